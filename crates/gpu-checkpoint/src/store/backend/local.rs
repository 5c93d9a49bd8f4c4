//! The local filesystem backend: a folder on a local disk or a shared filesystem (NFS, Lustre, Weka).
//!
//! ```text
//! STORE/store.json          format marker and version
//! STORE/lock                flock'ed: shared by writers and readers, exclusive by gc
//! STORE/chunks/ab/abcd...   one file per chunk, named by its BLAKE3 hex, fanned out by the first byte
//! STORE/manifests/ID.json   one per committed checkpoint
//! STORE/staging/ID/         an ingest's private folder (CRIU writes its images here)
//! ```
//! Folders are 0700 and files 0600: chunks hold process memory.
//!
//! A store is used only when its owner is trusted ([`super::trust`]), and every file operation in it goes
//! through the folder held open at that check, following no link ([`crate::beneath`]): nothing planted in a
//! store leads the tool out of it.
//!
//! Chunk files are written with direct I/O ([`write_direct`]), and read with it when they are not in the
//! page cache ([`Backend::read_chunk_uncached`]); [`DIRECT_IO_ENV`]`=0` turns both off.

use std::fs::File;
use std::io::{self, Read, Write};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use nix::fcntl::OFlag;

use super::direct::{
    blocks_layout, cached_pages, read_up_to, set_direct, write_direct, write_direct_parts,
};
use super::trust::{user_name, Access, Owners};
use super::{Backend, LocalFs, ObjectMeta, ReadBackend};
use crate::beneath::{Beneath, Kind};
use crate::store::chunk::ChunkId;
use crate::store::error::{Error, Result};
use crate::util::{is_direct_io_aligned, AlignedBuf, DIRECT_IO_ALIGN, DIR_MODE, FILE_MODE};

use super::objects::STORE_FILE;

/// Above this many new chunks one `syncfs` is cheaper than one fsync per chunk file (each fsync commits the
/// filesystem journal; syncfs commits it once for everything).
const SYNCFS_THRESHOLD: usize = 32;

pub struct LocalBackend {
    root: PathBuf,
    /// `root` for messages.
    location: String,
    staging: PathBuf,
    /// Who besides this user and root may own the store (read-only).
    owners: Owners,
    /// The store folder, held open by `init` once its owner was found trusted, and what this process may
    /// do with it.
    held: OnceLock<(Beneath, Access)>,
    tmp_counter: AtomicU64,
    /// Whole chunk objects are written with `O_DIRECT` (see [`write_direct`]) until the filesystem refuses
    /// it.
    direct: AtomicBool,
    /// Chunks missing from the page cache are read with `O_DIRECT` ([`Backend::read_chunk_uncached`]) until
    /// the kernel or the filesystem cannot.
    direct_reads: AtomicBool,
    /// The store's marker names an older version and could not be rewritten: readable, not writable.
    old_marker: AtomicBool,
}

/// A chunk object as the ingest hands it over.
#[derive(Clone, Copy)]
enum Object<'a> {
    /// Parts to write one after the other (header and payload in separate buffers; with direct I/O where
    /// they are laid out for it, see `direct::blocks_layout`).
    Parts(&'a [&'a [u8]]),
    /// Header then payload in one buffer (page-aligned when built for direct I/O).
    Whole(&'a [u8]),
}

/// Set to `0` to keep chunk files in the page cache: written and read through it, as before direct I/O
/// (for a filesystem where direct I/O is slow, or to keep a checkpoint cached for a restore on the same
/// node right after it).
pub const DIRECT_IO_ENV: &str = "GPU_CHECKPOINT_DIRECT_IO";

impl LocalBackend {
    /// Whether `root` holds a store (its `store.json` marker): commands that only read a store must not
    /// create one where there is none. A store this user may not look into is [`Error::Unreadable`]
    /// (permission denied), not "no store". A marker that is not a plain file still counts: opening the
    /// store then says what is wrong with it.
    pub fn holds_store(root: &Path) -> Result<bool> {
        let unreadable = |e: io::Error| Error::Unreadable {
            path: root.into(),
            source: e,
        };
        let dir = match Beneath::open(root) {
            Ok(d) => d,
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {
                return Ok(false)
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => return Err(unreadable(e)),
            Err(e) => return Err(Error::io("cannot open", root)(e)),
        };
        match dir.symlink_metadata(STORE_FILE) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => Err(unreadable(e)),
            Err(e) => Err(Error::io("cannot look for", dir.join(STORE_FILE))(e)),
        }
    }

    /// A backend on `root`, with direct I/O unless [`DIRECT_IO_ENV`] is `0`.
    pub fn new(root: &Path) -> LocalBackend {
        let direct = std::env::var_os(DIRECT_IO_ENV).is_none_or(|v| v != "0");
        LocalBackend::with_direct_io(root, direct)
    }

    /// A backend on `root` that writes new chunk files and reads cold ones with direct I/O (`true`, the
    /// default; it falls back by itself where the filesystem refuses) or through the page cache.
    pub fn with_direct_io(root: &Path, direct: bool) -> LocalBackend {
        // An absolute path keeps messages and manifest paths meaningful whatever the caller's cwd becomes.
        let root = std::path::absolute(root).unwrap_or_else(|_| root.to_path_buf());
        LocalBackend {
            location: root.display().to_string(),
            staging: root.join("staging"),
            root,
            owners: Owners { trusted: None },
            held: OnceLock::new(),
            tmp_counter: AtomicU64::new(0),
            direct: AtomicBool::new(direct),
            direct_reads: AtomicBool::new(direct),
            old_marker: AtomicBool::new(false),
        }
    }

    /// Also accepts a store owned by user `uid` (besides this user and root), for reading only: nothing is
    /// then written, changed or removed in it (`--trust-store-owner`).
    pub fn trusting(mut self, uid: Option<u32>) -> LocalBackend {
        self.owners.trusted = uid;
        self
    }

    fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        self.object_path(&super::chunk_key(id))
    }

    /// The store folder held open, and what this process may do with it; an error before `init`.
    fn held(&self) -> Result<(&Beneath, Access)> {
        self.held.get().map(|(d, a)| (d, *a)).ok_or_else(|| {
            Error::Internal(format!("store {} used before it was opened", self.location))
        })
    }

    /// The store folder, to read from.
    fn dir(&self) -> Result<&Beneath> {
        self.held().map(|(d, _)| d)
    }

    /// The store folder, to write to: another user's store trusted read-only refuses.
    fn writable(&self) -> Result<&Beneath> {
        match self.held()? {
            (dir, Access::ReadWrite) => Ok(dir),
            (_, Access::ReadOnly { owner }) => Err(Error::ReadOnly {
                path: self.root.as_path().into(),
                owner: user_name(owner),
            }),
        }
    }

    /// A temporary name in `folder` (`""`: the store folder) for `name`, unique among this store's writers.
    fn temp_name(&self, folder: &str, name: &str) -> String {
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        let tmp = format!(
            ".{name}.tmp.{}.{n}.{:08x}",
            std::process::id(),
            crate::store::random_u32()
        );
        if folder.is_empty() {
            tmp
        } else {
            format!("{folder}/{tmp}")
        }
    }

    /// Writes object `key` atomically and durably: temporary name, fsync, rename, fsync of the folder.
    fn put_durable(&self, dir: &Beneath, key: &str, bytes: &[u8]) -> io::Result<()> {
        let (folder, name) = key.rsplit_once('/').unwrap_or(("", key));
        let tmp = self.temp_name(folder, name);
        let written = (|| {
            let mut f = dir.create_new(&tmp, FILE_MODE, OFlag::empty())?;
            f.write_all(bytes)?;
            f.sync_all()?;
            dir.rename(&tmp, key)?;
            dir.sync(folder)
        })();
        if written.is_err() {
            let _ = dir.remove_file(&tmp);
        }
        written
    }

    /// Writes an object under a temporary name and renames it into place: readers see no object or a
    /// complete one. Whole page-aligned objects are written with direct I/O while the filesystem takes it.
    fn put_file(&self, key: &str, object: Object<'_>) -> Result<()> {
        let path = self.object_path(key);
        if let Some(e) = crate::fault::io_error("store.write") {
            return Err(Error::io("cannot write chunk", path)(e));
        }
        let dir = self.writable()?;
        let (folder, name) = key.rsplit_once('/').expect("object keys have a folder");
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        let tmp = format!(
            "{folder}/.tmp.{}.{}.{}",
            &name[..name.len().min(16)],
            std::process::id(),
            n
        );
        let direct = match object {
            Object::Whole(o) => self.direct.load(Ordering::Relaxed) && is_direct_io_aligned(o),
            Object::Parts(parts) => self.direct.load(Ordering::Relaxed) && blocks_layout(parts),
        };
        let flags = if direct {
            OFlag::O_DIRECT
        } else {
            OFlag::empty()
        };
        let open = || dir.create_new(&tmp, FILE_MODE, flags);
        let file = match open() {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                dir.create_dir_all(folder, DIR_MODE)
                    .map_err(Error::io("cannot create folder", dir.join(folder)))?;
                open().map_err(Error::io("cannot create chunk", dir.join(&tmp)))?
            }
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                self.no_direct_io(&e);
                return self.put_file(key, object);
            }
            Err(e) => return Err(Error::io("cannot create chunk", dir.join(&tmp))(e)),
        };
        let written = match object {
            Object::Whole(o) if direct => write_direct(&file, o),
            Object::Whole(o) => (&file).write_all(o),
            Object::Parts(parts) if direct => write_direct_parts(&file, parts),
            Object::Parts(parts) => parts.iter().try_for_each(|p| (&file).write_all(p)),
        };
        if let Err(e) = written {
            let _ = dir.remove_file(&tmp);
            if direct && e.raw_os_error() == Some(libc::EINVAL) {
                self.no_direct_io(&e);
                return self.put_file(key, object);
            }
            return Err(Error::io("cannot write chunk", dir.join(&tmp))(e));
        }
        // Start writeback of what went through the page cache (everything, or the last partial block of a
        // direct write) so that the final sync finds little left to write; don't wait for it.
        // SAFETY: valid fd; the flag only schedules writeback.
        unsafe {
            libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
        }
        drop(file);
        // rename() is atomic. If a concurrent writer stored the same name first, its copy is byte-identical,
        // so replacing it is harmless.
        dir.rename(&tmp, key).map_err(|e| {
            let _ = dir.remove_file(&tmp);
            Error::io("cannot rename chunk into place", &path)(e)
        })
    }

    /// Reads `len` bytes of the chunk object `file` into `buf` with direct I/O when they are not all in the
    /// page cache. `Ok(None)`: it did not (cached, or no direct reads here); read it the usual way.
    fn read_cold(
        &self,
        file: &File,
        path: &Path,
        len: usize,
        buf: &mut AlignedBuf,
    ) -> Result<Option<usize>> {
        if !self.direct_reads.load(Ordering::Relaxed) {
            return Ok(None);
        }
        match cached_pages(file) {
            Ok(pages) if pages * DIRECT_IO_ALIGN as u64 >= len as u64 => return Ok(None),
            Ok(_) => {}
            Err(e) => {
                self.no_direct_reads(&e);
                return Ok(None);
            }
        }
        if let Err(e) = set_direct(file, true) {
            self.no_direct_reads(&e);
            return Ok(None);
        }
        match read_up_to(
            file,
            buf.slice_mut(len.next_multiple_of(DIRECT_IO_ALIGN)),
            len,
        ) {
            Ok(n) => Ok(Some(n)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                self.no_direct_reads(&e);
                // The caller may read the same file the usual way.
                let _ = set_direct(file, false);
                Ok(None)
            }
            Err(e) => Err(Error::io("cannot read chunk", path)(e)),
        }
    }

    /// Reads chunks through the page cache from now on (no `cachestat`, or no direct I/O here).
    fn no_direct_reads(&self, e: &io::Error) {
        if self.direct_reads.swap(false, Ordering::Relaxed) {
            tracing::debug!(
                "{}: chunks are read through the page cache ({e})",
                self.root.display()
            );
        }
    }

    /// Writes chunks through the page cache from now on: the filesystem refused direct I/O.
    fn no_direct_io(&self, e: &io::Error) {
        if self.direct.swap(false, Ordering::Relaxed) {
            tracing::debug!(
                "{}: no direct I/O here ({e}); chunks go through the page cache",
                self.root.display()
            );
        }
    }
}

fn writable_error(path: &Path, source: io::Error) -> Error {
    Error::Unwritable {
        path: path.into(),
        source,
    }
}

impl ReadBackend for LocalBackend {
    fn location(&self) -> &str {
        &self.location
    }

    fn describe(&self, key: &str) -> String {
        self.object_path(key).display().to_string()
    }

    fn get(&self, key: &str, buf: &mut Vec<u8>) -> Result<bool> {
        let Some(mut file) = self.open_object(key)? else {
            return Ok(false);
        };
        buf.clear();
        file.read_to_end(buf)
            .map_err(Error::io("cannot read", self.object_path(key)))?;
        Ok(true)
    }

    fn get_range(&self, key: &str, range: Range<u64>, buf: &mut Vec<u8>) -> Result<bool> {
        let Some(file) = self.open_object(key)? else {
            return Ok(false);
        };
        let want = range.end.saturating_sub(range.start) as usize;
        buf.clear();
        buf.resize(want, 0);
        let mut n = 0;
        while n < want {
            match file.read_at(&mut buf[n..], range.start + n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("cannot read", self.object_path(key))(e)),
            }
        }
        buf.truncate(n);
        Ok(true)
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        match self.dir()?.symlink_metadata(key) {
            Ok(m) if m.is_file() => Ok(Some(ObjectMeta {
                key: key.to_owned(),
                size: m.len(),
                modified: m.modified().ok(),
            })),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("cannot look at", self.object_path(key))(e)),
        }
    }

    fn list(&self, prefix: &str, f: &mut dyn FnMut(ObjectMeta)) -> Result<()> {
        // The folder the prefix ends in, walked two levels down at most (chunks/ab/NAME is the deepest
        // the layout goes): only regular files, never a link followed, nor a temporary file (a dot name).
        let dir = self.dir()?;
        let (dir_key, _) = prefix.rsplit_once('/').unwrap_or(("", prefix));
        let mut stack = vec![(dir_key.to_owned(), 0)];
        while let Some((key, depth)) = stack.pop() {
            let entries = match dir.entries_stat(&key) {
                Ok(e) => e,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {
                    continue
                }
                Err(e) => return Err(Error::io("cannot list", dir.join(&key))(e)),
            };
            for entry in entries {
                let Some(name) = entry.name.to_str() else {
                    continue;
                };
                if name.starts_with('.') {
                    continue;
                }
                let child = if key.is_empty() {
                    name.to_owned()
                } else {
                    format!("{key}/{name}")
                };
                match entry.kind {
                    Kind::Dir
                        if depth < 2
                            && (prefix.starts_with(&format!("{child}/"))
                                || child.starts_with(prefix)) =>
                    {
                        stack.push((child, depth + 1));
                    }
                    Kind::File if child.starts_with(prefix) => f(ObjectMeta {
                        key: child,
                        size: entry.len,
                        modified: entry.modified,
                    }),
                    _ => {}
                }
            }
        }
        Ok(())
    }

    fn prefetch(&self, key: &str) {
        if let Ok(Some(file)) = self.open_object(key) {
            // SAFETY: fadvise on a valid fd; WILLNEED only starts reading the file into the page cache.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
        }
    }

    fn local(&self) -> Option<&dyn LocalFs> {
        Some(self)
    }
}

impl Backend for LocalBackend {
    fn init(&self) -> Result<()> {
        if self.held.get().is_some() {
            return Ok(());
        }
        let held = self.open_store()?;
        // Two threads opening one backend at once: both checked it; either holds it.
        let _ = self.held.set(held);
        Ok(())
    }

    fn check_writable(&self) -> Result<()> {
        let dir = self.writable()?;
        if self.old_marker.load(Ordering::Relaxed) {
            // Retried: what this build writes must not go into a store older builds would misread.
            self.write_marker(dir)
                .map_err(|e| writable_error(&dir.join(STORE_FILE), e))?;
            self.old_marker.store(false, Ordering::Relaxed);
        }
        // Really write and sync a file: a read-only mount, a full disk or missing permissions show up here,
        // before any process is touched.
        let probe = format!(
            "staging/.probe.{}.{}",
            std::process::id(),
            self.tmp_counter.fetch_add(1, Ordering::Relaxed)
        );
        let result = (|| {
            let mut f = dir.create_new(&probe, FILE_MODE, OFlag::empty())?;
            f.write_all(b"gpu-checkpoint write probe\n")?;
            f.sync_all()
        })();
        let _ = dir.remove_file(&probe);
        result.map_err(|e| writable_error(&self.root, e))?;
        // Chunk and manifest folders must be writable too (they could have different owners).
        for folder in ["chunks", "manifests"] {
            let name = std::ffi::CString::new(folder).expect("no NUL");
            // SAFETY: faccessat on the held folder's descriptor with a NUL-terminated name.
            if unsafe {
                libc::faccessat(
                    dir.fd().as_raw_fd(),
                    name.as_ptr(),
                    libc::W_OK | libc::X_OK,
                    0,
                )
            } != 0
            {
                return Err(writable_error(
                    &dir.join(folder),
                    io::Error::last_os_error(),
                ));
            }
        }
        Ok(())
    }

    fn put(&self, key: &str, parts: &[&[u8]], durable: bool) -> Result<()> {
        if durable {
            // Temporary name, sync, rename, sync the folder: after this the object exists, and a crash
            // before it leaves no trace of it.
            let dir = self.writable()?;
            let bytes = parts.concat();
            return match self.put_durable(dir, key, &bytes) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let folder = key.rsplit_once('/').map_or("", |(f, _)| f);
                    dir.create_dir_all(folder, DIR_MODE)
                        .map_err(Error::io("cannot create folder", dir.join(folder)))?;
                    self.put_durable(dir, key, &bytes)
                }
                r => r,
            }
            .map_err(Error::io("cannot write", self.object_path(key)));
        }
        match parts {
            [whole] => self.put_file(key, Object::Whole(whole)),
            parts => self.put_file(key, Object::Parts(parts)),
        }
    }

    fn sync(&self, keys: &[String]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let dir = self.dir()?;
        if keys.len() >= SYNCFS_THRESHOLD {
            // SAFETY: syncfs on a valid fd. Since Linux 5.8 it reports writeback errors.
            if unsafe { libc::syncfs(dir.fd().as_raw_fd()) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            tracing::debug!("syncfs failed ({e}); falling back to fsync per file");
        }
        let mut folders = std::collections::BTreeSet::new();
        for key in keys {
            dir.sync(key)
                .map_err(Error::io("cannot sync", self.object_path(key)))?;
            // The object's folder (a chunk's fan-out folder) and the folder that holds it, which a new
            // fan-out folder was added to.
            let folder = key.rsplit_once('/').map_or("", |(f, _)| f);
            folders.insert(folder.rsplit_once('/').map_or("", |(up, _)| up));
            folders.insert(folder);
        }
        for folder in folders {
            dir.sync(folder)
                .map_err(Error::io("cannot sync folder", dir.join(folder)))?;
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let dir = self.writable()?;
        match dir.remove_file(key) {
            Ok(()) => {
                // A deleted manifest must stay deleted after a crash; a chunk's deletion need not be
                // durable (gc would delete it again).
                if !key.starts_with(super::CHUNKS) {
                    let folder = key.rsplit_once('/').map_or("", |(f, _)| f);
                    dir.sync(folder)
                        .map_err(Error::io("cannot sync", dir.join(folder)))?;
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io("cannot delete", self.object_path(key))(e)),
        }
    }
}

#[path = "local_fs.rs"]
mod fs_caps;

#[path = "local_layout.rs"]
mod layout;

#[cfg(test)]
#[path = "local_tests.rs"]
mod tests;
