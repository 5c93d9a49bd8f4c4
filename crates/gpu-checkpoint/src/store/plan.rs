//! How much memory a checkpoint's store work may take, and how many workers and buffers that makes
//! ([`Plan`]): shared by the ingest, the streaming ingest and the reads.

use super::chunker::ChunkParams;

pub(super) const MIB: u64 = 1024 * 1024;

/// Memory the tool may use for a checkpoint of `total` bytes: max(64 MiB, 1% of it).
pub fn memory_budget(total: u64) -> u64 {
    (64 * MIB).max(total / 100)
}

/// Part of the budget kept for everything but the pipeline: the binary, its heap, the manifest.
pub(super) const RESERVE: u64 = 8 * MIB;

/// How many workers and buffers an ingest or materialize uses, derived from the memory budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    pub workers: usize,
    pub segments: usize,
    pub segment_size: usize,
    /// Bytes of buffers and state one worker holds.
    pub per_worker: u64,
}

impl Plan {
    /// Segments hold 3 maximum chunks (8 when the budget is large: less of each segment's unfinished tail
    /// is copied to the next), at least 3 of them (one being read, two being worked on); each worker needs a
    /// compression buffer and a decompression buffer (checking reused chunks) of one maximum chunk each,
    /// plus their zstd contexts. Workers are cut back before the budget (less a reserve for the rest of the
    /// tool) is exceeded.
    pub fn new(total: u64, threads: usize, params: ChunkParams, zstd_level: i32) -> Plan {
        Self::within(total, 0, threads, params, zstd_level)
    }

    /// [`Plan::new`] with `taken` bytes of the budget held elsewhere (a backend's requests in flight).
    pub fn within(
        total: u64,
        taken: u64,
        threads: usize,
        params: ChunkParams,
        zstd_level: i32,
    ) -> Plan {
        let budget = (memory_budget(total) - RESERVE).saturating_sub(taken);
        let max = params.max_size as u64;
        let segment_size = if budget >= 128 * MIB {
            8 * max
        } else {
            3 * max
        };
        let per_worker = Self::per_worker(params, zstd_level);
        let threads = threads.max(1) as u64;
        let workers = threads.min((budget.saturating_sub(3 * segment_size) / per_worker).max(1));
        let left = budget.saturating_sub(workers * per_worker);
        let segments = (left / segment_size).clamp(3, 2 + 2 * workers);
        Plan {
            workers: workers as usize,
            segments: segments as usize,
            segment_size: segment_size as usize,
            per_worker,
        }
    }

    /// Upper bound of the pipeline's buffers and compression state, in bytes.
    pub fn memory(&self) -> u64 {
        self.segments as u64 * self.segment_size as u64 + self.workers as u64 * self.per_worker
    }

    /// One worker's compression buffer, the decoder's buffer for checking reused chunks, and their zstd
    /// contexts. The context sizes are upper estimates for inputs of at most 4 MiB (zstd shrinks its tables
    /// to the input); measured with windows of 4 MiB (zstd 1.5.7): the compressor 0.57 MiB at level 1,
    /// 0.76 MiB at 2, 1.3 MiB at 3; the decompressor 0.1 MiB.
    fn per_worker(params: ChunkParams, zstd_level: i32) -> u64 {
        let ctx = match zstd_level {
            ..=2 => 2 * MIB,
            3..=5 => 6 * MIB,
            6..=12 => 16 * MIB,
            _ => 64 * MIB,
        };
        2 * params.max_size as u64 + ctx
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_stays_within_the_memory_budget() {
        let params = ChunkParams::default();
        for total in [0, 1 << 20, 1 << 30, 4 << 30, 100 << 30, 2 << 40] {
            for threads in [1, 2, 8, 64, 512] {
                for level in [1, 3, 9, 19] {
                    let p = Plan::new(total, threads, params, level);
                    let budget = memory_budget(total);
                    assert!(p.workers >= 1 && p.workers <= threads);
                    assert!(p.segments >= 3);
                    assert!(
                        p.memory() + RESERVE <= budget || (p.workers == 1 && p.segments == 3),
                        "{p:?} uses {} of {budget} for {total} bytes",
                        p.memory()
                    );
                }
            }
        }
        // Small checkpoints: 64 MiB, with room for the rest of the tool, and still two workers.
        let small = Plan::new(1 << 30, 2, params, 2);
        assert!(small.memory() + RESERVE <= 64 << 20, "{small:?}");
        assert_eq!(small.workers, 2);
        // A 100 GiB checkpoint may use 1 GiB and gets every core.
        assert_eq!(Plan::new(100 << 30, 64, params, 2).workers, 64);
    }
}
