//! Real programs that CRIU brings back only with an option (issue 14): an SQLite database in WAL mode
//! held open with its locks (`--file-locks`), a deleted 2 MiB file still open (`--ghost-limit`), an
//! established TCP connection (`--tcp-established`). For each: `detect` names the flag; a checkpoint
//! without it is refused before the tree is touched (exit 9), and the program goes on; with it, the
//! program comes back and goes on; and plain `criu dump` / `criu restore` with the same options does the
//! same in the same test, so that a difference is ours.
//!
//! Needs root, CRIU and python3 (its sqlite3 module): fails in CI without them, skips locally with the
//! reason.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::*;
use gpu_checkpoint::proc as tree;
use gpu_checkpoint_workloads::chain;

/// Writes rows to an SQLite database in WAL mode, one connection held open (so its locks are held) for
/// the program's life: row n holds n. After each row it writes n to a state file: the test follows the
/// writer there rather than in the database once it is restored (see [`Program::holds_lock_on`]).
const SQLITE_WRITER: &str = r#"
import os, sqlite3, sys, time
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE IF NOT EXISTS t (n INTEGER PRIMARY KEY, v TEXT)")
n = db.execute("SELECT coalesce(max(n), 0) FROM t").fetchone()[0]
while True:
    n += 1
    db.execute("INSERT INTO t VALUES (?, ?)", (n, "row %d" % n))
    with open(sys.argv[2] + ".tmp", "w") as s:
        s.write("%d\n" % n)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(0.02)
"#;

/// Prints `rows max_n integrity_check` of a database.
const SQLITE_CHECK: &str = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
rows, top = db.execute("SELECT count(*), coalesce(max(n), 0) FROM t").fetchone()
print(rows, top, db.execute("PRAGMA integrity_check").fetchone()[0])
"#;

/// Fills a 2 MiB file with random bytes, keeps it open, deletes it, and rereads it forever, writing
/// `checks ok` to a state file (ok: the contents still hash as written).
const GHOST_HOLDER: &str = r#"
import hashlib, os, sys, time
path, state = sys.argv[1], sys.argv[2]
data = os.urandom(2 << 20)
with open(path, "wb") as f:
    f.write(data)
f = open(path, "rb")
os.unlink(path)
want = hashlib.sha256(data).hexdigest()
del data
n = 0
while True:
    f.seek(0)
    ok = hashlib.sha256(f.read()).hexdigest() == want
    n += 1
    with open(state + ".tmp", "w") as s:
        s.write("%d %d\n" % (n, ok))
    os.replace(state + ".tmp", state)
    time.sleep(0.05)
"#;

/// The Python interpreter itself (not a wrapper script: what CRIU restores is the interpreter), when
/// root and CRIU are there too; like [`criu_ready`], its absence fails in CI and skips locally.
fn python() -> Option<PathBuf> {
    static PY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    if !criu_ready() {
        return None;
    }
    let found = PY.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", "import sqlite3, sys; print(sys.executable)"])
            .output()
            .map_err(|e| format!("python3: {e}"))?;
        if !out.status.success() {
            return Err(format!("python3 without sqlite3: {}", text(&out.stderr)));
        }
        Ok(PathBuf::from(text(&out.stdout).trim()))
    });
    match found {
        Ok(p) => Some(p.clone()),
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("the CRIU option tests need python3 with sqlite3 in CI: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            None
        }
    }
}

/// A program started in its own session and re-parented to init, as a service is; its tree is killed
/// on drop (unless [`Program::kill_and_wait_free`] did already: its PID may be someone else's by then).
struct Program {
    pid: i32,
    done: bool,
}

impl Program {
    fn start(argv: &[&Path]) -> Program {
        let out = Command::new("sh")
            .arg("-c")
            .arg(r#"setsid "$@" </dev/null >/dev/null 2>&1 & echo $!"#)
            .arg("sh")
            .args(argv)
            .output()
            .expect("run sh");
        assert!(out.status.success(), "{out:?}");
        let pid = text(&out.stdout).trim().parse().expect("a pid");
        Program { pid, done: false }
    }

    fn running(&self) -> bool {
        tree::stat(self.pid).is_some_and(|s| !s.is_dying() && s.state != 'T')
    }

    fn kill_and_wait_free(mut self) {
        let pids: Vec<i32> = tree::process_tree(self.pid).iter().map(|p| p.pid).collect();
        tree::kill_tree(&pids, Duration::from_secs(10));
        wait_pid_free(self.pid);
        self.done = true;
    }

    /// Whether it holds a lock through an fd on a file whose name ends with `suffix` (what
    /// `--file-locks` restores). In WAL mode SQLite holds a shared lock on the database file for the
    /// connection's life and never takes it again: only a restore with the locks gives it back.
    ///
    /// Its lock on the `-shm` file does not come back even so: CRIU 4.2.1 drops it, plain or ours
    /// (presumably by closing a descriptor of that file, which it maps, after setting the lock). That lock
    /// tells a new connection that others use the database; without it, a connection opened while the
    /// restored writer runs takes itself for the first and rebuilds the shared index under the writer,
    /// which then stalls or fails. So the tests do not open the database while a restored writer runs.
    fn holds_lock_on(&self, suffix: &str) -> bool {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{}/fd", self.pid)) else {
            return false;
        };
        fds.filter_map(|e| e.ok())
            .filter(|e| {
                std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().ends_with(suffix))
            })
            .any(|e| {
                let info = format!(
                    "/proc/{}/fdinfo/{}",
                    self.pid,
                    e.file_name().to_string_lossy()
                );
                std::fs::read_to_string(info).is_ok_and(|s| s.contains("lock:"))
            })
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

/// Waits up to 30 s for `what` to hold.
fn wait_for(what: &str, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The CRIU gpu-checkpoint finds, run by hand.
fn plain_criu(args: &[&str], dir: &Path) -> Output {
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

/// `criu dump -t PID EXTRA` into a new folder (the tree is killed after the dump, CRIU's default).
fn plain_dump(pid: i32, work: &Path, name: &str, extra: &[&str]) -> (Output, PathBuf) {
    let dir = work.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let pid = pid.to_string();
    let mut args = vec!["dump", "-t", &pid];
    args.extend_from_slice(extra);
    (plain_criu(&args, &dir), dir)
}

/// `criu restore -d EXTRA` from `dir`, which must succeed.
fn plain_restore(dir: &Path, extra: &[&str]) {
    let mut args = vec!["restore", "-d"];
    args.extend_from_slice(extra);
    let out = plain_criu(&args, dir);
    assert!(
        out.status.success(),
        "plain criu restore failed: {}\n{}",
        text(&out.stderr),
        std::fs::read_to_string(dir.join("criu.log")).unwrap_or_default()
    );
}

/// `detect --tree --format json` of `pid`: the flags of its `needs-option` findings.
fn needed_flags(pid: i32) -> Vec<String> {
    let out = ok(&gc(&[
        "detect",
        "--pid",
        &pid.to_string(),
        "--tree",
        "--format",
        "json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == "needs-option")
        .map(|f| {
            let e = &f["evidence"];
            assert!(e["remedy"].is_string(), "{f}");
            e["needs"]["option"].as_str().unwrap().to_string()
        })
        .collect()
}

/// `restore ID --storage STORE FLAG`: a dump-time flag given to the restore as well, as scripts written
/// for plain CRIU do. It must restore `pid` and say once that the checkpoint decides the flag; returns
/// what it said on stderr.
fn restore_giving_again(ck: &serde_json::Value, store: &Path, flag: &str, pid: i32) -> String {
    let out = gc(&[
        "restore",
        ck["id"].as_str().unwrap(),
        "--storage",
        store.to_str().unwrap(),
        flag,
    ]);
    assert_eq!(ok(&out).trim(), pid.to_string());
    let said = text(&out.stderr);
    assert!(
        said.contains(&format!("{flag}: checkpoint")) && said.contains("was taken with this"),
        "{said}"
    );
    said
}

/// (rows, highest n, integrity_check) of the database.
fn sqlite_check(py: &Path, script: &Path, db: &Path) -> (u64, u64, String) {
    let out = Command::new(py).arg(script).arg(db).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    let f: Vec<&str> = s.split_whitespace().collect();
    (
        f[0].parse().unwrap(),
        f[1].parse().unwrap(),
        f[2].to_string(),
    )
}

/// An SQLite scene: the writer and checker scripts and a database in a temporary folder.
struct Sqlite {
    dir: tempfile::TempDir,
    py: PathBuf,
    writer: PathBuf,
    check: PathBuf,
    db: PathBuf,
    state: PathBuf,
}

impl Sqlite {
    fn new(py: PathBuf) -> Sqlite {
        let dir = tempfile::tempdir().unwrap();
        let writer = dir.path().join("writer.py");
        let check = dir.path().join("check.py");
        std::fs::write(&writer, SQLITE_WRITER).unwrap();
        std::fs::write(&check, SQLITE_CHECK).unwrap();
        let db = dir.path().join("app.db");
        let state = dir.path().join("writer.state");
        Sqlite {
            dir,
            py,
            writer,
            check,
            db,
            state,
        }
    }

    fn store(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// A writer, once it has written a few rows.
    fn start(&self) -> Program {
        let from = self.written();
        let w = Program::start(&[&self.py, &self.writer, &self.db, &self.state]);
        self.wait_written("rows written", from + 10);
        assert!(
            w.holds_lock_on("app.db"),
            "the WAL connection holds its lock"
        );
        w
    }

    /// The last row the writer says it wrote.
    fn written(&self) -> u64 {
        std::fs::read_to_string(&self.state)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn wait_written(&self, what: &str, past: u64) {
        wait_for(what, || self.written() > past);
    }

    /// With no writer left: the whole database checks out, and holds every row written, once.
    fn check_intact(&self) {
        let (count, top, integrity) = sqlite_check(&self.py, &self.check, &self.db);
        assert_eq!(integrity, "ok");
        assert_eq!(count, top, "no row lost or written twice");
        assert!(
            top >= self.written(),
            "{top} rows, {} written",
            self.written()
        );
    }
}

#[test]
fn sqlite_in_wal_mode_needs_file_locks_and_comes_back_intact() {
    let Some(py) = python() else { return };
    let s = Sqlite::new(py);
    let store = s.store();
    let w = s.start();
    assert_eq!(needed_flags(w.pid), ["file-locks"]);

    // Without --file-locks: refused before anything is touched, naming the flag; the writer goes on.
    let err = fails_with(&run_checkpoint(w.pid, &store, &[]), 9);
    assert!(err.contains("--file-locks"), "{err}");
    s.wait_written("the writer going on", s.written() + 5);
    assert!(w.running());
    assert!(list_ids(&store).is_empty());

    // With it: stopped, restored (the flag given again is accepted), its locks back, writing on.
    let ck = checkpoint(w.pid, &store, &["--file-locks"]);
    assert_eq!(ck["stopped"], true);
    wait_pid_free(w.pid);
    let at_checkpoint = s.written();
    restore_giving_again(&ck, &store, "--file-locks", w.pid);
    s.wait_written("the restored writer going on", at_checkpoint + 10);
    assert!(w.holds_lock_on("app.db"), "restore gave the locks back");
    w.kill_and_wait_free();
    s.check_intact();

    // Plain CRIU: refused without the flag (the writer resumed), brought back with it.
    let w = s.start();
    let (out, _) = plain_dump(w.pid, s.dir.path(), "plain-refused", &[]);
    assert!(
        !out.status.success(),
        "plain criu dumps locks only with --file-locks"
    );
    s.wait_written("the writer going on after plain CRIU", s.written() + 5);
    assert!(w.running());
    let (out, images) = plain_dump(w.pid, s.dir.path(), "plain", &["--file-locks"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_pid_free(w.pid);
    let at_checkpoint = s.written();
    plain_restore(&images, &["--file-locks"]);
    s.wait_written("the writer restored by plain CRIU", at_checkpoint + 10);
    assert!(w.holds_lock_on("app.db"));
    w.kill_and_wait_free();
    s.check_intact();
}

/// `--criu-config`: a CRIU configuration file saying `file-locks` does what the flag does, on checkpoint
/// (the refusal counts it) and on restore (the locks come back only because the restore's file says so).
#[test]
fn a_criu_configuration_file_carries_options_to_both_sides() {
    let Some(py) = python() else { return };
    let s = Sqlite::new(py);
    let store = s.store();
    let conf = s.dir.path().join("criu.conf");
    std::fs::write(&conf, "# issue 14\nfile-locks\n").unwrap();
    let w = s.start();
    let ck = checkpoint(w.pid, &store, &["--criu-config", conf.to_str().unwrap()]);
    wait_pid_free(w.pid);
    let at_checkpoint = s.written();
    let pid = restore_with(
        ck["id"].as_str().unwrap(),
        &store,
        &["--criu-config", conf.to_str().unwrap()],
    );
    assert_eq!(pid, w.pid);
    s.wait_written("the restored writer going on", at_checkpoint + 10);
    assert!(
        w.holds_lock_on("app.db"),
        "the restore's configuration file gave the locks back"
    );
    w.kill_and_wait_free();
    s.check_intact();
}

/// (checks, ok) from the ghost holder's state file.
fn ghost_state(state: &Path) -> Option<(u64, bool)> {
    let s = std::fs::read_to_string(state).ok()?;
    let mut f = s.split_whitespace();
    Some((f.next()?.parse().ok()?, f.next()? == "1"))
}

#[test]
fn a_deleted_file_over_a_mib_needs_ghost_limit_and_keeps_its_contents() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let holder = dir.path().join("ghost.py");
    std::fs::write(&holder, GHOST_HOLDER).unwrap();
    let run = |name: &str| -> (Program, PathBuf) {
        let state = dir.path().join(format!("{name}.state"));
        let file = dir.path().join(format!("{name}.scratch"));
        let p = Program::start(&[&py, &holder, &file, &state]);
        wait_for("the file checked", || {
            ghost_state(&state).is_some_and(|(n, ok)| n > 3 && ok)
        });
        assert!(!file.exists(), "deleted");
        (p, state)
    };
    let checks = |state: &Path| ghost_state(state).map_or(0, |s| s.0);
    let going_on = |state: &Path, from: u64| {
        wait_for("the contents checked again", || {
            ghost_state(state).is_some_and(|(n, ok)| n > from + 5 && ok)
        })
    };

    let (p, state) = run("ours");
    assert_eq!(needed_flags(p.pid), ["ghost-limit"]);
    let err = fails_with(&run_checkpoint(p.pid, &store, &[]), 9);
    assert!(err.contains("--ghost-limit 2M"), "{err}");
    going_on(&state, checks(&state));
    let ck = checkpoint(p.pid, &store, &["--ghost-limit", "4M"]);
    wait_pid_free(p.pid);
    let at_checkpoint = checks(&state);
    assert_eq!(restore(ck["id"].as_str().unwrap(), &store), p.pid);
    going_on(&state, at_checkpoint);
    p.kill_and_wait_free();

    let (p, state) = run("plain");
    let (out, _) = plain_dump(p.pid, dir.path(), "plain-refused", &[]);
    assert!(
        !out.status.success(),
        "plain criu copies 2 MiB only with --ghost-limit"
    );
    going_on(&state, checks(&state));
    let (out, images) = plain_dump(p.pid, dir.path(), "plain", &["--ghost-limit", "4M"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_pid_free(p.pid);
    let at_checkpoint = checks(&state);
    plain_restore(&images, &[]);
    going_on(&state, at_checkpoint);
    p.kill_and_wait_free();
}

#[test]
fn an_established_connection_needs_tcp_established_and_restore_accepts_it_again() {
    let Some((dir, store)) = criu_ready().then(|| {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        (dir, store)
    }) else {
        return;
    };
    let sock = dir.path().join("wl.sock");
    let start = || {
        let w = Workload::start(
            "sockets",
            dir.path(),
            &["--unix", sock.to_str().unwrap(), "--tcp-pair", "1"],
        );
        w.wait_state("ticking", |r| r.len() == 1 && num(&r[0], "tcp_rounds") >= 3);
        w
    };
    let rounds = |w: &Workload| {
        num(
            &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
            "tcp_rounds",
        )
    };
    let carries_on = |w: &Workload, from: u64| {
        let after = w.wait_state("the connection carrying on", |r| {
            num(&r[0], "tcp_rounds") > from + 5
        });
        assert_eq!(num(&after[0], "errors"), 0);
        assert_eq!(
            num(&after[0], "tcp_value"),
            chain(7, num(&after[0], "tcp_rounds"))
        );
    };

    let w = start();
    assert!(needed_flags(w.pid).contains(&"tcp-established".to_string()));
    // Refused before the tree is frozen (CRIU would refuse only after freezing it, with its network
    // locked); the connection goes on.
    let err = fails_with(&run_checkpoint(w.pid, &store, &[]), 9);
    assert!(err.contains("--tcp-established"), "{err}");
    carries_on(&w, rounds(&w));
    let ck = checkpoint(w.pid, &store, &["--tcp-established"]);
    wait_pid_free(w.pid);
    let r0 = rounds(&w);
    // A script written for plain CRIU passes the flag to the restore too: accepted, said once.
    let said = restore_giving_again(&ck, &store, "--tcp-established", w.pid);
    assert_eq!(
        said.lines()
            .filter(|l| l.contains("--tcp-established"))
            .count(),
        1,
        "{said}"
    );
    carries_on(&w, r0);
    w.kill_and_wait_free();
    drop(w);

    // Plain CRIU, the same options (the lock method gpu-checkpoint uses by default).
    let w = start();
    let (out, images) = plain_dump(
        w.pid,
        dir.path(),
        "plain",
        &["--tcp-established", "--network-lock", "nftables"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    wait_pid_free(w.pid);
    let r0 = rounds(&w);
    plain_restore(&images, &["--tcp-established"]);
    carries_on(&w, r0);
}
