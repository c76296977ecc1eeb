//! Faults under a flow, each survived on UD and followed by the return to CM: the peer killed,
//! the port going down and up (and a GID added, which changes nothing), the handshake port
//! blocked or flooded or its stream cut, the receiver stopped, the node's own control loop
//! killed and restarted.

use super::*;

on_receive_models!(
    rings: Rings, then srq: Srq;
    // A ring registered for each setup that fails, and freed.
    a_blocked_handshake_port_keeps_the_peer_on_ud_until_it_opens,
    // Completions of a torn-down connection's ring, taken after the receiver resumes.
    a_stalled_receiver_falls_back_to_ud_and_returns_to_cm,
);

on_receive_models!(
    srq: Srq, then rings: Rings;
    a_killed_peer_falls_back_to_ud_and_returns_to_cm,
    the_port_going_down_and_up_moves_connected_mode_with_it,
);

/// The peer's control loop killed under the flow: A notices (the handshake stream ends), marks
/// it UD and the stream goes on over UD, intact; A retries with backoff (refused while B is
/// down); B restarted, the flow returns to CM.
fn a_killed_peer_falls_back_to_ud_and_returns_to_cm(recv: Recv) {
    let test = "a_killed_peer_falls_back_to_ud_and_returns_to_cm";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyk"), 2) else {
        return;
    };
    steps.step("both attached, a bulk stream promoted");
    attach(&mut lab, Which::A, recv, &dev, &[]);
    let pid_b = attach(&mut lab, Which::B, recv, &dev, &[]);
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5302);
    cm_up_within(&a, &b, PROMOTION, "promoted");

    steps.step("B's loop killed: A falls back to UD, the stream goes on");
    lab.kill9(pid_b);
    let t = Instant::now();
    let fell = a
        .wait_peer_mode(&b_ip, PeerModeView::Ud, Duration::from_secs(10))
        .expect("A kept B on CM after B's engine died");
    eprintln!("B killed: A fell back to UD after {:.1?}", t.elapsed());
    goes_on_over_ud(&a, &b_ip, &fell);
    assert_eq!(cm_of(&a).connections, 0);

    steps.step("B restarted without a stale CM entry: the flow back on CM");
    // B back: its entry for A, left CM_UP by the killed loop (pointing at a TUN device that
    // died with it), is UD again until a new connection is up.
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let a_ip = a.ip4.to_string();
    let b_view = b.peer(&a_ip).unwrap().expect("B knows A").mode;
    let a_view = a.peer(&b_ip).unwrap().unwrap().mode;
    assert!(
        b_view == PeerModeView::Ud || a_view != PeerModeView::Ud,
        "B restarted with a stale entry for A: {b_view} (A sees B as {a_view})"
    );
    // After A's backoff the flow is promoted again.
    returns_to_cm(&a, &b, Duration::from_secs(30), "B's restart");
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact, across CM -> UD -> CM", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// The node's own control loop killed (kill -9) under a UDP flow at a fixed rate and a TCP
/// stream, both A -> B on CM, then started again. Its TUN device dies with it: the fast path
/// sends the flows UD at once (the device is gone: `tx_ud_cm_device_gone`), not after the
/// heartbeat deadline. Lost: at most what was inside the engine when it died (the TUN queue of
/// 500 packets, the connection's backlog of 128 and its 64 sends in flight), and neither flow
/// waits for the deadline, at the kill or the restart (which adopts the pins, resets the stale
/// CM entries and promotes B again). The deadline is 10 s here, so that waiting for it (at
/// least 10 s) and what the flows do wait for stay apart on any machine: the lost queue's
/// sojourn (the datagrams) and TCP's retransmission timeout after it (the stream), both of
/// which grow with the machine's slowness.
#[test]
fn the_nodes_own_crash_and_restart_stall_no_flow() {
    let test = "the_nodes_own_crash_and_restart_stall_no_flow";
    let mut steps = Steps::new(test);
    let recv = Recv::Srq;
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyc", 2) else {
        return;
    };
    steps.step("both attached (A with a 10 s deadline), a paced UDP flow and a stream on CM");
    let deadline = Duration::from_secs(10);
    let policy = PolicyFile::new("hyc", "heartbeat-timeout=10s\n");
    let a_args = ["--policy", policy.arg()];
    let pid_a = attach(&mut lab, Which::A, recv, &dev, &a_args);
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let udp = PacedUdp::start(&a, &b, 5340);
    let stream = Stream::start(&a, &b, 5341);
    let on_cm = cm_up_within(&a, &b, PROMOTION, "promoted");
    // Both flows on CM: the datagrams are counted there too.
    std::thread::sleep(Duration::from_secs(2));
    let before = a.peer(&b_ip).unwrap().unwrap();
    assert!(
        before.traffic.tx_cm_packets > on_cm.traffic.tx_cm_packets + 1000,
        "the flows do not go CM: {before:?}"
    );
    let gone0 = reason(&a.status().unwrap(), "tx_ud_cm_device_gone");

    steps.step("A's loop killed under the flows (sampled for 4 s)");
    let killed = Instant::now();
    let after_kill = sample_while(
        || stream.received(),
        || {
            lab.kill9(pid_a);
            std::thread::sleep(Duration::from_secs(4));
        },
    );
    let gone = reason(&a.status().unwrap(), "tx_ud_cm_device_gone") - gone0;
    // B's entry as the dead loop left it (nobody writes it until the restart): CM_UP, unless
    // A's queue had overflowed just then (UD while it drains, by design; seen in CI), when
    // the device check never comes into play.
    let left = a.peer(&b_ip).unwrap().unwrap().mode;
    let last = read_status(&a.iface);
    eprintln!(
        "the dead loop's last status: queue overflows {:?}, B: {:?}",
        last.as_ref().map(|s| engine_count(s, "tx_congested")),
        last.as_ref()
            .and_then(|s| cm_peer(s, &b_ip).map(|p| p.why.clone()))
    );
    steps.step("A's loop restarted: B promoted again");
    let restarted = Instant::now();
    let mut up_again = Duration::ZERO;
    let after_restart = sample_while(
        || stream.received(),
        || {
            attach(&mut lab, Which::A, recv, &dev, &a_args);
            cm_up_within(&a, &b, PROMOTION, "promoted again after the restart");
            up_again = restarted.elapsed();
            std::thread::sleep(Duration::from_secs(2));
        },
    );
    // What the new loop's engine met once B was CM again: an overflow drops a packet and
    // sends the flow UD while the queue drains (by design), which TCP must recover from.
    let now = read_status(&a.iface);
    eprintln!(
        "after the restart: B cm_up again at {up_again:.1?}; the new loop's engine: queue \
         overflows {:?}, backpressure drops {:?}, no-connection drops {:?}",
        now.as_ref().map(|s| engine_count(s, "tx_congested")),
        now.as_ref().map(|s| engine_count(s, "tx_backpressure")),
        now.as_ref().map(|s| engine_count(s, "tx_no_connection")),
    );
    steps.step(
        "no datagram twice, at most what the engine held lost, no flow stalled for the deadline",
    );
    let ended = Instant::now();
    let pace = udp.pace;
    let (sent, got) = udp.finish();
    let total = stream.finish();

    let mut seqs: Vec<u32> = got.iter().map(|(i, _)| *i).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len(), got.len(), "a datagram arrived twice");
    let lost = sent - got.len() as u32;
    // What the kill cost: the datagrams due from just before it (those inside the engine) to a
    // second after (the TUN device's end). Others lost are the UD path's own drops under the
    // TCP stream, which shares it while the peer is UD (the lab's veth drops past its ring).
    let arrived: std::collections::HashSet<u32> = seqs.iter().copied().collect();
    let lost_at_kill = (0..sent)
        .filter(|i| !arrived.contains(i))
        .filter(|i| {
            let t = pace.due(*i);
            t + Duration::from_millis(500) >= killed && t <= killed + Duration::from_secs(1)
        })
        .count();
    let mut at: Vec<Instant> = got.iter().map(|(_, t)| *t).collect();
    at.sort_unstable();
    let gap_kill = longest_gap(&at, killed, restarted);
    let gap_restart = longest_gap(&at, restarted, ended);
    let (idle_kill, idle_restart) = (longest_idle(&after_kill), longest_idle(&after_restart));
    eprintln!(
        "kill -9: B's entry left {left}, UDP longest gap {gap_kill:.2?}, {gone} packets sent UD \
         for the gone device; \
         restart: UDP longest gap {gap_restart:.2?} (restart to CM again {:.1?}); \
         {lost} of {sent} datagrams lost, {lost_at_kill} of them due within 0.5 s before and 1 s \
         after the kill; TCP {} MiB, longest idle after the kill {idle_kill:.2?}, \
         after the restart {idle_restart:.2?} (sampled every 100 ms)",
        ended - restarted - Duration::from_secs(2),
        total >> 20,
    );
    if left == PeerModeView::CmUp {
        assert!(gone > 0, "no packet met the gone device's check");
    }
    assert!(
        lost_at_kill <= 500 + 128 + 64,
        "{lost_at_kill} datagrams lost at the kill: more than the engine could hold"
    );
    for (flow, what, gap) in [
        ("UDP flow", "kill", gap_kill),
        ("UDP flow", "restart", gap_restart),
        ("stream", "kill", idle_kill),
        ("stream", "restart", idle_restart),
    ] {
        assert!(
            gap < deadline / 2,
            "the {flow} stalled {gap:?} after the {what}: as if it waited for the heartbeat \
             deadline ({deadline:?})"
        );
    }
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// What a flood of the handshake port did, from the flooder's side.
#[derive(Debug, Default)]
struct FloodReport {
    opened: u64,
    refused: u64,
}

/// From `from`'s namespace, TCP connections to `to`, `hold` of them open at once, renewed
/// (the oldest closed) about 300 a second until `until`: a third send nothing, a third send
/// 48 bytes of garbage, a third half a REQ (magic, version, kind, then nothing).
fn flood(
    from: &Node,
    to: std::net::SocketAddr,
    hold: usize,
    until: Instant,
) -> std::thread::JoinHandle<FloodReport> {
    let ns = from.ns.clone();
    std::thread::spawn(move || {
        in_netns(&ns, move || {
            use ipoib_ctl::cm::wire::{Kind, MAGIC, VERSION};
            let mut open = std::collections::VecDeque::new();
            let mut r = FloodReport::default();
            let mut i = 0u64;
            while Instant::now() < until {
                i += 1;
                match TcpStream::connect_timeout(&to, Duration::from_secs(1)) {
                    Ok(mut s) => {
                        r.opened += 1;
                        let _ = match i % 3 {
                            0 => Ok(()),
                            1 => s.write_all(&[0x5a; 48]),
                            _ => {
                                let mut half = [0u8; 24];
                                half[..4].copy_from_slice(&MAGIC);
                                half[4] = VERSION;
                                half[5] = Kind::Req as u8;
                                s.write_all(&half)
                            }
                        };
                        open.push_back(s);
                        if open.len() > hold {
                            open.pop_front();
                        }
                    }
                    Err(_) => r.refused += 1,
                }
                std::thread::sleep(Duration::from_micros(3300));
            }
            r
        })
    })
}

/// A flood on A's handshake port from a third namespace (C), for 10 s (20 under `--long`):
/// 300 connections open at once, renewed about 300 a second, sending nothing, garbage or half
/// a REQ. Meanwhile small UDP B -> A is counted (none may be lost), and a bulk stream B -> A
/// starts 3 s in, so B must set up its connection to A through the flood. A's streams waiting for a REQ stay at the
/// bound (64), and with them its tasks, descriptors and memory; B's setup is refused at most
/// while the flood lasts and comes within seconds after it.
#[test]
fn a_flood_on_the_handshake_port_costs_nothing() {
    let test = "a_flood_on_the_handshake_port_costs_nothing";
    let mut steps = Steps::new(test);
    let recv = Recv::Srq;
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyf", 3) else {
        return;
    };
    steps.step("both attached, A's idle memory, tasks and descriptors");
    let pid_a = attach(&mut lab, Which::A, recv, &dev, &[]);
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let (a, b, c) = (lab.a.clone(), lab.b.clone(), lab.more[0].clone());
    let a_ip = a.ip4.to_string();
    let (rss0, fds0) = rss_and_fds(pid_a);
    let tasks0 = cm_of(&a).tasks;
    let secs: u32 = if long_run() { 20 } else { 10 };
    // Small datagrams every 2 ms, past the flood's end.
    let small = SmallUdp::start(&b, &a, 5350, (secs + 6) * 500);
    steps.step("C floods A's handshake port; small UDP B -> A, then a stream");
    let start = Instant::now();
    let until = start + Duration::from_secs(secs.into());
    let port = a.status().unwrap().policy.ctl_port;
    let flooder = flood(
        &c,
        std::net::SocketAddr::new(a.ip4.into(), port),
        300,
        until,
    );
    std::thread::sleep(Duration::from_secs(3));
    let stream = Stream::start(&b, &a, 5351);
    let mut peak = (0u64, 0u64, 0u64, 0u64);
    let mut on_cm_at = None;
    let mut looks = Looks::new(Duration::from_millis(200));
    while Instant::now() < until + Duration::from_secs(15) && on_cm_at.is_none() {
        let cm = cm_of(&a);
        let (rss, fds) = rss_and_fds(pid_a);
        peak = (
            peak.0.max(cm.awaiting_req),
            peak.1.max(cm.tasks),
            peak.2.max(rss),
            peak.3.max(fds),
        );
        if b.peer(&a_ip)
            .unwrap()
            .is_some_and(|p| p.mode == PeerModeView::CmUp)
        {
            on_cm_at = Some(start.elapsed());
        }
        looks.rest();
    }
    steps.step("bounded waiting set, tasks, descriptors and memory; B promoted");
    let report = flooder.join().expect("flooder");
    let cm = cm_of(&a);
    eprintln!(
        "flood: {} connections opened ({} refused) in {secs} s; A: peak {} streams waiting for \
         a REQ ({} dropped), peak {} tasks (idle {tasks0}), peak RSS {} KiB (idle {rss0}), peak \
         {} fds (idle {fds0}); B's setup to A done {:.1?} after the flood began (it ended at \
         {secs} s)",
        report.opened,
        report.refused,
        peak.0,
        cm.dropped_awaiting_req,
        peak.1,
        peak.2,
        peak.3,
        on_cm_at
    );
    let on_cm_at = on_cm_at.unwrap_or_else(|| {
        panic!(
            "B not on CM with A 15 s after the flood: {:#?}\nA's log:\n{}",
            b.cm().unwrap(),
            ctl_log(&a)
        )
    });
    // Thick enough once most of it met a full waiting set: five times the set's bound (a
    // slow machine opens fewer in the same seconds: 651 in 10 s at --slow 2.5).
    assert!(
        report.opened > 5 * 64,
        "the flood was too thin to prove anything: {report:?}"
    );
    assert!(
        cm.dropped_awaiting_req > 0,
        "the flood never filled the waiting set: {cm:#?}"
    );
    assert!(peak.0 <= 64, "streams waiting for a REQ past the bound");
    assert!(peak.1 <= tasks0 + 64 + 16 + 16, "tasks grew with the flood");
    assert!(
        peak.3 <= fds0 + 64 + 16 + 16,
        "descriptors grew with the flood"
    );
    assert!(peak.2 <= rss0 + 32 * 1024, "memory grew with the flood");
    assert!(
        on_cm_at < Duration::from_secs((secs + 10).into()),
        "B's setup came {on_cm_at:?} after the flood began"
    );
    steps.step("no small datagram lost, the stream intact");
    std::thread::sleep(Duration::from_secs(2));
    let (sent, received) = small.finish();
    assert_eq!(received, sent, "small UDP lost under the flood");
    let total = stream.finish();
    eprintln!(
        "{} MiB crossed intact; {received} of {sent} small datagrams",
        total >> 20
    );
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// How often `n`'s log says connected mode started (at the loop's start, and each time again).
fn starts(n: &Node) -> usize {
    ctl_log(n)
        .lines()
        .filter(|l| l.contains("connected mode on ") && l.contains(" started in "))
        .count()
}

/// Why `n`'s connected mode does not run, once its control loop says so (within 15 s: the
/// first start looks at the port at once, a stop says so at once); the loop must be alive,
/// its heartbeat fresh, and connected mode off.
fn cm_down_of(n: &Node, what: &str) -> String {
    let mut seen = None;
    wait_until(Duration::from_secs(15), || {
        let s = n.status().unwrap();
        seen = Some(s.clone());
        s.cm.is_none() && s.cm_down.is_some()
    });
    let s = seen.unwrap();
    let why = s.cm_down.clone().unwrap_or_else(|| {
        panic!(
            "{}: {what}: no reason why connected mode is off: {:?}\n{}",
            n.ns,
            s.cm.as_ref().map(|c| c.connections),
            ctl_log(n)
        )
    });
    assert!(
        s.loop_running && !s.failsafe_active,
        "{}: {what}: {s:#?}",
        n.ns
    );
    why
}

/// The port under connected mode, as a subnet moves it (rxe's link, under the flow):
/// - both nodes attached while it is DOWN wait on UD: status says why, the heartbeat beats,
///   and a look again a few seconds on finds them still waiting;
/// - it comes up (PORT_ACTIVE): connected mode starts on both, the flow is promoted;
/// - a GID added to the port's table (an address on rxe's netdev: GID_CHANGE) changes nothing
///   of ours: no restart, the flow stays on CM;
/// - the link goes down under the flow (PORT_ERR, and GID_CHANGE as its GIDs go): connected
///   mode stops at once on both, every peer on UD, the stream goes on over UD; the link
///   back, connected mode starts again and the flow returns to CM. The stream arrives intact
///   throughout.
fn the_port_going_down_and_up_moves_connected_mode_with_it(recv: Recv) {
    let test = "the_port_going_down_and_up_moves_connected_mode_with_it";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyq"), 2) else {
        return;
    };
    steps.step("both attached with the port down: on UD, saying why");
    let netdev = rdma_netdev(&dev);
    assert_eq!(
        netdev.as_deref(),
        Some("rxev0"),
        "the test's rxe device runs on rxev0"
    );
    let guard = LinkUp("rxev0".into());
    set_link("rxev0", "down").unwrap();
    let mut args = vec!["--cm-device", dev.as_str()];
    if recv == Recv::Rings {
        args.extend(["--srq", "off"]);
    }
    let (a, b) = (lab.a.clone(), lab.b.clone());
    for n in [&a, &b] {
        lab.attach_node(n, &args)
            .unwrap_or_else(|e| panic!("{}: attach with the port down: {e:#}", n.ns));
    }
    for n in [&a, &b] {
        let why = cm_down_of(n, "attached with the port down");
        eprintln!("{}: {why}", n.ns);
        assert!(
            why.contains("is not ready for connected mode") && why.contains("not ACTIVE"),
            "{}: {why}",
            n.ns
        );
    }
    steps.step("still waiting a few looks later, under a stream");
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5303);
    // Looked at again each second, and still waiting.
    std::thread::sleep(Duration::from_secs(3));
    let why = cm_down_of(&a, "still down");
    assert!(why.contains("not ACTIVE"), "{why}");
    assert_eq!(starts(&a), 0, "{}", ctl_log(&a));

    steps.step("the port up: connected mode on both, the flow promoted");
    set_link("rxev0", "up").unwrap();
    let t = Instant::now();
    let up = wait_until(Duration::from_secs(30), || {
        a.cm().unwrap().is_some() && b.cm().unwrap().is_some()
    });
    assert!(
        up,
        "connected mode did not start with the port up:\nA:\n{}\nB:\n{}",
        ctl_log(&a),
        ctl_log(&b)
    );
    eprintln!(
        "the port up: connected mode on both after {:.1?}",
        t.elapsed()
    );
    assert_eq!(a.status().unwrap().cm_down, None, "said down while it runs");
    cm_up_within(&a, &b, PROMOTION, "promoted once the port is up");
    let (starts_a, starts_b) = (starts(&a), starts(&b));
    assert_eq!((starts_a, starts_b), (1, 1), "A:\n{}", ctl_log(&a));

    steps.step("a GID added to the port: no restart, the flow on CM");
    // A GID more in the port's table: ours is as it was.
    ipoib_tests::programs::sh_ok(&["ip", "addr", "add", "10.78.0.77/24", "dev", "rxev0"]);
    let said = wait_until(Duration::from_secs(10), || {
        ctl_log(&a).contains("GID_CHANGE, nothing of ours changed")
    });
    assert!(said, "no GID_CHANGE seen at A:\n{}", ctl_log(&a));
    let before = a.peer(&b_ip).unwrap().unwrap();
    let later = over_cm_past(&a, &b_ip, &before);
    assert!(
        later.traffic.tx_cm_bytes > before.traffic.tx_cm_bytes + (1 << 20),
        "the flow left CM after a GID was added: {later:?}"
    );
    assert_eq!(
        (starts(&a), starts(&b)),
        (1, 1),
        "a GID elsewhere restarted connected mode"
    );
    ipoib_tests::programs::sh_ok(&["ip", "addr", "del", "10.78.0.77/24", "dev", "rxev0"]);

    steps.step("the port down under the flow: connected mode stops, every peer UD");
    set_link("rxev0", "down").unwrap();
    let t = Instant::now();
    let fell = a
        .wait_peer_mode(&b_ip, PeerModeView::Ud, Duration::from_secs(15))
        .unwrap_or_else(|| panic!("A kept B on CM with the port down:\n{}", ctl_log(&a)));
    eprintln!("the port down: A fell back to UD after {:.1?}", t.elapsed());
    // rxe raises PORT_ERR and GID_CHANGE (its addresses' GIDs go with the link), in either
    // order: connected mode stops on the first.
    for n in [&a, &b] {
        let why = cm_down_of(n, "the port down under the flow");
        eprintln!("{}: {why}", n.ns);
        assert!(
            ["PORT_ERR", "GID_CHANGE", "not ACTIVE"]
                .iter()
                .any(|w| why.contains(w)),
            "{}: {why}",
            n.ns
        );
        assert!(
            ctl_log(n).contains("starts again on the port as it is now"),
            "{}:\n{}",
            n.ns,
            ctl_log(n)
        );
    }
    goes_on_over_ud(&a, &b_ip, &fell);

    steps.step("the port back: the flow returns to CM, the stream intact");
    drop(guard);
    returns_to_cm(&a, &b, Duration::from_secs(60), "the port's return");
    assert!(starts(&a) >= 2, "A:\n{}", ctl_log(&a));
    let sent = stream.finish();
    eprintln!(
        "{} MiB crossed intact, across UD -> CM -> UD -> CM",
        sent >> 20
    );
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// A one-way flow (UDP, A -> B on CM, 100 datagrams a second) while every segment of the
/// handshake's TCP stream is dropped at B, its keepalive with it (as the UD path drops it under
/// load): B sends nothing else A could hear. B's engine sends a keepalive on the connection
/// itself each half-second it has sent nothing there, so A keeps hearing B and keeps the
/// connection for four heartbeat deadlines: the same connection throughout (A's status,
/// sampled every 250 ms), no failure counted against B, and A counts B's keepalives. (The
/// fast path's mode is not asked: a soft-RoCE stall may fill the queue and send the flow UD
/// while it drains, by design.)
#[test]
fn a_one_way_flow_keeps_its_connection_while_the_handshake_stream_is_cut() {
    let test = "a_one_way_flow_keeps_its_connection_while_the_handshake_stream_is_cut";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyo", 2) else {
        return;
    };
    steps.step("attached (A mode=connected), a one-way UDP flow on CM");
    // 120 kB/s is below the bulk threshold: mode=connected asks CM for it.
    let policy = PolicyFile::new("hyo", "mode=connected\n");
    lab.attach(Which::A, &["--cm-device", &dev, "--policy", policy.arg()])
        .unwrap();
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let flow = PacedUdp::every(&a, &b, 5390, Duration::from_millis(10));
    a.wait_peer_mode(&b_ip, PeerModeView::CmUp, Duration::from_secs(20))
        .unwrap_or_else(|| panic!("not promoted: {:#?}\n{}", a.cm().unwrap(), ctl_log(&a)));
    std::thread::sleep(Duration::from_secs(1));
    let before = cm_of(&a);
    let failures = |cm: &CmStatus| cm_peer(cm, &b_ip).map(|p| p.failures);
    steps.step("B's handshake stream cut: A keeps the connection for four deadlines");
    nft(
        &b,
        "table inet hs {\n chain in {\n  type filter hook input priority 0; policy accept;\n  \
         tcp sport 4755 drop\n  tcp dport 4755 drop\n }\n chain out {\n  type filter hook \
         output priority 0; policy accept;\n  tcp sport 4755 drop\n  tcp dport 4755 drop\n \
         }\n}\n",
    );
    let t = Instant::now();
    let heartbeat = Duration::from_secs(3);
    let mut samples = 0;
    let mut looks = Looks::new(Duration::from_millis(250));
    while t.elapsed() < 4 * heartbeat {
        if let Some(now) = read_status(&a.iface) {
            samples += 1;
            let same = now.connections == 1
                && now.established == before.established
                && failures(&now) == failures(&before);
            assert!(
                same,
                "A's connection to B changed {:.1?} after B's handshake stream was cut: \
                 {now:#?}\nB's engine: {:?}\nA's log:\n{}\nB's log:\n{}",
                t.elapsed(),
                b.cm().unwrap().map(|c| c.engine),
                ctl_log(&a),
                ctl_log(&b)
            );
        }
        looks.rest();
    }
    steps.step("A heard B's keepalives on the connection");
    let after = cm_of(&a);
    nft(&b, "delete table inet hs");
    let (sent, got) = flow.finish();
    let heard =
        engine_count(&after, "keepalives_received") - engine_count(&before, "keepalives_received");
    eprintln!(
        "{:.0?} with the handshake stream cut ({samples} samples): A kept its connection, \
         {heard} keepalive(s) from B on it; {} of {sent} datagrams arrived",
        4 * heartbeat,
        got.len()
    );
    assert!(samples >= 20, "A's status read {samples} times in 12 s");
    assert!(heard >= 4, "A heard {heard} keepalives from B in 12 s");
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// The handshake port blocked at the peer (its TCP SYNs dropped): A's setups time out, B stays
/// on UD with A backing off, the stream goes on over UD, intact, and nothing is left half set
/// up. Unblocked, a retry after the backoff connects and the flow goes CM.
fn a_blocked_handshake_port_keeps_the_peer_on_ud_until_it_opens(recv: Recv) {
    let test = "a_blocked_handshake_port_keeps_the_peer_on_ud_until_it_opens";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyp"), 2) else {
        return;
    };
    steps.step("B's handshake port blocked, both attached, a stream");
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let nft = |script: &str| nft(&b, script);
    nft(
        "table inet hs {\n chain in {\n  type filter hook input priority 0; policy accept;\n  tcp dport 4755 drop\n }\n}\n",
    );
    attach(&mut lab, Which::A, recv, &dev, &[]);
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let stream = Stream::start(&a, &b, 5304);

    steps.step("a setup given up, the stream on UD, no ring held");
    // Blocked: never CM, until a setup has been given up (timeouts: 4 steps of 2 s) and the
    // stream has moved on over UD.
    let start = a.peer(&b_ip).unwrap();
    let before = start.map_or(0, |p| p.traffic.tx_ud_bytes);
    let t = Instant::now();
    let gave_up = wait_until(Duration::from_secs(60), || {
        let p = a.peer(&b_ip).unwrap();
        if let Some(p) = &p {
            assert_ne!(
                p.mode,
                PeerModeView::CmUp,
                "CM with the handshake port blocked"
            );
        }
        let failures = cm_peer(&cm_of(&a), &b_ip).map_or(0, |p| p.failures);
        failures >= 1 && p.is_some_and(|p| p.traffic.tx_ud_bytes > before + (1 << 20))
    });
    let cm = cm_of(&a);
    let peer = cm_peer(&cm, &b_ip).expect("B in A's CM status");
    eprintln!("blocked for {:.1?}: {peer:?}", t.elapsed());
    assert!(
        gave_up,
        "no setup given up with the stream on UD in 60 s: {peer:?}"
    );
    assert!(cm.failed >= 1, "{cm:#?}");
    assert_eq!(cm.connections, 0);
    // Each setup registers a ring before it connects (rings per connection): one given up
    // frees it, so the peer waits out its backoff holding none.
    let freed = wait_until(Duration::from_secs(30), || {
        let cm = cm_of(&a);
        cm_peer(&cm, &b_ip).is_some_and(|p| p.state == CmPeerState::Backoff)
            && cm.receive.rings == 0
    });
    assert!(
        freed,
        "a given-up setup kept its ring: {:?}",
        cm_of(&a).receive
    );
    steps.step("the port open: the flow on CM after the backoff");
    // Open again: promoted after the backoff.
    nft("delete table inet hs");
    let t = Instant::now();
    a.wait_peer_mode(&b_ip, PeerModeView::CmUp, Duration::from_secs(60))
        .unwrap_or_else(|| {
            panic!(
                "not on CM 60 s after the port opened: {:#?}",
                a.cm().unwrap()
            )
        });
    eprintln!("port open: on CM after {:.1?}", t.elapsed());
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// Resumes a stopped process however the test ends.
struct Cont(u32);
impl Drop for Cont {
    fn drop(&mut self) {
        // SAFETY: plain kill(2).
        unsafe { libc::kill(self.0 as i32, libc::SIGCONT) };
    }
}

/// A stalled receiver: B has a small plan (memory-budget=16MiB: an SRQ of 256 buffers, or
/// rings of 64) and its control loop is stopped (SIGSTOP), so its engine takes nothing off
/// the SRQ or its ring and posts nothing again, while its HCA keeps acknowledging what lands in the buffers still
/// posted: A's sends complete without error into a blackhole (seen here before the keepalive:
/// 20 s on CM, no send error, the stream stalled). A takes B's silence on the connection's
/// stream as the peer gone once that silence passes the heartbeat deadline (the fallback's
/// time is printed, not bounded: each look takes seconds on a slow machine), counts it as B's
/// failure, and the stream goes on over UD, intact, while B is stopped. B resumed, A connects again after its backoff
/// and the flow returns to CM.
fn a_stalled_receiver_falls_back_to_ud_and_returns_to_cm(recv: Recv) {
    let test = "a_stalled_receiver_falls_back_to_ud_and_returns_to_cm";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hys"), 2) else {
        return;
    };
    steps.step("both attached (B on a small plan), a stream on CM");
    let tiny = PolicyFile::new("hys-b", "memory-budget=16MiB\n");
    attach(&mut lab, Which::A, recv, &dev, &[]);
    let pid_b = attach(&mut lab, Which::B, recv, &dev, &["--policy", tiny.arg()]);
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let rx = cm_of(&b).receive;
    match recv {
        Recv::Srq => assert_eq!(rx.depth, 256, "{rx:?}"),
        // 16 MiB holds four rings of 64 buffers of 64 KiB.
        Recv::Rings => assert_eq!((rx.depth, rx.max_rings), (64, 4), "{rx:?}"),
    }
    let stream = Stream::start(&a, &b, 5305);
    cm_up_within(&a, &b, PROMOTION, "promoted");
    std::thread::sleep(Duration::from_secs(2));

    steps.step("B stopped: A falls back to UD, counts B's failure, the stream goes on");
    let resume = Cont(pid_b);
    // SAFETY: plain kill(2).
    assert_eq!(unsafe { libc::kill(pid_b as i32, libc::SIGSTOP) }, 0);
    let t = Instant::now();
    // A condition, not a clock: B's silence is judged after the heartbeat deadline, but each
    // look at A's map is a whole `status` run, seconds apart on a slow machine.
    let fell = a
        .wait_peer_mode(&b_ip, PeerModeView::Ud, Duration::from_secs(30))
        .unwrap_or_else(|| {
            panic!(
                "A kept B on CM with B stalled: {:#?}\nA's log:\n{}",
                a.cm().unwrap(),
                ctl_log(&a)
            )
        });
    let took = t.elapsed();
    let heard: Vec<String> = ctl_log(&a)
        .lines()
        .filter(|l| l.contains("nothing heard for") || l.contains("went silent"))
        .map(str::to_string)
        .collect();
    eprintln!("A's log on B's silence: {heard:#?}");
    // The map changes at once; the policy's view is written into the status once a tick.
    let b_addr: std::net::IpAddr = b.ip4.into();
    let t = Instant::now();
    let mut looks = Looks::new(Duration::from_millis(100));
    let failed = loop {
        let s = read_status(&a.iface);
        let p = s
            .as_ref()
            .and_then(|s| s.peers.iter().find(|p| p.addr == b_addr).cloned());
        if let (Some(s), Some(p)) = (&s, p)
            && (p.failures >= 1 || t.elapsed() > Duration::from_secs(5))
        {
            break (s.clone(), p);
        }
        looks.rest();
    };
    let (cm, why) = failed;
    eprintln!(
        "B stopped: A fell back to UD after {took:.1?} ({}; send errors {}, queue overflows {})",
        why.why,
        cm.engine.get("send_errors").unwrap_or(&0),
        cm.engine.get("tx_congested").unwrap_or(&0)
    );
    assert!(
        why.failures >= 1,
        "the fallback was not taken as B's failure: {why:?}"
    );
    let before = stream.received();
    goes_on_over_ud(&a, &b_ip, &fell);
    assert!(
        stream.received() > before + (1 << 20),
        "nothing arrived while B was stopped"
    );

    steps.step("B resumed: the flow back on CM, intact");
    drop(resume);
    returns_to_cm(&a, &b, Duration::from_secs(90), "B's resumption");
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact, across CM -> UD -> CM", sent >> 20);
    steps.step("mode=datagram: the engine forgets the connection's flow");
    // mode=datagram drains the connection; the engine forgets what it tracked for it.
    let flows = || engine_flows(&a);
    assert!(flows().is_some_and(|f| f >= 1), "A's engine tracks no flow");
    a.set_policy("mode=datagram").unwrap();
    a.wait_peer_mode(&b_ip, PeerModeView::Ud, Duration::from_secs(10))
        .expect("mode=datagram drained B");
    wait_until(Duration::from_secs(10), || flows() == Some(0));
    assert_eq!(flows(), Some(0), "the closed connection's flow lingers");
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}
