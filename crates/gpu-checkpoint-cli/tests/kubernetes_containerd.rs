//! Kubernetes' checkpoint path with a real containerd (2.1) driven through its CRI API as the kubelet
//! drives it (KEP-2008 `CheckpointContainer`; restore by `CreateContainer` from the archive), the node
//! set up as docs/kubernetes.md says (`gpu-checkpoint node-setup --engine containerd`): containerd's runc
//! is gpu-checkpoint's wrapper, which freezes the SIMULATED GPU state of the container's processes with
//! the freeze stage around runc's checkpoint, records it in containerd's own archive, and restores it
//! onto the GPUs the new container was given. Needs root, CRIU, runc, busybox-static and containerd
//! (scripts/install-containerd.sh): fails in CI without them, skips locally.

mod container_support;
mod engine_support;

use std::path::{Path, PathBuf};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use container_support::*;
use cri_client::api::PodSandboxConfig;
use engine_support::*;
use gpu_checkpoint::freeze::sim;

/// The container's init: a shell counting in memory (written to /tmp/c) beside a SIMULATED GPU process
/// with one child, each computing on simulated GPU 0.
const GPU_SCRIPT: &str = "gpu-sim-workload --mib 8 --children 1 --workers 1 & \
     i=0; while true; do i=$((i+1)); echo $i > /tmp/c; usleep 100000; done";
const CPU_SCRIPT: &str = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; usleep 100000; done";

const RUNNING: i32 = cri_client::api::ContainerState::ContainerRunning as i32;
const GPU_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

fn gpu(index: u32) -> String {
    sim::sim_gpu_uuid(index).to_string()
}

type Pod = (String, PodSandboxConfig);

/// One test's node, its turn taken (fields drop in order: the node before its folder).
struct Scene {
    node: Node,
    dir: tempfile::TempDir,
    _turn: MutexGuard<'static, ()>,
}

/// A node whose containerd runs with `env`; `None` where containerd tests cannot run (skipped).
fn scene(env: &[(&str, &str)]) -> Option<Scene> {
    if !containerd_ready() {
        return None;
    }
    let turn = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&dir.path().join("node-a"), env);
    Some(Scene {
        node,
        dir,
        _turn: turn,
    })
}

impl Scene {
    /// A container of the test image with SIMULATED GPU processes on GPU 0 (and `env`), and those
    /// processes once both answer.
    fn start_gpu(&mut self, pod: &Pod, name: &str, env: &[(&str, &str)]) -> (String, Vec<i32>) {
        let gpu0 = gpu(0);
        let mut env = env.to_vec();
        env.push((GPU_ENV, &gpu0));
        let id = run_on(&mut self.node, pod, name, &image().name, GPU_SCRIPT, &env)
            .unwrap_or_else(|(_, e)| panic!("{name}: {e}"));
        let pids = gpu_pids(&mut self.node, &id);
        (id, pids)
    }

    /// Waits until the guardian's log (the node's, not runc's output, which the engine reads to its end)
    /// says `what`, and shows it.
    fn guardian_said(&self, what: &str) {
        let log = self.node.prefix.join("var/log/gpu-checkpoint/guardian.log");
        wait_for("the guardian's report", &|| {
            std::fs::read_to_string(&log).is_ok_and(|l| l.contains(what))
        });
        eprintln!("{}", std::fs::read_to_string(&log).unwrap());
    }

    /// `CheckpointContainer` into `checkpoint.tar` in the test's folder, which must succeed: the archive.
    fn checkpointed(&mut self, id: &str) -> PathBuf {
        self.checkpoint(id, "checkpoint.tar")
            .unwrap_or_else(|e| panic!("CheckpointContainer: {e}"))
    }

    /// `CheckpointContainer` into `name` in the test's folder.
    fn checkpoint(&mut self, id: &str, name: &str) -> Result<PathBuf, cri_client::Error> {
        let path = self.dir.path().join(name);
        self.node
            .cri
            .checkpoint(id, &path, Duration::from_secs(60))
            .map(|()| path)
    }
}

/// A [`scene`] whose wrapper is SIGKILLed at fault point `point` (`GPU_CHECKPOINT_FAULT`), with a GPU
/// container running in pod `pod` ([`Scene::start_gpu`]): its id and GPU processes.
fn killed_at(point: &str, pod: &str) -> Option<(Scene, String, Vec<i32>)> {
    let fault = format!("{point}=kill");
    let mut s = scene(&[("GPU_CHECKPOINT_FAULT", &fault)])?;
    let pod = s.node.pod(pod);
    let (id, pids) = s.start_gpu(&pod, "gpu", &[]);
    Some((s, id, pids))
}

/// Creates and starts container `name` of `image` in `pod` running `script` with `env`; the
/// container's id, or the CRI's error with the id of the container it created.
fn run_on(
    node: &mut Node,
    pod: &Pod,
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

/// The kubelet's restore: a container `name` in `pod` created from the checkpoint archive `ck`, which must
/// start.
fn restored_on(
    node: &mut Node,
    pod: &Pod,
    name: &str,
    ck: &Path,
    script: &str,
    env: &[(&str, &str)],
) -> String {
    run_on(node, pod, name, &ck.display().to_string(), script, env)
        .unwrap_or_else(|(_, e)| panic!("restore: {e}"))
}

/// The container's 2 SIMULATED GPU processes, once they answer.
fn gpu_pids(node: &mut Node, id: &str) -> Vec<i32> {
    wait_gpu_processes(id, &mut || node.init_pid(id), 2)
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

/// Whether container `id`'s counter went past `n` (a client of its own: `wait_for` takes `Fn`).
fn node_counter_above(socket: &Path, id: &str, n: u64) -> bool {
    let mut cri = cri_client::Cri::connect(socket, Duration::from_secs(10)).unwrap();
    cri.exec(id, &["cat", "/tmp/c"])
        .ok()
        .and_then(|o| parse_counter(&o.stdout))
        .is_some_and(|v| v > n)
}

/// Every GPU process is `running` (not locked, not checkpointed), verified and computing, and the
/// shell's counter goes on.
fn untouched(node: &mut Node, id: &str, pids: &[i32]) {
    assert_eq!(node.state(id), RUNNING);
    assert_healthy(pids);
    let c = counter(node, id);
    wait_for("the counter to go on", &|| {
        node_counter_above(&node.socket, id, c)
    });
}

/// A restored container's counter starts between `before` and `after` (taken around the checkpoint)
/// and goes on.
fn counter_carried_on(node: &mut Node, id: &str, before: u64, after: u64) {
    let resumed = counter(node, id);
    assert!(
        resumed >= before && resumed < after + 50,
        "before {before}, at the checkpoint <= {after}, restored {resumed}"
    );
    wait_for("the restored counter to go on", &|| {
        node_counter_above(&node.socket, id, resumed)
    });
}

/// `runc state` of `id` under containerd's runc root: whether runc knows the container.
fn runc_knows(id: &str) -> bool {
    std::process::Command::new("runc")
        .args(["--root", RUNC_ROOT, "state", id])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The record gpu-checkpoint put into containerd's archive, which is containerd's own.
fn record_of(archive_path: &Path) -> serde_json::Value {
    let files = archive(archive_path);
    for f in ["config.dump", "spec.dump", "status.dump"] {
        assert!(files.contains_key(f), "{f}: {:?}", files.keys());
    }
    archived_gpu_record(archive_path)
}

#[test]
fn a_gpu_container_is_checkpointed_and_restored_through_containerds_cri_onto_the_gpu_it_is_given() {
    let Some(mut s) = scene(&[]) else { return };
    let pod = s.node.pod("gpu-pod");
    let (id, pids) = s.start_gpu(&pod, "gpu", &[]);
    let before = counter(&mut s.node, &id);

    // KEP-2008: the kubelet's checkpoint is the CRI's CheckpointContainer; the container runs on.
    let ck = s.checkpointed(&id);
    let after = counter(&mut s.node, &id);
    untouched(&mut s.node, &id, &pids);

    // containerd's own archive, with our record: the GPU state frozen by the freeze stage.
    let rec = record_of(&ck);
    assert_eq!(rec["schema"], "gpu-checkpoint/engine-checkpoint");
    assert_frozen_by_us(&rec);
    assert_eq!(rec["strategy"], "cuda-driver");
    assert_eq!(rec["leave_running"], true);
    assert_eq!(rec["given_gpus"], serde_json::json!([gpu(0)]));
    let g = &rec["gpu"];
    assert_eq!(g["backend"], "sim");
    assert!(
        g["driver_version"].as_str().unwrap().contains("SIMULATED"),
        "{g}"
    );
    assert_eq!(g["gpus"][0]["model"], sim::SIM_MODEL);
    assert!(g["gpus"][0]["memory_bytes"].as_u64().unwrap() > 0);
    let processes = g["processes"].as_array().unwrap();
    assert_eq!(processes.len(), 2, "{g}");
    for p in processes {
        let ops = strings(&p["steps"], "op");
        assert_eq!(ops, ["lock", "checkpoint"], "{p}");
        assert!(p["memory"][0]["bytes"].as_u64().unwrap() >= 8 << 20, "{p}");
    }
    assert_eq!(
        g["thaw"].as_array().unwrap().len(),
        2,
        "restored + unlocked after the dump"
    );

    // The pod goes; the kubelet's restore creates the container from the archive in a new pod, given
    // another GPU: the checkpoint's GPU 0 is mapped onto it.
    s.node.cri.remove(&id, Duration::ZERO).unwrap();
    s.node.cri.remove_pod(&pod.0).unwrap();
    wait_gone(&pids);
    let pod2 = s.node.pod("gpu-pod-restored");
    let gpu1 = gpu(1);
    let restored = restored_on(
        &mut s.node,
        &pod2,
        "gpu",
        &ck,
        GPU_SCRIPT,
        &[(GPU_ENV, &gpu1)],
    );
    assert_eq!(s.node.state(&restored), RUNNING);
    let now = gpu_pids(&mut s.node, &restored);
    assert_healthy(&now);
    for &p in &now {
        let st = sim::status(p).unwrap();
        assert_eq!(
            st["uuids"], gpu1,
            "pid {p} runs on the GPU the container was given"
        );
    }
    counter_carried_on(&mut s.node, &restored, before, after);
}

#[test]
fn a_gpu_container_the_freeze_cannot_take_is_refused_with_the_reason_and_keeps_running() {
    let Some(mut s) = scene(&[]) else { return };
    let pod = s.node.pod("blocked-pod");

    // An MPS client (detect's blocker): refused before anything is touched, with the reason.
    let (id, pids) = s.start_gpu(&pod, "mps", &[("CUDA_MPS_PIPE_DIRECTORY", "/tmp/mps")]);
    let e = s
        .checkpoint(&id, "refused.tar")
        .expect_err("an MPS client is refused");
    let msg = e.to_string();
    eprintln!("CheckpointContainer of an MPS client: {msg}");
    assert!(msg.contains("refusing to checkpoint container"), "{msg}");
    assert!(msg.contains("nothing was touched"), "{msg}");
    assert!(msg.contains("mps"), "the blocker is named: {msg}");
    assert!(!s.dir.path().join("refused.tar").exists(), "no archive");
    untouched(&mut s.node, &id, &pids);
    s.node.cri.remove(&id, Duration::ZERO).unwrap();
    wait_gone(&pids);

    // The freeze fails half-way (one process's GPU checkpoint): every process is put back (restored
    // and unlocked), the container runs on, and the engine says why.
    let (id, pids) = s.start_gpu(&pod, "fault", &[]);
    sim::inject_fault(pids[1], "checkpoint").unwrap();
    let e = s
        .checkpoint(&id, "failed.tar")
        .expect_err("the freeze fails");
    let msg = e.to_string();
    assert!(msg.contains("checkpoint of pid"), "{msg}");
    sim::inject_fault(pids[1], "none").unwrap();
    untouched(&mut s.node, &id, &pids);
    // And then it checkpoints.
    s.checkpointed(&id);
    untouched(&mut s.node, &id, &pids);
}

#[test]
fn a_restore_onto_gpus_that_cannot_hold_the_checkpoint_is_refused_before_anything_is_created() {
    let Some(mut s) = scene(&[]) else { return };
    let pod = s.node.pod("src");
    let (id, pids) = s.start_gpu(&pod, "gpu", &[]);
    let ck = s.checkpointed(&id);
    s.node.cri.remove(&id, Duration::ZERO).unwrap();
    wait_gone(&pids);
    let archive = ck.display().to_string();

    let refused = |node: &mut Node, env: &[(&str, &str)], why: &str| {
        let pod = node.pod(&format!("dst-{}", why.replace(' ', "-")));
        let (id, e) = run_on(node, &pod, "restored", &archive, GPU_SCRIPT, env)
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
    refused(&mut s.node, &[(GPU_ENV, &gpu(7))], "not on this node");
    refused(&mut s.node, &[], "given no GPU");

    // Another node, whose GPUs are smaller than the checkpoint's (4 MiB against 1 GiB).
    let mut b = Node::start(&s.dir.path().join("node-b"), &[(sim::ENV_GPU_MIB, "4")]);
    refused(&mut b, &[(GPU_ENV, &gpu(0))], "memory");
}

#[test]
fn a_cpu_only_container_goes_through_the_cri_without_a_gpu_step() {
    let Some(mut s) = scene(&[]) else { return };
    let pod = s.node.pod("cpu-pod");
    let id = run_on(&mut s.node, &pod, "cpu", &image().name, CPU_SCRIPT, &[])
        .unwrap_or_else(|(_, e)| panic!("{e}"));
    let before = counter(&mut s.node, &id);
    let ck = s.checkpointed(&id);
    let after = counter(&mut s.node, &id);
    let rec = record_of(&ck);
    assert_eq!(rec["strategy"], "none");
    assert!(rec["gpu"].is_null() && rec["frozen_by"].is_null(), "{rec}");
    s.node.cri.remove(&id, Duration::ZERO).unwrap();
    let pod2 = s.node.pod("cpu-restored");
    let restored = restored_on(&mut s.node, &pod2, "cpu", &ck, CPU_SCRIPT, &[]);
    counter_carried_on(&mut s.node, &restored, before, after);
}

/// The wrapper is SIGKILLed right after it froze the GPU state (containerd had paused the container
/// for its checkpoint): its guardian waits for containerd's own resume and puts the GPU state back, so
/// the container computes on, `ExecSync` works, and the CRI call fails.
#[test]
fn the_wrapper_killed_after_the_freeze_leaves_the_container_computing() {
    let Some((mut s, id, pids)) = killed_at("engine.after-freeze", "killed") else {
        return;
    };
    let e = s
        .checkpoint(&id, "checkpoint.tar")
        .expect_err("the wrapper was killed");
    eprintln!("CheckpointContainer with the wrapper killed: {e}");
    // The guardian works on after the wrapper died, and says what it did in the node's log.
    wait_for("the GPU processes to be unlocked", &|| {
        pids.iter()
            .all(|&p| sim::status(p).is_ok_and(|s| s["state"] == "running"))
    });
    s.guardian_said("put back the GPU state of 2");
    untouched(&mut s.node, &id, &pids);
}

/// The wrapper is SIGKILLed during a restore, once the GPU state is back and before it is unlocked: its
/// guardian deletes the half-restored container (a copy whose GPU state is locked must not run on), the
/// CRI call fails, and the archive restores on another node.
#[test]
fn the_wrapper_killed_during_a_restore_leaves_no_container_and_the_archive_restores() {
    let Some((mut s, id, pids)) = killed_at("engine.gpu-restored", "src") else {
        return;
    };
    let ck = s.checkpointed(&id);
    s.node.cri.remove(&id, Duration::ZERO).unwrap();
    wait_gone(&pids);
    let archive = ck.display().to_string();
    let gpu0 = gpu(0);
    let env = [(GPU_ENV, gpu0.as_str())];
    let pod = s.node.pod("dst");
    let (id, e) = run_on(&mut s.node, &pod, "restored", &archive, GPU_SCRIPT, &env)
        .expect_err("the wrapper was killed");
    eprintln!("StartContainer with the wrapper killed: {e}");
    s.guardian_said("deleted the half-restored container");
    assert!(!runc_knows(&id), "runc still knows {id}");
    assert_ne!(s.node.state(&id), RUNNING);
    assert!(s.node.pids(&id).is_empty(), "{id} has processes");

    let mut b = Node::start(&s.dir.path().join("node-b"), &[]);
    let pod = b.pod("dst");
    let restored = run_on(&mut b, &pod, "restored", &archive, GPU_SCRIPT, &env)
        .unwrap_or_else(|(_, e)| panic!("restore: {e}"));
    assert_healthy(&gpu_pids(&mut b, &restored));
}
