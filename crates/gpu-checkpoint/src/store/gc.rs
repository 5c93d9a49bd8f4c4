//! Garbage collection: deletes chunks that no committed manifest references, and what dead writers left.
//!
//! A local store is safe against concurrent writers by locking: every ingest holds the store lock shared
//! from `begin` to commit or abort, and gc takes it exclusively, so gc runs only between writers. A writer
//! that decided "this chunk is already stored" therefore cannot have that chunk deleted before its manifest
//! is committed, and every staging folder gc sees belongs to a dead writer. (flock'ed locks vanish with
//! their process, so a killed writer never blocks gc forever.)
//!
//! Any other store (an object store has no lock) is kept safe by leases and a grace period: see
//! [`super::lease`]. Either way a damaged manifest stops gc: what it references is unknown, and deleting
//! would risk a checkpoint that could still be repaired.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use super::backend::{
    signature_of_key, Backend, LockMode, Objects, ReadBackend, ReadObjects, LEASES, MANIFESTS,
};
use super::chunk::ChunkId;
use super::error::{Error, Result};
use super::lease::{self, Lease, GC_MARKERS, GRACE, LEASE_TTL};
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
    /// Unreferenced chunks kept because they are younger than the grace period (object stores: a writer
    /// may have just written them).
    pub chunks_too_young: u64,
    /// Staging folders of crashed or killed ingests.
    pub stale_staging_removed: u64,
    pub stale_temp_removed: u64,
    pub stale_bytes_removed: u64,
    /// Leases of writers that died (object stores).
    pub stale_leases_removed: u64,
    /// Signatures whose manifest is gone (a writer killed between the two, or a delete cut short).
    pub orphan_signatures_removed: u64,
    /// Time spent waiting for in-flight checkpoints to finish.
    pub waited_ms: u64,
    pub elapsed_ms: u64,
}

pub(super) fn gc(inner: &Inner) -> Result<GcReport> {
    match inner.backend.local() {
        Some(local) => {
            let started = Instant::now();
            let _lock = local.lock(LockMode::Exclusive)?;
            let mut report = GcReport {
                waited_ms: started.elapsed().as_millis() as u64,
                ..GcReport::default()
            };
            let referenced = referenced(&*inner.backend, &mut report)?;
            // Only now, with every manifest readable: a refusal above deletes nothing, leftovers included.
            let stale = local.cleanup_stale()?;
            report.stale_staging_removed = stale.staging_dirs;
            report.stale_temp_removed = stale.temp_objects;
            report.stale_bytes_removed = stale.bytes;
            let unreferenced = unreferenced(&*inner.backend, &referenced, None, &mut report)?;
            delete(&*inner.backend, unreferenced, &mut report)?;
            orphan_signatures(&*inner.backend, None, &mut report)?;
            report.elapsed_ms = started.elapsed().as_millis() as u64;
            Ok(report)
        }
        None => gc_with_leases(inner, GRACE),
    }
}

/// Every chunk the committed manifests reference; a damaged manifest stops gc.
fn referenced(backend: &dyn ReadBackend, report: &mut GcReport) -> Result<HashSet<ChunkId>> {
    let mut referenced: HashSet<ChunkId> = HashSet::new();
    for id in backend.list_manifests()? {
        let Some(bytes) = backend.get_manifest(&id)? else {
            continue;
        };
        let info = manifest::decode(&bytes).map_err(|reason| Error::DamagedManifest {
            checkpoint: id.clone(),
            path: backend.describe(&super::backend::manifest_key(&id)).into(),
            reason: format!("{reason}; gc refuses to run until it is repaired or deleted"),
        })?;
        report.checkpoints += 1;
        for f in &info.files {
            referenced.extend(f.chunks.iter().filter_map(|c| c.id));
        }
    }
    Ok(referenced)
}

/// Stored chunks outside `referenced` (and, with `grace`, older than it), with their sizes.
fn unreferenced(
    backend: &dyn Backend,
    referenced: &HashSet<ChunkId>,
    grace: Option<Duration>,
    report: &mut GcReport,
) -> Result<Vec<(ChunkId, u64)>> {
    let now = SystemTime::now();
    let mut out = Vec::new();
    backend.list_chunk_objects(&mut |meta, id| {
        if referenced.contains(&id) {
            report.chunks_kept += 1;
            report.bytes_kept += meta.size;
            return;
        }
        let old_enough = grace.is_none_or(|g| {
            meta.modified
                .and_then(|m| now.duration_since(m).ok())
                .is_some_and(|age| age > g)
        });
        if old_enough {
            out.push((id, meta.size));
        } else {
            report.chunks_too_young += 1;
            report.chunks_kept += 1;
            report.bytes_kept += meta.size;
        }
    })?;
    Ok(out)
}

fn delete(backend: &dyn Backend, chunks: Vec<(ChunkId, u64)>, report: &mut GcReport) -> Result<()> {
    for (id, len) in chunks {
        backend.delete_chunk(&id)?;
        report.chunks_removed += 1;
        report.bytes_removed += len;
    }
    Ok(())
}

/// Removes signatures whose manifest does not exist (with `grace`, only those older than it: a writer
/// that began after gc's marker may sit between its signature and its manifest).
fn orphan_signatures(
    backend: &dyn Backend,
    grace: Option<Duration>,
    report: &mut GcReport,
) -> Result<()> {
    let now = SystemTime::now();
    let mut signatures = Vec::new();
    backend.list(MANIFESTS, &mut |m| {
        let old_enough = grace.is_none_or(|g| {
            m.modified
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age > g)
        });
        if let Some(id) = signature_of_key(&m.key).filter(|_| old_enough) {
            signatures.push(id.to_owned());
        }
    })?;
    for id in signatures {
        if backend.get_manifest(&id)?.is_none() {
            backend.delete_signature(&id)?;
            report.orphan_signatures_removed += 1;
        }
    }
    Ok(())
}

/// gc on a store without a lock: see [`super::lease`] for why it is safe against writers on other nodes.
/// Waits (up to a lease's life) for running writers to finish, as the local gc waits for the lock.
pub(super) fn gc_with_leases(inner: &Inner, grace: Duration) -> Result<GcReport> {
    let started = Instant::now();
    let backend = &*inner.backend;
    let gc_id = format!(
        "{}-{:08x}",
        super::time::id_stamp(SystemTime::now()),
        super::random_u32()
    );
    let mut report = GcReport::default();
    loop {
        let waited = Instant::now();
        wait_for_writers(backend, started)?;
        report.waited_ms += waited.elapsed().as_millis() as u64;
        // The marker goes up before the second look at the leases: a writer that is not seen there began
        // after the marker and sees it before it commits (see `lease`). Never held while waiting for
        // writers, who wait for it at their commit.
        let marker = Lease::take(
            inner.backend.clone(),
            format!("{GC_MARKERS}{gc_id}.json"),
            "gc",
            &gc_id,
        )?;
        let (writers, stale) = lease::live(backend, LEASES)?;
        if !writers.is_empty() {
            drop(marker);
            continue;
        }
        for s in stale {
            if backend.delete(&s.key)? {
                report.stale_leases_removed += 1;
            }
        }
        let mut scan = GcReport {
            waited_ms: report.waited_ms,
            stale_leases_removed: report.stale_leases_removed,
            ..GcReport::default()
        };
        let referenced = referenced(backend, &mut scan)?;
        let unreferenced = unreferenced(backend, &referenced, Some(grace), &mut scan)?;
        delete(backend, unreferenced, &mut scan)?;
        orphan_signatures(backend, Some(grace), &mut scan)?;
        report = scan;
        drop(marker);
        break;
    }
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}

/// Waits until no live writer lease is left; gives up after a lease's life.
fn wait_for_writers(backend: &dyn Backend, started: Instant) -> Result<()> {
    loop {
        let (writers, _) = lease::live(backend, LEASES)?;
        let Some(w) = writers.first() else {
            return Ok(());
        };
        if started.elapsed() > LEASE_TTL {
            return Err(Error::Conflict(format!(
                "gc waited {} s for checkpoints being written to finish ({} still are, such as {}); \
                 nothing was deleted",
                started.elapsed().as_secs(),
                writers.len(),
                backend.describe(&w.key)
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
