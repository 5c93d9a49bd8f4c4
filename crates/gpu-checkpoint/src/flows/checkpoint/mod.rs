//! The checkpoint of a process tree: the pipeline's target for `checkpoint --pid` (`flows/pipeline`
//! owns the order: detect -> GPU freeze -> dump -> store -> commit, nothing lost on failure).
//!
//! What this target adds, and why:
//! 1. Everything that can refuse does so before the process is touched: the PID exists, the store is
//!    writable, no other checkpoint of this PID or tree runs (per-PID locks, held until the end), detect
//!    does not say `unsupported`, CRIU would not fail on what the tree holds (`refusals.rs`), device
//!    files are reopened by CRIU's devices plugin where needed (`devices.rs`).
//! 2. CRIU dumps the tree into the store (streamed) or its staging folder (`--staged`). CRIU never kills
//!    the tree: it leaves it stopped (SIGSTOP), or running for a staged `--leave-running` dump
//!    ([`crate::flows::ImageTransfer::after_dump`]), so a failure of anything until the checkpoint is
//!    durable is undone by continuing the tree (`undo.rs`, before the pipeline puts its GPU state
//!    back). With `--leave-running` the tree a streamed dump left stopped is continued as soon as the
//!    store has read every image.
//! 3. Only once the checkpoint is durable, without `--leave-running`, the tree is killed (migration).
//!
//! The tree stays stopped (not running) between the dump and the kill so that it does nothing the
//! checkpoint would not contain: files written, messages sent after the dump would otherwise be done a
//! second time by the restored copy.

mod devices;
mod lock;
mod refusals;
mod undo;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::manifest::{CheckpointManifest, CriuInfo};
use super::pipeline::{self, CheckpointCommon, CheckpointTarget, DumpContext, Dumped, Prepared};
use super::{ms, Alone, Flow, ImageTransfer, Phases};
use crate::detect::{self, DetectOptions, Report, StrategyChoice, StrategyName};
use crate::dump::devices::{PluginDir, ReopenedDevice};
use crate::dump::{AfterDump, Criu, CriuOptions, DumpRequest};
use crate::exit::{Classify, ExitStatus};
use crate::proc::{self as tree, Processes};
use crate::store::{CheckpointInfo, Store};
use undo::ContinueGuard;

pub use lock::{lock_pid, lock_tree, PidLock};
pub use pipeline::DUMP_LOG;

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
    #[error("checkpoint {id} is stored, but the process tree could not be stopped: PIDs {pids:?} still run")]
    NotStopped { id: String, pids: Vec<i32> },
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
            Error::NotStopped { .. } => ExitStatus::Failure,
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
        let mut target = ProcessTree::new(self.criu, self.images, opts, self.procs);
        let common = CheckpointCommon::new(&opts.name, opts.leave_running);
        let out = self.pipeline().checkpoint(&mut target, &common, phases)?;
        let t = out.timings;
        Ok(CheckpointOutcome {
            info: out.info,
            manifest: out.manifest,
            timings: Timings {
                detect: t.detect,
                freeze: t.freeze,
                dump: t.dump,
                write: t.write,
                streamed: self.images.dump_streams(),
                paused: t.paused,
                continued: t.continued,
                stop: t.stop,
                total: t.total,
            },
            stopped: out.stopped,
        })
    }
}

/// A process tree, dumped by CRIU: the pipeline's target for [`Flow::checkpoint`].
struct ProcessTree<'a> {
    criu: &'a dyn Criu,
    procs: &'a dyn Processes,
    images: ImageTransfer,
    opts: &'a CheckpointOptions,
    /// The root's and the tree's locks, held until the checkpoint ends.
    locks: Vec<PidLock>,
    pids: Vec<i32>,
    /// Processes stopped before the checkpoint (`--allow-stopped`): they stay stopped.
    stopped_before: Vec<i32>,
    /// The tree as detect saw it: what the manifest lists should the root be gone after the dump.
    detected: Vec<tree::TreeProcess>,
    criu_info: Option<CriuInfo>,
    /// CRIU's devices plugin, in a private folder, when the tree holds device files it cannot dump.
    plugin: Option<PluginDir>,
    /// Filled in by the dump: the tree as CRIU dumped it, and the devices its plugin recorded.
    dumped: Vec<tree::TreeProcess>,
    reopened: Vec<ReopenedDevice>,
    /// CRIU's network lock left for the restore once the tree is killed (`--tcp-established`).
    network_lock: Option<crate::dump::KeptNetworkLock>,
}

impl<'a> ProcessTree<'a> {
    fn new(
        criu: &'a dyn Criu,
        images: ImageTransfer,
        opts: &'a CheckpointOptions,
        procs: &'a dyn Processes,
    ) -> Self {
        ProcessTree {
            criu,
            procs,
            images,
            opts,
            locks: Vec::new(),
            pids: Vec::new(),
            stopped_before: Vec::new(),
            detected: Vec::new(),
            criu_info: None,
            plugin: None,
            dumped: Vec::new(),
            reopened: Vec::new(),
            network_lock: None,
        }
    }
}

impl<'a> CheckpointTarget<'a> for ProcessTree<'a> {
    fn prepare(&mut self, store: &Store) -> crate::Result<Prepared> {
        let (pid, opts) = (self.opts.pid, self.opts);
        if !self.procs.is_alive(pid) {
            return Err(Error::NoSuchProcess { pid }.into());
        }
        self.criu.check_permitted()?;
        store.check_writable()?;
        self.locks.push(lock_pid(pid)?);
        let refuse = |reason: String| Error::StrategyRefused {
            pid,
            strategy: opts.strategy,
            reason,
        };
        if opts.strategy == StrategyChoice::BarSliding {
            return Err(refuse(detect::choice::BAR_SLIDING.into()).into());
        }
        let report = detect_tree(pid, &opts.detect)?;
        detect::choice::check(opts.strategy, &report).map_err(refuse)?;
        refusals::check_options(pid, &report, &opts.criu)?;
        refusals::check_limits(pid, &report)?;
        let reopen = devices::plan(pid, &report, &opts.reopen_devices, Path::new("/proc"))?;
        self.pids = report.processes.iter().map(|p| p.pid).collect();
        self.locks.extend(lock_tree(&self.pids, pid)?);
        // Processes stopped before we came stay stopped whatever happens (`--allow-stopped`).
        let stopped_before = stopped_processes(self.procs, &self.pids);
        if let (false, Some(&(stopped, state))) = (opts.allow_stopped, stopped_before.first()) {
            return Err(Error::Stopped {
                pid,
                stopped,
                state,
            }
            .into());
        }
        self.stopped_before = stopped_before.iter().map(|(p, _)| *p).collect();
        self.criu_info = Some(CriuInfo {
            version: self.criu.version()?,
            path: self.criu.describe(),
        });
        self.plugin = reopen
            .as_ref()
            .map(|p| PluginDir::for_dump(&p.allow, !p.replaced.is_empty()))
            .transpose()?;
        self.detected = report
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
        Ok(Prepared {
            root_pid: pid,
            pids: self.pids.clone(),
            stopped: self.stopped_before.clone(),
            report,
            gpu_on_host: true,
        })
    }

    fn dump(&mut self, ctx: &DumpContext<'_>) -> crate::Result<Dumped<'a>> {
        let (pid, opts) = (self.opts.pid, self.opts);
        // A streamed dump leaves the tree stopped even with --leave-running: it is continued once the
        // store has read every image, which are still the tree's own pages while in the pipes.
        let after = self.images.after_dump(ctx.leave_running);
        let tcp_hold = opts.criu.tcp_established && after == AfterDump::Stop;
        let locks_before = if tcp_hold {
            crate::dump::LocksBefore::of(pid)
        } else {
            Default::default()
        };
        let criu_env = self.plugin.as_ref().map(PluginDir::env).unwrap_or_default();
        let req = DumpRequest {
            pid,
            images_dir: ctx.ingest.staging_dir(),
            log_file: DUMP_LOG,
            after,
            options: &opts.criu,
            stream: self.images.dump_streams(),
            env: &criu_env,
            container: None,
        };
        // Takes the tree over from CRIU once it has finished: the guard that continues what CRIU left
        // stopped (and releases its locked network) whichever way the checkpoint leaves.
        let (detected, stopped_before, procs) = (&self.detected, &self.stopped_before, self.procs);
        let take_over = || {
            let mut dumped = procs.tree(pid);
            if dumped.is_empty() {
                // The root died right after CRIU let it go (leave_running): the images still hold the
                // tree.
                dumped = detected.clone();
            }
            let dumped_pids: Vec<i32> = dumped.iter().map(|p| p.pid).collect();
            let stopped = after == AfterDump::Stop;
            let mut stopped_tree = ContinueGuard::new(procs, &dumped_pids, stopped_before, stopped);
            let mut kept = None;
            if tcp_hold {
                let hold = crate::dump::NetworkHold::after_dump(
                    &dumped_pids,
                    &ctx.ingest.staging_dir().join(DUMP_LOG),
                    opts.criu.effective_network_lock(),
                    &locks_before,
                );
                pipeline::tell_network(ctx.watch, &hold);
                // Killed with the tree once durable (not released): CRIU's lock stays for the restore.
                kept = hold.kept().filter(|_| !ctx.leave_running);
                stopped_tree.release_network(hold);
            }
            (dumped, stopped_tree, kept)
        };
        // A leave-running tree is continued as soon as the store has copied every image out of CRIU's
        // pipes, while the store's workers still hash, compress and write them: the tree's pause is then
        // about CRIU's own, not the store's. Should the store fail afterwards, the checkpoint fails with the
        // tree running, as after any failure.
        let mut early = None;
        let mut continue_early = || {
            let (dumped, mut stopped_tree, _) = take_over();
            let continued = stopped_tree.armed();
            stopped_tree.continue_now();
            early = Some((dumped, stopped_tree, (ms(ctx.started), continued)));
        };
        let on_read: Option<&mut dyn FnMut()> = if ctx.leave_running {
            Some(&mut continue_early)
        } else {
            None
        };
        let stored = pipeline::dump_tree(
            self.criu,
            ctx.store,
            ctx.progress,
            &req,
            ctx.ingest,
            ctx.procs.resident_bytes(&self.pids),
            on_read,
        )?;
        let (dumped, stopped_tree, paused) = match early {
            Some((d, s, p)) => (d, s, Some(p)),
            None => {
                let (d, s, kept) = take_over();
                self.network_lock = kept;
                (d, s, None)
            }
        };
        let held = Box::new(TreeHeld {
            tree: stopped_tree,
            started: ctx.started,
            paused,
        });
        // CRIU finished, but the store may not have taken every image: on error `held`, dropped,
        // continues the tree.
        let streamed = stored.transpose()?;
        self.reopened = match &self.plugin {
            Some(p) => p.records()?,
            None => Vec::new(),
        };
        self.dumped = dumped;
        Ok(Dumped {
            streamed,
            held,
            hold_ms: 0.0,
        })
    }

    fn describe(&mut self, manifest: &mut CheckpointManifest) -> crate::Result<()> {
        manifest.criu = self.criu_info.take().expect("prepared");
        manifest.process_tree = std::mem::take(&mut self.dumped);
        manifest.options.criu = self.opts.criu.clone();
        manifest.devices = std::mem::take(&mut self.reopened);
        manifest.kept_network_lock = self.network_lock.take();
        Ok(())
    }

    fn undone(&self) -> &'static str {
        "the checkpoint was undone, the tree runs as before and nothing was stored"
    }
}

/// The tree CRIU dumped, held until the checkpoint is durable: continued when dropped before (`undo.rs`).
struct TreeHeld {
    tree: ContinueGuard,
    started: Instant,
    /// How long it was held stopped, and whether it was continued by us: once let go.
    paused: Option<(f64, bool)>,
}

impl pipeline::Held for TreeHeld {
    fn release(&mut self) -> crate::Result<()> {
        if self.paused.is_none() {
            let continued = self.tree.armed();
            self.tree.continue_now();
            self.paused = Some((ms(self.started), continued));
        }
        Ok(())
    }

    fn paused(&self) -> Option<(f64, bool)> {
        self.paused
    }

    fn stop(self: Box<Self>, checkpoint: &str) -> crate::Result<()> {
        let left = self.tree.disarm().kill(KILL_TIMEOUT);
        if !left.is_empty() {
            return Err(Error::NotStopped {
                id: checkpoint.to_string(),
                pids: left,
            }
            .into());
        }
        Ok(())
    }
}

/// The processes of `pids` that are stopped (state T: SIGSTOP, job control, or what an interrupted
/// checkpoint or a debugger left; t: traced). CRIU dumps them stopped and restores them stopped: without
/// `--allow-stopped` the tree is refused, since a restore of what an interrupted checkpoint left would exit
/// 0 with a process that never runs again.
fn stopped_processes(procs: &dyn Processes, pids: &[i32]) -> Vec<(i32, char)> {
    pids.iter()
        .filter_map(|&p| procs.stat(p).map(|s| (p, s.state)))
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

#[cfg(test)]
mod leave_running_tests;
#[cfg(test)]
mod phase_tests;
#[cfg(test)]
mod tests;
