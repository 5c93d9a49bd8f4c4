//! The read workers of the any-order sinks: tasks handed out in order as workers come free, each worker
//! with its own decoder and buffers, the first error stopping all.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use super::verify::Scratch;
use super::{fetched_len, read_plan_beside, Prefetcher, MEMORY_AHEAD_CHUNKS, PREFETCH_AHEAD};
use crate::store::backend::ReadObjects;
use crate::store::chunk::{ChunkId, Decoder};
use crate::store::error::{Error, Result};
use crate::store::manifest::CheckpointInfo;
use crate::store::Inner;
use crate::util::AlignedBuf;

/// Runs `work(task, scratch)` for every task on the read workers (each with its own decoder and buffers),
/// tasks taken in order as workers come free. Stops at the first error, which it returns.
///
/// Where the backend reads cold chunks with direct I/O, the workers wait on the device themselves and four
/// more of them than cores keep it busy ([`read_plan`]); otherwise the chunk `chunk_of(task)` names (id and raw length) is read ahead
/// into the page cache [`PREFETCH_AHEAD`] tasks early, or, where the backend holds what it reads ahead in
/// memory, as many as the read plan's `ahead_bytes` allow.
pub(super) fn on_workers<T: Sync>(
    inner: &Inner,
    info: &CheckpointInfo,
    tasks: &[T],
    chunk_of: impl Fn(&T) -> (Option<ChunkId>, u32) + Sync,
    work: impl Fn(&T, &mut Scratch) -> Result<()> + Sync,
) -> Result<()> {
    on_workers_beside(inner, info, 0, tasks, chunk_of, work)
}

/// [`on_workers`] with `others` readers of the caller's own running beside them, within the same memory
/// budget ([`read_plan_beside`]).
pub(super) fn on_workers_beside<T: Sync>(
    inner: &Inner,
    info: &CheckpointInfo,
    others: usize,
    tasks: &[T],
    chunk_of: impl Fn(&T) -> (Option<ChunkId>, u32) + Sync,
    work: impl Fn(&T, &mut Scratch) -> Result<()> + Sync,
) -> Result<()> {
    let plan = read_plan_beside(inner, info, others);
    let workers = plan.workers;
    let max_chunk = info.chunking.max_size as usize;
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let error: Mutex<Option<Error>> = Mutex::new(None);
    let fail = |e: Error| {
        failed.store(true, Ordering::SeqCst);
        error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };
    let ahead = if inner.reader().read_ahead_in_memory() {
        Prefetcher::new(MEMORY_AHEAD_CHUNKS, plan.ahead_bytes)
    } else {
        Prefetcher::new(PREFETCH_AHEAD, plan.ahead_bytes)
    };
    std::thread::scope(|s| {
        if !inner.reader().reads_uncached() {
            s.spawn(|| {
                let size = |i: usize| match chunk_of(&tasks[i]) {
                    (Some(_), len) => fetched_len(len),
                    (None, _) => 0,
                };
                ahead.run(tasks.len(), &size, &|i| {
                    if let (Some(id), _) = chunk_of(&tasks[i]) {
                        inner.reader().prefetch_chunk(&id);
                    }
                })
            });
        }
        let workers: Vec<_> = (0..workers.min(tasks.len()).max(1))
            .map(|_| {
                s.spawn(|| {
                    let dec = match Decoder::new(max_chunk) {
                        Ok(d) => d,
                        Err(e) => {
                            return fail(Error::Zstd {
                                op: "zstd",
                                source: e,
                            })
                        }
                    };
                    let mut scratch = Scratch {
                        dec,
                        buf: Vec::with_capacity(max_chunk + crate::store::chunk::HEADER_LEN),
                        direct: AlignedBuf::new(),
                    };
                    while !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(task) = tasks.get(i) else {
                            break;
                        };
                        ahead.taken(i + 1);
                        if let Err(e) = work(task, &mut scratch) {
                            fail(e);
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            if let Err(panic) = w.join() {
                ahead.stop();
                std::panic::resume_unwind(panic);
            }
        }
        ahead.stop();
    });
    match error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
