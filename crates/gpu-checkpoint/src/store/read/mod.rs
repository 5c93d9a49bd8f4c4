//! Reading a checkpoint back out of the store: one way for bytes to travel, whatever their destination.
//!
//! Every chunk goes through the same steps, in [`verify`]: fetched from the backend (a cold chunk with direct
//! I/O into an aligned buffer, a cached one through the page cache or mapped in place), decoded, and its
//! hash and length checked against the manifest; nothing reaches a destination before that. The steps run
//! on the read workers, with the chunks read ahead of them where the page cache is used ([`Prefetcher`]).
//! The destinations (sinks) differ only in the order they need:
//!
//! - [`folder`]: image files written into a folder (`materialize`, `materialize_selected`). Any order:
//!   [`pool::on_workers`] hands chunks to workers as they come free.
//! - [`chunks`]: verified chunks handed to the caller (`Store::visit_chunks` on the workers, or one at a
//!   time with a `ChunkReader`: the userfaultfd restore copies them into the processes).
//! - [`pipe`]: one image, in file order, to a writer or a pipe (`stream_file`: the streamed restore feeds
//!   CRIU's pipe; raw chunks are spliced from their files). It keeps a bounded window of verified chunks
//!   ahead of the writer, and recycles their buffers.
//!
//! Materialize: writes a checkpoint's image files back into a folder, with parallel reads, verifying every
//! chunk's hash before its bytes are written. Nothing is handed back until every chunk has been checked:
//! on any error the files written so far are removed, so CRIU never sees a partial or unverified image.

mod chunks;
mod folder;
mod pipe;
mod pool;
mod reuse;
mod verify;

use std::sync::Mutex;

use serde::Serialize;

use super::manifest::CheckpointInfo;
use super::Inner;

pub use chunks::{ChunkReader, ChunkSink};
pub(in crate::store) use folder::{materialize, materialize_selected};
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

/// The worker plan of reading a checkpoint back (no compression level matters there): how many read
/// workers, and how many bytes of chunks the backend may hold fetched ahead of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ReadPlan {
    pub workers: usize,
    /// Bytes of announced, not yet taken chunks at most ([`Prefetcher`]); unbounded where read-ahead
    /// goes to the page cache.
    pub ahead_bytes: u64,
}

/// Chunks a backend that holds read-ahead in memory is asked to fetch ahead at most: tens of requests in
/// flight hide an object store's latency (`docs/store.md`).
pub(super) const MEMORY_AHEAD_CHUNKS: usize = 48;

pub(super) fn read_plan(inner: &Inner, info: &CheckpointInfo) -> ReadPlan {
    read_plan_beside(inner, info, 0)
}

/// A stored object (or its direct-I/O buffer) and its decoded bytes, plus a zstd context: what one reader
/// of checkpoint `info` holds at most.
fn per_reader(info: &CheckpointInfo) -> u64 {
    2 * info.chunking.max_size as u64 + 2 * crate::store::plan::MIB
}

/// [`read_plan`] with `others` readers of the caller's own (each [`per_reader`]) running beside the
/// workers within the same memory budget (the userfaultfd fill's urgent path).
pub(super) fn read_plan_beside(inner: &Inner, info: &CheckpointInfo, others: usize) -> ReadPlan {
    let max = info.chunking.max_size as u64;
    let per_worker = per_reader(info);
    let budget = (crate::store::plan::memory_budget(info.stats.logical_bytes)
        - crate::store::plan::RESERVE)
        .saturating_sub(others as u64 * per_worker)
        .max(per_worker);
    let threads = inner.read_threads();
    if !inner.reader().read_ahead_in_memory() {
        return ReadPlan {
            workers: threads.min((budget / per_worker) as usize).max(1),
            ahead_bytes: u64::MAX,
        };
    }
    // Fetched ahead, chunks wait for a worker in memory: a quarter of the budget for them (at the 64 MiB
    // floor 14 MiB, 6-7 chunks of random memory), the rest for the workers. A fetched chunk costs the
    // process about twice its bytes at its peak (the client's body buffers and the allocator's arenas
    // around them): half the budget (28 MiB) peaked at 79-87 MiB of RSS, a quarter at 60, as fast. Each
    // chunk's GET is announced early and runs while the workers verify and copy others, so a few
    // (CPU-bound) workers and requests in flight beat many workers each waiting on its own GET
    // (`docs/store.md`).
    let ahead_bytes = (budget / 4).max(max + crate::store::chunk::HEADER_LEN as u64);
    let workers = threads
        .min((budget.saturating_sub(ahead_bytes) / per_worker) as usize)
        .max(1);
    ReadPlan {
        workers,
        ahead_bytes,
    }
}

/// Bytes a chunk of raw length `len` may take fetched: at most its raw bytes and a header (a chunk stored
/// compressed is stored only where that saves bytes).
pub(super) fn fetched_len(len: u32) -> u64 {
    len as u64 + crate::store::chunk::HEADER_LEN as u64
}

/// How many chunks ahead of the workers the backend is asked to start reading ([`ReadObjects::prefetch_chunk`])
/// on paths that read through the page cache. Read on demand, a chunk file from a cold cache left the
/// disk idle while the workers decoded and copied, and the workers idle while it read: a default restore
/// of 4 GiB through the page cache took 1.84-2.19 s from a cold cache against 1.05 s from a warm one, and
/// 1.78-2.10 s with 16 chunks (about 32 MiB) read ahead. Direct reads (no read-ahead) are faster still.
///
/// [`ReadObjects::prefetch_chunk`]: crate::store::backend::ReadObjects::prefetch_chunk
pub(super) const PREFETCH_AHEAD: usize = 16;

/// Asks the backend to read chunks ahead of the workers, in task order, from a thread of its own: on a
/// cold cache even opening a chunk file waits for the disk (folder and inode), which must not hold up a
/// worker. At most `ahead` tasks and `ahead_bytes` bytes of announced chunks (each task's size given to
/// [`Prefetcher::run`]) are ahead of the workers at a time; a task's bytes count from its announcement
/// until a worker takes it (from then on they are the worker's buffers, in the read plan).
///
/// A task is announced before its worker reads it or not at all: a task a worker took already is skipped,
/// and a worker that takes the task being announced waits until the announcement is made. An announcement
/// after the read would fetch the chunk a second time and, on the S3 backend, stay unread (and count
/// against its read-ahead limit) for the rest of the handle's life.
pub(super) struct Prefetcher {
    ahead: usize,
    ahead_bytes: u64,
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
    /// Announced tasks not taken yet, in order, with their sizes.
    held: std::collections::VecDeque<(usize, u64)>,
    held_bytes: u64,
}

impl PrefetchState {
    fn release_taken(&mut self) {
        while let Some(&(i, n)) = self.held.front() {
            if i >= self.taken {
                break;
            }
            self.held.pop_front();
            self.held_bytes -= n;
        }
    }
}

impl Prefetcher {
    pub(super) fn new(ahead: usize, ahead_bytes: u64) -> Prefetcher {
        Prefetcher {
            ahead,
            ahead_bytes,
            state: Mutex::default(),
            cond: std::sync::Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PrefetchState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls `fetch(i)` for tasks `0..n` in order, never more than `ahead` tasks beyond those taken nor
    /// more than `ahead_bytes` of announced, untaken tasks (`size(i)` each; one task at least, however
    /// large), and never for a task a worker took already.
    pub(super) fn run(&self, n: usize, size: &dyn Fn(usize) -> u64, fetch: &dyn Fn(usize)) {
        for i in 0..n {
            let len = size(i);
            let mut st = self.lock();
            while !st.stop
                && i >= st.taken
                && (i >= st.taken + self.ahead
                    || (st.held_bytes > 0 && st.held_bytes + len > self.ahead_bytes))
            {
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
            st.held.push_back((i, len));
            st.held_bytes += len;
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
            st.release_taken();
            self.cond.notify_all();
        }
        while taken > 0 && st.announcing == Some(taken - 1) {
            st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Bytes of announced chunks no worker has taken yet.
    #[cfg(test)]
    pub(super) fn held_bytes(&self) -> u64 {
        self.lock().held_bytes
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
