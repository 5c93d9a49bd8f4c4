//! The container as the pipeline's checkpoint target: found through its runtime, frozen inside where it
//! is a sandbox, held paused by the runtime (or stopped by its checkpoint and brought back from the
//! images), dumped by our CRIU with the runtime's settings or by the runtime itself, and killed and
//! deleted by the runtime once durable. See `mod.rs` for the order and why.

use std::path::PathBuf;

use super::guards::{ResumeGuard, Revive};
use super::{blocked, discover, injected, link_files, CheckpointRequest, ContainerRuntime};
use super::{direct, follow, sandbox};
use super::{ContainerCheckpointOptions, Discovered, Error, WorkDir, KILL_TIMEOUT};
use crate::detect::StrategyName;
use crate::dump::{Criu, CriuVersion};
use crate::flows::manifest::{CheckpointManifest, ContainerRecord, CriuInfo};
use crate::flows::ms;
use crate::flows::pipeline::{self, CheckpointTarget, DumpContext, Dumped, Held, Prepared};
use crate::flows::runtime::{DirectDump, SandboxUndo};
use crate::flows::{Event, Watch};
use crate::proc::{Processes, TreeProcess};
use crate::store::Store;

/// A container of an OCI runtime (runc: dumped by our CRIU with runc's settings, or by `runc
/// checkpoint`; runsc: by its own checkpoint, its GPU state frozen inside the sandbox).
pub(super) struct Container<'a> {
    runtime: &'a dyn ContainerRuntime,
    procs: &'a dyn Processes,
    /// Our CRIU, for a direct dump where the runtime says how.
    criu: Option<&'a dyn Criu>,
    opts: &'a ContainerCheckpointOptions,
    /// What [`CheckpointTarget::prepare`] found.
    found: Option<Discovered>,
    criu_info: Option<CriuInfo>,
    /// The runtime freezes the sandbox's GPU state itself, handed the tool.
    by_runtime: bool,
    /// The tool inside a sandbox and the guest PIDs it freezes.
    in_sandbox: Option<(PathBuf, Vec<i32>)>,
    /// CRIU driven directly with the runtime's settings (runc).
    pub(super) direct: Option<DirectDump>,
    pids: Vec<i32>,
    process_tree: Vec<TreeProcess>,
    /// CRIU's network lock the direct dump leaves for the restore once the container is stopped
    /// (`--tcp-established`; a namespace joined by path outlives the container).
    kept_lock: Option<crate::dump::KeptNetworkLock>,
}

impl<'a> Container<'a> {
    pub(super) fn new(
        runtime: &'a dyn ContainerRuntime,
        criu: Option<&'a dyn Criu>,
        opts: &'a ContainerCheckpointOptions,
        procs: &'a dyn Processes,
    ) -> Self {
        Container {
            runtime,
            procs,
            criu,
            opts,
            found: None,
            criu_info: None,
            by_runtime: false,
            in_sandbox: None,
            direct: None,
            pids: Vec::new(),
            process_tree: Vec::new(),
            kept_lock: None,
        }
    }

    fn found(&self) -> &Discovered {
        self.found.as_ref().expect("prepared")
    }
}

impl<'a> CheckpointTarget<'a> for Container<'a> {
    fn prepare(&mut self, store: &Store) -> crate::Result<Prepared> {
        let (runtime, opts) = (self.runtime, self.opts);
        let id = opts.id.as_str();
        let found = discover(runtime, id, &opts.detect)?;
        store.check_writable()?;
        // Our CRIU's version, for the manifest; a CRIU whose check ran beside the discovery
        // (`dump::PendingCriu`) is waited for here, and a failed check stops us before anything is touched.
        self.criu_info = match self.criu {
            Some(c) => Some(CriuInfo {
                version: c.version()?,
                path: c.describe(),
            }),
            None => None,
        };
        if let Some(reason) = blocked(&found.report) {
            return Err(Error::Unsupported {
                id: id.into(),
                reason,
            }
            .into());
        }
        let from_host = runtime.gpu_from_host();
        // A runtime that freezes the sandbox's GPU state itself is handed the tool instead: nothing of
        // ours runs inside, no guest PID is recorded, and its restore puts the state back.
        self.by_runtime =
            !from_host && opts.sandbox_gpu_tool.is_some() && runtime.checkpoints_gpu_itself();
        self.in_sandbox = match &opts.sandbox_gpu_tool {
            Some(tool) if self.by_runtime => Some((tool.clone(), Vec::new())),
            Some(tool) if !from_host => Some((tool.clone(), sandbox::gpu_pids(runtime, id, tool)?)),
            _ => None,
        };
        if self.in_sandbox.is_none()
            && !from_host
            && found.report.strategy.name != StrategyName::None
        {
            return Err(Error::Unsupported {
                id: id.into(),
                reason: format!(
                    "it holds GPU state (strategy {}), and under {} the application's CUDA state lives inside the sandbox, out of reach of a freeze from the host: name a cuda-checkpoint-compatible tool inside it (docs/containers.md)",
                    found.report.strategy.name,
                    runtime.name()
                ),
            }
            .into());
        }
        // CRIU driven directly where the runtime says how (runc); asked before anything is touched.
        self.direct = match (self.criu, opts.via_runtime) {
            (Some(_), false) => runtime.direct_dump(id, found.state.pid)?,
            _ => None,
        };
        self.pids = found.processes.iter().map(|m| m.pid).collect();
        if self.direct.is_none() && opts.tcp_established && !opts.leave_running {
            direct::warn_outside_peers(&self.pids, runtime.name());
        }
        self.process_tree = self
            .pids
            .iter()
            .filter_map(|&p| {
                let s = self.procs.stat(p)?;
                Some(TreeProcess {
                    pid: p,
                    ppid: s.ppid,
                    comm: s.comm.clone(),
                    cmdline: String::new(),
                    threads: s.threads,
                })
            })
            .collect();
        let prepared = Prepared {
            root_pid: found.state.pid,
            pids: self.pids.clone(),
            stopped: Vec::new(),
            report: found.report.clone(),
            gpu_on_host: self.in_sandbox.is_none(),
        };
        self.found = Some(found);
        Ok(prepared)
    }

    fn tell(&mut self, watch: &dyn Watch) -> crate::Result<()> {
        let Some(runtime) = self
            .runtime
            .cli()
            .filter(|_| !self.runtime.can_hold_paused())
        else {
            return Ok(());
        };
        let (gpu_tool, gpu_pids) = self.in_sandbox.clone().unzip();
        watch.tell(&Event::Sandbox(SandboxUndo {
            runtime,
            id: self.opts.id.clone(),
            bundle: self.found().state.bundle.clone(),
            tcp_established: self.opts.tcp_established,
            gpu_tool,
            gpu_pids: gpu_pids.unwrap_or_default(),
        }))?;
        Ok(())
    }

    fn freeze_inside(&mut self) -> crate::Result<Option<Box<dyn Held + 'a>>> {
        // Inside a sandbox, by the tool there (its guard is dropped after the one that brings the sandbox
        // back).
        Ok(match &self.in_sandbox {
            Some((tool, guest)) if !self.by_runtime => Some(Box::new(
                sandbox::SandboxFrozen::freeze(self.runtime, &self.opts.id, tool, guest)?,
            )),
            _ => None,
        })
    }

    fn dump(&mut self, ctx: &DumpContext<'_>) -> crate::Result<Dumped<'a>> {
        let (runtime, opts) = (self.runtime, self.opts);
        let id = opts.id.as_str();
        let found = self.found.as_ref().expect("prepared");
        // The runtime's checkpoint, with the container held paused where the runtime can.
        let hold = runtime.can_hold_paused();
        let mut paused = if hold {
            ctx.watch.tell(&Event::Paused {
                resume: runtime.resume_command(id),
            })?;
            runtime.pause(id)?;
            Some(ResumeGuard {
                runtime,
                id: id.to_string(),
                armed: true,
                stopped: None,
                network: None,
            })
        } else {
            None
        };
        let hold_ms = ms(ctx.started);
        // A runtime that cannot hold the container paused stops it at its checkpoint, and the undo
        // restores it from the images: those must outlive a failed commit, which removes the staging
        // folder. They go to a work folder of ours, linked into the staging folder afterwards.
        let own_images = (!hold)
            .then(|| WorkDir::create(ctx.store, ctx.ingest.id()))
            .transpose()?;
        let images = own_images
            .as_ref()
            .map_or(ctx.ingest.staging_dir(), WorkDir::path);
        if let Some(w) = &own_images {
            ctx.watch.tell(&Event::Stopping {
                images: w.path().to_path_buf(),
            })?;
        }
        injected("container.runtime-checkpoint", runtime)?;
        let streamed = match (&self.direct, self.criu) {
            (Some(d), Some(criu)) => {
                let locks_before = if direct::leaves_stopped(opts) {
                    crate::dump::LocksBefore::of(found.state.pid)
                } else {
                    Default::default()
                };
                let at = (ctx.store, ctx.progress, ctx.ingest);
                let expected = ctx.procs.resident_bytes(&self.pids);
                let stored = direct::dump_direct(criu, d, found, (at, expected), opts)?;
                if let Some(p) = paused.as_mut().filter(|_| direct::leaves_stopped(opts)) {
                    p.stopped = Some(ctx.procs.hold(&self.pids));
                    let log = ctx.ingest.staging_dir().join(pipeline::DUMP_LOG);
                    let lock = d.options.effective_network_lock();
                    let hold =
                        crate::dump::NetworkHold::after_dump(&self.pids, &log, lock, &locks_before);
                    pipeline::tell_network(ctx.watch, &hold);
                    self.kept_lock = hold.kept();
                    p.network = Some(hold);
                }
                stored.map(Ok)
            }
            _ => {
                let in_sandbox = self.in_sandbox.as_ref();
                let req = CheckpointRequest {
                    id,
                    images,
                    leave_running: hold,
                    tcp_established: opts.tcp_established,
                    gpu_tool: in_sandbox
                        .filter(|_| self.by_runtime)
                        .map(|(tool, _)| tool.as_path()),
                };
                match runtime.followed_image().filter(|_| own_images.is_some()) {
                    Some(name) => {
                        let expected = ctx.procs.resident_bytes(&self.pids);
                        let at = (ctx.ingest, ctx.progress, expected);
                        let f = follow::checkpoint_following(runtime, &req, name, at);
                        f.dumped?;
                        // A store failure is returned once the undo below is armed.
                        Some(f.stored)
                    }
                    None => {
                        runtime.checkpoint(&req)?;
                        None
                    }
                }
            }
        };
        let revive = own_images.as_ref().map(|w| Revive {
            runtime,
            id: id.to_string(),
            images: w.path().to_path_buf(),
            bundle: found.state.bundle.clone(),
            tcp_established: opts.tcp_established,
            armed: true,
        });
        let held = Box::new(ContainerHeld {
            revive,
            _work: own_images,
            paused,
            runtime,
            procs: self.procs,
            id: id.to_string(),
            init: found.state.pid,
        });
        let streamed = streamed.transpose()?;
        if let Some(w) = &held._work {
            link_files(w.path(), ctx.ingest.staging_dir(), streamed.as_ref())?;
        }
        Ok(Dumped {
            streamed,
            held,
            hold_ms,
        })
    }

    fn describe(&mut self, manifest: &mut CheckpointManifest) -> crate::Result<()> {
        let (runtime, opts) = (self.runtime, self.opts);
        let found = self.found.take().expect("prepared");
        let (gpu_tool, gpu_pids) = self.in_sandbox.take().unzip();
        manifest.criu = self.criu_info.take().unwrap_or_else(|| CriuInfo {
            version: CriuVersion {
                major: 0,
                minor: 0,
                sublevel: 0,
            },
            path: format!("{}'s own", runtime.name()),
        });
        manifest.process_tree = std::mem::take(&mut self.process_tree);
        manifest.kept_network_lock = self.kept_lock.take();
        manifest.container = Some(ContainerRecord {
            runtime: runtime.name().to_string(),
            global_args: runtime.global_args(),
            id: opts.id.clone(),
            bundle: found.state.bundle,
            processes: found.processes,
            tcp_established: opts.tcp_established,
            sandbox_gpu_tool: gpu_tool,
            sandbox_gpu_pids: gpu_pids.unwrap_or_default(),
            sandbox_gpu_by_runtime: self.by_runtime,
        });
        Ok(())
    }

    fn undone(&self) -> &'static str {
        "the checkpoint was undone, the container runs as before and nothing was stored"
    }
}

/// The container as its checkpoint left it, until durable: paused by its runtime (resumed when dropped),
/// or stopped by the runtime's checkpoint (brought back from the images in our work folder). Fields drop
/// in order: the sandbox is restored from the images before they are removed.
struct ContainerHeld<'a> {
    revive: Option<Revive<'a>>,
    _work: Option<WorkDir>,
    paused: Option<ResumeGuard<'a>>,
    runtime: &'a dyn ContainerRuntime,
    procs: &'a dyn Processes,
    id: String,
    init: i32,
}

impl Held for ContainerHeld<'_> {
    fn release(&mut self) -> crate::Result<()> {
        // It runs on: GPU work and the container resume while the images are stored.
        if let Some(p) = self.paused.take() {
            p.resume_now()?;
        }
        if let Some(r) = self.revive.take() {
            r.now()?;
        }
        Ok(())
    }

    /// Kills and deletes the checkpointed container (as `runc checkpoint` does), waiting for its init.
    fn stop(mut self: Box<Self>, _checkpoint: &str) -> crate::Result<()> {
        if let Some(p) = self.paused.take() {
            p.disarm();
        }
        if let Some(mut r) = self.revive.take() {
            r.armed = false;
        }
        // A paused container gets SIGKILL only once thawed by the kernel; runc's `delete --force`
        // kills, thaws and removes it in one go.
        let (id, init) = (self.id.as_str(), self.init);
        self.runtime.delete(id, true)?;
        let left = crate::proc::wait_until(KILL_TIMEOUT, || {
            self.procs
                .stat(init)
                .filter(|s| !s.is_dying())
                .map(|_| init)
                .into_iter()
                .collect()
        });
        if !left.is_empty() {
            return Err(Error::Processes {
                id: id.into(),
                reason: format!("checkpoint stored, but its init (pid {init}) still runs"),
            }
            .into());
        }
        Ok(())
    }
}
