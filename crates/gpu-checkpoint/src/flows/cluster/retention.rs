//! Deleting job checkpoints, and periodic checkpoints of a job with retention (`job checkpoint --every
//! 30m --keep 3`, `job delete`).
//!
//! A job checkpoint is deleted in two steps. First one transaction moves its manifest from
//! `checkpoints/ID` to `trash/ID`: from then on the job checkpoint does not exist (nobody restores
//! it), whatever happens next. Then the agents of its members' nodes delete the member checkpoints
//! from their stores (an operation of kind [`OpKind::Delete`], under the coordinator's lease like any
//! other); once every one is gone the trash entry goes too. A node whose agent is down, or a member
//! whose delete fails, leaves the trash entry in place, and the next delete or retention round of the
//! job tries again: member checkpoints are never left behind unnamed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::coord::{Compare, Coordinator, TxnOp};
use super::job::{self, checkpoint_job, JobCheckpointOptions, Op, Timeouts};
use super::records::{self as rec, MemberState, OpKind};
use super::{ClusterError, JobManifest, MemberRecord, Task};

/// What deleting one job checkpoint did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Deleted {
    pub id: String,
    /// The member checkpoints still in a store (their node's agent down, or their delete failed):
    /// `rank N on NODE: why`. The job checkpoint stays in the trash until a later delete gets them.
    pub left: Vec<String>,
}

/// Deletes job checkpoint `id`: gone from etcd at once (into the trash), then its member checkpoints
/// from the stores through the agents.
pub fn delete_job_checkpoint(
    coord: Arc<dyn Coordinator>,
    id: &str,
    timeouts: &Timeouts,
) -> Result<Deleted, ClusterError> {
    let c = coord.as_ref();
    let manifest = job::checkpoint(c, id)?;
    let moved = c.txn(
        &[
            Compare::Exists(rec::checkpoint(id)),
            Compare::Missing(rec::trash(id)),
        ],
        &[
            TxnOp::Delete(rec::checkpoint(id)),
            TxnOp::Put {
                key: rec::trash(id),
                value: rec::encode_manifest(&manifest),
                lease: None,
            },
        ],
    )?;
    if !moved {
        return Err(ClusterError::Busy {
            what: format!("job checkpoint {id} is being deleted already"),
        });
    }
    purge(coord, &manifest, timeouts)
}

/// Deletes the member checkpoints of a job checkpoint in the trash; removes it from the trash once
/// every one is gone.
fn purge(
    coord: Arc<dyn Coordinator>,
    manifest: &JobManifest,
    timeouts: &Timeouts,
) -> Result<Deleted, ClusterError> {
    let c = coord.as_ref();
    let alive = job::agents(c)?;
    let mut left = Vec::new();
    let mut members = Vec::new();
    for m in &manifest.members {
        if alive.iter().any(|a| a.node == m.node) {
            members.push(m);
        } else {
            left.push(format!(
                "rank {} on {}: no agent is registered for the node",
                m.rank, m.node
            ));
        }
    }
    if !members.is_empty() {
        let op_id = format!("{}.delete-{}", manifest.id, rec::now_ms());
        let record_members: Vec<MemberRecord> = members
            .iter()
            .map(|m| MemberRecord {
                rank: m.rank,
                node: m.node.clone(),
                pid: m.pid,
                container: None,
                ordered: false,
            })
            .collect();
        let tasks = record_members
            .iter()
            .zip(&members)
            .map(|(r, m)| Task {
                after: None,
                op: op_id.clone(),
                job: manifest.job.clone(),
                kind: OpKind::Delete,
                member: r.clone(),
                leave_running: false,
                lock_timeout_ms: None,
                quiesce: None,
                checkpoint: Some(m.checkpoint.clone()),
                device_map: None,
                job_checkpoint: Some(manifest.id.clone()),
            })
            .collect();
        let record = rec::OpRecord {
            id: op_id,
            job: manifest.job.clone(),
            kind: OpKind::Delete,
            members: record_members,
            started_unix_ms: rec::now_ms(),
            ordered: false,
        };
        let op = Op::start(c, Arc::clone(&coord), record, tasks, timeouts.lease_ttl)?;
        // Every member says done or failed; an agent that dies meanwhile leaves its member for later.
        let states = op.wait_finished("delete their checkpoint", timeouts.release);
        match states {
            Ok(states) => {
                for m in &members {
                    match states.get(&m.rank) {
                        Some(MemberState::Done { .. }) => {}
                        Some(MemberState::Failed { error, .. }) => {
                            left.push(format!("rank {} on {}: {error}", m.rank, m.node))
                        }
                        _ => left.push(format!("rank {} on {}: its agent is gone", m.rank, m.node)),
                    }
                }
            }
            Err(e) => left.push(format!("not every member confirmed its delete: {}", e.why)),
        }
    }
    if left.is_empty() {
        c.delete_prefix(&rec::trash(&manifest.id))?;
    }
    Ok(Deleted {
        id: manifest.id.clone(),
        left,
    })
}

/// The trash of `job` (or of every job): deleted job checkpoints whose member checkpoints are not all
/// deleted yet.
pub fn trash(coord: &dyn Coordinator, job: Option<&str>) -> Result<Vec<JobManifest>, ClusterError> {
    job::manifests_under(coord, &rec::trashed(), job)
}

/// Retention: deletes the job checkpoints of `job` beyond the newest `keep`, and tries again the ones
/// of its trash. Returns what each delete did (errors included: one failed delete stops none of the
/// others).
pub fn apply_retention(
    coord: Arc<dyn Coordinator>,
    job: &str,
    keep: usize,
    timeouts: &Timeouts,
) -> Result<Vec<Result<Deleted, ClusterError>>, ClusterError> {
    let c = coord.as_ref();
    let mut out = Vec::new();
    for m in trash(c, Some(job))? {
        out.push(purge(Arc::clone(&coord), &m, timeouts));
    }
    let all = job::checkpoints(c, Some(job))?;
    let old = all.len().saturating_sub(keep);
    for m in &all[..old] {
        out.push(delete_job_checkpoint(Arc::clone(&coord), &m.id, timeouts));
    }
    Ok(out)
}

/// Periodic checkpoints of a job.
#[derive(Debug, Clone)]
pub struct PeriodicOptions {
    /// Each round's job checkpoint (`leave_running` is forced on: the job runs on between rounds).
    pub checkpoint: JobCheckpointOptions,
    /// From one round's start to the next's (a round that takes longer is followed at once).
    pub every: Duration,
    /// Keep the newest this many job checkpoints of the job (None: keep all).
    pub keep: Option<usize>,
}

/// What one round did, for the caller to report.
#[derive(Debug)]
pub enum Round {
    /// The round's job checkpoint, committed.
    Committed(JobManifest),
    /// The round's job checkpoint failed (undone as any failed job checkpoint); the next round runs.
    Failed(ClusterError),
    /// A retention delete (or its failure).
    Retention(Result<Deleted, ClusterError>),
}

/// Checkpoints the job every `opts.every`, applying retention after each round, until `stop` is set (a
/// round under way finishes, or aborts, first). A failed round is reported and the next one runs.
pub fn run_periodic(
    coord: Arc<dyn Coordinator>,
    opts: &PeriodicOptions,
    stop: &AtomicBool,
    report: &mut dyn FnMut(u64, Round),
) {
    let mut copts = opts.checkpoint.clone();
    copts.leave_running = true;
    let mut round = 0u64;
    while !stop.load(Ordering::SeqCst) {
        round += 1;
        let started = Instant::now();
        match checkpoint_job(Arc::clone(&coord), &copts) {
            Ok(m) => report(round, Round::Committed(m)),
            Err(e) => report(round, Round::Failed(e)),
        }
        if let Some(keep) = opts.keep {
            match apply_retention(Arc::clone(&coord), &copts.job, keep, &copts.timeouts) {
                Ok(all) => all
                    .into_iter()
                    .for_each(|d| report(round, Round::Retention(d))),
                Err(e) => report(round, Round::Retention(Err(e))),
            }
        }
        let next = started + opts.every;
        while !stop.load(Ordering::SeqCst) && Instant::now() < next {
            std::thread::sleep((next - Instant::now()).min(Duration::from_millis(100)));
        }
    }
}
