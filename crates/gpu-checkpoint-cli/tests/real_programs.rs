//! Real programs nobody here wrote (issue 14), each checkpointed with `gpu-checkpoint checkpoint --pid
//! PID --storage DIR`, restored with `gpu-checkpoint restore ID --storage DIR` (the default restore) and
//! checked by its own client: redis-server (keys read back with redis-cli, writes taken), an nginx
//! master with two workers (a page served byte for byte, the same workers, a reload starting new ones),
//! and a Python multiprocessing pool updating shared memory (every worker going on, the shared state
//! consistent). Each in both modes: stopped (the default) and `--leave-running`, the original killed
//! before its copy is restored. Each round also runs through plain `criu dump` / `criu restore -d` in
//! the same test, first: a failure of plain CRIU is reported loudly and does not fail the test, ours
//! does.
//!
//! Every program listens on 127.0.0.1 only, on a port the test chose, and keeps its files in a private
//! temporary folder. Needs root, CRIU, redis-server and redis-cli, nginx and python3 (`scripts/setup.sh`
//! installs them): fails in CI without them, skips locally with the reason.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::programs::*;
use common::*;

/// Random bytes, reproducible from `seed`.
fn random_bytes(seed: &str, len: usize) -> Vec<u8> {
    let mut out = vec![0; len];
    blake3::Hasher::new()
        .update(seed.as_bytes())
        .finalize_xof()
        .fill(&mut out);
    out
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------------
// redis

const KEYS: usize = 1000;
const BIG_MIB: usize = 8;

/// redis-cli talking to the server on `port`; each command is one connection, closed when it returns.
struct RedisCli {
    cli: PathBuf,
    port: u16,
}

impl RedisCli {
    /// `redis-cli ARGS` with `stdin` (for `-x`): its stdout (raw, since it is not a terminal: each
    /// value on a line), or None when it failed (the server not up yet).
    fn try_cmd(&self, args: &[&str], stdin: &[u8]) -> Option<Vec<u8>> {
        let mut child = Command::new(&self.cli)
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run redis-cli");
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin).unwrap();
        drop(input);
        let out = child.wait_with_output().unwrap();
        // redis-cli exits 0 on some errors; an error reply starts with ERR or says it could not connect.
        let failed = !out.status.success()
            || out.stdout.starts_with(b"ERR")
            || text(&out.stderr).contains("Could not connect");
        (!failed).then_some(out.stdout)
    }

    fn cmd(&self, args: &[&str]) -> Vec<u8> {
        self.cmd_in(args, b"")
    }

    fn cmd_in(&self, args: &[&str], stdin: &[u8]) -> Vec<u8> {
        self.try_cmd(args, stdin)
            .unwrap_or_else(|| panic!("redis-cli {:?} failed", &args[..args.len().min(2)]))
    }

    fn text(&self, args: &[&str]) -> String {
        text(&self.cmd(args)).trim().to_string()
    }
}

/// redis-server with 1000 keys and one 8 MiB value, checkpointed through `via` in `mode` with no
/// client connected, restored: every key reads back, the server takes writes, and it holds the
/// checkpoint's data (a key set on a `--leave-running` original after the checkpoint is not there).
fn redis_round(via: Via, mode: Mode, server: &Path, cli: &Path) {
    let work = tempfile::tempdir().unwrap();
    let port = free_port();
    let p = Program::start(&[
        server.as_os_str(),
        "--port".as_ref(),
        port.to_string().as_ref(),
        "--bind".as_ref(),
        "127.0.0.1".as_ref(),
        "--save".as_ref(),
        "".as_ref(),
        "--appendonly".as_ref(),
        "no".as_ref(),
        "--daemonize".as_ref(),
        "no".as_ref(),
        "--dir".as_ref(),
        work.path().as_os_str(),
    ]);
    let r = RedisCli {
        cli: cli.to_path_buf(),
        port,
    };
    wait_for("redis-server answering", || {
        r.try_cmd(&["PING"], b"").is_some_and(|o| o == b"PONG\n")
    });

    let seed = format!("{via} {mode} {}", p.pid);
    let keys: Vec<String> = (0..KEYS).map(|i| format!("key:{i}")).collect();
    let values: Vec<String> = (0..KEYS)
        .map(|i| format!("{i}:{}", hex(&random_bytes(&format!("{seed} {i}"), 16))))
        .collect();
    let mut mset = vec!["MSET"];
    for (k, v) in keys.iter().zip(&values) {
        mset.extend([k.as_str(), v.as_str()]);
    }
    assert_eq!(r.text(&mset), "OK");
    let big = hex(&random_bytes(&seed, BIG_MIB << 19)).into_bytes();
    assert_eq!(text(&r.cmd_in(&["-x", "SET", "big"], &big)).trim(), "OK");
    assert_eq!(r.text(&["DBSIZE"]), (KEYS + 1).to_string());
    wait_no_connections(port);

    let taken = via.checkpoint(mode, p.pid, work.path(), &[], || {
        assert_eq!(r.text(&["SET", "after-checkpoint", "1"]), "OK");
        assert_eq!(r.text(&["GET", "after-checkpoint"]), "1");
    });
    taken.restore(p.pid, &[]);

    let mut mget = vec!["MGET"];
    mget.extend(keys.iter().map(String::as_str));
    let got = text(&r.cmd(&mget));
    assert!(
        got.lines().eq(values.iter().map(String::as_str)),
        "the {KEYS} keys read back as set"
    );
    let mut want = big;
    want.push(b'\n');
    assert!(r.cmd(&["GET", "big"]) == want, "the 8 MiB value reads back");
    assert_eq!(
        r.text(&["DBSIZE"]),
        (KEYS + 1).to_string(),
        "the checkpoint's keys, nothing set after it"
    );
    assert_eq!(r.text(&["SET", "after-restore", "2"]), "OK");
    assert_eq!(r.text(&["GET", "after-restore"]), "2");
    let info = r.text(&["INFO", "server"]);
    assert!(
        info.contains(&format!("process_id:{}", p.pid)),
        "the server answering is the restored one: {info}"
    );
}

fn redis_server(mode: Mode) {
    let Some(server) = program("redis-server", "redis-server") else {
        return;
    };
    let Some(cli) = program("redis-cli", "redis-tools") else {
        return;
    };
    Via::each(&format!("redis-server, {mode}"), |via| {
        redis_round(via, mode, &server, &cli)
    });
}

both_modes!(redis_server:
    redis_server_comes_back_with_its_keys,
    redis_server_comes_back_with_its_keys_after_a_leave_running_checkpoint);

// ---------------------------------------------------------------------------------------------------
// nginx

const WORKERS: usize = 2;

/// `GET PATH` from 127.0.0.1:`port` over HTTP/1.0: the body of a 200 answer, or None.
fn http_get(port: u16, path: &str) -> Option<Vec<u8>> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).ok()?;
    let end = answer.windows(4).position(|w| w == b"\r\n\r\n")?;
    answer
        .starts_with(b"HTTP/1.1 200 ")
        .then(|| answer[end + 4..].to_vec())
}

/// Whether this process has CAP_SYS_RESOURCE. Without it CRIU cannot read the resource limits of a
/// process of another user (`Can't get rlimit 0: Operation not permitted`, plain CRIU and ours alike),
/// so nginx's workers then run as root instead of nginx's default, nobody.
fn has_cap_sys_resource() -> bool {
    gpu_checkpoint::detect::limits::has_cap_sys_resource()
}

/// The command line of `pid`, its NULs as spaces.
fn cmdline(pid: i32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    text(&raw).replace('\0', " ").trim().to_string()
}

/// An nginx master with two workers serving a 1 MiB file, configured in a private folder, checkpointed
/// through `via` in `mode` with no client connected, restored: the page is served byte for byte, the
/// master has its two workers (the same PIDs), and a reload (SIGHUP) replaces them with two new ones,
/// which serve the page too.
fn nginx_round(via: Via, mode: Mode, nginx: &Path) {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path();
    let html = dir.join("html");
    std::fs::create_dir(&html).unwrap();
    let page = random_bytes(&format!("{via} {mode} page"), 1 << 20);
    std::fs::write(html.join("page.bin"), &page).unwrap();
    let user = if has_cap_sys_resource() {
        // Workers as nginx's default user, nobody, who must reach the page: the folder traversable,
        // not listable (its name is random), the page readable.
        use std::os::unix::fs::PermissionsExt;
        for (p, mode) in [(dir, 0o711), (html.as_path(), 0o755)] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        std::fs::set_permissions(
            html.join("page.bin"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        ""
    } else {
        eprintln!(
            "nginx's workers run as root: without CAP_SYS_RESOURCE CRIU cannot dump another user's process"
        );
        "user root;\n"
    };
    let port = free_port();
    let d = dir.display();
    let conf = dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "daemon off;\nmaster_process on;\nworker_processes {WORKERS};\n{user}\
             pid {d}/nginx.pid;\nerror_log {d}/error.log;\n\
             events {{ worker_connections 64; }}\n\
             http {{\n  access_log {d}/access.log;\n  client_body_temp_path {d}/body;\n  \
             proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  \
             scgi_temp_path {d}/scgi;\n  server {{ listen 127.0.0.1:{port}; root {html}; }}\n}}\n",
            html = html.display()
        ),
    )
    .unwrap();
    let p = Program::start(&[
        nginx.as_os_str(),
        "-c".as_ref(),
        conf.as_os_str(),
        "-p".as_ref(),
        dir.as_os_str(),
        "-e".as_ref(),
        dir.join("error.log").as_os_str(),
    ]);
    let serves = || http_get(port, "/page.bin").is_some_and(|b| b == page);
    let workers_up = |pid: i32| {
        let w = children(pid);
        w.len() == WORKERS && w.iter().all(|&c| cmdline(c) == "nginx: worker process")
    };
    wait_for("nginx's workers serving the page", || {
        workers_up(p.pid) && serves()
    });
    let workers = children(p.pid);
    wait_no_connections(port);

    let taken = via.checkpoint(mode, p.pid, dir, &[], || {
        assert!(serves(), "the original serves the page on");
    });
    taken.restore(p.pid, &[]);

    assert_eq!(children(p.pid), workers, "the master has its workers back");
    assert!(workers_up(p.pid));
    for _ in 0..8 {
        assert!(
            serves(),
            "the restored workers serve the page byte for byte"
        );
    }
    // The master still manages its workers: a reload replaces them.
    // SAFETY: kill has no memory preconditions; p.pid is the restored master.
    assert_eq!(unsafe { libc::kill(p.pid, libc::SIGHUP) }, 0);
    wait_for("a reload replacing the workers", || {
        workers_up(p.pid) && children(p.pid).iter().all(|c| !workers.contains(c))
    });
    assert!(serves(), "the new workers serve the page");
}

both_modes!("nginx master with workers", program("nginx", "nginx"), nginx_round;
    nginx_master_comes_back_with_its_workers,
    nginx_master_comes_back_with_its_workers_after_a_leave_running_checkpoint);

// ---------------------------------------------------------------------------------------------------
// Python multiprocessing

/// A `multiprocessing` pool (fork) of two workers sharing memory with the parent: under the lock of a
/// shared counter array, worker i counts its slot up and fills its 4 KiB region of a shared byte
/// array with the count. The parent, every 20 ms, copies counts and bytes under the same lock and
/// reports (a JSON line, [`REPORT_PY`]): its round, the counts, the workers' PIDs, the SHA-256 of the
/// shared bytes and the SHA-256 the counts call for (equal when the shared state is consistent).
const POOL: &str = r#"
import hashlib, json, multiprocessing as mp, os, sys, time
N, SLOT = 2, 4096

def init(counts, data, pids):
    global C, D, P
    C, D, P = counts, memoryview(data).cast("B"), pids

def work(i):
    P[i] = os.getpid()
    while True:
        with C.get_lock():
            n = C[i] + 1
            D[i * SLOT:(i + 1) * SLOT] = bytes([n % 251]) * SLOT
            C[i] = n
        time.sleep(0.01)

if __name__ == "__main__":
    report = reporter(sys.argv[1])
    ctx = mp.get_context("fork")
    counts = ctx.Array("q", N)
    data = ctx.RawArray("B", N * SLOT)
    pids = ctx.RawArray("q", N)
    pool = ctx.Pool(N, initializer=init, initargs=(counts, data, pids))
    running = pool.map_async(work, range(N), chunksize=1)
    rounds = 0
    while True:
        with counts.get_lock():
            c, d = list(counts), bytes(data)
        want = b"".join(bytes([x % 251]) * SLOT for x in c)
        rounds += 1
        report(json.dumps({"rounds": rounds, "counts": c, "pids": list(pids),
                           "digest": hashlib.sha256(d).hexdigest(),
                           "expected": hashlib.sha256(want).hexdigest()}))
        time.sleep(0.02)
"#;

/// What the pool's parent last reported.
struct PoolState {
    counts: Vec<u64>,
    pids: Vec<i32>,
}

/// The parent's last report, once there is one; its checksum must verify.
fn pool_state(report: &Report) -> Option<PoolState> {
    let v: serde_json::Value = serde_json::from_str(&report.last()?).expect("a report is JSON");
    assert_eq!(
        v["digest"], v["expected"],
        "the shared bytes agree with the shared counts: {v}"
    );
    let nums = |k: &str| -> Vec<i64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_i64().unwrap())
            .collect()
    };
    Some(PoolState {
        counts: nums("counts").iter().map(|&n| n as u64).collect(),
        pids: nums("pids").iter().map(|&n| n as i32).collect(),
    })
}

/// Waits until every worker's count is `by` past `from`, the checksum verifying each time.
fn pool_going_on(report: &Report, pid: i32, from: &[u64], by: u64, what: &str) -> PoolState {
    let mut last = None;
    wait_for_or(
        what,
        || {
            last = pool_state(report)
                .filter(|s| s.counts.iter().zip(from).all(|(&c, &f)| c >= f + by));
            last.is_some()
        },
        || {
            format!(
                "counts from {from:?}; the last report: {:?}\n{}",
                report.last(),
                tree_report(pid)
            )
        },
    );
    last.unwrap()
}

/// The pool checkpointed through `via` in `mode`, restored: the same parent and workers (PIDs), every
/// worker counting on from where the checkpoint left it, the shared bytes consistent with the counts.
fn pool_round(via: Via, mode: Mode, py: &Path) {
    let work = tempfile::tempdir().unwrap();
    let (p, report) = Program::python(py, work.path(), "pool", POOL, &[]);
    let started = pool_going_on(&report, p.pid, &[0, 0], 10, "the workers counting");
    let mut workers = started.pids.clone();
    workers.sort();
    assert!(workers.iter().all(|&w| w > 0), "{workers:?}");
    assert_eq!(
        children(p.pid),
        workers,
        "the pool's workers are the children"
    );

    let mut at = None;
    let taken = via.checkpoint(mode, p.pid, work.path(), &[], || {
        let now = pool_state(&report).unwrap().counts;
        pool_going_on(
            &report,
            p.pid,
            &now,
            10,
            "the original's workers counting on",
        );
        at = Some(now);
    });
    // After a leave-running checkpoint the report shows where the original got to: at least where the
    // checkpoint left the copy. Marked, so that what shows next comes from the copy.
    let at_checkpoint = at.unwrap_or_else(|| pool_state(&report).unwrap().counts);
    report.mark();
    taken.restore(p.pid, &[]);

    let after = pool_going_on(
        &report,
        p.pid,
        &at_checkpoint,
        20,
        "the restored workers counting on",
    );
    assert_eq!(
        after.pids, started.pids,
        "the same workers in the same slots"
    );
    assert_eq!(children(p.pid), workers, "the parent has its workers back");
    // A while longer, still consistent (pool_state checks every read).
    pool_going_on(
        &report,
        p.pid,
        &after.counts,
        20,
        "the restored pool going on",
    );
}

both_modes!("a Python multiprocessing pool with shared memory", python(), pool_round;
    a_python_multiprocessing_pool_carries_on_with_its_shared_memory,
    a_python_multiprocessing_pool_carries_on_after_a_leave_running_checkpoint);
