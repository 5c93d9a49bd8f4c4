//! The process side: detaching (`--daemon`), forking the process tree, the ready pipe every process
//! reports its PID on, the pidfile, stdio redirection, and deleting the device files on SIGTERM/SIGINT.
//! Kept apart from the simulator because all of it runs before any thread exists (fork is only safe
//! then) or in a signal handler, with raw syscalls and their own rules.

use std::convert::Infallible;
use std::ffi::CString;
use std::io::{BufRead, BufReader};
use std::os::fd::FromRawFd;
use std::sync::OnceLock;
use std::time::Duration;

use crate::content::mix;
use crate::fatal;

/// The write end of a ready pipe: a process writes its PID there once it serves requests.
pub type ReadyFd = libc::c_int;

fn last_os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// `--daemon`: forks; the copy that returns is the simulated GPU process, a session leader whose
/// stdio goes to `log` (or /dev/null), with the write end of the ready pipe. The launcher waits for
/// the ready line, prints the PID and exits 0 (or exits 2 if the process never got ready).
pub fn daemonize(log: Option<&str>) -> ReadyFd {
    let (r, w) = pipe();
    // SAFETY: no threads exist yet; fork is safe.
    match unsafe { libc::fork() } {
        -1 => fatal(&format!("fork: {}", last_os_error())),
        0 => {
            // A session leader of its own (CRIU wants the root of a dumped tree to lead its session,
            // or --shell-job); re-parented to init once the launcher exits, so that a killed copy is
            // reaped and its PID freed for a restore.
            // SAFETY: single-threaded child.
            unsafe {
                libc::close(r);
                libc::setsid();
            }
            redirect_stdio(log);
            w
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
                None => fatal("the simulated GPU process did not start (see --log)"),
            }
        }
    }
}

/// Forks `total` children, each running `child(i, ready)` (which never returns: `Infallible` says so on
/// stable Rust), and waits until every one reported ready. Must run before any thread exists. Returns the
/// children's PIDs in order.
pub fn fork_children(total: usize, child: impl Fn(usize, ReadyFd) -> Infallible) -> Vec<i32> {
    let mut children = Vec::new();
    if total == 0 {
        return children;
    }
    let (r, w) = pipe();
    for i in 0..total {
        // SAFETY: still single-threaded.
        match unsafe { libc::fork() } {
            -1 => fatal(&format!("fork: {}", last_os_error())),
            0 => {
                // SAFETY: child closes the read end it does not use.
                unsafe { libc::close(r) };
                child(i, w);
            }
            pid => children.push(pid),
        }
    }
    // SAFETY: parent keeps only the read end.
    unsafe { libc::close(w) };
    let started = read_lines(r, total);
    if started.len() != total {
        fatal("a child did not start");
    }
    children
}

/// Reports this process ready: its PID, one line, on the ready pipe (then closed).
pub fn notify_ready(fd: ReadyFd) {
    let msg = format!("{}\n", std::process::id());
    // SAFETY: writing to the pipe our parent reads.
    unsafe {
        libc::write(fd, msg.as_ptr().cast(), msg.len());
        libc::close(fd);
    }
}

/// A child with no GPU state at all (a CPU-only process of the tree).
pub fn run_cpu_child(ready: ReadyFd) -> ! {
    notify_ready(ready);
    let mut v: u64 = 1;
    loop {
        v = mix(v);
        std::hint::black_box(v);
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Writes our PID to `path` atomically (temporary name, rename).
pub fn write_pidfile(path: &str) {
    let tmp = format!("{path}.tmp");
    if std::fs::write(&tmp, format!("{}\n", std::process::id()))
        .and_then(|_| std::fs::rename(&tmp, path))
        .is_err()
    {
        fatal(&format!("cannot write pidfile {path}"));
    }
}

pub fn gettid() -> i32 {
    // SAFETY: no arguments, cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
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

/// On SIGTERM or SIGINT, deletes `paths` (the device files) and exits 128 + the signal.
pub fn delete_on_terminate<'a>(paths: impl Iterator<Item = &'a str>) {
    let _ = CLEANUP.set(paths.filter_map(|p| CString::new(p).ok()).collect());
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
}

fn pipe() -> (libc::c_int, libc::c_int) {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        fatal(&format!("pipe: {}", last_os_error()));
    }
    (fds[0], fds[1])
}

fn read_lines(fd: libc::c_int, n: usize) -> Vec<i32> {
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
