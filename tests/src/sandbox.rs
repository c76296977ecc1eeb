//! The shipped unit's privileges outside systemd: its capability bounding set, no new
//! privileges and its memlock limit, applied to `ipoib-ctl` by a wrapper script in the order
//! systemd applies them (the limit first, then the capabilities go, then the exec). The lab
//! runs the wrapper as its `ipoib-ctl` ([`crate::lab::Lab::run_ctl`]).

use std::path::{Path, PathBuf};

use crate::lab::ctl_path;

/// The unit as the repository ships it.
pub fn unit_text() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ipoib-ctl/ipoib-ctl@.service");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The unit's `CapabilityBoundingSet=`, as setpriv names them (`bpf`, `net_admin`).
pub fn unit_capabilities() -> Vec<String> {
    let text = unit_text();
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit sets CapabilityBoundingSet=");
    line.split_whitespace()
        .map(|c| c.trim_start_matches("CAP_").to_ascii_lowercase())
        .collect()
}

/// The unit's capabilities that only connected mode asks for: the engine's raw sockets to UD
/// (`net_raw`). Attaching without an RDMA device needs none of them; the VM's confined test
/// (`connected_mode_runs_with_only_the_units_capabilities`) finds the sockets made.
pub const CONNECTED_MODE_ONLY: &[&str] = &["net_raw"];

/// A script at `path` that runs this build's `ipoib-ctl` with only `caps` and no new
/// privileges, under the unit's `LimitMEMLOCK=` (which must be `infinity`) where it can be
/// raised.
pub fn wrapper(path: &Path, caps: &[String]) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    assert!(
        unit_text().lines().any(|l| l == "LimitMEMLOCK=infinity"),
        "the unit's memlock limit is no longer infinity: the wrapper would not be the unit"
    );
    let bounding: String = caps.iter().map(|c| format!(",+{c}")).collect();
    // The limit where this process may raise it; a machine whose root lacks
    // CAP_SYS_RESOURCE (this workplace's) keeps the limit it has, as a user manager does.
    let script = format!(
        "#!/bin/sh\nprlimit --pid $$ --memlock=unlimited:unlimited 2>/dev/null || true\n\
         exec setpriv --no-new-privs --bounding-set=-all{bounding} --inh-caps=-all -- {} \"$@\"\n",
        ctl_path().display()
    );
    std::fs::create_dir_all(path.parent().expect("a directory")).unwrap();
    std::fs::write(path, script).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_owned()
}

/// bpffs at /sys/fs/bpf, as systemd mounts it at boot (`sys-fs-bpf.mount`) before any unit
/// starts: the confined daemon may not mount it (that takes CAP_SYS_ADMIN), and a fresh VM
/// has none until the first unconfined attach.
pub fn bpffs_mounted() {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    if mounts
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf") && l.contains(" bpf "))
    {
        return;
    }
    let out = std::process::Command::new("mount")
        .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
        .output()
        .unwrap();
    assert!(out.status.success(), "mounting bpffs: {out:?}");
}
