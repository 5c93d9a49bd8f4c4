//! What CRIU cannot dump at all, or only as a shell job, found in /proc before anything is touched: each is
//! a `cannot-dump` finding naming its [`Limit`] and remedy, or a `needs-option` one naming `--shell-job`.
//! Without them CRIU says so only once it has frozen the tree, in its own words:
//!
//! | found | CRIU, after the freeze |
//! |---|---|
//! | an io_uring instance open or mapped | `Unknown shit 600 (anon_inode:[io_uring])` |
//! | SysV shared memory mapped in the IPC namespace CRIU runs in (it dumps SysV IPC only as part of a namespace of the tree's own) | `Task N with SysVIPC shmem map @ADDR doesn't live in IPC ns` |
//! | another user's process, and no `CAP_SYS_RESOURCE` to read its limits | `Can't get rlimit 0: Operation not permitted` |
//! | `/dev/tty` open in a process that does not hold its terminal, or not as its session's foreground | `ctty inheritance detected` |
//! | a root that does not lead its session; a pseudo-terminal whose master is outside the tree | `The root process N is not a session leader`, `Found slave peer index N without correspond master peer` (`--shell-job`) |
//! | a PID namespace whose init is not the root, or whose processes' session leader is outside it | `Can't dump a pid namespace without the process init`, `A session leader of N(1) is outside of its pid namespace` |
//!
//! Checks that depend on who runs the checkpoint (the user, the capabilities, the IPC namespace), and those
//! of sessions, terminals and PID namespaces (which hand-written and partial captures do not keep
//! faithfully) are made only on the live /proc ([`Caller`]), where a checkpoint runs; io_uring is seen in
//! captures too.

use super::finding::{Evidence, Finding, FindingKind, Limit, NeededOption};
use super::process::{Creds, ProcessSnapshot};

/// `CAP_SYS_RESOURCE` (capability bit 24).
const CAP_SYS_RESOURCE: u32 = 24;

/// Who would run CRIU: this process (detection runs in the tool that checkpoints).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    /// `CAP_SYS_RESOURCE` is in its effective set.
    pub cap_sys_resource: bool,
    /// Its IPC namespace's inode.
    pub ipc_ns: Option<u64>,
}

impl Caller {
    /// This process.
    pub fn here() -> Caller {
        // SAFETY: getuid and getgid have no preconditions.
        let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
        Caller {
            uid,
            gid,
            cap_sys_resource: has_cap_sys_resource(),
            ipc_ns: std::fs::read_link("/proc/self/ns/ipc").ok().and_then(|l| {
                l.to_str()?
                    .strip_prefix("ipc:[")?
                    .strip_suffix(']')?
                    .parse()
                    .ok()
            }),
        }
    }
}

/// Whether this process holds `CAP_SYS_RESOURCE` (CRIU, its child, gets the same set); `doctor` says so
/// too.
pub fn has_cap_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_RESOURCE) != 0)
}

/// The findings of this module for the processes `snaps` (`root` first when a tree was asked for; `None`
/// for a node scan, which has no tree), as `(pid, kind, evidence)`; `caller` on the live /proc only.
pub fn findings(
    root: Option<i32>,
    snaps: &[ProcessSnapshot],
    caller: Option<&Caller>,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut add = |pid: i32, kind: FindingKind, evidence: Evidence| {
        out.push(Finding {
            kind,
            pid,
            evidence,
        })
    };
    for s in snaps {
        if let Some(e) = io_uring(s) {
            add(s.pid, FindingKind::CannotDump, e);
        }
        if let Some(c) = caller {
            if let Some(e) = sysv_shm(s, c) {
                add(s.pid, FindingKind::CannotDump, e);
            }
            if let Some(e) = other_user(s, c) {
                add(s.pid, FindingKind::CannotDump, e);
            }
        }
    }
    if let (Some(root), Some(_)) = (root, caller) {
        for (pid, kind, e) in tree_checks(root, snaps) {
            add(pid, kind, e);
        }
    }
    out
}

fn cannot(limit: Limit, detail: String, remedy: &str) -> Evidence {
    Evidence {
        detail,
        limit: Some(limit),
        remedy: Some(remedy.to_string()),
        ..Default::default()
    }
}

const IO_URING: &str = "anon_inode:[io_uring]";

fn io_uring(s: &ProcessSnapshot) -> Option<Evidence> {
    let fds: Vec<i32> = s
        .fds
        .iter()
        .filter(|(_, t)| t == IO_URING)
        .map(|(fd, _)| *fd)
        .collect();
    let mapped = s
        .maps
        .iter()
        .filter(|m| m.path.as_deref() == Some(IO_URING))
        .count();
    if fds.is_empty() && mapped == 0 {
        return None;
    }
    let detail = format!(
        "io_uring instance(s): {} fd(s) {fds:?}, {mapped} ring mapping(s) (CRIU cannot dump io_uring)",
        fds.len()
    );
    Some(Evidence {
        fds,
        ..cannot(
            Limit::IoUring,
            detail,
            "CRIU cannot checkpoint io_uring instances: have the program use another I/O method before \
             the checkpoint (MariaDB: --innodb-use-native-aio=0; many programs fall back to threads when \
             io_uring is unavailable, e.g. under a seccomp profile that denies io_uring_setup)",
        )
    })
}

fn sysv_shm(s: &ProcessSnapshot, c: &Caller) -> Option<Evidence> {
    let (ns, mine) = (s.ipc_ns?, c.ipc_ns?);
    if ns != mine {
        return None;
    }
    let segments: Vec<String> = s
        .maps
        .iter()
        .filter(|m| m.shared && m.path.as_deref().is_some_and(|p| p.starts_with("/SYSV")))
        .map(|m| format!("{:#x}-{:#x}", m.start, m.end))
        .collect();
    let first = segments.first()?;
    let detail = format!(
        "{} SysV shared memory mapping(s) (first at {first}) in the IPC namespace gpu-checkpoint runs in: \
         CRIU dumps SysV IPC only with an IPC namespace of the tree's own",
        segments.len()
    );
    Some(Evidence {
        address: Some(first.clone()),
        ..cannot(
            Limit::SysvShm,
            detail,
            "start the program in an IPC namespace of its own (`unshare --ipc PROGRAM`, as a container \
             has): CRIU then checkpoints and restores the namespace with its SysV segments; a segment \
             of the host's namespace is shared with whoever else uses it",
        )
    })
}

fn other_user(s: &ProcessSnapshot, c: &Caller) -> Option<Evidence> {
    let Creds { uid, gid } = s.creds?;
    // The kernel's check_prlimit_permission: the caller's real ids must be every id of the target.
    let same = uid.iter().all(|u| *u == c.uid) && gid.iter().all(|g| *g == c.gid);
    if same || c.cap_sys_resource {
        return None;
    }
    let detail = format!(
        "runs as uid {} gid {} (real, effective, saved: {uid:?} / {gid:?}), and gpu-checkpoint runs as uid {} \
         without CAP_SYS_RESOURCE: CRIU cannot read its resource limits (\"Can't get rlimit\")",
        uid[1], gid[1], c.uid
    );
    Some(cannot(
        Limit::OtherUser,
        detail,
        "CRIU reads every process's resource limits, which the kernel allows for another user's process \
         only with CAP_SYS_RESOURCE: run gpu-checkpoint with that capability (a container that drops it \
         needs `--cap-add SYS_RESOURCE`, or a privileged one), or run the program as the user \
         gpu-checkpoint runs as",
    ))
}

/// The device number of `/dev/pts/N` (Unix98 pty slaves have majors 136-143).
fn pts_index(tty_nr: i32) -> Option<u32> {
    let major = (tty_nr >> 8) & 0xfff;
    let minor = (tty_nr & 0xff) | ((tty_nr >> 12) & 0xfff00);
    (136..=143)
        .contains(&major)
        .then(|| ((major - 136) * 256 + minor) as u32)
}

/// A `cannot-dump` finding of process `pid`.
fn refuse(pid: i32, limit: Limit, detail: String, remedy: &str) -> (i32, FindingKind, Evidence) {
    (pid, FindingKind::CannotDump, cannot(limit, detail, remedy))
}

/// Checks that need the whole tree: sessions, terminals and PID namespaces.
fn tree_checks(root: i32, snaps: &[ProcessSnapshot]) -> Vec<(i32, FindingKind, Evidence)> {
    let mut out = Vec::new();
    let in_tree = |pid: i32| snaps.iter().any(|s| s.pid == pid);
    let Some(r) = snaps.iter().find(|s| s.pid == root) else {
        return out;
    };
    let masters: Vec<u32> = snaps.iter().flat_map(|s| s.pty_masters.clone()).collect();
    let order = dump_order(root, snaps);
    let depth = |s: &ProcessSnapshot| s.nspid.len().max(1);
    let ns_init = depth(r) > 1 && r.nspid.last() == Some(&1);

    // PID namespaces.
    if depth(r) > 1 && !ns_init {
        out.push(refuse(
            root,
            Limit::PidNamespace,
            format!(
                "process {root} is {} in a PID namespace whose init is not in the tree (CRIU: \
                 \"Can't dump a pid namespace without the process init\")",
                r.nspid.last().copied().unwrap_or(root)
            ),
            "checkpoint the namespace's init, the process that is 1 in it (for a container, \
             `checkpoint --container`)",
        ));
    }
    for s in snaps.iter().filter(|s| depth(s) > depth(r)) {
        out.push(refuse(
            s.pid,
            Limit::PidNamespace,
            format!(
                "process {} is in a PID namespace nested below the tree's (CRIU cannot dump nested \
                 PID namespaces)",
                s.pid
            ),
            "checkpoint the nested namespace's init on its own",
        ));
    }
    if ns_init {
        if let Some(s) = snaps.iter().find(|s| !in_tree(s.stat.session)) {
            out.push(refuse(
                s.pid,
                Limit::PidNamespace,
                format!(
                    "the session leader of process {} ({}) is outside its PID namespace (CRIU: \"A \
                     session leader of {}(1) is outside of its pid namespace\")",
                    s.pid, s.stat.session, s.pid
                ),
                "start the namespace's init in a session of its own: `unshare --fork --pid setsid \
                 PROGRAM`",
            ));
        }
        // The rest (terminals, sessions) is the namespace's own: --shell-job does not apply.
        return out;
    }

    // Sessions and terminals. Session 0 here: the leader is in a PID namespace above the one
    // gpu-checkpoint (and CRIU) runs in, such as the host's session of a container's CI job; CRIU
    // refuses that whatever its options.
    if let Some(s) = snaps.iter().find(|s| s.stat.session == 0) {
        out.push(refuse(
            s.pid,
            Limit::PidNamespace,
            format!(
                "the session leader of process {} is outside the PID namespace gpu-checkpoint runs in \
                 (its session reads 0 here; CRIU: \"A session leader of {}({}) is outside of its pid \
                 namespace\"), which --shell-job does not change",
                s.pid, s.pid, s.pid
            ),
            "start the program in a session of its own (`setsid PROGRAM`), or run gpu-checkpoint in \
             the PID namespace its session began in",
        ));
        return out;
    }
    if r.stat.session != root {
        out.push((
            root,
            FindingKind::NeedsOption,
            shell_job(format!(
                "process {root} does not lead its session ({}): it was started from a shell or service \
                 that shares its session",
                r.stat.session
            )),
        ));
    }
    for s in snaps {
        let slaves: Vec<(i32, u32)> = s
            .fds
            .iter()
            .filter_map(|(fd, t)| Some((*fd, t.strip_prefix("/dev/pts/")?.parse().ok()?)))
            .collect();
        if let Some((fd, n)) = slaves.iter().find(|(_, n)| !masters.contains(n)) {
            out.push((
                s.pid,
                FindingKind::NeedsOption,
                shell_job(format!(
                    "fd {fd} is the terminal /dev/pts/{n}, whose master side no process of the tree holds"
                )),
            ));
        }
        let ctty: Vec<i32> = s
            .fds
            .iter()
            .filter(|(_, t)| t == "/dev/tty")
            .map(|(fd, _)| *fd)
            .collect();
        if ctty.is_empty() {
            continue;
        }
        // CRIU restores /dev/tty through the first descriptor of its terminal (master or slave) that it
        // meets in its dump order (the tree depth first), which must be this process's, and the session
        // must be its terminal's foreground (tty_verify_ctty in criu/tty.c). A tmux server (the root,
        // holding every pane's master) and an interactive shell in a pane (holding /dev/tty) fail it.
        let term = pts_index(s.stat.tty_nr);
        let first = term.and_then(|n| order.iter().find(|p| holds_pty(p, n)).map(|p| p.pid));
        if first != Some(s.pid) || s.stat.tpgid != s.stat.session {
            let why = match first {
                Some(p) if p != s.pid => format!(
                    "process {p} holds that terminal and comes first in CRIU's order, not this one"
                ),
                Some(_) => "its session is not the terminal's foreground".to_string(),
                None => "no process of the tree holds that terminal".to_string(),
            };
            out.push((
                s.pid,
                FindingKind::CannotDump,
                Evidence {
                    fds: ctty.clone(),
                    ..cannot(
                        Limit::Terminal,
                        format!(
                            "fd {} is /dev/tty, the controlling terminal of session {}: {why} (CRIU: \
                             \"ctty inheritance detected\")",
                            ctty[0], s.stat.session
                        ),
                        "CRIU restores /dev/tty only in the first process of the tree that holds its \
                         session's terminal: close /dev/tty in the program (an interactive shell opens it: \
                         run the program itself, not a shell, in a tmux pane or a terminal), or start it \
                         detached from any terminal (`setsid PROGRAM </dev/null >LOG 2>&1`)",
                    )
                },
            ));
        }
    }
    out
}

/// The processes in CRIU's dump order: the tree depth first from the root, children by PID.
fn dump_order(root: i32, snaps: &[ProcessSnapshot]) -> Vec<&ProcessSnapshot> {
    let mut out = Vec::with_capacity(snaps.len());
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        let Some(s) = snaps.iter().find(|s| s.pid == pid) else {
            continue;
        };
        out.push(s);
        let mut kids: Vec<i32> = snaps
            .iter()
            .filter(|c| c.stat.ppid == pid && c.pid != pid)
            .map(|c| c.pid)
            .collect();
        kids.sort_unstable_by(|a, b| b.cmp(a));
        stack.extend(kids);
    }
    out
}

/// Whether `s` holds either side of `/dev/pts/N`.
fn holds_pty(s: &ProcessSnapshot, n: u32) -> bool {
    s.pty_masters.contains(&n)
        || s.fds
            .iter()
            .any(|(_, t)| t.strip_prefix("/dev/pts/") == Some(&n.to_string()))
}

fn shell_job(detail: String) -> Evidence {
    let need = NeededOption::ShellJob;
    Evidence {
        detail,
        remedy: Some(format!(
            "add {} to the checkpoint (CRIU then leaves the session and terminal to whoever restores it, \
             and restore applies it again), or start the program with setsid and its input and output \
             away from a terminal",
            need.flag()
        )),
        needs: Some(need),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(pid: i32, session: i32) -> ProcessSnapshot {
        let mut s = crate::detect::process::test_snapshot(pid, &[]);
        s.stat.pgrp = session;
        s.stat.session = session;
        s.creds = Some(Creds {
            uid: [0; 3],
            gid: [0; 3],
        });
        s.ipc_ns = Some(1);
        s.pid_ns = Some(2);
        s
    }

    fn root_caller() -> Caller {
        Caller {
            uid: 0,
            gid: 0,
            cap_sys_resource: false,
            ipc_ns: Some(1),
        }
    }

    fn kinds(f: &[Finding]) -> Vec<(i32, Option<Limit>, Option<NeededOption>)> {
        f.iter()
            .map(|f| (f.pid, f.evidence.limit, f.evidence.needs.clone()))
            .collect()
    }

    #[test]
    fn io_uring_other_users_and_host_sysv_segments_are_refused() {
        use crate::detect::parse::MapEntry;
        let mut a = snap(10, 10);
        a.fds.push((9, IO_URING.into()));
        let mut b = snap(11, 10);
        b.creds = Some(Creds {
            uid: [101; 3],
            gid: [104; 3],
        });
        b.maps.push(MapEntry {
            start: 0x7f00,
            end: 0x8f00,
            read: true,
            write: true,
            exec: false,
            shared: true,
            offset: 0,
            inode: 4,
            path: Some("/SYSV0052e2c1".into()),
            deleted: true,
        });
        let f = findings(Some(10), &[a.clone(), b.clone()], Some(&root_caller()));
        assert_eq!(
            kinds(&f),
            [
                (10, Some(Limit::IoUring), None),
                (11, Some(Limit::SysvShm), None),
                (11, Some(Limit::OtherUser), None),
            ]
        );
        // With CAP_SYS_RESOURCE, and in an IPC namespace of its own, only io_uring is left.
        b.ipc_ns = Some(7);
        let able = Caller {
            cap_sys_resource: true,
            ..root_caller()
        };
        let f = findings(Some(10), &[a.clone(), b], Some(&able));
        assert_eq!(kinds(&f), [(10, Some(Limit::IoUring), None)]);
        // A captured tree: nothing that depends on the caller, nor the session checks.
        assert_eq!(findings(Some(10), &[snap(12, 5)], None), []);
    }

    #[test]
    fn sessions_and_terminals_need_a_shell_job_or_are_refused() {
        // Not a session leader: --shell-job.
        let f = findings(Some(20), &[snap(20, 5)], Some(&root_caller()));
        assert_eq!(kinds(&f), [(20, None, Some(NeededOption::ShellJob))]);
        // A session that began outside our PID namespace (it reads 0): refused, --shell-job cannot help.
        let mut child = snap(25, 24);
        child.stat.ppid = 24;
        child.stat.session = 0;
        let f = findings(Some(24), &[snap(24, 24), child], Some(&root_caller()));
        assert_eq!(kinds(&f), [(25, Some(Limit::PidNamespace), None)]);
        assert!(
            f[0].evidence.detail.contains("outside the PID namespace"),
            "{f:?}"
        );
        // A pts slave whose master is outside: --shell-job; with the master in the tree: nothing.
        let mut s = snap(21, 21);
        s.fds.push((0, "/dev/pts/3".into()));
        s.stat.tty_nr = (136 << 8) | 3;
        s.stat.tpgid = 21;
        let f = findings(Some(21), &[s.clone()], Some(&root_caller()));
        assert_eq!(kinds(&f), [(21, None, Some(NeededOption::ShellJob))]);
        let mut holder = snap(22, 22);
        holder.pty_masters = vec![3];
        let mut tree = vec![holder.clone(), s.clone()];
        tree[1].stat.ppid = 22;
        assert_eq!(findings(Some(22), &tree, Some(&root_caller())), []);
        // /dev/tty in the process that holds its terminal first, the foreground: fine (the master
        // outside, a shell job); in its child, which does not hold the terminal: ctty inheritance.
        s.fds.push((5, "/dev/tty".into()));
        let f = findings(Some(21), &[s.clone()], Some(&root_caller()));
        assert_eq!(kinds(&f), [(21, None, Some(NeededOption::ShellJob))]);
        let mut child = snap(23, 21);
        child.stat.ppid = 21;
        child.stat.tty_nr = (136 << 8) | 3;
        child.stat.tpgid = 21;
        child.fds.push((3, "/dev/tty".into()));
        let f = findings(Some(21), &[s.clone(), child], Some(&root_caller()));
        assert_eq!(
            kinds(&f),
            [
                (21, None, Some(NeededOption::ShellJob)),
                (23, Some(Limit::Terminal), None)
            ]
        );
        // A tmux server (root, holding the pane's master) and an interactive shell in the pane, which
        // holds /dev/tty and its slave: CRIU meets the server's master first.
        let mut server = snap(40, 40);
        server.pty_masters = vec![7];
        let mut shell = snap(41, 41);
        shell.stat.ppid = 40;
        shell.stat.tty_nr = (136 << 8) | 7;
        shell.stat.tpgid = 41;
        shell.fds = vec![(0, "/dev/pts/7".into()), (10, "/dev/tty".into())];
        let f = findings(
            Some(40),
            &[server.clone(), shell.clone()],
            Some(&root_caller()),
        );
        assert_eq!(kinds(&f), [(41, Some(Limit::Terminal), None)]);
        assert!(
            f[0].evidence
                .detail
                .contains("process 40 holds that terminal"),
            "{f:?}"
        );
        // The same shell without /dev/tty (a program run in the pane): fine.
        shell.fds.pop();
        assert_eq!(
            findings(Some(40), &[server, shell], Some(&root_caller())),
            []
        );
        assert_eq!(pts_index((136 << 8) | 3), Some(3));
        assert_eq!(pts_index((137 << 8) | 1), Some(257));
        assert_eq!(pts_index((4 << 8) | 1), None);
    }

    #[test]
    fn pid_namespaces_need_their_init_and_its_session() {
        // unshare --fork --pid PROGRAM: init of its namespace, its session led by unshare outside.
        let mut init = snap(30, 29);
        init.nspid = vec![30, 1];
        let f = findings(Some(30), &[init.clone()], Some(&root_caller()));
        assert_eq!(kinds(&f), [(30, Some(Limit::PidNamespace), None)]);
        // unshare --fork --pid setsid PROGRAM: fine (and no --shell-job asked of a namespace).
        init.stat.session = 30;
        assert_eq!(findings(Some(30), &[init], Some(&root_caller())), []);
        // A process inside a namespace that is not its init.
        let mut inner = snap(31, 31);
        inner.nspid = vec![31, 5];
        let f = findings(Some(31), &[inner], Some(&root_caller()));
        assert_eq!(kinds(&f), [(31, Some(Limit::PidNamespace), None)]);
    }
}
