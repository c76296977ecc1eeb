//! Project tasks that are not builds. `cargo xtask --help` lists them.
//!
//! Everything a fresh machine lacks is installed by `provision`, which every other task runs
//! first; it is idempotent and a second run does nothing.

mod provision;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "ipoib-hybrid project tasks",
    after_help = "Examples:\n  cargo xtask run            the two-node lab (or attach to ib0 where it exists)\n  \
                  cargo xtask provision      install what builds and tests need\n  \
                  cargo xtask test           provision, then run every test (CI runs this)\n  \
                  cargo xtask bench datapath ns/packet of each program vs a trivial one\n  \
                  cargo xtask bench verbs    RC message rate vs ib_send_bw on soft-RoCE (VM)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The main job: attach to the IPoIB interface if there is one; otherwise build the
    /// two-node lab, attach both ends, send real traffic, show live status, tear down.
    Run {
        /// Seconds of bulk TCP in the lab.
        #[arg(long, default_value_t = 6)]
        duration: u32,
        /// Print the final status of both lab nodes as JSON too.
        #[arg(long)]
        json: bool,
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
        /// Extra arguments for `cargo test` (after `--`), e.g. a test name filter.
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Boot Debian's 6.1 kernel in a VM (qemu, software emulation) and run the kernel, lab and
    /// verbs tests inside it: the programs must verify and behave the same on the older kernel
    /// (egress attaches through netlink clsact there), and verbs run on soft-RoCE.
    VmTest {
        /// Only these test targets (fastpath, lab, verbs, cm, engine); all by default.
        targets: Vec<String>,
    },
    /// Benchmarks (commands, not timed tests): results printed and saved under target/bench.
    Bench {
        #[command(subcommand)]
        what: Bench,
    },
}

#[derive(Subcommand)]
enum Bench {
    /// ns per packet of each eBPF program through BPF_PROG_TEST_RUN, beside a trivial program
    /// of the same type in the same run.
    Datapath {
        /// Runs per measurement (the kernel reports the mean).
        #[arg(long, default_value_t = 1_000_000)]
        repeat: u32,
        /// Interleaved rounds; the median is reported.
        #[arg(long, default_value_t = 5)]
        rounds: u32,
    },
    /// In the soft-RoCE VM: message throughput over 1 RC connection and over N sharing one
    /// SRQ, beside perftest's ib_send_bw on the same device in the same run, as ratios.
    Verbs {
        /// Message size in bytes.
        #[arg(long, default_value_t = 65520)]
        size: u32,
        /// Seconds per measurement.
        #[arg(long, default_value_t = 3)]
        seconds: u32,
        /// Interleaved rounds; the median is reported.
        #[arg(long, default_value_t = 3)]
        rounds: u32,
        /// Connections of the many-connection case.
        #[arg(long, default_value_t = 16)]
        qps: u32,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.cmd {
        Cmd::Run { duration, json } => run(&root, duration, json),
        Cmd::Provision { vm } => provision::run(provision::Scope { vm }),
        Cmd::Test { no_vm, args } => {
            test(&root, &args)?;
            if no_vm {
                println!("==> skipping the 6.1 VM run (--no-vm)");
                Ok(())
            } else {
                vm::test(&root, &[])
            }
        }
        Cmd::VmTest { targets } => vm::test(&root, &targets),
        Cmd::Bench {
            what: Bench::Datapath { repeat, rounds },
        } => {
            provision::run(provision::Scope::default())?;
            let out = root.join("target/bench/datapath.json");
            cargo(&root)
                .args([
                    "run",
                    "--release",
                    "-q",
                    "-p",
                    "ipoib-tests",
                    "--bin",
                    "bench-datapath",
                ])
                .arg("--")
                .args([
                    "--repeat",
                    &repeat.to_string(),
                    "--rounds",
                    &rounds.to_string(),
                ])
                .arg("--out")
                .arg(&out)
                .status_ok("bench-datapath")
        }
        Cmd::Bench {
            what:
                Bench::Verbs {
                    size,
                    seconds,
                    rounds,
                    qps,
                },
        } => bench_verbs(&root, size, seconds, rounds, qps),
    }
}

/// Builds the benchmark and its peer in release mode, runs them in the VM, and saves the
/// JSON line the benchmark prints to target/bench/verbs.json.
fn bench_verbs(root: &Path, size: u32, seconds: u32, rounds: u32, qps: u32) -> Result<()> {
    if !is_root() {
        bail!("the verbs benchmark needs root (it boots the VM and builds a network namespace)");
    }
    provision::run(provision::Scope { vm: true })?;
    cargo(root)
        .args(["build", "--release", "-q", "-p", "ipoib-ctl", "--bins"])
        .status_ok("cargo build ipoib-ctl")?;
    cargo(root)
        .args(["build", "--release", "-q", "-p", "ipoib-tests"])
        .args(["--bin", "bench-verbs", "--bin", "cm-node"])
        .status_ok("cargo build bench-verbs")?;
    let exe = root.join("target/release/bench-verbs");
    let script = format!(
        "set -eu; echo '==> bench-verbs on '$(uname -r); {} --size {size} --seconds {seconds} --rounds {rounds} --qps {qps}",
        exe.display()
    );
    let mut result = None;
    vm::run(root, &script, |line| {
        if let Some(j) = line.strip_prefix("BENCH-JSON ") {
            result = Some(j.to_string());
        }
    })
    .context("the verbs benchmark failed in the VM")?;
    let json = result.context("the benchmark printed no result")?;
    let out = root.join("target/bench/verbs.json");
    std::fs::create_dir_all(out.parent().unwrap())?;
    std::fs::write(&out, json + "\n")?;
    println!("==> saved {}", out.display());
    Ok(())
}

fn workspace_root() -> PathBuf {
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

fn run(root: &Path, duration: u32, json: bool) -> Result<()> {
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
    let mut c = Command::new(root.join("target/debug/ipoib-lab"));
    c.args(["--duration", &duration.to_string()]);
    if json {
        c.arg("--json");
    }
    c.status_ok("ipoib-lab")
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
