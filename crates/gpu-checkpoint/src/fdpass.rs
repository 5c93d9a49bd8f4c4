//! Receiving file descriptors over UNIX sockets (`SCM_RIGHTS`), shared by the image streamer (CRIU sends
//! one end of a pipe per image, `dump::streamer`) and the userfaultfd restore (CRIU sends each process's
//! userfaultfd, `flows::restore::uffd`).
//!
//! CRIU sends every descriptor alone, with a one-byte payload (`send_fds` in criu/util.c): one way to
//! receive them, so that the ownership of what the kernel installs in our table, the close-on-exec flag
//! and the checks are written once.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};

/// Receives the one descriptor the next message on `sock` carries (`what` names it in errors), close-on-exec.
/// The payload, one byte, is dropped. A peer that hung up instead is an `UnexpectedEof` error; a message
/// without exactly one descriptor is `InvalidData` (whatever it did carry is closed).
pub fn receive_one(sock: &impl AsFd, what: &str) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = [io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(
        sock.as_fd().as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(io::Error::from)?;
    if msg.bytes == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the socket closed before {what} came"),
        ));
    }
    let mut fds = Vec::new();
    for c in msg.cmsgs().map_err(io::Error::from)? {
        if let ControlMessageOwned::ScmRights(r) = c {
            fds.extend(r);
        }
    }
    // SAFETY: the kernel just installed these descriptors in our table; we own them now.
    let mut owned: Vec<OwnedFd> = fds
        .into_iter()
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if owned.len() != 1 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("expected one descriptor ({what}), got {}", owned.len()),
        ));
    }
    Ok(owned.remove(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    use nix::sys::socket::{sendmsg, ControlMessage};

    fn send(sock: &UnixStream, payload: &[u8], fds: &[RawFd]) {
        let cmsgs: Vec<ControlMessage> = if fds.is_empty() {
            vec![]
        } else {
            vec![ControlMessage::ScmRights(fds)]
        };
        sendmsg::<()>(
            sock.as_raw_fd(),
            &[io::IoSlice::new(payload)],
            &cmsgs,
            MsgFlags::empty(),
            None,
        )
        .unwrap();
    }

    #[test]
    fn a_descriptor_arrives_owned_and_close_on_exec() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, w) = nix::unistd::pipe().unwrap();
        send(&a, &[0], &[w.as_raw_fd()]);
        drop(w);
        let got = receive_one(&b, "a pipe").unwrap();
        // SAFETY: fcntl on a descriptor we own.
        let flags = unsafe { libc::fcntl(got.as_raw_fd(), libc::F_GETFD) };
        assert_ne!(flags & libc::FD_CLOEXEC, 0);
        std::fs::File::from(got).write_all(b"through").unwrap();
        let mut out = String::new();
        std::fs::File::from(r).read_to_string(&mut out).unwrap();
        assert_eq!(out, "through");
    }

    #[test]
    fn a_hang_up_or_a_message_without_a_descriptor_is_an_error() {
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, &[0], &[]);
        let e = receive_one(&b, "a pipe").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(
            e.to_string()
                .contains("expected one descriptor (a pipe), got 0"),
            "{e}"
        );
        drop(a);
        let e = receive_one(&b, "a pipe").unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
    }
}
