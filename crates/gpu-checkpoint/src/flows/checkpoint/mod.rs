//! The checkpoint flow: detect -> plan -> GPU freeze -> CRIU dump -> store, nothing lost on failure.
//!
//! Order, and why:
//! 1. Everything that can refuse does so before the process is touched: the PID exists, the store is
//!    writable, no other checkpoint of this PID runs (per-PID lock), detect does not say `unsupported`.
//! 2. GPU freeze (the [`crate::freeze::GpuHook`]), then CRIU dumps the tree into the store (streamed) or
//!    its staging folder (`--staged`). CRIU never kills the tree: it leaves it stopped (SIGSTOP), or
//!    running for a staged `--leave-running` dump ([`crate::flows::ImageTransfer::after_dump`]), so a
//!    failure of anything until the checkpoint is durable is undone by continuing the tree and putting
//!    its GPU state back. Guards do that when dropped (`undo.rs`), so that no way out of the flow can
//!    forget it. With `--leave-running` the flow continues the tree a streamed dump left stopped as soon
//!    as the store has read every image, then puts its GPU state back, before the commit.
//! 3. The store commits the checkpoint: every chunk durable, then the manifest (the checkpoint exists
//!    only from that moment on).
//! 4. Only then, without `--leave-running`, the tree is killed (migration).
//!
//! The tree stays stopped (not running) between the dump and the kill so that it does nothing the
//! checkpoint would not contain: files written, messages sent after the dump would otherwise be done a
//! second time by the restored copy.

mod devices;
mod lock;
mod refusals;
pub(in crate::flows) mod stream;
mod undo;

pub(in crate::flows) use stream::{dump_tree, tell_network};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::manifest::{
    self, CheckpointManifest, CriuInfo, HostInfo, OptionsRecord, PhaseTimings, Sizes,
};
use super::{ms, Alone, Flow, NotCommitted, Phases};
use crate::detect::{self, DetectOptions, Report, StrategyChoice, StrategyName};
use crate::dump::devices::PluginDir;
use crate::dump::{AfterDump, CriuOptions, DumpRequest};
use crate::exit::{Classify, ExitStatus};
use crate::fault;
use crate::flows::guardian::Event;
use crate::freeze::{FreezeContext, GpuHook, GpuRecord};
use crate::interrupt::InterruptGuard;
use crate::proc as tree;
use crate::store::{CheckpointInfo, Store, Streamed};
use undo::{ContinueGuard, GpuThawGuard};

pub use lock::{lock_pid, lock_tree, PidLock};

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
    #[error("refusing to checkpoint process {pid} (nothing was touched): CRIU would fail on what the tree holds; add {}:{}", flags.join(" "), needs.iter().map(|n| format!("\n  - {n}")).collect::<String>())]
    NeedsOptions {
        pid: i32,
        /// The flags to add.
        flags: Vec<String>,
        /// What needs each, per process.
        needs: Vec<String>,
    },
    #[error("refusing to checkpoint process {pid} (nothing was touched): CRIU cannot dump what the tree holds:{}", limits.iter().map(|n| format!("\n  - {n}")).collect::<String>())]
    CannotDump {
        pid: i32,
        /// Each, with its process and remedy.
        limits: Vec<String>,
    },
    #[error("refusing to checkpoint process {pid} (nothing was touched): process {stopped} is stopped (state {state}), so its checkpoint would be restored stopped; if an earlier checkpoint or a debugger left it so, continue it first (kill -CONT {stopped}); if it is stopped on purpose, pass --allow-stopped")]
    Stopped { pid: i32, stopped: i32, state: char },
    #[error("refusing --strategy {strategy} for process {pid} (nothing was touched): {reason}")]
    StrategyRefused {
        pid: i32,
        strategy: StrategyChoice,
        reason: String,
    },
    #[error("refusing to checkpoint process {pid} (nothing was touched): process {process} maps {path}; a device file is reopened on restore (at the same descriptor number) only where a process holds descriptors of it, and the contents of a mapping would not come back")]
    DeviceMapped {
        pid: i32,
        process: i32,
        path: String,
    },
    #[error("the job checkpoint aborted: {reason}; this member's checkpoint was undone, the tree runs as before and nothing was kept")]
    Aborted { reason: String },
    #[error("the job checkpoint's outcome is unknown ({reason}): the tree runs as before, and this member's checkpoint {id} is kept, as a committed job checkpoint may name it (`job list` tells; `gpu-checkpoint delete {id}` if none does)")]
    InDoubt { id: String, reason: String },
    #[error("interrupted by {signal}: the checkpoint was undone, the tree runs as before and nothing was stored")]
    Interrupted { signal: String },
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
            Error::Unsupported { .. }
            | Error::NeedsOptions { .. }
            | Error::CannotDump { .. }
            | Error::Stopped { .. }
            | Error::StrategyRefused { .. }
            | Error::DeviceMapped { .. } => ExitStatus::Unsupported,
            Error::Interrupted { .. } => ExitStatus::Interrupted,
            Error::Aborted { .. } | Error::InDoubt { .. } => ExitStatus::Failure,
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
    /// What CRIU is told (`--tcp-established`, `--file-locks`, ...); recorded in the manifest.
    pub criu: CriuOptions,
    /// How detect looks at the tree (`tree` is forced on: checkpoints act on trees).
    pub detect: DetectOptions,
    /// `--strategy`: detect's choice, or one forced (refused where detect says it cannot work).
    pub strategy: StrategyChoice,
    /// `--allow-stopped`: checkpoint processes stopped on purpose (SIGSTOP, job control) as they are; they
    /// stay stopped, and come back stopped, as with plain CRIU. Without it a stopped tree is refused.
    pub allow_stopped: bool,
    /// `--reopen-device`: device nodes CRIU cannot dump whose descriptors are recorded and reopened on
    /// restore, besides the NVIDIA nodes of processes without a CUDA context (always).
    pub reopen_devices: Vec<PathBuf>,
}

impl CheckpointOptions {
    pub fn new(pid: i32) -> Self {
        CheckpointOptions {
            pid,
            name: None,
            leave_running: false,
            criu: CriuOptions::default(),
            detect: DetectOptions {
                tree: true,
                ..DetectOptions::default()
            },
            strategy: StrategyChoice::Auto,
            allow_stopped: false,
            reopen_devices: Vec::new(),
        }
    }

    /// The options the manifest keeps.
    fn record(&self) -> OptionsRecord {
        OptionsRecord {
            leave_running: self.leave_running,
            criu: self.criu.clone(),
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
    /// The images went from CRIU to the store through pipes ([`crate::flows::ImageTransfer::Stream`]).
    pub streamed: bool,
    /// With `--leave-running`: how long the dump held the tree stopped, from CRIU's start until the tree
    /// ran again (CRIU let it go after a staged dump, or the flow continued it once the store had read
    /// every streamed image: `continued`). An upper bound: CRIU stops the tree a little after it starts.
    /// 0 otherwise (the tree stays stopped until it is killed).
    pub paused: f64,
    /// The flow continued the tree CRIU left stopped (a streamed `--leave-running` dump).
    pub continued: bool,
    /// Killing the tree after the checkpoint (0 with `--leave-running`).
    pub stop: f64,
    pub total: f64,
}

impl Timings {
    /// The timings the manifest keeps (the write phase is the store's own `stats.ingest_ms`).
    fn phases(&self) -> PhaseTimings {
        PhaseTimings {
            detect: self.detect,
            freeze: self.freeze,
            dump: self.dump,
            streamed: self.streamed,
        }
    }
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
        self.checkpoint_phased(opts, &Alone)
    }

    /// [`Flow::checkpoint`] as one member of a job checkpoint: waits at `phases`' barriers (once the GPU
    /// processes are locked, once the checkpoint is durable) and undoes everything, the stored checkpoint
    /// included, when one of them says no.
    pub fn checkpoint_phased(
        &mut self,
        opts: &CheckpointOptions,
        phases: &dyn Phases,
    ) -> crate::Result<CheckpointOutcome> {
        let started = Instant::now();
        let started_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let pid = opts.pid;
        // Every signal that would end this process is deferred until the flow has finished or undone
        // what it did; what cannot be deferred (SIGKILL) is the guardian's (`self.watch`).
        let interrupt = InterruptGuard::new();
        // 1. Refuse before touching the tree.
        if !tree::is_alive(pid) {
            return Err(Error::NoSuchProcess { pid }.into());
        }
        self.criu.check_permitted()?;
        self.store.check_writable()?;
        let _lock = lock_pid(pid)?;

        let refuse = |reason: String| Error::StrategyRefused {
            pid,
            strategy: opts.strategy,
            reason,
        };
        if opts.strategy == StrategyChoice::BarSliding {
            return Err(refuse(detect::choice::BAR_SLIDING.into()).into());
        }
        let t = Instant::now();
        let report = detect_tree(pid, &opts.detect)?;
        detect::choice::check(opts.strategy, &report).map_err(refuse)?;
        refusals::check_options(pid, &report, &opts.criu)?;
        refusals::check_limits(pid, &report)?;
        let reopen = devices::plan(pid, &report, &opts.reopen_devices, Path::new("/proc"))?;
        let tree_pids: Vec<i32> = report.processes.iter().map(|p| p.pid).collect();
        let _tree_locks = lock_tree(&tree_pids, pid)?;
        // Processes stopped before we came stay stopped whatever happens (`--allow-stopped`).
        let stopped_before = stopped_processes(&tree_pids);
        if let (false, Some(&(stopped, state))) = (opts.allow_stopped, stopped_before.first()) {
            return Err(Error::Stopped {
                pid,
                stopped,
                state,
            }
            .into());
        }
        let stopped_before: Vec<i32> = stopped_before.iter().map(|(p, _)| *p).collect();
        let mut timings = Timings {
            detect: ms(t),
            streamed: self.images.dump_streams(),
            ..Timings::default()
        };
        let criu = CriuInfo {
            version: self.criu.version()?,
            path: self.criu.describe(),
        };
        // CRIU's devices plugin, in a private folder, when the tree holds device files it cannot dump.
        let plugin = reopen
            .as_ref()
            .map(|p| PluginDir::for_dump(&p.allow, !p.replaced.is_empty()))
            .transpose()?;
        let criu_env = plugin.as_ref().map(PluginDir::env).unwrap_or_default();
        let ingest = self.store.begin(opts.name.as_deref())?;
        // The guardian learns what it would have to put back before anything is touched; if it cannot be
        // told, nothing is.
        self.watch.tell(&Event::Checkpoint {
            pids: tree_pids.clone(),
            leave_running: opts.leave_running,
            stopped: stopped_before.clone(),
        })?;
        if report.strategy.name != StrategyName::None {
            if let Some(backend) = self.gpu.backend() {
                self.watch.tell(&Event::Gpu { backend })?;
            }
        }
        fault::at("checkpoint.before-freeze");
        check_interrupt(&interrupt)?;

        // 2. Freeze and dump. From here on every way out before the commit puts the tree back the way it
        // was: the guards undo when dropped (see `undo.rs` for their order) and `ingest` removes the
        // staging folder.
        let t = Instant::now();
        let ctx = FreezeContext {
            root_pid: pid,
            pids: &tree_pids,
            report: &report,
            leave_running: opts.leave_running,
            after_lock: None,
        };
        let (mut gpu_record, passed) = freeze_phased(&mut *self.gpu, ctx, phases)?;
        let mut gpu = GpuThawGuard::new(&mut *self.gpu);
        if !passed {
            phases.locked().map_err(aborted_at_lock)?;
        }
        timings.freeze = ms(t);
        fault::at("checkpoint.after-freeze");
        check_interrupt(&interrupt)?;

        // A streamed dump leaves the tree stopped even with --leave-running: the flow continues it once
        // the store has read every image, which are still the tree's own pages while in the pipes.
        let after = self.images.after_dump(opts.leave_running);
        let t = Instant::now();
        let tcp_hold = opts.criu.tcp_established && after == AfterDump::Stop;
        let locks_before = if tcp_hold {
            crate::dump::LocksBefore::of(pid)
        } else {
            Default::default()
        };
        let req = DumpRequest {
            pid,
            images_dir: ingest.staging_dir(),
            log_file: DUMP_LOG,
            after,
            options: &opts.criu,
            stream: self.images.dump_streams(),
            env: &criu_env,
            container: None,
        };
        // Takes the tree over from CRIU once it has finished: the guard that continues what CRIU left
        // stopped (and releases its locked network) whichever way the flow leaves.
        let watch = self.watch;
        let take_over = || {
            let process_tree = dumped_tree(pid, &report);
            let dumped_pids: Vec<i32> = process_tree.iter().map(|p| p.pid).collect();
            let mut stopped_tree =
                ContinueGuard::new(&dumped_pids, &stopped_before, after == AfterDump::Stop);
            if tcp_hold {
                let hold = crate::dump::NetworkHold::after_dump(
                    &dumped_pids,
                    &ingest.staging_dir().join(DUMP_LOG),
                    opts.criu.effective_network_lock(),
                    &locks_before,
                );
                tell_network(watch, &hold);
                stopped_tree.release_network(hold);
            }
            (process_tree, stopped_tree)
        };
        // A leave-running tree is continued as soon as the store has copied every image out of CRIU's
        // pipes, while the store's workers still hash, compress and write them: the tree's pause is then
        // about CRIU's own, not the store's. Should the store fail afterwards, the checkpoint fails with the
        // tree running, as after any failure.
        let mut early = None;
        let mut continue_early = || {
            let (process_tree, mut stopped_tree) = take_over();
            timings.continued = stopped_tree.armed();
            stopped_tree.continue_now();
            timings.paused = ms(t);
            early = Some((process_tree, stopped_tree));
        };
        let on_read: Option<&mut dyn FnMut()> = if opts.leave_running {
            Some(&mut continue_early)
        } else {
            None
        };
        let stored = dump_tree(
            self.criu,
            self.store,
            self.progress,
            &req,
            &ingest,
            &tree_pids,
            on_read,
        )?;
        timings.dump = ms(t);
        let continued_early = early.is_some();
        let (process_tree, mut stopped_tree) = early.unwrap_or_else(take_over);
        // CRIU finished, but the store may not have taken every image.
        let streamed = stored.transpose()?;
        let reopened = match &plugin {
            Some(p) => p.records()?,
            None => Vec::new(),
        };
        fault::at("checkpoint.after-dump");
        check_interrupt(&interrupt)?;
        if opts.leave_running {
            // The store has read every image: the tree runs on (since `continue_early`, when streamed),
            // before its GPU state is put back (the GPU restore runs in its processes, which a stopped one
            // cannot do) and before the commit. From here on an undo only puts the GPU state back.
            if !continued_early {
                timings.continued = stopped_tree.armed();
                stopped_tree.continue_now();
                timings.paused = ms(t);
            }
            // GPU work resumes while the checkpoint is committed. The GPU restore + unlock timings
            // belong with the lock + checkpoint ones.
            let thaw = gpu.thaw()?;
            if let (Some(record), Some(thaw)) = (gpu_record.as_mut(), thaw) {
                record.thaw = Some(thaw);
            }
        }

        // 3. Commit.
        let sizes = image_sizes(ingest.staging_dir(), streamed.as_ref())?;
        let manifest = CheckpointManifest {
            schema: manifest::SCHEMA.into(),
            schema_version: manifest::SCHEMA_VERSION,
            id: ingest.id().to_string(),
            name: opts.name.clone(),
            started_unix_ms,
            host: HostInfo::current(),
            criu,
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            root_pid: pid,
            process_tree,
            strategy: report.strategy.name,
            detect: report,
            gpu_step: gpu.name().to_string(),
            gpu: encode(&gpu_record)?,
            options: opts.record(),
            timings_ms: timings.phases(),
            sizes,
            devices: reopened,
            container: None,
        };
        let metadata = encode(&manifest)?;

        let t = Instant::now();
        // The last moment a signal can still undo the checkpoint.
        check_interrupt(&interrupt)?;
        // On error the store removes the staging folder and keeps nothing: no partial checkpoint.
        let info = ingest.commit_streamed(streamed.unwrap_or_default(), metadata, self.progress)?;
        timings.write = ms(t);
        // A job checkpoint: hold everything as it is until the job commits (the guardian still undoes
        // should this process die meanwhile); an abort deletes this member's checkpoint, and the guards
        // put the tree back as for any failure before a commit.
        after_durable(phases, self.store, &info.id)?;
        // Durable: from here on a signal is deferred until the tree is stopped, as promised, and a dead
        // tool's guardian stops it.
        if let Err(e) = self.watch.tell(&Event::Durable) {
            tracing::warn!("{e}");
        }
        fault::at("checkpoint.after-commit");

        // 4. The checkpoint is durable: nothing is to be undone any more; stop the tree (migration).
        let held = stopped_tree.disarm();
        let t = Instant::now();
        let stopped = !opts.leave_running;
        if stopped {
            gpu.committed();
            let left = held.kill(KILL_TIMEOUT);
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

/// The GPU freeze of a checkpoint driven as one member of a job: `phases.locked()` is the barrier between
/// the lock and the GPU checkpoint. The hook calls it there; a hook that does not (a test hook) has not
/// passed it (`false`): the caller calls it right after, once its thaw guard is armed, still before the
/// CPU side is touched.
pub(crate) fn freeze_phased(
    gpu: &mut dyn GpuHook,
    ctx: FreezeContext<'_>,
    phases: &dyn Phases,
) -> crate::Result<(Option<GpuRecord>, bool)> {
    let passed = std::sync::atomic::AtomicBool::new(false);
    let after_lock = || {
        passed.store(true, std::sync::atomic::Ordering::SeqCst);
        phases.locked()
    };
    let record = gpu
        .freeze(&FreezeContext {
            after_lock: Some(&after_lock),
            ..ctx
        })
        .map_err(aborted)?;
    Ok((record, passed.load(std::sync::atomic::Ordering::SeqCst)))
}

/// A job member's checkpoint `id` is durable: waits for the job's outcome. An abort deletes `id`; in
/// doubt it is kept, as the job may have committed with it. Either is an error, on which the caller's
/// guards put the tree back as for any failure before a commit.
pub(crate) fn after_durable(phases: &dyn Phases, store: &Store, id: &str) -> crate::Result<()> {
    match phases.durable(id) {
        Ok(()) => Ok(()),
        Err(NotCommitted::Aborted(reason)) => {
            if let Err(e) = store.delete(id) {
                tracing::error!(
                    "the job aborted, and deleting its member checkpoint {id} failed: {e}"
                );
            }
            Err(Error::Aborted { reason }.into())
        }
        Err(NotCommitted::InDoubt(reason)) => Err(Error::InDoubt {
            id: id.to_string(),
            reason,
        }
        .into()),
    }
}

/// A no at the lock barrier, as the flow's own error.
pub(crate) fn aborted_at_lock(reason: String) -> crate::Error {
    Error::Aborted { reason }.into()
}

/// The freeze stage's abort at the lock barrier, as the flow's own error (the barrier's reason).
fn aborted(e: crate::freeze::Error) -> crate::Error {
    match e {
        crate::freeze::Error::Aborted(reason) => Error::Aborted { reason }.into(),
        e => e.into(),
    }
}

/// A signal came since `interrupt` was made: undo (the caller's guards do, as it returns the error).
fn check_interrupt(interrupt: &InterruptGuard) -> Result<(), Error> {
    if !interrupt.interrupted() {
        return Ok(());
    }
    Err(Error::Interrupted {
        signal: crate::interrupt::last_signal().unwrap_or_else(|| "a signal".into()),
    })
}

/// The processes of `pids` that are stopped (state T: SIGSTOP, job control, or what an interrupted
/// checkpoint or a debugger left; t: traced). CRIU dumps them stopped and restores them stopped: without
/// `--allow-stopped` the tree is refused, since a restore of what an interrupted checkpoint left would exit
/// 0 with a process that never runs again.
fn stopped_processes(pids: &[i32]) -> Vec<(i32, char)> {
    pids.iter()
        .filter_map(|&p| tree::stat(p).map(|s| (p, s.state)))
        .filter(|(_, state)| matches!(state, 'T' | 't'))
        .collect()
}

/// Detect's report of the tree rooted at `pid` (`tree` forced on: checkpoints act on trees), refused
/// when its strategy is `unsupported`.
fn detect_tree(pid: i32, opts: &DetectOptions) -> crate::Result<Report> {
    let report = detect::detect_pid(
        pid,
        &DetectOptions {
            tree: true,
            ..opts.clone()
        },
    )?;
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
    Ok(report)
}

/// The tree as CRIU dumped it: stopped (default), so the list is exact; with --leave-running the tree
/// goes on and this is the best knowledge we have.
fn dumped_tree(pid: i32, report: &Report) -> Vec<tree::TreeProcess> {
    let process_tree = tree::process_tree(pid);
    if !process_tree.is_empty() {
        return process_tree;
    }
    // The root died right after CRIU let it go (leave_running): the images still hold the tree.
    report
        .processes
        .iter()
        .map(|p| tree::TreeProcess {
            pid: p.pid,
            ppid: p.ppid,
            comm: p.comm.clone(),
            cmdline: String::new(),
            threads: 0,
        })
        .collect()
}

/// The sizes of CRIU's images: the files in the staging folder, plus those that came as streams.
pub(in crate::flows) fn image_sizes(
    staging: &Path,
    streamed: Option<&Streamed>,
) -> Result<Sizes, Error> {
    let mut sizes = Sizes::of_dir(staging).map_err(|source| Error::Images {
        path: staging.to_path_buf(),
        source,
    })?;
    if let Some(st) = streamed {
        sizes.add_streamed(st.files());
    }
    Ok(sizes)
}

/// The manifest (or a part of it) as the JSON the store keeps.
fn encode(value: &impl serde::Serialize) -> crate::Result<serde_json::Value> {
    serde_json::to_value(value)
        .map_err(|e| crate::store::Error::Invalid(format!("encoding the manifest: {e}")).into())
}

#[cfg(test)]
mod leave_running_tests;
#[cfg(test)]
mod phase_tests;
#[cfg(test)]
mod tests;
