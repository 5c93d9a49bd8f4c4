//! The private work folders restores materialize CRIU's images into (`STORE/restore-work/ID.<random>`),
//! and the sweep that removes what killed restores left there.

use std::path::{Path, PathBuf};

use super::Error;

/// The folder in a store that holds the restores' work folders.
const WORK_FOLDER: &str = "restore-work";

/// A private folder for the materialized images, removed on drop. It lives in the store's folder when
/// possible (same disk as the chunks, no tmpfs filling RAM with a copy of the process), else in the
/// temporary folder (read-only store, or one that is not a local folder).
///
/// Its name is unpredictable and it is created new (0700), inside a parent only root or this user can
/// change: a local user can neither guess it nor put one of their own in its place (root's CRIU would
/// read their images). An exclusive lock on it is held while it is in use, so a folder left by a killed
/// restore is recognised as such and removed by the next restore or `gc` ([`remove_stale_work_dirs`]).
pub(super) struct WorkDir {
    path: PathBuf,
    _lock: nix::fcntl::Flock<std::fs::File>,
}

impl WorkDir {
    pub(super) fn create(storage: Option<&Path>, id: &str) -> Result<WorkDir, Error> {
        let in_store = storage.map(|s| (s.join(WORK_FOLDER), format!("{id}.")));
        let in_temp = (
            std::env::temp_dir(),
            format!("gpu-checkpoint-restore.{id}."),
        );
        let mut failed = None;
        for (parent, prefix) in in_store.into_iter().chain([in_temp]) {
            if storage.is_some_and(|s| parent.starts_with(s)) {
                if let Err(source) = crate::util::ensure_private_dir(&parent) {
                    failed = Some(Error::WorkDir {
                        path: parent,
                        source,
                    });
                    continue;
                }
            }
            // Between the mkdir and the lock, another restore's sweep ([`remove_stale_work_dirs`]) may take
            // the new folder for a killed restore's and remove it; the lock is then on a deleted folder
            // (issue 18: CRIU could not create its log there). Only a folder still at its path once locked
            // is ours for good (a sweep removes only what it has locked); else a new one, a few times.
            for _ in 0..3 {
                let made = crate::util::create_unique_private_dir(&parent, &prefix)
                    .and_then(|path| Ok((lock_dir(&path)?, path)));
                match made {
                    Ok((Some(lock), path)) if still_at(&lock, &path) => {
                        return Ok(WorkDir { path, _lock: lock })
                    }
                    Ok((_, path)) => {
                        let source =
                            std::io::Error::other("removed or locked by another restore's sweep");
                        failed = Some(Error::WorkDir { path, source });
                    }
                    Err(source) => {
                        failed = Some(Error::WorkDir {
                            path: parent.clone(),
                            source,
                        })
                    }
                }
            }
        }
        // The temporary folder is always a candidate, so `failed` is its error.
        Err(failed.expect("at least one candidate"))
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(
                "could not remove the restore work folder {}: {e}",
                self.path.display()
            );
        }
    }
}

/// Opens `dir` (never through a link) and takes its exclusive lock: `Ok(None)` when another process holds
/// it.
fn lock_dir(dir: &Path) -> std::io::Result<Option<nix::fcntl::Flock<std::fs::File>>> {
    use nix::fcntl::{Flock, FlockArg};
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(dir)?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(lock) => Ok(Some(lock)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(e.into()),
    }
}

/// Whether the folder `lock` holds is still the one at `path` (not removed, nor replaced, meanwhile).
fn still_at(lock: &nix::fcntl::Flock<std::fs::File>, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (lock.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(held), Ok(there)) => held.dev() == there.dev() && held.ino() == there.ino(),
        _ => false,
    }
}

/// Removes the work folders that killed restores left in a store (their lock died with them); folders of
/// restores still running are locked and kept. Returns how many were removed. Run at the start of every
/// restore and by `gc`.
pub fn remove_stale_work_dirs(storage: &Path) -> std::io::Result<u64> {
    let root = storage.join(WORK_FOLDER);
    let entries = match std::fs::read_dir(&root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for entry in entries {
        let path = entry?.path();
        // A link or a file is nothing a restore made: leave it (and never follow it).
        match std::fs::symlink_metadata(&path) {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => continue,
            // Removed meanwhile by its restore, or by another sweep.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        }
        // Another sweep may have removed it between our open and our lock: then it is gone already.
        match lock_dir(&path) {
            Ok(Some(lock)) if still_at(&lock, &path) => {
                std::fs::remove_dir_all(&path)?;
                removed += 1;
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, MetadataExt};

    /// A store whose `restore-work` was replaced by a link to someone else's folder: the work folder must not
    /// be made through it (root's CRIU would read images that user can swap).
    #[test]
    fn work_folder_is_private_and_never_made_through_a_planted_link() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let theirs = dir.path().join("theirs");
        std::fs::create_dir_all(&store).unwrap();
        std::fs::create_dir(&theirs).unwrap();
        symlink(&theirs, store.join(WORK_FOLDER)).unwrap();
        let work = WorkDir::create(Some(&store), "20261124T000000Z-00000000").unwrap();
        assert!(
            std::fs::read_dir(&theirs).unwrap().next().is_none(),
            "nothing made in the linked folder"
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
        std::fs::remove_file(store.join(WORK_FOLDER)).unwrap();
        let a = WorkDir::create(Some(&store), "X").unwrap();
        let b = WorkDir::create(Some(&store), "X").unwrap();
        assert_ne!(a.path(), b.path());
        assert!(a.path().starts_with(store.join(WORK_FOLDER)));
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
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        std::fs::create_dir_all(&store).unwrap();
        let lost = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..400 {
                        remove_stale_work_dirs(&store).unwrap();
                        let work = WorkDir::create(Some(&store), "ID").unwrap();
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
    /// while the folder of a restore still running stays.
    #[test]
    fn stale_work_folders_are_removed_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        std::fs::create_dir_all(store.join(WORK_FOLDER).join("ID.dead-restore")).unwrap();
        std::fs::write(
            store.join(WORK_FOLDER).join("ID.dead-restore/pages-1.img"),
            b"x",
        )
        .unwrap();
        let live = WorkDir::create(Some(&store), "ID").unwrap();
        assert_eq!(remove_stale_work_dirs(&store).unwrap(), 1);
        assert!(!store.join(WORK_FOLDER).join("ID.dead-restore").exists());
        assert!(live.path().is_dir(), "a running restore's folder is kept");
        drop(live);
        assert_eq!(remove_stale_work_dirs(&store).unwrap(), 0);
        assert_eq!(remove_stale_work_dirs(&dir.path().join("none")).unwrap(), 0);
    }
}
