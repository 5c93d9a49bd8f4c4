//! The container flow's undo guards around the runtime's checkpoint: a paused container resumed, a
//! stopped sandbox brought back from its images.

use std::path::PathBuf;

use super::{ContainerRuntime, Error, RestoreRequest};

/// Resumes a container paused for its checkpoint when dropped, unless disarmed.
pub(super) struct ResumeGuard<'r> {
    pub(super) runtime: &'r dyn ContainerRuntime,
    pub(super) id: String,
    pub(super) armed: bool,
}

impl ResumeGuard<'_> {
    pub(super) fn resume_now(mut self) -> Result<(), Error> {
        self.armed = false;
        self.runtime.resume(&self.id)
    }

    pub(super) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for ResumeGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.runtime.resume(&self.id) {
                tracing::error!(
                    "after the failed checkpoint, resuming the container failed too: {e}"
                );
            }
        }
    }
}

/// Brings a container its runtime stopped at checkpoint time back from the images when dropped, unless
/// disarmed: the undo (and `--leave-running`) where the runtime cannot hold it paused (runsc).
pub(super) struct Revive<'r> {
    pub(super) runtime: &'r dyn ContainerRuntime,
    pub(super) id: String,
    pub(super) images: PathBuf,
    pub(super) bundle: PathBuf,
    pub(super) tcp_established: bool,
    pub(super) armed: bool,
}

impl Revive<'_> {
    pub(super) fn now(mut self) -> Result<(), Error> {
        self.armed = false;
        self.revive()
    }

    fn revive(&self) -> Result<(), Error> {
        // The stopped container still holds its id.
        self.runtime.delete(&self.id, true)?;
        self.runtime.restore(&RestoreRequest {
            id: &self.id,
            images: &self.images,
            bundle: &self.bundle,
            tcp_established: self.tcp_established,
            // The runtime's own images, in a folder (runsc).
            streamed: false,
        })
    }
}

impl Drop for Revive<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.revive() {
                tracing::error!("after the failed checkpoint, restoring the container from its images failed too: {e}");
            }
        }
    }
}
