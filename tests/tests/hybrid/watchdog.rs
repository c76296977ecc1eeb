//! The node's own engine wedged (panicked, stalled, hung; on one lane or two) or its handshake
//! listener dead: UD within the heartbeat's deadline, the watchdog fed while connected mode
//! starts again.

use super::*;

/// A's own engine wedged under the flow (`attach --test-faults`: the engine's task panics,
/// stalls in an await, or blocks the runtime's thread): within the heartbeat deadline the
/// flow goes UD, and goes on intact. What catches each: a task that ended stops connected
/// mode at once (peers UD in the map); a loop that stopped turning withholds the heartbeat
/// (the fail-safe then sends every packet UD, and an engine that turns again gets it back); a
/// blocked thread stops the heartbeat itself. Connected mode stopped by the panic starts
/// again after its backoff, and the flow returns to CM.
fn a_wedged_engine_goes_ud(fault: &str, tag: &str, port: u16, lanes: u32) {
    let test = format!("a_wedged_engine_goes_ud_{fault}_{lanes}");
    let mut steps = Steps::new(&test);
    let Some((dev, baseline, mut lab)) = rdma_lab(&test, tag, 2) else {
        return;
    };
    steps.step("both attached (A with a notify socket and test faults), a stream on CM, A's engine threads");
    // A tells a notify socket what it would tell systemd.
    let sock = ipoib_tests::notify::NotifySocket::bind(tag).unwrap();
    let period = Duration::from_secs(2);
    let (sock_path, usec) = (
        sock.path().to_str().unwrap().to_owned(),
        period.as_micros().to_string(),
    );
    let node_a = lab.a.clone();
    let lanes_arg = lanes.to_string();
    let lanes_args = ["--cm-lanes", lanes_arg.as_str()];
    let pid_a = lab
        .attach_node_env(
            &node_a,
            &[&["--cm-device", &dev, "--test-faults"][..], &lanes_args].concat(),
            &[("NOTIFY_SOCKET", &sock_path), ("WATCHDOG_USEC", &usec)],
        )
        .unwrap();
    lab.attach(
        Which::B,
        &[&["--cm-device", &dev][..], &lanes_args].concat(),
    )
    .unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, port);
    cm_up_within(&a, &b, PROMOTION, "promoted");
    for n in [&a, &b] {
        let cm = cm_of(n);
        assert_eq!(cm.engine_lanes, lanes, "{}: {cm:#?}", n.ns);
    }
    // One lane runs on the control loop's thread; more, each on a thread of its own.
    let engine_threads = std::fs::read_dir(format!("/proc/{pid_a}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.starts_with("engine-"))
        .count();
    let want = if lanes > 1 { lanes as usize } else { 0 };
    assert_eq!(
        engine_threads, want,
        "A's engine threads with {lanes} lane(s)"
    );
    steps.step("A's engine wedged: the flow UD within the heartbeat deadline, and on");
    let deadline = Duration::from_nanos(ipoib_common::DEFAULT_HEARTBEAT_TIMEOUT_NS);
    if fault == "panic" {
        // The restart takes 2 s more, awaited after the HCA's setup (as its netlink work
        // is): the loop must beat on meanwhile.
        let delay = format!("/run/ipoib-ctl/{}.start-delay", a.iface);
        std::fs::write(delay, START_DELAY.as_millis().to_string()).unwrap();
    }
    std::fs::write(format!("/run/ipoib-ctl/{}.fault", a.iface), fault).unwrap();
    let t = Instant::now();
    // UD for B's big packets: the map says so, or the fail-safe does.
    let on_ud = |s: &Status| {
        s.failsafe_active
            || s.peers
                .iter()
                .any(|p| p.addr == b_ip && p.mode == PeerModeView::Ud)
    };
    let mut seen = None;
    let fell = wait_until(Duration::from_secs(20), || {
        let s = a.status().unwrap();
        let done = on_ud(&s);
        seen = Some(s);
        done
    });
    let took = t.elapsed();
    let seen = seen.expect("a status");
    assert!(
        fell,
        "A still sends B's packets CM 20 s after its engine {fault}: {seen:#?}"
    );
    eprintln!(
        "engine {fault}: B's packets UD at A after {took:.1?} (fail-safe {}, connected mode {})",
        seen.failsafe_active,
        if seen.cm.is_none() {
            "stopped"
        } else {
            "still reported"
        }
    );
    // The fault is taken once a tick reads it (1 s), then the heartbeat deadline, and a
    // margin for software emulation.
    assert!(
        took < deadline + Duration::from_secs(5),
        "UD only after {took:.1?} (deadline {deadline:?})"
    );
    let fell = a.peer(&b_ip).unwrap().expect("A knows B");
    goes_on_over_ud(&a, &b_ip, &fell);
    if fault == "panic" {
        steps.step("after the panic: connected mode up again, the flow back on CM");
        // The restart comes 5 s after the stop, then the policy promotes B again.
        returns_to_cm(&a, &b, Duration::from_secs(40), "connected mode's restart");
        let log = ctl_log(&a);
        for line in log
            .lines()
            .filter(|l| l.contains("started in") || l.contains("set up in"))
        {
            eprintln!("A: {line}");
        }

        assert!(
            log.contains("connected mode on") && log.contains("runs again"),
            "A's log does not tell of the restart:\n{log}"
        );
    }
    steps.step("the stream intact; systemd's watchdog followed the engine");
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact", sent >> 20);
    watchdog_follows_the_engine(&sock, fault, t, period, last_setup(&ctl_log(&a)));
    let _ = std::fs::remove_file(format!("/run/ipoib-ctl/{}.start-delay", a.iface));
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// B's handshake listener dies under a flow from A (`attach --test-faults`, `listener`):
/// no peer could set a connection up to B any more, so B's connected mode stops on it (the
/// flow goes UD) and starts again after its backoff with a new listener; A connects again
/// and the flow returns to CM.
#[test]
fn a_node_whose_handshake_listener_dies_starts_connected_mode_again() {
    let test = "a_node_whose_handshake_listener_dies_starts_connected_mode_again";
    let mut steps = Steps::new(test);
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hld", 2) else {
        return;
    };
    steps.step("both attached (B with test faults), a stream on CM");
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    lab.attach(Which::B, &["--cm-device", &dev, "--test-faults"])
        .unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let stream = Stream::start(&a, &b, 5334);
    cm_up_within(&a, &b, PROMOTION, "promoted");
    steps.step("B's listener dies: B's connected mode stops on it");
    std::fs::write(format!("/run/ipoib-ctl/{}.fault", b.iface), "listener").unwrap();
    let stopped = wait_until(Duration::from_secs(10), || {
        ctl_log(&b).contains("the handshake listener stopped")
    });
    assert!(
        stopped,
        "B's connected mode did not stop on its listener's end:\n{}",
        ctl_log(&b)
    );
    steps.step("B's connected mode again: the flow back on CM, intact");
    returns_to_cm(&a, &b, Duration::from_secs(40), "B's restart");
    assert!(ctl_log(&b).contains("runs again"), "{}", ctl_log(&b));
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// systemd's watchdog (WATCHDOG=1 with the heartbeat) came while the engine turned, and
/// stopped once a stalled or hung engine withheld the heartbeat (systemd would restart the
/// unit); a panicked engine took connected mode down, the loop went on UD, said so, and
/// said when connected mode was up again, beating all along.
fn watchdog_follows_the_engine(
    sock: &ipoib_tests::notify::NotifySocket,
    fault: &str,
    faulted: Instant,
    period: Duration,
    setup: Duration,
) {
    let msgs = sock.messages();
    let ready = msgs.iter().find(|m| m.has("READY=1")).expect("READY=1");
    let before = sock.longest_gap("WATCHDOG=1", ready.at, faulted);
    let now = Instant::now();
    let last_ping = msgs
        .iter()
        .rev()
        .find(|m| m.has("WATCHDOG=1"))
        .map(|m| m.at);
    let statuses: Vec<&str> = msgs.iter().filter_map(|m| m.get("STATUS")).collect();
    // When each STATUS came, from the fault on (negative: before it), for a late ping's cause.
    let timeline: Vec<String> = msgs
        .iter()
        .filter_map(|m| Some((m.get("STATUS")?, m.at)))
        .map(|(s, at)| match at.checked_duration_since(faulted) {
            Some(d) => format!("+{d:.2?} {s}"),
            None => format!("-{:.2?} {s}", faulted - at),
        })
        .collect();
    let (after, gap_from) = sock.longest_gap_from("WATCHDOG=1", faulted, now);
    eprintln!(
        "watchdog: longest gap {before:?} before the fault, {after:?} after it (from \
         +{:.2?}); last WATCHDOG=1 {:?} before now; STATUS lines {timeline:#?}",
        gap_from - faulted,
        last_ping.map(|t| now - t)
    );
    assert!(
        before < period,
        "WATCHDOG=1 late while the engine turned: {before:?}"
    );
    match fault {
        "stall" | "hang" => {
            let quiet = now - last_ping.unwrap_or(faulted);
            assert!(
                quiet > 3 * period,
                "WATCHDOG=1 {quiet:?} ago though the engine {fault}s"
            );
        }
        _ => {
            // Through the stop, the UD-only time and the restart of connected mode, the
            // watchdog is fed about as regularly as before the fault: the loop beats at once
            // after the stop, and just before and after the restart that holds its thread
            // (without those beats: 1.49 s against 0.77 s before the fault, unloaded).
            // The HCA's setup holds the loop's thread by design (beaten just before and just
            // after): on a slow machine it alone took 1.7 s, so the gap may hold it too.
            assert!(
                after < period && after < before + period / 4 + setup,
                "the loop stopped its watchdog after the panic: {after:?} from +{:.2?} \
                 ({before:?} at most before the fault)",
                gap_from - faulted
            );
            assert!(
                statuses.iter().any(|s| s.contains("every peer on UD")),
                "{statuses:?}"
            );
            assert!(
                statuses
                    .iter()
                    .any(|s| s.contains("connected mode up again")),
                "{statuses:?}"
            );
            restart_beside_the_loop(sock, faulted, before, period, setup);
        }
    }
}

/// How long the last start's HCA setup took, as the log says it ("set up in 1.7s"); zero when
/// it does not say.
fn last_setup(log: &str) -> Duration {
    let Some(said) = log.lines().rev().find_map(|l| {
        let rest = &l[l.find(" set up in ")? + " set up in ".len()..];
        rest.split(':').next()
    }) else {
        return Duration::ZERO;
    };
    let (n, unit) = said.split_at(said.find(|c: char| c.is_alphabetic()).unwrap_or(said.len()));
    let n: f64 = n.parse().unwrap_or(0.0);
    Duration::from_secs_f64(match unit {
        "s" => n,
        "ms" => n / 1e3,
        "µs" | "us" => n / 1e6,
        _ => 0.0,
    })
}

#[test]
fn the_setup_time_is_read_from_the_log() {
    let log = "x INFO a: rxe0: Srq { depth: 512 } and 256 send slots set up in 762.5ms: one SRQ\n\
               x INFO a: rxe0: Srq { depth: 512 } and 256 send slots set up in 1.7s: one SRQ\n";
    assert_eq!(last_setup(log), Duration::from_secs_f64(1.7));
    assert_eq!(
        last_setup(&log[..log.find('\n').unwrap()]),
        Duration::from_secs_f64(0.7625)
    );
    assert_eq!(last_setup("nothing"), Duration::ZERO);
}

/// What `--test-faults` adds to a restart in the panic tests, awaited after the HCA's setup.
const START_DELAY: Duration = Duration::from_secs(2);

/// The restart of connected mode ran beside the loop: from "starting again" to "up again"
/// (at least [`START_DELAY`]) the watchdog was fed as at any other time, but for the HCA's
/// setup (0.2-0.4 s in the VM), which comes just after a beat. A start that held the loop's
/// thread throughout (as it did, 0.35-1.1 s in the VM without the delay) leaves a gap of the
/// whole start.
fn restart_beside_the_loop(
    sock: &ipoib_tests::notify::NotifySocket,
    faulted: Instant,
    before: Duration,
    period: Duration,
    setup: Duration,
) {
    let msgs = sock.messages();
    let status_at = |what: &str| {
        msgs.iter()
            .find(|m| m.at > faulted && m.get("STATUS").is_some_and(|s| s.contains(what)))
            .map(|m| m.at)
            .unwrap_or_else(|| panic!("no STATUS of {what:?} after the fault"))
    };
    let (began, up) = (
        status_at("connected mode starting again"),
        status_at("connected mode up again"),
    );
    let pings: Vec<Instant> = msgs
        .iter()
        .filter(|m| m.has("WATCHDOG=1"))
        .map(|m| m.at)
        .collect();
    // From the last ping before the start to the first one once it is up.
    let from = pings
        .iter()
        .rev()
        .find(|&&t| t <= began)
        .copied()
        .expect("a ping before");
    let to = pings
        .iter()
        .find(|&&t| t >= up)
        .copied()
        .expect("a ping after");
    let gap = sock.longest_gap("WATCHDOG=1", from, to);
    let during = pings.iter().filter(|&&t| t > began && t < up).count();
    // The loop beats a third of the period apart; `before` is how late it ran under load; the
    // margin is the one the watchdog is held to through the whole fault; and the HCA's setup
    // holds the thread by design (1.4 s alone in a slow run). Never the whole start.
    let most = (before.max(period / 3) + period / 4 + setup).min(up - began);
    assert!(
        up - began >= START_DELAY,
        "the start took {:.2?}, less than the delay it was given",
        up - began
    );
    eprintln!(
        "restart: {:.2?} from starting to up, {during} WATCHDOG=1 meanwhile, longest gap \
         {gap:.2?} (at most {most:.2?})",
        up - began
    );
    assert!(
        gap < most,
        "the restart held the loop: a gap of {gap:.2?} in the watchdog around a start of \
         {:.2?} ({during} pings during it)",
        up - began
    );
}

/// The panic on one lane; the suite runs it on two
/// ([`a_panicked_lane_sends_the_flow_ud_and_connected_mode_restarts`]: the same handling, and
/// the restart after it).
#[test]
#[ignore = "long: cargo xtask vm-test --long (the suite panics two lanes instead)"]
fn a_panicked_engine_sends_the_flow_ud() {
    a_wedged_engine_goes_ud("panic", "hwp", 5330, 1);
}

#[test]
fn a_stalled_engine_sends_the_flow_ud() {
    a_wedged_engine_goes_ud("stall", "hws", 5331, 1);
}

#[test]
fn a_hung_engine_sends_the_flow_ud() {
    a_wedged_engine_goes_ud("hang", "hwh", 5332, 1);
}

/// Both nodes on two engine lanes (`--cm-lanes 2`: a two-queue TUN device, an engine thread
/// per queue): the flow is promoted and crosses intact; A's lanes panic, connected mode stops
/// (the flow UD) and starts again, and the flow returns to CM.
#[test]
fn a_panicked_lane_sends_the_flow_ud_and_connected_mode_restarts() {
    a_wedged_engine_goes_ud("panic", "hwl", 5333, 2);
}

/// A's lanes block their threads (not the control loop's, as one engine does): the loop sees
/// them silent and withholds the heartbeat, so the flow goes UD.
#[test]
fn a_hung_lane_sends_the_flow_ud() {
    a_wedged_engine_goes_ud("hang", "hwm", 5334, 2);
}
