//! The checkpoint flow: detect -> plan -> GPU freeze -> CRIU dump -> store, nothing lost on failure.
//!
//! Order, and why:
//! 1. Everything that can refuse does so before the process is touched: the PID exists, the store is
//!    writable, no other checkpoint of this PID runs (per-PID lock), detect does not say `unsupported`.
//! 2. GPU freeze (the [`GpuHook`]), then CRIU dumps the tree into the store's staging folder. CRIU never
//!    kills the tree: it leaves it running (`--leave-running`) or stopped (SIGSTOP, the default), so a
//!    failure of anything until the checkpoint is durable is undone by continuing the tree.
//! 3. The store commits the checkpoint: every chunk durable, then the manifest (the checkpoint exists
//!    only from that moment on).
//! 4. Only then, without `--leave-running`, the tree is killed (migration).
//!
//! The tree stays stopped (not running) between the dump and the kill so that it does nothing the
//! checkpoint would not contain: files written, messages sent after the dump would otherwise be done a
//! second time by the restored copy.

mod lock;
mod stream;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::manifest::{
    self, CheckpointManifest, CriuInfo, HostInfo, OptionsRecord, PhaseTimings, Sizes,
};
use super::{ms, save_log, Flow, ImageTransfer};
use crate::detect::{self, DetectOptions, StrategyName};
use crate::dump::{AfterDump, DumpRequest};
use crate::exit::{Classify, ExitStatus};
use crate::freeze::{FreezeContext, GpuHook};
use crate::proc as tree;
use crate::store::{CheckpointInfo, Ingest, Store};

pub use lock::{lock_pid, PidLock};

/// Name of CRIU's dump log inside the checkpoint (stored with its images).
pub const DUMP_LOG: &str = "dump.log";

/// How long a killed tree may take to die before we report it.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("no such process: {pid}")]
    NoSuchProcess { pid: i32 },
    #[error("process {pid} is already being checkpointed (lock {} held)", lock.display())]
    Busy { pid: i32, lock: PathBuf },
    #[error("cannot take the checkpoint lock {}: {source}", path.display())]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("refusing to checkpoint process {pid}: its plan is `unsupported`:{}", blockers.iter().map(|b| format!("\n  - {b}")).collect::<String>())]
    Unsupported { pid: i32, blockers: Vec<String> },
    #[error("checkpoint {id} is stored, but the process tree could not be stopped: PIDs {pids:?} still run")]
    NotStopped { id: String, pids: Vec<i32> },
    #[error("measuring the images in {}: {source}", path.display())]
    Images {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::NoSuchProcess { .. } => ExitStatus::NoSuchProcess,
            Error::Busy { .. } => ExitStatus::Conflict,
            Error::Lock { source, .. } => crate::exit::io_exit_status(source),
            Error::Unsupported { .. } => ExitStatus::Unsupported,
            Error::NotStopped { .. } => ExitStatus::Failure,
            Error::Images { .. } => ExitStatus::Failure,
        }
    }
}

/// What to checkpoint and how.
#[derive(Debug, Clone)]
pub struct CheckpointOptions {
    pub pid: i32,
    pub name: Option<String>,
    /// Keep the tree running after the checkpoint (default: stop it once the checkpoint is durable).
    pub leave_running: bool,
    pub tcp_established: bool,
    pub shell_job: bool,
    /// How detect looks at the tree (`tree` is forced on: checkpoints act on trees).
    pub detect: DetectOptions,
}

impl CheckpointOptions {
    pub fn new(pid: i32) -> Self {
        CheckpointOptions {
            pid,
            name: None,
            leave_running: false,
            tcp_established: false,
            shell_job: false,
            detect: DetectOptions {
                tree: true,
                ..DetectOptions::default()
            },
        }
    }
}

/// Timings of one checkpoint, in milliseconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Timings {
    pub detect: f64,
    pub freeze: f64,
    /// CRIU's dump; when `streamed`, the images were stored meanwhile (this includes storing them).
    pub dump: f64,
    /// Storing the images after the dump; when `streamed`, only the commit (sync, manifest) and files CRIU
    /// wrote itself (its log).
    pub write: f64,
    /// The images went from CRIU to the store through pipes ([`ImageTransfer::Stream`]).
    pub streamed: bool,
    /// Killing the tree after the checkpoint (0 with `--leave-running`).
    pub stop: f64,
    pub total: f64,
}

/// A finished checkpoint.
#[derive(Debug, Clone)]
pub struct CheckpointOutcome {
    pub info: CheckpointInfo,
    pub manifest: CheckpointManifest,
    pub timings: Timings,
    /// The tree was killed (false with `--leave-running`).
    pub stopped: bool,
}

impl Flow<'_> {
    /// Checkpoints the tree rooted at `opts.pid`; see the module documentation for the order and the undo.
    pub fn checkpoint(&mut self, opts: &CheckpointOptions) -> crate::Result<CheckpointOutcome> {
        let started = Instant::now();
        let started_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let pid = opts.pid;
        if !tree::is_alive(pid) {
            return Err(Error::NoSuchProcess { pid }.into());
        }
        self.criu.check_permitted()?;
        self.store.check_writable()?;
        let _lock = lock_pid(pid)?;

        let t = Instant::now();
        let detect_opts = DetectOptions {
            tree: true,
            ..opts.detect.clone()
        };
        let report = detect::detect_pid(pid, &detect_opts)?;
        let mut timings = Timings {
            detect: ms(t),
            streamed: self.images != ImageTransfer::Staged,
            ..Timings::default()
        };
        if report.strategy.name == StrategyName::Unsupported {
            let blockers = report
                .strategy
                .blockers
                .iter()
                .map(|b| {
                    format!(
                        "pid {} {}: {} (remedy: {})",
                        b.pid, b.kind, b.message, b.remedy
                    )
                })
                .collect();
            return Err(Error::Unsupported { pid, blockers }.into());
        }
        let criu_version = self.criu.version()?;

        let ingest = self.store.begin(opts.name.as_deref())?;
        let detected_pids: Vec<i32> = report.processes.iter().map(|p| p.pid).collect();

        // From here on every failure must put the tree back the way it was.
        let t = Instant::now();
        let mut gpu_record = match self.gpu.freeze(&FreezeContext {
            root_pid: pid,
            pids: &detected_pids,
            report: &report,
            leave_running: opts.leave_running,
        }) {
            Ok(r) => r,
            Err(e) => {
                discard(ingest);
                return Err(e.into());
            }
        };
        timings.freeze = ms(t);

        let after = if opts.leave_running {
            AfterDump::KeepRunning
        } else {
            AfterDump::Stop
        };
        let t = Instant::now();
        let req = DumpRequest {
            pid,
            images_dir: ingest.staging_dir(),
            log_file: DUMP_LOG,
            after,
            tcp_established: opts.tcp_established,
            shell_job: opts.shell_job,
            stream: self.images != ImageTransfer::Staged,
        };
        let (dumped, streamed) = if req.stream {
            let expected = stream::resident_bytes(&detected_pids);
            let d = stream::dump_streamed(self.criu, &req, &ingest, expected, self.progress);
            (d.dumped, Some(d.stored))
        } else {
            (self.criu.dump(&req), None)
        };
        timings.dump = ms(t);
        if let Err(e) = dumped {
            // CRIU resumed (or never stopped) the tree; only the GPU state needs putting back. When the
            // store gave up first (disk full), CRIU only saw a broken pipe: the store's error says why.
            let e = keep_failed_log(self.store, &ingest, e);
            thaw_after_failure(self.gpu);
            discard(ingest);
            match streamed {
                Some(Err(store_err)) if store_err.exit_status() == ExitStatus::Storage => {
                    tracing::debug!("{e}");
                    return Err(store_err);
                }
                Some(Err(store_err)) => {
                    tracing::debug!("while CRIU failed, the store: {store_err}")
                }
                _ => {}
            }
            return Err(e.into());
        }
        // The tree as CRIU dumped it: stopped (default), so the list is exact; with --leave-running the
        // tree goes on and this is the best knowledge we have.
        let mut process_tree = tree::process_tree(pid);
        if process_tree.is_empty() {
            // The root died right after CRIU let it go (leave_running): the images still hold the tree.
            process_tree = report
                .processes
                .iter()
                .map(|p| tree::TreeProcess {
                    pid: p.pid,
                    ppid: p.ppid,
                    comm: p.comm.clone(),
                    cmdline: String::new(),
                    threads: 0,
                })
                .collect();
        }
        let pids: Vec<i32> = process_tree.iter().map(|p| p.pid).collect();
        // Puts the tree back after a failure from here on: continues it (it was left stopped) and, unless
        // that already happened, puts GPU state back.
        let undo = |gpu: &mut dyn GpuHook, thawed: bool, e: crate::Error| -> crate::Error {
            if after == AfterDump::Stop {
                tree::continue_tree(&pids);
            }
            if !thawed {
                thaw_after_failure(gpu);
            }
            e
        };
        // CRIU finished, but the store may not have taken every image.
        let streamed = match streamed.transpose() {
            Ok(s) => s,
            Err(e) => {
                discard(ingest);
                return Err(undo(self.gpu, false, e));
            }
        };
        let mut thawed = false;
        if opts.leave_running {
            // GPU work resumes while the images are stored.
            match self.gpu.thaw() {
                // The GPU restore + unlock timings belong with the lock + checkpoint ones.
                Ok(thaw) => {
                    if let (Some(record), Some(thaw)) = (gpu_record.as_mut(), thaw) {
                        record.thaw = Some(thaw);
                    }
                }
                Err(e) => {
                    discard(ingest);
                    return Err(e.into());
                }
            }
            thawed = true;
        }

        let sizes = match Sizes::of_dir(ingest.staging_dir()) {
            Ok(mut s) => {
                if let Some(st) = &streamed {
                    s.add_streamed(st.files());
                }
                s
            }
            Err(source) => {
                let e = Error::Images {
                    path: ingest.staging_dir().to_path_buf(),
                    source,
                };
                discard(ingest);
                return Err(undo(self.gpu, thawed, e.into()));
            }
        };
        let gpu = match serde_json::to_value(&gpu_record) {
            Ok(v) => v,
            Err(e) => {
                discard(ingest);
                let e = crate::store::Error::Invalid(format!("encoding the manifest: {e}"));
                return Err(undo(self.gpu, thawed, e.into()));
            }
        };
        let manifest = CheckpointManifest {
            schema: manifest::SCHEMA.into(),
            schema_version: manifest::SCHEMA_VERSION,
            id: ingest.id().to_string(),
            name: opts.name.clone(),
            started_unix_ms,
            host: HostInfo::current(),
            criu: CriuInfo {
                version: criu_version,
                path: self.criu.describe(),
            },
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            root_pid: pid,
            process_tree,
            strategy: report.strategy.name,
            detect: report,
            gpu_step: self.gpu.name().to_string(),
            gpu,
            options: OptionsRecord {
                leave_running: opts.leave_running,
                tcp_established: opts.tcp_established,
                shell_job: opts.shell_job,
            },
            timings_ms: PhaseTimings {
                detect: timings.detect,
                freeze: timings.freeze,
                dump: timings.dump,
                streamed: timings.streamed,
            },
            sizes,
        };
        let metadata = match serde_json::to_value(&manifest) {
            Ok(v) => v,
            Err(e) => {
                discard(ingest);
                let e = crate::store::Error::Invalid(format!("encoding the manifest: {e}"));
                return Err(undo(self.gpu, thawed, e.into()));
            }
        };

        let t = Instant::now();
        // On error the store removes the staging folder and keeps nothing: no partial checkpoint.
        let info =
            match ingest.commit_streamed(streamed.unwrap_or_default(), metadata, self.progress) {
                Ok(info) => info,
                Err(e) => return Err(undo(self.gpu, thawed, e.into())),
            };
        timings.write = ms(t);

        let t = Instant::now();
        let stopped = !opts.leave_running;
        if stopped {
            self.gpu.committed();
            let left = tree::kill_tree(&pids, KILL_TIMEOUT);
            if !left.is_empty() {
                return Err(Error::NotStopped {
                    id: info.id.clone(),
                    pids: left,
                }
                .into());
            }
        }
        timings.stop = ms(t);
        timings.total = ms(started);
        Ok(CheckpointOutcome {
            info,
            manifest,
            timings,
            stopped,
        })
    }
}

/// Puts GPU state back after a failed checkpoint. The checkpoint's own error is what the user must see;
/// a failure here is logged next to it.
fn thaw_after_failure(gpu: &mut dyn GpuHook) {
    if let Err(e) = gpu.thaw() {
        tracing::error!("after the failed checkpoint, putting the GPU state back failed too: {e}");
    }
}

/// Drops a staging folder; a failure to remove it is only logged (gc removes dead staging folders).
fn discard(ingest: Ingest) {
    let id = ingest.id().to_string();
    if let Err(e) = ingest.abort() {
        tracing::warn!("checkpoint {id}: could not remove its staging folder: {e}");
    }
}

/// Copies CRIU's log out of the staging folder (which is about to go) into the store's `logs/` folder,
/// or the temporary folder when the store cannot take it (full disk), and points the error at the copy.
fn keep_failed_log(store: &Store, ingest: &Ingest, e: crate::dump::Error) -> crate::dump::Error {
    let src = ingest.staging_dir().join(DUMP_LOG);
    if !src.exists() {
        return e;
    }
    match save_log(
        store.local_dir(),
        &src,
        &format!("{}.dump.log", ingest.id()),
    ) {
        Some(kept) => e.with_log_path(kept),
        None => e,
    }
}

#[cfg(test)]
mod tests;
