//! The container flow's undo guards around the runtime's checkpoint: a paused container resumed, a
//! stopped sandbox brought back from its images.

use std::path::PathBuf;

use super::{ContainerRuntime, Error, RestoreRequest};

/// Resumes a container paused for its checkpoint when dropped, unless disarmed.
pub(super) struct ResumeGuard<'r> {
    pub(super) runtime: &'r dyn ContainerRuntime,
    pub(super) id: String,
    pub(super) armed: bool,
    /// Processes CRIU left stopped (SIGSTOP, its `--leave-stopped`): continued once the container is
    /// resumed.
    pub(super) stopped: Option<crate::proc::Held>,
    /// With `--tcp-established` and the processes left stopped: the connections CRIU left in repair mode
    /// and locked, released before the container resumes (see [`crate::dump::NetworkHold`]).
    pub(super) network: Option<crate::dump::NetworkHold>,
}

impl ResumeGuard<'_> {
    pub(super) fn resume_now(mut self) -> Result<(), Error> {
        self.armed = false;
        self.resume()
    }

    fn resume(&self) -> Result<(), Error> {
        if let Some(hold) = &self.network {
            let n = hold.release();
            tracing::debug!("{n} TCP sockets taken out of repair mode");
        }
        let resumed = self.runtime.resume(&self.id);
        if let Some(stopped) = &self.stopped {
            stopped.continue_all();
        }
        resumed
    }

    pub(super) fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for ResumeGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.resume() {
                tracing::error!(
                    "after the failed checkpoint, resuming the container failed too: {e}"
                );
            }
        }
    }
}

/// Brings a container its runtime stopped at checkpoint time back from the images when dropped, unless
/// disarmed: the undo (and `--leave-running`) where the runtime cannot hold it paused (runsc).
pub(super) struct Revive<'r> {
    pub(super) runtime: &'r dyn ContainerRuntime,
    pub(super) id: String,
    pub(super) images: PathBuf,
    pub(super) bundle: PathBuf,
    pub(super) tcp_established: bool,
    pub(super) armed: bool,
}

impl Revive<'_> {
    pub(super) fn now(mut self) -> Result<(), Error> {
        self.armed = false;
        self.revive()
    }

    fn revive(&self) -> Result<(), Error> {
        // The stopped container still holds its id.
        self.runtime.delete(&self.id, true)?;
        self.runtime.restore(&RestoreRequest {
            id: &self.id,
            images: &self.images,
            bundle: &self.bundle,
            tcp_established: self.tcp_established,
            // The runtime's own images, in a folder (runsc).
            streamed: false,
        })
    }
}

impl Drop for Revive<'_> {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = self.revive() {
                tracing::error!("after the failed checkpoint, restoring the container from its images failed too: {e}");
            }
        }
    }
}

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

/// How long the guardian waits for the runtime's commands the dead tool left running on the sandbox
/// (its checkpoint, which goes on without the tool) before acting on the sandbox anyway.
const RUNTIME_LET_GO: std::time::Duration = std::time::Duration::from_secs(600);

impl SandboxUndo {
    /// Brings the sandbox back from `images` where the runtime's checkpoint into them stopped it, then
    /// puts its guest GPU state back (restore, unlock: asked of the tool per PID, so it does not matter
    /// where the freeze was when the tool died); says what it did.
    pub fn undo(&self, images: Option<&std::path::Path>) -> String {
        let mut said = Vec::new();
        if let Some(images) = images {
            // The runtime's checkpoint outlives the tool: it stops the sandbox when it finishes.
            crate::proc::wait_until(RUNTIME_LET_GO, || self.runtime_commands());
            let stopped = !matches!(self.runtime.state(&self.id), Ok(s) if s.status == "running");
            let revived = stopped.then(|| {
                Revive {
                    runtime: &self.runtime,
                    id: self.id.clone(),
                    images: images.to_path_buf(),
                    bundle: self.bundle.clone(),
                    tcp_established: self.tcp_established,
                    armed: true,
                }
                .now()
            });
            match revived {
                Some(Err(e)) => said.push(format!(
                    "could not restore the stopped sandbox from its images (kept in {}): {e}",
                    images.display()
                )),
                // Restored (runsc has read them) or never stopped: the images are not needed any more.
                done => {
                    if done.is_some() {
                        said.push("restored the stopped sandbox from its images".to_string());
                    }
                    super::unmount_under(images);
                    let _ = std::fs::remove_dir_all(images);
                }
            }
        }
        if let Some(path) = &self.gpu_tool {
            match super::sandbox::tool(&self.runtime, &self.id, path) {
                Ok(cli) => {
                    let n = crate::flows::guardian::put_back_gpu(&cli, &self.gpu_pids);
                    said.push(format!(
                        "put back the GPU state of {n} process(es) inside the sandbox"
                    ));
                }
                Err(e) => said.push(format!(
                    "cannot reach the GPU state inside the sandbox: {e}"
                )),
            }
        }
        said.join("; ")
    }

    /// The runtime's processes working on this sandbox that the tool started (same program and global
    /// flags, the id last: its checkpoint, restore, delete).
    fn runtime_commands(&self) -> Vec<i32> {
        let prefix = self.runtime.argv();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
            .filter(|pid| {
                let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let argv: Vec<&[u8]> = raw.split(|&b| b == 0).filter(|a| !a.is_empty()).collect();
                argv.len() > prefix.len()
                    && argv.iter().zip(&prefix).all(|(a, p)| *a == p.as_bytes())
                    && argv.last() == Some(&self.id.as_bytes())
            })
            .collect()
    }
}
