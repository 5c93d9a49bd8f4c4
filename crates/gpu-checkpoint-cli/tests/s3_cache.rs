//! A restore from S3 through a local read-through cache folder (`restore --cache-dir`): the first restore
//! on a node fetches the chunks and keeps them, a second one reads them from the cache without a request
//! (counted at a proxy in front of s3s-fs), and a cached chunk damaged on the node's disk is found by its
//! check and fetched again, never given to CRIU. Needs root, CRIU and s3s-fs: fails in CI without them,
//! skips locally with the reason.

mod common;
mod s3_support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::*;
use s3_support::proxy::FaultProxy;
use s3_support::*;

/// Every cached chunk file under `dir`.
fn cached_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if entry.file_type().unwrap().is_dir() {
            out.extend(cached_files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn a_second_restore_reads_the_cache_without_requests_and_a_damaged_cached_chunk_is_fetched_again() {
    let Some((dir, server)) = scene() else { return };
    let proxy = FaultProxy::start(&server.endpoint);
    let url = server.url("job");
    let a = Node::new(dir.path(), "node-a", &server);
    let b =
        Node::new(dir.path(), "node-b", &server).with_env("AWS_ENDPOINT_URL", &proxy.endpoint());
    let cache = dir.path().join("node-b-cache");
    let (w, checksum) = memory_workload(dir.path(), "32");
    let pid = w.pid.to_string();
    let ck = a.checkpoint_json(w.pid, &url, &[]);
    let id = ck["id"].as_str().unwrap().to_owned();
    let verified0 = num(
        &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
        "verified",
    );
    wait_pid_free(w.pid);
    let cache_arg = cache.to_str().unwrap();
    // Restores on node B through its cache; returns the chunk GETs that reached the server.
    let restore = || {
        let before = proxy.chunk_gets();
        w.blank_state();
        let out = ok(&b.run(&["restore", &id, "--storage", &url, "--cache-dir", cache_arg]));
        assert_eq!(out.trim(), pid);
        verifies(&w, &checksum, verified0);
        w.kill_and_wait_free();
        proxy.chunk_gets() - before
    };

    let first = restore();
    assert!(first > 5, "the first restore fetched the chunks: {first}");
    let files = cached_files(&cache);
    assert!(
        files.len() as u64 >= first,
        "{} cached of {first}",
        files.len()
    );
    for f in &files {
        let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", f.display());
        let d = f.parent().unwrap();
        assert_eq!(
            std::fs::metadata(d).unwrap().permissions().mode() & 0o777,
            0o700
        );
    }
    assert_eq!(
        std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777,
        0o700
    );

    assert_eq!(
        restore(),
        0,
        "the second restore read every chunk from the cache"
    );

    // One cached chunk damaged on node B's disk (a byte of its payload flipped): found and fetched again.
    let victim = files
        .iter()
        .max_by_key(|f| std::fs::metadata(f).unwrap().len())
        .unwrap();
    let mut bytes = std::fs::read(victim).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x20;
    std::fs::write(victim, &bytes).unwrap();
    assert_eq!(restore(), 1, "only the damaged chunk was fetched again");
    bytes[mid] ^= 0x20;
    assert!(
        std::fs::read(victim).unwrap() == bytes,
        "the good copy is cached again"
    );

    // A cache folder others can enter is refused: a usage error, nothing restored.
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = b.run(&["restore", &id, "--storage", &url, "--cache-dir", cache_arg]);
    let said = fails_with(&out, 2);
    assert!(said.contains("cache folder"), "{said}");
    assert!(!w.alive());
}
