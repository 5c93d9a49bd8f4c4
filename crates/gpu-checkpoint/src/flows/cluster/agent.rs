//! The agent's side of the cluster flow: one per node, registered in etcd under a lease, carrying out
//! the tasks coordinators give its node (a member's checkpoint or restore), each in a thread of its own
//! so that the members of one node lock together.
//!
//! What a member does on its node is the [`MemberWork`] the caller gives ([`super::LocalWork`]: the
//! node's checks, its quiesce hook, the checkpoint and restore flows with CRIU, the GPU hook and the
//! store); this module only speaks the protocol: it checks each task record it reads (a bad one is
//! logged and skipped, or reported failed), writes the member's state, and waits at the barriers for the
//! coordinator's decision (`AgentPhases`). Everything read from etcd is untrusted input.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::coord::{Compare, CoordError, Coordinator, Revision, TxnOp};
use super::follow::OpView;
use super::lease::LeaseGuard;
use super::member_error::MemberError;
use super::records::{self as rec, decode, encode, MemberState, OpKind, StateRecord, Task};
use super::{AgentRecord, ClusterError, JobManifest};
use crate::exit::Classify;
use crate::flows::{NotCommitted, Phases};
use crate::freeze::BeforeUnlock;
use crate::validate::printable;

/// What a member's part of an operation does on this node. Each call decides first whether the node
/// allows it (a member registered here, a checkpoint made for the job): the task comes from etcd.
pub trait MemberWork: Sync {
    /// Checkpoints the member's tree (after the job's quiesce hook), waiting at `phases`' barriers;
    /// returns once the job committed and the tree is stopped (or left running). On error everything is
    /// undone.
    fn checkpoint(&self, task: &Task, phases: &dyn Phases) -> Result<(), MemberError>;
    /// The GPUs (UUIDs) the member checkpoint `id` holds state of, for the job manifest.
    fn gpus(&self, id: &str) -> Vec<String>;
    /// Restores the member checkpoint `task.checkpoint`, GPU state included, waiting at `before_unlock`
    /// (given the root PID) once the GPU state is back and before it is unlocked; returns the root PID
    /// once unlocked. When `before_unlock` says no (the job's restore aborted), or anything fails, the
    /// restored copy is killed, never unlocked, and the checkpoint kept.
    fn restore(&self, task: &Task, before_unlock: &BeforeUnlock<'_>) -> Result<i32, MemberError>;
    /// Keeps the committed job manifest in this node's store.
    fn keep_manifest(&self, manifest: &JobManifest) -> Result<(), MemberError>;
    /// Deletes member checkpoint `task.checkpoint` and this node's copy of job checkpoint
    /// `task.job_checkpoint`'s manifest (retention, `job delete`); one already gone is no error.
    fn delete(&self, task: &Task) -> Result<(), MemberError>;
}

/// The agent's options.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub node: String,
    pub storage: String,
    /// The agent's lease: how long after its death coordinators learn of it.
    pub lease_ttl: Duration,
    /// How long a member waits at a barrier for the coordinator's decision (its death is seen sooner,
    /// through its lease).
    pub decision_timeout: Duration,
    /// The node's GPUs, registered with the agent: a job restore chooses a node for the members of a
    /// node that has no agent by them.
    pub gpus: Vec<crate::freeze::GpuInfo>,
}

impl AgentOptions {
    pub fn new(node: &str, storage: &str) -> Self {
        AgentOptions {
            node: node.into(),
            storage: storage.into(),
            lease_ttl: Duration::from_secs(5),
            decision_timeout: Duration::from_secs(3600),
            gpus: Vec::new(),
        }
    }
}

/// Registers the agent and serves its node's tasks until `stop` is set. Tasks under way when `stop`
/// comes are finished (or undone) first. A lost lease (the node cut off from etcd for longer than its
/// TTL: coordinators have aborted what it was doing) ends the tasks under way as they end on their own
/// (undone, or kept in doubt until etcd answers), then the agent registers again under a new lease
/// once etcd answers: a node whose link comes back takes part in the next job operation without a
/// restart. Another agent registered for the node meanwhile ends it (`Busy`).
pub fn run_agent(
    coord: Arc<dyn Coordinator>,
    opts: &AgentOptions,
    work: &dyn MemberWork,
    stop: &AtomicBool,
) -> Result<(), ClusterError> {
    rec::check_name("node", &opts.node).map_err(ClusterError::Usage)?;
    // Tasks already taken up stay taken up across registrations (their operations' keys may remain).
    let mut seen = HashSet::new();
    let mut lease = register(&coord, opts)?;
    loop {
        match serve(&coord, opts, work, stop, &lease, &mut seen) {
            Err(ClusterError::Coord(super::CoordError::LeaseLost(id))) => {
                tracing::warn!(
                    "agent for node {}: lease {id:x} lost; registering again",
                    opts.node
                );
                lease.abandon();
                lease = loop {
                    if stop.load(Ordering::SeqCst) {
                        return Ok(());
                    }
                    match register(&coord, opts) {
                        Ok(l) => break l,
                        Err(e @ ClusterError::Busy { .. }) => return Err(e),
                        Err(e) => {
                            tracing::warn!("registering node {} again: {e}", opts.node);
                            std::thread::sleep(Duration::from_millis(500));
                        }
                    }
                };
            }
            other => return other,
        }
    }
}

/// Puts the agent's record under a new lease, if no agent is registered for its node.
fn register(coord: &Arc<dyn Coordinator>, opts: &AgentOptions) -> Result<LeaseGuard, ClusterError> {
    let c = coord.as_ref();
    let lease = LeaseGuard::grant(Arc::clone(coord), opts.lease_ttl)?;
    let record = AgentRecord {
        node: opts.node.clone(),
        pid: std::process::id(),
        storage: opts.storage.clone(),
        tool_version: env!("CARGO_PKG_VERSION").into(),
        started_unix_ms: rec::now_ms(),
        gpus: opts.gpus.clone(),
    };
    let key = rec::agent(&opts.node);
    let registered = c.txn(
        &[Compare::Missing(key.clone())],
        &[TxnOp::Put {
            key: key.clone(),
            value: encode(&record),
            lease: Some(lease.id()),
        }],
    )?;
    if !registered {
        return Err(ClusterError::Busy {
            what: format!("an agent for node {} is registered already", opts.node),
        });
    }
    tracing::info!(
        "agent for node {} registered (lease {:x})",
        opts.node,
        lease.id()
    );
    Ok(lease)
}

/// Serves the node's tasks under `lease` until `stop` is set or the lease is lost (returned as
/// `LeaseLost` once every task under way has ended).
fn serve(
    coord: &Arc<dyn Coordinator>,
    opts: &AgentOptions,
    work: &dyn MemberWork,
    stop: &AtomicBool,
    lease: &LeaseGuard,
    seen: &mut HashSet<String>,
) -> Result<(), ClusterError> {
    let c = coord.as_ref();
    let prefix = rec::tasks(&opts.node);
    std::thread::scope(|scope| {
        // etcd may fail a request now and then (a member restarting, a loaded machine): the agent logs
        // it and reads its tasks again rather than dying, as long as its lease lives.
        let mut rev = 0;
        let mut resync = true;
        // One watch of the node's tasks, open while it works: a task arrives in its events, where a
        // watch opened again every half second had a gap (its opening's round trip) each time.
        let mut tasks: Option<Box<dyn super::WatchStream + '_>> = None;
        // Each task's key, value and revision (that of its operation's creation).
        let mut fresh: Vec<(String, Vec<u8>, Revision)> = Vec::new();
        loop {
            if resync {
                match c.range(&prefix) {
                    Ok((kvs, r)) => {
                        rev = r;
                        let kvs = kvs.into_iter();
                        fresh.extend(kvs.map(|kv| (kv.key, kv.value, kv.mod_revision)));
                        resync = false;
                        tasks = None;
                    }
                    Err(e) => {
                        tracing::warn!("reading this node's tasks: {e}");
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            }
            for (key, value, created) in fresh.drain(..) {
                if !seen.insert(key.clone()) {
                    continue;
                }
                let task: Task = match decode(&key, &value) {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::error!("skipped: {}", printable(&e.to_string()));
                        continue;
                    }
                };
                if let Err(why) = task.check(&key, &opts.node) {
                    tracing::error!("task {} skipped: {}", printable(&key), printable(&why));
                    // A task of a real operation is answered, so that its coordinator aborts at once
                    // rather than at its timeout; its key named this node and was checked.
                    if rec::check_name("operation", &task.op).is_ok()
                        && key == rec::task(&opts.node, &task.op, task.member.rank)
                    {
                        let failed = MemberState::Failed {
                            error: format!("node {}'s agent refused the task: {why}", opts.node),
                            exit: Some(crate::exit::ExitStatus::Usage as i32),
                        };
                        let r = StateRecord {
                            rank: task.member.rank,
                            node: opts.node.clone(),
                            state: failed,
                            at_unix_ms: rec::now_ms(),
                        };
                        let state = rec::state(&task.op, task.member.rank);
                        if let Err(e) = c.put(&state, &encode(&r), Some(lease.id())) {
                            tracing::warn!("writing {state}: {e}");
                        }
                    }
                    continue;
                }
                let member = Member {
                    coord: c,
                    view: std::sync::Mutex::new(OpView::at_start(c, &task.op, created)),
                    task,
                    node: opts.node.clone(),
                    lease: lease.id(),
                    timeout: opts.decision_timeout,
                    aborted: AtomicBool::new(false),
                    in_doubt: AtomicBool::new(false),
                    durable_id: Default::default(),
                    stop,
                    waited_us: Default::default(),
                    etcd_us: Default::default(),
                    picked_up_unix_ms: rec::now_ms(),
                    saw_go_unix_ms: Default::default(),
                    saw_commit_unix_ms: Default::default(),
                };
                scope.spawn(move || member.run(work));
            }
            if stop.load(Ordering::SeqCst) {
                return Ok(());
            }
            if lease.lost() {
                return Err(ClusterError::Coord(super::CoordError::LeaseLost(
                    lease.id(),
                )));
            }
            if resync {
                continue;
            }
            let open = match tasks.take() {
                Some(stream) => Ok(stream),
                None => c.watch_stream(&prefix, rev),
            };
            let next = open.and_then(|mut stream| {
                let events = stream.next(Duration::from_millis(500));
                tasks = Some(stream);
                events
            });
            match next {
                Ok(events) => {
                    for e in events {
                        rev = rev.max(e.revision());
                        if let super::Event::Put(kv) = e {
                            fresh.push((kv.key, kv.value, kv.mod_revision));
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!("watching this node's tasks: {e}");
                    resync = true;
                    tasks = None;
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    })
}

/// The coordinator's decision, as a member sees it.
enum Decision {
    Go,
    Commit,
    Abort(String),
    /// etcd cannot be reached: the decision cannot be learnt.
    Unreachable(String),
}

/// One member's task on this node.
struct Member<'c> {
    coord: &'c dyn Coordinator,
    /// The operation as this member knows it: one watch for the member's whole part.
    view: std::sync::Mutex<OpView<'c>>,
    task: Task,
    node: String,
    lease: super::LeaseId,
    timeout: Duration,
    /// The job aborted (rather than this member failing on its own).
    aborted: AtomicBool,
    /// Durable, and then etcd out of reach: the member checkpoint is kept (see `NotCommitted`).
    in_doubt: AtomicBool,
    /// The member checkpoint, once durable.
    durable_id: std::sync::Mutex<Option<String>>,
    /// The agent is stopping.
    stop: &'c AtomicBool,
    /// Time spent waiting at the barriers, in microseconds.
    waited_us: std::sync::atomic::AtomicU64,
    /// Time spent writing this member's states to etcd, in microseconds (its reads of the decision are
    /// inside `waited_us`).
    etcd_us: std::sync::atomic::AtomicU64,
    /// When (ms since the epoch) the agent picked the task up, and the member learnt of `go` and of
    /// `commit` (0: not yet): reported in `done`, for the coordinator's breakdown.
    picked_up_unix_ms: u64,
    saw_go_unix_ms: std::sync::atomic::AtomicU64,
    saw_commit_unix_ms: std::sync::atomic::AtomicU64,
}

impl Member<'_> {
    /// Runs one etcd request, its time counted in `etcd_us`.
    fn etcd<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.etcd_us
            .fetch_add(t.elapsed().as_micros() as u64, Ordering::SeqCst);
        r
    }

    fn say(&self, state: MemberState) {
        let r = StateRecord {
            rank: self.task.member.rank,
            node: self.node.clone(),
            state,
            at_unix_ms: rec::now_ms(),
        };
        let key = rec::state(&self.task.op, self.task.member.rank);
        if let Err(e) = self.etcd(|| self.coord.put(&key, &encode(&r), Some(self.lease))) {
            tracing::error!("writing {key}: {e}");
        }
    }

    /// Waits until the decision is `want` (or a later one), or the job aborted.
    fn wait(&self, want: &str) -> Decision {
        let t = Instant::now();
        let d = self.wait_untimed(want);
        let seen = match d {
            Decision::Go => Some(&self.saw_go_unix_ms),
            Decision::Commit => Some(&self.saw_commit_unix_ms),
            _ => None,
        };
        if let Some(seen) = seen {
            let _ = seen.compare_exchange(0, rec::now_ms(), Ordering::SeqCst, Ordering::SeqCst);
        }
        self.waited_us
            .fetch_add(t.elapsed().as_micros() as u64, Ordering::SeqCst);
        d
    }

    fn wait_untimed(&self, want: &str) -> Decision {
        let deadline = Instant::now() + self.timeout;
        let abort = |why: String| {
            self.aborted.store(true, Ordering::SeqCst);
            Decision::Abort(why)
        };
        // Not an abort by itself: before this member is durable no commit can name it (the caller
        // aborts), after it the job may have committed meanwhile (the caller is in doubt).
        let unreachable = |e: CoordError| {
            self.aborted.store(true, Ordering::SeqCst);
            Decision::Unreachable(format!("etcd: {e}"))
        };
        let mut view = self.view.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match view.decision.as_deref() {
                Some(b"abort") => {
                    return abort("the coordinator aborted the job's operation".into())
                }
                Some(b"commit") => return Decision::Commit,
                Some(b"go") if want == "go" => return Decision::Go,
                _ => {}
            }
            if !view.exists {
                // The operation is gone: its coordinator ended it, or died. A commit survives both.
                return match self.coord.get(&rec::checkpoint(&self.task.op)) {
                    Ok(Some(_)) if self.task.kind == OpKind::Checkpoint => Decision::Commit,
                    Ok(_) => abort("the coordinator is gone (its lease expired)".into()),
                    Err(e) => unreachable(e),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                return abort(format!(
                    "no decision from the coordinator in {:?}",
                    self.timeout
                ));
            }
            // The decision comes in the watch's events; wake-ups with only other members' states
            // cost no request.
            if let Err(e) = view.next((deadline - now).min(Duration::from_secs(1))) {
                return unreachable(e);
            }
        }
    }

    /// An ordered operation (`task.after`): waits until that rank's state is one `ready` accepts. An
    /// abort, that rank failing, etcd out of reach or the decision timeout end the wait with the
    /// reason.
    fn wait_turn(&self, ready: impl Fn(&MemberState) -> bool) -> Result<(), String> {
        let Some(prev) = self.task.after else {
            return Ok(());
        };
        let t = Instant::now();
        let deadline = t + self.timeout;
        let mut view = self.view.lock().unwrap_or_else(|p| p.into_inner());
        let result = loop {
            if view.decision.as_deref() == Some(b"abort") {
                break Err("the coordinator aborted the job's operation".into());
            }
            if !view.exists {
                break Err("the coordinator is gone (its lease expired)".into());
            }
            match view.state(prev) {
                Some(s) if ready(s) => break Ok(()),
                Some(MemberState::Failed { .. } | MemberState::Aborted) => {
                    break Err(format!("rank {prev}, before this one, failed"))
                }
                _ => {}
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(format!("rank {prev} was not ready in {:?}", self.timeout));
            }
            if let Err(e) = view.next((deadline - now).min(Duration::from_secs(1))) {
                break Err(format!("etcd: {e}"));
            }
        };
        drop(view);
        self.waited_us
            .fetch_add(t.elapsed().as_micros() as u64, Ordering::SeqCst);
        if result.is_err() {
            self.aborted.store(true, Ordering::SeqCst);
        }
        result
    }

    fn run(&self, work: &dyn MemberWork) {
        let rank = self.task.member.rank;
        tracing::info!(
            "{:?} of job {} (operation {}), rank {rank}",
            self.task.kind,
            self.task.job,
            self.task.op
        );
        match self.task.kind {
            OpKind::Checkpoint => self.checkpoint(work),
            OpKind::Restore => self.restore(work),
            OpKind::Delete => {
                let started = Instant::now();
                match work.delete(&self.task) {
                    Ok(()) => self.say(self.done(started)),
                    Err(e) => self.failed(&e),
                }
            }
        }
    }

    fn checkpoint(&self, work: &dyn MemberWork) {
        // Ordered: this member locks only once the rank before it is locked.
        let locked = |s: &MemberState| {
            matches!(
                s,
                MemberState::Locked | MemberState::Durable { .. } | MemberState::Done { .. }
            )
        };
        if let Err(why) = self.wait_turn(locked) {
            tracing::warn!("job checkpoint aborted before this member's turn: {why}");
            self.say(MemberState::Aborted);
            return;
        }
        let phases = AgentPhases { member: self, work };
        let started = Instant::now();
        match work.checkpoint(&self.task, &phases) {
            Ok(()) => {
                let kept = match self.etcd(|| self.coord.get(&rec::checkpoint(&self.task.op))) {
                    Ok(Some(kv)) => self.keep_manifest(work, &kv.key, &kv.value),
                    Ok(None) => Err("the job manifest is not in etcd".into()),
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = kept {
                    tracing::warn!("keeping job checkpoint {}'s manifest: {e}", self.task.op);
                }
                self.say(self.done(started));
            }
            Err(e) if self.in_doubt.load(Ordering::SeqCst) => {
                self.failed(&e);
                self.resolve_in_doubt(work);
            }
            Err(_) if self.aborted.load(Ordering::SeqCst) => self.say(MemberState::Aborted),
            Err(e) => self.failed(&e),
        }
    }

    /// Reports this member failed, with its error's exit class.
    fn failed(&self, e: &MemberError) {
        tracing::error!("rank {}: {e}", self.task.member.rank);
        self.say(MemberState::Failed {
            error: e.to_string(),
            exit: Some(e.exit_status() as i32),
        });
    }

    /// Keeps job manifest `bytes` (read at `key`) in this node's store, if it is the manifest of this
    /// member's operation: the record's own id is never trusted to name a file.
    fn keep_manifest(&self, work: &dyn MemberWork, key: &str, bytes: &[u8]) -> Result<(), String> {
        let m = decode::<JobManifest>(key, bytes).map_err(|e| printable(&e.to_string()))?;
        if m.id != self.task.op {
            return Err(format!(
                "the manifest at {} names job checkpoint {:?}, not {}",
                printable(key),
                printable(&m.id),
                self.task.op
            ));
        }
        work.keep_manifest(&m).map_err(|e| e.to_string())
    }

    /// In doubt (durable, then etcd out of reach): once etcd answers again, learns the job's outcome
    /// and finishes as it would have: a committed job keeps the member checkpoint (and a copy of its
    /// manifest), an aborted one deletes it. The operation's record goes before a commit can be
    /// written no more (the commit's transaction needs it), so it is read first: gone, with no
    /// manifest after it, means aborted for good. Gives up, keeping the checkpoint, when the agent
    /// stops or after the decision timeout.
    fn resolve_in_doubt(&self, work: &dyn MemberWork) {
        let Some(id) = self
            .durable_id
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        else {
            return;
        };
        let op = &self.task.op;
        let deadline = Instant::now() + self.timeout;
        while !self.stop.load(Ordering::SeqCst) && Instant::now() < deadline {
            let read = self.coord.get(&rec::op(op)).and_then(|o| {
                let manifest = self.coord.get(&rec::checkpoint(op))?;
                Ok((o.is_none(), manifest))
            });
            match read {
                Ok((_, Some(kv))) => {
                    let kept = self.keep_manifest(work, &kv.key, &kv.value);
                    tracing::info!("job checkpoint {op} is committed: member checkpoint {id} kept");
                    if let Err(e) = kept {
                        tracing::warn!("keeping job checkpoint {op}'s manifest: {e}");
                    }
                    return;
                }
                Ok((true, None)) => {
                    let task = Task {
                        checkpoint: Some(id.clone()),
                        job_checkpoint: None,
                        ..self.task.clone()
                    };
                    match work.delete(&task) {
                        Ok(()) => tracing::info!(
                            "job checkpoint {op} aborted: member checkpoint {id} deleted"
                        ),
                        Err(e) => tracing::error!("deleting member checkpoint {id}: {e}"),
                    }
                    return;
                }
                // Undecided (its coordinator lives on), or etcd still out of reach.
                Ok((false, None)) | Err(_) => std::thread::sleep(Duration::from_secs(1)),
            }
        }
        tracing::warn!("job checkpoint {op}: outcome still unknown, member checkpoint {id} kept");
    }

    fn done(&self, started: Instant) -> MemberState {
        MemberState::Done {
            work_ms: started.elapsed().as_secs_f64() * 1000.0,
            waited_ms: self.waited_us.load(Ordering::SeqCst) as f64 / 1000.0,
            etcd_ms: self.etcd_us.load(Ordering::SeqCst) as f64 / 1000.0,
            picked_up_unix_ms: self.picked_up_unix_ms,
            saw_go_unix_ms: self.saw_go_unix_ms.load(Ordering::SeqCst),
            saw_commit_unix_ms: self.saw_commit_unix_ms.load(Ordering::SeqCst),
        }
    }

    /// Two phases, as the checkpoint: every member restored with its GPU state back but still locked,
    /// then the coordinator's commit, then the unlock. An abort at the barrier kills this copy before
    /// it ever ran on its GPUs.
    fn restore(&self, work: &dyn MemberWork) {
        let started = Instant::now();
        // Ordered: restored once the rank before it is restored, unlocked once it is unlocked.
        let restored =
            |s: &MemberState| matches!(s, MemberState::Restored { .. } | MemberState::Done { .. });
        if let Err(why) = self.wait_turn(restored) {
            tracing::warn!("job restore aborted before this member's turn: {why}");
            self.say(MemberState::Aborted);
            return;
        }
        let before_unlock = |pid: i32| {
            crate::fault::at("cluster.member-restored");
            self.say(MemberState::Restored { pid });
            match self.wait("commit") {
                Decision::Commit | Decision::Go => {
                    self.wait_turn(|s| matches!(s, MemberState::Done { .. }))
                }
                // A restore kept nothing: a copy unlocked without the commit is killed either way.
                Decision::Abort(why) | Decision::Unreachable(why) => Err(why),
            }
        };
        match work.restore(&self.task, &before_unlock) {
            Ok(_) => self.say(self.done(started)),
            Err(why) if self.aborted.load(Ordering::SeqCst) => {
                tracing::warn!("job restore aborted ({why}): the restored copy was killed");
                self.say(MemberState::Aborted);
            }
            Err(e) => self.failed(&e),
        }
    }
}

/// The checkpoint flow's barriers, answered by the coordinator's decisions.
struct AgentPhases<'a, 'c> {
    member: &'a Member<'c>,
    work: &'a dyn MemberWork,
}

impl Phases for AgentPhases<'_, '_> {
    fn locked(&self) -> Result<(), String> {
        crate::fault::at("cluster.member-locked");
        self.member.say(MemberState::Locked);
        match self.member.wait("go") {
            Decision::Go | Decision::Commit => Ok(()),
            Decision::Abort(why) | Decision::Unreachable(why) => Err(why),
        }
    }

    fn durable(&self, id: &str) -> Result<(), NotCommitted> {
        crate::fault::at("cluster.member-durable");
        *self
            .member
            .durable_id
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(id.to_string());
        self.member.say(MemberState::Durable {
            checkpoint: id.to_string(),
            gpus: self.work.gpus(id),
        });
        match self.member.wait("commit") {
            Decision::Commit => Ok(()),
            Decision::Go => unreachable!("wait(\"commit\") returns no go"),
            Decision::Abort(why) => Err(NotCommitted::Aborted(why)),
            Decision::Unreachable(why) => {
                self.member.in_doubt.store(true, Ordering::SeqCst);
                Err(NotCommitted::InDoubt(why))
            }
        }
    }
}
