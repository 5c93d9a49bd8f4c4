//! One node's real outside world, assembled once: our CRIU, the store, the guardian, and for each
//! operation the GPU step ([`FreezeHook`]) with its settings. The binary's commands and the cluster
//! agent's member work (`cluster/local.rs`) run the flows through it, so that the flows are put together
//! for real in one place; tests put them together with their test doubles ([`Flow`], [`ContainerFlow`]).

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use super::checkpoint::{CheckpointOptions, CheckpointOutcome};
use super::container::{
    ContainerCheckpointOptions, ContainerCheckpointOutcome, ContainerFlow, ContainerRestoreOptions,
    ContainerRestoreOutcome,
};
use super::guardian::{Guardian, NoWatch, Watch};
use super::manifest::CheckpointManifest;
use super::restore::{RestoreOutcome, Target};
use super::runtime::{OciCli, RuntimeKind};
use super::{Flow, ImageTransfer, Phases};
use crate::dump::{Criu, CriuOptions};
use crate::freeze::{BeforeUnlock, FreezeHook, HookOptions};
use crate::proc::Live;
use crate::store::{CheckpointInfo, Progress, Store};

/// See the module documentation.
pub struct Node {
    store: Store,
    /// Our CRIU: it dumps and restores process trees, and runc's containers (runc's `--criu`); `None`
    /// where nothing of ours runs CRIU (a runsc sandbox checkpoints by itself).
    criu: Option<Box<dyn Criu>>,
    /// The binary the guardian runs (`EXE guardian`), started before each operation touches anything;
    /// `None`: no guardian (a library user that keeps its own promises).
    guardian: Option<PathBuf>,
}

impl Node {
    pub fn new(store: Store) -> Node {
        Node {
            store,
            criu: None,
            guardian: None,
        }
    }

    /// With our CRIU.
    pub fn with_criu(mut self, criu: Box<dyn Criu>) -> Node {
        self.criu = Some(criu);
        self
    }

    /// Each operation starts a guardian first: `exe guardian` (this very binary).
    pub fn guarded_by(mut self, exe: PathBuf) -> Node {
        self.guardian = Some(exe);
        self
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Finds the checkpoint `target` names, with its manifest.
    pub fn find(&self, target: &Target) -> crate::Result<(CheckpointInfo, CheckpointManifest)> {
        super::restore::find(&self.store, target)
    }

    /// Checkpoints a process tree ([`Flow::checkpoint_phased`]).
    pub fn checkpoint(
        &self,
        opts: &CheckpointOptions,
        gpu: HookOptions,
        images: ImageTransfer,
        progress: &dyn Progress,
        phases: &dyn Phases,
    ) -> crate::Result<CheckpointOutcome> {
        let (mut hook, watch) = (FreezeHook::new(gpu), self.watch()?);
        let mut flow = self.flow(&mut hook, watch.as_ref(), images, progress)?;
        flow.checkpoint_phased(opts, phases)
    }

    /// Restores a process tree ([`Flow::restore_phased`]).
    pub fn restore(
        &self,
        target: &Target,
        given: &CriuOptions,
        images: ImageTransfer,
        gpu: HookOptions,
        progress: &dyn Progress,
        before_unlock: Option<&BeforeUnlock<'_>>,
    ) -> crate::Result<RestoreOutcome> {
        let (mut hook, watch) = (FreezeHook::new(gpu), self.watch()?);
        let mut flow = self.flow(&mut hook, watch.as_ref(), images, progress)?;
        flow.restore_phased(target, given, before_unlock)
    }

    /// Checkpoints a container of `runtime` ([`ContainerFlow::checkpoint_phased`]): a runc container is
    /// dumped by our CRIU with runc's settings, unless `opts.via_runtime`.
    pub fn checkpoint_container(
        &self,
        runtime: &OciCli,
        opts: &ContainerCheckpointOptions,
        gpu: HookOptions,
        progress: &dyn Progress,
        phases: &dyn Phases,
    ) -> crate::Result<ContainerCheckpointOutcome> {
        let (mut hook, watch) = (FreezeHook::new(gpu), self.watch()?);
        let mut flow = self.container_flow(runtime, &mut hook, watch.as_ref(), progress);
        flow.checkpoint_phased(opts, phases)
    }

    /// Restores a container checkpoint as a container of `runtime` ([`ContainerFlow::restore_phased`]).
    pub fn restore_container(
        &self,
        runtime: &OciCli,
        opts: &ContainerRestoreOptions,
        gpu: HookOptions,
        progress: &dyn Progress,
        before_unlock: Option<&BeforeUnlock<'_>>,
    ) -> crate::Result<ContainerRestoreOutcome> {
        let (mut hook, watch) = (FreezeHook::new(gpu), self.watch()?);
        let mut flow = self.container_flow(runtime, &mut hook, watch.as_ref(), progress);
        flow.restore_phased(opts, before_unlock)
    }

    /// The guardian of one operation, told it is done when dropped (after the flow's own undo).
    fn watch(&self) -> crate::Result<Box<dyn Watch>> {
        Ok(match &self.guardian {
            Some(exe) => Box::new(Guardian::spawn(exe)?),
            None => Box::new(NoWatch),
        })
    }

    fn flow<'a>(
        &'a self,
        gpu: &'a mut FreezeHook,
        watch: &'a dyn Watch,
        images: ImageTransfer,
        progress: &'a dyn Progress,
    ) -> crate::Result<Flow<'a>> {
        let criu = self
            .criu
            .as_deref()
            .ok_or_else(|| crate::dump::Error::NotFound {
                tried: vec!["none given".into()],
            })?;
        Ok(Flow {
            criu,
            gpu,
            store: &self.store,
            progress,
            images,
            watch,
            procs: &Live,
        })
    }

    fn container_flow<'a>(
        &'a self,
        runtime: &'a OciCli,
        gpu: &'a mut FreezeHook,
        watch: &'a dyn Watch,
        progress: &'a dyn Progress,
    ) -> ContainerFlow<'a> {
        ContainerFlow {
            runtime,
            gpu,
            store: &self.store,
            progress,
            // runc runs our CRIU (its `--criu`); runsc checkpoints by itself.
            direct: self
                .criu
                .as_deref()
                .filter(|_| runtime.kind() == RuntimeKind::Runc),
            watch,
            procs: &Live,
        }
    }
}

/// The guardian's life (the binary's hidden `guardian` command), with the container flow's undo of a
/// runtime's half-done work: see [`super::guardian::serve`].
pub fn serve_guardian(sock: OwnedFd, tool: i32) -> i32 {
    super::guardian::serve(sock, tool, &super::container::GuardianUndo)
}
