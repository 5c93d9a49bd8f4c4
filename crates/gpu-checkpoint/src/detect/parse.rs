//! Parsers for the /proc files detection reads. They take bytes (what `read` returned) and the path
//! (for errors), and never panic: malformed input is an [`Error::Malformed`] naming file and line.

use std::path::Path;

use super::Error;

/// One line of `/proc/<pid>/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapEntry {
    pub start: u64,
    pub end: u64,
    pub read: bool,
    pub write: bool,
    pub exec: bool,
    /// `s` in the fourth permission column: MAP_SHARED. Device memory is always mapped shared.
    pub shared: bool,
    pub offset: u64,
    pub inode: u64,
    /// The path, with a trailing ` (deleted)` removed; `None` for anonymous mappings. Pseudo paths such
    /// as `[heap]` are kept as they are.
    pub path: Option<String>,
    pub deleted: bool,
}

impl MapEntry {
    pub fn size(&self) -> u64 {
        self.end - self.start
    }
}

fn malformed(path: &Path, line: usize, reason: impl Into<String>) -> Error {
    Error::Malformed {
        path: path.to_path_buf(),
        line: Some(line),
        reason: reason.into(),
    }
}

fn hex(field: &str) -> Option<u64> {
    if field.is_empty() || field.len() > 16 {
        return None;
    }
    u64::from_str_radix(field, 16).ok()
}

/// Parses a whole maps file.
pub fn parse_maps(data: &[u8], path: &Path) -> Result<Vec<MapEntry>, Error> {
    let text = String::from_utf8_lossy(data);
    let mut out = Vec::with_capacity(text.len() / 64);
    for (i, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        out.push(parse_maps_line(line).map_err(|reason| malformed(path, i + 1, reason))?);
    }
    Ok(out)
}

/// Parses one maps line: `start-end perms offset dev inode [path]`.
pub fn parse_maps_line(line: &str) -> Result<MapEntry, String> {
    let mut rest = line;
    let mut field = || -> Option<&str> {
        let t = rest.trim_start_matches(' ');
        let end = t.find(' ').unwrap_or(t.len());
        let (f, r) = t.split_at(end);
        rest = r;
        (!f.is_empty()).then_some(f)
    };
    let bad = |what: &str| format!("malformed maps line (bad {what}): {line:?}");
    let range = field().ok_or_else(|| bad("address range"))?;
    let perms = field().ok_or_else(|| bad("permissions"))?;
    let offset = field().ok_or_else(|| bad("offset"))?;
    let dev = field().ok_or_else(|| bad("device"))?;
    let inode = field().ok_or_else(|| bad("inode"))?;
    let (start, end) = range.split_once('-').ok_or_else(|| bad("address range"))?;
    let (start, end) = (
        hex(start).ok_or_else(|| bad("start address"))?,
        hex(end).ok_or_else(|| bad("end address"))?,
    );
    if end < start {
        return Err(bad("address range (end before start)"));
    }
    let p = perms.as_bytes();
    if p.len() != 4
        || !matches!(p[0], b'r' | b'-')
        || !matches!(p[1], b'w' | b'-')
        || !matches!(p[2], b'x' | b'-')
        || !matches!(p[3], b's' | b'p')
    {
        return Err(bad("permissions"));
    }
    let offset = hex(offset).ok_or_else(|| bad("offset"))?;
    if !dev.contains(':') {
        return Err(bad("device"));
    }
    let inode: u64 = inode.parse().map_err(|_| bad("inode"))?;
    let rest = rest.trim_start_matches(' ');
    let (path, deleted) = if rest.is_empty() {
        (None, false)
    } else if let Some(p) = rest.strip_suffix(" (deleted)") {
        (Some(p.to_string()), true)
    } else {
        (Some(rest.to_string()), false)
    };
    Ok(MapEntry {
        start,
        end,
        read: p[0] == b'r',
        write: p[1] == b'w',
        exec: p[2] == b'x',
        shared: p[3] == b's',
        offset,
        inode,
        path,
        deleted,
    })
}

/// The fields of `/proc/<pid>/stat`: one parser serves detection and the flows ([`crate::proc`]).
pub use crate::proc::{ProcStat as Stat, PF_KTHREAD};

/// Parses `stat` (see [`crate::proc::parse_stat`]), naming the file when it is malformed.
pub fn parse_stat(data: &[u8], path: &Path) -> Result<Stat, Error> {
    crate::proc::parse_stat(&String::from_utf8_lossy(data))
        .map_err(|reason| malformed(path, 1, reason))
}

/// `NSpid:` of `/proc/<pid>/status`: the pid in each PID namespace from the reader's down to the
/// process's own. Empty when the line is missing (old kernels, partial captures).
pub fn parse_nspid(data: &[u8]) -> Vec<i32> {
    let text = String::from_utf8_lossy(data);
    text.lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|v| {
            v.split_ascii_whitespace()
                .filter_map(|s| s.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Variables detection cares about: the GPU-related prefixes that `capture-proc.sh` also keeps.
pub const GPU_ENV_PREFIXES: &[&str] = &["CUDA_", "NCCL_", "NVIDIA_", "HIP_", "ROCR_", "GPU_"];

/// gpu-checkpoint's own settings (`GPU_CHECKPOINT_CRIU`, ...): they match the `GPU_` prefix but describe
/// this tool, and every process our scripts start inherits them, so they are no evidence of GPU state.
const OWN_ENV_PREFIX: &str = "GPU_CHECKPOINT_";

/// What stands in for a value that is not kept.
pub const REDACTED: &str = "<redacted>";

/// Words that mark a variable as a credential whatever its prefix (`GPU_API_KEY`, `NVIDIA_API_TOKEN`,
/// `CUDA_..._PASSWORD`): its value is never kept. `scripts/capture-proc.sh` uses the same list.
const SECRET_NAME_WORDS: &[&str] = &[
    "KEY",
    "TOKEN",
    "SECRET",
    "PASSW",
    "PASSPHRASE",
    "CREDENTIAL",
    "AUTH",
    "COOKIE",
    "SESSION",
    "PRIVATE",
    "SIGNATURE",
];

/// Whether a GPU variable's value may be kept (in reports, manifests, printed): not when its name looks like
/// a credential's, nor when the value carries a password (`scheme://user:password@host`). Device lists,
/// versions and paths, which detection uses as evidence, stay.
pub fn keeps_value(name: &str, value: &str) -> bool {
    let upper = name.to_ascii_uppercase();
    let secret_name = SECRET_NAME_WORDS.iter().any(|w| upper.contains(w));
    let userinfo = value.split("://").skip(1).any(|rest| {
        let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
        authority
            .rsplit_once('@')
            .is_some_and(|(user, _)| user.contains(':'))
    });
    !secret_name && !userinfo
}

/// Parses `environ` (NUL-separated `NAME=VALUE`), keeping only variables whose name starts with one of
/// [`GPU_ENV_PREFIXES`]. Values of other variables never leave this function: they may hold secrets; nor do
/// values of GPU variables that look like credentials ([`keeps_value`]): their names stay as evidence, with
/// [`REDACTED`] as the value.
pub fn parse_gpu_environ(data: &[u8]) -> Vec<(String, String)> {
    data.split(|&b| b == 0)
        .filter(|rec| {
            GPU_ENV_PREFIXES
                .iter()
                .any(|p| rec.starts_with(p.as_bytes()))
                && !rec.starts_with(OWN_ENV_PREFIX.as_bytes())
        })
        .filter_map(|rec| {
            let eq = rec.iter().position(|&b| b == b'=')?;
            let name = String::from_utf8_lossy(&rec[..eq]).into_owned();
            let value = String::from_utf8_lossy(&rec[eq + 1..]);
            let value = if keeps_value(&name, &value) {
                value.into_owned()
            } else {
                REDACTED.to_string()
            };
            Some((name, value))
        })
        .collect()
}

/// The cgroup path of a process: the cgroup v2 line (`0::/path`), else the first line's path.
pub fn parse_cgroup(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    let mut first = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(_), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" {
            return Some(path.to_string());
        }
        first.get_or_insert_with(|| path.to_string());
    }
    first
}

/// A container id in a cgroup path: the last 64-hex-digit token (docker, containerd, cri-o, podman all
/// put one there, with various prefixes and suffixes such as `docker-<id>.scope`).
pub fn container_id(cgroup: &str) -> Option<String> {
    cgroup
        .split(|c: char| !c.is_ascii_hexdigit())
        .rfind(|t| t.len() == 64)
        .map(str::to_string)
}

/// One socket of `net/unix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnixSocket {
    pub inode: u64,
    /// Bound path; abstract names start with `@`; empty for unnamed sockets.
    pub path: String,
}

/// Parses `net/unix`. Unnamed sockets are kept (with an empty path) so that a lookup can tell "this
/// namespace's socket, unnamed" from "not in this namespace". Lines that do not parse are skipped: the
/// file is a diagnostic aid and the kernel's format has grown columns.
pub fn parse_net_unix(data: &[u8]) -> Vec<UnixSocket> {
    let text = String::from_utf8_lossy(data);
    text.lines()
        .skip(1)
        .filter_map(|line| {
            // Num RefCount Protocol Flags Type St Inode [Path]
            let mut f = line.split_ascii_whitespace();
            let inode = f.nth(6)?.parse().ok()?;
            let path: Vec<&str> = f.collect();
            Some(UnixSocket {
                inode,
                path: path.join(" "),
            })
        })
        .collect()
}

/// `socket:[12345]` -> 12345.
pub fn socket_inode(fd_target: &str) -> Option<u64> {
    fd_target
        .strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// The first `lock:` line of an fdinfo file (`1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234 0 EOF`), without
/// its number and with spaces squeezed: a lock held through that descriptor by its process (the kernel
/// lists only the process's own).
pub fn fdinfo_lock(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    let line = text.lines().find_map(|l| l.strip_prefix("lock:"))?;
    let words: Vec<&str> = line
        .split_ascii_whitespace()
        .skip_while(|w| w.ends_with(':'))
        .collect();
    Some(words.join(" "))
}

/// TCP states CRIU dumps only with `--tcp-established` (or `--tcp-close`), as `net/tcp` writes them
/// (hex): ESTABLISHED, SYN_SENT, FIN_WAIT1, FIN_WAIT2, CLOSE_WAIT, LAST_ACK, CLOSING.
pub const TCP_CONNECTED_STATES: &[u8] = &[0x01, 0x02, 0x04, 0x05, 0x08, 0x09, 0x0b];

/// One socket of `net/tcp` or `net/tcp6`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSocket {
    pub inode: u64,
    /// The kernel's state number (`01` ESTABLISHED, `0A` LISTEN, ...).
    pub state: u8,
    /// Local and remote `ADDR:PORT`, in the file's hex.
    pub local: String,
    pub remote: String,
}

/// Parses `net/tcp` or `net/tcp6` (`sl local_address rem_address st ... uid timeout inode`); lines that do
/// not parse are skipped.
pub fn parse_net_tcp(data: &[u8]) -> Vec<TcpSocket> {
    let text = String::from_utf8_lossy(data);
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_ascii_whitespace().collect();
            Some(TcpSocket {
                local: (*f.get(1)?).to_string(),
                remote: (*f.get(2)?).to_string(),
                state: u8::from_str_radix(f.get(3)?, 16).ok()?,
                inode: f.get(9)?.parse().ok()?,
            })
        })
        .collect()
}

/// `0100007F:1F90` (net/tcp's hex: the address in host byte order) -> `127.0.0.1:8080`; IPv6 addresses
/// keep their hex, with the port in decimal.
pub fn tcp_address(hex: &str) -> String {
    let Some((addr, port)) = hex.split_once(':') else {
        return hex.to_string();
    };
    let Ok(p) = u16::from_str_radix(port, 16) else {
        return hex.to_string();
    };
    match u32::from_str_radix(addr, 16) {
        Ok(a) if addr.len() == 8 => {
            let b = a.to_le_bytes();
            format!("{}.{}.{}.{}:{p}", b[0], b[1], b[2], b[3])
        }
        _ => format!("[{addr}]:{p}"),
    }
}

/// The driver version from `driver/nvidia/version`
/// (`NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu ...`).
pub fn parse_driver_version(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_ascii_whitespace()
        .find(|t| {
            t.split('.').count() >= 2
                && t.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

/// The major number of a driver version string (`570.86.15` -> 570).
pub fn driver_major(version: &str) -> Option<u32> {
    version.split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "/proc/1/maps";

    #[test]
    fn maps_line_with_device_path() {
        let e = parse_maps_line("200000000-200200000 rw-s 00000000 00:05 1033   /dev/nvidiactl")
            .unwrap();
        assert_eq!(
            (e.start, e.end, e.size()),
            (0x2_0000_0000, 0x2_0020_0000, 0x20_0000)
        );
        assert!(e.read && e.write && !e.exec && e.shared);
        assert_eq!(e.inode, 1033);
        assert_eq!(e.path.as_deref(), Some("/dev/nvidiactl"));
    }

    #[test]
    fn maps_line_anonymous_reservation_and_deleted_and_spaces() {
        let e = parse_maps_line("7f0000000000-7f0000001000 ---p 00000000 00:00 0").unwrap();
        assert!(!e.read && !e.shared && e.path.is_none());
        let e =
            parse_maps_line("7f00-7f01 rw-s 00000000 00:01 9 /dev/shm/my seg (deleted)").unwrap();
        assert_eq!(e.path.as_deref(), Some("/dev/shm/my seg"));
        assert!(e.deleted);
    }

    #[test]
    fn malformed_maps_names_file_and_line() {
        let data = b"1000-2000 r--p 00000000 00:00 0\nzzzz-2000 r--p 00000000 00:00 0\n";
        let err = parse_maps(data, Path::new(P)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with("/proc/1/maps:2: "), "{msg}");
        assert!(matches!(err, Error::Malformed { line: Some(2), .. }));
        for bad in [
            "1000 r--p 0 00:00 0",
            "2000-1000 r--p 0 00:00 0",
            "1000-2000 rw 0 00:00 0",
            "1000-2000 rwxq 0 00:00 0",
            "1000-2000 rw-p 0 0000 0",
            "1000-2000 rw-p 0 00:00 x",
            "1000-2000",
            "",
            "1000-2000 r--p 0 00:00",
            "10000000000000000-10000000000000001 r--p 0 00:00 0",
        ] {
            assert!(parse_maps_line(bad).is_err(), "accepted {bad:?}");
        }
    }

    #[test]
    fn stat_with_parentheses_in_comm() {
        let s = parse_stat(
            b"42 (a) b) S 7 42 42 0 -1 4194560 1 2 3",
            Path::new("/proc/42/stat"),
        )
        .unwrap();
        assert_eq!(s.comm, "a) b");
        assert_eq!((s.state, s.ppid, s.flags), ('S', 7, 4194560));
        assert!(!s.is_kernel_thread());
        let k = parse_stat(b"2 (kthreadd) S 0 0 0 0 -1 2129984 0", Path::new("x")).unwrap();
        assert!(k.is_kernel_thread());
        assert!(parse_stat(b"42 (a S 7", Path::new("x")).is_err());
        assert!(parse_stat(b"", Path::new("x")).is_err());
        assert!(parse_stat(b"42 (a) S", Path::new("x")).is_err());
    }

    #[test]
    fn environ_keeps_only_gpu_variables() {
        let env = parse_gpu_environ(
            b"HOME=/root\0CUDA_VISIBLE_DEVICES=0,1\0SECRET=x\0NCCL_DEBUG=INFO\0GPU_X\0\
              GPU_CHECKPOINT_CRIU=/opt/criu\0GPU_DEVICE_ORDINAL=1\0",
        );
        assert_eq!(
            env,
            vec![
                ("CUDA_VISIBLE_DEVICES".to_string(), "0,1".to_string()),
                ("NCCL_DEBUG".to_string(), "INFO".to_string()),
                ("GPU_DEVICE_ORDINAL".to_string(), "1".to_string()),
            ]
        );
    }

    /// Credentials under GPU names keep their names (evidence) but never their values.
    #[test]
    fn environ_never_keeps_a_credential() {
        let env = parse_gpu_environ(
            b"GPU_API_KEY=sk-live-123\0NVIDIA_API_TOKEN=nvt-456\0CUDA_CACHE_PASSWORD=pw\0\
              NCCL_STORE_URL=https://alice:pw-789@store.invalid/x\0NCCL_SOCKET_IFNAME=eth0\0\
              CUDA_MPS_PIPE_DIRECTORY=/tmp/mps\0NVIDIA_VISIBLE_DEVICES=GPU-1234\0",
        );
        let text = format!("{env:?}");
        for secret in ["sk-live-123", "nvt-456", "pw", "pw-789"] {
            assert!(!text.contains(&format!("\"{secret}")), "{secret}: {text}");
        }
        assert!(!text.contains("pw-789"), "{text}");
        assert_eq!(env.len(), 7, "every GPU variable's name stays: {text}");
        assert!(env.contains(&("GPU_API_KEY".into(), REDACTED.into())));
        assert!(env.contains(&("NCCL_STORE_URL".into(), REDACTED.into())));
        assert!(env.contains(&("NCCL_SOCKET_IFNAME".into(), "eth0".into())));
        assert!(env.contains(&("CUDA_MPS_PIPE_DIRECTORY".into(), "/tmp/mps".into())));
        assert!(env.contains(&("NVIDIA_VISIBLE_DEVICES".into(), "GPU-1234".into())));
    }

    #[test]
    fn cgroup_and_container_id() {
        let id = "a".repeat(64);
        let cg = format!("12:cpu:/x\n0::/system.slice/docker-{id}.scope\n");
        let path = parse_cgroup(cg.as_bytes()).unwrap();
        assert_eq!(path, format!("/system.slice/docker-{id}.scope"));
        assert_eq!(container_id(&path), Some(id));
        assert_eq!(container_id("/user.slice/session-1.scope"), None);
        assert_eq!(parse_cgroup(b""), None);
    }

    #[test]
    fn net_unix_and_socket_inodes() {
        let data = b"Num       RefCount Protocol Flags    Type St Inode Path\n\
0000000000000000: 00000002 00000000 00010000 0001 01 4242 @gpu-checkpoint-sim/1\n\
0000000000000000: 00000003 00000000 00000000 0001 03 4243\n\
0000000000000000: 00000002 00000000 00010000 0001 01 4244 /tmp/nvidia-mps/control\n";
        let socks = parse_net_unix(data);
        assert_eq!(socks.len(), 3);
        assert_eq!(socks[0].inode, 4242);
        assert_eq!(socks[0].path, "@gpu-checkpoint-sim/1");
        assert_eq!((socks[1].inode, socks[1].path.as_str()), (4243, ""));
        assert_eq!(socks[2].path, "/tmp/nvidia-mps/control");
        assert_eq!(socket_inode("socket:[4242]"), Some(4242));
        assert_eq!(socket_inode("/dev/null"), None);
    }

    #[test]
    fn net_tcp_and_fdinfo_locks() {
        let tcp = b"  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5001 1 0 100 0 0 10 0\n\
   1: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 5002 1 0 20 4 30 10 -1\n\
   garbage\n";
        let socks = parse_net_tcp(tcp);
        assert_eq!(socks.len(), 2);
        assert_eq!((socks[0].inode, socks[0].state), (5001, 0x0a));
        assert_eq!((socks[1].inode, socks[1].state), (5002, 0x01));
        assert_eq!(tcp_address(&socks[1].local), "127.0.0.1:8080");
        assert_eq!(tcp_address(&socks[1].remote), "127.0.0.1:50000");
        assert_eq!(
            tcp_address("00000000000000000000000001000000:0016"),
            "[00000000000000000000000001000000]:22"
        );
        let info = "pos:\t0\nflags:\t0100002\nmnt_id:\t30\nino:\t1234\n\
                    lock:\t1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234 0 EOF\n";
        assert_eq!(
            fdinfo_lock(info.as_bytes()).as_deref(),
            Some("FLOCK ADVISORY WRITE 4242 00:2f:1234 0 EOF")
        );
        assert_eq!(fdinfo_lock(b"pos:\t0\n"), None);
    }

    #[test]
    fn driver_version() {
        let v = b"NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 23 2025\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(parse_driver_version(v).as_deref(), Some("570.86.15"));
        let open =
            b"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build\n";
        assert_eq!(parse_driver_version(open).as_deref(), Some("580.65.06"));
        assert_eq!(driver_major("550.54.14"), Some(550));
        assert_eq!(parse_driver_version(b"garbage"), None);
    }

    proptest::proptest! {
        /// Whatever a maps, stat or status file holds, parsing returns a value or an error, never panics.
        #[test]
        fn parsers_never_panic(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
                               line in "[0-9a-f -]{0,20}[rwxsp-]{0,5}[ 0-9a-f:]{0,30}.{0,20}") {
            let _ = parse_maps(&data, Path::new(P));
            let _ = parse_maps_line(&line);
            let _ = parse_stat(&data, Path::new("stat"));
            let _ = parse_stat(line.as_bytes(), Path::new("stat"));
            let _ = parse_nspid(&data);
            let _ = parse_gpu_environ(&data);
            let _ = parse_cgroup(&data);
            let _ = parse_net_unix(&data);
            let _ = parse_net_tcp(&data);
            let _ = fdinfo_lock(&data);
            let _ = parse_driver_version(&data);
        }
    }

    #[test]
    fn nspid() {
        assert_eq!(parse_nspid(b"Name:\tx\nNSpid:\t4000\t12\n"), vec![4000, 12]);
        assert!(parse_nspid(b"Name:\tx\n").is_empty());
    }
}
