//! The fast path proven in the running kernel: BPF_PROG_TEST_RUN on exact frames.
//!
//! Needs root (CI runs as root); see `load_or_skip`.

use ipoib_common::{
    IPOIB_FLAG_RC, PeerEntry, PeerKey, Policy, Reason, UD_MARK, global_mode, peer_mode, peer_pin,
};
use ipoib_ctl::{
    clock::{monotonic_coarse_ns, monotonic_ns},
    maps::PeerCacheCounts,
};
use ipoib_tests::*;

/// The CM device of the peers below: `lo`, which every namespace has (the fast path redirects
/// only into a device that exists; BPF_PROG_TEST_RUN runs the program in the caller's
/// namespace).
const CM_IFINDEX: u32 = 1;

/// Peers as a control plane would have written them.
fn install_peers(h: &mut Harness) {
    let peers: [(&str, u8, u8); 7] = [
        ("10.0.0.2", peer_mode::CM_UP, peer_pin::AUTO),
        ("10.0.0.3", peer_mode::UD, peer_pin::AUTO),
        ("10.0.0.4", peer_mode::CM_PENDING, peer_pin::AUTO),
        ("10.0.0.5", peer_mode::CM_UP, peer_pin::UD),
        ("10.0.0.6", peer_mode::UD, peer_pin::BLOCK),
        ("10.0.0.7", peer_mode::CM_UP, peer_pin::CM),
        ("fd00::2", peer_mode::CM_UP, peer_pin::AUTO),
    ];
    for (ip, mode, pin) in peers {
        let key = PeerKey::from(ip.parse::<std::net::IpAddr>().unwrap());
        let entry = PeerEntry {
            mode,
            pin,
            cm_ifindex: CM_IFINDEX,
            generation: 1,
            ..Default::default()
        };
        h.dp.maps.set_peer(key, entry).unwrap();
    }
    // A BLOCK pin is installed: the control plane raises the policy's flag with it.
    let p = h.policy();
    h.set_policy(Policy {
        any_blocked: 1,
        ..p
    });
}

fn harness(test: &str, link: Link) -> Option<Harness> {
    let dp = load_or_skip(test)?;
    let mut h = Harness::new(dp, link);
    install_peers(&mut h);
    Some(h)
}

/// Which per-peer path counter a case must bump.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    Cm,
    Ud,
    /// Not a unicast IP packet: no per-peer count.
    None,
}

struct Case {
    name: &'static str,
    frame: Vec<u8>,
    retval: u32,
    reason: Reason,
    rc_cleared: bool,
    peer: &'static str,
    path: Path,
}

fn case(
    name: &'static str,
    frame: Vec<u8>,
    reason: Reason,
    rc_cleared: bool,
    peer: &'static str,
    path: Path,
) -> Case {
    Case {
        name,
        frame,
        retval: if reason == Reason::TxCmRedirect {
            TC_ACT_REDIRECT
        } else {
            TC_ACT_OK
        },
        reason,
        rc_cleared,
        peer,
        path,
    }
}

/// Runs each case and checks: return value; output bytes (identical, or identical but for the
/// RC bit of byte 0); exactly one decision counted with the L3 bytes; the RC action counted iff
/// expected; the peer's counters bumped once on the right path.
fn check_cases(h: &mut Harness, cases: Vec<Case>) {
    for c in cases {
        let before = h.reasons();
        let peer_before = h.traffic(c.peer);
        let coarse_before = monotonic_coarse_ns();
        let out = h
            .egress(&c.frame)
            .unwrap_or_else(|e| panic!("{}: test_run failed: {e}", c.name));
        let coarse_after = monotonic_coarse_ns();
        let after = h.reasons();
        assert_eq!(out.retval, c.retval, "{}: return value", c.name);

        let mut expected = c.frame.clone();
        if c.rc_cleared {
            assert_ne!(
                c.frame[0] & IPOIB_FLAG_RC,
                0,
                "{}: case needs the RC flag",
                c.name
            );
            expected[0] &= !IPOIB_FLAG_RC;
        }
        assert_eq!(
            out.data_out.len(),
            c.frame.len(),
            "{}: length changed",
            c.name
        );
        assert!(out.data_out == expected, "{}: output bytes differ", c.name);

        let d = delta(&before, &after);
        let decisions: Vec<_> = d.iter().filter(|(r, _, _)| r.is_decision()).collect();
        assert_eq!(decisions.len(), 1, "{}: decisions counted: {d:?}", c.name);
        let (reason, packets, bytes) = *decisions[0];
        assert_eq!(reason, c.reason, "{}: reason", c.name);
        assert_eq!(packets, 1, "{}: counted once", c.name);
        let l3 = (c.frame.len() - h.link_l2_len()) as u64;
        if c.path != Path::None {
            assert_eq!(bytes, l3, "{}: L3 bytes counted", c.name);
        }
        let rc = d.iter().find(|(r, _, _)| *r == Reason::TxRcFlagCleared);
        assert_eq!(rc.is_some(), c.rc_cleared, "{}: RC action: {d:?}", c.name);

        let peer_after = h.traffic(c.peer);
        let (cm, ud) = (
            peer_after.tx_cm_packets - peer_before.tx_cm_packets,
            peer_after.tx_ud_packets - peer_before.tx_ud_packets,
        );
        match c.path {
            Path::Cm => {
                assert_eq!((cm, ud), (1, 0), "{}: peer path", c.name);
                assert_eq!(peer_after.tx_cm_bytes - peer_before.tx_cm_bytes, l3);
            }
            Path::Ud => {
                assert_eq!((cm, ud), (0, 1), "{}: peer path", c.name);
                assert_eq!(peer_after.tx_ud_bytes - peer_before.tx_ud_bytes, l3);
            }
            Path::None => assert_eq!((cm, ud), (0, 0), "{}: no peer count", c.name),
        }
        if c.path != Path::None {
            // CLOCK_MONOTONIC_COARSE as the program saw it: never ahead, and behind by at
            // most the tick its cache (`TickCache`) may have missed.
            let seen = peer_after.last_seen_ns;
            assert!(
                seen <= coarse_after && seen + 30_000_000 >= coarse_before,
                "{}: last_seen {seen} not the coarse clock, read as {coarse_before} before and \
                 {coarse_after} after",
                c.name
            );
        }
    }
}

trait L2Len {
    fn link_l2_len(&self) -> usize;
}

impl L2Len for Harness {
    fn link_l2_len(&self) -> usize {
        L2::unicast(self.link).len()
    }
}

const BIG: usize = 3000;
const SMALL: usize = 100;

#[test]
fn egress_decisions_ipoib() {
    let Some(mut h) = harness("egress_decisions_ipoib", Link::Ipoib) else {
        return;
    };
    let uc = L2::unicast(Link::Ipoib);
    let no_rc = L2::Ipoib {
        dst: ipoib_hwaddr(0x00, 0x48, unicast_gid(2)),
    };
    let udp_big = FrameSpec::tcp(uc, "10.0.0.1", "10.0.0.3", BIG)
        .with_l4(L4::Udp {
            sport: 1000,
            dport: 2000,
        })
        .build();
    let ping_big = FrameSpec::tcp(uc, "10.0.0.1", "10.0.0.2", BIG)
        .with_l4(L4::Icmp { ty: 8 })
        .build();
    let ctl = FrameSpec::tcp(uc, "10.0.0.1", "10.0.0.2", BIG)
        .with_l4(L4::Tcp {
            sport: 50000,
            dport: ipoib_common::DEFAULT_CTL_PORT,
        })
        .build();
    let na = FrameSpec::tcp(uc, "fd00::1", "fd00::2", 72)
        .with_l4(L4::Icmp { ty: 136 })
        .build();
    let ns_mc = FrameSpec::tcp(L2::multicast(Link::Ipoib), "fd00::1", "ff02::1:ff00:2", 72)
        .with_l4(L4::Icmp { ty: 135 })
        .build();
    let mut mc_rc = L2::multicast(Link::Ipoib);
    if let L2::Ipoib { dst } = &mut mc_rc {
        dst[0] = 0x80;
    }
    let threshold = ipoib_common::DEFAULT_CM_MIN_BYTES as usize;

    use Path::*;
    use Reason::*;
    let cases = vec![
        case(
            "v4 tcp big to CM_UP",
            tcp_to(uc, "10.0.0.2", BIG),
            TxCmRedirect,
            false,
            "10.0.0.2",
            Cm,
        ),
        case(
            "v4 at threshold",
            tcp_to(uc, "10.0.0.2", threshold),
            TxCmRedirect,
            false,
            "10.0.0.2",
            Cm,
        ),
        case(
            "v4 below threshold",
            tcp_to(uc, "10.0.0.2", threshold - 1),
            TxUdSmall,
            true,
            "10.0.0.2",
            Ud,
        ),
        case(
            "v4 tcp small to CM_UP",
            tcp_to(uc, "10.0.0.2", SMALL),
            TxUdSmall,
            true,
            "10.0.0.2",
            Ud,
        ),
        case(
            "v4 small, no RC flag",
            tcp_to(no_rc, "10.0.0.2", SMALL),
            TxUdSmall,
            false,
            "10.0.0.2",
            Ud,
        ),
        case(
            "v4 icmp big to CM_UP",
            ping_big,
            TxCmRedirect,
            false,
            "10.0.0.2",
            Cm,
        ),
        case(
            "v4 udp big to UD peer",
            udp_big,
            TxUdPeerNotUp,
            true,
            "10.0.0.3",
            Ud,
        ),
        case(
            "v4 big to CM_PENDING",
            tcp_to(uc, "10.0.0.4", BIG),
            TxUdPeerNotUp,
            true,
            "10.0.0.4",
            Ud,
        ),
        case(
            "v4 big to pinned UD",
            tcp_to(uc, "10.0.0.5", BIG),
            TxUdPinnedUd,
            true,
            "10.0.0.5",
            Ud,
        ),
        case(
            "v4 big to pinned CM",
            tcp_to(uc, "10.0.0.7", BIG),
            TxCmRedirect,
            false,
            "10.0.0.7",
            Cm,
        ),
        case(
            "v4 big to unknown",
            tcp_to(uc, "10.0.0.9", BIG),
            TxUdNoPeer,
            true,
            "10.0.0.9",
            Ud,
        ),
        case("handshake port", ctl, TxUdControl, true, "10.0.0.2", Ud),
        case(
            "multicast gid",
            tcp_to(L2::multicast(Link::Ipoib), "224.0.0.251", BIG),
            TxUdMulticast,
            false,
            "224.0.0.251",
            None,
        ),
        case(
            "multicast gid with RC bit",
            tcp_to(mc_rc, "224.0.0.251", BIG),
            TxUdMulticast,
            false,
            "224.0.0.251",
            None,
        ),
        case(
            "broadcast gid",
            tcp_to(L2::broadcast(Link::Ipoib), "10.0.0.255", BIG),
            TxUdMulticast,
            false,
            "10.0.0.255",
            None,
        ),
        case(
            "ip multicast on unicast gid",
            tcp_to(no_rc, "239.1.1.1", BIG),
            TxUdMulticast,
            false,
            "239.1.1.1",
            None,
        ),
        case(
            "arp request",
            arp_frame(L2::broadcast(Link::Ipoib)),
            TxUdArp,
            false,
            "10.0.0.2",
            None,
        ),
        case(
            "arp reply unicast",
            arp_frame(uc),
            TxUdArp,
            false,
            "10.0.0.2",
            None,
        ),
        case(
            "non-ip ethertype",
            non_ip_frame(uc, 0x88b5, 200),
            TxUdNonIp,
            false,
            "10.0.0.2",
            None,
        ),
        case(
            "v6 tcp big to CM_UP",
            tcp_to(uc, "fd00::2", BIG),
            TxCmRedirect,
            false,
            "fd00::2",
            Cm,
        ),
        case(
            "v6 tcp small",
            tcp_to(uc, "fd00::2", SMALL),
            TxUdSmall,
            true,
            "fd00::2",
            Ud,
        ),
        case(
            "v6 neighbor advert",
            na,
            TxUdNeighborDiscovery,
            true,
            "fd00::2",
            Ud,
        ),
        case(
            "v6 neighbor solicit mc",
            ns_mc,
            TxUdMulticast,
            false,
            "fd00::2",
            None,
        ),
    ];
    check_cases(&mut h, cases);
}

#[test]
fn egress_decisions_ethernet() {
    let Some(mut h) = harness("egress_decisions_ethernet", Link::Ether) else {
        return;
    };
    let uc = L2::unicast(Link::Ether);
    use Path::*;
    use Reason::*;
    let cases = vec![
        case(
            "v4 big to CM_UP",
            tcp_to(uc, "10.0.0.2", BIG),
            TxCmRedirect,
            false,
            "10.0.0.2",
            Cm,
        ),
        case(
            "v4 small",
            tcp_to(uc, "10.0.0.2", SMALL),
            TxUdSmall,
            false,
            "10.0.0.2",
            Ud,
        ),
        case(
            "v6 big to CM_UP",
            tcp_to(uc, "fd00::2", BIG),
            TxCmRedirect,
            false,
            "fd00::2",
            Cm,
        ),
        case(
            "multicast mac",
            tcp_to(L2::multicast(Link::Ether), "224.0.0.251", BIG),
            TxUdMulticast,
            false,
            "224.0.0.251",
            None,
        ),
        case(
            "broadcast mac",
            tcp_to(L2::broadcast(Link::Ether), "10.0.0.255", BIG),
            TxUdMulticast,
            false,
            "10.0.0.255",
            None,
        ),
        case(
            "arp",
            arp_frame(L2::broadcast(Link::Ether)),
            TxUdArp,
            false,
            "10.0.0.2",
            None,
        ),
        case(
            "vlan tag is not ip",
            non_ip_frame(uc, 0x8100, 100),
            TxUdNonIp,
            false,
            "10.0.0.2",
            None,
        ),
    ];
    check_cases(&mut h, cases);
}

/// Malformed headers pass untouched as UD, counted as malformed.
#[test]
fn egress_malformed_headers() {
    let Some(mut h) = harness("egress_malformed_headers", Link::Ipoib) else {
        return;
    };
    let uc = L2::unicast(Link::Ipoib);
    let good = tcp_to(uc, "10.0.0.2", BIG);
    let mut bad_version = good.clone();
    bad_version[24] = 0x55;
    let mut bad_ihl = good.clone();
    bad_ihl[24] = 0x44;
    let mut bad_doff = good.clone();
    bad_doff[24 + 20 + 12] = 0x40;
    let mut v6_bad_version = tcp_to(uc, "fd00::2", BIG);
    v6_bad_version[24] = 0x40;
    let cases = vec![
        case(
            "ip version 5",
            bad_version,
            Reason::TxUdMalformed,
            false,
            "10.0.0.2",
            Path::None,
        ),
        case(
            "ihl 4",
            bad_ihl,
            Reason::TxUdMalformed,
            false,
            "10.0.0.2",
            Path::None,
        ),
        case(
            "tcp doff 4",
            bad_doff,
            Reason::TxUdMalformed,
            false,
            "10.0.0.2",
            Path::None,
        ),
        case(
            "v6 version 4",
            v6_bad_version,
            Reason::TxUdMalformed,
            false,
            "fd00::2",
            Path::None,
        ),
    ];
    check_cases(&mut h, cases);
}

/// Later IPv4 fragments carry no L4 header and are classified by size alone.
#[test]
fn egress_ipv4_fragment() {
    let Some(mut h) = harness("egress_ipv4_fragment", Link::Ipoib) else {
        return;
    };
    let mut frag = tcp_to(L2::unicast(Link::Ipoib), "10.0.0.2", BIG);
    frag[24 + 6] = 0x00;
    frag[24 + 7] = 0xb9; // offset 185 * 8
    let cases = vec![case(
        "later fragment",
        frag,
        Reason::TxCmRedirect,
        false,
        "10.0.0.2",
        Path::Cm,
    )];
    check_cases(&mut h, cases);
}

#[test]
fn egress_policy_modes() {
    let Some(mut h) = harness("egress_policy_modes", Link::Ipoib) else {
        return;
    };
    let uc = L2::unicast(Link::Ipoib);
    let big = || tcp_to(uc, "10.0.0.2", BIG);
    let small = || tcp_to(uc, "10.0.0.2", SMALL);

    // datagram: nothing redirected, kernel CM forbidden.
    let base = Policy::new(ipoib_common::ARPHRD_INFINIBAND);
    h.set_policy(Policy {
        mode: global_mode::DATAGRAM,
        ..base
    });
    check_cases(
        &mut h,
        vec![case(
            "datagram big",
            big(),
            Reason::TxUdDatagramMode,
            true,
            "10.0.0.2",
            Path::Ud,
        )],
    );

    // connected: the fast path behaves as auto (promotion is the control plane's business).
    h.set_policy(Policy {
        mode: global_mode::CONNECTED,
        ..base
    });
    check_cases(
        &mut h,
        vec![
            case(
                "connected big",
                big(),
                Reason::TxCmRedirect,
                false,
                "10.0.0.2",
                Path::Cm,
            ),
            case(
                "connected small",
                small(),
                Reason::TxUdSmall,
                true,
                "10.0.0.2",
                Path::Ud,
            ),
        ],
    );

    // kernel_cm allowed: UD packets keep the RC flag, except for a peer pinned to UD.
    h.set_policy(Policy {
        kernel_cm: 1,
        ..base
    });
    check_cases(
        &mut h,
        vec![
            case(
                "kernel cm small",
                small(),
                Reason::TxUdSmall,
                false,
                "10.0.0.2",
                Path::Ud,
            ),
            case(
                "kernel cm pinned ud",
                tcp_to(uc, "10.0.0.5", BIG),
                Reason::TxUdPinnedUd,
                true,
                "10.0.0.5",
                Path::Ud,
            ),
        ],
    );

    // A higher threshold moves a packet from CM to UD.
    h.set_policy(Policy {
        cm_min_bytes: BIG as u32 + 1,
        ..base
    });
    check_cases(
        &mut h,
        vec![case(
            "threshold raised",
            big(),
            Reason::TxUdSmall,
            true,
            "10.0.0.2",
            Path::Ud,
        )],
    );

    // A zero link type means "not configured": untouched, counted.
    h.set_policy(Policy {
        link_type: 0,
        ..base
    });
    check_cases(
        &mut h,
        vec![case(
            "unconfigured",
            big(),
            Reason::TxUdNoPolicy,
            false,
            "10.0.0.2",
            Path::None,
        )],
    );
    h.set_policy(Policy {
        link_type: 999,
        ..base
    });
    check_cases(
        &mut h,
        vec![case(
            "unknown link type",
            big(),
            Reason::TxUdNoPolicy,
            false,
            "10.0.0.2",
            Path::None,
        )],
    );
}

/// The fail-safe: a stale (or never written) heartbeat sends everything UD.
/// A peer whose CM device is gone (its control loop died with its TUN device) goes UD at once,
/// though its entry still says CM_UP and the heartbeat is fresh; with the device there again
/// (a new loop wrote its new ifindex), CM.
#[test]
fn egress_to_a_gone_cm_device_goes_ud() {
    let Some(mut h) = harness("egress_to_a_gone_cm_device_goes_ud", Link::Ipoib) else {
        return;
    };
    // No namespace has this many devices: ifindexes are handed out in increasing order.
    const GONE: u32 = 0x7fff_fff0;
    let key = PeerKey::from("10.0.0.2".parse::<std::net::IpAddr>().unwrap());
    let entry = h.dp.maps.peer(&key).unwrap().expect("installed");
    let big = || tcp_to(L2::unicast(Link::Ipoib), "10.0.0.2", BIG);
    for (kernel_cm, rc_cleared) in [(0, true), (1, false)] {
        h.set_policy(Policy {
            kernel_cm,
            ..h.policy()
        });
        h.dp.maps
            .set_peer(
                key,
                PeerEntry {
                    cm_ifindex: GONE,
                    ..entry
                },
            )
            .unwrap();
        check_cases(
            &mut h,
            vec![case(
                "device gone",
                big(),
                Reason::TxUdCmDeviceGone,
                rc_cleared,
                "10.0.0.2",
                Path::Ud,
            )],
        );
        h.dp.maps.set_peer(key, entry).unwrap();
        check_cases(
            &mut h,
            vec![case(
                "device back",
                big(),
                Reason::TxCmRedirect,
                false,
                "10.0.0.2",
                Path::Cm,
            )],
        );
    }
}

/// The device check is asked of the kernel once per tick on each CPU (`TickCache`): a CM
/// device that dies (a TUN device, as the control loop's is, closed) is redirected to for at
/// most the rest of that tick, and is left UD once jiffies have moved.
#[test]
fn a_cm_device_that_dies_is_left_within_a_tick() {
    let Some((mut h, key, entry)) = pinned_harness("a_cm_device_that_dies_is_left_within_a_tick")
    else {
        return;
    };
    let tun = ipoib_ctl::tun::Tun::create("ipoibtick%d", false).expect("a TUN device");
    let name = std::ffi::CString::new(tun.name()).unwrap();
    // SAFETY: a valid C string.
    let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
    assert_ne!(ifindex, 0, "{}: no ifindex", tun.name());
    h.dp.maps
        .set_peer(
            key,
            PeerEntry {
                cm_ifindex: ifindex,
                ..entry
            },
        )
        .unwrap();
    let cm = Reason::TxCmRedirect;
    // Twice: the second is answered from the cache (within this tick, mostly).
    check_cases(
        &mut h,
        vec![
            big_to_2("the TUN device alive", cm),
            big_to_2("still alive", cm),
        ],
    );
    drop(tun);
    // Ticks are 1 to 10 ms (HZ 1000 to 100).
    std::thread::sleep(std::time::Duration::from_millis(30));
    check_cases(
        &mut h,
        vec![big_to_2("the TUN device closed", Reason::TxUdCmDeviceGone)],
    );
}

/// A harness with a fresh heartbeat and the thread pinned to the CPU it runs on (the caches are
/// per CPU: each run meets what the one before it left), with 10.0.0.2's key and entry.
fn pinned_harness(test: &str) -> Option<(Harness, PeerKey, PeerEntry)> {
    let mut h = harness(test, Link::Ipoib)?;
    h.beat();
    pin_to_this_cpu();
    let key = PeerKey::from("10.0.0.2".parse::<std::net::IpAddr>().unwrap());
    let entry = h.dp.maps.peer(&key).unwrap().expect("installed");
    Some((h, key, entry))
}

/// A big packet to 10.0.0.2 that must meet `reason`: redirected to CM, or sent UD with the RC
/// flag cleared (kernel CM is forbidden by default).
fn big_to_2(name: &'static str, reason: Reason) -> Case {
    let frame = tcp_to(L2::unicast(Link::Ipoib), "10.0.0.2", BIG);
    if reason == Reason::TxCmRedirect {
        case(name, frame, reason, false, "10.0.0.2", Path::Cm)
    } else {
        case(name, frame, reason, true, "10.0.0.2", Path::Ud)
    }
}

/// What the CM engine hands back to UD (a packet it read and cannot send over the peer's
/// connection, sent again by a socket with [`UD_MARK`]) goes UD as it is, to a peer on CM too,
/// and is no decision of the fast path's; with the kernel's CM forbidden its RC flag is
/// cleared. The same packet with another mark, or none, is redirected.
#[test]
fn a_packet_the_engine_hands_back_goes_ud() {
    let Some((mut h, _, _)) = pinned_harness("a_packet_the_engine_hands_back_goes_ud") else {
        return;
    };
    let frame = tcp_to(L2::unicast(Link::Ipoib), "10.0.0.2", BIG);
    assert_ne!(frame[0] & IPOIB_FLAG_RC, 0, "the case needs the RC flag");
    for mark in [0, UD_MARK + 1] {
        let out = h.egress_marked(&frame, mark).unwrap();
        assert_eq!(out.retval, TC_ACT_REDIRECT, "mark {mark:#x}");
    }
    let before = (h.reasons(), h.traffic("10.0.0.2"));
    let out = h.egress_marked(&frame, UD_MARK).unwrap();
    let after = (h.reasons(), h.traffic("10.0.0.2"));
    assert_eq!(out.retval, TC_ACT_OK);
    let mut expected = frame.clone();
    expected[0] &= !IPOIB_FLAG_RC;
    assert!(out.data_out == expected, "only the RC flag cleared");
    // By kind and packets: with a context given, the run's skb length is the frame's own.
    let counted: Vec<_> = delta(&before.0, &after.0)
        .into_iter()
        .map(|(r, packets, _)| (r, packets))
        .collect();
    assert_eq!(
        counted,
        [(Reason::TxRcFlagCleared, 1)],
        "no decision counted"
    );
    assert_eq!(
        before.1, after.1,
        "the peer's traffic counted once, when redirected"
    );
}

/// Sends `from`'s packet through ingress and returns the verdict.
fn ingress_verdict(h: &mut Harness, from: &str) -> u32 {
    let frame = as_ingress(
        &FrameSpec::tcp(L2::unicast(Link::Ipoib), from, "10.0.0.1", BIG).build(),
        Link::Ipoib,
    );
    h.ingress(&frame).unwrap().retval
}

/// The programs keep the peers map's answers in a per-CPU cache (`PeerCacheSlot`) that holds
/// while the heartbeat is unchanged; every write through `DatapathMaps` changes it
/// (`peers_stamp`). So each write takes effect with the next packet on a CPU whose cache holds
/// the peer: a mode, a pin, a removal, a return, a block on ingress.
#[test]
fn a_peer_write_takes_effect_with_the_next_packet() {
    let Some((mut h, key, entry)) =
        pinned_harness("a_peer_write_takes_effect_with_the_next_packet")
    else {
        return;
    };
    let cm = Reason::TxCmRedirect;
    check_cases(
        &mut h,
        vec![big_to_2("up", cm), big_to_2("up, from the cache", cm)],
    );
    let writes: [(&str, Option<PeerEntry>, Reason); 4] = [
        (
            "mode UD",
            Some(PeerEntry {
                mode: peer_mode::UD,
                ..entry
            }),
            Reason::TxUdPeerNotUp,
        ),
        (
            "pinned UD",
            Some(PeerEntry {
                pin: peer_pin::UD,
                ..entry
            }),
            Reason::TxUdPinnedUd,
        ),
        ("removed", None, Reason::TxUdNoPeer),
        ("back", Some(entry), Reason::TxCmRedirect),
    ];
    for (name, write, reason) in writes {
        match write {
            Some(e) => h.dp.maps.set_peer(key, e).unwrap(),
            None => h.dp.maps.remove_peer(&key).unwrap(),
        }
        // Twice: the lookup that fills the slot, then the slot (an absent entry too).
        check_cases(
            &mut h,
            vec![
                big_to_2(name, reason),
                big_to_2("and again, from the cache", reason),
            ],
        );
    }
    // Ingress, from the same cache: a block pin drops the next packet, its removal passes it.
    assert_eq!(ingress_verdict(&mut h, "10.0.0.2"), XDP_PASS);
    assert_eq!(ingress_verdict(&mut h, "10.0.0.2"), XDP_PASS);
    h.dp.maps
        .set_peer(
            key,
            PeerEntry {
                pin: peer_pin::BLOCK,
                ..entry
            },
        )
        .unwrap();
    assert_eq!(ingress_verdict(&mut h, "10.0.0.2"), XDP_DROP, "blocked");
    h.dp.maps.set_peer(key, entry).unwrap();
    assert_eq!(ingress_verdict(&mut h, "10.0.0.2"), XDP_PASS, "unblocked");
    // A beat (a new time, the stamp back to 0) changes the heartbeat too: the next packet
    // reads the map again, and finds the peer up.
    h.beat();
    check_cases(&mut h, vec![big_to_2("after a beat", cm)]);
}

/// The cache counts what it answers (`PeerCacheSlot::hits`, `misses_stale`, `misses_other`),
/// and `peer_cache_of` sums it as `status` and the metrics show it: a hit for each packet whose
/// peer the slot held under the current heartbeat, a stale miss after a beat or a write to the
/// peers map, another's miss for an empty slot or when two peers that share a slot take turns.
/// Ingress asks the same cache.
#[test]
fn the_peer_cache_counts_its_hits_and_each_kind_of_miss() {
    let Some((mut h, key, entry)) =
        pinned_harness("the_peer_cache_counts_its_hits_and_each_kind_of_miss")
    else {
        return;
    };
    let counts = |h: &mut Harness| {
        h.dp.peer_cache()
            .unwrap()
            .expect("this build's programs count their cache")
    };
    let send = |h: &mut Harness, to: &str| {
        h.egress(&tcp_to(L2::unicast(Link::Ipoib), to, BIG))
            .unwrap();
    };
    // (hits, stale, other) since the last look.
    let mut last = counts(&mut h);
    assert_eq!(last, PeerCacheCounts::default(), "a fresh load counted");
    let mut since = |h: &mut Harness| {
        let now = counts(h);
        let d = (
            now.hits - last.hits,
            now.misses_stale - last.misses_stale,
            now.misses_other - last.misses_other,
        );
        last = now;
        d
    };

    for _ in 0..4 {
        send(&mut h, "10.0.0.2");
    }
    assert_eq!(since(&mut h), (3, 0, 1), "an empty slot, then three hits");
    h.beat();
    send(&mut h, "10.0.0.2");
    send(&mut h, "10.0.0.2");
    assert_eq!(since(&mut h), (1, 1, 0), "after a beat");
    h.dp.maps.set_peer(key, entry).unwrap();
    send(&mut h, "10.0.0.2");
    assert_eq!(since(&mut h), (0, 1, 0), "after a write to the peers map");
    assert_eq!(ingress_verdict(&mut h, "10.0.0.2"), XDP_PASS);
    assert_eq!(ingress_verdict(&mut h, "10.0.0.2"), XDP_PASS);
    assert_eq!(since(&mut h), (2, 0, 0), "ingress, from the same slot");

    // Two peers (no entries: the cache holds "absent" too) in one slot, taking turns: each
    // packet evicts the other; a third in a slot of its own hits from its second packet.
    let [a, b, c] = cache_slot_neighbours();
    for to in [&a, &b, &a, &b] {
        send(&mut h, to);
    }
    assert_eq!(since(&mut h), (0, 0, 4), "two peers in one slot");
    send(&mut h, &c);
    send(&mut h, &c);
    assert_eq!(since(&mut h), (1, 0, 1), "a peer in a slot of its own");

    let slots: std::collections::HashSet<u32> = ["10.0.0.2", &b, &c]
        .iter()
        .map(|ip| PeerKey::from(ip.parse::<std::net::IpAddr>().unwrap()).cache_slot())
        .collect();
    assert_eq!(counts(&mut h).slots_filled, slots.len() as u64, "{slots:?}");
}

/// The fast path as the build before the cache's counts made it (layout 2, 56-byte slots:
/// `tests/fixtures/ipoib-ebpf-layout2-uncounted.o`), which an `attach` of this version adopts
/// as it finds it pinned: its cache is found but said to be uncounted (`status` shows "not
/// counted"), neither misread as counted slots nor an error.
#[test]
fn an_earlier_builds_uncounted_cache_is_told_apart() {
    const UNCOUNTED: &[u8] = include_bytes!("../fixtures/ipoib-ebpf-layout2-uncounted.o");
    let test = "an_earlier_builds_uncounted_cache_is_told_apart";
    let mut dp = match ipoib_ctl::datapath::Datapath::load_object(UNCOUNTED, None) {
        Ok(dp) => dp,
        Err(e) => return bpf_unavailable(test, &format!("loading the fixture failed: {e}")),
    };
    assert_eq!(dp.peer_cache().unwrap(), None);
    // This build's, beside it: counted.
    let Some(mut dp) = load_or_skip(test) else {
        return;
    };
    assert_eq!(dp.peer_cache().unwrap(), Some(PeerCacheCounts::default()));
}

/// A write to the peers map that leaves the heartbeat alone (what a control plane of an
/// earlier version of layout 2 does: it knows nothing of the cache) is heard at its next beat,
/// which changes the heartbeat: the cache lags a beat at most. In between, the cached answer
/// stands (shown here, so that the cache's use is seen, not assumed).
#[test]
fn a_write_that_leaves_the_heartbeat_alone_is_heard_at_the_next_beat() {
    let Some((mut h, key, entry)) =
        pinned_harness("a_write_that_leaves_the_heartbeat_alone_is_heard_at_the_next_beat")
    else {
        return;
    };
    check_cases(&mut h, vec![big_to_2("up", Reason::TxCmRedirect)]);
    let hb = h.dp.maps.heartbeat().unwrap();
    h.dp.maps
        .peers
        .insert(
            key,
            PeerEntry {
                mode: peer_mode::UD,
                ..entry
            },
            0,
        )
        .unwrap();
    assert_eq!(h.dp.maps.heartbeat().unwrap(), hb, "a raw write");
    check_cases(
        &mut h,
        vec![big_to_2(
            "the cached entry, until the next beat",
            Reason::TxCmRedirect,
        )],
    );
    h.beat();
    check_cases(
        &mut h,
        vec![big_to_2("heard at the beat", Reason::TxUdPeerNotUp)],
    );
}

/// Two peers whose keys share a cache slot each get their own entry, however their packets
/// alternate (each evicts the other), on egress and ingress.
#[test]
fn peers_that_share_a_cache_slot_keep_their_own_entries() {
    let Some(mut h) = harness(
        "peers_that_share_a_cache_slot_keep_their_own_entries",
        Link::Ipoib,
    ) else {
        return;
    };
    let [a, b, _] = cache_slot_neighbours();
    let key_of = |a: &str| PeerKey::from(a.parse::<std::net::IpAddr>().unwrap());
    let up = PeerEntry {
        mode: peer_mode::CM_UP,
        cm_ifindex: CM_IFINDEX,
        generation: 1,
        ..Default::default()
    };
    let blocked_ud = PeerEntry {
        mode: peer_mode::UD,
        pin: peer_pin::BLOCK,
        ..up
    };
    h.dp.maps.set_peer(key_of(&a), up).unwrap();
    h.dp.maps.set_peer(key_of(&b), blocked_ud).unwrap();
    h.beat();
    pin_to_this_cpu();
    let (a, b): (&'static str, &'static str) = (a.leak(), b.leak());
    for round in 0..3 {
        check_cases(
            &mut h,
            vec![
                case(
                    "CM_UP peer",
                    tcp_to(L2::unicast(Link::Ipoib), a, BIG),
                    Reason::TxCmRedirect,
                    false,
                    a,
                    Path::Cm,
                ),
                case(
                    "UD peer in the same slot",
                    tcp_to(L2::unicast(Link::Ipoib), b, BIG),
                    Reason::TxUdPeerNotUp,
                    true,
                    b,
                    Path::Ud,
                ),
            ],
        );
        assert_eq!(ingress_verdict(&mut h, a), XDP_PASS, "round {round}: {a}");
        assert_eq!(ingress_verdict(&mut h, b), XDP_DROP, "round {round}: {b}");
    }
}

#[test]
fn egress_heartbeat_deadline() {
    let Some(mut h) = harness("egress_heartbeat_deadline", Link::Ipoib) else {
        return;
    };
    let big = || tcp_to(L2::unicast(Link::Ipoib), "10.0.0.2", BIG);
    let timeout = h.policy().heartbeat_timeout_ns;
    let now = monotonic_ns();

    h.beat_at(now - timeout - 1_000_000_000);
    check_cases(
        &mut h,
        vec![case(
            "stale",
            big(),
            Reason::TxUdHeartbeatStale,
            true,
            "10.0.0.2",
            Path::Ud,
        )],
    );
    h.beat_at(0);
    check_cases(
        &mut h,
        vec![case(
            "never written",
            big(),
            Reason::TxUdHeartbeatStale,
            true,
            "10.0.0.2",
            Path::Ud,
        )],
    );
    // Just inside the deadline: still CM.
    h.beat_at(monotonic_ns() - timeout / 2);
    check_cases(
        &mut h,
        vec![case(
            "fresh",
            big(),
            Reason::TxCmRedirect,
            false,
            "10.0.0.2",
            Path::Cm,
        )],
    );
    // A short deadline expires under our eyes.
    h.set_policy(Policy {
        heartbeat_timeout_ns: 50_000_000,
        ..h.policy()
    });
    h.beat();
    std::thread::sleep(std::time::Duration::from_millis(120));
    check_cases(
        &mut h,
        vec![case(
            "expired",
            big(),
            Reason::TxUdHeartbeatStale,
            true,
            "10.0.0.2",
            Path::Ud,
        )],
    );
}

/// A receive hook as the tests run it: XDP (verdicts `XDP_*`) or its TC twin (`TC_ACT_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Hook {
    Xdp,
    Tc,
}

impl Hook {
    fn run(self, h: &mut Harness, frame: &[u8]) -> Result<Outcome, aya::programs::ProgramError> {
        match self {
            Hook::Xdp => h.ingress(frame),
            Hook::Tc => h.ingress_tc(frame),
        }
    }

    /// The hook's verdict for an XDP one.
    fn verdict(self, xdp: u32) -> u32 {
        match (self, xdp) {
            (Hook::Xdp, v) => v,
            (Hook::Tc, XDP_PASS) => TC_ACT_OK,
            (Hook::Tc, XDP_DROP) => TC_ACT_SHOT,
            (Hook::Tc, v) => panic!("no TC verdict for XDP's {v}"),
        }
    }
}

#[test]
fn ingress_counts_and_blocks() {
    for hook in [Hook::Xdp, Hook::Tc] {
        ingress_counts_and_blocks_at(hook);
    }
}

fn ingress_counts_and_blocks_at(hook: Hook) {
    let Some(mut h) = harness("ingress_counts_and_blocks", Link::Ipoib) else {
        return;
    };
    let uc = L2::unicast(Link::Ipoib);
    let from = |src: &str, len| {
        let dst = if src.contains(':') {
            "fd00::1"
        } else {
            "10.0.0.1"
        };
        as_ingress(&FrameSpec::tcp(uc, src, dst, len).build(), Link::Ipoib)
    };
    type IngressCase = (&'static str, Vec<u8>, u32, Reason, Option<&'static str>);
    let cases: Vec<IngressCase> = vec![
        (
            "v4 from peer",
            from("10.0.0.2", BIG),
            XDP_PASS,
            Reason::RxPeer,
            Some("10.0.0.2"),
        ),
        (
            "v4 from unknown",
            from("10.0.0.9", SMALL),
            XDP_PASS,
            Reason::RxPeer,
            Some("10.0.0.9"),
        ),
        (
            "v6 from peer",
            from("fd00::2", BIG),
            XDP_PASS,
            Reason::RxPeer,
            Some("fd00::2"),
        ),
        (
            "from blocked",
            from("10.0.0.6", BIG),
            XDP_DROP,
            Reason::RxDropBlocked,
            Some("10.0.0.6"),
        ),
        (
            // Its TCP header cut by the fragmenting: still the blocked peer's (the kernel
            // would reassemble it), not a malformed frame to pass.
            "first fragment from blocked",
            {
                let mut f = from("10.0.0.6", BIG);
                f.truncate(24 + 20 + 8);
                f[24 + 2..24 + 4].copy_from_slice(&28u16.to_be_bytes());
                f[24 + 6..24 + 8].copy_from_slice(&0x2000u16.to_be_bytes());
                f
            },
            XDP_DROP,
            Reason::RxDropBlocked,
            Some("10.0.0.6"),
        ),
        (
            "arp",
            as_ingress(&arp_frame(uc), Link::Ipoib),
            XDP_PASS,
            Reason::RxNonIp,
            None,
        ),
        (
            "truncated ip",
            from("10.0.0.2", BIG)[..30].to_vec(),
            XDP_PASS,
            Reason::RxMalformed,
            None,
        ),
    ];
    for (name, frame, retval, reason, peer) in cases {
        let name = format!("{hook:?}: {name}");
        let before = h.reasons();
        let t_before = peer.map(|p| h.traffic(p));
        let out = hook
            .run(&mut h, &frame)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(out.retval, hook.verdict(retval), "{name}: verdict");
        assert!(
            out.data_out == frame,
            "{name}: ingress must never write the packet"
        );
        let d = delta(&before, &h.reasons());
        assert_eq!(d.len(), 1, "{name}: counted once: {d:?}");
        assert_eq!((d[0].0, d[0].1), (reason, 1), "{name}: reason");
        if let (Some(p), Some(tb)) = (peer, t_before) {
            assert!(h.traffic(p).last_seen_ns > 0, "{name}: last_seen");
            let ta = h.traffic(p);
            let l3 = (frame.len() - 24) as u64;
            if reason == Reason::RxDropBlocked {
                assert_eq!(ta.rx_dropped - tb.rx_dropped, 1, "{name}");
                assert_eq!(ta.rx_packets, tb.rx_packets, "{name}");
            } else {
                assert_eq!(ta.rx_packets - tb.rx_packets, 1, "{name}");
                assert_eq!(ta.rx_bytes - tb.rx_bytes, l3, "{name}");
            }
        }
    }
}

/// The block is gated by the policy's `any_blocked` flag, which spares the peers lookup on
/// every received packet when nobody is blocked.
#[test]
fn ingress_block_needs_the_policy_flag() {
    let Some(mut h) = harness("ingress_block_needs_the_policy_flag", Link::Ipoib) else {
        return;
    };
    assert_eq!(ingress_verdict(&mut h, "10.0.0.6"), XDP_DROP);
    let p = h.policy();
    h.set_policy(Policy {
        any_blocked: 0,
        ..p
    });
    assert_eq!(ingress_verdict(&mut h, "10.0.0.6"), XDP_PASS);
}

/// Every truncation of valid frames, from 0 bytes to the end of the L4 header: below it the
/// frame is malformed and passes untouched; at it, the full frame's decision holds. The kernel
/// itself refuses test input shorter than an Ethernet header (EINVAL), which we record.
#[test]
fn truncations_never_misbehave() {
    for link in [Link::Ipoib, Link::Ether] {
        let Some(mut h) = harness("truncations_never_misbehave", link) else {
            return;
        };
        let uc = L2::unicast(link);
        let specs = vec![
            FrameSpec::tcp(uc, "10.0.0.1", "10.0.0.2", BIG),
            FrameSpec::tcp(uc, "10.0.0.1", "10.0.0.2", BIG).with_l4(L4::Udp { sport: 1, dport: 2 }),
            FrameSpec::tcp(uc, "fd00::1", "fd00::2", BIG),
            FrameSpec::tcp(uc, "fd00::1", "fd00::2", 72).with_l4(L4::Icmp { ty: 136 }),
        ];
        let (mut refused_egress, mut refused_ingress) = (0, 0);
        for spec in specs {
            let frame = spec.build();
            let end = spec.l4_end();
            for len in 0..=end {
                let cut = &frame[..len];
                let before = h.reasons();
                match h.egress(cut) {
                    Err(e) => {
                        assert!(
                            test_run_refuses_skb(cut),
                            "{link:?} len {len}: test_run failed: {e}"
                        );
                        refused_egress += 1;
                    }
                    Ok(out) => {
                        let d = delta(&before, &h.reasons());
                        let decisions: Vec<_> =
                            d.iter().filter(|(r, _, _)| r.is_decision()).collect();
                        assert_eq!(decisions.len(), 1, "{link:?} len {len}: {d:?}");
                        if len < end {
                            assert_eq!(out.retval, TC_ACT_OK, "{link:?} len {len}");
                            assert_eq!(decisions[0].0, Reason::TxUdMalformed, "{link:?} len {len}");
                            assert!(out.data_out == cut, "{link:?} len {len}: modified");
                        } else {
                            assert_ne!(decisions[0].0, Reason::TxUdMalformed, "{link:?} len {len}");
                        }
                    }
                }
                // Ingress sees the same truncations, as the driver delivers them.
                let ing = as_ingress(cut, link);
                let before = h.reasons();
                match h.ingress(&ing) {
                    Err(e) => {
                        assert!(
                            test_run_refuses_xdp(&ing),
                            "{link:?} ingress len {len}: {e}"
                        );
                        refused_ingress += 1;
                    }
                    Ok(out) => {
                        assert_eq!(out.retval, XDP_PASS, "{link:?} ingress len {len}");
                        assert!(out.data_out == ing, "{link:?} ingress len {len}: modified");
                        let d = delta(&before, &h.reasons());
                        assert_eq!(d.len(), 1, "{link:?} ingress len {len}: {d:?}");
                        if len < end {
                            assert_eq!(d[0].0, Reason::RxMalformed, "{link:?} ingress len {len}");
                        } else {
                            assert_eq!(d[0].0, Reason::RxPeer, "{link:?} ingress len {len}");
                        }
                    }
                }
            }
        }
        eprintln!(
            "{link:?}: test_run refused {refused_egress} egress and {refused_ingress} ingress \
             inputs (too short for its Ethernet view); every other length ran"
        );
    }
}

fn kernel_log_alarms() -> Option<usize> {
    let out = std::process::Command::new("dmesg").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Some(
        text.lines()
            .filter(|l| l.contains("WARNING:") || l.contains("BUG:") || l.contains("Oops"))
            .count(),
    )
}

/// Thousands of seeded random frames, half pure noise, half valid frames with random bytes
/// flipped and random lengths: never a verdict but pass/redirect (egress) or pass (ingress,
/// no blocked peer involved), never a write but the RC bit, one decision per packet, and no
/// kernel warning.
#[test]
fn random_frames_are_safe() {
    const N: usize = 3000;
    let alarms_before = kernel_log_alarms();
    for link in [Link::Ipoib, Link::Ether] {
        let Some(mut h) = harness("random_frames_are_safe", link) else {
            return;
        };
        // No blocked peer: ingress must then always pass.
        let blocked = PeerKey::from("10.0.0.6".parse::<std::net::IpAddr>().unwrap());
        h.dp.maps.remove_peer(&blocked).unwrap();
        let mut rng = Rng::new(0x1b0b_2026 + link as u64);
        let templates = [
            tcp_to(L2::unicast(link), "10.0.0.2", BIG),
            tcp_to(L2::unicast(link), "fd00::2", 400),
            arp_frame(L2::broadcast(link)),
        ];
        let before = h.reasons();
        let (mut egress_runs, mut ingress_runs, mut refused) = (0u64, 0u64, 0u64);
        for i in 0..N {
            let mut frame: Vec<u8> = if i % 2 == 0 {
                let len = 14 + rng.below(300) as usize;
                (0..len).map(|_| rng.next_u64() as u8).collect::<Vec<u8>>()
            } else {
                let t = &templates[rng.below(templates.len() as u64) as usize];
                let mut f = t.clone();
                for _ in 0..=rng.below(4) {
                    let at = rng.below(f.len().min(120) as u64) as usize;
                    f[at] = rng.next_u64() as u8;
                }
                let len = 14 + rng.below((f.len() - 14) as u64 + 1) as usize;
                f.truncate(len);
                f
            };
            if frame.len() < 14 {
                frame.resize(14, 0);
            }
            if test_run_refuses_skb(&frame) {
                refused += 1;
            } else {
                let out = h
                    .egress(&frame)
                    .unwrap_or_else(|e| panic!("frame {i} {frame:02x?}: egress test_run: {e}"));
                egress_runs += 1;
                assert!(
                    out.retval == TC_ACT_OK || out.retval == TC_ACT_REDIRECT,
                    "frame {i}: egress verdict {}",
                    out.retval
                );
                assert_eq!(out.data_out.len(), frame.len());
                assert!(
                    out.data_out[1..] == frame[1..],
                    "frame {i}: egress wrote the packet"
                );
                assert!(
                    out.data_out[0] == frame[0] || out.data_out[0] == frame[0] & !IPOIB_FLAG_RC,
                    "frame {i}: egress changed byte 0 beyond the RC bit"
                );
            }
            let ing = h.ingress(&frame).expect("ingress test_run");
            ingress_runs += 1;
            assert_eq!(ing.retval, XDP_PASS, "frame {i}: ingress verdict");
            assert!(ing.data_out == frame, "frame {i}: ingress wrote the packet");
        }
        let d = delta(&before, &h.reasons());
        let egress_decisions: u64 = d
            .iter()
            .filter(|(r, _, _)| r.is_decision() && r.is_egress())
            .map(|(_, p, _)| p)
            .sum();
        let ingress_decisions: u64 = d
            .iter()
            .filter(|(r, _, _)| !r.is_egress())
            .map(|(_, p, _)| p)
            .sum();
        assert_eq!(
            egress_decisions, egress_runs,
            "{link:?}: one egress decision per packet"
        );
        assert_eq!(
            ingress_decisions, ingress_runs,
            "{link:?}: one ingress decision per packet"
        );
        assert!(
            refused < N as u64 / 10,
            "{link:?}: too few frames ran: {refused} refused"
        );
        eprintln!("{link:?}: {N} random frames ({refused} refused by test_run): {d:?}");
    }
    match (alarms_before, kernel_log_alarms()) {
        (Some(b), Some(a)) => assert_eq!(a, b, "the kernel logged new warnings"),
        _ => loud_skip(
            "random_frames_are_safe (kernel warning check)",
            "dmesg unreadable here",
        ),
    }
}

/// The TC twin of ingress (IPoIB's hook) decides as the XDP program does: on random and
/// mangled frames of both links, from a peer, an unknown source and a blocked one, each
/// frame gets the same verdict at both hooks, neither writes it, and both count the same
/// reasons, packets and bytes.
#[test]
fn tc_ingress_decides_as_xdp_ingress_does() {
    const N: usize = 1500;
    for link in [Link::Ipoib, Link::Ether] {
        let Some(mut h) = harness("tc_ingress_decides_as_xdp_ingress_does", link) else {
            return;
        };
        let mut rng = Rng::new(0x7c1d_2026 + link as u64);
        let from = |src: &str, dst: &str, len| {
            as_ingress(
                &FrameSpec::tcp(L2::unicast(link), src, dst, len).build(),
                link,
            )
        };
        let templates = [
            from("10.0.0.2", "10.0.0.1", BIG),
            from("fd00::2", "fd00::1", 400),
            from("10.0.0.6", "10.0.0.1", BIG),
            from("10.0.0.9", "10.0.0.1", SMALL),
            as_ingress(&arp_frame(L2::broadcast(link)), link),
        ];
        let mut frames = Vec::new();
        while frames.len() < N {
            let t = &templates[rng.below(templates.len() as u64) as usize];
            let mut f = t.clone();
            // A third of the frames whole; the rest with bytes flipped in the headers and cut.
            if rng.below(3) != 0 {
                for _ in 0..=rng.below(4) {
                    let at = rng.below(f.len().min(120) as u64) as usize;
                    f[at] = rng.next_u64() as u8;
                }
                f.truncate(14 + rng.below((f.len() - 14) as u64 + 1) as usize);
            }
            if !test_run_refuses_skb(&f) {
                frames.push(f);
            }
        }
        let mut deltas = Vec::new();
        let mut verdicts = Vec::new();
        for hook in [Hook::Xdp, Hook::Tc] {
            let before = h.reasons();
            let mut seen = Vec::with_capacity(N);
            for (i, f) in frames.iter().enumerate() {
                let out = hook
                    .run(&mut h, f)
                    .unwrap_or_else(|e| panic!("{link:?} {hook:?} frame {i}: {e}"));
                assert!(out.data_out == *f, "{link:?} {hook:?} frame {i}: written");
                seen.push(out.retval);
            }
            deltas.push(delta(&before, &h.reasons()));
            verdicts.push(seen);
        }
        for (i, (x, t)) in verdicts[0].iter().zip(&verdicts[1]).enumerate() {
            assert_eq!(
                Hook::Tc.verdict(*x),
                *t,
                "{link:?} frame {i}: {:02x?}",
                frames[i]
            );
        }
        assert_eq!(deltas[0], deltas[1], "{link:?}: what each hook counted");
        let drops = verdicts[0].iter().filter(|v| **v == XDP_DROP).count();
        eprintln!(
            "{link:?}: {N} frames, {drops} dropped at both hooks: {:?}",
            deltas[0]
        );
        // The frames reached every kind of decision, the block among them.
        let reasons: Vec<Reason> = deltas[0].iter().map(|d| d.0).collect();
        for r in [
            Reason::RxPeer,
            Reason::RxDropBlocked,
            Reason::RxNonIp,
            Reason::RxMalformed,
        ] {
            assert!(
                reasons.contains(&r),
                "{link:?}: no frame gave {r:?}: {reasons:?}"
            );
        }
    }
}

/// Per-peer traffic at a slot named in the peer's entry (one hash lookup per packet), and
/// counted apart while a peer has no slot: the control plane's `assign_slots` moves a peer
/// from one to the other with its counts, in both directions of traffic; a slot lost to
/// another writer comes back; a slot named twice is kept by one entry; idle UD entries are
/// taken back, others kept; with every slot taken a new peer waits, counted apart.
#[test]
fn traffic_moves_from_counted_apart_to_a_slot() {
    let Some(mut h) = harness("traffic_moves_from_counted_apart_to_a_slot", Link::Ipoib) else {
        return;
    };
    let uc = L2::unicast(Link::Ipoib);
    let key = |ip: &str| PeerKey::from(ip.parse::<std::net::IpAddr>().unwrap());
    let apart = |h: &Harness, ip: &str| h.dp.maps.unknown.get(&key(ip), 0).is_ok();
    let slot = |h: &Harness, ip: &str| h.dp.maps.peer(&key(ip)).unwrap().map(|e| e.traffic_slot);
    let send = |h: &mut Harness, ip: &str, n: usize| {
        for _ in 0..n {
            h.egress(&tcp_to(uc, ip, SMALL)).unwrap();
        }
    };
    let (now, never) = (monotonic_ns(), u64::MAX);

    // An entry without a slot, and an address with no entry: both counted apart.
    send(&mut h, "10.0.0.3", 3);
    send(&mut h, "10.0.0.99", 2);
    assert!(apart(&h, "10.0.0.3") && apart(&h, "10.0.0.99"));
    assert_eq!(slot(&h, "10.0.0.3"), Some(0));
    assert_eq!(slot(&h, "10.0.0.99"), None);
    assert_eq!(h.traffic("10.0.0.3").tx_ud_packets, 3);

    let r = h.dp.maps.assign_slots(now, never).unwrap();
    assert_eq!((r.assigned, r.waiting, r.reclaimed), (2, 0, 0), "{r:?}");
    let s3 = slot(&h, "10.0.0.3").unwrap();
    let s99 = slot(&h, "10.0.0.99").unwrap();
    assert!(s3 != 0 && s99 != 0 && s3 != s99, "{s3} {s99}");
    assert!(!apart(&h, "10.0.0.3") && !apart(&h, "10.0.0.99"));
    // The new entry is the control plane's default: UD, the policy decides.
    let e99 = h.dp.maps.peer(&key("10.0.0.99")).unwrap().unwrap();
    assert_eq!((e99.mode, e99.pin), (peer_mode::UD, peer_pin::AUTO));
    // Counts carried, then counted at the slot.
    assert_eq!(h.traffic("10.0.0.3").tx_ud_packets, 3);
    send(&mut h, "10.0.0.3", 2);
    assert_eq!(h.traffic("10.0.0.3").tx_ud_packets, 5);
    assert!(!apart(&h, "10.0.0.3"), "counted apart despite its slot");
    let before = h.traffic("10.0.0.3");
    h.ingress(&as_ingress(
        &FrameSpec::tcp(uc, "10.0.0.3", "10.0.0.1", BIG).build(),
        Link::Ipoib,
    ))
    .unwrap();
    let after = h.traffic("10.0.0.3");
    assert_eq!(after.rx_packets - before.rx_packets, 1);
    assert!(!apart(&h, "10.0.0.3"));

    // Another writer rewrote the entry without its slot: counted apart again, then a slot
    // (the old one is free again: no entry names it) with only what came since.
    let e3 = h.dp.maps.peer(&key("10.0.0.3")).unwrap().unwrap();
    h.dp.maps
        .set_peer(
            key("10.0.0.3"),
            PeerEntry {
                traffic_slot: 0,
                ..e3
            },
        )
        .unwrap();
    send(&mut h, "10.0.0.3", 1);
    assert!(apart(&h, "10.0.0.3"));
    h.dp.maps.assign_slots(now, never).unwrap();
    assert_ne!(slot(&h, "10.0.0.3"), Some(0));
    assert_eq!(
        h.traffic("10.0.0.3").tx_ud_packets,
        1,
        "stale counts in a reused slot"
    );

    // One slot named by two entries: one keeps it.
    let e2 = h.dp.maps.peer(&key("10.0.0.2")).unwrap().unwrap();
    let shared = slot(&h, "10.0.0.99").unwrap();
    h.dp.maps
        .set_peer(
            key("10.0.0.2"),
            PeerEntry {
                traffic_slot: shared,
                ..e2
            },
        )
        .unwrap();
    h.dp.maps.assign_slots(now, never).unwrap();
    let named: Vec<u32> =
        h.dp.maps
            .peers()
            .unwrap()
            .iter()
            .map(|(_, e)| e.traffic_slot)
            .filter(|s| *s == shared)
            .collect();
    assert_eq!(named, [shared], "slot {shared} named twice");

    // Idle past the limit: UD unpinned entries go (their slots with them), the rest stay.
    let r = h.dp.maps.assign_slots(now + 1_000_000_000_000, 1).unwrap();
    let left: Vec<(String, u8, u8)> =
        h.dp.maps
            .peers()
            .unwrap()
            .iter()
            .filter(|(_, e)| e.traffic_slot != 0)
            .map(|(k, e)| (k.ip().unwrap().to_string(), e.mode, e.pin))
            .collect();
    assert!(r.reclaimed >= 2, "{r:?}");
    assert!(
        left.iter()
            .all(|(_, m, p)| *m != peer_mode::UD || *p != peer_pin::AUTO),
        "{left:?}"
    );
    assert_eq!(slot(&h, "10.0.0.3"), None, "an idle UD peer kept its entry");
    assert!(
        h.dp.maps.peer(&key("10.0.0.6")).unwrap().is_some(),
        "a BLOCK pin was taken back"
    );

    // Every slot taken: a new peer waits, counted apart, and is said to.
    let full = ipoib_common::MAX_TRAFFIC_PEERS;
    for i in 1..full {
        let k = PeerKey::v4([10, 200 + (i >> 16) as u8, (i >> 8) as u8, i as u8]);
        h.dp.maps
            .set_peer(
                k,
                PeerEntry {
                    traffic_slot: i,
                    pin: peer_pin::CM,
                    ..Default::default()
                },
            )
            .unwrap();
    }
    send(&mut h, "10.0.0.77", 1);
    let r = h.dp.maps.assign_slots(now, never).unwrap();
    assert_eq!((r.assigned, r.waiting), (0, 1), "{r:?}");
    assert!(apart(&h, "10.0.0.77"));
    assert_eq!(h.traffic("10.0.0.77").tx_ud_packets, 1);
}

/// A bpffs directory of this process's own (bpffs mounted first where nothing is, as
/// `attach` does: the VM boots without it), its pins and itself removed on drop.
struct PinDir(std::path::PathBuf);

impl PinDir {
    fn new(test: &str) -> Result<Self, String> {
        ipoib_ctl::attach::ensure_bpffs().map_err(|e| e.to_string())?;
        let dir =
            std::path::PathBuf::from(format!("/sys/fs/bpf/ipoib-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        Ok(Self(dir))
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(&self.0) {
            for e in entries.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// `ipoib-ctl status` reads the maps from another process while the control loop writes
/// them: a peer the loop moves from counted apart to a slot of its own meanwhile (the entry
/// with the slot, then the unknown map's entry removed) is in one map or the other at every
/// read, so status never loses a peer the fast path has seen. The loop's side runs here,
/// status's side in a thread with maps of its own opened from the pins.
#[test]
fn a_peer_given_its_slot_while_status_reads_is_never_missing() {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, AtomicU8, AtomicU32, Ordering::SeqCst},
    };
    let test = "a_peer_given_its_slot_while_status_reads_is_never_missing";
    let pins = match PinDir::new("slotrace") {
        Ok(p) => p,
        Err(e) => return bpf_unavailable(test, &format!("no bpffs directory: {e}")),
    };
    let Some(dp) = load_pinned_or_skip(test, Some(&pins.0)) else {
        return;
    };
    let mut h = Harness::new(dp, Link::Ipoib);
    install_peers(&mut h);
    let reader_maps = ipoib_ctl::maps::DatapathMaps::from_pins(&pins.0).unwrap();
    const ROUNDS: u8 = 40;
    const PER_ROUND: u8 = 20;
    let addr = |r: u8, i: u8| format!("10.9.{r}.{i}");
    // `seen`: rounds whose peers the fast path has seen (each peer is in one map or the other
    // from then on); `started`: reads status began.
    let (seen, started, done) = (
        Arc::new(AtomicU8::new(0)),
        Arc::new(AtomicU32::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let reader = {
        let (seen, started, done) = (seen.clone(), started.clone(), done.clone());
        std::thread::spawn(move || {
            let mut missing = Vec::new();
            while !done.load(SeqCst) {
                started.fetch_add(1, SeqCst);
                let rounds = seen.load(SeqCst);
                let views = ipoib_ctl::status::peers(&reader_maps).unwrap();
                let have: std::collections::HashSet<&str> =
                    views.iter().map(|v| v.addr.as_str()).collect();
                missing.extend(
                    (0..rounds)
                        .flat_map(|r| (1..=PER_ROUND).map(move |i| addr(r, i)))
                        .filter(|a| !have.contains(a.as_str())),
                );
            }
            missing
        })
    };
    let (now, never) = (monotonic_ns(), u64::MAX);
    let mut assigned = 0;
    for r in 0..ROUNDS {
        for i in 1..=PER_ROUND {
            h.egress(&tcp_to(L2::unicast(Link::Ipoib), &addr(r, i), SMALL))
                .unwrap();
        }
        seen.store(r + 1, SeqCst);
        // The loop moves these peers while status reads: once a read that knows of them has
        // begun (however slow the machine), and a moment into it.
        let before = started.load(SeqCst);
        let t = std::time::Instant::now();
        while started.load(SeqCst) == before {
            assert!(
                t.elapsed() < std::time::Duration::from_secs(30) && !reader.is_finished(),
                "status stopped reading"
            );
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
        assigned += h.dp.maps.assign_slots(now, never).unwrap().assigned;
    }
    done.store(true, SeqCst);
    let reads = started.load(SeqCst);
    let missing = reader.join().unwrap();
    eprintln!(
        "{assigned} peers given slots over {ROUNDS} rounds; status read {reads} times, \
         missed {} peer(s)",
        missing.len()
    );
    assert_eq!(assigned, usize::from(ROUNDS) * usize::from(PER_ROUND));
    assert!(missing.is_empty(), "status missed peers: {missing:?}");
}
