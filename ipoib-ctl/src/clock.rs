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

/// Nanoseconds of CPU time the calling thread has used (CLOCK_THREAD_CPUTIME_ID).
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; the clocks above always exist on Linux.
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Both readings advance as std's Instant (CLOCK_MONOTONIC too) does over the same span,
    /// to within the coarse clock's tick.
    #[test]
    fn both_clocks_advance_as_the_monotonic_clock_does() {
        let t = Instant::now();
        let (fine0, coarse0) = (monotonic_ns(), monotonic_coarse_ns());
        std::thread::sleep(Duration::from_millis(1200));
        let (fine1, coarse1) = (monotonic_ns(), monotonic_coarse_ns());
        let elapsed = t.elapsed().as_nanos() as u64;
        let fine = fine1 - fine0;
        assert!(
            fine <= elapsed && elapsed - fine < 20_000_000,
            "{fine} vs {elapsed}"
        );
        let coarse = coarse1.abs_diff(coarse0);
        assert!(
            coarse.abs_diff(elapsed) < 20_000_000,
            "{coarse} vs {elapsed}"
        );
    }

    /// The thread's CPU clock counts its work, not its sleep.
    #[test]
    fn the_thread_cpu_clock_counts_work_not_sleep() {
        let t0 = thread_cpu_ns();
        std::thread::sleep(Duration::from_millis(200));
        let slept = thread_cpu_ns() - t0;
        let t1 = thread_cpu_ns();
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(200) {
            std::hint::black_box(0u64);
        }
        let worked = thread_cpu_ns() - t1;
        assert!(slept < 50_000_000, "asleep it used {slept} ns");
        assert!(
            worked > slept && worked > 20_000_000,
            "busy it used {worked} ns"
        );
    }
}
