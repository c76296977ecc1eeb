//! The CM engine: moves packets between the TUN device and RC connections.
//!
//! - Transmit: a packet (virtio-net header + IP packet, a whole GSO super-packet at most
//!   64 KiB) is read from the TUN device straight into a free registered send slot, the one
//!   copy on this side, and posted from there as one RC SEND on the connection of its
//!   destination address. Send completions free the slot.
//! - Receive: every connection receives into the one SRQ, or, on an HCA without one, into a
//!   ring of its own (the receive's work request id names the ring and the slot: see
//!   [`crate::verbs::Receive`]); a receive completion's bytes (the same header + packet the
//!   sender read) are written into the TUN device, and the buffer is posted again at once, on
//!   the SRQ or the connection's ring.
//!
//! The RC message is `[virtio_net_hdr (10 B)][IP packet]`: the GSO type and size travel with
//! the packet, so the receiving stack takes the super-packet whole (no segmentation on either
//! side; the RC transport's ICRC protects the bytes).
//!
//! Backpressure: each connection has at most `max_send_wr` sends in flight; past that its
//! packets wait in a queue (already in their send slot) and are posted as its sends complete.
//! Past `backlog` waiting the engine reports [`EngineEvent::Congested`]: the control plane
//! marks the peer UD, so the next packets go over UD at once; what the engine has already
//! read still goes over the connection, in order, as long as `spare_slots` send slots stay
//! free for the other connections, if any (past that a packet is dropped and counted): a
//! switch to UD loses nothing. [`EngineEvent::Drained`] when the queue is empty again. TUN reads pause
//! while no send slot is free. A send that completes in error, or a receive (not flushed),
//! reports [`EngineEvent::QpError`] once per QP: its flow stays, dead (what is read for it
//! is dropped and counted as without a connection, no keepalive goes), until the control
//! plane takes the route away.
//!
//! One turn of the loop does one thing: a batch of TUN reads (each packet posted as it is
//! read), or completions until the CQ is empty or 20 ms are spent (the sends they
//! release posted at the end, one chain per QP), or a command, or housekeeping.
//!
//! The engine owns its routes (destination address to connection) and its per-QP receive
//! counts: the control plane changes routes with [`EngineCommand`]s through an
//! [`EngineControl`] and hears back [`EngineEvent`]s, so no lock is taken per packet sent. On
//! rings per connection a received message's ring is found in the ring pool's table, behind
//! one uncontended lock (the ring's QP is made and dropped on this same thread).
//!
//! Runs on tokio: AsyncFd on the TUN fd and on the CQ's completion channel.

use std::{
    collections::{HashMap, HashSet, VecDeque, hash_map::Entry},
    io,
    net::IpAddr,
    os::fd::{AsRawFd, RawFd},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use ipoib_common::IPOIB_CM_MTU;
use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::{mpsc, oneshot},
};

use crate::{
    tun::{TUN_READ_MAX, Tun, VNET_HDR_LEN},
    verbs::{Completion, RcQueuePair, Resources, SendRequest, VerbsError, WC_FLUSHED},
};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error("TUN {name}: {source}")]
    Tun {
        name: String,
        #[source]
        source: io::Error,
    },
    #[error("the CQ has no completion channel")]
    NoChannel,
    #[error("send region slots are {stride} B, a packet may need {need} B")]
    SlotTooSmall { stride: u64, need: usize },
}

/// Counters, shared with status and tests.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    /// The longest message posted.
    pub tx_largest: AtomicU64,
    /// Unicast packets for an address with no connection, or whose connection failed
    /// (dropped).
    pub tx_no_connection: AtomicU64,
    /// Multicast and broadcast packets (dropped: they always go UD; only the kernel's own
    /// chatter on the TUN device, never what the fast path redirects, lands here).
    pub tx_multicast: AtomicU64,
    /// Packets longer than the connection's MTU (dropped).
    pub tx_oversize: AtomicU64,
    /// Packets dropped: a congested connection's queue met `spare_slots`, or they waited on a
    /// failed QP.
    pub tx_backpressure: AtomicU64,
    /// Times a connection's queue overflowed and its peer was sent to UD until it drained.
    pub tx_congested: AtomicU64,
    /// Packets that found their connection's window (`max_send_wr` in flight) full and waited
    /// for a completion: none where what the engine is offered, not the window, sets its rate.
    pub tx_window_waits: AtomicU64,
    /// The sum, over data sends, of their connection's sends in flight counting them: over
    /// `tx_packets`, the mean depth the engine sent at (`max_send_wr` when always full).
    pub tx_depth_sum: AtomicU64,
    /// Packets that were not IP (dropped).
    pub tx_malformed: AtomicU64,
    pub send_errors: AtomicU64,
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    /// Receives that failed (not flushed): each one its QP's failure.
    pub rx_errors: AtomicU64,
    /// Receives flushed because their QP was closing or had failed (a connection's ring
    /// flushes its buffers when it closes): not errors.
    pub rx_flushed: AtomicU64,
    /// Writes into the TUN device that failed.
    pub rx_tun_errors: AtomicU64,
    /// Receive buffers the SRQ refused when posted again (each one fewer on the SRQ).
    pub rx_repost_errors: AtomicU64,
    /// Keepalives sent on connections that were idle this way, and received.
    pub keepalives_sent: AtomicU64,
    pub keepalives_received: AtomicU64,
    /// Connections the engine tracks sends for (a gauge; those whose connection is gone and
    /// have nothing in flight are forgotten at the next housekeeping).
    pub flows: AtomicU64,
    /// When the engine's loop last ran its housekeeping (monotonic ns): its proof of life,
    /// renewed every [`HOUSEKEEPING`] while the loop turns. Not a counter: not in snapshots.
    pub alive_ns: AtomicU64,
}

impl EngineStats {
    fn sent(&self, len: usize) {
        self.tx_packets.fetch_add(1, Ordering::Relaxed);
        self.tx_bytes.fetch_add(len as u64, Ordering::Relaxed);
        self.tx_largest.fetch_max(len as u64, Ordering::Relaxed);
    }

    /// How long since the engine's loop last showed life (see `alive_ns`).
    pub fn silent_for(&self, now_ns: u64) -> Duration {
        Duration::from_nanos(now_ns.saturating_sub(self.alive_ns.load(Ordering::Relaxed)))
    }

    /// Every counter by name.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("tx_packets", g(&self.tx_packets)),
            ("tx_bytes", g(&self.tx_bytes)),
            ("tx_largest", g(&self.tx_largest)),
            ("tx_no_connection", g(&self.tx_no_connection)),
            ("tx_multicast", g(&self.tx_multicast)),
            ("tx_oversize", g(&self.tx_oversize)),
            ("tx_backpressure", g(&self.tx_backpressure)),
            ("tx_congested", g(&self.tx_congested)),
            ("tx_window_waits", g(&self.tx_window_waits)),
            ("tx_depth_sum", g(&self.tx_depth_sum)),
            ("tx_malformed", g(&self.tx_malformed)),
            ("send_errors", g(&self.send_errors)),
            ("rx_packets", g(&self.rx_packets)),
            ("rx_bytes", g(&self.rx_bytes)),
            ("rx_errors", g(&self.rx_errors)),
            ("rx_flushed", g(&self.rx_flushed)),
            ("rx_tun_errors", g(&self.rx_tun_errors)),
            ("rx_repost_errors", g(&self.rx_repost_errors)),
            ("keepalives_sent", g(&self.keepalives_sent)),
            ("keepalives_received", g(&self.keepalives_received)),
            ("flows", g(&self.flows)),
        ]
    }

    /// `stats tx_packets=N tx_bytes=N ...`: one line, for logs and test peers.
    pub fn line(&self) -> String {
        let mut s = String::from("stats");
        for (k, v) in self.snapshot() {
            s.push_str(&format!(" {k}={v}"));
        }
        s
    }

    /// Parses [`EngineStats::line`] back.
    pub fn parse_line(line: &str) -> Option<HashMap<String, u64>> {
        let rest = line.strip_prefix("stats")?;
        rest.split_whitespace()
            .map(|kv| {
                let (k, v) = kv.split_once('=')?;
                Some((k.to_string(), v.parse().ok()?))
            })
            .collect()
    }
}

/// A connection as the engine uses it.
#[derive(Clone)]
pub struct Route {
    pub qp: Arc<RcQueuePair>,
    /// Largest RC message (RFC 4755 connection MTU, 65520 at most).
    pub mtu: u32,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Route(QP {}, MTU {})", self.qp.qpn(), self.mtu)
    }
}

/// What the control plane tells the engine.
#[derive(Debug)]
pub enum EngineCommand {
    /// Send `ip`'s packets over this connection from now on; answered with
    /// [`EngineEvent::RouteAdded`].
    AddRoute { ip: IpAddr, route: Route },
    /// Stop routing `ip` to QP `qpn` (if that is still its route), then fire `close`: the QP
    /// may be torn down once nothing new is posted on it.
    RemoveRoute {
        ip: IpAddr,
        qpn: u32,
        close: Option<oneshot::Sender<()>>,
    },
    /// A test hook (`attach --test-faults`): break the engine on purpose.
    Fault(Fault),
}

/// How a test breaks the engine, to prove the control loop catches each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Its task panics (tokio keeps the runtime; the task is gone).
    Panic,
    /// Its task awaits forever (the runtime turns; the engine moves nothing).
    Stall,
    /// It blocks the runtime's thread (nothing on that thread turns any more).
    Hang,
    /// Its task takes nothing for this many milliseconds, then goes on (a busy receiver: its
    /// receive buffers run dry meanwhile).
    Pause(u64),
}

impl std::str::FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "panic" => Ok(Fault::Panic),
            "stall" => Ok(Fault::Stall),
            "hang" => Ok(Fault::Hang),
            other => match other.strip_prefix("pause ").map(|ms| ms.trim().parse()) {
                Some(Ok(ms)) => Ok(Fault::Pause(ms)),
                _ => Err(format!(
                    "unknown fault `{other}` (panic, stall, hang, pause MS)"
                )),
            },
        }
    }
}

/// Breaks the engine as `f` says (returns only after a pause).
async fn inject(f: Fault) {
    tracing::warn!("test fault: engine {f:?}");
    match f {
        Fault::Panic => panic!("test fault: engine panic"),
        Fault::Stall => std::future::pending::<()>().await,
        Fault::Hang => loop {
            std::thread::sleep(Duration::from_secs(1));
        },
        Fault::Pause(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
    }
}

/// The control plane's end of the engine's command channel (clone freely).
#[derive(Clone)]
pub struct EngineControl(mpsc::UnboundedSender<EngineCommand>);

impl EngineControl {
    pub fn add_route(&self, ip: IpAddr, route: Route) {
        let _ = self.0.send(EngineCommand::AddRoute { ip, route });
    }

    /// Removes `ip`'s route to `qpn`; `close` fires once it is gone (also when the engine
    /// has stopped: the sender is then dropped, which a watcher takes as the same).
    pub fn remove_route(&self, ip: IpAddr, qpn: u32, close: Option<oneshot::Sender<()>>) {
        let _ = self.0.send(EngineCommand::RemoveRoute { ip, qpn, close });
    }

    /// A test hook: breaks the engine (see [`Fault`]).
    pub fn fault(&self, f: Fault) {
        let _ = self.0.send(EngineCommand::Fault(f));
    }
}

pub struct EngineConfig {
    /// Sends in flight per connection (the QPs' `max_send_wr`).
    pub max_send_wr: u32,
    /// Packets waiting per connection, when its sends are all in flight, past which its peer
    /// is sent UD until the queue drains.
    pub backlog: usize,
    /// Send slots a congested connection leaves free for the others (when there are others):
    /// its packets past `backlog` still wait while more are free, and are dropped after.
    pub spare_slots: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_send_wr: crate::plan::SEND_WINDOW,
            backlog: 128,
            spare_slots: 32,
        }
    }
}

/// A raw fd owned elsewhere, for `AsyncFd` (the owner must outlive the registration).
pub(crate) struct RawFdRef(pub(crate) RawFd);
impl AsRawFd for RawFdRef {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// What the engine tells the control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// A send on this QP completed in error, or a receive did (not flushed): the connection
    /// is dead (said once per QP).
    QpError { qpn: u32, status: u32 },
    /// The connection's queue overflowed: its traffic should go UD for now.
    Congested(IpAddr),
    /// Its queue drained after [`EngineEvent::Congested`]: CM again.
    Drained(IpAddr),
    /// The route of [`EngineCommand::AddRoute`] is in place.
    RouteAdded { ip: IpAddr, qpn: u32 },
    /// Bytes received so far on each routed QP (totals), sent when any changed.
    Received(Vec<(u32, u64)>),
    /// Keepalives received so far on each routed QP (totals), sent when any changed: the
    /// peer's engine runs. Apart from [`EngineEvent::Received`], which measures traffic (an
    /// idle connection is still reaped).
    Keepalives(Vec<(u32, u64)>),
}

/// Per-connection send state, by QP number.
struct Flow {
    dst: IpAddr,
    qp: Arc<RcQueuePair>,
    in_flight: u32,
    /// Filled send slots waiting to be posted, and their lengths.
    waiting: VecDeque<(u32, u32)>,
    congested: bool,
    dead: bool,
}

impl Flow {
    fn new(dst: IpAddr, qp: Arc<RcQueuePair>) -> Self {
        Self {
            dst,
            qp,
            in_flight: 0,
            waiting: VecDeque::new(),
            congested: false,
            dead: false,
        }
    }

    /// One more data send in flight, its depth counted (`tx_depth_sum`).
    fn admit(&mut self, stats: &EngineStats) {
        self.in_flight += 1;
        stats
            .tx_depth_sum
            .fetch_add(u64::from(self.in_flight), Ordering::Relaxed);
    }
}

pub struct Engine {
    /// Where a TUN read puts what does not fit in a send slot (the packet is then dropped as
    /// oversize): a packet longer than the read's buffers would fail the read.
    spill: Vec<u8>,
    tun: Tun,
    core: Core,
    commands: mpsc::UnboundedReceiver<EngineCommand>,
    control: EngineControl,
}

/// A count per QP, reported to the control plane as totals at the housekeeping after any
/// changed.
#[derive(Default)]
struct Totals {
    by_qp: HashMap<u32, u64>,
    changed: bool,
}

impl Totals {
    fn add(&mut self, qpn: u32, n: u64) {
        *self.by_qp.entry(qpn).or_default() += n;
        self.changed = true;
    }

    fn forget(&mut self, qpn: u32) {
        self.by_qp.remove(&qpn);
    }

    /// Keeps only the QPs in `live`.
    fn retain(&mut self, live: &HashSet<u32>) {
        self.by_qp.retain(|qpn, _| live.contains(qpn));
    }

    /// Every total, once after a change.
    fn report(&mut self) -> Option<Vec<(u32, u64)>> {
        std::mem::take(&mut self.changed)
            .then(|| self.by_qp.iter().map(|(q, n)| (*q, *n)).collect())
    }
}

/// Which counter a dropped packet is counted under.
type Dropped = fn(&EngineStats) -> &AtomicU64;

/// Everything but the TUN device, so the TUN's readiness can be borrowed while packets move.
struct Core {
    res: Arc<Resources>,
    cfg: EngineConfig,
    stats: Arc<EngineStats>,
    free: Vec<u32>,
    routes: HashMap<IpAddr, Route>,
    flows: HashMap<u32, Flow>,
    /// Bytes received per QP, and keepalives received per QP.
    rx_by_qp: Totals,
    keepalives_by_qp: Totals,
    /// QPs something was sent on since the last housekeeping (the others get a keepalive).
    sent_on: HashSet<u32>,
    /// Sends decided and not yet posted (QP number, request): posted by [`Core::flush`], one
    /// chain per QP, after each read ([`READ_CHAIN`]) and at the end of a completion turn.
    outbox: Vec<(u32, SendRequest)>,
    /// One QP's part of the outbox while it is posted (kept to reuse its memory).
    chain: Vec<SendRequest>,
    /// The completions of one poll, kept to reuse its memory.
    wcs: Vec<Completion>,
    events: Option<mpsc::UnboundedSender<EngineEvent>>,
}

/// A send of the first `len` bytes of send slot `slot`, named by its slot.
fn request(slot: u32, len: u32) -> SendRequest {
    SendRequest {
        slot,
        len,
        wr_id: u64::from(slot),
    }
}

/// The destination address of an IP packet.
fn destination(pkt: &[u8]) -> Option<IpAddr> {
    match pkt.first()? >> 4 {
        4 => {
            let a: [u8; 4] = pkt.get(16..20)?.try_into().ok()?;
            Some(IpAddr::from(a))
        }
        6 => {
            let a: [u8; 16] = pkt.get(24..40)?.try_into().ok()?;
            Some(IpAddr::from(a))
        }
        _ => None,
    }
}

/// How often flows of gone connections are forgotten, receive totals reported and the
/// engine's proof of life renewed.
pub const HOUSEKEEPING: Duration = Duration::from_millis(500);

/// Packets read from the TUN device per turn of the loop, at most.
const READ_BATCH: usize = 64;

/// Packets read from the TUN device posted together, at most: one, each posted as soon as it
/// is read. Measured (`bench engine --baseline-rings`, soft-RoCE): chains of up to 64 made CM
/// on rings per connection collapse in 10 of 25 rounds (116-213 Mbit/s against about 300,
/// its super-packets shrinking to 14-22 KB; no RNR NAKs), where the build that posted each
/// packet never did in 10, nor this one with a chain of 1 in 10. Why is not known; what a
/// long chain saves (a post call per packet) is not worth it.
const READ_CHAIN: usize = 1;

/// Completions taken per poll.
const POLL_BATCH: usize = 64;
/// How long one turn may take completions before the loop's other work: a receiver that
/// never finds its CQ empty still reads, takes commands and keeps its connections alive
/// (housekeeping every [`HOUSEKEEPING`]). Time, not a count: short of it the CQ is drained
/// as it fills, as the engine always did, and each receive buffer is posted again as soon as
/// its message is taken.
const TURN_BUDGET: Duration = Duration::from_millis(20);

/// A keepalive's length on the wire: the TUN's virtio-net header and nothing after it.
pub const KEEPALIVE_LEN: usize = VNET_HDR_LEN;

impl Engine {
    /// `tun` must be non-blocking; `res` must have one CQ for sends and receives, with a
    /// completion channel, and send slots of at least one CM message (65520 B). A packet
    /// longer than its connection's MTU is dropped and counted (`tx_oversize`): the route's
    /// device must keep GSO packets below it (gso_max_size).
    pub fn new(tun: Tun, res: Arc<Resources>, cfg: EngineConfig) -> Result<Self, EngineError> {
        if res.send.stride < u64::from(IPOIB_CM_MTU) {
            return Err(EngineError::SlotTooSmall {
                stride: res.send.stride,
                need: IPOIB_CM_MTU as usize,
            });
        }
        if res.recv_cq.channel_fd().is_none() || !Arc::ptr_eq(&res.send_cq, &res.recv_cq) {
            return Err(EngineError::NoChannel);
        }
        let free = (0..res.send.count).rev().collect();
        let (tx, commands) = mpsc::unbounded_channel();
        let stats = Arc::new(EngineStats::default());
        stats
            .alive_ns
            .store(crate::clock::monotonic_ns(), Ordering::Relaxed);
        Ok(Self {
            spill: vec![0; TUN_READ_MAX],
            tun,
            core: Core {
                res,
                cfg,
                stats,
                free,
                routes: HashMap::new(),
                flows: HashMap::new(),
                rx_by_qp: Totals::default(),
                keepalives_by_qp: Totals::default(),
                sent_on: HashSet::new(),
                outbox: Vec::with_capacity(2 * READ_BATCH),
                chain: Vec::with_capacity(2 * READ_BATCH),
                wcs: Vec::with_capacity(POLL_BATCH),
                events: None,
            },
            commands,
            control: EngineControl(tx),
        })
    }

    pub fn stats(&self) -> Arc<EngineStats> {
        self.core.stats.clone()
    }

    /// Where QP errors, congestion, routes added and receive totals are reported.
    pub fn events(&mut self) -> mpsc::UnboundedReceiver<EngineEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.core.events = Some(tx);
        rx
    }

    /// How the control plane adds and removes routes (commands are taken while `run` runs).
    pub fn control(&self) -> EngineControl {
        self.control.clone()
    }

    pub fn tun_name(&self) -> &str {
        self.tun.name()
    }

    fn tun_err(&self) -> impl Fn(io::Error) -> EngineError + use<> {
        let name = self.tun.name().to_string();
        move |source| EngineError::Tun {
            name: name.clone(),
            source,
        }
    }

    /// Runs until `stop` resolves (or an error). Commands, completions and TUN packets are
    /// handled as they come. Must be called inside a tokio runtime.
    pub async fn run(
        &mut self,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<(), EngineError> {
        let tun_err = self.tun_err();
        let fd = self
            .core
            .res
            .recv_cq
            .channel_fd()
            .ok_or(EngineError::NoChannel)?;
        // SAFETY: both fds stay open for as long as the AsyncFds live: the channel is owned by
        // the CQ in `core.res` and the TUN fd by `self.tun`, both outliving this function.
        let channel = unsafe { AsyncFd::register_with_interest(RawFdRef(fd), Interest::READABLE) }
            .map_err(|e| tun_err(e.into_parts().1))?;
        let tun = unsafe {
            AsyncFd::register_with_interest(RawFdRef(self.tun.as_raw_fd()), Interest::READABLE)
        }
        .map_err(|e| tun_err(e.into_parts().1))?;
        self.core.res.recv_cq.arm()?;
        // Completions left for the next turn (the last turn took its share and stopped).
        let mut more = self.core.completions(&self.tun)?;
        tokio::pin!(stop);
        let mut housekeeping = crate::clock::delayed_interval(HOUSEKEEPING);
        loop {
            let can_send = !self.core.free.is_empty();
            tokio::select! {
                _ = &mut stop => return Ok(()),
                Some(c) = self.commands.recv() => {
                    if let EngineCommand::Fault(f) = c {
                        inject(f).await;
                    }
                    self.core.command(c);
                }
                _ = housekeeping.tick() => self.core.housekeeping(),
                g = channel.readable() => {
                    let mut g = g.map_err(&tun_err)?;
                    let cq = &self.core.res.recv_cq;
                    while cq.wait(Duration::ZERO)? {}
                    g.clear_ready();
                    cq.arm()?;
                    more = self.core.completions(&self.tun)?;
                }
                // What the CQ still held after the last turn's share: taken after the other
                // branches had their chance (select picks among the ready at random) and the
                // runtime too. The yield is what lets the control loop, which shares this
                // thread, run between turns: a future that is always ready never gives the
                // thread back (seen: a peer taken for dead, its keepalives unread for 3.9 s,
                // under four bulk streams in the VM).
                () = tokio::task::yield_now(), if more => {
                    more = self.core.completions(&self.tun)?;
                }
                g = tun.readable(), if can_send => {
                    let mut g = g.map_err(&tun_err)?;
                    if self.read_batch().map_err(&tun_err)? {
                        g.clear_ready();
                    }
                }
            }
        }
    }

    /// Up to [`READ_BATCH`] packets from the TUN device, each read into a free send slot and
    /// sent from there to its connection (posted in chains of [`READ_CHAIN`]); true when the
    /// device has no more (its readiness is then cleared).
    fn read_batch(&mut self) -> io::Result<bool> {
        let r = self.read_some();
        self.core.flush();
        r
    }

    fn read_some(&mut self) -> io::Result<bool> {
        for _ in 0..READ_BATCH {
            let Some(slot) = self.core.free.pop() else {
                return Ok(false);
            };
            // SAFETY: the slot was free: nothing posted uses it until it is posted by
            // `transmit` (or given back to `free`), after this slice's last use.
            let buf = unsafe { self.core.res.send.slot(slot) };
            let room = buf.len();
            let read = self.tun.recv_vectored(&mut [
                io::IoSliceMut::new(buf),
                io::IoSliceMut::new(&mut self.spill),
            ]);
            match read {
                Ok(n) if n <= room => {
                    self.core.transmit(slot, n);
                    if self.core.outbox.len() >= READ_CHAIN {
                        self.core.flush();
                    }
                }
                Ok(_) => {
                    self.core.free.push(slot);
                    Core::count(&self.core.stats.tx_oversize);
                }
                Err(e) => {
                    self.core.free.push(slot);
                    if e.kind() == io::ErrorKind::WouldBlock {
                        return Ok(true);
                    }
                    return Err(e);
                }
            }
        }
        Ok(false)
    }
}

impl Core {
    fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    fn tell(&self, e: EngineEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(e);
        }
    }

    fn command(&mut self, c: EngineCommand) {
        match c {
            EngineCommand::AddRoute { ip, route } => {
                let qpn = route.qp.qpn();
                self.routes.insert(ip, route);
                self.tell(EngineEvent::RouteAdded { ip, qpn });
            }
            EngineCommand::Fault(_) => {}
            EngineCommand::RemoveRoute { ip, qpn, close } => {
                if self.routes.get(&ip).is_some_and(|r| r.qp.qpn() == qpn) {
                    self.routes.remove(&ip);
                }
                self.rx_by_qp.forget(qpn);
                self.keepalives_by_qp.forget(qpn);
                if let Some(close) = close {
                    let _ = close.send(());
                }
            }
        }
    }

    /// Forgets the flows of connections that are gone (no longer routed to their QP) and have
    /// nothing in flight or waiting: a connection closed while idle gets no completion that
    /// would remove its flow. Reports the receive totals when they changed.
    fn housekeeping(&mut self) {
        self.stats
            .alive_ns
            .store(crate::clock::monotonic_ns(), Ordering::Relaxed);
        let routes = &self.routes;
        let routed = |ip: &IpAddr, qpn: u32| routes.get(ip).is_some_and(|r| r.qp.qpn() == qpn);
        self.flows
            .retain(|qpn, f| f.in_flight > 0 || !f.waiting.is_empty() || routed(&f.dst, *qpn));
        let live: HashSet<u32> = routes.values().map(|r| r.qp.qpn()).collect();
        self.rx_by_qp.retain(&live);
        self.keepalives_by_qp.retain(&live);
        self.stats
            .flows
            .store(self.flows.len() as u64, Ordering::Relaxed);
        if let Some(totals) = self.rx_by_qp.report() {
            self.tell(EngineEvent::Received(totals));
        }
        if let Some(totals) = self.keepalives_by_qp.report() {
            self.tell(EngineEvent::Keepalives(totals));
        }
        self.send_keepalives();
    }

    /// A keepalive on every connection nothing was sent on since the last housekeeping: a
    /// message of [`KEEPALIVE_LEN`] zero bytes (no IP packet is that short), which the peer's
    /// engine counts and drops. It tells the peer that this engine runs, over the connection
    /// itself: a one-way stream's receiver sends nothing else on it, and the handshake
    /// stream's keepalive goes UD, which drops under load. Skipped where the queue is full or
    /// no slot is free (the peer is then hearing from this end anyway).
    fn send_keepalives(&mut self) {
        let sent = std::mem::take(&mut self.sent_on);
        let idle: Vec<(IpAddr, u32)> = self
            .routes
            .iter()
            .map(|(ip, r)| (*ip, r.qp.qpn()))
            .filter(|(_, qpn)| !sent.contains(qpn))
            .collect();
        for (ip, qpn) in idle {
            let qp = &self.routes[&ip].qp;
            let flow = self
                .flows
                .entry(qpn)
                .or_insert_with(|| Flow::new(ip, qp.clone()));
            if flow.dead || flow.in_flight >= self.cfg.max_send_wr {
                continue;
            }
            let Some(slot) = self.free.pop() else {
                return;
            };
            let send = &self.res.send;
            // SAFETY: the slot was free: nothing posted uses it until its send completes.
            unsafe { send.slot(slot)[..KEEPALIVE_LEN].fill(0) };
            match flow
                .qp
                .post_send(send, slot, KEEPALIVE_LEN as u32, u64::from(slot))
            {
                Ok(()) => {
                    flow.in_flight += 1;
                    Self::count(&self.stats.keepalives_sent);
                }
                Err(e) => {
                    self.free.push(slot);
                    tracing::debug!("keepalive to {ip}: {e}");
                }
            }
        }
    }

    /// The packet read into send slot `slot` (`len` bytes): to its connection. The slot is
    /// posted, queued, or given back free with the reason counted.
    fn transmit(&mut self, slot: u32, len: usize) {
        if let Err(why) = self.post_or_queue(slot, len) {
            self.free.push(slot);
            Self::count(why(&self.stats));
        }
    }

    /// Posts the packet in `slot`, or queues it behind its connection's sends in flight; else
    /// the counter of why it is dropped.
    fn post_or_queue(&mut self, slot: u32, len: usize) -> Result<(), Dropped> {
        let send = &self.res.send;
        // SAFETY: the slot is this packet's: taken from `free` and not posted yet.
        let msg = unsafe { &send.slot(slot)[..len] };
        let Some(dst) = msg.get(VNET_HDR_LEN..).and_then(destination) else {
            return Err(|s| &s.tx_malformed);
        };
        let multicast = match dst {
            IpAddr::V4(a) => a.is_multicast() || a.is_broadcast(),
            IpAddr::V6(a) => a.is_multicast(),
        };
        if multicast {
            return Err(|s| &s.tx_multicast);
        }
        let Some(route) = self.routes.get(&dst) else {
            return Err(|s| &s.tx_no_connection);
        };
        if len > route.mtu as usize {
            return Err(|s| &s.tx_oversize);
        }
        let qpn = route.qp.qpn();
        let flow = self
            .flows
            .entry(qpn)
            .or_insert_with(|| Flow::new(dst, route.qp.clone()));
        if flow.dead {
            // Reported; its route goes when the control plane hears of it.
            return Err(|s| &s.tx_no_connection);
        }
        let full = flow.in_flight >= self.cfg.max_send_wr;
        // Past the bound the next packets go UD until the queue drains; this one, already
        // read, still waits its turn while slots are left for the other connections.
        if full && flow.waiting.len() >= self.cfg.backlog {
            // Slots are kept back only where another connection may need them.
            let keep = self.routes.len() < 2 || self.free.len() >= self.cfg.spare_slots;
            if keep {
                flow.waiting.push_back((slot, len as u32));
                Self::count(&self.stats.tx_window_waits);
            }
            if !std::mem::replace(&mut flow.congested, true) {
                Self::count(&self.stats.tx_congested);
                self.tell(EngineEvent::Congested(dst));
            }
            return if keep {
                Ok(())
            } else {
                Err(|s| &s.tx_backpressure)
            };
        }
        if full {
            flow.waiting.push_back((slot, len as u32));
            Self::count(&self.stats.tx_window_waits);
            return Ok(());
        }
        flow.admit(&self.stats);
        self.outbox.push((qpn, request(slot, len as u32)));
        Ok(())
    }

    /// Posts the turn's sends: one chain per QP, in the order they were decided. A send its
    /// QP did not take gives its slot back, counted as a send error; one it took counts as
    /// sent.
    fn flush(&mut self) {
        if self.outbox.is_empty() {
            return;
        }
        // Stable: each QP's sends keep their order.
        self.outbox.sort_by_key(|(qpn, _)| *qpn);
        let mut chain = std::mem::take(&mut self.chain);
        let mut rest = &self.outbox[..];
        while let Some(&(qpn, _)) = rest.first() {
            let n = rest.iter().take_while(|(q, _)| *q == qpn).count();
            chain.clear();
            chain.extend(rest[..n].iter().map(|(_, r)| *r));
            rest = &rest[n..];
            // Every send in the outbox was counted in flight on its flow, so the flow is
            // still there; a send error taken in the same turn killed it: those wait no more.
            let Some(flow) = self.flows.get_mut(&qpn).filter(|f| !f.dead) else {
                for r in &chain {
                    self.free.push(r.slot);
                    Self::count(&self.stats.tx_backpressure);
                }
                if let Some(f) = self.flows.get_mut(&qpn) {
                    f.in_flight = f.in_flight.saturating_sub(chain.len() as u32);
                }
                continue;
            };
            let (posted, result) = flow.qp.post_sends(&self.res.send, &chain);
            for r in &chain[..posted] {
                self.stats.sent(r.len as usize);
            }
            if posted > 0 {
                self.sent_on.insert(qpn);
            }
            if let Err(e) = result {
                tracing::debug!("post_send to {}: {e}", flow.dst);
                for r in &chain[posted..] {
                    flow.in_flight -= 1;
                    self.free.push(r.slot);
                    Self::count(&self.stats.send_errors);
                }
            }
        }
        self.outbox.clear();
        self.chain = chain;
    }

    /// Takes completions, receives and sends apart, until the CQ is empty or the turn's
    /// [`TURN_BUDGET`] is spent, then posts the sends they freed room for; true when the CQ
    /// may hold more.
    fn completions(&mut self, tun: &Tun) -> Result<bool, EngineError> {
        let mut wcs = std::mem::take(&mut self.wcs);
        let mut result = Ok(true);
        let start = std::time::Instant::now();
        while start.elapsed() < TURN_BUDGET {
            let n = match self.res.recv_cq.poll(&mut wcs, POLL_BATCH) {
                Ok(n) => n,
                Err(e) => {
                    result = Err(e.into());
                    break;
                }
            };
            for wc in &wcs {
                if wc.recv {
                    if let Err(e) = self.on_receive(tun, wc) {
                        result = Err(e);
                        break;
                    }
                } else {
                    self.on_send_done(wc);
                }
            }
            if result.is_err() {
                break;
            }
            if n < POLL_BATCH {
                result = Ok(false);
                break;
            }
        }
        self.wcs = wcs;
        self.flush();
        result
    }

    /// A receive completed: its message into the TUN device, and its buffer posted again on
    /// the SRQ or its connection's ring. A ring's receive flushed in error is not posted again
    /// (its QP is going), nor one whose ring is already gone.
    fn on_receive(&mut self, tun: &Tun, wc: &Completion) -> Result<(), EngineError> {
        let flushed = wc.error == Some(WC_FLUSHED);
        let Some(buf) = self.res.recv.filled(wc) else {
            // Its ring is gone: a flush after the QP was torn down, or an id of nothing.
            Self::count(if flushed {
                &self.stats.rx_flushed
            } else {
                &self.stats.rx_errors
            });
            return Ok(());
        };
        let on_ring = buf.qp().is_some();
        if let Some(status) = wc.error {
            if flushed {
                Self::count(&self.stats.rx_flushed);
            } else {
                Self::count(&self.stats.rx_errors);
                self.on_receive_failed(wc.qp_num, status);
            }
            if on_ring {
                return Ok(());
            }
        } else if buf.bytes().len() <= KEEPALIVE_LEN {
            Self::count(&self.stats.keepalives_received);
            self.keepalives_by_qp.add(wc.qp_num, 1);
        } else if tun.send(buf.bytes()).is_err() {
            Self::count(&self.stats.rx_tun_errors);
        } else {
            self.stats.rx_packets.fetch_add(1, Ordering::Relaxed);
            let bytes = u64::from(wc.bytes);
            self.stats.rx_bytes.fetch_add(bytes, Ordering::Relaxed);
            self.rx_by_qp.add(wc.qp_num, bytes);
        }
        match buf.repost() {
            Ok(()) => Ok(()),
            // A ring whose QP went to the error state takes no receives: the connection is
            // going, and the control plane hears of it from the QP.
            Err(e) if on_ring => {
                tracing::debug!("reposting on QP {}: {e}", wc.qp_num);
                Ok(())
            }
            // The SRQ refused the buffer: it holds one fewer (its limit event says when it runs
            // low). Counted and said, not fatal: stopping the engine would stop connected mode
            // on this node for good, for one buffer.
            Err(e) => {
                Self::count(&self.stats.rx_repost_errors);
                tracing::warn!("reposting a receive buffer on the SRQ: {e}");
                Ok(())
            }
        }
    }

    /// A receive on `qpn` failed on its own (a message longer than its buffer, a protocol
    /// error: not a flush, which only follows a failure): the QP is in error, as a failed send
    /// says, and is reported the same way, once, its flow marked dead (no more sends posted).
    fn on_receive_failed(&mut self, qpn: u32, status: u32) {
        let flow = match self.flows.entry(qpn) {
            Entry::Occupied(f) => f.into_mut(),
            Entry::Vacant(v) => {
                let Some((ip, r)) = self.routes.iter().find(|(_, r)| r.qp.qpn() == qpn) else {
                    // Not routed (closed already): nobody to tell.
                    return;
                };
                v.insert(Flow::new(*ip, r.qp.clone()))
            }
        };
        if !std::mem::replace(&mut flow.dead, true) {
            self.tell(EngineEvent::QpError { qpn, status });
        }
    }

    /// A send completed: its slot is free, and a waiting packet of the same connection goes.
    /// In error, the QP is dead: what waits for it is dropped and it is reported once.
    fn on_send_done(&mut self, wc: &Completion) {
        if wc.error.is_some() {
            Self::count(&self.stats.send_errors);
        }
        self.free.push(wc.wr_id as u32);
        let Some(flow) = self.flows.get_mut(&wc.qp_num) else {
            return;
        };
        flow.in_flight = flow.in_flight.saturating_sub(1);
        if let Some(status) = wc.error {
            for (s, _) in flow.waiting.drain(..) {
                self.free.push(s);
                Self::count(&self.stats.tx_backpressure);
            }
            // Kept, dead, until housekeeping finds it unrouted with every send back (its QP
            // alive till then, so its number is not another's).
            if !std::mem::replace(&mut flow.dead, true) {
                let qpn = wc.qp_num;
                self.tell(EngineEvent::QpError { qpn, status });
            }
            return;
        }
        if let Some((s, len)) = flow.waiting.pop_front() {
            // Posted at the end of the turn while its destination is still routed to this QP.
            let routed = self
                .routes
                .get(&flow.dst)
                .is_some_and(|r| r.qp.qpn() == wc.qp_num);
            if routed {
                flow.admit(&self.stats);
                self.outbox.push((wc.qp_num, request(s, len)));
            } else {
                self.free.push(s);
                Self::count(&self.stats.tx_no_connection);
            }
        }
        if flow.congested && flow.waiting.is_empty() {
            flow.congested = false;
            let dst = flow.dst;
            self.tell(EngineEvent::Drained(dst));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_are_reported_once_after_a_change_and_only_for_live_qps() {
        let mut t = Totals::default();
        assert_eq!(t.report(), None);
        t.add(7, 100);
        t.add(7, 20);
        t.add(9, 1);
        let mut r = t.report().unwrap();
        r.sort_unstable();
        assert_eq!(r, vec![(7, 120), (9, 1)]);
        assert_eq!(t.report(), None, "reported again without a change");
        t.retain(&HashSet::from([9]));
        t.add(9, 1);
        assert_eq!(t.report(), Some(vec![(9, 2)]));
        t.forget(9);
        t.add(9, 5);
        assert_eq!(t.report(), Some(vec![(9, 5)]));
    }

    #[test]
    fn faults_parse_by_name() {
        assert_eq!("panic".parse(), Ok(Fault::Panic));
        assert_eq!(" stall\n".parse(), Ok(Fault::Stall));
        assert_eq!("hang".parse(), Ok(Fault::Hang));
        assert_eq!("pause 2000\n".parse(), Ok(Fault::Pause(2000)));
        assert!("crash".parse::<Fault>().is_err());
        assert!("pause".parse::<Fault>().is_err());
        assert!("pause soon".parse::<Fault>().is_err());
    }

    #[test]
    fn silence_is_measured_from_the_last_proof_of_life() {
        let s = EngineStats::default();
        s.alive_ns.store(5_000_000_000, Ordering::Relaxed);
        assert_eq!(s.silent_for(6_500_000_000), Duration::from_millis(1500));
        assert_eq!(s.silent_for(4_000_000_000), Duration::ZERO);
    }

    #[test]
    fn destination_of_v4_and_v6_packets() {
        let mut v4 = [0u8; 20];
        v4[0] = 0x45;
        v4[16..20].copy_from_slice(&[10, 98, 0, 2]);
        assert_eq!(destination(&v4), Some("10.98.0.2".parse().unwrap()));
        let mut v6 = [0u8; 40];
        v6[0] = 0x60;
        v6[24..40].copy_from_slice(&"fd00::2".parse::<std::net::Ipv6Addr>().unwrap().octets());
        assert_eq!(destination(&v6), Some("fd00::2".parse().unwrap()));
        assert_eq!(destination(&v4[..19]), None);
        assert_eq!(destination(&[0x50; 40]), None);
        assert_eq!(destination(&[]), None);
    }
}
