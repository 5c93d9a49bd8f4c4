//! Helpers for tests that drive the SIMULATED GPU (`gpu-sim-workload`): start simulated GPU processes
//! detached (re-parented, as CRIU needs), talk to them, and kill them at the end of a test.

#![allow(dead_code)] // each test file uses a different subset

use gpu_checkpoint::freeze::sim;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

// The CRIU-test helpers: one definition of the binary under test, of running it, of "can CRIU run here"
// (fail in CI, skip locally) and of waiting for PIDs to be free.
#[path = "../common/mod.rs"]
pub mod common;
#[allow(unused_imports)] // each test file uses a different subset
pub use common::{criu_ready, gc as run, gc_bin as gpu_checkpoint, strings};

/// `gpu-sim-workload`, built next to `gpu-checkpoint` by `cargo build --workspace` / `cargo test --workspace`.
pub fn sim_workload() -> PathBuf {
    built_beside(
        "gpu-sim-workload",
        "run `cargo build -p gpu-checkpoint-workloads` (cargo test --workspace builds it)",
    )
}

/// The file `name` built next to `gpu-checkpoint`, which must be there (`how`: what builds it).
pub fn built_beside(name: &str, how: &str) -> PathBuf {
    let p = gpu_checkpoint().with_file_name(name);
    assert!(p.exists(), "{} is missing: {how}", p.display());
    p
}

/// A simulated GPU process tree started detached; killed (every process) on drop.
pub struct SimProcess {
    pub pid: i32,
    pub children: Vec<i32>,
}

impl SimProcess {
    /// Starts `gpu-sim-workload --daemon` with `args`; returns once its control socket answers.
    pub fn start(args: &[&str]) -> Self {
        Self::start_env(args, &[])
    }

    pub fn start_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let pid = common::start_detached(
            Command::new(sim_workload())
                .arg("--daemon")
                .args(args)
                .envs(env.iter().copied()),
            "gpu-sim-workload --daemon",
        );
        let st = status(pid);
        let children = match st.get("children").map(String::as_str) {
            None | Some("none") => Vec::new(),
            Some(list) => list.split(',').map(|c| c.parse().unwrap()).collect(),
        };
        SimProcess { pid, children }
    }

    pub fn all_pids(&self) -> Vec<i32> {
        std::iter::once(self.pid)
            .chain(self.children.iter().copied())
            .collect()
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        for p in self.all_pids() {
            // SAFETY: signalling processes this test started.
            unsafe { libc::kill(p, libc::SIGKILL) };
            for d in 0..4 {
                let _ = std::fs::remove_file(sim::device_file(p, d));
            }
        }
    }
}

pub fn status(pid: i32) -> BTreeMap<String, String> {
    sim::status(pid).unwrap_or_else(|e| panic!("STATUS of {pid}: {e}"))
}

/// Sum of the workers' steps: grows while the simulated GPU computes.
pub fn steps(pid: i32) -> u64 {
    status(pid)["steps"]
        .split(',')
        .map(|s| s.parse::<u64>().unwrap())
        .sum()
}

/// Asserts the process computes: its step count grows within a few seconds.
pub fn assert_progress(pid: i32) {
    let before = steps(pid);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        if steps(pid) > before {
            return;
        }
    }
    panic!("pid {pid} made no progress from {before} steps");
}

/// Asserts the device memory holds exactly what the kernels wrote (the simulator recomputes it).
pub fn assert_verified(pid: i32) {
    if let Err(e) = sim::verify(pid) {
        panic!("device memory of {pid} is wrong: {e}");
    }
}

/// Every process runs on its simulated GPU, its device memory is what its kernels wrote, and it
/// computes on.
pub fn assert_healthy(pids: &[i32]) {
    for &p in pids {
        assert_eq!(status(p)["state"], "running", "pid {p}");
        assert_verified(p);
        assert_progress(p);
    }
}

pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Waits until none of `pids` exists any more (killed, and reaped by init).
pub fn wait_gone(pids: &[i32]) {
    for &pid in pids {
        common::wait_pid_free(pid);
    }
}

/// Runs `gpu-checkpoint` and parses its JSON output; panics with the output on failure.
pub fn json_ok(args: &[&str]) -> serde_json::Value {
    let o = run(args);
    assert!(o.status.success(), "gpu-checkpoint {args:?}: {}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "gpu-checkpoint {args:?} printed no JSON ({e}): {}",
            text(&o)
        )
    })
}

/// The checkpoints a store lists; none where no store was made (a checkpoint refused or interrupted before
/// it opened the store leaves none, and `list` refuses a folder that is not a store).
pub fn listed(store: &std::path::Path) -> Vec<serde_json::Value> {
    if !store.join("store.json").exists() {
        return Vec::new();
    }
    let o = common::list_json(store);
    common::assert_success(&o, "list");
    match serde_json::from_slice(&o.stdout).expect("list prints JSON") {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => o
            .get("checkpoints")
            .and_then(|c| c.as_array().cloned())
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// `checkpoint --pid PID --storage STORE --gpu-backend sim EXTRA...`: a SIMULATED process checkpointed.
pub fn checkpoint_args(pid: i32, store: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "checkpoint",
        "--pid",
        &pid.to_string(),
        "--storage",
        store.to_str().unwrap(),
        "--gpu-backend",
        "sim",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Whether, in `events` (rank, driver call, `begin`/`OK`/`ERR`, in the order they happened), each of
/// ranks `0..ranks` made `call`, and each began it only after the rank before it had its `call`
/// answered.
pub fn in_rank_order(events: &[(usize, String, String)], call: &str, ranks: usize) -> bool {
    let at = |rank: usize, what: &str| {
        events
            .iter()
            .position(|(r, c, w)| *r == rank && c == call && w == what)
    };
    (0..ranks).all(|r| at(r, "begin").is_some() && at(r, "OK").is_some())
        && (1..ranks).all(|r| at(r, "begin") > at(r - 1, "OK"))
}
