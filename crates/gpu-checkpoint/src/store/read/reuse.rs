//! Checking the chunks a checkpoint reuses instead of writing them (issue 13): the stored object must hold
//! exactly the bytes the ingest has just hashed to its name, and it is read again for that at every
//! re-checkpoint. A worker reads it on a helper thread while it hashes the piece ([`ReadAhead`]), so that the
//! read and the hash overlap.

use std::thread::Scope;

use crossbeam_channel::{Receiver, Sender};

use crate::store::backend::{ReadBackend, ReadObjects};
use crate::store::chunk::{ChunkId, Decoder, Encoder, HEADER_LEN, TRAILER_LEN};
use crate::store::error::Result;
use crate::util::AlignedBuf;

/// What the ingest found when it looked at a chunk it already has in the store.
pub(in crate::store) enum Reused {
    /// Not stored: write it.
    Missing,
    /// Stored and good; its stored size.
    Good(u64),
    /// Stored, but not as these bytes (damaged, truncated, unreadable): the problem. Write it again.
    Damaged(String),
}

/// The longest object a chunk of `len` raw bytes can have: the header, the payload (zstd is kept only when
/// smaller than the raw bytes) and a trailer.
fn max_object(len: usize) -> usize {
    HEADER_LEN + len + TRAILER_LEN
}

/// Judges chunk `id` before the ingest reuses it instead of writing it, from what
/// [`ReadObjects::read_object`] read of it into `buf`: its stored object must hold exactly `data`, the bytes the
/// ingest has just hashed to `id`. A header and size that look right are not enough (issue 13): the
/// checkpoint that references the chunk lets the tool stop the process, so every chunk it names must be
/// known good at that moment, and the ingest has the right bytes in hand to write a damaged one again.
///
/// A raw object is compared with `data` (it hashes to `id` already, so equal bytes are the proof); a
/// compressed one is proved by its checksum trailer (format version 2) without decompressing it, or, written
/// by an earlier build (version 1), decoded and compared ([`Decoder::check_reuse`]).
fn judge(
    read: Result<Option<usize>>,
    id: &ChunkId,
    data: &[u8],
    buf: &AlignedBuf,
    dec: &mut Decoder,
) -> Reused {
    match read {
        Ok(None) => Reused::Missing,
        Ok(Some(n)) if n > max_object(data.len()) => Reused::Damaged(format!(
            "damaged ({n} bytes, more than a chunk of {} bytes takes)",
            data.len()
        )),
        Ok(Some(n)) => match dec.check_reuse(id, buf.slice(n), data) {
            Ok(()) => Reused::Good(n as u64),
            Err(problem) => Reused::Damaged(problem),
        },
        Err(e) => Reused::Damaged(format!("unreadable ({e})")),
    }
}

/// A read for the helper: chunk, longest object wanted, and the buffer to read it into.
struct Request {
    id: ChunkId,
    max_len: usize,
    buf: AlignedBuf,
}

/// A read done: the chunk, the buffer back, and what [`ReadObjects::read_object`] returned.
struct Done {
    id: ChunkId,
    buf: AlignedBuf,
    read: Result<Option<usize>>,
}

/// One ingest worker's reader of the chunk it is about to check, on a helper thread of its own.
///
/// Why: a re-checkpoint of unchanged memory reads back about half of its logical size (the stored objects
/// of every reused chunk, cold: they were written with direct I/O). Read by the worker itself after the
/// hash, each read left the worker idle and each hash left the disk idle; an unchanged 2 GiB re-checkpoint
/// spent about as long waiting for its reads as computing (store_bench, docs/store.md). A piece cut at an
/// old chunk boundary is most likely that old chunk again: the worker starts reading the old chunk's object
/// ([`ReadAhead::start`]), hashes the piece meanwhile, and checks the object when the hash says it is the
/// chunk ([`ReadAhead::check`]). The object is read into the encoder's own buffer (lent to the helper and
/// given back), so reading ahead takes no memory beyond what the worker plan already counts.
///
/// The check itself is unchanged: every reused chunk is verified, from bytes read during this checkpoint,
/// before the checkpoint may reference it; a wrong guess costs one read, and the chunk is then read again.
pub(in crate::store) struct ReadAhead {
    /// `None` once the helper is gone (it panicked): the worker reads by itself from then on.
    requests: Option<Sender<Request>>,
    done: Receiver<Done>,
    /// A read is under way, and the encoder's buffer is out with it.
    pending: bool,
}

impl ReadAhead {
    /// Starts the helper thread in `scope`; it ends when the `ReadAhead` is dropped.
    pub(in crate::store) fn spawn<'scope>(
        scope: &'scope Scope<'scope, '_>,
        backend: &'scope dyn ReadBackend,
    ) -> ReadAhead {
        let (requests, incoming) = crossbeam_channel::bounded::<Request>(1);
        let (finished, done) = crossbeam_channel::bounded::<Done>(1);
        scope.spawn(move || {
            for Request {
                id,
                max_len,
                mut buf,
            } in incoming
            {
                let read = backend.read_object(&id, max_len, &mut buf);
                if finished.send(Done { id, buf, read }).is_err() {
                    break;
                }
            }
        });
        ReadAhead {
            requests: Some(requests),
            done,
            pending: false,
        }
    }

    /// Starts reading the stored object of chunk `expected` (the chunk a piece of `len` bytes is expected
    /// to be) into the encoder's buffer, while the caller hashes the piece. One read at a time: call
    /// [`ReadAhead::check`] or [`ReadAhead::settle`] before the next `start`, and before using the encoder.
    pub(in crate::store) fn start(&mut self, expected: ChunkId, len: usize, enc: &mut Encoder) {
        let Some(requests) = &self.requests else {
            return;
        };
        if self.pending {
            return;
        }
        let request = Request {
            id: expected,
            max_len: max_object(len),
            buf: enc.lend_object_buffer(),
        };
        match requests.send(request) {
            Ok(()) => self.pending = true,
            Err(e) => {
                enc.return_object_buffer(e.0.buf);
                self.requests = None;
            }
        }
    }

    /// Waits for the read under way, if any, and gives the encoder its buffer back: which chunk was read,
    /// and what the read returned.
    fn finish(&mut self, enc: &mut Encoder) -> Option<(ChunkId, Result<Option<usize>>)> {
        if !std::mem::take(&mut self.pending) {
            return None;
        }
        match self.done.recv() {
            Ok(Done { id, buf, read }) => {
                enc.return_object_buffer(buf);
                Some((id, read))
            }
            // The helper panicked, with the buffer (the encoder allocates another when it needs one).
            Err(_) => {
                self.requests = None;
                None
            }
        }
    }

    /// Drops the read under way (the piece turned out to need no check) and gives the encoder its buffer
    /// back.
    pub(in crate::store) fn settle(&mut self, enc: &mut Encoder) {
        self.finish(enc);
    }

    /// Checks chunk `id`, the hash of `data`, before the ingest reuses it (see [`judge`]): with the object
    /// read ahead if that was this chunk's, else read now (into the encoder's buffer; a cold object with
    /// direct I/O). Each chunk is checked once per ingest (the ingest's `seen` set lets only its first
    /// occurrence through).
    pub(in crate::store) fn check(
        &mut self,
        backend: &dyn ReadBackend,
        id: &ChunkId,
        data: &[u8],
        enc: &mut Encoder,
        dec: &mut Decoder,
    ) -> Reused {
        let read = match self.finish(enc) {
            Some((read, result)) if read == *id => result,
            _ => backend.read_object(id, max_object(data.len()), enc.object_buffer()),
        };
        judge(read, id, data, enc.object_buffer(), dec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::backend::{Backend, LocalBackend, Objects};

    /// A store with chunk objects of `raw` (stored raw) and `text` (compressed), written as the ingest
    /// writes them; their ids.
    fn stored(backend: &LocalBackend, enc: &mut Encoder, raw: &[u8], text: &[u8]) -> [ChunkId; 2] {
        backend.init().unwrap();
        [raw, text].map(|data| {
            let id = ChunkId::of(data);
            let (_, object) = enc.encode_object(&id, data);
            backend.put_chunk_object(&id, object).unwrap();
            id
        })
    }

    fn flip_last_byte(backend: &LocalBackend, id: &ChunkId) {
        let path = backend.local_chunk_file(id).unwrap();
        let mut b = std::fs::read(&path).unwrap();
        let n = b.len();
        b[n - 1] ^= 1;
        std::fs::write(&path, b).unwrap();
    }

    #[test]
    fn a_chunk_read_ahead_is_checked_and_damage_is_found() {
        let t = tempfile::tempdir().unwrap();
        let backend = LocalBackend::with_direct_io(&t.path().join("store"), true);
        let max = 1 << 20;
        let (mut enc, mut dec) = (
            Encoder::new(Some(1), max).unwrap(),
            Decoder::new(0).unwrap(),
        );
        let mut raw = vec![0u8; 300_000];
        crate::testdata::XorShift64::new(3).fill_bytes(&mut raw);
        let text: Vec<u8> = (0..300_000u32).map(|i| (i % 7) as u8 + b'a').collect();
        let [raw_id, text_id] = stored(&backend, &mut enc, &raw, &text);
        let buf_at = |enc: &mut Encoder| enc.object_buffer().slice(1).as_ptr();
        let home = buf_at(&mut enc);
        std::thread::scope(|s| {
            let mut ahead = ReadAhead::spawn(s, &backend);
            let mut check = |expected: ChunkId, id: ChunkId, data: &[u8]| {
                ahead.start(expected, data.len(), &mut enc);
                let r = ahead.check(&backend, &id, data, &mut enc, &mut dec);
                assert_eq!(
                    buf_at(&mut enc),
                    home,
                    "the encoder has its own buffer back"
                );
                r
            };
            for (id, data) in [(raw_id, &raw), (text_id, &text)] {
                let n = std::fs::metadata(backend.local_chunk_file(&id).unwrap())
                    .unwrap()
                    .len();
                assert!(matches!(check(id, id, data), Reused::Good(m) if m == n));
                // Guessed wrong: the chunk is read again, and found good all the same.
                let other = if id == raw_id { text_id } else { raw_id };
                assert!(matches!(check(other, id, data), Reused::Good(_)));
            }
            // A raw object is compared with the bytes in hand (a compressed one is proved by its trailer,
            // the bytes in hand by their hash, which the caller checked).
            let mut changed = raw.clone();
            changed[1000] ^= 1;
            assert!(matches!(
                check(raw_id, raw_id, &changed),
                Reused::Damaged(_)
            ));
            // A raw payload's last byte, a compressed object's trailer: both found through the read ahead.
            flip_last_byte(&backend, &raw_id);
            flip_last_byte(&backend, &text_id);
            assert!(
                matches!(check(raw_id, raw_id, &raw), Reused::Damaged(p) if p.contains("BLAKE3"))
            );
            assert!(
                matches!(check(text_id, text_id, &text), Reused::Damaged(p) if p.contains("trailer"))
            );
            let missing = ChunkId::of(b"not stored");
            assert!(matches!(
                check(missing, missing, b"not stored"),
                Reused::Missing
            ));
            // A read no longer needed gives the buffer back too.
            ahead.start(raw_id, raw.len(), &mut enc);
            ahead.settle(&mut enc);
            assert_eq!(buf_at(&mut enc), home);
        });
    }
}
