//! `gpu-checkpoint detect` end to end: JSON fields, text output and exit codes.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../gpu-checkpoint/tests/fixtures/proc")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

fn detect(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .arg("detect")
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run gpu-checkpoint")
}

/// `detect ARGS... --proc-root ROOT EXTRA...`, ROOT the fixture `name`.
fn detect_in(name: &str, args: &[&str], extra: &[&str]) -> Output {
    let root = fixture(name);
    let mut all = args.to_vec();
    all.extend(["--proc-root", &root]);
    all.extend_from_slice(extra);
    detect(&all)
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited with a code")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(o: &Output) -> serde_json::Value {
    assert_eq!(code(o), 0, "stderr: {}", stderr(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(o)))
}

#[test]
fn json_report_of_a_blocked_process() {
    let v = json(&detect_in(
        "cuda-malloc-managed",
        &["--pid", "5000"],
        &["--format", "json"],
    ));
    let keys: std::collections::BTreeSet<&str> =
        v.as_object().unwrap().keys().map(String::as_str).collect();
    let want =
        "schema_version pid gpu processes findings strategy strategies driver_version elapsed_ms";
    assert_eq!(keys, want.split(' ').collect(), "the report's fields");
    assert_eq!(v["schema_version"], 1);
    assert_eq!(v["pid"], 5000);
    assert_eq!(v["gpu"], true);
    assert_eq!(v["driver_version"], "570.86.15");
    assert!(v["elapsed_ms"].as_f64().unwrap() >= 0.0);
    assert_eq!(v["processes"][0]["strategy"], "unsupported");
    assert_eq!(v["processes"][0]["comm"], "cuda_managed");
    assert_eq!(v["processes"][0]["ppid"], 4999);
    assert_eq!(v["strategy"]["name"], "unsupported");
    // Every strategy weighed, none chosen, and why the GPU ones were not: the blockers.
    let weighed = v["strategies"].as_array().unwrap();
    assert_eq!(weighed.len(), 5);
    assert!(weighed.iter().all(|c| c["chosen"] == false), "{weighed:?}");
    assert_eq!(weighed[1]["why"], "blocked: see the blockers");
    let b = &v["strategy"]["blockers"][0];
    assert_eq!(b["kind"], "managed-memory");
    assert_eq!(b["pid"], 5000);
    assert!(b["message"].as_str().unwrap().contains("4.0 MiB"));
    assert!(b["remedy"].as_str().unwrap().contains("cudaMalloc"));
    let managed = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "managed-memory")
        .unwrap();
    assert_eq!(managed["pid"], 5000);
    assert_eq!(managed["evidence"]["size"], 4 << 20);
    assert_eq!(managed["evidence"]["path"], "/dev/nvidia-uvm");
}

#[test]
fn text_report_short_and_verbose() {
    let short = detect_in("pci-bar", &["--pid", "7500"], &[]);
    assert_eq!(code(&short), 0, "{}", stderr(&short));
    let text = stdout(&short);
    assert!(text.starts_with("pid 7500: strategy unsupported"), "{text}");
    assert!(text.contains("blocker pci-bar"), "{text}");
    assert!(
        text.contains("BAR sliding"),
        "the remedy says what BAR sliding cannot do: {text}"
    );
    assert!(
        !text.contains("0x7f3c46c00000"),
        "evidence only with --verbose: {text}"
    );
    let verbose = stdout(&detect_in("pci-bar", &["--pid", "7500"], &["--verbose"]));
    assert!(
        verbose.contains("0x7f3c46c00000-0x7f3c46c10000"),
        "{verbose}"
    );
    assert!(verbose.contains("libcuda.so.570.86.15"), "{verbose}");
    assert!(verbose.lines().count() > text.lines().count());
}

/// What CRIU will need an option for is printed with the flag, without --verbose.
#[test]
fn text_report_names_the_flags_a_checkpoint_needs() {
    let out = detect_in("needs-options", &["--pid", "9300", "--tree"], &[]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.starts_with("pid 9300: strategy none"), "{text}");
    assert!(
        text.contains("needs --file-locks (pid 9300): fd 3 holds file locks"),
        "{text}"
    );
    assert!(
        text.contains("needs --tcp-established (pid 9300): 1 established TCP connection"),
        "{text}"
    );
}

#[test]
fn simulator_only_on_request_and_said_so() {
    let sim = |extra: &[&str]| detect_in("simulator", &["--pid", "9000"], extra);
    let on = stdout(&sim(&["--simulator"]));
    assert!(on.contains("(simulated GPU)"), "{on}");
    assert!(on.contains("cuda-driver"), "{on}");
    let off = stdout(&sim(&[]));
    assert!(off.contains("strategy none"), "{off}");
    assert!(!off.contains("simulated"), "{off}");
    let v = json(&sim(&["--simulator", "--format", "json"]));
    assert_eq!(v["processes"][0]["simulated"], true);
}

#[test]
fn tree_and_all() {
    let tree = |args: &[&str], extra: &[&str]| detect_in("tree", args, extra);
    let v = json(&tree(&["--pid", "8000", "--tree"], &["--format", "json"]));
    assert_eq!(v["processes"].as_array().unwrap().len(), 4);
    assert_eq!(v["strategy"]["name"], "unsupported");
    let v = json(&tree(&["--all"], &["--format", "json"]));
    assert_eq!(v["pid"], serde_json::Value::Null);
    let pids: Vec<i64> = v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_i64().unwrap())
        .collect();
    assert_eq!(pids, vec![8001, 8002]);
    let text = stdout(&tree(&["--all"], &[]));
    assert!(text.starts_with("2 process(es) with GPU state"), "{text}");
}

#[test]
fn exit_codes() {
    let cases: &[(&[&str], i32, &str)] = &[
        (
            &["--pid", "31337", "--proc-root", &fixture("no-gpu")],
            3,
            "no process 31337",
        ),
        (
            &["--pid", "1", "--proc-root", &fixture("not-a-proc-tree")],
            2,
            "is not a /proc tree",
        ),
        (
            &["--all", "--proc-root", "/nonexistent/proc"],
            2,
            "is not a /proc tree",
        ),
        (
            &["--pid", "100", "--proc-root", &fixture("bad")],
            2,
            "bad/100/maps:3:",
        ),
        (
            &["--pid", "2", "--proc-root", &fixture("bad")],
            2,
            "kernel thread",
        ),
        (
            &["--pid", "101", "--proc-root", &fixture("bad")],
            2,
            "--pid 100",
        ),
        (&[], 2, "--pid"),
        (&["--tree", "--all"], 2, ""),
        (&["--pid", "1", "--all"], 2, ""),
        (&["--pid", "0"], 2, ""),
        (&["--pid", "abc"], 2, ""),
        (&["--pid", "1", "--format", "yaml"], 2, ""),
    ];
    for (args, want, needle) in cases {
        let o = detect(args);
        assert_eq!(code(&o), *want, "detect {args:?}: stderr {}", stderr(&o));
        assert!(
            stderr(&o).contains(needle),
            "detect {args:?}: stderr {}",
            stderr(&o)
        );
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
}

#[test]
fn live_process_and_exit_code_3() {
    let me = std::process::id().to_string();
    let v = json(&detect(&["--pid", &me, "--format", "json"]));
    assert_eq!(v["pid"], std::process::id());
    assert_eq!(v["strategy"]["name"], "none");

    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = child.id().to_string();
    child.kill().unwrap();
    child.wait().unwrap();
    let o = detect(&["--pid", &pid]);
    assert_eq!(code(&o), 3, "{}", stderr(&o));
}

/// Not being allowed to read a process is exit 4. As root, drop to `nobody` with setpriv to see it.
#[test]
fn permission_denied_is_exit_4() {
    let me = std::process::id().to_string();
    let root = unsafe { libc::geteuid() } == 0;
    let o = if root {
        let have_setpriv = Command::new("setpriv").arg("--version").output().is_ok();
        if !have_setpriv {
            assert!(
                std::env::var("CI").is_err(),
                "setpriv (util-linux) is required in CI"
            );
            println!("skipped: setpriv not found, cannot drop root to test permission denied");
            return;
        }
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_gpu-checkpoint"))
            .args(["detect", "--pid", &me])
            .output()
            .unwrap()
    } else {
        // Not root: a root-owned process (pid 1) is not ours to read.
        detect(&["--pid", "1"])
    };
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permission denied reading /proc/"),
        "{}",
        stderr(&o)
    );
}

/// A credential in a GPU-prefixed variable is named in the report (evidence) but its value is never printed.
#[test]
fn detect_verbose_never_prints_a_credential() {
    let mut child = Command::new("sleep")
        .arg("30")
        .env("GPU_API_KEY", "gpu-secret-value-1")
        .env("CUDA_VISIBLE_DEVICES", "0")
        .spawn()
        .unwrap();
    // `spawn` returns once the exec has begun (the close-on-exec pipe closed), but the kernel fills the
    // new environment block a little later: read before that, /proc/PID/environ is empty (a fresh CI run
    // on 2 loaded cores did exactly that). Wait for the exec to finish before asking detect.
    let environ = format!("/proc/{}/environ", child.id());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !std::fs::read(&environ).is_ok_and(|e| !e.is_empty()) {
        assert!(
            std::time::Instant::now() < deadline,
            "{environ} stayed empty"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .args(["detect", "--pid", &child.id().to_string(), "--verbose"])
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!text.contains("gpu-secret-value-1"), "{text}");
    assert!(text.contains("GPU_API_KEY=<redacted>"), "{text}");
    assert!(text.contains("CUDA_VISIBLE_DEVICES=0"), "{text}");
}
