//! The manifest: one JSON object per checkpoint, listing its files and their chunks, with a checksum of its
//! own so that a damaged manifest is detected rather than misread.
//!
//! The file is the compact JSON of [`CheckpointInfo`] with one extra last member,
//! `"manifest_checksum":"blake3:HEX"`, the BLAKE3 hash of the same JSON without that member. The file stays
//! valid JSON (readable with any tool), and checking it needs no re-serialisation: cut the last member off,
//! hash, compare.

use serde::{Deserialize, Serialize};

use super::chunk::ChunkId;

pub const MANIFEST_FORMAT_NAME: &str = "gpu-checkpoint-manifest";
/// Version of the manifest schema this build writes; it reads this one and older ones.
pub const MANIFEST_FORMAT_VERSION: u32 = 1;
const CHECKSUM_KEY: &[u8] = br#","manifest_checksum":"blake3:"#;

/// How a checkpoint's files were cut into chunks and encoded (recorded so that later builds with other
/// settings still know what they are reading).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Chunking {
    /// `fastcdc-v2020`
    pub algorithm: String,
    pub min_size: u32,
    pub avg_size: u32,
    pub max_size: u32,
    /// `blake3` of the raw chunk content.
    pub hash: String,
    /// `zstd` (chunks that do not compress are stored raw).
    pub compression: String,
    pub level: i32,
}

/// One chunk of a file. A chunk without a hash is all zeros: it is not stored at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// BLAKE3 of the raw content; absent for an all-zero chunk.
    #[serde(rename = "h", default, skip_serializing_if = "Option::is_none")]
    pub id: Option<ChunkId>,
    /// Raw (uncompressed) length.
    #[serde(rename = "n")]
    pub len: u32,
}

/// One image file of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Relative path inside the image folder, `/`-separated.
    pub path: String,
    /// Permission bits the file had (it is always restored private, 0600).
    pub mode: u32,
    pub size: u64,
    pub chunks: Vec<ChunkRef>,
}

/// Sizes and timings of one ingest.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IngestStats {
    /// Sum of the image files' sizes.
    pub logical_bytes: u64,
    /// Bytes in all-zero chunks (not stored).
    pub zero_bytes: u64,
    /// Raw bytes of the distinct non-zero chunks this checkpoint references.
    pub unique_bytes: u64,
    /// Bytes those distinct chunks take in the store (compressed, with headers), shared or not.
    pub stored_bytes: u64,
    /// Bytes this ingest actually wrote (chunks that were not in the store yet), manifest excluded.
    pub new_bytes: u64,
    pub manifest_bytes: u64,
    pub files: u64,
    pub chunks: u64,
    pub unique_chunks: u64,
    pub new_chunks: u64,
    /// (logical - zero) / unique: duplication inside this checkpoint.
    pub dedup_ratio: f64,
    /// unique / stored: what zstd saved.
    pub compression_ratio: f64,
    /// logical / stored: everything together.
    pub reduction_ratio: f64,
    /// Chunking, hashing, compression and writing, wall clock; for images streamed from CRIU, from the first
    /// image to the commit (the store's work overlaps CRIU's dump).
    pub ingest_ms: u64,
    /// Making the new chunks durable (part of `ingest_ms`).
    pub sync_ms: u64,
}

/// A committed checkpoint: its manifest, parsed and checked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CheckpointInfo {
    pub format: String,
    pub version: u32,
    pub id: String,
    pub name: Option<String>,
    /// RFC 3339, UTC, when the checkpoint was begun.
    pub created: String,
    pub chunking: Chunking,
    pub stats: IngestStats,
    /// The checkpoint flow's own record (process tree, detect report, timings...), stored verbatim.
    pub metadata: serde_json::Value,
    pub files: Vec<FileEntry>,
}

impl CheckpointInfo {
    /// Every chunk reference of the checkpoint with its file index, chunk index and offset in the file.
    pub fn chunk_refs(&self) -> impl Iterator<Item = (usize, usize, u64, ChunkRef)> + '_ {
        self.files.iter().enumerate().flat_map(|(fi, f)| {
            let mut offset = 0u64;
            f.chunks.iter().enumerate().map(move |(ci, c)| {
                let at = offset;
                offset += c.len as u64;
                (fi, ci, at, *c)
            })
        })
    }
}

/// Serialises a manifest with its checksum appended.
pub fn encode(info: &CheckpointInfo) -> Vec<u8> {
    let mut body = serde_json::to_vec(info).expect("manifest is serialisable");
    let hash = blake3::hash(&body);
    debug_assert_eq!(body.last(), Some(&b'}'));
    body.pop();
    body.extend_from_slice(CHECKSUM_KEY);
    body.extend_from_slice(hash.to_hex().as_bytes());
    body.extend_from_slice(b"\"}\n");
    body
}

/// Checks a manifest's checksum and parses it. The error says what is wrong.
pub fn decode(bytes: &[u8]) -> Result<CheckpointInfo, String> {
    let mut end = bytes.len();
    while end > 0 && bytes[end - 1].is_ascii_whitespace() {
        end -= 1;
    }
    let text = &bytes[..end];
    let pos =
        rfind(text, CHECKSUM_KEY).ok_or("no manifest_checksum (truncated or not a manifest)")?;
    let tail = &text[pos + CHECKSUM_KEY.len()..];
    if tail.len() != 64 + 2 || &tail[64..] != b"\"}" {
        return Err("malformed manifest_checksum (truncated?)".into());
    }
    let want = std::str::from_utf8(&tail[..64]).map_err(|_| "malformed manifest_checksum")?;
    let mut hasher = blake3::Hasher::new();
    hasher.update(&text[..pos]);
    hasher.update(b"}");
    let got = hasher.finalize().to_hex();
    if got.as_str() != want {
        return Err(format!(
            "checksum mismatch (stored {}, content hashes to {})",
            &want[..16],
            &got.as_str()[..16]
        ));
    }
    let mut body = text[..pos].to_vec();
    body.push(b'}');
    let info: CheckpointInfo =
        serde_json::from_slice(&body).map_err(|e| format!("unreadable JSON: {e}"))?;
    if info.format != MANIFEST_FORMAT_NAME {
        return Err(format!("not a manifest (format {:?})", info.format));
    }
    if info.version > MANIFEST_FORMAT_VERSION {
        return Err(format!(
            "manifest version {} is newer than this build supports ({MANIFEST_FORMAT_VERSION}); upgrade gpu-checkpoint",
            info.version
        ));
    }
    for f in &info.files {
        // Every reader of a manifest sees the same verdict: a path a restore would refuse to write (outside
        // the image folder) makes the manifest damaged for verify, list and gc too.
        let rel = std::path::Path::new(&f.path);
        if f.path.is_empty()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(format!("file path {:?} escapes the image folder", f.path));
        }
        let sum: u64 = f.chunks.iter().map(|c| c.len as u64).sum();
        if sum != f.size {
            return Err(format!(
                "file {} has size {} but its chunks add up to {sum}",
                f.path, f.size
            ));
        }
    }
    Ok(info)
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).rposition(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointInfo {
        CheckpointInfo {
            format: MANIFEST_FORMAT_NAME.into(),
            version: MANIFEST_FORMAT_VERSION,
            id: "20261120T233501Z-3f2a".into(),
            name: Some("job".into()),
            created: "2026-11-20T23:35:01.000Z".into(),
            chunking: Chunking {
                algorithm: "fastcdc-v2020".into(),
                min_size: 1,
                avg_size: 2,
                max_size: 3,
                hash: "blake3".into(),
                compression: "zstd".into(),
                level: 1,
            },
            stats: IngestStats::default(),
            metadata: serde_json::json!({"pid": 42, "note": "a \"quoted\" }"}),
            files: vec![FileEntry {
                path: "pages-1.img".into(),
                mode: 0o600,
                size: 10,
                chunks: vec![
                    ChunkRef {
                        id: Some(ChunkId::of(b"x")),
                        len: 6,
                    },
                    ChunkRef { id: None, len: 4 },
                ],
            }],
        }
    }

    #[test]
    fn round_trip_and_valid_json() {
        let info = sample();
        let bytes = encode(&info);
        assert_eq!(decode(&bytes).unwrap(), info);
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert!(v["manifest_checksum"]
            .as_str()
            .unwrap()
            .starts_with("blake3:"));
    }

    #[test]
    fn any_damage_is_detected() {
        let bytes = encode(&sample());
        for i in 0..bytes.len() - 1 {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            assert!(decode(&b).is_err(), "flip at byte {i} not detected");
        }
        assert!(decode(&bytes[..bytes.len() / 2]).is_err());
        assert!(decode(b"").is_err());
    }
}
