//! The chunk object format: a 16-byte header, then the payload (zstd frame or raw bytes).
//!
//! ```text
//! offset size field
//!      0    4 magic "GCKC"
//!      4    1 format version (1)
//!      5    1 encoding: 0 = raw, 1 = zstd
//!      6    2 reserved, 0
//!      8    4 raw length (little endian): the chunk's uncompressed size
//!     12    4 payload length (little endian): bytes after the header
//! ```
//! A chunk is named by the BLAKE3 hash of its *raw* bytes, so decoding it and hashing the result proves every
//! byte; the payload length in the header makes truncation detectable without decompressing.

use std::fmt;

/// Size of the fixed header in front of every stored chunk.
pub const HEADER_LEN: usize = 16;
const MAGIC: &[u8; 4] = b"GCKC";
const VERSION: u8 = 1;

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

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    pub fn from_hex(s: &str) -> Option<ChunkId> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(ChunkId(out))
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
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(MAGIC);
        h[4] = VERSION;
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
        if bytes[4] != VERSION {
            return Err(format!("of unsupported chunk format version {}", bytes[4]));
        }
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
        })
    }

    /// Total size of the stored object.
    pub fn stored_len(&self) -> u64 {
        HEADER_LEN as u64 + self.payload_len as u64
    }
}

/// Reusable per-thread compression state, so that contexts and buffers are allocated once per worker and
/// not once per chunk (fresh memory is slow to touch on the machines this runs on).
pub struct Encoder {
    /// `None`: compression is off for this store's new chunks, every chunk is stored raw.
    compressor: Option<zstd::bulk::Compressor<'static>>,
    zbuf: Vec<u8>,
}

impl Encoder {
    /// `level`: the zstd level, or `None` to store every chunk raw (the fastest ingest and restore).
    pub fn new(level: Option<i32>, max_chunk: usize) -> std::io::Result<Encoder> {
        Ok(Encoder {
            compressor: level.map(zstd::bulk::Compressor::new).transpose()?,
            zbuf: Vec::with_capacity(if level.is_some() { max_chunk } else { 0 }),
        })
    }

    /// Encodes one chunk: returns its header and payload (the zstd frame in the encoder's buffer, or `raw`).
    ///
    /// Chunks are stored raw unless zstd saves at least 1/32 of them: a chunk that barely compresses costs
    /// decompression time on every restore for almost no space. zstd's output buffer is capped at that
    /// limit, so zstd itself gives up early on incompressible data (destination too small).
    pub fn encode<'a>(&'a mut self, raw: &'a [u8]) -> (Header, &'a [u8]) {
        let limit = raw.len() - raw.len() / 32;
        self.zbuf.clear();
        self.zbuf.reserve(limit);
        if let (Some(compressor), true) = (self.compressor.as_mut(), raw.len() >= 256) {
            let r = compressor.compress_to_buffer(raw, &mut ZstdBuf(&mut self.zbuf, limit));
            if let Ok(n) = r {
                if n < limit {
                    let header = Header {
                        encoding: Encoding::Zstd,
                        raw_len: raw.len() as u32,
                        payload_len: n as u32,
                    };
                    return (header, &self.zbuf[..n]);
                }
            }
        }
        let header = Header {
            encoding: Encoding::Raw,
            raw_len: raw.len() as u32,
            payload_len: raw.len() as u32,
        };
        (header, raw)
    }
}

/// A `WriteBuf` over a Vec that exposes at most `limit` bytes of capacity to zstd.
struct ZstdBuf<'a>(&'a mut Vec<u8>, usize);

unsafe impl zstd::zstd_safe::WriteBuf for ZstdBuf<'_> {
    fn as_slice(&self) -> &[u8] {
        self.0.as_slice()
    }
    fn capacity(&self) -> usize {
        self.1.min(self.0.capacity())
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    unsafe fn filled_until(&mut self, n: usize) {
        // SAFETY: zstd initialised the first `n` bytes, and n <= capacity() <= the Vec's capacity.
        unsafe { self.0.set_len(n) }
    }
}

/// Reusable per-thread decompression state.
pub struct Decoder {
    decompressor: zstd::bulk::Decompressor<'static>,
    out: Vec<u8>,
}

impl Decoder {
    pub fn new(max_chunk: usize) -> std::io::Result<Decoder> {
        Ok(Decoder {
            decompressor: zstd::bulk::Decompressor::new()?,
            out: Vec::with_capacity(max_chunk),
        })
    }

    /// Decodes a stored chunk and checks that it hashes to `id`. Returns the raw bytes, borrowed from `stored`
    /// (raw chunks) or from the decoder's buffer (zstd chunks). The error describes the damage.
    pub fn decode<'a>(&'a mut self, id: &ChunkId, stored: &'a [u8]) -> Result<&'a [u8], String> {
        let header = Header::decode(stored)?;
        let payload = &stored[HEADER_LEN..];
        if payload.len() as u64 != header.payload_len as u64 {
            return Err(format!(
                "truncated ({} of {} payload bytes)",
                payload.len(),
                header.payload_len
            ));
        }
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
        if ChunkId::of(raw) != *id {
            return Err("damaged (content does not match its BLAKE3 name)".into());
        }
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

    fn roundtrip(data: &[u8]) -> Encoding {
        let mut enc = Encoder::new(Some(3), data.len()).unwrap();
        let (header, payload) = enc.encode(data);
        let mut stored = header.encode().to_vec();
        stored.extend_from_slice(payload);
        let mut dec = Decoder::new(data.len()).unwrap();
        assert_eq!(dec.decode(&ChunkId::of(data), &stored).unwrap(), data);
        header.encoding
    }

    #[test]
    fn compressible_chunks_use_zstd_and_random_ones_stay_raw() {
        let text: Vec<u8> = (0..100_000u32)
            .flat_map(|i| (i % 97).to_le_bytes())
            .collect();
        assert_eq!(roundtrip(&text), Encoding::Zstd);
        let mut rnd = vec![0u8; 100_000];
        let mut x = 0x9e3779b97f4a7c15u64;
        for b in rnd.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        assert_eq!(roundtrip(&rnd), Encoding::Raw);
        assert_eq!(roundtrip(b"tiny"), Encoding::Raw);
    }

    #[test]
    fn compression_off_stores_even_compressible_chunks_raw() {
        let data = vec![7u8; 100_000];
        let mut enc = Encoder::new(None, data.len()).unwrap();
        let (header, payload) = enc.encode(&data);
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
        let (header, payload) = enc.encode(&data);
        let mut stored = header.encode().to_vec();
        stored.extend_from_slice(payload);
        let mut dec = Decoder::new(data.len()).unwrap();
        let truncated = &stored[..stored.len() - 1];
        assert!(dec
            .decode(&id, truncated)
            .unwrap_err()
            .contains("truncated"));
        let mut flipped = stored.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 1;
        assert!(dec.decode(&id, &flipped).is_err());
        assert!(dec
            .decode(&id, &stored[..3])
            .unwrap_err()
            .contains("truncated"));
        let other = ChunkId::of(b"other");
        assert!(dec.decode(&other, &stored).unwrap_err().contains("BLAKE3"));
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
