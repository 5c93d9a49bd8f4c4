//! The chunk object format: a 16-byte header, then the payload (zstd frame or raw bytes), then in format
//! version 2 a 32-byte trailer.
//!
//! ```text
//! offset size field
//!      0    4 magic "GCKC"
//!      4    1 format version (1 or 2)
//!      5    1 encoding: 0 = raw, 1 = zstd
//!      6    2 reserved, 0
//!      8    4 raw length (little endian): the chunk's uncompressed size
//!     12    4 payload length (little endian): bytes after the header (before the trailer)
//!     16    n payload
//!   16+n   32 version 2 only: trailer, BLAKE3 keyed with the chunk's name (its 32 bytes) of header and payload
//! ```
//! A chunk is named by the BLAKE3 hash of its *raw* bytes, so decoding it and hashing the result proves every
//! byte; the payload length in the header makes truncation detectable without decompressing.
//!
//! The trailer proves the stored object is the one written for this name, without decompressing it: a
//! re-checkpoint checks every compressed chunk it reuses by hashing the stored bytes (see
//! [`Decoder::check_reuse`]). Keyed with the name, so that another chunk's intact object in its place does not
//! pass. Writers use version 2 for zstd objects and version 1 for raw ones (a raw payload is compared with
//! the bytes in hand, which costs less than hashing it); readers accept both, for either encoding.

use std::fmt;

use crate::util::{AlignedBuf, DIRECT_IO_ALIGN};

/// How a chunk whose bytes do not hash to its name is described in errors.
pub(crate) const HASH_MISMATCH: &str = "damaged (content does not match its BLAKE3 name)";

/// How a version 2 object whose trailer does not match is described in errors.
pub(crate) const TRAILER_MISMATCH: &str =
    "damaged (stored object does not match its checksum trailer)";

/// Size of the fixed header in front of every stored chunk.
pub const HEADER_LEN: usize = 16;
/// Size of the checksum trailer after the payload of a format version 2 object.
pub const TRAILER_LEN: usize = 32;
const MAGIC: &[u8; 4] = b"GCKC";
/// Format version of an object without a trailer (earlier builds wrote only these).
const VERSION_PLAIN: u8 = 1;
/// Format version of an object with a checksum trailer.
const VERSION_TRAILER: u8 = 2;

/// How a chunk's payload is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    /// Stored as is: compression would not have saved enough to pay for decompressing it.
    Raw = 0,
    Zstd = 1,
}

/// A chunk's name: the BLAKE3 hash of its raw content.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    pub fn of(data: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(data).as_bytes())
    }

    /// The same hash, computed with all cores (BLAKE3 is a tree): for a thread that would otherwise be the
    /// pipeline's bottleneck.
    pub fn of_large(data: &[u8]) -> ChunkId {
        if data.len() < 256 * 1024 {
            return ChunkId::of(data);
        }
        ChunkId(
            *blake3::Hasher::new()
                .update_rayon(data)
                .finalize()
                .as_bytes(),
        )
    }

    /// 64 lowercase hex digits (BLAKE3's own writing of a hash).
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// 64 hex digits, either case.
    pub fn from_hex(s: &str) -> Option<ChunkId> {
        blake3::Hash::from_hex(s)
            .ok()
            .map(|h| ChunkId(*h.as_bytes()))
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", &self.to_hex()[..16])
    }
}

// Chunk ids appear in manifests as lowercase hex strings.
impl serde::Serialize for ChunkId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for ChunkId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ChunkId, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        ChunkId::from_hex(&s).ok_or_else(|| {
            serde::de::Error::custom(format!("bad chunk id {s:?} (want 64 hex digits)"))
        })
    }
}

/// The parsed fixed header of a stored chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub encoding: Encoding,
    pub raw_len: u32,
    pub payload_len: u32,
    /// Format version 2: a checksum trailer follows the payload.
    pub trailer: bool,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(MAGIC);
        h[4] = if self.trailer {
            VERSION_TRAILER
        } else {
            VERSION_PLAIN
        };
        h[5] = self.encoding as u8;
        h[8..12].copy_from_slice(&self.raw_len.to_le_bytes());
        h[12..16].copy_from_slice(&self.payload_len.to_le_bytes());
        h
    }

    /// Parses a header; the error says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<Header, String> {
        if bytes.len() < HEADER_LEN {
            return Err(format!(
                "truncated ({} bytes, shorter than the {HEADER_LEN}-byte header)",
                bytes.len()
            ));
        }
        if &bytes[..4] != MAGIC {
            return Err("not a chunk (bad magic)".into());
        }
        let trailer = match bytes[4] {
            VERSION_PLAIN => false,
            VERSION_TRAILER => true,
            v => return Err(format!("of unsupported chunk format version {v}")),
        };
        let encoding = match bytes[5] {
            0 => Encoding::Raw,
            1 => Encoding::Zstd,
            e => return Err(format!("of unknown encoding {e}")),
        };
        let raw_len = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        let payload_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes"));
        if encoding == Encoding::Raw && raw_len != payload_len {
            return Err("damaged (raw chunk with mismatched lengths)".into());
        }
        Ok(Header {
            encoding,
            raw_len,
            payload_len,
            trailer,
        })
    }

    /// Total size of the stored object.
    pub fn stored_len(&self) -> u64 {
        HEADER_LEN as u64 + self.payload_len as u64 + self.trailer_len() as u64
    }

    fn trailer_len(&self) -> usize {
        if self.trailer {
            TRAILER_LEN
        } else {
            0
        }
    }

    fn raw(len: usize) -> Header {
        Header {
            encoding: Encoding::Raw,
            raw_len: len as u32,
            payload_len: len as u32,
            trailer: false,
        }
    }

    fn zstd(raw_len: usize, payload_len: usize) -> Header {
        Header {
            encoding: Encoding::Zstd,
            raw_len: raw_len as u32,
            payload_len: payload_len as u32,
            trailer: true,
        }
    }
}

/// The trailer of chunk `id`'s version 2 object: BLAKE3 keyed with the name, of `head_and_payload` (the
/// object without its trailer).
fn trailer_of(id: &ChunkId, head_and_payload: &[u8]) -> [u8; TRAILER_LEN] {
    *blake3::keyed_hash(&id.0, head_and_payload).as_bytes()
}

/// Checks a whole stored object's length against its header and, in format version 2, its trailer against
/// `id`; returns the header. The payload is `stored[HEADER_LEN..][..payload_len]`. The error describes the
/// damage.
fn check_object(id: Option<&ChunkId>, stored: &[u8]) -> Result<Header, String> {
    let header = Header::decode(stored)?;
    let want = header.stored_len();
    if stored.len() as u64 != want {
        let after = stored.len().saturating_sub(HEADER_LEN);
        let what = if header.trailer {
            "payload and trailer"
        } else {
            "payload"
        };
        return Err(if (stored.len() as u64) < want {
            format!(
                "truncated ({after} of {} {what} bytes)",
                want - HEADER_LEN as u64
            )
        } else {
            format!("damaged ({} bytes, its header says {want})", stored.len())
        });
    }
    if let (Some(id), true) = (id, header.trailer) {
        let end = stored.len() - TRAILER_LEN;
        if trailer_of(id, &stored[..end])[..] != stored[end..] {
            return Err(TRAILER_MISMATCH.into());
        }
    }
    Ok(header)
}

/// Checks chunk `id`'s whole stored object without decompressing it: a raw payload by its hash, a zstd
/// payload by its checksum trailer (format version 2). `Ok(false)`: it cannot be proved that way (zstd in
/// version 1, written by an earlier build). The local read cache takes only objects proved so.
pub fn check_without_decoding(id: &ChunkId, stored: &[u8]) -> Result<bool, String> {
    let header = check_object(Some(id), stored)?;
    match header.encoding {
        Encoding::Raw => {
            let payload = &stored[HEADER_LEN..HEADER_LEN + header.payload_len as usize];
            if ChunkId::of(payload) != *id {
                return Err(HASH_MISMATCH.into());
            }
            Ok(true)
        }
        Encoding::Zstd => Ok(header.trailer),
    }
}

/// A chunk's stored object as [`Encoder::encode_parts`] hands it to the backend.
pub enum ObjectParts<'a> {
    /// The whole object in one page-aligned buffer.
    Whole(&'a [u8]),
    /// The object in three consecutive parts: its first block (page-aligned), whole blocks (page-aligned
    /// memory, possibly none), and the rest (less than a block, possibly empty).
    Blocks([&'a [u8]; 3]),
}

impl ObjectParts<'_> {
    /// The parts in order.
    pub fn parts(&self) -> &[&[u8]] {
        match self {
            ObjectParts::Whole(o) => std::slice::from_ref(o),
            ObjectParts::Blocks(p) => p,
        }
    }
}

/// Reusable per-thread compression state, so that contexts and buffers are allocated once per worker and
/// not once per chunk (fresh memory is slow to touch on the machines this runs on).
pub struct Encoder {
    /// `None`: compression is off for this store's new chunks, every chunk is stored raw.
    compressor: Option<zstd::bulk::Compressor<'static>>,
    /// The chunk object being built: header room, then the zstd frame (or, for
    /// [`Encoder::encode_object`], a raw chunk's copy). Page-aligned for direct I/O.
    obj: AlignedBuf,
    max_chunk: usize,
    predictor: Predictor,
}

impl Encoder {
    /// `level`: the zstd level, or `None` to store every chunk raw (the fastest ingest and restore).
    pub fn new(level: Option<i32>, max_chunk: usize) -> std::io::Result<Encoder> {
        let compressor = match level {
            None => None,
            Some(level) => {
                let mut c = zstd::bulk::Compressor::new(level)?;
                tune(&mut c, max_chunk)?;
                Some(c)
            }
        };
        Ok(Encoder {
            compressor,
            obj: AlignedBuf::new(),
            max_chunk,
            predictor: Predictor::default(),
        })
    }

    /// Encodes chunk `id` (the name of `raw`): returns its header and the rest of its stored object (the
    /// zstd frame and its trailer in the encoder's buffer, or `raw`).
    ///
    /// Chunks are stored raw unless zstd saves at least 1/32 of them: a chunk that barely compresses costs
    /// decompression time on every restore for almost no space. A chunk the `Predictor` finds random
    /// (encrypted or compressed data) is stored raw without running zstd; otherwise zstd's output buffer is
    /// capped at the limit, so zstd gives up early on whatever the predictor let through.
    pub fn encode<'a>(&'a mut self, id: &ChunkId, raw: &'a [u8]) -> (Header, &'a [u8]) {
        match self.compress(raw) {
            Some(n) => {
                let header = Header::zstd(raw.len(), n);
                let obj = self.finish(id, header);
                (header, &obj[HEADER_LEN..])
            }
            None => (Header::raw(raw.len()), raw),
        }
    }

    /// Encodes chunk `id` like [`Encoder::encode`] and returns the whole stored object, header, payload and
    /// trailer, in one page-aligned buffer (for a backend writing with direct I/O): a raw chunk is copied
    /// into it.
    pub fn encode_object(&mut self, id: &ChunkId, raw: &[u8]) -> (Header, &[u8]) {
        let header = match self.compress(raw) {
            Some(n) => Header::zstd(raw.len(), n),
            None => {
                Self::object_room(&mut self.obj, self.max_chunk, raw.len())
                    [HEADER_LEN..HEADER_LEN + raw.len()]
                    .copy_from_slice(raw);
                Header::raw(raw.len())
            }
        };
        (header, self.finish(id, header))
    }

    /// Encodes chunk `id` like [`Encoder::encode_object`] for a backend writing with direct I/O, without
    /// copying a raw chunk whose bytes lie where direct I/O can take them: when `raw` starts
    /// [`HEADER_LEN`] bytes past a page boundary (a page-aligned chunk of a [`SegBuf`] segment), its
    /// object's first block is built in the encoder's buffer (the header and the first bytes), the whole
    /// blocks after it are `raw`'s own bytes, and the rest is the last partial block. The parts, joined,
    /// are byte for byte what [`Encoder::encode_object`] returns.
    ///
    /// [`SegBuf`]: crate::store::chunker::SegBuf
    pub fn encode_parts<'a>(
        &'a mut self,
        id: &ChunkId,
        raw: &'a [u8],
    ) -> (Header, ObjectParts<'a>) {
        let first = DIRECT_IO_ALIGN - HEADER_LEN;
        let placed = (raw.as_ptr() as usize + first).is_multiple_of(DIRECT_IO_ALIGN);
        if !placed || raw.len() < first + DIRECT_IO_ALIGN {
            let (header, object) = self.encode_object(id, raw);
            return (header, ObjectParts::Whole(object));
        }
        if let Some(n) = self.compress(raw) {
            let header = Header::zstd(raw.len(), n);
            return (header, ObjectParts::Whole(self.finish(id, header)));
        }
        let header = Header::raw(raw.len());
        let head = &mut Self::object_room(&mut self.obj, self.max_chunk, 0)[..DIRECT_IO_ALIGN];
        head[..HEADER_LEN].copy_from_slice(&header.encode());
        head[HEADER_LEN..].copy_from_slice(&raw[..first]);
        let blocks = (raw.len() - first) / DIRECT_IO_ALIGN * DIRECT_IO_ALIGN;
        let (body, tail) = raw[first..].split_at(blocks);
        (header, ObjectParts::Blocks([&*head, body, tail]))
    }

    /// Completes the object whose payload lies in the buffer after the header room: writes the header in
    /// front and, in version 2, the trailer after it. Returns the whole object.
    fn finish(&mut self, id: &ChunkId, header: Header) -> &[u8] {
        let obj = &mut Self::object_room(&mut self.obj, self.max_chunk, header.raw_len as usize)
            [..header.stored_len() as usize];
        obj[..HEADER_LEN].copy_from_slice(&header.encode());
        if header.trailer {
            let end = obj.len() - TRAILER_LEN;
            let trailer = trailer_of(id, &obj[..end]);
            obj[end..].copy_from_slice(&trailer);
        }
        obj
    }

    /// The encoder's object buffer, with room for the largest object, lent out between two encodes: the
    /// ingest reads a stored chunk it is about to reuse into it to check it, instead of holding a second
    /// buffer of that size per worker.
    pub fn object_buffer(&mut self) -> &mut AlignedBuf {
        Self::object_room(&mut self.obj, self.max_chunk, 0);
        &mut self.obj
    }

    /// The object buffer lent out by value (to a thread that reads a stored chunk into it); the encoder
    /// holds none until [`Encoder::return_object_buffer`], and allocates a new one if it is never returned.
    pub fn lend_object_buffer(&mut self) -> AlignedBuf {
        std::mem::take(self.object_buffer())
    }

    /// Takes back the buffer of [`Encoder::lend_object_buffer`].
    pub fn return_object_buffer(&mut self, buf: AlignedBuf) {
        self.obj = buf;
    }

    /// The object buffer `obj`, room for the header, a chunk of `len` raw bytes and a trailer. Sized for the
    /// largest chunk at once: growing it chunk by chunk would reallocate it (and lose its contents) every
    /// time.
    fn object_room(obj: &mut AlignedBuf, max_chunk: usize, len: usize) -> &mut [u8] {
        obj.slice_mut(HEADER_LEN + max_chunk.max(len) + TRAILER_LEN)
    }

    /// Compresses `raw` into `obj` after the header room if that is worth it; returns the frame's length.
    fn compress(&mut self, raw: &[u8]) -> Option<usize> {
        let compressor = self.compressor.as_mut()?;
        if raw.len() < 256 || self.predictor.is_random(raw) {
            return None;
        }
        let limit = raw.len() - raw.len() / 32;
        let out = &mut Self::object_room(&mut self.obj, self.max_chunk, raw.len())
            [HEADER_LEN..HEADER_LEN + limit];
        // A frame that does not fit in `limit` bytes fails with "destination too small": stored raw.
        match compressor.compress_to_buffer(raw, out) {
            Ok(n) if n < limit => Some(n),
            _ => None,
        }
    }
}

/// Compression parameters beyond the level: a window covering the largest chunk, so that a page recurring
/// anywhere in a chunk is found (level 1's default window is 512 KiB for inputs this size). Measured on page
/// images (`docs/store.md`, Tuning): 4-5% smaller on the benchmark's image at the same CPU, the same on a
/// real process's memory; larger hash tables saved a little more space on the benchmark but cost 6-28%
/// more CPU on real memory. Decoding needs no setting: the decoder writes straight into a buffer of the
/// chunk's size, and 4 MiB is far below its default window limit (128 MiB).
fn tune(c: &mut zstd::bulk::Compressor<'static>, max_chunk: usize) -> std::io::Result<()> {
    let window_log = max_chunk.next_power_of_two().trailing_zeros().clamp(10, 27);
    c.set_parameter(zstd::stream::raw::CParameter::WindowLog(window_log))
}

/// Tells random chunks (encrypted or compressed data) from the rest by sampling, at a small fraction of
/// what zstd costs on them (zstd level 1 runs about 2.5 GB/s per core on random bytes, the predictor 9-20
/// GB/s; on compressible data it usually decides within the first region).
///
/// A chunk is looked at in regions of 16 pages (64 KiB; the last one takes the rest, up to 31 pages). From
/// each 4 KiB page, 4 words of 8 bytes spread over the page are sampled (1/128 of the data). The chunk is
/// random when, in every region,
/// - the 512 sampled bytes show no more byte collisions than data of at least 7.75 bits of (Rényi)
///   entropy per byte would: then no order-0 coder (zstd's Huffman literals) can save 1/32, the threshold
///   under which a chunk is stored raw anyway (in a chunk of less than 16 pages, four standard deviations
///   above what random bytes show, if that is more: 32 samples a page are too few to judge); and
/// - no sampled word (two per page; compared without their lowest bit) occurs twice in the chunk: a page of
///   random bytes that recurs in the chunk is what LZ matching compresses. The sample positions repeat
///   every 4 KiB, so every copy of a page at a multiple of 4 KiB further on (as pages are, in page images)
///   is sampled at the same words, wherever the chunk starts.
///
/// A decision per chunk, not per region: splitting a chunk into zstd frames of compressed and raw regions
/// (which the format would allow) saved no measurable CPU on the benchmark's mixed chunks, since zstd is
/// fast on random bytes, and cost space (matches across the split are lost); see `docs/store.md`.
///
/// What it misses (random bytes copied at a distance that is not a multiple of 4 KiB inside one chunk) is
/// stored raw instead of compressed: a loss of space, never of data.
#[derive(Default)]
struct Predictor {
    /// Open-addressing table of the sampled words seen in this chunk (with the low bit set; 0 = empty).
    table: Vec<u64>,
}

const PAGE: usize = 4096;
const REGION_PAGES: usize = 16;
/// 8-byte words sampled from each page, spread over it; the even ones are also looked up for repeats.
const SAMPLES_PER_PAGE: usize = 4;
/// At most one collision per this many pairs of sampled bytes: 2^7.75 (see [`Predictor`]).
const PAIRS_PER_COLLISION: f64 = 215.27;

impl Predictor {
    fn is_random(&mut self, data: &[u8]) -> bool {
        let pages = data.len() / PAGE;
        if pages == 0 {
            return false;
        }
        let slots = (pages * SAMPLES_PER_PAGE).next_power_of_two();
        self.table.clear();
        self.table.resize(slots, 0);
        // Regions of REGION_PAGES pages; a shorter rest joins the last one (too few samples to judge).
        let regions = (pages / REGION_PAGES).max(1);
        for r in 0..regions {
            let end = if r + 1 == regions {
                pages
            } else {
                (r + 1) * REGION_PAGES
            };
            let mut counts = [0u16; 256];
            let mut collisions = 0u64;
            for page in data[r * REGION_PAGES * PAGE..end * PAGE].chunks_exact(PAGE) {
                for k in 0..SAMPLES_PER_PAGE {
                    let at = k * (PAGE / SAMPLES_PER_PAGE) + 8 * k;
                    let w = u64::from_le_bytes(page[at..at + 8].try_into().expect("8 bytes"));
                    for b in w.to_le_bytes() {
                        let c = &mut counts[b as usize];
                        collisions += *c as u64;
                        *c += 1;
                    }
                    if k % 2 == 0 && !self.insert(w) {
                        return false;
                    }
                }
            }
            let samples = ((end - r * REGION_PAGES) * SAMPLES_PER_PAGE * 8) as f64;
            let pairs = samples * (samples - 1.0) / 2.0;
            // Random bytes collide once per 256 pairs: allow 4 standard deviations of that for the
            // chunks too small to be judged on the entropy threshold alone.
            let uniform = pairs / 256.0;
            let limit = (pairs / PAIRS_PER_COLLISION).max(uniform + 4.0 * uniform.sqrt());
            if collisions as f64 > limit {
                return false;
            }
        }
        true
    }

    /// Adds a sampled word to the table; false if it was there already.
    fn insert(&mut self, w: u64) -> bool {
        let mask = self.table.len() - 1;
        let key = w | 1;
        let mut i = (w.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize & mask;
        loop {
            match self.table[i] {
                0 => {
                    self.table[i] = key;
                    return true;
                }
                k if k == key => return false,
                _ => i = (i + 1) & mask,
            }
        }
    }
}

/// Reusable per-thread decompression state.
pub struct Decoder {
    decompressor: zstd::bulk::Decompressor<'static>,
    out: Vec<u8>,
    /// The last [`decode`](Decoder::decode) left its bytes in `out` (a zstd chunk), not in its input.
    decoded_here: bool,
}

impl Decoder {
    pub fn new(max_chunk: usize) -> std::io::Result<Decoder> {
        Ok(Decoder {
            decompressor: zstd::bulk::Decompressor::new()?,
            out: Vec::with_capacity(max_chunk),
            decoded_here: false,
        })
    }

    /// Hands over the buffer holding the last decoded chunk's bytes, if the decoder holds them (a zstd
    /// chunk; a raw chunk's bytes are the input's), by swapping it with `spare`, which the decoder keeps
    /// for the next chunk. Returns whether it did. Saves copying the bytes out of a buffer that is about to
    /// be reused.
    pub fn swap_output(&mut self, spare: &mut Vec<u8>) -> bool {
        let held = std::mem::take(&mut self.decoded_here);
        if held {
            std::mem::swap(&mut self.out, spare);
        }
        held
    }

    /// Decodes a stored chunk and checks that it hashes to `id`. Returns the raw bytes, borrowed from `stored`
    /// (raw chunks) or from the decoder's buffer (zstd chunks). The error describes the damage.
    pub fn decode<'a>(&'a mut self, id: &ChunkId, stored: &'a [u8]) -> Result<&'a [u8], String> {
        let raw = self.decode_unhashed(stored)?;
        if ChunkId::of(raw) != *id {
            return Err(HASH_MISMATCH.into());
        }
        Ok(raw)
    }

    /// Checks a stored chunk like [`Decoder::decode`] and, in format version 2, its trailer too: a whole
    /// object check (`verify`). Restores skip the trailer: the hash of the decoded bytes proves them, and a
    /// damaged trailer alone does not make a checkpoint unrestorable. Returns the raw length.
    pub fn verify(&mut self, id: &ChunkId, stored: &[u8]) -> Result<usize, String> {
        check_object(Some(id), stored)?;
        self.decode(id, stored).map(<[u8]>::len)
    }

    /// Checks that stored chunk `id` holds exactly `expected`, bytes the caller has just hashed to `id`
    /// (the ingest checks every chunk it reuses this way; the error describes the damage):
    /// - a raw payload is compared with `expected` (equal bytes are the proof, and comparing costs less
    ///   than hashing again);
    /// - a zstd payload in format version 2 is proved by its trailer (BLAKE3 keyed with `id`, of header and
    ///   payload, as the writer computed it from the compressed bytes of `expected`): hashing the stored
    ///   bytes, not decompressing them, which costs a fraction;
    /// - a zstd payload in version 1 (earlier builds) is decoded and compared.
    pub fn check_reuse(
        &mut self,
        id: &ChunkId,
        stored: &[u8],
        expected: &[u8],
    ) -> Result<(), String> {
        let header = check_object(Some(id), stored)?;
        if header.raw_len as usize != expected.len() {
            return Err(HASH_MISMATCH.into());
        }
        let payload = &stored[HEADER_LEN..HEADER_LEN + header.payload_len as usize];
        let equal = match (header.encoding, header.trailer) {
            (Encoding::Raw, _) => payload == expected,
            // The trailer matched in `check_object`.
            (Encoding::Zstd, true) => true,
            (Encoding::Zstd, false) => self.decode_unhashed(stored)? == expected,
        };
        if !equal {
            return Err(HASH_MISMATCH.into());
        }
        Ok(())
    }

    /// Decodes a stored chunk, checking its header and lengths but neither its hash nor its trailer.
    fn decode_unhashed<'a>(&'a mut self, stored: &'a [u8]) -> Result<&'a [u8], String> {
        let header = check_object(None, stored)?;
        let payload = &stored[HEADER_LEN..HEADER_LEN + header.payload_len as usize];
        self.decoded_here = header.encoding == Encoding::Zstd;
        let raw: &[u8] = match header.encoding {
            Encoding::Raw => payload,
            Encoding::Zstd => {
                let want = header.raw_len as usize;
                self.out.clear();
                self.out.reserve(want);
                let n = self
                    .decompressor
                    .decompress_to_buffer(payload, &mut self.out)
                    .map_err(|e| format!("damaged (zstd: {e})"))?;
                if n != want {
                    return Err(format!(
                        "damaged (decompressed to {n} bytes, expected {want})"
                    ));
                }
                &self.out
            }
        };
        Ok(raw)
    }
}

/// True if every byte is zero.
pub fn is_zero(data: &[u8]) -> bool {
    zero_prefix_len(data) == data.len()
}

/// How many bytes at the start of `data` are zero. ORs 64-byte blocks so the compiler can vectorise the
/// inner loop, and stops at the first non-zero block (page images are mostly either long zero runs or data).
pub fn zero_prefix_len(data: &[u8]) -> usize {
    let mut blocks = data.chunks_exact(64);
    let mut n = 0;
    for b in &mut blocks {
        if b.iter().fold(0u8, |a, &x| a | x) != 0 {
            return n + b.iter().position(|&x| x != 0).unwrap_or(0);
        }
        n += 64;
    }
    n + blocks
        .remainder()
        .iter()
        .position(|&x| x != 0)
        .unwrap_or(blocks.remainder().len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testdata::random_bytes;

    fn roundtrip(data: &[u8]) -> Encoding {
        let mut enc = Encoder::new(Some(3), data.len()).unwrap();
        let (header, payload) = enc.encode(&ChunkId::of(data), data);
        let mut stored = header.encode().to_vec();
        stored.extend_from_slice(payload);
        let mut dec = Decoder::new(data.len()).unwrap();
        assert_eq!(dec.decode(&ChunkId::of(data), &stored).unwrap(), data);
        header.encoding
    }

    /// `encode_parts` leaves whole objects alone: a raw chunk that does not lie HEADER_LEN past a page, one
    /// too short for a block after its first, and a compressed one all come back as `encode_object`'s.
    #[test]
    fn only_a_placed_raw_chunk_is_split() {
        use crate::store::chunker::SegBuf;
        let mut enc = Encoder::new(Some(1), 1 << 16).unwrap();
        let mut check = Encoder::new(Some(1), 1 << 16).unwrap();
        let mut seg = SegBuf::new(1 << 16);
        let random = random_bytes(40_000, 5);
        let text = b"a page of text, again and again. ".repeat(1000);
        // Misplaced (one byte further), short, compressible; then placed and random: split.
        seg[..40_001][1..].copy_from_slice(&random);
        let cases: [(&[u8], bool); 4] = [
            (&seg[1..40_001], false),
            (&random[..5000], false),
            (&text[..30_000], false),
            (&random, true),
        ];
        for (n, (data, split)) in cases.into_iter().enumerate() {
            let mut placed = SegBuf::new(1 << 16);
            let data: &[u8] = if split {
                placed[..data.len()].copy_from_slice(data);
                &placed[..data.len()]
            } else {
                data
            };
            let id = ChunkId::of(data);
            let expected = check.encode_object(&id, data).1.to_vec();
            let (_, parts) = enc.encode_parts(&id, data);
            assert_eq!(matches!(parts, ObjectParts::Blocks(_)), split, "case {n}");
            assert_eq!(parts.parts().concat(), expected, "case {n}");
        }
    }

    #[test]
    fn whole_objects_are_aligned_and_decode_like_header_plus_payload() {
        let text: Vec<u8> = (0..50_000u32)
            .flat_map(|i| (i % 97).to_le_bytes())
            .collect();
        let random = random_bytes(70_001, 3);
        let mut enc = Encoder::new(Some(1), 80_000).unwrap();
        let mut dec = Decoder::new(80_000).unwrap();
        for (data, want) in [
            (&text[..], Encoding::Zstd),
            (&random[..], Encoding::Raw),
            (&b"tiny"[..], Encoding::Raw),
        ] {
            // The split form first, then the whole object from the same encoder (its buffer reused).
            let (h1, payload) = enc.encode(&ChunkId::of(data), data);
            let mut split = h1.encode().to_vec();
            split.extend_from_slice(payload);
            let (h2, object) = enc.encode_object(&ChunkId::of(data), data);
            assert_eq!(h1, h2);
            assert_eq!(h2.encoding, want);
            assert!(crate::util::is_direct_io_aligned(object));
            assert_eq!(object.len() as u64, h2.stored_len());
            assert_eq!(object, &split[..]);
            assert_eq!(dec.decode(&ChunkId::of(data), object).unwrap(), data);
        }
        // Compression off: raw objects all the same.
        let mut raw_only = Encoder::new(None, 80_000).unwrap();
        let (h, object) = raw_only.encode_object(&ChunkId::of(&text), &text);
        assert_eq!(h.encoding, Encoding::Raw);
        assert_eq!(&object[HEADER_LEN..], &text[..]);
    }

    #[test]
    fn compressible_chunks_use_zstd_and_random_ones_stay_raw() {
        let text: Vec<u8> = (0..100_000u32)
            .flat_map(|i| (i % 97).to_le_bytes())
            .collect();
        assert_eq!(roundtrip(&text), Encoding::Zstd);
        assert_eq!(roundtrip(&random_bytes(100_000, 0)), Encoding::Raw);
        assert_eq!(roundtrip(b"tiny"), Encoding::Raw);
    }

    /// Small integers in 8-byte words, as in heap pages.
    fn heap_like(n: usize, seed: u64) -> Vec<u8> {
        random_bytes(n, seed)
            .chunks(8)
            .flat_map(|w| (u64::from_le_bytes(w.try_into().unwrap()) % 4096).to_le_bytes())
            .take(n)
            .collect()
    }

    #[test]
    fn predictor_finds_random_chunks_and_only_those() {
        let mut p = Predictor::default();
        // Random bytes of any length from a page up, at any alignment, whatever the seed.
        for seed in 0..300u64 {
            let n = [4096, 5000, 65536 + 4096, 100_000, 1 << 20][seed as usize % 5];
            assert!(
                p.is_random(&random_bytes(n, seed)),
                "random {n} bytes, seed {seed}"
            );
        }
        assert!(p.is_random(&random_bytes((4 << 20) - 3, 1)));
        assert!(
            !p.is_random(&random_bytes(4095, 1)),
            "shorter than a page: left to zstd"
        );
        assert!(!p.is_random(&heap_like(1 << 20, 3)));
        assert!(!p.is_random(&vec![0u8; 1 << 20]));
        // Floats with a narrow range of exponents: high-entropy mantissas, but the exponent bytes repeat.
        let floats: Vec<u8> = random_bytes(1 << 20, 5)
            .chunks(4)
            .flat_map(|w| {
                (1.0 + u32::from_le_bytes(w.try_into().unwrap()) as f32 / 4e9).to_le_bytes()
            })
            .collect();
        assert!(!p.is_random(&floats));
        // Random pages that recur (a few distinct pages copied around), seen from a chunk that starts in the
        // middle of a page: each page alone is random, the chunk compresses.
        let distinct = random_bytes(16 * 4096, 9);
        let mut recurring = Vec::new();
        for i in 0..256usize {
            let k = (i * 7) % 16;
            recurring.extend_from_slice(&distinct[k * 4096..(k + 1) * 4096]);
        }
        assert!(!p.is_random(&recurring[1234..]));
        // Random except for one 64 KiB region (a region is 16 pages): compressible.
        let mut mostly = random_bytes(1 << 20, 11);
        mostly[512 * 1024..576 * 1024].fill(0);
        assert!(!p.is_random(&mostly));
    }

    #[test]
    fn random_chunks_are_stored_raw_and_everything_round_trips() {
        let mut enc = Encoder::new(Some(1), 4 << 20).unwrap();
        let mut dec = Decoder::new(4 << 20).unwrap();
        let random = random_bytes(3 << 20, 21);
        let heap = heap_like(3 << 20, 22);
        // A chunk that is half random, half heap: one decision per chunk, and zstd stores the random half
        // in raw blocks of its frame.
        let mixed: Vec<u8> = random[..1 << 20]
            .iter()
            .chain(&heap[..1 << 20])
            .copied()
            .collect();
        let mut mostly_random = random.clone();
        mostly_random[..256 * 1024].fill(0);
        for (name, data, want) in [
            ("random", &random, Encoding::Raw),
            ("heap", &heap, Encoding::Zstd),
            ("mixed", &mixed, Encoding::Zstd),
            ("mostly random", &mostly_random, Encoding::Zstd),
        ] {
            let (header, payload) = enc.encode(&ChunkId::of(data), data);
            assert_eq!(header.encoding, want, "{name}");
            if want == Encoding::Zstd {
                assert!(payload.len() < data.len() - data.len() / 32, "{name}");
            }
            if name == "mixed" {
                // The random half costs its size, the heap half compresses to about a fifth.
                assert!(
                    payload.len() < (1 << 20) + (1 << 19),
                    "{name}: {}",
                    payload.len()
                );
            }
            let mut stored = header.encode().to_vec();
            stored.extend_from_slice(payload);
            assert_eq!(
                dec.decode(&ChunkId::of(data), &stored).unwrap(),
                &data[..],
                "{name}"
            );
        }
    }

    #[test]
    fn the_window_covers_a_whole_chunk() {
        // 2 MiB of random bytes repeated once, 2 MiB further on: level 1's default window (512 KiB for
        // inputs this size) would miss the repeat; the tuned one finds it.
        let half = random_bytes(2 << 20, 31);
        let data: Vec<u8> = half.iter().chain(&half).copied().collect();
        let mut enc = Encoder::new(Some(1), 4 << 20).unwrap();
        let (header, payload) = enc.encode(&ChunkId::of(&data), &data);
        assert_eq!(header.encoding, Encoding::Zstd);
        assert!(
            payload.len() < half.len() + half.len() / 16,
            "{}",
            payload.len()
        );
    }

    #[test]
    fn chunks_written_by_earlier_builds_still_decode() {
        // Format version 1 as earlier builds wrote it: zstd at level 1 with default parameters (one frame)
        // or several frames; the decoder accepts any standard zstd stream.
        let data = heap_like(1 << 20, 41);
        let frame = zstd::bulk::compress(&data, 1).unwrap();
        let mut two = zstd::bulk::compress(&data[..1000], 3).unwrap();
        two.extend_from_slice(&zstd::bulk::compress(&data[1000..], 1).unwrap());
        let mut dec = Decoder::new(data.len()).unwrap();
        for payload in [frame, two] {
            let stored = v1_stored(data.len(), &payload);
            assert_eq!(stored[4], 1, "format version 1");
            assert_eq!(dec.decode(&ChunkId::of(&data), &stored).unwrap(), &data[..]);
        }
    }

    #[test]
    fn compression_off_stores_even_compressible_chunks_raw() {
        let data = vec![7u8; 100_000];
        let mut enc = Encoder::new(None, data.len()).unwrap();
        let (header, payload) = enc.encode(&ChunkId::of(&data), &data);
        assert_eq!(header.encoding, Encoding::Raw);
        assert_eq!(payload, &data[..]);
        let mut stored = header.encode().to_vec();
        stored.extend_from_slice(payload);
        let mut dec = Decoder::new(data.len()).unwrap();
        assert_eq!(dec.decode(&ChunkId::of(&data), &stored).unwrap(), data);
    }

    #[test]
    fn damage_is_detected_and_described() {
        let data = vec![7u8; 10_000];
        let id = ChunkId::of(&data);
        let mut enc = Encoder::new(Some(1), data.len()).unwrap();
        let (header, payload) = enc.encode(&ChunkId::of(&data), &data);
        let mut stored = header.encode().to_vec();
        stored.extend_from_slice(payload);
        let mut dec = Decoder::new(data.len()).unwrap();
        let truncated = &stored[..stored.len() - 1];
        assert!(dec
            .decode(&id, truncated)
            .unwrap_err()
            .contains("truncated"));
        // The payload's last byte (a version 2 object: the trailer follows).
        assert!(header.trailer);
        let mut flipped = stored.clone();
        let last = flipped.len() - 1 - TRAILER_LEN;
        flipped[last] ^= 1;
        assert!(dec.decode(&id, &flipped).is_err());
        assert!(dec.verify(&id, &flipped).is_err());
        // The trailer's last byte: the content still decodes to its name (a restore takes it), `verify`
        // reports the object.
        let mut flipped = stored.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert_eq!(dec.decode(&id, &flipped).unwrap(), &data[..]);
        assert_eq!(dec.verify(&id, &flipped).unwrap_err(), TRAILER_MISMATCH);
        assert_eq!(dec.verify(&id, &stored), Ok(data.len()));
        assert!(dec
            .decode(&id, &stored[..3])
            .unwrap_err()
            .contains("truncated"));
        let mut longer = stored.clone();
        longer.push(0);
        assert!(dec
            .decode(&id, &longer)
            .unwrap_err()
            .contains("header says"));
        let other = ChunkId::of(b"other");
        assert!(dec.decode(&other, &stored).unwrap_err().contains("BLAKE3"));
    }

    /// A version 1 object (no trailer) as earlier builds wrote it: `payload`, a zstd stream of `raw_len`
    /// bytes, under its header.
    fn v1_stored(raw_len: usize, payload: &[u8]) -> Vec<u8> {
        let header = Header {
            encoding: Encoding::Zstd,
            raw_len: raw_len as u32,
            payload_len: payload.len() as u32,
            trailer: false,
        };
        let mut stored = header.encode().to_vec();
        stored.extend_from_slice(payload);
        stored
    }

    /// A version 1 object of `data` as earlier builds wrote it (zstd level 1, one frame).
    fn v1_object(data: &[u8]) -> Vec<u8> {
        v1_stored(data.len(), &zstd::bulk::compress(data, 1).unwrap())
    }

    /// Chunk `data`'s name, header and whole object as this build writes them (zstd level 1).
    fn object_of(data: &[u8]) -> (ChunkId, Header, Vec<u8>) {
        let id = ChunkId::of(data);
        let mut enc = Encoder::new(Some(1), data.len()).unwrap();
        let (header, object) = enc.encode_object(&id, data);
        (id, header, object.to_vec())
    }

    /// Chunk `data` as this build writes it, check that its header says `(encoding, trailer)` and its format
    /// byte `version`, and that a fresh decoder (no output buffer, as the ingest's) accepts it for reuse.
    fn reusable_object(
        data: &[u8],
        encoding: Encoding,
        trailer: bool,
        version: u8,
    ) -> (ChunkId, Vec<u8>, Decoder) {
        let (id, header, object) = object_of(data);
        assert_eq!((header.encoding, header.trailer), (encoding, trailer));
        assert_eq!(object[4], version, "format version");
        let mut dec = Decoder::new(0).unwrap();
        assert_eq!(dec.check_reuse(&id, &object, data), Ok(()));
        (id, object, dec)
    }

    #[test]
    fn a_reused_zstd_object_is_proved_by_its_trailer_without_decompressing() {
        let data = heap_like(20_000, 51);
        let (id, object, mut dec) = reusable_object(&data, Encoding::Zstd, true, 2);
        // The ingest's decoder starts without an output buffer: it stays so, nothing was decompressed.
        assert_eq!(dec.out.capacity(), 0, "decompressed");
        // Bytes of another length than the header says: refused.
        assert!(dec.check_reuse(&id, &object, &data[..100]).is_err());
        // Every flipped byte, in header, payload or trailer, is found; so is every truncation.
        for i in 0..object.len() {
            for bit in [0x01, 0x80] {
                let mut bad = object.clone();
                bad[i] ^= bit;
                assert!(dec.check_reuse(&id, &bad, &data).is_err(), "byte {i}");
            }
        }
        for n in 0..object.len() {
            assert!(dec.check_reuse(&id, &object[..n], &data).is_err(), "{n}");
        }
        let mut longer = object.clone();
        longer.extend_from_slice(&[0; 4096]);
        assert!(dec.check_reuse(&id, &longer, &data).is_err());
        // Another chunk's intact object in its place (same raw length): its trailer is keyed with its own
        // name.
        let swapped_data = heap_like(20_000, 52);
        let (swapped_id, _, swapped) = object_of(&swapped_data);
        assert_eq!(
            dec.check_reuse(&swapped_id, &swapped, &swapped_data),
            Ok(())
        );
        assert_eq!(
            dec.check_reuse(&id, &swapped, &data).unwrap_err(),
            TRAILER_MISMATCH
        );
        // Garbage.
        assert!(dec
            .check_reuse(&id, &random_bytes(object.len(), 3), &data)
            .is_err());
        assert_eq!(dec.out.capacity(), 0, "decompressed");
    }

    #[test]
    fn a_reused_version_1_object_is_still_decoded_and_compared() {
        let data = heap_like(200_000, 53);
        let id = ChunkId::of(&data);
        let stored = v1_object(&data);
        let mut dec = Decoder::new(0).unwrap();
        assert_eq!(dec.check_reuse(&id, &stored, &data), Ok(()));
        assert!(dec.out.capacity() >= data.len(), "decompressed");
        // Damage under an intact header, and a truncation, are found the full way.
        let mut bad = stored.clone();
        let mid = HEADER_LEN + (bad.len() - HEADER_LEN) / 2;
        bad[mid] ^= 0x40;
        assert!(dec.check_reuse(&id, &bad, &data).is_err());
        assert!(dec
            .check_reuse(&id, &stored[..stored.len() - 1], &data)
            .unwrap_err()
            .contains("truncated"));
        // A version 2 object turned into version 1 by a flipped version byte: its trailer is left over.
        let mut relabelled = object_of(&data).2;
        relabelled[4] = 1;
        assert!(dec.check_reuse(&id, &relabelled, &data).is_err());
    }

    #[test]
    fn a_reused_raw_object_is_compared() {
        let data = random_bytes(100_000, 54);
        // Raw objects keep format version 1.
        let (id, object, mut dec) = reusable_object(&data, Encoding::Raw, false, 1);
        let mut bad = object.clone();
        bad[HEADER_LEN + 5000] ^= 1;
        assert_eq!(
            dec.check_reuse(&id, &bad, &data).unwrap_err(),
            HASH_MISMATCH
        );
        assert!(dec
            .check_reuse(&id, &object[..object.len() - 1], &data)
            .is_err());
    }

    #[test]
    fn zero_detection() {
        assert!(is_zero(&[0u8; 1000]));
        assert!(is_zero(&[]));
        let mut v = vec![0u8; 1000];
        v[999] = 1;
        assert!(!is_zero(&v));
        v[999] = 0;
        v[3] = 1;
        assert!(!is_zero(&v));
        assert_eq!(zero_prefix_len(&v), 3);
        v[3] = 0;
        v[700] = 2;
        assert_eq!(zero_prefix_len(&v), 700);
        assert_eq!(zero_prefix_len(&[0, 0, 0]), 3);
    }
}
