//! The one checkpoint and the one restore: each a sequence of the stages with their undo guards, run on
//! a **target** that says what is checkpointed or restored and how (`docs/architecture.md` draws it).
//!
//! Checkpoint ([`Pipeline::checkpoint`]), in order, whatever the target:
//! 1. the target refuses before anything is touched and finds its tree ([`CheckpointTarget::prepare`]:
//!    a process tree's locks, detect and refusals; a container's discovery through its runtime);
//! 2. the store begins the checkpoint; the guardian is told the tree, what the target adds
//!    ([`CheckpointTarget::tell`]) and the GPU backend, before anything is touched;
//! 3. the GPU freeze: what the host's GPU step cannot reach first (inside a sandbox:
//!    [`CheckpointTarget::freeze_inside`]), then the GPU hook, waiting at a job's lock barrier
//!    ([`Phases::locked`](super::Phases::locked)); each undone by a guard on any later failure;
//! 4. the target dumps its tree into the store ([`CheckpointTarget::dump`]: CRIU, or the container
//!    runtime's checkpoint) and hands back the tree it holds ([`Held`]: stopped, or paused by the
//!    runtime), put back when dropped;
//! 5. with `--leave-running` the tree and its GPU state are let go before the commit;
//! 6. the manifest (with the target's own part: [`CheckpointTarget::describe`]) is committed, a job
//!    member waits for the job's outcome ([`Phases::durable`](super::Phases::durable)), the guardian hears it is durable;
//! 7. without `--leave-running` the tree is stopped for good ([`Held::stop`]).
//!
//! A signal between the steps undoes what was done ([`check_interrupt`]); a failure anywhere before the
//! commit drops the guards in the reverse order of the steps, so the tree runs as before, its GPU state
//! back, nothing stored.
//!
//! The pieces the targets share live here too: the streamed dump of CRIU's images into the store
//! (`dump.rs`), the images served from the store to a restore (`serve.rs`), the GPU step's guard
//! (`thaw.rs`) and the shared steps (`steps.rs`).

mod checkpoint;
mod dump;
mod restore;
mod serve;
mod steps;
mod thaw;

use std::time::Instant;

use crate::detect::Report;
use crate::exit::{Classify, ExitStatus};
use crate::freeze::GpuHook;
use crate::proc::Processes;
use crate::store::{Ingest, Progress, Store, Streamed};

use super::manifest::CheckpointManifest;
use super::Watch;

pub use checkpoint::{CheckpointCommon, Checkpointed, Timings};
pub use dump::{dump_tree, store_error_first, tell_network, DUMP_LOG};
pub use restore::{
    Discard, Found, GpuRestore, GpuStep, RestoreContext, RestoreTarget, RestoreTimings, Restored,
    RestoredCheckpoint,
};
pub use serve::{restore_streamed, send_image};
pub use steps::{aborted_at_lock, after_durable, check_interrupt, freeze_phased};
pub use thaw::GpuThawGuard;

/// The pipeline's own errors: what a step shared by every target says.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A signal came while the tree was held: what was done is undone (`undone` says what that means).
    #[error("interrupted by {signal}: {undone}")]
    Interrupted { signal: String, undone: String },
    #[error("the job checkpoint aborted: {reason}; this member's checkpoint was undone, the tree runs as before and nothing was kept")]
    Aborted { reason: String },
    #[error("the job checkpoint's outcome is unknown ({reason}): the tree runs as before, and this member's checkpoint {id} is kept, as a committed job checkpoint may name it (`job list` tells; `gpu-checkpoint delete {id}` if none does)")]
    InDoubt { id: String, reason: String },
    #[error("measuring the images in {}: {source}", path.display())]
    Images {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::Interrupted { .. } => ExitStatus::Interrupted,
            Error::Aborted { .. } | Error::InDoubt { .. } | Error::Images { .. } => {
                ExitStatus::Failure
            }
        }
    }
}

/// What the pipeline works with around its target: the GPU step, the store, the progress display, the
/// guardian and the live processes, each chosen by the caller (the real ones, or test ones).
pub struct Pipeline<'a> {
    pub gpu: &'a mut dyn GpuHook,
    pub store: &'a Store,
    pub progress: &'a dyn Progress,
    pub watch: &'a dyn Watch,
    pub procs: &'a dyn Processes,
}

/// What a checkpoint target found before touching anything ([`CheckpointTarget::prepare`]).
#[derive(Debug, Clone)]
pub struct Prepared {
    /// The tree's root (a container's init), the GPU step's root.
    pub root_pid: i32,
    /// Every process the checkpoint holds, root first.
    pub pids: Vec<i32>,
    /// Those stopped before the checkpoint (`--allow-stopped`): they stay stopped whatever happens.
    pub stopped: Vec<i32>,
    /// Detect's report of the tree, recorded in the manifest.
    pub report: Report,
    /// Whether the host's GPU step freezes the report's GPU processes; not where their GPU state is
    /// out of its reach (inside a gVisor sandbox, frozen by [`CheckpointTarget::freeze_inside`]).
    pub gpu_on_host: bool,
}

/// Where a target's dump goes and whom it tells ([`CheckpointTarget::dump`]).
pub struct DumpContext<'c> {
    pub ingest: &'c Ingest,
    pub store: &'c Store,
    pub progress: &'c dyn Progress,
    pub watch: &'c dyn Watch,
    pub procs: &'c dyn Processes,
    pub leave_running: bool,
    /// When the dump started: how long a tree let go early was held is measured from it.
    pub started: Instant,
}

/// What a target's dump hands back: the store's side of the images and the tree, held.
pub struct Dumped<'a> {
    /// The images that went straight into the store (`None`: they are files in the staging folder).
    pub streamed: Option<Streamed>,
    /// The tree as the dump left it, put back when dropped until the checkpoint is durable.
    pub held: Box<dyn Held + 'a>,
    /// How long of the dump went to holding the tree before its images were taken (a container's
    /// pause), in milliseconds: not counted as the dump itself.
    pub hold_ms: f64,
}

/// A tree (or what of it the GPU step cannot reach) held by a checkpoint until it is durable: stopped by
/// CRIU, paused or stopped by a container runtime, its GPU state checkpointed inside a sandbox. Dropped
/// before [`Held::release`] or [`Held::stop`], it puts the tree back as it was (the undo).
pub trait Held {
    /// `--leave-running`: lets the tree run on now, before the commit; from here on nothing of it is
    /// undone. A second call does nothing.
    fn release(&mut self) -> crate::Result<()>;
    /// With `--leave-running`: how long the tree was held stopped from the dump's start until it ran
    /// again, and whether the pipeline continued it (rather than its dumper letting it go).
    fn paused(&self) -> Option<(f64, bool)> {
        None
    }
    /// Checkpoint `checkpoint` is durable and the tree is to go (migration): stops it for good.
    fn stop(self: Box<Self>, checkpoint: &str) -> crate::Result<()>;
}

/// What a checkpoint is of: a process tree (`flows/checkpoint`), a container or sandbox
/// (`flows/container`), each as a job member too (through [`Phases`](super::Phases)). The pipeline owns the order,
/// the GPU step, the store and the guardian; the target supplies what differs.
pub trait CheckpointTarget<'a> {
    /// Refuses before anything is touched, and finds the tree.
    fn prepare(&mut self, store: &Store) -> crate::Result<Prepared>;

    /// Tells the guardian what it would have to undo beyond the tree and its host GPU state (a
    /// sandbox its runtime cannot hold paused), before anything is touched.
    fn tell(&mut self, _watch: &dyn Watch) -> crate::Result<()> {
        Ok(())
    }

    /// Freezes the GPU state the host's GPU step cannot reach (inside a sandbox), before it: what puts
    /// it back, dropped after the GPU step's own undo.
    fn freeze_inside(&mut self) -> crate::Result<Option<Box<dyn Held + 'a>>> {
        Ok(None)
    }

    /// Dumps the tree into `ctx.ingest`; a failure leaves the tree as the dump found it (the target's
    /// own guards, dropped, put it back).
    fn dump(&mut self, ctx: &DumpContext<'_>) -> crate::Result<Dumped<'a>>;

    /// The manifest's part of the target (its CRIU, process list, options, devices, container), filled in
    /// before the commit; an error undoes the checkpoint.
    fn describe(&mut self, manifest: &mut CheckpointManifest) -> crate::Result<()>;

    /// What an interrupted checkpoint of this target left: said with the signal.
    fn undone(&self) -> &'static str;
}
