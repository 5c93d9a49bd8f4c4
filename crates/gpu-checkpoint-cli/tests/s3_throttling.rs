//! A throttling and slow S3 server: a proxy in front of s3s-fs (`s3_support::proxy`) answers a share of
//! requests with `503 SlowDown` and delays the rest. The client retries with backoff, so a checkpoint and
//! a restore still succeed; a server that throttles everything past the retry timeout fails the checkpoint
//! cleanly. Needs root, CRIU and s3s-fs: fails in CI without them, skips locally with the reason.

mod common;
mod s3_support;

use std::time::{Duration, Instant};

use common::*;
use s3_support::proxy::FaultProxy;
use s3_support::*;

#[test]
fn a_throttling_slow_server_is_retried_and_checkpoint_and_restore_succeed() {
    let Some((dir, server)) = scene() else { return };
    let proxy = FaultProxy::start(&server.endpoint);
    proxy.throttle_one_in(3);
    proxy.delay(Duration::from_millis(20));
    let url = server.url("job");
    let a = Node::new(dir.path(), "node-a", &server)
        .with_env("AWS_ENDPOINT_URL", &proxy.endpoint())
        .with_env("GPU_CHECKPOINT_S3_RETRY_TIMEOUT", "60");
    let (w, checksum) = memory_workload(dir.path(), "32");
    let pid = w.pid.to_string();
    let checkpoint = || {
        let ck = a.checkpoint_json(w.pid, &url, &["--leave-running"]);
        (ck["id"].as_str().unwrap().to_owned(), ck["stats"].clone())
    };
    checkpoint();
    let throttled = proxy.throttled();
    assert!(throttled > 0, "the checkpoint went through throttling");

    // An unchanged re-checkpoint sends almost nothing: its chunks are in the bucket already.
    let sent0 = proxy.bytes_sent();
    let (id, stats) = checkpoint();
    let sent = proxy.bytes_sent() - sent0;
    let logical = stats["logical_bytes"].as_u64().unwrap();
    eprintln!(
        "re-checkpoint sent {sent} bytes for {logical} bytes of image ({:.2}%); {} of {} requests \
         throttled",
        100.0 * sent as f64 / logical as f64,
        proxy.throttled(),
        proxy.requests()
    );
    // What was sent is what was new (the chunks the process's small changing mappings fall in, a few
    // MiB whatever the size: see the benchmark in docs/store.md for the share on a large image), plus
    // requests' heads: not the chunks already in the bucket.
    let new = stats["new_bytes"].as_u64().unwrap();
    assert!(new * 5 < logical, "{stats}");
    assert!(
        sent < new + logical / 100,
        "sent {sent} of {logical} bytes: {stats}"
    );

    let verified0 = num(
        &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
        "verified",
    );
    w.kill_and_wait_free();
    let throttled = proxy.throttled();
    let out = ok(&a.run(&["restore", &id, "--storage", &url]));
    assert_eq!(out.trim(), pid);
    verifies(&w, &checksum, verified0);
    assert!(
        proxy.throttled() > throttled,
        "the restore went through throttling"
    );
}

#[test]
fn a_server_throttling_everything_fails_the_checkpoint_cleanly() {
    let Some((dir, server)) = scene() else { return };
    let proxy = FaultProxy::start(&server.endpoint);
    let url = server.url("job");
    // The test nodes retry for 3 s (GPU_CHECKPOINT_S3_RETRY_TIMEOUT).
    let a =
        Node::new(dir.path(), "node-a", &server).with_env("AWS_ENDPOINT_URL", &proxy.endpoint());
    let (w, checksum) = memory_workload(dir.path(), "128");
    let pid = w.pid.to_string();
    let child = a
        .command(&["checkpoint", "--pid", &pid, "--storage", &url])
        .spawn()
        .unwrap();
    // Once the first chunks are in, the server throttles every request: mid-checkpoint.
    let t0 = Instant::now();
    while proxy.chunk_puts() == 0 {
        assert!(t0.elapsed().as_secs() < 60, "no chunk reached the server");
        std::thread::sleep(Duration::from_millis(2));
    }
    proxy.throttle_one_in(1);
    let out = child.wait_with_output().unwrap();
    let said = fails_with(&out, 6);
    assert!(proxy.throttled() > 1, "the client retried");
    // The error says why (the server's answer after the retries), not only CRIU's broken pipe.
    let error = said
        .lines()
        .find(|l| l.starts_with("error: "))
        .expect("an error line");
    assert!(error.contains("503") && error.contains("retries"), "{said}");
    assert!(w.alive() && !w.stopped(), "the process keeps running");
    let now = num(&w.wait_state("verifying", |r| r.len() == 1)[0], "verified");
    verifies(&w, &checksum, now);
    // Nothing listed, seen by another node that reaches the server directly.
    assert!(manifests_on_server(&server, "job").is_empty());
    let b = Node::new(dir.path(), "node-b", &server);
    assert_eq!(b.json(&["list", "--storage", &url]), serde_json::json!([]));
    assert!(!format!("{}{said}", text(&out.stdout)).contains(s3::SECRET_KEY));
}
