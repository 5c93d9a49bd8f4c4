//! An in-memory backend for tests: objects in a map, nothing more. Like an object store it has no lock
//! and no local fast path, so the store's object-store paths (leases, the gc grace period) run on it; it
//! also lets tests damage objects, fail writes, and age objects on purpose.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use super::{chunk_key, manifest_key, Backend, ObjectMeta, ReadBackend};
use crate::store::chunk::ChunkId;
use crate::store::error::{Error, Result};

/// Test-only storage. Not durable, not shared between processes.
pub struct MemoryBackend {
    work: PathBuf,
    objects: Mutex<BTreeMap<String, (Vec<u8>, SystemTime)>>,
    /// When set, every write fails with ENOSPC (to test "storage full" paths).
    pub fail_writes: AtomicBool,
    /// When set, chunk writes fail with ENOSPC while the store still looks writable: a disk that fills
    /// up during a checkpoint.
    pub fail_chunk_writes: AtomicBool,
    /// Called before every chunk write, from the store's workers: a slow store (it may block), or one that
    /// fails later on (it returns true: the write fails with ENOSPC).
    #[allow(clippy::type_complexity)]
    pub chunk_write_hook: Mutex<Option<Box<dyn Fn() -> bool + Send + Sync>>>,
}

impl MemoryBackend {
    /// `work` is a local folder the test owns (ingests create their staging folders in it).
    pub fn new(work: &Path) -> MemoryBackend {
        MemoryBackend {
            work: work.to_path_buf(),
            objects: Mutex::default(),
            fail_writes: AtomicBool::default(),
            fail_chunk_writes: AtomicBool::default(),
            chunk_write_hook: Mutex::default(),
        }
    }

    fn objects(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Vec<u8>, SystemTime)>> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn full(&self, op: &'static str) -> Error {
        Error::Io {
            op,
            path: self.location().into(),
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        }
    }

    fn with(&self, key: &str, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        match self.objects().get_mut(key) {
            Some(o) => {
                f(&mut o.0);
                true
            }
            None => false,
        }
    }

    /// Lets a test change (damage) a stored chunk.
    pub fn with_chunk(&self, id: &ChunkId, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        self.with(&chunk_key(id), f)
    }

    /// Lets a test change (damage) a stored manifest.
    pub fn with_manifest(&self, id: &str, f: impl FnOnce(&mut Vec<u8>)) -> bool {
        self.with(&manifest_key(id), f)
    }

    /// Removes a chunk behind the store's back.
    pub fn remove_chunk(&self, id: &ChunkId) -> bool {
        self.objects().remove(&chunk_key(id)).is_some()
    }

    /// Makes every stored object `by` older (time passing, for gc's grace period and leases' expiry).
    pub fn age(&self, by: Duration) {
        for o in self.objects().values_mut() {
            o.1 -= by;
        }
    }
}

impl ReadBackend for MemoryBackend {
    fn location(&self) -> &str {
        "memory:"
    }

    fn get(&self, key: &str, buf: &mut Vec<u8>) -> Result<bool> {
        match self.objects().get(key) {
            Some(o) => {
                buf.clear();
                buf.extend_from_slice(&o.0);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn get_range(&self, key: &str, range: Range<u64>, buf: &mut Vec<u8>) -> Result<bool> {
        match self.objects().get(key) {
            Some(o) => {
                let end = (range.end as usize).min(o.0.len());
                let start = (range.start as usize).min(end);
                buf.clear();
                buf.extend_from_slice(&o.0[start..end]);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        Ok(self.objects().get(key).map(|o| ObjectMeta {
            key: key.to_owned(),
            size: o.0.len() as u64,
            modified: Some(o.1),
        }))
    }

    fn list(&self, prefix: &str, f: &mut dyn FnMut(ObjectMeta)) -> Result<()> {
        let found: Vec<ObjectMeta> = self
            .objects()
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, o)| ObjectMeta {
                key: k.clone(),
                size: o.0.len() as u64,
                modified: Some(o.1),
            })
            .collect();
        found.into_iter().for_each(f);
        Ok(())
    }

    fn work_root(&self) -> Option<&Path> {
        Some(&self.work)
    }
}

impl Backend for MemoryBackend {
    fn init(&self) -> Result<()> {
        crate::util::create_private_dir_all(&self.work)
            .map_err(Error::io("cannot create", &self.work))
    }

    fn check_writable(&self) -> Result<()> {
        if self.fail_writes.load(Ordering::Relaxed) {
            return Err(Error::Unwritable {
                path: self.location().into(),
                source: std::io::Error::from_raw_os_error(libc::ENOSPC),
            });
        }
        Ok(())
    }

    fn put(&self, key: &str, parts: &[&[u8]], _durable: bool) -> Result<()> {
        if self.fail_writes.load(Ordering::Relaxed) {
            return Err(self.full("cannot write"));
        }
        if key.starts_with(super::CHUNKS) {
            let hook = self
                .chunk_write_hook
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let fail = hook.as_ref().is_some_and(|h| h());
            drop(hook);
            if fail || self.fail_chunk_writes.load(Ordering::Relaxed) {
                return Err(self.full("cannot write chunk"));
            }
        }
        self.objects()
            .insert(key.to_owned(), (parts.concat(), SystemTime::now()));
        Ok(())
    }

    fn sync(&self, _keys: &[String]) -> Result<()> {
        if self.fail_writes.load(Ordering::Relaxed) {
            return Err(self.full("cannot sync"));
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.objects().remove(key).is_some())
    }
}
