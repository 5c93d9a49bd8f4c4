//! The GPU step's undo as a guard: the pipeline's, whatever dumps the processes after the freeze (CRIU,
//! a container runtime), and the engines' wrapper's around runc's own checkpoint.

use crate::freeze::{GpuHook, ThawRecord};

/// Puts the GPU state [`GpuHook::freeze`] took back when dropped (GPU restore + unlock), unless
/// [`GpuThawGuard::thaw`] already did (`--leave-running`) or the checkpoint was
/// [`GpuThawGuard::committed`].
pub struct GpuThawGuard<'g> {
    gpu: &'g mut dyn GpuHook,
    /// The hook still holds frozen state: no thaw or commit yet.
    armed: bool,
}

impl<'g> GpuThawGuard<'g> {
    /// Guards the state a successful [`GpuHook::freeze`] of `gpu` took.
    pub fn new(gpu: &'g mut dyn GpuHook) -> Self {
        GpuThawGuard { gpu, armed: true }
    }

    /// The hook's name, for the manifest (known once `freeze` has chosen a backend).
    pub fn name(&self) -> &str {
        self.gpu.name()
    }

    /// `--leave-running`: GPU restore + unlock right after the dump, so that GPU work resumes while the
    /// images are stored. The hook is thawed at most once: after this, failed or not, nothing is left
    /// for the drop to put back, and an error is the checkpoint's own.
    pub fn thaw(&mut self) -> Result<Option<ThawRecord>, crate::freeze::Error> {
        self.armed = false;
        self.gpu.thaw()
    }

    /// The checkpoint is durable and the tree is about to be killed (migration): its GPU state stays
    /// checkpointed, in the checkpoint.
    pub fn committed(mut self) {
        if std::mem::take(&mut self.armed) {
            self.gpu.committed();
        }
    }
}

impl Drop for GpuThawGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        // The checkpoint's own error is what the user must see; a failure here is logged next to it.
        if let Err(e) = self.gpu.thaw() {
            tracing::error!(
                "after the failed checkpoint, putting the GPU state back failed too: {e}"
            );
        }
    }
}
