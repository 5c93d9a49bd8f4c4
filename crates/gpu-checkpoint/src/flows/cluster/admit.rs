//! What an agent acts on: only the members registered through it, on its node.
//!
//! A member is registered by `gpu-checkpoint job add` run on the member's node, which asks the node's
//! agent over its local socket ([`super::register`]); the agent checks the caller (root, or the owner
//! of the process: whoever may already signal and ptrace it), the process (alive, not init, not a kernel
//! thread, not the agent or one of its ancestors) and the node's policy (`agent --allow-uid`,
//! `--allow-cgroup`), records the member with its process's start time in its state folder, and only
//! then writes the member to etcd. A checkpoint task is carried out only for a member registered so,
//! whose PID is still the same process; anything else in etcd (a forged task, a member written to etcd
//! by hand) is refused. Restores and deletes act only on checkpoints an agent made for the job
//! checkpoint the task names ([`super::local`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::member_error::MemberError;
use super::records::{self as rec, Task};

/// What `job add` asks of its node's agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub job: String,
    pub rank: u32,
    pub pid: Option<i32>,
    pub container: Option<String>,
    #[serde(default)]
    pub ordered: bool,
    /// The node the caller means (checked against the agent's own).
    #[serde(default)]
    pub node: Option<String>,
}

/// A member this agent registered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Admitted {
    pub job: String,
    pub rank: u32,
    pub pid: Option<i32>,
    /// The process's start (clock ticks after boot): tells it from a later process with its PID.
    pub start_ticks: Option<u64>,
    pub container: Option<String>,
    /// The local user who registered it (0: root, or the agent itself after a restore).
    pub by_uid: u32,
    pub at_unix_ms: u64,
}

/// What the node's operator allows members to be, beyond their existing (`agent --allow-uid`,
/// `--allow-cgroup`). Empty lists allow any.
#[derive(Debug, Clone, Default)]
pub struct NodePolicy {
    /// The processes' (real) user ids.
    pub allow_uids: Vec<u32>,
    /// cgroup (v2) paths, such as `/system.slice/slurmstepd.scope`: the member's root process must be
    /// in one of them or below.
    pub allow_cgroups: Vec<String>,
}

/// The members this agent registered, kept in its state folder (`members.json`, 0600) so that a
/// restarted agent still knows them.
pub struct Admission {
    file: Option<PathBuf>,
    policy: NodePolicy,
    members: Mutex<BTreeMap<(String, u32), Admitted>>,
}

/// The state file's envelope: versioned like every record.
#[derive(Serialize, Deserialize)]
struct StateFile {
    schema: String,
    schema_version: u32,
    members: Vec<Admitted>,
}

const STATE_SCHEMA: &str = "gpu-checkpoint/agent-members";

impl Admission {
    /// The registry in `state_dir` (created 0700; it must be this user's and writable by no one else).
    pub fn open(state_dir: &Path, policy: NodePolicy) -> Result<Admission, MemberError> {
        use std::os::unix::fs::MetadataExt;
        let io = |what: &str, e| MemberError::io(format!("{what} {}", state_dir.display()), e);
        crate::util::create_private_dir_all(state_dir).map_err(|e| io("creating", e))?;
        let meta = std::fs::symlink_metadata(state_dir).map_err(|e| io("reading", e))?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
            return Err(MemberError::Refused(format!(
                "agent state folder {}: not a folder of this user's that only it can write",
                state_dir.display()
            )));
        }
        let file = state_dir.join("members.json");
        let members = match std::fs::read(&file) {
            Ok(bytes) => {
                let s: StateFile = serde_json::from_slice(&bytes)
                    .map_err(|e| MemberError::BadTask(format!("{}: {e}", file.display())))?;
                if s.schema != STATE_SCHEMA || s.schema_version > 1 {
                    return Err(MemberError::BadTask(format!(
                        "{}: schema {:?} version {}, not {STATE_SCHEMA:?} 1",
                        file.display(),
                        s.schema,
                        s.schema_version
                    )));
                }
                s.members
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(io("reading", e)),
        };
        Ok(Admission {
            file: Some(file),
            policy,
            members: Mutex::new(
                members
                    .into_iter()
                    .map(|a| ((a.job.clone(), a.rank), a))
                    .collect(),
            ),
        })
    }

    /// A registry kept in memory only (tests).
    pub fn in_memory(policy: NodePolicy) -> Admission {
        Admission {
            file: None,
            policy,
            members: Default::default(),
        }
    }

    pub fn get(&self, job: &str, rank: u32) -> Option<Admitted> {
        self.lock().get(&(job.to_string(), rank)).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, u32), Admitted>> {
        self.members.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn keep(&self, a: Admitted) -> Result<(), MemberError> {
        let mut members = self.lock();
        members.insert((a.job.clone(), a.rank), a);
        let Some(file) = &self.file else {
            return Ok(());
        };
        let state = StateFile {
            schema: STATE_SCHEMA.into(),
            schema_version: 1,
            members: members.values().cloned().collect(),
        };
        let bytes = serde_json::to_vec_pretty(&state).expect("plain data");
        crate::util::write_atomic(file, &bytes)
            .map_err(|e| MemberError::io(format!("writing {}", file.display()), e))
    }

    /// Registers a member for the local user `caller_uid` (from the socket's peer credentials). A
    /// container member is checked by `container_init` (its init's PID, once the runtime says it
    /// exists); only root registers containers.
    pub fn register(
        &self,
        reg: &Registration,
        caller_uid: u32,
        container_init: &dyn Fn(&str) -> Result<i32, MemberError>,
    ) -> Result<Admitted, MemberError> {
        rec::check_name("job", &reg.job).map_err(MemberError::BadTask)?;
        let (pid, start_ticks, container) = match (reg.pid, &reg.container) {
            (Some(pid), None) => {
                let start = check_process(pid, Some(caller_uid), &self.policy)?;
                (Some(pid), Some(start), None)
            }
            (None, Some(id)) => {
                crate::validate::container_id(id).map_err(MemberError::BadTask)?;
                if caller_uid != 0 {
                    return Err(MemberError::Refused(
                        "only root registers a container as a member".into(),
                    ));
                }
                let init = container_init(id)?;
                check_process(init, None, &self.policy)?;
                (None, None, Some(id.clone()))
            }
            _ => {
                return Err(MemberError::BadTask(
                    "a member is a PID or a container, one of the two".into(),
                ))
            }
        };
        let a = Admitted {
            job: reg.job.clone(),
            rank: reg.rank,
            pid,
            start_ticks,
            container,
            by_uid: caller_uid,
            at_unix_ms: rec::now_ms(),
        };
        self.keep(a.clone())?;
        Ok(a)
    }

    /// Whether this node's agent may checkpoint the member `task` names: registered here, the same
    /// process (or container) still, and still within the node's policy.
    pub fn check(&self, task: &Task) -> Result<(), MemberError> {
        let m = &task.member;
        let Some(a) = self.get(&task.job, m.rank) else {
            return Err(MemberError::Refused(format!(
                "rank {} of job {} was not registered through this node's agent (run `gpu-checkpoint \
                 job add` on node {})",
                m.rank, task.job, m.node
            )));
        };
        match (m.pid, &m.container) {
            (Some(pid), None) if a.pid == Some(pid) => {
                let now = crate::proc::stat(pid).map(|s| s.start_ticks);
                if now != a.start_ticks {
                    return Err(MemberError::Refused(format!(
                        "PID {pid} is no longer the process registered as rank {} of job {} (it \
                         exited; the PID may be another process's now): register the member again",
                        m.rank, task.job
                    )));
                }
                check_process(pid, None, &self.policy).map(drop)
            }
            (None, Some(id)) if a.container.as_deref() == Some(id.as_str()) => Ok(()),
            _ => Err(MemberError::Refused(format!(
                "rank {} of job {} is registered here as {}, not as the task says",
                m.rank,
                task.job,
                describe(&a)
            ))),
        }
    }

    /// A member this node restored (`pid`, or the container `container`): registered as the job's
    /// member now, so that the job's next checkpoint finds it.
    pub fn restored(&self, task: &Task, pid: i32, container: Option<String>) {
        let a = Admitted {
            job: task.job.clone(),
            rank: task.member.rank,
            pid: container.is_none().then_some(pid),
            start_ticks: crate::proc::stat(pid).map(|s| s.start_ticks),
            container,
            by_uid: 0,
            at_unix_ms: rec::now_ms(),
        };
        if let Err(e) = self.keep(a) {
            tracing::warn!("registering restored rank {}: {e}", task.member.rank);
        }
    }
}

fn describe(a: &Admitted) -> String {
    match (&a.pid, &a.container) {
        (Some(p), _) => format!("PID {p}"),
        (_, Some(c)) => format!("container {c}"),
        _ => "nothing".into(),
    }
}

/// Checks that `pid` is a process the agent may act on for `caller` (None: the agent itself), within
/// `policy`; returns its start time.
pub fn check_process(
    pid: i32,
    caller: Option<u32>,
    policy: &NodePolicy,
) -> Result<u64, MemberError> {
    crate::validate::pid(pid).map_err(MemberError::Refused)?;
    let gone = || MemberError::NoSuchProcess(pid);
    let stat = crate::proc::stat(pid).ok_or_else(gone)?;
    if stat.is_dying() {
        return Err(gone());
    }
    if stat.is_kernel_thread() {
        return Err(MemberError::Refused(format!(
            "PID {pid} is a kernel thread"
        )));
    }
    if is_self_or_ancestor(pid) {
        return Err(MemberError::Refused(format!(
            "PID {pid} is the agent or one of its ancestors: its tree holds the agent"
        )));
    }
    let uids = uids(pid).ok_or_else(gone)?;
    if let Some(caller) = caller.filter(|&c| c != 0) {
        if uids.iter().any(|&u| u != caller) {
            return Err(MemberError::Refused(format!(
                "PID {pid} is not the caller's (uid {caller}) process: only its owner or root \
                 registers it"
            )));
        }
    }
    if !policy.allow_uids.is_empty() && !policy.allow_uids.contains(&uids[0]) {
        return Err(MemberError::Refused(format!(
            "PID {pid} runs as uid {}, which this node's agent does not allow (--allow-uid)",
            uids[0]
        )));
    }
    if !policy.allow_cgroups.is_empty() {
        let cg = cgroup(pid).ok_or_else(gone)?;
        let inside = policy.allow_cgroups.iter().any(|allowed| {
            let allowed = allowed.trim_end_matches('/');
            cg == allowed || cg.starts_with(&format!("{allowed}/")) || allowed.is_empty()
        });
        if !inside {
            return Err(MemberError::Refused(format!(
                "PID {pid} is in cgroup {}, outside the ones this node's agent allows \
                 (--allow-cgroup)",
                crate::validate::printable(&cg)
            )));
        }
    }
    Ok(stat.start_ticks)
}

/// The real, effective and saved user ids of `pid` (`/proc/PID/status`).
fn uids(pid: i32) -> Option<Vec<u32>> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Uid:"))?;
    let ids: Vec<u32> = line
        .split_whitespace()
        .take(3)
        .filter_map(|u| u.parse().ok())
        .collect();
    (ids.len() == 3).then_some(ids)
}

/// The cgroup (v2) path of `pid`: `/proc/PID/cgroup`'s `0::PATH` line.
fn cgroup(pid: i32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
}

/// `pid` is this process or one of its ancestors.
fn is_self_or_ancestor(pid: i32) -> bool {
    let mut p = std::process::id() as i32;
    while p > 0 {
        if p == pid {
            return true;
        }
        match crate::proc::stat(p) {
            Some(s) if s.ppid != p => p = s.ppid,
            _ => break,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flows::cluster::records::MemberRecord;

    fn task(job: &str, rank: u32, pid: Option<i32>, container: Option<&str>) -> Task {
        let mut m = MemberRecord::process(rank, "n1", pid.unwrap_or(0));
        m.pid = pid;
        m.container = container.map(String::from);
        Task::checkpoint(&format!("{job}-1"), job, m)
    }

    /// A process for the tests to register, killed when dropped.
    struct Sleeper(std::process::Child);

    impl Sleeper {
        fn start() -> (Sleeper, i32) {
            let child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let pid = child.id() as i32;
            (Sleeper(child), pid)
        }

        fn end(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    impl Drop for Sleeper {
        fn drop(&mut self) {
            self.end();
        }
    }

    fn reg(pid: Option<i32>, container: Option<&str>) -> Registration {
        Registration {
            job: "train".into(),
            rank: 0,
            pid,
            container: container.map(String::from),
            ordered: false,
            node: None,
        }
    }

    const NO_CONTAINERS: &dyn Fn(&str) -> Result<i32, MemberError> =
        &|id| Err(MemberError::Refused(format!("no container {id}")));

    #[test]
    fn only_registered_members_whose_process_is_the_same_are_checkpointed() {
        let (mut child, pid) = Sleeper::start();
        let a = Admission::in_memory(NodePolicy::default());
        // Not registered: refused, whatever etcd says.
        let e = a.check(&task("train", 0, Some(pid), None)).unwrap_err();
        assert!(e.to_string().contains("not registered"), "{e}");
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::exit::ExitStatus::PermissionDenied
        );
        a.register(&reg(Some(pid), None), 0, NO_CONTAINERS).unwrap();
        a.check(&task("train", 0, Some(pid), None)).unwrap();
        // Another PID, or a container, for the registered rank: refused.
        let e = a.check(&task("train", 0, Some(1234567), None)).unwrap_err();
        assert!(e.to_string().contains("registered here as PID"), "{e}");
        assert!(a.check(&task("train", 0, None, Some("c1"))).is_err());
        assert!(a.check(&task("train", 1, Some(pid), None)).is_err());
        // The process exits: its PID no longer names it.
        child.end();
        let e = a.check(&task("train", 0, Some(pid), None)).unwrap_err();
        assert!(e.to_string().contains("no longer the process"), "{e}");
    }

    #[test]
    fn a_local_user_registers_only_processes_of_their_own_and_never_init_or_the_agent() {
        let (_child, pid) = Sleeper::start();
        let a = Admission::in_memory(NodePolicy::default());
        // SAFETY: getuid has no preconditions.
        let me = unsafe { libc::getuid() };
        let other = if me == 0 { 65534 } else { me + 1 };
        let e = a
            .register(&reg(Some(pid), None), other, NO_CONTAINERS)
            .unwrap_err();
        assert!(e.to_string().contains("only its owner or root"), "{e}");
        a.register(&reg(Some(pid), None), me, NO_CONTAINERS)
            .unwrap();
        for bad in [1, 0, -5, std::process::id() as i32] {
            assert!(
                a.register(&reg(Some(bad), None), 0, NO_CONTAINERS).is_err(),
                "{bad}"
            );
        }
        // Containers: root only, and only those the runtime knows.
        let e = a.register(&reg(None, Some("c1")), me.max(1), NO_CONTAINERS);
        assert!(e.is_err());
        let e = a
            .register(&reg(None, Some("--help")), 0, NO_CONTAINERS)
            .unwrap_err();
        assert!(e.to_string().contains("starts with '-'"), "{e}");
        let init = |_: &str| Ok(pid);
        a.register(&reg(None, Some("c1")), 0, &init).unwrap();
    }

    #[test]
    fn the_nodes_policy_limits_users_and_cgroups() {
        let (_child, pid) = Sleeper::start();
        let cg = cgroup(pid).unwrap_or_default();
        let strict = NodePolicy {
            allow_uids: vec![4242],
            allow_cgroups: Vec::new(),
        };
        let e = check_process(pid, None, &strict).unwrap_err();
        assert!(e.to_string().contains("--allow-uid"), "{e}");
        let elsewhere = NodePolicy {
            allow_uids: Vec::new(),
            allow_cgroups: vec!["/no/such.slice".into()],
        };
        let e = check_process(pid, None, &elsewhere).unwrap_err();
        assert!(e.to_string().contains("--allow-cgroup"), "{e}");
        let here = NodePolicy {
            allow_uids: Vec::new(),
            allow_cgroups: vec![cg],
        };
        check_process(pid, None, &here).unwrap();
    }

    #[test]
    fn registrations_survive_a_restart_in_a_private_state_folder() {
        use std::os::unix::fs::PermissionsExt;
        let (_child, pid) = Sleeper::start();
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("agent");
        let a = Admission::open(&state, NodePolicy::default()).unwrap();
        a.register(&reg(Some(pid), None), 0, NO_CONTAINERS).unwrap();
        drop(a);
        let mode = std::fs::metadata(state.join("members.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        let again = Admission::open(&state, NodePolicy::default()).unwrap();
        again.check(&task("train", 0, Some(pid), None)).unwrap();
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(Admission::open(&state, NodePolicy::default()).is_err());
    }
}
