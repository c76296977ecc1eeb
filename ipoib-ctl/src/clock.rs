//! CLOCK_MONOTONIC, the clock the fast path's timestamps are on (read coarsely, once per tick, by
//! the programs), and its coarse reading; and the loops' intervals.

/// Nanoseconds on CLOCK_MONOTONIC, comparable with the fast path's timestamps.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// Nanoseconds on CLOCK_MONOTONIC_COARSE: the clock the fast path stamps last-seen times with
/// (`bpf_ktime_get_coarse_ns`, asked once per tick), as it reads at this moment.
pub fn monotonic_coarse_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC_COARSE)
}

fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; both clocks above always exist on Linux.
    let rc = unsafe { libc::clock_gettime(id, &mut ts) };
    debug_assert_eq!(rc, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A tokio interval whose missed ticks are delayed, not bunched: what every periodic branch
/// of the loops wants (after a stall, one tick, then the period again).
pub fn delayed_interval(period: std::time::Duration) -> tokio::time::Interval {
    let mut i = tokio::time::interval(period);
    i.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    i
}
