//! Real gVisor sandboxes (runsc, `--platform=ptrace --network=none`: what works here) checkpointed from
//! the host: `--leave-running`, a failed store write that brings the sandbox back from the images, and
//! a checkpoint that stops the sandbox restored under a new id. CPU only: under gVisor the GPU state
//! lives inside the sandbox (docs/containers.md). Needs root, CRIU, runsc and busybox-static: fails in CI
//! without them, skips locally.

mod container_support;

use container_support::*;
use std::time::{Duration, Instant};

/// The counter's `seq`: its state file is in the bundle's rootfs (gVisor's gofer writes it there).
fn seq(bundle: &Bundle) -> Option<u64> {
    state_field(&bundle.rootfs().join("state/c"), "seq")
}

/// Waits until the counter in `id` passes `above`.
fn counts_past(bundle: &Bundle, id: &str, above: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(s) = seq(bundle).filter(|&s| s > above) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "{id}: the counter stays at {above} or below"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_gvisor_sandbox_checkpoints_restores_and_comes_back_after_a_failure() {
    let Some(s) = Scene::runsc(&["exec workload counter --state /state/c"], &[]) else {
        return;
    };
    let (store, runsc, bundle) = (&s.store, &s.runc, &s.bundle);
    let id = s.run("rs");
    let first = counts_past(bundle, &id, 0);
    let gc = |args: &[&str], env: &[(&str, &str)]| s.gc(args, env);
    let json = |o: std::process::Output| -> serde_json::Value {
        assert!(o.status.success(), "{}", text(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let ck = ["checkpoint", "--container", &id, "--format", "json"];

    let mut args = ck.to_vec();
    args.push("--leave-running");
    let kept = json(gc(&args, &[]));
    assert_eq!(kept["stopped"], false);
    assert_eq!(kept["container"]["runtime"], "runsc");
    let global = kept["container"]["global_args"].as_array().unwrap();
    assert!(
        global.iter().any(|a| a == "--platform=ptrace"),
        "{global:?}"
    );
    // runsc's checkpoint.img was stored while runsc wrote it, not read again afterwards.
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(kept["manifest"].as_str().unwrap()).unwrap())
            .unwrap();
    let meta = &manifest["metadata"];
    assert_eq!(meta["timings_ms"]["streamed"], true, "{meta}");
    // The streamed image is counted (a small sandbox's, compressed by runsc: about 200 KiB).
    assert!(
        meta["sizes"]["image_bytes"].as_u64().unwrap() > 64 << 10,
        "{}",
        meta["sizes"]
    );
    let after = counts_past(bundle, &id, first);

    // The store fails after runsc stopped the sandbox: it comes back from the images, counting on.
    let o = gc(&ck, &[("GPU_CHECKPOINT_FAULT", "store.write=eio")]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        listed(store).len() == 1,
        "only the first checkpoint is stored"
    );
    assert!(
        runsc.state(&id).is_some_and(|(s, _)| s == "running"),
        "the sandbox runs again"
    );
    let revived = counts_past(bundle, &id, after);

    let stopped = json(gc(&ck, &[]));
    assert_eq!(stopped["stopped"], true);
    assert_eq!(
        runsc.state(&id),
        None,
        "the checkpointed sandbox is deleted"
    );
    let copy = format!("{id}-2");
    // The runtime's flags come from the checkpoint.
    let restore = [
        "restore",
        stopped["id"].as_str().unwrap(),
        "--container",
        &copy,
    ];
    let o = std::process::Command::new(gpu_checkpoint())
        .args(restore)
        .args(["--storage", store.to_str().unwrap(), "--runtime", "runsc"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(runsc.state(&copy).is_some_and(|(s, _)| s == "running"));
    counts_past(bundle, &copy, revived);

    // Dropping the runtime deletes every sandbox it started: none of their processes is left.
    let root = runsc.root.clone();
    let Scene {
        runc, dir: _dir, ..
    } = s;
    drop(runc);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !sandbox_processes(&root).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(
        sandbox_processes(&root),
        Vec::<u32>::new(),
        "runsc processes left"
    );
}

/// The PIDs of runsc's processes (sandbox, gofer) that run with this state folder.
fn sandbox_processes(root: &std::path::Path) -> Vec<u32> {
    let flag = format!("--root={}", root.display());
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).any(|arg| arg == flag.as_bytes()))
        })
        .collect()
}

/// `runsc exec ID /bin/sim-cuda-checkpoint ARGS...` -> stdout (the SIMULATED tool's own checks).
fn sim_tool(runsc: &Runc, id: &str, args: &[&str]) -> String {
    let o = common::run_ok(
        runsc
            .cmd()
            .args(["exec", id, "/bin/sim-cuda-checkpoint"])
            .args(args),
        &format!("sim-cuda-checkpoint {args:?}"),
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The simulator's kernel steps, summed over its workers (its `STATUS`).
fn sim_steps(runsc: &Runc, id: &str) -> u64 {
    let out = sim_tool(runsc, id, &["--status", "--pid", "1"]);
    out.split_whitespace()
        .find_map(|kv| kv.strip_prefix("steps="))
        .map(|v| v.split(',').filter_map(|n| n.parse::<u64>().ok()).sum())
        .unwrap_or_else(|| panic!("no steps in `{out}`"))
}

/// A sandbox named after `tag` running the SIMULATED GPU workload as its init (guest PID 1), with the
/// SIMULATED stand-in for `cuda-checkpoint` at /bin/sim-cuda-checkpoint inside, in a new folder beside a
/// store path: the scene and the sandbox's id once the simulator answers there, or `None` (with the
/// reason printed) where runsc is not ready.
fn gpu_sandbox(tag: &str) -> Option<(Scene, String)> {
    let s = Scene::runsc(&["exec gpu-sim-workload --mib 8 --workers 2"], &[])?;
    let (runsc, bundle) = (&s.runc, &s.bundle);
    let tool = built_beside(
        "sim-cuda-checkpoint",
        "cargo build -p gpu-checkpoint-workloads",
    );
    std::fs::copy(&tool, bundle.rootfs().join("bin/sim-cuda-checkpoint")).unwrap();
    copy_libraries(&tool, &bundle.rootfs());
    let id = s.run(tag);
    wait_for("the simulator answers inside the sandbox", &|| {
        runsc
            .cmd()
            .args([
                "exec",
                &id,
                "/bin/sim-cuda-checkpoint",
                "--get-state",
                "--pid",
                "1",
            ])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("running"))
    });
    Some((s, id))
}

/// Checkpoint arguments that freeze the sandbox's GPU state inside it with the SIMULATED tool.
fn gpu_checkpoint_args(id: &str) -> Vec<&str> {
    vec![
        "checkpoint",
        "--container",
        id,
        "--cuda-checkpoint-path",
        "/bin/sim-cuda-checkpoint",
    ]
}

/// `gpu-checkpoint checkpoint --container ID --runtime runsc --cuda-checkpoint-path TOOL`: the GPU state
/// is frozen inside the sandbox around runsc's checkpoint, put back there after a failed store write
/// (the sandbox brought back first), and restored inside the new sandbox, where the SIMULATED device
/// memory is verified and the workload computes on. (The host sees no GPU state in this sandbox: the
/// simulator's lives in the sentry, so without the tool the checkpoint would not freeze it at all.)
#[test]
fn gpu_checkpoint_freezes_a_gvisor_sandbox_gpu_state_inside_it() {
    let Some((s, id)) = gpu_sandbox("rt") else {
        return;
    };
    let (store, runsc, bundle) = (&s.store, &s.runc, &s.bundle);
    let gc = |args: &[&str], env: &[(&str, &str)]| s.gc(args, env);
    let mut ck = gpu_checkpoint_args(&id);
    ck.extend(["--format", "json"]);
    // --leave-running: the sandbox is brought back from the images, then its GPU state inside.
    let mut kept = ck.to_vec();
    kept.push("--leave-running");
    let o = gc(&kept, &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("SIMULATED"), "{}", text(&o));
    assert!(sim_tool(runsc, &id, &["--get-state", "--pid", "1"]).contains("running"));
    let steps = sim_steps(runsc, &id);
    wait_for("the simulator computes on after --leave-running", &|| {
        sim_steps(runsc, &id) > steps
    });

    // The store fails after runsc stopped the sandbox: it comes back, its GPU state restored inside.
    let o = gc(&ck, &[("GPU_CHECKPOINT_FAULT", "store.write=eio")]);
    assert!(!o.status.success(), "{}", text(&o));
    assert_eq!(
        listed(store).len(),
        1,
        "only the first checkpoint is stored"
    );
    assert!(sim_tool(runsc, &id, &["--get-state", "--pid", "1"]).contains("running"));
    let before = sim_steps(runsc, &id);
    wait_for("the revived simulator computes on", &|| {
        sim_steps(runsc, &id) > before
    });

    let o = gc(&ck, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(listed(store).len(), 2);
    assert_eq!(out["stopped"], true);
    assert_eq!(
        out["container"]["sandbox_gpu_tool"],
        "/bin/sim-cuda-checkpoint"
    );
    assert_eq!(out["container"]["sandbox_gpu_pids"], serde_json::json!([1]));
    assert_eq!(
        runsc.state(&id),
        None,
        "the checkpointed sandbox is deleted"
    );

    let copy = format!("{id}-2");
    let restore = || {
        std::process::Command::new(gpu_checkpoint())
            .args(["restore", out["id"].as_str().unwrap(), "--container", &copy])
            .args(["--storage", store.to_str().unwrap(), "--runtime", "runsc"])
            .output()
            .unwrap()
    };
    // The tool gone from the sandbox: the GPU restore fails, no sandbox is left, the checkpoint stays.
    let tool = bundle.rootfs().join("bin/sim-cuda-checkpoint");
    let hidden = bundle.rootfs().join("bin/hidden-tool");
    std::fs::rename(&tool, &hidden).unwrap();
    let o = restore();
    assert!(!o.status.success(), "{}", text(&o));
    assert_eq!(
        runsc.state(&copy),
        None,
        "the half-restored sandbox is removed"
    );
    assert_eq!(listed(store).len(), 2, "the checkpoint stays");
    std::fs::rename(&hidden, &tool).unwrap();
    let o = restore();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("SIMULATED"), "{}", text(&o));
    assert!(sim_tool(runsc, &copy, &["--get-state", "--pid", "1"]).contains("running"));
    let verified = sim_tool(runsc, &copy, &["--verify", "--pid", "1"]);
    assert!(verified.starts_with("verified"), "{verified}");
    let after = sim_steps(runsc, &copy);
    wait_for("the restored simulator computes on", &|| {
        sim_steps(runsc, &copy) > after
    });
}

/// The in-sandbox freeze (docs/containers.md), shown with this runsc: the `cuda-cli` backend's commands
/// run inside the sandbox by `runsc exec` on the guest PID, with the SIMULATED stand-in for
/// `cuda-checkpoint`, around runsc's own checkpoint and restore. The simulated device memory is checked
/// after the restore and the workload computes on. The simulator's control channel is an abstract
/// socket of the sandbox's network stack: from the host it cannot be reached at all (checked first).
#[test]
fn the_gpu_state_of_a_gvisor_sandbox_is_frozen_from_inside_it_around_runsc_checkpoint() {
    use gpu_checkpoint::freeze::cuda_cli::CudaCli;
    use gpu_checkpoint::freeze::{GpuDriver, ProcessState};
    let Some((s, id)) = gpu_sandbox("rg") else {
        return;
    };
    let (dir, runsc, bundle) = (&s.dir, &s.runc, &s.bundle);
    // The backend inside the sandbox named `id`, on guest PIDs.
    let inside = |id: &str| {
        let mut wrapper: Vec<String> = vec![
            "runsc".into(),
            "--root".into(),
            runsc.root.display().to_string(),
        ];
        wrapper.extend(runsc.global.iter().map(|g| g.to_string()));
        wrapper.extend(["exec".into(), id.to_string()]);
        CudaCli::wrapped(wrapper, "/bin/sim-cuda-checkpoint")
    };
    // The simulated GPU process is the sandbox's init: guest PID 1.
    let gpu = inside(&id);
    // From the host, the sandbox's process has no simulator to talk to.
    let (_, host_pid) = runsc.state(&id).unwrap();
    assert!(
        gpu_checkpoint::freeze::sim::status(host_pid).is_err(),
        "the host reached the sandbox's simulator"
    );

    gpu.lock(1, Some(Duration::from_secs(10))).unwrap();
    let at_lock = sim_steps(runsc, &id);
    gpu.checkpoint(1).unwrap();
    assert_eq!(gpu.state(1).unwrap(), ProcessState::Checkpointed);
    let images = dir.path().join("images");
    std::fs::create_dir(&images).unwrap();
    let o = runsc
        .cmd()
        .args(["checkpoint", "--image-path"])
        .arg(&images)
        .arg(&id)
        .output()
        .unwrap();
    assert!(o.status.success(), "runsc checkpoint: {}", text(&o));
    let copy = format!("{id}-2");
    let o = runsc
        .cmd()
        .args(["restore", "--detach", "--image-path"])
        .arg(&images)
        .arg("--bundle")
        .arg(&bundle.dir)
        .arg(&copy)
        // The restored sandbox keeps the stdio it is given: never a pipe of ours.
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(o.success(), "runsc restore {copy}");
    let gpu = inside(&copy);
    assert_eq!(
        gpu.state(1).unwrap(),
        ProcessState::Checkpointed,
        "the GPU state stays checkpointed across runsc's checkpoint and restore"
    );
    gpu.restore(1, &[]).unwrap();
    gpu.unlock(1).unwrap();
    assert_eq!(gpu.state(1).unwrap(), ProcessState::Running);
    let verified = sim_tool(runsc, &copy, &["--verify", "--pid", "1"]);
    assert!(verified.starts_with("verified"), "{verified}");
    let after = sim_steps(runsc, &copy);
    assert!(after >= at_lock, "steps went back: {after} < {at_lock}");
    wait_for("the restored simulator computes on", &|| {
        sim_steps(runsc, &copy) > after
    });
}

/// Runs `gpu-checkpoint ARGS` and SIGKILLs it while its `runsc checkpoint` runs (a child of the tool
/// whose command line has `checkpoint --image-path`); returns once the guardian, which shares the tool's
/// stderr, is done.
fn killed_during_runsc_checkpoint(s: &Scene, args: &[&str]) -> std::process::Output {
    let tool = std::process::Command::new(gpu_checkpoint())
        .args(args)
        .args(store_args(&s.store, &s.runc))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = tool.id();
    let runs_checkpoint = || {
        has_child(pid as i32, &|argv| {
            argv.contains("checkpoint\0--image-path")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !runs_checkpoint() {
        assert!(Instant::now() < deadline, "runsc checkpoint never ran");
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(20));
    let mut tool = tool;
    tool.kill().unwrap();
    tool.wait_with_output().unwrap()
}

/// The tool SIGKILLed (the guardian's case) right after it locked the sandbox's GPU processes inside it
/// (`container.sandbox-locked`), then while runsc's checkpoint runs (which goes on without the tool and
/// stops the sandbox), then after it stopped the sandbox with its GPU state checkpointed inside
/// (`checkpoint.after-dump`): the guardian waits for runsc's checkpoint, brings the stopped sandbox back
/// from the images, then restores and unlocks the GPU state inside it through the same `runsc exec`.
/// Each time the sandbox runs, the SIMULATED GPU process is `running` (not locked), its device memory
/// verifies, it computes on, and nothing is stored.
#[test]
fn the_tool_killed_after_the_in_sandbox_lock_leaves_the_sandbox_running_and_unlocked() {
    use std::os::unix::process::ExitStatusExt;
    let Some((s, id)) = gpu_sandbox("rk") else {
        return;
    };
    let (store, runsc) = (&s.store, &s.runc);
    let ck = gpu_checkpoint_args(&id);
    for point in [
        "container.sandbox-locked",
        "during runsc checkpoint",
        "checkpoint.after-dump",
    ] {
        let fault = format!("{point}=kill");
        // `output` returns once the guardian, which shares the tool's stderr, is done.
        let o = match point {
            "during runsc checkpoint" => killed_during_runsc_checkpoint(&s, &ck),
            _ => s.gc(&ck, &[("GPU_CHECKPOINT_FAULT", &fault)]),
        };
        assert_eq!(o.status.signal(), Some(9), "{point}: {}", text(&o));
        let said = text(&o);
        assert!(
            said.contains("put back the GPU state of 1 process(es) inside the sandbox"),
            "{point}: the guardian did not unlock inside: {said}"
        );
        assert_eq!(
            said.contains("restored the stopped sandbox from its images"),
            point != "container.sandbox-locked",
            "{point}: runsc's checkpoint stops it: {said}"
        );
        assert!(
            runsc.state(&id).is_some_and(|(s, _)| s == "running"),
            "{point}: the sandbox does not run: {}",
            text(&o)
        );
        let state = sim_tool(runsc, &id, &["--get-state", "--pid", "1"]);
        assert!(
            state.contains("running"),
            "{point}: the GPU process is left {state}: {}",
            text(&o)
        );
        let verified = sim_tool(runsc, &id, &["--verify", "--pid", "1"]);
        assert!(verified.starts_with("verified"), "{point}: {verified}");
        let steps = sim_steps(runsc, &id);
        wait_for("the simulator computes on", &|| {
            sim_steps(runsc, &id) > steps
        });
        assert!(listed(store).is_empty(), "{point}: nothing is stored");
    }

    // Killed once the checkpoint is durable: the guardian leaves the sandbox as the checkpoint left it
    // (stopped by runsc's checkpoint), puts nothing back inside it, and the checkpoint restores.
    let o = s.gc(
        &ck,
        &[("GPU_CHECKPOINT_FAULT", "checkpoint.after-commit=kill")],
    );
    assert_eq!(o.status.signal(), Some(9), "{}", text(&o));
    let said = text(&o);
    assert!(said.contains("the checkpoint was durable"), "{said}");
    assert!(!said.contains("inside the sandbox"), "{said}");
    assert!(!said.contains("restored the stopped sandbox"), "{said}");
    assert!(
        runsc.state(&id).is_none_or(|(s, _)| s != "running"),
        "the checkpointed sandbox was brought back: {said}"
    );
    let stored = listed(store);
    assert_eq!(stored.len(), 1, "the durable checkpoint is kept");
    let copy = format!("{id}-2");
    let o = std::process::Command::new(gpu_checkpoint())
        .args(["restore", stored[0]["id"].as_str().unwrap()])
        .args(["--container", &copy])
        .args(store_args(store, runsc))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(sim_tool(runsc, &copy, &["--get-state", "--pid", "1"]).contains("running"));
    let verified = sim_tool(runsc, &copy, &["--verify", "--pid", "1"]);
    assert!(verified.starts_with("verified"), "{verified}");
}
