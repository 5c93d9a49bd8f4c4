//! The container restore: materialize the runtime's images, `restore --detach` under the id asked for,
//! then GPU restore + unlock of its GPU processes under their new host PIDs. See `mod.rs` for why.

use std::path::{Path, PathBuf};
use std::time::Instant;

// Applying an imported archive's root file system changes: only the restore uses it.
pub(super) mod rootfs;
// The images streamed from the store into the runtime's CRIU.
mod streamed;
use super::{injected, ContainerFlow, Error, RestoreUndo, WorkDir};
use crate::fault;
use crate::flows::pipeline::Discard as PipelineDiscard;
use crate::flows::pipeline::{Found, GpuRestore, GpuStep, RestoreContext, RestoreTarget, Restored};
use crate::flows::runtime::{members, pid_map, ContainerRuntime};
use crate::flows::{ms, CheckpointManifest, ContainerRecord, Event, Watch};
use crate::freeze::{BeforeUnlock, RestoreRecord, RestoredTree};

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
        kill_leftovers(&self.work);
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

/// A container checkpoint's manifest and container record; refuses a process checkpoint, and one taken
/// with another runtime than `runtime`.
fn find_container(
    store: &crate::store::Store,
    runtime: &dyn ContainerRuntime,
    checkpoint: &str,
) -> crate::Result<Loaded> {
    let (info, manifest, record) = load(store, checkpoint)?;
    if record.runtime != runtime.name() {
        return Err(Error::WrongRuntime {
            id: info.id,
            taken: record.runtime,
            given: runtime.name().into(),
        }
        .into());
    }
    Ok((info, manifest, record))
}

impl ContainerFlow<'_> {
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
        let mut target = Restore::new(self.runtime, opts);
        let out = self.pipeline().restore(&mut target, before_unlock)?;
        let t = out.timings;
        Ok(ContainerRestoreOutcome {
            checkpoint: out.id,
            id: opts.id.clone(),
            pid: out.pid,
            timings: RestoreTimings {
                fetch: t.fetch,
                runtime_restore: t.restore,
                gpu: t.gpu,
                total: t.total,
            },
            gpu: out.gpu,
            materialized_because: target.materialized_because,
        })
    }
}

/// A container its runtime restores from the checkpoint's images: the pipeline's restore target for
/// [`ContainerFlow::restore`].
struct Restore<'a> {
    runtime: &'a dyn ContainerRuntime,
    opts: &'a ContainerRestoreOptions,
    /// The checkpoint's container record, and the bundle it is restored into.
    record: Option<ContainerRecord>,
    bundle: PathBuf,
    work: Option<WorkDir>,
    /// Why the images were materialized for the runtime's CRIU, not streamed (`None`: streamed).
    materialized_because: Option<String>,
}

impl<'a> Restore<'a> {
    fn new(runtime: &'a dyn ContainerRuntime, opts: &'a ContainerRestoreOptions) -> Self {
        Restore {
            runtime,
            opts,
            record: None,
            bundle: PathBuf::new(),
            work: None,
            materialized_because: None,
        }
    }

    fn record(&self) -> &ContainerRecord {
        self.record.as_ref().expect("found")
    }
}

impl<'a> RestoreTarget<'a> for Restore<'a> {
    fn find(
        &mut self,
        store: &crate::store::Store,
    ) -> crate::Result<(crate::store::CheckpointInfo, CheckpointManifest)> {
        let id = self.opts.id.as_str();
        super::check_container_id(id)?;
        let (info, manifest, record) = find_container(store, self.runtime, &self.opts.checkpoint)?;
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
        self.bundle = self
            .opts
            .bundle
            .clone()
            .unwrap_or_else(|| record.bundle.clone());
        if self.bundle.as_os_str().is_empty() {
            return Err(Error::NoBundle { id: info.id }.into());
        }
        self.record = Some(record);
        Ok((info, manifest))
    }

    fn prepare(&mut self, found: &Found<'_>) -> crate::Result<PathBuf> {
        let info = found.info;
        let work = WorkDir::create(found.store, &info.id)?;
        let path = work.path().to_path_buf();
        self.work = Some(work);
        self.materialized_because = streamed::why_not(self.runtime, info, &self.bundle);
        Ok(path)
    }

    fn tell(&mut self, watch: &dyn Watch, work: &Path) -> crate::Result<()> {
        // Should this process die before the restore has succeeded, the guardian deletes what the
        // runtime restored and removes the work folder (`undo_restore`).
        if let Some(runtime) = self.runtime.cli() {
            watch.tell(&Event::ContainerRestore(RestoreUndo {
                runtime,
                id: self.opts.id.clone(),
                work: work.to_path_buf(),
            }))?;
        }
        Ok(())
    }

    fn fetch(&mut self, ctx: &RestoreContext<'_>) -> crate::Result<f64> {
        let t = Instant::now();
        if let Some(why) = &self.materialized_because {
            tracing::info!("restoring from materialized images: {why}");
            ctx.store
                .materialize(&ctx.info.id, ctx.work, ctx.progress)?;
        }
        Ok(ms(t))
    }

    fn restore(
        &mut self,
        ctx: &RestoreContext<'_>,
        _: &mut GpuStep<'_>,
    ) -> crate::Result<Restored<'a>> {
        let (runtime, id, work) = (self.runtime, self.opts.id.as_str(), ctx.work);
        // An imported archive's root file system changes, applied before the runtime restores; put back
        // (this guard is dropped after `discard`'s) if the restore fails.
        let rootfs = rootfs::apply(work, &self.bundle, work)?;
        fault::at("container.rootfs-applied");
        let discard = Discard {
            runtime,
            id: id.to_string(),
            work: work.to_path_buf(),
            armed: true,
        };
        injected("container.runtime-restore", runtime)?;
        let req = super::RestoreRequest {
            id,
            images: work,
            bundle: &self.bundle,
            tcp_established: self.record().tcp_established,
            streamed: self.materialized_because.is_none(),
        };
        if req.streamed {
            streamed::restore(runtime, &req, ctx.store, ctx.info, ctx.progress)?;
        } else {
            runtime.restore(&req)?;
        }
        let state = runtime.state(id)?;
        Ok(Restored {
            root_pid: state.pid,
            fetch_ms: 0.0,
            discard: Box::new(Discarded { discard, rootfs }),
        })
    }

    fn restore_gpu(&mut self, step: GpuRestore<'_>) -> crate::Result<Option<RestoreRecord>> {
        let (runtime, id, record) = (self.runtime, self.opts.id.as_str(), self.record());
        let (root_pid, before_unlock) = (step.root_pid, step.before_unlock);
        match &record.sandbox_gpu_tool {
            // Frozen by the runtime itself: its restore put the state back.
            Some(_) if record.sandbox_gpu_by_runtime => Ok(None),
            // Frozen inside the sandbox: put back there, on the same guest PIDs (a failure leaves
            // no sandbox: `discard`).
            Some(tool) => {
                super::sandbox::restore(runtime, id, tool, &record.sandbox_gpu_pids)?;
                Ok(None)
            }
            None => {
                // The GPU processes come back under new host PIDs: find each through its PID inside
                // the container.
                let now = members(root_pid);
                let map = pid_map(&record.processes, &now);
                let gpu_record = step.record.map(|r| r.with_pids(|p| map.get(&p).copied()));
                let pids: Vec<i32> = now.iter().map(|m| m.pid).collect();
                // The GPU state back, still locked: a point to inject faults at, then the caller's
                // barrier (a job restore's).
                let barrier = |root: i32| {
                    fault::at("container.gpu-restored");
                    before_unlock.map_or(Ok(()), |b| b(root))
                };
                Ok(step.gpu.finish_restore(
                    gpu_record.as_ref(),
                    &RestoredTree {
                        root_pid,
                        pids: &pids,
                        before_unlock: Some(&barrier),
                    },
                )?)
            }
        }
    }

    fn finished(&mut self, watch: &dyn Watch) {
        if let Err(e) = watch.tell(&Event::Restored) {
            tracing::warn!("telling the guardian the container restore succeeded: {e}");
        }
    }
}

/// The restored container and the root file system changes applied for it: the container deleted,
/// then the changes put back, when dropped unless kept.
struct Discarded<'r> {
    discard: Discard<'r>,
    rootfs: Option<rootfs::Applied>,
}

impl PipelineDiscard for Discarded<'_> {
    fn keep(mut self: Box<Self>) {
        self.discard.armed = false;
        if let Some(applied) = self.rootfs.take() {
            applied.keep();
        }
    }
}

/// How long the guardian waits for the runtime's restore the dead tool left (with runc: runc, our
/// `criu swrk` stand-in and CRIU, which fail once the store's image socket is gone, or finish) before
/// killing what is left of it.
const RESTORE_LET_GO: std::time::Duration = std::time::Duration::from_secs(60);

/// Undoes the half-done restore (see the type); says what it did.
pub(super) fn undo_restore(undo: &RestoreUndo) -> String {
    let mut said = Vec::new();
    let left = crate::proc::wait_until(RESTORE_LET_GO, || restoring(undo));
    let killed = kill_trees(&left) + kill_leftovers(&undo.work);
    if killed > 0 {
        said.push(format!(
            "killed what was left of the runtime's restore ({killed} processes)"
        ));
    }
    // Before anything is deleted: what the runtime left mounted (also where it knows no container).
    super::unmount_under(&undo.runtime.state_dir(&undo.id));
    match undo.runtime.state(&undo.id) {
        Ok(_) => match undo.runtime.delete(&undo.id, true) {
            Ok(()) => said.push(format!("deleted the half-restored container {}", undo.id)),
            Err(e) => said.push(format!(
                "could not delete the half-restored container {}: {e}",
                undo.id
            )),
        },
        Err(Error::NoSuchContainer { .. }) => {}
        Err(e) => said.push(format!("cannot ask for container {}: {e}", undo.id)),
    }
    // An imported archive's root file system changes, journaled in the work folder (nothing runs on
    // the rootfs any more).
    said.extend(rootfs::undo_left(&undo.work));
    super::unmount_under(&undo.work);
    match std::fs::remove_dir_all(&undo.work) {
        Ok(()) => said.push(format!("removed {}", undo.work.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => said.push(format!("could not remove {}: {e}", undo.work.display())),
    }
    said.push("the checkpoint is intact".into());
    said.join("; ")
}

/// What still works on the restore: the runtime's commands on the id (any of its global flags: runc
/// is given our stand-in as its `--criu`), and whatever runs in the work folder (CRIU, run there by
/// the stand-in, which outlives a killed runc).
fn restoring(undo: &RestoreUndo) -> Vec<i32> {
    let program = &undo.runtime.argv()[..1];
    let mut pids = super::guards::runtime_commands(program, &undo.id);
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return pids;
    };
    pids.extend(
        dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                std::fs::read_link(format!("/proc/{pid}/cwd"))
                    .is_ok_and(|cwd| cwd.starts_with(&undo.work))
            }),
    );
    pids.retain(|&p| crate::proc::is_alive(p));
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Kills the trees rooted at `roots`; returns how many processes they held.
fn kill_trees(roots: &[i32]) -> usize {
    let tree: Vec<i32> = roots
        .iter()
        .flat_map(|&p| crate::proc::process_tree(p))
        .map(|p| p.pid)
        .collect();
    crate::proc::kill_tree(&tree, std::time::Duration::from_secs(10));
    tree.len()
}

/// Kills what a failed or abandoned restore left running beside its runtime: CRIU (run in the work folder
/// by runc's `criu swrk` stand-in, which goes on if the stand-in is killed) with the tasks it is
/// restoring, and a tree CRIU finished restoring that the runtime never took (its init's PID in the
/// work folder's pidfile; killing a PID namespace's init kills the namespace). Only processes that
/// started after this one (the tool, or the guardian started before the restore): a PID reused since
/// is left alone. Returns how many processes were killed.
pub(super) fn kill_leftovers(work: &std::path::Path) -> usize {
    let me = crate::proc::stat(std::process::id() as i32).map_or(u64::MAX, |s| s.start_ticks);
    let ours =
        |pid: i32| crate::proc::stat(pid).is_some_and(|s| !s.is_dying() && s.start_ticks >= me);
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut roots: Vec<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(work))
        })
        .collect();
    let pidfile = work.join(crate::dump::swrk_proxy::PIDFILE);
    if let Some(pid) = std::fs::read_to_string(pidfile)
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
    {
        roots.push(pid);
    }
    roots.retain(|&p| p != std::process::id() as i32 && ours(p));
    let killed = kill_trees(&roots);
    if killed > 0 {
        tracing::warn!("killed {killed} process(es) left by the failed restore");
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_runs_in_the_work_folder_is_killed_and_an_older_pidfile_process_is_not() {
        let work = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .current_dir(work.path())
            .spawn()
            .unwrap();
        // PID 1 started before this process: a pidfile naming it (a PID reused since) is not acted on.
        std::fs::write(work.path().join(crate::dump::swrk_proxy::PIDFILE), "1\n").unwrap();
        assert_eq!(kill_leftovers(work.path()), 1);
        let st = child.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(9));
        assert_eq!(kill_leftovers(work.path()), 0);
    }
}
