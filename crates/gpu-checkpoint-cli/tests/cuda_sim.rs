//! `gpu-checkpoint cuda ...` against the SIMULATED GPU: the lifecycle, device memory moving out and
//! back, illegal transitions, lock semantics, injected faults, device maps, and JSON timings.

mod sim_support;

use gpu_checkpoint::freeze::sim;
use sim_support::*;
use std::time::Instant;

fn cuda(action: &str, pid: i32, extra: &[&str]) -> std::process::Output {
    let pid = pid.to_string();
    let mut args = vec!["cuda", action, "--pid", &pid, "--gpu-backend", "sim"];
    args.extend_from_slice(extra);
    run(&args)
}

fn ok(action: &str, pid: i32, extra: &[&str]) -> String {
    let o = cuda(action, pid, extra);
    assert!(o.status.success(), "cuda {action} {extra:?}: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

fn fails(action: &str, pid: i32, extra: &[&str], code: i32, needle: &str) -> String {
    let o = cuda(action, pid, extra);
    assert_eq!(o.status.code(), Some(code), "cuda {action}: {}", text(&o));
    let t = text(&o);
    assert!(
        t.contains(needle),
        "cuda {action}: expected `{needle}` in: {t}"
    );
    t
}

/// `cuda state` says `running`, and the process computes on, its device memory intact.
fn runs_intact(pid: i32) {
    assert_eq!(ok("state", pid, &[]), "running");
    assert_progress(pid);
    assert_verified(pid);
}

#[test]
fn lifecycle_moves_device_memory_out_and_back() {
    let p = SimProcess::start(&["--mib", "4", "--devices", "2"]);
    let pid = p.pid;
    assert_eq!(ok("state", pid, &[]), "running");
    assert_progress(pid);

    ok("lock", pid, &["--timeout", "5000"]);
    assert_eq!(ok("state", pid, &[]), "locked");
    let locked = status(pid);
    let frozen_steps = steps(pid);
    std::thread::sleep(std::time::Duration::from_millis(100));
    assert_eq!(steps(pid), frozen_steps, "no kernel runs while locked");
    // STATUS reports the real device memory: its checksum is the device file's.
    let file = sim::device_file(pid, 0);
    let on_disk = blake3::hash(&std::fs::read(&file).unwrap()).to_hex()[..16].to_string();
    assert_eq!(locked["checksums"].split(',').next().unwrap(), on_disk);

    ok("checkpoint", pid, &[]);
    assert_eq!(ok("state", pid, &[]), "checkpointed");
    assert!(!file.exists(), "checkpoint releases the simulated device");
    assert!(!sim::device_file(pid, 1).exists());
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        !maps.contains("gpu-checkpoint-sim"),
        "no device mapping left:\n{maps}"
    );
    assert_eq!(
        status(pid)["checksums"],
        locked["checksums"],
        "host copy holds the device memory"
    );

    ok("restore", pid, &[]);
    assert_eq!(ok("state", pid, &[]), "locked");
    assert!(file.exists(), "restore maps a new simulated device");
    assert_eq!(status(pid)["checksums"], locked["checksums"]);
    assert_verified(pid);

    ok("unlock", pid, &[]);
    runs_intact(pid);
}

#[test]
fn illegal_transitions_are_refused_and_change_nothing() {
    let p = SimProcess::start(&["--mib", "1"]);
    let pid = p.pid;
    for action in ["checkpoint", "restore", "unlock"] {
        fails(action, pid, &[], 1, "CUDA_ERROR_ILLEGAL_STATE");
        assert_eq!(ok("state", pid, &[]), "running");
    }
    ok("lock", pid, &[]);
    fails("lock", pid, &[], 1, "ILLEGAL_STATE");
    fails("restore", pid, &[], 1, "ILLEGAL_STATE");
    ok("checkpoint", pid, &[]);
    fails("unlock", pid, &[], 1, "ILLEGAL_STATE");
    fails("checkpoint", pid, &[], 1, "ILLEGAL_STATE");
    fails("lock", pid, &[], 1, "ILLEGAL_STATE");
    assert_eq!(ok("state", pid, &[]), "checkpointed");
    ok("restore", pid, &[]);
    ok("unlock", pid, &[]);
    assert_progress(pid);
    assert_verified(pid);
}

#[test]
fn lock_waits_for_in_flight_work_up_to_the_timeout() {
    // Each simulated kernel runs 400 ms: a 50 ms lock cannot drain it, a 5 s lock can.
    let p = SimProcess::start(&["--mib", "1", "--workers", "1", "--kernel-us", "400000"]);
    let pid = p.pid;
    std::thread::sleep(std::time::Duration::from_millis(100));
    let t = Instant::now();
    fails("lock", pid, &["--timeout", "50"], 1, "CUDA_ERROR_NOT_READY");
    assert!(t.elapsed().as_millis() >= 50);
    assert_eq!(
        ok("state", pid, &[]),
        "running",
        "a timed-out lock leaves it running"
    );
    assert_progress(pid);
    ok("lock", pid, &["--timeout", "5000"]);
    assert_eq!(ok("state", pid, &[]), "locked");
    ok("unlock", pid, &[]);
}

#[test]
fn injected_faults_leave_the_process_usable() {
    let p = SimProcess::start(&["--mib", "2"]);
    let pid = p.pid;

    sim::inject_fault(pid, "lock-timeout").unwrap();
    fails("lock", pid, &["--timeout", "100"], 1, "NOT_READY");
    assert_eq!(ok("state", pid, &[]), "running");

    // toggle undoes its own lock when the checkpoint fails (NVIDIA's utility leaves it locked).
    sim::inject_fault(pid, "checkpoint").unwrap();
    fails("toggle", pid, &[], 1, "CUDA_ERROR_NOT_SUPPORTED");
    assert_eq!(ok("state", pid, &[]), "running");
    assert_progress(pid);

    sim::inject_fault(pid, "restore-oom").unwrap();
    ok("toggle", pid, &[]);
    assert_eq!(ok("state", pid, &[]), "checkpointed");
    fails("restore", pid, &[], 1, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(
        ok("state", pid, &[]),
        "checkpointed",
        "a failed restore can be retried"
    );
    sim::inject_fault(pid, "restore").unwrap();
    fails("toggle", pid, &[], 1, "CUDA_ERROR_OPERATING_SYSTEM");
    sim::inject_fault(pid, "none").unwrap();
    ok("toggle", pid, &[]);
    runs_intact(pid);
}

#[test]
fn device_map_moves_to_other_simulated_gpus() {
    let p = SimProcess::start(&["--mib", "1", "--devices", "2"]);
    let pid = p.pid;
    let before = status(pid)["uuids"].clone();
    ok("lock", pid, &[]);
    ok("checkpoint", pid, &[]);
    fails("restore", pid, &["--device-map", "0=7"], 2, "index 7");
    fails("restore", pid, &["--device-map", "nonsense"], 2, "OLD=NEW");
    fails("restore", pid, &["--device-map", "0=1"], 1, "do not cover");
    let u0 = sim::sim_gpu_uuid(0).to_string();
    let u1 = sim::sim_gpu_uuid(1).to_string();
    ok("restore", pid, &["--device-map", &format!("{u0}=1,1={u0}")]);
    let after = status(pid)["uuids"].clone();
    assert_eq!(before, format!("{u0},{u1}"));
    assert_eq!(after, format!("{u1},{u0}"));
    ok("unlock", pid, &[]);
    assert_verified(pid);
}

#[test]
fn json_reports_every_call_with_its_time() {
    let p = SimProcess::start(&["--mib", "1"]);
    let o = cuda("toggle", p.pid, &["--format", "json"]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["backend"], "sim");
    assert_eq!(v["ok"], true);
    assert_eq!(v["state"], "checkpointed");
    let ops = strings(&v["calls"], "op");
    assert_eq!(ops, ["state", "lock", "checkpoint", "state"]);
    assert!(v["calls"][1]["ms"].as_f64().unwrap() >= 0.0);
    let tid: i32 = ok("restore-tid", p.pid, &[]).parse().unwrap();
    assert!(std::path::Path::new(&format!("/proc/{}/task/{tid}", p.pid)).exists());
    ok("toggle", p.pid, &[]);
}

#[test]
fn processes_without_a_gpu_context_and_missing_ones_are_clear_errors() {
    let p = SimProcess::start(&["--mib", "1", "--no-context"]);
    fails("state", p.pid, &[], 1, "CUDA_ERROR_NOT_INITIALIZED");
    fails("state", 999_999_999, &[], 3, "no such process");
    // Our own test process has no simulated GPU at all.
    fails(
        "state",
        std::process::id() as i32,
        &[],
        1,
        "not a simulated GPU process",
    );
    // auto never picks the simulator.
    let o = run(&["cuda", "state", "--pid", &p.pid.to_string()]);
    assert!(!o.status.success());
    assert!(!text(&o).contains("SIMULATED"), "{}", text(&o));
}
