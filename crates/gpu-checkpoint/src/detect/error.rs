//! Errors of the detect stage. Each one names the file (and line) it is about, so that a user reading a
//! report from another machine can see what was wrong with it.

use std::path::PathBuf;

use crate::exit::{io_exit_status, Classify, ExitStatus};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The process does not exist, or it exited while we were reading it.
    #[error("no process {pid} (no {path})")]
    NoSuchProcess { pid: i32, path: PathBuf },

    /// A /proc file exists but we may not read it (not root, or another user's process).
    #[error("permission denied reading {path} (run as root or as the process's owner)")]
    PermissionDenied { path: PathBuf },

    /// Kernel threads have no user memory and no GPU state; there is nothing to checkpoint.
    #[error(
        "pid {pid} is a kernel thread ({comm}): it holds no user state and cannot be checkpointed"
    )]
    KernelThread { pid: i32, comm: String },

    /// The pid is a thread of another process: checkpoints act on whole processes.
    #[error("pid {tid} is a thread of process {tgid}; pass --pid {tgid}")]
    Thread { tid: i32, tgid: i32 },

    /// `--proc-root` does not look like a /proc tree (live or captured).
    #[error("{path} is not a /proc tree: {reason}")]
    NotProcTree { path: PathBuf, reason: String },

    /// A /proc file whose content we cannot parse (a malformed maps line, a stat without its fields).
    #[error("{}{}: {reason}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Malformed {
        path: PathBuf,
        /// 1-based line number, where the file is line-oriented.
        line: Option<usize>,
        reason: String,
    },

    /// This platform has no /proc (detection needs Linux's, or a captured tree given with `--proc-root`).
    #[error("/proc is not available on this platform; pass --proc-root with a tree captured on Linux (scripts/capture-proc.sh)")]
    ProcUnavailable,

    /// Any other I/O failure.
    #[error("reading {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::NoSuchProcess { .. } => ExitStatus::NoSuchProcess,
            Error::PermissionDenied { .. } => ExitStatus::PermissionDenied,
            Error::KernelThread { .. }
            | Error::Thread { .. }
            | Error::NotProcTree { .. }
            | Error::Malformed { .. } => ExitStatus::Usage,
            Error::ProcUnavailable => ExitStatus::Failure,
            Error::Io { source, .. } => match io_exit_status(source) {
                // A NotFound that reached here is not "no such process" (those are mapped before): keep
                // the generic code rather than mislead.
                ExitStatus::NoSuchProcess => ExitStatus::Failure,
                s => s,
            },
        }
    }
}

impl Error {
    /// True when the error only means that the process went away while we looked at it.
    pub fn is_vanished(&self) -> bool {
        matches!(self, Error::NoSuchProcess { .. })
    }
}
