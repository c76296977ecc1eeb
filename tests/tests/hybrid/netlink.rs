//! Netlink: connected mode follows the interface's addresses and gso_max_size over netlink,
//! and runs no program.

use super::*;

/// `ip -j ARGS` in node `n`'s namespace, parsed.
fn ip_json(n: &Node, args: &[&str]) -> serde_json::Value {
    let out = n.cmd("ip").arg("-j").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn gso_max_size(n: &Node) -> u64 {
    ip_json(n, &["-d", "link", "show", "dev", &n.iface])[0]["gso_max_size"]
        .as_u64()
        .expect("gso_max_size")
}

fn ipv4_on(n: &Node, dev: &str) -> Vec<String> {
    ip_json(n, &["-4", "addr", "show", "dev", dev])[0]["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]))
        .collect()
}

/// The daemon speaks netlink, not `ip`: A's runs with a PATH that holds only `nsenter` (the
/// lab enters its namespace with it), so any program it tried to run would fail; connected
/// mode still comes up and carries a stream. Meanwhile its TUN device holds the interface's
/// IPv4 addresses (loose rp_filter) as they change, an address added and one removed, and
/// the interface's gso_max_size is 65000 while attached and what it was once detached.
#[test]
fn connected_mode_follows_the_interface_over_netlink_and_runs_no_program() {
    let test = "connected_mode_follows_the_interface_over_netlink_and_runs_no_program";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hnl", 2) else {
        return;
    };
    let (a, b) = (lab.a.clone(), lab.b.clone());
    steps.step(
        "A attached with a PATH of nsenter only: gso_max_size 65000, its address on the TUN device",
    );
    loose_rp_filter(&[&a, &b]);
    let gso_before = gso_max_size(&a);
    let bin = std::env::temp_dir().join("hnl-path");
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::create_dir_all(&bin).unwrap();
    let nsenter = ipoib_tests::programs::on_path("nsenter").expect("nsenter on PATH");
    std::os::unix::fs::symlink(&nsenter, bin.join("nsenter")).unwrap();
    lab.attach_node_env(
        &a,
        &["--cm-device", &dev],
        &[("PATH", bin.to_str().unwrap())],
    )
    .unwrap();
    attach(&mut lab, Which::B, Recv::Srq, &dev, &[]);
    let tun = cm_of(&a).tun;
    let own = format!("{}/32", a.ip4);
    let gso_during = gso_max_size(&a);
    eprintln!(
        "A's {}: gso_max_size {gso_before} before attach, {gso_during} attached; {tun}: {:?}",
        a.iface,
        ipv4_on(&a, &tun)
    );
    assert_eq!(gso_during, 65000);
    assert_eq!(ipv4_on(&a, &tun), std::slice::from_ref(&own));

    steps.step("a bulk stream promoted to CM");
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5395);
    a.wait_peer_mode(&b_ip, PeerModeView::CmUp, Duration::from_secs(15))
        .unwrap_or_else(|| panic!("not promoted: {:#?}\n{}", cm_of(&a), ctl_log(&a)));
    steps.step("an address added to A's interface and removed: the TUN device follows");
    // An address added to the interface, then the first one removed and put back.
    let extra = "10.79.0.1";
    let addr_on_a = |change: &str, addr: &str| {
        let args = ["addr", change, addr, "dev", &a.iface];
        let out = a.cmd("ip").args(args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}");
    };
    addr_on_a("add", &format!("{extra}/24"));
    let both = [own.clone(), format!("{extra}/32")];
    let t = Instant::now();
    let added = wait_until(Duration::from_secs(5), || ipv4_on(&a, &tun) == both);
    eprintln!(
        "{extra} on {tun} after {:.0?}: {:?}",
        t.elapsed(),
        ipv4_on(&a, &tun)
    );
    assert!(added, "{:?}\n{}", ipv4_on(&a, &tun), ctl_log(&a));
    addr_on_a("del", &format!("{extra}/24"));
    let t = Instant::now();
    let removed = wait_until(Duration::from_secs(5), || {
        ipv4_on(&a, &tun) == [own.clone()]
    });
    eprintln!("{extra} off {tun} after {:.0?}", t.elapsed());
    assert!(removed, "{:?}\n{}", ipv4_on(&a, &tun), ctl_log(&a));
    steps.step("the stream intact, over CM");
    let sent = stream.finish();
    let p = a.peer(&b_ip).unwrap().expect("A knows B");
    eprintln!(
        "{} MiB intact, {} MiB of it over CM",
        sent >> 20,
        p.traffic.tx_cm_bytes >> 20
    );
    assert!(p.traffic.tx_cm_bytes > 1 << 20, "{p:?}");

    steps.step("A detached: gso_max_size as it was");
    let out = a.ctl(&["detach", &a.iface]).unwrap();
    assert!(out.status.success());
    let restored = wait_until(Duration::from_secs(10), || gso_max_size(&a) == gso_before);
    let log = ctl_log(&a);
    eprintln!(
        "after detach: gso_max_size {}; A's log on it:\n{}",
        gso_max_size(&a),
        log.lines()
            .filter(|l| l.contains("gso_max_size") || l.contains(&tun))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(restored, "gso_max_size not restored\n{log}");
    let _ = std::fs::remove_dir_all(&bin);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}
