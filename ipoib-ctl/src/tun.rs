//! The CM engine's TUN device: where `ipoib_egress` redirects the packets chosen for CM, and
//! where packets received over RC connections are handed to the stack.
//!
//! Opened with IFF_TUN | IFF_NO_PI | IFF_VNET_HDR and the checksum and TSO offloads on, so a
//! TCP GSO super-packet (up to 64 KiB) arrives whole with a 10-byte virtio-net header in front
//! ([`VnetHdr`]) and can be written back whole on the receiving side: one RC message per
//! super-packet, no segmentation in userspace.

use std::{
    ffi::CString,
    fs::File,
    io::{self, Read as _, Write as _},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd},
};

/// Bytes of `struct virtio_net_hdr` (no mergeable buffers), the TUN's vnet header size.
pub const VNET_HDR_LEN: usize = 10;
/// The largest packet a TUN read returns with TSO on (64 KiB GSO plus headers), plus the header.
pub const TUN_READ_MAX: usize = 65536 + VNET_HDR_LEN;

/// `virtio_net_hdr` flags and GSO types (linux/virtio_net.h).
pub const VNET_F_NEEDS_CSUM: u8 = 1;
pub const VNET_F_DATA_VALID: u8 = 2;
pub const VNET_GSO_NONE: u8 = 0;
pub const VNET_GSO_TCPV4: u8 = 1;
pub const VNET_GSO_UDP: u8 = 3;
pub const VNET_GSO_TCPV6: u8 = 4;
pub const VNET_GSO_ECN: u8 = 0x80;

#[derive(Debug, thiserror::Error)]
pub enum TunError {
    #[error("`{0}` is not a valid interface name")]
    BadName(String),
    #[error("opening /dev/net/tun: {0} (load the tun module: modprobe tun; and run as root)")]
    Open(#[source] io::Error),
    #[error("{what} on {name}: {source}")]
    Ioctl {
        what: &'static str,
        name: String,
        #[source]
        source: io::Error,
    },
}

/// The virtio-net header in front of every packet (little-endian, as TUN uses on x86 and
/// every little-endian host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VnetHdr {
    pub flags: u8,
    pub gso_type: u8,
    /// Bytes of headers (L2..L4) in a GSO packet.
    pub hdr_len: u16,
    /// Payload bytes per segment (the MSS) of a GSO packet.
    pub gso_size: u16,
    /// With NEEDS_CSUM: where checksumming starts, and where (after it) the sum goes.
    pub csum_start: u16,
    pub csum_offset: u16,
}

impl VnetHdr {
    pub fn parse(b: &[u8]) -> Option<Self> {
        let b: &[u8; VNET_HDR_LEN] = b.get(..VNET_HDR_LEN)?.try_into().ok()?;
        let u = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        Some(Self {
            flags: b[0],
            gso_type: b[1],
            hdr_len: u(2),
            gso_size: u(4),
            csum_start: u(6),
            csum_offset: u(8),
        })
    }

    pub fn encode(&self) -> [u8; VNET_HDR_LEN] {
        let mut b = [0u8; VNET_HDR_LEN];
        b[0] = self.flags;
        b[1] = self.gso_type;
        b[2..4].copy_from_slice(&self.hdr_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.gso_size.to_le_bytes());
        b[6..8].copy_from_slice(&self.csum_start.to_le_bytes());
        b[8..10].copy_from_slice(&self.csum_offset.to_le_bytes());
        b
    }

    /// A GSO super-packet (to be segmented by whoever transmits it on a small-MTU link).
    pub fn is_gso(&self) -> bool {
        self.gso_type & !VNET_GSO_ECN != VNET_GSO_NONE
    }
}

/// A TUN device owned by this process: removed when dropped (it is not persistent).
pub struct Tun {
    file: File,
    name: String,
}

impl Tun {
    /// Creates TUN device `name` (a `%d` in it is numbered by the kernel) in the calling
    /// thread's network namespace, with vnet headers and the checksum and TSO offloads on.
    /// The device is left down; the fd is non-blocking when `nonblocking`.
    pub fn create(name: &str, nonblocking: bool) -> Result<Self, TunError> {
        Self::open_queue(name, nonblocking, 0)
    }

    /// Creates TUN device `name` with `queues` queues (IFF_MULTI_QUEUE), one fd each, as
    /// [`Tun::create`] makes one: the kernel spreads the packets it transmits over the queues
    /// by flow, and a packet written into any queue is received by the stack alike. One
    /// queue is a plain device, as `create` makes.
    pub fn create_queues(
        name: &str,
        queues: usize,
        nonblocking: bool,
    ) -> Result<Vec<Self>, TunError> {
        if queues <= 1 {
            return Ok(vec![Self::create(name, nonblocking)?]);
        }
        let first = Self::open_queue(name, nonblocking, libc::IFF_MULTI_QUEUE)?;
        let name = first.name.clone();
        let mut all = vec![first];
        for _ in 1..queues {
            all.push(Self::open_queue(&name, nonblocking, libc::IFF_MULTI_QUEUE)?);
        }
        Ok(all)
    }

    /// Opens one queue of device `name` (creating it if it does not exist) with `extra` flags.
    fn open_queue(name: &str, nonblocking: bool, extra: libc::c_int) -> Result<Self, TunError> {
        let bytes = name.as_bytes();
        if bytes.is_empty() || bytes.len() >= libc::IFNAMSIZ || bytes.contains(&0) {
            return Err(TunError::BadName(name.to_string()));
        }
        let path = CString::new("/dev/net/tun").expect("no NUL");
        let mut oflags = libc::O_RDWR | libc::O_CLOEXEC;
        if nonblocking {
            oflags |= libc::O_NONBLOCK;
        }
        // SAFETY: a valid C string; the fd is owned at once.
        let fd = unsafe { libc::open(path.as_ptr(), oflags) };
        if fd < 0 {
            return Err(TunError::Open(io::Error::last_os_error()));
        }
        // SAFETY: fd is fresh and ours.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        // SAFETY: ifreq is plain old data; zero is valid.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        req.ifr_ifru.ifru_flags =
            (libc::IFF_TUN | libc::IFF_NO_PI | libc::IFF_VNET_HDR | extra) as i16;
        let ioctl_err = |what, name: &str| TunError::Ioctl {
            what,
            name: name.to_string(),
            source: io::Error::last_os_error(),
        };
        // SAFETY: TUNSETIFF reads and writes a valid ifreq.
        if unsafe { libc::ioctl(fd, libc::TUNSETIFF, &mut req) } < 0 {
            return Err(ioctl_err("TUNSETIFF", name));
        }
        let name: String = req
            .ifr_name
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8 as char)
            .collect();
        let hdr = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int.
        if unsafe { libc::ioctl(fd, libc::TUNSETVNETHDRSZ, &hdr) } < 0 {
            return Err(ioctl_err("TUNSETVNETHDRSZ", &name));
        }
        let offload = libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6 | libc::TUN_F_TSO_ECN;
        // SAFETY: TUNSETOFFLOAD takes the flags as its argument value.
        if unsafe { libc::ioctl(fd, libc::TUNSETOFFLOAD, offload as libc::c_ulong) } < 0 {
            return Err(ioctl_err("TUNSETOFFLOAD", &name));
        }
        Ok(Self { file, name })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// One packet with its vnet header into `buf` (at least [`TUN_READ_MAX`] bytes).
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// One packet, as `recv`, into `bufs` in turn (readv): the packet's length, which is
    /// more than the first buffer holds only when it spilled into the next.
    pub fn recv_vectored(&self, bufs: &mut [io::IoSliceMut<'_>]) -> io::Result<usize> {
        (&self.file).read_vectored(bufs)
    }

    /// One packet with its vnet header, handed to the stack as received on this device.
    pub fn send(&self, pkt: &[u8]) -> io::Result<usize> {
        (&self.file).write(pkt)
    }
}

impl AsFd for Tun {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

impl AsRawFd for Tun {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vnet_header_round_trips_little_endian() {
        let h = VnetHdr {
            flags: VNET_F_NEEDS_CSUM,
            gso_type: VNET_GSO_TCPV4 | VNET_GSO_ECN,
            hdr_len: 66,
            gso_size: 1448,
            csum_start: 34,
            csum_offset: 16,
        };
        let b = h.encode();
        assert_eq!(b, [1, 0x81, 66, 0, 0xa8, 0x05, 34, 0, 16, 0]);
        assert_eq!(VnetHdr::parse(&b), Some(h));
        assert!(h.is_gso());
        assert!(!VnetHdr::default().is_gso());
        assert_eq!(VnetHdr::parse(&b[..9]), None);
    }

    #[test]
    fn bad_names_are_refused_before_any_syscall() {
        for n in ["", "a-name-far-too-long", "nul\0"] {
            assert!(
                matches!(Tun::create(n, true), Err(TunError::BadName(_))),
                "{n:?}"
            );
        }
    }
}
