//! Every program that the project's code, tests, lab, benchmarks and xtask run, and where it
//! comes from. Provisioning installs what is missing from this table and then checks each
//! program with a PATH lookup (`command -v`); `tests::every_spawned_program_is_in_the_table`
//! scans the sources for the programs they spawn and fails on one that is not here.
//!
//! The test crate includes this file too (`ipoib_tests::programs`), so a helper that cannot
//! start a program names the package that brings it.
//!
//! Kept free of dependencies: plain data and two lookups.

/// Where a program comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A Debian package, installed by `apt-get` when the program is missing.
    Debian(&'static str),
    /// A PyPI package, installed by pip.
    Pypi(&'static str),
    /// Built by provisioning itself (bpf-linker against nightly's libLLVM).
    Built,
    /// The Rust toolchain that machines of this kind ship with (rustup, cargo, rustc).
    Toolchain,
}

/// When a program is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Builds, host tests, the lab, `cargo xtask run` on this kernel.
    Host,
    /// Only in the soft-RoCE VM (booting it, or what runs inside it).
    Vm,
}

#[derive(Debug, Clone, Copy)]
pub struct Program {
    pub name: &'static str,
    pub source: Source,
    pub scope: Scope,
    pub why: &'static str,
}

const fn deb(name: &'static str, pkg: &'static str, scope: Scope, why: &'static str) -> Program {
    Program {
        name,
        source: Source::Debian(pkg),
        scope,
        why,
    }
}

use Scope::{Host, Vm};

pub const PROGRAMS: &[Program] = &[
    // iproute2
    deb(
        "ip",
        "iproute2",
        Host,
        "netns, veth, addresses, links (the lab and the tests; ipoib-ctl itself speaks netlink)",
    ),
    deb(
        "ss",
        "iproute2",
        Host,
        "TCP socket state when a hybrid test fails",
    ),
    deb(
        "nstat",
        "iproute2",
        Host,
        "the stack's drop counters in the hybrid tests",
    ),
    deb(
        "tc",
        "iproute2",
        Host,
        "the qdiscs' drop counts the soak samples",
    ),
    deb(
        "rdma",
        "iproute2",
        Host,
        "creates soft-RoCE devices, counts RDMA resources",
    ),
    // util-linux, procps, coreutils: in the base image, listed so a missing one is named
    deb(
        "nsenter",
        "util-linux",
        Host,
        "runs a lab command in a node's namespace",
    ),
    deb(
        "setpriv",
        "util-linux",
        Host,
        "runs ipoib-ctl without privileges (exit-code test), and with only the unit's capabilities",
    ),
    deb(
        "dmesg",
        "util-linux",
        Host,
        "the kernel log when the verifier refuses a program, and the VM's kernel warnings",
    ),
    deb(
        "ps",
        "procps",
        Host,
        "the VM's watchdog: processes a hanging test waits on",
    ),
    deb(
        "sysctl",
        "procps",
        Host,
        "per-namespace network settings in the lab",
    ),
    deb(
        "uname",
        "coreutils",
        Host,
        "the kernel release in benchmark results and VM logs",
    ),
    deb("id", "coreutils", Host, "xtask: is this root"),
    deb(
        "timeout",
        "coreutils",
        Host,
        "the VM's test binaries, each within 45 minutes",
    ),
    deb(
        "sleep",
        "coreutils",
        Host,
        "the VM's watchdog: every 2 minutes",
    ),
    deb("bash", "bash", Host, "the VM's test script"),
    // what the tests add
    deb(
        "modprobe",
        "kmod",
        Host,
        "loads rdma_rxe (cm tests, cargo xtask run) and tun (VM)",
    ),
    deb(
        "prlimit",
        "util-linux",
        Host,
        "the unit's memlock limit, outside systemd, in the capability tests",
    ),
    deb(
        "unshare",
        "util-linux",
        Host,
        "a mount namespace for the journald test's journal and the systemd user manager",
    ),
    deb(
        "stat",
        "coreutils",
        Host,
        "JOURNAL_STREAM in the journald test",
    ),
    deb(
        "sh",
        "dash",
        Host,
        "the journald and systemd tests' scripts",
    ),
    deb(
        "mount",
        "mount",
        Host,
        "tmpfs and bind mounts in those scripts' mount namespaces",
    ),
    // the operator's side: the unit, the journal, the man pages
    deb(
        "systemd-analyze",
        "systemd",
        Host,
        "verifies the unit file (its package also brings systemd-journald for the log test)",
    ),
    deb(
        "journalctl",
        "systemd",
        Host,
        "reads what ipoib-ctl logged to journald",
    ),
    deb(
        "systemctl",
        "systemd",
        Host,
        "the unit under a systemd user manager (its package brings /lib/systemd/systemd); \
         xtask install: daemon-reload where systemd runs",
    ),
    deb(
        "prometheus-node-exporter",
        "prometheus-node-exporter",
        Host,
        "scrapes the metrics textfile in its test (the textfile collector, over HTTP)",
    ),
    deb(
        "promtool",
        "prometheus",
        Host,
        "checks and unit-tests the shipped alerting rules and the dashboard's queries",
    ),
    deb(
        "groff",
        "groff-base",
        Host,
        "renders the man pages in their test",
    ),
    // the packages: built with the distributions' own tools, installed into a fresh root
    deb(
        "dpkg-deb",
        "dpkg",
        Host,
        "builds the .deb; reads its fields in the package test",
    ),
    deb(
        "dpkg",
        "dpkg",
        Host,
        "the .deb's architecture; installs, upgrades and purges it in the package test's root",
    ),
    deb(
        "dpkg-shlibdeps",
        "dpkg-dev",
        Host,
        "the .deb's Depends: the packages of the libraries ipoib-ctl links",
    ),
    deb(
        "strip",
        "binutils",
        Host,
        "the packaged binary without its debug sections",
    ),
    deb(
        "readelf",
        "binutils",
        Host,
        "the libraries ipoib-ctl links, held against the .rpm's requirements",
    ),
    deb("rpmbuild", "rpm", Host, "builds the .rpm"),
    deb(
        "rpm",
        "rpm",
        Host,
        "the .rpm's file list, dependencies and scripts, and an upgrade, in the package test",
    ),
    deb(
        "mmdebstrap",
        "mmdebstrap",
        Host,
        "a fresh Debian root for the package test (the .deb's dependencies from the archive)",
    ),
    deb(
        "chroot",
        "coreutils",
        Host,
        "runs dpkg and ipoib-ctl in that root",
    ),
    deb("ping", "iputils-ping", Host, "ICMP over UD in the lab"),
    deb(
        "iperf3",
        "iperf3",
        Host,
        "a real bulk TCP flow in the lab and the benchmarks",
    ),
    deb(
        "ethtool",
        "ethtool",
        Host,
        "the lab interfaces' segmentation offload (off: datagram mode; on: a UD path that segments in the device), and the offloads of the UD stand-ins in the hop benchmark",
    ),
    deb(
        "bpftool",
        "bpftool",
        Host,
        "programs and maps as the kernel shows them (BTF names)",
    ),
    deb("apt-get", "apt", Host, "provisioning"),
    deb(
        "dpkg-query",
        "dpkg",
        Host,
        "provisioning: is a build dependency installed",
    ),
    deb("python3", "python3", Vm, "pip installs virtme-ng"),
    // the VM
    deb(
        "qemu-system-x86_64",
        "qemu-system-x86",
        Vm,
        "boots the VM (run by vng)",
    ),
    deb(
        "busybox",
        "busybox-static",
        Vm,
        "virtme-ng's init inside the VM",
    ),
    deb(
        "ibv_devinfo",
        "ibverbs-utils",
        Vm,
        "what discovery is checked against",
    ),
    deb(
        "ib_send_bw",
        "perftest",
        Vm,
        "the RC throughput baseline in the benchmarks",
    ),
    deb(
        "nft",
        "nftables",
        Vm,
        "blocks the handshake port in a fault test; holds the VM's input hook for a boot",
    ),
    Program {
        name: "vng",
        source: Source::Pypi("virtme-ng==1.42"),
        scope: Vm,
        why: "boots Debian's 6.1 kernel with the host's filesystem",
    },
    Program {
        name: "bpf-linker",
        source: Source::Built,
        scope: Host,
        why: "links the eBPF programs",
    },
    Program {
        name: "rustup",
        source: Source::Toolchain,
        scope: Host,
        why: "nightly for the eBPF crate",
    },
    Program {
        name: "rustc",
        source: Source::Toolchain,
        scope: Host,
        why: "the nightly sysroot's libLLVM",
    },
    Program {
        name: "cargo",
        source: Source::Toolchain,
        scope: Host,
        why: "builds",
    },
];

/// The table's row for `name`.
pub fn program(name: &str) -> Option<&'static Program> {
    PROGRAMS.iter().find(|p| p.name == name)
}

/// Where `name` is on PATH (what `command -v` finds), if anywhere.
pub fn on_path(name: &str) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// "`modprobe` is not installed: it comes with Debian package kmod (`cargo xtask provision`
/// installs it)", or the like for a program outside the table.
pub fn missing_message(name: &str) -> String {
    let from = match program(name).map(|p| (p.source, p.scope)) {
        Some((Source::Debian(pkg), Scope::Host)) => {
            format!("it comes with Debian package {pkg} (`cargo xtask provision` installs it)")
        }
        Some((Source::Debian(pkg), Scope::Vm)) => {
            format!("it comes with Debian package {pkg} (`cargo xtask provision --vm` installs it)")
        }
        Some((Source::Pypi(pkg), _)) => {
            format!("it comes with PyPI package {pkg} (`cargo xtask provision --vm` installs it)")
        }
        Some((Source::Built, _)) => "`cargo xtask provision` builds it".into(),
        Some((Source::Toolchain, _)) => "it comes with the Rust toolchain (rustup)".into(),
        None => "it is not in xtask/src/provision/programs.rs, so nothing installs it".into(),
    };
    format!("`{name}` is not installed: {from}")
}
