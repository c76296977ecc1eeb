//! CLOCK_MONOTONIC, the clock `bpf_ktime_get_ns` reads in the kernel; and the loops' intervals.

/// Nanoseconds on CLOCK_MONOTONIC, comparable with the fast path's timestamps.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
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
