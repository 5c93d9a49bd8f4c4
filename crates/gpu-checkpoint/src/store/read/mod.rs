//! Reading a checkpoint back out of the store: one way for bytes to travel, whatever their destination.
//!
//! Every chunk goes through the same steps, in [`verify`]: fetched from the backend (a cold chunk with direct
//! I/O into an aligned buffer, a cached one through the page cache or mapped in place), decoded, and its
//! hash and length checked against the manifest; nothing reaches a destination before that. The steps run
//! on the read workers, with the chunks read ahead of them where the page cache is used ([`Prefetcher`]).
//! The destinations (sinks) differ only in the order they need:
//!
//! - [`folder`]: image files written into a folder (`materialize`, `materialize_selected`), and verified
//!   chunks handed to a visitor (`visit_chunks`: the userfaultfd restore copies them into the processes).
//!   Any order: [`pool::on_workers`] hands chunks to workers as they come free.
//! - [`pipe`]: one image, in file order, to a writer or a pipe (`stream_file`: the streamed restore feeds
//!   CRIU's pipe; raw chunks are spliced from their files). It keeps a bounded window of verified chunks
//!   ahead of the writer, and recycles their buffers.
//!
//! Materialize: writes a checkpoint's image files back into a folder, with parallel reads, verifying every
//! chunk's hash before its bytes are written. Nothing is handed back until every chunk has been checked:
//! on any error the files written so far are removed, so CRIU never sees a partial or unverified image.

mod folder;
mod pipe;
mod pool;
mod reuse;
mod verify;

use std::sync::Mutex;

use serde::Serialize;

use super::manifest::CheckpointInfo;
use super::Inner;

pub(in crate::store) use folder::{materialize, materialize_selected, visit_chunks};
pub(in crate::store) use pipe::stream_file;
pub(in crate::store) use reuse::{ReadAhead, Reused};

/// What [`Store::materialize`](crate::store::Store::materialize) did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MaterializeStats {
    pub files: u64,
    /// Bytes of image files written (zero chunks included, as holes).
    pub logical_bytes: u64,
    /// Bytes read from the store.
    pub stored_bytes_read: u64,
    pub chunks_read: u64,
    pub zero_bytes: u64,
    pub elapsed_ms: u64,
}

/// The worker plan of reading a checkpoint back (no compression level matters there).
pub(super) fn read_workers(inner: &Inner, info: &CheckpointInfo) -> usize {
    let max = info.chunking.max_size as u64;
    // A stored object (or its direct-I/O buffer) and its decoded bytes, plus a zstd context.
    let per_worker = 2 * max + 2 * crate::store::ingest::MIB;
    let budget = crate::store::ingest::memory_budget(info.stats.logical_bytes)
        - crate::store::ingest::RESERVE;
    inner
        .read_threads()
        .min((budget / per_worker) as usize)
        .max(1)
}

/// How many chunks ahead of the workers the backend is asked to start reading ([`Backend::prefetch_chunk`])
/// on paths that read through the page cache. Read on demand, a chunk file from a cold cache left the
/// disk idle while the workers decoded and copied, and the workers idle while it read: a default restore
/// of 4 GiB through the page cache took 1.84-2.19 s from a cold cache against 1.05 s from a warm one, and
/// 1.78-2.10 s with 16 chunks (about 32 MiB) read ahead. Direct reads (no read-ahead) are faster still.
///
/// [`Backend::prefetch_chunk`]: crate::store::backend::Backend::prefetch_chunk
pub(super) const PREFETCH_AHEAD: usize = 16;

/// Asks the backend to read chunks ahead of the workers, in task order, from a thread of its own: on a
/// cold cache even opening a chunk file waits for the disk (folder and inode), which must not hold up a
/// worker.
///
/// A task is announced before its worker reads it or not at all: a task a worker took already is skipped,
/// and a worker that takes the task being announced waits until the announcement is made. An announcement
/// after the read would fetch the chunk a second time and, on the S3 backend, stay unread (and count
/// against its read-ahead limit) for the rest of the handle's life.
pub(super) struct Prefetcher {
    ahead: usize,
    state: Mutex<PrefetchState>,
    cond: std::sync::Condvar,
}

#[derive(Default)]
struct PrefetchState {
    /// Tasks the workers have taken so far (the highest announced by [`Prefetcher::taken`]).
    taken: usize,
    stop: bool,
    /// The task being announced to the backend right now.
    announcing: Option<usize>,
}

impl Prefetcher {
    pub(super) fn new(ahead: usize) -> Prefetcher {
        Prefetcher {
            ahead,
            state: Mutex::default(),
            cond: std::sync::Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PrefetchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls `fetch(i)` for tasks `0..n` in order, never more than `ahead` tasks beyond those taken, and
    /// never for a task a worker took already.
    pub(super) fn run(&self, n: usize, fetch: &dyn Fn(usize)) {
        for i in 0..n {
            let mut st = self.lock();
            while !st.stop && i >= st.taken + self.ahead {
                st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            if st.stop {
                return;
            }
            if i < st.taken {
                // Taken (and maybe read) already; later tasks may still be ahead of the workers.
                continue;
            }
            st.announcing = Some(i);
            drop(st);
            fetch(i);
            self.lock().announcing = None;
            self.cond.notify_all();
        }
    }

    /// A worker has taken task `taken - 1` (and so the first `taken` tasks are taken or being taken).
    /// Returns once no announcement of that task is under way: it was made, or will not be.
    pub(super) fn taken(&self, taken: usize) {
        let mut st = self.lock();
        if taken > st.taken {
            st.taken = taken;
            self.cond.notify_all();
        }
        while taken > 0 && st.announcing == Some(taken - 1) {
            st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub(super) fn stop(&self) {
        self.lock().stop = true;
        self.cond.notify_all();
    }
}

/// One chunk to fetch: file index, chunk index, offset in the file.
pub(super) type Task = (usize, usize, u64);

#[cfg(test)]
mod tests;
