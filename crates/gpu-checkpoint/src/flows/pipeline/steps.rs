//! The steps every target's checkpoint shares around its own: the GPU freeze as a job member, the wait
//! for a job's outcome once durable, the check for a signal between steps, and the manifest's sizes.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::Error;
use crate::flows::manifest::Sizes;
use crate::flows::{NotCommitted, Phases};
use crate::freeze::{FreezeContext, GpuHook, GpuRecord};
use crate::interrupt::InterruptGuard;
use crate::store::{Store, Streamed};

/// The GPU freeze of a checkpoint driven as one member of a job: `phases.locked()` is the barrier between
/// the lock and the GPU checkpoint. The hook calls it there; a hook that does not (a test hook) has not
/// passed it (`false`): the caller calls it right after, once its thaw guard is armed, still before the
/// CPU side is touched.
pub fn freeze_phased(
    gpu: &mut dyn GpuHook,
    ctx: FreezeContext<'_>,
    phases: &dyn Phases,
) -> crate::Result<(Option<GpuRecord>, bool)> {
    let passed = AtomicBool::new(false);
    let after_lock = || {
        passed.store(true, Ordering::SeqCst);
        phases.locked()
    };
    let record = gpu
        .freeze(&FreezeContext {
            after_lock: Some(&after_lock),
            ..ctx
        })
        .map_err(|e| match e {
            // The barrier's no, as the pipeline's own error (with the barrier's reason).
            crate::freeze::Error::Aborted(reason) => Error::Aborted { reason }.into(),
            e => crate::Error::from(e),
        })?;
    Ok((record, passed.load(Ordering::SeqCst)))
}

/// A no at the lock barrier, as the pipeline's own error.
pub fn aborted_at_lock(reason: String) -> crate::Error {
    Error::Aborted { reason }.into()
}

/// A job member's checkpoint `id` is durable: waits for the job's outcome. An abort deletes `id`; in
/// doubt it is kept, as the job may have committed with it. Either is an error, on which the caller's
/// guards put the tree back as for any failure before a commit.
pub fn after_durable(phases: &dyn Phases, store: &Store, id: &str) -> crate::Result<()> {
    match phases.durable(id) {
        Ok(()) => Ok(()),
        Err(NotCommitted::Aborted(reason)) => {
            if let Err(e) = store.delete(id) {
                tracing::error!(
                    "the job aborted, and deleting its member checkpoint {id} failed: {e}"
                );
            }
            Err(Error::Aborted { reason }.into())
        }
        Err(NotCommitted::InDoubt(reason)) => Err(Error::InDoubt {
            id: id.to_string(),
            reason,
        }
        .into()),
    }
}

/// A signal came since `interrupt` was made: the caller's guards undo as it returns the error, which
/// says what that left (`undone`).
pub fn check_interrupt(interrupt: &InterruptGuard, undone: &str) -> Result<(), Error> {
    if !interrupt.interrupted() {
        return Ok(());
    }
    Err(Error::Interrupted {
        signal: crate::interrupt::last_signal().unwrap_or_else(|| "a signal".into()),
        undone: undone.into(),
    })
}

/// The sizes of the images: the files in the staging folder, plus those that came as streams.
pub(super) fn image_sizes(staging: &Path, streamed: Option<&Streamed>) -> Result<Sizes, Error> {
    let mut sizes = Sizes::of_dir(staging).map_err(|source| Error::Images {
        path: staging.to_path_buf(),
        source,
    })?;
    if let Some(st) = streamed {
        sizes.add_streamed(st.files());
    }
    Ok(sizes)
}

/// The manifest (or a part of it) as the JSON the store keeps.
pub(super) fn encode(value: &impl serde::Serialize) -> crate::Result<serde_json::Value> {
    serde_json::to_value(value)
        .map_err(|e| crate::store::Error::Invalid(format!("encoding the manifest: {e}")).into())
}
