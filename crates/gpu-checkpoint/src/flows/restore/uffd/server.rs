//! Our end of CRIU's lazy-pages protocol while CRIU restores: the socket CRIU sends each process's
//! userfaultfd over, and the page faults CRIU's own restorer causes before the processes run.
//!
//! CRIU speaks to its `lazy-pages` daemon here (criu/uffd.c): it connects to `lazy-pages.socket` in its
//! work folder and, per process, sends the PID as a 32-bit integer, then the descriptor as `SCM_RIGHTS`.
//! Until the post-restore notification the processes do not run, so the only events are the faults of
//! CRIU's restorer (a few pages, e.g. a thread's rseq area), served one page at a time; the bulk copy is
//! `fill.rs`'s, after this server stopped.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::dump::streamer::{accept_until, bind_in};
use crate::store::{CheckpointInfo, Store};

use super::plan::Plan;
use super::sys::{self, page_size, UFFD_EVENT_PAGEFAULT};
use super::{copy_error, other};

/// The socket CRIU connects to (criu/uffd.c, `LAZY_PAGES_SOCK_NAME`), in its work folder.
pub const SOCKET: &str = "lazy-pages.socket";
/// What CRIU sends on the socket once the restore is done (criu/uffd.c), after the descriptors.
const RESTORE_FINISHED: i32 = 0x5253_5446;

/// Whether `conn` has data (or a hang-up) to read right now.
fn readable_now(conn: &std::os::unix::net::UnixStream) -> bool {
    let mut fd = libc::pollfd {
        fd: conn.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd; a zero timeout never blocks.
    unsafe { libc::poll(&mut fd, 1, 0) > 0 }
}

/// CRIU's side of the restore before the post-restore notification: receives the userfaultfds as CRIU
/// sends them, and answers the page faults CRIU's restorer causes itself (it touches a few pages of lazy
/// memory while completing a process, e.g. the thread's rseq area). The processes are not running yet,
/// so no other event can come.
pub(super) struct Server<'a> {
    socket: &'a LazySocket,
    plan: &'a Plan,
    store: &'a Store,
    info: &'a CheckpointInfo,
    pub(super) uffds: Mutex<HashMap<i32, OwnedFd>>,
    pub(super) stop: AtomicBool,
    pub(super) served: AtomicU64,
}

impl<'a> Server<'a> {
    pub(super) fn new(
        socket: &'a LazySocket,
        plan: &'a Plan,
        store: &'a Store,
        info: &'a CheckpointInfo,
    ) -> Self {
        Server {
            socket,
            plan,
            store,
            info,
            uffds: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            served: AtomicU64::new(0),
        }
    }

    /// Until `stop`: accept CRIU's connection, take descriptors, serve faults.
    pub(super) fn run(&self) -> crate::store::Result<()> {
        let io = |what: &str, e: std::io::Error| other(format!("{what}: {e}"));
        // Every descriptor comes over the connection: until CRIU connects there is nothing else to serve.
        let Some(mut conn) = accept_until(&self.socket.listener, &self.stop)
            .map_err(|e| io("accepting CRIU's lazy-pages connection", e))?
        else {
            return Ok(());
        };
        conn.set_read_timeout(Some(Duration::from_secs(5)))
            .map_err(|e| io("CRIU's lazy-pages connection", e))?;
        let mut conn_open = true;
        while !self.stop.load(Ordering::SeqCst) {
            let uffds: Vec<(i32, RawFd)> = self
                .uffds
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(p, f)| (*p, f.as_raw_fd()))
                .collect();
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(uffds.len() + 1);
            fds.push(libc::pollfd {
                // poll ignores negative descriptors
                fd: if conn_open { conn.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            });
            fds.extend(uffds.iter().map(|&(_, fd)| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            }));
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(io("waiting for CRIU", e));
            }
            if fds[0].revents != 0 {
                conn_open = self.take_message(&mut conn)?;
            }
            for (k, &(pid, fd)) in uffds.iter().enumerate() {
                if fds[k + 1].revents != 0 {
                    self.drain(pid, fd)?;
                }
            }
        }
        // Stopped at the post-restore notification: every process sent its descriptor before it, but the
        // last messages may still wait in the socket (a loaded machine was seen to lose one that way, and
        // the restore then failed with "CRIU sent no userfaultfd"). Take all that is there.
        while conn_open && readable_now(&conn) {
            conn_open = self.take_message(&mut conn)?;
        }
        // CRIU writes "restore finished" on the connection later: keep it open until the socket goes.
        *self.socket.conn.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
        Ok(())
    }

    /// Reads one message of CRIU's lazy-pages connection: a PID, then (for a live process) its
    /// userfaultfd. Returns false once CRIU has closed the connection.
    fn take_message(
        &self,
        conn: &mut std::os::unix::net::UnixStream,
    ) -> crate::store::Result<bool> {
        let io = |what: &str, e: std::io::Error| other(format!("{what}: {e}"));
        let mut word = [0u8; 4];
        match conn.read(&mut word[..1]) {
            Ok(0) => Ok(false),
            Ok(_) => {
                conn.read_exact(&mut word[1..])
                    .map_err(|e| io("reading CRIU's lazy-pages message", e))?;
                let pid = i32::from_ne_bytes(word);
                if pid > 0 && pid != RESTORE_FINISHED {
                    let fd = crate::fdpass::receive_one(conn, "the process's userfaultfd")
                        .map_err(|e| io("receiving a userfaultfd", e))?;
                    self.uffds
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(pid, fd);
                }
                // pid < 0: a zombie (no memory); RESTORE_FINISHED: nothing to do.
                Ok(true)
            }
            Err(e) => Err(io("reading CRIU's lazy-pages message", e)),
        }
    }

    /// Handles every event queued on process `pid`'s userfaultfd.
    fn drain(&self, pid: i32, uffd: RawFd) -> crate::store::Result<()> {
        while let Some(msg) = sys::read_event(uffd)
            .map_err(|e| other(format!("reading process {pid}'s userfaultfd: {e}")))?
        {
            if msg.event != UFFD_EVENT_PAGEFAULT {
                return Err(other(format!(
                    "process {pid}: userfaultfd event {:#x} while CRIU restored it (only page \
                     faults are expected before it runs)",
                    msg.event
                )));
            }
            self.serve_fault(pid, uffd, msg.arg[1])?;
        }
        Ok(())
    }

    /// Copies the page at `addr` (or a zero page, if the checkpoint holds none there) into process `pid`.
    fn serve_fault(&self, pid: i32, uffd: RawFd, addr: u64) -> crate::store::Result<()> {
        let page = page_size();
        let addr = addr - addr % page;
        let task = self.plan.tasks.iter().find(|t| t.pid == pid);
        let run = task.and_then(|t| {
            let i = t.lazy.partition_point(|r| r.vaddr + r.len <= addr);
            t.lazy.get(i).filter(|r| r.vaddr <= addr)
        });
        let result = match (task, run) {
            (Some(task), Some(run)) => {
                let img = run.img_off + (addr - run.vaddr);
                let buf = Mutex::new(vec![0u8; page as usize]);
                let want = |off: u64, len: u64| off < img + page && img < off + len;
                let visit = |off: u64, len: u64, bytes: Option<&[u8]>| {
                    if let Some(d) = bytes {
                        let (a, b) = (off.max(img), (off + len).min(img + page));
                        buf.lock().unwrap_or_else(|e| e.into_inner())
                            [(a - img) as usize..(b - img) as usize]
                            .copy_from_slice(&d[(a - off) as usize..(b - off) as usize]);
                    }
                    Ok(())
                };
                self.store.visit_chunks(
                    self.info,
                    &task.pages,
                    &want,
                    &visit,
                    &crate::store::NoProgress,
                )?;
                let buf = buf.into_inner().unwrap_or_else(|e| e.into_inner());
                sys::copy(uffd, addr, &buf)
            }
            // Not in the checkpoint: the page was never touched, it reads as zeros.
            _ => sys::zeropage(uffd, addr, page),
        };
        match result {
            Ok(()) => {}
            // Served already (two threads faulted on it).
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(copy_error(pid, addr, page, e)),
        }
        self.served.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// The socket CRIU sends the userfaultfds over, listening in CRIU's work folder; removed on drop.
pub(super) struct LazySocket {
    listener: UnixListener,
    path: PathBuf,
    /// CRIU's connection, kept open until CRIU is done: it writes "restore finished" on it after the
    /// post-restore notification, and would get a broken pipe if we had hung up.
    conn: Mutex<Option<UnixStream>>,
}

impl LazySocket {
    /// Only root may connect: whoever sends a descriptor there gets memory written into it.
    pub(super) fn bind(dir: &Path) -> std::io::Result<LazySocket> {
        let path = dir.join(SOCKET);
        let listener = bind_in(dir, SOCKET)?;
        Ok(LazySocket {
            listener,
            path,
            conn: Mutex::new(None),
        })
    }
}

impl Drop for LazySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};

    /// A checkpoint nothing is read from (the server only needs one to exist).
    fn empty_info() -> CheckpointInfo {
        serde_json::from_value(serde_json::json!({
            "format": crate::store::manifest::MANIFEST_FORMAT_NAME,
            "version": crate::store::manifest::MANIFEST_FORMAT_VERSION,
            "id": "20261124T000000Z-0000",
            "name": null,
            "created": "2026-11-24T00:00:00.000Z",
            "chunking": {"algorithm": "fastcdc-v2020", "min_size": 1, "avg_size": 2, "max_size": 3,
                         "hash": "blake3", "compression": "none", "level": 0},
            "stats": crate::store::manifest::IngestStats::default(),
            "metadata": null,
            "files": []
        }))
        .unwrap()
    }

    /// CRIU sends every process's userfaultfd before its post-restore notification, but a loaded
    /// machine's server thread may not have read the last ones when the notification stops it: they must
    /// still be taken (the restore failed with "CRIU sent no userfaultfd" before).
    #[test]
    fn descriptors_still_queued_at_the_notification_are_taken() {
        let dir = tempfile::tempdir().unwrap();
        let socket = LazySocket::bind(dir.path()).unwrap();
        let store = Store::open(&dir.path().join("store"), Default::default()).unwrap();
        let (plan, info) = (Plan::default(), empty_info());
        let server = Server::new(&socket, &plan, &store, &info);
        // CRIU's side: connected, one process's PID and its descriptor sent, as criu/uffd.c sends them.
        let mut criu = UnixStream::connect(&socket.path).unwrap();
        criu.write_all(&4242i32.to_ne_bytes()).unwrap();
        let (_r, w) = nix::unistd::pipe().unwrap();
        let fds = [w.as_raw_fd()];
        sendmsg::<()>(
            criu.as_raw_fd(),
            &[std::io::IoSlice::new(&[0])],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        // The notification came before the server read anything.
        server.stop.store(true, Ordering::SeqCst);
        server.run().unwrap();
        let uffds = server.uffds.lock().unwrap();
        assert!(uffds.contains_key(&4242), "{:?}", uffds.keys());
    }
}
