//! Stage 3: dump and restore the CPU side of a process tree with CRIU (>= 4.0) over its RPC.
//!
//! [`Criu`] is the boundary: [`CriuRpc`] talks to a real CRIU through `criu swrk <fd>` (the same service
//! protocol libcriu, runc and Podman use); `FakeCriu` (`fake.rs`, compiled for unit tests only) stands in
//! for it in unit tests of the flows.
//! [`discover`] finds a CRIU that is new enough (`--criu`, `GPU_CHECKPOINT_CRIU`, `PATH`, the project's own
//! prefix filled by `scripts/install-criu.sh`).
//!
//! Every operation keeps CRIU's log (debug level) in a file the caller names; when CRIU fails the error
//! carries the log's `Error (...)` lines and its path, because CRIU's own answer over the RPC is only an errno.

mod container;
pub mod devices;
mod discover;
#[cfg(test)]
mod fake;
pub mod images;
mod kept_lock;
mod log;
mod network;
mod nft;
pub mod options;
pub mod pending;
mod rpc;
pub mod streamer;
pub mod swrk_notify;
pub mod swrk_proxy;

use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::exit::{Classify, ExitStatus};

pub use container::ContainerDump;
pub use discover::{discover, named, parse_version_output, CriuSource, FoundCriu, ENV_CRIU};
#[cfg(test)]
pub use fake::{FakeCriu, FakeCriuCall};
pub use kept_lock::{boot_id, KeptNetworkLock, LockState, Released};
pub use log::{error_lines, log_error_lines};
pub use network::{criu_lock_tables, outside_connections, LocksBefore, NetworkHold};
pub use options::{CgroupMode, CriuOptions, NetworkLock, RestoreOptions};
pub use pending::PendingCriu;
pub use rpc::CriuRpc;

/// The oldest CRIU we accept: 3.x cannot restore on recent kernels (vDSO) and lacks the tree handling
/// GPU processes need.
pub const MIN_VERSION: CriuVersion = CriuVersion {
    major: 4,
    minor: 0,
    sublevel: 0,
};

/// A CRIU release number.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct CriuVersion {
    pub major: u32,
    pub minor: u32,
    pub sublevel: u32,
}

impl fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.sublevel)
    }
}

/// What CRIU does with the tree once its images are written. CRIU's third choice, killing the tree, is
/// deliberately not offered: the flow kills only after the checkpoint is durable in the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AfterDump {
    /// The tree resumes right away (`leave_running`): periodic checkpoints of a job that goes on.
    KeepRunning,
    /// The tree stays stopped (SIGSTOP, `leave_stopped`) so that it does nothing the checkpoint would not
    /// contain, until the caller kills it (checkpoint durable) or continues it (checkpoint failed).
    Stop,
}

/// One dump of the process tree rooted at `pid` into `images_dir`.
#[derive(Debug, Clone)]
pub struct DumpRequest<'a> {
    pub pid: i32,
    /// Where CRIU writes its images (and the log, and `stats-dump`).
    pub images_dir: &'a Path,
    /// Name of CRIU's log file, created inside `images_dir` (CRIU allows no sub-folders here).
    pub log_file: &'a str,
    pub after: AfterDump,
    /// The options users pass to CRIU (`--tcp-established`, `--file-locks`, ...).
    pub options: &'a CriuOptions,
    /// CRIU sends its images to the image streamer listening in `images_dir` ([`streamer`]) instead of
    /// writing them there (CRIU's `--stream`); only its log is written to `images_dir`.
    pub stream: bool,
    /// Variables CRIU runs with, on top of ours ([`devices::PluginDir::env`]: its plugin folder).
    pub env: &'a [(OsString, OsString)],
    /// The tree is a container's, dumped from outside its runtime with the runtime's settings.
    pub container: Option<&'a ContainerDump>,
}

/// One restore of the images in `images_dir`; the tree is restored detached (re-parented to init).
#[derive(Clone)]
pub struct RestoreRequest<'a> {
    pub images_dir: &'a Path,
    /// Name of CRIU's log file, created inside `images_dir`.
    pub log_file: &'a str,
    /// The options CRIU needs on restore ([`CriuOptions::restore_options`]).
    pub options: &'a CriuOptions,
    /// CRIU asks the image streamer listening in `images_dir` for its images (`--stream`).
    pub stream: bool,
    /// CRIU leaves the pages its pagemaps mark lazy to a userfaultfd handler listening on
    /// `lazy-pages.socket` in `images_dir` (`--lazy-pages`; not with `stream`).
    pub lazy_pages: bool,
    /// Called at CRIU's post-restore notification (every process restored, none resumed yet); an error
    /// makes CRIU kill the restored tree and fail.
    pub post_restore: Option<&'a PostRestore<'a>>,
    /// Variables CRIU runs with, on top of ours ([`devices::PluginDir::env`]: its plugin folder).
    pub env: &'a [(OsString, OsString)],
}

/// A hook run at CRIU's post-restore notification; its error is the restore's.
pub type PostRestore<'a> = dyn Fn() -> Result<(), String> + Sync + 'a;

impl std::fmt::Debug for RestoreRequest<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoreRequest")
            .field("images_dir", &self.images_dir)
            .field("log_file", &self.log_file)
            .field("options", &self.options)
            .field("stream", &self.stream)
            .field("lazy_pages", &self.lazy_pages)
            .field("post_restore", &self.post_restore.is_some())
            .field("env", &self.env)
            .finish()
    }
}

/// What `criu check` said about this kernel.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CheckOutcome {
    /// `criu check` exited 0 ("Looks good").
    pub ok: bool,
    /// Its output (stdout and stderr).
    pub output: String,
}

/// The boundary to CRIU. Implementations: [`CriuRpc`] (real) and `FakeCriu` (unit tests only).
pub trait Criu: Send + Sync {
    /// The CRIU binary (or a description of the fake), for messages and the manifest.
    fn describe(&self) -> String;
    /// CRIU's version, as CRIU itself reports it.
    fn version(&self) -> Result<CriuVersion, Error>;
    /// Fails when this process may not checkpoint or restore (CRIU needs root); called before anything
    /// is touched.
    fn check_permitted(&self) -> Result<(), Error>;
    /// Runs `criu check` (kernel features CRIU needs).
    fn check(&self) -> Result<CheckOutcome, Error>;
    /// Dumps the tree. On error the tree is left running (CRIU resumes every task it seized).
    fn dump(&self, req: &DumpRequest<'_>) -> Result<(), Error>;
    /// Restores the tree detached and returns the PID of its root.
    fn restore(&self, req: &RestoreRequest<'_>) -> Result<i32, Error>;
}

/// Which CRIU operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Version,
    Check,
    Dump,
    Restore,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Version => "version",
            Op::Check => "check",
            Op::Dump => "dump",
            Op::Restore => "restore",
        })
    }
}

/// A failed CRIU operation, with what CRIU said.
#[derive(Debug, Clone)]
pub struct Failure {
    pub op: Op,
    /// The errno CRIU reported over the RPC, when it reported one.
    pub errno: Option<i32>,
    /// CRIU's own error message over the RPC (CRIU >= 3.15), when it sent one.
    pub message: Option<String>,
    /// The `Error (...)` lines of CRIU's log (the last few).
    pub error_lines: Vec<String>,
    /// Where the log is; the checkpoint flow moves it out of the staging folder before reporting.
    pub log: Option<PathBuf>,
    /// What the failure means, for the exit code.
    pub kind: FailureKind,
}

/// The class of a CRIU failure, read from the errno and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    NoSuchProcess,
    PermissionDenied,
    /// The images folder ran out of space (or quota).
    StorageFull,
    /// Restore: a PID of the tree is taken by another process.
    PidInUse,
    Other,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CRIU {} failed", self.op)?;
        // The log's error lines include CRIU's message (its first error), in context.
        if !self.error_lines.is_empty() {
        } else if let Some(msg) = self.message.as_deref().filter(|m| !m.is_empty()) {
            write!(f, ": {msg}")?;
        } else if let Some(errno) = self.errno.filter(|e| *e != 0) {
            write!(f, ": {}", std::io::Error::from_raw_os_error(errno))?;
        }
        for line in &self.error_lines {
            write!(f, "\n  {line}")?;
        }
        if let Some(hint) = self.hint() {
            write!(f, "\n  {hint}")?;
        }
        if let Some(log) = &self.log {
            write!(f, "\n  CRIU log: {}", log.display())?;
        }
        Ok(())
    }
}

impl Failure {
    /// What the user can do about a failure the tool knows a way around.
    pub fn hint(&self) -> Option<&'static str> {
        let said = |needle: &str| self.error_lines.iter().any(|l| l.contains(needle));
        // CRIU's RPC answers EBADRQC for any failure to set up the request, which comes before its log
        // exists: alone, "Invalid request code" sends the user looking at the options (issue 18: it was the
        // images folder, removed under CRIU).
        if self.errno == Some(libc::EBADRQC) && self.error_lines.is_empty() {
            return Some(
                "hint: CRIU could not set up the request (EBADRQC): open the images folder, enter it, create \
                 its log there, or take an option; check that the folder still exists and is writable",
            );
        }
        (self.op == Op::Dump && said("Can't dump file") && said("(chr ")).then_some(
            "hint: a process holds a character device CRIU cannot dump; if it only holds it open (no \
             mapping), `--reopen-device PATH` (the path `ls -l /proc/PID/fd` shows) records it and \
             reopens it at the same descriptor number on restore",
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("CRIU not found (tried: {}); run scripts/install-criu.sh, or pass --criu PATH / set {ENV_CRIU} to a CRIU >= {MIN_VERSION}", tried.join("; "))]
    NotFound { tried: Vec<String> },
    #[error("CRIU at {} is version {version}; gpu-checkpoint needs CRIU >= {MIN_VERSION} (run scripts/install-criu.sh for a private copy)", path.display())]
    TooOld { path: PathBuf, version: CriuVersion },
    #[error("checkpoint and restore need root (CRIU ptraces and re-creates processes); run gpu-checkpoint as root")]
    NotRoot,
    #[error("the CRIU plugin that reopens device files ({}) is not there: build the workspace (cargo build), or name the plugin with {}", path.display(), devices::ENV_PLUGIN)]
    PluginMissing { path: PathBuf },
    #[error("cannot run CRIU at {}: {source}", path.display())]
    Spawn {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Failed(Failure),
    #[error("talking to CRIU ({} swrk): {detail}", path.display())]
    Protocol { path: PathBuf, detail: String },
    #[error("{0}")]
    NetworkLockElsewhere(Box<kept_lock::Elsewhere>),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::NotFound { .. } | Error::TooOld { .. } | Error::PluginMissing { .. } => {
                ExitStatus::ToolMissing
            }
            Error::NotRoot => ExitStatus::PermissionDenied,
            Error::Spawn { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => ExitStatus::ToolMissing,
                _ => crate::exit::io_exit_status(source),
            },
            Error::Failed(f) => match f.kind {
                FailureKind::NoSuchProcess => ExitStatus::NoSuchProcess,
                FailureKind::PermissionDenied => ExitStatus::PermissionDenied,
                FailureKind::StorageFull => ExitStatus::Storage,
                FailureKind::PidInUse => ExitStatus::Conflict,
                FailureKind::Other => ExitStatus::Failure,
            },
            Error::Protocol { .. } => ExitStatus::Failure,
            Error::NetworkLockElsewhere { .. } => ExitStatus::Conflict,
            Error::Io { source, .. } => crate::exit::io_exit_status(source),
        }
    }
}

impl Error {
    /// The CRIU failure inside this error, if it is one.
    pub fn failure(&self) -> Option<&Failure> {
        match self {
            Error::Failed(f) => Some(f),
            _ => None,
        }
    }

    /// Points a failure at the log's new place (after the flow moved it out of a folder it removes).
    pub fn with_log_path(mut self, path: PathBuf) -> Self {
        if let Error::Failed(f) = &mut self {
            f.log = Some(path);
        }
        self
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}
