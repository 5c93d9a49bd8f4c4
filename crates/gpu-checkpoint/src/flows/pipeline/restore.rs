//! The restore sequence, whatever the target: a process tree CRIU restores (`flows/restore`), a container
//! its runtime restores (`flows/container/restore.rs`).
//!
//! In order, and why:
//! 1. the target finds the checkpoint and refuses what it cannot restore ([`RestoreTarget::find`],
//!    [`RestoreTarget::check`]: a PID in use, too little memory, another runtime's checkpoint);
//! 2. the GPU step checks this node can take the GPU state ([`crate::freeze::GpuHook::prepare_restore`]);
//! 3. the target readies its work folder ([`RestoreTarget::prepare`]) and tells the guardian what it
//!    would undo should this process die ([`RestoreTarget::tell`]);
//! 4. a signal until here stops the restore before anything is created ([`super::check_interrupt`]);
//! 5. the target restores the tree from the images ([`RestoreTarget::restore`]: CRIU, or the runtime),
//!    every chunk verified first; what it restored is discarded should a later step fail
//!    ([`Discard`]);
//! 6. the GPU state goes back into the restored processes, waiting at a job restore's barrier between
//!    the restore and the unlock ([`RestoreTarget::restore_gpu`]); where the processes run before all
//!    of their memory is in, the target runs this step while the memory comes in ([`GpuStep::run`]);
//! 7. the restored tree is kept.
//!
//! Nothing here changes the checkpoint: a failed restore can be tried again.

use std::path::Path;
use std::time::Instant;

use super::{check_interrupt, Pipeline};
use crate::fault;
use crate::flows::manifest::CheckpointManifest;
use crate::flows::{ms, Watch};
use crate::freeze::{BeforeUnlock, GpuHook, GpuRecord, RestoreRecord};
use crate::interrupt::InterruptGuard;
use crate::store::{CheckpointInfo, Progress, Store};

/// The checkpoint a restore found, in its store.
pub struct Found<'c> {
    pub store: &'c Store,
    pub info: &'c CheckpointInfo,
    pub manifest: &'c CheckpointManifest,
}

/// What the target's own steps of a restore work with.
pub struct RestoreContext<'c> {
    pub store: &'c Store,
    pub progress: &'c dyn Progress,
    pub info: &'c CheckpointInfo,
    pub manifest: &'c CheckpointManifest,
    /// The restore's private work folder ([`RestoreTarget::prepare`]'s).
    pub work: &'c Path,
    /// The guardian (it holds what must outlive this process while the restore goes on).
    pub watch: &'c dyn Watch,
    /// When the restore started (the timings' origin).
    pub started: Instant,
}

/// A tree the target restored: its root, and what discards it unless the restore finishes.
pub struct Restored<'a> {
    /// The restored root's PID (a container's init).
    pub root_pid: i32,
    /// How long of the restore went to fetching images before the restore proper, in milliseconds.
    pub fetch_ms: f64,
    pub discard: Box<dyn Discard + 'a>,
}

/// A restored tree that must not run on unless its restore finishes (its GPU state back): killed (a
/// container deleted) when dropped, kept by [`Discard::keep`].
pub trait Discard {
    fn keep(self: Box<Self>);
}

/// The GPU step's part of a restore ([`RestoreTarget::restore_gpu`]): its record put back into the tree
/// restored at `root_pid`, waiting at `before_unlock` between the GPU restore and the unlock.
pub struct GpuRestore<'g> {
    pub gpu: &'g mut dyn GpuHook,
    pub record: Option<GpuRecord>,
    pub root_pid: i32,
    pub before_unlock: Option<&'g BeforeUnlock<'g>>,
}

/// The GPU step of a restore (restore + unlock), run once: by the target while its restore goes on
/// (processes resumed before their memory is in: the GPU restore overlaps the memory's coming in, its
/// faults served first), otherwise by the pipeline once the target's restore returned.
pub struct GpuStep<'g> {
    gpu: &'g mut dyn GpuHook,
    record: Option<GpuRecord>,
    before_unlock: Option<&'g BeforeUnlock<'g>>,
    started: Instant,
    done: Option<GpuDone>,
}

/// What [`GpuStep::run`] did: its result, how long it took and when it was done (ms from the start).
struct GpuDone {
    result: crate::Result<Option<RestoreRecord>>,
    ms: f64,
    at: f64,
}

impl GpuStep<'_> {
    /// Runs the GPU step through `step` (the target's [`RestoreTarget::restore_gpu`], or what the
    /// target runs in its place) on the tree restored at `root_pid`; once only, later calls do nothing.
    pub fn run(
        &mut self,
        root_pid: i32,
        step: impl FnOnce(GpuRestore<'_>) -> crate::Result<Option<RestoreRecord>>,
    ) {
        if self.done.is_some() {
            return;
        }
        fault::at("restore.after-criu");
        let t = Instant::now();
        let result = step(GpuRestore {
            gpu: &mut *self.gpu,
            record: self.record.take(),
            root_pid,
            before_unlock: self.before_unlock,
        });
        self.done = Some(GpuDone {
            result,
            ms: ms(t),
            at: ms(self.started),
        });
    }
}

/// What is restored: a process tree (CRIU), a container (its runtime), each as a job member too
/// (through the barrier given to [`Pipeline::restore`]).
pub trait RestoreTarget<'a> {
    /// Finds the checkpoint and its manifest; refuses one this target does not restore.
    fn find(&mut self, store: &Store) -> crate::Result<(CheckpointInfo, CheckpointManifest)>;

    /// Refuses, before the GPU step's own check, what would make the restore fail here.
    fn check(&mut self, _found: &Found<'_>, _gpu: Option<&GpuRecord>) -> crate::Result<()> {
        Ok(())
    }

    /// Readies the restore once the GPU step agreed: returns its private work folder, which the target
    /// keeps (and removes) until it is dropped, after the pipeline's guards.
    fn prepare(&mut self, found: &Found<'_>) -> crate::Result<std::path::PathBuf>;

    /// Tells the guardian what it would undo should this process die from here on.
    fn tell(&mut self, watch: &dyn Watch, work: &Path) -> crate::Result<()>;

    /// Fetches what must be in the work folder before the last check for a signal (a container's
    /// materialized images); returns how long it took, in milliseconds.
    fn fetch(&mut self, _ctx: &RestoreContext<'_>) -> crate::Result<f64> {
        Ok(0.0)
    }

    /// Restores the tree from the images; may run the GPU step itself once the tree exists
    /// ([`GpuStep::run`]), where it overlaps what the restore still does.
    fn restore(
        &mut self,
        ctx: &RestoreContext<'_>,
        gpu: &mut GpuStep<'_>,
    ) -> crate::Result<Restored<'a>>;

    /// Puts the GPU state back into the restored tree.
    fn restore_gpu(&mut self, step: GpuRestore<'_>) -> crate::Result<Option<RestoreRecord>>;

    /// The restore finished: what the target says of it (to the guardian).
    fn finished(&mut self, _watch: &dyn Watch) {}
}

/// The pipeline's timings of one restore, in milliseconds.
#[derive(Debug, Clone, Default)]
pub struct RestoreTimings {
    /// Reading and verifying the images out of the store into the work folder before the restore.
    pub fetch: f64,
    /// The restore proper (CRIU's, the runtime's); when streamed, with the images read meanwhile.
    pub restore: f64,
    /// The GPU step (restore + unlock, and a job restore's wait between them); 0 without GPU state.
    pub gpu: f64,
    /// From the start until the GPU step was done.
    pub gpu_done: f64,
    pub total: f64,
}

/// A finished restore.
#[derive(Debug, Clone)]
pub struct RestoredCheckpoint {
    /// The checkpoint's id.
    pub id: String,
    /// The restored root's PID.
    pub pid: i32,
    pub timings: RestoreTimings,
    /// The GPU step's restore (`None` without GPU state).
    pub gpu: Option<RestoreRecord>,
}

impl Pipeline<'_> {
    /// Restores a checkpoint into `target`; see the module documentation for the order.
    pub fn restore<'a>(
        &mut self,
        target: &mut dyn RestoreTarget<'a>,
        before_unlock: Option<&BeforeUnlock<'_>>,
    ) -> crate::Result<RestoredCheckpoint> {
        let started = Instant::now();
        // From the moment the tree starts being created, a signal is deferred until the copy is whole
        // (or discarded): a half-restored copy must not be left behind.
        let interrupt = InterruptGuard::new();
        let (info, manifest) = target.find(self.store)?;
        let gpu_record = manifest.gpu_record()?;
        let found = Found {
            store: self.store,
            info: &info,
            manifest: &manifest,
        };
        target.check(&found, gpu_record.as_ref())?;
        self.gpu.prepare_restore(gpu_record.as_ref())?;
        let work = target.prepare(&found)?;
        target.tell(self.watch, &work)?;
        let ctx = RestoreContext {
            store: self.store,
            progress: self.progress,
            info: &info,
            manifest: &manifest,
            work: &work,
            watch: self.watch,
            started,
        };
        let mut timings = RestoreTimings {
            fetch: target.fetch(&ctx)?,
            ..RestoreTimings::default()
        };
        fault::at("restore.before-criu");
        check_interrupt(&interrupt, "nothing was restored; the checkpoint is intact")?;

        let mut step = GpuStep {
            gpu: &mut *self.gpu,
            record: gpu_record,
            before_unlock,
            started,
            done: None,
        };
        let t = Instant::now();
        let restored = target.restore(&ctx, &mut step)?;
        timings.fetch += restored.fetch_ms;
        timings.restore = ms(t) - restored.fetch_ms;

        step.run(restored.root_pid, |s| target.restore_gpu(s));
        let done = step.done.take().expect("the GPU step ran");
        (timings.gpu, timings.gpu_done) = (done.ms, done.at);
        // A copy whose GPU state did not come back (or whose job restore aborted) must not run on:
        // `restored.discard`, dropped, discards it.
        let gpu = done.result?;
        restored.discard.keep();
        target.finished(self.watch);
        timings.total = ms(started);
        Ok(RestoredCheckpoint {
            id: info.id,
            pid: restored.root_pid,
            timings,
            gpu,
        })
    }
}
