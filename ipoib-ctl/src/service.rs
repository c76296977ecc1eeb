//! What the service manager hears from `attach` (systemd's notify protocol, `Type=notify`):
//! READY once the fast path is attached and connected mode is up or has said why the node is
//! UD only; WATCHDOG each time the heartbeat is written, so a loop or an engine that does not
//! turn stops it (systemd then restarts the unit after `WatchdogSec`); STOPPING on the way out;
//! a STATUS line with each change. Without `NOTIFY_SOCKET` every call does nothing.
//!
//! The protocol itself is the `sd-notify` crate's.

use std::time::Duration;

use sd_notify::NotifyState;

/// The notify socket of this process, if it has one, and its watchdog.
#[derive(Debug)]
pub struct Notifier {
    enabled: bool,
    /// `WATCHDOG_USEC`, when it names this process.
    watchdog: Option<Duration>,
    /// A send failed: said once, then quiet.
    failed: bool,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID`.
    pub fn from_env() -> Self {
        Self::new(
            std::env::var_os("NOTIFY_SOCKET").is_some(),
            sd_notify::watchdog_enabled(),
        )
    }

    /// A socket (`enabled`) and a watchdog period, as the environment would give them.
    fn new(enabled: bool, watchdog: Option<Duration>) -> Self {
        Self {
            enabled,
            watchdog: watchdog.filter(|d| !d.is_zero()),
            failed: false,
        }
    }

    /// A service manager listens.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The watchdog's period, if the service manager set one.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog.filter(|_| self.enabled)
    }

    /// The longest the heartbeat may wait before the next ping: a third of the watchdog's
    /// period, so one late beat does not trip it.
    pub fn beat_at_most(&self) -> Option<Duration> {
        self.watchdog().map(|w| w / 3)
    }

    /// Startup is finished; `status` says in what state.
    pub fn ready(&mut self, status: &str) {
        self.send(&[NotifyState::Ready, NotifyState::Status(status)]);
    }

    pub fn status(&mut self, status: &str) {
        self.send(&[NotifyState::Status(status)]);
    }

    /// The loop turned and its engine moves (called where the heartbeat is written).
    pub fn alive(&mut self) {
        if self.watchdog().is_none() {
            return;
        }
        self.send(&[NotifyState::Watchdog]);
    }

    pub fn stopping(&mut self, status: &str) {
        self.send(&[NotifyState::Stopping, NotifyState::Status(status)]);
    }

    fn send(&mut self, states: &[NotifyState]) {
        if !self.enabled {
            return;
        }
        match sd_notify::notify(states) {
            Ok(()) => self.failed = false,
            Err(e) if !self.failed => {
                self.failed = true;
                tracing::warn!("telling the service manager ({states:?}): {e}");
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_sets_the_beat_only_where_a_manager_listens() {
        let w = Duration::from_secs(30);
        let n = Notifier::new(true, Some(w));
        assert_eq!(n.watchdog(), Some(w));
        assert_eq!(n.beat_at_most(), Some(Duration::from_secs(10)));
        // No socket: nobody to ping, the beat is the heartbeat's own.
        let n = Notifier::new(false, Some(w));
        assert_eq!((n.watchdog(), n.beat_at_most()), (None, None));
        // WatchdogSec=0 (or none): off.
        let n = Notifier::new(true, Some(Duration::ZERO));
        assert_eq!((n.watchdog(), n.beat_at_most()), (None, None));
        assert!(Notifier::new(true, None).enabled());
        assert!(!Notifier::new(false, None).enabled());
    }
}
