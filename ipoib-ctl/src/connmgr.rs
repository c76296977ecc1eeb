//! The CM side of `ipoib-ctl attach`: verbs resources sized by the memory plan, the TUN device
//! and the [`engine`](crate::engine), the handshake listener, and the
//! [`promotion`](crate::promotion) policy driven once a second by the fast path's per-peer
//! counters. It writes the fast path's peer map: a peer becomes `CM_UP` (redirected to the
//! TUN device) only once its connection is established, and goes back to `UD` before the
//! connection is torn down, so nothing is redirected into a dead connection.
//!
//! Runs on its own thread with a single-threaded tokio runtime, beside the heartbeat loop.

use std::{
    collections::HashMap,
    io,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use ipoib_common::{PeerEntry, PeerKey, peer_mode, peer_pin};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};

use crate::{
    clock::monotonic_ns,
    cm::{Cm, Connection, Gone, HwAddr, RejectReason, Resources, SetupConfig, SetupError},
    engine::{Engine, EngineConfig, EngineError, EngineEvent, EngineStats, Route, Routes},
    maps::{DatapathMaps, MapsError},
    plan::{self, CM_BUF_SIZE, PAGE_SIZE, PlanKind},
    policy::Mode,
    promotion::{
        Action, Config as PromotionConfig, Failure, Pin as PeerPin, Promoter, Sample, State,
    },
    tun::{Tun, TunError},
    verbs::{
        self, AsyncEvent, CompletionQueue, Device, MemoryRegion, SharedReceiveQueue, VerbsError,
    },
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
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("RDMA device {0} not found")]
    NoDevice(String),
    #[error("the memory plan for {device} allows no connected mode: {why}")]
    NoPlan { device: String, why: String },
    #[error("configuring {dev}: `{cmd}` failed: {stderr}")]
    Ip {
        dev: String,
        cmd: String,
        stderr: String,
    },
}

/// How a peer's IPoIB hardware address (GID and UD QPN) is found from its IP address.
#[derive(Debug, Clone)]
pub enum Resolve {
    /// IPoIB: the neighbour table of this interface (the 20-byte link-layer address).
    Neighbour(String),
    /// The lab (Ethernet, one soft-RoCE device shared by every node): the peer's GID is our
    /// own and its UD QPN is [`lab_ud_qpn`] of its address.
    Lab,
}

/// The lab's stand-in UD QPN of a node: 0x100 plus the last byte of its address.
pub fn lab_ud_qpn(ip: IpAddr) -> u32 {
    let last = match ip {
        IpAddr::V4(a) => a.octets()[3],
        IpAddr::V6(a) => a.octets()[15],
    };
    0x100 + u32::from(last)
}

/// Parses a 20-byte IPoIB hardware address (`80:00:00:48:fe:80:...`): flags, QPN, GID.
pub fn parse_ipoib_hwaddr(s: &str) -> Option<HwAddr> {
    let b: Vec<u8> = s
        .split(':')
        .map(|h| u8::from_str_radix(h, 16))
        .collect::<Result<_, _>>()
        .ok()?;
    if b.len() != 20 {
        return None;
    }
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[4..]);
    Some(HwAddr {
        gid,
        ud_qpn: u32::from_be_bytes([0, b[1], b[2], b[3]]),
    })
}

impl Resolve {
    async fn peer(&self, ip: IpAddr, own_gid: [u8; 16]) -> Option<HwAddr> {
        match self {
            Resolve::Lab => Some(HwAddr {
                gid: own_gid,
                ud_qpn: lab_ud_qpn(ip),
            }),
            Resolve::Neighbour(iface) => {
                parse_ipoib_hwaddr(&crate::netdev::neighbour(iface, ip).await?)
            }
        }
    }
}

/// What `attach` passes in.
#[derive(Debug, Clone)]
pub struct CmOptions {
    /// The RDMA device and port under the interface.
    pub device: String,
    pub port: u8,
    /// Our UD QPN (the interface's hardware address; the lab's stand-in).
    pub ud_qpn: u32,
    pub resolve: Resolve,
    /// The handshake's TCP port (policy `ctl-port`).
    pub ctl_port: u16,
    /// Policy `memory-budget`, or None for the automatic rule.
    pub memory_budget: Option<u64>,
    /// Registered send buffers, shared by every connection.
    pub send_slots: u32,
    /// How often the policy runs.
    pub tick: Duration,
    /// Where the status is written (JSON), once per tick.
    pub status_path: PathBuf,
    /// Overrides of the promotion policy's defaults (the plan sets `max_connections`).
    pub promotion: PromotionConfig,
}

/// One peer in the status.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct PeerStatus {
    pub addr: IpAddr,
    pub state: String,
    pub why: String,
    pub failures: u32,
    pub promotions: u64,
}

/// What the CM side reports, written as JSON to `status_path` every tick.
#[derive(Debug, Clone, Serialize, serde::Deserialize, Default)]
pub struct CmStatus {
    pub device: String,
    pub tun: String,
    pub srq_depth: u32,
    /// Times fewer than a quarter of the SRQ's buffers were posted (the SRQ limit event).
    #[serde(default)]
    pub srq_low_events: u64,
    pub max_connections: usize,
    pub mode: String,
    pub connections: usize,
    pub established: u64,
    pub failed: u64,
    pub engine: HashMap<String, u64>,
    pub peers: Vec<PeerStatus>,
}

/// The CM status of `iface` as its control loop last wrote it.
pub fn read_status(iface: &str) -> Option<CmStatus> {
    let path = PathBuf::from(crate::attach::RUN_DIR).join(format!("{iface}.cm.json"));
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// The running CM side; stops on [`CmHandle::stop`].
pub struct CmHandle {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), CmError>>>,
}

impl CmHandle {
    /// Stops it: every connection is marked UD in the map, then closed; the TUN device goes.
    pub fn stop(mut self) -> Result<(), CmError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(CmError::Io(io::Error::other("the CM thread panicked"))),
            None => Ok(()),
        }
    }
}

impl Drop for CmHandle {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn ip_cmd(dev: &str, args: &[&str]) -> Result<(), CmError> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => CmError::Ip {
                dev: dev.into(),
                cmd: format!("ip {}", args.join(" ")),
                stderr: "`ip` is not installed (Debian package iproute2)".into(),
            },
            _ => e.into(),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(CmError::Ip {
            dev: dev.into(),
            cmd: format!("ip {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().into(),
        })
    }
}

/// Sets everything up and starts the CM thread; returns once it runs (or why it cannot).
pub fn start(iface: &str, pin_dir: PathBuf, opts: CmOptions) -> Result<CmHandle, CmError> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (stop_tx, stop_rx) = oneshot::channel();
    let iface = iface.to_string();
    let thread = std::thread::Builder::new()
        .name("ipoib-cm".into())
        .spawn(move || run(iface, pin_dir, opts, ready_tx, stop_rx))?;
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(CmHandle {
            stop: Some(stop_tx),
            thread: Some(thread),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => match thread.join() {
            Ok(Err(e)) => Err(e),
            _ => Err(CmError::Io(io::Error::other(
                "the CM thread ended while starting",
            ))),
        },
    }
}

/// Why the manager hears from a connection.
enum Event {
    Established(IpAddr, Connection),
    SetupFailed(IpAddr, SetupError),
    /// The connection ended: `gone` says how the peer went, None when we closed it.
    Closed {
        ip: IpAddr,
        qpn: u32,
        gone: Option<Gone>,
    },
}

struct Live {
    qpn: u32,
    close: oneshot::Sender<()>,
}

/// GSO packets larger than this would not fit one RC message with the engine's header.
pub const GSO_MAX_SIZE: u32 = 65000;

struct Setup {
    /// The interface's gso_max_size before we lowered it (restored at stop).
    gso_before: Option<u64>,
    res: Arc<Resources>,
    engine: Engine,
    srq_depth: u32,
    max_connections: usize,
    device: String,
    /// The open device, for its asynchronous events.
    dev: Device,
}

/// Makes the stack accept IPv4 packets written into the TUN device from peers whose route is
/// the IPoIB interface. The reverse-path filter uses max(all, device): the device's own
/// setting goes to 0; with `all` at 2 (loose, systemd's default) a device without an IPv4
/// address still fails the check (fib_validate_source: no address -> last resort -> drop;
/// seen here: 13 packets in on the TUN device, 13 fewer delivered), so the interface's IPv4
/// addresses are added to it as /32 without a prefix route, which changes no routing. With
/// `all` at 1 (strict) nothing arriving on the TUN device passes: said loudly.
fn accept_on_tun(iface: &str, tun: &str) -> Result<(), CmError> {
    std::fs::write(format!("/proc/sys/net/ipv4/conf/{tun}/rp_filter"), "0")?;
    let all = std::fs::read_to_string("/proc/sys/net/ipv4/conf/all/rp_filter").unwrap_or_default();
    match all.trim() {
        "1" => tracing::warn!(
            "net.ipv4.conf.all.rp_filter=1 (strict) drops what connected mode receives on {tun}: \
             set it to 2 (loose) or 0"
        ),
        "2" => {
            let addrs = crate::netdev::ipv4_addrs(iface).unwrap_or_default();
            for local in addrs {
                let cidr = format!("{local}/32");
                ip_cmd(tun, &["addr", "add", &cidr, "dev", tun, "noprefixroute"])?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The interface's gso_max_size, from `ip -d -j link`.
fn gso_max_size(iface: &str) -> Option<u64> {
    crate::netdev::link_attr(iface, "gso_max_size")
        .ok()??
        .as_u64()
}

fn setup(iface: &str, opts: &CmOptions, tun_name: &str) -> Result<Setup, CmError> {
    tracing::info!(
        "starting connected mode on {iface}: {} port {}",
        opts.device,
        opts.port
    );
    let dev = Device::open(&opts.device).map_err(|e| match e {
        VerbsError::NoDevices => CmError::NoDevice(opts.device.clone()),
        e => e.into(),
    })?;
    let p = plan::plan(&dev.limits()?, verbs::system_memory(), opts.memory_budget);
    if p.kind != PlanKind::Srq || p.max_cm_peers == 0 {
        // Per-connection rings (no SRQ) are planned but not built yet.
        return Err(CmError::NoPlan {
            device: opts.device.clone(),
            why: p.why,
        });
    }
    let port = dev.first_address(opts.port)?;
    let pd = dev.alloc_pd()?;
    let depth = p.ring as u32;
    let cq = CompletionQueue::create(&dev, depth + 2 * opts.send_slots, true)?;
    let stride = CM_BUF_SIZE.div_ceil(PAGE_SIZE) * PAGE_SIZE;
    let srq = SharedReceiveQueue::create(&pd, depth, p.buffer_bytes as u32, stride)?;
    let send = MemoryRegion::register(&pd, opts.send_slots, stride)?;
    let res = Arc::new(Resources {
        pd,
        send_cq: cq.clone(),
        recv_cq: cq.clone(),
        srq,
        port,
    });
    let tun = Tun::create(tun_name, true)?;
    let name = tun.name().to_string();
    // No IPv6 link-local address (the kernel's own chatter would come to the engine), a
    // 64 KiB MTU, and reverse-path filtering that accepts what arrives here (see
    // `accept_on_tun`).
    ip_cmd(
        &name,
        &[
            "link",
            "set",
            &name,
            "addrgenmode",
            "none",
            "mtu",
            "65520",
            "up",
        ],
    )?;
    accept_on_tun(iface, &name)?;
    let engine = Engine::new(
        tun,
        res.clone(),
        cq,
        send,
        Routes::default(),
        EngineConfig::default(),
    )?;
    // The stack builds GSO packets for the interface the route uses: keep them small enough
    // for one RC message (header included), or the engine would have to drop them.
    let gso_before = gso_max_size(iface);
    if gso_before.is_none_or(|g| g > u64::from(GSO_MAX_SIZE)) {
        let size = GSO_MAX_SIZE.to_string();
        ip_cmd(iface, &["link", "set", "dev", iface, "gso_max_size", &size])?;
    }
    Ok(Setup {
        gso_before,
        res,
        engine,
        srq_depth: depth,
        max_connections: p.max_cm_peers as usize,
        device: opts.device.clone(),
        dev,
    })
}

fn run(
    iface: String,
    pin_dir: PathBuf,
    opts: CmOptions,
    ready: std::sync::mpsc::Sender<Result<(), CmError>>,
    stop: oneshot::Receiver<()>,
) -> Result<(), CmError> {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return Ok(());
        }
    };
    // IFNAMSIZ is 16 with the NUL: 13 characters at most before the suffix.
    let tun_name = format!("{}cm", iface.chars().take(13).collect::<String>());
    let s = match setup(&iface, &opts, &tun_name)
        .and_then(|s| Ok((s, DatapathMaps::from_pins(&pin_dir)?)))
    {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return Ok(());
        }
    };
    let (setup, maps) = s;
    let tun = setup.engine.tun_name().to_string();
    let status_path = opts.status_path.clone();
    let r = rt.block_on(manage(iface.clone(), opts, setup, maps, tun, ready, stop));
    if let Err(e) = &r {
        tracing::error!("connected mode on {iface} stopped on an error: {e}");
        let _ = std::fs::remove_file(status_path);
    }
    r
}

#[allow(clippy::too_many_arguments)]
async fn manage(
    iface: String,
    opts: CmOptions,
    setup: Setup,
    mut maps: DatapathMaps,
    tun: String,
    ready: std::sync::mpsc::Sender<Result<(), CmError>>,
    stop: oneshot::Receiver<()>,
) -> Result<(), CmError> {
    let Setup {
        gso_before,
        res,
        mut engine,
        srq_depth,
        max_connections,
        device,
        dev,
    } = setup;
    let tun_ifindex = match crate::netdev::Netdev::lookup(&tun) {
        Ok(d) => d.ifindex,
        Err(e) => {
            let _ = ready.send(Err(CmError::Io(io::Error::other(e.to_string()))));
            return Ok(());
        }
    };
    let listener =
        match tokio::net::TcpListener::bind(SocketAddr::from(([0u8; 16], opts.ctl_port))).await {
            Ok(l) => l,
            Err(e) => {
                let _ = ready.send(Err(e.into()));
                return Ok(());
            }
        };
    let cm = Arc::new(Cm::new(res.clone(), opts.ud_qpn, SetupConfig::default()));
    // The plan's cap, lowered by policy `max-connections` (read again on every tick, so a
    // change takes effect live).
    let plan_max = max_connections;
    let cap = |iface: &str| {
        crate::attach::read_state(iface)
            .and_then(|s| s.max_connections)
            .map_or(plan_max, |n| (n as usize).min(plan_max))
    };
    let mut max_connections = cap(&iface);
    cm.set_limit(max_connections);
    let routes = engine.routes();
    let stats = engine.stats();
    let (eng_tx, mut eng_rx) = mpsc::unbounded_channel::<EngineEvent>();
    engine.set_events(eng_tx);
    let (engine_stop_tx, engine_stop_rx) = oneshot::channel::<()>();
    let engine_task = tokio::spawn(async move {
        let r = engine
            .run(async {
                let _ = engine_stop_rx.await;
            })
            .await;
        (engine, r)
    });
    // The device's asynchronous events (a QP gone fatal with no send in flight to report it,
    // the SRQ running low, a port changing state), read on a thread of their own.
    let (dev_tx, mut dev_rx) = mpsc::unbounded_channel::<AsyncEvent>();
    let dev_stop = Arc::new(AtomicBool::new(false));
    let dev_thread = std::thread::Builder::new()
        .name("cm-device-events".into())
        .spawn({
            let stop = dev_stop.clone();
            move || {
                while !stop.load(Ordering::Relaxed) {
                    match dev.async_event(Duration::from_millis(250)) {
                        Ok(Some(e)) => {
                            if dev_tx.send(e).is_err() {
                                return;
                            }
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!("no more device events: {e}");
                            return;
                        }
                    }
                }
            }
        });
    let dev_thread = match dev_thread {
        Ok(t) => t,
        Err(e) => {
            let _ = ready.send(Err(e.into()));
            return Ok(());
        }
    };
    let srq_limit = srq_depth / 4;
    let mut srq_low: u64 = 0;
    let mut srq_armed = true;
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<Event>();
    let (acc_tx, mut acc_rx) = mpsc::unbounded_channel();
    tokio::spawn(cm.clone().serve(listener, acc_tx));
    // A previous control loop that died (kill -9, a crash) left its peers CM_UP or
    // CM_PENDING, pointing at a TUN device that is gone: UD until connected again.
    let _ = std::fs::remove_file(&opts.status_path);
    let reset = |maps: &mut DatapathMaps| -> Result<(), CmError> {
        for (key, e) in maps.peers()? {
            if e.mode != peer_mode::UD {
                maps.set_peer(
                    key,
                    PeerEntry {
                        mode: peer_mode::UD,
                        cm_ifindex: 0,
                        generation: e.generation.wrapping_add(1),
                        ..e
                    },
                )?;
            }
        }
        Ok(())
    };
    if let Err(e) = reset(&mut maps) {
        let _ = ready.send(Err(e));
        return Ok(());
    }
    let _ = ready.send(Ok(()));
    tracing::info!(
        "CM on {iface}: {device} port {} ({} GID index {}), TUN {tun}, SRQ {srq_depth} x {} B, \
         at most {max_connections} connections, handshake on TCP {}",
        opts.port,
        if res.port.ethernet { "RoCE" } else { "IB" },
        res.port.gid_index,
        CM_BUF_SIZE,
        opts.ctl_port
    );

    let mut promo_cfg = opts.promotion.clone();
    promo_cfg.max_connections = max_connections;
    let mut promoter: Promoter<IpAddr> = Promoter::new(promo_cfg, Mode::Auto);
    let mut live: HashMap<IpAddr, Live> = HashMap::new();
    // Bytes each peer's connections received (the fast path counts only what we send CM): a
    // connection the peer sends over is not idle.
    let mut cm_rx: HashMap<IpAddr, u64> = HashMap::new();
    let mut last_rx: HashMap<u32, u64> = HashMap::new();
    let mut tick = tokio::time::interval(opts.tick);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(stop);
    let mark = |maps: &mut DatapathMaps, ip: IpAddr, mode: u8| -> Result<(), CmError> {
        let key = PeerKey::from(ip);
        let old = maps.peer(&key)?.unwrap_or_default();
        maps.set_peer(
            key,
            PeerEntry {
                mode,
                cm_ifindex: if mode == peer_mode::CM_UP {
                    tun_ifindex
                } else {
                    0
                },
                generation: old.generation.wrapping_add(1),
                ..old
            },
        )?;
        Ok(())
    };
    // Watches a live connection: ends it on request, or when the peer closes it or stays
    // silent past the heartbeat deadline (the same one the fast path's fail-safe uses).
    let watch =
        |ip: IpAddr, mut c: Connection, dead_after: Duration, ev: mpsc::UnboundedSender<Event>| {
            let (close_tx, close_rx) = oneshot::channel::<()>();
            let qpn = c.qp.qpn();
            tokio::spawn(async move {
                let gone = tokio::select! {
                    g = c.watch(dead_after / 3, dead_after) => Some(g),
                    _ = close_rx => None,
                };
                c.close();
                let _ = ev.send(Event::Closed { ip, qpn, gone });
            });
            Live {
                qpn,
                close: close_tx,
            }
        };

    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = tick.tick() => {
                let now = monotonic_ns();
                if let Ok(p) = maps.policy() {
                    promoter.set_mode(Mode::from_raw(p.mode).unwrap_or(Mode::Auto));
                }
                // The limit disarms itself when it fires: arm it again once refilled.
                if !srq_armed && res.srq.posted() > srq_limit {
                    srq_armed = res.srq.arm_limit(srq_limit).is_ok();
                }
                let now_max = cap(&iface);
                if now_max != max_connections {
                    tracing::info!("CM on {iface}: at most {now_max} connections (was {max_connections})");
                    max_connections = now_max;
                    promoter.set_max_connections(now_max);
                    cm.set_limit(now_max);
                }
                for (key, e) in maps.peers().unwrap_or_default() {
                    if let Some(ip) = key.ip() {
                        promoter.set_pin(ip, match e.pin {
                            peer_pin::UD => PeerPin::Ud,
                            peer_pin::CM => PeerPin::Cm,
                            peer_pin::BLOCK => PeerPin::Block,
                            _ => PeerPin::Auto,
                        });
                    }
                }
                let rx = stats.rx_by_qp.lock().expect("rx_by_qp").clone();
                for (ip, l) in &live {
                    let v = rx.get(&l.qpn).copied().unwrap_or(0);
                    let before = last_rx.insert(l.qpn, v).unwrap_or(0);
                    *cm_rx.entry(*ip).or_default() += v.saturating_sub(before);
                }
                for (key, t) in maps.traffic().unwrap_or_default() {
                    if let Some(ip) = key.ip() {
                        promoter.observe(now, ip, Sample {
                            tx_packets: t.tx_ud_packets + t.tx_cm_packets,
                            tx_bytes: t.tx_ud_bytes + t.tx_cm_bytes,
                            cm_bytes: t.tx_cm_bytes + cm_rx.get(&ip).copied().unwrap_or(0),
                        });
                    }
                }
                for a in promoter.tick(now) {
                    match a {
                        Action::Connect(ip) => {
                            mark(&mut maps, ip, peer_mode::CM_PENDING)?;
                            let (cm, ev, resolve) = (cm.clone(), ev_tx.clone(), opts.resolve.clone());
                            let (port, gid) = (opts.ctl_port, res.port.gid);
                            tokio::spawn(async move {
                                let Some(hw) = resolve.peer(ip, gid).await else {
                                    let _ = ev.send(Event::SetupFailed(ip, SetupError::Timeout("neighbour")));
                                    return;
                                };
                                let e = match cm.connect(SocketAddr::new(ip, port), hw).await {
                                    Ok(c) => Event::Established(ip, c),
                                    Err(e) => Event::SetupFailed(ip, e),
                                };
                                let _ = ev.send(e);
                            });
                        }
                        Action::Disconnect(ip, why) => {
                            // UD first, then the route, then the QP.
                            mark(&mut maps, ip, peer_mode::UD)?;
                            routes.remove(&ip);
                            if let Some(l) = live.remove(&ip) {
                                tracing::info!("{ip}: closing its connection (QP {}): {why:?}", l.qpn);
                                let _ = l.close.send(());
                            } else {
                                promoter.closed(now, &ip);
                            }
                        }
                    }
                }
                let mut snapshot = cm_status(&promoter, &live, &cm, &stats, &device, &tun, srq_depth, max_connections);
                snapshot.srq_low_events = srq_low;
                if let Ok(json) = serde_json::to_vec_pretty(&snapshot) {
                    let _ = std::fs::write(&opts.status_path, json);
                }
            }
            Some(e) = eng_rx.recv() => match e {
                EngineEvent::Congested(ip) if live.contains_key(&ip) => {
                    tracing::debug!("{ip}: the connection's queue is full: UD until it drains");
                    mark(&mut maps, ip, peer_mode::UD)?;
                }
                EngineEvent::Drained(ip) if live.contains_key(&ip) => {
                    mark(&mut maps, ip, peer_mode::CM_UP)?;
                }
                EngineEvent::QpError { qpn, status } => {
                    let why = format!("completion status {status}");
                    if let Some(ip) = broken(&mut live, qpn) {
                        tracing::warn!("{ip}: QP {qpn} failed ({why}): UD, retry later");
                        mark(&mut maps, ip, peer_mode::UD)?;
                        routes.remove(&ip);
                        promoter.failed(monotonic_ns(), &ip, Failure::QpError);
                    }
                }
                _ => {}
            },
            Some(e) = dev_rx.recv() => match e {
                AsyncEvent::QpFatal(qpn) => {
                    if let Some(ip) = broken(&mut live, qpn) {
                        tracing::warn!("{ip}: QP {qpn} went fatal (device event): UD, retry later");
                        mark(&mut maps, ip, peer_mode::UD)?;
                        routes.remove(&ip);
                        promoter.failed(monotonic_ns(), &ip, Failure::QpError);
                    }
                }
                AsyncEvent::SrqLimitReached => {
                    srq_low += 1;
                    srq_armed = false;
                    tracing::warn!(
                        "CM on {iface}: fewer than {srq_limit} of {srq_depth} receive buffers posted \
                         (the engine is not keeping up); senders will meet RNR NAKs"
                    );
                }
                AsyncEvent::PortChange(port) => tracing::info!("{device} port {port} changed state"),
                other => tracing::debug!("device event {other:?}"),
            },
            Some((addr, r)) = acc_rx.recv() => match r {
                Ok(c) => {
                    // The listener is dual-stack: an IPv4 peer shows as ::ffff:a.b.c.d.
                    let ip = addr.ip().to_canonical();
                    let _ = ev_tx.send(Event::Established(ip, c));
                    tracing::debug!("{ip}: accepted a connection");
                }
                Err(e) => tracing::debug!("{addr}: handshake refused: {e}"),
            },
            Some(ev) = ev_rx.recv() => {
                let now = monotonic_ns();
                match ev {
                    Event::Established(ip, c) => {
                        let ours = matches!(promoter.explain(&ip).map(|e| e.state), Some(State::Connecting { .. }));
                        let keep = if ours { promoter.connected(now, &ip); true } else { promoter.accepted(now, ip) };
                        if !keep || live.contains_key(&ip) {
                            tracing::debug!("{ip}: not keeping its connection (one exists, policy, or the plan is full)");
                            c.close();
                            continue;
                        }
                        routes.add(ip, Route { qp: c.qp.clone(), mtu: c.mtu });
                        mark(&mut maps, ip, peer_mode::CM_UP)?;
                        tracing::info!("{ip}: connected (QP {}, MTU {})", c.qp.qpn(), c.mtu);
                        // Not under 1 s however short the fast path's deadline: a busy peer's
                        // keepalive may come late.
                        let dead_after = maps
                            .policy()
                            .map_or(Duration::from_secs(3), |p| Duration::from_nanos(p.heartbeat_timeout_ns))
                            .max(Duration::from_secs(1));
                        live.insert(ip, watch(ip, c, dead_after, ev_tx.clone()));
                    }
                    // Our REQ lost the crossing to the peer's, and the peer's connection is
                    // already up (its Established came first): that one stands. (Seen in the
                    // VM: taking this as a failure marked the peer UD and let the policy
                    // count it out, so the node held one connection more than its plan.)
                    Event::SetupFailed(ip, e) if live.contains_key(&ip) => {
                        tracing::debug!("{ip}: our setup ended ({e}); the peer's connection stands");
                    }
                    Event::SetupFailed(ip, e) => {
                        tracing::info!("{ip}: connection setup failed, UD for now: {e}");
                        mark(&mut maps, ip, peer_mode::UD)?;
                        promoter.failed(now, &ip, match e {
                            SetupError::Rejected(RejectReason::NoResources | RejectReason::Busy)
                            | SetupError::Busy
                            | SetupError::Full => Failure::NoResources,
                            SetupError::Rejected(_) | SetupError::Crossed | SetupError::InProgress | SetupError::WrongPeer { .. } => Failure::Rejected,
                            SetupError::Timeout(_) => Failure::Timeout,
                            _ => Failure::QpError,
                        });
                    }
                    Event::Closed { ip, qpn, gone } => {
                        stats.rx_by_qp.lock().expect("rx_by_qp").remove(&qpn);
                        last_rx.remove(&qpn);
                        match live.get(&ip) {
                            // An older connection of a peer that has a new one: leave it be.
                            Some(l) if l.qpn != qpn => continue,
                            Some(_) => {
                                live.remove(&ip);
                            }
                            None => {}
                        }
                        mark(&mut maps, ip, peer_mode::UD)?;
                        routes.remove(&ip);
                        match gone {
                            Some(Gone::Closed) => {
                                tracing::info!("{ip}: the peer closed its connection (QP {qpn})");
                                promoter.closed(now, &ip);
                            }
                            // Alive at the IP level but not taking what we send: UD, retry later.
                            Some(Gone::Silent) => {
                                tracing::warn!("{ip}: the peer's control loop went silent: connection (QP {qpn}) closed, UD");
                                promoter.failed(now, &ip, Failure::Timeout);
                            }
                            None => promoter.closed(now, &ip),
                        }
                    }
                }
            }
        }
    }

    // Teardown: every peer UD first, then the connections, then the engine and the TUN.
    for (ip, l) in live.drain() {
        let _ = mark(&mut maps, ip, peer_mode::UD);
        routes.remove(&ip);
        let _ = l.close.send(());
    }
    // Let the watchers close their QPs.
    tokio::time::sleep(Duration::from_millis(50)).await;
    dev_stop.store(true, Ordering::Relaxed);
    let _ = dev_thread.join();
    let _ = engine_stop_tx.send(());
    if let Ok((engine, r)) = engine_task.await {
        drop(engine);
        r?;
    }
    let _ = std::fs::remove_file(&opts.status_path);
    if let Some(g) = gso_before.filter(|g| *g > u64::from(GSO_MAX_SIZE)) {
        let _ = ip_cmd(
            &iface,
            &["link", "set", "dev", &iface, "gso_max_size", &g.to_string()],
        );
    }
    tracing::info!("CM on {iface} stopped; every peer is on UD");
    Ok(())
}

/// The live connection whose QP is `qpn` broke: it is removed and told to close. Returns its
/// peer, whose map entry, route and policy state the caller sets.
fn broken(live: &mut HashMap<IpAddr, Live>, qpn: u32) -> Option<IpAddr> {
    let ip = live.iter().find(|(_, l)| l.qpn == qpn).map(|(ip, _)| *ip)?;
    if let Some(l) = live.remove(&ip) {
        let _ = l.close.send(());
    }
    Some(ip)
}

#[allow(clippy::too_many_arguments)]
fn cm_status(
    promoter: &Promoter<IpAddr>,
    live: &HashMap<IpAddr, Live>,
    cm: &Cm,
    stats: &EngineStats,
    device: &str,
    tun: &str,
    srq_depth: u32,
    max_connections: usize,
) -> CmStatus {
    let peers = promoter
        .peers()
        .filter_map(|(ip, _)| {
            let e = promoter.explain(ip)?;
            let state = match e.state {
                State::Ud { .. } => "ud",
                State::Connecting { .. } => "connecting",
                State::Up { .. } => "cm",
                State::Draining { .. } => "closing",
                State::Backoff { .. } => "backoff",
            };
            Some(PeerStatus {
                addr: *ip,
                state: state.into(),
                why: e.to_string(),
                failures: e.failures,
                promotions: e.promotions,
            })
        })
        .collect();
    let get = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
    CmStatus {
        device: device.into(),
        tun: tun.into(),
        srq_depth,
        srq_low_events: 0,
        max_connections,
        mode: promoter.mode().to_string(),
        connections: live.len(),
        established: get(&cm.stats.established),
        failed: get(&cm.stats.failed),
        engine: stats
            .snapshot()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        peers,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipoib_hardware_addresses_parse() {
        let hw = parse_ipoib_hwaddr("80:00:00:48:fe:80:00:00:00:00:00:00:00:02:c9:03:00:12:34:56")
            .unwrap();
        assert_eq!(hw.ud_qpn, 0x48);
        assert_eq!(hw.gid[0..2], [0xfe, 0x80]);
        assert_eq!(hw.gid[15], 0x56);
        assert!(parse_ipoib_hwaddr("00:11:22:33:44:55").is_none());
        assert!(parse_ipoib_hwaddr("zz:00").is_none());
    }

    #[test]
    fn lab_qpns_follow_the_last_byte() {
        assert_eq!(lab_ud_qpn("10.77.0.2".parse().unwrap()), 0x102);
        assert_eq!(lab_ud_qpn("fd77::1".parse().unwrap()), 0x101);
    }
}
