//! `cargo xtask bench hook` (root; `--vm` in the soft-RoCE VM's 6.1): what the receive hook
//! costs on a path with GRO, the choice between generic XDP and a TC ingress program for
//! IPoIB interfaces (issue 35, item 7).
//!
//! IPoIB has no native XDP, so an XDP program on it runs generic: after GRO, on an skb. Generic
//! XDP gives a program a linear buffer with 256 bytes of headroom, so it reallocates the head
//! of an skb with less and linearizes one that GRO merged (a copy of every received byte). A
//! TC ingress program sees the same skb in place. veth stands in for the IPoIB interface:
//! forced into generic mode, GRO on its receiving side (its NAPI path, as IPoIB's receive
//! completions go through `napi_gro_receive`), the sender segmenting in software (GSO, TSO
//! off) as IPoIB's datagram mode does, at IPoIB's two UD MTUs.
//!
//! Each hook runs a trivial program (`baseline_xdp`, `baseline_tc`: pass everything), so what
//! is measured is the hook, not a program: the fast path's own cost per packet is
//! `bench datapath`'s. TCP (iperf3) between two namespaces, each MTU with no program, generic
//! XDP and TC ingress, interleaved round by round: Gbit/s and CPU seconds per GB over all CPUs
//! (/proc/stat across the run). The median of the rounds is reported, with ratios to the same
//! MTU without a program. One JSON line after `BENCH-JSON `; `--out` saves it.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use aya::{
    Ebpf,
    programs::{SchedClassifier, TcAttachType, Xdp, XdpMode, tc},
};
use clap::Parser;
use ipoib_ctl::datapath::BASELINE_OBJECT;
use ipoib_tests::{
    bench::{TICKS_PER_S, busy_ticks, check_features, median, publish, sh},
    cmlab::in_netns,
};
use serde_json::json;

#[derive(Parser)]
#[command(about = "TCP with GRO through generic XDP vs TC ingress vs no receive hook")]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Interleaved rounds; the median of each measurement is reported.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Where to save the JSON result.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// The receive hook on the receiving veth.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Hook {
    None,
    GenericXdp,
    TcIngress,
}

impl Hook {
    const ALL: [Hook; 3] = [Hook::None, Hook::GenericXdp, Hook::TcIngress];

    fn name(self) -> &'static str {
        match self {
            Hook::None => "none",
            Hook::GenericXdp => "generic-xdp",
            Hook::TcIngress => "tc-ingress",
        }
    }

    /// Attaches this hook's trivial program to `dev` in this thread's namespace; the program
    /// stays attached while the returned object lives.
    fn attach(self, dev: &str) -> Result<Option<Ebpf>> {
        if self == Hook::None {
            return Ok(None);
        }
        let mut ebpf = Ebpf::load(BASELINE_OBJECT).context("loading the baseline programs")?;
        match self {
            Hook::None => {}
            Hook::GenericXdp => {
                let p: &mut Xdp = ebpf
                    .program_mut("baseline_xdp")
                    .context("baseline_xdp")?
                    .try_into()?;
                p.load()?;
                p.attach(dev, XdpMode::Skb)
                    .with_context(|| format!("generic XDP on {dev}"))?;
            }
            Hook::TcIngress => {
                // A kernel with TCX (6.6) needs no qdisc; one with netlink's clsact does.
                let _ = tc::qdisc_add_clsact(dev);
                let p: &mut SchedClassifier = ebpf
                    .program_mut("baseline_tc")
                    .context("baseline_tc")?
                    .try_into()?;
                p.load()?;
                p.attach(dev, TcAttachType::Ingress)
                    .with_context(|| format!("TC ingress on {dev}"))?;
            }
        }
        Ok(Some(ebpf))
    }
}

/// IPoIB's UD MTUs: 2 KiB and 4 KiB IB MTUs less the 4-byte IPoIB header.
const MTUS: [u32; 2] = [2044, 4092];

/// Two namespaces joined by a veth pair, the receiving end hooked, with an iperf3 server
/// behind it; the namespaces (and their devices) are deleted when dropped.
struct Pair {
    mtu: u32,
    hook: Hook,
    ns: [String; 2],
    ip: [String; 2],
    server: Option<Child>,
    program: Option<Ebpf>,
}

impl Drop for Pair {
    fn drop(&mut self) {
        if let Some(mut s) = self.server.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
        self.program.take();
        for ns in &self.ns {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

impl Pair {
    fn new(mtu: u32, hook: Hook, subnet: u8) -> Result<Self> {
        let ns = [0, 1].map(|i| format!("bhook-{mtu}-{}-{}", hook.name(), ["a", "b"][i]));
        for n in &ns {
            // A run stopped by Ctrl-C leaves its namespaces: start clean.
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
        let mut pair = Pair {
            mtu,
            hook,
            ns,
            ip: [1, 2].map(|h| format!("10.96.{subnet}.{h}")),
            server: None,
            program: None,
        };
        for n in &pair.ns {
            sh(&["ip", "netns", "add", n])?;
            sh(&["ip", "-n", n, "link", "set", "lo", "up"])?;
        }
        let devs = ["hookva", "hookvb"];
        let m = mtu.to_string();
        sh(&[
            "ip",
            "link",
            "add",
            devs[0],
            "mtu",
            &m,
            "netns",
            &pair.ns[0],
            "type",
            "veth",
            "peer",
            "name",
            devs[1],
            "mtu",
            &m,
            "netns",
            &pair.ns[1],
        ])?;
        let features: [&[&str]; 2] = [&["tso", "off", "gso", "on"], &["gro", "on"]];
        for (i, f) in features.iter().enumerate() {
            let ns = &pair.ns[i];
            sh(&[
                &["ip", "netns", "exec", ns, "ethtool", "-K", devs[i]][..],
                f,
            ]
            .concat())?;
            check_features(ns, devs[i], f)?;
            let cidr = format!("{}/24", pair.ip[i]);
            sh(&["ip", "-n", ns, "addr", "add", &cidr, "dev", devs[i]])?;
            sh(&["ip", "-n", ns, "link", "set", devs[i], "up"])?;
        }
        pair.program = in_netns(&pair.ns[1], move || hook.attach(devs[1]))?;
        pair.check_hook(devs[1])?;
        let server = Command::new("ip")
            .args(["netns", "exec", &pair.ns[1], "iperf3", "-s", "-p", "5201"])
            .args(["-B", &pair.ip[1]])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("iperf3 server")?;
        pair.server = Some(server);
        std::thread::sleep(Duration::from_millis(300));
        Ok(pair)
    }

    /// That the kernel shows the receiving device hooked as asked, and only so: `ip link`
    /// names generic XDP `xdpgeneric`; a TC program shows in `tc filter` (netlink) or
    /// `bpftool net` (TCX).
    fn check_hook(&self, dev: &str) -> Result<()> {
        let out = Command::new("ip")
            .args(["-n", &self.ns[1], "-d", "link", "show", "dev", dev])
            .output()
            .context("ip link show")?;
        let link = String::from_utf8_lossy(&out.stdout);
        // The first line's words name the XDP mode: `xdpgeneric`, or `xdp`/`xdpdrv` if native.
        let words: Vec<&str> = link
            .lines()
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        ensure!(
            words.contains(&"xdpgeneric") == (self.hook == Hook::GenericXdp)
                && !words.contains(&"xdp")
                && !words.contains(&"xdpdrv"),
            "{dev} with hook {}: ip link shows\n{link}",
            self.hook.name()
        );
        Ok(())
    }

    /// One iperf3 run of `secs` seconds: (Gbit/s, CPU seconds per GB).
    fn run(&self, secs: u32) -> Result<(f64, f64)> {
        let busy0 = busy_ticks()?;
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns[0], "iperf3", "-J", "-p", "5201"])
            .args(["-c", &self.ip[1], "-t", &secs.to_string()])
            .output()
            .context("iperf3 client")?;
        let busy1 = busy_ticks()?;
        ensure!(
            out.status.success(),
            "iperf3 at MTU {} through {}: {}",
            self.mtu,
            self.hook.name(),
            String::from_utf8_lossy(&out.stdout)
        );
        let r: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let bytes = r["end"]["sum_received"]["bytes"].as_f64().unwrap_or(0.0);
        let bps = r["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .unwrap_or(0.0);
        ensure!(bytes > 0.0, "nothing crossed {}", self.hook.name());
        Ok((
            bps / 1e9,
            (busy1 - busy0) as f64 / TICKS_PER_S / (bytes / 1e9),
        ))
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: geteuid has no preconditions.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "bench-hook needs root (network namespaces, veth, eBPF)"
    );
    ensure!(
        args.rounds > 0 && args.seconds > 0,
        "rounds and seconds must be positive"
    );
    let mut pairs = Vec::new();
    for mtu in MTUS {
        for hook in Hook::ALL {
            pairs.push(Pair::new(mtu, hook, pairs.len() as u8 + 1)?);
        }
    }
    let mut runs: BTreeMap<(u32, Hook), Vec<(f64, f64)>> = BTreeMap::new();
    for round in 0..args.rounds {
        for p in &pairs {
            let (g, c) = p.run(args.seconds)?;
            eprintln!(
                "round {}/{}: MTU {} {:<11} {g:6.2} Gbit/s, {c:5.2} CPU s/GB",
                round + 1,
                args.rounds,
                p.mtu,
                p.hook.name(),
            );
            runs.entry((p.mtu, p.hook)).or_default().push((g, c));
        }
    }
    drop(pairs);
    report(&args, &runs)
}

fn report(args: &Args, runs: &BTreeMap<(u32, Hook), Vec<(f64, f64)>>) -> Result<()> {
    let m = |mtu: u32, h: Hook, f: fn(&(f64, f64)) -> f64| {
        median(&runs[&(mtu, h)].iter().map(f).collect::<Vec<_>>())
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "\nTCP through a veth with GRO (iperf3), {} s x {} interleaved rounds (median), kernel {}, \
         {cpus} CPUs",
        args.seconds,
        args.rounds,
        kernel.trim()
    );
    println!(
        "{:>5} {:<11} {:>8} {:>9} {:>11} {:>10}",
        "MTU", "hook", "Gbit/s", "CPU s/GB", "Gbit/none", "CPU/none"
    );
    let mut rows = Vec::new();
    for mtu in MTUS {
        let (g0, c0) = (m(mtu, Hook::None, |r| r.0), m(mtu, Hook::None, |r| r.1));
        for h in Hook::ALL {
            let (g, c) = (m(mtu, h, |r| r.0), m(mtu, h, |r| r.1));
            println!(
                "{mtu:>5} {:<11} {g:>8.2} {c:>9.2} {:>11.2} {:>10.2}",
                h.name(),
                g / g0,
                c / c0
            );
            rows.push(json!({
                "mtu": mtu, "hook": h.name(), "gbit_s": g, "cpu_s_per_gb": c,
                "gbit_over_none": g / g0, "cpu_over_none": c / c0,
                "rounds": runs[&(mtu, h)].iter().map(|r| json!({
                    "gbit_s": r.0, "cpu_s_per_gb": r.1,
                })).collect::<Vec<_>>(),
            }));
        }
    }
    let result = json!({
        "bench": "hook", "kernel": kernel.trim(), "cpus": cpus, "seconds": args.seconds,
        "rounds": args.rounds, "rows": rows,
    });
    publish(&result, args.out.as_deref())
}
