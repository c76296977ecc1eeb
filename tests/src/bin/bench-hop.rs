//! `cargo xtask bench hop` (this machine's kernel, root): what the CM engine's userspace hop
//! costs on a real CPU, beside the kernel paths it competes with. The VM cannot tell: under
//! software emulation every path is slow. TCP (iperf3) between two network namespaces, with 1
//! and N streams, over four paths, interleaved in one run:
//!
//! - `hop`: each namespace has a TUN device opened as the engine opens its own (virtio-net
//!   header, checksum and TSO offloads, MTU 65520); one thread per direction reads a packet
//!   from one into a buffer of a send slot's size and writes it into the other: the sender's
//!   engine reading its TUN and the receiver's engine writing its own. No RC between them: on
//!   an HCA the transfer is DMA, which costs the CPU nothing.
//! - `hop-2copy`: the same, but each packet is copied once more (read into a buffer, then
//!   copied into the slot) as the engine did before it read into its send slots directly.
//! - `hop-2q`: `hop` on multi-queue TUN devices (IFF_MULTI_QUEUE), two queues each and a
//!   thread per queue and direction: what an engine task per queue would give. The kernel
//!   spreads flows over the queues by their hash, so one stream uses one queue.
//! - `ud-2044`: a veth pair, MTU 2044, TSO and GSO off on the sender, GRO off on the receiver:
//!   IPoIB datagram mode on an HCA without offloads, a cost per 2 KiB packet on both sides.
//! - `ud-4092`: MTU 4092, segmentation in software (GSO) on the sender, GRO on the receiver:
//!   close to Enhanced IPoIB on mlx5, but that its HCA segments for free.
//! - `veth`: a plain veth pair with every offload (the kernel's best case).
//!
//! Measured per run: Gbit/s (iperf3's receiver side), CPU seconds per GB moved over all CPUs
//! (/proc/stat across the run: iperf3 on both ends, the kernel's softirqs, the relay), and
//! for the hop the relay threads' own CPU per GB and the mean packet they moved. The median
//! of the rounds is reported, with ratios to `veth` of the same stream count. One JSON line
//! after `BENCH-JSON `; `--out` saves it.

use std::{
    collections::BTreeMap,
    os::fd::AsRawFd as _,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering},
    },
    thread::JoinHandle,
};

use anyhow::{Result, ensure};
use clap::Parser;
use ipoib_ctl::tun::{TUN_READ_MAX, Tun};
use ipoib_tests::{
    bench::{NsPair, TICKS_PER_S, median, publish, sh, stat_ticks},
    cmlab::in_netns,
};
use serde_json::json;

#[derive(Parser)]
#[command(about = "TCP through the engine's TUN hop vs the kernel's UD stand-ins and veth")]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 5)]
    seconds: u32,
    /// Interleaved rounds; the median of each measurement is reported.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Parallel TCP streams of the many-stream case (the other is 1).
    #[arg(long, default_value_t = 4)]
    streams: u32,
    /// Where to save the JSON result.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Kind {
    Hop,
    Hop2Copy,
    Hop2Q,
    Ud2044,
    Ud4092,
    Veth,
}

impl Kind {
    const ALL: [Kind; 6] = [
        Kind::Hop,
        Kind::Hop2Copy,
        Kind::Hop2Q,
        Kind::Ud2044,
        Kind::Ud4092,
        Kind::Veth,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Hop => "hop",
            Kind::Hop2Copy => "hop-2copy",
            Kind::Hop2Q => "hop-2q",
            Kind::Ud2044 => "ud-2044",
            Kind::Ud4092 => "ud-4092",
            Kind::Veth => "veth",
        }
    }

    /// MTU, and the `ethtool -K` settings of the sender's and the receiver's device.
    fn veth(
        self,
    ) -> Option<(
        &'static str,
        &'static [&'static str],
        &'static [&'static str],
    )> {
        match self {
            Kind::Hop | Kind::Hop2Copy | Kind::Hop2Q => None,
            Kind::Ud2044 => Some(("2044", &["tso", "off", "gso", "off"], &["gro", "off"])),
            Kind::Ud4092 => Some(("4092", &["tso", "off", "gso", "on"], &["gro", "on"])),
            Kind::Veth => Some(("1500", &[], &[])),
        }
    }
}

/// What a relay thread moved, and which thread it is (for its CPU time).
#[derive(Default)]
struct Moved {
    tid: AtomicI32,
    packets: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
}

/// The hop: two TUN devices and a thread per queue and direction between them.
struct Relay {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    moved: Vec<Arc<Moved>>,
}

impl Relay {
    /// CPU ticks (user + system) of every relay thread so far.
    fn ticks(&self) -> Result<u64> {
        self.moved
            .iter()
            .map(|m| thread_ticks(m.tid.load(Ordering::Relaxed)))
            .sum()
    }

    fn totals(&self) -> (u64, u64, u64) {
        let f = |get: fn(&Moved) -> &AtomicU64| {
            self.moved
                .iter()
                .map(|m| get(m).load(Ordering::Relaxed))
                .sum()
        };
        (f(|m| &m.packets), f(|m| &m.bytes), f(|m| &m.errors))
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// user + system ticks of thread `tid` of this process.
fn thread_ticks(tid: i32) -> Result<u64> {
    stat_ticks(&format!("/proc/self/task/{tid}/stat"))
}

/// Moves packets from `from` to `to` as the engine does: non-blocking reads until the device
/// has no more, then a wait for readiness. With `copy`, each packet is copied into a second
/// buffer before it is written (the engine's transmit before it read into its send slots).
fn relay(from: Arc<Tun>, to: Arc<Tun>, copy: bool, stop: Arc<AtomicBool>, moved: Arc<Moved>) {
    // SAFETY: gettid has no preconditions.
    moved
        .tid
        .store(unsafe { libc::gettid() }, Ordering::Relaxed);
    let mut buf = vec![0u8; TUN_READ_MAX];
    let mut slot = vec![0u8; if copy { TUN_READ_MAX } else { 0 }];
    while !stop.load(Ordering::Relaxed) {
        match from.recv(&mut buf) {
            Ok(n) => {
                let pkt = if copy {
                    slot[..n].copy_from_slice(&buf[..n]);
                    &slot[..n]
                } else {
                    &buf[..n]
                };
                if to.send(pkt).is_ok() {
                    moved.packets.fetch_add(1, Ordering::Relaxed);
                    moved.bytes.fetch_add(n as u64, Ordering::Relaxed);
                } else {
                    moved.errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut pfd = libc::pollfd {
                    fd: from.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut pfd, 1, 100) };
            }
            Err(_) => return,
        }
    }
}

/// Two namespaces joined by one path, with an iperf3 server in the second; the relay is
/// stopped, then the namespaces deleted, when dropped.
struct Pair {
    kind: Kind,
    relay: Option<Relay>,
    ends: NsPair,
}

impl Pair {
    fn new(kind: Kind, subnet: u8) -> Result<Self> {
        let mut pair = Pair {
            kind,
            relay: None,
            ends: NsPair::new(&format!("bhop-{}", kind.name()), [97, subnet])?,
        };
        let devs = match kind.veth() {
            None => {
                let queues = if kind == Kind::Hop2Q { 2 } else { 1 };
                pair.hop(kind == Kind::Hop2Copy, queues)?
            }
            Some((mtu, tx, rx)) => {
                let names = ["hopva", "hopvb"];
                pair.ends.veth(names, mtu, [tx, rx])?;
                names.map(String::from)
            }
        };
        pair.ends.address(devs.each_ref().map(String::as_str))?;
        pair.ends.serve()?;
        Ok(pair)
    }

    /// The TUN devices, opened as the engine opens its own with `queues` queues each, and
    /// the relay between them: a thread per queue and direction, queue i to queue i.
    fn hop(&mut self, copy: bool, queues: usize) -> Result<[String; 2]> {
        let [qa, qb] = self.ends.ns.clone().map(|n| {
            in_netns(&n, move || Tun::create_queues("hop%d", queues, true))
                .map(|q| q.into_iter().map(Arc::new).collect::<Vec<_>>())
        });
        let (qa, qb) = (qa?, qb?);
        let names = [qa[0].name().to_string(), qb[0].name().to_string()];
        for (ns, name) in self.ends.ns.iter().zip(&names) {
            let up = ["link", "set", name, "addrgenmode", "none", "mtu", "65520"];
            sh(&[&["ip", "-n", ns][..], &up[..]].concat())?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut moved = Vec::new();
        let mut threads = Vec::new();
        for (a, b) in qa.iter().zip(&qb) {
            for (from, to) in [(a, b), (b, a)] {
                let m = Arc::new(Moved::default());
                let (f, t, s, m2) = (from.clone(), to.clone(), stop.clone(), m.clone());
                threads.push(std::thread::spawn(move || relay(f, t, copy, s, m2)));
                moved.push(m);
            }
        }
        self.relay = Some(Relay {
            stop,
            threads,
            moved,
        });
        Ok(names)
    }

    /// One iperf3 run of `streams` streams for `secs` seconds.
    fn run(&self, streams: u32, secs: u32) -> Result<Run> {
        let relay0 = self.relay.as_ref().map(|r| (r.ticks(), r.totals()));
        let io = self.ends.iperf3(streams, secs, self.kind.name())?;
        let gb = io.bytes / 1e9;
        let mut run = Run {
            gbit_s: io.gbit_s,
            cpu_s_per_gb: io.cpu_s_per_gb(),
            relay_cpu_s_per_gb: None,
            relay_mean_bytes: None,
        };
        if let (Some(r), Some((t0, (p0, b0, e0)))) = (&self.relay, relay0) {
            let (t1, (p1, b1, e1)) = (r.ticks()?, r.totals());
            ensure!(e1 == e0, "the relay failed {} writes", e1 - e0);
            run.relay_cpu_s_per_gb = Some((t1 - t0?) as f64 / TICKS_PER_S / gb);
            run.relay_mean_bytes = Some((b1 - b0) as f64 / (p1 - p0).max(1) as f64);
        }
        Ok(run)
    }
}

#[derive(Clone, Copy, Debug)]
struct Run {
    gbit_s: f64,
    cpu_s_per_gb: f64,
    relay_cpu_s_per_gb: Option<f64>,
    relay_mean_bytes: Option<f64>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    // SAFETY: geteuid has no preconditions.
    ensure!(
        unsafe { libc::geteuid() } == 0,
        "bench-hop needs root (network namespaces, /dev/net/tun, veth)"
    );
    ensure!(
        args.rounds > 0 && args.seconds > 0,
        "rounds and seconds must be positive"
    );
    let pairs: Vec<Pair> = Kind::ALL
        .iter()
        .enumerate()
        .map(|(i, k)| Pair::new(*k, i as u8 + 1))
        .collect::<Result<_>>()?;
    let counts = if args.streams == 1 {
        vec![1]
    } else {
        vec![1, args.streams]
    };
    let mut runs: BTreeMap<(Kind, u32), Vec<Run>> = BTreeMap::new();
    for round in 0..args.rounds {
        for &streams in &counts {
            for p in &pairs {
                let r = p.run(streams, args.seconds)?;
                eprintln!(
                    "round {}/{}: {:<8} {streams} stream(s): {:6.2} Gbit/s, {:5.2} CPU s/GB",
                    round + 1,
                    args.rounds,
                    p.kind.name(),
                    r.gbit_s,
                    r.cpu_s_per_gb
                );
                runs.entry((p.kind, streams)).or_default().push(r);
            }
        }
    }
    drop(pairs);
    report(&args, &counts, &runs)
}

fn report(args: &Args, counts: &[u32], runs: &BTreeMap<(Kind, u32), Vec<Run>>) -> Result<()> {
    let m = |k: Kind, s: u32, f: fn(&Run) -> Option<f64>| {
        let v: Vec<f64> = runs[&(k, s)].iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "\nTCP between two namespaces (iperf3), {} s x {} interleaved rounds (median), kernel {}, {cpus} CPUs",
        args.seconds,
        args.rounds,
        kernel.trim()
    );
    println!(
        "{:<8} {:>7} {:>8} {:>9} {:>10} {:>10} {:>13} {:>11}",
        "path",
        "streams",
        "Gbit/s",
        "CPU s/GB",
        "Gbit/veth",
        "CPU/veth",
        "relay CPU s/GB",
        "relay mean B"
    );
    let mut rows = Vec::new();
    for &s in counts {
        let veth_g = m(Kind::Veth, s, |r| Some(r.gbit_s)).unwrap_or(f64::NAN);
        let veth_c = m(Kind::Veth, s, |r| Some(r.cpu_s_per_gb)).unwrap_or(f64::NAN);
        for k in Kind::ALL {
            let g = m(k, s, |r| Some(r.gbit_s)).unwrap_or(f64::NAN);
            let c = m(k, s, |r| Some(r.cpu_s_per_gb)).unwrap_or(f64::NAN);
            let rc = m(k, s, |r| r.relay_cpu_s_per_gb);
            let rb = m(k, s, |r| r.relay_mean_bytes);
            let opt = |v: Option<f64>, p: usize| v.map_or("-".into(), |v| format!("{v:.p$}"));
            println!(
                "{:<8} {s:>7} {g:>8.2} {c:>9.2} {:>10.2} {:>10.2} {:>13} {:>11}",
                k.name(),
                g / veth_g,
                c / veth_c,
                opt(rc, 2),
                opt(rb, 0)
            );
            rows.push(json!({
                "path": k.name(), "streams": s, "gbit_s": g, "cpu_s_per_gb": c,
                "gbit_over_veth": g / veth_g, "cpu_over_veth": c / veth_c,
                "relay_cpu_s_per_gb": rc, "relay_mean_bytes": rb,
                "rounds": runs[&(k, s)].iter().map(|r| json!({
                    "gbit_s": r.gbit_s, "cpu_s_per_gb": r.cpu_s_per_gb,
                })).collect::<Vec<_>>(),
            }));
        }
    }
    let result = json!({
        "bench": "hop", "kernel": kernel.trim(), "cpus": cpus, "seconds": args.seconds,
        "rounds": args.rounds, "rows": rows,
    });
    publish(&result, args.out.as_deref())
}
