//! Our end of CRIU's lazy-pages protocol while the processes are restored: the socket CRIU sends each
//! process's userfaultfd over, and the events on those descriptors until the fill is done.
//!
//! CRIU speaks to its `lazy-pages` daemon here (criu/uffd.c): it connects to `lazy-pages.socket` in its
//! work folder and, per process, sends the PID as a 32-bit integer, then the descriptor as `SCM_RIGHTS`.
//! Until the post-restore notification the processes do not run, and the only events are the faults of
//! CRIU's restorer (a few pages, e.g. a thread's rseq area). Once they run (a restore that resumes them
//! before all of their memory is in), every event CRIU asked for comes: page faults, forks, `mremap`,
//! `munmap` and `MADV_DONTNEED`. The events that change the mappings are read with [`Filler::gate`]
//! held for writing, so that no copy is under way while what is pending changes (`fill.rs`); faults are
//! handed to the fill's urgent queue.

use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::dump::streamer::{accept_until, bind_in};

use super::fill::{Filler, Space};
use super::other;
use super::sys::{self, Event};

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

/// Receives the userfaultfds as CRIU sends them (each becomes a space of the fill), and handles the events
/// on them until stopped.
pub(super) struct Server<'a> {
    socket: &'a LazySocket,
    filler: &'a Filler<'a>,
    /// The guardian, and whether it holds the descriptors now: a forked child's is handed to it too.
    guardian: Option<(&'a dyn super::Hold, &'a AtomicBool)>,
    pub(super) stop: AtomicBool,
    /// Set once [`Server::run`] no longer looks at any descriptor (they may be closed then).
    pub(super) stopped: AtomicBool,
}

impl<'a> Server<'a> {
    pub(super) fn new(
        socket: &'a LazySocket,
        filler: &'a Filler<'a>,
        guardian: Option<(&'a dyn super::Hold, &'a AtomicBool)>,
    ) -> Self {
        Server {
            socket,
            filler,
            guardian,
            stop: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        }
    }

    /// Until `stop`: accept CRIU's connection, take descriptors, handle events. A failure is also the
    /// fill's (every path stops).
    pub(super) fn run(&self) -> crate::store::Result<()> {
        let r = self.serve();
        self.stopped.store(true, Ordering::SeqCst);
        if let Err(e) = &r {
            self.filler.fail(other(e.to_string()));
        }
        r
    }

    fn serve(&self) -> crate::store::Result<()> {
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
            let spaces: Vec<Arc<Space>> = self.filler.spaces();
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(spaces.len() + 1);
            fds.push(libc::pollfd {
                // poll ignores negative descriptors
                fd: if conn_open { conn.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            });
            fds.extend(spaces.iter().map(|s| libc::pollfd {
                fd: s.uffd.as_raw_fd(),
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
            for (k, space) in spaces.iter().enumerate() {
                if fds[k + 1].revents != 0 {
                    self.drain(space)?;
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
                    self.filler.add_process(pid, fd);
                }
                // pid < 0: a zombie (no memory); RESTORE_FINISHED: nothing to do.
                Ok(true)
            }
            Err(e) => Err(io("reading CRIU's lazy-pages message", e)),
        }
    }

    /// Handles every event queued on `space`'s userfaultfd: mapping changes at once, with the gate held
    /// for writing; faults after, for the fill.
    fn drain(&self, space: &Space) -> crate::store::Result<()> {
        let uffd: RawFd = space.uffd.as_raw_fd();
        let mut faults = Vec::new();
        {
            let _gate = self.filler.gate.write().unwrap_or_else(|e| e.into_inner());
            while let Some(msg) = sys::read_event(uffd)
                .map_err(|e| other(format!("reading process {}'s userfaultfd: {e}", space.pid)))?
            {
                match msg.decode() {
                    Event::Fault(addr) => faults.push(addr),
                    Event::Fork(child) => {
                        let child = self.filler.forked(space, child);
                        if let Some((g, held)) = self.guardian {
                            if held.load(Ordering::SeqCst) {
                                g.hold(&[child.uffd.as_raw_fd()]);
                            }
                        }
                    }
                    Event::Remap { from, to, len } => self.filler.remapped(space, from, to, len),
                    Event::Remove { start, end } | Event::Unmap { start, end } => {
                        self.filler.dropped(space, start, end)
                    }
                    Event::Other(e) => {
                        return Err(other(format!(
                            "process {}: unexpected userfaultfd event {e:#x}",
                            space.pid
                        )))
                    }
                }
            }
        }
        for addr in faults {
            self.filler.fault(space, addr)?;
        }
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
    use crate::flows::restore::uffd::plan::Plan;
    use crate::store::{CheckpointInfo, Store};
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
        let filler = Filler::new(&plan, &store, &info);
        let server = Server::new(&socket, &filler, None);
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
        assert!(filler.has_process(4242));
    }
}
