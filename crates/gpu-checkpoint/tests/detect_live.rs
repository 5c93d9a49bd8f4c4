//! Detection on live processes this test starts: shared-memory segments, variables, a process tree, a
//! process that exits during the scan, and bad input (kernel thread, thread id, missing pid).
//!
//! The workloads are this test binary itself, re-executed with `DETECT_LIVE_CHILD=<spec>` (see
//! [`live_child`]): no tool outside the repository is needed.

#![cfg(target_os = "linux")]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use gpu_checkpoint::detect::{detect_all, detect_pid, DetectOptions, Error, Report};
use gpu_checkpoint::Classify;
use gpu_checkpoint::ExitStatus;

const CHILD_ENV: &str = "DETECT_LIVE_CHILD";
/// What a workload prints once it has set everything up.
const READY: &str = "detect-live-workload-ready";

/// A workload started for one test; killed (and its files removed) when dropped.
struct Workload {
    child: Child,
    _stdin: ChildStdin,
    files: Vec<String>,
}

impl Workload {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for f in &self.files {
            let _ = std::fs::remove_file(f);
            if let Some(dir) = std::path::Path::new(f).parent() {
                if dir.starts_with("/dev/shm/gpu-checkpoint-sim") {
                    let _ = std::fs::remove_dir(dir);
                }
            }
        }
    }
}

/// A name unique to this test run and call.
fn unique(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Starts this binary as a workload that performs `spec` (`;`-separated actions, see [`act`]) and waits
/// until it says it is ready.
fn start(spec: &str, env: &[(&str, &str)]) -> Workload {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "live_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, spec)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        // Away from the terminal the tests may run in, and leading its own session, as a service: detect
        // would otherwise (rightly) say a checkpoint of it needs --shell-job.
        .stderr(Stdio::null());
    gpu_checkpoint::proc::in_own_session(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start workload");
    let stdin = child.stdin.take().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        if out.read_line(&mut line).unwrap() == 0 {
            panic!("workload `{spec}` exited before it was ready");
        }
        // libtest has printed `test live_child ... ` on the same line before the test ran.
        if line.contains(READY) {
            break;
        }
    }
    // Keep draining its output so that it never blocks on a full pipe.
    std::thread::spawn(move || for _ in out.lines() {});
    let files = spec
        .split(';')
        .filter_map(|a| a.strip_prefix("shm:"))
        .map(str::to_string)
        .collect();
    Workload {
        child,
        _stdin: stdin,
        files,
    }
}

/// The workload side. Actions: `shm:PATH` maps a 1 MiB file MAP_SHARED; `sock:NAME` binds an abstract
/// UNIX socket; `spawn:SPEC` starts a child workload (`,` separates its actions); `churn` starts and
/// reaps short-lived children without pause; `flock:PATH` holds a lock on a new file; `deleted:PATH`
/// keeps a 2 MiB file open and deletes it; `tcp-pair` holds both ends of an established loopback TCP
/// connection; `unix-pair` a UNIX socket pair; `dgram-to:PATH` a datagram socket connected to the one
/// bound at PATH. Then it prints `ready` and waits for stdin to close.
#[test]
fn live_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return; // run as an ordinary test: nothing to do
    };
    let mut keep: Vec<Box<dyn std::any::Any>> = Vec::new();
    for action in spec.split(';').filter(|a| !a.is_empty()) {
        act(action, &mut keep);
    }
    println!("{READY}");
    std::io::stdout().flush().unwrap();
    let mut sink = String::new();
    while std::io::stdin()
        .read_line(&mut sink)
        .map(|n| n > 0)
        .unwrap_or(false)
    {}
    drop(keep);
    // Leave before libtest reports: whoever read our output may be gone (a killed parent workload).
    std::process::exit(0);
}

fn act(action: &str, keep: &mut Vec<Box<dyn std::any::Any>>) {
    if let Some(path) = action.strip_prefix("shm:") {
        let p = std::path::Path::new(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(p)
            .unwrap();
        f.set_len(1 << 20).unwrap();
        // SAFETY: a fresh shared mapping of a file we own, never touched through a reference.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                1 << 20,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        keep.push(Box::new(f));
    } else if let Some(name) = action.strip_prefix("sock:") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        keep.push(Box::new(UnixListener::bind_addr(&addr).unwrap()));
    } else if let Some(sub) = action.strip_prefix("spawn:") {
        keep.push(Box::new(start(&sub.replace(',', ";"), &[])));
    } else if let Some(path) = action.strip_prefix("flock:") {
        let f = std::fs::File::create(path).unwrap();
        // SAFETY: flock on a descriptor we own.
        assert_eq!(
            unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX) },
            0
        );
        keep.push(Box::new(f));
    } else if let Some(path) = action.strip_prefix("deleted:") {
        // 2 MiB of data: what CRIU copies (and counts against --ghost-limit) is what the file holds on disk.
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(&vec![0xa5; 2 << 20]).unwrap();
        std::fs::remove_file(path).unwrap();
        keep.push(Box::new(f));
    } else if let Some(path) = action.strip_prefix("sparse-deleted:") {
        // 64 MiB long, 4 KiB of it data: CRIU copies the data only, and needs no --ghost-limit for it.
        let mut f = std::fs::File::create(path).unwrap();
        f.write_all(&[0xa5; 4096]).unwrap();
        f.set_len(64 << 20).unwrap();
        std::fs::remove_file(path).unwrap();
        keep.push(Box::new(f));
    } else if action == "tcp-pair" {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        keep.push(Box::new((listener, client, server)));
    } else if action == "unix-pair" {
        keep.push(Box::new(std::os::unix::net::UnixStream::pair().unwrap()));
    } else if let Some(path) = action.strip_prefix("dgram-to:") {
        let s = std::os::unix::net::UnixDatagram::unbound().unwrap();
        s.connect(path).unwrap();
        keep.push(Box::new(s));
    } else if action == "churn" {
        std::thread::spawn(|| loop {
            let _ = Command::new("true").status();
        });
    } else {
        panic!("unknown workload action {action}");
    }
}

fn live(simulator: bool, tree: bool) -> DetectOptions {
    DetectOptions {
        tree,
        simulator,
        ..DetectOptions::default()
    }
}

fn kinds(r: &Report) -> Vec<&'static str> {
    let mut k: Vec<&str> = r.findings.iter().map(|f| f.kind.as_str()).collect();
    k.sort_unstable();
    k.dedup();
    k
}

#[test]
fn shared_segments_and_variables() {
    let nccl = format!("/dev/shm/nccl-{}", unique("live"));
    let w = start(
        &format!("shm:{nccl}"),
        &[
            ("CUDA_VISIBLE_DEVICES", "0"),
            ("NCCL_DEBUG", "INFO"),
            ("SECRET_TOKEN", "hunter2"),
        ],
    );
    let r = detect_pid(w.pid(), &live(false, false)).unwrap();
    assert_eq!(r.processes.len(), 1);
    assert_eq!(r.processes[0].pid, w.pid());
    assert!(!r.gpu, "variables and a shared segment are not GPU state");
    assert_eq!(r.strategy.name.as_str(), "none");
    assert_eq!(kinds(&r), vec!["gpu-env", "nccl"]);
    let seg = r
        .findings
        .iter()
        .find(|f| f.evidence.path.as_deref() == Some(nccl.as_str()))
        .expect("the NCCL segment is found");
    assert_eq!(seg.evidence.size, Some(1 << 20));
    assert_eq!(seg.evidence.mappings, Some(1));
    assert_eq!(seg.evidence.fds.len(), 1, "the workload keeps its fd open");
    let var = |v: &str| {
        r.findings
            .iter()
            .any(|f| f.evidence.variable.as_deref() == Some(v))
    };
    assert!(var("CUDA_VISIBLE_DEVICES=0"));
    assert!(var("NCCL_DEBUG=INFO"));
    assert!(!serde_json::to_string(&r).unwrap().contains("hunter2"));
}

/// A held flock, a deleted 2 MiB file, an established loopback TCP pair and a datagram socket connected
/// outside the tree are each named with the flag CRIU needs for it; a UNIX socket pair within the process
/// and a deleted sparse file of 64 MiB holding 4 KiB (CRIU counts its blocks, as zdtm's unlink_largefile
/// shows) need none. Nothing blocks.
#[test]
fn what_criu_needs_an_option_for() {
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("log.sock");
    let _bound = std::os::unix::net::UnixDatagram::bind(&outside).unwrap();
    let lock = dir.path().join("held.lock");
    let scratch = dir.path().join("scratch");
    let sparse = dir.path().join("sparse");
    let w = start(
        &format!(
            "flock:{};deleted:{};sparse-deleted:{};tcp-pair;unix-pair;dgram-to:{}",
            lock.display(),
            scratch.display(),
            sparse.display(),
            outside.display()
        ),
        &[],
    );
    let r = detect_pid(w.pid(), &live(false, true)).unwrap();
    assert_eq!(r.strategy.name.as_str(), "none");
    assert!(r.strategy.blockers.is_empty() && !r.gpu);
    let flags: Vec<String> = r
        .findings
        .iter()
        .filter_map(|f| f.evidence.needs.as_ref().map(|n| n.flag()))
        .collect();
    let unix_diag = gpu_checkpoint::detect::unix_diag::unix_sockets().is_ok();
    let mut want = vec!["--file-locks", "--ghost-limit 2M", "--tcp-established"];
    if unix_diag {
        want.push("--ext-unix-sk");
    }
    assert_eq!(flags, want, "{:#?}", r.findings);
    let by_flag = |flag: &str| {
        &r.findings
            .iter()
            .find(|f| f.evidence.needs.as_ref().is_some_and(|n| n.flag() == flag))
            .unwrap()
            .evidence
    };
    assert_eq!(
        by_flag("--file-locks").path.as_deref(),
        lock.to_str(),
        "the locked file"
    );
    assert_eq!(by_flag("--ghost-limit 2M").size, Some(2 << 20));
    assert_eq!(
        by_flag("--ghost-limit 2M").path.as_deref(),
        scratch.to_str()
    );
    assert_eq!(by_flag("--tcp-established").fds.len(), 2, "both ends");
    if unix_diag {
        assert_eq!(by_flag("--ext-unix-sk").socket.as_deref(), outside.to_str());
    }
}

#[test]
fn simulated_gpu_process_only_with_simulator() {
    let id = unique("live");
    let device = format!("/dev/shm/gpu-checkpoint-sim/{id}/device");
    let other = format!("/dev/shm/{id}-staging");
    let w = start(
        &format!("shm:{device};shm:{other};sock:gpu-checkpoint-sim/{id}"),
        &[],
    );

    let r = detect_pid(w.pid(), &live(true, false)).unwrap();
    assert!(r.gpu);
    assert!(r.processes[0].simulated);
    assert_eq!(r.strategy.name.as_str(), "cuda-driver");
    assert!(r.strategy.blockers.is_empty(), "{:?}", r.strategy.blockers);
    let mem = r
        .findings
        .iter()
        .find(|f| f.kind.as_str() == "device-mapping")
        .expect("simulated device memory");
    assert!(mem.evidence.simulated);
    assert_eq!(mem.evidence.path.as_deref(), Some(device.as_str()));
    assert_eq!(mem.evidence.size, Some(1 << 20));
    let sock = r
        .findings
        .iter()
        .find(|f| f.evidence.socket.is_some())
        .expect("control socket");
    assert_eq!(sock.kind.as_str(), "cuda-library");
    assert_eq!(
        sock.evidence.socket.as_deref(),
        Some(format!("@gpu-checkpoint-sim/{id}").as_str())
    );
    // Other shared segments of a GPU process are reported (they may carry IPC handles) but do not block.
    assert!(r.findings.iter().any(
        |f| f.kind.as_str() == "cuda-ipc" && f.evidence.path.as_deref() == Some(other.as_str())
    ));

    // Without --simulator the same process is an ordinary one.
    let r = detect_pid(w.pid(), &live(false, false)).unwrap();
    assert!(!r.gpu && !r.processes[0].simulated);
    assert_eq!(r.strategy.name.as_str(), "none");
    assert!(r.findings.is_empty(), "{:?}", r.findings);
}

#[test]
fn process_tree() {
    let id = unique("live");
    let device = format!("/dev/shm/gpu-checkpoint-sim/{id}/device");
    // parent (no GPU) -> child (no GPU) -> grandchild (simulated GPU)
    let w = start(&format!("spawn:spawn:shm:{device}"), &[]);
    let r = detect_pid(w.pid(), &live(true, true)).unwrap();
    assert_eq!(r.processes.len(), 3, "{:?}", r.processes);
    assert_eq!(r.processes[0].pid, w.pid());
    let gpu: Vec<_> = r.processes.iter().filter(|p| p.simulated).collect();
    assert_eq!(gpu.len(), 1);
    let child = r.processes.iter().find(|p| p.ppid == w.pid()).unwrap();
    assert_eq!(gpu[0].ppid, child.pid, "the grandchild holds the device");
    assert_eq!(r.strategy.name.as_str(), "cuda-driver");
    assert!(r.simulated());

    let alone = detect_pid(w.pid(), &live(true, false)).unwrap();
    assert_eq!(alone.processes.len(), 1);
    assert_eq!(alone.strategy.name.as_str(), "none");

    // The node-wide scan finds the grandchild and not its ancestors.
    let all = detect_all(&live(true, false)).unwrap();
    assert!(all.processes.iter().any(|p| p.pid == gpu[0].pid));
    assert!(!all
        .processes
        .iter()
        .any(|p| p.pid == w.pid() || p.pid == child.pid));
}

#[test]
fn processes_exiting_during_the_scan() {
    let w = start("churn", &[]);
    let mut max_seen = 0;
    for _ in 0..200 {
        let r = detect_pid(w.pid(), &live(false, true))
            .unwrap_or_else(|e| panic!("a child exiting mid-scan must not fail the scan: {e}"));
        assert_eq!(r.processes[0].pid, w.pid());
        max_seen = max_seen.max(r.processes.len());
    }
    for _ in 0..5 {
        detect_all(&live(true, false))
            .unwrap_or_else(|e| panic!("--all with exiting processes: {e}"));
    }
    println!("saw up to {max_seen} process(es) in the churning tree");

    // The target itself gone: a clear "no such process".
    let mut w = w;
    let pid = w.pid();
    w.child.kill().unwrap();
    w.child.wait().unwrap();
    let e = detect_pid(pid, &live(false, false)).unwrap_err();
    assert!(matches!(e, Error::NoSuchProcess { .. }), "{e}");
    assert_eq!(e.exit_status(), ExitStatus::NoSuchProcess);
}

#[test]
fn bad_input_on_the_live_proc() {
    // A kernel thread, where this /proc shows one (not inside every container).
    let kthread = std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                let flags: u64 = s[s.rfind(')').unwrap() + 1..]
                    .split_whitespace()
                    .nth(6)
                    .and_then(|f| f.parse().ok())
                    .unwrap_or(0);
                flags & 0x0020_0000 != 0
            })
        });
    match kthread {
        Some(pid) => {
            let e = detect_pid(pid, &live(false, false)).unwrap_err();
            assert!(matches!(e, Error::KernelThread { .. }), "{e}");
            assert_eq!(e.exit_status(), ExitStatus::Usage);
        }
        None => println!("skipped the kernel-thread case: this /proc shows no kernel thread"),
    }

    // A thread id of this process.
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        tx.send(unsafe { libc::gettid() }).unwrap();
        let _ = done_rx.recv();
    });
    let tid = rx.recv().unwrap();
    let e = detect_pid(tid, &live(false, false)).unwrap_err();
    assert!(
        matches!(e, Error::Thread { tgid, .. } if tgid == std::process::id() as i32),
        "{e}"
    );
    drop(done_tx);
    t.join().unwrap();

    // A pid above the kernel's limit cannot exist.
    let e = detect_pid(i32::MAX, &live(false, false)).unwrap_err();
    assert!(matches!(e, Error::NoSuchProcess { .. }), "{e}");

    // This process itself: fine, and fast enough to be unremarkable.
    let me = detect_pid(std::process::id() as i32, &live(false, false)).unwrap();
    assert_eq!(me.strategy.name.as_str(), "none");
}

#[test]
fn all_leaves_out_the_scanning_process() {
    let id = unique("live-self");
    let device = format!("/dev/shm/gpu-checkpoint-sim/{id}/device");
    let mut keep = Vec::new();
    act(&format!("shm:{device}"), &mut keep);
    let me = std::process::id() as i32;
    // This process now holds (simulated) GPU state: asked about directly, it says so...
    let r = detect_pid(me, &live(true, false));
    // ...but a node scan leaves out the process that scans (NVML opens /dev/nvidiactl in it).
    let all = detect_all(&live(true, false));
    let _ = std::fs::remove_file(&device);
    let _ = std::fs::remove_dir(std::path::Path::new(&device).parent().unwrap());
    assert!(r.unwrap().processes[0].simulated);
    assert!(!all.unwrap().processes.iter().any(|p| p.pid == me));
}
