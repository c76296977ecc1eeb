//! What the engine reads of an IP packet's header: where it goes, and which flow it is of.

use std::net::IpAddr;

/// An IP packet's flow within its connection: its source address, protocol and ports (none
/// for a fragment after the first, nor past IPv6 extension headers), hashed.
pub(super) fn flow_key(pkt: &[u8]) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
    let (src, proto, l4) = match pkt.first().map(|b| b >> 4) {
        Some(4) => {
            let ihl = usize::from(pkt[0] & 0x0f) * 4;
            let later_fragment = pkt
                .get(6..8)
                .is_some_and(|f| u16::from_be_bytes([f[0], f[1]]) & 0x1fff != 0);
            let l4 = if later_fragment { None } else { pkt.get(ihl..) };
            (pkt.get(12..16), pkt.get(9), l4)
        }
        Some(6) => (pkt.get(8..24), pkt.get(6), pkt.get(40..)),
        _ => (None, None, None),
    };
    let ports = match proto {
        Some(6 | 17 | 132) => l4.and_then(|l| l.get(..4)),
        _ => None,
    };
    BuildHasherDefault::<DefaultHasher>::default().hash_one((src, proto, ports))
}

/// The destination address of an IP packet.
pub(super) fn destination(pkt: &[u8]) -> Option<IpAddr> {
    match pkt.first()? >> 4 {
        4 => {
            let a: [u8; 4] = pkt.get(16..20)?.try_into().ok()?;
            Some(IpAddr::from(a))
        }
        6 => {
            let a: [u8; 16] = pkt.get(24..40)?.try_into().ok()?;
            Some(IpAddr::from(a))
        }
        _ => None,
    }
}
