//! The checkpoint's undo, as guards that act when they are dropped: whichever way the flow leaves before
//! the checkpoint is durable (an error returned with `?`, a panic), the tree is put back the way it was,
//! without an undo call at every exit.
//!
//! The pipeline creates them in the order it takes the steps they undo, so they drop in the reverse
//! order: the tree CRIU left stopped is continued ([`ContinueGuard`]) before its GPU state is put back
//! (the pipeline's [`crate::flows::pipeline::GpuThawGuard`]), because the GPU restore runs in the
//! processes themselves (the driver's restore thread, the simulator's own answer), which a stopped process
//! cannot do. The staging folder goes last, with the store's [`crate::store::Ingest`], which removes it
//! when dropped uncommitted.

use crate::proc as tree;

/// Continues (SIGCONT) the tree CRIU left stopped when dropped, unless [`ContinueGuard::disarm`]ed
/// because the checkpoint is durable. The tree is held through pidfds: a continue or a kill never reaches
/// a process that took one of its PIDs since.
pub(super) struct ContinueGuard {
    /// The whole tree: what the caller kills once the checkpoint is durable.
    tree: tree::Held,
    /// What an undo continues: the tree less the processes that were stopped before the checkpoint
    /// (`--allow-stopped`), which stay stopped.
    resume: tree::Held,
    /// CRIU left the tree stopped (no `--leave-running`) and nothing has taken it over yet.
    armed: bool,
    /// With `--tcp-established`: the connections CRIU left in repair mode and locked, released before
    /// the tree is continued (a continued tree's connections would be dead otherwise).
    network: Option<crate::dump::NetworkHold>,
}

impl ContinueGuard {
    /// Guards `pids`, the tree as CRIU dumped it; `stopped`: CRIU left it stopped (with
    /// `--leave-running` it runs, and there is nothing to continue).
    pub(super) fn new(pids: &[i32], stopped_before: &[i32], stopped: bool) -> Self {
        let resume: Vec<i32> = pids
            .iter()
            .copied()
            .filter(|p| !stopped_before.contains(p))
            .collect();
        ContinueGuard {
            tree: tree::Held::open(pids),
            resume: tree::Held::open(&resume),
            armed: stopped,
            network: None,
        }
    }

    /// The undo also releases what CRIU's dump left of the network (see [`crate::dump::NetworkHold`]).
    pub(super) fn release_network(&mut self, hold: crate::dump::NetworkHold) {
        self.network = Some(hold);
    }

    /// Continues the tree now, as the undo would (the network released first; the processes stopped
    /// before the checkpoint stay stopped), and disarms the undo: a `--leave-running` tree that a
    /// streamed dump left stopped runs on once the store has read every image
    /// ([`crate::flows::ImageTransfer::after_dump`]). Nothing to do when CRIU let it go itself.
    pub(super) fn continue_now(&mut self) {
        self.resume_if_armed();
        self.armed = false;
    }

    /// CRIU left the tree stopped and nothing has taken it over yet.
    pub(super) fn armed(&self) -> bool {
        self.armed
    }

    fn resume_if_armed(&self) {
        if self.armed {
            if let Some(hold) = &self.network {
                let n = hold.release();
                tracing::debug!("{n} TCP sockets taken out of repair mode");
            }
            self.resume.continue_all();
        }
    }

    /// The checkpoint is durable: the tree is the caller's again (to kill, or to leave running).
    pub(super) fn disarm(mut self) -> tree::Held {
        self.armed = false;
        std::mem::replace(&mut self.tree, tree::Held::open(&[]))
    }
}

impl Drop for ContinueGuard {
    fn drop(&mut self) {
        self.resume_if_armed();
    }
}
