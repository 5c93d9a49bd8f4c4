//! The container checkpoint archive of podman, CRI-O and checkpointctl (`--format oci-checkpoint`):
//! `export` writes a container checkpoint of the store as one, `import` stores one as a checkpoint.
//!
//! The archive's layout (read in podman's `exportCheckpoint` and checkpointctl's `lib/metadata.go`): a
//! tar whose `checkpoint/` folder holds the runtime's images (CRIU's `*.img` and runc's
//! `descriptors.json`, or runsc's `checkpoint.img`), next to `config.dump` (the engine's container
//! config, JSON: `id`, `name`, `runtime`, `createdTime`, ...), `spec.dump` (the OCI runtime spec the
//! container ran with) and optional files: `rootfs-diff.tar` and `deleted.files` (changes to the root
//! file system), `network.status`, `devshm-checkpoint.tar`, `stats-dump`, `artifacts/`, `ctr.log`.
//!
//! In the store the runtime's images lie flat, as the container restore hands them to the runtime; every
//! other file of an imported archive is kept under `oci/` with its path in the archive, so that an export
//! of an import gives the same files back (byte for byte) and a restore's runtime, which reads only its
//! own image names, never sees them. A checkpoint taken by `checkpoint --container` has no `oci/`: its
//! export writes a `config.dump` from its manifest (with the podman image its rootfs is, when given,
//! for `podman container restore --import`) and the bundle's `config.json` as `spec.dump`. An
//! imported `rootfs-diff.tar`/`deleted.files` is applied by the restore (`restore/rootfs.rs`).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use serde::Serialize;

use super::{Error, WorkDir};
use crate::detect::{Report, StrategyDecision, StrategyName};
use crate::flows::manifest::{self, CheckpointManifest, ContainerRecord, CriuInfo, HostInfo};
use crate::flows::manifest::{OptionsRecord, PhaseTimings, Sizes};
use crate::store::{CheckpointInfo, Progress, Store};

/// The runtime's images in the archive.
pub const CHECKPOINT_DIR: &str = "checkpoint";
/// The root file system's added and changed files (a tar), and its removed paths (JSON).
const ROOTFS_DIFF: &str = "rootfs-diff.tar";
const DELETED_FILES: &str = "deleted.files";
/// The engine's container config (JSON).
pub const CONFIG_DUMP: &str = "config.dump";
/// The OCI runtime spec (JSON).
pub const SPEC_DUMP: &str = "spec.dump";
/// Where the store keeps an imported archive's files other than the images.
const OCI_DIR: &str = "oci";
/// CRIU's log and statistics of the dump: the archive's top level (podman keeps them in the bundle, next
/// to the others; `checkpointctl inspect` reads `stats-dump` there).
const TOP_LEVEL: [&str; 2] = ["dump.log", "stats-dump"];
/// The spec annotation naming the engine whose archive this is; checkpointctl reads the container's
/// name and creation time from `config.dump` only when it is `libpod` (otherwise it looks for
/// Kubernetes annotations a runc bundle does not have, and calls the engine containerd).
const MANAGER_ANNOTATION: &str = "io.container.manager";

/// The image in podman's storage whose root file system is the checkpointed bundle's (made with `podman
/// import` of the rootfs): what podman's `container restore --import` needs to restore an export of a
/// checkpoint taken by `checkpoint --container`.
#[derive(Debug, Clone)]
pub struct PodmanImage {
    /// Its name (`localhost/NAME:TAG`), which podman looks up first.
    pub name: String,
    /// Its id: 64 hexadecimal digits (`podman image inspect --format '{{.Id}}'`).
    pub id: String,
}

/// What `export` wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ExportOutcome {
    pub checkpoint: String,
    pub path: PathBuf,
    /// The archive's file entries, in order.
    pub entries: Vec<String>,
    /// The archive's size.
    pub bytes: u64,
    /// With `--rootfs-base`: the root file system changes the archive carries.
    pub rootfs_changes: Option<RootfsSummary>,
}

/// How many root file system changes an export carries, and what it left out.
#[derive(Debug, Clone, Serialize)]
pub struct RootfsSummary {
    /// Entries in `rootfs-diff.tar` (added or changed).
    pub changed: usize,
    /// Paths in `deleted.files`.
    pub deleted: usize,
    /// Entries not carried (devices, pipes, sockets, other file systems), with why.
    pub skipped: Vec<String>,
}

/// What `import` stored.
#[derive(Debug, Clone)]
pub struct ImportOutcome {
    pub info: CheckpointInfo,
    /// The container's id and runtime from `config.dump`.
    pub container: String,
    pub runtime: String,
}

/// The part of `config.dump` read and written here; podman's has many more fields, kept as they are
/// (an import stores the file itself).
#[derive(Debug, Serialize, serde::Deserialize)]
struct ConfigDump {
    id: String,
    #[serde(default)]
    name: String,
    #[serde(rename = "runtime", default, skip_serializing_if = "String::is_empty")]
    oci_runtime: String,
    #[serde(rename = "createdTime", default)]
    created_time: String,
    /// The podman image the container's root file system is (`--podman-image`): podman's restore
    /// creates the container's storage from it, and refuses one without the other.
    #[serde(
        rename = "rootfsImageID",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    rootfs_image_id: String,
    #[serde(
        rename = "rootfsImageName",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    rootfs_image_name: String,
    #[serde(
        rename = "checkpointedTime",
        default,
        skip_serializing_if = "String::is_empty"
    )]
    checkpointed_time: String,
}

/// The archive is not what it should be. The reason may quote the archive (entry names, a header's bytes):
/// its control characters are escaped.
fn bad(path: &Path, reason: impl Into<String>) -> crate::Error {
    Error::Archive {
        path: path.to_path_buf(),
        reason: crate::fmt::escape_controls(&reason.into()).into_owned(),
    }
    .into()
}

/// Copies an archive entry into `out`, telling the archive's failures (a short or garbled archive: a bad
/// input) from the store's (a full file system: a storage error, exit status 6).
fn copy_entry(
    archive: &Path,
    entry: &mut impl Read,
    out: &mut File,
    dest: &Path,
) -> crate::Result<()> {
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match entry.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(bad(archive, format!("not a readable tar archive: {e}"))),
        };
        out.write_all(&buf[..n])
            .map_err(|source| crate::store::Error::Unwritable {
                path: dest.into(),
                source,
            })?;
    }
}

/// Every regular file under `root`, as sorted relative paths with `/`.
fn files_under(root: &Path) -> Result<Vec<String>, crate::Error> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).map_err(Error::io_at(&dir))? {
            let e = e.map_err(Error::io_at(&dir))?;
            let kind = e.file_type().map_err(Error::io_at(&dir))?;
            if kind.is_dir() {
                stack.push(e.path());
            } else if kind.is_file() {
                let rel = e.path().strip_prefix(root).expect("under root").to_owned();
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Where a file of the store goes in the archive.
fn archive_name(stored: &str) -> String {
    match stored.strip_prefix("oci/") {
        Some(rest) => rest.to_string(),
        None if TOP_LEVEL.contains(&stored) => stored.to_string(),
        None => format!("{CHECKPOINT_DIR}/{stored}"),
    }
}

/// Where a file of the archive goes in the store.
fn stored_name(entry: &str) -> String {
    match entry.strip_prefix("checkpoint/") {
        Some(image) if !image.contains('/') => image.to_string(),
        _ => format!("{OCI_DIR}/{entry}"),
    }
}

/// `spec.dump` from the bundle's `config.json`: the same spec, with the engine annotation of the
/// archive's format (libpod's) added when the bundle names none.
fn spec_dump(path: &Path, config_json: Vec<u8>) -> Result<Vec<u8>, crate::Error> {
    let mut spec: serde_json::Value = serde_json::from_slice(&config_json)
        .map_err(|e| bad(path, format!("the bundle's config.json is not JSON: {e}")))?;
    let Some(obj) = spec.as_object_mut() else {
        return Err(bad(path, "the bundle's config.json is not a JSON object"));
    };
    let annotations = obj
        .entry("annotations")
        .or_insert_with(|| serde_json::json!({}));
    match annotations.as_object_mut() {
        Some(a) if a.contains_key(MANAGER_ANNOTATION) => return Ok(config_json),
        Some(a) => {
            a.insert(MANAGER_ANNOTATION.into(), "libpod".into());
        }
        None => return Err(bad(path, "the bundle's annotations are not a JSON object")),
    }
    Ok(serde_json::to_vec_pretty(&spec).expect("a JSON value"))
}

fn append(
    tar: &mut tar::Builder<impl Write>,
    name: &str,
    size: u64,
    data: impl Read,
    mtime: u64,
) -> std::io::Result<()> {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(size);
    // The images hold a process's whole memory: unpacked, they are the owner's alone.
    h.set_mode(0o600);
    h.set_mtime(mtime);
    tar.append_data(&mut h, name, data)
}

/// Writes checkpoint `checkpoint` (a container checkpoint) as a podman/CRI-O checkpoint archive at
/// `dest`, uncompressed. The images are read out of the store with every chunk verified; the archive
/// appears at `dest` only when complete (a private temporary file renamed), and an existing `dest` is
/// never overwritten.
pub fn export_oci(
    store: &Store,
    checkpoint: &str,
    dest: &Path,
    podman: Option<&PodmanImage>,
    rootfs_base: Option<&Path>,
    progress: &dyn Progress,
) -> crate::Result<ExportOutcome> {
    let (info, _, record) = super::restore::load(store, checkpoint)?;
    if let Some(image) = podman {
        let hex = image.id.len() == 64 && image.id.bytes().all(|b| b.is_ascii_hexdigit());
        if !hex || image.name.is_empty() {
            return Err(bad(
                dest,
                format!(
                    "--podman-image-id must be the image's 64-digit id and --podman-image its name (got {:?}, {:?})",
                    image.id, image.name
                ),
            ));
        }
    }
    let work = WorkDir::create(store, &info.id)?;
    store.materialize(&info.id, work.path(), progress)?;
    let stored = files_under(work.path())?;

    // The metadata an engine reads, from the archive this was imported from or made from the manifest.
    let mut extra: Vec<(String, Vec<u8>)> = Vec::new();
    if !stored.iter().any(|f| f == "oci/config.dump") {
        // A runc container has no name but its id (the checkpoint's --name names the checkpoint). For
        // podman the id is 64 hexadecimal digits (it shows the first 12); one made from the checkpoint
        // and the container, so that two exports of a checkpoint restore as the same container.
        let id = match podman {
            Some(_) => blake3::hash(format!("{}/{}", info.id, record.id).as_bytes())
                .to_hex()
                .to_string(),
            None => record.id.clone(),
        };
        let config = ConfigDump {
            id,
            name: record.id.clone(),
            oci_runtime: record.runtime.clone(),
            created_time: info.created.clone(),
            checkpointed_time: info.created.clone(),
            rootfs_image_id: podman.map(|p| p.id.clone()).unwrap_or_default(),
            rootfs_image_name: podman.map(|p| p.name.clone()).unwrap_or_default(),
        };
        let json = serde_json::to_vec_pretty(&config).expect("plain struct");
        extra.push((CONFIG_DUMP.into(), json));
    } else if podman.is_some() || rootfs_base.is_some() {
        return Err(bad(
            dest,
            "the checkpoint was imported from an archive: its config.dump, image and root file system changes are the engine's own; --podman-image and --rootfs-base are for checkpoints taken by checkpoint --container",
        ));
    }
    // The container's root file system changes against the one it started from, read now from the
    // bundle (for a container the checkpoint stopped, they are as they were at the checkpoint).
    let mut diff_tar = None;
    let rootfs_changes = match rootfs_base {
        Some(base) => {
            let rootfs = super::restore::rootfs::rootfs_of(&record.bundle)?;
            let changes = super::rootfs_diff::diff(base, &rootfs)?;
            if !changes.changed.is_empty() {
                // Beside the images in the private work folder: it may be large.
                let path = work.path().join(".rootfs-diff.tar");
                let f = File::options()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)
                    .map_err(Error::io_at(&path))?;
                super::rootfs_diff::write_diff_tar(&rootfs, &changes, BufWriter::new(&f))?;
                diff_tar = Some(path);
            }
            if !changes.deleted.is_empty() {
                extra.push((DELETED_FILES.into(), changes.deleted_files()));
            }
            Some(RootfsSummary {
                changed: changes.changed.len(),
                deleted: changes.deleted.len(),
                skipped: changes
                    .skipped
                    .iter()
                    .map(|(p, why)| format!("{}: {why}", p.display()))
                    .collect(),
            })
        }
        None => None,
    };
    if !stored.iter().any(|f| f == "oci/spec.dump") {
        let spec = record.bundle.join("config.json");
        let json = std::fs::read(&spec).map_err(|e| {
            bad(
                &spec,
                format!("spec.dump is made from the container's bundle, whose config.json cannot be read: {e}"),
            )
        })?;
        extra.push((SPEC_DUMP.into(), spec_dump(&spec, json)?));
    }

    let parent = match dest.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".gpu-checkpoint-export.")
        .tempfile_in(&parent)
        .map_err(Error::io_at(&parent))?;
    let mtime = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut entries = Vec::new();
    let mut tar = tar::Builder::new(BufWriter::new(tmp.as_file()));
    let write = |e: std::io::Error| bad(dest, format!("writing the archive: {e}"));
    let mut dir = tar::Header::new_gnu();
    dir.set_entry_type(tar::EntryType::Directory);
    dir.set_mode(0o700);
    dir.set_mtime(mtime);
    dir.set_size(0);
    tar.append_data(&mut dir, format!("{CHECKPOINT_DIR}/"), std::io::empty())
        .map_err(write)?;
    for (name, data) in &extra {
        append(&mut tar, name, data.len() as u64, &data[..], mtime).map_err(write)?;
        entries.push(name.clone());
    }
    let mut files: Vec<(String, PathBuf)> = stored
        .iter()
        .map(|rel| (archive_name(rel), work.path().join(rel)))
        .collect();
    if let Some(path) = diff_tar {
        files.push((ROOTFS_DIFF.into(), path));
    }
    for (name, path) in files {
        let f = File::open(&path).map_err(Error::io_at(&path))?;
        let size = f.metadata().map_err(Error::io_at(&path))?.len();
        append(&mut tar, &name, size, BufReader::new(f), mtime).map_err(write)?;
        entries.push(name);
    }
    tar.into_inner()
        .and_then(|mut w| w.flush())
        .map_err(write)?;
    tmp.as_file().sync_all().map_err(write)?;
    let bytes = tmp.as_file().metadata().map_err(write)?.len();
    tmp.persist_noclobber(dest).map_err(|e| {
        bad(
            dest,
            format!(
                "cannot put the archive in place (an existing file is never overwritten): {}",
                e.error
            ),
        )
    })?;
    crate::util::fsync_dir(&parent).map_err(Error::io_at(&parent))?;
    Ok(ExportOutcome {
        checkpoint: info.id,
        path: dest.to_path_buf(),
        entries,
        bytes,
        rootfs_changes,
    })
}

/// A relative path inside the archive, refused when it could leave the folder it is unpacked in.
fn safe_entry_path(archive: &Path, path: &Path) -> Result<String, crate::Error> {
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => parts.push(
                p.to_str()
                    .ok_or_else(|| bad(archive, "an entry's name is not UTF-8"))?
                    .to_string(),
            ),
            Component::CurDir => {}
            _ => {
                return Err(bad(
                    archive,
                    format!("entry {} leaves the archive's folder", path.display()),
                ))
            }
        }
    }
    Ok(parts.join("/"))
}

/// Opens the archive, uncompressed or zstd-compressed (podman's default).
fn open_archive(path: &Path) -> Result<Box<dyn Read>, crate::Error> {
    let mut f = File::open(path).map_err(|e| bad(path, format!("cannot open: {e}")))?;
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic).map_err(|e| bad(path, e.to_string()))?;
    let head = std::io::Cursor::new(magic[..n].to_vec());
    let reader = BufReader::new(head.chain(f));
    match magic {
        [0x28, 0xb5, 0x2f, 0xfd] => Ok(Box::new(
            zstd::stream::read::Decoder::with_buffer(reader).map_err(|e| bad(path, e.to_string()))?,
        )),
        [0x1f, 0x8b, ..] => Err(bad(
            path,
            "gzip-compressed: unpack it first (gunzip), or export with podman's --compress zstd or none",
        )),
        _ => Ok(Box::new(reader)),
    }
}

/// Stores a podman/CRI-O checkpoint archive as a container checkpoint (chunked and deduplicated like
/// any other). Only regular files and folders are accepted; nothing is stored unless the archive is
/// complete and holds `config.dump` and the runtime's images. The checkpoint records no bundle (pass
/// `restore --bundle`) and no GPU state.
pub fn import_oci(
    store: &Store,
    archive: &Path,
    name: Option<&str>,
    progress: &dyn Progress,
) -> crate::Result<ImportOutcome> {
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let ingest = store.begin(name)?;
    let staging = ingest.staging_dir().to_path_buf();
    let mut tar = tar::Archive::new(open_archive(archive)?);
    let read = |e: std::io::Error| bad(archive, format!("not a readable tar archive: {e}"));
    for entry in tar.entries().map_err(read)? {
        let mut entry = entry.map_err(read)?;
        let path = entry.path().map_err(read)?.into_owned();
        let rel = safe_entry_path(archive, &path)?;
        match entry.header().entry_type() {
            tar::EntryType::Directory => continue,
            tar::EntryType::Regular | tar::EntryType::Continuous => {}
            other => {
                return Err(bad(
                    archive,
                    format!("entry {rel} is a {other:?}, not a regular file: refused"),
                ))
            }
        }
        if rel.is_empty() {
            continue;
        }
        let dest = staging.join(stored_name(&rel));
        if let Some(d) = dest.parent() {
            crate::util::create_private_dir_all(d).map_err(Error::io_at(d))?;
        }
        let mut out = crate::util::create_new_private_file(&dest).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                bad(archive, format!("entry {rel}: {e} (twice in the archive?)"))
            } else {
                crate::store::Error::Unwritable {
                    path: dest.as_path().into(),
                    source: e,
                }
                .into()
            }
        })?;
        copy_entry(archive, &mut entry, &mut out, &dest)?;
    }

    let config_path = staging.join(OCI_DIR).join(CONFIG_DUMP);
    let config: ConfigDump = std::fs::read(&config_path)
        .map_err(|_| {
            bad(
                archive,
                "no config.dump: not a container checkpoint archive",
            )
        })
        .and_then(|b| {
            serde_json::from_slice(&b).map_err(|e| bad(archive, format!("config.dump: {e}")))
        })?;
    let runtime = match Path::new(&config.oci_runtime).file_name() {
        Some(n) if n == "runsc" => "runsc",
        _ => "runc",
    };
    let image = if runtime == "runsc" {
        "checkpoint.img"
    } else {
        "inventory.img"
    };
    if !staging.join(image).is_file() {
        return Err(bad(
            archive,
            format!(
                "no {CHECKPOINT_DIR}/{image}: the archive holds no {runtime} checkpoint images"
            ),
        ));
    }

    let sizes = Sizes::of_dir(&staging).map_err(Error::io_at(&staging))?;
    let manifest = CheckpointManifest {
        schema: manifest::SCHEMA.into(),
        schema_version: manifest::SCHEMA_VERSION,
        id: ingest.id().to_string(),
        name: name.map(str::to_string),
        started_unix_ms,
        host: HostInfo::current(),
        criu: CriuInfo {
            version: crate::dump::CriuVersion {
                major: 0,
                minor: 0,
                sublevel: 0,
            },
            path: format!("imported from {}", archive.display()),
        },
        tool_version: env!("CARGO_PKG_VERSION").to_string(),
        root_pid: 0,
        process_tree: Vec::new(),
        detect: Report {
            schema_version: crate::detect::SCHEMA_VERSION,
            pid: None,
            gpu: false,
            processes: Vec::new(),
            findings: Vec::new(),
            strategy: StrategyDecision {
                name: StrategyName::None,
                blockers: Vec::new(),
            },
            strategies: Vec::new(),
            ordered: false,
            driver_version: None,
            elapsed_ms: 0.0,
            notes: Vec::new(),
        },
        strategy: StrategyName::None,
        gpu_step: "none".into(),
        gpu: serde_json::Value::Null,
        options: OptionsRecord::default(),
        timings_ms: PhaseTimings::default(),
        sizes,
        devices: Vec::new(),
        container: Some(ContainerRecord {
            runtime: runtime.into(),
            global_args: Vec::new(),
            id: config.id.clone(),
            // Unknown here: the restore must be given one.
            bundle: PathBuf::new(),
            processes: Vec::new(),
            tcp_established: false,
            sandbox_gpu_tool: None,
            sandbox_gpu_pids: Vec::new(),
            sandbox_gpu_by_runtime: false,
        }),
        kept_network_lock: None,
    };
    let metadata = serde_json::to_value(&manifest)
        .map_err(|e| crate::store::Error::Invalid(format!("encoding the manifest: {e}")))?;
    let info = ingest.commit(metadata, progress)?;
    Ok(ImportOutcome {
        info,
        container: config.id,
        runtime: runtime.into(),
    })
}

#[cfg(test)]
mod tests;
