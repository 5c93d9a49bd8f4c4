//! What the cluster flow keeps in etcd, and where: the key layout and the JSON records, each versioned
//! and self-describing (`schema`, `schema_version`) like the checkpoint manifest, so that a newer
//! gpu-checkpoint's records are refused rather than misread.
//!
//! ```text
//! /gpu-checkpoint/v1/agents/NODE                 AgentRecord     (the agent's lease)
//! /gpu-checkpoint/v1/jobs/JOB/members/RANK       MemberRecord    (job add)
//! /gpu-checkpoint/v1/checkpoints/ID              JobManifest     (the commit's transaction)
//! /gpu-checkpoint/v1/ops/ID/op                   OpRecord        (the coordinator's lease)
//! /gpu-checkpoint/v1/ops/ID/decision             "go" | "commit" | "abort" (the coordinator's lease)
//! /gpu-checkpoint/v1/ops/ID/members/RANK         StateRecord     (the member's agent's lease)
//! /gpu-checkpoint/v1/tasks/NODE/ID/RANK          Task            (the coordinator's lease)
//! /gpu-checkpoint/v1/trash/ID                    JobManifest     (a deleted job checkpoint whose member
//!                                                                 checkpoints are not all deleted yet)
//! ```
//!
//! Leases carry the failure detection: a dead coordinator's operation, decision and tasks vanish (its
//! agents abort), a dead agent's registration and states vanish (its coordinator aborts).

use serde::{Deserialize, Serialize};

use super::coord::CoordError;

/// Every key of the cluster flow starts with this.
pub const ROOT: &str = "/gpu-checkpoint/v1/";
/// The `schema` of the records.
pub const SCHEMA: &str = "gpu-checkpoint/cluster";
/// The newest version of the records this build reads.
pub const SCHEMA_VERSION: u32 = ORDERED_VERSION;
/// The version of the records with nothing of a later version in them: what every gpu-checkpoint
/// reads, so it is what this build writes wherever it can.
pub const BASE_VERSION: u32 = 1;
/// The records of ordered operations (a job manifest with `ordered`, a task with `after`) are written
/// with this version. A gpu-checkpoint that knows only version 1 ignores fields it does not know, so it
/// would read them as unordered and lock or restore members sharing CUDA IPC memory out of order; it
/// refuses version 2 instead. Unordered ones stay version 1, which every gpu-checkpoint reads (and
/// version 1 manifests, which have no `ordered`, read as unordered).
pub const ORDERED_VERSION: u32 = 2;

pub fn agents() -> String {
    format!("{ROOT}agents/")
}
pub fn agent(node: &str) -> String {
    format!("{ROOT}agents/{node}")
}
pub fn members(job: &str) -> String {
    format!("{ROOT}jobs/{job}/members/")
}
pub fn member(job: &str, rank: u32) -> String {
    // Zero-padded: etcd lists keys in byte order, and ranks should come out in numeric order.
    format!("{ROOT}jobs/{job}/members/{rank:08}")
}
pub fn jobs() -> String {
    format!("{ROOT}jobs/")
}
pub fn checkpoints() -> String {
    format!("{ROOT}checkpoints/")
}
pub fn checkpoint(id: &str) -> String {
    format!("{ROOT}checkpoints/{id}")
}
pub fn trashed() -> String {
    format!("{ROOT}trash/")
}
pub fn trash(id: &str) -> String {
    format!("{ROOT}trash/{id}")
}
pub fn op_prefix(id: &str) -> String {
    format!("{ROOT}ops/{id}/")
}
pub fn op(id: &str) -> String {
    format!("{ROOT}ops/{id}/op")
}
pub fn decision(id: &str) -> String {
    format!("{ROOT}ops/{id}/decision")
}
pub fn states(id: &str) -> String {
    format!("{ROOT}ops/{id}/members/")
}
pub fn state(id: &str, rank: u32) -> String {
    format!("{ROOT}ops/{id}/members/{rank:08}")
}
pub fn tasks(node: &str) -> String {
    format!("{ROOT}tasks/{node}/")
}
pub fn task(node: &str, id: &str, rank: u32) -> String {
    format!("{ROOT}tasks/{node}/{id}/{rank:08}")
}

/// A name that goes into a key (node, job, checkpoint id): no `/` (it would change the layout), no
/// blanks or control characters, not empty, at most 128 bytes.
pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:@".contains(&b))
        && name != "."
        && name != "..";
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} {:?}: use 1-128 of A-Z a-z 0-9 - _ . : @",
            crate::validate::printable(name)
        ))
    }
}

/// The envelope of every record: which schema, which version.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Envelope<T> {
    schema: String,
    schema_version: u32,
    #[serde(flatten)]
    body: T,
}

/// A record as the bytes etcd keeps, of [`BASE_VERSION`].
pub fn encode<T: Serialize>(body: &T) -> Vec<u8> {
    encode_as(body, BASE_VERSION)
}

fn encode_as<T: Serialize>(body: &T, schema_version: u32) -> Vec<u8> {
    serde_json::to_vec(&Envelope {
        schema: SCHEMA.into(),
        schema_version,
        body,
    })
    .expect("records are plain data")
}

/// [`ORDERED_VERSION`] for a record that orders its operation, else [`BASE_VERSION`].
fn version_if_ordered(ordered: bool) -> u32 {
    if ordered {
        ORDERED_VERSION
    } else {
        BASE_VERSION
    }
}

/// A job manifest as etcd and the members' stores keep it: [`ORDERED_VERSION`] if ordered.
pub fn encode_manifest(m: &JobManifest) -> Vec<u8> {
    encode_as(m, version_if_ordered(m.ordered))
}

/// A member as etcd keeps it: [`ORDERED_VERSION`] if it must be checkpointed in rank order (a
/// gpu-checkpoint that does not know about ordering would checkpoint its job unordered).
pub fn encode_member(m: &MemberRecord) -> Vec<u8> {
    encode_as(m, version_if_ordered(m.ordered))
}

/// A task as etcd keeps it: [`ORDERED_VERSION`] if the member waits for another (`after`).
pub fn encode_task(t: &Task) -> Vec<u8> {
    encode_as(t, version_if_ordered(t.after.is_some()))
}

/// A record from etcd's bytes; refuses another schema or a newer version.
pub fn decode<T: for<'de> Deserialize<'de>>(key: &str, bytes: &[u8]) -> Result<T, CoordError> {
    let bad = |why: String| {
        let key = crate::validate::printable(key);
        CoordError::Request(format!(
            "record {key}: {}",
            crate::validate::printable(&why)
        ))
    };
    let env: Envelope<serde_json::Value> =
        serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
    if env.schema != SCHEMA {
        return Err(bad(format!("schema {:?}, not {SCHEMA:?}", env.schema)));
    }
    if env.schema_version > SCHEMA_VERSION {
        return Err(bad(format!(
            "written by a newer gpu-checkpoint (schema version {}, this one reads up to {SCHEMA_VERSION})",
            env.schema_version
        )));
    }
    serde_json::from_value(env.body).map_err(|e| bad(e.to_string()))
}

/// An agent's registration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentRecord {
    pub node: String,
    /// The agent's PID on its node.
    pub pid: u32,
    /// Its store (a folder, shared or not).
    pub storage: String,
    pub tool_version: String,
    pub started_unix_ms: u64,
    /// The node's GPUs, as its GPU backend lists them (empty: none, or not known; older agents): what
    /// a job restore chooses a node by when a member's own node has no agent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<crate::freeze::GpuInfo>,
}

/// A member of a job: one process tree on one node, with its rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    pub rank: u32,
    pub node: String,
    /// The root of the member's process tree on its node.
    pub pid: Option<i32>,
    /// Or its container (recorded; the agent does not resolve containers yet).
    pub container: Option<String>,
    /// Its processes share CUDA IPC memory with other members' (`job add --ordered`): every checkpoint
    /// of the job is then ordered. Written as [`ORDERED_VERSION`] when set.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ordered: bool,
}

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OpKind {
    Checkpoint,
    Restore,
    /// Deletes the member checkpoints of a deleted job checkpoint (retention, `job delete`).
    Delete,
}

/// The operation a coordinator runs, kept while it runs (its lease).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpRecord {
    pub id: String,
    pub job: String,
    pub kind: OpKind,
    pub members: Vec<MemberRecord>,
    pub started_unix_ms: u64,
    /// Members locked (or restored and unlocked) in rank order: `job checkpoint --ordered`, or the
    /// restore of an ordered job checkpoint.
    #[serde(default)]
    pub ordered: bool,
}

/// One member's part of an operation, for the agent of its node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// The operation (and, for a checkpoint, the job checkpoint's id).
    pub op: String,
    pub job: String,
    pub kind: OpKind,
    /// The member, on the node that runs this task (a restore's target node).
    pub member: MemberRecord,
    /// Checkpoint: keep the tree running afterwards.
    pub leave_running: bool,
    /// Checkpoint: how long locking a CUDA process may wait for its GPU work (None: no limit).
    pub lock_timeout_ms: Option<u64>,
    /// Checkpoint: the name of a quiesce hook of the node's agent (`agent --quiesce-hook NAME=PROGRAM`),
    /// run before the lock (the application reaches a collective boundary). A name only: what it runs
    /// is the node's to say. (gpu-checkpoint before 0.2 read a shell command here.)
    pub quiesce: Option<String>,
    /// Restore: the member checkpoint to restore; delete: the one to delete.
    pub checkpoint: Option<String>,
    /// Restore: the device map for this member's node (`OLD=NEW,...`, as `restore --device-map`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_map: Option<String>,
    /// Restore and delete: the job checkpoint the member checkpoint belongs to (a delete removes the
    /// store's copy of its manifest too). The agent acts only on a checkpoint made for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_checkpoint: Option<String>,
    /// An ordered operation (CUDA IPC between members): the rank this member waits for, the next
    /// lower one; it locks after that one is locked, restores after it is restored and unlocks after
    /// it is unlocked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u32>,
}

impl MemberRecord {
    /// Rank `rank`, the process tree of `pid` on `node`.
    pub fn process(rank: u32, node: &str, pid: i32) -> MemberRecord {
        MemberRecord {
            rank,
            node: node.into(),
            pid: Some(pid),
            container: None,
            ordered: false,
        }
    }
}

impl Task {
    /// Operation `op`'s checkpoint of `member` of `job`, with no option set (stopped after it, no lock
    /// timeout, no quiesce hook, unordered).
    pub fn checkpoint(op: &str, job: &str, member: MemberRecord) -> Task {
        Task {
            op: op.into(),
            job: job.into(),
            kind: OpKind::Checkpoint,
            member,
            leave_running: false,
            lock_timeout_ms: None,
            quiesce: None,
            checkpoint: None,
            device_map: None,
            job_checkpoint: None,
            after: None,
        }
    }

    /// Checks a task read from etcd at `key` by the agent of `node`: where it was found matches what it
    /// says (this node, its operation, its rank), and every name, id and PID in it is one this tool
    /// would have written. The agent carries out no other (etcd is untrusted input).
    pub fn check(&self, key: &str, node: &str) -> Result<(), String> {
        check_name("operation", &self.op)?;
        check_name("job", &self.job)?;
        check_name("node", &self.member.node)?;
        if self.member.node != node {
            return Err(format!("it is for node {:?}, not {node}", self.member.node));
        }
        if key != task(node, &self.op, self.member.rank) {
            return Err(format!(
                "found at {key:?}, where a task of operation {} rank {} is not",
                self.op, self.member.rank
            ));
        }
        if let Some(pid) = self.member.pid {
            crate::validate::pid(pid)?;
        }
        if let Some(c) = &self.member.container {
            crate::validate::container_id(c)?;
        }
        if let Some(id) = &self.checkpoint {
            crate::validate::checkpoint_id(id)?;
        }
        if let Some(id) = &self.job_checkpoint {
            check_name("job checkpoint", id)?;
        }
        if let Some(hook) = &self.quiesce {
            check_name("quiesce hook", hook)?;
        }
        let one_member = self.member.pid.is_some() != self.member.container.is_some();
        match self.kind {
            OpKind::Checkpoint if !one_member => {
                Err("a checkpoint task names a PID or a container, one of the two".into())
            }
            OpKind::Restore | OpKind::Delete
                if self.checkpoint.is_none() || self.job_checkpoint.is_none() =>
            {
                Err(
                    "a restore or delete task names its member checkpoint and job checkpoint"
                        .into(),
                )
            }
            _ => Ok(()),
        }
    }
}

/// Where a member is in an operation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum MemberState {
    /// Checkpoint: every GPU process of the member is locked; waiting for `go`.
    Locked,
    /// Checkpoint: the member's checkpoint is durable in its store; waiting for `commit`.
    Durable {
        checkpoint: String,
        gpus: Vec<String>,
    },
    /// Restore: the member's tree is restored, GPU state included; waiting for `commit`.
    Restored { pid: i32 },
    /// The member finished its part after the commit: its whole part took `work_ms`, of which it waited
    /// `waited_ms` at the barriers for the others and the coordinator, and `etcd_ms` writing its states
    /// to etcd (part of its work; its reads of the decision are part of its waits). By its clock, when
    /// its agent picked its task up and when it learnt of `go` and of `commit` (0: not known; older
    /// agents), for the coordinator's breakdown of the protocol's time.
    Done {
        work_ms: f64,
        waited_ms: f64,
        #[serde(default)]
        etcd_ms: f64,
        #[serde(default)]
        picked_up_unix_ms: u64,
        #[serde(default)]
        saw_go_unix_ms: u64,
        #[serde(default)]
        saw_commit_unix_ms: u64,
    },
    /// The member undid its part after an abort (unlocked and running, or its restored copy killed).
    Aborted,
    /// The member failed; it undid its part. `exit`: its error's exit code (absent from older agents).
    Failed {
        error: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        exit: Option<i32>,
    },
}

/// A member's state, as its agent writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateRecord {
    pub rank: u32,
    pub node: String,
    #[serde(flatten)]
    pub state: MemberState,
    pub at_unix_ms: u64,
}

/// One member of a committed job checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobMember {
    pub rank: u32,
    pub node: String,
    pub pid: Option<i32>,
    /// The member's own checkpoint, in its node's store.
    pub checkpoint: String,
    /// The GPUs its processes used, by UUID.
    pub gpus: Vec<String>,
    /// The models of `gpus`, in their order, as its agent listed them (empty: not known). Older tools
    /// ignore this and the next field: they only help a restore choose another node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_models: Vec<String>,
    /// Its agent's store at checkpoint time: a restore on another node chooses an agent with the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<String>,
}

/// The cut: when every member was locked (`go`), and when the job checkpoint was committed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cut {
    pub started_unix_ms: u64,
    pub locked_unix_ms: u64,
    pub committed_unix_ms: u64,
}

/// Where the coordinator's time went (milliseconds): `prepare` (tasks out until every member locked),
/// `checkpoint` (go until every member durable), `commit` (the transaction), `release` (until every
/// member finished). The protocol's own round trips are in `etcd` (the coordinator's etcd requests, not
/// its waits); the members' own work in `member_work_max` (the slowest member's part less its waits at
/// the barriers, `member_waited_max` the longest such wait).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct JobTimings {
    pub prepare: f64,
    pub checkpoint: f64,
    pub commit: f64,
    pub release: f64,
    pub total: f64,
    pub etcd: f64,
    #[serde(default)]
    pub member_work_max: f64,
    #[serde(default)]
    pub member_waited_max: f64,
    /// The largest of the members' own etcd request times (inside `member_work_max`'s member's work).
    #[serde(default)]
    pub member_etcd_max: f64,
    /// Summed over the coordinator's waits: the time between the first and the last member reaching
    /// the state waited for (by the members' clocks). Members' work queueing or differing in size, not
    /// protocol; part of the coordinator's waits.
    #[serde(default)]
    pub barrier_skew: f64,
    /// Summed over the coordinator's waits: from the last member's state write to the coordinator
    /// seeing it (the agent's write round trip and the watch's wake-up).
    #[serde(default)]
    pub watch_wake: f64,
    /// From the tasks' transaction to the last member's agent picking its task up (its task watch's
    /// wake-up; members' clocks against the coordinator's).
    #[serde(default)]
    pub task_pickup: f64,
    /// From `go` written to the last member learning of it (its watch's wake-up, and reads if any).
    #[serde(default)]
    pub go_delivery: f64,
    /// From `commit` written to the last member learning of it.
    #[serde(default)]
    pub commit_delivery: f64,
}

/// A committed job checkpoint: in etcd (`checkpoints/ID`) and in every member's store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobManifest {
    pub id: String,
    pub job: String,
    pub leave_running: bool,
    /// Checkpointed in rank order (`job checkpoint --ordered`): restored in that order too. Written as
    /// [`ORDERED_VERSION`] when set; absent (version 1 manifests) means unordered.
    #[serde(default)]
    pub ordered: bool,
    pub members: Vec<JobMember>,
    pub cut: Cut,
    pub timings_ms: JobTimings,
}

impl JobManifest {
    /// Checks a manifest read from etcd at job checkpoint `id`'s key: it is that job checkpoint's, and
    /// its job, nodes and member checkpoint ids are ones this tool writes.
    pub fn check(&self, id: &str) -> Result<(), String> {
        if self.id != id {
            return Err(format!(
                "it names job checkpoint {:?}",
                crate::validate::printable(&self.id)
            ));
        }
        check_name("job", &self.job)?;
        for m in &self.members {
            check_name("node", &m.node)?;
            crate::validate::checkpoint_id(&m.checkpoint)?;
        }
        Ok(())
    }
}

/// Milliseconds since the epoch, for the records.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_carry_their_schema_and_newer_ones_are_refused() {
        let m = MemberRecord {
            rank: 3,
            node: "n1".into(),
            pid: Some(42),
            container: None,
            ordered: false,
        };
        let bytes = encode_member(&m);
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["schema"], SCHEMA);
        assert_eq!(v["schema_version"], BASE_VERSION);
        assert_eq!(decode::<MemberRecord>("k", &bytes).unwrap(), m);
        assert!(!String::from_utf8_lossy(&bytes).contains("ordered"));
        // A member sharing CUDA IPC memory is a version 2 record (older tools refuse it).
        let o = MemberRecord {
            ordered: true,
            ..m.clone()
        };
        let v2: serde_json::Value = serde_json::from_slice(&encode_member(&o)).unwrap();
        assert_eq!(v2["schema_version"], ORDERED_VERSION);
        assert_eq!(decode::<MemberRecord>("k", &encode_member(&o)).unwrap(), o);
        let mut newer = v.clone();
        newer["schema_version"] = (SCHEMA_VERSION + 1).into();
        let e = decode::<MemberRecord>("k", &serde_json::to_vec(&newer).unwrap()).unwrap_err();
        assert!(e.to_string().contains("newer gpu-checkpoint"), "{e}");
        let s = StateRecord {
            rank: 1,
            node: "a".into(),
            state: MemberState::Failed {
                error: "x".into(),
                exit: Some(3),
            },
            at_unix_ms: 5,
        };
        assert_eq!(decode::<StateRecord>("k", &encode(&s)).unwrap(), s);
    }

    #[test]
    fn ordered_manifests_and_tasks_are_a_newer_version_and_old_manifests_read_as_unordered() {
        // A manifest as a version 1 gpu-checkpoint wrote it: no `ordered`.
        let old = br#"{"schema":"gpu-checkpoint/cluster","schema_version":1,"id":"j-1","job":"j",
            "leave_running":true,"members":[],"cut":{"started_unix_ms":1,"locked_unix_ms":2,
            "committed_unix_ms":3},"timings_ms":{"prepare":0,"checkpoint":0,"commit":0,
            "release":0,"total":0,"etcd":0}}"#;
        let mut m: JobManifest = decode("k", old).unwrap();
        assert!(!m.ordered);
        let version = |bytes: &[u8]| {
            let v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
            v["schema_version"].as_u64().unwrap()
        };
        assert_eq!(version(&encode_manifest(&m)), 1);
        m.ordered = true;
        let bytes = encode_manifest(&m);
        assert_eq!(version(&bytes), 2);
        assert!(decode::<JobManifest>("k", &bytes).unwrap().ordered);
        // A task as a version 1 coordinator wrote it: no `after`.
        let old = br#"{"schema":"gpu-checkpoint/cluster","schema_version":1,"op":"j-1","job":"j",
            "kind":"checkpoint","member":{"rank":1,"node":"a","pid":1,"container":null},
            "leave_running":false,"lock_timeout_ms":null,"quiesce":null,"checkpoint":null}"#;
        let mut t: Task = decode("k", old).unwrap();
        assert_eq!(t.after, None);
        assert_eq!(version(&encode_task(&t)), 1);
        t.after = Some(0);
        assert_eq!(version(&encode_task(&t)), 2);
        assert_eq!(decode::<Task>("k", &encode_task(&t)).unwrap(), t);
    }

    #[test]
    fn a_task_read_from_etcd_is_checked_before_anything_is_done_with_it() {
        let good = Task {
            quiesce: Some("drain".into()),
            ..Task::checkpoint(
                "train-1700000000000",
                "train",
                MemberRecord::process(2, "n1", 4242),
            )
        };
        let key = task("n1", &good.op, 2);
        good.check(&key, "n1").unwrap();
        let bad = |f: fn(&mut Task), why: &str| {
            let mut t = good.clone();
            f(&mut t);
            let e = t
                .check(&task("n1", &t.op, t.member.rank), "n1")
                .unwrap_err();
            assert!(e.contains(why), "{e} (wanted {why:?})");
        };
        bad(|t| t.op = "../../outside/PWN".into(), "operation");
        bad(|t| t.job = "a/b".into(), "job");
        bad(|t| t.member.node = "n2".into(), "not n1");
        bad(|t| t.member.pid = Some(1), "PID 1");
        bad(|t| t.member.pid = Some(-1), "PID -1");
        bad(
            |t| t.quiesce = Some("touch /tmp/pwned".into()),
            "quiesce hook",
        );
        bad(
            |t| {
                t.member.pid = None;
                t.member.container = Some("--help".into());
            },
            "container id",
        );
        bad(|t| t.member.container = Some("c1".into()), "one of the two");
        bad(
            |t| {
                t.kind = OpKind::Restore;
                t.checkpoint = Some("../../etc".into());
                t.job_checkpoint = Some("train-1".into());
            },
            "checkpoint id",
        );
        bad(|t| t.kind = OpKind::Delete, "names its member checkpoint");
        // Found under another node's or another operation's key: not this task.
        assert!(good.check(&task("n2", &good.op, 2), "n2").is_err());
        assert!(good.check(&task("n1", "other-1", 2), "n1").is_err());
        assert!(good.check(&task("n1", &good.op, 3), "n1").is_err());
        // Messages escape what they quote.
        let mut t = good.clone();
        t.job = "\u{1b}[2J".into();
        assert!(!t.check(&key, "n1").unwrap_err().contains('\u{1b}'));
    }

    #[test]
    fn names_that_would_change_the_key_layout_are_refused() {
        for bad in ["", "a/b", "..", "a b", "x\n"] {
            assert!(check_name("node", bad).is_err(), "{bad:?}");
        }
        assert!(check_name("node", "node-1.rack:2").is_ok());
        // Ranks sort numerically as keys.
        assert!(member("j", 10) > member("j", 9));
    }
}
