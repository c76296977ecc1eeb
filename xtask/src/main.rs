//! Project tasks that are not builds. `cargo xtask --help` lists them.
//!
//! Everything a fresh machine lacks is installed by `provision`, which every other task runs
//! first; it is idempotent and a second run does nothing.

mod bench;
mod fuzz;
mod install;
mod package;
mod provision;
mod shape;
mod slow;
#[cfg(test)]
mod spawned;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use bench::Bench;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "ipoib-hybrid project tasks",
    after_help = "Examples:\n  cargo xtask run            the two-node lab (or attach to ib0 where it exists)\n  \
                  cargo xtask provision      install what builds and tests need\n  \
                  cargo xtask install        ipoib-ctl, its systemd unit, completions and man pages\n  \
                  cargo xtask package        a .deb and an .rpm of ipoib-ctl (target/package)\n  \
                  cargo xtask test           provision, then run every test (CI runs this)\n  \
                  cargo xtask fuzz           every decoder under libFuzzer, 10 minutes in all\n  \
                  cargo xtask soak           faults from a seeded schedule under load, in the VM\n  \
                  cargo xtask bench datapath ns/packet of each program vs a trivial one\n  \
                  cargo xtask bench hop      TCP through the engine's hop (3 designs) vs stand-ins for UD\n  \
                  cargo xtask bench tick     the policy's tick at 4096 peers (release)\n  \
                  cargo xtask bench verbs    RC message rate vs ib_send_bw on soft-RoCE (VM)\n  \
                  cargo xtask bench engine   TCP over CM (SRQ, rings) vs UD between the lab's nodes (VM)\n  \
                  cargo xtask bench lanes    the CM engine on one lane vs two (TUN queues, threads) (VM)\n  \
                  cargo xtask bench memory   receive memory against peers: SRQ, rings, the kernel (VM)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The main job: attach to the IPoIB interface if there is one; otherwise the two-node lab
    /// with connected mode on soft-RoCE (in the VM where this kernel has no RDMA): ping on UD,
    /// a bulk flow promoted to CM, a fault and the fallback, live status, teardown.
    Run {
        /// Seconds of bulk TCP in the lab (at least 30 with connected mode: promotion, two
        /// faults, each with the fallback and the return).
        #[arg(long, default_value_t = 6)]
        duration: u32,
        /// Print the final status of both lab nodes as JSON too.
        #[arg(long)]
        json: bool,
        /// Where this kernel has no RDMA: run the lab here with a stand-in for the CM device
        /// instead of booting the soft-RoCE VM.
        #[arg(long)]
        no_vm: bool,
    },
    /// Build ipoib-ctl (release) and install it with its systemd unit, shell completions and
    /// man pages.
    #[command(after_help = "Examples:\n  cargo xtask install\n  \
                            cargo xtask install --destdir /tmp/pkg --prefix /usr")]
    Install {
        /// Staging root prepended to every path (for a package); `/` installs for real.
        #[arg(long, default_value = "/")]
        destdir: PathBuf,
        /// Prefix of the binary and its shared files (PREFIX/sbin, PREFIX/share).
        #[arg(long, default_value = "/usr/local")]
        prefix: PathBuf,
    },
    /// Build ipoib-ctl (release) and pack it as a .deb and an .rpm (dpkg-deb, rpmbuild): the
    /// binary, the unit, man pages, completions, an example policy (a configuration file),
    /// the alerting rules, the dashboard and the docs.
    #[command(after_help = "Examples:\n  cargo xtask package\n  \
                            cargo xtask package --out /tmp/pkgs --release 2")]
    Package {
        /// Where the packages go (default: target/package in the workspace).
        #[arg(long)]
        out: Option<PathBuf>,
        /// The packages' revision (the version is the binary's own).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        release: u32,
    },
    /// Install the toolchain parts and Debian packages the project needs (idempotent).
    Provision {
        /// Also what the soft-RoCE VM needs (qemu, Debian's kernel, rdma-core, virtme-ng).
        #[arg(long)]
        vm: bool,
    },
    /// Provision, then run fmt, clippy and every test. Needs root for the kernel tests.
    Test {
        /// Skip the run on Debian's 6.1 kernel in the VM (CI does not skip it).
        #[arg(long)]
        no_vm: bool,
        /// The VM run in the slow-machine mode: the VM held to 2/FACTOR CPUs (a cgroup's CPU
        /// quota), as slow as CI's slowest machines (2.5 when given no value).
        #[arg(long, value_name = "FACTOR", num_args = 0..=1, default_missing_value = "2.5")]
        slow: Option<f64>,
        /// Extra arguments for `cargo test` (after `--`), e.g. a test name filter.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Boot Debian's 6.1 kernel in a VM (qemu, software emulation) and run the kernel, lab and
    /// verbs tests inside it: the programs must verify and behave the same on the older kernel
    /// (egress attaches through netlink clsact there), and verbs run on soft-RoCE.
    VmTest {
        /// Only these test targets (fastpath, lab, netlink, upgrade, verbs, cm, engine, hybrid); all by default.
        targets: Vec<String>,
        /// Only the tests whose names contain this (libtest's filter), in every target run;
        /// repeat for several.
        #[arg(long, value_name = "SUBSTRING")]
        filter: Vec<String>,
        /// The slow-machine mode: the VM held to 2/FACTOR CPUs (a cgroup's CPU quota), as
        /// slow as CI's slowest machines (2.5 when given no value).
        #[arg(long, value_name = "FACTOR", num_args = 0..=1, default_missing_value = "2.5")]
        slow: Option<f64>,
        /// The long run, before a release: every scenario on both receive models, and the
        /// full rounds of those the suite runs shorter.
        #[arg(long)]
        long: bool,
    },
    /// Every fuzz target (fuzz/: the handshake, the policy language, the CM status file, the
    /// sysfs readers, the neighbour address) in turn under libFuzzer (cargo-fuzz, nightly,
    /// installed when missing): executions and findings per target, saved in target/fuzz.
    #[command(after_help = "Examples:\n  cargo xtask fuzz\n  \
                            cargo xtask fuzz --time 60 --target policy")]
    Fuzz {
        /// Seconds in all, shared between the targets.
        #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..))]
        time: u64,
        /// Only this target (repeat for more).
        #[arg(long)]
        target: Vec<String>,
    },
    /// The seeded chaos soak in the VM: three nodes, bulk TCP and numbered UDP promoted to CM
    /// while faults come every 5 to 30 s (kill -9, SIGSTOP, the RC link, the handshake port
    /// blocked, an engine paused, policy changes, detach and attach), on rings, then on an
    /// SRQ: the flows intact, losses only around faults, every resource flat.
    #[command(after_help = "Examples:\n  cargo xtask soak --minutes 30\n  \
                            cargo xtask soak --minutes 3 --seed 1234   (replays a run's faults)")]
    Soak {
        /// Minutes on each receive model.
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=600))]
        minutes: u64,
        /// The schedule's seed (a run prints its own).
        #[arg(long)]
        seed: Option<u64>,
        /// The slow-machine mode, as for vm-test (2.5 when given no value).
        #[arg(long, value_name = "FACTOR", num_args = 0..=1, default_missing_value = "2.5")]
        slow: Option<f64>,
        /// Only one receive model: rings or srq.
        #[arg(long, value_parser = ["rings", "srq"])]
        model: Option<String>,
        /// The control loops' log level (RUST_LOG: info, debug, trace), for a replay.
        #[arg(long, value_parser = ["info", "debug", "trace"])]
        log: Option<String>,
        /// Pace each stream to MIBS MiB/s, in mode `connected` (under `auto`'s promotion
        /// rate); unpaced, in mode `auto`, when not given (the streams then take all the CPU).
        #[arg(long, value_name = "MIBS", value_parser = clap::value_parser!(u64).range(1..))]
        rate: Option<u64>,
        /// Where the nodes' receive programs run (`attach --ingress`): auto is XDP on the
        /// lab's veths; tc is the hook they have on IPoIB.
        #[arg(long, value_parser = ["auto", "xdp", "tc"])]
        ingress: Option<String>,
    },
    /// The code's shape: ipoib-ctl's modules import in one direction, no source file over 800
    /// lines outside its tests, README.md under 300 lines.
    Shape,
    /// Benchmarks (commands, not timed tests): results printed and saved under target/bench.
    Bench {
        #[command(subcommand)]
        what: Bench,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.cmd {
        Cmd::Run {
            duration,
            json,
            no_vm,
        } => run(&root, duration, json, no_vm),
        Cmd::Provision { vm } => provision::run(provision::Scope { vm }),
        Cmd::Shape => shape::run(&root),
        Cmd::Fuzz { time, target } => fuzz::run(&root, time, &target),
        Cmd::Install { destdir, prefix } => {
            provision::run(provision::Scope { vm: false })?;
            install::run(
                &root,
                &install::Layout {
                    destdir,
                    prefix,
                    unit_dir: PathBuf::from("/etc/systemd/system"),
                },
            )
        }
        Cmd::Package { out, release } => {
            provision::run(provision::Scope { vm: false })?;
            let out = std::path::absolute(out.unwrap_or_else(|| root.join("target/package")))?;
            std::fs::create_dir_all(&out)?;
            package::run(&root, &out, release)
        }
        Cmd::Test { no_vm, slow, args } => {
            test(&root, &args)?;
            if no_vm {
                println!("==> skipping the 6.1 VM run (--no-vm)");
                Ok(())
            } else {
                vm::test(
                    &root,
                    &vm::Run {
                        slow,
                        ..vm::Run::default()
                    },
                )
            }
        }
        Cmd::VmTest {
            targets,
            filter,
            slow,
            long,
        } => vm::test(
            &root,
            &vm::Run {
                targets,
                filters: filter,
                slow,
                long,
                env: Vec::new(),
            },
        ),
        Cmd::Soak {
            minutes,
            seed,
            slow,
            model,
            log,
            rate,
            ingress,
        } => {
            let mut env = vec![("IPOIB_SOAK_SECS".to_string(), (minutes * 60).to_string())];
            if let Some(r) = rate {
                env.push(("IPOIB_SOAK_RATE".into(), r.to_string()));
            }
            if let Some(s) = seed {
                env.push(("IPOIB_SOAK_SEED".into(), s.to_string()));
            }
            if let Some(l) = log {
                env.push(("IPOIB_SOAK_LOG".into(), l));
            }
            if let Some(i) = ingress {
                env.push(("IPOIB_SOAK_INGRESS".into(), i));
            }
            vm::test(
                &root,
                &vm::Run {
                    targets: vec!["hybrid".into()],
                    filters: vec![match model.as_deref() {
                        Some("rings") => "the_soak_on_rings".into(),
                        Some(_) => "the_soak_on_an_srq".into(),
                        None => "the_soak_on".into(),
                    }],
                    env,
                    slow,
                    // The soak's tests are ignored in the suite.
                    long: true,
                },
            )
        }
        Cmd::Bench { what } => bench::run(&root, what),
    }
}

pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

pub(crate) fn cargo(root: &Path) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root);
    c
}

/// `cargo +nightly`, through rustup (not the cargo that runs xtask, which is stable).
fn cargo_nightly(dir: &Path) -> Command {
    let mut c = Command::new("rustup");
    c.args(["run", "nightly", "cargo"]).current_dir(dir);
    for v in ["CARGO", "RUSTC", "RUSTUP_TOOLCHAIN", "RUSTC_WRAPPER"] {
        c.env_remove(v);
    }
    c
}

pub(crate) trait StatusOk {
    fn status_ok(&mut self, what: &str) -> Result<()>;
}

impl StatusOk for Command {
    fn status_ok(&mut self, what: &str) -> Result<()> {
        let status = self
            .status()
            .with_context(|| format!("could not start {what}"))?;
        if !status.success() {
            bail!("{what} failed ({status})");
        }
        Ok(())
    }
}

pub(crate) fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn run(root: &Path, duration: u32, json: bool, no_vm: bool) -> Result<()> {
    if !is_root() {
        bail!("cargo xtask run needs root: it loads eBPF programs and builds network namespaces");
    }
    provision::run(provision::Scope::default())?;
    cargo(root)
        .args([
            "build",
            "-q",
            "-p",
            "ipoib-ctl",
            "-p",
            "ipoib-tests",
            "--bins",
        ])
        .status_ok("cargo build")?;
    let lab = root.join("target/debug/ipoib-lab");
    let mut args = vec!["--duration".to_string(), duration.to_string()];
    if json {
        args.push("--json".into());
    }
    let ipoib = std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| std::fs::read_to_string(e.path().join("type")).is_ok_and(|t| t.trim() == "32"));
    // Connected mode needs verbs: a real HCA, or soft-RoCE where this kernel has it.
    let rdma_here = Command::new("modprobe")
        .args(["-q", "rdma_rxe"])
        .status()
        .is_ok_and(|s| s.success())
        || Path::new("/sys/class/infiniband")
            .read_dir()
            .is_ok_and(|mut d| d.next().is_some());
    if ipoib || rdma_here || no_vm {
        if !ipoib && rdma_here {
            args.push("--rdma".into());
        } else if !ipoib {
            println!(
                "==> no RDMA here and --no-vm: the lab with a stand-in for the CM device (no connected mode)"
            );
        }
        return Command::new(lab).args(&args).status_ok("ipoib-lab");
    }
    println!(
        "==> no RDMA on this kernel: the demo runs in the soft-RoCE VM (Debian 6.1, rdma_rxe)"
    );
    provision::run(provision::Scope { vm: true })?;
    let script = format!(
        "set -eu; modprobe tun; echo '==> ipoib-lab on '$(uname -r); {} --rdma {}",
        lab.display(),
        args.join(" ")
    );
    vm::run(root, &script, None, |_| {})
}

fn test(root: &Path, args: &[String]) -> Result<()> {
    provision::run(provision::Scope::default())?;
    println!("==> cargo fmt --check");
    cargo(root)
        .args(["fmt", "--all", "--check"])
        .status_ok("cargo fmt --check")?;
    println!("==> cargo clippy -D warnings (userspace, stable)");
    cargo(root)
        .args([
            "clippy",
            "--workspace",
            "--exclude",
            "ipoib-ebpf",
            "--all-targets",
            "-q",
        ])
        .args(["--", "-D", "warnings"])
        .status_ok("cargo clippy")?;
    println!("==> cargo clippy -D warnings (eBPF, nightly, bpfel-unknown-none)");
    cargo_nightly(&root.join("ipoib-ebpf"))
        .args([
            "clippy",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .args(["-q", "--", "-D", "warnings"])
        .status_ok("cargo clippy (eBPF)")?;
    // The lab tests run the real ipoib-ctl binary, which `cargo test` alone does not build.
    println!("==> cargo build --bins (ipoib-ctl, for the lab tests)");
    cargo(root)
        .args(["build", "-q", "-p", "ipoib-ctl", "--bins"])
        .status_ok("cargo build ipoib-ctl")?;
    let mut c = cargo(root);
    // The eBPF crate only builds for its own target; ipoib-ctl's build script builds it.
    c.args(["test", "--workspace", "--exclude", "ipoib-ebpf"]);
    if is_root() {
        // CI is root: a test that needs BPF must run, never skip.
        c.env("IPOIB_REQUIRE_BPF", "1");
    } else {
        eprintln!(
            "!!! not root: tests that need BPF will SKIP loudly. CI runs as root and runs them all."
        );
    }
    if !args.is_empty() {
        c.arg("--").args(args);
    }
    println!("==> cargo test --workspace");
    c.status_ok("cargo test")
}
