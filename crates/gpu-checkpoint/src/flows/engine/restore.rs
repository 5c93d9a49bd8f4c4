//! `runc restore` as an engine runs it, of a checkpoint whose record (`gpu-checkpoint.json`) says it
//! holds GPU state.
//!
//! In order, and why:
//! 1. Before runc creates anything: this node must hold the checkpoint's GPU state (the KEP-6274
//!    contract). The checkpoint's GPUs, in order, go onto the GPUs the new container was given
//!    (`NVIDIA_VISIBLE_DEVICES` of its bundle's spec), in order, by UUID; every target must be one it was
//!    given, on this node, of the same model with as much memory, with the memory the checkpoint's
//!    processes need free; the driver must restore onto other GPUs where the map moves any, and a
//!    SIMULATED checkpoint only meets the simulator. Any "no" fails the restore with the reason, the
//!    container never created.
//! 2. The real runc restores the container (`--detach`, as every engine runs it: runc returns once the
//!    container runs), with our CRIU.
//! 3. The GPU state is restored + unlocked in its processes, found under their new host PIDs through
//!    their PIDs inside the container. A failure deletes the container (a half-restored copy must not
//!    run on); the images are never changed. Should this process die in between, the guardian deletes
//!    it.

use super::record::{self, ArchiveRecord};
use super::{Engine, Error};
use crate::flows::runtime::{members, pid_map, ContainerRuntime, RestoreUndo};
use crate::flows::Event;
use crate::freeze::{match_gpus, GpuHook, GpuInfo, RestoredTree};

/// Deletes the restored container when dropped armed: its GPU state did not come back.
struct Discard<'a> {
    runtime: &'a dyn ContainerRuntime,
    id: String,
    armed: bool,
}

impl Drop for Discard<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.runtime.delete(&self.id, true) {
                tracing::error!("deleting the half-restored container {}: {e}", self.id);
            }
        }
    }
}

impl Engine<'_> {
    /// Restores as `runc restore` would, with the checkpoint's GPU state; `None` when the checkpoint
    /// holds none (the caller hands the command line to runc as it is).
    pub fn restore(&mut self) -> crate::Result<Option<i32>> {
        let call = self.call;
        let id = call.id().unwrap_or_default().to_string();
        let images = call
            .image_path()
            .map_err(|e| Error::Io(format!("the current folder: {e}")))?;
        let Some(rec) = ArchiveRecord::read(&images)? else {
            return Ok(None);
        };
        let Some(gpu_record) = rec.gpu_state().cloned() else {
            return Ok(None);
        };
        let refuse = |reason: String| Error::RestoreRefused {
            id: id.clone(),
            reason,
        };
        if !call.flag("detach") && !call.flag("d") {
            return Err(refuse(
                "restoring GPU state needs runc's --detach (the GPU state is restored once runc \
                 returns with the container running; every engine passes it)"
                    .into(),
            )
            .into());
        }
        // 1. This node, and the GPUs the container was given.
        let bundle = call
            .bundle()
            .map_err(|e| Error::Io(format!("the current folder: {e}")))?;
        let spec = super::read_spec(&bundle)?;
        let given = record::given_gpus(&spec).map_err(&refuse)?;
        let node: Vec<GpuInfo> = crate::freeze::open(self.config.gpu_backend)
            .and_then(|d| d.gpus())
            .map_err(|e| refuse(format!("this node's GPUs: {e}")))?;
        let given = match record::resolve(&given, &node).map_err(&refuse)? {
            Some(g) if !g.is_empty() => g,
            _ => {
                return Err(refuse(format!(
                    "the checkpoint holds GPU state and the container was given no GPU ({} of its \
                     spec)",
                    record::GPU_ENV
                ))
                .into())
            }
        };
        let map = record::restore_map(&rec, &given).map_err(&refuse)?;
        // The GPUs were the container's to choose (no `--device-map` here): said without that advice.
        let mismatch = |e: crate::freeze::Error| match e {
            crate::freeze::Error::GpuMismatch(m) => {
                refuse(format!("the GPUs given do not match the checkpoint's: {m}"))
            }
            e => refuse(e.to_string()),
        };
        let pairs = match_gpus(&gpu_record, &node, Some(&map)).map_err(mismatch)?;
        if let Some(p) = pairs
            .iter()
            .find(|p| !given.iter().any(|g| g.uuid == p.new))
        {
            return Err(refuse(format!(
                "the checkpoint's GPU {} would be restored onto {}, which the container was not given",
                p.old, p.new
            ))
            .into());
        }
        let mut hook = self.hook(Some(map));
        hook.prepare_restore(Some(&gpu_record)).map_err(mismatch)?;
        if self.config.simulated() {
            eprintln!("SIMULATED GPU: restoring the simulated GPU state of container {id}");
        }

        // 2. runc's restore; the guardian deletes what it made should we die before the GPU state is
        // back (its work folder is an empty one of ours: runc's own is the engine's).
        let work =
            crate::util::private_temp_dir_in(&std::env::temp_dir(), "gpu-checkpoint-restore.")
                .map_err(|e| Error::Io(format!("a work folder: {e}")))?;
        if let Some(runtime) = self.runtime.cli() {
            self.watch.tell(&Event::ContainerRestore(RestoreUndo {
                runtime,
                id: id.clone(),
                work: work.path().to_path_buf(),
            }))?;
        }
        let status = self.run_runc()?;
        if status != 0 {
            return Ok(Some(status));
        }
        let discard = Discard {
            runtime: self.runtime,
            id: id.clone(),
            armed: true,
        };

        // 3. The GPU state, in the processes under their new host PIDs.
        let restored = self.finish(&mut hook, &rec, &gpu_record);
        let mut discard = discard;
        match restored {
            Ok(()) => discard.armed = false,
            Err(e) => {
                drop(discard);
                return Err(Error::GpuRestore {
                    id,
                    source: Box::new(e),
                }
                .into());
            }
        }
        if let Err(e) = self.watch.tell(&Event::Restored) {
            tracing::warn!("telling the guardian the restore succeeded: {e}");
        }
        Ok(Some(0))
    }

    fn finish(
        &self,
        hook: &mut dyn GpuHook,
        rec: &ArchiveRecord,
        gpu_record: &crate::freeze::GpuRecord,
    ) -> crate::Result<()> {
        let id = self.call.id().unwrap_or_default();
        let state = self.runtime.state(id)?;
        let now = members(state.pid);
        let map = pid_map(&rec.processes, &now);
        let moved = gpu_record.with_pids(|p| map.get(&p).copied());
        let pids: Vec<i32> = now.iter().map(|m| m.pid).collect();
        let barrier = |_root: i32| {
            crate::fault::at("engine.gpu-restored");
            Ok(())
        };
        hook.finish_restore(
            Some(&moved),
            &RestoredTree {
                root_pid: state.pid,
                pids: &pids,
                before_unlock: Some(&barrier),
            },
        )?;
        Ok(())
    }
}
