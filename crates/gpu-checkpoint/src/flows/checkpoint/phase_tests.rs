//! A checkpoint driven as one member of a job ([`Phases`]): where it waits, and what an abort at each
//! barrier leaves (the tree running, its GPU state put back, nothing stored).

use std::sync::Mutex;

use super::tests::{names, Scene};
use super::*;
use crate::flows::NotCommitted;

/// Says yes or no at each barrier, and records what it saw there.
pub(super) struct Barriers {
    at_lock: Result<(), String>,
    at_durable: Result<(), NotCommitted>,
    seen: Mutex<Vec<String>>,
    watch: i32,
}

impl Barriers {
    pub(super) fn new(
        watch: i32,
        at_lock: Result<(), String>,
        at_durable: Result<(), NotCommitted>,
    ) -> Self {
        Barriers {
            at_lock,
            at_durable,
            seen: Mutex::default(),
            watch,
        }
    }

    /// What it saw at each barrier.
    pub(super) fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

impl Phases for Barriers {
    fn locked(&self) -> Result<(), String> {
        self.seen.lock().unwrap().push("locked".into());
        self.at_lock.clone()
    }
    fn durable(&self, id: &str) -> Result<(), NotCommitted> {
        let stopped = tree::stat(self.watch).is_some_and(|s| s.state == 'T');
        self.seen
            .lock()
            .unwrap()
            .push(format!("durable {id} stopped={stopped}"));
        self.at_durable.clone()
    }
}

#[test]
fn an_abort_while_locked_thaws_before_any_dump_and_stores_nothing() {
    let (s, p, mut gpu) = Scene::with_tree();
    let b = Barriers::new(p.pid(), Err("rank 3 timed out".into()), Ok(()));
    let err = s
        .checkpoint_phased(&mut gpu, &CheckpointOptions::new(p.pid()), &b)
        .unwrap_err();
    assert!(
        matches!(&err, crate::Error::Pipeline(pipeline::Error::Aborted { reason }) if reason == "rank 3 timed out"),
        "{err}"
    );
    assert_eq!(*b.seen.lock().unwrap(), ["locked"]);
    assert!(
        s.criu.calls().is_empty(),
        "no dump after an abort at the lock"
    );
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    assert!(p.running());
    s.assert_nothing_kept();
}

#[test]
fn an_abort_once_durable_deletes_the_member_checkpoint_and_resumes_the_held_tree() {
    let (s, p, mut gpu) = Scene::with_tree();
    let b = Barriers::new(
        p.pid(),
        Ok(()),
        Err(NotCommitted::Aborted("rank 1's dump failed".into())),
    );
    let err = s
        .checkpoint_phased(&mut gpu, &CheckpointOptions::new(p.pid()), &b)
        .unwrap_err();
    assert!(err.to_string().contains("rank 1's dump failed"), "{err}");
    let seen = b.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    // The tree is held stopped while the job decides, then continued and thawed.
    assert!(seen[1].ends_with("stopped=true"), "{seen:?}");
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    assert!(p.running());
    assert!(
        s.store.list().unwrap().is_empty(),
        "the member's checkpoint is gone"
    );
}

#[test]
fn in_doubt_once_durable_keeps_the_member_checkpoint_and_resumes_the_held_tree() {
    let (s, p, mut gpu) = Scene::with_tree();
    let why = NotCommitted::InDoubt("etcd: unreachable".into());
    let b = Barriers::new(p.pid(), Ok(()), Err(why));
    let err = s
        .checkpoint_phased(&mut gpu, &CheckpointOptions::new(p.pid()), &b)
        .unwrap_err();
    assert!(
        matches!(
            &err,
            crate::Error::Pipeline(pipeline::Error::InDoubt { .. })
        ),
        "{err}"
    );
    // The tree runs on as after an abort, but the checkpoint a committed job may name stays.
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    assert!(p.running());
    assert_eq!(s.store.list().unwrap().len(), 1);
}

#[test]
fn a_committed_job_stops_the_tree_as_a_plain_checkpoint_does() {
    let (s, p, mut gpu) = Scene::with_tree();
    let b = Barriers::new(p.pid(), Ok(()), Ok(()));
    let out = s
        .checkpoint_phased(&mut gpu, &CheckpointOptions::new(p.pid()), &b)
        .unwrap();
    assert_eq!(
        *b.seen.lock().unwrap(),
        [
            "locked".to_string(),
            format!("durable {} stopped=true", out.info.id)
        ]
    );
    assert!(out.stopped && !p.running());
    assert_eq!(s.store.list().unwrap().len(), 1);
}
