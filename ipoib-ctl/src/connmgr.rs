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

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::{
        Arc, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use ipoib_common::{PeerEntry, PeerKey, PeerMode, PeerPin};
use serde::Serialize;
use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::{mpsc, oneshot, watch},
    task::JoinHandle,
};

pub use self::core::{Command, Core, PeerView, TickInput, Traffic};
use crate::{
    clock::monotonic_ns,
    cm::{Cm, Connection, Gone, RejectReason, SetupConfig, SetupError},
    engine::{
        Engine, EngineConfig, EngineControl, EngineError, EngineEvent, EngineStats, Fault,
        HOUSEKEEPING, RawFdRef, Route,
    },
    ledger::{Ledger, Share},
    maps::{DatapathMaps, MapsError},
    netdev::{self, NetdevError, Resolve},
    plan::{self, CM_BUF_SIZE, CM_BUF_STRIDE, PlanKind, SrqChoice},
    policy::Mode,
    promotion::{Config as PromotionConfig, Failure, Promoter, UdPath},
    rtnl::{self, AddressMirror, Rtnl},
    tun::{Tun, TunError},
    verbs::{self, AsyncEvent, Device, Receive, ReceiveModel, Resources, VerbsError},
};

#[derive(Debug, thiserror::Error)]
pub enum CmError {
    #[error(transparent)]
    Verbs(#[from] VerbsError),
    #[error(transparent)]
    Tun(#[from] TunError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error(transparent)]
    Io(#[from] io::Error),
    /// The handshake port is taken on this interface.
    #[error(
        "the handshake port (TCP {port}) is taken on {iface}: another `ipoib-ctl attach {iface}`, \
         or another program listening on it for every interface (`ss -ltnp 'sport = {port}'`)"
    )]
    PortTaken { iface: String, port: u16 },
    #[error("RDMA device {0} not found")]
    NoDevice(String),
    #[error("{device} has {ports} port(s); port {port} is not one of them")]
    NoPort { device: String, port: u8, ports: u8 },
    #[error(
        "partition P_Key 0x{pkey:04x} is not in the P_Key table of {device} port {port} \
         (`cat /sys/class/infiniband/{device}/ports/{port}/pkeys/*`; the subnet manager \
         gives the port its partitions)"
    )]
    NoPartition { device: String, port: u8, pkey: u16 },
    #[error("the memory plan for {device} allows no connected mode: {why}")]
    NoPlan { device: String, why: String },
    #[error(
        "memory-budget {} is more than the node's whole budget, {} (`--node-memory-budget`)",
        crate::policy::format_size(*asked), crate::policy::format_size(*node)
    )]
    OverNodeBudget { asked: u64, node: u64 },
    #[error(transparent)]
    Netdev(#[from] NetdevError),
    #[error("the engine stopped: {0}")]
    EngineStopped(String),
    #[error("the handshake listener stopped: {0}")]
    ListenerStopped(String),
}

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

/// One peer in the status.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct PeerStatus {
    pub addr: IpAddr,
    pub state: String,
    pub why: String,
    pub failures: u32,
    /// While `failures` counts any: the last one (kept while the next setup runs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<FailureStatus>,
    pub promotions: u64,
}

/// A peer's last failed setup or broken connection, in the status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct FailureStatus {
    pub reason: Failure,
    /// The reason in words.
    pub said: String,
    /// Seconds since it failed, when the status was written.
    pub secs_ago: u64,
}

/// Where receives land, and what they cost, in the CM status.
#[derive(Debug, Clone, Serialize, serde::Deserialize, Default, PartialEq, Eq)]
pub struct ReceiveStatus {
    /// "srq" (one shared receive queue) or "rings" (a ring per connection).
    pub model: String,
    /// Buffers of the SRQ, or of each ring.
    pub depth: u32,
    /// Rings that exist now (set up, in use or being torn down), and the plan's K.
    pub rings: u32,
    pub max_rings: u32,
    /// Receive memory registered now, and the plan's budget.
    pub registered_bytes: u64,
    pub budget_bytes: u64,
    /// Rings made, refused at K, and the mean time to register one (µs).
    pub rings_made: u64,
    pub rings_refused: u64,
    pub ring_register_us: u64,
}

impl ReceiveStatus {
    fn of(recv: &Receive, budget_bytes: u64) -> Self {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let registered_bytes = recv.registered_bytes();
        match recv {
            Receive::Srq(srq) => Self {
                model: "srq".into(),
                depth: srq.depth,
                registered_bytes,
                budget_bytes,
                ..Self::default()
            },
            Receive::Rings(pool) => {
                let made = get(&pool.made);
                Self {
                    model: "rings".into(),
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
}

/// What the CM side reports, written as JSON to `status_path` every tick.
#[derive(Debug, Clone, Serialize, serde::Deserialize, Default)]
pub struct CmStatus {
    pub device: String,
    pub tun: String,
    #[serde(default)]
    pub receive: ReceiveStatus,
    /// The SRQ's buffers (0 with rings per connection).
    pub srq_depth: u32,
    /// Times fewer than a quarter of the SRQ's buffers were posted (the SRQ limit event).
    #[serde(default)]
    pub srq_low_events: u64,
    pub max_connections: usize,
    pub mode: String,
    /// How the interface's UD path segments: `per-packet` (mode auto promotes busy peers) or
    /// `offloaded` (TSO: it promotes none by rate); see [`UdPath`].
    #[serde(default)]
    pub ud_path: String,
    pub connections: usize,
    pub established: u64,
    pub failed: u64,
    /// The node's budget, and what each attached interface holds of it.
    #[serde(default)]
    pub node: NodeBudget,
    /// Incoming handshake streams waiting for their REQ now, and those dropped (oldest
    /// first) because too many waited.
    #[serde(default)]
    pub awaiting_req: u64,
    #[serde(default)]
    pub dropped_awaiting_req: u64,
    /// Tasks alive in the control loop's runtime.
    #[serde(default)]
    pub tasks: u64,
    /// The latest the policy's tick ran after its time, since connected mode started: how
    /// long the thread that runs the control loop, the engine and the handshakes was kept
    /// from it (milliseconds).
    #[serde(default)]
    pub tick_late_max_ms: u64,
    /// Engines, one per lane (TUN queue); `engine` counts for all of them.
    #[serde(default)]
    pub engine_lanes: u32,
    pub engine: HashMap<String, u64>,
    pub peers: Vec<PeerStatus>,
}

/// Where `iface`'s control loop writes its CM status.
pub fn status_path(iface: &str) -> PathBuf {
    crate::attach::run_file(iface, "cm.json")
}

/// The CM status of `iface` as its control loop last wrote it.
pub fn read_status(iface: &str) -> Option<CmStatus> {
    serde_json::from_slice(&std::fs::read(status_path(iface)).ok()?).ok()
}

impl From<&SetupError> for Failure {
    fn from(e: &SetupError) -> Self {
        match e {
            SetupError::Rejected(RejectReason::NoResources | RejectReason::Busy)
            | SetupError::Busy
            | SetupError::Full => Failure::NoResources,
            SetupError::Rejected(_)
            | SetupError::Crossed
            | SetupError::InProgress
            | SetupError::WrongPeer { .. } => Failure::Rejected,
            SetupError::Timeout(_) => Failure::Timeout,
            SetupError::Io(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                Failure::NotRunning
            }
            SetupError::Malformed(_) | SetupError::Unexpected(_) => Failure::NotRunning,
            SetupError::Io(_) => Failure::Network,
            SetupError::Verbs(_) => Failure::QpError,
        }
    }
}

/// GSO packets larger than this would not fit one RC message with the engine's header.
pub const GSO_MAX_SIZE: u32 = 65000;

/// Makes the stack accept IPv4 packets written into the TUN device from peers whose route is
/// the IPoIB interface. The reverse-path filter uses max(all, device): the device's own
/// setting goes to 0; with `all` at 2 (loose, systemd's default) a device without an IPv4
/// address still fails the check (fib_validate_source: no address -> last resort -> drop;
/// seen here: 13 packets in on the TUN device, 13 fewer delivered), so the interface's IPv4
/// addresses are added to it as /32 without a prefix route, which changes no routing. With
/// `all` at 1 (strict) nothing arriving on the TUN device passes: said loudly.
async fn accept_on_tun(
    iface: &rtnl::Link,
    tun: &rtnl::Link,
) -> Result<Option<AddressMirror>, CmError> {
    std::fs::write(
        format!("/proc/sys/net/ipv4/conf/{}/rp_filter", tun.name),
        "0",
    )?;
    let all = std::fs::read_to_string("/proc/sys/net/ipv4/conf/all/rp_filter").unwrap_or_default();
    match all.trim() {
        "1" => tracing::warn!(
            "net.ipv4.conf.all.rp_filter=1 (strict) drops what connected mode receives on {}: \
             set it to 2 (loose) or 0",
            tun.name
        ),
        // The interface's addresses now, and as they change (an address added later would
        // otherwise fail the check for packets to it).
        "2" => {
            return Ok(Some(
                AddressMirror::start(iface.clone(), tun.clone()).await?,
            ));
        }
        _ => {}
    }
    Ok(None)
}

/// The device, its plan and the verbs resources sized by it.
struct Hca {
    dev: Device,
    res: Arc<Resources>,
    model: ReceiveModel,
    plan: plan::Plan,
}

impl Hca {
    /// The SRQ's buffers (0 with rings per connection).
    fn srq_depth(&self) -> u32 {
        match self.model {
            ReceiveModel::Srq { depth } => depth,
            ReceiveModel::Rings { .. } => 0,
        }
    }

    fn max_connections(&self) -> usize {
        self.plan.max_cm_peers as usize
    }
}

/// Opens the device, joins the node's budget (its ledger) and builds what the plan says
/// ([`plan::plan_for_node`]). The receive model follows the HCA: an SRQ where it has one (and
/// `--srq off` did not turn it down), rings per connection otherwise, and also where making
/// the SRQ fails or the node's budget has no room left for one. An SRQ's memory is taken from
/// the node's budget at once; rings take theirs one at a time, as connections come, so any
/// interface may use what the others do not.
fn open_hca(iface: &str, opts: &CmOptions) -> Result<(Hca, Arc<Ledger>), CmError> {
    let dev = open_device(&opts.device)?;
    let limits = dev.limits()?;
    let pkey_index = partition_index(&dev, opts.port, opts.pkey)?;
    let mem = verbs::system_memory();
    let node = opts.node_budget.unwrap_or(plan::budget(mem, None).0);
    let ledger = Arc::new(Ledger::join(iface, node)?);
    let (node, shares) = ledger.view()?;
    if let Some(asked) = opts.memory_budget.filter(|b| *b > node) {
        return Err(CmError::OverNodeBudget { asked, node });
    }
    let others: u64 = shares
        .iter()
        .filter(|s| s.iface != iface)
        .map(|s| s.bytes)
        .sum();
    let free = node.saturating_sub(others);
    let p = plan::plan_for_node(&limits, mem, node, free, opts.memory_budget, opts.srq);
    if p.kind == PlanKind::Srq {
        if ledger.try_take(p.memory_bytes)? {
            match build(&dev, opts, &p, pkey_index) {
                Err(CmError::Verbs(e)) => {
                    ledger.give_back(p.memory_bytes)?;
                    tracing::warn!(
                        "{}: the SRQ could not be made ({e}): a receive ring per connection \
                         instead",
                        opts.device
                    );
                }
                r => return Ok((r?, ledger)),
            }
        } else {
            tracing::warn!(
                "{}: another interface took the node's budget first: a receive ring per \
                 connection instead",
                opts.device
            );
        }
    }
    let p = plan::rings_for_node(&limits, mem, node, opts.memory_budget);
    let hca = build(&dev, opts, &p, pkey_index)?;
    if let Receive::Rings(pool) = &hca.res.recv {
        pool.share_budget(ledger.clone());
    }
    Ok((hca, ledger))
}

/// Tests only (`--test-faults`): each start of connected mode waits after the HCA's setup,
/// awaited as its netlink work is, the milliseconds in `RUN_DIR/IFACE.start-delay`: what a
/// slow start does to the control loop, which goes on beside it.
async fn test_start_delay(iface: &str, opts: &CmOptions) {
    let path = crate::attach::run_file(iface, "start-delay");
    let Some(text) = opts
        .test_faults
        .then(|| std::fs::read_to_string(&path).ok())
        .flatten()
    else {
        return;
    };
    match text.trim().parse() {
        Ok(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
        Err(e) => tracing::warn!("{}: {e}", path.display()),
    }
}

fn open_device(name: &str) -> Result<Device, CmError> {
    Device::open(name).map_err(|e| match e {
        VerbsError::NoDevices => CmError::NoDevice(name.to_string()),
        e => e.into(),
    })
}

/// Checks, before anything is changed, that connected mode can be set up on `port` of
/// `device` in partition `pkey`: the device exists, has that port, and the port is in that
/// partition. The P_Key index found.
pub fn probe(device: &str, port: u8, pkey: Option<u16>) -> Result<u16, CmError> {
    partition_index(&open_device(device)?, port, pkey)
}

/// Where partition `pkey` sits in the P_Key table of `port` (checked to be one of the
/// device's), as the kernel's IPoIB finds it ([`crate::iblink::pkey_index`]); 0 (the
/// default partition) where no partition is named.
fn partition_index(dev: &Device, port: u8, pkey: Option<u16>) -> Result<u16, CmError> {
    let ports = dev.port_count()?;
    if !(1..=ports).contains(&port) {
        return Err(CmError::NoPort {
            device: dev.name().into(),
            port,
            ports,
        });
    }
    let Some(pkey) = pkey else {
        return Ok(0);
    };
    let table = dev.pkey_table(port)?;
    let index = crate::iblink::pkey_index(&table, pkey).ok_or_else(|| CmError::NoPartition {
        device: dev.name().into(),
        port,
        pkey,
    })?;
    tracing::info!(
        "{}: partition 0x{pkey:04x} at P_Key index {index} of port {port} (table {table:04x?})",
        dev.name()
    );
    Ok(index)
}

/// The resources of plan `p` on `dev`, QPs in the partition at `pkey_index`.
fn build(dev: &Device, opts: &CmOptions, p: &plan::Plan, pkey_index: u16) -> Result<Hca, CmError> {
    let (depth, k) = (
        p.ring as u32,
        p.max_cm_peers.min(u64::from(u32::MAX)) as u32,
    );
    let model = match p.kind {
        PlanKind::Srq => ReceiveModel::Srq { depth },
        PlanKind::PerConnection => ReceiveModel::Rings { depth, max: k },
        PlanKind::UdOnly => {
            return Err(CmError::NoPlan {
                device: opts.device.clone(),
                why: p.why.clone(),
            });
        }
    };
    let (buffer, t0) = (p.buffer_bytes as u32, std::time::Instant::now());
    let res = Resources::create_lanes(
        dev,
        opts.port,
        pkey_index,
        model,
        buffer,
        opts.send_slots,
        CM_BUF_STRIDE,
        opts.lanes,
    )?;
    tracing::info!(
        "{}: {model:?} and {} send slots set up in {:.1?}: {}",
        opts.device,
        opts.send_slots,
        t0.elapsed(),
        p.why
    );
    Ok(Hca {
        dev: dev.clone(),
        res,
        model,
        plan: p.clone(),
    })
}

/// The TUN device `IFACEcm`: no IPv6 link-local address (the kernel's own chatter would come
/// to the engine), a 64 KiB MTU, reverse-path filtering that accepts what arrives on it (see
/// [`accept_on_tun`]). Returns it, its ifindex and what keeps its addresses.
async fn open_tun(
    rtnl: &Rtnl,
    iface: &str,
    queues: u32,
) -> Result<(Vec<Tun>, u32, Option<AddressMirror>), CmError> {
    let iface = rtnl::Link {
        index: netdev::Netdev::lookup(iface)?.ifindex,
        name: iface.to_string(),
    };
    // IFNAMSIZ is 16 with the NUL: 13 characters at most before the suffix.
    let want = format!("{}cm", iface.name.chars().take(13).collect::<String>());
    let tun = Tun::create_queues(&want, queues as usize, true)?;
    let link = rtnl::Link {
        index: netdev::Netdev::lookup(tun[0].name())?.ifindex,
        name: tun[0].name().to_string(),
    };
    rtnl.bring_up_without_ipv6(link.index, 65520).await?;
    let mirror = accept_on_tun(&iface, &link).await?;
    Ok((tun, link.index, mirror))
}

/// The stack builds GSO packets for the interface the route uses: keep them small enough for
/// one RC message (header included), or the engine would have to drop them. Returns what
/// was changed, to undo.
async fn lower_gso(
    rtnl: Arc<Rtnl>,
    iface: &str,
    addresses: Option<AddressMirror>,
) -> Result<LinkChanges, CmError> {
    let link = rtnl.link(iface).await?;
    let before = link.gso_max_size;
    if before.is_none_or(|g| g > GSO_MAX_SIZE) {
        rtnl.set_gso_max_size(link.index, GSO_MAX_SIZE).await?;
        tracing::info!(
            "{iface}: gso_max_size {} -> {GSO_MAX_SIZE} (a GSO packet must fit one RC \
             message); restored on exit",
            before.map_or("unknown".into(), |g| g.to_string())
        );
    }
    Ok(LinkChanges {
        rtnl,
        iface_index: link.index,
        gso_before: before,
        _addresses: addresses,
    })
}

/// A previous control loop that died (kill -9, a crash) left its peers CM_UP or CM_PENDING,
/// pointing at a TUN device that is gone: UD until connected again.
fn reset_peers(maps: &mut DatapathMaps) -> Result<(), CmError> {
    for (key, e) in maps.peers()? {
        if e.mode != u8::from(PeerMode::Ud) {
            let entry = PeerEntry {
                mode: PeerMode::Ud.into(),
                cm_ifindex: 0,
                generation: e.generation.wrapping_add(1),
                ..e
            };
            maps.set_peer(key, entry)?;
        }
    }
    Ok(())
}

/// The node's receive-memory budget in the status: its size and each interface's share.
#[derive(Debug, Clone, Serialize, serde::Deserialize, Default)]
pub struct NodeBudget {
    pub budget_bytes: u64,
    pub shares: Vec<Share>,
}

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
    /// The connection ended: `gone` says how the peer went, None when we closed it.
    Closed {
        ip: IpAddr,
        qpn: u32,
        gone: Option<Gone>,
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

/// The running engine (its lanes') and how to stop it.
struct EngineTask {
    control: EngineControl,
    /// Each lane's counters.
    stats: Vec<Arc<EngineStats>>,
    stop: watch::Sender<bool>,
    /// The engine's task; with several lanes, a task that ends when the first lane does and
    /// stops the others. None once it ended.
    task: Option<JoinHandle<Result<(), EngineError>>>,
}

/// Why a task ended (the engine's, the listener's: `result` takes its outcome from what it
/// returned): it returned, returned an error, panicked or was aborted. Never, once it was
/// taken.
async fn task_end<T, E: std::fmt::Display>(
    task: &mut Option<JoinHandle<T>>,
    result: impl FnOnce(T) -> Result<(), E>,
) -> String {
    let Some(t) = task else {
        return std::future::pending().await;
    };
    match t.await.map(result) {
        Ok(Ok(())) => "it returned".into(),
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    }
}

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
/// with [`Manager::next_input`] and [`Manager::handle`]; ended by [`Manager::shutdown`].
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

    /// Sets connected mode up on `iface` (attached, its maps pinned in `pin_dir`): the plan,
    /// verbs resources, TUN device, engine, handshake listener and device events. When this
    /// returns Ok, connected mode runs and every stale CM entry is reset to UD. Must be called
    /// inside a tokio runtime.
    pub async fn start(iface: &str, pin_dir: &Path, opts: CmOptions) -> Result<Self, CmError> {
        let (t0, dev, port) = (std::time::Instant::now(), &opts.device, opts.port);
        tracing::info!("starting connected mode on {iface}: {dev} port {port}");
        // Blocking, on the loop's thread (made on another, the SRQ's region was missing from
        // `rdma resource show mr` under our PID); 0.2-0.4 s on soft-RoCE. The rest is awaited.
        let (hca, ledger) = open_hca(iface, &opts)?;
        test_start_delay(iface, &opts).await;
        let mut maps = DatapathMaps::from_pins(pin_dir)?;
        let listener = listen(iface, opts.ctl_port)?;
        let rtnl = Arc::new(Rtnl::new()?);
        let (queues, tun_ifindex, addresses) = open_tun(&rtnl, iface, opts.lanes).await?;
        let engines = make_engines(queues, hca.res.clone()).await?;
        let device_events = watch_device(&hca.dev)?;
        let _ = std::fs::remove_file(&opts.status_path);
        reset_peers(&mut maps)?;
        // Nothing fails past this point: what runs from here is undone by `shutdown`.
        let link = lower_gso(rtnl, iface, addresses).await?;
        let setup = SetupConfig {
            device: Some(iface.to_string()),
            ..SetupConfig::default()
        };
        let cm = Arc::new(Cm::new(hca.res.clone(), opts.ud_qpn, setup));
        let core = new_core(iface, &opts, &hca, &cm);
        let (acc_tx, accepted) = mpsc::unbounded_channel();
        let serve = Some(tokio::spawn(cm.clone().serve(listener, acc_tx)));
        let tun_name = engines[0].tun_name().to_string();
        let (engine, engine_events) = spawn_engine(engines);
        let (outcomes_tx, outcomes) = mpsc::unbounded_channel();
        let tick = crate::clock::delayed_interval(opts.tick);
        let m = Self {
            device_events,
            iface: iface.to_string(),
            core,
            maps,
            srq_depth: hca.srq_depth(),
            plan_max: hca.max_connections(),
            budget_bytes: hca.plan.budget_bytes,
            ledger,
            dev: hca.dev,
            res: hca.res,
            cm,
            serve,
            engine,
            engine_events,
            accepted,
            outcomes_tx,
            outcomes,
            parked: HashMap::new(),
            watched: HashMap::new(),
            tick,
            tun: tun_name,
            tun_ifindex,
            link,
            opts,
            looked_at: monotonic_ns(),
            awake_since: monotonic_ns(),
            tick_late_max: Duration::ZERO,
        };
        m.started(t0.elapsed());
        Ok(m)
    }

    /// Says what runs, in the log and in the status file (before the first tick: whoever
    /// sees the control loop up finds connected mode's status), and how long the start took
    /// (the HCA's setup, the part that blocks, is logged by itself: "set up in").
    fn started(&self, took: Duration) {
        self.write_status();
        tracing::info!("connected mode on {} started in {took:.1?}", self.iface);
        let port = &self.res.port;
        let receive = match &self.res.recv {
            Receive::Srq(srq) => format!("SRQ {} x {CM_BUF_SIZE} B", srq.depth),
            Receive::Rings(pool) => format!(
                "a ring of {} x {CM_BUF_SIZE} B per connection, at most {} rings",
                pool.depth, pool.max
            ),
        };
        tracing::info!(
            "CM on {}: {} port {} ({} GID index {}, P_Key index {}), TUN {}, {receive}, at \
             most {} connections, handshake on TCP {}",
            self.iface,
            self.opts.device,
            self.opts.port,
            if port.ethernet { "RoCE" } else { "IB" },
            port.gid_index,
            port.pkey_index,
            self.tun,
            self.core.max_connections(),
            self.opts.ctl_port
        );
        tracing::info!(
            "{}",
            ud_path_line(
                &self.iface,
                self.core.ud_path(),
                self.opts.promotion.promote_rate
            )
        );
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
    pub fn handle(&mut self, input: Input) -> Result<(), CmError> {
        match input {
            Input::Tick => self.on_tick()?,
            Input::Engine(e) => self.on_engine_event(e),
            Input::DeviceEvents => self.on_device_events(),
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
    /// the SRQ running low, a port changing state.
    fn on_device_events(&mut self) {
        loop {
            match self.dev.async_event(Duration::ZERO) {
                Ok(Some(AsyncEvent::QpFatal(qpn))) => {
                    self.core
                        .handle_qp_error(monotonic_ns(), qpn, "device event: QP fatal");
                }
                Ok(Some(AsyncEvent::SrqLimitReached)) => self.core.handle_srq_limit(),
                Ok(Some(AsyncEvent::PortChange(port))) => {
                    tracing::info!("{} port {port} changed state", self.opts.device);
                }
                Ok(Some(other)) => tracing::debug!("device event {other:?}"),
                Ok(None) => return,
                Err(e) => {
                    tracing::warn!("reading device events: {e}");
                    return;
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
            Outcome::Closed { ip, qpn, gone } => {
                self.watched.remove(&qpn);
                self.core.handle_closed(now, ip, qpn, gone);
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
                        c.close();
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
        tokio::spawn(async move {
            let gone = tokio::select! {
                g = c.watch(dead_after / 3, dead_after, &traffic) => Some(g),
                _ = close_rx => None,
            };
            c.close();
            let _ = tx.send(Outcome::Closed { ip, qpn, gone });
        });
    }

    fn write_status(&self) {
        let peers = self
            .core
            .peers(monotonic_ns())
            .into_iter()
            .map(PeerStatus::from)
            .collect();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let engine = EngineStats::total(self.engine.stats.iter().map(|s| &**s)).snapshot();
        let status = CmStatus {
            device: self.opts.device.clone(),
            tun: self.tun.clone(),
            receive: ReceiveStatus::of(&self.res.recv, self.budget_bytes),
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
            mode: self.core.mode().to_string(),
            ud_path: self.core.ud_path().to_string(),
            connections: self.core.connections(),
            established: get(&self.cm.stats.established),
            failed: get(&self.cm.stats.failed),
            awaiting_req: get(&self.cm.stats.awaiting_req),
            dropped_awaiting_req: get(&self.cm.stats.dropped_awaiting_req),
            tasks: tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks() as u64,
            tick_late_max_ms: self.tick_late_max.as_millis() as u64,
            engine_lanes: self.engine.stats.len() as u32,
            engine: engine
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            peers,
        };
        if let Ok(json) = serde_json::to_vec_pretty(&status)
            && let Err(e) = crate::files::replace(&self.opts.status_path, &json)
        {
            tracing::debug!("writing {}: {e}", self.opts.status_path.display());
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
        // Let the engine drop the routes and the watchers close their QPs.
        tokio::time::sleep(Duration::from_millis(50)).await;
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

impl From<PeerView> for PeerStatus {
    fn from(p: PeerView) -> Self {
        Self {
            addr: p.addr,
            state: p.state.into(),
            why: p.why,
            failures: p.failures,
            last_failure: p.last_failure.map(|l| FailureStatus {
                reason: l.why,
                said: l.why.to_string(),
                secs_ago: l.ago.as_secs(),
            }),
            promotions: p.promotions,
        }
    }
}

/// The decision core with the plan's cap (lowered by policy), its setup limit already given
/// to `cm`, before the listener takes a REQ.
fn new_core(iface: &str, opts: &CmOptions, hca: &Hca, cm: &Cm) -> Core {
    let mut promo = opts.promotion.clone();
    let ring_bytes = hca.res.recv.rings().map(|p| p.ring_bytes());
    promo.max_connections = cap(iface, hca.max_connections(), ring_bytes);
    let mut promoter = Promoter::new(promo, Mode::Auto);
    match netdev::tso_on(iface) {
        Ok(tso) => promoter.set_ud_path(UdPath::of_tso(tso)),
        Err(e) => tracing::warn!("{e}: the UD path is taken to build every datagram"),
    }
    let mut core = Core::new(promoter, hca.srq_depth());
    while let Some(c) = core.next_command() {
        if let Command::SetSetupLimit(n) = c {
            cm.set_limit(n);
        }
    }
    core
}

/// The handshake listener of `iface`: `[::]:port` (IPv4 too) bound to the interface
/// (SO_BINDTODEVICE), so every attached interface of a node has its own on the same port, and
/// a REQ is taken by the interface it came through, whose HCA port serves it.
pub fn listen(iface: &str, port: u16) -> Result<tokio::net::TcpListener, CmError> {
    let s = tokio::net::TcpSocket::new_v6()?;
    s.set_reuseaddr(true)?;
    s.bind_device(Some(iface.as_bytes()))?;
    match s.bind(SocketAddr::from(([0u8; 16], port))) {
        Err(e) if e.kind() == io::ErrorKind::AddrInUse => Err(CmError::PortTaken {
            iface: iface.to_string(),
            port,
        }),
        r => r.map_err(CmError::from),
    }?;
    Ok(s.listen(1024)?)
}

/// The device's async fd, watched by the runtime.
fn watch_device(dev: &Device) -> Result<AsyncFd<RawFdRef>, CmError> {
    // SAFETY: the fd belongs to the device context, which the manager's `dev` keeps open for
    // as long as this AsyncFd lives (the manager drops it first).
    unsafe { AsyncFd::register_with_interest(RawFdRef(dev.async_fd()), Interest::READABLE) }
        .map_err(|e| CmError::Io(e.into_parts().1))
}

/// Waits for the engine's task to end after its stop; one that does not within a second (a
/// stalled engine) is aborted. Either way the engine, and its TUN device, are dropped.
async fn stop_engine(mut task: JoinHandle<Result<(), EngineError>>) -> Result<(), CmError> {
    match tokio::time::timeout(Duration::from_secs(1), &mut task).await {
        Ok(Ok(r)) => r.map_err(CmError::from),
        Ok(Err(e)) => Err(CmError::Io(io::Error::other(format!(
            "the engine task: {e}"
        )))),
        Err(_) => {
            task.abort();
            let _ = task.await;
            tracing::warn!("the engine did not stop within 1 s: aborted");
            Ok(())
        }
    }
}

/// The engine with its control and events: one lane's as a task of this runtime; several
/// lanes' each on a thread of its own, watched by a task of this runtime that ends when the
/// first lane does (the others are then stopped: connected mode restarts whole).
fn spawn_engine(mut engines: Vec<Engine>) -> (EngineTask, mpsc::UnboundedReceiver<EngineEvent>) {
    let (events_tx, events) = mpsc::unbounded_channel();
    for e in &mut engines {
        e.report_to(events_tx.clone());
    }
    let control = engines[0].control();
    let stats = engines.iter().map(Engine::stats).collect();
    let (stop, stop_rx) = watch::channel(false);
    let task = if engines.len() == 1 {
        let mut engine = engines.remove(0);
        tokio::spawn(async move {
            let r = engine.run(stopped(stop_rx)).await;
            drop(engine);
            r
        })
    } else {
        let stop_all = stop.clone();
        tokio::spawn(async move {
            let mut lanes = tokio::task::JoinSet::new();
            for engine in engines {
                lanes.spawn(on_thread(engine, stop_rx.clone()));
            }
            let first = lanes.join_next().await;
            let _ = stop_all.send(true);
            // The others end on the stop, their engines and TUN queues dropped; one that does
            // not within a second (hung) is left to end with the process.
            let rest = async { while lanes.join_next().await.is_some() {} };
            let _ = tokio::time::timeout(Duration::from_secs(1), rest).await;
            match first {
                Some(Ok(r)) => r,
                Some(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                Some(Err(e)) => Err(EngineError::Lane(e.to_string())),
                None => Ok(()),
            }
        })
    };
    let t = EngineTask {
        control,
        stats,
        stop,
        task: Some(task),
    };
    (t, events)
}

/// An engine per lane of `res`, one per TUN queue. One lane's on this thread (a node on one
/// lane runs one thread per interface); several lanes' off it, since that gives the device the
/// steering program (loaded the first time: tens of ms on a real CPU, seconds under
/// emulation).
async fn make_engines(queues: Vec<Tun>, res: Arc<Resources>) -> Result<Vec<Engine>, CmError> {
    if queues.len() == 1 {
        return Ok(Engine::lanes(queues, res, EngineConfig::default())?);
    }
    tokio::task::spawn_blocking(move || Engine::lanes(queues, res, EngineConfig::default()))
        .await
        .map_err(|e| CmError::Io(io::Error::other(format!("making the engines: {e}"))))?
        .map_err(CmError::from)
}

/// Resolves once `stop` says so (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Runs one lane's engine on a thread of its own until `stop`; its result, or its panic,
/// once it ends.
async fn on_thread(engine: Engine, stop: watch::Receiver<bool>) -> Result<(), EngineError> {
    let lane = engine.lane();
    let (tx, rx) = oneshot::channel();
    engine
        .spawn_thread(stopped(stop), move |r| {
            let _ = tx.send(r);
        })
        .map_err(|e| EngineError::Lane(format!("lane {lane}'s thread: {e}")))?;
    match rx.await {
        Ok(r) => r,
        // The thread ended without a word: it panicked (and said so on stderr).
        Err(_) => panic!("the engine of lane {lane} panicked"),
    }
}

/// The operator's pins, by address, from the peers map as read.
fn pins(peers: &[(PeerKey, PeerEntry)]) -> Vec<(IpAddr, PeerPin)> {
    peers
        .iter()
        .filter_map(|(k, e)| Some((k.ip()?, PeerPin::try_from(e.pin).unwrap_or_default())))
        .collect()
}

/// The plan's cap as the policy lowers it now ([`live_cap`]; the state file is read on
/// every tick, so a `set-policy` takes effect live).
fn cap(iface: &str, plan_max: usize, ring_bytes: Option<u64>) -> usize {
    let state = crate::attach::read_state(iface);
    live_cap(
        plan_max,
        state.as_ref().and_then(|s| s.max_connections),
        state.as_ref().and_then(|s| s.memory_budget),
        ring_bytes,
    )
}

/// The connections allowed now: the plan's cap, lowered by policy `max-connections` and,
/// with a receive ring per connection (`ring_bytes` each), by the rings policy
/// `memory-budget` holds. Only lowered: the completion queue and the pool were sized for the
/// plan at attach, so a budget above it, and any budget for an SRQ (made once), takes effect
/// at the next attach.
pub fn live_cap(
    plan_max: usize,
    max_connections: Option<u32>,
    memory_budget: Option<u64>,
    ring_bytes: Option<u64>,
) -> usize {
    let by_count = max_connections.map_or(plan_max, |n| n as usize);
    let by_memory = match (memory_budget, ring_bytes) {
        (Some(budget), Some(ring)) if ring > 0 => {
            usize::try_from(budget / ring).unwrap_or(usize::MAX)
        }
        _ => plan_max,
    };
    plan_max.min(by_count).min(by_memory)
}

/// The start log's line on the UD path: what it is, what that means for mode `auto`, and the
/// rate that makes a peer busy where a rate promotes at all (`promote_rate`, bytes/s).
fn ud_path_line(iface: &str, path: UdPath, promote_rate: f64) -> String {
    let busy = match path {
        UdPath::PerPacket => format!(
            " (a busy peer sends over {:.0} MiB/s in bulk)",
            promote_rate / f64::from(1 << 20)
        ),
        UdPath::Offloaded => String::new(),
    };
    format!("{iface}: the UD path is {path}: {}{busy}", path.effect())
}

#[cfg(test)]
mod tests {
    use super::live_cap;

    /// What status says of a failed setup comes from here: a refused handshake port is a peer
    /// without ipoib-hybrid, not a QP error.
    #[test]
    fn setup_errors_are_filed_as_what_they_are() {
        use std::io::{Error, ErrorKind};

        use crate::{
            cm::{SetupError, wire::RejectReason},
            promotion::Failure,
        };
        let f = |e: SetupError| Failure::from(&e);
        assert_eq!(
            f(SetupError::Io(Error::from(ErrorKind::ConnectionRefused))),
            Failure::NotRunning
        );
        assert_eq!(
            f(SetupError::Unexpected(crate::cm::wire::Kind::Rep)),
            Failure::NotRunning
        );
        assert_eq!(
            f(SetupError::Io(Error::from(ErrorKind::ConnectionReset))),
            Failure::Network
        );
        assert_eq!(f(SetupError::Timeout("REP")), Failure::Timeout);
        assert_eq!(f(SetupError::Full), Failure::NoResources);
        assert_eq!(
            f(SetupError::Rejected(RejectReason::NoResources)),
            Failure::NoResources
        );
        assert_eq!(f(SetupError::Crossed), Failure::Rejected);
    }

    /// A rate threshold is named only where a rate promotes: never on an offloaded UD path.
    #[test]
    fn the_start_line_names_the_bulk_rate_only_where_it_promotes() {
        use super::ud_path_line;
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
