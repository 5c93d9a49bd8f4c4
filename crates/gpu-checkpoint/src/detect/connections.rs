//! Who the processes in scope are connected to: their TCP sockets (`net/tcp`, `net/tcp6` of each network
//! namespace) and the UNIX sockets whose peer lies outside the scope (the live kernel's
//! [`super::unix_diag`]). [`super::needs`] turns them into `needs-option` findings.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use super::needs::ExternalPeer;
use super::parse::{parse_net_tcp, socket_inode, TcpSocket};
use super::process::ProcessSnapshot;
use super::source::ProcRoot;
use super::unix_diag::{self, UnixSocket};

/// TCP sockets by inode, read per network namespace and only for processes that hold sockets: a server's
/// `net/tcp` can be long, and every process of a tree usually shares one namespace.
pub struct TcpTables<'a> {
    root: &'a ProcRoot,
    by_netns: RefCell<HashMap<String, Rc<HashMap<u64, TcpSocket>>>>,
}

impl<'a> TcpTables<'a> {
    pub fn new(root: &'a ProcRoot) -> Self {
        TcpTables {
            root,
            by_netns: RefCell::default(),
        }
    }

    /// The TCP sockets visible to process `snap` (none when it holds no socket).
    pub fn of(&self, snap: &ProcessSnapshot) -> Rc<HashMap<u64, TcpSocket>> {
        if !snap.fds.iter().any(|(_, t)| socket_inode(t).is_some()) {
            return Rc::default();
        }
        let pid = snap.pid;
        // A captured tree has no `ns/net` link: read its files each time.
        let netns = std::fs::read_link(self.root.pid_file(pid, "ns/net"))
            .ok()
            .map(|l| l.to_string_lossy().into_owned());
        if let Some(t) = netns
            .as_ref()
            .and_then(|n| self.by_netns.borrow().get(n).cloned())
        {
            return t;
        }
        let mut table = HashMap::new();
        let mut buf = Vec::new();
        for file in ["net/tcp", "net/tcp6"] {
            if let Ok(true) = self.root.read_optional(pid, file, &mut buf) {
                table.extend(parse_net_tcp(&buf).into_iter().map(|s| (s.inode, s)));
            }
        }
        let table = Rc::new(table);
        if let Some(n) = netns {
            self.by_netns.borrow_mut().insert(n, Rc::clone(&table));
        }
        table
    }
}

/// The UNIX sockets of the processes in scope whose peer is not one of theirs.
#[derive(Default)]
pub struct ExternalPeers {
    kernel: HashMap<u64, UnixSocket>,
    in_scope: HashSet<u64>,
}

impl ExternalPeers {
    /// Asks the kernel about the sockets of `snaps` when they are this machine's processes (`live`) and
    /// hold any. What cannot be asked (no sock_diag) is a note; nothing is then reported.
    pub fn of(snaps: &[ProcessSnapshot], live: bool, notes: &mut Vec<String>) -> Self {
        let in_scope: HashSet<u64> = snaps
            .iter()
            .flat_map(|s| s.fds.iter().filter_map(|(_, t)| socket_inode(t)))
            .collect();
        if !live || in_scope.is_empty() {
            return ExternalPeers::default();
        }
        match unix_diag::unix_sockets() {
            Ok(kernel) => ExternalPeers { kernel, in_scope },
            Err(e) => {
                notes.push(format!(
                    "UNIX socket peers not checked (NETLINK_SOCK_DIAG: {e})"
                ));
                ExternalPeers::default()
            }
        }
    }

    /// The peer of socket `inode` when it is connected outside the scope.
    pub fn peer(&self, inode: u64) -> Option<ExternalPeer> {
        let s = self.kernel.get(&inode)?;
        if s.peer == 0 || self.in_scope.contains(&s.peer) {
            return None;
        }
        Some(ExternalPeer {
            dgram: s.kind == libc::SOCK_DGRAM as u8,
            peer: s.peer,
            peer_name: self.kernel.get(&s.peer).and_then(|p| p.name.clone()),
        })
    }
}
