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
//!
//! The scenarios are in modules by feature (promotion, faults, queues, watchdog, memory,
//! rails, netlink); this file holds what they share: the lab, the flows, the waits.

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
    promotion::{Failure, UdPath},
    status::{
        PeerModeView, PeerView, Status,
        cm::{CmPeerState, CmStatus, PeerStatus, ReceiveKind, read_status},
    },
};
use ipoib_tests::{
    cmlab::{COUNTED, LinkUp, device, in_netns, rdma_netdev, rdma_resources, set_link, settle},
    lab::{Lab, Node, Which, lab_unavailable},
    long_run,
    pace::{Looks, wait_until},
    steps::Steps,
};

/// Loose reverse-path filtering on each of `nodes`, as systemd sets it on most distributions
/// (the lab sets 0): connected mode must make its TUN device pass it.
fn loose_rp_filter(nodes: &[&Node]) {
    for n in nodes {
        let out = n
            .cmd("sysctl")
            .args(["-qw", "net.ipv4.conf.all.rp_filter=2"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}: rp_filter=2", n.ns);
    }
}

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
        Self::start_with(a, b, addr, None)
    }

    /// A stream from `a` to `b` that sends `per_sec` bytes a second at most, in 64 KiB writes
    /// on a schedule: bulk, without taking all the CPU a slow machine has.
    fn paced(a: &Node, b: &Node, port: u16, per_sec: u64) -> Self {
        let addr = std::net::SocketAddr::new(b.ip4.into(), port);
        Self::start_with(a, b, addr, Some(per_sec))
    }

    fn start_with(a: &Node, b: &Node, addr: std::net::SocketAddr, per_sec: Option<u64>) -> Self {
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
                    let mut next = Instant::now();
                    while !stop.load(Ordering::Relaxed) {
                        let at = (off % p.len() as u64) as usize;
                        let end = per_sec.map_or(p.len(), |_| p.len().min(at + (1 << 16)));
                        s.write_all(&p[at..end]).expect("send the stream");
                        off += (end - at) as u64;
                        if let Some(rate) = per_sec {
                            // The next write is due a write's time after this one was, or
                            // now if that has passed: a stalled stream does not burst after.
                            next = (next
                                + Duration::from_secs_f64((end - at) as f64 / rate as f64))
                            .max(Instant::now());
                            std::thread::sleep(next.saturating_duration_since(Instant::now()));
                        }
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
    sender: std::thread::JoinHandle<Vec<Instant>>,
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
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        // 8 MiB: the receiving thread may be starved for seconds on a slow machine, and a
        // datagram its socket drops is the test's loss, not the datapath's.
        let rcvbuf: libc::c_int = 8 << 20;
        // SAFETY: setsockopt on an open socket with an int option of the right size.
        let rc = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&sock),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&raw const rcvbuf).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0, "SO_RCVBUFFORCE: {}", std::io::Error::last_os_error());
        let stop = Arc::new(AtomicBool::new(false));
        let pace = Pace {
            t0: Instant::now(),
            period,
        };
        let receiver = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let mut got = Vec::new();
                let mut buf = [0u8; 2048];
                let (mut heard, mut stopped) = (Instant::now(), None);
                // Until the sender has stopped and nothing came for 5 s since (late arrivals on
                // a slow machine): a silence while the flow runs is the test's to measure, not
                // the receiver's end.
                loop {
                    match sock.recv(&mut buf) {
                        Ok(n) => {
                            assert_eq!(n, Self::LEN, "a datagram changed size");
                            heard = Instant::now();
                            got.push((u32::from_be_bytes(buf[..4].try_into().unwrap()), heard));
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) =>
                        {
                            if stop.load(Ordering::Relaxed) {
                                let since = *stopped.get_or_insert_with(Instant::now);
                                if since.max(heard).elapsed() > Duration::from_secs(5) {
                                    return got;
                                }
                            }
                        }
                        Err(e) => panic!("receive a datagram: {e}"),
                    }
                }
            }
        });
        let sender = std::thread::spawn({
            let (ns, stop) = (a.ns.clone(), stop.clone());
            move || {
                in_netns(&ns, move || {
                    let s = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                    let mut sent = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let mut d = [0u8; Self::LEN];
                        d[..4].copy_from_slice(&(sent.len() as u32).to_be_bytes());
                        // A full socket buffer would block: the rate is the sender's own.
                        sent.push(Instant::now());
                        s.send_to(&d, &addr).expect("send a datagram");
                        let due = pace.due(sent.len() as u32);
                        std::thread::sleep(due.saturating_duration_since(Instant::now()));
                    }
                    sent
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
        let (sent, got) = self.finish_timed();
        (sent.len() as u32, got)
    }

    /// Stops; (when each datagram was sent, each received once with when it came).
    fn finish_timed(self) -> (Vec<Instant>, Vec<(u32, Instant)>) {
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

/// The longest time the count of `samples` did not grow: from the first sample of a run of
/// equal counts to the sample that first shows more (or the last sample).
fn longest_idle(samples: &[(Instant, u64)]) -> Duration {
    let Some(&(mut t0, mut n0)) = samples.first() else {
        return Duration::ZERO;
    };
    let mut idle = Duration::ZERO;
    for &(t, n) in &samples[1..] {
        idle = idle.max(t - t0);
        if n != n0 {
            (t0, n0) = (t, n);
        }
    }
    idle
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

/// `peer` as `n` sees it once more than 1 MiB has gone to it over CM past `since`, or after
/// 15 s (TCP may still be in its retransmission backoff after a fault): the caller asserts.
fn over_cm_past(n: &Node, peer: &str, since: &PeerView) -> PeerView {
    let view = || n.peer(peer).unwrap().expect("the peer in the map");
    wait_until(Duration::from_secs(15), || {
        view().traffic.tx_cm_bytes > since.traffic.tx_cm_bytes + (1 << 20)
    });
    view()
}

/// How long a test waits for a flow's promotion when that is its precondition, not its claim
/// (the promotion tests time it): a slow machine's stream reaches the bulk rate late (more
/// than 15 s seen in the slow-machine mode).
const PROMOTION: Duration = Duration::from_secs(60);

/// A's entry for `b` once it is CM_UP, waited for up to `within`; if it is not, the panic
/// says `what` was expected and shows both nodes' connections and logs.
fn cm_up_within(a: &Node, b: &Node, within: Duration, what: &str) -> PeerView {
    let peer = &b.ip4.to_string();
    a.wait_peer_mode(peer, PeerModeView::CmUp, within)
        .unwrap_or_else(|| {
            panic!(
                "not {what} within {within:?}: A's entry {:?}\nA: {:#?}\nB: {:#?}\nA's log:\n{}\nB's log:\n{}",
                a.peer(peer).ok().flatten(),
                a.cm().ok().flatten(),
                b.cm().ok().flatten().map(|c| (c.connections, c.peers)),
                ctl_log(a),
                ctl_log(b)
            )
        })
}

/// The fault gone (`what`), `b` is back on CM at A within `within` and the flow goes CM
/// again: more than 1 MiB within 15 s (TCP may still be in its retransmission backoff after
/// the fault). Both nodes' logs are printed if not.
fn returns_to_cm(a: &Node, b: &Node, within: Duration, what: &str) {
    let peer = &b.ip4.to_string();
    let t = Instant::now();
    let back = cm_up_within(a, b, within, &format!("back on CM after {what}"));
    eprintln!("{what}: back on CM after {:.1?}", t.elapsed());
    let later = over_cm_past(a, peer, &back);
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
    /// As the CM status has it.
    fn kind(self) -> ReceiveKind {
        match self {
            Recv::Srq => ReceiveKind::Srq,
            Recv::Rings => ReceiveKind::Rings,
        }
    }

    /// As the CM status names it in JSON.
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
    assert_eq!(cm.receive.model, recv.kind(), "{}: {cm:#?}", n.ns);
    pid
}

/// `rdma resource show mr -j` for the process `pid`: its memory regions' (count, bytes).
fn mrs_of(pid: u32) -> (u64, u64) {
    mrs_of_each([pid])[0]
}

/// [`mrs_of`] for several processes from one `rdma` call (each takes seconds under emulation).
fn mrs_of_each<const N: usize>(pids: [u32; N]) -> [(u64, u64); N] {
    let out = ipoib_tests::programs::sh(&["rdma", "resource", "show", "mr", "-j"]);
    let mrs: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("rdma -j");
    pids.map(|pid| {
        mrs.iter()
            .filter(|m| m["pid"].as_u64() == Some(u64::from(pid)))
            .fold((0, 0), |(n, b), m| {
                (n + 1, b + m["mrlen"].as_u64().unwrap_or(0))
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

mod faults;
mod memory;
mod netlink;
mod promotion;
mod queues;
mod rails;
mod soak;
mod watchdog;
