//! The protocol with the in-memory coordinator: agents in threads, members whose local work is a stand-in
//! that records when it locks, checkpoints and undoes, and fails on demand.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::records as rec;
use super::*;
use crate::flows::{NotCommitted, Phases};
use crate::freeze::BeforeUnlock;

/// How a stand-in member behaves.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(super) enum Fault {
    None,
    /// Its lock fails (GPU work not drained in time).
    Lock,
    /// Its dump fails after every member locked.
    Dump,
    /// Its dump fails once (the first time), then works.
    DumpOnce,
    /// Its restore fails after CRIU restored it, at the GPU restore (its copy is killed).
    GpuRestore,
}

/// What a stand-in member records when its restored copy is unlocked and runs on its GPUs.
const UNLOCKED: &str = "GPU unlocked";

/// The local work of every member of one agent: records `(rank, event)` in a log shared by all agents.
struct StandIn {
    log: Arc<Mutex<Vec<(u32, String)>>>,
    faults: BTreeMap<u32, Fault>,
    /// A `DumpOnce` fault fired already.
    fired: AtomicBool,
}

impl StandIn {
    fn note(&self, rank: u32, what: &str) {
        self.log.lock().unwrap().push((rank, what.into()));
    }
}

/// A stand-in's failure (exit class 1, as a plain failure of the flows).
fn failure(message: impl Into<String>) -> MemberError {
    MemberError::Reported {
        message: message.into(),
        exit: crate::exit::ExitStatus::Failure,
    }
}

impl MemberWork for StandIn {
    fn checkpoint(&self, task: &Task, phases: &dyn Phases) -> Result<(), MemberError> {
        let rank = task.member.rank;
        let fault = self.faults.get(&rank).copied().unwrap_or(Fault::None);
        if fault == Fault::Lock {
            self.note(rank, "lock failed");
            return Err(failure("lock timed out"));
        }
        self.note(rank, "locked");
        if let Err(e) = phases.locked() {
            self.note(rank, "unlocked");
            return Err(failure(e));
        }
        self.note(rank, "gpu checkpoint + dump");
        if fault == Fault::Dump
            || (fault == Fault::DumpOnce && !self.fired.swap(true, Ordering::SeqCst))
        {
            self.note(rank, "dump failed; thawed");
            return Err(failure("CRIU dump failed"));
        }
        let id = format!("{}.member-{rank}", task.op);
        match phases.durable(&id) {
            Ok(()) => {}
            Err(NotCommitted::Aborted(e)) => {
                self.note(rank, "deleted + resumed");
                return Err(failure(e));
            }
            Err(NotCommitted::InDoubt(e)) => {
                self.note(rank, "kept + resumed");
                return Err(failure(e));
            }
        }
        self.note(
            rank,
            if task.leave_running {
                "left running"
            } else {
                "stopped"
            },
        );
        Ok(())
    }
    fn gpus(&self, _id: &str) -> Vec<String> {
        vec!["GPU-sim".into()]
    }
    fn restore(&self, task: &Task, before_unlock: &BeforeUnlock<'_>) -> Result<i32, MemberError> {
        let rank = task.member.rank;
        let fault = self.faults.get(&rank).copied().unwrap_or(Fault::None);
        if fault == Fault::Dump {
            return Err(failure("CRIU restore failed"));
        }
        if let Some(map) = &task.device_map {
            self.note(rank, &format!("device map {map}"));
        }
        self.note(
            rank,
            &format!("restored {}", task.checkpoint.as_deref().unwrap()),
        );
        // As the restore flow: a copy that is not unlocked is killed.
        if fault == Fault::GpuRestore {
            self.note(rank, "killed");
            return Err(failure("GPU restore failed"));
        }
        let pid = 1000 + rank as i32;
        if let Err(e) = before_unlock(pid) {
            self.note(rank, "killed");
            return Err(failure(e));
        }
        self.note(rank, UNLOCKED);
        Ok(pid)
    }
    fn keep_manifest(&self, m: &JobManifest) -> Result<(), MemberError> {
        self.note(u32::MAX, &format!("kept {}", m.id));
        Ok(())
    }
    fn delete(&self, task: &Task) -> Result<(), MemberError> {
        let id = task.checkpoint.as_deref().unwrap();
        self.note(task.member.rank, &format!("deleted {id}"));
        Ok(())
    }
}

/// Agents for `nodes` in threads, on one in-memory etcd; stopped (and joined) on drop.
pub(super) struct Cluster {
    pub(super) coord: Arc<MemoryCoordinator>,
    log: Arc<Mutex<Vec<(u32, String)>>>,
    stop: Arc<AtomicBool>,
    agents: Vec<std::thread::JoinHandle<Result<(), ClusterError>>>,
}

impl Cluster {
    /// Agents on nodes `a` and `b`, and job `train` with rank 0 on `a` and rank 1 on `b`.
    fn train_on_a_and_b() -> Cluster {
        let c = Cluster::start(&["a", "b"], &[]);
        c.add("train", 0, "a");
        c.add("train", 1, "b");
        c
    }

    pub(super) fn start(nodes: &[&str], faults: &[(u32, Fault)]) -> Cluster {
        Cluster::start_on(Arc::new(MemoryCoordinator::new()), nodes, faults, |c| c)
    }

    /// Agents that reach `coord` through what `agents_see` makes of it (a counting wrapper).
    pub(super) fn start_on(
        coord: Arc<MemoryCoordinator>,
        nodes: &[&str],
        faults: &[(u32, Fault)],
        agents_see: impl Fn(Arc<dyn Coordinator>) -> Arc<dyn Coordinator>,
    ) -> Cluster {
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut agents = Vec::new();
        for node in nodes {
            let seen = agents_see(Arc::clone(&coord) as Arc<dyn Coordinator>);
            let (coord, stop) = (seen, Arc::clone(&stop));
            let work = StandIn {
                log: Arc::clone(&log),
                faults: faults.iter().copied().collect(),
                fired: AtomicBool::new(false),
            };
            let mut opts = AgentOptions::new(node, "/store");
            opts.lease_ttl = Duration::from_millis(600);
            agents.push(std::thread::spawn(move || {
                run_agent(coord, &opts, &work, &stop)
            }));
        }
        let c = Cluster {
            coord,
            log,
            stop,
            agents,
        };
        while job::agents(c.coord.as_ref()).unwrap().len() < nodes.len() {
            std::thread::sleep(Duration::from_millis(5));
        }
        c
    }

    pub(super) fn add(&self, job: &str, rank: u32, node: &str) {
        job::add_member(
            self.coord.as_ref(),
            job,
            &MemberRecord::process(rank, node, 100 + rank as i32),
        )
        .unwrap();
    }

    fn log(&self) -> Vec<(u32, String)> {
        self.log.lock().unwrap().clone()
    }

    fn events_of(&self, rank: u32) -> Vec<String> {
        self.log()
            .into_iter()
            .filter(|(r, _)| *r == rank)
            .map(|(_, e)| e)
            .collect()
    }

    pub(super) fn arc(&self) -> Arc<dyn Coordinator> {
        Arc::clone(&self.coord) as Arc<dyn Coordinator>
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for a in self.agents.drain(..) {
            let _ = a.join();
        }
    }
}

pub(super) fn opts(job: &str) -> JobCheckpointOptions {
    JobCheckpointOptions {
        job: job.into(),
        timeouts: Timeouts {
            lease_ttl: Duration::from_millis(600),
            prepare: Duration::from_secs(10),
            work: Duration::from_secs(10),
            release: Duration::from_secs(10),
        },
        ..JobCheckpointOptions::default()
    }
}

#[test]
fn every_member_locks_before_any_checkpoints_and_the_commit_records_them_all() {
    let c = Cluster::start(&["a", "b"], &[]);
    for (rank, node) in [(0, "a"), (1, "a"), (2, "b"), (3, "b")] {
        c.add("train", rank, node);
    }
    let m = checkpoint_job(c.arc(), &opts("train")).unwrap();
    assert_eq!(m.members.len(), 4);
    assert_eq!(m.members[2].checkpoint, format!("{}.member-2", m.id));
    assert_eq!(m.members[3].node, "b");
    assert!(m.cut.locked_unix_ms <= m.cut.committed_unix_ms);
    let log = c.log();
    let last_lock = log.iter().rposition(|(_, e)| e == "locked").unwrap();
    let first_dump = log
        .iter()
        .position(|(_, e)| e.starts_with("gpu checkpoint"))
        .unwrap();
    assert!(
        last_lock < first_dump,
        "a member checkpointed before all were locked: {log:?}"
    );
    for rank in 0..4 {
        assert_eq!(c.events_of(rank).last().unwrap(), "stopped", "{log:?}");
    }
    // Committed in etcd, kept by each agent, and nothing of the operation is left.
    assert_eq!(
        job::checkpoint(c.coord.as_ref(), &m.id)
            .unwrap()
            .members
            .len(),
        4
    );
    assert!(c.events_of(u32::MAX).contains(&format!("kept {}", m.id)));
    assert!(c
        .coord
        .range(&format!("{}ops/", rec::ROOT))
        .unwrap()
        .0
        .is_empty());
    assert!(c
        .coord
        .range(&format!("{}tasks/", rec::ROOT))
        .unwrap()
        .0
        .is_empty());

    // And it restores, on other nodes.
    let map = parse_node_map("a=b,b=a").unwrap();
    let devices = parse_device_maps(&["a:0=1".into()]).unwrap();
    let r = restore_job(c.arc(), &m.id, &map, &devices, &opts("train").timeouts).unwrap();
    assert_eq!(
        r.members.iter().map(|m| m.pid).collect::<Vec<_>>(),
        [1000, 1001, 1002, 1003]
    );
    assert_eq!(r.members[0].node, "b");
    assert!(c
        .events_of(2)
        .contains(&format!("restored {}.member-2", m.id)));
    // Two phases: every member restored (GPU state back, still locked) before any is unlocked.
    let log = c.log();
    let last_restored = log.iter().rposition(|(_, e)| e.starts_with("restored "));
    let first_unlocked = log.iter().position(|(_, e)| e == UNLOCKED);
    assert!(last_restored.unwrap() < first_unlocked.unwrap(), "{log:?}");
    assert_eq!(log.iter().filter(|(_, e)| e == UNLOCKED).count(), 4);
    // A device map goes to the node it names (a, where ranks 2 and 3 are restored), and only there.
    assert!(c.events_of(2).contains(&"device map 0=1".to_string()));
    assert!(!c.events_of(0).iter().any(|e| e.starts_with("device map")));
    let bad = parse_device_maps(&["c:0=1".into()]).unwrap();
    let e = restore_job(c.arc(), &m.id, &map, &bad, &opts("train").timeouts).unwrap_err();
    assert!(matches!(e, ClusterError::Usage(_)), "{e}");
}

#[test]
fn a_member_that_cannot_lock_aborts_the_job_and_every_other_member_unlocks() {
    let c = Cluster::start(&["a", "b"], &[(2, Fault::Lock)]);
    for (rank, node) in [(0, "a"), (1, "b"), (2, "b")] {
        c.add("train", rank, node);
    }
    let e = checkpoint_job(c.arc(), &opts("train")).unwrap_err();
    assert!(matches!(e, ClusterError::Aborted { .. }), "{e}");
    assert!(e.to_string().contains("lock timed out"), "{e}");
    let log = c.log();
    assert!(
        !log.iter().any(|(_, e)| e.starts_with("gpu checkpoint")),
        "{log:?}"
    );
    for rank in [0, 1] {
        // Each either never locked, or unlocked again.
        let ev = c.events_of(rank);
        assert!(ev.is_empty() || ev.last().unwrap() == "unlocked", "{log:?}");
    }
    assert!(job::checkpoints(c.coord.as_ref(), None).unwrap().is_empty());
}

#[test]
fn a_failed_dump_aborts_and_the_durable_members_delete_their_checkpoints() {
    let c = Cluster::start(&["a", "b"], &[(1, Fault::Dump)]);
    for (rank, node) in [(0, "a"), (1, "b")] {
        c.add("train", rank, node);
    }
    let e = checkpoint_job(c.arc(), &opts("train")).unwrap_err();
    assert!(e.to_string().contains("CRIU dump failed"), "{e}");
    // The job's error comes as soon as rank 1 reports; rank 0 may still be on its way (woken at the lock
    // barrier, or between its dump and the durable barrier): wait for its own undo.
    let settled = |ev: &[String]| {
        ev.last()
            .is_some_and(|l| l == "deleted + resumed" || l == "unlocked")
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !settled(&c.events_of(0)) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let ev = c.events_of(0);
    assert!(settled(&ev), "{ev:?}");
    assert!(!ev.contains(&"stopped".to_string()), "{ev:?}");
    assert!(job::checkpoints(c.coord.as_ref(), None).unwrap().is_empty());
}

#[test]
fn an_agent_whose_lease_expires_aborts_the_job() {
    let c = Cluster::start(&["a"], &[]);
    c.add("train", 0, "a");
    c.add("train", 1, "ghost");
    // "ghost"'s agent registers, then dies (its lease is not refreshed any more).
    let lease = c.coord.grant(Duration::from_millis(400)).unwrap();
    c.coord
        .put(
            &rec::agent("ghost"),
            &rec::encode(&AgentRecord {
                node: "ghost".into(),
                pid: 1,
                storage: "/s".into(),
                tool_version: "0".into(),
                started_unix_ms: 0,
                gpus: Vec::new(),
            }),
            Some(lease),
        )
        .unwrap();
    let e = checkpoint_job(c.arc(), &opts("train")).unwrap_err();
    assert!(e.to_string().contains("agent is gone"), "{e}");
    assert_eq!(c.events_of(0).last().map(String::as_str), Some("unlocked"));
}

#[test]
fn a_dead_coordinator_makes_every_locked_member_unlock() {
    let c = Cluster::start(&["a"], &[]);
    c.add("train", 0, "a");
    // A coordinator that sends the tasks, sees the member locked, and dies before deciding.
    let lease = c.coord.grant(Duration::from_millis(300)).unwrap();
    let member = job::members(c.coord.as_ref(), "train").unwrap()[0].clone();
    let task = Task::checkpoint("train-1", "train", member);
    c.coord
        .put(&rec::op("train-1"), b"{}", Some(lease))
        .unwrap();
    c.coord
        .put(
            &rec::task("a", "train-1", 0),
            &rec::encode(&task),
            Some(lease),
        )
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while c.events_of(0).last().map(String::as_str) != Some("unlocked") {
        assert!(std::time::Instant::now() < deadline, "{:?}", c.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let states = c.coord.range(&rec::states("train-1")).unwrap().0;
    let s: rec::StateRecord = rec::decode("k", &states[0].value).unwrap();
    assert_eq!(s.state, MemberState::Aborted);
}

/// Checkpoints job `train` of `members` (rank, node), then restores it with agents (on an etcd holding
/// just the job checkpoint) whose members behave as `faults` say; the restore must fail.
fn failed_restore(
    members: &[(u32, &str)],
    faults: &[(u32, Fault)],
) -> (Cluster, JobManifest, ClusterError) {
    let c = Cluster::start(&["a", "b"], &[]);
    for (rank, node) in members {
        c.add("train", *rank, node);
    }
    let m = checkpoint_job(c.arc(), &opts("train")).unwrap();
    drop(c);
    let c2 = Cluster::start(&["a", "b"], faults);
    c2.coord
        .put(&rec::checkpoint(&m.id), &rec::encode(&m), None)
        .unwrap();
    let none = BTreeMap::new();
    let e = restore_job(c2.arc(), &m.id, &none, &none, &opts("train").timeouts).unwrap_err();
    (c2, m, e)
}

#[test]
fn a_failed_member_restore_kills_every_restored_copy_and_keeps_the_checkpoint() {
    // Rank 1 cannot be restored at all (CRIU fails).
    let (c2, m, e) = failed_restore(&[(0, "a"), (1, "b")], &[(1, Fault::Dump)]);
    assert!(e.to_string().contains("CRIU restore failed"), "{e}");
    assert_eq!(
        c2.events_of(0),
        [format!("restored {}.member-0", m.id), "killed".into()]
    );
    assert!(job::checkpoint(c2.coord.as_ref(), &m.id).is_ok());
}

#[test]
fn a_member_whose_gpu_restore_fails_leaves_no_member_unlocked_and_every_copy_killed() {
    // Rank 1's copy is restored by CRIU, and its GPU restore fails; ranks 0 and 2 are restored.
    let members = [(0, "a"), (1, "b"), (2, "b")];
    let (c2, m, e) = failed_restore(&members, &[(1, Fault::GpuRestore)]);
    assert!(e.to_string().contains("GPU restore failed"), "{e}");
    for rank in 0..3 {
        assert_eq!(
            c2.events_of(rank),
            [format!("restored {}.member-{rank}", m.id), "killed".into()],
            "rank {rank}"
        );
    }
    let log = c2.log();
    assert!(!log.iter().any(|(_, e)| e == UNLOCKED), "{log:?}");
    assert!(job::checkpoint(c2.coord.as_ref(), &m.id).is_ok());
}

#[test]
fn periodic_checkpoints_keep_the_newest_and_a_failed_round_does_not_stop_the_next() {
    // Rank 1's first dump fails: round 1 aborts, the others commit.
    let c = Cluster::start(&["a", "b"], &[(1, Fault::DumpOnce)]);
    c.add("train", 0, "a");
    c.add("train", 1, "b");
    let popts = PeriodicOptions {
        checkpoint: opts("train"),
        every: Duration::from_millis(20),
        keep: Some(2),
    };
    let stop = AtomicBool::new(false);
    let (mut committed, mut failed, mut deleted) = (Vec::new(), Vec::new(), Vec::new());
    let mut report = |round: u64, r: Round| match r {
        Round::Committed(m) => {
            committed.push(m.id);
            if committed.len() == 4 {
                stop.store(true, Ordering::SeqCst);
            }
        }
        Round::Failed(e) => failed.push((round, e.to_string())),
        Round::Retention(d) => deleted.push(d.unwrap()),
    };
    run_periodic(c.arc(), &popts, &stop, &mut report);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(failed[0].0, 1);
    assert!(failed[0].1.contains("CRIU dump failed"), "{failed:?}");
    // The newest two are kept; the two before were deleted, their member checkpoints too.
    let kept: Vec<String> = job::checkpoints(c.coord.as_ref(), Some("train"))
        .unwrap()
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(kept, committed[2..]);
    assert_eq!(
        deleted.iter().map(|d| d.id.clone()).collect::<Vec<_>>(),
        committed[..2]
    );
    assert!(deleted.iter().all(|d| d.left.is_empty()), "{deleted:?}");
    for old in &committed[..2] {
        for rank in [0, 1] {
            let ev = format!("deleted {old}.member-{rank}");
            assert!(c.events_of(rank).contains(&ev), "{:?}", c.log());
        }
    }
    assert!(retention::trash(c.coord.as_ref(), None).unwrap().is_empty());
    // The job ran on between rounds (leave_running forced): nothing was stopped.
    assert!(
        !c.log().iter().any(|(_, e)| e == "stopped"),
        "{:?}",
        c.log()
    );
    // The newest restores.
    let none = BTreeMap::new();
    restore_job(
        c.arc(),
        &committed[3],
        &none,
        &none,
        &opts("train").timeouts,
    )
    .unwrap();
}

#[test]
fn a_member_checkpoint_on_a_node_without_agent_stays_in_the_trash_until_a_later_delete() {
    let c = Cluster::train_on_a_and_b();
    let m = checkpoint_job(c.arc(), &opts("train")).unwrap();
    drop(c);
    // Only a's agent runs now: the job checkpoint goes, b's member checkpoint waits in the trash.
    let c = Cluster::start(&["a"], &[]);
    c.coord
        .put(&rec::checkpoint(&m.id), &rec::encode(&m), None)
        .unwrap();
    let d = delete_job_checkpoint(c.arc(), &m.id, &opts("train").timeouts).unwrap();
    assert_eq!(d.left.len(), 1, "{d:?}");
    assert!(d.left[0].contains("rank 1 on b"), "{d:?}");
    assert!(job::checkpoints(c.coord.as_ref(), None).unwrap().is_empty());
    assert!(c
        .events_of(0)
        .contains(&format!("deleted {}.member-0", m.id)));
    let trashed = retention::trash(c.coord.as_ref(), Some("train")).unwrap();
    assert_eq!(trashed.len(), 1);
    // Deleting it again is refused (it is not a job checkpoint any more).
    let e = delete_job_checkpoint(c.arc(), &m.id, &opts("train").timeouts).unwrap_err();
    assert!(matches!(e, ClusterError::NotFound { .. }), "{e}");
    drop(c);
    // b's agent is back: the next retention round of the job empties the trash.
    let c = Cluster::start(&["a", "b"], &[]);
    c.coord
        .put(&rec::trash(&m.id), &rec::encode(&trashed[0]), None)
        .unwrap();
    let done = apply_retention(c.arc(), "train", 3, &opts("train").timeouts).unwrap();
    assert_eq!(done.len(), 1);
    assert!(done[0].as_ref().unwrap().left.is_empty(), "{done:?}");
    assert!(c
        .events_of(1)
        .contains(&format!("deleted {}.member-1", m.id)));
    assert!(retention::trash(c.coord.as_ref(), None).unwrap().is_empty());
}

#[test]
fn a_job_checkpoints_timings_break_the_protocol_down() {
    let nodes = ["a", "b", "c"];
    let c = Cluster::start(&nodes, &[]);
    for (rank, node) in nodes.iter().enumerate() {
        c.add("train", rank as u32, node);
    }
    let m = checkpoint_job(c.arc(), &opts("train")).unwrap();
    let t = &m.timings_ms;
    // The members report their own state writes; the waits their skew and wake-ups, within the total.
    assert!(t.member_etcd_max > 0.0, "{t:?}");
    assert!(t.member_etcd_max <= t.member_work_max, "{t:?}");
    for part in [
        t.barrier_skew,
        t.watch_wake,
        t.task_pickup,
        t.go_delivery,
        t.commit_delivery,
    ] {
        assert!((0.0..=t.total + 1.0).contains(&part), "{t:?}");
    }
}

#[test]
fn an_agent_whose_lease_expired_registers_again_and_takes_part_in_the_next_job() {
    let c = Cluster::start(&["a"], &[]);
    c.add("train", 0, "a");
    // a's lease runs out (its node cut off from etcd for longer than the TTL): its record goes.
    let old = c.coord.leases();
    assert_eq!(old.len(), 1);
    c.coord.expire(old[0]);
    // Once etcd answers again the agent registers under a new lease (before: it ended with an error).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while job::agents(c.coord.as_ref()).unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "a did not register again"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_ne!(c.coord.leases(), old);
    let m = checkpoint_job(c.arc(), &opts("train")).unwrap();
    assert_eq!(m.members.len(), 1);
}

#[test]
fn a_forged_job_manifest_is_refused_before_any_agent_is_asked() {
    let c = Cluster::train_on_a_and_b();
    let m = checkpoint_job(c.arc(), &opts("train")).unwrap();
    let none = BTreeMap::new();
    let forged: [fn(&mut JobManifest); 3] = [
        |m| m.members[0].checkpoint = "../../etc".into(),
        |m| m.members[1].node = "b/../../x".into(),
        |m| m.id = "../../outside/PWN".into(),
    ];
    for forge in forged {
        let mut bad = m.clone();
        forge(&mut bad);
        let key = rec::checkpoint(&m.id);
        c.coord
            .put(&key, &rec::encode_manifest(&bad), None)
            .unwrap();
        let e = restore_job(c.arc(), &m.id, &none, &none, &opts("train").timeouts).unwrap_err();
        assert!(matches!(e, ClusterError::Damaged { .. }), "{e}");
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::exit::ExitStatus::CheckpointInvalid
        );
        let e = delete_job_checkpoint(c.arc(), &m.id, &opts("train").timeouts).unwrap_err();
        assert!(matches!(e, ClusterError::Damaged { .. }), "{e}");
        let (tasks, _) = c.coord.range(&format!("{}tasks/", rec::ROOT)).unwrap();
        assert!(tasks.is_empty(), "{tasks:?}");
    }
}

#[test]
fn bad_task_records_are_skipped_or_refused_and_the_agent_serves_on() {
    let c = Cluster::start(&["a"], &[]);
    c.add("train", 0, "a");
    let lease = c.coord.grant(Duration::from_secs(30)).unwrap();
    let tasks = format!("{}tasks/a/", rec::ROOT);
    // Not JSON; another schema; a task whose key says another rank; one naming PID 1 and a shell command.
    let mut evil = Task::checkpoint("evil-1", "train", MemberRecord::process(0, "a", 1));
    evil.quiesce = Some("id > /tmp/x".into());
    let records: [(String, Vec<u8>); 4] = [
        (
            format!("{tasks}junk/00000000"),
            b"\x1b[2J not json".to_vec(),
        ),
        (
            format!("{tasks}other/00000000"),
            br#"{"schema":"x","schema_version":1}"#.to_vec(),
        ),
        (format!("{tasks}evil-1/00000007"), rec::encode_task(&evil)),
        (format!("{tasks}evil-1/00000000"), rec::encode_task(&evil)),
    ];
    for (key, value) in &records {
        c.coord.put(key, value, Some(lease)).unwrap();
    }
    // The task found where its rank's would be is answered: failed, exit 2, nothing run.
    let state = rec::state("evil-1", 0);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let failed = loop {
        if let Some(kv) = c.coord.get(&state).unwrap() {
            break rec::decode::<rec::StateRecord>(&kv.key, &kv.value).unwrap();
        }
        assert!(std::time::Instant::now() < deadline, "no answer");
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        matches!(&failed.state, MemberState::Failed { exit: Some(2), error } if error.contains("refused the task")),
        "{failed:?}"
    );
    assert!(
        c.log().is_empty(),
        "the stand-in did something: {:?}",
        c.log()
    );
    c.coord.revoke(lease).unwrap();
    // The agent serves on: a real job checkpoint commits.
    let m = checkpoint_job(c.arc(), &opts("train")).unwrap();
    assert_eq!(m.members.len(), 1);
}
