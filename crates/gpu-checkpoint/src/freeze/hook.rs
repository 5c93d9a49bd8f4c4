//! The freeze stage's boundary with the flows: the GPU step as a hook the flows call at fixed points.
//!
//! The flows own the order of operations and the undo on failure; a [`GpuHook`] only knows how to move
//! GPU state out of and back into processes. [`NoGpu`] is the hook for trees without GPU state (strategy
//! `none`); [`super::FreezeHook`] is the real one (CUDA driver API, `cuda-checkpoint`, the simulator).
//! The trait lives in the freeze stage, which owns it, so that the stage depends on no flow.
//!
//! Checkpoint, in the order the flow runs it (the hook's calls in bold):
//!
//! 1. detect accepts the tree (strategy not `unsupported`); the store is writable; the PID is locked.
//! 2. **[`GpuHook::freeze`]**: lock every GPU process of the tree, then checkpoint its GPU state into host
//!    memory. The tree is running. On error the hook has already put back whatever it did (restore +
//!    unlock the processes it handled), so that every process runs as before; the flow stops there.
//! 3. CRIU dumps the tree into the store's staging folder, leaving it running (`--leave-running`) or
//!    stopped (SIGSTOP, default) once the images are written.
//! 4. With `--leave-running`, right after a successful dump: **[`GpuHook::thaw`]** (GPU restore +
//!    unlock), so that GPU work resumes while the images are being stored.
//! 5. The store commits the checkpoint (durable, manifest last).
//! 6. Default (migration): the tree is killed. Its GPU state lives in the checkpoint; nothing to thaw.
//!
//! On a failure after step 2 and before the checkpoint is durable (CRIU dump failed, store write failed):
//! the flow continues the tree if CRIU left it stopped, then calls **[`GpuHook::thaw`]** (unless step 4
//! already did), and discards the partial checkpoint. The tree runs as before the checkpoint started.
//!
//! Restore:
//!
//! 1. **[`GpuHook::prepare_restore`]** with the `gpu` record [`GpuHook::freeze`] returned at checkpoint
//!    time, as the flow read it back from the manifest ([`GpuRecord::from_manifest`], which refuses a
//!    record from a newer gpu-checkpoint): check this node can take the GPU state (same GPU count and
//!    models, or a device map). Nothing has been started yet: an error here leaves nothing to undo.
//! 2. The images are fetched and verified; CRIU restores the tree. Its GPU processes come back running
//!    but still locked, their GPU state in host memory.
//! 3. **[`GpuHook::finish_restore`]**: GPU restore of each restored GPU process, the barrier a job restore
//!    waits at ([`BeforeUnlock`]), then the unlock of each. On error the
//!    flow kills the restored tree (a half-restored copy must not run) and keeps the checkpoint intact for
//!    another try.

use serde::{Deserialize, Serialize};

use super::group::ProcessRecord;
use super::step::{GpuRecord, ThawRecord};
use super::types::GpuPair;
use super::Error;
use crate::detect::{Report, StrategyName};

/// What [`GpuHook::finish_restore`] did, for the report (`restore --format json` prints it as `gpu`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RestoreRecord {
    /// The backend that restored the GPU state.
    pub backend: String,
    /// The GPUs restored onto, by UUID (empty: the same GPUs, by index).
    pub pairs: Vec<GpuPair>,
    /// Each process's GPU restore + unlock.
    pub processes: Vec<ProcessRecord>,
}

/// A barrier [`GpuHook::freeze`] calls once every GPU process of the tree is locked (GPU work drained) and
/// before any is checkpointed: a job checkpoint waits there until every member of the job is locked, so
/// that its cut is consistent. `Err(reason)`: abort; the hook unlocks what it locked and fails with
/// [`super::Error::Aborted`]. Called exactly once by a `freeze` that gets that far, also when the tree has
/// no GPU process to lock.
pub type AfterLock<'a> = dyn Fn() -> Result<(), String> + Sync + 'a;

/// What [`GpuHook::freeze`] is given.
#[derive(Clone, Copy)]
pub struct FreezeContext<'a> {
    /// The root of the tree being checkpointed.
    pub root_pid: i32,
    /// Every process of the tree at the time of detection.
    pub pids: &'a [i32],
    /// The detect report of the tree, with its strategy (never `unsupported` here).
    pub report: &'a Report,
    /// The tree keeps running after the checkpoint (`--leave-running`).
    pub leave_running: bool,
    /// Where to wait once the tree's GPU processes are locked ([`AfterLock`]); `None`: go straight on.
    pub after_lock: Option<&'a AfterLock<'a>>,
}

impl std::fmt::Debug for FreezeContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FreezeContext")
            .field("root_pid", &self.root_pid)
            .field("pids", &self.pids)
            .field("leave_running", &self.leave_running)
            .field("after_lock", &self.after_lock.is_some())
            .finish_non_exhaustive()
    }
}

impl FreezeContext<'_> {
    /// Passes the [`AfterLock`] barrier, if any.
    pub fn locked(&self) -> Result<(), Error> {
        match self.after_lock {
            Some(barrier) => barrier().map_err(Error::Aborted),
            None => Ok(()),
        }
    }
}

/// A barrier [`GpuHook::finish_restore`] calls once the GPU state of every GPU process of the restored
/// tree (root PID given) is back and before any is unlocked: a job restore waits there until every
/// member of the job is restored, so that no member runs on its GPUs while another may still fail.
/// `Err(reason)`: abort; nothing is unlocked, the hook fails with [`super::Error::Aborted`] and the flow
/// kills the restored copy. Called exactly once by a `finish_restore` that gets that far, also when the
/// tree has no GPU state.
pub type BeforeUnlock<'a> = dyn Fn(i32) -> Result<(), String> + Sync + 'a;

/// What [`GpuHook::finish_restore`] is given.
#[derive(Clone, Copy)]
pub struct RestoredTree<'a> {
    /// The restored root's PID (CRIU restores every process under its original PID).
    pub root_pid: i32,
    /// Every process of the restored tree, as recorded in the checkpoint.
    pub pids: &'a [i32],
    /// Where to wait once the tree's GPU state is restored, still locked ([`BeforeUnlock`]); `None`:
    /// unlock straight away.
    pub before_unlock: Option<&'a BeforeUnlock<'a>>,
}

impl std::fmt::Debug for RestoredTree<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RestoredTree")
            .field("root_pid", &self.root_pid)
            .field("pids", &self.pids)
            .field("before_unlock", &self.before_unlock.is_some())
            .finish()
    }
}

impl RestoredTree<'_> {
    /// Passes the [`BeforeUnlock`] barrier, if any.
    pub fn restored(&self) -> Result<(), Error> {
        match self.before_unlock {
            Some(barrier) => barrier(self.root_pid).map_err(Error::Aborted),
            None => Ok(()),
        }
    }
}

/// The GPU step of the flows; see the module documentation for when each method runs and what it must
/// undo. Every method may block (GPU calls with timeouts). Errors are the freeze stage's, and their exit
/// status is the command's.
pub trait GpuHook {
    /// The name recorded in the manifest (`none`, `cuda-driver`, `cuda-cli`, `sim`...).
    fn name(&self) -> &str;

    /// The backend another process (the guardian) opens to put GPU state back, should this one die
    /// between [`GpuHook::freeze`] and the end of the checkpoint; `None` where none could (no GPU step,
    /// an in-process fake driver).
    fn backend(&self) -> Option<super::GpuBackend> {
        None
    }

    /// Before the CRIU dump: lock + checkpoint the GPU state of every GPU process of the tree. Returns
    /// the record kept in the manifest under `gpu` (driver version, GPUs, per-process states and timings),
    /// `None` for a tree without GPU state (`null` in the manifest); [`GpuHook::prepare_restore`] and
    /// [`GpuHook::finish_restore`] get it back. On error nothing must be left locked or checkpointed.
    fn freeze(&mut self, ctx: &FreezeContext<'_>) -> Result<Option<GpuRecord>, Error>;

    /// After a dump with `--leave-running`, or after any failure following a successful
    /// [`GpuHook::freeze`]: GPU restore + unlock of the processes `freeze` handled, in the original tree,
    /// which is running. Called at most once per successful `freeze`. Returns timings for the report,
    /// `None` when nothing was frozen.
    fn thaw(&mut self) -> Result<Option<ThawRecord>, Error>;

    /// The checkpoint is durable and the tree is about to be stopped (migration): the processes
    /// [`GpuHook::freeze`] handled stay checkpointed, and nothing must thaw them later.
    fn committed(&mut self) {}

    /// Before restoring: check this node can take the checkpoint's GPU state (`record` is what
    /// [`GpuHook::freeze`] returned, `None` for a checkpoint without GPU state).
    fn prepare_restore(&mut self, record: Option<&GpuRecord>) -> Result<(), Error>;

    /// After CRIU restored the tree: GPU restore of its GPU processes, the [`RestoredTree::restored`]
    /// barrier, then their unlock. On error (the barrier's included) the flow kills the restored tree. Returns timings for the report, `None` when there was no GPU state to restore.
    fn finish_restore(
        &mut self,
        record: Option<&GpuRecord>,
        restored: &RestoredTree<'_>,
    ) -> Result<Option<RestoreRecord>, Error>;
}

/// The hook for trees without GPU state: refuses trees that have some (they need a GPU backend), and
/// does nothing otherwise.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoGpu;

impl GpuHook for NoGpu {
    fn name(&self) -> &str {
        "none"
    }

    fn freeze(&mut self, ctx: &FreezeContext<'_>) -> Result<Option<GpuRecord>, Error> {
        match ctx.report.strategy.name {
            StrategyName::None => ctx.locked().map(|()| None),
            strategy => Err(Error::NoGpuStep { strategy }),
        }
    }

    fn thaw(&mut self) -> Result<Option<ThawRecord>, Error> {
        Ok(None)
    }

    fn prepare_restore(&mut self, record: Option<&GpuRecord>) -> Result<(), Error> {
        match record {
            None => Ok(()),
            Some(_) => Err(Error::NoGpuStepForRestore),
        }
    }

    fn finish_restore(
        &mut self,
        _record: Option<&GpuRecord>,
        restored: &RestoredTree<'_>,
    ) -> Result<Option<RestoreRecord>, Error> {
        restored.restored().map(|()| None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_restore_record_prints_as_it_always_did() {
        // `restore --format json` printed `json!({"backend", "pairs", "processes"})`, or null.
        let r = RestoreRecord {
            backend: "sim".into(),
            pairs: vec![],
            processes: vec![ProcessRecord::new(7)],
        };
        assert_eq!(
            serde_json::to_value(&r).unwrap(),
            json!({"backend": "sim", "pairs": [], "processes": [{"pid": 7, "steps": []}]})
        );
        assert!(serde_json::to_value(None::<RestoreRecord>)
            .unwrap()
            .is_null());
    }
}
