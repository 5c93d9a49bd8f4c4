//! The store's layout in keys, the same on every backend (and, for the local one, the same files as
//! before the boundary took the shape of an object store):
//!
//! ```text
//! store.json              format marker and version
//! chunks/ab/abcd...       one object per chunk, named by its BLAKE3 hex, fanned out by the first byte
//! manifests/ID.json       one per committed checkpoint
//! manifests/ID.sig        its signature, where it was signed (written before the manifest)
//! leases/ID.json          an ingest in progress on a store without flock (object stores), see `lease`
//! ```
//! [`Objects`] turns chunk ids and checkpoint ids into keys, and takes a [`LocalFs`](super::LocalFs) fast
//! path where the backend offers one.

use std::path::PathBuf;

use super::{Backend, ObjectMeta, ReadBackend};
use crate::store::chunk::{ChunkId, ObjectParts, HEADER_LEN};
use crate::store::error::{Error, Result};
use crate::util::AlignedBuf;

/// The store's format marker.
pub const STORE_FILE: &str = "store.json";
/// The store format this build writes and reads. Bump it on incompatible layout changes; older builds then
/// refuse the store instead of misreading it. 2: compressed chunks are written in chunk format version 2
/// (with a trailer), which builds of store version 1 read as damaged; this build reads version 1 stores and
/// marks them version 2 when it opens them (the local backend's `upgrade_marker`; an object store's marker is
/// rewritten on open).
pub const STORE_FORMAT_VERSION: u32 = 2;
const STORE_FORMAT_NAME: &str = "gpu-checkpoint-store";

#[derive(serde::Serialize, serde::Deserialize)]
struct StoreFile {
    format: String,
    version: u32,
}

/// The marker a new store gets.
pub(crate) fn marker() -> Vec<u8> {
    let marker = StoreFile {
        format: STORE_FORMAT_NAME.into(),
        version: STORE_FORMAT_VERSION,
    };
    serde_json::to_vec_pretty(&marker).expect("serialisable")
}

/// Checks an existing store's marker (`at`: where it was read, for messages): a gpu-checkpoint store of a
/// version this build reads. Returns that version (older ones are marked this build's before a write).
pub(crate) fn check_marker(bytes: &[u8], at: &str) -> Result<u32> {
    let bad = |reason: String| Error::BadStore {
        path: at.into(),
        reason,
    };
    let parsed: StoreFile =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("unreadable store marker: {e}")))?;
    if parsed.format != STORE_FORMAT_NAME {
        return Err(bad(format!(
            "not a gpu-checkpoint store (format {:?})",
            parsed.format
        )));
    }
    if parsed.version > STORE_FORMAT_VERSION {
        return Err(bad(format!(
            "store format version {} is newer than this build supports ({}); upgrade gpu-checkpoint",
            parsed.version, STORE_FORMAT_VERSION
        )));
    }
    Ok(parsed.version)
}

/// Prefix of chunk objects.
pub const CHUNKS: &str = "chunks/";
/// Prefix of manifests.
pub const MANIFESTS: &str = "manifests/";
/// Prefix of writers' leases (object stores).
pub const LEASES: &str = "leases/";

/// The key of chunk `id`.
pub fn chunk_key(id: &ChunkId) -> String {
    let hex = id.to_hex();
    format!("{CHUNKS}{}/{hex}", &hex[..2])
}

/// The key of checkpoint `id`'s manifest.
pub fn manifest_key(id: &str) -> String {
    format!("{MANIFESTS}{id}.json")
}

/// The key of checkpoint `id`'s signature (`store::signing`): beside its manifest, so that every backend
/// lists, reads and deletes it the same way.
pub fn signature_key(id: &str) -> String {
    format!("{MANIFESTS}{id}.sig")
}

/// The checkpoint id a signature key names.
pub(crate) fn signature_of_key(key: &str) -> Option<&str> {
    let id = key.strip_prefix(MANIFESTS)?.strip_suffix(".sig")?;
    (!id.is_empty() && !id.starts_with('.') && !id.contains('/')).then_some(id)
}

/// The chunk a key names, if it is a chunk key (anything else under `chunks/`, such as a temporary file, is
/// not a chunk).
pub(crate) fn chunk_of_key(key: &str) -> Option<ChunkId> {
    let rest = key.strip_prefix(CHUNKS)?;
    let (fan, hex) = rest.split_once('/')?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) || !hex.starts_with(fan) {
        return None;
    }
    ChunkId::from_hex(hex)
}

/// The checkpoint id a manifest key names (temporary files of in-flight writes start with a dot and are
/// not checkpoints).
pub(crate) fn manifest_of_key(key: &str) -> Option<&str> {
    let id = key.strip_prefix(MANIFESTS)?.strip_suffix(".json")?;
    (!id.is_empty() && !id.starts_with('.') && !id.contains('/')).then_some(id)
}

/// Chunks and manifests on any [`ReadBackend`], for reading: the layout above, and the local fast paths
/// where there are. Implemented for every backend; not meant to be implemented otherwise.
pub trait ReadObjects: ReadBackend {
    /// Reads a whole stored chunk into `buf`. `Ok(false)` if there is no such chunk.
    fn read_chunk(&self, id: &ChunkId, buf: &mut Vec<u8>) -> Result<bool> {
        self.get(&chunk_key(id), buf)
    }

    /// The chunk's object as a local file, where the store is a local folder.
    fn local_chunk_file(&self, id: &ChunkId) -> Option<PathBuf> {
        self.local().map(|l| l.object_path(&chunk_key(id)))
    }

    /// The chunk's object as a local file opened for reading, where the store is a local folder.
    fn open_local_chunk(&self, id: &ChunkId) -> Option<std::fs::File> {
        self.local().and_then(|l| l.open_chunk(id))
    }

    /// Whether cold chunks are read past the page cache ([`LocalFs::read_chunk_uncached`]).
    ///
    /// [`LocalFs::read_chunk_uncached`]: super::LocalFs::read_chunk_uncached
    fn reads_uncached(&self) -> bool {
        self.local().is_some_and(|l| l.reads_uncached())
    }

    /// A cold local chunk read with direct I/O; `Ok(None)`: read it the usual way.
    fn read_chunk_uncached(&self, id: &ChunkId, buf: &mut AlignedBuf) -> Result<Option<usize>> {
        match self.local() {
            Some(l) => l.read_chunk_uncached(id, buf),
            None => Ok(None),
        }
    }

    /// Reads chunk `id`'s whole object into `buf` and returns its length, or `Ok(None)` if there is no
    /// such chunk. The ingest reads every chunk it would reuse this way, to check it first. An object
    /// longer than `max_len` is not kept (its length is returned): it cannot be the chunk wanted.
    fn read_object(
        &self,
        id: &ChunkId,
        max_len: usize,
        buf: &mut AlignedBuf,
    ) -> Result<Option<usize>> {
        if let Some(l) = self.local() {
            return l.read_object(id, max_len, buf);
        }
        let mut object = Vec::new();
        // One byte more than the longest object wanted: enough to tell a longer one.
        if !self.get_range(&chunk_key(id), 0..max_len as u64 + 1, &mut object)? {
            return Ok(None);
        }
        if object.len() <= max_len {
            buf.slice_mut(object.len()).copy_from_slice(&object);
            return Ok(Some(object.len()));
        }
        Ok(Some(
            self.head(&chunk_key(id))?
                .map_or(object.len(), |m| m.size as usize),
        ))
    }

    /// Hints that chunk `id` will be read soon.
    fn prefetch_chunk(&self, id: &ChunkId) {
        self.prefetch(&chunk_key(id))
    }

    /// Calls `f(id, stored_len)` for every stored chunk.
    fn list_chunks(&self, f: &mut dyn FnMut(ChunkId, u64)) -> Result<()> {
        self.list_chunk_objects(&mut |m, id| f(id, m.size))
    }

    /// Calls `f(meta, id)` for every stored chunk (gc needs their age too).
    fn list_chunk_objects(&self, f: &mut dyn FnMut(&ObjectMeta, ChunkId)) -> Result<()> {
        self.list(CHUNKS, &mut |m| {
            if let Some(id) = chunk_of_key(&m.key) {
                f(&m, id)
            }
        })
    }

    /// Reads a manifest; `Ok(None)` if there is none under that id.
    fn get_manifest(&self, id: &str) -> Result<Option<Vec<u8>>> {
        let mut buf = Vec::new();
        Ok(self.get(&manifest_key(id), &mut buf)?.then_some(buf))
    }

    /// Reads a checkpoint's signature object; `Ok(None)` if it has none.
    fn get_signature(&self, id: &str) -> Result<Option<Vec<u8>>> {
        let mut buf = Vec::new();
        Ok(self.get(&signature_key(id), &mut buf)?.then_some(buf))
    }

    /// The ids of every committed manifest, in no particular order.
    fn list_manifests(&self) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        self.list(MANIFESTS, &mut |m| {
            if let Some(id) = manifest_of_key(&m.key) {
                ids.push(id.to_owned());
            }
        })?;
        Ok(ids)
    }
}

impl<B: ReadBackend + ?Sized> ReadObjects for B {}

/// Chunks and manifests on any [`Backend`], for writing (and, through [`ReadObjects`], reading).
/// Implemented for every backend; not meant to be implemented otherwise.
pub trait Objects: Backend + ReadObjects {
    /// Stores chunk `id` (its header, then the rest of its object: the payload and, in format version 2,
    /// the trailer), write-once. Not durable until [`Objects::sync_chunks`].
    fn put_chunk(&self, id: &ChunkId, header: &[u8], rest: &[u8]) -> Result<()> {
        self.put(&chunk_key(id), &[header, rest], false)
    }

    /// Whether [`Objects::put_chunk_object`] is the cheaper way in (a local store writing with direct I/O).
    fn aligned_objects(&self) -> bool {
        self.local().is_some_and(|l| l.aligned_objects())
    }

    /// Stores chunk `id` given as its whole object (header, payload, trailer), like
    /// [`Objects::put_chunk`].
    fn put_chunk_object(&self, id: &ChunkId, object: &[u8]) -> Result<()> {
        if self.local().is_some() {
            self.put(&chunk_key(id), &[object], false)
        } else {
            self.put(
                &chunk_key(id),
                &[&object[..HEADER_LEN], &object[HEADER_LEN..]],
                false,
            )
        }
    }

    /// Stores chunk `id` given as its object's consecutive parts ([`ObjectParts`] of
    /// `Encoder::encode_parts`), like [`Objects::put_chunk_object`]: a local store writes parts laid out
    /// for direct I/O straight from where they are.
    fn put_chunk_parts(&self, id: &ChunkId, object: &ObjectParts<'_>) -> Result<()> {
        match object {
            ObjectParts::Whole(o) => self.put_chunk_object(id, o),
            ObjectParts::Blocks(parts) => self.put(&chunk_key(id), parts, false),
        }
    }

    /// Makes the given chunks (put by this process) durable.
    fn sync_chunks(&self, written: &[ChunkId]) -> Result<()> {
        let keys: Vec<String> = written.iter().map(chunk_key).collect();
        self.sync(&keys)
    }

    /// Deletes a chunk; deleting a missing chunk is not an error.
    fn delete_chunk(&self, id: &ChunkId) -> Result<()> {
        self.delete(&chunk_key(id)).map(|_| ())
    }

    /// Stores a manifest atomically and durably: after this returns the checkpoint exists, and a crash
    /// before it leaves no trace of it.
    fn put_manifest(&self, id: &str, bytes: &[u8]) -> Result<()> {
        self.put(&manifest_key(id), &[bytes], true)
    }

    /// Stores a checkpoint's signature object durably, before its manifest (which commits the checkpoint).
    fn put_signature(&self, id: &str, bytes: &[u8]) -> Result<()> {
        self.put(&signature_key(id), &[bytes], true)
    }

    /// Deletes a checkpoint's signature, if it has one.
    fn delete_signature(&self, id: &str) -> Result<()> {
        self.delete(&signature_key(id)).map(|_| ())
    }

    /// Deletes a manifest durably; `Ok(false)` if there was none.
    fn delete_manifest(&self, id: &str) -> Result<bool> {
        self.delete(&manifest_key(id))
    }
}

impl<B: Backend + ?Sized> Objects for B {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_strangers_are_not_objects() {
        let id = ChunkId::of(b"x");
        let key = chunk_key(&id);
        assert_eq!(chunk_of_key(&key), Some(id));
        assert_eq!(chunk_of_key(&format!("{key}.tmp")), None);
        let hex = id.to_hex();
        assert_eq!(
            chunk_of_key(&format!("{CHUNKS}00/{hex}")),
            None,
            "wrong fan-out"
        );
        assert_eq!(
            manifest_of_key(&manifest_key("20261120T233501Z-0a")),
            Some("20261120T233501Z-0a")
        );
        assert_eq!(manifest_of_key("manifests/.x.json.tmp.1"), None);
        assert_eq!(manifest_of_key("manifests/.x.json"), None);
        assert_eq!(manifest_of_key("manifests/a/b.json"), None);
        assert_eq!(manifest_of_key(&signature_key("x")), None);
        assert_eq!(signature_of_key(&signature_key("x")), Some("x"));
        assert_eq!(signature_of_key(&manifest_key("x")), None);
    }
}
