//! One checkpoint at a time per process: an exclusive `flock` on a per-PID file, held for the whole flow.
//!
//! The lock lives outside any store (`/run/gpu-checkpoint/locks`, or the temporary folder when /run is not
//! writable) because two checkpoints of one process into two different stores would race just as well.
//! `flock` locks die with their holder, so a crashed checkpoint never leaves a stale lock behind.

use std::fs::File;
use std::path::PathBuf;

use nix::fcntl::{Flock, FlockArg};

use super::Error;

/// An exclusive lock on checkpointing one PID; released on drop.
#[derive(Debug)]
pub struct PidLock {
    _lock: Flock<File>,
    path: PathBuf,
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
    vec![
        PathBuf::from("/run/gpu-checkpoint/locks"),
        std::env::temp_dir().join("gpu-checkpoint-locks"),
    ]
}

/// Takes the lock for `pid`, or fails with [`Error::Busy`] when another checkpoint of it is running.
pub fn lock_pid(pid: i32) -> Result<PidLock, Error> {
    let mut last_err = None;
    for dir in lock_dirs() {
        if let Err(e) = crate::util::create_private_dir_all(&dir) {
            last_err = Some((dir, e));
            continue;
        }
        let path = dir.join(format!("pid-{pid}.lock"));
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) => {
                last_err = Some((path, e));
                continue;
            }
        };
        return match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(PidLock { _lock: lock, path }),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Err(Error::Busy { pid, lock: path }),
            Err((_, errno)) => Err(Error::Lock {
                path,
                source: errno.into(),
            }),
        };
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
        lock_pid(pid).unwrap();
    }
}
