//! `job restore`: every member of a job checkpoint restored on its node (or the one the map names, or
//! one chosen for it, `placement.rs`), GPU state back and still locked, before the coordinator commits
//! and the agents unlock; the same two-phase operation (`Op`) as a job checkpoint.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::coord::Coordinator;
use super::job::{agents, before, checkpoint, preflight_with, Cause, Op, Timeouts, Verdict};
use super::placement::{self, Chosen};
use super::records::{self as rec, MemberState, OpKind};
use super::timings::Clock;
use super::ClusterError;
use super::{JobMember, JobTimings, MemberRecord, Task};

/// A finished job restore: each member's restored root PID on its node.
#[derive(Debug, Clone, serde::Serialize)]
pub struct JobRestoreOutcome {
    pub id: String,
    pub job: String,
    pub members: Vec<RestoredMember>,
    /// The nodes chosen for members whose node had no agent.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub placed: Vec<Chosen>,
    pub timings_ms: JobTimings,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct RestoredMember {
    pub rank: u32,
    pub node: String,
    pub pid: i32,
}

/// Parses `OLD=NEW,...` (a member-to-node map for a restore).
pub fn parse_node_map(s: &str) -> Result<BTreeMap<String, String>, ClusterError> {
    let mut map = BTreeMap::new();
    for pair in s.split(',').filter(|p| !p.is_empty()) {
        let (old, new) = pair
            .split_once('=')
            .ok_or_else(|| ClusterError::Usage(format!("--node-map: {pair:?} is not OLD=NEW")))?;
        rec::check_name("node", old).map_err(ClusterError::Usage)?;
        rec::check_name("node", new).map_err(ClusterError::Usage)?;
        if map.insert(old.to_string(), new.to_string()).is_some() {
            return Err(ClusterError::Usage(format!("--node-map names {old} twice")));
        }
    }
    Ok(map)
}

/// Parses `job restore --device-map NODE:OLD=NEW,...` arguments (one per node) into a device map per
/// node: the node is the one the members are restored *on*, the map is `restore --device-map`'s (GPU
/// indices or UUIDs, checked here so that a typo fails before any agent starts).
pub fn parse_device_maps(args: &[String]) -> Result<BTreeMap<String, String>, ClusterError> {
    let mut maps = BTreeMap::new();
    for a in args {
        let (node, map) = a.split_once(':').ok_or_else(|| {
            ClusterError::Usage(format!("--device-map: {a:?} is not NODE:OLD=NEW,..."))
        })?;
        rec::check_name("node", node).map_err(ClusterError::Usage)?;
        map.parse::<crate::freeze::DeviceMap>()
            .map_err(|e| ClusterError::Usage(format!("--device-map {a:?}: {e}")))?;
        if maps.insert(node.to_string(), map.to_string()).is_some() {
            return Err(ClusterError::Usage(format!(
                "--device-map names node {node} twice"
            )));
        }
    }
    Ok(maps)
}

/// Restores every member of job checkpoint `id`, each on the node `node_map` names for its node, else
/// on its node while that has an agent, else on a node chosen for it ([`placement`]), with the device
/// map `device_maps` gives for that node (or the chosen one's): all restored (GPU state included, still
/// GPU-locked) before the coordinator commits, and only then unlocked by their agents; any failure kills
/// every restored copy, none of which was unlocked, and keeps the checkpoint.
pub fn restore_job(
    coord: Arc<dyn Coordinator>,
    id: &str,
    node_map: &BTreeMap<String, String>,
    device_maps: &BTreeMap<String, String>,
    timeouts: &Timeouts,
) -> Result<JobRestoreOutcome, ClusterError> {
    let mut clock = Clock::start();
    let c = coord.as_ref();
    let manifest = checkpoint(c, id)?;
    if let Some(old) = node_map
        .keys()
        .find(|old| !manifest.members.iter().any(|m| &&m.node == old))
    {
        return Err(ClusterError::Usage(format!(
            "--node-map: no member of {id} ran on node {old}"
        )));
    }
    let alive = agents(c)?;
    let placement = placement::place(&manifest, node_map, &alive)?;
    let mut device_maps = device_maps.clone();
    for (node, map) in &placement.device_maps {
        // A map the user gave for the chosen node is theirs to keep.
        device_maps
            .entry(node.clone())
            .or_insert_with(|| map.clone());
    }
    let targets: Vec<(MemberRecord, &JobMember)> = manifest
        .members
        .iter()
        .map(|m| {
            let node = placement.nodes.get(&m.node).unwrap_or(&m.node).clone();
            (
                MemberRecord {
                    rank: m.rank,
                    node,
                    pid: m.pid,
                    container: None,
                    ordered: false,
                },
                m,
            )
        })
        .collect();
    let members: Vec<MemberRecord> = targets.iter().map(|(t, _)| t.clone()).collect();
    if let Some(node) = device_maps
        .keys()
        .find(|n| !members.iter().any(|m| &&m.node == n))
    {
        return Err(ClusterError::Usage(format!(
            "--device-map: no member of {id} is restored on node {node}"
        )));
    }
    preflight_with(c, &manifest.job, &members, &alive)?;
    let op_id = format!("{id}.restore-{}", rec::now_ms());
    let tasks = targets
        .iter()
        .map(|(target, m)| Task {
            op: op_id.clone(),
            job: manifest.job.clone(),
            kind: OpKind::Restore,
            member: target.clone(),
            leave_running: false,
            lock_timeout_ms: None,
            quiesce: None,
            checkpoint: Some(m.checkpoint.clone()),
            device_map: device_maps.get(&target.node).cloned(),
            job_checkpoint: Some(id.to_string()),
            after: before(&members, target.rank, manifest.ordered),
        })
        .collect();
    let record = rec::OpRecord {
        id: op_id,
        job: manifest.job.clone(),
        kind: OpKind::Restore,
        members: members.clone(),
        started_unix_ms: rec::now_ms(),
        ordered: manifest.ordered,
    };
    let op = Op::start(c, Arc::clone(&coord), record, tasks, timeouts.lease_ttl)?;
    clock.sent_unix_ms = rec::now_ms();
    clock.phase();
    let states = op
        .wait_all("restore", timeouts.work, |s, alive| match s {
            Some(MemberState::Failed { error, exit }) => Verdict::Fail(Cause::failed(error, *exit)),
            Some(MemberState::Aborted) => Verdict::Fail(Cause::from("aborted".to_string())),
            _ if !alive => {
                Verdict::Fail(Cause::from("its agent is gone (lease expired)".to_string()))
            }
            Some(MemberState::Restored { .. }) => Verdict::Done,
            _ => Verdict::Pending,
        })
        .map_err(|why| op.abort(why, timeouts.release))?;
    clock.timings.checkpoint = clock.lap();
    clock.phase();
    op.decide("commit")
        .map_err(|e| op.abort(e.to_string(), timeouts.release))?;
    clock.commit_unix_ms = rec::now_ms();
    clock.timings.commit = clock.lap();
    clock.phase();
    match op.wait_finished("finish", timeouts.release) {
        Ok(states) => clock.members_done(&states),
        Err(e) => tracing::warn!("job {} is restored, but: {}", manifest.job, e.why),
    }
    clock.timings.release = clock.lap();
    let timings = op.timings(clock);
    let restored = members
        .iter()
        .map(|m| RestoredMember {
            rank: m.rank,
            node: m.node.clone(),
            pid: match states.get(&m.rank) {
                Some(MemberState::Restored { pid }) => *pid,
                _ => 0,
            },
        })
        .collect();
    Ok(JobRestoreOutcome {
        id: id.to_string(),
        job: manifest.job,
        members: restored,
        placed: placement.chosen,
        timings_ms: timings,
    })
}
