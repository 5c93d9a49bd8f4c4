//! CRIU's image-streamer protocol (`criu dump --stream`, `criu restore --stream`), our side of it.
//!
//! With `--stream`, CRIU writes and reads no image file itself: it connects to a UNIX socket in the images
//! folder (`streamer-capture.sock` on dump, `streamer-serve.sock` on restore) and, for every image it opens,
//! sends the image's name and one end of a fresh pipe; the image's bytes flow through that pipe. This lets the
//! store cut, hash and compress CRIU's pages while CRIU produces them (the images are written once, into the
//! store, instead of staged on disk and read back), and lets a restore feed CRIU verified bytes straight from
//! the store's chunks.
//!
//! On the socket (one connection per CRIU run, shared by its processes under a lock CRIU holds):
//! ```text
//! CRIU -> us   u32 LE length, img_streamer_request_entry { required string filename = 1; }
//! restore only:
//! us -> CRIU   u32 LE length, img_streamer_reply_entry  { required bool exists = 1; }
//! (dump, or restore when the image exists)
//! CRIU -> us   1 byte with SCM_RIGHTS: our end of the pipe (dump: read end, restore: write end)
//! ```
//! We never report errors over the socket (the protocol has no way to): a failure closes the pipe, and
//! CRIU fails on the broken pipe, which makes it give up the dump (the tree resumes) or the restore.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The socket CRIU connects to on dump.
pub const CAPTURE_SOCKET: &str = "streamer-capture.sock";
/// The socket CRIU connects to on restore.
pub const SERVE_SOCKET: &str = "streamer-serve.sock";

/// The pipe size we ask for (kernel memory, per open image; CRIU opens a few at a time).
const PIPE_SIZE: libc::c_int = 16 << 20;

/// Image names are short (`pages-12345.img`); anything longer is not CRIU talking.
const MAX_REQUEST: usize = 4096;

/// Which side of the protocol we serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// CRIU dumps: we receive images.
    Capture,
    /// CRIU restores: we send images.
    Serve,
}

impl Mode {
    fn socket_name(self) -> &'static str {
        match self {
            Mode::Capture => CAPTURE_SOCKET,
            Mode::Serve => SERVE_SOCKET,
        }
    }
}

/// The listening socket in an images folder; removed again when dropped.
pub struct Listener {
    listener: UnixListener,
    path: PathBuf,
    mode: Mode,
}

impl Listener {
    /// Binds the mode's socket in `dir` (a stale one left by a crash is replaced). Only root may connect:
    /// whoever connects gets the process's memory (serve) or writes into the checkpoint (capture).
    pub fn bind(dir: &Path, mode: Mode) -> io::Result<Listener> {
        let path = dir.join(mode.socket_name());
        let listener = bind_in(dir, mode.socket_name())?;
        Ok(Listener {
            listener,
            path,
            mode,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits for CRIU to connect; `Ok(None)` once `stop` is set (CRIU finished or failed without
    /// connecting).
    pub fn accept(&self, stop: &AtomicBool) -> io::Result<Option<Connection>> {
        Ok(accept_until(&self.listener, stop)?.map(|sock| Connection {
            sock,
            mode: self.mode,
        }))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Runs `criu` (a CRIU call with `--stream`) while answering its image connection on `listener`, one
/// thread per image running `transfer(name, pipe)`; on restore (`Mode::Serve`) only images `exists` accepts
/// are announced. Returns CRIU's result and the serving's: the connection's own failure (as a dump error),
/// else the first image thread's. The checkpoint and restore flows both stream through this one loop.
pub fn serve_while<T, E>(
    listener: &Listener,
    exists: &(dyn Fn(&str) -> bool + Sync),
    transfer: &(dyn Fn(String, File) -> Result<(), E> + Sync),
    criu: impl FnOnce() -> T,
) -> (T, Result<(), E>)
where
    E: From<super::Error> + Send,
{
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let server = s.spawn(|| serve(listener, &stop, s, exists, transfer));
        let result = criu();
        stop.store(true, Ordering::SeqCst);
        let served = server
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        (result, served)
    })
}

/// Answers CRIU's connection until CRIU hangs up (or finishes without connecting: its own error says why).
fn serve<'scope, E>(
    listener: &Listener,
    stop: &AtomicBool,
    s: &'scope std::thread::Scope<'scope, '_>,
    exists: &(dyn Fn(&str) -> bool + Sync),
    transfer: &'scope (dyn Fn(String, File) -> Result<(), E> + Sync),
) -> Result<(), E>
where
    E: From<super::Error> + Send + 'scope,
{
    let proto = |e: io::Error| E::from(super::Error::io("CRIU's image streamer connection", e));
    let Some(mut conn) = listener.accept(stop).map_err(proto)? else {
        return Ok(());
    };
    let mut images = Vec::new();
    let result = (|| {
        while let Some(name) = conn.next_request().map_err(proto)? {
            if listener.mode == Mode::Serve {
                let found = exists(&name);
                tracing::debug!("CRIU asks for image {name} (exists: {found})");
                conn.reply(found).map_err(proto)?;
                if !found {
                    continue;
                }
            }
            let pipe = conn.receive_pipe().map_err(proto)?;
            images.push(s.spawn(move || transfer(name, pipe)));
        }
        Ok(())
    })();
    // Every image thread is waited for; the server's own error comes first, else the first thread's.
    let mut first = result.err();
    for t in images {
        let r = t.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        if let (None, Err(e)) = (&first, r) {
            first = Some(e);
        }
    }
    first.map_or(Ok(()), Err)
}

fn wait_readable(fd: RawFd, timeout: Duration) -> io::Result<()> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    Ok(())
}

/// CRIU's connection: a sequence of image requests.
pub struct Connection {
    sock: UnixStream,
    mode: Mode,
}

impl Connection {
    /// The next image CRIU opens, or `None` when CRIU is done (it closed the socket).
    pub fn next_request(&mut self) -> io::Result<Option<String>> {
        let mut len = [0u8; 4];
        // Exactly the bytes of one message, never more: the pipe's descriptor rides on the byte after it.
        if !read_exact_or_eof(&mut self.sock, &mut len)? {
            return Ok(None);
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_REQUEST {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("image request of {len} bytes"),
            ));
        }
        let mut msg = vec![0u8; len];
        self.sock.read_exact(&mut msg)?;
        decode_request(&msg).map(Some)
    }

    /// Restore: tells CRIU whether the image it asked for exists (if it does, CRIU sends a pipe next).
    pub fn reply(&mut self, exists: bool) -> io::Result<()> {
        debug_assert_eq!(self.mode, Mode::Serve);
        // img_streamer_reply_entry: field 1, varint.
        let msg = [0x08, exists as u8];
        let mut out = Vec::with_capacity(6);
        out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        out.extend_from_slice(&msg);
        self.sock.write_all(&out)
    }

    /// Receives the pipe for the image just requested: the read end on dump, the write end on restore.
    pub fn receive_pipe(&mut self) -> io::Result<File> {
        let pipe = File::from(crate::fdpass::receive_one(&self.sock, "the image's pipe")?);
        // A large pipe lets CRIU and us work at the same time: the store cuts a segment of several MiB at
        // once, and with a 64 KiB (default) or 1 MiB pipe CRIU would wait idle meanwhile (and on restore,
        // a whole chunk fits in the pipe, so CRIU reads while we verify the next). Root may exceed
        // fs.pipe-max-size; best effort, falling back to smaller sizes.
        for size in [PIPE_SIZE, 4 << 20, 1 << 20] {
            // SAFETY: fcntl on a descriptor we own.
            if unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_SETPIPE_SZ, size) } >= 0 {
                break;
            }
        }
        Ok(pipe)
    }
}

/// Whether `path` fits in a socket address (107 bytes, kept clear of): a store deep in the file system
/// gets past it, and a folder's descriptor (`/proc/.../fd/N`) must name the folder instead.
pub(crate) fn fits_socket_address(path: &Path) -> bool {
    path.as_os_str().len() < 100
}

/// A listening UNIX socket `name` in `dir` (an existing one is replaced), 0600 and non-blocking (polled, so
/// that a CRIU that fails before it connects does not leave us waiting forever).
pub(crate) fn bind_in(dir: &Path, name: &str) -> io::Result<UnixListener> {
    let path = dir.join(name);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    // The folder's descriptor names it in a few bytes (the kernel resolves /proc/self/fd/N like a
    // symlink).
    let listener = if fits_socket_address(&path) {
        UnixListener::bind(&path)?
    } else {
        let dir_fd = File::open(dir)?;
        UnixListener::bind(Path::new(&format!("/proc/self/fd/{}", dir_fd.as_raw_fd())).join(name))?
    };
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Waits for the one connection to a socket made by [`bind_in`] and returns it blocking; `Ok(None)` once
/// `stop` is set (the peer, CRIU, finished or failed without connecting).
pub(crate) fn accept_until(
    listener: &UnixListener,
    stop: &AtomicBool,
) -> io::Result<Option<UnixStream>> {
    loop {
        match listener.accept() {
            Ok((sock, _)) => {
                sock.set_nonblocking(false)?;
                return Ok(Some(sock));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if stop.load(Ordering::SeqCst) {
                    return Ok(None);
                }
                wait_readable(listener.as_raw_fd(), Duration::from_millis(20))?;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Reads exactly `buf.len()` bytes; `false` if the stream ended before the first byte.
fn read_exact_or_eof(r: &mut impl Read, buf: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        match r.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Ok(false),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "CRIU closed the image-streamer socket mid-message",
                ))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Decodes `img_streamer_request_entry` (one required string, field 1) with the protobuf crate's reader,
/// and checks the name is a plain file name: it becomes a path in the checkpoint.
fn decode_request(msg: &[u8]) -> io::Result<String> {
    let bad = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    let mut is = protobuf::CodedInputStream::from_bytes(msg);
    let mut name = None;
    while !is.eof().map_err(|e| bad(e.to_string()))? {
        let tag = is.read_raw_tag_or_eof().map_err(|e| bad(e.to_string()))?;
        match tag {
            Some(0x0a) => name = Some(is.read_string().map_err(|e| bad(e.to_string()))?),
            Some(t) => is
                .skip_field(protobuf::rt::WireType::new(t & 7).ok_or_else(|| {
                    bad(format!(
                        "image request with an unknown wire type in tag {t}"
                    ))
                })?)
                .map_err(|e| bad(e.to_string()))?,
            None => break,
        }
    }
    let name = name.ok_or_else(|| bad("image request without a file name".into()))?;
    if name.is_empty() || name.contains('/') || name == "." || name == ".." || name.contains('\0') {
        return Err(bad(format!("CRIU asked for an odd image name {name:?}")));
    }
    Ok(name)
}

/// The client side, for tests and the fake CRIU: what CRIU does for one image.
pub mod client {
    use super::*;

    /// Connects to the mode's socket in `dir`.
    pub fn connect(dir: &Path, mode: Mode) -> io::Result<UnixStream> {
        UnixStream::connect(dir.join(mode.socket_name()))
    }

    /// Asks for `name`; on restore returns `None` when the streamer says it does not exist. Returns our end
    /// of the pipe (the write end on dump, the read end on restore).
    pub fn open(sock: &mut UnixStream, mode: Mode, name: &str) -> io::Result<Option<File>> {
        let mut msg = vec![0x0a];
        encode_varint(name.len() as u64, &mut msg);
        msg.extend_from_slice(name.as_bytes());
        let mut out = (msg.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&msg);
        sock.write_all(&out)?;
        if mode == Mode::Serve {
            let mut len = [0u8; 4];
            sock.read_exact(&mut len)?;
            let mut reply = vec![0u8; u32::from_le_bytes(len) as usize];
            sock.read_exact(&mut reply)?;
            if reply != [0x08, 0x01] {
                return Ok(None);
            }
        }
        let (r, w) = nix::unistd::pipe().map_err(io::Error::from)?;
        let (ours, theirs) = match mode {
            Mode::Capture => (w, r),
            Mode::Serve => (r, w),
        };
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let fds = [theirs.as_raw_fd()];
        sendmsg::<()>(
            sock.as_raw_fd(),
            &[io::IoSlice::new(&[0])],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .map_err(io::Error::from)?;
        Ok(Some(File::from(ours)))
    }

    fn encode_varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A listener in a fresh folder, and `criu` run on a thread against it (given its connected socket):
    /// the accepted connection and that thread. The folder lives as long as the connection is used.
    fn with_criu<T: Send + 'static>(
        mode: Mode,
        criu: impl FnOnce(UnixStream) -> T + Send + 'static,
    ) -> (tempfile::TempDir, Connection, std::thread::JoinHandle<T>) {
        let dir = tempfile::tempdir().unwrap();
        let listener = Listener::bind(dir.path(), mode).unwrap();
        let d = dir.path().to_path_buf();
        let criu = std::thread::spawn(move || criu(client::connect(&d, mode).unwrap()));
        let stop = AtomicBool::new(false);
        let conn = listener.accept(&stop).unwrap().unwrap();
        (dir, conn, criu)
    }

    #[test]
    fn capture_receives_names_and_bytes() {
        let (_dir, mut conn, criu) = with_criu(Mode::Capture, |mut sock| {
            for (name, fill) in [("inventory.img", 1u8), ("pages-1.img", 2)] {
                let mut pipe = client::open(&mut sock, Mode::Capture, name)
                    .unwrap()
                    .unwrap();
                pipe.write_all(&vec![fill; 300_000]).unwrap();
            }
        });
        let mut got = Vec::new();
        while let Some(name) = conn.next_request().unwrap() {
            let mut pipe = conn.receive_pipe().unwrap();
            let mut data = Vec::new();
            pipe.read_to_end(&mut data).unwrap();
            got.push((name, data.len(), data[0]));
        }
        criu.join().unwrap();
        assert_eq!(
            got,
            vec![
                ("inventory.img".to_string(), 300_000, 1),
                ("pages-1.img".to_string(), 300_000, 2)
            ]
        );
    }

    #[test]
    fn serve_answers_missing_images_and_sends_bytes() {
        let (_dir, mut conn, criu) = with_criu(Mode::Serve, |mut sock| {
            assert!(client::open(&mut sock, Mode::Serve, "absent.img")
                .unwrap()
                .is_none());
            let mut pipe = client::open(&mut sock, Mode::Serve, "core-1.img")
                .unwrap()
                .unwrap();
            let mut data = Vec::new();
            pipe.read_to_end(&mut data).unwrap();
            data
        });
        assert_eq!(conn.next_request().unwrap().as_deref(), Some("absent.img"));
        conn.reply(false).unwrap();
        assert_eq!(conn.next_request().unwrap().as_deref(), Some("core-1.img"));
        conn.reply(true).unwrap();
        let mut pipe = conn.receive_pipe().unwrap();
        pipe.write_all(b"core bytes").unwrap();
        drop(pipe);
        assert_eq!(criu.join().unwrap(), b"core bytes");
        assert!(conn.next_request().unwrap().is_none());
    }

    #[test]
    fn a_deep_folder_still_gets_its_socket() {
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("d".repeat(60)).join("e".repeat(60));
        std::fs::create_dir_all(&deep).unwrap();
        let listener = Listener::bind(&deep, Mode::Capture).unwrap();
        assert!(listener.path().as_os_str().len() > 108);
        let d = deep.clone();
        let criu = std::thread::spawn(move || {
            // CRIU runs in the images folder and connects by a short path too (`-D .`).
            let dir = File::open(&d).unwrap();
            let mut sock = UnixStream::connect(format!(
                "/proc/self/fd/{}/{CAPTURE_SOCKET}",
                dir.as_raw_fd()
            ))
            .unwrap();
            let mut pipe = client::open(&mut sock, Mode::Capture, "x.img")
                .unwrap()
                .unwrap();
            pipe.write_all(b"deep").unwrap();
        });
        let stop = AtomicBool::new(false);
        let mut conn = listener.accept(&stop).unwrap().unwrap();
        assert_eq!(conn.next_request().unwrap().as_deref(), Some("x.img"));
        let mut data = Vec::new();
        conn.receive_pipe().unwrap().read_to_end(&mut data).unwrap();
        assert_eq!(data, b"deep");
        criu.join().unwrap();
    }

    #[test]
    fn accept_gives_up_when_told_to_stop() {
        let dir = tempfile::tempdir().unwrap();
        let listener = Listener::bind(dir.path(), Mode::Capture).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            s.store(true, Ordering::SeqCst);
        });
        assert!(listener.accept(&stop).unwrap().is_none());
        t.join().unwrap();
        let path = listener.path().to_path_buf();
        drop(listener);
        assert!(!path.exists(), "the socket is removed with the listener");
    }

    #[test]
    fn odd_names_are_refused() {
        for name in ["../etc/passwd", "", "a/b.img", ".."] {
            let mut msg = vec![0x0a, name.len() as u8];
            msg.extend_from_slice(name.as_bytes());
            assert!(decode_request(&msg).is_err(), "{name:?}");
        }
        assert!(decode_request(&[]).is_err());
        let mut ok = vec![0x0a, 8];
        ok.extend_from_slice(b"mm-1.img");
        assert_eq!(decode_request(&ok).unwrap(), "mm-1.img");
    }
}
