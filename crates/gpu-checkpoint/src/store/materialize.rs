//! Materialize: writes a checkpoint's image files back into a folder, with parallel reads, verifying every
//! chunk's hash before its bytes are written. Nothing is handed back until every chunk has been checked:
//! on any error the files written so far are removed, so CRIU never sees a partial or unverified image.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use serde::Serialize;

use super::chunk::{ChunkId, Decoder};
use super::error::{Error, Result};
use super::ingest::Plan;
use super::manifest::{CheckpointInfo, ChunkRef};
use super::{Inner, Progress};
use crate::util::{create_private_dir_all, create_private_file, AlignedBuf};

/// What [`Store::materialize`](super::Store::materialize) did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MaterializeStats {
    pub files: u64,
    /// Bytes of image files written (zero chunks included, as holes).
    pub logical_bytes: u64,
    /// Bytes read from the store.
    pub stored_bytes_read: u64,
    pub chunks_read: u64,
    pub zero_bytes: u64,
    pub elapsed_ms: u64,
}

/// The worker plan of reading a checkpoint back (no compression level matters there).
fn read_workers(inner: &Inner, info: &CheckpointInfo) -> usize {
    let max = info.chunking.max_size as u64;
    // A stored object (or its direct-I/O buffer) and its decoded bytes, plus a zstd context.
    let per_worker = 2 * max + 2 * super::ingest::MIB;
    let budget = super::ingest::memory_budget(info.stats.logical_bytes) - super::ingest::RESERVE;
    inner
        .read_threads()
        .min((budget / per_worker) as usize)
        .max(1)
}

/// How many chunks ahead of the workers the backend is asked to start reading ([`Backend::prefetch_chunk`])
/// on paths that read through the page cache. Read on demand, a chunk file from a cold cache left the
/// disk idle while the workers decoded and copied, and the workers idle while it read: a default restore
/// of 4 GiB through the page cache took 1.84-2.19 s from a cold cache against 1.05 s from a warm one, and
/// 1.78-2.10 s with 16 chunks (about 32 MiB) read ahead. Direct reads (no read-ahead) are faster still.
///
/// [`Backend::prefetch_chunk`]: super::backend::Backend::prefetch_chunk
const PREFETCH_AHEAD: usize = 16;

/// Asks the backend to read chunks ahead of the workers, in task order, from a thread of its own: on a
/// cold cache even opening a chunk file waits for the disk (folder and inode), which must not hold up a
/// worker.
struct Prefetcher {
    ahead: usize,
    /// Tasks the workers have taken so far, and whether to stop.
    state: Mutex<(usize, bool)>,
    cond: std::sync::Condvar,
}

impl Prefetcher {
    fn new(ahead: usize) -> Prefetcher {
        Prefetcher {
            ahead,
            state: Mutex::new((0, false)),
            cond: std::sync::Condvar::new(),
        }
    }

    /// Calls `fetch(i)` for tasks `0..n` in order, never more than `ahead` tasks beyond those taken.
    fn run(&self, n: usize, fetch: &dyn Fn(usize)) {
        for i in 0..n {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            while !st.1 && i >= st.0 + self.ahead {
                st = self.cond.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            if st.1 {
                return;
            }
            drop(st);
            fetch(i);
        }
    }

    /// The workers have taken the first `taken` tasks.
    fn taken(&self, taken: usize) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if taken > st.0 {
            st.0 = taken;
            self.cond.notify_one();
        }
    }

    fn stop(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.cond.notify_one();
    }
}

/// One chunk to fetch: file index, chunk index, offset in the file.
type Task = (usize, usize, u64);

pub(super) fn materialize(
    inner: &Inner,
    info: &CheckpointInfo,
    dest: &Path,
    progress: &dyn Progress,
) -> Result<MaterializeStats> {
    materialize_selected(inner, info, dest, &|_, _, _| true, progress)
}

/// [`materialize`] of the chunks `keep(path, offset, len)` selects; the others stay holes.
pub(super) fn materialize_selected(
    inner: &Inner,
    info: &CheckpointInfo,
    dest: &Path,
    keep: &(dyn Fn(&str, u64, u64) -> bool + Sync),
    progress: &dyn Progress,
) -> Result<MaterializeStats> {
    let started = Instant::now();
    let created_dest = !dest.exists();
    create_private_dir_all(dest).map_err(Error::io("cannot create folder", dest))?;
    let mut created: Vec<PathBuf> = Vec::new();
    let result = write_all(inner, info, dest, keep, progress, &mut created);
    if result.is_err() {
        // Leave no partial image behind for CRIU to trip over.
        for p in &created {
            let _ = fs::remove_file(p);
        }
        if created_dest {
            let _ = fs::remove_dir_all(dest);
        }
    }
    let mut stats = result?;
    stats.elapsed_ms = started.elapsed().as_millis() as u64;
    Ok(stats)
}

fn write_all(
    inner: &Inner,
    info: &CheckpointInfo,
    dest: &Path,
    keep: &(dyn Fn(&str, u64, u64) -> bool + Sync),
    progress: &dyn Progress,
    created: &mut Vec<PathBuf>,
) -> Result<MaterializeStats> {
    let mut files = Vec::with_capacity(info.files.len());
    for f in &info.files {
        let rel = Path::new(&f.path);
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(Error::DamagedManifest {
                checkpoint: info.id.clone(),
                path: inner.backend.manifest_path(&info.id),
                reason: format!("file path {:?} escapes the image folder", f.path),
            });
        }
        let path = dest.join(rel);
        if let Some(parent) = path.parent() {
            create_private_dir_all(parent).map_err(Error::io("cannot create folder", parent))?;
        }
        let file =
            create_private_file(&path).map_err(Error::io("cannot create image file", &path))?;
        created.push(path.clone());
        // Sized up front: all-zero chunks are simply never written and read back as zeros (holes).
        file.set_len(f.size)
            .map_err(Error::io("cannot size image file", &path))?;
        files.push((file, path));
    }

    let stored = |fi: usize, off: u64, c: &ChunkRef, kept: bool| {
        c.id.is_some() && keep(&info.files[fi].path, off, c.len as u64) == kept
    };
    let tasks: Vec<Task> = info
        .chunk_refs()
        .filter(|(fi, _, off, c)| stored(*fi, *off, c, true))
        .map(|(fi, ci, off, _)| (fi, ci, off))
        .collect();
    // Left as holes: counted as done for the progress bar.
    let skipped: u64 = info
        .chunk_refs()
        .filter(|(fi, _, off, c)| stored(*fi, *off, c, false))
        .map(|(_, _, _, c)| c.len as u64)
        .sum();
    let total: u64 = info.stats.logical_bytes;
    let zero_bytes: u64 = info
        .chunk_refs()
        .filter(|(_, _, _, c)| c.id.is_none())
        .map(|(_, _, _, c)| c.len as u64)
        .sum();
    let (stored, count) = (AtomicU64::new(0), AtomicU64::new(0));
    progress.start("restore images", total);
    progress.advance(zero_bytes + skipped);
    let chunk_of = |&(fi, ci, _): &Task| info.files[fi].chunks[ci].id;
    let result = on_workers(inner, info, &tasks, chunk_of, |&(fi, ci, off), scratch| {
        let (raw, stored_len) = fetch_any(inner, info, scratch, fi, ci, off)?;
        let (file, path) = &files[fi];
        file.write_all_at(raw, off)
            .map_err(Error::io("cannot write image file", path))?;
        let n = raw.len() as u64;
        stored.fetch_add(stored_len, Ordering::Relaxed);
        count.fetch_add(1, Ordering::Relaxed);
        progress.advance(n);
        Ok(())
    });
    progress.finish();
    result?;
    let (stored_bytes_read, chunks_read) = (stored.into_inner(), count.into_inner());
    Ok(MaterializeStats {
        files: files.len() as u64,
        logical_bytes: total,
        stored_bytes_read,
        chunks_read,
        zero_bytes,
        elapsed_ms: 0,
    })
}

/// Calls `visit(offset, len, bytes)` with the verified bytes of every chunk of file `fi` that
/// `want(offset, len)` selects, on the store's workers; see
/// [`Store::visit_chunks`](super::Store::visit_chunks).
pub(super) fn visit_chunks(
    inner: &Inner,
    info: &CheckpointInfo,
    fi: usize,
    want: &(dyn Fn(u64, u64) -> bool + Sync),
    visit: &super::ChunkVisitor<'_>,
    progress: &dyn Progress,
) -> Result<()> {
    let tasks: Vec<(usize, u64, u64)> = info
        .chunk_refs()
        .filter(|(f, _, off, c)| *f == fi && want(*off, c.len as u64))
        .map(|(_, ci, off, c)| (ci, off, c.len as u64))
        .collect();
    let chunk_of = |&(ci, _, _): &(usize, u64, u64)| info.files[fi].chunks[ci].id;
    on_workers(inner, info, &tasks, chunk_of, |&(ci, off, len), scratch| {
        let Some(id) = info.files[fi].chunks[ci].id else {
            return visit(off, len, None).map(|()| progress.advance(len));
        };
        // A cold chunk is read with direct I/O; a cached raw one is verified where it lies, mapped.
        if let Some(n) = inner
            .backend
            .read_chunk_uncached(&id, &mut scratch.direct)?
        {
            let raw = decode_checked(info, &mut scratch.dec, scratch.direct.slice(n), fi, ci, off)?;
            visit(off, len, Some(raw))?;
        } else if let Some(map) = verify_raw_in_place(inner, info, fi, ci, off)? {
            visit(off, len, Some(&map.bytes()[super::chunk::HEADER_LEN..]))?;
        } else {
            // Cached and compressed (or not a local file): read the usual way. `fetch_any` would ask the
            // backend for an uncached read a second time.
            let raw = fetch_verified(inner, info, &mut scratch.dec, &mut scratch.buf, fi, ci, off)?;
            visit(off, len, Some(raw))?;
        }
        progress.advance(len);
        Ok(())
    })
}

/// Runs `work(task, scratch)` for every task on the read workers (each with its own decoder and buffers),
/// tasks taken in order as workers come free. Stops at the first error, which it returns.
///
/// Where the backend reads cold chunks with direct I/O, the workers wait on the device themselves and four
/// more of them than cores keep it busy ([`read_workers`]); otherwise the chunk `chunk_of(task)` names is read ahead
/// into the page cache [`PREFETCH_AHEAD`] tasks early.
fn on_workers<T: Sync>(
    inner: &Inner,
    info: &CheckpointInfo,
    tasks: &[T],
    chunk_of: impl Fn(&T) -> Option<ChunkId> + Sync,
    work: impl Fn(&T, &mut Scratch) -> Result<()> + Sync,
) -> Result<()> {
    let workers = read_workers(inner, info);
    let max_chunk = info.chunking.max_size as usize;
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let error: Mutex<Option<Error>> = Mutex::new(None);
    let fail = |e: Error| {
        failed.store(true, Ordering::SeqCst);
        error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(e);
    };
    let ahead = Prefetcher::new(PREFETCH_AHEAD);
    std::thread::scope(|s| {
        if !inner.backend.reads_uncached() {
            s.spawn(|| {
                ahead.run(tasks.len(), &|i| {
                    if let Some(id) = chunk_of(&tasks[i]) {
                        inner.backend.prefetch_chunk(&id);
                    }
                })
            });
        }
        let workers: Vec<_> = (0..workers.min(tasks.len()).max(1))
            .map(|_| {
                s.spawn(|| {
                    let dec = match Decoder::new(max_chunk) {
                        Ok(d) => d,
                        Err(e) => return fail(Error::Other(format!("zstd: {e}"))),
                    };
                    let mut scratch = Scratch {
                        dec,
                        buf: Vec::with_capacity(max_chunk + super::chunk::HEADER_LEN),
                        direct: AlignedBuf::new(),
                    };
                    while !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(task) = tasks.get(i) else {
                            break;
                        };
                        ahead.taken(i + 1);
                        if let Err(e) = work(task, &mut scratch) {
                            fail(e);
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            if let Err(panic) = w.join() {
                ahead.stop();
                std::panic::resume_unwind(panic);
            }
        }
        ahead.stop();
    });
    match error.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The error for chunk `ci` of file `fi` (at `offset` in the file): names checkpoint, file and chunk.
fn damaged_chunk(
    info: &CheckpointInfo,
    fi: usize,
    ci: usize,
    offset: u64,
    problem: String,
) -> Error {
    let file = &info.files[fi];
    let cref = file.chunks[ci];
    Error::DamagedChunk {
        checkpoint: info.id.clone(),
        file: file.path.clone(),
        index: ci,
        chunk: cref.id.expect("only stored chunks are fetched").to_hex(),
        offset,
        len: cref.len as u64,
        problem,
    }
}

/// Reads chunk `ci` of file `fi` and checks it; the error names checkpoint, file and chunk.
///
/// Through `read`, not a mapping: mapping each object (what the splice path does for raw chunks) measured
/// no faster here (2.04-2.19 against 2.16-2.24 s of CPU for a 2 GiB folder, alternated), and a read cannot
/// fault on a file truncated behind the store's back.
pub(super) fn fetch_verified<'a>(
    inner: &Inner,
    info: &CheckpointInfo,
    dec: &'a mut Decoder,
    buf: &'a mut Vec<u8>,
    fi: usize,
    ci: usize,
    offset: u64,
) -> Result<&'a [u8]> {
    let id = info.files[fi].chunks[ci]
        .id
        .expect("only stored chunks are fetched");
    if !inner.backend.read_chunk(&id, buf)? {
        return Err(damaged_chunk(info, fi, ci, offset, "missing".into()));
    }
    decode_checked(info, dec, buf, fi, ci, offset)
}

/// Decodes stored object `stored` of chunk `ci` of file `fi` and checks it against the manifest (hash and
/// length).
fn decode_checked<'a>(
    info: &CheckpointInfo,
    dec: &'a mut Decoder,
    stored: &'a [u8],
    fi: usize,
    ci: usize,
    offset: u64,
) -> Result<&'a [u8]> {
    let cref = info.files[fi].chunks[ci];
    let id = cref.id.expect("only stored chunks are fetched");
    let damaged = |problem: String| damaged_chunk(info, fi, ci, offset, problem);
    let raw = dec.decode(&id, stored).map_err(damaged)?;
    if raw.len() != cref.len as usize {
        return Err(damaged(format!(
            "damaged ({} bytes, the manifest says {})",
            raw.len(),
            cref.len
        )));
    }
    Ok(raw)
}

/// A read worker's reusable state.
struct Scratch {
    dec: Decoder,
    /// Objects read through the page cache.
    buf: Vec<u8>,
    /// Objects read with direct I/O.
    direct: AlignedBuf,
}

/// Like [`fetch_verified`], but a chunk missing from the page cache is read with direct I/O
/// ([`Backend::read_chunk_uncached`]). Returns the verified bytes and the stored object's size.
///
/// [`Backend::read_chunk_uncached`]: super::backend::Backend::read_chunk_uncached
fn fetch_any<'a>(
    inner: &Inner,
    info: &CheckpointInfo,
    s: &'a mut Scratch,
    fi: usize,
    ci: usize,
    offset: u64,
) -> Result<(&'a [u8], u64)> {
    let id = info.files[fi].chunks[ci]
        .id
        .expect("only stored chunks are fetched");
    if let Some(n) = inner.backend.read_chunk_uncached(&id, &mut s.direct)? {
        let raw = decode_checked(info, &mut s.dec, s.direct.slice(n), fi, ci, offset)?;
        return Ok((raw, n as u64));
    }
    if !inner.backend.read_chunk(&id, &mut s.buf)? {
        return Err(damaged_chunk(info, fi, ci, offset, "missing".into()));
    }
    let n = s.buf.len() as u64;
    Ok((decode_checked(info, &mut s.dec, &s.buf, fi, ci, offset)?, n))
}

/// A chunk object mapped read-only, unmapped on drop. Chunk objects are written once, complete, and
/// replaced only by rename (a new inode; the mapping keeps the old one), never truncated in place: the
/// mapping cannot lose pages under us unless something outside the store truncates the file.
pub(super) struct Mapped {
    ptr: *mut libc::c_void,
    len: usize,
    /// Kept open for the mapping's life (splicing from it needs the descriptor too).
    file: fs::File,
}

// SAFETY: a read-only mapping owned by this value; shared references only read it.
unsafe impl Send for Mapped {}
unsafe impl Sync for Mapped {}

impl Mapped {
    /// Maps a whole local chunk object; `None` when it cannot be mapped or is empty (the read path then
    /// reports what is wrong).
    pub(super) fn new(file: fs::File) -> Option<Mapped> {
        use std::os::fd::AsRawFd;
        let len = file.metadata().ok()?.len() as usize;
        if len == 0 {
            return None;
        }
        // SAFETY: a read-only private mapping of `len` bytes of a file we hold open; unmapped in `drop`.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_POPULATE,
                file.as_raw_fd(),
                0,
            )
        };
        (ptr != libc::MAP_FAILED).then_some(Mapped { ptr, len, file })
    }

    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` readable bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `open`; no slice of it outlives `self`.
        unsafe { libc::munmap(self.ptr, self.len) };
    }
}

/// Writes file `fi` of a checkpoint, in order, to `out` (a pipe CRIU reads during a streaming restore):
/// chunks are fetched, decoded and verified in parallel a few ahead of the writer, and only verified bytes
/// are written. On a damaged chunk the error names checkpoint, file and chunk, and nothing of that chunk or
/// after it reaches `out`. Returns the bytes written.
///
/// With `splice_to` (the descriptor of `out`, a pipe), raw chunks kept in local files are verified where
/// they lie (mapped and hashed, no copy) and spliced from their file into the pipe: the pipe then holds the
/// page cache's pages instead of copies, which saves a copy and the pipe's own page allocations (a streamed
/// restore of 1 GiB of random memory took 10% less time, half the system CPU). Chunk objects are written
/// once and replaced only by rename, so the bytes spliced are the bytes hashed (the open descriptor keeps
/// the inode that was verified); only a writer modifying the object in place, behind the store's back, could
/// slip in between.
pub(super) fn stream_file(
    inner: &Inner,
    info: &CheckpointInfo,
    fi: usize,
    out: &mut dyn std::io::Write,
    splice_to: Option<std::os::fd::BorrowedFd<'_>>,
    progress: &dyn Progress,
) -> Result<u64> {
    use std::collections::BTreeMap;
    use std::sync::Condvar;

    let file = &info.files[fi];
    let write_err = |e| Error::io("cannot send image file", Path::new(&file.path))(e);
    let offsets: Vec<u64> = info
        .chunk_refs()
        .filter(|r| r.0 == fi)
        .map(|(_, _, offset, _)| offset)
        .collect();
    let stored: Vec<usize> = (0..file.chunks.len())
        .filter(|&ci| file.chunks[ci].id.is_some())
        .collect();
    let max_chunk = info.chunking.max_size as usize;
    let plan = Plan::new(
        info.stats.logical_bytes,
        inner.opts.effective_threads(),
        inner.opts.chunking,
        1,
    );
    // Chunks decoded ahead of the writer: enough to keep every worker busy, within the memory budget.
    let window = (2 * plan.workers + 2).min(stored.len().max(1));
    let workers = plan.workers.min(stored.len()).max(1);

    struct State {
        /// Next entry of `stored` to fetch.
        next: usize,
        /// Entries of `stored` the writer has consumed.
        consumed: usize,
        ready: BTreeMap<usize, Ready>,
        spare: Vec<Vec<u8>>,
        error: Option<Error>,
        stop: bool,
    }
    let state = Mutex::new(State {
        next: 0,
        consumed: 0,
        ready: BTreeMap::new(),
        spare: Vec::new(),
        error: None,
        stop: false,
    });
    let cond = Condvar::new();
    let lock = || state.lock().unwrap_or_else(|p| p.into_inner());
    let ahead = Prefetcher::new(PREFETCH_AHEAD);

    std::thread::scope(|s| {
        s.spawn(|| {
            ahead.run(stored.len(), &|k| {
                if let Some(id) = file.chunks[stored[k]].id {
                    inner.backend.prefetch_chunk(&id);
                }
            })
        });
        for _ in 0..workers {
            s.spawn(|| {
                let mut dec = match Decoder::new(max_chunk) {
                    Ok(d) => d,
                    Err(e) => {
                        let mut st = lock();
                        st.error.get_or_insert(Error::Other(format!("zstd: {e}")));
                        st.stop = true;
                        cond.notify_all();
                        return;
                    }
                };
                let mut buf = Vec::with_capacity(max_chunk + super::chunk::HEADER_LEN);
                loop {
                    let k = {
                        let mut st = lock();
                        while !st.stop && st.next < stored.len() && st.next >= st.consumed + window
                        {
                            st = cond.wait(st).unwrap_or_else(|p| p.into_inner());
                        }
                        if st.stop || st.next >= stored.len() {
                            return;
                        }
                        st.next += 1;
                        st.next - 1
                    };
                    ahead.taken(k + 1);
                    let ci = stored[k];
                    // A local raw chunk is verified in its file and spliced from there when writing to a
                    // pipe; anything else is read, decoded and verified into a buffer. Buffers go round
                    // between workers and the writer: fresh multi-MiB allocations would cost a page fault
                    // per 4 KiB on every chunk.
                    let in_place = splice_to.and_then(|_| {
                        verify_raw_in_place(inner, info, fi, ci, offsets[ci]).transpose()
                    });
                    let r = match in_place {
                        Some(verified) => verified.map(Ready::InFile),
                        None => {
                            let mut bytes = lock().spare.pop().unwrap_or_default();
                            fetch_verified(inner, info, &mut dec, &mut buf, fi, ci, offsets[ci])
                                .map(|raw| raw.len())
                                .map(|len| {
                                    // The verified bytes are not copied for the writer: the buffer
                                    // they lie in (the decoder's, or the read buffer after the
                                    // header) goes to it, and the spare takes that buffer's place.
                                    let start = if dec.swap_output(&mut bytes) {
                                        0
                                    } else {
                                        std::mem::swap(&mut buf, &mut bytes);
                                        super::chunk::HEADER_LEN
                                    };
                                    Ready::Bytes { bytes, start, len }
                                })
                        }
                    };
                    let mut st = lock();
                    match r {
                        Ok(ready) => {
                            st.ready.insert(k, ready);
                        }
                        Err(e) => {
                            st.error.get_or_insert(e);
                            st.stop = true;
                        }
                    }
                    cond.notify_all();
                }
            });
        }

        // The writer: every chunk in file order; zero runs are written from a zeroed buffer.
        let result = (|| -> Result<u64> {
            let zeros = vec![0u8; max_chunk.min(1 << 20)];
            let mut written = 0u64;
            let mut k = 0;
            for cref in &file.chunks {
                if cref.id.is_none() {
                    let mut left = cref.len as usize;
                    while left > 0 {
                        let n = left.min(zeros.len());
                        out.write_all(&zeros[..n]).map_err(&write_err)?;
                        left -= n;
                    }
                } else {
                    let raw = {
                        let mut st = lock();
                        loop {
                            if let Some(raw) = st.ready.remove(&k) {
                                st.consumed += 1;
                                cond.notify_all();
                                break raw;
                            }
                            if let Some(e) = st.error.take() {
                                return Err(e);
                            }
                            st = cond.wait(st).unwrap_or_else(|p| p.into_inner());
                        }
                    };
                    k += 1;
                    match raw {
                        Ready::Bytes { bytes, start, len } => {
                            out.write_all(&bytes[start..start + len])
                                .map_err(&write_err)?;
                            lock().spare.push(bytes);
                        }
                        Ready::InFile(src) => {
                            let pipe = splice_to
                                .expect("chunks are left in their files only when splicing");
                            splice_chunk(&src.file, pipe, cref.len as usize).map_err(&write_err)?;
                        }
                    }
                }
                written += cref.len as u64;
                progress.advance(cref.len as u64);
            }
            Ok(written)
        })();
        let mut st = lock();
        st.stop = true;
        cond.notify_all();
        drop(st);
        ahead.stop();
        result
    })
}

/// A verified chunk waiting for the writer.
enum Ready {
    /// Its bytes: `bytes[start..start + len]`.
    Bytes {
        bytes: Vec<u8>,
        start: usize,
        len: usize,
    },
    /// A raw chunk verified in its object file, to be spliced from there (the chunk's bytes after the
    /// header).
    InFile(Mapped),
}

/// Splices a raw chunk's payload from its object file into `pipe`.
fn splice_chunk(
    src: &fs::File,
    pipe: std::os::fd::BorrowedFd<'_>,
    len: usize,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut off = super::chunk::HEADER_LEN as libc::loff_t;
    let mut left = len;
    while left > 0 {
        // SAFETY: both descriptors are open for the call; `off` is a valid loff_t we own.
        let n = unsafe {
            libc::splice(
                src.as_raw_fd(),
                &mut off,
                pipe.as_raw_fd(),
                std::ptr::null_mut(),
                left,
                libc::SPLICE_F_MORE,
            )
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "chunk object ended early",
            ));
        }
        left -= n as usize;
    }
    Ok(())
}

/// Verifies chunk `ci` of file `fi` in its local object file, without reading it into a buffer: the
/// payload is mapped and hashed. `Ok(Some(map))`: a raw chunk that matches its name, to be spliced from
/// its file. `Ok(None)`: not a local raw chunk (compressed, on another backend, or missing or short, which the
/// usual path then reports). A raw chunk whose content does not match is a `DamagedChunk` error.
fn verify_raw_in_place(
    inner: &Inner,
    info: &CheckpointInfo,
    fi: usize,
    ci: usize,
    offset: u64,
) -> Result<Option<Mapped>> {
    use super::chunk::{Encoding, Header, HEADER_LEN};
    use std::os::unix::fs::FileExt;
    let cref = info.files[fi].chunks[ci];
    let id = cref.id.expect("only stored chunks are fetched");
    let len = cref.len as usize;
    let Some(file) = inner
        .backend
        .local_chunk_file(&id)
        .and_then(|p| fs::File::open(p).ok())
    else {
        return Ok(None);
    };
    // The header first: a compressed chunk goes the usual way, and mapping (and populating) its whole
    // file only to find that out would be wasted.
    let mut head = [0u8; HEADER_LEN];
    match file
        .read_exact_at(&mut head, 0)
        .map(|()| Header::decode(&head))
    {
        Ok(Ok(h)) if h.encoding == Encoding::Raw && h.raw_len as usize == len => {}
        _ => return Ok(None),
    }
    let Some(map) = Mapped::new(file) else {
        return Ok(None);
    };
    let bytes = map.bytes();
    if bytes.len() != HEADER_LEN + len {
        return Ok(None);
    }
    if ChunkId::of(&bytes[HEADER_LEN..]) != id {
        return Err(damaged_chunk(
            info,
            fi,
            ci,
            offset,
            super::chunk::HASH_MISMATCH.into(),
        ));
    }
    Ok(Some(map))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefetcher_stays_ahead_by_at_most_its_window_and_stops() {
        let p = Prefetcher::new(3);
        let fetched = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            s.spawn(|| p.run(100, &|i| fetched.lock().unwrap().push(i)));
            let wait_for = |n: usize| {
                let t0 = Instant::now();
                while fetched.lock().unwrap().len() < n {
                    assert!(t0.elapsed().as_secs() < 10, "prefetcher stuck");
                    std::thread::yield_now();
                }
            };
            wait_for(3);
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert_eq!(*fetched.lock().unwrap(), vec![0, 1, 2], "nothing taken yet");
            p.taken(5);
            wait_for(8);
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert_eq!(fetched.lock().unwrap().len(), 8, "5 taken + 3 ahead");
            p.stop();
        });
        assert_eq!(*fetched.lock().unwrap(), (0..8).collect::<Vec<_>>());
    }
}
