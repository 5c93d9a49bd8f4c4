//! A member's work on its node, done by the single-node flows: the checkpoint flow (or the container
//! flow, for a member given by container) driven in phases, the restore flows, and the node's copy of
//! a committed job manifest. The agent ([`super::agent`]) calls it through [`MemberWork`]; the
//! binary only assembles it ([`LocalWork::new`]).
//!
//! Every value it is given comes from a task that [`super::admit`] checked: the member is one this
//! node's agent registered, a checkpoint id is one of a job's member checkpoints in this store.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::admit::Admission;
use super::agent::MemberWork;
use super::hooks::QuiesceHooks;
use super::member_error::MemberError;
use super::records::{self as rec, JobManifest, OpKind, Task};
use crate::checkpoint::CheckpointOptions;
use crate::dump::{Criu, CriuOptions, CriuRpc};
use crate::flows::container::{
    ContainerCheckpointOptions, ContainerFlow, ContainerRestoreOptions, OciCli, RuntimeKind,
};
use crate::flows::guardian::Guardian;
use crate::flows::{CheckpointManifest, Flow, ImageTransfer, Phases};
use crate::freeze::{BeforeUnlock, DeviceMap, FreezeHook, GpuBackend, GroupOptions, HookOptions};
use crate::restore::Target;
use crate::store::{NoProgress, Store};

/// What the agent's member work needs of its node.
pub struct LocalWorkOptions {
    pub criu: CriuRpc,
    /// The CRIU binary (runc's `--criu`).
    pub criu_path: PathBuf,
    pub criu_options: CriuOptions,
    pub store: Store,
    pub backend: GpuBackend,
    /// The container runtime of members given by container, and its state folder.
    pub runtime: RuntimeKind,
    pub runtime_root: Option<PathBuf>,
    /// The gpu-checkpoint binary: the guardian runs it, and so does runc's restore (the image proxy).
    pub exe: PathBuf,
    /// The members registered through this node's agent: the only ones it checkpoints.
    pub admission: Arc<Admission>,
    /// The node's quiesce hooks, which a job checkpoint names.
    pub hooks: QuiesceHooks,
}

/// The members' local work: the checkpoint and restore flows, each call with its own GPU hook and
/// guardian, on this node's store.
pub struct LocalWork {
    o: LocalWorkOptions,
    /// Members of one job on this node keep the same manifest: one writes it, the others find it.
    manifests: std::sync::Mutex<()>,
}

impl LocalWork {
    pub fn new(options: LocalWorkOptions) -> Self {
        LocalWork {
            o: options,
            manifests: Default::default(),
        }
    }

    pub fn store(&self) -> &Store {
        &self.o.store
    }

    pub fn backend(&self) -> GpuBackend {
        self.o.backend
    }

    fn hook(&self, lock_timeout: Option<Duration>, device_map: Option<DeviceMap>) -> FreezeHook {
        FreezeHook::new(HookOptions {
            backend: self.o.backend,
            group: GroupOptions {
                lock_timeout,
                ..GroupOptions::default()
            },
            device_map,
        })
    }

    fn guardian(&self) -> Result<Guardian, MemberError> {
        Ok(Guardian::spawn(&self.o.exe).map_err(crate::Error::from)?)
    }

    /// The container runtime, looked up when a member given by container needs it.
    pub fn runtime(&self) -> Result<OciCli, MemberError> {
        let criu = (self.o.runtime == RuntimeKind::Runc).then(|| self.o.criu_path.clone());
        let rt = OciCli::find(
            self.o.runtime,
            criu,
            self.o.runtime_root.clone(),
            Vec::new(),
        )
        .map_err(crate::Error::from)?;
        // A restore has runc's CRIU read the images streamed from the store, through this binary.
        Ok(rt.with_restore_proxy(self.o.exe.clone()))
    }

    /// The checkpoint and restore flows on this node's store, its steps told to `guardian`.
    fn flow<'a>(
        &'a self,
        gpu: &'a mut FreezeHook,
        guardian: &'a Guardian,
        images: ImageTransfer,
    ) -> Flow<'a> {
        Flow {
            criu: &self.o.criu,
            gpu,
            store: &self.o.store,
            progress: &NoProgress,
            images,
            watch: guardian,
        }
    }

    /// The container flow on this node's store, its steps told to `guardian`.
    fn container_flow<'a>(
        &'a self,
        runtime: &'a OciCli,
        gpu: &'a mut FreezeHook,
        guardian: &'a Guardian,
        direct: Option<&'a dyn Criu>,
    ) -> ContainerFlow<'a> {
        ContainerFlow {
            runtime,
            gpu,
            store: &self.o.store,
            progress: &NoProgress,
            direct,
            watch: guardian,
        }
    }

    /// A member given by container: the container flow, in phases.
    fn checkpoint_container(
        &self,
        id: &str,
        task: &Task,
        phases: &dyn Phases,
    ) -> Result<(), MemberError> {
        let runtime = self.runtime()?;
        let mut gpu = self.hook(task.lock_timeout_ms.map(Duration::from_millis), None);
        let guardian = self.guardian()?;
        // As `checkpoint --container`: a runc container is dumped by our CRIU with runc's settings.
        let direct = (self.o.runtime == RuntimeKind::Runc).then_some(&self.o.criu as &dyn Criu);
        let mut flow = self.container_flow(&runtime, &mut gpu, &guardian, direct);
        let mut opts = ContainerCheckpointOptions::new(id);
        opts.name = Some(member_checkpoint_name(&task.op, task.member.rank));
        opts.leave_running = task.leave_running;
        opts.tcp_established = self.o.criu_options.tcp_established;
        opts.detect.simulator = self.o.backend == GpuBackend::Sim;
        flow.checkpoint_phased(&opts, phases)?;
        Ok(())
    }

    /// A member checkpoint of a container: restored as that container, by the container flow.
    fn restore_container(
        &self,
        checkpoint: &str,
        container: &str,
        map: Option<DeviceMap>,
        before_unlock: &BeforeUnlock<'_>,
    ) -> Result<i32, MemberError> {
        let runtime = self.runtime()?;
        let mut gpu = self.hook(None, map);
        // Deletes the half-restored container should the agent die mid-way.
        let guardian = self.guardian()?;
        let mut flow = self.container_flow(&runtime, &mut gpu, &guardian, None);
        let opts = ContainerRestoreOptions {
            checkpoint: checkpoint.to_string(),
            id: container.to_string(),
            bundle: None,
        };
        let out = flow.restore_phased(&opts, Some(before_unlock))?;
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

    /// The manifest of member checkpoint `id` in this store (found by id only, never by name).
    pub fn member_manifest(&self, id: &str) -> Result<CheckpointManifest, MemberError> {
        let info = self.o.store.get(id).map_err(crate::Error::from)?;
        if info.id != id {
            return Err(MemberError::Refused(format!(
                "{id:?} is not a checkpoint id of this store"
            )));
        }
        CheckpointManifest::from_metadata(&info.metadata).map_err(|e| {
            MemberError::Refused(format!("checkpoint {id}: its manifest does not read: {e}"))
        })
    }

    /// Refuses a restore or delete of member checkpoint `id` unless an agent made it for the job
    /// checkpoint and rank `task` names: a forged task cannot restore (run as root) or delete any other
    /// checkpoint of the store.
    fn made_for(&self, id: &str, task: &Task) -> Result<CheckpointManifest, MemberError> {
        let job_checkpoint = match (&task.job_checkpoint, task.kind) {
            (Some(j), _) => j.as_str(),
            (None, OpKind::Checkpoint) => task.op.as_str(),
            (None, _) => {
                return Err(MemberError::BadTask(
                    "the task does not name the job checkpoint of its member checkpoint".into(),
                ))
            }
        };
        let m = self.member_manifest(id)?;
        let want = member_checkpoint_name(job_checkpoint, task.member.rank);
        if m.name.as_deref() != Some(want.as_str()) {
            return Err(MemberError::Refused(format!(
                "checkpoint {id} is not rank {}'s of job checkpoint {job_checkpoint} (it is named \
                 {:?}): an agent acts only on the member checkpoints it made for a job",
                task.member.rank,
                m.name.as_deref().map(crate::validate::printable)
            )));
        }
        Ok(m)
    }

    /// The node's copy of job checkpoint `id`'s manifest: `STORE/jobs/ID.json`.
    fn manifest_copy(&self, id: &str) -> Result<PathBuf, MemberError> {
        rec::check_name("job checkpoint", id).map_err(MemberError::BadTask)?;
        // The agent's store is a local folder (`--storage` is a path; an agent on object storage is
        // not built yet).
        let root = self.o.store.local_dir().ok_or_else(|| {
            MemberError::BadTask("the agent's store is not a local folder".into())
        })?;
        Ok(root.join("jobs").join(format!("{id}.json")))
    }
}

/// The name a member checkpoint gets in its store: the job checkpoint (the operation's id) and the
/// rank. A restore or delete task is carried out only on a checkpoint of this name (see
/// [`super::admit`]): what an agent made for that job checkpoint, nothing else of the store.
pub fn member_checkpoint_name(job_checkpoint: &str, rank: u32) -> String {
    format!("{job_checkpoint}.rank{rank}")
}

impl MemberWork for LocalWork {
    fn checkpoint(&self, task: &Task, phases: &dyn Phases) -> Result<(), MemberError> {
        self.o.admission.check(task)?;
        if let Some(hook) = &task.quiesce {
            self.o.hooks.run(hook, task)?;
        }
        if let Some(id) = &task.member.container {
            return self.checkpoint_container(id, task, phases);
        }
        let pid = task.member.pid.ok_or_else(|| {
            MemberError::BadTask("a member with neither PID nor container".into())
        })?;
        let mut gpu = self.hook(task.lock_timeout_ms.map(Duration::from_millis), None);
        let guardian = self.guardian()?;
        let mut flow = self.flow(&mut gpu, &guardian, ImageTransfer::Stream);
        let mut opts = CheckpointOptions::new(pid);
        opts.name = Some(member_checkpoint_name(&task.op, task.member.rank));
        opts.leave_running = task.leave_running;
        opts.criu = self.o.criu_options.clone();
        // The simulator is recognised only when asked for, never silently.
        opts.detect.simulator = self.o.backend == GpuBackend::Sim;
        flow.checkpoint_phased(&opts, phases)?;
        Ok(())
    }

    fn gpus(&self, id: &str) -> Vec<String> {
        self.member_manifest(id)
            .ok()
            .and_then(|m| m.gpu_record().ok().flatten())
            .map(|r| r.used_gpus().iter().map(|g| g.uuid.to_string()).collect())
            .unwrap_or_default()
    }

    fn restore(&self, task: &Task, before_unlock: &BeforeUnlock<'_>) -> Result<i32, MemberError> {
        let id = task
            .checkpoint
            .as_deref()
            .ok_or_else(|| MemberError::BadTask("a restore task without a checkpoint".into()))?;
        // The coordinator checked the map's syntax; this node checks it against its GPUs.
        let map = match task.device_map.as_deref() {
            None => None,
            Some(m) => Some(
                m.parse::<DeviceMap>()
                    .map_err(|e| MemberError::BadTask(format!("device map {m:?}: {e}")))?,
            ),
        };
        let manifest = self.made_for(id, task)?;
        // A container's checkpoint is restored as that container.
        if let Some(c) = manifest.container {
            crate::validate::container_id(&c.id).map_err(MemberError::BadTask)?;
            let pid = self.restore_container(id, &c.id, map, before_unlock)?;
            self.o.admission.restored(task, pid, Some(c.id));
            return Ok(pid);
        }
        let mut gpu = self.hook(None, map);
        let guardian = self.guardian()?;
        let mut flow = self.flow(&mut gpu, &guardian, ImageTransfer::default_restore());
        // The flow kills the copy itself when the job's restore aborts at `before_unlock`.
        let out = flow.restore_phased(
            &Target::Checkpoint(id.to_string()),
            &CriuOptions::default(),
            Some(before_unlock),
        )?;
        self.o.admission.restored(task, out.pid, None);
        Ok(out.pid)
    }

    fn keep_manifest(&self, m: &JobManifest) -> Result<(), MemberError> {
        let path = self.manifest_copy(&m.id)?;
        let dir = path.parent().expect("a file in jobs/");
        crate::util::create_private_dir_all(dir)
            .map_err(|source| MemberError::io(format!("creating {}", dir.display()), source))?;
        let _one = self.manifests.lock().unwrap_or_else(|p| p.into_inner());
        if path.exists() {
            return Ok(());
        }
        // The record as etcd keeps it: versioned and self-describing (an ordered one is version 2).
        let json = rec::encode_manifest(m);
        crate::util::write_atomic(&path, &json)
            .map_err(|source| MemberError::io(format!("writing {}", path.display()), source))
    }

    fn delete(&self, task: &Task) -> Result<(), MemberError> {
        let id = task
            .checkpoint
            .as_deref()
            .ok_or_else(|| MemberError::BadTask("a delete task without a checkpoint".into()))?;
        // Retried deletes find some member checkpoints gone already: that is what they wanted.
        match self.made_for(id, task) {
            Ok(_) => {}
            Err(MemberError::Flow(crate::Error::Store(crate::store::Error::NotFound {
                ..
            }))) => {}
            Err(e) => return Err(e),
        }
        match self.o.store.delete(id) {
            Ok(()) | Err(crate::store::Error::NotFound { .. }) => {}
            Err(e) => return Err(crate::Error::from(e).into()),
        }
        if let Some(job) = task.job_checkpoint.as_deref() {
            // Members of one job on this node share the copy: the first delete removes it.
            let path = self.manifest_copy(job)?;
            let _one = self.manifests.lock().unwrap_or_else(|p| p.into_inner());
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(MemberError::io(format!("removing {}", path.display()), e)),
            }
        }
        Ok(())
    }
}
