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
//! 4. At CRIU's `post-restore` notification every process is restored and none runs yet. We then copy
//!    every lazy page out of its verified chunk into its process (`UFFDIO_COPY`, chunk by chunk on all
//!    workers; raw chunks straight from their mapped files), close the userfaultfds, and only then answer.
//!    The processes resume with all of their memory and without a registration: no page fault and no
//!    userfaultfd event (fork, mremap, munmap) ever has to be served, so nothing depends on this process
//!    staying alive afterwards. Pages of all-zero chunks are not copied at all: with the registration
//!    gone they read as zeros, as untouched anonymous memory does.
//! 5. A failure (a damaged chunk, a copy the kernel refuses, a process CRIU sent no descriptor for)
//!    answers the notification with an error: CRIU then kills the restored tree, and the checkpoint is
//!    left as it was.
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
//! `server.rs` takes the descriptors from CRIU and serves its restorer's faults; `fill.rs` copies the
//! pages at the notification; `sys.rs` is the raw userfaultfd interface. This file drives a restore.

mod cow;
mod fill;
mod plan;
mod server;
mod sys;

pub use fill::FillStats;
pub(super) use plan::Plan;

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Mutex;

use crate::store::{CheckpointInfo, Progress, Store};

use server::{LazySocket, Server};

/// Whether this process may use userfaultfd (kernel support, and no seccomp filter or sysctl in the way)
/// and the kernel speaks its API: `restore` copies memory through it by default and streams to CRIU
/// otherwise. Only the basic service is needed (missing-page copies into anonymous memory, which CRIU
/// registers): the processes never run with a registration, so no event feature is.
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

/// Runs `criu.restore(req)` with lazy pages, filling the memory at the post-restore notification (see
/// the module documentation). `req.images_dir` holds the images [`Plan::keep`] selected. Returns CRIU's
/// result and the fill's (its error, when it made CRIU fail, is the one to report).
pub(super) fn restore(
    criu: &dyn crate::dump::Criu,
    req: &crate::dump::RestoreRequest<'_>,
    store: &Store,
    info: &CheckpointInfo,
    plan: &Plan,
    progress: &dyn Progress,
) -> (
    Result<i32, crate::dump::Error>,
    crate::store::Result<FillStats>,
) {
    let shared = FillStats {
        shared_bytes: plan.shared_bytes(),
        ..FillStats::default()
    };
    if let Err(e) = write_pagemaps(plan, req.images_dir) {
        let e = crate::dump::Error::io(
            format!("writing pagemaps in {}", req.images_dir.display()),
            e,
        );
        return (Err(e), Ok(shared));
    }
    if plan.is_empty() {
        // Nothing left to us (no lazy page, or every one shared): an ordinary restore from the images,
        // which hold every page.
        return (criu.restore(req), Ok(shared));
    }
    let socket = match LazySocket::bind(req.images_dir) {
        Ok(s) => s,
        Err(e) => {
            let e = crate::dump::Error::io(
                format!("listening for CRIU in {}", req.images_dir.display()),
                e,
            );
            return (Err(e), Ok(FillStats::default()));
        }
    };
    let server = Server::new(&socket, plan, store, info);
    let outcome: Mutex<Option<crate::store::Result<FillStats>>> = Mutex::new(None);
    let (restored, serve_result) = std::thread::scope(|s| {
        let serving = s.spawn(|| server.run());
        let serving = Mutex::new(Some(serving));
        // Stops the fault server (the restorer is done touching memory) and returns its result.
        let stop_serving = || -> crate::store::Result<()> {
            server.stop.store(true, Ordering::SeqCst);
            match serving.lock().unwrap_or_else(|e| e.into_inner()).take() {
                Some(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(other("the page-fault server panicked".into()))),
                None => Ok(()),
            }
        };
        let hook = || -> Result<(), String> {
            let filled = stop_serving().and_then(|()| {
                let uffds =
                    std::mem::take(&mut *server.uffds.lock().unwrap_or_else(|e| e.into_inner()));
                plan.fill(store, info, uffds, progress)
            });
            let verdict = filled.as_ref().map(|_| ()).map_err(|e| e.to_string());
            *outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(filled);
            verdict
        };
        let req = crate::dump::RestoreRequest {
            lazy_pages: true,
            post_restore: Some(&hook),
            ..req.clone()
        };
        let restored = criu.restore(&req);
        (restored, stop_serving())
    });
    let filled = outcome
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_else(|| match (&restored, serve_result) {
            // CRIU failed before its notification; a fault-server error would say why, else CRIU's
            // own error does.
            (Err(_), served) => served.map(|()| FillStats::default()),
            // Restored without the notification: the memory was never copied, and with the
            // descriptors closed it would read as zeros. The caller must not let it run.
            (Ok(_), _) => Err(other(
                "CRIU restored without a post-restore notification: the memory was not copied"
                    .into(),
            )),
        })
        .map(|mut st| {
            st.faults_served = server.served.into_inner();
            st.shared_bytes = shared.shared_bytes;
            st
        });
    (restored, filled)
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
