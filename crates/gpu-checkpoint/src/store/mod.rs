//! Stage 4: the checkpoint store: chunked, compressed, content-addressed, verified images.
//!
//! A checkpoint's image files are cut into content-defined chunks (FastCDC), named by BLAKE3, compressed
//! with zstd and written once into a store shared by all checkpoints; a per-checkpoint manifest lists the
//! files and their chunks. See `docs/store.md` for the format and the guarantees.
//!
//! ```no_run
//! use gpu_checkpoint::store::{NoProgress, Store, StoreOptions};
//! # fn main() -> Result<(), gpu_checkpoint::store::Error> {
//! let store = Store::open("/var/lib/ckpt".as_ref(), StoreOptions::default())?;
//! store.check_writable()?;
//! let ingest = store.begin(Some("job"))?;
//! // ... CRIU writes its images into ingest.staging_dir() ...
//! let info = ingest.commit(serde_json::json!({"pid": 42}), &NoProgress)?;
//! store.materialize(&info.id, "/tmp/restore-images".as_ref(), &NoProgress)?;
//! # Ok(()) }
//! ```

pub mod backend;
pub mod chunk;
pub mod chunker;
mod error;
mod gc;
mod index;
mod ingest;
mod lease;
pub mod manifest;
mod open;
mod options;
mod piece;
mod pipelined;
mod plan;
mod read;
mod signed;
pub mod signing;
mod stream;
#[cfg(any(test, feature = "test-support"))]
mod testing;
mod time;
mod verify;

use std::path::{Path, PathBuf};
use std::sync::Arc;

#[cfg(any(test, feature = "test-support"))]
pub use backend::MemoryBackend;
pub use backend::{
    Backend, LocalBackend, LocalFs, LockMode, ObjectMeta, Objects, ReadBackend, ReadObjects,
};
pub use chunker::ChunkParams;
pub use error::{Error, Location, Result};
pub use gc::GcReport;
pub use ingest::Ingest;
pub use lease::{GRACE, LEASE_TTL};
pub use manifest::{CheckpointInfo, ChunkRef, Chunking, FileEntry, IngestStats};
pub use options::{StoreOptions, THREADS_ENV};
pub use piece::Streamed;
pub use plan::{memory_budget, Plan};

pub use read::{ChunkReader, ChunkSink, MaterializeStats};
pub use stream::Streams;
pub use verify::{VerifyProblem, VerifyReport};

/// Reports the progress of a long operation (ingest, materialize, verify) in bytes. The CLI implements it
/// with a progress bar; the library never prints.
pub trait Progress: Sync {
    /// A phase begins; `total_bytes` is what `advance` will add up to.
    fn start(&self, phase: &str, total_bytes: u64);
    /// `bytes` more of the current phase are done (called from worker threads).
    fn advance(&self, bytes: u64);
    /// The current phase is over.
    fn finish(&self);
}

/// A [`Progress`] that shows nothing.
pub struct NoProgress;

impl Progress for NoProgress {
    fn start(&self, _phase: &str, _total_bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

pub(crate) struct Inner {
    backend: Arc<dyn Backend>,
    opts: StoreOptions,
    /// Stored chunks, for backends where asking is a request.
    index: index::IndexCache,
}

impl Inner {
    /// The backend's read half: what the read path and verify take, so that they cannot write.
    fn reader(&self) -> &dyn ReadBackend {
        &*self.backend
    }

    /// Workers for an ingest. A worker writing chunks with direct I/O waits for the device while its
    /// object is written, so one more worker than cores keeps the cores busy (4 GiB checkpoint on 2 cores:
    /// 1.79-1.89 s with 3 workers against 1.82-2.03 s with 2, `docs/criu.md`). An explicit thread count
    /// is taken as it is.
    fn ingest_threads(&self) -> usize {
        let extra = self.opts.explicit_threads().is_none() && self.backend.aligned_objects();
        self.opts.effective_threads() + extra as usize
    }

    /// Workers for a restore's reads: four more than cores where cold chunks are read with direct I/O, for
    /// the same reason (the workers wait on the device), unless a thread count was given. A default restore
    /// of 4 GiB from a cold cache on 2 cores took 1.86-2.02 s with 2 workers, 1.51-1.55 s with 3, 1.28-1.38 s
    /// with 4 and 1.19-1.24 s with 6 (`docs/criu.md`).
    fn read_threads(&self) -> usize {
        let extra = if self.opts.explicit_threads().is_none() && self.backend.reads_uncached() {
            4
        } else {
            0
        };
        self.opts.effective_threads() + extra
    }
}

/// A checkpoint store. Cheap to clone; safe to use from many threads and processes at once.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

/// A `list` entry: a committed checkpoint, or a manifest that failed its checks.
#[derive(Clone, Debug)]
pub enum ListEntry {
    Ok(Box<CheckpointInfo>),
    Damaged { id: String, reason: String },
}

impl Store {
    /// Opens a store on any backend (the in-memory one in tests, an object store).
    pub fn with_backend(backend: Arc<dyn Backend>, opts: StoreOptions) -> Result<Store> {
        opts.chunking.validate().map_err(Error::Invalid)?;
        backend.init()?;
        Ok(Store {
            inner: Arc::new(Inner {
                backend,
                opts,
                index: Default::default(),
            }),
        })
    }

    /// The backend (tests use it to damage things on purpose).
    pub fn backend(&self) -> &dyn Backend {
        &*self.inner.backend
    }

    pub fn options(&self) -> &StoreOptions {
        &self.inner.opts
    }

    /// Where the store lives: a path, or a URL.
    pub fn location(&self) -> &str {
        self.inner.backend.location()
    }

    /// The store's local folder, if it is one (see [`LocalFs::root`]): the flows keep CRIU logs and
    /// restore work folders there; elsewhere they use the temporary folder.
    /// `None` too for another user's store trusted read-only: nothing of the flows goes into it.
    pub fn local_dir(&self) -> Option<&Path> {
        self.inner
            .backend
            .local()
            .filter(|l| !l.read_only())
            .map(|l| l.root())
    }

    /// Held while reading checkpoints: the local store's lock, shared (gc waits for it). Object stores have
    /// none: a checkpoint being read is protected by its manifest, which only `delete` removes.
    fn read_guard(&self) -> Result<Option<backend::LockGuard>> {
        self.inner
            .backend
            .local()
            .map(|l| l.lock(LockMode::Shared))
            .transpose()
    }

    /// Fails with exit status 6 if the store cannot be written now. Call it before touching a process.
    pub fn check_writable(&self) -> Result<()> {
        self.inner.backend.check_writable()
    }

    /// Starts a new checkpoint: allocates its id (UTC time + 32 random bits, unique, sortable by time) and
    /// a private staging folder on the store's filesystem. An id is never reused while its manifest or
    /// staging folder exists; 32 bits also keep the id of an aborted checkpoint (which its failed dump's
    /// log is named after) from coming back in the same second: 16 bits did, for one test run in a few
    /// hundred. Holds the store lock shared until the ingest ends, so `gc` cannot run meanwhile.
    pub fn begin(&self, name: Option<&str>) -> Result<Ingest> {
        if let Some(n) = name {
            validate_name(n)?;
        }
        let backend = &self.inner.backend;
        let lock = backend
            .local()
            .map(|l| l.lock(LockMode::Shared))
            .transpose()?;
        // Staging folders: on the store's own disk for a local store; elsewhere in the client's work
        // folder, or a private folder of unpredictable name in the temporary folder.
        let root = backend
            .work_root()
            .map(Path::to_path_buf)
            .unwrap_or_else(std::env::temp_dir);
        for _ in 0..64 {
            let now = std::time::SystemTime::now();
            let id = format!("{}-{:08x}", time::id_stamp(now), random_u32());
            if backend.get_manifest(&id)?.is_some() {
                continue;
            }
            let staging = match backend.local() {
                // In the store folder held open, never through a link.
                Some(local) => match local.create_staging(&id) {
                    Err(Error::Conflict(_)) => continue,
                    made => made?,
                },
                None => match private_folder(&root, &id, backend.work_root().is_some()) {
                    Ok(s) => s,
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                    Err(e) => {
                        return Err(Error::Unwritable {
                            path: root.join(&id).into(),
                            source: e,
                        })
                    }
                },
            };
            let guard = match lock {
                Some(l) => lease::WriterGuard::Lock(l),
                None => match lease::Lease::for_ingest(backend.clone(), &id) {
                    Ok(l) => lease::WriterGuard::Lease(l),
                    Err(e) => {
                        let _ = std::fs::remove_dir_all(&staging);
                        return Err(e);
                    }
                },
            };
            return Ok(Ingest::new(
                self.inner.clone(),
                id,
                name.map(str::to_owned),
                time::rfc3339(now),
                staging,
                guard,
            ));
        }
        Err(Error::Conflict(
            "could not allocate a unique checkpoint id (64 collisions)".into(),
        ))
    }

    /// Every committed checkpoint, oldest first. Damaged manifests are skipped (with a warning in the log);
    /// [`Store::list_entries`] shows them and `verify` reports them.
    pub fn list(&self) -> Result<Vec<CheckpointInfo>> {
        Ok(self
            .list_entries()?
            .into_iter()
            .filter_map(|e| match e {
                ListEntry::Ok(i) => Some(*i),
                ListEntry::Damaged { id, reason } => {
                    tracing::warn!("checkpoint {id}: damaged manifest: {reason}");
                    None
                }
            })
            .collect())
    }

    /// Every manifest, valid or not, oldest first.
    pub fn list_entries(&self) -> Result<Vec<ListEntry>> {
        let mut out: Vec<(String, String, ListEntry)> = Vec::new();
        for id in self.inner.backend.list_manifests()? {
            match self.load(&id) {
                Ok(info) => out.push((info.created.clone(), id, ListEntry::Ok(Box::new(info)))),
                // Removed between listing and reading (concurrent delete): not a checkpoint any more.
                Err(Error::NotFound { .. }) => {}
                Err(Error::DamagedManifest { reason, .. }) => {
                    out.push((String::new(), id.clone(), ListEntry::Damaged { id, reason }))
                }
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        Ok(out.into_iter().map(|e| e.2).collect())
    }

    /// A checkpoint by id, or by name (its newest checkpoint), with its manifest checked. Not found or
    /// damaged: exit status 7.
    /// With [`StoreOptions::trusted_keys`], a checkpoint whose manifest no trusted key signed is refused
    /// (exit status 4), and what is returned was parsed from the very bytes whose signature was checked.
    pub fn get(&self, id_or_name: &str) -> Result<CheckpointInfo> {
        self.trusted(self.find(id_or_name)?)
    }

    fn find(&self, id_or_name: &str) -> Result<CheckpointInfo> {
        if is_plain_id(id_or_name) {
            match self.load(id_or_name) {
                Err(Error::NotFound { .. }) => {}
                other => return other,
            }
        }
        let entries = self.list_entries()?;
        let newest = entries.iter().rev().find_map(|e| match e {
            ListEntry::Ok(i) if i.name.as_deref() == Some(id_or_name) => Some(i),
            _ => None,
        });
        // A name means its newest checkpoint. A damaged manifest that may be a newer one of that name
        // makes the name stand for none: falling back to an older checkpoint would restore (or delete) the
        // wrong one.
        for e in &entries {
            let ListEntry::Damaged { id, reason } = e else {
                continue;
            };
            if self.may_be_newest_named(id, id_or_name, newest.map(|i| &**i)) {
                return Err(Error::DamagedManifest {
                    checkpoint: id.clone(),
                    path: self.manifest_location(id).into(),
                    reason: format!(
                        "{reason}; it may be the newest checkpoint named {id_or_name:?}, so the name \
                         stands for none (restore an older one by its id, or delete this one)"
                    ),
                });
            }
        }
        newest
            .map(|i| (**i).clone())
            .ok_or_else(|| Error::NotFound {
                what: id_or_name.to_owned(),
                storage: self.location().into(),
            })
    }

    /// Whether the damaged manifest `id` may be a checkpoint named `name` newer than `newest`: what its JSON
    /// still says (name, creation time) when it reads, else its id's timestamp (ids start with the second
    /// they were made in). Anything that cannot be ruled out counts.
    fn may_be_newest_named(&self, id: &str, name: &str, newest: Option<&CheckpointInfo>) -> bool {
        let json = self
            .inner
            .backend
            .get_manifest(id)
            .ok()
            .flatten()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
        let field = |key: &str| json.as_ref().and_then(|v| v.get(key));
        let named = match field("name") {
            Some(serde_json::Value::String(n)) => n == name,
            Some(serde_json::Value::Null) => false,
            _ => true,
        };
        let newer = newest.is_none_or(|n| match field("created").and_then(|c| c.as_str()) {
            Some(created) => created >= n.created.as_str(),
            None => id.split('-').next() >= n.id.split('-').next(),
        });
        named && newer
    }

    /// Where a checkpoint's manifest lives, for messages and `inspect`: a path, or a URL.
    pub fn manifest_location(&self, id: &str) -> String {
        self.inner.backend.describe(&backend::manifest_key(id))
    }

    /// The file of a checkpoint's manifest, where the store is a local folder (for
    /// `restore --metadata PATH`).
    pub fn manifest_path(&self, id: &str) -> Option<PathBuf> {
        self.inner
            .backend
            .local()
            .map(|l| l.object_path(&backend::manifest_key(id)))
    }

    /// Loads the checkpoint whose manifest is at `path` (which must be inside this store, a local one).
    pub fn get_by_manifest_path(&self, path: &Path) -> Result<CheckpointInfo> {
        let not_ours = |why: String| Error::NotFound {
            what: format!("{} ({why})", path.display()),
            storage: self.location().into(),
        };
        let id = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
            .filter(|id| is_plain_id(id))
            .ok_or_else(|| not_ours("not a manifest's name".into()))?;
        let ours = self
            .manifest_path(id)
            .ok_or_else(|| not_ours("the store is not a local folder".into()))?;
        let info = self.trusted(self.load(id)?)?;
        // The file must be the very manifest of this store, not a copy elsewhere with the same name.
        let same = match (std::fs::canonicalize(path), std::fs::canonicalize(&ours)) {
            (Ok(a), Ok(b)) => a == b,
            _ => path == ours,
        };
        if !same {
            return Err(not_ours(format!(
                "not a manifest of this store; expected {}",
                ours.display()
            )));
        }
        Ok(info)
    }

    /// Opens the local store a manifest file belongs to (`STORE/manifests/ID.json`) and loads that
    /// checkpoint: for `restore --metadata PATH` without `--storage`.
    pub fn open_by_manifest_path(
        path: &Path,
        opts: StoreOptions,
    ) -> Result<(Store, CheckpointInfo)> {
        let root = path
            .parent()
            .filter(|d| d.file_name() == Some(std::ffi::OsStr::new("manifests")))
            .and_then(Path::parent)
            .filter(|r| r.join("store.json").is_file())
            .ok_or_else(|| Error::NotFound {
                what: format!(
                    "{} (not STORE/manifests/ID.json of a store)",
                    path.display()
                ),
                storage: path.into(),
            })?;
        let store = Store::open(root, opts)?;
        let info = store.get_by_manifest_path(path)?;
        Ok((store, info))
    }

    /// Writes checkpoint `id`'s image files into `dest` (created 0700 if missing), reading chunks in
    /// parallel and verifying each before writing it. On error nothing is left in `dest`; the error names
    /// checkpoint, file and chunk.
    pub fn materialize(
        &self,
        id: &str,
        dest: &Path,
        progress: &dyn Progress,
    ) -> Result<MaterializeStats> {
        let _lock = self.read_guard()?;
        let info = self.get(id)?;
        read::materialize(&self.inner, &info, dest, progress)
    }

    /// [`Store::materialize`] of only the chunks `keep(path, offset, len)` selects: the others are left as
    /// holes (zeros) in their files. For a restore whose page images are mostly filled by other means
    /// (`restore --uffd` writes only the pages CRIU itself reads).
    pub fn materialize_selected(
        &self,
        info: &CheckpointInfo,
        dest: &Path,
        keep: &(dyn Fn(&str, u64, u64) -> bool + Sync),
        progress: &dyn Progress,
    ) -> Result<MaterializeStats> {
        let _lock = self.read_guard()?;
        read::materialize_selected(&self.inner, info, dest, keep, progress)
    }

    /// Sends the image `name` of checkpoint `info` to `out` in order, every chunk verified before its bytes
    /// are written (a streaming restore: `out` is the pipe CRIU reads). `Ok(None)` when the checkpoint has
    /// no such image. Returns the bytes written.
    pub fn stream_file(
        &self,
        info: &CheckpointInfo,
        name: &str,
        out: &mut dyn std::io::Write,
        progress: &dyn Progress,
    ) -> Result<Option<u64>> {
        self.send_file(info, name, out, None, progress)
    }

    /// [`Store::stream_file`] into a pipe (a streamed restore): raw chunks kept in local files are
    /// verified where they lie and spliced into the pipe instead of copied through a buffer.
    pub fn stream_file_to_pipe(
        &self,
        info: &CheckpointInfo,
        name: &str,
        pipe: &std::fs::File,
        progress: &dyn Progress,
    ) -> Result<Option<u64>> {
        use std::os::fd::AsFd;
        // `&File` writes too, so the pipe serves as the writer and as the descriptor to splice into.
        self.send_file(info, name, &mut &*pipe, Some(pipe.as_fd()), progress)
    }

    /// What both of the above do: finds the image, holds the store lock shared, sends it.
    fn send_file(
        &self,
        info: &CheckpointInfo,
        name: &str,
        out: &mut dyn std::io::Write,
        splice_to: Option<std::os::fd::BorrowedFd<'_>>,
        progress: &dyn Progress,
    ) -> Result<Option<u64>> {
        let Some(fi) = info.files.iter().position(|f| f.path == name) else {
            return Ok(None);
        };
        let _lock = self.read_guard()?;
        read::stream_file(&self.inner, info, fi, out, splice_to, progress).map(Some)
    }

    /// Deletes a checkpoint (its manifest). Its chunks stay until `gc`, since other checkpoints may share them.
    /// Trusted keys play no part: deleting runs nothing, and an untrusted checkpoint must stay removable.
    pub fn delete(&self, id: &str) -> Result<()> {
        let info = self.find(id)?;
        if !self.inner.backend.delete_manifest(&info.id)? {
            return Err(Error::NotFound {
                what: id.to_owned(),
                storage: self.location().into(),
            });
        }
        // After the manifest, which makes the checkpoint: a crash between leaves an orphan gc removes.
        self.inner.backend.delete_signature(&info.id)
    }

    /// Deletes a manifest even if it is damaged (by exact id).
    pub fn delete_damaged(&self, id: &str) -> Result<bool> {
        if !is_plain_id(id) {
            return Ok(false);
        }
        let deleted = self.inner.backend.delete_manifest(id)?;
        self.inner.backend.delete_signature(id)?;
        Ok(deleted)
    }

    /// Re-reads and checks one checkpoint (`Some`) or the whole store (`None`). Problems are listed in the
    /// report (use [`VerifyReport::into_result`] to turn them into an error); only a missing checkpoint or
    /// an unreadable store is an `Err`.
    pub fn verify(&self, id: Option<&str>, progress: &dyn Progress) -> Result<VerifyReport> {
        let _lock = self.read_guard()?;
        let checkpoints = match id {
            // Not `get`: with trusted keys, an untrusted checkpoint is one of the problems reported.
            Some(id) => match self.find(id) {
                Ok(info) => vec![Ok(info)],
                Err(Error::DamagedManifest {
                    checkpoint, reason, ..
                }) => vec![Err((checkpoint, format!("damaged manifest: {reason}")))],
                Err(e) => return Err(e),
            },
            None => self
                .list_entries()?
                .into_iter()
                .map(|e| match e {
                    ListEntry::Ok(i) => Ok(*i),
                    ListEntry::Damaged { id, reason } => {
                        Err((id, format!("damaged manifest: {reason}")))
                    }
                })
                .collect(),
        };
        let permissions = self
            .inner
            .backend
            .local()
            .map(|l| l.restore_permissions())
            .unwrap_or_default();
        let mut report = verify::verify(&self.inner, checkpoints, progress)?;
        report.permissions_restored = permissions;
        Ok(report)
    }

    /// Removes chunks no checkpoint references, and staging folders of dead writers. Waits for checkpoints
    /// being written to finish (they hold the store lock) so it never deletes what they need.
    pub fn gc(&self) -> Result<GcReport> {
        gc::gc(&self.inner)
    }

    fn load(&self, id: &str) -> Result<CheckpointInfo> {
        self.decode_manifest(id, &self.manifest_bytes(id)?)
    }

    /// The bytes of checkpoint `id`'s manifest as stored.
    fn manifest_bytes(&self, id: &str) -> Result<Vec<u8>> {
        self.inner
            .backend
            .get_manifest(id)?
            .ok_or_else(|| Error::NotFound {
                what: id.to_owned(),
                storage: self.location().into(),
            })
    }

    /// Checks and parses the manifest `bytes` of checkpoint `id`.
    fn decode_manifest(&self, id: &str, bytes: &[u8]) -> Result<CheckpointInfo> {
        let path: Location = self.manifest_location(id).into();
        let info = manifest::decode(bytes).map_err(|reason| Error::DamagedManifest {
            checkpoint: id.to_owned(),
            path: path.clone(),
            reason,
        })?;
        if info.id != id {
            return Err(Error::DamagedManifest {
                checkpoint: id.to_owned(),
                path,
                reason: format!("it describes checkpoint {}", info.id),
            });
        }
        Ok(info)
    }
}

/// A staging folder for checkpoint `id` in `root`: the client's own work folder (`named`: `root/ID`), or
/// the temporary folder (a private folder of unpredictable name).
fn private_folder(root: &Path, id: &str, named: bool) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if named {
        let staging = root.join(id);
        return std::fs::DirBuilder::new()
            .mode(crate::util::DIR_MODE)
            .create(&staging)
            .map(|()| staging);
    }
    tempfile::Builder::new()
        .prefix(&format!("gpu-checkpoint-staging-{id}."))
        .permissions(std::fs::Permissions::from_mode(crate::util::DIR_MODE))
        .tempdir_in(root)
        .map(|d| d.keep())
}

/// Names are for humans and scripts: letters, digits, `.`, `_`, `-`; 1 to 128 characters.
fn validate_name(name: &str) -> Result<()> {
    if is_plain_id(name) {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "bad checkpoint name {name:?}: use 1-128 letters, digits, '.', '_' or '-', not starting with '.'"
        )))
    }
}

/// What a checkpoint's id and name may look like (one rule for both: each is used as a file name, so neither
/// may walk out of its folder): 1-128 letters, digits, '.', '_' or '-', not starting with '.'.
fn is_plain_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && !s.starts_with('.')
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// 32 random bits (the kernel's), for names no one can guess.
pub(crate) fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), libc::GRND_NONBLOCK) };
    if n == 4 {
        return u32::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    t ^ std::process::id().rotate_left(16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_ids_cannot_escape() {
        assert!(validate_name("job-1.v2_x").is_ok());
        for bad in ["", "../x", "a/b", ".hidden", "sp ace"] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
            assert!(!is_plain_id(bad), "{bad:?}");
        }
    }
}
