//! The engine's decisions, packet by packet: each test drives a core as the engine's loop
//! does (a slot taken, a packet read into it, the outbox posted, completions) and checks what
//! it posts, what it drops under which counter, what it tells the control plane, and that
//! every send slot comes back.

use std::net::Ipv6Addr;

use super::*;

/// A QP known by its number.
#[derive(Clone, Debug)]
struct Qp(u32);

impl SendEnd for Qp {
    fn qpn(&self) -> u32 {
        self.0
    }
}

const SLOTS: u32 = 16;

fn core_with(max_send_wr: u32, backlog: usize, spare_slots: usize) -> EngineCore<Qp> {
    let cfg = EngineConfig {
        max_send_wr,
        backlog,
        spare_slots,
    };
    EngineCore::new(0..SLOTS, cfg, Arc::new(EngineStats::default()))
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A TUN read of `len` bytes: the virtio-net header, then an IP packet to `dst`.
fn packet(dst: IpAddr, len: usize) -> Vec<u8> {
    let mut m = vec![0u8; len.max(VNET_HDR_LEN + 40)];
    let p = &mut m[VNET_HDR_LEN..];
    match dst {
        IpAddr::V4(a) => {
            p[0] = 0x45;
            p[16..20].copy_from_slice(&a.octets());
        }
        IpAddr::V6(a) => {
            p[0] = 0x60;
            p[24..40].copy_from_slice(&a.octets());
        }
    }
    m.truncate(len);
    m
}

fn route(c: &mut EngineCore<Qp>, dst: &str, qpn: u32, mtu: u32) {
    c.add_route(ip(dst), Route { qp: Qp(qpn), mtu });
}

/// Reads `msg` into a free slot, as the loop does; the slot.
fn read(c: &mut EngineCore<Qp>, msg: &[u8]) -> u32 {
    let slot = c.take_slot().expect("a free slot");
    c.transmit(slot, msg);
    slot
}

fn read_to(c: &mut EngineCore<Qp>, dst: &str, len: usize) -> u32 {
    read(c, &packet(ip(dst), len))
}

/// What the core let go of unsent, offered to UD and given back, as the loop does at the
/// end of each turn: (slot, length), in order.
fn unsent(c: &mut EngineCore<Qp>) -> Vec<(u32, u32)> {
    let out: Vec<_> = std::iter::from_fn(|| c.next_unsent()).collect();
    for (slot, _) in &out {
        c.give_back(*slot, None);
    }
    out
}

/// The send slots free once what was let go of unsent has been offered to UD.
fn free(c: &mut EngineCore<Qp>) -> usize {
    unsent(c);
    c.free_slots()
}

/// Posts the outbox, every chain taken whole: (QP, slot, length) in posting order.
fn post(c: &mut EngineCore<Qp>) -> Vec<(u32, u32, u32)> {
    let mut posted = Vec::new();
    c.flush(|qp, chain| {
        posted.extend(chain.iter().map(|r| {
            assert_eq!(r.wr_id, u64::from(r.slot), "a send is named by its slot");
            (qp.0, r.slot, r.len)
        }));
        (chain.len(), Ok::<(), String>(()))
    });
    posted
}

fn done(c: &mut EngineCore<Qp>, qpn: u32, slot: u32, error: Option<u32>) {
    c.handle_send_done(&Completion {
        wr_id: u64::from(slot),
        qp_num: qpn,
        bytes: 0,
        recv: false,
        error,
    });
}

fn receive(
    c: &mut EngineCore<Qp>,
    qpn: u32,
    len: usize,
    error: Option<u32>,
    on_ring: bool,
) -> Receipt {
    let wc = Completion {
        wr_id: 0,
        qp_num: qpn,
        bytes: len as u32,
        recv: true,
        error,
    };
    c.handle_receive(&wc, len, on_ring)
}

/// A packet of `bytes` received on `qpn` and written into the TUN device, as the loop does.
fn packet_in(c: &mut EngineCore<Qp>, qpn: u32, bytes: u32) {
    assert_eq!(
        receive(c, qpn, bytes as usize, None, false),
        Receipt::Deliver
    );
    c.handle_delivered(qpn, bytes, true);
}

fn keepalive_in(c: &mut EngineCore<Qp>, qpn: u32) {
    assert_eq!(receive(c, qpn, KEEPALIVE_LEN, None, false), Receipt::Repost);
}

/// A receive on `qpn` (on the SRQ) that completed in error, not flushed.
fn failed_in(c: &mut EngineCore<Qp>, qpn: u32, status: u32) {
    assert_eq!(receive(c, qpn, 0, Some(status), false), Receipt::Repost);
}

fn events(c: &mut EngineCore<Qp>) -> Vec<EngineEvent> {
    std::iter::from_fn(|| c.next_event()).collect()
}

fn stat(c: &EngineCore<Qp>, name: &str) -> u64 {
    c.stats()
        .snapshot()
        .into_iter()
        .find(|(k, _)| *k == name)
        .unwrap_or_else(|| panic!("no counter {name}"))
        .1
}

/// Every counter that is not 0.
fn nonzero(c: &EngineCore<Qp>) -> Vec<(&'static str, u64)> {
    c.stats
        .snapshot()
        .into_iter()
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// Housekeeping with every keepalive taken: (QP, slot) of each.
fn housekeeping(c: &mut EngineCore<Qp>) -> Vec<(u32, u32)> {
    let mut sent = Vec::new();
    c.housekeeping(|qp, slot| {
        sent.push((qp.0, slot));
        Ok::<(), String>(())
    });
    sent
}

#[test]
fn a_routed_packet_is_posted_on_its_connection_and_counted_sent_once_posted() {
    let mut c = core_with(8, 4, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    assert_eq!(
        events(&mut c),
        [EngineEvent::RouteAdded {
            ip: ip("10.0.0.2"),
            qpn: 7
        }]
    );
    let a = read_to(&mut c, "10.0.0.2", 100);
    let b = read_to(&mut c, "10.0.0.2", 300);
    assert_eq!(c.unposted(), 2);
    assert_eq!(stat(&c, "tx_packets"), 0, "counted sent only once posted");
    assert_eq!(post(&mut c), [(7, a, 100), (7, b, 300)]);
    assert_eq!(c.unposted(), 0);
    assert_eq!(
        nonzero(&c),
        [
            ("tx_packets", 2),
            ("tx_bytes", 400),
            ("tx_largest", 300),
            ("tx_depth_sum", 1 + 2),
        ]
    );
    assert_eq!(free(&mut c), SLOTS as usize - 2);
    done(&mut c, 7, a, None);
    done(&mut c, 7, b, None);
    assert_eq!(free(&mut c), SLOTS as usize);
    assert!(post(&mut c).is_empty());
    assert_eq!(events(&mut c), []);
}

#[test]
fn an_ipv6_packet_goes_by_its_destination_too() {
    let mut c = core_with(8, 4, 2);
    route(&mut c, "fd00::2", 7, 65520);
    route(&mut c, "fd00::3", 8, 65520);
    let s = read_to(&mut c, "fd00::3", 80);
    assert_eq!(post(&mut c), [(8, s, 80)]);
}

#[test]
fn what_cannot_go_is_counted_under_its_own_reason_and_offered_to_ud() {
    let mut c = core_with(8, 4, 2);
    route(&mut c, "10.0.0.2", 7, 200);
    // Not IP: too short for a destination, or of no IP version.
    read(&mut c, &packet(ip("10.0.0.2"), VNET_HDR_LEN + 19));
    let mut v5 = packet(ip("10.0.0.2"), 100);
    v5[VNET_HDR_LEN] = 0x55;
    read(&mut c, &v5);
    read(&mut c, &[]);
    for group in ["224.0.0.1", "255.255.255.255", "ff02::1"] {
        read_to(&mut c, group, 100);
    }
    read_to(&mut c, "10.0.0.9", 100);
    read_to(&mut c, "10.0.0.2", 201);
    let fits = read_to(&mut c, "10.0.0.2", 200);
    assert_eq!(
        post(&mut c),
        [(7, fits, 200)],
        "only what fits its route goes"
    );
    assert_eq!(
        nonzero(&c),
        [
            ("tx_packets", 1),
            ("tx_bytes", 200),
            ("tx_largest", 200),
            ("tx_no_connection", 1),
            ("tx_multicast", 3),
            ("tx_oversize", 1),
            ("tx_depth_sum", 1),
            ("tx_malformed", 3),
        ]
    );
    // The unicast packets are let go to UD in the order read, their slots taken until then;
    // what is no IP packet, and multicast (the kernel's own chatter on the TUN device), is
    // dropped, its slot free at once.
    assert_eq!(
        c.free_slots(),
        SLOTS as usize - 3,
        "one in flight, two to offer"
    );
    let lens: Vec<u32> = unsent(&mut c).into_iter().map(|(_, len)| len).collect();
    assert_eq!(lens, [100, 201]);
    assert_eq!(
        c.free_slots(),
        SLOTS as usize - 1,
        "every other slot free again"
    );
}

#[test]
fn a_slot_given_back_is_counted_only_when_a_reason_is_given() {
    let mut c = core_with(8, 4, 2);
    let s = c.take_slot().unwrap();
    c.give_back(s, None);
    let s = c.take_slot().unwrap();
    c.give_back(s, Some(|s| &s.tx_oversize));
    assert_eq!(nonzero(&c), [("tx_oversize", 1)]);
    assert_eq!(free(&mut c), SLOTS as usize);
}

#[test]
fn reading_stops_when_no_slot_is_free() {
    let mut c = core_with(SLOTS, 4, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    let slots: Vec<u32> = (0..SLOTS)
        .map(|_| read_to(&mut c, "10.0.0.2", 64))
        .collect();
    assert!(!c.can_read());
    assert_eq!(c.take_slot(), None);
    let mut distinct = slots.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), slots.len(), "no slot handed out twice");
    assert_eq!(post(&mut c).len(), SLOTS as usize);
    done(&mut c, 7, slots[3], None);
    assert!(c.can_read());
    assert_eq!(c.take_slot(), Some(slots[3]));
}

#[test]
fn a_full_window_queues_in_order_and_each_completion_releases_the_next() {
    let mut c = core_with(2, 10, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    let s: Vec<u32> = (0..5)
        .map(|i| read_to(&mut c, "10.0.0.2", 100 + i))
        .collect();
    assert_eq!(post(&mut c), [(7, s[0], 100), (7, s[1], 101)]);
    assert_eq!(stat(&c, "tx_window_waits"), 3);
    done(&mut c, 7, s[1], None);
    assert_eq!(
        post(&mut c),
        [(7, s[2], 102)],
        "the first waiting goes first"
    );
    done(&mut c, 7, s[0], None);
    done(&mut c, 7, s[2], None);
    assert_eq!(post(&mut c), [(7, s[3], 103), (7, s[4], 104)]);
    // Depths: 1, 2; then each completion lets one in beside the other in flight: 2.
    assert_eq!(stat(&c, "tx_depth_sum"), 1 + 2 + 2 + 2 + 2);
    done(&mut c, 7, s[3], None);
    done(&mut c, 7, s[4], None);
    assert_eq!(free(&mut c), SLOTS as usize);
    assert_eq!(stat(&c, "tx_packets"), 5);
    assert_eq!(
        events(&mut c).len(),
        1,
        "only the route's: no congestion below the backlog"
    );
}

#[test]
fn past_the_backlog_the_peer_is_congested_once_and_drained_when_its_queue_empties() {
    let mut c = core_with(1, 2, 4);
    route(&mut c, "10.0.0.2", 7, 65520);
    events(&mut c);
    let s: Vec<u32> = (0..5).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    assert_eq!(post(&mut c), [(7, s[0], 100)]);
    // The only connection: what it read past the backlog still waits.
    assert_eq!(events(&mut c), [EngineEvent::Congested(ip("10.0.0.2"))]);
    assert_eq!(stat(&c, "tx_congested"), 1);
    assert_eq!(stat(&c, "tx_window_waits"), 4);
    assert_eq!(stat(&c, "tx_backpressure"), 0);
    for i in 0..4 {
        done(&mut c, 7, s[i], None);
        assert_eq!(post(&mut c), [(7, s[i + 1], 100)]);
        let drained = i == 3;
        assert_eq!(
            events(&mut c),
            if drained {
                vec![EngineEvent::Drained(ip("10.0.0.2"))]
            } else {
                vec![]
            },
            "after completion {i}"
        );
    }
    done(&mut c, 7, s[4], None);
    assert_eq!(events(&mut c), []);
    assert_eq!(free(&mut c), SLOTS as usize);
    // Congested again after draining: said again.
    for _ in 0..4 {
        read_to(&mut c, "10.0.0.2", 100);
    }
    assert_eq!(events(&mut c), [EngineEvent::Congested(ip("10.0.0.2"))]);
    assert_eq!(stat(&c, "tx_congested"), 2);
}

#[test]
fn a_congested_connection_leaves_spare_slots_to_the_others() {
    // 16 slots, a window of 1, a backlog of 1, 12 kept spare.
    let mut c = core_with(1, 1, 12);
    route(&mut c, "10.0.0.2", 7, 65520);
    route(&mut c, "10.0.0.3", 8, 65520);
    events(&mut c);
    let first = read_to(&mut c, "10.0.0.2", 100);
    read_to(&mut c, "10.0.0.2", 100); // waits in the backlog
    // Past the backlog: kept while 12 slots stay free after it (16 - 4 = 12).
    read_to(&mut c, "10.0.0.2", 100);
    read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(stat(&c, "tx_backpressure"), 0);
    assert_eq!(free(&mut c), 12);
    // The next would leave 11: let go to UD, its slot free again once offered.
    read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(stat(&c, "tx_backpressure"), 1);
    assert_eq!(free(&mut c), 12);
    assert_eq!(
        events(&mut c),
        [EngineEvent::Congested(ip("10.0.0.2"))],
        "said once"
    );
    let other = read_to(&mut c, "10.0.0.3", 100);
    assert_eq!(post(&mut c), [(7, first, 100), (8, other, 100)]);
    assert_eq!(stat(&c, "tx_congested"), 1);
}

/// A TUN read of a UDP datagram of `len` bytes from port `sport` to `dst` (IPv4).
fn datagram(dst: &str, sport: u16, len: usize) -> Vec<u8> {
    let mut m = packet(ip(dst), len);
    let p = &mut m[VNET_HDR_LEN..];
    p[9] = 17;
    p[20..22].copy_from_slice(&sport.to_be_bytes());
    p[22..24].copy_from_slice(&5404u16.to_be_bytes());
    m
}

#[test]
fn under_overload_a_sparse_flow_loses_nothing_to_a_bulk_one_on_its_connection() {
    // 16 slots, a window of 1, a backlog of 1, 12 kept spare: 4 slots for 10.0.0.2.
    let mut c = core_with(1, 1, 12);
    route(&mut c, "10.0.0.2", 7, 65520);
    route(&mut c, "10.0.0.3", 8, 65520);
    let bulk: Vec<u32> = (0..4)
        .map(|_| read(&mut c, &datagram("10.0.0.2", 1, 1000)))
        .collect();
    assert_eq!(free(&mut c), 12);
    // A datagram of another flow past the bound: the bulk flow's oldest waiting one gives
    // its slot back (bulk[0] is in flight), and this one waits in the queue.
    let s1 = read(&mut c, &datagram("10.0.0.2", 2, 200));
    assert_eq!(stat(&c, "tx_backpressure"), 1);
    let offered: Vec<u32> = unsent(&mut c).into_iter().map(|(s, _)| s).collect();
    assert_eq!(offered, [bulk[1]], "the one dropped is offered to UD");
    assert_eq!(free(&mut c), 12);
    // The bulk flow's next is its own to drop: with it, it would hold the most (3000 bytes).
    read(&mut c, &datagram("10.0.0.2", 1, 1000));
    assert_eq!(stat(&c, "tx_backpressure"), 2);
    // Counted in bytes, not packets: two more small ones wait (400, then 600 bytes, against
    // the bulk flow's 2000, then 1000), though the second makes them more packets than it.
    let s2 = read(&mut c, &datagram("10.0.0.2", 2, 200));
    let s3 = read(&mut c, &datagram("10.0.0.2", 2, 200));
    assert_eq!(stat(&c, "tx_backpressure"), 4);
    // Now the small flow holds the queue: its next is the one dropped.
    read(&mut c, &datagram("10.0.0.2", 2, 200));
    assert_eq!(stat(&c, "tx_backpressure"), 5);
    assert_eq!(free(&mut c), 12);
    assert_eq!(stat(&c, "tx_window_waits"), 6);
    // What goes, in order: the first in flight, then the small flow's three.
    let mut sent = post(&mut c);
    for _ in 0..3 {
        let (_, slot, _) = *sent.last().unwrap();
        done(&mut c, 7, slot, None);
        sent.extend(post(&mut c));
    }
    assert_eq!(
        sent,
        [(7, bulk[0], 1000), (7, s1, 200), (7, s2, 200), (7, s3, 200)]
    );
}

#[test]
fn a_flow_is_its_source_protocol_and_ports() {
    let key = |sport: u16| flow_key(&datagram("10.0.0.2", sport, 100)[VNET_HDR_LEN..]);
    assert_eq!(key(1), key(1));
    assert_ne!(key(1), key(2), "another source port");
    let mut other_dport = datagram("10.0.0.2", 1, 100);
    other_dport[VNET_HDR_LEN + 23] ^= 1;
    assert_ne!(
        flow_key(&other_dport[VNET_HDR_LEN..]),
        key(1),
        "another destination port"
    );
    let mut other_src = datagram("10.0.0.2", 1, 100);
    other_src[VNET_HDR_LEN + 15] = 9;
    assert_ne!(
        flow_key(&other_src[VNET_HDR_LEN..]),
        key(1),
        "another source address"
    );
    // The ports are read past the header's options (IHL 6: 24 bytes).
    let mut options = datagram("10.0.0.2", 1, 100);
    options[VNET_HDR_LEN] = 0x46;
    let with_ports = |m: &mut Vec<u8>, at: usize, p: u16| {
        m[VNET_HDR_LEN + at..VNET_HDR_LEN + at + 2].copy_from_slice(&p.to_be_bytes())
    };
    with_ports(&mut options, 24, 7);
    let a = flow_key(&options[VNET_HDR_LEN..]);
    with_ports(&mut options, 24, 8);
    assert_ne!(
        flow_key(&options[VNET_HDR_LEN..]),
        a,
        "ports after the options"
    );
    with_ports(&mut options, 20, 9);
    assert_ne!(
        flow_key(&options[VNET_HDR_LEN..]),
        a,
        "the options are no ports"
    );
}

#[test]
fn a_later_fragment_and_a_protocol_without_ports_are_keyed_without_them() {
    // A fragment after the first has no ports: its bytes there are data.
    let later = |sport: u16| {
        let mut m = datagram("10.0.0.2", sport, 100);
        m[VNET_HDR_LEN + 6..VNET_HDR_LEN + 8].copy_from_slice(&0x0001u16.to_be_bytes());
        flow_key(&m[VNET_HDR_LEN..])
    };
    assert_eq!(later(1), later(2));
    // The first fragment has them (more fragments, offset 0).
    let first = |sport: u16| {
        let mut m = datagram("10.0.0.2", sport, 100);
        m[VNET_HDR_LEN + 6] = 0x20;
        flow_key(&m[VNET_HDR_LEN..])
    };
    assert_ne!(first(1), first(2));
    // A protocol without ports: the bytes there are not read.
    let icmp = |b: u8| {
        let mut m = datagram("10.0.0.2", 1, 100);
        m[VNET_HDR_LEN + 9] = 1;
        m[VNET_HDR_LEN + 20] = b;
        flow_key(&m[VNET_HDR_LEN..])
    };
    assert_eq!(icmp(1), icmp(2));
    // TCP and SCTP have ports where UDP has them.
    for proto in [6u8, 132] {
        let k = |sport: u16| {
            let mut m = datagram("10.0.0.2", sport, 100);
            m[VNET_HDR_LEN + 9] = proto;
            flow_key(&m[VNET_HDR_LEN..])
        };
        assert_ne!(k(1), k(2), "protocol {proto}");
    }
}

#[test]
fn an_ipv6_flow_is_keyed_too_and_a_short_packet_is_no_panic() {
    // IPv6: source at 8, next header at 6, ports at 40.
    let v6 = |sport: u16, src: u8| {
        let mut m = packet(ip("fd00::2"), 100);
        let p = &mut m[VNET_HDR_LEN..];
        p[6] = 17;
        p[23] = src;
        p[40..42].copy_from_slice(&sport.to_be_bytes());
        flow_key(p)
    };
    assert_eq!(v6(1, 1), v6(1, 1));
    assert_ne!(v6(1, 1), v6(2, 1));
    assert_ne!(v6(1, 1), v6(1, 2));
    // Too short for what it names, or no IP at all: a key still, no panic.
    for short in [
        &[][..],
        &[0x45][..],
        &[0x4f, 0, 0, 0, 0, 0, 0, 0, 0, 17][..],
        &[0x60; 30][..],
    ] {
        flow_key(short);
    }
}

#[test]
fn the_only_connection_keeps_every_slot_it_reads_into_past_the_backlog() {
    // Spare slots are kept for other connections: with none, none are kept back.
    let mut c = core_with(1, 1, SLOTS as usize);
    route(&mut c, "10.0.0.2", 7, 65520);
    for _ in 0..SLOTS {
        read_to(&mut c, "10.0.0.2", 100);
    }
    assert_eq!(stat(&c, "tx_backpressure"), 0);
    assert_eq!(stat(&c, "tx_window_waits"), u64::from(SLOTS) - 1);
    // With three, the same reads leave the spare slots to the other two.
    let mut c = core_with(1, 1, 12);
    for (n, qpn) in [(2, 7), (3, 8), (4, 9)] {
        route(&mut c, &format!("10.0.0.{n}"), qpn, 65520);
    }
    for _ in 0..6 {
        read_to(&mut c, "10.0.0.2", 100);
    }
    assert_eq!(stat(&c, "tx_backpressure"), 2);
    assert_eq!(free(&mut c), 12);
}

#[test]
fn a_send_in_error_kills_its_connection_once_and_drops_what_waits() {
    let mut c = core_with(1, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    events(&mut c);
    let s: Vec<u32> = (0..3).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    assert_eq!(post(&mut c), [(7, s[0], 100)]);
    done(&mut c, 7, s[0], Some(12));
    assert_eq!(
        events(&mut c),
        [EngineEvent::QpError {
            qpn: 7,
            status: Some(12)
        }]
    );
    assert_eq!(stat(&c, "send_errors"), 1);
    assert_eq!(stat(&c, "tx_backpressure"), 2, "both waiting dropped");
    assert_eq!(free(&mut c), SLOTS as usize);
    assert!(post(&mut c).is_empty(), "nothing released by a failed send");
    // Dead until the control plane takes its route: what is read for it is let go to UD.
    read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(stat(&c, "tx_no_connection"), 1);
    assert!(post(&mut c).is_empty());
    // A second failure (a flushed keepalive, say) is counted, not said again.
    let k = c.take_slot().unwrap();
    done(&mut c, 7, k, Some(5));
    assert_eq!(stat(&c, "send_errors"), 2);
    assert_eq!(events(&mut c), []);
    assert_eq!(free(&mut c), SLOTS as usize);
}

#[test]
fn a_qp_that_refuses_part_of_a_chain_is_dead_and_what_waits_for_it_let_go() {
    let mut c = core_with(2, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    events(&mut c);
    let s: Vec<u32> = (0..4).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    let mut offered = Vec::new();
    c.flush(|qp, chain| {
        offered.push((qp.0, chain.len()));
        (1, Err("refused"))
    });
    assert_eq!(
        offered,
        [(7, 2)],
        "one chain for the QP, its window's worth"
    );
    assert_eq!(stat(&c, "tx_packets"), 1);
    assert_eq!(stat(&c, "send_errors"), 1);
    assert_eq!(
        stat(&c, "tx_backpressure"),
        2,
        "the two waiting let go at once"
    );
    assert_eq!(
        events(&mut c),
        [EngineEvent::QpError {
            qpn: 7,
            status: None
        }]
    );
    assert_eq!(
        free(&mut c),
        SLOTS as usize - 1,
        "only the one posted is out"
    );
    // Dead: nothing more is tried on it, no keepalive either.
    read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(stat(&c, "tx_no_connection"), 1);
    assert!(post(&mut c).is_empty());
    assert_eq!(housekeeping(&mut c), []);
    done(&mut c, 7, s[0], Some(5));
    assert_eq!(events(&mut c), [], "said once");
    assert_eq!(free(&mut c), SLOTS as usize);
}

#[test]
fn a_qp_that_takes_nothing_is_dead_too() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    route(&mut c, "10.0.0.3", 8, 65520);
    events(&mut c);
    read_to(&mut c, "10.0.0.2", 100);
    let other = read_to(&mut c, "10.0.0.3", 100);
    let mut posted = Vec::new();
    c.flush(|qp, chain| {
        if qp.0 == 7 {
            return (0, Err("refused"));
        }
        posted.extend(chain.iter().map(|r| r.slot));
        (chain.len(), Ok(()))
    });
    assert_eq!(posted, [other], "the other connection's send still goes");
    assert_eq!(stat(&c, "send_errors"), 1);
    assert_eq!(stat(&c, "tx_packets"), 1);
    assert_eq!(
        events(&mut c),
        [EngineEvent::QpError {
            qpn: 7,
            status: None
        }]
    );
}

#[test]
fn sends_decided_for_a_connection_that_died_in_the_same_turn_are_not_posted() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    route(&mut c, "10.0.0.3", 8, 65520);
    let first = read_to(&mut c, "10.0.0.2", 100);
    post(&mut c);
    read_to(&mut c, "10.0.0.2", 100);
    let other = read_to(&mut c, "10.0.0.3", 100);
    done(&mut c, 7, first, Some(12));
    assert_eq!(
        post(&mut c),
        [(8, other, 100)],
        "only the live connection's"
    );
    assert_eq!(stat(&c, "tx_backpressure"), 1);
    done(&mut c, 8, other, None);
    assert_eq!(free(&mut c), SLOTS as usize);
}

fn released(c: &mut EngineCore<Qp>) -> Vec<Released> {
    std::iter::from_fn(|| c.next_released()).collect()
}

/// A core whose route to 10.0.0.2 (QP 7, a window of one) is being let go with one send in
/// flight and two waiting: the core and the three slots, in order.
fn letting_go_of_three() -> (EngineCore<Qp>, Vec<u32>) {
    let mut c = core_with(1, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    let s: Vec<u32> = (0..3).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    assert_eq!(post(&mut c), [(7, s[0], 100)]);
    assert_eq!(c.remove_route(ip("10.0.0.2"), 7), Removal::Draining);
    (c, s)
}

#[test]
fn what_waits_for_a_removed_route_goes_over_it_before_it_is_let_go() {
    let mut c = core_with(1, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    // One in flight, three waiting.
    let mut s: Vec<u32> = (0..4).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    assert_eq!(post(&mut c), [(7, s[0], 100)]);
    assert_eq!(c.remove_route(ip("10.0.0.2"), 7), Removal::Draining);
    assert!(c.awaits_read_empty());
    // Still its route: a packet read now (sent here before the peer went UD) queues too.
    s.push(read_to(&mut c, "10.0.0.2", 100));
    assert!(post(&mut c).is_empty(), "the window is full");
    // No keepalive on a route being let go, though nothing was sent on it since.
    housekeeping(&mut c);
    assert!(housekeeping(&mut c).is_empty());
    // Each completion releases the next, on the old connection, in order.
    for i in 0..4 {
        done(&mut c, 7, s[i], None);
        assert_eq!(post(&mut c), [(7, s[i + 1], 100)], "the send after {i}");
    }
    c.handle_read_empty();
    assert!(!c.awaits_read_empty());
    assert!(released(&mut c).is_empty(), "one send still in flight");
    done(&mut c, 7, s[4], None);
    assert_eq!(
        released(&mut c),
        [Released {
            ip: ip("10.0.0.2"),
            qpn: 7,
            unrouted: true
        }]
    );
    assert_eq!(stat(&c, "tx_no_connection"), 0);
    assert_eq!(stat(&c, "tx_packets"), 5);
    assert_eq!(free(&mut c), SLOTS as usize);
    // Gone now: what comes next has no connection.
    read_to(&mut c, "10.0.0.2", 100);
    assert!(post(&mut c).is_empty());
    assert_eq!(stat(&c, "tx_no_connection"), 1);
    assert!(
        events(&mut c)
            .iter()
            .all(|e| matches!(e, EngineEvent::RouteAdded { .. }))
    );
}

#[test]
fn an_idle_route_is_let_go_once_the_tun_device_is_read_empty() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    assert_eq!(c.remove_route(ip("10.0.0.2"), 7), Removal::Draining);
    assert!(
        released(&mut c).is_empty(),
        "the device may still hold packets to it"
    );
    let s = read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(post(&mut c), [(7, s, 100)], "one it held");
    c.handle_read_empty();
    assert!(released(&mut c).is_empty(), "its send is in flight");
    done(&mut c, 7, s, None);
    assert_eq!(released(&mut c).len(), 1);
    // Its flow is forgotten at the next housekeeping.
    housekeeping(&mut c);
    assert_eq!(stat(&c, "flows"), 0);
}

#[test]
fn a_dead_connections_route_is_removed_at_once() {
    let mut c = core_with(1, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    let s: Vec<u32> = (0..3).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    post(&mut c);
    done(&mut c, 7, s[0], Some(12));
    assert_eq!(
        stat(&c, "tx_backpressure"),
        2,
        "what waited, let go as it died"
    );
    assert_eq!(c.remove_route(ip("10.0.0.2"), 7), Removal::Removed);
    assert!(released(&mut c).is_empty(), "nothing to let go later");
    assert!(!c.awaits_read_empty());
    assert_eq!(free(&mut c), SLOTS as usize);
}

#[test]
fn a_connection_that_dies_while_its_route_is_let_go_is_let_go_at_once() {
    let (mut c, s) = letting_go_of_three();
    done(&mut c, 7, s[0], Some(12));
    assert_eq!(released(&mut c).len(), 1, "not waiting for the TUN device");
    assert_eq!(stat(&c, "tx_backpressure"), 2);
    assert_eq!(free(&mut c), SLOTS as usize);
}

#[test]
fn a_route_let_go_drops_what_still_waits_after_the_drain_bound() {
    let (mut c, s) = letting_go_of_three();
    c.handle_read_empty();
    // The connection completes nothing.
    for _ in 0..DRAIN_HOUSEKEEPINGS {
        housekeeping(&mut c);
        assert!(released(&mut c).is_empty());
    }
    housekeeping(&mut c);
    assert_eq!(released(&mut c).len(), 1);
    assert_eq!(stat(&c, "tx_no_connection"), 2, "the two that waited");
    assert_eq!(
        stat(&c, "flows"),
        1,
        "its flow kept while its send is in flight"
    );
    // The send in flight comes back, late: its slot is free, nothing more goes.
    done(&mut c, 7, s[0], None);
    assert!(post(&mut c).is_empty());
    assert_eq!(free(&mut c), SLOTS as usize);
    housekeeping(&mut c);
    assert_eq!(stat(&c, "flows"), 0, "then forgotten");
}

#[test]
fn a_route_replaced_while_let_go_sends_what_waited_on_the_old_connection() {
    let (mut c, s) = letting_go_of_three();
    route(&mut c, "10.0.0.2", 8, 65520);
    let n = read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(
        post(&mut c),
        [(8, n, 100)],
        "the new route carries what comes next"
    );
    done(&mut c, 7, s[0], None);
    assert_eq!(post(&mut c), [(7, s[1], 100)]);
    done(&mut c, 7, s[1], None);
    assert_eq!(post(&mut c), [(7, s[2], 100)]);
    done(&mut c, 7, s[2], None);
    // Let go without the TUN device: nothing more is read for the old route.
    assert_eq!(
        released(&mut c),
        [Released {
            ip: ip("10.0.0.2"),
            qpn: 7,
            unrouted: false
        }]
    );
    assert_eq!(stat(&c, "tx_no_connection"), 0);
    let m = read_to(&mut c, "10.0.0.2", 100);
    done(&mut c, 8, n, None);
    assert_eq!(post(&mut c), [(8, m, 100)], "the new route stays");
}

/// The control plane replaced the route before it removed the old one (a reconnect): the old
/// connection's sends are still its, and its close waits for them.
#[test]
fn a_removal_after_the_route_moved_waits_for_the_old_connections_sends() {
    let mut c = core_with(1, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    let s: Vec<u32> = (0..2).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    post(&mut c);
    route(&mut c, "10.0.0.2", 8, 65520);
    assert_eq!(
        c.remove_route(ip("10.0.0.2"), 7),
        Removal::Draining,
        "one in flight, one waiting"
    );
    done(&mut c, 7, s[0], None);
    assert_eq!(
        post(&mut c),
        [(7, s[1], 100)],
        "what waited goes on the old connection"
    );
    assert!(released(&mut c).is_empty());
    done(&mut c, 7, s[1], None);
    assert_eq!(released(&mut c).len(), 1);
    // Only a send in flight, nothing waiting: the same.
    let n = read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(post(&mut c), [(8, n, 100)]);
    route(&mut c, "10.0.0.2", 9, 65520);
    assert_eq!(
        c.remove_route(ip("10.0.0.2"), 8),
        Removal::Draining,
        "one in flight"
    );
    done(&mut c, 8, n, None);
    assert_eq!(
        released(&mut c),
        [Released {
            ip: ip("10.0.0.2"),
            qpn: 8,
            unrouted: false
        }]
    );
    assert_eq!(
        c.remove_route(ip("10.0.0.2"), 8),
        Removal::NotHere,
        "nothing of it left"
    );
    assert_eq!(stat(&c, "tx_no_connection"), 0);
    assert_eq!(free(&mut c), SLOTS as usize);
}

#[test]
fn a_congested_route_let_go_tells_the_control_plane_nothing_more() {
    let mut c = core_with(1, 1, 0);
    route(&mut c, "10.0.0.2", 7, 65520);
    events(&mut c);
    let s: Vec<u32> = (0..3).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    post(&mut c);
    assert_eq!(events(&mut c), [EngineEvent::Congested(ip("10.0.0.2"))]);
    assert_eq!(c.remove_route(ip("10.0.0.2"), 7), Removal::Draining);
    // More past the backlog, and the queue emptied: neither is the peer's news now.
    let late = read_to(&mut c, "10.0.0.2", 100);
    for slot in [s[0], s[1], s[2]] {
        done(&mut c, 7, slot, None);
        post(&mut c);
    }
    done(&mut c, 7, late, None);
    assert!(events(&mut c).is_empty(), "no Congested, no Drained");
    c.handle_read_empty();
    assert_eq!(released(&mut c).len(), 1);
    assert_eq!(free(&mut c), SLOTS as usize);
}

#[test]
fn what_waits_for_a_route_replaced_without_removal_is_dropped_at_the_next_completion() {
    let mut c = core_with(1, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    let s: Vec<u32> = (0..4).map(|_| read_to(&mut c, "10.0.0.2", 100)).collect();
    post(&mut c);
    route(&mut c, "10.0.0.2", 8, 65520);
    done(&mut c, 7, s[0], None);
    assert!(post(&mut c).is_empty(), "nothing more on the old QP");
    assert_eq!(stat(&c, "tx_no_connection"), 3, "all three, not one");
    assert_eq!(free(&mut c), SLOTS as usize);
    housekeeping(&mut c);
    assert_eq!(stat(&c, "flows"), 0, "the old QP's flow is forgotten");
}

#[test]
fn a_route_is_removed_only_from_its_own_qp() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    assert_eq!(c.remove_route(ip("10.0.0.2"), 8), Removal::NotHere);
    let s = read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(
        post(&mut c),
        [(7, s, 100)],
        "a stale removal leaves the route"
    );
    assert_eq!(c.remove_route(ip("10.0.0.2"), 7), Removal::Draining);
    assert_eq!(
        c.remove_route(ip("10.0.0.2"), 7),
        Removal::Draining,
        "asked again: the same"
    );
    done(&mut c, 7, s, None);
    c.handle_read_empty();
    assert_eq!(released(&mut c).len(), 1, "let go once");
    assert_eq!(
        c.remove_route(ip("10.0.0.2"), 7),
        Removal::NotHere,
        "gone already"
    );
    read_to(&mut c, "10.0.0.2", 100);
    assert!(post(&mut c).is_empty());
    assert_eq!(stat(&c, "tx_no_connection"), 1);
}

/// A core of one lane hands out that lane's send slots and no others.
#[test]
fn a_core_uses_its_lanes_slots_only() {
    let mut c: EngineCore<Qp> = EngineCore::new(
        16..20,
        EngineConfig::default(),
        Arc::new(EngineStats::default()),
    );
    let mut taken: Vec<u32> = std::iter::from_fn(|| c.take_slot()).collect();
    taken.sort_unstable();
    assert_eq!(taken, [16, 17, 18, 19]);
    assert!(!c.can_read());
}

/// Housekeeping (its keepalives completed), and what it told: the totals in QP order.
fn totals_told(c: &mut EngineCore<Qp>) -> Vec<EngineEvent> {
    for (qpn, slot) in housekeeping(c) {
        done(c, qpn, slot, None);
    }
    let mut told = events(c);
    for e in &mut told {
        if let EngineEvent::Received(t) | EngineEvent::Keepalives(t) = e {
            t.sort_unstable();
        }
    }
    told
}

#[test]
fn housekeeping_reports_each_total_once_after_a_change_and_only_for_routed_qps() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    route(&mut c, "10.0.0.3", 8, 65520);
    events(&mut c);
    packet_in(&mut c, 7, 100);
    packet_in(&mut c, 7, 20);
    packet_in(&mut c, 8, 11);
    packet_in(&mut c, 9, 1000); // not routed: never reported
    keepalive_in(&mut c, 8);
    assert_eq!(
        totals_told(&mut c),
        [
            EngineEvent::Received(vec![(7, 120), (8, 11)]),
            EngineEvent::Keepalives(vec![(8, 1)]),
        ]
    );
    assert_eq!(totals_told(&mut c), [], "not again without a change");
    packet_in(&mut c, 8, 11);
    assert_eq!(
        totals_told(&mut c),
        [EngineEvent::Received(vec![(7, 120), (8, 22)])]
    );
    // A removed route's totals start again from nothing.
    c.remove_route(ip("10.0.0.3"), 8);
    c.handle_read_empty();
    route(&mut c, "10.0.0.3", 8, 65520);
    events(&mut c);
    packet_in(&mut c, 8, 50);
    keepalive_in(&mut c, 8);
    assert_eq!(
        totals_told(&mut c),
        [
            EngineEvent::Received(vec![(7, 120), (8, 50)]),
            EngineEvent::Keepalives(vec![(8, 1)]),
        ]
    );
}

#[test]
fn housekeeping_forgets_a_gone_connections_flow_once_its_sends_are_back() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    route(&mut c, "10.0.0.3", 8, 65520);
    let a = read_to(&mut c, "10.0.0.2", 100);
    read_to(&mut c, "10.0.0.3", 100);
    post(&mut c);
    housekeeping(&mut c);
    assert_eq!(stat(&c, "flows"), 2);
    c.remove_route(ip("10.0.0.2"), 7);
    c.handle_read_empty();
    housekeeping(&mut c);
    assert_eq!(stat(&c, "flows"), 2, "kept while its send is in flight");
    done(&mut c, 7, a, None);
    housekeeping(&mut c);
    assert_eq!(stat(&c, "flows"), 1);
}

#[test]
fn keepalives_go_to_idle_live_connections_with_room() {
    let mut c = core_with(1, 8, 2);
    for (n, qpn) in [(2, 7), (3, 8), (4, 9), (5, 10)] {
        route(&mut c, &format!("10.0.0.{n}"), qpn, 65520);
    }
    // 8 and 10 send; 7 and 9 are idle and get a keepalive, which is not a packet sent.
    let on8 = read_to(&mut c, "10.0.0.3", 100);
    read_to(&mut c, "10.0.0.5", 100);
    post(&mut c);
    let mut first = housekeeping(&mut c);
    first.sort_unstable();
    assert_eq!(first.iter().map(|k| k.0).collect::<Vec<_>>(), [7, 9]);
    assert_eq!(stat(&c, "keepalives_sent"), 2);
    assert_eq!(stat(&c, "tx_packets"), 2);
    for (qpn, slot) in first {
        done(&mut c, qpn, slot, None);
    }
    done(&mut c, 8, on8, None);
    // 9 dies; 8 sends again; 10's window is still full.
    failed_in(&mut c, 9, 10);
    let on8 = read_to(&mut c, "10.0.0.3", 100);
    post(&mut c);
    assert_eq!(
        housekeeping(&mut c).iter().map(|k| k.0).collect::<Vec<_>>(),
        [7]
    );
    // Its window full with the keepalive, 7 gets none next time; 8 does (idle now, its send
    // back).
    done(&mut c, 8, on8, None);
    assert_eq!(
        housekeeping(&mut c).iter().map(|k| k.0).collect::<Vec<_>>(),
        [8]
    );
    assert_eq!(stat(&c, "keepalives_sent"), 4);
}

#[test]
fn a_keepalive_the_qp_refuses_gives_its_slot_back_and_kills_the_connection() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    route(&mut c, "10.0.0.3", 8, 65520);
    events(&mut c);
    let mut tried = Vec::new();
    c.housekeeping(|qp, _| {
        tried.push(qp.0);
        if qp.0 == 7 { Err("refused") } else { Ok(()) }
    });
    tried.sort_unstable();
    assert_eq!(tried, [7, 8]);
    assert_eq!(stat(&c, "keepalives_sent"), 1);
    assert_eq!(
        free(&mut c),
        SLOTS as usize - 1,
        "the refused one's slot is back"
    );
    assert_eq!(
        events(&mut c),
        [EngineEvent::QpError {
            qpn: 7,
            status: None
        }]
    );
    read_to(&mut c, "10.0.0.2", 100);
    assert_eq!(stat(&c, "tx_no_connection"), 1);
}

#[test]
fn no_keepalive_goes_without_a_free_slot() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    let taken: Vec<u32> = std::iter::from_fn(|| c.take_slot()).collect();
    assert_eq!(taken.len(), SLOTS as usize);
    assert_eq!(housekeeping(&mut c), []);
    c.give_back(taken[0], None);
    assert_eq!(housekeeping(&mut c), [(7, taken[0])]);
}

#[test]
fn a_failed_receive_kills_its_connection_once_and_an_unrouted_qp_is_nobodys() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    events(&mut c);
    failed_in(&mut c, 9, 10);
    assert_eq!(events(&mut c), []);
    failed_in(&mut c, 7, 10);
    failed_in(&mut c, 7, 10);
    assert_eq!(
        events(&mut c),
        [EngineEvent::QpError {
            qpn: 7,
            status: Some(10)
        }]
    );
    let dead = read_to(&mut c, "10.0.0.2", 100);
    assert!(post(&mut c).is_empty());
    assert_eq!(stat(&c, "tx_no_connection"), 1);
    assert_eq!(unsent(&mut c), [(dead, 100)]);
    // A flow that already sent dies the same way.
    route(&mut c, "10.0.0.3", 8, 65520);
    let s = read_to(&mut c, "10.0.0.3", 100);
    post(&mut c);
    // Its window full (8, one sent before), three more wait.
    let read: Vec<u32> = (0..10).map(|_| read_to(&mut c, "10.0.0.3", 100)).collect();
    assert_eq!(post(&mut c).len(), 7);
    assert_eq!(stat(&c, "tx_window_waits"), 3);
    failed_in(&mut c, 8, 4);
    assert_eq!(
        stat(&c, "tx_backpressure"),
        3,
        "what waits is let go at once"
    );
    let offered: Vec<u32> = unsent(&mut c).into_iter().map(|(s, _)| s).collect();
    assert_eq!(offered, read[7..], "what waited is offered to UD, in order");
    assert_eq!(
        events(&mut c),
        [
            EngineEvent::RouteAdded {
                ip: ip("10.0.0.3"),
                qpn: 8
            },
            EngineEvent::QpError {
                qpn: 8,
                status: Some(4)
            }
        ]
    );
    done(&mut c, 8, s, None);
    assert!(post(&mut c).is_empty());
}

#[test]
fn each_receive_is_counted_once_and_its_buffer_kept_only_on_a_failing_ring() {
    let mut c = core_with(8, 8, 2);
    route(&mut c, "10.0.0.2", 7, 65520);
    events(&mut c);
    // Flushed: not an error, and no failure told; a ring's buffer stays off its QP.
    assert_eq!(
        receive(&mut c, 7, 0, Some(WC_FLUSHED), false),
        Receipt::Repost
    );
    assert_eq!(receive(&mut c, 7, 0, Some(WC_FLUSHED), true), Receipt::Keep);
    assert_eq!(events(&mut c), []);
    // A keepalive is a message no longer than the virtio-net header; one byte more is a packet.
    assert_eq!(
        receive(&mut c, 7, KEEPALIVE_LEN, None, true),
        Receipt::Repost
    );
    assert_eq!(
        receive(&mut c, 7, KEEPALIVE_LEN + 1, None, true),
        Receipt::Deliver
    );
    c.handle_delivered(7, 1500, false);
    c.handle_delivered(7, 1500, true);
    // A buffer nobody knows: counted, nothing told.
    let lost = |error| Completion {
        wr_id: 0,
        qp_num: 7,
        bytes: 0,
        recv: true,
        error,
    };
    c.handle_receive_lost(&lost(Some(WC_FLUSHED)));
    c.handle_receive_lost(&lost(Some(WC_FLUSHED)));
    c.handle_receive_lost(&lost(Some(10)));
    assert_eq!(events(&mut c), []);
    // In error on a ring: its QP's failure, told once; the buffer kept.
    assert_eq!(receive(&mut c, 7, 0, Some(10), true), Receipt::Keep);
    assert_eq!(
        nonzero(&c),
        [
            ("rx_packets", 1),
            ("rx_bytes", 1500),
            ("rx_errors", 2),
            ("rx_flushed", 4),
            ("rx_tun_errors", 1),
            ("keepalives_received", 1),
        ]
    );
    assert_eq!(
        events(&mut c),
        [EngineEvent::QpError {
            qpn: 7,
            status: Some(10)
        }]
    );
    assert_eq!(
        totals_told(&mut c),
        [
            EngineEvent::Received(vec![(7, 1500)]),
            EngineEvent::Keepalives(vec![(7, 1)]),
        ]
    );
}

#[test]
fn destination_of_v4_and_v6_packets() {
    let mut v4 = [0u8; 20];
    v4[0] = 0x45;
    v4[16..20].copy_from_slice(&[10, 98, 0, 2]);
    assert_eq!(destination(&v4), Some(ip("10.98.0.2")));
    let mut v6 = [0u8; 40];
    v6[0] = 0x60;
    v6[24..40].copy_from_slice(&"fd00::2".parse::<Ipv6Addr>().unwrap().octets());
    assert_eq!(destination(&v6), Some(ip("fd00::2")));
    assert_eq!(destination(&v4[..19]), None);
    assert_eq!(destination(&v6[..39]), None);
    assert_eq!(destination(&[0x50; 40]), None);
    assert_eq!(destination(&[]), None);
}

/// Slots and windows under any order of events: a seeded run of reads (to routed, unrouted
/// and multicast addresses), posts the QP takes whole or in part, completions (some in
/// error), housekeeping, routes moved (removed first or not) and receives failed. After every
/// step each send slot is in exactly one place (free, waiting, decided, or in flight on the
/// QP) and no QP has more sends in flight than its window; once everything in flight
/// completes, every slot is free again.
#[test]
fn every_slot_is_in_one_place_and_every_window_kept_whatever_happens() {
    for seed in 1..=200u64 {
        let mut run = Run::new(seed);
        for step in 0..300u32 {
            run.step(step);
            run.check(step);
        }
        run.finish();
    }
}

const DSTS: [&str; 5] = ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.9", "224.0.0.1"];
const WINDOW: u32 = 3;

/// One seeded run of [`every_slot_is_in_one_place_and_every_window_kept_whatever_happens`].
struct Run {
    c: EngineCore<Qp>,
    /// Sends on the QPs, as the QPs hold them: (QP, slot).
    in_flight: Vec<(u32, u32)>,
    rng: u64,
    seed: u64,
}

impl Run {
    fn new(seed: u64) -> Self {
        let mut c = core_with(WINDOW, 2, 4);
        for (i, d) in DSTS[..3].iter().enumerate() {
            route(&mut c, d, 7 + i as u32, 65520);
        }
        let rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let in_flight = Vec::new();
        Self {
            c,
            in_flight,
            rng,
            seed,
        }
    }

    /// xorshift64, below `n`: enough to vary the order; no crate for three lines.
    fn next(&mut self, n: u64) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % n
    }

    fn step(&mut self, step: u32) {
        match self.next(10) {
            0..=3 if self.c.can_read() => {
                let d = DSTS[self.next(DSTS.len() as u64) as usize];
                read_to(&mut self.c, d, 100);
            }
            4 => {
                let take_all = self.next(4) > 0;
                let in_flight = &mut self.in_flight;
                self.c.flush(|qp, chain| {
                    let n = if take_all {
                        chain.len()
                    } else {
                        chain.len() / 2
                    };
                    in_flight.extend(chain[..n].iter().map(|r| (qp.0, r.slot)));
                    (n, if n < chain.len() { Err("full") } else { Ok(()) })
                });
            }
            5 | 6 if !self.in_flight.is_empty() => {
                let i = self.next(self.in_flight.len() as u64) as usize;
                let (qpn, slot) = self.in_flight.remove(i);
                let error = (self.next(20) == 0).then_some(12);
                done(&mut self.c, qpn, slot, error);
            }
            7 => {
                if self.next(2) == 0 {
                    self.c.handle_read_empty();
                }
                let in_flight = &mut self.in_flight;
                self.c.housekeeping(|qp, slot| {
                    in_flight.push((qp.0, slot));
                    Ok::<(), String>(())
                });
            }
            8 => {
                // A route moves to a new QP (the old one is the control plane's to close).
                let d = DSTS[self.next(3) as usize];
                if self.next(2) == 0 {
                    let old = self.c.routes[&ip(d)].qp.0;
                    self.c.remove_route(ip(d), old);
                }
                route(&mut self.c, d, 100 + step, 65520);
            }
            9 if self.next(5) == 0 => {
                let d = DSTS[self.next(3) as usize];
                let qpn = self.c.routes[&ip(d)].qp.0;
                failed_in(&mut self.c, qpn, 10);
            }
            _ => {}
        }
        events(&mut self.c);
        released(&mut self.c);
        // The loop offers what was let go of to UD at the end of its turns; some steps here
        // leave it taken until a later one.
        if self.next(2) == 0 {
            unsent(&mut self.c);
        }
    }

    /// Every slot in one place; each QP's sends within its window, and counted by its flow.
    fn check(&self, step: u32) {
        let (c, seed) = (&self.c, self.seed);
        check_slots(c, &self.in_flight, seed, step);
        for (qpn, f) in &c.flows {
            let on_qp = self.in_flight.iter().filter(|(q, _)| q == qpn).count() as u32;
            assert!(
                on_qp <= WINDOW,
                "seed {seed} step {step}: QP {qpn} has {on_qp} in flight"
            );
            let decided = c.outbox.iter().filter(|(q, _)| q == qpn).count() as u32;
            assert_eq!(
                f.in_flight,
                on_qp + decided,
                "seed {seed} step {step}: QP {qpn}"
            );
        }
    }

    /// Everything posted, everything in flight completes, until nothing is left: every slot
    /// is free.
    fn finish(mut self) {
        loop {
            let in_flight = &mut self.in_flight;
            self.c.flush(|qp, chain| {
                in_flight.extend(chain.iter().map(|r| (qp.0, r.slot)));
                (chain.len(), Ok::<(), String>(()))
            });
            let Some((qpn, slot)) = self.in_flight.pop() else {
                break;
            };
            done(&mut self.c, qpn, slot, None);
        }
        check_slots(&self.c, &self.in_flight, self.seed, 300);
        let seed = self.seed;
        assert_eq!(
            free(&mut self.c),
            SLOTS as usize,
            "seed {seed}: every slot back"
        );
    }
}

/// Each slot in exactly one place: free, let go of unsent, waiting on a flow, decided, or on a
/// QP.
fn check_slots(c: &EngineCore<Qp>, in_flight: &[(u32, u32)], seed: u64, step: u32) {
    let mut all: Vec<u32> = c.free.clone();
    all.extend(c.unsent.iter().map(|(s, _)| *s));
    all.extend(
        c.flows
            .values()
            .flat_map(|f| f.waiting.iter().map(|(s, _, _)| *s)),
    );
    all.extend(c.outbox.iter().map(|(_, r)| r.slot));
    all.extend(in_flight.iter().map(|(_, s)| *s));
    all.sort_unstable();
    assert_eq!(
        all,
        (0..SLOTS).collect::<Vec<_>>(),
        "seed {seed} step {step}: slots lost or in two places"
    );
}
