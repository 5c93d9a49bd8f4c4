//! Fault injection at named points of the flows, for the tests of what gpu-checkpoint promises when it
//! is killed or fails mid-way (the fault matrix, `docs/guarantees.md`); the same idea as CRIU's
//! `CRIU_FAULT`.
//!
//! `GPU_CHECKPOINT_FAULT=POINT=ACTION[,POINT=ACTION...]`, read once. Actions at a step ([`at`]): `kill`
//! (SIGKILL to the tool itself: nothing of ours runs after it, the guardian's case), `term` (SIGTERM:
//! deferred, and the flow undoes or finishes) and `sleep:MS` (waits MS milliseconds there: a window in
//! which a test cuts a node's network, say). Actions at an I/O ([`io_error`]): `eio`, `enospc`. The
//! points are listed in [`POINTS`]. Unset, every call is one look at an empty list.
//!
//! A leaf module: it imports nothing of the crate.

use std::sync::OnceLock;

/// The environment variable that arms faults.
pub const ENV: &str = "GPU_CHECKPOINT_FAULT";

/// Every point a fault can be injected at, in the order a checkpoint, then a restore, reaches them.
pub const POINTS: &[&str] = &[
    "checkpoint.before-freeze",
    "checkpoint.after-freeze",
    "checkpoint.after-dump",
    "checkpoint.after-commit",
    "store.write",
    "restore.before-criu",
    "restore.after-criu",
    // The userfaultfd restore's background fill, before each chunk it copies (with the processes already
    // running, unless `--resume filled`): `sleep:MS` stretches the time their memory takes to come in.
    "restore.memory",
    // The container flow (`flows/container/`): its runtime's commands fail as the runtime's own would
    // (`eio`); its other steps share the points above (`checkpoint.after-dump` is after the runtime's
    // checkpoint, `restore.before-criu` and `restore.after-criu` around its restore).
    "container.runtime-checkpoint",
    "container.runtime-restore",
    // A container restore's GPU processes: their GPU state restored, not yet unlocked.
    "container.gpu-restored",
    // In a gVisor sandbox: its GPU processes locked by the tool inside it, not yet checkpointed.
    "container.sandbox-locked",
    // The cluster flow (docs/cluster.md): an agent once its member is locked / durable / restored
    // (GPU state back, still locked), and the coordinator before and after the commit's transaction.
    "cluster.member-locked",
    "cluster.member-durable",
    "cluster.member-restored",
    "cluster.before-commit",
    "cluster.after-commit",
];

fn armed() -> &'static [(String, String)] {
    static ARMED: OnceLock<Vec<(String, String)>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var(ENV)
            .unwrap_or_default()
            .split(',')
            .filter_map(|p| p.split_once('='))
            .map(|(point, action)| (point.trim().to_string(), action.trim().to_string()))
            .collect()
    })
}

fn action(point: &str) -> Option<&'static str> {
    armed()
        .iter()
        .find(|(p, _)| p == point)
        .map(|(_, a)| a.as_str())
}

/// The step `point` is reached: does what `GPU_CHECKPOINT_FAULT` says there, if anything.
pub fn at(point: &str) {
    let sig = match action(point) {
        Some("kill") => libc::SIGKILL,
        Some("term") => libc::SIGTERM,
        Some(a) => {
            if let Some(ms) = a.strip_prefix("sleep:").and_then(|ms| ms.parse().ok()) {
                eprintln!("gpu-checkpoint: injected fault at {point}: sleeping {ms} ms");
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            return;
        }
        None => return,
    };
    eprintln!("gpu-checkpoint: injected fault at {point}: signal {sig}");
    // SAFETY: raise has no memory-safety preconditions.
    unsafe { libc::raise(sig) };
}

/// The I/O at `point` is about to happen: the error `GPU_CHECKPOINT_FAULT` says it fails with, if any.
pub fn io_error(point: &str) -> Option<std::io::Error> {
    let errno = match action(point)? {
        "eio" => libc::EIO,
        "enospc" => libc::ENOSPC,
        _ => return None,
    };
    Some(std::io::Error::from_raw_os_error(errno))
}
