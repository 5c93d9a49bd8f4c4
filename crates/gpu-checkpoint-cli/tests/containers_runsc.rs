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
    let recs = gpu_checkpoint_workloads::read_state(&bundle.rootfs().join("state/c")).ok()?;
    gpu_checkpoint_workloads::field_u64(recs.first()?, "seq")
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
    if !runsc_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let runsc = Runc::runsc(dir.path());
    let bundle = Bundle::new(
        &dir.path().join("bundle"),
        &["exec workload counter --state /state/c"],
        &[],
    );
    let id = format!("gc-{}-rs", std::process::id());
    runsc.run(&id, &bundle);
    let first = counts_past(&bundle, &id, 0);
    let gc = |args: &[&str], env: &[(&str, &str)]| {
        std::process::Command::new(gpu_checkpoint())
            .args(args)
            .args(store_args(&store, &runsc))
            .envs(env.iter().copied())
            .output()
            .unwrap()
    };
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
    let after = counts_past(&bundle, &id, first);

    // The store fails after runsc stopped the sandbox: it comes back from the images, counting on.
    let o = gc(&ck, &[("GPU_CHECKPOINT_FAULT", "store.write=eio")]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        listed(&store).len() == 1,
        "only the first checkpoint is stored"
    );
    assert!(
        runsc.state(&id).is_some_and(|(s, _)| s == "running"),
        "the sandbox runs again"
    );
    let revived = counts_past(&bundle, &id, after);

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
    counts_past(&bundle, &copy, revived);
}
