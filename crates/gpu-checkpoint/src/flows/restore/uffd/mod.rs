//! Restore with the processes' private memory copied from the store straight into them through
//! userfaultfd, instead of through CRIU: what `restore` does by default where userfaultfd is available
//! (`--stream` and `--staged` choose the other ways).
//!
//! Why: a streamed restore cannot get under about 1.22x plain `criu restore` (`docs/criu.md`): in stream
//! mode CRIU premaps every private mapping and reads its pages from a pipe, while a plain restore reads
//! page-cache files into place; a staged restore pays a whole extra copy. Here no page goes through CRIU
//! (but for those processes share, below):
//! 1. The checkpoint's pagemaps say which pages CRIU may leave to a userfaultfd handler (`PE_LAZY`:
//!    private anonymous memory that is not a stack), and where each page lies in the page image.
//! 2. The images are materialized without those pages: the page images become sparse files holding only
//!    the pages CRIU still reads itself (stacks, a few MiB at most).
//! 3. CRIU restores with `--lazy-pages`: it maps the memory, registers it with one userfaultfd per process
//!    and sends each descriptor over `lazy-pages.socket` in its work folder (CRIU's own protocol with its
//!    `lazy-pages` daemon: the PID as a 32-bit integer, then the descriptor as `SCM_RIGHTS`).
//! 4. At CRIU's `post-restore` notification every process is restored and none runs yet. The fill
//!    starts: every lazy page is copied out of its verified chunk into its process (`UFFDIO_COPY`, chunk
//!    by chunk on the store's workers). With [`Resume::Early`] (the default) the notification is answered
//!    at once and the processes run: a page they touch first faults, and its chunk is read, verified and
//!    copied ahead of the rest by the urgent path; their forks, `mremap`, `munmap` and `MADV_DONTNEED`
//!    are followed (`pending.rs`, `server.rs`), and the guardian holds a copy of every descriptor ([`Hold`])
//!    so that a touch of missing memory waits rather than reads zeros should this process die. With
//!    [`Resume::Filled`] the notification is answered only once every page is in. Either way [`restore`]
//!    returns once every page is in, and then closes the userfaultfds: from then on nothing depends on
//!    this process. Pages of all-zero chunks are not copied at all: with the registration gone they read
//!    as zeros, as untouched anonymous memory does (a fault there before that gets the zero page). Windows
//!    of memory the kernel backs with huge pages are collapsed back into huge pages once in (`crate::thp`).
//! 5. A failure (a damaged chunk, a copy the kernel refuses, a process CRIU sent no descriptor for)
//!    before the processes run answers the notification with an error: CRIU then kills the restored tree.
//!    Once they run, the fill kills them itself (they would wait for memory that cannot come). The
//!    checkpoint is left as it was.
//!
//! Except for pages a parent shares with its children. After a fork they hold one copy of each private
//! page until one writes it, and CRIU gets that sharing back only for pages it restores itself: it fills
//! the parent's memory, forks the child, and keeps each inherited page equal to the child's own (lazy
//! pages are neither there at the fork nor kept). Copied in here, every process had its own copy (a
//! parent with 256 MiB and 4 forked readers: 257 MiB PSS before, 1281 MiB after). So in a tree the plan
//! leaves to CRIU, on both sides, the pages a parent and child both have in a mapping CRIU pairs between
//! them (`cow.rs`, CRIU's own rules): they are materialized, and the pagemaps CRIU reads are written into
//! the work folder with those entries no longer lazy. The rest still comes through userfaultfd; a single
//! process (the benchmarked case) reads no tree and changes nothing. Copying the shared pages into the
//! parent before the children fork is not possible from outside CRIU: CRIU forks them before the
//! processes' userfaultfds exist.
//!
//! The parts, by job: `plan.rs` decides which pages go through userfaultfd and where each lies, with
//! `cow.rs` for the pages parent and children share;
//! `server.rs` takes the descriptors from CRIU and reads the events on them; `fill.rs` copies the pages,
//! in the background and for faults first; `pending.rs` keeps what is still to copy right while the
//! processes change their mappings; `sys.rs` is the raw userfaultfd interface. This file drives a restore.

mod cow;
mod fill;
mod pending;
mod plan;
mod server;
mod sys;

pub use fill::FillStats;
pub(super) use plan::Plan;

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::store::{CheckpointInfo, Progress, Store};

use fill::Filler;
use server::{LazySocket, Server};

/// Whether this process may use userfaultfd (kernel support, and no seccomp filter or sysctl in the way)
/// and the kernel speaks its API: `restore` copies memory through it by default and streams to CRIU
/// otherwise. Only the basic service is needed here (missing-page copies into anonymous memory, which
/// CRIU registers; the events of a running process are CRIU's to ask for).
pub fn available() -> bool {
    sys::open(libc::O_CLOEXEC | libc::O_NONBLOCK)
        .and_then(|fd| sys::handshake(fd.as_raw_fd()))
        .is_ok()
}

/// A failure of the userfaultfd restore itself (not of the store it reads): it travels through the store's
/// chunk workers as their sink's error.
fn other(msg: String) -> crate::store::Error {
    crate::store::Error::Sink(Box::new(super::Error::Uffd(msg)))
}

fn copy_error(pid: i32, addr: u64, len: u64, e: std::io::Error) -> crate::store::Error {
    other(format!(
        "cannot copy {len} bytes into process {pid} at {addr:#x} (UFFDIO_COPY): {e}"
    ))
}

/// When the restored processes go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// As soon as CRIU has restored them: what they touch before it is copied is served on demand, from
    /// verified chunks, ahead of the rest (the default).
    Early,
    /// Once all of their memory is in, with no registration left: nothing they do ever waits for this
    /// process.
    Filled,
}

/// Threads that read the chunks page faults wait for, beside the background fill (within the same memory
/// budget: the background fill runs fewer workers where the budget would not hold them all).
const URGENT_THREADS: usize = 2;

/// What [`restore`] did.
pub(super) struct Outcome<T> {
    pub(super) restored: Result<i32, crate::dump::Error>,
    /// The fill's result (its error, when it made CRIU fail or killed the copy, is the one to report).
    pub(super) filled: crate::store::Result<FillStats>,
    /// When CRIU was told to go on with the processes.
    pub(super) resumed: Option<Instant>,
    /// When every page was in.
    pub(super) memory_in: Option<Instant>,
    /// What `then` returned, when CRIU restored the tree.
    pub(super) then: Option<T>,
}

/// The guardian's part: it holds a copy of every userfaultfd while the processes run before their memory
/// is in ([`Hold::hold`]), so that should this process die, they wait on their next fault (and the
/// guardian kills them) instead of finding zeros where their memory was; [`Hold::release`] before ours
/// are closed.
pub(super) trait Hold: Sync {
    fn hold(&self, fds: &[RawFd]);
    fn release(&self);
}

/// Runs `criu.restore(req)` with lazy pages, the memory copied in from the post-restore notification on
/// (see the module documentation), and `then(pid)` once CRIU has restored the tree, while the fill goes
/// on where the processes resume early. Returns once every page is in (or the fill failed; a copy resumed
/// early is then killed).
#[allow(clippy::too_many_arguments)]
pub(super) fn restore<T>(
    criu: &dyn crate::dump::Criu,
    req: &crate::dump::RestoreRequest<'_>,
    store: &Store,
    info: &CheckpointInfo,
    plan: &Plan,
    progress: &dyn Progress,
    resume: Resume,
    guardian: &dyn Hold,
    then: impl FnOnce(i32) -> T,
) -> Outcome<T> {
    let shared = FillStats {
        shared_bytes: plan.shared_bytes(),
        ..FillStats::default()
    };
    let failed = |e: crate::dump::Error| Outcome {
        restored: Err(e),
        filled: Ok(shared),
        resumed: None,
        memory_in: None,
        then: None,
    };
    if let Err(e) = write_pagemaps(plan, req.images_dir) {
        return failed(crate::dump::Error::io(
            format!("writing pagemaps in {}", req.images_dir.display()),
            e,
        ));
    }
    if plan.is_empty() {
        // Nothing left to us (no lazy page, or every one shared): an ordinary restore from the images,
        // which hold every page.
        let restored = criu.restore(req);
        let at = Instant::now();
        let then = restored.as_ref().ok().map(|&pid| then(pid));
        return Outcome {
            restored,
            filled: Ok(shared),
            resumed: Some(at),
            memory_in: Some(at),
            then,
        };
    }
    let socket = match LazySocket::bind(req.images_dir) {
        Ok(s) => s,
        Err(e) => {
            return failed(crate::dump::Error::io(
                format!("listening for CRIU in {}", req.images_dir.display()),
                e,
            ))
        }
    };
    let filler = Filler::new(plan, store, info);
    let held = std::sync::atomic::AtomicBool::new(false);
    let server = Server::new(&socket, &filler, Some((guardian, &held)));
    // The background fill's start (true) or abort (false), and its end.
    let go: (Mutex<Option<bool>>, Condvar) = (Mutex::new(None), Condvar::new());
    let end: (Mutex<Option<Instant>>, Condvar) = (Mutex::new(None), Condvar::new());
    let resumed: Mutex<Option<Instant>> = Mutex::new(None);
    // Collapsing into huge pages, where done before the processes resume (`Resume::Filled`).
    let huge: Mutex<Option<(u64, f64)>> = Mutex::new(None);
    std::thread::scope(|s| {
        let serving = s.spawn(|| server.run());
        let urgent: Vec<_> = (0..URGENT_THREADS)
            .map(|_| s.spawn(|| filler.serve_urgent()))
            .collect();
        let background = s.spawn(|| {
            let mut g = go.0.lock().unwrap_or_else(|e| e.into_inner());
            while g.is_none() {
                g = go.1.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            if *g != Some(true) {
                return;
            }
            drop(g);
            if filler.fill_in_background(progress).is_err() && resume == Resume::Early {
                // The processes run and would wait forever for memory that will not come.
                kill_copy(plan);
            }
            *end.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            end.1.notify_all();
        });
        let start = |run: bool| {
            let mut g = go.0.lock().unwrap_or_else(|e| e.into_inner());
            g.get_or_insert(run);
            go.1.notify_all();
        };
        let wait_end = || {
            let mut e = end.0.lock().unwrap_or_else(|e| e.into_inner());
            while e.is_none() {
                e = end.1.wait(e).unwrap_or_else(|e| e.into_inner());
            }
        };
        // Stops looking at the descriptors and closes them: the registrations go.
        let close = || {
            server.stop.store(true, Ordering::SeqCst);
            while !server.stopped.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            if held.swap(false, Ordering::SeqCst) {
                guardian.release();
            }
            filler.close();
        };
        let hook = || -> Result<(), String> {
            // Every process sent its descriptor before the notification; the last may still be on
            // their way through the socket.
            let deadline = Instant::now() + Duration::from_secs(5);
            for t in plan.tasks.iter().filter(|t| !t.lazy.is_empty()) {
                while !filler.has_process(t.pid) {
                    if Instant::now() > deadline || server.stopped.load(Ordering::SeqCst) {
                        let e = other(format!(
                            "CRIU sent no userfaultfd for process {} (its memory cannot be restored)",
                            t.pid
                        ));
                        let msg = e.to_string();
                        filler.fail(e);
                        return Err(msg);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            if resume == Resume::Early {
                let fds: Vec<RawFd> = filler.spaces().iter().map(|s| s.uffd.as_raw_fd()).collect();
                guardian.hold(&fds);
                held.store(true, Ordering::SeqCst);
            }
            start(true);
            if resume == Resume::Filled {
                wait_end();
                if let Some(e) = filler.failure() {
                    return Err(e.to_string());
                }
                close();
                *huge.lock().unwrap_or_else(|e| e.into_inner()) = Some(collapse_huge(plan));
            }
            *resumed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            Ok(())
        };
        let req = crate::dump::RestoreRequest {
            lazy_pages: true,
            post_restore: Some(&hook),
            ..req.clone()
        };
        let restored = criu.restore(&req);
        let resumed_at = *resumed.lock().unwrap_or_else(|e| e.into_inner());
        let then_out = match (&restored, resumed_at) {
            (Ok(pid), Some(_)) => Some(then(*pid)),
            _ => None,
        };
        // CRIU failed before its notification: no fill.
        start(false);
        if resumed_at.is_some() {
            wait_end();
        }
        filler.stop();
        close();
        let mut huge = huge.into_inner().unwrap_or_else(|e| e.into_inner());
        if huge.is_none() && resumed_at.is_some() && filler.failure().is_none() {
            huge = Some(collapse_huge(plan));
        }
        for u in urgent {
            let _ = u.join();
        }
        let _ = background.join();
        let served = serving
            .join()
            .unwrap_or_else(|_| Err(other("the page-fault server panicked".into())));
        let filled = match (filler.take_error(), &restored, resumed_at) {
            (Some(e), _, _) => Err(e),
            (None, Err(_), _) => served.map(|()| filler.stats()),
            // Restored without the notification: the memory was never copied, and with the
            // descriptors closed it would read as zeros. The caller must not let it run.
            (None, Ok(_), None) => Err(other(
                "CRIU restored without a post-restore notification: the memory was not copied"
                    .into(),
            )),
            (None, Ok(_), Some(_)) => Ok(filler.stats()),
        }
        .map(|mut st| {
            if let Some((bytes, ms)) = huge {
                (st.huge_bytes, st.huge_ms) = (bytes, ms);
            }
            st
        });
        let memory_in = *end.0.lock().unwrap_or_else(|e| e.into_inner());
        Outcome {
            restored,
            filled,
            resumed: resumed_at,
            memory_in,
            then: then_out,
        }
    })
}

/// Collapses each process's huge-page windows back into huge pages, now that they are in and no longer
/// registered; returns the bytes the kernel took and the time (ms). A kernel that cannot (before 6.1, or
/// without `MADV_COLLAPSE` for another process) leaves them in 4 KiB pages, as they were copied.
fn collapse_huge(plan: &Plan) -> (u64, f64) {
    let t = Instant::now();
    let mut done = 0;
    for task in plan.tasks.iter().filter(|t| !t.huge.is_empty()) {
        match crate::thp::collapse(task.pid, &task.huge) {
            Ok(n) => done += n,
            Err(e) => tracing::info!(
                "process {}: its memory stays in 4 KiB pages (MADV_COLLAPSE: {e})",
                task.pid
            ),
        }
    }
    (done, t.elapsed().as_secs_f64() * 1000.0)
}

/// Kills the restored processes (and any child they forked meanwhile): their memory cannot come.
fn kill_copy(plan: &Plan) {
    let mut pids: Vec<i32> = Vec::new();
    for t in &plan.tasks {
        for p in crate::proc::process_tree(t.pid) {
            if !pids.contains(&p.pid) {
                pids.push(p.pid);
            }
        }
    }
    let left = crate::proc::kill_tree(&pids, Duration::from_secs(10));
    if !left.is_empty() {
        tracing::error!("restored processes {left:?} could not be stopped");
    }
}

/// Writes the plan's pagemaps (shared pages not lazy) into CRIU's work folder `dir`, in place of the
/// checkpoint's, which [`Plan::keep`] left out: new private files, as materialization creates them.
fn write_pagemaps(plan: &Plan, dir: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    for (name, bytes) in &plan.pagemaps {
        let path = dir.join(name);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?
            .write_all(bytes)?;
    }
    Ok(())
}
