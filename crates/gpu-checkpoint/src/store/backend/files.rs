//! The local backend's files: opened only when they are regular files, the store lock, sizes.

use std::fs::{self, File};
use std::io;
use std::path::Path;

use super::LockMode;

/// Opens a store file for reading, accepting only a regular file: `None` when it is missing, a link, or
/// anything else (a FIFO would block the open or the read forever, a device such as `/dev/zero` would never
/// end). The store never makes anything but regular files, so any other kind is not one of its objects.
pub(super) fn open_regular(path: &Path) -> io::Result<Option<File>> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = match fs::OpenOptions::new()
        .read(true)
        // O_NONBLOCK: opening a FIFO must not wait for a writer (it has no effect on regular files).
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Ok(None),
        Err(e) => return Err(e),
    };
    Ok(file.metadata()?.is_file().then_some(file))
}

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

/// Bytes under a path (files only), for reporting what a cleanup freed.
pub(super) fn tree_size(path: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return meta.len();
    }
    fs::read_dir(path)
        .map(|entries| entries.flatten().map(|e| tree_size(&e.path())).sum())
        .unwrap_or(0)
}

/// Puts the mode of store path `path` back to `want` (0700 for folders, 0600 for files: chunks and
/// manifests hold process memory and what the process ran with) when someone loosened or changed it, and
/// records it in `found`. Links are never followed or changed. One that cannot be changed (another owner,
/// a read-only mount) is recorded too, with why.
pub(super) fn restore_mode(path: &Path, want: u32, found: &mut Vec<String>) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = fs::symlink_metadata(path) else {
        return;
    };
    let mode = meta.permissions().mode() & 0o7777;
    if meta.file_type().is_symlink() || mode == want {
        return;
    }
    found.push(
        match fs::set_permissions(path, fs::Permissions::from_mode(want)) {
            Ok(()) => format!("{} was {mode:04o}, now {want:04o}", path.display()),
            Err(e) => format!(
                "{} is {mode:04o}, should be {want:04o}, and cannot be changed: {e}",
                path.display()
            ),
        },
    );
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
