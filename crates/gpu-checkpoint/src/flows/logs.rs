//! Where the flows keep CRIU logs that are not part of a checkpoint: failed dumps, and restores.

use std::path::{Path, PathBuf};

/// Where the flows keep CRIU logs that are not part of a checkpoint: failed dumps, and restores.
pub fn logs_dir(storage: &Path) -> PathBuf {
    storage.join("logs")
}

/// Copies a log to `logs_dir(storage)/name` (0600), falling back to the temporary folder (also for a store
/// that is not a local folder: `storage` `None`). Returns where it went, or `None` when it could be kept
/// nowhere.
pub fn save_log(storage: Option<&Path>, src: &Path, name: &str) -> Option<PathBuf> {
    let fallback = std::env::temp_dir().join("gpu-checkpoint-logs");
    for dir in storage.map(logs_dir).into_iter().chain([fallback]) {
        if crate::util::create_private_dir_all(&dir).is_err() {
            continue;
        }
        let dest = dir.join(name);
        let copied = std::fs::read(src).and_then(|data| {
            use std::io::Write;
            let mut f = crate::util::create_private_file(&dest)?;
            f.write_all(&data)
        });
        match copied {
            Ok(()) => return Some(dest),
            Err(_) => {
                let _ = std::fs::remove_file(&dest);
            }
        }
    }
    None
}
