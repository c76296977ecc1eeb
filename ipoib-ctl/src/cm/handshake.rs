//! The CM handshake over TCP: REQ, REP or REJ, RTU. The TCP stream stays open for the life of
//! the RC connection: its end (the peer closed, crashed or was killed) is how each side learns
//! that the other is gone, as a CM DREQ or a timewait would tell it on InfiniBand.
//!
//! A peer can also stop without closing anything: its control loop stopped (SIGSTOP) or
//! wedged. Its HCA still acknowledges what lands in its posted receive buffers, so sends
//! complete without error while nothing reads them: a blackhole until the buffers run out.
//! [`Connection::watch`] therefore has each side send a keepalive byte on the stream from its
//! control loop and take a peer that sent nothing for the heartbeat deadline as gone.
//!
//! * Active side ([`Cm::connect`]): makes its QP, sends REQ, takes the REP, brings its QP to
//!   RTS, sends RTU. Transient failures (TCP errors, timeouts, REJ busy or no resources) are
//!   retried with exponential backoff, a bounded number of times.
//! * Passive side ([`Cm::accept`]): validates the REQ before it allocates anything, makes its
//!   QP, brings it to RTS, sends REP, waits for RTU.
//! * Setups in flight, both sides together, are capped; past the cap a REQ gets REJ busy.
//! * Connections are capped too ([`Cm::set_limit`], the memory plan): a REQ that would go past
//!   the cap gets REJ no-resources before anything is allocated for it. Without an SRQ each
//!   QP needs a receive ring from the node's pool, which counts rings (crossing setups and
//!   those being torn down included): a REQ that finds no ring gets REJ no-resources too, and
//!   our own setup fails with [`SetupError::Full`] before it sends a REQ.
//! * One connection per peer (its IPoIB address, UD QPN and GID). Crossing REQs are resolved
//!   by the tie-break of RFC 4755: the lower address accepts the other side's REQ, the higher
//!   one refuses it (REJ crossing) and its own REQ completes.

use std::{
    collections::{HashMap, VecDeque},
    io,
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
    sync::{Semaphore, mpsc},
    task::AbortHandle,
    time::timeout,
};

use super::wire::{
    Hello, HwAddr, Kind, MSG_LEN, Msg, PathParams, RejectReason, WireError, accepts_crossing,
    connection_mtu,
};
use crate::{
    clock::{delayed_interval, monotonic_ns},
    path::PathRecord,
    verbs::{RcQueuePair, RcTiming, Resources, VerbsError},
};

/// A random first PSN (24 bits).
fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: writes at most 4 bytes into b. On failure the PSN is 0, which is valid.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    u32::from_ne_bytes(b) & 0xff_ffff
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("TCP: {0}")]
    Io(#[from] io::Error),
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    #[error("the peer refused: {0:?}")]
    Rejected(RejectReason),
    #[error("malformed message from the peer: {0}")]
    Malformed(#[from] WireError),
    #[error("unexpected {0:?} from the peer")]
    Unexpected(Kind),
    #[error("the peer answered as {got:?}, expected {want:?}")]
    WrongPeer { want: HwAddr, got: HwAddr },
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error("crossing REQs: the peer's REQ won the tie-break; its connection is the one")]
    Crossed,
    #[error("a setup with this peer is under way or it is connected")]
    InProgress,
    #[error("too many setups in flight")]
    Busy,
    #[error("as many connections as the plan allows")]
    Full,
    #[error("no path to the peer's port: {0}")]
    NoPath(#[from] crate::path::NoPath),
}

impl SetupError {
    /// Worth another attempt after a backoff.
    pub fn transient(&self) -> bool {
        match self {
            Self::Io(_) | Self::Timeout(_) => true,
            Self::Rejected(r) => r.transient(),
            _ => false,
        }
    }
}

/// Timeouts, retries and caps of connection setup.
#[derive(Debug, Clone)]
pub struct SetupConfig {
    /// Each step: TCP connect, waiting for REP, waiting for REQ or RTU.
    pub step_timeout: Duration,
    /// Attempts after the first, for transient failures.
    pub retries: u32,
    /// First backoff; doubled after each failure, up to `max_backoff`.
    pub backoff: Duration,
    pub max_backoff: Duration,
    /// Setups in flight at once, active and passive together.
    pub max_concurrent: usize,
    /// Incoming streams that have not sent their REQ yet, at most: past it the oldest is
    /// dropped. A peer sends its REQ as soon as it connects, so only streams that send nothing
    /// (or half a REQ) grow old; a flood of them costs this many tasks and sockets, and a
    /// setup among them is refused only if the flood turns this many over before its REQ
    /// arrives.
    pub max_awaiting_req: usize,
    /// Send queue depth of each RC QP.
    pub max_send_wr: u32,
    /// ACK and RNR timeouts and retries of each connection.
    pub timing: RcTiming,
    /// The interface our handshake streams go out of (SO_BINDTODEVICE): the one whose HCA
    /// port the connections use. None: wherever the route says.
    pub device: Option<String>,
    /// Whether a setup asks for a path record to the peer (librdmacm, on the peer's address:
    /// on IPoIB, where that address is on the fabric) and sends it in its REQ.
    pub path_records: bool,
    /// Each of a path resolution's two steps (address, route) at most.
    pub path_timeout: Duration,
}

impl Default for SetupConfig {
    fn default() -> Self {
        Self {
            step_timeout: Duration::from_secs(2),
            retries: 3,
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            max_concurrent: 16,
            max_awaiting_req: 64,
            max_send_wr: crate::plan::SEND_WINDOW,
            timing: RcTiming::default(),
            device: None,
            path_records: false,
            path_timeout: Duration::from_millis(500),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Outgoing,
    Incoming,
    Connected,
}

/// Setups and connections by peer; an entry belongs to whoever holds its token.
#[derive(Default)]
struct Table {
    next: AtomicU64,
    peers: Mutex<HashMap<HwAddr, (Stage, u64)>>,
}

/// An entry of the table, removed when dropped (if still its owner's).
struct Slot {
    table: Arc<Table>,
    peer: HwAddr,
    token: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut peers = self.table.peers.lock().unwrap();
        if peers.get(&self.peer).is_some_and(|(_, t)| *t == self.token) {
            peers.remove(&self.peer);
        }
    }
}

impl Slot {
    fn set(&self, stage: Stage) {
        if let Some(e) = self.table.peers.lock().unwrap().get_mut(&self.peer)
            && e.1 == self.token
        {
            e.0 = stage;
        }
    }
}

/// An established RC connection.
pub struct Connection {
    pub qp: Arc<RcQueuePair>,
    /// The peer's REQ or REP.
    pub peer: Hello,
    pub peer_addr: SocketAddr,
    /// RFC 4755 per-connection MTU: the smaller receive MTU less the 4-byte header.
    pub mtu: u32,
    ctl: TcpStream,
    _slot: Slot,
}

impl Connection {
    /// Resolves when the peer is gone: its end of the control stream closed or broke. Sends
    /// no keepalive (test peers use it); `attach` uses [`Connection::watch`].
    pub async fn closed(&mut self) {
        let mut b = [0u8; 64];
        loop {
            match self.ctl.read(&mut b).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // keepalive bytes (see `watch`): not looked at here
            }
        }
    }

    /// Watches the peer: sends a keepalive byte every `every` and resolves when the peer
    /// closes the stream ([`Gone::Closed`]) or is silent for `dead_after` ([`Gone::Silent`]).
    /// Both sides must run it (a side that does not sends nothing and is taken as gone).
    /// `traffic` holds when the peer's engine was last seen sending on the connection
    /// (monotonic ns, 0 for never): that proves it alive as a keepalive does, and under load
    /// the keepalive, a small packet on UD, may be the one that is late.
    pub async fn watch(
        &mut self,
        every: Duration,
        dead_after: Duration,
        traffic: &AtomicU64,
    ) -> Gone {
        let mut tick = delayed_interval(every);
        let mut hearing = Hearing::new(monotonic_ns(), every, dead_after);
        let mut b = [0u8; 64];
        loop {
            // Reads first: bytes that came while this task did not run are heard before the
            // tick judges.
            let got = tokio::select! {
                biased;
                r = self.ctl.read(&mut b) => Some(r),
                _ = tick.tick() => None,
            };
            match got {
                Some(Ok(0) | Err(_)) => return Gone::Closed,
                Some(Ok(_)) => hearing.heard(monotonic_ns()),
                None => {
                    let now = monotonic_ns();
                    hearing.heard(traffic.load(Ordering::Relaxed));
                    if let Some(silence) = hearing.turn(now) {
                        tracing::info!(
                            "{}: nothing heard for {silence:?} (keepalive or traffic)",
                            self.peer_addr
                        );
                        return Gone::Silent;
                    }
                    // A full socket buffer (the peer reads nothing) is not an error here: the
                    // silence above decides.
                    match self.ctl.try_write(&[KEEPALIVE]) {
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(_) => return Gone::Closed,
                    }
                }
            }
        }
    }

    /// Ends the connection here: the QP goes to the error state (outstanding work flushes), and
    /// the control stream closes, which the peer sees at once.
    pub fn close(self) {
        let _ = self.qp.to_error();
    }
}

/// When a watched peer is silent: nothing heard from it for the deadline, counted only over
/// time this side was itself running. A watch that did not run for a while (the process or the
/// machine starved of CPU, stopped, a VM paused) could not have heard the peer either, and the
/// peer, starved alike, could not have sent: the silence counts from its wake. I/O-free, on
/// monotonic nanoseconds.
#[derive(Debug, Clone)]
struct Hearing {
    heard: u64,
    /// Since when the watch has turned without a gap longer than its deadline allows.
    awake_since: u64,
    last_turn: u64,
    every: u64,
    dead_after: u64,
}

impl Hearing {
    fn new(now: u64, every: Duration, dead_after: Duration) -> Self {
        Self {
            heard: now,
            awake_since: now,
            last_turn: now,
            every: every.as_nanos() as u64,
            dead_after: dead_after.as_nanos() as u64,
        }
    }

    /// The peer was heard at `at` (a time in the past is ignored).
    fn heard(&mut self, at: u64) {
        self.heard = self.heard.max(at);
    }

    /// The watch's turn at `now`: the silence when it is past the deadline.
    fn turn(&mut self, now: u64) -> Option<Duration> {
        // A turn later than two periods: this side was not running in between.
        if now.saturating_sub(self.last_turn) > 2 * self.every {
            self.awake_since = now;
        }
        self.last_turn = now;
        let silence = now.saturating_sub(self.heard.max(self.awake_since));
        (silence > self.dead_after).then(|| Duration::from_nanos(silence))
    }
}

/// The byte [`Connection::watch`] sends, after RTU, while the connection lives.
const KEEPALIVE: u8 = b'K';

/// How a watched peer went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// It closed the stream (detach, exit, crash, kill -9: the kernel closes it).
    Closed,
    /// The stream is open but it sent nothing for the deadline (stopped or wedged).
    Silent,
}

/// One stream counted in [`CmStats::awaiting_req`] while this lives (dropped with its task,
/// aborted or not).
struct AwaitingReq(Arc<Cm>);

impl AwaitingReq {
    fn new(cm: &Arc<Cm>) -> Self {
        cm.stats.awaiting_req.fetch_add(1, Ordering::Relaxed);
        Self(cm.clone())
    }
}

impl Drop for AwaitingReq {
    fn drop(&mut self) {
        self.0.stats.awaiting_req.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counters of the handshake, for status and tests.
#[derive(Debug, Default)]
pub struct CmStats {
    pub established: AtomicU64,
    pub rejected_sent: AtomicU64,
    pub failed: AtomicU64,
    /// Incoming streams dropped, oldest first, because too many waited for their REQ.
    pub dropped_awaiting_req: AtomicU64,
    /// Incoming streams waiting for their REQ now.
    pub awaiting_req: AtomicU64,
    /// Path records resolved for our setups, resolutions that failed, and REQs that brought
    /// the peer's.
    pub paths_resolved: AtomicU64,
    pub paths_unresolved: AtomicU64,
    pub paths_from_peer: AtomicU64,
}

/// The connection manager of one node (one IPoIB interface).
pub struct Cm {
    res: Arc<Resources>,
    /// This side's UD QPN (from its IPoIB hardware address).
    pub ud_qpn: u32,
    /// This side's receive MTU (the receive buffer's size, SRQ or ring).
    pub recv_mtu: u32,
    pub cfg: SetupConfig,
    permits: Arc<Semaphore>,
    table: Arc<Table>,
    /// Connections and setups at most (see [`Cm::set_limit`]).
    limit: AtomicUsize,
    pub stats: CmStats,
    paths: super::paths::Paths,
}

async fn read_msg(s: &mut TcpStream, t: Duration, what: &'static str) -> Result<Msg, SetupError> {
    let mut b = [0u8; MSG_LEN];
    match timeout(t, s.read_exact(&mut b)).await {
        Err(_) => Err(SetupError::Timeout(what)),
        Ok(Err(e)) => Err(e.into()),
        Ok(Ok(_)) => Ok(Msg::decode(&b)?),
    }
}

async fn write_msg(s: &mut TcpStream, m: Msg, t: Duration) -> Result<(), SetupError> {
    write_raw(s, m.encode(), t).await
}

async fn write_raw(s: &mut TcpStream, b: [u8; MSG_LEN], t: Duration) -> Result<(), SetupError> {
    match timeout(t, s.write_all(&b)).await {
        Err(_) => Err(SetupError::Timeout("sending")),
        Ok(r) => Ok(r?),
    }
}

impl Cm {
    pub fn new(res: Arc<Resources>, ud_qpn: u32, cfg: SetupConfig) -> Self {
        Self {
            recv_mtu: res.recv.buffer_bytes(),
            res,
            ud_qpn,
            permits: Arc::new(Semaphore::new(cfg.max_concurrent)),
            cfg,
            table: Arc::default(),
            limit: AtomicUsize::new(usize::MAX),
            stats: CmStats::default(),
            paths: super::paths::Paths::default(),
        }
    }

    /// Caps the connections (and setups under way) this side holds: past it an incoming REQ
    /// is refused with REJ no-resources. Outgoing setups are the caller's to count (the
    /// promotion policy does); this keeps peers that promote us from going past the plan.
    pub fn set_limit(&self, n: usize) {
        self.limit.store(n, Ordering::Relaxed);
    }

    /// Connections and setups under way, both directions.
    pub fn held(&self) -> usize {
        self.table.peers.lock().unwrap().len()
    }

    /// This side's IPoIB address (UD QPN and port GID).
    pub fn hwaddr(&self) -> HwAddr {
        HwAddr {
            gid: self.res.port.gid,
            ud_qpn: self.ud_qpn,
        }
    }

    fn hello(&self, qp: &RcQueuePair, path: Option<&PathRecord>) -> Hello {
        Hello {
            ud_qpn: self.ud_qpn,
            recv_mtu: self.recv_mtu,
            rc: qp.endpoint(),
            path: path.map(PathParams::of),
        }
    }

    fn reject(&self, reason: RejectReason) -> Msg {
        self.stats.rejected_sent.fetch_add(1, Ordering::Relaxed);
        Msg::Rej {
            ud_qpn: self.ud_qpn,
            recv_mtu: self.recv_mtu,
            reason,
        }
    }

    /// Claims `peer` for a setup in `stage`; Err(InProgress) when an entry exists (see
    /// `accept` for the one case where an incoming REQ takes over an outgoing setup), and
    /// Err(Full) for an incoming setup past the limit.
    fn claim(&self, peer: HwAddr, stage: Stage) -> Result<Slot, SetupError> {
        let mut peers = self.table.peers.lock().unwrap();
        let token = self.table.next.fetch_add(1, Ordering::Relaxed);
        match peers.get(&peer) {
            // Takes over our own setup's place: the count does not change.
            Some((Stage::Outgoing, _))
                if stage == Stage::Incoming && accepts_crossing(self.hwaddr(), peer) => {}
            Some(_) => return Err(SetupError::InProgress),
            None if stage == Stage::Incoming
                && peers.len() >= self.limit.load(Ordering::Relaxed) =>
            {
                return Err(SetupError::Full);
            }
            None => {}
        }
        peers.insert(peer, (stage, token));
        Ok(Slot {
            table: self.table.clone(),
            peer,
            token,
        })
    }

    /// A QP for a setup; Err(Full) when the plan's receive rings are all taken.
    fn new_qp(&self) -> Result<Arc<RcQueuePair>, SetupError> {
        match self.res.rc_qp(self.cfg.max_send_wr, random_psn()) {
            Ok(qp) => Ok(qp),
            Err(VerbsError::RingsExhausted { .. }) => Err(SetupError::Full),
            Err(e) => Err(e.into()),
        }
    }

    /// Connects to the peer at `addr` whose IPoIB address is `peer`, retrying transient
    /// failures with exponential backoff.
    pub async fn connect(&self, addr: SocketAddr, peer: HwAddr) -> Result<Connection, SetupError> {
        let mut backoff = self.cfg.backoff;
        let mut attempt = 0;
        loop {
            match self.connect_once(addr, peer).await {
                Ok(c) => return Ok(c),
                Err(e) if e.transient() && attempt < self.cfg.retries => {
                    tracing::debug!(%addr, attempt, "setup failed, retrying in {backoff:?}: {e}");
                    attempt += 1;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.cfg.max_backoff);
                }
                Err(e) => {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            }
        }
    }

    /// One attempt, no retry.
    pub async fn connect_once(
        &self,
        addr: SocketAddr,
        peer: HwAddr,
    ) -> Result<Connection, SetupError> {
        let t = self.cfg.step_timeout;
        let _permit = self.permits.acquire().await.map_err(|_| SetupError::Busy)?;
        let slot = self.claim(peer, Stage::Outgoing)?;
        // The QP (and its receive ring, without an SRQ) first: past the plan's rings the peer
        // is not bothered.
        let qp = self.new_qp()?;
        let path = if self.cfg.path_records {
            let t = self.cfg.path_timeout;
            self.paths.get(addr.ip(), t, &self.stats).await
        } else {
            None
        };
        let mut s = match timeout(t, self.tcp_connect(addr)).await {
            Err(_) => return Err(SetupError::Timeout("TCP connect")),
            Ok(r) => r?,
        };
        s.set_nodelay(true)?;
        write_msg(&mut s, Msg::Req(self.hello(&qp, path.as_ref())), t).await?;
        let rep = match read_msg(&mut s, t, "REP").await? {
            Msg::Rep(h) => h,
            Msg::Rej {
                reason: RejectReason::Crossing,
                ..
            } => {
                return Err(SetupError::Crossed);
            }
            Msg::Rej { reason, .. } => return Err(SetupError::Rejected(reason)),
            m => return Err(SetupError::Unexpected(m.kind())),
        };
        if rep.hwaddr() != peer {
            return Err(SetupError::WrongPeer {
                want: peer,
                got: rep.hwaddr(),
            });
        }
        let av = self.res.port.path_to(&rep.rc, path.as_ref())?;
        qp.connect(&rep.rc, &av, self.cfg.timing)?;
        write_msg(
            &mut s,
            Msg::Rtu {
                ud_qpn: self.ud_qpn,
                recv_mtu: self.recv_mtu,
            },
            t,
        )
        .await?;
        slot.set(Stage::Connected);
        self.stats.established.fetch_add(1, Ordering::Relaxed);
        Ok(Connection {
            qp,
            mtu: connection_mtu(self.recv_mtu, rep.recv_mtu),
            peer: rep,
            peer_addr: addr,
            ctl: s,
            _slot: slot,
        })
    }

    /// A TCP stream to `addr`, out of our interface when we have one.
    async fn tcp_connect(&self, addr: SocketAddr) -> io::Result<TcpStream> {
        let s = match addr {
            SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
            SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
        };
        if let Some(d) = &self.cfg.device {
            s.bind_device(Some(d.as_bytes()))?;
        }
        s.connect(addr).await
    }

    /// The passive side of one TCP stream. Nothing is allocated until the REQ is valid.
    pub async fn accept(&self, mut s: TcpStream) -> Result<Connection, SetupError> {
        let req = self.take_req(&mut s).await?;
        self.answer(s, req).await
    }

    /// Reads an incoming stream's REQ; a malformed one or another message is answered with a
    /// REJ. Holds nothing of the setup's: no permit, no entry, no QP.
    async fn take_req(&self, s: &mut TcpStream) -> Result<Hello, SetupError> {
        let t = self.cfg.step_timeout;
        s.set_nodelay(true)?;
        match read_msg(s, t, "REQ").await {
            Ok(Msg::Req(h)) => Ok(h),
            Ok(m) => {
                write_msg(s, self.reject(RejectReason::Malformed), t).await?;
                Err(SetupError::Unexpected(m.kind()))
            }
            Err(SetupError::Malformed(e)) => {
                // An asker of another version reads the REJ in its own where it can.
                let version = match e {
                    WireError::Version(v) => v,
                    _ => super::wire::VERSION,
                };
                write_raw(s, self.reject(e.reason()).encode_as(version), t).await?;
                Err(e.into())
            }
            Err(e) => Err(e),
        }
    }

    /// The passive side once its REQ is in: a permit (REJ busy past the setups in flight),
    /// the peer's entry, the QP, REP, RTU.
    async fn answer(&self, mut s: TcpStream, req: Hello) -> Result<Connection, SetupError> {
        let t = self.cfg.step_timeout;
        let peer_addr = s.peer_addr()?;
        let Ok(_permit) = self.permits.try_acquire() else {
            write_msg(&mut s, self.reject(RejectReason::Busy), t).await?;
            return Err(SetupError::Busy);
        };
        let slot = match self.claim(req.hwaddr(), Stage::Incoming) {
            Ok(slot) => slot,
            Err(e) => {
                let reason = match e {
                    SetupError::Full => RejectReason::NoResources,
                    _ => RejectReason::Crossing,
                };
                write_msg(&mut s, self.reject(reason), t).await?;
                return Err(e);
            }
        };
        let path = req.path_for_passive(&self.res.port.gid);
        if path.is_some() {
            self.stats.paths_from_peer.fetch_add(1, Ordering::Relaxed);
        }
        let av = match self.res.port.path_to(&req.rc, path.as_ref()) {
            Ok(r) => r,
            Err(e) => {
                write_msg(&mut s, self.reject(RejectReason::NoPath), t).await?;
                return Err(e.into());
            }
        };
        let qp = match self.new_qp() {
            Ok(qp) => qp,
            Err(e) => {
                write_msg(&mut s, self.reject(RejectReason::NoResources), t).await?;
                return Err(e);
            }
        };
        qp.connect(&req.rc, &av, self.cfg.timing)?;
        write_msg(&mut s, Msg::Rep(self.hello(&qp, path.as_ref())), t).await?;
        match read_msg(&mut s, t, "RTU").await? {
            Msg::Rtu { ud_qpn, .. } if ud_qpn == req.ud_qpn => {}
            Msg::Rtu { .. } => return Err(SetupError::Unexpected(Kind::Rtu)),
            m => return Err(SetupError::Unexpected(m.kind())),
        }
        slot.set(Stage::Connected);
        self.stats.established.fetch_add(1, Ordering::Relaxed);
        Ok(Connection {
            qp,
            mtu: connection_mtu(self.recv_mtu, req.recv_mtu),
            peer: req,
            peer_addr,
            ctl: s,
            _slot: slot,
        })
    }

    /// Accepts on `listener` until `tx` is closed or the listener itself fails (an error of
    /// one connection, or the process out of descriptors or memory for a moment, is not the
    /// listener's: see [`accept_failure`]): each stream waits for its REQ in its own task, at
    /// most [`SetupConfig::max_awaiting_req`] of them (past it the oldest is dropped); a REQ
    /// goes on in a task of its own, and every outcome goes to `tx`.
    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        tx: mpsc::UnboundedSender<(SocketAddr, Result<Connection, SetupError>)>,
    ) -> io::Result<()> {
        // The tasks of streams waiting for their REQ, oldest first (finished ones are pruned
        // as streams come).
        let mut awaiting: VecDeque<AbortHandle> = VecDeque::new();
        loop {
            let (s, addr) = accept(&listener).await?;
            if tx.is_closed() {
                return Ok(());
            }
            awaiting.retain(|h| !h.is_finished());
            while awaiting.len() >= self.cfg.max_awaiting_req.max(1) {
                if let Some(oldest) = awaiting.pop_front() {
                    oldest.abort();
                    self.stats
                        .dropped_awaiting_req
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            let (cm, tx) = (self.clone(), tx.clone());
            let gauge = AwaitingReq::new(&cm);
            let waiting = tokio::spawn(async move {
                let mut s = s;
                let req = cm.take_req(&mut s).await;
                drop(gauge);
                let report = move |cm: &Cm, r: Result<Connection, SetupError>| {
                    if let Err(e) = &r {
                        cm.stats.failed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%addr, "incoming setup failed: {e}");
                    }
                    let _ = tx.send((addr, r));
                };
                match req {
                    // Out of the waiting set: the setup is bounded by the permits.
                    Ok(req) => {
                        tokio::spawn(async move {
                            let r = cm.answer(s, req).await;
                            report(&cm, r);
                        });
                    }
                    Err(e) => report(&cm, Err(e)),
                }
            });
            awaiting.push_back(waiting.abort_handle());
        }
    }
}

/// The next stream `listener` takes; an error only when the listener itself failed (see
/// [`accept_failure`]).
async fn accept(listener: &TcpListener) -> io::Result<(TcpStream, SocketAddr)> {
    let mut short = false;
    loop {
        match listener.accept().await {
            Ok(a) => return Ok(a),
            Err(e) => match accept_failure(&e) {
                AcceptFailure::Connection => {
                    tracing::debug!("a handshake stream failed before its accept: {e}");
                }
                AcceptFailure::Short => {
                    if !std::mem::replace(&mut short, true) {
                        tracing::warn!("accepting handshake streams: {e}; trying again");
                    }
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
                AcceptFailure::Listener => return Err(e),
            },
        }
    }
}

/// How long the listener pauses when the process is short of descriptors or memory.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Whose failure an error of `accept` is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptFailure {
    /// The connection's, gone before it was taken (accept(2): Linux passes a pending network
    /// error of the new socket to accept; the advice is to retry): the next is taken at once.
    Connection,
    /// The process's, for a moment: no descriptor or memory left. Taken again after a pause.
    Short,
    /// The listener's own (not a socket, invalid): nothing more will come from it.
    Listener,
}

/// Classifies an error of `accept` (see [`AcceptFailure`]).
pub fn accept_failure(e: &io::Error) -> AcceptFailure {
    match e.raw_os_error() {
        Some(
            libc::ECONNABORTED
            | libc::ECONNRESET
            | libc::EPROTO
            | libc::EPERM
            | libc::EINTR
            | libc::ENETDOWN
            | libc::ENOPROTOOPT
            | libc::EHOSTDOWN
            | libc::ENONET
            | libc::EHOSTUNREACH
            | libc::EOPNOTSUPP
            | libc::ENETUNREACH
            | libc::ETIMEDOUT,
        ) => AcceptFailure::Connection,
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM) => AcceptFailure::Short,
        _ if e.kind() == io::ErrorKind::WouldBlock => AcceptFailure::Connection,
        _ => AcceptFailure::Listener,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn an_accept_error_is_the_connections_the_processs_or_the_listeners() {
        let os = io::Error::from_raw_os_error;
        for e in [
            libc::ECONNABORTED,
            libc::EPROTO,
            libc::EHOSTUNREACH,
            libc::ENETUNREACH,
            libc::ETIMEDOUT,
        ] {
            assert_eq!(accept_failure(&os(e)), AcceptFailure::Connection, "{e}");
        }
        for e in [libc::EMFILE, libc::ENFILE, libc::ENOBUFS, libc::ENOMEM] {
            assert_eq!(accept_failure(&os(e)), AcceptFailure::Short, "{e}");
        }
        for e in [libc::EBADF, libc::EINVAL, libc::ENOTSOCK] {
            assert_eq!(accept_failure(&os(e)), AcceptFailure::Listener, "{e}");
        }
        assert_eq!(
            accept_failure(&io::ErrorKind::WouldBlock.into()),
            AcceptFailure::Connection
        );
    }

    /// A watch of 1 s turns with a deadline of 3 s, from t = 0.
    fn hearing() -> Hearing {
        Hearing::new(0, Duration::from_secs(1), Duration::from_secs(3))
    }

    #[test]
    fn a_peer_heard_of_nothing_past_the_deadline_is_silent() {
        let mut h = hearing();
        for t in 1..=3 {
            assert_eq!(h.turn(t * 1000 * MS), None, "at {t} s");
        }
        assert_eq!(h.turn(3001 * MS), Some(Duration::from_millis(3001)));
    }

    #[test]
    fn keepalives_or_traffic_keep_a_peer_alive() {
        let mut h = hearing();
        h.heard(2500 * MS);
        assert_eq!(h.turn(4000 * MS), None);
        assert_eq!(h.turn(5000 * MS), None);
        // Its traffic is as good as its keepalive.
        h.heard(5400 * MS);
        assert_eq!(h.turn(6000 * MS), None);
        assert_eq!(h.turn(7000 * MS), None);
        assert_eq!(h.turn(8000 * MS), None);
        assert_eq!(h.turn(8401 * MS), Some(Duration::from_millis(3001)));
        // An older proof does not move the last one back.
        h.heard(100 * MS);
        assert_eq!(h.turn(8500 * MS), Some(Duration::from_millis(3100)));
    }

    #[test]
    fn time_this_side_did_not_run_is_not_the_peers_silence() {
        let mut h = hearing();
        assert_eq!(h.turn(1000 * MS), None);
        // Starved for 5 s: the next turn comes 5 s late and judges nothing yet.
        assert_eq!(h.turn(6000 * MS), None);
        assert_eq!(h.turn(7000 * MS), None);
        assert_eq!(
            h.turn(9000 * MS),
            None,
            "a turn 2 periods late still counts as awake"
        );
        assert_eq!(h.turn(9001 * MS), Some(Duration::from_millis(3001)));
    }

    #[test]
    fn a_turn_just_over_two_periods_late_restarts_the_count() {
        let mut h = hearing();
        assert_eq!(h.turn(2000 * MS), None);
        assert_eq!(h.turn(4001 * MS), None);
        for t in [5001, 6001, 7001] {
            assert_eq!(h.turn(t * MS), None, "at {t} ms");
        }
        assert_eq!(h.turn(7002 * MS), Some(Duration::from_millis(3001)));
    }
}
