//! The S3 tests' pieces: the real server (s3s-fs, shared with the library's tests), a "node" (the tool
//! with its own private temporary folder, nothing shared with other nodes but the bucket), and a
//! fault-injecting proxy in front of the server (throttling, a slow server).
#![allow(dead_code)] // each test file uses its own subset

#[path = "../../../gpu-checkpoint/tests/common/garage.rs"]
pub mod garage;
pub mod proxy;
#[path = "../../../gpu-checkpoint/tests/common/s3.rs"]
pub mod s3;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::common::*;

/// One node: the tool with its own private temporary folder (staging and restore work), reaching the
/// server through the standard AWS variables.
pub struct Node {
    pub tmp: PathBuf,
    env: Vec<(&'static str, String)>,
}

impl Node {
    pub fn new(dir: &Path, name: &str, server: &dyn s3::Endpoint) -> Node {
        let tmp = dir.join(name);
        std::fs::create_dir(&tmp).unwrap();
        Node {
            tmp,
            // Failures in tests are quick: a stopped server is not waited for.
            env: [("GPU_CHECKPOINT_S3_RETRY_TIMEOUT", "3".to_string())]
                .into_iter()
                .chain(server.env())
                .collect(),
        }
    }

    /// The same node with `key=value` in its environment (replacing what was there).
    pub fn with_env(mut self, key: &'static str, value: &str) -> Node {
        self.env.retain(|(k, _)| *k != key);
        self.env.push((key, value.to_string()));
        self
    }

    /// The tool with this node's environment, its output captured.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(gc_bin());
        cmd.args(args)
            .env("TMPDIR", &self.tmp)
            .envs(self.env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        cmd
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run gpu-checkpoint")
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        serde_json::from_str(&ok(&self.run(&json_args(args)))).expect("JSON")
    }

    /// `checkpoint --pid PID --storage URL EXTRA... --format json`, its output.
    pub fn checkpoint(&self, pid: i32, url: &str, extra: &[&str]) -> Output {
        let pid = pid.to_string();
        let mut args = vec!["checkpoint", "--pid", &pid, "--storage", url];
        args.extend_from_slice(extra);
        self.run(&json_args(&args))
    }

    /// [`Node::checkpoint`], which must succeed: what it printed.
    pub fn checkpoint_json(&self, pid: i32, url: &str, extra: &[&str]) -> serde_json::Value {
        serde_json::from_str(&ok(&self.checkpoint(pid, url, extra))).expect("JSON")
    }
}

/// `args` with `--format json`.
pub fn json_args<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut args = args.to_vec();
    args.extend_from_slice(&["--format", "json"]);
    args
}

/// Waits until the restored copy has verified its memory `more` times past `before` against `checksum`.
pub fn verifies(w: &Workload, checksum: &str, before: u64) {
    let r = w.wait_state("the restored memory verified", |r| {
        r.len() == 1 && num(&r[0], "verified") > before + 2
    });
    assert_eq!(r[0]["checksum"], checksum);
    assert_eq!(num(&r[0], "bad"), 0, "{r:?}");
}

/// A private folder and a running server, or `None` (the reason printed) where root, CRIU or s3s-fs is
/// missing outside CI.
pub fn scene() -> Option<(tempfile::TempDir, s3::S3Server)> {
    if !criu_ready() {
        return None;
    }
    let server = s3::S3Server::start()?;
    Some((tempfile::tempdir().unwrap(), server))
}

/// A private folder and a running garage (the long test lane), or `None` (the reason printed) where root
/// or CRIU is missing outside CI, or outside the long lane.
pub fn garage_scene() -> Option<(tempfile::TempDir, garage::GarageServer)> {
    if !criu_ready() {
        return None;
    }
    let server = garage::GarageServer::start()?;
    Some((tempfile::tempdir().unwrap(), server))
}

/// The manifests s3s-fs holds under `prefix` (read on its disk, not through the tool).
pub fn manifests_on_server(server: &s3::S3Server, prefix: &str) -> Vec<String> {
    std::fs::read_dir(server.object_file(&format!("{prefix}/manifests")))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Makes every object s3s-fs holds under `prefix` look `secs` older (s3s-fs's `Last-Modified` is the
/// file's mtime): what gc's grace period would otherwise keep becomes collectable.
pub fn age_objects(server: &s3::S3Server, prefix: &str, secs: u64) {
    let when = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - secs;
    let st = Command::new("find")
        .arg(server.object_file(prefix))
        .args(["-type", "f", "-exec", "touch", "-m", "-d"])
        .arg(format!("@{when}"))
        .args(["{}", "+"])
        .status()
        .expect("run find");
    assert!(st.success());
}
