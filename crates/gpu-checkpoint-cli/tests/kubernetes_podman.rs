//! The engines' path with podman (4.3.1): the node set up as docs/kubernetes.md says (`gpu-checkpoint
//! node-setup --engine podman`, whose containers.conf drop-in makes gpu-checkpoint's wrapper podman's
//! runc), then podman's own `container checkpoint --export` and `container restore --import` of a
//! SIMULATED GPU container: the GPU state frozen by the freeze stage and recorded in podman's archive,
//! the container's counter going on after the restore. Needs root, CRIU, runc, podman and
//! busybox-static: fails in CI without them, skips locally.

mod container_support;

use container_support::podman::*;
use container_support::*;
use gpu_checkpoint::freeze::sim;

const GPU_SCRIPT: &str = "gpu-sim-workload --mib 8 --children 1 --workers 1 & \
     i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done";

/// The container's 2 SIMULATED GPU processes, once they answer.
fn gpu_pids(podman: &Podman, name: &str) -> Vec<i32> {
    let mut init = || {
        podman
            .ok(&["inspect", "--format", "{{.State.Pid}}", name])
            .parse()
            .unwrap_or(0)
    };
    wait_gpu_processes(name, &mut init, 2)
}

#[test]
fn podman_checkpoints_and_restores_a_gpu_container_through_the_wrapper() {
    let Some(dir) = podman_folder() else { return };
    let prefix = dir.path().join("node");
    node_setup("podman", &prefix);
    let conf = prefix.join("etc/containers/containers.conf.d/50-gpu-checkpoint.conf");
    let podman = Podman::with_conf(dir.path(), &conf);
    let image = "localhost/gpu-checkpoint-engine-test:1";
    podman.import_minimal_image(image);
    let name = cid("podman-gpu");
    let gpu0 = sim::sim_gpu_uuid(0).to_string();
    podman.run_detached(
        &name,
        image,
        &[("NVIDIA_VISIBLE_DEVICES", &gpu0)],
        GPU_SCRIPT,
    );
    let pids = gpu_pids(&podman, &name);
    // podman's runtime is the wrapper node-setup wrote.
    let runtime = podman.ok(&["inspect", "--format", "{{.OCIRuntime}}", &name]);
    assert_eq!(runtime, "gpu-checkpoint");

    // `--leave-running`: the container and its GPU work go on; the archive holds the frozen state.
    let running = dir.path().join("running.tar.zst");
    podman.export_checkpoint(&name, &running, &["--leave-running"]);
    assert_healthy(&pids);
    let rec = archived_gpu_record(&running);
    assert_frozen_by_us(&rec);
    assert_eq!(rec["leave_running"], true);
    assert_eq!(
        rec["gpu"]["processes"].as_array().unwrap().len(),
        2,
        "{rec}"
    );
    assert_eq!(rec["gpu"]["thaw"].as_array().unwrap().len(), 2, "{rec}");

    // podman's default checkpoint stops the container: its GPU state stays in the images.
    let before = podman.counter(&name);
    let stopped = dir.path().join("stopped.tar.zst");
    podman.export_checkpoint(&name, &stopped, &[]);
    wait_gone(&pids);
    let rec = archived_gpu_record(&stopped);
    assert_eq!(rec["leave_running"], false);
    assert!(rec["gpu"]["thaw"].is_null(), "{rec}");
    let steps = strings(&rec["gpu"]["processes"][0]["steps"], "op");
    assert_eq!(steps, ["lock", "checkpoint"]);
    podman.ok(&["rm", "--force", &name]);

    // podman's restore: the wrapper restores and unlocks the GPU state; the counter goes on.
    let restored = format!("{name}-restored");
    podman.import_checkpoint(&stopped, &["--name", &restored]);
    let now = gpu_pids(&podman, &restored);
    assert_healthy(&now);
    let resumed = podman.counter(&restored);
    assert!(resumed >= before, "before {before}, restored {resumed}");
    wait_for("the restored counter to go on", &|| {
        podman.counter(&restored) > resumed
    });
}
