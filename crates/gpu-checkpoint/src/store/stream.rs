//! Ingest of image files that arrive as streams (CRIU's image streamer, `dump::streamer`) instead of files
//! in the staging folder: CRIU's pages are cut, hashed, compressed and written while CRIU produces them,
//! so they are written once, into the store.
//!
//! ```text
//! a thread per page image (two from 4 threads on)   workers (N threads, the caller's)
//! pages-*.img: read the pipe into pooled segments   zero check -> BLAKE3 -> stored?
//!   || FastCDC on the segment read before  -------->   no: zstd -> write-once put
//! small images: read whole, then cut  ------------>   record ChunkRef
//! very large other images: spilled to the staging folder, stored by `commit` like any staged file
//! ```
//! CRIU writes several images at once (a task's pagemap and pages go out interleaved), so every image
//! must be drained as it comes: no stream may wait for another. Pooled segments are what bound memory, and
//! a stream blocked on its pipe holds up to two of them (the one it cuts or its unfinished tail, and the
//! one it fills: `store::pipelined`);
//! only as many streams read into the pool as leave one segment free for the others, the rest are read
//! into memory whole (they are small: CRIU's metadata images) or spilled to disk.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crossbeam_channel::{Receiver, Sender};

use super::chunk::ChunkId;
use super::chunker::{is_page_image, ChunkParams, Chunker, Hints, Piece, SegmentPool};
use super::error::{Error, Result};
use super::ingest::Ingest;
use super::piece::{coder, store_piece, Collected, Streamed};
use super::pipelined::chunk_pipelined;
use super::plan::Plan;
use super::read::ReadAhead;
use super::Progress;

/// Images other than pages are read into memory up to this size; beyond it they go to the staging folder.
const IN_MEMORY_MAX: usize = 8 << 20;

/// A streaming session of one [`Ingest`]. Feed it with [`Streams::add`] from one thread per image, run
/// [`Streams::work`] on [`Streams::workers`] threads, then [`Streams::close`] and [`Streams::finish`].
pub struct Streams<'a> {
    ingest: &'a Ingest,
    params: ChunkParams,
    level: Option<i32>,
    plan: Plan,
    pool: SegmentPool,
    /// How many more streams may read into the pool at the same time.
    pool_slots: Mutex<usize>,
    hints: HashMap<String, Hints>,
    tx: Mutex<Option<Sender<(usize, Piece)>>>,
    rx: Receiver<(usize, Piece)>,
    files: Mutex<Vec<StreamFile>>,
    collected: Mutex<Collected>,
    seen: Mutex<HashSet<ChunkId>>,
    failed: AtomicBool,
    started: std::time::Instant,
    /// Read and cut each pooled image on two threads ([`chunk_pipelined`]), see [`OVERLAP_MIN_THREADS`].
    overlap: bool,
}

/// The store threads from which a pooled image is read and cut on two threads rather than one. Below
/// that, CRIU, the workers and the stream's thread already keep every core busy, and the extra thread only
/// takes turns with them: on 2 cores, 2 GiB streamed took 1.13-1.20x as long in 3 of 4 alternated runs
/// (`docs/criu.md`, "What bounds the checkpoint's ingest"). `GPU_CHECKPOINT_THREADS` sets it.
const OVERLAP_MIN_THREADS: usize = 4;

struct StreamFile {
    name: String,
    size: u64,
    state: FileState,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FileState {
    Receiving,
    Done,
    /// Written to the staging folder instead; `commit` stores it from there.
    Spilled,
    /// Sent again later in the same checkpoint: the later copy counts.
    Replaced,
}

/// How many segments a copying session's pool may grow by: enough for `expected` bytes and the chunker's
/// tails (each segment starts with the previous one's unfinished chunk, at most an eighth of a large
/// segment), within half the memory the kernel says is available (`available`, from `/proc/meminfo`), so
/// that the copy never pushes the host into swapping or reclaim. None when that leaves no more than the
/// plan's own pool: the session then reads at the workers' pace, as any other.
fn copy_spare(expected: u64, available: Option<u64>, plan: &Plan) -> usize {
    let seg = plan.segment_size as u64;
    let want = expected + expected / 4;
    let bytes = want.min(available.unwrap_or(0) / 2);
    let own = plan.segments as u64 * seg;
    if bytes <= own {
        return 0;
    }
    ((bytes - own) / seg) as usize
}

/// `MemAvailable` of `/proc/meminfo`, in bytes: what can be allocated without swapping.
fn mem_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl Ingest {
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
}

impl<'a> Streams<'a> {
    /// A session sized for about `expected_bytes` of images (it only sets the memory budget; more or fewer
    /// bytes are fine).
    ///
    /// `copy`: the images are the pages of a tree that is held stopped until every one has been read
    /// (a leave-running dump): the pool may then grow by about `expected_bytes` (see [`copy_spare`]), so
    /// that the pipes are copied into memory at the pace of the reads rather than of the workers, which
    /// finish while the tree runs again.
    pub(super) fn new(ingest: &'a Ingest, expected_bytes: u64, copy: bool) -> Streams<'a> {
        let opts = &ingest.inner().opts;
        let params = opts.chunking;
        let plan = Plan::within(
            expected_bytes,
            ingest.inner().backend.memory_in_flight(),
            ingest.inner().ingest_threads(),
            params,
            opts.zstd_level,
        );
        let spare = if copy {
            copy_spare(expected_bytes, mem_available(), &plan)
        } else {
            0
        };
        tracing::debug!(
            ?plan,
            spare,
            expected_bytes,
            "streaming ingest {}",
            ingest.id()
        );
        let (tx, rx) = crossbeam_channel::unbounded();
        Streams {
            ingest,
            params,
            level: opts.compression_level(),
            plan,
            pool: SegmentPool::growing(plan.segments, spare, plan.segment_size),
            pool_slots: Mutex::new((plan.segments + spare - 1) / 2),
            hints: ingest.parent_hints(),
            tx: Mutex::new(Some(tx)),
            rx,
            files: Mutex::default(),
            collected: Mutex::default(),
            seen: Mutex::default(),
            failed: AtomicBool::new(false),
            started: std::time::Instant::now(),
            overlap: opts.effective_threads() >= OVERLAP_MIN_THREADS,
        }
    }

    /// How many threads should run [`Streams::work`].
    pub fn workers(&self) -> usize {
        self.plan.workers
    }

    /// Records the session's first failure (what [`Streams::finish`] returns, with its kind intact: a full
    /// disk must still say so) and returns its message for the stream that ran into it.
    fn fail(&self, e: Error) -> Error {
        let msg = Error::SessionFailed {
            first: e.to_string(),
        };
        let mut c = self.collected.lock().unwrap_or_else(|p| p.into_inner());
        c.error.get_or_insert(e);
        // Raised only once the error is recorded: a stream that sees the flag and gives up reports an error
        // derived from this one, which must not get in first.
        self.failed.store(true, Ordering::SeqCst);
        msg
    }

    /// Stores one image read from `reader` until its end. Returns an error (and makes every other stream
    /// of the session fail too) when the store cannot take it; the caller then drops `reader`, which is
    /// what tells CRIU to give up.
    pub fn add(&self, name: &str, reader: impl Read) -> Result<()> {
        self.add_as(name, reader, name.starts_with("pages-"))
    }

    /// [`Streams::add`] for a large image that is not one of CRIU's page images (runsc's
    /// `checkpoint.img`): cut into the pool as it comes, like pages, rather than spilled to the staging
    /// folder and stored again at commit.
    pub fn add_bulk(&self, name: &str, reader: impl Read) -> Result<()> {
        self.add_as(name, reader, true)
    }

    fn add_as(&self, name: &str, mut reader: impl Read, bulk: bool) -> Result<()> {
        let index = {
            let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
            // An image written twice is like a file rewritten: the later one counts (what a staged dump
            // would have left in the folder).
            for f in files.iter_mut().filter(|f| f.name == name) {
                f.state = FileState::Replaced;
            }
            files.push(StreamFile {
                name: name.to_string(),
                size: 0,
                state: FileState::Receiving,
            });
            self.collected
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .chunks
                .push(Vec::new());
            files.len() - 1
        };
        let tx = self
            .tx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| Error::Internal("image stream after the session closed".into()))?;
        let send = &mut |piece: Piece| {
            !self.failed.load(Ordering::Relaxed) && tx.send((index, piece)).is_ok()
        };
        let hints = self.hints.get(name);
        let result = if bulk && self.take_pool_slot() {
            let r = self.add_pooled(name, &mut reader, hints, send);
            *self.pool_slots.lock().unwrap_or_else(|p| p.into_inner()) += 1;
            r.map(|size| (size, FileState::Done))
        } else {
            self.add_in_memory(name, &mut reader, hints, send)
        };
        let (size, state) = result.map_err(|e| self.fail(e))?;
        if self.failed.load(Ordering::SeqCst) {
            return Err(self.session_error());
        }
        let mut files = self.files.lock().unwrap_or_else(|p| p.into_inner());
        files[index].size = size;
        if files[index].state != FileState::Replaced {
            files[index].state = state;
        }
        Ok(())
    }

    fn session_error(&self) -> Error {
        match &self
            .collected
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .error
        {
            Some(e) => Error::SessionFailed {
                first: e.to_string(),
            },
            None => Error::SessionFailed {
                first: "the streaming ingest failed".into(),
            },
        }
    }

    fn take_pool_slot(&self) -> bool {
        let mut slots = self.pool_slots.lock().unwrap_or_else(|p| p.into_inner());
        if *slots == 0 {
            return false;
        }
        *slots -= 1;
        true
    }

    fn add_pooled(
        &self,
        name: &str,
        reader: &mut dyn Read,
        hints: Option<&Hints>,
        send: &mut (dyn FnMut(Piece) -> bool + Send),
    ) -> Result<u64> {
        let io = |source| Error::Receive {
            name: name.to_string(),
            source,
        };
        let pages = is_page_image(name);
        let stop = || self.failed.load(Ordering::Relaxed);
        let bytes = if self.overlap {
            let chunker = Chunker::new(std::io::empty(), self.params, &self.pool, hints)
                .map_err(io)?
                .page_aligned(pages);
            chunk_pipelined(chunker, reader, &self.pool, &stop, send).map_err(io)?
        } else {
            let mut chunker = Chunker::new(reader, self.params, &self.pool, hints)
                .map_err(io)?
                .page_aligned(pages);
            while !chunker.is_done() && !stop() {
                chunker.step(self.pool.get(), send).map_err(io)?;
            }
            chunker.bytes()
        };
        if stop() {
            return Err(self.session_error());
        }
        Ok(bytes)
    }

    fn add_in_memory(
        &self,
        name: &str,
        reader: &mut dyn Read,
        hints: Option<&Hints>,
        send: &mut dyn FnMut(Piece) -> bool,
    ) -> Result<(u64, FileState)> {
        let io = |source| Error::Receive {
            name: name.to_string(),
            source,
        };
        let mut data = Vec::new();
        reader
            .take(IN_MEMORY_MAX as u64 + 1)
            .read_to_end(&mut data)
            .map_err(io)?;
        if data.len() <= IN_MEMORY_MAX {
            let size = Chunker::<std::io::Empty>::cut_owned(
                data,
                self.params,
                hints,
                is_page_image(name),
                send,
            );
            return Ok((size, FileState::Done));
        }
        // A large image that is not a page image (a tmpfs archive, a ghost file): onto the disk with it,
        // rather than into memory.
        let path = self.ingest.staging_dir().join(name);
        let mut file = crate::util::create_private_file(&path)
            .map_err(Error::io("cannot create image file", &path))?;
        file.write_all(&data)
            .map_err(Error::io("cannot write image file", &path))?;
        let rest = std::io::copy(reader, &mut file).map_err(io)?;
        Ok((data.len() as u64 + rest, FileState::Spilled))
    }

    /// Runs one worker until the session is closed and every queued chunk is stored.
    pub fn work(&self, progress: &dyn Progress) {
        let backend = &*self.ingest.inner().backend;
        let index = self.ingest.inner().index.get(backend);
        let mut coder = match coder(self.level, self.params.max_size as usize) {
            Ok(c) => Some(c),
            Err(e) => {
                self.fail(Error::Zstd {
                    op: "cannot create zstd context",
                    source: e,
                });
                None
            }
        };
        // The chunks this worker checks before reusing them are read while it hashes (see `ReadAhead`).
        std::thread::scope(|s| {
            let mut ahead = ReadAhead::spawn(s, backend);
            for (file, piece) in self.rx.iter() {
                let Some((enc, dec)) = coder.as_mut() else {
                    continue;
                };
                if self.failed.load(Ordering::Relaxed) {
                    continue; // drop it: returns its segment, so the streams can see the failure
                }
                let name = self.files.lock().unwrap_or_else(|p| p.into_inner())[file]
                    .name
                    .clone();
                let hints = self.hints.get(&name);
                match store_piece(
                    backend,
                    index.as_deref(),
                    (enc, dec, &mut ahead),
                    &self.seen,
                    &piece,
                    hints,
                ) {
                    Ok((cref, outcome)) => {
                        let len = piece.data().len() as u64;
                        let index = piece.index;
                        drop(piece);
                        self.collected
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .record(file, index, cref, outcome, len);
                        progress.advance(len);
                    }
                    Err(e) => {
                        self.fail(e);
                    }
                }
            }
        });
    }

    /// No more images will come: the workers stop once the queue is empty.
    pub fn close(&self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// The images stored, once the workers have stopped. Fails when any stream or worker failed.
    pub fn finish(self) -> Result<Streamed> {
        self.close();
        let mut collected = self
            .collected
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(e) = collected.error.take() {
            return Err(e);
        }
        let files = self.files.into_inner().unwrap_or_else(|p| p.into_inner());
        let mut out = Streamed::default();
        for (f, chunks) in files.into_iter().zip(std::mem::take(&mut collected.chunks)) {
            match f.state {
                FileState::Done => {
                    out.files.push((f.name, f.size));
                    collected.chunks.push(chunks);
                }
                FileState::Spilled | FileState::Replaced => {}
                FileState::Receiving => {
                    return Err(Error::ImageIncomplete {
                        name: f.name.clone(),
                    })
                }
            }
        }
        out.collected = collected;
        out.started = Some(self.started);
        out.hints = Some(self.hints);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copying session buffers the expected bytes (and the chunker's tails) in memory when half of what
    /// is available holds them, no more than that half otherwise, and nothing extra when that half is no
    /// more than the plan's own pool.
    #[test]
    fn a_copying_session_grows_within_half_the_available_memory() {
        let plan = Plan {
            workers: 2,
            segments: 6,
            segment_size: 32 << 20,
            per_worker: 18 << 20,
        };
        let gib = 1u64 << 30;
        let spare = copy_spare(gib, Some(16 * gib), &plan);
        assert_eq!(spare as u64 * (32 << 20), gib + gib / 4 - 6 * (32 << 20));
        let short = copy_spare(gib, Some(gib), &plan);
        assert_eq!(short as u64 * (32 << 20), gib / 2 - 6 * (32 << 20));
        assert_eq!(copy_spare(gib, Some(300 << 20), &plan), 0);
        assert_eq!(copy_spare(gib, None, &plan), 0);
        assert_eq!(copy_spare(100 << 20, Some(16 * gib), &plan), 0);
        assert!(mem_available().is_some_and(|b| b > 0));
    }
}
