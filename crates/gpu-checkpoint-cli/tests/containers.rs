//! Real runc containers checkpointed from the host (`checkpoint --container`, `restore --container`):
//! a CPU container (memory, threads, a TCP listener) and a SIMULATED multi-process GPU container
//! (`gpu-sim-workload`, its device memory checked after restore); `--leave-running`; a second checkpoint
//! deduplicated against the first; and a failure at every step (GPU lock, GPU checkpoint, runtime
//! checkpoint, store write, runtime restore, GPU restore) leaving the container running or the checkpoint
//! intact. Needs root, CRIU, runc and busybox-static: fails in CI without them, skips locally.

mod container_support;

use container_support::*;
use gpu_checkpoint::freeze::sim;
use std::time::{Duration, Instant};

const GPU_ARGS: &[&str] = &[
    "exec",
    "gpu-sim-workload",
    "--mib",
    "8",
    "--children",
    "2",
    "--workers",
    "2",
];

/// What the tests need around a GPU container (see [`Scene`]).
impl Scene {
    /// `gpu-checkpoint COMMAND... --container ID --gpu-backend sim --format json EXTRA...`, asserting
    /// success: its JSON.
    fn sim_json(&self, command: &[&str], id: &str, extra: &[&str]) -> serde_json::Value {
        let mut args = command.to_vec();
        args.extend([
            "--container",
            id,
            "--gpu-backend",
            "sim",
            "--format",
            "json",
        ]);
        args.extend_from_slice(extra);
        let o = self.gc(&args, &[]);
        assert!(o.status.success(), "{}: {}", command[0], text(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    }

    fn checkpoint(&self, id: &str, extra: &[&str]) -> serde_json::Value {
        self.sim_json(&["checkpoint"], id, extra)
    }

    fn restore(&self, ckpt: &str, id: &str) -> serde_json::Value {
        let out = self.sim_json(&["restore", ckpt], id, &[]);
        // Every runc restore here reads its images streamed from the store (docs/containers.md).
        assert_eq!(out["streamed"], true, "{out}");
        out
    }

    /// Waits until the container's processes all answer the simulator's control channel.
    fn gpu_pids(&self, id: &str, n: usize) -> Vec<i32> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let pids = self.runc.pids(id);
            if pids.len() >= n && pids.iter().all(|&p| sim::status(p).is_ok()) {
                return pids;
            }
            assert!(
                Instant::now() < deadline,
                "container {id}: {pids:?} not all up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs the bundle as container `name` (made unique) and waits for its 3 GPU processes.
    fn start_gpu(&self, name: &str) -> (String, Vec<i32>) {
        let id = self.run(name);
        let pids = self.gpu_pids(&id, 3);
        (id, pids)
    }

    fn running(&self, id: &str) -> bool {
        self.runc.state(id).is_some_and(|(s, _)| s == "running")
    }
}

#[test]
fn a_gpu_container_survives_checkpoint_stop_restore_and_is_runcs_afterwards() {
    let Some(s) = Scene::runc(GPU_ARGS, &[]) else {
        return;
    };
    // sh execs the workload: its init and its 2 children, each with SIMULATED device memory.
    let (id, pids) = s.start_gpu("gpu");
    let before: Vec<u64> = pids.iter().map(|&p| steps(p)).collect();
    let ck = s.checkpoint(&id, &[]);
    assert_eq!(ck["stopped"], true);
    // Our CRIU dumped it with runc's settings, the images streamed into the store.
    assert_eq!(ck["dump"], "direct");
    assert_eq!(ck["container"]["runtime"], "runc");
    assert_eq!(ck["container"]["id"].as_str(), Some(id.as_str()));
    assert_eq!(ck["processes"], 3);
    assert_eq!(ck["gpu"]["processes"].as_array().unwrap().len(), 3);
    assert_eq!(
        s.runc.state(&id),
        None,
        "the checkpointed container is deleted"
    );
    wait_gone(&pids);

    let new_id = cid("gpu-2");
    let r = s.restore(ck["id"].as_str().unwrap(), &new_id);
    assert_eq!(r["container"].as_str(), Some(new_id.as_str()));
    assert_eq!(r["gpu"]["processes"].as_array().unwrap().len(), 3);
    assert!(s.running(&new_id), "{:?}", s.runc.list());
    let now = s.gpu_pids(&new_id, 3);
    assert_eq!(now[0], r["pid"].as_i64().unwrap() as i32);
    assert_healthy(&now);
    // Each process went on from where it was checkpointed (its PID inside the container is the same).
    let after: Vec<u64> = now.iter().map(|&p| steps(p)).collect();
    assert!(
        after.iter().sum::<u64>() >= before.iter().sum::<u64>(),
        "{before:?} -> {after:?}"
    );
    // runc manages it: list shows it, kill stops it.
    assert!(s.runc.list().contains(&(new_id.clone(), "running".into())));
    let killed = s
        .runc
        .cmd()
        .args(["kill", &new_id, "KILL"])
        .status()
        .unwrap();
    assert!(killed.success());
    wait_gone(&now);
    assert!(!s.running(&new_id));
}

#[test]
fn leave_running_keeps_computing_and_its_checkpoint_restores_beside_the_original() {
    let Some(s) = Scene::runc(GPU_ARGS, &[]) else {
        return;
    };
    let (id, pids) = s.start_gpu("lr");
    let ck = s.checkpoint(&id, &["--leave-running"]);
    assert_eq!(ck["stopped"], false);
    assert!(s.running(&id));
    assert_eq!(s.runc.pids(&id), pids, "the same processes run on");
    assert_healthy(&pids);
    // It restores next to the running original, under another id.
    let copy = cid("lr-copy");
    s.restore(ck["id"].as_str().unwrap(), &copy);
    assert_healthy(&s.gpu_pids(&copy, 3));
    assert_healthy(&pids);
    // The fallback, runc's own checkpoint into a staging folder, restores as well.
    let ck = s.checkpoint(&id, &["--leave-running", "--runtime-checkpoint"]);
    assert_eq!(ck["dump"], "runtime");
    assert_eq!(s.runc.pids(&id), pids, "the same processes run on");
    let copy = cid("lr-copy2");
    s.restore(ck["id"].as_str().unwrap(), &copy);
    assert_healthy(&s.gpu_pids(&copy, 3));
    assert_healthy(&pids);
}

/// A store deep in the file system (as `/var/lib/...` paths get): the restore's work folder in it is
/// too long a path for a socket address, and the streamed runc restore still works. It failed before:
/// the CRIU stand-in's post-restore socket could not be bound there ("criu failed: type RESTORE").
#[test]
fn a_store_deep_in_the_file_system_restores_streamed() {
    let Some(mut s) = Scene::runc(GPU_ARGS, &[]) else {
        return;
    };
    s.store = s
        .dir
        .path()
        .join("a-folder-of-a-store-deep-in-the-file-system".repeat(2))
        .join("store");
    assert!(s.store.as_os_str().len() > 100, "{}", s.store.display());
    let (id, _) = s.start_gpu("deep");
    let ck = s.checkpoint(&id, &[]);
    // Streamed, as every runc restore here (`Scene::restore` checks it).
    s.restore(ck["id"].as_str().unwrap(), &id);
    assert_healthy(&s.gpu_pids(&id, 3));
}

#[test]
fn a_cpu_container_with_memory_threads_and_a_tcp_listener_restores() {
    let args = [
        "ip link set lo up &&",
        "workload memory --mib 32 --state /state/mem &",
        "exec workload sockets --state /state/sock --unix /tmp/u",
    ];
    let Some(s) = Scene::runc(&args, &[]) else {
        return;
    };
    let id = s.run("cpu");
    let sock = s.bundle.rootfs().join("state/sock");
    let mem = s.bundle.rootfs().join("state/mem");
    wait_for("the workloads", &|| {
        state_field(&mem, "verified").is_some_and(|v| v > 0) && state_field(&sock, "seq").is_some()
    });
    let port = state_field(&sock, "port").unwrap();
    let answer = s.runc.exec(&id, &["nc", "127.0.0.1", &port.to_string()]);
    assert!(answer.starts_with("seq="), "{answer}");
    // A first checkpoint leaves it running; the second, which stops it, stores little new: the 32 MiB
    // did not change.
    let first = s.checkpoint(&id, &["--leave-running"]);
    assert!(s.running(&id));
    let ck = s.checkpoint(&id, &[]);
    let seq_at = state_field(&sock, "seq").unwrap();
    assert_eq!(s.runc.state(&id), None);
    let (new1, new2) = (
        first["stats"]["new_bytes"].as_u64().unwrap(),
        ck["stats"]["new_bytes"].as_u64().unwrap(),
    );
    assert!(new1 > 32 << 20, "the first stored the memory: {new1}");
    assert!(
        new2 * 4 < new1,
        "second checkpoint wrote {new2} new bytes, the first {new1}"
    );

    s.restore(ck["id"].as_str().unwrap(), &id);
    assert!(s.running(&id));
    // runc dumps and restores the container's network namespace empty (`empty_ns`): its network is the
    // runtime's (a CNI plugin, a hook) to set up again, here its loopback.
    s.runc.exec(&id, &["ip", "link", "set", "lo", "up"]);
    wait_for("the restored workloads", &|| {
        state_field(&sock, "seq").is_some_and(|q| q > seq_at + 5)
    });
    let verified = state_field(&mem, "verified").unwrap();
    wait_for("the memory verified again", &|| {
        state_field(&mem, "verified").is_some_and(|v| v > verified)
    });
    assert_eq!(state_field(&mem, "bad"), Some(0), "memory intact");
    assert_eq!(state_field(&sock, "errors"), Some(0));
    // The listener came back with its port, inside the container's own network namespace.
    let answer = s.runc.exec(&id, &["nc", "127.0.0.1", &port.to_string()]);
    assert!(answer.starts_with("seq="), "{answer}");
}

/// A failed checkpoint: the container runs as before, healthy, and nothing is stored.
fn assert_untouched(s: &Scene, id: &str, pids: &[i32]) {
    assert!(s.running(id), "{:?}", s.runc.list());
    assert_eq!(&s.runc.pids(id), pids, "the same processes");
    assert_healthy(pids);
    assert!(listed(&s.store).is_empty(), "a failed checkpoint is listed");
}

#[test]
fn every_failed_checkpoint_step_leaves_the_container_running() {
    let Some(s) = Scene::runc(GPU_ARGS, &[]) else {
        return;
    };
    let (id, pids) = s.start_gpu("fail-ck");
    let ck = ["checkpoint", "--container", &id, "--gpu-backend", "sim"];
    // GPU lock (one process's lock times out), GPU checkpoint (one process's fails).
    for (pid, fault, extra, needle) in [
        (
            pids[2],
            "lock-timeout",
            &["--lock-timeout", "300ms"][..],
            "CUDA_ERROR_NOT_READY",
        ),
        (pids[1], "checkpoint", &[][..], "CUDA_ERROR_NOT_SUPPORTED"),
    ] {
        sim::inject_fault(pid, fault).unwrap();
        let mut args = ck.to_vec();
        args.extend(extra);
        let o = s.gc(&args, &[]);
        assert!(
            !o.status.success() && text(&o).contains(needle),
            "{fault}: {}",
            text(&o)
        );
        sim::inject_fault(pid, "none").unwrap();
        assert_untouched(&s, &id, &pids);
    }
    // The runtime's checkpoint, the store's write, and a SIGTERM after the dump.
    for (fault, needle) in [
        ("container.runtime-checkpoint=eio", "injected fault"),
        ("store.write=eio", "rror"),
        ("checkpoint.after-dump=term", "interrupted"),
    ] {
        let o = s.gc(&ck, &[("GPU_CHECKPOINT_FAULT", fault)]);
        assert!(!o.status.success(), "{fault}: {}", text(&o));
        assert!(text(&o).contains(needle), "{fault}: {}", text(&o));
        assert_untouched(&s, &id, &pids);
    }
    // SIGKILL of the tool while the container is paused and its GPU state checkpointed: the guardian
    // resumes the container and puts the GPU state back.
    for fault in ["checkpoint.after-freeze=kill", "checkpoint.after-dump=kill"] {
        let o = s.gc(&ck, &[("GPU_CHECKPOINT_FAULT", fault)]);
        assert!(!o.status.success(), "{fault}: {}", text(&o));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !(s.running(&id) && pids.iter().all(|&p| status(p)["state"] == "running")) {
            assert!(Instant::now() < deadline, "{fault}: {:?}", s.runc.list());
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_untouched(&s, &id, &pids);
    }
}

#[test]
fn a_failed_restore_keeps_the_checkpoint_and_the_bundle() {
    // The fault file lives in the rootfs, so the restored copy reads it too.
    let env = ["GPU_SIM_FAULT_FILE=/state/faults"];
    let Some(s) = Scene::runc(GPU_ARGS, &env) else {
        return;
    };
    let faults = s.bundle.rootfs().join("state/faults");
    std::fs::write(&faults, "").unwrap();
    let (id, pids) = s.start_gpu("fail-rs");
    let ck = s.checkpoint(&id, &[]);
    let ckpt = ck["id"].as_str().unwrap();
    wait_gone(&pids);
    let restore = ["restore", ckpt, "--container", &id, "--gpu-backend", "sim"];
    // The runtime's restore fails.
    let o = s.gc(
        &restore,
        &[("GPU_CHECKPOINT_FAULT", "container.runtime-restore=eio")],
    );
    assert!(
        !o.status.success() && text(&o).contains("injected fault"),
        "{}",
        text(&o)
    );
    assert_eq!(s.runc.state(&id), None);
    // The GPU restore fails: the restored container is killed and deleted, its rootfs kept.
    std::fs::write(&faults, "restore-oom").unwrap();
    let o = s.gc(&restore, &[]);
    assert!(
        !o.status.success() && text(&o).contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{}",
        text(&o)
    );
    assert_eq!(s.runc.state(&id), None, "{:?}", s.runc.list());
    assert!(
        s.bundle.rootfs().join("bin/busybox").is_file(),
        "the bundle's rootfs is intact"
    );
    assert_eq!(listed(&s.store).len(), 1, "the checkpoint is intact");
    // And it restores once the fault is gone.
    std::fs::write(&faults, "").unwrap();
    s.restore(ckpt, &id);
    assert_healthy(&s.gpu_pids(&id, 3));
    let _ = &s.dir;
}

/// What the direct dump takes over from runc beyond the default spec's mounts: a bind mount from the host
/// (an external mount keyed by its path in the container) and a network namespace the container joined
/// by path, as CNI-based engines set it up (external, `net[INODE]:extRootNetNS`). runc restores both.
#[test]
fn a_container_with_a_bind_mount_and_a_joined_network_namespace_restores_from_the_direct_dump() {
    let script = ["i=0; while true; do i=$((i+1)); echo $i > /data/n; sleep 0.1; done"];
    let Some(s) = Scene::runc(&script, &[]) else {
        return;
    };
    let Some(ns) = NetNs::add(&cid("ns")) else {
        return;
    };
    let ns_path = ns.path();
    let data = s.dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    s.bundle.join_netns(&ns);
    let config_path = s.bundle.dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    config["mounts"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
            "destination": "/data", "type": "bind", "source": data, "options": ["rbind", "rw"]
        }));
    std::fs::write(&config_path, serde_json::to_vec(&config).unwrap()).unwrap();
    let id = s.run("mounts");
    let count = || -> u64 {
        std::fs::read_to_string(data.join("n"))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    };
    wait_for("the counter", &|| count() >= 5);
    let ck = s.checkpoint(&id, &[]);
    assert_eq!(ck["dump"], "direct");
    assert_eq!(s.runc.state(&id), None);
    let at = count();

    s.restore(ck["id"].as_str().unwrap(), &id);
    assert!(s.running(&id), "{:?}", s.runc.list());
    // The shell's counter goes on from its memory, through the bind mount.
    wait_for("the counter after restore", &|| count() > at + 5);
    let (_, init) = s.runc.state(&id).unwrap();
    let ino = |p: &str| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
    assert_eq!(
        ino(&format!("/proc/{init}/ns/net")),
        ino(&ns_path),
        "restored into the namespace it joined"
    );
}

/// The tool SIGKILLed while our CRIU streams the container's images into the store: the pipes break,
/// CRIU fails and lets the (paused) container go as it was, and the guardian resumes it; nothing is
/// stored.
#[test]
fn the_tool_killed_during_the_direct_dump_leaves_the_container_running() {
    let Some(s) = Scene::memory("256") else {
        return;
    };
    let id = s.run("kill-dump");
    let mem = s.bundle.rootfs().join("state/mem");
    let verified = || state_field(&mem, "verified").unwrap_or(0);
    wait_for("the memory workload", &|| verified() > 0);
    let pids = s.runc.pids(&id);
    let mut tool = std::process::Command::new(gpu_checkpoint())
        .args(["checkpoint", "--container", &id])
        .args(store_args(&s.store, &s.runc))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let tool_pid = tool.id() as i32;
    // CRIU runs as the tool's child (`criu dump --stream`, through the project's wrapper script) while
    // the images stream.
    let criu_child = || {
        has_child(tool_pid, &|argv| {
            argv.contains("criu") && argv.contains("dump") && argv.contains("--stream")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !criu_child() {
        assert!(Instant::now() < deadline, "CRIU never ran");
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(30));
    tool.kill().unwrap();
    let st = tool.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&st),
        Some(9),
        "killed, not finished"
    );
    wait_for("the container resumed", &|| s.running(&id));
    assert_eq!(s.runc.pids(&id), pids, "the same processes");
    let at = verified();
    wait_for("the memory verified again", &|| verified() > at);
    assert_eq!(state_field(&mem, "bad"), Some(0), "memory intact");
    assert!(listed(&s.store).is_empty(), "nothing stored");
}

/// Every file name that shows up under `dir` (two levels: the store's `container-work/ID.../NAME`) until
/// `stop` is set, polled every millisecond.
fn watch_names(
    dir: std::path::PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<std::collections::BTreeSet<String>> {
    std::thread::spawn(move || {
        let mut seen = std::collections::BTreeSet::new();
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            for work in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                for f in std::fs::read_dir(work.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    seen.insert(f.file_name().to_string_lossy().into_owned());
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        seen
    })
}

/// runc's restore reads CRIU's images streamed from the store (through our `criu swrk` stand-in): no
/// image is written into the work folder, the restore says so, and the container's memory is back. A
/// damaged chunk first: the restore fails with the store's error (exit 7, naming the chunk), and leaves
/// no container, no mount, an intact rootfs and the checkpoint.
#[test]
fn a_runc_restore_streams_the_images_from_the_store_and_a_damaged_chunk_fails_it_cleanly() {
    let Some(s) = Scene::memory("16") else { return };
    let id = s.run("stream");
    let mem = s.bundle.rootfs().join("state/mem");
    let field = |key: &str| state_field(&mem, key);
    wait_for("the workload", &|| field("verified").is_some_and(|v| v > 0));
    let ck = s.checkpoint(&id, &[]);
    let ckpt = ck["id"].as_str().unwrap();
    assert_eq!(s.runc.state(&id), None);

    // A damaged chunk of the page image.
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ck["manifest"].as_str().unwrap()).unwrap()).unwrap();
    let files = manifest["files"].as_array().unwrap();
    let pages = files
        .iter()
        .find(|f| f["path"].as_str().unwrap().starts_with("pages-"))
        .expect("a page image");
    let hash = pages["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|c| c["h"].as_str())
        .expect("a stored chunk")
        .to_string();
    let chunk = s.store.join("chunks").join(&hash[..2]).join(&hash);
    let original = std::fs::read(&chunk).unwrap();
    let mut damaged = original.clone();
    let mid = damaged.len() / 2;
    damaged[mid] ^= 1;
    std::fs::write(&chunk, &damaged).unwrap();
    let restore = ["restore", ckpt, "--container", &id, "--format", "json"];
    let o = s.gc(&restore, &[]);
    assert_eq!(o.status.code(), Some(7), "{}", text(&o));
    let err = text(&o);
    assert!(err.contains(&hash[..16]), "names the chunk: {err}");
    assert_eq!(s.runc.state(&id), None, "{:?}", s.runc.list());
    assert!(s.runc.list().is_empty(), "{:?}", s.runc.list());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(&id), "a mount of the container is left");
    assert!(
        s.bundle.rootfs().join("bin/busybox").is_file(),
        "rootfs intact"
    );
    assert_eq!(listed(&s.store).len(), 1, "the checkpoint is intact");
    std::fs::write(&chunk, &original).unwrap();

    // Repaired: restored streamed, no image file in the work folder at any time.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = watch_names(s.store.join("container-work"), stop.clone());
    let o = s.gc(&restore, &[]);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = watcher.join().unwrap();
    assert!(o.status.success(), "restore: {}", text(&o));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(out["streamed"], true, "{out}");
    assert!(
        seen.contains("descriptors.json"),
        "the watcher saw the work folder: {seen:?}"
    );
    let images: Vec<&String> = seen.iter().filter(|n| n.ends_with(".img")).collect();
    assert!(
        images.is_empty(),
        "images written during the restore: {images:?}"
    );
    assert!(s.running(&id));
    let verified = field("verified").unwrap();
    wait_for("the memory verified again", &|| {
        field("verified").is_some_and(|v| v > verified)
    });
    assert_eq!(field("bad"), Some(0), "memory intact");
}
