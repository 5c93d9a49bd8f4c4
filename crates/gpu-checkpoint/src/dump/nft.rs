//! nftables over netlink (netfilter's `NETLINK_NETFILTER`), in any network namespace: what the release of
//! CRIU's network lock (`network.rs`) needs, listing and deleting tables as `nft list tables` and `nft
//! delete table` would, without the `nft` command (hosts often lack it; CRIU carries libnftables).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub(super) const NFPROTO_INET: u8 = 1;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFTA_TABLE_NAME: u16 = 1;

/// A netfilter netlink socket of network namespace `ns` (ours with `None`): made by a thread that
/// entered it, since a socket belongs to the namespace it was made in wherever it is used.
fn nft_socket(ns: Option<&std::fs::File>) -> io::Result<OwnedFd> {
    let Some(ns) = ns else {
        return nft_socket_here();
    };
    let ns = ns.try_clone()?;
    std::thread::spawn(move || {
        // SAFETY: setns on a descriptor we own; it moves only this short-lived thread.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        nft_socket_here()
    })
    .join()
    .map_err(|_| io::Error::other("the thread entering the namespace panicked"))?
}

/// The cookie of network namespace `ns` (ours with `None`): unlike its inode, never given to another
/// namespace during this boot (`SO_NETNS_COOKIE`, Linux 5.14).
pub(super) fn netns_cookie(ns: Option<&std::fs::File>) -> io::Result<u64> {
    let sock = nft_socket(ns)?;
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt into a u64 we own, its size given.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&mut v as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

fn nft_socket_here() -> io::Result<OwnedFd> {
    const NETLINK_NETFILTER: libc::c_int = 12;
    // SAFETY: plain socket(2); the descriptor is owned right after.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_NETFILTER,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval {
        tv_sec: 5,
        tv_usec: 0,
    };
    // SAFETY: setsockopt with a timeval we own.
    unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    Ok(sock)
}

/// The names of the nftables tables of `family` in namespace `ns`, as `nft list tables` (a dump of
/// NFT_MSG_GETTABLE).
pub(super) fn nft_tables(ns: Option<&std::fs::File>, family: u8) -> io::Result<Vec<String>> {
    const NFT_MSG_NEWTABLE: u16 = 0;
    const NFT_MSG_GETTABLE: u16 = 1;
    let sock = nft_socket(ns)?;
    let mut req = Vec::new();
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    let get = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETTABLE;
    nl_message(&mut req, get, flags, 1, [family, 0], [0, 0], &[]);
    send_all(&sock, &req)?;
    let mut names = Vec::new();
    let mut buf = vec![0u8; 65536];
    loop {
        let n = recv(&sock, &mut buf)?;
        let mut at = 0;
        while at + 16 <= n {
            let len = u32::from_ne_bytes(buf[at..at + 4].try_into().unwrap()) as usize;
            let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
            if len < 16 || at + len > n {
                return Err(io::Error::other("a truncated netlink message"));
            }
            let msg = &buf[at..at + len];
            match kind {
                k if k == libc::NLMSG_DONE as u16 => return Ok(names),
                k if k == libc::NLMSG_ERROR as u16 => {
                    let errno = msg
                        .get(16..20)
                        .map_or(0, |e| -i32::from_ne_bytes(e.try_into().unwrap()));
                    if errno != 0 {
                        return Err(io::Error::from_raw_os_error(errno));
                    }
                }
                k if k == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWTABLE => {
                    // After nlmsghdr and nfgenmsg: attributes (length, type, value; 4-byte aligned).
                    let mut a = 20;
                    while a + 4 <= msg.len() {
                        let alen = u16::from_ne_bytes([msg[a], msg[a + 1]]) as usize;
                        let akind = u16::from_ne_bytes([msg[a + 2], msg[a + 3]]) & 0x3fff;
                        if alen < 4 || a + alen > msg.len() {
                            break;
                        }
                        if akind == NFTA_TABLE_NAME {
                            let v = &msg[a + 4..a + alen];
                            let v = v.split(|&b| b == 0).next().unwrap_or_default();
                            names.push(String::from_utf8_lossy(v).into_owned());
                        }
                        a += alen.next_multiple_of(4);
                    }
                }
                _ => {}
            }
            at += len.next_multiple_of(4);
        }
    }
}

fn send_all(sock: &OwnedFd, bytes: &[u8]) -> io::Result<()> {
    // SAFETY: send on our socket from a buffer we own; the kernel is the default destination.
    let sent = unsafe { libc::send(sock.as_raw_fd(), bytes.as_ptr().cast(), bytes.len(), 0) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn recv(sock: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: recv into a buffer we own.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

/// Deletes nftables table `name` of `family` in namespace `ns` (ours with `None`) over netlink, as
/// `nft delete table` would (one batch: begin, NFT_MSG_DELTABLE, end). A table already gone is no error.
pub(super) fn nft_delete_table(
    ns: Option<&std::fs::File>,
    family: u8,
    name: &str,
) -> io::Result<()> {
    const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
    const NFNL_MSG_BATCH_END: u16 = 0x11;
    const NFT_MSG_DELTABLE: u16 = 2;
    let sock = nft_socket(ns)?;
    let mut attr = name.as_bytes().to_vec();
    attr.push(0);
    let mut payload = ((4 + attr.len()) as u16).to_ne_bytes().to_vec();
    payload.extend_from_slice(&NFTA_TABLE_NAME.to_ne_bytes());
    payload.extend_from_slice(&attr);
    while !payload.len().is_multiple_of(4) {
        payload.push(0);
    }
    let mut batch = Vec::new();
    let flags = libc::NLM_F_REQUEST as u16;
    let subsys = NFNL_SUBSYS_NFTABLES.to_be_bytes();
    nl_message(
        &mut batch,
        NFNL_MSG_BATCH_BEGIN,
        flags,
        1,
        [0, 0],
        subsys,
        &[],
    );
    let del = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELTABLE;
    let ack = flags | libc::NLM_F_ACK as u16;
    nl_message(&mut batch, del, ack, 2, [family, 0], [0, 0], &payload);
    nl_message(
        &mut batch,
        NFNL_MSG_BATCH_END,
        flags,
        3,
        [0, 0],
        subsys,
        &[],
    );
    send_all(&sock, &batch)?;
    let mut buf = [0u8; 4096];
    let n = recv(&sock, &mut buf)?;
    // The answer: nlmsghdr (16 bytes) of type NLMSG_ERROR, then the errno (negative, 0 for success).
    if n < 20 || u16::from_ne_bytes([buf[4], buf[5]]) != libc::NLMSG_ERROR as u16 {
        return Err(io::Error::other("unexpected netlink answer"));
    }
    match -i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]) {
        0 | libc::ENOENT => Ok(()),
        errno => Err(io::Error::from_raw_os_error(errno)),
    }
}

/// Appends one netlink message: `nlmsghdr`, `nfgenmsg` (family, version, res_id), payload.
fn nl_message(
    out: &mut Vec<u8>,
    kind: u16,
    flags: u16,
    seq: u32,
    [family, version]: [u8; 2],
    res_id: [u8; 2],
    payload: &[u8],
) {
    let len = (16 + 4 + payload.len()) as u32;
    out.extend_from_slice(&len.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    out.extend_from_slice(&[family, version]);
    out.extend_from_slice(&res_id);
    out.extend_from_slice(payload);
}
