//! The storage boundary. Everything above it (ingest, materialize, verify, gc) speaks only this trait, so an
//! S3-compatible backend is one more implementation of it: chunks and manifests are write-once objects under
//! keys, listing and deletion are by key, and durability and locking are explicit calls.
//!
//! Implementations: [`LocalBackend`] (the real one: a local or shared POSIX filesystem) and [`MemoryBackend`]
//! (tests only).

mod direct;
mod files;
mod local;
mod memory;

pub use local::{LocalBackend, DIRECT_IO_ENV};
pub use memory::MemoryBackend;

use std::path::{Path, PathBuf};

use super::chunk::{ChunkId, HEADER_LEN};
use super::error::Result;
use crate::util::AlignedBuf;

/// Shared (readers and writers of checkpoints) or exclusive (gc) access to the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockMode {
    /// Held by every ingest, materialize and verify: they need the chunks they reference to stay.
    Shared,
    /// Held by gc while it decides what is unreferenced and deletes it.
    Exclusive,
}

/// Holds a store lock until dropped. Backends put whatever keeps the lock alive inside (an flock'ed file, a
/// lease, a guard).
pub struct LockGuard(#[allow(dead_code)] pub Box<dyn Send + Sync>);

/// What [`Backend::cleanup_stale`] removed.
#[derive(Clone, Copy, Debug, Default)]
pub struct StaleCleanup {
    /// Staging folders of ingests that are no longer running (crashed or killed writers).
    pub staging_dirs: u64,
    /// Temporary objects of interrupted chunk or manifest writes.
    pub temp_objects: u64,
    /// Bytes those took.
    pub bytes: u64,
}

/// A store's storage. Implementations must be safe to call from many threads at once.
pub trait Backend: Send + Sync {
    /// Where the store lives, for messages (a path, or a URL for object stores).
    fn location(&self) -> &Path;

    /// The store's own local folder, when it is one: the flows keep CRIU logs and restore work folders in
    /// it (same disk, same permissions). `None` for stores that are not a local folder (object stores,
    /// tests' memory): the flows then use the temporary folder.
    fn local_dir(&self) -> Option<&Path> {
        None
    }

    /// Creates the store's layout if it is missing, or validates an existing one (format and version).
    fn init(&self) -> Result<()>;

    /// Fails with a storage error (exit status 6) if chunks and manifests cannot be written right now.
    fn check_writable(&self) -> Result<()>;

    /// Puts the permissions of every store path (chunks included) back to private where someone changed
    /// them, says so on stderr, and returns what it found (`verify` reports it). Default: nothing to do.
    fn restore_permissions(&self) -> Vec<String> {
        Vec::new()
    }

    /// A local folder, private to this store, in which ingests get their staging folders (CRIU writes its
    /// images there). For the local backend it is on the store's own filesystem.
    fn staging_root(&self) -> &Path;

    /// Stores chunk `id` (its header, then the rest of its object: the payload and, in format version 2, the
    /// trailer) under its name, write-once: if another writer stored the same name meanwhile, either copy
    /// may stay (they are identical). Not durable until [`Backend::sync_chunks`].
    fn put_chunk(&self, id: &ChunkId, header: &[u8], rest: &[u8]) -> Result<()>;

    /// Whether [`Backend::put_chunk_object`] is the cheaper way in: it writes a page-aligned object with
    /// direct I/O. The ingest then builds each object in an aligned buffer ([`Encoder::encode_object`]).
    ///
    /// [`Encoder::encode_object`]: crate::store::chunk::Encoder::encode_object
    fn aligned_objects(&self) -> bool {
        false
    }

    /// Stores chunk `id` given as its whole object (header, payload, trailer), like [`Backend::put_chunk`].
    fn put_chunk_object(&self, id: &ChunkId, object: &[u8]) -> Result<()> {
        self.put_chunk(id, &object[..HEADER_LEN], &object[HEADER_LEN..])
    }

    /// Makes the given chunks (written by this process with `put_chunk`) durable.
    fn sync_chunks(&self, written: &[ChunkId]) -> Result<()>;

    /// Reads a whole stored chunk into `buf` (replacing its content). `Ok(false)` if there is no such chunk.
    fn read_chunk(&self, id: &ChunkId, buf: &mut Vec<u8>) -> Result<bool>;

    /// The chunk's object as a local file, when the backend keeps chunks in files. `None`: read it with
    /// `read_chunk`.
    fn local_chunk_file(&self, _id: &ChunkId) -> Option<PathBuf> {
        None
    }

    /// Whether [`Backend::read_chunk_uncached`] can read chunks past a cache (direct I/O).
    fn reads_uncached(&self) -> bool {
        false
    }

    /// Reads chunk `id`'s whole object into `buf` with direct I/O when it is not (all) in the page cache,
    /// and returns its length. `Ok(None)`: read it the usual way ([`Backend::read_chunk`], or mapped): it is
    /// cached, missing, or the backend cannot. A cold read through the page cache costs the kernel a page
    /// allocation and insertion per 4 KiB and left this project's VMs at 2.4 GB/s, where direct reads of the
    /// same files ran at 3.8 GB/s with a tenth of the system CPU.
    fn read_chunk_uncached(&self, _id: &ChunkId, _buf: &mut AlignedBuf) -> Result<Option<usize>> {
        Ok(None)
    }

    /// Reads chunk `id`'s whole object into `buf` and returns its length, or `Ok(None)` if there is no such
    /// chunk. The ingest reads every chunk it would reuse this way, to check it first (`check_reused`). An
    /// object longer than `max_len` is not read (its length is returned): the caller knows it
    /// cannot be the chunk it wants. The local backend reads a cold object with direct I/O, like
    /// [`Backend::read_chunk_uncached`]; the default goes through [`Backend::read_chunk`].
    fn read_object(
        &self,
        id: &ChunkId,
        max_len: usize,
        buf: &mut AlignedBuf,
    ) -> Result<Option<usize>> {
        let mut object = Vec::new();
        if !self.read_chunk(id, &mut object)? {
            return Ok(None);
        }
        if object.len() <= max_len {
            buf.slice_mut(object.len()).copy_from_slice(&object);
        }
        Ok(Some(object.len()))
    }

    /// Hints that chunk `id` will be read soon: a backend that can start fetching it in the background
    /// does (the local one asks the kernel to read the file ahead). Never fails; default: nothing.
    fn prefetch_chunk(&self, _id: &ChunkId) {}

    /// Deletes a chunk; deleting a missing chunk is not an error.
    fn delete_chunk(&self, id: &ChunkId) -> Result<()>;

    /// Calls `f(id, stored_len)` for every stored chunk.
    fn list_chunks(&self, f: &mut dyn FnMut(ChunkId, u64)) -> Result<()>;

    /// Stores a manifest atomically and durably (temporary name, sync, rename, sync the folder): after this
    /// returns the checkpoint exists, and a crash before it leaves no trace of it.
    fn put_manifest(&self, id: &str, bytes: &[u8]) -> Result<()>;

    /// Reads a manifest; `Ok(None)` if there is none under that id.
    fn get_manifest(&self, id: &str) -> Result<Option<Vec<u8>>>;

    /// Deletes a manifest durably; `Ok(false)` if there was none.
    fn delete_manifest(&self, id: &str) -> Result<bool>;

    /// The ids of every committed manifest, in no particular order.
    fn list_manifests(&self) -> Result<Vec<String>>;

    /// Where the manifest of `id` lives (a file path for the local backend).
    fn manifest_path(&self, id: &str) -> PathBuf;

    /// The checkpoint id a manifest path names, if the path points into this store.
    fn manifest_id_from_path(&self, path: &Path) -> Option<String> {
        let name = path.file_name()?.to_str()?;
        name.strip_suffix(".json").map(str::to_owned)
    }

    /// Takes the store lock; blocks until it is available.
    fn lock(&self, mode: LockMode) -> Result<LockGuard>;

    /// Takes the store lock only if it is free right now.
    fn try_lock(&self, mode: LockMode) -> Result<Option<LockGuard>>;

    /// Removes what dead writers left behind (staging folders, temporary objects). Only called with the
    /// exclusive lock held, so no writer is running.
    fn cleanup_stale(&self) -> Result<StaleCleanup>;
}
