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

use super::backend::{Objects, ReadObjects};
use super::chunk::ChunkId;
use super::chunker::{is_page_image, ChunkParams, Chunker, Hints, Piece, SegBuf, SegmentPool};
use super::error::{Error, Result};
use super::lease::WriterGuard;
use super::manifest::{self, CheckpointInfo, ChunkRef, Chunking, FileEntry, IngestStats};
use super::piece::{coder, store_piece, Collected, Streamed};
use super::plan::Plan;
use super::read::ReadAhead;
use super::{Inner, Progress};

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
        // The signature goes first: the manifest commits the checkpoint, and a crash between the two leaves
        // an orphan signature that gc removes.
        if let Some(key) = &self.inner.opts.sign_key {
            self.inner
                .backend
                .put_signature(&self.id, &key.sign_manifest(&bytes))?;
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
