//! A local read-through cache of chunk objects in front of a remote backend (an object store): a restore
//! on a node that restored before reads the chunks it already fetched from its own disk, without a request.
//!
//! The cache is a private folder of this user (0700, owner and mode checked on the folder held open, never
//! a link), with files 0600, reached only below that folder and never through a link
//! ([`crate::beneath`]). Its layout, `gpu-checkpoint-chunks-v1/ab/abcd...`, names the format's version (the objects
//! themselves are chunk objects, self-describing by their header); chunks are named by their hash, so one
//! cache serves every store. Trust: none. A chunk goes in only after it was proved to be chunk `id`
//! ([`check_without_decoding`]: its hash, or its checksum trailer), and is proved again every time it is
//! taken out; one that fails (damaged on this disk, truncated by a crash, planted) is removed and fetched
//! from the store again. The store's read path then decodes and hashes it as it does every chunk, so
//! nothing unproved reaches CRIU either way. Entries are written under a new unpredictable name
//! (`O_EXCL`, `O_NOFOLLOW`) and renamed into place: a reader sees a whole object or none.
//!
//! The cache only ever speeds a read up: a failure to write it is ignored (said once on stderr), and it is
//! never emptied by the tool (remove the folder to reclaim the space).

use std::io::{self, Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use nix::fcntl::OFlag;

use super::objects::chunk_of_key;
use super::{Backend, LocalFs, ObjectMeta, ReadBackend};
use crate::beneath::Beneath;
use crate::store::chunk::{check_without_decoding, ChunkId};
use crate::store::error::{Error, Result};
use crate::util::{check_private, create_private_dir_all, ensure_private_dir, DIR_MODE, FILE_MODE};

/// The folder inside the cache that holds chunk objects, by layout version.
const LAYOUT: &str = "gpu-checkpoint-chunks-v1";

/// What a cache did, for tests and messages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Chunks served from the cache.
    pub hits: u64,
    /// Chunks fetched from the store (and then kept).
    pub fetched: u64,
    /// Cached chunks that failed their check and were fetched again.
    pub damaged: u64,
}

/// A backend with a local read-through cache of chunk objects: see the module's documentation.
pub struct CachedBackend {
    inner: Arc<dyn Backend>,
    /// The layout folder, held open.
    root: Beneath,
    hits: AtomicU64,
    fetched: AtomicU64,
    damaged: AtomicU64,
    /// A write to the cache failed once (said once; later failures are silent).
    write_failed: AtomicBool,
}

impl CachedBackend {
    /// `inner` with a read cache in folder `dir`, created private (0700) where missing; an existing one must
    /// be a real folder of this user that no one else can enter (else a usage error: it is not used).
    pub fn new(inner: Arc<dyn Backend>, dir: &Path) -> Result<CachedBackend> {
        let refuse = |e: io::Error| Error::Invalid(format!("cache folder {}: {e}", dir.display()));
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !parent.exists() {
                create_private_dir_all(parent).map_err(refuse)?;
            }
        }
        ensure_private_dir(dir).map_err(refuse)?;
        // What is checked is the folder held open, whatever its path names by now.
        let top = Beneath::open(dir).map_err(refuse)?;
        check_private(&top.metadata().map_err(refuse)?, dir).map_err(refuse)?;
        match top.create_dir(LAYOUT, DIR_MODE) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(refuse(e)),
        }
        let root = top.subdir(LAYOUT).map_err(refuse)?;
        check_private(&root.metadata().map_err(refuse)?, root.path()).map_err(refuse)?;
        Ok(CachedBackend {
            inner,
            root,
            hits: AtomicU64::new(0),
            fetched: AtomicU64::new(0),
            damaged: AtomicU64::new(0),
            write_failed: AtomicBool::new(false),
        })
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            fetched: self.fetched.load(Ordering::Relaxed),
            damaged: self.damaged.load(Ordering::Relaxed),
        }
    }

    /// Where chunk `id` is kept, below the cache folder.
    fn rel(id: &ChunkId) -> String {
        let hex = id.to_hex();
        format!("{}/{hex}", &hex[..2])
    }

    /// Its path, for messages.
    fn path(&self, id: &ChunkId) -> PathBuf {
        self.root.join(Self::rel(id))
    }

    /// Chunk `id` from the cache into `buf`, proved; `false` when it is not cached or failed its check
    /// (then removed).
    fn take(&self, id: &ChunkId, buf: &mut Vec<u8>) -> bool {
        let Ok(Some(mut file)) = self.root.open_regular(Self::rel(id)) else {
            return false;
        };
        buf.clear();
        if file.read_to_end(buf).is_err() {
            return false;
        }
        match check_without_decoding(id, buf) {
            Ok(true) => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                true
            }
            outcome => {
                let problem = outcome.err().unwrap_or_else(|| "not provable".into());
                eprintln!(
                    "gpu-checkpoint: cached chunk {} is {problem}; fetched from the store again",
                    self.path(id).display()
                );
                self.damaged.fetch_add(1, Ordering::Relaxed);
                let _ = self.root.remove_file(Self::rel(id));
                false
            }
        }
    }

    /// Keeps chunk `id`'s object `stored`, fetched from the store, if it proves to be that chunk.
    fn keep(&self, id: &ChunkId, stored: &[u8]) {
        if check_without_decoding(id, stored) != Ok(true) {
            // Damaged in the store, or unprovable without decoding: the read path reports or decodes it.
            return;
        }
        if let Err(e) = self.write(id, stored) {
            if !self.write_failed.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "gpu-checkpoint: cannot write the read cache {} ({e}); going on without it",
                    self.root.path().display()
                );
            }
        }
    }

    /// Removes the cached copy of chunk object `key`, if any.
    fn forget(&self, key: &str) {
        if let Some(id) = chunk_of_key(key) {
            let _ = self.root.remove_file(Self::rel(&id));
        }
    }

    fn write(&self, id: &ChunkId, stored: &[u8]) -> io::Result<()> {
        let hex = id.to_hex();
        let fan = &hex[..2];
        match self.root.create_dir(fan, DIR_MODE) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let tmp = format!(
            "{fan}/.{hex}.tmp.{}.{:08x}",
            std::process::id(),
            crate::store::random_u32()
        );
        let written = self
            .root
            .create_new(&tmp, FILE_MODE, OFlag::empty())
            .and_then(|mut f| f.write_all(stored));
        match written.and_then(|()| self.root.rename(&tmp, Self::rel(id))) {
            Ok(()) => Ok(()),
            Err(e) => {
                let _ = self.root.remove_file(&tmp);
                Err(e)
            }
        }
    }
}

impl ReadBackend for CachedBackend {
    fn location(&self) -> &str {
        self.inner.location()
    }
    fn describe(&self, key: &str) -> String {
        self.inner.describe(key)
    }

    /// A chunk comes from the cache when it is there and proves good; otherwise from the store, and is
    /// then kept.
    fn get(&self, key: &str, buf: &mut Vec<u8>) -> Result<bool> {
        let Some(id) = chunk_of_key(key) else {
            return self.inner.get(key, buf);
        };
        if self.take(&id, buf) {
            return Ok(true);
        }
        if !self.inner.get(key, buf)? {
            return Ok(false);
        }
        self.fetched.fetch_add(1, Ordering::Relaxed);
        self.keep(&id, buf);
        Ok(true)
    }

    fn get_range(&self, key: &str, range: Range<u64>, buf: &mut Vec<u8>) -> Result<bool> {
        self.inner.get_range(key, range, buf)
    }
    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        self.inner.head(key)
    }
    fn list(&self, prefix: &str, f: &mut dyn FnMut(ObjectMeta)) -> Result<()> {
        self.inner.list(prefix, f)
    }

    /// A cached chunk needs no request: only the others are fetched ahead.
    fn prefetch(&self, key: &str) {
        if let Some(id) = chunk_of_key(key) {
            if self
                .root
                .symlink_metadata(Self::rel(&id))
                .is_ok_and(|m| m.is_file())
            {
                return;
            }
        }
        self.inner.prefetch(key)
    }

    fn read_ahead_in_memory(&self) -> bool {
        self.inner.read_ahead_in_memory()
    }

    fn requests_in_flight(&self) -> usize {
        self.inner.requests_in_flight()
    }
    fn local(&self) -> Option<&dyn LocalFs> {
        self.inner.local()
    }
    fn work_root(&self) -> Option<&Path> {
        self.inner.work_root()
    }
}

impl Backend for CachedBackend {
    super::forward_writes!(inner: init, check_writable, sync, memory_in_flight);

    /// Writing or deleting a chunk through this handle drops its cached copy first, so that a read after
    /// it sees what the store holds (the same bytes, except where a damaged chunk is written again).
    fn put(&self, key: &str, parts: &[&[u8]], durable: bool) -> Result<()> {
        self.forget(key);
        self.inner.put(key, parts, durable)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.forget(key);
        self.inner.delete(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::backend::{chunk_key, MemoryBackend};
    use crate::store::chunk::Encoder;
    use std::fs;
    use std::os::unix::fs::PermissionsExt;

    /// A memory backend holding one chunk of `raw`.
    fn stored(raw: &[u8], level: Option<i32>) -> (Arc<MemoryBackend>, ChunkId, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemoryBackend::new(&dir.path().join("work")));
        let id = ChunkId::of(raw);
        let mut enc = Encoder::new(level, raw.len()).unwrap();
        let object = enc.encode_object(&id, raw).1.to_vec();
        mem.put(&chunk_key(&id), &[&object], true).unwrap();
        (mem, id, dir)
    }

    #[test]
    fn a_chunk_is_kept_private_served_again_and_refetched_when_damaged() {
        for level in [None, Some(1)] {
            let raw: Vec<u8> = (0..20_000u32).map(|i| (i % 7) as u8).collect();
            let (mem, id, dir) = stored(&raw, level);
            let cache_dir = dir.path().join("cache");
            let cache = CachedBackend::new(mem.clone(), &cache_dir).unwrap();
            let mut buf = Vec::new();
            assert!(cache.get(&chunk_key(&id), &mut buf).unwrap());
            let first = buf.clone();
            assert_eq!(cache.stats().fetched, 1);
            let file = cache.path(&id);
            assert_eq!(
                fs::metadata(&file).unwrap().permissions().mode() & 0o777,
                0o600
            );
            for d in [
                &cache_dir,
                &cache.root.path().to_path_buf(),
                &file.parent().unwrap().to_path_buf(),
            ] {
                assert_eq!(fs::metadata(d).unwrap().permissions().mode() & 0o777, 0o700);
            }
            // Gone from the store: served from the cache alone.
            mem.delete(&chunk_key(&id)).unwrap();
            assert!(cache.get(&chunk_key(&id), &mut buf).unwrap());
            assert_eq!(buf, first);
            assert_eq!(cache.stats().hits, 1);
            // Damaged in the cache: removed, fetched again (from the store, back now).
            mem.put(&chunk_key(&id), &[&first], true).unwrap();
            let mut bad = first.clone();
            let n = bad.len();
            bad[n / 2] ^= 1;
            fs::write(&file, &bad).unwrap();
            assert!(cache.get(&chunk_key(&id), &mut buf).unwrap());
            assert_eq!(buf, first);
            assert_eq!(
                cache.stats(),
                CacheStats {
                    hits: 1,
                    fetched: 2,
                    damaged: 1
                }
            );
            assert_eq!(
                fs::read(&file).unwrap(),
                first,
                "the good copy is cached again"
            );
        }
    }

    #[test]
    fn a_cache_folder_open_to_others_or_a_link_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mem = Arc::new(MemoryBackend::new(&dir.path().join("work")));
        let open = dir.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).unwrap();
        let err = CachedBackend::new(mem.clone(), &open).err().unwrap();
        assert!(matches!(err, Error::Invalid(_)), "{err}");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &link).unwrap();
        fs::create_dir(dir.path().join("elsewhere")).unwrap();
        assert!(CachedBackend::new(mem, &link).is_err());
    }

    /// Issue 26: a link planted in the cache (a fan-out folder pointing elsewhere) is never followed, to
    /// read or to write; and a cache folder of another user (made where root's would go) is refused.
    #[test]
    fn links_in_the_cache_lead_nowhere_and_another_users_folder_is_refused() {
        let raw: Vec<u8> = (0..20_000u32).map(|i| (i % 11) as u8).collect();
        let (mem, id, dir) = stored(&raw, None);
        let outside = dir.path().join("outside");
        fs::create_dir(&outside).unwrap();
        let cache_dir = dir.path().join("cache");
        let cache = CachedBackend::new(mem.clone(), &cache_dir).unwrap();
        let fan = &id.to_hex()[..2];
        std::os::unix::fs::symlink(&outside, cache.root.path().join(fan)).unwrap();
        // A copy of the chunk where the link points: not taken from there, and nothing written there.
        fs::write(outside.join(id.to_hex()), b"planted").unwrap();
        let mut buf = Vec::new();
        assert!(cache.get(&chunk_key(&id), &mut buf).unwrap());
        assert_eq!(cache.stats().hits, 0);
        assert_eq!(cache.stats().fetched, 1);
        assert_eq!(fs::read_dir(&outside).unwrap().count(), 1);
        assert_eq!(fs::read(outside.join(id.to_hex())).unwrap(), b"planted");

        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CI runs as root: this test needs it"
            );
            eprintln!("SKIPPED (the other-user half): not root");
            return;
        }
        let theirs = dir.path().join("theirs");
        fs::create_dir(&theirs).unwrap();
        fs::set_permissions(&theirs, fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
        let err = CachedBackend::new(mem, &theirs).err().unwrap();
        assert!(err.to_string().contains("not a private folder"), "{err}");
    }
}
