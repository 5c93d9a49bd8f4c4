//! `store_bench --parts`: the ingest's CPU time against the sum of its parts (issue 15's target: within
//! 1.2x), each measured alone on the same bytes in the same run, rounds alternated:
//!
//! - FastCDC: the store's chunker (`chunk_stream`, the store's chunk sizes and segment size) reading every
//!   image file from the page cache, as the ingest's reader does;
//! - BLAKE3: `ChunkId::of` over every chunk the ingest hashes (all but the all-zero ones);
//! - zstd: the store's `Encoder` at the store's level over every chunk the ingest compresses (the distinct
//!   hashed ones; its predictor skips random chunks without running zstd, as in the ingest);
//! - the real ingest of the same folder into an empty store (durable, all workers).
//!
//! CPU time is user + system of the whole process (`getrusage(RUSAGE_SELF)`); the parts run on one thread,
//! the ingest on its workers.

use std::collections::HashSet;
use std::fs;
use std::hint::black_box;
use std::path::{Path, PathBuf};

use gpu_checkpoint::store::chunk::{is_zero, ChunkId, Encoder};
use gpu_checkpoint::store::chunker::{chunk_stream, Known, SegmentPool};
use gpu_checkpoint::store::{NoProgress, Plan, Store, StoreOptions};

use super::{here, link_into, median, rusage, sync};

/// A chunk as the ingest sees it: which file, where, and whether it is hashed at all.
struct Cut {
    file: usize,
    offset: usize,
    len: usize,
    zero: bool,
}

/// Median user and system CPU seconds of one step over the rounds.
#[derive(Default)]
struct Step(Vec<(f64, f64)>, Vec<f64>);

impl Step {
    fn push(&mut self, user: f64, sys: f64, wall: f64) {
        self.0.push((user, sys));
        self.1.push(wall);
    }
    fn cpu(&self) -> f64 {
        median(self.0.iter().map(|(u, s)| u + s).collect())
    }
    fn user(&self) -> f64 {
        median(self.0.iter().map(|c| c.0).collect())
    }
    fn sys(&self) -> f64 {
        median(self.0.iter().map(|c| c.1).collect())
    }
    fn all(&self) -> String {
        let v: Vec<String> = self
            .0
            .iter()
            .map(|(u, s)| format!("{:.2}", u + s))
            .collect();
        v.join(" ")
    }
}

/// Runs `f` and records its user and system CPU time and wall time.
fn timed<T>(step: &mut Step, f: impl FnOnce() -> T) -> T {
    let (u0, s0) = rusage(libc::RUSAGE_SELF);
    let (r, cost) = here(f);
    let (u1, s1) = rusage(libc::RUSAGE_SELF);
    step.push(u1 - u0, s1 - s0, cost.wall);
    r
}

pub fn run(dir: &Path, src: &Path, opts: &StoreOptions, rounds: usize) {
    let mut files: Vec<PathBuf> = fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let logical: u64 = files.iter().map(|f| fs::metadata(f).unwrap().len()).sum();
    let gib = logical as f64 / (1u64 << 30) as f64;
    let params = opts.chunking;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = if opts.threads == 0 {
        threads
    } else {
        opts.threads
    };
    let plan = Plan::new(logical, threads, params, opts.zstd_level);
    let level = opts.compression_level();

    // The bytes the hash and zstd steps work on, held in memory (not timed): the ingest reads each byte
    // once, in its chunker, so reading belongs to the chunking step.
    let data: Vec<Vec<u8>> = files.iter().map(|f| fs::read(f).unwrap()).collect();
    let chunk_all = || {
        let pool = SegmentPool::new(3, plan.segment_size);
        let mut cuts = Vec::new();
        for (i, f) in files.iter().enumerate() {
            chunk_stream(fs::File::open(f).unwrap(), params, &pool, None, |p| {
                cuts.push(Cut {
                    file: i,
                    offset: p.offset as usize,
                    len: p.data().len(),
                    zero: p.known == Known::Zero,
                });
                true
            })
            .unwrap();
        }
        cuts
    };
    // What the ingest hashes and compresses, found once, not timed.
    let mut cuts = chunk_all();
    for c in cuts.iter_mut() {
        c.zero = c.zero || is_zero(&data[c.file][c.offset..c.offset + c.len]);
    }
    let bytes_of = |c: &Cut| &data[c.file][c.offset..c.offset + c.len];
    let hashed: Vec<&Cut> = cuts.iter().filter(|c| !c.zero).collect();
    let mut seen = HashSet::new();
    let distinct: Vec<(ChunkId, &Cut)> = hashed
        .iter()
        .map(|c| (ChunkId::of(bytes_of(c)), *c))
        .filter(|(id, _)| seen.insert(*id))
        .collect();
    let sum = |v: &[&Cut]| v.iter().map(|c| c.len as u64).sum::<u64>();
    let distinct_bytes: u64 = distinct.iter().map(|(_, c)| c.len as u64).sum();

    let (mut cdc, mut hash, mut zstd, mut ingest) = Default::default();
    let store_dir = dir.join("parts-store");
    for round in 0..rounds {
        eprintln!("parts round {}/{}", round + 1, rounds);
        // Each round starts with a different step, so that none always runs first (or last).
        for step in (0..4).map(|i| (i + round) % 4) {
            sync();
            match step {
                0 => {
                    let n = timed(&mut cdc, chunk_all).len();
                    assert_eq!(n, cuts.len(), "the chunker cut differently");
                }
                1 => {
                    let ids: Vec<ChunkId> = timed(&mut hash, || {
                        hashed.iter().map(|c| ChunkId::of(bytes_of(c))).collect()
                    });
                    black_box(ids);
                }
                2 => {
                    let stored = timed(&mut zstd, || {
                        let mut enc = Encoder::new(level, params.max_size as usize).unwrap();
                        distinct
                            .iter()
                            .map(|(id, c)| enc.encode(id, bytes_of(c)).0.stored_len())
                            .sum::<u64>()
                    });
                    black_box(stored);
                }
                _ => {
                    let _ = fs::remove_dir_all(&store_dir);
                    let store = Store::open(&store_dir, opts.clone()).unwrap();
                    let ing = store.begin(Some("bench")).unwrap();
                    link_into(src, ing.staging_dir());
                    timed(&mut ingest, || {
                        ing.commit(serde_json::json!({"bench": true}), &NoProgress)
                            .unwrap()
                    });
                }
            }
        }
    }
    let _ = fs::remove_dir_all(&store_dir);

    let parts = cdc.cpu() + hash.cpu() + zstd.cpu();
    println!("ingest CPU against the sum of its parts: {gib:.2} GiB, {rounds} rounds alternated");
    println!(
        "  chunks {} ({} all-zero, not hashed); hashed {} bytes; compressed (distinct) {} chunks, {} bytes",
        cuts.len(),
        cuts.len() - hashed.len(),
        sum(&hashed),
        distinct.len(),
        distinct_bytes
    );
    println!(
        "  zstd level {:?}, chunk sizes {}/{}/{} KiB, segment {} MiB, ingest workers {}",
        level,
        params.min_size >> 10,
        params.avg_size >> 10,
        params.max_size >> 10,
        plan.segment_size >> 20,
        plan.workers
    );
    let row = |label: &str, s: &Step| {
        println!(
            "  {label:<22} {:6.3} s CPU/GiB (user {:.3}, sys {:.3}; per round {}; wall {:.2} s)",
            s.cpu() / gib,
            s.user() / gib,
            s.sys() / gib,
            s.all(),
            median(s.1.clone())
        )
    };
    row("FastCDC (read + cut)", &cdc);
    row("BLAKE3", &hash);
    row("zstd (store Encoder)", &zstd);
    println!("  {:<22} {:6.3} s CPU/GiB", "sum of parts", parts / gib);
    row("ingest", &ingest);
    println!(
        "  ingest / sum of parts  {:.3}  (target <= 1.2); the rest: {:.3} s CPU/GiB",
        ingest.cpu() / parts,
        (ingest.cpu() - parts) / gib
    );
}
