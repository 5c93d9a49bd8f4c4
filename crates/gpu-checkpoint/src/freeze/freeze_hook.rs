//! The freeze stage as the flows' GPU hook ([`GpuHook`]).
//!
//! The driver is opened only when a tree (or a checkpoint) actually holds GPU state, so that checkpoints
//! of CPU-only trees work on machines without any GPU driver, whatever `--gpu-backend` says.

use super::group::{GroupOptions, Skipped};
use super::hook::{FreezeContext, GpuHook, RestoreRecord, RestoredTree};
use super::step::{GpuRecord, GpuStep, ThawRecord, RECORD_SCHEMA};
use super::types::{DeviceMap, GpuPair};
use super::{Error, GpuBackend};
use crate::detect::{Report, StrategyName};
use crate::interrupt::InterruptGuard;

/// Options of the GPU step, from the command line.
#[derive(Debug, Clone)]
pub struct HookOptions {
    pub backend: GpuBackend,
    pub group: GroupOptions,
    /// `restore --device-map`.
    pub device_map: Option<DeviceMap>,
}

impl Default for HookOptions {
    fn default() -> Self {
        HookOptions {
            backend: GpuBackend::Auto,
            group: GroupOptions::default(),
            device_map: None,
        }
    }
}

/// The GPU hook of the checkpoint and restore flows.
pub struct FreezeHook {
    opts: HookOptions,
    step: Option<GpuStep>,
    /// Decided by `prepare_restore`, used by `finish_restore`.
    pairs: Vec<GpuPair>,
    name: String,
    /// Held while processes are without their GPU state: a Ctrl-C then waits for the undo.
    guard: Option<InterruptGuard>,
}

impl FreezeHook {
    pub fn new(opts: HookOptions) -> Self {
        FreezeHook {
            name: opts.backend.as_str().to_string(),
            opts,
            step: None,
            pairs: Vec::new(),
            guard: None,
        }
    }

    fn step(&mut self, backend: GpuBackend) -> Result<&mut GpuStep, Error> {
        if self.step.is_none() {
            let driver = super::open(backend)?;
            self.name = driver.backend().as_str().to_string();
            self.step = Some(GpuStep::new(driver, self.opts.group.clone()));
        }
        Ok(self.step.as_mut().expect("just set"))
    }

    /// The backend to restore with: the user's choice, which must fit how the checkpoint was taken (a
    /// simulated checkpoint is never restored onto a real GPU, nor the reverse, and `auto` never picks
    /// the simulator).
    fn restore_backend(&self, rec: &GpuRecord) -> Result<GpuBackend, Error> {
        let chosen = self.opts.backend;
        let sim_record = rec.backend == GpuBackend::Sim;
        match (sim_record, chosen) {
            (true, GpuBackend::Sim)
            | (false, GpuBackend::Auto | GpuBackend::CudaDriver | GpuBackend::CudaCli) => {
                Ok(chosen)
            }
            #[cfg(test)]
            (_, GpuBackend::Fake) => Ok(chosen),
            (true, _) => Err(Error::WrongBackend(
                "the checkpoint holds SIMULATED GPU state; restore it with --gpu-backend sim"
                    .into(),
            )),
            (false, _) => Err(Error::WrongBackend(format!(
                "the checkpoint holds real GPU state ({}); the simulator cannot restore it",
                rec.backend
            ))),
        }
    }
}

/// Whether detect saw a CUDA context in `pid` (the many `/dev/nvidiactl` mappings a context makes, or
/// NVML listing it): on driver 580 a process without one (NVML only, a child forked without exec) also
/// answers the state query with RUNNING and accepts a lock, so the query alone cannot tell
/// ([`crate::detect::context`]).
pub fn has_cuda_context(report: &Report, pid: i32) -> bool {
    crate::detect::context::has_cuda_context(report.findings_of(pid))
}

impl GpuHook for FreezeHook {
    fn name(&self) -> &str {
        &self.name
    }

    fn backend(&self) -> Option<GpuBackend> {
        // The fake driver lives in this process: nobody else can reach its state.
        #[cfg(test)]
        if self.opts.backend == GpuBackend::Fake {
            return None;
        }
        Some(self.opts.backend)
    }

    fn freeze(&mut self, ctx: &FreezeContext<'_>) -> Result<Option<GpuRecord>, Error> {
        let mut candidates = Vec::new();
        let mut skipped = Vec::new();
        for p in &ctx.report.processes {
            match p.strategy {
                StrategyName::None => {}
                StrategyName::CudaDriver | StrategyName::CudaCli => {
                    // The simulator must never stand in for a real GPU: a real CUDA process would answer
                    // "not a simulated process" and be skipped, its GPU state lost.
                    if self.opts.backend == GpuBackend::Sim && !p.simulated {
                        return Err(Error::WrongBackend(format!(
                            "pid {} holds real NVIDIA GPU state; --gpu-backend sim only handles the simulator",
                            p.pid
                        )));
                    }
                    if p.simulated || has_cuda_context(ctx.report, p.pid) {
                        candidates.push(p.pid);
                    } else {
                        skipped.push(Skipped {
                            pid: p.pid,
                            reason: "NVIDIA device files open but no GPU memory mapped: no CUDA context \
                                     (an NVML-only process such as nvidia-smi, or libcuda loaded but unused)"
                                .into(),
                        });
                    }
                }
                strategy => {
                    return Err(Error::NoGpuStep { strategy });
                }
            }
        }
        if candidates.is_empty() {
            // Nothing to lock: the tree is as locked as it gets.
            ctx.locked()?;
            if skipped.is_empty() {
                return Ok(None);
            }
            // Nothing to freeze, but say who was left alone (without opening any driver).
            for s in &skipped {
                tracing::info!("pid {} left alone: {}", s.pid, s.reason);
            }
            let rec = GpuRecord {
                schema: RECORD_SCHEMA,
                ordered: false,
                backend: self.opts.backend,
                driver_version: None,
                gpus: Vec::new(),
                lock_timeout_ms: None,
                processes: Vec::new(),
                skipped,
                timings: Default::default(),
                thaw: None,
            };
            return Ok(Some(rec));
        }
        let backend = self.opts.backend;
        if ctx.report.ordered && !self.opts.group.ordered {
            tracing::info!(
                "the tree's processes share CUDA IPC memory: locking them one after another, root first"
            );
            self.opts.group.ordered = true;
        }
        let guard = InterruptGuard::new();
        let step = self.step(backend)?;
        // A SIMULATED process and a real driver (or the SIMULATED libcuda and a real process) would
        // answer "no CUDA state" and be skipped, their GPU state lost: refuse instead.
        let simulated_driver = step.driver().simulated();
        if let Some(p) = ctx
            .report
            .processes
            .iter()
            .find(|p| candidates.contains(&p.pid) && p.simulated != simulated_driver)
        {
            return Err(Error::WrongBackend(format!(
                "pid {} is {} GPU process, but the driver loaded ({}) is {}",
                p.pid,
                if p.simulated { "a SIMULATED" } else { "a real" },
                step.driver().driver_version().unwrap_or_default(),
                if simulated_driver {
                    "SIMULATED"
                } else {
                    "a real one"
                }
            )));
        }
        let mut rec = step.freeze_with(&candidates, ctx.after_lock)?;
        self.guard = Some(guard);
        rec.skipped.splice(0..0, skipped);
        Ok(Some(rec))
    }

    fn thaw(&mut self) -> Result<Option<ThawRecord>, Error> {
        match self.step.as_mut() {
            None => Ok(None),
            Some(step) => {
                let records = step.thaw();
                self.guard = None;
                records.map(Some)
            }
        }
    }

    fn committed(&mut self) {
        if let Some(step) = self.step.as_mut() {
            step.committed();
        }
        self.guard = None;
    }

    fn prepare_restore(&mut self, record: Option<&GpuRecord>) -> Result<(), Error> {
        let Some(rec) = record.filter(|r| !r.processes.is_empty()) else {
            return Ok(());
        };
        let backend = self.restore_backend(rec)?;
        let map = self.opts.device_map.clone();
        let step = self.step(backend)?;
        let simulated_record = rec.backend == GpuBackend::Sim
            || rec
                .driver_version
                .as_deref()
                .is_some_and(|v| v.contains("SIMULATED"));
        if simulated_record != step.driver().simulated() {
            return Err(Error::WrongBackend(format!(
                "the checkpoint's GPU state was taken by {}, and the driver here is {}",
                rec.driver_version.as_deref().unwrap_or("an unknown driver"),
                step.driver().driver_version().unwrap_or_default()
            )));
        }
        self.pairs = step.prepare_restore(rec, map.as_ref())?;
        // From the CRIU restore until the GPU restore, a restored copy would be stuck without it.
        self.guard = Some(InterruptGuard::new());
        Ok(())
    }

    fn finish_restore(
        &mut self,
        record: Option<&GpuRecord>,
        restored: &RestoredTree<'_>,
    ) -> Result<Option<RestoreRecord>, Error> {
        let Some(rec) = record.filter(|r| !r.processes.is_empty()) else {
            return restored.restored().map(|()| None);
        };
        let backend = self.restore_backend(rec)?;
        let pairs = self.pairs.clone();
        let records = self
            .step(backend)?
            .finish_restore_with(rec, &pairs, &|| restored.restored());
        self.guard = None;
        let records = records?;
        Ok(Some(RestoreRecord {
            backend: self.name.clone(),
            pairs,
            processes: records,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::Report;
    use crate::Classify;
    use serde_json::{json, Value};

    fn report(procs: &[(i32, &str, bool)]) -> Report {
        report_with(procs, vec![])
    }

    fn mapping(pid: i32, path: &str, mappings: u32) -> Value {
        json!({"kind": "device-mapping", "pid": pid,
               "evidence": {"detail": "x", "path": path, "mappings": mappings}})
    }

    fn report_with(procs: &[(i32, &str, bool)], findings: Vec<Value>) -> Report {
        let processes: Vec<Value> = procs
            .iter()
            .map(|(pid, strategy, simulated)| {
                json!({"pid": pid, "comm": "x", "ppid": 1, "strategy": strategy, "simulated": simulated})
            })
            .collect();
        serde_json::from_value(json!({
            "schema_version": 1, "pid": procs[0].0, "gpu": true, "processes": processes,
            "findings": findings, "strategy": {"name": "cuda-driver", "blockers": []},
            "driver_version": null, "elapsed_ms": 0.0
        }))
        .unwrap()
    }

    fn freeze(hook: &mut FreezeHook, r: &Report) -> Result<Option<GpuRecord>, Error> {
        let pids: Vec<i32> = r.processes.iter().map(|p| p.pid).collect();
        hook.freeze(&FreezeContext {
            root_pid: pids[0],
            pids: &pids,
            report: r,
            leave_running: false,
            after_lock: None,
        })
    }

    fn sim_hook() -> FreezeHook {
        FreezeHook::new(HookOptions {
            backend: GpuBackend::Sim,
            ..HookOptions::default()
        })
    }

    #[test]
    fn cpu_only_trees_need_no_driver() {
        // `auto` would fail to open on this machine; a tree without GPU state never asks.
        let mut hook = FreezeHook::new(HookOptions::default());
        let v = freeze(&mut hook, &report(&[(1, "none", false)])).unwrap();
        assert!(v.is_none());
        assert!(hook.step.is_none());
        hook.prepare_restore(None).unwrap();
    }

    #[test]
    fn the_simulator_never_stands_in_for_a_real_gpu() {
        let e = freeze(
            &mut sim_hook(),
            &report(&[(1, "cuda-driver", false), (2, "cuda-driver", true)]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("real NVIDIA GPU state"), "{e}");
        assert_eq!(e.exit_status(), crate::ExitStatus::Usage);
    }

    #[test]
    fn only_processes_with_a_cuda_context_are_frozen() {
        // Real GPU state through the simulator is refused before anything is touched, so use the
        // context check directly: a CUDA process maps many /dev/nvidiactl pages, nvidia-smi one, a
        // child forked without exec only its parent's /dev/nvidia0 windows.
        let r = report_with(
            &[
                (1, "cuda-driver", false),
                (2, "cuda-driver", false),
                (3, "cuda-driver", false),
            ],
            vec![
                mapping(1, "/dev/nvidia0", 3),
                mapping(2, "/dev/nvidiactl", 1),
                mapping(3, "/dev/nvidiactl", 27),
            ],
        );
        assert!(!has_cuda_context(&r, 1), "a forked child's windows");
        assert!(!has_cuda_context(&r, 2), "NVML-only");
        assert!(has_cuda_context(&r, 3));
        let r = report_with(
            &[(4, "cuda-driver", false)],
            vec![mapping(4, "/dev/nvidia-uvm", 1)],
        );
        assert!(!has_cuda_context(&r, 4));
        // With only NVML-only processes nothing is frozen and no driver is opened.
        let mut hook = FreezeHook::new(HookOptions::default());
        let r = report_with(
            &[(2, "cuda-driver", false)],
            vec![mapping(2, "/dev/nvidiactl", 1)],
        );
        let rec = freeze(&mut hook, &r).unwrap().unwrap();
        assert!(rec.processes.is_empty());
        assert_eq!(rec.skipped[0].pid, 2, "left alone and reported");
        assert!(hook.step.is_none());
        // Its restore needs no driver either.
        hook.prepare_restore(Some(&rec)).unwrap();
        assert!(hook.step.is_none());
    }

    #[test]
    fn amd_gpus_are_refused() {
        let e = freeze(&mut sim_hook(), &report(&[(1, "amdgpu", false)])).unwrap_err();
        assert_eq!(e.exit_status(), crate::ExitStatus::Unsupported, "{e}");
    }

    #[test]
    fn restore_backend_must_match_how_the_checkpoint_was_taken() {
        let rec = |backend: GpuBackend| GpuRecord {
            schema: RECORD_SCHEMA,
            ordered: false,
            backend,
            driver_version: None,
            gpus: vec![],
            lock_timeout_ms: None,
            processes: vec![],
            skipped: vec![],
            timings: Default::default(),
            thaw: None,
        };
        let with = |b: GpuBackend| {
            FreezeHook::new(HookOptions {
                backend: b,
                ..HookOptions::default()
            })
        };
        use GpuBackend::{Auto, CudaCli, CudaDriver, Sim};
        // (asked on restore, recorded at the checkpoint, accepted)
        for (asked, recorded, ok) in [
            (Auto, Sim, false),
            (CudaDriver, Sim, false),
            (Sim, Sim, true),
            (Sim, CudaDriver, false),
            (Auto, CudaCli, true),
        ] {
            let got = with(asked).restore_backend(&rec(recorded));
            assert_eq!(got.is_ok(), ok, "{asked:?} for {recorded:?}");
        }
        // A record from a newer gpu-checkpoint is refused, not misread.
        let newer = json!({"schema": RECORD_SCHEMA + 1});
        assert!(matches!(
            GpuRecord::from_manifest(&newer),
            Err(Error::Record(_))
        ));
    }
}
