//! A stop flag raised by SIGINT or SIGTERM, for loops that must end cleanly on Ctrl-C.

use std::sync::atomic::{AtomicBool, Ordering};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// From now on SIGINT and SIGTERM raise the flag instead of killing the process.
pub fn stop_on_sigint_sigterm() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}
