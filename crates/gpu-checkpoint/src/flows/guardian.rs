//! The guardian: a small process that outlives the tool and keeps the promise the tool cannot keep once
//! it is dead (`kill -9`, the OOM killer, a crash).
//!
//! Signals the tool can catch are deferred and undone by the flows themselves ([`crate::interrupt`]).
//! Against the ones it cannot, the binary starts a guardian (`gpu-checkpoint guardian`, its own session,
//! OOM-proof, deaf to every catchable signal) before the tree is touched, and the flow tells it, step by
//! step and waiting for its acknowledgement, what it would have to undo: the tree's PIDs (which it holds
//! through pidfds from then on), the GPU backend once GPU state may be out, that the checkpoint is
//! durable, or which PIDs a restore is bringing back. It watches the tool through a pidfd. If the tool dies
//! before saying [`Event::Done`]:
//!
//! * checkpoint, not yet durable: it waits until CRIU has let go of the tree, continues it, and puts GPU
//!   state back (restore + unlock, asked of the driver per process, so nothing of its own is kept); a
//!   gVisor sandbox ([`Event::Sandbox`]) it restores from the images where the runtime's checkpoint
//!   stopped it, and puts back the GPU state inside it through the runtime's `exec`;
//! * checkpoint, durable: it finishes what the checkpoint promised: the tree is killed (unless
//!   `--leave-running`);
//! * restore: it kills the half-restored copy (the processes holding the checkpoint's PIDs that started
//!   after the guardian), so that the checkpoint, which a restore never changes, can be restored again;
//! * container restore ([`Event::ContainerRestore`], until [`Event::Restored`]): it lets the runtime's
//!   restore the tool left fail or finish (or kills it), unmounts what it left in the runtime's state
//!   folder, deletes the half-restored container and removes the work folder, so that the checkpoint
//!   restores again under the same id.
//!
//! It keeps no state on disk. The flows talk to it through the [`Watch`] trait; library users and tests
//! that start no guardian pass [`NoWatch`].

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::container::{RestoreUndo, SandboxUndo};
use crate::exit::{Classify, ExitStatus};
use crate::freeze::{GpuBackend, GpuDriver, ProcessState};
use crate::proc::{self as tree, Held};

/// The descriptor number the guardian finds its end of the socket at.
pub const GUARDIAN_FD: i32 = 3;
/// How long the tool waits for the guardian's answer to one event.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the guardian waits for CRIU to let go of a tree before continuing it anyway.
const CRIU_LET_GO: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot start the guardian process ({exe}): {source}")]
    Spawn {
        exe: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the guardian process is gone ({0}); nothing was touched")]
    Lost(String),
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        ExitStatus::Failure
    }
}

/// What the flow tells the guardian, in the order it happens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "event")]
pub enum Event {
    /// A checkpoint is about to touch these processes (root first); `stopped` were stopped before it
    /// (`--allow-stopped`) and stay so.
    Checkpoint {
        pids: Vec<i32>,
        leave_running: bool,
        #[serde(default)]
        stopped: Vec<i32>,
    },
    /// GPU state of the tree may be locked or checkpointed from now on, through this backend.
    Gpu { backend: GpuBackend },
    /// The tree is a sandbox its runtime cannot hold paused (runsc): to be brought back should the
    /// runtime's checkpoint have stopped it, and its GPU state put back inside it. Told before its GPU
    /// processes are locked inside it.
    Sandbox(SandboxUndo),
    /// The runtime's checkpoint, which stops the sandbox, is about to write its images into this
    /// folder (a work folder of the tool's, which outlives it): what brings the sandbox back.
    Stopping { images: std::path::PathBuf },
    /// The tree's container is held paused (frozen) by its runtime for the checkpoint: this command
    /// (program and arguments) resumes it, before the tree is continued or killed (a frozen process
    /// neither runs nor dies).
    Paused { resume: Vec<String> },
    /// The tree's container was paused by its engine before the tool touched it (containerd pauses a
    /// task around its checkpoint), and the engine resumes it once the runtime's command returns: the
    /// guardian waits for that before it puts the GPU state back, so that the engine's own resume still
    /// finds the container paused, as it expects. Only a container the engine leaves paused is resumed
    /// (then paused again) by the guardian.
    EnginePaused(EnginePaused),
    /// CRIU's dump left the tree stopped with its TCP connections in repair mode and locked
    /// (`--tcp-established`): released before the tree is continued.
    Network(crate::dump::NetworkHold),
    /// The checkpoint is durable: from now on the tree is to be stopped, not put back.
    Durable,
    /// A restore is about to create processes with these PIDs.
    Restore { pids: Vec<i32> },
    /// The restored processes go on before all of their memory is in: these descriptors of the tool's
    /// (their userfaultfds) are what serves it. The guardian holds a copy of each (`pidfd_getfd`) until
    /// [`Event::MemoryIn`], so that should the tool die, a process touching memory not yet in waits (and
    /// is killed with the copy) instead of reading zeros.
    Memory { fds: Vec<i32> },
    /// Every page is in: the guardian lets go of its copies (the tool's own close drops the
    /// registrations).
    MemoryIn,
    /// A container restore is about to run the runtime's restore: what deletes the half-restored
    /// container and removes the work folder.
    ContainerRestore(RestoreUndo),
    /// The container restore succeeded: the container is the runtime's, nothing to undo any more.
    Restored,
    /// The flow finished or undid everything itself: nothing is left to do.
    Done,
}

/// Where the flows report their steps (a boundary with the outside world: another process).
pub trait Watch: Sync {
    /// Tells `event` and returns once it is recorded. An error before the tree is touched must stop the
    /// flow; later ones are logged (the flow's own undo still works).
    fn tell(&self, event: &Event) -> Result<(), Error>;
}

/// No guardian: for library users and tests that do not need one.
pub struct NoWatch;

impl Watch for NoWatch {
    fn tell(&self, _: &Event) -> Result<(), Error> {
        Ok(())
    }
}

/// A running guardian process, told by [`Watch::tell`]; told [`Event::Done`] and reaped when dropped.
pub struct Guardian {
    sock: std::sync::Mutex<BufReader<UnixStream>>,
    child: Child,
}

impl Guardian {
    /// Starts `exe guardian --tool-pid PID` with its end of a socket at [`GUARDIAN_FD`], and waits until
    /// it watches us.
    pub fn spawn(exe: &Path) -> Result<Guardian, Error> {
        Guardian::spawn_logging(exe, Stdio::inherit())
    }

    /// [`Guardian::spawn`] with the guardian's reports going to `stderr` instead of ours: a tool whose
    /// output is read to its end by its caller (an engine running its runtime) must not leave the
    /// guardian holding that output, or the caller would wait for the guardian.
    pub fn spawn_logging(exe: &Path, stderr: Stdio) -> Result<Guardian, Error> {
        let spawn_err = |source| Error::Spawn {
            exe: exe.display().to_string(),
            source,
        };
        let (ours, theirs) = UnixStream::pair().map_err(spawn_err)?;
        let fd = theirs.as_raw_fd();
        let mut cmd = Command::new(exe);
        cmd.arg("guardian")
            .arg("--tool-pid")
            .arg(std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        // SAFETY: between fork and exec only async-signal-safe calls: dup2, setsid.
        unsafe {
            cmd.pre_exec(move || {
                // dup2 clears close-on-exec on the copy; a socket already at 3 keeps its flag, so clear it.
                if fd == GUARDIAN_FD {
                    libc::fcntl(fd, libc::F_SETFD, 0);
                } else if libc::dup2(fd, GUARDIAN_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Its own session: a terminal's Ctrl-C or hang-up reaches the tool, not the guardian.
                libc::setsid();
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(spawn_err)?;
        drop(theirs);
        ours.set_read_timeout(Some(ANSWER_TIMEOUT))
            .map_err(spawn_err)?;
        let g = Guardian {
            sock: std::sync::Mutex::new(BufReader::new(ours)),
            child,
        };
        g.answer()
            .map_err(|e| Error::Lost(format!("it did not start: {e}")))?;
        Ok(g)
    }

    /// Reads the guardian's one-line answer.
    fn answer(&self) -> std::io::Result<()> {
        let mut sock = self.sock.lock().unwrap_or_else(|p| p.into_inner());
        let mut line = String::new();
        sock.read_line(&mut line)?;
        if line.trim() == "ok" {
            Ok(())
        } else {
            Err(std::io::Error::other(format!("answered {line:?}")))
        }
    }
}

impl Watch for Guardian {
    fn tell(&self, event: &Event) -> Result<(), Error> {
        let mut line = serde_json::to_string(event).map_err(|e| Error::Lost(e.to_string()))?;
        line.push('\n');
        self.sock
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut()
            .write_all(line.as_bytes())
            .map_err(|e| Error::Lost(e.to_string()))?;
        self.answer().map_err(|e| Error::Lost(e.to_string()))
    }
}

impl Drop for Guardian {
    fn drop(&mut self) {
        if let Err(e) = self.tell(&Event::Done) {
            tracing::debug!("telling the guardian we are done: {e}");
        }
        let _ = self.child.wait();
    }
}

/// A checkpoint's tree, held through pidfds.
struct Tree {
    /// Every process: what a durable checkpoint stops.
    all: Held,
    /// Those that ran before the checkpoint: what an undone one continues.
    running: Held,
    leave_running: bool,
}

/// See [`Event::EnginePaused`]: the runtime's command lines for the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnginePaused {
    /// Prints the container's state (`runc state ID`: JSON with `status`).
    pub state: Vec<String>,
    pub resume: Vec<String>,
    pub pause: Vec<String>,
}

/// How long the guardian waits for the engine to resume the container it paused.
const ENGINE_RESUME_WAIT: Duration = Duration::from_secs(30);

impl EnginePaused {
    fn paused(&self) -> bool {
        let Some((program, args)) = self.state.split_first() else {
            return false;
        };
        Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
            .ok()
            .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
            .is_some_and(|v| v["status"] == "paused")
    }

    /// Waits for the engine's resume; returns whether the guardian had to resume the container itself
    /// (it pauses it again once the GPU state is back: [`EnginePaused::pause_again`]).
    fn wait_for_engine(&self) -> bool {
        let until = std::time::Instant::now() + ENGINE_RESUME_WAIT;
        while std::time::Instant::now() < until {
            if !self.paused() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        resume_container(&self.resume, true);
        true
    }

    fn pause_again(&self) {
        if let Some((program, args)) = self.pause.split_first() {
            let _ = Command::new(program)
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// What the guardian knows: only what it was told.
#[derive(Default)]
struct Watched {
    tree: Option<Tree>,
    gpu: Option<GpuBackend>,
    durable: bool,
    restore: Option<Vec<i32>>,
    /// The command that resumes the tree's paused container.
    resume: Option<Vec<String>>,
    /// The container its engine paused.
    engine_paused: Option<EnginePaused>,
    sandbox: Option<SandboxUndo>,
    /// The images of the runtime's checkpoint that stops the sandbox.
    stopping: Option<std::path::PathBuf>,
    /// What CRIU's dump left of the tree's network.
    network: Option<crate::dump::NetworkHold>,
    /// A container restore under way.
    container_restore: Option<RestoreUndo>,
    /// Copies of a restore's userfaultfds ([`Event::Memory`]).
    memory: Vec<OwnedFd>,
}

/// The guardian's life, run by the binary's hidden `guardian` command: `sock` is its end of the socket,
/// `tool` the PID of the tool it watches. Returns the exit code.
pub fn serve(sock: OwnedFd, tool: i32) -> i32 {
    become_unkillable();
    let tool_fd = match tree::pidfd_open(tool) {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!("gpu-checkpoint guardian: cannot watch pid {tool}: {e}");
            return 1;
        }
    };
    let sock = UnixStream::from(sock);
    let mut reader = BufReader::new(match sock.try_clone() {
        Ok(s) => s,
        Err(_) => return 1,
    });
    let mut writer = sock;
    if writer.write_all(b"ok\n").is_err() {
        return 1;
    }
    let mut watched = Watched::default();
    loop {
        let mut fds = [
            libc::pollfd {
                fd: reader.get_ref().as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: tool_fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Data first: a tool that said Done and exited must not be mistaken for one that died.
        // SAFETY: two valid pollfds.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            continue; // EINTR
        }
        if fds[0].revents != 0 {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => {} // the tool closed its end or died: see below
                Ok(_) => match serde_json::from_str::<Event>(&line) {
                    Ok(Event::Done) => {
                        let _ = writer.write_all(b"ok\n");
                        return 0;
                    }
                    Ok(event) => {
                        watched.record(event, &tool_fd);
                        let _ = writer.write_all(b"ok\n");
                        continue;
                    }
                    Err(e) => {
                        let _ = writer.write_all(format!("bad event: {e}\n").as_bytes());
                        continue;
                    }
                },
            }
        }
        // The socket closed without Done, or the tool exited: the tool is dead.
        watched.tool_died(tool);
        return 0;
    }
}

impl Watched {
    fn record(&mut self, event: Event, tool: &OwnedFd) {
        match event {
            Event::Checkpoint {
                pids,
                leave_running,
                stopped,
            } => {
                let running: Vec<i32> = pids
                    .iter()
                    .copied()
                    .filter(|p| !stopped.contains(p))
                    .collect();
                self.tree = Some(Tree {
                    all: Held::open(&pids),
                    running: Held::open(&running),
                    leave_running,
                });
            }
            Event::Gpu { backend } => self.gpu = Some(backend),
            Event::Paused { resume } => self.resume = Some(resume),
            Event::EnginePaused(e) => self.engine_paused = Some(e),
            Event::Sandbox(s) => self.sandbox = Some(s),
            Event::Stopping { images } => self.stopping = Some(images),
            Event::Network(hold) => self.network = Some(hold),
            Event::Durable => self.durable = true,
            Event::Restore { pids } => self.restore = Some(pids),
            Event::Memory { fds } => {
                for fd in fds {
                    match tree::pidfd_getfd(tool, fd) {
                        Ok(copy) => self.memory.push(copy),
                        Err(e) => eprintln!(
                            "gpu-checkpoint guardian: cannot hold the tool's descriptor {fd}: {e}"
                        ),
                    }
                }
            }
            Event::MemoryIn => self.memory.clear(),
            Event::ContainerRestore(undo) => self.container_restore = Some(undo),
            Event::Restored => self.container_restore = None,
            Event::Done => {}
        }
    }

    fn tool_died(&self, tool: i32) {
        let say =
            |what: &str| eprintln!("gpu-checkpoint guardian: the tool (pid {tool}) died; {what}");
        if let Some(undo) = &self.container_restore {
            say(&format!("undid the container restore: {}", undo.undo()));
            return;
        }
        if let Some(pids) = &self.restore {
            let killed = kill_restored_copy(pids);
            say(&format!(
                "killed the half-restored copy ({} processes); the checkpoint is intact",
                killed
            ));
            return;
        }
        let Some(tree) = &self.tree else {
            return;
        };
        if self.durable {
            if let Some(resume) = &self.resume {
                resume_container(resume, true);
            }
            if !tree.leave_running {
                let left = tree.all.kill(Duration::from_secs(10));
                say(&format!(
                    "the checkpoint was durable: stopped the tree as promised{}",
                    if left.is_empty() {
                        String::new()
                    } else {
                        format!(" (PIDs {left:?} still run)")
                    }
                ));
            }
            return;
        }
        // Not durable: never after the commit, where the sandbox (stopped or running on) is as promised.
        let sandbox = self
            .sandbox
            .as_ref()
            .map(|s| format!("; {}", s.undo(self.stopping.as_deref())));
        if sandbox.is_none() {
            // CRIU may still hold the tree (a dump in progress when the tool died fails or finishes by
            // itself): a continue sent meanwhile would be lost. (A sandbox is dumped by its runtime,
            // not CRIU, and its sentry traces its own processes on the ptrace platform.)
            wait_untraced(&tree.all.pids(), CRIU_LET_GO);
        }
        if let Some(hold) = &self.network {
            let n = hold.release();
            say(&format!(
                "took {n} TCP sockets out of repair mode and unlocked the network"
            ));
        }
        if let Some(resume) = &self.resume {
            resume_settled(resume, &tree.all.pids());
        }
        let resumed_for_the_engine = self
            .engine_paused
            .as_ref()
            .is_some_and(EnginePaused::wait_for_engine);
        tree.running.continue_all();
        let thawed = self.gpu.map(|b| thaw_gpu(b, &tree.all.pids())).unwrap_or(0);
        // The GPU restore runs in the processes themselves; continue again in case one was stopped meanwhile.
        tree.running.continue_all();
        if let Some(e) = self
            .engine_paused
            .as_ref()
            .filter(|_| resumed_for_the_engine)
        {
            e.pause_again();
        }
        say(&format!(
            "the checkpoint was not durable: resumed the tree ({} processes) and put back the GPU state of {thawed}{}",
            tree.running.pids().len(),
            sandbox.unwrap_or_default()
        ));
    }
}

/// How long after resuming a paused container the guardian keeps resuming it again (see
/// [`resume_settled`]).
const RESUME_AGAIN: Duration = Duration::from_secs(3);

/// Resumes the paused container once CRIU has let go of it, and again for [`RESUME_AGAIN`]: a CRIU that
/// was still starting when the tool died (its dump fails on the broken image pipes, or runc's finishes)
/// seizes the tree later and, letting go, puts the container's freezer back as it found it, frozen. A
/// resume of a running container fails and changes nothing.
fn resume_settled(argv: &[String], pids: &[i32]) {
    resume_container(argv, true);
    let until = std::time::Instant::now() + RESUME_AGAIN;
    while std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
        wait_untraced(pids, CRIU_LET_GO);
        resume_container(argv, false);
    }
}

/// Runs the command that resumes a paused container (its runtime's `resume`); a container that runs
/// already makes it fail, which changes nothing (said only when `say`).
fn resume_container(argv: &[String], say: bool) {
    let Some((program, args)) = argv.split_first() else {
        return;
    };
    match Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(st) if st.success() => eprintln!("gpu-checkpoint guardian: resumed the container"),
        Ok(_) if !say => {}
        Ok(st) => eprintln!("gpu-checkpoint guardian: `{}` {st}", argv.join(" ")),
        Err(e) => eprintln!("gpu-checkpoint guardian: cannot run {program}: {e}"),
    }
}

/// Deaf to every catchable signal, in its own session already, and last in line for the OOM killer: the
/// guardian must outlive what kills the tool.
fn become_unkillable() {
    for sig in 1..=libc::SIGRTMAX() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP || sig == libc::SIGCHLD {
            continue;
        }
        // SAFETY: ignoring a signal has no memory-safety preconditions; invalid numbers fail harmlessly.
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        tracing::debug!("guardian: oom_score_adj: {e}");
    }
}

/// Waits until no process of `pids` is traced (CRIU seizes them with ptrace while it dumps).
fn wait_untraced(pids: &[i32], timeout: Duration) {
    tree::wait_until(timeout, || {
        pids.iter()
            .copied()
            .filter(|&p| tracer(p).is_some_and(|t| t != 0))
            .collect()
    });
}

/// `TracerPid` of `/proc/PID/status`; `None` when the process is gone.
fn tracer(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// Puts back the GPU state of every process of `pids` the driver says is locked or checkpointed; returns
/// how many. Asked of the driver, not remembered: the tool may have died at any point of the freeze.
fn thaw_gpu(backend: GpuBackend, pids: &[i32]) -> usize {
    match crate::freeze::open(backend) {
        Ok(driver) => put_back_gpu(&*driver, pids),
        Err(e) => {
            eprintln!("gpu-checkpoint guardian: cannot open the GPU backend {backend}: {e}");
            0
        }
    }
}

/// [`thaw_gpu`] through `driver` (also the tool inside a sandbox, on guest PIDs).
pub(crate) fn put_back_gpu(driver: &dyn GpuDriver, pids: &[i32]) -> usize {
    let mut thawed = 0;
    for &pid in pids {
        let done = match driver.state(pid) {
            Ok(ProcessState::Checkpointed) => {
                driver.restore(pid, &[]).and_then(|()| driver.unlock(pid))
            }
            Ok(ProcessState::Locked) => driver.unlock(pid),
            _ => continue,
        };
        match done {
            Ok(()) => thawed += 1,
            Err(e) => {
                eprintln!("gpu-checkpoint guardian: putting back the GPU state of pid {pid}: {e}")
            }
        }
    }
    thawed
}

/// Kills the processes holding `pids` that started after this guardian (the copy a restore was creating:
/// the PIDs were checked free before), until none is left; returns how many were killed.
fn kill_restored_copy(pids: &[i32]) -> usize {
    let me = tree::stat(std::process::id() as i32).map_or(0, |s| s.start_ticks);
    let mut killed = 0;
    // CRIU may still be creating processes: look again until a round finds none.
    for _ in 0..50 {
        let copy: Vec<i32> = pids
            .iter()
            .copied()
            .filter(|&p| tree::stat(p).is_some_and(|s| !s.is_dying() && s.start_ticks >= me))
            .collect();
        if copy.is_empty() {
            break;
        }
        killed += copy.len();
        Held::open(&copy).kill(Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(100));
    }
    killed
}

/// The guardian's socket handed over at [`GUARDIAN_FD`] (for the binary's `guardian` command).
///
/// # Safety
/// Descriptor [`GUARDIAN_FD`] must be the socket [`Guardian::spawn`] passed, owned by nothing else.
pub unsafe fn inherited_socket() -> OwnedFd {
    // SAFETY: the caller promises the descriptor is ours.
    unsafe { OwnedFd::from_raw_fd(GUARDIAN_FD) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_travel_as_one_json_line_each() {
        for e in [
            Event::Checkpoint {
                pids: vec![4, 5],
                leave_running: true,
                stopped: vec![5],
            },
            Event::Gpu {
                backend: GpuBackend::Sim,
            },
            Event::Paused {
                resume: vec!["runc".into(), "resume".into(), "c1".into()],
            },
            Event::Sandbox(SandboxUndo {
                runtime: serde_json::from_value(serde_json::json!({"kind": "runsc",
                    "binary": "/usr/sbin/runsc", "criu": null, "root": "/run/r",
                    "extra": ["--platform=ptrace"]}))
                .unwrap(),
                id: "s1".into(),
                bundle: "/b".into(),
                tcp_established: false,
                gpu_tool: Some("/bin/cuda-checkpoint".into()),
                gpu_pids: vec![1, 7],
            }),
            Event::Stopping {
                images: "/store/container-work/x.1".into(),
            },
            Event::Durable,
            Event::Restore { pids: vec![7] },
            Event::ContainerRestore(RestoreUndo {
                runtime: serde_json::from_value(serde_json::json!({"kind": "runc",
                    "binary": "/usr/sbin/runc", "criu": "/usr/sbin/criu", "root": "/run/r",
                    "extra": [], "restore_proxy": "/usr/bin/gpu-checkpoint"}))
                .unwrap(),
                id: "c1".into(),
                work: "/store/container-work/x.2".into(),
            }),
            Event::Restored,
            Event::Done,
        ] {
            let line = serde_json::to_string(&e).unwrap();
            assert!(!line.contains('\n'));
            assert_eq!(serde_json::from_str::<Event>(&line).unwrap(), e);
        }
    }

    #[test]
    fn a_tracer_is_read_from_status() {
        assert_eq!(tracer(std::process::id() as i32), Some(0));
        assert_eq!(tracer(i32::MAX - 1), None);
    }
}
