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

    /// Addresses of real ports, as tools printed them on real hosts (docs/testing.md says
    /// where each is from): a ConnectX-3 (mlx4) in connected mode (flags 0x80: RC), and two
    /// mlx5 ports in Enhanced IPoIB (flags 0: datagram only). The flags never enter the address a setup reaches and checks the REP
    /// against: a peer whose REP names the same GID and QPN is the one asked, flags or not.
    #[test]
    fn real_hardware_addresses_parse_and_their_flags_stay_out() {
        let parse = |s: &str| -> Vec<u8> {
            s.split(':')
                .map(|h| u8::from_str_radix(h, 16).unwrap())
                .collect()
        };
        let cases = [
            (
                "80:00:0a:80:fe:80:00:00:00:00:00:00:00:02:c9:03:00:a0:00:91",
                0xa80,
                "0002c90300a00091",
            ),
            (
                "00:00:0a:2d:fe:80:00:00:00:00:00:00:ec:0d:9a:03:00:44:36:8d",
                0xa2d,
                "ec0d9a030044368d",
            ),
            (
                "00:00:06:2f:fe:80:00:00:00:00:00:00:e4:1d:2d:03:00:e7:0f:f6",
                0x62f,
                "e41d2d0300e70ff6",
            ),
        ];
        for (text, qpn, guid) in cases {
            let b = parse(text);
            let hw = ipoib_hwaddr(&b).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(hw.ud_qpn, qpn, "{text}");
            assert_eq!(hw.gid[..8], [0xfe, 0x80, 0, 0, 0, 0, 0, 0], "{text}");
            let g: String = hw.gid[8..].iter().map(|x| format!("{x:02x}")).collect();
            assert_eq!(g, guid, "{text}");
            // The same port with its flags flipped is the same peer.
            let mut flipped = b.clone();
            flipped[0] ^= 0x80;
            assert_eq!(ipoib_hwaddr(&flipped), Some(hw), "{text}");
            // A REP from it carries GID and UD QPN only: equal to what the neighbour said.
            let rep = super::super::wire::Hello {
                ud_qpn: qpn,
                recv_mtu: 65524,
                rc: crate::verbs::RcEndpoint {
                    qpn: 0x1234,
                    psn: 1,
                    lid: 7,
                    gid: hw.gid,
                    mtu: 5,
                    link_layer: crate::path::LinkLayer::InfiniBand,
                },
                path: None,
            };
            assert_eq!(rep.hwaddr(), hw, "{text}");
        }
    }

    #[test]
    fn lab_qpns_follow_the_last_byte() {
        assert_eq!(lab_ud_qpn("10.77.0.2".parse().unwrap()), 0x102);
        assert_eq!(lab_ud_qpn("fd77::1".parse().unwrap()), 0x101);
    }
}
