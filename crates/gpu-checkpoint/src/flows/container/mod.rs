//! The container flow: a container of an OCI runtime (runc, runsc) checkpointed from the host, its GPU
//! processes frozen by us and its CPU side dumped by the runtime itself, which knows the container's
//! mounts, namespaces, cgroups and descriptors (see `docs/containers.md`).
//!
//! Checkpoint, in order, and why:
//! 1. Refuse before touching anything: the runtime knows the container and it runs; the store is writable.
//! 2. Find the container's processes from the host (`members.rs`: same cgroups and PID namespace as its
//!    init), and detect's report of its tree (GPU processes by NVML or /proc, as for a process).
//! 3. GPU freeze (lock + checkpoint) of its CUDA processes: undone on any later failure (a guard). In a
//!    gVisor sandbox, by a cuda-checkpoint-compatible tool run inside it on guest PIDs (`sandbox.rs`),
//!    its undo after the sandbox is brought back.
//! 4. Where the runtime can (runc), pause the container, then dump it, leaving it running: by default
//!    with our CRIU and the settings the runtime itself would give CRIU (`direct.rs`), the images
//!    streamed into the store (no staged copy); else (runsc, or `via_runtime`) by the runtime's own
//!    `checkpoint` into the store's private staging folder (runsc: into a work folder of ours, its
//!    `checkpoint.img` stored while runsc writes it, `follow.rs`). The container stays stopped (frozen)
//!    until the checkpoint is durable, and a failure before that resumes it (a guard, dropped before the
//!    GPU one: the GPU restore runs in the processes). Without `--leave-running`, only once the checkpoint
//!    is durable is the container killed and deleted, as `runc checkpoint` would have done.
//! 5. The store takes the images (dedup across checkpoints and containers) and commits the manifest,
//!    which records the container (runtime, its flags, id, bundle, its processes' PIDs inside it).
//!
//! Restore (`restore.rs`): the images are materialized into a private folder, the runtime restores the
//! container detached under the id asked for (it manages it afterwards: `runc list`, `runc kill`), then
//! the GPU state is restored + unlocked in its processes, found again under their new host PIDs through
//! their PIDs inside the container. A failure kills and deletes the restored container (after unmounting
//! what the runtime left mounted: `oci.rs`); the checkpoint is never changed. Should this process die
//! half-way, the guardian, told before the runtime's restore, does the same (`guards::RestoreUndo`).

pub mod archive;
mod direct;
mod discover;
mod follow;
mod guards;
mod restore;
pub mod rootfs_diff;
mod sandbox;

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use discover::{blocked, discover, discover_in, Discovered};
pub use follow::{Follow, FollowReader};
pub use restore::{ContainerRestoreOptions, ContainerRestoreOutcome, RestoreTimings};
// The runtime seam the flow drives (`flows/runtime`), under the names its users know.
#[cfg(test)]
pub use crate::flows::runtime::FakeRuntime;
pub use crate::flows::runtime::{
    check_container_id, members, unmount_under, CheckpointRequest, ContainerRuntime,
    ContainerState, DirectDump, Error, OciCli, RestoreRequest, RestoreUndo, RuntimeKind,
    SandboxUndo,
};

use super::checkpoint::{aborted_at_lock, after_durable, freeze_phased};
use super::guardian::Event;
use super::manifest::{self, CheckpointManifest, ContainerRecord, CriuInfo, HostInfo};
use super::manifest::{OptionsRecord, PhaseTimings};
use super::ms;
use super::thaw::GpuThawGuard;
use super::{Alone, Phases};
use crate::detect::{self, DetectOptions, Report, StrategyName};
use crate::dump::Criu;
use crate::fault;
use crate::freeze::{FreezeContext, GpuHook};
use crate::interrupt::InterruptGuard;
use crate::store::{CheckpointInfo, Progress, Store};
use guards::{ResumeGuard, Revive};

/// The outside world of the container flow, chosen by the caller.
pub struct ContainerFlow<'a> {
    pub runtime: &'a dyn ContainerRuntime,
    pub gpu: &'a mut dyn GpuHook,
    pub store: &'a Store,
    pub progress: &'a dyn Progress,
    /// Our CRIU, to dump the container directly with the runtime's settings where the runtime offers
    /// them ([`ContainerRuntime::direct_dump`]: runc), its images streamed into the store, unless asked
    /// for the runtime's own checkpoint (which runs the same CRIU, runc's `--criu`); the manifest records
    /// it. `None`: the runtime checkpoints by itself (runsc).
    pub direct: Option<&'a dyn Criu>,
    /// Who is told each step of a checkpoint or restore, to undo or finish it should this process die
    /// ([`super::guardian`]): it resumes the paused container, puts the GPU state back, or stops the
    /// container once the checkpoint is durable; it deletes a half-restored container.
    pub watch: &'a dyn super::Watch,
}

/// What to checkpoint and how.
#[derive(Debug, Clone)]
pub struct ContainerCheckpointOptions {
    /// The container's id in its runtime.
    pub id: String,
    pub name: Option<String>,
    /// Keep the container running (default: kill and delete it once the checkpoint is durable).
    pub leave_running: bool,
    /// How detect looks at the container's processes (`tree` is forced on).
    pub detect: DetectOptions,
    /// CRIU's `--tcp-established` (runc only).
    pub tcp_established: bool,
    /// Let the runtime dump the container (`runc checkpoint` into the staging folder, then stored)
    /// even where CRIU could be driven directly: the fallback for a setting the direct path does not
    /// take over (docs/containers.md).
    pub via_runtime: bool,
    /// A cuda-checkpoint-compatible tool, as a path inside the sandbox, that freezes the GPU state
    /// inside a gVisor sandbox (`sandbox.rs`); without it such a sandbox is refused.
    pub sandbox_gpu_tool: Option<PathBuf>,
}

impl ContainerCheckpointOptions {
    pub fn new(id: &str) -> Self {
        ContainerCheckpointOptions {
            id: id.to_string(),
            name: None,
            leave_running: false,
            detect: DetectOptions {
                tree: true,
                ..DetectOptions::default()
            },
            tcp_established: false,
            via_runtime: false,
            sandbox_gpu_tool: None,
        }
    }
}

/// Timings of one container checkpoint, in milliseconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CheckpointTimings {
    pub detect: f64,
    /// The GPU step's lock + checkpoint (0 without GPU state).
    pub freeze: f64,
    /// The runtime's pause (0 where it cannot hold the container paused).
    pub pause: f64,
    /// The runtime's checkpoint into the staging folder (the direct dump, and runsc: with the images
    /// stored meanwhile).
    pub runtime_checkpoint: f64,
    /// Storing the images and committing the manifest.
    pub write: f64,
    /// Killing and deleting the container (0 with `--leave-running`).
    pub stop: f64,
    pub total: f64,
}

/// A finished container checkpoint.
#[derive(Debug, Clone)]
pub struct ContainerCheckpointOutcome {
    pub info: CheckpointInfo,
    pub manifest: CheckpointManifest,
    pub timings: CheckpointTimings,
    /// The container was killed and deleted (false with `--leave-running`).
    pub stopped: bool,
    /// Our CRIU dumped it with the runtime's settings, the images streamed into the store (false: the
    /// runtime's own checkpoint, then stored).
    pub direct: bool,
}

/// How long a killed container's init may take to go.
const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// A signal came since `interrupt` was made: the caller's guards undo as it returns the error.
fn check_interrupt(interrupt: &InterruptGuard) -> Result<(), Error> {
    if !interrupt.interrupted() {
        return Ok(());
    }
    Err(Error::Interrupted {
        signal: crate::interrupt::last_signal().unwrap_or_else(|| "a signal".into()),
        undone: "the checkpoint was undone, the container runs as before and nothing was stored"
            .into(),
    })
}

/// An injected runtime failure (`GPU_CHECKPOINT_FAULT=container.runtime-checkpoint=eio`), as the
/// runtime's own would come.
fn injected(point: &str, runtime: &dyn ContainerRuntime) -> Result<(), Error> {
    match fault::io_error(point) {
        None => Ok(()),
        Some(e) => Err(Error::Runtime {
            command: format!("{} ({point})", runtime.name()),
            status: "injected fault".into(),
            stderr: e.to_string(),
            log: None,
        }),
    }
}

impl ContainerFlow<'_> {
    /// Checkpoints a container; see the module documentation for the order and the undo.
    pub fn checkpoint(
        &mut self,
        opts: &ContainerCheckpointOptions,
    ) -> crate::Result<ContainerCheckpointOutcome> {
        self.checkpoint_phased(opts, &Alone)
    }

    /// [`ContainerFlow::checkpoint`] as one member of a job checkpoint (a member given by container):
    /// waits at `phases`' barriers, once its GPU processes are locked and once its checkpoint is
    /// durable, and undoes as any failed checkpoint when one says no (in doubt, keeping the checkpoint).
    pub fn checkpoint_phased(
        &mut self,
        opts: &ContainerCheckpointOptions,
        phases: &dyn Phases,
    ) -> crate::Result<ContainerCheckpointOutcome> {
        let started = Instant::now();
        let started_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let interrupt = InterruptGuard::new();
        let id = opts.id.as_str();
        // 1-2. Refuse before touching anything.
        let t = Instant::now();
        let found = discover(self.runtime, id, &opts.detect)?;
        self.store.check_writable()?;
        // Our CRIU's version, for the manifest; a CRIU whose check ran beside the discovery
        // (`dump::PendingCriu`) is waited for here, and a failed check stops us before anything is touched.
        let criu = match self.direct {
            Some(c) => Some(CriuInfo {
                version: c.version()?,
                path: c.describe(),
            }),
            None => None,
        };
        if let Some(reason) = blocked(&found.report) {
            return Err(Error::Unsupported {
                id: id.into(),
                reason,
            }
            .into());
        }
        let from_host = self.runtime.gpu_from_host();
        // A runtime that freezes the sandbox's GPU state itself is handed the tool instead: nothing of
        // ours runs inside, no guest PID is recorded, and its restore puts the state back.
        let by_runtime =
            !from_host && opts.sandbox_gpu_tool.is_some() && self.runtime.checkpoints_gpu_itself();
        let in_sandbox = match &opts.sandbox_gpu_tool {
            Some(tool) if by_runtime => Some((tool, Vec::new())),
            Some(tool) if !from_host => Some((tool, sandbox::gpu_pids(self.runtime, id, tool)?)),
            _ => None,
        };
        if in_sandbox.is_none() && !from_host && found.report.strategy.name != StrategyName::None {
            return Err(Error::Unsupported {
                id: id.into(),
                reason: format!(
                    "it holds GPU state (strategy {}), and under {} the application's CUDA state lives inside the sandbox, out of reach of a freeze from the host: name a cuda-checkpoint-compatible tool inside it (docs/containers.md)",
                    found.report.strategy.name,
                    self.runtime.name()
                ),
            }
            .into());
        }
        // CRIU driven directly where the runtime says how (runc); asked before anything is touched.
        let direct = match (self.direct, opts.via_runtime) {
            (Some(criu), false) => self
                .runtime
                .direct_dump(id, found.state.pid)?
                .map(|d| (criu, d)),
            _ => None,
        };
        let pids: Vec<i32> = found.processes.iter().map(|m| m.pid).collect();
        if direct.is_none() && opts.tcp_established && !opts.leave_running {
            direct::warn_outside_peers(&pids, self.runtime.name());
        }
        let process_tree: Vec<crate::proc::TreeProcess> = pids
            .iter()
            .filter_map(|&p| {
                let s = crate::proc::stat(p)?;
                Some(crate::proc::TreeProcess {
                    pid: p,
                    ppid: s.ppid,
                    comm: s.comm.clone(),
                    cmdline: String::new(),
                    threads: s.threads,
                })
            })
            .collect();
        let mut timings = CheckpointTimings {
            detect: ms(t),
            ..CheckpointTimings::default()
        };
        let ingest = self.store.begin(opts.name.as_deref())?;
        // The guardian learns what it would have to put back before anything is touched.
        self.watch.tell(&Event::Checkpoint {
            pids: pids.clone(),
            leave_running: opts.leave_running,
            stopped: Vec::new(),
        })?;
        // The tool inside a sandbox and the guest PIDs it freezes: for the guardian and the manifest.
        let sandbox_gpu = match &in_sandbox {
            Some((tool, guest)) => (Some(tool.to_path_buf()), guest.clone()),
            None => (None, Vec::new()),
        };
        if let Some(runtime) = self
            .runtime
            .cli()
            .filter(|_| !self.runtime.can_hold_paused())
        {
            self.watch.tell(&Event::Sandbox(SandboxUndo {
                runtime,
                id: id.to_string(),
                bundle: found.state.bundle.clone(),
                tcp_established: opts.tcp_established,
                gpu_tool: sandbox_gpu.0.clone(),
                gpu_pids: sandbox_gpu.1.clone(),
            }))?;
        }
        if found.report.strategy.name != StrategyName::None && in_sandbox.is_none() {
            if let Some(backend) = self.gpu.backend() {
                self.watch.tell(&Event::Gpu { backend })?;
            }
        }
        fault::at("checkpoint.before-freeze");
        check_interrupt(&interrupt)?;

        // 3. GPU freeze; the guard puts it back on any way out before the commit. Inside a sandbox,
        // by the tool there (its guard is dropped after the one that brings the sandbox back).
        let t = Instant::now();
        let sandboxed = match &in_sandbox {
            Some((tool, guest)) if !by_runtime => Some(sandbox::SandboxFrozen::freeze(
                self.runtime,
                id,
                tool,
                guest,
            )?),
            _ => None,
        };
        let host_report;
        let report = if in_sandbox.is_some() {
            // The host side has nothing of its own to freeze.
            host_report = Report {
                strategy: detect::StrategyDecision {
                    name: StrategyName::None,
                    blockers: Vec::new(),
                },
                ..found.report.clone()
            };
            &host_report
        } else {
            &found.report
        };
        let ctx = FreezeContext {
            root_pid: found.state.pid,
            pids: &pids,
            report,
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

        // 4. The runtime's checkpoint, with the container held paused where the runtime can.
        let hold = self.runtime.can_hold_paused();
        let t = Instant::now();
        let mut paused = if hold {
            self.watch.tell(&Event::Paused {
                resume: self.runtime.resume_command(id),
            })?;
            self.runtime.pause(id)?;
            Some(ResumeGuard {
                runtime: self.runtime,
                id: id.to_string(),
                armed: true,
                stopped: None,
                network: None,
            })
        } else {
            None
        };
        timings.pause = ms(t);
        let t = Instant::now();
        // A runtime that cannot hold the container paused stops it at its checkpoint, and the undo
        // restores it from the images: those must outlive a failed commit, which removes the staging
        // folder. They go to a work folder of ours, linked into the staging folder afterwards.
        let own_images = (!hold)
            .then(|| WorkDir::create(self.store, ingest.id()))
            .transpose()?;
        let images = own_images
            .as_ref()
            .map_or(ingest.staging_dir(), WorkDir::path);
        if let Some(w) = &own_images {
            self.watch.tell(&Event::Stopping {
                images: w.path().to_path_buf(),
            })?;
        }
        injected("container.runtime-checkpoint", self.runtime)?;
        let streamed = match &direct {
            Some((criu, d)) => {
                let locks_before = if direct::leaves_stopped(opts) {
                    crate::dump::LocksBefore::of(found.state.pid)
                } else {
                    Default::default()
                };
                let stored = direct::dump_direct(
                    *criu,
                    d,
                    &found,
                    (self.store, self.progress, &ingest),
                    opts,
                )?;
                if let Some(p) = paused.as_mut().filter(|_| direct::leaves_stopped(opts)) {
                    p.stopped = Some(crate::proc::Held::open(&pids));
                    let log = ingest.staging_dir().join(super::checkpoint::DUMP_LOG);
                    let lock = d.options.effective_network_lock();
                    let hold =
                        crate::dump::NetworkHold::after_dump(&pids, &log, lock, &locks_before);
                    super::checkpoint::tell_network(self.watch, &hold);
                    p.network = Some(hold);
                }
                stored.map(Ok)
            }
            None => {
                let req = CheckpointRequest {
                    id,
                    images,
                    leave_running: hold,
                    tcp_established: opts.tcp_established,
                    gpu_tool: in_sandbox
                        .as_ref()
                        .filter(|_| by_runtime)
                        .map(|(tool, _)| tool.as_path()),
                };
                match self
                    .runtime
                    .followed_image()
                    .filter(|_| own_images.is_some())
                {
                    Some(name) => {
                        let expected = super::checkpoint::stream::resident_bytes(&pids);
                        let at = (&ingest, self.progress, expected);
                        let f = follow::checkpoint_following(self.runtime, &req, name, at);
                        f.dumped?;
                        // A store failure is returned once the undo below is armed.
                        Some(f.stored)
                    }
                    None => {
                        self.runtime.checkpoint(&req)?;
                        None
                    }
                }
            }
        };
        let revive = own_images.as_ref().map(|w| Revive {
            runtime: self.runtime,
            id: id.to_string(),
            images: w.path().to_path_buf(),
            bundle: found.state.bundle.clone(),
            tcp_established: opts.tcp_established,
            armed: true,
        });
        let streamed = streamed.transpose()?;
        if let Some(w) = &own_images {
            link_files(w.path(), ingest.staging_dir(), streamed.as_ref())?;
        }
        timings.runtime_checkpoint = ms(t);
        fault::at("checkpoint.after-dump");
        check_interrupt(&interrupt)?;
        let paused = match paused {
            Some(p) if opts.leave_running => {
                // It runs on: GPU work and the container resume while the images are stored.
                p.resume_now()?;
                None
            }
            other => other,
        };
        let revive = match revive {
            Some(r) if opts.leave_running => {
                r.now()?;
                None
            }
            other => other,
        };
        let sandboxed = match sandboxed {
            Some(s) if opts.leave_running => {
                s.thaw()?;
                None
            }
            other => other,
        };
        if opts.leave_running {
            let thaw = gpu.thaw()?;
            if let (Some(record), Some(thaw)) = (gpu_record.as_mut(), thaw) {
                record.thaw = Some(thaw);
            }
        }

        // 5. Commit.
        let sizes = super::checkpoint::image_sizes(ingest.staging_dir(), streamed.as_ref())?;
        let manifest = CheckpointManifest {
            schema: manifest::SCHEMA.into(),
            schema_version: manifest::SCHEMA_VERSION,
            id: ingest.id().to_string(),
            name: opts.name.clone(),
            started_unix_ms,
            host: HostInfo::current(),
            criu: criu.unwrap_or_else(|| CriuInfo {
                version: crate::dump::CriuVersion {
                    major: 0,
                    minor: 0,
                    sublevel: 0,
                },
                path: format!("{}'s own", self.runtime.name()),
            }),
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            root_pid: found.state.pid,
            process_tree,
            strategy: found.report.strategy.name,
            detect: found.report.clone(),
            gpu_step: gpu.name().to_string(),
            gpu: serde_json::to_value(&gpu_record)
                .map_err(|e| crate::store::Error::Invalid(format!("encoding the manifest: {e}")))?,
            options: OptionsRecord {
                leave_running: opts.leave_running,
                criu: crate::dump::CriuOptions::default(),
            },
            timings_ms: PhaseTimings {
                detect: timings.detect,
                freeze: timings.freeze,
                dump: timings.runtime_checkpoint,
                streamed: streamed.is_some(),
            },
            sizes,
            devices: Vec::new(),
            container: Some(ContainerRecord {
                runtime: self.runtime.name().to_string(),
                global_args: self.runtime.global_args(),
                id: id.to_string(),
                bundle: found.state.bundle.clone(),
                processes: found.processes.clone(),
                tcp_established: opts.tcp_established,
                sandbox_gpu_tool: sandbox_gpu.0,
                sandbox_gpu_pids: sandbox_gpu.1,
                sandbox_gpu_by_runtime: by_runtime,
            }),
        };
        let metadata = serde_json::to_value(&manifest)
            .map_err(|e| crate::store::Error::Invalid(format!("encoding the manifest: {e}")))?;
        let t = Instant::now();
        check_interrupt(&interrupt)?;
        let info = ingest.commit_streamed(streamed.unwrap_or_default(), metadata, self.progress)?;
        timings.write = ms(t);
        // A job member holds everything (paused, GPU checkpointed) until the job commits.
        after_durable(phases, self.store, &info.id)?;
        if let Err(e) = self.watch.tell(&Event::Durable) {
            tracing::warn!("{e}");
        }
        fault::at("checkpoint.after-commit");

        // Durable: nothing is undone any more.
        let t = Instant::now();
        let stopped = !opts.leave_running;
        if stopped {
            gpu.committed();
            if let Some(p) = paused {
                p.disarm();
            }
            if let Some(mut r) = revive {
                r.armed = false;
            }
            if let Some(mut s) = sandboxed {
                s.armed = false;
            }
            self.stop(id, found.state.pid)?;
        }
        timings.stop = ms(t);
        timings.total = ms(started);
        Ok(ContainerCheckpointOutcome {
            info,
            manifest,
            timings,
            stopped,
            direct: direct.is_some(),
        })
    }

    /// Kills and deletes the checkpointed container (as `runc checkpoint` does), waiting for its init.
    fn stop(&self, id: &str, init: i32) -> Result<(), Error> {
        // A paused container gets SIGKILL only once thawed by the kernel; runc's `delete --force`
        // kills, thaws and removes it in one go.
        self.runtime.delete(id, true)?;
        let left = crate::proc::wait_until(KILL_TIMEOUT, || {
            crate::proc::stat(init)
                .filter(|s| !s.is_dying())
                .map(|_| init)
                .into_iter()
                .collect()
        });
        if !left.is_empty() {
            return Err(Error::Processes {
                id: id.into(),
                reason: format!("checkpoint stored, but its init (pid {init}) still runs"),
            });
        }
        Ok(())
    }
}

/// The container flow's undo of the records it tells the guardian: what the guardian process is
/// handed when it starts ([`crate::flows::guardian::serve`]).
pub struct GuardianUndo;

impl crate::flows::runtime::RuntimeUndo for GuardianUndo {
    fn sandbox(&self, undo: &SandboxUndo, images: Option<&std::path::Path>) -> String {
        guards::undo_sandbox(undo, images)
    }

    fn container_restore(&self, undo: &RestoreUndo) -> String {
        restore::undo_restore(undo)
    }
}

/// Hard-links (copies, across file systems) every file of `from` into `to`, which CRIU-style image
/// folders keep flat.
fn link_files(
    from: &std::path::Path,
    to: &std::path::Path,
    streamed: Option<&crate::store::Streamed>,
) -> Result<(), Error> {
    let failed = |source| Error::WorkDir {
        path: from.to_path_buf(),
        source,
    };
    for e in std::fs::read_dir(from).map_err(failed)? {
        let e = e.map_err(failed)?;
        let name = e.file_name();
        // Already stored as it was written.
        let was_streamed = streamed.is_some_and(|s| s.names().any(|n| *n == *name));
        if was_streamed || !e.file_type().map_err(failed)?.is_file() {
            continue;
        }
        let dest = to.join(e.file_name());
        if std::fs::hard_link(e.path(), &dest).is_err() {
            std::fs::copy(e.path(), &dest).map_err(failed)?;
        }
    }
    Ok(())
}

/// Where [`ContainerFlow`] puts the runtime's images on restore (and runsc's on checkpoint): a private
/// folder in the store's folder (same disk as the chunks, so that links work), removed when dropped.
pub(crate) struct WorkDir(crate::flows::workdir::WorkDir);

impl WorkDir {
    fn create(store: &Store, id: &str) -> Result<WorkDir, Error> {
        let place = crate::flows::workdir::Place {
            store: store.local_dir(),
            folder: "container-work",
            temp_prefix: "gpu-checkpoint-container",
        };
        crate::flows::workdir::WorkDir::create(&place, id)
            .map(WorkDir)
            .map_err(|(path, source)| Error::WorkDir { path, source })
    }

    fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        // Never through what a failed restore left mounted in it (the folder itself is removed after this).
        unmount_under(self.0.path());
    }
}

#[cfg(test)]
mod tests;
