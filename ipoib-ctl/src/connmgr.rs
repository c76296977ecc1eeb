//! Connected mode inside `attach`: the [`Manager`] owns what connected mode runs on (verbs
//! resources sized by the memory plan, the TUN device and the [`engine`](crate::engine), the
//! handshake listener, the device's asynchronous events) and carries out what its I/O-free
//! [`Core`] decides. Each source of input is one branch of [`Manager::next_input`] and one
//! `on_*` method; each decision is a [`Command`] that [`Manager::execute`] performs in order.
//!
//! It writes the fast path's peer map: a peer becomes `CM_UP` (redirected to the TUN device)
//! only once the engine has its route, and goes back to `UD` before the route goes and the
//! connection is closed, so nothing is redirected into a dead connection.
//!
//! Runs inside the control loop's one runtime ([`crate::daemon`]), the engine as a task of it.

mod core;
mod engine_task;
mod error;
mod start;

pub use self::error::CmError;

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use ipoib_common::{PeerEntry, PeerKey, PeerMode};
use tokio::{
    io::unix::AsyncFd,
    sync::{mpsc, oneshot},
    task::JoinHandle,
};

pub use self::core::{CmPeer, Command, Core, TickInput, Traffic};
use self::engine_task::{EngineTask, stop_engine, task_end};
use self::start::{cap, pins};
pub use self::start::{listen, live_cap, probe};
use crate::{
    clock::monotonic_ns,
    cm::{Cm, Connection, Gone, Resolve, SetupError},
    engine::{EngineEvent, EngineStats, Fault, HOUSEKEEPING, RawFdRef, Route},
    ledger::Ledger,
    maps::DatapathMaps,
    netdev, path,
    plan::SrqChoice,
    policy::Mode,
    promotion::{Config as PromotionConfig, Failure, UdPath},
    rtnl::{AddressMirror, Rtnl},
    status::cm::{CmStatus, FailureStatus, NodeBudget, PeerStatus, ReceiveKind, ReceiveStatus},
    tun::Tun,
    verbs::{self, AsyncEvent, Device, Receive, Resources},
};

/// What `attach` passes in.
#[derive(Debug, Clone)]
pub struct CmOptions {
    /// The RDMA device and port under the interface.
    pub device: String,
    pub port: u8,
    /// The interface's partition (its P_Key, from sysfs on IPoIB); None: the default
    /// partition, at index 0 of the port's P_Key table.
    pub pkey: Option<u16>,
    /// Our UD QPN (the interface's hardware address; the lab's stand-in).
    pub ud_qpn: u32,
    pub resolve: Resolve,
    /// The handshake's TCP port (policy `ctl-port`).
    pub ctl_port: u16,
    /// Policy `memory-budget` (this interface's part of the node's budget at most), or None.
    pub memory_budget: Option<u64>,
    /// `--node-memory-budget`, or None for the automatic rule (1/64 of system memory).
    pub node_budget: Option<u64>,
    /// Whether the HCA's SRQ may be used (`attach --srq`).
    pub srq: SrqChoice,
    /// Registered send buffers, shared by every connection (and shared out over the lanes).
    pub send_slots: u32,
    /// Engine lanes (`attach --cm-lanes`): the TUN device's queues, each read by an engine on
    /// a thread of its own with a CQ and a share of the send slots; 1 is one engine, a task
    /// on the control loop's thread.
    pub lanes: u32,
    /// How often the policy runs.
    pub tick: Duration,
    /// Where the status is written (JSON), once per tick.
    pub status_path: PathBuf,
    /// Overrides of the promotion policy's defaults (the plan sets `max_connections`).
    pub promotion: PromotionConfig,
    /// Tests only: take a [`Fault`] for the engine from `RUN_DIR/IFACE.fault` on each tick.
    pub test_faults: bool,
}

/// Where receives land now, and what they cost, for the CM status.
fn receive_status(recv: &Receive, budget_bytes: u64) -> ReceiveStatus {
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let registered_bytes = recv.registered_bytes();
    match recv {
        Receive::Srq(srq) => ReceiveStatus {
            model: ReceiveKind::Srq,
            depth: srq.depth,
            registered_bytes,
            budget_bytes,
            ..ReceiveStatus::default()
        },
        Receive::Rings(pool) => {
            let made = get(&pool.made);
            ReceiveStatus {
                model: ReceiveKind::Rings,
                depth: pool.depth,
                rings: pool.in_use(),
                max_rings: pool.max,
                registered_bytes,
                budget_bytes,
                rings_made: made,
                rings_refused: get(&pool.refused),
                ring_register_us: get(&pool.register_ns) / made.max(1) / 1000,
            }
        }
    }
}

/// GSO packets larger than this would not fit one RC message with the engine's header.
pub const GSO_MAX_SIZE: u32 = 65000;

/// A connection in the engine's routes, watched by its own task.
struct Watched {
    /// Ends the watch (and the connection).
    close: oneshot::Sender<()>,
    /// Bytes the engine has received on it so far, and keepalives.
    received: u64,
    keepalives: u64,
    /// When either last grew (monotonic ns, 0 for never): the watch takes it as word from
    /// the peer (a one-way stream's sender hears its receiver only through the keepalives).
    traffic: Arc<AtomicU64>,
}

/// How a setup or a watched connection ended (from the tasks that run them).
pub enum Outcome {
    Established(IpAddr, Connection),
    SetupFailed(IpAddr, SetupError),
    /// The watch found the peer gone; the connection is still open, until asked to close.
    Gone {
        ip: IpAddr,
        qpn: u32,
        gone: Gone,
    },
    /// The connection is closed (after the close it was asked for).
    Closed {
        ip: IpAddr,
        qpn: u32,
    },
}

/// One input of the manager, from [`Manager::next_input`].
pub enum Input {
    /// The policy's tick: counters, pins, the policy and the cap are read.
    Tick,
    Engine(EngineEvent),
    /// The device's async fd is readable.
    DeviceEvents,
    /// A peer set a connection up to us (or tried).
    Accepted(SocketAddr, Result<Connection, SetupError>),
    Outcome(Outcome),
    /// The engine's task ended (it panicked, or returned an error): why.
    EngineStopped(String),
    /// The handshake listener's task ended (its listener failed): why.
    ListenerStopped(String),
}

/// How long the engine's loop may show no life (its housekeeping runs every
/// [`HOUSEKEEPING`]) before it is taken as wedged: the heartbeat is withheld, so the fast
/// path's fail-safe sends every packet UD once the heartbeat is stale. Connected mode stays
/// up: an engine that turns again (a long stall, not a dead task) gets the heartbeat back and
/// its peers CM again. A task that ended stops connected mode (see [`Input::EngineStopped`]).
pub const ENGINE_DEADLINE: Duration = Duration::from_millis(1500);
// A live engine renews its proof of life at least twice within the deadline.
const _: () = assert!(ENGINE_DEADLINE.as_millis() >= 2 * HOUSEKEEPING.as_millis());

/// Netlink, and what connected mode changed over it on the interface, undone in
/// [`Manager::shutdown`] (gso_max_size) or when dropped (the address mirror).
struct LinkChanges {
    /// Also for neighbour lookups.
    rtnl: Arc<Rtnl>,
    /// The interface's index and gso_max_size before connected mode lowered it.
    iface_index: u32,
    gso_before: Option<u32>,
    /// Keeps the interface's IPv4 addresses on the TUN device (with loose rp_filter).
    _addresses: Option<AddressMirror>,
}

/// Connected mode on one interface. Built by [`Manager::start`]; fed by the control loop
/// with [`Manager::next_input`] and [`Manager::on_input`]; ended by [`Manager::shutdown`].
pub struct Manager {
    /// First, so it is deregistered before the device context (in `dev`) can close its fd.
    device_events: AsyncFd<RawFdRef>,
    iface: String,
    opts: CmOptions,
    core: Core,
    maps: DatapathMaps,
    dev: Device,
    res: Arc<Resources>,
    srq_depth: u32,
    plan_max: usize,
    /// The plan's receive memory budget.
    budget_bytes: u64,
    /// This interface's share of the node's budget.
    ledger: Arc<Ledger>,
    cm: Arc<Cm>,
    /// The handshake listener's task; None once it ended.
    serve: Option<JoinHandle<io::Result<()>>>,
    engine: EngineTask,
    engine_events: mpsc::UnboundedReceiver<EngineEvent>,
    accepted: mpsc::UnboundedReceiver<(SocketAddr, Result<Connection, SetupError>)>,
    outcomes_tx: mpsc::UnboundedSender<Outcome>,
    outcomes: mpsc::UnboundedReceiver<Outcome>,
    /// Established connections waiting for the core's word (route or discard), by QPN.
    parked: HashMap<u32, Connection>,
    /// Watched connections, by QPN.
    watched: HashMap<u32, Watched>,
    tick: tokio::time::Interval,
    tun: String,
    tun_ifindex: u32,
    link: LinkChanges,
    /// The loop's own liveness, so a stop of the whole process (SIGSTOP, a paused VM, CPU
    /// starvation) is not taken for a wedged engine: when the loop last looked, and since when
    /// it has run without a gap longer than [`ENGINE_DEADLINE`] (monotonic ns).
    looked_at: u64,
    awake_since: u64,
    /// The latest a tick ran after its time (see [`CmStatus::tick_late_max_ms`]).
    tick_late_max: Duration,
}

/// What a stopped [`Manager`] may leave behind for a while: its verbs resources and its share
/// of the node's budget, held by tasks still finishing (a setup in its handshake, a stream
/// that has not sent its REQ yet). Connected mode starts again only once they are gone: the
/// device would hold both sets of resources, and the old share's end would remove the new
/// one's file from the ledger.
#[derive(Debug, Clone)]
pub struct Remains {
    res: Weak<Resources>,
    ledger: Weak<Ledger>,
}

impl Remains {
    pub fn gone(&self) -> bool {
        self.res.strong_count() == 0 && self.ledger.strong_count() == 0
    }
}

impl Manager {
    /// What this connected mode leaves behind until its last task ends (see [`Remains`]).
    pub fn remains(&self) -> Remains {
        Remains {
            res: Arc::downgrade(&self.res),
            ledger: Arc::downgrade(&self.ledger),
        }
    }

    /// The next thing to handle. Cancel-safe: every branch is a channel receive, a tick or a
    /// readiness wait.
    pub async fn next_input(&mut self) -> Input {
        // The tick never ends, so some branch always stays enabled.
        tokio::select! {
            at = self.tick.tick() => {
                self.tick_late_max = self.tick_late_max.max(at.elapsed());
                Input::Tick
            }
            Some(e) = self.engine_events.recv() => Input::Engine(e),
            Ok(mut g) = self.device_events.readable() => {
                g.clear_ready();
                Input::DeviceEvents
            }
            Some((a, r)) = self.accepted.recv() => Input::Accepted(a, r),
            Some(o) = self.outcomes.recv() => Input::Outcome(o),
            why = task_end(&mut self.engine.task, |r| r) => Input::EngineStopped(why),
            why = task_end(&mut self.serve, |r| r) => Input::ListenerStopped(why),
        }
    }

    /// Whether the engine's loop turns: its task runs and showed life within
    /// [`ENGINE_DEADLINE`] of the control loop running. The heartbeat is written only while
    /// it does.
    pub fn engine_alive(&mut self) -> bool {
        self.engine.task.as_ref().is_some_and(|t| !t.is_finished())
            && self.engine_silence() < ENGINE_DEADLINE
    }

    /// How long the engine has shown no life while this loop ran. After a gap in the loop
    /// itself (the whole process was stopped or starved) the engine gets a fresh deadline:
    /// the two resume together, and either may be polled first.
    fn engine_silence(&mut self) -> Duration {
        let now = monotonic_ns();
        if Duration::from_nanos(now.saturating_sub(self.looked_at)) > ENGINE_DEADLINE {
            self.awake_since = now;
        }
        self.looked_at = now;
        let awake = Duration::from_nanos(now.saturating_sub(self.awake_since));
        let lanes = EngineStats::total(self.engine.stats.iter().map(|s| &**s));
        lanes.silent_for(now).min(awake)
    }

    /// Handles one input, then carries out what the core decided.
    pub fn on_input(&mut self, input: Input) -> Result<(), CmError> {
        match input {
            Input::Tick => self.on_tick()?,
            Input::Engine(e) => self.on_engine_event(e),
            Input::DeviceEvents => self.on_device_events()?,
            Input::Accepted(addr, r) => self.on_accepted(addr, r),
            Input::Outcome(o) => self.on_outcome(o),
            Input::EngineStopped(why) => {
                self.engine.task = None;
                return Err(CmError::EngineStopped(why));
            }
            // No peer could set a connection up to us any more: stopped (and started again
            // by the control loop), not left deaf.
            Input::ListenerStopped(why) => {
                self.serve = None;
                return Err(CmError::ListenerStopped(why));
            }
        }
        self.execute()
    }

    /// The policy's tick: the policy (mode, cap), the operator's pins and the fast path's
    /// counters go to the core; then the status file is written.
    fn on_tick(&mut self) -> Result<(), CmError> {
        if self.opts.test_faults {
            self.take_test_fault();
        }
        // One pass over the peers map for the pins and the traffic slots.
        let peers = self.maps.peers().unwrap_or_default();
        let input = TickInput {
            mode: self.maps.policy().ok().and_then(|p| Mode::from_raw(p.mode)),
            ud_path: self.ud_path(),
            max_connections: cap(
                &self.iface,
                self.plan_max,
                self.res.recv.rings().map(|p| p.ring_bytes()),
            ),
            pins: pins(&peers),
            traffic: self.traffic(&peers),
            srq_posted: self.res.recv.srq().map_or(0, |s| s.posted()),
        };
        self.core.handle_tick(monotonic_ns(), input);
        self.execute()?;
        self.write_status();
        Ok(())
    }

    /// Tests only: a fault written into `RUN_DIR/IFACE.fault` goes to the engine, or, for
    /// `listener`, ends the handshake listener's task.
    fn take_test_fault(&self) {
        let path = crate::attach::run_file(&self.iface, "fault");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return;
        };
        let _ = std::fs::remove_file(&path);
        if text.trim() == "listener" {
            // The handshake listener's task dies (as on a failure of the listener itself).
            if let Some(serve) = &self.serve {
                serve.abort();
            }
            return;
        }
        match text.parse::<Fault>() {
            Ok(f) => self.engine.control.fault(f),
            Err(e) => tracing::warn!("{}: {e}", path.display()),
        }
    }

    /// How the interface's UD path segments, asked each tick (an operator may turn TSO on or
    /// off at any time); None when the kernel does not answer (any interface answers
    /// ETHTOOL_GTSO: only a vanished one, which the link watch handles, would not).
    fn ud_path(&self) -> Option<UdPath> {
        netdev::tso_on(&self.iface)
            .inspect_err(|e| tracing::debug!("{e}: the UD path is taken to be as it was"))
            .ok()
            .map(UdPath::of_tso)
    }

    fn traffic(&self, peers: &[(PeerKey, PeerEntry)]) -> Vec<(IpAddr, Traffic)> {
        let traffic = self.maps.traffic_of_peers(peers).unwrap_or_default();
        traffic
            .into_iter()
            .filter_map(|(k, t)| {
                let t = Traffic {
                    tx_packets: t.tx_ud_packets + t.tx_cm_packets,
                    tx_bytes: t.tx_ud_bytes + t.tx_cm_bytes,
                    tx_cm_bytes: t.tx_cm_bytes,
                };
                Some((k.ip()?, t))
            })
            .collect()
    }

    fn on_engine_event(&mut self, e: EngineEvent) {
        let now = monotonic_ns();
        match e {
            EngineEvent::QpError { qpn, status } => {
                let why = match status {
                    Some(status) => format!("completion status {status}"),
                    None => "the QP refused a send".to_string(),
                };
                self.core.handle_qp_error(now, qpn, &why);
            }
            EngineEvent::Congested(ip) => self.core.handle_congested(ip),
            EngineEvent::Drained(ip) => self.core.handle_drained(ip),
            EngineEvent::RouteAdded { ip, qpn } => self.core.handle_route_added(ip, qpn),
            EngineEvent::Received(totals) => {
                self.heard(now, &totals, |w| &mut w.received);
                self.core.handle_received(&totals);
            }
            EngineEvent::Keepalives(totals) => self.heard(now, &totals, |w| &mut w.keepalives),
        }
    }

    /// Word from the peers in the engine's `totals`: each watched connection whose count
    /// (the one `field` picks) grew was heard at `now`.
    fn heard(&mut self, now: u64, totals: &[(u32, u64)], field: fn(&mut Watched) -> &mut u64) {
        for (qpn, total) in totals {
            if let Some(w) = self.watched.get_mut(qpn)
                && std::mem::replace(field(w), *total) != *total
            {
                w.traffic.store(now, Ordering::Relaxed);
            }
        }
    }

    /// The device's asynchronous events: a QP gone fatal with no send in flight to report it,
    /// the SRQ running low; and any event of our port, which stops connected mode (the
    /// control loop starts it again on the port as it is then).
    fn on_device_events(&mut self) -> Result<(), CmError> {
        loop {
            match self.dev.async_event(Duration::ZERO) {
                Ok(Some(AsyncEvent::QpFatal(qpn))) => {
                    self.core
                        .handle_qp_error(monotonic_ns(), qpn, "device event: QP fatal");
                }
                Ok(Some(AsyncEvent::SrqLimitReached)) => self.core.handle_srq_limit(),
                Ok(Some(AsyncEvent::QpLastWqeReached(qpn))) => self.engine.control.last_wqe(qpn),
                Ok(Some(AsyncEvent::Port(event, port))) if port == self.opts.port => {
                    let was = &self.res.port;
                    let now = self.dev.port_now(port).ok();
                    let snap = |p: &verbs::PortAddress| (p.state, p.endpoint());
                    let action =
                        path::on_port_event(event, &snap(was), now.as_ref().map(snap).as_ref());
                    if action == path::OnPortEvent::Restart {
                        return Err(CmError::PortEvent {
                            device: self.opts.device.clone(),
                            port,
                            event,
                        });
                    }
                    tracing::info!(
                        "{} port {port}: {event}, nothing of ours changed: connected mode goes on",
                        self.opts.device
                    );
                }
                Ok(Some(other)) => tracing::debug!("device event {other:?}"),
                Ok(None) => return Ok(()),
                Err(e) => {
                    tracing::warn!("reading device events: {e}");
                    return Ok(());
                }
            }
        }
    }

    fn on_accepted(&mut self, addr: SocketAddr, r: Result<Connection, SetupError>) {
        match r {
            Ok(c) => {
                // The listener is dual-stack: an IPv4 peer shows as ::ffff:a.b.c.d.
                let ip = addr.ip().to_canonical();
                tracing::debug!("{ip}: accepted a connection");
                self.on_established(ip, c);
            }
            Err(e) => tracing::debug!("{addr}: handshake refused: {e}"),
        }
    }

    fn on_outcome(&mut self, o: Outcome) {
        let now = monotonic_ns();
        match o {
            Outcome::Established(ip, c) => self.on_established(ip, c),
            Outcome::SetupFailed(ip, e) => {
                tracing::info!("{ip}: connection setup failed, UD for now: {e}");
                self.core.handle_setup_failed(now, ip, Failure::from(&e));
            }
            Outcome::Gone { ip, qpn, gone } => self.core.handle_gone(now, ip, qpn, gone),
            Outcome::Closed { ip, qpn } => {
                self.watched.remove(&qpn);
                self.core.handle_closed(now, ip, qpn);
            }
        }
    }

    fn on_established(&mut self, ip: IpAddr, c: Connection) {
        let qpn = c.qp.qpn();
        self.parked.insert(qpn, c);
        self.core.handle_established(monotonic_ns(), ip, qpn);
    }

    /// Carries out the core's commands, in order.
    pub fn execute(&mut self) -> Result<(), CmError> {
        while let Some(c) = self.core.next_command() {
            match c {
                Command::SetPeerMode(ip, mode) => self.set_peer_mode(ip, mode)?,
                Command::Connect(ip) => self.connect(ip),
                Command::AddRoute { ip, qpn } => self.add_route(ip, qpn),
                Command::RemoveRoute { ip, qpn, close } => {
                    let close = if close {
                        self.watched.remove(&qpn).map(|w| w.close)
                    } else {
                        None
                    };
                    self.engine.control.remove_route(ip, qpn, close);
                }
                Command::Discard { ip, qpn } => {
                    tracing::debug!("{ip}: connection QP {qpn} not kept");
                    if let Some(c) = self.parked.remove(&qpn) {
                        let qp = c.qp.clone();
                        c.close();
                        self.engine.control.bury(qp);
                    }
                }
                Command::SetSetupLimit(n) => self.cm.set_limit(n),
                Command::ArmSrqLimit(limit) => {
                    let armed = self.res.recv.srq().map(|s| s.arm_limit(limit));
                    if let Some(Err(e)) = armed {
                        tracing::warn!("arming the SRQ limit: {e}");
                    }
                }
            }
        }
        Ok(())
    }

    fn set_peer_mode(&mut self, ip: IpAddr, mode: PeerMode) -> Result<(), CmError> {
        let key = PeerKey::from(ip);
        let old = self.maps.peer(&key)?.unwrap_or_default();
        let entry = PeerEntry {
            mode: mode.into(),
            cm_ifindex: if mode == PeerMode::CmUp {
                self.tun_ifindex
            } else {
                0
            },
            generation: old.generation.wrapping_add(1),
            ..old
        };
        self.maps.set_peer(key, entry)?;
        Ok(())
    }

    /// A setup to `ip`: its address resolved, then the handshake, as a task that reports
    /// its [`Outcome`].
    fn connect(&self, ip: IpAddr) {
        let (cm, tx, resolve, rtnl) = (
            self.cm.clone(),
            self.outcomes_tx.clone(),
            self.opts.resolve.clone(),
            self.link.rtnl.clone(),
        );
        let (port, gid) = (self.opts.ctl_port, self.res.port.gid);
        tokio::spawn(async move {
            let Some(hw) = resolve.peer(&rtnl, ip, gid).await else {
                let _ = tx.send(Outcome::SetupFailed(ip, SetupError::Timeout("neighbour")));
                return;
            };
            let o = match cm.connect(SocketAddr::new(ip, port), hw).await {
                Ok(c) => Outcome::Established(ip, c),
                Err(e) => Outcome::SetupFailed(ip, e),
            };
            let _ = tx.send(o);
        });
    }

    /// The parked connection `qpn` becomes `ip`'s route in the engine, and is watched: it ends
    /// on request, or when the peer closes it or stays silent past the heartbeat deadline
    /// (the one the fast path's fail-safe uses; not under 1 s, as a busy peer's keepalive may
    /// come late).
    fn add_route(&mut self, ip: IpAddr, qpn: u32) {
        let Some(mut c) = self.parked.remove(&qpn) else {
            return;
        };
        tracing::info!("{ip}: connected (QP {qpn}, MTU {})", c.mtu);
        let route = Route {
            qp: c.qp.clone(),
            mtu: c.mtu,
        };
        self.engine.control.add_route(ip, route);
        let dead_after = self
            .maps
            .policy()
            .map_or(Duration::from_secs(3), |p| {
                Duration::from_nanos(p.heartbeat_timeout_ns)
            })
            .max(Duration::from_secs(1));
        let (close, close_rx) = oneshot::channel::<()>();
        let traffic = Arc::new(AtomicU64::new(0));
        let w = Watched {
            close,
            received: 0,
            keepalives: 0,
            traffic: traffic.clone(),
        };
        self.watched.insert(qpn, w);
        let tx = self.outcomes_tx.clone();
        let control = self.engine.control.clone();
        tokio::spawn(async move {
            let mut close_rx = close_rx;
            let gone = tokio::select! {
                g = c.watch(dead_after / 3, dead_after, &traffic) => Some(g),
                _ = &mut close_rx => None,
            };
            // The peer gone: said first, and closed only when asked (a demotion's order: UD,
            // then what the engine holds goes over the connection, then the close).
            if let Some(gone) = gone {
                let _ = tx.send(Outcome::Gone { ip, qpn, gone });
                let _ = close_rx.await;
            }
            // Closed, then held by the engine until drained (engine::graves).
            let qp = c.qp.clone();
            c.close();
            control.bury(qp);
            let _ = tx.send(Outcome::Closed { ip, qpn });
        });
    }

    fn write_status(&self) {
        let status = self.status();
        if let Ok(json) = serde_json::to_vec_pretty(&status)
            && let Err(e) = crate::files::replace(&self.opts.status_path, &json)
        {
            tracing::debug!("writing {}: {e}", self.opts.status_path.display());
        }
    }

    /// What connected mode reports now: what it writes to its status file once a tick, and
    /// what the control loop's metrics are made from.
    pub fn status(&self) -> CmStatus {
        let peers = self
            .core
            .peers(monotonic_ns())
            .into_iter()
            .map(PeerStatus::from)
            .collect();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let total = EngineStats::total(self.engine.stats.iter().map(|s| &**s));
        let engine = total.snapshot();
        CmStatus {
            device: self.opts.device.clone(),
            tun: self.tun.clone(),
            receive: receive_status(&self.res.recv, self.budget_bytes),
            node: self.ledger.view().map_or_else(
                |e| {
                    tracing::debug!("the node budget's ledger: {e}");
                    NodeBudget::default()
                },
                |(budget_bytes, shares)| NodeBudget {
                    budget_bytes,
                    shares,
                },
            ),
            srq_depth: self.srq_depth,
            srq_low_events: self.core.srq_low_events(),
            max_connections: self.core.max_connections(),
            mode: self.core.mode(),
            ud_path: self.core.ud_path(),
            connections: self.core.connections(),
            established: get(&self.cm.stats.established),
            failed: get(&self.cm.stats.failed),
            awaiting_req: get(&self.cm.stats.awaiting_req),
            dropped_awaiting_req: get(&self.cm.stats.dropped_awaiting_req),
            paths_resolved: get(&self.cm.stats.paths_resolved),
            paths_unresolved: get(&self.cm.stats.paths_unresolved),
            paths_from_peer: get(&self.cm.stats.paths_from_peer),
            tasks: tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks() as u64,
            tick_late_max_ms: self.tick_late_max.as_millis() as u64,
            engine_lanes: self.engine.stats.len() as u32,
            engine: engine
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            engine_cpu_ns: total.cpu_ns.load(Ordering::Relaxed),
            peers,
        }
    }

    /// Stops connected mode: every peer UD first, then the connections, then the engine and
    /// the TUN device; the interface's gso_max_size is restored.
    pub async fn shutdown(mut self) -> Result<(), CmError> {
        if let Some(serve) = &self.serve {
            serve.abort();
        }
        self.core.handle_shutdown();
        self.execute()?;
        // The routes' removal taken by every lane before it stops (a wedged lane is not
        // waited for past a second: stopping it aborts it).
        let synced = tokio::time::timeout(Duration::from_secs(1), self.engine.control.sync());
        if synced.await.is_err() {
            tracing::warn!(
                "{}: the engine did not take its last commands in 1 s",
                self.iface
            );
        }
        let _ = self.engine.stop.send(true);
        let result = match self.engine.task.take() {
            Some(task) => stop_engine(task).await,
            None => Ok(()),
        };
        let _ = std::fs::remove_file(&self.opts.status_path);
        if let Some(g) = self.link.gso_before.filter(|g| *g > GSO_MAX_SIZE) {
            match self
                .link
                .rtnl
                .set_gso_max_size(self.link.iface_index, g)
                .await
            {
                Ok(()) => tracing::info!("{}: gso_max_size {g} again", self.iface),
                Err(e) => tracing::warn!("{}: gso_max_size not restored to {g}: {e}", self.iface),
            }
        }
        tracing::info!("CM on {} stopped; every peer is on UD", self.iface);
        result
    }
}

impl From<CmPeer> for PeerStatus {
    fn from(p: CmPeer) -> Self {
        Self {
            addr: p.addr,
            state: p.state,
            why: p.why,
            failures: p.failures,
            last_failure: p.last_failure.map(|l| FailureStatus {
                reason: l.why,
                said: l.why.to_string(),
                secs_ago: l.ago.as_secs(),
            }),
            promotions: p.promotions,
            waiting_for_plan: p.waiting_for_plan,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::live_cap;

    /// A rate threshold is named only where a rate promotes: never on an offloaded UD path.
    #[test]
    fn the_start_line_names_the_bulk_rate_only_where_it_promotes() {
        use super::start::ud_path_line;
        use crate::promotion::UdPath;
        let per_packet = ud_path_line("ib0", UdPath::PerPacket, 4.0 * f64::from(1 << 20));
        assert!(
            per_packet.starts_with("ib0: the UD path is per-packet: "),
            "{per_packet}"
        );
        assert!(
            per_packet.ends_with(" (a busy peer sends over 4 MiB/s in bulk)"),
            "{per_packet}"
        );
        let offloaded = ud_path_line("ib0", UdPath::Offloaded, 4.0 * f64::from(1 << 20));
        assert!(
            offloaded.starts_with("ib0: the UD path is offloaded: "),
            "{offloaded}"
        );
        assert!(!offloaded.contains("MiB/s"), "{offloaded}");
    }

    #[test]
    fn the_policy_only_lowers_the_plans_cap() {
        const RING: u64 = 4 << 20;
        // Nothing set: the plan.
        assert_eq!(live_cap(96, None, None, Some(RING)), 96);
        assert_eq!(live_cap(1000, None, None, None), 1000);
        // max-connections lowers, never raises.
        assert_eq!(live_cap(96, Some(3), None, Some(RING)), 3);
        assert_eq!(live_cap(96, Some(500), None, Some(RING)), 96);
        // memory-budget counts rings: 14 MiB holds 3 of 4 MiB, 4 MiB one, less none.
        assert_eq!(live_cap(96, None, Some(14 << 20), Some(RING)), 3);
        assert_eq!(live_cap(96, None, Some(RING), Some(RING)), 1);
        assert_eq!(live_cap(96, None, Some(RING - 1), Some(RING)), 0);
        assert_eq!(live_cap(2, None, Some(1 << 40), Some(RING)), 2);
        // The smaller of the two.
        assert_eq!(live_cap(96, Some(2), Some(14 << 20), Some(RING)), 2);
        assert_eq!(live_cap(96, Some(5), Some(14 << 20), Some(RING)), 3);
        // On an SRQ the budget is the SRQ's, made once: the cap stays.
        assert_eq!(live_cap(1000, None, Some(RING), None), 1000);
        assert_eq!(live_cap(1000, None, Some(RING), Some(0)), 1000);
    }
}
