//! The agent's local socket, through which `gpu-checkpoint job add` registers a member on its node
//! ([`super::admit`]): one JSON line asked, one answered. The socket is open to every local user; who
//! may register what is decided by the caller's credentials, which the kernel gives (`SO_PEERCRED`),
//! not by anything the caller says.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::admit::{Admission, Registration};
use super::coord::Coordinator;
use super::member_error::MemberError;
use super::records::MemberRecord;
use crate::exit::{Classify, ExitStatus};

/// Where `job add` and the agent meet when neither is told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/gpu-checkpoint/agent.sock";

/// How long one client may take to ask (a slow one does not hold the others up for longer).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// The agent's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// The agent's node (the member's, now).
    pub node: Option<String>,
    /// Why the registration was refused, and its exit code.
    pub error: Option<String>,
    pub exit: Option<i32>,
}

/// A registration refused by the agent, or an agent that could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("no gpu-checkpoint agent answers at {socket} (start `gpu-checkpoint agent` on this node, or give --agent-socket): {source}")]
    NoAgent {
        socket: String,
        source: std::io::Error,
    },
    #[error("the agent refused: {message}")]
    Refused { message: String, exit: ExitStatus },
}

impl Classify for RegisterError {
    fn exit_status(&self) -> ExitStatus {
        match self {
            RegisterError::NoAgent { .. } => ExitStatus::Conflict,
            RegisterError::Refused { exit, .. } => *exit,
        }
    }
}

/// Asks the agent at `socket` to register `reg`; returns the agent's node.
pub fn register_member(socket: &Path, reg: &Registration) -> Result<String, RegisterError> {
    let no_agent = |source| RegisterError::NoAgent {
        socket: socket.display().to_string(),
        source,
    };
    let mut s = UnixStream::connect(socket).map_err(no_agent)?;
    // The agent checks the process and writes to etcd: give it longer than a client gets.
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(no_agent)?;
    let mut line = serde_json::to_vec(reg).expect("plain data");
    line.push(b'\n');
    s.write_all(&line).map_err(no_agent)?;
    let mut answer = String::new();
    BufReader::new(s.take(64 * 1024))
        .read_line(&mut answer)
        .map_err(no_agent)?;
    let reply: Reply = serde_json::from_str(&answer).map_err(|e| {
        no_agent(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            e.to_string(),
        ))
    })?;
    match (reply.error, reply.node) {
        (None, Some(node)) => Ok(node),
        (error, _) => Err(RegisterError::Refused {
            message: crate::validate::printable(&error.unwrap_or_else(|| "no answer".into())),
            exit: reply
                .exit
                .and_then(ExitStatus::from_code)
                .unwrap_or(ExitStatus::Failure),
        }),
    }
}

/// The agent's side: a listening socket, removed on drop.
pub struct RegistrationSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl RegistrationSocket {
    /// Listens at `path`, open to every local user. A socket left there by an agent that died is
    /// replaced; one another agent answers on is not.
    pub fn bind(path: &Path) -> Result<RegistrationSocket, MemberError> {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let io = |what: &str, e| MemberError::io(format!("{what} {}", path.display()), e);
        if let Some(dir) = path.parent() {
            if !dir.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .create(dir)
                    .map_err(|e| io("creating the folder of", e))?;
            }
        }
        match std::fs::symlink_metadata(path) {
            Ok(m) if m.file_type().is_socket() => {
                if UnixStream::connect(path).is_ok() {
                    return Err(MemberError::Refused(format!(
                        "another agent listens on {} already (give this one --socket)",
                        path.display()
                    )));
                }
                std::fs::remove_file(path).map_err(|e| io("removing the stale socket", e))?;
            }
            Ok(_) => {
                return Err(MemberError::Refused(format!(
                    "{} exists and is not a socket",
                    path.display()
                )))
            }
            Err(_) => {}
        }
        let listener = UnixListener::bind(path).map_err(|e| io("listening on", e))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| io("opening", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| io("listening on", e))?;
        Ok(RegistrationSocket {
            listener,
            path: path.to_path_buf(),
        })
    }

    /// Answers registrations until `stop` is set: each checked by `admission` (containers looked up
    /// with `container_init`), then written to etcd as member `RANK` of its job on `node`.
    pub fn serve(
        &self,
        node: &str,
        admission: &Admission,
        container_init: &dyn Fn(&str) -> Result<i32, MemberError>,
        coord: &dyn Coordinator,
        stop: &AtomicBool,
    ) {
        while !stop.load(Ordering::SeqCst) {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    let reply = answer(&stream, node, admission, container_init, coord);
                    let mut line = serde_json::to_vec(&reply).expect("plain data");
                    line.push(b'\n');
                    let _ = (&stream).write_all(&line);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => {
                    tracing::warn!("registration socket {}: {e}", self.path.display());
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }
}

impl Drop for RegistrationSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One client's registration, answered.
fn answer(
    stream: &UnixStream,
    node: &str,
    admission: &Admission,
    container_init: &dyn Fn(&str) -> Result<i32, MemberError>,
    coord: &dyn Coordinator,
) -> Reply {
    let refuse = |e: &dyn Classify| Reply {
        node: None,
        error: Some(e.to_string()),
        exit: Some(e.exit_status() as i32),
    };
    let asked = (|| {
        let creds =
            nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::PeerCredentials)
                .map_err(|e| {
                    MemberError::io("reading the caller's credentials".into(), e.into())
                })?;
        stream
            .set_nonblocking(false)
            .and_then(|()| stream.set_read_timeout(Some(CLIENT_TIMEOUT)))
            .map_err(|e| MemberError::io("reading the registration".into(), e))?;
        let mut line = String::new();
        BufReader::new(stream.take(64 * 1024))
            .read_line(&mut line)
            .map_err(|e| MemberError::io("reading the registration".into(), e))?;
        let reg: Registration = serde_json::from_str(&line)
            .map_err(|e| MemberError::BadTask(format!("a registration that does not read: {e}")))?;
        Ok::<_, MemberError>((reg, creds.uid(), creds.pid()))
    })();
    let (reg, uid, caller) = match asked {
        Ok(a) => a,
        Err(e) => return refuse(&e),
    };
    if let Some(n) = reg.node.as_deref().filter(|n| *n != node) {
        return refuse(&MemberError::BadTask(format!(
            "this agent is node {node}'s, not {}'s: run `job add` on the member's node",
            crate::validate::printable(n)
        )));
    }
    let admitted = match admission.register(&reg, uid, container_init) {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(
                "registration of rank {} of job {} by uid {uid} (pid {caller}) refused: {e}",
                reg.rank,
                crate::validate::printable(&reg.job)
            );
            return refuse(&e);
        }
    };
    let record = MemberRecord {
        rank: admitted.rank,
        node: node.to_string(),
        pid: admitted.pid,
        container: admitted.container.clone(),
        ordered: reg.ordered,
    };
    if let Err(e) = super::job::add_member(coord, &admitted.job, &record) {
        return refuse(&e);
    }
    tracing::info!(
        "rank {} of job {} registered by uid {uid}: {}",
        admitted.rank,
        admitted.job,
        match (&admitted.pid, &admitted.container) {
            (Some(p), _) => format!("PID {p}"),
            (_, Some(c)) => format!("container {c}"),
            _ => String::new(),
        }
    );
    Reply {
        node: Some(node.to_string()),
        error: None,
        exit: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flows::cluster::{job, MemoryCoordinator, NodePolicy};

    #[test]
    fn a_registration_is_checked_by_the_agent_and_written_to_etcd_by_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.sock");
        let socket = RegistrationSocket::bind(&path).unwrap();
        // A second agent on the same socket is refused; the first keeps it.
        let e = RegistrationSocket::bind(&path).err().unwrap();
        assert!(e.to_string().contains("another agent listens"), "{e}");
        let coord = MemoryCoordinator::new();
        let admission = Admission::in_memory(NodePolicy::default());
        let stop = AtomicBool::new(false);
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let reg = |pid: i32, node: Option<&str>| Registration {
            job: "train".into(),
            rank: 1,
            pid: Some(pid),
            container: None,
            ordered: false,
            node: node.map(String::from),
        };
        let no_containers = |id: &str| Err(MemberError::Refused(format!("no container {id}")));
        /// Stops the server when the test's part ends, passed or not.
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        std::thread::scope(|s| {
            let _stop = StopOnDrop(&stop);
            s.spawn(|| socket.serve("n1", &admission, &no_containers, &coord, &stop));
            let node = register_member(&path, &reg(child.id() as i32, None)).unwrap();
            assert_eq!(node, "n1");
            let e = register_member(&path, &reg(1, None)).unwrap_err();
            assert_eq!(e.exit_status(), ExitStatus::PermissionDenied, "{e}");
            let e = register_member(&path, &reg(child.id() as i32, Some("n2"))).unwrap_err();
            assert!(
                e.to_string().contains("run `job add` on the member's node"),
                "{e}"
            );
        });
        let members = job::members(&coord, "train").unwrap();
        assert_eq!(members.len(), 1);
        assert_eq!(
            (members[0].pid, members[0].node.as_str()),
            (Some(child.id() as i32), "n1")
        );
        assert!(admission.get("train", 1).is_some());
        let _ = child.kill();
        let _ = child.wait();
        // The socket goes with the agent; a stale one (its agent died) is replaced.
        drop(socket);
        assert!(!path.exists());
        let stale = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(stale);
        RegistrationSocket::bind(&path).unwrap();
        // Nobody answers: the command says so (exit 8).
        let gone = dir.path().join("none.sock");
        let e = register_member(&gone, &reg(2, None)).unwrap_err();
        assert_eq!(e.exit_status(), ExitStatus::Conflict);
    }
}
