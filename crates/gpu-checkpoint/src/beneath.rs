//! File operations confined to one folder: a store, a read cache, a restore's work folders.
//!
//! The tool runs as root; a folder it works in may have been prepared by someone else (a shared file
//! system, a team's folder), and a symbolic link planted inside would make root read, write, chmod or delete
//! whatever it points at. So the folder is opened once, and every path below it is resolved from that
//! descriptor without following any link and without leaving it: `openat2(2)` with `RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS` (Linux 5.6+), or, where the kernel lacks it, one component at a time with
//! `O_NOFOLLOW`. Creating, renaming, removing and listing go through the descriptor of the parent folder
//! resolved that way (`mkdirat`, `renameat`, `unlinkat`): a link is never followed, only ever removed itself.
//! What the path given to [`Beneath::open`] names is taken as it is (the caller named it, links and all);
//! whether its owner is trusted is the caller's check (see `store::backend::trust`).

use std::ffi::{OsStr, OsString};
use std::fs::{File, Metadata};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag};
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::UnlinkatFlags;

/// Whether `openat2` is there to use; cleared the first time the kernel says it has none.
static OPENAT2: AtomicBool = AtomicBool::new(true);

/// How deep [`Beneath::remove_all`] goes: the tool's own trees are a few levels deep, and one descriptor is
/// held per level.
const MAX_DEPTH: usize = 64;

/// A folder held open; every operation below works on paths relative to it (see the module's text).
#[derive(Debug)]
pub struct Beneath {
    fd: OwnedFd,
    path: PathBuf,
}

/// What an entry of a folder is, as listed (never what a link points at).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
    Link,
    /// A FIFO, socket or device.
    Other,
}

/// One entry of a folder ([`Beneath::entries`]).
#[derive(Clone, Debug)]
pub struct Entry {
    pub name: OsString,
    pub kind: Kind,
}

/// An entry of a folder with what `lstat` says of it ([`Beneath::entries_stat`]).
#[derive(Clone, Debug)]
pub struct EntryStat {
    pub name: OsString,
    pub kind: Kind,
    pub len: u64,
    /// Permission, set-id and sticky bits.
    pub mode: u32,
    pub uid: u32,
    pub modified: Option<std::time::SystemTime>,
}

/// The descriptor of the folder an operation's last component is in: the held folder itself, or one
/// resolved below it.
enum Parent<'a> {
    Held(BorrowedFd<'a>),
    Below(OwnedFd),
}

impl Parent<'_> {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Parent::Held(fd) => *fd,
            Parent::Below(fd) => fd.as_fd(),
        }
    }
}

fn errno(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// The components of `rel`, each a plain name: an absolute path or `..` would leave the folder.
fn components(rel: &Path) -> io::Result<Vec<&OsStr>> {
    rel.components()
        .filter(|c| *c != Component::CurDir)
        .map(|c| match c {
            Component::Normal(n) => Ok(n),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} leaves the folder it must stay in", rel.display()),
            )),
        })
        .collect()
}

/// `openat2` confined below `dir`, following no link. `Err(ENOSYS)` where the kernel has no `openat2`.
fn openat2_beneath(
    dir: BorrowedFd<'_>,
    rel: &Path,
    flags: OFlag,
    mode: Mode,
) -> nix::Result<OwnedFd> {
    use nix::fcntl::{OpenHow, ResolveFlag};
    let how = OpenHow::new().flags(flags).mode(mode).resolve(
        ResolveFlag::RESOLVE_BENEATH
            | ResolveFlag::RESOLVE_NO_SYMLINKS
            | ResolveFlag::RESOLVE_NO_MAGICLINKS,
    );
    let rel = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    nix::fcntl::openat2(dir, rel, how)
}

/// The same without `openat2`: each folder on the way opened with `O_NOFOLLOW` from the one before.
fn walk_beneath(dir: BorrowedFd<'_>, rel: &Path, flags: OFlag, mode: Mode) -> io::Result<OwnedFd> {
    let parts = components(rel)?;
    let Some((last, folders)) = parts.split_last() else {
        return nix::fcntl::openat(dir, ".", flags, mode).map_err(errno);
    };
    let mut at: Option<OwnedFd> = None;
    for name in folders {
        let from = at.as_ref().map_or(dir, |f| f.as_fd());
        let next = nix::fcntl::openat(
            from,
            *name,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| match e {
            // O_PATH | O_NOFOLLOW opens a link itself, which then is no folder: say it is a link.
            Errno::ENOTDIR => errno(Errno::ELOOP),
            e => errno(e),
        })?;
        at = Some(next);
    }
    let from = at.as_ref().map_or(dir, |f| f.as_fd());
    nix::fcntl::openat(from, *last, flags, mode).map_err(errno)
}

/// Opens `rel` below `dir` (see the module's text); `flags` get `O_NOFOLLOW` and `O_CLOEXEC`.
fn open_below(
    dir: BorrowedFd<'_>,
    rel: &Path,
    flags: OFlag,
    mode: u32,
    use_openat2: bool,
) -> io::Result<OwnedFd> {
    components(rel)?;
    let flags = flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    // openat2 refuses a mode unless a file may be created.
    let mode = if flags.intersects(OFlag::O_CREAT | OFlag::O_TMPFILE) {
        Mode::from_bits_truncate(mode)
    } else {
        Mode::empty()
    };
    if use_openat2 && OPENAT2.load(Ordering::Relaxed) {
        match openat2_beneath(dir, rel, flags, mode) {
            Ok(fd) => return Ok(fd),
            Err(Errno::ENOSYS) => OPENAT2.store(false, Ordering::Relaxed),
            // A seccomp filter that does not know the call may answer EPERM: the walk says what is true.
            Err(Errno::EPERM) => {}
            Err(e) => return Err(errno(e)),
        }
    }
    walk_beneath(dir, rel, flags, mode)
}

impl Beneath {
    /// Opens folder `path` to work below it. The links in `path` itself are followed: the caller named it.
    pub fn open(path: &Path) -> io::Result<Beneath> {
        let fd = nix::fcntl::open(
            path,
            OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(errno)?;
        Ok(Beneath {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The folder's path, as it was opened (for messages, and for programs that take paths).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `rel`'s path, for messages.
    pub fn join(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.path.join(rel)
    }

    /// The held folder's own metadata (of what the descriptor holds, whatever its path names now).
    pub fn metadata(&self) -> io::Result<Metadata> {
        File::from(self.fd.try_clone()?).metadata()
    }

    /// The folder `rel` below, held open in its turn (never reached through a link).
    pub fn subdir(&self, rel: impl AsRef<Path>) -> io::Result<Beneath> {
        let rel = rel.as_ref();
        let fd = self.open_fd(rel, OFlag::O_DIRECTORY | OFlag::O_RDONLY, 0)?;
        Ok(Beneath {
            fd,
            path: self.path.join(rel),
        })
    }

    /// Opens `rel` with `flags` (`O_NOFOLLOW` and `O_CLOEXEC` added) and, for a file it creates, `mode`.
    pub fn open_fd(&self, rel: impl AsRef<Path>, flags: OFlag, mode: u32) -> io::Result<OwnedFd> {
        let rel = rel.as_ref();
        match open_below(self.fd.as_fd(), rel, flags, mode, true) {
            // A folder asked for where a link is: the kernel says "not a folder"; say it is a link, so that
            // no caller takes it for a missing or a plain entry.
            Err(e)
                if e.raw_os_error() == Some(libc::ENOTDIR)
                    && flags.contains(OFlag::O_DIRECTORY) =>
            {
                let link = open_below(self.fd.as_fd(), rel, OFlag::O_PATH, 0, true)
                    .and_then(|fd| File::from(fd).metadata())
                    .is_ok_and(|m| m.file_type().is_symlink());
                Err(if link { errno(Errno::ELOOP) } else { e })
            }
            r => r,
        }
    }

    /// [`Beneath::open_fd`] as a file.
    pub fn open_file(&self, rel: impl AsRef<Path>, flags: OFlag, mode: u32) -> io::Result<File> {
        self.open_fd(rel, flags, mode).map(File::from)
    }

    /// Opens `rel` for reading when it is a regular file: `None` when it is missing, a link, or anything
    /// else (a FIFO would block the open or the read, a device would never end).
    pub fn open_regular(&self, rel: impl AsRef<Path>) -> io::Result<Option<File>> {
        // O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on regular files).
        let file = match self.open_file(rel, OFlag::O_RDONLY | OFlag::O_NONBLOCK, 0) {
            Ok(f) => f,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ELOOP)) => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        if !file.metadata()?.is_file() {
            return Ok(None);
        }
        // Reads of a regular file never block anyway; clear the flag so that none is surprised by it.
        nix::fcntl::fcntl(&file, nix::fcntl::FcntlArg::F_SETFL(OFlag::O_RDONLY)).map_err(errno)?;
        Ok(Some(file))
    }

    /// Creates file `rel`, which must not exist (`O_EXCL`: nothing planted in its place is opened), for
    /// writing with `mode` and `extra` flags (`O_DIRECT`...).
    pub fn create_new(&self, rel: impl AsRef<Path>, mode: u32, extra: OFlag) -> io::Result<File> {
        self.open_file(
            rel,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | extra,
            mode,
        )
    }

    /// What `rel` is, a link itself rather than what it points at (`lstat`).
    pub fn symlink_metadata(&self, rel: impl AsRef<Path>) -> io::Result<Metadata> {
        let fd = self.open_fd(rel, OFlag::O_PATH, 0)?;
        File::from(fd).metadata()
    }

    /// The folder that holds `rel`'s last component, and that component.
    fn parent<'a>(&self, rel: &'a Path) -> io::Result<(Parent<'_>, &'a OsStr)> {
        let parts = components(rel)?;
        let Some((name, folders)) = parts.split_last() else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the held folder itself has no parent here",
            ));
        };
        if folders.is_empty() {
            return Ok((Parent::Held(self.fd.as_fd()), name));
        }
        let up: PathBuf = folders.iter().collect();
        let fd = self.open_fd(&up, OFlag::O_PATH | OFlag::O_DIRECTORY, 0)?;
        Ok((Parent::Below(fd), name))
    }

    /// Creates folder `rel` with `mode` (its parent must exist; an existing one is `AlreadyExists`).
    pub fn create_dir(&self, rel: impl AsRef<Path>, mode: u32) -> io::Result<()> {
        let (parent, name) = self.parent(rel.as_ref())?;
        nix::sys::stat::mkdirat(parent.fd(), name, Mode::from_bits_truncate(mode)).map_err(errno)
    }

    /// Creates folder `rel` and the missing folders above it, each with `mode`; one that exists must be a
    /// folder (a link in the way is an error, not followed).
    pub fn create_dir_all(&self, rel: impl AsRef<Path>, mode: u32) -> io::Result<()> {
        let mut at = PathBuf::new();
        for name in components(rel.as_ref())? {
            at.push(name);
            match self.create_dir(&at, mode) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    if !self.symlink_metadata(&at)?.is_dir() {
                        return Err(io::Error::new(
                            io::ErrorKind::AlreadyExists,
                            format!("{} is not a folder", self.join(&at).display()),
                        ));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Removes `rel` when it is not a folder (a link is removed itself).
    pub fn remove_file(&self, rel: impl AsRef<Path>) -> io::Result<()> {
        let (parent, name) = self.parent(rel.as_ref())?;
        nix::unistd::unlinkat(parent.fd(), name, UnlinkatFlags::NoRemoveDir).map_err(errno)
    }

    /// Removes `rel` and, for a folder, everything in it, following no link (a link is removed itself).
    /// Returns the bytes the regular files removed held. A missing `rel` is `NotFound`.
    pub fn remove_all(&self, rel: impl AsRef<Path>) -> io::Result<u64> {
        let (parent, name) = self.parent(rel.as_ref())?;
        remove_tree(parent.fd(), name, 0)
    }

    /// Renames `from` to `to` (both below this folder), replacing a file at `to`.
    pub fn rename(&self, from: impl AsRef<Path>, to: impl AsRef<Path>) -> io::Result<()> {
        let (a, a_name) = self.parent(from.as_ref())?;
        let (b, b_name) = self.parent(to.as_ref())?;
        nix::fcntl::renameat(a.fd(), a_name, b.fd(), b_name).map_err(errno)
    }

    /// The entries of folder `rel` (`""`: this folder), without `.` and `..`.
    pub fn entries(&self, rel: impl AsRef<Path>) -> io::Result<Vec<Entry>> {
        let fd = self.open_fd(rel, OFlag::O_DIRECTORY | OFlag::O_RDONLY, 0)?;
        list(fd)
    }

    /// [`Beneath::entries`] with each entry's `lstat` (size, mode, owner, age: one call per entry, from the
    /// folder's descriptor).
    pub fn entries_stat(&self, rel: impl AsRef<Path>) -> io::Result<Vec<EntryStat>> {
        let fd = self.open_fd(rel, OFlag::O_DIRECTORY | OFlag::O_RDONLY, 0)?;
        let at = fd.try_clone()?;
        let mut out = Vec::new();
        for e in list(fd)? {
            let st = match nix::sys::stat::fstatat(
                &at,
                e.name.as_os_str(),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            ) {
                Ok(st) => st,
                // Removed since it was listed.
                Err(Errno::ENOENT) => continue,
                Err(err) => return Err(errno(err)),
            };
            let modified = u64::try_from(st.st_mtime).ok().map(|s| {
                std::time::UNIX_EPOCH
                    + std::time::Duration::new(s, st.st_mtime_nsec.clamp(0, 999_999_999) as u32)
            });
            out.push(EntryStat {
                name: e.name,
                kind: kind_of(st.st_mode),
                len: st.st_size.max(0) as u64,
                mode: st.st_mode & 0o7777,
                uid: st.st_uid,
                modified,
            });
        }
        Ok(out)
    }

    /// Sets the permissions of `rel`, a regular file or a folder (never a link, nor what it points at).
    /// Returns the mode it had (the permission bits and the set-id and sticky bits).
    pub fn set_mode(&self, rel: impl AsRef<Path>, mode: u32) -> io::Result<u32> {
        use std::os::unix::fs::MetadataExt;
        let rel = rel.as_ref();
        let held = File::from(self.open_fd(rel, OFlag::O_PATH, 0)?);
        let meta = held.metadata()?;
        if !meta.is_file() && !meta.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} is not a regular file or a folder",
                    self.join(rel).display()
                ),
            ));
        }
        let was = meta.mode() & 0o7777;
        if was != mode {
            fchmod_held(&held, mode)?;
        }
        Ok(was)
    }

    /// Makes `rel` (a file, or a folder and so its entries) durable: `fsync`.
    pub fn sync(&self, rel: impl AsRef<Path>) -> io::Result<()> {
        self.open_file(rel, OFlag::O_RDONLY | OFlag::O_NONBLOCK, 0)?
            .sync_all()
    }

    /// The held folder's descriptor (for `syncfs`, `flock`, ...).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// chmod of the very file an `O_PATH` descriptor holds: through its `/proc/self/fd` entry (an `O_PATH`
/// descriptor itself cannot `fchmod`); where /proc is not mounted, through a descriptor reopened from it.
fn fchmod_held(held: &File, mode: u32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let proc_path = format!("/proc/self/fd/{}", held.as_raw_fd());
    let mode = Mode::from_bits_truncate(mode);
    match nix::sys::stat::fchmodat(
        nix::fcntl::AT_FDCWD,
        proc_path.as_str(),
        mode,
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    ) {
        Ok(()) => Ok(()),
        Err(Errno::ENOENT) => {
            let file = nix::fcntl::open(
                proc_path.as_str(),
                OFlag::O_RDONLY | OFlag::O_CLOEXEC,
                Mode::empty(),
            );
            match file {
                Ok(fd) => nix::sys::stat::fchmod(fd, mode).map_err(errno),
                Err(_) => Err(errno(Errno::ENOENT)),
            }
        }
        Err(e) => Err(errno(e)),
    }
}

/// The entries of the folder `fd` holds.
fn list(fd: OwnedFd) -> io::Result<Vec<Entry>> {
    use nix::dir::Type;
    let stat_fd = fd.try_clone()?;
    let mut dir = nix::dir::Dir::from_fd(fd).map_err(errno)?;
    let mut out = Vec::new();
    for entry in dir.iter() {
        let entry = entry.map_err(errno)?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let name = OsStr::from_bytes(name).to_os_string();
        let kind = match entry.file_type() {
            Some(Type::File) => Kind::File,
            Some(Type::Directory) => Kind::Dir,
            Some(Type::Symlink) => Kind::Link,
            Some(_) => Kind::Other,
            // Some file systems do not say in the listing: ask (never following a link).
            None => match nix::sys::stat::fstatat(
                &stat_fd,
                name.as_os_str(),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            ) {
                Ok(st) => kind_of(st.st_mode),
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(errno(e)),
            },
        };
        out.push(Entry { name, kind });
    }
    Ok(out)
}

fn kind_of(mode: libc::mode_t) -> Kind {
    match SFlag::from_bits_truncate(mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => Kind::File,
        SFlag::S_IFDIR => Kind::Dir,
        SFlag::S_IFLNK => Kind::Link,
        _ => Kind::Other,
    }
}

/// Removes `name` in folder `parent`, a whole tree for a folder, following no link.
fn remove_tree(parent: BorrowedFd<'_>, name: &OsStr, depth: usize) -> io::Result<u64> {
    let st = nix::sys::stat::fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(errno)?;
    if kind_of(st.st_mode) != Kind::Dir {
        nix::unistd::unlinkat(parent, name, UnlinkatFlags::NoRemoveDir).map_err(errno)?;
        return Ok(if kind_of(st.st_mode) == Kind::File {
            st.st_size as u64
        } else {
            0
        });
    }
    if depth >= MAX_DEPTH {
        return Err(io::Error::other(format!(
            "more than {MAX_DEPTH} folders deep: not removed"
        )));
    }
    // O_NOFOLLOW: should the folder have been swapped for a link since, this fails (ELOOP).
    let fd = nix::fcntl::openat(
        parent,
        name,
        OFlag::O_DIRECTORY | OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(errno)?;
    let held = fd.try_clone()?;
    let mut bytes = 0;
    for entry in list(fd)? {
        match remove_tree(held.as_fd(), &entry.name, depth + 1) {
            Ok(n) => bytes += n,
            // Removed meanwhile (by another cleaner): gone either way.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    nix::unistd::unlinkat(parent, name, UnlinkatFlags::RemoveDir).map_err(errno)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    /// A tree with links planted everywhere a caller might step: in place of a folder on the way, of the
    /// last component, and pointing outside with an absolute and a relative target.
    fn planted() -> (tempfile::TempDir, Beneath, PathBuf) {
        let t = tempfile::tempdir().unwrap();
        let outside = t.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("victim"), "keep me").unwrap();
        std::fs::set_permissions(
            outside.join("victim"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let root = t.path().join("root");
        std::fs::create_dir_all(root.join("real/sub")).unwrap();
        std::fs::write(root.join("real/sub/file"), "inside").unwrap();
        symlink(&outside, root.join("abs-dir")).unwrap();
        symlink("../outside", root.join("rel-dir")).unwrap();
        symlink(outside.join("victim"), root.join("abs-file")).unwrap();
        symlink("../../outside/victim", root.join("real/rel-file")).unwrap();
        let b = Beneath::open(&root).unwrap();
        (t, b, outside)
    }

    fn both_ways(check: impl Fn(&dyn Fn(&Beneath, &str, OFlag) -> io::Result<OwnedFd>)) {
        check(&|b, rel, flags| open_below(b.fd(), Path::new(rel), flags, 0o600, true));
        check(&|b, rel, flags| open_below(b.fd(), Path::new(rel), flags, 0o600, false));
    }

    #[test]
    fn no_link_is_followed_and_nothing_outside_is_reached() {
        let (_t, b, outside) = planted();
        both_ways(|open| {
            assert!(open(&b, "real/sub/file", OFlag::O_RDONLY).is_ok());
            for rel in [
                "abs-dir/victim",
                "rel-dir/victim",
                "abs-file",
                "real/rel-file",
                "../outside/victim",
                "/etc/passwd",
                "real/../../outside/victim",
            ] {
                for flags in [
                    OFlag::O_RDONLY,
                    OFlag::O_WRONLY | OFlag::O_CREAT,
                    OFlag::O_WRONLY | OFlag::O_TRUNC,
                ] {
                    assert!(open(&b, rel, flags).is_err(), "{rel} {flags:?}");
                }
            }
            // Creating through a linked folder makes nothing there.
            assert!(open(&b, "abs-dir/new", OFlag::O_WRONLY | OFlag::O_CREAT).is_err());
        });
        assert_eq!(
            std::fs::read_to_string(outside.join("victim")).unwrap(),
            "keep me"
        );
        assert!(!outside.join("new").exists());
    }

    #[test]
    fn listing_removing_and_chmod_stay_inside() {
        let (_t, b, outside) = planted();
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
        // Through a linked folder: no listing, no chmod, no removal of what is behind it.
        assert!(b.entries("abs-dir").is_err());
        assert!(b.entries("rel-dir").is_err());
        assert!(b.set_mode("abs-dir/victim", 0o600).is_err());
        assert!(b.set_mode("abs-file", 0o600).is_err());
        assert!(b.remove_file("abs-dir/victim").is_err());
        assert!(b.remove_all("rel-dir/victim").is_err());
        assert_eq!(mode(&outside.join("victim")), 0o644);
        // The links themselves are listed as links and removed as links.
        let kinds: Vec<(String, Kind)> = {
            let mut v: Vec<_> = b
                .entries("")
                .unwrap()
                .into_iter()
                .map(|e| (e.name.to_string_lossy().into_owned(), e.kind))
                .collect();
            v.sort_by(|a, b| a.0.cmp(&b.0));
            v
        };
        assert_eq!(
            kinds,
            [
                ("abs-dir".to_string(), Kind::Link),
                ("abs-file".to_string(), Kind::Link),
                ("real".to_string(), Kind::Dir),
                ("rel-dir".to_string(), Kind::Link),
            ]
        );
        assert!(b
            .symlink_metadata("abs-dir")
            .unwrap()
            .file_type()
            .is_symlink());
        b.remove_all("abs-dir").unwrap();
        b.remove_file("abs-file").unwrap();
        // A tree holding a link to the outside: the link goes, what it pointed at stays.
        assert_eq!(b.remove_all("real").unwrap(), "inside".len() as u64);
        assert!(outside.join("victim").is_file());
        assert_eq!(
            std::fs::read_to_string(outside.join("victim")).unwrap(),
            "keep me"
        );
        assert_eq!(mode(&outside.join("victim")), 0o644);
    }

    #[test]
    fn files_and_folders_are_made_renamed_and_chmodded_below() {
        let t = tempfile::tempdir().unwrap();
        let b = Beneath::open(t.path()).unwrap();
        b.create_dir_all("a/b/c", 0o700).unwrap();
        b.create_dir_all("a/b/c", 0o700).unwrap();
        let mut f = b.create_new("a/b/c/.tmp", 0o600, OFlag::empty()).unwrap();
        std::io::Write::write_all(&mut f, b"x").unwrap();
        assert_eq!(
            b.create_new("a/b/c/.tmp", 0o600, OFlag::empty())
                .unwrap_err()
                .kind(),
            io::ErrorKind::AlreadyExists
        );
        b.rename("a/b/c/.tmp", "a/b/c/x").unwrap();
        let mut s = String::new();
        std::io::Read::read_to_string(&mut b.open_regular("a/b/c/x").unwrap().unwrap(), &mut s)
            .unwrap();
        assert_eq!(s, "x");
        assert!(b.open_regular("a/b/c/missing").unwrap().is_none());
        assert!(
            b.open_regular("a/b").unwrap().is_none(),
            "a folder is no regular file"
        );
        assert_eq!(b.set_mode("a/b/c/x", 0o644).unwrap(), 0o600);
        assert_eq!(b.set_mode("a/b/c/x", 0o600).unwrap(), 0o644);
        assert_eq!(b.set_mode("a", 0o755).unwrap(), 0o700);
        b.sync("a/b").unwrap();
        let sub = b.subdir("a/b").unwrap();
        assert_eq!(sub.path(), t.path().join("a/b"));
        assert_eq!(sub.entries("c").unwrap()[0].name, "x");
        // A file in the way of a folder.
        assert!(b.create_dir_all("a/b/c/x/y", 0o700).is_err());
        assert_eq!(b.remove_all("a").unwrap(), 1);
        assert!(b.entries("").unwrap().is_empty());
    }
}
