//! A client of CRIU's RPC service in `criu swrk <fd>` mode, on the message types rust-criu generates from
//! CRIU's `rpc.proto`.
//!
//! We drive the protocol ourselves instead of rust-criu's `Criu` because we need what it does not expose:
//! the restored PID, `leave_stopped`, `cr_errmsg`, and control over CRIU's standard streams (a shell job's
//! restore needs our terminal). One `swrk` process serves one request: it is spawned with one end of a
//! `SOCK_SEQPACKET` pair, answers, and exits when we close our end.

use std::ffi::OsString;
use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
use protobuf::{Message, MessageField};
use rust_criu::rust_criu_protobuf::rpc;

use super::log::failure;
use super::{
    AfterDump, CheckOutcome, Criu, CriuOptions, CriuVersion, DumpRequest, Error, FoundCriu, Op,
    PostRestore, RestoreRequest,
};

/// CRIU's log level for dump and restore: 4 (debug) is what runc and Podman use; the log is the only
/// place that says why an operation failed, and it costs little next to the page images.
const LOG_LEVEL: i32 = 4;

/// Largest RPC message we accept; CRIU's answers are a few hundred bytes.
const MAX_MESSAGE: usize = 1 << 20;

/// The real CRIU, driven over its RPC.
#[derive(Debug, Clone)]
pub struct CriuRpc {
    path: PathBuf,
    /// The version discovery already read (`criu --version`), saving a `swrk` round trip per checkpoint.
    known_version: Option<CriuVersion>,
}

impl CriuRpc {
    /// A client for the CRIU binary (or wrapper script) at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        CriuRpc {
            path: path.into(),
            known_version: None,
        }
    }

    /// A client for a CRIU found by [`super::discover`].
    pub fn from_found(found: &FoundCriu) -> Self {
        CriuRpc {
            path: found.path.clone(),
            known_version: Some(found.version),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn protocol(&self, detail: impl Into<String>) -> Error {
        Error::Protocol {
            path: self.path.clone(),
            detail: detail.into(),
        }
    }

    /// Sends one request to a fresh `criu swrk` and returns its final answer. `log` is the log file CRIU
    /// writes for this request (to quote it on failure); `inherit_stdio` lets CRIU use our terminal.
    fn call(
        &self,
        op: Op,
        req: rpc::Criu_req,
        log: Option<&Path>,
        inherit_stdio: bool,
    ) -> Result<rpc::Criu_resp, Error> {
        self.call_notified(op, req, log, inherit_stdio, None, &[])
    }

    /// [`CriuRpc::call`], running `post_restore` at CRIU's post-restore notification, CRIU with `env` set.
    fn call_notified(
        &self,
        op: Op,
        req: rpc::Criu_req,
        log: Option<&Path>,
        inherit_stdio: bool,
        post_restore: Option<&PostRestore<'_>>,
        env: &[(OsString, OsString)],
    ) -> Result<rpc::Criu_resp, Error> {
        let expected = req.type_();
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| Error::io("creating the socket pair for criu swrk", e.into()))?;
        let mut cmd = Command::new(&self.path);
        cmd.arg("swrk").arg(theirs.as_raw_fd().to_string());
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        if inherit_stdio {
            cmd.stdin(Stdio::inherit()).stdout(Stdio::inherit());
        } else {
            cmd.stdin(Stdio::null()).stdout(Stdio::null());
        }
        // CRIU logs to its log file; stderr only carries failures from before the log is open.
        cmd.stderr(Stdio::inherit());
        let child_fd = theirs.as_raw_fd();
        // SAFETY: only fcntl (async-signal-safe) runs between fork and exec. The socket is created
        // close-on-exec so that no other child spawned meanwhile inherits it; CRIU's end keeps it open.
        unsafe {
            cmd.pre_exec(move || {
                if libc::fcntl(child_fd, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            path: self.path.clone(),
            source,
        })?;
        // Without our copy of CRIU's end, CRIU exiting shows up as end-of-file on ours.
        drop(theirs);
        let result = self.converse(op, &ours, &req, expected, log, &mut child, post_restore);
        drop(ours);
        let status = child.wait();
        match result {
            Err(e) => Err(e),
            Ok(Some(resp)) => Ok(resp),
            Ok(None) => {
                let status = status
                    .map(|s| s.to_string())
                    .unwrap_or_else(|e| format!("unknown status: {e}"));
                let mut f = failure(
                    op,
                    None,
                    Some(format!("criu swrk exited ({status}) without answering")),
                    log,
                );
                if f.error_lines.is_empty() && log.is_none() {
                    f.message = Some(format!(
                        "criu swrk ({}) exited ({status}) without answering",
                        self.path.display()
                    ));
                }
                Err(Error::Failed(f))
            }
        }
    }

    /// Request, then answers until the final one; NOTIFY messages (action scripts) are acknowledged,
    /// `post-restore` with `post_restore`'s verdict. `Ok(None)`: CRIU hung up without a final answer.
    #[allow(clippy::too_many_arguments)]
    fn converse(
        &self,
        op: Op,
        sock: &OwnedFd,
        req: &rpc::Criu_req,
        expected: rpc::Criu_req_type,
        log: Option<&Path>,
        child: &mut Child,
        post_restore: Option<&PostRestore<'_>>,
    ) -> Result<Option<rpc::Criu_resp>, Error> {
        let bytes = req
            .write_to_bytes()
            .map_err(|e| self.protocol(format!("encoding the request: {e}")))?;
        send(sock.as_raw_fd(), &bytes).map_err(|e| Error::io("sending the request to CRIU", e))?;
        let mut buf = vec![0u8; MAX_MESSAGE];
        loop {
            let n = match recv(sock.as_raw_fd(), &mut buf) {
                Ok(0) => return Ok(None),
                Ok(n) if n > buf.len() => {
                    let _ = child.kill();
                    return Err(self.protocol(format!("answer of {n} bytes is too large")));
                }
                Ok(n) => n,
                Err(e) if e.raw_os_error() == Some(libc::ECONNRESET) => return Ok(None),
                Err(e) => return Err(Error::io("reading CRIU's answer", e)),
            };
            let resp = rpc::Criu_resp::parse_from_bytes(&buf[..n])
                .map_err(|e| self.protocol(format!("decoding the answer: {e}")))?;
            if resp.type_() == rpc::Criu_req_type::NOTIFY && resp.success() {
                let script = resp.notify.as_ref().map(|n| n.script()).unwrap_or("");
                let ok = match post_restore {
                    Some(hook) if script == "post-restore" => match hook() {
                        Ok(()) => true,
                        Err(e) => {
                            // CRIU kills the restored tree and answers with a failure.
                            tracing::debug!("post-restore hook failed: {e}");
                            false
                        }
                    },
                    _ => true,
                };
                let mut ack = rpc::Criu_req::new();
                ack.set_type(rpc::Criu_req_type::NOTIFY);
                ack.set_notify_success(ok);
                let ack = ack
                    .write_to_bytes()
                    .map_err(|e| self.protocol(format!("encoding a notify answer: {e}")))?;
                send(sock.as_raw_fd(), &ack)
                    .map_err(|e| Error::io("answering a CRIU notification", e))?;
                continue;
            }
            if !resp.success() {
                let errno = resp.has_cr_errno().then(|| resp.cr_errno());
                let msg = resp.has_cr_errmsg().then(|| resp.cr_errmsg().to_string());
                return Err(Error::Failed(failure(op, errno, msg, log)));
            }
            if resp.type_() != expected {
                let _ = child.kill();
                return Err(self.protocol(format!(
                    "answer of type {:?} to a {:?} request",
                    resp.type_(),
                    expected
                )));
            }
            return Ok(Some(resp));
        }
    }
}

/// Streaming (`--stream`) runs CRIU's command line instead of its RPC: CRIU refuses to stream in service
/// mode (`criu swrk` opens the images folder with no streaming mode and aborts on `--stream`, also when
/// it comes through the RPC's `config_file`). The command takes the same options; what the RPC would
/// answer comes from the exit status, the log, and `--pidfile`.
impl CriuRpc {
    fn cli_command(
        &self,
        verb: &str,
        images_dir: &Path,
        log_file: &str,
        env: &[(OsString, OsString)],
    ) -> Command {
        // Absolute: CRIU runs in another folder (a relative `--criu` would not be found from there).
        let mut cmd =
            Command::new(std::path::absolute(&self.path).unwrap_or_else(|_| self.path.clone()));
        // CRIU runs in the images folder and names it `.`: it connects to `./streamer-*.sock`, which fits
        // a socket path however deep the store is (the log and the pidfile land there too).
        cmd.current_dir(images_dir);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        cmd.arg(verb)
            .arg("--stream")
            .arg("-D")
            .arg(".")
            .arg("-v4")
            .arg("-o")
            .arg(log_file);
        cmd.stderr(Stdio::inherit());
        cmd
    }

    fn run_cli(&self, op: Op, mut cmd: Command, log: &Path) -> Result<(), Error> {
        let status = cmd.status().map_err(|source| Error::Spawn {
            path: self.path.clone(),
            source,
        })?;
        if status.success() {
            return Ok(());
        }
        Err(Error::Failed(failure(
            op,
            None,
            Some(format!("criu {op} exited ({status})")),
            Some(log),
        )))
    }

    fn dump_cli(&self, req: &DumpRequest<'_>) -> Result<(), Error> {
        let mut cmd = self.cli_command("dump", req.images_dir, req.log_file, req.env);
        cmd.arg("-t").arg(req.pid.to_string());
        cmd.arg(match req.after {
            AfterDump::KeepRunning => "--leave-running",
            AfterDump::Stop => "--leave-stopped",
        });
        cmd.args(req.options.cli_args());
        if let Some(c) = req.container {
            cmd.args(c.cli_args());
        }
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        self.run_cli(Op::Dump, cmd, &req.images_dir.join(req.log_file))
    }

    fn restore_cli(&self, req: &RestoreRequest<'_>) -> Result<i32, Error> {
        const PIDFILE: &str = "restored.pid";
        let mut cmd = self.cli_command("restore", req.images_dir, req.log_file, req.env);
        // Detached: the tree is re-parented to init when CRIU exits, as with the RPC.
        cmd.arg("--restore-detached").arg("--pidfile").arg(PIDFILE);
        if req.options.shell_job {
            cmd.stdin(Stdio::inherit()).stdout(Stdio::inherit());
        } else {
            cmd.stdin(Stdio::null()).stdout(Stdio::null());
        }
        cmd.args(req.options.cli_args());
        self.run_cli(Op::Restore, cmd, &req.images_dir.join(req.log_file))?;
        // CRIU writes the pidfile into its work folder, which is the images folder here.
        let path = req.images_dir.join(PIDFILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let _ = std::fs::remove_file(&path);
        text.trim()
            .parse()
            .map_err(|_| self.protocol(format!("{} holds no PID: {text:?}", path.display())))
    }
}

pub(super) fn send(fd: RawFd, data: &[u8]) -> std::io::Result<()> {
    // SAFETY: `data` is valid for `data.len()` bytes; MSG_NOSIGNAL turns a dead peer into EPIPE.
    let n = crate::util::retry_interrupted(|| unsafe {
        libc::send(fd, data.as_ptr().cast(), data.len(), libc::MSG_NOSIGNAL)
    })?;
    if n != data.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::WriteZero,
            "short write on a SOCK_SEQPACKET socket",
        ));
    }
    Ok(())
}

/// Receives one message; with MSG_TRUNC the result is the message's full length even when `buf` was
/// too small, so the caller can tell a truncated message from a complete one.
pub(super) fn recv(fd: RawFd, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: `buf` is valid for writes of `buf.len()` bytes.
    crate::util::retry_interrupted(|| unsafe {
        libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_TRUNC)
    })
}

/// Opens a folder for CRIU: CRIU resolves `images_dir_fd` as `/proc/<our pid>/fd/<n>`, so the descriptor
/// stays in our process (close-on-exec is fine) for as long as the request runs.
fn open_dir(path: &Path) -> Result<File, Error> {
    File::open(path).map_err(|e| Error::io(format!("opening {}", path.display()), e))
}

fn base_opts(images: &File, log_file: &str, options: &CriuOptions) -> rpc::Criu_opts {
    let mut opts = rpc::Criu_opts::new();
    opts.set_images_dir_fd(images.as_raw_fd());
    opts.set_log_level(LOG_LEVEL);
    opts.set_log_file(log_file.to_string());
    options.apply_rpc(&mut opts);
    opts
}

fn request(kind: rpc::Criu_req_type, opts: Option<rpc::Criu_opts>) -> rpc::Criu_req {
    let mut req = rpc::Criu_req::new();
    req.set_type(kind);
    if let Some(opts) = opts {
        req.opts = MessageField::some(opts);
    }
    req
}

impl Criu for CriuRpc {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn version(&self) -> Result<CriuVersion, Error> {
        if let Some(v) = self.known_version {
            return Ok(v);
        }
        let resp = self.call(
            Op::Version,
            request(rpc::Criu_req_type::VERSION, None),
            None,
            false,
        )?;
        let v = resp
            .version
            .as_ref()
            .ok_or_else(|| self.protocol("VERSION answer without a version"))?;
        let num = |n: i32| u32::try_from(n).unwrap_or(0);
        Ok(CriuVersion {
            major: num(v.major_number()),
            minor: num(v.minor_number()),
            sublevel: num(v.sublevel()),
        })
    }

    fn check_permitted(&self) -> Result<(), Error> {
        require_root()
    }

    fn check(&self) -> Result<CheckOutcome, Error> {
        // The RPC's CHECK answers only yes or no; the command also says which features are missing.
        let out = Command::new(&self.path)
            .arg("check")
            .stdin(Stdio::null())
            .output()
            .map_err(|source| Error::Spawn {
                path: self.path.clone(),
                source,
            })?;
        let mut output = String::from_utf8_lossy(&out.stdout).into_owned();
        output.push_str(&String::from_utf8_lossy(&out.stderr));
        Ok(CheckOutcome {
            ok: out.status.success(),
            output,
        })
    }

    fn dump(&self, req: &DumpRequest<'_>) -> Result<(), Error> {
        let images = open_dir(req.images_dir)?;
        if req.stream {
            return self.dump_cli(req);
        }
        let mut opts = base_opts(&images, req.log_file, req.options);
        opts.set_pid(req.pid);
        if let Some(c) = req.container {
            c.apply_rpc(&mut opts);
        }
        match req.after {
            AfterDump::KeepRunning => opts.set_leave_running(true),
            AfterDump::Stop => opts.set_leave_stopped(true),
        }
        let log = req.images_dir.join(req.log_file);
        self.call_notified(
            Op::Dump,
            request(rpc::Criu_req_type::DUMP, Some(opts)),
            Some(&log),
            false,
            None,
            req.env,
        )?;
        Ok(())
    }

    fn restore(&self, req: &RestoreRequest<'_>) -> Result<i32, Error> {
        let images = open_dir(req.images_dir)?;
        if req.stream {
            if req.lazy_pages || req.post_restore.is_some() {
                return Err(self.protocol(
                    "a streamed restore takes neither lazy pages nor a post-restore hook",
                ));
            }
            return self.restore_cli(req);
        }
        let mut opts = base_opts(&images, req.log_file, req.options);
        if req.lazy_pages {
            opts.set_lazy_pages(true);
        }
        if req.post_restore.is_some() {
            opts.set_notify_scripts(true);
        }
        // Not `rst_sibling`: the tree becomes a child of `criu swrk`, which exits after the restore, so the
        // tree is re-parented to init (detached) instead of to us.
        let log = req.images_dir.join(req.log_file);
        let resp = self.call_notified(
            Op::Restore,
            request(rpc::Criu_req_type::RESTORE, Some(opts)),
            Some(&log),
            req.options.shell_job,
            req.post_restore,
            req.env,
        )?;
        let pid = resp
            .restore
            .as_ref()
            .map(|r| r.pid())
            .ok_or_else(|| self.protocol("RESTORE answer without the restored PID"))?;
        Ok(pid)
    }
}

/// CRIU ptraces and re-creates processes: only root may run it.
pub(super) fn require_root() -> Result<(), Error> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(Error::NotRoot);
    }
    Ok(())
}
