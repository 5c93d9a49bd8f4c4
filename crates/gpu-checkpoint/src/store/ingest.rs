//! Ingest: turns a staging folder of image files into chunks and a committed manifest.
//!
//! ```text
//! reader (this thread)          workers (N threads)                       after all chunks
//! walk files -> read segments   zero check -> BLAKE3 -> already stored?   sync new chunks (durable)
//!   -> FastCDC cut points  -->   no: zstd -> write-once put               -> manifest (atomic, durable)
//!      (bounded channel)         record ChunkRef                          -> remove staging
//! ```
//! Memory is bounded by the segment pool plus one compression buffer per worker (see [`Plan`]).

use std::collections::{HashMap, HashSet};
use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::backend::Objects;
use super::chunk::{is_zero, ChunkId, Decoder, Encoder};
use super::chunker::{
    is_page_image, ChunkParams, Chunker, Hints, Known, Piece, SegBuf, SegmentPool,
};
use super::error::{Error, Result};
use super::index::ChunkIndex;
use super::lease::WriterGuard;
use super::manifest::{self, CheckpointInfo, ChunkRef, Chunking, FileEntry, IngestStats};
use super::read::{ReadAhead, Reused};
use super::stream::{Streamed, Streams};
use super::{Inner, Progress};

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

/// An ingest in progress: a new checkpoint id and a private staging folder. Commit it, or abort it; dropping
/// it uncommitted removes the staging folder too.
pub struct Ingest {
    inner: Arc<Inner>,
    id: String,
    name: Option<String>,
    created: String,
    staging: PathBuf,
    done: bool,
    /// Keeps gc off this ingest's chunks until its manifest is put.
    guard: WriterGuard,
}

struct FileToIngest {
    rel: String,
    abs: PathBuf,
    size: u64,
    mode: u32,
}

/// What the workers found, collected under one mutex (a few thousand updates per GiB: no contention).
#[derive(Default)]
pub(super) struct Collected {
    pub(super) chunks: Vec<Vec<Option<ChunkRef>>>,
    /// Stored size of every distinct non-zero chunk.
    pub(super) stored: HashMap<ChunkId, (u64, u32)>,
    pub(super) new: Vec<ChunkId>,
    pub(super) new_bytes: u64,
    pub(super) zero_bytes: u64,
    pub(super) error: Option<Error>,
}

impl Collected {
    pub(super) fn record(
        &mut self,
        file: usize,
        index: usize,
        cref: ChunkRef,
        outcome: Outcome,
        len: u64,
    ) {
        let slots = &mut self.chunks[file];
        if slots.len() <= index {
            slots.resize(index + 1, None);
        }
        slots[index] = Some(cref);
        match outcome {
            Outcome::Zero => self.zero_bytes += len,
            Outcome::Duplicate => {}
            Outcome::Present(stored) => {
                self.stored
                    .insert(cref.id.expect("non-zero"), (stored, cref.len));
            }
            Outcome::New(stored) => {
                let id = cref.id.expect("non-zero");
                self.stored.insert(id, (stored, cref.len));
                self.new.push(id);
                self.new_bytes += stored;
            }
        }
    }
}

/// The reading side of the pipeline: which file is being cut, and the queue its chunks go to. Behind a
/// mutex; whichever worker holds it advances it by one segment.
struct Reader<'a> {
    files: &'a [FileToIngest],
    pool: &'a SegmentPool,
    hints: &'a HashMap<String, Hints>,
    params: ChunkParams,
    next: usize,
    current: Option<(usize, Chunker<'a, File>)>,
    /// Dropped when every file has been read (or on failure): the workers then drain the queue and stop.
    tx: Option<crossbeam_channel::Sender<(usize, Piece)>>,
}

impl Reader<'_> {
    /// Reads one segment's worth of the current file (opening the next one if needed) into `buf`.
    fn step(&mut self, buf: SegBuf) -> Result<()> {
        if self.current.is_none() {
            let Some(f) = self.files.get(self.next) else {
                self.tx = None;
                return Ok(());
            };
            let file = File::open(&f.abs).map_err(Error::io("cannot open image file", &f.abs))?;
            // SAFETY: advisory hint on a valid fd: read ahead more aggressively.
            unsafe {
                libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL);
            }
            let chunker = Chunker::new(file, self.params, self.pool, self.hints.get(&f.rel))
                .map_err(Error::io("cannot read image file", &f.abs))?
                .page_aligned(is_page_image(&f.rel));
            self.current = Some((self.next, chunker));
            self.next += 1;
        }
        let (i, chunker) = self.current.as_mut().expect("set above");
        let i = *i;
        let f = &self.files[i];
        let tx = self.tx.as_ref().expect("only called while reading");
        chunker
            .step(buf, &mut |piece| tx.send((i, piece)).is_ok())
            .map_err(Error::io("cannot read image file", &f.abs))?;
        if chunker.is_done() {
            if chunker.bytes() != f.size {
                // The file changed under us (CRIU still writing?): refuse to store a torn image.
                return Err(Error::ImageChanged {
                    path: f.abs.clone(),
                    before: f.size,
                    after: chunker.bytes(),
                });
            }
            self.current = None;
            if self.next == self.files.len() {
                self.tx = None;
            }
        }
        Ok(())
    }
}

impl Ingest {
    pub(super) fn new(
        inner: Arc<Inner>,
        id: String,
        name: Option<String>,
        created: String,
        staging: PathBuf,
        guard: WriterGuard,
    ) -> Ingest {
        Ingest {
            inner,
            id,
            name,
            created,
            staging,
            done: false,
            guard,
        }
    }

    pub(super) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Starts receiving images as streams (CRIU's image streamer) for about `expected_bytes`; see
    /// [`Streams`]. Its result goes to [`Ingest::commit_streamed`].
    pub fn streams(&self, expected_bytes: u64) -> Streams<'_> {
        Streams::new(self, expected_bytes, false)
    }

    /// [`Ingest::streams`] for images that must be copied out of their pipes as fast as they come: the
    /// pages of a tree held stopped until they are all read (a leave-running dump; CRIU's pipes hold the
    /// tree's own pages). The session may buffer up to about `expected_bytes` in memory, within what the
    /// host has available, so the tree's pause does not wait for the workers.
    pub fn streams_copying(&self, expected_bytes: u64) -> Streams<'_> {
        Streams::new(self, expected_bytes, true)
    }

    /// The checkpoint id this ingest will commit under.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The private folder (0700) where CRIU writes its images.
    pub fn staging_dir(&self) -> &Path {
        &self.staging
    }

    /// Stores every file of the staging folder, makes every chunk durable, commits the manifest, then removes
    /// the staging folder. On error nothing is committed (chunks already written stay, unreferenced, until
    /// `gc`), and the staging folder is removed.
    pub fn commit(
        self,
        metadata: serde_json::Value,
        progress: &dyn Progress,
    ) -> Result<CheckpointInfo> {
        self.commit_streamed(Streamed::default(), metadata, progress)
    }

    /// [`Ingest::commit`] for a checkpoint whose images came (partly) as streams: stores what the staging
    /// folder holds besides them, then commits one manifest listing both. `streamed` must come from this
    /// ingest's [`Ingest::streams`].
    pub fn commit_streamed(
        mut self,
        mut streamed: Streamed,
        metadata: serde_json::Value,
        progress: &dyn Progress,
    ) -> Result<CheckpointInfo> {
        // A streamed checkpoint's store work began with its first image, during CRIU's dump.
        let started = streamed.started.unwrap_or_else(Instant::now);
        let mut files = collect_files(&self.staging)?;
        let streamed_names: HashSet<&str> = streamed.names().collect();
        if let Some(f) = files
            .iter()
            .find(|f| streamed_names.contains(f.rel.as_str()))
        {
            return Err(Error::ImageTwice {
                name: f.rel.clone(),
            });
        }
        let total: u64 = files.iter().map(|f| f.size).sum();
        let params = self.inner.opts.chunking;
        let plan = Plan::within(
            total,
            self.inner.backend.memory_in_flight(),
            self.inner.ingest_threads(),
            params,
            self.inner.opts.zstd_level,
        );
        tracing::debug!(?plan, total, "ingest {}", self.id);

        let hints = match streamed.hints.take() {
            Some(h) => h,
            None => self.parent_hints(),
        };

        progress.start("store", total);
        let collected = self.run_pipeline(&files, &hints, plan, progress);
        progress.finish();
        let mut collected = collected?;
        // The streamed images join the staged ones; a chunk both wrote is stored once (the second found it
        // present), so the maps merge and the new ones add up.
        let total = total + streamed.bytes();
        let Streamed {
            files: streamed_files,
            collected: s,
            started: _,
            hints: _,
        } = streamed;
        for (name, size) in streamed_files {
            files.push(FileToIngest {
                abs: self.staging.join(&name),
                rel: name,
                size,
                mode: crate::util::FILE_MODE,
            });
        }
        collected.chunks.extend(s.chunks);
        collected.stored.extend(s.stored);
        collected.new.extend(s.new);
        collected.new_bytes += s.new_bytes;
        collected.zero_bytes += s.zero_bytes;

        let sync_started = Instant::now();
        self.inner.backend.sync_chunks(&collected.new)?;
        let sync_ms = sync_started.elapsed().as_millis() as u64;

        let mut entries = Vec::with_capacity(files.len());
        for (f, chunks) in files.iter().zip(std::mem::take(&mut collected.chunks)) {
            let chunks: Vec<ChunkRef> = chunks
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| Error::Internal(format!("a chunk of {} was lost", f.rel)))?;
            entries.push(FileEntry {
                path: f.rel.clone(),
                mode: f.mode,
                size: f.size,
                chunks,
            });
        }
        entries.sort_by(|a, b| a.path.cmp(&b.path));
        let unique_bytes: u64 = collected.stored.values().map(|v| v.1 as u64).sum();
        let stored_bytes: u64 = collected.stored.values().map(|v| v.0).sum();
        let nchunks: u64 = entries.iter().map(|e| e.chunks.len() as u64).sum();
        let mut stats = IngestStats {
            logical_bytes: total,
            zero_bytes: collected.zero_bytes,
            unique_bytes,
            stored_bytes,
            new_bytes: collected.new_bytes,
            manifest_bytes: 0,
            files: entries.len() as u64,
            chunks: nchunks,
            unique_chunks: collected.stored.len() as u64,
            new_chunks: collected.new.len() as u64,
            dedup_ratio: ratio(total - collected.zero_bytes, unique_bytes),
            compression_ratio: ratio(unique_bytes, stored_bytes),
            reduction_ratio: ratio(total, stored_bytes),
            ingest_ms: 0,
            sync_ms,
        };
        let mut info = CheckpointInfo {
            format: manifest::MANIFEST_FORMAT_NAME.into(),
            version: manifest::MANIFEST_FORMAT_VERSION,
            id: self.id.clone(),
            name: self.name.clone(),
            created: self.created.clone(),
            chunking: Chunking {
                algorithm: "fastcdc-v2020".into(),
                min_size: params.min_size,
                avg_size: params.avg_size,
                max_size: params.max_size,
                hash: "blake3".into(),
                compression: if self.inner.opts.compress {
                    "zstd"
                } else {
                    "none"
                }
                .into(),
                level: self.inner.opts.compression_level().unwrap_or(0),
            },
            stats: IngestStats::default(),
            metadata,
            files: entries,
        };
        stats.ingest_ms = started.elapsed().as_millis() as u64;
        info.stats = stats.clone();
        // The manifest's own size goes into the stats it contains: encode once to learn it, then for real.
        stats.manifest_bytes = manifest::encode(&info).len() as u64;
        info.stats = stats;
        let bytes = manifest::encode(&info);
        if let WriterGuard::Lease(lease) = &self.guard {
            // No lock kept gc away (an object store): make sure it took none of the chunks reused.
            let new: HashSet<&ChunkId> = collected.new.iter().collect();
            let reused: Vec<ChunkId> = collected
                .stored
                .keys()
                .filter(|id| !new.contains(id))
                .copied()
                .collect();
            lease.before_commit(&reused)?;
        }
        // Every chunk named by the manifest is durable (sync above): now the checkpoint may exist.
        self.inner.backend.put_manifest(&self.id, &bytes)?;
        self.done = true;
        if let Err(e) = fs::remove_dir_all(&self.staging) {
            tracing::warn!(
                "checkpoint {} committed, but its staging folder {} could not be removed: {e}",
                self.id,
                self.staging.display()
            );
        }
        Ok(info)
    }

    /// Gives up: removes the staging folder. The store stays as it was (chunks already written are
    /// unreferenced and go at the next `gc`).
    pub fn abort(mut self) -> Result<()> {
        self.done = true;
        match fs::remove_dir_all(&self.staging) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("cannot remove staging folder", &self.staging)(e)),
        }
    }

    /// Chunk boundaries of the checkpoint this one most likely repeats: the newest with the same name (or
    /// the newest of all for an unnamed one), if it was chunked with the same sizes. Only a speed-up: a
    /// wrong guess costs one hash per chunk at most and changes nothing stored.
    pub(super) fn parent_hints(&self) -> HashMap<String, Hints> {
        let backend = &*self.inner.backend;
        let Ok(mut ids) = backend.list_manifests() else {
            return HashMap::new();
        };
        // Ids start with their UTC time: sorting them sorts by age.
        ids.sort_unstable_by(|a, b| b.cmp(a));
        let params = self.inner.opts.chunking;
        for id in ids.iter().take(32) {
            let Ok(Some(bytes)) = backend.get_manifest(id) else {
                continue;
            };
            let Ok(info) = manifest::decode(&bytes) else {
                continue;
            };
            if self.name.is_some() && info.name != self.name {
                continue;
            }
            let c = &info.chunking;
            if (c.min_size, c.avg_size, c.max_size)
                != (params.min_size, params.avg_size, params.max_size)
            {
                return HashMap::new();
            }
            tracing::debug!("checkpoint {}: chunk hints from {}", self.id, info.id);
            return info
                .files
                .iter()
                .map(|f| (f.path.clone(), Hints::new(&f.chunks)))
                .collect();
        }
        HashMap::new()
    }

    fn run_pipeline(
        &self,
        files: &[FileToIngest],
        hints: &HashMap<String, Hints>,
        plan: Plan,
        progress: &dyn Progress,
    ) -> Result<Collected> {
        let params = self.inner.opts.chunking;
        let level = self.inner.opts.compression_level();
        let backend = &*self.inner.backend;
        let index = self.inner.index.get(backend);
        let index = index.as_deref();
        let pool = SegmentPool::new(plan.segments, plan.segment_size);
        let collected = Mutex::new(Collected {
            chunks: files.iter().map(|_| Vec::new()).collect(),
            ..Collected::default()
        });
        let seen: Mutex<HashSet<ChunkId>> = Mutex::default();
        let failed = AtomicBool::new(false);
        let fail = |e: Error| {
            failed.store(true, Ordering::SeqCst);
            let mut c = collected.lock().unwrap_or_else(|p| p.into_inner());
            c.error.get_or_insert(e);
        };
        // The queue itself is unbounded: what bounds it (and memory) is the segment pool, since every
        // queued piece holds its segment.
        let (tx, rx) = crossbeam_channel::unbounded::<(usize, Piece)>();
        let reader = Mutex::new(Reader {
            files,
            pool: &pool,
            hints,
            params,
            next: 0,
            current: None,
            tx: Some(tx),
        });

        // No thread is tied to a stage: each one advances the reader when the queue runs low and nobody else
        // is reading, and otherwise stores queued chunks. On a busy machine every slice of CPU time a thread
        // gets does useful work, instead of a stage thread waiting for another that is not scheduled.
        std::thread::scope(|s| {
            for _ in 0..plan.workers {
                let rx = rx.clone();
                let (collected, seen, failed, fail, reader, pool) =
                    (&collected, &seen, &failed, &fail, &reader, &pool);
                s.spawn(move || {
                    let mut ahead = ReadAhead::spawn(s, backend);
                    let mut coder = match coder(level, params.max_size as usize) {
                        Ok(c) => Some(c),
                        Err(e) => {
                            fail(Error::Zstd {
                                op: "cannot create zstd context",
                                source: e,
                            });
                            None
                        }
                    };
                    let low_water = 2 * plan.workers;
                    loop {
                        if failed.load(Ordering::Relaxed) {
                            // Stop reading; drop what is queued (returns the segments) and leave.
                            if let Ok(mut r) = reader.lock() {
                                r.tx = None;
                            }
                            while rx.try_recv().is_ok() {}
                            break;
                        }
                        if rx.len() < low_water {
                            if let Ok(mut r) = reader.try_lock() {
                                if r.tx.is_some() {
                                    if let Some(buf) = pool.try_get() {
                                        if let Err(e) = r.step(buf) {
                                            r.tx = None;
                                            fail(e);
                                        }
                                        continue;
                                    }
                                }
                            }
                        }
                        let job = match rx.recv_timeout(std::time::Duration::from_millis(2)) {
                            Ok(job) => job,
                            Err(crossbeam_channel::RecvTimeoutError::Timeout) => continue,
                            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
                        };
                        let (file, piece) = job;
                        let Some((enc, dec)) = coder.as_mut() else {
                            continue;
                        };
                        let file_hints = hints.get(&files[file].rel);
                        let coder = (enc, dec, &mut ahead);
                        match store_piece(backend, index, coder, seen, &piece, file_hints) {
                            Ok((cref, outcome)) => {
                                let len = piece.data().len() as u64;
                                let index = piece.index;
                                drop(piece);
                                collected
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .record(file, index, cref, outcome, len);
                                progress.advance(len);
                            }
                            Err(e) => fail(e),
                        }
                    }
                });
            }
            drop(rx);
        });
        let mut c = collected.into_inner().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = c.error.take() {
            return Err(e);
        }
        Ok(c)
    }
}

impl Drop for Ingest {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = fs::remove_dir_all(&self.staging) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!(
                        "cannot remove staging folder {}: {e}",
                        self.staging.display()
                    );
                }
            }
        }
    }
}

pub(super) enum Outcome {
    Zero,
    /// Another chunk of this same ingest had the same content.
    Duplicate,
    /// Already in the store (an earlier checkpoint); stored size.
    Present(u64),
    /// Written by this ingest; stored size.
    New(u64),
}

pub(super) fn store_piece(
    backend: &dyn super::backend::Backend,
    index: Option<&ChunkIndex>,
    (enc, dec, ahead): (&mut Encoder, &mut Decoder, &mut ReadAhead),
    seen: &Mutex<HashSet<ChunkId>>,
    piece: &Piece,
    hints: Option<&Hints>,
) -> Result<(ChunkRef, Outcome)> {
    let data = piece.data();
    let len = data.len() as u32;
    if let Known::Expect(old) = piece.known {
        // Most likely the old chunk again, to be checked before it is reused: read it while hashing.
        if !seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&old)
        {
            ahead.start(old, data.len(), enc);
        }
    }
    let id = match piece.known {
        Known::Id(id) => id,
        Known::Zero => return Ok((ChunkRef { id: None, len }, Outcome::Zero)),
        Known::Nothing if is_zero(data) => return Ok((ChunkRef { id: None, len }, Outcome::Zero)),
        Known::Nothing => ChunkId::of(data),
        Known::Expect(old) => {
            let id = ChunkId::of(data);
            if id != old {
                if let Some(h) = hints {
                    h.mismatch.store(true, Ordering::Relaxed);
                }
            }
            id
        }
    };
    let cref = ChunkRef { id: Some(id), len };
    let first = seen.lock().unwrap_or_else(|p| p.into_inner()).insert(id);
    if !first {
        ahead.settle(enc);
        return Ok((cref, Outcome::Duplicate));
    }
    // Not in the index of stored chunks (object stores): certainly new, no request to find that out.
    let reused = match index {
        Some(i) if !i.may_hold(&id) => {
            ahead.settle(enc);
            Reused::Missing
        }
        _ => ahead.check(backend, &id, data, enc, dec),
    };
    match reused {
        Reused::Good(stored) => return Ok((cref, Outcome::Present(stored))),
        Reused::Missing => {}
        // Written again below, under a temporary name renamed over the damaged one, and made durable with
        // the new chunks before the manifest: the checkpoint never references what it could not restore.
        Reused::Damaged(problem) => tracing::warn!(
            "chunk {id} in the store is {problem}; writing it again from the checkpoint's bytes"
        ),
    }
    let header = if backend.aligned_objects() {
        let (header, object) = enc.encode_parts(&id, data);
        backend.put_chunk_parts(&id, &object)?;
        header
    } else {
        let (header, payload) = enc.encode(&id, data);
        backend.put_chunk(&id, &header.encode(), payload)?;
        header
    };
    if let Some(i) = index {
        i.add(id);
    }
    Ok((cref, Outcome::New(header.stored_len())))
}

/// A worker's encoder, and its decoder for checking the chunks it reuses ([`ReadAhead::check`]). The decoder's
/// buffer grows only when a compressed chunk is checked; [`Plan`] counts it anyway.
pub(super) fn coder(level: Option<i32>, max_chunk: usize) -> std::io::Result<(Encoder, Decoder)> {
    Ok((Encoder::new(level, max_chunk)?, Decoder::new(0)?))
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        1.0
    } else {
        ((a as f64 / b as f64) * 1000.0).round() / 1000.0
    }
}

/// Every regular file under `root`, sorted by relative path. Anything else (symlinks, devices) is refused:
/// the store would silently lose it.
fn collect_files(root: &Path) -> Result<Vec<FileToIngest>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in fs::read_dir(&dir).map_err(Error::io("cannot list staging folder", &dir))? {
            let entry = entry.map_err(Error::io("cannot list staging folder", &dir))?;
            let path = entry.path();
            let meta = fs::symlink_metadata(&path).map_err(Error::io("cannot stat", &path))?;
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                let rel = path
                    .strip_prefix(root)
                    .expect("under root")
                    .to_str()
                    .ok_or_else(|| Error::Unstorable {
                        path: path.clone(),
                        reason: "image file name is not UTF-8",
                    })?
                    .to_owned();
                out.push(FileToIngest {
                    rel,
                    abs: path,
                    size: meta.len(),
                    mode: meta.permissions().mode() & 0o7777,
                });
            } else {
                return Err(Error::Unstorable {
                    path,
                    reason: "the staging folder holds it, and it is not a regular file or folder; the store keeps only those",
                });
            }
        }
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
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
