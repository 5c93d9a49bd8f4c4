//! `runc checkpoint` as an engine runs it, with the container's GPU state frozen by us around it.
//!
//! In order, and why:
//! 1. Refuse before anything is touched: detect's refusals (managed memory, MIG, MPS, CUDA IPC without
//!    an order to lock in, a PCI BAR, RDMA...), NVIDIA device files held without a CUDA context (runc's
//!    CRIU cannot dump them), and what a GPU checkpoint cannot be taken with (runc's
//!    `--pre-dump` and `--lazy-pages`: GPU state reaches host memory only at the checkpoint itself). The
//!    reason goes to runc's output and log, which the engine hands its caller (the kubelet).
//! 2. An engine may have paused (frozen) the container first (containerd's client pauses a task around
//!    its checkpoint): a frozen process cannot drain its GPU work, so it is resumed for the freeze and
//!    paused again right after, as the engine left it, before runc's checkpoint runs.
//! 3. The freeze stage locks every CUDA process of the container, then checkpoints them all, in parallel
//!    (undone on any later failure: a guard).
//! 4. Our record goes into the images folder, then the real runc checkpoints, with our CRIU.
//! 5. With `--leave-running` the GPU state is put back right after; without, it stays in the images and
//!    runc has stopped the container. Should this process die between 3 and 5, the guardian (told each
//!    step) puts the GPU state back, resuming the container first where the engine had paused it.

use std::ffi::OsString;

use super::record::{ArchiveRecord, RECORD_SCHEMA, RECORD_VERSION};
use super::{Engine, Error};
use crate::detect::{DetectOptions, StrategyName};
use crate::flows::container;
use crate::flows::guardian::EnginePaused;
use crate::flows::pipeline::GpuThawGuard;
use crate::flows::runtime::ContainerRuntime;
use crate::flows::Event;
use crate::freeze::{has_cuda_context, FreezeContext, GpuHook, ThawRecord};

/// Holds the container's GPU state frozen; put back when dropped unless committed or thawed. A
/// container the engine paused is resumed for the GPU's restore + unlock, and paused again.
struct Frozen<'a, 'g> {
    /// `None` once thawed or committed.
    gpu: Option<GpuThawGuard<'g>>,
    runtime: &'a dyn ContainerRuntime,
    id: String,
    engine_paused: bool,
}

impl Frozen<'_, '_> {
    /// GPU restore + unlock, with the container running: resumed first (and paused again after) where
    /// the engine paused it. At most once.
    fn thaw(&mut self) -> crate::Result<Option<ThawRecord>> {
        let Some(mut gpu) = self.gpu.take() else {
            return Ok(None);
        };
        if self.engine_paused {
            // Best effort: a failure before the engine's pause was taken again leaves it running.
            if let Err(e) = self.runtime.resume(&self.id) {
                tracing::debug!("resuming {}: {e}", self.id);
            }
        }
        let thawed = gpu.thaw();
        if self.engine_paused {
            self.runtime.pause(&self.id)?;
        }
        Ok(thawed?)
    }

    /// runc's checkpoint stopped the container: its GPU state is in the images.
    fn committed(mut self) {
        if let Some(gpu) = self.gpu.take() {
            gpu.committed();
        }
    }
}

impl Drop for Frozen<'_, '_> {
    fn drop(&mut self) {
        if let Err(e) = self.thaw() {
            tracing::error!("putting the GPU state of container {} back: {e}", self.id);
        }
    }
}

impl Engine<'_> {
    /// Checkpoints as `runc checkpoint` would, with the container's GPU state; returns runc's exit code.
    pub fn checkpoint(&mut self) -> crate::Result<i32> {
        let call = self.call;
        let id = call.id().unwrap_or_default().to_string();
        let images = call
            .image_path()
            .map_err(|e| Error::Io(format!("the current folder: {e}")))?;
        let state = match self.runtime.state(&id) {
            Ok(s) if matches!(s.status.as_str(), "running" | "paused") => s,
            // runc says what is wrong with it.
            _ => return self.run_runc(),
        };
        let engine_paused = state.status == "paused";
        let detect = DetectOptions {
            tree: true,
            nvml: true,
            simulator: self.config.simulated(),
            ..DetectOptions::default()
        };
        let found = container::discover_in(state, &detect)?;
        let refuse = |reason: String| Error::Refused {
            id: id.clone(),
            reason,
        };
        if let Some(reason) = container::blocked(&found.report) {
            // One line: an engine may keep only the first line of runc's output.
            let mut remedies: Vec<&str> = Vec::new();
            for b in &found.report.strategy.blockers {
                if !remedies.contains(&b.remedy.as_str()) {
                    remedies.push(&b.remedy);
                }
            }
            let reason = format!(
                "{}; what to do: {}",
                reason.replace("\n  - ", " ").replace(":  ", ": "),
                remedies.join("; ")
            );
            return Err(refuse(reason).into());
        }
        // NVIDIA device files held without a CUDA context (an NVML-only process, a child forked from a
        // CUDA process): runc's CRIU cannot dump them, and the freeze would leave them alone.
        if let Some(p) = found.report.processes.iter().find(|p| {
            matches!(p.strategy, StrategyName::CudaDriver | StrategyName::CudaCli)
                && !p.simulated
                && !has_cuda_context(&found.report, p.pid)
        }) {
            return Err(refuse(format!(
                "pid {} holds NVIDIA device files without a CUDA context (an NVML-only process, or a child \
                 forked from a CUDA process), which runc's CRIU cannot dump; what to do: close them before \
                 the checkpoint, or checkpoint the container with `gpu-checkpoint checkpoint --container`, \
                 whose CRIU reopens them (docs/criu.md)",
                p.pid
            ))
            .into());
        }
        let gpu_state = found.report.strategy.name != StrategyName::None;
        for flag in ["pre-dump", "lazy-pages"] {
            if gpu_state && call.flag(flag) {
                return Err(refuse(format!(
                    "it holds GPU state (strategy {}), and runc's --{flag} cannot carry it: GPU memory \
                     reaches host memory only at the checkpoint itself",
                    found.report.strategy.name
                ))
                .into());
            }
        }
        let pids: Vec<i32> = found.processes.iter().map(|m| m.pid).collect();
        let leave_running = call.flag("leave-running");
        let mut record = ArchiveRecord {
            schema: RECORD_SCHEMA.into(),
            version: RECORD_VERSION,
            tool_version: env!("CARGO_PKG_VERSION").into(),
            container: id.clone(),
            processes: found.processes.clone(),
            strategy: found.report.strategy.name,
            frozen_by: None,
            given_gpus: self.given_gpus(&found.state.bundle),
            gpu: None,
            leave_running,
        };
        if !gpu_state {
            record.write(&images)?;
            return self.run_runc();
        }

        // The guardian learns what to put back before anything is touched.
        self.watch.tell(&Event::Checkpoint {
            pids: pids.clone(),
            leave_running,
            stopped: Vec::new(),
        })?;
        self.watch.tell(&Event::Gpu {
            backend: self.config.gpu_backend,
        })?;
        if engine_paused {
            // Should we die, the engine resumes the container itself (the guardian waits for that).
            if let Some(cli) = self.runtime.cli() {
                self.watch.tell(&Event::EnginePaused(EnginePaused {
                    state: cli.command_line("state", &id),
                    resume: cli.command_line("resume", &id),
                    pause: cli.command_line("pause", &id),
                }))?;
            }
            self.runtime.resume(&id)?;
        }
        let ctx = FreezeContext {
            root_pid: found.state.pid,
            pids: &pids,
            report: &found.report,
            leave_running,
            after_lock: None,
        };
        let runtime = self.runtime;
        let mut hook = self.hook(None);
        let frozen_record = hook.freeze(&ctx);
        let mut frozen = Frozen {
            gpu: None,
            runtime,
            id: id.clone(),
            engine_paused,
        };
        let frozen_record = match frozen_record {
            Ok(r) => {
                frozen.gpu = Some(GpuThawGuard::new(&mut hook));
                r
            }
            // The hook put back what it had done; the container goes back to the engine's pause.
            Err(e) => {
                if engine_paused {
                    runtime.pause(&id)?;
                }
                return Err(e.into());
            }
        };
        if engine_paused {
            runtime.pause(&id)?;
        }
        crate::fault::at("engine.after-freeze");
        record.frozen_by = frozen
            .gpu
            .as_ref()
            .map(|g| format!("gpu-checkpoint, GPU backend {}", g.name()));
        record.gpu = frozen_record;
        record.write(&images)?;

        let status = (self.real)(&call.with_criu(self.config.criu.as_deref()))?;
        if status != 0 {
            // `frozen` puts the GPU state back as it drops.
            return Ok(status);
        }
        if leave_running {
            let thaw = frozen.thaw()?;
            if let (Some(g), Some(t)) = (record.gpu.as_mut(), thaw) {
                g.thaw = Some(t);
            }
            record.write(&images)?;
        } else {
            frozen.committed();
        }
        if let Err(e) = self.watch.tell(&Event::Durable) {
            tracing::warn!("{e}");
        }
        Ok(0)
    }

    /// The real runc with the engine's command line, and our CRIU.
    pub(super) fn run_runc(&self) -> crate::Result<i32> {
        let line: Vec<OsString> = self.call.with_criu(self.config.criu.as_deref());
        Ok((self.real)(&line)?)
    }
}
