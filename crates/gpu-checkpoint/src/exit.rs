//! The exit-code contract of the `gpu-checkpoint` binary, and the trait every library error implements to
//! classify itself into it.
//!
//! A leaf module: it imports nothing of the crate, so that every stage and flow can depend on it without
//! depending on each other. Each error type decides its own exit status where it is defined (the only place
//! that knows what its variants mean); the binary takes that status where a library error enters it (one
//! conversion from any `Classify` type) and never converts errors by hand.

/// Exit codes of the `gpu-checkpoint` binary. Scripts depend on them: never renumber.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum ExitStatus {
    /// Anything not listed below.
    Failure = 1,
    /// Bad arguments or bad input files.
    Usage = 2,
    /// The process (or checkpoint's process) does not exist.
    NoSuchProcess = 3,
    /// Not permitted: not root / no CAP_CHECKPOINT_RESTORE / unreadable /proc files.
    PermissionDenied = 4,
    /// CRIU (or another required tool or driver library) missing or too old.
    ToolMissing = 5,
    /// Storage full, not writable, or not reachable (an object store down or throttling past the retries).
    Storage = 6,
    /// Checkpoint not found or damaged.
    CheckpointInvalid = 7,
    /// Restore conflict (PID in use, GPUs do not match) or a checkpoint already in progress.
    Conflict = 8,
    /// A checkpoint was refused because the plan is `unsupported`, a CRIU option it needs is missing, or
    /// the tree is stopped.
    Unsupported = 9,
    /// A signal (SIGINT, SIGTERM, SIGHUP, ...) came while the command held the tree: what it had done
    /// was undone (checkpoint: the tree runs as before, nothing is stored).
    Interrupted = 10,
}

impl ExitStatus {
    /// Every status, in code order.
    pub const ALL: [ExitStatus; 10] = [
        ExitStatus::Failure,
        ExitStatus::Usage,
        ExitStatus::NoSuchProcess,
        ExitStatus::PermissionDenied,
        ExitStatus::ToolMissing,
        ExitStatus::Storage,
        ExitStatus::CheckpointInvalid,
        ExitStatus::Conflict,
        ExitStatus::Unsupported,
        ExitStatus::Interrupted,
    ];

    /// The status of exit code `code`, as a record that carried it across a process boundary has it
    /// (a job member's failure, from its agent).
    pub fn from_code(code: i32) -> Option<ExitStatus> {
        Self::ALL.into_iter().find(|s| *s as i32 == code)
    }
}

/// An error that knows which documented exit status it means. Implemented by every error type of the
/// library: the binary accepts a library error only through this trait, so the compiler checks that
/// none lacks it.
pub trait Classify: std::error::Error {
    /// The exit code the binary should use for this error.
    fn exit_status(&self) -> ExitStatus;
}

/// Classifies an I/O error into an exit status; used by the stage errors.
pub fn io_exit_status(e: &std::io::Error) -> ExitStatus {
    match e.kind() {
        std::io::ErrorKind::NotFound => ExitStatus::NoSuchProcess,
        std::io::ErrorKind::PermissionDenied => ExitStatus::PermissionDenied,
        _ => match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EROFS) | Some(libc::EDQUOT) => ExitStatus::Storage,
            Some(libc::ESRCH) => ExitStatus::NoSuchProcess,
            Some(libc::EPERM) => ExitStatus::PermissionDenied,
            _ => ExitStatus::Failure,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_reads_back_from_its_code() {
        for s in ExitStatus::ALL {
            assert_eq!(ExitStatus::from_code(s as i32), Some(s));
        }
        assert_eq!(ExitStatus::from_code(0), None);
        assert_eq!(ExitStatus::from_code(11), None);
    }

    #[test]
    fn io_errors_map_to_documented_exit_statuses() {
        let os = std::io::Error::from_raw_os_error;
        // Full, over quota or read-only storage is "storage" (6) whatever io::ErrorKind std gives them:
        // the stages rely on this instead of checking these errnos themselves.
        for errno in [libc::ENOSPC, libc::EDQUOT, libc::EROFS] {
            assert_eq!(
                io_exit_status(&os(errno)),
                ExitStatus::Storage,
                "errno {errno}"
            );
        }
        assert_eq!(io_exit_status(&os(libc::ENOENT)), ExitStatus::NoSuchProcess);
        assert_eq!(io_exit_status(&os(libc::ESRCH)), ExitStatus::NoSuchProcess);
        assert_eq!(
            io_exit_status(&os(libc::EACCES)),
            ExitStatus::PermissionDenied
        );
        assert_eq!(
            io_exit_status(&os(libc::EPERM)),
            ExitStatus::PermissionDenied
        );
        assert_eq!(io_exit_status(&os(libc::EIO)), ExitStatus::Failure);
    }
}
