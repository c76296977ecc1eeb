//! `hop-mmap`'s packet ring: an AF_PACKET socket's TPACKET_V2 receive ring, and whether the
//! kernel lets its mapping be registered.

use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::atomic::AtomicU32,
};

use ipoib_ctl::tun::VNET_HDR_LEN;
use serde_json::json;

/// The device `hop-mmap` sends through in each namespace.
pub(crate) const RING_DEV: &str = "hopd";

/// Frames of a `hop-mmap` packet ring: packets taken and not yet written.
pub(crate) const RING_FRAMES: usize = 256;

/// One ring frame, in whole pages: the ring's header, the vnet and Ethernet headers, and a
/// 64 KiB packet (a GSO super-packet at most).
pub(crate) const RING_FRAME: usize =
    (libc::TPACKET2_HDRLEN + 16 + VNET_HDR_LEN + 65536 + 4095) & !4095;

/// An AF_PACKET socket on one device with a TPACKET_V2 receive ring of [`RING_FRAMES`]
/// frames mapped into this process, each taking one outgoing packet with its vnet header.
pub(crate) struct PacketRing {
    pub(crate) fd: OwnedFd,
    map: *mut u8,
}

// SAFETY: the mapping is only reached through `&self` by the one thread that relays from it.
unsafe impl Send for PacketRing {}

impl PacketRing {
    /// Opens the ring on `dev` of the calling thread's network namespace.
    pub(crate) fn open(dev: &str) -> std::io::Result<Self> {
        let err = std::io::Error::last_os_error;
        let all = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket call; the fd is owned at once.
        let raw = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                all.into(),
            )
        };
        if raw < 0 {
            return Err(err());
        }
        // SAFETY: fresh and ours.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let set = |opt: libc::c_int, val: *const libc::c_void, len: usize| {
            // SAFETY: val points at len readable bytes.
            let rc = unsafe {
                libc::setsockopt(raw, libc::SOL_PACKET, opt, val, len as libc::socklen_t)
            };
            if rc < 0 {
                let e = err();
                Err(std::io::Error::new(
                    e.kind(),
                    format!("SOL_PACKET option {opt}: {e}"),
                ))
            } else {
                Ok(())
            }
        };
        let (v2, on) = (
            libc::tpacket_versions::TPACKET_V2 as libc::c_int,
            1 as libc::c_int,
        );
        set(libc::PACKET_VERSION, (&raw const v2).cast(), 4)?;
        // The vnet header keeps a GSO super-packet whole, as TUN reads give it.
        set(libc::PACKET_VNET_HDR, (&raw const on).cast(), 4)?;
        let req = libc::tpacket_req {
            tp_block_size: RING_FRAME as u32,
            tp_block_nr: RING_FRAMES as u32,
            tp_frame_size: RING_FRAME as u32,
            tp_frame_nr: RING_FRAMES as u32,
        };
        let req_ptr = (&raw const req).cast::<libc::c_void>();
        set(
            libc::PACKET_RX_RING,
            req_ptr,
            size_of::<libc::tpacket_req>(),
        )?;
        // SAFETY: maps the ring just made on this socket.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                RING_FRAME * RING_FRAMES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                raw,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(err());
        }
        let ring = Self {
            fd,
            map: map.cast(),
        };
        let name = std::ffi::CString::new(dev).map_err(std::io::Error::other)?;
        // SAFETY: a valid C string.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            return Err(err());
        }
        // SAFETY: sockaddr_ll is plain old data; zero is valid.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_protocol = all;
        addr.sll_ifindex = ifindex as i32;
        // SAFETY: binds to a valid sockaddr_ll of its size.
        let rc = unsafe {
            libc::bind(
                raw,
                (&raw const addr).cast(),
                size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(err());
        }
        Ok(ring)
    }

    /// The socket's pending error (which `poll` keeps reporting until it is read).
    pub(crate) fn take_error(&self) -> std::io::Error {
        let mut e: libc::c_int = 0;
        let mut len = size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: SO_ERROR writes one int.
        unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&raw mut e).cast(),
                &mut len,
            )
        };
        std::io::Error::from_raw_os_error(e)
    }

    /// Packets dropped for want of a free frame since the last call.
    pub(crate) fn drops(&self) -> std::io::Result<u64> {
        /// `struct tpacket_stats` and its socket option (not in the libc crate).
        #[repr(C)]
        struct TpacketStats {
            packets: u32,
            drops: u32,
        }
        const PACKET_STATISTICS: libc::c_int = 6;
        let mut st = TpacketStats {
            packets: 0,
            drops: 0,
        };
        let mut len = size_of::<TpacketStats>() as libc::socklen_t;
        // SAFETY: PACKET_STATISTICS writes at most len bytes into st (and resets them).
        let rc = unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_PACKET,
                PACKET_STATISTICS,
                (&raw mut st).cast(),
                &mut len,
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(st.drops.into())
    }

    /// Frame `i`'s header.
    pub(crate) fn header(&self, i: usize) -> *mut libc::tpacket2_hdr {
        // SAFETY: i < RING_FRAMES, inside the mapping.
        unsafe { self.map.add(i * RING_FRAME).cast() }
    }

    /// Frame `i`'s status word, shared with the kernel.
    pub(crate) fn status(&self, i: usize) -> &AtomicU32 {
        // SAFETY: tp_status is the header's first field, an aligned u32 the kernel also
        // reads and writes.
        unsafe { AtomicU32::from_ptr(self.header(i).cast()) }
    }
}

impl Drop for PacketRing {
    fn drop(&mut self) {
        // SAFETY: the mapping made in open, unmapped once.
        unsafe { libc::munmap(self.map.cast(), RING_FRAME * RING_FRAMES) };
    }
}

/// Whether a packet ring's mapping can be registered with io_uring (as fixed buffers) and
/// with verbs (as a memory region on the first RDMA device, read-only and writable): "ok",
/// or the error.
pub(crate) fn ring_registration() -> serde_json::Value {
    let ring = match PacketRing::open("lo") {
        Ok(r) => r,
        Err(e) => return json!({ "ring": e.to_string() }),
    };
    let len = RING_FRAME * RING_FRAMES;
    let outcome = |r: std::io::Result<()>| r.map_or_else(|e| e.to_string(), |()| "ok".into());
    let uring = io_uring::IoUring::new(4).and_then(|ring_| {
        let iov = libc::iovec {
            iov_base: ring.map.cast(),
            iov_len: len,
        };
        // SAFETY: the mapping outlives the io_uring, which is dropped at once.
        unsafe { ring_.submitter().register_buffers(&[iov]) }
    });
    json!({
        "io_uring_fixed_buffers": outcome(uring),
        "verbs_mr_read": verbs_register(ring.map, len, 0),
        "verbs_mr_write": verbs_register(
            ring.map,
            len,
            ibverbs_sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
        ),
    })
}

/// Registers `len` bytes at `addr` with `access` as a memory region on the first RDMA device,
/// then lets it go: "ok on DEVICE", the error, or "no RDMA device".
pub(crate) fn verbs_register(addr: *mut u8, len: usize, access: i32) -> String {
    use ibverbs_sys as v;
    let err = || std::io::Error::last_os_error().to_string();
    let mut n = 0;
    // SAFETY: plain verbs calls; each object made is let go before return, in reverse.
    unsafe {
        let list = v::ibv_get_device_list(&mut n);
        if list.is_null() || n == 0 {
            if !list.is_null() {
                v::ibv_free_device_list(list);
            }
            return "no RDMA device".into();
        }
        let dev = *list;
        let name = std::ffi::CStr::from_ptr(v::ibv_get_device_name(dev))
            .to_string_lossy()
            .into_owned();
        let ctx = v::ibv_open_device(dev);
        v::ibv_free_device_list(list);
        if ctx.is_null() {
            return format!("ibv_open_device {name}: {}", err());
        }
        let pd = v::ibv_alloc_pd(ctx);
        let out = if pd.is_null() {
            format!("ibv_alloc_pd {name}: {}", err())
        } else {
            let mr = v::ibv_reg_mr(pd, addr.cast(), len, access);
            let out = if mr.is_null() {
                format!("ibv_reg_mr on {name}: {}", err())
            } else {
                v::ibv_dereg_mr(mr);
                format!("ok on {name}")
            };
            v::ibv_dealloc_pd(pd);
            out
        };
        v::ibv_close_device(ctx);
        out
    }
}
