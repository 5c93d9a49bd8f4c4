//! Real databases and caches (issue 28), each checkpointed with `gpu-checkpoint checkpoint`, restored with
//! `gpu-checkpoint restore` (the default restore) and checked by its own client, in both modes (stopped,
//! and `--leave-running` with the original killed before its copy is restored), and through plain CRIU
//! 4.2.1 in the same test (`Via`: its failures are printed loudly, ours fail the test):
//!
//! - PostgreSQL 15 in an IPC namespace of its own (`unshare --ipc`): 5000 rows and their checksum survive,
//!   and it takes writes. In the host's IPC namespace its SysV segment cannot be dumped: refused before
//!   anything is touched, and it keeps answering.
//! - MariaDB 10.11 (`--innodb-use-native-aio=0`, `--file-locks`) with a MEMORY table (only in memory: it
//!   survives only if the process's memory does) and an InnoDB one. Stock (native AIO through io_uring):
//!   refused before anything is touched, and it keeps answering.
//! - memcached: 300 keys and a 512 KiB value read back, stats from the restored PID.
//!
//! PostgreSQL refuses to run as root, and CRIU cannot dump another user's processes without
//! `CAP_SYS_RESOURCE`, which the test machines lack (docs/criu.md): the test runs it as root through a
//! one-line `LD_PRELOAD` shim compiled here, which makes `getuid`/`geteuid` answer 65534 so that postgres
//! starts (its data folder is 65534's); CRIU sees root's processes.
//!
//! Every program listens on 127.0.0.1 only, on a port the test picks, and keeps its files in a private
//! temporary folder. Needs root, CRIU, PostgreSQL, MariaDB, memcached and a C compiler
//! (`scripts/setup.sh` installs the packages, never started as services): fails in CI without them, skips
//! locally with the reason.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::programs::*;
use common::*;

/// Runs `cmd`, which must succeed; its stdout.
fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// A database's command-line client: the program and its arguments up to the statement's flag (`-c`,
/// `-e`), which the SQL follows.
struct Sql {
    argv: Vec<std::ffi::OsString>,
}

impl Sql {
    /// The client's output, trimmed; None when it failed (the server not up yet).
    fn try_sql(&self, sql: &str) -> Option<String> {
        let out = Command::new(&self.argv[0])
            .args(&self.argv[1..])
            .arg(sql)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| text(&out.stdout).trim().to_string())
    }

    fn sql(&self, sql: &str) -> String {
        self.try_sql(sql)
            .unwrap_or_else(|| panic!("{} {sql:?} failed", self.argv[0].to_string_lossy()))
    }
}

/// A folder copied (`cp -a`) from a template made once per test binary.
fn copy_dir(from: &Path, to: &Path) {
    run_ok(Command::new("cp").arg("-a").arg(from).arg(to));
}

// ---------------------------------------------------------------------------------------------------
// PostgreSQL

const ROWS: usize = 5000;

/// The PostgreSQL server binaries (`/usr/lib/postgresql/VERSION/bin`, the newest), when root and CRIU
/// are there too.
fn postgres_bin() -> Option<PathBuf> {
    if !criu_ready() {
        return None;
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.filter_map(|e| Some(e.ok()?.path().join("bin")))
                .filter(|b| b.join("postgres").is_file() && b.join("initdb").is_file())
                .collect()
        })
        .unwrap_or_default();
    found.sort_by_key(|b| {
        b.parent()
            .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
            .unwrap_or(0)
    });
    match found.pop() {
        Some(b) => Some(b),
        None => missing(
            "PostgreSQL not found in /usr/lib/postgresql (Debian package postgresql; scripts/setup.sh \
             installs it)",
        ),
    }
}

/// The shim that lets postgres run as root (see the module documentation), and a cluster made once per
/// test with it (`initdb`), which each round copies.
struct PgTemplate {
    bin: PathBuf,
    _dir: tempfile::TempDir,
    shim: PathBuf,
    data: PathBuf,
}

/// What `getuid` and `geteuid` answer postgres: anything but root.
const AS_NOBODY: &str = "#include <unistd.h>\nuid_t getuid(void) { return 65534; }\nuid_t geteuid(void) { return 65534; }\n";

impl PgTemplate {
    fn new(bin: PathBuf) -> PgTemplate {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("as-nobody.c");
        std::fs::write(&src, AS_NOBODY).unwrap();
        let shim = dir.path().join("as-nobody.so");
        run_ok(
            Command::new("cc")
                .args(["-shared", "-fPIC", "-O2", "-o"])
                .arg(&shim)
                .arg(&src),
        );
        let data = dir.path().join("data");
        std::fs::create_dir(&data).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&data, Some(65534), None).unwrap();
        run_ok(
            Command::new(bin.join("initdb"))
                .env("LD_PRELOAD", &shim)
                .args(["-U", "postgres", "--auth=trust", "--no-sync", "-D"])
                .arg(&data),
        );
        PgTemplate {
            bin,
            _dir: dir,
            shim,
            data,
        }
    }
}

/// A server in a private folder, reached through its socket there (`psql -tA`).
struct Pg {
    client: Sql,
    port: u16,
}

impl std::ops::Deref for Pg {
    type Target = Sql;
    fn deref(&self) -> &Sql {
        &self.client
    }
}

impl Pg {
    /// `rows|checksum` of the test table.
    fn state(&self) -> String {
        self.sql("SELECT count(*), md5(string_agg(v, ',' ORDER BY k)) FROM t")
    }
}

/// Copies the template cluster into `dir` and starts postgres there, in an IPC namespace of its own when
/// `own_ipc`, with `ROWS` rows in table `t`.
fn start_postgres(t: &PgTemplate, dir: &Path, own_ipc: bool) -> (Program, Pg) {
    let bin = &t.bin;
    let data = dir.join("data");
    copy_dir(&t.data, &data);
    let port = free_port();
    let mut argv: Vec<std::ffi::OsString> = vec![bin.join("psql").into()];
    argv.extend(["-X", "-q", "-tA", "-U", "postgres", "-d", "postgres"].map(Into::into));
    argv.extend([
        "-h".into(),
        dir.into(),
        "-p".into(),
        port.to_string().into(),
        "-c".into(),
    ]);
    let pg = Pg {
        client: Sql { argv },
        port,
    };
    let mut argv: Vec<String> = Vec::new();
    if own_ipc {
        argv.extend(["unshare", "--ipc"].map(String::from));
    }
    argv.push("env".into());
    argv.push(format!("LD_PRELOAD={}", t.shim.display()));
    argv.push(bin.join("postgres").display().to_string());
    argv.extend([
        "-D".into(),
        data.display().to_string(),
        "-k".into(),
        dir.display().to_string(),
        "-p".into(),
        pg.port.to_string(),
        "-c".into(),
        "listen_addresses=127.0.0.1".into(),
        "-c".into(),
        "fsync=off".into(),
        // Dynamic shared memory in the data folder, not /dev/shm: a killed server leaves its segments
        // behind, and the private folder goes with the test.
        "-c".into(),
        "dynamic_shared_memory_type=mmap".into(),
    ]);
    let p = Program::start(&argv);
    wait_for("postgres answering", || pg.try_sql("SELECT 1").is_some());
    pg.sql(&format!(
        "CREATE TABLE t (k int PRIMARY KEY, v text); \
         INSERT INTO t SELECT i, md5(i::text) FROM generate_series(1, {ROWS}) i"
    ));
    (p, pg)
}

/// The postmaster's long-lived children (checkpointer, background writer, WAL writer, launchers), by
/// PID: backends and autovacuum workers come and go.
fn background_workers(postmaster: i32) -> Vec<(i32, String)> {
    children(postmaster)
        .into_iter()
        .filter_map(|c| {
            let cmd = std::fs::read(format!("/proc/{c}/cmdline")).ok()?;
            let cmd = text(&cmd).replace('\0', " ").trim().to_string();
            let long_lived = ["checkpointer", "background writer", "walwriter", "launcher"]
                .iter()
                .any(|w| cmd.contains(w));
            long_lived.then_some((c, cmd))
        })
        .collect()
}

fn postgres_round(via: Via, mode: Mode, t: &PgTemplate) {
    let work = tempfile::tempdir().unwrap();
    let (p, pg) = start_postgres(t, work.path(), true);
    let before = pg.state();
    assert!(before.starts_with(&format!("{ROWS}|")), "{before}");
    let workers = background_workers(p.pid);
    assert!(
        workers.len() >= 3,
        "postgres has its background workers: {workers:?}"
    );
    wait_no_connections(pg.port);

    let taken = via.checkpoint(mode, p.pid, work.path(), &[], || {
        assert_eq!(pg.state(), before, "the original answers on");
    });
    taken.restore(p.pid, &[]);

    assert_eq!(pg.state(), before, "every row back, the same checksum");
    assert_eq!(
        background_workers(p.pid),
        workers,
        "the same background workers"
    );
    pg.sql("INSERT INTO t SELECT i, md5(i::text) FROM generate_series(10001, 10010) i");
    assert!(
        pg.state().starts_with(&format!("{}|", ROWS + 10)),
        "the restored server takes writes"
    );
}

/// The template, when PostgreSQL and a C compiler are there (and root and CRIU).
fn postgres_template() -> Option<PgTemplate> {
    let bin = postgres_bin()?;
    has_cc().then(|| PgTemplate::new(bin))
}

/// A C compiler (for the PostgreSQL shim); Rust needs one to link, so CI has it.
fn has_cc() -> bool {
    let found = Command::new("cc").arg("--version").output().is_ok();
    found || missing::<()>("no C compiler (cc): the PostgreSQL test builds a shim").is_some()
}

both_modes!("PostgreSQL in its own IPC namespace", postgres_template(), postgres_round;
    postgres_in_its_own_ipc_namespace_comes_back_with_its_rows,
    postgres_in_its_own_ipc_namespace_comes_back_after_a_leave_running_checkpoint);

/// In the host's IPC namespace, postgres's SysV segment is what CRIU cannot dump: refused before anything
/// is touched (plain CRIU fails after freezing it: "doesn't live in IPC ns"), and postgres answers on.
#[test]
fn postgres_in_the_hosts_ipc_namespace_is_refused_and_keeps_answering() {
    let Some(t) = postgres_template() else { return };
    let work = tempfile::tempdir().unwrap();
    let (p, pg) = start_postgres(&t, work.path(), false);
    let before = pg.state();
    refused(
        "PostgreSQL in the host's IPC namespace",
        p.pid,
        &[],
        &["sysv-shm", "unshare --ipc"],
    );
    assert_eq!(pg.state(), before, "postgres answers on");
}

// ---------------------------------------------------------------------------------------------------
// MariaDB

const MEMORY_ROWS: usize = 2000;

/// `mariadbd` and the `mariadb` client, when root and CRIU are there too.
fn mariadb() -> Option<(PathBuf, PathBuf)> {
    let server = program("mariadbd", "mariadb-server")?;
    let client = program("mariadb", "mariadb-client")?;
    Some((server, client))
}

/// A database made once per test (`mariadb-install-db`, in the folder returned), which each round copies.
fn maria_template() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    run_ok(
        Command::new("mariadb-install-db")
            .args([
                "--no-defaults",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ])
            .arg(format!("--datadir={}", data.display())),
    );
    dir
}

/// A server in a private folder, reached through its socket there (`mariadb -N -B`).
struct Maria(Sql);

impl std::ops::Deref for Maria {
    type Target = Sql;
    fn deref(&self) -> &Sql {
        &self.0
    }
}

impl Maria {
    /// `rows checksum` of the MEMORY table and of the InnoDB one.
    fn state(&self) -> String {
        self.sql(
            "SELECT count(*), md5(group_concat(v ORDER BY k)) FROM d.m; \
             SELECT count(*), md5(group_concat(v ORDER BY k)) FROM d.i",
        )
    }
}

/// Starts mariadbd on a copy of the template, with native AIO (io_uring) or without, and fills a
/// MEMORY table and an InnoDB table.
fn start_mariadb(
    (server, client, template): (&Path, &Path, &Path),
    dir: &Path,
    native_aio: bool,
) -> (Program, Maria) {
    let data = dir.join("data");
    copy_dir(&template.join("data"), &data);
    let tmp = dir.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let socket = dir.join("mysqld.sock");
    let mut argv: Vec<std::ffi::OsString> = vec![client.into()];
    argv.extend(["--no-defaults", "-uroot", "-N", "-B", "-S"].map(Into::into));
    argv.extend([socket.clone().into(), "-e".into()]);
    let m = Maria(Sql { argv });
    let mut argv: Vec<String> = vec![
        server.display().to_string(),
        "--no-defaults".into(),
        format!("--datadir={}", data.display()),
        format!("--socket={}", socket.display()),
        format!("--port={}", free_port()),
        "--bind-address=127.0.0.1".into(),
        "--user=root".into(),
        format!("--tmpdir={}", tmp.display()),
        format!("--pid-file={}", dir.join("mysqld.pid").display()),
        format!("--log-error={}", dir.join("error.log").display()),
        "--innodb-buffer-pool-size=32M".into(),
    ];
    if !native_aio {
        argv.push("--innodb-use-native-aio=0".into());
    }
    let p = Program::start(&argv);
    wait_for("mariadbd answering", || m.try_sql("SELECT 1").is_some());
    m.sql(&format!(
        "CREATE DATABASE d; USE d; \
         CREATE TABLE d.m (k INT PRIMARY KEY, v VARCHAR(64)) ENGINE=MEMORY; \
         CREATE TABLE d.i (k INT PRIMARY KEY, v VARCHAR(64)) ENGINE=InnoDB; \
         INSERT INTO d.m SELECT seq, md5(seq) FROM seq_1_to_{MEMORY_ROWS}; \
         INSERT INTO d.i SELECT seq, sha1(seq) FROM seq_1_to_{MEMORY_ROWS}"
    ));
    (p, m)
}

fn mariadb_round(via: Via, mode: Mode, server: (&Path, &Path, &Path)) {
    let work = tempfile::tempdir().unwrap();
    let (p, m) = start_mariadb(server, work.path(), false);
    let before = m.state();
    assert!(before.starts_with(&format!("{MEMORY_ROWS}\t")), "{before}");

    // Aria holds POSIX locks on its control file: CRIU needs --file-locks (plain CRIU too, on restore).
    let taken = via.checkpoint(mode, p.pid, work.path(), &["--file-locks"], || {
        assert_eq!(m.state(), before, "the original answers on");
    });
    taken.restore(p.pid, &["--file-locks"]);

    assert_eq!(
        m.state(),
        before,
        "the MEMORY table (only in the process's memory) and the InnoDB table back, row for row"
    );
    m.sql("INSERT INTO d.m VALUES (100000, 'after'); INSERT INTO d.i VALUES (100000, 'after')");
    assert_eq!(
        m.sql("SELECT count(*) FROM d.m; SELECT count(*) FROM d.i"),
        format!("{}\n{}", MEMORY_ROWS + 1, MEMORY_ROWS + 1),
        "the restored server takes writes"
    );
}

fn mariadb_server(mode: Mode) {
    let Some((server, client)) = mariadb() else {
        return;
    };
    let template = maria_template();
    Via::each(&format!("MariaDB with a MEMORY table, {mode}"), |via| {
        mariadb_round(via, mode, (&server, &client, template.path()))
    });
}

both_modes!(mariadb_server:
    mariadb_comes_back_with_its_memory_table,
    mariadb_comes_back_with_its_memory_table_after_a_leave_running_checkpoint);

/// Stock MariaDB does InnoDB's asynchronous I/O through io_uring, which CRIU cannot dump ("Unknown shit 600
/// (anon_inode:[io_uring])" after the freeze): refused before anything is touched, naming the remedy,
/// and it answers on.
#[test]
fn stock_mariadb_with_io_uring_is_refused_and_keeps_answering() {
    let Some((server, client)) = mariadb() else {
        return;
    };
    let template = maria_template();
    let work = tempfile::tempdir().unwrap();
    let (p, m) = start_mariadb((&server, &client, template.path()), work.path(), true);
    let uring = std::fs::read_dir(format!("/proc/{}/fd", p.pid))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .any(|l| l.to_str() == Some("anon_inode:[io_uring]"));
    if !uring {
        // A kernel without io_uring (or one that denies it): MariaDB falls back; nothing to refuse.
        eprintln!("this MariaDB holds no io_uring instance here (kernel without io_uring?)");
        return;
    }
    let before = m.state();
    refused(
        "stock MariaDB (io_uring)",
        p.pid,
        &["--file-locks"],
        &["io-uring", "--innodb-use-native-aio=0"],
    );
    assert_eq!(m.state(), before, "MariaDB answers on");
}

// ---------------------------------------------------------------------------------------------------
// memcached

const MC_KEYS: usize = 300;

/// One memcached text-protocol session: sends `req`, reads until the answer ends with `end`.
fn memcached(port: u16, req: &[u8], end: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect to memcached");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(req).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    while !got.ends_with(end) {
        let n = s.read(&mut buf).expect("read from memcached");
        assert!(n > 0, "memcached closed: {}", text(&got));
        got.extend_from_slice(&buf[..n]);
    }
    got
}

fn mc_get_all(port: u16) -> Vec<u8> {
    let keys: Vec<String> = (0..MC_KEYS).map(|i| format!("k{i}")).collect();
    memcached(
        port,
        format!("get big {}\r\n", keys.join(" ")).as_bytes(),
        b"END\r\n",
    )
}

fn memcached_round(via: Via, mode: Mode, bin: &Path) {
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let p = Program::start(&[
        bin.display().to_string(),
        "-l".into(),
        "127.0.0.1".into(),
        "-p".into(),
        port.to_string(),
        "-U".into(),
        "0".into(),
        "-u".into(),
        "root".into(),
        "-m".into(),
        "64".into(),
        "-t".into(),
        "4".into(),
    ]);
    wait_for("memcached answering", || {
        TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let mut set = Vec::new();
    for i in 0..MC_KEYS {
        let v = format!("value-{i}-{via}-{mode}");
        set.extend(format!("set k{i} 0 0 {}\r\n{v}\r\n", v.len()).bytes());
    }
    let big: Vec<u8> = (0..512 << 10).map(|i| (i % 251) as u8).collect();
    set.extend(format!("set big 7 0 {}\r\n", big.len()).bytes());
    set.extend(&big);
    set.extend(b"\r\n");
    let stored = memcached(port, &set, b"STORED\r\n".repeat(MC_KEYS + 1).as_slice());
    assert_eq!(stored, b"STORED\r\n".repeat(MC_KEYS + 1));
    let before = mc_get_all(port);
    wait_no_connections(port);

    let taken = via.checkpoint(mode, p.pid, work.path(), &[], || {
        assert!(mc_get_all(port) == before, "the original serves on");
    });
    taken.restore(p.pid, &[]);

    assert!(
        mc_get_all(port) == before,
        "every value back, byte for byte"
    );
    let stats = text(&memcached(port, b"stats\r\n", b"END\r\n"));
    let pid = BufReader::new(stats.as_bytes())
        .lines()
        .map_while(Result::ok)
        .find_map(|l| l.strip_prefix("STAT pid ").map(str::to_string));
    assert_eq!(
        pid,
        Some(p.pid.to_string()),
        "the restored memcached answers"
    );
    let after = memcached(port, b"set after 0 0 1\r\nx\r\nget after\r\n", b"END\r\n");
    assert!(
        text(&after).contains("VALUE after 0 1\r\nx\r\n"),
        "it takes writes"
    );
}

both_modes!("memcached", program("memcached", "memcached"), memcached_round;
    memcached_comes_back_with_its_values,
    memcached_comes_back_with_its_values_after_a_leave_running_checkpoint);
