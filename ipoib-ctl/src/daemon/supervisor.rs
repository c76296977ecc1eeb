//! Connected mode's life in the control loop, as pure decisions: its state ([`CmPhase`]),
//! what happens to it ([`CmEvent`]), and what the loop does then ([`CmStep`]); and the
//! [`Backoff`] that says when a stopped connected mode starts again.

use std::time::Duration;

use crate::connmgr::Remains;

/// Where connected mode is, in the control loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmPhase {
    /// Every peer on UD for good: it never ran (no device, not wanted, failed to start).
    UdOnly,
    Running,
    /// Stopped on an error, or a start again failed: it starts again when the backoff says.
    BackingOff,
    /// A start again under way, beside the loop's other branches.
    Starting,
}

/// What happens to connected mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmEvent {
    /// The running connected mode stopped on an error; whether the port's (an event of it).
    Stopped { the_ports: bool },
    /// The backoff's wait is over; whether what the last one left behind is gone.
    RestartDue { remains_gone: bool },
    /// A start again ended.
    StartEnded { ok: bool },
}

/// What the loop does on an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmStep {
    /// Shut the stopped connected mode down, keep what it leaves, wait the backoff.
    StopAndBackOff,
    /// Beat, then begin a start.
    BeginStart,
    /// Look again a little later: the last one's remains are not gone.
    Postpone,
    /// The start ended well: it runs again.
    Adopt,
    /// The start failed: back off again.
    BackOffAgain,
    /// The event does not apply here.
    Ignore,
}

/// The next phase and what to do, on `event` in `phase`.
pub fn transition(phase: CmPhase, event: CmEvent) -> (CmPhase, CmStep) {
    use {CmEvent as E, CmPhase as P, CmStep as S};
    match (phase, event) {
        (P::Running, E::Stopped { .. }) => (P::BackingOff, S::StopAndBackOff),
        (P::BackingOff, E::RestartDue { remains_gone: true }) => (P::Starting, S::BeginStart),
        (
            P::BackingOff,
            E::RestartDue {
                remains_gone: false,
            },
        ) => (P::BackingOff, S::Postpone),
        (P::Starting, E::StartEnded { ok: true }) => (P::Running, S::Adopt),
        (P::Starting, E::StartEnded { ok: false }) => (P::BackingOff, S::BackOffAgain),
        (p, _) => (p, S::Ignore),
    }
}

/// When connected mode starts again after it stopped on an error: [`Backoff::FIRST`] after
/// a stop, twice as long after each stop or failed start that came within
/// [`Backoff::STEADY`] of the last start, at most [`Backoff::MOST`]. A stop is worth a
/// restart (a QP, CQ or TUN error on a node that ran connected mode; the engine's panic), a
/// loop of them is not worth a busy node.
#[derive(Debug, Clone)]
pub struct Backoff {
    wait: Duration,
    /// Since when connected mode runs; None while it does not.
    running_since: Option<std::time::Instant>,
    due: Option<std::time::Instant>,
    /// What the connected mode that stopped leaves behind: the next starts once it is gone.
    pub remains: Option<Remains>,
    /// Since when a due start waits for those remains, and whether that was said.
    lingering_since: Option<std::time::Instant>,
    warned: bool,
}

impl Backoff {
    pub const FIRST: Duration = Duration::from_secs(5);
    pub const MOST: Duration = Duration::from_secs(300);
    pub const STEADY: Duration = Duration::from_secs(600);
    /// How often a due start looks again whether the last one's remains are gone.
    pub const LINGER: Duration = Duration::from_millis(500);
    /// How soon connected mode starts again after its port's event, and how often a port
    /// that is not ready is looked at again: as the kernel's IPoIB flushes at once, with
    /// nothing that grows (the port's state is the subnet's doing, a query costs nothing).
    pub const PORT_POLL: Duration = Duration::from_secs(1);
    pub const LINGER_WARN: Duration = Duration::from_secs(30);

    /// Connected mode never ran: its port was not ready at `now`; it starts once it is.
    pub fn waiting_for_port(now: std::time::Instant) -> Self {
        let mut b = Self::new(now);
        b.port_wait(now);
        b
    }

    /// Connected mode stopped, or did not start, at `now` because of its port: it starts
    /// again after [`Backoff::PORT_POLL`], and the wait after an error is as it was.
    pub fn port_wait(&mut self, now: std::time::Instant) -> Duration {
        self.running_since = None;
        self.due = Some(now + Self::PORT_POLL);
        self.lingering_since = None;
        self.warned = false;
        Self::PORT_POLL
    }

    /// Connected mode started at `now`.
    pub fn new(now: std::time::Instant) -> Self {
        Self {
            wait: Duration::ZERO,
            running_since: Some(now),
            due: None,
            remains: None,
            lingering_since: None,
            warned: false,
        }
    }

    /// The start due at `now` waits [`Backoff::LINGER`] more: what the last connected mode
    /// left is not gone. True once, when the waiting has gone on for
    /// [`Backoff::LINGER_WARN`] (a task that never ends keeps connected mode off).
    pub fn postpone(&mut self, now: std::time::Instant) -> bool {
        let since = *self.lingering_since.get_or_insert(now);
        self.due = Some(now + Self::LINGER);
        let long = now.duration_since(since) >= Self::LINGER_WARN;
        long && !std::mem::replace(&mut self.warned, true)
    }

    pub fn started(&mut self, now: std::time::Instant) {
        self.running_since = Some(now);
        self.due = None;
        self.lingering_since = None;
        self.warned = false;
    }

    /// Connected mode stopped, or did not start, at `now`: how long until the next start.
    pub fn stopped(&mut self, now: std::time::Instant) -> Duration {
        let steady = self
            .running_since
            .take()
            .is_some_and(|t| now.duration_since(t) >= Self::STEADY);
        self.wait = if self.wait.is_zero() || steady {
            Self::FIRST
        } else {
            (self.wait * 2).min(Self::MOST)
        };
        self.due = Some(now + self.wait);
        self.lingering_since = None;
        self.warned = false;
        self.wait
    }

    /// When connected mode should start again; None while it runs.
    pub fn due(&self) -> Option<std::time::Instant> {
        self.due
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const S: Duration = Duration::from_secs(1);

    /// The life of connected mode: a stop backs off, a due start waits for the remains, a
    /// start that fails backs off again, one that works runs; nothing else moves it.
    #[test]
    fn connected_mode_moves_only_as_its_events_say() {
        use {CmEvent as E, CmPhase as P, CmStep as S};
        let gone = E::RestartDue { remains_gone: true };
        let lingering = E::RestartDue {
            remains_gone: false,
        };
        let (ok, failed) = (E::StartEnded { ok: true }, E::StartEnded { ok: false });
        for the_ports in [false, true] {
            assert_eq!(
                transition(P::Running, E::Stopped { the_ports }),
                (P::BackingOff, S::StopAndBackOff)
            );
        }
        assert_eq!(
            transition(P::BackingOff, lingering),
            (P::BackingOff, S::Postpone)
        );
        assert_eq!(
            transition(P::BackingOff, gone),
            (P::Starting, S::BeginStart)
        );
        assert_eq!(
            transition(P::Starting, failed),
            (P::BackingOff, S::BackOffAgain)
        );
        assert_eq!(transition(P::Starting, ok), (P::Running, S::Adopt));
        // Events that do not apply leave the phase as it is.
        for (p, e) in [
            (P::UdOnly, E::Stopped { the_ports: false }),
            (P::UdOnly, gone),
            (P::UdOnly, ok),
            (P::Running, gone),
            (P::Running, ok),
            (P::BackingOff, E::Stopped { the_ports: true }),
            (P::BackingOff, ok),
            (P::Starting, E::Stopped { the_ports: false }),
            (P::Starting, gone),
        ] {
            assert_eq!(transition(p, e), (p, S::Ignore), "{p:?} {e:?}");
        }
    }

    #[test]
    fn a_restart_waits_longer_after_each_quick_stop_and_short_again_after_a_steady_run() {
        let t0 = Instant::now();
        let mut b = Backoff::new(t0);
        assert_eq!(b.due(), None, "nothing due while it runs");
        // Stopped after a minute: the first wait.
        let t = t0 + 60 * S;
        assert_eq!(b.stopped(t), Backoff::FIRST);
        assert_eq!(b.due(), Some(t + Backoff::FIRST));
        // The start fails: twice as long, and twice again.
        let t = t + Backoff::FIRST;
        assert_eq!(b.stopped(t), 2 * Backoff::FIRST);
        let t = t + 2 * Backoff::FIRST;
        assert_eq!(b.stopped(t), 4 * Backoff::FIRST);
        // It starts, and stops again soon: the wait goes on growing, up to the most.
        let t = t + 4 * Backoff::FIRST;
        b.started(t);
        assert_eq!(b.due(), None);
        assert_eq!(b.stopped(t + S), 8 * Backoff::FIRST);
        for _ in 0..10 {
            b.stopped(t + S);
        }
        assert_eq!(b.stopped(t + S), Backoff::MOST);
        // Failed starts long after the last run do not count as a steady run.
        assert_eq!(b.stopped(t + 2 * Backoff::STEADY), Backoff::MOST);
        // A run as long as STEADY: the next stop waits the first wait again.
        let t = t + 3 * Backoff::STEADY;
        b.started(t);
        assert_eq!(b.stopped(t + Backoff::STEADY), Backoff::FIRST);
        assert_eq!(b.due(), Some(t + Backoff::STEADY + Backoff::FIRST));
    }

    #[test]
    fn a_start_waits_for_the_last_ones_remains_and_says_so_once_when_long() {
        let t0 = Instant::now();
        let mut b = Backoff::new(t0);
        let t = t0 + S;
        b.stopped(t);
        let due = t + Backoff::FIRST;
        assert!(!b.postpone(due));
        assert_eq!(b.due(), Some(due + Backoff::LINGER));
        let mut said = 0;
        let mut now = due;
        while now < due + 2 * Backoff::LINGER_WARN {
            now += Backoff::LINGER;
            said += usize::from(b.postpone(now));
            assert_eq!(b.due(), Some(now + Backoff::LINGER));
            if now < due + Backoff::LINGER_WARN {
                assert_eq!(said, 0, "said after {:?}", now - due);
            }
        }
        assert_eq!(said, 1);
        // Started at last, and stopped again: a new wait is said anew.
        b.started(now);
        b.stopped(now + S);
        let due = b.due().unwrap();
        assert!(!b.postpone(due));
        assert!(b.postpone(due + Backoff::LINGER_WARN));
    }

    /// The port's stops and waits: a short wait that never grows, and that leaves the wait
    /// after an error as it was.
    #[test]
    fn the_ports_waits_are_short_and_leave_the_error_backoff_alone() {
        let t0 = Instant::now();
        let b = Backoff::waiting_for_port(t0);
        assert_eq!(b.due(), Some(t0 + Backoff::PORT_POLL));
        let mut b = Backoff::new(t0);
        let t = t0 + S;
        assert_eq!(b.stopped(t), Backoff::FIRST);
        assert_eq!(b.stopped(t), 2 * Backoff::FIRST);
        for k in 1..5 {
            let now = t + k * S;
            assert_eq!(b.port_wait(now), Backoff::PORT_POLL);
            assert_eq!(b.due(), Some(now + Backoff::PORT_POLL));
        }
        // An error after the port's waits: the error's wait goes on from where it was.
        assert_eq!(b.stopped(t + 10 * S), 4 * Backoff::FIRST);
        // A port wait during a long linger starts the linger's count anew.
        let due = b.due().unwrap();
        b.postpone(due);
        b.port_wait(due + Backoff::LINGER_WARN);
        assert!(!b.postpone(due + Backoff::LINGER_WARN + S));
    }
}
