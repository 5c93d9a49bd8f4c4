//! Where /proc data comes from: the live `/proc` or a captured tree (`--proc-root DIR`).
//!
//! Both are read through the same [`ProcRoot`], a path abstraction: a captured tree is laid out exactly
//! like `/proc` (`DIR/<pid>/maps`, `DIR/<pid>/fd/<n>` symlinks, `DIR/net/unix`, ...), so one code path
//! serves both and the tests exercise the code that runs in production.
//!
//! We read the files ourselves rather than through `procfs::Process`: detection reads a handful of
//! fields from a handful of files, and raw reads into one buffer are measurably cheaper for the
//! "whole node in < 200 ms" target (see `docs/detect.md`), give us the line numbers our errors must
//! name, and do not tie the crate to Linux (a captured tree can be read anywhere).

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use super::Error;

/// The root of a /proc tree.
#[derive(Debug, Clone)]
pub struct ProcRoot {
    path: PathBuf,
}

impl ProcRoot {
    /// Opens `path` as a /proc tree after checking that it looks like one: a folder holding at least one
    /// numeric (process) folder. Anything else is bad input (exit 2), not "no such process".
    pub fn open(path: &Path) -> Result<Self, Error> {
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        if path == Path::new("/proc") {
            return Err(Error::ProcUnavailable);
        }
        let not_tree = |reason: String| Error::NotProcTree {
            path: path.to_path_buf(),
            reason,
        };
        let meta = fs::metadata(path).map_err(|e| not_tree(e.to_string()))?;
        if !meta.is_dir() {
            return Err(not_tree("not a folder".into()));
        }
        let entries = fs::read_dir(path).map_err(|e| match e.kind() {
            io::ErrorKind::PermissionDenied => Error::PermissionDenied {
                path: path.to_path_buf(),
            },
            _ => not_tree(e.to_string()),
        })?;
        let has_pid = entries
            .filter_map(|e| e.ok())
            .any(|e| parse_pid(e.file_name().as_encoded_bytes()).is_some());
        if !has_pid {
            return Err(not_tree("no process folders (numeric names) in it".into()));
        }
        Ok(ProcRoot {
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn pid_dir(&self, pid: i32) -> PathBuf {
        self.path.join(pid.to_string())
    }

    pub fn pid_file(&self, pid: i32, name: &str) -> PathBuf {
        let mut p = self.pid_dir(pid);
        p.push(name);
        p
    }

    /// True when `<root>/<pid>` exists.
    pub fn has_pid(&self, pid: i32) -> bool {
        pid > 0 && self.pid_dir(pid).is_dir()
    }

    /// Every process folder under the root, in no particular order.
    pub fn pids(&self) -> Result<Vec<i32>, Error> {
        let rd = fs::read_dir(&self.path).map_err(|e| self.io_error(&self.path, e))?;
        Ok(rd
            .filter_map(|e| e.ok())
            .filter_map(|e| parse_pid(e.file_name().as_encoded_bytes()))
            .collect())
    }

    /// Reads a file of process `pid` into `buf` (cleared first). A missing file of a process whose folder
    /// is gone means the process exited (or never existed): [`Error::NoSuchProcess`].
    pub fn read_into(&self, pid: i32, name: &str, buf: &mut Vec<u8>) -> Result<(), Error> {
        let path = self.pid_file(pid, name);
        buf.clear();
        match fs::File::open(&path).and_then(|mut f| f.read_to_end(buf)) {
            Ok(_) => Ok(()),
            Err(e) => Err(self.pid_error(pid, path, e)),
        }
    }

    /// Like [`read_into`](Self::read_into), but a file that is missing while the process folder exists is
    /// `Ok(false)`: captured trees may lack optional files (environ, cgroup, ...).
    pub fn read_optional(&self, pid: i32, name: &str, buf: &mut Vec<u8>) -> Result<bool, Error> {
        match self.read_into(pid, name, buf) {
            Ok(()) => Ok(true),
            Err(Error::Malformed { line: None, .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The open file descriptors of `pid` and what they point at (`/dev/nvidiactl`, `socket:[123]`, ...).
    pub fn fds(&self, pid: i32) -> Result<Vec<(i32, String)>, Error> {
        let dir = self.pid_file(pid, "fd");
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            // git keeps no empty folders: a captured process without fds has no fd folder.
            Err(e) if e.kind() == io::ErrorKind::NotFound && self.pid_dir(pid).is_dir() => {
                return Ok(Vec::new())
            }
            Err(e) => return Err(self.pid_error(pid, dir, e)),
        };
        let mut out = Vec::new();
        for entry in rd {
            let entry = match entry {
                Ok(e) => e,
                // The process exited while we listed its fds.
                Err(e) => return Err(self.pid_error(pid, dir, e)),
            };
            let Some(fd) = parse_pid(entry.file_name().as_encoded_bytes()) else {
                continue;
            };
            match fs::read_link(entry.path()) {
                Ok(target) => out.push((fd, target.to_string_lossy().into_owned())),
                // The fd was closed between readdir and readlink: it is not there any more.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(self.pid_error(pid, entry.path(), e)),
            }
        }
        out.sort_unstable_by_key(|(fd, _)| *fd);
        Ok(out)
    }

    /// The bytes on disk of the regular file that fd `fd` of `pid` has open (`st_blocks` × 512, what
    /// CRIU copies of a deleted file and compares with `--ghost-limit`: a sparse file counts its data
    /// only), through the fd link (which reaches a deleted file too); `None` when it is no regular file
    /// or the tree is a capture (its links name files that are not there).
    pub fn fd_file_allocated(&self, pid: i32, fd: i32) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        let md = fs::metadata(self.pid_file(pid, &format!("fd/{fd}"))).ok()?;
        md.is_file().then_some(md.blocks() * 512)
    }

    /// The bytes on disk of the file mapped at `start`-`end` in `pid` (`map_files`, which reaches a deleted
    /// file too), as [`ProcRoot::fd_file_allocated`]; `None` in a capture.
    pub fn map_file_allocated(&self, pid: i32, start: u64, end: u64) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        let md = fs::metadata(self.pid_file(pid, &format!("map_files/{start:x}-{end:x}"))).ok()?;
        md.is_file().then_some(md.blocks() * 512)
    }

    /// The inode of namespace `kind` (`ipc`, `pid`, ...) of `pid`, from its `ns/KIND` link
    /// (`ipc:[4026531839]`); `None` where the tree has no such link (captures).
    pub fn ns_inode(&self, pid: i32, kind: &str) -> Option<u64> {
        let link = fs::read_link(self.pid_file(pid, &format!("ns/{kind}"))).ok()?;
        let link = link.to_str()?;
        link.strip_prefix(kind)?
            .strip_prefix(":[")?
            .strip_suffix(']')?
            .parse()
            .ok()
    }

    /// Thread ids of `pid` (`task/*`); empty when the tree has no task folder.
    pub fn tids(&self, pid: i32) -> Vec<i32> {
        let mut out: Vec<i32> = fs::read_dir(self.pid_file(pid, "task"))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| parse_pid(e.file_name().as_encoded_bytes()))
                    .collect()
            })
            .unwrap_or_default();
        out.sort_unstable();
        out
    }

    /// A file relative to the root (`net/unix`, `driver/nvidia/version`); `None` when absent or unreadable.
    pub fn read_root_file(&self, rel: &str) -> Option<Vec<u8>> {
        fs::read(self.path.join(rel)).ok()
    }

    fn pid_error(&self, pid: i32, path: PathBuf, e: io::Error) -> Error {
        let gone = e.raw_os_error() == Some(libc::ESRCH)
            || (e.kind() == io::ErrorKind::NotFound && !self.pid_dir(pid).is_dir());
        if gone {
            Error::NoSuchProcess { pid, path }
        } else if e.kind() == io::ErrorKind::NotFound {
            // The process folder is there but a file the kernel always provides is not: an incomplete
            // captured tree. Optional files are handled by `read_optional`.
            Error::Malformed {
                path,
                line: None,
                reason:
                    "missing (an incomplete /proc tree? capture it with scripts/capture-proc.sh)"
                        .into(),
            }
        } else {
            self.io_error(&path, e)
        }
    }

    fn io_error(&self, path: &Path, e: io::Error) -> Error {
        match e.kind() {
            io::ErrorKind::PermissionDenied => Error::PermissionDenied {
                path: path.to_path_buf(),
            },
            _ => Error::Io {
                path: path.to_path_buf(),
                source: e,
            },
        }
    }
}

/// A positive decimal pid, or `None` (`self`, `net`, `12a`, `0`).
pub fn parse_pid(name: &[u8]) -> Option<i32> {
    if name.is_empty() || name.len() > 10 || !name.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: i64 = std::str::from_utf8(name).ok()?.parse().ok()?;
    (n > 0 && n <= i32::MAX as i64).then_some(n as i32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Classify;

    #[test]
    fn parse_pid_accepts_only_positive_decimals() {
        assert_eq!(parse_pid(b"42"), Some(42));
        assert_eq!(parse_pid(b"self"), None);
        assert_eq!(parse_pid(b"0"), None);
        assert_eq!(parse_pid(b"12a"), None);
        assert_eq!(parse_pid(b""), None);
        assert_eq!(parse_pid(b"99999999999"), None);
    }

    #[test]
    fn open_rejects_a_folder_without_processes() {
        let dir = tempfile::tempdir().unwrap();
        let err = ProcRoot::open(dir.path()).unwrap_err();
        assert!(matches!(err, Error::NotProcTree { .. }), "{err}");
        assert_eq!(err.exit_status(), crate::ExitStatus::Usage);
        let file = dir.path().join("f");
        fs::write(&file, b"x").unwrap();
        assert!(matches!(
            ProcRoot::open(&file).unwrap_err(),
            Error::NotProcTree { .. }
        ));
        assert!(matches!(
            ProcRoot::open(&dir.path().join("missing")).unwrap_err(),
            Error::NotProcTree { .. }
        ));
    }
}
