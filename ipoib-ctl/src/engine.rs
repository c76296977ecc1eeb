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
//! free for the other connections, if any: a switch to UD loses nothing. Past that a packet
//! is let go and counted, one of the flow (source, protocol, ports) that holds the most
//! bytes of the queue, so a sparse flow loses nothing to a bulk one beside it; and a packet
//! let go, here or for want of a connection, is sent over UD by a raw socket whose mark the
//! fast path lets through ([`ud`]), unless UD cannot carry it (a GSO super-packet: TCP sends
//! it again): `tx_sent_ud`, `tx_not_sent_ud`.
//! [`EngineEvent::Drained`] when the queue is empty again. TUN reads pause while no send slot
//! is free. A send that completes in error, a receive that does (not
//! flushed), or a send the QP refuses to take reports [`EngineEvent::QpError`] once per QP:
//! what waits for it is let go to UD at once, and its flow stays, dead (what is read for it
//! is let go to UD, counted as without a connection; no keepalive goes), until the control
//! plane takes the route away. A live connection's route the control plane takes away goes once
//! what the engine holds for the peer has gone over it (what waits, what the TUN device still
//! holds, the sends in flight; 2 s at most): a demotion loses nothing either.
//!
//! Teardown: a closed connection's QP on the SRQ comes back to the engine of its lane, which
//! holds it until its last completion has been reaped (LAST_WQE_REACHED, then a drain marker:
//! [`graves`]), so no provider can clean unpolled completions, and the buffers they hold, out
//! of the CQ at its destroy.
//!
//! One turn of the loop does one thing: a batch of TUN reads (each packet posted as it is
//! read), or completions until the CQ is empty or 20 ms are spent (the sends they
//! release posted at the end, one chain per QP), or a command, or housekeeping.
//!
//! What to do with each packet and completion is decided in [`EngineCore`], free of I/O and
//! unit-tested on its own (`engine/core/tests.rs`); this module's loop reads, polls, posts and
//! writes, and performs what the core decides. The engine owns its routes (destination
//! address to connection) and its per-QP receive counts: the control plane changes routes with
//! [`EngineCommand`]s through an [`EngineControl`] and hears back [`EngineEvent`]s, so no lock
//! is taken per packet sent. On rings per connection a received message's ring is found in the
//! ring pool's table, behind one lock (taken also where a ring's QP is made or dropped, and by
//! the other lanes' engines).
//!
//! Lanes: the resources may be shared out over several lanes ([`crate::verbs::Lane`]: a CQ
//! and a range of the send slots each; the SRQ or ring pool shared), a QP made on the lane
//! with the fewest. [`Engine::lanes`] makes one engine per lane, each reading one queue of a
//! multi-queue TUN device and run on a thread of its own, with one [`EngineControl`] for all: a
//! route goes to the engine of its QP's lane, which steers its destination to its queue
//! ([`crate::steer`]) before it takes the route, so each destination is read by the engine
//! that posts on its connection. [`Engine::new`] is the one engine of one lane.
//!
//! Runs on tokio: AsyncFd on the TUN fd and on the CQ's completion channel.

mod control;
mod core;
pub mod graves;
mod packet;
pub mod ud;

use std::{
    collections::HashMap,
    io,
    net::IpAddr,
    os::fd::AsRawFd,
    sync::{Arc, Mutex, atomic::Ordering},
    time::Duration,
};

use ipoib_common::IPOIB_CM_MTU;
use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::mpsc,
};

use crate::{
    steer::Steering,
    tun::{TUN_READ_MAX, Tun, VNET_HDR_LEN},
    verbs::{Completion, Lane, RcQueuePair, Resources},
};

pub(crate) use self::control::RawFdRef;
use self::control::inject;
pub use self::control::{
    CloseWhenDone, EngineCommand, EngineConfig, EngineControl, EngineError, EngineEvent,
    EngineStats, Fault, Route,
};
pub use self::core::{EngineCore, Receipt, Released, Removal, SendEnd};

pub struct Engine {
    /// Where a TUN read puts what does not fit in a send slot (the packet is then dropped as
    /// oversize): a packet longer than the read's buffers would fail the read.
    spill: Vec<u8>,
    tun: Tun,
    io: Io,
    commands: mpsc::UnboundedReceiver<EngineCommand>,
    control: EngineControl,
}

/// The engine's I/O but the TUN device (kept apart so the TUN's readiness can be borrowed
/// while packets move), and the core that decides it.
struct Io {
    res: Arc<Resources>,
    /// The CQ it polls and the send slots it posts from.
    lane: Arc<Lane>,
    /// Where the TUN device's packets to each destination go, with more than one lane: each
    /// route this engine takes steers its destination to this lane's queue.
    steering: Option<Arc<Mutex<Steering>>>,
    /// What is decided: see [`EngineCore`].
    core: EngineCore<Arc<RcQueuePair>>,
    /// The completions of one poll, kept to reuse its memory.
    wcs: Vec<Completion>,
    events: Option<mpsc::UnboundedSender<EngineEvent>>,
    /// The close of each connection whose route is being let go ([`Removal::Draining`]),
    /// held until it is ([`EngineCore::next_released`]).
    closing: HashMap<u32, Vec<Arc<CloseWhenDone>>>,
    /// Closed QPs on the SRQ, held until drained ([`graves`]).
    graves: graves::Graves<Arc<RcQueuePair>>,
    /// The thread's CPU time when the loop started ([`EngineStats::cpu_ns`] counts from it).
    cpu_start_ns: u64,
    /// Where what cannot go over a connection goes instead (none: it is dropped).
    ud: Option<ud::UdOut>,
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
    /// `tun` must be non-blocking; `res` must have one lane, with a completion channel, and
    /// send slots of at least one CM message (65520 B). A packet longer than its connection's
    /// MTU is let go to UD and counted (`tx_oversize`): the route's device must keep GSO packets
    /// below it (gso_max_size).
    pub fn new(tun: Tun, res: Arc<Resources>, cfg: EngineConfig) -> Result<Self, EngineError> {
        Ok(Self::lanes(vec![tun], res, cfg)?.remove(0))
    }

    /// One engine per lane of `res`, lane `i`'s reading queue `i` of a multi-queue TUN
    /// device ([`Tun::create_queues`], one queue per lane), with one control for all: a route
    /// goes to the engine of its QP's lane, and with more than one lane the device is steered
    /// ([`Steering`]) so that a destination's packets are read by the engine of its route.
    /// Each engine runs on a thread of its own; they share the SRQ (or the ring pool).
    pub fn lanes(
        queues: Vec<Tun>,
        res: Arc<Resources>,
        cfg: EngineConfig,
    ) -> Result<Vec<Self>, EngineError> {
        if queues.len() != res.lanes.len() {
            return Err(EngineError::Lanes {
                lanes: res.lanes.len(),
                queues: queues.len(),
            });
        }
        if res.send.stride < u64::from(IPOIB_CM_MTU) {
            return Err(EngineError::SlotTooSmall {
                stride: res.send.stride,
                need: IPOIB_CM_MTU as usize,
            });
        }
        if res.lanes.iter().any(|l| l.cq.channel_fd().is_none()) {
            return Err(EngineError::NoChannel);
        }
        let steering = steer_queues(&queues)?;
        let (senders, receivers): (Vec<_>, Vec<_>) =
            queues.iter().map(|_| mpsc::unbounded_channel()).unzip();
        let control = EngineControl(senders.into());
        let engines = queues
            .into_iter()
            .zip(receivers)
            .zip(res.lanes.clone())
            .map(|((tun, commands), lane)| {
                let stats = Arc::new(EngineStats::default());
                stats
                    .alive_ns
                    .store(crate::clock::monotonic_ns(), Ordering::Relaxed);
                Self {
                    spill: vec![0; TUN_READ_MAX],
                    tun,
                    io: Io {
                        core: EngineCore::new(lane.slots.clone(), cfg, stats),
                        res: res.clone(),
                        lane,
                        steering: steering.clone(),
                        wcs: Vec::with_capacity(POLL_BATCH),
                        events: None,
                        closing: HashMap::new(),
                        graves: graves::Graves::default(),
                        cpu_start_ns: 0,
                        ud: None,
                    },
                    commands,
                    control: control.clone(),
                }
            })
            .collect();
        Ok(engines)
    }

    pub fn stats(&self) -> Arc<EngineStats> {
        self.io.core.stats().clone()
    }

    /// What this engine cannot send over a connection goes over UD through `out` (without
    /// it, it is dropped).
    pub fn send_unsent_over(&mut self, out: ud::UdOut) {
        self.io.ud = Some(out);
    }

    /// Where QP errors, congestion, routes added and receive totals are reported.
    pub fn events(&mut self) -> mpsc::UnboundedReceiver<EngineEvent> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.io.events = Some(tx);
        rx
    }

    /// Runs on a thread of its own (named `engine-LANE`, with a current-thread runtime of its
    /// own) until `stop`, then is dropped, its TUN queue with it; `done` is given how the run
    /// ended. A panic ends the thread without calling `done`.
    pub fn spawn_thread(
        mut self,
        stop: impl std::future::Future<Output = ()> + Send + 'static,
        done: impl FnOnce(Result<(), EngineError>) + Send + 'static,
    ) -> io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name(format!("engine-{}", self.lane()))
            .spawn(move || {
                let r = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| EngineError::Lane(format!("its runtime: {e}")))
                    .and_then(|rt| rt.block_on(self.run(stop)));
                drop(self);
                done(r);
            })
    }

    /// Reports into `tx` (the engines of several lanes into one channel).
    pub fn report_to(&mut self, tx: mpsc::UnboundedSender<EngineEvent>) {
        self.io.events = Some(tx);
    }

    /// The lane it runs (see [`Resources::lanes`]).
    pub fn lane(&self) -> u32 {
        self.io.lane.index
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
        let fd = self.io.lane.cq.channel_fd().ok_or(EngineError::NoChannel)?;
        // SAFETY: both fds stay open for as long as the AsyncFds live: the channel is owned by
        // the CQ in `io.lane` and the TUN fd by `self.tun`, both outliving this function.
        let channel = unsafe { AsyncFd::register_with_interest(RawFdRef(fd), Interest::READABLE) }
            .map_err(|e| tun_err(e.into_parts().1))?;
        let tun = unsafe {
            AsyncFd::register_with_interest(RawFdRef(self.tun.as_raw_fd()), Interest::READABLE)
        }
        .map_err(|e| tun_err(e.into_parts().1))?;
        self.io.lane.cq.arm()?;
        self.io.cpu_start_ns = crate::clock::thread_cpu_ns();
        // Completions left for the next turn (the last turn took its share and stopped).
        let mut more = self.io.completions(&self.tun)?;
        tokio::pin!(stop);
        let mut housekeeping = crate::clock::delayed_interval(HOUSEKEEPING);
        loop {
            let can_send = self.io.core.can_read();
            tokio::select! {
                _ = &mut stop => return Ok(()),
                Some(c) = self.commands.recv() => {
                    if let EngineCommand::Fault(f) = c {
                        inject(f).await;
                    }
                    self.io.command(c);
                    self.read_for_drains().map_err(&tun_err)?;
                }
                _ = housekeeping.tick() => {
                    self.io.housekeeping();
                    self.read_for_drains().map_err(&tun_err)?;
                }
                g = channel.readable() => {
                    let mut g = g.map_err(&tun_err)?;
                    let cq = &self.io.lane.cq;
                    while cq.wait(Duration::ZERO)? {}
                    g.clear_ready();
                    cq.arm()?;
                    more = self.io.completions(&self.tun)?;
                }
                // What the CQ still held after the last turn's share, taken after a yield: the
                // control loop shares this thread, and a future always ready never gives it back.
                () = tokio::task::yield_now(), if more => {
                    more = self.io.completions(&self.tun)?;
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

    /// A batch of TUN reads where a route being let go waits for the device to be read empty:
    /// after the command that asked (an idle device would never say it is readable), and at
    /// each housekeeping (in case no send slot was free to read with then).
    fn read_for_drains(&mut self) -> io::Result<()> {
        if self.io.core.awaits_read_empty() {
            self.read_batch()?;
        }
        Ok(())
    }

    /// Up to [`READ_BATCH`] packets from the TUN device, each read into a free send slot and
    /// sent from there to its connection (posted in chains of [`READ_CHAIN`]); true when the
    /// device has no more (its readiness is then cleared).
    fn read_batch(&mut self) -> io::Result<bool> {
        let r = self.read_some();
        self.io.flush();
        r
    }

    fn read_some(&mut self) -> io::Result<bool> {
        for _ in 0..READ_BATCH {
            let Some(slot) = self.io.core.take_slot() else {
                return Ok(false);
            };
            // SAFETY: the slot was free: nothing posted uses it until it is posted by
            // `transmit` (or given back free), after this slice's last use.
            let buf = unsafe { self.io.res.send.slot(slot) };
            let room = buf.len();
            let read = self.tun.recv_vectored(&mut [
                io::IoSliceMut::new(buf),
                io::IoSliceMut::new(&mut self.spill),
            ]);
            match read {
                Ok(n) if n <= room => {
                    self.io.transmit(slot, n);
                    if self.io.core.unposted() >= READ_CHAIN {
                        self.io.flush();
                    }
                }
                Ok(_) => {
                    // Cut short by its slot: UD could not carry it either.
                    self.io.core.give_back(slot, Some(|s| &s.tx_oversize));
                    let stats = self.io.core.stats();
                    stats.tx_not_sent_ud.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    self.io.core.give_back(slot, None);
                    if e.kind() == io::ErrorKind::WouldBlock {
                        self.io.core.handle_read_empty();
                        return Ok(true);
                    }
                    return Err(e);
                }
            }
        }
        Ok(false)
    }
}

impl Io {
    /// Tells the control plane what the core decided to, and lets go of the connections
    /// whose routes the core has let go of.
    fn tell(&mut self) {
        self.send_unsent();
        while let Some(e) = self.core.next_event() {
            if let Some(tx) = &self.events {
                let _ = tx.send(e);
            }
        }
        while let Some(Released { ip, qpn, unrouted }) = self.core.next_released() {
            if unrouted {
                self.steer(ip, Steering::clear);
            }
            // Its close fires once every lane has let go of it.
            self.closing.remove(&qpn);
        }
    }

    fn command(&mut self, c: EngineCommand) {
        match c {
            EngineCommand::AddRoute { ip, route } => {
                self.steer(ip, Steering::set);
                self.core.add_route(ip, route);
            }
            EngineCommand::Fault(_) => {}
            EngineCommand::Sync(ack) => {
                let _ = ack.send(());
            }
            EngineCommand::RemoveRoute { ip, qpn, close } => {
                match self.core.remove_route(ip, qpn) {
                    Removal::NotHere => drop(close),
                    Removal::Removed => {
                        self.steer(ip, Steering::clear);
                        drop(close);
                    }
                    Removal::Draining => self.closing.entry(qpn).or_default().extend(close),
                }
            }
            // A QP on its own ring takes its buffers with it: nothing to drain.
            EngineCommand::Bury(qp) if self.res.recv.srq().is_none() => drop(qp),
            EngineCommand::Bury(qp) => self.graves.bury(qp),
            EngineCommand::LastWqe(qpn) => self.graves.last_wqe(qpn),
        }
        self.post_drains();
        self.tell();
    }

    /// The drain markers due ([`graves::Graves::due`]) posted; a QP that refuses its marker
    /// is let go at once.
    fn post_drains(&mut self) {
        for qp in self.graves.due() {
            if let Err(e) = qp.post_drain() {
                tracing::debug!("drain marker on QP {}: {e}", qp.qpn());
                if let Some((qp, exit)) = self.graves.refused(qp.qpn()) {
                    self.let_go(qp, exit);
                }
            }
        }
    }

    /// A QP out of its grave, counted by how it left, dropped (destroyed once nothing else
    /// holds it).
    fn let_go(&self, qp: Arc<RcQueuePair>, exit: graves::Exit) {
        let stats = self.core.stats();
        self::core::count(match exit {
            graves::Exit::Drained => &stats.qps_drained,
            graves::Exit::TimedOut | graves::Exit::Refused => &stats.qps_undrained,
        });
        drop(qp);
    }

    /// `ip`'s steering to this lane's queue set (before its route: its packets are read
    /// here from then on) or cleared, with `change`; with one lane there is none. A failure
    /// leaves the destination where it was (its packets read by another lane are let go to
    /// UD there, counted as without a connection), and is said.
    fn steer(
        &self,
        ip: IpAddr,
        change: fn(&mut Steering, IpAddr, u32) -> Result<(), crate::steer::SteerError>,
    ) {
        let Some(steering) = &self.steering else {
            return;
        };
        let mut steering = steering.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = change(&mut steering, ip, self.lane.index) {
            tracing::warn!("steering {ip} to lane {}: {e}", self.lane.index);
        }
    }

    /// The engine's proof of life and its CPU time renewed, and the core's housekeeping: its
    /// keepalives (a message of [`KEEPALIVE_LEN`] zero bytes, which no IP packet is) posted.
    fn housekeeping(&mut self) {
        let stats = self.core.stats();
        stats
            .alive_ns
            .store(crate::clock::monotonic_ns(), Ordering::Relaxed);
        let cpu = crate::clock::thread_cpu_ns().saturating_sub(self.cpu_start_ns);
        stats.cpu_ns.store(cpu, Ordering::Relaxed);
        let send = &self.res.send;
        self.core.housekeeping(|qp, slot| {
            // SAFETY: the slot was free: nothing posted uses it until its send completes.
            unsafe { send.slot(slot)[..KEEPALIVE_LEN].fill(0) };
            qp.post_send(send, slot, KEEPALIVE_LEN as u32, u64::from(slot))
        });
        for (qp, exit) in self.graves.housekeeping() {
            tracing::debug!("QP {} let go undrained", qp.qpn());
            self.let_go(qp, exit);
        }
        self.post_drains();
        self.tell();
    }

    /// What the core let go of unsent: over UD where it can go, then its slot free again.
    fn send_unsent(&mut self) {
        while let Some((slot, len)) = self.core.next_unsent() {
            let sent = self.ud.as_ref().map(|ud| {
                // SAFETY: the slot is still taken (the core gives it out again only once
                // given back, below), and nothing posted uses it.
                let msg = unsafe { &mut self.res.send.slot(slot)[..len as usize] };
                ud.send(msg)
            });
            let stats = self.core.stats();
            match sent {
                Some(Ok(())) => stats.tx_sent_ud.fetch_add(1, Ordering::Relaxed),
                why => {
                    tracing::trace!("a packet not sent over UD either: {why:?}");
                    stats.tx_not_sent_ud.fetch_add(1, Ordering::Relaxed)
                }
            };
            self.core.give_back(slot, None);
        }
    }

    /// The packet read into send slot `slot` (`len` bytes): to the core, which decides where.
    fn transmit(&mut self, slot: u32, len: usize) {
        // SAFETY: the slot is this packet's: taken from the core's free slots and not posted
        // yet; the slice is not kept past the call.
        let msg = unsafe { &self.res.send.slot(slot)[..len] };
        self.core.transmit(slot, msg);
    }

    /// Posts the sends the core decided: one chain per QP.
    fn flush(&mut self) {
        let send = &self.res.send;
        self.core.flush(|qp, chain| qp.post_sends(send, chain));
        self.tell();
    }

    /// Takes completions, receives and sends apart, until the CQ is empty or the turn's
    /// [`TURN_BUDGET`] is spent, then posts the sends they freed room for; true when the CQ
    /// may hold more.
    fn completions(&mut self, tun: &Tun) -> Result<bool, EngineError> {
        let mut wcs = std::mem::take(&mut self.wcs);
        let mut result = Ok(true);
        let start = std::time::Instant::now();
        while start.elapsed() < TURN_BUDGET {
            let n = match self.lane.cq.poll(&mut wcs, POLL_BATCH) {
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
                } else if let Some(qpn) = graves::drain_of(wc.wr_id) {
                    if let Some((qp, exit)) = self.graves.drained(qpn) {
                        self.let_go(qp, exit);
                    }
                } else {
                    self.core.handle_send_done(wc);
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

    /// A receive completed: as the core decides, its message into the TUN device and its
    /// buffer posted again on the SRQ or its connection's ring.
    fn on_receive(&mut self, tun: &Tun, wc: &Completion) -> Result<(), EngineError> {
        let Some(buf) = self.res.recv.filled(wc) else {
            self.core.handle_receive_lost(wc);
            return Ok(());
        };
        let on_ring = buf.qp().is_some();
        match self.core.handle_receive(wc, buf.bytes().len(), on_ring) {
            Receipt::Keep => return Ok(()),
            Receipt::Repost => {}
            Receipt::Deliver => {
                let written = tun.send(buf.bytes()).is_ok();
                self.core.handle_delivered(wc.qp_num, wc.bytes, written);
            }
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
                self::core::count(&self.core.stats().rx_repost_errors);
                tracing::warn!("reposting a receive buffer on the SRQ: {e}");
                Ok(())
            }
        }
    }
}

/// With several queues, the device's steering (each destination to its route's queue); with
/// one, none.
fn steer_queues(queues: &[Tun]) -> Result<Option<Arc<Mutex<Steering>>>, EngineError> {
    if queues.len() == 1 {
        return Ok(None);
    }
    let t0 = std::time::Instant::now();
    let s = Steering::attach(&queues[0])?;
    tracing::info!(
        "{}: {} queues, each destination steered to its route's (the program given in {:.1?})",
        queues[0].name(),
        queues.len(),
        t0.elapsed()
    );
    Ok(Some(Arc::new(Mutex::new(s))))
}

#[cfg(test)]
mod tests {
    use super::{control::COUNTERS, *};

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
    fn lanes_counters_and_cpu_add_up_but_the_largest_and_the_oldest_proof_of_life() {
        let (a, b) = (EngineStats::default(), EngineStats::default());
        for (s, n) in [(&a, 1), (&b, 10)] {
            for (_, c) in COUNTERS {
                c(s).store(n, Ordering::Relaxed);
            }
            s.alive_ns.store(100 * n, Ordering::Relaxed);
            s.cpu_ns.store(1000 * n, Ordering::Relaxed);
        }
        let t = EngineStats::total([&a, &b]);
        assert_eq!(t.cpu_ns.load(Ordering::Relaxed), 11_000);
        for (name, v) in t.snapshot() {
            let want = if name == "tx_largest" { 10 } else { 11 };
            assert_eq!(v, want, "{name}");
        }
        assert_eq!(t.alive_ns.load(Ordering::Relaxed), 100);
        assert_eq!(EngineStats::total([&a]).snapshot(), a.snapshot());
        assert_eq!(t.snapshot().len(), COUNTERS.len());
    }

    #[test]
    fn silence_is_measured_from_the_last_proof_of_life() {
        let s = EngineStats::default();
        s.alive_ns.store(5_000_000_000, Ordering::Relaxed);
        assert_eq!(s.silent_for(6_500_000_000), Duration::from_millis(1500));
        assert_eq!(s.silent_for(4_000_000_000), Duration::ZERO);
    }
}
