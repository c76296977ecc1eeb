//! The protection domain and registered memory.

use std::{io, sync::Arc};

use ibverbs_sys as ffi;

use super::{Context, VerbsError};

pub struct ProtectionDomain {
    pub(super) pd: *mut ffi::ibv_pd,
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
    pub(super) pd: Arc<ProtectionDomain>,
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

    pub(super) fn sge(&self, slot: u32, len: u32) -> ffi::ibv_sge {
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
