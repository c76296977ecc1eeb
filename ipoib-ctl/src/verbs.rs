//! The only module that touches verbs.
//!
//! Discovery goes through ibverbs-sys (the bindings the ibverbs crate itself
//! uses): the crate's safe `Context` queries port 1 only and refuses to open a device whose
//! port is not active, while discovery must see every device and port as it is.

use std::{ffi::CStr, io, ptr};

use ibverbs_sys as ffi;
use serde::Serialize;

use crate::plan::HcaLimits;

#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    #[error("no RDMA devices: this kernel has no RDMA support (libibverbs: {0})")]
    NoKernelSupport(io::Error),
    #[error(
        "no RDMA devices found (is an RDMA driver loaded? e.g. `modprobe rdma_rxe` and `rdma link add`)"
    )]
    NoDevices,
    #[error("{device}: {what} failed: {source}")]
    Query {
        device: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PortCaps {
    pub port: u8,
    /// "active", "down", "init", "armed", ...
    pub state: String,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    pub max_mtu: u32,
    /// "InfiniBand" or "Ethernet".
    pub link_layer: String,
    pub lid: u16,
    pub gid_table_len: u32,
    /// Non-zero GIDs, as `fe80:0000:...` strings like ibv_devinfo prints them.
    pub gids: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceCaps {
    pub name: String,
    pub fw_ver: String,
    /// Node GUID as ibv_devinfo prints it (`xxxx:xxxx:xxxx:xxxx`).
    pub node_guid: String,
    pub max_qp: u64,
    pub max_qp_wr: u64,
    pub max_sge: u64,
    pub max_cqe: u64,
    pub max_srq: u64,
    pub max_srq_wr: u64,
    pub max_srq_sge: u64,
    pub ports: Vec<PortCaps>,
}

impl DeviceCaps {
    pub fn srq(&self) -> bool {
        self.max_srq > 0
    }

    pub fn limits(&self) -> HcaLimits {
        HcaLimits {
            max_qp: self.max_qp,
            max_qp_wr: self.max_qp_wr,
            max_cqe: self.max_cqe,
            max_srq: self.max_srq,
            max_srq_wr: self.max_srq_wr,
            max_srq_sge: self.max_srq_sge,
        }
    }
}

fn mtu_bytes(m: ffi::ibv_mtu) -> u32 {
    match m {
        1..=5 => 128 << m,
        _ => 0,
    }
}

fn port_state(s: ffi::ibv_port_state::Type) -> String {
    match s {
        0 => "nop",
        1 => "down",
        2 => "init",
        3 => "armed",
        4 => "active",
        5 => "active_defer",
        _ => "unknown",
    }
    .to_string()
}

fn gid_string(raw: &[u8; 16]) -> String {
    raw.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// The device list, freed on drop (after every context opened from it is closed).
struct DeviceList(*mut *mut ffi::ibv_device, usize);

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: returned by ibv_get_device_list, freed once.
        unsafe { ffi::ibv_free_device_list(self.0) };
    }
}

impl DeviceList {
    /// The kernel's RDMA devices; a kernel without RDMA support is an error.
    fn get() -> Result<Self, VerbsError> {
        let mut n = 0;
        // SAFETY: n is a valid out pointer.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(VerbsError::NoKernelSupport(io::Error::last_os_error()));
        }
        Ok(Self(list, n.max(0) as usize))
    }

    /// Each device with its name.
    fn iter(&self) -> impl Iterator<Item = (*mut ffi::ibv_device, String)> + '_ {
        (0..self.1).map(|i| {
            // SAFETY: i < n entries of the list.
            let dev = unsafe { *self.0.add(i) };
            // SAFETY: a device of the list; the name is a NUL-terminated string it owns.
            let name = unsafe { CStr::from_ptr(ffi::ibv_get_device_name(dev)) }
                .to_string_lossy()
                .into_owned();
            (dev, name)
        })
    }
}

/// Every RDMA device and port, with what the memory plan and connection setup need.
pub fn discover() -> Result<Vec<DeviceCaps>, VerbsError> {
    let list = DeviceList::get()?;
    if list.1 == 0 {
        return Err(VerbsError::NoDevices);
    }
    let mut out = Vec::with_capacity(list.1);
    for (dev, name) in list.iter() {
        let ctx = Device::open_raw(dev, name)?;
        let name = ctx.name.clone();
        let q = |what, source| ctx.err(what, source);
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: valid context and out pointer.
        let rc = unsafe { ffi::ibv_query_device(ctx.ctx, &mut attr) };
        if rc != 0 {
            return Err(q("ibv_query_device", io::Error::from_raw_os_error(rc)));
        }
        // SAFETY: fw_ver is a NUL-terminated char array.
        let fw_ver = unsafe { CStr::from_ptr(attr.fw_ver.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let guid = u64::from_be(attr.node_guid).to_be_bytes();
        let node_guid = guid
            .chunks(2)
            .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
            .collect::<Vec<_>>()
            .join(":");
        let mut ports = Vec::new();
        for port in 1..=attr.phys_port_cnt {
            let mut pa = ffi::ibv_port_attr::default();
            // SAFETY: valid context; the compat symbol takes the full struct, as ibverbs does.
            let rc = unsafe { ffi::ibv_query_port(ctx.ctx, port, ptr::addr_of_mut!(pa).cast()) };
            if rc != 0 {
                return Err(q("ibv_query_port", io::Error::from_raw_os_error(rc)));
            }
            let mut gids = Vec::new();
            for idx in 0..pa.gid_tbl_len.max(0) {
                let mut gid = ffi::ibv_gid { raw: [0; 16] };
                // SAFETY: valid context, index within the table, out pointer.
                if unsafe { ffi::ibv_query_gid(ctx.ctx, port, idx, &mut gid) } != 0 {
                    continue;
                }
                // SAFETY: raw is the union's plain-bytes view.
                let raw = unsafe { gid.raw };
                if raw != [0; 16] {
                    gids.push(gid_string(&raw));
                }
            }
            ports.push(PortCaps {
                port,
                state: port_state(pa.state),
                active_mtu: mtu_bytes(pa.active_mtu),
                max_mtu: mtu_bytes(pa.max_mtu),
                link_layer: match pa.link_layer as u32 {
                    1 => "InfiniBand".into(),
                    2 => "Ethernet".into(),
                    0 => "InfiniBand".into(), // IBV_LINK_LAYER_UNSPECIFIED: IB by convention
                    other => format!("unknown({other})"),
                },
                lid: pa.lid,
                gid_table_len: pa.gid_tbl_len.max(0) as u32,
                gids,
            });
        }
        out.push(DeviceCaps {
            name,
            fw_ver,
            node_guid,
            max_qp: attr.max_qp.max(0) as u64,
            max_qp_wr: attr.max_qp_wr.max(0) as u64,
            max_sge: attr.max_sge.max(0) as u64,
            max_cqe: attr.max_cqe.max(0) as u64,
            max_srq: attr.max_srq.max(0) as u64,
            max_srq_wr: attr.max_srq_wr.max(0) as u64,
            max_srq_sge: attr.max_srq_sge.max(0) as u64,
            ports,
        });
        drop(ctx);
    }
    Ok(out)
}

/// Total system memory in bytes (MemTotal), for the budget rule.
pub fn system_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a kernel without RDMA (this host), discovery says so instead of returning nothing.
    #[test]
    fn no_rdma_is_an_error_not_an_empty_list() {
        match discover() {
            Ok(devs) => assert!(!devs.is_empty(), "an empty device list must be an error"),
            Err(VerbsError::NoKernelSupport(_) | VerbsError::NoDevices) => {}
            Err(e) => panic!("unexpected: {e}"),
        }
    }

    #[test]
    fn formats() {
        assert_eq!(mtu_bytes(3), 1024);
        assert_eq!(mtu_bytes(5), 4096);
        let mut g = [0u8; 16];
        g[0] = 0xfe;
        g[1] = 0x80;
        g[15] = 1;
        assert_eq!(gid_string(&g), "fe80:0000:0000:0000:0000:0000:0000:0001");
    }
}

/// An open device context.
pub struct Device {
    ctx: *mut ffi::ibv_context,
    pub name: String,
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device, closed once, after everything made from it (the
        // borrows of PD and SRQ end first).
        unsafe { ffi::ibv_close_device(self.ctx) };
    }
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

    fn open_raw(dev: *mut ffi::ibv_device, name: String) -> Result<Self, VerbsError> {
        // SAFETY: a device of a live device list.
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(VerbsError::Query {
                device: name,
                what: "ibv_open_device",
                source: io::Error::last_os_error(),
            });
        }
        Ok(Self { ctx, name })
    }

    fn err(&self, what: &'static str, source: io::Error) -> VerbsError {
        VerbsError::Query {
            device: self.name.clone(),
            what,
            source,
        }
    }

    pub fn alloc_pd(&self) -> Result<ProtectionDomain<'_>, VerbsError> {
        // SAFETY: valid context.
        let pd = unsafe { ffi::ibv_alloc_pd(self.ctx) };
        if pd.is_null() {
            return Err(self.err("ibv_alloc_pd", io::Error::last_os_error()));
        }
        Ok(ProtectionDomain { pd, dev: self })
    }
}

pub struct ProtectionDomain<'d> {
    pd: *mut ffi::ibv_pd,
    dev: &'d Device,
}

impl Drop for ProtectionDomain<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; every MR and SRQ of it borrowed it and is gone.
        unsafe { ffi::ibv_dealloc_pd(self.pd) };
    }
}

/// Page-aligned memory for receive buffers.
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

/// A shared receive queue with its buffers registered once and every one of them posted.
/// Dropped in order: SRQ, then the memory region, then the memory.
pub struct SharedReceiveQueue<'p> {
    srq: *mut ffi::ibv_srq,
    mr: *mut ffi::ibv_mr,
    buffers: Buffers,
    pub depth: u32,
    pub buffer_bytes: u32,
    /// Bytes between buffers (whole pages).
    pub stride: u64,
    pub posted: u32,
    _pd: &'p ProtectionDomain<'p>,
}

impl Drop for SharedReceiveQueue<'_> {
    fn drop(&mut self) {
        // SAFETY: created here, destroyed once, SRQ before the MR its receives point into.
        unsafe {
            ffi::ibv_destroy_srq(self.srq);
            ffi::ibv_dereg_mr(self.mr);
        }
    }
}

/// What the HCA reports for an SRQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

impl<'p> SharedReceiveQueue<'p> {
    /// An SRQ of `depth` receives of `buffer_bytes` each, `stride` apart in one registered
    /// region (one SGE per receive: the region is contiguous). The limit event is armed at a
    /// quarter of the depth, for refilling before starvation.
    pub fn create(
        pd: &'p ProtectionDomain<'p>,
        depth: u32,
        buffer_bytes: u32,
        stride: u64,
    ) -> Result<Self, VerbsError> {
        let dev = pd.dev;
        let invalid = |what| dev.err(what, io::Error::from(io::ErrorKind::InvalidInput));
        if depth == 0 || buffer_bytes == 0 || stride < buffer_bytes as u64 {
            return Err(invalid("SRQ sizing"));
        }
        let len = (depth as u64 * stride) as usize;
        let layout =
            std::alloc::Layout::from_size_align(len, 4096).map_err(|_| invalid("buffer layout"))?;
        // SAFETY: non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(dev.err(
                "allocating receive buffers",
                io::Error::from(io::ErrorKind::OutOfMemory),
            ));
        }
        let buffers = Buffers { ptr, layout };
        // SAFETY: the region is valid for len bytes and lives as long as the MR (dropped after).
        let mr = unsafe {
            ffi::ibv_reg_mr(
                pd.pd,
                buffers.ptr.cast(),
                len,
                ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
            )
        };
        if mr.is_null() {
            return Err(dev.err("ibv_reg_mr", io::Error::last_os_error()));
        }
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
            let e = io::Error::last_os_error();
            // SAFETY: registered above, not used by anything.
            unsafe { ffi::ibv_dereg_mr(mr) };
            return Err(dev.err("ibv_create_srq", e));
        }
        let mut q = Self {
            srq,
            mr,
            buffers,
            depth,
            buffer_bytes,
            stride,
            posted: 0,
            _pd: pd,
        };
        q.post(0..depth)?;
        q.arm_limit(depth / 4)?;
        Ok(q)
    }

    /// Posts the receive buffers `slots` (each slot's wr_id is its index).
    pub fn post(&mut self, slots: std::ops::Range<u32>) -> Result<(), VerbsError> {
        // SAFETY: the MR is valid; lkey is plain data.
        let lkey = unsafe { (*self.mr).lkey };
        const BATCH: u32 = 256;
        let mut start = slots.start;
        while start < slots.end {
            let end = (start + BATCH).min(slots.end);
            let mut sges: Vec<ffi::ibv_sge> = (start..end)
                .map(|i| ffi::ibv_sge {
                    addr: self.buffers.ptr as u64 + i as u64 * self.stride,
                    length: self.buffer_bytes,
                    lkey,
                })
                .collect();
            let mut wrs: Vec<ffi::ibv_recv_wr> = (start..end)
                .map(|i| ffi::ibv_recv_wr {
                    wr_id: i as u64,
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
            let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
            // ibv_post_srq_recv is a static inline in verbs.h: dispatch through the context's
            // ops table, as libibverbs itself does.
            // SAFETY: the SRQ's context is valid; wrs and sges outlive the call.
            let rc = unsafe {
                let ctx = (*self.srq).context;
                match (*ctx).ops.post_srq_recv {
                    Some(f) => f(self.srq, wrs.as_mut_ptr(), &mut bad),
                    None => libc::EOPNOTSUPP,
                }
            };
            if rc != 0 {
                return Err(self
                    ._pd
                    .dev
                    .err("post_srq_recv", io::Error::from_raw_os_error(rc)));
            }
            self.posted += end - start;
            start = end;
        }
        Ok(())
    }

    /// Arms the SRQ limit event: the HCA raises it when fewer than `limit` receives remain.
    pub fn arm_limit(&mut self, limit: u32) -> Result<(), VerbsError> {
        let mut attr = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: limit,
        };
        // SAFETY: valid SRQ; IBV_SRQ_LIMIT only.
        let rc = unsafe { ffi::ibv_modify_srq(self.srq, &mut attr, ffi::IBV_SRQ_LIMIT as i32) };
        if rc != 0 {
            return Err(self
                ._pd
                .dev
                .err("ibv_modify_srq", io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    pub fn query(&self) -> Result<SrqAttr, VerbsError> {
        let mut attr = ffi::ibv_srq_attr {
            max_wr: 0,
            max_sge: 0,
            srq_limit: 0,
        };
        // SAFETY: valid SRQ and out pointer.
        let rc = unsafe { ffi::ibv_query_srq(self.srq, &mut attr) };
        if rc != 0 {
            return Err(self
                ._pd
                .dev
                .err("ibv_query_srq", io::Error::from_raw_os_error(rc)));
        }
        Ok(SrqAttr {
            max_wr: attr.max_wr,
            max_sge: attr.max_sge,
            srq_limit: attr.srq_limit,
        })
    }
}
