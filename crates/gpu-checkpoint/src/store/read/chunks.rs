//! Verified chunks handed to the caller instead of written somewhere: every chunk of an image the caller
//! selects, on the read workers ([`Store::visit_chunks`]), or one chunk at a time on the caller's thread
//! ([`ChunkReader`]). The userfaultfd restore copies them into the processes, the first in the background,
//! the second for a page a process waits for.

use super::pool::on_workers_beside;
use super::verify::{fetch_any, Scratch};
use crate::store::chunk::{Decoder, HEADER_LEN};
use crate::store::error::{Error, Result};
use crate::store::manifest::CheckpointInfo;
use crate::store::{Inner, Progress, Store};
use crate::util::AlignedBuf;

/// Where [`Store::visit_chunks`] hands the verified chunks of an image.
pub trait ChunkSink: Sync {
    /// Whether the chunk at `off` (`len` bytes) of the image is to be read: asked once for each chunk,
    /// when the reads are planned.
    fn wants(&self, off: u64, len: u64) -> bool;
    /// Asked by a worker right before it reads a planned chunk: `false` skips it (another path took it
    /// meanwhile). By default every planned chunk is read.
    fn claim(&self, _off: u64, _len: u64) -> bool {
        true
    }
    /// The chunk's verified bytes (`None`: an all-zero chunk, which is not stored). An error stops every
    /// worker and is what [`Store::visit_chunks`] returns.
    fn visit(&self, off: u64, len: u64, bytes: Option<&[u8]>) -> Result<()>;
    /// Readers of the sink's own ([`ChunkReader`]s) that run beside the workers: the workers are fewer
    /// where the memory budget would not hold them all.
    fn other_readers(&self) -> usize {
        0
    }
}

/// Reads chunk `ci` of file `fi` (at `off`) and calls `f` with its verified bytes: a cold chunk read with
/// direct I/O into the worker's aligned buffer, a cached one read into its buffer (not mapped: a mapping
/// per chunk costs each worker the process's mmap lock for writing and, unmapped, a TLB flush on every
/// core the workers run on, which grows with the cores; the copy out of the page cache does not, and
/// measured the same here: warm 2 GiB restores 634-654 ms read against 648-651 ms mapped, alternated).
fn with_verified(
    inner: &Inner,
    info: &CheckpointInfo,
    fi: usize,
    ci: usize,
    off: u64,
    scratch: &mut Scratch,
    f: &mut dyn FnMut(Option<&[u8]>) -> Result<()>,
) -> Result<()> {
    if info.files[fi].chunks[ci].id.is_none() {
        return f(None);
    }
    let (raw, _) = fetch_any(inner, info, scratch, fi, ci, off)?;
    f(Some(raw))
}

fn scratch(info: &CheckpointInfo) -> Result<Scratch> {
    let max_chunk = info.chunking.max_size as usize;
    Ok(Scratch {
        dec: Decoder::new(max_chunk).map_err(|e| Error::Zstd {
            op: "zstd",
            source: e,
        })?,
        buf: Vec::with_capacity(max_chunk + HEADER_LEN),
        direct: AlignedBuf::new(),
    })
}

impl Store {
    /// Hands the verified bytes of every chunk of image `name` that `sink` wants to [`ChunkSink::visit`],
    /// on the store's worker threads, roughly in file order (any order at all when a worker is slow).
    /// Stops at the first error, the store's (naming checkpoint, file and chunk) or the sink's. `Ok(None)`
    /// when the checkpoint has no such image.
    pub fn visit_chunks(
        &self,
        info: &CheckpointInfo,
        name: &str,
        sink: &dyn ChunkSink,
        progress: &dyn Progress,
    ) -> Result<Option<()>> {
        let Some(fi) = info.files.iter().position(|f| f.path == name) else {
            return Ok(None);
        };
        let _lock = self.read_guard()?;
        let inner = &*self.inner;
        let tasks: Vec<(usize, u64, u64)> = info
            .chunk_refs()
            .filter(|(f, _, off, c)| *f == fi && sink.wants(*off, c.len as u64))
            .map(|(_, ci, off, c)| (ci, off, c.len as u64))
            .collect();
        let chunk_of = |&(ci, _, _): &(usize, u64, u64)| {
            let c = &info.files[fi].chunks[ci];
            (c.id, c.len)
        };
        let others = sink.other_readers();
        on_workers_beside(
            inner,
            info,
            others,
            &tasks,
            chunk_of,
            |&(ci, off, len), scratch| {
                if sink.claim(off, len) {
                    with_verified(inner, info, fi, ci, off, scratch, &mut |bytes| {
                        sink.visit(off, len, bytes)
                    })?;
                }
                progress.advance(len);
                Ok(())
            },
        )
        .map(Some)
    }

    /// A reader of single chunks of checkpoint `info`, verified, on the caller's thread (its buffers and
    /// decoder are kept from one chunk to the next). It holds the store's lock shared while it lives.
    pub fn chunk_reader<'a>(&'a self, info: &'a CheckpointInfo) -> Result<ChunkReader<'a>> {
        Ok(ChunkReader {
            _lock: self.read_guard()?,
            inner: &self.inner,
            info,
            scratch: scratch(info)?,
            offsets: vec![None; info.files.len()],
        })
    }
}

/// What [`ChunkReader::read_at`] calls with a chunk: its offset in the image, its length, its verified
/// bytes (`None`: all zeros).
pub type ChunkFn<'f> = dyn FnMut(u64, u64, Option<&[u8]>) -> Result<()> + 'f;

/// Reads one verified chunk at a time ([`Store::chunk_reader`]).
pub struct ChunkReader<'a> {
    _lock: Option<crate::store::backend::LockGuard>,
    inner: &'a Inner,
    info: &'a CheckpointInfo,
    scratch: Scratch,
    /// Per file, where each chunk starts (made on the first read of that file).
    offsets: Vec<Option<Vec<u64>>>,
}

impl ChunkReader<'_> {
    /// Reads the chunk of image `name` that holds byte `offset` and calls `f(chunk offset, length,
    /// verified bytes)` (`None` for an all-zero chunk). `Ok(false)` when the checkpoint has no such image
    /// or the image no such byte.
    pub fn read_at(&mut self, name: &str, offset: u64, f: &mut ChunkFn<'_>) -> Result<bool> {
        let Some(fi) = self.info.files.iter().position(|f| f.path == name) else {
            return Ok(false);
        };
        let file = &self.info.files[fi];
        let starts = self.offsets[fi].get_or_insert_with(|| {
            file.chunks
                .iter()
                .scan(0u64, |at, c| {
                    let start = *at;
                    *at += c.len as u64;
                    Some(start)
                })
                .collect()
        });
        // The last chunk starting at or before `offset`.
        let Some(ci) = starts.partition_point(|&s| s <= offset).checked_sub(1) else {
            return Ok(false);
        };
        let (off, len) = (starts[ci], file.chunks[ci].len as u64);
        if offset >= off + len {
            return Ok(false);
        }
        with_verified(
            self.inner,
            self.info,
            fi,
            ci,
            off,
            &mut self.scratch,
            &mut |bytes| f(off, len, bytes),
        )?;
        Ok(true)
    }
}
