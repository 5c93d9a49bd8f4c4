//! What CRIU dumps only when told: held file locks, large deleted files, established TCP connections, UNIX
//! sockets connected outside the tree. Each becomes a `needs-option` finding naming the checkpoint flag,
//! so that a user learns it from `detect` (and the checkpoint refuses before freezing anything), not from
//! CRIU's log after the tree was frozen.
//!
//! One row of `CHECKS` per kind of resource; each reads what [`super::process`] gathered and what the
//! caller knows about the process's sockets ([`ClassifyContext`]).

use super::finding::{Evidence, FindingKind, NeededOption};
use super::parse::{socket_inode, tcp_address, TcpSocket, TCP_CONNECTED_STATES};
use super::process::ProcessSnapshot;
use crate::fmt::human_bytes;

/// CRIU's default `--ghost-limit`: deleted files up to this size are copied into the images without it.
pub const CRIU_GHOST_LIMIT: u64 = 1 << 20;

/// A UNIX socket of the process connected to one outside the processes in scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExternalPeer {
    /// A datagram socket (CRIU's `--ext-unix-sk` covers those, when the peer has a name).
    pub dgram: bool,
    /// The peer's inode.
    pub peer: u64,
    /// The name the peer is bound to, if any.
    pub peer_name: Option<String>,
}

/// What classification needs besides the process itself.
pub struct ClassifyContext<'a> {
    /// Recognise the GPU simulator's devices (tests and demos only).
    pub simulator: bool,
    /// Path of a UNIX socket inode (from `net/unix`), when it has one.
    pub socket_path: &'a dyn Fn(u64) -> Option<String>,
    /// The TCP socket of an inode (from the process's `net/tcp` and `net/tcp6`).
    pub tcp_socket: &'a dyn Fn(u64) -> Option<TcpSocket>,
    /// The peer of a UNIX socket inode when it lies outside the processes in scope (live /proc only).
    pub external_peer: &'a dyn Fn(u64) -> Option<ExternalPeer>,
}

type Check = fn(&ProcessSnapshot, &ClassifyContext<'_>) -> Vec<Evidence>;

/// Each kind of resource CRIU dumps only with an option, in report order.
const CHECKS: &[Check] = &[
    file_locks,
    ghost_files,
    tcp_connections,
    external_unix_sockets,
];

/// The `needs-option` findings of one process.
pub fn findings(snap: &ProcessSnapshot, ctx: &ClassifyContext<'_>) -> Vec<(FindingKind, Evidence)> {
    CHECKS
        .iter()
        .flat_map(|check| check(snap, ctx))
        .map(|e| (FindingKind::NeedsOption, e))
        .collect()
}

/// The evidence of a need: `remedy` names the flag.
fn need(needs: NeededOption, detail: String, remedy: String) -> Evidence {
    Evidence {
        detail,
        needs: Some(needs),
        remedy: Some(remedy),
        ..Default::default()
    }
}

fn fd_list(fds: &[i32]) -> String {
    let s: Vec<String> = fds.iter().map(|f| f.to_string()).collect();
    match s.len() {
        1 => format!("fd {}", s[0]),
        _ => format!("fds {}", s.join(", ")),
    }
}

/// Any lock: CRIU refuses the whole dump ("Some file locks are hold by dumping tasks").
fn file_locks(snap: &ProcessSnapshot, _: &ClassifyContext<'_>) -> Vec<Evidence> {
    let Some((first_fd, first_lock)) = snap.locks.first() else {
        return Vec::new();
    };
    let fds: Vec<i32> = snap.locks.iter().map(|(fd, _)| *fd).collect();
    let path = snap
        .fds
        .iter()
        .find(|(fd, _)| fd == first_fd)
        .map(|(_, p)| p.clone());
    let detail = format!(
        "{} {} file locks (fd {first_fd}: {} on {})",
        fd_list(&fds),
        if fds.len() == 1 { "holds" } else { "hold" },
        first_lock,
        path.as_deref().unwrap_or("?")
    );
    let need = NeededOption::FileLocks;
    let remedy = format!(
        "add {} to the checkpoint: CRIU dumps and restores the locks with it (restore applies it again \
         from the checkpoint)",
        need.flag()
    );
    vec![Evidence {
        fds,
        path,
        ..self::need(need, detail, remedy)
    }]
}

/// Deleted files over CRIU's default limit, open or mapped ("Can't dump ghost file ... increase limit").
fn ghost_files(snap: &ProcessSnapshot, _: &ClassifyContext<'_>) -> Vec<Evidence> {
    let open = snap
        .deleted
        .iter()
        .map(|d| (d.size, &d.path, vec![d.fd], format!("fd {}", d.fd)));
    let mapped = snap.deleted_maps.iter().map(|d| {
        (
            d.size,
            &d.path,
            vec![],
            format!("the mapping at {}", d.range),
        )
    });
    open.chain(mapped)
        .filter_map(|(size, path, fds, what)| {
            let size = size.filter(|s| *s > CRIU_GHOST_LIMIT)?;
            let need = NeededOption::GhostLimit { bytes: size };
            let detail = format!(
                "{what} is a deleted file holding {} on disk: {path} (CRIU copies deleted files into the \
                 images only up to {} by default)",
                human_bytes(size),
                human_bytes(CRIU_GHOST_LIMIT)
            );
            let remedy = format!(
                "add {} to the checkpoint, so that CRIU copies its {} into the images",
                need.flag(),
                human_bytes(size)
            );
            Some(Evidence {
                fds,
                path: Some(path.clone()),
                size: Some(size),
                ..self::need(need, detail, remedy)
            })
        })
        .collect()
}

/// TCP connections past the handshake ("Connected TCP socket, consider using --tcp-established").
fn tcp_connections(snap: &ProcessSnapshot, ctx: &ClassifyContext<'_>) -> Vec<Evidence> {
    let mut fds = Vec::new();
    let mut shown = Vec::new();
    for (fd, target) in &snap.fds {
        let Some(sock) = socket_inode(target).and_then(|i| (ctx.tcp_socket)(i)) else {
            continue;
        };
        if TCP_CONNECTED_STATES.contains(&sock.state) {
            fds.push(*fd);
            if shown.len() < 3 {
                shown.push(format!(
                    "fd {fd} {} -> {}",
                    tcp_address(&sock.local),
                    tcp_address(&sock.remote)
                ));
            }
        }
    }
    if fds.is_empty() {
        return Vec::new();
    }
    let more = if fds.len() > shown.len() { ", ..." } else { "" };
    let detail = format!(
        "{} established TCP connection(s): {}{more}",
        fds.len(),
        shown.join(", ")
    );
    let need = NeededOption::TcpEstablished;
    let remedy = format!(
        "add {} to the checkpoint to bring the connections back (or --tcp-close to restore them closed)",
        need.flag()
    );
    vec![Evidence {
        fds,
        ..self::need(need, detail, remedy)
    }]
}

/// UNIX sockets whose peer CRIU will not dump ("External socket is used"; "Can't dump half of stream
/// unix connection").
fn external_unix_sockets(snap: &ProcessSnapshot, ctx: &ClassifyContext<'_>) -> Vec<Evidence> {
    let mut out = Vec::new();
    for (fd, target) in &snap.fds {
        let Some(inode) = socket_inode(target) else {
            continue;
        };
        let Some(p) = (ctx.external_peer)(inode) else {
            continue;
        };
        let peer = p
            .peer_name
            .clone()
            .unwrap_or_else(|| format!("unnamed socket {}", p.peer));
        let (need, remedy) = match (&p.peer_name, p.dgram) {
            (Some(name), true) => {
                let need = NeededOption::ExtUnixSk { inode };
                let remedy = format!(
                    "add {} (or --external unix[{inode}]) to the checkpoint: CRIU then reconnects it to \
                     {name} on restore",
                    need.flag()
                );
                (need, remedy)
            }
            _ => {
                let need = NeededOption::External {
                    resource: format!("unix[{inode}]"),
                };
                let remedy = format!(
                    "CRIU dumps one end of a connection only as external ({}), and its restore then needs \
                     a socket handed over in its place (criu restore --inherit-fd), which gpu-checkpoint \
                     restore does not do: close the connection before the checkpoint, or checkpoint a tree \
                     that holds both ends",
                    need.flag()
                );
                (need, remedy)
            }
        };
        let detail = format!(
            "fd {fd} is a UNIX {} socket connected to {peer}, outside the processes checkpointed",
            if p.dgram { "datagram" } else { "stream" },
        );
        out.push(Evidence {
            fds: vec![*fd],
            socket: p.peer_name.clone(),
            ..self::need(need, detail, remedy)
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::parse::TcpSocket;
    use crate::detect::process::DeletedFile;

    fn snap(fds: &[(i32, &str)]) -> ProcessSnapshot {
        crate::detect::process::test_snapshot(100, fds)
    }

    fn run(s: &ProcessSnapshot) -> Vec<Evidence> {
        let tcp = |inode: u64| {
            let state = match inode {
                1 => 0x01, // established
                2 => 0x0a, // listening
                3 => 0x08, // close-wait
                _ => return None,
            };
            Some(TcpSocket {
                inode,
                state,
                local: "0100007F:1F90".into(),
                remote: "0100007F:C350".into(),
            })
        };
        let peers = |inode: u64| match inode {
            10 => Some(ExternalPeer {
                dgram: true,
                peer: 99,
                peer_name: Some("/dev/log".into()),
            }),
            11 => Some(ExternalPeer {
                dgram: false,
                peer: 98,
                peer_name: None,
            }),
            _ => None,
        };
        let ctx = ClassifyContext {
            simulator: false,
            socket_path: &|_| None,
            tcp_socket: &tcp,
            external_peer: &peers,
        };
        findings(s, &ctx).into_iter().map(|(_, e)| e).collect()
    }

    /// Each kind of resource, the option it needs and the flag its remedy names; what CRIU dumps without
    /// an option (a small deleted file, a listening socket, a socket whose peer is in the tree) is no
    /// finding.
    #[test]
    fn each_resource_needs_its_flag() {
        let mut s = snap(&[
            (3, "/var/db/app.db"),
            (4, "socket:[1]"),
            (5, "socket:[2]"),
            (6, "socket:[3]"),
            (7, "socket:[10]"),
            (8, "socket:[11]"),
            (9, "socket:[12]"),
        ]);
        s.locks = vec![(3, "POSIX ADVISORY WRITE 100 08:01:77 0 0".into())];
        s.deleted = vec![
            DeletedFile {
                fd: 20,
                path: "/tmp/big".into(),
                size: Some(2 << 20),
            },
            DeletedFile {
                fd: 21,
                path: "/tmp/small".into(),
                size: Some(1 << 20),
            },
            DeletedFile {
                fd: 22,
                path: "/tmp/unknown".into(),
                size: None,
            },
        ];
        let found = run(&s);
        let needs: Vec<(NeededOption, String)> = found
            .iter()
            .map(|e| (e.needs.clone().unwrap(), e.needs.as_ref().unwrap().flag()))
            .collect();
        assert_eq!(
            needs,
            vec![
                (NeededOption::FileLocks, "--file-locks".into()),
                (
                    NeededOption::GhostLimit { bytes: 2 << 20 },
                    "--ghost-limit 2M".into()
                ),
                (NeededOption::TcpEstablished, "--tcp-established".into()),
                (
                    NeededOption::ExtUnixSk { inode: 10 },
                    "--ext-unix-sk".into()
                ),
                (
                    NeededOption::External {
                        resource: "unix[11]".into()
                    },
                    "--external unix[11]".into()
                ),
            ]
        );
        for e in &found {
            let flag = e.needs.as_ref().unwrap().flag();
            assert!(e.remedy.as_ref().unwrap().contains(&flag), "{e:?}");
            assert!(!e.detail.is_empty());
        }
        assert_eq!(found[0].fds, [3]);
        assert_eq!(found[0].path.as_deref(), Some("/var/db/app.db"));
        assert_eq!(found[1].size, Some(2 << 20));
        // The established and the closing connection, not the listener.
        assert_eq!(found[2].fds, [4, 6]);
        assert!(found[2]
            .detail
            .contains("127.0.0.1:8080 -> 127.0.0.1:50000"));
        assert_eq!(found[3].socket.as_deref(), Some("/dev/log"));
        // Odd sizes round up to whole MiB.
        assert_eq!(
            NeededOption::GhostLimit {
                bytes: (2 << 20) + 1
            }
            .flag(),
            "--ghost-limit 3M"
        );
        assert!(run(&snap(&[(0, "/dev/null"), (1, "pipe:[5]")])).is_empty());
    }
}
