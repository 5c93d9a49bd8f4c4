//! An in-memory backend for tests: objects in hash maps, a reader-writer lock in a mutex, and a staging root
//! the test provides. It also lets tests damage objects on purpose.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};

use super::{Backend, LockGuard, LockMode, StaleCleanup};
use crate::store::chunk::ChunkId;
use crate::store::error::{Error, Result};

#[derive(Default)]
struct LockState {
    readers: usize,
    writer: bool,
}

#[derive(Default)]
struct Objects {
    chunks: HashMap<ChunkId, Vec<u8>>,
    manifests: HashMap<String, Vec<u8>>,
}

/// Test-only storage. Not durable, not shared between processes.
pub struct MemoryBackend {
    location: PathBuf,
    staging: PathBuf,
    objects: Mutex<Objects>,
    lock: Arc<(Mutex<LockState>, Condvar)>,
    /// When set, every write fails with ENOSPC (to test "storage full" paths).
    pub fail_writes: std::sync::atomic::AtomicBool,
    /// When set, chunk writes fail with ENOSPC while the store still looks writable: a disk that fills
    /// up during a checkpoint.
    pub fail_chunk_writes: std::sync::atomic::AtomicBool,
}

struct MemGuard {
    lock: Arc<(Mutex<LockState>, Condvar)>,
    mode: LockMode,
}

impl Drop for MemGuard {
    fn drop(&mut self) {
        let (m, cv) = &*self.lock;
        let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
        match self.mode {
            LockMode::Shared => s.readers -= 1,
            LockMode::Exclusive => s.writer = false,
        }
        cv.notify_all();
    }
}

impl MemoryBackend {
    /// `staging` is a local folder the test owns (ingests create their staging folders in it).
    pub fn new(staging: &Path) -> MemoryBackend {
        MemoryBackend {
            location: PathBuf::from("memory:"),
            staging: staging.to_path_buf(),
            objects: Mutex::default(),
            lock: Arc::default(),
            fail_writes: Default::default(),
            fail_chunk_writes: Default::default(),
        }
    }

    fn objects(&self) -> std::sync::MutexGuard<'_, Objects> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_fail(&self) -> Result<()> {
        if self.fail_writes.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Error::Io {
                op: "cannot write",
                path: self.location.clone(),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        Ok(())
    }

    /// Lets a test change (damage) a stored chunk.
    pub fn with_chunk(&self, id: &ChunkId, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        match self.objects().chunks.get_mut(id) {
            Some(c) => {
                f(c);
                true
            }
            None => false,
        }
    }

    /// Lets a test change (damage) a stored manifest.
    pub fn with_manifest(&self, id: &str, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        match self.objects().manifests.get_mut(id) {
            Some(m) => {
                f(m);
                true
            }
            None => false,
        }
    }

    /// Removes a chunk behind the store's back.
    pub fn remove_chunk(&self, id: &ChunkId) -> bool {
        self.objects().chunks.remove(id).is_some()
    }

    fn acquire(&self, mode: LockMode, wait: bool) -> Option<LockGuard> {
        let (m, cv) = &*self.lock;
        let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let free = match mode {
                LockMode::Shared => !s.writer,
                LockMode::Exclusive => !s.writer && s.readers == 0,
            };
            if free {
                match mode {
                    LockMode::Shared => s.readers += 1,
                    LockMode::Exclusive => s.writer = true,
                }
                return Some(LockGuard(Box::new(MemGuard {
                    lock: self.lock.clone(),
                    mode,
                })));
            }
            if !wait {
                return None;
            }
            s = cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Backend for MemoryBackend {
    fn location(&self) -> &Path {
        &self.location
    }

    fn init(&self) -> Result<()> {
        crate::util::create_private_dir_all(&self.staging)
            .map_err(Error::io("cannot create", &self.staging))
    }

    fn check_writable(&self) -> Result<()> {
        self.check_fail().map_err(|e| match e {
            Error::Io { path, source, .. } => Error::Unwritable { path, source },
            e => e,
        })
    }

    fn staging_root(&self) -> &Path {
        &self.staging
    }

    fn put_chunk(&self, id: &ChunkId, header: &[u8], payload: &[u8]) -> Result<()> {
        self.check_fail()?;
        if self
            .fail_chunk_writes
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(Error::Io {
                op: "cannot write chunk",
                path: self.location.clone(),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        let mut obj = Vec::with_capacity(header.len() + payload.len());
        obj.extend_from_slice(header);
        obj.extend_from_slice(payload);
        self.objects().chunks.insert(*id, obj);
        Ok(())
    }

    fn sync_chunks(&self, _written: &[ChunkId]) -> Result<()> {
        self.check_fail()
    }

    fn read_chunk(&self, id: &ChunkId, buf: &mut Vec<u8>) -> Result<bool> {
        match self.objects().chunks.get(id) {
            Some(c) => {
                buf.clear();
                buf.extend_from_slice(c);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn delete_chunk(&self, id: &ChunkId) -> Result<()> {
        self.objects().chunks.remove(id);
        Ok(())
    }

    fn list_chunks(&self, f: &mut dyn FnMut(ChunkId, u64)) -> Result<()> {
        let all: Vec<(ChunkId, u64)> = self
            .objects()
            .chunks
            .iter()
            .map(|(id, c)| (*id, c.len() as u64))
            .collect();
        for (id, len) in all {
            f(id, len);
        }
        Ok(())
    }

    fn put_manifest(&self, id: &str, bytes: &[u8]) -> Result<()> {
        self.check_fail()?;
        self.objects()
            .manifests
            .insert(id.to_owned(), bytes.to_vec());
        Ok(())
    }

    fn get_manifest(&self, id: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.objects().manifests.get(id).cloned())
    }

    fn delete_manifest(&self, id: &str) -> Result<bool> {
        Ok(self.objects().manifests.remove(id).is_some())
    }

    fn list_manifests(&self) -> Result<Vec<String>> {
        Ok(self.objects().manifests.keys().cloned().collect())
    }

    fn manifest_path(&self, id: &str) -> PathBuf {
        self.location.join(format!("{id}.json"))
    }

    fn lock(&self, mode: LockMode) -> Result<LockGuard> {
        Ok(self
            .acquire(mode, true)
            .expect("waiting acquire always succeeds"))
    }

    fn try_lock(&self, mode: LockMode) -> Result<Option<LockGuard>> {
        Ok(self.acquire(mode, false))
    }

    fn cleanup_stale(&self) -> Result<StaleCleanup> {
        let mut out = StaleCleanup::default();
        if let Ok(entries) = std::fs::read_dir(&self.staging) {
            for entry in entries.flatten() {
                if std::fs::remove_dir_all(entry.path()).is_ok() {
                    out.staging_dirs += 1;
                }
            }
        }
        Ok(out)
    }
}
