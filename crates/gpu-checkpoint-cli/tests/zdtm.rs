//! CRIU's own zdtm tests through gpu-checkpoint (issue 14): every zdtm static test of `zdtm.list` that
//! plain CRIU brings back here must come back through gpu-checkpoint too, in both checkpoint modes and
//! with the default restore.
//!
//! The tests are C programs from Debian's criu source package, fetched and built by
//! `scripts/install-zdtm.sh` into `.deps/zdtm` (`static/T` and `commands`, each test's arguments as its
//! Makefile's `T.pid` rule gives them). A zdtm test daemonizes (its launcher exits once it is ready and
//! has written `T.pid`), checks its own state until SIGTERM, then writes `PASS` or `FAIL` to `T.out`. For
//! each test, in each mode, in a fresh folder each time:
//! - plain CRIU: `criu dump -t PID` (+ the `opts` of the test's `.desc`), `criu restore -d`, SIGTERM;
//! - gpu-checkpoint: `checkpoint --pid PID` (+ the same options), `restore ID` (the default restore),
//!   SIGTERM.
//!
//! The modes: stop (the dump kills the test; gpu-checkpoint's default) and `--leave-running` (the test
//! runs on, and is killed and its PID waited free before the restore, whose state zdtm checks).
//!
//! A test plain CRIU fails here in a mode is reported and not run through gpu-checkpoint in that mode;
//! any gpu-checkpoint failure where plain CRIU passed fails this test, naming the zdtm test, the mode and
//! the tail of CRIU's log (gpu-checkpoint keeps it in the store's `logs/`). The tests of
//! [`ALLOW_STOPPED`] run through gpu-checkpoint with `--allow-stopped`.
//!
//! Processes whose parent exits are re-parented to init, which on some hosts (a VM whose init is an
//! agent) reaps them a second or more later; a PID a restore needs stays taken until then. So this test
//! makes itself a child subreaper and reaps every child itself ([`Reaper`]): the suite runs in about a
//! tenth of the time. Therefore every command here is run through [`Reaper::run`], never
//! `Command::output` (whose wait would race the reaper).
//!
//! Needs root, CRIU and the built zdtm: fails in CI without them, skips locally with the reason.
//! `GPU_CHECKPOINT_ZDTM_ONLY="pipe00 fifo"` runs only those; `GPU_CHECKPOINT_ZDTM` points at another
//! build than `.deps/zdtm`.

mod common;

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::*;
use gpu_checkpoint::dump::Released;
use gpu_checkpoint::proc as tree;

/// The tests to run, in order (one or more names a line; `#` comments say why the others are left out).
const LIST: &str = include_str!("zdtm.list");

/// Tests whose tree holds a process stopped on purpose (SIGSTOP; its parent continues it later).
/// gpu-checkpoint refuses a stopped tree unless told `--allow-stopped` (an interrupted checkpoint may have
/// left it so: docs/guarantees.md), as CRIU needs `--file-locks` for a held lock: through gpu-checkpoint
/// these run with the flag, and come back stopped as with plain CRIU.
const ALLOW_STOPPED: &[&str] = &["stopped", "stopped01", "stopped02", "stopped12", "vdso02"];

/// How long one CRIU or gpu-checkpoint command, a test's start or its stop may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

fn listed() -> Vec<&'static str> {
    let only = std::env::var("GPU_CHECKPOINT_ZDTM_ONLY").unwrap_or_default();
    let only: Vec<&str> = only.split_whitespace().collect();
    LIST.lines()
        .map(|l| l.split('#').next().unwrap_or(""))
        .flat_map(str::split_whitespace)
        .filter(|t| only.is_empty() || only.contains(t))
        .collect()
}

/// The zdtm build: `GPU_CHECKPOINT_ZDTM`, else the repository's `.deps/zdtm`.
fn zdtm_dir() -> PathBuf {
    std::env::var_os("GPU_CHECKPOINT_ZDTM")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.deps/zdtm"))
}

/// Each listed test's arguments, from the build's `commands`; an error names what is missing.
fn commands(zdtm: &Path) -> Result<HashMap<String, Vec<String>>, String> {
    let file = zdtm.join("commands");
    let text = std::fs::read_to_string(&file).map_err(|e| {
        format!(
            "{}: {e}; run scripts/install-zdtm.sh (scripts/setup.sh does)",
            file.display()
        )
    })?;
    let cmds: HashMap<String, Vec<String>> = text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace().map(String::from);
            Some((w.next()?, w.collect()))
        })
        .collect();
    for t in listed() {
        if !cmds.contains_key(t) || !zdtm.join("static").join(t).is_file() {
            return Err(format!(
                "zdtm test {t} is not built in {}; run scripts/install-zdtm.sh",
                zdtm.display()
            ));
        }
    }
    Ok(cmds)
}

/// The CRIU options a test's `.desc` asks for (`'opts': '--file-locks'`), split into words.
fn desc_opts(zdtm: &Path, test: &str) -> Vec<String> {
    let Ok(desc) = std::fs::read_to_string(zdtm.join("static").join(format!("{test}.desc"))) else {
        return Vec::new();
    };
    let Some(at) = desc.find("'opts'") else {
        return Vec::new();
    };
    let rest = &desc[at + "'opts'".len()..];
    let Some(open) = rest.find(['\'', '"']) else {
        return Vec::new();
    };
    let quote = rest[open..].chars().next().unwrap();
    let value = &rest[open + 1..];
    let value = &value[..value.find(quote).unwrap_or(value.len())];
    value.split_whitespace().map(String::from).collect()
}

/// Reaps every child of this process, including the orphans it inherits as a child subreaper, and hands
/// the exit statuses of the commands [`Reaper::run`] started to it.
#[derive(Clone)]
struct Reaper {
    children: Arc<(Mutex<Children>, Condvar)>,
}

/// The commands [`Reaper::run`] waits for: `None` while running, then their wait status. The status of
/// any other process (an orphan) is dropped: its PID may be reused by a later command.
type Children = HashMap<i32, Option<i32>>;

/// What a command did.
struct Ran {
    /// The wait status (`None`: killed after [`STEP_TIMEOUT`]).
    status: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn success(&self) -> bool {
        self.status == Some(0)
    }

    fn describe(&self) -> String {
        let status = match self.status {
            Some(s) if libc::WIFEXITED(s) => format!("exit {}", libc::WEXITSTATUS(s)),
            Some(s) => format!("signal {}", libc::WTERMSIG(s)),
            None => format!("timed out after {STEP_TIMEOUT:?}"),
        };
        format!(
            "{status}; stdout: {}; stderr: {}",
            self.stdout.trim(),
            self.stderr.trim()
        )
    }
}

impl Reaper {
    fn start() -> Reaper {
        // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes an integer flag.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        assert_eq!(rc, 0, "PR_SET_CHILD_SUBREAPER");
        let r = Reaper {
            children: Arc::new((Mutex::new(HashMap::new()), Condvar::new())),
        };
        let me = r.clone();
        std::thread::spawn(move || loop {
            let mut status = 0;
            // SAFETY: waitpid with a valid pointer to an int.
            let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
            if pid > 0 {
                let (map, cv) = &*me.children;
                if let Some(waiting) = map.lock().unwrap().get_mut(&pid) {
                    *waiting = Some(status);
                    cv.notify_all();
                }
            } else {
                // No child at the moment (ECHILD): look again soon.
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        r
    }

    /// Runs `cmd` (stdin from /dev/null) to its end and returns what it printed and its status; kills it
    /// after [`STEP_TIMEOUT`].
    fn run(&self, cmd: &mut Command) -> Ran {
        let (map, cv) = &*self.children;
        // Started and registered under the lock, so that the reaper, which takes it to hand a status
        // over, cannot drop the status of a command that ends at once.
        let mut children = map.lock().unwrap();
        #[allow(clippy::zombie_processes)] // the reaper waits for it
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {cmd:?}: {e}"));
        let pid = child.id() as i32;
        children.insert(pid, None);
        let mut out = child.stdout.take().unwrap();
        let mut err = child.stderr.take().unwrap();
        let out = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let err = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let deadline = Instant::now() + STEP_TIMEOUT;
        let status = loop {
            if let Some(st) = children[&pid] {
                children.remove(&pid);
                break Some(st);
            }
            let now = Instant::now();
            if now >= deadline {
                // SAFETY: our child, not reaped yet (no status under the lock we hold), so the PID is
                // still its own. Its status, when the reaper gets it, is dropped.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                children.remove(&pid);
                break None;
            }
            children = cv.wait_timeout(children, deadline - now).unwrap().0;
        };
        drop(children);
        Ran {
            status,
            stdout: out.join().unwrap(),
            stderr: err.join().unwrap(),
        }
    }
}

/// Who checkpoints and restores a test.
#[derive(Clone, Copy, PartialEq)]
enum Tool {
    /// `criu dump` and `criu restore -d`.
    Plain,
    /// `gpu-checkpoint checkpoint` and `gpu-checkpoint restore` (the default restore).
    Ours,
}

/// What happens to the test at the checkpoint.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Stopped (killed once the images are written): a migration.
    Stop,
    /// Left running (`--leave-running`); the test kills the original before the restore, whose state
    /// zdtm checks.
    LeaveRunning,
}

fn run_name(tool: Tool, mode: Mode) -> &'static str {
    match (tool, mode) {
        (Tool::Plain, Mode::Stop) => "criu",
        (Tool::Plain, Mode::LeaveRunning) => "criu --leave-running",
        (Tool::Ours, Mode::Stop) => "gpu-checkpoint",
        (Tool::Ours, Mode::LeaveRunning) => "gpu-checkpoint --leave-running",
    }
}

/// Kills what is left of a test's tree (the original after a `--leave-running` checkpoint, a test a
/// failed dump resumed) and waits until its PID is free.
fn kill_test(pid: i32) {
    let pids: Vec<i32> = tree::process_tree(pid).iter().map(|p| p.pid).collect();
    tree::kill_tree(&pids, Duration::from_secs(10));
    wait_pid_free(pid);
}

struct Suite {
    reaper: Reaper,
    zdtm: PathBuf,
    criu: PathBuf,
    cmds: HashMap<String, Vec<String>>,
    work: tempfile::TempDir,
}

impl Drop for Suite {
    /// Whatever a failed or interrupted run left (zdtm tests run until told to stop, and as a subreaper
    /// this process inherited them) goes with it.
    fn drop(&mut self) {
        let me = std::process::id() as i32;
        let left: Vec<i32> = tree::process_tree(me)
            .iter()
            .map(|p| p.pid)
            .filter(|p| *p != me)
            .collect();
        tree::kill_tree(&left, Duration::from_secs(10));
    }
}

/// The last `n` lines of a file, for a failure message.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| format!("({e})"));
    last_lines(&text, n)
}

/// The last `n` lines of `text`.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The tails of the CRIU logs gpu-checkpoint kept in the store's `logs/` (failed dumps, restores).
fn store_logs(store: &Path) -> String {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(store.join("logs"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    logs.sort();
    logs.iter()
        .map(|l| format!("--- {} (tail):\n{}", l.display(), tail(l, 25)))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Suite {
    /// Starts test `t` in `dir` as its Makefile does; returns its PID once its pidfile is written.
    fn start(&self, t: &str, dir: &Path) -> Result<i32, String> {
        let ran = self.reaper.run(
            Command::new(self.zdtm.join("static").join(t))
                .args(&self.cmds[t])
                .current_dir(dir),
        );
        let pidfile = dir.join(format!("{t}.pid"));
        if !ran.success() {
            return Err(format!(
                "the test did not start: {}\n{}",
                ran.describe(),
                tail(&dir.join(format!("{t}.out.inprogress")), 10)
            ));
        }
        std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| format!("{} holds no PID", pidfile.display()))
    }

    /// Stops a test as zdtm does (SIGTERM) and checks its verdict: `T.out` (written as the test exits)
    /// ends with PASS.
    fn stop_and_check(&self, t: &str, dir: &Path, pid: i32) -> Result<(), String> {
        if !tree::is_alive(pid) {
            return Err(format!("pid {pid} is not running after the restore"));
        }
        // SAFETY: kill has no memory-safety preconditions; the PID is the restored test's.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let out = dir.join(format!("{t}.out"));
        let deadline = Instant::now() + STEP_TIMEOUT;
        while !out.exists() && tree::pid_taken(pid) {
            if Instant::now() >= deadline {
                let pids: Vec<i32> = tree::process_tree(pid).iter().map(|p| p.pid).collect();
                let seen = where_stuck(&pids);
                tree::kill_tree(&pids, Duration::from_secs(10));
                return Err(format!(
                    "still running {STEP_TIMEOUT:?} after SIGTERM\n{seen}{}",
                    tail(&dir.join(format!("{t}.out.inprogress")), 10)
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        wait_pid_free(pid);
        let verdict = std::fs::read_to_string(&out)
            .map_err(|e| format!("{}: {e} (the test died without a verdict)", out.display()))?;
        if verdict.trim_end().ends_with("PASS") {
            Ok(())
        } else {
            Err(format!("{t}.out:\n{}", verdict.trim_end()))
        }
    }

    /// Plain CRIU on the test in `dir`: `criu dump` (stopping it, or leaving it running and killing it
    /// then), `criu restore -d`.
    fn plain(&self, dir: &Path, pid: i32, opts: &[String], mode: Mode) -> Result<(), String> {
        let images = dir.join("images");
        std::fs::create_dir(&images).unwrap();
        let mut dump = Command::new(&self.criu);
        dump.args(["dump", "-v4", "-o", "dump.log", "-t", &pid.to_string()])
            .arg("-D")
            .arg(&images)
            .args(opts);
        // As gpu-checkpoint does: CRIU's RPC and command line default to the iptables command, which many
        // hosts lack; the nftables lock goes through the library CRIU carries.
        if opts.iter().any(|o| o == "--tcp-established") {
            dump.args(["--network-lock", "nftables"]);
        }
        if mode == Mode::LeaveRunning {
            dump.arg("--leave-running");
        }
        let ran = self.reaper.run(&mut dump);
        if !ran.success() {
            return Err(format!(
                "criu dump: {}\n{}",
                ran.describe(),
                tail(&images.join("dump.log"), 25)
            ));
        }
        if mode == Mode::LeaveRunning && !tree::is_alive(pid) {
            return Err("the tree is not running after criu dump --leave-running".into());
        }
        kill_test(pid);
        let ran = self.reaper.run(
            Command::new(&self.criu)
                .args(["restore", "-d", "-v4", "-o", "restore.log", "-D"])
                .arg(&images)
                .args(opts),
        );
        if !ran.success() {
            // CRIU keeps its dump's network lock for another restore: none comes, and it would drop a
            // later test's connection that gets the same ports. Exactly this dump's (its log names it).
            let lock = gpu_checkpoint::dump::KeptNetworkLock::logged_in(&images.join("dump.log"));
            let released = match lock.map(|l| (l.release("plain CRIU's dump"), l.describe())) {
                Some((Ok(Released::Released), what)) => {
                    format!("\n(released its network lock: {what})")
                }
                Some((Ok(Released::NothingLeft), _)) | None => String::new(),
                Some((Err(e), what)) => format!("\n(its network lock, {what}, not released: {e})"),
            };
            return Err(format!(
                "criu restore: {}\n{}{released}",
                ran.describe(),
                tail(&images.join("restore.log"), 25)
            ));
        }
        Ok(())
    }

    /// gpu-checkpoint on the test in `dir`: checkpoint (stopping it, or leaving it running and killing it
    /// then), restore.
    fn ours(&self, dir: &Path, pid: i32, opts: &[String], mode: Mode) -> Result<(), String> {
        let store = dir.join("store");
        let storage = store.to_str().unwrap();
        let failed =
            |what: &str, ran: &Ran| format!("{what}: {}\n{}", ran.describe(), store_logs(&store));
        let mut ck = Command::new(gc_bin());
        ck.args([
            "checkpoint",
            "--pid",
            &pid.to_string(),
            "--storage",
            storage,
        ])
        .args(opts);
        if mode == Mode::LeaveRunning {
            ck.arg("--leave-running");
        }
        let ran = self.reaper.run(&mut ck);
        if !ran.success() {
            return Err(failed("gpu-checkpoint checkpoint", &ran));
        }
        let id = ran.stdout.trim().to_string();
        if mode == Mode::LeaveRunning && !tree::is_alive(pid) {
            return Err("the tree is not running after checkpoint --leave-running".into());
        }
        kill_test(pid);
        let ran =
            self.reaper
                .run(Command::new(gc_bin()).args(["restore", &id, "--storage", storage]));
        if !ran.success() {
            // As for plain CRIU (above): the network lock this checkpoint recorded, if still there.
            let released = self.reaper.run(Command::new(gc_bin()).args([
                "release-network-lock",
                &id,
                "--storage",
                storage,
            ]));
            let failed = failed("gpu-checkpoint restore", &ran);
            return Err(format!(
                "{failed}\n(release-network-lock: {})",
                released.describe()
            ));
        }
        if ran.stdout.trim() != pid.to_string() {
            return Err(format!(
                "restore printed {:?}, not {pid}",
                ran.stdout.trim()
            ));
        }
        Ok(())
    }

    /// One test through one tool in one mode, in a fresh folder.
    fn run(&self, t: &str, tool: Tool, mode: Mode) -> Result<(), String> {
        let dir = self
            .work
            .path()
            .join(t)
            .join(run_name(tool, mode).replace([' ', '-'], ""));
        std::fs::create_dir_all(&dir).unwrap();
        let mut opts = desc_opts(&self.zdtm, t);
        let pid = self.start(t, &dir)?;
        let done = match tool {
            Tool::Plain => self.plain(&dir, pid, &opts, mode),
            Tool::Ours => {
                if ALLOW_STOPPED.contains(&t) {
                    opts.push("--allow-stopped".into());
                }
                self.ours(&dir, pid, &opts, mode)
            }
        };
        if let Err(e) = done {
            kill_test(pid);
            return Err(e);
        }
        self.stop_and_check(t, &dir, pid)
    }
}

/// Where each thread of a hung test waits (state, wait channel, kernel stack), for the failure message:
/// a flake that shows once in many runs must say enough the first time.
fn where_stuck(pids: &[i32]) -> String {
    let mut seen = String::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let at = task.path();
            let read = |f: &str| std::fs::read_to_string(at.join(f)).unwrap_or_default();
            let state = read("status")
                .lines()
                .find(|l| l.starts_with("State:"))
                .unwrap_or_default()
                .to_string();
            seen += &format!(
                "pid {pid} task {}: {state}, wchan {}\n{}",
                task.file_name().to_string_lossy(),
                read("wchan"),
                read("stack")
            );
        }
    }
    seen
}

/// Whether the suite can run here: root, CRIU and the zdtm build; like [`criu_ready`], their absence
/// fails in CI and skips locally.
fn ready() -> Option<(PathBuf, HashMap<String, Vec<String>>)> {
    if !criu_ready() {
        return None;
    }
    let zdtm = zdtm_dir();
    match commands(&zdtm) {
        Ok(cmds) => Some((zdtm, cmds)),
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("the zdtm suite cannot run in CI: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

#[test]
fn zdtm_tests_plain_criu_passes_pass_through_gpu_checkpoint() {
    let Some((zdtm, cmds)) = ready() else { return };
    // Before the reaper starts: finding CRIU runs `criu --version` and waits for it.
    let criu = gpu_checkpoint::dump::discover(None).expect("CRIU").path;
    let suite = Suite {
        reaper: Reaper::start(),
        zdtm,
        criu,
        cmds,
        work: tempfile::tempdir().unwrap(),
    };
    let started = Instant::now();
    let tests = listed();
    let mut plain_failed = Vec::new();
    let mut ours_failed = Vec::new();
    let mut details = Vec::new();
    let (mut plain_passed, mut ours_passed) = (0, 0);
    for &t in &tests {
        // One line per test and mode: the verdict and how long it took.
        let say = |tool: Tool, mode: Mode, at: Instant, verdict: &str| {
            eprintln!(
                "zdtm {t:<22} {:<31} {verdict} ({:.2}s)",
                run_name(tool, mode),
                at.elapsed().as_secs_f64()
            )
        };
        for mode in [Mode::Stop, Mode::LeaveRunning] {
            let at = Instant::now();
            if let Err(e) = suite.run(t, Tool::Plain, mode) {
                say(Tool::Plain, mode, at, "FAIL");
                eprintln!("zdtm {t}: PLAIN CRIU FAILS HERE, not run through gpu-checkpoint in this mode:\n{e}");
                plain_failed.push(format!("{t} ({})", run_name(Tool::Plain, mode)));
                continue;
            }
            say(Tool::Plain, mode, at, "PASS");
            plain_passed += 1;
            let at = Instant::now();
            let name = format!("{t} ({})", run_name(Tool::Ours, mode));
            match suite.run(t, Tool::Ours, mode) {
                Ok(()) => {
                    say(Tool::Ours, mode, at, "PASS");
                    ours_passed += 1;
                }
                Err(e) => {
                    say(Tool::Ours, mode, at, "FAIL");
                    eprintln!("zdtm {name}: FAILED\n{e}");
                    ours_failed.push(name);
                    // Again in the assertion's message, which ends the test's output: what a
                    // truncated CI log keeps.
                    details.push(format!("{t}: {}", last_lines(&e, 40)));
                }
            }
        }
    }
    eprintln!(
        "zdtm: {} tests, 2 modes, in {:.0}s: plain CRIU passed {plain_passed} runs{}; gpu-checkpoint passed \
         {ours_passed} of those {plain_passed}{}",
        tests.len(),
        started.elapsed().as_secs_f64(),
        if plain_failed.is_empty() {
            String::new()
        } else {
            format!(" (failed here: {})", plain_failed.join(", "))
        },
        if ours_failed.is_empty() {
            String::new()
        } else {
            format!("; FAILED: {}", ours_failed.join(", "))
        },
    );
    assert!(
        ours_failed.is_empty(),
        "zdtm tests plain CRIU passes failed through gpu-checkpoint: {}\n{}",
        ours_failed.join(", "),
        details.join("\n")
    );
}
