//! Promotion: bulk traffic to CM, small traffic on UD, over IPv6 and in a partition; a UD path
//! that segments keeps bulk on UD; a peer that runs no ipoib-hybrid stays UD, and says why.

use super::*;

on_receive_models!(
    rings: Rings, then srq: Srq;
    // A reaped connection's ring freed, on both sides.
    bulk_tcp_is_promoted_to_cm_and_small_traffic_stays_on_ud,
);

/// A bulk TCP stream from A to B, checked byte for byte, starts on UD and is promoted to CM;
/// pings and small UDP beside it stay UD, none lost; B streams back to A over the same
/// connection, checked too; idle, the connection is reaped and both sides' QPs and receive
/// rings are freed (the kernel's counts); detached, A's TUN device goes.
fn bulk_tcp_is_promoted_to_cm_and_small_traffic_stays_on_ud(recv: Recv) {
    let test = "bulk_tcp_is_promoted_to_cm_and_small_traffic_stays_on_ud";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyb"), 2) else {
        return;
    };
    steps.step("both nodes attached, B reaping connections idle for 2 s");
    // Loose reverse-path filtering (other tests keep the lab's 0).
    loose_rp_filter(&[&lab.a, &lab.b]);
    let pid_a = attach(&mut lab, Which::A, recv, &dev, &[]);
    // B reaps connections idle for 2 s: the one A sends the stream over must not look idle to
    // B, which only receives over it (its ACKs are small: UD).
    let pid_b = attach(
        &mut lab,
        Which::B,
        recv,
        &dev,
        &["--cm-idle-after", "2", "--cm-min-hold", "1"],
    );
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let tun_a = cm_of(&a).tun;
    // The kernel's view of each node's memory regions with no connection.
    let [mrs_a, mrs_b] = mrs_of_each([pid_a, pid_b]);

    steps.step("a bulk stream A -> B promoted to CM, on one thread");
    let stream = Stream::start(&a, &b, 5301);
    // Promotion: B becomes cm_up at A within a few ticks of the flow starting.
    let t0 = Instant::now();
    let at_promotion = a.wait_peer_mode(&b_ip, PeerModeView::CmUp, Duration::from_secs(12));
    let at_promotion = at_promotion
        .unwrap_or_else(|| panic!("B was not promoted at A in 12 s: {:#?}", a.cm().unwrap()));
    let promoted_after = t0.elapsed();
    // One thread per attached interface: the heartbeat, connected mode, its engine and the
    // device's events all run on the control loop's one runtime.
    let pid = a.status().unwrap().loop_pid.expect("A's control loop pid");
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.count())
        .unwrap_or(0);
    eprintln!("A's control loop (pid {pid}) runs {threads} thread(s) with a connection up");
    assert_eq!(threads, 1, "A's attach runs {threads} threads");
    std::thread::sleep(Duration::from_secs(4));
    steps.step("pings and small UDP beside the stream: UD, none lost");
    // Mixed traffic while the stream rides CM: pings and small UDP datagrams are small, so UD
    // (the fast path's `tx_ud_small`), and none is lost.
    let small = |s: &Status| reason(s, "tx_ud_small");
    let before = a.status().unwrap();
    let udp = SmallUdp::start(&a, &b, 5401, 400);
    let ping = a
        .cmd("ping")
        .args(["-c", "5", "-i", "0.2", "-W", "2", &b_ip])
        .output()
        .unwrap();
    assert!(
        ping.status.success(),
        "{}",
        String::from_utf8_lossy(&ping.stdout)
    );
    let (sent_udp, got_udp) = udp.finish();
    assert_eq!(
        got_udp, sent_udp,
        "small UDP datagrams were lost beside the bulk flow"
    );
    let after = a.status().unwrap();
    eprintln!(
        "beside the stream on CM: 5 pings and {sent_udp} datagrams of 100 B, {got_udp} arrived; \
         {} small packets counted UD",
        small(&after) - small(&before)
    );
    assert!(
        small(&after) >= small(&before) + 5 + sent_udp,
        "5 pings and {sent_udp} datagrams, {} small packets counted UD",
        small(&after) - small(&before)
    );
    // Still B's connection: on CM, or back on it within seconds after a moment of congestion
    // (its queue past the backlog sends the peer UD until it drains; counted as congested).
    let still = a.wait_peer_mode(&b_ip, PeerModeView::CmUp, Duration::from_secs(5));
    assert!(
        still.is_some(),
        "B is off CM after the small traffic: {:?}; A's engine {:?}",
        a.peer(&b_ip).unwrap(),
        cm_of(&a).engine
    );
    eprintln!("small traffic beside the stream: UD, none lost");
    steps.step("B streams back to A over the same connection");
    // The other direction too: B streams to A over the connection it accepted (its map says
    // CM for A once its engine routes A's address to it), checked byte for byte at A.
    let a_ip = a.ip4.to_string();
    let back_from = b.peer(&a_ip).unwrap().expect("B knows A");
    let back = Stream::start(&b, &a, 5302);
    eprintln!("B streams to A (B's view of A: {back_from:?})");
    let back_to = over_cm_past(&b, &a_ip, &back_from);
    let during = cm_of(&a);
    let b_during = cm_of(&b);
    // The engine's CPU time is measured on its thread, the control loop's one: more than
    // nothing while a stream rides it, and no more than the whole process has used (its
    // ticks, with two of slack for their rounding).
    let process_ns =
        ipoib_tests::bench::stat_ticks(&format!("/proc/{pid}/stat")).unwrap() * 10_000_000;
    eprintln!(
        "A's engine: {} ms of CPU ({:?} s per GB), its process {} ms",
        during.engine_cpu_ns / 1_000_000,
        during.engine_cpu_s_per_gb(),
        process_ns / 1_000_000
    );
    assert!(
        during.engine_cpu_ns > 0 && during.engine_cpu_ns <= process_ns + 20_000_000,
        "A's engine CPU {} ns against its process's {process_ns} ns",
        during.engine_cpu_ns
    );
    eprintln!(
        "{} B checked at A; B's view of A: {back_to:?}; B's engine: {:?}; A's \
         engine: {:?}",
        back.received(),
        b_during.engine,
        during.engine
    );
    let sent_back = back.finish();
    let sent = stream.finish();
    let cm_back = back_to.traffic.tx_cm_bytes - back_from.traffic.tx_cm_bytes;
    eprintln!(
        "B -> A: {} MiB intact, {} MiB of it over CM",
        sent_back >> 20,
        cm_back >> 20
    );
    assert!(
        cm_back > 1 << 20,
        "B's stream to A hardly went CM: {back_to:?}"
    );

    steps.step("most of the stream went CM");
    let end = a.peer(&b_ip).unwrap().unwrap();
    let (t0, t1) = (&at_promotion.traffic, &end.traffic);
    let (cm, ud) = (
        t1.tx_cm_bytes - t0.tx_cm_bytes,
        t1.tx_ud_bytes - t0.tx_ud_bytes,
    );
    eprintln!(
        "promoted after {promoted_after:.1?}; {} MiB sent; after promotion CM {} MiB, UD {} KiB; \
         A's connected mode: {:#?}",
        sent >> 20,
        cm >> 20,
        ud >> 10,
        during
    );
    // The large majority goes CM. Not all: when the connection's queue overflows, the next
    // packets go UD until it drains (`tx_congested`; seen here in runs on a slow machine: 15
    // of 101 MiB, and 23.6 of 92.5 MiB). So: at least half CM, and more than a tenth UD only
    // where the queue overflowed (UD with a cause).
    let overflows = engine_count(&cm_of(&a), "tx_congested");
    eprintln!("A's queue overflowed {overflows} time(s)");
    let share = cm as f64 / (cm + ud).max(1) as f64;
    if share < 0.5 || (share < 0.9 && overflows == 0) {
        let tun_b = b.cm().unwrap();
        let link = b.cmd("ip").args(["-s", "link"]).output().unwrap();
        let nstat = b.cmd("nstat").args(["-az"]).output().unwrap();
        let drops: Vec<String> = String::from_utf8_lossy(&nstat.stdout)
            .lines()
            .filter(|l| l.split_whitespace().nth(1).is_some_and(|v| v != "0"))
            .map(str::to_string)
            .collect();
        let ss_a = a.cmd("ss").args(["-tin"]).output().unwrap();
        let ss_b = b.cmd("ss").args(["-tin"]).output().unwrap();
        eprintln!(
            "A ss: {}\nB ss: {}\nA log: {}\nB log: {}",
            String::from_utf8_lossy(&ss_a.stdout),
            String::from_utf8_lossy(&ss_b.stdout),
            std::fs::read_to_string(a.log_path()).unwrap_or_default(),
            std::fs::read_to_string(b.log_path()).unwrap_or_default(),
        );
        panic!(
            "after promotion only {cm} of {} bytes went CM (queue overflows: {overflows})\nB's \
             CM: {tun_b:#?}\nB's links: {}\nB's drops: {drops:#?}",
            cm + ud,
            String::from_utf8_lossy(&link.stdout)
        );
    }
    assert!(cm > 1 << 20, "hardly anything went CM: {cm} bytes");
    assert!(
        engine_count(&during, "tx_bytes") > 0 && engine_count(&during, "tx_oversize") == 0,
        "{:?}",
        during.engine
    );
    assert_eq!(during.connections, 1);
    let peer_why = cm_peer(&during, &b_ip).expect("B in A's CM status");
    assert_eq!(peer_why.state, CmPeerState::Cm, "{peer_why:?}");
    assert_eq!(
        peer_why.promotions, 1,
        "the connection was lost and set up again: {peer_why:?}"
    );
    // B took the connection as the passive side, and kept it while the stream came in over
    // it (it reaps after 2 s idle, and counts what it receives).
    assert_eq!(b_during.connections, 1, "{b_during:#?}");

    steps.step("idle: the connection reaped, its QPs and rings freed");
    // Idle now: B reaps the connection (after 2 s), A sees it close; each side's QP goes, and
    // with it (without an SRQ) its receive ring: the kernel's counts are back where they were.
    let reaped = wait_until(Duration::from_secs(15), || {
        cm_of(&a).connections == 0 && cm_of(&b).connections == 0
    });
    assert!(reaped, "not reaped: A {:#?}\nB {:#?}", cm_of(&a), cm_of(&b));
    let qps_now = || rdma_resources(&dev).get("qp").copied();
    wait_until(Duration::from_secs(5), || {
        qps_now() == baseline.get("qp").copied() && mrs_of_each([pid_a, pid_b]) == [mrs_a, mrs_b]
    });
    assert_eq!(
        qps_now(),
        baseline.get("qp").copied(),
        "a reaped connection's QP lingers"
    );
    assert_eq!(
        mrs_of_each([pid_a, pid_b]),
        [mrs_a, mrs_b],
        "a reaped ring lingers"
    );
    steps.step("A detached: its TUN device gone, A UD at B");
    // Detach A: its control loop stops connected mode and A's TUN device goes; B says A is
    // UD. Then everything: QPs back to where they were.
    let out = a.ctl(&["detach", &a.iface]).unwrap();
    assert!(out.status.success());
    let tun_gone = || {
        !a.cmd("ip")
            .args(["link", "show", &tun_a])
            .output()
            .unwrap()
            .status
            .success()
    };
    wait_until(Duration::from_secs(10), tun_gone);
    assert!(tun_gone(), "{tun_a} outlived A's control loop");
    wait_until(Duration::from_secs(10), || cm_of(&b).connections == 0);
    assert_eq!(cm_of(&b).connections, 0, "B kept a dead connection");
    assert_eq!(
        b.peer(&a.ip4.to_string()).unwrap().unwrap().mode,
        PeerModeView::Ud
    );
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// An IPv6 peer: a bulk stream to B's IPv6 address is promoted like an IPv4 one (the fast path
/// keys the peer by its IPv6 address, the handshake runs over IPv6, the engine routes IPv6
/// packets), goes CM and arrives intact.
#[test]
fn an_ipv6_peer_is_promoted_too() {
    let test = "an_ipv6_peer_is_promoted_too";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hy6", 2) else {
        return;
    };
    steps.step("both attached");
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b6: std::net::Ipv6Addr = b.ip6.parse().unwrap();
    let key = b6.to_string();
    steps.step("a bulk stream to B's IPv6 address promoted");
    let stream = Stream::start_to(&a, &b, std::net::SocketAddr::new(b6.into(), 5306));
    let at = a
        .wait_peer_mode(&key, PeerModeView::CmUp, Duration::from_secs(15))
        .unwrap_or_else(|| {
            panic!(
                "{key} was not promoted at A in 15 s: {:#?}",
                a.cm().unwrap()
            )
        });
    steps.step("the stream on CM");
    std::thread::sleep(Duration::from_secs(4));
    let later = a.peer(&key).unwrap().unwrap();
    let (cm, ud) = (
        later.traffic.tx_cm_bytes - at.traffic.tx_cm_bytes,
        later.traffic.tx_ud_bytes - at.traffic.tx_ud_bytes,
    );
    let sent = stream.finish();
    eprintln!(
        "IPv6: {} MiB sent; after promotion CM {} MiB, UD {} KiB",
        sent >> 20,
        cm >> 20,
        ud >> 10
    );
    assert!(cm > 1 << 20, "hardly anything went CM over IPv6: {later:?}");
    assert!(
        cm as f64 >= 0.9 * (cm + ud) as f64,
        "after promotion only {cm} of {} bytes went CM",
        cm + ud
    );
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// The partition (P_Key) of connected mode, looked up in the port's real P_Key table (read
/// here from sysfs, apart from the code under test). A partition the port is not in, or a
/// port the device lacks, is bad input: `attach` exits 2 before anything changed. A limited
/// member's P_Key of a partition the port is in (the low 15 bits match, as the kernel's
/// `ib_find_pkey` matches) finds its entry: the connection comes up and a stream arrives
/// intact over it. What this cannot show: soft-RoCE's table holds one entry (the default
/// partition), and it neither checks nor uses a QP's P_Key index (seen: with the index forced
/// one past its table, this test still passed). Which index is taken is proven by the unit
/// tests of `iblink::pkey_index` (the kernel's rule), the sysfs side of P_Key child
/// interfaces by `iblink`'s tests on fixture trees laid out as the kernel lays them out.
#[test]
fn connected_mode_is_set_up_in_the_interfaces_partition() {
    let test = "connected_mode_is_set_up_in_the_interfaces_partition";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyk", 2) else {
        return;
    };
    steps.step("the port's P_Key table, read from sysfs");
    let dir = format!("/sys/class/infiniband/{dev}/ports/1/pkeys");
    let table: Vec<u16> = (0..)
        .map_while(|i| std::fs::read_to_string(format!("{dir}/{i}")).ok())
        .map(|t| u16::from_str_radix(t.trim().trim_start_matches("0x"), 16).unwrap())
        .collect();
    eprintln!("{dev} port 1 P_Key table: {table:04x?}");
    let default = *table.first().expect("a P_Key table");
    assert_eq!(
        default & 0x7fff,
        0x7fff,
        "not the default partition at 0: {table:04x?}"
    );
    let absent = (1..0x7fffu16)
        .map(|k| k | 0x8000)
        .find(|k| table.iter().all(|t| t & 0x7fff != k & 0x7fff))
        .unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let cases = [
        vec!["--cm-pkey".to_string(), format!("{absent:#06x}")],
        vec!["--cm-port".to_string(), "2".to_string()],
    ];
    steps.step(
        "a partition the port is not in, and a port the device lacks: refused, nothing attached",
    );
    for extra in cases {
        let mut args = vec!["attach", &a.iface, "--cm-device", &dev];
        args.extend(extra.iter().map(String::as_str));
        let out = a.ctl(&args).unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        eprintln!("{extra:?}: exit {:?}: {}", out.status.code(), err.trim());
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        let st = a.ctl(&["status", &a.iface]).unwrap();
        assert_eq!(
            st.status.code(),
            Some(4),
            "{args:?} left {} attached: {}",
            a.iface,
            String::from_utf8_lossy(&st.stdout)
        );
    }
    steps.step("attached in the default partition as a limited member names it");
    // The default partition as a limited member would name it.
    let limited = format!("{:#06x}", default & 0x7fff);
    lab.attach(Which::A, &["--cm-device", &dev, "--cm-pkey", &limited])
        .unwrap();
    lab.attach(Which::B, &["--cm-device", &dev, "--cm-pkey", &limited])
        .unwrap();
    let b_ip = b.ip4.to_string();
    steps.step("a bulk stream promoted and carried over CM");
    let stream = Stream::start(&a, &b, 5380);
    a.wait_peer_mode(&b_ip, PeerModeView::CmUp, Duration::from_secs(20))
        .unwrap_or_else(|| panic!("not promoted: {:#?}\n{}", a.cm().unwrap(), ctl_log(&a)));
    std::thread::sleep(Duration::from_secs(2));
    let sent = stream.finish();
    let peer = a.peer(&b_ip).unwrap().unwrap();
    eprintln!(
        "partition {limited}: {} MiB sent, {} MiB of it over CM, intact",
        sent >> 20,
        peer.traffic.tx_cm_bytes >> 20
    );
    assert!(
        peer.traffic.tx_cm_bytes > 1 << 20,
        "hardly anything went CM: {peer:?}"
    );
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// Mode auto on a UD path that segments in the device (TSO on A's interface, as on Enhanced
/// IPoIB) leaves a bulk stream on UD and says why; once A's interface segments in software
/// (TSO turned off under the flow, as an operator would with ethtool) the next tick promotes
/// the stream's peer, and the stream arrives intact across the switch. On the star lab: a
/// veth end whose peer runs a native XDP program loses TSO ("off [fixed]"), so A's peer
/// must be a bridge port, not B's interface.
#[test]
fn a_ud_path_that_segments_in_the_device_keeps_bulk_traffic_on_ud() {
    let test = "a_ud_path_that_segments_in_the_device_keeps_bulk_traffic_on_ud";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyt", 3) else {
        return;
    };
    let (a, b) = (lab.a.clone(), lab.b.clone());
    steps.step("attached with TSO on A: its UD path offloaded, B's per-packet");
    a.set_tso(true).unwrap();
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    assert_eq!(cm_of(&a).ud_path, UdPath::Offloaded, "{:#?}", cm_of(&a));
    assert_eq!(cm_of(&b).ud_path, UdPath::PerPacket, "{:#?}", cm_of(&b));
    let b_ip = b.ip4.to_string();
    steps.step("a bulk stream stays on UD for 8 s, and A says why");
    let stream = Stream::start(&a, &b, 5335);
    // Promotion on a per-packet path takes 2-3 ticks of bulk traffic; give it 8.
    let before = wait_until(Duration::from_secs(10), || a.peer(&b_ip).unwrap().is_some());
    assert!(before, "A never saw B: {:#?}", a.status().unwrap());
    let first = a.peer(&b_ip).unwrap().unwrap();
    std::thread::sleep(Duration::from_secs(8));
    let held = a.peer(&b_ip).unwrap().unwrap();
    let why = cm_peer(&cm_of(&a), &b_ip).map(|p| p.why.clone());
    eprintln!(
        "TSO on: {} MiB on UD in 8 s, CM {} B; A says {why:?}",
        (held.traffic.tx_ud_bytes - first.traffic.tx_ud_bytes) >> 20,
        held.traffic.tx_cm_bytes
    );
    assert_eq!(held.mode, PeerModeView::Ud, "{held:?}\n{}", ctl_log(&a));
    assert_eq!(held.traffic.tx_cm_bytes, 0, "{held:?}");
    assert!(
        held.traffic.tx_ud_bytes > first.traffic.tx_ud_bytes + (8 << 20),
        "the stream hardly moved, so it proves nothing: {held:?}"
    );
    let why = why.expect("A's policy knows B");
    assert!(why.contains("segments in the device"), "{why}");
    assert!(
        ctl_log(&a).contains("the UD path is offloaded"),
        "{}",
        ctl_log(&a)
    );
    let human = a.ctl(&["status", &a.iface]).unwrap();
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("UD path: the device segments (TSO)"),
        "{human}"
    );

    steps.step("TSO off under the flow: B promoted");
    a.set_tso(false).unwrap();
    let t = Instant::now();
    let up = a
        .wait_peer_mode(&b_ip, PeerModeView::CmUp, Duration::from_secs(15))
        .unwrap_or_else(|| {
            panic!(
                "not promoted once TSO was off: {:#?}\n{}",
                cm_of(&a),
                ctl_log(&a)
            )
        });
    eprintln!("TSO off: B on CM after {:.1?}", t.elapsed());
    assert_eq!(cm_of(&a).ud_path, UdPath::PerPacket);
    assert!(
        ctl_log(&a).contains("the UD path is per-packet now"),
        "{}",
        ctl_log(&a)
    );
    steps.step("the stream goes on over CM, intact");
    std::thread::sleep(Duration::from_secs(3));
    let later = a.peer(&b_ip).unwrap().unwrap();
    assert!(
        later.traffic.tx_cm_bytes > up.traffic.tx_cm_bytes + (1 << 20),
        "on CM, yet the stream does not go CM: {later:?}"
    );
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// A peer that runs no ipoib-hybrid (a mixed cluster during a rolling upgrade): A's setups
/// to it are refused at the handshake port, the flow goes on over UD, and A's status says
/// what the peer is, not a QP error.
#[test]
fn a_peer_without_ipoib_hybrid_is_shown_as_such_and_stays_ud() {
    let test = "a_peer_without_ipoib_hybrid_is_shown_as_such_and_stays_ud";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hnr", 2) else {
        return;
    };
    steps.step("only A attached, mode=connected");
    let policy = PolicyFile::new("hnr", "mode=connected\n");
    attach(
        &mut lab,
        Which::A,
        Recv::Srq,
        &dev,
        &["--policy", policy.arg()],
    );
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    steps.step("A's setups to B refused: its status says B runs no ipoib-hybrid");
    let stream = Stream::start(&a, &b, 5390);
    let mut seen = None;
    let said = wait_until(Duration::from_secs(30), || {
        let p = cm_of(&a)
            .peers
            .into_iter()
            .find(|p| p.addr.to_string() == b_ip);
        let done = p.as_ref().is_some_and(|p| p.failures >= 1);
        seen = p;
        done
    });
    let p = seen.expect("A's policy knows B");
    eprintln!(
        "B at A: {} ({}), {} failure(s)",
        p.state.name(),
        p.why,
        p.failures
    );
    assert!(said, "no failed setup to B in 30 s: {p:?}");
    // The reason stays in view while a retry after the backoff runs, in the field and the words.
    let last = p
        .last_failure
        .as_ref()
        .expect("the last failure in the status");
    assert_eq!(last.reason, Failure::NotRunning, "{p:?}");
    for said in [&p.why, &last.said] {
        assert!(
            said.contains("runs no ipoib-hybrid"),
            "B's setup failure shown as: {said} ({p:?})"
        );
    }
    steps.step("the stream goes on over UD, intact");
    // UD, or cm_pending while a retry after the backoff runs (its packets go UD meanwhile).
    let view = a.peer(&b_ip).unwrap().expect("A knows B");
    assert_ne!(view.mode, PeerModeView::CmUp, "{view:?}");
    goes_on_over_ud(&a, &b_ip, &view);
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact over UD", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// Connected mode with only the shipped unit's capabilities and memlock limit, on 6.1 with
/// real verbs: both nodes attach confined (the wrapper applies the unit's
/// `CapabilityBoundingSet=`, `NoNewPrivileges=` and `LimitMEMLOCK=`), register their receive
/// memory, and a bulk stream is promoted and carried over RC.
#[test]
fn connected_mode_runs_with_only_the_units_capabilities() {
    use ipoib_tests::sandbox::{unit_capabilities, wrapper};
    let test = "connected_mode_runs_with_only_the_units_capabilities";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyc", 2) else {
        return;
    };
    steps.step("both attached with only the unit's capabilities and memlock limit");
    let dir = std::env::temp_dir().join(format!("ipoib-{test}-{}", std::process::id()));
    let confined = wrapper(&dir.join("ipoib-ctl"), &unit_capabilities());
    ipoib_tests::sandbox::bpffs_mounted();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    for n in [&a, &b] {
        lab.attach_node_as(n, &confined, &["--cm-device", &dev], &[])
            .unwrap();
    }
    let key = b.ip4.to_string();
    steps.step("a bulk stream promoted and carried over RC");
    let stream = Stream::start(&a, &b, 5307);
    let at = a
        .wait_peer_mode(&key, PeerModeView::CmUp, Duration::from_secs(15))
        .unwrap_or_else(|| panic!("{key} was not promoted in 15 s: {:#?}", a.cm().unwrap()));
    std::thread::sleep(Duration::from_secs(3));
    let later = a.peer(&key).unwrap().unwrap();
    let cm = later.traffic.tx_cm_bytes - at.traffic.tx_cm_bytes;
    let sent = stream.finish();
    let registered = cm_of(&b).receive.registered_bytes;
    eprintln!(
        "confined: {} MiB sent, {} MiB over CM after promotion, B registered {} MiB",
        sent >> 20,
        cm >> 20,
        registered >> 20
    );
    assert!(cm > 1 << 20, "hardly anything went CM: {later:?}");
    assert!(registered > 0, "B registered no receive memory");
    // Each engine holds its raw sockets to UD (CAP_NET_RAW): IPPROTO_RAW (255) on IPv4 and
    // IPv6, listed in the node's namespace.
    for n in [&a, &b] {
        let ns = n.ns.clone();
        let raw = ipoib_tests::cmlab::in_netns(&ns, || {
            ["raw", "raw6"].map(|f| {
                std::fs::read_to_string(format!("/proc/thread-self/net/{f}")).unwrap_or_default()
            })
        });
        for (family, table) in ["IPv4", "IPv6"].iter().zip(raw) {
            let held = table.lines().skip(1).any(|l| {
                l.split_whitespace()
                    .nth(1)
                    .is_some_and(|a| a.ends_with(":00FF"))
            });
            assert!(held, "{ns}: no {family} raw socket to UD:\n{table}");
        }
    }
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
    let _ = std::fs::remove_dir_all(&dir);
}
