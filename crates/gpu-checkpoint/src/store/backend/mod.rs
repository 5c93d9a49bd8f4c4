//! The storage boundary, shaped like an object store: write-once objects under keys, read whole or by
//! range, looked up (`head`), listed by prefix and deleted. Everything above it (ingest, materialize,
//! verify, gc) speaks only this (what only reads, only its read half, [`ReadBackend`]), so a store on S3
//! is one more implementation; the store's layout (which key holds what) is [`Objects`] and
//! [`ReadObjects`], the same for every backend.
//!
//! A local file system can do more than an object store: direct I/O, mapping and splicing chunk files, a
//! staging folder on the store's own disk, flock. Those are an optional capability, [`LocalFs`], that only
//! the file-system backend offers ([`ReadBackend::local`]): the flows ask for the capability, never which
//! backend they hold, and every fast path has a plain object-store way beside it.
//!
//! Implementations: [`LocalBackend`] (a local or shared POSIX file system), `S3Backend` (with the `s3`
//! feature: any S3-compatible server) and, for tests only (the unit tests, and the `test-support` feature),
//! `MemoryBackend`: no local capability, so it takes the object-store paths, leases included.

mod cache;
mod direct;
mod files;
mod local;
#[cfg(any(test, feature = "test-support"))]
mod memory;
mod objects;
#[cfg(feature = "s3")]
mod s3;
mod trust;

pub use cache::{CacheStats, CachedBackend};
pub use local::{LocalBackend, DIRECT_IO_ENV};
#[cfg(any(test, feature = "test-support"))]
pub use memory::MemoryBackend;
pub(crate) use objects::signature_of_key;
pub use objects::{
    chunk_key, manifest_key, signature_key, Objects, ReadObjects, CHUNKS, LEASES, MANIFESTS,
    STORE_FILE,
};
#[cfg(feature = "s3")]
pub use s3::{S3Backend, S3Config, S3_RETRY_TIMEOUT_ENV};
pub use trust::{uid_of, user_name, Access};

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::chunk::ChunkId;
use super::error::Result;
use crate::util::AlignedBuf;

/// Shared (readers and writers of checkpoints) or exclusive (gc) access to a local store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    /// Held by every ingest, materialize and verify: they need the chunks they reference to stay.
    Shared,
    /// Held by gc while it decides what is unreferenced and deletes it.
    Exclusive,
}

/// Holds a store lock until dropped. Backends put whatever keeps the lock alive inside (an flock'ed file, a
/// guard).
pub struct LockGuard(#[allow(dead_code)] pub Box<dyn Send + Sync>);

/// What [`LocalFs::cleanup_stale`] removed.
#[derive(Clone, Copy, Debug, Default)]
pub struct StaleCleanup {
    /// Staging folders of ingests that are no longer running (crashed or killed writers).
    pub staging_dirs: u64,
    /// Temporary objects of interrupted chunk or manifest writes.
    pub temp_objects: u64,
    /// Bytes those took.
    pub bytes: u64,
}

/// What a listing or a `head` says about one stored object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectMeta {
    /// The object's key (store-relative: `chunks/ab/abcd...`).
    pub key: String,
    pub size: u64,
    /// When it was last written, by the storage's clock (`None` where the storage does not say).
    pub modified: Option<SystemTime>,
}

/// The read half of a store's storage: objects under keys, read whole or by range, looked up and listed.
/// Implementations must be safe to call from many threads at once.
///
/// The restore path and verify take only this half, so the compiler keeps them from writing to a store
/// they read (a store another user trusts us to read, a checkpoint being restored). [`Backend`] adds the
/// writes; a decorator implements both halves over one it wraps.
///
/// Keys are `/`-separated, store-relative, made only by [`Objects`] (never from user input). The
/// semantics every implementation keeps, and the only ones the store relies on (see `docs/store.md`):
/// - an object is written whole or not at all: a reader sees no object or a complete one;
/// - after `put` (durable) or `sync` returns, a `get`, `head` or `list` anywhere sees the object, and after
///   `delete` returns none sees it (read-after-write consistency, which S3 gives since 2020);
/// - nothing conditional: two writers of one key may both succeed, and either copy may stay (the store only
///   writes the same bytes twice under one key, or keys that are unique to one writer).
pub trait ReadBackend: Send + Sync {
    /// Where the store lives, for messages: a path, or a URL for object stores.
    fn location(&self) -> &str;

    /// Where object `key` lives, for messages (a file path, or a URL).
    fn describe(&self, key: &str) -> String {
        format!("{}/{key}", self.location().trim_end_matches('/'))
    }

    /// Reads a whole object into `buf` (replacing its content). `Ok(false)` if there is no such object.
    fn get(&self, key: &str, buf: &mut Vec<u8>) -> Result<bool>;

    /// Reads bytes `range` of an object into `buf` (fewer where the object ends first). `Ok(false)` if
    /// there is no such object.
    fn get_range(&self, key: &str, range: Range<u64>, buf: &mut Vec<u8>) -> Result<bool>;

    /// Size and age of an object, `None` if there is none.
    fn head(&self, key: &str) -> Result<Option<ObjectMeta>>;

    /// Calls `f` for every object whose key starts with `prefix`, in no particular order.
    fn list(&self, prefix: &str, f: &mut dyn FnMut(ObjectMeta)) -> Result<()>;

    /// Hints that object `key` will be read soon: a backend that can start fetching it in the background
    /// does. Never fails; default: nothing.
    fn prefetch(&self, _key: &str) {}

    /// Whether a [`ReadBackend::prefetch`] holds the object's bytes in this process until it is read (an
    /// object store's fetch ahead) rather than in the page cache: the read path then bounds its read-ahead
    /// by bytes within the memory budget. Default: no.
    fn read_ahead_in_memory(&self) -> bool {
        false
    }

    /// How many requests this backend wants in flight to be fast: 0 for a local disk (the workers' own
    /// reads keep it busy), tens for an object store, whose every request waits a network round trip.
    fn requests_in_flight(&self) -> usize {
        0
    }

    /// The local file system's fast paths, where the store is a local folder; `None` for every other
    /// backend (they then take the plain object paths).
    fn local(&self) -> Option<&dyn LocalFs> {
        None
    }

    /// A local folder this client may use for staging folders and restore work (private, on the client's
    /// disk), when the backend knows one; `None`: the system's temporary folder.
    fn work_root(&self) -> Option<&Path> {
        self.local().map(|l| l.staging_root())
    }
}

/// A store's storage, read and written: [`ReadBackend`] and the writes (which ingest, gc and leases
/// need). Every implementation keeps the semantics [`ReadBackend`] lists.
pub trait Backend: ReadBackend {
    /// Creates the store's layout if it is missing, or validates an existing one (format and version).
    fn init(&self) -> Result<()>;

    /// Fails with a storage error (exit status 6) if objects cannot be written right now.
    fn check_writable(&self) -> Result<()>;

    /// Stores `parts`, concatenated, as object `key`. Write-once: if another writer stored the key
    /// meanwhile, either copy may stay. `durable`: durable when this returns (manifests: after it the
    /// checkpoint exists); otherwise durable only after [`Backend::sync`] (chunks, synced together).
    fn put(&self, key: &str, parts: &[&[u8]], durable: bool) -> Result<()>;

    /// Makes objects this process put without `durable` durable, and reports any of their writes that
    /// failed (a backend may still be sending them when `put` returns).
    fn sync(&self, keys: &[String]) -> Result<()>;

    /// Deletes an object; `Ok(false)` if there was none (where the backend can tell). A deleted manifest is
    /// gone for every reader when this returns.
    fn delete(&self, key: &str) -> Result<bool>;

    /// Bytes this backend may hold in puts sent in the background: an ingest's plan takes them out of
    /// the memory budget. Default: none.
    fn memory_in_flight(&self) -> u64 {
        0
    }
}

/// Implements the named [`Backend`] writes by handing them to the backend in field `$inner`, unchanged: a
/// decorator writes its own only where it adds something (the read cache forgets a chunk it is told to
/// overwrite), and the rest cannot drift from the trait.
macro_rules! forward_writes {
    ($inner:ident: $($method:ident),+ $(,)?) => {
        $($crate::store::backend::forward_writes!(@ $inner $method);)+
    };
    (@ $inner:ident init) => {
        fn init(&self) -> $crate::store::Result<()> {
            self.$inner.init()
        }
    };
    (@ $inner:ident check_writable) => {
        fn check_writable(&self) -> $crate::store::Result<()> {
            self.$inner.check_writable()
        }
    };
    (@ $inner:ident put) => {
        fn put(&self, key: &str, parts: &[&[u8]], durable: bool) -> $crate::store::Result<()> {
            self.$inner.put(key, parts, durable)
        }
    };
    (@ $inner:ident sync) => {
        fn sync(&self, keys: &[String]) -> $crate::store::Result<()> {
            self.$inner.sync(keys)
        }
    };
    (@ $inner:ident delete) => {
        fn delete(&self, key: &str) -> $crate::store::Result<bool> {
            self.$inner.delete(key)
        }
    };
    (@ $inner:ident memory_in_flight) => {
        fn memory_in_flight(&self) -> u64 {
            self.$inner.memory_in_flight()
        }
    };
}
pub(crate) use forward_writes;

/// What only a store in a local folder can do: the fast paths of a local disk, and flock.
pub trait LocalFs: Send + Sync {
    /// The store's folder: the flows keep CRIU logs and restore work folders in it (same disk, same
    /// permissions).
    fn root(&self) -> &Path;

    /// The folder, on the store's own file system, in which ingests get their staging folders.
    fn staging_root(&self) -> &Path;

    /// The file holding object `key` (for messages and tests: the backend itself reaches its files only
    /// below the folder it held open when it checked the store's owner, never through a link).
    fn object_path(&self, key: &str) -> PathBuf;

    /// Whether the store is another user's, trusted for reading only: the flows then keep their logs and
    /// work folders elsewhere, and nothing is written to it.
    fn read_only(&self) -> bool {
        false
    }

    /// Creates the private staging folder of checkpoint `id` in [`LocalFs::staging_root`] and returns its
    /// path (a folder of that name existing already is a conflict).
    fn create_staging(&self, id: &str) -> Result<PathBuf>;

    /// Chunk `id`'s object file, opened for reading (never through a link); `None` when it is missing or
    /// not a regular file.
    fn open_chunk(&self, id: &ChunkId) -> Option<std::fs::File>;

    /// Whether a whole page-aligned object given as one part to [`Backend::put`] is written with direct
    /// I/O: the ingest then builds each object in an aligned buffer
    /// ([`Encoder::encode_object`](crate::store::chunk::Encoder::encode_object)).
    fn aligned_objects(&self) -> bool;

    /// Whether [`LocalFs::read_chunk_uncached`] can read chunks past the page cache (direct I/O).
    fn reads_uncached(&self) -> bool;

    /// Reads chunk `id`'s whole object into `buf` with direct I/O when it is not (all) in the page cache,
    /// and returns its length. `Ok(None)`: read it the usual way: it is cached, missing, or direct reads
    /// are off. A cold read through the page cache costs the kernel a page allocation and insertion per
    /// 4 KiB and left this project's VMs at 2.4 GB/s, where direct reads of the same files ran at 3.8 GB/s
    /// with a tenth of the system CPU.
    fn read_chunk_uncached(&self, id: &ChunkId, buf: &mut AlignedBuf) -> Result<Option<usize>>;

    /// Reads chunk `id`'s whole object into `buf` (a cold one with direct I/O) and returns its length, or
    /// `Ok(None)` if there is no such chunk; an object longer than `max_len` is not read (its length is
    /// returned).
    fn read_object(
        &self,
        id: &ChunkId,
        max_len: usize,
        buf: &mut AlignedBuf,
    ) -> Result<Option<usize>>;

    /// Takes the store lock; blocks until it is available.
    fn lock(&self, mode: LockMode) -> Result<LockGuard>;

    /// Takes the store lock only if it is free right now.
    fn try_lock(&self, mode: LockMode) -> Result<Option<LockGuard>>;

    /// Puts the permissions of every store path (chunks included) back to private where someone changed
    /// them, says so on stderr, and returns what it found (`verify` reports it).
    fn restore_permissions(&self) -> Vec<String>;

    /// Removes what dead writers left behind (staging folders, temporary files). Only called with the
    /// exclusive lock held, so no writer is running.
    fn cleanup_stale(&self) -> Result<StaleCleanup>;
}
