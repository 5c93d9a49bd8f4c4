//! The default restore lets the processes run as soon as CRIU has restored them, their memory copied in
//! behind them (`restore --resume early`): what they touch first is served first, from verified chunks,
//! and whatever they do to their mappings meanwhile (fork, `MADV_DONTNEED`, `munmap`, `mremap`, a
//! mapping split by `mprotect`) must leave every byte right. Real CRIU, as root.

mod common;

use std::process::Command;

use common::*;
use gpu_checkpoint_workloads::read_state;

/// The background fill waits this long before each chunk: a 256 MiB process then takes seconds to come
/// in, and runs (and churns) all that time.
const SLOW_FILL: &str = "restore.memory=sleep:25";

fn restore_env(id: &str, store: &std::path::Path, env: &[(&str, &str)]) -> std::process::Output {
    let s = store.to_str().unwrap();
    Command::new(gc_bin())
        .args(["restore", id, "--storage", s, "--format", "json"])
        .envs(env.iter().copied())
        .output()
        .expect("run gpu-checkpoint")
}

/// The churn over `mib` MiB, under way.
fn churning(dir: &std::path::Path, mib: &str) -> Workload {
    let w = Workload::start("churn", dir, &["--mib", mib]);
    w.wait_state("churning", |r| {
        r.first()
            .and_then(|r| gpu_checkpoint_workloads::field_u64(r, "rounds"))
            .is_some_and(|n| n >= 3)
    });
    w
}

/// A checkpoint of the churn alone: one taken while its forked child lives holds both, and CRIU then
/// restores their shared memory itself (none of it comes through userfaultfd). Taken `--leave-running`
/// until one holds the churn alone; the churn is then killed, to be restored.
/// A churning workload of `mib` MiB in a fresh CRIU scene, checkpointed alone (`None`: no CRIU here,
/// the reason printed): the scene's folder and store, the workload and its checkpoint.
fn churned(
    mib: &str,
) -> Option<(
    tempfile::TempDir,
    std::path::PathBuf,
    Workload,
    serde_json::Value,
)> {
    let (dir, store) = criu_scene()?;
    let w = churning(dir.path(), mib);
    let ck = checkpoint_alone(&w, &store);
    Some((dir, store, w, ck))
}

fn checkpoint_alone(w: &Workload, store: &std::path::Path) -> serde_json::Value {
    for _ in 0..50 {
        let ck = checkpoint(w.pid, store, &["--leave-running"]);
        if ck["processes"] == 1 {
            w.kill_and_wait_free();
            return ck;
        }
    }
    panic!("every checkpoint caught the churn with its child");
}

/// A field of the churn's record (0 before it has one).
fn field(w: &Workload, key: &str) -> u64 {
    read_state(&w.state)
        .ok()
        .and_then(|r| {
            r.first()
                .and_then(|r| gpu_checkpoint_workloads::field_u64(r, key))
        })
        .unwrap_or(0)
}

#[test]
fn a_process_running_before_its_memory_is_in_keeps_every_byte_through_forks_and_mapping_changes() {
    let Some((_dir, store, w, ck)) = churned("256") else {
        return;
    };
    let (at_checkpoint, full) = (field(&w, "rounds"), field(&w, "full"));
    let out = restore_env(
        ck["id"].as_str().unwrap(),
        &store,
        &[("GPU_CHECKPOINT_FAULT", SLOW_FILL)],
    );
    let out: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    let t = &out["timings_ms"];
    let (resumed, memory_in) = (
        t["resumed"].as_f64().unwrap(),
        t["memory_in"].as_f64().unwrap(),
    );
    assert!(
        resumed + 500.0 < memory_in,
        "the process ran long before its memory was in: {t}"
    );
    // It went on all along, and goes on, checking every byte, all of its memory twice over.
    let after = w.wait_state("two full checks after the restore", |r| {
        r.first()
            .is_some_and(|r| num(r, "rounds") > at_checkpoint + 512 && num(r, "full") >= full + 2)
    });
    assert_eq!(num(&after[0], "bad"), 0, "{after:?}");
    let u = &t["uffd"];
    assert!(u["faults_served"].as_u64().unwrap() > 0, "{t}");
    assert!(
        u["forks"].as_u64().unwrap() > 0,
        "it forked while its memory came in: {t}"
    );
    assert!(
        u["mapping_changes"].as_u64().unwrap() > 0,
        "it changed its mappings meanwhile: {t}"
    );
}

#[test]
fn the_tool_killed_while_the_memory_comes_in_leaves_no_copy_and_the_checkpoint_restores() {
    let Some((_dir, store, w, ck)) = churned("64") else {
        return;
    };
    let id = ck["id"].as_str().unwrap();
    // Killed at its first chunk, while the restored process runs: the guardian holds the process's
    // userfaultfd, so it waits on memory not yet in (rather than reading zeros) until the guardian kills
    // it.
    let out = restore_env(
        id,
        &store,
        &[("GPU_CHECKPOINT_FAULT", "restore.memory=kill")],
    );
    assert!(out.status.code().is_none(), "killed: {out:?}");
    wait_pid_free(w.pid);
    assert_eq!(
        field(&w, "bad"),
        0,
        "the copy never saw a wrong byte before it was killed"
    );
    w.blank_state();
    assert_eq!(restore(id, &store), w.pid);
    let after = w.wait_state("a full check after the restore", |r| {
        r.first().is_some_and(|r| num(r, "full") >= 1)
    });
    assert_eq!(num(&after[0], "bad"), 0, "{after:?}");
}
