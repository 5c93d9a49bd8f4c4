//! The undo records of a container runtime's half-done work that the guardian (`flows/guardian.rs`) is
//! told, so that it can finish or undo it should the tool die (SIGKILL, the OOM killer). The records are
//! data, below both the guardian and the container flow; what undoes them is the container flow's
//! ([`RuntimeUndo`], handed to the guardian when it starts).

use std::path::{Path, PathBuf};

/// What the guardian (`flows/guardian.rs`) is told about a sandbox its runtime cannot hold paused
/// (runsc), to undo what a tool that died (SIGKILL, the OOM killer) before the commit left of its
/// checkpoint, as `Revive` and the in-sandbox freeze's guard would have: the sandbox stopped by the
/// runtime's checkpoint, its guest GPU processes locked or checkpointed inside it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SandboxUndo {
    /// The tool's runtime command line: the same binary, root and global flags.
    pub runtime: super::OciCli,
    pub id: String,
    pub bundle: PathBuf,
    pub tcp_established: bool,
    /// The cuda-checkpoint-compatible tool inside the sandbox and the guest PIDs it freezes, when the
    /// checkpoint freezes GPU state inside the sandbox.
    #[serde(default)]
    pub gpu_tool: Option<PathBuf>,
    #[serde(default)]
    pub gpu_pids: Vec<i32>,
}

/// What the guardian (`flows/guardian.rs`) is told about a container restore under way, told before the
/// runtime's restore starts and withdrawn once the restore has succeeded: should the tool die in
/// between, it undoes what `Discard` and `WorkDir` (`restore.rs`, `mod.rs`) would have: the
/// half-restored container (running or not, its GPU state restored or not) deleted, never through
/// what the runtime left mounted in its state folder (runc's `criu-root` is a bind mount of the bundle's
/// rootfs), and the work folder removed. The checkpoint, which a restore never changes, stays.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RestoreUndo {
    /// The tool's runtime command line: the same binary, root and global flags.
    pub runtime: super::OciCli,
    /// The id the container is restored under (checked free before).
    pub id: String,
    /// The restore's work folder (the runtime's images, logs, CRIU's image socket).
    pub work: PathBuf,
}

/// What undoes the records above, as the guardian runs it: implemented by the container flow, which knows
/// how (its guards' undo, the root file system journal); the guardian is handed it when it starts.
pub trait RuntimeUndo {
    /// Brings a sandbox the runtime's checkpoint stopped back from `images` (where it was stopping one)
    /// and puts its GPU state back inside it; says what it did.
    fn sandbox(&self, undo: &SandboxUndo, images: Option<&Path>) -> String;
    /// Undoes a container restore that did not finish; says what it did.
    fn container_restore(&self, undo: &RestoreUndo) -> String;
}
