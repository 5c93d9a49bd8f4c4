//! Deferring SIGINT, SIGTERM and SIGHUP while GPU state is frozen.
//!
//! Between the GPU checkpoint and its thaw (or the durable checkpoint), dying would leave the processes
//! locked and without their device memory: exactly what gpu-checkpoint promises never to do. While an
//! [`InterruptGuard`] lives, those signals only set a flag (and say so on stderr); the flow finishes or
//! undoes its work, and the command then exits as interrupted ([`interrupted`]). CRIU, a child process,
//! still gets a terminal's Ctrl-C itself, so an interrupted dump fails and is undone quickly.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Guards alive (nested guards keep the handlers until the last one goes).
static GUARDS: AtomicUsize = AtomicUsize::new(0);

const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

extern "C" fn on_signal(_sig: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
    let msg =
        b"gpu-checkpoint: interrupt received; finishing or undoing the GPU step safely first\n";
    // SAFETY: write(2) is async-signal-safe; the buffer is static.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// True when a deferred signal arrived.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// While alive, SIGINT/SIGTERM/SIGHUP are recorded instead of killing the process.
pub struct InterruptGuard {
    previous: Vec<(libc::c_int, libc::sighandler_t)>,
}

impl InterruptGuard {
    pub fn new() -> Self {
        let first = GUARDS.fetch_add(1, Ordering::SeqCst) == 0;
        let mut previous = Vec::new();
        if first {
            for sig in SIGNALS {
                // SAFETY: installing a handler that only touches an atomic and calls write(2).
                let old =
                    unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
                previous.push((sig, old));
            }
        }
        InterruptGuard { previous }
    }
}

impl Default for InterruptGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for InterruptGuard {
    fn drop(&mut self) {
        GUARDS.fetch_sub(1, Ordering::SeqCst);
        for (sig, old) in self.previous.drain(..) {
            // SAFETY: putting back the handler that was there before.
            unsafe { libc::signal(sig, old) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_under_the_guard_is_recorded_not_fatal() {
        {
            let _g = InterruptGuard::new();
            // SAFETY: signalling ourselves; the guard's handler catches it.
            unsafe { libc::raise(libc::SIGHUP) };
            assert!(interrupted());
        }
        // The previous disposition (default) is back: do not raise again here.
        // SAFETY: reading the current handler by swapping it with itself.
        let h = unsafe { libc::signal(libc::SIGHUP, libc::SIG_DFL) };
        assert_eq!(h, libc::SIG_DFL);
    }
}
