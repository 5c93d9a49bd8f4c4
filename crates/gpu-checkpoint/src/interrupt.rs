//! Deferring the signals that would kill the tool while it holds a tree in a state only it can undo.
//!
//! Between freezing a tree (its GPU state checkpointed, or CRIU leaving it stopped) and the checkpoint
//! being durable, dying would leave the processes stopped or without their device memory: exactly what
//! gpu-checkpoint promises never to do. While an [`InterruptGuard`] lives, every catchable signal whose
//! default action ends or stops the process only records that it came (and says so on stderr); the flow
//! checks [`InterruptGuard::interrupted`] between its steps and undoes what it did, and the command then
//! exits as interrupted. What cannot be caught (SIGKILL, the OOM killer) is the guardian's job
//! (`flows::guardian`).
//!
//! One owner of the process's signal dispositions: the first guard installs the handlers and saves what
//! was there, the last one dropped puts that back, whatever order guards are dropped in. A leaf module:
//! stages and flows both use it.

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Mutex;

use nix::sys::signal::Signal;

/// Signals received while a guard was alive, ever (a guard compares against its count at creation).
static RECEIVED: AtomicUsize = AtomicUsize::new(0);
/// The last signal received, for the message.
static LAST: AtomicI32 = AtomicI32::new(0);
/// Guards alive, and the dispositions the first one replaced.
static OWNER: Mutex<(usize, Vec<(libc::c_int, libc::sigaction)>)> = Mutex::new((0, Vec::new()));

/// Signals whose default action ends the process (SIGPIPE is left alone: Rust ignores it, so a closed
/// pipe is an EPIPE error where it happens, not an interrupt).
const ENDING: [libc::c_int; 14] = [
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGTERM,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGALRM,
    libc::SIGVTALRM,
    libc::SIGPROF,
    libc::SIGXCPU,
    libc::SIGXFSZ,
    libc::SIGIO,
    libc::SIGPWR,
    libc::SIGSTKFLT,
];
/// Signals whose default action stops the process (a terminal's Ctrl-Z): ignored while guarded, since a
/// stopped tool cannot undo anything either, but not counted as interrupts.
const STOPPING: [libc::c_int; 3] = [libc::SIGTSTP, libc::SIGTTIN, libc::SIGTTOU];

extern "C" fn on_signal(sig: libc::c_int) {
    RECEIVED.fetch_add(1, Ordering::SeqCst);
    LAST.store(sig, Ordering::SeqCst);
    let msg =
        b"gpu-checkpoint: signal received; finishing or undoing the current step safely first\n";
    // SAFETY: write(2) is async-signal-safe; the buffer is static.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
}

/// Every signal deferred and what it gets: the ending ones and the real-time ones (they end a process
/// too) our handler, the stopping ones SIG_IGN.
fn deferred() -> Vec<(libc::c_int, libc::sighandler_t)> {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    let mut v: Vec<_> = ENDING.iter().map(|&s| (s, handler)).collect();
    v.extend((libc::SIGRTMIN()..=libc::SIGRTMAX()).map(|s| (s, handler)));
    v.extend(STOPPING.iter().map(|&s| (s, libc::SIG_IGN)));
    v
}

/// Sets `sig`'s disposition, returning the old one; `None` when the kernel refuses (a signal glibc
/// keeps for itself). Raw `sigaction(2)`: real-time signals have no `nix` `Signal` variant.
fn set(sig: libc::c_int, action: &libc::sigaction) -> Option<libc::sigaction> {
    // SAFETY: sigaction with valid pointers; our handler only touches atomics and calls write(2), both
    // async-signal-safe.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(sig, action, &mut old) == 0).then_some(old)
    }
}

/// A disposition: `handler` with `SA_RESTART` (an interrupted read goes on), nothing masked.
fn action(handler: libc::sighandler_t) -> libc::sigaction {
    // SAFETY: an all-zero sigaction is a valid value (empty mask, no flags).
    let mut a: libc::sigaction = unsafe { std::mem::zeroed() };
    a.sa_sigaction = handler;
    a.sa_flags = libc::SA_RESTART;
    a
}

/// True when a deferred signal arrived in this process, under any guard (for the binary's last word).
pub fn interrupted() -> bool {
    RECEIVED.load(Ordering::SeqCst) > 0
}

/// The name of the last deferred signal received (`SIGTERM`), if any.
pub fn last_signal() -> Option<String> {
    let sig = LAST.load(Ordering::SeqCst);
    if sig == 0 {
        return None;
    }
    Some(match Signal::try_from(sig) {
        Ok(s) => s.as_str().to_string(),
        Err(_) => format!("signal {sig}"),
    })
}

/// While alive, the signals above are recorded instead of ending (or stopping) the process.
pub struct InterruptGuard {
    /// `RECEIVED` when this guard was made: what came later is this guard's business.
    seen: usize,
}

impl InterruptGuard {
    pub fn new() -> Self {
        let mut owner = OWNER.lock().unwrap_or_else(|p| p.into_inner());
        if owner.0 == 0 {
            for (sig, handler) in deferred() {
                if let Some(old) = set(sig, &action(handler)) {
                    owner.1.push((sig, old));
                }
            }
        }
        owner.0 += 1;
        InterruptGuard {
            seen: RECEIVED.load(Ordering::SeqCst),
        }
    }

    /// True when a deferred signal arrived since this guard was made.
    pub fn interrupted(&self) -> bool {
        RECEIVED.load(Ordering::SeqCst) > self.seen
    }
}

impl Default for InterruptGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for InterruptGuard {
    fn drop(&mut self) {
        let mut owner = OWNER.lock().unwrap_or_else(|p| p.into_inner());
        owner.0 -= 1;
        if owner.0 == 0 {
            for (sig, old) in std::mem::take(&mut owner.1) {
                set(sig, &old);
            }
        }
    }
}

/// Whether `sig`'s handler is ours now (tests).
#[cfg(test)]
fn ours(sig: libc::c_int) -> bool {
    // SAFETY: a null new action only reads the current one.
    let cur = unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        assert_eq!(libc::sigaction(sig, std::ptr::null(), &mut cur), 0);
        cur
    };
    cur.sa_sigaction == on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs the test named `name` of this binary again in a child process with `GC_SIGNAL_CHILD` set, so
    /// that the signals it raises reach no other test's guard (a flow under test would see them).
    fn in_child(name: &str) {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--nocapture", "--test-threads=1"])
            .env("GC_SIGNAL_CHILD", "1")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "{name} in a child: {out:?}"
        );
    }

    #[test]
    fn a_signal_under_the_guard_is_recorded_not_fatal() {
        if std::env::var_os("GC_SIGNAL_CHILD").is_none() {
            return in_child("interrupt::tests::a_signal_under_the_guard_is_recorded_not_fatal");
        }
        // What was there before (SIG_DFL, or SIG_IGN under nohup): the guard must put exactly that back.
        // SAFETY: a null new action only reads the current one.
        let before = unsafe {
            let mut cur: libc::sigaction = std::mem::zeroed();
            assert_eq!(libc::sigaction(libc::SIGHUP, std::ptr::null(), &mut cur), 0);
            cur.sa_sigaction
        };
        {
            let g = InterruptGuard::new();
            for sig in [
                libc::SIGHUP,
                libc::SIGTERM,
                libc::SIGRTMIN() + 3,
                libc::SIGTSTP,
            ] {
                // SAFETY: signalling ourselves; the guard's handler catches it (or ignores SIGTSTP).
                unsafe { libc::raise(sig) };
            }
            assert!(g.interrupted());
            assert!(interrupted());
            // SIGTSTP was ignored, not counted: the last one is the real-time signal.
            assert_eq!(
                last_signal(),
                Some(format!("signal {}", libc::SIGRTMIN() + 3))
            );
            // A guard made after the signals has seen none of them.
            assert!(!InterruptGuard::new().interrupted());
        }
        // The previous disposition is back: do not raise again here.
        // SAFETY: reading the current handler by swapping it with itself.
        let h = unsafe { libc::signal(libc::SIGHUP, libc::SIG_DFL) };
        assert_eq!(h, before);
    }

    #[test]
    fn the_last_guard_dropped_puts_the_handlers_back_whatever_the_order() {
        if std::env::var_os("GC_SIGNAL_CHILD").is_none() {
            return in_child(
                "interrupt::tests::the_last_guard_dropped_puts_the_handlers_back_whatever_the_order",
            );
        }
        let first = InterruptGuard::new();
        let second = InterruptGuard::new();
        assert!(ours(libc::SIGTERM));
        // The first guard goes while the second lives: the handlers must stay (they were lost before).
        drop(first);
        assert!(ours(libc::SIGTERM), "handlers kept while a guard lives");
        drop(second);
        assert!(
            !ours(libc::SIGTERM),
            "handlers restored after the last guard"
        );
    }
}
