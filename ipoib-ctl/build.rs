//! Builds the eBPF object (nightly, `bpfel-unknown-none`, `-Z build-std=core`, BTF) with
//! aya-build and leaves it in OUT_DIR, where `src/datapath.rs` embeds it.
use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
    let metadata = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let ebpf = metadata
        .packages
        .into_iter()
        .find(|p| p.name.as_str() == "ipoib-ebpf")
        .ok_or_else(|| anyhow!("ipoib-ebpf package not found in the workspace"))?;
    let root = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", ebpf.manifest_path))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: ebpf.name.as_str(),
            root_dir: root.as_str(),
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
