//! The undo record of the root file system changes, on disk beside the copies, so that the guardian
//! (`guards::RestoreUndo`) can put the rootfs back when the tool dies (SIGKILL, the OOM killer) between
//! the changes and the end of the restore, as the tool's own [`super::Applied`] guard would.
//!
//! One JSON line per step, appended (unbuffered: it reaches the file with each write, whatever happens to
//! the tool next) before the change it allows to undo: the rootfs first, then each path created or
//! copied away. A line cut short by the tool's death is ignored: its change had not started.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The journal's name in the copies' folder (`rootfs-undo.*` in the work folder).
const JOURNAL: &str = "journal.jsonl";
/// The prefix of the copies' folder.
pub(super) const BACKUP_PREFIX: &str = "rootfs-undo.";

#[derive(Debug, serde::Serialize, serde::Deserialize)]
enum Line {
    /// The root file system changed (the first line).
    Rootfs(PathBuf),
    /// A path inside it that did not exist before.
    Created(PathBuf),
    /// A path inside it copied away before it was replaced or removed: (path, copy).
    Saved(PathBuf, PathBuf),
}

pub(super) struct Journal(File);

impl Journal {
    /// Starts the journal of changes to `rootfs` in the copies' folder `backup`.
    pub(super) fn create(backup: &Path, rootfs: &Path) -> std::io::Result<Journal> {
        let mut j = Journal(crate::util::create_new_private_file(&backup.join(JOURNAL))?);
        j.note(&Line::Rootfs(rootfs.to_path_buf()))?;
        Ok(j)
    }

    pub(super) fn created(&mut self, rel: &Path) -> std::io::Result<()> {
        self.note(&Line::Created(rel.to_path_buf()))
    }

    pub(super) fn saved(&mut self, rel: &Path, copy: &Path) -> std::io::Result<()> {
        self.note(&Line::Saved(rel.to_path_buf(), copy.to_path_buf()))
    }

    fn note(&mut self, line: &Line) -> std::io::Result<()> {
        let mut text = serde_json::to_vec(line).map_err(std::io::Error::other)?;
        text.push(b'\n');
        self.0.write_all(&text)
    }
}

/// Puts back the changes a dead tool's restore left in the root file systems journaled in `work`; says
/// what it did, one sentence each.
pub(in crate::flows::container) fn undo_left(work: &Path) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(work) else {
        return Vec::new();
    };
    let mut said = Vec::new();
    for backup in dir.flatten() {
        let name = backup.file_name();
        if !name.to_string_lossy().starts_with(BACKUP_PREFIX) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(backup.path().join(JOURNAL)) else {
            continue;
        };
        let (mut rootfs, mut created, mut saved) = (None, Vec::new(), Vec::new());
        for line in text.lines() {
            match serde_json::from_str(line) {
                Ok(Line::Rootfs(r)) => rootfs = Some(r),
                Ok(Line::Created(rel)) => created.push(rel),
                Ok(Line::Saved(rel, copy)) => saved.push((rel, copy)),
                Err(_) => break, // cut short: its change never started
            }
        }
        let Some(rootfs) = rootfs else { continue };
        said.push(match super::undo(&rootfs, &created, &saved) {
            Ok(()) => format!(
                "put the root file system {} back as it was ({} paths)",
                rootfs.display(),
                created.len() + saved.len()
            ),
            Err(e) => format!(
                "could not put the root file system {} back: {e} (its earlier files are in {})",
                rootfs.display(),
                backup.path().display()
            ),
        });
    }
    said
}
