//! The local backend's direct I/O: objects of every length written and read back exact.

use super::*;
use crate::store::backend::{LockMode, Objects, ReadObjects};
use crate::store::chunk::{Decoder, Encoder, HEADER_LEN};
use crate::testdata::random_bytes as random;
use std::fs;
use std::os::unix::fs::PermissionsExt;

fn backend(dir: &Path, direct: bool) -> LocalBackend {
    let b = LocalBackend::with_direct_io(&dir.join("store"), direct);
    b.init().unwrap();
    b
}

#[test]
fn direct_writes_and_reads_keep_objects_of_every_length_exact() {
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path(), true);
    assert!(LocalFs::aligned_objects(&b) && LocalFs::reads_uncached(&b));
    let mut enc = Encoder::new(None, 1 << 20).unwrap();
    let mut dec = Decoder::new(1 << 20).unwrap();
    let mut direct = AlignedBuf::new();
    // Shorter than a block, exactly blocks (header included), blocks and a tail.
    for (i, len) in [1usize, 4096 - HEADER_LEN, 3 * 4096 + 100, 1 << 20]
        .into_iter()
        .enumerate()
    {
        let data = random(len, i as u64 + 1);
        let id = ChunkId::of(&data);
        let (_, object) = enc.encode_object(&id, &data);
        b.put_chunk_object(&id, object).unwrap();
        let path = b.chunk_path(&id);
        assert_eq!(fs::read(&path).unwrap(), object, "length {len}");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let mut whole = AlignedBuf::new();
        assert_eq!(
            ReadObjects::read_object(&b, &id, object.len(), &mut whole).unwrap(),
            Some(object.len())
        );
        assert_eq!(whole.slice(object.len()), object);
        // fs::read above cached every page: read the usual way now.
        assert_eq!(
            ReadObjects::read_chunk_uncached(&b, &id, &mut direct).unwrap(),
            None
        );
        let mut buf = Vec::new();
        assert!(b.read_chunk(&id, &mut buf).unwrap());
        assert_eq!(dec.decode(&id, &buf).unwrap(), &data[..]);
    }
    // A chunk written directly and not read since is not (all) cached: read with direct I/O, exact.
    let data = random(2 * 4096 + 7, 99);
    let id = ChunkId::of(&data);
    let (_, object) = enc.encode_object(&id, &data);
    b.put_chunk_object(&id, object).unwrap();
    let n = ReadObjects::read_chunk_uncached(&b, &id, &mut direct)
        .unwrap()
        .expect("a freshly written chunk is read past the cache");
    assert_eq!(dec.decode(&id, direct.slice(n)).unwrap(), &data[..]);
    // Missing: left to the usual read, which reports it.
    let missing = ChunkId::of(b"not stored");
    assert_eq!(
        ReadObjects::read_chunk_uncached(&b, &missing, &mut direct).unwrap(),
        None
    );
}

#[test]
fn buffered_backends_and_unaligned_objects_go_through_the_page_cache() {
    let t = tempfile::tempdir().unwrap();
    let buffered = backend(t.path(), false);
    assert!(!LocalFs::aligned_objects(&buffered) && !LocalFs::reads_uncached(&buffered));
    let data = random(5000, 7);
    let id = ChunkId::of(&data);
    let mut enc = Encoder::new(None, 8192).unwrap();
    let (_, object) = enc.encode_object(&id, &data);
    buffered.put_chunk_object(&id, object).unwrap();
    let mut direct = AlignedBuf::new();
    assert_eq!(
        ReadObjects::read_chunk_uncached(&buffered, &id, &mut direct).unwrap(),
        None
    );
    assert_eq!(fs::read(buffered.chunk_path(&id)).unwrap(), object);

    // An object that is not page-aligned in memory cannot go direct: written through the cache.
    let t2 = tempfile::tempdir().unwrap();
    let b = backend(t2.path(), true);
    let mut shifted = vec![0u8; object.len() + 1];
    shifted[1..].copy_from_slice(object);
    b.put_chunk_object(&id, &shifted[1..]).unwrap();
    assert_eq!(fs::read(b.chunk_path(&id)).unwrap(), object);
    assert!(
        LocalFs::aligned_objects(&b),
        "one unaligned object does not turn direct I/O off"
    );
}

/// A raw chunk that lies where a segment places it (`SegBuf`: HEADER_LEN past a page) is written from
/// there: only its first block is assembled, the rest goes to the device with direct I/O (so it is not in
/// the page cache afterwards), and the file is the same object `encode_object` builds.
#[test]
fn a_raw_chunk_in_a_segment_goes_to_the_device_from_where_it_lies() {
    use crate::store::chunk::ObjectParts;
    use crate::store::chunker::SegBuf;
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path(), true);
    // Compression on: random bytes stay raw.
    let mut enc = Encoder::new(Some(1), 1 << 20).unwrap();
    let mut whole = Encoder::new(Some(1), 1 << 20).unwrap();
    let mut dec = Decoder::new(1 << 20).unwrap();
    let mut direct = AlignedBuf::new();
    // One block after the first and no rest; blocks and a rest; a large chunk.
    for (i, len) in [2 * 4096 - HEADER_LEN, 3 * 4096 + 100, (1 << 20) - 5]
        .into_iter()
        .enumerate()
    {
        let mut seg = SegBuf::new(1 << 20);
        seg[..len].copy_from_slice(&random(len, i as u64 + 40));
        let data = &seg[..len];
        let id = ChunkId::of(data);
        let expected = whole.encode_object(&id, data).1.to_vec();
        let (_, parts) = enc.encode_parts(&id, data);
        assert!(matches!(parts, ObjectParts::Blocks(_)), "length {len}");
        assert_eq!(parts.parts().concat(), expected, "length {len}");
        b.put_chunk_parts(&id, &parts).unwrap();
        let n = ReadObjects::read_chunk_uncached(&b, &id, &mut direct)
            .unwrap()
            .expect("written past the page cache");
        assert_eq!(dec.decode(&id, direct.slice(n)).unwrap(), data);
        let path = b.chunk_path(&id);
        assert_eq!(fs::read(&path).unwrap(), expected, "length {len}");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
    // Where direct I/O is off the same parts go through the page cache, the same bytes.
    let buffered = backend(&t.path().join("b"), false);
    let mut seg = SegBuf::new(1 << 20);
    seg[..5 * 4096].copy_from_slice(&random(5 * 4096, 77));
    let id = ChunkId::of(&seg[..5 * 4096]);
    let (_, parts) = enc.encode_parts(&id, &seg[..5 * 4096]);
    buffered.put_chunk_parts(&id, &parts).unwrap();
    assert_eq!(
        fs::read(buffered.chunk_path(&id)).unwrap(),
        parts.parts().concat()
    );
}

/// Links planted in a store after it was opened and checked (the race the owner check alone would leave):
/// every operation works below the folder held open and follows none of them, so nothing outside is
/// removed, chmodded or created (issue 26).
#[test]
fn links_planted_after_the_open_lead_nowhere() {
    use std::os::unix::fs::symlink;
    let t = tempfile::tempdir().unwrap();
    let b = backend(t.path(), false);
    let root = t.path().join("store");
    let outside = t.path().join("outside");
    fs::create_dir_all(outside.join("sub")).unwrap();
    for f in ["a", "sub/b"] {
        fs::write(outside.join(f), "keep").unwrap();
        fs::set_permissions(outside.join(f), fs::Permissions::from_mode(0o644)).unwrap();
    }
    let untouched = || {
        for f in ["a", "sub/b"] {
            assert_eq!(fs::read_to_string(outside.join(f)).unwrap(), "keep");
            assert_eq!(
                fs::metadata(outside.join(f)).unwrap().permissions().mode() & 0o777,
                0o644
            );
        }
    };
    let plant = |name: &str, target: &Path| {
        let at = root.join(name);
        if at.is_dir() {
            fs::remove_dir_all(&at).unwrap();
        } else {
            let _ = fs::remove_file(&at);
        }
        symlink(target, at).unwrap();
    };
    plant("staging", &outside);
    plant("manifests", &outside);
    let created = t.path().join("created");
    plant("lock", &created);
    fs::remove_dir_all(root.join("chunks")).unwrap();
    fs::create_dir(root.join("chunks")).unwrap();
    symlink(&outside, root.join("chunks/ab")).unwrap();

    assert!(
        b.cleanup_stale().is_err(),
        "a linked staging folder is refused"
    );
    let listed = b.list_manifests();
    assert!(
        listed.is_err(),
        "a linked manifests folder is refused: {listed:?}"
    );
    b.restore_permissions();
    assert!(b.lock(LockMode::Shared).is_err());
    assert!(b.try_lock(LockMode::Exclusive).is_err());
    assert!(!created.exists(), "the lock was created through its link");
    assert!(b.put("manifests/x.json", &[b"{}"], true).is_err());
    let id = ChunkId::of(b"x");
    let key = crate::store::backend::chunk_key(&id);
    let fan = &id.to_hex()[..2];
    fs::remove_file(root.join("chunks/ab")).unwrap();
    symlink(&outside, root.join("chunks").join(fan)).unwrap();
    assert!(b.put(&key, &[b"object"], false).is_err());
    assert!(b.delete(&format!("chunks/{fan}/a")).is_err());
    assert!(!b
        .get(&format!("chunks/{fan}/a"), &mut Vec::new())
        .unwrap_or(false));
    assert!(b
        .head(&format!("chunks/{fan}/a"))
        .map_or(true, |m| m.is_none()));
    untouched();
    assert_eq!(
        fs::read_dir(&outside).unwrap().count(),
        2,
        "nothing made outside"
    );
    // Opening the store again refuses it, naming the link.
    let err = LocalBackend::with_direct_io(&root, false)
        .init()
        .unwrap_err();
    assert!(err.to_string().contains("symbolic link"), "{err}");
}
