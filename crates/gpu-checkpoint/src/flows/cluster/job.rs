//! The coordinator's side of the cluster flow: `job checkpoint` (and, through `Op`, `job restore`,
//! in `job_restore.rs`) as two-phase operations over etcd (see `docs/cluster.md` for the protocol),
//! and the reads behind `job list` and `job status`.
//!
//! An operation lives under a lease of the coordinator's ([`LeaseGuard`]): should the coordinator die,
//! its operation, decision and tasks vanish and every agent undoes its part. It ends, whichever way, by
//! deleting what it wrote (the guard revokes the lease; `Op`'s drop deletes the members' states).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::coord::{Compare, Coordinator, TxnOp};
use super::lease::LeaseGuard;
use super::placement;
use super::records::{
    self as rec, decode, encode, encode_manifest, encode_task, MemberState, OpKind,
};
use super::timings::{Clock, EtcdTime};
use super::view::View;
use super::ClusterError;
use super::{AgentRecord, JobManifest, JobMember, JobTimings, MemberRecord, Task};
use crate::exit::ExitStatus;

/// The coordinator's timings and timeouts.
#[derive(Debug, Clone)]
pub struct Timeouts {
    /// The coordinator's lease: how long after its death the agents learn of it.
    pub lease_ttl: Duration,
    /// From the tasks going out until every member is locked (their GPU locks included).
    pub prepare: Duration,
    /// From `go` until every member's checkpoint is durable (or every member restored).
    pub work: Duration,
    /// After the decision, how long the members may take to say they finished or undid their part.
    pub release: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            lease_ttl: Duration::from_secs(5),
            prepare: Duration::from_secs(60),
            work: Duration::from_secs(3600),
            release: Duration::from_secs(60),
        }
    }
}

/// A job checkpoint's options.
#[derive(Debug, Clone, Default)]
pub struct JobCheckpointOptions {
    pub job: String,
    pub leave_running: bool,
    pub lock_timeout: Option<Duration>,
    pub quiesce: Option<String>,
    /// Lock the members one after the other in rank order (and restore the checkpoint so): jobs
    /// whose processes share CUDA IPC memory (driver r610 and later).
    pub ordered: bool,
    pub timeouts: Timeouts,
}

impl JobCheckpointOptions {
    /// Refuses names that no record may hold (the job's, the quiesce hook's): a usage error, before
    /// etcd is asked anything.
    pub fn check(&self) -> Result<(), ClusterError> {
        rec::check_name("job", &self.job).map_err(ClusterError::Usage)?;
        if let Some(hook) = &self.quiesce {
            rec::check_name("quiesce hook", hook).map_err(ClusterError::Usage)?;
        }
        Ok(())
    }
}

/// Registers (or replaces) a member of a job.
pub fn add_member(
    coord: &dyn Coordinator,
    job: &str,
    m: &MemberRecord,
) -> Result<(), ClusterError> {
    rec::check_name("job", job).map_err(ClusterError::Usage)?;
    rec::check_name("node", &m.node).map_err(ClusterError::Usage)?;
    if m.pid.is_none() == m.container.is_none() {
        return Err(ClusterError::Usage(
            "a member is a PID or a container, one of the two".into(),
        ));
    }
    coord.put(&rec::member(job, m.rank), &rec::encode_member(m), None)?;
    Ok(())
}

/// The members of `job`, by rank.
pub fn members(coord: &dyn Coordinator, job: &str) -> Result<Vec<MemberRecord>, ClusterError> {
    let (kvs, _) = coord.range(&rec::members(job))?;
    kvs.iter()
        .map(|kv| decode(&kv.key, &kv.value).map_err(Into::into))
        .collect()
}

/// Every job with members, and its members.
pub fn jobs(coord: &dyn Coordinator) -> Result<BTreeMap<String, Vec<MemberRecord>>, ClusterError> {
    let (kvs, _) = coord.range(&rec::jobs())?;
    let mut out: BTreeMap<String, Vec<MemberRecord>> = BTreeMap::new();
    for kv in kvs {
        let rest = &kv.key[rec::jobs().len()..];
        if let Some((job, _)) = rest.split_once("/members/") {
            out.entry(job.to_string())
                .or_default()
                .push(decode(&kv.key, &kv.value)?);
        }
    }
    Ok(out)
}

/// The agents registered now (their leases alive).
pub fn agents(coord: &dyn Coordinator) -> Result<Vec<AgentRecord>, ClusterError> {
    let (kvs, _) = coord.range(&rec::agents())?;
    kvs.iter()
        .map(|kv| decode(&kv.key, &kv.value).map_err(Into::into))
        .collect()
}

/// The committed job checkpoints (of `job`, or all), oldest first.
pub fn checkpoints(
    coord: &dyn Coordinator,
    job: Option<&str>,
) -> Result<Vec<JobManifest>, ClusterError> {
    manifests_under(coord, &rec::checkpoints(), job)
}

/// The job manifests under `prefix` (committed ones, or the trash), of `job` or all, oldest first.
pub(super) fn manifests_under(
    coord: &dyn Coordinator,
    prefix: &str,
    job: Option<&str>,
) -> Result<Vec<JobManifest>, ClusterError> {
    let (kvs, _) = coord.range(prefix)?;
    let mut all: Vec<JobManifest> = kvs
        .iter()
        .map(|kv| decode::<JobManifest>(&kv.key, &kv.value))
        .collect::<Result<_, _>>()?;
    all.retain(|m| job.is_none_or(|j| m.job == j));
    all.sort_by_key(|m| m.cut.committed_unix_ms);
    Ok(all)
}

/// One committed job checkpoint.
pub fn checkpoint(coord: &dyn Coordinator, id: &str) -> Result<JobManifest, ClusterError> {
    rec::check_name("job checkpoint", id).map_err(ClusterError::Usage)?;
    let kv = coord
        .get(&rec::checkpoint(id))?
        .ok_or_else(|| ClusterError::NotFound { id: id.into() })?;
    let m: JobManifest = decode(&kv.key, &kv.value)?;
    // What a restore or delete sends to agents comes from here: a record that names another job
    // checkpoint, a node or a checkpoint id this tool would not write is refused, not passed on.
    m.check(id)
        .map_err(|why| ClusterError::Damaged { id: id.into(), why })?;
    Ok(m)
}

/// The operations running now (their coordinators alive).
pub fn running(coord: &dyn Coordinator) -> Result<Vec<rec::OpRecord>, ClusterError> {
    let (kvs, _) = coord.range(&format!("{}ops/", rec::ROOT))?;
    kvs.iter()
        .filter(|kv| kv.key.ends_with("/op"))
        .map(|kv| decode(&kv.key, &kv.value).map_err(Into::into))
        .collect()
}

/// What a member's state means at one step of an operation.
pub(super) enum Verdict {
    Done,
    Pending,
    Fail(Cause),
}

/// Why an operation aborts, and the exit class of the member failure that made it (absent: the
/// operation's own failure, such as a timeout or a lost agent).
#[derive(Debug)]
pub(super) struct Cause {
    pub(super) why: String,
    pub(super) exit: Option<ExitStatus>,
}

impl From<String> for Cause {
    fn from(why: String) -> Cause {
        Cause { why, exit: None }
    }
}

impl Cause {
    /// A member's `failed` state: its error and its exit code, as its agent wrote them.
    pub(super) fn failed(error: &str, exit: Option<i32>) -> Cause {
        Cause {
            why: error.to_string(),
            exit: exit.and_then(ExitStatus::from_code),
        }
    }
}

/// One operation of the coordinator's: its id, its members (on the nodes that run them), its lease.
pub(super) struct Op<'a> {
    coord: &'a dyn Coordinator,
    pub(super) id: String,
    members: Vec<MemberRecord>,
    lease: LeaseGuard,
    /// Time spent in etcd requests: the protocol's own round trips.
    etcd_ms: EtcdTime,
    /// The members' states and agents, read at the first wait and kept current by its watches.
    view: std::cell::RefCell<Option<View<'a>>>,
}

impl<'a> Op<'a> {
    pub(super) fn etcd<T>(&self, f: impl FnOnce() -> T) -> T {
        self.etcd_ms.time(f)
    }

    /// Starts the operation: its record and every member's task, in one transaction, under the lease.
    pub(super) fn start(
        coord: &'a dyn Coordinator,
        shared: Arc<dyn Coordinator>,
        record: rec::OpRecord,
        tasks: Vec<Task>,
        ttl: Duration,
    ) -> Result<Op<'a>, ClusterError> {
        let lease = LeaseGuard::grant(shared, ttl)?;
        let mut then = vec![TxnOp::Put {
            key: rec::op(&record.id),
            value: encode(&record),
            lease: Some(lease.id()),
        }];
        for t in &tasks {
            then.push(TxnOp::Put {
                key: rec::task(&t.member.node, &t.op, t.member.rank),
                value: encode_task(t),
                lease: Some(lease.id()),
            });
        }
        let fresh = [
            Compare::Missing(rec::op(&record.id)),
            Compare::Missing(rec::checkpoint(&record.id)),
        ];
        if !coord.txn(&fresh, &then)? {
            return Err(ClusterError::Busy {
                what: format!("operation {} exists already", record.id),
            });
        }
        Ok(Op {
            coord,
            id: record.id,
            members: record.members,
            lease,
            etcd_ms: Default::default(),
            view: Default::default(),
        })
    }

    /// Waits until `judge` says every member is done, one fails, or `limit` passes.
    pub(super) fn wait_all(
        &self,
        phase: &str,
        limit: Duration,
        judge: impl Fn(Option<&MemberState>, bool) -> Verdict,
    ) -> Result<BTreeMap<u32, MemberState>, Cause> {
        let deadline = Instant::now() + limit;
        // One view for the operation's life: later phases go on watching from where the last stopped.
        let mut slot = self.view.borrow_mut();
        if slot.is_none() {
            let read = self.etcd(|| View::read(self.coord, &self.id));
            *slot = Some(read.map_err(|e| e.to_string())?);
        }
        let view = slot.as_mut().expect("read above");
        loop {
            if self.lease.lost() {
                return Err(Cause::from(
                    "the coordinator's etcd lease expired".to_string(),
                ));
            }
            let by_rank = view.by_rank();
            let mut pending = Vec::new();
            for m in &self.members {
                match judge(by_rank.get(&m.rank), view.alive(&m.node)) {
                    Verdict::Done => {}
                    Verdict::Pending => pending.push(m.rank),
                    Verdict::Fail(c) => {
                        return Err(Cause {
                            why: format!("rank {} on node {}: {}", m.rank, m.node, c.why),
                            exit: c.exit,
                        })
                    }
                }
            }
            if pending.is_empty() {
                view.arrived(self.members.iter().map(|m| m.rank).collect());
                return Ok(by_rank);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Cause::from(format!(
                    "timed out after {limit:?} waiting for ranks {pending:?} to {phase}"
                )));
            }
            let wait = (deadline - now).min(Duration::from_secs(1));
            // Not counted as etcd time: waiting here is waiting for the members. One watch of the root
            // sees both the members' states and the agents' registrations.
            view.next(wait).map_err(|e| Cause::from(e.to_string()))?;
        }
    }

    /// Waits (up to `limit`) until every member has finished its part after the decision (done or
    /// failed), or its agent is gone: a member left by a dead agent is not waited for.
    pub(super) fn wait_finished(
        &self,
        phase: &str,
        limit: Duration,
    ) -> Result<BTreeMap<u32, MemberState>, Cause> {
        self.wait_all(phase, limit, |s, alive| match s {
            Some(MemberState::Done { .. } | MemberState::Failed { .. }) => Verdict::Done,
            _ if !alive => Verdict::Done,
            _ => Verdict::Pending,
        })
    }

    /// The operation's timings, ended now.
    pub(super) fn timings(&self, clock: Clock) -> JobTimings {
        let view = self.view.borrow();
        let barriers = view.as_ref().map_or((0.0, 0.0), |v| (v.skew_ms, v.wake_ms));
        clock.finish(&self.etcd_ms, barriers)
    }

    pub(super) fn decide(&self, decision: &str) -> Result<(), ClusterError> {
        self.etcd(|| {
            self.coord.put(
                &rec::decision(&self.id),
                decision.as_bytes(),
                Some(self.lease.id()),
            )
        })?;
        Ok(())
    }

    /// Tells every member to undo its part, waits (up to `limit`) until each did or is gone, and
    /// returns the error naming the reason and each member's outcome.
    pub(super) fn abort(&self, cause: impl Into<Cause>, limit: Duration) -> ClusterError {
        let Cause { why: reason, exit } = cause.into();
        tracing::warn!("job operation {} aborts: {reason}", self.id);
        if let Err(e) = self.decide("abort") {
            // The agents see the operation vanish with the lease instead.
            tracing::warn!("writing the abort: {e}");
        }
        let outcome = self.wait_all("undo their part", limit, |s, alive| match s {
            Some(MemberState::Aborted | MemberState::Failed { .. }) => Verdict::Done,
            // A dead agent's guardian undoes its member's checkpoint.
            _ if !alive => Verdict::Done,
            None if self.lease.lost() => Verdict::Done,
            _ => Verdict::Pending,
        });
        let undone = match outcome {
            Ok(states) => self
                .members
                .iter()
                .map(|m| {
                    let s = match states.get(&m.rank) {
                        Some(MemberState::Failed { error, .. }) => format!("failed: {error}"),
                        Some(MemberState::Aborted) => "undone".into(),
                        _ => "agent gone (its guardian undoes)".into(),
                    };
                    format!("rank {} on {}: {s}", m.rank, m.node)
                })
                .collect(),
            Err(e) => vec![format!("not every member confirmed its undo: {}", e.why)],
        };
        ClusterError::Aborted {
            id: self.id.clone(),
            reason,
            members: undone,
            exit,
        }
    }
}

impl Drop for Op<'_> {
    fn drop(&mut self) {
        // The members' states (under their agents' leases) go with the operation; the rest of its keys
        // go with the lease, when the guard drops after this.
        if let Err(e) = self.coord.delete_prefix(&rec::op_prefix(&self.id)) {
            tracing::warn!("removing operation {}'s keys: {e}", self.id);
        }
    }
}

/// Checks that every member has an agent, and that no operation on the job runs; returns the agents.
fn preflight(
    coord: &dyn Coordinator,
    job: &str,
    targets: &[MemberRecord],
) -> Result<Vec<AgentRecord>, ClusterError> {
    let alive = agents(coord)?;
    preflight_with(coord, job, targets, &alive)?;
    Ok(alive)
}

/// [`preflight`] with the agents read already.
pub(super) fn preflight_with(
    coord: &dyn Coordinator,
    job: &str,
    targets: &[MemberRecord],
    alive: &[AgentRecord],
) -> Result<(), ClusterError> {
    for m in targets {
        if !alive.iter().any(|a| a.node == m.node) {
            return Err(ClusterError::NoAgent {
                node: m.node.clone(),
            });
        }
    }
    if let Some(op) = running(coord)?.into_iter().find(|o| o.job == job) {
        return Err(ClusterError::Busy {
            what: format!("job {job} is in operation {} already", op.id),
        });
    }
    Ok(())
}

/// A consistent checkpoint of every member of `opts.job`; see the module documentation.
pub fn checkpoint_job(
    coord: Arc<dyn Coordinator>,
    opts: &JobCheckpointOptions,
) -> Result<JobManifest, ClusterError> {
    let mut clock = Clock::start();
    let started_unix_ms = rec::now_ms();
    let c = coord.as_ref();
    let job = &opts.job;
    opts.check()?;
    let members = members(c, job)?;
    if members.is_empty() {
        return Err(ClusterError::Usage(format!(
            "job {job} has no members: register them with `gpu-checkpoint job add`"
        )));
    }
    let alive = preflight(c, job, &members)?;
    // A member registered as sharing CUDA IPC memory (`job add --ordered`) makes every checkpoint of
    // the job ordered, asked for or not: out of order its locks could hang on memory another holds.
    let ordered = opts.ordered || members.iter().any(|m| m.ordered);
    let id = format!("{job}-{started_unix_ms}");
    let tasks = members
        .iter()
        .map(|m| Task {
            leave_running: opts.leave_running,
            lock_timeout_ms: opts.lock_timeout.map(|d| d.as_millis() as u64),
            quiesce: opts.quiesce.clone(),
            after: before(&members, m.rank, ordered),
            ..Task::checkpoint(&id, job, m.clone())
        })
        .collect();
    let record = rec::OpRecord {
        id: id.clone(),
        job: job.clone(),
        kind: OpKind::Checkpoint,
        members: members.clone(),
        started_unix_ms,
        ordered,
    };
    let t = &opts.timeouts;
    let op = Op::start(c, Arc::clone(&coord), record, tasks, t.lease_ttl)?;
    clock.sent_unix_ms = rec::now_ms();
    crate::fault::at("cluster.prepare");

    // 1. Prepare: every member locked.
    clock.phase();
    let gone = |alive: bool| (!alive).then(|| "its agent is gone (lease expired)".to_string());
    op.wait_all("lock", t.prepare, |s, alive| match (s, gone(alive)) {
        (Some(MemberState::Failed { error, exit }), _) => {
            Verdict::Fail(Cause::failed(error, *exit))
        }
        (Some(MemberState::Aborted), _) => Verdict::Fail(Cause::from("aborted".to_string())),
        (_, Some(why)) => Verdict::Fail(Cause::from(why)),
        (Some(MemberState::Locked), _) => Verdict::Done,
        _ => Verdict::Pending,
    })
    .map_err(|why| op.abort(why, t.release))?;
    clock.timings.prepare = clock.lap();
    let locked_unix_ms = rec::now_ms();

    // 2. Every member locked: go.
    clock.phase();
    op.decide("go")
        .map_err(|e| op.abort(e.to_string(), t.release))?;
    clock.go_unix_ms = rec::now_ms();
    let states = op
        .wait_all("store their checkpoint", t.work, |s, alive| {
            match (s, gone(alive)) {
                (Some(MemberState::Failed { error, exit }), _) => {
                    Verdict::Fail(Cause::failed(error, *exit))
                }
                (Some(MemberState::Aborted), _) => {
                    Verdict::Fail(Cause::from("aborted".to_string()))
                }
                (_, Some(why)) => Verdict::Fail(Cause::from(why)),
                (Some(MemberState::Durable { .. }), _) => Verdict::Done,
                _ => Verdict::Pending,
            }
        })
        .map_err(|why| op.abort(why, t.release))?;
    clock.timings.checkpoint = clock.lap();

    // 3. Commit: the manifest and the decision in one transaction, only while the operation (the
    // coordinator's lease) is alive; a coordinator that lost its lease cannot commit what the agents
    // are undoing.
    clock.phase();
    let mut manifest = JobManifest {
        id: id.clone(),
        job: job.clone(),
        leave_running: opts.leave_running,
        ordered,
        members: members
            .iter()
            .map(|m| {
                let (checkpoint, gpus) = match states.get(&m.rank) {
                    Some(MemberState::Durable { checkpoint, gpus }) => {
                        (checkpoint.clone(), gpus.clone())
                    }
                    _ => unreachable!("wait_all returned every member durable"),
                };
                // What a restore elsewhere chooses a node by: the GPUs' models and the store.
                let agent = alive.iter().find(|a| a.node == m.node);
                let gpu_models = agent
                    .map(|a| placement::models_of(&gpus, &a.gpus))
                    .unwrap_or_default();
                JobMember {
                    rank: m.rank,
                    node: m.node.clone(),
                    pid: m.pid,
                    checkpoint,
                    gpus,
                    gpu_models,
                    storage: agent.map(|a| a.storage.clone()),
                }
            })
            .collect(),
        cut: rec::Cut {
            started_unix_ms,
            locked_unix_ms,
            committed_unix_ms: rec::now_ms(),
        },
        timings_ms: clock.timings.clone(),
    };
    crate::fault::at("cluster.before-commit");
    let committed = op.etcd(|| {
        c.txn(
            &[
                Compare::Exists(rec::op(&id)),
                Compare::Missing(rec::checkpoint(&id)),
            ],
            &[
                TxnOp::Put {
                    key: rec::checkpoint(&id),
                    value: encode_manifest(&manifest),
                    lease: None,
                },
                TxnOp::Put {
                    key: rec::decision(&id),
                    value: b"commit".to_vec(),
                    lease: Some(op.lease.id()),
                },
            ],
        )
    });
    match committed {
        Ok(true) => clock.commit_unix_ms = rec::now_ms(),
        Ok(false) => {
            return Err(op.abort(
                "the coordinator's lease expired before the commit".to_string(),
                t.release,
            ))
        }
        // Unknown: the transaction may have applied. The agents decide from the manifest's key.
        Err(e) => return Err(op.abort(format!("the commit failed: {e}"), t.release)),
    }
    clock.timings.commit = clock.lap();
    crate::fault::at("cluster.after-commit");

    // 4. Committed: the members stop their trees (or leave them running) and keep the manifest.
    clock.phase();
    match op.wait_finished("finish", t.release) {
        Ok(states) => clock.members_done(&states),
        Err(e) => tracing::warn!("job checkpoint {id} is committed, but: {}", e.why),
    }
    clock.timings.release = clock.lap();
    manifest.timings_ms = op.timings(clock);
    // The final timings, for `job status` (the committed record had them up to the commit).
    if let Err(e) = c.put(&rec::checkpoint(&id), &encode_manifest(&manifest), None) {
        tracing::warn!("recording job checkpoint {id}'s timings: {e}");
    }
    Ok(manifest)
}

/// In an ordered operation, the rank `rank` waits for: the next lower one among `members`.
pub(super) fn before(members: &[MemberRecord], rank: u32, ordered: bool) -> Option<u32> {
    let lower = members.iter().map(|m| m.rank).filter(|&r| r < rank);
    lower.max().filter(|_| ordered)
}
