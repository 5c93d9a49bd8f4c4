//! Real programs that CRIU brings back only with an option (issue 14): an SQLite database in WAL mode
//! held open with its locks (`--file-locks`), a deleted 2 MiB file still open (`--ghost-limit`), an
//! established TCP connection (`--tcp-established`). For each: `detect` names the flag; a checkpoint
//! without it is refused before the tree is touched (exit 9), and the program goes on; with it, the
//! program comes back and goes on; and plain `criu dump` / `criu restore` with the same options does the
//! same in the same test, so that a difference is ours (a failure of plain CRIU is reported loudly and
//! does not fail the test). Each runs in both modes: stopped (the default) and `--leave-running`, the
//! original then killed before its copy is restored.
//!
//! Needs root, CRIU and python3 (its sqlite3 module): fails in CI without them, skips locally with the
//! reason.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::programs::*;
use common::*;
use gpu_checkpoint_workloads::chain;

/// Writes rows to an SQLite database in WAL mode, one connection held open (so its locks are held) for
/// the program's life: row n holds n, written while the file REPORT.go exists. Each round it reports
/// `n rounds` ([`REPORT_PY`]): the test follows the writer there rather than in the database once it is
/// restored (see [`holds_lock_on`]).
const SQLITE_WRITER: &str = r#"
import os, sqlite3, sys, time
report = reporter(sys.argv[2])
db = sqlite3.connect(sys.argv[1], isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
db.execute("CREATE TABLE IF NOT EXISTS t (n INTEGER PRIMARY KEY, v TEXT)")
n = db.execute("SELECT coalesce(max(n), 0) FROM t").fetchone()[0]
rounds = 0
while True:
    rounds += 1
    if os.path.exists(sys.argv[2] + ".go"):
        n += 1
        db.execute("INSERT INTO t VALUES (?, ?)", (n, "row %d" % n))
    report("%d %d" % (n, rounds))
    time.sleep(0.02)
"#;

/// Prints `rows max_n integrity_check` of a database.
const SQLITE_CHECK: &str = r#"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
rows, top = db.execute("SELECT count(*), coalesce(max(n), 0) FROM t").fetchone()
print(rows, top, db.execute("PRAGMA integrity_check").fetchone()[0])
"#;

/// Fills a 2 MiB file with random bytes, keeps it open, deletes it, and rereads it forever, reporting
/// `checks ok` ([`REPORT_PY`]; ok: the contents still hash as written).
const GHOST_HOLDER: &str = r#"
import hashlib, os, sys, time
path, report = sys.argv[1], reporter(sys.argv[2])
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
    report("%d %d" % (n, ok))
    time.sleep(0.05)
"#;

/// Whether `pid` holds a lock through an fd on a file whose name ends with `suffix` (what
/// `--file-locks` restores). In WAL mode SQLite holds a shared lock on the database file for the
/// connection's life and never takes it again: only a restore with the locks gives it back.
///
/// Its lock on the `-shm` file does not come back even so: CRIU 4.2.1 drops it, plain or ours
/// (presumably by closing a descriptor of that file, which it maps, after setting the lock). That lock
/// tells a new connection that others use the database; without it, a connection opened while the
/// restored writer runs takes itself for the first and rebuilds the shared index under the writer,
/// which then stalls or fails. So the tests do not open the database while a restored writer runs.
fn holds_lock_on(pid: i32, suffix: &str) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| t.to_string_lossy().ends_with(suffix))
        })
        .any(|e| {
            let info = format!("/proc/{pid}/fdinfo/{}", e.file_name().to_string_lossy());
            std::fs::read_to_string(info).is_ok_and(|s| s.contains("lock:"))
        })
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
    report: Report,
}

impl Sqlite {
    fn new(py: PathBuf) -> Sqlite {
        let dir = tempfile::tempdir().unwrap();
        let writer = dir.path().join("writer.py");
        let check = dir.path().join("check.py");
        std::fs::write(&writer, [REPORT_PY, SQLITE_WRITER].concat()).unwrap();
        std::fs::write(&check, SQLITE_CHECK).unwrap();
        let db = dir.path().join("app.db");
        let report = Report::new(dir.path().join("writer.log"));
        Sqlite {
            dir,
            py,
            writer,
            check,
            db,
            report,
        }
    }

    fn store(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// A writer, once it has written a few rows.
    fn start(&self) -> Program {
        let from = self.written();
        self.writing(true);
        let w = Program::start(&[&self.py, &self.writer, &self.db, &self.report.path]);
        self.wait_written("rows written", from + 10);
        assert!(
            holds_lock_on(w.pid, "app.db"),
            "the WAL connection holds its lock"
        );
        w
    }

    /// Lets the writer write rows, or not (it goes on with its rounds).
    fn writing(&self, on: bool) {
        // The writer's own name for it: its report's path and ".go".
        let mut go = self.report.path.clone().into_os_string();
        go.push(".go");
        if on {
            std::fs::write(go, "").unwrap();
        } else {
            let _ = std::fs::remove_file(go);
        }
    }

    /// (the last row the writer says it wrote, its rounds).
    fn progress(&self) -> (u64, u64) {
        let s = self.report.last().unwrap_or_default();
        let mut f = s.split_whitespace().map(|v| v.parse().unwrap_or(0));
        (f.next().unwrap_or(0), f.next().unwrap_or(0))
    }

    /// The last row the writer says it wrote.
    fn written(&self) -> u64 {
        self.progress().0
    }

    /// Stops the writer writing rows (for `--leave-running`: a database the original goes on
    /// changing after the checkpoint is not the one its copy knows) and waits until it has stopped.
    fn pause(&self) {
        self.writing(false);
        let rounds = self.progress().1;
        wait_for("the writer pausing", || self.progress().1 > rounds + 2);
        let n = self.written();
        wait_for("the writer going round", || self.progress().1 > rounds + 5);
        assert_eq!(self.written(), n, "paused");
    }

    /// The writer goes round, not writing (it is paused).
    fn wait_rounds(&self) {
        let (n, rounds) = self.progress();
        wait_for("the writer going round", || self.progress().1 > rounds + 5);
        assert_eq!(self.written(), n, "still paused");
    }

    fn wait_written(&self, what: &str, past: u64) {
        wait_for(what, || self.written() > past);
    }

    /// The restored writer `w` writes on (`what`) past `at_checkpoint`, holding its lock again (`locks`
    /// says why it must); then, once it is killed, the database checks out ([`Sqlite::check_intact`]).
    fn writes_on_holding_its_lock(&self, w: Program, at_checkpoint: u64, what: &str, locks: &str) {
        self.wait_written(what, at_checkpoint + 10);
        assert!(holds_lock_on(w.pid, "app.db"), "{locks}");
        w.kill_and_wait_free();
        self.check_intact();
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

/// An SQLite writer in WAL mode in `mode`: `detect` names `--file-locks`; without it the checkpoint is
/// refused before anything is touched; with it the writer comes back holding its lock and writes on,
/// the database intact. Plain CRIU the same.
fn sqlite_in_wal_mode(mode: Mode) {
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

    // With it: restored (the flag given again is accepted), its locks back, writing on.
    if mode == Mode::LeaveRunning {
        s.pause();
    }
    let ck = checkpoint_in(mode, w.pid, &store, &["--file-locks"], || s.wait_rounds());
    let at_checkpoint = s.written();
    restore_giving_again(&ck, &store, "--file-locks", w.pid);
    s.writing(true);
    s.writes_on_holding_its_lock(
        w,
        at_checkpoint,
        "the restored writer going on",
        "restore gave the locks back",
    );

    // Plain CRIU: refused without the flag (the writer resumed), brought back with it.
    Via::Plain.case(&format!("SQLite in WAL mode, {mode}"), || {
        let w = s.start();
        let (out, _) = plain_dump(w.pid, s.dir.path(), "plain-refused", &[]);
        assert!(
            !out.status.success(),
            "plain criu dumps locks only with --file-locks"
        );
        s.wait_written("the writer going on after plain CRIU", s.written() + 5);
        assert!(w.running());
        if mode == Mode::LeaveRunning {
            s.pause();
        }
        let taken = Via::Plain.checkpoint(mode, w.pid, s.dir.path(), &["--file-locks"], || {
            s.wait_rounds()
        });
        let at_checkpoint = s.written();
        taken.restore(w.pid, &["--file-locks"]);
        s.writing(true);
        s.writes_on_holding_its_lock(
            w,
            at_checkpoint,
            "the writer restored by plain CRIU",
            "plain CRIU gave the locks back",
        );
    });
}

both_modes!(sqlite_in_wal_mode:
    sqlite_in_wal_mode_needs_file_locks_and_comes_back_intact,
    sqlite_in_wal_mode_comes_back_intact_after_a_leave_running_checkpoint);

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
    s.writes_on_holding_its_lock(
        w,
        at_checkpoint,
        "the restored writer going on",
        "the restore's configuration file gave the locks back",
    );
}

/// (checks, ok) from the ghost holder's last report.
fn ghost_state(report: &Report) -> Option<(u64, bool)> {
    let s = report.last()?;
    let mut f = s.split_whitespace();
    Some((f.next()?.parse().ok()?, f.next()? == "1"))
}

/// A process rereading a deleted 2 MiB file, in `mode`: `detect` names `--ghost-limit`; without it the
/// checkpoint is refused; with it the file comes back with its contents. Plain CRIU the same.
fn a_deleted_file_over_a_mib(mode: Mode) {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let holder = dir.path().join("ghost.py");
    std::fs::write(&holder, [REPORT_PY, GHOST_HOLDER].concat()).unwrap();
    let run = |name: &str| -> (Program, Report) {
        let state = Report::new(dir.path().join(format!("{name}.log")));
        let file = dir.path().join(format!("{name}.scratch"));
        let p = Program::start(&[&py, &holder, &file, &state.path]);
        wait_for("the file checked", || {
            ghost_state(&state).is_some_and(|(n, ok)| n > 3 && ok)
        });
        assert!(!file.exists(), "deleted");
        (p, state)
    };
    let checks = |state: &Report| ghost_state(state).map_or(0, |s| s.0);
    // Checked again 5 times past `from`: after a restore, `from` is where the original left its report,
    // so only the copy can get past it.
    let going_on = |state: &Report, from: u64| {
        wait_for("the contents checked again", || {
            ghost_state(state).is_some_and(|(n, ok)| n > from + 5 && ok)
        })
    };

    let (p, state) = run("ours");
    assert_eq!(needed_flags(p.pid), ["ghost-limit"]);
    let err = fails_with(&run_checkpoint(p.pid, &store, &[]), 9);
    assert!(err.contains("--ghost-limit 2M"), "{err}");
    going_on(&state, checks(&state));
    let ck = checkpoint_in(mode, p.pid, &store, &["--ghost-limit", "4M"], || {
        going_on(&state, checks(&state))
    });
    let at_checkpoint = checks(&state);
    assert_eq!(restore(ck["id"].as_str().unwrap(), &store), p.pid);
    going_on(&state, at_checkpoint);
    p.kill_and_wait_free();

    Via::Plain.case(&format!("a deleted 2 MiB file, {mode}"), || {
        let (p, state) = run("plain");
        let (out, _) = plain_dump(p.pid, dir.path(), "plain-refused", &[]);
        assert!(
            !out.status.success(),
            "plain criu copies 2 MiB only with --ghost-limit"
        );
        going_on(&state, checks(&state));
        let taken =
            Via::Plain.checkpoint(mode, p.pid, dir.path(), &["--ghost-limit", "4M"], || {
                going_on(&state, checks(&state))
            });
        let at_checkpoint = checks(&state);
        taken.restore(p.pid, &[]);
        going_on(&state, at_checkpoint);
        p.kill_and_wait_free();
    });
}

both_modes!(a_deleted_file_over_a_mib:
    a_deleted_file_over_a_mib_needs_ghost_limit_and_keeps_its_contents,
    a_deleted_file_over_a_mib_keeps_its_contents_after_a_leave_running_checkpoint);

/// An established loopback TCP pair in `mode`: `detect` names `--tcp-established`; without it the
/// checkpoint is refused before the tree is frozen; with it the conversation carries on after the
/// restore, which accepts the flag again. Plain CRIU the same.
fn an_established_connection(mode: Mode) {
    let Some((dir, store)) = criu_ready().then(|| {
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        (dir, store)
    }) else {
        return;
    };
    // Each run in a new folder: a state file left by another run would answer for this one until it
    // starts writing.
    let start = |name: &str| {
        let run = dir.path().join(name);
        std::fs::create_dir(&run).unwrap();
        let sock = run.join("wl.sock");
        let w = Workload::start(
            "sockets",
            &run,
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
    // 5 rounds past `from`: after a restore, `from` is where the original left the state file, so
    // only the copy can get past it.
    let carries_on = |w: &Workload, from: u64| {
        let after = w.wait_state("the connection carrying on", |r| {
            r.len() == 1 && num(&r[0], "tcp_rounds") > from + 5
        });
        assert_eq!(num(&after[0], "errors"), 0);
        assert_eq!(
            num(&after[0], "tcp_value"),
            chain(7, num(&after[0], "tcp_rounds"))
        );
    };

    let w = start("ours");
    assert!(needed_flags(w.pid).contains(&"tcp-established".to_string()));
    // Refused before the tree is frozen (CRIU would refuse only after freezing it, with its network
    // locked); the connection goes on.
    let err = fails_with(&run_checkpoint(w.pid, &store, &[]), 9);
    assert!(err.contains("--tcp-established"), "{err}");
    carries_on(&w, rounds(&w));
    let ck = checkpoint_in(mode, w.pid, &store, &["--tcp-established"], || {
        carries_on(&w, rounds(&w))
    });
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
    Via::Plain.case(&format!("an established TCP pair, {mode}"), || {
        let w = start("plain");
        let taken = Via::Plain.checkpoint(
            mode,
            w.pid,
            dir.path(),
            &["--tcp-established", "--network-lock", "nftables"],
            || carries_on(&w, rounds(&w)),
        );
        let r0 = rounds(&w);
        taken.restore(w.pid, &["--tcp-established"]);
        carries_on(&w, r0);
    });
}

both_modes!(an_established_connection:
    an_established_connection_needs_tcp_established_and_restore_accepts_it_again,
    an_established_connection_carries_on_after_a_leave_running_checkpoint);
