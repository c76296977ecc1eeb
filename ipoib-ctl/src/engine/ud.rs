//! The UD path's way in for the packets an engine read and cannot send over a connection (its
//! queue past the bound, the connection gone or failed): raw IP sockets bound to the
//! interface, whose packets carry [`UD_MARK`] so that the fast path lets them through to UD.
//! A packet is then lost only where UD cannot carry it either: a GSO super-packet (TCP sends
//! it again), one longer than the interface's MTU, one that is no IP packet, one the socket
//! refuses (its buffer full), or an IPv6 packet where the node has no IPv6 raw socket.

use std::{
    io,
    net::{IpAddr, SocketAddr},
};

use ipoib_common::UD_MARK;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::tun::{VNET_F_NEEDS_CSUM, VNET_HDR_LEN, VnetHdr};

/// Why a packet did not go UD.
#[derive(Debug, PartialEq, Eq)]
pub enum NotUd {
    /// A GSO super-packet: only a device that segments could send it.
    Gso,
    /// No IP packet, or its checksum's place lies outside it.
    Malformed,
    /// The socket refused it (too long for the MTU, its buffer full, no route).
    Refused(io::ErrorKind),
    /// An IPv6 packet, and the node has no IPv6 raw socket.
    NoSocket,
}

/// Raw IPv4 and IPv6 sockets out of one interface, non-blocking, their packets marked.
pub struct UdOut {
    v4: Socket,
    /// None where the node has no IPv6 (its IPv6 packets are then not sent).
    v6: Option<Socket>,
}

/// A send buffer for a burst: a dead connection's queue (128 packets of up to 4 KiB on IPoIB)
/// let go at once.
const SNDBUF: libc::c_int = 4 << 20;

impl UdOut {
    /// Sockets out of `iface`. Needs CAP_NET_RAW and CAP_NET_ADMIN (the mark, the buffer).
    pub fn new(iface: &str) -> io::Result<Self> {
        let open = |domain| -> io::Result<Socket> {
            // IPPROTO_RAW: the IP header is the packet's own, on IPv4 and IPv6 alike.
            let s = Socket::new(domain, Type::RAW, Some(Protocol::from(libc::IPPROTO_RAW)))?;
            s.set_mark(UD_MARK)?;
            s.bind_device(Some(iface.as_bytes()))?;
            s.set_nonblocking(true)?;
            // Past net.core.wmem_max: SO_SNDBUFFORCE (CAP_NET_ADMIN).
            let size = SNDBUF;
            // SAFETY: a plain setsockopt on an fd this owns, with an int's size.
            let r = unsafe {
                libc::setsockopt(
                    std::os::fd::AsRawFd::as_raw_fd(&s),
                    libc::SOL_SOCKET,
                    libc::SO_SNDBUFFORCE,
                    (&raw const size).cast(),
                    size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r != 0 {
                let e = io::Error::last_os_error();
                tracing::debug!("{iface}: the raw socket's send buffer stays the default: {e}");
            }
            Ok(s)
        };
        let v4 = open(Domain::IPV4)?;
        let v6 = open(Domain::IPV6)
            .inspect_err(|e| tracing::info!("{iface}: no IPv6 raw socket to UD: {e}"))
            .ok();
        Ok(Self { v4, v6 })
    }

    /// Sends `msg` (a TUN read: virtio-net header, then the IP packet) over UD, its
    /// transport checksum completed first where the header says it is partial.
    pub fn send(&self, msg: &mut [u8]) -> Result<(), NotUd> {
        let dst = prepare(msg)?;
        let sock = if dst.is_ipv4() {
            &self.v4
        } else {
            self.v6.as_ref().ok_or(NotUd::NoSocket)?
        };
        sock.send_to(
            &msg[VNET_HDR_LEN..],
            &SockAddr::from(SocketAddr::new(dst, 0)),
        )
        .map(|_| ())
        .map_err(|e| NotUd::Refused(e.kind()))
    }
}

/// What UD needs of a TUN read: no GSO, an IP destination, and the checksum a device would
/// have finished (NEEDS_CSUM), finished here; the destination.
pub fn prepare(msg: &mut [u8]) -> Result<IpAddr, NotUd> {
    let hdr = VnetHdr::parse(msg).ok_or(NotUd::Malformed)?;
    if hdr.is_gso() {
        return Err(NotUd::Gso);
    }
    let pkt = &mut msg[VNET_HDR_LEN..];
    let dst = super::packet::destination(pkt).ok_or(NotUd::Malformed)?;
    if hdr.flags & VNET_F_NEEDS_CSUM != 0 {
        finish_checksum(pkt, hdr.csum_start.into(), hdr.csum_offset.into())
            .ok_or(NotUd::Malformed)?;
    }
    Ok(dst)
}

/// The Internet checksum over `pkt[start..]`, stored at `start + offset`, where the field
/// holds the pseudo-header's sum (as the kernel leaves it for a device that checksums):
/// what `skb_checksum_help` does. None where the field lies outside the packet.
pub fn finish_checksum(pkt: &mut [u8], start: usize, offset: usize) -> Option<()> {
    let at = start.checked_add(offset)?;
    if at + 2 > pkt.len() {
        return None;
    }
    let mut sum: u32 = 0;
    let mut words = pkt[start..].chunks_exact(2);
    for w in &mut words {
        sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = words.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    // Zero is sent as all ones: UDP reads a zero as "no checksum"; to TCP both are zero.
    let folded = match !(sum as u16) {
        0 => 0xffff,
        c => c,
    };
    pkt[at..at + 2].copy_from_slice(&folded.to_be_bytes());
    Some(())
}

#[cfg(test)]
mod tests;
