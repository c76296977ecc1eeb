//! A path record for a peer's IP address, as librdmacm resolves it: `rdma_resolve_addr` then
//! `rdma_resolve_route` on an id of its own. On InfiniBand that asks the subnet administrator
//! (as the kernel's IPoIB asks it for its address handles); on RoCE librdmacm fills the route
//! itself. Blocking (each step bounded by its timeout): callers on tokio run it with
//! `spawn_blocking`.
//!
//! librdmacm is opened at run time (`librdmacm.so.1`): a node without it runs connected mode
//! with no path records rather than not at all. Its structures are mirrored here up to the
//! fields read, as rdma_cma.h and sa.h lay them out (a layout test pins the offsets gcc gives
//! for those headers on x86_64).

use std::{
    ffi::{c_int, c_void},
    io,
    net::{IpAddr, SocketAddr},
    ptr,
    sync::OnceLock,
    time::Duration,
};

use crate::path::PathRecord;

/// Why no path record was had.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("librdmacm is not loaded ({0}): no path records")]
    NoLibrary(String),
    #[error("{what}: {source}")]
    Call {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{what}: got event {got} (status {status})")]
    Event {
        what: &'static str,
        got: u32,
        status: i32,
    },
    #[error("{0}: no answer within the timeout")]
    Timeout(&'static str),
    #[error("the route holds no path record")]
    NoPath,
}

// rdma_cma.h's event types used here.
const ADDR_RESOLVED: u32 = 0;
const ROUTE_RESOLVED: u32 = 2;
/// RDMA_PS_TCP: the port space of a connected id.
const PS_TCP: c_int = 0x0106;

#[repr(C)]
struct EventChannel {
    fd: c_int,
}

/// `struct ibv_sa_path_rec` (sa.h).
#[repr(C)]
struct SaPathRec {
    dgid: [u8; 16],
    sgid: [u8; 16],
    dlid: u16,
    slid: u16,
    raw_traffic: c_int,
    flow_label: u32,
    hop_limit: u8,
    traffic_class: u8,
    reversible: c_int,
    numb_path: u8,
    pkey: u16,
    sl: u8,
    mtu_selector: u8,
    mtu: u8,
    rate_selector: u8,
    rate: u8,
    packet_life_time_selector: u8,
    packet_life_time: u8,
    preference: u8,
}

/// `struct rdma_cm_id` (rdma_cma.h) up to its route's path records.
#[repr(C)]
struct CmId {
    verbs: *mut c_void,
    channel: *mut EventChannel,
    context: *mut c_void,
    qp: *mut c_void,
    /// `struct rdma_addr`: two `sockaddr_storage` and `struct rdma_ib_addr` (two GIDs, a
    /// P_Key), 8-aligned.
    addr: [u64; 37],
    path_rec: *mut SaPathRec,
    num_paths: c_int,
}

/// `struct rdma_cm_event` (rdma_cma.h) up to its status.
#[repr(C)]
struct CmEvent {
    id: *mut CmId,
    listen_id: *mut CmId,
    event: u32,
    status: c_int,
}

/// The functions used, from `librdmacm.so.1`.
struct Lib {
    create_event_channel: unsafe extern "C" fn() -> *mut EventChannel,
    destroy_event_channel: unsafe extern "C" fn(*mut EventChannel),
    create_id: unsafe extern "C" fn(*mut EventChannel, *mut *mut CmId, *mut c_void, c_int) -> c_int,
    destroy_id: unsafe extern "C" fn(*mut CmId) -> c_int,
    resolve_addr: unsafe extern "C" fn(*mut CmId, *const c_void, *const c_void, c_int) -> c_int,
    resolve_route: unsafe extern "C" fn(*mut CmId, c_int) -> c_int,
    get_cm_event: unsafe extern "C" fn(*mut EventChannel, *mut *mut CmEvent) -> c_int,
    ack_cm_event: unsafe extern "C" fn(*mut CmEvent) -> c_int,
    /// Kept open for the process's life: the functions above point into it.
    _lib: libloading::Library,
}

fn lib() -> Result<&'static Lib, PathError> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(|| load().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| PathError::NoLibrary(e.clone()))
}

fn load() -> Result<Lib, libloading::Error> {
    // SAFETY: librdmacm's initialisers have no preconditions; each symbol is taken with the
    // signature rdma_cma.h gives it.
    unsafe {
        let lib = libloading::Library::new("librdmacm.so.1")?;
        Ok(Lib {
            create_event_channel: *lib.get(b"rdma_create_event_channel\0")?,
            destroy_event_channel: *lib.get(b"rdma_destroy_event_channel\0")?,
            create_id: *lib.get(b"rdma_create_id\0")?,
            destroy_id: *lib.get(b"rdma_destroy_id\0")?,
            resolve_addr: *lib.get(b"rdma_resolve_addr\0")?,
            resolve_route: *lib.get(b"rdma_resolve_route\0")?,
            get_cm_event: *lib.get(b"rdma_get_cm_event\0")?,
            ack_cm_event: *lib.get(b"rdma_ack_cm_event\0")?,
            _lib: lib,
        })
    }
}

/// An id on a channel of its own, both destroyed when dropped (the id first).
struct Resolver {
    lib: &'static Lib,
    channel: *mut EventChannel,
    id: *mut CmId,
}

impl Drop for Resolver {
    fn drop(&mut self) {
        // SAFETY: made in `new`, destroyed once, the id before its channel.
        unsafe {
            if !self.id.is_null() {
                (self.lib.destroy_id)(self.id);
            }
            (self.lib.destroy_event_channel)(self.channel);
        }
    }
}

fn last_os(what: &'static str) -> PathError {
    PathError::Call {
        what,
        source: io::Error::last_os_error(),
    }
}

impl Resolver {
    fn new() -> Result<Self, PathError> {
        let lib = lib()?;
        // SAFETY: no arguments; null on failure.
        let channel = unsafe { (lib.create_event_channel)() };
        if channel.is_null() {
            return Err(last_os("rdma_create_event_channel"));
        }
        let mut r = Self {
            lib,
            channel,
            id: ptr::null_mut(),
        };
        // SAFETY: a live channel and an out pointer.
        if unsafe { (lib.create_id)(channel, &mut r.id, ptr::null_mut(), PS_TCP) } != 0 {
            return Err(last_os("rdma_create_id"));
        }
        Ok(r)
    }

    /// The next event on the channel, which must be `want`, within `timeout`.
    fn expect(&self, what: &'static str, want: u32, timeout: Duration) -> Result<(), PathError> {
        // SAFETY: a live channel; fd is plain data.
        let fd = unsafe { (*self.channel).fd };
        match super::wait_readable(fd, timeout) {
            Ok(true) => {}
            Ok(false) => return Err(PathError::Timeout(what)),
            Err(source) => return Err(PathError::Call { what, source }),
        }
        let mut ev: *mut CmEvent = ptr::null_mut();
        // SAFETY: a live channel, readable; an out pointer.
        if unsafe { (self.lib.get_cm_event)(self.channel, &mut ev) } != 0 {
            return Err(last_os("rdma_get_cm_event"));
        }
        // SAFETY: the event just taken, acknowledged once, after its fields are read.
        let (got, status) = unsafe { ((*ev).event, (*ev).status) };
        unsafe { (self.lib.ack_cm_event)(ev) };
        if got == want && status == 0 {
            Ok(())
        } else {
            Err(PathError::Event { what, got, status })
        }
    }
}

/// A sockaddr for `ip` (port 0) as librdmacm takes it.
fn sockaddr(ip: IpAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain data, all zeroes valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match SocketAddr::new(ip, 0) {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as u16,
                sin_port: 0,
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: a sockaddr_in fits in a sockaddr_storage.
            unsafe { ptr::write(ptr::addr_of_mut!(ss).cast(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as u16,
                sin6_port: 0,
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: a sockaddr_in6 fits in a sockaddr_storage.
            unsafe { ptr::write(ptr::addr_of_mut!(ss).cast(), sin6) };
        }
    }
    ss
}

/// The path record to `dst` (an address of the peer's IPoIB interface), each of the two
/// resolutions bounded by `timeout`. Blocking.
pub fn resolve_path(dst: IpAddr, timeout: Duration) -> Result<PathRecord, PathError> {
    let r = Resolver::new()?;
    let ms = c_int::try_from(timeout.as_millis()).unwrap_or(c_int::MAX);
    let dst = sockaddr(dst);
    // SAFETY: a live id; the address outlives the call (librdmacm copies it).
    if unsafe { (r.lib.resolve_addr)(r.id, ptr::null(), ptr::addr_of!(dst).cast(), ms) } != 0 {
        return Err(last_os("rdma_resolve_addr"));
    }
    // A margin over librdmacm's own timeout, which ends in an error event.
    let wait = timeout + Duration::from_millis(500);
    r.expect("rdma_resolve_addr", ADDR_RESOLVED, wait)?;
    // SAFETY: a live id whose address is resolved.
    if unsafe { (r.lib.resolve_route)(r.id, ms) } != 0 {
        return Err(last_os("rdma_resolve_route"));
    }
    r.expect("rdma_resolve_route", ROUTE_RESOLVED, wait)?;
    // SAFETY: the id's route, resolved: num_paths records at path_rec, owned by the id.
    let rec = unsafe {
        if (*r.id).num_paths < 1 || (*r.id).path_rec.is_null() {
            return Err(PathError::NoPath);
        }
        &*(*r.id).path_rec
    };
    Ok(PathRecord {
        dlid: u16::from_be(rec.dlid),
        sl: rec.sl,
        mtu: u32::from(rec.mtu),
        rate: rec.rate,
        packet_life_time: rec.packet_life_time,
        hop_limit: rec.hop_limit,
        traffic_class: rec.traffic_class,
        flow_label: u32::from_be(rec.flow_label),
    })
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;

    /// The offsets gcc gives for rdma_cma.h and sa.h (rdma-core 55, x86_64): printed with
    /// `offsetof` from the headers ibverbs-sys builds.
    #[test]
    fn the_mirrored_structures_have_the_headers_layout() {
        assert_eq!(offset_of!(CmId, addr), 32);
        assert_eq!(offset_of!(CmId, path_rec), 328);
        assert_eq!(offset_of!(CmId, num_paths), 336);
        assert_eq!(size_of::<SaPathRec>(), 64);
        assert_eq!(offset_of!(SaPathRec, dlid), 32);
        assert_eq!(offset_of!(SaPathRec, flow_label), 40);
        assert_eq!(offset_of!(SaPathRec, hop_limit), 44);
        assert_eq!(offset_of!(SaPathRec, traffic_class), 45);
        assert_eq!(offset_of!(SaPathRec, sl), 56);
        assert_eq!(offset_of!(SaPathRec, mtu), 58);
        assert_eq!(offset_of!(SaPathRec, rate), 60);
        assert_eq!(offset_of!(SaPathRec, packet_life_time), 62);
        assert_eq!(offset_of!(CmEvent, event), 16);
        assert_eq!(offset_of!(CmEvent, status), 20);
    }

    #[test]
    fn sockaddrs_carry_the_family_and_the_address() {
        let v4 = sockaddr("10.78.0.1".parse().unwrap());
        assert_eq!(v4.ss_family, libc::AF_INET as u16);
        // SAFETY: written as a sockaddr_in.
        let sin: libc::sockaddr_in = unsafe { ptr::read(ptr::addr_of!(v4).cast()) };
        assert_eq!(sin.sin_addr.s_addr.to_ne_bytes(), [10, 78, 0, 1]);
        let v6 = sockaddr("fd00::2".parse().unwrap());
        assert_eq!(v6.ss_family, libc::AF_INET6 as u16);
        // SAFETY: written as a sockaddr_in6.
        let sin6: libc::sockaddr_in6 = unsafe { ptr::read(ptr::addr_of!(v6).cast()) };
        assert_eq!(sin6.sin6_addr.s6_addr[15], 2);
    }
}
