//! The local backend's store lock, and the warning about loosened permissions.

use std::fs::File;
use std::io;
use std::path::Path;

use super::LockMode;

/// Takes the store lock on `file` (`nonblocking`: `Ok(None)` when another process holds it). nix's `Flock`
/// (the one flock implementation the crate uses, as the flows' per-PID locks do) releases it on drop.
pub(super) fn flock(
    file: File,
    mode: LockMode,
    nonblocking: bool,
) -> io::Result<Option<nix::fcntl::Flock<File>>> {
    use nix::fcntl::{Flock, FlockArg};
    let arg = match (mode, nonblocking) {
        (LockMode::Shared, false) => FlockArg::LockShared,
        (LockMode::Shared, true) => FlockArg::LockSharedNonblock,
        (LockMode::Exclusive, false) => FlockArg::LockExclusive,
        (LockMode::Exclusive, true) => FlockArg::LockExclusiveNonblock,
    };
    let mut file = file;
    loop {
        match Flock::lock(file, arg) {
            Ok(lock) => return Ok(Some(lock)),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Ok(None),
            Err((f, nix::errno::Errno::EINTR)) => file = f,
            Err((_, e)) => return Err(e.into()),
        }
    }
}

/// Says on stderr (a warning) which store paths had other permissions than the store's, if any.
pub(super) fn warn_modes(root: &Path, found: &[String]) {
    const SHOWN: usize = 8;
    if found.is_empty() {
        return;
    }
    let more = found.len().saturating_sub(SHOWN);
    tracing::warn!(
        "store {}: {} path(s) had loosened permissions (folders must be 0700, files 0600): {}{}",
        root.display(),
        found.len(),
        found[..found.len().min(SHOWN)].join("; "),
        if more > 0 {
            format!("; and {more} more")
        } else {
            String::new()
        }
    );
}
