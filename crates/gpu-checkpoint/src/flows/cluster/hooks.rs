//! The node's quiesce hooks: programs the agent was started with (`agent --quiesce-hook NAME=PROGRAM`),
//! one of which a job checkpoint may name (`job checkpoint --quiesce NAME`). Nothing executable
//! travels through etcd: a task carries a hook's name, and the node decides what it runs.
//!
//! A hook runs without a shell, with an empty environment but for `PATH` and the member's
//! `GPU_CHECKPOINT_JOB`, `GPU_CHECKPOINT_RANK` and `GPU_CHECKPOINT_PID` (never the agent's etcd
//! credentials), and is killed after its timeout. Its program must be a regular executable file that
//! only root or the agent's user can change, in a folder no one else can write to: otherwise anyone
//! who could change it would run code as the agent.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::member_error::MemberError;
use super::records::{self as rec, Task};

/// The hooks the agent was started with.
#[derive(Debug, Clone, Default)]
pub struct QuiesceHooks {
    hooks: BTreeMap<String, PathBuf>,
    /// How long a hook may run before it is killed (and the member fails).
    pub timeout: Duration,
}

impl QuiesceHooks {
    pub fn new(timeout: Duration) -> Self {
        QuiesceHooks {
            hooks: BTreeMap::new(),
            timeout,
        }
    }

    /// Adds `NAME=PROGRAM` (an absolute path), after checking the program as the module says.
    pub fn add(&mut self, spec: &str) -> Result<(), MemberError> {
        let bad = |why: String| {
            Err(MemberError::BadTask(format!(
                "--quiesce-hook {spec:?}: {why}"
            )))
        };
        let Some((name, program)) = spec.split_once('=') else {
            return bad("not NAME=PROGRAM".into());
        };
        rec::check_name("quiesce hook", name).map_err(MemberError::BadTask)?;
        let program = Path::new(program);
        if !program.is_absolute() {
            return bad("the program must be an absolute path".into());
        }
        check_program(program).map_err(MemberError::Refused)?;
        if self.hooks.insert(name.into(), program.into()).is_some() {
            return bad(format!("hook {name} given twice"));
        }
        Ok(())
    }

    pub fn names(&self) -> Vec<&str> {
        self.hooks.keys().map(String::as_str).collect()
    }

    /// Runs hook `name` for `task`'s member; an unknown name, a failure or a timeout fails the member.
    pub fn run(&self, name: &str, task: &Task) -> Result<(), MemberError> {
        let Some(program) = self.hooks.get(name) else {
            return Err(MemberError::Refused(format!(
                "quiesce hook {:?} is not one this node's agent was started with (agent \
                 --quiesce-hook NAME=PROGRAM; it has: {})",
                crate::validate::printable(name),
                if self.hooks.is_empty() {
                    "none".to_string()
                } else {
                    self.names().join(", ")
                }
            )));
        };
        // Checked again: the file may have changed since the agent started.
        check_program(program).map_err(MemberError::Refused)?;
        let mut c = std::process::Command::new(program);
        c.env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .env("GPU_CHECKPOINT_JOB", &task.job)
            .env("GPU_CHECKPOINT_RANK", task.member.rank.to_string())
            .stdin(std::process::Stdio::null());
        if let Some(pid) = task.member.pid {
            c.env("GPU_CHECKPOINT_PID", pid.to_string());
        }
        if let Some(id) = &task.member.container {
            c.env("GPU_CHECKPOINT_CONTAINER", id);
        }
        let failed = |why: String| {
            MemberError::Quiesce(format!(
                "quiesce hook {name} ({}): {why}",
                program.display()
            ))
        };
        let mut child = c
            .spawn()
            .map_err(|e| failed(format!("cannot run it: {e}")))?;
        let deadline = Instant::now() + self.timeout;
        loop {
            match child.try_wait() {
                Ok(Some(s)) if s.success() => return Ok(()),
                Ok(Some(s)) => return Err(failed(format!("it failed ({s})"))),
                Ok(None) if Instant::now() >= deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(failed(format!(
                        "it did not finish in {:?}; killed",
                        self.timeout
                    )));
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return Err(failed(e.to_string())),
            }
        }
    }
}

/// A program only root or this user can change: a regular executable file owned by one of them,
/// writable by no one else, in a folder writable by no one else.
fn check_program(program: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let trusted = |m: &std::fs::Metadata| (m.uid() == 0 || m.uid() == me) && m.mode() & 0o022 == 0;
    let meta = std::fs::metadata(program).map_err(|e| format!("{}: {e}", program.display()))?;
    if !meta.is_file() || meta.mode() & 0o111 == 0 {
        return Err(format!("{} is not an executable file", program.display()));
    }
    if !trusted(&meta) {
        return Err(format!(
            "{} can be changed by users other than root and the agent's (owner uid {}, mode {:o})",
            program.display(),
            meta.uid(),
            meta.mode() & 0o7777
        ));
    }
    let dir = program.parent().unwrap_or(Path::new("/"));
    let dmeta = std::fs::metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !trusted(&dmeta) {
        return Err(format!(
            "{}'s folder {} is writable by others: the program could be replaced",
            program.display(),
            dir.display()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flows::cluster::records::MemberRecord;
    use std::os::unix::fs::PermissionsExt;

    fn task() -> Task {
        Task::checkpoint("j-1", "j", MemberRecord::process(3, "n1", 4242))
    }

    fn script(dir: &Path, name: &str, body: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn a_hook_runs_without_a_shell_with_the_members_environment_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = dir.path().join("out");
        let body = format!(
            "echo \"$GPU_CHECKPOINT_JOB $GPU_CHECKPOINT_RANK $GPU_CHECKPOINT_PID ${{HOME:-none}}\" > {}",
            out.display()
        );
        let p = script(dir.path(), "drain", &body, 0o755);
        let mut hooks = QuiesceHooks::new(Duration::from_secs(10));
        hooks.add(&format!("drain={}", p.display())).unwrap();
        // The agent's own environment (HOME here; its etcd password in a unit) does not reach it.
        hooks.run("drain", &task()).unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "j 3 4242 none\n");
        // A name the node does not know is refused, a shell command too: nothing is run.
        let e = hooks.run("touch /tmp/pwned", &task()).unwrap_err();
        assert!(e.to_string().contains("not one this node's agent"), "{e}");
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::exit::ExitStatus::PermissionDenied
        );
    }

    #[test]
    fn a_hook_that_others_can_change_is_refused_and_a_slow_one_is_killed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let mut hooks = QuiesceHooks::new(Duration::from_millis(300));
        let writable = script(dir.path(), "w", "true", 0o777);
        let e = hooks.add(&format!("w={}", writable.display())).unwrap_err();
        assert!(e.to_string().contains("can be changed"), "{e}");
        assert!(hooks.add("rel=bin/true").is_err());
        assert!(hooks.add("bad name=/bin/true").is_err());
        let slow = script(dir.path(), "slow", "sleep 5", 0o700);
        hooks.add(&format!("slow={}", slow.display())).unwrap();
        let t = Instant::now();
        let e = hooks.run("slow", &task()).unwrap_err();
        assert!(e.to_string().contains("killed"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(4));
        let fails = script(dir.path(), "fails", "exit 3", 0o700);
        hooks.add(&format!("fails={}", fails.display())).unwrap();
        assert!(hooks
            .run("fails", &task())
            .unwrap_err()
            .to_string()
            .contains("failed"));
        let open = tempfile::tempdir().unwrap();
        std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let in_open = script(open.path(), "x", "true", 0o755);
        let e = hooks.add(&format!("x={}", in_open.display())).unwrap_err();
        assert!(e.to_string().contains("writable by others"), "{e}");
    }
}
