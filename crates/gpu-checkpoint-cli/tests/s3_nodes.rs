//! The store on a real S3 server (s3s-fs on 127.0.0.1): a process checkpointed on "node A" and restored on
//! "node B", two clients with their own work folders and nothing shared but the bucket; `list`,
//! `inspect`, `verify`, `delete` and `gc` on S3; and the faults of an object store (the server gone during
//! a checkpoint or a restore, a damaged object). Needs root, CRIU and s3s-fs: fails in CI without them,
//! skips locally with the reason.

mod common;
#[path = "../../gpu-checkpoint/tests/common/s3.rs"]
mod s3;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::*;

/// One node: the tool with its own private temporary folder (staging and restore work), reaching the
/// server through the standard AWS variables.
struct Node {
    tmp: PathBuf,
    env: Vec<(&'static str, String)>,
}

impl Node {
    fn new(dir: &Path, name: &str, server: &s3::S3Server) -> Node {
        let tmp = dir.join(name);
        std::fs::create_dir(&tmp).unwrap();
        Node {
            tmp,
            env: server.env(),
        }
    }

    /// The tool with this node's environment, its output captured.
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(gc_bin());
        cmd.args(args)
            .env("TMPDIR", &self.tmp)
            // Failures in tests are quick: a stopped server is not waited for.
            .env("GPU_CHECKPOINT_S3_RETRY_TIMEOUT", "3")
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run gpu-checkpoint")
    }

    fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut args = args.to_vec();
        args.extend_from_slice(&["--format", "json"]);
        serde_json::from_str(&ok(&self.run(&args))).expect("JSON")
    }
}

/// Waits until the restored copy has verified its memory `more` times past `before` against `checksum`.
fn verifies(w: &Workload, checksum: &str, before: u64) {
    let r = w.wait_state("the restored memory verified", |r| {
        r.len() == 1 && num(&r[0], "verified") > before + 2
    });
    assert_eq!(r[0]["checksum"], checksum);
    assert_eq!(num(&r[0], "bad"), 0, "{r:?}");
}

fn scene() -> Option<(tempfile::TempDir, s3::S3Server)> {
    if !criu_ready() {
        return None;
    }
    let server = s3::S3Server::start()?;
    Some((tempfile::tempdir().unwrap(), server))
}

#[test]
fn checkpoint_on_node_a_restores_on_node_b_through_s3() {
    let Some((dir, server)) = scene() else { return };
    let url = server.url("fleet/job");
    let (a, b) = (
        Node::new(dir.path(), "node-a", &server),
        Node::new(dir.path(), "node-b", &server),
    );
    let (w, checksum) = memory_workload(dir.path(), "48");
    let pid = w.pid.to_string();
    let ck = a.json(&[
        "checkpoint",
        "--pid",
        &pid,
        "--storage",
        &url,
        "--name",
        "job",
    ]);
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

#[test]
fn the_server_gone_mid_checkpoint_leaves_the_process_running_and_nothing_listed() {
    let Some((dir, mut server)) = scene() else {
        return;
    };
    let url = server.url("job");
    let a = Node::new(dir.path(), "node-a", &server);
    let (w, checksum) = memory_workload(dir.path(), "256");
    let pid = w.pid.to_string();
    // Started, then the server goes away once the first chunks are in: mid-checkpoint.
    let mut child = a
        .command(&["checkpoint", "--pid", &pid, "--storage", &url])
        .spawn()
        .unwrap();
    let chunks = server.object_file("job/chunks");
    let t0 = std::time::Instant::now();
    while std::fs::read_dir(&chunks).map_or(true, |mut d| d.next().is_none()) {
        assert!(t0.elapsed().as_secs() < 60, "no chunk reached the server");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the checkpoint ended first"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    server.stop();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{out:?}");
    assert!(w.alive() && !w.stopped(), "the process keeps running");
    let now = num(&w.wait_state("verifying", |r| r.len() == 1)[0], "verified");
    verifies(&w, &checksum, now);
    // Nothing listed: no manifest reached the server.
    let manifests = server.object_file("job/manifests");
    let listed: Vec<_> = std::fs::read_dir(&manifests)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(listed.is_empty(), "{listed:?}");
    // No secret in what the tool said.
    let said = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(!said.contains(s3::SECRET_KEY), "{said}");
}

#[test]
fn a_damaged_object_stops_a_restore_and_the_checkpoint_stays_restorable_after_repair() {
    let Some((dir, server)) = scene() else { return };
    let url = server.url("job");
    let a = Node::new(dir.path(), "node-a", &server);
    let (w, checksum) = memory_workload(dir.path(), "8");
    let pid = w.pid.to_string();
    let ck = a.json(&["checkpoint", "--pid", &pid, "--storage", &url]);
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
    let out = a.run(&["verify", &id, "--storage", &url]);
    let said = fails_with(&out, 7);
    assert!(said.contains(&hash), "{said}");
    fails_with(&a.run(&["restore", &id, "--storage", &url]), 7);
    assert!(!w.alive(), "nothing was restored from a damaged checkpoint");
    // Put back, the same checkpoint restores: a failed restore leaves it intact.
    std::fs::write(&object, &original).unwrap();
    let verified0 = num(
        &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
        "verified",
    );
    let out = ok(&a.run(&["restore", &id, "--storage", &url]));
    assert_eq!(out.trim(), pid);
    verifies(&w, &checksum, verified0);
}

#[test]
fn the_server_gone_mid_restore_leaves_the_checkpoint_intact_and_a_retry_restores() {
    let Some((dir, mut server)) = scene() else {
        return;
    };
    let url = server.url("job");
    let b = Node::new(dir.path(), "node-b", &server);
    let (w, checksum) = memory_workload(dir.path(), "256");
    let pid = w.pid.to_string();
    let ck = b.json(&["checkpoint", "--pid", &pid, "--storage", &url]);
    let id = ck["id"].as_str().unwrap().to_owned();
    let verified0 = num(
        &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
        "verified",
    );
    wait_pid_free(w.pid);
    // The server goes away once the restore has made its work folder (it is fetching chunks then).
    let mut child = b
        .command(&["restore", &id, "--storage", &url])
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while !std::fs::read_dir(&b.tmp).unwrap().flatten().any(|e| {
        e.file_name()
            .to_string_lossy()
            .starts_with("gpu-checkpoint-restore")
    }) {
        assert!(
            t0.elapsed().as_secs() < 60,
            "the restore made no work folder"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the restore ended first"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    server.stop();
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{out:?}");
    wait_pid_free(w.pid);
    // The checkpoint is intact: back up, the server serves it, and the same restore works.
    server.restart();
    ok(&b.run(&["verify", &id, "--storage", &url]));
    let out = ok(&b.run(&["restore", &id, "--storage", &url]));
    assert_eq!(out.trim(), pid);
    verifies(&w, &checksum, verified0);
}
