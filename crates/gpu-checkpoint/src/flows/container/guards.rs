//! The container flow's undo guards around the runtime's checkpoint (a paused container resumed, a
//! stopped sandbox brought back from its images), and what the guardian does of them should the tool
//! die before the commit ([`undo_sandbox`]).

use std::path::PathBuf;

use super::{ContainerRuntime, Error, RestoreRequest};
use crate::flows::runtime::SandboxUndo;

/// Resumes a container paused for its checkpoint when dropped, unless disarmed.
pub(super) struct ResumeGuard<'r> {
    pub(super) runtime: &'r dyn ContainerRuntime,
    pub(super) id: String,
    pub(super) armed: bool,
    /// Processes CRIU left stopped (SIGSTOP, its `--leave-stopped`): continued once the container is
    /// resumed.
    pub(super) stopped: Option<Box<dyn crate::proc::Hold>>,
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

/// How long the guardian waits for the runtime's commands the dead tool left running on the sandbox
/// (its checkpoint, which goes on without the tool) before acting on the sandbox anyway.
const RUNTIME_LET_GO: std::time::Duration = std::time::Duration::from_secs(600);

/// Brings the sandbox back from `images` where the runtime's checkpoint into them stopped it, then
/// puts its guest GPU state back (restore, unlock: asked of the tool per PID, so it does not matter
/// where the freeze was when the tool died); says what it did.
pub(super) fn undo_sandbox(undo: &SandboxUndo, images: Option<&std::path::Path>) -> String {
    let mut said = Vec::new();
    if let Some(images) = images {
        // The runtime's checkpoint outlives the tool: it stops the sandbox when it finishes.
        crate::proc::wait_until(RUNTIME_LET_GO, || {
            runtime_commands(&undo.runtime.argv(), &undo.id)
        });
        let stopped = !matches!(undo.runtime.state(&undo.id), Ok(s) if s.status == "running");
        let revived = stopped.then(|| {
            Revive {
                runtime: &undo.runtime,
                id: undo.id.clone(),
                images: images.to_path_buf(),
                bundle: undo.bundle.clone(),
                tcp_established: undo.tcp_established,
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
    if let Some(path) = &undo.gpu_tool {
        match super::sandbox::tool(&undo.runtime, &undo.id, path) {
            Ok(cli) => {
                let n = crate::flows::guardian::put_back_gpu(&cli, &undo.gpu_pids);
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

/// The processes whose command line starts with `prefix` and ends with `id`: the runtime's commands on
/// container `id`.
pub(super) fn runtime_commands(prefix: &[String], id: &str) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let argv: Vec<&[u8]> = raw.split(|&b| b == 0).filter(|a| !a.is_empty()).collect();
            argv.len() > prefix.len()
                && argv.iter().zip(prefix).all(|(a, p)| *a == p.as_bytes())
                && argv.last() == Some(&id.as_bytes())
        })
        .collect()
}
