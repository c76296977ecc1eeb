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
//! Each hook runs a trivial program (`baseline_xdp`, `baseline_tc`: pass everything), which
//! measures the hook, and then the fast path's own ingress there (`ipoib_ingress` in generic
//! XDP, `ipoib_tcingress` at TC; the sender an entry with a traffic slot, as the control loop
//! leaves a peer it has seen), which adds the program (its cost per packet alone is
//! `bench datapath`'s). TCP (iperf3) between two namespaces, each MTU with no program and each
//! program, interleaved round by round: Gbit/s and CPU seconds per GB over all CPUs
//! (/proc/stat across the run). The median of the rounds is reported, with ratios to the same
//! MTU without a program. One JSON line after `BENCH-JSON `; `--out` saves it.

use std::{any::Any, collections::BTreeMap, net::IpAddr, path::PathBuf, process::Command};

use anyhow::{Context as _, Result, ensure};
use aya::{
    Ebpf,
    programs::{SchedClassifier, TcAttachType, Xdp, XdpMode, tc},
};
use clap::Parser;
use ipoib_common::{ARPHRD_ETHER, PeerEntry, PeerKey, Policy};
use ipoib_ctl::{
    clock::monotonic_ns,
    datapath::{BASELINE_OBJECT, Datapath},
};
use ipoib_tests::{
    bench::{NsPair, median, publish},
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
    FastPathXdp,
    FastPathTc,
}

impl Hook {
    const ALL: [Hook; 5] = [
        Hook::None,
        Hook::GenericXdp,
        Hook::TcIngress,
        Hook::FastPathXdp,
        Hook::FastPathTc,
    ];

    fn name(self) -> &'static str {
        match self {
            Hook::None => "none",
            Hook::GenericXdp => "generic-xdp",
            Hook::TcIngress => "tc-ingress",
            Hook::FastPathXdp => "fastpath-xdp",
            Hook::FastPathTc => "fastpath-tc",
        }
    }

    fn is_xdp(self) -> bool {
        matches!(self, Hook::GenericXdp | Hook::FastPathXdp)
    }

    /// Attaches this hook's program to `dev` in this thread's namespace (`sender`: the address
    /// the traffic comes from); the program stays attached while the returned object lives.
    fn attach(self, dev: &str, sender: &str) -> Result<Option<Box<dyn Any + Send>>> {
        if matches!(self, Hook::FastPathXdp | Hook::FastPathTc) {
            let mut dp = Datapath::load().context("loading the fast path")?;
            dp.maps.set_policy(&Policy::new(ARPHRD_ETHER))?;
            let key = PeerKey::from(sender.parse::<IpAddr>()?);
            let entry = PeerEntry {
                traffic_slot: 1,
                ..PeerEntry::default()
            };
            dp.maps.set_peer(key, entry)?;
            dp.maps.beat(monotonic_ns())?;
            if self == Hook::FastPathXdp {
                dp.ingress()?
                    .attach(dev, XdpMode::Skb)
                    .with_context(|| format!("ipoib_ingress in generic XDP on {dev}"))?;
            } else {
                let _ = tc::qdisc_add_clsact(dev);
                dp.ingress_tc()?
                    .attach(dev, TcAttachType::Ingress)
                    .with_context(|| format!("ipoib_tcingress at TC ingress on {dev}"))?;
            }
            return Ok(Some(Box::new(dp)));
        }
        if self == Hook::None {
            return Ok(None);
        }
        let mut ebpf = Ebpf::load(BASELINE_OBJECT).context("loading the baseline programs")?;
        match self {
            Hook::None | Hook::FastPathXdp | Hook::FastPathTc => {}
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
        Ok(Some(Box::new(ebpf)))
    }
}

/// IPoIB's UD MTUs: 2 KiB and 4 KiB IB MTUs less the 4-byte IPoIB header.
const MTUS: [u32; 2] = [2044, 4092];

/// Two namespaces joined by a veth pair, the receiving end hooked, with an iperf3 server
/// behind it; the program is detached, then the namespaces deleted, when dropped.
struct Pair {
    mtu: u32,
    hook: Hook,
    program: Option<Box<dyn Any + Send>>,
    ends: NsPair,
}

impl Pair {
    fn new(mtu: u32, hook: Hook, subnet: u8) -> Result<Self> {
        let mut pair = Pair {
            mtu,
            hook,
            program: None,
            ends: NsPair::new(&format!("bhook-{mtu}-{}", hook.name()), [96, subnet])?,
        };
        let devs = ["hookva", "hookvb"];
        let features: [&[&str]; 2] = [&["tso", "off", "gso", "on"], &["gro", "on"]];
        pair.ends.veth(devs, &mtu.to_string(), features)?;
        pair.ends.address(devs)?;
        let sender = pair.ends.ip[0].clone();
        pair.program = in_netns(&pair.ends.ns[1], move || hook.attach(devs[1], &sender))?;
        pair.check_hook(devs[1])?;
        pair.ends.serve()?;
        Ok(pair)
    }

    /// That the kernel shows the receiving device hooked as asked, and only so: `ip link`
    /// names generic XDP `xdpgeneric`; a TC program shows in `tc filter` (netlink) or
    /// `bpftool net` (TCX).
    fn check_hook(&self, dev: &str) -> Result<()> {
        let out = Command::new("ip")
            .args(["-n", &self.ends.ns[1], "-d", "link", "show", "dev", dev])
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
            words.contains(&"xdpgeneric") == self.hook.is_xdp()
                && !words.contains(&"xdp")
                && !words.contains(&"xdpdrv"),
            "{dev} with hook {}: ip link shows\n{link}",
            self.hook.name()
        );
        Ok(())
    }

    /// One iperf3 run of `secs` seconds: (Gbit/s, CPU seconds per GB).
    fn run(&self, secs: u32) -> Result<(f64, f64)> {
        let what = format!("MTU {} through {}", self.mtu, self.hook.name());
        let io = self.ends.iperf3(1, secs, &what)?;
        Ok((io.gbit_s, io.cpu_s_per_gb()))
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
                "round {}/{}: MTU {} {:<12} {g:6.2} Gbit/s, {c:5.2} CPU s/GB",
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
        "{:>5} {:<12} {:>8} {:>9} {:>11} {:>10}",
        "MTU", "hook", "Gbit/s", "CPU s/GB", "Gbit/none", "CPU/none"
    );
    let mut rows = Vec::new();
    for mtu in MTUS {
        let (g0, c0) = (m(mtu, Hook::None, |r| r.0), m(mtu, Hook::None, |r| r.1));
        for h in Hook::ALL {
            let (g, c) = (m(mtu, h, |r| r.0), m(mtu, h, |r| r.1));
            println!(
                "{mtu:>5} {:<12} {g:>8.2} {c:>9.2} {:>11.2} {:>10.2}",
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
