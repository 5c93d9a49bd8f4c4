//! The engines' path: gpu-checkpoint standing in for runc, so that every runc-based container engine
//! (containerd's CRI and so the kubelet's checkpoint API, CRI-O, podman, and `runc checkpoint` itself)
//! gets GPU-aware checkpoints and restores without knowing it (docs/kubernetes.md).
//!
//! **Why a runtime wrapper** (and not a CRIU plugin, nor a stand-in for runc's CRIU): the engines run
//! their OCI runtime by a path they are configured with (containerd's runc option `BinaryName`, CRI-O's
//! `runtime_path`, podman's `--runtime` / `containers.conf`), and a program there sees, for a checkpoint,
//! the container's id, runc's root, the images folder and whether the container runs on, *before* any of
//! its processes is touched. So it can
//! - refuse what cannot be checkpointed with a reason the engine hands its caller (runc's failure and
//!   output are the CRI error the kubelet returns), before the container is touched: a CRIU plugin runs
//!   once CRIU has seized the tree, and a CRIU stand-in could only fail runc's request with a number;
//! - freeze the GPU state of every CUDA process of the container together (the freeze stage's lock of
//!   all, then checkpoint of all, in parallel), where CRIU's plugins are called one process at a time;
//! - add its record to the images folder (`gpu-checkpoint.json`), which every engine packs into its
//!   checkpoint archive unchanged (containerd and podman tar the whole folder as `checkpoint/`), so the
//!   engine's own archive format is kept and `checkpointctl` still reads it;
//! - on restore, read that record and the new container's bundle (the GPUs it was given) and refuse a
//!   node or a container that cannot take the GPU state before runc creates anything.
//!
//! Every other command is handed to the real runc unchanged (`exec`: same PID, same descriptors), and so
//! is a checkpoint or restore of a container without GPU state, except that runc is given our CRIU
//! (`--criu`) with an empty plugin folder, so that no CRIU cuda plugin drives the CUDA state machine
//! beside us (KEP-6274: one integration owner).
//!
//! Checkpoint (`checkpoint.rs`), restore (`restore.rs`): built on the stages (detect, the freeze stage's
//! [`crate::freeze::GpuHook`], the container flow's discovery and PID map, the GPU record of the
//! manifest), not on a copy of the container flow.

mod checkpoint;
pub mod node;
mod record;
mod restore;
pub mod runc_args;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::exit::{Classify, ExitStatus};
use crate::freeze::GpuBackend;
pub use record::{given_gpus, ArchiveRecord, Given, GPU_ENV, RECORD_FILE};
pub use runc_args::RuncCall;

/// The wrapper's configuration: one file per node, written by `gpu-checkpoint node-setup`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeConfig {
    /// `gpu-checkpoint/node-config`.
    pub schema: String,
    pub version: u32,
    /// The real runc.
    pub runtime: PathBuf,
    /// The CRIU runc is given (`--criu`); `None`: runc's own choice.
    #[serde(default)]
    pub criu: Option<PathBuf>,
    /// An empty folder CRIU looks for plugins in (`CRIU_LIBS_DIR`), so that CRIU's cuda plugin, if
    /// installed, stays out of it; `None`: CRIU's default.
    #[serde(default)]
    pub criu_plugins: Option<PathBuf>,
    /// The GPU backend (`auto`; `sim` only on test nodes, which say SIMULATED).
    pub gpu_backend: GpuBackend,
    /// How long the lock of a CUDA process may wait for its submitted work.
    #[serde(default)]
    pub lock_timeout_ms: Option<u64>,
    /// Where the guardian reports what it put back after a wrapper died (appended); `None`: nowhere.
    /// Not the wrapper's own output, which the engine reads to its end.
    #[serde(default)]
    pub guardian_log: Option<PathBuf>,
}

/// `schema` of [`NodeConfig`].
pub const CONFIG_SCHEMA: &str = "gpu-checkpoint/node-config";
/// The newest [`NodeConfig`] layout this build reads.
pub const CONFIG_VERSION: u32 = 1;

impl NodeConfig {
    pub fn read(path: &Path) -> Result<NodeConfig, Error> {
        let bad = |reason: String| Error::Config {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
        if v.get("schema").and_then(|s| s.as_str()) != Some(CONFIG_SCHEMA) {
            return Err(bad(format!("not a {CONFIG_SCHEMA} file")));
        }
        if v.get("version")
            .and_then(|s| s.as_u64())
            .is_none_or(|n| n > u64::from(CONFIG_VERSION))
        {
            return Err(bad(format!(
                "version newer than this gpu-checkpoint reads ({CONFIG_VERSION})"
            )));
        }
        serde_json::from_value(v).map_err(|e| bad(e.to_string()))
    }

    pub fn lock_timeout(&self) -> Option<Duration> {
        self.lock_timeout_ms.map(Duration::from_millis)
    }

    /// The simulator is chosen explicitly (a test node): said on every checkpoint and restore.
    pub fn simulated(&self) -> bool {
        self.gpu_backend == GpuBackend::Sim
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the node configuration {}: {reason}", path.display())]
    Config { path: PathBuf, reason: String },
    #[error("runc's command line: {0}")]
    CommandLine(String),
    #[error("refusing to checkpoint container {id} (nothing was touched): {reason}")]
    Refused { id: String, reason: String },
    #[error("refusing to restore container {id} (nothing was created): {reason}")]
    RestoreRefused { id: String, reason: String },
    #[error("the checkpoint's GPU record {}: {reason}", path.display())]
    Record { path: PathBuf, reason: String },
    #[error("runc {command} of {id} failed ({status})")]
    Runc {
        command: String,
        id: String,
        status: String,
    },
    #[error("the GPU state of restored container {id}: {source}; the container was deleted")]
    GpuRestore {
        id: String,
        #[source]
        source: Box<crate::Error>,
    },
    #[error("{0}")]
    Io(String),
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::Config { .. } | Error::CommandLine(_) => ExitStatus::Usage,
            Error::Refused { .. } => ExitStatus::Unsupported,
            Error::RestoreRefused { .. } => ExitStatus::Conflict,
            Error::Record { .. } => ExitStatus::CheckpointInvalid,
            Error::Runc { .. } | Error::Io(_) => ExitStatus::Failure,
            Error::GpuRestore { source, .. } => source.exit_status(),
        }
    }
}

/// What the wrapper does for runc's command line `call`.
pub enum Plan {
    /// Hand it to the real runc as it is (with our CRIU for a checkpoint or restore).
    Exec(Vec<OsString>),
    /// A checkpoint: ours around runc's.
    Checkpoint,
    /// A restore: ours around runc's.
    Restore,
}

/// Decides what to do with `call`: only a `checkpoint` or `restore` of one container is ours.
pub fn plan(call: &RuncCall, config: &NodeConfig) -> Plan {
    let criu = config.criu.as_deref();
    match (call.command.as_deref(), call.id()) {
        (Some("checkpoint"), Some(_)) => Plan::Checkpoint,
        (Some("restore"), Some(_)) => Plan::Restore,
        (Some("checkpoint" | "restore"), None) => Plan::Exec(call.with_criu(criu)),
        _ => Plan::Exec(call.args.clone()),
    }
}

/// The environment runc is run with for a checkpoint or restore: CRIU's plugin folder, so that no CRIU
/// plugin acts on the GPU state behind us.
pub fn runc_env(config: &NodeConfig) -> Vec<(&'static str, OsString)> {
    config
        .criu_plugins
        .iter()
        .map(|p| ("CRIU_LIBS_DIR", p.as_os_str().to_owned()))
        .collect()
}

/// Appends `msg` to runc's log (`--log`, in its `--log-format`) as an error, where engines read the
/// reason of a failed runc command (containerd's shim reports the log's last error of a failed restore;
/// the runc process's own output goes to the container's stdio there).
pub fn log_error(call: &RuncCall, msg: &str) {
    let Some(path) = call.global_value("log").filter(|p| !p.is_empty()) else {
        return;
    };
    // No time: a reader takes a line without one (containerd's decodes `level` and `msg`).
    let line = if call.global_value("log-format") == Some("json") {
        serde_json::json!({"level": "error", "msg": msg}).to_string()
    } else {
        format!("level=error msg={msg:?}")
    };
    let opened = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path);
    if let Ok(mut f) = opened {
        use std::io::Write;
        let _ = writeln!(f, "{line}");
    }
}

/// One runc command line of an engine, handled on the node `config` describes.
pub struct Engine<'a> {
    pub config: &'a NodeConfig,
    pub call: &'a RuncCall,
    /// The real runc with the call's root and flags, for `state`, `pause`, `resume`, `delete`.
    pub runtime: &'a dyn crate::flows::runtime::ContainerRuntime,
    /// Runs the real runc with a command line (its output goes where the engine reads ours); its exit
    /// code.
    pub real: &'a dyn Fn(&[OsString]) -> Result<i32, Error>,
    /// Who finishes or undoes our part should this process die ([`crate::flows::guardian`]).
    pub watch: &'a dyn crate::flows::Watch,
}

impl Engine<'_> {
    /// The freeze stage, as this node is configured, restoring onto `device_map`'s GPUs.
    fn hook(&self, device_map: Option<crate::freeze::DeviceMap>) -> crate::freeze::FreezeHook {
        crate::freeze::FreezeHook::new(crate::freeze::HookOptions {
            backend: self.config.gpu_backend,
            group: crate::freeze::GroupOptions {
                lock_timeout: self.config.lock_timeout(),
                ordered: false,
            },
            device_map,
        })
    }

    /// The GPUs a bundle's spec gives its container, as this node's UUIDs; `None` where it names none
    /// or this node's GPUs cannot be listed (the record then keeps the GPUs the processes used).
    fn given_gpus(&self, bundle: &Path) -> Option<Vec<crate::freeze::GpuUuid>> {
        let spec = read_spec(bundle).ok()?;
        let given = given_gpus(&spec).ok()?;
        if given == Given::Unset {
            return None;
        }
        let node = crate::freeze::open(self.config.gpu_backend)
            .ok()?
            .gpus()
            .ok()?;
        let gpus = record::resolve(&given, &node).ok()??;
        Some(gpus.iter().map(|g| g.uuid).collect())
    }
}

/// A bundle's OCI spec (`config.json`).
fn read_spec(bundle: &Path) -> Result<serde_json::Value, Error> {
    let path = bundle.join("config.json");
    let bytes = std::fs::read(&path).map_err(|e| Error::Io(format!("{}: {e}", path.display())))?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Io(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests;
