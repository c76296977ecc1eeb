//! A device: its context, discovery of its ports, its asynchronous events.

use std::{io, os::fd::RawFd, ptr, sync::Arc, time::Duration};

use ibverbs_sys as ffi;

use super::{DeviceList, ProtectionDomain, RcEndpoint, VerbsError, wait_readable};
use crate::path::{LinkLayer, PortEvent, PortState};

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
    pub(super) fn check(&self, what: &'static str, rc: i32) -> Result<(), VerbsError> {
        match rc {
            0 => Ok(()),
            rc => Err(self.err(what, io::Error::from_raw_os_error(rc.abs()))),
        }
    }
}

/// An open RDMA device.
#[derive(Clone)]
pub struct Device {
    pub(super) ctx: Arc<Context>,
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
    /// Something about a port changed (its state, its LID, its subnet manager, its P_Key or
    /// GID tables): what, and the port's number.
    Port(PortEvent, u8),
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

    /// The port's attributes: one ibv_query_port, which each question below asks once.
    pub(super) fn port_attr(&self, port: u8) -> Result<ffi::ibv_port_attr, VerbsError> {
        let mut pa = ffi::ibv_port_attr::default();
        // SAFETY: valid context; the compat symbol takes the full struct, as ibverbs does.
        let rc = unsafe { ffi::ibv_query_port(self.ctx.ctx, port, ptr::addr_of_mut!(pa).cast()) };
        self.ctx.check("ibv_query_port", rc)?;
        Ok(pa)
    }

    /// The GID at `index` of the port's table (all zero where none is set).
    pub(super) fn gid(&self, port: u8, index: i32) -> Result<[u8; 16], VerbsError> {
        let mut gid = ffi::ibv_gid { raw: [0; 16] };
        // SAFETY: valid context and out pointer.
        let rc = unsafe { ffi::ibv_query_gid(self.ctx.ctx, port, index, &mut gid) };
        self.ctx.check("ibv_query_gid", rc)?;
        // SAFETY: raw is the union's plain-bytes view.
        Ok(unsafe { gid.raw })
    }

    /// A port's address from its attributes and one GID of it.
    fn address(
        &self,
        port: u8,
        pa: &ffi::ibv_port_attr,
        (gid, gid_index): ([u8; 16], u8),
    ) -> Result<PortAddress, VerbsError> {
        Ok(PortAddress {
            port,
            state: PortState::from_raw(pa.state),
            lid: pa.lid,
            gid,
            gid_index,
            active_mtu: pa.active_mtu,
            link_layer: link_layer(pa.link_layer),
            pkey_index: 0,
            ca_ack_delay: self.query_device()?.local_ca_ack_delay,
        })
    }

    /// The first GID of the port's table that is set, and its index (on RoCE the GIDs follow
    /// the netdev's IP addresses, so index 0 may be empty).
    fn first_gid(
        &self,
        port: u8,
        pa: &ffi::ibv_port_attr,
    ) -> Result<Option<([u8; 16], u8)>, VerbsError> {
        // GID indexes are a u8 in the address vector; a table longer than 256 is cut there.
        for index in 0..pa.gid_tbl_len.clamp(0, 256) {
            let gid = self.gid(port, index)?;
            if gid != [0; 16] {
                return Ok(Some((gid, index as u8)));
            }
        }
        Ok(None)
    }

    /// This port's address as a connection needs it: LID, active MTU and the GID at
    /// `gid_index`.
    pub fn port_address(&self, port: u8, gid_index: u8) -> Result<PortAddress, VerbsError> {
        let pa = self.port_attr(port)?;
        let gid = self.gid(port, i32::from(gid_index))?;
        self.address(port, &pa, (gid, gid_index))
    }

    /// The port as connected mode's readiness needs it: its state, and its first GID that is
    /// set ([`Device::first_address`]) or a zero GID where none is (RoCE with no address).
    pub fn port_now(&self, port: u8) -> Result<PortAddress, VerbsError> {
        let pa = self.port_attr(port)?;
        let gid = self.first_gid(port, &pa)?.unwrap_or(([0; 16], 0));
        self.address(port, &pa, gid)
    }

    /// How many physical ports the device has.
    pub fn port_count(&self) -> Result<u8, VerbsError> {
        Ok(self.query_device()?.phys_port_cnt)
    }

    pub(super) fn query_device(&self) -> Result<ffi::ibv_device_attr, VerbsError> {
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: valid context and out pointer.
        let rc = unsafe { ffi::ibv_query_device(self.ctx.ctx, &mut attr) };
        self.ctx.check("ibv_query_device", rc)?;
        Ok(attr)
    }

    /// The port's P_Key table, in host order (ibv_query_pkey answers in network order).
    pub fn pkey_table(&self, port: u8) -> Result<Vec<u16>, VerbsError> {
        let pa = self.port_attr(port)?;
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
        let pa = self.port_attr(port)?;
        match self.first_gid(port, &pa)? {
            Some(gid) => self.address(port, &pa, gid),
            None => Err(self.err(NO_GID, io::Error::from(io::ErrorKind::AddrNotAvailable))),
        }
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
                other => match port_event(other) {
                    Some(p) => AsyncEvent::Port(p, ev.element.port_num as u8),
                    None => AsyncEvent::Other(other),
                },
            }
        };
        // SAFETY: the event returned above, acknowledged once.
        unsafe { ffi::ibv_ack_async_event(&mut ev) };
        Ok(Some(kind))
    }
}

const NO_GID: &str = "port has no GID";

fn link_layer(raw: u8) -> LinkLayer {
    if u32::from(raw) == ffi::IBV_LINK_LAYER_ETHERNET {
        LinkLayer::Ethernet
    } else {
        // IBV_LINK_LAYER_UNSPECIFIED is InfiniBand: providers older than RoCE report it.
        LinkLayer::InfiniBand
    }
}

/// A port event from verbs' event type.
fn port_event(event_type: u32) -> Option<PortEvent> {
    Some(match event_type {
        ffi::IBV_EVENT_PORT_ACTIVE => PortEvent::Active,
        ffi::IBV_EVENT_PORT_ERR => PortEvent::Error,
        ffi::IBV_EVENT_LID_CHANGE => PortEvent::LidChange,
        ffi::IBV_EVENT_PKEY_CHANGE => PortEvent::PkeyChange,
        ffi::IBV_EVENT_SM_CHANGE => PortEvent::SmChange,
        ffi::IBV_EVENT_CLIENT_REREGISTER => PortEvent::ClientReregister,
        ffi::IBV_EVENT_GID_CHANGE => PortEvent::GidChange,
        _ => return None,
    })
}

/// Where a port is, for the far end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAddress {
    pub port: u8,
    /// When it was queried.
    pub state: PortState,
    pub lid: u16,
    pub gid: [u8; 16],
    pub gid_index: u8,
    /// ibv_mtu enum (1 = 256 .. 5 = 4096).
    pub active_mtu: u32,
    pub link_layer: LinkLayer,
    /// The HCA's local ACK delay (IB encoding), for the ACK timeout a path record derives.
    pub ca_ack_delay: u8,
    /// Where the partition's P_Key sits in the port's table: local, for this side's QPs
    /// (0, the default partition, unless [`Resources::create_lanes`] was given another).
    pub pkey_index: u16,
}

impl PortAddress {
    /// Where it is, for a path.
    pub fn endpoint(&self) -> crate::path::Endpoint {
        crate::path::Endpoint {
            link_layer: self.link_layer,
            lid: self.lid,
            gid: self.gid,
            mtu: self.active_mtu,
        }
    }

    /// The address vector from it to `remote`, with `record` where the subnet gave one
    /// ([`crate::path::address_vector`]).
    pub fn path_to(
        &self,
        remote: &RcEndpoint,
        record: Option<&crate::path::PathRecord>,
    ) -> Result<crate::path::AddressVector, crate::path::NoPath> {
        crate::path::address_vector(&self.endpoint(), &remote.at(), record, self.ca_ack_delay)
    }

    /// Whether connected mode may run on it ([`crate::path::port_ready`]).
    pub fn ready(&self) -> Result<(), crate::path::PortNotReady> {
        crate::path::port_ready(self.state, &self.endpoint())
    }
}
