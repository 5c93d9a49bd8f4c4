//! The protocol with the in-memory coordinator: agents in threads, members whose local work is a stand-in
//! that records when it locks, checkpoints and undoes, and fails on demand.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::records as rec;
use super::*;
use crate::flows::Phases;

/// How a stand-in member behaves.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Fault {
    None,
    /// Its lock fails (GPU work not drained in time).
    Lock,
    /// Its dump fails after every member locked.
    Dump,
}

/// The local work of every member of one agent: records `(rank, event)` in a log shared by all agents.
struct StandIn {
    log: Arc<Mutex<Vec<(u32, String)>>>,
    faults: BTreeMap<u32, Fault>,
}

impl StandIn {
    fn note(&self, rank: u32, what: &str) {
        self.log.lock().unwrap().push((rank, what.into()));
    }
}

impl MemberWork for StandIn {
    fn checkpoint(&self, task: &Task, phases: &dyn Phases) -> Result<(), String> {
        let rank = task.member.rank;
        let fault = self.faults.get(&rank).copied().unwrap_or(Fault::None);
        if fault == Fault::Lock {
            self.note(rank, "lock failed");
            return Err("lock timed out".into());
        }
        self.note(rank, "locked");
        if let Err(e) = phases.locked() {
            self.note(rank, "unlocked");
            return Err(e);
        }
        self.note(rank, "gpu checkpoint + dump");
        if fault == Fault::Dump {
            self.note(rank, "dump failed; thawed");
            return Err("CRIU dump failed".into());
        }
        let id = format!("member-{rank}");
        if let Err(e) = phases.durable(&id) {
            self.note(rank, "deleted + resumed");
            return Err(e);
        }
        self.note(rank, "stopped");
        Ok(())
    }
    fn gpus(&self, _id: &str) -> Vec<String> {
        vec!["GPU-sim".into()]
    }
    fn restore(&self, task: &Task) -> Result<i32, String> {
        let rank = task.member.rank;
        if self.faults.get(&rank) == Some(&Fault::Dump) {
            return Err("CRIU restore failed".into());
        }
        self.note(
            rank,
            &format!("restored {}", task.checkpoint.as_deref().unwrap()),
        );
        Ok(1000 + rank as i32)
    }
    fn kill(&self, pid: i32) {
        self.note((pid - 1000) as u32, "killed");
    }
    fn keep_manifest(&self, m: &JobManifest) -> Result<(), String> {
        self.note(u32::MAX, &format!("kept {}", m.id));
        Ok(())
    }
}

/// Agents for `nodes` in threads, on one in-memory etcd; stopped (and joined) on drop.
struct Cluster {
    coord: Arc<MemoryCoordinator>,
    log: Arc<Mutex<Vec<(u32, String)>>>,
    stop: Arc<AtomicBool>,
    agents: Vec<std::thread::JoinHandle<Result<(), ClusterError>>>,
}

impl Cluster {
    fn start(nodes: &[&str], faults: &[(u32, Fault)]) -> Cluster {
        let coord = Arc::new(MemoryCoordinator::new());
        let log = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut agents = Vec::new();
        for node in nodes {
            let (coord, stop) = (Arc::clone(&coord), Arc::clone(&stop));
            let work = StandIn {
                log: Arc::clone(&log),
                faults: faults.iter().copied().collect(),
            };
            let mut opts = AgentOptions::new(node, "/store");
            opts.lease_ttl = Duration::from_millis(600);
            agents.push(std::thread::spawn(move || {
                run_agent(coord as Arc<dyn Coordinator>, &opts, &work, &stop)
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

    fn add(&self, job: &str, rank: u32, node: &str) {
        job::add_member(
            self.coord.as_ref(),
            job,
            &MemberRecord {
                rank,
                node: node.into(),
                pid: Some(100 + rank as i32),
                container: None,
            },
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

    fn arc(&self) -> Arc<dyn Coordinator> {
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

fn opts(job: &str) -> JobCheckpointOptions {
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
    assert_eq!(m.members[2].checkpoint, "member-2");
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
    let map = job::parse_node_map("a=b,b=a").unwrap();
    let r = restore_job(c.arc(), &m.id, &map, &opts("train").timeouts).unwrap();
    assert_eq!(
        r.members.iter().map(|m| m.pid).collect::<Vec<_>>(),
        [1000, 1001, 1002, 1003]
    );
    assert_eq!(r.members[0].node, "b");
    assert!(c.events_of(2).contains(&"restored member-2".to_string()));
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
    let task = Task {
        op: "train-1".into(),
        job: "train".into(),
        kind: rec::OpKind::Checkpoint,
        member: job::members(c.coord.as_ref(), "train").unwrap()[0].clone(),
        leave_running: false,
        lock_timeout_ms: None,
        quiesce: None,
        checkpoint: None,
    };
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

#[test]
fn a_failed_member_restore_kills_every_restored_copy_and_keeps_the_checkpoint() {
    let c = Cluster::start(&["a", "b"], &[]);
    c.add("train", 0, "a");
    c.add("train", 1, "b");
    let m = checkpoint_job(c.arc(), &opts("train")).unwrap();
    drop(c);
    // The same etcd, agents whose rank 1 cannot be restored.
    let c2 = Cluster::start(&["a", "b"], &[(1, Fault::Dump)]);
    c2.coord
        .put(&rec::checkpoint(&m.id), &rec::encode(&m), None)
        .unwrap();
    let e = restore_job(c2.arc(), &m.id, &BTreeMap::new(), &opts("train").timeouts).unwrap_err();
    assert!(e.to_string().contains("CRIU restore failed"), "{e}");
    assert_eq!(c2.events_of(0), ["restored member-0", "killed"]);
    assert!(job::checkpoint(c2.coord.as_ref(), &m.id).is_ok());
}
