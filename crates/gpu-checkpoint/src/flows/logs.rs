//! Where the flows keep CRIU logs that are not part of a checkpoint: failed dumps, and restores.
//!
//! The tool runs as root, so every place it writes must be one no other local user can steer: the store's
//! own `logs/` folder, or a per-user folder in the temporary folder that must already be private
//! (created 0700, refused when it is a link, belongs to someone else or is open to others). Log files are
//! created new (`O_EXCL`, `O_NOFOLLOW`): a planted file or link is never written through.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Where the flows keep CRIU logs that are not part of a checkpoint: failed dumps, and restores.
pub fn logs_dir(storage: &Path) -> PathBuf {
    storage.join("logs")
}

/// The fallback for logs that the store cannot hold (a full or read-only store, or one that is not a local
/// folder): `gpu-checkpoint-logs.UID` in the temporary folder, one per user.
pub fn fallback_logs_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    std::env::temp_dir().join(format!("gpu-checkpoint-logs.{uid}"))
}

/// Copies a log to `logs_dir(storage)/name` (0600), falling back to [`fallback_logs_dir`] (also for a store
/// that is not a local folder: `storage` `None`). A name already taken gets a `.N` suffix. Returns where it
/// went, or `None` when it could be kept nowhere.
pub fn save_log(storage: Option<&Path>, src: &Path, name: &str) -> Option<PathBuf> {
    let data = std::fs::read(src).ok()?;
    for dir in storage
        .map(logs_dir)
        .into_iter()
        .chain([fallback_logs_dir()])
    {
        let usable = match storage {
            // The store's folder is ours (0700, made by us); its logs/ must be a private folder in it.
            Some(s) if dir.starts_with(s) => crate::util::ensure_private_dir(&dir),
            _ => crate::util::check_trusted_dir(&std::env::temp_dir())
                .and_then(|()| crate::util::ensure_private_dir(&dir)),
        };
        if let Err(e) = usable {
            tracing::debug!("not keeping the log in {}: {e}", dir.display());
            continue;
        }
        for n in 0..100 {
            let dest = match n {
                0 => dir.join(name),
                n => dir.join(format!("{name}.{n}")),
            };
            match crate::util::create_new_private_file(&dest) {
                Ok(mut f) => match f.write_all(&data) {
                    Ok(()) => return Some(dest),
                    Err(_) => {
                        let _ = std::fs::remove_file(&dest);
                        break;
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(_) => break,
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// Links planted in a store's `logs/` (the folder itself, or a log's name) are never written through:
    /// root would overwrite whatever file they point at.
    #[test]
    fn logs_are_never_written_through_planted_links() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("restore.log");
        std::fs::write(&src, "CRIU's log\n").unwrap();
        let victim = dir.path().join("victim");
        std::fs::write(&victim, "root-only content\n").unwrap();

        // A link in place of a log's name: the log goes beside it.
        let store = dir.path().join("store");
        crate::util::create_private_dir_all(&logs_dir(&store)).unwrap();
        symlink(&victim, logs_dir(&store).join("ID.restore.log")).unwrap();
        let kept = save_log(Some(&store), &src, "ID.restore.log").unwrap();
        assert_eq!(kept, logs_dir(&store).join("ID.restore.log.1"));
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), "CRIU's log\n");
        assert_eq!(
            std::fs::read_to_string(&victim).unwrap(),
            "root-only content\n"
        );

        // A link in place of the logs folder: not used.
        let other = dir.path().join("other");
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::create_dir(&elsewhere).unwrap();
        symlink(&elsewhere, logs_dir(&other)).unwrap();
        let name = format!("test-{}-{}.log", std::process::id(), line!());
        let kept = save_log(Some(&other), &src, &name).unwrap();
        assert!(!kept.starts_with(&other), "{}", kept.display());
        assert!(std::fs::read_dir(&elsewhere).unwrap().next().is_none());
        std::fs::remove_file(kept).unwrap();
    }
}
