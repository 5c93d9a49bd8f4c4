//! Restore with the processes' private memory copied from the store straight into them through
//! userfaultfd (`restore --uffd`), instead of through CRIU.
//!
//! Why: a streamed restore cannot get under about 1.22x plain `criu restore` (`docs/criu.md`): in stream
//! mode CRIU premaps every private mapping and reads its pages from a pipe, while a plain restore reads
//! page-cache files into place; a staged restore pays a whole extra copy. Here no page goes through CRIU:
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
//! The parts, by job: `plan.rs` decides which pages go through userfaultfd and where each lies;
//! `server.rs` takes the descriptors from CRIU and serves its restorer's faults; `fill.rs` copies the
//! pages at the notification; `sys.rs` is the raw userfaultfd interface. This file drives a restore.

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

fn other(msg: String) -> crate::store::Error {
    crate::store::Error::Other(msg)
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
    if plan.is_empty() {
        // Nothing CRIU would leave to us: an ordinary restore from the (whole) images.
        return (criu.restore(req), Ok(FillStats::default()));
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
            st
        });
    (restored, filled)
}
