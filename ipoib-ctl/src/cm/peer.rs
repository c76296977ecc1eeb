//! A peer's IPoIB hardware address (GID and UD QPN), found from its IP address: what a
//! setup needs to reach the peer's handshake and to check the REP against.

use std::net::IpAddr;

use super::HwAddr;
use crate::rtnl::Rtnl;

/// How a peer's IPoIB hardware address (GID and UD QPN) is found from its IP address.
#[derive(Debug, Clone)]
pub enum Resolve {
    /// IPoIB: the neighbour table of this interface (the 20-byte link-layer address).
    Neighbour { ifindex: u32 },
    /// The lab (Ethernet, one soft-RoCE device shared by every node): the peer's GID is our
    /// own and its UD QPN is [`lab_ud_qpn`] of its address.
    Lab,
}

/// The lab's stand-in UD QPN of a node: 0x100 plus the last byte of its address.
pub fn lab_ud_qpn(ip: IpAddr) -> u32 {
    let last = match ip {
        IpAddr::V4(a) => a.octets()[3],
        IpAddr::V6(a) => a.octets()[15],
    };
    0x100 + u32::from(last)
}

/// The IPoIB hardware address in 20 bytes (flags and QPN, then the GID), as netlink gives it.
pub fn ipoib_hwaddr(b: &[u8]) -> Option<HwAddr> {
    let b: &[u8; 20] = b.try_into().ok()?;
    let mut gid = [0u8; 16];
    gid.copy_from_slice(&b[4..]);
    Some(HwAddr {
        gid,
        ud_qpn: u32::from_be_bytes([0, b[1], b[2], b[3]]),
    })
}

impl Resolve {
    /// The peer's GID and UD QPN; `own_gid` is the lab's stand-in.
    pub async fn peer(&self, rtnl: &Rtnl, ip: IpAddr, own_gid: [u8; 16]) -> Option<HwAddr> {
        match self {
            Resolve::Lab => Some(HwAddr {
                gid: own_gid,
                ud_qpn: lab_ud_qpn(ip),
            }),
            Resolve::Neighbour { ifindex } => match rtnl.neighbour(*ifindex, ip).await {
                Ok(l) => ipoib_hwaddr(&l?),
                Err(e) => {
                    tracing::warn!("{ip}: {e}");
                    None
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipoib_hardware_addresses_parse() {
        let mut b = [0u8; 20];
        b[..6].copy_from_slice(&[0x80, 0x00, 0x01, 0x48, 0xfe, 0x80]);
        b[19] = 0x56;
        let hw = ipoib_hwaddr(&b).unwrap();
        assert_eq!(hw.ud_qpn, 0x148);
        assert_eq!(hw.gid[0..2], [0xfe, 0x80]);
        assert_eq!(hw.gid[15], 0x56);
        assert!(ipoib_hwaddr(&b[..6]).is_none());
        assert!(ipoib_hwaddr(&[0u8; 21]).is_none());
    }

    #[test]
    fn lab_qpns_follow_the_last_byte() {
        assert_eq!(lab_ud_qpn("10.77.0.2".parse().unwrap()), 0x102);
        assert_eq!(lab_ud_qpn("fd77::1".parse().unwrap()), 0x101);
    }
}
