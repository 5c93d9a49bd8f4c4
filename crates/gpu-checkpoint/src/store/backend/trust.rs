//! Whose store a local folder is, and whether this process may trust it.
//!
//! The tool runs as root and restores what a store holds: whoever can write a store can make root run
//! their code and, through links planted in it, read, write, chmod or delete files anywhere. So a local store
//! is used only when it belongs to the user running the tool or to root (or, read-only, to one other user
//! named with `--trust-store-owner`), and no one else can change it:
//! - the store folder, its folders (`chunks/` and each fan-out folder, `manifests/`, `staging/`, the flows'
//!   `logs/`, `restore-work/`, `container-work/`) and its marker and lock file belong to such an owner and
//!   are not writable by group or others;
//! - none of those is a symbolic link (a store holds none);
//! - no folder above the store is writable by group or others unless it is sticky (like `/tmp`, where no
//!   one can rename another user's entries): otherwise someone could swap the store for a folder of theirs.
//!
//! What fails any of these is refused with the reason ([`Error::Untrusted`], exit status 4). Everything the
//! backend does afterwards goes through the folder it held open at that check ([`crate::beneath`]).

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::beneath::{Beneath, Kind};
use crate::store::error::{Error, Result};

/// The folders a store (and the flows working in it) may hold; each is checked when present.
pub(super) const FOLDERS: [&str; 6] = [
    "chunks",
    "manifests",
    "staging",
    "logs",
    "restore-work",
    "container-work",
];

/// The store's files besides its objects.
pub(super) const FILES: [&str; 2] = [super::STORE_FILE, "lock"];

/// What this process may do with a store it trusts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Its own (or root's): read and write.
    ReadWrite,
    /// Another user's, trusted for reading only (`--trust-store-owner`): nothing is written, chmodded
    /// or removed in it.
    ReadOnly { owner: u32 },
}

/// The effective user.
fn me() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// `uid` with its name where the system knows one, for messages.
pub fn user_name(uid: u32) -> String {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(u)) => format!("{} (uid {uid})", u.name),
        _ => format!("uid {uid}"),
    }
}

/// The uid of user `name`, or `name` itself when it is a number.
pub fn uid_of(name: &str) -> Option<u32> {
    match nix::unistd::User::from_name(name) {
        Ok(Some(u)) => Some(u.uid.as_raw()),
        _ => name.parse().ok(),
    }
}

/// Who may own a store's folders and files: the effective user, root and, read-only, `trusted`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Owners {
    pub trusted: Option<u32>,
}

impl Owners {
    /// What `uid` owning part of a store allows, or why it is refused.
    fn access(&self, uid: u32) -> std::result::Result<Access, String> {
        if uid == me() || uid == 0 {
            return Ok(Access::ReadWrite);
        }
        if self.trusted == Some(uid) {
            return Ok(Access::ReadOnly { owner: uid });
        }
        let allowed = match me() {
            0 => "root".to_string(),
            me => format!("this user ({}) or root", user_name(me)),
        };
        Err(format!(
            "belongs to {}, not to {allowed}: whoever owns a store can make the tool run their code and \
             reach any file through it (to read a store of a user you trust: --trust-store-owner USER, \
             read-only; docs/security.md)",
            user_name(uid),
        ))
    }

    /// Checks one part of the store (`meta`, of `path`, a link itself rather than what it points at).
    fn check(
        &self,
        path: &Path,
        meta: &Metadata,
        folder: bool,
    ) -> std::result::Result<Access, Error> {
        let refuse = |reason: String| Error::Untrusted {
            path: path.into(),
            reason,
        };
        if meta.file_type().is_symlink() {
            return Err(refuse(
                "is a symbolic link; a store holds none (someone planted it?): remove it".into(),
            ));
        }
        if folder != meta.is_dir() || (!folder && !meta.is_file()) {
            return Err(Error::BadStore {
                path: path.into(),
                reason: format!(
                    "is not a {} as in a gpu-checkpoint store",
                    if folder { "folder" } else { "regular file" }
                ),
            });
        }
        let access = self.access(meta.uid()).map_err(refuse)?;
        if meta.mode() & 0o022 != 0 {
            return Err(refuse(format!(
                "can be changed by other users (mode {:04o}); make it 0{} (chmod go-w) once you know \
                 nobody else did",
                meta.mode() & 0o7777,
                if folder { "700" } else { "600" }
            )));
        }
        Ok(access)
    }
}

/// Whether the held folder is this user's and empty (a folder made for a new store).
pub(super) fn own_empty_folder(dir: &Beneath) -> bool {
    dir.metadata().is_ok_and(|m| m.uid() == me()) && dir.entries("").is_ok_and(|e| e.is_empty())
}

/// The narrower of two accesses.
pub(super) fn narrower(a: Access, b: Access) -> Access {
    match (a, b) {
        (Access::ReadWrite, b) => b,
        (a, _) => a,
    }
}

/// Checks the held store folder itself and the folders above it.
pub(super) fn check_root(dir: &Beneath, owners: Owners) -> Result<Access> {
    let meta = dir
        .metadata()
        .map_err(Error::io("cannot look at", dir.path()))?;
    let access = owners.check(dir.path(), &meta, true)?;
    check_above(dir)?;
    Ok(access)
}

/// Checks the store's own folders and files (those present), and the chunk fan-out folders.
pub(super) fn check_layout(dir: &Beneath, owners: Owners) -> Result<Access> {
    let mut access = Access::ReadWrite;
    let mut one = |rel: &str, folder: bool| -> Result<()> {
        match dir.symlink_metadata(rel) {
            Ok(meta) => {
                access = narrower(access, owners.check(&dir.join(rel), &meta, folder)?);
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("cannot look at", dir.join(rel))(e)),
        }
    };
    for rel in FOLDERS {
        one(rel, true)?;
    }
    for rel in FILES {
        one(rel, false)?;
    }
    match dir.entries("chunks") {
        Ok(subs) => {
            for sub in subs {
                let rel = Path::new("chunks").join(&sub.name);
                let rel = rel.to_str().unwrap_or("chunks/?");
                if sub.kind == Kind::Dir || sub.kind == Kind::Link {
                    one(rel, true)?;
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("cannot list", dir.join("chunks"))(e)),
    }
    Ok(access)
}

/// Refuses a store below a folder that others can change (writable by group or others, not sticky).
fn check_above(dir: &Beneath) -> Result<()> {
    // Where the held folder really is (its path may hold links).
    let real = std::fs::read_link(format!(
        "/proc/self/fd/{}",
        std::os::fd::AsRawFd::as_raw_fd(&dir.fd())
    ))
    .or_else(|_| std::fs::canonicalize(dir.path()))
    .map_err(Error::io("cannot resolve", dir.path()))?;
    for up in real.ancestors().skip(1) {
        let Ok(meta) = std::fs::symlink_metadata(up) else {
            continue;
        };
        let sticky = meta.mode() & libc::S_ISVTX != 0;
        if meta.mode() & 0o022 != 0 && !sticky {
            return Err(Error::Untrusted {
                path: dir.path().into(),
                reason: format!(
                    "lies in {}, which other users can change (mode {:04o}, not sticky): they could put \
                     a folder of theirs in its place",
                    up.display(),
                    meta.mode() & 0o7777
                ),
            });
        }
    }
    Ok(())
}
