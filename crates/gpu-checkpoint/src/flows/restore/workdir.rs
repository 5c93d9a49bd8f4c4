//! The private work folders restores materialize CRIU's images into (`STORE/restore-work/ID.<random>`),
//! and the sweep that removes what killed restores left there (both on [`crate::flows::workdir`]).

use std::path::Path;

use super::Error;

/// The folder in a store that holds the restores' work folders.
const WORK_FOLDER: &str = "restore-work";

/// A private work folder for a restore's images (see [`crate::flows::workdir`]).
pub(super) struct WorkDir(crate::flows::workdir::WorkDir);

impl WorkDir {
    pub(super) fn create(storage: Option<&Path>, id: &str) -> Result<WorkDir, Error> {
        let place = crate::flows::workdir::Place {
            store: storage,
            folder: WORK_FOLDER,
            temp_prefix: "gpu-checkpoint-restore",
        };
        crate::flows::workdir::WorkDir::create(&place, id)
            .map(WorkDir)
            .map_err(|(path, source)| Error::WorkDir { path, source })
    }

    pub(super) fn path(&self) -> &Path {
        self.0.path()
    }
}

/// Removes the work folders that killed restores left in a store (their lock died with them); folders of
/// restores still running are locked and kept. Returns how many were removed. Run at the start of every
/// restore and by `gc`.
pub fn remove_stale_work_dirs(storage: &Path) -> std::io::Result<u64> {
    crate::flows::workdir::remove_stale(storage, WORK_FOLDER)
}
