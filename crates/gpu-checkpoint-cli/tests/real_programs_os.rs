//! Real programs and kernel objects (issue 28), each checkpointed with `gpu-checkpoint checkpoint` and
//! restored with `gpu-checkpoint restore`, in both modes (stopped, and `--leave-running` with the original
//! killed before its copy is restored), and through plain CRIU 4.2.1 in the same test (`Via`: its failures
//! are printed loudly, ours fail the test):
//!
//! - tmux: a server with a pane counting and a pane running `cat`; the count goes on, typed keys reach
//!   `cat`. With an interactive shell in a pane (which opens `/dev/tty`), CRIU cannot dump it ("ctty
//!   inheritance detected": it meets the server's master of that terminal first): refused before anything
//!   is touched, tmux going on.
//! - inotify, an eventfd, a pseudo-terminal pair and 64 threads in one Python process: every one works
//!   after the restore.
//! - A process that is PID 1 of its own PID namespace (`unshare --fork --pid setsid PROGRAM`): restored
//!   into a new namespace, as `criu restore` does (new PID here, 1 there), counting on. Without `setsid`
//!   its session leader is outside the namespace: refused before anything is touched.
//! - A deleted binary over CRIU's 1 MiB ghost limit (a copy of the Python interpreter): refused naming
//!   `--ghost-limit`, restored with it.
//! - An 8 TiB `PROT_NONE` reservation (what MariaDB 11's InnoDB makes for `innodb_buffer_pool_size_max`):
//!   the default and streamed restores, which need CRIU to premap it writable, become staged where the
//!   overcommit policy would refuse that (`vm.overcommit_memory=0`), and the process comes back.
//! - 2 GiB of memory (the `memory` workload), its checksum verified after the restore.
//! - Refusals, the program running on: `/dev/tty` held where CRIU sees "ctty inheritance", another user's
//!   process without `CAP_SYS_RESOURCE`, a root that does not lead its session (`--shell-job`).
//!
//! Needs root, CRIU, tmux, python3 and util-linux's `unshare` and `setpriv` (`scripts/setup.sh` installs
//! the packages): fails in CI without them, skips locally with the reason.

mod common;

use std::path::Path;
use std::process::Command;

use common::programs::*;
use common::*;

/// The JSON object of the last report since the mark, once there is one.
fn last_json(report: &Report) -> Option<serde_json::Value> {
    serde_json::from_str(&report.last()?).ok()
}

/// Waits until the report's `key` is at least `at_least`; the last report.
fn reported_past(report: &Report, key: &str, at_least: u64, what: &str) -> serde_json::Value {
    let mut last = None;
    wait_for_or(
        what,
        || {
            last = last_json(report).filter(|v| v[key].as_u64().is_some_and(|n| n >= at_least));
            last.is_some()
        },
        || format!("the last report: {:?}", report.last()),
    );
    last.unwrap()
}

/// Held by the tests that make pseudo-terminals, one at a time: CRIU restores a pty at the index it had
/// (opening `/dev/ptmx` until it gets it), which fails when another pty has taken that index meanwhile;
/// tests of this file run in parallel otherwise.
fn terminals() -> std::sync::MutexGuard<'static, ()> {
    static TERMINALS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TERMINALS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Kills the tree at a PID learnt after the start (a restored copy, a daemonized server) on drop.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let pids: Vec<i32> = gpu_checkpoint::proc::process_tree(self.0)
            .iter()
            .map(|p| p.pid)
            .collect();
        gpu_checkpoint::proc::kill_tree(&pids, std::time::Duration::from_secs(5));
    }
}

// ---------------------------------------------------------------------------------------------------
// tmux

/// `tmux -S SOCKET ARGS...`, which must succeed: its stdout.
fn tmux(bin: &Path, sock: &Path, args: &[&str]) -> String {
    let out = Command::new(bin)
        .arg("-S")
        .arg(sock)
        .args(args)
        .output()
        .expect("run tmux");
    assert!(out.status.success(), "tmux {args:?}: {}", text(&out.stderr));
    text(&out.stdout)
}

/// The highest `tick N` the counting pane shows.
fn ticks(bin: &Path, sock: &Path) -> u64 {
    tmux(bin, sock, &["capture-pane", "-p", "-t", "t:0"])
        .lines()
        .filter_map(|l| l.strip_prefix("tick ")?.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

/// A tmux server on socket `sock`: window 0 counting, window 1 running `second` (`cat`, or an
/// interactive `sh`); its PID, whose tree is killed when the guard goes (also should this panic).
fn start_tmux(bin: &Path, sock: &Path, second: &str) -> KillOnDrop {
    let count = "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.1; done";
    tmux(
        bin,
        sock,
        &[
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-s",
            "t",
            "-x",
            "80",
            "-y",
            "24",
            "sh",
            "-c",
            count,
        ],
    );
    let server = KillOnDrop(
        tmux(bin, sock, &["display", "-p", "#{pid}"])
            .trim()
            .parse()
            .unwrap(),
    );
    tmux(bin, sock, &["new-window", "-t", "t:", second]);
    wait_for("the pane counting", || ticks(bin, sock) >= 5);
    server
}

fn tmux_round(via: Via, mode: Mode, bin: &Path) {
    let work = tempfile::tempdir().unwrap();
    let sock = work.path().join("tmux.sock");
    let guard = start_tmux(bin, &sock, "cat");
    let server = guard.0;

    // The count the checkpoint holds is at least this (the server is gone once it is taken).
    let at = ticks(bin, &sock);
    let taken = via.checkpoint(mode, server, work.path(), &[], || {
        wait_for("the original's pane counting on", || ticks(bin, &sock) > at);
    });
    taken.restore(server, &[]);

    wait_for("the restored pane counting on", || {
        ticks(bin, &sock) > at + 5
    });
    tmux(
        bin,
        &sock,
        &["send-keys", "-t", "t:1", "marker-42", "Enter"],
    );
    wait_for("the restored cat echoing what was typed", || {
        tmux(bin, &sock, &["capture-pane", "-p", "-t", "t:1"])
            .lines()
            .filter(|l| l.trim() == "marker-42")
            .count()
            == 2
    });
}

fn tmux_server(mode: Mode) {
    let Some(bin) = program("tmux", "tmux") else {
        return;
    };
    let _terminals = terminals();
    Via::each(&format!("a tmux server with two panes, {mode}"), |via| {
        tmux_round(via, mode, &bin)
    });
}

both_modes!(tmux_server:
    tmux_comes_back_with_its_panes,
    tmux_comes_back_with_its_panes_after_a_leave_running_checkpoint);

/// An interactive shell in a pane opens `/dev/tty`; CRIU restores it only through the first descriptor
/// of that terminal it meets, which is the server's master: "ctty inheritance detected" after the freeze.
/// Refused before anything is touched, naming the cause; tmux counts on.
#[test]
fn tmux_with_an_interactive_shell_is_refused_and_goes_on() {
    let Some(bin) = program("tmux", "tmux") else {
        return;
    };
    let _terminals = terminals();
    let work = tempfile::tempdir().unwrap();
    let sock = work.path().join("tmux.sock");
    let guard = start_tmux(&bin, &sock, "sh");
    let server = guard.0;
    refused(
        "tmux with an interactive shell",
        server,
        &[],
        &["terminal", "ctty inheritance"],
    );
    let at = ticks(&bin, &sock);
    wait_for("tmux counting on", || ticks(&bin, &sock) > at + 3);
}

// ---------------------------------------------------------------------------------------------------
// Kernel objects: inotify, eventfd, a pty pair, many threads

/// Watches a folder with inotify (counting the events it reads), passes a count through an eventfd,
/// bytes through a pseudo-terminal pair (raw mode: master to slave), and runs 64 threads, each counting;
/// reports all of it each round ([`REPORT_PY`]).
const KERNEL_OBJECTS: &str = r#"
import ctypes, json, os, select, struct, sys, threading, time, tty
watched, report = sys.argv[1], reporter(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
ino = libc.inotify_init1(os.O_NONBLOCK)
assert ino >= 0 and libc.inotify_add_watch(ino, watched.encode(), 0x100 | 0x2) >= 0
efd = os.eventfd(0, os.EFD_NONBLOCK)
master, slave = os.openpty()
tty.setraw(slave)
THREADS = 64
counts = [0] * THREADS
def work(i):
    while True:
        counts[i] += 1
        time.sleep(0.01)
for i in range(THREADS):
    threading.Thread(target=work, args=(i,), daemon=True).start()
events = passed = through_pty = rounds = 0
while True:
    rounds += 1
    try:
        data = os.read(ino, 65536)
        at = 0
        while at < len(data):
            events += 1
            at += 16 + struct.unpack_from("iIII", data, at)[3]
    except BlockingIOError:
        pass
    os.eventfd_write(efd, 3)
    passed += os.eventfd_read(efd)
    os.write(master, b"ping")
    if select.select([slave], [], [], 1)[0]:
        through_pty += len(os.read(slave, 64))
    report(json.dumps({"rounds": rounds, "events": events, "eventfd": passed, "pty": through_pty,
                       "threads": threading.active_count(), "slowest": min(counts)}))
    time.sleep(0.02)
"#;

fn kernel_objects_round(via: Via, mode: Mode, py: &Path) {
    let work = tempfile::tempdir().unwrap();
    let watched = work.path().join("watched");
    std::fs::create_dir(&watched).unwrap();
    let (p, report) = Program::python(
        py,
        work.path(),
        "objects",
        KERNEL_OBJECTS,
        &[watched.as_os_str()],
    );
    // The watch exists once the program reports.
    reported_past(&report, "rounds", 1, "the program's first round");
    std::fs::write(watched.join("before"), b"1").unwrap();
    let started = reported_past(&report, "events", 1, "the first inotify event");
    assert_eq!(started["threads"], 65, "{started}");

    let taken = via.checkpoint(mode, p.pid, work.path(), &[], || {
        let r = last_json(&report).unwrap();
        reported_past(
            &report,
            "rounds",
            r["rounds"].as_u64().unwrap() + 5,
            "the original on",
        );
    });
    let at = last_json(&report).unwrap();
    report.mark();
    taken.restore(p.pid, &[]);

    let rounds = at["rounds"].as_u64().unwrap();
    let resumed = reported_past(&report, "rounds", rounds + 5, "the restored copy going on");
    std::fs::write(watched.join("after"), b"2").unwrap();
    let events = at["events"].as_u64().unwrap();
    let after = reported_past(&report, "events", events + 1, "inotify after the restore");
    for key in ["eventfd", "pty", "slowest"] {
        assert!(
            after[key].as_u64() > at[key].as_u64(),
            "{key} went on after the restore: {at} -> {after}"
        );
    }
    assert_eq!(resumed["threads"], 65, "every thread back: {resumed}");
    assert_eq!(
        after["eventfd"].as_u64().unwrap() % 3,
        0,
        "the eventfd passes whole counts: {after}"
    );
}

fn kernel_objects(mode: Mode) {
    let Some(py) = python() else { return };
    let _terminals = terminals();
    Via::each(
        &format!("inotify, eventfd, a pty pair and 64 threads, {mode}"),
        |via| kernel_objects_round(via, mode, &py),
    );
}

both_modes!(kernel_objects:
    inotify_eventfd_ptys_and_threads_work_after_the_restore,
    inotify_eventfd_ptys_and_threads_work_after_a_leave_running_checkpoint);

// ---------------------------------------------------------------------------------------------------
// A PID namespace's init

/// Counts, reporting its PID as it sees it (1 in a namespace of its own) ([`REPORT_PY`]).
const COUNTER: &str = r#"
import json, os, sys, time
report, n = reporter(sys.argv[1]), 0
while True:
    n += 1
    report(json.dumps({"n": n, "pid": os.getpid()}))
    time.sleep(0.02)
"#;

/// `unshare --fork --pid [setsid] PY COUNTER LOG`: unshare, and the namespace's init (its child).
fn start_in_pid_namespace(py: &Path, dir: &Path, setsid: bool) -> (Program, i32, Report) {
    let script = dir.join("counter.py");
    std::fs::write(&script, [REPORT_PY, COUNTER].concat()).unwrap();
    let report = Report::new(dir.join("counter.log"));
    let mut argv: Vec<&std::ffi::OsStr> =
        ["unshare", "--fork", "--pid"].map(|a| a.as_ref()).to_vec();
    if setsid {
        argv.push("setsid".as_ref());
    }
    argv.extend([py.as_os_str(), script.as_os_str(), report.path.as_os_str()]);
    let p = Program::start(&argv);
    reported_past(&report, "n", 3, "the namespace's init counting");
    let init = children(p.pid);
    assert_eq!(init.len(), 1, "unshare has the init as its child");
    (p, init[0], report)
}

/// Without `setsid`, the init's session leader is `unshare`, outside its namespace: CRIU fails after
/// the freeze ("A session leader of N(1) is outside of its pid namespace"); refused before, counting on.
#[test]
fn a_pid_namespace_init_whose_session_is_outside_is_refused() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let (_unshare, init, report) = start_in_pid_namespace(&py, work.path(), false);
    refused(
        "a PID namespace's init in unshare's session",
        init,
        &[],
        &["pid-namespace", "setsid"],
    );
    let n = last_json(&report).unwrap()["n"].as_u64().unwrap();
    reported_past(&report, "n", n + 3, "the init counting on");
}

fn pid_namespace_round(via: Via, mode: Mode, py: &Path) {
    let work = tempfile::tempdir().unwrap();
    let (_unshare, init, report) = start_in_pid_namespace(py, work.path(), true);
    assert_eq!(last_json(&report).unwrap()["pid"], 1);

    let taken = via.checkpoint(mode, init, work.path(), &[], || {
        let n = last_json(&report).unwrap()["n"].as_u64().unwrap();
        reported_past(&report, "n", n + 5, "the original counting on");
    });
    let at = last_json(&report).unwrap()["n"].as_u64().unwrap();
    report.mark();
    let restored = taken.restore_as(&[], &[]);
    let _guard = KillOnDrop(restored);

    let v = reported_past(&report, "n", at + 5, "the restored init counting on");
    assert_eq!(v["pid"], 1, "PID 1 of its namespace again: {v}");
    let status = std::fs::read_to_string(format!("/proc/{restored}/status")).unwrap();
    let nspid = status.lines().find(|l| l.starts_with("NSpid:")).unwrap();
    assert!(
        nspid.split_whitespace().last() == Some("1"),
        "{restored} is init of a new namespace: {nspid}"
    );
}

both_modes!("the init of its own PID namespace", python(), pid_namespace_round;
    a_pid_namespace_init_is_restored_into_a_new_namespace,
    a_pid_namespace_init_is_restored_into_a_new_namespace_after_a_leave_running_checkpoint);

// ---------------------------------------------------------------------------------------------------
// A deleted binary

/// The `counter` workload run from a copy of the workload binary (a debug build: well over 1 MiB),
/// deleted once it runs; the copy's size.
fn deleted_counter(dir: &Path) -> (Workload, u64) {
    let copy = dir.join("workload-copy");
    std::fs::copy(workload_bin(), &copy).unwrap();
    let size = std::fs::metadata(&copy).unwrap().len();
    let state = dir.join("counter.state");
    let out = Command::new(&copy)
        .arg("counter")
        .arg("--state")
        .arg(&state)
        .arg("--detach")
        .output()
        .expect("start the copy");
    assert!(out.status.success(), "{out:?}");
    let pid = text(&out.stdout)
        .trim()
        .parse()
        .expect("the copy prints its pid");
    let w = Workload { pid, state };
    w.wait_state("the copy counting", |r| {
        r.len() == 1 && num(&r[0], "seq") >= 3
    });
    std::fs::remove_file(&copy).unwrap();
    (w, size)
}

fn deleted_binary_round(via: Via, mode: Mode, limit: &str) {
    let work = tempfile::tempdir().unwrap();
    let (w, _) = deleted_counter(work.path());
    let taken = via.checkpoint(mode, w.pid, work.path(), &["--ghost-limit", limit], || {
        let seq = num(&w.wait_state("counting", |r| r.len() == 1)[0], "seq");
        w.wait_state("the original counting on", |r| {
            r.len() == 1 && num(&r[0], "seq") > seq
        });
    });
    w.blank_state();
    taken.restore(w.pid, &[]);
    let first = num(
        &w.wait_state("the copy's first count", |r| r.len() == 1)[0],
        "seq",
    );
    w.wait_state("the restored copy counting on", |r| {
        r.len() == 1 && num(&r[0], "seq") > first + 3
    });
    let exe = std::fs::read_link(format!("/proc/{}/exe", w.pid)).unwrap();
    assert!(
        exe.to_string_lossy().ends_with("(deleted)"),
        "it runs its deleted binary: {exe:?}"
    );
}

/// A binary deleted while it runs: over 1 MiB, CRIU copies it into the images only with
/// `--ghost-limit`, and fails after the freeze without ("Can't dump ghost file"); refused before anything
/// is touched, naming the flag (as for an open deleted file), and restored with it.
#[test]
fn a_deleted_binary_is_refused_without_ghost_limit_and_comes_back_with_it() {
    if !criu_ready() {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let (w, size) = deleted_counter(work.path());
    assert!(size > 1 << 20, "the binary is over 1 MiB: {size}");
    let limit = format!("{}M", (size >> 20) + 2);
    refused(
        "a deleted binary",
        w.pid,
        &[],
        &["--ghost-limit", "workload-copy"],
    );
    drop(w);
    for mode in [Mode::Stop, Mode::LeaveRunning] {
        Via::each(&format!("a deleted binary, {mode}"), |via| {
            deleted_binary_round(via, mode, &limit)
        });
    }
}

// ---------------------------------------------------------------------------------------------------
// A reservation larger than memory

/// Reserves 8 TiB of address space `PROT_NONE` (MariaDB 11's InnoDB reserves as much for
/// `innodb_buffer_pool_size_max`), then counts ([`REPORT_PY`]).
const RESERVATION: &str = r#"
import ctypes, json, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
MAP_PRIVATE, MAP_ANONYMOUS = 0x02, 0x20
base = libc.mmap(None, 8 << 40, 0, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
report, n = reporter(sys.argv[1]), 0
while True:
    n += 1
    report(json.dumps({"n": n, "base": base}))
    time.sleep(0.02)
"#;

fn reservation_round(via: Via, mode: Mode, py: &Path) {
    let work = tempfile::tempdir().unwrap();
    let (p, report) = Program::python(py, work.path(), "reserve", RESERVATION, &[]);
    let base = reported_past(&report, "n", 3, "the reservation made")["base"].clone();

    let taken = via.checkpoint(mode, p.pid, work.path(), &[], || {
        let n = last_json(&report).unwrap()["n"].as_u64().unwrap();
        reported_past(&report, "n", n + 3, "the original counting on");
    });
    // The default restore, then (ours) the streamed one: both need CRIU's premap.
    let restores: &[&[&str]] = match via {
        Via::Plain => &[&[]],
        Via::Ours => &[&[], &["--stream"]],
    };
    for (i, flags) in restores.iter().enumerate() {
        if i > 0 {
            kill_tree_and_wait_free(p.pid);
        }
        let at = last_json(&report).unwrap()["n"].as_u64().unwrap();
        report.mark();
        assert_eq!(taken.restore_as(&[], flags), p.pid, "{flags:?}");
        let v = reported_past(&report, "n", at + 5, "the restored copy counting on");
        assert_eq!(v["base"], base, "the same reservation");
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", p.pid)).unwrap();
        let start = format!("{:x}-", base.as_u64().unwrap());
        assert!(
            maps.lines()
                .any(|l| l.starts_with(&start) && l.contains(" ---p ")),
            "the 8 TiB reservation is back, PROT_NONE, at {start}"
        );
    }
}

fn reservation(mode: Mode) {
    let Some(py) = python() else { return };
    let policy = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
    if policy.trim() != "0" {
        // Still run: the restores must work under any policy; only 0 made them fail before.
        eprintln!(
            "vm.overcommit_memory is {policy}: the heuristic policy (0) is the case at stake"
        );
    }
    Via::each(&format!("an 8 TiB PROT_NONE reservation, {mode}"), |via| {
        reservation_round(via, mode, &py)
    });
}

both_modes!(reservation:
    an_8_tib_reservation_comes_back_through_the_default_and_streamed_restores,
    an_8_tib_reservation_comes_back_after_a_leave_running_checkpoint);

// ---------------------------------------------------------------------------------------------------
// 2 GiB of memory

fn memory_round(via: Via, mode: Mode) {
    let work = tempfile::tempdir().unwrap();
    let (w, checksum) = memory_workload(work.path(), "2048");
    let taken = via.checkpoint(mode, w.pid, work.path(), &[], || {
        assert!(w.alive(), "the original runs on");
    });
    w.blank_state();
    taken.restore(w.pid, &[]);
    let after = w.wait_state("the restored 2 GiB re-verified", |r| {
        r.len() == 1 && num(&r[0], "verified") >= 1 && r[0]["checksum"] == checksum
    });
    assert_eq!(after[0]["checksum"], checksum);
}

/// 2 GiB through both tools in both modes: about a minute here, so in the long lane
/// (`GPU_CHECKPOINT_LONG_TESTS=1`, `scripts/test.sh --long`); 1 GiB is in CI's (`criu.rs`).
#[test]
fn two_gib_of_memory_come_back_verified() {
    if std::env::var("GPU_CHECKPOINT_LONG_TESTS").as_deref() != Ok("1") {
        eprintln!("SKIPPED: the long lane's (GPU_CHECKPOINT_LONG_TESTS=1)");
        return;
    }
    if !criu_ready() {
        return;
    }
    for mode in [Mode::Stop, Mode::LeaveRunning] {
        Via::each(&format!("2 GiB of memory, {mode}"), |via| {
            memory_round(via, mode)
        });
    }
}

// ---------------------------------------------------------------------------------------------------
// Refusals

/// Holds a pseudo-terminal as a shell would and has a child that opens `/dev/tty` without holding the
/// terminal itself; prints the child's PID, then counts (the child too, [`REPORT_PY`]).
const CTTY: &str = r#"
import json, os, pty, sys, time
pid, master = pty.fork()
if pid == 0:
    report = reporter(sys.argv[1])
    child = os.fork()
    if child == 0:
        fd = os.open("/dev/tty", os.O_RDWR)
        for f in (0, 1, 2):
            os.close(f)
        n = 0
        while True:
            n += 1
            report(json.dumps({"n": n, "pid": os.getpid()}))
            time.sleep(0.02)
    while True:
        time.sleep(1)
while True:
    try:
        os.read(master, 1024)
    except OSError:
        time.sleep(0.1)
"#;

/// A session whose terminal one process holds while its child holds `/dev/tty`: CRIU fails after the
/// freeze ("ctty inheritance detected", even as a shell job); refused before anything is touched, naming
/// the cause, and the child counts on.
#[test]
fn dev_tty_held_apart_from_its_terminal_is_refused() {
    let Some(py) = python() else { return };
    let _terminals = terminals();
    let work = tempfile::tempdir().unwrap();
    let script = work.path().join("ctty.py");
    std::fs::write(&script, [REPORT_PY, CTTY].concat()).unwrap();
    let report = Report::new(work.path().join("ctty.log"));
    let p = Program::start(&[py.as_os_str(), script.as_os_str(), report.path.as_os_str()]);
    let child = reported_past(&report, "n", 3, "the child counting")["pid"]
        .as_i64()
        .unwrap() as i32;
    let session = gpu_checkpoint::proc::process_tree(p.pid)
        .iter()
        .find(|t| t.ppid == p.pid)
        .expect("the session's leader")
        .pid;
    assert_eq!(children(session), [child]);
    // The session's terminal master is the python above it: a shell job.
    refused(
        "/dev/tty apart from its terminal",
        session,
        &["--shell-job"],
        &["terminal", "ctty inheritance"],
    );
    let n = last_json(&report).unwrap()["n"].as_u64().unwrap();
    reported_past(&report, "n", n + 3, "the child counting on");
}

/// Another user's process (nobody's `sleep`), where this machine lacks `CAP_SYS_RESOURCE` (the test
/// machines do): CRIU cannot read its limits ("Can't get rlimit"); refused before anything is touched,
/// and it runs on, and `doctor` warns. With the capability it is checkpointed.
#[test]
fn another_users_process_without_cap_sys_resource_is_refused() {
    let Some(setpriv) = program("setpriv", "util-linux") else {
        return;
    };
    let p = Program::start(&[
        setpriv.as_os_str(),
        "--reuid=65534".as_ref(),
        "--regid=65534".as_ref(),
        "--clear-groups".as_ref(),
        "sleep".as_ref(),
        "1000".as_ref(),
    ]);
    wait_for("nobody's sleep", || {
        std::fs::read_to_string(format!("/proc/{}/status", p.pid))
            .is_ok_and(|s| s.contains("Uid:\t65534"))
    });
    if gpu_checkpoint::detect::limits::has_cap_sys_resource() {
        let work = tempfile::tempdir().unwrap();
        let ck = checkpoint(p.pid, &work.path().join("store"), &["--leave-running"]);
        assert_eq!(ck["stopped"], false);
        return;
    }
    refused(
        "another user's process",
        p.pid,
        &[],
        &["other-user", "CAP_SYS_RESOURCE"],
    );
    // doctor says so too, rather than criu check's "Looks good." alone.
    let doctor = gc(&["doctor", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&doctor.stdout).unwrap();
    assert_eq!(v["cap_sys_resource"], false, "{v}");
    assert!(
        v["warnings"][0]
            .as_str()
            .is_some_and(|w| w.contains("CAP_SYS_RESOURCE") && w.contains("Can't get rlimit")),
        "{v}"
    );
}

/// A process that does not lead its session (started in the background by a shell that does): CRIU
/// fails after the freeze ("The root process N is not a session leader"); refused before anything is
/// touched, naming `--shell-job`; with it, checkpointed and restored like the rest. The shell is made a
/// session leader here (`setsid`) whatever session the test runs in: a CI job's may begin outside its
/// PID namespace, which CRIU refuses even with `--shell-job` (refused as such, see detect/limits.rs).
#[test]
fn a_process_that_does_not_lead_its_session_needs_shell_job() {
    let Some(py) = python() else { return };
    let work = tempfile::tempdir().unwrap();
    let script = work.path().join("counter.py");
    std::fs::write(&script, [REPORT_PY, COUNTER].concat()).unwrap();
    let report = Report::new(work.path().join("counter.log"));
    let mut child = Command::new("setsid")
        .args([
            "sh",
            "-c",
            "\"$0\" \"$@\" </dev/null >/dev/null 2>&1 & echo $!; exec >&-; wait",
        ])
        .arg(&py)
        .arg(&script)
        .arg(&report.path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let pid: i32 = line.trim().parse().expect("the counter's PID");
    reported_past(&report, "n", 3, "the child counting");
    refused("not a session leader", pid, &[], &["--shell-job"]);
    let ck = checkpoint(
        pid,
        &work.path().join("store"),
        &["--shell-job", "--leave-running"],
    );
    assert_eq!(ck["stopped"], false, "{ck}");
    assert!(runs(pid));
    // SAFETY: signalling the counter this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = child.wait();
    let _ = child.kill();
    let _ = child.wait();
}
