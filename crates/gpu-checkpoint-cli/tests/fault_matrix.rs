//! The fault matrix (issue 13, `docs/guarantees.md`): the tool is killed (SIGKILL: its guardian's case)
//! or told to stop (SIGTERM: deferred, then undone or finished) at each step of a checkpoint and of a
//! restore, and the store fails its writes (EIO, ENOSPC), for a CPU-only tree and a tree of SIMULATED GPU
//! processes, streamed and staged. After each cell, one of the two promises holds, and which one is
//! asserted for the step: the tree runs with its memory (and its device memory, on its GPU), or a
//! durable checkpoint exists, the tree was stopped, and the checkpoint restores; and the store verifies.
//!
//! Faults come from `GPU_CHECKPOINT_FAULT` (`gpu_checkpoint::fault`). `Command::output` returns only once
//! the guardian has also exited (it shares the tool's stderr), so its work is done when a cell is checked.
//! Needs root and CRIU: fails in CI without them, skips locally with the reason.

mod sim_support;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use gpu_checkpoint::proc as tree;
use sim_support::common::{self, Workload};
use sim_support::{assert_healthy, criu_ready, gpu_checkpoint, text, SimProcess};

/// What a cell's fault must leave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    /// The tree runs on as before; nothing is stored.
    Running,
    /// The checkpoint is durable, the tree was stopped, and the checkpoint restores.
    Durable,
    /// `--leave-running`: the checkpoint is durable and the tree runs on.
    DurableRunning,
}

/// The tree under test: a CPU-only process re-verifying its memory, or SIMULATED GPU processes.
enum Tree {
    Cpu(Workload),
    Gpu(SimProcess),
}

impl Tree {
    fn start(gpu: bool, dir: &Path) -> Tree {
        if gpu {
            Tree::Gpu(SimProcess::start(&["--mib", "8", "--children", "1"]))
        } else {
            let w = Workload::start("memory", dir, &["--mib", "16", "--verify-ms", "20"]);
            w.wait_state("memory verified", |r| verified(r) > 0);
            Tree::Cpu(w)
        }
    }

    fn pid(&self) -> i32 {
        match self {
            Tree::Cpu(w) => w.pid,
            Tree::Gpu(s) => s.pid,
        }
    }

    fn pids(&self) -> Vec<i32> {
        match self {
            Tree::Cpu(w) => vec![w.pid],
            Tree::Gpu(s) => s.all_pids(),
        }
    }

    fn gpu_args(&self) -> &'static [&'static str] {
        match self {
            Tree::Cpu(_) => &[],
            Tree::Gpu(_) => &["--gpu-backend", "sim"],
        }
    }

    /// Runs (not stopped), with its memory intact and going on: the CPU workload re-verifies its
    /// checksum again, without a bad round; every GPU process runs on its device with the memory its
    /// kernels wrote and computes on.
    fn assert_running_intact(&self, cell: &str) {
        for p in self.pids() {
            let st = tree::stat(p).unwrap_or_else(|| panic!("{cell}: pid {p} is gone"));
            assert!(
                !st.is_dying() && !matches!(st.state, 'T' | 't'),
                "{cell}: pid {p} is in state {}",
                st.state
            );
        }
        match self {
            Tree::Cpu(w) => {
                let before = verified(&w.wait_state("a state record", |_| true));
                let r = w.wait_state("another verification", |r| verified(r) > before);
                assert_eq!(field(&r, "bad"), 0, "{cell}: memory changed: {r:?}");
            }
            Tree::Gpu(s) => assert_healthy(&s.all_pids()),
        }
    }

    /// Every process was stopped (killed) after the durable checkpoint.
    fn assert_stopped(&self, cell: &str) {
        let left = tree::wait_until(Duration::from_secs(10), || {
            self.pids()
                .into_iter()
                .filter(|&p| tree::is_alive(p))
                .collect()
        });
        assert!(
            left.is_empty(),
            "{cell}: {left:?} still run after a durable checkpoint"
        );
        for p in self.pids() {
            common::wait_pid_free(p);
        }
    }
}

fn field(records: &[gpu_checkpoint_workloads::Record], key: &str) -> u64 {
    records
        .first()
        .and_then(|r| r.get(key))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn verified(records: &[gpu_checkpoint_workloads::Record]) -> u64 {
    field(records, "verified")
}

/// Runs `gpu-checkpoint ARGS` with `GPU_CHECKPOINT_FAULT=fault` (none when empty).
fn run_with_fault(args: &[&str], fault: &str) -> Output {
    let mut cmd = Command::new(gpu_checkpoint());
    cmd.args(args).env(gpu_checkpoint::fault::ENV, fault);
    cmd.output().expect("run gpu-checkpoint")
}

/// Checkpoints the tree with `GPU_CHECKPOINT_FAULT=fault` (none when empty).
fn checkpoint_with_fault(t: &Tree, store: &Path, extra: &[&str], fault: &str) -> Output {
    let started = Instant::now();
    let out = common::run_checkpoint_env(
        t.pid(),
        store,
        &[t.gpu_args(), extra].concat(),
        &[(gpu_checkpoint::fault::ENV, fault)],
    );
    // The guardian shares the tool's stderr: `output` returned once it, too, was done.
    assert!(
        started.elapsed() < Duration::from_secs(90),
        "checkpoint with {fault}: took {:?}",
        started.elapsed()
    );
    out
}

fn ids(store: &Path) -> Vec<String> {
    if !store.join("store.json").exists() {
        return Vec::new();
    }
    common::list_ids(store)
}

fn assert_store_verifies(store: &Path, cell: &str) {
    if !store.join("store.json").exists() {
        return;
    }
    let o = common::gc(&["verify", "--storage", store.to_str().unwrap()]);
    assert!(
        o.status.success(),
        "{cell}: the store does not verify: {}",
        text(&o)
    );
}

/// Restores checkpoint `id` with `fault`; returns the output.
fn restore_with_fault(t: &Tree, id: &str, store: &Path, fault: &str) -> Output {
    let mut args = vec!["restore", id, "--storage", store.to_str().unwrap()];
    args.extend_from_slice(t.gpu_args());
    run_with_fault(&args, fault)
}

/// Restores `id` (no fault) and checks the copy runs intact, then kills it.
fn assert_restores(t: &Tree, id: &str, store: &Path, cell: &str) {
    let o = restore_with_fault(t, id, store, "");
    assert!(o.status.success(), "{cell}: restore: {}", text(&o));
    t.assert_running_intact(&format!("{cell}, restored"));
    for p in t.pids() {
        let _ = tree::kill_tree(&[p], Duration::from_secs(5));
    }
    for p in t.pids() {
        common::wait_pid_free(p);
    }
}

/// One checkpoint cell: start a tree, checkpoint it with `fault` (and `extra` arguments: `--staged`,
/// `--leave-running`), check what `expect` says.
fn checkpoint_cell(gpu: bool, extra: &[&str], fault: &str, expect: Expect) {
    let cell = format!(
        "{} {} {fault}",
        if gpu { "gpu" } else { "cpu" },
        if extra.is_empty() {
            "streamed".to_string()
        } else {
            extra.join(" ")
        }
    );
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let t = Tree::start(gpu, dir.path());
    let o = checkpoint_with_fault(&t, &store, extra, fault);
    let out = text(&o);
    match expect {
        Expect::Running => {
            assert!(
                !o.status.success(),
                "{cell}: the checkpoint succeeded: {out}"
            );
            assert!(
                ids(&store).is_empty(),
                "{cell}: a checkpoint is listed: {out}"
            );
            t.assert_running_intact(&cell);
        }
        Expect::Durable => {
            let listed = ids(&store);
            assert_eq!(listed.len(), 1, "{cell}: {out}");
            t.assert_stopped(&cell);
            assert_store_verifies(&store, &cell);
            assert_restores(&t, &listed[0], &store, &cell);
        }
        Expect::DurableRunning => {
            assert_eq!(ids(&store).len(), 1, "{cell}: {out}");
            t.assert_running_intact(&cell);
        }
    }
    assert_store_verifies(&store, &cell);
    // What the cell says of the tool's end: a SIGTERM is exit 10 when it undid the checkpoint, a SIGKILL
    // is a death by signal, and the guardian says what it did (nothing to do for a durable checkpoint of
    // a tree that runs on).
    if fault.ends_with("=term") && expect == Expect::Running {
        assert_eq!(o.status.code(), Some(10), "{cell}: {out}");
    }
    if fault.ends_with("=kill") {
        assert_eq!(o.status.code(), None, "{cell}: killed by a signal: {out}");
        assert!(
            expect == Expect::DurableRunning || out.contains("guardian"),
            "{cell}: the guardian said nothing: {out}"
        );
    }
}

/// Checkpoint steps and what a fault there must leave.
const CHECKPOINT_CELLS: &[(&str, Expect)] = &[
    ("checkpoint.before-freeze=kill", Expect::Running),
    ("checkpoint.before-freeze=term", Expect::Running),
    ("checkpoint.after-freeze=kill", Expect::Running),
    ("checkpoint.after-freeze=term", Expect::Running),
    ("checkpoint.after-dump=kill", Expect::Running),
    ("checkpoint.after-dump=term", Expect::Running),
    ("checkpoint.after-commit=kill", Expect::Durable),
    ("checkpoint.after-commit=term", Expect::Durable),
    ("store.write=eio", Expect::Running),
    ("store.write=enospc", Expect::Running),
];

/// `--leave-running`, streamed: CRIU leaves the tree stopped and the tool continues it once the store
/// has read every image, before the GPU thaw. Killed before that continue, the guardian continues it.
const LEAVE_RUNNING_CELLS: &[(&str, Expect)] = &[
    ("checkpoint.after-dump=kill", Expect::Running),
    ("checkpoint.after-dump=term", Expect::Running),
    ("checkpoint.after-commit=kill", Expect::DurableRunning),
    ("store.write=eio", Expect::Running),
];

fn checkpoint_matrix(gpu: bool, staged: bool) {
    if !criu_ready() {
        return;
    }
    let extra: &[&str] = if staged { &["--staged"] } else { &[] };
    for (fault, expect) in CHECKPOINT_CELLS {
        checkpoint_cell(gpu, extra, fault, *expect);
    }
}

fn leave_running_matrix(gpu: bool) {
    if !criu_ready() {
        return;
    }
    for (fault, expect) in LEAVE_RUNNING_CELLS {
        checkpoint_cell(gpu, &["--leave-running"], fault, *expect);
    }
}

#[test]
fn checkpoint_faults_cpu_streamed() {
    checkpoint_matrix(false, false);
}

#[test]
fn checkpoint_faults_cpu_staged() {
    checkpoint_matrix(false, true);
}

#[test]
fn checkpoint_faults_gpu_streamed() {
    checkpoint_matrix(true, false);
}

#[test]
fn checkpoint_faults_gpu_staged() {
    checkpoint_matrix(true, true);
}

#[test]
fn leave_running_checkpoint_faults_cpu() {
    leave_running_matrix(false);
}

#[test]
fn leave_running_checkpoint_faults_gpu() {
    leave_running_matrix(true);
}

/// Restore steps: a kill before CRIU or before the GPU restore leaves no copy running (the guardian
/// kills what CRIU made) and the checkpoint restores afterwards; a SIGTERM before CRIU stops the restore
/// (exit 10), one after CRIU is deferred until the copy is whole.
fn restore_matrix(gpu: bool, transfer: &[&str]) {
    if !criu_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let t = Tree::start(gpu, dir.path());
    let o = checkpoint_with_fault(&t, &store, &[], "");
    assert!(o.status.success(), "checkpoint: {}", text(&o));
    t.assert_stopped("checkpoint");
    let id = &ids(&store)[0];
    for fault in [
        "restore.before-criu=kill",
        "restore.before-criu=term",
        "restore.after-criu=kill",
        "restore.after-criu=term",
    ] {
        let cell = format!("{} {transfer:?} {fault}", if gpu { "gpu" } else { "cpu" });
        let mut args = vec!["restore", id.as_str(), "--storage", store.to_str().unwrap()];
        args.extend_from_slice(t.gpu_args());
        args.extend_from_slice(transfer);
        let o = run_with_fault(&args, fault);
        let out = text(&o);
        if fault == "restore.after-criu=term" {
            // Deferred: the copy was finished, and runs.
            assert!(o.status.success(), "{cell}: {out}");
            t.assert_running_intact(&cell);
            for p in t.pids() {
                tree::kill_tree(&[p], Duration::from_secs(5));
            }
        } else {
            assert!(!o.status.success(), "{cell}: {out}");
            if fault.ends_with("=term") {
                assert_eq!(o.status.code(), Some(10), "{cell}: {out}");
            }
        }
        // No copy left behind, whatever happened: the PIDs are free for the next try.
        for p in t.pids() {
            common::wait_pid_free(p);
        }
        assert_store_verifies(&store, &cell);
    }
    // The checkpoint is intact: it restores, and its copy runs with its memory.
    assert_restores(&t, id, &store, "after the restore faults");
}

#[test]
fn restore_faults_cpu() {
    restore_matrix(false, &[]);
}

#[test]
fn restore_faults_cpu_stream() {
    restore_matrix(false, &["--stream"]);
}

#[test]
fn restore_faults_gpu() {
    restore_matrix(true, &[]);
}
