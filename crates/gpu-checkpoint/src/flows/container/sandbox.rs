//! The GPU freeze inside a gVisor sandbox: under runsc the application's CUDA state lives in the
//! sentry, out of reach of the host driver, so a cuda-checkpoint-compatible tool is run inside the
//! sandbox (`runsc exec`, [`CudaCli::wrapped`]) on the sandbox's own (guest) PIDs. Guest PIDs survive
//! runsc's checkpoint and restore unchanged, so they are recorded as they are and never mapped.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{ContainerRuntime, Error};
use crate::freeze::cuda_cli::CudaCli;
use crate::freeze::{GpuDriver, ProcessState};

/// How long a lock inside the sandbox may wait for running GPU work.
const LOCK_TIMEOUT: Duration = Duration::from_secs(10);

/// The tool inside sandbox `id`, run through the runtime's `exec`.
pub(super) fn tool(
    runtime: &dyn ContainerRuntime,
    id: &str,
    path: &Path,
) -> Result<CudaCli, Error> {
    let wrapper = runtime.exec_prefix(id).ok_or_else(|| Error::Unsupported {
        id: id.into(),
        reason: format!(
            "{} cannot run a command inside the container",
            runtime.name()
        ),
    })?;
    Ok(CudaCli::wrapped(wrapper, path))
}

/// The guest PIDs of sandbox `id` that hold CUDA state the tool can checkpoint (state `running`).
pub(super) fn gpu_pids(
    runtime: &dyn ContainerRuntime,
    id: &str,
    path: &Path,
) -> crate::Result<Vec<i32>> {
    let cli = tool(runtime, id, path)?;
    // A process without CUDA state is one the tool refuses: not ours to freeze.
    Ok(runtime
        .guest_pids(id)?
        .into_iter()
        .filter(|&p| cli.state(p).ok() == Some(ProcessState::Running))
        .collect())
}

/// GPU state checkpointed inside a sandbox: restored and unlocked there when dropped, unless disarmed.
/// Declared before the guard that brings a stopped sandbox back, so that it runs after it.
pub(super) struct SandboxFrozen<'r> {
    runtime: &'r dyn ContainerRuntime,
    id: String,
    path: PathBuf,
    /// Guest PIDs locked (and those of them checkpointed).
    locked: Vec<i32>,
    checkpointed: Vec<i32>,
    armed: bool,
}

impl<'r> SandboxFrozen<'r> {
    /// Locks then checkpoints `pids` inside sandbox `id`; a failure puts back what was done.
    pub(super) fn freeze(
        runtime: &'r dyn ContainerRuntime,
        id: &str,
        path: &Path,
        pids: &[i32],
    ) -> crate::Result<Self> {
        let cli = tool(runtime, id, path)?;
        let mut frozen = SandboxFrozen {
            runtime,
            id: id.into(),
            path: path.into(),
            locked: Vec::new(),
            checkpointed: Vec::new(),
            armed: true,
        };
        for &p in pids {
            cli.lock(p, Some(LOCK_TIMEOUT))?;
            frozen.locked.push(p);
        }
        // Where a test kills the tool with the sandbox's GPU state locked (the guardian's case).
        crate::fault::at("container.sandbox-locked");
        for &p in pids {
            cli.checkpoint(p)?;
            frozen.checkpointed.push(p);
        }
        Ok(frozen)
    }

    fn put_back(&self) -> crate::Result<()> {
        let cli = tool(self.runtime, &self.id, &self.path)?;
        for &p in &self.checkpointed {
            cli.restore(p, &[])?;
        }
        for &p in &self.locked {
            cli.unlock(p)?;
        }
        Ok(())
    }
}

impl crate::flows::pipeline::Held for SandboxFrozen<'_> {
    /// Restores and unlocks now (the sandbox runs on: `--leave-running`).
    fn release(&mut self) -> crate::Result<()> {
        if !std::mem::take(&mut self.armed) {
            return Ok(());
        }
        self.put_back()
    }

    /// The checkpoint is durable: the GPU state stays in it.
    fn stop(mut self: Box<Self>, _checkpoint: &str) -> crate::Result<()> {
        self.armed = false;
        Ok(())
    }
}

impl Drop for SandboxFrozen<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.put_back() {
                tracing::error!("after the failed checkpoint, putting the GPU state back inside sandbox {} failed too: {e}", self.id);
            }
        }
    }
}

/// Restores and unlocks the GPU state of `pids` inside the restored sandbox `id`.
pub(super) fn restore(
    runtime: &dyn ContainerRuntime,
    id: &str,
    path: &Path,
    pids: &[i32],
) -> crate::Result<()> {
    let cli = tool(runtime, id, path)?;
    for &p in pids {
        cli.restore(p, &[])?;
    }
    for &p in pids {
        cli.unlock(p)?;
    }
    Ok(())
}
