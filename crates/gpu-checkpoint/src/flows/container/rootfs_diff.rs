//! The changes a container made to its root file system, against the root file system it started from
//! (for podman: its image, `podman image mount ID`), as the checkpoint archive carries them:
//! `rootfs-diff.tar` (what the container added or changed) and `deleted.files` (a JSON list of the
//! paths it removed, absolute inside the container, as podman writes them). `export --rootfs-base DIR`
//! writes them, so that an engine restoring the archive on top of the image (`podman container restore
//! --import`) finds the files the processes had open, and the ones they wrote, as they were; podman's own
//! restore and ours (`restore/rootfs.rs`) apply them.
//!
//! What counts as a change, as containers-storage's naive diff (`archive.ChangesDirs`) judges it: an
//! entry missing from the base, of another type, owner or mode; a regular file of another size, or of
//! the same size with another modification time and other bytes (same size and time: unchanged, read
//! neither); a link to another target. A folder whose own metadata is unchanged is not an entry itself,
//! only what changed inside it. Devices, pipes and sockets are not carried (our restore refuses them in a
//! diff; a socket or pipe is the processes', which CRIU restores), nor anything on another file system
//! mounted inside: both are reported.
//!
//! Safely: the container owns its root file system and may change it while we read (an export of a
//! checkpoint left running), so nothing is read through a link it could plant. Every folder is opened
//! from its parent's descriptor with `O_NOFOLLOW | O_DIRECTORY` and every entry is reached through its
//! folder's pinned descriptor (`/proc/self/fd/N/NAME`, the last component never followed).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::Error;

/// What differs between a root file system and its base.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RootfsChanges {
    /// Relative paths to carry in `rootfs-diff.tar`, parents before their contents.
    pub changed: Vec<PathBuf>,
    /// Relative paths the base has and the root file system does not (the top-most of a removed tree).
    pub deleted: Vec<PathBuf>,
    /// Relative paths left out (devices, pipes, sockets, other file systems), with why.
    pub skipped: Vec<(PathBuf, &'static str)>,
}

impl RootfsChanges {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.deleted.is_empty()
    }

    /// `deleted.files`: the removed paths as podman lists them (`/bin/nc`).
    pub fn deleted_files(&self) -> Vec<u8> {
        let list: Vec<String> = self
            .deleted
            .iter()
            .map(|p| format!("/{}", p.display()))
            .collect();
        serde_json::to_vec(&list).expect("a list of strings")
    }
}

fn refused(root: &Path, reason: impl Into<String>) -> crate::Error {
    Error::RootfsChanges {
        rootfs: root.to_path_buf(),
        reason: reason.into(),
    }
    .into()
}

/// A folder held open (`O_NOFOLLOW | O_DIRECTORY`): its entries are reached through the descriptor, so
/// a folder on the way swapped for a link afterwards changes nothing.
struct Dir {
    file: File,
}

impl Dir {
    fn open_root(path: &Path) -> std::io::Result<Dir> {
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_DIRECTORY)
            .open(path)?;
        Ok(Dir { file })
    }

    /// `name` of this folder, reached through the descriptor, its last component never followed.
    fn entry(&self, name: &std::ffi::OsStr) -> PathBuf {
        use std::os::fd::AsRawFd;
        Path::new(&format!("/proc/self/fd/{}", self.file.as_raw_fd())).join(name)
    }

    fn sub(&self, name: &std::ffi::OsStr) -> std::io::Result<Dir> {
        Dir::open_root(&self.entry(name))
    }

    /// The names of the entries, sorted (a deterministic archive).
    fn names(&self) -> std::io::Result<BTreeSet<OsString>> {
        use std::os::fd::AsRawFd;
        fs::read_dir(format!("/proc/self/fd/{}", self.file.as_raw_fd()))?
            .map(|e| e.map(|e| e.file_name()))
            .collect()
    }

    fn lstat(&self, name: &std::ffi::OsStr) -> std::io::Result<fs::Metadata> {
        fs::symlink_metadata(self.entry(name))
    }

    fn open_file(&self, name: &std::ffi::OsStr) -> std::io::Result<File> {
        fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.entry(name))
    }
}

/// The changes of `rootfs` against `base`.
pub fn diff(base: &Path, rootfs: &Path) -> crate::Result<RootfsChanges> {
    let err = |what: &Path, e: std::io::Error| refused(rootfs, format!("{}: {e}", what.display()));
    let top = Dir::open_root(rootfs).map_err(|e| err(rootfs, e))?;
    let under = Dir::open_root(base).map_err(|e| err(base, e))?;
    let dev = top.file.metadata().map_err(|e| err(rootfs, e))?.dev();
    let mut walk = Walk {
        dev,
        out: RootfsChanges::default(),
    };
    walk.both(&top, Some(&under), Path::new(""))
        .map_err(|(p, e)| err(&rootfs.join(p), e))?;
    Ok(walk.out)
}

type WalkResult = Result<(), (PathBuf, std::io::Error)>;

struct Walk {
    /// The root file system's device: a folder on another one is a mount inside, left out.
    dev: u64,
    out: RootfsChanges,
}

impl Walk {
    /// Compares folder `rel` of the root file system (`top`) with the base's (`base`; `None`: the base
    /// has no such folder, everything in it is new).
    fn both(&mut self, top: &Dir, base: Option<&Dir>, rel: &Path) -> WalkResult {
        let at = |e| (rel.to_path_buf(), e);
        let names = top.names().map_err(at)?;
        if let Some(base) = base {
            for gone in base.names().map_err(at)?.difference(&names) {
                self.out.deleted.push(rel.join(gone));
            }
        }
        for name in &names {
            let path = rel.join(name);
            let at = |e| (path.clone(), e);
            let m = top.lstat(name).map_err(at)?;
            let old = base.and_then(|b| b.lstat(name).ok());
            let kind = m.file_type();
            if !(kind.is_dir() || kind.is_file() || kind.is_symlink()) {
                self.out.skipped.push((path, "not a folder, file or link"));
                continue;
            }
            if m.dev() != self.dev {
                self.out
                    .skipped
                    .push((path, "another file system mounted here"));
                continue;
            }
            let same_kind = old.as_ref().is_some_and(|o| o.file_type() == kind);
            let same_meta = old.as_ref().is_some_and(|o| {
                same_kind && o.mode() == m.mode() && o.uid() == m.uid() && o.gid() == m.gid()
            });
            if kind.is_dir() {
                if !same_meta {
                    self.out.changed.push(path.clone());
                }
                let sub = top.sub(name).map_err(at)?;
                // A folder that replaced something else: all of it is new.
                let old_sub = match (same_kind, base) {
                    (true, Some(b)) => Some(b.sub(name).map_err(at)?),
                    _ => None,
                };
                self.both(&sub, old_sub.as_ref(), &path)?;
            } else if !same_meta || !self.same_content(top, base, name, &m).map_err(at)? {
                self.out.changed.push(path);
            }
        }
        Ok(())
    }

    /// A file or link of the same type, owner and mode on both sides: whether its content is the same.
    fn same_content(
        &self,
        top: &Dir,
        base: Option<&Dir>,
        name: &std::ffi::OsStr,
        m: &fs::Metadata,
    ) -> std::io::Result<bool> {
        let Some(base) = base else {
            return Ok(false);
        };
        let o = base.lstat(name)?;
        if m.file_type().is_symlink() {
            return Ok(fs::read_link(top.entry(name))? == fs::read_link(base.entry(name))?);
        }
        if o.size() != m.size() {
            return Ok(false);
        }
        // Nanoseconds count unless one side has none (a file unpacked from a tar keeps whole seconds).
        let nanos = o.mtime_nsec() == m.mtime_nsec() || o.mtime_nsec() == 0 || m.mtime_nsec() == 0;
        if o.mtime() == m.mtime() && nanos {
            return Ok(true);
        }
        same_bytes(top.open_file(name)?, base.open_file(name)?)
    }
}

fn same_bytes(mut a: File, mut b: File) -> std::io::Result<bool> {
    let (mut x, mut y) = (vec![0u8; 1 << 16], vec![0u8; 1 << 16]);
    loop {
        let n = read_full(&mut a, &mut x)?;
        let m = read_full(&mut b, &mut y)?;
        if n != m || x[..n] != y[..m] {
            return Ok(false);
        }
        if n == 0 {
            return Ok(true);
        }
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Writes `rootfs-diff.tar` of `changes` (entries named by their relative paths, with their owners,
/// modes and times) into `out`.
pub fn write_diff_tar(
    rootfs: &Path,
    changes: &RootfsChanges,
    out: impl Write,
) -> crate::Result<()> {
    let err = |p: &Path, e: std::io::Error| refused(rootfs, format!("{}: {e}", p.display()));
    let mut tar = tar::Builder::new(out);
    let top = Dir::open_root(rootfs).map_err(|e| err(rootfs, e))?;
    for rel in &changes.changed {
        let (parent, name) = match (rel.parent(), rel.file_name()) {
            (Some(p), Some(n)) => (p, n),
            _ => return Err(refused(rootfs, format!("{}: not an entry", rel.display()))),
        };
        // Each folder on the way opened again without following links (see the module's comment).
        let mut dir = Dir {
            file: top.file.try_clone().map_err(|e| err(rel, e))?,
        };
        for c in parent.components() {
            dir = dir.sub(c.as_os_str()).map_err(|e| err(rel, e))?;
        }
        let m = dir.lstat(name).map_err(|e| err(rel, e))?;
        let mut h = tar::Header::new_gnu();
        h.set_metadata_in_mode(&m, tar::HeaderMode::Complete);
        let kind = m.file_type();
        let written = if kind.is_dir() {
            h.set_size(0);
            tar.append_data(&mut h, rel, std::io::empty())
        } else if kind.is_symlink() {
            let target = fs::read_link(dir.entry(name)).map_err(|e| err(rel, e))?;
            h.set_size(0);
            tar.append_link(&mut h, rel, target)
        } else {
            let f = dir.open_file(name).map_err(|e| err(rel, e))?;
            // The size as opened: the file may have changed since the walk.
            let m = f.metadata().map_err(|e| err(rel, e))?;
            h.set_metadata_in_mode(&m, tar::HeaderMode::Complete);
            tar.append_data(&mut h, rel, f.take(m.size()))
        };
        written.map_err(|e| err(rel, e))?;
    }
    tar.into_inner()
        .and_then(|mut w| w.flush())
        .map_err(|e| err(rootfs, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn tree(root: &Path) {
        fs::create_dir_all(root.join("bin")).unwrap();
        fs::create_dir_all(root.join("etc/app")).unwrap();
        fs::write(root.join("bin/sh"), b"shell").unwrap();
        fs::write(root.join("bin/nc"), b"netcat").unwrap();
        fs::write(root.join("etc/app/conf"), b"a=1").unwrap();
        symlink("sh", root.join("bin/ash")).unwrap();
    }

    /// Copies `from` into `to` keeping modification times (what `podman import` of a tar does).
    fn copy_tree(from: &Path, to: &Path) {
        let st = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", from.display()))
            .arg(to)
            .status()
            .unwrap();
        assert!(st.success());
    }

    /// A base tree and an untouched copy of it, in a temporary folder.
    fn base_and_copy() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let (base, root) = (d.path().join("base"), d.path().join("root"));
        tree(&base);
        fs::create_dir(&root).unwrap();
        copy_tree(&base, &root);
        (d, base, root)
    }

    #[test]
    fn an_untouched_copy_has_no_changes() {
        let (_d, base, root) = base_and_copy();
        let c = diff(&base, &root).unwrap();
        assert!(c.is_empty(), "{c:?}");
    }

    #[test]
    fn added_changed_retargeted_and_removed_entries_are_found() {
        let (_d, base, root) = base_and_copy();
        // Same size, other bytes, other time: changed. A new folder with a file, a link retargeted, a
        // file and a whole folder removed, a pipe (left out).
        fs::write(root.join("etc/app/conf"), b"a=2").unwrap();
        let t = fs::metadata(base.join("etc/app/conf"))
            .unwrap()
            .modified()
            .unwrap();
        File::options()
            .write(true)
            .open(root.join("etc/app/conf"))
            .unwrap()
            .set_modified(t + std::time::Duration::from_secs(5))
            .unwrap();
        fs::create_dir_all(root.join("data/sub")).unwrap();
        fs::write(root.join("data/sub/f"), b"x").unwrap();
        fs::remove_file(root.join("bin/ash")).unwrap();
        symlink("nc", root.join("bin/ash")).unwrap();
        fs::remove_file(root.join("bin/nc")).unwrap();
        fs::remove_dir_all(root.join("etc/app")).unwrap();
        fs::create_dir(root.join("etc/app")).unwrap();
        let st = std::process::Command::new("mkfifo")
            .arg(root.join("fifo"))
            .status()
            .unwrap();
        assert!(st.success());
        let c = diff(&base, &root).unwrap();
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(
            c.changed,
            [p("bin/ash"), p("data"), p("data/sub"), p("data/sub/f")]
        );
        assert_eq!(c.deleted, [p("bin/nc"), p("etc/app/conf")]);
        assert_eq!(c.deleted_files(), br#"["/bin/nc","/etc/app/conf"]"#);
        assert_eq!(c.skipped.len(), 1);
        assert_eq!(c.skipped[0].0, p("fifo"));

        // The conf file changed in place (same size, same time: not read, unchanged by the rule; with
        // another time its bytes decide).
        fs::create_dir_all(root.join("etc/app")).unwrap();
        copy_tree(&base.join("etc"), &root.join("etc"));
        fs::write(root.join("etc/app/conf"), b"a=3").unwrap();
        let c = diff(&base, &root).unwrap();
        assert!(c.changed.contains(&p("etc/app/conf")), "{c:?}");

        // The tar holds exactly those entries, the link as a link, the files' bytes.
        let mut buf = Vec::new();
        write_diff_tar(&root, &c, &mut buf).unwrap();
        let mut a = tar::Archive::new(&buf[..]);
        let mut seen = Vec::new();
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().into_owned();
            let kind = e.header().entry_type();
            let mut body = String::new();
            if kind.is_file() {
                e.read_to_string(&mut body).unwrap();
            }
            if kind.is_symlink() {
                body = e.link_name().unwrap().unwrap().display().to_string();
            }
            seen.push((path.display().to_string(), body));
        }
        let expect: Vec<(String, String)> = c
            .changed
            .iter()
            .map(|p| {
                let body = match p.to_str().unwrap() {
                    "bin/ash" => "nc",
                    "data/sub/f" => "x",
                    "etc/app/conf" => "a=3",
                    _ => "",
                };
                (p.display().to_string(), body.to_string())
            })
            .collect();
        assert_eq!(seen, expect);
    }

    #[test]
    fn a_folder_that_is_a_link_is_never_followed() {
        let (d, base, root) = base_and_copy();
        // The container replaced a folder with a link out of its root file system.
        let outside = d.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("secret"), b"host").unwrap();
        fs::remove_dir_all(root.join("etc")).unwrap();
        symlink(&outside, root.join("etc")).unwrap();
        let c = diff(&base, &root).unwrap();
        assert_eq!(c.changed, [PathBuf::from("etc")]);
        let mut buf = Vec::new();
        write_diff_tar(&root, &c, &mut buf).unwrap();
        assert!(!buf.windows(4).any(|w| w == b"host"));
        // The root itself a link: refused.
        let link = d.path().join("link");
        symlink(&root, &link).unwrap();
        assert!(diff(&base, &link).is_err());
    }
}
