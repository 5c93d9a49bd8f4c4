//! Verify: re-reads and checks manifests and every chunk they reference. Each distinct chunk is read and
//! hashed once, however many checkpoints share it; every problem is reported against every checkpoint, file
//! and chunk index that references the damaged chunk.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

use super::backend::ReadObjects;
use super::chunk::{ChunkId, Decoder};
use super::error::{Error, Result};
use super::manifest::CheckpointInfo;
use super::plan::Plan;
use super::signing::Signature;
use super::{Inner, Progress};

/// One thing `verify` found wrong.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct VerifyProblem {
    pub checkpoint: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// Index of the chunk in the file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunk: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    pub problem: String,
}

impl std::fmt::Display for VerifyProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "checkpoint {}", self.checkpoint)?;
        if let Some(file) = &self.file {
            write!(f, ": file {file}")?;
        }
        if let (Some(i), Some(c)) = (self.index, &self.chunk) {
            write!(f, ": chunk #{i} {c}")?;
        }
        if let Some(o) = self.offset {
            write!(f, " (offset {o})")?;
        }
        write!(f, ": {}", self.problem)
    }
}

/// What `verify` checked and found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct VerifyReport {
    /// Checkpoints whose manifests were checked.
    pub checkpoints: Vec<String>,
    /// Distinct chunks read and hashed.
    pub chunks_checked: u64,
    /// Raw bytes those chunks hold.
    pub bytes_checked: u64,
    /// Stored bytes read.
    pub stored_bytes_read: u64,
    pub problems: Vec<VerifyProblem>,
    /// Each checkpoint's signature (`store::signing`): one that does not match its manifest is a problem,
    /// and so, with trusted keys, is one no trusted key made.
    pub signatures: BTreeMap<String, Signature>,
    /// Store paths whose permissions were not private (folders 0700, files 0600), now put back: a
    /// warning, not a problem (the content is intact).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub permissions_restored: Vec<String>,
    pub elapsed_ms: u64,
}

impl VerifyReport {
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty()
    }

    /// `Err(VerifyFailed)` (exit status 7) if there were problems.
    pub fn into_result(self) -> Result<VerifyReport> {
        match self.problems.first() {
            None => Ok(self),
            Some(p) => Err(Error::VerifyFailed {
                count: self.problems.len(),
                first: p.to_string(),
            }),
        }
    }
}

impl VerifyProblem {
    /// A problem of a checkpoint as a whole (its manifest, its signature).
    fn of_checkpoint(id: &str, problem: String) -> VerifyProblem {
        VerifyProblem {
            checkpoint: id.to_owned(),
            file: None,
            index: None,
            chunk: None,
            offset: None,
            problem,
        }
    }
}

/// Records checkpoint `id`'s signature; returns what is wrong with it, if anything.
fn check_signature(
    inner: &Inner,
    id: &str,
    signatures: &mut BTreeMap<String, Signature>,
) -> Result<Option<String>> {
    let Some(bytes) = inner.reader().get_manifest(id)? else {
        return Ok(Some("its manifest was removed during verify".into()));
    };
    let sig = inner.reader().get_signature(id)?;
    let status = Signature::of(&bytes, sig.as_deref());
    let problem = match (&inner.opts.trusted_keys, &status) {
        (Some(keys), _) => keys.check(&bytes, sig.as_deref()).err(),
        (None, Signature::Bad { reason }) => Some(reason.clone()),
        (None, _) => None,
    };
    signatures.insert(id.to_owned(), status);
    Ok(problem.map(|p| format!("untrusted: {p}")))
}

/// A reference to a chunk: checkpoint index, file index, chunk index, offset, raw length.
type Ref = (usize, usize, usize, u64, u32);

pub(super) fn verify(
    inner: &Inner,
    checkpoints: Vec<std::result::Result<CheckpointInfo, (String, String)>>,
    progress: &dyn Progress,
) -> Result<VerifyReport> {
    let started = Instant::now();
    let mut report = VerifyReport::default();
    let mut infos = Vec::new();
    for c in checkpoints {
        match c {
            Ok(info) => {
                report.checkpoints.push(info.id.clone());
                if let Some(problem) = check_signature(inner, &info.id, &mut report.signatures)? {
                    report
                        .problems
                        .push(VerifyProblem::of_checkpoint(&info.id, problem));
                }
                infos.push(info);
            }
            Err((id, problem)) => {
                report.checkpoints.push(id.clone());
                report
                    .problems
                    .push(VerifyProblem::of_checkpoint(&id, problem));
            }
        }
    }
    let mut refs: HashMap<ChunkId, Vec<Ref>> = HashMap::new();
    for (k, info) in infos.iter().enumerate() {
        for (fi, ci, off, c) in info.chunk_refs() {
            if let Some(id) = c.id {
                refs.entry(id).or_default().push((k, fi, ci, off, c.len));
            }
        }
    }
    let mut chunks: Vec<(ChunkId, Vec<Ref>)> = refs.into_iter().collect();
    // Sorted by name: the local backend's fan-out folders are then read in order.
    chunks.sort_by_key(|c| c.0);
    let total: u64 = chunks.iter().map(|(_, r)| r[0].4 as u64).sum();
    let max_chunk = infos
        .iter()
        .map(|i| i.chunking.max_size as usize)
        .max()
        .unwrap_or(0);
    let plan = Plan::new(
        total,
        inner.opts.effective_threads(),
        inner.opts.chunking,
        1,
    );
    let next = AtomicUsize::new(0);
    let problems: Mutex<Vec<VerifyProblem>> = Mutex::default();
    let sums = Mutex::new((0u64, 0u64, 0u64));
    progress.start("verify", total);
    std::thread::scope(|s| {
        for _ in 0..plan.workers.min(chunks.len()).max(1) {
            s.spawn(|| {
                let mut dec = Decoder::new(max_chunk).ok();
                let mut buf = Vec::with_capacity(
                    max_chunk + super::chunk::HEADER_LEN + super::chunk::TRAILER_LEN,
                );
                let (mut n, mut raw_bytes, mut stored) = (0u64, 0u64, 0u64);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((id, rs)) = chunks.get(i) else { break };
                    let outcome = match (inner.reader().read_chunk(id, &mut buf), dec.as_mut()) {
                        (Err(e), _) => Err(e.to_string()),
                        (Ok(false), _) => Err("missing".to_string()),
                        (Ok(true), None) => Err("cannot create a zstd context".to_string()),
                        (Ok(true), Some(dec)) => dec.verify(id, &buf),
                    };
                    let mut found = Vec::new();
                    match outcome {
                        Ok(len) => {
                            n += 1;
                            raw_bytes += len as u64;
                            stored += buf.len() as u64;
                            for &(k, fi, ci, off, want) in rs {
                                if len != want as usize {
                                    found.push(problem(
                                        &infos[k],
                                        fi,
                                        ci,
                                        off,
                                        id,
                                        format!("damaged ({len} bytes, the manifest says {want})"),
                                    ));
                                }
                            }
                        }
                        Err(p) => {
                            for &(k, fi, ci, off, _) in rs {
                                found.push(problem(&infos[k], fi, ci, off, id, p.clone()));
                            }
                        }
                    }
                    if !found.is_empty() {
                        problems
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .extend(found);
                    }
                    progress.advance(rs[0].4 as u64);
                }
                let mut t = sums.lock().unwrap_or_else(|p| p.into_inner());
                t.0 += n;
                t.1 += raw_bytes;
                t.2 += stored;
            });
        }
    });
    progress.finish();
    let (n, raw_bytes, stored) = sums.into_inner().unwrap_or_else(|p| p.into_inner());
    report.chunks_checked = n;
    report.bytes_checked = raw_bytes;
    report.stored_bytes_read = stored;
    let mut found = problems.into_inner().unwrap_or_else(|p| p.into_inner());
    found.sort_by(|a, b| (&a.checkpoint, &a.file, a.index).cmp(&(&b.checkpoint, &b.file, b.index)));
    report.problems.extend(found);
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    Ok(report)
}

fn problem(
    info: &CheckpointInfo,
    fi: usize,
    ci: usize,
    off: u64,
    id: &ChunkId,
    p: String,
) -> VerifyProblem {
    VerifyProblem {
        checkpoint: info.id.clone(),
        file: Some(info.files[fi].path.clone()),
        index: Some(ci),
        chunk: Some(id.to_hex()),
        offset: Some(off),
        problem: p,
    }
}
