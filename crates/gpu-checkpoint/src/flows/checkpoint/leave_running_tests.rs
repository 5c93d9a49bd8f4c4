//! `--leave-running`: a streamed dump leaves the tree stopped (CRIU's `--leave-stopped`) and the flow
//! continues it once the store has read every image, before its GPU state is put back and before the
//! commit (`ImageTransfer::after_dump`); a staged one lets CRIU resume it. Whatever fails afterwards, the
//! tree runs on (what was stopped before the checkpoint stays stopped: `tests.rs`,
//! `a_process_stopped_on_purpose_is_checkpointed_with_allow_stopped_and_stays_stopped_when_undone`).

use std::time::Duration;

use super::tests::{names, RecordingGpu, Scene, Sleeper};
use super::*;
use crate::dump::FakeCriuCall;
use crate::flows::ImageTransfer;
use crate::flows::NotCommitted;

fn leave_running(pid: i32) -> CheckpointOptions {
    let mut opts = CheckpointOptions::new(pid);
    opts.leave_running = true;
    opts
}

/// The one dump the fake CRIU was asked for: what it was to do with the tree, and whether it streamed.
fn dumped(s: &Scene) -> (AfterDump, bool) {
    match s.criu.calls().as_slice() {
        [FakeCriuCall::Dump { after, stream, .. }] => (*after, *stream),
        calls => panic!("{calls:?}"),
    }
}

/// Waits a little for `pid`'s state to settle (a SIGCONT takes effect asynchronously).
fn settled_running(p: &Sleeper) -> bool {
    tree::wait_until(Duration::from_secs(5), || {
        if p.running() {
            vec![]
        } else {
            vec![p.pid()]
        }
    })
    .is_empty()
}

#[test]
fn a_streamed_leave_running_dump_stops_the_tree_and_continues_it_before_the_gpu_thaw() {
    let (s, p, mut gpu) = Scene::with_tree();
    gpu.watch = Some(p.pid());
    let out = s.checkpoint(&mut gpu, &leave_running(p.pid())).unwrap();
    // Streamed, and CRIU (the fake SIGSTOPs like CRIU's leave_stopped) did not resume the tree itself:
    // its pages were still in the pipes when it would have.
    assert_eq!(dumped(&s), (AfterDump::Stop, true));
    assert!(
        out.timings.streamed && out.timings.continued,
        "{:?}",
        out.timings
    );
    assert!(out.timings.paused > 0.0 && out.timings.paused <= out.timings.total);
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    assert_eq!(gpu.events()[1].1, 1, "thaw comes after the dump");
    assert_eq!(
        gpu.stopped_at_thaw,
        Some(false),
        "continued before the GPU thaw: the GPU restore runs in the processes"
    );
    assert!(!out.stopped && settled_running(&p));
    assert_eq!(s.store.list().unwrap().len(), 1);
}

#[test]
fn a_staged_leave_running_dump_lets_criu_resume_the_tree() {
    let mut s = Scene::new();
    s.images = ImageTransfer::Staged;
    let p = Sleeper::start();
    let mut gpu = RecordingGpu::new(&s.criu);
    gpu.watch = Some(p.pid());
    let out = s.checkpoint(&mut gpu, &leave_running(p.pid())).unwrap();
    assert_eq!(dumped(&s), (AfterDump::KeepRunning, false));
    assert!(!out.timings.streamed && !out.timings.continued);
    assert!(out.timings.paused > 0.0);
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    assert_eq!(gpu.stopped_at_thaw, Some(false));
    assert!(!out.stopped && p.running());
    assert_eq!(s.store.list().unwrap().len(), 1);
}

#[test]
fn a_failed_commit_after_a_streamed_leave_running_dump_leaves_the_tree_running_and_thawed_once() {
    // The store refuses the odd file CRIU left among its files: the commit fails, after the continue.
    let (s, p, mut gpu) = Scene::with_tree_and_odd_file();
    let err = s.checkpoint(&mut gpu, &leave_running(p.pid())).unwrap_err();
    assert!(matches!(err, crate::Error::Store(_)), "{err}");
    assert_eq!(dumped(&s), (AfterDump::Stop, true));
    assert_eq!(
        names(&gpu.events()),
        ["freeze", "thaw"],
        "thawed once, before the commit; the undo has nothing left to put back"
    );
    assert_eq!(gpu.stopped_at_thaw, Some(false));
    assert!(settled_running(&p));
    s.assert_nothing_kept();
}

#[test]
fn a_job_member_left_running_runs_while_the_job_decides_and_an_abort_keeps_it_running() {
    let (s, p, mut gpu) = Scene::with_tree();
    let b = super::phase_tests::Barriers::new(
        p.pid(),
        Ok(()),
        Err(NotCommitted::Aborted("rank 2's dump failed".into())),
    );
    let err = s
        .checkpoint_phased(&mut gpu, &leave_running(p.pid()), &b)
        .unwrap_err();
    assert!(err.to_string().contains("rank 2's dump failed"), "{err}");
    let seen = b.seen();
    assert!(seen[1].ends_with("stopped=false"), "{seen:?}");
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    assert!(settled_running(&p));
    assert!(s.store.list().unwrap().is_empty());
}

/// A leave-running checkpoint into a store whose chunk writes all wait (up to 5 s) for the tree to run
/// again, then fail when `fail_after` (a store that fills up while the tree already runs). Returns the
/// checkpoint's result, whether the tree was running at every chunk write, the GPU's events and the store.
/// What [`slow_store_case`] saw: the checkpoint's result, whether the tree ran at each chunk write, the
/// GPU's events, the store.
type SlowStoreSeen = (
    crate::Result<CheckpointOutcome>,
    Vec<bool>,
    Vec<(String, usize)>,
    Store,
);

fn slow_store_case(fail_after: bool) -> SlowStoreSeen {
    let dir = tempfile::tempdir().unwrap();
    let backend = std::sync::Arc::new(crate::store::MemoryBackend::new(dir.path()));
    let store =
        Store::with_backend(backend.clone(), crate::store::StoreOptions::default()).unwrap();
    let criu = std::sync::Arc::new(crate::dump::FakeCriu::new());
    criu.image_bytes(6 << 20);
    let p = Sleeper::start();
    let pid = p.pid();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen_by_hook = seen.clone();
    *backend.chunk_write_hook.lock().unwrap() = Some(Box::new(move || {
        let running = tree::wait_until(Duration::from_secs(5), || match tree::stat(pid) {
            Some(s) if s.state == 'T' => vec![pid],
            _ => vec![],
        });
        seen_by_hook.lock().unwrap().push(running.is_empty());
        fail_after
    }));
    let mut gpu = RecordingGpu::new(&criu);
    gpu.watch = Some(pid);
    let out = Flow {
        criu: &*criu,
        gpu: &mut gpu,
        store: &store,
        progress: &crate::store::NoProgress,
        images: ImageTransfer::Stream,
        watch: &crate::flows::guardian::NoWatch,
        procs: &crate::proc::Live,
    }
    .checkpoint(&leave_running(pid));
    assert!(settled_running(&p), "the tree runs on, whatever happened");
    assert_eq!(gpu.stopped_at_thaw, Some(false));
    let seen = seen.lock().unwrap().clone();
    (out, seen, gpu.events(), store)
}

/// The tree runs again as soon as the store has read (copied) every image out of CRIU's pipes: a slow
/// store still writing them does not hold it stopped; the commit waits for the store.
#[test]
fn a_streamed_leave_running_tree_runs_while_a_slow_store_is_still_writing() {
    let (out, seen, events, store) = slow_store_case(false);
    let out = out.unwrap();
    assert!(!seen.is_empty() && seen.iter().all(|r| *r), "{seen:?}");
    assert!(out.timings.continued, "{:?}", out.timings);
    assert!(
        out.timings.paused < out.timings.dump,
        "continued before the store finished: {:?}",
        out.timings
    );
    assert_eq!(names(&events), ["freeze", "thaw"]);
    assert_eq!(store.list().unwrap().len(), 1);
}

/// The store fails once the tree runs again: the checkpoint fails with the store's error, the tree runs
/// on, its GPU state is put back once, nothing is committed.
#[test]
fn a_store_failing_after_the_early_continue_fails_the_checkpoint_with_the_tree_running() {
    let (out, seen, events, store) = slow_store_case(true);
    let err = out.unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Storage, "{err}");
    assert!(!seen.is_empty() && seen.iter().all(|r| *r), "{seen:?}");
    assert_eq!(names(&events), ["freeze", "thaw"]);
    assert!(store.list().unwrap().is_empty());
}
