//! `gpu-checkpoint agent`: one per node, in the foreground; registers in etcd and carries out the job
//! operations' local parts with the single-node flows (detect, GPU lock + checkpoint, CRIU, store;
//! restore), until SIGTERM or SIGINT.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use gpu_checkpoint::checkpoint::CheckpointOptions;
use gpu_checkpoint::dump::{discover, CriuOptions, CriuRpc};
use gpu_checkpoint::flows::cluster::{
    run_agent, AgentOptions, Coordinator, JobManifest, MemberWork, Task,
};
use gpu_checkpoint::flows::container::{
    ContainerCheckpointOptions, ContainerFlow, ContainerRestoreOptions, OciCli, RuntimeKind,
};
use gpu_checkpoint::flows::{CheckpointManifest, Flow, ImageTransfer, Phases};
use gpu_checkpoint::freeze::{
    Backend, BeforeUnlock, DeviceMap, FreezeHook, GroupOptions, HookOptions,
};
use gpu_checkpoint::interrupt::InterruptGuard;
use gpu_checkpoint::restore::Target;
use gpu_checkpoint::store::{NoProgress, Store, StoreOptions};

use super::criu_opts::CriuArgs;
use super::cuda::GpuArgs;
use super::job::EtcdArgs;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    /// This node's name, as `job add --node` names it.
    #[arg(long)]
    pub node: String,
    /// The store the members' checkpoints go to (a folder; shared by the nodes, or each its own).
    #[arg(long, env = "GPU_CHECKPOINT_STORAGE")]
    pub storage: PathBuf,
    /// The CRIU binary to use (as `checkpoint --criu`).
    #[arg(long, value_name = "PATH")]
    pub criu: Option<PathBuf>,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// The agent's etcd lease: how long after this agent dies coordinators abort what it was part of.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub lease_ttl: Duration,
    #[command(flatten)]
    pub criu_opts: CriuArgs,
    /// The container runtime of the members given by container (`job add --container`): `runc` or
    /// `runsc`, as `checkpoint --runtime`.
    #[arg(long, value_name = "runc|runsc", default_value = "runc")]
    pub runtime: RuntimeKind,
    /// That runtime's state folder (its global `--root`), where it is not the default.
    #[arg(long, value_name = "DIR")]
    pub runtime_root: Option<PathBuf>,
}

/// The members' local work: the checkpoint and restore flows, each call with its own GPU hook and
/// guardian, on this node's store.
struct LocalWork {
    criu: CriuRpc,
    store: Store,
    backend: Backend,
    criu_options: gpu_checkpoint::dump::CriuOptions,
    /// The CRIU binary (runc's `--criu`).
    criu_path: PathBuf,
    runtime: RuntimeKind,
    runtime_root: Option<PathBuf>,
    /// Members of one job on this node keep the same manifest: one writes it, the others find it.
    manifests: std::sync::Mutex<()>,
}

impl LocalWork {
    fn hook(&self, lock_timeout: Option<Duration>, device_map: Option<DeviceMap>) -> FreezeHook {
        FreezeHook::new(HookOptions {
            backend: self.backend,
            group: GroupOptions {
                lock_timeout,
                ..GroupOptions::default()
            },
            device_map,
        })
    }
}

impl LocalWork {
    /// The container runtime, looked up when a member given by container needs it.
    fn runtime(&self) -> Result<OciCli, String> {
        let criu = (self.runtime == RuntimeKind::Runc).then(|| self.criu_path.clone());
        let rt = OciCli::find(self.runtime, criu, self.runtime_root.clone(), Vec::new())
            .map_err(|e| e.to_string())?;
        // A restore has runc's CRIU read the images streamed from the store, through this binary.
        Ok(match std::env::current_exe() {
            Ok(exe) => rt.with_restore_proxy(exe),
            Err(_) => rt,
        })
    }

    /// A member given by container: the container flow, in phases.
    fn checkpoint_container(
        &self,
        id: &str,
        task: &Task,
        phases: &dyn Phases,
    ) -> Result<(), String> {
        let runtime = self.runtime()?;
        let mut gpu = self.hook(task.lock_timeout_ms.map(Duration::from_millis), None);
        let guardian = super::start_guardian().map_err(|e| e.to_string())?;
        let mut flow = ContainerFlow {
            runtime: &runtime,
            gpu: &mut gpu,
            store: &self.store,
            progress: &NoProgress,
            // As `checkpoint --container`: a runc container is dumped by our CRIU with runc's settings.
            direct: (self.runtime == RuntimeKind::Runc)
                .then_some(&self.criu as &dyn gpu_checkpoint::dump::Criu),
            watch: &guardian,
        };
        let mut opts = ContainerCheckpointOptions::new(id);
        opts.name = Some(format!("{}.rank{}", task.job, task.member.rank));
        opts.leave_running = task.leave_running;
        opts.tcp_established = self.criu_options.tcp_established;
        opts.detect.simulator = self.backend == Backend::Sim;
        flow.checkpoint_phased(&opts, phases)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// A member checkpoint of a container: restored as that container, by the container flow.
    fn restore_container(
        &self,
        checkpoint: &str,
        container: &str,
        map: Option<DeviceMap>,
        before_unlock: &BeforeUnlock<'_>,
    ) -> Result<i32, String> {
        let runtime = self.runtime()?;
        let mut gpu = self.hook(None, map);
        // Deletes the half-restored container should the agent die mid-way.
        let guardian = super::start_guardian().map_err(|e| e.to_string())?;
        let mut flow = ContainerFlow {
            runtime: &runtime,
            gpu: &mut gpu,
            store: &self.store,
            progress: &NoProgress,
            direct: None,
            watch: &guardian,
        };
        let opts = ContainerRestoreOptions {
            checkpoint: checkpoint.to_string(),
            id: container.to_string(),
            bundle: None,
        };
        let out = flow
            .restore_phased(&opts, Some(before_unlock))
            .map_err(|e| e.to_string())?;
        // Said in the agent's log: how the runtime's CRIU got the images.
        match &out.materialized_because {
            None => {
                tracing::info!("restored container {container}: images streamed from the store")
            }
            Some(why) => {
                tracing::info!("restored container {container}: images materialized first ({why})")
            }
        }
        Ok(out.pid)
    }
}

impl MemberWork for LocalWork {
    fn checkpoint(&self, task: &Task, phases: &dyn Phases) -> Result<(), String> {
        if let Some(id) = &task.member.container {
            return self.checkpoint_container(id, task, phases);
        }
        let pid = task
            .member
            .pid
            .ok_or("a member with neither PID nor container")?;
        let mut gpu = self.hook(task.lock_timeout_ms.map(Duration::from_millis), None);
        let guardian = super::start_guardian().map_err(|e| e.to_string())?;
        let mut flow = Flow {
            criu: &self.criu,
            gpu: &mut gpu,
            store: &self.store,
            progress: &NoProgress,
            images: ImageTransfer::Stream,
            watch: &guardian,
        };
        let mut opts = CheckpointOptions::new(pid);
        opts.name = Some(format!("{}.rank{}", task.job, task.member.rank));
        opts.leave_running = task.leave_running;
        opts.criu = self.criu_options.clone();
        // The simulator is recognised only when asked for, never silently.
        opts.detect.simulator = self.backend == Backend::Sim;
        flow.checkpoint_phased(&opts, phases)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn gpus(&self, id: &str) -> Vec<String> {
        let Ok(info) = self.store.get(id) else {
            return Vec::new();
        };
        CheckpointManifest::from_metadata(&info.metadata)
            .ok()
            .and_then(|m| m.gpu_record().ok().flatten())
            .map(|r| r.used_gpus().iter().map(|g| g.uuid.to_string()).collect())
            .unwrap_or_default()
    }

    fn restore(&self, task: &Task, before_unlock: &BeforeUnlock<'_>) -> Result<i32, String> {
        let id = task
            .checkpoint
            .as_deref()
            .ok_or("a restore task without a checkpoint")?;
        // The coordinator checked the map's syntax; this node checks it against its GPUs.
        let map = match task.device_map.as_deref() {
            None => None,
            Some(m) => Some(m.parse::<DeviceMap>().map_err(|e| e.to_string())?),
        };
        // A container's checkpoint is restored as that container.
        let container = self
            .store
            .get(id)
            .ok()
            .and_then(|i| CheckpointManifest::from_metadata(&i.metadata).ok())
            .and_then(|m| m.container);
        if let Some(c) = container {
            return self.restore_container(id, &c.id, map, before_unlock);
        }
        let mut gpu = self.hook(None, map);
        let guardian = super::start_guardian().map_err(|e| e.to_string())?;
        let mut flow = Flow {
            criu: &self.criu,
            gpu: &mut gpu,
            store: &self.store,
            progress: &NoProgress,
            images: ImageTransfer::default_restore(),
            watch: &guardian,
        };
        // The flow kills the copy itself when the job's restore aborts at `before_unlock`.
        flow.restore_phased(
            &Target::Checkpoint(id.to_string()),
            &CriuOptions::default(),
            Some(before_unlock),
        )
        .map(|o| o.pid)
        .map_err(|e| e.to_string())
    }

    fn keep_manifest(&self, m: &JobManifest) -> Result<(), String> {
        // The agent's store is a local folder (`--storage` is a path; an agent on object storage is not
        // built yet).
        let root = self
            .store
            .local_dir()
            .ok_or("the agent's store is not a local folder")?;
        let dir = root.join("jobs");
        gpu_checkpoint::util::create_private_dir_all(&dir).map_err(|e| e.to_string())?;
        let path = dir.join(format!("{}.json", m.id));
        let _one = self.manifests.lock().unwrap_or_else(|p| p.into_inner());
        if path.exists() {
            return Ok(());
        }
        // The record as etcd keeps it: versioned and self-describing (an ordered one is version 2).
        let json = gpu_checkpoint::flows::cluster::records::encode_manifest(m);
        gpu_checkpoint::util::write_atomic(&path, &json).map_err(|e| e.to_string())
    }

    fn delete(&self, task: &Task) -> Result<(), String> {
        let id = task
            .checkpoint
            .as_deref()
            .ok_or("a delete task without a checkpoint")?;
        // Retried deletes find some member checkpoints gone already: that is what they wanted.
        match self.store.delete(id) {
            Ok(()) | Err(gpu_checkpoint::store::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.to_string()),
        }
        if let (Some(job), Some(root)) = (task.job_checkpoint.as_deref(), self.store.local_dir()) {
            gpu_checkpoint::flows::cluster::records::check_name("job checkpoint", job)?;
            // Members of one job on this node share the copy: the first delete removes it.
            let path = root.join("jobs").join(format!("{job}.json"));
            let _one = self.manifests.lock().unwrap_or_else(|p| p.into_inner());
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("{}: {e}", path.display())),
            }
        }
        Ok(())
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let coord = args.etcd.connect()?;
    let found = discover(args.criu.as_deref())?;
    let criu = CriuRpc::from_found(&found);
    gpu_checkpoint::dump::Criu::check_permitted(&criu)?;
    let store = Store::open(&args.storage, StoreOptions::default())?;
    let work = LocalWork {
        criu,
        store,
        backend: args.gpu.gpu_backend.into(),
        criu_options: args.criu_opts.options()?,
        criu_path: found.path.clone(),
        runtime: args.runtime,
        runtime_root: args.runtime_root.clone(),
        manifests: Default::default(),
    };
    let mut opts = AgentOptions::new(&args.node, &args.storage.to_string_lossy());
    opts.lease_ttl = args.lease_ttl;
    // Registered with the agent, for job restores that choose a node by its GPUs. A node whose GPU
    // backend does not load (no driver, no GPU) registers none: members that used GPUs are not sent
    // there.
    opts.gpus = match gpu_checkpoint::freeze::open(work.backend).and_then(|d| d.gpus()) {
        Ok(gpus) => gpus,
        Err(e) => {
            tracing::info!("no GPUs registered: {e}");
            Vec::new()
        }
    };
    // SIGTERM and SIGINT end the agent cleanly: recorded here, then the loop stops taking tasks, finishes
    // or undoes those under way, and revokes its registration.
    let _signals = InterruptGuard::new();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                if gpu_checkpoint::interrupt::interrupted() {
                    stop.store(true, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    eprintln!(
        "gpu-checkpoint agent: node {} registered in etcd {}; store {}",
        args.node,
        coord.endpoints(),
        args.storage.display()
    );
    let result = run_agent(coord as Arc<dyn Coordinator>, &opts, &work, &stop);
    stop.store(true, Ordering::SeqCst);
    let _ = watcher.join();
    result?;
    if let Some(sig) = gpu_checkpoint::interrupt::last_signal() {
        eprintln!("gpu-checkpoint agent: {sig}: stopped, registration removed");
    }
    Ok(())
}
