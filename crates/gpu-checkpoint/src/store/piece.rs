//! What the ingest and the streaming ingest share: storing one piece of an image as a chunk
//! ([`store_piece`]), what the workers found ([`Collected`]), and what a streaming session stored
//! ([`Streamed`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use super::backend::Objects;
use super::chunk::{is_zero, ChunkId, Decoder, Encoder};
use super::chunker::{Hints, Known, Piece};
use super::error::{Error, Result};
use super::index::ChunkIndex;
use super::manifest::ChunkRef;
use super::read::{ReadAhead, Reused};

/// What the workers found, collected under one mutex (a few thousand updates per GiB: no contention).
#[derive(Default)]
pub(super) struct Collected {
    pub(super) chunks: Vec<Vec<Option<ChunkRef>>>,
    /// Stored size of every distinct non-zero chunk.
    pub(super) stored: HashMap<ChunkId, (u64, u32)>,
    pub(super) new: Vec<ChunkId>,
    pub(super) new_bytes: u64,
    pub(super) zero_bytes: u64,
    pub(super) error: Option<Error>,
}

impl Collected {
    pub(super) fn record(
        &mut self,
        file: usize,
        index: usize,
        cref: ChunkRef,
        outcome: Outcome,
        len: u64,
    ) {
        let slots = &mut self.chunks[file];
        if slots.len() <= index {
            slots.resize(index + 1, None);
        }
        slots[index] = Some(cref);
        match outcome {
            Outcome::Zero => self.zero_bytes += len,
            Outcome::Duplicate => {}
            Outcome::Present(stored) => {
                self.stored
                    .insert(cref.id.expect("non-zero"), (stored, cref.len));
            }
            Outcome::New(stored) => {
                let id = cref.id.expect("non-zero");
                self.stored.insert(id, (stored, cref.len));
                self.new.push(id);
                self.new_bytes += stored;
            }
        }
    }
}

pub(super) enum Outcome {
    Zero,
    /// Another chunk of this same ingest had the same content.
    Duplicate,
    /// Already in the store (an earlier checkpoint); stored size.
    Present(u64),
    /// Written by this ingest; stored size.
    New(u64),
}

pub(super) fn store_piece(
    backend: &dyn super::backend::Backend,
    index: Option<&ChunkIndex>,
    (enc, dec, ahead): (&mut Encoder, &mut Decoder, &mut ReadAhead),
    seen: &Mutex<HashSet<ChunkId>>,
    piece: &Piece,
    hints: Option<&Hints>,
) -> Result<(ChunkRef, Outcome)> {
    let data = piece.data();
    let len = data.len() as u32;
    if let Known::Expect(old) = piece.known {
        // Most likely the old chunk again, to be checked before it is reused: read it while hashing.
        if !seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&old)
        {
            ahead.start(old, data.len(), enc);
        }
    }
    let id = match piece.known {
        Known::Id(id) => id,
        Known::Zero => return Ok((ChunkRef { id: None, len }, Outcome::Zero)),
        Known::Nothing if is_zero(data) => return Ok((ChunkRef { id: None, len }, Outcome::Zero)),
        Known::Nothing => ChunkId::of(data),
        Known::Expect(old) => {
            let id = ChunkId::of(data);
            if id != old {
                if let Some(h) = hints {
                    h.mismatch.store(true, Ordering::Relaxed);
                }
            }
            id
        }
    };
    let cref = ChunkRef { id: Some(id), len };
    let first = seen.lock().unwrap_or_else(|p| p.into_inner()).insert(id);
    if !first {
        ahead.settle(enc);
        return Ok((cref, Outcome::Duplicate));
    }
    // Not in the index of stored chunks (object stores): certainly new, no request to find that out.
    let reused = match index {
        Some(i) if !i.may_hold(&id) => {
            ahead.settle(enc);
            Reused::Missing
        }
        _ => ahead.check(backend, &id, data, enc, dec),
    };
    match reused {
        Reused::Good(stored) => return Ok((cref, Outcome::Present(stored))),
        Reused::Missing => {}
        // Written again below, under a temporary name renamed over the damaged one, and made durable with
        // the new chunks before the manifest: the checkpoint never references what it could not restore.
        Reused::Damaged(problem) => tracing::warn!(
            "chunk {id} in the store is {problem}; writing it again from the checkpoint's bytes"
        ),
    }
    let header = if backend.aligned_objects() {
        let (header, object) = enc.encode_parts(&id, data);
        backend.put_chunk_parts(&id, &object)?;
        header
    } else {
        let (header, payload) = enc.encode(&id, data);
        backend.put_chunk(&id, &header.encode(), payload)?;
        header
    };
    if let Some(i) = index {
        i.add(id);
    }
    Ok((cref, Outcome::New(header.stored_len())))
}

/// A worker's encoder, and its decoder for checking the chunks it reuses ([`ReadAhead::check`]). The decoder's
/// buffer grows only when a compressed chunk is checked; [`Plan`] counts it anyway.
pub(super) fn coder(level: Option<i32>, max_chunk: usize) -> std::io::Result<(Encoder, Decoder)> {
    Ok((Encoder::new(level, max_chunk)?, Decoder::new(0)?))
}

/// What a streaming session stored, for [`super::Ingest::commit_streamed`].
#[derive(Default)]
pub struct Streamed {
    /// Name and size of every image received whole, in the order of `collected.chunks`.
    pub(super) files: Vec<(String, u64)>,
    pub(super) collected: Collected,
    /// When the session began: the store's work on this checkpoint started then.
    pub(super) started: Option<std::time::Instant>,
    /// The parent checkpoint's chunk boundaries the session looked up, for the staged files `commit` adds
    /// (looked up once per checkpoint).
    pub(super) hints: Option<HashMap<String, Hints>>,
}

impl Streamed {
    /// Bytes received as streams.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.1).sum()
    }

    /// Names of the images received as streams.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.files.iter().map(|f| f.0.as_str())
    }

    /// Name and size of every image received as a stream.
    pub fn files(&self) -> impl Iterator<Item = (&str, u64)> {
        self.files.iter().map(|f| (f.0.as_str(), f.1))
    }
}
