//! Reading one process: the raw facts detection classifies (maps, fds, GPU variables, threads, cgroup).

use super::parse::{self, MapEntry, Stat};
use super::source::ProcRoot;
use super::Error;

/// Everything detection read about one process.
#[derive(Debug, Clone)]
pub struct ProcessSnapshot {
    pub pid: i32,
    pub stat: Stat,
    /// `NSpid` from status: this pid in each nested PID namespace (empty when unknown).
    pub nspid: Vec<i32>,
    pub maps: Vec<MapEntry>,
    pub fds: Vec<(i32, String)>,
    /// GPU-related variables only (see [`parse::GPU_ENV_PREFIXES`]).
    pub env: Vec<(String, String)>,
    pub cgroup: Option<String>,
    /// File locks held through an fd: (fd, its first `lock:` line in fdinfo).
    pub locks: Vec<(i32, String)>,
    /// Open files that were deleted.
    pub deleted: Vec<DeletedFile>,
    /// Mapped files that were deleted (not open through an fd: those are in `deleted`).
    pub deleted_maps: Vec<MappedDeleted>,
    /// Real, effective and saved user and group ids (`Uid:`/`Gid:` of status); `None` when unknown.
    pub creds: Option<Creds>,
    /// The IPC and PID namespaces it is in (`ns/ipc`, `ns/pid` inodes); `None` when the tree has no `ns`
    /// links (captures).
    pub ipc_ns: Option<u64>,
    pub pid_ns: Option<u64>,
    /// The indexes of the pseudo-terminals whose master side it holds (`tty-index` of its `/dev/ptmx` fds).
    pub pty_masters: Vec<u32>,
}

/// User and group ids: real, effective, saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Creds {
    pub uid: [u32; 3],
    pub gid: [u32; 3],
}

/// A mapped file that was deleted (its maps path ends in ` (deleted)`): CRIU copies it into the images,
/// up to `--ghost-limit`, as it does an open one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedDeleted {
    /// The path it had, without ` (deleted)`.
    pub path: String,
    /// Its first mapping (`0xSTART-0xEND`).
    pub range: String,
    /// The bytes it occupies on disk (`st_blocks` × 512, through `map_files`); unknown in a capture.
    pub size: Option<u64>,
}

/// An open file that was deleted (its fd link ends in ` (deleted)`): CRIU copies its contents into the
/// images, up to `--ghost-limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeletedFile {
    pub fd: i32,
    /// The path it had, without ` (deleted)`.
    pub path: String,
    /// The bytes it occupies on disk (`st_blocks` × 512, what CRIU measures against `--ghost-limit`;
    /// less than its length when it is sparse); unknown in a captured tree (the link names a file that
    /// is not there).
    pub size: Option<u64>,
}

/// What an fd link ends with once its file is deleted.
const DELETED: &str = " (deleted)";

/// Reuses read buffers across processes: a node scan reads thousands of small files.
#[derive(Default)]
pub struct Reader {
    buf: Vec<u8>,
}

impl Reader {
    /// `stat` only: cheap, for tree walks and kernel-thread checks.
    pub fn stat(&mut self, root: &ProcRoot, pid: i32) -> Result<Stat, Error> {
        root.read_into(pid, "stat", &mut self.buf)?;
        parse::parse_stat(&self.buf, &root.pid_file(pid, "stat"))
    }

    /// Reads every file detection needs. Rejects kernel threads and thread ids (their /proc folders
    /// exist but they are not processes one can checkpoint).
    pub fn snapshot(&mut self, root: &ProcRoot, pid: i32) -> Result<ProcessSnapshot, Error> {
        let stat = self.stat(root, pid)?;
        if stat.is_kernel_thread() {
            return Err(Error::KernelThread {
                pid,
                comm: stat.comm,
            });
        }
        let mut nspid = Vec::new();
        let mut creds = None;
        if root.read_optional(pid, "status", &mut self.buf)? {
            match tgid(&self.buf) {
                // An exiting task's status shows Tgid 0 once it is unhashed: it is gone.
                Some(0) => {
                    return Err(Error::NoSuchProcess {
                        pid,
                        path: root.pid_file(pid, "status"),
                    })
                }
                Some(tgid) if tgid != pid => return Err(Error::Thread { tid: pid, tgid }),
                _ => {}
            }
            nspid = parse::parse_nspid(&self.buf);
            creds = parse_creds(&self.buf);
        }
        root.read_into(pid, "maps", &mut self.buf)?;
        let maps = parse::parse_maps(&self.buf, &root.pid_file(pid, "maps"))?;
        let fds = root.fds(pid)?;
        let env = if root.read_optional(pid, "environ", &mut self.buf)? {
            parse::parse_gpu_environ(&self.buf)
        } else {
            Vec::new()
        };
        let cgroup = if root.read_optional(pid, "cgroup", &mut self.buf)? {
            parse::parse_cgroup(&self.buf)
        } else {
            None
        };
        let (locks, deleted) = self.open_files(root, pid, &fds);
        let deleted_maps = deleted_maps(root, pid, &maps, &deleted);
        let pty_masters = self.pty_masters(root, pid, &fds);
        Ok(ProcessSnapshot {
            pid,
            stat,
            nspid,
            maps,
            fds,
            env,
            cgroup,
            locks,
            deleted,
            deleted_maps,
            creds,
            ipc_ns: root.ns_inode(pid, "ipc"),
            pid_ns: root.ns_inode(pid, "pid"),
            pty_masters,
        })
    }

    /// The `tty-index` of each `/dev/ptmx` descriptor (best effort: a capture has no fdinfo).
    fn pty_masters(&mut self, root: &ProcRoot, pid: i32, fds: &[(i32, String)]) -> Vec<u32> {
        let mut out = Vec::new();
        for (fd, _) in fds.iter().filter(|(_, t)| is_ptmx(t)) {
            if let Ok(true) = root.read_optional(pid, &format!("fdinfo/{fd}"), &mut self.buf) {
                let text = String::from_utf8_lossy(&self.buf);
                let index: Option<u32> = text
                    .lines()
                    .find_map(|l| l.strip_prefix("tty-index:"))
                    .and_then(|v| v.trim().parse().ok());
                out.extend(index);
            }
        }
        out
    }

    /// The locks held through the fds that name files, and the files among them that were deleted.
    /// Best effort: an fd closed meanwhile, or a capture without fdinfo, shows neither.
    fn open_files(
        &mut self,
        root: &ProcRoot,
        pid: i32,
        fds: &[(i32, String)],
    ) -> (Vec<(i32, String)>, Vec<DeletedFile>) {
        let mut locks = Vec::new();
        let mut deleted = Vec::new();
        // Locks and ghost files are files'; sockets, pipes and anonymous inodes name no path. memfd and
        // SysV segments look deleted but are CRIU's other cases.
        for (fd, target) in fds.iter().filter(|(_, t)| t.starts_with('/')) {
            if let Ok(true) = root.read_optional(pid, &format!("fdinfo/{fd}"), &mut self.buf) {
                if let Some(lock) = parse::fdinfo_lock(&self.buf) {
                    locks.push((*fd, lock));
                }
            }
            let Some(path) = target.strip_suffix(DELETED) else {
                continue;
            };
            if path.starts_with("/memfd:") || path.starts_with("/SYSV") {
                continue;
            }
            deleted.push(DeletedFile {
                fd: *fd,
                path: path.to_string(),
                size: root.fd_file_allocated(pid, *fd),
            });
        }
        (locks, deleted)
    }

    /// `(tid, comm)` of every thread; threads that exit meanwhile are left out.
    pub fn threads(&mut self, root: &ProcRoot, pid: i32) -> Vec<(i32, String)> {
        root.tids(pid)
            .into_iter()
            .filter_map(|tid| {
                root.read_optional(pid, &format!("task/{tid}/comm"), &mut self.buf)
                    .ok()
                    .filter(|found| *found)
                    .map(|_| {
                        (
                            tid,
                            String::from_utf8_lossy(&self.buf).trim_end().to_string(),
                        )
                    })
            })
            .collect()
    }

    /// Direct children of `pid` from `task/*/children` (the live /proc), or `None` when the tree has no
    /// such files (captures): the caller then derives children from every process's ppid.
    pub fn children(&mut self, root: &ProcRoot, pid: i32) -> Option<Vec<i32>> {
        let mut found = false;
        let mut out = Vec::new();
        for tid in root.tids(pid) {
            if let Ok(true) =
                root.read_optional(pid, &format!("task/{tid}/children"), &mut self.buf)
            {
                found = true;
                out.extend(
                    String::from_utf8_lossy(&self.buf)
                        .split_ascii_whitespace()
                        .filter_map(|s| s.parse::<i32>().ok()),
                );
            }
        }
        found.then_some(out)
    }

    /// Reads `maps` raw into the internal buffer and returns it (for the cheap node scan).
    pub fn raw<'a>(&'a mut self, root: &ProcRoot, pid: i32, name: &str) -> Result<&'a [u8], Error> {
        root.read_into(pid, name, &mut self.buf)?;
        Ok(&self.buf)
    }
}

/// A pseudo-terminal's master side, as an fd link names it.
pub fn is_ptmx(target: &str) -> bool {
    target == "/dev/ptmx" || target == "/dev/pts/ptmx"
}

/// The mapped files of `maps` that were deleted and are not among the open ones (`open`), one per path,
/// with their size on disk where the tree can tell (`map_files`, live only).
fn deleted_maps(
    root: &ProcRoot,
    pid: i32,
    maps: &[MapEntry],
    open: &[DeletedFile],
) -> Vec<MappedDeleted> {
    let mut out: Vec<MappedDeleted> = Vec::new();
    for m in maps {
        let Some(path) = m.path.as_deref().filter(|_| m.deleted) else {
            continue;
        };
        // SysV segments, memfd and shared anonymous memory look deleted but are CRIU's other cases.
        let special = !path.starts_with('/')
            || path.starts_with("/SYSV")
            || path.starts_with("/memfd:")
            || path == "/dev/zero";
        if special || open.iter().any(|d| d.path == path) || out.iter().any(|d| d.path == path) {
            continue;
        }
        out.push(MappedDeleted {
            path: path.to_string(),
            range: format!("{:#x}-{:#x}", m.start, m.end),
            size: root.map_file_allocated(pid, m.start, m.end),
        });
    }
    out
}

/// `Uid:` and `Gid:` of a status file (real, effective, saved).
fn parse_creds(status: &[u8]) -> Option<Creds> {
    let text = String::from_utf8_lossy(status);
    let ids = |key: &str| -> Option<[u32; 3]> {
        let line = text.lines().find_map(|l| l.strip_prefix(key))?;
        let v: Vec<u32> = line
            .split_ascii_whitespace()
            .filter_map(|s| s.parse().ok())
            .collect();
        Some([*v.first()?, *v.get(1)?, *v.get(2)?])
    };
    Some(Creds {
        uid: ids("Uid:")?,
        gid: ids("Gid:")?,
    })
}

fn tgid(status: &[u8]) -> Option<i32> {
    String::from_utf8_lossy(status)
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

/// A process with the given fds and nothing else: a session leader, no terminal, ids and namespaces
/// unknown (for the tests of what is made of a snapshot).
#[cfg(test)]
pub(crate) fn test_snapshot(pid: i32, fds: &[(i32, &str)]) -> ProcessSnapshot {
    ProcessSnapshot {
        pid,
        stat: Stat::leader(pid, 1, "app", 'S'),
        nspid: vec![],
        maps: vec![],
        fds: fds.iter().map(|(f, p)| (*f, p.to_string())).collect(),
        env: vec![],
        cgroup: None,
        locks: vec![],
        deleted: vec![],
        deleted_maps: vec![],
        creds: None,
        ipc_ns: None,
        pid_ns: None,
        pty_masters: vec![],
    }
}
