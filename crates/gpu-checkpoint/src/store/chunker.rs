//! Content-defined chunking of one file into a stream of chunks, with bounded memory.
//!
//! The file is read into large pooled segments; FastCDC (v2020) finds cut points inside a segment and every
//! chunk is handed on as a reference into it (no copy). Only the unfinished tail of a segment (less than one
//! maximum chunk) is copied to the start of the next. Segments come from a fixed pool and go back to it when
//! the last chunk referencing them is done, so the pool size bounds the memory of the whole pipeline and a
//! slow consumer blocks the reader (backpressure) instead of growing a queue.

use std::io::Read;
use std::ops::Range;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use super::chunk::is_zero;

/// FastCDC sizes. Page images are cut into chunks of about `avg_size`; see `docs/store.md` for how these
/// were chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkParams {
    pub min_size: u32,
    pub avg_size: u32,
    pub max_size: u32,
}

impl Default for ChunkParams {
    fn default() -> Self {
        ChunkParams {
            min_size: 512 * 1024,
            avg_size: 2 * 1024 * 1024,
            max_size: 4 * 1024 * 1024,
        }
    }
}

impl ChunkParams {
    /// Checks the limits FastCDC v2020 supports (it only debug-asserts them).
    pub fn validate(&self) -> Result<(), String> {
        use fastcdc::v2020::{
            AVERAGE_MAX, AVERAGE_MIN, MAXIMUM_MAX, MAXIMUM_MIN, MINIMUM_MAX, MINIMUM_MIN,
        };
        let (min, avg, max) = (
            self.min_size as usize,
            self.avg_size as usize,
            self.max_size as usize,
        );
        let ok = (MINIMUM_MIN..=MINIMUM_MAX).contains(&min)
            && (AVERAGE_MIN..=AVERAGE_MAX).contains(&avg)
            && (MAXIMUM_MIN..=MAXIMUM_MAX).contains(&max)
            && min <= avg
            && avg <= max
            && min % 2 == 0
            && avg % 2 == 0
            && max % 2 == 0;
        if ok {
            Ok(())
        } else {
            Err(format!("unsupported chunk sizes {self:?}"))
        }
    }
}

/// A pooled read buffer; returns itself to the pool when the last chunk referencing it is dropped.
pub struct Segment {
    buf: Vec<u8>,
    home: Sender<Vec<u8>>,
}

impl Drop for Segment {
    fn drop(&mut self) {
        // The pool outlives every segment except during teardown, when losing the buffer is fine.
        let _ = self.home.send(std::mem::take(&mut self.buf));
    }
}

/// A fixed set of segment buffers.
pub struct SegmentPool {
    give: Sender<Vec<u8>>,
    take: Receiver<Vec<u8>>,
    size: usize,
}

impl SegmentPool {
    /// `count` buffers of `size` bytes, allocated (and touched) once.
    pub fn new(count: usize, size: usize) -> SegmentPool {
        let (give, take) = crossbeam_channel::bounded(count);
        for _ in 0..count {
            give.send(vec![0u8; size]).expect("pool has room");
        }
        SegmentPool { give, take, size }
    }

    fn get(&self) -> Vec<u8> {
        // Cannot fail: we hold a sender ourselves.
        self.take.recv().expect("pool sender alive")
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
}

impl Piece {
    pub fn data(&self) -> &[u8] {
        &self.seg.buf[self.range.clone()]
    }
}

/// Cuts everything `reader` yields into chunks and passes them, in order, to `emit`. Stops early (returning
/// `Ok`) if `emit` returns `false`. Returns the number of bytes read.
pub fn chunk_stream(
    mut reader: impl Read,
    params: ChunkParams,
    pool: &SegmentPool,
    mut emit: impl FnMut(Piece) -> bool,
) -> std::io::Result<u64> {
    let (min, avg, max) = (
        params.min_size as usize,
        params.avg_size as usize,
        params.max_size as usize,
    );
    let mut prev: Option<(Arc<Segment>, Range<usize>)> = None;
    let mut index = 0usize;
    let mut offset = 0u64;
    loop {
        let mut buf = pool.get();
        let mut filled = 0;
        if let Some((seg, tail)) = prev.take() {
            buf[..tail.len()].copy_from_slice(&seg.buf[tail.clone()]);
            filled = tail.len();
        }
        let mut eof = false;
        while filled < pool.size {
            match reader.read(&mut buf[filled..]) {
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = pool.give.send(buf);
                    return Err(e);
                }
            }
        }
        let seg = Arc::new(Segment {
            buf,
            home: pool.give.clone(),
        });
        let data = &seg.buf[..filled];
        let cdc = fastcdc::v2020::FastCDC::new(data, min, avg, max);
        let mut pos = 0;
        while pos < filled {
            let remaining = filled - pos;
            // Not at the end of the file: keep the last partial window for the next segment, where the
            // chunker sees what follows it (a cut here would depend on where segments happen to end).
            if !eof && remaining < max {
                break;
            }
            // Zero runs are common in memory images; a whole maximum-size window of zeros becomes one chunk
            // without running the rolling hash over it. Deterministic in the content, so dedup still works.
            let end = if remaining >= max && is_zero(&data[pos..pos + max]) {
                pos + max
            } else {
                cdc.cut(pos, remaining).1
            };
            let piece = Piece {
                seg: seg.clone(),
                range: pos..end,
                index,
                offset,
            };
            index += 1;
            offset += (end - pos) as u64;
            pos = end;
            if !emit(piece) {
                return Ok(offset);
            }
        }
        if eof {
            return Ok(offset);
        }
        prev = Some((seg, pos..filled));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    fn cut(data: &[u8], params: ChunkParams, seg: usize) -> Vec<(u64, Vec<u8>)> {
        let pool = SegmentPool::new(3, seg);
        let mut out = Vec::new();
        chunk_stream(data, params, &pool, |p| {
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

    #[test]
    fn empty_input_has_no_chunks() {
        assert!(cut(&[], SMALL, 65536).is_empty());
    }
}
