//! Points where a checkpoint driven from outside (a member of a job checkpoint, `flows::cluster`) waits for
//! the others. The checkpoint flow calls them at fixed points and undoes with its own guards when one says
//! no, so that a job's abort reuses exactly the undo of a failed single checkpoint.

/// The barriers of a job checkpoint's two-phase protocol, as one member's checkpoint flow sees them.
/// `Err(reason)` aborts: the flow undoes what it did and fails with `checkpoint::Error::Aborted`.
pub trait Phases: Sync {
    /// Every GPU process of the tree is locked (GPU work drained) and none is checkpointed yet; the CPU
    /// side has not been touched. Returns once every member of the job is locked (go on), or the job
    /// aborted.
    fn locked(&self) -> Result<(), String>;

    /// The member's checkpoint `id` is durable in the store; the tree is still held (stopped, or running
    /// with `--leave-running`) and its GPU state still checkpointed. Returns once the job's checkpoint is
    /// committed (the flow then stops the tree as usual), or the job aborted (the flow deletes `id`,
    /// continues the tree and puts its GPU state back), or its outcome cannot be learnt (the flow
    /// continues the tree and puts its GPU state back, but keeps `id`).
    fn durable(&self, id: &str) -> Result<(), NotCommitted>;
}

/// Why a member's durable checkpoint is not followed by a commit, as the member sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotCommitted {
    /// The job aborted: nothing of it is kept.
    Aborted(String),
    /// The member cannot learn the outcome (its coordination service is unreachable): the job may
    /// have committed without it hearing so, and a committed job checkpoint names this member's
    /// checkpoint, so it is kept; the tree runs on, as after any checkpoint that did not complete.
    InDoubt(String),
}

/// A checkpoint of its own: never waits, never aborts.
#[derive(Debug, Default, Clone, Copy)]
pub struct Alone;

impl Phases for Alone {
    fn locked(&self) -> Result<(), String> {
        Ok(())
    }

    fn durable(&self, _id: &str) -> Result<(), NotCommitted> {
        Ok(())
    }
}
