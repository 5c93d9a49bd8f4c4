//! Small helpers shared by several stages.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

/// Mode of every folder that holds checkpoint data: images hold a process's whole memory.
pub const DIR_MODE: u32 = 0o700;
/// Mode of every file that holds checkpoint data.
pub const FILE_MODE: u32 = 0o600;

/// Creates `path` and its missing parents with mode 0700.
pub fn create_private_dir_all(path: &Path) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(path)
}

/// Creates (truncating) a file with mode 0600. A symbolic link in its place is refused (`O_NOFOLLOW`), never
/// written through: the tool runs as root, and a link could point at any file.
pub fn create_private_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Creates a file with mode 0600 that must not exist yet (`O_EXCL`: nothing planted in its place is opened,
/// link or not).
pub fn create_new_private_file(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(FILE_MODE)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// Checks that `dir` is a folder (not a link) that no one but this user and root can change: owned by root or
/// the effective user, and writable by group or others only when sticky (like /tmp, where no one can
/// rename or remove another user's entries). Folders created inside such a parent with unpredictable names
/// cannot be swapped by a local user.
pub fn check_trusted_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::symlink_metadata(dir)?;
    let refuse = |why: String| Err(io::Error::new(io::ErrorKind::PermissionDenied, why));
    if !meta.file_type().is_dir() {
        return refuse(format!("{} is not a folder", dir.display()));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != me {
        return refuse(format!(
            "{} belongs to uid {}, not to this user (uid {me}) or root",
            dir.display(),
            meta.uid()
        ));
    }
    let sticky = meta.mode() & libc::S_ISVTX != 0;
    if meta.mode() & 0o022 != 0 && !sticky {
        return refuse(format!(
            "{} can be changed by other users (mode {:o})",
            dir.display(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Makes sure `dir` is a private folder of this user: created 0700 when missing; an existing one must be a
/// real folder owned by this user that no one else can enter (else `PermissionDenied`: it is not used).
pub fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    match fs::DirBuilder::new().mode(DIR_MODE).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    check_private(&fs::symlink_metadata(dir)?, dir)
}

/// Checks that `meta` (of `dir`, not following a link) is a private folder of this user: a real folder
/// owned by the effective user that no one else can enter (else `PermissionDenied`).
pub fn check_private(meta: &fs::Metadata, dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if !meta.file_type().is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is not a private folder of uid {me} (a link, another owner, or open to others)",
                dir.display()
            ),
        ));
    }
    Ok(())
}

/// Creates a new private folder (0700) named `PREFIX` followed by random characters inside `parent`, which
/// must pass [`check_trusted_dir`]. The name cannot be guessed, and the folder is new (mkdir fails on an
/// existing name), so nothing planted beforehand is used.
pub fn create_unique_private_dir(parent: &Path, prefix: &str) -> io::Result<std::path::PathBuf> {
    private_temp_dir_in(parent, prefix).map(tempfile::TempDir::keep)
}

/// Like [`create_unique_private_dir`], but the folder (and what is in it) is removed when the returned
/// value is dropped.
pub fn private_temp_dir_in(parent: &Path, prefix: &str) -> io::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    check_trusted_dir(parent)?;
    tempfile::Builder::new()
        .prefix(prefix)
        .rand_bytes(12)
        .permissions(fs::Permissions::from_mode(DIR_MODE))
        .tempdir_in(parent)
}

/// fsyncs a folder so that renames and creations inside it are durable.
pub fn fsync_dir(path: &Path) -> io::Result<()> {
    File::open(path)?.sync_all()
}

/// Writes `data` to `path` atomically and durably: temporary name, fsync, rename, fsync the folder.
pub fn write_atomic(path: &Path, data: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    {
        let mut f = create_private_file(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    fsync_dir(dir)
}

/// Alignment of buffers for direct I/O (`O_DIRECT`): a page satisfies the memory, offset and length
/// alignment of every block device in use (512-byte blocks, 511 DMA alignment on this project's machines).
pub const DIRECT_IO_ALIGN: usize = 4096;

/// A zero-initialised, page-aligned byte buffer that grows on demand (its contents are not kept then). Used
/// where bytes go to a file opened with `O_DIRECT`, which takes aligned memory only.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    cap: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// An empty buffer; nothing is allocated until [`AlignedBuf::slice_mut`] asks for bytes.
    pub const fn new() -> AlignedBuf {
        AlignedBuf {
            ptr: std::ptr::NonNull::dangling(),
            cap: 0,
        }
    }

    fn layout(cap: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(cap, DIRECT_IO_ALIGN).expect("valid layout")
    }

    /// Bytes allocated.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The first `len` bytes, page-aligned. Grows the buffer first if it is smaller, losing its contents.
    pub fn slice_mut(&mut self, len: usize) -> &mut [u8] {
        if self.cap < len {
            self.free();
            let cap = len.next_multiple_of(DIRECT_IO_ALIGN);
            // SAFETY: non-zero size (len > cap >= 0).
            let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(cap)) };
            self.ptr = std::ptr::NonNull::new(ptr)
                .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout(cap)));
            self.cap = cap;
        }
        if len == 0 {
            return &mut [];
        }
        // SAFETY: `cap >= len` initialised bytes, borrowed uniquely through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len) }
    }

    /// The first `len` bytes (`len` at most the capacity).
    pub fn slice(&self, len: usize) -> &[u8] {
        assert!(
            len <= self.cap,
            "{len} bytes asked of a {}-byte buffer",
            self.cap
        );
        if len == 0 {
            return &[];
        }
        // SAFETY: as in `slice_mut`, shared.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), len) }
    }

    fn free(&mut self) {
        if self.cap > 0 {
            // SAFETY: allocated in `slice_mut` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) };
            self.cap = 0;
            self.ptr = std::ptr::NonNull::dangling();
        }
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        AlignedBuf::new()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

/// A system call's result (`call` returns what the libc wrapper does: a count, or -1 with `errno` set),
/// the call made again while a signal interrupts it.
pub fn retry_interrupted(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// True if `bytes` starts on a [`DIRECT_IO_ALIGN`] boundary.
pub fn is_direct_io_aligned(bytes: &[u8]) -> bool {
    (bytes.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn atomic_write_is_private_and_complete() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.json");
        write_atomic(&p, b"hello").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"hello");
        assert_eq!(
            fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let leftovers: Vec<_> = fs::read_dir(d.path()).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left behind");
    }

    #[test]
    fn aligned_buffers_are_aligned_zeroed_and_grow() {
        let mut b = AlignedBuf::new();
        assert_eq!(b.capacity(), 0);
        assert!(b.slice_mut(0).is_empty());
        let s = b.slice_mut(5000);
        assert_eq!(s.len(), 5000);
        assert!(is_direct_io_aligned(s));
        assert!(s.iter().all(|&x| x == 0));
        s[4999] = 7;
        assert_eq!(b.capacity(), 8192);
        // Within the capacity: same allocation, contents kept.
        assert_eq!(b.slice_mut(6000)[4999], 7);
        assert_eq!(b.slice(5000)[4999], 7);
        let grown = b.slice_mut(3 * 4096 + 1);
        assert!(is_direct_io_aligned(grown));
        assert_eq!(b.capacity(), 4 * 4096);
        assert!(!is_direct_io_aligned(&b.slice(100)[1..]));
    }
}
