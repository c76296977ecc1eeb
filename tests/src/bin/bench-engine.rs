//! `cargo xtask bench engine` (inside the soft-RoCE VM): TCP throughput between the two lab
//! nodes with the peer on CM (fast path -> TUN -> engine -> RC on rxe) and with it on UD (the
//! veth), in the same lab and the same boot, interleaved; and the CPU time each path costs per
//! byte (all CPUs, from /proc/stat, over the measurement).
//!
//! CM is measured on both receive models, each in its own lab in the same boot: an SRQ (what
//! soft-RoCE offers) and a receive ring per connection (`attach --srq off`, the model of an HCA
//! without an SRQ).
//!
//! The path is switched with the policy, as an operator would: `mode=connected` promotes the
//! peer (the measurement starts once it is `cm_up`), `mode=datagram` drains it.
//!
//! Beside them, in each round: the engine's message rate during the CM run (RC messages
//! posted per second, from A's engine counters) against `ib_send_bw` between the same two
//! namespaces on the same device, with the engine's mean message size, 1 QP and the engine's
//! window: how much of the raw RC message rate the engine carries while the kernel's TCP runs
//! on both ends. Then `ib_send_bw` once more, while a TCP flow crosses from A to B over UD at
//! the CM run's rate: the yardstick with neighbours like the engine's, so what the neighbours
//! take from the device's rate is told apart from what the engine costs. The result is one
//! JSON line after `BENCH-JSON `.
//!
//! Each run also says where the CPUs went (user, system, interrupts and softirqs, and each
//! node's `ipoib-ctl`), and each round the sender's CPU time per message: A's `ipoib-ctl`
//! against `ib_send_bw`'s client. On soft-RoCE a user QP's sends are built by the kernel
//! inside the post call, so both hold the device's work: whether the engine is held back by
//! its own thread, and by what beyond the device, is read off these. `--streams N` offers
//! the engine N TCP streams instead of one.
//!
//! With `--baseline-ctl PATH`, a third lab runs that `ipoib-ctl` (built from another commit)
//! and its CM run joins each round: the engine before and after a change, side by side in
//! one boot (on an SRQ; with `--baseline-rings`, on rings per connection, beside this build's
//! rings).

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use clap::Parser;
use ipoib_ctl::{engine::EngineConfig, maps::PeerCacheCounts, status::PeerModeView, verbs::Device};
use ipoib_tests::{
    bench::{CpuSplit, TICKS_PER_S, stat_user_system},
    cmlab::rxe_device,
    lab::{Lab, Node, Which, json_u64},
    perftest::{SendBw, SendBwRate},
};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 8)]
    seconds: u32,
    /// Interleaved rounds (CM, then UD); the median of each is reported (at least 5: one
    /// round in three can be far off under emulation).
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Parallel TCP streams (iperf3 -P): more offered to the engine than one stream's window.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=16))]
    streams: u32,
    /// An `ipoib-ctl` from another commit, measured on CM (SRQ) in each round beside this one.
    #[arg(long)]
    baseline_ctl: Option<std::path::PathBuf>,
    /// The baseline receives on rings per connection (`attach --srq off`), and is compared
    /// with this build's CM on rings.
    #[arg(long, requires = "baseline_ctl")]
    baseline_rings: bool,
    /// Runs the `ipoib-ctl` of A (the sender), or of both nodes with `--ctl-nice-both`, at
    /// this nice value (an experiment: whether the engine's rate follows the CPU its thread
    /// gets; 0 leaves them as started).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    ctl_nice: i32,
    /// `--ctl-nice` for B's `ipoib-ctl` too.
    #[arg(long)]
    ctl_nice_both: bool,
}

/// Every thread of process `pid` at `nice` (on Linux a nice value is a thread's: setpriority
/// on the PID would change the main thread's alone; threads made later inherit their maker's).
fn renice(pid: u32, nice: i32) -> Result<()> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let tid: u32 = task?.file_name().to_string_lossy().parse()?;
        // SAFETY: a plain syscall on a thread id.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) };
        ensure!(
            rc == 0,
            "setpriority({tid}, {nice}): {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

fn wait_mode(a: &Node, peer: &str, mode: PeerModeView, within: Duration) -> Result<()> {
    a.wait_peer_mode(peer, mode, within)
        .map(|_| ())
        .with_context(|| format!("{peer} did not become {mode} in {within:?}"))
}

fn set_mode(a: &Node, mode: &str) -> Result<()> {
    a.set_policy(&format!("mode={mode}"))?;
    Ok(())
}

#[derive(Clone, Copy, Debug)]
struct Run {
    mbit_s: f64,
    /// CPU seconds (all CPUs) per GB moved.
    cpu_s_per_gb: f64,
    /// Share of the bytes the fast path counted on CM.
    cm_share: f64,
    /// RC messages A's engine posted, per second, and their mean size.
    engine_msg_per_s: f64,
    engine_msgs: u64,
    engine_mean_size: f64,
    /// The mean number of sends in flight on the connection as A's engine posted each one
    /// (up to its window, `max_send_wr`), and how many packets found the window full.
    engine_depth: f64,
    engine_window_waits: u64,
    /// A's `ipoib-ctl` CPU time per RC message its engine posted (seconds): on soft-RoCE a
    /// send is built in the kernel within the post call, so this holds the device's work too.
    ctl_a_cpu_s_per_msg: f64,
    /// RNR NAKs the RDMA devices received during the run (a receiver out of posted buffers
    /// told a sender to wait), when the device counts them.
    rnr_naks: Option<u64>,
    /// Where the CPUs went, in CPUs busy on average over the run (2 = both, all the time):
    /// userspace, system, interrupts and softirqs; and A's and B's `ipoib-ctl` processes
    /// (every thread; a syscall's kernel work included, softirqs not).
    cpus: Cpus,
    /// A's peer cache over the run (its programs' own counts): lookups, and how many hit.
    /// None where A's programs do not count (a baseline build from before the counts).
    cache: Option<CacheRun>,
}

#[derive(Clone, Copy, Debug, Default)]
struct CacheRun {
    lookups: u64,
    hits: u64,
}

impl CacheRun {
    /// The cache's lookups and hits so far, as `status --json` shows them, if it does.
    fn of(status: &serde_json::Value) -> Option<Self> {
        let c: PeerCacheCounts = serde_json::from_value(status.get("peer_cache")?.clone()).ok()?;
        Some(Self {
            lookups: c.lookups(),
            hits: c.hits,
        })
    }

    fn since(self, before: Self) -> Self {
        Self {
            lookups: self.lookups.saturating_sub(before.lookups),
            hits: self.hits.saturating_sub(before.hits),
        }
    }

    fn hit_percent(&self) -> f64 {
        self.hits as f64 * 100.0 / self.lookups.max(1) as f64
    }
}

/// A run's peer-cache line, or what it lacks.
fn cache_line(r: &Run) -> String {
    r.cache.map_or("A's peer cache: not counted".into(), |c| {
        format!(
            "A's peer cache: {:.2}% of {} lookups hit",
            c.hit_percent(),
            c.lookups
        )
    })
}

fn cache_json(r: &Run) -> serde_json::Value {
    r.cache.map_or(serde_json::Value::Null, |c| {
        json!({"lookups": c.lookups, "hits": c.hits,
               "hit_percent": (c.hit_percent() * 100.0).round() / 100.0})
    })
}

#[derive(Clone, Copy, Debug, Default)]
struct Cpus {
    user: f64,
    system: f64,
    irq: f64,
    ctl_a: f64,
    /// The part of `ctl_a` spent in userspace: the engine's own code.
    ctl_a_user: f64,
    ctl_b: f64,
}

impl Cpus {
    fn line(&self) -> String {
        format!(
            "CPUs busy: user {:.2}, system {:.2}, irq+softirq {:.2}; ipoib-ctl A {:.2} (user {:.2}), B {:.2}",
            self.user, self.system, self.irq, self.ctl_a, self.ctl_a_user, self.ctl_b
        )
    }

    fn json(&self) -> serde_json::Value {
        let r2 = |x: f64| (x * 100.0).round() / 100.0;
        json!({"user": r2(self.user), "system": r2(self.system), "irq": r2(self.irq),
               "ctl_a": r2(self.ctl_a), "ctl_a_user": r2(self.ctl_a_user), "ctl_b": r2(self.ctl_b)})
    }
}

/// The `ipoib-ctl attach` processes of a lab's two nodes.
#[derive(Clone, Copy)]
struct Ctls {
    a: u32,
    b: u32,
}

impl Ctls {
    /// (user, system) ticks of A's process and of B's.
    fn ticks(&self) -> Result<[(u64, u64); 2]> {
        let of = |pid: u32| stat_user_system(&format!("/proc/{pid}/stat"));
        Ok([of(self.a)?, of(self.b)?])
    }
}

/// One round's CM run beside `ib_send_bw` between the same namespaces: polling (the rate's
/// yardstick) and on events (the CPU per message's).
#[derive(Clone, Copy)]
struct PerfRound {
    engine: Run,
    polling: SendBwRate,
    events: SendBwRate,
    beside: Beside,
}

impl PerfRound {
    /// The engine's message rate over `ib_send_bw`'s.
    fn ratio(&self) -> f64 {
        self.engine.engine_msg_per_s / self.polling.msg_per_s
    }
}

/// RNR NAKs received so far, summed over every RDMA device and port (`rcvd_rnr_err`, which
/// rxe and mlx5 count); None when no device has the counter.
fn rnr_naks() -> Option<u64> {
    let naks: Vec<u64> = ipoib_tests::cmlab::rdma_hw_counters()
        .into_iter()
        .filter_map(|(_, k, n)| (k == "rcvd_rnr_err").then_some(n))
        .collect();
    (!naks.is_empty()).then(|| naks.iter().sum())
}

/// A run's RNR NAKs, or "?" where the device does not count them.
fn naks(r: &Run) -> String {
    r.rnr_naks.map_or("?".into(), |n| n.to_string())
}

/// `ib_send_bw` measured again while a TCP flow crosses from A to B over UD (the lab's veth)
/// at the CM run's rate: the yardstick with neighbours like the engine's (iperf3's ends and
/// both nodes' TCP stacks on the same two vCPUs), to tell what the neighbours take from the
/// device's rate apart from what the engine does.
#[derive(Clone, Copy, Debug)]
struct Beside {
    perf: SendBwRate,
    /// The flow's rate over UD while `ib_send_bw` ran, from A's fast-path counters.
    flow_mbit_s: f64,
}

fn send_bw_beside_flow(
    a: &Node,
    b: &Node,
    perftest: &SendBw,
    iters: u64,
    mbit_s: f64,
    streams: u32,
) -> Result<Beside> {
    let b_ip = b.ip4.to_string();
    let ud_bytes = || -> Result<u64> {
        let p = a.peer_json(&b_ip)?.context("A knows B")?;
        Ok(p["tx_ud_bytes"].as_u64().unwrap_or(0))
    };
    // iperf3's -b is per stream.
    let per_stream = format!("{:.0}M", (mbit_s / f64::from(streams)).max(1.0));
    let mut flow = a
        .cmd("iperf3")
        .args(["-c", &b_ip, "-p", "5210", "-t", "300", "-b", &per_stream])
        .args(["-P", &streams.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("iperf3 client (the flow beside ib_send_bw)")?;
    std::thread::sleep(Duration::from_secs(1));
    let (t0, bytes0) = (Instant::now(), ud_bytes());
    let perf = perftest.rate(iters);
    let (secs, bytes1) = (t0.elapsed().as_secs_f64(), ud_bytes());
    // SIGINT, not SIGKILL: the client ends the test with the server, which is then free for
    // the next run (`nsenter` execs iperf3, so this is its PID).
    // SAFETY: a signal to our own child, not yet waited for.
    unsafe { libc::kill(flow.id() as libc::pid_t, libc::SIGINT) };
    let _ = flow.wait();
    std::thread::sleep(Duration::from_millis(300));
    let sent = bytes1?.saturating_sub(bytes0?);
    Ok(Beside {
        perf: perf?,
        flow_mbit_s: sent as f64 * 8.0 / secs / 1e6,
    })
}

fn iperf(a: &Node, b: &Node, ctls: Ctls, secs: u32, streams: u32) -> Result<Run> {
    let b_ip = b.ip4.to_string();
    let before = a.peer_json(&b_ip)?.context("A knows B")?;
    // (packets, bytes, depth sum, window waits) A's engine counted, and A's peer cache.
    let engine = |n: &Node| -> Result<([u64; 4], Option<CacheRun>)> {
        let s = n.status_json()?;
        let e = &s["cm"]["engine"];
        let c = ["tx_packets", "tx_bytes", "tx_depth_sum", "tx_window_waits"];
        Ok((c.map(|k| json_u64(e, k)), CacheRun::of(&s)))
    };
    let (e0, cache0) = engine(a)?;
    let rnr0 = rnr_naks();
    let t0 = Instant::now();
    let (split0, ctl0) = (CpuSplit::now()?, ctls.ticks()?);
    let out = a
        .cmd("iperf3")
        .args(["-c", &b_ip, "-p", "5210", "-t", &secs.to_string(), "-J"])
        .args(["-P", &streams.to_string()])
        .output()
        .context("iperf3 client")?;
    let (split, ctl1) = (CpuSplit::now()?.since(split0), ctls.ticks()?);
    let secs_run = t0.elapsed().as_secs_f64();
    let busy = |ticks: u64| ticks as f64 / TICKS_PER_S / secs_run;
    // (user, system) ticks node `i`'s ipoib-ctl spent during the run.
    let spent = |i: usize| {
        (
            ctl1[i].0.saturating_sub(ctl0[i].0),
            ctl1[i].1.saturating_sub(ctl0[i].1),
        )
    };
    let ((a_user, a_system), (b_user, b_system)) = (spent(0), spent(1));
    let a_ticks = a_user + a_system;
    let (e1, cache1) = engine(a)?;
    let msgs = e1[0] - e0[0];
    let rnr1 = rnr_naks();
    ensure!(
        out.status.success(),
        "iperf3: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let after = a.peer_json(&b_ip)?.context("A knows B")?;
    let r: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let bytes = r["end"]["sum_received"]["bytes"].as_f64().unwrap_or(0.0);
    let bps = r["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or(0.0);
    let d = |k: &str| after[k].as_u64().unwrap_or(0) - before[k].as_u64().unwrap_or(0);
    let (cm, ud) = (d("tx_cm_bytes") as f64, d("tx_ud_bytes") as f64);
    let cpu_s = split.busy as f64 / TICKS_PER_S;
    Ok(Run {
        mbit_s: bps / 1e6,
        cpu_s_per_gb: cpu_s / (bytes / 1e9),
        cm_share: cm / (cm + ud).max(1.0),
        engine_msg_per_s: msgs as f64 / secs_run,
        engine_msgs: msgs,
        engine_mean_size: (e1[1] - e0[1]) as f64 / msgs.max(1) as f64,
        engine_depth: (e1[2] - e0[2]) as f64 / msgs.max(1) as f64,
        engine_window_waits: e1[3] - e0[3],
        ctl_a_cpu_s_per_msg: a_ticks as f64 / TICKS_PER_S / msgs.max(1) as f64,
        rnr_naks: rnr0.zip(rnr1).map(|(x, y)| y.saturating_sub(x)),
        cpus: Cpus {
            user: busy(split.user),
            system: busy(split.system),
            irq: busy(split.irq),
            ctl_a: busy(a_ticks),
            ctl_a_user: busy(a_user),
            ctl_b: busy(b_user + b_system),
        },
        cache: cache1.zip(cache0).map(|(c1, c0)| c1.since(c0)),
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = rxe_device().context("no RDMA device and none could be made (rdma_rxe)")?;
    let mut lab = Lab::new("bne", false)?;
    let mut rings = Lab::new("bnr", false)?;
    let mut baseline = match &args.baseline_ctl {
        Some(exe) => {
            ensure!(exe.exists(), "{} does not exist", exe.display());
            let mut l = Lab::new("bnb", false)?;
            l.run_ctl(exe);
            Some(l)
        }
        None => None,
    };
    let result = bench(&mut lab, &mut rings, baseline.as_mut(), &dev, &args);
    lab.teardown();
    rings.teardown();
    if let Some(l) = baseline.as_mut() {
        l.teardown();
    }
    result
}

/// Both nodes of `lab` attached (with `extra`), and an iperf3 server on B.
fn start(lab: &mut Lab, dev: &str, extra: &[&str]) -> Result<(std::process::Child, Ctls)> {
    let args: Vec<&str> = ["--cm-device", dev].iter().chain(extra).copied().collect();
    let ctls = Ctls {
        a: lab.attach(Which::A, &args)?,
        b: lab.attach(Which::B, &args)?,
    };
    let b_ip = lab.b.ip4.to_string();
    let server = lab
        .b
        .cmd("iperf3")
        .args(["-s", "-B", &b_ip, "-p", "5210"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("iperf3 server")?;
    std::thread::sleep(Duration::from_millis(300));
    Ok((server, ctls))
}

/// The flow from A to B once B is CM at A (mode=connected promotes it as soon as A sends it
/// anything, after the hold that follows the previous round's demotion).
fn cm_run(a: &Node, b: &Node, ctls: Ctls, secs: u32, streams: u32) -> Result<Run> {
    let b_ip = b.ip4.to_string();
    set_mode(a, "connected")?;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(30)
        && a.peer_json(&b_ip)?.is_none_or(|p| p["mode"] != "cm_up")
    {
        let _ = a.cmd("ping").args(["-c", "1", "-W", "1", &b_ip]).output();
        std::thread::sleep(Duration::from_millis(500));
    }
    wait_mode(a, &b_ip, PeerModeView::CmUp, Duration::from_secs(1))?;
    iperf(a, b, ctls, secs, streams)
}

fn bench(
    lab: &mut Lab,
    rings: &mut Lab,
    mut baseline: Option<&mut Lab>,
    dev: &str,
    args: &Args,
) -> Result<()> {
    let (mut server, ctls) = start(lab, dev, &[])?;
    let (mut rings_server, ring_ctls) = start(rings, dev, &["--srq", "off"])?;
    if args.ctl_nice != 0 {
        let mut pids = vec![ctls.a, ring_ctls.a];
        if args.ctl_nice_both {
            pids.extend([ctls.b, ring_ctls.b]);
        }
        for pid in pids {
            renice(pid, args.ctl_nice)?;
        }
        eprintln!(
            "{} at nice {}",
            if args.ctl_nice_both {
                "both nodes' ipoib-ctl"
            } else {
                "A's ipoib-ctl"
            },
            args.ctl_nice
        );
    }
    let base_extra: &[&str] = if args.baseline_rings {
        &["--srq", "off"]
    } else {
        &[]
    };
    let (mut base_server, base_ctls) = match baseline.as_mut() {
        Some(l) => {
            let (s, c) = start(l, dev, base_extra)?;
            (Some(s), Some(c))
        }
        None => (None, None),
    };
    let base_nodes = baseline.as_ref().map(|l| (l.a.clone(), l.b.clone()));
    let mut base_runs = Vec::new();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let (ra, rb) = (rings.a.clone(), rings.b.clone());
    let b_ip = b.ip4.to_string();
    let gid_index = Device::open(dev)?.first_address(1)?.gid_index;
    let window = EngineConfig::default().max_send_wr;
    let mut cm_runs = Vec::new();
    let mut ring_runs = Vec::new();
    let mut ud_runs = Vec::new();
    let mut perf_runs: Vec<PerfRound> = Vec::new();
    let mut err = None;
    for round in 0..args.rounds {
        let r = (|| -> Result<()> {
            let cm = cm_run(&a, &b, ctls, args.seconds, args.streams)?;
            // Raw RC between the same namespaces, messages of the engine's mean size, about
            // as many as the engine moved.
            let perftest = SendBw {
                dev,
                gid_index,
                size: (cm.engine_mean_size.round() as u32).clamp(1, 65520),
                window,
                qps: 1,
                server_ns: &b.ns,
                client_ns: Some(&a.ns),
                server: b.ip4.into(),
                events: false,
            };
            let perf_rate = perftest.rate(cm.engine_msgs)?;
            let perf = perf_rate.msg_per_s;
            // The same on a completion channel, as the engine waits: its client's CPU is
            // then the work a message costs, without the spinning (not the yardstick of the
            // rate: ib_send_bw's default, polling, is the device's best).
            let perf_events = SendBw {
                events: true,
                ..perftest
            }
            .rate(cm.engine_msgs)?;
            // UD: mode=datagram drains the connection; the fast path sends everything UD.
            set_mode(&a, "datagram")?;
            wait_mode(&a, &b_ip, PeerModeView::Ud, Duration::from_secs(10))?;
            let beside =
                send_bw_beside_flow(&a, &b, &perftest, cm.engine_msgs, cm.mbit_s, args.streams)?;
            // CM again, on rings per connection, in the other lab.
            let on_rings = cm_run(&ra, &rb, ring_ctls, args.seconds, args.streams)?;
            set_mode(&ra, "datagram")?;
            wait_mode(
                &ra,
                &rb.ip4.to_string(),
                PeerModeView::Ud,
                Duration::from_secs(10),
            )?;
            let ud = iperf(&a, &b, ctls, args.seconds, args.streams)?;
            if let (Some((ba, bb)), Some(bc)) = (&base_nodes, base_ctls) {
                let base = cm_run(ba, bb, bc, args.seconds, args.streams)?;
                set_mode(ba, "datagram")?;
                wait_mode(
                    ba,
                    &bb.ip4.to_string(),
                    PeerModeView::Ud,
                    Duration::from_secs(10),
                )?;
                let (model, mine) = if args.baseline_rings {
                    ("rings", &on_rings)
                } else {
                    ("SRQ", &cm)
                };
                eprintln!(
                    "round {round}: baseline CM on {model} {:.0} Mbit/s ({:.1} CPU s/GB, engine {:.0} msg/s of {:.0} B, {} RNR NAKs) \
                     against this build's {:.0} Mbit/s ({:.1} CPU s/GB, engine {:.0} msg/s of {:.0} B, {} RNR NAKs)",
                    base.mbit_s,
                    base.cpu_s_per_gb,
                    base.engine_msg_per_s,
                    base.engine_mean_size,
                    naks(&base),
                    mine.mbit_s,
                    mine.cpu_s_per_gb,
                    mine.engine_msg_per_s,
                    mine.engine_mean_size,
                    naks(mine)
                );
                base_runs.push(base);
            }
            eprintln!(
                "round {round}: CM {:.0} Mbit/s ({:.1} CPU s/GB, {:.0}% counted CM, engine {:.0} msg/s of {:.0} B \
                 at depth {:.1} of {window} ({} window waits), {} RNR NAKs); \
                 CM on rings {:.0} Mbit/s ({:.1} CPU s/GB, {:.0}% counted CM, {} RNR NAKs); \
                 UD {:.0} Mbit/s ({:.1} CPU s/GB); ib_send_bw {perf:.0} msg/s",
                cm.mbit_s,
                cm.cpu_s_per_gb,
                cm.cm_share * 100.0,
                cm.engine_msg_per_s,
                cm.engine_mean_size,
                cm.engine_depth,
                cm.engine_window_waits,
                naks(&cm),
                on_rings.mbit_s,
                on_rings.cpu_s_per_gb,
                on_rings.cm_share * 100.0,
                naks(&on_rings),
                ud.mbit_s,
                ud.cpu_s_per_gb
            );
            for (path, r) in [("CM", &cm), ("CM on rings", &on_rings), ("UD", &ud)] {
                eprintln!(
                    "round {round}: {path}: {}; {}",
                    r.cpus.line(),
                    cache_line(r)
                );
            }
            eprintln!(
                "round {round}: sender's CPU per message: A's ipoib-ctl {:.2} ms; ib_send_bw's client {:.2} ms polling, \
                 {:.2} ms on events ({:.0} msg/s)",
                cm.ctl_a_cpu_s_per_msg * 1e3,
                perf_rate.client_cpu_s_per_msg * 1e3,
                perf_events.client_cpu_s_per_msg * 1e3,
                perf_events.msg_per_s
            );
            eprintln!(
                "round {round}: ib_send_bw beside a TCP flow over UD of {:.0} Mbit/s: {:.0} msg/s \
                 ({:.2} of alone); the engine over it: {:.2}",
                beside.flow_mbit_s,
                beside.perf.msg_per_s,
                beside.perf.msg_per_s / perf,
                cm.engine_msg_per_s / beside.perf.msg_per_s
            );
            perf_runs.push(PerfRound {
                engine: cm,
                polling: perf_rate,
                events: perf_events,
                beside,
            });
            cm_runs.push(cm);
            ring_runs.push(on_rings);
            ud_runs.push(ud);
            Ok(())
        })();
        if let Err(e) = r {
            err = Some(e);
            break;
        }
    }
    for s in [&mut server, &mut rings_server]
        .into_iter()
        .chain(base_server.as_mut())
    {
        let _ = s.kill();
        let _ = s.wait();
    }
    if let Some(e) = err {
        return Err(e);
    }
    let med = |v: &mut Vec<Run>| {
        v.sort_by(|x, y| x.mbit_s.total_cmp(&y.mbit_s));
        v[v.len() / 2]
    };
    // Per round, this build's engine rate over the baseline's (before a median is taken).
    let mine = if args.baseline_rings {
        &ring_runs
    } else {
        &cm_runs
    };
    let mut base_ratio: Vec<f64> = mine
        .iter()
        .zip(&base_runs)
        .map(|(c, b)| c.engine_msg_per_s / b.engine_msg_per_s)
        .collect();
    base_ratio.sort_by(f64::total_cmp);
    let base = (!base_runs.is_empty()).then(|| med(&mut base_runs));
    let (cm, on_rings, ud) = (med(&mut cm_runs), med(&mut ring_runs), med(&mut ud_runs));
    // Beside a flow over UD, by round: ib_send_bw's rate over its rate alone, the engine's
    // over it, and the flow's rate; the median of each.
    let median_of = |f: &dyn Fn(&PerfRound) -> f64| {
        let mut v: Vec<f64> = perf_runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let beside_over_alone = median_of(&|p| p.beside.perf.msg_per_s / p.polling.msg_per_s);
    let engine_over_beside = median_of(&|p| p.engine.engine_msg_per_s / p.beside.perf.msg_per_s);
    let beside_flow = median_of(&|p| p.beside.flow_mbit_s);
    perf_runs.sort_by(|x, y| x.ratio().total_cmp(&y.ratio()));
    // The round with the median ratio, its own figures beside it.
    let median = perf_runs[perf_runs.len() / 2];
    let (engine_over_perftest, engine_rate, engine_size, perf, engine_cpu, perf_cpu) = (
        median.ratio(),
        median.engine.engine_msg_per_s,
        median.engine.engine_mean_size,
        median.polling.msg_per_s,
        median.engine.ctl_a_cpu_s_per_msg,
        median.events.client_cpu_s_per_msg,
    );
    let r1 = |x: f64| (x * 10.0).round() / 10.0;
    let out = json!({
        "bench": "engine",
        "device": dev,
        "kernel": String::from_utf8_lossy(&Command::new("uname").arg("-r").output()?.stdout).trim(),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "streams": args.streams,
        "ctl_nice": args.ctl_nice,
        "ctl_nice_both": args.ctl_nice_both,
        "cm": {"mbit_s": r1(cm.mbit_s), "cpu_s_per_gb": r1(cm.cpu_s_per_gb), "cm_share": r1(cm.cm_share * 100.0) / 100.0, "rnr_naks": cm.rnr_naks, "cpus": cm.cpus.json(), "peer_cache": cache_json(&cm),
               "engine_depth": r1(cm.engine_depth), "engine_window_waits": cm.engine_window_waits},
        "cm_rings": {"mbit_s": r1(on_rings.mbit_s), "cpu_s_per_gb": r1(on_rings.cpu_s_per_gb), "cm_share": r1(on_rings.cm_share * 100.0) / 100.0, "rnr_naks": on_rings.rnr_naks, "cpus": on_rings.cpus.json(), "peer_cache": cache_json(&on_rings)},
        "ud": {"mbit_s": r1(ud.mbit_s), "cpu_s_per_gb": r1(ud.cpu_s_per_gb), "cpus": ud.cpus.json(), "peer_cache": cache_json(&ud)},
        "cm_over_ud": (cm.mbit_s / ud.mbit_s * 1000.0).round() / 1000.0,
        "engine_msg_per_s": engine_rate.round(),
        "engine_mean_size": engine_size.round(),
        "ib_send_bw_msg_per_s": perf.round(),
        "engine_over_ib_send_bw": (engine_over_perftest * 1000.0).round() / 1000.0,
        "engine_ctl_cpu_ms_per_msg": (engine_cpu * 1e5).round() / 100.0,
        "ib_send_bw_events_client_cpu_ms_per_msg": (perf_cpu * 1e5).round() / 100.0,
        "ib_send_bw_beside_ud_flow": {"flow_mbit_s": r1(beside_flow),
            "over_alone": (beside_over_alone * 1000.0).round() / 1000.0,
            "engine_over_it": (engine_over_beside * 1000.0).round() / 1000.0},
        "baseline": base.map(|b| json!({
            "ctl": args.baseline_ctl.as_ref().map(|p| p.display().to_string()),
            "receives": if args.baseline_rings { "rings" } else { "srq" },
            "mbit_s": r1(b.mbit_s), "cpu_s_per_gb": r1(b.cpu_s_per_gb),
            "engine_msg_per_s": b.engine_msg_per_s.round(), "rnr_naks": b.rnr_naks,
            "engine_over_baseline": base_ratio.get(base_ratio.len() / 2).map(|r| (r * 1000.0).round() / 1000.0),
        })),
    });
    println!(
        "\n{:>9} {:>10} {:>12} {:>10} {:>22}",
        "path", "Mbit/s", "CPU s/GB", "CM share", "A's peer cache hits"
    );
    let mut paths = vec![("CM, SRQ", cm), ("CM, rings", on_rings), ("UD", ud)];
    if let Some(b) = base {
        paths.push(("baseline", b));
    }
    for (path, r) in paths {
        let cache = r.cache.map_or("not counted".into(), |c| {
            format!("{:.2}% of {}", c.hit_percent(), c.lookups)
        });
        println!(
            "{path:>9} {:>10.0} {:>12.1} {:>9.0}% {cache:>22}",
            r.mbit_s,
            r.cpu_s_per_gb,
            r.cm_share * 100.0
        );
    }
    println!(
        "engine: {:.0} msg/s of {:.0} B (CM run) vs ib_send_bw {perf:.0} msg/s: {engine_over_perftest:.2} (median round)",
        engine_rate, engine_size
    );
    println!(
        "sender's CPU per message, that round: A's ipoib-ctl {:.2} ms, ib_send_bw's client (on events) {:.2} ms",
        engine_cpu * 1e3,
        perf_cpu * 1e3
    );
    println!(
        "ib_send_bw beside a TCP flow over UD ({beside_flow:.0} Mbit/s): {beside_over_alone:.2} of its rate alone; \
         the engine over it: {engine_over_beside:.2} (medians of the rounds)"
    );
    println!("BENCH-JSON {out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runs_cache_is_the_difference_of_two_status_readings() {
        let at = |hits: u64, stale: u64, other: u64| {
            json!({"peer_cache": {"hits": hits, "misses_stale": stale,
                                  "misses_other": other, "slots_filled": 2}})
        };
        let before = CacheRun::of(&at(10, 1, 2)).unwrap();
        let after = CacheRun::of(&at(1010, 3, 7)).unwrap();
        let run = after.since(before);
        assert_eq!((run.lookups, run.hits), (1007, 1000));
        assert!((run.hit_percent() - 100_000.0 / 1007.0).abs() < 1e-9);
        // A status without the counts (an earlier build's programs): not counted.
        assert!(CacheRun::of(&json!({"peer_cache": null})).is_none());
        assert!(CacheRun::of(&json!({})).is_none());
    }
}
