//! Paced polling: a test that waits for a condition looks at it, then rests in proportion to
//! what the look cost.
//!
//! A look is mostly `ipoib-ctl status`, a process of its own: about a fifth of a second of the
//! VM's CPU under emulation, more in the slow-machine mode. Looked at back to back every
//! 100 ms, the looks took most of a slow VM's CPU from the daemons they waited for, and the
//! waits grew with every look.

use std::time::{Duration, Instant};

/// How long a rest lasts against the look before it: at most a third of the CPU goes to looks.
const REST_PER_LOOK: u32 = 2;

/// The longest rest: a look that takes seconds (`rdma` dumps every region) must not delay
/// seeing the condition, or acting on it, by twice as much.
const MAX_REST: Duration = Duration::from_secs(2);

/// The rests between the looks of one polling loop: call [`Looks::rest`] after each look.
#[derive(Debug)]
pub struct Looks {
    floor: Duration,
    since: Instant,
}

impl Looks {
    /// Rests of at least `floor`, and twice the look before them up to [`MAX_REST`].
    pub fn new(floor: Duration) -> Self {
        Self {
            floor,
            since: Instant::now(),
        }
    }

    /// How long to rest after a look that took `look`.
    pub fn rest_after(&self, look: Duration) -> Duration {
        (look * REST_PER_LOOK).min(MAX_REST).max(self.floor)
    }

    /// Sleeps the rest due after the look that ran since the last rest (or since [`Looks::new`]).
    pub fn rest(&mut self) {
        std::thread::sleep(self.rest_after(self.since.elapsed()));
        self.since = Instant::now();
    }
}

/// Looks at `done` until it holds or `within` has passed, pacing the looks ([`Looks`], rests of
/// at least 100 ms). Looks once more at the end: a condition that came during the last rest
/// counts.
pub fn wait_until(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    let mut looks = Looks::new(Duration::from_millis(100));
    loop {
        if done() {
            return true;
        }
        if t.elapsed() >= within {
            return false;
        }
        looks.rest();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rest_is_twice_the_look_within_its_floor_and_cap() {
        let p = Looks::new(Duration::from_millis(100));
        assert_eq!(p.rest_after(Duration::ZERO), Duration::from_millis(100));
        assert_eq!(
            p.rest_after(Duration::from_millis(49)),
            Duration::from_millis(100)
        );
        assert_eq!(
            p.rest_after(Duration::from_millis(300)),
            Duration::from_millis(600)
        );
        assert_eq!(
            p.rest_after(Duration::from_millis(999)),
            Duration::from_millis(1998)
        );
        assert_eq!(p.rest_after(Duration::from_secs(15)), MAX_REST);
    }

    #[test]
    fn a_wait_looks_until_the_condition_holds() {
        let mut looks = 0;
        assert!(wait_until(Duration::from_secs(10), || {
            looks += 1;
            looks == 3
        }));
        assert_eq!(looks, 3);
    }

    #[test]
    fn a_wait_gives_up_after_its_bound_with_a_last_look() {
        let t = Instant::now();
        let mut looks = 0;
        assert!(!wait_until(Duration::from_millis(250), || {
            looks += 1;
            false
        }));
        assert!(t.elapsed() >= Duration::from_millis(250));
        // Looks at 0, 100, 200 and 300 ms: the last after the bound.
        assert!(looks >= 3, "{looks} looks");
    }
}
