//! Writers and gc on a store without flock (object stores): leases that expire, and a gc that deletes only
//! what no writer can be about to reference. Nothing here needs a conditional write (several
//! S3-compatible servers ignore `If-None-Match`): only read-after-write consistency of put, list and delete.
//!
//! The protocol (`docs/store.md`, "Object storage"):
//! - A writer puts `leases/ID.json` before it looks at any chunk, renews it every [`RENEW_EVERY`] while
//!   it runs, and deletes it after its manifest is put. Before putting the manifest it waits until no gc is
//!   running (no live `gc/` marker), then checks that every chunk it reused is still stored; a writer whose
//!   lease could not be renewed in time commits nothing.
//! - gc waits until no live lease is left, puts its own `gc/` marker (renewed like a lease), looks at the
//!   leases again (one there: it takes its marker down and waits again), reads every manifest, lists the
//!   chunks, deletes those that no manifest references and that are older than [`GRACE`] (longer than any
//!   lease), then removes its marker.
//!
//! Why that is enough: take a writer W and a deletion d of a chunk W reused. If gc put its marker before
//! W's marker check, W sees it, waits for gc to end, and its reuse check (after d) finds the chunk gone.
//! If gc put its marker after W's marker check, W's lease was put before gc's second look at the leases:
//! either it is still there (gc deletes nothing) or W had already put its manifest, before gc read the
//! manifests, which then reference the chunk. The grace period covers what the protocol does not: a writer
//! that was stopped longer than its lease and has not yet noticed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::backend::{Backend, ObjectMeta, ReadBackend, ReadObjects, LEASES};
use super::chunk::ChunkId;
use super::error::{Error, Result};

/// How long a lease (or a gc marker) counts as live after its last renewal.
pub const LEASE_TTL: Duration = Duration::from_secs(10 * 60);
/// How often a writer renews its lease.
pub const RENEW_EVERY: Duration = Duration::from_secs(60);
/// How far the clocks of the storage and of a client may disagree.
pub const CLOCK_SKEW: Duration = Duration::from_secs(5 * 60);
/// gc deletes no chunk younger than this: longer than any lease, with the clock skew on both sides.
pub const GRACE: Duration = Duration::from_secs(LEASE_TTL.as_secs() + 2 * CLOCK_SKEW.as_secs());
/// Prefix of running gcs' markers.
pub const GC_MARKERS: &str = "gc/";

/// Whether a lease or marker last written at `modified` (by the storage's clock) may still be live.
pub(super) fn is_live(meta: &ObjectMeta) -> bool {
    match meta.modified {
        Some(m) => {
            SystemTime::now()
                .duration_since(m)
                .is_ok_and(|age| age < LEASE_TTL + CLOCK_SKEW)
                || m > SystemTime::now()
        }
        None => true,
    }
}

/// Live objects under `prefix`, and the stale ones.
pub(super) fn live(
    backend: &dyn ReadBackend,
    prefix: &str,
) -> Result<(Vec<ObjectMeta>, Vec<ObjectMeta>)> {
    let mut all = Vec::new();
    backend.list(prefix, &mut |m| all.push(m))?;
    Ok(all.into_iter().partition(is_live))
}

fn lease_body(what: &str, id: &str) -> Vec<u8> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    serde_json::to_vec_pretty(&serde_json::json!({
        "format": "gpu-checkpoint-lease",
        "version": 1,
        "what": what,
        "id": id,
        "host": host.trim(),
        "pid": std::process::id(),
        "ttl_s": LEASE_TTL.as_secs(),
    }))
    .expect("serialisable")
}

struct Renewal {
    stop: Mutex<bool>,
    cond: Condvar,
    /// Set when the lease could not be renewed before it would expire.
    lost: AtomicBool,
}

/// An object announcing a writer (or a gc), renewed in the background, deleted on drop.
pub struct Lease {
    backend: Arc<dyn Backend>,
    key: String,
    renewal: Arc<Renewal>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Lease {
    /// Puts lease `key` (`what`: "ingest" or "gc", `id`: whose) and starts renewing it.
    pub(super) fn take(
        backend: Arc<dyn Backend>,
        key: String,
        what: &str,
        id: &str,
    ) -> Result<Lease> {
        let body = lease_body(what, id);
        backend.put(&key, &[&body], true)?;
        let renewal = Arc::new(Renewal {
            stop: Mutex::new(false),
            cond: Condvar::new(),
            lost: AtomicBool::new(false),
        });
        let thread = {
            let (backend, key, renewal) = (backend.clone(), key.clone(), renewal.clone());
            std::thread::Builder::new()
                .name("lease".into())
                .spawn(move || {
                    let mut renewed = Instant::now();
                    let mut stop = renewal.stop.lock().unwrap_or_else(|p| p.into_inner());
                    loop {
                        // A lease dropped before this thread first took the lock has said so already:
                        // waiting for a notification would wait a whole renewal period.
                        if *stop {
                            return;
                        }
                        let (s, _) = renewal
                            .cond
                            .wait_timeout(stop, RENEW_EVERY)
                            .unwrap_or_else(|p| p.into_inner());
                        stop = s;
                        if *stop {
                            return;
                        }
                        match backend.put(&key, &[&body], true) {
                            Ok(()) => renewed = Instant::now(),
                            Err(e) => tracing::warn!("cannot renew lease {key}: {e}"),
                        }
                        if renewed.elapsed() + RENEW_EVERY >= LEASE_TTL {
                            renewal.lost.store(true, Ordering::SeqCst);
                        }
                    }
                })
                .map_err(|e| Error::Internal(format!("cannot start the lease thread: {e}")))?
        };
        Ok(Lease {
            backend,
            key,
            renewal,
            thread: Some(thread),
        })
    }

    /// A writer's lease for checkpoint `id`.
    pub(super) fn for_ingest(backend: Arc<dyn Backend>, id: &str) -> Result<Lease> {
        Lease::take(backend, format!("{LEASES}{id}.json"), "ingest", id)
    }

    /// What a writer does before it puts its manifest: waits for running gcs to end, then checks that
    /// every chunk it reused is still stored. A chunk gone (a gc deleted it while this writer ran) fails
    /// the checkpoint, which can be retried: nothing is listed, the process was not touched by the store.
    pub(super) fn before_commit(&self, reused: &[ChunkId]) -> Result<()> {
        if self.renewal.lost.load(Ordering::SeqCst) {
            return Err(Error::Conflict(format!(
                "the writer's lease {} could not be renewed in time; gc may have run meanwhile, so the \
                 checkpoint is not committed (retry it)",
                self.backend.describe(&self.key)
            )));
        }
        let started = Instant::now();
        loop {
            let (running, _) = live(&*self.backend, GC_MARKERS)?;
            if running.is_empty() {
                break;
            }
            if started.elapsed() > LEASE_TTL {
                return Err(Error::Conflict(format!(
                    "a gc is still running on {} ({}); the checkpoint is not committed (retry it)",
                    self.backend.location(),
                    running[0].key
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let missing = missing_chunks(&*self.backend, reused)?;
        if let Some(id) = missing.first() {
            return Err(Error::Conflict(format!(
                "{} chunk(s) this checkpoint reused were deleted while it was written (a concurrent gc), \
                 first {id}; the checkpoint is not committed (retry it)",
                missing.len()
            )));
        }
        Ok(())
    }
}

/// Which of `ids` are not stored: one `head` each for a few, one listing for many (a listing returns a
/// thousand keys per request).
fn missing_chunks(backend: &dyn ReadBackend, ids: &[ChunkId]) -> Result<Vec<ChunkId>> {
    if ids.len() <= 32 {
        let mut missing = Vec::new();
        for id in ids {
            if backend.head(&super::backend::chunk_key(id))?.is_none() {
                missing.push(*id);
            }
        }
        return Ok(missing);
    }
    let mut stored = std::collections::HashSet::new();
    backend.list_chunks(&mut |id, _| {
        stored.insert(id);
    })?;
    Ok(ids
        .iter()
        .filter(|id| !stored.contains(id))
        .copied()
        .collect())
}

impl Drop for Lease {
    fn drop(&mut self) {
        *self.renewal.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.renewal.cond.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Err(e) = self.backend.delete(&self.key) {
            tracing::warn!(
                "cannot remove lease {}: {e} (it expires by itself)",
                self.key
            );
        }
    }
}

/// What keeps a writer's chunks safe from gc until its manifest is put: the store lock (a local store), or
/// a lease (any other).
pub(super) enum WriterGuard {
    Lock(#[allow(dead_code)] super::backend::LockGuard),
    Lease(Lease),
}
