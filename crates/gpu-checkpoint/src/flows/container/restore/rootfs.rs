//! The root file system changes of an imported podman/CRI-O checkpoint archive (`rootfs-diff.tar`: the
//! files the container added or changed; `deleted.files`: a JSON list of the paths it removed), applied
//! to the restore's bundle before the runtime restores the container, as podman does on `restore
//! --import` (`CRApplyRootFsDiffTar`, then `CRRemoveDeletedFiles`).
//!
//! Safely: every entry is checked before anything is changed (a relative path inside the rootfs; only
//! folders, regular files and symbolic links whose target stays inside the rootfs; no existing folder on
//! the way that is a link), and nothing is written through a link. Each change is undoable: what it
//! replaces or removes is first copied into a private folder, what it creates is noted, and the
//! [`Applied`] guard puts the rootfs back as it was when dropped armed (a failed apply, a failed runtime
//! or GPU restore); a restore that succeeds disarms it. Each step is journaled beside the copies
//! (`journal.rs`), so that the guardian puts the rootfs back too if the tool dies before the restore ends.

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::{symlink, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use super::Error;

mod journal;
pub(super) use journal::undo_left;

/// Where an imported archive's files lie among the materialized images (`archive.rs` keeps them under
/// `oci/`).
const DIFF_TAR: &str = "oci/rootfs-diff.tar";
const DELETED: &str = "oci/deleted.files";

fn refused(rootfs: &Path, reason: impl Into<String>) -> crate::Error {
    Error::RootfsChanges {
        rootfs: rootfs.to_path_buf(),
        reason: reason.into(),
    }
    .into()
}

/// The bundle's root file system: `root.path` of its `config.json`, relative to the bundle or absolute.
pub(in crate::flows::container) fn rootfs_of(bundle: &Path) -> crate::Result<PathBuf> {
    let config = bundle.join("config.json");
    let spec: serde_json::Value = fs::read(&config)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        .map_err(|e| refused(bundle, format!("the bundle's config.json: {e}")))?;
    let root = spec["root"]["path"]
        .as_str()
        .ok_or_else(|| refused(bundle, "the bundle's config.json has no root.path"))?;
    Ok(bundle.join(root))
}

/// A path of the archive as a relative path inside the rootfs (a leading `/` or `./` is dropped);
/// `None` when it could leave it or names the rootfs itself.
fn inside(path: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// Whether a link at `link` (relative to the rootfs) pointing to `target` resolves inside the rootfs,
/// read as the container reads it (an absolute target starts at the rootfs).
fn link_stays_inside(link: &Path, target: &Path) -> bool {
    let mut depth: Vec<&std::ffi::OsStr> = if target.is_absolute() {
        Vec::new()
    } else {
        link.parent()
            .map(|p| p.iter().collect())
            .unwrap_or_default()
    };
    for c in target.components() {
        match c {
            Component::Normal(p) => depth.push(p),
            Component::ParentDir if depth.pop().is_none() => return false,
            _ => {}
        }
    }
    true
}

/// One change the diff makes.
enum Change {
    Dir { mode: u32 },
    File { mode: u32, data_at: u64, size: u64 },
    Link { target: PathBuf },
}

struct Entry {
    path: PathBuf,
    change: Change,
    owner: (u32, u32),
}

/// Reads and checks every entry of the diff (nothing is changed yet).
fn read_diff(tar_path: &Path, rootfs: &Path) -> crate::Result<Vec<Entry>> {
    let f = File::open(tar_path).map_err(Error::io_at(tar_path))?;
    let mut tar = tar::Archive::new(f);
    let bad = |e: std::io::Error| refused(rootfs, format!("rootfs-diff.tar is not readable: {e}"));
    let mut out = Vec::new();
    for entry in tar.entries_with_seek().map_err(bad)? {
        let entry = entry.map_err(bad)?;
        let raw = entry.path().map_err(bad)?.into_owned();
        let h = entry.header();
        let mode = h.mode().map_err(bad)? & 0o7777;
        let owner = (h.uid().map_err(bad)? as u32, h.gid().map_err(bad)? as u32);
        let Some(path) = inside(&raw) else {
            if raw
                .components()
                .all(|c| matches!(c, Component::CurDir | Component::RootDir))
            {
                continue; // the rootfs itself: its mode and owner are the bundle's, not the diff's
            }
            return Err(refused(
                rootfs,
                format!(
                    "rootfs-diff.tar: {} leaves the root file system",
                    raw.display()
                ),
            ));
        };
        let change = match h.entry_type() {
            tar::EntryType::Directory => Change::Dir { mode },
            tar::EntryType::Regular | tar::EntryType::Continuous => Change::File {
                mode,
                data_at: entry.raw_file_position(),
                size: entry.size(),
            },
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name()
                    .map_err(bad)?
                    .ok_or_else(|| refused(rootfs, "rootfs-diff.tar: a link without a target"))?
                    .into_owned();
                if !link_stays_inside(&path, &target) {
                    return Err(refused(
                        rootfs,
                        format!(
                            "rootfs-diff.tar: link {} -> {} leaves the root file system",
                            path.display(),
                            target.display()
                        ),
                    ));
                }
                Change::Link { target }
            }
            other => {
                return Err(refused(
                    rootfs,
                    format!(
                    "rootfs-diff.tar: {} is a {other:?}; only folders, files and links are applied",
                    path.display()
                ),
                ))
            }
        };
        out.push(Entry {
            path,
            change,
            owner,
        });
    }
    Ok(out)
}

/// `deleted.files`: the paths to remove, each inside the rootfs.
fn read_deleted(path: &Path, rootfs: &Path) -> crate::Result<Vec<PathBuf>> {
    let list: Vec<String> = fs::read(path)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        .map_err(|e| refused(rootfs, format!("deleted.files: {e}")))?;
    list.iter()
        .map(|p| {
            inside(Path::new(p)).ok_or_else(|| {
                refused(
                    rootfs,
                    format!("deleted.files: {p} is not a path inside the root file system"),
                )
            })
        })
        .collect()
}

/// Refuses a path any of whose existing folders on the way is a link (writing there would follow it,
/// perhaps out of the rootfs).
fn no_link_on_the_way(rootfs: &Path, rel: &Path) -> crate::Result<()> {
    let mut at = rootfs.to_path_buf();
    let parents: Vec<_> = rel.parent().map(|p| p.iter().collect()).unwrap_or_default();
    for c in parents {
        at.push(c);
        match fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(refused(
                    rootfs,
                    format!(
                        "{} is reached through the link {}: refused",
                        rel.display(),
                        at.display()
                    ),
                ))
            }
            Ok(m) if !m.is_dir() => {
                return Err(refused(
                    rootfs,
                    format!(
                        "{} is under {}, which is not a folder",
                        rel.display(),
                        at.display()
                    ),
                ))
            }
            Ok(_) => {}
            Err(_) => break, // created by the diff (its folders come first), or missing: checked again when written
        }
    }
    Ok(())
}

/// Copies `from` (a file, link or folder, never followed) to `to`.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    let m = fs::symlink_metadata(from)?;
    if m.file_type().is_symlink() {
        symlink(fs::read_link(from)?, to)?;
    } else if m.is_dir() {
        fs::create_dir(to)?;
        for e in fs::read_dir(from)? {
            let e = e?;
            copy_tree(&e.path(), &to.join(e.file_name()))?;
        }
        fs::set_permissions(to, m.permissions())?;
    } else if m.is_file() {
        fs::copy(from, to)?;
    } else {
        // A device, FIFO or socket: reading it would not copy it (a FIFO would block).
        return Err(std::io::Error::other(format!(
            "{} is a special file: not replaced or removed",
            from.display()
        )));
    }
    use std::os::unix::fs::MetadataExt;
    std::os::unix::fs::lchown(to, Some(m.uid()), Some(m.gid()))
}

fn remove_tree(path: &Path) -> std::io::Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// The changes applied to a rootfs; undone when dropped armed.
pub(super) struct Applied {
    rootfs: PathBuf,
    /// What was there before, copied: (path in the rootfs, copy).
    saved: Vec<(PathBuf, PathBuf)>,
    /// What did not exist before, in the order created.
    created: Vec<PathBuf>,
    /// The copies; kept on disk when the undo fails, for whoever repairs the rootfs.
    backup: Option<tempfile::TempDir>,
    /// The steps above, journaled in `backup` for the guardian.
    journal: journal::Journal,
    armed: bool,
}

impl Applied {
    /// Keeps the changes (the restore succeeded).
    pub(super) fn keep(mut self) {
        self.armed = false;
    }

    /// Copies away what is at `rel` before it is replaced or removed; notes it as created when nothing
    /// was there. Done once per path: the first state is the one to put back.
    fn save(&mut self, rel: &Path) -> crate::Result<()> {
        if self.created.iter().any(|p| p == rel) || self.saved.iter().any(|(p, _)| p == rel) {
            return Ok(());
        }
        let at = self.rootfs.join(rel);
        if fs::symlink_metadata(&at).is_err() {
            self.journal.created(rel).map_err(Error::io_at(&at))?;
            self.created.push(rel.to_path_buf());
            return Ok(());
        }
        let backup = self.backup.as_ref().expect("present until dropped");
        let copy = backup.path().join(self.saved.len().to_string());
        copy_tree(&at, &copy).map_err(Error::io_at(&at))?;
        self.journal.saved(rel, &copy).map_err(Error::io_at(&at))?;
        self.saved.push((rel.to_path_buf(), copy));
        Ok(())
    }

    fn write(&mut self, e: &Entry, tar: &mut File) -> crate::Result<()> {
        no_link_on_the_way(&self.rootfs, &e.path)?;
        let at = self.rootfs.join(&e.path);
        let existing = fs::symlink_metadata(&at).ok();
        if let (Change::Dir { .. }, Some(m)) = (&e.change, &existing) {
            if m.is_dir() {
                return Ok(()); // a folder that is there stays, with its contents
            }
        }
        self.save(&e.path)?;
        remove_tree(&at).map_err(Error::io_at(&at))?;
        let mode = match &e.change {
            Change::Dir { mode } => {
                fs::create_dir(&at).map_err(Error::io_at(&at))?;
                Some(*mode)
            }
            Change::File {
                mode,
                data_at,
                size,
            } => {
                // O_EXCL | O_NOFOLLOW: what was there has just been removed; never through a link.
                let mut out = fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .mode(0o600)
                    .open(&at)
                    .map_err(Error::io_at(&at))?;
                tar.seek(SeekFrom::Start(*data_at))
                    .map_err(Error::io_at(&at))?;
                let copied = std::io::copy(&mut (&mut *tar).take(*size), &mut out)
                    .map_err(Error::io_at(&at))?;
                if copied != *size {
                    return Err(refused(&self.rootfs, "rootfs-diff.tar is truncated"));
                }
                Some(*mode)
            }
            Change::Link { target } => {
                symlink(target, &at).map_err(Error::io_at(&at))?;
                None
            }
        };
        // The owner first: chown clears the set-id bits the mode may have.
        std::os::unix::fs::lchown(&at, Some(e.owner.0), Some(e.owner.1))
            .map_err(Error::io_at(&at))?;
        if let Some(mode) = mode {
            fs::set_permissions(&at, fs::Permissions::from_mode(mode))
                .map_err(Error::io_at(&at))?;
        }
        Ok(())
    }

    fn delete(&mut self, rel: &Path) -> crate::Result<()> {
        no_link_on_the_way(&self.rootfs, rel)?;
        let at = self.rootfs.join(rel);
        if fs::symlink_metadata(&at).is_err() {
            return Ok(());
        }
        self.save(rel)?;
        Ok(remove_tree(&at).map_err(Error::io_at(&at))?)
    }
}

/// Puts `rootfs` back: removes what was `created`, then copies back what was `saved`, last first.
fn undo(rootfs: &Path, created: &[PathBuf], saved: &[(PathBuf, PathBuf)]) -> std::io::Result<()> {
    // The container may have run before its restore failed (the runtime's restore resumes it; a GPU
    // restore fails after) and put a link where a folder on the way was, to make this undo remove or
    // write outside its root file system. Such a path is left as it is, and said.
    let mut left = Vec::new();
    for rel in created.iter().rev() {
        if no_link_on_the_way(rootfs, rel).is_err() {
            left.push(rel);
            continue;
        }
        remove_tree(&rootfs.join(rel))?;
    }
    for (rel, copy) in saved.iter().rev() {
        if no_link_on_the_way(rootfs, rel).is_err() {
            left.push(rel);
            continue;
        }
        let at = rootfs.join(rel);
        remove_tree(&at)?;
        copy_tree(copy, &at)?;
    }
    if left.is_empty() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!(
            "left as they are, a link or a file now on their way: {left:?}"
        )))
    }
}

impl Drop for Applied {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Err(e) = undo(&self.rootfs, &self.created, &self.saved) {
            let kept = self.backup.take().map(tempfile::TempDir::keep);
            tracing::error!(
                "putting the root file system {} back as it was failed: {e} (its earlier files are kept in {:?})",
                self.rootfs.display(),
                kept
            );
        }
    }
}

/// Applies the root file system changes found among the materialized `images` to `bundle`'s rootfs;
/// `None` when the checkpoint has none. The copies for the undo go into a private folder in `work`.
pub(super) fn apply(images: &Path, bundle: &Path, work: &Path) -> crate::Result<Option<Applied>> {
    let (diff, deleted) = (images.join(DIFF_TAR), images.join(DELETED));
    if !diff.is_file() && !deleted.is_file() {
        return Ok(None);
    }
    let rootfs = rootfs_of(bundle)?;
    if !fs::symlink_metadata(&rootfs).is_ok_and(|m| m.is_dir()) {
        return Err(refused(&rootfs, "not a folder"));
    }
    // Everything checked before anything changes.
    let entries = if diff.is_file() {
        read_diff(&diff, &rootfs)?
    } else {
        Vec::new()
    };
    let removed = if deleted.is_file() {
        read_deleted(&deleted, &rootfs)?
    } else {
        Vec::new()
    };
    for rel in entries.iter().map(|e| &e.path).chain(&removed) {
        no_link_on_the_way(&rootfs, rel)?;
    }
    let backup = tempfile::Builder::new()
        .prefix(journal::BACKUP_PREFIX)
        .tempdir_in(work)
        .map_err(Error::io_at(work))?;
    let journal =
        journal::Journal::create(backup.path(), &rootfs).map_err(Error::io_at(backup.path()))?;
    let mut applied = Applied {
        rootfs,
        saved: Vec::new(),
        created: Vec::new(),
        backup: Some(backup),
        journal,
        armed: true,
    };
    if !entries.is_empty() {
        let mut tar = File::open(&diff).map_err(Error::io_at(&diff))?;
        for e in &entries {
            applied.write(e, &mut tar)?;
            // A failure here (injected: `container.rootfs-apply=eio`) leaves nothing half-applied.
            if let Some(err) = crate::fault::io_error("container.rootfs-apply") {
                return Err(Error::io_at(&applied.rootfs)(err).into());
            }
        }
    }
    for rel in &removed {
        applied.delete(rel)?;
    }
    Ok(Some(applied))
}

#[cfg(test)]
mod tests;
