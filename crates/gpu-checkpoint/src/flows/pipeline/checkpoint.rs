//! The checkpoint sequence (see `mod.rs` for the order and why).

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::steps::{encode, image_sizes};
use super::{
    aborted_at_lock, after_durable, check_interrupt, freeze_phased, CheckpointTarget, DumpContext,
    GpuThawGuard, Pipeline,
};
use crate::detect::{Report, StrategyDecision, StrategyName};
use crate::dump::{CriuOptions, CriuVersion};
use crate::fault;
use crate::flows::guardian::Event;
use crate::flows::manifest::{self, CheckpointManifest, CriuInfo, HostInfo};
use crate::flows::manifest::{OptionsRecord, PhaseTimings};
use crate::flows::{ms, Phases};
use crate::freeze::FreezeContext;
use crate::interrupt::InterruptGuard;
use crate::store::CheckpointInfo;

/// What every checkpoint is asked, whatever its target.
#[derive(Debug, Clone, Default)]
pub struct CheckpointCommon {
    pub name: Option<String>,
    /// Keep the tree running after the checkpoint (default: stop it once the checkpoint is durable).
    pub leave_running: bool,
}

impl CheckpointCommon {
    pub fn new(name: &Option<String>, leave_running: bool) -> Self {
        CheckpointCommon {
            name: name.clone(),
            leave_running,
        }
    }
}

/// The pipeline's timings of one checkpoint, in milliseconds.
#[derive(Debug, Clone, Default)]
pub struct Timings {
    /// The target's preparation: refusals, discovery, detect.
    pub detect: f64,
    /// The GPU step's lock + checkpoint (and inside a sandbox).
    pub freeze: f64,
    /// Holding the tree before its images were taken (a container's pause).
    pub hold: f64,
    /// The dump (when streamed, with the images stored meanwhile).
    pub dump: f64,
    /// Storing what was left and committing the manifest.
    pub write: f64,
    /// With `--leave-running`: how long the tree was held stopped ([`super::Held::paused`]).
    pub paused: f64,
    /// The pipeline continued the tree its dumper left stopped.
    pub continued: bool,
    /// Stopping the tree after the commit (0 with `--leave-running`).
    pub stop: f64,
    pub total: f64,
}

/// A finished checkpoint.
#[derive(Debug, Clone)]
pub struct Checkpointed {
    pub info: CheckpointInfo,
    pub manifest: CheckpointManifest,
    pub timings: Timings,
    /// The tree was stopped for good (false with `--leave-running`).
    pub stopped: bool,
}

impl Pipeline<'_> {
    /// Checkpoints `target`; a job member waits at `phases`' barriers and undoes everything, the stored
    /// checkpoint included, when one of them says no.
    pub fn checkpoint<'a>(
        &mut self,
        target: &mut dyn CheckpointTarget<'a>,
        opts: &CheckpointCommon,
        phases: &dyn Phases,
    ) -> crate::Result<Checkpointed> {
        let started = Instant::now();
        let started_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        // Every signal that would end this process is deferred until the pipeline has finished or undone
        // what it did; what cannot be deferred (SIGKILL) is the guardian's (`self.watch`).
        let interrupt = InterruptGuard::new();
        let undone = target.undone();
        let leave_running = opts.leave_running;

        // 1. Refuse before touching anything.
        let t = Instant::now();
        let prep = target.prepare(self.store)?;
        let mut timings = super::Timings {
            detect: ms(t),
            ..Default::default()
        };
        let ingest = self.store.begin(opts.name.as_deref())?;

        // 2. The guardian learns what it would have to put back before anything is touched; if it cannot
        // be told, nothing is.
        self.watch.tell(&Event::Checkpoint {
            pids: prep.pids.clone(),
            leave_running,
            stopped: prep.stopped.clone(),
        })?;
        target.tell(self.watch)?;
        let host_gpu = prep.gpu_on_host && prep.report.strategy.name != StrategyName::None;
        if host_gpu {
            if let Some(backend) = self.gpu.backend() {
                self.watch.tell(&Event::Gpu { backend })?;
            }
        }
        fault::at("checkpoint.before-freeze");
        check_interrupt(&interrupt, undone)?;

        // 3. Freeze. From here on every way out before the commit puts the tree back the way it was: the
        // guards undo when dropped, in the reverse order of the steps (the tree runs again before its GPU
        // state is put back: the GPU restore runs in its processes), and `ingest` removes the staging
        // folder.
        let t = Instant::now();
        let mut inside = target.freeze_inside()?;
        let host_report;
        let report = if prep.gpu_on_host {
            &prep.report
        } else {
            // Nothing the host's GPU step can reach.
            host_report = Report {
                strategy: StrategyDecision {
                    name: StrategyName::None,
                    blockers: Vec::new(),
                },
                ..prep.report.clone()
            };
            &host_report
        };
        let ctx = FreezeContext {
            root_pid: prep.root_pid,
            pids: &prep.pids,
            report,
            leave_running,
            after_lock: None,
        };
        let (mut gpu_record, passed) = freeze_phased(&mut *self.gpu, ctx, phases)?;
        let mut gpu = GpuThawGuard::new(&mut *self.gpu);
        if !passed {
            phases.locked().map_err(aborted_at_lock)?;
        }
        timings.freeze = ms(t);
        fault::at("checkpoint.after-freeze");
        check_interrupt(&interrupt, undone)?;

        // 4. The target's dump, into the store; it hands back the tree it holds.
        let t = Instant::now();
        let dumped = target.dump(&DumpContext {
            ingest: &ingest,
            store: self.store,
            progress: self.progress,
            watch: self.watch,
            procs: self.procs,
            leave_running,
            started: t,
        })?;
        let mut held = dumped.held;
        let streamed = dumped.streamed;
        timings.hold = dumped.hold_ms;
        timings.dump = ms(t) - dumped.hold_ms;
        fault::at("checkpoint.after-dump");
        check_interrupt(&interrupt, undone)?;

        // 5. `--leave-running`: the store has read every image; the tree runs on before its GPU state is
        // put back and before the commit. From here on an undo only puts the GPU state back.
        if leave_running {
            held.release()?;
            if let Some(inside) = inside.as_mut() {
                inside.release()?;
            }
            if let Some((paused, continued)) = held.paused() {
                timings.paused = paused;
                timings.continued = continued;
            }
            // GPU work resumes while the checkpoint is committed; the GPU restore + unlock timings belong
            // with the lock + checkpoint ones.
            let thaw = gpu.thaw()?;
            if let (Some(record), Some(thaw)) = (gpu_record.as_mut(), thaw) {
                record.thaw = Some(thaw);
            }
        }

        // 6. Commit.
        let mut manifest = CheckpointManifest {
            schema: manifest::SCHEMA.into(),
            schema_version: manifest::SCHEMA_VERSION,
            id: ingest.id().to_string(),
            name: opts.name.clone(),
            started_unix_ms,
            host: HostInfo::current(),
            // The target's own: the CRIU that dumped it, or its runtime ([`CheckpointTarget::describe`]).
            criu: CriuInfo {
                version: CriuVersion {
                    major: 0,
                    minor: 0,
                    sublevel: 0,
                },
                path: String::new(),
            },
            tool_version: env!("CARGO_PKG_VERSION").to_string(),
            root_pid: prep.root_pid,
            process_tree: Vec::new(),
            strategy: prep.report.strategy.name,
            detect: prep.report,
            gpu_step: gpu.name().to_string(),
            gpu: encode(&gpu_record)?,
            options: OptionsRecord {
                leave_running,
                criu: CriuOptions::default(),
            },
            timings_ms: PhaseTimings {
                detect: timings.detect,
                freeze: timings.freeze,
                dump: timings.dump,
                streamed: streamed.is_some(),
            },
            sizes: image_sizes(ingest.staging_dir(), streamed.as_ref())?,
            devices: Vec::new(),
            container: None,
            kept_network_lock: None,
        };
        target.describe(&mut manifest)?;
        let metadata = encode(&manifest)?;
        let t = Instant::now();
        // The last moment a signal can still undo the checkpoint.
        check_interrupt(&interrupt, undone)?;
        // On error the store removes the staging folder and keeps nothing: no partial checkpoint.
        let info = ingest.commit_streamed(streamed.unwrap_or_default(), metadata, self.progress)?;
        timings.write = ms(t);
        // A job checkpoint: hold everything as it is until the job commits (the guardian still undoes
        // should this process die meanwhile); an abort deletes this member's checkpoint, and the guards
        // put the tree back as for any failure before a commit.
        after_durable(phases, self.store, &info.id)?;
        // Durable: from here on a signal is deferred until the tree is stopped, as promised, and a dead
        // tool's guardian stops it.
        if let Err(e) = self.watch.tell(&Event::Durable) {
            tracing::warn!("{e}");
        }
        fault::at("checkpoint.after-commit");

        // 7. The checkpoint is durable: nothing is to be undone any more; stop the tree (migration).
        let t = Instant::now();
        let stopped = !leave_running;
        if stopped {
            gpu.committed();
            if let Some(inside) = inside {
                inside.stop(&info.id)?;
            }
            held.stop(&info.id)?;
        }
        timings.stop = ms(t);
        timings.total = ms(started);
        Ok(Checkpointed {
            info,
            manifest,
            timings,
            stopped,
        })
    }
}
