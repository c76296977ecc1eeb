//! Completion queues with their channel, and the completions they give.

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

use super::{Context, Device, POLL_MAX, VerbsError, wait_readable};

/// The bit [`RcQueuePair::post_sends`] sets in every send's work request id, and
/// [`CompletionQueue::poll`] takes off again: what tells a send's completion from a receive's.
/// The completion's opcode cannot: it is undefined when the status is an error (soft-RoCE
/// leaves it 0, `IBV_WC_SEND`, on a receive that failed). A caller's send ids stay below it;
/// receive ids ([`super::receive::wr_id`]) never reach it.
pub const SEND_WR_ID: u64 = 1 << 63;

/// Beside [`SEND_WR_ID`], a drain marker's ([`RcQueuePair::post_drain`]): this bit and the
/// QP's number.
pub const DRAIN_WR_ID: u64 = 1 << 62;

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
    pub(super) fn from_id(id: u64, qp_num: u32, bytes: u32, error: Option<u32>) -> Self {
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
    pub(super) cq: *mut ffi::ibv_cq,
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
