//! The store on a real S3 server (s3s-fs on 127.0.0.1): a process checkpointed on "node A" and restored on
//! "node B", two clients with their own work folders and nothing shared but the bucket; `list`,
//! `inspect`, `verify`, `delete` and `gc` on S3; and the faults of an object store (the server gone during
//! a checkpoint or a restore, a damaged object); two nodes checkpointing into one bucket while a third runs
//! gc. Needs root, CRIU and s3s-fs: fails in CI without them,
//! skips locally with the reason.

mod common;
mod s3_support;

use common::*;
use s3_support::*;

#[test]
fn checkpoint_on_node_a_restores_on_node_b_through_s3() {
    let Some((dir, server)) = scene() else { return };
    node_a_to_node_b(dir.path(), &server);
}

/// The same against garage, a production object store (the long test lane: `scripts/test.sh --long`).
#[test]
fn checkpoint_on_node_a_restores_on_node_b_through_garage() {
    let Some((dir, server)) = garage_scene() else {
        return;
    };
    node_a_to_node_b(dir.path(), &server);
}

fn node_a_to_node_b(dir: &std::path::Path, server: &dyn s3::Endpoint) {
    let url = server.url("fleet/job");
    let (a, b) = (
        Node::new(dir, "node-a", server),
        Node::new(dir, "node-b", server),
    );
    let (w, checksum) = memory_workload(dir, "48");
    let pid = w.pid.to_string();
    let ck = a.checkpoint_json(w.pid, &url, &["--name", "job"]);
    assert_eq!(ck["stopped"], true);
    let id = ck["id"].as_str().unwrap().to_owned();
    assert!(
        ck["manifest"]
            .as_str()
            .unwrap()
            .starts_with("s3://ckpt/fleet/job/manifests/"),
        "{ck}"
    );
    let at_checkpoint = gpu_checkpoint_workloads::read_state(&w.state).unwrap();
    let verified0 = num(&at_checkpoint[0], "verified");
    wait_pid_free(w.pid);

    // Node B sees it, checks it, restores it: the bucket is all the nodes share.
    let listed = b.json(&["list", "--storage", &url]);
    assert_eq!(listed[0]["id"], id.as_str(), "{listed}");
    let inspected = b.json(&["inspect", "job", "--storage", &url]);
    assert_eq!(inspected["id"], id.as_str());
    ok(&b.run(&["verify", "job", "--storage", &url]));
    let out = ok(&b.run(&["restore", "job", "--storage", &url]));
    assert_eq!(out.trim(), pid, "CRIU restores the original PID");
    verifies(&w, &checksum, verified0);

    // A re-checkpoint of the restored process on node B reuses what node A stored.
    let again = b.json(&[
        "checkpoint",
        "--pid",
        &pid,
        "--storage",
        &url,
        "--name",
        "job",
        "--leave-running",
    ]);
    let stats = &again["stats"];
    assert!(
        stats["new_bytes"].as_u64().unwrap() < stats["stored_bytes"].as_u64().unwrap() / 2,
        "most of the memory was already in the bucket: {stats}"
    );
    // Deleting both leaves nothing listed; gc keeps the young chunks (another node may be writing).
    ok(&a.run(&["delete", &id, "--storage", &url]));
    ok(&a.run(&["delete", again["id"].as_str().unwrap(), "--storage", &url]));
    assert_eq!(a.json(&["list", "--storage", &url]), serde_json::json!([]));
    let gc = a.json(&["gc", "--storage", &url]);
    assert_eq!(gc["checkpoints"], 0);
    assert!(gc["chunks_too_young"].as_u64().unwrap() > 0, "{gc}");
    let said = ok(&a.run(&["gc", "--storage", &url]));
    assert!(said.contains("younger than the grace period"), "{said}");
    // No staging or restore work folder is left in either node's temporary folder (CRIU's logs are kept
    // there on purpose: the store has no folder for them).
    for node in [&a, &b] {
        let left: Vec<String> = std::fs::read_dir(&node.tmp)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("gpu-checkpoint-logs"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}

/// One node, its store under `job/` of a bucket on a real S3 server ([`scene`]), and a `memory` workload
/// of `mib` MiB (its checksum, its PID as text). Fields drop in order: the workload, then the server, then
/// the folder.
struct OneNode {
    w: Workload,
    checksum: String,
    pid: String,
    node: Node,
    url: String,
    server: s3::S3Server,
    _dir: tempfile::TempDir,
}

fn one_node(name: &str, mib: &str) -> Option<OneNode> {
    let (dir, server) = scene()?;
    let (w, checksum) = memory_workload(dir.path(), mib);
    Some(OneNode {
        pid: w.pid.to_string(),
        w,
        checksum,
        node: Node::new(dir.path(), name, &server),
        url: server.url("job"),
        server,
        _dir: dir,
    })
}

/// Runs `node`'s `gpu-checkpoint ARGS...` and stops `server` once `mid_way` says the command is half-way
/// (within a minute, `not_yet` otherwise; still running then, or its `what` ended first): its output.
fn server_gone_when(
    server: &mut s3::S3Server,
    node: &Node,
    args: &[&str],
    what: &str,
    not_yet: &str,
    mid_way: impl Fn() -> bool,
) -> std::process::Output {
    let mut child = node.command(args).spawn().unwrap();
    let t0 = std::time::Instant::now();
    while !mid_way() {
        assert!(t0.elapsed().as_secs() < 60, "{not_yet}");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the {what} ended first"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    server.stop();
    child.wait_with_output().unwrap()
}

#[test]
fn the_server_gone_mid_checkpoint_leaves_the_process_running_and_nothing_listed() {
    let Some(mut s) = one_node("node-a", "256") else {
        return;
    };
    let (a, url, pid, w, checksum) = (&s.node, &s.url, &s.pid, &s.w, &s.checksum);
    // Started, then the server goes away once the first chunks are in: mid-checkpoint.
    let chunks = s.server.object_file("job/chunks");
    let out = server_gone_when(
        &mut s.server,
        a,
        &["checkpoint", "--pid", pid, "--storage", url],
        "checkpoint",
        "no chunk reached the server",
        || std::fs::read_dir(&chunks).is_ok_and(|mut d| d.next().is_some()),
    );
    // Storage that cannot be reached once the retries ran out: exit 6, not CRIU's broken pipe.
    fails_with(&out, 6);
    assert!(w.alive() && !w.stopped(), "the process keeps running");
    let now = num(&w.wait_state("verifying", |r| r.len() == 1)[0], "verified");
    verifies(w, checksum, now);
    // Nothing listed: no manifest reached the server.
    let listed = manifests_on_server(&s.server, "job");
    assert!(listed.is_empty(), "{listed:?}");
    // No secret in what the tool said.
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!said.contains(s3::SECRET_KEY), "{said}");
}

#[test]
fn a_damaged_object_stops_a_restore_and_the_checkpoint_stays_restorable_after_repair() {
    let Some(s) = one_node("node-a", "8") else {
        return;
    };
    let (a, url, pid, w, server) = (&s.node, &s.url, &s.pid, &s.w, &s.server);
    let ck = a.json(&["checkpoint", "--pid", pid, "--storage", url]);
    let id = ck["id"].as_str().unwrap().to_owned();
    wait_pid_free(w.pid);
    // Truncate every chunk object of the page image on the server's disk.
    let manifest: serde_json::Value = serde_json::from_slice(
        &std::fs::read(server.object_file(&format!("job/manifests/{id}.json"))).unwrap(),
    )
    .unwrap();
    let pages = manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"].as_str().unwrap().starts_with("pages-"))
        .unwrap();
    let hash = pages["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|c| c["h"].as_str())
        .unwrap()
        .to_owned();
    let object = server.object_file(&format!("job/chunks/{}/{hash}", &hash[..2]));
    let original = std::fs::read(&object).unwrap();
    std::fs::write(&object, &original[..original.len() / 2]).unwrap();
    let out = a.run(&["verify", &id, "--storage", url]);
    let said = fails_with(&out, 7);
    assert!(said.contains(&hash), "{said}");
    fails_with(&a.run(&["restore", &id, "--storage", url]), 7);
    assert!(!w.alive(), "nothing was restored from a damaged checkpoint");
    // Put back, the same checkpoint restores: a failed restore leaves it intact.
    std::fs::write(&object, &original).unwrap();
    let verified0 = num(
        &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
        "verified",
    );
    let out = ok(&a.run(&["restore", &id, "--storage", url]));
    assert_eq!(out.trim(), pid);
    verifies(w, &s.checksum, verified0);
}

#[test]
fn the_server_gone_mid_restore_leaves_the_checkpoint_intact_and_a_retry_restores() {
    let Some(mut s) = one_node("node-b", "256") else {
        return;
    };
    let (b, url, pid, w, checksum) = (&s.node, &s.url, &s.pid, &s.w, &s.checksum);
    let ck = b.json(&["checkpoint", "--pid", pid, "--storage", url]);
    let id = ck["id"].as_str().unwrap().to_owned();
    let verified0 = num(
        &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
        "verified",
    );
    wait_pid_free(w.pid);
    // The server goes away once the restore has made its work folder (it is fetching chunks then).
    let out = server_gone_when(
        &mut s.server,
        b,
        &["restore", &id, "--storage", url],
        "restore",
        "the restore made no work folder",
        || {
            std::fs::read_dir(&b.tmp).unwrap().flatten().any(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("gpu-checkpoint-restore")
            })
        },
    );
    assert!(!out.status.success(), "{out:?}");
    wait_pid_free(w.pid);
    // The checkpoint is intact: back up, the server serves it, and the same restore works.
    s.server.restart();
    ok(&b.run(&["verify", &id, "--storage", url]));
    let out = ok(&b.run(&["restore", &id, "--storage", url]));
    assert_eq!(out.trim(), pid);
    verifies(w, checksum, verified0);
}

/// Checkpoints `w` `rounds` times (leaving it running) from `node`; a checkpoint refused because a gc
/// took a chunk it reused (exit 8, "retry it") is retried. Between rounds it waits until one more gc has
/// finished (counted by `gc_runs`), so that gc runs between, and during, the checkpoints of both nodes
/// however the machine's load spaces them. The ids committed, and how many were refused.
fn checkpoint_rounds(
    node: &Node,
    w: &Workload,
    url: &str,
    rounds: usize,
    gc_runs: &std::sync::atomic::AtomicUsize,
) -> (Vec<String>, usize) {
    let (mut ids, mut refused) = (Vec::new(), 0);
    for round in 0..rounds {
        if round > 0 {
            let seen = gc_runs.load(std::sync::atomic::Ordering::SeqCst);
            let t0 = std::time::Instant::now();
            while gc_runs.load(std::sync::atomic::Ordering::SeqCst) == seen {
                assert!(t0.elapsed().as_secs() < 300, "no gc finished in 5 minutes");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
        loop {
            let out = node.checkpoint(w.pid, url, &["--leave-running"]);
            if out.status.code() == Some(8) {
                // Refused before anything was listed: the process runs on, the retry may commit.
                assert!(w.alive() && !w.stopped());
                refused += 1;
                assert!(
                    refused < 10,
                    "refused again and again: {}",
                    text(&out.stderr)
                );
                continue;
            }
            let ck: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
            ids.push(ck["id"].as_str().unwrap().to_owned());
            break;
        }
    }
    (ids, refused)
}

#[test]
fn two_nodes_checkpoint_into_one_bucket_while_a_third_runs_gc() {
    let Some((dir, server)) = scene() else { return };
    let url = server.url("fleet");
    // The default retry timeout: a loaded machine's server may be slow, and nothing here stops it.
    let node = |name: &str| {
        Node::new(dir.path(), name, &server).with_env("GPU_CHECKPOINT_S3_RETRY_TIMEOUT", "30")
    };
    let (a, b, g) = (node("node-a"), node("node-b"), node("node-gc"));
    let workload = |name: &str, seed: &str, mib: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir(&d).unwrap();
        memory_workload_with(&d, &["--mib", mib, "--seed", seed])
    };
    let (wa, sum_a) = workload("wa", "1", "16");
    let (wb, _) = workload("wb", "2", "16");
    // Garbage for gc, made old enough to collect: a deleted checkpoint of a process gone (nothing will
    // reference its chunks again) and a deleted one of node A's process (its next checkpoints reuse
    // those chunks: the race the leases guard).
    {
        let (wc, _) = workload("wc", "3", "8");
        for (w, n) in [(&wc, &a), (&wa, &a)] {
            let ck = n.checkpoint_json(w.pid, &url, &["--leave-running"]);
            ok(&n.run(&["delete", ck["id"].as_str().unwrap(), "--storage", &url]));
        }
    }
    age_objects(&server, "fleet/chunks", 2 * 3600);

    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
    let (writing, gc_runs) = (AtomicBool::new(true), AtomicUsize::new(0));
    let ((ids_a, refused_a), (ids_b, refused_b), gcs) = std::thread::scope(|s| {
        let ha = s.spawn(|| checkpoint_rounds(&a, &wa, &url, 3, &gc_runs));
        let hb = s.spawn(|| checkpoint_rounds(&b, &wb, &url, 3, &gc_runs));
        let hg = s.spawn(|| {
            let mut reports = Vec::new();
            while writing.load(SeqCst) {
                reports.push(g.json(&["gc", "--storage", &url]));
                gc_runs.fetch_add(1, SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            reports
        });
        let (ra, rb) = (ha.join(), hb.join());
        let during = gc_runs.load(SeqCst);
        // Stops the gc loop before anything can panic: the scope waits for it.
        writing.store(false, SeqCst);
        let mut gcs = hg.join().unwrap();
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        // gc ran, and finished, while the nodes wrote (it waits only while a writer holds a lease).
        assert!(during >= 2, "no gc finished while the nodes wrote");
        // And one more once every writer is done.
        gcs.push(g.json(&["gc", "--storage", &url]));
        (ra, rb, gcs)
    });
    let removed: u64 = gcs
        .iter()
        .map(|r| r["chunks_removed"].as_u64().unwrap())
        .sum();
    eprintln!(
        "{} gc runs removed {removed} chunks; checkpoints refused and retried: node A {refused_a}, \
         node B {refused_b}",
        gcs.len()
    );
    assert!(removed > 0, "the old garbage was collected: {gcs:?}");

    // Every committed checkpoint is listed and whole: gc removed no chunk a manifest references.
    let mut committed: Vec<String> = ids_a.iter().chain(&ids_b).cloned().collect();
    committed.sort();
    let listed = g.json(&["list", "--storage", &url]);
    let mut listed: Vec<String> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    listed.sort();
    assert_eq!(listed, committed);
    for id in &committed {
        ok(&g.run(&["verify", id, "--storage", &url]));
    }
    // No writer's lease and no gc marker is left behind.
    for prefix in ["fleet/leases", "fleet/gc"] {
        let left: Vec<_> = std::fs::read_dir(server.object_file(prefix))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{prefix}: {left:?}");
    }
    // And node A's last checkpoint restores on node B.
    let verified0 = num(
        &gpu_checkpoint_workloads::read_state(&wa.state).unwrap()[0],
        "verified",
    );
    wa.kill_and_wait_free();
    let out = ok(&b.run(&["restore", ids_a.last().unwrap(), "--storage", &url]));
    assert_eq!(out.trim(), wa.pid.to_string());
    verifies(&wa, &sum_a, verified0);
}
