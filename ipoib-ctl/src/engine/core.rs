//! The engine's decisions, free of I/O: which connection a packet read from the TUN device
//! goes to; whether it is posted, waits behind its connection's window, or is let go to UD
//! or dropped (and under which counter); which waiting packet a send completion releases;
//! when a connection is congested, drained or dead; which connections get a keepalive; the
//! send slots free; what a receive completion is (a packet, a keepalive, a failure, a
//! flush) and whether its buffer is posted again; the receive totals per QP.
//! [`super::Engine`]'s loop reads the TUN device, polls the CQ, posts and writes, and hands
//! each of those here; what this decides comes back as [`Receipt`]s, sends to post
//! ([`EngineCore::flush`], which the loop gives the posting), keepalives to post
//! ([`EngineCore::housekeeping`]) and events for the control plane
//! ([`EngineCore::next_event`]).
//!
//! One engine, one core: the state a queue's hot loop needs is all here, none of it shared.

use std::{
    collections::{HashMap, HashSet, VecDeque, hash_map::Entry},
    fmt::Display,
    net::IpAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use super::{
    EngineConfig, EngineEvent, EngineStats, KEEPALIVE_LEN, READ_BATCH, Route,
    packet::{destination, flow_key},
};
use crate::{
    tun::VNET_HDR_LEN,
    verbs::{Completion, RcQueuePair, SendRequest, WC_FLUSHED},
};

/// A connection's sending end, as the core knows it: by its QP number. The engine's is
/// `Arc<RcQueuePair>`; the core only holds it and hands it back to post on.
pub trait SendEnd: Clone {
    fn qpn(&self) -> u32;
}

impl SendEnd for Arc<RcQueuePair> {
    fn qpn(&self) -> u32 {
        RcQueuePair::qpn(self)
    }
}

/// What becomes of a receive completion's buffer, as [`EngineCore::handle_receive`] decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receipt {
    /// A packet: written into the TUN device (then [`EngineCore::handle_delivered`] with how that
    /// went), and the buffer posted again.
    Deliver,
    /// Taken here (a keepalive, or a receive in error on the SRQ): the buffer posted again.
    Repost,
    /// A receive in error on a connection's ring: its QP is going, and the buffer is not
    /// posted again.
    Keep,
}

/// Which counter a packet not sent over a connection is counted under.
pub(crate) type Dropped = fn(&EngineStats) -> &AtomicU64;

/// Why a packet read was not sent over a connection, and what becomes of it.
enum NotSent {
    /// Let go to UD ([`EngineCore::next_unsent`]).
    ToUd(Dropped),
    /// Dropped, its slot free at once: no unicast IP packet (the kernel's own chatter on the
    /// TUN device, which UD has had already).
    Dropped(Dropped),
}

/// Per-connection send state, by QP number.
struct Flow<Q> {
    dst: IpAddr,
    qp: Q,
    in_flight: u32,
    /// Filled send slots waiting to be posted: slot, length, and the packet's [`flow_key`].
    waiting: VecDeque<(u32, u32, u64)>,
    congested: bool,
    dead: bool,
}

impl<Q> Flow<Q> {
    fn new(dst: IpAddr, qp: Q) -> Self {
        Self {
            dst,
            qp,
            in_flight: 0,
            waiting: VecDeque::new(),
            congested: false,
            dead: false,
        }
    }

    /// Lets go of what waits, each packet to `unsent` (offered to UD), counted under `why`.
    fn drop_waiting(
        &mut self,
        unsent: &mut VecDeque<(u32, u32)>,
        stats: &EngineStats,
        why: Dropped,
    ) {
        for (s, len, _) in self.waiting.drain(..) {
            unsent.push_back((s, len));
            count(why(stats));
        }
    }

    /// The connection on QP `qpn` failed (`status`: the completion's, `None` for a send the
    /// QP refused): nothing more is posted on it, and what waits for it is let go to UD
    /// (`tx_backpressure`). The first time, the [`EngineEvent::QpError`] that reports it.
    fn fail(
        &mut self,
        qpn: u32,
        status: Option<u32>,
        unsent: &mut VecDeque<(u32, u32)>,
        stats: &EngineStats,
    ) -> Option<EngineEvent> {
        self.drop_waiting(unsent, stats, |s| &s.tx_backpressure);
        (!std::mem::replace(&mut self.dead, true)).then_some(EngineEvent::QpError { qpn, status })
    }

    /// Which waiting packet to let go so that a packet of `len` bytes of flow `key` may wait:
    /// the oldest of the flow that holds the most bytes of the queue, if that is not `key`'s
    /// own with this packet (then None: the new packet is the one let go). A sparse flow so
    /// keeps its place beside a bulk one that shares its connection, as fq_codel drops from
    /// its fattest flow; by bytes, since a bulk flow's packets are few and large.
    fn victim_for(&self, key: u64, len: u32) -> Option<usize> {
        let mut held: HashMap<u64, u64> = HashMap::new();
        for (_, l, k) in &self.waiting {
            *held.entry(*k).or_default() += u64::from(*l);
        }
        let own = held.get(&key).copied().unwrap_or(0) + u64::from(len);
        let (fattest, most) = held.into_iter().max_by_key(|(_, n)| *n)?;
        if most <= own {
            return None;
        }
        self.waiting.iter().position(|(_, _, k)| *k == fattest)
    }

    /// One more data send in flight, its depth counted (`tx_depth_sum`).
    fn admit(&mut self, stats: &EngineStats) {
        self.in_flight += 1;
        stats
            .tx_depth_sum
            .fetch_add(u64::from(self.in_flight), Ordering::Relaxed);
    }
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

/// A send of the first `len` bytes of send slot `slot`, named by its slot.
fn request(slot: u32, len: u32) -> SendRequest {
    SendRequest {
        slot,
        len,
        wr_id: u64::from(slot),
    }
}

pub(super) fn count(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What [`EngineCore::remove_route`] did with the route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removal {
    /// Nothing of it is here: another engine's route, or gone already.
    NotHere,
    /// Removed at once: its connection is dead (what waited for it was let go as it died).
    Removed,
    /// Kept until what this engine holds for the destination has gone over it; then let go,
    /// as [`EngineCore::next_released`] says.
    Draining,
}

/// A route let go after [`Removal::Draining`]: its QP may be closed once every engine has let
/// go of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    pub ip: IpAddr,
    pub qpn: u32,
    /// It was still the destination's route here when let go (not replaced meanwhile): the
    /// destination's steering to this engine is cleared.
    pub unrouted: bool,
}

/// A route being let go: what the engine holds for its destination goes over it first.
struct Drain {
    ip: IpAddr,
    /// The TUN device has been read empty since the removal was asked: every packet to the
    /// destination that the fast path sent here before it sent the peer UD has been read.
    read_empty: bool,
    /// Housekeepings since the removal was asked.
    housekeepings: u32,
}

/// Housekeepings a removal waits at most (2 s) for what the engine holds for the destination
/// (a connection that stopped completing its sends would otherwise hold it for good): then
/// what still waits is let go to UD (`tx_no_connection`) and the route let go.
const DRAIN_HOUSEKEEPINGS: u32 = 4;

pub struct EngineCore<Q> {
    cfg: EngineConfig,
    stats: Arc<EngineStats>,
    /// Send slots nothing is read into, posted from or waiting in.
    free: Vec<u32>,
    /// Packets read and not sent over a connection (each counted under its reason): send
    /// slot and length. Their slots stay taken until the loop has offered them to the UD path
    /// ([`EngineCore::next_unsent`]) and given them back.
    unsent: VecDeque<(u32, u32)>,
    routes: HashMap<IpAddr, Route<Q>>,
    flows: HashMap<u32, Flow<Q>>,
    /// Bytes received per QP, and keepalives received per QP.
    rx_by_qp: Totals,
    keepalives_by_qp: Totals,
    /// QPs something was sent on since the last housekeeping (the others get a keepalive).
    sent_on: HashSet<u32>,
    /// Sends decided and not yet posted (QP number, request): posted by [`EngineCore::flush`],
    /// one chain per QP.
    outbox: Vec<(u32, SendRequest)>,
    /// One QP's part of the outbox while it is posted (kept to reuse its memory).
    chain: Vec<SendRequest>,
    events: VecDeque<EngineEvent>,
    /// Routes being let go, by QP, and those let go since the loop last asked.
    draining: HashMap<u32, Drain>,
    released: VecDeque<Released>,
}

impl<Q: SendEnd> EngineCore<Q> {
    /// A core for send slots `slots` (its lane's), all free.
    pub fn new(slots: std::ops::Range<u32>, cfg: EngineConfig, stats: Arc<EngineStats>) -> Self {
        Self {
            cfg,
            stats,
            free: slots.rev().collect(),
            unsent: VecDeque::new(),
            routes: HashMap::new(),
            flows: HashMap::new(),
            rx_by_qp: Totals::default(),
            keepalives_by_qp: Totals::default(),
            sent_on: HashSet::new(),
            outbox: Vec::with_capacity(2 * READ_BATCH),
            chain: Vec::with_capacity(2 * READ_BATCH),
            events: VecDeque::new(),
            draining: HashMap::new(),
            released: VecDeque::new(),
        }
    }

    /// The counters it keeps (shared with status and tests).
    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }

    /// The next thing to tell the control plane.
    pub fn next_event(&mut self) -> Option<EngineEvent> {
        self.events.pop_front()
    }

    /// A free send slot to read the next packet into (none: reading waits for a completion).
    pub fn take_slot(&mut self) -> Option<u32> {
        self.free.pop()
    }

    /// Whether a packet can be read now.
    pub fn can_read(&self) -> bool {
        !self.free.is_empty()
    }

    /// Send slots free.
    pub fn free_slots(&self) -> usize {
        self.free.len()
    }

    /// A packet read and not sent over a connection, its slot still taken: the loop offers it
    /// to the UD path (the fast path lets it through there), then gives the slot back. So a
    /// packet the engine cannot send is dropped only where UD cannot take it either.
    pub fn next_unsent(&mut self) -> Option<(u32, u32)> {
        // In the order they were let go: a flow's datagrams keep theirs over UD.
        self.unsent.pop_front()
    }

    /// A taken slot given back: nothing was read into it, what was read was not sent
    /// (counted under `why` when given), or an unsent packet was offered to UD.
    pub fn give_back(&mut self, slot: u32, why: Option<Dropped>) {
        self.free.push(slot);
        if let Some(why) = why {
            count(why(&self.stats));
        }
    }

    /// Sends decided and not yet posted.
    pub fn unposted(&self) -> usize {
        self.outbox.len()
    }

    /// From now on `ip`'s packets go over `route` (a route it replaces that was being let go
    /// no longer waits for the TUN device: nothing more is read for it).
    pub fn add_route(&mut self, ip: IpAddr, route: Route<Q>) {
        let qpn = route.qp.qpn();
        if let Some(old) = self.routes.insert(ip, route) {
            self.settle(old.qp.qpn());
        }
        self.events.push_back(EngineEvent::RouteAdded { ip, qpn });
    }

    /// `ip`'s packets are to stop going to QP `qpn` (if that is still its route), which the
    /// control plane will close. The fast path sends the peer UD before it asks, so what this
    /// engine holds for it is what it had read or had still to read: that goes over the
    /// connection first, in order, and the sends in flight complete (a close would flush
    /// them). So the route stays until the TUN device has been read empty once and nothing
    /// waits or is in flight on the QP; then it is let go ([`EngineCore::next_released`]),
    /// its totals forgotten. A dead connection's route goes at once; past 4 housekeepings
    /// (2 s) what still waits is let go to UD (`tx_no_connection`).
    pub fn remove_route(&mut self, ip: IpAddr, qpn: u32) -> Removal {
        let routed = self.routes.get(&ip).is_some_and(|r| r.qp.qpn() == qpn);
        let flow = self.flows.get_mut(&qpn);
        let (dead, holds) = flow.map_or((false, false), |f| {
            // No longer the peer's connection: its queue emptying says nothing of the peer.
            f.congested = false;
            (f.dead, f.in_flight > 0 || !f.waiting.is_empty())
        });
        if self.draining.contains_key(&qpn) {
            return Removal::Draining;
        }
        if dead || !(routed || holds) {
            if routed {
                self.routes.remove(&ip);
            }
            self.rx_by_qp.forget(qpn);
            self.keepalives_by_qp.forget(qpn);
            return if routed {
                Removal::Removed
            } else {
                Removal::NotHere
            };
        }
        let drain = Drain {
            ip,
            read_empty: false,
            housekeepings: 0,
        };
        self.draining.insert(qpn, drain);
        self.settle(qpn);
        Removal::Draining
    }

    /// Whether a route being let go waits for the TUN device to be read empty (the loop then
    /// reads it at once: an idle device would never say it is readable).
    pub fn awaits_read_empty(&self) -> bool {
        self.draining.values().any(|d| !d.read_empty)
    }

    /// The TUN device was read empty: every packet it held when a removal was asked has been
    /// read.
    pub fn handle_read_empty(&mut self) {
        if self.draining.is_empty() {
            return;
        }
        let waited: Vec<u32> = self
            .draining
            .iter_mut()
            .filter_map(|(qpn, d)| (!std::mem::replace(&mut d.read_empty, true)).then_some(*qpn))
            .collect();
        for qpn in waited {
            self.settle(qpn);
        }
    }

    /// The next route let go after [`Removal::Draining`].
    pub fn next_released(&mut self) -> Option<Released> {
        self.released.pop_front()
    }

    /// Lets go of the route to `qpn` being let go, if nothing is left to wait for: its
    /// connection is dead, or nothing waits or is in flight on it and the TUN device has
    /// been read empty since (or the destination has another route now).
    fn settle(&mut self, qpn: u32) {
        let Some(d) = self.draining.get(&qpn) else {
            return;
        };
        let flow = self.flows.get(&qpn);
        let dead = flow.is_some_and(|f| f.dead);
        let holds = flow.is_some_and(|f| f.in_flight > 0 || !f.waiting.is_empty());
        let routed = self.routes.get(&d.ip).is_some_and(|r| r.qp.qpn() == qpn);
        if dead || (!holds && (d.read_empty || !routed)) {
            self.release(qpn);
        }
    }

    /// Lets go of the route to `qpn` being let go, whatever is left: what still waits is let
    /// go to UD.
    fn release(&mut self, qpn: u32) {
        let Some(d) = self.draining.remove(&qpn) else {
            return;
        };
        let unrouted = self.routes.get(&d.ip).is_some_and(|r| r.qp.qpn() == qpn);
        if unrouted {
            self.routes.remove(&d.ip);
        }
        if let Some(flow) = self.flows.get_mut(&qpn) {
            flow.drop_waiting(&mut self.unsent, &self.stats, |s| &s.tx_no_connection);
        }
        self.rx_by_qp.forget(qpn);
        self.keepalives_by_qp.forget(qpn);
        self.released.push_back(Released {
            ip: d.ip,
            qpn,
            unrouted,
        });
    }

    /// The packet `msg` (virtio-net header and IP packet) read into send slot `slot`: to its
    /// connection. The slot is put in the outbox or queued behind its connection's window;
    /// else, the reason counted, the packet is let go to UD ([`EngineCore::next_unsent`]), or
    /// its slot given back free where it is no unicast IP packet (the kernel's own chatter on
    /// the TUN device, which UD must not get twice).
    pub fn transmit(&mut self, slot: u32, msg: &[u8]) {
        match self.post_or_queue(slot, msg) {
            Ok(()) => {}
            Err(NotSent::ToUd(why)) => {
                count(why(&self.stats));
                self.unsent.push_back((slot, msg.len() as u32));
            }
            Err(NotSent::Dropped(why)) => self.give_back(slot, Some(why)),
        }
    }

    /// Puts the packet in `slot` in the outbox, or queues it behind its connection's sends in
    /// flight; else why not.
    fn post_or_queue(&mut self, slot: u32, msg: &[u8]) -> Result<(), NotSent> {
        let len = msg.len();
        let Some(dst) = msg.get(VNET_HDR_LEN..).and_then(destination) else {
            return Err(NotSent::Dropped(|s| &s.tx_malformed));
        };
        let multicast = match dst {
            IpAddr::V4(a) => a.is_multicast() || a.is_broadcast(),
            IpAddr::V6(a) => a.is_multicast(),
        };
        if multicast {
            return Err(NotSent::Dropped(|s| &s.tx_multicast));
        }
        let Some(route) = self.routes.get(&dst) else {
            return Err(NotSent::ToUd(|s| &s.tx_no_connection));
        };
        if len > route.mtu as usize {
            return Err(NotSent::ToUd(|s| &s.tx_oversize));
        }
        let qpn = route.qp.qpn();
        let flow = self
            .flows
            .entry(qpn)
            .or_insert_with(|| Flow::new(dst, route.qp.clone()));
        if flow.dead {
            // Reported; its route goes when the control plane hears of it.
            return Err(NotSent::ToUd(|s| &s.tx_no_connection));
        }
        let full = flow.in_flight >= self.cfg.max_send_wr;
        if !full {
            flow.admit(&self.stats);
            self.outbox.push((qpn, request(slot, len as u32)));
            return Ok(());
        }
        let key = flow_key(&msg[VNET_HDR_LEN..]);
        if flow.waiting.len() < self.cfg.backlog {
            flow.waiting.push_back((slot, len as u32, key));
            count(&self.stats.tx_window_waits);
            return Ok(());
        }
        // Past the bound the next packets go UD until the queue drains; this one, already
        // read, still waits its turn while slots are left for the other connections.
        // A route being let go is no longer the peer's: nothing to send UD.
        if !self.draining.contains_key(&qpn) && !std::mem::replace(&mut flow.congested, true) {
            count(&self.stats.tx_congested);
            self.events.push_back(EngineEvent::Congested(dst));
        }
        // Slots are kept back only where another connection may need them; then a packet
        // of the queue's fattest flow (in bytes) is the one let go to UD.
        let keep = self.routes.len() < 2 || self.free.len() >= self.cfg.spare_slots;
        if !keep {
            let Some(i) = flow.victim_for(key, len as u32) else {
                return Err(NotSent::ToUd(|s| &s.tx_backpressure));
            };
            let (victim, vlen, _) = flow.waiting.remove(i).expect("a waiting packet");
            self.unsent.push_back((victim, vlen));
            count(&self.stats.tx_backpressure);
        }
        flow.waiting.push_back((slot, len as u32, key));
        count(&self.stats.tx_window_waits);
        Ok(())
    }

    /// Posts the outbox with `post`: one chain per QP, in the order the sends were decided.
    /// `post` returns how many of the chain it posted, from the first, and the error that
    /// stopped it. A send not posted gives its slot back, counted as a send error; one posted
    /// counts as sent.
    pub fn flush<E: Display>(
        &mut self,
        mut post: impl FnMut(&Q, &[SendRequest]) -> (usize, Result<(), E>),
    ) {
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
                    self.unsent.push_back((r.slot, r.len));
                    count(&self.stats.tx_backpressure);
                }
                if let Some(f) = self.flows.get_mut(&qpn) {
                    f.in_flight = f.in_flight.saturating_sub(chain.len() as u32);
                }
                continue;
            };
            let (posted, result) = post(&flow.qp, &chain);
            for r in &chain[..posted] {
                self.stats.sent(r.len as usize);
            }
            // No keepalive is due on it (one that took none of the chain is dead: none goes).
            self.sent_on.insert(qpn);
            if let Err(e) = result {
                tracing::debug!("post_send to {}: {e}", flow.dst);
                for r in &chain[posted..] {
                    flow.in_flight -= 1;
                    self.unsent.push_back((r.slot, r.len));
                    count(&self.stats.send_errors);
                }
                // The window keeps the send queue from filling, so a QP that refuses a send is
                // broken. Posting on would black-hole the peer's packets, and what waits here
                // could wait for completions that never come: it fails as on a send in error.
                let failed = flow.fail(qpn, None, &mut self.unsent, &self.stats);
                self.events.extend(failed);
            }
        }
        self.outbox.clear();
        self.chain = chain;
    }

    /// A send completed: its slot is free, and a waiting packet of the same connection goes
    /// to the outbox. In error, the QP is dead: what waits for it is let go to UD and it is
    /// reported once.
    pub fn handle_send_done(&mut self, wc: &Completion) {
        if wc.error.is_some() {
            count(&self.stats.send_errors);
        }
        self.free.push(wc.wr_id as u32);
        let Some(flow) = self.flows.get_mut(&wc.qp_num) else {
            return;
        };
        flow.in_flight = flow.in_flight.saturating_sub(1);
        if let Some(status) = wc.error {
            // Kept, dead, until housekeeping finds it unrouted with every send back (its QP
            // alive till then, so its number is not another's).
            let failed = flow.fail(wc.qp_num, Some(status), &mut self.unsent, &self.stats);
            self.events.extend(failed);
            self.settle(wc.qp_num);
            return;
        }
        // The next waiting is posted at the end of the turn while its destination is still
        // routed to this QP, or the route is being let go; else none of them will ever go on
        // it (the route moved without a removal).
        let routed = self.draining.contains_key(&wc.qp_num)
            || self
                .routes
                .get(&flow.dst)
                .is_some_and(|r| r.qp.qpn() == wc.qp_num);
        if !routed {
            flow.drop_waiting(&mut self.unsent, &self.stats, |s| &s.tx_no_connection);
        } else if let Some((s, len, _)) = flow.waiting.pop_front() {
            flow.admit(&self.stats);
            self.outbox.push((wc.qp_num, request(s, len)));
        }
        if flow.congested && flow.waiting.is_empty() {
            flow.congested = false;
            self.events.push_back(EngineEvent::Drained(flow.dst));
        }
        self.settle(wc.qp_num);
    }

    /// A receive completed into a buffer of `len` bytes, on a connection's ring or not:
    /// counted, and what becomes of the buffer. A flushed receive is not an error (it only
    /// follows one, or a close); one in error otherwise is its QP's failure.
    pub fn handle_receive(&mut self, wc: &Completion, len: usize, on_ring: bool) -> Receipt {
        if let Some(status) = wc.error {
            if status == WC_FLUSHED {
                count(&self.stats.rx_flushed);
            } else {
                count(&self.stats.rx_errors);
                self.receive_failed(wc.qp_num, status);
            }
            return if on_ring {
                Receipt::Keep
            } else {
                Receipt::Repost
            };
        }
        if len <= KEEPALIVE_LEN {
            count(&self.stats.keepalives_received);
            self.keepalives_by_qp.add(wc.qp_num, 1);
            return Receipt::Repost;
        }
        Receipt::Deliver
    }

    /// A receive whose buffer is not known (its ring gone: a flush after its QP was torn
    /// down, or an id of nothing): counted, flushed or not.
    pub fn handle_receive_lost(&mut self, wc: &Completion) {
        count(if wc.error == Some(WC_FLUSHED) {
            &self.stats.rx_flushed
        } else {
            &self.stats.rx_errors
        });
    }

    /// The packet of [`Receipt::Deliver`], `bytes` long, received on `qpn`: written into the
    /// TUN device (`written`) or not.
    pub fn handle_delivered(&mut self, qpn: u32, bytes: u32, written: bool) {
        if !written {
            count(&self.stats.rx_tun_errors);
            return;
        }
        count(&self.stats.rx_packets);
        let bytes = u64::from(bytes);
        self.stats.rx_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.rx_by_qp.add(qpn, bytes);
    }

    /// A receive on `qpn` failed on its own (a message longer than its buffer, a protocol
    /// error: not a flush, which only follows a failure): the QP is in error, as a failed send
    /// says, and is reported the same way, once, its flow marked dead (no more sends posted,
    /// what waits let go to UD).
    fn receive_failed(&mut self, qpn: u32, status: u32) {
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
        let failed = flow.fail(qpn, Some(status), &mut self.unsent, &self.stats);
        self.events.extend(failed);
    }

    /// Forgets the flows of connections that are gone (no longer routed to their QP) and have
    /// nothing in flight or waiting: a connection closed while idle gets no completion that
    /// would remove its flow. Reports the receive totals when they changed. Then a keepalive,
    /// posted with `post` (given the QP and a free slot), on every connection nothing was
    /// sent on since the last housekeeping.
    pub fn housekeeping<E: Display>(&mut self, post: impl FnMut(&Q, u32) -> Result<(), E>) {
        self.age_drains();
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
            self.events.push_back(EngineEvent::Received(totals));
        }
        if let Some(totals) = self.keepalives_by_qp.report() {
            self.events.push_back(EngineEvent::Keepalives(totals));
        }
        self.send_keepalives(post);
    }

    /// Routes being let go: each settled if it can be (a connection that died meanwhile), or
    /// let go whatever is left past [`DRAIN_HOUSEKEEPINGS`].
    fn age_drains(&mut self) {
        let qpns: Vec<u32> = self.draining.keys().copied().collect();
        for qpn in qpns {
            let Some(d) = self.draining.get_mut(&qpn) else {
                continue;
            };
            d.housekeepings += 1;
            if d.housekeepings > DRAIN_HOUSEKEEPINGS {
                tracing::debug!(
                    "{}: the route to QP {qpn} let go with sends still held for it",
                    d.ip
                );
                self.release(qpn);
            } else {
                self.settle(qpn);
            }
        }
    }

    /// A keepalive on every connection nothing was sent on since the last housekeeping (see
    /// [`super::KEEPALIVE_LEN`]): it tells the peer that this engine runs, over the connection
    /// itself: a one-way stream's receiver sends nothing else on it, and the handshake
    /// stream's keepalive goes UD, which drops under load. Skipped where the window is full
    /// or no slot is free (the peer is then hearing from this end anyway).
    fn send_keepalives<E: Display>(&mut self, mut post: impl FnMut(&Q, u32) -> Result<(), E>) {
        let sent = std::mem::take(&mut self.sent_on);
        let idle: Vec<(IpAddr, u32)> = self
            .routes
            .iter()
            .map(|(ip, r)| (*ip, r.qp.qpn()))
            .filter(|(_, qpn)| !sent.contains(qpn) && !self.draining.contains_key(qpn))
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
            match post(&flow.qp, slot) {
                Ok(()) => {
                    flow.in_flight += 1;
                    count(&self.stats.keepalives_sent);
                }
                Err(e) => {
                    // Refused: broken, as a data send refused says.
                    self.free.push(slot);
                    tracing::debug!("keepalive to {ip}: {e}");
                    let failed = flow.fail(qpn, None, &mut self.unsent, &self.stats);
                    self.events.extend(failed);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
