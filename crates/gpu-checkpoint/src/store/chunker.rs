//! Content-defined chunking of one file into a stream of chunks, with bounded memory.
//!
//! The file is read into large pooled segments; FastCDC (v2020) finds cut points inside a segment and every
//! chunk is handed on as a reference into it (no copy). Only the unfinished tail of a segment (less than one
//! maximum chunk) is copied to the start of the next. Segments come from a fixed pool and go back to it when
//! the last chunk referencing them is done, so the pool size bounds the memory of the whole pipeline and a
//! slow consumer blocks the reader (backpressure) instead of growing a queue.

use std::collections::HashMap;
use std::io::Read;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use super::chunk::{is_zero, zero_prefix_len, ChunkId, HEADER_LEN};
use super::manifest::ChunkRef;
use crate::util::DIRECT_IO_ALIGN;

/// The size of a memory page in CRIU's page images: the granularity of [`Chunker::page_aligned`] cuts.
pub const PAGE: usize = 4096;

/// Whether an image is one of CRIU's page images (`pages-N.img`): its content is whole memory pages, so
/// its chunks are cut at page boundaries ([`Chunker::page_aligned`]).
pub fn is_page_image(name: &str) -> bool {
    let file = name.rsplit('/').next().unwrap_or(name);
    file.starts_with("pages-") && file.ends_with(".img")
}

/// A segment buffer of a fixed length whose first byte sits [`HEADER_LEN`] bytes past a page boundary.
///
/// Why: a raw chunk's stored object is its header followed by its bytes, and the local store writes it
/// with direct I/O, which takes page-aligned memory only. A chunk that starts at a page-aligned offset of
/// such a buffer has every byte after its first `DIRECT_IO_ALIGN - HEADER_LEN` on the same page boundaries
/// as in its object, so all but its first block can go to the device straight from the segment, without
/// being copied into an aligned buffer first ([`crate::store::chunk::Encoder::encode_parts`]).
pub struct SegBuf {
    vec: Vec<u8>,
    start: usize,
    len: usize,
}

impl SegBuf {
    /// `len` zeroed bytes, placed as described above (the allocation is one page larger).
    pub fn new(len: usize) -> SegBuf {
        let vec = vec![0u8; len + DIRECT_IO_ALIGN];
        let addr = vec.as_ptr() as usize;
        let start = (HEADER_LEN + DIRECT_IO_ALIGN - addr % DIRECT_IO_ALIGN) % DIRECT_IO_ALIGN;
        SegBuf { vec, start, len }
    }

    /// A buffer of exactly `vec`'s bytes, wherever they are.
    pub fn from_vec(vec: Vec<u8>) -> SegBuf {
        let len = vec.len();
        SegBuf { vec, start: 0, len }
    }
}

impl std::ops::Deref for SegBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.vec[self.start..self.start + self.len]
    }
}

impl std::ops::DerefMut for SegBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.vec[self.start..self.start + self.len]
    }
}

impl Default for SegBuf {
    fn default() -> Self {
        SegBuf::from_vec(Vec::new())
    }
}

/// Content-defined chunk sizes. A chunk is never cut before `min_size` bytes; from there FastCDC's gear
/// hash looks for a cut point with a mask tuned for a cut every `avg_size - min_size` bytes on average
/// (rounded to a power of two), and `max_size` ends the chunk if none is found. See `docs/store.md` for how
/// these were chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkParams {
    pub min_size: u32,
    pub avg_size: u32,
    pub max_size: u32,
}

impl Default for ChunkParams {
    /// min 1.5 MiB, avg 1.75 MiB, max 4 MiB. The rolling hash only runs past the minimum, so a large
    /// minimum with a short search after it (256 KiB expected) leaves it about a quarter of the bytes to
    /// scan (chunks average 2 MiB on real memory: runs without a cut point go on to the maximum), where
    /// FastCDC's own settings (min = avg = 1 MiB, its largest minimum) scanned 43%: its rolling hash went
    /// from 14% to 8% of a checkpoint's CPU. A small insertion still lands the next cut on the old one
    /// unless a cut point falls within the inserted length of the minimum (4 KiB / 256 KiB = 1.6%).
    /// Measurements in `docs/store.md`.
    fn default() -> Self {
        ChunkParams {
            min_size: 1536 * 1024,
            avg_size: 1792 * 1024,
            max_size: 4 * 1024 * 1024,
        }
    }
}

impl ChunkParams {
    /// Checks the sizes: even (FastCDC tests cut points in pairs), 64 bytes <= min < avg <= max <= 16 MiB.
    pub fn validate(&self) -> Result<(), String> {
        let (min, avg, max) = (self.min_size, self.avg_size, self.max_size);
        let ok = (64..avg).contains(&min)
            && avg <= max
            && max <= 16 * 1024 * 1024
            && min % 2 == 0
            && avg % 2 == 0
            && max % 2 == 0;
        if ok {
            Ok(())
        } else {
            Err(format!("unsupported chunk sizes {self:?}"))
        }
    }

    /// The gear-hash mask (and its one-bit-shifted twin, for FastCDC's two-bytes-at-a-time scan) giving a
    /// cut every `avg - min` bytes on average.
    fn masks(&self) -> (u64, u64) {
        let gap = (self.avg_size - self.min_size).max(64) as usize;
        let (mask, _) = fastcdc::v2020::select_masks(gap, fastcdc::v2020::Normalization::Level0);
        (mask, mask << 1)
    }
}

/// The end of the chunk starting at `data[0]`: FastCDC v2020's scan, from `min_size` on, with
/// [`ChunkParams::masks`].
fn cdc_cut(data: &[u8], params: ChunkParams, (mask, mask_ls): (u64, u64)) -> usize {
    let min = params.min_size as usize;
    fastcdc::v2020::cut(
        data,
        min,
        min,
        params.max_size as usize,
        mask,
        mask,
        mask_ls,
        mask_ls,
    )
    .1
}

/// A pooled read buffer; returns itself to the pool when the last chunk referencing it is dropped.
pub struct Segment {
    buf: SegBuf,
    home: Sender<SegBuf>,
}

impl Drop for Segment {
    fn drop(&mut self) {
        // The pool outlives every segment except during teardown, when losing the buffer is fine.
        let _ = self.home.send(std::mem::take(&mut self.buf));
    }
}

/// A set of segment buffers: a fixed number allocated up front, plus up to `spare` more allocated only
/// when every one is in use (a leave-running dump copies CRIU's pipes into memory as fast as they come,
/// rather than waiting for the workers to free a segment: see [`crate::store::Streams`]).
pub struct SegmentPool {
    give: Sender<SegBuf>,
    take: Receiver<SegBuf>,
    size: usize,
    /// How many more buffers may still be allocated on demand.
    spare: AtomicUsize,
}

impl SegmentPool {
    /// `count` buffers of `size` bytes, allocated (and touched) once.
    pub fn new(count: usize, size: usize) -> SegmentPool {
        Self::growing(count, 0, size)
    }

    /// [`SegmentPool::new`] that may grow by `spare` more buffers when all are in use. They are allocated
    /// untouched (the kernel maps their pages as they are first written) and kept until the pool goes.
    pub fn growing(count: usize, spare: usize, size: usize) -> SegmentPool {
        let (give, take) = crossbeam_channel::bounded(count + spare);
        for _ in 0..count {
            give.send(SegBuf::new(size)).expect("pool has room");
        }
        SegmentPool {
            give,
            take,
            size,
            spare: spare.into(),
        }
    }

    /// A free segment, waiting for one if all are in use and the pool may not grow.
    pub fn get(&self) -> SegBuf {
        if let Some(buf) = self.try_get() {
            return buf;
        }
        let grow = self
            .spare
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        if grow {
            return SegBuf::new(self.size);
        }
        // Cannot fail: we hold a sender ourselves.
        self.take.recv().expect("pool sender alive")
    }

    /// A free segment, if there is one right now.
    pub fn try_get(&self) -> Option<SegBuf> {
        self.take.try_recv().ok()
    }

    /// Gives back a segment taken with [`SegmentPool::get`] and not used (another stream may be waiting
    /// for it).
    pub fn put(&self, buf: SegBuf) {
        // Cannot fail: we hold a receiver ourselves.
        let _ = self.give.send(buf);
    }
}

/// One chunk: a range of a shared segment, plus where it sits in its file.
pub struct Piece {
    seg: Arc<Segment>,
    range: Range<usize>,
    /// Index of the chunk within its file.
    pub index: usize,
    /// Byte offset of the chunk within its file.
    pub offset: u64,
    /// What the chunker already knows about the content.
    pub known: Known,
}

/// What the chunker found out about a piece while cutting it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Known {
    /// Nothing: hash it.
    Nothing,
    /// All zeros.
    Zero,
    /// Hashed already, with this result.
    Id(ChunkId),
    /// Cut at an old chunk boundary without hashing, expecting the old chunk's content (speculation, see
    /// [`Hints`]): hash it and report a mismatch.
    Expect(ChunkId),
}

/// The chunk boundaries of the same file in an earlier checkpoint, by offset. A re-checkpoint of barely
/// changed memory finds most chunks at the same offsets: hashing a candidate and comparing it with the old
/// name replaces running the rolling hash over it.
///
/// Where FastCDC cuts depends on the chunk's bytes and the one byte after it, so a hinted chunk is what CDC
/// would cut unless exactly that next byte changed; then keeping the old boundary is just as good for
/// deduplication (the next chunk is looked up at the same offset again). The last chunk of the old file was
/// cut by the end of the file, not by content: it is never used as a hint.
///
/// While every hinted chunk so far matched, the chunker *speculates*: it cuts at the old boundaries without
/// hashing and leaves the comparison to the workers (which hash anyway, in parallel). The first mismatch a
/// worker reports turns speculation off for the file; chunks already cut speculatively are still correct
/// chunks (just cut at the old offsets), so the cost of a wrong guess is at most the pieces in flight.
#[derive(Default)]
pub struct Hints {
    at: HashMap<u64, ChunkRef>,
    /// Set by a worker when a speculative chunk did not match.
    pub mismatch: std::sync::atomic::AtomicBool,
}

impl Hints {
    pub fn new(chunks: &[ChunkRef]) -> Hints {
        let mut at = HashMap::with_capacity(chunks.len());
        let mut offset = 0u64;
        for c in chunks.iter().take(chunks.len().saturating_sub(1)) {
            at.insert(offset, *c);
            offset += c.len as u64;
        }
        Hints {
            at,
            mismatch: Default::default(),
        }
    }
}

impl Piece {
    pub fn data(&self) -> &[u8] {
        &self.seg.buf[self.range.clone()]
    }
}

/// Cuts one file (or any reader) into chunks, one segment at a time, so that whichever thread is free can
/// advance it (see the ingest pipeline).
pub struct Chunker<'h, R> {
    reader: R,
    params: ChunkParams,
    hints: Option<&'h Hints>,
    /// Cut only at page boundaries of the file (a page image), see [`Chunker::page_aligned`].
    pages: bool,
    home: Sender<SegBuf>,
    /// The unfinished tail of the previous segment.
    prev: Option<(Arc<Segment>, Range<usize>)>,
    index: usize,
    offset: u64,
    done: bool,
}

impl<'h, R: Read> Chunker<'h, R> {
    pub fn new(
        reader: R,
        params: ChunkParams,
        pool: &SegmentPool,
        hints: Option<&'h Hints>,
    ) -> std::io::Result<Self> {
        // A segment must hold a whole maximum chunk after the tail carried over from the previous one.
        if pool.size < 2 * params.max_size as usize {
            return Err(std::io::Error::other(format!(
                "segment size {} is below twice the maximum chunk size {}",
                pool.size, params.max_size
            )));
        }
        Ok(Chunker {
            reader,
            params,
            hints,
            pages: false,
            home: pool.give.clone(),
            prev: None,
            index: 0,
            offset: 0,
            done: false,
        })
    }

    /// Cuts chunks at page boundaries of the file only (`is_page_image`): every content-defined or
    /// zero-run cut is moved back to the page boundary before it (never below the minimum chunk size).
    ///
    /// A page image changes by whole pages (a page dumped or not, written or not), so moving a cut within
    /// its page keeps it content-defined for deduplication, and chunks that start on page boundaries are
    /// written to the store without a copy (see [`SegBuf`]): about a tenth of a checkpoint's CPU here.
    pub fn page_aligned(mut self, on: bool) -> Self {
        self.pages = on;
        self
    }

    /// Bytes cut into chunks so far.
    pub fn bytes(&self) -> u64 {
        self.offset
    }

    /// True once every chunk has been emitted (or `emit` asked to stop).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Fills `buf` (a segment from the pool) with the previous tail and more input, and emits, in order,
    /// every chunk whose end is known. `emit` returning `false` stops the chunker.
    pub fn step(
        &mut self,
        mut buf: SegBuf,
        emit: &mut dyn FnMut(Piece) -> bool,
    ) -> std::io::Result<()> {
        let size = buf.len();
        let mut filled = 0;
        if let Some((seg, tail)) = self.prev.take() {
            buf[..tail.len()].copy_from_slice(&seg.buf[tail.clone()]);
            filled = tail.len();
        }
        let mut eof = false;
        while filled < size {
            match self.reader.read(&mut buf[filled..]) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = self.home.send(buf);
                    self.done = true;
                    return Err(e);
                }
            }
        }
        let seg = Arc::new(Segment {
            buf,
            home: self.home.clone(),
        });
        self.cut(seg, 0..filled, eof, emit);
        Ok(())
    }

    /// How many bytes a segment filled by another thread must leave free in front of the input's next
    /// bytes ([`Chunker::step_read`]): room for the previous segment's unfinished tail, which is shorter
    /// than one maximum chunk, rounded up to whole pages so that a page-aligned chunk stays page-aligned in
    /// the segment.
    pub fn tail_room(&self) -> usize {
        (self.params.max_size as usize).next_multiple_of(PAGE)
    }

    /// [`Chunker::step`] for a segment that another thread has read into: `buf[new]` holds the input's
    /// next bytes (`eof`: the last of them), after at least [`Chunker::tail_room`] bytes, where the previous
    /// segment's unfinished tail is copied, right in front of them. The cut points are those of
    /// [`Chunker::step`]: they never depend on where segments end. A page-aligned chunk lands on the
    /// segment's page boundaries (see [`SegBuf`]) when every segment but the last brings the same whole
    /// number of pages and `new.start` is a whole number of pages.
    pub fn step_read(
        &mut self,
        mut buf: SegBuf,
        new: Range<usize>,
        eof: bool,
        emit: &mut dyn FnMut(Piece) -> bool,
    ) -> std::io::Result<()> {
        let mut start = new.start;
        if let Some((seg, tail)) = self.prev.take() {
            if tail.len() > start {
                self.done = true;
                let _ = self.home.send(buf);
                return Err(std::io::Error::other(format!(
                    "an unfinished chunk of {} bytes does not fit in front of the segment's {start}",
                    tail.len()
                )));
            }
            start -= tail.len();
            buf[start..new.start].copy_from_slice(&seg.buf[tail]);
        }
        let seg = Arc::new(Segment {
            buf,
            home: self.home.clone(),
        });
        self.cut(seg, start..new.end, eof, emit);
        Ok(())
    }

    /// Cuts a whole input held in memory (a small image received over a pipe): the same cut points as
    /// reading it from a file, without a pooled segment. The buffer is freed with its last chunk.
    pub fn cut_owned(
        data: Vec<u8>,
        params: ChunkParams,
        hints: Option<&'h Hints>,
        pages: bool,
        emit: &mut dyn FnMut(Piece) -> bool,
    ) -> u64 {
        // Nobody takes buffers back from this channel: the segment is dropped with its last piece.
        let (home, _) = crossbeam_channel::bounded(1);
        let mut chunker = Chunker {
            reader: std::io::empty(),
            params,
            hints,
            pages,
            home: home.clone(),
            prev: None,
            index: 0,
            offset: 0,
            done: false,
        };
        let filled = data.len();
        chunker.cut(
            Arc::new(Segment {
                buf: SegBuf::from_vec(data),
                home,
            }),
            0..filled,
            true,
            emit,
        );
        chunker.offset
    }
}

impl<R> Chunker<'_, R> {
    /// The length of a chunk cut `len` bytes after the current offset, when cutting at pages moved to
    /// the page boundary before its end, or after it where that would make it shorter than `min` (and
    /// `avail`, the bytes at hand, and the maximum allow); else left as it is.
    fn on_page(&self, len: usize, min: usize, avail: usize) -> usize {
        if !self.pages {
            return len;
        }
        let end = self.offset + len as u64;
        let down = (end - end % PAGE as u64).saturating_sub(self.offset) as usize;
        if down >= min.max(1) {
            return down;
        }
        let up = down + PAGE;
        if up >= min && up <= avail && up <= self.params.max_size as usize {
            up
        } else {
            len
        }
    }

    /// Emits every chunk of `seg[input]` whose end is known, keeping the unfinished tail for the next
    /// segment unless `eof`.
    fn cut(
        &mut self,
        seg: Arc<Segment>,
        input: Range<usize>,
        eof: bool,
        emit: &mut dyn FnMut(Piece) -> bool,
    ) {
        let (min, max) = (self.params.min_size as usize, self.params.max_size as usize);
        let base = input.start;
        let filled = input.len();
        let data = &seg.buf[input];
        let masks = self.params.masks();
        let mut pos = 0;
        while pos < filled {
            let remaining = filled - pos;
            // Not at the end of the file: keep the last partial window for the next segment, where the
            // chunker sees what follows it (a cut here would depend on where segments happen to end).
            if !eof && remaining < max {
                break;
            }
            let mut known = Known::Nothing;
            let mut end = 0;
            // Zero runs are common in memory images. A run of at least `min` zero bytes becomes a chunk of its
            // own, up to `max`, cut exactly where the data starts: no rolling hash over it, nothing stored,
            // and the data after it starts a chunk (so it deduplicates wherever the run ends). Like CDC, this
            // depends only on the content from `pos` on.
            let zeros = zero_prefix_len(&data[pos..pos + remaining.min(max)]);
            if zeros >= min {
                known = Known::Zero;
                end = pos + self.on_page(zeros, min, zeros);
            } else if let Some(hints) = self.hints {
                if let Some(hint) = hints.at.get(&self.offset) {
                    let hend = pos + hint.len as usize;
                    if hend <= filled {
                        let candidate = &data[pos..hend];
                        let speculate = !hints.mismatch.load(std::sync::atomic::Ordering::Relaxed);
                        let found = match hint.id {
                            None => is_zero(candidate).then_some(Known::Zero),
                            Some(old) if speculate => Some(Known::Expect(old)),
                            Some(old) => {
                                let id = ChunkId::of_large(candidate);
                                (id == old).then_some(Known::Id(id))
                            }
                        };
                        if let Some(k) = found {
                            known = k;
                            end = hend;
                        }
                    } else if !eof {
                        break; // let the next segment bring the rest of the candidate
                    }
                }
            }
            if known == Known::Nothing {
                let len = cdc_cut(&data[pos..filled], self.params, masks);
                // The end of the file ends the last chunk wherever it is.
                end = pos
                    + if pos + len == filled && eof {
                        len
                    } else {
                        self.on_page(len, min, filled - pos)
                    };
            }
            let piece = Piece {
                seg: seg.clone(),
                range: base + pos..base + end,
                index: self.index,
                offset: self.offset,
                known,
            };
            self.index += 1;
            self.offset += (end - pos) as u64;
            pos = end;
            if !emit(piece) {
                self.done = true;
                return;
            }
        }
        if eof {
            self.done = true;
        } else {
            self.prev = Some((seg, base + pos..base + filled));
        }
    }
}

/// Cuts everything `reader` yields into chunks and passes them, in order, to `emit` (one thread; tests and
/// simple callers). Stops early if `emit` returns `false`. Returns the number of bytes cut.
pub fn chunk_stream(
    reader: impl Read,
    params: ChunkParams,
    pool: &SegmentPool,
    hints: Option<&Hints>,
    mut emit: impl FnMut(Piece) -> bool,
) -> std::io::Result<u64> {
    let mut chunker = Chunker::new(reader, params, pool, hints)?;
    while !chunker.is_done() {
        chunker.step(pool.get(), &mut emit)?;
    }
    Ok(chunker.bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testdata::XorShift64;

    /// One byte per output (bits 24-31): the data these tests were tuned on, kept byte for byte.
    fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
        XorShift64::new(seed | 1)
            .take(n)
            .map(|x| (x >> 24) as u8)
            .collect()
    }

    fn cut(data: &[u8], params: ChunkParams, seg: usize) -> Vec<(u64, Vec<u8>)> {
        let pool = SegmentPool::new(3, seg);
        let mut out = Vec::new();
        chunk_stream(data, params, &pool, None, |p| {
            out.push((p.offset, p.data().to_vec()));
            true
        })
        .unwrap();
        out
    }

    const SMALL: ChunkParams = ChunkParams {
        min_size: 1024,
        avg_size: 4096,
        max_size: 16384,
    };

    #[test]
    fn chunks_cover_the_input_and_respect_limits() {
        let mut data = pseudo_random(300_000, 7);
        data[100_000..200_000].fill(0);
        let chunks = cut(&data, SMALL, 65536);
        let joined: Vec<u8> = chunks.iter().flat_map(|c| c.1.clone()).collect();
        assert_eq!(joined, data);
        for (i, (_, c)) in chunks.iter().enumerate() {
            assert!(c.len() <= 16384);
            if i + 1 < chunks.len() {
                assert!(c.len() >= 1024, "chunk {i} too small: {}", c.len());
            }
        }
    }

    /// A growing pool hands out its spare buffers instead of waiting, then waits like any other; buffers
    /// given back are reused.
    #[test]
    fn a_growing_pool_allocates_its_spares_before_it_waits() {
        let pool = SegmentPool::growing(1, 2, 4096);
        let held: Vec<SegBuf> = (0..3).map(|_| pool.get()).collect();
        assert!(held.iter().all(|b| b.len() == 4096));
        assert!(pool.try_get().is_none(), "three buffers at most");
        for b in held {
            pool.give.send(b).unwrap();
        }
        let again: Vec<SegBuf> = (0..3).map(|_| pool.get()).collect();
        assert_eq!(again.len(), 3);
        assert!(pool.try_get().is_none());
    }

    #[test]
    fn cut_points_do_not_depend_on_segment_size() {
        let data = pseudo_random(500_000, 3);
        let a = cut(&data, SMALL, 32768);
        let b = cut(&data, SMALL, 1 << 20);
        assert_eq!(a, b);
    }

    #[test]
    fn an_insertion_changes_only_nearby_chunks() {
        let data = pseudo_random(400_000, 11);
        let mut edited = data.clone();
        edited.splice(200_000..200_000, b"inserted bytes".iter().copied());
        let a: std::collections::HashSet<Vec<u8>> =
            cut(&data, SMALL, 65536).into_iter().map(|c| c.1).collect();
        let b: Vec<Vec<u8>> = cut(&edited, SMALL, 65536)
            .into_iter()
            .map(|c| c.1)
            .collect();
        let changed = b.iter().filter(|c| !a.contains(*c)).count();
        assert!(changed <= 3, "{changed} of {} chunks changed", b.len());
    }

    fn old_and_new() -> (Vec<u8>, Vec<u8>, Vec<ChunkRef>) {
        let mut old = pseudo_random(600_000, 21);
        old[100_000..180_000].fill(0);
        let refs = cut(&old, SMALL, 65536)
            .into_iter()
            .map(|(_, c)| ChunkRef {
                id: (!is_zero(&c)).then(|| ChunkId::of(&c)),
                len: c.len() as u32,
            })
            .collect();
        let mut new = old.clone();
        new[300_000..300_100].fill(9); // an in-place edit
        new.splice(450_000..450_000, [1u8, 2, 3]); // a shift
        new.extend_from_slice(&pseudo_random(50_000, 5)); // growth at the end
        (old, new, refs)
    }

    /// Chunks `data` with hints, playing the workers' part: a speculative chunk that does not match turns
    /// speculation off. Returns the chunks and how many were known without the rolling hash.
    fn cut_with(data: &[u8], hints: &Hints) -> (Vec<(u64, Vec<u8>)>, usize) {
        let pool = SegmentPool::new(3, 65536);
        let mut out = Vec::new();
        let mut known = 0;
        chunk_stream(data, SMALL, &pool, Some(hints), |p| {
            match p.known {
                Known::Expect(old) if ChunkId::of(p.data()) != old => hints
                    .mismatch
                    .store(true, std::sync::atomic::Ordering::Relaxed),
                Known::Nothing => {}
                _ => known += 1,
            }
            out.push((p.offset, p.data().to_vec()));
            true
        })
        .unwrap();
        (out, known)
    }

    /// Verified hints (after a mismatch) give exactly the chunks CDC gives.
    #[test]
    fn verified_hints_give_the_same_chunks_as_cdc() {
        let (_, new, refs) = old_and_new();
        let hints = Hints::new(&refs);
        hints
            .mismatch
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let (with, known) = cut_with(&new, &hints);
        // Up to a next-byte change at a boundary, which this data does not have.
        assert_eq!(with, cut(&new, SMALL, 65536));
        assert!(
            known * 3 > with.len(),
            "{known} of {} chunks hinted",
            with.len()
        );
    }

    /// Speculation reproduces unchanged data exactly, and after an edit costs at most the pieces cut
    /// before the mismatch was reported.
    #[test]
    fn speculative_hints_cost_little_when_wrong() {
        let (old, new, refs) = old_and_new();
        let hints = Hints::new(&refs);
        let (same, known) = cut_with(&old, &hints);
        assert_eq!(same, cut(&old, SMALL, 65536));
        assert_eq!(known, same.len() - 1, "all but the last chunk from hints");
        assert!(!hints.mismatch.load(std::sync::atomic::Ordering::Relaxed));

        let old_set: std::collections::HashSet<Vec<u8>> =
            cut(&old, SMALL, 65536).into_iter().map(|c| c.1).collect();
        let new_bytes = |chunks: &[(u64, Vec<u8>)]| -> usize {
            chunks
                .iter()
                .filter(|c| !old_set.contains(&c.1))
                .map(|c| c.1.len())
                .sum()
        };
        let hints = Hints::new(&refs);
        let (with, _) = cut_with(&new, &hints);
        let joined: Vec<u8> = with.iter().flat_map(|c| c.1.clone()).collect();
        assert_eq!(joined, new);
        let cdc_new = new_bytes(&cut(&new, SMALL, 65536));
        assert!(
            new_bytes(&with) <= cdc_new + 3 * 65536,
            "{} new bytes with speculation, {cdc_new} with CDC",
            new_bytes(&with)
        );
    }

    #[test]
    fn a_buffer_cut_in_memory_gives_the_chunks_of_a_stream() {
        let mut data = pseudo_random(300_000, 9);
        data[50_000..120_000].fill(0);
        let mut owned = Vec::new();
        let n = Chunker::<std::io::Empty>::cut_owned(data.clone(), SMALL, None, false, &mut |p| {
            owned.push((p.offset, p.data().to_vec()));
            true
        });
        assert_eq!(n, data.len() as u64);
        assert_eq!(owned, cut(&data, SMALL, 65536));
    }

    /// Random pages with a zero run that starts and ends inside pages, as a page image (4 KiB pages; SMALL
    /// chunks are 1-4 pages).
    fn page_image(pages: usize, seed: u64) -> Vec<u8> {
        let mut data = pseudo_random(pages * PAGE, seed);
        data[10 * PAGE + 100..20 * PAGE + 300].fill(0);
        data
    }

    fn cut_pages(data: &[u8], seg: usize) -> Vec<(u64, Vec<u8>)> {
        let pool = SegmentPool::new(3, seg);
        let mut chunker = Chunker::new(data, SMALL, &pool, None)
            .unwrap()
            .page_aligned(true);
        let mut out = Vec::new();
        while !chunker.is_done() {
            chunker
                .step(pool.get(), &mut |p| {
                    // A chunk on a page boundary lies HEADER_LEN past a page of its segment (where the
                    // store writes it from without a copy).
                    if p.offset % PAGE as u64 == 0 {
                        assert_eq!(
                            p.data().as_ptr() as usize % DIRECT_IO_ALIGN,
                            HEADER_LEN,
                            "chunk at {}",
                            p.offset
                        );
                    }
                    out.push((p.offset, p.data().to_vec()));
                    true
                })
                .unwrap();
        }
        out
    }

    /// Page images are cut on page boundaries only (the last chunk ends with the file), whatever the
    /// segment size and whether read from a stream or held in memory; plain files are not.
    #[test]
    fn a_page_image_is_cut_at_page_boundaries() {
        let data = page_image(300, 4);
        let chunks = cut_pages(&data, 65536);
        let joined: Vec<u8> = chunks.iter().flat_map(|c| c.1.clone()).collect();
        assert_eq!(joined, data);
        assert!(chunks.len() > 50, "{} chunks", chunks.len());
        for (offset, bytes) in &chunks[..chunks.len() - 1] {
            let end = offset + bytes.len() as u64;
            assert_eq!(end % PAGE as u64, 0, "a chunk ends at {end}");
            assert!(bytes.len() >= SMALL.min_size as usize);
            assert!(bytes.len() <= SMALL.max_size as usize);
        }
        assert_eq!(chunks, cut_pages(&data, 1 << 20));
        let mut owned = Vec::new();
        Chunker::<std::io::Empty>::cut_owned(data.clone(), SMALL, None, true, &mut |p| {
            owned.push((p.offset, p.data().to_vec()));
            true
        });
        assert_eq!(owned, chunks);
        // The same bytes as any other file: cut where the content says, off page boundaries.
        let plain = cut(&data, SMALL, 65536);
        assert!(plain[..plain.len() - 1]
            .iter()
            .any(|(o, b)| !(o + b.len() as u64).is_multiple_of(PAGE as u64)));
        assert!(is_page_image("pages-1.img") && is_page_image("sub/pages-12.img"));
        assert!(!is_page_image("pagemap-1.img") && !is_page_image("checkpoint.img"));
    }

    /// Cut at pages, an image with a page added in the middle still shares all but the chunks around it
    /// with the image before.
    #[test]
    fn page_aligned_chunks_survive_a_page_added() {
        let data = page_image(400, 8);
        let mut edited = data.clone();
        edited.splice(200 * PAGE..200 * PAGE, pseudo_random(PAGE, 99));
        let a: std::collections::HashSet<Vec<u8>> =
            cut_pages(&data, 65536).into_iter().map(|c| c.1).collect();
        let b: Vec<Vec<u8>> = cut_pages(&edited, 65536).into_iter().map(|c| c.1).collect();
        let changed = b.iter().filter(|c| !a.contains(*c)).count();
        assert!(changed <= 3, "{changed} of {} chunks changed", b.len());
    }

    #[test]
    fn empty_input_has_no_chunks() {
        assert!(cut(&[], SMALL, 65536).is_empty());
    }
}
