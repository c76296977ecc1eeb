//! `cargo xtask bench hop` (this machine's kernel, root): what the CM engine's userspace hop
//! costs on a real CPU, beside the kernel paths it competes with. The VM cannot tell: under
//! software emulation every path is slow. TCP (iperf3) between two network namespaces, with 1
//! and N streams, over these paths, interleaved in one run (`--paths` picks some):
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
//! - `hop-uring`: `hop` with io_uring in place of a `read` and a `write` per packet: per
//!   direction a ring, [`relays::URING_DEPTH`] buffers of a send slot's size registered with
//!   it (as the engine's send slots would be), a read of each kept queued on the one device,
//!   each packet read written into the other device from the same buffer, and the buffer
//!   queued for a read again once written: one `io_uring_enter` per batch of completions.
//! - `hop-mmap`: the sender's side takes its packets from a packet-mmap ring in place of TUN
//!   reads. Each namespace sends through an ifb device (what the fast path would redirect to:
//!   its transmit frees a packet that no TC action redirected to it, as a dummy device's does,
//!   and ifb is built into kernels that lack dummy), whose outgoing packets the kernel
//!   copies, GSO super-packets whole with their vnet header, into the frames of a TPACKET_V2
//!   receive ring on an AF_PACKET socket (one frame per packet, [`ring::RING_FRAMES`] of
//!   them); the relay writes each frame's packet from the ring itself into the other
//!   namespace's TUN device through io_uring, and hands the frame back once written. No
//!   system call per packet on either side, and no copy in userspace.
//! - `ud-2044`: a veth pair, MTU 2044, TSO and GSO off on the sender, GRO off on the receiver:
//!   IPoIB datagram mode on an HCA without offloads, a cost per 2 KiB packet on both sides.
//! - `ud-4092`: MTU 4092, segmentation in software (GSO) on the sender, GRO on the receiver:
//!   close to Enhanced IPoIB on mlx5, but that its HCA segments for free.
//! - `veth`: a plain veth pair with every offload (the kernel's best case).
//!
//! Measured per run: Gbit/s (iperf3's receiver side), CPU seconds per GB moved over all CPUs
//! (/proc/stat across the run: iperf3 on both ends, the kernel's softirqs, the relay), and
//! for the hops the relay's own CPU per GB (this process's, io_uring's workers included), the
//! mean of the data packets it moved (1 KiB or more), its small packets (ACKs, and data
//! segments that small) per data packet and its system calls per packet; for `hop-mmap` the
//! packets its rings dropped for want of a free frame. The median
//! of the rounds is reported, with ratios to `veth` of the same stream count. One JSON line
//! after `BENCH-JSON `; `--out` saves it.
//!
//! With `hop-mmap`, first: whether this kernel lets a packet ring's mapping be registered,
//! as io_uring fixed buffers and as a verbs memory region on the first RDMA device (which
//! would let its frames be sent over RC with no copy in userspace at all).

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
};

use anyhow::{Result, ensure};
use clap::Parser;
use ipoib_ctl::tun::Tun;
use ipoib_tests::{
    bench::{NsPair, TICKS_PER_S, median, publish, sh, stat_ticks},
    cmlab::in_netns,
};
use serde_json::json;

mod relays;
mod ring;

use relays::{Moved, Mover, Totals, relay, relay_ring, relay_uring};
use ring::{PacketRing, RING_DEV, ring_registration};

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
    /// Only these paths (by name, e.g. `hop,hop-uring,veth`); all when not given. The ratios
    /// need `veth`.
    #[arg(long, value_delimiter = ',')]
    paths: Vec<String>,
    /// Bytes per write of the sender (iperf3's `-l`; 128 KiB when not given). A write that is
    /// not a whole number of segments leaves a short tail segment.
    #[arg(long)]
    len: Option<u32>,
    /// Where to save the JSON result.
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Kind {
    Hop,
    Hop2Copy,
    Hop2Q,
    HopUring,
    HopMmap,
    Ud2044,
    Ud4092,
    Veth,
}

impl Kind {
    const ALL: [Kind; 8] = [
        Kind::Hop,
        Kind::Hop2Copy,
        Kind::Hop2Q,
        Kind::HopUring,
        Kind::HopMmap,
        Kind::Ud2044,
        Kind::Ud4092,
        Kind::Veth,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Hop => "hop",
            Kind::Hop2Copy => "hop-2copy",
            Kind::Hop2Q => "hop-2q",
            Kind::HopUring => "hop-uring",
            Kind::HopMmap => "hop-mmap",
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
            Kind::Hop | Kind::Hop2Copy | Kind::Hop2Q | Kind::HopUring | Kind::HopMmap => None,
            Kind::Ud2044 => Some(("2044", &["tso", "off", "gso", "off"], &["gro", "off"])),
            Kind::Ud4092 => Some(("4092", &["tso", "off", "gso", "on"], &["gro", "on"])),
            Kind::Veth => Some(("1500", &[], &[])),
        }
    }
}

/// The hop: two TUN devices and a thread per queue and direction between them.
struct Relay {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    moved: Vec<Arc<Moved>>,
}

impl Relay {
    /// CPU ticks (user + system) of this process so far: the relay threads, and the worker
    /// threads io_uring may start for them (the other pairs' relays sit idle meanwhile).
    fn ticks(&self) -> Result<u64> {
        stat_ticks("/proc/self/stat")
    }

    /// What every relay thread moved so far.
    fn totals(&self) -> Totals {
        let f = |get: fn(&Moved) -> &AtomicU64| {
            self.moved
                .iter()
                .map(|m| get(m).load(Ordering::Relaxed))
                .sum()
        };
        Totals {
            packets: f(|m| &m.packets),
            large: f(|m| &m.large),
            large_bytes: f(|m| &m.large_bytes),
            errors: f(|m| &m.errors),
            calls: f(|m| &m.calls),
            drops: f(|m| &m.drops),
        }
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
            None if kind == Kind::HopMmap => pair.hop_mmap()?,
            None => {
                let queues = if kind == Kind::Hop2Q { 2 } else { 1 };
                let mover = match kind {
                    Kind::Hop2Copy => Mover::Copy,
                    Kind::HopUring => Mover::Uring,
                    _ => Mover::Syscalls,
                };
                pair.hop(mover, queues)?
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
    fn hop(&mut self, mover: Mover, queues: usize) -> Result<[String; 2]> {
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
                threads.push(std::thread::spawn(move || match mover {
                    Mover::Uring => relay_uring(&f, &t, &s, &m2),
                    _ => relay(f, t, mover == Mover::Copy, s, m2),
                }));
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

    /// `hop-mmap`'s devices in each namespace, a dummy device to send through (returned: it
    /// gets the address) and a TUN device to receive on, and the relay between them: a thread
    /// per direction from one namespace's packet ring to the other's TUN device.
    fn hop_mmap(&mut self) -> Result<[String; 2]> {
        let mut rings = Vec::new();
        let mut tuns = Vec::new();
        for ns in &self.ends.ns {
            let add = ["link", "add", RING_DEV, "mtu", "65520", "type", "ifb"];
            sh(&[&["ip", "-n", ns][..], &add[..]].concat())?;
            // Up before the ring binds to it: a bind to a device that is down leaves
            // ENETDOWN pending on the socket.
            sh(&["ip", "-n", ns, "link", "set", RING_DEV, "up"])?;
            let tun = in_netns(ns, || Tun::create("hopr%d", true))?;
            let up = [
                "link",
                "set",
                tun.name(),
                "addrgenmode",
                "none",
                "mtu",
                "65520",
                "up",
            ];
            sh(&[&["ip", "-n", ns][..], &up[..]].concat())?;
            rings.push(in_netns(ns, || PacketRing::open(RING_DEV))?);
            tuns.push(tun);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut moved = Vec::new();
        let mut threads = Vec::new();
        for (ring, to) in rings.into_iter().zip(tuns.into_iter().rev()) {
            let m = Arc::new(Moved::default());
            let (s, m2) = (stop.clone(), m.clone());
            threads.push(std::thread::spawn(move || relay_ring(&ring, &to, &s, &m2)));
            moved.push(m);
        }
        self.relay = Some(Relay {
            stop,
            threads,
            moved,
        });
        Ok([RING_DEV, RING_DEV].map(String::from))
    }

    /// One iperf3 run of `streams` streams for `secs` seconds.
    fn run(&self, streams: u32, secs: u32, len: Option<u32>) -> Result<Run> {
        let relay0 = self.relay.as_ref().map(|r| (r.ticks(), r.totals()));
        let io = self
            .ends
            .iperf3_writes(streams, secs, len, self.kind.name())?;
        let gb = io.bytes / 1e9;
        let mut run = Run {
            gbit_s: io.gbit_s,
            cpu_s_per_gb: io.cpu_s_per_gb(),
            relay_cpu_s_per_gb: None,
            relay_data_bytes: None,
            relay_small_per_data: None,
            relay_calls_per_packet: None,
            ring_drops: None,
        };
        if let (Some(r), Some((t0, before))) = (&self.relay, relay0) {
            let (t1, d) = (r.ticks()?, r.totals().since(before));
            run.ring_drops = (self.kind == Kind::HopMmap).then_some(d.drops);
            ensure!(d.errors == 0, "the relay failed {} writes", d.errors);
            let (packets, large) = (d.packets.max(1) as f64, d.large.max(1) as f64);
            run.relay_cpu_s_per_gb = Some((t1 - t0?) as f64 / TICKS_PER_S / gb);
            run.relay_data_bytes = Some(d.large_bytes as f64 / large);
            run.relay_small_per_data = Some((d.packets - d.large) as f64 / large);
            run.relay_calls_per_packet = Some(d.calls as f64 / packets);
        }
        Ok(run)
    }
}

#[derive(Clone, Copy, Debug)]
struct Run {
    gbit_s: f64,
    cpu_s_per_gb: f64,
    relay_cpu_s_per_gb: Option<f64>,
    /// Mean bytes of the relay's data packets ([`relays::LARGE`] bytes or more).
    relay_data_bytes: Option<f64>,
    /// The relay's packets under [`relays::LARGE`] bytes (ACKs, and data segments that
    /// small) per data packet.
    relay_small_per_data: Option<f64>,
    relay_calls_per_packet: Option<f64>,
    /// Packets the packet ring dropped for want of a frame (counted with a lag).
    ring_drops: Option<u64>,
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
    for p in &args.paths {
        ensure!(
            Kind::ALL.iter().any(|k| k.name() == p),
            "no path {p:?}; the paths are {}",
            Kind::ALL.map(Kind::name).join(", ")
        );
    }
    let kinds: Vec<Kind> = Kind::ALL
        .into_iter()
        .filter(|k| args.paths.is_empty() || args.paths.iter().any(|p| p == k.name()))
        .collect();
    let pairs: Vec<Pair> = kinds
        .iter()
        .enumerate()
        .map(|(i, k)| Pair::new(*k, i as u8 + 1))
        .collect::<Result<_>>()?;
    let registration = kinds.contains(&Kind::HopMmap).then(|| {
        // soft-RoCE where the kernel has it (the VM), for the verbs registration.
        let _ = ipoib_tests::cmlab::rxe_device();
        ring_registration()
    });
    if let Some(r) = &registration {
        eprintln!("packet ring mapping registered: {r}");
    }
    let counts = if args.streams == 1 {
        vec![1]
    } else {
        vec![1, args.streams]
    };
    let mut runs: BTreeMap<(Kind, u32), Vec<Run>> = BTreeMap::new();
    for round in 0..args.rounds {
        for &streams in &counts {
            for p in &pairs {
                let r = p.run(streams, args.seconds, args.len)?;
                let drops = r
                    .ring_drops
                    .map_or(String::new(), |d| format!(", {d} ring drops"));
                eprintln!(
                    "round {}/{}: {:<9} {streams} stream(s): {:6.2} Gbit/s, {:5.2} CPU s/GB{drops}",
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
    report(&args, &kinds, &counts, &runs, registration)
}

fn report(
    args: &Args,
    kinds: &[Kind],
    counts: &[u32],
    runs: &BTreeMap<(Kind, u32), Vec<Run>>,
    registration: Option<serde_json::Value>,
) -> Result<()> {
    let m = |k: Kind, s: u32, f: fn(&Run) -> Option<f64>| {
        let v: Vec<f64> = runs.get(&(k, s))?.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "\nTCP between two namespaces (iperf3, writes of {}), {} s x {} interleaved rounds (median), \
         kernel {}, {cpus} CPUs",
        args.len.map_or("128 KiB".into(), |l| format!("{l} B")),
        args.seconds,
        args.rounds,
        kernel.trim()
    );
    println!(
        "{:<9} {:>7} {:>8} {:>9} {:>10} {:>10} {:>14} {:>12} {:>10} {:>13}",
        "path",
        "streams",
        "Gbit/s",
        "CPU s/GB",
        "Gbit/veth",
        "CPU/veth",
        "relay CPU s/GB",
        "data mean B",
        "small/data",
        "syscalls/pkt"
    );
    let mut rows = Vec::new();
    for &s in counts {
        let veth_g = m(Kind::Veth, s, |r| Some(r.gbit_s)).unwrap_or(f64::NAN);
        let veth_c = m(Kind::Veth, s, |r| Some(r.cpu_s_per_gb)).unwrap_or(f64::NAN);
        for &k in kinds {
            let g = m(k, s, |r| Some(r.gbit_s)).unwrap_or(f64::NAN);
            let c = m(k, s, |r| Some(r.cpu_s_per_gb)).unwrap_or(f64::NAN);
            let rc = m(k, s, |r| r.relay_cpu_s_per_gb);
            let rb = m(k, s, |r| r.relay_data_bytes);
            let ra = m(k, s, |r| r.relay_small_per_data);
            let rs = m(k, s, |r| r.relay_calls_per_packet);
            let opt = |v: Option<f64>, p: usize| v.map_or("-".into(), |v| format!("{v:.p$}"));
            println!(
                "{:<9} {s:>7} {g:>8.2} {c:>9.2} {:>10.2} {:>10.2} {:>14} {:>12} {:>10} {:>13}",
                k.name(),
                g / veth_g,
                c / veth_c,
                opt(rc, 2),
                opt(rb, 0),
                opt(ra, 2),
                opt(rs, 2)
            );
            rows.push(json!({
                "path": k.name(), "streams": s, "gbit_s": g, "cpu_s_per_gb": c,
                "gbit_over_veth": g / veth_g, "cpu_over_veth": c / veth_c,
                "relay_cpu_s_per_gb": rc, "relay_data_bytes": rb, "relay_small_per_data": ra,
                "relay_syscalls_per_packet": rs,
                "rounds": runs[&(k, s)].iter().map(|r| json!({
                    "gbit_s": r.gbit_s, "cpu_s_per_gb": r.cpu_s_per_gb, "ring_drops": r.ring_drops,
                })).collect::<Vec<_>>(),
            }));
        }
    }
    let result = json!({
        "bench": "hop", "kernel": kernel.trim(), "cpus": cpus, "seconds": args.seconds,
        "rounds": args.rounds, "write_len": args.len, "rows": rows, "ring_registration": registration,
    });
    publish(&result, args.out.as_deref())
}
