//! What a checkpoint records about itself: the `metadata` of its store manifest.
//!
//! The store's manifest (`STORE/manifests/ID.json`) holds the id, name, creation time, file list and
//! storage statistics (sizes stored, dedup, and `stats.ingest_ms`: the *write* phase, timed by the store
//! itself); its `metadata` object is a [`CheckpointManifest`]: host, kernel, CRIU, process tree, detect
//! report, strategy, options, the other phase timings and the image sizes. Users script against it:
//! fields are only ever added within a schema version.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::detect::{Report, StrategyName};
use crate::dump::devices::ReopenedDevice;
use crate::dump::{CriuOptions, CriuVersion, KeptNetworkLock};
use crate::freeze::GpuRecord;
use crate::proc::TreeProcess;

/// Names this JSON shape, so that a stray JSON file is never taken for a checkpoint manifest.
pub const SCHEMA: &str = "gpu-checkpoint/checkpoint";
/// Version of the shape; a reader refuses versions newer than it knows.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct CheckpointManifest {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// Always [`SCHEMA_VERSION`] for manifests this version writes.
    pub schema_version: u32,
    /// The checkpoint's id in its store.
    pub id: String,
    pub name: Option<String>,
    /// When the checkpoint started, in milliseconds since the Unix epoch (the store's `created` says the
    /// same in RFC 3339).
    pub started_unix_ms: u64,
    pub host: HostInfo,
    pub criu: CriuInfo,
    /// gpu-checkpoint's version that wrote this.
    pub tool_version: String,
    /// The root of the checkpointed tree.
    pub root_pid: i32,
    /// Every process of the tree, root first.
    pub process_tree: Vec<TreeProcess>,
    /// The detect report of the tree, as `gpu-checkpoint detect --tree --format json` prints it.
    pub detect: Report,
    /// The strategy used (the detect report's, e.g. `none` or `cuda-driver`).
    pub strategy: StrategyName,
    /// The GPU step's name and its record (`null` without GPU state); see [`super::GpuHook`].
    pub gpu_step: String,
    /// A [`GpuRecord`], kept as JSON here so that a record from a newer gpu-checkpoint is refused by
    /// [`CheckpointManifest::gpu_record`] with the GPU step's own error when it is used (restore), not as
    /// an unreadable manifest.
    pub gpu: serde_json::Value,
    pub options: OptionsRecord,
    /// Phase timings in milliseconds; the write phase is the store's `stats.ingest_ms`.
    pub timings_ms: PhaseTimings,
    pub sizes: Sizes,
    /// Device files CRIU's devices plugin recorded (NVIDIA nodes of processes without a CUDA context,
    /// nodes named with `--reopen-device`), reopened on restore; absent when there were none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<ReopenedDevice>,
    /// The container this checkpoint is of (`checkpoint --container`); absent for a process tree. Its
    /// images are the runtime's (runc's CRIU images and `descriptors.json`): only the container restore
    /// reads them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ContainerRecord>,
    /// CRIU's network lock this checkpoint left on its node for the restore (`--tcp-established`, the
    /// tree stopped): which, in which namespace, on which boot; absent when none was left (and in
    /// manifests written before the field existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_network_lock: Option<KeptNetworkLock>,
}

/// What a container checkpoint records about its container, for the restore.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ContainerRecord {
    /// `runc` or `runsc`: a restore must use the same.
    pub runtime: String,
    /// The runtime's global flags at checkpoint time (`--root`, `--runtime-arg`s), used again on restore.
    pub global_args: Vec<String>,
    /// The container's id.
    pub id: String,
    /// Its bundle folder (config.json, rootfs): the restore's default bundle.
    pub bundle: std::path::PathBuf,
    /// Its processes, init first: host PIDs (those of `process_tree`) and PIDs inside the container,
    /// through which the restore finds each GPU process again under its new host PID.
    pub processes: Vec<ContainerProcess>,
    /// CRIU's `--tcp-established` was given (the restore gives it again).
    #[serde(default)]
    pub tcp_established: bool,
    /// The cuda-checkpoint-compatible tool (a path inside the sandbox) that froze the GPU state inside
    /// a gVisor sandbox: the restore runs it again there. `None`: no GPU state was frozen inside.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_gpu_tool: Option<std::path::PathBuf>,
    /// The guest PIDs (inside the sandbox) whose GPU state that tool checkpointed; runsc's restore
    /// gives them back unchanged, so they are never mapped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sandbox_gpu_pids: Vec<i32>,
    /// The runtime froze that GPU state itself, with the tool (`runsc checkpoint
    /// --cuda-checkpoint-path`), and its restore puts it back: the restore runs nothing inside. An
    /// older gpu-checkpoint, which does not know this field, runs the tool on `sandbox_gpu_pids`,
    /// none: nothing either.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sandbox_gpu_by_runtime: bool,
}

/// One process of a container: its PID on the host and inside the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerProcess {
    /// Its PID on the host (this PID namespace).
    pub pid: i32,
    /// Its PID inside the container (the last of `NSpid`): what a restore gives it back.
    pub ns_pid: i32,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct HostInfo {
    pub hostname: String,
    /// `uname -r`.
    pub kernel: String,
    pub arch: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct CriuInfo {
    pub version: CriuVersion,
    pub path: String,
}

/// The options the checkpoint was taken with; restore reuses the CRIU ones
/// ([`CriuOptions::restore_options`]).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct OptionsRecord {
    pub leave_running: bool,
    /// The CRIU options, beside `leave_running` in JSON (`tcp_established`, `shell_job`, `file_locks`,
    /// `ghost_limit`, ...). A manifest written before an option existed reads it as its default.
    #[serde(flatten)]
    pub criu: CriuOptions,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct PhaseTimings {
    pub detect: f64,
    /// The GPU step's freeze (lock + checkpoint); 0 without GPU state.
    pub freeze: f64,
    /// CRIU's dump: images streamed into the store meanwhile (when `streamed`), or written to the staging
    /// folder.
    pub dump: f64,
    /// The images were streamed into the store during the dump (absent in older manifests: staged).
    #[serde(default)]
    pub streamed: bool,
}

/// Sizes of CRIU's images as written (before the store's chunking and compression).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct Sizes {
    pub image_files: u64,
    pub image_bytes: u64,
    /// The memory pages (`pages-*.img`), the bulk of a checkpoint.
    pub pages_bytes: u64,
}

impl Sizes {
    /// Measures the image files of a folder (not recursive: CRIU writes a flat folder).
    pub fn of_dir(dir: &Path) -> std::io::Result<Sizes> {
        let mut s = Sizes::default();
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let md = e.metadata()?;
            if !md.is_file() {
                continue;
            }
            s.image_files += 1;
            s.image_bytes += md.len();
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("pages-") && name.ends_with(".img") {
                s.pages_bytes += md.len();
            }
        }
        Ok(s)
    }

    /// Counts images that came as streams (they never were files in the folder).
    pub fn add_streamed<'a>(&mut self, files: impl Iterator<Item = (&'a str, u64)>) {
        for (name, size) in files {
            self.image_files += 1;
            self.image_bytes += size;
            if name.starts_with("pages-") && name.ends_with(".img") {
                self.pages_bytes += size;
            }
        }
    }
}

impl HostInfo {
    /// This machine.
    pub fn current() -> HostInfo {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        HostInfo {
            hostname: read("/proc/sys/kernel/hostname"),
            kernel: read("/proc/sys/kernel/osrelease"),
            arch: std::env::consts::ARCH.to_string(),
        }
    }
}

impl CheckpointManifest {
    /// Reads the manifest out of a store manifest's `metadata`, refusing what is not one or is newer than
    /// this build understands.
    pub fn from_metadata(metadata: &serde_json::Value) -> Result<CheckpointManifest, String> {
        let schema = metadata.get("schema").and_then(|s| s.as_str());
        if schema != Some(SCHEMA) {
            return Err(format!(
                "its metadata is not a gpu-checkpoint checkpoint manifest (schema {schema:?}, expected {SCHEMA:?})"
            ));
        }
        let version = metadata.get("schema_version").and_then(|v| v.as_u64());
        match version {
            Some(v) if v <= u64::from(SCHEMA_VERSION) => {}
            Some(v) => {
                return Err(format!(
                    "manifest schema version {v} is newer than this gpu-checkpoint understands ({SCHEMA_VERSION}); upgrade gpu-checkpoint"
                ))
            }
            None => return Err("manifest has no schema_version".into()),
        }
        serde_json::from_value(metadata.clone()).map_err(|e| format!("bad manifest: {e}"))
    }

    /// The GPU step's record, `None` for a checkpoint without GPU state; see [`GpuRecord::from_manifest`].
    pub fn gpu_record(&self) -> Result<Option<GpuRecord>, crate::freeze::Error> {
        GpuRecord::from_manifest(&self.gpu)
    }

    /// Every PID of the checkpointed tree, root first.
    pub fn pids(&self) -> Vec<i32> {
        self.process_tree.iter().map(|p| p.pid).collect()
    }
}
