//! How connected mode starts ([`Manager::start`]): the HCA opened and its resources sized by
//! the memory plan, the TUN device and its netlink settings, the engine, the handshake
//! listener and the device's events; and the cap the policy may lower.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::Arc,
    time::Duration,
};

use ipoib_common::{PeerEntry, PeerKey, PeerMode, PeerPin};
use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::mpsc,
};

use super::{
    CmError, CmOptions, Command, Core, GSO_MAX_SIZE, LinkChanges, Manager,
    engine_task::{make_engines, spawn_engine},
};
use crate::{
    clock::monotonic_ns,
    cm::{Cm, Resolve, SetupConfig},
    engine::RawFdRef,
    ledger::Ledger,
    maps::DatapathMaps,
    netdev,
    plan::{self, CM_BUF_SIZE, CM_BUF_STRIDE, PlanKind},
    policy::Mode,
    promotion::{Promoter, UdPath},
    rtnl::{self, AddressMirror, Rtnl},
    tun::Tun,
    verbs::{self, Device, Receive, ReceiveModel, Resources, VerbsError},
};

impl Manager {
    /// Sets connected mode up on `iface` (attached, its maps pinned in `pin_dir`): the plan,
    /// verbs resources, TUN device, engine, handshake listener and device events. When this
    /// returns Ok, connected mode runs and every stale CM entry is reset to UD. Must be called
    /// inside a tokio runtime.
    pub async fn start(iface: &str, pin_dir: &Path, opts: CmOptions) -> Result<Self, CmError> {
        let (t0, dev, port) = (std::time::Instant::now(), &opts.device, opts.port);
        tracing::info!("starting connected mode on {iface}: {dev} port {port}");
        // Blocking, on the loop's thread: the kernel lists an RDMA object under the thread that
        // made it (docs/architecture.md). The rest is awaited.
        let (hca, ledger) = open_hca(iface, &opts)?;
        test_start_delay(iface, &opts).await;
        let mut maps = DatapathMaps::from_pins(pin_dir)?;
        let listener = listen(iface, opts.ctl_port)?;
        let rtnl = Arc::new(Rtnl::new()?);
        let (queues, tun_ifindex, addresses) = open_tun(&rtnl, iface, opts.lanes).await?;
        let engines = make_engines(iface, queues, hca.res.clone()).await?;
        let device_events = watch_device(&hca.dev)?;
        let _ = std::fs::remove_file(&opts.status_path);
        reset_peers(&mut maps)?;
        // Nothing fails past this point: what runs from here is undone by `shutdown`.
        let link = lower_gso(rtnl, iface, addresses).await?;
        // Path records where the peers' addresses are on the fabric (IPoIB), not in the lab.
        let setup = SetupConfig {
            device: Some(iface.to_string()),
            path_records: matches!(opts.resolve, Resolve::Neighbour { .. }),
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
            match port.link_layer {
                crate::path::LinkLayer::Ethernet => "RoCE",
                crate::path::LinkLayer::InfiniBand => "IB",
            },
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
}

/// Makes the stack accept IPv4 packets written into the TUN device from peers whose route is
/// the IPoIB interface. The reverse-path filter uses max(all, device): the device's own
/// setting goes to 0; with `all` at 2 (loose, systemd's default) a device without an IPv4
/// address still fails the check (fib_validate_source: no address -> last resort -> drop),
/// so the interface's IPv4 addresses are added to it as /32 without a prefix route, which
/// changes no routing. With `all` at 1 (strict) nothing arriving on the TUN device passes:
/// said loudly.
pub(super) async fn accept_on_tun(
    iface: &rtnl::NamedLink,
    tun: &rtnl::NamedLink,
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
pub(super) struct Hca {
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
pub(super) fn open_hca(iface: &str, opts: &CmOptions) -> Result<(Hca, Arc<Ledger>), CmError> {
    let dev = open_device(&opts.device)?;
    let port = dev.port_now(opts.port)?;
    port.ready().map_err(|why| CmError::PortNotReady {
        device: opts.device.clone(),
        port: opts.port,
        why,
    })?;
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
pub(super) async fn test_start_delay(iface: &str, opts: &CmOptions) {
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

pub(super) fn open_device(name: &str) -> Result<Device, CmError> {
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
pub(super) fn partition_index(dev: &Device, port: u8, pkey: Option<u16>) -> Result<u16, CmError> {
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
pub(super) fn build(
    dev: &Device,
    opts: &CmOptions,
    p: &plan::Plan,
    pkey_index: u16,
) -> Result<Hca, CmError> {
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
pub(super) async fn open_tun(
    rtnl: &Rtnl,
    iface: &str,
    queues: u32,
) -> Result<(Vec<Tun>, u32, Option<AddressMirror>), CmError> {
    let iface = rtnl::NamedLink {
        index: netdev::Netdev::lookup(iface)?.ifindex,
        name: iface.to_string(),
    };
    // IFNAMSIZ is 16 with the NUL: 13 characters at most before the suffix.
    let want = format!("{}cm", iface.name.chars().take(13).collect::<String>());
    let tun = Tun::create_queues(&want, queues as usize, true)?;
    let link = rtnl::NamedLink {
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
pub(super) async fn lower_gso(
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
pub(super) fn reset_peers(maps: &mut DatapathMaps) -> Result<(), CmError> {
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

/// The decision core with the plan's cap (lowered by policy), its setup limit already given
/// to `cm`, before the listener takes a REQ.
pub(super) fn new_core(iface: &str, opts: &CmOptions, hca: &Hca, cm: &Cm) -> Core {
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
pub(super) fn watch_device(dev: &Device) -> Result<AsyncFd<RawFdRef>, CmError> {
    // SAFETY: the fd belongs to the device context, which the manager's `dev` keeps open for
    // as long as this AsyncFd lives (the manager drops it first).
    unsafe { AsyncFd::register_with_interest(RawFdRef(dev.async_fd()), Interest::READABLE) }
        .map_err(|e| CmError::Io(e.into_parts().1))
}

/// The operator's pins, by address, from the peers map as read.
pub(super) fn pins(peers: &[(PeerKey, PeerEntry)]) -> Vec<(IpAddr, PeerPin)> {
    peers
        .iter()
        .filter_map(|(k, e)| Some((k.ip()?, PeerPin::try_from(e.pin).unwrap_or_default())))
        .collect()
}

/// The plan's cap as the policy lowers it now ([`live_cap`]; the state file is read on
/// every tick, so a `set-policy` takes effect live).
pub(super) fn cap(iface: &str, plan_max: usize, ring_bytes: Option<u64>) -> usize {
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
pub(super) fn ud_path_line(iface: &str, path: UdPath, promote_rate: f64) -> String {
    let busy = match path {
        UdPath::PerPacket => format!(
            " (a busy peer sends over {:.0} MiB/s in bulk)",
            promote_rate / f64::from(1 << 20)
        ),
        UdPath::Offloaded => String::new(),
    };
    format!("{iface}: the UD path is {path}: {}{busy}", path.effect())
}
