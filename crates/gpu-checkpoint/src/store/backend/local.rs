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
//! Chunk files are written with direct I/O ([`write_direct`]), and read with it when they are not in the
//! page cache ([`Backend::read_chunk_uncached`]); [`DIRECT_IO_ENV`]`=0` turns both off.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::direct::{
    blocks_layout, cached_pages, read_up_to, set_direct, write_direct, write_direct_parts,
};
use super::files::{flock, open_regular, restore_mode, tree_size, warn_modes};
use super::{Backend, LocalFs, LockGuard, LockMode, ObjectMeta, StaleCleanup};
use crate::store::chunk::ChunkId;
use crate::store::error::{Error, Result};
use crate::util::{
    create_private_dir_all, fsync_dir, is_direct_io_aligned, write_atomic, AlignedBuf,
    DIRECT_IO_ALIGN, DIR_MODE, FILE_MODE,
};

use super::objects::{check_marker, marker, STORE_FILE, STORE_FORMAT_VERSION};

/// Above this many new chunks one `syncfs` is cheaper than one fsync per chunk file (each fsync commits the
/// filesystem journal; syncfs commits it once for everything).
const SYNCFS_THRESHOLD: usize = 32;

pub struct LocalBackend {
    root: PathBuf,
    /// `root` for messages.
    location: String,
    chunks: PathBuf,
    manifests: PathBuf,
    staging: PathBuf,
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
    /// (permission denied), not "no store".
    pub fn holds_store(root: &Path) -> Result<bool> {
        let marker = root.join(STORE_FILE);
        match fs::metadata(&marker) {
            Ok(m) => Ok(m.is_file()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {
                Ok(false)
            }
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => Err(Error::Unreadable {
                path: root.into(),
                source: e,
            }),
            Err(e) => Err(Error::io("cannot look for", marker)(e)),
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
            chunks: root.join("chunks"),
            manifests: root.join("manifests"),
            staging: root.join("staging"),
            root,
            tmp_counter: AtomicU64::new(0),
            direct: AtomicBool::new(direct),
            direct_reads: AtomicBool::new(direct),
            old_marker: AtomicBool::new(false),
        }
    }

    fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        self.object_path(&super::chunk_key(id))
    }

    /// Writes an object under a temporary name and renames it into place: readers see no object or a
    /// complete one. Whole page-aligned objects are written with direct I/O while the filesystem takes it.
    fn put_file(&self, path: &Path, object: Object<'_>) -> Result<()> {
        if let Some(e) = crate::fault::io_error("store.write") {
            return Err(Error::io("cannot write chunk", path)(e));
        }
        let dir = path.parent().expect("object paths have a parent");
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let tmp = dir.join(format!(
            ".tmp.{}.{}.{}",
            &name[..name.len().min(16)],
            std::process::id(),
            n
        ));
        let direct = match object {
            Object::Whole(o) => self.direct.load(Ordering::Relaxed) && is_direct_io_aligned(o),
            Object::Parts(parts) => self.direct.load(Ordering::Relaxed) && blocks_layout(parts),
        };
        let open = || {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(FILE_MODE)
                .custom_flags(if direct { libc::O_DIRECT } else { 0 })
                .open(&tmp)
        };
        let file = match open() {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                create_private_dir_all(dir).map_err(Error::io("cannot create folder", dir))?;
                open().map_err(Error::io("cannot create chunk", &tmp))?
            }
            Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => {
                self.no_direct_io(&e);
                return self.put_file(path, object);
            }
            Err(e) => return Err(Error::io("cannot create chunk", &tmp)(e)),
        };
        let written = match object {
            Object::Whole(o) if direct => write_direct(&file, o),
            Object::Whole(o) => (&file).write_all(o),
            Object::Parts(parts) if direct => write_direct_parts(&file, parts),
            Object::Parts(parts) => parts.iter().try_for_each(|p| (&file).write_all(p)),
        };
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            if direct && e.raw_os_error() == Some(libc::EINVAL) {
                self.no_direct_io(&e);
                return self.put_file(path, object);
            }
            return Err(Error::io("cannot write chunk", &tmp)(e));
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
        fs::rename(&tmp, path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            Error::io("cannot rename chunk into place", path)(e)
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

    fn lock_file(&self) -> Result<File> {
        let path = self.root.join("lock");
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(FILE_MODE)
            .open(&path)
            .map_err(Error::io("cannot open lock file", &path))
    }

    /// Puts every store path's permissions back to 0700 (folders) and 0600 (files) where they differ;
    /// with `chunks`, the chunk files and their folders too. Returns what differed.
    fn restore_modes(&self, chunks: bool) -> Vec<String> {
        let mut found = Vec::new();
        for dir in [&self.root, &self.chunks, &self.manifests, &self.staging] {
            restore_mode(dir, DIR_MODE, &mut found);
        }
        for file in [STORE_FILE, "lock"] {
            restore_mode(&self.root.join(file), FILE_MODE, &mut found);
        }
        let files_in = |dir: &Path, found: &mut Vec<String>| {
            for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
                restore_mode(&entry.path(), FILE_MODE, found);
            }
        };
        files_in(&self.manifests, &mut found);
        if chunks {
            for sub in fs::read_dir(&self.chunks).into_iter().flatten().flatten() {
                if sub.file_type().is_ok_and(|t| t.is_dir()) {
                    restore_mode(&sub.path(), DIR_MODE, &mut found);
                    files_in(&sub.path(), &mut found);
                }
            }
        }
        found
    }

    fn create_layout(&self) -> Result<()> {
        for dir in [&self.root, &self.chunks, &self.manifests, &self.staging] {
            create_private_dir_all(dir).map_err(|e| writable_error(&self.root, e))?;
        }
        // The root may have existed (an empty folder the user made): make it private too.
        set_mode(&self.root, DIR_MODE)?;
        self.write_marker()
            .map_err(|e| writable_error(&self.root, e))?;
        fsync_dir(&self.root).map_err(Error::io("cannot sync", &self.root))
    }

    /// Writes the marker of this build's store version, atomically and durably.
    fn write_marker(&self) -> io::Result<()> {
        write_atomic(&self.root.join(STORE_FILE), &marker())
    }

    /// Marks a store of an older version as this build's before anything is written to it: builds of the
    /// older version would misread what this one writes (compressed chunks in chunk format version 2 read
    /// as damaged), and the marker makes them refuse the store instead, naming the versions. A store whose
    /// marker cannot be rewritten (a read-only mount, an immutable folder) still opens for reading (verify,
    /// restore), and [`Backend::check_writable`] then refuses writes.
    fn upgrade_marker(&self, from: u32) {
        match self.write_marker() {
            Ok(()) => tracing::debug!(
                "{}: store format version {from} marked {STORE_FORMAT_VERSION}",
                self.root.display()
            ),
            Err(e) => {
                self.old_marker.store(true, Ordering::Relaxed);
                tracing::debug!(
                    "{}: store format version {from} left as it is ({e}); the store is read only",
                    self.root.display()
                );
            }
        }
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(|e| writable_error(path, e))
}

fn writable_error(path: &Path, source: io::Error) -> Error {
    Error::Unwritable {
        path: path.into(),
        source,
    }
}

impl Backend for LocalBackend {
    fn location(&self) -> &str {
        &self.location
    }

    fn describe(&self, key: &str) -> String {
        self.object_path(key).display().to_string()
    }

    fn init(&self) -> Result<()> {
        // A file (or anything but a folder) given as the storage is a usage error, not an I/O failure.
        if fs::metadata(&self.root).is_ok_and(|m| !m.is_dir()) {
            return Err(Error::Invalid(format!(
                "storage {} is not a folder",
                self.root.display()
            )));
        }
        let marker = self.root.join(STORE_FILE);
        match fs::read(&marker) {
            Ok(bytes) => {
                let version = check_marker(&bytes, &marker.display().to_string())?;
                if version < STORE_FORMAT_VERSION {
                    self.upgrade_marker(version);
                }
                // Folders may be missing if someone cleaned up by hand; they hold nothing we need to keep.
                for dir in [&self.chunks, &self.manifests, &self.staging] {
                    if !dir.is_dir() {
                        create_private_dir_all(dir).map_err(|e| writable_error(dir, e))?;
                    }
                }
                // Loosened permissions are put back on every open (the folders and manifests: a few
                // paths); `verify` also checks every chunk.
                warn_modes(&self.root, &self.restore_modes(false));
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // A new store, in a missing or empty folder; never in a folder that holds other things.
                if let Ok(mut entries) = fs::read_dir(&self.root) {
                    if entries.next().is_some() {
                        return Err(Error::BadStore {
                            path: (&self.root).into(),
                            reason: "is not empty and not a gpu-checkpoint store (no store.json); \
                                     use an empty or new folder"
                                .into(),
                        });
                    }
                }
                self.create_layout()
            }
            Err(e) => Err(Error::io("cannot read", marker)(e)),
        }
    }

    fn check_writable(&self) -> Result<()> {
        if self.old_marker.load(Ordering::Relaxed) {
            // Retried: what this build writes must not go into a store older builds would misread.
            self.write_marker()
                .map_err(|e| writable_error(&self.root.join(STORE_FILE), e))?;
            self.old_marker.store(false, Ordering::Relaxed);
        }
        // Really write and sync a file: a read-only mount, a full disk or missing permissions show up here,
        // before any process is touched.
        let probe = self.staging.join(format!(
            ".probe.{}.{}",
            std::process::id(),
            self.tmp_counter.fetch_add(1, Ordering::Relaxed)
        ));
        let result = (|| {
            let mut f = crate::util::create_private_file(&probe)?;
            f.write_all(b"gpu-checkpoint write probe\n")?;
            f.sync_all()
        })();
        let _ = fs::remove_file(&probe);
        result.map_err(|e| writable_error(&self.root, e))?;
        // Chunk and manifest folders must be writable too (they could have different owners).
        for dir in [&self.chunks, &self.manifests] {
            let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
                .map_err(|_| Error::NulInPath { path: dir.clone() })?;
            // SAFETY: access() with a valid NUL-terminated path.
            if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
                return Err(writable_error(dir, io::Error::last_os_error()));
            }
        }
        Ok(())
    }

    fn put(&self, key: &str, parts: &[&[u8]], durable: bool) -> Result<()> {
        let path = self.object_path(key);
        if durable {
            // Temporary name, sync, rename, sync the folder: after this the object exists, and a crash
            // before it leaves no trace of it.
            let bytes = parts.concat();
            return match write_atomic(&path, &bytes) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    let dir = path.parent().expect("object paths have a parent");
                    create_private_dir_all(dir).map_err(Error::io("cannot create folder", dir))?;
                    write_atomic(&path, &bytes)
                }
                r => r,
            }
            .map_err(Error::io("cannot write", &path));
        }
        match parts {
            [whole] => self.put_file(&path, Object::Whole(whole)),
            parts => self.put_file(&path, Object::Parts(parts)),
        }
    }

    fn sync(&self, keys: &[String]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        if keys.len() >= SYNCFS_THRESHOLD {
            let root = File::open(&self.root).map_err(Error::io("cannot open", &self.root))?;
            // SAFETY: syncfs on a valid fd. Since Linux 5.8 it reports writeback errors.
            if unsafe { libc::syncfs(root.as_raw_fd()) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            tracing::debug!("syncfs failed ({e}); falling back to fsync per file");
        }
        let mut dirs = std::collections::BTreeSet::new();
        for key in keys {
            let path = self.object_path(key);
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(Error::io("cannot sync", &path))?;
            // The object's folder (a chunk's fan-out folder) and the folder that holds it, which a new
            // fan-out folder was added to.
            let dir = path.parent().expect("parent").to_path_buf();
            if let Some(up) = dir.parent().filter(|up| up.starts_with(&self.root)) {
                dirs.insert(up.to_path_buf());
            }
            dirs.insert(dir);
        }
        for dir in dirs {
            fsync_dir(&dir).map_err(Error::io("cannot sync folder", &dir))?;
        }
        Ok(())
    }

    fn get(&self, key: &str, buf: &mut Vec<u8>) -> Result<bool> {
        let path = self.object_path(key);
        let mut file = match open_regular(&path) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(false),
            Err(e) => return Err(Error::io("cannot open", path)(e)),
        };
        buf.clear();
        file.read_to_end(buf)
            .map_err(Error::io("cannot read", &path))?;
        Ok(true)
    }

    fn get_range(&self, key: &str, range: Range<u64>, buf: &mut Vec<u8>) -> Result<bool> {
        let path = self.object_path(key);
        let file = match open_regular(&path) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(false),
            Err(e) => return Err(Error::io("cannot open", path)(e)),
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
                Err(e) => return Err(Error::io("cannot read", &path)(e)),
            }
        }
        buf.truncate(n);
        Ok(true)
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        let path = self.object_path(key);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() => Ok(Some(ObjectMeta {
                key: key.to_owned(),
                size: m.len(),
                modified: m.modified().ok(),
            })),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("cannot look at", path)(e)),
        }
    }

    fn list(&self, prefix: &str, f: &mut dyn FnMut(ObjectMeta)) -> Result<()> {
        // The folder the prefix ends in, walked two levels down at most (chunks/ab/NAME is the deepest
        // the layout goes): only regular files, never a link followed, nor a temporary file (a dot name).
        let (dir_key, _) = prefix.rsplit_once('/').unwrap_or(("", prefix));
        let dir = if dir_key.is_empty() {
            self.root.clone()
        } else {
            self.root.join(dir_key)
        };
        let mut stack = vec![(dir, dir_key.to_owned(), 0)];
        while let Some((dir, key, depth)) = stack.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENOTDIR)) => {
                    continue
                }
                Err(e) => return Err(Error::io("cannot list", &dir)(e)),
            };
            for entry in entries {
                let entry = entry.map_err(Error::io("cannot list", &dir))?;
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                if name.starts_with('.') {
                    continue;
                }
                let child = if key.is_empty() {
                    name.to_owned()
                } else {
                    format!("{key}/{name}")
                };
                let Ok(kind) = entry.file_type() else {
                    continue;
                };
                if kind.is_dir() && depth < 2 {
                    if prefix.starts_with(&format!("{child}/")) || child.starts_with(prefix) {
                        stack.push((entry.path(), child, depth + 1));
                    }
                } else if kind.is_file() && child.starts_with(prefix) {
                    let meta = entry.metadata().ok();
                    f(ObjectMeta {
                        key: child,
                        size: meta.as_ref().map_or(0, |m| m.len()),
                        modified: meta.and_then(|m| m.modified().ok()),
                    });
                }
            }
        }
        Ok(())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let path = self.object_path(key);
        match fs::remove_file(&path) {
            Ok(()) => {
                // A deleted manifest must stay deleted after a crash; a chunk's deletion need not be
                // durable (gc would delete it again).
                if !key.starts_with(super::CHUNKS) {
                    let dir = path.parent().expect("parent");
                    fsync_dir(dir).map_err(Error::io("cannot sync", dir))?;
                }
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io("cannot delete", path)(e)),
        }
    }

    fn prefetch(&self, key: &str) {
        if let Ok(file) = File::open(self.object_path(key)) {
            // SAFETY: fadvise on a valid fd; WILLNEED only starts reading the file into the page cache.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
        }
    }

    fn local(&self) -> Option<&dyn LocalFs> {
        Some(self)
    }
}

impl LocalFs for LocalBackend {
    fn root(&self) -> &Path {
        &self.root
    }

    fn staging_root(&self) -> &Path {
        &self.staging
    }

    fn object_path(&self, key: &str) -> PathBuf {
        debug_assert!(
            !key.split('/')
                .any(|c| c.is_empty() || c == "." || c == ".."),
            "bad key {key:?}"
        );
        self.root.join(key)
    }

    fn aligned_objects(&self) -> bool {
        self.direct.load(Ordering::Relaxed)
    }

    fn reads_uncached(&self) -> bool {
        self.direct_reads.load(Ordering::Relaxed)
    }

    fn read_chunk_uncached(&self, id: &ChunkId, buf: &mut AlignedBuf) -> Result<Option<usize>> {
        if !self.direct_reads.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let path = self.chunk_path(id);
        // Missing, unreadable or not a regular file: the usual read reports it.
        let Ok(Some(file)) = open_regular(&path) else {
            return Ok(None);
        };
        let len = file
            .metadata()
            .map_err(Error::io("cannot stat chunk", &path))?
            .len() as usize;
        self.read_cold(&file, &path, len, buf)
    }

    fn read_object(
        &self,
        id: &ChunkId,
        max_len: usize,
        buf: &mut AlignedBuf,
    ) -> Result<Option<usize>> {
        let path = self.chunk_path(id);
        let file = match open_regular(&path) {
            Ok(Some(f)) => f,
            Ok(None) => return Ok(None),
            Err(e) => return Err(Error::io("cannot open chunk", path)(e)),
        };
        let len = file
            .metadata()
            .map_err(Error::io("cannot stat chunk", &path))?
            .len() as usize;
        if len > max_len {
            return Ok(Some(len));
        }
        if let Some(n) = self.read_cold(&file, &path, len, buf)? {
            return Ok(Some(n));
        }
        read_up_to(&file, buf.slice_mut(len), len)
            .map(Some)
            .map_err(Error::io("cannot read chunk", &path))
    }

    fn lock(&self, mode: LockMode) -> Result<LockGuard> {
        let file = match (self.lock_file(), mode) {
            (Ok(f), _) => f,
            // A store on a read-only mount (restoring on another node): readers lock the existing file
            // read-only, or need no lock where there is none (nothing can write or collect here).
            (Err(Error::Io { source, .. }), LockMode::Shared)
                if source.raw_os_error() == Some(libc::EROFS) =>
            {
                match File::open(self.root.join("lock")) {
                    Ok(f) => f,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        return Ok(LockGuard(Box::new(())))
                    }
                    Err(e) => {
                        return Err(Error::io("cannot open lock file", self.root.join("lock"))(
                            e,
                        ))
                    }
                }
            }
            (Err(e), _) => return Err(e),
        };
        let lock = flock(file, mode, false)
            .map_err(Error::io("cannot lock", self.root.join("lock")))?
            .expect("a blocking lock is taken or fails");
        Ok(LockGuard(Box::new(lock)))
    }

    fn try_lock(&self, mode: LockMode) -> Result<Option<LockGuard>> {
        let file = self.lock_file()?;
        let lock =
            flock(file, mode, true).map_err(Error::io("cannot lock", self.root.join("lock")))?;
        Ok(lock.map(|l| LockGuard(Box::new(l))))
    }

    fn restore_permissions(&self) -> Vec<String> {
        let found = self.restore_modes(true);
        warn_modes(&self.root, &found);
        found
    }

    fn cleanup_stale(&self) -> Result<StaleCleanup> {
        let mut out = StaleCleanup::default();
        if let Ok(entries) = fs::read_dir(&self.staging) {
            for entry in entries.flatten() {
                let path = entry.path();
                out.bytes += tree_size(&path);
                let removed = if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    fs::remove_dir_all(&path)
                } else {
                    fs::remove_file(&path)
                };
                removed.map_err(Error::io("cannot remove stale staging", &path))?;
                out.staging_dirs += 1;
            }
        }
        let mut remove_temps = |dir: &Path| -> Result<()> {
            let Ok(entries) = fs::read_dir(dir) else {
                return Ok(());
            };
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with(".tmp.")
                    || entry.file_name().to_string_lossy().contains(".json.tmp.")
                {
                    out.bytes += entry.metadata().map(|m| m.len()).unwrap_or(0);
                    let path = entry.path();
                    fs::remove_file(&path).map_err(Error::io("cannot remove temporary", &path))?;
                    out.temp_objects += 1;
                }
            }
            Ok(())
        };
        remove_temps(&self.manifests)?;
        if let Ok(subs) = fs::read_dir(&self.chunks) {
            for sub in subs.flatten() {
                remove_temps(&sub.path())?;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
#[path = "local_tests.rs"]
mod tests;
