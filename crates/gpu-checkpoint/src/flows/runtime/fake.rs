//! The test [`ContainerRuntime`]: containers in memory, images written as small files, every call
//! recorded, and any command made to fail. Its containers' `pid` is a real process (the caller's
//! choice, usually the test itself), so that discovery and detect have something to look at.

use std::cell::RefCell;
use std::collections::BTreeMap;

use super::Error;
use super::{CheckpointRequest, ContainerRuntime, ContainerState, RestoreRequest};

/// See the module documentation.
#[derive(Debug, Default)]
pub struct FakeRuntime {
    containers: RefCell<BTreeMap<String, ContainerState>>,
    /// Every call, as `command id`.
    pub calls: RefCell<Vec<String>>,
    /// The command (`pause`, `checkpoint`, `restore`, ...) that fails.
    pub fail: Option<&'static str>,
    /// The PID a restored container's init gets.
    pub restored_pid: i32,
    /// Its containers' GPU processes cannot be frozen from the host (as under gVisor).
    pub sandboxed: bool,
    /// The settings of a direct CRIU dump it offers (`None`: it has no such path).
    pub direct: Option<super::DirectDump>,
    /// Its restore reads the images streamed, as CRIU does, through the socket in the images folder.
    pub streams: bool,
    /// The bytes of `pages-1.img` its last streamed restore read.
    pub streamed_pages: RefCell<Option<Vec<u8>>>,
    /// Its checkpoint freezes the sandbox's GPU state itself (as newer runsc).
    pub gpu_itself: bool,
    /// The tool its last checkpoint was handed for that.
    pub gpu_tool: RefCell<Option<std::path::PathBuf>>,
}

impl FakeRuntime {
    /// A runtime knowing one running container `id` whose init is `pid`.
    pub fn with_container(id: &str, pid: i32) -> FakeRuntime {
        let rt = FakeRuntime {
            restored_pid: pid,
            ..FakeRuntime::default()
        };
        rt.containers.borrow_mut().insert(
            id.into(),
            ContainerState {
                id: id.into(),
                status: "running".into(),
                pid,
                bundle: "/nonexistent/bundle".into(),
            },
        );
        rt
    }

    /// `id`'s status, `None` when it is not there.
    pub fn status(&self, id: &str) -> Option<String> {
        self.containers.borrow().get(id).map(|c| c.status.clone())
    }

    fn call(&self, command: &str, id: &str) -> Result<(), Error> {
        self.calls.borrow_mut().push(format!("{command} {id}"));
        if self.fail == Some(command) {
            return Err(Error::Runtime {
                command: format!("fake {command} {id}"),
                status: "exit status: 1".into(),
                stderr: "made to fail".into(),
                log: None,
            });
        }
        Ok(())
    }

    fn set(&self, id: &str, status: &str) -> Result<(), Error> {
        let mut all = self.containers.borrow_mut();
        let c = all.get_mut(id).ok_or_else(|| Error::NoSuchContainer {
            runtime: "fake".into(),
            id: id.into(),
            root: String::new(),
        })?;
        c.status = status.into();
        Ok(())
    }
}

/// Reads image `name` as CRIU's `--stream` restore does; fails on a short or missing image.
fn read_streamed(dir: &std::path::Path, name: &str) -> std::io::Result<Vec<u8>> {
    use crate::dump::streamer::{client, Mode};
    use std::io::Read;
    let mut sock = client::connect(dir, Mode::Serve)?;
    let mut pipe = client::open(&mut sock, Mode::Serve, name)?
        .ok_or_else(|| std::io::Error::other(format!("no {name}")))?;
    let mut bytes = Vec::new();
    pipe.read_to_end(&mut bytes)?;
    if bytes.len() != 1 << 20 {
        return Err(std::io::Error::other(format!("{} bytes", bytes.len())));
    }
    Ok(bytes)
}

impl ContainerRuntime for FakeRuntime {
    fn name(&self) -> &str {
        "runc"
    }

    fn direct_dump(&self, id: &str, _init: i32) -> Result<Option<super::DirectDump>, Error> {
        self.call("direct-dump", id)?;
        Ok(self.direct.clone())
    }

    fn global_args(&self) -> Vec<String> {
        vec!["--root".into(), "/fake".into()]
    }

    fn can_hold_paused(&self) -> bool {
        true
    }

    fn gpu_from_host(&self) -> bool {
        !self.sandboxed
    }

    fn checkpoints_gpu_itself(&self) -> bool {
        self.gpu_itself
    }

    fn state(&self, id: &str) -> Result<ContainerState, Error> {
        self.containers
            .borrow()
            .get(id)
            .cloned()
            .ok_or_else(|| Error::NoSuchContainer {
                runtime: "fake".into(),
                id: id.into(),
                root: String::new(),
            })
    }

    fn list(&self) -> Result<Vec<ContainerState>, Error> {
        Ok(self.containers.borrow().values().cloned().collect())
    }

    fn pause(&self, id: &str) -> Result<(), Error> {
        self.call("pause", id)?;
        self.set(id, "paused")
    }

    fn resume_command(&self, id: &str) -> Vec<String> {
        vec!["fake".into(), "resume".into(), id.into()]
    }

    fn resume(&self, id: &str) -> Result<(), Error> {
        self.call("resume", id)?;
        self.set(id, "running")
    }

    fn checkpoint(&self, req: &CheckpointRequest<'_>) -> Result<(), Error> {
        self.call("checkpoint", req.id)?;
        *self.gpu_tool.borrow_mut() = req.gpu_tool.map(Into::into);
        let write = |name: &str, data: &[u8]| {
            std::fs::write(req.images.join(name), data).map_err(|e| Error::Runtime {
                command: "fake checkpoint".into(),
                status: "exit status: 1".into(),
                stderr: e.to_string(),
                log: None,
            })
        };
        write(
            "descriptors.json",
            b"[\"/dev/null\",\"/dev/null\",\"/dev/null\"]",
        )?;
        write("pages-1.img", &vec![7u8; 1 << 20])?;
        if self.streams {
            // CRIU's images always hold one: what tells a restore they are CRIU's.
            write("inventory.img", b"inventory")?;
        }
        if !req.leave_running {
            self.containers.borrow_mut().remove(req.id);
        }
        Ok(())
    }

    fn streams_restore(&self) -> bool {
        self.streams
    }

    fn restore(&self, req: &RestoreRequest<'_>) -> Result<(), Error> {
        self.call("restore", req.id)?;
        if req.streamed {
            // What CRIU does: every image through the store's socket, never a file.
            let pages = read_streamed(req.images, "pages-1.img").map_err(|e| Error::Protocol {
                runtime: "fake".into(),
                reason: format!("streamed pages-1.img: {e}"),
            })?;
            *self.streamed_pages.borrow_mut() = Some(pages);
        } else if !req.images.join("pages-1.img").is_file() {
            return Err(Error::Protocol {
                runtime: "fake".into(),
                reason: "no images".into(),
            });
        }
        self.containers.borrow_mut().insert(
            req.id.into(),
            ContainerState {
                id: req.id.into(),
                status: "running".into(),
                pid: self.restored_pid,
                bundle: req.bundle.to_path_buf(),
            },
        );
        Ok(())
    }

    fn kill(&self, id: &str, _signal: &str) -> Result<(), Error> {
        self.call("kill", id)?;
        self.set(id, "stopped")
    }

    fn delete(&self, id: &str, _force: bool) -> Result<(), Error> {
        self.call("delete", id)?;
        // Its init goes with it, as with a real runtime (never the test process itself).
        if let Some(c) = self.containers.borrow_mut().remove(id) {
            if c.pid > 0 && c.pid != std::process::id() as i32 {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(c.pid, libc::SIGKILL) };
            }
        }
        Ok(())
    }
}
