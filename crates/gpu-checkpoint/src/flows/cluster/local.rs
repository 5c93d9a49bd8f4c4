//! A member's work on its node, done by the single-node flows through the node's [`Node`]: the
//! checkpoint pipeline on a process tree (or a container, for a member given by container) driven in
//! phases, the restores, and the node's copy of a committed job manifest. The agent ([`super::agent`])
//! calls it through [`MemberWork`]; the binary only assembles it ([`LocalWork::new`]).
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
use crate::dump::CriuOptions;
use crate::flows::container::{ContainerCheckpointOptions, ContainerRestoreOptions};
use crate::flows::runtime::{OciCli, RuntimeKind};
use crate::flows::{CheckpointManifest, ImageTransfer, Node, Phases};
use crate::freeze::{BeforeUnlock, DeviceMap, GpuBackend, GroupOptions, HookOptions};
use crate::restore::Target;
use crate::store::{NoProgress, Store};

/// What the agent's member work needs of its node.
pub struct LocalWorkOptions {
    /// The node's flows: its store, our CRIU and the guardian (this binary).
    pub node: Node,
    /// The CRIU binary (runc's `--criu`).
    pub criu_path: PathBuf,
    pub criu_options: CriuOptions,
    pub backend: GpuBackend,
    /// The container runtime of members given by container, and its state folder.
    pub runtime: RuntimeKind,
    pub runtime_root: Option<PathBuf>,
    /// The gpu-checkpoint binary: runc's restore runs it (the image proxy).
    pub exe: PathBuf,
    /// The members registered through this node's agent: the only ones it checkpoints.
    pub admission: Arc<Admission>,
    /// The node's quiesce hooks, which a job checkpoint names.
    pub hooks: QuiesceHooks,
}

/// The members' local work: the checkpoint and restore flows of this node's [`Node`] (each call with its
/// own GPU hook and guardian).
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
        self.o.node.store()
    }

    pub fn backend(&self) -> GpuBackend {
        self.o.backend
    }

    /// The GPU step's settings of one member's operation.
    fn gpu(&self, lock_timeout: Option<Duration>, device_map: Option<DeviceMap>) -> HookOptions {
        HookOptions {
            backend: self.o.backend,
            group: GroupOptions {
                lock_timeout,
                ..GroupOptions::default()
            },
            device_map,
        }
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

    /// A member given by container: the container flow, in phases.
    fn checkpoint_container(
        &self,
        id: &str,
        task: &Task,
        phases: &dyn Phases,
    ) -> Result<(), MemberError> {
        let runtime = self.runtime()?;
        let gpu = self.gpu(task.lock_timeout_ms.map(Duration::from_millis), None);
        // As `checkpoint --container`: a runc container is dumped by our CRIU with runc's settings.
        let mut opts = ContainerCheckpointOptions::new(id);
        opts.name = Some(member_checkpoint_name(&task.op, task.member.rank));
        opts.leave_running = task.leave_running;
        opts.tcp_established = self.o.criu_options.tcp_established;
        opts.detect.simulator = self.o.backend == GpuBackend::Sim;
        let node = &self.o.node;
        node.checkpoint_container(&runtime, &opts, gpu, &NoProgress, phases)?;
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
        let opts = ContainerRestoreOptions {
            checkpoint: checkpoint.to_string(),
            id: container.to_string(),
            bundle: None,
        };
        // Its guardian deletes the half-restored container should the agent die mid-way.
        let gpu = self.gpu(None, map);
        let node = &self.o.node;
        let out = node.restore_container(&runtime, &opts, gpu, &NoProgress, Some(before_unlock))?;
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
        let info = self.store().get(id).map_err(crate::Error::from)?;
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
        let root = self.store().local_dir().ok_or_else(|| {
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
        let gpu = self.gpu(task.lock_timeout_ms.map(Duration::from_millis), None);
        let mut opts = CheckpointOptions::new(pid);
        opts.name = Some(member_checkpoint_name(&task.op, task.member.rank));
        opts.leave_running = task.leave_running;
        opts.criu = self.o.criu_options.clone();
        // The simulator is recognised only when asked for, never silently.
        opts.detect.simulator = self.o.backend == GpuBackend::Sim;
        let (images, node) = (ImageTransfer::Stream, &self.o.node);
        node.checkpoint(&opts, gpu, images, &NoProgress, phases)?;
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
        // The flow kills the copy itself when the job's restore aborts at `before_unlock`.
        let out = self.o.node.restore(
            &Target::Checkpoint(id.to_string()),
            &CriuOptions::default(),
            ImageTransfer::default_restore(),
            self.gpu(None, map),
            &NoProgress,
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
        match self.store().delete(id) {
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
