//! The checkpoint and restore flows with GPU state, on trees of SIMULATED GPU processes, with real CRIU:
//! device memory survives checkpoint -> stop -> restore and the computation continues; `--leave-running`;
//! device maps and the GPU check of the restore node; and every injected fault leaves every process
//! running and correct, and the store without a checkpoint. Needs root and CRIU: fails in CI without
//! them, skips locally with the reason.

mod sim_support;

use gpu_checkpoint::freeze::{sim, GpuRecord};
use sim_support::*;
use std::path::Path;
use std::process::Command;

/// The simulated GPUs are the node's: every live simulated process of every test holds memory on them. The
/// test of the restore's free-memory check needs exact figures, so it runs alone (write), the others
/// together (read).
static GPUS: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// A test's temporary folder, and its hold on the simulated GPUs.
struct Scratch {
    dir: tempfile::TempDir,
    _gpus: Box<dyn std::any::Any>,
}

impl Scratch {
    fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// A temporary folder and a store path in it, when CRIU flows can run here.
fn setup() -> Option<(Scratch, std::path::PathBuf)> {
    scratch(Box::new(GPUS.read().unwrap_or_else(|p| p.into_inner())))
}

/// [`setup`] for a test that must have the simulated GPUs to itself.
fn setup_alone() -> Option<(Scratch, std::path::PathBuf)> {
    scratch(Box::new(GPUS.write().unwrap_or_else(|p| p.into_inner())))
}

fn scratch(gpus: Box<dyn std::any::Any>) -> Option<(Scratch, std::path::PathBuf)> {
    if !criu_ready() {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    Some((Scratch { dir, _gpus: gpus }, store))
}

fn checkpoint(pid: i32, store: &Path, extra: &[&str]) -> serde_json::Value {
    let args = checkpoint_args(pid, store, extra);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["--format", "json"]);
    json_ok(&args)
}

fn checkpoint_fails(pid: i32, store: &Path, extra: &[&str], needle: &str) -> String {
    let args = checkpoint_args(pid, store, extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(&args);
    let t = text(&o);
    assert!(!o.status.success(), "checkpoint should fail: {t}");
    assert!(t.contains(needle), "expected `{needle}` in: {t}");
    t
}

/// `restore ID --storage STORE --gpu-backend sim EXTRA...`.
fn restore_args<'a>(id: &'a str, store: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    common::restore_args(id, store, &[&["--gpu-backend", "sim"][..], extra].concat())
}

fn restore(id: &str, store: &Path, extra: &[&str]) -> i32 {
    let o = run(&restore_args(id, store, extra));
    assert!(o.status.success(), "restore: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
}

/// The failure left no checkpoint: nothing listed, no manifest file.
fn assert_no_checkpoint(store: &Path) {
    assert!(listed(store).is_empty(), "a failed checkpoint is listed");
    let manifests = store.join("manifests");
    let n = std::fs::read_dir(&manifests)
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(n, 0, "manifest files left in {}", manifests.display());
}

#[test]
fn a_tree_survives_checkpoint_stop_restore_with_device_memory() {
    let Some((_dir, store)) = setup() else { return };
    // Three simulated GPU processes, one that only loaded the library (no context), one without GPU.
    let tree = SimProcess::start(&[
        "--mib",
        "16",
        "--children",
        "2",
        "--idle-children",
        "1",
        "--cpu-children",
        "1",
    ]);
    let gpu_pids: Vec<i32> = tree.all_pids()[..3].to_vec();
    let idle = tree.all_pids()[3];
    let before: Vec<u64> = gpu_pids.iter().map(|&p| steps(p)).collect();

    let ck = checkpoint(tree.pid, &store, &[]);
    assert_eq!(ck["stopped"], true);
    assert_eq!(ck["processes"], 5);
    let rec: GpuRecord = serde_json::from_value(ck["gpu"].clone()).unwrap();
    assert_eq!(
        rec.pids(),
        gpu_pids,
        "the three simulated GPU processes, not the CPU child"
    );
    // The one without a context is left alone, and reported.
    assert_eq!(rec.skipped.len(), 1, "{:?}", rec.skipped);
    assert_eq!(rec.skipped[0].pid, idle);
    assert!(
        rec.skipped[0].reason.contains("NOT_INITIALIZED"),
        "{:?}",
        rec.skipped
    );
    assert!(rec.driver_version.as_deref().unwrap().contains("SIMULATED"));
    assert!(!rec.gpus.is_empty() && rec.gpus[0].model.contains("SIMULATED"));
    for p in &rec.processes {
        let ops: Vec<_> = p.steps.iter().map(|s| s.op).collect();
        assert_eq!(ops.len(), 2, "lock and checkpoint recorded for {}", p.pid);
        assert!(p.steps.iter().all(|s| s.ok && s.ms >= 0.0));
        assert_eq!(p.gpus, vec![sim::sim_gpu_uuid(0)]);
    }
    wait_gone(&tree.all_pids());
    for &p in &gpu_pids {
        assert!(!sim::device_file(p, 0).exists(), "no device left for {p}");
    }

    let id = ck["id"].as_str().unwrap();
    let o = run(&restore_args(id, &store, &["--format", "json"]));
    assert!(o.status.success(), "restore: {}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["pid"], tree.pid);
    assert_eq!(r["gpu"]["processes"].as_array().unwrap().len(), 3);
    assert_healthy(&gpu_pids);
    assert_eq!(
        status(idle)["state"],
        "running",
        "the idle process came back too"
    );
    for (i, &p) in gpu_pids.iter().enumerate() {
        assert!(
            steps(p) >= before[i],
            "pid {p} continued from its checkpoint (steps {} < {})",
            steps(p),
            before[i]
        );
    }
}

/// The GPU restore does not wait for the memory: the processes resume as soon as CRIU has restored them,
/// and the driver's restore (here the simulator's: it copies the device memory it staged in the process's
/// memory back to the device) runs while the rest comes in, its page faults served first. With the
/// background fill slowed down, the GPU step is done long before the last page is in, and the device
/// memory is right.
#[test]
fn the_gpu_restore_overlaps_the_memory_coming_in() {
    let Some((_dir, store)) = setup() else { return };
    let tree = SimProcess::start(&["--mib", "256"]);
    let ck = checkpoint(tree.pid, &store, &[]);
    wait_gone(&[tree.pid]);
    let id = ck["id"].as_str().unwrap();
    let o = Command::new(gpu_checkpoint())
        .args(restore_args(id, &store, &["--format", "json"]))
        .env("GPU_CHECKPOINT_FAULT", "restore.memory=sleep:40")
        .output()
        .unwrap();
    assert!(o.status.success(), "restore: {}", text(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let t = &r["timings_ms"];
    let (gpu_done, memory_in) = (
        t["gpu_done"].as_f64().unwrap(),
        t["memory_in"].as_f64().unwrap(),
    );
    assert!(
        gpu_done + 300.0 < memory_in,
        "the GPU restore waited for the memory: {t}"
    );
    // Its staged device memory came through faults, ahead of the background fill.
    assert!(t["uffd"]["faults_served"].as_u64().unwrap() > 16, "{t}");
    assert_healthy(&[tree.pid]);
}

#[test]
fn leave_running_keeps_the_tree_computing_and_the_checkpoint_restores() {
    let Some((_dir, store)) = setup() else { return };
    let tree = SimProcess::start(&["--mib", "8", "--children", "1"]);
    let ck = checkpoint(tree.pid, &store, &["--leave-running"]);
    assert_eq!(ck["stopped"], false);
    // The manifest has the GPU restore + unlock that followed the dump, per process.
    let rec: GpuRecord = serde_json::from_value(ck["gpu"].clone()).unwrap();
    let thaw = rec.thaw.expect("thaw record");
    assert_eq!(thaw.len(), 2);
    for p in &thaw {
        let ops: Vec<&str> = p.steps.iter().map(|s| s.op.key()).collect();
        assert_eq!(ops, ["restore", "unlock"], "pid {}", p.pid);
    }
    assert_healthy(&tree.all_pids());
    let at_checkpoint = steps(tree.pid);

    // Stop the original, then bring the checkpoint back.
    for p in tree.all_pids() {
        // SAFETY: killing the processes this test started.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    wait_gone(&tree.all_pids());
    let pid = restore(ck["id"].as_str().unwrap(), &store, &[]);
    assert_eq!(pid, tree.pid);
    assert_healthy(&tree.all_pids());
    assert!(steps(tree.pid) > 0 && at_checkpoint > 0);
}

#[test]
fn a_lock_timeout_leaves_every_process_running_and_no_checkpoint() {
    let Some((_dir, store)) = setup() else { return };
    let tree = SimProcess::start(&["--mib", "4", "--children", "2"]);
    sim::inject_fault(tree.children[1], "lock-timeout").unwrap();
    let t = checkpoint_fails(
        tree.pid,
        &store,
        &["--lock-timeout", "300ms"],
        "CUDA_ERROR_NOT_READY",
    );
    assert!(t.contains(&tree.children[1].to_string()), "{t}");
    assert_healthy(&tree.all_pids());
    assert_no_checkpoint(&store);
}

#[test]
fn a_gpu_checkpoint_failure_restores_the_others() {
    let Some((_dir, store)) = setup() else { return };
    let tree = SimProcess::start(&["--mib", "4", "--children", "2"]);
    sim::inject_fault(tree.children[0], "checkpoint").unwrap();
    checkpoint_fails(tree.pid, &store, &[], "CUDA_ERROR_NOT_SUPPORTED");
    assert_healthy(&tree.all_pids());
    assert_no_checkpoint(&store);
}

/// A store on a tmpfs too small for the images: CRIU's dump fails (ENOSPC), after the GPU state was
/// checkpointed. The GPU state must come back.
#[test]
fn a_failed_dump_puts_the_gpu_state_back() {
    let Some((dir, _)) = setup() else { return };
    let mnt = dir.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(mounted.success(), "mount a small tmpfs");
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&mnt);
    let store = mnt.join("store");
    let tree = SimProcess::start(&["--mib", "16", "--children", "1"]);
    checkpoint_fails(tree.pid, &store, &[], "error");
    assert_healthy(&tree.all_pids());
    for p in tree.all_pids() {
        assert!(
            sim::device_file(p, 0).exists(),
            "pid {p} got its device back"
        );
    }
    assert_no_checkpoint(&store);
}

#[test]
fn a_failed_gpu_restore_stops_the_copy_and_keeps_the_checkpoint() {
    let Some((dir, store)) = setup() else { return };
    // The fault file lives outside the process, so it reaches the copy CRIU restores.
    let fault_file = dir.path().join("faults");
    std::fs::write(&fault_file, "").unwrap();
    let tree = SimProcess::start_env(
        &["--mib", "8", "--children", "1"],
        &[("GPU_SIM_FAULT_FILE", fault_file.to_str().unwrap())],
    );
    let ck = checkpoint(tree.pid, &store, &[]);
    let id = ck["id"].as_str().unwrap().to_string();
    wait_gone(&tree.all_pids());

    std::fs::write(&fault_file, "restore-oom").unwrap();
    let o = run(&restore_args(&id, &store, &[]));
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{t}");
    // The half-restored copy was stopped; the checkpoint is still there.
    wait_gone(&tree.all_pids());
    assert_eq!(listed(&store).len(), 1);

    std::fs::write(&fault_file, "").unwrap();
    let pid = restore(&id, &store, &[]);
    assert_eq!(pid, tree.pid);
    assert_healthy(&tree.all_pids());
}

#[test]
fn restore_checks_the_gpus_and_follows_a_device_map() {
    let Some((_dir, store)) = setup() else { return };
    let tree = SimProcess::start(&["--mib", "4"]);
    let ck = checkpoint(tree.pid, &store, &[]);
    let id = ck["id"].as_str().unwrap();
    wait_gone(&[tree.pid]);

    // A node with one simulated GPU where the checkpoint's had two: refused before anything starts.
    let o = Command::new(gpu_checkpoint())
        .args(restore_args(id, &store, &[]))
        .env(sim::ENV_GPUS, "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(8), "{}", text(&o));
    assert!(text(&o).contains("--device-map"), "{}", text(&o));
    assert!(!Path::new(&format!("/proc/{}", tree.pid)).exists());

    // The simulator never restores real GPU state, nor real backends simulated state.
    let o = run(&[
        "restore",
        id,
        "--storage",
        store.to_str().unwrap(),
        "--gpu-backend",
        "cuda-driver",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));

    // Onto the other simulated GPU.
    let pid = restore(id, &store, &["--device-map", "0=1"]);
    assert_eq!(pid, tree.pid);
    assert_eq!(status(pid)["uuids"], sim::sim_gpu_uuid(1).to_string());
    assert_healthy(&[pid]);
}

/// Ctrl-C in the middle of a checkpoint (SIGINT to the command's process group, CRIU included): either
/// the checkpoint completed (listed, tree stopped) or it was undone (nothing listed, every process
/// running with its device memory). Never processes left without their GPU state.
#[test]
fn an_interrupt_never_strands_gpu_state() {
    use std::os::unix::process::CommandExt;
    let Some((_dir, store)) = setup() else { return };
    for delay_ms in [150u64, 400] {
        let tree = SimProcess::start(&["--mib", "64", "--children", "1"]);
        let args = checkpoint_args(tree.pid, &store, &[]);
        let mut child = Command::new(gpu_checkpoint())
            .args(&args)
            .process_group(0)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        // SAFETY: signalling the process group of the command this test started.
        unsafe { libc::kill(-(child.id() as i32), libc::SIGINT) };
        let _ = child.wait();
        let listed_now = listed(&store);
        eprintln!(
            "interrupt after {delay_ms} ms: {}",
            if listed_now.is_empty() {
                "undone"
            } else {
                "completed"
            }
        );
        if listed_now.is_empty() {
            assert_healthy(&tree.all_pids());
        } else {
            wait_gone(&tree.all_pids());
            let id = listed_now[0]["id"].as_str().unwrap().to_string();
            let pid = restore(&id, &store, &[]);
            assert_healthy(&tree.all_pids());
            assert_eq!(pid, tree.pid);
            let o = run(&["delete", &id, "--storage", store.to_str().unwrap()]);
            assert!(o.status.success(), "{}", text(&o));
        }
    }
}

/// `--strategy`: `bar-sliding` and strategies detect says cannot work are refused before anything is
/// touched (exit 9, with the reason), a contradicting `--gpu-backend` is a usage error, and a strategy
/// that can work is used; `detect` lists every strategy it weighed.
#[test]
fn strategies_are_forced_or_refused_with_a_reason() {
    let Some((_dir, store)) = setup() else { return };
    let tree = SimProcess::start(&["--mib", "4"]);
    let o = run(&[
        "detect",
        "--pid",
        &tree.pid.to_string(),
        "--simulator",
        "--format",
        "json",
    ]);
    let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let weighed: Vec<(&str, bool)> = report["strategies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["strategy"].as_str().unwrap(),
                c["chosen"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        weighed,
        [
            ("none", false),
            ("cuda-driver", true),
            ("cuda-cli", false),
            ("amdgpu", false),
            ("bar-sliding", false)
        ]
    );
    for (strategy, code, needle) in [
        ("bar-sliding", 9, "cannot restore"),
        ("none", 9, "holds GPU state"),
        ("cuda-cli", 2, "contradicts"),
    ] {
        let args = checkpoint_args(tree.pid, &store, &["--strategy", strategy]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run(&args);
        assert_eq!(o.status.code(), Some(code), "{strategy}: {}", text(&o));
        assert!(text(&o).contains(needle), "{strategy}: {}", text(&o));
        assert_healthy(&[tree.pid]);
        assert!(listed(&store).is_empty());
    }
    let ck = checkpoint(tree.pid, &store, &["--strategy", "cuda-driver"]);
    assert_eq!(ck["strategy"], "cuda-driver");
    wait_gone(&[tree.pid]);
}

/// The restore's preflight against the known stuck-process failure (a GPU restore out of device memory
/// leaves the process stuck for good): with 64 MiB simulated GPUs, a checkpoint that held 48 MiB on GPU 0
/// is refused (exit 8, with the numbers) while another process holds 32 MiB there, before anything is
/// restored; onto the free GPU 1 it restores.
#[test]
fn a_restore_that_would_run_a_gpu_out_of_memory_is_refused_before_anything_is_restored() {
    let Some((_dir, store)) = setup_alone() else {
        return;
    };
    let tree = SimProcess::start(&["--mib", "48"]);
    let args = checkpoint_args(tree.pid, &store, &["--format", "json"]);
    let o = Command::new(gpu_checkpoint())
        .args(&args)
        .env(sim::ENV_GPU_MIB, "64")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let ck: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        ck["gpu"]["processes"][0]["memory"][0]["bytes"],
        48u64 << 20,
        "{}",
        ck["gpu"]
    );
    let id = ck["id"].as_str().unwrap();
    wait_gone(&[tree.pid]);
    let _other = SimProcess::start(&["--mib", "32"]);
    let restore_on_64_mib = |extra: &[&str]| {
        Command::new(gpu_checkpoint())
            .args(restore_args(id, &store, extra))
            .env(sim::ENV_GPU_MIB, "64")
            .output()
            .unwrap()
    };
    let o = restore_on_64_mib(&[]);
    assert_eq!(o.status.code(), Some(8), "{}", text(&o));
    assert!(
        text(&o).contains("32.0 MiB free") && text(&o).contains("need 48.0 MiB"),
        "{}",
        text(&o)
    );
    assert!(
        !Path::new(&format!("/proc/{}", tree.pid)).exists(),
        "nothing restored"
    );
    let o = restore_on_64_mib(&["--device-map", "0=1"]);
    assert!(o.status.success(), "{}", text(&o));
    assert_healthy(&[tree.pid]);
}
