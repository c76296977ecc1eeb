//! The core driven as the manager drives it: events and a clock in, commands out.

use super::*;
use crate::promotion::Config;

const SEC: u64 = 1_000_000_000;

fn ip(last: u8) -> IpAddr {
    IpAddr::from([10, 0, 0, last])
}

/// A core with a plan of `max` connections, the default policy otherwise, an SRQ of 256.
fn core(max: usize) -> Core {
    let cfg = Config {
        max_connections: max,
        ..Config::default()
    };
    let mut c = Core::new(Promoter::new(cfg, Mode::Auto), 256);
    assert_eq!(drain(&mut c), [Command::SetSetupLimit(max)]);
    c
}

/// The peer UD in the map, then its route gone (and the connection closed when `close`).
fn demoted(ip: IpAddr, qpn: u32, close: bool) -> [Command; 2] {
    [
        Command::SetPeerMode(ip, PeerMode::Ud),
        Command::RemoveRoute { ip, qpn, close },
    ]
}

fn drain(c: &mut Core) -> Vec<Command> {
    std::iter::from_fn(|| c.next_command()).collect()
}

/// A peer that sent `mb` MiB in 64 KiB packets by `t` seconds (cumulative, as the fast path
/// counts).
fn bulk(peer: IpAddr, t: u64, mb: u64) -> (IpAddr, Traffic) {
    let bytes = (t * mb) << 20;
    (
        peer,
        Traffic {
            tx_packets: bytes / 65536,
            tx_bytes: bytes,
            tx_cm_bytes: 0,
        },
    )
}

fn tick(c: &mut Core, t: u64, max: usize, traffic: Vec<(IpAddr, Traffic)>) -> Vec<Command> {
    c.handle_tick(
        t * SEC,
        TickInput {
            mode: Some(Mode::Auto),
            max_connections: max,
            traffic,
            srq_posted: 256,
            ..TickInput::default()
        },
    );
    drain(c)
}

/// Ticks with bulk traffic from `peer` until the core asks to connect it; the time then.
fn promote(c: &mut Core, peer: IpAddr, max: usize) -> u64 {
    for t in 1..10 {
        let cmds = tick(c, t, max, vec![bulk(peer, t, 50)]);
        if cmds.contains(&Command::Connect(peer)) {
            // Pending in the map before the setup starts.
            assert_eq!(
                cmds,
                [
                    Command::SetPeerMode(peer, PeerMode::CmPending),
                    Command::Connect(peer)
                ]
            );
            return t;
        }
        assert!(cmds.is_empty(), "{cmds:?}");
    }
    panic!("{peer} was never promoted");
}

/// Promotes `peer` and brings its connection `qpn` up, route first, then CM_UP.
fn up(c: &mut Core, peer: IpAddr, qpn: u32, max: usize) -> u64 {
    let t = promote(c, peer, max);
    c.handle_established(t * SEC, peer, qpn);
    assert_eq!(drain(c), [Command::AddRoute { ip: peer, qpn }]);
    c.handle_route_added(peer, qpn);
    assert_eq!(drain(c), [Command::SetPeerMode(peer, PeerMode::CmUp)]);
    t
}

#[test]
fn a_bulk_peer_is_connected_and_redirected_only_once_the_engine_has_its_route() {
    let mut c = core(4);
    let t = promote(&mut c, ip(2), 4);
    c.handle_established(t * SEC, ip(2), 77);
    assert_eq!(drain(&mut c), [Command::AddRoute { ip: ip(2), qpn: 77 }]);
    // A route-added for another QP (an older connection) redirects nothing.
    c.handle_route_added(ip(2), 76);
    assert_eq!(drain(&mut c), []);
    c.handle_route_added(ip(2), 77);
    assert_eq!(drain(&mut c), [Command::SetPeerMode(ip(2), PeerMode::CmUp)]);
    assert_eq!(c.connections(), 1);
    assert_eq!(c.peers(0)[0].state, CmPeerState::Cm);
}

#[test]
fn small_packets_are_never_promoted() {
    let mut c = core(4);
    for t in 1..20 {
        let small = Traffic {
            tx_packets: t * 100_000,
            tx_bytes: t * 100_000 * 100,
            tx_cm_bytes: 0,
        };
        assert_eq!(tick(&mut c, t, 4, vec![(ip(3), small)]), []);
    }
    assert_eq!(c.connections(), 0);
}

#[test]
fn a_second_connection_of_a_connected_peer_is_discarded() {
    let mut c = core(4);
    let t = up(&mut c, ip(2), 77, 4);
    c.handle_established(t * SEC, ip(2), 78);
    assert_eq!(drain(&mut c), [Command::Discard { ip: ip(2), qpn: 78 }]);
    assert_eq!(c.connections(), 1);
}

#[test]
fn a_peer_made_connection_past_the_plan_is_discarded() {
    let mut c = core(1);
    let t = up(&mut c, ip(2), 77, 1);
    c.handle_established(t * SEC, ip(3), 90);
    assert_eq!(drain(&mut c), [Command::Discard { ip: ip(3), qpn: 90 }]);
    assert_eq!(c.connections(), 1);
}

#[test]
fn a_peer_made_connection_within_the_plan_is_kept() {
    let mut c = core(2);
    c.handle_established(SEC, ip(3), 90);
    assert_eq!(drain(&mut c), [Command::AddRoute { ip: ip(3), qpn: 90 }]);
    assert_eq!(c.connections(), 1);
}

#[test]
fn a_qp_error_sends_the_peer_ud_before_the_route_goes_and_backs_off() {
    let mut c = core(4);
    let t = up(&mut c, ip(2), 77, 4);
    // Another QP's error is none of this peer's business.
    c.handle_qp_error(t * SEC, 12345, "status 12");
    assert_eq!(drain(&mut c), []);
    c.handle_qp_error(t * SEC, 77, "status 12");
    assert_eq!(drain(&mut c), demoted(ip(2), 77, true));
    assert_eq!(c.connections(), 0);
    assert_eq!(c.peers(0)[0].state, CmPeerState::Backoff);
    // Still bulk, but in backoff: no setup at the next tick.
    assert_eq!(tick(&mut c, t, 4, vec![bulk(ip(2), t, 60)]), []);
    // The watcher then reports the connection closed: given up already, nothing to undo.
    c.handle_closed((t + 1) * SEC, ip(2), 77);
    assert_eq!(drain(&mut c), []);
    assert_eq!(c.peers(0)[0].state, CmPeerState::Backoff);
}

#[test]
fn a_failed_setup_is_ud_with_backoff_unless_the_peers_connection_is_up() {
    let mut c = core(4);
    let t = promote(&mut c, ip(2), 4);
    c.handle_setup_failed(t * SEC, ip(2), Failure::Timeout);
    assert_eq!(drain(&mut c), [Command::SetPeerMode(ip(2), PeerMode::Ud)]);
    assert_eq!(c.peers(0)[0].state, CmPeerState::Backoff);
    // Status says what failed and how long ago, as of when it is asked.
    let last = LastFailure {
        why: Failure::Timeout,
        ago: std::time::Duration::from_secs(3),
    };
    assert_eq!(c.peers((t + 3) * SEC)[0].last_failure, Some(last));

    // Crossing: the peer's connection came up first; our setup's end changes nothing.
    let mut c = core(4);
    let t = promote(&mut c, ip(2), 4);
    c.handle_established(t * SEC, ip(2), 77);
    drain(&mut c);
    c.handle_setup_failed(t * SEC, ip(2), Failure::Rejected);
    assert_eq!(drain(&mut c), []);
    assert_eq!(c.connections(), 1);
}

#[test]
fn a_gone_connection_of_a_peer_with_a_newer_one_is_closed_and_changes_nothing_else() {
    let mut c = core(4);
    let t = up(&mut c, ip(2), 77, 4);
    c.handle_gone(t * SEC, ip(2), 70, Gone::Closed);
    let close = Command::RemoveRoute {
        ip: ip(2),
        qpn: 70,
        close: true,
    };
    assert_eq!(drain(&mut c), [close]);
    c.handle_closed(t * SEC, ip(2), 70);
    assert_eq!(drain(&mut c), []);
    assert_eq!(c.connections(), 1);
    assert_eq!(c.peers(0)[0].state, CmPeerState::Cm);
}

#[test]
fn a_gone_peer_goes_ud_before_its_connection_is_closed() {
    // A silent peer is a failure (backoff); a peer that closed its end is not.
    for (gone, state) in [
        (Gone::Silent, CmPeerState::Backoff),
        (Gone::Closed, CmPeerState::Ud),
    ] {
        let mut c = core(4);
        let t = up(&mut c, ip(2), 77, 4);
        c.handle_gone(t * SEC, ip(2), 77, gone);
        // Not closed yet: the engine sends what it holds first, then closes it.
        assert_eq!(drain(&mut c), demoted(ip(2), 77, true), "{gone:?}");
        assert_eq!(c.connections(), 0, "{gone:?}");
        assert_eq!(c.peers(0)[0].state, state, "{gone:?}");
        // Its close, when it comes, changes nothing more.
        c.handle_closed((t + 1) * SEC, ip(2), 77);
        assert_eq!(drain(&mut c), [], "{gone:?}");
        assert_eq!(c.peers(0)[0].state, state, "{gone:?}");
    }
}

/// Datagram mode sheds the connection to 10.0.0.2 (up, QP 77); the core, its commands taken.
fn shedding() -> (Core, u64) {
    let mut c = core(4);
    let t = up(&mut c, ip(2), 77, 4);
    c.handle_tick(
        (t + 1) * SEC,
        TickInput {
            mode: Some(Mode::Datagram),
            max_connections: 4,
            srq_posted: 256,
            ..TickInput::default()
        },
    );
    assert_eq!(drain(&mut c), demoted(ip(2), 77, true));
    (c, t + 2)
}

#[test]
fn a_connection_let_go_already_is_closed_when_its_peer_is_gone_and_nothing_else_changes() {
    // Being shed: the shed goes on, whichever way the peer went.
    for gone in [Gone::Silent, Gone::Closed] {
        let (mut c, t) = shedding();
        c.handle_gone(t * SEC, ip(2), 77, gone);
        let close = Command::RemoveRoute {
            ip: ip(2),
            qpn: 77,
            close: true,
        };
        assert_eq!(drain(&mut c), [close], "{gone:?}");
        assert_eq!(c.peers(0)[0].state, CmPeerState::Closing, "{gone:?}");
    }
    // Given up on a QP error: one failure, not two.
    let mut c = core(4);
    let t = up(&mut c, ip(2), 77, 4);
    c.handle_qp_error(t * SEC, 77, "status 12");
    drain(&mut c);
    c.handle_gone(t * SEC, ip(2), 77, Gone::Silent);
    assert_eq!(c.peers(0)[0].failures, 1);
    assert_eq!(c.peers(0)[0].state, CmPeerState::Backoff);
}

#[test]
fn a_shed_connection_is_ud_once_closed() {
    let (mut c, t) = shedding();
    assert_eq!(c.peers(0)[0].state, CmPeerState::Closing);
    c.handle_closed(t * SEC, ip(2), 77);
    assert_eq!(drain(&mut c), demoted(ip(2), 77, false));
    assert_eq!(c.peers(0)[0].state, CmPeerState::Ud);
}

#[test]
fn congestion_sends_a_live_peer_ud_until_it_drains() {
    let mut c = core(4);
    up(&mut c, ip(2), 77, 4);
    c.handle_congested(ip(2));
    assert_eq!(drain(&mut c), [Command::SetPeerMode(ip(2), PeerMode::Ud)]);
    c.handle_drained(ip(2));
    assert_eq!(drain(&mut c), [Command::SetPeerMode(ip(2), PeerMode::CmUp)]);
    // A peer without a connection is left alone.
    c.handle_congested(ip(9));
    c.handle_drained(ip(9));
    assert_eq!(drain(&mut c), []);
}

#[test]
fn datagram_mode_takes_every_connection_down() {
    // `shedding` asserts the connection's demotion.
    let (c, _) = shedding();
    assert_eq!(c.mode(), Mode::Datagram);
}

#[test]
fn a_lowered_cap_refuses_setups_and_sheds_connections() {
    let mut c = core(2);
    assert_eq!(c.max_connections(), 2);
    let t = up(&mut c, ip(2), 77, 2);
    c.handle_established(t * SEC, ip(3), 90);
    assert_eq!(drain(&mut c), [Command::AddRoute { ip: ip(3), qpn: 90 }]);
    // Both idle past the hold: lowering the cap to 1 sheds one, after the limit is set.
    let later = t + 20;
    let cmds = tick(&mut c, later, 1, vec![]);
    assert_eq!(cmds[0], Command::SetSetupLimit(1));
    let removed: Vec<_> = cmds
        .iter()
        .filter(|c| matches!(c, Command::RemoveRoute { close: true, .. }))
        .collect();
    assert_eq!(removed.len(), 1, "{cmds:?}");
    assert_eq!(c.connections(), 1);
    assert_eq!(c.max_connections(), 1);
}

#[test]
fn bytes_received_keep_a_connection_from_being_reaped() {
    let idle = Config::default().idle_after.as_secs();
    // The peer is in the fast path's table, but we send it nothing new.
    let quiet = |t: u64| {
        let last = bulk(ip(2), t, 50).1;
        vec![(ip(2), last)]
    };
    // Received every second: kept past idle_after.
    let mut c = core(4);
    let t = up(&mut c, ip(2), 77, 4);
    for s in 1..=idle + 5 {
        c.handle_received(&[(77, s * 1_000_000)]);
        let cmds = tick(&mut c, t + s, 4, quiet(t));
        assert!(cmds.is_empty(), "at {s} s: {cmds:?}");
    }
    assert_eq!(c.connections(), 1);
    // Totals for a QP that is no connection of ours count for nobody.
    c.handle_received(&[(999, 1 << 30)]);
    // Nothing received: reaped once idle_after has passed.
    let mut c = core(4);
    let t = up(&mut c, ip(2), 77, 4);
    let reaped = (1..=idle + 5).find(|s| {
        tick(&mut c, t + s, 4, quiet(t)).contains(&Command::SetPeerMode(ip(2), PeerMode::Ud))
    });
    assert!(reaped.is_some_and(|s| s >= idle - 1), "{reaped:?}");
}

#[test]
fn the_srq_limit_is_counted_and_armed_again_once_refilled() {
    let mut c = core(4);
    c.handle_srq_limit();
    assert_eq!(c.srq_low_events(), 1);
    c.handle_srq_limit();
    assert_eq!(c.srq_low_events(), 2, "each event counted");
    let low = TickInput {
        mode: Some(Mode::Auto),
        max_connections: 4,
        srq_posted: 64,
        ..TickInput::default()
    };
    c.handle_tick(SEC, low.clone());
    assert_eq!(
        drain(&mut c),
        [],
        "not armed while a quarter or fewer are posted"
    );
    c.handle_tick(
        2 * SEC,
        TickInput {
            srq_posted: 65,
            ..low.clone()
        },
    );
    assert_eq!(drain(&mut c), [Command::ArmSrqLimit(64)]);
    c.handle_tick(
        3 * SEC,
        TickInput {
            srq_posted: 256,
            ..low
        },
    );
    assert_eq!(drain(&mut c), [], "armed once");
}

#[test]
fn shutdown_sends_every_peer_ud_then_closes_its_connection() {
    let mut c = core(4);
    let t = up(&mut c, ip(2), 77, 4);
    c.handle_established(t * SEC, ip(3), 90);
    drain(&mut c);
    c.handle_shutdown();
    let cmds = drain(&mut c);
    assert_eq!(cmds.len(), 4);
    for pair in cmds.chunks(2) {
        let Command::SetPeerMode(a, PeerMode::Ud) = pair[0] else {
            panic!("{cmds:?}")
        };
        assert!(
            matches!(pair[1], Command::RemoveRoute { ip, close: true, .. } if ip == a),
            "{cmds:?}"
        );
    }
    assert_eq!(c.connections(), 0);
}

#[test]
fn pins_reach_the_policy() {
    let mut c = core(4);
    c.handle_tick(
        SEC,
        TickInput {
            mode: Some(Mode::Auto),
            max_connections: 4,
            pins: vec![(ip(5), PeerPin::Cm)],
            srq_posted: 256,
            ..TickInput::default()
        },
    );
    // Pinned to CM: connected without any traffic.
    assert_eq!(
        drain(&mut c),
        [
            Command::SetPeerMode(ip(5), PeerMode::CmPending),
            Command::Connect(ip(5))
        ]
    );
}

#[test]
fn the_ud_path_of_a_tick_decides_promotion_by_rate_and_none_keeps_the_last() {
    let mut c = core(4);
    let offloaded = |t: u64, path: Option<UdPath>, peer: IpAddr| TickInput {
        mode: Some(Mode::Auto),
        ud_path: path,
        max_connections: 4,
        traffic: vec![bulk(peer, t, 50)],
        srq_posted: 256,
        ..TickInput::default()
    };
    c.handle_tick(SEC, offloaded(1, Some(UdPath::Offloaded), ip(2)));
    assert_eq!(c.ud_path(), UdPath::Offloaded);
    // Unreadable (None) keeps the last path: still no promotion of a bulk sender.
    for t in 2..8 {
        c.handle_tick(t * SEC, offloaded(t, None, ip(2)));
        assert_eq!(drain(&mut c), []);
    }
    assert_eq!(c.ud_path(), UdPath::Offloaded);
    assert_eq!(c.peers(0)[0].state, CmPeerState::Ud);
    assert!(
        c.peers(0)[0].why.contains("segments in the device"),
        "{:?}",
        c.peers(0)[0]
    );
    c.handle_tick(8 * SEC, offloaded(8, Some(UdPath::PerPacket), ip(2)));
    assert_eq!(
        drain(&mut c),
        [
            Command::SetPeerMode(ip(2), PeerMode::CmPending),
            Command::Connect(ip(2))
        ]
    );
}

/// A bulk peer the full plan keeps on UD is said to wait for it; one below the threshold, or
/// one on CM, is not.
#[test]
fn a_bulk_peer_kept_on_ud_by_a_full_plan_waits_for_it() {
    let mut c = core(1);
    let t = up(&mut c, ip(2), 77, 1);
    let small = (
        ip(4),
        Traffic {
            tx_packets: 10,
            tx_bytes: 1000,
            tx_cm_bytes: 0,
        },
    );
    // ip(3) as busy as ip(2): not twice as busy, so it evicts no one.
    for s in t + 1..t + 6 {
        tick(
            &mut c,
            s,
            1,
            vec![bulk(ip(2), s, 50), bulk(ip(3), s, 50), small],
        );
    }
    let waiting = |c: &Core, peer: IpAddr| {
        let p = c.peers(0).into_iter().find(|p| p.addr == peer).unwrap();
        (p.state, p.waiting_for_plan)
    };
    assert_eq!(waiting(&c, ip(2)), (CmPeerState::Cm, false));
    assert_eq!(waiting(&c, ip(3)), (CmPeerState::Ud, true));
    assert_eq!(waiting(&c, ip(4)), (CmPeerState::Ud, false));
}
