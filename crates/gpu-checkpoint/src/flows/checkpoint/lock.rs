//! One checkpoint at a time per process: an exclusive `flock` on a per-PID file, held for the whole flow.
//!
//! The lock lives outside any store (`/run/gpu-checkpoint/locks`, or `gpu-checkpoint-locks.UID` in the
//! temporary folder when /run is not writable; either must be a private folder of this user) because two checkpoints of one process into two different stores would race just as well.
//! `flock` locks die with their holder, so a crashed checkpoint never leaves a stale lock behind; the file is
//! removed when the lock is released, so that lock files do not pile up (one per PID ever checkpointed).
//! Removing it is safe because a lock counts only while its file is still the one at the path: a taker
//! that locked a file just unlinked by the previous holder sees that and tries again.
//!
//! A checkpoint locks every process of its tree, not only the root: checkpoints of a parent and of its
//! child at the same time would otherwise both go ahead and fail inside CRIU.

use std::fs::File;
use std::path::PathBuf;

use nix::fcntl::{Flock, FlockArg};

use super::Error;

/// An exclusive lock on checkpointing one PID; released (and its file removed) on drop.
#[derive(Debug)]
pub struct PidLock {
    _lock: Flock<File>,
    path: PathBuf,
}

impl Drop for PidLock {
    fn drop(&mut self) {
        // Still locked here (the lock is released after this, when the field drops): no one else can have
        // taken it through this file.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether the locked `file` is still the file at `path` (a holder may have removed it meanwhile).
fn still_at(file: &File, path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

impl PidLock {
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

fn lock_dirs() -> Vec<PathBuf> {
    if let Some(dir) = std::env::var_os("GPU_CHECKPOINT_LOCK_DIR").filter(|d| !d.is_empty()) {
        return vec![PathBuf::from(dir)];
    }
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    vec![
        PathBuf::from("/run/gpu-checkpoint/locks"),
        std::env::temp_dir().join(format!("gpu-checkpoint-locks.{uid}")),
    ]
}

/// Takes the locks of every PID of a tree (the root's is taken first, by the caller): [`Error::Busy`] when a
/// checkpoint of any of them runs (a parent's or a child's tree overlapping this one).
pub fn lock_tree(pids: &[i32], root: i32) -> Result<Vec<PidLock>, Error> {
    pids.iter()
        .filter(|&&p| p != root)
        .map(|&p| lock_pid(p))
        .collect()
}

/// Takes the lock for `pid`, or fails with [`Error::Busy`] when another checkpoint of it is running.
pub fn lock_pid(pid: i32) -> Result<PidLock, Error> {
    let mut last_err = None;
    for dir in lock_dirs() {
        // The folder must be this user's own: in a folder someone else controls, they could take or remove
        // the locks.
        let private = dir
            .parent()
            .map_or(Ok(()), crate::util::create_private_dir_all)
            .and_then(|()| crate::util::ensure_private_dir(&dir));
        if let Err(e) = private {
            last_err = Some((dir, e));
            continue;
        }
        let path = dir.join(format!("pid-{pid}.lock"));
        // A few tries: each fails only when the previous holder removed the file between our open and
        // our lock.
        for _ in 0..8 {
            use std::os::unix::fs::OpenOptionsExt;
            let file = match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(crate::util::FILE_MODE)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) => {
                    last_err = Some((path.clone(), e));
                    break;
                }
            };
            return match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
                Ok(lock) if still_at(&lock, &path) => Ok(PidLock { _lock: lock, path }),
                Ok(_) => continue,
                Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(Error::Busy { pid, lock: path }),
                Err((_, errno)) => Err(Error::Lock {
                    path,
                    source: errno.into(),
                }),
            };
        }
    }
    let (path, source) = last_err.unwrap_or_else(|| {
        (
            PathBuf::from("/run/gpu-checkpoint/locks"),
            std::io::Error::from(std::io::ErrorKind::NotFound),
        )
    });
    Err(Error::Lock { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Classify;

    #[test]
    fn second_lock_of_a_pid_is_refused_until_the_first_is_dropped() {
        // A PID no process can have, so that a concurrent real checkpoint is not disturbed.
        let pid = i32::MAX - 7;
        let first = lock_pid(pid).unwrap();
        let err = lock_pid(pid).unwrap_err();
        assert!(
            matches!(err, Error::Busy { pid: p, .. } if p == pid),
            "{err}"
        );
        assert_eq!(err.exit_status(), crate::ExitStatus::Conflict);
        drop(first);
        let again = lock_pid(pid).unwrap();
        // Released locks leave no file behind.
        let path = again.path().to_path_buf();
        assert!(path.exists());
        drop(again);
        assert!(!path.exists(), "{}", path.display());
    }

    /// Checkpoints of a parent's tree and of its child's overlap: the second is refused whichever comes
    /// first.
    #[test]
    fn trees_sharing_a_process_exclude_each_other() {
        let (parent, child) = (i32::MAX - 11, i32::MAX - 12);
        let _child_root = lock_pid(child).unwrap();
        let _parent_root = lock_pid(parent).unwrap();
        let err = lock_tree(&[parent, child], parent).unwrap_err();
        assert!(
            matches!(err, Error::Busy { pid, .. } if pid == child),
            "{err}"
        );
    }
}
