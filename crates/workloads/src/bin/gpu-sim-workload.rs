//! gpu-sim-workload: a SIMULATED GPU process, for tests and demos on machines without a GPU.
//!
//! It behaves towards gpu-checkpoint the way a CUDA process behaves towards the driver:
//! * "device memory" is a `MAP_SHARED` mapping of `/dev/shm/gpu-checkpoint-sim/<pid>-dev<N>` (the
//!   simulated device), one per simulated GPU;
//! * worker threads keep running "kernels" on it: deterministic writes, so the content is a function of
//!   the per-worker step counters and can be verified at any time (`VERIFY`);
//! * a control channel, the abstract UNIX socket `@gpu-checkpoint-sim/<pid>`, answers the driver's
//!   checkpoint calls with its state machine and result codes: `STATE`, `LOCK <ms>`, `CHECKPOINT`,
//!   `RESTORE [old=new,...]`, `UNLOCK`, `RESTORE_TID`, plus `STATUS`, `VERIFY`, `FAULT <names|none>`;
//! * LOCK blocks new kernels and waits for the ones in flight, up to the timeout (then NOT_READY, and the
//!   process keeps running); CHECKPOINT copies device memory into ordinary process memory, replaces the
//!   device mapping with an inaccessible reservation and deletes the device file, so CRIU dumps plain
//!   memory; RESTORE maps a new device file at the same addresses and copies the contents back.
//! * faults can be injected at each step: `--fault NAME` (repeatable), `GPU_SIM_FAULTS=a,b`, the control
//!   message `FAULT a,b`, or the file named by `GPU_SIM_FAULT_FILE` (read at every call, so it reaches a
//!   copy restored by CRIU). Names: `lock-timeout`, `checkpoint`, `restore`, `restore-oom`.
//!
//! Options: `--devices N` (1), `--mib M` per device (8), `--workers W` (2), `--kernel-us U` (200),
//! `--children K` (K more simulated GPU processes, forked: a process tree), `--cpu-children K` (children
//! with no GPU at all), `--idle-children K` (children like `--no-context`), `--no-context` (answers like
//! a process that loaded libcuda but made no context: no device memory, NOT_INITIALIZED),
//! `--daemon` (detach: fork + setsid, prints the PID once ready), `--pidfile PATH`, `--log PATH`.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io::{BufRead, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

const SHM_DIR: &str = "/dev/shm/gpu-checkpoint-sim";
/// Words per block: one kernel writes one block.
const BLOCK_WORDS: usize = 512;
/// UUID prefix of simulated GPUs (the library's `sim_gpu_uuid`): "Qmgp".
const UUID_PREFIX: &str = "GPU-516d6770-";

// CUresult codes the simulator answers with (cuda.h numbers).
const INVALID_VALUE: i32 = 1;
const OUT_OF_MEMORY: i32 = 2;
const NOT_INITIALIZED: i32 = 3;
const INVALID_DEVICE: i32 = 101;
const OPERATING_SYSTEM: i32 = 304;
const ILLEGAL_STATE: i32 = 401;
const NOT_READY: i32 = 600;
const NOT_SUPPORTED: i32 = 801;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Running,
    Locked,
    Checkpointed,
    Failed,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Locked => "locked",
            State::Checkpointed => "checkpointed",
            State::Failed => "failed",
        }
    }
}

struct Options {
    devices: usize,
    mib: usize,
    workers: usize,
    kernel_us: u64,
    children: usize,
    cpu_children: usize,
    idle_children: usize,
    no_context: bool,
    daemon: bool,
    pidfile: Option<String>,
    log: Option<String>,
    faults: BTreeSet<String>,
}

fn usage(msg: &str) -> ! {
    eprintln!("gpu-sim-workload (SIMULATED GPU): {msg}");
    std::process::exit(2)
}

fn parse_options() -> Options {
    let mut o = Options {
        devices: 1,
        mib: 8,
        workers: 2,
        kernel_us: 200,
        children: 0,
        cpu_children: 0,
        idle_children: 0,
        no_context: false,
        daemon: false,
        pidfile: None,
        log: None,
        faults: BTreeSet::new(),
    };
    if let Ok(f) = std::env::var("GPU_SIM_FAULTS") {
        o.faults.extend(fault_names(&f));
    }
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| {
            args.next()
                .unwrap_or_else(|| usage(&format!("{name} needs a value")))
        };
        let num = |s: String, name: &str| -> usize {
            s.parse()
                .unwrap_or_else(|_| usage(&format!("{name}: `{s}` is not a number")))
        };
        match a.as_str() {
            "--devices" => o.devices = num(val("--devices"), "--devices"),
            "--mib" => o.mib = num(val("--mib"), "--mib"),
            "--workers" => o.workers = num(val("--workers"), "--workers"),
            "--kernel-us" => o.kernel_us = num(val("--kernel-us"), "--kernel-us") as u64,
            "--children" => o.children = num(val("--children"), "--children"),
            "--cpu-children" => o.cpu_children = num(val("--cpu-children"), "--cpu-children"),
            "--idle-children" => o.idle_children = num(val("--idle-children"), "--idle-children"),
            "--no-context" => o.no_context = true,
            "--daemon" => o.daemon = true,
            "--pidfile" => o.pidfile = Some(val("--pidfile")),
            "--log" => o.log = Some(val("--log")),
            "--fault" => o.faults.extend(fault_names(&val("--fault"))),
            "-h" | "--help" => {
                println!("gpu-sim-workload: a SIMULATED GPU process for gpu-checkpoint tests and demos (not a real GPU). See the source header for options.");
                std::process::exit(0)
            }
            other => usage(&format!("unknown option `{other}`")),
        }
    }
    if o.devices == 0 || o.devices > 16 || o.mib == 0 || o.workers == 0 || o.workers > 64 {
        usage("need 1-16 devices, >= 1 MiB each, 1-64 workers");
    }
    o
}

fn fault_names(s: &str) -> Vec<String> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|f| !f.is_empty() && *f != "none")
        .map(str::to_string)
        .collect()
}

/// SplitMix64: the value a kernel writes is a pure function of (device, block word, worker, step).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn initial_word(dev: usize, i: usize) -> u64 {
    mix(((dev as u64) << 56) ^ (i as u64) ^ 0x5151_0000_0000)
}

fn kernel_word(dev: usize, i: usize, worker: usize, step: u64) -> u64 {
    mix(((dev as u64) << 56)
        ^ ((worker as u64) << 48)
        ^ step.wrapping_mul(0x1000_0000_01b3)
        ^ ((i as u64) << 1))
}

/// The geometry shared by the kernels and the verifier: worker `w` at step `s` writes block
/// `(s % per_worker) * workers + w`.
#[derive(Clone, Copy)]
struct Geometry {
    workers: usize,
    per_worker: usize,
}

impl Geometry {
    fn new(bytes: usize, workers: usize) -> Self {
        let words = bytes / 8;
        let blocks = words / BLOCK_WORDS;
        Geometry {
            workers,
            per_worker: (blocks / workers).max(1),
        }
    }

    fn block_of(&self, worker: usize, step: u64) -> usize {
        (step as usize % self.per_worker) * self.workers + worker
    }

    /// What word `i` of device `dev` must hold after the workers made `steps` steps.
    fn expected(&self, dev: usize, i: usize, steps: &[u64]) -> u64 {
        let block = i / BLOCK_WORDS;
        let (worker, k) = (block % self.workers, block / self.workers);
        if k >= self.per_worker || worker >= steps.len() {
            return initial_word(dev, i);
        }
        let s = steps[worker];
        if s <= k as u64 {
            return initial_word(dev, i);
        }
        let p = self.per_worker as u64;
        let last = k as u64 + p * ((s - 1 - k as u64) / p);
        kernel_word(dev, i, worker, last)
    }
}

/// One simulated device's memory.
struct Device {
    addr: *mut u64,
    bytes: usize,
    path: String,
    uuid: String,
    /// The host copy while CHECKPOINTED (ordinary anonymous process memory).
    host: Option<Vec<u64>>,
}

// SAFETY: the device memory is only touched by workers while a kernel is in flight, and by the control
// thread only when no kernel can be (LOCKED/CHECKPOINTED, or paused with nothing in flight).
unsafe impl Send for Device {}

struct Inner {
    state: State,
    /// A lock (or a VERIFY) is waiting: no new kernels start.
    draining: bool,
    in_flight: usize,
    steps: Vec<u64>,
    devices: Vec<Device>,
    faults: BTreeSet<String>,
}

struct Sim {
    inner: Mutex<Inner>,
    cv: Condvar,
    geometry: Geometry,
    kernel: Duration,
    no_context: bool,
    control_tid: OnceLock<i32>,
    children: Vec<i32>,
}

/// Device files to delete if we are told to terminate (read by the signal handler).
static CLEANUP: OnceLock<Vec<CString>> = OnceLock::new();

extern "C" fn on_terminate(sig: libc::c_int) {
    if let Some(paths) = CLEANUP.get() {
        for p in paths {
            // SAFETY: unlink is async-signal-safe; the strings live for the whole program.
            unsafe { libc::unlink(p.as_ptr()) };
        }
    }
    // SAFETY: async-signal-safe exit with the conventional status.
    unsafe { libc::_exit(128 + sig) };
}

fn err(code: i32, msg: impl AsRef<str>) -> String {
    format!("ERR {code} {}", msg.as_ref())
}

fn last_os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Creates the device file and maps it at `at` (or anywhere when null). Returns the mapping.
fn map_device(path: &str, bytes: usize, at: *mut u64) -> Result<*mut u64, (i32, String)> {
    let _ = std::fs::remove_file(path);
    let c = CString::new(path).map_err(|e| (INVALID_VALUE, e.to_string()))?;
    // SAFETY: plain syscalls on a path we own; every result is checked.
    unsafe {
        let fd = libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o600,
        );
        if fd < 0 {
            return Err((
                OPERATING_SYSTEM,
                format!("open {path}: {}", last_os_error()),
            ));
        }
        // Allocate every page now: running out of "device memory" must be an error here, not a
        // SIGBUS on first touch.
        let r = libc::posix_fallocate(fd, 0, bytes as libc::off_t);
        if r != 0 {
            libc::close(fd);
            libc::unlink(c.as_ptr());
            let code = if r == libc::ENOSPC {
                OUT_OF_MEMORY
            } else {
                OPERATING_SYSTEM
            };
            return Err((
                code,
                format!(
                    "allocating {bytes} bytes of simulated device memory: {}",
                    std::io::Error::from_raw_os_error(r)
                ),
            ));
        }
        let flags = libc::MAP_SHARED | if at.is_null() { 0 } else { libc::MAP_FIXED };
        let p = libc::mmap(
            at.cast(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        );
        let e = last_os_error();
        libc::close(fd);
        if p == libc::MAP_FAILED {
            libc::unlink(c.as_ptr());
            return Err((OPERATING_SYSTEM, format!("mmap {path}: {e}")));
        }
        Ok(p.cast())
    }
}

/// Replaces a device mapping by an inaccessible anonymous reservation of the same range, so that the
/// addresses stay ours (as CUDA keeps its virtual address reservations) and CRIU sees no device file.
fn release_device(addr: *mut u64, bytes: usize) -> Result<(), String> {
    // SAFETY: MAP_FIXED over our own mapping of exactly this range.
    let p = unsafe {
        libc::mmap(
            addr.cast(),
            bytes,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("reserving the device range: {}", last_os_error()));
    }
    Ok(())
}

fn words<'a>(addr: *mut u64, bytes: usize) -> &'a mut [u64] {
    // SAFETY: callers pass a live mapping of `bytes` bytes that nothing else touches meanwhile.
    unsafe { std::slice::from_raw_parts_mut(addr, bytes / 8) }
}

fn checksum(ws: &[u64]) -> String {
    // SAFETY: viewing initialised u64s as bytes (the same bytes the device file holds).
    let bytes = unsafe { std::slice::from_raw_parts(ws.as_ptr().cast::<u8>(), ws.len() * 8) };
    blake3::hash(bytes).to_hex()[..16].to_string()
}

impl Sim {
    fn lock_inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Faults from memory, plus the fault file (re-read every call).
    fn has_fault(&self, g: &Inner, name: &str) -> bool {
        if g.faults.contains(name) {
            return true;
        }
        std::env::var("GPU_SIM_FAULT_FILE")
            .ok()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map(|s| fault_names(&s).iter().any(|f| f == name))
            .unwrap_or(false)
    }

    fn worker(&self, w: usize) {
        loop {
            let (step, devs): (u64, Vec<(*mut u64, usize)>) = {
                let mut g = self.lock_inner();
                while g.state != State::Running || g.draining {
                    g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
                }
                g.in_flight += 1;
                (
                    g.steps[w],
                    g.devices.iter().map(|d| (d.addr, d.bytes)).collect(),
                )
            };
            let block = self.geometry.block_of(w, step);
            for (dev, (addr, bytes)) in devs.into_iter().enumerate() {
                let mem = words(addr, bytes);
                let start = block * BLOCK_WORDS;
                for (i, word) in mem.iter_mut().enumerate().skip(start).take(BLOCK_WORDS) {
                    *word = kernel_word(dev, i, w, step);
                }
            }
            // The kernel's run time: a lock has to wait for it.
            std::thread::sleep(self.kernel);
            let mut g = self.lock_inner();
            g.steps[w] += 1;
            g.in_flight -= 1;
            if g.in_flight == 0 {
                self.cv.notify_all();
            }
        }
    }

    /// Stops new kernels and waits for those in flight; `None` timeout waits for ever.
    fn drain<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        timeout: Option<Duration>,
    ) -> (MutexGuard<'a, Inner>, bool) {
        g.draining = true;
        let deadline = timeout.map(|t| Instant::now() + t);
        while g.in_flight > 0 {
            match deadline {
                None => g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        g.draining = false;
                        self.cv.notify_all();
                        return (g, false);
                    }
                    g = self
                        .cv
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
        (g, true)
    }

    fn handle(&self, line: &str) -> String {
        let (cmd, arg) = line
            .trim()
            .split_once(' ')
            .map(|(c, a)| (c, a.trim()))
            .unwrap_or((line.trim(), ""));
        if self.no_context && !matches!(cmd, "STATUS" | "FAULT") {
            return err(
                NOT_INITIALIZED,
                "no CUDA context in this process (it only loaded the library)",
            );
        }
        match cmd {
            "STATE" => format!("OK {}", self.lock_inner().state.name()),
            "LOCK" => self.lock(arg),
            "CHECKPOINT" => self.checkpoint(),
            "RESTORE" => self.restore(arg),
            "UNLOCK" => self.unlock(),
            "RESTORE_TID" => format!("OK {}", self.control_tid.get().copied().unwrap_or(0)),
            "STATUS" => self.status(),
            "VERIFY" => self.verify(),
            "FAULT" => {
                let mut g = self.lock_inner();
                g.faults = fault_names(arg).into_iter().collect();
                "OK".into()
            }
            _ => err(INVALID_VALUE, format!("unknown request `{cmd}`")),
        }
    }

    fn lock(&self, arg: &str) -> String {
        let Ok(ms) = arg.parse::<u64>() else {
            return err(INVALID_VALUE, format!("bad timeout `{arg}`"));
        };
        let timeout = (ms > 0).then(|| Duration::from_millis(ms));
        let g = self.lock_inner();
        if g.state != State::Running {
            return err(
                ILLEGAL_STATE,
                format!("process is {}, lock needs running", g.state.name()),
            );
        }
        if self.has_fault(&g, "lock-timeout") {
            // Injected: the work in flight never finishes within the timeout.
            drop(g);
            match timeout {
                Some(t) => std::thread::sleep(t),
                None => loop {
                    std::thread::sleep(Duration::from_millis(20));
                    if !self.has_fault(&self.lock_inner(), "lock-timeout") {
                        break;
                    }
                },
            }
            if timeout.is_some() {
                return err(
                    NOT_READY,
                    format!("in-flight work did not finish within {ms} ms (simulated fault)"),
                );
            }
            return self.lock(arg);
        }
        let (mut g, drained) = self.drain(g, timeout);
        if !drained {
            return err(
                NOT_READY,
                format!("in-flight work did not finish within {ms} ms"),
            );
        }
        g.state = State::Locked;
        g.draining = false;
        "OK".into()
    }

    fn checkpoint(&self) -> String {
        let mut g = self.lock_inner();
        if g.state != State::Locked {
            return err(
                ILLEGAL_STATE,
                format!("process is {}, checkpoint needs locked", g.state.name()),
            );
        }
        if self.has_fault(&g, "checkpoint") {
            return err(
                NOT_SUPPORTED,
                "simulated checkpoint failure (fault injected); the process stays locked",
            );
        }
        for d in g.devices.iter_mut() {
            let host = words(d.addr, d.bytes).to_vec();
            if let Err(e) = release_device(d.addr, d.bytes) {
                g.state = State::Failed;
                return err(OPERATING_SYSTEM, e);
            }
            let _ = std::fs::remove_file(&d.path);
            d.host = Some(host);
        }
        g.state = State::Checkpointed;
        "OK".into()
    }

    fn restore(&self, arg: &str) -> String {
        let mut g = self.lock_inner();
        if g.state != State::Checkpointed {
            return err(
                ILLEGAL_STATE,
                format!("process is {}, restore needs checkpointed", g.state.name()),
            );
        }
        if self.has_fault(&g, "restore-oom") {
            return err(
                OUT_OF_MEMORY,
                "not enough simulated device memory (fault injected); still checkpointed",
            );
        }
        if self.has_fault(&g, "restore") {
            return err(
                OPERATING_SYSTEM,
                "simulated restore failure (fault injected); still checkpointed",
            );
        }
        // GPU pairs: when given, they must cover every device, and name simulated GPUs.
        let mut new_uuids: Vec<String> = g.devices.iter().map(|d| d.uuid.clone()).collect();
        let pairs: Vec<(String, String)> = arg
            .split(',')
            .filter(|p| !p.trim().is_empty())
            .filter_map(|p| p.split_once('='))
            .map(|(a, b)| (a.trim().to_ascii_lowercase(), b.trim().to_string()))
            .collect();
        if !pairs.is_empty() {
            for (i, d) in g.devices.iter().enumerate() {
                match pairs
                    .iter()
                    .find(|(old, _)| *old == d.uuid.to_ascii_lowercase())
                {
                    None => {
                        return err(
                            INVALID_VALUE,
                            format!("the GPU pairs do not cover {}", d.uuid),
                        )
                    }
                    Some((_, new))
                        if !new
                            .to_ascii_uppercase()
                            .starts_with(&UUID_PREFIX.to_ascii_uppercase()) =>
                    {
                        return err(INVALID_DEVICE, format!("{new} is not a simulated GPU"))
                    }
                    Some((_, new)) => new_uuids[i] = new.clone(),
                }
            }
        }
        let mut done = Vec::new();
        for (i, d) in g.devices.iter().enumerate() {
            match map_device(&d.path, d.bytes, d.addr) {
                Ok(_) => done.push(i),
                Err((code, msg)) => {
                    // All or nothing: put back the reservations of the devices already mapped.
                    for &j in &done {
                        let dj = &g.devices[j];
                        let _ = release_device(dj.addr, dj.bytes);
                        let _ = std::fs::remove_file(&dj.path);
                    }
                    return err(code, msg);
                }
            }
        }
        for (d, uuid) in g.devices.iter_mut().zip(new_uuids) {
            if let Some(host) = d.host.take() {
                words(d.addr, d.bytes).copy_from_slice(&host);
            }
            d.uuid = uuid;
        }
        g.state = State::Locked;
        "OK".into()
    }

    fn unlock(&self) -> String {
        let mut g = self.lock_inner();
        if g.state != State::Locked {
            return err(
                ILLEGAL_STATE,
                format!("process is {}, unlock needs locked", g.state.name()),
            );
        }
        g.state = State::Running;
        self.cv.notify_all();
        "OK".into()
    }

    /// Runs `f` on each device's memory while no kernel is in flight.
    fn with_quiet_memory<T>(&self, f: impl Fn(&Inner, usize, &[u64]) -> T) -> Vec<T> {
        let g = self.lock_inner();
        let was_draining = g.draining;
        let (mut g, _) = self.drain(g, None);
        let out = g
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| match &d.host {
                Some(h) => f(&g, i, h),
                None => f(&g, i, words(d.addr, d.bytes)),
            })
            .collect();
        g.draining = was_draining;
        self.cv.notify_all();
        out
    }

    fn status(&self) -> String {
        let sums = self.with_quiet_memory(|_, _, m| checksum(m));
        let g = self.lock_inner();
        let list = |v: Vec<String>| v.join(",");
        format!(
            "OK simulated=yes state={} pid={} steps={} devices={} bytes={} checksums={} uuids={} files={} faults={} children={}",
            g.state.name(),
            std::process::id(),
            list(g.steps.iter().map(u64::to_string).collect()),
            g.devices.len(),
            g.devices.first().map_or(0, |d| d.bytes),
            list(sums),
            list(g.devices.iter().map(|d| d.uuid.clone()).collect()),
            list(g.devices.iter().map(|d| d.path.clone()).collect()),
            if g.faults.is_empty() { "none".into() } else { list(g.faults.iter().cloned().collect()) },
            if self.children.is_empty() { "none".into() } else { list(self.children.iter().map(i32::to_string).collect()) },
        )
    }

    fn verify(&self) -> String {
        let geo = self.geometry;
        let results = self.with_quiet_memory(|g, dev, mem| {
            mem.iter()
                .enumerate()
                .find(|(i, w)| **w != geo.expected(dev, *i, &g.steps))
                .map(|(i, w)| {
                    format!(
                        "device {dev} word {i}: {w:#x} != expected {:#x}",
                        geo.expected(dev, i, &g.steps)
                    )
                })
        });
        let bad: Vec<String> = results.into_iter().flatten().collect();
        if bad.is_empty() {
            let g = self.lock_inner();
            format!(
                "OK verified {} device(s) at steps {:?}",
                g.devices.len(),
                g.steps
            )
        } else {
            err(
                OPERATING_SYSTEM,
                format!("device memory corrupt: {}", bad.join("; ")),
            )
        }
    }
}

fn gettid() -> i32 {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// Sets up this process's simulated GPU and serves the control channel for ever.
fn run_gpu_process(
    o: &Options,
    no_context: bool,
    children: Vec<i32>,
    ready: Option<libc::c_int>,
) -> ! {
    let pid = std::process::id();
    let bytes = o.mib << 20;
    if let Err(e) = std::fs::create_dir_all(SHM_DIR) {
        usage(&format!("cannot create {SHM_DIR}: {e}"));
    }
    let mut devices = Vec::new();
    // A process that only loaded the library has no device memory: just the control channel.
    let device_count = if no_context { 0 } else { o.devices };
    for d in 0..device_count {
        let path = format!("{SHM_DIR}/{pid}-dev{d}");
        let addr =
            map_device(&path, bytes, std::ptr::null_mut()).unwrap_or_else(|(_, m)| usage(&m));
        for (i, w) in words(addr, bytes).iter_mut().enumerate() {
            *w = initial_word(d, i);
        }
        devices.push(Device {
            addr,
            bytes,
            path,
            uuid: format!("{UUID_PREFIX}0000-0000-0000-0000{:08x}", d),
            host: None,
        });
    }
    let _ = CLEANUP.set(
        devices
            .iter()
            .filter_map(|d| CString::new(d.path.clone()).ok())
            .collect(),
    );
    // SAFETY: installing a handler that only calls async-signal-safe functions.
    unsafe {
        libc::signal(
            libc::SIGTERM,
            on_terminate as *const () as libc::sighandler_t,
        );
        libc::signal(
            libc::SIGINT,
            on_terminate as *const () as libc::sighandler_t,
        );
    }
    let addr = SocketAddr::from_abstract_name(format!("gpu-checkpoint-sim/{pid}").as_bytes())
        .unwrap_or_else(|e| usage(&e.to_string()));
    let listener = UnixListener::bind_addr(&addr)
        .unwrap_or_else(|e| usage(&format!("cannot bind @gpu-checkpoint-sim/{pid}: {e}")));
    let sim = Arc::new(Sim {
        inner: Mutex::new(Inner {
            state: State::Running,
            draining: false,
            in_flight: 0,
            steps: vec![0; o.workers],
            devices,
            faults: o.faults.clone(),
        }),
        cv: Condvar::new(),
        geometry: Geometry::new(bytes, o.workers),
        kernel: Duration::from_micros(o.kernel_us),
        no_context,
        control_tid: OnceLock::new(),
        children,
    });
    let _ = sim.control_tid.set(gettid());
    if !no_context {
        for w in 0..o.workers {
            let s = Arc::clone(&sim);
            std::thread::spawn(move || s.worker(w));
        }
    }
    println!(
        "gpu-sim-workload: SIMULATED GPU process pid={pid} devices={} x {} MiB workers={} (not a real GPU)",
        o.devices, o.mib, o.workers
    );
    let _ = std::io::stdout().flush();
    if let Some(fd) = ready {
        let msg = format!("{pid}\n");
        // SAFETY: writing to the pipe our parent reads.
        unsafe {
            libc::write(fd, msg.as_ptr().cast(), msg.len());
            libc::close(fd);
        }
    }
    loop {
        // accept() is restarted after CRIU restores the listening socket; transient errors just loop.
        let Ok((stream, _)) = listener.accept() else {
            continue;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            continue;
        }
        let answer = sim.handle(&line);
        let _ = (&stream).write_all(format!("{answer}\n").as_bytes());
    }
}

/// A child with no GPU state at all (a CPU-only process of the tree).
fn run_cpu_child(ready: libc::c_int) -> ! {
    let msg = format!("{}\n", std::process::id());
    // SAFETY: writing to our parent's pipe.
    unsafe {
        libc::write(ready, msg.as_ptr().cast(), msg.len());
        libc::close(ready);
    }
    let mut v: u64 = 1;
    loop {
        v = mix(v);
        std::hint::black_box(v);
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn pipe() -> (libc::c_int, libc::c_int) {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        usage(&format!("pipe: {}", last_os_error()));
    }
    (fds[0], fds[1])
}

fn read_lines(fd: libc::c_int, n: usize) -> Vec<i32> {
    use std::os::fd::FromRawFd;
    // SAFETY: we own the read end.
    let f = unsafe { std::fs::File::from_raw_fd(fd) };
    BufReader::new(f)
        .lines()
        .take(n)
        .filter_map(|l| l.ok()?.trim().parse().ok())
        .collect()
}

fn redirect_stdio(log: Option<&str>) {
    let out = match log {
        Some(p) => CString::new(p).ok(),
        None => CString::new("/dev/null").ok(),
    };
    let Some(out) = out else { return };
    // SAFETY: plain descriptor juggling on our own stdio.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        let fd = libc::open(
            out.as_ptr(),
            libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND,
            0o644,
        );
        if null >= 0 {
            libc::dup2(null, 0);
        }
        if fd >= 0 {
            libc::dup2(fd, 1);
            libc::dup2(fd, 2);
        }
    }
}

fn main() {
    let o = parse_options();
    let mut ready_out: Option<libc::c_int> = None;
    if o.daemon {
        let (r, w) = pipe();
        // SAFETY: no threads exist yet; fork is safe.
        match unsafe { libc::fork() } {
            -1 => usage(&format!("fork: {}", last_os_error())),
            0 => {
                // A session leader of its own (CRIU wants the root of a dumped tree to lead its session,
                // or --shell-job); re-parented to init once the launcher exits, so that a killed copy is
                // reaped and its PID freed for a restore.
                // SAFETY: single-threaded child.
                unsafe {
                    libc::close(r);
                    libc::setsid();
                }
                redirect_stdio(o.log.as_deref());
                ready_out = Some(w);
            }
            _child => {
                // SAFETY: the launcher keeps only the read end and waits for the ready line.
                unsafe { libc::close(w) };
                let got = read_lines(r, 1);
                match got.first() {
                    Some(pid) => {
                        println!("{pid}");
                        std::process::exit(0)
                    }
                    None => usage("the simulated GPU process did not start (see --log)"),
                }
            }
        }
    }
    // Fork the children before any thread exists.
    let mut children = Vec::new();
    let total = o.children + o.cpu_children + o.idle_children;
    if total > 0 {
        let (r, w) = pipe();
        for i in 0..total {
            // SAFETY: still single-threaded.
            match unsafe { libc::fork() } {
                -1 => usage(&format!("fork: {}", last_os_error())),
                0 => {
                    // SAFETY: child closes the read end it does not use.
                    unsafe { libc::close(r) };
                    if i < o.children {
                        run_gpu_process(&o, o.no_context, Vec::new(), Some(w));
                    } else if i < o.children + o.idle_children {
                        run_gpu_process(&o, true, Vec::new(), Some(w));
                    } else {
                        run_cpu_child(w);
                    }
                }
                pid => children.push(pid),
            }
        }
        // SAFETY: parent keeps only the read end.
        unsafe { libc::close(w) };
        let started = read_lines(r, total);
        if started.len() != total {
            usage("a child did not start");
        }
    }
    if let Some(p) = &o.pidfile {
        let tmp = format!("{p}.tmp");
        if std::fs::write(&tmp, format!("{}\n", std::process::id()))
            .and_then(|_| std::fs::rename(&tmp, p))
            .is_err()
        {
            usage(&format!("cannot write pidfile {p}"));
        }
    }
    run_gpu_process(&o, o.no_context, children, ready_out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expected_content_follows_the_kernels() {
        let geo = Geometry::new(64 * 1024, 3);
        let mut mem: Vec<u64> = (0..64 * 1024 / 8).map(|i| initial_word(1, i)).collect();
        let mut steps = vec![0u64; 3];
        for round in 0..100u64 {
            for (w, step) in steps.iter_mut().enumerate() {
                if (round + w as u64).is_multiple_of(4) {
                    continue; // workers advance unevenly
                }
                let b = geo.block_of(w, *step);
                let block = mem.iter_mut().enumerate().skip(b * BLOCK_WORDS);
                for (i, word) in block.take(BLOCK_WORDS) {
                    *word = kernel_word(1, i, w, *step);
                }
                *step += 1;
            }
        }
        for (i, v) in mem.iter().enumerate() {
            assert_eq!(*v, geo.expected(1, i, &steps), "word {i}");
        }
        mem[7] ^= 1;
        assert_ne!(mem[7], geo.expected(1, 7, &steps));
    }
}
