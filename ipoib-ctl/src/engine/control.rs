//! What the engine's users hold and what they say to each other: its configuration, the
//! commands the control plane sends it ([`EngineControl`]), the events it sends back, its
//! counters, the routes, and the faults the tests inject.

use std::{
    collections::HashMap,
    io,
    net::IpAddr,
    os::fd::{AsRawFd, RawFd},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::sync::{mpsc, oneshot};

use crate::verbs::{RcQueuePair, VerbsError};

use super::SendEnd;

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
    #[error("{queues} TUN queues for {lanes} lanes: one engine per lane reads one queue")]
    Lanes { lanes: usize, queues: usize },
    #[error(transparent)]
    Steer(#[from] crate::steer::SteerError),
    #[error("an engine lane: {0}")]
    Lane(String),
}

/// Counters, shared with status and tests.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub tx_packets: AtomicU64,
    pub tx_bytes: AtomicU64,
    /// The longest message posted.
    pub tx_largest: AtomicU64,
    /// Unicast packets for an address with no connection, or whose connection failed (let go
    /// to UD: `tx_sent_ud`).
    pub tx_no_connection: AtomicU64,
    /// Multicast and broadcast packets (dropped: they always go UD; only the kernel's own
    /// chatter on the TUN device, never what the fast path redirects, lands here).
    pub tx_multicast: AtomicU64,
    /// Packets longer than the connection's MTU (let go to UD).
    pub tx_oversize: AtomicU64,
    /// Packets let go to UD: a congested connection's queue met `spare_slots`, or they waited
    /// on a failed QP.
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
    /// Packets let go to UD (counted above under backpressure, no connection or oversize, or
    /// in `send_errors` where the QP refused them): those sent over UD, and those UD could not
    /// take (a GSO packet, one the socket refused, or no socket): lost.
    pub tx_sent_ud: AtomicU64,
    /// Packets let go to UD that UD could not take: lost.
    pub tx_not_sent_ud: AtomicU64,
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
    /// QPs taken down through their drain marker, and those let go without it (no
    /// LAST_WQE_REACHED, no marker completion, or a marker refused, within the bounds).
    pub qps_drained: AtomicU64,
    pub qps_undrained: AtomicU64,
    /// When the engine's loop last ran its housekeeping (monotonic ns): its proof of life,
    /// renewed every [`HOUSEKEEPING`] while the loop turns. Not a counter: not in snapshots.
    pub alive_ns: AtomicU64,
    /// CPU time of the thread the engine runs on since its loop started (ns), renewed at each
    /// housekeeping: what connected mode costs this node. With one lane the control loop
    /// shares the thread, and its tick and handshakes are counted too. Not in snapshots.
    pub cpu_ns: AtomicU64,
}

impl EngineStats {
    pub(super) fn sent(&self, len: usize) {
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
        COUNTERS
            .iter()
            .map(|(name, c)| (*name, c(self).load(Ordering::Relaxed)))
            .collect()
    }

    /// The counters of the engines of several lanes as one: summed (their CPU time too), but
    /// `tx_largest` (the largest of them) and the proof of life (the oldest of them).
    pub fn total<'a>(all: impl IntoIterator<Item = &'a EngineStats>) -> EngineStats {
        let t = EngineStats {
            alive_ns: AtomicU64::new(u64::MAX),
            ..EngineStats::default()
        };
        for s in all {
            for (name, c) in COUNTERS {
                let v = c(s).load(Ordering::Relaxed);
                match *name {
                    "tx_largest" => c(&t).fetch_max(v, Ordering::Relaxed),
                    _ => c(&t).fetch_add(v, Ordering::Relaxed),
                };
            }
            t.alive_ns
                .fetch_min(s.alive_ns.load(Ordering::Relaxed), Ordering::Relaxed);
            t.cpu_ns
                .fetch_add(s.cpu_ns.load(Ordering::Relaxed), Ordering::Relaxed);
        }
        t
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

/// Every counter of [`EngineStats`] by name, in the order lines and snapshots give them.
pub(super) type Counter = fn(&EngineStats) -> &AtomicU64;
pub(super) const COUNTERS: &[(&str, Counter)] = &[
    ("tx_packets", |s| &s.tx_packets),
    ("tx_bytes", |s| &s.tx_bytes),
    ("tx_largest", |s| &s.tx_largest),
    ("tx_no_connection", |s| &s.tx_no_connection),
    ("tx_multicast", |s| &s.tx_multicast),
    ("tx_oversize", |s| &s.tx_oversize),
    ("tx_backpressure", |s| &s.tx_backpressure),
    ("tx_congested", |s| &s.tx_congested),
    ("tx_window_waits", |s| &s.tx_window_waits),
    ("tx_depth_sum", |s| &s.tx_depth_sum),
    ("tx_malformed", |s| &s.tx_malformed),
    ("tx_sent_ud", |s| &s.tx_sent_ud),
    ("tx_not_sent_ud", |s| &s.tx_not_sent_ud),
    ("send_errors", |s| &s.send_errors),
    ("rx_packets", |s| &s.rx_packets),
    ("rx_bytes", |s| &s.rx_bytes),
    ("rx_errors", |s| &s.rx_errors),
    ("rx_flushed", |s| &s.rx_flushed),
    ("rx_tun_errors", |s| &s.rx_tun_errors),
    ("rx_repost_errors", |s| &s.rx_repost_errors),
    ("keepalives_sent", |s| &s.keepalives_sent),
    ("keepalives_received", |s| &s.keepalives_received),
    ("flows", |s| &s.flows),
    ("qps_drained", |s| &s.qps_drained),
    ("qps_undrained", |s| &s.qps_undrained),
];

/// A connection as the engine uses it (the core's tests give it a QP of their own).
#[derive(Clone)]
pub struct Route<Q = Arc<RcQueuePair>> {
    pub qp: Q,
    /// Largest RC message (RFC 4755 connection MTU, 65520 at most).
    pub mtu: u32,
}

impl<Q: SendEnd> std::fmt::Debug for Route<Q> {
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
    /// Stop routing `ip` to QP `qpn` (if that is still its route) once what the engine holds
    /// for it has gone over it (see [`EngineCore::remove_route`]), then let go of `close`: it
    /// fires once every lane has (the QP may be torn down once nothing is posted on it or in
    /// flight).
    RemoveRoute {
        ip: IpAddr,
        qpn: u32,
        close: Option<Arc<CloseWhenDone>>,
    },
    /// A test hook (`attach --test-faults`): break the engine on purpose.
    Fault(Fault),
    /// Answered once every command sent before it has been taken.
    Sync(oneshot::Sender<()>),
    /// A connection's QP, closed (in the error state): held until drained
    /// ([`super::graves`]), then let go.
    Bury(Arc<RcQueuePair>),
    /// IBV_EVENT_QP_LAST_WQE_REACHED for this QP.
    LastWqe(u32),
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
pub(super) async fn inject(f: Fault) {
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

/// Fires its sender when the last lane lets go of it (a route removal sent to every lane).
#[derive(Debug)]
pub struct CloseWhenDone(pub(super) Option<oneshot::Sender<()>>);

impl Drop for CloseWhenDone {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// The control plane's end of the command channels of the engines of one set of lanes, one
/// per lane in lane order (clone freely).
#[derive(Clone)]
pub struct EngineControl(pub(super) Arc<[mpsc::UnboundedSender<EngineCommand>]>);

impl EngineControl {
    /// `ip`'s packets over `route` from now on: told to the engine of the QP's lane.
    pub fn add_route(&self, ip: IpAddr, route: Route) {
        if let Some(lane) = self.0.get(route.qp.lane() as usize) {
            let _ = lane.send(EngineCommand::AddRoute { ip, route });
        }
    }

    /// Removes `ip`'s route to `qpn` on whichever lane has it (told to every lane: a lane
    /// without it lets go at once, the one with it once what it holds for `ip` has gone over
    /// the connection); `close` fires once every lane has (also when an engine has stopped:
    /// the sender is then dropped, which a watcher takes as the same).
    pub fn remove_route(&self, ip: IpAddr, qpn: u32, close: Option<oneshot::Sender<()>>) {
        let close = close.map(|c| Arc::new(CloseWhenDone(Some(c))));
        for lane in self.0.iter() {
            let close = close.clone();
            let _ = lane.send(EngineCommand::RemoveRoute { ip, qpn, close });
        }
    }

    /// `qp`, closed, to the engine of its lane, which holds it until drained.
    pub fn bury(&self, qp: Arc<RcQueuePair>) {
        if let Some(lane) = self.0.get(qp.lane() as usize) {
            let _ = lane.send(EngineCommand::Bury(qp));
        }
    }

    /// LAST_WQE_REACHED for `qpn`, to every lane (the one burying it takes it).
    pub fn last_wqe(&self, qpn: u32) {
        for lane in self.0.iter() {
            let _ = lane.send(EngineCommand::LastWqe(qpn));
        }
    }

    /// Resolves once every lane has taken every command sent before (or has stopped).
    pub async fn sync(&self) {
        let acks: Vec<oneshot::Receiver<()>> = self
            .0
            .iter()
            .map(|lane| {
                let (tx, rx) = oneshot::channel();
                let _ = lane.send(EngineCommand::Sync(tx));
                rx
            })
            .collect();
        for ack in acks {
            let _ = ack.await;
        }
    }

    /// A test hook: breaks every lane's engine (see [`Fault`]).
    pub fn fault(&self, f: Fault) {
        for lane in self.0.iter() {
            let _ = lane.send(EngineCommand::Fault(f));
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Sends in flight per connection (the QPs' `max_send_wr`).
    pub max_send_wr: u32,
    /// Packets waiting per connection, when its sends are all in flight, past which its peer
    /// is sent UD until the queue drains.
    pub backlog: usize,
    /// Send slots a congested connection leaves free for the others (when there are others):
    /// its packets past `backlog` still wait while more are free, and are let go to UD after.
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
    /// A send on this QP completed in error, or a receive did (not flushed), with the
    /// completion's status; or the QP refused a send (`None`): the connection is dead (said
    /// once per QP).
    QpError { qpn: u32, status: Option<u32> },
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
