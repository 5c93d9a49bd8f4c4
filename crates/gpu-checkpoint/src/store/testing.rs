//! What the store's tests share (the unit tests, and the integration tests through the `test-support`
//! feature): never in a build of the tool.

use super::{ChunkParams, StoreOptions};

impl StoreOptions {
    /// Small chunks, so that test-sized files have many of them and debug builds stay quick (tests only).
    pub fn small_chunks() -> StoreOptions {
        StoreOptions {
            zstd_level: 1,
            compress: true,
            threads: 2,
            chunking: ChunkParams {
                min_size: 4096,
                avg_size: 16384,
                max_size: 65536,
            },
            ..StoreOptions::default()
        }
    }
}
