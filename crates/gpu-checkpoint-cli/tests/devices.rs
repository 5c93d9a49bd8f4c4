//! Device files CRIU cannot dump, reopened on restore (issue 17, item 3): the mechanism NVIDIA nodes held
//! without a CUDA context go through, tested on a stand-in node CRIU cannot dump either, `/dev/fuse`
//! (`Can't dump file N of that type [20600] (chr 10:229)`).
//!
//! A Python process holds `/dev/fuse` open at fd 9 (read-write) and at fd 3 (read-only, non-blocking), and
//! counts. Plain `criu dump` fails on it (the baseline); `gpu-checkpoint checkpoint` without
//! `--reopen-device` fails too, names the flag and leaves the process running; with
//! `--reopen-device /dev/fuse` it is checkpointed, and its restore has both descriptors back on the same
//! node with the same flags, and counts on from where it was. Through both dump paths (streamed, staged),
//! the three restores (userfaultfd, `--stream`, `--staged`) and both modes (stopped, `--leave-running`).
//! Plain CRIU with the same plugin, by hand, does the same in the same test.
//!
//! Needs root, CRIU, python3 and `/dev/fuse`: fails in CI without them, skips locally with the reason.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::programs::*;
use common::*;

/// Holds `/dev/fuse` at fd 9 (O_RDWR) and fd 3 (O_RDONLY | O_NONBLOCK); reports `n ok` every 20 ms
/// ([`REPORT_PY`], its log opened after fd 3 is taken), `ok` being 1 while both descriptors still name
/// `/dev/fuse` with the flags they were opened with; `n` lives in memory only.
const HOLDER: &str = r#"
import fcntl, os, sys, time
def hold(fd, flags):
    f = os.open("/dev/fuse", flags)
    if f != fd:
        os.dup2(f, fd)
        os.close(f)
hold(9, os.O_RDWR)
hold(3, os.O_RDONLY | os.O_NONBLOCK)
report = reporter(sys.argv[1])
want = {9: os.O_RDWR, 3: os.O_RDONLY | os.O_NONBLOCK}
mask = os.O_ACCMODE | os.O_NONBLOCK
n = 0
while True:
    n += 1
    ok = all(os.readlink("/proc/self/fd/%d" % fd) == "/dev/fuse"
             and fcntl.fcntl(fd, fcntl.F_GETFL) & mask == w for fd, w in want.items())
    report("%d %d" % (n, ok))
    time.sleep(0.02)
"#;

/// What the tests need: root, CRIU, python3, /dev/fuse, and the plugin built next to the binary.
fn ready() -> Option<PathBuf> {
    let py = python()?;
    if !Path::new("/dev/fuse").exists() {
        return missing("/dev/fuse missing (the stand-in device node)");
    }
    plugin();
    Some(py)
}

/// Builds the plugin next to `gpu-checkpoint` (another crate's library is not built for this crate's
/// tests; a no-op when it is up to date), where the binary looks for it.
fn plugin() -> PathBuf {
    static PLUGIN: OnceLock<PathBuf> = OnceLock::new();
    PLUGIN
        .get_or_init(|| {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let st = Command::new(cargo)
                .args(["build", "-q", "-p", "gpu-checkpoint-criu-devices"])
                .status()
                .expect("run cargo to build the plugin");
            assert!(st.success(), "cargo build of the plugin failed");
            let so = gc_bin()
                .parent()
                .unwrap()
                .join("libgpu_checkpoint_devices.so");
            assert!(so.is_file(), "{} missing after cargo build", so.display());
            so
        })
        .clone()
}

/// `(n, ok)` of the holder's last report.
fn state(report: &Report) -> Option<(u64, bool)> {
    let text = report.last()?;
    let mut it = text.split_whitespace();
    let n = it.next()?.parse().ok()?;
    let ok = it.next()? == "1";
    Some((n, ok))
}

/// Waits until the holder has counted past `past` with both descriptors right; returns its count.
fn counts_past(report: &Report, past: u64) -> u64 {
    let mut seen = None;
    wait_for(&format!("the holder to count past {past}"), || {
        seen = state(report);
        matches!(seen, Some((n, true)) if n > past)
    });
    seen.unwrap().0
}

/// Access mode and O_NONBLOCK of `pid`'s fd, from fdinfo (octal `flags:`).
fn fd_flags(pid: i32, fd: i32) -> i32 {
    let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap();
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .expect("flags in fdinfo");
    i32::from_str_radix(flags.trim(), 8).unwrap() & (libc::O_ACCMODE | libc::O_NONBLOCK)
}

/// Both descriptors of `pid` are on /dev/fuse with their flags.
fn holds_fuse(pid: i32) {
    for (fd, want) in [(9, libc::O_RDWR), (3, libc::O_RDONLY | libc::O_NONBLOCK)] {
        let link = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).unwrap();
        assert_eq!(link, Path::new("/dev/fuse"), "fd {fd} of {pid}");
        assert_eq!(fd_flags(pid, fd), want, "flags of fd {fd} of {pid}");
    }
}

fn start(py: &Path, dir: &Path) -> (Program, Report) {
    let (p, st) = Program::python(py, dir, "holder", HOLDER, &[]);
    counts_past(&st, 2);
    holds_fuse(p.pid);
    (p, st)
}

#[test]
fn without_the_flag_criu_fails_and_the_process_runs_on() {
    let Some(py) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (p, st) = start(&py, dir.path());
    // The baseline: plain CRIU cannot dump the node.
    let (out, img) = plain_dump(p.pid, dir.path(), "plain", &["--leave-running"]);
    let log = std::fs::read_to_string(img.join("criu.log")).unwrap_or_default();
    assert!(!out.status.success(), "plain criu dump took /dev/fuse");
    assert!(
        log.contains("Can't dump file") && log.contains("chr 10:229"),
        "{log}"
    );
    let store = dir.path().join("store");
    let err = fails_with(&run_checkpoint(p.pid, &store, &[]), 1);
    assert!(err.contains("--reopen-device"), "{err}");
    assert!(list_ids(&store).is_empty());
    // Running, not stopped, and counting.
    let n = state(&st).unwrap().0;
    counts_past(&st, n);
    holds_fuse(p.pid);
    p.kill_and_wait_free();
}

/// One round: checkpoint with `--reopen-device /dev/fuse` and `extra` in `mode`, restore with `restore`.
fn round(mode: Mode, extra: &[&str], restore_flags: &[&str]) {
    let Some(py) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (p, st) = start(&py, dir.path());
    let store = dir.path().join("store");
    let mut args = vec!["--reopen-device", "/dev/fuse"];
    args.extend_from_slice(extra);
    args.extend_from_slice(mode.flags());
    let v = checkpoint(p.pid, &store, &args);
    let at = state(&st).unwrap().0;
    let devices = v["devices"].as_array().expect("devices recorded");
    // Two open files (fd 9 and fd 3 are two opens), both of /dev/fuse.
    assert_eq!(devices.len(), 2, "{v}");
    assert!(devices.iter().all(|d| d["path"] == "/dev/fuse"), "{v}");
    let pid = p.pid;
    if mode == Mode::LeaveRunning {
        counts_past(&st, at);
        holds_fuse(pid);
    }
    p.kill_and_wait_free();
    st.mark();
    let id = v["id"].as_str().unwrap();
    let restored = restore_with(id, &store, restore_flags);
    assert_eq!(restored, pid);
    // The copy counts on from the checkpoint (n lives in memory only): stopped, the original's last
    // count was the checkpoint's; left running, the original counted on, and the copy counts from a
    // value at or below its last.
    let n = counts_past(&st, if mode == Mode::Stop { at } else { 1 });
    counts_past(&st, n);
    holds_fuse(restored);
    kill_tree_and_wait_free(restored);
}

#[test]
fn stopped_streamed_then_default_restore() {
    round(Mode::Stop, &[], &[]);
}

#[test]
fn left_running_staged_then_streamed_restore() {
    round(Mode::LeaveRunning, &["--staged"], &["--stream"]);
}

#[test]
fn stopped_staged_then_staged_restore() {
    round(Mode::Stop, &["--staged"], &["--staged"]);
}

/// The plugin under plain CRIU, run by hand with the variables gpu-checkpoint sets: the mechanism is
/// CRIU's own external-file hooks, nothing of our flow.
#[test]
fn plain_criu_with_the_plugin() {
    let Some(py) = ready() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (p, st) = start(&py, dir.path());
    let plugins = dir.path().join("plugins");
    std::fs::create_dir(&plugins).unwrap();
    std::os::unix::fs::symlink(plugin(), plugins.join("libgpu_checkpoint_devices.so")).unwrap();
    let record = dir.path().join("records");
    std::fs::write(&record, "").unwrap();
    let img = dir.path().join("img");
    std::fs::create_dir(&img).unwrap();
    let criu = gpu_checkpoint::dump::discover(None).expect("CRIU").path;
    let run = |args: &[&str]| {
        Command::new(&criu)
            .args(args)
            .arg("-D")
            .arg(&img)
            .env("CRIU_LIBS_DIR", &plugins)
            .env("GPU_CHECKPOINT_DEVICES_RECORD", &record)
            .env("GPU_CHECKPOINT_DEVICES_ALLOW", "/dev/fuse")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run criu")
    };
    let pid = p.pid.to_string();
    let out = run(&["dump", "-t", &pid, "-v4", "-o", "dump.log"]);
    assert!(
        out.status.success(),
        "plain criu dump with the plugin: {}",
        std::fs::read_to_string(img.join("dump.log")).unwrap_or_default()
    );
    let at = state(&st).unwrap().0;
    let records = std::fs::read_to_string(&record).unwrap();
    assert_eq!(records.lines().count(), 2, "{records}");
    p.kill_and_wait_free();
    let out = run(&["restore", "-d", "-v4", "-o", "restore.log"]);
    assert!(
        out.status.success(),
        "plain criu restore with the plugin: {}",
        std::fs::read_to_string(img.join("restore.log")).unwrap_or_default()
    );
    counts_past(&st, at);
    let restored: i32 = pid.parse().unwrap();
    holds_fuse(restored);
    kill_tree_and_wait_free(restored);
}

/// The NVIDIA case end to end, with a stand-in: in a private mount namespace whose `/dev` is a tmpfs, the
/// NVIDIA nodes an NVML client holds are made nodes of the stand-in device (10:229). A process holding
/// them at the descriptors the real `nvidia-smi` capture holds them (`tests/fixtures/real/smi-475`: fd 9
/// `/dev/nvidiactl`, 10 and 15-17 `/dev/nvidia0`, 11 and 14 `/dev/nvidia-uvm`, 12 and 13 the MIG
/// config/monitor capabilities) and mapping nothing is what a `pynvml` process looks like to detect: no
/// CUDA context, strategy `none`. It is checkpointed without any flag (no GPU step; the plugin takes every
/// descriptor, `/dev/nvidia-uvm` included, on which CRIU failed on the H200) and restored with each
/// descriptor on its node again, counting on.
const NVIDIA_IN_A_NAMESPACE: &str = r#"
set -eu
py=$1 gc=$2 work=$3
d=$(mktemp -d)
mount -t tmpfs -o mode=755 tmpfs "$d"
cp -a /dev/null /dev/zero /dev/full /dev/random /dev/urandom "$d"/
ln -s /proc/self/fd "$d"/fd
mkdir "$d"/pts "$d"/shm
mount --bind /dev/pts "$d"/pts
mount --bind /dev/shm "$d"/shm
mkdir "$d"/nvidia-caps
for n in nvidiactl nvidia0 nvidia-uvm nvidia-caps/nvidia-cap1 nvidia-caps/nvidia-cap2; do
    mknod "$d"/$n c 10 229
done
mount --move "$d" /dev
cat > "$work"/holder.py <<'PY'
import os, sys, time
# Descriptors inherited from outside (a harness's) name files of the host's /dev, which this namespace
# hides from CRIU.
os.closerange(3, 4096)
layout = {9: "nvidiactl", 10: "nvidia0", 11: "nvidia-uvm", 12: "nvidia-caps/nvidia-cap1",
          13: "nvidia-caps/nvidia-cap2", 14: "nvidia-uvm", 15: "nvidia0", 16: "nvidia0", 17: "nvidia0"}
for fd, node in layout.items():
    f = os.open("/dev/" + node, os.O_RDWR)
    os.dup2(f, fd)
    os.close(f)
n = 0
while True:
    n += 1
    ok = all(os.readlink("/proc/self/fd/%d" % fd) == "/dev/" + node for fd, node in layout.items())
    with open(sys.argv[1] + ".tmp", "w") as s:
        s.write("%d %d\n" % (n, ok))
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(0.02)
PY
pid=$(setsid "$py" "$work"/holder.py "$work"/state </dev/null >/dev/null 2>&1 & echo $!)
trap 'kill -9 $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -s "$work"/state ] && break; sleep 0.05; done
"$gc" checkpoint --pid "$pid" --storage "$work"/store --format json > "$work"/checkpoint.json
at=$(cut -d' ' -f1 "$work"/state)
for _ in $(seq 200); do [ -e /proc/$pid ] || break; sleep 0.05; done
rm "$work"/state
id=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$work"/checkpoint.json)
restored=$("$gc" restore "$id" --storage "$work"/store)
for _ in $(seq 100); do [ -s "$work"/state ] && [ "$(cut -d' ' -f1 "$work"/state)" -gt "$at" ] && break; sleep 0.05; done
echo "at=$at restored=$restored state=$(cat "$work"/state) link=$(readlink /proc/$restored/fd/9) uvm=$(readlink /proc/$restored/fd/14)"
"#;

#[test]
fn nvidia_node_without_a_context_is_reopened_without_a_flag() {
    let Some(py) = ready() else { return };
    if !Path::new("/usr/bin/unshare").exists() && !Path::new("/bin/unshare").exists() {
        missing::<()>("unshare (util-linux) missing");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("nvidia.sh");
    std::fs::write(&script, NVIDIA_IN_A_NAMESPACE).unwrap();
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "bash"])
        .arg(&script)
        .arg(&py)
        .arg(gc_bin())
        .arg(dir.path())
        .output()
        .expect("run unshare");
    let said = text(&out.stdout);
    assert!(out.status.success(), "{said}\n{}", text(&out.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("checkpoint.json")).unwrap())
            .unwrap();
    assert_eq!(v["devices"][0]["path"], "/dev/nvidiactl", "{v}");
    // One record per open file (nine descriptors, nine opens), every node.
    let paths: std::collections::BTreeSet<&str> =
        strings(&v["devices"], "path").into_iter().collect();
    assert_eq!(v["devices"].as_array().map(Vec::len), Some(9), "{v}");
    assert_eq!(
        paths.into_iter().collect::<Vec<_>>(),
        [
            "/dev/nvidia-caps/nvidia-cap1",
            "/dev/nvidia-caps/nvidia-cap2",
            "/dev/nvidia-uvm",
            "/dev/nvidia0",
            "/dev/nvidiactl"
        ]
    );
    // No CUDA context: nothing for the GPU step.
    assert_eq!(v["strategy"], "none", "{v}");
    assert!(v["gpu"].is_null(), "{v}");
    let field = |k: &str| {
        said.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{k}=")))
            .unwrap_or_else(|| panic!("{k} in {said}"))
            .to_string()
    };
    let at: u64 = field("at").parse().unwrap();
    let n: u64 = field("state").parse().unwrap();
    assert!(n > at, "the copy counts on from {at}: {said}");
    assert!(
        said.contains(" 1 link=/dev/nvidiactl uvm=/dev/nvidia-uvm"),
        "{said}"
    );
    let restored: i32 = field("restored").parse().unwrap();
    kill_tree_and_wait_free(restored);
}
