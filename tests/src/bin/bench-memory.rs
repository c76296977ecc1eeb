//! `cargo xtask bench memory` (inside the soft-RoCE VM): the receive memory a node registers
//! against its connected peers, for the two receive models, beside the kernel's formula.
//!
//! One node in this process connects to a peer (`cm-node`, another namespace) from 1, K and
//! 3K endpoints (distinct UD QPNs: to the peer, distinct neighbours), once with an SRQ and
//! once with a ring per connection, both sized by the memory plan for `--budget`; after each
//! step the receive memory is read from the kernel's own view (`rdma resource show mr -j`,
//! this process's regions, less the send slots), and so is the time each ring took to
//! register. Beside it, the plan for 4096 peers on this machine and on a 24 GiB node. The
//! result is one JSON line after `BENCH-JSON `.

use std::{sync::atomic::Ordering, time::Instant};

use anyhow::{Context as _, Result};
use clap::Parser;
use ipoib_ctl::{
    cm::{Cm, Connection, SetupConfig},
    plan::{self, CM_BUF_STRIDE, PlanKind, SrqChoice},
    policy::{format_size, parse_size},
    verbs::{self, Device, ReceiveModel},
};
use ipoib_tests::cmlab::{Netns, Peer, Verbs, rxe_device, sh};
use serde_json::json;

#[derive(Parser)]
struct Args {
    /// The memory budget both models are planned with (small, so K is small in the VM).
    #[arg(long, default_value = "14MiB")]
    budget: String,
}

/// This process's memory regions on `dev`: (count, bytes), the kernel's view.
fn own_mrs(dev: &str) -> Result<(u64, u64)> {
    let out = sh(&["rdma", "resource", "show", "mr", "-j"]);
    let mrs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)?;
    let pid = u64::from(std::process::id());
    Ok(mrs
        .iter()
        .filter(|m| m["ifname"].as_str() == Some(dev) && m["pid"].as_u64() == Some(pid))
        .fold((0, 0), |(n, b), m| {
            (n + 1, b + m["mrlen"].as_u64().unwrap_or(0))
        }))
}

/// One step: `peers` endpoints connected (or refused), and the receive memory then.
struct Step {
    peers: u64,
    connected: usize,
    recv_bytes: u64,
}

/// Connects 1, K and 3K endpoints of a node on `model` to `peer`; the receive memory after
/// each, and the mean time to register one ring (µs; 0 with an SRQ).
fn measure(
    rt: &tokio::runtime::Runtime,
    dev: &str,
    model: ReceiveModel,
    k: u64,
    peer: &Peer,
) -> Result<(Vec<Step>, u64)> {
    let send_slots = 16;
    let node = Verbs::open_with(dev, model, send_slots)?;
    let send_bytes = u64::from(send_slots) * CM_BUF_STRIDE;
    let mut conns: Vec<Connection> = Vec::new();
    let mut steps = Vec::new();
    let mut tried = 0u64;
    for want in [1, k, 3 * k] {
        while tried < want {
            let cm = Cm::new(
                node.res.clone(),
                0x1000 + tried as u32,
                SetupConfig::default(),
            );
            if let Ok(c) = rt.block_on(cm.connect_once(peer.addr, peer.hw)) {
                conns.push(c);
            }
            tried += 1;
        }
        let (_, bytes) = own_mrs(dev)?;
        steps.push(Step {
            peers: want,
            connected: conns.len(),
            recv_bytes: bytes - send_bytes,
        });
    }
    let register_us = node.res.recv.rings().map_or(0, |p| {
        p.register_ns.load(Ordering::Relaxed) / p.made.load(Ordering::Relaxed).max(1) / 1000
    });
    Ok((steps, register_us))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let budget = parse_size(&args.budget).context("--budget: a size like 14MiB")?;
    let dev = rxe_device().context("no RDMA device and none could be made (rdma_rxe)")?;
    let limits = Device::open(&dev)?.limits()?;
    let mem = verbs::system_memory();
    let srq_plan = plan::plan_with(&limits, mem, Some(budget), SrqChoice::Auto);
    let ring_plan = plan::plan_with(&limits, mem, Some(budget), SrqChoice::Off);
    anyhow::ensure!(
        srq_plan.kind == PlanKind::Srq && ring_plan.kind == PlanKind::PerConnection,
        "{budget} B plans no SRQ and no rings here: {srq_plan:?} {ring_plan:?}"
    );
    let k = ring_plan.max_cm_peers;
    let ns = Netns::new("bmm", 8);
    let peer = Peer::start(&ns, &dev, "10.77.8.2:4755".parse()?, 0x48, &[]);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let t = Instant::now();
    let srq_depth = srq_plan.ring as u32;
    let (srq, _) = measure(&rt, &dev, ReceiveModel::Srq { depth: srq_depth }, k, &peer)?;
    let rings_model = ReceiveModel::Rings {
        depth: ring_plan.ring as u32,
        max: k as u32,
    };
    let (rings, register_us) = measure(&rt, &dev, rings_model, k, &peer)?;
    drop(peer);
    eprintln!("measured in {:.1?}", t.elapsed());

    println!(
        "\nreceive memory registered (kernel's view) with a budget of {}: SRQ of {srq_depth}, \
         rings of {} (K = {k}; {register_us} us to register one)",
        format_size(budget),
        ring_plan.ring
    );
    println!(
        "{:>6} {:>14} {:>18} {:>14} {:>16}",
        "peers", "SRQ", "rings (CM peers)", "kernel SRQ", "kernel no SRQ"
    );
    let mut rows = Vec::new();
    for (s, r) in srq.iter().zip(&rings) {
        let (ks, kn) = (
            plan::kernel_memory(s.peers, true),
            plan::kernel_memory(s.peers, false),
        );
        println!(
            "{:>6} {:>14} {:>13} ({:>2}) {:>14} {:>16}",
            s.peers,
            format_size(s.recv_bytes),
            format_size(r.recv_bytes),
            r.connected,
            format_size(ks),
            format_size(kn)
        );
        rows.push(json!({
            "peers": s.peers, "measured": true,
            "srq_bytes": s.recv_bytes, "srq_connected": s.connected,
            "rings_bytes": r.recv_bytes, "rings_connected": r.connected,
            "kernel_srq_bytes": ks, "kernel_no_srq_bytes": kn,
        }));
    }
    // 4096 peers, computed by the plan: this machine's automatic budget and a 24 GiB node's.
    for (what, memory) in [("this VM", mem), ("24 GiB node", 24u64 << 30)] {
        let s = plan::plan_with(&limits, memory, None, SrqChoice::Auto);
        let r = plan::plan_with(&limits, memory, None, SrqChoice::Off);
        let (ks, kn) = (
            plan::kernel_memory(4096, true),
            plan::kernel_memory(4096, false),
        );
        println!(
            "{:>6} {:>14} {:>13} ({:>2}) {:>14} {:>16}   planned, {what}, budget {}",
            4096,
            format_size(s.memory_bytes),
            format_size(r.memory_bytes),
            r.max_cm_peers,
            format_size(ks),
            format_size(kn),
            format_size(r.budget_bytes)
        );
        rows.push(json!({
            "peers": 4096, "measured": false, "node": what, "budget_bytes": r.budget_bytes,
            "srq_bytes": s.memory_bytes, "rings_bytes": r.memory_bytes,
            "rings_connected": r.max_cm_peers,
            "kernel_srq_bytes": ks, "kernel_no_srq_bytes": kn,
        }));
    }
    let out = json!({
        "bench": "memory",
        "device": dev,
        "budget_bytes": budget,
        "k": k,
        "srq_depth": srq_depth,
        "ring_depth": ring_plan.ring,
        "ring_register_us": register_us,
        "rows": rows,
    });
    println!("BENCH-JSON {out}");
    Ok(())
}
