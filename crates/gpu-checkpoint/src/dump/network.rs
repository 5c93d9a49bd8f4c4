//! What a dump with `--tcp-established` leaves behind when CRIU leaves the tree stopped, and its release.
//!
//! CRIU puts every established TCP socket of the tree in repair mode (`TCP_REPAIR`) and locks the network
//! so that no segment reaches or leaves the connections while they are dumped. With `--leave-stopped` it
//! keeps both for the kill that follows a durable checkpoint: the connections then end without a FIN or a
//! reset, and a restore takes them over. CRIU's own `network_unlock` (criu/net.c, criu/sk-tcp.c) only runs
//! when the dump fails or the tree is left running. When the checkpoint fails after CRIU's dump, the undo
//! must release them as `network_unlock` would before the tree is continued, or every connection of the
//! continued tree is dead (a write fails with EPIPE in repair mode, the peer's segments are dropped).
//!
//! What the lock is follows from CRIU's choices, read from its dump log (debug level, which we always ask
//! for) where it names them:
//! - a tree in our network namespace: each connection is locked on its own, with `iptables -I ... -j DROP`
//!   rules (both directions; CRIU logs each command: the release deletes exactly those) or, with
//!   nftables, as elements of a set in the table `inet CRIU-<run id>` CRIU made for this dump (named in
//!   the logged commands: the release deletes that table, as CRIU's unlock does);
//! - a tree in a network namespace of its own (a container): the whole namespace is locked, with the
//!   iptables chain `CRIU` jumped to from INPUT and OUTPUT (the release removes the jumps and the chain in
//!   that namespace, as CRIU's `iptables_network_unlock_internal` does) or, with nftables, with the table
//!   `inet CRIU-<run id>` whose input and output chains drop everything (CRIU's
//!   `nftables_lock_network_internal`; the release deletes it in that namespace, as
//!   `nftables_network_unlock` does). CRIU logs no command for it, nor its run id (that is made before
//!   its log opens; the name is cut to 26 bytes, `table[32]` with `inet `), so the table is found by
//!   listing the namespace's `CRIU-*` tables before the dump ([`LocksBefore`]) and after it: the new
//!   one is this dump's. Another dump's lock there (a sibling container of the same namespace being
//!   checkpointed, or one checkpointed and not yet restored, whose restore needs its lock) is left alone.
//!
//! The sockets are taken out of repair mode with `TCP_REPAIR_OFF` (CRIU's `libsoccr_resume`), which sends
//! a window probe so that the peer learns the window again. CRIU also puts back each socket's
//! `SO_REUSEADDR`, which repair mode overwrote; we cannot know its old value (CRIU kept it in the images),
//! and it is left off: it only matters to a `bind`, which an established socket never makes again.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use super::nft::{nft_delete_table, nft_tables, NFPROTO_INET};
use super::KeptNetworkLock;
use super::NetworkLock;

/// `TCP_REPAIR` and its values, from `linux/tcp.h` (libc has no constants for them).
const TCP_REPAIR: libc::c_int = 19;
const TCP_REPAIR_OFF: libc::c_int = 0;

/// What a dump that left the tree stopped holds of its network: released by [`NetworkHold::release`].
/// Serializable: the flow tells it to the guardian, which releases it if the tool dies first.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NetworkHold {
    /// The tree: each TCP socket of these processes in repair mode is taken out of it.
    pids: Vec<i32>,
    /// The per-connection `iptables`/`ip6tables` rules CRIU inserted, as argument lists (`-I` in them).
    rules: Vec<Vec<String>>,
    /// The nftables table (family inet) CRIU made for its per-connection lock.
    nft_table: Option<String>,
    /// A process of the tree whose network namespace CRIU locked whole with iptables (it is not ours).
    netns_of: Option<i32>,
    /// The nftables tables (family inet) CRIU made to lock the tree's network namespace whole (it is
    /// not ours): deleted in the namespace of the tree's first process.
    #[serde(default)]
    netns_tables: Vec<String>,
}

/// CRIU's lock tables in the network namespace of a tree's root before its dump (see the module's
/// documentation): `None` where the tree is in ours (CRIU locks each connection on its own there) or
/// where they could not be listed.
#[derive(Debug, Default, Clone)]
pub struct LocksBefore(Option<Vec<String>>);

impl LocksBefore {
    /// Lists them for the tree whose root is `root`; call it right before CRIU's dump.
    pub fn of(root: i32) -> LocksBefore {
        let Some(ns) = foreign_netns(root) else {
            return LocksBefore(None);
        };
        match lock_tables(Some(&ns)) {
            Ok(t) => LocksBefore(Some(t)),
            Err(e) => {
                tracing::warn!("listing the nftables tables of {root}'s network namespace: {e}");
                LocksBefore(None)
            }
        }
    }
}

/// The network namespace of `pid`, where it is not ours.
pub(super) fn foreign_netns(pid: i32) -> Option<std::fs::File> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).ok()?;
    let ours = std::fs::metadata("/proc/self/ns/net").ok()?.ino();
    (ns.metadata().ok()?.ino() != ours).then_some(ns)
}

/// CRIU's lock tables (family inet, named `CRIU-*`) in the network namespace at `netns` (a
/// `/proc/PID/ns/net` or `/run/netns/NAME`).
pub fn criu_lock_tables(netns: &Path) -> io::Result<Vec<String>> {
    lock_tables(Some(&std::fs::File::open(netns)?))
}

pub(super) fn lock_tables(ns: Option<&std::fs::File>) -> io::Result<Vec<String>> {
    let mut t = nft_tables(ns, NFPROTO_INET)?;
    t.retain(|name| name.starts_with("CRIU-"));
    Ok(t)
}

impl NetworkHold {
    /// What the dump of `pids` (root first) left, from CRIU's dump log `log`, the lock `method` it
    /// was asked for, and the lock tables in its namespace before the dump `before`. Call it right after
    /// CRIU's dump returned, while the log is there and the tree stopped.
    pub fn after_dump(
        pids: &[i32],
        log: &Path,
        method: NetworkLock,
        before: &LocksBefore,
    ) -> NetworkHold {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let (rules, nft_table) = logged_lock(&text);
        let ns = pids
            .first()
            .and_then(|&root| Some((root, foreign_netns(root)?)));
        let netns_of = ns
            .as_ref()
            .filter(|_| method == NetworkLock::Iptables)
            .map(|(root, _)| *root);
        let netns_tables = match &ns {
            Some((root, ns)) if method == NetworkLock::Nftables => {
                match lock_tables(Some(ns)) {
                    // Unknown before (unlisted): all of them, so that the tree does not run on with a
                    // dead network.
                    Ok(mut after) => {
                        after.retain(|t| !before.0.iter().flatten().any(|b| b == t));
                        after
                    }
                    Err(e) => {
                        tracing::warn!("listing the nftables tables of {root}'s namespace: {e}");
                        Vec::new()
                    }
                }
            }
            _ => Vec::new(),
        };
        NetworkHold {
            pids: pids.to_vec(),
            rules,
            nft_table,
            netns_of,
            netns_tables,
        }
    }

    /// What of this hold stays on the node when the tree is killed with it (a durable checkpoint that
    /// stops the tree): CRIU's lock, kept for the restore (`kept_lock.rs`); `None` without one.
    pub fn kept(&self) -> Option<KeptNetworkLock> {
        let root = *self.pids.first()?;
        // Per connection in our namespace or whole in the tree's: the tree's namespace either way.
        let tables = self.nft_table.iter().chain(&self.netns_tables).cloned();
        KeptNetworkLock::new(
            root,
            tables.collect(),
            self.rules.clone(),
            self.netns_of.is_some(),
        )
    }

    /// Releases the connections as CRIU's `network_unlock` does: the per-connection locks and repair mode
    /// first, the namespace's lock last. Best effort: each failure is logged and the rest still done.
    /// Returns the number of sockets taken out of repair mode.
    pub fn release(&self) -> usize {
        for rule in &self.rules {
            run_rule(rule, "-D", None);
        }
        let mut repaired = 0;
        for &pid in &self.pids {
            match repair_off(pid) {
                Ok(n) => repaired += n,
                Err(e) => tracing::warn!("taking the TCP sockets of {pid} out of repair mode: {e}"),
            }
        }
        if let Some(table) = &self.nft_table {
            if let Err(e) = nft_delete_table(None, NFPROTO_INET, table) {
                tracing::warn!("deleting CRIU's nftables table inet {table}: {e}");
            }
        }
        // The tree is stopped and held: its PIDs are still its own.
        if let (Some(root), false) = (self.pids.first(), self.netns_tables.is_empty()) {
            match std::fs::File::open(format!("/proc/{root}/ns/net")) {
                Ok(ns) => {
                    for table in &self.netns_tables {
                        if let Err(e) = nft_delete_table(Some(&ns), NFPROTO_INET, table) {
                            tracing::warn!("deleting CRIU's nftables table inet {table} in the namespace of {root}: {e}");
                        }
                    }
                }
                Err(e) => tracing::warn!("the tree's network namespace: {e}"),
            }
        }
        match self
            .netns_of
            .map(|pid| std::fs::File::open(format!("/proc/{pid}/ns/net")))
        {
            Some(Ok(ns)) => unlock_netns(&ns),
            Some(Err(e)) => tracing::warn!("the tree's network namespace: {e}"),
            None => {}
        }
        repaired
    }
}

/// Runs CRIU's `iptables ... -I CHAIN ...` rule `rule` with `-I` replaced by `op` (`-D` deletes it, `-C`
/// checks it is there) in namespace `ns`; true when the command exits 0.
pub(super) fn run_rule(rule: &[String], op: &str, ns: Option<&std::fs::File>) -> bool {
    let args: Vec<&str> = rule
        .iter()
        .map(|a| if a == "-I" { op } else { a.as_str() })
        .collect();
    run_quiet(&args, ns, None)
}

/// The established TCP connections of processes `pids` (in one network namespace) whose other end is not
/// one of theirs, as `local -> remote`: what a peer outside them would see closed when they are
/// checkpointed with the connections unlocked and then killed.
pub fn outside_connections(pids: &[i32]) -> Vec<String> {
    let mut ours = std::collections::HashSet::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let link = std::fs::read_link(fd.path()).unwrap_or_default();
            let link = link.to_string_lossy();
            if let Some(ino) = link
                .strip_prefix("socket:[")
                .and_then(|l| l.strip_suffix(']'))
            {
                ours.insert(ino.to_string());
            }
        }
    }
    let Some(root) = pids.first() else {
        return Vec::new();
    };
    // (local, remote) of each established connection of theirs, from the namespace's tables.
    let mut conns = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{root}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && f[3] == "01" && ours.contains(f[9]) {
                conns.push((f[1].to_string(), f[2].to_string()));
            }
        }
    }
    outside(&conns)
}

/// Of connections (local, remote), those whose remote end is none of their local ends.
fn outside(conns: &[(String, String)]) -> Vec<String> {
    conns
        .iter()
        .filter(|(_, remote)| !conns.iter().any(|(local, _)| local == remote))
        .map(|(l, r)| format!("{} -> {}", tcp_address(l), tcp_address(r)))
        .collect()
}

/// `0100007F:1388` (IPv4 as `/proc/net/tcp` writes it: the address's bytes in host order) as
/// `127.0.0.1:5000`; other forms are left as they are.
fn tcp_address(hex: &str) -> String {
    let Some((addr, port)) = hex.split_once(':') else {
        return hex.to_string();
    };
    match (u32::from_str_radix(addr, 16), u16::from_str_radix(port, 16)) {
        (Ok(a), Ok(p)) if addr.len() == 8 => {
            format!("{}:{p}", std::net::Ipv4Addr::from(a.to_ne_bytes()))
        }
        _ => hex.to_string(),
    }
}

/// The per-connection lock CRIU logged: its `iptables -I` commands and the nftables table its set
/// elements went into.
pub(super) fn logged_lock(log: &str) -> (Vec<Vec<String>>, Option<String>) {
    let mut rules = Vec::new();
    let mut table = None;
    for line in log.lines() {
        let Some(cmd) = bracketed(line, "Running iptables [") else {
            if let Some(cmd) = bracketed(line, "Running nftables [") {
                // add element inet CRIU-<run id> conns4 { ... }
                let words: Vec<&str> = cmd.split_ascii_whitespace().collect();
                if let ["add", "element", "inet", name, ..] = words[..] {
                    table.get_or_insert_with(|| name.to_string());
                }
            }
            continue;
        };
        let args: Vec<String> = cmd.split_ascii_whitespace().map(String::from).collect();
        let known = matches!(
            args.first().map(String::as_str),
            Some("iptables" | "ip6tables")
        );
        if known && args.iter().any(|a| a == "-I") {
            rules.push(args);
        }
    }
    (rules, table)
}

fn bracketed<'l>(line: &'l str, prefix: &str) -> Option<&'l str> {
    let at = line.find(prefix)? + prefix.len();
    line[at..].rfind(']').map(|end| &line[at..at + end])
}

/// Takes every TCP socket of `pid` that is in repair mode out of it; returns how many.
fn repair_off(pid: i32) -> io::Result<usize> {
    let pidfd = crate::proc::pidfd_open(pid)?;
    let mut n = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"));
        let Some(target) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<RawFd>().ok())
        else {
            continue;
        };
        if !is_socket {
            continue;
        }
        let Ok(sock) = crate::proc::pidfd_getfd(&pidfd, target) else {
            continue; // closed since the listing
        };
        let tcp = get_int(&sock, libc::SOL_SOCKET, libc::SO_PROTOCOL) == Some(libc::IPPROTO_TCP);
        // Several processes (or descriptors) may share a socket: the first one turns it off.
        if tcp && get_int(&sock, libc::IPPROTO_TCP, TCP_REPAIR) == Some(1) {
            match set_int(
                sock.as_raw_fd(),
                libc::IPPROTO_TCP,
                TCP_REPAIR,
                TCP_REPAIR_OFF,
            ) {
                Ok(()) => n += 1,
                Err(e) => tracing::warn!("TCP_REPAIR off on fd {target} of {pid}: {e}"),
            }
        }
    }
    Ok(n)
}

fn set_int(fd: RawFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: setsockopt with an int we own, its size given.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn get_int(fd: &OwnedFd, level: libc::c_int, opt: libc::c_int) -> Option<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into an int we own, its size given.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(v)
}

/// Removes CRIU's chain `CRIU` and the jumps to it from the namespace `ns`, as
/// `iptables_network_unlock_internal` does: the jumps (twice if one is still there, for the nft backend of
/// iptables), then the chain, for IPv4 and, where the kernel has it, IPv6.
pub(super) fn unlock_netns(ns: &std::fs::File) {
    const JUMPS: &str = "*filter\n:CRIU - [0:0]\n-D INPUT -j CRIU\n-D OUTPUT -j CRIU\nCOMMIT\n";
    const CHAIN: &str = "*filter\n:CRIU - [0:0]\n-X CRIU\nCOMMIT\n";
    let ipv6 = Path::new("/proc/net/if_inet6").exists();
    let restore = |text: &str| {
        run_quiet(
            &["iptables-restore", "-w", "--noflush"],
            Some(ns),
            Some(text),
        );
        if ipv6 {
            run_quiet(
                &["ip6tables-restore", "-w", "--noflush"],
                Some(ns),
                Some(text),
            );
        }
    };
    restore(JUMPS);
    if run_quiet(&["iptables", "-C", "INPUT", "-j", "CRIU"], Some(ns), None) {
        restore(JUMPS);
    }
    restore(CHAIN);
}

/// Runs `args` (in network namespace `ns`, with `input` on its stdin); true when it exits 0. A failure is
/// logged at debug level: a rule or chain already gone is not an error of the release.
pub(super) fn run_quiet(args: &[&str], ns: Option<&std::fs::File>, input: Option<&str>) -> bool {
    let mut cmd = Command::new(args[0]);
    cmd.args(&args[1..])
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(ns) = ns {
        let fd = ns.as_raw_fd();
        // SAFETY: only setns (async-signal-safe) runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let out = cmd.spawn().and_then(|mut child| {
        if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
            use std::io::Write;
            stdin.write_all(text.as_bytes())?;
        }
        child.wait_with_output()
    });
    match out {
        Ok(o) if o.status.success() => true,
        Ok(o) => {
            tracing::debug!(
                "{}: {} {}",
                args.join(" "),
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            );
            false
        }
        Err(e) => {
            tracing::debug!("{}: {e}", args.join(" "));
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_is_read_from_criu_log() {
        let log = "(00.1) \tRunning iptables [iptables -w -t filter -I INPUT --protocol tcp -m mark ! --mark 0xC114 --source 127.0.0.1 --sport 1 --destination 127.0.0.1 --dport 2 -j DROP]\n\
                   (00.2) \tRunning nftables [add element inet CRIU-abc-1 conns4 { 127.0.0.1 . 1 . 127.0.0.1 . 2 }]\n\
                   (00.3) \tRunning iptables [iptables -w -t filter -D INPUT --protocol tcp]\n";
        let (rules, table) = logged_lock(log);
        assert_eq!(rules.len(), 1, "only the inserted rules");
        assert_eq!(rules[0][0], "iptables");
        assert_eq!(rules[0].last().unwrap(), "DROP");
        assert_eq!(table.as_deref(), Some("CRIU-abc-1"));
        assert_eq!(logged_lock("nothing"), (Vec::new(), None));
    }

    /// A connection between two of our sockets is not outside; one whose other end is not ours is.
    #[test]
    fn connections_to_a_peer_outside_are_found() {
        let c = |l: &str, r: &str| (l.to_string(), r.to_string());
        let conns = [
            c("0100007F:1388", "0100007F:9C40"),
            c("0100007F:9C40", "0100007F:1388"),
            c("0100007F:1389", "0200000A:D431"),
        ];
        assert_eq!(outside(&conns), ["127.0.0.1:5001 -> 10.0.0.2:54321"]);
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        // Other tests of this process may hold connections to peers elsewhere meanwhile: only this
        // pair's two ends must not be listed.
        let ends = [a.local_addr().unwrap(), b.local_addr().unwrap()].map(|e| format!("{e} -> "));
        let found = outside_connections(&[std::process::id() as i32]);
        assert!(
            !found.iter().any(|f| ends.iter().any(|e| f.starts_with(e))),
            "both ends are ours: {found:?}"
        );
    }

    /// Repair mode needs CAP_NET_ADMIN: as root, one end of a loopback connection of this process is put
    /// in repair mode (as CRIU's dump does); the release finds it among our descriptors, turns it out of
    /// repair mode, and the connection carries data both ways again. A table that is not there is no
    /// error of the release.
    #[test]
    fn a_socket_in_repair_mode_is_released() {
        use std::io::{Read, Write};
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: TCP_REPAIR needs root");
            return;
        }
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        set_int(a.as_raw_fd(), libc::IPPROTO_TCP, TCP_REPAIR, 1).unwrap();
        assert!(
            a.write_all(b"x").is_err(),
            "a socket in repair mode sends nothing"
        );
        let hold = NetworkHold {
            pids: vec![std::process::id() as i32],
            ..Default::default()
        };
        assert!(hold.release() >= 1, "our socket in repair mode");
        a.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        b.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        b.write_all(b"pong").unwrap();
        a.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"pong");
        nft_delete_table(None, NFPROTO_INET, "CRIU-not-there").unwrap();
        let tables = nft_tables(None, NFPROTO_INET).unwrap();
        assert!(!tables.iter().any(|t| t == "CRIU-not-there"), "{tables:?}");
    }
}
