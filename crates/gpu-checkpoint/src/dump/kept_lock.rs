//! CRIU's network lock that a `--tcp-established` checkpoint leaves on its node for the restore: recorded
//! in the checkpoint's manifest, so that a failed restore can say it is still there and the user can
//! release it when giving the restore up.
//!
//! A checkpoint that stops the tree once durable (the default) kills it with the lock CRIU's dump made
//! still in place (`network.rs`): the connections' segments are dropped on this node, so that the peers'
//! segments do not reset them before a restore takes them over. CRIU's restore removes the lock when it
//! succeeds (it finds the table by the dump's run id in `inventory.img`); a failed one keeps it for the next
//! try. Meanwhile it also drops a new connection that gets the same addresses and ports.
//!
//! The lock lives in one network namespace of one node until that node reboots: the record names the boot
//! (`/proc/sys/kernel/random/boot_id`) and the namespace (its nsfs inode), so that no restore or release
//! on another node, or after a reboot, acts on a lock that is not there. What is released is exactly what
//! CRIU made for this dump: its nftables tables (`inet CRIU-<run id>`: the run id is this dump's), its
//! per-connection `iptables` rules (this dump's 4-tuples), or the chain `CRIU` of a namespace CRIU locked
//! whole; never another dump's.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::network::{lock_tables, logged_lock, run_quiet, run_rule, unlock_netns};
use super::nft::{netns_cookie, nft_delete_table, NFPROTO_INET};

/// Where the kernel names this boot.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// CRIU's network lock a checkpoint left on its node (the manifest's `kept_network_lock`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct KeptNetworkLock {
    /// The node's boot (`/proc/sys/kernel/random/boot_id`) when the lock was left: it is gone after a reboot.
    pub boot_id: String,
    /// The node's host name then, for the messages.
    pub host: String,
    /// The network namespace the lock is in (the tree's), as the inode of its `/proc/PID/ns/net`.
    pub netns: u64,
    /// Its cookie (`SO_NETNS_COOKIE`): an inode may be given to a new namespace once the old one is
    /// gone, a cookie never is. Absent where the kernel has none (before 5.14).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns_cookie: Option<u64>,
    /// CRIU's nftables tables (family inet, `CRIU-<run id>`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nft_tables: Vec<String>,
    /// CRIU's per-connection `iptables`/`ip6tables` rules, as it ran them (with `-I`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub iptables_rules: Vec<Vec<String>>,
    /// CRIU's chain `CRIU`, jumped to from INPUT and OUTPUT, locking the namespace whole (iptables).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub iptables_chain: bool,
}

/// Where a recorded lock stands on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LockState {
    /// It is here: something of it is still in place.
    Held,
    /// It was left on this boot, and nothing of it is left (a restore took it over, it was released,
    /// or its namespace is gone).
    Gone,
    /// It was left on another node, or before this node's last reboot: this boot's id.
    Elsewhere { boot_id: String },
}

/// A lock left on another node or boot than this one: [`KeptNetworkLock::release`] refuses it.
#[derive(Debug, thiserror::Error)]
#[error("checkpoint {id}'s network lock was left on {host} (boot id {boot_id}), and this is {here_host} (boot id {here_boot_id}): release it on that node; if that node is this one, it rebooted since and the lock went with the reboot")]
pub struct Elsewhere {
    pub id: String,
    pub host: String,
    pub boot_id: String,
    pub here_host: String,
    pub here_boot_id: String,
}

/// What [`KeptNetworkLock::release`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Released {
    /// The lock was there and is gone now.
    Released,
    /// Nothing of it was left to release.
    NothingLeft,
}

/// This node's host name.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// This boot's id.
pub fn boot_id() -> io::Result<String> {
    Ok(std::fs::read_to_string(BOOT_ID)?.trim().to_string())
}

impl KeptNetworkLock {
    /// The record of a lock in the network namespace of process `pid`, made of those parts; `None` when
    /// there is none (`--network-lock skip`) or the node's boot or the namespace cannot be read.
    pub(super) fn new(
        pid: i32,
        nft_tables: Vec<String>,
        iptables_rules: Vec<Vec<String>>,
        iptables_chain: bool,
    ) -> Option<KeptNetworkLock> {
        if nft_tables.is_empty() && iptables_rules.is_empty() && !iptables_chain {
            return None;
        }
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))
            .and_then(|f| Ok((f.metadata()?.ino(), f)));
        match (boot_id(), ns) {
            (Ok(boot_id), Ok((netns, f))) => Some(KeptNetworkLock {
                boot_id,
                host: hostname(),
                netns,
                netns_cookie: netns_cookie(Some(&f)).ok(),
                nft_tables,
                iptables_rules,
                iptables_chain,
            }),
            (b, n) => {
                let n = n.map(|(ino, _)| ino);
                tracing::warn!("the network lock left for the restore is not recorded: boot id {b:?}, namespace {n:?}");
                None
            }
        }
    }

    /// The lock a `criu dump --tcp-established` of a tree in this process's network namespace logged in
    /// its log `log` (its nftables table, its iptables rules), as a record of this node: what a dump made
    /// without gpu-checkpoint (plain CRIU) left, for its release. `None` when it logged none.
    pub fn logged_in(log: &Path) -> Option<KeptNetworkLock> {
        let text = std::fs::read_to_string(log).ok()?;
        let (rules, table) = logged_lock(&text);
        let table = table.into_iter().collect();
        KeptNetworkLock::new(std::process::id() as i32, table, rules, false)
    }

    /// What the lock is, in words: `the nftables table inet CRIU-... (in network namespace net:[N])`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        for t in &self.nft_tables {
            parts.push(format!("the nftables table inet {t}"));
        }
        match self.iptables_rules.len() {
            0 => {}
            1 => parts.push("1 iptables rule dropping its connection's 4-tuple".into()),
            n => parts.push(format!(
                "{n} iptables rules dropping its connections' 4-tuples"
            )),
        }
        if self.iptables_chain {
            parts.push("the iptables chain CRIU (jumped to from INPUT and OUTPUT)".into());
        }
        let ours = std::fs::metadata("/proc/self/ns/net").is_ok_and(|m| m.ino() == self.netns);
        let ns = if ours {
            String::new()
        } else {
            format!(" in network namespace net:[{}]", self.netns)
        };
        format!("{}{ns}", parts.join(", "))
    }

    /// Where the lock stands on this node.
    pub fn state(&self) -> io::Result<LockState> {
        let here = boot_id()?;
        if here != self.boot_id {
            return Ok(LockState::Elsewhere { boot_id: here });
        }
        let Some(ns) = self.find_netns() else {
            return Ok(LockState::Gone);
        };
        let tables = lock_tables(Some(&ns))?;
        let held = self.nft_tables.iter().any(|t| tables.contains(t))
            || self
                .iptables_rules
                .iter()
                .any(|r| run_rule(r, "-C", Some(&ns)))
            || (self.iptables_chain
                && run_quiet(&["iptables", "-C", "INPUT", "-j", "CRIU"], Some(&ns), None));
        Ok(if held {
            LockState::Held
        } else {
            LockState::Gone
        })
    }

    /// The lock's network namespace, where something still holds it: the one of its inode, and of its
    /// cookie where recorded (else a new namespace that got the inode would be taken for it).
    fn find_netns(&self) -> Option<std::fs::File> {
        let ns = find_netns(self.netns)?;
        match self.netns_cookie {
            Some(c) if netns_cookie(Some(&ns)).ok() != Some(c) => None,
            _ => Some(ns),
        }
    }

    /// Releases the lock of checkpoint `id` on this node, as CRIU's `network_unlock` would: its rules,
    /// its tables, its chain; the connections it kept for the restore are then lost. Refused when the
    /// lock was left on another node or boot; nothing to do when nothing of it is left.
    pub fn release(&self, id: &str) -> Result<Released, super::Error> {
        let io = |e| super::Error::io(format!("checkpoint {id}'s network lock"), e);
        match self.state().map_err(io)? {
            LockState::Gone => return Ok(Released::NothingLeft),
            LockState::Elsewhere { boot_id } => {
                return Err(super::Error::NetworkLockElsewhere(Box::new(Elsewhere {
                    id: id.to_string(),
                    host: self.host.clone(),
                    boot_id: self.boot_id.clone(),
                    here_host: hostname(),
                    here_boot_id: boot_id,
                })))
            }
            LockState::Held => {}
        }
        // Held: the namespace was just found.
        let ns = self
            .find_netns()
            .ok_or_else(|| io(io::ErrorKind::NotFound.into()))?;
        for rule in &self.iptables_rules {
            run_rule(rule, "-D", Some(&ns));
        }
        for t in &self.nft_tables {
            nft_delete_table(Some(&ns), NFPROTO_INET, t).map_err(io)?;
        }
        if self.iptables_chain {
            unlock_netns(&ns);
        }
        match self.state().map_err(io)? {
            LockState::Held => Err(io(io::Error::other(format!(
                "{} is still there after its release",
                self.describe()
            )))),
            _ => Ok(Released::Released),
        }
    }
}

/// The network namespace whose nsfs inode is `ino`, where something still holds it: ours, one named in
/// `/run/netns`, or a process's.
fn find_netns(ino: u64) -> Option<std::fs::File> {
    let named = std::fs::read_dir("/run/netns")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path());
    let procs = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .map(|e| e.path().join("ns/net"));
    std::iter::once(std::path::PathBuf::from("/proc/self/ns/net"))
        .chain(named)
        .chain(procs)
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.ino() == ino))
        .and_then(|p| std::fs::File::open(p).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> KeptNetworkLock {
        KeptNetworkLock {
            boot_id: boot_id().unwrap(),
            host: "node-a".into(),
            netns: std::fs::metadata("/proc/self/ns/net").unwrap().ino(),
            netns_cookie: None,
            nft_tables: vec!["CRIU-not-there-1".into()],
            iptables_rules: Vec::new(),
            iptables_chain: false,
        }
    }

    /// A lock of another boot is refused, not looked for; one of this boot whose table is not there is
    /// nothing to release.
    #[test]
    fn a_lock_of_another_boot_is_refused_and_one_gone_is_nothing_to_release() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: listing nftables tables needs root");
            return;
        }
        let gone = record();
        assert_eq!(gone.state().unwrap(), LockState::Gone);
        assert_eq!(gone.release("ck").unwrap(), Released::NothingLeft);
        let other = KeptNetworkLock {
            boot_id: "00000000-0000-0000-0000-000000000000".into(),
            ..record()
        };
        assert!(matches!(
            other.state().unwrap(),
            LockState::Elsewhere { .. }
        ));
        let e = other.release("ck").unwrap_err();
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::exit::ExitStatus::Conflict
        );
        assert!(e.to_string().contains("node-a"), "{e}");
    }

    /// A namespace is found by its inode and, where recorded, its cookie: a new namespace that got the
    /// inode of one gone is not taken for it.
    #[test]
    fn a_namespace_is_known_by_its_cookie() {
        let mut r = record();
        r.netns_cookie = Some(netns_cookie(None).unwrap());
        assert!(r.find_netns().is_some(), "ours, by inode and cookie");
        r.netns_cookie = Some(r.netns_cookie.unwrap() ^ 1);
        assert!(r.find_netns().is_none(), "another cookie: not ours");
        assert_eq!(r.state().unwrap(), LockState::Gone);
    }

    /// Plain CRIU's dump log names its table: the record is of this boot and namespace.
    #[test]
    fn a_lock_is_read_from_a_dump_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("dump.log");
        std::fs::write(&log, "(00.2) \tRunning nftables [add element inet CRIU-abc-1 conns4 { 127.0.0.1 . 1 . 127.0.0.1 . 2 }]\n").unwrap();
        let logged = KeptNetworkLock::logged_in(&log).unwrap();
        assert_eq!(logged.nft_tables, ["CRIU-abc-1"]);
        assert_eq!(
            (logged.boot_id, logged.netns),
            (record().boot_id, record().netns)
        );
        std::fs::write(&log, "(00.1) Dumping finished successfully\n").unwrap();
        assert_eq!(KeptNetworkLock::logged_in(&log), None);
    }

    #[test]
    fn the_lock_is_described_in_words() {
        let mut r = record();
        r.iptables_rules = vec![vec!["iptables".into()]; 2];
        assert_eq!(
            r.describe(),
            "the nftables table inet CRIU-not-there-1, 2 iptables rules dropping its connections' 4-tuples"
        );
        r.netns = 1;
        assert!(r.describe().ends_with(" in network namespace net:[1]"));
    }
}
