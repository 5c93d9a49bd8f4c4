//! The container restore: materialize the runtime's images, `restore --detach` under the id asked for,
//! then GPU restore + unlock of its GPU processes under their new host PIDs. See `mod.rs` for why.

use std::path::PathBuf;
use std::time::Instant;

use super::members::{self, pid_map};
// Applying an imported archive's root file system changes: only the restore uses it.
pub(super) mod rootfs;
pub(super) use rootfs::undo_left as undo_rootfs_left;
// The images streamed from the store into the runtime's CRIU.
mod streamed;
use super::{injected, ContainerFlow, Error, RestoreUndo, WorkDir};
use crate::fault;
use crate::flows::{ms, CheckpointManifest, ContainerRecord, Event};
use crate::freeze::{BeforeUnlock, RestoreRecord, RestoredTree};
use crate::interrupt::InterruptGuard;

/// Which checkpoint to restore, and as what.
#[derive(Debug, Clone)]
pub struct ContainerRestoreOptions {
    /// The checkpoint's id or name.
    pub checkpoint: String,
    /// The restored container's id (the checkpointed one's, or a new one).
    pub id: String,
    /// Another bundle than the checkpointed container's (its rootfs must hold the same files).
    pub bundle: Option<PathBuf>,
}

/// Timings of one container restore, in milliseconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RestoreTimings {
    /// Reading and verifying the images out of the store into the work folder (0 when streamed).
    pub fetch: f64,
    /// The runtime's restore (when streamed, with the store serving the images to its CRIU).
    pub runtime_restore: f64,
    /// The GPU step (restore + unlock); 0 without GPU state.
    pub gpu: f64,
    pub total: f64,
}

/// A finished container restore.
#[derive(Debug, Clone)]
pub struct ContainerRestoreOutcome {
    /// The checkpoint's id.
    pub checkpoint: String,
    /// The restored container's id and its init's host PID.
    pub id: String,
    pub pid: i32,
    pub timings: RestoreTimings,
    pub gpu: Option<RestoreRecord>,
    /// CRIU read the images streamed from the store (none materialized); `None` then, else why not.
    pub materialized_because: Option<String>,
}

impl ContainerRestoreOutcome {
    /// Whether the runtime's CRIU read its images streamed from the store.
    pub fn streamed(&self) -> bool {
        self.materialized_because.is_none()
    }
}

/// Kills and deletes a restored container that must not run on (its GPU state did not come back, or
/// the restore failed half-way), unmounting what the runtime left first (`oci.rs`).
struct Discard<'r> {
    runtime: &'r dyn super::ContainerRuntime,
    id: String,
    /// The work folder: what still runs there (CRIU, left by a killed `criu swrk` stand-in) is killed.
    work: PathBuf,
    armed: bool,
}

impl Drop for Discard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        super::guards::kill_leftovers(&self.work);
        if self.runtime.state(&self.id).is_err() {
            return;
        }
        if let Err(e) = self.runtime.delete(&self.id, true) {
            tracing::error!("removing the half-restored container {}: {e}", self.id);
        }
    }
}

/// A stored container checkpoint: its store entry, manifest and container record.
pub type Loaded = (
    crate::store::CheckpointInfo,
    CheckpointManifest,
    ContainerRecord,
);

/// A container checkpoint's manifest and container record; refuses a process checkpoint.
pub(super) fn load(store: &crate::store::Store, checkpoint: &str) -> crate::Result<Loaded> {
    let info = store.get(checkpoint)?;
    let manifest = CheckpointManifest::from_metadata(&info.metadata).map_err(|reason| {
        crate::restore::Error::BadManifest {
            id: info.id.clone(),
            reason,
        }
    })?;
    let Some(record) = manifest.container.clone() else {
        return Err(Error::NotAContainerCheckpoint { id: info.id }.into());
    };
    Ok((info, manifest, record))
}

impl ContainerFlow<'_> {
    /// A container checkpoint's manifest and container record; refuses a process checkpoint, and one
    /// taken with another runtime.
    pub fn find_container(&self, checkpoint: &str) -> crate::Result<Loaded> {
        let (info, manifest, record) = load(self.store, checkpoint)?;
        if record.runtime != self.runtime.name() {
            return Err(Error::WrongRuntime {
                id: info.id,
                taken: record.runtime,
                given: self.runtime.name().into(),
            }
            .into());
        }
        Ok((info, manifest, record))
    }

    /// Restores a container checkpoint; see the module documentation.
    pub fn restore(
        &mut self,
        opts: &ContainerRestoreOptions,
    ) -> crate::Result<ContainerRestoreOutcome> {
        self.restore_phased(opts, None)
    }

    /// [`ContainerFlow::restore`] as one member of a job restore: `before_unlock` is called once the
    /// GPU state is back and before the GPU processes are unlocked; a no there deletes the restored
    /// container, never unlocked.
    pub fn restore_phased(
        &mut self,
        opts: &ContainerRestoreOptions,
        before_unlock: Option<&BeforeUnlock<'_>>,
    ) -> crate::Result<ContainerRestoreOutcome> {
        let started = Instant::now();
        let interrupt = InterruptGuard::new();
        let id = opts.id.as_str();
        super::check_container_id(id)?;
        let (info, manifest, record) = self.find_container(&opts.checkpoint)?;
        match self.runtime.state(id) {
            Err(Error::NoSuchContainer { .. }) => {}
            Err(e) => return Err(e.into()),
            Ok(_) => {
                return Err(Error::Exists {
                    runtime: self.runtime.name().into(),
                    id: id.into(),
                }
                .into())
            }
        }
        // An imported checkpoint does not know where its container's files are.
        let bundle = opts.bundle.clone().unwrap_or_else(|| record.bundle.clone());
        if bundle.as_os_str().is_empty() {
            return Err(Error::NoBundle { id: info.id }.into());
        }
        let gpu_record = manifest.gpu_record()?;
        self.gpu.prepare_restore(gpu_record.as_ref())?;
        let work = WorkDir::create(self.store, &info.id)?;
        // Should this process die before the restore has succeeded, the guardian deletes what the
        // runtime restored and removes the work folder (`guards::RestoreUndo`).
        if let Some(runtime) = self.runtime.cli() {
            self.watch.tell(&Event::ContainerRestore(RestoreUndo {
                runtime,
                id: id.to_string(),
                work: work.path().to_path_buf(),
            }))?;
        }
        let materialized_because = streamed::why_not(self.runtime, &info, &bundle);
        let t = Instant::now();
        if let Some(why) = &materialized_because {
            tracing::info!("restoring from materialized images: {why}");
            self.store
                .materialize(&info.id, work.path(), self.progress)?;
        }
        let fetch = ms(t);
        fault::at("restore.before-criu");
        if interrupt.interrupted() {
            return Err(Error::Interrupted {
                signal: crate::interrupt::last_signal().unwrap_or_else(|| "a signal".into()),
                undone: "nothing was restored; the checkpoint is intact".into(),
            }
            .into());
        }

        let t = Instant::now();
        // An imported archive's root file system changes, applied before the runtime restores; put back
        // (this guard is dropped after `discard`'s) if the restore fails.
        let rootfs_changes = rootfs::apply(work.path(), &bundle, work.path())?;
        fault::at("container.rootfs-applied");
        let mut discard = Discard {
            runtime: self.runtime,
            id: id.to_string(),
            work: work.path().to_path_buf(),
            armed: true,
        };
        injected("container.runtime-restore", self.runtime)?;
        let req = super::RestoreRequest {
            id,
            images: work.path(),
            bundle: &bundle,
            tcp_established: record.tcp_established,
            streamed: materialized_because.is_none(),
        };
        if req.streamed {
            streamed::restore(self.runtime, &req, self.store, &info, self.progress)?;
        } else {
            self.runtime.restore(&req)?;
        }
        let runtime_restore = ms(t);
        let state = self.runtime.state(id)?;
        fault::at("restore.after-criu");

        let t = Instant::now();
        let gpu = match &record.sandbox_gpu_tool {
            // Frozen by the runtime itself: its restore put the state back.
            Some(_) if record.sandbox_gpu_by_runtime => None,
            // Frozen inside the sandbox: put back there, on the same guest PIDs (a failure leaves
            // no sandbox: `discard`).
            Some(tool) => {
                super::sandbox::restore(self.runtime, id, tool, &record.sandbox_gpu_pids)?;
                None
            }
            None => {
                // The GPU processes come back under new host PIDs: find each through its PID inside
                // the container.
                let now = members::members(state.pid);
                let map = pid_map(&record.processes, &now);
                let gpu_record = gpu_record.map(|r| r.with_pids(|p| map.get(&p).copied()));
                let pids: Vec<i32> = now.iter().map(|m| m.pid).collect();
                // The GPU state back, still locked: a point to inject faults at, then the caller's
                // barrier (a job restore's).
                let barrier = |root: i32| {
                    fault::at("container.gpu-restored");
                    before_unlock.map_or(Ok(()), |b| b(root))
                };
                self.gpu.finish_restore(
                    gpu_record.as_ref(),
                    &RestoredTree {
                        root_pid: state.pid,
                        pids: &pids,
                        before_unlock: Some(&barrier),
                    },
                )?
            }
        };
        let gpu_ms = ms(t);
        discard.armed = false;
        if let Err(e) = self.watch.tell(&Event::Restored) {
            tracing::warn!("telling the guardian the container restore succeeded: {e}");
        }
        if let Some(applied) = rootfs_changes {
            applied.keep();
        }
        Ok(ContainerRestoreOutcome {
            checkpoint: info.id,
            id: id.to_string(),
            pid: state.pid,
            timings: RestoreTimings {
                fetch,
                runtime_restore,
                gpu: gpu_ms,
                total: ms(started),
            },
            gpu,
            materialized_because,
        })
    }
}
