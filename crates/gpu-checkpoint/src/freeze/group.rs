//! Many CUDA processes at once: lock all in parallel, checkpoint all in parallel, and undo on failure so
//! that every process keeps running.
//!
//! The guarantees (each has a test below and a flow test with the simulator):
//! * a lock fails or times out on any process -> the ones already locked are unlocked;
//! * a checkpoint fails on any process -> the others are restored and unlocked, the failed one unlocked;
//! * the CPU dump (or storage) fails afterwards -> [`Frozen`] is thawed: restore + unlock on all. Dropping
//!   a [`Frozen`] without calling [`Frozen::finish`] thaws too, so an early return cannot strand a process;
//! * after a CRIU restore, [`restore_all`] restores every process before unlocking any, so a tree either
//!   resumes whole or not at all (the caller then stops the half-restored copy).

use super::lifecycle::{Checkpointed, Failed, GpuProcess, Locked, Running};
use super::types::{GpuPair, Op, ProcessState};
use super::{Error, GpuDriver, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Default `--lock-timeout`.
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct GroupOptions {
    /// How long a lock may wait for submitted GPU work (`None`: no limit).
    pub lock_timeout: Option<Duration>,
    /// One process after another, in the tree's order, instead of all at once: processes that share CUDA
    /// IPC memory (driver 610 and later) must be locked in sequence, and restored and unlocked in the same
    /// order.
    pub ordered: bool,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            lock_timeout: Some(DEFAULT_LOCK_TIMEOUT),
            ordered: false,
        }
    }
}

/// One driver call on one process, for the manifest and the report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub op: Op,
    /// True when the call was part of undoing a failed checkpoint.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub undo: bool,
    pub ok: bool,
    pub ms: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The GPU transitions of one process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub pid: i32,
    pub steps: Vec<StepRecord>,
}

impl ProcessRecord {
    pub fn new(pid: i32) -> Self {
        ProcessRecord {
            pid,
            steps: Vec::new(),
        }
    }

    /// Total milliseconds spent in `op` (not counting undo).
    pub fn ms(&self, op: Op) -> f64 {
        self.steps
            .iter()
            .filter(|s| s.op == op && !s.undo)
            .map(|s| s.ms)
            .sum()
    }
}

/// A process of the tree left alone because it has no CUDA state (it loaded libcuda or NVML but made
/// no context, or it is not a simulated GPU process with the simulator).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Skipped {
    pub pid: i32,
    pub reason: String,
}

/// Which processes of a tree the GPU step acts on.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Plan {
    pub cuda: Vec<i32>,
    pub skipped: Vec<Skipped>,
}

/// Runs `f` on every item in its own thread and returns the results in order.
fn parallel<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    each(items, false, f)
}

/// [`parallel`], or one after another in `items`' order when `ordered`.
fn each<T: Send, R: Send>(items: Vec<T>, ordered: bool, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    if ordered || items.len() <= 1 {
        return items.into_iter().map(f).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .into_iter()
            .map(|it| {
                let f = &f;
                s.spawn(move || f(it))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Times one call and records it.
fn timed<T, E>(
    rec: &mut ProcessRecord,
    op: Op,
    undo: bool,
    f: impl FnOnce() -> std::result::Result<T, E>,
    err_of: impl Fn(&E) -> String,
) -> std::result::Result<T, E> {
    let t = Instant::now();
    let r = f();
    rec.steps.push(StepRecord {
        op,
        undo,
        ok: r.is_ok(),
        ms: t.elapsed().as_secs_f64() * 1000.0,
        error: r.as_ref().err().map(&err_of),
    });
    r
}

fn failed_msg<H>(f: &Failed<H>) -> String {
    f.error.to_string()
}

/// Queries every pid (in parallel) and sorts them into CUDA processes to freeze and processes to leave
/// alone. A process already locked or checkpointed by someone else is refused: freezing it again would
/// hide whose lock it is.
pub fn plan(driver: &dyn GpuDriver, pids: &[i32]) -> Result<Plan> {
    let answers = parallel(pids.to_vec(), |pid| (pid, driver.state(pid)));
    let mut plan = Plan::default();
    let mut errors = Vec::new();
    for (pid, answer) in answers {
        match answer {
            Ok(ProcessState::Running) => plan.cuda.push(pid),
            Ok(state) => errors.push(Error::Cuda {
                op: Op::State,
                pid,
                code: super::CuError::IllegalState,
                detail: Some(format!(
                    "its GPU state is already {state}; `gpu-checkpoint cuda unlock`/`restore` it first"
                )),
            }),
            Err(e) if e.is_no_cuda() => plan.skipped.push(Skipped {
                pid,
                reason: e.to_string(),
            }),
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(plan)
    } else {
        Err(Error::Many(errors))
    }
}

/// Every process of a group locked and checkpointed: CRIU may dump them now.
///
/// Call [`Frozen::thaw`] to resume them (`--leave-running`, or the dump failed) or [`Frozen::finish`]
/// once their checkpoint is durable and they are to be stopped. Dropping it thaws.
pub struct Frozen {
    procs: Vec<Checkpointed>,
    records: Vec<ProcessRecord>,
}

impl std::fmt::Debug for Frozen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frozen")
            .field("pids", &self.pids())
            .finish()
    }
}

/// Locks every process in parallel, then checkpoints every process in parallel. On any failure the
/// others are brought back to RUNNING and the error lists each failure (and any failed undo).
pub fn freeze_all(
    driver: &Arc<dyn GpuDriver>,
    pids: &[i32],
    opts: &GroupOptions,
) -> Result<Frozen> {
    freeze_all_with(driver, pids, opts, None)
}

/// [`freeze_all`], calling `after_lock` once every process is locked and before any is checkpointed (a
/// job checkpoint's barrier: [`super::AfterLock`]); when it says no, every process is unlocked and the
/// error is [`Error::Aborted`].
pub fn freeze_all_with(
    driver: &Arc<dyn GpuDriver>,
    pids: &[i32],
    opts: &GroupOptions,
    after_lock: Option<&super::AfterLock<'_>>,
) -> Result<Frozen> {
    let timeout = opts.lock_timeout;
    let locks = each(pids.to_vec(), opts.ordered, |pid| {
        let mut rec = ProcessRecord::new(pid);
        let r = timed(
            &mut rec,
            Op::Lock,
            false,
            || Running::assume(Arc::clone(driver), pid).lock(timeout),
            failed_msg,
        );
        (rec, r.map_err(|f| f.error))
    });
    let (mut records, locked, mut errors) = sorted(locks);
    if !errors.is_empty() {
        errors.extend(undo_locked(locked, &mut records));
        return Err(Error::Many(errors));
    }
    if let Some(Err(reason)) = after_lock.map(|barrier| barrier()) {
        let undo = undo_locked(locked, &mut records);
        if undo.is_empty() {
            return Err(Error::Aborted(reason));
        }
        let mut errors = vec![Error::Aborted(reason)];
        errors.extend(undo);
        return Err(Error::Many(errors));
    }

    let cps = each(locked, opts.ordered, |l: Locked| {
        let mut rec = ProcessRecord::new(l.pid());
        let r = timed(
            &mut rec,
            Op::Checkpoint,
            false,
            || l.checkpoint(),
            failed_msg,
        );
        (rec, r)
    });
    let mut checkpointed = Vec::new();
    let mut still_locked = Vec::new();
    for (rec, r) in cps {
        merge(&mut records, rec);
        match r {
            Ok(c) => checkpointed.push(c),
            Err(f) => {
                errors.push(f.error);
                still_locked.push(f.handle);
            }
        }
    }
    if !errors.is_empty() {
        errors.extend(undo_locked(still_locked, &mut records));
        errors.extend(undo_checkpointed(checkpointed, &[], &mut records, true));
        return Err(Error::Many(errors));
    }
    Ok(Frozen {
        procs: checkpointed,
        records,
    })
}

fn merge(records: &mut Vec<ProcessRecord>, rec: ProcessRecord) {
    match records.iter_mut().find(|r| r.pid == rec.pid) {
        Some(r) => r.steps.extend(rec.steps),
        None => records.push(rec),
    }
}

/// Unlocks (in parallel); returns the errors of unlocks that failed.
fn undo_locked(locked: Vec<Locked>, records: &mut Vec<ProcessRecord>) -> Vec<Error> {
    let results = parallel(locked, |l| {
        let mut rec = ProcessRecord::new(l.pid());
        let r = timed(&mut rec, Op::Unlock, true, || l.unlock(), failed_msg);
        (rec, r.err().map(|f| f.error))
    });
    let mut errors = Vec::new();
    for (rec, e) in results {
        merge(records, rec);
        errors.extend(e);
    }
    errors
}

/// Restores then unlocks (in parallel per process); returns the errors.
fn undo_checkpointed(
    procs: Vec<Checkpointed>,
    pairs: &[GpuPair],
    records: &mut Vec<ProcessRecord>,
    undo: bool,
) -> Vec<Error> {
    let results = parallel(procs, |c| {
        let mut rec = ProcessRecord::new(c.pid());
        let r = timed(&mut rec, Op::Restore, undo, || c.restore(pairs), failed_msg)
            .map_err(|f| f.error)
            .and_then(|l| {
                timed(&mut rec, Op::Unlock, undo, || l.unlock(), failed_msg)
                    .map(drop)
                    .map_err(|f| f.error)
            });
        (rec, r.err())
    });
    let mut errors = Vec::new();
    for (rec, e) in results {
        merge(records, rec);
        errors.extend(e);
    }
    errors
}

impl Frozen {
    pub fn pids(&self) -> Vec<i32> {
        self.procs.iter().map(|p| p.pid()).collect()
    }

    pub fn records(&self) -> &[ProcessRecord] {
        &self.records
    }

    /// Restores and unlocks every process (after a `--leave-running` dump, or when the dump failed).
    /// Returns the records of these restore and unlock calls.
    pub fn thaw(mut self) -> std::result::Result<Vec<ProcessRecord>, (Error, Vec<ProcessRecord>)> {
        let procs = std::mem::take(&mut self.procs);
        let mut records = Vec::new();
        let errors = undo_checkpointed(procs, &[], &mut records, false);
        if errors.is_empty() {
            Ok(records)
        } else {
            Err((Error::Many(errors), records))
        }
    }

    /// The checkpoint is durable and the processes are about to be stopped: keep them CHECKPOINTED.
    pub fn finish(mut self) -> Vec<ProcessRecord> {
        self.procs.clear();
        std::mem::take(&mut self.records)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if self.procs.is_empty() {
            return;
        }
        // Nobody decided what to do with these processes (an early return or a panic in the flow):
        // bring them back rather than leave them without their GPU state.
        let procs = std::mem::take(&mut self.procs);
        let mut records = Vec::new();
        for e in undo_checkpointed(procs, &[], &mut records, true) {
            tracing::error!("could not resume a process after an interrupted checkpoint: {e}");
        }
    }
}

/// After a CRIU restore: every process is CHECKPOINTED. Restores all (in parallel, onto `pairs`, or in
/// `pids`' order when `ordered`), and only when every restore worked, unlocks all (in the same order).
/// On failure nothing is unlocked: the caller stops the restored copy and keeps the checkpoint.
pub fn restore_all(
    driver: &Arc<dyn GpuDriver>,
    pids: &[i32],
    pairs: &[GpuPair],
    ordered: bool,
) -> std::result::Result<Vec<ProcessRecord>, (Error, Vec<ProcessRecord>)> {
    restore_all_with(driver, pids, pairs, ordered, &|| Ok(()))
}

/// [`restore_all`], calling `before_unlock` once every process's GPU state is restored and before any
/// is unlocked (a job restore's barrier); if it says no, nothing is unlocked and the error is
/// [`Error::Aborted`].
pub fn restore_all_with(
    driver: &Arc<dyn GpuDriver>,
    pids: &[i32],
    pairs: &[GpuPair],
    ordered: bool,
    before_unlock: &(dyn Fn() -> std::result::Result<(), Error> + Sync),
) -> std::result::Result<Vec<ProcessRecord>, (Error, Vec<ProcessRecord>)> {
    let results = each(pids.to_vec(), ordered, |pid| {
        let mut rec = ProcessRecord::new(pid);
        let r = match GpuProcess::observe(driver, pid) {
            Ok(GpuProcess::Checkpointed(c)) => timed(
                &mut rec,
                Op::Restore,
                false,
                || c.restore(pairs),
                failed_msg,
            )
            .map_err(|f| f.error),
            Ok(other) => Err(Error::Cuda {
                op: Op::Restore,
                pid,
                code: super::CuError::IllegalState,
                detail: Some(format!(
                    "restored process is {}, expected checkpointed",
                    other.state()
                )),
            }),
            Err(e) => Err(e),
        };
        (rec, r)
    });
    let (mut records, locked, mut errors) = sorted(results);
    if !errors.is_empty() {
        return Err((Error::Many(errors), records));
    }
    if let Err(e) = before_unlock() {
        return Err((e, records));
    }
    let unlocks = each(locked, ordered, |l| {
        let mut rec = ProcessRecord::new(l.pid());
        let r = timed(&mut rec, Op::Unlock, false, || l.unlock(), failed_msg);
        (rec, r.err().map(|f| f.error))
    });
    for (rec, e) in unlocks {
        merge(&mut records, rec);
        errors.extend(e);
    }
    if errors.is_empty() {
        Ok(records)
    } else {
        Err((Error::Many(errors), records))
    }
}

/// What a step run on every process gave: the processes' records, those it succeeded on, the errors.
fn sorted<T>(results: Vec<(ProcessRecord, Result<T>)>) -> (Vec<ProcessRecord>, Vec<T>, Vec<Error>) {
    let (mut records, mut done, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    for (rec, r) in results {
        records.push(rec);
        match r {
            Ok(v) => done.push(v),
            Err(e) => errors.push(e),
        }
    }
    (records, done, errors)
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeDriver;
    use super::super::CuError;
    use super::*;

    fn driver(pids: &[i32]) -> (Arc<FakeDriver>, Arc<dyn GpuDriver>) {
        let d = Arc::new(FakeDriver::new());
        for &p in pids {
            d.add(p);
        }
        let dd: Arc<dyn GpuDriver> = d.clone();
        (d, dd)
    }

    /// A freeze of `pids` whose driver fails each of `faults` (pid, operation, error) once.
    fn failed_freeze(pids: &[i32], faults: &[(i32, Op, CuError)]) -> (Arc<FakeDriver>, Error) {
        let (d, dd) = driver(pids);
        for &(pid, op, e) in faults {
            d.fail_next(pid, op, e);
        }
        let e = freeze_all(&dd, pids, &GroupOptions::default()).unwrap_err();
        (d, e)
    }

    fn states(d: &FakeDriver, pids: &[i32]) -> Vec<ProcessState> {
        pids.iter().map(|&p| d.state(p).unwrap()).collect()
    }

    #[test]
    fn freeze_then_thaw_returns_all_to_running() {
        let pids = [1, 2, 3];
        let (d, dd) = driver(&pids);
        let f = freeze_all(&dd, &pids, &GroupOptions::default()).unwrap();
        assert_eq!(states(&d, &pids), vec![ProcessState::Checkpointed; 3]);
        for r in f.records() {
            let ops: Vec<Op> = r.steps.iter().map(|s| s.op).collect();
            assert_eq!(ops, [Op::Lock, Op::Checkpoint]);
        }
        let recs = f.thaw().unwrap();
        assert_eq!(states(&d, &pids), vec![ProcessState::Running; 3]);
        assert_eq!(recs.len(), 3);
        for r in &recs {
            let ops: Vec<Op> = r.steps.iter().map(|s| s.op).collect();
            assert_eq!(ops, [Op::Restore, Op::Unlock]);
        }
    }

    #[test]
    fn locks_run_in_parallel() {
        let pids = [1, 2, 3, 4];
        let (d, dd) = driver(&pids);
        d.set_delay(Duration::from_millis(200));
        let t = Instant::now();
        let f = freeze_all(&dd, &pids, &GroupOptions::default()).unwrap();
        // Serial would be 4 x (lock + checkpoint) x 200 ms = 1.6 s.
        assert!(
            t.elapsed() < Duration::from_millis(1000),
            "{:?}",
            t.elapsed()
        );
        drop(f.finish());
    }

    #[test]
    fn a_lock_timeout_unlocks_the_locked_ones() {
        let pids = [1, 2, 3];
        let (d, e) = failed_freeze(&pids, &[(2, Op::Lock, CuError::NotReady)]);
        assert!(e.to_string().contains("CUDA_ERROR_NOT_READY"), "{e}");
        assert_eq!(states(&d, &pids), vec![ProcessState::Running; 3]);
        assert!(!d.calls().contains(&(1, Op::Checkpoint)));
    }

    /// A job checkpoint's barrier: it runs with every process locked and none checkpointed; a no there
    /// unlocks them all.
    #[test]
    fn an_abort_at_the_lock_barrier_unlocks_every_process_and_checkpoints_none() {
        let pids = [1, 2, 3];
        let (d, dd) = driver(&pids);
        let seen = std::sync::Mutex::new(Vec::new());
        let barrier = || {
            seen.lock().unwrap().push(states(&d, &pids));
            Err("member 2 failed".to_string())
        };
        let e = freeze_all_with(&dd, &pids, &GroupOptions::default(), Some(&barrier)).unwrap_err();
        assert!(
            matches!(&e, Error::Aborted(r) if r == "member 2 failed"),
            "{e}"
        );
        assert_eq!(*seen.lock().unwrap(), vec![vec![ProcessState::Locked; 3]]);
        assert_eq!(states(&d, &pids), vec![ProcessState::Running; 3]);
        assert!(!d.calls().iter().any(|(_, op)| *op == Op::Checkpoint));
        // A yes goes on to the checkpoint.
        let go = || Ok(());
        let f = freeze_all_with(&dd, &pids, &GroupOptions::default(), Some(&go)).unwrap();
        assert_eq!(states(&d, &pids), vec![ProcessState::Checkpointed; 3]);
        drop(f);
    }

    #[test]
    fn a_checkpoint_failure_restores_and_unlocks_the_others() {
        let pids = [1, 2, 3];
        let (d, e) = failed_freeze(&pids, &[(3, Op::Checkpoint, CuError::NotSupported)]);
        assert!(e.to_string().contains("pid 3"), "{e}");
        assert_eq!(states(&d, &pids), vec![ProcessState::Running; 3]);
        let calls = d.calls();
        assert!(calls.contains(&(1, Op::Restore)) && calls.contains(&(1, Op::Unlock)));
        assert!(
            !calls.contains(&(3, Op::Restore)),
            "3 was never checkpointed"
        );
        assert!(calls.contains(&(3, Op::Unlock)));
    }

    #[test]
    fn a_failed_undo_is_reported_too() {
        let faults = [
            (2, Op::Lock, CuError::NotReady),
            (1, Op::Unlock, CuError::OperatingSystem),
        ];
        let (_, e) = failed_freeze(&[1, 2], &faults);
        let s = e.to_string();
        assert!(
            s.contains("NOT_READY") && s.contains("OPERATING_SYSTEM"),
            "{s}"
        );
    }

    #[test]
    fn dropping_a_frozen_group_thaws_it() {
        let pids = [5, 6];
        let (d, dd) = driver(&pids);
        {
            let _f = freeze_all(&dd, &pids, &GroupOptions::default()).unwrap();
        }
        assert_eq!(states(&d, &pids), vec![ProcessState::Running; 2]);
    }

    #[test]
    fn finish_keeps_them_checkpointed() {
        let pids = [5];
        let (d, dd) = driver(&pids);
        let recs = freeze_all(&dd, &pids, &GroupOptions::default())
            .unwrap()
            .finish();
        assert_eq!(recs.len(), 1);
        assert_eq!(states(&d, &pids), vec![ProcessState::Checkpointed]);
    }

    #[test]
    fn ordered_groups_go_one_process_at_a_time_in_the_tree_order() {
        let pids = [31, 32, 33];
        let (d, dd) = driver(&pids);
        // A delay that lets parallel calls overlap: only an ordered group makes the order certain.
        d.set_delay(Duration::from_millis(20));
        let opts = GroupOptions {
            ordered: true,
            ..GroupOptions::default()
        };
        let frozen = freeze_all(&dd, &pids, &opts).unwrap();
        frozen.finish();
        let ops = |from: usize| -> Vec<(i32, Op)> {
            d.calls()[from..]
                .iter()
                .copied()
                .filter(|(_, op)| *op != Op::State)
                .collect()
        };
        let want = |a: Op, b: Op| -> Vec<(i32, Op)> {
            let mut v: Vec<(i32, Op)> = pids.iter().map(|&p| (p, a)).collect();
            v.extend(pids.iter().map(|&p| (p, b)));
            v
        };
        assert_eq!(ops(0), want(Op::Lock, Op::Checkpoint));
        let before = d.calls().len();
        restore_all(&dd, &pids, &[], true).unwrap();
        assert_eq!(ops(before), want(Op::Restore, Op::Unlock));
        assert_eq!(states(&d, &pids), vec![ProcessState::Running; 3]);
    }

    #[test]
    fn restore_all_unlocks_only_when_every_restore_worked() {
        let pids = [7, 8];
        let (d, dd) = driver(&pids);
        freeze_all(&dd, &pids, &GroupOptions::default())
            .unwrap()
            .finish();
        d.fail_next(8, Op::Restore, CuError::OutOfMemory);
        let (e, _) = restore_all(&dd, &pids, &[], false).unwrap_err();
        assert!(e.to_string().contains("OUT_OF_MEMORY"), "{e}");
        assert_eq!(
            states(&d, &pids),
            vec![ProcessState::Locked, ProcessState::Checkpointed]
        );
        assert!(!d.calls().contains(&(7, Op::Unlock)));

        // A second attempt (another restore of the same checkpoint) works.
        let (d2, dd2) = driver(&pids);
        freeze_all(&dd2, &pids, &GroupOptions::default())
            .unwrap()
            .finish();
        let recs = restore_all(&dd2, &pids, &[], false).unwrap();
        assert_eq!(states(&d2, &pids), vec![ProcessState::Running; 2]);
        assert!(recs.iter().all(|r| r.ms(Op::Restore) >= 0.0));
    }

    #[test]
    fn restore_all_with_a_barrier_that_says_no_restores_every_process_and_unlocks_none() {
        let pids = [7, 8];
        let (d, dd) = driver(&pids);
        freeze_all(&dd, &pids, &GroupOptions::default())
            .unwrap()
            .finish();
        let seen = std::sync::Mutex::new(Vec::new());
        let barrier = || {
            seen.lock().unwrap().push(states(&d, &pids));
            Err(Error::Aborted("member 3 failed".into()))
        };
        let (e, _) = restore_all_with(&dd, &pids, &[], false, &barrier).unwrap_err();
        assert!(
            matches!(&e, Error::Aborted(r) if r == "member 3 failed"),
            "{e}"
        );
        // At the barrier every GPU state was back, each process still locked; and so they stay.
        assert_eq!(*seen.lock().unwrap(), vec![vec![ProcessState::Locked; 2]]);
        assert_eq!(states(&d, &pids), vec![ProcessState::Locked; 2]);
        assert!(!d.calls().iter().any(|(_, op)| *op == Op::Unlock));
    }

    #[test]
    fn plan_skips_processes_without_cuda_and_refuses_locked_ones() {
        let (d, _) = driver(&[1, 2]);
        let p = plan(d.as_ref(), &[1, 2, 99]).unwrap();
        assert_eq!(p.cuda, vec![1, 2]);
        assert_eq!(p.skipped.len(), 1);
        assert_eq!(p.skipped[0].pid, 99);
        d.lock(2, None).unwrap();
        let e = plan(d.as_ref(), &[1, 2]).unwrap_err();
        assert!(e.to_string().contains("already locked"), "{e}");
    }
}
