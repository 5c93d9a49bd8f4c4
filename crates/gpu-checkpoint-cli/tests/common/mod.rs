//! Shared by the CLI tests that drive real CRIU: finding CRIU and the workload binary, starting
//! workloads, running `gpu-checkpoint`, reading state files.
#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gpu_checkpoint::proc as tree;
use gpu_checkpoint_workloads::{read_state, Record};

pub mod programs;

/// The `gpu-checkpoint` binary under test.
pub fn gc_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpu-checkpoint"))
}

/// A temporary folder and a store path in it, when root and CRIU are there (see [`criu_ready`]).
pub fn criu_scene() -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    if !criu_ready() {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    Some((dir, store))
}

/// A `counter` workload in a [`criu_scene`], once it has ticked `seq` times: the folder, the store path
/// and the workload.
pub fn criu_counter(seq: u64) -> Option<(tempfile::TempDir, PathBuf, Workload)> {
    let (dir, store) = criu_scene()?;
    let w = Workload::start("counter", dir.path(), &[]);
    w.wait_state("the counter ticking", |r| {
        r.len() == 1 && num(&r[0], "seq") >= seq
    });
    Some((dir, store, w))
}

/// Whether tests needing root and CRIU can run. In CI (`CI=true`) their absence fails the test; locally
/// the test is skipped with the reason printed.
pub fn criu_ready() -> bool {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    let ready = READY.get_or_init(|| {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not running as root".into());
        }
        gpu_checkpoint::dump::discover(None)
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    needs(
        "CRIU",
        ready,
        "scripts/test.sh installs CRIU; CI runs as root",
    )
}

/// Whether what the `tests` tests need is here (`found`). In CI (`CI=true`) its absence fails the test,
/// saying why and how CI gets it (`ci_hint`); locally the test is skipped with the reason printed.
pub fn needs(tests: &str, found: &Result<(), String>, ci_hint: &str) -> bool {
    match found {
        Ok(()) => true,
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("{tests} tests cannot run in CI: {why} ({ci_hint})")
        }
        Err(why) => {
            eprintln!("SKIPPED: {why}; run scripts/setup.sh as root to run the {tests} tests");
            false
        }
    }
}

/// The workload binary, built next to `gpu-checkpoint` (another crate's binaries are not visible to
/// this crate's tests, so we ask cargo for it: a no-op when it is up to date).
pub fn workload_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let dir = gc_bin().parent().expect("target dir").to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args([
            "build",
            "-q",
            "-p",
            "gpu-checkpoint-workloads",
            "--bin",
            "workload",
        ]);
        if dir.ends_with("release") {
            cmd.arg("--release");
        }
        let st = cmd.status().expect("run cargo to build the workload");
        assert!(st.success(), "building the workload failed: {st}");
        let bin = dir.join("workload");
        assert!(bin.exists(), "{} missing after cargo build", bin.display());
        bin
    })
    .clone()
}

/// A running workload; killed (with its tree) on drop.
pub struct Workload {
    pub pid: i32,
    pub state: PathBuf,
}

impl Workload {
    /// Starts `workload KIND --state DIR/state --detach ARGS...`.
    pub fn start(kind: &str, dir: &Path, args: &[&str]) -> Workload {
        let state = dir.join(format!("{kind}.state"));
        let pid = start_detached(
            Command::new(workload_bin())
                .arg(kind)
                .arg("--state")
                .arg(&state)
                .arg("--detach")
                .args(args),
            &format!("workload {kind}"),
        );
        Workload { pid, state }
    }

    /// The records of the state file, once it has `n` records that satisfy `ok`.
    pub fn wait_state(&self, what: &str, ok: impl Fn(&[Record]) -> bool) -> Vec<Record> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(recs) = read_state(&self.state) {
                if ok(&recs) {
                    return recs;
                }
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; state: {:?}",
                read_state(&self.state)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Blanks the state file, keeping its size (CRIU checks the size of a file a process holds open):
    /// what it shows next comes from a restored copy, not from the original it replaced.
    pub fn blank_state(&self) {
        let size = std::fs::metadata(&self.state).unwrap().len() as usize;
        std::fs::write(&self.state, vec![b' '; size]).unwrap();
    }

    pub fn alive(&self) -> bool {
        tree::is_alive(self.pid)
    }

    /// Stopped by a signal (CRIU's leave_stopped) rather than running.
    pub fn stopped(&self) -> bool {
        tree::stat(self.pid).is_some_and(|s| s.state == 'T')
    }

    /// Kills the workload's tree and waits until its PID is free (init reaps it).
    pub fn kill_and_wait_free(&self) {
        let pids: Vec<i32> = tree::process_tree(self.pid).iter().map(|p| p.pid).collect();
        tree::kill_tree(&pids, Duration::from_secs(10));
        wait_pid_free(self.pid);
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let pids: Vec<i32> = tree::process_tree(self.pid).iter().map(|p| p.pid).collect();
        tree::kill_tree(&pids, Duration::from_secs(5));
    }
}

/// A `memory` workload of `mib` MiB, once it has filled its memory and verified it: the workload and the
/// memory's checksum.
pub fn memory_workload(dir: &Path, mib: &str) -> (Workload, String) {
    memory_workload_with(dir, &["--mib", mib])
}

/// [`memory_workload`] with the workload's arguments (`--mib`, `--seed`, ...).
pub fn memory_workload_with(dir: &Path, args: &[&str]) -> (Workload, String) {
    let w = Workload::start("memory", dir, args);
    let r = w.wait_state("memory filled and verified", |r| {
        r.len() == 1
            && r[0].get("phase").map(String::as_str) == Some("verifying")
            && num(&r[0], "verified") >= 1
    });
    let checksum = r[0]["checksum"].clone();
    (w, checksum)
}

/// Waits until no process (not even a zombie) holds `pid`.
pub fn wait_pid_free(pid: i32) {
    let left = tree::wait_until(Duration::from_secs(30), || {
        if tree::pid_taken(pid) {
            vec![pid]
        } else {
            vec![]
        }
    });
    assert!(left.is_empty(), "pid {pid} still taken");
}

/// Runs `cmd` to its end, asserting that it succeeded ([`assert_success`]): its output.
pub fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_success(&out, what);
    out
}

/// Asserts that the run of `what` succeeded, with its status and output in the message.
pub fn assert_success(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// Runs `cmd`, which starts a program detached and prints its PID (`what` names it in the messages): the
/// PID.
pub fn start_detached(cmd: &mut Command, what: &str) -> i32 {
    let out = run_ok(cmd, what);
    let said = text(&out.stdout);
    said.trim()
        .parse()
        .unwrap_or_else(|e| panic!("{what} prints its pid ({e}): {said:?}"))
}

/// Runs `gpu-checkpoint ARGS...`.
pub fn gc(args: &[&str]) -> Output {
    Command::new(gc_bin())
        .args(args)
        .output()
        .expect("run gpu-checkpoint")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts a successful run and returns its stdout.
pub fn ok(out: &Output) -> String {
    assert_success(out, "gpu-checkpoint");
    text(&out.stdout)
}

/// Asserts a failed run with exit code `code`.
pub fn fails_with(out: &Output, code: i32) -> String {
    assert_eq!(
        out.status.code(),
        Some(code),
        "expected exit {code}:\nstdout: {}\nstderr: {}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stderr)
}

/// Runs `gpu-checkpoint checkpoint --pid PID --storage STORE EXTRA...`.
pub fn run_checkpoint(pid: i32, store: &Path, extra: &[&str]) -> Output {
    run_checkpoint_env(pid, store, extra, &[])
}

/// [`run_checkpoint`] with variables added to the environment.
pub fn run_checkpoint_env(pid: i32, store: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let pid = pid.to_string();
    let mut args = vec![
        "checkpoint",
        "--pid",
        &pid,
        "--storage",
        store.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Command::new(gc_bin())
        .args(&args)
        .envs(env.iter().copied())
        .output()
        .expect("run gpu-checkpoint")
}

/// `gpu-checkpoint checkpoint --pid PID --storage STORE --format json EXTRA...` -> its JSON.
pub fn checkpoint(pid: i32, store: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["--format", "json"];
    args.extend_from_slice(extra);
    let out = ok(&run_checkpoint(pid, store, &args));
    serde_json::from_str(&out).expect("checkpoint prints JSON")
}

/// `gpu-checkpoint restore TARGET --storage STORE` -> the restored PID.
pub fn restore(target: &str, store: &Path) -> i32 {
    restore_with(target, store, &[])
}

/// `restore TARGET --storage STORE EXTRA...`.
pub fn restore_args<'a>(target: &'a str, store: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["restore", target, "--storage", store.to_str().unwrap()];
    args.extend_from_slice(extra);
    args
}

/// `gpu-checkpoint restore TARGET --storage STORE EXTRA...` -> the restored PID.
pub fn restore_with(target: &str, store: &Path, extra: &[&str]) -> i32 {
    let out = ok(&gc(&restore_args(target, store, extra)));
    out.trim().parse().expect("restore prints the PID")
}

/// `gpu-checkpoint list --storage STORE --format json`.
pub fn list_json(store: &Path) -> Output {
    gc(&[
        "list",
        "--storage",
        &store.display().to_string(),
        "--format",
        "json",
    ])
}

/// The ids `list --format json` shows.
pub fn list_ids(store: &Path) -> Vec<String> {
    let out = list_json(store);
    if !out.status.success() {
        return Vec::new();
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("list JSON");
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// The string field `key` of every element of the JSON array `list`.
pub fn strings<'a>(list: &'a serde_json::Value, key: &str) -> Vec<&'a str> {
    list.as_array()
        .unwrap_or_else(|| panic!("not an array: {list}"))
        .iter()
        .map(|e| {
            e[key]
                .as_str()
                .unwrap_or_else(|| panic!("no string {key} in {e}"))
        })
        .collect()
}

/// Number field of a record.
pub fn num(rec: &Record, key: &str) -> u64 {
    gpu_checkpoint_workloads::field_u64(rec, key)
        .unwrap_or_else(|| panic!("record without {key}: {rec:?}"))
}

/// A tmpfs mounted on a fresh folder (for disk-full and read-only storage), unmounted on drop.
pub struct Tmpfs {
    pub path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    pub fn mount(opts: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(&path)
            .status()
            .expect("run mount");
        assert!(st.success(), "mount -t tmpfs -o {opts} failed");
        Tmpfs { path, _dir: dir }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

/// A small podman-style checkpoint archive at `path`: `config.dump` and runc's images (random bytes), for
/// `import`.
pub fn podman_archive(path: &Path, image_bytes: usize) {
    let mut tar = tar::Builder::new(std::fs::File::create(path).unwrap());
    let mut add = |name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o600);
        h.set_cksum();
        tar.append_data(&mut h, name, data).unwrap();
    };
    add("config.dump", br#"{"id": "c1", "runtime": "runc"}"#);
    let mut image = vec![0u8; image_bytes];
    gpu_checkpoint_testdata::XorShift64::new(9).fill_bytes(&mut image);
    add("checkpoint/inventory.img", &image);
    add("checkpoint/pages-1.img", &image[..image.len().min(4096)]);
    tar.into_inner().unwrap();
}
