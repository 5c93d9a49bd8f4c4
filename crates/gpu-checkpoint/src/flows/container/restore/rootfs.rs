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

use super::super::archive::io;
use super::Error;

mod journal;
pub(in crate::flows::container) use journal::undo_left;

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
    let f = File::open(tar_path).map_err(io(tar_path))?;
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
            self.journal.created(rel).map_err(io(&at))?;
            self.created.push(rel.to_path_buf());
            return Ok(());
        }
        let backup = self.backup.as_ref().expect("present until dropped");
        let copy = backup.path().join(self.saved.len().to_string());
        copy_tree(&at, &copy).map_err(io(&at))?;
        self.journal.saved(rel, &copy).map_err(io(&at))?;
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
        remove_tree(&at).map_err(io(&at))?;
        let mode = match &e.change {
            Change::Dir { mode } => {
                fs::create_dir(&at).map_err(io(&at))?;
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
                    .map_err(io(&at))?;
                tar.seek(SeekFrom::Start(*data_at)).map_err(io(&at))?;
                let copied =
                    std::io::copy(&mut (&mut *tar).take(*size), &mut out).map_err(io(&at))?;
                if copied != *size {
                    return Err(refused(&self.rootfs, "rootfs-diff.tar is truncated"));
                }
                Some(*mode)
            }
            Change::Link { target } => {
                symlink(target, &at).map_err(io(&at))?;
                None
            }
        };
        // The owner first: chown clears the set-id bits the mode may have.
        std::os::unix::fs::lchown(&at, Some(e.owner.0), Some(e.owner.1)).map_err(io(&at))?;
        if let Some(mode) = mode {
            fs::set_permissions(&at, fs::Permissions::from_mode(mode)).map_err(io(&at))?;
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
        remove_tree(&at).map_err(io(&at))
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
        .map_err(io(work))?;
    let journal = journal::Journal::create(backup.path(), &rootfs).map_err(io(backup.path()))?;
    let mut applied = Applied {
        rootfs,
        saved: Vec::new(),
        created: Vec::new(),
        backup: Some(backup),
        journal,
        armed: true,
    };
    if !entries.is_empty() {
        let mut tar = File::open(&diff).map_err(io(&diff))?;
        for e in &entries {
            applied.write(e, &mut tar)?;
            // A failure here (injected: `container.rootfs-apply=eio`) leaves nothing half-applied.
            if let Some(err) = crate::fault::io_error("container.rootfs-apply") {
                return Err(io(&applied.rootfs)(err));
            }
        }
    }
    for rel in &removed {
        applied.delete(rel)?;
    }
    Ok(Some(applied))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One entry of a test diff: name, kind, data (a link's target for a link).
    type Entry<'a> = (&'a str, tar::EntryType, &'a [u8]);

    /// A bundle (`config.json` naming `rootfs`) whose rootfs holds `keep` ("old") and `bin/sh`, and
    /// images holding `oci/rootfs-diff.tar` of `entries` and `oci/deleted.files` of `deleted`.
    fn setup(entries: &[Entry<'_>], deleted: &[&str]) -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let bundle = dir.path().join("bundle");
        fs::create_dir_all(bundle.join("rootfs/bin")).unwrap();
        fs::write(
            bundle.join("config.json"),
            br#"{"root": {"path": "rootfs"}}"#,
        )
        .unwrap();
        fs::write(bundle.join("rootfs/keep"), "old").unwrap();
        fs::write(bundle.join("rootfs/bin/sh"), "sh").unwrap();
        let images = dir.path().join("images");
        fs::create_dir_all(images.join("oci")).unwrap();
        let mut b = tar::Builder::new(File::create(images.join(DIFF_TAR)).unwrap());
        for (name, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o644);
            // SAFETY: geteuid/getegid have no preconditions. Our own ids: chown to them works unprivileged.
            h.set_uid(unsafe { libc::geteuid() }.into());
            h.set_gid(unsafe { libc::getegid() }.into());
            h.set_mtime(0);
            match kind {
                tar::EntryType::Symlink | tar::EntryType::Link => {
                    h.set_size(0);
                    let target = std::str::from_utf8(data).unwrap();
                    b.append_link(&mut h, name, target).unwrap();
                }
                _ => {
                    h.set_size(data.len() as u64);
                    // Names are written raw: the tar crate refuses to write `..` itself.
                    h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
                    h.set_cksum();
                    b.append(&h, *data).unwrap();
                }
            }
        }
        b.finish().unwrap();
        fs::write(images.join(DELETED), serde_json::to_vec(deleted).unwrap()).unwrap();
        (dir, bundle, images)
    }

    /// Every path under `root` with its kind and contents (a link's target), for comparing states.
    fn snapshot(root: &Path) -> Vec<(PathBuf, String)> {
        let mut out = Vec::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let m = fs::symlink_metadata(&p).unwrap();
                let what = if m.file_type().is_symlink() {
                    format!("-> {}", fs::read_link(&p).unwrap().display())
                } else if m.is_dir() {
                    stack.push(p.clone());
                    "dir".into()
                } else if m.is_file() {
                    fs::read_to_string(&p).unwrap()
                } else {
                    "special".into()
                };
                out.push((p.strip_prefix(root).unwrap().to_path_buf(), what));
            }
        }
        out.sort();
        out
    }

    #[test]
    fn changes_apply_and_are_undone_when_dropped_armed() {
        use tar::EntryType::{Directory, Regular, Symlink};
        let (dir, bundle, images) = setup(
            &[
                ("data/", Directory, b""),
                ("data/f", Regular, b"new"),
                ("keep", Regular, b"changed"),
                ("data/l", Symlink, b"../keep"),
            ],
            &["/bin/sh"],
        );
        let rootfs = bundle.join("rootfs");
        let before = snapshot(&rootfs);
        let applied = apply(&images, &bundle, dir.path()).unwrap().unwrap();
        assert_eq!(fs::read_to_string(rootfs.join("data/f")).unwrap(), "new");
        assert_eq!(fs::read_to_string(rootfs.join("keep")).unwrap(), "changed");
        assert_eq!(
            fs::read_link(rootfs.join("data/l")).unwrap(),
            Path::new("../keep")
        );
        assert!(!rootfs.join("bin/sh").exists());
        drop(applied);
        assert_eq!(snapshot(&rootfs), before, "undone");
        // Kept: the changes stay.
        apply(&images, &bundle, dir.path()).unwrap().unwrap().keep();
        assert_eq!(fs::read_to_string(rootfs.join("keep")).unwrap(), "changed");
    }

    /// The container, run by a restore that then fails, swaps a folder the changes went into for a
    /// link out of its root file system: the undo does not follow it (the host's file of the same name
    /// stays), puts back what it safely can, and says what it left.
    #[test]
    fn the_undo_never_follows_a_link_the_container_put_on_the_way() {
        use tar::EntryType::{Directory, Regular};
        let (dir, bundle, images) = setup(
            &[
                ("data/", Directory, b""),
                ("data/f", Regular, b"new"),
                ("keep", Regular, b"changed"),
            ],
            &[],
        );
        let rootfs = bundle.join("rootfs");
        let outside = dir.path().join("host");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("f"), "the host's").unwrap();
        let applied = apply(&images, &bundle, dir.path()).unwrap().unwrap();
        fs::remove_dir_all(rootfs.join("data")).unwrap();
        std::os::unix::fs::symlink(&outside, rootfs.join("data")).unwrap();
        drop(applied);
        assert_eq!(fs::read_to_string(outside.join("f")).unwrap(), "the host's");
        assert_eq!(fs::read_to_string(rootfs.join("keep")).unwrap(), "old");
    }

    /// The tool dies with the changes applied (its guard never drops): the journal in the work folder
    /// lets the guardian put everything back, a changed file included; a journal line cut short is
    /// ignored.
    #[test]
    fn the_journal_puts_the_changes_back_without_the_guard() {
        use tar::EntryType::{Directory, Regular};
        let (dir, bundle, images) = setup(
            &[
                ("data/", Directory, b""),
                ("data/f", Regular, b"new"),
                ("keep", Regular, b"changed"),
            ],
            &["/bin/sh"],
        );
        let work = dir.path().join("work");
        fs::create_dir(&work).unwrap();
        let rootfs = bundle.join("rootfs");
        let before = snapshot(&rootfs);
        let mut applied = apply(&images, &bundle, &work).unwrap().unwrap();
        // What a death in the middle of a write leaves at the journal's end.
        let journal = applied
            .backup
            .as_ref()
            .unwrap()
            .path()
            .join("journal.jsonl");
        std::io::Write::write_all(
            &mut fs::OpenOptions::new().append(true).open(&journal).unwrap(),
            br#"{"Created":"nev"#,
        )
        .unwrap();
        let _kept_for_the_guardian = applied.backup.take().unwrap().keep();
        std::mem::forget(applied);
        assert_ne!(snapshot(&rootfs), before);
        let said = undo_left(&work);
        assert_eq!(snapshot(&rootfs), before, "put back: {said:?}");
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].contains("back as it was"), "{said:?}");
        assert!(undo_left(&dir.path().join("none")).is_empty());
    }

    #[test]
    fn bad_entries_are_refused_before_anything_changes() {
        use tar::EntryType::{Block, Link, Regular, Symlink};
        let cases: [(&str, Vec<Entry<'_>>, &[&str], &str); 6] = [
            (
                "dot-dot",
                vec![("keep", Regular, b"x"), ("../out", Regular, b"x")],
                &[],
                "leaves",
            ),
            (
                "escaping link",
                vec![("l", Symlink, b"../../etc")],
                &[],
                "leaves",
            ),
            ("hard link", vec![("h", Link, b"keep")], &[], "only folders"),
            ("device", vec![("d", Block, b"")], &[], "only folders"),
            (
                "deleted outside",
                vec![("keep", Regular, b"x")],
                &["/../x"],
                "not a path inside",
            ),
            (
                "through a link",
                vec![("keep", Regular, b"x"), ("bin2/x", Regular, b"x")],
                &[],
                "through the link",
            ),
        ];
        for (what, entries, deleted, says) in cases {
            let (dir, bundle, images) = setup(&entries, deleted);
            let rootfs = bundle.join("rootfs");
            symlink("/etc", rootfs.join("bin2")).unwrap();
            let before = snapshot(&rootfs);
            let e = apply(&images, &bundle, dir.path()).err().expect(what);
            assert!(e.to_string().contains(says), "{what}: {e}");
            assert_eq!(
                crate::exit::Classify::exit_status(&e),
                crate::ExitStatus::Usage,
                "{what}"
            );
            assert_eq!(snapshot(&rootfs), before, "{what}: nothing changed");
        }
    }

    #[test]
    fn a_failure_half_way_puts_everything_back() {
        use tar::EntryType::{Regular, Symlink};
        // The diff's own link on the way of a later entry: seen only while applying.
        let (dir, bundle, images) = setup(
            &[
                ("keep", Regular, b"changed"),
                ("a", Symlink, b"bin"),
                ("a/x", Regular, b"x"),
            ],
            &[],
        );
        let rootfs = bundle.join("rootfs");
        let before = snapshot(&rootfs);
        let e = apply(&images, &bundle, dir.path()).err().expect("refused");
        assert!(e.to_string().contains("through the link"), "{e}");
        assert_eq!(snapshot(&rootfs), before);
        assert!(!rootfs.join("bin/x").exists());
    }

    #[test]
    fn a_special_file_is_not_removed_or_replaced() {
        use tar::EntryType::Regular;
        let (dir, bundle, images) = setup(&[("keep", Regular, b"changed")], &["/fifo"]);
        let rootfs = bundle.join("rootfs");
        let fifo =
            std::ffi::CString::new(rootfs.join("fifo").into_os_string().into_encoded_bytes())
                .unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let before = snapshot(&rootfs);
        let e = apply(&images, &bundle, dir.path()).err().expect("refused");
        assert!(e.to_string().contains("special file"), "{e}");
        assert_eq!(snapshot(&rootfs), before, "the changed file put back");
    }

    #[test]
    fn links_are_judged_as_the_container_reads_them() {
        assert!(link_stays_inside(
            Path::new("etc/mtab"),
            Path::new("/proc/mounts")
        ));
        assert!(link_stays_inside(Path::new("a/b/l"), Path::new("../../x")));
        assert!(!link_stays_inside(
            Path::new("a/b/l"),
            Path::new("../../../x")
        ));
        assert_eq!(inside(Path::new("/bin/nc")).unwrap(), Path::new("bin/nc"));
        assert!(inside(Path::new("./")).is_none() && inside(Path::new("a/../b")).is_none());
    }
}
