//! Detection on /proc trees pinned under `tests/fixtures/`.
//!
//! `fixtures/proc/*` are hand-written from documented layouts (each folder's README says which);
//! `fixtures/real/*` are captures of real processes (`scripts/capture-proc.sh`). Adding a capture is one
//! folder plus one line in [`REAL`]; every folder under `real/` is also checked by
//! [`every_real_capture_is_detected`] without any line at all.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpu_checkpoint::detect::{
    detect_all_with, detect_pid, detect_pid_with, nvml::ComputeProcess, nvml::StaticInventory,
    DetectOptions, Error, Report,
};
use gpu_checkpoint::{Classify, ExitStatus};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn opts(dir: &str, tree: bool, simulator: bool) -> DetectOptions {
    DetectOptions {
        proc_root: fixtures().join(dir),
        tree,
        nvml: false,
        simulator,
    }
}

/// One expectation on one fixture.
struct Case {
    dir: &'static str,
    pid: i32,
    tree: bool,
    simulator: bool,
    strategy: &'static str,
    /// Exactly the finding kinds expected (JSON names).
    kinds: &'static [&'static str],
    /// Exactly the blocker kinds expected (JSON names).
    blockers: &'static [&'static str],
}

const CUDA: &[&str] = &[
    "nvidia-ctl",
    "nvidia-device",
    "nvidia-uvm",
    "device-mapping",
    "cuda-library",
    "gpu-env",
];

macro_rules! kinds {
    ($($k:literal),*) => { &[$($k),*] };
    (CUDA + $($k:literal),*) => { &["nvidia-ctl", "nvidia-device", "nvidia-uvm", "device-mapping", "cuda-library", "gpu-env", $($k),*] };
}

#[rustfmt::skip]
const CASES: &[Case] = &[
    Case { dir: "proc/cuda-malloc", pid: 4242, tree: false, simulator: false, strategy: "cuda-driver", kinds: CUDA, blockers: &[] },
    Case { dir: "proc/cuda-malloc-r555", pid: 4242, tree: false, simulator: false, strategy: "cuda-cli", kinds: CUDA, blockers: &[] },
    Case { dir: "proc/cuda-malloc-r535", pid: 4242, tree: false, simulator: false, strategy: "unsupported", kinds: CUDA, blockers: &["driver-too-old"] },
    Case { dir: "proc/cuda-malloc-managed", pid: 5000, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "managed-memory"), blockers: &["managed-memory"] },
    Case { dir: "proc/cuda-malloc-host", pid: 5100, tree: false, simulator: false, strategy: "cuda-driver", kinds: CUDA, blockers: &[] },
    Case { dir: "proc/cuda-ipc-pair", pid: 6000, tree: true, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "cuda-ipc"), blockers: &["cuda-ipc"] },
    Case { dir: "proc/cuda-ipc-pair-r610", pid: 6000, tree: true, simulator: false, strategy: "cuda-driver", kinds: kinds!(CUDA + "cuda-ipc"), blockers: &[] },
    Case { dir: "proc/cuda-ipc-pair-r610", pid: 6001, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "cuda-ipc"), blockers: &["cuda-ipc"] },
    Case { dir: "proc/pytorch-nccl", pid: 7000, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "nccl", "nvml", "cuda-ipc"), blockers: &["cuda-ipc"] },
    Case { dir: "proc/cuda-rdma", pid: 7100, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "rdma"), blockers: &["rdma"] },
    // NVML only, no mapping: no CUDA context, nothing for the GPU step; the descriptors are reopened.
    Case { dir: "proc/nvidia-smi", pid: 7200, tree: false, simulator: false, strategy: "none", kinds: kinds!("nvidia-ctl", "nvidia-device", "nvml"), blockers: &[] },
    // Derived from real/torch-470: a child forked without exec keeps descriptors and /dev/nvidia0 windows.
    Case { dir: "proc/cuda-fork-child", pid: 530, tree: false, simulator: false, strategy: "none", kinds: kinds!("nvidia-ctl", "nvidia-device", "nvidia-uvm", "device-mapping", "cuda-library", "nvml", "nccl", "gpu-env"), blockers: &[] },
    Case { dir: "proc/cuda-fork-child", pid: 470, tree: true, simulator: false, strategy: "cuda-driver", kinds: kinds!("nvidia-ctl", "nvidia-device", "nvidia-uvm", "device-mapping", "cuda-library", "nvml", "nccl", "gpu-env"), blockers: &[] },
    Case { dir: "proc/cuda-mig", pid: 7300, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "mig"), blockers: &["mig"] },
    Case { dir: "proc/cuda-mps-client", pid: 7400, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "mps"), blockers: &["mps"] },
    Case { dir: "proc/pci-bar", pid: 7500, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "pci-bar"), blockers: &["pci-bar"] },
    Case { dir: "proc/amd-rocm", pid: 7600, tree: false, simulator: false, strategy: "amdgpu", kinds: kinds!("amd-gpu", "gpu-env"), blockers: &[] },
    Case { dir: "proc/render-node-only", pid: 7700, tree: false, simulator: false, strategy: "none", kinds: &[], blockers: &[] },
    Case { dir: "proc/cuda-idle", pid: 7800, tree: false, simulator: false, strategy: "none", kinds: kinds!("cuda-library", "gpu-env"), blockers: &[] },
    Case { dir: "proc/no-gpu", pid: 7900, tree: false, simulator: false, strategy: "none", kinds: &[], blockers: &[] },
    Case { dir: "proc/tree", pid: 8000, tree: true, simulator: false, strategy: "unsupported", kinds: kinds!(CUDA + "managed-memory"), blockers: &["managed-memory"] },
    Case { dir: "proc/tree", pid: 8001, tree: true, simulator: false, strategy: "cuda-driver", kinds: CUDA, blockers: &[] },
    Case { dir: "proc/tree", pid: 8000, tree: false, simulator: false, strategy: "none", kinds: &[], blockers: &[] },
    Case { dir: "proc/tree-vanished", pid: 8500, tree: true, simulator: false, strategy: "cuda-driver", kinds: CUDA, blockers: &[] },
    Case { dir: "proc/rdma-only", pid: 9200, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!("rdma"), blockers: &["rdma"] },
    Case { dir: "proc/simulator", pid: 9000, tree: false, simulator: true, strategy: "cuda-driver", kinds: kinds!("device-mapping", "cuda-library"), blockers: &[] },
    Case { dir: "proc/simulator", pid: 9000, tree: false, simulator: false, strategy: "none", kinds: &[], blockers: &[] },
    Case { dir: "proc/simulator-checkpointed", pid: 9100, tree: false, simulator: true, strategy: "cuda-driver", kinds: kinds!("cuda-library"), blockers: &[] },
    Case { dir: "proc/simulator-checkpointed", pid: 9100, tree: false, simulator: false, strategy: "none", kinds: &[], blockers: &[] },
    Case { dir: "proc/needs-options", pid: 9300, tree: true, simulator: false, strategy: "none", kinds: kinds!("needs-option"), blockers: &[] },
    // What CRIU cannot dump is no GPU blocker: the strategy stays, a checkpoint refuses (docs/criu.md).
    Case { dir: "proc/io-uring", pid: 9400, tree: false, simulator: false, strategy: "none", kinds: kinds!("cannot-dump"), blockers: &[] },
    // nvidia-smi's page of /dev/nvidiactl without a CUDA context: refused.
    Case { dir: "real/smi-475", pid: 475, tree: false, simulator: false, strategy: "unsupported", kinds: kinds!("nvidia-ctl", "nvidia-device", "nvidia-uvm", "device-mapping", "cuda-library", "nvml", "nccl", "gpu-env"), blockers: &["device-mapping"] },
];

/// Real captures: (folder under `fixtures/`, expected strategy of the tree of its top process).
/// Add one line per capture. These came from an H200, driver 580 (docs/hardware.md).
#[rustfmt::skip]
const REAL: &[(&str, &str)] = &[
    ("real/malloc-462", "cuda-driver"),
    // After cuCheckpointProcessCheckpoint: no /dev/nvidia* fd or mapping left, CRIU sees a plain process.
    ("real/malloc-checkpointed-462", "none"),
    ("real/managed-464", "unsupported"),
    ("real/host-466", "cuda-driver"),
    // Legacy CUDA IPC leaves nothing in /proc; the driver checkpointed the exporter fine.
    ("real/ipc-468", "cuda-driver"),
    ("real/ipcc-490", "cuda-driver"),
    ("real/torch-470", "cuda-driver"),
    // NVML only: device files open, no CUDA context (one /dev/nvidiactl page, not the 27 mappings of a
    // context), so not `cuda-driver`; that page is an NVML client's state, refused (`device-mapping`).
    ("real/smi-475", "unsupported"),
];

fn json_names<T: serde::Serialize>(items: impl IntoIterator<Item = T>) -> BTreeSet<String> {
    items
        .into_iter()
        .map(|k| {
            serde_json::to_value(k)
                .unwrap()
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

fn run(case: &Case) -> Report {
    detect_pid(case.pid, &opts(case.dir, case.tree, case.simulator))
        .unwrap_or_else(|e| panic!("{} pid {}: {e}", case.dir, case.pid))
}

#[test]
fn fixture_cases() {
    let mut failures = Vec::new();
    for case in CASES {
        let r = run(case);
        let what = format!(
            "{} pid {} tree={} simulator={}",
            case.dir, case.pid, case.tree, case.simulator
        );
        let strategy = serde_json::to_value(r.strategy.name).unwrap();
        if strategy != case.strategy {
            failures.push(format!(
                "{what}: strategy {strategy}, expected {}",
                case.strategy
            ));
        }
        let kinds = json_names(r.findings.iter().map(|f| f.kind));
        let want: BTreeSet<String> = case.kinds.iter().map(|s| s.to_string()).collect();
        if kinds != want {
            failures.push(format!(
                "{what}: finding kinds {kinds:?}, expected {want:?}"
            ));
        }
        let blockers = json_names(r.strategy.blockers.iter().map(|b| b.kind));
        let want: BTreeSet<String> = case.blockers.iter().map(|s| s.to_string()).collect();
        if blockers != want {
            failures.push(format!("{what}: blockers {blockers:?}, expected {want:?}"));
        }
        for b in &r.strategy.blockers {
            if b.message.is_empty() || b.remedy.is_empty() {
                failures.push(format!(
                    "{what}: blocker {:?} without message or remedy",
                    b.kind
                ));
            }
        }
        // GPU state and a strategy other than `none` go together, except for RDMA without a GPU: refused
        // (CRIU cannot dump it) but not GPU state; and NVIDIA device files without a CUDA context:
        // device state (`--all` lists them), though nothing for the GPU step.
        let gpu_expected = (case.strategy != "none" && case.kinds != ["rdma"])
            || case.kinds.contains(&"nvidia-ctl");
        if r.gpu != gpu_expected {
            failures.push(format!("{what}: gpu = {}", r.gpu));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

/// The fixtures cover every finding kind and every blocker kind the JSON documents.
#[test]
fn fixtures_cover_every_kind() {
    let mut kinds = BTreeSet::new();
    let mut blockers = BTreeSet::new();
    for case in CASES {
        let r = run(case);
        kinds.extend(json_names(r.findings.iter().map(|f| f.kind)));
        blockers.extend(json_names(r.strategy.blockers.iter().map(|b| b.kind)));
    }
    // The NVML finding from NVML itself (not the library) comes from the inventory test below.
    let all_kinds = [
        "nvidia-ctl",
        "nvidia-device",
        "nvidia-uvm",
        "managed-memory",
        "device-mapping",
        "cuda-library",
        "nvml",
        "cuda-ipc",
        "nccl",
        "rdma",
        "pci-bar",
        "mig",
        "mps",
        "amd-gpu",
        "gpu-env",
        "needs-option",
        "cannot-dump",
    ];
    let all_blockers = [
        "managed-memory",
        "cuda-ipc",
        "mig",
        "mps",
        "pci-bar",
        "rdma",
        "driver-too-old",
        "device-mapping",
    ];
    for k in all_kinds {
        assert!(kinds.contains(k), "no fixture shows finding kind {k}");
    }
    for b in all_blockers {
        assert!(blockers.contains(b), "no fixture shows blocker kind {b}");
    }
    assert_eq!(
        kinds.len(),
        all_kinds.len(),
        "unexpected finding kinds: {kinds:?}"
    );
    assert_eq!(
        blockers.len(),
        all_blockers.len(),
        "unexpected blocker kinds: {blockers:?}"
    );
}

#[test]
fn cuda_malloc_evidence() {
    let r = detect_pid(4242, &opts("proc/cuda-malloc", false, false)).unwrap();
    assert_eq!(r.schema_version, 1);
    assert_eq!(r.pid, Some(4242));
    assert_eq!(r.driver_version.as_deref(), Some("570.86.15"));
    let p = &r.processes[0];
    assert_eq!(
        (p.pid, p.ppid, p.comm.as_str()),
        (4242, 4200, "cuda_malloc")
    );
    assert_eq!(p.container_id.as_deref().map(str::len), Some(64));
    assert_eq!(p.nspid, vec![4242, 17]);
    assert!(!p.simulated);

    let find = |kind: &str, path: &str| {
        r.findings
            .iter()
            .find(|f| f.kind.as_str() == kind && f.evidence.path.as_deref() == Some(path))
            .unwrap_or_else(|| panic!("no {kind} finding for {path}"))
    };
    // The 64 KiB rw-s window of /dev/nvidia0: GPU 0, one mapping, its address.
    let bar = find("device-mapping", "/dev/nvidia0");
    assert_eq!(bar.evidence.size, Some(64 * 1024));
    assert_eq!(bar.evidence.gpu, Some(0));
    assert_eq!(
        bar.evidence.address.as_deref(),
        Some("0x7f3c46c00000-0x7f3c46c10000")
    );
    // The nvidiactl windows: summed, each range listed, the one at 0x200200000 among them.
    let ctl = find("device-mapping", "/dev/nvidiactl");
    assert_eq!(ctl.evidence.mappings, Some(9));
    assert_eq!(ctl.evidence.size, Some(7 * 0x20_0000 + 0x1_0000 + 0x1000));
    assert!(ctl
        .evidence
        .ranges
        .contains(&"0x200200000-0x200400000".to_string()));
    assert_eq!(
        find("nvidia-ctl", "/dev/nvidiactl").evidence.fds,
        vec![3, 7]
    );
    assert_eq!(
        find("nvidia-uvm", "/dev/nvidia-uvm").evidence.fds,
        vec![4, 5]
    );
    // Libraries, variables, the restore thread.
    assert!(r
        .findings
        .iter()
        .any(|f| f.evidence.library.as_deref()
            == Some("/usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15")));
    assert!(r
        .findings
        .iter()
        .any(|f| f.evidence.variable.as_deref() == Some("CUDA_VISIBLE_DEVICES=0")));
    assert!(r.findings.iter().any(|f| f.evidence.tid == Some(4243)));
    // Secrets never leave: redacted and non-GPU variables are not reported.
    assert!(!serde_json::to_string(&r).unwrap().contains("PATH="));
}

/// A held lock and an established connection are named with the flag each needs; a listener, a lock-free
/// fd and a deleted file of unknown size are not. Nothing blocks: the strategy stays `none`.
#[test]
fn needs_option_findings_name_their_flags() {
    let r = detect_pid(9300, &opts("proc/needs-options", true, false)).unwrap();
    assert_eq!(r.strategy.name.as_str(), "none");
    assert!(r.strategy.blockers.is_empty() && !r.gpu);
    let flags: Vec<String> = r
        .findings
        .iter()
        .map(|f| f.evidence.needs.as_ref().expect("needs").flag())
        .collect();
    assert_eq!(flags, ["--file-locks", "--tcp-established"]);
    let lock = &r.findings[0].evidence;
    assert_eq!(lock.fds, [3]);
    assert_eq!(lock.path.as_deref(), Some("/var/lib/app/app.db"));
    assert!(
        lock.detail.contains("POSIX ADVISORY READ"),
        "{}",
        lock.detail
    );
    assert!(lock.remedy.as_deref().unwrap().contains("--file-locks"));
    let tcp = &r.findings[1].evidence;
    assert_eq!(tcp.fds, [5]);
    assert!(
        tcp.detail.contains("127.0.0.1:8080 -> 127.0.0.1:50000"),
        "{}",
        tcp.detail
    );
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["findings"][0]["kind"], "needs-option");
    assert_eq!(
        v["findings"][0]["evidence"]["needs"],
        serde_json::json!({"option": "file-locks"})
    );
    assert_eq!(
        v["findings"][1]["evidence"]["needs"]["option"],
        "tcp-established"
    );
}

#[test]
fn json_shape_is_stable_and_round_trips() {
    let r = detect_pid(6000, &opts("proc/cuda-ipc-pair", true, false)).unwrap();
    let v = serde_json::to_value(&r).unwrap();
    let keys: BTreeSet<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        BTreeSet::from([
            "schema_version",
            "pid",
            "gpu",
            "processes",
            "findings",
            "strategy",
            "strategies",
            "driver_version",
            "elapsed_ms"
        ])
    );
    let strategy: BTreeSet<&str> = v["strategy"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(strategy, BTreeSet::from(["name", "blockers"]));
    let blocker: BTreeSet<&str> = v["strategy"]["blockers"][0]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        blocker,
        BTreeSet::from(["kind", "pid", "message", "remedy"])
    );
    for f in v["findings"].as_array().unwrap() {
        let keys: BTreeSet<&str> = f.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, BTreeSet::from(["kind", "pid", "evidence"]));
    }
    for p in v["processes"].as_array().unwrap() {
        for k in ["pid", "comm", "ppid", "strategy"] {
            assert!(p.get(k).is_some(), "process without {k}: {p}");
        }
        assert!(
            p.get("simulated").is_none(),
            "simulated is only written when true"
        );
    }
    let back: Report = serde_json::from_value(v).unwrap();
    assert_eq!(back.findings, r.findings);
    assert_eq!(back.strategy, r.strategy);
    assert_eq!(back.processes, r.processes);
}

#[test]
fn simulator_is_flagged_and_only_on_request() {
    let r = detect_pid(9000, &opts("proc/simulator", false, true)).unwrap();
    assert!(r.processes[0].simulated);
    assert!(r.gpu);
    let mem = r
        .findings
        .iter()
        .find(|f| f.kind.as_str() == "device-mapping")
        .unwrap();
    assert!(mem.evidence.simulated);
    assert_eq!(mem.evidence.size, Some(64 << 20));
    assert!(mem.evidence.address.is_some());
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["processes"][0]["simulated"], true);
    assert_eq!(v["findings"][0]["evidence"]["simulated"], true);

    let off = detect_pid(9000, &opts("proc/simulator", false, false)).unwrap();
    assert!(!off.gpu && off.findings.is_empty() && !off.processes[0].simulated);
}

#[test]
fn tree_walk_from_ppids_and_vanished_children() {
    let r = detect_pid(8000, &opts("proc/tree", true, false)).unwrap();
    let pids: Vec<i32> = r.processes.iter().map(|p| p.pid).collect();
    assert_eq!(
        pids,
        vec![8000, 8001, 8002, 8003],
        "8100 is not a descendant"
    );
    assert!(r.strategy.blockers.iter().all(|b| b.pid == 8002));
    let by_pid = |pid| {
        r.processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap()
            .strategy
            .as_str()
    };
    assert_eq!(by_pid(8001), "cuda-driver");
    assert_eq!(by_pid(8002), "unsupported");
    assert_eq!(by_pid(8003), "none");

    let r = detect_pid(8500, &opts("proc/tree-vanished", true, false)).unwrap();
    let pids: Vec<i32> = r.processes.iter().map(|p| p.pid).collect();
    assert_eq!(pids, vec![8500, 8501]);
    assert!(r.notes.iter().any(|n| n.contains("8509")), "{:?}", r.notes);
}

#[test]
fn all_lists_only_processes_with_gpu_state() {
    let r = detect_all_with(&opts("proc/tree", false, false), None).unwrap();
    assert_eq!(r.pid, None);
    let pids: Vec<i32> = r.processes.iter().map(|p| p.pid).collect();
    assert_eq!(pids, vec![8001, 8002]);
    assert_eq!(r.strategy.name.as_str(), "unsupported");

    let rdma = detect_all_with(&opts("proc/rdma-only", false, false), None).unwrap();
    assert!(rdma.processes.is_empty(), "RDMA alone is not GPU state");
    assert!(!rdma.gpu);

    let sim = |on| detect_all_with(&opts("proc/simulator-checkpointed", false, on), None).unwrap();
    assert_eq!(
        sim(true).processes.len(),
        1,
        "the control socket alone marks a simulated process"
    );
    assert!(sim(false).processes.is_empty());
}

#[test]
fn nvml_processes_are_added_and_mapped_through_nspid() {
    let inventory = StaticInventory {
        driver_version: Some("575.51.03".into()),
        processes: vec![
            // A host pid that this tree shows as is.
            ComputeProcess {
                pid: 7900,
                gpu: 1,
                used_memory: Some(512 << 20),
            },
            // 17 is 4242's pid inside its container (NSpid 4242 17).
            ComputeProcess {
                pid: 17,
                gpu: 0,
                used_memory: None,
            },
            ComputeProcess {
                pid: 31337,
                gpu: 0,
                used_memory: None,
            },
        ],
    };
    let r = detect_all_with(&opts("proc/no-gpu", false, false), Some(&inventory)).unwrap();
    assert_eq!(
        r.processes.len(),
        1,
        "NVML's word makes the shell a GPU process"
    );
    let nvml = &r.findings[0];
    assert_eq!(
        (nvml.kind.as_str(), nvml.pid, nvml.evidence.gpu),
        ("nvml", 7900, Some(1))
    );
    assert_eq!(nvml.evidence.size, Some(512 << 20));
    assert_eq!(
        r.driver_version.as_deref(),
        Some("575.51.03"),
        "NVML's version when the tree has none"
    );
    assert!(r.notes.iter().any(|n| n.contains("31337")), "{:?}", r.notes);

    let r = detect_pid_with(
        4242,
        &opts("proc/cuda-malloc", false, false),
        Some(&inventory),
    )
    .unwrap();
    assert!(r
        .findings
        .iter()
        .any(|f| f.kind.as_str() == "nvml" && f.evidence.gpu == Some(0)));
    assert_eq!(
        r.driver_version.as_deref(),
        Some("570.86.15"),
        "the tree's own version wins"
    );
}

#[test]
fn bad_input_is_a_clear_error() {
    let bad = |pid| detect_pid(pid, &opts("proc/bad", false, false)).unwrap_err();

    let e = bad(100);
    let msg = e.to_string();
    assert!(matches!(e, Error::Malformed { line: Some(3), .. }), "{msg}");
    assert!(msg.contains("bad/100/maps:3:"), "{msg}");
    assert_eq!(e.exit_status(), ExitStatus::Usage);

    let e = bad(2);
    assert!(matches!(e, Error::KernelThread { pid: 2, .. }), "{e}");
    assert_eq!(e.exit_status(), ExitStatus::Usage);

    let e = bad(101);
    assert!(
        matches!(
            e,
            Error::Thread {
                tid: 101,
                tgid: 100
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("--pid 100"));

    let e = bad(102);
    assert!(e.to_string().contains("102/stat"), "{e}");
    assert_eq!(e.exit_status(), ExitStatus::Usage);

    // A task caught while exiting shows Tgid 0: gone, not a thread of process 0.
    let e = bad(103);
    assert!(matches!(e, Error::NoSuchProcess { pid: 103, .. }), "{e}");

    let e = bad(4242);
    assert!(matches!(e, Error::NoSuchProcess { pid: 4242, .. }), "{e}");
    assert_eq!(e.exit_status(), ExitStatus::NoSuchProcess);

    let e = detect_pid(1, &opts("proc/not-a-proc-tree", false, false)).unwrap_err();
    assert!(matches!(e, Error::NotProcTree { .. }), "{e}");
    assert_eq!(e.exit_status(), ExitStatus::Usage);
    let e = detect_all_with(&opts("proc/does-not-exist", false, false), None).unwrap_err();
    assert_eq!(e.exit_status(), ExitStatus::Usage);
}

fn top_pid(root: &Path) -> i32 {
    let pids: Vec<(i32, i32)> = std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .map(|pid| {
            let stat = std::fs::read_to_string(root.join(format!("{pid}/stat"))).unwrap();
            let ppid = stat[stat.rfind(')').unwrap() + 1..]
                .split_whitespace()
                .nth(1)
                .unwrap()
                .parse()
                .unwrap();
            (pid, ppid)
        })
        .collect();
    let tops: Vec<i32> = pids
        .iter()
        .filter(|(_, ppid)| !pids.iter().any(|(p, _)| p == ppid))
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(
        tops.len(),
        1,
        "{}: one top process expected, found {tops:?}",
        root.display()
    );
    tops[0]
}

#[test]
fn real_captures_have_their_expected_strategy() {
    for (dir, strategy) in REAL {
        let root = fixtures().join(dir);
        let r = detect_pid(top_pid(&root), &opts(dir, true, false))
            .unwrap_or_else(|e| panic!("{dir}: {e}"));
        assert_eq!(r.strategy.name.as_str(), *strategy, "{dir}");
    }
}

/// Every capture dropped under `fixtures/real/` is read without error, and has a line in [`REAL`].
#[test]
fn every_real_capture_is_detected() {
    let Ok(entries) = std::fs::read_dir(fixtures().join("real")) else {
        println!("no fixtures/real folder yet: nothing to check");
        return;
    };
    for e in entries.filter_map(|e| e.ok()).filter(|e| e.path().is_dir()) {
        let dir = format!("real/{}", e.file_name().to_string_lossy());
        detect_pid(top_pid(&e.path()), &opts(&dir, true, false))
            .unwrap_or_else(|e| panic!("{dir}: {e}"));
        assert!(
            REAL.iter().any(|(d, _)| *d == dir),
            "{dir}: add its expected strategy to REAL"
        );
    }
}

/// What the real captures taught (docs/hardware.md): the driver's own /dev/nvidia-uvm mapping is not
/// managed memory, a cudaMallocManaged allocation is; nvidia-cap1/2 opened through NVML are not MIG.
#[test]
fn real_layouts_driver_uvm_mapping_and_mig_capabilities() {
    let malloc = detect_pid(462, &opts("real/malloc-462", false, false)).unwrap();
    let uvm = malloc
        .findings
        .iter()
        .find(|f| {
            f.evidence.path.as_deref() == Some("/dev/nvidia-uvm") && f.evidence.mappings.is_some()
        })
        .expect("the driver's UVM mapping is reported");
    assert_eq!(uvm.kind.as_str(), "device-mapping");
    assert_eq!(
        uvm.evidence.address.as_deref(),
        Some("0x204a00000-0x204c00000")
    );
    assert_eq!(malloc.driver_version.as_deref(), Some("580.159.04"));

    let managed = detect_pid(464, &opts("real/managed-464", false, false)).unwrap();
    let m = managed
        .findings
        .iter()
        .find(|f| f.kind.as_str() == "managed-memory")
        .unwrap();
    assert_eq!(m.evidence.size, Some(256 << 20));
    assert_eq!(
        m.evidence.address.as_deref(),
        Some("0x7fdbb4000000-0x7fdbc4000000")
    );
    assert_eq!(managed.strategy.blockers.len(), 1);
    assert_eq!(managed.strategy.blockers[0].kind.as_str(), "managed-memory");

    // The driver's UVM socket: in every CUDA process, and the only trace of CUDA in a checkpointed one.
    let sock = |r: &Report| {
        r.findings
            .iter()
            .find(|f| {
                f.evidence
                    .socket
                    .as_deref()
                    .is_some_and(|s| s.starts_with("@cuda-uvmfd-"))
            })
            .map(|f| f.evidence.detail.clone())
    };
    assert!(sock(&malloc).is_some_and(|d| !d.contains("checkpointed")));
    let ckpt = detect_pid(462, &opts("real/malloc-checkpointed-462", false, false)).unwrap();
    assert!(
        sock(&ckpt).is_some_and(|d| d.contains("checkpointed")),
        "{:?}",
        sock(&ckpt)
    );
    assert_eq!(ckpt.strategy.name.as_str(), "none");

    for (dir, pid) in [("real/torch-470", 470), ("real/smi-475", 475)] {
        let r = detect_pid(pid, &opts(dir, false, false)).unwrap();
        assert!(
            !r.findings.iter().any(|f| f.kind.as_str() == "mig"),
            "{dir}"
        );
        assert!(r
            .findings
            .iter()
            .any(|f| f.evidence.path.as_deref() == Some("/dev/nvidia-caps/nvidia-cap1")));
    }
}

/// The driver cannot tell a CUDA context from none (driver 580 answers RUNNING either way); /proc can. Every
/// real capture with a context maps /dev/nvidiactl many times; nvidia-smi maps one page of it and is refused
/// before anything is touched, with the remedy; a child forked without exec (derived from torch-470) keeps
/// only /dev/nvidia0 windows, which a checkpoint replaces.
#[test]
fn a_cuda_context_is_told_from_none_by_the_maps() {
    use gpu_checkpoint::detect::context::has_cuda_context;
    for (dir, pid) in [
        ("real/malloc-462", 462),
        ("real/host-466", 466),
        ("real/torch-470", 470),
        ("real/ipcc-490", 490),
    ] {
        let r = detect_pid(pid, &opts(dir, false, false)).unwrap();
        assert!(has_cuda_context(r.findings_of(pid)), "{dir}");
        assert!(r.inherited_mappings().is_empty(), "{dir}");
    }
    let smi = detect_pid(475, &opts("real/smi-475", false, false)).unwrap();
    assert!(!has_cuda_context(smi.findings_of(475)));
    assert_eq!(smi.processes[0].strategy.as_str(), "unsupported");
    let b = &smi.strategy.blockers;
    assert_eq!(b.len(), 1, "{b:?}");
    assert_eq!(b[0].kind.as_str(), "device-mapping");
    assert_eq!(b[0].pid, 475);
    assert!(b[0].message.contains("/dev/nvidiactl"), "{}", b[0].message);
    assert!(b[0].remedy.contains("NVML client"), "{}", b[0].remedy);

    let tree = detect_pid(470, &opts("proc/cuda-fork-child", true, false)).unwrap();
    let strategy = |pid: i32| {
        tree.processes
            .iter()
            .find(|p| p.pid == pid)
            .unwrap()
            .strategy
            .as_str()
    };
    assert_eq!((strategy(470), strategy(530)), ("cuda-driver", "none"));
    assert!(has_cuda_context(tree.findings_of(470)));
    assert!(!has_cuda_context(tree.findings_of(530)));
    let inherited = tree.inherited_mappings();
    assert_eq!(inherited.len(), 1, "{inherited:?}");
    assert_eq!(inherited[0].pid, 530);
    assert_eq!(inherited[0].path, "/dev/nvidia0");
    assert_eq!(
        inherited[0].ranges,
        ["0x200600000-0x200800000", "0x7f1eec320000-0x7f1eec330000"]
    );
}

/// Processes sharing CUDA IPC memory (driver 610, checkpointed as one tree) need the ordered GPU step:
/// detect says so; a blocked tree (older driver, or one process alone) and a tree without IPC do not.
#[test]
fn a_tree_sharing_cuda_ipc_memory_is_reported_as_needing_order() {
    let r = detect_pid(6000, &opts("proc/cuda-ipc-pair-r610", true, false)).unwrap();
    assert!(r.ordered, "{:?}", r.strategy);
    assert_eq!(serde_json::to_value(&r).unwrap()["ordered"], true);
    for (dir, pid, tree) in [
        ("proc/cuda-ipc-pair", 6000, true),
        ("proc/cuda-ipc-pair-r610", 6001, false),
    ] {
        assert!(
            !detect_pid(pid, &opts(dir, tree, false)).unwrap().ordered,
            "{dir} {pid}"
        );
    }
}

/// An io_uring instance (stock MariaDB's) is what CRIU cannot dump: a `cannot-dump` finding naming it,
/// with its fd and a remedy, in the JSON users script against.
#[test]
fn io_uring_is_reported_as_what_criu_cannot_dump() {
    let r = detect_pid(9400, &opts("proc/io-uring", false, false)).unwrap();
    let f: Vec<&gpu_checkpoint::detect::Finding> = r
        .findings
        .iter()
        .filter(|f| f.kind.as_str() == "cannot-dump")
        .collect();
    assert_eq!(f.len(), 1, "{:?}", r.findings);
    let v = serde_json::to_value(f[0]).unwrap();
    assert_eq!(v["evidence"]["limit"], "io-uring", "{v}");
    assert_eq!(v["evidence"]["fds"], serde_json::json!([9]), "{v}");
    assert!(
        v["evidence"]["remedy"]
            .as_str()
            .is_some_and(|r| r.contains("--innodb-use-native-aio=0")),
        "{v}"
    );
    assert!(r.strategy.blockers.is_empty());
}
