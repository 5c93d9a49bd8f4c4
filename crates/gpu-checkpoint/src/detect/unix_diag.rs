//! Which UNIX socket is connected to which, from the live kernel through `NETLINK_SOCK_DIAG` (what
//! `ss -x` reads).
//!
//! `net/unix` lists sockets but not their peers, and CRIU refuses to dump a socket connected to one
//! outside the tree unless told (`--ext-unix-sk`, `--external unix[INO]`). Only the live kernel can say
//! who is connected to whom, so a captured /proc tree goes without this check; and the kernel answers
//! for the caller's network namespace only (a process in another one is not checked: best effort).

use std::collections::HashMap;
use std::os::fd::AsRawFd;

use nix::sys::socket::{
    recv, sendto, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};

/// One UNIX socket as the kernel describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnixSocket {
    /// `libc::SOCK_STREAM`, `SOCK_DGRAM` or `SOCK_SEQPACKET`.
    pub kind: u8,
    /// The inode of the socket it is connected to (0: none).
    pub peer: u64,
    /// The name it is bound to (`@...` for the abstract namespace), if any.
    pub name: Option<String>,
}

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// `UDIAG_SHOW_NAME | UDIAG_SHOW_PEER` (linux/unix_diag.h).
const SHOW_NAME_AND_PEER: u32 = 0x1 | 0x4;
const UNIX_DIAG_NAME: u16 = 0;
const UNIX_DIAG_PEER: u16 = 2;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// `struct nlmsghdr` and `struct unix_diag_msg`.
const NLMSG_HEADER: usize = 16;
const UNIX_DIAG_MSG: usize = 16;

/// Every UNIX socket of this network namespace, by inode.
pub fn unix_sockets() -> std::io::Result<HashMap<u64, UnixSocket>> {
    let sock = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )?;
    sendto(
        sock.as_raw_fd(),
        &request(),
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )?;
    let mut out = HashMap::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = recv(sock.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        if n == 0 || parse_batch(&buf[..n], &mut out)? {
            return Ok(out);
        }
    }
}

/// A dump request for every UNIX socket, with its name and peer.
fn request() -> Vec<u8> {
    let mut r = Vec::with_capacity(NLMSG_HEADER + 24);
    let len = (NLMSG_HEADER + 24) as u32;
    r.extend_from_slice(&len.to_ne_bytes());
    r.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    r.extend_from_slice(&flags.to_ne_bytes());
    r.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
    r.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
                                              // struct unix_diag_req
    r.push(libc::AF_UNIX as u8);
    r.push(0); // protocol
    r.extend_from_slice(&0u16.to_ne_bytes()); // pad
    r.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    r.extend_from_slice(&0u32.to_ne_bytes()); // every inode
    r.extend_from_slice(&SHOW_NAME_AND_PEER.to_ne_bytes());
    r.extend_from_slice(&u32::MAX.to_ne_bytes()); // no cookie
    r.extend_from_slice(&u32::MAX.to_ne_bytes());
    r
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn bad(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("sock_diag: {what}"),
    )
}

/// Parses one datagram of answers into `out`; true once the kernel said it is done.
fn parse_batch(mut b: &[u8], out: &mut HashMap<u64, UnixSocket>) -> std::io::Result<bool> {
    while b.len() >= NLMSG_HEADER {
        let len = u32_at(b, 0).ok_or_else(|| bad("short header"))? as usize;
        let kind = u16_at(b, 4).ok_or_else(|| bad("short header"))?;
        if len < NLMSG_HEADER || len > b.len() {
            return Err(bad("message length out of bounds"));
        }
        let payload = &b[NLMSG_HEADER..len];
        match kind {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let errno = u32_at(payload, 0).map_or(0, |e| e as i32);
                return Err(std::io::Error::from_raw_os_error(errno.saturating_neg()));
            }
            SOCK_DIAG_BY_FAMILY => {
                if let Some((inode, s)) = parse_socket(payload) {
                    out.insert(inode, s);
                }
            }
            _ => {}
        }
        // Messages are 4-byte aligned.
        let next = (len + 3) & !3;
        b = b.get(next..).unwrap_or(&[]);
    }
    Ok(false)
}

/// One `struct unix_diag_msg` and its attributes.
fn parse_socket(m: &[u8]) -> Option<(u64, UnixSocket)> {
    let kind = *m.get(1)?;
    let inode = u64::from(u32_at(m, 4)?);
    let mut s = UnixSocket {
        kind,
        peer: 0,
        name: None,
    };
    let mut a = m.get(UNIX_DIAG_MSG..)?;
    while a.len() >= 4 {
        let len = usize::from(u16_at(a, 0)?);
        let ty = u16_at(a, 2)?;
        if len < 4 || len > a.len() {
            break;
        }
        let data = &a[4..len];
        match ty {
            UNIX_DIAG_PEER => s.peer = u64::from(u32_at(data, 0)?),
            UNIX_DIAG_NAME if !data.is_empty() => s.name = Some(socket_name(data)),
            _ => {}
        }
        a = a.get((len + 3) & !3..).unwrap_or(&[]);
    }
    Some((inode, s))
}

/// A path, or `@name` for the abstract namespace (a leading NUL), as `net/unix` writes it.
fn socket_name(data: &[u8]) -> String {
    match data.split_first() {
        Some((0, rest)) => format!("@{}", String::from_utf8_lossy(rest)),
        _ => String::from_utf8_lossy(data)
            .trim_end_matches('\0')
            .to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::net::{UnixDatagram, UnixStream};

    fn inode(fd: &impl AsRawFd) -> u64 {
        std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .unwrap()
            .ino()
    }

    /// A socket pair's halves name each other; a bound datagram socket has its name.
    #[test]
    fn peers_and_names_from_the_kernel() {
        let (a, b) = UnixStream::pair().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.sock");
        let bound = UnixDatagram::bind(&path).unwrap();
        let client = UnixDatagram::unbound().unwrap();
        client.connect(&path).unwrap();
        let all = match unix_sockets() {
            Ok(all) => all,
            // A sandbox without NETLINK_SOCK_DIAG: nothing to check against.
            Err(e) => {
                eprintln!("SKIPPED: sock_diag unavailable: {e}");
                return;
            }
        };
        let (ia, ib) = (inode(&a), inode(&b));
        assert_eq!(all[&ia].peer, ib);
        assert_eq!(all[&ib].peer, ia);
        assert_eq!(all[&ia].kind, libc::SOCK_STREAM as u8);
        let ibound = inode(&bound);
        assert_eq!(all[&ibound].name.as_deref(), path.to_str());
        assert_eq!(all[&inode(&client)].peer, ibound);
        assert_eq!(all[&inode(&client)].kind, libc::SOCK_DGRAM as u8);
    }

    #[test]
    fn abstract_names_and_truncated_messages() {
        assert_eq!(socket_name(b"\0cuda-uvmfd-1"), "@cuda-uvmfd-1");
        assert_eq!(socket_name(b"/run/x.sock\0"), "/run/x.sock");
        let mut out = HashMap::new();
        // A header claiming more than there is.
        let mut m = 64u32.to_ne_bytes().to_vec();
        m.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        assert!(parse_batch(&m, &mut out).is_err());
        assert!(parse_socket(&[1, 2]).is_none());
    }
}
