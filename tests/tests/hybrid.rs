//! The whole hybrid on soft-RoCE in the VM: lab nodes, each with `ipoib-ctl attach
//! --cm-device rxe0` (fast path + connected mode). A bulk TCP flow starts on UD, the policy
//! promotes the peer, the fast path redirects the flow's big packets to the TUN device and
//! the engine carries them over RC; the stream arrives intact across the switch; pings and
//! small UDP stay on UD; and detaching releases every QP and the TUN devices. Then the faults
//! (the peer killed, the RC path failing, the handshake port blocked, the receiver stalled),
//! each survived on UD and followed by a return to CM, and the memory test (a plan of K
//! connections among 3K peers that want CM, on a four-node lab).
//!
//! The lab's link is a veth pair or a bridge (Ethernet); the one rxe device serves every
//! node. On the host (no RDMA) the tests skip loudly; `cargo xtask vm-test` runs them with
//! IPOIB_REQUIRE_RDMA=1.

use std::{
    collections::HashMap,
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use ipoib_ctl::{
    promotion::Failure,
    status::{
        PeerView, Status,
        cm::{CmStatus, PeerStatus, read_status},
    },
};
use ipoib_tests::{
    cmlab::{COUNTED, LinkUp, device, in_netns, rdma_netdev, rdma_resources, set_link, settle},
    lab::{Lab, Node, Which, lab_unavailable},
    long_run,
};

/// `n`'s connected mode, which must run.
fn cm_of(n: &Node) -> CmStatus {
    n.cm()
        .unwrap()
        .unwrap_or_else(|| panic!("{} runs no connected mode", n.ns))
}

/// An engine counter of a CM status (0 when absent).
fn engine_count(cm: &CmStatus, k: &str) -> u64 {
    cm.engine.get(k).copied().unwrap_or(0)
}

/// The flows `n`'s engine tracks, as its status file last said (None: unreadable).
fn engine_flows(n: &Node) -> Option<u64> {
    read_status(&n.iface).and_then(|s| s.engine.get("flows").copied())
}

/// The policy's view of the peer at `ip` in a CM status.
fn cm_peer<'a>(cm: &'a CmStatus, ip: &str) -> Option<&'a PeerStatus> {
    cm.peers.iter().find(|p| p.addr.to_string() == ip)
}

/// What `n`'s `ipoib-ctl attach` logged, for a failure message.
fn ctl_log(n: &Node) -> String {
    std::fs::read_to_string(n.log_path()).unwrap_or_default()
}

/// Packets the fast path counted for one decision reason.
fn reason(s: &Status, k: &str) -> u64 {
    s.reasons.get(k).map_or(0, |c| c.packets)
}

/// The stream repeats this pattern; its length is prime (65521), so a lost, duplicated or
/// reordered TCP segment (a few KiB, never a multiple of it) shows at the receiver.
fn period() -> Vec<u8> {
    ipoib_tests::cmlab::pattern(11, 65521)
}

/// A TCP stream from node `a` to node `b`, every byte checked at `b`, until `finish`.
struct Stream {
    stop: Arc<AtomicBool>,
    /// Bytes checked at the receiver so far.
    received: Arc<AtomicU64>,
    sender: std::thread::JoinHandle<u64>,
    receiver: std::thread::JoinHandle<u64>,
}

impl Stream {
    fn start(a: &Node, b: &Node, port: u16) -> Self {
        Self::start_to(a, b, std::net::SocketAddr::new(b.ip4.into(), port))
    }

    /// A stream from `a` to `addr`, one of `b`'s addresses.
    fn start_to(a: &Node, b: &Node, addr: std::net::SocketAddr) -> Self {
        let listener = in_netns(&b.ns, move || TcpListener::bind(addr).expect("listen at B"));
        let received = Arc::new(AtomicU64::new(0));
        let progress = received.clone();
        let receiver = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let p = period();
            let mut buf = vec![0u8; 1 << 16];
            let mut off = 0u64;
            loop {
                let n = s.read(&mut buf).expect("read the stream");
                if n == 0 {
                    return off;
                }
                let mut got = &buf[..n];
                while !got.is_empty() {
                    let at = (off % p.len() as u64) as usize;
                    let k = got.len().min(p.len() - at);
                    assert!(
                        got[..k] == p[at..at + k],
                        "the stream differs near byte {off}"
                    );
                    got = &got[k..];
                    off += k as u64;
                }
                progress.store(off, Ordering::Relaxed);
            }
        });
        let stop = Arc::new(AtomicBool::new(false));
        let sender = std::thread::spawn({
            let (ns, stop) = (a.ns.clone(), stop.clone());
            move || {
                in_netns(&ns, move || {
                    let mut s = TcpStream::connect(addr).expect("connect to B");
                    // A stream that stops moving fails the test rather than hanging it.
                    s.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
                    let p = period();
                    let mut off = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let at = (off % p.len() as u64) as usize;
                        s.write_all(&p[at..]).expect("send the stream");
                        off += (p.len() - at) as u64;
                    }
                    off
                })
            }
        });
        Self {
            stop,
            received,
            sender,
            receiver,
        }
    }

    /// Bytes that have arrived, checked, so far.
    fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Stops sending; returns the bytes sent, once the receiver got them all, intact.
    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let sent = self.sender.join().expect("sender");
        let received = self.receiver.join().expect("receiver (a byte differed?)");
        assert_eq!(received, sent, "the stream arrived whole");
        sent
    }
}

/// `count` small UDP datagrams (100 B, numbered, 2 ms apart) from `a` to `b`, counted at `b`.
struct SmallUdp {
    sender: std::thread::JoinHandle<u64>,
    receiver: std::thread::JoinHandle<u64>,
}

impl SmallUdp {
    fn start(a: &Node, b: &Node, port: u16, count: u32) -> Self {
        let addr = format!("{}:{port}", b.ip4);
        let sock = in_netns(&b.ns, {
            let addr = addr.clone();
            move || std::net::UdpSocket::bind(addr).expect("UDP at B")
        });
        sock.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let receiver = std::thread::spawn(move || {
            let mut seen = vec![false; count as usize];
            let mut buf = [0u8; 2048];
            while let Ok(n) = sock.recv(&mut buf) {
                assert_eq!(n, 100, "a datagram changed size");
                let i = u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize;
                seen[i] = true;
                if seen.iter().all(|s| *s) {
                    break;
                }
            }
            seen.iter().filter(|s| **s).count() as u64
        });
        let sender = std::thread::spawn({
            let ns = a.ns.clone();
            move || {
                in_netns(&ns, move || {
                    let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                    for i in 0..count {
                        let mut d = [0u8; 100];
                        d[..4].copy_from_slice(&i.to_be_bytes());
                        s.send_to(&d, &addr).expect("send a datagram");
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    u64::from(count)
                })
            }
        });
        Self { sender, receiver }
    }

    /// (sent, received).
    fn finish(self) -> (u64, u64) {
        let sent = self.sender.join().expect("UDP sender");
        (sent, self.receiver.join().expect("UDP receiver"))
    }
}

/// When [`PacedUdp`]'s datagrams are due: datagram 0 at `t0`, datagram i i periods later.
#[derive(Debug, Clone, Copy)]
struct Pace {
    t0: Instant,
    period: Duration,
}

impl Pace {
    fn due(&self, i: u32) -> Instant {
        self.t0 + self.period * i
    }
}

/// Numbered UDP datagrams of 1200 bytes (over `cm_min_bytes`: they go CM when the peer is up)
/// from `a` to `b`, one a millisecond (or a `period`), until `finish`; the receiver notes when
/// each arrived.
struct PacedUdp {
    pace: Pace,
    stop: Arc<AtomicBool>,
    sender: std::thread::JoinHandle<u32>,
    receiver: std::thread::JoinHandle<Vec<(u32, Instant)>>,
}

impl PacedUdp {
    const LEN: usize = 1200;

    fn start(a: &Node, b: &Node, port: u16) -> Self {
        Self::every(a, b, port, Duration::from_millis(1))
    }

    fn every(a: &Node, b: &Node, port: u16, period: Duration) -> Self {
        let addr = format!("{}:{port}", b.ip4);
        let sock = in_netns(&b.ns, {
            let addr = addr.clone();
            move || std::net::UdpSocket::bind(addr).expect("UDP at B")
        });
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let pace = Pace {
            t0: Instant::now(),
            period,
        };
        let receiver = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 2048];
            // Ends 5 s after the last datagram.
            while let Ok(n) = sock.recv(&mut buf) {
                assert_eq!(n, Self::LEN, "a datagram changed size");
                got.push((
                    u32::from_be_bytes(buf[..4].try_into().unwrap()),
                    Instant::now(),
                ));
            }
            got
        });
        let sender = std::thread::spawn({
            let (ns, stop) = (a.ns.clone(), stop.clone());
            move || {
                in_netns(&ns, move || {
                    let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                    let mut i = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        let mut d = [0u8; Self::LEN];
                        d[..4].copy_from_slice(&i.to_be_bytes());
                        // A full socket buffer would block: the rate is the sender's own.
                        s.send_to(&d, &addr).expect("send a datagram");
                        i += 1;
                        let due = pace.due(i);
                        std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    }
                    i
                })
            }
        });
        Self {
            pace,
            stop,
            sender,
            receiver,
        }
    }

    /// Stops; (sent, each datagram received once with when it came).
    fn finish(self) -> (u32, Vec<(u32, Instant)>) {
        self.stop.store(true, Ordering::Relaxed);
        let sent = self.sender.join().expect("UDP sender");
        let got = self.receiver.join().expect("UDP receiver");
        (sent, got)
    }
}

/// The longest time within `[from, to]` with no arrival, of arrivals `at` (sorted).
fn longest_gap(at: &[Instant], from: Instant, to: Instant) -> Duration {
    let inside = at.iter().copied().filter(|t| *t >= from && *t <= to);
    let mut last = from;
    let mut gap = Duration::ZERO;
    for t in inside.chain([to]) {
        gap = gap.max(t - last);
        last = t;
    }
    gap
}

/// Samples of a growing byte count (when, total), taken every 100 ms while `during` runs.
fn sample_while(count: impl Fn() -> u64 + Sync, during: impl FnOnce()) -> Vec<(Instant, u64)> {
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            let mut v = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                v.push((Instant::now(), count()));
                std::thread::sleep(Duration::from_millis(100));
            }
            v.push((Instant::now(), count()));
            v
        });
        during();
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    })
}

/// The half-second windows of `samples` in which the count did not grow: (start, end) offsets
/// from the first sample.
fn idle_half_seconds(samples: &[(Instant, u64)]) -> Vec<(Duration, Duration)> {
    let Some(&(t0, _)) = samples.first() else {
        return Vec::new();
    };
    let mut idle = Vec::new();
    let mut i = 0;
    for j in 0..samples.len() {
        // The earliest sample at least 0.5 s before sample j.
        while samples[j].0 - samples[i].0 > Duration::from_millis(500) {
            i += 1;
        }
        if i > 0 && samples[j].1 == samples[i - 1].1 {
            idle.push((samples[i - 1].0 - t0, samples[j].0 - t0));
        }
    }
    idle
}

/// Polls `done` every 100 ms until it holds or `within` has passed; whether it held.
fn wait_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    loop {
        if done() {
            return true;
        }
        if t.elapsed() >= within {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// After a fault sent `peer` to UD at A (`fell`: A's entry then), the flow goes on over UD:
/// more than 1 MiB, looked at after 3 s and then until 15 s. Not sooner than 3 s (the tests
/// go on to their next step no earlier than they always did), and up to 15: what the fault
/// swallowed leaves TCP in its retransmission backoff, whose next try can come seconds after
/// the fallback (seen in CI: B stalled 4.8 s before A fell back, and nothing at all crossed
/// in the next 3 s, neither way).
fn goes_on_over_ud(a: &Node, peer: &str, fell: &PeerView) {
    std::thread::sleep(Duration::from_secs(3));
    let t = Instant::now();
    let on_ud = || a.peer(peer).unwrap().unwrap();
    let moved = wait_until(Duration::from_secs(12), || {
        on_ud().traffic.tx_ud_bytes > fell.traffic.tx_ud_bytes + (1 << 20)
    });
    assert!(moved, "the flow did not go on over UD: {:?}", on_ud());
    if t.elapsed() > Duration::from_millis(200) {
        eprintln!(
            "the flow went on over UD {:.1?} after the first 3 s",
            t.elapsed()
        );
    }
}

/// The fault gone (`what`), `b` is back on CM at A within `within` and the flow goes CM
/// again: more than 1 MiB within 15 s (TCP may still be in its retransmission backoff after
/// the fault). Both nodes' logs are printed if not.
fn returns_to_cm(a: &Node, b: &Node, within: Duration, what: &str) {
    let peer = &b.ip4.to_string();
    let t = Instant::now();
    let back = a.wait_peer_mode(peer, "cm_up", within).unwrap_or_else(|| {
        panic!(
            "not back on CM within {within:?} of {what}: {:#?}\nB: {:#?}\nA's log:\n{}\nB's log:\n{}",
            a.cm().unwrap(),
            b.cm().ok().flatten().map(|c| (c.connections, c.peers)),
            ctl_log(a),
            ctl_log(b)
        )
    });
    eprintln!("{what}: back on CM after {:.1?}", t.elapsed());
    let goes_cm = || a.peer(peer).unwrap().unwrap();
    wait_until(Duration::from_secs(15), || {
        goes_cm().traffic.tx_cm_bytes > back.traffic.tx_cm_bytes + (1 << 20)
    });
    let later = goes_cm();
    assert!(
        later.traffic.tx_cm_bytes > back.traffic.tx_cm_bytes + (1 << 20),
        "back on CM, yet the flow does not go CM: {later:?}\nA: {:#?}\nB: {:#?}\nA's log:\n{}\nB's log:\n{}",
        a.cm()
            .ok()
            .flatten()
            .map(|c| (c.connections, c.engine, c.peers)),
        b.cm().ok().flatten().map(|c| (c.connections, c.peers)),
        ctl_log(a),
        ctl_log(b)
    );
}

/// The rxe device, the device's resource counts before the test, and a fresh lab named
/// `tag`; None after a loud skip where the kernel has no RDMA.
fn rdma_lab(test: &str, tag: &str, nodes: usize) -> Option<(String, HashMap<String, u64>, Lab)> {
    let dev = device(test)?;
    if let Some(why) = lab_unavailable() {
        panic!("{test}: RDMA is here but the lab cannot run: {why}");
    }
    let baseline = rdma_resources(&dev);
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let avail = mem.lines().find(|l| l.starts_with("MemAvailable:"));
    eprintln!("{test}: {}", avail.unwrap_or("no MemAvailable"));
    let lab = if nodes == 2 {
        Lab::new(tag, false)
    } else {
        Lab::star(tag, nodes)
    };
    Some((dev, baseline, lab.unwrap()))
}

/// The receive model a scenario runs on. The streams and the faults run on both: the SRQ
/// that soft-RoCE offers (what `--srq auto` picks there), and a ring per connection
/// (`--srq off`: the model of an HCA without an SRQ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recv {
    Srq,
    Rings,
}

impl Recv {
    /// As the CM status names it.
    fn name(self) -> &'static str {
        match self {
            Recv::Srq => "srq",
            Recv::Rings => "rings",
        }
    }

    /// The lab's name for a scenario on this model (each its own namespaces).
    fn tag(self, base: &str) -> String {
        match self {
            Recv::Srq => base.to_string(),
            Recv::Rings => format!("{base}r"),
        }
    }
}

/// Each scenario as two tests, `NAME::srq` and `NAME::rings`: the first model given runs in
/// the suite, the second only under `cargo xtask vm-test --long` (ignored otherwise). The SRQ
/// is what every other test attaches with, so a scenario runs on rings where it observes what
/// rings alone do (a ring registered, refused at K, freed, run dry).
macro_rules! on_receive_models {
    ($first:ident: $First:ident, then $then:ident: $Then:ident; $($scenario:ident),+ $(,)?) => {$(
        mod $scenario {
            #[test]
            fn $first() {
                super::$scenario(super::Recv::$First)
            }
            #[test]
            #[ignore = "the scenario on its second receive model: cargo xtask vm-test --long"]
            fn $then() {
                super::$scenario(super::Recv::$Then)
            }
        }
    )+};
}

on_receive_models!(
    rings: Rings, then srq: Srq;
    // A reaped connection's ring freed, on both sides.
    bulk_tcp_is_promoted_to_cm_and_small_traffic_stays_on_ud,
    // A ring registered for each setup that fails, and freed.
    a_blocked_handshake_port_keeps_the_peer_on_ud_until_it_opens,
    // K rings within the budget, REQs past K refused, the budget lowered live.
    a_plan_of_k_connections_holds_among_3k_peers_that_want_cm,
    // Completions of a torn-down connection's ring, taken after the receiver resumes.
    a_stalled_receiver_falls_back_to_ud_and_returns_to_cm,
    // A ring run dry under a burst: the sender waits (RNR), the connection lives.
    a_receiver_whose_engine_pauses_under_a_burst_keeps_the_stream_intact,
    // A shed connection's ring freed (the two-lane test sheds on an SRQ).
    a_shed_connection_drops_nothing_its_engine_held,
);

on_receive_models!(
    srq: Srq, then rings: Rings;
    a_killed_peer_falls_back_to_ud_and_returns_to_cm,
    a_failed_rc_path_falls_back_to_ud_and_returns_to_cm,
    an_overflowing_connection_queue_sends_the_peer_ud_until_it_drains,
);

/// `ipoib-ctl attach --cm-device DEV` on lab node `which`, on receive model `recv`, with
/// `extra` arguments; checks that connected mode runs on that model. Its pid.
fn attach(lab: &mut Lab, which: Which, recv: Recv, dev: &str, extra: &[&str]) -> u32 {
    let n = lab.node(which).clone();
    attach_node(lab, &n, recv, dev, extra)
}

/// [`attach`] on any node of the lab.
fn attach_node(lab: &mut Lab, n: &Node, recv: Recv, dev: &str, extra: &[&str]) -> u32 {
    let mut args = vec!["--cm-device", dev];
    if recv == Recv::Rings {
        args.extend(["--srq", "off"]);
    }
    args.extend_from_slice(extra);
    let pid = lab
        .attach_node(n, &args)
        .unwrap_or_else(|e| panic!("{}: attach {args:?}: {e:#}", n.ns));
    let cm = cm_of(n);
    assert_eq!(cm.receive.model, recv.name(), "{}: {cm:#?}", n.ns);
    pid
}

/// `rdma resource show mr -j` for the process `pid`: its memory regions' (count, bytes).
fn mrs_of(pid: u32) -> (u64, u64) {
    let out = ipoib_tests::programs::sh(&["rdma", "resource", "show", "mr", "-j"]);
    let mrs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("rdma -j");
    mrs.iter()
        .filter(|m| m["pid"].as_u64() == Some(u64::from(pid)))
        .fold((0, 0), |(n, b), m| {
            (n + 1, b + m["mrlen"].as_u64().unwrap_or(0))
        })
}

/// A policy file for `attach --policy`, removed when dropped.
struct PolicyFile(std::path::PathBuf);

impl PolicyFile {
    fn new(name: &str, text: &str) -> Self {
        let p = std::env::temp_dir().join(format!("ipoib-test-{name}.policy"));
        std::fs::write(&p, text).unwrap();
        Self(p)
    }

    fn arg(&self) -> &str {
        self.0.to_str().expect("utf-8 path")
    }
}

impl Drop for PolicyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A bulk TCP stream from A to B, checked byte for byte, starts on UD and is promoted to CM;
/// pings and small UDP beside it stay UD, none lost; B streams back to A over the same
/// connection, checked too; idle, the connection is reaped and both sides' QPs and receive
/// rings are freed (the kernel's counts); detached, A's TUN device goes.
fn bulk_tcp_is_promoted_to_cm_and_small_traffic_stays_on_ud(recv: Recv) {
    let test = "bulk_tcp_is_promoted_to_cm_and_small_traffic_stays_on_ud";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyb"), 2) else {
        return;
    };
    // Loose reverse-path filtering, as systemd sets it on most distributions (the lab sets 0,
    // which the other test keeps): connected mode must make the TUN device pass it.
    for n in [&lab.a, &lab.b] {
        let out = n
            .cmd("sysctl")
            .args(["-qw", "net.ipv4.conf.all.rp_filter=2"])
            .output()
            .unwrap();
        assert!(out.status.success());
    }
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
    let (mrs_a, mrs_b) = (mrs_of(pid_a), mrs_of(pid_b));

    let stream = Stream::start(&a, &b, 5301);
    // Promotion: B becomes cm_up at A within a few ticks of the flow starting.
    let t0 = Instant::now();
    let at_promotion = a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(12));
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
    let still = a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(5));
    assert!(
        still.is_some(),
        "B is off CM after the small traffic: {:?}; A's engine {:?}",
        a.peer(&b_ip).unwrap(),
        cm_of(&a).engine
    );
    eprintln!("small traffic beside the stream: UD, none lost");
    // The other direction too: B streams to A over the connection it accepted (its map says
    // CM for A once its engine routes A's address to it), checked byte for byte at A.
    let a_ip = a.ip4.to_string();
    let back_from = b.peer(&a_ip).unwrap().expect("B knows A");
    let back = Stream::start(&b, &a, 5302);
    eprintln!("B streams to A (B's view of A: {back_from:?})");
    let b_to_a = || b.peer(&a_ip).unwrap().expect("B knows A");
    wait_until(Duration::from_secs(15), || {
        b_to_a().traffic.tx_cm_bytes > back_from.traffic.tx_cm_bytes + (1 << 20)
    });
    let during = cm_of(&a);
    let b_during = cm_of(&b);
    let back_to = b_to_a();
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
    assert_eq!(peer_why.state, "cm", "{peer_why:?}");
    assert_eq!(
        peer_why.promotions, 1,
        "the connection was lost and set up again: {peer_why:?}"
    );
    // B took the connection as the passive side, and kept it while the stream came in over
    // it (it reaps after 2 s idle, and counts what it receives).
    assert_eq!(b_during.connections, 1, "{b_during:#?}");

    // Idle now: B reaps the connection (after 2 s), A sees it close; each side's QP goes, and
    // with it (without an SRQ) its receive ring: the kernel's counts are back where they were.
    let reaped = wait_until(Duration::from_secs(15), || {
        cm_of(&a).connections == 0 && cm_of(&b).connections == 0
    });
    assert!(reaped, "not reaped: A {:#?}\nB {:#?}", cm_of(&a), cm_of(&b));
    let qps_now = || rdma_resources(&dev).get("qp").copied();
    wait_until(Duration::from_secs(5), || {
        qps_now() == baseline.get("qp").copied() && mrs_of(pid_a) == mrs_a && mrs_of(pid_b) == mrs_b
    });
    assert_eq!(
        qps_now(),
        baseline.get("qp").copied(),
        "a reaped connection's QP lingers"
    );
    assert_eq!(
        (mrs_of(pid_a), mrs_of(pid_b)),
        (mrs_a, mrs_b),
        "a reaped ring lingers"
    );
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
    assert_eq!(b.peer(&a.ip4.to_string()).unwrap().unwrap().mode, "ud");
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// The peer's control loop killed under the flow: A notices (the handshake stream ends), marks
/// it UD and the stream goes on over UD, intact; A retries with backoff (refused while B is
/// down); B restarted, the flow returns to CM.
fn a_killed_peer_falls_back_to_ud_and_returns_to_cm(recv: Recv) {
    let test = "a_killed_peer_falls_back_to_ud_and_returns_to_cm";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyk"), 2) else {
        return;
    };
    attach(&mut lab, Which::A, recv, &dev, &[]);
    let pid_b = attach(&mut lab, Which::B, recv, &dev, &[]);
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5302);
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(12))
        .expect("promoted");

    lab.kill9(pid_b);
    let t = Instant::now();
    let fell = a
        .wait_peer_mode(&b_ip, "ud", Duration::from_secs(10))
        .expect("A kept B on CM after B's engine died");
    eprintln!("B killed: A fell back to UD after {:.1?}", t.elapsed());
    goes_on_over_ud(&a, &b_ip, &fell);
    assert_eq!(cm_of(&a).connections, 0);

    // B back: its entry for A, left CM_UP by the killed loop (pointing at a TUN device that
    // died with it), is UD again until a new connection is up.
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let a_ip = a.ip4.to_string();
    let b_view = b.peer(&a_ip).unwrap().expect("B knows A").mode;
    let a_view = a.peer(&b_ip).unwrap().unwrap().mode;
    assert!(
        b_view == "ud" || a_view != "ud",
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
/// 500 packets, the connection's backlog of 128 and its 64 sends in flight), and no half
/// second passes without a datagram or a byte of the stream, for the kill or the restart
/// (which adopts the pins, resets the stale CM entries and promotes B again).
#[test]
fn the_nodes_own_crash_and_restart_stall_no_flow() {
    let test = "the_nodes_own_crash_and_restart_stall_no_flow";
    let recv = Recv::Srq;
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyc", 2) else {
        return;
    };
    let pid_a = attach(&mut lab, Which::A, recv, &dev, &[]);
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let udp = PacedUdp::start(&a, &b, 5340);
    let stream = Stream::start(&a, &b, 5341);
    let on_cm = a
        .wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(15))
        .expect("promoted");
    // Both flows on CM: the datagrams are counted there too.
    std::thread::sleep(Duration::from_secs(2));
    let before = a.peer(&b_ip).unwrap().unwrap();
    assert!(
        before.traffic.tx_cm_packets > on_cm.traffic.tx_cm_packets + 1000,
        "the flows do not go CM: {before:?}"
    );
    let gone0 = reason(&a.status().unwrap(), "tx_ud_cm_device_gone");

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
    let restarted = Instant::now();
    let mut up_again = Duration::ZERO;
    let after_restart = sample_while(
        || stream.received(),
        || {
            attach(&mut lab, Which::A, recv, &dev, &[]);
            a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(20))
                .expect("promoted again after the restart");
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
    let (idle_kill, idle_restart) = (
        idle_half_seconds(&after_kill),
        idle_half_seconds(&after_restart),
    );
    // The idle windows overlap: their span says it.
    let span = |w: &[(Duration, Duration)]| match (w.first(), w.last()) {
        (Some(f), Some(l)) => format!("{} from {:.1?} to {:.1?}", w.len(), f.0, l.1),
        _ => "none".to_string(),
    };
    eprintln!(
        "kill -9: B's entry left {left}, UDP longest gap {gap_kill:.2?}, {gone} packets sent UD \
         for the gone device; \
         restart: UDP longest gap {gap_restart:.2?} (restart to CM again {:.1?}); \
         {lost} of {sent} datagrams lost, {lost_at_kill} of them due within 0.5 s before and 1 s \
         after the kill; TCP {} MiB, idle half-seconds after the kill: {}, \
         after the restart: {}",
        ended - restarted - Duration::from_secs(2),
        total >> 20,
        span(&idle_kill),
        span(&idle_restart)
    );
    if left == "cm_up" {
        assert!(gone > 0, "no packet met the gone device's check");
    }
    assert!(
        lost_at_kill <= 500 + 128 + 64,
        "{lost_at_kill} datagrams lost at the kill: more than the engine could hold"
    );
    for (what, gap) in [("kill", gap_kill), ("restart", gap_restart)] {
        assert!(
            gap < Duration::from_millis(500),
            "the UDP flow stalled {gap:?} after the {what}"
        );
    }
    assert!(idle_kill.is_empty(), "the stream stalled after the kill");
    assert!(
        idle_restart.is_empty(),
        "the stream stalled after the restart"
    );
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

/// `pid`'s resident memory (KiB) and open file descriptors.
fn rss_and_fds(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
    (rss, fds)
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
    let recv = Recv::Srq;
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyf", 3) else {
        return;
    };
    let pid_a = attach(&mut lab, Which::A, recv, &dev, &[]);
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let (a, b, c) = (lab.a.clone(), lab.b.clone(), lab.more[0].clone());
    let a_ip = a.ip4.to_string();
    let (rss0, fds0) = rss_and_fds(pid_a);
    let tasks0 = cm_of(&a).tasks;
    let secs: u32 = if long_run() { 20 } else { 10 };
    // Small datagrams every 2 ms, past the flood's end.
    let small = SmallUdp::start(&b, &a, 5350, (secs + 6) * 500);
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
    while Instant::now() < until + Duration::from_secs(15) && on_cm_at.is_none() {
        let cm = cm_of(&a);
        let (rss, fds) = rss_and_fds(pid_a);
        peak = (
            peak.0.max(cm.awaiting_req),
            peak.1.max(cm.tasks),
            peak.2.max(rss),
            peak.3.max(fds),
        );
        if b.peer(&a_ip).unwrap().is_some_and(|p| p.mode == "cm_up") {
            on_cm_at = Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
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
    assert!(
        report.opened > 1000,
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

/// The RC QPs of process `pid`, by the device they are on (`rdma resource show qp -j`).
fn rc_qps_by_device(pid: u32) -> HashMap<String, u64> {
    let out = ipoib_tests::programs::sh(&["rdma", "resource", "show", "qp", "-j"]);
    let qps: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("rdma -j");
    let mut by = HashMap::new();
    for q in qps
        .iter()
        .filter(|q| q["pid"].as_u64() == Some(u64::from(pid)) && q["type"] == "RC")
    {
        let dev = q["ifname"].as_str().unwrap_or("?").to_string();
        *by.entry(dev).or_default() += 1;
    }
    by
}

/// Two nodes joined by two rails: rail 0 (`lab.a`-`lab.b`) on the first rxe device, rail 1
/// (`a1`-`b1`) on a second one. Every interface attached on `recv`, A's with `extra_a`; A's
/// two pids. Fields drop in order: the lab (whose loops hold both devices) before `rxe1`.
struct TwoRails {
    lab: Lab,
    a1: Node,
    b1: Node,
    devs: [String; 2],
    baselines: [HashMap<String, u64>; 2],
    pids_a: [u32; 2],
    _rxe1: ipoib_tests::cmlab::SecondRxe,
}

impl TwoRails {
    fn new(test: &str, tag: &str, recv: Recv, extra_a: &[&str]) -> Option<Self> {
        // The first device must exist before the second is made on its veth pair.
        device(test)?;
        let rxe1 = ipoib_tests::cmlab::SecondRxe::make();
        let (dev0, baseline0, mut lab) = rdma_lab(test, tag, 2)?;
        let dev1 = rxe1.0.clone();
        let baseline1 = rdma_resources(&dev1);
        let (a1, b1) = lab.second_rail().expect("second rail");
        let pid_a0 = attach(&mut lab, Which::A, recv, &dev0, extra_a);
        let pid_a1 = attach_node(&mut lab, &a1, recv, &dev1, extra_a);
        attach(&mut lab, Which::B, recv, &dev0, &[]);
        attach_node(&mut lab, &b1, recv, &dev1, &[]);
        Some(Self {
            lab,
            a1,
            b1,
            devs: [dev0, dev1],
            baselines: [baseline0, baseline1],
            pids_a: [pid_a0, pid_a1],
            _rxe1: rxe1,
        })
    }

    /// Tears the lab down; both devices back to their baselines.
    fn finish(mut self) {
        self.lab.teardown();
        for (dev, baseline) in self.devs.iter().zip(&self.baselines) {
            settle(dev, baseline, COUNTED);
        }
    }
}

/// Two rails: A and B joined by two links, rail 0 (`a0`-`b0`) on rxe0 and rail 1
/// (`a1`-`b1`) on rxe1, both interfaces attached on both nodes: four control loops, each with
/// its handshake listener on the same port, bound to its interface. A byte-checked stream on
/// each rail at once: each is promoted to CM, on its own device (the kernel's view of each
/// loop's RC QPs). Then A's rail-1 loop killed: rail 0's connection is untouched (the same
/// connection, the stream goes on over CM), rail 1's stream goes on over UD; both intact.
#[test]
fn two_rails_each_run_connected_mode_on_their_own_device() {
    let test = "two_rails_each_run_connected_mode_on_their_own_device";
    let Some(mut rails) = TwoRails::new(test, "hyw", Recv::Srq, &[]) else {
        return;
    };
    let [dev0, dev1] = rails.devs.clone();
    let [pid_a0, pid_a1] = rails.pids_a;
    let (a0, b0) = (rails.lab.a.clone(), rails.lab.b.clone());
    let (a1, b1) = (rails.a1.clone(), rails.b1.clone());
    let (b0_ip, b1_ip) = (b0.ip4.to_string(), b1.ip4.to_string());
    let s0 = Stream::start(&a0, &b0, 5360);
    let s1 = Stream::start(&a1, &b1, 5361);
    for (n, peer) in [(&a0, &b0_ip), (&a1, &b1_ip)] {
        n.wait_peer_mode(peer, "cm_up", Duration::from_secs(20))
            .unwrap_or_else(|| {
                panic!(
                    "{} not promoted: {:#?}\n{}",
                    n.iface,
                    n.cm().unwrap(),
                    ctl_log(n)
                )
            });
    }
    let (q0, q1) = (rc_qps_by_device(pid_a0), rc_qps_by_device(pid_a1));
    eprintln!("A's RC QPs by device: rail 0 {q0:?}, rail 1 {q1:?}");
    assert!(
        q0.get(&dev0).is_some_and(|n| *n > 0) && q0.len() == 1,
        "rail 0's connections are not all on {dev0}: {q0:?}"
    );
    assert!(
        q1.get(&dev1).is_some_and(|n| *n > 0) && q1.len() == 1,
        "rail 1's connections are not all on {dev1}: {q1:?}"
    );

    let rail0 = cm_of(&a0);
    let before = a0.peer(&b0_ip).unwrap().unwrap();
    rails.lab.kill9(pid_a1);
    // Its entry stays CM_UP (nobody is left to write it), but its CM device is gone with the
    // loop: the fast path sends rail 1's stream UD.
    let fell = a1.peer(&b1_ip).unwrap().unwrap();
    goes_on_over_ud(&a1, &b1_ip, &fell);
    let after = a0.peer(&b0_ip).unwrap().unwrap();
    let rail0_after = cm_of(&a0);
    eprintln!(
        "A's rail-1 loop killed: rail 0 sent {} MiB more over CM meanwhile",
        (after.traffic.tx_cm_bytes - before.traffic.tx_cm_bytes) >> 20
    );
    // Rail 0 stays CM; a queue overflow sends it UD while the queue drains (by design: seen
    // in a CI run, 2 overflows), so it must be CM again within the drain, on the same
    // connection (checked below).
    let settled = a0.wait_peer_mode(&b0_ip, "cm_up", Duration::from_secs(10));
    assert!(
        settled.is_some(),
        "rail 0 left CM (seen {}): {rail0_after:#?}",
        after.mode
    );
    assert!(
        after.traffic.tx_cm_bytes > before.traffic.tx_cm_bytes + (1 << 20),
        "rail 0's stream does not go on over CM: {after:?}"
    );
    assert_eq!(
        (rail0_after.established, rail0_after.failed),
        (rail0.established, rail0.failed),
        "rail 0's connection changed"
    );
    let (t0, t1) = (s0.finish(), s1.finish());
    eprintln!(
        "{} MiB on rail 0, {} MiB on rail 1, intact",
        t0 >> 20,
        t1 >> 20
    );
    rails.finish();
}

/// The node's budget shared by two rails: A's two loops (rings per connection) are given a node
/// budget of one ring (`--node-memory-budget 4MiB`); a stream on each rail wants CM. One rail
/// gets the ring, the other stays on UD (its setup refused for want of memory, before anything
/// is allocated); the kernel's view of both loops' receive regions, sampled as fast as it can
/// be read (`rdma` takes seconds under emulation), never shows more than one ring. Then A's loop on the rail that holds it is killed: the
/// other rail takes the ring after its backoff and goes CM. Both streams intact.
#[test]
fn two_rails_share_the_nodes_budget() {
    let test = "two_rails_share_the_nodes_budget";
    let one_ring = ["--node-memory-budget", "4MiB"];
    let Some(mut rails) = TwoRails::new(test, "hyn", Recv::Rings, &one_ring) else {
        return;
    };
    let [pid_a0, pid_a1] = rails.pids_a;
    let (a0, b0) = (rails.lab.a.clone(), rails.lab.b.clone());
    let (a1, b1) = (rails.a1.clone(), rails.b1.clone());
    let node = cm_of(&a1).node;
    assert_eq!(node.budget_bytes, 4 << 20, "{node:?}");
    // Each loop's regions at rest (its send slots): what comes on top are rings.
    let rest = [(pid_a0, mrs_of(pid_a0)), (pid_a1, mrs_of(pid_a1))];
    let rings_now = |live: &[u32]| {
        rest.iter()
            .filter(|(pid, _)| live.contains(pid))
            .fold((0, 0), |(r, b), (pid, (n0, b0))| {
                let (n, bytes) = mrs_of(*pid);
                (r + n - n0, b + bytes - b0)
            })
    };
    let by_rail = [
        (&a0, b0.ip4.to_string(), pid_a0),
        (&a1, b1.ip4.to_string(), pid_a1),
    ];
    let s0 = Stream::start(&a0, &b0, 5370);
    let s1 = Stream::start(&a1, &b1, 5371);
    let mut samples = 0;
    let mut held_by = None;
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        let (rings, bytes) = rings_now(&[pid_a0, pid_a1]);
        assert!(
            rings <= 1 && bytes <= 4 << 20,
            "A holds {rings} rings, {bytes} B: over the node's budget"
        );
        samples += 1;
        let up: Vec<usize> = (0..2)
            .filter(|i| {
                let (n, peer, _) = &by_rail[*i];
                n.peer(peer).unwrap().is_some_and(|p| p.mode == "cm_up")
            })
            .collect();
        assert!(up.len() <= 1, "both rails on CM with one ring");
        held_by = held_by.or(up.first().copied());
        std::thread::sleep(Duration::from_millis(200));
    }
    let won = held_by.expect("neither rail got the node's one ring");
    let lost = 1 - won;
    let (n_lost, peer_lost, pid_lost) = &by_rail[lost];
    let refused = cm_of(n_lost).receive.rings_refused;
    eprintln!(
        "rail {won} holds the ring; rail {lost} refused {refused} times; {samples} samples of \
         A's regions, never over one ring"
    );
    assert!(refused > 0, "rail {lost} never asked for a ring");
    // UD, or cm_pending while a retry after its backoff asks for a ring again.
    assert_ne!(
        n_lost.peer(peer_lost).unwrap().unwrap().mode,
        "cm_up",
        "rail {lost} on CM without a ring"
    );
    // The rail holding the ring loses its loop: the other takes the ring.
    rails.lab.kill9(by_rail[won].2);
    let t = Instant::now();
    let back = wait_until(Duration::from_secs(45), || {
        let (rings, bytes) = rings_now(&[*pid_lost]);
        assert!(rings <= 1 && bytes <= 4 << 20, "over the budget: {rings}");
        n_lost
            .peer(peer_lost)
            .unwrap()
            .is_some_and(|p| p.mode == "cm_up")
    });
    assert!(
        back,
        "rail {lost} did not take the freed ring: {:#?}\n{}",
        cm_of(n_lost),
        ctl_log(n_lost)
    );
    eprintln!(
        "rail {won}'s loop killed: rail {lost} on CM {:.1?} later",
        t.elapsed()
    );
    let (t0, t1) = (s0.finish(), s1.finish());
    eprintln!(
        "{} MiB on rail 0, {} MiB on rail 1, intact",
        t0 >> 20,
        t1 >> 20
    );
    rails.finish();
}

/// The RC path fails under the flow while both control loops live: the link under the RDMA
/// device goes down, A's sends exhaust their retries and complete in error, the engine reports
/// the QP error, A marks B UD and backs off; the stream goes on over UD, intact. The link back,
/// a retry after the backoff connects again and the flow returns to CM.
fn a_failed_rc_path_falls_back_to_ud_and_returns_to_cm(recv: Recv) {
    let test = "a_failed_rc_path_falls_back_to_ud_and_returns_to_cm";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyq"), 2) else {
        return;
    };
    let netdev = rdma_netdev(&dev);
    assert_eq!(
        netdev.as_deref(),
        Some("rxev0"),
        "the test's rxe device runs on rxev0"
    );
    attach(&mut lab, Which::A, recv, &dev, &[]);
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5303);
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(12))
        .expect("promoted");

    let guard = LinkUp("rxev0".into());
    set_link("rxev0", "down").unwrap();
    let t = Instant::now();
    let fell = a
        .wait_peer_mode(&b_ip, "ud", Duration::from_secs(15))
        .unwrap_or_else(|| {
            panic!(
                "A kept B on CM with the RC path down: {:#?}",
                a.cm().unwrap()
            )
        });
    eprintln!("RC path down: A fell back to UD after {:.1?}", t.elapsed());
    // The map changes at once; the status file (the engine's counters) once a tick.
    let errors = || read_status(&a.iface).map_or(0, |s| engine_count(&s, "send_errors"));
    // Within a few ticks: the status is written by the control loop, late on a slow machine.
    wait_until(Duration::from_secs(10), || errors() > 0);
    let cm = cm_of(&a);
    assert!(
        engine_count(&cm, "send_errors") > 0,
        "the fallback came from something else than the QP error: {cm:#?}"
    );
    goes_on_over_ud(&a, &b_ip, &fell);

    drop(guard);
    returns_to_cm(&a, &b, Duration::from_secs(90), "the link's return");
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact, across CM -> UD -> CM", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// Runs the nftables `script` in node `n`'s namespace.
fn nft(n: &Node, script: &str) {
    let mut c = n
        .cmd("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("nft (cargo xtask provision --vm installs nftables)");
    c.stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(c.wait().unwrap().success(), "nft: {script}");
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
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyo", 2) else {
        return;
    };
    // 120 kB/s is below the bulk threshold: mode=connected asks CM for it.
    let policy = PolicyFile::new("hyo", "mode=connected\n");
    lab.attach(Which::A, &["--cm-device", &dev, "--policy", policy.arg()])
        .unwrap();
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let flow = PacedUdp::every(&a, &b, 5390, Duration::from_millis(10));
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(20))
        .unwrap_or_else(|| panic!("not promoted: {:#?}\n{}", a.cm().unwrap(), ctl_log(&a)));
    std::thread::sleep(Duration::from_secs(1));
    let before = cm_of(&a);
    let failures = |cm: &CmStatus| cm_peer(cm, &b_ip).map(|p| p.failures);
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
        std::thread::sleep(Duration::from_millis(250));
    }
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
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyp"), 2) else {
        return;
    };
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let nft = |script: &str| nft(&b, script);
    nft(
        "table inet hs {\n chain in {\n  type filter hook input priority 0; policy accept;\n  tcp dport 4755 drop\n }\n}\n",
    );
    attach(&mut lab, Which::A, recv, &dev, &[]);
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let stream = Stream::start(&a, &b, 5304);

    // Blocked: never CM, until a setup has been given up (timeouts: 4 steps of 2 s) and the
    // stream has moved on over UD.
    let start = a.peer(&b_ip).unwrap();
    let before = start.map_or(0, |p| p.traffic.tx_ud_bytes);
    let t = Instant::now();
    let gave_up = wait_until(Duration::from_secs(60), || {
        let p = a.peer(&b_ip).unwrap();
        if let Some(p) = &p {
            assert_ne!(p.mode, "cm_up", "CM with the handshake port blocked");
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
        cm_peer(&cm, &b_ip).is_some_and(|p| p.state == "backoff") && cm.receive.rings == 0
    });
    assert!(
        freed,
        "a given-up setup kept its ring: {:?}",
        cm_of(&a).receive
    );
    // Open again: promoted after the backoff.
    nft("delete table inet hs");
    let t = Instant::now();
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(60))
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

/// What A's memory regions look like to the kernel, against its plan, at one sample.
struct MemoryWatch {
    pid: u32,
    /// Regions registered at start that are not receive buffers (the send slots): their
    /// count and bytes.
    other: (u64, u64),
    budget: u64,
    max_rings: u64,
    recv: Recv,
    /// The most receive bytes and rings seen.
    peak: (u64, u64),
    samples: u64,
}

impl MemoryWatch {
    /// At start, with no connection: the kernel's regions of `pid`, less the receive memory A
    /// says it registered (its SRQ; rings come later).
    fn start(a: &Node, pid: u32, recv: Recv) -> Self {
        let rx = cm_of(a).receive;
        let (n, bytes) = mrs_of(pid);
        let srq_regions = u64::from(recv == Recv::Srq);
        Self {
            pid,
            other: (n - srq_regions, bytes - rx.registered_bytes),
            budget: rx.budget_bytes,
            max_rings: u64::from(rx.max_rings),
            recv,
            peak: (0, 0),
            samples: 0,
        }
    }

    /// The kernel's receive regions of A now: (rings, bytes); asserts the plan holds.
    fn sample(&mut self) -> (u64, u64) {
        let (n, bytes) = mrs_of(self.pid);
        let (regions, bytes) = (n - self.other.0, bytes - self.other.1);
        let rings = if self.recv == Recv::Rings { regions } else { 0 };
        assert!(
            bytes <= self.budget,
            "{bytes} B of receive buffers registered, over the budget of {} B",
            self.budget
        );
        assert!(
            rings <= self.max_rings,
            "{rings} rings registered, over the plan's {}",
            self.max_rings
        );
        self.peak = (self.peak.0.max(bytes), self.peak.1.max(rings));
        self.samples += 1;
        (rings, bytes)
    }
}

/// Memory: A's plan holds K connections (policy max-connections=K) and 3K peers want CM
/// (mode=connected everywhere, each peer streaming to A). At no tick does A hold more than K
/// live connections (it refuses the REQs past its plan with REJ no-resources, before
/// allocating anything, and promotes no more than K itself), the device never holds more RC
/// QPs than K connections and the refused setups under way account for, the plan is used, and
/// the peers past it keep streaming over UD, intact. The receive memory A registers, summed
/// from the kernel's own view every 100 ms, never exceeds its budget, nor its rings the
/// plan's: an SRQ of 256 buffers in 16 MiB, or, without an SRQ, rings of 4 MiB in 14 MiB
/// (three; a fourth would not fit). `max-connections` raised to 3 and lowered to 1 again on
/// the running loop: A connects and evicts; an evicted connection's ring is freed.
fn a_plan_of_k_connections_holds_among_3k_peers_that_want_cm(recv: Recv) {
    const K: u64 = 1;
    const PEERS: usize = 3 * K as usize;
    let test = "a_plan_of_k_connections_holds_among_3k_peers_that_want_cm";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hym"), PEERS + 1) else {
        return;
    };
    let budget = match recv {
        Recv::Srq => "16MiB",
        Recv::Rings => "14MiB",
    };
    let for_a = PolicyFile::new(
        "hym-a",
        &format!("mode=connected\nmemory-budget={budget}\nmax-connections={K}\n"),
    );
    let for_peers = PolicyFile::new("hym-p", "mode=connected\nmemory-budget=16MiB\n");
    let a = lab.a.clone();
    let peers: Vec<Node> = lab.nodes().skip(1).cloned().collect();
    let pid_a = attach(&mut lab, Which::A, recv, &dev, &["--policy", for_a.arg()]);
    let mut mem = MemoryWatch::start(&a, pid_a, recv);
    for p in &peers {
        attach_node(&mut lab, p, recv, &dev, &["--policy", for_peers.arg()]);
    }
    let a_cm = cm_of(&a);
    assert_eq!(a_cm.max_connections as u64, K, "{a_cm:#?}");
    if recv == Recv::Rings {
        assert_eq!(a_cm.receive.max_rings, 3, "{:?}", a_cm.receive);
    }
    let streams: Vec<Stream> = peers
        .iter()
        .enumerate()
        .map(|(i, p)| Stream::start(p, &a, 5310 + i as u16))
        .collect();

    // 15 s of everyone wanting CM (30 under `--long`). A's live connections, and the RC QPs on
    // the device: both ends of each connection, and a refused peer's setup under way (an
    // initiator makes its QP before it sends the REQ; it is destroyed on the REJ).
    let (window, mid_at) = if long_run() { (30, 20) } else { (15, 10) };
    let qp_base = baseline.get("qp").copied().unwrap_or(0);
    let (mut peak, mut qp_peak) = (0u64, 0u64);
    let mut mid = Vec::new();
    let t = Instant::now();
    // Each control loop writes its connected-mode status once a tick; read the files (a
    // status command per node would take seconds under emulation and miss ticks).
    let held = |n: &Node| read_status(&n.iface).map(|s| s.connections as u64);
    // The last value read (a file caught mid-write does not parse).
    let mut at_a = 0;
    while t.elapsed() < Duration::from_secs(window) {
        at_a = held(&a).unwrap_or(at_a);
        let qps = rdma_resources(&dev).get("qp").copied().unwrap_or(0) - qp_base;
        assert!(
            at_a <= K,
            "past the plan after {:.1?}: A holds {at_a}: {:#?}",
            t.elapsed(),
            a.cm().unwrap()
        );
        assert!(
            qps <= 2 * K + PEERS as u64,
            "{qps} QPs for a plan of {K} connection(s) and {PEERS} peers"
        );
        mem.sample();
        peak = peak.max(at_a);
        qp_peak = qp_peak.max(qps);
        if mid.is_empty() && t.elapsed() > Duration::from_secs(mid_at) {
            mid = streams.iter().map(Stream::received).collect();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let cm = cm_of(&a);
    eprintln!(
        "{} samples over {window} s: A held at most {peak} connection(s) (plan {K}), {qp_peak} QPs \
         above the baseline at most, {} B of receive buffers and {} ring(s) at most (kernel's \
         view; budget {} B); A refused {} setup(s); A's receive side: {:?}; A's peers: {:#?}",
        mem.samples, mem.peak.0, mem.peak.1, mem.budget, cm.failed, cm.receive, cm.peers
    );
    assert_eq!(peak, K, "the plan's connections were never used");
    assert!(cm.failed >= 1, "no REQ was refused: {cm:#?}");
    // Every stream kept moving in the window's last seconds, CM or UD.
    let last: Vec<u64> = streams.iter().map(Stream::received).collect();
    for (i, (m, l)) in mid.iter().zip(&last).enumerate() {
        assert!(
            *l > m + (1 << 20),
            "peer {i}'s stream stalled: {m} -> {l} bytes in the last {} s",
            window - mid_at
        );
    }
    // Bytes by path at A's peers: some CM (the plan used), and the peers past it on UD.
    let mut on_ud = 0;
    for p in &peers {
        let view = p
            .peer(&a.ip4.to_string())
            .unwrap()
            .expect("A in the peer's map");
        if view.mode != "cm_up" {
            on_ud += 1;
        }
    }
    assert!(
        on_ud >= PEERS - K as usize,
        "{on_ud} of {PEERS} peers on UD with a plan of {K}"
    );
    cap_raised_and_lowered(&a, &peers, &mut mem);
    for s in streams {
        let sent = s.finish();
        assert!(sent > 1 << 20, "{sent} bytes");
    }
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// The cap changed on A's running loop: raised to 3, A connects every peer itself (they are in
/// backoff, which takes a connection set up to them); lowered to 1 again, A closes the two
/// least recently active, and their rings (without an SRQ) are freed. With rings it is
/// lowered by the memory budget (`memory-budget=4MiB`, one ring), the cap left at 3: the
/// budget counts on a running loop too. The memory plan is sampled throughout.
fn cap_raised_and_lowered(a: &Node, peers: &[Node], mem: &mut MemoryWatch) {
    let recv = mem.recv;
    let held_now = || read_status(&a.iface).map_or(0, |s| s.connections);
    let mut wait_held = |want: usize, within: Duration| {
        wait_until(within, || {
            mem.sample();
            held_now() == want
        });
        held_now()
    };
    let set = |setting: &str| {
        let out = a.ctl(&["set-policy", &a.iface, setting]).unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!(
            "set-policy {setting}: {}",
            String::from_utf8_lossy(&out.stdout).trim()
        );
    };
    set("max-connections=3");
    let t = Instant::now();
    let raised = wait_held(3, Duration::from_secs(20));
    eprintln!(
        "max-connections=3: A holds {raised} after {:.1?}",
        t.elapsed()
    );
    assert_eq!(
        raised,
        3,
        "{:#?}\nA's log:\n{}",
        a.cm().unwrap(),
        ctl_log(a)
    );
    let lower = match recv {
        Recv::Srq => "max-connections=1",
        Recv::Rings => "memory-budget=4MiB",
    };
    set(lower);
    let t = Instant::now();
    let lowered = wait_held(1, Duration::from_secs(10));
    eprintln!("{lower}: A holds {lowered} after {:.1?}", t.elapsed());
    assert_eq!(
        lowered,
        1,
        "{:#?}\nA's log:\n{}",
        a.cm().unwrap(),
        ctl_log(a)
    );
    if mem.recv == Recv::Rings {
        // Evicted: their rings go with their QPs (the kernel's count of A's regions). The one
        // kept may end meanwhile (seen once in CI and once here under load: the peer closed
        // it 0.5 s after the eviction; its log is printed below if this fails); A connects a
        // peer again once the evicted ones' hold (min_hold, 10 s) is over, so wait for that.
        let mut none_held = false;
        wait_until(Duration::from_secs(20), || {
            let rings = mem.sample().0;
            none_held |= rings == 0;
            rings == 1 && read_status(&a.iface).is_some_and(|s| s.connections == 1)
        });
        if none_held {
            eprintln!(
                "!!! A held no connection for a while after the eviction: the kept one \
                 closed\nA's log:\n{}",
                ctl_log(a)
            );
        }
        let (rings, bytes) = mem.sample();
        let ours = cm_of(a).receive;
        eprintln!(
            "after eviction: {rings} ring(s), {bytes} B registered (A says {} and {} B); peak \
             {} ring(s), {} B",
            ours.rings, ours.registered_bytes, mem.peak.1, mem.peak.0
        );
        assert_eq!(
            rings,
            1,
            "the evicted connections' rings were not freed (or the kept one closed): {:#?}\nA's \
             log:\n{}\npeers' logs:\n{}",
            a.cm().unwrap(),
            ctl_log(a),
            peers
                .iter()
                .map(|p| format!("--- {}\n{}", p.ip4, ctl_log(p)))
                .collect::<String>()
        );
        assert_eq!(
            bytes, ours.registered_bytes,
            "A's count differs from the kernel's"
        );
        assert_eq!(mem.peak.1, 3, "the raised cap never used three rings");
    }
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
/// stream as the peer gone, falls back to UD within the heartbeat deadline, and the stream
/// goes on over UD, intact, while B is stopped. B resumed, A connects again after its backoff
/// and the flow returns to CM.
fn a_stalled_receiver_falls_back_to_ud_and_returns_to_cm(recv: Recv) {
    let test = "a_stalled_receiver_falls_back_to_ud_and_returns_to_cm";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hys"), 2) else {
        return;
    };
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
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(12))
        .expect("promoted");
    std::thread::sleep(Duration::from_secs(2));

    let resume = Cont(pid_b);
    // SAFETY: plain kill(2).
    assert_eq!(unsafe { libc::kill(pid_b as i32, libc::SIGSTOP) }, 0);
    let t = Instant::now();
    let fell = a
        .wait_peer_mode(&b_ip, "ud", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("A kept B on CM with B stalled: {:#?}", a.cm().unwrap()));
    let took = t.elapsed();
    // The map changes at once; the policy's view is written into the status once a tick.
    let b_addr: std::net::IpAddr = b.ip4.into();
    let t = Instant::now();
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
        std::thread::sleep(Duration::from_millis(100));
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

    drop(resume);
    returns_to_cm(&a, &b, Duration::from_secs(90), "B's resumption");
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact, across CM -> UD -> CM", sent >> 20);
    // mode=datagram drains the connection; the engine forgets what it tracked for it.
    let flows = || engine_flows(&a);
    assert!(flows().is_some_and(|f| f >= 1), "A's engine tracks no flow");
    let out = a.ctl(&["set-policy", &a.iface, "mode=datagram"]).unwrap();
    assert!(out.status.success());
    a.wait_peer_mode(&b_ip, "ud", Duration::from_secs(10))
        .expect("mode=datagram drained B");
    wait_until(Duration::from_secs(10), || flows() == Some(0));
    assert_eq!(flows(), Some(0), "the closed connection's flow lingers");
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// A connection shed under a bulk flow: A sends to B and C, both on CM, and the cap is
/// lowered to one (`set-policy max-connections=1`), so A's control plane closes one of them
/// on its own (the fast path knows nothing of the cap, unlike `mode=datagram` or a pin,
/// which it follows before the control plane acts). The packets A's engine already holds
/// for that peer (behind the connection's window, or still in the TUN device's queue) go
/// over the connection before it closes, and the sends in flight complete first: nothing is
/// dropped as without a connection, no send completes in error, and both streams go on,
/// intact. Three times, five under `--long` (the cap raised again in between, the shed peer
/// back on CM): a shedding finds packets held in some rounds, not all (the build that dropped
/// them did so in round 0, 1 and 2 of the three runs seen: 21, 28 and 7 packets).
fn a_shed_connection_drops_nothing_its_engine_held(recv: Recv) {
    shed_under_flows(recv, 1);
}

/// [`a_shed_connection_drops_nothing_its_engine_held`] with A on two engine lanes: each
/// connection on a lane of its own (the lane with the fewest QPs), so the shed one's route is
/// let go by its lane while the other lane, told the same, lets go at once.
#[test]
fn a_shed_connection_on_two_lanes_drops_nothing_its_engine_held() {
    shed_under_flows(Recv::Srq, 2);
}

fn shed_under_flows(recv: Recv, lanes: u32) {
    let test = "a_shed_connection_drops_nothing_its_engine_held";
    let tag = format!("{}{lanes}", recv.tag("hds"));
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &tag, 3) else {
        return;
    };
    let policy = PolicyFile::new(&tag, "mode=connected\n");
    let lanes_arg = lanes.to_string();
    let hold = [
        "--policy",
        policy.arg(),
        "--cm-min-hold",
        "2s",
        "--cm-lanes",
        &lanes_arg,
    ];
    attach(&mut lab, Which::A, recv, &dev, &hold);
    assert_eq!(cm_of(&lab.a).engine_lanes, lanes);
    let peers: Vec<Node> = lab.nodes().skip(1).cloned().collect();
    for p in &peers {
        attach_node(&mut lab, p, recv, &dev, &[]);
    }
    let a = lab.a.clone();
    let streams: Vec<Stream> = peers
        .iter()
        .enumerate()
        .map(|(i, p)| Stream::start(&a, p, 5396 + 2 * lanes as u16 + i as u16))
        .collect();
    let ips: Vec<String> = peers.iter().map(|p| p.ip4.to_string()).collect();
    let counts = |cm: &CmStatus| {
        [
            "tx_no_connection",
            "send_errors",
            "tx_window_waits",
            "tx_packets",
        ]
        .map(|k| engine_count(cm, k))
    };
    let cap = |n: u32| {
        let out = a
            .ctl(&["set-policy", &a.iface, &format!("max-connections={n}")])
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let flows = || engine_flows(&a);
    let rounds = if long_run() { 5 } else { 3 };
    for round in 0..rounds {
        for ip in &ips {
            a.wait_peer_mode(ip, "cm_up", Duration::from_secs(30))
                .unwrap_or_else(|| panic!("round {round}: {ip} not on CM:\n{}", ctl_log(&a)));
        }
        let on_cm = counts(&cm_of(&a));
        std::thread::sleep(Duration::from_secs(2));
        let before = counts(&cm_of(&a));
        cap(1);
        // One connection closed, its flow forgotten once the engine let it go.
        assert!(
            wait_until(Duration::from_secs(10), || flows() == Some(1)),
            "round {round}: no connection was shed: {} flows",
            flows().unwrap_or(0)
        );
        let after = counts(&cm_of(&a));
        let d: Vec<u64> = after.iter().zip(&before).map(|(x, y)| x - y).collect();
        let waits = before[2] - on_cm[2];
        eprintln!(
            "round {round}: across the shedding: {} dropped as without a connection, {} sends \
             in error ({} packets sent over connections meanwhile); in the 2 s before it, \
             {waits} of {} packets waited for a window",
            d[0],
            d[1],
            d[3],
            before[3] - on_cm[3]
        );
        assert!(
            waits > 0,
            "round {round}: no packet waited for a window: the engine held nothing to lose"
        );
        assert_eq!(
            (d[0], d[1]),
            (0, 0),
            "round {round}: shedding dropped what the engine held (without a connection, sends \
             in error)"
        );
        for (s, ip) in streams.iter().zip(&ips) {
            let at = s.received();
            assert!(
                wait_until(Duration::from_secs(10), || s.received() > at + (1 << 20)),
                "round {round}: the stream to {ip} stopped after the shedding"
            );
        }
        cap(2);
    }
    for s in streams {
        let sent = s.finish();
        eprintln!(
            "{} MiB crossed intact, across {rounds} sheddings",
            sent >> 20
        );
    }
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// An IPv6 peer: a bulk stream to B's IPv6 address is promoted like an IPv4 one (the fast path
/// keys the peer by its IPv6 address, the handshake runs over IPv6, the engine routes IPv6
/// packets), goes CM and arrives intact.
#[test]
fn an_ipv6_peer_is_promoted_too() {
    let test = "an_ipv6_peer_is_promoted_too";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hy6", 2) else {
        return;
    };
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b6: std::net::Ipv6Addr = b.ip6.parse().unwrap();
    let key = b6.to_string();
    let stream = Stream::start_to(&a, &b, std::net::SocketAddr::new(b6.into(), 5306));
    let at = a
        .wait_peer_mode(&key, "cm_up", Duration::from_secs(15))
        .unwrap_or_else(|| {
            panic!(
                "{key} was not promoted at A in 15 s: {:#?}",
                a.cm().unwrap()
            )
        });
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
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyk", 2) else {
        return;
    };
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
    // The default partition as a limited member would name it.
    let limited = format!("{:#06x}", default & 0x7fff);
    lab.attach(Which::A, &["--cm-device", &dev, "--cm-pkey", &limited])
        .unwrap();
    lab.attach(Which::B, &["--cm-device", &dev, "--cm-pkey", &limited])
        .unwrap();
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5380);
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(20))
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

/// Backpressure: hosts tuned for bulk TCP (socket buffers up to 64 MiB, as HPC sites set
/// them) and four streams to one peer put more in flight than the connection's queue holds
/// (64 sends posted, 128 waiting). The engine reports the overflow, the peer goes UD while
/// the queue drains (the next packets take UD at once, the connection stays up), and CM
/// again once drained; every stream arrives intact.
fn an_overflowing_connection_queue_sends_the_peer_ud_until_it_drains(recv: Recv) {
    let test = "an_overflowing_connection_queue_sends_the_peer_ud_until_it_drains";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyo"), 2) else {
        return;
    };
    for n in [&lab.a, &lab.b] {
        for k in ["net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem"] {
            let out = n
                .cmd("sysctl")
                .args(["-qw", &format!("{k}=4096 131072 67108864")])
                .output()
                .unwrap();
            assert!(out.status.success());
        }
    }
    attach(&mut lab, Which::A, recv, &dev, &[]);
    attach(&mut lab, Which::B, recv, &dev, &[]);
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    // Every write of B's entry in A's peer map bumps its generation (from 0, before the
    // entry exists): counted from before the streams, as the overflow may come with the
    // promotion itself (seen in a CI run: overflowed, UD and back before the test looked).
    let generation = || a.peer(&b_ip).unwrap().map_or(0, |p| p.generation);
    let gen_before = generation();
    let streams: Vec<Stream> = (0..4).map(|i| Stream::start(&a, &b, 5320 + i)).collect();
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(15))
        .expect("promoted");
    // Big packets sent UD because the peer is not CM_UP (the fast path's reason counter):
    // from here on, only the overflow makes any.
    let not_up = |s: &Status| reason(s, "tx_ud_peer_not_up");
    let on_cm = not_up(&a.status().unwrap());
    let engine = |k: &str| read_status(&a.iface).and_then(|s| s.engine.get(k).copied());
    let t = Instant::now();
    wait_until(Duration::from_secs(40), || {
        engine("tx_congested").unwrap_or(0) > 0
    });
    let congested = engine("tx_congested").unwrap_or(0);
    let cm = cm_of(&a);
    assert!(
        congested > 0,
        "the queue never overflowed in 40 s: {:#?}",
        cm.engine
    );
    eprintln!(
        "queue overflowed after {:.1?} ({congested} time(s), {} packets dropped at the bound)",
        t.elapsed(),
        engine_count(&cm, "tx_backpressure")
    );
    // While it drains the peer is UD, then CM again, on the same connection. How many big
    // packets meet the UD window depends on how long the drain takes: under emulation a small
    // overflow (a few packets past the bound) drains within the engine's own turn, before the
    // control loop has written UD, and none do (seen 0 in 2 of 4 runs, 399 and 2075 in the
    // others). That the peer was marked UD and back is certain: its entry was written twice
    // more than the promotion's own two writes (CM_PENDING, CM_UP).
    let marked_and_back = || {
        generation().wrapping_sub(gen_before) >= 4
            && a.peer(&b_ip).unwrap().is_some_and(|p| p.mode == "cm_up")
    };
    wait_until(Duration::from_secs(20), marked_and_back);
    let later = not_up(&a.status().unwrap());
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(10))
        .expect("CM again once drained");
    let writes = generation().wrapping_sub(gen_before);
    eprintln!(
        "{} big packets went UD while the queue drained; B's entry written {writes} times",
        later - on_cm
    );
    assert!(
        writes >= 4,
        "B's entry was not marked UD and back after the overflow ({writes} writes in all, \
         2 of them the promotion's)"
    );
    let cm = cm_of(&a);
    let peer = cm_peer(&cm, &b_ip).expect("B in A's CM status");
    // One promotion and no failed setup: so the writes above are the overflow's.
    assert_eq!(
        (peer.promotions, peer.failures),
        (1, 0),
        "congestion tore the connection down: {peer:?}\n{cm:#?}\nA's log:\n{}\nB's log:\n{}",
        ctl_log(&a),
        ctl_log(&b)
    );
    assert_eq!(engine_count(&cm, "send_errors"), 0, "{cm:#?}");
    // Under four bulk streams each node's thread still gave its control loop its tick on
    // time, give or take: the engine beside it yields between turns of completions.
    for n in [&a, &b] {
        let late = Duration::from_millis(cm_of(n).tick_late_max_ms);
        eprintln!("{}: the policy's tick late by {late:?} at most", n.ns);
        assert!(
            late < Duration::from_secs(1),
            "{}: the control loop was kept from its tick for {late:?}",
            n.ns
        );
    }
    let total: u64 = streams.into_iter().map(Stream::finish).sum();
    eprintln!("{} MiB in four streams crossed intact", total >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// A receiver whose engine pauses under a burst: B's engine takes nothing for 2 s
/// (`attach --test-faults`, `pause 2000`) while A streams to it, so B's receive buffers (its
/// ring of 64, or the SRQ's) run dry. A's sends meet RNR NAKs and wait (retried without end:
/// the connection lives, no send fails); A's queue fills past its bound, so A's next packets
/// go UD until it drains; B's heartbeat lapses while its engine shows no life, so B sends UD
/// meanwhile. Once B's engine turns again the stream goes on over CM, on the same connection,
/// intact.
fn a_receiver_whose_engine_pauses_under_a_burst_keeps_the_stream_intact(recv: Recv) {
    let test = "a_receiver_whose_engine_pauses_under_a_burst_keeps_the_stream_intact";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, &recv.tag("hyd"), 2) else {
        return;
    };
    attach(&mut lab, Which::A, recv, &dev, &[]);
    attach(&mut lab, Which::B, recv, &dev, &["--test-faults"]);
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5340);
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(15))
        .expect("promoted");
    std::thread::sleep(Duration::from_secs(2));
    let before = cm_of(&a);
    // Every write of B's entry in A's peer map bumps its generation: UD and back is two.
    let generation = || a.peer(&b_ip).unwrap().expect("A knows B").generation;
    let gen_before = generation();
    let fault = format!("/run/ipoib-ctl/{}.fault", b.iface);
    std::fs::write(&fault, "pause 2000").unwrap();
    // B takes the fault at its next tick (removing the file), then its engine pauses 2 s:
    // watch A's view of B until 3 s after it was taken.
    let (mut went_ud, mut b_failsafe) = (false, false);
    let mut taken: Option<Instant> = None;
    let t = Instant::now();
    while taken.is_none_or(|at| at.elapsed() < Duration::from_secs(3)) {
        went_ud |= a.peer(&b_ip).unwrap().is_some_and(|p| p.mode == "ud");
        b_failsafe |= b.status().is_ok_and(|s| s.failsafe_active);
        if taken.is_none() && !std::path::Path::new(&fault).exists() {
            taken = Some(Instant::now());
        }
        assert!(
            taken.is_some() || t.elapsed() < Duration::from_secs(15),
            "B did not take the fault in 15 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let back = a
        .wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("not back on CM after the pause: {:#?}", a.cm().unwrap()));
    let goes_cm = || a.peer(&b_ip).unwrap().expect("A knows B");
    wait_until(Duration::from_secs(15), || {
        goes_cm().traffic.tx_cm_bytes > back.traffic.tx_cm_bytes + (1 << 20)
    });
    let later = goes_cm();
    let after = cm_of(&a);
    let sent = stream.finish();
    let overflows = engine_count(&after, "tx_congested") - engine_count(&before, "tx_congested");
    let writes = generation().wrapping_sub(gen_before);
    eprintln!(
        "B's engine paused 2 s: A's packets for B went UD meanwhile: {} (seen UD {went_ud}, \
         B's entry at A written {writes} times; A's queue overflowed {overflows} time(s), {} \
         packets dropped at its bound); B's fail-safe seen: {b_failsafe}; A's send errors {}; \
         {} MiB crossed intact",
        went_ud || writes >= 2,
        engine_count(&after, "tx_backpressure") - engine_count(&before, "tx_backpressure"),
        engine_count(&after, "send_errors"),
        sent >> 20
    );
    assert_eq!(
        engine_count(&after, "send_errors"),
        0,
        "a send failed: the dry ring killed the connection: {after:#?}"
    );
    let peer = cm_peer(&after, &b_ip).expect("B in A's CM status");
    assert_eq!(
        peer.promotions, 1,
        "the connection was set up again: {peer:?}"
    );
    assert!(
        later.traffic.tx_cm_bytes > back.traffic.tx_cm_bytes + (1 << 20),
        "back on CM, yet the flow does not go CM: {later:?}"
    );
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// A's own engine wedged under the flow (`attach --test-faults`: the engine's task panics,
/// stalls in an await, or blocks the runtime's thread): within the heartbeat deadline the
/// flow goes UD, and goes on intact. What catches each: a task that ended stops connected
/// mode at once (peers UD in the map); a loop that stopped turning withholds the heartbeat
/// (the fail-safe then sends every packet UD, and an engine that turns again gets it back); a
/// blocked thread stops the heartbeat itself. Connected mode stopped by the panic starts
/// again after its backoff, and the flow returns to CM.
fn a_wedged_engine_goes_ud(fault: &str, tag: &str, port: u16, lanes: u32) {
    let test = format!("a_wedged_engine_goes_ud_{fault}_{lanes}");
    let Some((dev, baseline, mut lab)) = rdma_lab(&test, tag, 2) else {
        return;
    };
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
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(15))
        .expect("promoted");
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
    let on_ud =
        |s: &Status| s.failsafe_active || s.peers.iter().any(|p| p.addr == b_ip && p.mode == "ud");
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
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact", sent >> 20);
    watchdog_follows_the_engine(&sock, fault, t, period);
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
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hld", 2) else {
        return;
    };
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    lab.attach(Which::B, &["--cm-device", &dev, "--test-faults"])
        .unwrap();
    let (a, b) = (lab.a.clone(), lab.b.clone());
    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5334);
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(15))
        .expect("promoted");
    std::fs::write(format!("/run/ipoib-ctl/{}.fault", b.iface), "listener").unwrap();
    let stopped = wait_until(Duration::from_secs(10), || {
        ctl_log(&b).contains("the handshake listener stopped")
    });
    assert!(
        stopped,
        "B's connected mode did not stop on its listener's end:\n{}",
        ctl_log(&b)
    );
    returns_to_cm(&a, &b, Duration::from_secs(40), "B's restart");
    assert!(ctl_log(&b).contains("runs again"), "{}", ctl_log(&b));
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact", sent >> 20);
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
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hyt", 3) else {
        return;
    };
    let (a, b) = (lab.a.clone(), lab.b.clone());
    a.set_tso(true).unwrap();
    lab.attach(Which::A, &["--cm-device", &dev]).unwrap();
    lab.attach(Which::B, &["--cm-device", &dev]).unwrap();
    assert_eq!(cm_of(&a).ud_path, "offloaded", "{:#?}", cm_of(&a));
    assert_eq!(cm_of(&b).ud_path, "per-packet", "{:#?}", cm_of(&b));
    let b_ip = b.ip4.to_string();
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
    assert_eq!(held.mode, "ud", "{held:?}\n{}", ctl_log(&a));
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

    a.set_tso(false).unwrap();
    let t = Instant::now();
    let up = a
        .wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(15))
        .unwrap_or_else(|| {
            panic!(
                "not promoted once TSO was off: {:#?}\n{}",
                cm_of(&a),
                ctl_log(&a)
            )
        });
    eprintln!("TSO off: B on CM after {:.1?}", t.elapsed());
    assert_eq!(cm_of(&a).ud_path, "per-packet");
    assert!(
        ctl_log(&a).contains("the UD path is per-packet now"),
        "{}",
        ctl_log(&a)
    );
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

/// systemd's watchdog (WATCHDOG=1 with the heartbeat) came while the engine turned, and
/// stopped once a stalled or hung engine withheld the heartbeat (systemd would restart the
/// unit); a panicked engine took connected mode down, the loop went on UD, said so, and
/// said when connected mode was up again, beating all along.
fn watchdog_follows_the_engine(
    sock: &ipoib_tests::notify::NotifySocket,
    fault: &str,
    faulted: Instant,
    period: Duration,
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
            assert!(
                after < period && after < before + period / 4,
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
            restart_beside_the_loop(sock, faulted, before, period);
        }
    }
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
    // margin is the one the watchdog is held to through the whole fault.
    let most = before.max(period / 3) + period / 4;
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
        gap <= most,
        "the restart held the loop: a gap of {gap:.2?} in the watchdog around a start of \
         {:.2?} ({during} pings during it)",
        up - began
    );
}

#[test]
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

/// A peer that runs no ipoib-hybrid (a mixed cluster during a rolling upgrade): A's setups
/// to it are refused at the handshake port, the flow goes on over UD, and A's status says
/// what the peer is, not a QP error.
#[test]
fn a_peer_without_ipoib_hybrid_is_shown_as_such_and_stays_ud() {
    let test = "a_peer_without_ipoib_hybrid_is_shown_as_such_and_stays_ud";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hnr", 2) else {
        return;
    };
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
    eprintln!("B at A: {} ({}), {} failure(s)", p.state, p.why, p.failures);
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
    // UD, or cm_pending while a retry after the backoff runs (its packets go UD meanwhile).
    let view = a.peer(&b_ip).unwrap().expect("A knows B");
    assert_ne!(view.mode, "cm_up", "{view:?}");
    goes_on_over_ud(&a, &b_ip, &view);
    let sent = stream.finish();
    eprintln!("{} MiB crossed intact over UD", sent >> 20);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}

/// `ip -j ARGS` in node `n`'s namespace, parsed.
fn ip_json(n: &Node, args: &[&str]) -> serde_json::Value {
    let out = n.cmd("ip").arg("-j").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn gso_max_size(n: &Node) -> u64 {
    ip_json(n, &["-d", "link", "show", "dev", &n.iface])[0]["gso_max_size"]
        .as_u64()
        .expect("gso_max_size")
}

fn ipv4_on(n: &Node, dev: &str) -> Vec<String> {
    ip_json(n, &["-4", "addr", "show", "dev", dev])[0]["addr_info"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|a| format!("{}/{}", a["local"].as_str().unwrap(), a["prefixlen"]))
        .collect()
}

/// The daemon speaks netlink, not `ip`: A's runs with a PATH that holds only `nsenter` (the
/// lab enters its namespace with it), so any program it tried to run would fail; connected
/// mode still comes up and carries a stream. Meanwhile its TUN device holds the interface's
/// IPv4 addresses (loose rp_filter) as they change, an address added and one removed, and
/// the interface's gso_max_size is 65000 while attached and what it was once detached.
#[test]
fn connected_mode_follows_the_interface_over_netlink_and_runs_no_program() {
    let test = "connected_mode_follows_the_interface_over_netlink_and_runs_no_program";
    let Some((dev, baseline, mut lab)) = rdma_lab(test, "hnl", 2) else {
        return;
    };
    let (a, b) = (lab.a.clone(), lab.b.clone());
    for n in [&a, &b] {
        let out = n
            .cmd("sysctl")
            .args(["-qw", "net.ipv4.conf.all.rp_filter=2"])
            .output()
            .unwrap();
        assert!(out.status.success());
    }
    let gso_before = gso_max_size(&a);
    let bin = std::env::temp_dir().join("hnl-path");
    let _ = std::fs::remove_dir_all(&bin);
    std::fs::create_dir_all(&bin).unwrap();
    let nsenter = ipoib_tests::programs::on_path("nsenter").expect("nsenter on PATH");
    std::os::unix::fs::symlink(&nsenter, bin.join("nsenter")).unwrap();
    lab.attach_node_env(
        &a,
        &["--cm-device", &dev],
        &[("PATH", bin.to_str().unwrap())],
    )
    .unwrap();
    attach(&mut lab, Which::B, Recv::Srq, &dev, &[]);
    let tun = cm_of(&a).tun;
    let own = format!("{}/32", a.ip4);
    let gso_during = gso_max_size(&a);
    eprintln!(
        "A's {}: gso_max_size {gso_before} before attach, {gso_during} attached; {tun}: {:?}",
        a.iface,
        ipv4_on(&a, &tun)
    );
    assert_eq!(gso_during, 65000);
    assert_eq!(ipv4_on(&a, &tun), std::slice::from_ref(&own));

    let b_ip = b.ip4.to_string();
    let stream = Stream::start(&a, &b, 5395);
    a.wait_peer_mode(&b_ip, "cm_up", Duration::from_secs(15))
        .unwrap_or_else(|| panic!("not promoted: {:#?}\n{}", cm_of(&a), ctl_log(&a)));
    // An address added to the interface, then the first one removed and put back.
    let extra = "10.79.0.1";
    let addr_on_a = |change: &str, addr: &str| {
        let args = ["addr", change, addr, "dev", &a.iface];
        let out = a.cmd("ip").args(args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}");
    };
    addr_on_a("add", &format!("{extra}/24"));
    let both = [own.clone(), format!("{extra}/32")];
    let t = Instant::now();
    let added = wait_until(Duration::from_secs(5), || ipv4_on(&a, &tun) == both);
    eprintln!(
        "{extra} on {tun} after {:.0?}: {:?}",
        t.elapsed(),
        ipv4_on(&a, &tun)
    );
    assert!(added, "{:?}\n{}", ipv4_on(&a, &tun), ctl_log(&a));
    addr_on_a("del", &format!("{extra}/24"));
    let t = Instant::now();
    let removed = wait_until(Duration::from_secs(5), || {
        ipv4_on(&a, &tun) == [own.clone()]
    });
    eprintln!("{extra} off {tun} after {:.0?}", t.elapsed());
    assert!(removed, "{:?}\n{}", ipv4_on(&a, &tun), ctl_log(&a));
    let sent = stream.finish();
    let p = a.peer(&b_ip).unwrap().expect("A knows B");
    eprintln!(
        "{} MiB intact, {} MiB of it over CM",
        sent >> 20,
        p.traffic.tx_cm_bytes >> 20
    );
    assert!(p.traffic.tx_cm_bytes > 1 << 20, "{p:?}");

    let out = a.ctl(&["detach", &a.iface]).unwrap();
    assert!(out.status.success());
    let restored = wait_until(Duration::from_secs(10), || gso_max_size(&a) == gso_before);
    let log = ctl_log(&a);
    eprintln!(
        "after detach: gso_max_size {}; A's log on it:\n{}",
        gso_max_size(&a),
        log.lines()
            .filter(|l| l.contains("gso_max_size") || l.contains(&tun))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(restored, "gso_max_size not restored\n{log}");
    let _ = std::fs::remove_dir_all(&bin);
    lab.teardown();
    settle(&dev, &baseline, COUNTED);
}
