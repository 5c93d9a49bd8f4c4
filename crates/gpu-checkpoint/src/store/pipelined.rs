//! Reading and cutting one stream on two threads: the caller's thread reads the input into pooled segments
//! while a second one cuts the segment read before.
//!
//! Why: one streamed page image is one pipe, and reading it (the kernel's copy out of CRIU's pipe, 60-65%
//! of the thread that did both) and FastCDC (15-20%) ran one after the other on one thread, the one part
//! of a checkpoint's ingest that did not grow with the cores (`docs/criu.md`, "What bounds the checkpoint's
//! ingest"). Overlapped, a stream goes at the pace of the slower of the two.
//!
//! The reader fills each segment after [`Chunker::tail_room`] bytes, always with the same whole number of
//! pages (fewer only at the end of the input), and the cutter copies the previous segment's unfinished
//! tail in front of them: the cut points are those of one thread ([`Chunker::step`]), and page-aligned
//! chunks stay on page boundaries of their segment for the direct-I/O writes. Segments come from the pool
//! and are handed over one at a time (a stream holds the one being read and the one being cut), so a slow
//! consumer still blocks the reader.

use std::io::{ErrorKind, Read};
use std::sync::atomic::{AtomicBool, Ordering};

use super::chunker::{Chunker, Piece, SegBuf, SegmentPool, PAGE};

/// A segment the reader filled: its buffer, how many bytes it read after the tail room, whether the input
/// ended there.
struct Filled {
    buf: SegBuf,
    len: usize,
    eof: bool,
}

/// Cuts everything `reader` yields with `chunker` (made with an empty reader: `reader` is read here),
/// reading the next segment on the calling thread while a scoped thread cuts the previous one and passes
/// its chunks, in order, to `emit`. Stops, on both threads, when `emit` returns `false`, when `stop`
/// returns `true` (checked after each read) or on an error, which it returns; every segment not handed
/// on as a chunk goes back to `pool`. Returns the number of bytes cut.
pub fn chunk_pipelined(
    mut chunker: Chunker<'_, std::io::Empty>,
    reader: &mut dyn Read,
    pool: &SegmentPool,
    stop: &dyn Fn() -> bool,
    emit: &mut (dyn FnMut(Piece) -> bool + Send),
) -> std::io::Result<u64> {
    let room = chunker.tail_room();
    // Tested once on the first segment: every segment of the pool has the same size.
    let first = pool.get();
    let per_segment = (first.len().saturating_sub(room) / PAGE) * PAGE;
    if per_segment == 0 {
        let size = first.len();
        pool.put(first);
        return Err(std::io::Error::other(format!(
            "segment size {size} leaves no whole page after {room} bytes for a chunk's tail"
        )));
    }
    let halted = AtomicBool::new(false);
    let (tx, rx) = crossbeam_channel::bounded::<Filled>(0);
    std::thread::scope(|s| {
        let cutter = s.spawn(|| {
            let result = (|| {
                for f in rx.iter() {
                    chunker.step_read(f.buf, room..room + f.len, f.eof, emit)?;
                    if chunker.is_done() {
                        break;
                    }
                }
                Ok(chunker.bytes())
            })();
            // Tells the reader to stop at its next read instead of filling a segment nobody will cut.
            halted.store(true, Ordering::Relaxed);
            drop(rx);
            result
        });
        let stopped = || stop() || halted.load(Ordering::Relaxed);
        let mut next = Some(first);
        let read = loop {
            let mut buf = next.take().unwrap_or_else(|| pool.get());
            let filled = fill(reader, &mut buf[room..room + per_segment], &stopped);
            let (len, eof) = match filled {
                Ok(Some(got)) => got,
                Ok(None) => {
                    pool.put(buf);
                    break Ok(());
                }
                Err(e) => {
                    pool.put(buf);
                    break Err(e);
                }
            };
            if let Err(back) = tx.send(Filled { buf, len, eof }) {
                pool.put(back.into_inner().buf);
                break Ok(());
            }
            if eof {
                break Ok(());
            }
        };
        drop(tx);
        let cut = cutter
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("the chunker's thread panicked")));
        read.and(cut)
    })
}

/// Reads into `buf` until it is full or the input ends: `Some((bytes read, whether it ended))`, or `None`
/// once `stopped` says to give up.
fn fill(
    reader: &mut dyn Read,
    buf: &mut [u8],
    stopped: &dyn Fn() -> bool,
) -> std::io::Result<Option<(usize, bool)>> {
    let mut filled = 0;
    while filled < buf.len() {
        if stopped() {
            return Ok(None);
        }
        match reader.read(&mut buf[filled..]) {
            Ok(0) => return Ok(Some((filled, true))),
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Some((filled, false)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::chunk::{is_zero, ChunkId, HEADER_LEN};
    use crate::store::chunker::{ChunkParams, Hints};
    use crate::store::manifest::ChunkRef;
    use crate::testdata::{random_bytes, XorShift64};
    use crate::util::DIRECT_IO_ALIGN;

    /// Chunks of 1-4 pages, so that a few hundred pages make dozens of chunks and of segments.
    const SMALL: ChunkParams = ChunkParams {
        min_size: 1024,
        avg_size: 4096,
        max_size: 16384,
    };
    /// 48 KiB of new data a segment after the tail room, about a dozen pages.
    const SEGMENT: usize = 64 << 10;

    /// A reader that hands out `data` in reads of 1 to 5,000 bytes (as a pipe does, off page boundaries),
    /// and fails with "pipe broke" once `fail_at` bytes are read.
    struct ShortReads<'d> {
        data: &'d [u8],
        pos: usize,
        sizes: XorShift64,
        fail_at: Option<usize>,
    }

    impl<'d> ShortReads<'d> {
        fn new(data: &'d [u8]) -> Self {
            ShortReads {
                data,
                pos: 0,
                sizes: XorShift64::from_seed(17),
                fail_at: None,
            }
        }
    }

    impl Read for ShortReads<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.fail_at.is_some_and(|at| self.pos >= at) {
                return Err(std::io::Error::other("pipe broke"));
            }
            let n = (1 + self.sizes.next_u64() as usize % 5000)
                .min(buf.len())
                .min(self.data.len() - self.pos);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }

    /// Random pages with zero runs that start and end inside pages.
    fn page_image(pages: usize) -> Vec<u8> {
        let mut data = random_bytes(pages * PAGE, 5);
        data[10 * PAGE + 100..20 * PAGE + 300].fill(0);
        data[pages / 2 * PAGE + 7..(pages / 2 + 39) * PAGE].fill(0);
        data
    }

    type Chunks = Vec<(u64, Vec<u8>)>;

    /// Records a piece, checking that a chunk on a page boundary of a page image lies HEADER_LEN past a
    /// page of its segment (where the store writes it from without a copy).
    fn record(out: &mut Chunks, p: &Piece, pages: bool) {
        if pages && p.offset.is_multiple_of(PAGE as u64) {
            let at = p.data().as_ptr() as usize % DIRECT_IO_ALIGN;
            assert_eq!(at, HEADER_LEN, "chunk at {}", p.offset);
        }
        out.push((p.offset, p.data().to_vec()));
    }

    fn serial(data: &[u8], pages: bool, hints: Option<&Hints>) -> Chunks {
        let pool = SegmentPool::new(3, SEGMENT);
        let mut chunker = Chunker::new(data, SMALL, &pool, hints)
            .unwrap()
            .page_aligned(pages);
        let mut out = Vec::new();
        while !chunker.is_done() {
            let emit = &mut |p: Piece| {
                record(&mut out, &p, pages);
                true
            };
            chunker.step(pool.get(), emit).unwrap();
        }
        out
    }

    /// Runs the pipelined path over `reader` with a pool of three segments, emitting until `emit_max`
    /// chunks; returns its result, the chunks, and how many of the pool's segments came back.
    fn pipelined(
        reader: &mut dyn Read,
        pages: bool,
        hints: Option<&Hints>,
        stop: &dyn Fn() -> bool,
        emit_max: usize,
    ) -> (std::io::Result<u64>, Chunks, usize) {
        let pool = SegmentPool::new(3, SEGMENT);
        let chunker = Chunker::new(std::io::empty(), SMALL, &pool, hints)
            .unwrap()
            .page_aligned(pages);
        let mut out = Vec::new();
        let emit = &mut |p: Piece| {
            record(&mut out, &p, pages);
            out.len() < emit_max
        };
        let result = chunk_pipelined(chunker, reader, &pool, stop, emit);
        let back = std::iter::from_fn(|| pool.try_get()).count();
        (result, out, back)
    }

    /// The same chunks as one thread, read in short reads over dozens of segments: page images and plain
    /// files, with and without (verified) hints from an earlier version; every segment back in the pool.
    #[test]
    fn two_threads_cut_like_one() {
        let data = page_image(600);
        assert!(data.len() > 30 * SEGMENT);
        let mut old = data.clone();
        old[200 * PAGE..201 * PAGE].fill(3);
        let refs: Vec<ChunkRef> = serial(&old, true, None)
            .into_iter()
            .map(|(_, c)| ChunkRef {
                id: (!is_zero(&c)).then(|| ChunkId::of(&c)),
                len: c.len() as u32,
            })
            .collect();
        let hints = Hints::new(&refs);
        hints.mismatch.store(true, Ordering::Relaxed);
        for (pages, hints) in [(true, None), (false, None), (true, Some(&hints))] {
            let want = serial(&data, pages, hints);
            assert!(want.len() > 100, "{} chunks", want.len());
            let mut reader = ShortReads::new(&data);
            let (result, got, back) = pipelined(&mut reader, pages, hints, &|| false, usize::MAX);
            assert_eq!(result.unwrap(), data.len() as u64);
            assert!(got == want, "pages {pages}, hints {}", hints.is_some());
            assert_eq!(back, 3, "segments back in the pool");
        }
    }

    /// A read error in the middle of the input is what the call returns; the chunks before it are cut,
    /// and every segment goes back to the pool.
    #[test]
    fn a_read_error_mid_stream_is_returned() {
        let data = page_image(300);
        let mut reader = ShortReads::new(&data);
        reader.fail_at = Some(150 * PAGE);
        let (result, got, back) = pipelined(&mut reader, true, None, &|| false, usize::MAX);
        let e = result.unwrap_err();
        assert_eq!(e.to_string(), "pipe broke");
        assert!(!got.is_empty(), "the chunks before the error were cut");
        assert!(got.iter().all(|(o, c)| *o as usize + c.len() <= 150 * PAGE));
        assert_eq!(back, 3);
    }

    /// When the consumer stops taking chunks (a failed session) or `stop` says so, the reader stops too,
    /// well before the end of the input.
    #[test]
    fn a_stop_on_either_side_stops_both() {
        let data = page_image(2000);
        let mut reader = ShortReads::new(&data);
        let (result, got, back) = pipelined(&mut reader, true, None, &|| false, 1);
        assert!(result.is_ok());
        assert_eq!(got.len(), 1);
        assert!(reader.pos <= 3 * SEGMENT, "read {} bytes", reader.pos);
        assert_eq!(back, 3);

        let reads = std::cell::Cell::new(0);
        let stop = || {
            reads.set(reads.get() + 1);
            reads.get() > 100
        };
        let mut reader = ShortReads::new(&data);
        let (result, _, back) = pipelined(&mut reader, true, None, &stop, usize::MAX);
        assert!(result.unwrap() < data.len() as u64);
        assert!(reader.pos <= 100 * 5000, "read {} bytes", reader.pos);
        assert_eq!(back, 3);
    }
}
