//! The shared receive queue, and posting receives to it.

use std::{
    io, ptr,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
};

use ibverbs_sys as ffi;

use super::{Context, MemoryRegion, ProtectionDomain, VerbsError, wr_id};

/// Sends one provider call takes at most in [`RcQueuePair::post_sends`] (its chain is built
/// on the stack; longer lists go in several calls).
pub const POST_CHAIN_MAX: usize = 64;

/// Completions one [`CompletionQueue::poll`] takes at most (on the stack).
pub const POLL_MAX: usize = 64;

/// Posts receives of `region`'s `slots` (`len` bytes each, work request ids of `ring`) in
/// chains of `chain`, each through `post` (the SRQ's or the QP's post call: it gets the
/// chain's first request and returns its rc); `posted` counts what went.
pub(super) fn post_receives(
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
    pub(super) srq: *mut ffi::ibv_srq,
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
