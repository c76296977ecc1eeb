//! Verbs objects with owned lifetimes: each holds an `Arc` of what it was made from, so the
//! drop order the HCA needs (QP before CQ, SRQ and PD; MR before PD; everything before the
//! context) follows from ownership, and objects can move between threads and tasks.
//!
//! libibverbs objects are thread-safe (rdma-core locks inside the provider), hence the
//! `Send`/`Sync` impls. Several calls that verbs.h defines as static inline functions
//! (ibv_post_send, ibv_post_srq_recv, ibv_poll_cq, ibv_req_notify_cq) have no symbol to
//! bind: they dispatch through the context's ops table, as libibverbs itself does.

use std::{
    io,
    os::fd::RawFd,
    ptr,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use ibverbs_sys as ffi;

use super::receive::{Receive, ReceiveModel, RecvRing, RingPool, wr_id};
use super::{DeviceList, VerbsError, mtu_bytes};

/// An open device context, closed when the last object made from it is gone.
pub(super) struct Context {
    ctx: *mut ffi::ibv_context,
    name: String,
}

// SAFETY: libibverbs contexts may be used from any thread.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device, closed once; every object made from it holds an
        // Arc of this context and is gone.
        unsafe { ffi::ibv_close_device(self.ctx) };
    }
}

impl Context {
    pub(super) fn err(&self, what: &'static str, source: io::Error) -> VerbsError {
        VerbsError::Query {
            device: self.name.clone(),
            what,
            source,
        }
    }

    /// A verbs call's return code (0 or an errno value) as a result.
    fn check(&self, what: &'static str, rc: i32) -> Result<(), VerbsError> {
        match rc {
            0 => Ok(()),
            rc => Err(self.err(what, io::Error::from_raw_os_error(rc.abs()))),
        }
    }
}

/// An open RDMA device.
#[derive(Clone)]
pub struct Device {
    ctx: Arc<Context>,
}

/// An asynchronous event the HCA raised (ibv_get_async_event).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AsyncEvent {
    /// The SRQ's receives fell below its armed limit (the limit is disarmed by this).
    SrqLimitReached,
    /// A QP went to the error state; its QPN.
    QpFatal(u32),
    /// The last WQE of a QP attached to an SRQ was consumed (after an error); its QPN.
    QpLastWqeReached(u32),
    /// A port changed state; its number.
    PortChange(u8),
    /// Any other event type (the raw value).
    Other(u32),
}

impl Device {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Self, VerbsError> {
        let list = DeviceList::get()?;
        let (dev, name) = list
            .iter()
            .find(|(_, n)| n == name)
            .ok_or(VerbsError::NoDevices)?;
        // The context outlives the list: rdma-core keeps a device alive while a context of
        // it is open.
        Self::open_raw(dev, name)
    }

    pub(super) fn open_raw(dev: *mut ffi::ibv_device, name: String) -> Result<Self, VerbsError> {
        // SAFETY: a device of a live device list.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(VerbsError::Query {
                device: name,
                what: "ibv_open_device",
                source: io::Error::last_os_error(),
            });
        }
        Ok(Self {
            ctx: Arc::new(Context { ctx, name }),
        })
    }

    pub fn name(&self) -> &str {
        &self.ctx.name
    }

    pub(super) fn raw(&self) -> *mut ffi::ibv_context {
        self.ctx.ctx
    }

    pub(super) fn err(&self, what: &'static str, source: io::Error) -> VerbsError {
        self.ctx.err(what, source)
    }

    pub fn alloc_pd(&self) -> Result<Arc<ProtectionDomain>, VerbsError> {
        // SAFETY: valid context.
        let pd = unsafe { ffi::ibv_alloc_pd(self.ctx.ctx) };
        if pd.is_null() {
            return Err(self.err("ibv_alloc_pd", io::Error::last_os_error()));
        }
        Ok(Arc::new(ProtectionDomain {
            pd,
            ctx: self.ctx.clone(),
        }))
    }

    /// This port's address as a connection needs it: LID, active MTU and the GID at
    /// `gid_index`.
    pub fn port_address(&self, port: u8, gid_index: u8) -> Result<PortAddress, VerbsError> {
        let mut pa = ffi::ibv_port_attr::default();
        // SAFETY: valid context; the compat symbol takes the full struct, as ibverbs does.
        let rc = unsafe { ffi::ibv_query_port(self.ctx.ctx, port, ptr::addr_of_mut!(pa).cast()) };
        self.ctx.check("ibv_query_port", rc)?;
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: valid context and out pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.ctx.ctx, port, gid_index as i32, &mut gid) };
        self.ctx.check("ibv_query_gid", rc)?;
        Ok(PortAddress {
            port,
            lid: pa.lid,
            // SAFETY: raw is the union's plain-bytes view.
            gid: unsafe { gid.raw },
            gid_index,
            active_mtu: pa.active_mtu,
            ethernet: pa.link_layer as u32 == ffi::IBV_LINK_LAYER_ETHERNET,
            pkey_index: 0,
        })
    }

    /// How many physical ports the device has.
    pub fn port_count(&self) -> Result<u8, VerbsError> {
        Ok(self.query_device()?.phys_port_cnt)
    }

    fn query_device(&self) -> Result<ffi::ibv_device_attr, VerbsError> {
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: valid context and out pointer.
        let rc = unsafe { ffi::ibv_query_device(self.ctx.ctx, &mut attr) };
        self.ctx.check("ibv_query_device", rc)?;
        Ok(attr)
    }

    /// The port's P_Key table, in host order (ibv_query_pkey answers in network order).
    pub fn pkey_table(&self, port: u8) -> Result<Vec<u16>, VerbsError> {
        let mut pa = ffi::ibv_port_attr::default();
        // SAFETY: valid context; the compat symbol takes the full struct, as ibverbs does.
        let rc = unsafe { ffi::ibv_query_port(self.ctx.ctx, port, ptr::addr_of_mut!(pa).cast()) };
        self.ctx.check("ibv_query_port", rc)?;
        (0..i32::from(pa.pkey_tbl_len))
            .map(|i| {
                let mut raw = 0u16;
                // SAFETY: valid context and out pointer; i is below the table's length.
                let rc = unsafe { ffi::ibv_query_pkey(self.ctx.ctx, port, i, &mut raw) };
                self.ctx
                    .check("ibv_query_pkey", rc)
                    .map(|()| u16::from_be(raw))
            })
            .collect()
    }

    /// The port's address with the first GID that is set (on RoCE the GIDs follow the
    /// netdev's IP addresses, so index 0 may be empty).
    pub fn first_address(&self, port: u8) -> Result<PortAddress, VerbsError> {
        let mut pa = ffi::ibv_port_attr::default();
        // SAFETY: valid context; the compat symbol takes the full struct, as ibverbs does.
        let rc = unsafe { ffi::ibv_query_port(self.ctx.ctx, port, ptr::addr_of_mut!(pa).cast()) };
        self.ctx.check("ibv_query_port", rc)?;
        // GID indexes are a u8 in the address vector; a table longer than 256 is cut there.
        for idx in 0..pa.gid_tbl_len.clamp(0, 256) {
            let a = self.port_address(port, idx as u8)?;
            if a.gid != [0; 16] {
                return Ok(a);
            }
        }
        Err(self.err(
            "port has no GID",
            io::Error::from(io::ErrorKind::AddrNotAvailable),
        ))
    }

    /// The limits the memory plan needs (one ibv_query_device; `discover` reads every
    /// device, port and GID besides).
    pub fn limits(&self) -> Result<crate::plan::HcaLimits, VerbsError> {
        let attr = self.query_device()?;
        let n = |v: i32| v.max(0) as u64;
        Ok(crate::plan::HcaLimits {
            max_qp: n(attr.max_qp),
            max_qp_wr: n(attr.max_qp_wr),
            max_cqe: n(attr.max_cqe),
            max_srq: n(attr.max_srq),
            max_srq_wr: n(attr.max_srq_wr),
            max_srq_sge: n(attr.max_srq_sge),
        })
    }

    /// The fd that turns readable when an asynchronous event waits: an event loop watches it
    /// and then takes the events with [`Device::async_event`] and a zero timeout.
    pub fn async_fd(&self) -> RawFd {
        // SAFETY: valid context; async_fd is plain data, fixed for the context's life.
        unsafe { (*self.ctx.ctx).async_fd }
    }

    /// The next asynchronous event, waiting up to `timeout`; `None` when none came.
    pub fn async_event(&self, timeout: Duration) -> Result<Option<AsyncEvent>, VerbsError> {
        // SAFETY: valid context; async_fd is plain data.
        let fd = unsafe { (*self.ctx.ctx).async_fd };
        if !wait_readable(fd, timeout).map_err(|e| self.err("poll(async_fd)", e))? {
            return Ok(None);
        }
        let mut ev = ffi::ibv_async_event::default();
        // SAFETY: valid context and out pointer; the fd is readable so this does not block.
        let rc = unsafe { ffi::ibv_get_async_event(self.ctx.ctx, &mut ev) };
        if rc != 0 {
            return Err(self.err("ibv_get_async_event", io::Error::last_os_error()));
        }
        // SAFETY: the union member that goes with each event type.
        let kind = unsafe {
            match ev.event_type {
                ffi::IBV_EVENT_SRQ_LIMIT_REACHED => AsyncEvent::SrqLimitReached,
                ffi::IBV_EVENT_QP_FATAL => AsyncEvent::QpFatal((*ev.element.qp).qp_num),
                ffi::IBV_EVENT_QP_LAST_WQE_REACHED => {
                    AsyncEvent::QpLastWqeReached((*ev.element.qp).qp_num)
                }
                ffi::IBV_EVENT_PORT_ACTIVE | ffi::IBV_EVENT_PORT_ERR => {
                    AsyncEvent::PortChange(ev.element.port_num as u8)
                }
                other => AsyncEvent::Other(other),
            }
        };
        // SAFETY: the event returned above, acknowledged once.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Ok(Some(kind))
    }
}

/// What every connection of a node shares: the PD, where receives land (the SRQ, or the pool
/// of per-connection rings), the registered send slots, the port's address, and its lanes:
/// one per engine, each a CQ (with a completion channel) for the sends and receives of the
/// QPs made on it and a range of the send slots. Built once, for the daemon and the test nodes
/// alike. Each object holds an Arc of what it was made from (the QPs made from these too), so
/// the HCA's drop order holds whatever drops first.
pub struct Resources {
    pub pd: Arc<ProtectionDomain>,
    pub recv: Receive,
    /// Send slots, each one CM message in whole pages.
    pub send: Arc<MemoryRegion>,
    pub port: PortAddress,
    /// At least one. A QP is made on the lane with the fewest QPs ([`Resources::rc_qp`]).
    pub lanes: Vec<Arc<Lane>>,
}

/// One engine's share of [`Resources`]: the CQ its QPs' sends and receives complete on, and
/// the send slots it posts from.
pub struct Lane {
    pub index: u32,
    pub cq: Arc<CompletionQueue>,
    pub slots: std::ops::Range<u32>,
    /// QPs made on this lane and not yet dropped.
    qps: AtomicU32,
}

impl Lane {
    /// QPs made on this lane and not yet dropped.
    pub fn qps(&self) -> u32 {
        self.qps.load(Ordering::Relaxed)
    }
}

/// Send slots `0..slots` shared out over `lanes` lanes, in order, the first ones one more when
/// they do not divide evenly.
fn lane_slots(slots: u32, lanes: u32, lane: u32) -> std::ops::Range<u32> {
    let (each, more) = (slots / lanes, slots % lanes);
    let start = lane * each + lane.min(more);
    start..start + each + u32::from(lane < more)
}

impl Resources {
    /// On `port` of `dev` (its first GID that is set), QPs in the partition at `pkey_index` of
    /// the port's P_Key table: receives of `buffer_bytes` as `model` says (an SRQ with every
    /// buffer posted, or a pool that registers a ring per connection), `send_slots` send
    /// slots, every buffer `stride` bytes apart, and `lanes` lanes (at least one, at most one
    /// per send slot) sharing the send slots out. Each lane's CQ is deep enough for every
    /// receive that may be posted (any of them may complete on any lane) and its sends (twice:
    /// a slot may complete in error after a flush).
    #[allow(clippy::too_many_arguments)]
    pub fn create_lanes(
        dev: &Device,
        port: u8,
        pkey_index: u16,
        model: ReceiveModel,
        buffer_bytes: u32,
        send_slots: u32,
        stride: u64,
        lanes: u32,
    ) -> Result<Arc<Self>, VerbsError> {
        let lanes = lanes.clamp(1, send_slots.max(1));
        let port = PortAddress {
            pkey_index,
            ..dev.first_address(port)?
        };
        let pd = dev.alloc_pd()?;
        let lanes = (0..lanes)
            .map(|index| {
                let slots = lane_slots(send_slots, lanes, index);
                let cqe = model.receives().saturating_add(2 * slots.len() as u32);
                Ok(Arc::new(Lane {
                    index,
                    cq: CompletionQueue::create(dev, cqe, true)?,
                    slots,
                    qps: AtomicU32::new(0),
                }))
            })
            .collect::<Result<Vec<_>, VerbsError>>()?;
        let recv = match model {
            ReceiveModel::Srq { depth } => Receive::Srq(SharedReceiveQueue::create(
                &pd,
                depth,
                buffer_bytes,
                stride,
            )?),
            ReceiveModel::Rings { depth, max } => {
                Receive::Rings(RingPool::new(&pd, depth, max, buffer_bytes, stride)?)
            }
        };
        let send = MemoryRegion::register(&pd, send_slots, stride)?;
        Ok(Arc::new(Self {
            pd,
            recv,
            send,
            port,
            lanes,
        }))
    }

    /// An RC QP on these resources, first PSN `psn`, on the lane with the fewest QPs (the
    /// first of them): receiving on the SRQ, or on a ring of its own (registered and posted
    /// here; Err([`VerbsError::RingsExhausted`]) before anything is allocated when the pool is
    /// at its cap).
    pub fn rc_qp(&self, max_send_wr: u32, psn: u32) -> Result<Arc<RcQueuePair>, VerbsError> {
        let lane = self
            .lanes
            .iter()
            .min_by_key(|l| l.qps())
            .expect("at least one lane");
        let ring = match &self.recv {
            Receive::Srq(_) => None,
            Receive::Rings(pool) => Some(pool.ring()?),
        };
        let qp = Arc::new(RcQueuePair::create(
            &self.pd,
            lane,
            self.recv.srq(),
            ring,
            self.port,
            max_send_wr,
            psn,
        )?);
        if let (Some(pool), Some(ring)) = (self.recv.rings(), qp.ring()) {
            pool.register(ring.id, &qp);
            let slots: Vec<u32> = (0..pool.depth).collect();
            qp.post_ring(&slots)?;
        }
        Ok(qp)
    }
}

/// Waits until `fd` is readable; false on timeout.
fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    loop {
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n >= 0 {
            return Ok(n > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Where a port is, for the far end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAddress {
    pub port: u8,
    pub lid: u16,
    pub gid: [u8; 16],
    pub gid_index: u8,
    /// ibv_mtu enum (1 = 256 .. 5 = 4096).
    pub active_mtu: u32,
    /// RoCE: addressing by GID (a GRH on every packet), no LIDs.
    pub ethernet: bool,
    /// Where the partition's P_Key sits in the port's table: local, for this side's QPs
    /// (0, the default partition, unless [`Resources::create_lanes`] was given another).
    pub pkey_index: u16,
}

pub struct ProtectionDomain {
    pd: *mut ffi::ibv_pd,
    pub(super) ctx: Arc<Context>,
}

// SAFETY: as Context.
unsafe impl Send for ProtectionDomain {}
unsafe impl Sync for ProtectionDomain {}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; every MR, SRQ and QP of it holds an Arc of it and
        // is gone.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// Page-aligned, zeroed memory.
struct Buffers {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Drop for Buffers {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// `count` slots of `stride` bytes in one registered region (local write access: receives
/// land in it; sends read from it).
pub struct MemoryRegion {
    mr: *mut ffi::ibv_mr,
    buffers: Buffers,
    pub count: u32,
    /// Bytes between slots (whole pages).
    pub stride: u64,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: the region is plain memory; who may touch which slot is the caller's contract
// (see `slot`).
unsafe impl Send for MemoryRegion {}
unsafe impl Sync for MemoryRegion {}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered here, deregistered once, before the memory (a field) is freed;
        // whatever posted work into it (SRQ, QPs) holds an Arc of this region and is gone.
        unsafe { ffi::ibv_dereg_mr(self.mr) };
    }
}

impl MemoryRegion {
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        count: u32,
        stride: u64,
    ) -> Result<Arc<Self>, VerbsError> {
        let invalid = |what| {
            pd.ctx
                .err(what, io::Error::from(io::ErrorKind::InvalidInput))
        };
        if count == 0 || stride == 0 || !stride.is_multiple_of(4096) {
            return Err(invalid("region sizing"));
        }
        let len = count as u64 * stride;
        let layout = std::alloc::Layout::from_size_align(len as usize, 4096)
            .map_err(|_| invalid("buffer layout"))?;
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(pd.ctx.err(
                "allocating registered buffers",
                io::Error::from(io::ErrorKind::OutOfMemory),
            ));
        }
        let buffers = Buffers { ptr, layout };
        // SAFETY: the region is valid for len bytes and outlives the MR (freed after it).
        let mr = unsafe {
            ffi::ibv_reg_mr(
                pd.pd,
                buffers.ptr.cast(),
                len as usize,
                ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
            )
        };
        if mr.is_null() {
            return Err(pd.ctx.err("ibv_reg_mr", io::Error::last_os_error()));
        }
        Ok(Arc::new(Self {
            mr,
            buffers,
            count,
            stride,
            pd: pd.clone(),
        }))
    }

    fn sge(&self, slot: u32, len: u32) -> ffi::ibv_sge {
        debug_assert!(slot < self.count && len as u64 <= self.stride);
        ffi::ibv_sge {
            addr: self.buffers.ptr as u64 + slot as u64 * self.stride,
            length: len,
            // SAFETY: the MR is valid; lkey is plain data.
            lkey: unsafe { (*self.mr).lkey },
        }
    }

    /// Slot `slot`'s bytes.
    ///
    /// # Safety
    /// The slot must not be posted to the HCA (receive not yet completed, or send not yet
    /// completed) while the slice lives, and no other slice of it may be live: the caller owns
    /// each slot between its completion and its next post.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slot(&self, slot: u32) -> &mut [u8] {
        assert!(slot < self.count, "slot {slot} of {}", self.count);
        // SAFETY: within the allocation; exclusivity is the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.buffers.ptr.add((slot as u64 * self.stride) as usize),
                self.stride as usize,
            )
        }
    }
}

/// Sends one provider call takes at most in [`RcQueuePair::post_sends`] (its chain is built
/// on the stack; longer lists go in several calls).
pub const POST_CHAIN_MAX: usize = 64;

/// Completions one [`CompletionQueue::poll`] takes at most (on the stack).
pub const POLL_MAX: usize = 64;

/// Posts receives of `region`'s `slots` (`len` bytes each, work request ids of `ring`) in
/// chains of `chain`, each through `post` (the SRQ's or the QP's post call: it gets the
/// chain's first request and returns its rc); `posted` counts what went.
fn post_receives(
    region: &MemoryRegion,
    len: u32,
    ring: u32,
    slots: &[u32],
    chain: usize,
    posted: &AtomicU32,
    mut post: impl FnMut(*mut ffi::ibv_recv_wr) -> i32,
) -> i32 {
    for chunk in slots.chunks(chain) {
        let mut sges: Vec<ffi::ibv_sge> = chunk.iter().map(|&i| region.sge(i, len)).collect();
        let mut wrs: Vec<ffi::ibv_recv_wr> = chunk
            .iter()
            .map(|&i| ffi::ibv_recv_wr {
                wr_id: wr_id(ring, i),
                next: ptr::null_mut(),
                sg_list: ptr::null_mut(),
                num_sge: 1,
            })
            .collect();
        for k in 0..wrs.len() {
            wrs[k].sg_list = &mut sges[k];
            if k + 1 < wrs.len() {
                wrs[k].next = &mut wrs[k + 1] as *mut _;
            }
        }
        let rc = post(wrs.as_mut_ptr());
        if rc != 0 {
            return rc;
        }
        posted.fetch_add(chunk.len() as u32, Ordering::Relaxed);
    }
    0
}

/// A shared receive queue with its buffers registered once and every one of them posted.
pub struct SharedReceiveQueue {
    srq: *mut ffi::ibv_srq,
    pub region: Arc<MemoryRegion>,
    pub depth: u32,
    pub buffer_bytes: u32,
    posted: AtomicU32,
}

// SAFETY: as Context.
unsafe impl Send for SharedReceiveQueue {}
unsafe impl Sync for SharedReceiveQueue {}

impl Drop for SharedReceiveQueue {
    fn drop(&mut self) {
        // SAFETY: created here, destroyed once, before the region its receives point into
        // (a field, dropped after); every QP on it holds an Arc of it and is gone.
        unsafe { ffi::ibv_destroy_srq(self.srq) };
    }
}

/// What the HCA reports for an SRQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

impl SharedReceiveQueue {
    /// An SRQ of `depth` receives of `buffer_bytes` each, `stride` apart in one registered
    /// region (one SGE per receive: the region is contiguous), every receive posted and the
    /// limit event armed at a quarter of the depth, for refilling before starvation.
    pub fn create(
        pd: &Arc<ProtectionDomain>,
        depth: u32,
        buffer_bytes: u32,
        stride: u64,
    ) -> Result<Arc<Self>, VerbsError> {
        if buffer_bytes == 0 || stride < buffer_bytes as u64 {
            return Err(pd
                .ctx
                .err("SRQ sizing", io::Error::from(io::ErrorKind::InvalidInput)));
        }
        let region = MemoryRegion::register(pd, depth, stride)?;
        let mut init = ffi::ibv_srq_init_attr {
            srq_context: ptr::null_mut(),
            attr: ffi::ibv_srq_attr {
                max_wr: depth,
                max_sge: 1,
                srq_limit: 0,
            },
        };
        // SAFETY: valid PD and init attributes.
        let srq = unsafe { ffi::ibv_create_srq(pd.pd, &mut init) };
        if srq.is_null() {
            return Err(pd.ctx.err("ibv_create_srq", io::Error::last_os_error()));
        }
        let q = Self {
            srq,
            region,
            depth,
            buffer_bytes,
            posted: AtomicU32::new(0),
        };
        q.post(0..depth)?;
        q.arm_limit(depth / 4)?;
        Ok(Arc::new(q))
    }

    fn ctx(&self) -> &Context {
        &self.region.pd.ctx
    }

    /// Receives posted and not yet completed, as far as this process has been told
    /// (`completed` is called for each receive completion).
    pub fn posted(&self) -> u32 {
        self.posted.load(Ordering::Relaxed)
    }

    /// Counts one receive completion (the slot is the caller's until posted again).
    pub fn completed(&self, n: u32) {
        self.posted.fetch_sub(n, Ordering::Relaxed);
    }

    /// Posts the receive buffers `slots` (each receive's wr_id is its slot: ring 0), in chains.
    pub fn post(&self, slots: std::ops::Range<u32>) -> Result<(), VerbsError> {
        let v: Vec<u32> = slots.collect();
        self.post_slots(&v)
    }

    /// Posts the receive buffers of `slots`, in chains of up to 256.
    pub fn post_slots(&self, slots: &[u32]) -> Result<(), VerbsError> {
        let (region, len) = (&self.region, self.buffer_bytes);
        let rc = post_receives(region, len, 0, slots, 256, &self.posted, |wr| {
            let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
            // SAFETY: the SRQ's context is valid; the chain and its SGEs outlive the call.
            unsafe {
                let ctx = (*self.srq).context;
                match (*ctx).ops.post_srq_recv {
                    Some(f) => f(self.srq, wr, &mut bad),
                    None => libc::EOPNOTSUPP,
                }
            }
        });
        self.ctx().check("post_srq_recv", rc)
    }

    /// Arms the SRQ limit event: the HCA raises it when fewer than `limit` receives remain.
    pub fn arm_limit(&self, limit: u32) -> Result<(), VerbsError> {
        let mut attr = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        // SAFETY: valid SRQ; IBV_SRQ_LIMIT only.
        let rc = unsafe { ffi::ibv_modify_srq(self.srq, &mut attr, ffi::IBV_SRQ_LIMIT as i32) };
        self.ctx().check("ibv_modify_srq", rc)
    }

    pub fn query(&self) -> Result<SrqAttr, VerbsError> {
        let mut attr = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: 0,
        };
        // SAFETY: valid SRQ and out pointer.
        let rc = unsafe { ffi::ibv_query_srq(self.srq, &mut attr) };
        self.ctx().check("ibv_query_srq", rc)?;
        Ok(SrqAttr {
            max_wr: attr.max_wr,
            max_sge: attr.max_sge,
            srq_limit: attr.srq_limit,
        })
    }
}

/// The bit [`RcQueuePair::post_sends`] sets in every send's work request id, and
/// [`CompletionQueue::poll`] takes off again: what tells a send's completion from a receive's.
/// The completion's opcode cannot: it is undefined when the status is an error (soft-RoCE
/// leaves it 0, `IBV_WC_SEND`, on a receive that failed). A caller's send ids stay below it;
/// receive ids ([`super::receive::wr_id`]) never reach it.
pub const SEND_WR_ID: u64 = 1 << 63;

/// The status of a work request flushed because its QP was already in error (a completion
/// that says nothing new of the QP).
pub const WC_FLUSHED: u32 = ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;

/// A completion, reduced to what the engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The work request id as it was posted.
    pub wr_id: u64,
    pub qp_num: u32,
    pub bytes: u32,
    /// true for a receive, false for a send (from the work request id, so also in error).
    pub recv: bool,
    /// `None` on success, else the ibv_wc_status value (e.g. 12 = retry exceeded,
    /// 5 = flushed after an error).
    pub error: Option<u32>,
}

impl Completion {
    /// What the engine uses of the provider's completion `wc` (its opcode is not read).
    fn of(wc: &ffi::ibv_wc) -> Self {
        let error = wc.error().map(|(status, _)| status);
        Self::from_id(wc.wr_id(), wc.qp_num, wc.len() as u32, error)
    }

    /// A completion of the work request posted with id `id` (as the HCA hands it back).
    fn from_id(id: u64, qp_num: u32, bytes: u32, error: Option<u32>) -> Self {
        Self {
            wr_id: id & !SEND_WR_ID,
            qp_num,
            bytes,
            recv: id & SEND_WR_ID == 0,
            error,
        }
    }
}

/// A completion queue, optionally with its own completion channel (an fd that becomes
/// readable when the armed CQ gets a completion: what tokio waits on).
pub struct CompletionQueue {
    cq: *mut ffi::ibv_cq,
    channel: *mut ffi::ibv_comp_channel,
    ctx: Arc<Context>,
    /// Events taken from the channel and not yet acknowledged (acknowledged in batches and
    /// before destroy, as ibv_destroy_cq requires).
    unacked: AtomicU32,
}

// SAFETY: as Context.
unsafe impl Send for CompletionQueue {}
unsafe impl Sync for CompletionQueue {}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: created here; every QP on it holds an Arc of it and is gone; events are
        // acknowledged before the CQ is destroyed, the channel after it.
        unsafe {
            let n = self.unacked.load(Ordering::Relaxed);
            if n > 0 {
                ffi::ibv_ack_cq_events(self.cq, n);
            }
            ffi::ibv_destroy_cq(self.cq);
            if !self.channel.is_null() {
                ffi::ibv_destroy_comp_channel(self.channel);
            }
        }
    }
}

impl CompletionQueue {
    pub fn create(dev: &Device, cqe: u32, with_channel: bool) -> Result<Arc<Self>, VerbsError> {
        let channel = if with_channel {
            // SAFETY: valid context.
            let ch = unsafe { ffi::ibv_create_comp_channel(dev.raw()) };
            if ch.is_null() {
                return Err(dev.err("ibv_create_comp_channel", io::Error::last_os_error()));
            }
            ch
        } else {
            ptr::null_mut()
        };
        // SAFETY: valid context; the channel is null or ours.
        let cq = unsafe { ffi::ibv_create_cq(dev.raw(), cqe as i32, ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = io::Error::last_os_error();
            if !channel.is_null() {
                // SAFETY: created above, used by nothing.
                unsafe { ffi::ibv_destroy_comp_channel(channel) };
            }
            return Err(dev.err("ibv_create_cq", e));
        }
        Ok(Arc::new(Self {
            cq,
            channel,
            ctx: dev.ctx.clone(),
            unacked: AtomicU32::new(0),
        }))
    }

    /// Takes up to `max` completions (64 at most per call) into `out` (cleared first);
    /// returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError> {
        out.clear();
        // SAFETY: ibv_wc is plain integers; zero is a valid value.
        let mut wcs: [ffi::ibv_wc; POLL_MAX] = unsafe { std::mem::zeroed() };
        let max = max.clamp(1, POLL_MAX);
        // SAFETY: valid CQ; wcs has room for max entries.
        let n = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.poll_cq {
                Some(f) => f(self.cq, max as i32, wcs.as_mut_ptr()),
                None => -libc::EOPNOTSUPP,
            }
        };
        if n < 0 {
            return Err(self.ctx.err("poll_cq", io::Error::from_raw_os_error(-n)));
        }
        out.extend(wcs[..n as usize].iter().map(Completion::of));
        Ok(n as usize)
    }

    /// Asks for an event on the channel at the next completion.
    pub fn arm(&self) -> Result<(), VerbsError> {
        // SAFETY: valid CQ.
        let rc = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.req_notify_cq {
                Some(f) => f(self.cq, 0),
                None => libc::EOPNOTSUPP,
            }
        };
        self.ctx.check("req_notify_cq", rc)
    }

    /// The completion channel's fd (None without a channel).
    pub fn channel_fd(&self) -> Option<RawFd> {
        // SAFETY: the channel is ours; fd is plain data.
        (!self.channel.is_null()).then(|| unsafe { (*self.channel).fd })
    }

    /// Waits up to `timeout` for the armed CQ's event and takes it; false on timeout. Re-arm,
    /// then poll again before waiting, or a completion that raced the arm is missed.
    pub fn wait(&self, timeout: Duration) -> Result<bool, VerbsError> {
        let fd = self.channel_fd().ok_or_else(|| {
            self.ctx.err(
                "waiting without a completion channel",
                io::Error::from(io::ErrorKind::Unsupported),
            )
        })?;
        if !wait_readable(fd, timeout).map_err(|e| self.ctx.err("poll(comp channel)", e))? {
            return Ok(false);
        }
        let mut cq = ptr::null_mut();
        let mut cq_ctx = ptr::null_mut();
        // SAFETY: our channel; the fd is readable so this does not block.
        let rc = unsafe { ffi::ibv_get_cq_event(self.channel, &mut cq, &mut cq_ctx) };
        if rc != 0 {
            return Err(self.ctx.err("ibv_get_cq_event", io::Error::last_os_error()));
        }
        if self.unacked.fetch_add(1, Ordering::Relaxed) + 1 >= 64 {
            let n = self.unacked.swap(0, Ordering::Relaxed);
            if n > 0 {
                // SAFETY: events taken from this CQ's channel, acknowledged once.
                unsafe { ffi::ibv_ack_cq_events(self.cq, n) };
            }
        }
        Ok(true)
    }
}

/// The far end of an RC connection, as the handshake carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcEndpoint {
    /// 24 bits.
    pub qpn: u32,
    /// 24 bits: the first PSN the endpoint sends with.
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// ibv_mtu enum (1 = 256 .. 5 = 4096): the endpoint's port MTU.
    pub mtu: u32,
}

/// QP state as ibv_query_qp reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Error,
    Unknown(u32),
}

/// RC timing of a connection.
///
/// - Transport: local ACK timeout 4.096 µs * 2^14 (~67 ms), 7 retries: a peer that answers
///   nothing (gone, link down) ends in a completion error within about half a second.
/// - Receiver not ready (RNR): a receiver whose buffers are all in use answers with an RNR NAK
///   carrying its `min_rnr_timer`; the sender waits that long and tries again, `rnr_retry`
///   times (7: without end). A ring per connection holds 64 messages, a few milliseconds of
///   a fast stream, so any pause of the receiving engine longer than the retries cover kills
///   a connection that had a finite count (0.64 ms * 7 tries: under 5 ms). Retrying without
///   end at a short timer makes a busy receiver slow its sender to its own pace, and
///   liveness is judged elsewhere: word from the peer (its keepalive on the connection's
///   stream, its traffic, the sends its HCA acknowledges: all stop with a stopped peer once
///   its posted buffers are full), the engine's queue bound (a peer that takes nothing goes UD until it drains) and
///   the policy's idle reaping. Measured in `tests/cm.rs`
///   (`a_dry_ring_slows_its_sender_and_the_connection_lives`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcTiming {
    pub ack_timeout: u8,
    pub retry_cnt: u8,
    /// 7: retry without end.
    pub rnr_retry: u8,
    /// The RNR NAK timer this end asks for (IB encoding: 12 = 0.64 ms, 31 = 491.52 ms).
    pub min_rnr_timer: u8,
}

impl Default for RcTiming {
    fn default() -> Self {
        Self {
            ack_timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
        }
    }
}

/// The RNR NAK timer's IB encoding in microseconds (IBA table 45).
pub fn rnr_timer_us(code: u8) -> u32 {
    const US: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    US[usize::from(code & 31)]
}

/// A reliable-connected queue pair receiving on an SRQ or on a ring of its own.
pub struct RcQueuePair {
    qp: *mut ffi::ibv_qp,
    port: PortAddress,
    pub psn: u32,
    /// Its own receive buffers (no SRQ): freed after the QP is destroyed.
    ring: Option<RecvRing>,
    _pd: Arc<ProtectionDomain>,
    /// Its sends and receives complete on the lane's CQ; counted among the lane's QPs until
    /// dropped.
    lane: Arc<Lane>,
    _srq: Option<Arc<SharedReceiveQueue>>,
}

// SAFETY: as Context.
unsafe impl Send for RcQueuePair {}
unsafe impl Sync for RcQueuePair {}

impl Drop for RcQueuePair {
    fn drop(&mut self) {
        // SAFETY: created here, destroyed once; the CQs, SRQ, ring and PD it uses are fields,
        // alive until after this.
        unsafe { ffi::ibv_destroy_qp(self.qp) };
        self.lane.qps.fetch_sub(1, Ordering::Relaxed);
    }
}

impl RcQueuePair {
    /// An RC QP receiving on `srq`, or on `ring` (exactly one of them), its sends and receives
    /// completing on `lane`'s CQ, moved to INIT on `port`. `psn` is the first
    /// PSN it will send with (24 bits). A ring's receives are posted by the caller.
    pub(super) fn create(
        pd: &Arc<ProtectionDomain>,
        lane: &Arc<Lane>,
        srq: Option<&Arc<SharedReceiveQueue>>,
        ring: Option<RecvRing>,
        port: PortAddress,
        max_send_wr: u32,
        psn: u32,
    ) -> Result<Self, VerbsError> {
        let max_recv_wr = ring.as_ref().map_or(0, |r| r.region.count);
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: lane.cq.cq,
            recv_cq: lane.cq.cq,
            srq: srq.map_or(ptr::null_mut(), |s| s.srq),
            cap: ffi::ibv_qp_cap {
                max_send_wr,
                max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 1,
        };
        // SAFETY: valid PD, CQs and SRQ, all kept alive by the QP's fields.
        let qp = unsafe { ffi::ibv_create_qp(pd.pd, &mut init) };
        if qp.is_null() {
            return Err(pd.ctx.err("ibv_create_qp", io::Error::last_os_error()));
        }
        // Counted here, uncounted in drop.
        lane.qps.fetch_add(1, Ordering::Relaxed);
        let q = Self {
            qp,
            port,
            psn: psn & 0xff_ffff,
            ring,
            _pd: pd.clone(),
            lane: lane.clone(),
            _srq: srq.cloned(),
        };
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: port.pkey_index,
            port_num: port.port,
            qp_access_flags: 0,
            ..Default::default()
        };
        use ffi::ibv_qp_attr_mask as M;
        q.modify(
            &mut attr,
            M::IBV_QP_STATE | M::IBV_QP_PKEY_INDEX | M::IBV_QP_PORT | M::IBV_QP_ACCESS_FLAGS,
            "ibv_modify_qp(INIT)",
        )?;
        Ok(q)
    }

    /// Its own receive ring (None on an SRQ).
    pub fn ring(&self) -> Option<&RecvRing> {
        self.ring.as_ref()
    }

    /// Posts the buffers `slots` of its ring (each receive's wr_id names the ring and slot),
    /// in chains of up to 64.
    pub fn post_ring(&self, slots: &[u32]) -> Result<(), VerbsError> {
        let Some(ring) = &self.ring else {
            return Err(self.ctx().err(
                "post_recv: the QP receives on an SRQ",
                io::Error::from(io::ErrorKind::InvalidInput),
            ));
        };
        let (region, len) = (&ring.region, ring.buffer_bytes);
        let rc = post_receives(region, len, ring.id, slots, 64, &ring.posted, |wr| {
            let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
            // SAFETY: valid QP; the chain and its SGEs outlive the call; the region is
            // registered on this QP's PD and outlives the QP.
            unsafe {
                let ctx = (*self.qp).context;
                match (*ctx).ops.post_recv {
                    Some(f) => f(self.qp, wr, &mut bad),
                    None => libc::EOPNOTSUPP,
                }
            }
        });
        self.ctx().check("post_recv", rc)
    }

    fn ctx(&self) -> &Context {
        &self._pd.ctx
    }

    fn modify(
        &self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        what: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: valid QP and attributes.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        self.ctx().check(what, rc)
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: valid QP; qp_num is plain data.
        unsafe { (*self.qp).qp_num }
    }

    /// The lane it was made on: the engine that posts on it and polls its completions.
    pub fn lane(&self) -> u32 {
        self.lane.index
    }

    /// This end, for the handshake.
    pub fn endpoint(&self) -> RcEndpoint {
        RcEndpoint {
            qpn: self.qpn(),
            psn: self.psn,
            lid: self.port.lid,
            gid: self.port.gid,
            mtu: self.port.active_mtu,
        }
    }

    /// The path MTU with `remote` (the smaller port MTU), in bytes.
    pub fn path_mtu(&self, remote: &RcEndpoint) -> u32 {
        mtu_bytes(self.port.active_mtu.min(remote.mtu))
    }

    /// INIT -> RTR -> RTS towards `remote`, with `timing`.
    pub fn connect(&self, remote: &RcEndpoint, timing: RcTiming) -> Result<(), VerbsError> {
        use ffi::ibv_qp_attr_mask as M;
        let global = self.port.ethernet || remote.lid == 0;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: self.port.active_mtu.min(remote.mtu),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: timing.min_rnr_timer,
            ah_attr: ffi::ibv_ah_attr {
                grh: ffi::ibv_global_route {
                    dgid: ffi::ibv_gid { raw: remote.gid },
                    flow_label: 0,
                    sgid_index: self.port.gid_index,
                    hop_limit: if global { 64 } else { 0 },
                    traffic_class: 0,
                },
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                is_global: global as u8,
                port_num: self.port.port,
            },
            ..Default::default()
        };
        self.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_AV
                | M::IBV_QP_PATH_MTU
                | M::IBV_QP_DEST_QPN
                | M::IBV_QP_RQ_PSN
                | M::IBV_QP_MAX_DEST_RD_ATOMIC
                | M::IBV_QP_MIN_RNR_TIMER,
            "ibv_modify_qp(RTR)",
        )?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: timing.ack_timeout,
            retry_cnt: timing.retry_cnt,
            rnr_retry: timing.rnr_retry,
            sq_psn: self.psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            M::IBV_QP_STATE
                | M::IBV_QP_TIMEOUT
                | M::IBV_QP_RETRY_CNT
                | M::IBV_QP_RNR_RETRY
                | M::IBV_QP_SQ_PSN
                | M::IBV_QP_MAX_QP_RD_ATOMIC,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Moves the QP to the error state: outstanding work completes as flushed, so buffers can
    /// be reclaimed before the QP is destroyed.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            ffi::ibv_qp_attr_mask::IBV_QP_STATE,
            "ibv_modify_qp(ERR)",
        )
    }

    pub fn state(&self) -> Result<QpState, VerbsError> {
        let mut attr = ffi::ibv_qp_attr::default();
        let mut init = ffi::ibv_qp_init_attr::default();
        // SAFETY: valid QP and out pointers.
        let rc = unsafe {
            ffi::ibv_query_qp(
                self.qp,
                &mut attr,
                ffi::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        };
        self.ctx().check("ibv_query_qp", rc)?;
        use ffi::ibv_qp_state as S;
        Ok(match attr.qp_state {
            S::IBV_QPS_RESET => QpState::Reset,
            S::IBV_QPS_INIT => QpState::Init,
            S::IBV_QPS_RTR => QpState::Rtr,
            S::IBV_QPS_RTS => QpState::Rts,
            S::IBV_QPS_SQD => QpState::Sqd,
            S::IBV_QPS_SQE => QpState::Sqe,
            S::IBV_QPS_ERR => QpState::Error,
            other => QpState::Unknown(other),
        })
    }

    /// Posts one signaled SEND of the first `len` bytes of `region`'s slot `slot`
    /// (wr_id = `wr_id`). The slot must stay untouched until the send completes.
    pub fn post_send(
        &self,
        region: &MemoryRegion,
        slot: u32,
        len: u32,
        wr_id: u64,
    ) -> Result<(), VerbsError> {
        let (_, r) = self.post_sends(region, &[SendRequest { slot, len, wr_id }]);
        r
    }

    /// Posts `sends` as chains of signaled SENDs, in order, one call per [`POST_CHAIN_MAX`]
    /// (one doorbell on the HCA, one system call on soft-RoCE). Returns how many were posted, from the first:
    /// on an error the rest were not (their slots are the caller's again). Each slot must stay
    /// untouched until its send completes.
    pub fn post_sends(
        &self,
        region: &MemoryRegion,
        sends: &[SendRequest],
    ) -> (usize, Result<(), VerbsError>) {
        if sends.is_empty() {
            return (0, Ok(()));
        }
        if let Some(bad) = sends.iter().position(|s| {
            s.slot >= region.count || u64::from(s.len) > region.stride || s.wr_id >= SEND_WR_ID
        }) {
            let e = self.ctx().err(
                "post_send: slot or length out of the region, or a work request id past 2^63",
                io::Error::from(io::ErrorKind::InvalidInput),
            );
            let (posted, r) = self.post_sends(region, &sends[..bad]);
            return (posted, r.and(Err(e)));
        }
        let mut posted = 0;
        for chunk in sends.chunks(POST_CHAIN_MAX) {
            let (n, r) = self.post_chain(region, chunk);
            posted += n;
            if r.is_err() {
                return (posted, r);
            }
        }
        (posted, Ok(()))
    }

    /// One call of the provider's post_send for `sends` (at most [`POST_CHAIN_MAX`], checked
    /// against the region), the chain built on the stack.
    fn post_chain(
        &self,
        region: &MemoryRegion,
        sends: &[SendRequest],
    ) -> (usize, Result<(), VerbsError>) {
        debug_assert!(!sends.is_empty() && sends.len() <= POST_CHAIN_MAX);
        // Only the chain's own entries are written (most chains are one send: the other 63
        // stay untouched on the hot path); nothing reads past them.
        let mut sges = [const { std::mem::MaybeUninit::<ffi::ibv_sge>::uninit() }; POST_CHAIN_MAX];
        let mut wrs =
            [const { std::mem::MaybeUninit::<ffi::ibv_send_wr>::uninit() }; POST_CHAIN_MAX];
        let n = sends.len();
        // Written through these pointers only, so neither array is borrowed again before the
        // call; neither moves.
        let base = wrs.as_mut_ptr().cast::<ffi::ibv_send_wr>();
        let sge_base = sges.as_mut_ptr().cast::<ffi::ibv_sge>();
        for (k, s) in sends.iter().enumerate() {
            // SAFETY: k < n <= POST_CHAIN_MAX: within both arrays; k + 1 is written next turn.
            unsafe {
                let sge = sge_base.add(k);
                sge.write(region.sge(s.slot, s.len));
                base.add(k).write(ffi::ibv_send_wr {
                    wr_id: s.wr_id | SEND_WR_ID,
                    next: if k + 1 < n {
                        base.add(k + 1)
                    } else {
                        ptr::null_mut()
                    },
                    sg_list: sge,
                    num_sge: 1,
                    opcode: ffi::ibv_wr_opcode::IBV_WR_SEND,
                    send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
                    ..Default::default()
                });
            }
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: valid QP; the chain and its SGEs outlive the call; the region is registered
        // on this PD.
        let rc = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(f) => f(self.qp, base, &mut bad),
                None => libc::EOPNOTSUPP,
            }
        };
        if rc == 0 {
            return (n, Ok(()));
        }
        // The provider names the first request it did not take; without one, none went.
        let posted = if bad.is_null() {
            0
        } else {
            // SAFETY: `bad` points into the chain, at or after its base.
            (unsafe { bad.offset_from(base) } as usize).min(n)
        };
        (posted, self.ctx().check("post_send", rc))
    }
}

/// One SEND of [`RcQueuePair::post_sends`]: the first `len` bytes of a registered slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendRequest {
    pub slot: u32,
    pub len: u32,
    /// Below [`SEND_WR_ID`]: its completion gives it back as it was.
    pub wr_id: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::wr_id;

    /// A receive that failed has no opcode to trust (soft-RoCE leaves 0, `IBV_WC_SEND`): its
    /// id says receive, and names its ring and slot. A send, failed or not, gives back the id
    /// it was posted with.
    #[test]
    fn a_completion_is_a_send_or_a_receive_by_its_id_also_in_error() {
        use ffi::ibv_wc_status as st;
        let (len_err, flushed) = (Some(st::IBV_WC_LOC_LEN_ERR), Some(st::IBV_WC_WR_FLUSH_ERR));
        let c = Completion::from_id(wr_id(0, 309), 261, 0, len_err);
        assert!(c.recv);
        assert_eq!((c.wr_id, c.error), (309, len_err));
        let c = Completion::from_id(wr_id(5, 7), 261, 0, flushed);
        assert!(c.recv);
        assert_eq!(c.wr_id, wr_id(5, 7));
        let c = Completion::from_id(wr_id(0, 3), 261, 1000, None);
        assert_eq!((c.recv, c.wr_id, c.qp_num, c.bytes), (true, 3, 261, 1000));
        for error in [None, Some(st::IBV_WC_RETRY_EXC_ERR), flushed] {
            let c = Completion::from_id(SEND_WR_ID | 255, 261, 0, error);
            assert!(!c.recv);
            assert_eq!((c.wr_id, c.error), (255, error));
        }
    }

    #[test]
    fn rnr_timer_codes_in_microseconds() {
        assert_eq!(rnr_timer_us(0), 655_360);
        assert_eq!(rnr_timer_us(1), 10);
        assert_eq!(rnr_timer_us(12), 640);
        assert_eq!(rnr_timer_us(14), 1280);
        assert_eq!(rnr_timer_us(31), 491_520);
    }

    /// The chosen RNR timing: retried without end, at 0.64 ms (see [`RcTiming`]).
    #[test]
    fn a_busy_receiver_is_waited_for() {
        let t = RcTiming::default();
        assert_eq!((t.rnr_retry, rnr_timer_us(t.min_rnr_timer)), (7, 640));
        assert_eq!((t.ack_timeout, t.retry_cnt), (14, 7));
    }

    /// Every send slot on exactly one lane, in order, the lanes as even as can be.
    #[test]
    fn lanes_share_the_send_slots_out_evenly_in_order() {
        for (slots, lanes) in [(256, 1), (256, 2), (10, 3), (7, 7), (5, 4)] {
            let ranges: Vec<_> = (0..lanes).map(|l| lane_slots(slots, lanes, l)).collect();
            assert_eq!(ranges[0].start, 0, "{slots}/{lanes}: {ranges:?}");
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{slots}/{lanes}: {ranges:?}");
            }
            assert_eq!(ranges[ranges.len() - 1].end, slots, "{ranges:?}");
            let sizes: Vec<_> = ranges.iter().map(|r| r.len()).collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "{slots}/{lanes}: {sizes:?}");
            assert!(sizes.windows(2).all(|w| w[0] >= w[1]), "{sizes:?}");
        }
        assert_eq!(lane_slots(10, 3, 0), 0..4);
        assert_eq!(lane_slots(10, 3, 2), 7..10);
    }
}
