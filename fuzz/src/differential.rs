//! The fast path's own parse (`ipoib-ebpf/src/parse.rs`, compiled here unchanged: it needs
//! nothing of the kernel's) against etherparse, an independent parser, on the same frame.
//!
//! Where both parse, they agree on the L3 family, the addresses, multicast, the handshake's
//! TCP (the ports) and Neighbor Discovery. Where only one parses, the fast path must be the
//! safe side: it may call a frame malformed only where etherparse refuses it too (a malformed
//! frame goes UD and, on receive, past the block, to the kernel, which must drop it), and it
//! may accept what etherparse refuses only in what it does not read (a length field, an
//! ICMPv6 header shorter than etherparse's 8 bytes, truncated options).
//!
//! Not compared, and why: IPv6 behind extension headers (the fast path reads the first next
//! header: Neighbor Discovery and the handshake's TCP are recognised only without them, which
//! is how the kernel sends them); VLAN-tagged Ethernet (not IP to the fast path: UD).

use std::net::{Ipv4Addr, Ipv6Addr};

use etherparse::{EtherType, LinkSlice, NetSlice, SlicedPacket, TransportSlice};
use ipoib_common::{ARPHRD_ETHER, ARPHRD_INFINIBAND};

#[allow(dead_code, clippy::all)]
#[path = "../../ipoib-ebpf/src/parse.rs"]
mod fastpath;

/// The handshake port the control flag is checked against.
const CTL_PORT: u16 = 4755;

/// What a parse says of a frame, in the terms both can say it.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    ethertype: u16,
    /// (family 4 or 6, source, destination)
    ip: Option<(u8, Vec<u8>, Vec<u8>)>,
    multicast: bool,
    control: bool,
    neighbor_discovery: bool,
}

/// How a frame came out of the comparison (what a seeded run tallies, to show it reached
/// every kind of frame).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Outcome {
    /// Both read it alike: IP or not, and the flags the fast path decides by.
    Agreed {
        ip: bool,
        multicast: bool,
        control: bool,
        neighbor_discovery: bool,
    },
    /// Compared up to an extension header or a VLAN tag.
    NotCompared,
    /// etherparse refused it; the fast path read it (in what it does not read, see above).
    OnlyFastPath,
    /// Both refused it.
    BothRefused,
    /// Nothing to parse.
    Empty,
}

/// The first byte picks the framing (even: IPoIB, odd: Ethernet) and whether a handshake port
/// is set (bit 1 clear); the rest is the frame.
pub fn parse(data: &[u8]) {
    compare(data);
}

/// [`parse`], saying how the frame came out.
pub fn compare(data: &[u8]) -> Outcome {
    let Some((&pick, frame)) = data.split_first() else {
        return Outcome::Empty;
    };
    let link = if pick & 1 == 0 {
        ARPHRD_INFINIBAND
    } else {
        ARPHRD_ETHER
    };
    let ctl_port = if pick & 2 == 0 { CTL_PORT } else { 0 };
    let ours = fast_path(frame, link, ctl_port);
    let theirs = reference(frame, link, ctl_port);
    match (&ours, &theirs) {
        (Ok(o), Ok(Some(t))) => {
            assert_eq!(o, t, "the two parses differ on {frame:02x?}");
            Outcome::Agreed {
                ip: o.ip.is_some(),
                multicast: o.multicast,
                control: o.control,
                neighbor_discovery: o.neighbor_discovery,
            }
        }
        // Behind extension headers or a VLAN tag: only what lies before them is compared.
        (Ok(o), Ok(None)) => {
            assert!(!o.neighbor_discovery && !o.control, "{o:?}");
            Outcome::NotCompared
        }
        (Err(()), Ok(t)) => {
            panic!("the fast path calls malformed a frame etherparse reads as {t:?}: {frame:02x?}")
        }
        (Ok(_), Err(_)) => Outcome::OnlyFastPath,
        (Err(()), Err(_)) => Outcome::BothRefused,
    }
}

/// The fast path's parse of `frame`.
fn fast_path(frame: &[u8], link: u16, ctl_port: u16) -> Result<Seen, ()> {
    let data = frame.as_ptr() as usize;
    let f = fastpath::parse(data, data + frame.len(), link, ctl_port).map_err(|_| ())?;
    let ip = f.ip.then(|| {
        let len = if f.family == 4 { 4 } else { 16 };
        (
            f.family,
            frame[f.src_at..f.src_at + len].to_vec(),
            frame[f.dst_at..f.dst_at + len].to_vec(),
        )
    });
    Ok(Seen {
        ethertype: f.ethertype,
        ip,
        multicast: f.multicast,
        control: f.control,
        neighbor_discovery: f.neighbor_discovery,
    })
}

/// etherparse's reading of `frame`: Err where it refuses the frame, Ok(None) where the frame
/// is one the two are not compared on.
fn reference(frame: &[u8], link: u16, ctl_port: u16) -> Result<Option<Seen>, String> {
    let (packet, ethertype, l2_multicast) = if link == ARPHRD_INFINIBAND {
        // RFC 4391's pseudo header as Linux builds it: the 20-byte destination address
        // (flags, QPN, GID), the ethertype, 2 reserved bytes.
        if frame.len() < 24 {
            return Err("shorter than the IPoIB header".into());
        }
        let ethertype = u16::from_be_bytes([frame[20], frame[21]]);
        let packet = SlicedPacket::from_ether_type(EtherType(ethertype), &frame[24..]);
        (packet, ethertype, frame[4] == 0xff)
    } else {
        let packet = SlicedPacket::from_ethernet(frame);
        let (ethertype, multicast) = match packet.as_ref().map(|p| &p.link) {
            Ok(Some(LinkSlice::Ethernet2(e))) => (e.ether_type().0, e.destination()[0] & 1 != 0),
            _ => return Err("no Ethernet header".into()),
        };
        (packet, ethertype, multicast)
    };
    let packet = packet.map_err(|e| e.to_string())?;
    if !packet.link_exts.is_empty() {
        return Ok(None);
    }
    let (ip, l3_multicast, ext_headers) = match &packet.net {
        Some(NetSlice::Ipv4(v4)) => {
            let (src, dst) = (v4.header().source(), v4.header().destination());
            let d = Ipv4Addr::from(dst);
            (
                Some((4, src.to_vec(), dst.to_vec())),
                d.is_multicast() || d.is_broadcast(),
                false,
            )
        }
        Some(NetSlice::Ipv6(v6)) => {
            let (src, dst) = (v6.header().source(), v6.header().destination());
            let ext = v6.payload().ip_number != v6.header().next_header();
            (
                Some((6, src.to_vec(), dst.to_vec())),
                Ipv6Addr::from(dst).is_multicast(),
                ext,
            )
        }
        Some(NetSlice::Arp(_)) | None => (None, false, false),
    };
    if ext_headers {
        return Ok(None);
    }
    let (control, neighbor_discovery) = match &packet.transport {
        Some(TransportSlice::Tcp(t)) => (
            ctl_port != 0 && (t.source_port() == ctl_port || t.destination_port() == ctl_port),
            false,
        ),
        // Neighbor Discovery is ICMPv6 over IPv6 (etherparse reads ICMPv6 over IPv4 too).
        Some(TransportSlice::Icmpv6(i)) => (
            false,
            matches!(packet.net, Some(NetSlice::Ipv6(_))) && (133..=137).contains(&i.type_u8()),
        ),
        _ => (false, false),
    };
    Ok(Some(Seen {
        ethertype,
        ip,
        multicast: l2_multicast || l3_multicast,
        control,
        neighbor_discovery,
    }))
}
