//! The traffic of a simulated cluster, shared by the promotion simulation (a test) and the
//! tick benchmark: 4096 neighbours, a hundred of them bulk senders that come and go.

pub const MB: u64 = 1_000_000;
/// Peers that send bulk: on for 90 s, off for 90 s, phases staggered.
pub const BULK: u32 = 100;
/// Peers whose setups never succeed (a firewall on the handshake port).
pub const DEAD: std::ops::Range<u32> = 4000..4010;

/// What peer `k` sends in second `t`: (bytes, mean packet size).
pub fn traffic(k: u32, t: u64) -> (u64, u64) {
    if k < BULK {
        // Bulk peers: on for 90 s, off for 90 s, phases staggered (about 50 on at a time);
        // from 300 s to 400 s a surge, all 100 on. Rates 5..=302 MB/s.
        let on = ((t + u64::from(k) * 7) / 90).is_multiple_of(2) || (300..400).contains(&t);
        let rate = 5 * MB + u64::from(k) * 3 * MB;
        if on { (rate, 60_000) } else { (0, 1) }
    } else if DEAD.contains(&k) {
        (100 * MB, 60_000)
    } else {
        // Everyone else: ARP, pings and small RPCs, some of them busy.
        (u64::from(k % 50) * 2_000, 120)
    }
}
