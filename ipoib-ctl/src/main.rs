fn main() -> anyhow::Result<()> {
    let dp = ipoib_ctl::datapath::Datapath::load()?;
    println!("loaded; policy {:?}", dp.maps.policy()?);
    Ok(())
}
