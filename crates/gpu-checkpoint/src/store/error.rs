//! The store's error type and how each failure maps to the binary's exit status.

use std::io;
use std::path::{Path, PathBuf};

use crate::exit::{Classify, ExitStatus};

/// Where something is in a store, for messages: a file path for the local backend, a URL for an object
/// store (`s3://bucket/prefix/chunks/ab/...`). Errors carry this, not a `PathBuf`, so that a backend which
/// is not a file system can say where it failed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Location(String);

impl Location {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&Path> for Location {
    fn from(p: &Path) -> Location {
        Location(p.display().to_string())
    }
}

impl From<PathBuf> for Location {
    fn from(p: PathBuf) -> Location {
        Location::from(p.as_path())
    }
}

impl From<&PathBuf> for Location {
    fn from(p: &PathBuf) -> Location {
        Location::from(p.as_path())
    }
}

impl From<String> for Location {
    fn from(s: String) -> Location {
        Location(s)
    }
}

impl From<&str> for Location {
    fn from(s: &str) -> Location {
        Location(s.to_owned())
    }
}

impl From<&Location> for Location {
    fn from(l: &Location) -> Location {
        l.clone()
    }
}

/// Everything that can go wrong in the store. Messages name the storage path, the checkpoint, the file and
/// the chunk wherever they are known, because "a chunk is damaged" alone is not actionable.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O operation on the store failed (`op` says which, `path` where).
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: Location,
        #[source]
        source: io::Error,
    },

    /// The storage cannot be written (read-only, no permission, full): checked before a process is touched.
    #[error("storage {path} is not writable: {source}")]
    Unwritable {
        path: Location,
        #[source]
        source: io::Error,
    },

    /// The storage cannot be read by this user (a root-owned 0700 store read by another user): permission
    /// denied (exit status 4), not a full or read-only storage.
    #[error("storage {path} cannot be read: {source}")]
    Unreadable {
        path: Location,
        #[source]
        source: io::Error,
    },

    /// A local store this process must not trust: another user's, open to others, or holding a link where
    /// its own folders and files belong (see `store::backend::trust`). Permission denied: exit status 4.
    #[error("refusing storage {path}: it {reason}")]
    Untrusted { path: Location, reason: String },

    /// A store of another user, trusted for reading only (`--trust-store-owner`), was asked to change.
    #[error(
        "storage {path} belongs to {owner}, trusted for reading only (--trust-store-owner): nothing is \
         written, changed or removed in it"
    )]
    ReadOnly { path: Location, owner: String },

    /// The storage path exists but is not a gpu-checkpoint store, or one of a format this build cannot read.
    #[error("{path}: {reason}")]
    BadStore { path: Location, reason: String },

    /// No checkpoint with this id or name.
    #[error("no checkpoint {what:?} in storage {storage}")]
    NotFound { what: String, storage: Location },

    /// A manifest is unreadable, fails its own checksum, or has an unsupported version.
    #[error("checkpoint {checkpoint}: manifest {path} is damaged: {reason}")]
    DamagedManifest {
        checkpoint: String,
        path: Location,
        reason: String,
    },

    /// Trusted keys were given (`--trust-key`) and the checkpoint's manifest is unsigned, signed by
    /// another key, or does not match its signature: refused before anything of it is read (exit 4).
    #[error("refusing checkpoint {checkpoint}: {reason}")]
    UntrustedCheckpoint { checkpoint: String, reason: String },

    /// A chunk a checkpoint needs is missing, truncated or does not hash to its name.
    #[error(
        "checkpoint {checkpoint}: file {file}: chunk #{index} {chunk} (offset {offset}, {len} bytes) is {problem}"
    )]
    DamagedChunk {
        checkpoint: String,
        file: String,
        index: usize,
        chunk: String,
        offset: u64,
        len: u64,
        problem: String,
    },

    /// `verify` found problems; the report lists them all.
    #[error("verify found {count} problem(s); first: {first}")]
    VerifyFailed { count: usize, first: String },

    /// A bad checkpoint name or bad store options (a usage error).
    #[error("{0}")]
    Invalid(String),

    /// zstd could not be set up (`op` says what was being created).
    #[error("{op}: {source}")]
    Zstd {
        op: &'static str,
        #[source]
        source: io::Error,
    },

    /// An image file changed size while it was being stored (CRIU still writing?): a torn image is refused.
    #[error("image file {} changed size during ingest ({before} -> {after} bytes)", path.display())]
    ImageChanged {
        path: PathBuf,
        before: u64,
        after: u64,
    },

    /// One image came both through a stream and as a file in the staging folder.
    #[error("image {name} was both streamed and written to the staging folder")]
    ImageTwice { name: String },

    /// A streamed image ended before its end (its writer stopped).
    #[error("image {name} was not received to its end")]
    ImageIncomplete { name: String },

    /// Reading a streamed image's bytes from its pipe failed.
    #[error("receiving image {name}: {source}")]
    Receive {
        name: String,
        #[source]
        source: io::Error,
    },

    /// The staging folder holds something the store cannot keep: a name that is not UTF-8, or an entry that
    /// is not a regular file or folder.
    #[error("{}: {reason}", path.display())]
    Unstorable { path: PathBuf, reason: &'static str },

    /// A path the store must hand to the kernel holds a NUL byte.
    #[error("path {} contains a NUL byte", path.display())]
    NulInPath { path: PathBuf },

    /// The streaming session failed earlier; this is its first error's message, for the streams that ran
    /// into it (the error itself, with its kind, is what the session reports).
    #[error("{first}")]
    SessionFailed { first: String },

    /// The caller's sink of verified chunks (a [`Store::visit_chunks`](super::Store::visit_chunks) visitor,
    /// such as the userfaultfd restore copying them into processes) failed: its own error, carried through
    /// the store's workers unchanged.
    #[error(transparent)]
    Sink(Box<dyn std::error::Error + Send + Sync>),

    /// A broken invariant of the store's own code (a bug): the operation stops rather than store something
    /// wrong.
    #[error("internal: {0}")]
    Internal(String),

    /// Another writer got in the way (id collision, lock held) in a way that retrying may fix.
    #[error("{0}")]
    Conflict(String),
}

impl Classify for Error {
    /// The binary's exit status for this error (see [`crate::exit::ExitStatus`]).
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::Io { source, .. } => io_status(source),
            Error::Unwritable { .. } => ExitStatus::Storage,
            Error::Unreadable { .. }
            | Error::Untrusted { .. }
            | Error::UntrustedCheckpoint { .. } => ExitStatus::PermissionDenied,
            Error::ReadOnly { .. } => ExitStatus::Storage,
            Error::BadStore { .. } => ExitStatus::Failure,
            Error::NotFound { .. }
            | Error::DamagedManifest { .. }
            | Error::DamagedChunk { .. }
            | Error::VerifyFailed { .. } => ExitStatus::CheckpointInvalid,
            Error::Invalid(_) => ExitStatus::Usage,
            Error::Zstd { .. }
            | Error::ImageChanged { .. }
            | Error::ImageTwice { .. }
            | Error::ImageIncomplete { .. }
            | Error::Receive { .. }
            | Error::Unstorable { .. }
            | Error::NulInPath { .. }
            | Error::SessionFailed { .. }
            | Error::Sink(_)
            | Error::Internal(_) => ExitStatus::Failure,
            Error::Conflict(_) => ExitStatus::Conflict,
        }
    }
}

impl Error {
    /// Shorthand used all over the store: wraps an `io::Error` with the operation and the path.
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<Location>,
    ) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}

/// Storage-side I/O errors: full, read-only or over quota means "storage" (6); the rest is a plain failure.
/// (The crate-wide `io_exit_status` maps NotFound to "no such process", which is wrong for files here.)
fn io_status(e: &io::Error) -> ExitStatus {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EROFS) | Some(libc::EDQUOT) | Some(libc::EACCES) => {
            ExitStatus::Storage
        }
        _ if e.kind() == io::ErrorKind::PermissionDenied => ExitStatus::Storage,
        // Storage that kept failing until the retries ran out (an object store down or throttling).
        _ if e.kind() == io::ErrorKind::TimedOut => ExitStatus::Storage,
        _ => ExitStatus::Failure,
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    fn io(errno: i32) -> Error {
        Error::io("cannot write chunk", "/s/chunks/ab/x")(io::Error::from_raw_os_error(errno))
    }

    #[test]
    fn exit_statuses_follow_the_contract() {
        assert_eq!(io(libc::ENOSPC).exit_status(), ExitStatus::Storage);
        assert_eq!(io(libc::EROFS).exit_status(), ExitStatus::Storage);
        assert_eq!(io(libc::EACCES).exit_status(), ExitStatus::Storage);
        assert_eq!(io(libc::EIO).exit_status(), ExitStatus::Failure);
        let nf = Error::NotFound {
            what: "x".into(),
            storage: "/s".into(),
        };
        assert_eq!(nf.exit_status(), ExitStatus::CheckpointInvalid);
        assert_eq!(
            Error::Conflict("c".into()).exit_status(),
            ExitStatus::Conflict
        );
        assert_eq!(
            Error::Internal("a chunk was lost".into()).exit_status(),
            ExitStatus::Failure
        );
        assert_eq!(
            Error::ImageTwice { name: "x".into() }.exit_status(),
            ExitStatus::Failure
        );
        // Messages name the operation and the path.
        let msg = io(libc::ENOSPC).to_string();
        assert!(
            msg.contains("cannot write chunk") && msg.contains("/s/chunks/ab/x"),
            "{msg}"
        );
    }
}
