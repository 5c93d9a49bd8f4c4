//! Shared by the tests of real programs (`criu_options.rs`, `real_programs.rs`, `cow.rs`): programs
//! started as services, the two checkpoint modes, and the same round through plain CRIU run by hand, so
//! that a difference between CRIU and gpu-checkpoint shows up as gpu-checkpoint's failure.

use std::ffi::OsStr;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gpu_checkpoint::proc as tree;

use super::{checkpoint, criu_ready, text, wait_pid_free};

/// In CI (`CI=true`) a missing component fails the test; locally the test is skipped with the reason.
pub fn missing<T>(why: &str) -> Option<T> {
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{why} (scripts/setup.sh installs what the tests need; CI runs it)")
    }
    eprintln!("SKIPPED: {why}");
    None
}

/// The program `name` (from Debian's `package`, which `scripts/setup.sh` installs), when root and CRIU
/// are there too; missing, like [`criu_ready`], it fails the test in CI and skips it locally.
pub fn program(name: &str, package: &str) -> Option<PathBuf> {
    if !criu_ready() {
        return None;
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/sbin", "/bin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file());
    match found {
        Some(p) => Some(p),
        None => missing(&format!(
            "{name} not found (Debian package {package}; scripts/setup.sh installs it)"
        )),
    }
}

/// The Python interpreter itself (not a wrapper script: what CRIU restores is the interpreter), with
/// the modules the tests use (sqlite3, multiprocessing), when root and CRIU are there too; like
/// [`criu_ready`], its absence fails in CI and skips locally.
pub fn python() -> Option<PathBuf> {
    static PY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    if !criu_ready() {
        return None;
    }
    let found = PY.get_or_init(|| {
        let out = Command::new("python3")
            .args([
                "-c",
                "import sqlite3, multiprocessing.sharedctypes, sys; print(sys.executable)",
            ])
            .output()
            .map_err(|e| format!("python3: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "python3 without sqlite3 or multiprocessing: {}",
                text(&out.stderr)
            ));
        }
        Ok(PathBuf::from(text(&out.stdout).trim()))
    });
    match found {
        Ok(p) => Some(p.clone()),
        Err(why) => missing(&format!("the tests of real programs need python3: {why}")),
    }
}

/// Python defining `reporter(path)`: a program's progress, one line a round, appended to a log it holds
/// open for its whole life (`O_WRONLY | O_APPEND`, one `write` a line). Read with [`Report`].
///
/// Not a temporary file renamed over a state file each round: a `--leave-running` checkpoint can catch
/// the program with that file open, or written but not yet renamed, and the original, running on, then
/// renames it away. Its copy, restored later, needs a file that is gone: CRIU cannot reopen it (the
/// restore fails), or the copy's rename fails and it dies (a copy that never reported, seen in CI). A
/// log stays where it is, and CRIU reopens it without checking its size, since logs grow.
pub const REPORT_PY: &str = r#"
import os as _os
def reporter(path):
    fd = _os.open(path, _os.O_WRONLY | _os.O_APPEND | _os.O_CREAT, 0o600)
    def report(line):
        _os.write(fd, (line + "\n").encode())
    return report
"#;

/// The log a program writes through [`REPORT_PY`]: its last line since a mark.
pub struct Report {
    pub path: PathBuf,
    /// Lines before this offset do not count (the original's, before its copy was restored).
    from: std::cell::Cell<u64>,
}

impl Report {
    pub fn new(path: PathBuf) -> Report {
        Report {
            path,
            from: std::cell::Cell::new(0),
        }
    }

    /// The last whole line written since the mark; `None` before the first.
    pub fn last(&self) -> Option<String> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&self.path).ok()?;
        let len = f.metadata().ok()?.len();
        // A line is well under 64 KiB: the tail holds the last one whole.
        let start = self.from.get().max(len.saturating_sub(64 << 10));
        f.seek(SeekFrom::Start(start)).ok()?;
        let mut tail = Vec::new();
        f.take(len - start).read_to_end(&mut tail).ok()?;
        let end = tail.iter().rposition(|&b| b == b'\n')?;
        let begin = tail[..end]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        Some(String::from_utf8_lossy(&tail[begin..end]).into_owned())
    }

    /// From now on only lines written after this call count: with the original gone, what shows next
    /// comes from its restored copy.
    pub fn mark(&self) {
        self.from
            .set(std::fs::metadata(&self.path).map_or(0, |m| m.len()));
    }
}

/// A free TCP port on 127.0.0.1 (the kernel's choice, released for the program to take).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Waits up to 30 s for `what` to hold.
pub fn wait_for(what: &str, ok: impl FnMut() -> bool) {
    wait_for_or(what, ok, String::new);
}

/// [`wait_for`], with `report()` in the failure's message: what the program was doing when it timed
/// out (a flake seen once in CI is only understood from what it left in the log).
pub fn wait_for_or(what: &str, mut ok: impl FnMut() -> bool, report: impl FnOnce() -> String) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        if Instant::now() >= deadline {
            panic!("timed out waiting for {what}\n{}", report());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Every thread of the tree at `pid`: state, wait channel, the system call it sits in and its kernel
/// stack, for a failure's message.
pub fn tree_report(pid: i32) -> String {
    let read = |p: String| {
        std::fs::read_to_string(p)
            .unwrap_or_else(|e| format!("({e})"))
            .trim()
            .to_string()
    };
    let mut out = format!("the tree of {pid}:\n");
    for p in tree::process_tree(pid) {
        let tasks: Vec<i32> = std::fs::read_dir(format!("/proc/{}/task", p.pid))
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        out += &format!("  {} (parent {}) {:?}\n", p.pid, p.ppid, p.cmdline);
        for t in tasks {
            let dir = format!("/proc/{}/task/{t}", p.pid);
            // A thread's own `/proc/TID/stat` is its line, as the process's is.
            let state = tree::stat(t).map_or('?', |s| s.state);
            out += &format!(
                "    task {t}: state {state} wchan {} syscall {}\n      {}\n",
                read(format!("{dir}/wchan")),
                read(format!("{dir}/syscall")),
                read(format!("{dir}/stack")).replace('\n', "\n      ")
            );
        }
    }
    out
}

/// Whether `pid` runs: not stopped (CRIU's leave_stopped), not exiting, not gone.
pub fn runs(pid: i32) -> bool {
    tree::stat(pid).is_some_and(|s| !s.is_dying() && s.state != 'T')
}

/// The children of `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    let mut kids: Vec<i32> = tree::process_tree(pid)
        .iter()
        .filter(|p| p.ppid == pid)
        .map(|p| p.pid)
        .collect();
    kids.sort();
    kids
}

/// Kills the tree at `pid` and waits until its PID is free (init reaps it).
pub fn kill_tree_and_wait_free(pid: i32) {
    let pids: Vec<i32> = tree::process_tree(pid).iter().map(|p| p.pid).collect();
    tree::kill_tree(&pids, Duration::from_secs(10));
    wait_pid_free(pid);
}

/// Waits until no socket of this network namespace on local port `port` is past the handshake and
/// still held by a process (inode not 0): a client's connection closed on both sides. A listening
/// socket is fine for CRIU; an established one needs `--tcp-established`.
pub fn wait_no_connections(port: u16) {
    let held = || {
        ["/proc/net/tcp", "/proc/net/tcp6"]
            .iter()
            .filter_map(|f| std::fs::read_to_string(f).ok())
            .flat_map(|t| t.lines().skip(1).map(String::from).collect::<Vec<_>>())
            .filter(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 9
                    && f[1]
                        .rsplit(':')
                        .next()
                        .and_then(|p| u16::from_str_radix(p, 16).ok())
                        == Some(port)
                    && f[3] != "0A"
                    && f[9] != "0"
            })
            .count()
    };
    wait_for(&format!("the connections to port {port} closed"), || {
        held() == 0
    });
}

/// A program started in its own session and re-parented to init, as a service is; its tree is killed
/// on drop (unless [`Program::kill_and_wait_free`] did already: its PID may be someone else's by then).
pub struct Program {
    pub pid: i32,
    done: bool,
}

impl Program {
    /// `setsid ARGV...`, its output thrown away.
    pub fn start<S: AsRef<OsStr>>(argv: &[S]) -> Program {
        let pid = super::start_detached(
            Command::new("sh")
                .arg("-c")
                .arg(r#"setsid "$@" </dev/null >/dev/null 2>&1 & echo $!"#)
                .arg("sh")
                .args(argv),
            "sh",
        );
        Program { pid, done: false }
    }

    /// Writes `script` (after [`REPORT_PY`]) to `DIR/NAME.py` and starts `PY DIR/NAME.py ARGS...
    /// DIR/NAME.log`: the program and its report.
    pub fn python(
        py: &Path,
        dir: &Path,
        name: &str,
        script: &str,
        args: &[&OsStr],
    ) -> (Program, Report) {
        let file = dir.join(format!("{name}.py"));
        std::fs::write(&file, [REPORT_PY, script].concat()).unwrap();
        let report = Report::new(dir.join(format!("{name}.log")));
        let mut argv = vec![py.as_os_str(), file.as_os_str()];
        argv.extend_from_slice(args);
        argv.push(report.path.as_os_str());
        (Program::start(&argv), report)
    }

    pub fn running(&self) -> bool {
        runs(self.pid)
    }

    pub fn kill_and_wait_free(mut self) {
        kill_tree_and_wait_free(self.pid);
        self.done = true;
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let pids: Vec<i32> = tree::process_tree(self.pid).iter().map(|p| p.pid).collect();
        tree::kill_tree(&pids, Duration::from_secs(5));
    }
}

/// The CRIU gpu-checkpoint finds, run by hand.
pub fn plain_criu(args: &[&str], dir: &Path) -> Output {
    let criu = gpu_checkpoint::dump::discover(None).expect("CRIU").path;
    Command::new(criu)
        .args(args)
        .arg("-D")
        .arg(dir)
        .args(["-v4", "-o", "criu.log"])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run criu")
}

/// CRIU's `Error` lines in `dir`'s log, for a failure message.
fn criu_errors(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("criu.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Error"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `criu dump -t PID EXTRA` into a new folder (the tree is killed after the dump, CRIU's default).
pub fn plain_dump(pid: i32, work: &Path, name: &str, extra: &[&str]) -> (Output, PathBuf) {
    let dir = work.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let pid = pid.to_string();
    let mut args = vec!["dump", "-t", &pid];
    args.extend_from_slice(extra);
    (plain_criu(&args, &dir), dir)
}

/// `criu restore -d EXTRA` from `dir`, which must succeed.
pub fn plain_restore(dir: &Path, extra: &[&str]) {
    let mut args = vec!["restore", "-d"];
    args.extend_from_slice(extra);
    let out = plain_criu(&args, dir);
    assert!(
        out.status.success(),
        "plain criu restore failed: {}\n{}",
        text(&out.stderr),
        criu_errors(dir)
    );
}

/// The two tests of one scenario: `$stop`, whose checkpoint stops the tree, and `$running`, whose
/// checkpoint leaves it running (`--leave-running`).
///
/// `both_modes!(scenario: stop, running)`: each runs `scenario(mode)`.
/// `both_modes!("what", found, round; stop, running)`: each runs `round(via, mode, &found)` for both
/// tools ([`Via::each`], `what` naming the case) with what `found` (an `Option`, a program looked up
/// with [`program`] for instance) holds; `None` ends the test (a failure in CI, skipped locally).
#[allow(unused_macros)] // not every test file that includes this module has such tests
macro_rules! both_modes {
    ($scenario:ident: $stop:ident, $running:ident) => {
        $crate::common::programs::both_modes!(@tests $scenario; $stop, $running);
    };
    ($what:literal, $found:expr, $round:path; $stop:ident, $running:ident) => {
        $crate::common::programs::both_modes!(@tests
            |mode| $crate::common::programs::rounds($what, mode, $found, |via, mode, found| {
                $round(via, mode, found)
            });
            $stop, $running);
    };
    (@tests $scenario:expr; $stop:ident, $running:ident) => {
        #[test]
        fn $stop() {
            ($scenario)($crate::common::programs::Mode::Stop);
        }

        #[test]
        fn $running() {
            ($scenario)($crate::common::programs::Mode::LeaveRunning);
        }
    };
}
#[allow(unused_imports)]
pub(crate) use both_modes;

/// [`Via::each`] of `round` in `mode` with what `found` holds; `None` ends the test (see [`both_modes`]).
pub fn rounds<T>(what: &str, mode: Mode, found: Option<T>, round: impl Fn(Via, Mode, &T)) {
    let Some(found) = found else { return };
    Via::each(&format!("{what}, {mode}"), |via| round(via, mode, &found));
}

/// How the checkpointed tree carries on: stopped (the default: killed once the checkpoint is taken,
/// to be restored), or `--leave-running` (the original keeps running; the test kills it before the
/// restore).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Stop,
    LeaveRunning,
}

impl Mode {
    /// The flags, for `gpu-checkpoint checkpoint` and `criu dump` alike.
    pub fn flags(self) -> &'static [&'static str] {
        match self {
            Mode::Stop => &[],
            Mode::LeaveRunning => &["--leave-running"],
        }
    }

    /// After the checkpoint of the tree at `pid`: stopped, its PID must come free; left running, it
    /// must run on, `going_on` checks it works, and it is killed, so that its copy can be restored.
    fn after_checkpoint(self, pid: i32, going_on: impl FnOnce()) {
        match self {
            Mode::Stop => wait_pid_free(pid),
            Mode::LeaveRunning => {
                assert!(runs(pid), "--leave-running left {pid} running");
                going_on();
                kill_tree_and_wait_free(pid);
            }
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Stop => "stop",
            Mode::LeaveRunning => "--leave-running",
        })
    }
}

/// `gpu-checkpoint checkpoint` of the tree at `pid` in `mode` with `extra`, then the original out of
/// the way ([`Mode`]); returns the checkpoint's JSON.
pub fn checkpoint_in(
    mode: Mode,
    pid: i32,
    store: &Path,
    extra: &[&str],
    going_on: impl FnOnce(),
) -> serde_json::Value {
    let mut args = mode.flags().to_vec();
    args.extend_from_slice(extra);
    let ck = checkpoint(pid, store, &args);
    assert_eq!(ck["stopped"], mode == Mode::Stop, "{ck}");
    mode.after_checkpoint(pid, going_on);
    ck
}

/// `criu dump -t PID` in `mode` with `extra` into `work/name`, which must succeed, then the original
/// out of the way ([`Mode`]); returns the images' folder.
pub fn plain_dump_in(
    mode: Mode,
    pid: i32,
    work: &Path,
    name: &str,
    extra: &[&str],
    going_on: impl FnOnce(),
) -> PathBuf {
    let mut args = mode.flags().to_vec();
    args.extend_from_slice(extra);
    let (out, dir) = plain_dump(pid, work, name, &args);
    assert!(
        out.status.success(),
        "plain criu dump failed: {}\n{}",
        text(&out.stderr),
        criu_errors(&dir)
    );
    mode.after_checkpoint(pid, going_on);
    dir
}

/// Who checkpoints and restores a program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// Plain `criu dump` / `criu restore -d`, run by hand: the reference.
    Plain,
    /// `gpu-checkpoint checkpoint` / `gpu-checkpoint restore` (the default restore).
    Ours,
}

impl fmt::Display for Via {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Via::Plain => "plain CRIU",
            Via::Ours => "gpu-checkpoint",
        })
    }
}

/// What a checkpoint left to restore from.
pub enum Taken {
    Plain(PathBuf),
    Ours {
        store: PathBuf,
        id: String,
        /// What `checkpoint --format json` said.
        ck: serde_json::Value,
    },
}

impl Via {
    /// Plain CRIU first: when gpu-checkpoint then fails, the output already says how CRIU fared.
    pub const BOTH: [Via; 2] = [Via::Plain, Via::Ours];

    /// Runs `case` for this tool. Plain CRIU's failure is reported loudly, on the test's real stderr
    /// (shown even when the test passes), and does not fail the test: the test asserts
    /// gpu-checkpoint's result, and CRIU failing here too is news about CRIU or the machine, not ours.
    /// gpu-checkpoint's failure fails the test.
    pub fn case(self, what: &str, case: impl FnOnce()) {
        match self {
            Via::Ours => case(),
            Via::Plain => {
                if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(case)) {
                    let why = e
                        .downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| e.downcast_ref::<&str>().copied())
                        .unwrap_or("(no message)");
                    let _ = writeln!(
                        std::io::stderr(),
                        "\n!!!!!!!! PLAIN CRIU FAILED: {what}\n!!!!!!!! {}\n!!!!!!!! \
                         (gpu-checkpoint's run of the same case is still asserted)\n",
                        why.replace('\n', "\n!!!!!!!! ")
                    );
                }
            }
        }
    }

    /// Runs `round` through plain CRIU, then through gpu-checkpoint, each as a [`Via::case`].
    pub fn each(what: &str, round: impl Fn(Via)) {
        for via in Via::BOTH {
            via.case(what, || round(via));
        }
    }

    /// Checkpoints the tree at `pid` in `mode` with the CRIU options `opts` (the same names for both
    /// tools) into `work` (a store, or a folder of images named after the mode); `going_on` checks the
    /// original at work after a `--leave-running` checkpoint, before it is killed.
    pub fn checkpoint(
        self,
        mode: Mode,
        pid: i32,
        work: &Path,
        opts: &[&str],
        going_on: impl FnOnce(),
    ) -> Taken {
        match self {
            Via::Plain => {
                let name = format!("plain-{}", mode.flags().join("").trim_start_matches('-'));
                Taken::Plain(plain_dump_in(mode, pid, work, &name, opts, going_on))
            }
            Via::Ours => {
                let store = work.join("store");
                let ck = checkpoint_in(mode, pid, &store, opts, going_on);
                let id = ck["id"].as_str().expect("a checkpoint id").to_string();
                Taken::Ours { store, id, ck }
            }
        }
    }
}

impl Taken {
    /// Restores the tree (detached), which must come back under `pid`; plain CRIU gets `plain_opts`
    /// (CRIU's restore needs some dump options again; gpu-checkpoint takes them from the checkpoint).
    pub fn restore(&self, pid: i32, plain_opts: &[&str]) {
        assert_eq!(
            self.restore_as(plain_opts, &[]),
            pid,
            "restored under its PID"
        );
    }

    /// Restores the tree (detached) and returns the root's PID here, which a tree that is a PID
    /// namespace of its own does not keep; `ours` are gpu-checkpoint restore's own flags (`--stream`).
    pub fn restore_as(&self, plain_opts: &[&str], ours: &[&str]) -> i32 {
        match self {
            Taken::Plain(dir) => {
                let pidfile = dir.join("restored.pid");
                let _ = std::fs::remove_file(&pidfile);
                let pidfile_arg = pidfile.to_str().unwrap();
                let mut opts = vec!["--pidfile", pidfile_arg];
                opts.extend_from_slice(plain_opts);
                plain_restore(dir, &opts);
                let pid: i32 = std::fs::read_to_string(&pidfile)
                    .expect("criu restore --pidfile")
                    .trim()
                    .parse()
                    .expect("a pid");
                assert!(tree::is_alive(pid), "plain CRIU restored {pid}");
                pid
            }
            Taken::Ours { store, id, .. } => super::restore_with(id, store, ours),
        }
    }
}

/// A case whose right answer is a refusal: `gpu-checkpoint checkpoint --pid PID EXTRA` must exit 9
/// before touching the tree, its message naming each of `says`, and the program must run on; plain CRIU
/// is run beside (`criu dump --leave-running`), and how it fared is printed (it fails after freezing the
/// tree, in its own words, or it does not: either is news about CRIU, not a failure of this test).
pub fn refused(what: &str, pid: i32, extra: &[&str], says: &[&str]) -> String {
    let work = tempfile::tempdir().unwrap();
    let (out, dir) = plain_dump(pid, work.path(), "plain", &["--leave-running"]);
    let criu_said = if out.status.success() {
        "plain criu dump succeeded".to_string()
    } else {
        format!("plain criu dump failed: {}", criu_errors(&dir))
    };
    let _ = writeln!(std::io::stderr(), "{what}: {criu_said}");
    // CRIU resumes the tree whether it succeeded or not; a stopped process would not "run on".
    wait_for(&format!("{what}: {pid} running after plain CRIU"), || {
        runs(pid)
    });
    let out = super::run_checkpoint(pid, &work.path().join("store"), extra);
    let err = super::fails_with(&out, 9);
    assert!(
        err.contains("nothing was touched"),
        "{what}: refused before touching the tree: {err}"
    );
    for s in says {
        assert!(err.contains(s), "{what}: the refusal names {s:?}: {err}");
    }
    assert!(runs(pid), "{what}: {pid} runs on after the refusal");
    assert!(
        super::list_ids(&work.path().join("store")).is_empty(),
        "{what}: nothing stored"
    );
    err
}
