//! `cargo xtask bench NAME [OPTIONS]`: builds benchmark NAME (`tests/src/bin/bench-NAME`),
//! runs it where it runs (this machine's kernel or the soft-RoCE VM) with OPTIONS passed on as
//! given, and saves the JSON result it prints under target/bench. The options are the
//! benchmark's own, defined once in its binary: `cargo xtask bench NAME --help` prints them.

use std::path::Path;

use anyhow::{Context as _, Result, bail};
use clap::Subcommand;

use crate::{StatusOk as _, cargo, is_root, provision, vm};

/// A benchmark's options, passed on to it as given.
#[derive(clap::Args)]
pub struct Options {
    /// The benchmark's options (`--help` lists them). Paths in them are taken from the
    /// workspace's root, where the benchmark runs (in the VM too).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<String>,
}

#[derive(Subcommand)]
pub enum Bench {
    /// ns per packet of each eBPF program through BPF_PROG_TEST_RUN, beside a trivial program
    /// of the same type in the same run.
    #[command(disable_help_flag = true)]
    Datapath(Options),
    /// In the soft-RoCE VM: message throughput over 1 RC connection and over N sharing one
    /// SRQ, beside perftest's ib_send_bw on the same device in the same run, as ratios.
    #[command(disable_help_flag = true)]
    Verbs(Options),
    /// In the VM: TCP throughput between the lab's nodes on CM (engine over rxe) and on UD,
    /// interleaved in one boot, with CPU time per byte of each path.
    #[command(disable_help_flag = true)]
    Engine(Options),
    /// In the VM: the CM engine on one lane against two (a TUN queue, a CQ and a thread each),
    /// TCP to two addresses of the peer at once, each over a connection of its own,
    /// interleaved in one boot: Gbit/s and CPU seconds per GB.
    #[command(disable_help_flag = true)]
    Lanes(Options),
    /// On this machine's kernel (root): TCP between two namespaces through the engine's TUN
    /// hop (two TUN devices and a relay: read and write, io_uring, a packet-mmap ring), over
    /// the kernel's UD stand-ins and a plain veth, 1 and N streams, interleaved: Gbit/s, CPU
    /// seconds per GB, the relay's system calls per packet. `--vm`: on the VM's 6.1 instead.
    #[command(disable_help_flag = true)]
    Hop(Options),
    /// The receive hook for IPoIB (root): TCP through a veth with GRO, forced into generic
    /// XDP, against TC ingress and no program, at MTU 2044 and 4092, interleaved: Gbit/s and
    /// CPU seconds per GB. `--vm`: on the VM's 6.1 instead of this machine's kernel.
    #[command(disable_help_flag = true)]
    Hook(Options),
    /// Connected mode's once-a-second tick (the promotion policy and what the node holds) at
    /// thousands of peers, release build: median, p99 and slowest tick.
    #[command(disable_help_flag = true)]
    Tick(Options),
    /// In the VM: receive memory registered against connected peers (1, K, 3K) with an SRQ and
    /// with a ring per connection (the kernel's view), beside the kernel's formula and the
    /// plan for 4096 peers.
    #[command(disable_help_flag = true)]
    Memory(Options),
}

/// Where a benchmark runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// On this machine's kernel; `root_for`: why it needs root, if it does; `packages`:
    /// whether it needs the machine's packages (`provision`: bpftool, iperf3, ...).
    Host {
        root_for: Option<&'static str>,
        packages: bool,
    },
    /// In the soft-RoCE VM.
    Vm,
}

/// What xtask knows of one benchmark: its binary's name (`bench-NAME`), where it runs,
/// whether `--vm` moves it into the VM, and whether it runs `ipoib-ctl`.
struct Spec {
    name: &'static str,
    place: Place,
    vm_too: bool,
    runs_ctl: bool,
}

impl Bench {
    fn split(self) -> (Spec, Vec<String>) {
        let host = |root_for| Place::Host {
            root_for,
            packages: true,
        };
        let spec = |name, place, vm_too, runs_ctl| Spec {
            name,
            place,
            vm_too,
            runs_ctl,
        };
        match self {
            Bench::Datapath(o) => (spec("datapath", host(None), false, false), o.args),
            Bench::Verbs(o) => (spec("verbs", Place::Vm, false, true), o.args),
            Bench::Engine(o) => (spec("engine", Place::Vm, false, true), o.args),
            Bench::Lanes(o) => (spec("lanes", Place::Vm, false, true), o.args),
            Bench::Memory(o) => (spec("memory", Place::Vm, false, true), o.args),
            // bench-hop asks `ipoib-ctl caps` for an RDMA device (its packet ring's
            // registration).
            Bench::Hop(o) => (
                spec(
                    "hop",
                    host(Some("network namespaces, TUN and veth devices")),
                    true,
                    true,
                ),
                o.args,
            ),
            Bench::Hook(o) => (
                spec(
                    "hook",
                    host(Some("network namespaces, veth, eBPF")),
                    true,
                    false,
                ),
                o.args,
            ),
            // A pure computation: no package.
            Bench::Tick(o) => (
                spec(
                    "tick",
                    Place::Host {
                        root_for: None,
                        packages: false,
                    },
                    false,
                    false,
                ),
                o.args,
            ),
        }
    }
}

/// Where it runs and what is passed on: `--vm` (where the benchmark takes it) is xtask's.
fn place_and_args(spec: &Spec, mut args: Vec<String>) -> (Place, Vec<String>) {
    let before = args.len();
    if spec.vm_too {
        args.retain(|a| a != "--vm");
    }
    let place = if args.len() < before {
        Place::Vm
    } else {
        spec.place
    };
    (place, args)
}

/// Whether `args` ask for the benchmark's help.
fn asks_help(args: &[String]) -> bool {
    args.iter().any(|a| a == "--help" || a == "-h")
}

/// Its result's file under target/bench: `NAME.json`, `NAME-vm.json` for a host benchmark
/// run in the VM.
fn result_file(spec: &Spec, place: Place) -> String {
    match (spec.place, place) {
        (Place::Host { .. }, Place::Vm) => format!("{}-vm.json", spec.name),
        _ => format!("{}.json", spec.name),
    }
}

/// `args` as one line of a POSIX shell script, each word as given.
fn shell_words(args: &[String]) -> String {
    args.iter()
        .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
        .collect::<Vec<_>>()
        .join(" ")
}

pub fn run(root: &Path, bench: Bench) -> Result<()> {
    let (spec, args) = bench.split();
    let (place, args) = place_and_args(&spec, args);
    let bin = format!("bench-{}", spec.name);
    if asks_help(&args) {
        build(root, &bin, false)?;
        if spec.vm_too {
            println!("--vm (xtask's): run it in the soft-RoCE VM (Debian's 6.1) instead\n");
        }
        return std::process::Command::new(root.join("target/release").join(&bin))
            .arg("--help")
            .status_ok(&bin);
    }
    let out = root.join("target/bench").join(result_file(&spec, place));
    match place {
        Place::Host { root_for, packages } => {
            if let Some(why) = root_for
                && !is_root()
            {
                bail!("this benchmark needs root ({why})");
            }
            if packages {
                provision::run(provision::Scope::default())?;
            }
            build(root, &bin, spec.runs_ctl)?;
            std::process::Command::new(root.join("target/release").join(&bin))
                .args(&args)
                .arg("--out")
                .arg(&out)
                .current_dir(root)
                .status_ok(&bin)
        }
        Place::Vm => in_vm(root, &bin, &args, &out),
    }
}

/// Builds benchmark `bin` in release mode, with `ipoib-ctl` (and cm-node, which the VM's
/// benchmarks start) where it runs them.
fn build(root: &Path, bin: &str, with_ctl: bool) -> Result<()> {
    if with_ctl {
        cargo(root)
            .args(["build", "--release", "-q", "-p", "ipoib-ctl", "--bins"])
            .status_ok("cargo build ipoib-ctl")?;
    }
    let mut c = cargo(root);
    c.args([
        "build",
        "--release",
        "-q",
        "-p",
        "ipoib-tests",
        "--bin",
        bin,
    ]);
    if with_ctl {
        c.args(["--bin", "cm-node"]);
    }
    c.status_ok("cargo build the benchmark")
}

/// Runs benchmark `bin` in the VM and saves the JSON line it prints to `out`.
fn in_vm(root: &Path, bin: &str, args: &[String], out: &Path) -> Result<()> {
    if !is_root() {
        bail!("this benchmark needs root (it boots the VM and builds network namespaces)");
    }
    provision::run(provision::Scope { vm: true })?;
    build(root, bin, true)?;
    let exe = root.join("target/release").join(bin);
    let script = format!(
        "set -eu; modprobe tun; echo '==> {bin} on '$(uname -r); {} {}",
        exe.display(),
        shell_words(args)
    );
    let mut result = None;
    vm::run(root, &script, None, |line| {
        if let Some(j) = line.strip_prefix("BENCH-JSON ") {
            result = Some(j.to_string());
        }
    })
    .with_context(|| format!("{bin} failed in the VM"))?;
    let json = result.context("the benchmark printed no result")?;
    std::fs::create_dir_all(out.parent().expect("target/bench"))?;
    std::fs::write(out, json + "\n")?;
    println!("==> saved {}", out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn parse(words: &[&str]) -> Bench {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            bench: Bench,
        }
        Cli::try_parse_from(std::iter::once("bench").chain(words.iter().copied()))
            .unwrap()
            .bench
    }

    fn strings(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| w.to_string()).collect()
    }

    /// Every option goes to the benchmark as given, flags and negative numbers included;
    /// `--vm` is taken out where the benchmark runs in the VM on request.
    #[test]
    fn options_pass_on_as_given_and_vm_is_xtasks() {
        let (spec, args) = parse(&["engine", "--ctl-nice", "-5", "--rounds", "7"]).split();
        assert_eq!(args, strings(&["--ctl-nice", "-5", "--rounds", "7"]));
        assert_eq!(place_and_args(&spec, args).0, Place::Vm);
        let (spec, args) = parse(&["hop", "--seconds", "3", "--vm", "--paths=hop,veth"]).split();
        let (place, args) = place_and_args(&spec, args);
        assert_eq!(
            (place, args),
            (Place::Vm, strings(&["--seconds", "3", "--paths=hop,veth"]))
        );
        assert_eq!(result_file(&spec, place), "hop-vm.json");
        let (spec, args) = parse(&["hook", "--rounds", "2"]).split();
        let (place, args) = place_and_args(&spec, args);
        assert!(matches!(
            place,
            Place::Host {
                root_for: Some(_),
                packages: true
            }
        ));
        assert_eq!(args, strings(&["--rounds", "2"]));
        assert_eq!(result_file(&spec, place), "hook.json");
        // Only where xtask takes it: elsewhere the benchmark refuses it itself.
        let (spec, args) = parse(&["tick", "--vm"]).split();
        assert_eq!(
            place_and_args(&spec, args),
            (
                Place::Host {
                    root_for: None,
                    packages: false
                },
                strings(&["--vm"])
            ),
            "the tick's needs no package"
        );
        let (spec, _) = parse(&["memory"]).split();
        assert_eq!(result_file(&spec, spec.place), "memory.json");
        let (spec, _) = parse(&["datapath"]).split();
        assert_eq!(
            spec.place,
            Place::Host {
                root_for: None,
                packages: true
            }
        );
        let (_, args) = parse(&["datapath", "--help"]).split();
        assert!(asks_help(&args));
        assert!(!asks_help(&strings(&["--paths", "hop"])));
        assert!(asks_help(&strings(&["-h"])));
    }

    #[test]
    fn the_vm_script_gets_each_word_as_given() {
        let words = strings(&["--budget", "14 MiB", "it's"]);
        assert_eq!(shell_words(&words), r"'--budget' '14 MiB' 'it'\''s'");
        let out = std::process::Command::new("sh")
            .args(["-c", &format!("printf '%s|' {}", shell_words(&words))])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8(out.stdout).unwrap(),
            "--budget|14 MiB|it's|"
        );
    }
}
