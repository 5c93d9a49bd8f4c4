//! The local backend's [`LocalFs`] capability: what only a folder on a disk offers (the store lock, direct
//! reads of cold chunks, chunk files opened for mapping, staging folders on the store's own disk), each
//! below the store folder held open and never through a link.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use nix::fcntl::OFlag;

use super::super::direct::read_up_to;
use super::super::files::{flock, warn_modes};
use super::super::objects::chunk_key;
use super::super::trust::Access;
use super::super::{LocalFs, LockGuard, LockMode, StaleCleanup};
use super::LocalBackend;
use crate::beneath::Beneath;
use crate::store::chunk::ChunkId;
use crate::store::error::{Error, Result};
use crate::util::{AlignedBuf, DIR_MODE, FILE_MODE};

impl LocalBackend {
    /// The store's lock file, to `flock`: created where missing, except in a store trusted read-only,
    /// where readers lock it if it is there and need none where it is not (nothing can write or collect
    /// in a store no one may write). `Ok(None)`: no lock needed.
    pub(super) fn lock_file(&self, mode: LockMode) -> Result<Option<File>> {
        let (dir, access) = self.held()?;
        let path = dir.join("lock");
        let read_only = |dir: &Beneath| match dir.open_file("lock", OFlag::O_RDONLY, 0) {
            Ok(f) => Ok(Some(f)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("cannot open lock file", &path)(e)),
        };
        match (access, mode) {
            (Access::ReadOnly { .. }, LockMode::Exclusive) => self.writable().map(|_| None),
            (Access::ReadOnly { .. }, LockMode::Shared) => read_only(dir),
            (Access::ReadWrite, _) => {
                match dir.open_file("lock", OFlag::O_RDWR | OFlag::O_CREAT, FILE_MODE) {
                    Ok(f) => Ok(Some(f)),
                    // A store on a read-only mount (restoring on another node): as above.
                    Err(e) if e.raw_os_error() == Some(libc::EROFS) && mode == LockMode::Shared => {
                        read_only(dir)
                    }
                    Err(e) => Err(Error::io("cannot open lock file", &path)(e)),
                }
            }
        }
    }

    /// Opens object `key` for reading when it is a regular file (`None`: missing, a link, or anything else:
    /// not one of the store's objects).
    pub(super) fn open_object(&self, key: &str) -> Result<Option<File>> {
        self.dir()?
            .open_regular(key)
            .map_err(Error::io("cannot open", self.object_path(key)))
    }
}

impl LocalFs for LocalBackend {
    fn root(&self) -> &Path {
        &self.root
    }

    fn staging_root(&self) -> &Path {
        &self.staging
    }

    fn object_path(&self, key: &str) -> PathBuf {
        debug_assert!(
            !key.split('/')
                .any(|c| c.is_empty() || c == "." || c == ".."),
            "bad key {key:?}"
        );
        self.root.join(key)
    }

    fn read_only(&self) -> bool {
        matches!(self.held(), Ok((_, Access::ReadOnly { .. })))
    }

    fn create_staging(&self, id: &str) -> Result<PathBuf> {
        let dir = self.writable()?;
        let rel = format!("staging/{id}");
        match dir.create_dir(&rel, DIR_MODE) {
            Ok(()) => Ok(dir.join(&rel)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Err(Error::Conflict(format!(
                "staging folder {} exists already",
                dir.join(&rel).display()
            ))),
            Err(e) => Err(Error::Unwritable {
                path: dir.join(&rel).into(),
                source: e,
            }),
        }
    }

    fn open_chunk(&self, id: &ChunkId) -> Option<File> {
        self.open_object(&chunk_key(id)).ok().flatten()
    }

    fn aligned_objects(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    fn reads_uncached(&self) -> bool {
        self.direct_reads.load(Ordering::Relaxed)
    }

    fn read_chunk_uncached(&self, id: &ChunkId, buf: &mut AlignedBuf) -> Result<Option<usize>> {
        if !self.direct_reads.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let path = self.chunk_path(id);
        // Missing, unreadable or not a regular file: the usual read reports it.
        let Some(file) = self.open_chunk(id) else {
            return Ok(None);
        };
        let len = file
            .metadata()
            .map_err(Error::io("cannot stat chunk", &path))?
            .len() as usize;
        self.read_cold(&file, &path, len, buf)
    }

    fn read_object(
        &self,
        id: &ChunkId,
        max_len: usize,
        buf: &mut AlignedBuf,
    ) -> Result<Option<usize>> {
        let path = self.chunk_path(id);
        let Some(file) = self.open_object(&chunk_key(id))? else {
            return Ok(None);
        };
        let len = file
            .metadata()
            .map_err(Error::io("cannot stat chunk", &path))?
            .len() as usize;
        if len > max_len {
            return Ok(Some(len));
        }
        if let Some(n) = self.read_cold(&file, &path, len, buf)? {
            return Ok(Some(n));
        }
        read_up_to(&file, buf.slice_mut(len), len)
            .map(Some)
            .map_err(Error::io("cannot read chunk", &path))
    }

    fn lock(&self, mode: LockMode) -> Result<LockGuard> {
        let Some(file) = self.lock_file(mode)? else {
            return Ok(LockGuard(Box::new(())));
        };
        let lock = flock(file, mode, false)
            .map_err(Error::io("cannot lock", self.root.join("lock")))?
            .expect("a blocking lock is taken or fails");
        Ok(LockGuard(Box::new(lock)))
    }

    fn try_lock(&self, mode: LockMode) -> Result<Option<LockGuard>> {
        let Some(file) = self.lock_file(mode)? else {
            return Ok(Some(LockGuard(Box::new(()))));
        };
        let lock =
            flock(file, mode, true).map_err(Error::io("cannot lock", self.root.join("lock")))?;
        Ok(lock.map(|l| LockGuard(Box::new(l))))
    }

    fn restore_permissions(&self) -> Vec<String> {
        let Ok(dir) = self.writable() else {
            // Another user's store, read only: its permissions are its owner's to fix.
            return Vec::new();
        };
        let found = self.restore_modes(dir, true);
        warn_modes(&self.root, &found);
        found
    }

    fn cleanup_stale(&self) -> Result<StaleCleanup> {
        self.remove_stale()
    }
}
