//! `cargo xtask bench verbs` (inside the soft-RoCE VM): message throughput of our RC
//! connections on one SRQ, beside perftest's `ib_send_bw` on the same device in the same run.
//!
//! Both sides are set up alike: the receiver is a second process in its own network namespace
//! (`cm-node --sink`, or `ib_send_bw` as server), both busy-poll, the sender keeps `window`
//! sends in flight per QP, messages are `size` bytes. Measurements are interleaved (ours, then
//! perftest, for 1 QP and for N QPs) over several rounds and the median of each is reported,
//! so drift of the machine hits both alike. The result is one JSON line after `BENCH-JSON `.

use std::{
    collections::HashMap,
    process::Command,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use clap::Parser;
use ipoib_ctl::cm::{Cm, Connection, SetupConfig};
use ipoib_tests::{
    cmlab::{Netns, Peer, Verbs, rxe_device},
    perftest::SendBw,
};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// Message size in bytes (65520: the IPoIB CM MTU).
    #[arg(long, default_value_t = 65520)]
    size: u32,
    /// Seconds per measurement.
    #[arg(long, default_value_t = 3)]
    seconds: u32,
    /// Interleaved rounds; the median of each measurement is reported.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// QPs of the many-connection case (all on one SRQ on our side).
    #[arg(long, default_value_t = 16)]
    qps: u32,
    /// Sends in flight per QP (ib_send_bw -t).
    #[arg(long, default_value_t = 64)]
    window: u32,
}

/// One measurement: messages completed at the sender per second, and their size.
#[derive(Clone, Copy, Debug)]
struct Rate {
    msgs: u64,
    msg_per_s: f64,
    size: u32,
}

impl Rate {
    fn msg_per_s(&self) -> f64 {
        self.msg_per_s
    }
    fn mb_per_s(&self) -> f64 {
        self.msg_per_s() * f64::from(self.size) / 1e6
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!((1..=65520).contains(&args.size), "--size must be 1..=65520");
    ensure!(args.qps >= 1 && args.window >= 1 && args.rounds >= 1);
    let dev = rxe_device().context("no RDMA device and none could be made (rdma_rxe)")?;
    let ns = Netns::new("bnv", 9);
    let addr = "10.77.9.2:4755".parse()?;
    let mut peer = Peer::start(&ns, &dev, addr, 0x48, &["--sink", "--depth", "1024"]);

    let node = Arc::new(Verbs::open(&dev, 64, args.qps * args.window)?);
    let gid_index = node.res.port.gid_index;
    let cfg = SetupConfig {
        max_send_wr: args.window,
        ..SetupConfig::default()
    };
    let cms: Vec<Arc<Cm>> = (0..args.qps)
        .map(|i| Arc::new(Cm::new(node.res.clone(), 0x100 + i, cfg.clone())))
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let conns: Vec<Connection> = rt.block_on(async {
        let mut v = Vec::new();
        for cm in &cms {
            v.push(cm.connect(peer.addr, peer.hw).await?);
        }
        anyhow::Ok(v)
    })?;
    eprintln!(
        "bench-verbs: {} connections up on {dev} (GID index {gid_index}), {} B messages, window {}",
        conns.len(),
        args.size,
        args.window
    );

    let secs = Duration::from_secs(u64::from(args.seconds));
    let mut ours1 = Vec::new();
    let mut oursn = Vec::new();
    let mut perf1 = Vec::new();
    let mut perfn = Vec::new();
    let mut sent_total = 0;
    for round in 0..args.rounds {
        for (n, ours, perf) in [
            (1, &mut ours1, &mut perf1),
            (args.qps, &mut oursn, &mut perfn),
        ] {
            let r = blast(&node, &conns[..n as usize], args.size, args.window, secs)?;
            sent_total += r.msgs;
            // As many messages as ours moved (-n counts per QP), so both run about as long.
            let iters = (r.msgs / u64::from(n)).max(u64::from(4 * args.window));
            let perftest = SendBw {
                dev: &dev,
                gid_index,
                size: args.size,
                window: args.window,
                qps: n,
                server_ns: &ns.name,
                client_ns: None,
                server: addr.ip(),
                events: false,
            };
            let p = Rate {
                msgs: iters * u64::from(n),
                msg_per_s: perftest.rate(iters)?.msg_per_s,
                size: args.size,
            };
            eprintln!(
                "round {round}, {n} QP: ours {:.0} msg/s {:.1} MB/s; ib_send_bw {:.0} msg/s {:.1} MB/s",
                r.msg_per_s(),
                r.mb_per_s(),
                p.msg_per_s(),
                p.mb_per_s()
            );
            ours.push(r);
            perf.push(p);
        }
    }
    // Every message that completed here was taken by the sink: RC completes a send only once
    // the receiver has ACKed it into a posted buffer. The sink's own count must agree.
    let deadline = Instant::now() + Duration::from_secs(10);
    let received: u64 = loop {
        let line = peer.expect(
            "received",
            deadline.saturating_duration_since(Instant::now()),
        );
        let n: u64 = line.split(' ').nth(1).context("received line")?.parse()?;
        if n >= sent_total {
            break n;
        }
    };
    ensure!(
        received == sent_total,
        "the sink took {received} messages, the sender completed {sent_total}"
    );

    let med = |v: &mut Vec<Rate>| {
        v.sort_by(|a, b| a.msg_per_s().total_cmp(&b.msg_per_s()));
        v[v.len() / 2]
    };
    let (o1, on, p1, pn) = (
        med(&mut ours1),
        med(&mut oursn),
        med(&mut perf1),
        med(&mut perfn),
    );
    let row = |ours: Rate, perf: Rate, qps: u32| {
        json!({
            "qps": qps,
            "ours_msg_per_s": ours.msg_per_s().round(),
            "ours_mb_per_s": (ours.mb_per_s() * 10.0).round() / 10.0,
            "ib_send_bw_msg_per_s": perf.msg_per_s().round(),
            "ib_send_bw_mb_per_s": (perf.mb_per_s() * 10.0).round() / 10.0,
            "ratio": (ours.msg_per_s() / perf.msg_per_s() * 1000.0).round() / 1000.0,
        })
    };
    let out = json!({
        "bench": "verbs",
        "device": dev,
        "kernel": String::from_utf8_lossy(&Command::new("uname").arg("-r").output()?.stdout).trim(),
        "size": args.size,
        "window": args.window,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "sink_received": received,
        "results": [row(o1, p1, 1), row(on, pn, args.qps)],
    });
    println!(
        "\n{:>4} {:>12} {:>10} {:>12} {:>10} {:>7}",
        "QPs", "ours msg/s", "MB/s", "ib_send_bw", "MB/s", "ratio"
    );
    for (o, p, q) in [(o1, p1, 1), (on, pn, args.qps)] {
        println!(
            "{q:>4} {:>12.0} {:>10.1} {:>12.0} {:>10.1} {:>7.3}",
            o.msg_per_s(),
            o.mb_per_s(),
            p.msg_per_s(),
            p.mb_per_s(),
            o.msg_per_s() / p.msg_per_s()
        );
    }
    println!("BENCH-JSON {out}");
    for c in conns {
        c.close();
    }
    Ok(())
}

/// Sends `size`-byte messages round-robin over `conns` for `dur`, `window` in flight per QP,
/// busy-polling the CQ; then waits for what is in flight. Counts completed sends.
fn blast(
    node: &Verbs,
    conns: &[Connection],
    size: u32,
    window: u32,
    dur: Duration,
) -> Result<Rate> {
    let index: HashMap<u32, usize> = conns
        .iter()
        .enumerate()
        .map(|(i, c)| (c.qp.qpn(), i))
        .collect();
    let mut free: Vec<u32> = (0..node.send.count).collect();
    let mut in_flight = vec![0u32; conns.len()];
    let mut wcs = Vec::with_capacity(64);
    let mut done = 0u64;
    let start = Instant::now();
    let stop = start + dur;
    loop {
        let sending = Instant::now() < stop;
        if sending {
            for (i, c) in conns.iter().enumerate() {
                while in_flight[i] < window {
                    let Some(slot) = free.pop() else { break };
                    c.qp.post_send(&node.send, slot, size, u64::from(slot))?;
                    in_flight[i] += 1;
                }
            }
        } else if in_flight.iter().all(|&n| n == 0) {
            break;
        }
        wcs.clear();
        node.cq.poll(&mut wcs, 64)?;
        for wc in &wcs {
            if wc.recv {
                continue;
            }
            if let Some(status) = wc.error {
                bail!("send completion error {status} on QP {}", wc.qp_num);
            }
            free.push(wc.wr_id as u32);
            in_flight[index[&wc.qp_num]] -= 1;
            done += 1;
        }
        if start.elapsed() > dur + Duration::from_secs(30) {
            bail!("sends still in flight 30 s after the end");
        }
    }
    Ok(Rate {
        msgs: done,
        msg_per_s: done as f64 / start.elapsed().as_secs_f64(),
        size,
    })
}
