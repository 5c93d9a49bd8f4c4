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
        runtime_commands(&self.runtime.argv(), &self.id)
    }
}

/// The processes whose command line starts with `prefix` and ends with `id`: the runtime's commands on
/// container `id`.
fn runtime_commands(prefix: &[String], id: &str) -> Vec<i32> {
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

/// How long the guardian waits for the runtime's restore the dead tool left (with runc: runc, our
/// `criu swrk` stand-in and CRIU, which fail once the store's image socket is gone, or finish) before
/// killing what is left of it.
const RESTORE_LET_GO: std::time::Duration = std::time::Duration::from_secs(60);

impl RestoreUndo {
    /// Undoes the half-done restore (see the type); says what it did.
    pub fn undo(&self) -> String {
        let mut said = Vec::new();
        let left = crate::proc::wait_until(RESTORE_LET_GO, || self.restoring());
        let killed = kill_trees(&left) + kill_leftovers(&self.work);
        if killed > 0 {
            said.push(format!(
                "killed what was left of the runtime's restore ({killed} processes)"
            ));
        }
        // Before anything is deleted: what the runtime left mounted (also where it knows no container).
        super::unmount_under(&self.runtime.state_dir(&self.id));
        match self.runtime.state(&self.id) {
            Ok(_) => match self.runtime.delete(&self.id, true) {
                Ok(()) => said.push(format!("deleted the half-restored container {}", self.id)),
                Err(e) => said.push(format!(
                    "could not delete the half-restored container {}: {e}",
                    self.id
                )),
            },
            Err(Error::NoSuchContainer { .. }) => {}
            Err(e) => said.push(format!("cannot ask for container {}: {e}", self.id)),
        }
        // An imported archive's root file system changes, journaled in the work folder (nothing runs on
        // the rootfs any more).
        said.extend(super::restore::undo_rootfs_left(&self.work));
        super::unmount_under(&self.work);
        match std::fs::remove_dir_all(&self.work) {
            Ok(()) => said.push(format!("removed {}", self.work.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => said.push(format!("could not remove {}: {e}", self.work.display())),
        }
        said.push("the checkpoint is intact".into());
        said.join("; ")
    }

    /// What still works on the restore: the runtime's commands on the id (any of its global flags: runc
    /// is given our stand-in as its `--criu`), and whatever runs in the work folder (CRIU, run there by
    /// the stand-in, which outlives a killed runc).
    fn restoring(&self) -> Vec<i32> {
        let program = &self.runtime.argv()[..1];
        let mut pids = runtime_commands(program, &self.id);
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return pids;
        };
        pids.extend(
            dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
                .filter(|pid| {
                    std::fs::read_link(format!("/proc/{pid}/cwd"))
                        .is_ok_and(|cwd| cwd.starts_with(&self.work))
                }),
        );
        pids.retain(|&p| crate::proc::is_alive(p));
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

/// Kills the trees rooted at `roots`; returns how many processes they held.
fn kill_trees(roots: &[i32]) -> usize {
    let tree: Vec<i32> = roots
        .iter()
        .flat_map(|&p| crate::proc::process_tree(p))
        .map(|p| p.pid)
        .collect();
    crate::proc::kill_tree(&tree, std::time::Duration::from_secs(10));
    tree.len()
}

/// Kills what a failed or abandoned restore left running beside its runtime: CRIU (run in the work folder
/// by runc's `criu swrk` stand-in, which goes on if the stand-in is killed) with the tasks it is
/// restoring, and a tree CRIU finished restoring that the runtime never took (its init's PID in the
/// work folder's pidfile; killing a PID namespace's init kills the namespace). Only processes that
/// started after this one (the tool, or the guardian started before the restore): a PID reused since
/// is left alone. Returns how many processes were killed.
pub(super) fn kill_leftovers(work: &std::path::Path) -> usize {
    let me = crate::proc::stat(std::process::id() as i32).map_or(u64::MAX, |s| s.start_ticks);
    let ours =
        |pid: i32| crate::proc::stat(pid).is_some_and(|s| !s.is_dying() && s.start_ticks >= me);
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut roots: Vec<i32> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| {
            std::fs::read_link(format!("/proc/{pid}/cwd")).is_ok_and(|cwd| cwd.starts_with(work))
        })
        .collect();
    let pidfile = work.join(crate::dump::swrk_proxy::PIDFILE);
    if let Some(pid) = std::fs::read_to_string(pidfile)
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
    {
        roots.push(pid);
    }
    roots.retain(|&p| p != std::process::id() as i32 && ours(p));
    let killed = kill_trees(&roots);
    if killed > 0 {
        tracing::warn!("killed {killed} process(es) left by the failed restore");
    }
    killed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_runs_in_the_work_folder_is_killed_and_an_older_pidfile_process_is_not() {
        let work = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .current_dir(work.path())
            .spawn()
            .unwrap();
        // PID 1 started before this process: a pidfile naming it (a PID reused since) is not acted on.
        std::fs::write(work.path().join(crate::dump::swrk_proxy::PIDFILE), "1\n").unwrap();
        assert_eq!(kill_leftovers(work.path()), 1);
        let st = child.wait().unwrap();
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(9));
        assert_eq!(kill_leftovers(work.path()), 0);
    }
}
