//! Private work folders of the restores (materialized images, CRIU's and the runtime's files), in the
//! store's folder when it is a local one of this user, else in the temporary folder.
//!
//! A work folder lives in the store when possible (same disk as the chunks, no tmpfs filling RAM with a copy
//! of the process). Its name is unpredictable and it is created new (0700) inside a parent only root or this
//! user can change, reached from a folder held open and never through a link ([`crate::beneath`]): a local
//! user can neither guess it nor put one of their own in its place (root's CRIU would read their images),
//! and a link planted as the parent (`STORE/restore-work`) is never followed: the temporary folder is used
//! instead. An exclusive lock on the folder is held while it is in use, so a folder left by a killed
//! restore is recognised as such and removed by the next restore or `gc` ([`remove_stale`]).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg, OFlag};

use crate::beneath::{Beneath, Kind};
use crate::util::DIR_MODE;

/// A private folder, locked while in use and removed (never through a link) on drop.
pub(crate) struct WorkDir {
    parent: Beneath,
    name: String,
    path: PathBuf,
    _lock: Flock<File>,
}

/// Where a work folder may go: `STORE/FOLDER/` named `ID.RANDOM`, or the temporary folder named
/// `TEMP_PREFIX.ID.RANDOM`.
pub(crate) struct Place<'a> {
    /// The store's local folder, if it is one this process may write to.
    pub store: Option<&'a Path>,
    /// The store's folder for such work folders (`restore-work`, `container-work`).
    pub folder: &'a str,
    /// What the folder is for, in its name in the temporary folder (`gpu-checkpoint-restore`).
    pub temp_prefix: &'a str,
}

impl WorkDir {
    /// A new work folder for checkpoint `id` in the first place that works; the error is the temporary
    /// folder's (the last tried), with the folder it was to be made in.
    pub(crate) fn create(place: &Place<'_>, id: &str) -> Result<WorkDir, (PathBuf, io::Error)> {
        let mut failed = None;
        if let Some(store) = place.store {
            match store_parent(store, place.folder) {
                Ok(parent) => match Self::create_in(parent, &format!("{id}.")) {
                    Ok(w) => return Ok(w),
                    Err(e) => failed = Some(e),
                },
                Err(e) => failed = Some((store.join(place.folder), e)),
            }
        }
        let temp = std::env::temp_dir();
        let parent = crate::util::check_trusted_dir(&temp).and_then(|()| Beneath::open(&temp));
        match parent {
            Ok(parent) => Self::create_in(parent, &format!("{}.{id}.", place.temp_prefix)),
            Err(e) => {
                if let Some((path, first)) = failed {
                    tracing::debug!("no work folder in {}: {first}", path.display());
                }
                Err((temp, e))
            }
        }
    }

    /// A new locked folder named `PREFIX` and random characters in `parent`.
    fn create_in(parent: Beneath, prefix: &str) -> Result<WorkDir, (PathBuf, io::Error)> {
        // Between the mkdir and the lock, another restore's sweep may take the new folder for a killed
        // restore's and remove it; the lock is then on a deleted folder (issue 18: CRIU could not create its
        // log there). Only a folder still there once locked is ours for good (a sweep removes only what it
        // has locked); else a new one, a few times.
        let mut failed = io::Error::other("no attempt");
        for _ in 0..3 {
            let name = format!(
                "{prefix}{:08x}{:08x}",
                crate::store::random_u32(),
                crate::store::random_u32()
            );
            match parent.create_dir(&name, DIR_MODE) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err((parent.path().to_path_buf(), e)),
            }
            match lock(&parent, &name) {
                Ok(Some(lock)) if still_there(&parent, &name, &lock) => {
                    return Ok(WorkDir {
                        path: parent.join(&name),
                        parent,
                        name,
                        _lock: lock,
                    })
                }
                Ok(_) => failed = io::Error::other("removed or locked by another restore's sweep"),
                Err(e) => failed = e,
            }
        }
        Err((parent.path().to_path_buf(), failed))
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = self.parent.remove_all(&self.name) {
            tracing::warn!(
                "could not remove the work folder {}: {e}",
                self.path.display()
            );
        }
    }
}

/// `STORE/FOLDER`, made where missing, held open: a private folder of this user reached without a link.
fn store_parent(store: &Path, folder: &str) -> io::Result<Beneath> {
    let store = Beneath::open(store)?;
    match store.create_dir(folder, DIR_MODE) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let parent = store.subdir(folder)?;
    crate::util::check_private(&parent.metadata()?, parent.path())?;
    Ok(parent)
}

/// Opens folder `name` in `parent` (never through a link) and takes its exclusive lock: `Ok(None)` when
/// another process holds it.
fn lock(parent: &Beneath, name: &str) -> io::Result<Option<Flock<File>>> {
    let file = parent.open_file(name, OFlag::O_DIRECTORY | OFlag::O_RDONLY, 0)?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(e.into()),
    }
}

/// Whether the folder `lock` holds is still `name` in `parent` (not removed, nor replaced, meanwhile).
fn still_there(parent: &Beneath, name: &str, lock: &Flock<File>) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (lock.metadata(), parent.symlink_metadata(name)) {
        (Ok(held), Ok(there)) => held.dev() == there.dev() && held.ino() == there.ino(),
        _ => false,
    }
}

/// Removes the work folders that killed restores left in `STORE/FOLDER` (their lock died with them);
/// folders still in use are locked and kept. Returns how many were removed. A link in place of the folder,
/// or in it, is nothing a restore made: never followed, left alone.
pub(crate) fn remove_stale(store: &Path, folder: &str) -> io::Result<u64> {
    let parent = match Beneath::open(store).and_then(|s| s.subdir(folder)) {
        Ok(p) => p,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for entry in parent.entries("")? {
        if entry.kind != Kind::Dir {
            continue;
        }
        let Some(name) = entry.name.to_str() else {
            continue;
        };
        // Another sweep may have removed it between our listing and our lock: then it is gone already.
        match lock(&parent, name) {
            Ok(Some(lock)) if still_there(&parent, name, &lock) => match parent.remove_all(name) {
                Ok(_) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            },
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt};

    const WORK: &str = "restore-work";

    fn place(store: &Path) -> Place<'_> {
        Place {
            store: Some(store),
            folder: WORK,
            temp_prefix: "gpu-checkpoint-restore",
        }
    }

    /// A temporary folder with an empty `store` in it: the folder (removed on drop) and the store's path.
    fn temp_store() -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        std::fs::create_dir_all(&store).unwrap();
        (dir, store)
    }

    /// A store whose `restore-work` was replaced by a link to someone else's folder: the work folder must not
    /// be made through it (root's CRIU would read images that user can swap), nor anything there removed.
    #[test]
    fn work_folder_is_private_and_never_made_through_a_planted_link() {
        let (dir, store) = temp_store();
        let theirs = dir.path().join("theirs");
        std::fs::create_dir_all(theirs.join("ID.looks-stale")).unwrap();
        symlink(&theirs, store.join(WORK)).unwrap();
        let work = WorkDir::create(&place(&store), "20261124T000000Z-00000000").unwrap();
        assert_eq!(
            std::fs::read_dir(&theirs).unwrap().count(),
            1,
            "nothing made in the linked folder"
        );
        assert!(
            remove_stale(&store, WORK).is_err(),
            "a linked folder is refused"
        );
        assert!(
            theirs.join("ID.looks-stale").is_dir(),
            "nothing removed there"
        );
        assert!(
            !work.path().starts_with(&store),
            "{}",
            work.path().display()
        );
        let meta = std::fs::symlink_metadata(work.path()).unwrap();
        assert!(meta.is_dir());
        assert_eq!(meta.mode() & 0o777, 0o700);
        // Two restores of one checkpoint get two different, unguessable folders.
        std::fs::remove_file(store.join(WORK)).unwrap();
        let a = WorkDir::create(&place(&store), "X").unwrap();
        let b = WorkDir::create(&place(&store), "X").unwrap();
        assert_ne!(a.path(), b.path());
        assert!(a.path().starts_with(store.join(WORK)));
        let name = a.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.len() >= "X.".len() + 12, "{name}");
    }

    /// Issue 18: agents restoring at once on one store each sweep `restore-work` for stale folders. A sweep
    /// that came between another restore's mkdir and its lock removed that restore's new folder, and the
    /// restore went on locking a deleted folder: CRIU then could not create its log there and failed with
    /// EBADRQC ("Invalid request code", CRIU's code for a request it could not set up). Every folder handed
    /// out must still be there, and no sweep fails on what another removed, however they interleave.
    #[test]
    fn concurrent_sweeps_never_remove_a_new_work_folder() {
        let (_dir, store) = temp_store();
        let lost = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..400 {
                        remove_stale(&store, WORK).unwrap();
                        let work = WorkDir::create(&place(&store), "ID").unwrap();
                        if !work.path().is_dir() {
                            lost.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(
            lost.into_inner(),
            0,
            "restores were handed a removed work folder"
        );
    }

    /// A restore killed mid-way leaves its work folder (images, logs): the next restore or gc removes it,
    /// while the folder of a restore still running stays. A link in the work folder (planted) is removed
    /// itself, never what it points at.
    #[test]
    fn stale_work_folders_are_removed_and_live_ones_kept() {
        let (dir, store) = temp_store();
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"k").unwrap();
        let dead = store.join(WORK).join("ID.dead-restore");
        std::fs::create_dir_all(&dead).unwrap();
        std::fs::write(dead.join("pages-1.img"), b"x").unwrap();
        symlink(&outside, dead.join("link")).unwrap();
        let live = WorkDir::create(&place(&store), "ID").unwrap();
        assert_eq!(remove_stale(&store, WORK).unwrap(), 1);
        assert!(!dead.exists());
        assert!(outside.join("keep").is_file());
        assert!(live.path().is_dir(), "a running restore's folder is kept");
        drop(live);
        assert_eq!(remove_stale(&store, WORK).unwrap(), 0);
        assert_eq!(remove_stale(&dir.path().join("none"), WORK).unwrap(), 0);
    }
}
