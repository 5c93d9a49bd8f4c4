//! Live processes as /proc shows them: one parser of `/proc/PID/stat` (detection reads it through its
//! `ProcRoot`, the flows here), who is in the tree rooted at a PID, what holds a PID, and the signals the
//! flows send to a tree (continue, kill) with the wait for it to be gone.
//!
//! A leaf module like `util`: stages and flows both use it, and it uses neither.

use std::collections::HashMap;
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
    /// The number of threads; 0 when the line stops before that field (a truncated capture).
    pub threads: u32,
    /// The kernel's `PF_*` flags of the (main) thread.
    pub flags: u64,
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
    let threads = rest.get(17).and_then(|s| s.parse().ok()).unwrap_or(0);
    Ok(ProcStat {
        pid,
        comm,
        state,
        ppid,
        threads,
        flags,
    })
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

fn signal(pids: &[i32], sig: i32) {
    for &pid in pids {
        // SAFETY: kill has no memory-safety preconditions; a PID that is already gone answers ESRCH.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Continues a tree CRIU left stopped (`leave_stopped`).
pub fn continue_tree(pids: &[i32]) {
    signal(pids, libc::SIGCONT);
}

/// Kills a tree and waits until none of its processes runs any more (they may stay zombies until their
/// parent reaps them). Returns the PIDs still running after `timeout`.
///
/// Returns once every process is dying, not once it is gone: a checkpoint does not wait for the kernel to
/// free the process's memory (7% of a 4 GiB checkpoint). `criu dump` waits for even less (it sends SIGKILL
/// while detaching and returns). `restore` waits for a PID held by a dying process.
pub fn kill_tree(pids: &[i32], timeout: Duration) -> Vec<i32> {
    signal(pids, libc::SIGKILL);
    wait_until(timeout, || {
        pids.iter().copied().filter(|p| is_alive(*p)).collect()
    })
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
}
