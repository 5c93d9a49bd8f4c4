//! Garbage collection: deletes chunks that no committed manifest references, and what dead writers left.
//!
//! Safe against concurrent writers by locking: every ingest holds the store lock shared from `begin` to
//! commit or abort, and gc takes it exclusively, so gc runs only between writers. A writer that decided
//! "this chunk is already stored" therefore cannot have that chunk deleted before its manifest is committed,
//! and every staging folder gc sees belongs to a dead writer. (flock'ed locks vanish with their process, so a
//! killed writer never blocks gc forever.) A damaged manifest stops gc: what it references is unknown, and
//! deleting would risk a checkpoint that could still be repaired.

use std::collections::HashSet;
use std::time::Instant;

use serde::Serialize;

use super::backend::LockMode;
use super::chunk::ChunkId;
use super::error::{Error, Result};
use super::manifest;
use super::Inner;

/// What `gc` did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GcReport {
    pub checkpoints: u64,
    pub chunks_kept: u64,
    pub bytes_kept: u64,
    pub chunks_removed: u64,
    pub bytes_removed: u64,
    /// Staging folders of crashed or killed ingests.
    pub stale_staging_removed: u64,
    pub stale_temp_removed: u64,
    pub stale_bytes_removed: u64,
    /// Time spent waiting for in-flight checkpoints to finish.
    pub waited_ms: u64,
    pub elapsed_ms: u64,
}

pub(super) fn gc(inner: &Inner) -> Result<GcReport> {
    let started = Instant::now();
    let backend = &*inner.backend;
    let _lock = backend.lock(LockMode::Exclusive)?;
    let mut report = GcReport {
        waited_ms: started.elapsed().as_millis() as u64,
        ..GcReport::default()
    };
    let mut referenced: HashSet<ChunkId> = HashSet::new();
    for id in backend.list_manifests()? {
        let Some(bytes) = backend.get_manifest(&id)? else {
            continue;
        };
        let info = manifest::decode(&bytes).map_err(|reason| Error::DamagedManifest {
            checkpoint: id.clone(),
            path: backend.manifest_path(&id),
            reason: format!("{reason}; gc refuses to run until it is repaired or deleted"),
        })?;
        report.checkpoints += 1;
        for f in &info.files {
            referenced.extend(f.chunks.iter().filter_map(|c| c.id));
        }
    }
    // Only now, with every manifest readable: a refusal above deletes nothing, leftovers included.
    let stale = backend.cleanup_stale()?;
    report.stale_staging_removed = stale.staging_dirs;
    report.stale_temp_removed = stale.temp_objects;
    report.stale_bytes_removed = stale.bytes;

    let mut unreferenced = Vec::new();
    backend.list_chunks(&mut |id, len| {
        if referenced.contains(&id) {
            report.chunks_kept += 1;
            report.bytes_kept += len;
        } else {
            unreferenced.push((id, len));
        }
    })?;
    for (id, len) in unreferenced {
        backend.delete_chunk(&id)?;
        report.chunks_removed += 1;
        report.bytes_removed += len;
    }
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}
