//! Live processes as /proc shows them: one parser of `/proc/PID/stat` (detection reads it through its
//! `ProcRoot`, the flows here), who is in the tree rooted at a PID, what holds a PID, and the signals the
//! flows send to a tree (continue, kill) with the wait for it to be gone.
//!
//! A leaf module like `util`: stages and flows both use it, and it uses neither.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// One process of a checkpointed tree, as recorded in the manifest.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TreeProcess {
    pub pid: i32,
    pub ppid: i32,
    pub comm: String,
    /// The command line, arguments separated by spaces (truncated to 512 bytes).
    pub cmdline: String,
    pub threads: u32,
}

/// What `/proc/PID/stat` says about a process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcStat {
    pub pid: i32,
    pub comm: String,
    /// The state letter: R, S, D, T, t, Z, X, I...
    pub state: char,
    pub ppid: i32,
    /// Process group, session, controlling terminal (`tty_nr`, 0 for none) and the terminal's foreground
    /// process group (`tpgid`, -1 for none): 0 (-1) when the line stops before them.
    pub pgrp: i32,
    pub session: i32,
    pub tty_nr: i32,
    pub tpgid: i32,
    /// The number of threads; 0 when the line stops before that field (a truncated capture).
    pub threads: u32,
    /// The kernel's `PF_*` flags of the (main) thread.
    pub flags: u64,
    /// When the process started, in clock ticks after boot (0 when the line stops before it): with the
    /// PID, it tells a process from a later one that took the same PID.
    pub start_ticks: u64,
}

/// `PF_EXITING`: set as a task enters `do_exit`, before its memory is torn down.
const PF_EXITING: u64 = 0x4;
/// `PF_KTHREAD` from the kernel's `include/linux/sched.h`: set for kernel threads.
pub const PF_KTHREAD: u64 = 0x0020_0000;

impl ProcStat {
    pub fn is_zombie(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }

    /// Killed and on its way out: it runs no more of its own code, but may still be freeing its memory
    /// (a quarter of a second for 4 GiB here), after which it is a zombie until its parent reaps it.
    pub fn is_exiting(&self) -> bool {
        self.flags & PF_EXITING != 0
    }

    /// A zombie or exiting: gone for every purpose but holding its PID.
    pub fn is_dying(&self) -> bool {
        self.is_zombie() || self.is_exiting()
    }

    pub fn is_kernel_thread(&self) -> bool {
        self.flags & PF_KTHREAD != 0
    }
}

/// Parses the content of a `/proc/PID/stat` file; the error says which field is missing. The command name
/// may hold spaces and parentheses, so the fields after it are found from the last `)`.
pub fn parse_stat(text: &str) -> Result<ProcStat, &'static str> {
    let open = text.find('(').ok_or("no '(' before the command name")?;
    let close = text.rfind(')').ok_or("no ')' after the command name")?;
    if close < open {
        return Err("')' before '('");
    }
    let pid = text[..open].trim().parse().map_err(|_| "no pid field")?;
    let comm = text[open + 1..close].to_string();
    // After the name: state(3) ppid(4) ... flags(9) ... num_threads(20), numbered as in proc(5).
    let rest: Vec<&str> = text[close + 1..].split_ascii_whitespace().collect();
    let state = rest
        .first()
        .and_then(|s| s.chars().next())
        .ok_or("no state field")?;
    let ppid = rest
        .get(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no ppid field")?;
    let flags = rest
        .get(6)
        .and_then(|s| s.parse().ok())
        .ok_or("no flags field")?;
    let field = |n: usize, none: i32| rest.get(n).and_then(|s| s.parse().ok()).unwrap_or(none);
    let threads = rest.get(17).and_then(|s| s.parse().ok()).unwrap_or(0);
    let start_ticks = rest.get(19).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok(ProcStat {
        pid,
        comm,
        state,
        ppid,
        pgrp: field(2, 0),
        session: field(3, 0),
        tty_nr: field(4, 0),
        tpgid: field(5, -1),
        threads,
        flags,
        start_ticks,
    })
}

/// Has `cmd` start its process the way a service runs: leading a session of its own, which is what CRIU
/// expects of the root of a tree it dumps (otherwise it wants `--shell-job`, and detect says so).
pub fn in_own_session(cmd: &mut std::process::Command) -> &mut std::process::Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: only setsid (async-signal-safe) between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// `/proc/PID/stat` of a live (or zombie) process; `None` when the PID is free.
pub fn stat(pid: i32) -> Option<ProcStat> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|t| parse_stat(&t).ok())
}

fn cmdline(pid: i32) -> String {
    let mut raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    raw.truncate(512);
    while raw.last() == Some(&0) {
        raw.pop();
    }
    String::from_utf8_lossy(&raw).replace('\0', " ")
}

fn all_stats() -> Vec<ProcStat> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(stat)
        .collect()
}

/// The tree rooted at `root` (root first, then breadth-first), or an empty list when `root` is gone.
pub fn process_tree(root: i32) -> Vec<TreeProcess> {
    let stats = all_stats();
    let mut children: HashMap<i32, Vec<&ProcStat>> = HashMap::new();
    for s in &stats {
        children.entry(s.ppid).or_default().push(s);
    }
    let Some(root_stat) = stats.iter().find(|s| s.pid == root) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut queue = std::collections::VecDeque::from([root_stat]);
    while let Some(s) = queue.pop_front() {
        out.push(TreeProcess {
            pid: s.pid,
            ppid: s.ppid,
            comm: s.comm.clone(),
            cmdline: cmdline(s.pid),
            threads: s.threads,
        });
        if let Some(kids) = children.get(&s.pid) {
            let mut kids = kids.clone();
            kids.sort_by_key(|k| k.pid);
            queue.extend(kids);
        }
    }
    out
}

/// True while `pid` names a process that can still run: neither a zombie nor exiting.
pub fn is_alive(pid: i32) -> bool {
    stat(pid).is_some_and(|s| !s.is_dying())
}

/// Processes held through pidfds (`pidfd_open(2)`), so that a signal meant for them can never reach a
/// process that took one of their PIDs later: between a tree's dump and its kill, or in the guardian,
/// which may act long after it was told the PIDs. A kernel without pidfds (before 5.3) falls back to
/// `kill(2)` by PID.
pub struct Held {
    procs: Vec<(i32, Option<OwnedFd>)>,
}

impl Held {
    /// Opens a pidfd for each of `pids` that still exists (a zombie counts: it still holds its PID).
    pub fn open(pids: &[i32]) -> Held {
        let procs = pids
            .iter()
            .filter_map(|&pid| match pidfd_open(pid) {
                Ok(fd) => Some((pid, Some(fd))),
                Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => Some((pid, None)),
                // Gone already: nothing to signal, and its PID must not be signalled by number.
                Err(_) => None,
            })
            .collect();
        Held { procs }
    }

    /// The PIDs held (those that existed when opened).
    pub fn pids(&self) -> Vec<i32> {
        self.procs.iter().map(|(pid, _)| *pid).collect()
    }

    /// Sends `sig` to every process held; one that has exited since is skipped (ESRCH).
    pub fn signal(&self, sig: i32) {
        for (pid, fd) in &self.procs {
            match fd {
                // SAFETY: pidfd_send_signal with a valid pidfd, no siginfo, no flags.
                Some(fd) => unsafe {
                    libc::syscall(
                        libc::SYS_pidfd_send_signal,
                        fd.as_raw_fd(),
                        sig,
                        std::ptr::null::<libc::siginfo_t>(),
                        0u32,
                    )
                },
                // SAFETY: kill has no memory-safety preconditions; a PID that is gone answers ESRCH.
                None => (unsafe { libc::kill(*pid, sig) }) as libc::c_long,
            };
        }
    }

    /// Continues the processes (a tree CRIU left stopped).
    pub fn continue_all(&self) {
        self.signal(libc::SIGCONT);
    }

    /// Kills the processes and waits until none of them runs any more; see [`kill_tree`]. Returns the
    /// PIDs still running after `timeout`.
    pub fn kill(&self, timeout: Duration) -> Vec<i32> {
        self.signal(libc::SIGKILL);
        let pids = self.pids();
        wait_until(timeout, || {
            pids.iter().copied().filter(|p| is_alive(*p)).collect()
        })
    }
}

/// `pidfd_open(2)`: a descriptor that names this very process, not whoever holds its PID later.
pub fn pidfd_open(pid: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a PID and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A copy of descriptor `fd` of the process `pidfd` refers to (`pidfd_getfd`: root, or a tracer's rights).
pub fn pidfd_getfd(pidfd: &OwnedFd, fd: RawFd) -> std::io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_getfd with a valid pidfd; the result is a new descriptor or -1.
    let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0u32) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(copy as RawFd) })
}

/// Continues a tree CRIU left stopped (`leave_stopped`).
pub fn continue_tree(pids: &[i32]) {
    Held::open(pids).continue_all();
}

/// Kills a tree and waits until none of its processes runs any more (they may stay zombies until their
/// parent reaps them). Returns the PIDs still running after `timeout`.
///
/// Returns once every process is dying, not once it is gone: a checkpoint does not wait for the kernel to
/// free the process's memory (7% of a 4 GiB checkpoint). `criu dump` waits for even less (it sends SIGKILL
/// while detaching and returns). `restore` waits for a PID held by a dying process.
pub fn kill_tree(pids: &[i32], timeout: Duration) -> Vec<i32> {
    Held::open(pids).kill(timeout)
}

/// Waits until `pending()` is empty or `timeout` passed; returns the last `pending()`.
pub fn wait_until(timeout: Duration, mut pending: impl FnMut() -> Vec<i32>) -> Vec<i32> {
    let deadline = Instant::now() + timeout;
    // A killed process is usually dying within a millisecond: poll fast first, then every 20 ms.
    let mut pause = Duration::from_millis(1);
    loop {
        let left = pending();
        if left.is_empty() || Instant::now() >= deadline {
            return left;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// True when `/proc/PID` exists (a process, zombie or not, holds the PID).
pub fn pid_taken(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_odd_names() {
        let s = parse_stat("42 (a (b) c) S 1 42 42 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 3 0 5 0")
            .expect("parses");
        assert!(!s.is_exiting());
        let dying = parse_stat("7 (w) R 1 7 7 0 -1 4194372 1 0 0 0 0 0 0 0 20 0 1 0 5 0").unwrap();
        assert!(dying.is_exiting() && dying.is_dying() && !dying.is_zombie());
        assert_eq!(s.pid, 42);
        assert_eq!(s.comm, "a (b) c");
        assert_eq!(s.state, 'S');
        assert_eq!(s.ppid, 1);
        assert_eq!(s.threads, 3);
        assert_eq!(s.start_ticks, 5);
        assert!(parse_stat("garbage").is_err());
        assert!(parse_stat("1 (x) Z").is_err());
    }

    #[test]
    fn finds_own_tree_with_a_child() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let me = std::process::id() as i32;
        let tree = process_tree(me);
        assert_eq!(tree[0].pid, me);
        assert!(tree
            .iter()
            .any(|p| p.pid == child.id() as i32 && p.comm == "sleep"));
        let left = kill_tree(&[child.id() as i32], Duration::from_secs(5));
        assert!(left.is_empty());
        let _ = child.wait();
        assert!(!pid_taken(child.id() as i32));
    }

    #[test]
    fn held_processes_are_signalled_through_their_pidfd_only() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        let held = Held::open(&[pid, i32::MAX - 1]);
        assert_eq!(held.pids(), vec![pid], "a free PID is not held");
        held.signal(libc::SIGSTOP);
        let stopped = wait_until(Duration::from_secs(5), || {
            if stat(pid).is_some_and(|s| s.state == 'T') {
                vec![]
            } else {
                vec![pid]
            }
        });
        assert!(stopped.is_empty(), "SIGSTOP reached the process");
        held.continue_all();
        assert!(held.kill(Duration::from_secs(5)).is_empty());
        let _ = child.wait();
        // Reaped: the pidfd still names the dead process, never a new holder of the PID.
        held.signal(libc::SIGKILL);
    }
}
