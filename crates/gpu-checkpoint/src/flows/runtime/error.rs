//! The container flow's errors, each with its exit code.

use std::path::{Path, PathBuf};

use crate::exit::{Classify, ExitStatus};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A container id that would not be safe on a runtime's command line or in a path (the reason quotes
    /// it escaped).
    #[error("bad {reason}")]
    BadId { reason: String },
    #[error("{runtime} not found ({what}); scripts/install-containers.sh installs it")]
    RuntimeMissing { runtime: String, what: String },
    #[error("no container {id} in {runtime} (root {root})")]
    NoSuchContainer {
        runtime: String,
        id: String,
        root: String,
    },
    #[error("container {id} is {status}, not running: nothing to checkpoint")]
    NotRunning { id: String, status: String },
    #[error("a container {id} already exists in {runtime}; restore under another --container id, or delete it first")]
    Exists { runtime: String, id: String },
    #[error("`{command}` failed ({status}): {stderr}{}", log.as_ref().map(|l| format!(" (log kept: {})", l.display())).unwrap_or_default())]
    Runtime {
        command: String,
        status: String,
        stderr: String,
        /// The runtime's or CRIU's log, copied out of the work folder.
        log: Option<PathBuf>,
    },
    #[error("cannot run {runtime}: {source}")]
    Spawn {
        runtime: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{runtime} said something unexpected: {reason}")]
    Protocol { runtime: String, reason: String },
    #[error("checkpoint {id} is not a container checkpoint (it was taken with --pid): restore it without --container")]
    NotAContainerCheckpoint { id: String },
    #[error(
        "checkpoint {id} was taken with {taken}; restore it with --runtime {taken}, not {given}"
    )]
    WrongRuntime {
        id: String,
        taken: String,
        given: String,
    },
    #[error("container {id}: {reason}")]
    Processes { id: String, reason: String },
    #[error("refusing to checkpoint container {id} (nothing was touched): {reason}")]
    Unsupported { id: String, reason: String },
    #[error("checkpoint archive {}: {reason}", path.display())]
    Archive { path: PathBuf, reason: String },
    #[error("no bundle recorded for checkpoint {id} (imported from an archive): restore it with --bundle DIR")]
    NoBundle { id: String },
    #[error("the checkpoint's root file system changes for {}: {reason}; nothing was changed or restored", rootfs.display())]
    RootfsChanges { rootfs: PathBuf, reason: String },
    #[error("a work folder for the runtime: {} ({source})", path.display())]
    WorkDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// An I/O failure on `path` (a work folder, an images folder, a root file system), for `map_err`.
    pub fn io_at(path: &Path) -> impl Fn(std::io::Error) -> Error + Copy + '_ {
        move |source| Error::WorkDir {
            path: path.to_path_buf(),
            source,
        }
    }
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::RuntimeMissing { .. } => ExitStatus::ToolMissing,
            Error::NoSuchContainer { .. } => ExitStatus::NoSuchProcess,
            Error::NotRunning { .. } | Error::Exists { .. } => ExitStatus::Conflict,
            Error::BadId { .. }
            | Error::NotAContainerCheckpoint { .. }
            | Error::WrongRuntime { .. }
            | Error::Archive { .. }
            | Error::NoBundle { .. }
            | Error::RootfsChanges { .. } => ExitStatus::Usage,
            Error::Runtime { .. }
            | Error::Spawn { .. }
            | Error::Protocol { .. }
            | Error::Processes { .. } => ExitStatus::Failure,
            Error::Unsupported { .. } => ExitStatus::Unsupported,
            Error::WorkDir { source, .. } => crate::exit::io_exit_status(source),
        }
    }
}
