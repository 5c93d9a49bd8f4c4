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

use crate::proc::{Hold, Processes};

/// Continues (SIGCONT) the tree CRIU left stopped when dropped, unless [`ContinueGuard::disarm`]ed
/// because the checkpoint is durable. The tree is held ([`Processes::hold`], pidfds): a continue or a kill
/// never reaches a process that took one of its PIDs since.
pub(super) struct ContinueGuard {
    /// The whole tree: what the caller kills once the checkpoint is durable.
    tree: Box<dyn Hold>,
    /// What an undo continues: the tree less the processes that were stopped before the checkpoint
    /// (`--allow-stopped`), which stay stopped.
    resume: Box<dyn Hold>,
    /// CRIU left the tree stopped (no `--leave-running`) and nothing has taken it over yet.
    armed: bool,
    /// With `--tcp-established`: the connections CRIU left in repair mode and locked, released before
    /// the tree is continued (a continued tree's connections would be dead otherwise).
    network: Option<crate::dump::NetworkHold>,
}

impl ContinueGuard {
    /// Guards `pids`, the tree as CRIU dumped it; `stopped`: CRIU left it stopped (with
    /// `--leave-running` it runs, and there is nothing to continue).
    pub(super) fn new(
        procs: &dyn Processes,
        pids: &[i32],
        stopped_before: &[i32],
        stopped: bool,
    ) -> Self {
        let resume: Vec<i32> = pids
            .iter()
            .copied()
            .filter(|p| !stopped_before.contains(p))
            .collect();
        ContinueGuard {
            tree: procs.hold(pids),
            resume: procs.hold(&resume),
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
    pub(super) fn disarm(mut self) -> Box<dyn Hold> {
        self.armed = false;
        std::mem::replace(&mut self.tree, Box::new(crate::proc::Held::open(&[])))
    }
}

impl Drop for ContinueGuard {
    fn drop(&mut self) {
        self.resume_if_armed();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::FakeProcesses;

    /// A tree of pretend processes CRIU left stopped: the root, a child stopped before the checkpoint
    /// (`--allow-stopped`) and another child.
    fn stopped_tree() -> FakeProcesses {
        let procs = FakeProcesses::default();
        procs.add(100, 1, 'T').add(101, 100, 'T').add(102, 100, 'T');
        procs
    }

    #[test]
    fn an_undo_continues_what_ran_before_and_leaves_what_was_stopped_before() {
        let procs = stopped_tree();
        drop(ContinueGuard::new(&procs, &[100, 101, 102], &[101], true));
        assert_eq!(
            procs.signals(),
            [(100, libc::SIGCONT), (102, libc::SIGCONT)]
        );
        assert_eq!(procs.state(101), Some('T'), "stopped before: stays stopped");
        assert_eq!(procs.state(102), Some('S'));
    }

    #[test]
    fn a_tree_the_dumper_let_go_or_that_was_continued_is_not_continued_again() {
        let procs = stopped_tree();
        drop(ContinueGuard::new(&procs, &[100, 102], &[], false));
        assert!(procs.signals().is_empty(), "never stopped by the dump");
        let mut guard = ContinueGuard::new(&procs, &[100, 102], &[], true);
        guard.continue_now();
        assert!(!guard.armed());
        drop(guard);
        assert_eq!(
            procs.signals(),
            [(100, libc::SIGCONT), (102, libc::SIGCONT)],
            "once, by continue_now"
        );
    }

    #[test]
    fn a_durable_checkpoint_kills_the_whole_tree_and_names_what_survives() {
        let procs = stopped_tree();
        procs.survives_kill(102);
        let tree = ContinueGuard::new(&procs, &[100, 101, 102], &[101], true).disarm();
        assert_eq!(tree.kill(std::time::Duration::ZERO), [102]);
        assert!(
            !procs.signals().contains(&(100, libc::SIGCONT)),
            "disarmed: no continue"
        );
        assert_eq!(procs.state(100), Some('Z'));
        assert_eq!(
            procs.state(101),
            Some('Z'),
            "stopped before, killed all the same"
        );
    }
}
