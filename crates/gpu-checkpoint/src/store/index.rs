//! An index of stored chunks, for stores where asking is a request (object stores): built from one
//! listing, cached on the store handle, and only ever trusted to say "not stored". A chunk the index holds
//! is still read and checked before it is reused (`read::ReadAhead::check`), so a stale index costs at most a
//! write of bytes that were there already, never a lost chunk.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::backend::{ReadBackend, ReadObjects};
use super::chunk::ChunkId;

/// How long a listing is trusted before the next ingest lists again (chunks this client writes are added as
/// it writes them; other clients' meanwhile are merely written again).
const MAX_AGE: Duration = Duration::from_secs(60);

pub(super) struct ChunkIndex {
    ids: RwLock<HashSet<ChunkId>>,
    built: Instant,
}

impl ChunkIndex {
    /// Whether the chunk may be stored (`false`: it certainly was not at the listing, nor written since).
    pub(super) fn may_hold(&self, id: &ChunkId) -> bool {
        self.ids
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(id)
    }

    /// This client has just stored `id`.
    pub(super) fn add(&self, id: ChunkId) {
        self.ids
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id);
    }
}

/// The cache a store handle keeps.
#[derive(Default)]
pub(super) struct IndexCache(Mutex<Option<Arc<ChunkIndex>>>);

impl IndexCache {
    /// The index for an ingest into `backend`: `None` where asking is cheap (a local folder), or where the
    /// listing failed (the ingest then asks per chunk).
    pub(super) fn get(&self, backend: &dyn ReadBackend) -> Option<Arc<ChunkIndex>> {
        if backend.local().is_some() {
            return None;
        }
        let mut cached = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = cached.as_ref().filter(|i| i.built.elapsed() < MAX_AGE) {
            return Some(i.clone());
        }
        let mut ids = HashSet::new();
        if let Err(e) = backend.list_chunks(&mut |id, _| {
            ids.insert(id);
        }) {
            tracing::debug!("no index of stored chunks ({e}); asking per chunk");
            return None;
        }
        let index = Arc::new(ChunkIndex {
            ids: RwLock::new(ids),
            built: Instant::now(),
        });
        *cached = Some(index.clone());
        Some(index)
    }
}
