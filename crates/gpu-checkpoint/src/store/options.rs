//! The options of a store handle: tuning, and who it trusts (owners, signing keys).

use std::sync::Arc;

use super::signing::{SigningKey, TrustedKeys};
use super::ChunkParams;

/// The environment variable that sets the store's worker threads where [`StoreOptions::threads`] is 0.
pub const THREADS_ENV: &str = "GPU_CHECKPOINT_THREADS";

/// Tuning of a store handle. Nothing here changes what is stored in a way that breaks reading.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// zstd level for new chunks. Default 1: on a real process's memory level 2 stored the same and took
    /// 25% more CPU, level 3 stored more and took 2.5x the CPU (measurements in `docs/store.md`).
    pub zstd_level: i32,
    /// Compress new chunks with zstd (`zstd_level`). Off, every chunk is stored raw: ingest and restore then
    /// cost little more than hashing and copying, for users who value checkpoint time over disk space.
    pub compress: bool,
    /// Worker threads for hashing, compression and parallel reads; 0 = `GPU_CHECKPOINT_THREADS` where set,
    /// else one per core this process may run on (and one more for an ingest into a store written with
    /// direct I/O, four more for reads with it: those workers also wait on the device).
    pub threads: usize,
    /// Content-defined chunking sizes for new checkpoints.
    pub chunking: ChunkParams,
    /// A local store owned by this user (besides the one running the tool and root) is accepted, for
    /// reading only (`--trust-store-owner`): see `docs/security.md`. Any other owner is refused.
    pub trusted_owner: Option<u32>,
    /// Sign every manifest this handle commits with this key (`checkpoint --sign-key`): a detached
    /// signature beside the manifest, see [`super::signing`].
    pub sign_key: Option<Arc<SigningKey>>,
    /// Trust only checkpoints whose manifest one of these keys signed (`--trust-key`): [`super::Store::get`]
    /// (what restore, verify and inspect read a checkpoint through) refuses any other (exit status 4).
    /// `None`: signatures are shown but not required.
    pub trusted_keys: Option<Arc<TrustedKeys>>,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            zstd_level: 1,
            compress: true,
            threads: 0,
            chunking: ChunkParams::default(),
            trusted_owner: None,
            sign_key: None,
            trusted_keys: None,
        }
    }
}

impl StoreOptions {
    /// The zstd level new chunks are compressed with, or `None` when compression is off.
    pub fn compression_level(&self) -> Option<i32> {
        self.compress.then_some(self.zstd_level)
    }

    pub(super) fn effective_threads(&self) -> usize {
        self.explicit_threads().unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        })
    }

    /// The thread count given (`threads`, else `GPU_CHECKPOINT_THREADS`): taken as it is, with no worker
    /// added for the device's waits. Benchmarks vary it to show how the pipelines scale with cores.
    pub(super) fn explicit_threads(&self) -> Option<usize> {
        if self.threads > 0 {
            return Some(self.threads);
        }
        std::env::var(THREADS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
    }
}
