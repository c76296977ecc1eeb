//! The CM engine: moves packets between the TUN device and RC connections.
//!
//! - Transmit: a packet read from the TUN device (virtio-net header + IP packet, a whole GSO
//!   super-packet at most 64 KiB) is copied into a registered send slot and posted as one RC
//!   SEND on the connection of its destination address. Send completions free the slot.
//! - Receive: every connection receives into the one SRQ; a receive completion's bytes (the
//!   same header + packet the sender read) are written into the TUN device, and the buffer is
//!   posted again at once.
//!
//! The RC message is `[virtio_net_hdr (10 B)][IP packet]`: the GSO type and size travel with
//! the packet, so the receiving stack takes the super-packet whole (no segmentation on either
//! side; the RC transport's ICRC protects the bytes).
//!
//! Backpressure: each connection has at most `max_send_wr` sends in flight; past that its
//! packets wait in a bounded queue (already in their send slot) and are posted as its sends
//! complete. When the queue is full the packet is dropped and counted, and the engine reports
//! [`EngineEvent::Congested`]: the control plane marks the peer UD, so the next packets go
//! over UD at once; [`EngineEvent::Drained`] when the queue is empty again. TUN reads pause
//! while no send slot is free. A send that completes in error reports
//! [`EngineEvent::QpError`] once per QP.
//!
//! Runs on tokio: AsyncFd on the TUN fd and on the CQ's completion channel.

use std::{
    collections::{HashMap, VecDeque},
    io,
    net::IpAddr,
    os::fd::{AsRawFd, RawFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use ipoib_common::IPOIB_CM_MTU;
use tokio::io::{Interest, unix::AsyncFd};

use crate::{
    cm::Resources,
    tun::{TUN_READ_MAX, Tun, VNET_HDR_LEN},
    verbs::{CompletionQueue, MemoryRegion, RcQueuePair, VerbsError},
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
    /// Unicast packets for an address with no connection (dropped).
    pub tx_no_connection: AtomicU64,
    /// Multicast and broadcast packets (dropped: they always go UD; only the kernel's own
    /// chatter on the TUN device, never what the fast path redirects, lands here).
    pub tx_multicast: AtomicU64,
    /// Packets longer than the connection's MTU (dropped).
    pub tx_oversize: AtomicU64,
    /// Packets dropped because the connection's queue was full or no send slot was free.
    pub tx_backpressure: AtomicU64,
    /// Times a connection's queue overflowed and its peer was sent to UD until it drained.
    pub tx_congested: AtomicU64,
    /// Packets that were not IP (dropped).
    pub tx_malformed: AtomicU64,
    pub send_errors: AtomicU64,
    pub rx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub rx_errors: AtomicU64,
    /// Writes into the TUN device that failed.
    pub rx_tun_errors: AtomicU64,
    /// Connections the engine tracks sends for (a gauge; those whose connection is gone and
    /// have nothing in flight are forgotten once a second).
    pub flows: AtomicU64,
    /// Bytes received per QP (the control plane counts a connection that only receives as
    /// active; it removes a QP's entry when the connection is gone).
    pub rx_by_qp: Mutex<HashMap<u32, u64>>,
}

impl EngineStats {
    fn sent(&self, len: usize) {
        self.tx_packets.fetch_add(1, Ordering::Relaxed);
        self.tx_bytes.fetch_add(len as u64, Ordering::Relaxed);
        self.tx_largest.fetch_max(len as u64, Ordering::Relaxed);
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
            ("tx_malformed", g(&self.tx_malformed)),
            ("send_errors", g(&self.send_errors)),
            ("rx_packets", g(&self.rx_packets)),
            ("rx_bytes", g(&self.rx_bytes)),
            ("rx_errors", g(&self.rx_errors)),
            ("rx_tun_errors", g(&self.rx_tun_errors)),
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

/// Destination address to connection: the control plane adds a route once the connection is
/// established, and removes it before the QP is torn down.
#[derive(Clone, Default)]
pub struct Routes(Arc<Mutex<HashMap<IpAddr, Route>>>);

impl Routes {
    pub fn add(&self, peer: IpAddr, route: Route) {
        self.0.lock().expect("routes").insert(peer, route);
    }
    pub fn remove(&self, peer: &IpAddr) -> Option<Route> {
        self.0.lock().expect("routes").remove(peer)
    }
    fn get(&self, peer: &IpAddr) -> Option<Route> {
        self.0.lock().expect("routes").get(peer).cloned()
    }
}

pub struct EngineConfig {
    /// Sends in flight per connection (the QPs' `max_send_wr`).
    pub max_send_wr: u32,
    /// Packets that may wait per connection when its sends are all in flight.
    pub backlog: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_send_wr: 64,
            backlog: 128,
        }
    }
}

struct RawFdRef(RawFd);
impl AsRawFd for RawFdRef {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// What the engine tells the control plane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// A send on this QP completed in error: the connection is dead (said once per QP).
    QpError { qpn: u32, status: u32 },
    /// The connection's queue overflowed: its traffic should go UD for now.
    Congested(IpAddr),
    /// Its queue drained after [`EngineEvent::Congested`]: CM again.
    Drained(IpAddr),
}

/// Per-connection send state, by QP number.
struct Flow {
    dst: IpAddr,
    in_flight: u32,
    /// Filled send slots waiting to be posted, and their lengths.
    waiting: VecDeque<(u32, u32)>,
    congested: bool,
    dead: bool,
}

impl Flow {
    fn new(dst: IpAddr) -> Self {
        Self {
            dst,
            in_flight: 0,
            waiting: VecDeque::new(),
            congested: false,
            dead: false,
        }
    }
}

pub struct Engine {
    tun: Tun,
    core: Core,
}

/// Everything but the TUN device, so the TUN's readiness can be borrowed while packets move.
struct Core {
    res: Arc<Resources>,
    cq: Arc<CompletionQueue>,
    send: Arc<MemoryRegion>,
    routes: Routes,
    cfg: EngineConfig,
    stats: Arc<EngineStats>,
    free: Vec<u32>,
    flows: HashMap<u32, Flow>,
    events: Option<tokio::sync::mpsc::UnboundedSender<EngineEvent>>,
}

/// Reports `e` to the control plane, if it listens. (A free function over the field, so it
/// can be called while a flow of the same core is borrowed.)
fn tell(events: &Option<tokio::sync::mpsc::UnboundedSender<EngineEvent>>, e: EngineEvent) {
    if let Some(tx) = events {
        let _ = tx.send(e);
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

impl Engine {
    /// `tun` must be non-blocking; `cq` must be the CQ of `res` (sends and receives), with a
    /// completion channel; `send` is a region of send slots on `res.pd`, each at least one
    /// CM message (65520 B). A packet longer than its connection's MTU is dropped and counted
    /// (`tx_oversize`): the route's device must keep GSO packets below it (gso_max_size).
    pub fn new(
        tun: Tun,
        res: Arc<Resources>,
        cq: Arc<CompletionQueue>,
        send: Arc<MemoryRegion>,
        routes: Routes,
        cfg: EngineConfig,
    ) -> Result<Self, EngineError> {
        if send.stride < u64::from(IPOIB_CM_MTU) {
            return Err(EngineError::SlotTooSmall {
                stride: send.stride,
                need: IPOIB_CM_MTU as usize,
            });
        }
        let free = (0..send.count).rev().collect();
        Ok(Self {
            tun,
            core: Core {
                res,
                cq,
                send,
                routes,
                cfg,
                stats: Arc::default(),
                free,
                flows: HashMap::new(),
                events: None,
            },
        })
    }

    pub fn stats(&self) -> Arc<EngineStats> {
        self.core.stats.clone()
    }

    /// Where QP errors and congestion are reported.
    pub fn set_events(&mut self, tx: tokio::sync::mpsc::UnboundedSender<EngineEvent>) {
        self.core.events = Some(tx);
    }

    /// The table `transmit` looks connections up in (shared: add and remove from anywhere).
    pub fn routes(&self) -> Routes {
        self.core.routes.clone()
    }

    pub fn tun_name(&self) -> &str {
        self.tun.name()
    }

    /// Runs until `stop` resolves (or an error). Completions and TUN packets are handled as
    /// they come. Must be called inside a tokio runtime.
    pub async fn run(
        &mut self,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<(), EngineError> {
        let core = &mut self.core;
        let tun_name = self.tun.name().to_string();
        let tun_err = |source| EngineError::Tun {
            name: tun_name.clone(),
            source,
        };
        let fd = core.cq.channel_fd().ok_or(EngineError::NoChannel)?;
        // SAFETY: both fds stay open for as long as the AsyncFds live: the channel is owned by
        // `core.cq` and the TUN fd by `self.tun`, both outliving this function's locals.
        let channel = unsafe { AsyncFd::register_with_interest(RawFdRef(fd), Interest::READABLE) }
            .map_err(|e| tun_err(e.into_parts().1))?;
        let tun = unsafe {
            AsyncFd::register_with_interest(RawFdRef(self.tun.as_raw_fd()), Interest::READABLE)
        }
        .map_err(|e| tun_err(e.into_parts().1))?;
        core.cq.arm()?;
        core.completions(&self.tun)?;
        tokio::pin!(stop);
        let mut buf = vec![0u8; TUN_READ_MAX];
        let mut housekeeping = tokio::time::interval(Duration::from_secs(1));
        housekeeping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let can_send = !core.free.is_empty();
            tokio::select! {
                _ = &mut stop => return Ok(()),
                _ = housekeeping.tick() => core.forget_stale_flows(),
                g = channel.readable() => {
                    let mut g = g.map_err(tun_err)?;
                    while core.cq.wait(Duration::ZERO)? {}
                    g.clear_ready();
                    core.cq.arm()?;
                    core.completions(&self.tun)?;
                }
                g = tun.readable(), if can_send => {
                    let mut g = g.map_err(tun_err)?;
                    // A batch, then back to the completions.
                    for _ in 0..64 {
                        if core.free.is_empty() {
                            break;
                        }
                        match self.tun.recv(&mut buf) {
                            Ok(n) => core.transmit(&buf[..n])?,
                            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                                g.clear_ready();
                                break;
                            }
                            Err(e) => return Err(tun_err(e)),
                        }
                    }
                }
            }
        }
    }
}

impl Core {
    fn count(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Forgets the flows of connections that are gone (no longer routed to their QP) and have
    /// nothing in flight or waiting: a connection closed while idle gets no completion that
    /// would remove its flow.
    fn forget_stale_flows(&mut self) {
        let routes = &self.routes;
        self.flows.retain(|qpn, f| {
            f.in_flight > 0
                || !f.waiting.is_empty()
                || routes.get(&f.dst).is_some_and(|r| r.qp.qpn() == *qpn)
        });
        self.stats
            .flows
            .store(self.flows.len() as u64, Ordering::Relaxed);
    }

    /// One packet read from the TUN device: to its connection.
    fn transmit(&mut self, msg: &[u8]) -> Result<(), EngineError> {
        let Some(dst) = msg.get(VNET_HDR_LEN..).and_then(destination) else {
            Self::count(&self.stats.tx_malformed);
            return Ok(());
        };
        let multicast = match dst {
            IpAddr::V4(a) => a.is_multicast() || a.is_broadcast(),
            IpAddr::V6(a) => a.is_multicast(),
        };
        if multicast {
            Self::count(&self.stats.tx_multicast);
            return Ok(());
        }
        let Some(route) = self.routes.get(&dst) else {
            Self::count(&self.stats.tx_no_connection);
            return Ok(());
        };
        if msg.len() > route.mtu as usize {
            Self::count(&self.stats.tx_oversize);
            return Ok(());
        }
        let qpn = route.qp.qpn();
        let flow = self.flows.entry(qpn).or_insert_with(|| Flow::new(dst));
        let full = flow.in_flight >= self.cfg.max_send_wr;
        if full && flow.waiting.len() >= self.cfg.backlog {
            // Past the bound: this packet is lost, the next go UD until the queue drains.
            Self::count(&self.stats.tx_backpressure);
            if !flow.congested {
                flow.congested = true;
                Self::count(&self.stats.tx_congested);
                tell(&self.events, EngineEvent::Congested(dst));
            }
            return Ok(());
        }
        let Some(slot) = self.free.pop() else {
            Self::count(&self.stats.tx_backpressure);
            return Ok(());
        };
        // SAFETY: the slot was free: nothing posted uses it until its send completes.
        unsafe { self.send.slot(slot)[..msg.len()].copy_from_slice(msg) };
        if full {
            flow.waiting.push_back((slot, msg.len() as u32));
            return Ok(());
        }
        flow.in_flight += 1;
        if let Err(e) = route
            .qp
            .post_send(&self.send, slot, msg.len() as u32, u64::from(slot))
        {
            flow.in_flight -= 1;
            self.free.push(slot);
            Self::count(&self.stats.send_errors);
            tracing::debug!("post_send to {dst}: {e}");
            return Ok(());
        }
        self.stats.sent(msg.len());
        Ok(())
    }

    /// Takes every completion: receives into the TUN device (buffers posted again), sends free
    /// their slot and let a waiting packet of the same connection go.
    fn completions(&mut self, tun: &Tun) -> Result<(), EngineError> {
        let mut wcs = Vec::with_capacity(64);
        loop {
            let n = self.cq.poll(&mut wcs, 64)?;
            if n == 0 {
                return Ok(());
            }
            let srq = &self.res.srq;
            let mut repost = Vec::new();
            for wc in &wcs {
                let slot = wc.wr_id as u32;
                if wc.recv {
                    srq.completed(1);
                    if wc.error.is_some() {
                        Self::count(&self.stats.rx_errors);
                    } else {
                        // SAFETY: the receive completed; the slot is ours until posted again.
                        let msg = unsafe { &srq.region.slot(slot)[..wc.bytes as usize] };
                        match tun.send(msg) {
                            Ok(_) => {
                                self.stats.rx_packets.fetch_add(1, Ordering::Relaxed);
                                self.stats
                                    .rx_bytes
                                    .fetch_add(u64::from(wc.bytes), Ordering::Relaxed);
                                *self
                                    .stats
                                    .rx_by_qp
                                    .lock()
                                    .expect("rx_by_qp")
                                    .entry(wc.qp_num)
                                    .or_default() += u64::from(wc.bytes);
                            }
                            Err(_) => Self::count(&self.stats.rx_tun_errors),
                        }
                    }
                    repost.push(slot);
                    continue;
                }
                if wc.error.is_some() {
                    Self::count(&self.stats.send_errors);
                }
                self.free.push(slot);
                let Some(flow) = self.flows.get_mut(&wc.qp_num) else {
                    continue;
                };
                flow.in_flight = flow.in_flight.saturating_sub(1);
                if let Some(status) = wc.error {
                    // The QP is in error: what waits for it can never go; free it.
                    for (s, _) in flow.waiting.drain(..) {
                        self.free.push(s);
                        Self::count(&self.stats.tx_backpressure);
                    }
                    if !flow.dead {
                        flow.dead = true;
                        let e = EngineEvent::QpError {
                            qpn: wc.qp_num,
                            status,
                        };
                        tell(&self.events, e);
                    }
                    if flow.in_flight == 0 {
                        // Every send of the dead QP is back: forget it.
                        self.flows.remove(&wc.qp_num);
                    }
                    continue;
                }
                if let Some((s, len)) = flow.waiting.pop_front() {
                    // The flow's own destination, still routed to this QP.
                    let qp = self
                        .routes
                        .get(&flow.dst)
                        .filter(|r| r.qp.qpn() == wc.qp_num)
                        .map(|r| r.qp);
                    match qp.map(|qp| qp.post_send(&self.send, s, len, u64::from(s))) {
                        Some(Ok(())) => {
                            flow.in_flight += 1;
                            self.stats.sent(len as usize);
                        }
                        _ => {
                            self.free.push(s);
                            Self::count(&self.stats.tx_no_connection);
                        }
                    }
                }
                if flow.congested && flow.waiting.is_empty() {
                    flow.congested = false;
                    tell(&self.events, EngineEvent::Drained(flow.dst));
                }
            }
            if !repost.is_empty() {
                srq.post_slots(&repost)?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
