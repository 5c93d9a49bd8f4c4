//! The checkpoint store end to end: round trips, dedup, sharing, corruption, crashes, gc, permissions.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_checkpoint::store::{
    Error, MemoryBackend, NoProgress, Progress, ReadObjects, Store, StoreOptions,
};
use gpu_checkpoint::Classify;
use gpu_checkpoint::ExitStatus;
use proptest::prelude::*;

mod common;

use common::pseudo_random;

fn open(dir: &Path) -> Store {
    Store::open(&dir.join("store"), StoreOptions::small_chunks()).unwrap()
}

/// A store in a temporary folder and, beside it, a CRIU-like image folder `src` ([`criu_like`]): the
/// folder, the store and `src`.
fn store_and_images(pages: usize, seed: u64) -> (tempfile::TempDir, Store, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let src = t.path().join("src");
    fs::create_dir_all(&src).unwrap();
    criu_like(&src, pages, seed);
    (t, store, src)
}

/// A CRIU-like image folder: a big pages file of 4 KiB pages (zeros, random, repeated, text-like) and a few
/// small metadata files.
fn criu_like(dir: &Path, pages: usize, seed: u64) {
    let mut img = Vec::with_capacity(pages * 4096);
    let repeated = pseudo_random(4096, seed ^ 0xabc);
    for p in 0..pages {
        // Runs of 37 pages of one kind: memory has long zero and data runs, not alternating pages.
        match (p / 37) % 4 {
            0 => img.extend_from_slice(&[0u8; 4096]),
            1 => img.extend_from_slice(&pseudo_random(4096, seed + p as u64)),
            2 => img.extend_from_slice(&repeated),
            _ => img.extend((0..4096).map(|i| b"abcdefgh"[(i / 3 + p) % 8])),
        }
    }
    fs::write(dir.join("pages-1.img"), img).unwrap();
    fs::write(dir.join("pagemap-1.img"), pseudo_random(3000, seed + 1)).unwrap();
    fs::write(dir.join("core-1.img"), b"core").unwrap();
    fs::write(dir.join("empty.img"), b"").unwrap();
}

fn ingest(
    store: &Store,
    name: Option<&str>,
    fill: impl FnOnce(&Path),
) -> gpu_checkpoint::store::CheckpointInfo {
    let ing = store.begin(name).unwrap();
    fill(ing.staging_dir());
    ing.commit(serde_json::json!({"test": true}), &NoProgress)
        .unwrap()
}

/// Every file under `a` equals the one under `b`, and nothing is missing on either side.
fn assert_same_tree(a: &Path, b: &Path) {
    let list = |d: &Path| {
        let mut v: Vec<PathBuf> = walk(d)
            .into_iter()
            .map(|p| p.strip_prefix(d).unwrap().to_path_buf())
            .collect();
        v.sort();
        v
    };
    let (la, lb) = (list(a), list(b));
    assert_eq!(la, lb);
    for rel in la {
        assert!(
            fs::read(a.join(&rel)).unwrap() == fs::read(b.join(&rel)).unwrap(),
            "{} differs",
            rel.display()
        );
    }
}

fn walk(d: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in fs::read_dir(d).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn copy_tree(from: &Path, to: &Path) {
    for f in walk(from) {
        let rel = f.strip_prefix(from).unwrap();
        fs::create_dir_all(to.join(rel).parent().unwrap()).unwrap();
        fs::copy(&f, to.join(rel)).unwrap();
    }
}

fn chunk_files(store_dir: &Path) -> Vec<PathBuf> {
    walk(&store_dir.join("chunks"))
        .into_iter()
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect()
}

fn mode(p: &Path) -> u32 {
    fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn round_trip_of_a_criu_like_folder() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let src = t.path().join("src");
    fs::create_dir_all(src.join("sub")).unwrap();
    criu_like(&src, 1500, 1);
    fs::write(src.join("sub/nested.img"), b"nested").unwrap();
    let info = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert_eq!(info.stats.files, 5);
    assert!(info.stats.zero_bytes > 0, "zero pages are recognised");
    assert!(
        info.stats.stored_bytes < info.stats.logical_bytes,
        "compression and dedup saved space"
    );
    let out = t.path().join("out");
    let m = store.materialize(&info.id, &out, &NoProgress).unwrap();
    assert_eq!(m.logical_bytes, info.stats.logical_bytes);
    assert_same_tree(&src, &out);
    // By name too, and through the manifest path.
    assert_eq!(store.get("job").unwrap().id, info.id);
    let by_path = store
        .get_by_manifest_path(&store.manifest_path(&info.id).unwrap())
        .unwrap();
    assert_eq!(by_path, info);
    let (reopened, again) = Store::open_by_manifest_path(
        &store.manifest_path(&info.id).unwrap(),
        StoreOptions::small_chunks(),
    )
    .unwrap();
    assert_eq!(again, info);
    assert_eq!(reopened.location(), store.location());
    let elsewhere = t.path().join("copy.json");
    fs::copy(store.manifest_path(&info.id).unwrap(), &elsewhere).unwrap();
    assert!(matches!(
        Store::open_by_manifest_path(&elsewhere, StoreOptions::small_chunks()),
        Err(Error::NotFound { .. })
    ));
    assert_eq!(by_path.metadata, serde_json::json!({"test": true}));
}

#[test]
fn compression_off_stores_chunks_raw_and_round_trips() {
    let t = tempfile::tempdir().unwrap();
    let raw_opts = StoreOptions {
        compress: false,
        ..StoreOptions::small_chunks()
    };
    let store = Store::open(&t.path().join("store"), raw_opts).unwrap();
    let src = t.path().join("src");
    fs::create_dir_all(&src).unwrap();
    criu_like(&src, 600, 3);
    let info = ingest(&store, None, |d| copy_tree(&src, d));
    let manifest: serde_json::Value =
        serde_json::from_slice(&fs::read(store.manifest_path(&info.id).unwrap()).unwrap()).unwrap();
    assert_eq!(manifest["chunking"]["compression"], "none", "{manifest}");
    // Every distinct chunk is stored whole: its raw bytes plus a 16-byte header each, nothing saved.
    assert_eq!(
        info.stats.stored_bytes,
        info.stats.unique_bytes + 16 * info.stats.unique_chunks,
        "{:?}",
        info.stats
    );
    let out = t.path().join("out");
    store.materialize(&info.id, &out, &NoProgress).unwrap();
    assert_same_tree(&src, &out);
    assert!(store.verify(Some(&info.id), &NoProgress).unwrap().is_ok());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn random_and_structured_files_round_trip(
        files in prop::collection::vec(
            (0usize..4, 0usize..300_000, any::<u64>()),
            1..5,
        )
    ) {
        let t = tempfile::tempdir().unwrap();
        let store = open(t.path());
        let src = t.path().join("src");
        fs::create_dir_all(&src).unwrap();
        for (i, (kind, len, seed)) in files.iter().enumerate() {
            let data = match kind {
                0 => pseudo_random(*len, *seed),
                1 => vec![0u8; *len],
                2 => pseudo_random(4096, *seed).into_iter().cycle().take(*len).collect(),
                _ => {
                    // Random with zero holes at random places.
                    let mut d = pseudo_random(*len, *seed);
                    let hole = (*seed as usize) % (len + 1);
                    let end = (hole + 70_000).min(*len);
                    d[hole..end].fill(0);
                    d
                }
            };
            fs::write(src.join(format!("f{i}.img")), data).unwrap();
        }
        let info = ingest(&store, None, |d| copy_tree(&src, d));
        let out = t.path().join("out");
        store.materialize(&info.id, &out, &NoProgress).unwrap();
        assert_same_tree(&src, &out);
        prop_assert!(store.verify(Some(&info.id), &NoProgress).unwrap().is_ok());
    }
}

#[test]
fn unchanged_re_checkpoint_writes_nothing_and_a_small_change_only_its_chunks() {
    let (t, store, src) = store_and_images(2000, 7);
    let first = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert!(first.stats.new_bytes > 0);
    let again = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert_eq!(again.stats.new_chunks, 0);
    assert_eq!(again.stats.new_bytes, 0);
    assert_eq!(again.stats.stored_bytes, first.stats.stored_bytes);

    // Change one 4 KiB page in place: only the chunk holding it is new.
    let pages = src.join("pages-1.img");
    let mut img = fs::read(&pages).unwrap();
    let mid = img.len() / 2;
    img[mid..mid + 4096].copy_from_slice(&pseudo_random(4096, 99));
    fs::write(&pages, &img).unwrap();
    let edited = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert!(
        (1..=2).contains(&edited.stats.new_chunks),
        "{} new chunks",
        edited.stats.new_chunks
    );

    // Insert one page: the chunks around it are new, plus at most what the chunker had cut at the old
    // offsets before the first mismatch was reported (speculation, bounded by the segments in flight).
    img.splice(mid / 2..mid / 2, pseudo_random(4096, 98));
    fs::write(&pages, &img).unwrap();
    let changed = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert!(changed.stats.new_chunks >= 1);
    assert!(
        changed.stats.new_bytes * 10 < first.stats.new_bytes,
        "{} new bytes vs {} first",
        changed.stats.new_bytes,
        first.stats.new_bytes
    );
    // The name resolves to the newest.
    assert_eq!(store.get("job").unwrap().id, changed.id);
    let out = t.path().join("out");
    store.materialize("job", &out, &NoProgress).unwrap();
    assert_same_tree(&src, &out);
    let ids: Vec<String> = store.list().unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(
        ids,
        vec![first.id, again.id, edited.id, changed.id],
        "oldest first"
    );
}

#[test]
fn two_checkpoints_with_the_same_content_share_chunks() {
    let (t, store, src) = store_and_images(800, 3);
    let a = ingest(&store, Some("replica-a"), |d| copy_tree(&src, d));
    let after_a = chunk_files(&t.path().join("store")).len();
    // Same memory under other file names (another process's images: pages-9.img, ...).
    let b = ingest(&store, Some("replica-b"), |d| {
        for f in walk(&src) {
            let name = f
                .file_name()
                .unwrap()
                .to_string_lossy()
                .replace("-1.", "-9.");
            fs::copy(&f, d.join(name)).unwrap();
        }
    });
    assert_eq!(b.stats.new_bytes, 0);
    assert_eq!(chunk_files(&t.path().join("store")).len(), after_a);
    assert_eq!(a.stats.unique_chunks, after_a as u64);
    // Deleting one keeps the other whole, even after gc.
    store.delete("replica-a").unwrap();
    let r = store.gc().unwrap();
    assert_eq!(r.chunks_removed, 0);
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    store.delete(&b.id).unwrap();
    let r = store.gc().unwrap();
    assert_eq!(r.chunks_removed as usize, after_a);
    assert!(chunk_files(&t.path().join("store")).is_empty());
    assert!(store.list().unwrap().is_empty());
}

/// A checkpoint with a single big random file, its store folder, and one of its chunk files.
fn one_checkpoint(t: &Path) -> (Store, gpu_checkpoint::store::CheckpointInfo, PathBuf) {
    let store = open(t);
    let info = ingest(&store, None, |d| {
        fs::write(d.join("pages-1.img"), pseudo_random(400_000, 5)).unwrap()
    });
    let chunk = info.files[0].chunks[2].id.unwrap().to_hex();
    let path = t.join("store/chunks").join(&chunk[..2]).join(&chunk);
    (store, info, path)
}

fn expect_damage(
    store: &Store,
    info: &gpu_checkpoint::store::CheckpointInfo,
    what: &str,
    t: &Path,
) {
    let chunk = info.files[0].chunks[2].id.unwrap().to_hex();
    let out = t.join(format!("out-{what}"));
    let err = store.materialize(&info.id, &out, &NoProgress).unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid);
    let msg = err.to_string();
    assert!(
        msg.contains(&info.id)
            && msg.contains("pages-1.img")
            && msg.contains(&chunk)
            && msg.contains("#2"),
        "{msg}"
    );
    assert!(msg.contains(what), "{msg}");
    assert!(!out.exists(), "no partial image left for CRIU");
    let report = store.verify(None, &NoProgress).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    let p = &report.problems[0];
    assert_eq!(p.checkpoint, info.id);
    assert_eq!(p.file.as_deref(), Some("pages-1.img"));
    assert_eq!(p.chunk.as_deref(), Some(chunk.as_str()));
    assert_eq!(p.index, Some(2));
    assert!(p.problem.contains(what), "{}", p.problem);
    assert_eq!(
        report.into_result().unwrap_err().exit_status(),
        ExitStatus::CheckpointInvalid
    );
}

#[test]
fn flipped_byte_is_detected() {
    let t = tempfile::tempdir().unwrap();
    let (store, info, chunk) = one_checkpoint(t.path());
    let mut b = fs::read(&chunk).unwrap();
    let n = b.len();
    b[n - 100] ^= 0x20;
    fs::write(&chunk, b).unwrap();
    expect_damage(&store, &info, "damaged", t.path());
}

#[test]
fn truncated_chunk_is_detected() {
    let t = tempfile::tempdir().unwrap();
    let (store, info, chunk) = one_checkpoint(t.path());
    let b = fs::read(&chunk).unwrap();
    fs::write(&chunk, &b[..b.len() - 10]).unwrap();
    expect_damage(&store, &info, "truncated", t.path());
    // A re-ingest of the same content repairs the store: the truncated chunk is not trusted for dedup.
    let again = ingest(&store, None, |d| {
        fs::write(d.join("pages-1.img"), pseudo_random(400_000, 5)).unwrap()
    });
    assert_eq!(again.stats.new_chunks, 1);
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
}

/// Issue 13, item 1: a re-checkpoint of unchanged data must not reference a stored chunk that is damaged
/// while its header and size still look right (a flipped payload byte): the checkpoint has the right bytes
/// in hand, so it verifies what it reuses and writes a damaged chunk again. Both encodings: a raw chunk
/// (random pages) and a zstd one (text-like pages), on the local and the memory backend.
/// Where the local store under `t` keeps chunk `id`.
fn chunk_path(t: &Path, id: &gpu_checkpoint::store::chunk::ChunkId) -> PathBuf {
    let hex = id.to_hex();
    t.join("store/chunks").join(&hex[..2]).join(&hex)
}

/// How many problems `verify` finds in checkpoint `id`.
fn problems(store: &Store, id: &str) -> usize {
    store.verify(Some(id), &NoProgress).unwrap().problems.len()
}

#[test]
fn a_re_checkpoint_rewrites_a_damaged_chunk_it_would_reuse() {
    let (t, store, src) = store_and_images(600, 11);
    let first = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    let pages = first
        .files
        .iter()
        .find(|f| f.path == "pages-1.img")
        .unwrap();
    // One raw and one compressed chunk (their payload sizes tell them apart).
    let (mut raw, mut zstd) = (None, None);
    for c in pages
        .chunks
        .iter()
        .filter_map(|c| c.id.map(|id| (id, c.len)))
    {
        let path = chunk_path(t.path(), &c.0);
        let stored = fs::metadata(&path).unwrap().len();
        if stored == 16 + c.1 as u64 {
            raw.get_or_insert(path);
        } else {
            zstd.get_or_insert(path);
        }
    }
    let (raw, zstd) = (raw.expect("a raw chunk"), zstd.expect("a zstd chunk"));
    for path in [&raw, &zstd] {
        let mut b = fs::read(path).unwrap();
        let n = b.len();
        b[n - 7] ^= 0x40;
        fs::write(path, b).unwrap();
    }
    assert_eq!(problems(&store, &first.id), 2);

    let again = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert_eq!(
        again.stats.new_chunks, 2,
        "the two damaged chunks are written again"
    );
    let report = store.verify(Some(&again.id), &NoProgress).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    let out = t.path().join("out");
    store.materialize(&again.id, &out, &NoProgress).unwrap();
    assert_same_tree(&src, &out);
    // The rewrite repaired the older checkpoint too, and left the files private.
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    assert_eq!(mode(&raw), 0o600);
    assert_eq!(mode(&zstd), 0o600);
    // A third, unchanged checkpoint finds every chunk good and writes none.
    let third = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert_eq!(third.stats.new_chunks, 0);

    // The same through a backend without files (the verification reads the object through the trait).
    let mem = Arc::new(MemoryBackend::new(&t.path().join("staging")));
    let store = Store::with_backend(mem.clone(), StoreOptions::small_chunks()).unwrap();
    let data = pseudo_random(100_000, 4);
    let info = ingest(&store, None, |d| fs::write(d.join("a.img"), &data).unwrap());
    let first = info.files[0].chunks[1].id.unwrap();
    assert!(mem.with_chunk(&first, |c| c[20] ^= 1));
    let again = ingest(&store, None, |d| fs::write(d.join("a.img"), &data).unwrap());
    assert_eq!(again.stats.new_chunks, 1);
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
}

/// What a re-checkpoint does with compressed chunks, which it checks by their checksum trailer (format
/// version 2) instead of decompressing them, and with those of earlier builds (version 1, no trailer),
/// which it still decodes and compares.
#[test]
fn a_re_checkpoint_checks_compressed_chunks_by_their_trailer_and_older_ones_in_full() {
    let (t, store, src) = store_and_images(600, 12);
    let first = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    let mut zstd: Vec<PathBuf> = Vec::new();
    for f in &first.files {
        for c in f.chunks.iter().filter_map(|c| c.id.map(|id| (id, c.len))) {
            let path = chunk_path(t.path(), &c.0);
            let stored = fs::read(&path).unwrap();
            if stored.len() != 16 + c.1 as usize && !zstd.contains(&path) {
                assert_eq!(
                    stored[4], 2,
                    "compressed chunks are written in format version 2"
                );
                zstd.push(path);
            }
        }
    }
    assert!(zstd.len() >= 6, "{} compressed chunks", zstd.len());
    let edit = |path: &Path, f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = fs::read(path).unwrap();
        f(&mut b);
        fs::write(path, b).unwrap();
    };
    // Version 1 as earlier builds wrote it: the same header and payload, no trailer.
    let to_v1 = |b: &mut Vec<u8>| {
        b[4] = 1;
        b.truncate(b.len() - 32);
    };
    let mid = |b: &[u8]| 16 + (b.len() - 48) / 2;
    // A flipped payload byte, a flipped trailer byte, another chunk's intact object in its place.
    edit(&zstd[0], &|b| {
        let i = mid(b);
        b[i] ^= 0x10;
    });
    edit(&zstd[1], &|b| {
        let n = b.len();
        b[n - 1] ^= 0x01;
    });
    fs::copy(&zstd[5], &zstd[2]).unwrap();
    // An intact version 1 object is accepted as it is; a damaged one is found the full way.
    edit(&zstd[3], &to_v1);
    edit(&zstd[4], &|b| {
        to_v1(b);
        let i = 16 + (b.len() - 16) / 2;
        b[i] ^= 0x10;
    });
    let v1 = fs::read(&zstd[3]).unwrap();
    // Every reference to the four damaged chunks (a chunk of repeated pages recurs in the image).
    let damaged = [&zstd[0], &zstd[1], &zstd[2], &zstd[4]];
    let references = first
        .files
        .iter()
        .flat_map(|f| f.chunks.iter().filter_map(|c| c.id))
        .filter(|id| damaged.contains(&&chunk_path(t.path(), id)))
        .count();
    assert!(references >= 4);
    assert_eq!(problems(&store, &first.id), references);

    let again = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert_eq!(
        again.stats.new_chunks, 4,
        "the four damaged chunks, and only those, are written again"
    );
    assert_eq!(fs::read(&zstd[3]).unwrap(), v1, "left as it was");
    for path in [&zstd[0], &zstd[1], &zstd[2], &zstd[4]] {
        assert_eq!(fs::read(path).unwrap()[4], 2, "rewritten in version 2");
    }
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    let out = t.path().join("out");
    store.materialize(&again.id, &out, &NoProgress).unwrap();
    assert_same_tree(&src, &out);
    let third = ingest(&store, Some("job"), |d| copy_tree(&src, d));
    assert_eq!(third.stats.new_chunks, 0);
}

#[test]
fn missing_chunk_is_detected() {
    let t = tempfile::tempdir().unwrap();
    let (store, info, chunk) = one_checkpoint(t.path());
    fs::remove_file(&chunk).unwrap();
    expect_damage(&store, &info, "missing", t.path());
}

#[test]
fn damaged_manifest_is_detected_and_can_be_deleted() {
    let t = tempfile::tempdir().unwrap();
    let (store, info, _) = one_checkpoint(t.path());
    let good = ingest(&store, Some("good"), |d| {
        fs::write(d.join("x.img"), b"fine").unwrap()
    });
    let path = store.manifest_path(&info.id).unwrap();
    let mut b = fs::read(&path).unwrap();
    let i = b.len() / 2;
    b[i] = if b[i] == b'7' { b'8' } else { b'7' };
    fs::write(&path, b).unwrap();
    let err = store.get(&info.id).unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid);
    assert!(
        err.to_string().contains(&info.id) && err.to_string().contains("manifest"),
        "{err}"
    );
    let err = store
        .materialize(&info.id, &t.path().join("out"), &NoProgress)
        .unwrap_err();
    assert!(matches!(err, Error::DamagedManifest { .. }), "{err}");
    // list shows only the valid one; verify reports the damaged one.
    let ids: Vec<String> = store.list().unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(ids, vec![good.id.clone()]);
    let report = store.verify(None, &NoProgress).unwrap();
    assert_eq!(report.problems.len(), 1);
    assert_eq!(report.problems[0].checkpoint, info.id);
    assert!(report.problems[0].problem.contains("manifest"));
    // gc refuses to guess what a damaged manifest referenced.
    assert!(matches!(
        store.gc().unwrap_err(),
        Error::DamagedManifest { .. }
    ));
    assert!(store.delete_damaged(&info.id).unwrap());
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    store.gc().unwrap();
    assert!(store.verify(Some("good"), &NoProgress).unwrap().is_ok());
}

#[test]
fn truncated_manifest_is_detected() {
    let t = tempfile::tempdir().unwrap();
    let (store, info, _) = one_checkpoint(t.path());
    let path = store.manifest_path(&info.id).unwrap();
    let b = fs::read(&path).unwrap();
    fs::write(&path, &b[..b.len() - 30]).unwrap();
    assert!(matches!(
        store.get(&info.id).unwrap_err(),
        Error::DamagedManifest { .. }
    ));
}

#[test]
fn permissions_are_private() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("store");
    let store = open(t.path());
    let ing = store.begin(None).unwrap();
    assert_eq!(mode(ing.staging_dir()), 0o700);
    fs::write(
        ing.staging_dir().join("pages-1.img"),
        pseudo_random(200_000, 1),
    )
    .unwrap();
    let info = ing.commit(serde_json::Value::Null, &NoProgress).unwrap();
    for d in [
        root.clone(),
        root.join("chunks"),
        root.join("manifests"),
        root.join("staging"),
    ] {
        assert_eq!(mode(&d), 0o700, "{}", d.display());
    }
    for f in chunk_files(&root) {
        assert_eq!(mode(&f), 0o600, "{}", f.display());
        assert_eq!(mode(f.parent().unwrap()), 0o700);
    }
    assert_eq!(mode(&store.manifest_path(&info.id).unwrap()), 0o600);
    assert_eq!(mode(&root.join("store.json")), 0o600);
    let out = t.path().join("out");
    store.materialize(&info.id, &out, &NoProgress).unwrap();
    assert_eq!(mode(&out), 0o700);
    assert_eq!(mode(&out.join("pages-1.img")), 0o600);
}

#[test]
fn abort_and_drop_leave_nothing() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let a = store.begin(None).unwrap();
    let (sa, ida) = (a.staging_dir().to_path_buf(), a.id().to_owned());
    fs::write(sa.join("x.img"), b"x").unwrap();
    a.abort().unwrap();
    assert!(!sa.exists());
    let b = store.begin(None).unwrap();
    let sb = b.staging_dir().to_path_buf();
    assert_ne!(b.id(), ida);
    drop(b);
    assert!(!sb.exists());
    assert!(store.list().unwrap().is_empty());
    assert!(matches!(
        store.get(&ida).unwrap_err(),
        Error::NotFound { .. }
    ));
}

#[test]
fn ids_are_unique_and_sortable() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let mut ids = Vec::new();
    for _ in 0..20 {
        let i = store.begin(None).unwrap();
        ids.push(i.id().to_owned());
        i.abort().unwrap();
    }
    let set: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(set.len(), ids.len());
    for id in &ids {
        assert_eq!(id.len(), "20261120T233501Z-3f2a9c1b".len(), "{id}");
        assert!(id.as_bytes()[8] == b'T' && id.as_bytes()[15] == b'Z');
    }
}

#[test]
fn open_refuses_foreign_folders_and_newer_formats() {
    let t = tempfile::tempdir().unwrap();
    let foreign = t.path().join("foreign");
    fs::create_dir_all(&foreign).unwrap();
    fs::write(foreign.join("important.txt"), b"x").unwrap();
    assert!(matches!(
        Store::open(&foreign, StoreOptions::small_chunks()),
        Err(Error::BadStore { .. })
    ));
    let s = t.path().join("store");
    open(t.path());
    fs::write(
        s.join("store.json"),
        br#"{"format":"gpu-checkpoint-store","version":99}"#,
    )
    .unwrap();
    let err = Store::open(&s, StoreOptions::small_chunks()).err().unwrap();
    assert!(err.to_string().contains("newer"), "{err}");
}

/// Builds of store format version 1 read compressed chunks of chunk format version 2 as damaged: a store
/// this build writes is marked version 2, which they refuse ("newer than this build supports"), and a
/// version 1 store is marked so when this build opens it, before anything is written.
#[test]
fn a_store_is_marked_with_a_version_older_builds_refuse() {
    let t = tempfile::tempdir().unwrap();
    let s = t.path().join("store");
    let marker = |s: &Path| -> serde_json::Value {
        serde_json::from_slice(&fs::read(s.join("store.json")).unwrap()).unwrap()
    };
    let store = open(t.path());
    let info = ingest(&store, None, |d| {
        fs::write(d.join("pages-1.img"), pseudo_random(300_000, 8)).unwrap()
    });
    assert_eq!(marker(&s)["version"], 2, "older builds accept 1 only");
    // A store of an earlier build, opened by this one: marked version 2, and still read as before.
    fs::write(
        s.join("store.json"),
        br#"{"format":"gpu-checkpoint-store","version":1}"#,
    )
    .unwrap();
    let store = Store::open(&s, StoreOptions::small_chunks()).unwrap();
    assert_eq!(marker(&s)["version"], 2);
    assert_eq!(mode(&s.join("store.json")), 0o600);
    assert!(store.verify(Some(&info.id), &NoProgress).unwrap().is_ok());
}

#[test]
fn unwritable_storage_is_exit_status_6() {
    let t = tempfile::tempdir().unwrap();
    let mem = Arc::new(MemoryBackend::new(&t.path().join("staging")));
    mem.fail_writes.store(true, Ordering::Relaxed);
    let store = Store::with_backend(mem.clone(), StoreOptions::small_chunks()).unwrap();
    let err = store.check_writable().unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Storage);
    // Nor can a checkpoint begin (its writer's lease cannot be put): the same status.
    let err = store
        .begin(None)
        .err()
        .expect("begin fails on a full store");
    assert_eq!(err.exit_status(), ExitStatus::Storage, "{err}");
    // A full disk during commit: an error with status 6, nothing listed, staging removed.
    mem.fail_writes.store(false, Ordering::Relaxed);
    let ing = store.begin(None).unwrap();
    mem.fail_writes.store(true, Ordering::Relaxed);
    let staging = ing.staging_dir().to_path_buf();
    fs::write(staging.join("pages-1.img"), pseudo_random(300_000, 2)).unwrap();
    let err = ing
        .commit(serde_json::Value::Null, &NoProgress)
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Storage, "{err}");
    assert!(store.list().unwrap().is_empty());
    assert!(!staging.exists());
}

#[test]
fn memory_backend_round_trips_and_detects_damage() {
    let t = tempfile::tempdir().unwrap();
    let mem = Arc::new(MemoryBackend::new(&t.path().join("staging")));
    let store = Store::with_backend(mem.clone(), StoreOptions::small_chunks()).unwrap();
    let data = pseudo_random(100_000, 4);
    let info = ingest(&store, None, |d| fs::write(d.join("a.img"), &data).unwrap());
    let out = t.path().join("out");
    store.materialize(&info.id, &out, &NoProgress).unwrap();
    assert_eq!(fs::read(out.join("a.img")).unwrap(), data);
    let mut n = 0;
    store.backend().list_chunks(&mut |_, _| n += 1).unwrap();
    assert_eq!(n as u64, info.stats.unique_chunks);

    let first = info.files[0].chunks[0].id.unwrap();
    assert!(mem.with_chunk(&first, |c| {
        let last = c.len() - 1;
        c[last] ^= 1;
    }));
    let report = store.verify(None, &NoProgress).unwrap();
    assert_eq!(report.problems.len(), 1);
    assert_eq!(
        report.problems[0].chunk.as_deref(),
        Some(first.to_hex().as_str())
    );
    let second = info.files[0].chunks[1].id.unwrap();
    assert!(mem.remove_chunk(&second));
    let err = store
        .materialize(&info.id, &t.path().join("out2"), &NoProgress)
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid);
    assert!(mem.with_manifest(&info.id, |m| m[10] ^= 1));
    assert!(matches!(
        store.get(&info.id),
        Err(Error::DamagedManifest { .. })
    ));
}

/// Progress that counts and can slow an ingest down (to widen race windows in tests).
struct Slow {
    done: AtomicU64,
    delay: Duration,
    marker: Option<(PathBuf, u64)>,
}

impl Progress for Slow {
    fn start(&self, _: &str, _: u64) {}
    fn advance(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::SeqCst) + bytes;
        if let Some((path, at)) = &self.marker {
            if done >= *at && !path.exists() {
                fs::write(path, b"midway").unwrap();
            }
        }
        std::thread::sleep(self.delay);
    }
    fn finish(&self) {}
}

#[test]
fn gc_with_a_concurrent_writer_keeps_what_the_writer_needs() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let data = pseudo_random(1_500_000, 8);
    // A deleted checkpoint leaves chunks that a new writer will find "already stored" and reuse.
    let old = ingest(&store, None, |d| {
        fs::write(d.join("pages-1.img"), &data).unwrap()
    });
    store.delete(&old.id).unwrap();
    let ing = store.begin(Some("new")).unwrap();
    fs::write(ing.staging_dir().join("pages-1.img"), &data).unwrap();
    let gc_store = store.clone();
    let started = Instant::now();
    let (info, gc_report) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let slow = Slow {
                done: AtomicU64::new(0),
                delay: Duration::from_millis(5),
                marker: None,
            };
            ing.commit(serde_json::Value::Null, &slow).unwrap()
        });
        std::thread::sleep(Duration::from_millis(30));
        let gc = s.spawn(move || gc_store.gc().unwrap());
        (writer.join().unwrap(), gc.join().unwrap())
    });
    assert!(started.elapsed() >= Duration::from_millis(30));
    assert_eq!(info.stats.new_chunks, 0, "the writer reused the old chunks");
    assert!(gc_report.waited_ms > 0, "gc waited for the writer");
    assert_eq!(
        gc_report.chunks_removed, 0,
        "nothing the new checkpoint references was deleted"
    );
    let report = store.verify(Some("new"), &NoProgress).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    let out = t.path().join("out");
    store.materialize("new", &out, &NoProgress).unwrap();
    assert_eq!(fs::read(out.join("pages-1.img")).unwrap(), data);
}

const CRASH_ENV: &str = "GPU_CHECKPOINT_TEST_CRASH_STORE";

/// Not a test on its own: the writer process that `crash_during_ingest_leaves_the_store_consistent` kills.
#[test]
#[ignore = "helper process for crash_during_ingest_leaves_the_store_consistent"]
fn crash_writer_child() {
    let Ok(dir) = std::env::var(CRASH_ENV) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let store = Store::open(&dir.join("store"), StoreOptions::small_chunks()).unwrap();
    let ing = store.begin(Some("doomed")).unwrap();
    fs::write(
        ing.staging_dir().join("pages-1.img"),
        pseudo_random(8 << 20, 77),
    )
    .unwrap();
    let slow = Slow {
        done: AtomicU64::new(0),
        delay: Duration::from_millis(20),
        marker: Some((dir.join("midway"), 2 << 20)),
    };
    ing.commit(serde_json::Value::Null, &slow).unwrap();
    // Only reached if the parent failed to kill us.
    fs::write(dir.join("finished"), b"").unwrap();
}

#[test]
fn crash_during_ingest_leaves_the_store_consistent() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let kept = ingest(&store, Some("kept"), |d| criu_like(d, 300, 1));
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_writer_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CRASH_ENV, t.path())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !t.path().join("midway").exists() {
        assert!(Instant::now() < deadline, "writer never got midway");
        assert!(child.try_wait().unwrap().is_none(), "writer exited early");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL: no destructors, no cleanup
    child.wait().unwrap();
    assert!(!t.path().join("finished").exists());

    // The killed writer left chunks and its staging folder, but no checkpoint.
    assert!(chunk_files(&t.path().join("store")).len() as u64 > kept.stats.unique_chunks);
    assert_eq!(
        fs::read_dir(t.path().join("store/staging"))
            .unwrap()
            .count(),
        1
    );
    let listed: Vec<String> = store.list().unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(listed, vec![kept.id.clone()]);
    assert!(matches!(store.get("doomed"), Err(Error::NotFound { .. })));
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());

    // gc removes the leftovers (its lock is free: the dead writer's flock died with it).
    let r = store.gc().unwrap();
    assert_eq!(r.stale_staging_removed, 1);
    assert!(r.chunks_removed > 0);
    assert_eq!(
        chunk_files(&t.path().join("store")).len() as u64,
        kept.stats.unique_chunks
    );
    assert_eq!(
        fs::read_dir(t.path().join("store/staging"))
            .unwrap()
            .count(),
        0
    );
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    let again = ingest(&store, Some("after"), |d| criu_like(d, 100, 2));
    assert!(store.verify(Some(&again.id), &NoProgress).unwrap().is_ok());
}

#[test]
fn concurrent_writers_of_the_same_content_both_commit() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let data = pseudo_random(1_200_000, 31);
    let infos: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let (store, data) = (store.clone(), &data);
                s.spawn(move || {
                    let name = format!("writer-{i}");
                    ingest(&store, Some(&name), |d| {
                        fs::write(d.join("pages-1.img"), data).unwrap()
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(store.list().unwrap().len(), 3);
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    // Whoever raced, the store holds each chunk once.
    assert_eq!(
        chunk_files(&t.path().join("store")).len() as u64,
        infos[0].stats.unique_chunks
    );
    for info in &infos {
        let out = t.path().join(&info.id);
        store.materialize(&info.id, &out, &NoProgress).unwrap();
        assert_eq!(fs::read(out.join("pages-1.img")).unwrap(), data);
    }
}

/// A real full filesystem (a small tmpfs): the error is "storage" (exit 6), nothing is listed, the staging
/// folder is gone, and what was written is garbage that gc removes.
#[test]
fn full_disk_during_ingest_is_a_storage_error_and_leaves_the_store_consistent() {
    let t = tempfile::tempdir().unwrap();
    let mnt = t.path().join("small");
    fs::create_dir_all(&mnt).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=6m,mode=0700", "tmpfs"])
        .arg(&mnt)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !common::runs_here(
        mounted,
        "cannot mount a tmpfs here (needs root)",
        "CI must run this test as root (mount tmpfs)",
    ) {
        return;
    }
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0).status();
        }
    }
    let _guard = Unmount(&mnt);
    let store = Store::open(&mnt.join("store"), StoreOptions::small_chunks()).unwrap();
    store.check_writable().unwrap();
    let small = ingest(&store, Some("fits"), |d| {
        fs::write(d.join("a.img"), pseudo_random(200_000, 1)).unwrap()
    });
    let ing = store.begin(Some("too-big")).unwrap();
    let staging = ing.staging_dir().to_path_buf();
    // 3 MiB of images fit in staging; storing them next to the staging copy does not.
    fs::write(staging.join("pages-1.img"), pseudo_random(3 << 20, 2)).unwrap();
    let err = ing
        .commit(serde_json::Value::Null, &NoProgress)
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Storage, "{err}");
    assert!(!staging.exists());
    let ids: Vec<String> = store.list().unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(ids, vec![small.id.clone()]);
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    store.gc().unwrap();
    assert_eq!(
        chunk_files(&mnt.join("store")).len() as u64,
        small.stats.unique_chunks
    );
}

/// Images that arrive as pipes (CRIU's image streamer) are stored like staged files: the same chunks, and
/// they come back byte for byte, through `materialize` and through `stream_file`. The "CRIU" thread writes
/// two page images and a pagemap interleaved, as CRIU does, so every stream must be drained while the
/// others wait (a second page image at once goes the in-memory way); an image over 8 MiB that is not a
/// page image is spilled to the staging folder.
#[test]
fn streamed_images_are_stored_like_staged_ones() {
    use std::io::Write;
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    criu_like(&src, 700, 7);
    fs::write(src.join("pages-2.img"), pseudo_random(300 * 4096, 8)).unwrap();
    fs::write(
        src.join("tmpfs-dev-9.tar.gz.img"),
        pseudo_random(9 << 20, 9),
    )
    .unwrap();
    let store = open(t.path());
    let staged = ingest(&store, None, |d| copy_tree(&src, d));

    let ing = store.begin(None).unwrap();
    let streams = ing.streams(16 << 20);
    let names = [
        "pages-1.img",
        "pagemap-1.img",
        "pages-2.img",
        "core-1.img",
        "empty.img",
        "tmpfs-dev-9.tar.gz.img",
    ];
    std::thread::scope(|s| {
        for _ in 0..streams.workers() {
            s.spawn(|| streams.work(&NoProgress));
        }
        let mut writers = Vec::new();
        let mut readers = Vec::new();
        for name in names {
            let (r, w) = std::io::pipe().unwrap();
            let streams = &streams;
            readers.push(s.spawn(move || streams.add(name, r)));
            writers.push((fs::read(src.join(name)).unwrap(), w));
        }
        // Interleaved, 4 KiB at a time: an image left undrained would block this thread for good.
        let mut pos = vec![0usize; writers.len()];
        loop {
            let mut progress = false;
            for (i, (data, w)) in writers.iter_mut().enumerate() {
                if pos[i] < data.len() {
                    let end = (pos[i] + 4096).min(data.len());
                    w.write_all(&data[pos[i]..end]).unwrap();
                    pos[i] = end;
                    progress = true;
                }
            }
            if !progress {
                break;
            }
        }
        drop(writers);
        for r in readers {
            r.join().unwrap().unwrap();
        }
        streams.close();
    });
    let streamed = streams.finish().unwrap();
    assert_eq!(
        streamed.names().count(),
        names.len() - 1,
        "the large archive was spilled"
    );
    let info = ing
        .commit_streamed(streamed, serde_json::json!({"test": true}), &NoProgress)
        .unwrap();

    let files = |i: &gpu_checkpoint::store::CheckpointInfo| {
        i.files
            .iter()
            .map(|f| (f.path.clone(), f.size, f.chunks.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        files(&info),
        files(&staged),
        "the same images, cut the same way"
    );
    let out = t.path().join("out");
    store.materialize(&info.id, &out, &NoProgress).unwrap();
    assert_same_tree(&src, &out);
    for name in names {
        let mut sent = Vec::new();
        let n = store
            .stream_file(&info, name, &mut sent, &NoProgress)
            .unwrap()
            .unwrap();
        assert_eq!(n as usize, sent.len());
        assert_eq!(sent, fs::read(src.join(name)).unwrap(), "{name}");
    }
    assert!(store
        .stream_file(&info, "absent.img", &mut Vec::new(), &NoProgress)
        .unwrap()
        .is_none());
}

/// `stream_file` hands each verified chunk's buffer to its writer instead of copying it, so buffers change
/// roles (read buffer, decoder output, writer's bytes) from chunk to chunk: a long image alternating raw and
/// compressed chunks, with a few worker threads, must still come out byte for byte.
#[test]
fn stream_file_of_alternating_raw_and_compressed_chunks_is_exact() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    let mut img = Vec::new();
    for i in 0..24u64 {
        let len = (3 << 20) + (i as usize * 4096);
        if i % 2 == 0 {
            img.extend_from_slice(&pseudo_random(len, 100 + i));
        } else {
            img.extend((0..len).map(|k| b"0123456789abcdef"[(k / 5 + i as usize) % 16]));
        }
    }
    fs::write(src.join("pages-1.img"), &img).unwrap();
    let store = Store::open(
        &t.path().join("store"),
        StoreOptions {
            threads: 3,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let info = ingest(&store, None, |d| copy_tree(&src, d));
    let mut sent = Vec::new();
    store
        .stream_file(&info, "pages-1.img", &mut sent, &NoProgress)
        .unwrap()
        .unwrap();
    assert!(
        info.stats.compression_ratio > 1.2,
        "some chunks are compressed"
    );
    assert!(sent == img, "the streamed image differs from the source");
}

/// A damaged chunk stops `stream_file` before any of its bytes are written, naming the chunk.
#[test]
fn stream_file_writes_nothing_of_a_damaged_chunk() {
    let t = tempfile::tempdir().unwrap();
    // Its third chunk (random data: every chunk is stored) is the one `one_checkpoint` points at.
    let (store, info, path) = one_checkpoint(t.path());
    let pages = &info.files[0];
    let before: u64 = pages.chunks[..2].iter().map(|c| c.len as u64).sum();
    let hex = pages.chunks[2].id.unwrap().to_hex();
    let mut bytes = fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    fs::write(&path, bytes).unwrap();
    let mut sent = Vec::new();
    let err = store
        .stream_file(&info, "pages-1.img", &mut sent, &NoProgress)
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid);
    assert!(err.to_string().contains(&hex), "{err}");
    assert!(
        sent.len() as u64 <= before,
        "{} bytes sent, the damaged chunk starts at {before}",
        sent.len()
    );
}

/// An image sent twice in one streamed checkpoint counts once, with the later content (as a file rewritten
/// in a staging folder would).
#[test]
fn an_image_streamed_twice_keeps_the_later_copy() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let ing = store.begin(None).unwrap();
    let streams = ing.streams(1 << 20);
    std::thread::scope(|s| {
        for _ in 0..streams.workers() {
            s.spawn(|| streams.work(&NoProgress));
        }
        streams.add("stats-dump", &b"first"[..]).unwrap();
        streams.add("stats-dump", &b"second copy"[..]).unwrap();
        streams.close();
    });
    let streamed = streams.finish().unwrap();
    let info = ing
        .commit_streamed(streamed, serde_json::json!({}), &NoProgress)
        .unwrap();
    assert_eq!(info.files.len(), 1);
    let mut sent = Vec::new();
    store
        .stream_file(&info, "stats-dump", &mut sent, &NoProgress)
        .unwrap();
    assert_eq!(sent, b"second copy");
}

/// `stream_file_to_pipe` (a streamed restore's path: raw chunks verified in their files and spliced) sends
/// exactly the image through a real pipe, and stops before a damaged raw chunk's bytes.
#[test]
fn stream_file_to_pipe_splices_verified_raw_chunks_and_stops_at_damage() {
    use std::io::Read;
    let t = tempfile::tempdir().unwrap();
    let (store, info, damaged_path) = one_checkpoint(t.path());
    let source = pseudo_random(400_000, 5);
    let through_pipe = |store: &Store| {
        let (mut r, w) = std::io::pipe().unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            r.read_to_end(&mut got).unwrap();
            got
        });
        let w = fs::File::from(std::os::fd::OwnedFd::from(w));
        let result = store.stream_file_to_pipe(&info, "pages-1.img", &w, &NoProgress);
        drop(w);
        (result, reader.join().unwrap())
    };
    let (result, got) = through_pipe(&store);
    assert_eq!(result.unwrap(), Some(source.len() as u64));
    assert_eq!(got, source);

    // The third chunk (random data: stored raw) damaged in place.
    let mut bytes = fs::read(&damaged_path).unwrap();
    assert_eq!(bytes[5], 0, "a raw chunk");
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    fs::write(&damaged_path, bytes).unwrap();
    let before: u64 = info.files[0].chunks[..2].iter().map(|c| c.len as u64).sum();
    let (result, got) = through_pipe(&store);
    let err = result.unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid, "{err}");
    assert!(
        got.len() as u64 <= before,
        "{} bytes sent, damage at {before}",
        got.len()
    );
    assert_eq!(got[..], source[..got.len()]);
}

/// A name stands for its newest checkpoint: when that one's manifest is damaged, the name is refused (exit
/// 7) instead of silently meaning an older checkpoint (restore would bring back the wrong one, delete
/// would delete the intact one).
#[test]
fn a_name_whose_newest_checkpoint_is_damaged_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let store = open(&t.path().join("store"));
    let older = ingest(&store, Some("job"), |d| {
        fs::write(d.join("x.img"), b"old").unwrap()
    });
    std::thread::sleep(Duration::from_millis(5));
    let newer = ingest(&store, Some("job"), |d| {
        fs::write(d.join("x.img"), b"new").unwrap()
    });
    let other = ingest(&store, Some("other"), |d| {
        fs::write(d.join("x.img"), b"o").unwrap()
    });
    assert_eq!(store.get("job").unwrap().id, newer.id);

    // A flipped byte in the newest's chunk list: its JSON still reads, and says it is "job".
    let path = store.manifest_path(&newer.id).unwrap();
    let intact = fs::read(&path).unwrap();
    let text = String::from_utf8(intact.clone()).unwrap();
    fs::write(&path, text.replacen("\"x.img\"", "\"y.img\"", 1)).unwrap();
    let err = store.get("job").unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid, "{err}");
    assert!(err.to_string().contains(&newer.id), "{err}");
    // Another name is not affected, and the older checkpoint stays reachable by its id.
    assert_eq!(store.get("other").unwrap().id, other.id);
    assert_eq!(store.get(&older.id).unwrap().id, older.id);

    // Unreadable as JSON: nothing rules it out either.
    fs::write(&path, &intact[..intact.len() / 2]).unwrap();
    assert_eq!(
        store.get("job").unwrap_err().exit_status(),
        ExitStatus::CheckpointInvalid
    );
    // Once the damaged one is deleted, the name means the older one again.
    assert!(store.delete_damaged(&newer.id).unwrap());
    assert_eq!(store.get("job").unwrap().id, older.id);
}

/// Runs `f` on a thread and fails the test if it has not returned within 20 s (it would hang forever).
fn within_20s<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("{what} hangs"))
}

/// Special files planted in a store's folders: a FIFO in place of a chunk or a manifest hung verify, list,
/// restore and gc forever; a chunk linked to /dev/zero made a restore read without end; a folder named like a
/// manifest broke every command. Only regular files are store objects: the others are missing or damaged.
#[test]
fn special_files_in_a_store_neither_hang_nor_exhaust_memory() {
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let root = t.path().join("store");
    let info = ingest(&store, Some("job"), |d| criu_like(d, 64, 7));
    let chunks = chunk_files(&root);
    assert!(chunks.len() >= 2, "{chunks:?}");
    let mkfifo = |p: &Path| {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    };
    // A chunk replaced by a FIFO, another by a link to /dev/zero.
    fs::remove_file(&chunks[0]).unwrap();
    mkfifo(&chunks[0]);
    fs::remove_file(&chunks[1]).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &chunks[1]).unwrap();
    // A FIFO and a folder named like manifests.
    mkfifo(
        &root
            .join("manifests")
            .join("20261124T000000Z-fifo0000.json"),
    );
    fs::create_dir(
        root.join("manifests")
            .join("20261124T000001Z-dir00000.json"),
    )
    .unwrap();

    let id = info.id.clone();
    let r = t.path().to_path_buf();
    let (listed, verified) = within_20s("list and verify", move || {
        let store = open(&r);
        let listed: Vec<String> = store.list().unwrap().into_iter().map(|i| i.id).collect();
        (listed, store.verify(Some(&id), &NoProgress).unwrap())
    });
    assert_eq!(listed, vec![info.id.clone()]);
    assert!(!verified.is_ok(), "damaged chunks are reported");
    let r = t.path().to_path_buf();
    let id = info.id.clone();
    let out = t.path().join("out");
    let err = within_20s("materialize", move || {
        open(&r).materialize(&id, &out, &NoProgress).unwrap_err()
    });
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid, "{err}");
}

/// A store mounted read-only (the migration case: restoring on another node) can be listed, verified and
/// materialized; before, every read failed on creating the lock file (exit 6). Needs root (a bind mount):
/// fails in CI without it, skips locally with the reason.
#[test]
fn a_read_only_store_can_be_verified_and_restored() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !common::runs_here(
        root,
        "not root (the test bind-mounts the store read-only)",
        "CI runs as root",
    ) {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let store = open(t.path());
    let info = ingest(&store, Some("job"), |d| criu_like(d, 32, 3));
    drop(store);
    let root = t.path().join("store");
    let _ = fs::remove_file(root.join("lock"));
    let ro = t.path().join("ro");
    fs::create_dir(&ro).unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new("mount")
            .args(args)
            .status()
            .unwrap()
    };
    assert!(run(&["--bind", root.to_str().unwrap(), ro.to_str().unwrap()]).success());
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(ro.clone());
    assert!(run(&["-o", "remount,bind,ro", ro.to_str().unwrap()]).success());
    assert!(
        fs::write(ro.join("probe"), b"x").is_err(),
        "the mount is read-only"
    );

    let store = Store::open(&ro, StoreOptions::small_chunks()).unwrap();
    assert_eq!(store.get("job").unwrap().id, info.id);
    assert!(store.verify(Some("job"), &NoProgress).unwrap().is_ok());
    let out = t.path().join("out");
    store.materialize(&info.id, &out, &NoProgress).unwrap();
    assert!(out.join("pages-1.img").is_file());
}

/// Issue 26: six first checkpoints started at once into a store folder that did not exist yet (the ranks of
/// a job, agents sharing a file system): four failed with "is not empty and not a gpu-checkpoint store (no
/// store.json)". Six opens and checkpoints at once, many rounds: every one succeeds, into one store.
#[test]
fn concurrent_first_opens_make_one_store() {
    let t = tempfile::tempdir().unwrap();
    for round in 0..25 {
        let dir = t.path().join(format!("r{round}")).join("store");
        let start = std::sync::Barrier::new(6);
        std::thread::scope(|s| {
            for i in 0..6u8 {
                let (dir, start) = (&dir, &start);
                s.spawn(move || {
                    start.wait();
                    let store = Store::open(dir, StoreOptions::small_chunks())
                        .unwrap_or_else(|e| panic!("round {round}, opener {i}: {e}"));
                    ingest(&store, None, |d| {
                        fs::write(d.join("core-1.img"), [i; 64]).unwrap()
                    });
                });
            }
        });
        let store = Store::open(&dir, StoreOptions::small_chunks()).unwrap();
        assert_eq!(store.list().unwrap().len(), 6, "round {round}");
        assert!(store.verify(None, &NoProgress).unwrap().problems.is_empty());
    }
}

/// A store folder that is a file, a folder holding something else, or a marker that is a link: each is
/// refused with what is wrong, and nothing is made in it.
#[test]
fn only_an_empty_or_missing_folder_becomes_a_store() {
    let t = tempfile::tempdir().unwrap();
    let other = t.path().join("other");
    fs::create_dir(&other).unwrap();
    fs::write(other.join("notes.txt"), "mine").unwrap();
    let err = Store::open(&other, StoreOptions::small_chunks())
        .err()
        .unwrap();
    assert!(err.to_string().contains("is not empty"), "{err}");
    assert_eq!(
        fs::read_dir(&other).unwrap().count(),
        1,
        "nothing made in it"
    );
    let linked = t.path().join("linked");
    fs::create_dir(&linked).unwrap();
    std::os::unix::fs::symlink(other.join("notes.txt"), linked.join("store.json")).unwrap();
    let err = Store::open(&linked, StoreOptions::small_chunks())
        .err()
        .unwrap();
    assert_eq!(err.exit_status(), ExitStatus::PermissionDenied, "{err}");
    assert!(err.to_string().contains("symbolic link"), "{err}");
    // An empty folder of this user made with a loose umask becomes a private store.
    let loose = t.path().join("loose");
    fs::create_dir(&loose).unwrap();
    fs::set_permissions(&loose, fs::Permissions::from_mode(0o775)).unwrap();
    Store::open(&loose, StoreOptions::small_chunks()).unwrap();
    assert_eq!(mode(&loose), 0o700);
}
