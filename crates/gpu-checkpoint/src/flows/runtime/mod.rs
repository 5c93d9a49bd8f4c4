//! The container runtime, the boundary of the container flow and the engines' wrapper with the outside
//! world: one trait ([`ContainerRuntime`]), with the real OCI runtimes' command lines ([`OciCli`]: runc,
//! runsc) and a test fake (`FakeRuntime`, unit tests only); what the runtime knows that the flows use
//! (runc's settings for a direct CRIU dump: `direct.rs`; a container's processes seen from the host:
//! `processes.rs`); and the records of a runtime's half-done work the guardian is told (`undo.rs`).
//!
//! The flows only need what every OCI runtime's command line offers: `state`, `pause`/`resume`,
//! `checkpoint`/`restore` into and from a folder of images, `kill`, `delete`, `list`.

mod direct;
mod error;
#[cfg(test)]
mod fake;
mod id;
mod oci;
mod processes;
mod undo;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use direct::{runc_settings, DirectDump, DESCRIPTORS};
pub use error::Error;
#[cfg(test)]
pub use fake::FakeRuntime;
pub use id::check_container_id;
pub use oci::{unmount_under, OciCli, RuntimeKind};
pub use processes::{members, pid_map, Member};
pub use undo::{RestoreUndo, RuntimeUndo, SandboxUndo};

/// A container as the runtime's `state` reports it (the OCI runtime spec's state, the fields we use).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerState {
    pub id: String,
    /// `created`, `running`, `paused`, `stopped`.
    pub status: String,
    /// The container's init process, in this (the host's) PID namespace; 0 when it has none.
    #[serde(default)]
    pub pid: i32,
    /// The bundle folder (its `config.json` and, usually, `rootfs/`).
    #[serde(default)]
    pub bundle: PathBuf,
}

/// What a checkpoint asks of the runtime.
#[derive(Debug, Clone)]
pub struct CheckpointRequest<'a> {
    pub id: &'a str,
    /// A private folder the runtime writes CRIU's images into (and its logs: the work path).
    pub images: &'a Path,
    /// The container keeps running after the dump. The flow always asks for this with runc: it pauses
    /// the container first, so that it is stopped until the checkpoint is durable and only then killed
    /// (a failure in between resumes it).
    pub leave_running: bool,
    /// CRIU's `--tcp-established`.
    pub tcp_established: bool,
    /// The cuda-checkpoint-compatible tool (a path inside the sandbox) the runtime's checkpoint freezes
    /// the sandbox's GPU state with, itself: only where [`ContainerRuntime::checkpoints_gpu_itself`].
    pub gpu_tool: Option<&'a Path>,
}

/// What a restore asks of the runtime.
#[derive(Debug, Clone)]
pub struct RestoreRequest<'a> {
    /// The id the restored container gets (the checkpointed one's, or a new one).
    pub id: &'a str,
    /// The folder of images: materialized from the store, or (`streamed`) holding only the runtime's
    /// own files (`descriptors.json`) and the socket CRIU reads its images through.
    pub images: &'a Path,
    /// The bundle to restore into (the checkpointed container's unless told otherwise).
    pub bundle: &'a Path,
    pub tcp_established: bool,
    /// CRIU reads its images streamed (`criu restore --stream`): only where
    /// [`ContainerRuntime::streams_restore`] says so.
    pub streamed: bool,
}

/// An OCI container runtime, as the container flow drives it. Every call blocks until the runtime's
/// command has finished; errors carry the command and what it printed.
pub trait ContainerRuntime {
    /// `runc`, `runsc`: recorded in the manifest, and a restore must use the same.
    fn name(&self) -> &str;
    /// The global flags every command gets (`--root`, `--runtime-arg`s), as recorded in the manifest and
    /// used again on restore.
    fn global_args(&self) -> Vec<String>;
    /// Whether `pause` followed by `checkpoint --leave-running` works (runc: yes): the flow then holds
    /// the container stopped from the dump until the checkpoint is durable. Where not (runsc, whose
    /// `--leave-running` restores the sandbox and then waits for it to exit: the "hang" seen here), the
    /// runtime's checkpoint stops the container, and the flow restores it from the images to leave it
    /// running or to undo.
    fn can_hold_paused(&self) -> bool;
    /// Whether the container's GPU processes are host processes the GPU step can freeze from the host
    /// (runc: yes). In a gVisor sandbox the application runs inside the sentry, and the host driver sees
    /// only the sandbox (nvproxy): its CUDA state must be checkpointed inside (docs/containers.md).
    fn gpu_from_host(&self) -> bool {
        self.can_hold_paused()
    }
    /// Whether the runtime's `checkpoint` freezes the GPU state inside the sandbox itself when given the
    /// tool's path ([`CheckpointRequest::gpu_tool`]), and its `restore` puts it back itself: newer runsc
    /// (`runsc checkpoint --cuda-checkpoint-path`, where its sentry finds the guest's CUDA processes and
    /// toggles them). Where not, the flow runs the tool inside the sandbox itself (`sandbox.rs`).
    fn checkpoints_gpu_itself(&self) -> bool {
        false
    }
    /// CRIU's settings for dumping the container directly, as the runtime itself would
    /// (`direct.rs`): the images then stream into the store and the runtime's restore still
    /// restores them. `None` where the runtime has no such path (runsc checkpoints by itself).
    fn direct_dump(&self, _id: &str, _init: i32) -> Result<Option<DirectDump>, Error> {
        Ok(None)
    }
    /// The one image file the runtime's `checkpoint` writes from start to end (runsc: `checkpoint.img`),
    /// stored while the runtime still writes it (the container flow's `Follow`); `None`: its images are stored
    /// once it has finished.
    fn followed_image(&self) -> Option<&'static str> {
        None
    }
    /// The command line (program first) that runs a program inside container `id` (`runsc ... exec
    /// ID`): how the GPU step reaches a sandbox's CUDA state. `None` where the flow does not use it.
    fn exec_prefix(&self, _id: &str) -> Option<Vec<String>> {
        None
    }
    /// The runtime's command line, for the guardian to act on a sandbox as the tool would should the
    /// tool die ([`SandboxUndo`]); `None` for a runtime that is no command line (the fake).
    fn cli(&self) -> Option<OciCli> {
        None
    }
    /// Whether [`ContainerRuntime::restore`] can have CRIU read its images streamed from the store's
    /// socket in the images folder ([`RestoreRequest::streamed`]): runc with our `criu swrk` stand-in
    /// (`dump/swrk_proxy.rs`). Where not, the images are materialized into the folder first.
    fn streams_restore(&self) -> bool {
        false
    }
    /// The PIDs of container `id`'s processes as seen inside it (`ps`).
    fn guest_pids(&self, id: &str) -> Result<Vec<i32>, Error> {
        Err(Error::Protocol {
            runtime: self.name().into(),
            reason: format!("no process list for {id}"),
        })
    }
    /// The container's state; [`Error::NoSuchContainer`] when the runtime does not know it.
    fn state(&self, id: &str) -> Result<ContainerState, Error>;
    /// Every container the runtime knows (`list`).
    fn list(&self) -> Result<Vec<ContainerState>, Error>;
    fn pause(&self, id: &str) -> Result<(), Error>;
    /// The command line that resumes `id` (program first): what the guardian runs should this process
    /// die while the container is paused.
    fn resume_command(&self, id: &str) -> Vec<String>;
    fn resume(&self, id: &str) -> Result<(), Error>;
    /// Dumps the container into `req.images`; without `leave_running` the runtime kills it afterwards.
    fn checkpoint(&self, req: &CheckpointRequest<'_>) -> Result<(), Error>;
    /// Creates and starts `req.id` from the images, detached; the runtime manages it afterwards.
    fn restore(&self, req: &RestoreRequest<'_>) -> Result<(), Error>;
    /// Sends `signal` (`KILL`, `TERM`) to the container's processes.
    fn kill(&self, id: &str, signal: &str) -> Result<(), Error>;
    /// Removes the container (`force`: kills it first). Before it, whatever a failed restore left mounted
    /// inside the runtime's state folder is unmounted: runc's `criu-root` is a bind mount of the bundle's
    /// rootfs, and a `delete -f` with it still mounted wipes the rootfs.
    fn delete(&self, id: &str, force: bool) -> Result<(), Error>;
}
