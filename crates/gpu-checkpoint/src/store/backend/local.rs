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

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use super::{Backend, LockGuard, LockMode, StaleCleanup};
use crate::store::chunk::{ChunkId, Header, HEADER_LEN};
use crate::store::error::{Error, Result};
use crate::util::{create_private_dir_all, fsync_dir, write_atomic, DIR_MODE, FILE_MODE};

/// The store format this build writes and reads. Bump it on incompatible layout changes; older builds then
/// refuse the store instead of misreading it.
pub const STORE_FORMAT_VERSION: u32 = 1;
const STORE_FORMAT_NAME: &str = "gpu-checkpoint-store";
const STORE_FILE: &str = "store.json";

/// Above this many new chunks one `syncfs` is cheaper than one fsync per chunk file (each fsync commits the
/// filesystem journal; syncfs commits it once for everything).
const SYNCFS_THRESHOLD: usize = 32;

#[derive(Serialize, Deserialize)]
struct StoreFile {
    format: String,
    version: u32,
}

pub struct LocalBackend {
    root: PathBuf,
    chunks: PathBuf,
    manifests: PathBuf,
    staging: PathBuf,
    tmp_counter: AtomicU64,
}

impl LocalBackend {
    pub fn new(root: &Path) -> LocalBackend {
        // An absolute path keeps messages and manifest paths meaningful whatever the caller's cwd becomes.
        let root = std::path::absolute(root).unwrap_or_else(|_| root.to_path_buf());
        LocalBackend {
            chunks: root.join("chunks"),
            manifests: root.join("manifests"),
            staging: root.join("staging"),
            root,
            tmp_counter: AtomicU64::new(0),
        }
    }

    fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        let hex = id.to_hex();
        self.chunks.join(&hex[..2]).join(hex)
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

    fn create_layout(&self) -> Result<()> {
        for dir in [&self.root, &self.chunks, &self.manifests, &self.staging] {
            create_private_dir_all(dir).map_err(|e| writable_error(&self.root, e))?;
        }
        // The root may have existed (an empty folder the user made): make it private too.
        set_mode(&self.root, DIR_MODE)?;
        let marker = StoreFile {
            format: STORE_FORMAT_NAME.into(),
            version: STORE_FORMAT_VERSION,
        };
        let bytes = serde_json::to_vec_pretty(&marker).expect("serialisable");
        write_atomic(&self.root.join(STORE_FILE), &bytes)
            .map_err(|e| writable_error(&self.root, e))?;
        fsync_dir(&self.root).map_err(Error::io("cannot sync", &self.root))
    }
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(|e| writable_error(path, e))
}

fn writable_error(path: &Path, source: io::Error) -> Error {
    Error::Unwritable {
        path: path.to_path_buf(),
        source,
    }
}

fn is_hex_name(name: &str) -> bool {
    name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

fn flock(file: &File, op: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: flock on a valid, owned file descriptor.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

fn lock_op(mode: LockMode) -> libc::c_int {
    match mode {
        LockMode::Shared => libc::LOCK_SH,
        LockMode::Exclusive => libc::LOCK_EX,
    }
}

impl Backend for LocalBackend {
    fn location(&self) -> &Path {
        &self.root
    }

    fn local_dir(&self) -> Option<&Path> {
        Some(&self.root)
    }

    fn init(&self) -> Result<()> {
        let marker = self.root.join(STORE_FILE);
        match fs::read(&marker) {
            Ok(bytes) => {
                let parsed: StoreFile =
                    serde_json::from_slice(&bytes).map_err(|e| Error::BadStore {
                        path: marker.clone(),
                        reason: format!("unreadable store marker: {e}"),
                    })?;
                if parsed.format != STORE_FORMAT_NAME {
                    return Err(Error::BadStore {
                        path: marker,
                        reason: format!("not a gpu-checkpoint store (format {:?})", parsed.format),
                    });
                }
                if parsed.version > STORE_FORMAT_VERSION {
                    return Err(Error::BadStore {
                        path: marker,
                        reason: format!(
                            "store format version {} is newer than this build supports ({}); upgrade gpu-checkpoint",
                            parsed.version, STORE_FORMAT_VERSION
                        ),
                    });
                }
                // Folders may be missing if someone cleaned up by hand; they hold nothing we need to keep.
                for dir in [&self.chunks, &self.manifests, &self.staging] {
                    if !dir.is_dir() {
                        create_private_dir_all(dir).map_err(|e| writable_error(dir, e))?;
                    }
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                // A new store, in a missing or empty folder; never in a folder that holds other things.
                if let Ok(mut entries) = fs::read_dir(&self.root) {
                    if entries.next().is_some() {
                        return Err(Error::BadStore {
                            path: self.root.clone(),
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
                .map_err(|_| Error::Other(format!("path {} contains a NUL byte", dir.display())))?;
            // SAFETY: access() with a valid NUL-terminated path.
            if unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
                return Err(writable_error(dir, io::Error::last_os_error()));
            }
        }
        Ok(())
    }

    fn staging_root(&self) -> &Path {
        &self.staging
    }

    fn chunk_stored_len(&self, id: &ChunkId) -> Result<Option<u64>> {
        let path = self.chunk_path(id);
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("cannot open chunk", path)(e)),
        };
        let len = file
            .metadata()
            .map_err(Error::io("cannot stat chunk", &path))?
            .len();
        let mut head = [0u8; HEADER_LEN];
        if file.read_exact_at(&mut head, 0).is_err() {
            return Ok(None);
        }
        // A chunk file whose size disagrees with its header was cut short (a crash before the data reached the
        // disk): treat it as absent so that this ingest writes it again instead of referencing it.
        match Header::decode(&head) {
            Ok(h) if h.stored_len() == len => Ok(Some(len)),
            _ => Ok(None),
        }
    }

    fn put_chunk(&self, id: &ChunkId, header: &[u8], payload: &[u8]) -> Result<()> {
        let path = self.chunk_path(id);
        let dir = path.parent().expect("chunk paths have a parent");
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(
            ".tmp.{}.{}.{}",
            &id.to_hex()[..16],
            std::process::id(),
            n
        ));
        let open = || {
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(FILE_MODE)
                .open(&tmp)
        };
        let mut file = match open() {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                create_private_dir_all(dir).map_err(Error::io("cannot create folder", dir))?;
                open().map_err(Error::io("cannot create chunk", &tmp))?
            }
            Err(e) => return Err(Error::io("cannot create chunk", &tmp)(e)),
        };
        let written = file
            .write_all(header)
            .and_then(|_| file.write_all(payload))
            .map_err(Error::io("cannot write chunk", &tmp));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        // Start writeback now so that the final sync finds little left to write; don't wait for it.
        // SAFETY: valid fd; the flag only schedules writeback.
        unsafe {
            libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE);
        }
        drop(file);
        // rename() is atomic: readers see no chunk or a complete one. If a concurrent writer stored the same
        // name first, its copy is byte-identical, so replacing it is harmless.
        fs::rename(&tmp, &path).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            Error::io("cannot rename chunk into place", &path)(e)
        })
    }

    fn sync_chunks(&self, written: &[ChunkId]) -> Result<()> {
        if written.is_empty() {
            return Ok(());
        }
        if written.len() >= SYNCFS_THRESHOLD {
            let root = File::open(&self.root).map_err(Error::io("cannot open", &self.root))?;
            // SAFETY: syncfs on a valid fd. Since Linux 5.8 it reports writeback errors.
            if unsafe { libc::syncfs(root.as_raw_fd()) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            tracing::debug!("syncfs failed ({e}); falling back to fsync per chunk");
        }
        let mut dirs = std::collections::BTreeSet::new();
        for id in written {
            let path = self.chunk_path(id);
            File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(Error::io("cannot sync chunk", &path))?;
            dirs.insert(path.parent().expect("parent").to_path_buf());
        }
        dirs.insert(self.chunks.clone());
        for dir in dirs {
            fsync_dir(&dir).map_err(Error::io("cannot sync folder", &dir))?;
        }
        Ok(())
    }

    fn local_chunk_file(&self, id: &ChunkId) -> Option<PathBuf> {
        Some(self.chunk_path(id))
    }

    fn read_chunk(&self, id: &ChunkId, buf: &mut Vec<u8>) -> Result<bool> {
        let path = self.chunk_path(id);
        let mut file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(Error::io("cannot open chunk", path)(e)),
        };
        buf.clear();
        file.read_to_end(buf)
            .map_err(Error::io("cannot read chunk", &path))?;
        Ok(true)
    }

    fn delete_chunk(&self, id: &ChunkId) -> Result<()> {
        let path = self.chunk_path(id);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("cannot delete chunk", path)(e)),
        }
    }

    fn list_chunks(&self, f: &mut dyn FnMut(ChunkId, u64)) -> Result<()> {
        let top = match fs::read_dir(&self.chunks) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io("cannot list", &self.chunks)(e)),
        };
        for sub in top {
            let sub = sub.map_err(Error::io("cannot list", &self.chunks))?;
            if !sub.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                continue;
            }
            let dir = sub.path();
            for entry in fs::read_dir(&dir).map_err(Error::io("cannot list", &dir))? {
                let entry = entry.map_err(Error::io("cannot list", &dir))?;
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                if !is_hex_name(name) {
                    continue;
                }
                let Some(id) = ChunkId::from_hex(name) else {
                    continue;
                };
                let len = entry.metadata().map(|m| m.len()).unwrap_or(0);
                f(id, len);
            }
        }
        Ok(())
    }

    fn put_manifest(&self, id: &str, bytes: &[u8]) -> Result<()> {
        let path = self.manifest_path(id);
        write_atomic(&path, bytes).map_err(Error::io("cannot write manifest", &path))
    }

    fn get_manifest(&self, id: &str) -> Result<Option<Vec<u8>>> {
        let path = self.manifest_path(id);
        match fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io("cannot read manifest", path)(e)),
        }
    }

    fn delete_manifest(&self, id: &str) -> Result<bool> {
        let path = self.manifest_path(id);
        match fs::remove_file(&path) {
            Ok(()) => {
                fsync_dir(&self.manifests).map_err(Error::io("cannot sync", &self.manifests))?;
                Ok(true)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io("cannot delete manifest", path)(e)),
        }
    }

    fn list_manifests(&self) -> Result<Vec<String>> {
        let mut ids = Vec::new();
        let entries = match fs::read_dir(&self.manifests) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(ids),
            Err(e) => return Err(Error::io("cannot list", &self.manifests)(e)),
        };
        for entry in entries {
            let entry = entry.map_err(Error::io("cannot list", &self.manifests))?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            // Temporary files of in-flight manifest writes start with a dot: they are not checkpoints.
            if name.starts_with('.') {
                continue;
            }
            if let Some(id) = name.strip_suffix(".json") {
                ids.push(id.to_owned());
            }
        }
        Ok(ids)
    }

    fn manifest_path(&self, id: &str) -> PathBuf {
        self.manifests.join(format!("{id}.json"))
    }

    fn lock(&self, mode: LockMode) -> Result<LockGuard> {
        let file = self.lock_file()?;
        flock(&file, lock_op(mode)).map_err(Error::io("cannot lock", self.root.join("lock")))?;
        Ok(LockGuard(Box::new(file)))
    }

    fn try_lock(&self, mode: LockMode) -> Result<Option<LockGuard>> {
        let file = self.lock_file()?;
        match flock(&file, lock_op(mode) | libc::LOCK_NB) {
            Ok(()) => Ok(Some(LockGuard(Box::new(file)))),
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(None),
            Err(e) => Err(Error::io("cannot lock", self.root.join("lock"))(e)),
        }
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

/// Bytes under a path (files only), for reporting what a cleanup freed.
fn tree_size(path: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return meta.len();
    }
    fs::read_dir(path)
        .map(|entries| entries.flatten().map(|e| tree_size(&e.path())).sum())
        .unwrap_or(0)
}
