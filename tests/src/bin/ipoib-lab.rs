//! `cargo xtask run`: on a machine with an IPoIB interface, attach to it; on one without, build
//! the two-node lab, attach both ends, send real traffic, show both nodes live, tear down.

use std::{
    process::{Command, ExitCode, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use ipoib_common::{ARPHRD_INFINIBAND, PeerEntry, PeerKey, peer_mode};
use ipoib_ctl::{
    attach::pin_dir,
    maps::DatapathMaps,
    netdev::Netdev,
    signals::{self, stop_requested},
    status,
};
use ipoib_tests::{
    cmlab::{LinkUp, rdma_netdev, set_link},
    lab::{Lab, Node, Which, ctl_path, lab_unavailable, ping_summary},
};

#[derive(Parser)]
#[command(about = "Run the IPoIB hybrid datapath: on a real IPoIB interface, or in a two-node lab")]
struct Args {
    /// Seconds of bulk TCP in the lab.
    #[arg(long, default_value_t = 6)]
    duration: u32,
    /// Always run the lab, even where an IPoIB interface exists.
    #[arg(long)]
    lab: bool,
    /// Print the final status of both lab nodes as JSON.
    #[arg(long)]
    json: bool,
    /// Connected mode for real: soft-RoCE (rxe) under the lab, `attach --cm-device`, the
    /// engine and the policy; then two faults (the RC path failing under the flow, node B's
    /// control loop killed), each followed by the fallback to UD and the return to CM.
    /// Needs a kernel with rdma_rxe (`cargo xtask run` boots the VM for it).
    #[arg(long)]
    rdma: bool,
}

fn ipoib_interfaces() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| Netdev::lookup(n).is_ok_and(|d| d.arphrd == ARPHRD_INFINIBAND))
        .collect()
}

fn show(title: &str, n: &Node) {
    match status::gather(&n.iface) {
        Ok(s) => print!(
            "--- {title} ({} in netns {}) ---\n{}",
            n.iface,
            n.ns,
            status::render(&s)
        ),
        Err(e) => println!("--- {title}: {e}"),
    }
}

fn sleep_unless_stopped(d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end && !stop_requested() {
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn demo(args: &Args) -> Result<()> {
    if let Some(why) = lab_unavailable() {
        bail!("{why}");
    }
    println!(
        "No IPoIB interface here: building the two-node lab (two network namespaces, a veth pair)."
    );
    let rdma = if args.rdma {
        Some(ipoib_tests::cmlab::rxe_device().context(
            "--rdma: no RDMA device and none could be made (this kernel has no rdma_rxe)",
        )?)
    } else {
        None
    };
    let mut lab = Lab::new("demo", rdma.is_none()).context("building the lab")?;
    let result = match &rdma {
        Some(dev) => run_cm_demo(&mut lab, args, dev),
        None => run_demo(&mut lab, args),
    };
    if stop_requested() {
        println!("\ninterrupted");
    }
    // However the demo ended (done, Ctrl-C, an error), nothing stays behind.
    println!("tearing the lab down (namespaces, links, pins)");
    lab.teardown();
    result
}

fn run_demo(lab: &mut Lab, args: &Args) -> Result<()> {
    lab.attach(Which::A, &[])?;
    lab.attach(Which::B, &[])?;
    let (a, b) = (lab.a.clone(), lab.b.clone());
    println!(
        "attached ipoib-ctl to {} ({}) and {} ({})\n",
        a.iface, a.ip4, b.iface, b.ip4
    );

    ping(&a, &b)?;
    if stop_requested() {
        return Ok(());
    }

    // No RDMA here, so no CM engine: a second veth pair stands in for the CM device. Marking B
    // CM_UP on A, as the engine does once a connection is up, sends A's big packets through it.
    let cm_ifindex = a.ifindex(a.cm_iface.as_deref().expect("cm stand-in"))?;
    let mut maps = DatapathMaps::from_pins(&pin_dir(&a.iface))?;
    maps.set_peer(
        PeerKey::from(std::net::IpAddr::V4(b.ip4)),
        PeerEntry {
            mode: peer_mode::CM_UP,
            cm_ifindex,
            generation: 1,
            ..Default::default()
        },
    )?;
    println!(
        "marked {} CM_UP on {} (CM stand-in {}, ifindex {cm_ifindex}); bulk TCP for {} s...\n",
        b.ip4,
        a.iface,
        a.cm_iface.as_deref().unwrap_or("?"),
        args.duration
    );
    let (server, mut client) = iperf(&a, &b, args.duration, "g")?;
    let start = Instant::now();
    while client.try_wait()?.is_none() && !stop_requested() {
        sleep_unless_stopped(Duration::from_secs(2));
        println!("=== {:.0} s", start.elapsed().as_secs_f64());
        show("node A", &a);
    }
    finish(client, server, "iperf3", &a, &b, args.json)
}

/// Ten pings from A to B (small packets: UD), and how many came back.
fn ping(a: &Node, b: &Node) -> Result<()> {
    let out = a
        .cmd("ping")
        .args(["-n", "-q", "-c", "10", "-i", "0.1", &b.ip4.to_string()])
        .output()?;
    let (sent, got) = ping_summary(&String::from_utf8_lossy(&out.stdout)).unwrap_or((0, 0));
    println!(
        "ping {} -> {}: {got}/{sent} replies (small packets: UD)",
        a.ip4, b.ip4
    );
    Ok(())
}

/// An iperf3 server on B (one test) and a client on A sending for `secs` seconds, reporting in
/// `unit` (iperf3 -f); [`finish`] ends them.
fn iperf(
    a: &Node,
    b: &Node,
    secs: u32,
    unit: &str,
) -> Result<(std::process::Child, std::process::Child)> {
    let b_ip = b.ip4.to_string();
    let server = b
        .cmd("iperf3")
        .args(["-s", "-1", "-B", &b_ip, "-p", "5201"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("iperf3 server (cargo xtask provision installs iperf3)")?;
    std::thread::sleep(Duration::from_millis(300));
    let client = a
        .cmd("iperf3")
        .args([
            "-c",
            &b_ip,
            "-p",
            "5201",
            "-t",
            &secs.to_string(),
            "-f",
            unit,
        ])
        .stdout(Stdio::piped())
        .spawn()?;
    Ok((server, client))
}

/// Ends the iperf3 pair, prints its result and the final status of both nodes (and JSON).
fn finish(
    mut client: std::process::Child,
    mut server: std::process::Child,
    label: &str,
    a: &Node,
    b: &Node,
    json: bool,
) -> Result<()> {
    let _ = client.kill();
    let out = client.wait_with_output()?;
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    if let Some(l) = text.lines().rev().find(|l| l.contains("receiver")) {
        println!("\n{label}: {}", l.trim());
    }
    println!("\n=== final");
    show("node A", a);
    show("node B", b);
    if json {
        let both: Vec<_> = [a, b]
            .iter()
            .filter_map(|n| status::gather(&n.iface).ok())
            .collect();
        println!("{}", serde_json::to_string_pretty(&both)?);
    }
    Ok(())
}

/// One line per node: the peer's mode and bytes by path at A, connections at both.
fn live_line(t: f64, a: &Node, b: &Node) {
    let sa = status::gather(&a.iface).ok();
    let peer = sa.as_ref().and_then(|s| {
        s.peers
            .iter()
            .find(|p| p.addr == b.ip4.to_string())
            .map(|p| (p.mode, p.traffic.tx_ud_bytes, p.traffic.tx_cm_bytes))
    });
    let conns = |s: Option<&status::Status>| {
        s.and_then(|s| s.cm.as_ref())
            .map_or("-".to_string(), |c| c.connections.to_string())
    };
    let sb = status::gather(&b.iface).ok();
    let why = sa
        .as_ref()
        .and_then(|s| s.cm.as_ref())
        .and_then(|c| {
            c.peers
                .iter()
                .find(|p| p.addr == std::net::IpAddr::V4(b.ip4))
        })
        .map_or_else(String::new, |p| p.why.clone());
    match peer {
        Some((mode, ud, cm)) => println!(
            "{t:5.1}s  A->B {mode:<10} UD {:>9.1} MiB  CM {:>9.1} MiB   connections A {} B {}   {why}",
            ud as f64 / 1048576.0,
            cm as f64 / 1048576.0,
            conns(sa.as_ref()),
            conns(sb.as_ref()),
        ),
        None => println!("{t:5.1}s  A does not know B yet"),
    }
}

/// CM, then two faults under the flow, each survived on UD and followed by the return to CM:
/// the RC path fails (the link under the soft-RoCE device down: its port's PORT_ERR stops
/// connected mode on both nodes until PORT_ACTIVE), and B's control loop is killed (its QPs
/// die with it).
fn run_cm_demo(lab: &mut Lab, args: &Args, dev: &str) -> Result<()> {
    lab.attach(Which::A, &["--cm-device", dev])?;
    let mut pid_b = lab.attach(Which::B, &["--cm-device", dev])?;
    let (a, b) = (lab.a.clone(), lab.b.clone());
    println!(
        "attached ipoib-ctl with connected mode on {dev} to {} ({}) and {} ({})\n",
        a.iface, a.ip4, b.iface, b.ip4
    );
    ping(&a, &b)?;
    println!();
    let secs = args.duration.max(30);
    // Only the lab's own soft-RoCE link is taken down, never a real HCA's.
    let rc_link = rdma_netdev(dev).filter(|n| n == "rxev0");
    let at = |pct: u32| f64::from(secs * pct / 100);
    match &rc_link {
        Some(l) => println!(
            "bulk TCP (iperf3) A -> B for {secs} s; the RC path fails at {} s ({l} down) and \
             returns at {} s; node B's control loop is killed at {} s and restarted at {} s\n",
            at(25),
            at(35),
            at(55),
            at(70)
        ),
        None => println!(
            "bulk TCP (iperf3) A -> B for {secs} s; node B's control loop is killed at {} s and \
             restarted at {} s ({dev} is not the lab's soft-RoCE device: its link stays up)\n",
            at(55),
            at(70)
        ),
    }
    let (server, mut client) = iperf(&a, &b, secs, "m")?;
    let start = Instant::now();
    let (mut killed, mut restarted) = (false, false);
    let mut link_guard: Option<LinkUp> = None;
    let mut link_failed = false;
    while client.try_wait()?.is_none() && !stop_requested() {
        sleep_unless_stopped(Duration::from_secs(1));
        let t = start.elapsed().as_secs_f64();
        live_line(t, &a, &b);
        if let Some(l) = rc_link.as_ref().filter(|_| !link_failed && t >= at(25)) {
            link_guard = Some(LinkUp(l.clone()));
            set_link(l, "down")?;
            link_failed = true;
            println!(
                "        FAULT: the RC path fails ({l}, the link under {dev}, down): the port's \
                 PORT_ERR stops connected mode on both nodes, every peer on UD"
            );
        } else if link_guard.is_some() && t >= at(35) {
            drop(link_guard.take());
            println!("        the RC path is back: connected mode starts again on the active port");
        } else if !killed && t >= at(55) {
            lab.kill9(pid_b);
            killed = true;
            println!(
                "        FAULT: node B's control loop killed (kill -9): its RC QP and engine are gone"
            );
        } else if killed && !restarted && t >= at(70) {
            pid_b = lab.attach(Which::B, &["--cm-device", dev])?;
            restarted = true;
            println!("        node B's control loop restarted (pid {pid_b})");
        }
    }
    finish(
        client,
        server,
        "iperf3 (the flow survived both faults)",
        &a,
        &b,
        args.json,
    )
}

fn main() -> ExitCode {
    let args = Args::parse();
    signals::stop_on_sigint_sigterm();
    let ifaces = if args.lab || args.rdma {
        Vec::new()
    } else {
        ipoib_interfaces()
    };
    let result = if let Some(iface) = ifaces.first() {
        println!("IPoIB interface {iface} found: ipoib-ctl attach {iface} (Ctrl-C to stop)");
        Command::new(ctl_path())
            .args(["attach", iface])
            .status()
            .map_err(Into::into)
            .and_then(|s| {
                if s.success() {
                    Ok(())
                } else {
                    bail!("ipoib-ctl exited with {s}")
                }
            })
    } else {
        demo(&args)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ipoib-lab: {e:#}");
            ExitCode::FAILURE
        }
    }
}
