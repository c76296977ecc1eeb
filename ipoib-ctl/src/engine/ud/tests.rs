//! What a packet needs before UD takes it, checked against etherparse's checksums.

use std::net::Ipv4Addr;

use etherparse::PacketBuilder;

use super::*;
use crate::tun::{VNET_GSO_TCPV4, VNET_GSO_UDP};

/// `whole` (an IP packet whose transport header starts at `start`, its checksum field at
/// `start + offset`) as a TUN read with the checksum left partial, as the kernel leaves it for
/// a device that checksums: the field holds the pseudo-header's sum, not complemented, of
/// `addrs` (source, then destination), the protocol and the transport length.
fn left_partial(whole: &[u8], addrs: &[u8], proto: u8, start: u16, offset: u16) -> Vec<u8> {
    let l4_len = (whole.len() - usize::from(start)) as u32;
    let mut sum: u32 = addrs
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    sum += u32::from(proto) + l4_len;
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let mut partial = whole.to_vec();
    let at = usize::from(start + offset);
    partial[at..at + 2].copy_from_slice(&(sum as u16).to_be_bytes());
    let hdr = VnetHdr {
        flags: VNET_F_NEEDS_CSUM,
        csum_start: start,
        csum_offset: offset,
        ..VnetHdr::default()
    };
    let mut msg = hdr.encode().to_vec();
    msg.extend_from_slice(&partial);
    msg
}

/// A TUN read of a UDP datagram with `payload` bytes from 10.0.0.1:4000 to `dst`:5000, its
/// checksum left partial; and the same datagram with the checksum etherparse computes.
fn partial_udp(dst: Ipv4Addr, payload: usize) -> (Vec<u8>, Vec<u8>) {
    let data: Vec<u8> = (0..payload).map(|i| (i * 7 + 3) as u8).collect();
    let mut whole = Vec::new();
    PacketBuilder::ipv4([10, 0, 0, 1], dst.octets(), 64)
        .udp(4000, 5000)
        .write(&mut whole, &data)
        .unwrap();
    let addrs = [[10, 0, 0, 1], dst.octets()].concat();
    (left_partial(&whole, &addrs, 17, 20, 6), whole)
}

#[test]
fn a_partial_checksum_is_finished_as_a_device_would() {
    // Odd and even lengths: the last byte of an odd one is the high half of a word.
    for payload in [0, 1, 2, 17, 1000, 1401] {
        let (mut msg, whole) = partial_udp(Ipv4Addr::new(10, 0, 0, 2), payload);
        assert_eq!(prepare(&mut msg), Ok(IpAddr::from([10, 0, 0, 2])));
        assert_eq!(msg[VNET_HDR_LEN..], whole, "{payload} bytes");
    }
}

#[test]
fn a_whole_checksum_is_left_as_it_is() {
    let (mut msg, whole) = partial_udp(Ipv4Addr::new(10, 0, 0, 2), 100);
    msg[..VNET_HDR_LEN].fill(0);
    msg[VNET_HDR_LEN..].copy_from_slice(&whole);
    assert_eq!(prepare(&mut msg), Ok(IpAddr::from([10, 0, 0, 2])));
    assert_eq!(msg[VNET_HDR_LEN..], whole);
}

#[test]
fn gso_is_not_for_ud_nor_what_is_no_ip_packet() {
    for gso in [VNET_GSO_TCPV4, VNET_GSO_UDP] {
        let (mut msg, _) = partial_udp(Ipv4Addr::new(10, 0, 0, 2), 100);
        msg[1] = gso;
        assert_eq!(prepare(&mut msg), Err(NotUd::Gso));
    }
    let (mut msg, _) = partial_udp(Ipv4Addr::new(10, 0, 0, 2), 100);
    msg[VNET_HDR_LEN] = 0x55;
    assert_eq!(prepare(&mut msg), Err(NotUd::Malformed), "IP version 5");
    assert_eq!(
        prepare(&mut [0u8; 9]),
        Err(NotUd::Malformed),
        "shorter than the header"
    );
}

#[test]
fn a_checksum_place_outside_the_packet_is_refused_untouched() {
    let (msg, _) = partial_udp(Ipv4Addr::new(10, 0, 0, 2), 10);
    let len = (msg.len() - VNET_HDR_LEN) as u16;
    for (start, offset) in [(len - 1, 0), (20, len), (u16::MAX, u16::MAX)] {
        let mut m = msg.clone();
        m[6..8].copy_from_slice(&start.to_le_bytes());
        m[8..10].copy_from_slice(&offset.to_le_bytes());
        let before = m.clone();
        assert_eq!(prepare(&mut m), Err(NotUd::Malformed), "{start} + {offset}");
        assert_eq!(m, before);
    }
    // The last two bytes are still inside.
    let mut m = msg.clone();
    m[6..8].copy_from_slice(&(len - 2).to_le_bytes());
    m[8..10].copy_from_slice(&0u16.to_le_bytes());
    assert!(prepare(&mut m).is_ok());
}

#[test]
fn a_sum_of_zero_is_sent_as_all_ones() {
    // Ones' complement: a field that makes the sum 0xffff over the rest gives zero, sent as
    // 0xffff (UDP's "no checksum" is 0).
    let mut pkt = [0xff, 0xff, 0x00, 0x00];
    finish_checksum(&mut pkt, 0, 2).unwrap();
    assert_eq!(pkt[2..], [0xff, 0xff]);
    let mut pkt = [0x12, 0x34, 0x00, 0x00];
    finish_checksum(&mut pkt, 0, 2).unwrap();
    assert_eq!(pkt[2..], (!0x1234u16).to_be_bytes());
}

#[test]
fn an_ipv6_tcp_checksum_is_finished_too() {
    let (src, dst) = ([0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], {
        let mut d = [0u8; 16];
        d[0] = 0xfd;
        d[15] = 2;
        d
    });
    for payload in [0usize, 1, 999] {
        let data: Vec<u8> = (0..payload).map(|i| (i * 13 + 5) as u8).collect();
        let mut whole = Vec::new();
        PacketBuilder::ipv6(src, dst, 64)
            .tcp(4000, 5000, 7, 65000)
            .write(&mut whole, &data)
            .unwrap();
        let mut msg = left_partial(&whole, &[src, dst].concat(), 6, 40, 16);
        assert_eq!(prepare(&mut msg), Ok(IpAddr::from(dst)));
        assert_eq!(msg[VNET_HDR_LEN..], whole, "{payload} bytes");
    }
}
