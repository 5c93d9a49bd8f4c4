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
mod checkpoint;
mod direct;
mod discover;
mod follow;
mod guards;
mod restore;
pub mod rootfs_diff;
mod sandbox;

use std::path::PathBuf;
use std::time::Duration;

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

use super::manifest::CheckpointManifest;
use super::pipeline::{CheckpointCommon, Pipeline};
use super::{Alone, Phases};
use crate::detect::DetectOptions;
use crate::dump::Criu;
use crate::fault;
use crate::freeze::GpuHook;
use crate::store::{CheckpointInfo, Progress, Store};

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
    /// The live processes: /proc and signals ([`crate::proc::Live`], or a test table).
    pub procs: &'a dyn crate::proc::Processes,
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
pub(super) const KILL_TIMEOUT: Duration = Duration::from_secs(10);

/// An injected runtime failure (`GPU_CHECKPOINT_FAULT=container.runtime-checkpoint=eio`), as the
/// runtime's own would come.
pub(super) fn injected(point: &str, runtime: &dyn ContainerRuntime) -> Result<(), Error> {
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
        let mut target = checkpoint::Container::new(self.runtime, self.direct, opts, self.procs);
        let common = CheckpointCommon::new(&opts.name, opts.leave_running);
        let out = self.pipeline().checkpoint(&mut target, &common, phases)?;
        let t = out.timings;
        Ok(ContainerCheckpointOutcome {
            info: out.info,
            manifest: out.manifest,
            timings: CheckpointTimings {
                detect: t.detect,
                freeze: t.freeze,
                pause: t.hold,
                runtime_checkpoint: t.dump,
                write: t.write,
                stop: t.stop,
                total: t.total,
            },
            stopped: out.stopped,
            direct: target.direct.is_some(),
        })
    }

    /// The pipeline with this flow's GPU step, store, progress display and guardian.
    fn pipeline(&mut self) -> Pipeline<'_> {
        Pipeline {
            gpu: &mut *self.gpu,
            store: self.store,
            progress: self.progress,
            watch: self.watch,
            procs: self.procs,
        }
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
pub(super) fn link_files(
    from: &std::path::Path,
    to: &std::path::Path,
    streamed: Option<&crate::store::Streamed>,
) -> Result<(), Error> {
    let failed = Error::io_at(from);
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
    pub(super) fn create(store: &Store, id: &str) -> Result<WorkDir, Error> {
        let place = crate::flows::workdir::Place {
            store: store.local_dir(),
            folder: "container-work",
            temp_prefix: "gpu-checkpoint-container",
        };
        crate::flows::workdir::WorkDir::create(&place, id)
            .map(WorkDir)
            .map_err(|(path, source)| Error::WorkDir { path, source })
    }

    pub(super) fn path(&self) -> &std::path::Path {
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
