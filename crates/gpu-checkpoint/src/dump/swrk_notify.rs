//! The `post-restore` hand-off of the `criu swrk` stand-in (`swrk_proxy.rs`): runc must hear of the
//! restored tree before any of its processes resumes, as CRIU's service tells it.
//!
//! CRIU's command line has no notifications, but it runs action scripts at the same moments. It
//! execs a script as named (no shell, no arguments), and its descriptors are its own by then (runc's
//! socket, inherited, is not where it was), so: CRIU is given this program as its `--action-script`,
//! with [`NOTIFY_ENV`] naming a socket the proxy listens on in its private work folder. At
//! `post-restore` the script sends the restored init's PID (`CRTOOLS_INIT_PID`) there; the proxy tells
//! runc and waits for its answer; the script exits 0 on yes (CRIU resumes the tree) and 1 on no (CRIU
//! kills the tree, which never ran). Every other action: 0 at once.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::Duration;

use protobuf::{Message, MessageField};
use rust_criu::rust_criu_protobuf::rpc;

use super::rpc::{recv, send};

/// Set, in CRIU's environment (which its scripts inherit), to the proxy's socket: its presence makes
/// `gpu-checkpoint` act as the action script ([`notify_call`]).
pub const NOTIFY_ENV: &str = "GPU_CHECKPOINT_SWRK_NOTIFY";

/// The socket's name in the proxy's work folder.
const SOCKET: &str = "post-restore.sock";

/// `Some(the proxy's socket)` when this process was started by CRIU as the proxy's action script.
pub fn notify_call() -> Option<PathBuf> {
    std::env::var_os(NOTIFY_ENV).map(PathBuf::from)
}

/// The action script (see the module documentation); returns its exit status.
pub fn notify(socket: &Path) -> i32 {
    notify_as(
        std::env::var("CRTOOLS_SCRIPT_ACTION").ok().as_deref(),
        std::env::var("CRTOOLS_INIT_PID").ok().as_deref(),
        socket,
    )
}

/// [`notify`] for CRIU's `action` and `init_pid`.
fn notify_as(action: Option<&str>, init_pid: Option<&str>, socket: &Path) -> i32 {
    if action != Some("post-restore") {
        return 0;
    }
    let Some(pid) = init_pid.and_then(|p| p.parse::<i32>().ok()) else {
        eprintln!("gpu-checkpoint swrk proxy: CRIU gave no CRTOOLS_INIT_PID at post-restore");
        return 1;
    };
    let verdict = UnixStream::connect(socket).and_then(|mut s| {
        writeln!(s, "{pid}")?;
        let mut yes = [0u8; 1];
        s.read_exact(&mut yes)?;
        Ok(yes[0] == b'1')
    });
    match verdict {
        Ok(true) => 0,
        Ok(false) => {
            eprintln!(
                "gpu-checkpoint swrk proxy: runc refused the restored container (post-restore)"
            );
            1
        }
        Err(e) => {
            eprintln!("gpu-checkpoint swrk proxy: {}: {e}", socket.display());
            1
        }
    }
}

/// Tells runc on `fd` that the tree of init `pid` is restored (CRIU's `post-restore` notification) and
/// waits for its answer: whether it took the container.
pub fn tell_runc(fd: RawFd, pid: i32) -> bool {
    let mut notify = rpc::Criu_notify::new();
    notify.set_script("post-restore".into());
    notify.set_pid(pid);
    let mut resp = rpc::Criu_resp::new();
    resp.set_type(rpc::Criu_req_type::NOTIFY);
    resp.set_success(true);
    resp.notify = MessageField::some(notify);
    let sent = resp
        .write_to_bytes()
        .ok()
        .is_some_and(|b| send(fd, &b).is_ok());
    if !sent {
        return false;
    }
    let mut buf = vec![0u8; 64 << 10];
    recv(fd, &mut buf)
        .ok()
        .filter(|&n| n > 0 && n <= buf.len())
        .and_then(|n| rpc::Criu_req::parse_from_bytes(&buf[..n]).ok())
        .is_some_and(|r| r.notify_success())
}

/// The proxy's end: the socket the script reaches it on.
pub struct Gate {
    listener: UnixListener,
    /// The socket in the work folder.
    file: PathBuf,
    /// The path the script connects to: `file`, or where that is too long for a socket address
    /// (107 bytes; a store deep in the file system, as `/var/lib/...`, gets there), the same socket
    /// through the work folder's descriptor held here, `/proc/PROXY/fd/N/post-restore.sock`.
    connect: PathBuf,
    _dir: std::fs::File,
    /// Whether runc was told (and took the container).
    told: bool,
}

impl Gate {
    /// Listens in `work` (the restore's private work folder), 0600.
    pub fn open(work: &Path) -> std::io::Result<Gate> {
        let listener = super::streamer::bind_in(work, SOCKET)?;
        let dir = std::fs::File::open(work)?;
        let file = work.join(SOCKET);
        let connect = if super::streamer::fits_socket_address(&file) {
            file.clone()
        } else {
            PathBuf::from(format!(
                "/proc/{}/fd/{}/{SOCKET}",
                std::process::id(),
                dir.as_raw_fd()
            ))
        };
        Ok(Gate {
            listener,
            file,
            connect,
            _dir: dir,
            told: false,
        })
    }

    /// The path the action script connects to.
    pub fn path(&self) -> &Path {
        &self.connect
    }

    /// Whether runc took the restored container.
    pub fn told(&self) -> bool {
        self.told
    }

    /// Answers the script, asking `runc` (`pid` -> took it), until `criu` exits; returns its status.
    pub fn serve(
        &mut self,
        criu: &mut Child,
        runc: &mut dyn FnMut(i32) -> bool,
    ) -> std::io::Result<ExitStatus> {
        // CRIU's exit wakes the poll too (its pidfd becomes readable): the restore goes on the moment
        // CRIU has resumed the tree, not at the next timeout. Without a pidfd (kernels before 5.3),
        // the timeout notices it.
        let exited = crate::proc::pidfd_open(criu.id() as i32).ok();
        loop {
            if let Some(status) = criu.try_wait()? {
                return Ok(status);
            }
            let mut pfds = [
                libc::pollfd {
                    fd: self.listener.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: exited.as_ref().map_or(-1, |f| f.as_raw_fd()),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds (a negative fd is ignored by poll).
            unsafe { libc::poll(pfds.as_mut_ptr(), 2, 50) };
            match self.listener.accept() {
                Ok((s, _)) => self.answer(s, runc),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn answer(&mut self, s: UnixStream, runc: &mut dyn FnMut(i32) -> bool) {
        // The script writes at once; a script that does not is no reason to hang the restore.
        let _ = s.set_nonblocking(false);
        let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
        let mut line = String::new();
        let mut r = BufReader::new(&s);
        let pid = r
            .read_line(&mut line)
            .ok()
            .and_then(|_| line.trim().parse::<i32>().ok());
        let yes = match pid {
            // Asked once: a second connection gets no.
            Some(pid) if !self.told => runc(pid),
            _ => false,
        };
        self.told |= yes;
        let _ = (&s).write_all(if yes { b"1" } else { b"0" });
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// runc's side of the socket: reads one message, answers whether it accepts it.
    fn runc_answering(
        sock: std::os::unix::net::UnixDatagram,
        accept: bool,
    ) -> std::thread::JoinHandle<Option<rpc::Criu_resp>> {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 4096];
            let n = sock.recv(&mut buf).ok()?;
            let got = rpc::Criu_resp::parse_from_bytes(&buf[..n]).ok()?;
            let mut ack = rpc::Criu_req::new();
            ack.set_type(rpc::Criu_req_type::NOTIFY);
            ack.set_notify_success(accept);
            sock.send(&ack.write_to_bytes().unwrap()).ok()?;
            Some(got)
        })
    }

    #[test]
    fn runc_is_told_the_restored_init_and_its_answer_is_kept() {
        for accept in [true, false] {
            let (ours, runc) = std::os::unix::net::UnixDatagram::pair().unwrap();
            let runc = runc_answering(runc, accept);
            assert_eq!(tell_runc(ours.as_raw_fd(), 4242), accept);
            let got = runc.join().unwrap().expect("runc got a message");
            assert_eq!(got.type_(), rpc::Criu_req_type::NOTIFY);
            assert_eq!(got.notify.script(), "post-restore");
            assert_eq!(got.notify.pid(), 4242);
        }
    }

    #[test]
    fn the_script_passes_other_actions_and_waits_for_the_proxy_at_post_restore() {
        let dir = tempfile::tempdir().unwrap();
        script_and_proxy_in(dir.path());
    }

    /// A work folder whose socket path is longer than a socket address holds (a store in a deep
    /// folder): the gate listens all the same, and the script reaches it by a short path. Failed
    /// before with "path must be shorter than SUN_LEN", which failed every streamed runc restore
    /// from such a store.
    #[test]
    fn a_work_folder_too_deep_for_a_socket_address_still_reaches_the_proxy() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a".repeat(60)).join("b".repeat(60));
        std::fs::create_dir_all(&deep).unwrap();
        assert!(deep.join(SOCKET).as_os_str().len() > 108);
        let path = script_and_proxy_in(&deep);
        assert!(path.as_os_str().len() < 100, "{}", path.display());
    }

    /// The script's cases against a gate in `work`; returns the path the script was given.
    fn script_and_proxy_in(work: &Path) -> PathBuf {
        let mut gate = Gate::open(work).unwrap();
        let mode = std::fs::metadata(work.join(SOCKET)).unwrap();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        let socket = gate.path().to_path_buf();
        // Other actions pass without a word to the proxy (no connection: nothing would answer).
        assert_eq!(notify_as(Some("pre-restore"), Some("7"), &socket), 0);
        assert_eq!(notify_as(Some("network-unlock"), None, &socket), 0);
        // No PID from CRIU: refused rather than runc told nothing.
        assert_eq!(notify_as(Some("post-restore"), None, &socket), 1);
        for (pid, expect) in [("41", 0), ("42", 1)] {
            // A stand-in for CRIU: it runs the script (here, a thread) and exits when it has ended.
            let script = {
                let socket = socket.clone();
                std::thread::spawn(move || notify_as(Some("post-restore"), Some(pid), &socket))
            };
            let mut criu = std::process::Command::new("sh")
                .args(["-c", "sleep 0.3"])
                .spawn()
                .unwrap();
            let mut asked = Vec::new();
            let status = gate
                .serve(&mut criu, &mut |p| {
                    asked.push(p);
                    p == 41
                })
                .unwrap();
            assert!(status.success());
            assert_eq!(script.join().unwrap(), expect, "pid {pid}");
            if expect == 0 {
                assert_eq!(asked, [41]);
            } else {
                // Once runc took a tree, another ask is no.
                assert!(asked.is_empty(), "{asked:?}");
            }
        }
        assert!(gate.told());
        drop(gate);
        assert!(!work.join(SOCKET).exists());
        socket
    }
}
