//! `cargo xtask bench lanes` (inside the soft-RoCE VM): the CM engine on one lane against two,
//! in one boot, interleaved: TCP from node A to node B's two addresses at once, each routed
//! over a connection of its own (two peers' worth of traffic), through A's engines (in this
//! process: one lane, or two with a TUN queue and a thread each) and B's (`cm-node --queues`,
//! as many lanes as A). Each round runs both, in turn first. Per run: Gbit/s of both iperf3
//! clients together, CPU seconds per GB of all CPUs and of each node's engine process, and how
//! A's bytes split over its lanes. The result is one JSON line after `BENCH-JSON `.
//!
//! Two lanes can only pay where the engine's thread is what limits: under emulation on two
//! vCPUs soft-RoCE's own work in the kernel shares the same CPUs, so read the split of CPU
//! time beside the rate.

use std::{
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use clap::Parser;
use ipoib_tests::{
    bench::{CpuSplit, TICKS_PER_S, median, stat_ticks},
    cmlab::{COUNTED, Netns, rdma_resources, rxe_device, settle},
    lanes::LanePair,
};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Seconds per measurement.
    #[arg(long, default_value_t = 8)]
    seconds: u32,
    /// Rounds (each runs one lane and two, in turn first); the median is reported.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// TCP streams to each of B's addresses (iperf3 -P).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=8))]
    streams: u32,
}

/// One measurement.
struct Run {
    lanes: u32,
    gbit_s: f64,
    cpu_s_per_gb: f64,
    a_cpu_s_per_gb: f64,
    b_cpu_s_per_gb: f64,
    /// A's bytes sent, by lane.
    lane_bytes: Vec<u64>,
    /// A's RC messages sent per second (all lanes), and their mean size.
    a_msg_per_s: f64,
    a_mean_msg: f64,
    /// CPUs busy (of the VM's), on average over the run.
    cpus_busy: f64,
}

impl Run {
    fn json(&self) -> serde_json::Value {
        json!({
            "lanes": self.lanes,
            "gbit_s": self.gbit_s,
            "cpu_s_per_gb": self.cpu_s_per_gb,
            "a_cpu_s_per_gb": self.a_cpu_s_per_gb,
            "b_cpu_s_per_gb": self.b_cpu_s_per_gb,
            "lane_bytes": self.lane_bytes,
            "a_msg_per_s": self.a_msg_per_s,
            "a_mean_msg": self.a_mean_msg,
            "cpus_busy": self.cpus_busy,
        })
    }

    fn line(&self) -> String {
        format!(
            "{} lane(s): {:.3} Gbit/s, {:.1} CPU s/GB (A's engines {:.1}, B's {:.1}), {:.2} CPUs \
             busy; A sent {:.0} msg/s of {:.0} B on average, its bytes by lane {:?}",
            self.lanes,
            self.gbit_s,
            self.cpu_s_per_gb,
            self.a_cpu_s_per_gb,
            self.b_cpu_s_per_gb,
            self.cpus_busy,
            self.a_msg_per_s,
            self.a_mean_msg,
            self.lane_bytes
        )
    }
}

/// An iperf3 server in `ns` for one test on `port`.
fn server(ns: &str, port: u16) -> Result<Child> {
    Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "iperf3",
            "-s",
            "-1",
            "-p",
            &port.to_string(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("iperf3 server")
}

fn measure(dev: &str, ns: &Netns, lanes: u32, secs: u32, streams: u32) -> Result<Run> {
    let baseline = rdma_resources(dev);
    let pair = LanePair::start(dev, ns, (8, 3), lanes, false)?;
    let mut servers = [server(&ns.name, 5211)?, server(&ns.name, 5212)?];
    std::thread::sleep(Duration::from_millis(300));
    let b_stat = format!("/proc/{}/stat", pair.peer.child.id());
    let lane_bytes =
        |p: &LanePair| -> Vec<u64> { p.lanes().iter().map(|l| l["tx_bytes"]).collect() };
    let msgs = |p: &LanePair| -> u64 { p.lanes().iter().map(|l| l["tx_packets"]).sum() };
    let msgs0 = msgs(&pair);
    let (bytes0, split0) = (lane_bytes(&pair), CpuSplit::now()?);
    let (a0, b0) = (stat_ticks("/proc/self/stat")?, stat_ticks(&b_stat)?);
    let t0 = Instant::now();
    let clients: Vec<_> = pair
        .dsts
        .iter()
        .zip([5211, 5212])
        .map(|(dst, port)| {
            Command::new("iperf3")
                .args(["-c", &dst.to_string(), "-p", &port.to_string(), "-J"])
                .args(["-t", &secs.to_string(), "-P", &streams.to_string()])
                .stdout(Stdio::piped())
                .spawn()
                .context("iperf3 client")
        })
        .collect::<Result<_>>()?;
    let outs: Vec<_> = clients
        .into_iter()
        .map(|c| c.wait_with_output())
        .collect::<std::io::Result<_>>()?;
    let secs_run = t0.elapsed().as_secs_f64();
    let split = CpuSplit::now()?.since(split0);
    let (a1, b1) = (stat_ticks("/proc/self/stat")?, stat_ticks(&b_stat)?);
    let (bytes1, msgs1) = (lane_bytes(&pair), msgs(&pair) - msgs0);
    let (mut bytes, mut bps) = (0.0, 0.0);
    for out in &outs {
        ensure!(
            out.status.success(),
            "iperf3: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let r: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        bytes += r["end"]["sum_received"]["bytes"].as_f64().unwrap_or(0.0);
        bps += r["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .unwrap_or(0.0);
    }
    for s in &mut servers {
        let _ = s.wait();
    }
    ensure!(bytes > 0.0, "nothing crossed");
    let gb = bytes / 1e9;
    let lane_bytes: Vec<u64> = bytes1.iter().zip(&bytes0).map(|(x, y)| x - y).collect();
    let per_gb = |ticks: u64| ticks as f64 / TICKS_PER_S / gb;
    let run = Run {
        lanes,
        gbit_s: bps / 1e9,
        cpu_s_per_gb: per_gb(split.busy),
        a_cpu_s_per_gb: per_gb(a1.saturating_sub(a0)),
        b_cpu_s_per_gb: per_gb(b1.saturating_sub(b0)),
        a_msg_per_s: msgs1 as f64 / secs_run,
        a_mean_msg: lane_bytes.iter().sum::<u64>() as f64 / msgs1.max(1) as f64,
        lane_bytes,
        cpus_busy: split.busy as f64 / TICKS_PER_S / secs_run,
    };
    drop(pair.stop()?);
    settle(dev, &baseline, COUNTED);
    Ok(run)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev =
        rxe_device().context("no soft-RoCE device (run inside the VM: cargo xtask bench lanes)")?;
    let ns = Netns::new("lanes", 8);
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "==> {} rounds of {} s: TCP to two addresses of B ({} streams each), one lane against \
         two, {cpus} CPUs",
        args.rounds, args.seconds, args.streams
    );
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let order = if round % 2 == 0 { [1, 2] } else { [2, 1] };
        let mut runs = Vec::new();
        for lanes in order {
            let r = measure(&dev, &ns, lanes, args.seconds, args.streams)
                .with_context(|| format!("round {round}, {lanes} lane(s)"))?;
            println!("round {round}: {}", r.line());
            runs.push(r);
        }
        runs.sort_by_key(|r| r.lanes);
        let ratio = runs[1].gbit_s / runs[0].gbit_s;
        println!("round {round}: two lanes / one: {ratio:.2}x the rate");
        rounds.push(runs);
    }
    let of = |lanes: usize, f: fn(&Run) -> f64| -> f64 {
        median(&rounds.iter().map(|r| f(&r[lanes])).collect::<Vec<_>>())
    };
    let ratios: Vec<f64> = rounds.iter().map(|r| r[1].gbit_s / r[0].gbit_s).collect();
    let cpu_ratios: Vec<f64> = rounds
        .iter()
        .map(|r| r[1].cpu_s_per_gb / r[0].cpu_s_per_gb)
        .collect();
    let summary = |lanes: usize| {
        json!({
            "gbit_s": of(lanes, |r| r.gbit_s),
            "cpu_s_per_gb": of(lanes, |r| r.cpu_s_per_gb),
            "a_cpu_s_per_gb": of(lanes, |r| r.a_cpu_s_per_gb),
            "b_cpu_s_per_gb": of(lanes, |r| r.b_cpu_s_per_gb),
            "cpus_busy": of(lanes, |r| r.cpus_busy),
        })
    };
    println!(
        "==> median: one lane {:.3} Gbit/s at {:.1} CPU s/GB; two lanes {:.3} Gbit/s at {:.1} \
         CPU s/GB; two / one by round: rate {:.2}x (median), CPU per GB {:.2}x",
        of(0, |r| r.gbit_s),
        of(0, |r| r.cpu_s_per_gb),
        of(1, |r| r.gbit_s),
        of(1, |r| r.cpu_s_per_gb),
        median(&ratios),
        median(&cpu_ratios),
    );
    let out = json!({
        "bench": "lanes",
        "seconds": args.seconds,
        "rounds": args.rounds,
        "streams_per_address": args.streams,
        "cpus": cpus,
        "one_lane": summary(0),
        "two_lanes": summary(1),
        "rate_ratio_by_round": ratios,
        "rate_ratio_median": median(&ratios),
        "cpu_per_gb_ratio_median": median(&cpu_ratios),
        "runs": rounds.iter().flatten().map(Run::json).collect::<Vec<_>>(),
    });
    println!("BENCH-JSON {out}");
    Ok(())
}
