//! The real `cuda-driver` backend (dlopen of `libcuda.so.1`, `cuGetProcAddress`, the argument layouts,
//! `cuInit` before a restore) end to end, through the SIMULATED libcuda of `crates/cuda-sim` named by
//! `LD_LIBRARY_PATH`, for every layout the driver has had (CUDA 12.8, 13.0, 13.3, 13.4): the `cuda`
//! subcommands, a checkpoint and restore of a 4-process tree, a device map (13.0 on; refused by 12.8), a
//! lock timeout and every injected failure, each leaving every process running or the checkpoint
//! restorable. The simulated driver checks each argument struct's bytes at `cuda.h`'s offsets, so a layout
//! mistake on our side fails here as it would on a real driver.
//!
//! Needs root and CRIU for the checkpoints: fails in CI without them, skips locally with the reason.

mod sim_support;

use std::path::Path;
use std::process::{Command, Output};

use gpu_checkpoint::freeze::sim;
use sim_support::common::{list_ids, restore_args, run_checkpoint_env, wait_pid_free};
use sim_support::*;

/// The CUDA versions whose argument layouts differ.
const VERSIONS: [&str; 4] = ["12.8", "13.0", "13.3", "13.4"];

/// A private folder holding the simulator as `libcuda.so.1`, for `LD_LIBRARY_PATH`.
struct Driver {
    dir: tempfile::TempDir,
    version: &'static str,
}

impl Driver {
    fn new(version: &'static str) -> Driver {
        let built = built_beside(
            "libcuda.so",
            "cargo build --workspace builds crates/cuda-sim",
        );
        let dir = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(&built, dir.path().join("libcuda.so.1")).unwrap();
        Driver { dir, version }
    }

    /// The variables that make `gpu-checkpoint` load this driver.
    fn env(&self) -> [(&str, &str); 2] {
        [
            ("LD_LIBRARY_PATH", self.dir.path().to_str().unwrap()),
            ("GPU_CHECKPOINT_SIM_CUDA_VERSION", self.version),
        ]
    }

    /// `gpu-checkpoint ARGS` with this driver.
    fn run(&self, args: &[&str]) -> Output {
        Command::new(gpu_checkpoint())
            .args(args)
            .envs(self.env())
            .output()
            .unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "CUDA {}: {args:?}: {}",
            self.version,
            text(&o)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn checkpoint(&self, pid: i32, store: &Path, extra: &[&str]) -> Output {
        let backend = [
            "--gpu-backend",
            "cuda-driver",
            "--simulated-gpus",
            "--format",
            "json",
        ];
        run_checkpoint_env(pid, store, &[&backend[..], extra].concat(), &self.env())
    }

    fn restore(&self, id: &str, store: &Path, extra: &[&str]) -> Output {
        self.run(&restore_args(
            id,
            store,
            &[&["--gpu-backend", "cuda-driver"][..], extra].concat(),
        ))
    }
}

/// Runs `test` with the driver of every layout and an empty store (in a private folder); not at all
/// where CRIU cannot run (criu_ready says why).
fn with_every_layout(test: impl Fn(&Driver, &Path, &Path)) {
    if !criu_ready() {
        return;
    }
    for v in VERSIONS {
        let dir = tempfile::tempdir().unwrap();
        test(&Driver::new(v), &dir.path().join("store"), dir.path());
    }
}

#[test]
fn the_cuda_subcommands_drive_every_layout() {
    for v in VERSIONS {
        let d = Driver::new(v);
        let p = SimProcess::start(&["--mib", "4"]);
        let pid = p.pid.to_string();
        let state = || d.ok(&["cuda", "state", "--pid", &pid]).trim().to_string();
        assert_eq!(state(), "running", "CUDA {v}");
        d.ok(&["cuda", "lock", "--pid", &pid, "--timeout", "2000"]);
        assert_eq!(state(), "locked");
        d.ok(&["cuda", "checkpoint", "--pid", &pid]);
        assert_eq!(state(), "checkpointed");
        d.ok(&["cuda", "restore", "--pid", &pid]);
        d.ok(&["cuda", "unlock", "--pid", &pid]);
        assert_eq!(state(), "running");
        assert_healthy(&[p.pid]);
        // An illegal transition is the driver's ILLEGAL_STATE, and changes nothing.
        let o = d.run(&["cuda", "unlock", "--pid", &pid]);
        assert!(text(&o).contains("ILLEGAL_STATE"), "CUDA {v}: {}", text(&o));
        // The backend says which driver it met.
        let json = d.ok(&["cuda", "state", "--pid", &pid, "--format", "json"]);
        assert!(
            json.contains(&format!("SIMULATED CUDA {v}")),
            "CUDA {v}: {json}"
        );
        // detect says which driver would checkpoint the tree here, its layout and capabilities.
        let detect = d.ok(&["detect", "--pid", &pid, "--simulator"]);
        assert!(
            detect.contains(&format!("SIMULATED CUDA {v}"))
                && detect.contains(&format!("argument layout {v}")),
            "CUDA {v}: {detect}"
        );
        let doctor = d.ok(&["doctor"]);
        assert!(
            doctor.contains(&format!("argument layout {v}")),
            "CUDA {v}: {doctor}"
        );
        assert_eq!(
            doctor.contains("gpu-migration"),
            v != "12.8",
            "CUDA {v}: {doctor}"
        );
        assert!(!doctor.contains("custom-storage"), "CUDA {v}: {doctor}");
        // 13.4's custom storage is found at run time where the driver has it.
        let o = Command::new(gpu_checkpoint())
            .arg("doctor")
            .envs(d.env())
            .env("GPU_CHECKPOINT_SIM_CUSTOM_STORAGE", "1")
            .output()
            .unwrap();
        assert_eq!(
            text(&o).contains("custom-storage"),
            v == "13.4",
            "CUDA {v}: {}",
            text(&o)
        );
    }
}

#[test]
fn a_four_process_tree_checkpoints_and_restores_through_every_layout() {
    with_every_layout(|d, store, _| {
        let v = d.version;
        let tree = SimProcess::start(&["--mib", "8", "--children", "3"]);
        let pids = tree.all_pids();
        assert_eq!(pids.len(), 4);
        let o = d.checkpoint(tree.pid, store, &[]);
        assert!(o.status.success(), "CUDA {v}: {}", text(&o));
        let ck: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(ck["gpu"]["backend"], "cuda-driver", "CUDA {v}");
        assert!(
            ck["gpu"]["driver_version"]
                .as_str()
                .unwrap()
                .contains(&format!("SIMULATED CUDA {v}")),
            "CUDA {v}: {}",
            ck["gpu"]
        );
        assert_eq!(
            ck["gpu"]["processes"].as_array().unwrap().len(),
            4,
            "CUDA {v}"
        );
        wait_gone(&pids);
        let id = ck["id"].as_str().unwrap();

        // Onto other GPUs: 13.0 and later take a device map; 12.8's driver cannot (exit 5, before CRIU
        // restores anything), and the checkpoint stays for a restore onto the same GPUs. Without NVML
        // the record counts both GPUs as used, so the map swaps both.
        let o = d.restore(id, store, &["--device-map", "0=1,1=0"]);
        if v == "12.8" {
            assert_eq!(o.status.code(), Some(5), "CUDA {v}: {}", text(&o));
            assert!(text(&o).contains("13.0"), "CUDA {v}: {}", text(&o));
            assert!(pids
                .iter()
                .all(|&p| !std::path::Path::new(&format!("/proc/{p}")).exists()));
            let o = d.restore(id, store, &[]);
            assert!(o.status.success(), "CUDA {v}: {}", text(&o));
        } else {
            assert!(o.status.success(), "CUDA {v}: {}", text(&o));
            assert_eq!(status(tree.pid)["uuids"], sim::sim_gpu_uuid(1).to_string());
        }
        assert_healthy(&pids);
    });
}

#[test]
fn every_injected_failure_leaves_the_tree_running_or_the_checkpoint_restorable() {
    with_every_layout(|d, store, dir| {
        let v = d.version;
        // The fault file lives outside the processes, so it reaches the copies CRIU restores.
        let fault_file = dir.join("faults");
        std::fs::write(&fault_file, "").unwrap();
        let tree = SimProcess::start_env(
            &["--mib", "4", "--children", "3"],
            &[("GPU_SIM_FAULT_FILE", fault_file.to_str().unwrap())],
        );
        let pids = tree.all_pids();
        // A lock that times out (NOT_READY), then a failed device checkpoint: every process unlocked or
        // restored, running with its memory, nothing stored.
        for (victim, fault, extra) in [
            (
                tree.children[1],
                "lock-timeout",
                &["--lock-timeout", "300ms"][..],
            ),
            (tree.children[0], "checkpoint", &[][..]),
        ] {
            sim::inject_fault(victim, fault).unwrap();
            let o = d.checkpoint(tree.pid, store, extra);
            assert!(!o.status.success(), "CUDA {v} {fault}: {}", text(&o));
            sim::inject_fault(victim, "none").unwrap();
            assert_healthy(&pids);
            assert!(list_ids(store).is_empty(), "CUDA {v} {fault}");
        }
        // A GPU restore that runs out of device memory: the copy is killed, the checkpoint stays, and it
        // restores once the memory is there.
        let o = d.checkpoint(tree.pid, store, &[]);
        assert!(o.status.success(), "CUDA {v}: {}", text(&o));
        let ck: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let id = ck["id"].as_str().unwrap();
        wait_gone(&pids);
        std::fs::write(&fault_file, "restore-oom").unwrap();
        let o = d.restore(id, store, &[]);
        assert!(!o.status.success(), "CUDA {v}: {}", text(&o));
        assert!(
            text(&o).contains("CUDA_ERROR_OUT_OF_MEMORY"),
            "CUDA {v}: {}",
            text(&o)
        );
        wait_gone(&pids);
        assert_eq!(list_ids(store).len(), 1, "CUDA {v}");
        std::fs::write(&fault_file, "").unwrap();
        let o = d.restore(id, store, &[]);
        assert!(o.status.success(), "CUDA {v}: {}", text(&o));
        assert_healthy(&pids);
        for &p in &pids {
            // SAFETY: killing the processes this test restored.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        for &p in &pids {
            wait_pid_free(p);
        }
    });
}
