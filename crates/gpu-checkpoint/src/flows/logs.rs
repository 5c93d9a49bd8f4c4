//! Where the flows keep CRIU logs that are not part of a checkpoint: failed dumps, and restores.
//!
//! The tool runs as root, so every place it writes must be one no other local user can steer: the store's
//! own `logs/` folder, or a per-user folder in the temporary folder that must already be private
//! (created 0700, refused when it is a link, belongs to someone else or is open to others), held open and
//! written below without following a link ([`crate::beneath`]). Log files are created new (`O_EXCL`,
//! `O_NOFOLLOW`): a planted file or link is never written through.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::beneath::Beneath;

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
    let in_store = storage.map(|s| open_logs(s, true));
    let fallback = || {
        let temp = std::env::temp_dir();
        crate::util::check_trusted_dir(&temp)?;
        let dir = fallback_logs_dir();
        crate::util::ensure_private_dir(&dir)?;
        open_logs(&dir, false)
    };
    for dir in in_store.into_iter().chain(std::iter::once_with(fallback)) {
        let dir = match dir {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!("not keeping the log {name} there: {e}");
                continue;
            }
        };
        for n in 0..100 {
            let file = match n {
                0 => name.to_string(),
                n => format!("{name}.{n}"),
            };
            match dir.create_new(&file, crate::util::FILE_MODE, nix::fcntl::OFlag::empty()) {
                Ok(mut f) => match f.write_all(&data) {
                    Ok(()) => return Some(dir.join(&file)),
                    Err(_) => {
                        let _ = dir.remove_file(&file);
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

/// The private logs folder: `STORE/logs` (`in_store`, made where missing), or the fallback itself, held
/// open; it must be a private folder of this user, reached without a link.
fn open_logs(dir: &Path, in_store: bool) -> std::io::Result<Beneath> {
    let held = if in_store {
        let store = Beneath::open(dir)?;
        match store.create_dir("logs", crate::util::DIR_MODE) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        store.subdir("logs")?
    } else {
        Beneath::open(dir)?
    };
    crate::util::check_private(&held.metadata()?, held.path())?;
    Ok(held)
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
