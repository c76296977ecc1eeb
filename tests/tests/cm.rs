//! RC connections on real verbs (soft-RoCE in the VM): the handshake over TCP, QPs on one
//! SRQ, messages with their contents checked, rejection of malformed REQs, crossing REQs,
//! timeouts and retries, the setup cap, the SRQ limit event, and resources counted back to
//! where they were.
//!
//! Two nodes: this process in the root network namespace and `cm-node` in a second one,
//! joined by a veth pair for the IP side; both use the one rxe device for RDMA (loopback is
//! what works on 6.1). The host kernel has no RDMA: there each test skips, loudly;
//! `cargo xtask vm-test` runs them with IPOIB_REQUIRE_RDMA=1, where skipping fails.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::Arc,
    time::{Duration, Instant},
};

use ipoib_ctl::{
    cm::{
        Cm, Connection, RejectReason, SetupConfig, SetupError,
        wire::{Hello, MSG_LEN, Msg},
    },
    path::LinkLayer,
    verbs::{
        AsyncEvent, RcEndpoint, RcTiming, ReceiveModel, SEND_WR_ID, SendRequest, rnr_timer_us,
    },
};
use ipoib_tests::cmlab::{
    COUNTED, Netns, Peer, Pump, Received, Verbs, connect_a_to_b, device, listen, pattern,
    rdma_resources, registered_mrs, settle,
};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

const CONNS: u32 = 64;
const SIZES: &[usize] = &[1, 2, 63, 1024, 4095, 4096, 4097, 32768, 65519, 65520];

/// 64 RC connections on one SRQ each side; every size from 1 byte to 65520 bytes echoed with
/// its contents checked; a connection closed here is noticed there; the peer killed is noticed
/// here; and afterwards the device holds no QP, CQ, MR, SRQ or PD of either node.
#[test]
fn many_connections_share_one_srq_and_move_checked_messages() {
    let Some(dev) = device("many_connections_share_one_srq_and_move_checked_messages") else {
        return;
    };
    let ns = Netns::new("cmt1", 1);
    let baseline = rdma_resources(&dev);
    let mut peer = Peer::start(&ns, &dev, "10.77.1.2:4755".parse().unwrap(), 0x48, &[]);
    let node = Arc::new(Verbs::open(&dev, 1024, 256).unwrap());
    let cfg = SetupConfig {
        max_concurrent: 8,
        ..SetupConfig::default()
    };
    // 64 local endpoints (UD QPNs 0x100..) on one SRQ: to the peer, 64 distinct neighbours.
    let cms: Vec<Arc<Cm>> = (0..CONNS)
        .map(|i| Arc::new(Cm::new(node.res.clone(), 0x100 + i, cfg.clone())))
        .collect();
    let rt = rt();
    let (peer_addr, peer_hw) = (peer.addr, peer.hw);
    let mut conns: Vec<Connection> = rt.block_on(async {
        let mut set = tokio::task::JoinSet::new();
        for (i, cm) in cms.iter().enumerate() {
            let cm = cm.clone();
            set.spawn(async move { (i, cm.connect(peer_addr, peer_hw).await) });
        }
        let mut v: Vec<(usize, Connection)> = Vec::new();
        while let Some(r) = set.join_next().await {
            let (i, c) = r.unwrap();
            v.push((i, c.unwrap_or_else(|e| panic!("connection {i}: {e}"))));
        }
        v.sort_by_key(|(i, _)| *i);
        v.into_iter().map(|(_, c)| c).collect()
    });
    for _ in 0..CONNS {
        peer.expect("established", Duration::from_secs(10));
    }
    for c in &conns {
        assert_eq!(c.mtu, 65520, "RFC 4755 MTU: 65524 - 4");
        assert_eq!(c.peer.ud_qpn, 0x48);
    }
    let during = rdma_resources(&dev);
    assert_eq!(
        during["qp"],
        baseline.get("qp").copied().unwrap_or(0) + 2 * CONNS as u64,
        "one QP per connection on each side: {during:?}"
    );
    assert_eq!(
        during["srq"],
        baseline.get("srq").copied().unwrap_or(0) + 2,
        "one SRQ per node, whatever the number of connections: {during:?}"
    );

    // Every size on every connection, echoed; contents checked per connection.
    let checked = echo_checked(&node, &conns.iter().collect::<Vec<_>>());
    eprintln!(
        "{CONNS} connections, {checked} echoes of {} sizes checked; SRQ posted {}",
        SIZES.len(),
        node.srq().posted()
    );
    assert_eq!(node.srq().posted(), 1024, "every receive posted again");

    // Closed here: the peer notices and frees its QP.
    let first = conns.remove(0);
    first.close();
    let line = peer.expect("closed", Duration::from_secs(5));
    assert!(line.starts_with("closed 0x100 "), "{line}");

    // The peer killed: every connection here notices (its control stream ends).
    peer.kill9();
    let noticed = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), async {
            for c in conns.iter_mut() {
                c.closed().await;
            }
        })
        .await
    });
    assert!(noticed.is_ok(), "the peer's death went unnoticed");
    for c in conns {
        c.close();
    }
    drop(cms);
    drop(node);
    settle(&dev, &baseline, COUNTED);
}

/// A valid REQ as a hostile or broken client might start from.
fn req_to(peer: &Peer) -> [u8; MSG_LEN] {
    Msg::Req(Hello {
        ud_qpn: 0x77,
        recv_mtu: 65524,
        rc: RcEndpoint {
            qpn: 0x123,
            psn: 1,
            lid: 0,
            gid: peer.hw.gid,
            mtu: 3,
            link_layer: LinkLayer::Ethernet,
        },
        path: None,
    })
    .encode()
}

fn exchange(addr: SocketAddr, bytes: &[u8]) -> Option<Msg> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(bytes).unwrap();
    let mut b = [0u8; MSG_LEN];
    match s.read_exact(&mut b) {
        Ok(()) => Some(Msg::decode(&b).expect("the peer's answer decodes")),
        Err(_) => None,
    }
}

/// Each malformed field gets a REJ naming the class of fault, and costs the peer nothing: no
/// QP is made for it. A REQ whose RTU never comes costs a QP only until the step timeout.
#[test]
fn malformed_requests_are_rejected_and_cost_nothing() {
    let Some(dev) = device("malformed_requests_are_rejected_and_cost_nothing") else {
        return;
    };
    let ns = Netns::new("cmt2", 2);
    let mut peer = Peer::start(
        &ns,
        &dev,
        "10.77.2.2:4755".parse().unwrap(),
        0x48,
        &["--step-timeout", "0.5", "--depth", "64"],
    );
    let ready = rdma_resources(&dev);
    let good = req_to(&peer);
    let cases: &[(&str, usize, u8, RejectReason)] = &[
        ("magic", 0, b'X', RejectReason::Malformed),
        ("version", 4, 9, RejectReason::Version),
        ("kind", 5, 7, RejectReason::Malformed),
        ("reject reason in a REQ", 6, 1, RejectReason::Malformed),
        ("reserved", 7, 1, RejectReason::Malformed),
        ("UD QPN high byte", 8, 1, RejectReason::Malformed),
        ("receive MTU", 12, 0xff, RejectReason::Malformed),
        ("RC QPN high byte", 16, 1, RejectReason::Malformed),
        ("PSN high byte", 20, 1, RejectReason::Malformed),
        ("multicast LID", 24, 0xc0, RejectReason::Malformed),
        ("port MTU", 26, 9, RejectReason::Malformed),
        ("link layer", 27, 3, RejectReason::Malformed),
        ("InfiniBand to a RoCE port", 27, 1, RejectReason::NoPath),
        ("multicast GID", 28, 0xff, RejectReason::Malformed),
        ("path bytes", 45, 1, RejectReason::Malformed),
    ];
    for &(what, off, val, want) in cases {
        let mut b = good;
        b[off] = val;
        match exchange(peer.addr, &b) {
            Some(Msg::Rej { reason, ud_qpn, .. }) => {
                assert_eq!(reason, want, "{what}");
                assert_eq!(ud_qpn, 0x48, "a REJ carries the sender's UD QPN (RFC 4755)");
            }
            other => panic!("{what}: expected a REJ, got {other:?}"),
        }
        let line = peer.expect("failed", Duration::from_secs(5));
        eprintln!("{what}: {line}");
    }
    // A REQ of version 1 (no link layer): REJ version, written in version 1 for it to read.
    let mut v1 = good;
    (v1[4], v1[27]) = (1, 0);
    let mut s = TcpStream::connect(peer.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&v1).unwrap();
    let mut rej = [0u8; MSG_LEN];
    s.read_exact(&mut rej).unwrap();
    assert_eq!(
        (&rej[0..4], rej[4], rej[5], rej[6]),
        (&b"IPHC"[..], 1, 3, RejectReason::Version as u8),
        "{rej:?}"
    );
    rej[4] = ipoib_ctl::cm::wire::VERSION;
    assert!(matches!(
        Msg::decode(&rej),
        Ok(Msg::Rej {
            reason: RejectReason::Version,
            ud_qpn: 0x48,
            ..
        })
    ));
    peer.expect("failed", Duration::from_secs(5));
    // An RTU where a REQ belongs.
    let rtu = Msg::Rtu {
        ud_qpn: 0x77,
        recv_mtu: 65524,
    }
    .encode();
    assert!(matches!(
        exchange(peer.addr, &rtu),
        Some(Msg::Rej {
            reason: RejectReason::Malformed,
            ..
        })
    ));
    // Half a message, then EOF; and a client that says nothing: no answer, no QP.
    assert_eq!(exchange(peer.addr, &good[..20]), None);
    let t = Instant::now();
    assert_eq!(exchange(peer.addr, &[]), None);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "a silent client is dropped at the step timeout"
    );
    let after = rdma_resources(&dev);
    assert_eq!(
        after.get("qp"),
        ready.get("qp"),
        "malformed REQs made QPs: {after:?}"
    );

    // A well-formed REQ that never sends RTU: the peer answers REP with a real QP and frees it
    // at the step timeout.
    let mut s = TcpStream::connect(peer.addr).unwrap();
    s.write_all(&good).unwrap();
    let mut b = [0u8; MSG_LEN];
    s.read_exact(&mut b).unwrap();
    let Msg::Rep(rep) = Msg::decode(&b).unwrap() else {
        panic!("expected REP");
    };
    assert_eq!(rep.ud_qpn, 0x48);
    assert!(rep.rc.qpn > 1);
    peer.expect("failed timed out waiting for RTU", Duration::from_secs(5));
    drop(s);
    settle(&dev, &ready, &["qp"]);
}

/// Two nodes in this process on loopback TCP, each with its own SRQ.
fn two_nodes(
    dev: &str,
    cfg_a: SetupConfig,
    cfg_b: SetupConfig,
) -> (Arc<Verbs>, Arc<Cm>, Arc<Verbs>, Arc<Cm>) {
    let a = Arc::new(Verbs::open(dev, 64, 64).unwrap());
    let b = Arc::new(Verbs::open(dev, 64, 64).unwrap());
    let cma = Arc::new(Cm::new(a.res.clone(), 0x10, cfg_a));
    let cmb = Arc::new(Cm::new(b.res.clone(), 0x20, cfg_b));
    (a, cma, b, cmb)
}

/// Both nodes send a REQ at once: the tie-break leaves exactly one connection, the lower
/// address (A, UD QPN 0x10) accepting B's REQ.
#[test]
fn crossing_requests_leave_one_connection() {
    let Some(dev) = device("crossing_requests_leave_one_connection") else {
        return;
    };
    let baseline = rdma_resources(&dev);
    let (_a, cma, _b, cmb) = two_nodes(&dev, SetupConfig::default(), SetupConfig::default());
    rt().block_on(async {
        let (addr_a, mut in_a) = listen(&cma).await;
        let (addr_b, mut in_b) = listen(&cmb).await;
        let (ra, rb) = tokio::join!(
            cma.connect_once(addr_b, cmb.hwaddr()),
            cmb.connect_once(addr_a, cma.hwaddr())
        );
        eprintln!(
            "A->B: {:?}; B->A: {:?}",
            ra.as_ref().err(),
            rb.as_ref().err()
        );
        let (active, passive) = match (ra, rb) {
            // Crossed: A (lower) accepted B's REQ; B refused A's.
            (Err(SetupError::Crossed), Ok(c)) => (c, in_a.recv().await.unwrap().1.unwrap()),
            // Not crossed after all: one REQ arrived before the other was sent.
            (Ok(c), Err(SetupError::InProgress)) => (c, in_b.recv().await.unwrap().1.unwrap()),
            (Err(SetupError::InProgress), Ok(c)) => (c, in_a.recv().await.unwrap().1.unwrap()),
            (ra, rb) => panic!("not one connection: {:?} / {:?}", ra.err(), rb.err()),
        };
        assert_eq!(passive.peer.rc.qpn, active.qp.qpn());
        assert_eq!(active.peer.rc.qpn, passive.qp.qpn());
        let est = |cm: &Cm| {
            cm.stats
                .established
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        assert_eq!(
            est(&cma) + est(&cmb),
            2,
            "one connection, counted once on each side"
        );
        let now = rdma_resources(&dev);
        assert_eq!(
            now["qp"],
            baseline.get("qp").copied().unwrap_or(0) + 2,
            "{now:?}"
        );
        // A refused REQ got a REJ crossing, or none was sent; no second connection comes.
        let more = tokio::time::timeout(Duration::from_millis(300), async {
            tokio::select! {
                m = in_a.recv() => m.map(|(_, r)| r.is_ok()),
                m = in_b.recv() => m.map(|(_, r)| r.is_ok()),
            }
        })
        .await;
        assert!(
            !matches!(more, Ok(Some(true))),
            "a second connection was made"
        );
    });
    drop((cma, cmb));
    settle(&dev, &baseline, &["qp"]);
}

/// A listener that accepts and never answers: each attempt times out, transient failures are
/// retried with doubling backoff a bounded number of times, and no QP outlives its attempt.
/// A refused TCP connect is retried the same way.
#[test]
fn timeouts_are_retried_with_backoff_then_given_up() {
    let Some(dev) = device("timeouts_are_retried_with_backoff_then_given_up") else {
        return;
    };
    let baseline = rdma_resources(&dev);
    let cfg = SetupConfig {
        step_timeout: Duration::from_millis(300),
        retries: 2,
        backoff: Duration::from_millis(100),
        ..SetupConfig::default()
    };
    let (_a, cma, _b, cmb) = two_nodes(&dev, cfg, SetupConfig::default());
    let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mute_addr = mute.local_addr().unwrap();
    let held = std::thread::spawn(move || {
        let mut v = Vec::new();
        mute.set_nonblocking(true).unwrap();
        let end = Instant::now() + Duration::from_secs(4);
        while Instant::now() < end {
            if let Ok((s, _)) = mute.accept() {
                v.push(s);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        v.len()
    });
    let rt = rt();
    let t = Instant::now();
    let r = rt.block_on(cma.connect(mute_addr, cmb.hwaddr()));
    let took = t.elapsed();
    assert!(
        matches!(r, Err(SetupError::Timeout("REP"))),
        "{:?}",
        r.err()
    );
    // 3 attempts of 300 ms and backoffs of 100 + 200 ms.
    assert!(
        took >= Duration::from_millis(1200),
        "gave up after {took:?}"
    );
    assert_eq!(held.join().unwrap(), 3, "one try and two retries");
    // Nothing listens: refused, retried, given up.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let r = rt.block_on(cma.connect(closed, cmb.hwaddr()));
    assert!(matches!(r, Err(SetupError::Io(_))), "{:?}", r.err());
    assert_eq!(
        cma.stats.failed.load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    let now = rdma_resources(&dev);
    assert_eq!(
        now.get("qp"),
        baseline.get("qp"),
        "a failed setup left a QP: {now:?}"
    );
}

/// With one setup allowed at a time, a REQ that comes while another setup is under way gets
/// REJ busy, which the active side treats as transient. A stream that has sent no REQ holds
/// no setup: it does not make anyone busy.
#[test]
fn setups_past_the_cap_are_refused_busy() {
    use ipoib_ctl::{
        cm::wire::{Hello, MSG_LEN, Msg},
        verbs::RcEndpoint,
    };
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let Some(dev) = device("setups_past_the_cap_are_refused_busy") else {
        return;
    };
    let cap1 = SetupConfig {
        max_concurrent: 1,
        step_timeout: Duration::from_secs(3),
        ..SetupConfig::default()
    };
    let once = SetupConfig {
        retries: 0,
        ..SetupConfig::default()
    };
    let (_a, cma, _b, cmb) = two_nodes(&dev, once, cap1);
    rt().block_on(async {
        let (addr_b, mut in_b) = listen(&cmb).await;
        // A client that connects and says nothing holds nothing: A's setup goes through.
        let silent = tokio::net::TcpStream::connect(addr_b).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let c = cma
            .connect(addr_b, cmb.hwaddr())
            .await
            .expect("a silent stream made B busy");
        let (_, accepted) = in_b.recv().await.expect("B's side");
        drop((c, accepted, silent));
        // A client that sends a valid REQ and never the RTU holds B's only setup slot (for
        // B's step timeout).
        let mut holder = tokio::net::TcpStream::connect(addr_b).await.unwrap();
        let req = Msg::Req(Hello {
            ud_qpn: 0x30,
            recv_mtu: 65524,
            rc: RcEndpoint {
                qpn: 0x1234,
                psn: 1,
                lid: 0,
                gid: cmb.hwaddr().gid,
                mtu: 3,
                link_layer: LinkLayer::Ethernet,
            },
            path: None,
        });
        holder.write_all(&req.encode()).await.unwrap();
        let mut rep = [0u8; MSG_LEN];
        holder.read_exact(&mut rep).await.unwrap();
        assert!(
            matches!(Msg::decode(&rep), Ok(Msg::Rep(_))),
            "the holder's REQ was not answered with REP"
        );
        let r = cma.connect(addr_b, cmb.hwaddr()).await;
        match r {
            Err(e @ SetupError::Rejected(RejectReason::Busy)) => assert!(e.transient()),
            other => panic!("expected REJ busy, got {:?}", other.err()),
        }
    });
}

/// A node at its connection limit (the memory plan) refuses another peer's REQ with REJ
/// no-resources before allocating anything for it; the refused side sees a transient refusal;
/// once a connection goes, the next REQ is accepted.
#[test]
fn requests_past_the_connection_limit_are_refused_no_resources() {
    let Some(dev) = device("requests_past_the_connection_limit_are_refused_no_resources") else {
        return;
    };
    let baseline = rdma_resources(&dev);
    let once = SetupConfig {
        retries: 0,
        ..SetupConfig::default()
    };
    let (a, cma, _b, cmb) = two_nodes(&dev, once.clone(), SetupConfig::default());
    // A second initiator on A's resources, with its own address.
    let cmc = Arc::new(Cm::new(a.res.clone(), 0x30, once));
    cmb.set_limit(1);
    rt().block_on(async {
        let (addr_b, mut in_b) = listen(&cmb).await;
        let first = cma
            .connect(addr_b, cmb.hwaddr())
            .await
            .expect("the first fits");
        let accepted = in_b.recv().await.unwrap().1.expect("B accepted the first");
        assert_eq!(cmb.held(), 1);
        let qps = rdma_resources(&dev).get("qp").copied();
        match cmc.connect(addr_b, cmb.hwaddr()).await {
            Err(e @ SetupError::Rejected(RejectReason::NoResources)) => assert!(e.transient()),
            other => panic!("expected REJ no-resources, got {:?}", other.err()),
        }
        assert!(matches!(
            in_b.recv().await.unwrap().1,
            Err(SetupError::Full)
        ));
        // B made nothing for it (C's own QP is gone with the failed attempt).
        assert_eq!(rdma_resources(&dev).get("qp").copied(), qps);
        first.close();
        drop(accepted);
        assert_eq!(cmb.held(), 0);
        let again = cmc.connect(addr_b, cmb.hwaddr()).await.expect("room again");
        again.close();
    });
    settle(&dev, &baseline, &["qp"]);
}

/// The SRQ limit event: receives consumed and not posted again drop the SRQ below its armed
/// limit (a quarter of the depth) and the HCA says so; posting them again refills it.
#[test]
fn srq_limit_event_fires_before_starvation() {
    let Some(dev) = device("srq_limit_event_fires_before_starvation") else {
        return;
    };
    let (a, cma, b, cmb) = two_nodes(&dev, SetupConfig::default(), SetupConfig::default());
    let srq = b.srq().clone();
    assert_eq!(srq.query().unwrap().srq_limit, 16);
    let rt = rt();
    let (conn, _peer_conn) = connect_a_to_b(&rt, &cma, &cmb);
    // 50 of B's 64 receives consumed, none posted again: 14 left, under the limit of 16.
    let mut pa = Pump::new(a.clone());
    let mut none = Vec::new();
    for i in 0..50 {
        pa.send(&conn.qp, &pattern(i, 100), &mut none).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while pa.sent < 50 && Instant::now() < deadline {
        pa.progress(&mut none, Duration::from_millis(100)).unwrap();
    }
    assert_eq!(pa.sent, 50, "{:?}", pa.send_errors);
    let mut ev = None;
    while ev.is_none() && Instant::now() < deadline {
        ev = b.dev.async_event(Duration::from_millis(500)).unwrap();
    }
    assert_eq!(ev, Some(AsyncEvent::SrqLimitReached));
    // The limit disarms itself when it fires; refill by taking the completions.
    assert_eq!(srq.query().unwrap().srq_limit, 0);
    let mut pb = Pump::new(b.clone());
    let mut got = Vec::new();
    pb.collect(&mut got, 50, Duration::from_secs(10)).unwrap();
    for (i, m) in got.iter().enumerate() {
        assert!(
            m.data == pattern(i as u32, 100),
            "message {i} in order and intact"
        );
    }
    srq.arm_limit(16).unwrap();
    assert_eq!(srq.posted(), 64);
}

/// Connections to `peer` from fresh endpoints (UD QPNs `first..`) on `node`: each result.
fn connect_all(
    rt: &tokio::runtime::Runtime,
    node: &Verbs,
    first: u32,
    n: u32,
    peer: &Peer,
) -> Vec<Result<Connection, SetupError>> {
    let (addr, hw) = (peer.addr, peer.hw);
    rt.block_on(async {
        let mut v = Vec::new();
        for i in 0..n {
            let cm = Cm::new(node.res.clone(), first + i, SetupConfig::default());
            v.push(cm.connect_once(addr, hw).await);
        }
        v
    })
}

/// Every size echoed once on every connection, lengths and contents checked per connection;
/// the echoes checked.
fn echo_checked(node: &Arc<Verbs>, conns: &[&Connection]) -> usize {
    let by_qpn: std::collections::HashMap<u32, u32> = conns
        .iter()
        .enumerate()
        .map(|(i, c)| (c.qp.qpn(), i as u32))
        .collect();
    let mut pump = Pump::new(node.clone());
    let mut checked = 0;
    for &size in SIZES {
        let mut got: Vec<Received> = Vec::new();
        for (i, c) in conns.iter().enumerate() {
            pump.send(&c.qp, &pattern(i as u32, size), &mut got)
                .unwrap();
        }
        pump.collect(&mut got, conns.len(), Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("size {size}: {e}"));
        let mut seen = vec![false; conns.len()];
        for m in &got {
            let i = by_qpn[&m.qp_num];
            assert_eq!(m.data.len(), size, "connection {i}");
            assert!(
                m.data == pattern(i, size),
                "connection {i}, {size} B: contents differ"
            );
            assert!(!seen[i as usize], "two echoes on connection {i}");
            seen[i as usize] = true;
            checked += 1;
        }
    }
    assert!(pump.send_errors.is_empty(), "{:?}", pump.send_errors);
    checked
}

/// Without an SRQ: a peer with a receive ring per connection and K=3 takes three connections
/// and refuses the fourth REQ with REJ no-resources before it allocates anything (the kernel's
/// view: no fourth ring registered); a node with an SRQ and the ring node move every size
/// both ways, contents checked; a closed connection's ring is freed; a node with rings and
/// K=1 refuses its own second setup without asking the peer; rings talk to rings; and at the
/// end the device holds what it held before.
#[test]
fn rings_per_connection_hold_k_interoperate_and_are_freed() {
    let Some(dev) = device("rings_per_connection_hold_k_interoperate_and_are_freed") else {
        return;
    };
    let ns = Netns::new("cmt9", 9);
    let baseline = rdma_resources(&dev);
    let (mrs0, bytes0) = registered_mrs(&dev);
    let extra = ["--rings", "3", "--depth", "64"];
    let mut peer = Peer::start(&ns, &dev, "10.77.9.2:4755".parse().unwrap(), 0x48, &extra);
    let (mrs1, bytes1) = registered_mrs(&dev);
    assert_eq!(
        mrs1,
        mrs0 + 1,
        "a ring node registers only its send slots at start"
    );
    let ring = 64 * ipoib_tests::cmlab::STRIDE;
    let srq_node = Arc::new(Verbs::open(&dev, 256, 64).unwrap());
    let rt = rt();
    let (mrs2, bytes2) = registered_mrs(&dev);
    let mut r = connect_all(&rt, &srq_node, 0x100, 4, &peer);
    let refused = r.pop().unwrap();
    assert!(
        matches!(
            refused,
            Err(SetupError::Rejected(RejectReason::NoResources))
        ),
        "the 4th REQ: {:?}",
        refused.err()
    );
    let mut conns: Vec<Connection> = r.into_iter().map(|c| c.expect("within K")).collect();
    for _ in 0..3 {
        peer.expect("established", Duration::from_secs(10));
    }
    let (mrs3, bytes3) = registered_mrs(&dev);
    assert_eq!(
        (mrs3 - mrs2, bytes3 - bytes2),
        (3, 3 * ring),
        "three rings registered at the peer, no fourth"
    );
    let now = rdma_resources(&dev);
    assert_eq!(
        now["qp"],
        baseline.get("qp").copied().unwrap_or(0) + 6,
        "{now:?}"
    );
    let checked = echo_checked(&srq_node, &conns.iter().collect::<Vec<_>>());
    eprintln!(
        "SRQ node <-> ring node: {checked} echoes checked; peer: {} B of rings beside {} B \
         of send slots",
        bytes3 - bytes2,
        bytes1 - bytes0
    );

    // One closed: the peer's ring goes with its QP.
    conns.remove(0).close();
    peer.expect("closed", Duration::from_secs(5));
    let freed = |want: u64| {
        let end = Instant::now() + Duration::from_secs(5);
        while registered_mrs(&dev).1 != want && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(50));
        }
        registered_mrs(&dev).1
    };
    assert_eq!(
        freed(bytes3 - ring),
        bytes3 - ring,
        "the closed ring was not freed"
    );

    // A ring node with K=1, to the ring peer (which has one ring free again): one
    // connection, and its second setup fails here, Full, without a REQ.
    let model = ReceiveModel::Rings { depth: 64, max: 1 };
    let ring_node = Arc::new(Verbs::open_with(&dev, model, 64).unwrap());
    let mut r = connect_all(&rt, &ring_node, 0x200, 2, &peer);
    let second = r.pop().unwrap();
    assert!(
        matches!(second, Err(SetupError::Full)),
        "{:?}",
        second.err()
    );
    let rc = r.pop().unwrap().expect("rings to rings");
    peer.expect("established", Duration::from_secs(10));
    let pool = ring_node.res.recv.rings().unwrap();
    assert_eq!((pool.in_use(), pool.registered_bytes()), (1, ring));
    assert_eq!(pool.refused.load(std::sync::atomic::Ordering::Relaxed), 1);
    let checked = echo_checked(&ring_node, &[&rc]);
    eprintln!("ring node <-> ring node: {checked} echoes checked");
    assert_eq!(
        rc.qp
            .ring()
            .unwrap()
            .posted
            .load(std::sync::atomic::Ordering::Relaxed),
        64
    );
    rc.close();
    let end = Instant::now() + Duration::from_secs(5);
    while pool.in_use() > 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        (pool.in_use(), pool.registered_bytes()),
        (0, 0),
        "the ring outlived its QP"
    );

    drop(conns);
    peer.kill9();
    drop((srq_node, ring_node));
    drop(rt);
    settle(&dev, &baseline, COUNTED);
    assert_eq!(registered_mrs(&dev), (mrs0, bytes0));
}

/// What a sender saw while its receiver's ring was dry for a while.
#[derive(Debug)]
struct DryRing {
    delivered: u64,
    send_errors: Vec<(u32, u32)>,
    /// From the end of the pause until every send completed (or failed).
    after_pause: Duration,
}

/// A sends `n` messages to B, whose ring of `depth` buffers nobody empties for `pause`; then B
/// takes everything. A retries RNR `rnr_retry` times; B asks for RNR timer `rnr_timer`.
fn dry_ring(dev: &str, rnr_retry: u8, rnr_timer: u8, pause: Duration) -> DryRing {
    let (depth, n) = (8u32, 24usize);
    let timing = |rnr_retry, min_rnr_timer| SetupConfig {
        timing: RcTiming {
            rnr_retry,
            min_rnr_timer,
            ..RcTiming::default()
        },
        ..SetupConfig::default()
    };
    let a = Arc::new(Verbs::open(dev, 64, 64).unwrap());
    let model = ReceiveModel::Rings { depth, max: 1 };
    let b = Arc::new(Verbs::open_with(dev, model, 64).unwrap());
    let cma = Arc::new(Cm::new(a.res.clone(), 0x10, timing(rnr_retry, 12)));
    let cmb = Arc::new(Cm::new(b.res.clone(), 0x20, timing(7, rnr_timer)));
    let rt = rt();
    let (conn, _accepted) = rt.block_on(async {
        let (addr_b, mut in_b) = listen(&cmb).await;
        let c = cma.connect_once(addr_b, cmb.hwaddr()).await.unwrap();
        (c, in_b.recv().await.unwrap().1.unwrap())
    });
    let (mut pa, mut pb) = (Pump::new(a.clone()), Pump::new(b.clone()));
    pb.keep = false;
    let mut sink = Vec::new();
    for i in 0..n {
        pa.send(&conn.qp, &pattern(i as u32, 4096), &mut sink)
            .unwrap();
    }
    std::thread::sleep(pause);
    let t = Instant::now();
    while (pa.sent as usize + pa.send_errors.len()) < n && t.elapsed() < Duration::from_secs(20) {
        pb.progress(&mut sink, Duration::ZERO).unwrap();
        pa.progress(&mut sink, Duration::from_millis(1)).unwrap();
    }
    let after_pause = t.elapsed();
    pb.progress(&mut sink, Duration::from_millis(50)).unwrap();
    DryRing {
        delivered: pb.received,
        send_errors: pa.send_errors.clone(),
        after_pause,
    }
}

/// The RNR choice, measured: a receiver whose ring of 8 runs dry under 24 messages and is
/// not emptied for a while. With a finite RNR retry count (6) the sender's QP fails within
/// milliseconds of the ring running dry (completion status 13, RNR retry exceeded): a busy
/// receiver would kill its connections. With the chosen timing (retry without end, RNR timer
/// 0.64 ms) the sender waits out a half-second pause and every message arrives.
#[test]
fn a_dry_ring_slows_its_sender_and_the_connection_lives() {
    let Some(dev) = device("a_dry_ring_slows_its_sender_and_the_connection_lives") else {
        return;
    };
    let baseline = rdma_resources(&dev);
    let chosen = RcTiming::default();
    let mut rows = Vec::new();
    for (retry, timer, pause_ms) in [
        (6, 12, 50),
        (6, 31, 500),
        (chosen.rnr_retry, chosen.min_rnr_timer, 50),
        (chosen.rnr_retry, chosen.min_rnr_timer, 500),
    ] {
        let r = dry_ring(&dev, retry, timer, Duration::from_millis(pause_ms));
        eprintln!(
            "rnr_retry {retry}, RNR timer {timer} ({} us), receiver paused {pause_ms} ms: \
             {} of 24 delivered, send errors {:?}, done {:.1?} after the pause",
            rnr_timer_us(timer),
            r.delivered,
            r.send_errors.first(),
            r.after_pause
        );
        rows.push((retry, timer, pause_ms, r));
    }
    let finite = &rows[0].3;
    assert!(
        finite.send_errors.iter().any(|(_, s)| *s == 13),
        "a finite RNR retry count survived a 50 ms pause: {finite:?}"
    );
    for (_, _, pause, r) in &rows[2..] {
        assert!(r.send_errors.is_empty(), "{pause} ms: {r:?}");
        assert_eq!(r.delivered, 24, "{pause} ms: {r:?}");
    }
    settle(&dev, &baseline, COUNTED);
}

/// Sends posted as one chain arrive in order and intact; a chain longer than the QP's send
/// queue is taken up to what fits, and the count `post_sends` returns is exactly what the peer
/// receives (the provider's "first request not taken", turned into a count).
#[test]
fn a_chain_of_sends_is_posted_in_order_and_cut_where_the_queue_is_full() {
    let Some(dev) = device("a_chain_of_sends_is_posted_in_order_and_cut_where_the_queue_is_full")
    else {
        return;
    };
    let small = SetupConfig {
        max_send_wr: 8,
        ..SetupConfig::default()
    };
    let (a, cma, b, cmb) = two_nodes(&dev, small, SetupConfig::default());
    let rt = rt();
    let (conn, _peer_conn) = connect_a_to_b(&rt, &cma, &cmb);
    let fill = |slots: std::ops::Range<u32>, first: u32| -> Vec<SendRequest> {
        slots
            .enumerate()
            .map(|(k, slot)| {
                let data = pattern(first + k as u32, 100 + slot as usize);
                // SAFETY: nothing posted uses the slot yet.
                unsafe { a.send.slot(slot)[..data.len()].copy_from_slice(&data) };
                SendRequest {
                    slot,
                    len: data.len() as u32,
                    wr_id: u64::from(slot),
                }
            })
            .collect()
    };
    let mut pa = Pump::new(a.clone());
    let mut pb = Pump::new(b.clone());
    let mut got = Vec::new();

    // A chain that fits: every send taken.
    let chain = fill(0..4, 0);
    let (posted, r) = conn.qp.post_sends(&a.send, &chain);
    assert_eq!((posted, r.is_ok()), (4, true));
    pb.collect(&mut got, 4, Duration::from_secs(10)).unwrap();
    let mut none = Vec::new();
    let mut completed = |pa: &mut Pump, n: u64| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while pa.sent < n && Instant::now() < deadline {
            pa.progress(&mut none, Duration::from_millis(100)).unwrap();
        }
        assert_eq!(pa.sent, n, "sends completed: {:?}", pa.send_errors);
    };
    completed(&mut pa, 4);

    // 64 sends on a queue of 8 (an HCA may round it up, never to 64): cut where it is full.
    let chain = fill(0..64, 4);
    let (posted, r) = conn.qp.post_sends(&a.send, &chain);
    eprintln!("a chain of 64 on a send queue of 8: {posted} taken ({r:?})");
    assert!(r.is_err(), "a queue of 8 took all 64");
    assert!((8..64).contains(&posted), "{posted} taken");
    pb.collect(&mut got, 4 + posted, Duration::from_secs(10))
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    pb.progress(&mut got, Duration::ZERO).unwrap();
    assert_eq!(got.len(), 4 + posted, "the peer got more than was taken");
    for (i, m) in got.iter().enumerate() {
        let slot = if i < 4 { i } else { i - 4 };
        assert!(
            m.data == pattern(i as u32, 100 + slot),
            "message {i} in order and intact"
        );
    }
    completed(&mut pa, 4 + posted as u64);
    assert!(pa.send_errors.is_empty(), "{:?}", pa.send_errors);
}

/// A receive that fails (a message longer than the SRQ buffer it lands in) completes in error,
/// and such a completion's opcode is undefined (soft-RoCE leaves it 0, a send's): it must
/// still read as a receive that names its SRQ buffer, and the sender's failed completion as a
/// send that gives back its slot. (The engine once took such a receive for a send and stopped
/// on "slot 309 of 256".)
#[test]
fn completions_in_error_tell_a_receive_from_a_send() {
    let Some(dev) = device("completions_in_error_tell_a_receive_from_a_send") else {
        return;
    };
    let baseline = rdma_resources(&dev);
    {
        let a = Arc::new(Verbs::open(&dev, 64, 64).unwrap());
        let model = ReceiveModel::Srq { depth: 64 };
        let b = Arc::new(Verbs::open_buffers(&dev, model, 256, 64).unwrap());
        let cma = Arc::new(Cm::new(a.res.clone(), 0x10, SetupConfig::default()));
        let cmb = Arc::new(Cm::new(b.res.clone(), 0x20, SetupConfig::default()));
        let rt = rt();
        let (conn, peer_conn) = connect_a_to_b(&rt, &cma, &cmb);
        let data = pattern(1, 1000);
        // SAFETY: nothing posted uses slot 3.
        unsafe { a.send.slot(3)[..data.len()].copy_from_slice(&data) };
        // An id with the send bit set could not be told from the completion: refused, unposted.
        assert!(conn.qp.post_send(&a.send, 3, 1000, SEND_WR_ID | 3).is_err());
        conn.qp.post_send(&a.send, 3, 1000, 3).unwrap();

        let first_completion = |node: &Verbs| {
            let mut wcs = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if node.cq.poll(&mut wcs, 64).unwrap() > 0 {
                    return wcs[0];
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            panic!("no completion in 10 s");
        };
        let rx = first_completion(&b);
        eprintln!("B, a 1000-byte message into a 256-byte buffer: {rx:?}");
        assert!(rx.error.is_some(), "the receive did not fail: {rx:?}");
        assert!(rx.recv, "a failed receive read as a send: {rx:?}");
        assert_eq!(rx.qp_num, peer_conn.qp.qpn());
        let buf = b.res.recv.filled(&rx).expect("names no receive buffer");
        assert!(buf.qp().is_none(), "not the SRQ's buffer");
        buf.repost().unwrap();

        let tx = first_completion(&a);
        eprintln!("A, the send of it: {tx:?}");
        assert!(!tx.recv, "a send read as a receive: {tx:?}");
        assert_eq!((tx.wr_id, tx.qp_num), (3, conn.qp.qpn()));
        assert!(
            tx.error.is_some(),
            "the peer took 1000 bytes into 256: {tx:?}"
        );
    }
    settle(&dev, &baseline, COUNTED);
}

/// librdmacm resolves a path to the rxe device's own address (rxev0, 10.78.0.1: the route a
/// RoCE node fills itself), and a setup that asks for path records sends it in its REQ: the
/// answering side takes it, both QPs run with the ACK timeout ib_cm's rule gives for the
/// path's packet lifetime (not the fixed one), and messages cross. A peer's address no RDMA
/// device is on resolves to an error within the timeouts, and the setup goes on without.
#[test]
fn a_path_record_is_resolved_and_carried_in_the_req() {
    let Some(dev) = device("a_path_record_is_resolved_and_carried_in_the_req") else {
        return;
    };
    let rxe_ip: std::net::IpAddr = "10.78.0.1".parse().unwrap();
    let t = Instant::now();
    let rec = ipoib_ctl::verbs::resolve_path(rxe_ip, Duration::from_secs(1))
        .unwrap_or_else(|e| panic!("no path to {rxe_ip} on {dev}: {e}"));
    eprintln!("path record to {rxe_ip} in {:.1?}: {rec:?}", t.elapsed());
    assert!((1..=5).contains(&rec.mtu), "{rec:?}");
    assert!((1..=31).contains(&rec.packet_life_time), "{rec:?}");
    let t = Instant::now();
    let none =
        ipoib_ctl::verbs::resolve_path("10.99.0.1".parse().unwrap(), Duration::from_millis(500));
    eprintln!("no path to 10.99.0.1 after {:.1?}: {none:?}", t.elapsed());
    assert!(none.is_err(), "{none:?}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());

    let baseline = rdma_resources(&dev);
    let asks = SetupConfig {
        path_records: true,
        path_timeout: Duration::from_secs(1),
        ..SetupConfig::default()
    };
    let (a, cma, b, cmb) = two_nodes(&dev, asks, SetupConfig::default());
    let rt = rt();
    let (conn, peer_conn) = rt.block_on(async {
        let l = tokio::net::TcpListener::bind((rxe_ip, 0)).await.unwrap();
        let addr_b = l.local_addr().unwrap();
        let (tx, mut in_b) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(cmb.clone().serve(l, tx));
        let c = cma.connect(addr_b, cmb.hwaddr()).await.unwrap();
        (c, in_b.recv().await.unwrap().1.unwrap())
    });
    use std::sync::atomic::Ordering::Relaxed;
    assert_eq!(cma.stats.paths_resolved.load(Relaxed), 1);
    assert_eq!(cmb.stats.paths_from_peer.load(Relaxed), 1);
    let want = ipoib_ctl::path::ack_timeout(a.res.port.ca_ack_delay, rec.packet_life_time);
    let (ta, mtu_a) = conn.qp.path_attrs().unwrap();
    let (tb, mtu_b) = peer_conn.qp.path_attrs().unwrap();
    eprintln!(
        "ACK timeouts {ta} and {tb} (fixed: {}), path MTUs {mtu_a} and {mtu_b}",
        RcTiming::default().ack_timeout
    );
    assert_eq!(ta, want, "A's QP");
    assert_eq!(
        tb,
        ipoib_ctl::path::ack_timeout(b.res.port.ca_ack_delay, rec.packet_life_time),
        "B's QP took A's path"
    );
    assert!(mtu_a <= rec.mtu && mtu_b <= rec.mtu);
    // Messages cross on the path's address vector.
    let mut pa = Pump::new(a.clone());
    let mut none_sink = Vec::new();
    for i in 0..8 {
        pa.send(&conn.qp, &pattern(i, 1000), &mut none_sink)
            .unwrap();
    }
    let mut pb = Pump::new(b.clone());
    let mut got = Vec::new();
    pb.collect(&mut got, 8, Duration::from_secs(10)).unwrap();
    for (i, m) in got.iter().enumerate() {
        assert!(m.data == pattern(i as u32, 1000), "message {i} intact");
    }
    // B's handshake task holds B until its runtime goes.
    drop((conn, peer_conn, pa, pb, cma, cmb, a, b, rt));
    settle(&dev, &baseline, COUNTED);
}
