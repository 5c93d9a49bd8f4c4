//! Kubernetes' checkpoint path with a real containerd (2.1) driven through its CRI API as the kubelet
//! drives it (KEP-2008 `CheckpointContainer`; restore by `CreateContainer` from the archive), the node
//! set up as docs/kubernetes.md says (`gpu-checkpoint node-setup --engine containerd`): containerd's runc
//! is gpu-checkpoint's wrapper, which freezes the SIMULATED GPU state of the container's processes with
//! the freeze stage around runc's checkpoint, records it in containerd's own archive, and restores it
//! onto the GPUs the new container was given. Needs root, CRIU, runc, busybox-static and containerd
//! (scripts/install-containerd.sh): fails in CI without them, skips locally.

mod container_support;
mod engine_support;

use std::path::Path;
use std::time::{Duration, Instant};

use container_support::*;
use engine_support::*;
use gpu_checkpoint::freeze::sim;

/// The container's init: a shell counting in memory (written to /tmp/c) beside a SIMULATED GPU process
/// with one child, each computing on simulated GPU 0.
const GPU_SCRIPT: &str = "gpu-sim-workload --mib 8 --children 1 --workers 1 & \
     i=0; while true; do i=$((i+1)); echo $i > /tmp/c; usleep 100000; done";
const CPU_SCRIPT: &str = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; usleep 100000; done";

const RUNNING: i32 = cri_client::api::ContainerState::ContainerRunning as i32;

fn gpu_env(index: u32) -> (&'static str, String) {
    (
        "NVIDIA_VISIBLE_DEVICES",
        sim::sim_gpu_uuid(index).to_string(),
    )
}

/// The container's SIMULATED GPU processes, once `n` of them answer.
fn gpu_pids(node: &mut Node, id: &str, n: usize) -> Vec<i32> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pids: Vec<i32> = node
            .pids(id)
            .into_iter()
            .filter(|&p| sim::status(p).is_ok())
            .collect();
        if pids.len() >= n {
            return pids;
        }
        assert!(
            Instant::now() < deadline,
            "{id}: {pids:?} of {n} GPU processes up"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The shell's counter, once it has one.
fn counter(node: &mut Node, id: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(n) = node.read_number(id, "/tmp/c") {
            return n;
        }
        assert!(Instant::now() < deadline, "{id}: no counter");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Creates and starts container `name` in pod `pod` running `script` with `env`.
fn run(
    node: &mut Node,
    pod: &(String, cri_client::api::PodSandboxConfig),
    name: &str,
    image: &str,
    script: &str,
    env: &[(&str, &str)],
) -> Result<String, (String, cri_client::Error)> {
    let config = container_config(name, image, script, env);
    let id = node
        .cri
        .create(&pod.0, &config, &pod.1)
        .expect("CreateContainer");
    node.cri.start(&id).map_err(|e| (id.clone(), e))?;
    Ok(id)
}

/// The record gpu-checkpoint put into containerd's archive.
fn record_of(archive_path: &Path) -> serde_json::Value {
    let files = archive(archive_path);
    assert!(
        files.contains_key("checkpoint/inventory.img"),
        "CRIU's images in containerd's archive: {:?}",
        files.keys()
    );
    for f in ["config.dump", "spec.dump", "status.dump"] {
        assert!(files.contains_key(f), "{f}: {:?}", files.keys());
    }
    let rec = files
        .get("checkpoint/gpu-checkpoint.json")
        .unwrap_or_else(|| panic!("no GPU record in the archive: {:?}", files.keys()));
    serde_json::from_slice(rec).unwrap()
}

#[test]
fn a_gpu_container_is_checkpointed_and_restored_through_containerds_cri_onto_the_gpu_it_is_given() {
    if !containerd_ready() {
        return;
    }
    let _turn = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &[]);
    let pod = node.pod("gpu-pod");
    let (k, v) = gpu_env(0);
    let id = run(
        &mut node,
        &pod,
        "gpu",
        &image().name,
        GPU_SCRIPT,
        &[(k, &v)],
    )
    .unwrap();
    let pids = gpu_pids(&mut node, &id, 2);
    let before = counter(&mut node, &id);

    // KEP-2008: the kubelet's checkpoint is the CRI's CheckpointContainer; the container runs on.
    let ck = dir.path().join("checkpoint.tar");
    node.cri
        .checkpoint(&id, &ck, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("CheckpointContainer: {e}"));
    let after = counter(&mut node, &id);
    assert_eq!(node.state(&id), RUNNING);
    assert_healthy(&pids);

    // containerd's own archive, with our record: the GPU state frozen by the freeze stage.
    let rec = record_of(&ck);
    assert_eq!(rec["schema"], "gpu-checkpoint/engine-checkpoint");
    assert!(
        rec["frozen_by"]
            .as_str()
            .unwrap()
            .contains("gpu-checkpoint"),
        "{rec}"
    );
    assert_eq!(rec["strategy"], "cuda-driver");
    assert_eq!(rec["leave_running"], true);
    assert_eq!(rec["given_gpus"], serde_json::json!([v]));
    let gpu = &rec["gpu"];
    assert_eq!(gpu["backend"], "sim");
    assert!(
        gpu["driver_version"]
            .as_str()
            .unwrap()
            .contains("SIMULATED"),
        "{gpu}"
    );
    assert_eq!(gpu["gpus"][0]["model"], sim::SIM_MODEL);
    assert!(gpu["gpus"][0]["memory_bytes"].as_u64().unwrap() > 0);
    let processes = gpu["processes"].as_array().unwrap();
    assert_eq!(processes.len(), 2, "{gpu}");
    for p in processes {
        let ops: Vec<&str> = p["steps"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["op"].as_str().unwrap())
            .collect();
        assert_eq!(ops, ["lock", "checkpoint"], "{p}");
        assert!(p["memory"][0]["bytes"].as_u64().unwrap() >= 8 << 20, "{p}");
    }
    assert_eq!(
        gpu["thaw"].as_array().unwrap().len(),
        2,
        "restored + unlocked after the dump"
    );

    // The pod goes; the kubelet's restore creates the container from the archive in a new pod, given
    // another GPU: the checkpoint's GPU 0 is mapped onto it.
    node.cri.remove(&id, Duration::ZERO).unwrap();
    node.cri.remove_pod(&pod.0).unwrap();
    wait_gone(&pids);
    let pod2 = node.pod("gpu-pod-restored");
    let (k, v1) = gpu_env(1);
    let restored = run(
        &mut node,
        &pod2,
        "gpu",
        &ck.display().to_string(),
        GPU_SCRIPT,
        &[(k, &v1)],
    )
    .unwrap_or_else(|(_, e)| panic!("restore: {e}"));
    assert_eq!(node.state(&restored), RUNNING);
    let now = gpu_pids(&mut node, &restored, 2);
    assert_healthy(&now);
    for &p in &now {
        let st = sim::status(p).unwrap();
        assert_eq!(
            st["uuids"], v1,
            "pid {p} runs on the GPU the container was given"
        );
    }
    // The counter carried on from where it was checkpointed.
    let resumed = counter(&mut node, &restored);
    assert!(
        resumed >= before && resumed < after + 50,
        "before {before}, at the checkpoint <= {after}, restored {resumed}"
    );
    wait_for("the restored counter to go on", &|| {
        node_counter_above(&node.socket, &restored, resumed)
    });
}

/// Whether container `id`'s counter went past `n` (a client of its own: `wait_for` takes `Fn`).
fn node_counter_above(socket: &Path, id: &str, n: u64) -> bool {
    let mut cri = cri_client::Cri::connect(socket, Duration::from_secs(10)).unwrap();
    cri.exec(id, &["cat", "/tmp/c"])
        .ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<u64>()
                .ok()
        })
        .is_some_and(|v| v > n)
}

/// `runc state` of `id` under containerd's runc root: whether runc knows the container.
fn runc_knows(id: &str) -> bool {
    std::process::Command::new("runc")
        .args(["--root", RUNC_ROOT, "state", id])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Every GPU process is `running` (not locked, not checkpointed), verified and computing.
fn untouched(node: &mut Node, id: &str, pids: &[i32]) {
    assert_eq!(node.state(id), RUNNING);
    assert_healthy(pids);
    let c = counter(node, id);
    wait_for("the counter to go on", &|| {
        node_counter_above(&node.socket, id, c)
    });
}

#[test]
fn a_gpu_container_the_freeze_cannot_take_is_refused_with_the_reason_and_keeps_running() {
    if !containerd_ready() {
        return;
    }
    let _turn = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &[]);
    let pod = node.pod("blocked-pod");
    let (k, v) = gpu_env(0);
    let image = image().name.clone();

    // An MPS client (detect's blocker): refused before anything is touched, with the reason.
    let mps = [(k, v.as_str()), ("CUDA_MPS_PIPE_DIRECTORY", "/tmp/mps")];
    let id = run(&mut node, &pod, "mps", &image, GPU_SCRIPT, &mps).unwrap();
    let pids = gpu_pids(&mut node, &id, 2);
    let ck = dir.path().join("refused.tar");
    let e = node
        .cri
        .checkpoint(&id, &ck, Duration::from_secs(60))
        .expect_err("an MPS client is refused");
    let msg = e.to_string();
    eprintln!("CheckpointContainer of an MPS client: {msg}");
    assert!(msg.contains("refusing to checkpoint container"), "{msg}");
    assert!(msg.contains("nothing was touched"), "{msg}");
    assert!(msg.contains("mps"), "the blocker is named: {msg}");
    assert!(!ck.exists(), "no archive");
    untouched(&mut node, &id, &pids);
    node.cri.remove(&id, Duration::ZERO).unwrap();
    wait_gone(&pids);

    // The freeze fails half-way (one process's GPU checkpoint): every process is put back (restored
    // and unlocked), the container runs on, and the engine says why.
    let id = run(&mut node, &pod, "fault", &image, GPU_SCRIPT, &[(k, &v)]).unwrap();
    let pids = gpu_pids(&mut node, &id, 2);
    sim::inject_fault(pids[1], "checkpoint").unwrap();
    let e = node
        .cri
        .checkpoint(&id, &ck, Duration::from_secs(60))
        .expect_err("the freeze fails");
    let msg = e.to_string();
    assert!(msg.contains("checkpoint of pid"), "{msg}");
    sim::inject_fault(pids[1], "none").unwrap();
    untouched(&mut node, &id, &pids);
    // And then it checkpoints.
    node.cri
        .checkpoint(&id, &ck, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("CheckpointContainer: {e}"));
    untouched(&mut node, &id, &pids);
}

#[test]
fn a_restore_onto_gpus_that_cannot_hold_the_checkpoint_is_refused_before_anything_is_created() {
    if !containerd_ready() {
        return;
    }
    let _turn = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let a_dir = dir.path().join("a");
    let mut a = Node::start(&a_dir, &[]);
    let pod = a.pod("src");
    let (k, v) = gpu_env(0);
    let image = image().name.clone();
    let id = run(&mut a, &pod, "gpu", &image, GPU_SCRIPT, &[(k, &v)]).unwrap();
    let pids = gpu_pids(&mut a, &id, 2);
    let ck = dir.path().join("checkpoint.tar");
    a.cri
        .checkpoint(&id, &ck, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("CheckpointContainer: {e}"));
    a.cri.remove(&id, Duration::ZERO).unwrap();
    wait_gone(&pids);
    let archive = ck.display().to_string();

    let refused = |node: &mut Node,
                   pod: &(String, cri_client::api::PodSandboxConfig),
                   env: &[(&str, &str)],
                   why: &str| {
        let (id, e) = run(node, pod, "restored", &archive, GPU_SCRIPT, env)
            .expect_err("the restore is refused");
        let msg = e.to_string();
        eprintln!("StartContainer of the restore ({why}): {msg}");
        assert!(msg.contains("refusing to restore"), "{msg}");
        assert!(msg.contains("nothing was created"), "{msg}");
        assert!(msg.contains(why), "{why:?} not in {msg}");
        assert_ne!(node.state(&id), RUNNING);
        assert!(!runc_knows(&id), "runc created {id}");
        assert!(node.pids(&id).is_empty(), "{id} has processes");
        node.cri.remove(&id, Duration::ZERO).unwrap();
    };
    // A GPU the node does not have, and no GPU at all.
    let pod = a.pod("dst");
    let missing = sim::sim_gpu_uuid(7).to_string();
    refused(&mut a, &pod, &[(k, &missing)], "not on this node");
    refused(&mut a, &pod, &[], "given no GPU");

    // Another node, whose GPUs are smaller than the checkpoint's (4 MiB against 1 GiB).
    let b_dir = dir.path().join("b");
    let mut b = Node::start(&b_dir, &[(sim::ENV_GPU_MIB, "4")]);
    let pod = b.pod("dst");
    refused(&mut b, &pod, &[(k, &v)], "memory");
}

#[test]
fn a_cpu_only_container_goes_through_the_cri_without_a_gpu_step() {
    if !containerd_ready() {
        return;
    }
    let _turn = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let mut node = Node::start(dir.path(), &[]);
    let pod = node.pod("cpu-pod");
    let image = image().name.clone();
    let id = run(&mut node, &pod, "cpu", &image, CPU_SCRIPT, &[]).unwrap();
    let before = counter(&mut node, &id);
    let ck = dir.path().join("checkpoint.tar");
    node.cri
        .checkpoint(&id, &ck, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("CheckpointContainer: {e}"));
    let after = counter(&mut node, &id);
    let rec = record_of(&ck);
    assert_eq!(rec["strategy"], "none");
    assert!(rec["gpu"].is_null() && rec["frozen_by"].is_null(), "{rec}");
    node.cri.remove(&id, Duration::ZERO).unwrap();
    let pod2 = node.pod("cpu-restored");
    let restored = run(
        &mut node,
        &pod2,
        "cpu",
        &ck.display().to_string(),
        CPU_SCRIPT,
        &[],
    )
    .unwrap_or_else(|(_, e)| panic!("restore: {e}"));
    let resumed = counter(&mut node, &restored);
    assert!(
        resumed >= before && resumed < after + 50,
        "before {before}, at the checkpoint <= {after}, restored {resumed}"
    );
    wait_for("the restored counter to go on", &|| {
        node_counter_above(&node.socket, &restored, resumed)
    });
}

/// The wrapper is SIGKILLed right after it froze the GPU state (containerd had paused the container
/// for its checkpoint): its guardian resumes the container and puts the GPU state back, so the
/// container computes on, and the CRI call fails.
#[test]
fn the_wrapper_killed_after_the_freeze_leaves_the_container_computing() {
    if !containerd_ready() {
        return;
    }
    let _turn = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let fault = [("GPU_CHECKPOINT_FAULT", "engine.after-freeze=kill")];
    let mut node = Node::start(dir.path(), &fault);
    let pod = node.pod("killed");
    let (k, v) = gpu_env(0);
    let image = image().name.clone();
    let id = run(&mut node, &pod, "gpu", &image, GPU_SCRIPT, &[(k, &v)]).unwrap();
    let pids = gpu_pids(&mut node, &id, 2);
    let ck = dir.path().join("checkpoint.tar");
    let e = node
        .cri
        .checkpoint(&id, &ck, Duration::from_secs(60))
        .expect_err("the wrapper was killed");
    eprintln!("CheckpointContainer with the wrapper killed: {e}");
    // The guardian works on after the wrapper died.
    wait_for("the GPU processes to be unlocked", &|| {
        pids.iter()
            .all(|&p| sim::status(p).is_ok_and(|s| s["state"] == "running"))
    });
    // The guardian says what it did, in the node's log (not in runc's output, which the engine reads
    // to its end).
    let log = node.prefix.join("var/log/gpu-checkpoint/guardian.log");
    wait_for("the guardian's report", &|| {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("put back the GPU state of 2"))
    });
    eprintln!("{}", std::fs::read_to_string(&log).unwrap());
    untouched(&mut node, &id, &pids);
}
