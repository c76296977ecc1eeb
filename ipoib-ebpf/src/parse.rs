//! Bounds-checked parsing of IPoIB and Ethernet frames, shared by both programs.
//!
//! Every read goes through [`ptr_at`], which the verifier sees as a packet-bounds check.
//!
//! Hand-written rather than on network-types' header structs: IPoIB's framing (a 20-byte
//! pseudo address and a 4-byte header) is not among them, and the IP fields read here are a
//! handful at fixed offsets, each through the same bounds check.

use core::mem::size_of;

use ipoib_common::{
    ARPHRD_ETHER, ARPHRD_INFINIBAND, ETH_HLEN, ETH_P_ARP, ETH_P_IP, ETH_P_IPV6, FAMILY_IPV4,
    FAMILY_IPV6, ICMPV6_ND_FIRST, ICMPV6_ND_LAST, IPOIB_FLAG_RC, IPOIB_GID_OFFSET, IPOIB_HARD_LEN,
    IPOIB_HWADDR_LEN, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, PeerKey, Reason,
};

/// The deepest byte any parse reads: IPoIB header, IPv4 with the longest options, TCP.
pub const PARSE_MAX: usize = IPOIB_HARD_LEN + 60 + 20;

/// Why a frame could not be parsed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    /// The policy names a link type this program does not know.
    UnknownLink,
    /// Truncated, or a header field that cannot be (IP version, IHL, TCP data offset).
    Malformed,
}

/// What the decisions need to know about one frame.
pub struct Frame {
    /// Bytes before the IP header.
    pub l2_len: usize,
    /// The destination address' flags byte (IPoIB framing; 0 on Ethernet).
    pub flags: u8,
    /// The destination advertises connected mode (flags has `IPOIB_FLAG_RC`, IPoIB only).
    pub rc_flag: bool,
    /// Multicast or broadcast, at L2 or at L3.
    pub multicast: bool,
    pub ethertype: u16,
    /// An IP packet, of `family` ([`FAMILY_IPV4`] or [`FAMILY_IPV6`]), whose destination
    /// and source addresses lie at `dst_at` and `src_at` in the frame. Offsets, not keys: a
    /// program builds the one key it needs with [`key_at`]. (Two 20-byte keys carried through
    /// the parse's branches were compiled into a spill and a reload per byte, more
    /// instructions than the rest of the parse.)
    pub ip: bool,
    pub family: u8,
    pub dst_at: usize,
    pub src_at: usize,
    /// ICMPv6 Neighbor Discovery (RFC 4755: must go over UD).
    pub neighbor_discovery: bool,
    /// TCP to or from the CM handshake port.
    pub control: bool,
}

impl Frame {
    /// Sent to one peer (the address at `dst_at`): unicast IP.
    #[inline(always)]
    pub fn unicast(&self) -> bool {
        self.ip && !self.multicast
    }

    /// The reason for a frame that is not IP.
    #[inline(always)]
    pub fn non_ip_reason(&self) -> Reason {
        if self.ethertype == ETH_P_ARP {
            Reason::TxUdArp
        } else {
            Reason::TxUdNonIp
        }
    }
}

/// A pointer to a `T` at `offset`, or `None` when it does not lie wholly inside the packet.
#[inline(always)]
fn ptr_at<T>(data: usize, data_end: usize, offset: usize) -> Result<*const T, ParseError> {
    if data + offset + size_of::<T>() > data_end {
        return Err(ParseError::Malformed);
    }
    Ok((data + offset) as *const T)
}

/// The peer key of the `family` address at `at` in the frame (see [`Frame::ip`]); all zeros
/// where there is none. The parse has checked the bounds; `ptr_at` checks them again for the
/// verifier, which does not carry them across the program. Built of words
/// ([`PeerKey::of_words`]), with one way out so that every word stays a scalar: a key returned
/// whole from a branch (all zeros, say) was zeroed by a call to `memset` again.
#[inline(always)]
pub fn key_at(data: usize, data_end: usize, family: u8, at: usize) -> PeerKey {
    let mut w = [0u32; 4];
    let mut found = 0;
    match family {
        FAMILY_IPV4 => {
            if let Ok(a) = ptr_at::<[u8; 4]>(data, data_end, at) {
                // SAFETY: bounds checked by ptr_at.
                w[0] = u32::from_ne_bytes(unsafe { *a });
                found = family;
            }
        }
        FAMILY_IPV6 => {
            if let Ok(a) = ptr_at::<[[u8; 4]; 4]>(data, data_end, at) {
                // SAFETY: bounds checked by ptr_at.
                let a = unsafe { &*a };
                w = [
                    u32::from_ne_bytes(a[0]),
                    u32::from_ne_bytes(a[1]),
                    u32::from_ne_bytes(a[2]),
                    u32::from_ne_bytes(a[3]),
                ];
                found = family;
            }
        }
        _ => {}
    }
    PeerKey::of_words(w, found)
}

#[inline(always)]
fn be16(b: [u8; 2]) -> u16 {
    u16::from_be_bytes(b)
}

/// Parses the frame between `data` and `data_end` as `link_type` framing.
/// `ctl_port` (0: none) marks TCP to or from the handshake port.
#[inline(always)]
pub fn parse(
    data: usize,
    data_end: usize,
    link_type: u16,
    ctl_port: u16,
) -> Result<Frame, ParseError> {
    let mut f = Frame {
        l2_len: 0,
        flags: 0,
        rc_flag: false,
        multicast: false,
        ethertype: 0,
        ip: false,
        family: 0,
        dst_at: 0,
        src_at: 0,
        neighbor_discovery: false,
        control: false,
    };
    match link_type {
        ARPHRD_INFINIBAND => {
            let h: *const [u8; IPOIB_HARD_LEN] = ptr_at(data, data_end, 0)?;
            // SAFETY: bounds checked by ptr_at.
            let h = unsafe { &*h };
            f.l2_len = IPOIB_HARD_LEN;
            f.flags = h[0];
            f.rc_flag = h[0] & IPOIB_FLAG_RC != 0;
            f.multicast = h[IPOIB_GID_OFFSET] == 0xff;
            f.ethertype = be16([h[IPOIB_HWADDR_LEN], h[IPOIB_HWADDR_LEN + 1]]);
        }
        ARPHRD_ETHER => {
            let h: *const [u8; ETH_HLEN] = ptr_at(data, data_end, 0)?;
            // SAFETY: bounds checked by ptr_at.
            let h = unsafe { &*h };
            f.l2_len = ETH_HLEN;
            f.multicast = h[0] & 1 != 0;
            f.ethertype = be16([h[12], h[13]]);
        }
        _ => return Err(ParseError::UnknownLink),
    }
    let l2 = f.l2_len;
    let (proto, l4) = match f.ethertype {
        ETH_P_IP => {
            let ip: *const [u8; 20] = ptr_at(data, data_end, l2)?;
            // SAFETY: bounds checked by ptr_at.
            let ip = unsafe { &*ip };
            if ip[0] >> 4 != 4 {
                return Err(ParseError::Malformed);
            }
            let ihl = ((ip[0] & 0x0f) as usize) * 4;
            if ihl < 20 {
                return Err(ParseError::Malformed);
            }
            f.ip = true;
            f.family = FAMILY_IPV4;
            f.dst_at = l2 + 16;
            f.src_at = l2 + 12;
            let dst = [ip[16], ip[17], ip[18], ip[19]];
            if dst[0] & 0xf0 == 0xe0 || dst == [0xff; 4] {
                f.multicast = true;
            }
            // A fragment has no whole L4 header to read: later ones carry none, and the first
            // may be cut inside it (a frame that is still its sender's, not malformed).
            if be16([ip[6], ip[7]]) & 0x3fff != 0 {
                return Ok(f);
            }
            (ip[9], l2 + ihl)
        }
        ETH_P_IPV6 => {
            let ip: *const [u8; 40] = ptr_at(data, data_end, l2)?;
            // SAFETY: bounds checked by ptr_at.
            let ip = unsafe { &*ip };
            if ip[0] >> 4 != 6 {
                return Err(ParseError::Malformed);
            }
            f.multicast |= ip[24] == 0xff;
            f.ip = true;
            f.family = FAMILY_IPV6;
            f.dst_at = l2 + 24;
            f.src_at = l2 + 8;
            (ip[6], l2 + 40)
        }
        _ => return Ok(f),
    };
    match proto {
        IPPROTO_TCP => {
            let tcp: *const [u8; 20] = ptr_at(data, data_end, l4)?;
            // SAFETY: bounds checked by ptr_at.
            let tcp = unsafe { &*tcp };
            if tcp[12] >> 4 < 5 {
                return Err(ParseError::Malformed);
            }
            let sport = be16([tcp[0], tcp[1]]);
            let dport = be16([tcp[2], tcp[3]]);
            f.control = ctl_port != 0 && (sport == ctl_port || dport == ctl_port);
        }
        IPPROTO_UDP => {
            let _udp: *const [u8; 8] = ptr_at(data, data_end, l4)?;
        }
        IPPROTO_ICMPV6 if f.ethertype == ETH_P_IPV6 => {
            let icmp: *const [u8; 4] = ptr_at(data, data_end, l4)?;
            // SAFETY: bounds checked by ptr_at.
            let ty = unsafe { (*icmp)[0] };
            f.neighbor_discovery = (ICMPV6_ND_FIRST..=ICMPV6_ND_LAST).contains(&ty);
        }
        _ => {}
    }
    Ok(f)
}
