//! The only module that touches verbs.
//!
//! Discovery goes through ibverbs-sys (the bindings the ibverbs crate itself
//! uses): the crate's safe `Context` queries port 1 only and refuses to open a device whose
//! port is not active, while discovery must see every device and port as it is.
//!
//! One object a file: the device ([`device`]), the PD and memory regions, the SRQ, CQs, RC
//! QPs, where receives land ([`receive`]) and what a node's connections share
//! ([`resources`]). Each object holds an `Arc` of what it was made from, so the drop order
//! the HCA needs (QP before CQ, SRQ and PD; MR before PD; everything before the context)
//! follows from ownership, and objects can move between threads and tasks.
//!
//! libibverbs objects are thread-safe (rdma-core locks inside the provider), hence the
//! `Send`/`Sync` impls. Several calls that verbs.h defines as static inline functions
//! (ibv_post_send, ibv_post_srq_recv, ibv_poll_cq, ibv_req_notify_cq) have no symbol to
//! bind: they dispatch through the context's ops table, as libibverbs itself does.

use std::{ffi::CStr, io};

use ibverbs_sys as ffi;
use serde::Serialize;

use crate::plan::HcaLimits;

mod cq;
mod device;
mod memory;
mod qp;
mod rdmacm;
mod receive;
mod resources;
mod srq;
pub use cq::*;
pub use device::*;
pub use memory::*;
pub use qp::*;
pub use rdmacm::{PathError, resolve_path};
pub use receive::*;
pub use resources::*;
pub use srq::*;

#[derive(Debug, thiserror::Error)]
pub enum VerbsError {
    #[error("no RDMA devices: this kernel has no RDMA support (libibverbs: {0})")]
    NoKernelSupport(io::Error),
    #[error(
        "no RDMA devices found (is an RDMA driver loaded? e.g. `modprobe rdma_rxe` and `rdma link add`)"
    )]
    NoDevices,
    #[error("all {max} receive rings are in use (the memory plan's cap)")]
    RingsExhausted { max: u32 },
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
    /// The subnet manager's LID (0 on RoCE, and where no SM has swept the port).
    pub sm_lid: u16,
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
        out.push(device_caps(&ctx)?);
    }
    Ok(out)
}

fn device_caps(ctx: &Device) -> Result<DeviceCaps, VerbsError> {
    let attr = ctx.query_device()?;
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
    let ports = (1..=attr.phys_port_cnt)
        .map(|port| port_caps(ctx, port))
        .collect::<Result<_, _>>()?;
    let n = |v: i32| v.max(0) as u64;
    Ok(DeviceCaps {
        name: ctx.name().to_string(),
        fw_ver,
        node_guid,
        max_qp: n(attr.max_qp),
        max_qp_wr: n(attr.max_qp_wr),
        max_sge: n(attr.max_sge),
        max_cqe: n(attr.max_cqe),
        max_srq: n(attr.max_srq),
        max_srq_wr: n(attr.max_srq_wr),
        max_srq_sge: n(attr.max_srq_sge),
        ports,
    })
}

fn port_caps(ctx: &Device, port: u8) -> Result<PortCaps, VerbsError> {
    let pa = ctx.port_attr(port)?;
    // An entry that cannot be read is left out of the list, not an error: the list informs.
    let gids = (0..pa.gid_tbl_len.max(0))
        .filter_map(|idx| ctx.gid(port, idx).ok())
        .filter(|raw| *raw != [0; 16])
        .map(|raw| gid_string(&raw))
        .collect();
    Ok(PortCaps {
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
        sm_lid: pa.sm_lid,
        gid_table_len: pa.gid_tbl_len.max(0) as u32,
        gids,
    })
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
