//! The CM engine on real verbs (soft-RoCE in the VM): TCP between two nodes whose only path is
//! TUN device -> engine -> RC connection -> engine -> TUN device.
//!
//! This process is node A (root namespace), `cm-node --tun` is node B (second namespace); the
//! handshake runs over their veth pair, the data addresses (10.98.0.0/24) exist only on the TUN
//! devices. The TUN MTU is 1500, like a UD link, so the bytes can only cross as whole GSO
//! super-packets, one RC message each. On the host (no RDMA) the test skips loudly; `cargo
//! xtask vm-test` runs it with IPOIB_REQUIRE_RDMA=1, where skipping fails.

use std::{
    io::{Read as _, Write as _},
    net::{IpAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use ipoib_ctl::{
    cm::{Cm, SetupConfig},
    engine::{Engine, EngineConfig, EngineEvent, EngineStats, Route},
    tun::Tun,
    verbs::{ReceiveModel, WC_FLUSHED},
};
use ipoib_tests::cmlab::{
    COUNTED, Netns, Peer, Verbs, connect_a_to_b, device, in_netns, pattern, rdma_resources, settle,
    tun_up,
};
use ipoib_tests::lanes::LanePair;

const BYTES: usize = 48 << 20;

/// Verbs B's latest counters (its `stats` lines), waiting up to `within` for `ok` to hold.
fn peer_stats(
    peer: &mut Peer,
    within: Duration,
    ok: impl Fn(&std::collections::HashMap<String, u64>) -> bool,
) -> std::collections::HashMap<String, u64> {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = peer.expect("stats", left);
        let s = EngineStats::parse_line(&line).expect("a stats line");
        if ok(&s) || Instant::now() > deadline {
            return s;
        }
    }
}

#[test]
fn tcp_between_two_nodes_rides_rc_as_whole_super_packets() {
    let Some(dev) = device("tcp_between_two_nodes_rides_rc_as_whole_super_packets") else {
        return;
    };
    let ns = Netns::new("eng", 5);
    let baseline = rdma_resources(&dev);
    let mut peer = Peer::start(
        &ns,
        &dev,
        "10.77.5.2:4755".parse().unwrap(),
        0x48,
        &["--tun", "10.98.0.2/24", "--peer-ip", "10.98.0.1"],
    );
    let node = Arc::new(Verbs::open(&dev, 512, 256).unwrap());
    let tun = Tun::create("cmt%d", true).unwrap();
    let tun_name = tun.name().to_string();
    tun_up(&tun_name, "10.98.0.1/24");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cm = Arc::new(Cm::new(node.res.clone(), 0x100, SetupConfig::default()));
    let conn = rt
        .block_on(cm.connect(peer.addr, peer.hw))
        .expect("the connection");
    peer.expect("established", Duration::from_secs(10));
    let mut engine = Engine::new(tun, node.res.clone(), EngineConfig::default()).unwrap();
    let peer_ip: IpAddr = "10.98.0.2".parse().unwrap();
    // Taken by the engine when it runs, before any packet.
    let control = engine.control();
    control.add_route(
        peer_ip,
        Route {
            qp: conn.qp.clone(),
            mtu: conn.mtu,
        },
    );
    let stats = engine.stats();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    // The engine shares its thread with the control loop in `attach`: a task beside it on the
    // same runtime, ticking every 10 ms, finds how long the engine kept the thread at most.
    let longest_gap_us = Arc::new(AtomicU64::new(0));
    let gap = longest_gap_us.clone();
    let engine_thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let beside = tokio::spawn(async move {
                let mut last = Instant::now();
                loop {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    let us = last.elapsed().as_micros() as u64;
                    gap.fetch_max(us, Ordering::Relaxed);
                    last = Instant::now();
                }
            });
            let r = engine
                .run(async {
                    let _ = stop_rx.await;
                })
                .await;
            beside.abort();
            r
        })
        .expect("engine");
        engine
    });

    // The bulk flow, A -> B, checked byte for byte at B.
    let listener = in_netns(&ns.name, || {
        TcpListener::bind("10.98.0.2:5001").expect("listen at B")
    });
    let receiver = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut got = Vec::with_capacity(BYTES);
        s.read_to_end(&mut got).expect("read the flow");
        got
    });
    let data = pattern(5, BYTES);
    let t = Instant::now();
    {
        let mut s =
            TcpStream::connect_timeout(&"10.98.0.2:5001".parse().unwrap(), Duration::from_secs(10))
                .expect("connect over the engine");
        s.write_all(&data).expect("send the flow");
    }
    let got = receiver.join().expect("receiver");
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(got.len(), BYTES, "bytes arrived");
    assert!(got == data, "the flow's contents differ");

    let longest_gap = Duration::from_micros(longest_gap_us.load(Ordering::Relaxed));
    let here: std::collections::HashMap<_, _> = stats.snapshot().into_iter().collect();
    let there = peer_stats(&mut peer, Duration::from_secs(5), |s| {
        s["rx_bytes"] >= BYTES as u64
    });
    eprintln!(
        "{} MiB in {secs:.1} s ({:.1} MB/s); a task beside A's engine waited {longest_gap:?} \
         at most for a 10 ms tick; A: {here:?}; B: {there:?}",
        BYTES >> 20,
        BYTES as f64 / secs / 1e6
    );
    // A turn takes completions for 20 ms at most, then gives the thread back; under
    // emulation the scheduler adds its own delays, well under this.
    assert!(
        longest_gap < Duration::from_millis(500),
        "the engine kept its thread for {longest_gap:?}: the control loop beside it would \
         have starved"
    );
    // Every data byte went over RC (TUN is the only path), in whole super-packets.
    assert!(here["tx_bytes"] >= BYTES as u64, "{here:?}");
    assert!(there["rx_bytes"] >= BYTES as u64, "{there:?}");
    // A segmented flow would never exceed the 1500-byte MTU (+ the 10-byte header). How far
    // above it the super-packets go depends on the rate: TCP sizes them to about 1 ms of its
    // pacing rate (tcp_tso_autosize), ~5-10 KB at the 5-10 MB/s of emulation, 64 KiB at line
    // rate (seen here: mean 5173 B, largest 34814 B at 5.4 MB/s).
    let mean = here["tx_bytes"] / here["tx_packets"];
    assert!(
        mean > 1510 && here["tx_largest"] > 3 * 1510,
        "mean RC message {mean} B, largest {} B: super-packets were not whole",
        here["tx_largest"]
    );
    assert!(here["tx_largest"] > 1500 && here["tx_largest"] <= u64::from(conn.mtu));
    for k in [
        "tx_oversize",
        "tx_no_connection",
        "tx_malformed",
        "send_errors",
        "rx_errors",
        "rx_flushed",
        "rx_tun_errors",
        "rx_repost_errors",
    ] {
        assert_eq!(here[k], 0, "A {k}: {here:?}");
        assert_eq!(there[k], 0, "B {k}: {there:?}");
    }
    // The ACKs came back the same way.
    assert!(here["rx_packets"] > 0 && there["tx_packets"] > 0);
    // Each send went out with at least itself in flight and at most the window; a mean at
    // the window means every send found it full, and each such packet counted a wait.
    let window = u64::from(EngineConfig::default().max_send_wr);
    let depth = here["tx_depth_sum"] as f64 / here["tx_packets"] as f64;
    assert!(
        (1.0..=window as f64).contains(&depth),
        "mean depth {depth:.2}: {here:?}"
    );
    assert!(
        depth < window as f64 || here["tx_window_waits"] > 0,
        "always at the window, never waited: {here:?}"
    );

    // Teardown: the engine stops, the connection closes, the TUN device goes, and the
    // device's verbs resources return to where they were.
    control.remove_route(peer_ip, conn.qp.qpn(), None);
    stop_tx.send(()).unwrap();
    let engine = engine_thread.join().expect("engine thread");
    drop(engine);
    conn.close();
    peer.expect("closed", Duration::from_secs(5));
    let out = std::process::Command::new("ip")
        .args(["link", "show", &tun_name])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{tun_name} outlived the engine");
    drop(peer);
    drop(cm);
    drop(node);
    settle(&dev, &baseline, COUNTED);
}

/// Takes what the engine says into `seen` until it has said what `wanted` matches, 10 s at
/// most.
fn until_said(
    events: &mut tokio::sync::mpsc::UnboundedReceiver<EngineEvent>,
    seen: &mut Vec<EngineEvent>,
    wanted: impl Fn(&EngineEvent) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && !seen.iter().any(&wanted) {
        match events.try_recv() {
            Ok(e) => seen.push(e),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// A receive that fails at the engine (a message longer than its SRQ buffer) is the QP's
/// failure: counted as a receive error, not a send one, told once as a QP error, its SRQ
/// buffer posted again, and the engine runs on. (Read as a send, such a completion once handed
/// an SRQ buffer's number out as a send slot and stopped the engine on "slot 309 of 256".)
#[test]
fn a_receive_that_fails_is_the_qps_failure_and_the_engine_runs_on() {
    let Some(dev) = device("a_receive_that_fails_is_the_qps_failure_and_the_engine_runs_on") else {
        return;
    };
    let baseline = rdma_resources(&dev);
    {
        // A: the engine, on SRQ buffers of 2 KiB; B: a bare node that sends it 4000 bytes.
        let a =
            Arc::new(Verbs::open_buffers(&dev, ReceiveModel::Srq { depth: 64 }, 2048, 16).unwrap());
        let b = Arc::new(Verbs::open(&dev, 64, 16).unwrap());
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let cma = Arc::new(Cm::new(a.res.clone(), 0x10, SetupConfig::default()));
        let cmb = Arc::new(Cm::new(b.res.clone(), 0x20, SetupConfig::default()));
        let (conn_a, conn_b) = connect_a_to_b(&rt, &cma, &cmb);
        let tun = Tun::create("cmt%d", true).unwrap();
        let mut engine = Engine::new(tun, a.res.clone(), EngineConfig::default()).unwrap();
        let mut events = engine.events();
        let stats = engine.stats();
        let peer_ip: IpAddr = "10.98.1.2".parse().unwrap();
        engine.control().add_route(
            peer_ip,
            Route {
                qp: conn_a.qp.clone(),
                mtu: conn_a.mtu,
            },
        );
        let srq = a.srq().clone();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let running = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(engine.run(async {
                let _ = stop_rx.await;
            }))
        });

        // The route in place (a receive on an unrouted QP concerns nobody).
        let mut seen = Vec::new();
        until_said(&mut events, &mut seen, |e| {
            matches!(e, EngineEvent::RouteAdded { .. })
        });
        let data = pattern(9, 4000);
        // SAFETY: nothing posted uses B's slot 0.
        unsafe { b.send.slot(0)[..data.len()].copy_from_slice(&data) };
        conn_b.qp.post_send(&b.send, 0, 4000, 0).unwrap();

        let qpn = conn_a.qp.qpn();
        until_said(&mut events, &mut seen, |e| {
            matches!(e, EngineEvent::QpError { .. })
        });
        // Anything else it says within a second, two housekeepings that would send a keepalive
        // on an idle connection (a second QP error would be a bug).
        std::thread::sleep(Duration::from_secs(1));
        while let Ok(e) = events.try_recv() {
            seen.push(e);
        }
        let here: std::collections::HashMap<_, _> = stats.snapshot().into_iter().collect();
        eprintln!("the engine said {seen:?}; its counters {here:?}");
        let errors: Vec<_> = seen
            .iter()
            .filter(|e| matches!(e, EngineEvent::QpError { .. }))
            .collect();
        assert_eq!(errors.len(), 1, "QP errors told: {seen:?}");
        // Told by the receive, with its cause: not a flush of a send that came after.
        assert!(
            matches!(errors[0], EngineEvent::QpError { qpn: q, status: Some(s) } if *q == qpn && *s != WC_FLUSHED),
            "not QP {qpn}'s own failure: {errors:?}"
        );
        assert_eq!((here["rx_errors"], here["rx_flushed"]), (1, 0), "{here:?}");
        // A keepalive in flight when the QP failed is flushed: the only sends there were.
        assert!(
            here["send_errors"] <= here["keepalives_sent"] && here["tx_packets"] == 0,
            "{here:?}"
        );
        assert_eq!(
            srq.posted(),
            64,
            "the failed receive's buffer was not posted again"
        );
        assert!(!running.is_finished(), "the engine stopped: {here:?}");
        stop_tx.send(()).unwrap();
        running.join().unwrap().expect("the engine's run");
        conn_a.close();
        conn_b.close();
    }
    settle(&dev, &baseline, COUNTED);
}

/// Bytes sent to `dst:5001` over a fresh TCP connection, checked at B by `receiver`.
fn flow(dst: &'static str, seed: u32, bytes: usize) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let data = pattern(seed, bytes);
        let mut s = TcpStream::connect_timeout(&dst.parse().unwrap(), Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("connect to {dst} over the engine: {e}"));
        s.write_all(&data).expect("send the flow");
        data
    })
}

/// Two lanes on each node (a two-queue TUN device, an engine on a thread of its own per queue,
/// a CQ and a share of the send slots each, one SRQ or a ring per connection): A connects to B
/// twice, as two nodes would, the QPs land on different lanes, and each of B's two addresses is
/// routed over one of them. Two TCP flows to each address at once: every byte arrives, each
/// lane carries its own address's flows and no packet reaches a lane without its route (the
/// steering program sends each destination to the queue of its route's lane; the kernel's own
/// spreading by flow hash would not).
fn two_lanes_carry_each_destination_on_its_own_queue(rings: bool) {
    let test = "two_lanes_carry_each_destination_on_its_own_queue";
    let Some(dev) = device(test) else {
        return;
    };
    let ns = Netns::new(if rings { "eng2r" } else { "eng2" }, 6);
    let baseline = rdma_resources(&dev);
    let mut pair = LanePair::start(&dev, &ns, (6, 2), 2, rings).expect("two nodes on two lanes");
    let conns = &pair.conns;
    assert_ne!(
        conns[0].qp.lane(),
        conns[1].qp.lane(),
        "one connection per lane"
    );

    // Four flows at once, two to each address, checked byte for byte at B.
    const FLOW: usize = 8 << 20;
    let listener = in_netns(&ns.name, || {
        TcpListener::bind("0.0.0.0:5001").expect("listen at B")
    });
    let receiver = std::thread::spawn(move || {
        let takers: Vec<_> = (0..4)
            .map(|_| {
                let (mut s, from) = listener.accept().expect("accept");
                std::thread::spawn(move || {
                    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                    let mut got = Vec::with_capacity(FLOW);
                    s.read_to_end(&mut got).expect("read a flow");
                    (from, got)
                })
            })
            .collect();
        takers
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect::<Vec<_>>()
    });
    let senders = [
        flow("10.98.2.2:5001", 1, FLOW),
        flow("10.98.2.3:5001", 2, FLOW),
        flow("10.98.2.2:5001", 3, FLOW),
        flow("10.98.2.3:5001", 4, FLOW),
    ];
    let sent: Vec<_> = senders.into_iter().map(|s| s.join().unwrap()).collect();
    let got = receiver.join().expect("receiver");
    for (from, bytes) in &got {
        assert!(
            sent.iter().any(|d| d == bytes),
            "a flow from {from} arrived with {} B that match none sent",
            bytes.len()
        );
    }

    let lanes = pair.lanes();
    let there = peer_stats(&mut pair.peer, Duration::from_secs(5), |s| {
        s["rx_bytes"] >= 4 * FLOW as u64
    });
    eprintln!("A's lanes: {lanes:?}; B (both lanes): {there:?}");
    for (c, dst) in conns.iter().zip(pair.dsts) {
        let lane = &lanes[c.qp.lane() as usize];
        assert!(
            lane["tx_bytes"] >= 2 * FLOW as u64,
            "lane {} carried {} B for {dst}'s two flows: {lane:?}",
            c.qp.lane(),
            lane["tx_bytes"],
        );
    }
    // B sends to A over its latest connection (its route), so A receives the ACKs on that
    // connection's lane.
    let acks = &lanes[conns[1].qp.lane() as usize];
    assert!(
        acks["rx_packets"] > 0,
        "no ACK on the lane of B's route: {acks:?}"
    );
    for (i, lane) in lanes.iter().enumerate() {
        for k in [
            "tx_no_connection",
            "tx_oversize",
            "send_errors",
            "rx_errors",
        ] {
            assert_eq!(lane[k], 0, "A's lane {i} {k}: {lane:?}");
        }
    }
    assert!(there["rx_bytes"] >= 4 * FLOW as u64, "{there:?}");

    let tun = pair.tun.clone();
    let peer = pair.stop().expect("the lanes stopped");
    let out = std::process::Command::new("ip")
        .args(["link", "show", &tun])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{tun} outlived the engines");
    drop(peer);
    settle(&dev, &baseline, COUNTED);
}

#[test]
fn two_lanes_carry_each_destination_on_its_own_queue_on_an_srq() {
    two_lanes_carry_each_destination_on_its_own_queue(false);
}

/// As above, each connection receiving on a ring of its own (an HCA without an SRQ): each
/// lane's engine finds its received messages' rings in the pool the lanes share.
#[test]
fn two_lanes_carry_each_destination_on_its_own_queue_on_rings() {
    two_lanes_carry_each_destination_on_its_own_queue(true);
}
