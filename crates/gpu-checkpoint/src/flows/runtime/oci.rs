//! The real [`ContainerRuntime`]: an OCI runtime's command line (runc, runsc), run as a child process.
//!
//! runc is told our CRIU with its global `--criu PATH` flag (runc 1.1.5 takes it only before the
//! command). Every command gets the same global flags (`--root`, the user's `--runtime-arg`s), which the
//! manifest records so that the restore uses them again.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::Error;
use super::{CheckpointRequest, ContainerRuntime, ContainerState, RestoreRequest};

/// Which runtime a command line belongs to: their flags differ a little.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeKind {
    Runc,
    Runsc,
}

impl RuntimeKind {
    pub fn name(self) -> &'static str {
        match self {
            RuntimeKind::Runc => "runc",
            RuntimeKind::Runsc => "runsc",
        }
    }

    /// The runtime's state folder when `--root` is not given (each keeps one folder per container).
    fn default_root(self) -> &'static str {
        match self {
            RuntimeKind::Runc => "/run/runc",
            RuntimeKind::Runsc => "/var/run/runsc",
        }
    }
}

impl std::str::FromStr for RuntimeKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "runc" => Ok(RuntimeKind::Runc),
            "runsc" => Ok(RuntimeKind::Runsc),
            _ => Err(format!("unknown runtime {s:?} (runc, runsc)")),
        }
    }
}

/// An OCI runtime's command line. Serializable: the guardian is told it to act on a sandbox with the
/// same runtime, root and flags as the tool ([`super::SandboxUndo`]).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OciCli {
    kind: RuntimeKind,
    binary: PathBuf,
    /// runc's `--criu`: our CRIU (runsc has its own checkpointing and takes none).
    criu: Option<PathBuf>,
    /// `--root`: the runtime's state folder (`None`: its default).
    root: Option<PathBuf>,
    /// More global flags (`--runtime-arg`), before the command.
    extra: Vec<String>,
    /// The program runc is given as its CRIU for a streamed restore (our binary, which then acts as
    /// `dump/swrk_proxy.rs` and runs `criu` itself); `None`: restores materialize the images.
    restore_proxy: Option<PathBuf>,
}

impl OciCli {
    /// The runtime `kind`, found on PATH (or `/usr/sbin`), with its global flags.
    pub fn find(
        kind: RuntimeKind,
        criu: Option<PathBuf>,
        root: Option<PathBuf>,
        extra: Vec<String>,
    ) -> Result<OciCli, Error> {
        let binary = crate::path_search::which(kind.name())
            .or_else(|| {
                let p = Path::new("/usr/sbin").join(kind.name());
                p.is_file().then_some(p)
            })
            .ok_or_else(|| Error::RuntimeMissing {
                runtime: kind.name().into(),
                what: "not on PATH".into(),
            })?;
        Ok(OciCli::at(kind, binary, criu, root, extra))
    }

    /// The runtime `kind` at `binary` (the engines' path runs the real runc a node names).
    pub fn at(
        kind: RuntimeKind,
        binary: PathBuf,
        criu: Option<PathBuf>,
        root: Option<PathBuf>,
        extra: Vec<String>,
    ) -> OciCli {
        OciCli {
            kind,
            binary,
            criu: criu.filter(|_| kind == RuntimeKind::Runc),
            root,
            extra,
            restore_proxy: None,
        }
    }

    /// Lets runc restore from streamed images through `exe`, a program that acts as
    /// [`crate::dump::swrk_proxy`] when runc runs it as `EXE swrk FD` (the `gpu-checkpoint` binary).
    pub fn with_restore_proxy(mut self, exe: PathBuf) -> OciCli {
        if self.kind == RuntimeKind::Runc && self.criu.is_some() {
            self.restore_proxy = Some(exe);
        }
        self
    }

    pub fn kind(&self) -> RuntimeKind {
        self.kind
    }

    /// The runtime's state folder for container `id`.
    pub(crate) fn state_dir(&self, id: &str) -> PathBuf {
        self.root
            .clone()
            .unwrap_or_else(|| PathBuf::from(self.kind.default_root()))
            .join(id)
    }

    fn command(&self) -> Command {
        self.command_with(self.criu.as_deref())
    }

    /// The runtime's command with `criu` as runc's `--criu`.
    fn command_with(&self, criu: Option<&Path>) -> Command {
        let mut c = Command::new(&self.binary);
        if let Some(criu) = criu {
            c.arg("--criu").arg(criu);
        }
        c.args(self.global_args());
        c.stdin(Stdio::null());
        c
    }

    /// Runs the runtime with `args` and returns its stdout; a failure carries what it printed.
    fn run(&self, args: &[&str]) -> Result<String, Error> {
        let mut c = self.command();
        c.args(args);
        let out = c.output().map_err(|source| Error::Spawn {
            runtime: self.kind.name().into(),
            source,
        })?;
        if out.status.success() {
            return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
        }
        Err(self.failed(args, &out.status, &String::from_utf8_lossy(&out.stderr)))
    }

    fn failed(&self, args: &[&str], status: &std::process::ExitStatus, stderr: &str) -> Error {
        Error::Runtime {
            command: format!("{} {}", self.kind.name(), args.join(" ")),
            status: status.to_string(),
            stderr: stderr.trim().to_string(),
            log: None,
        }
    }

    /// Every command's first arguments (program, `--criu`, global flags), as its processes show them.
    pub(crate) fn argv(&self) -> Vec<String> {
        let c = self.command();
        let mut argv = vec![c.get_program().to_string_lossy().into_owned()];
        argv.extend(c.get_args().map(|a| a.to_string_lossy().into_owned()));
        argv
    }

    /// The command line of `verb ID` (`state`, `pause`, `resume`), program first: for another process
    /// to run (the guardian).
    pub fn command_line(&self, verb: &str, id: &str) -> Vec<String> {
        let mut argv = self.argv();
        argv.extend([verb.to_string(), id.to_string()]);
        argv
    }

    fn no_such(&self, id: &str) -> Error {
        Error::NoSuchContainer {
            runtime: self.kind.name().into(),
            id: id.into(),
            root: self.state_dir("").display().to_string(),
        }
    }
}

impl ContainerRuntime for OciCli {
    fn name(&self) -> &str {
        self.kind.name()
    }

    fn global_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if let Some(root) = &self.root {
            args.push("--root".into());
            args.push(root.display().to_string());
        }
        args.extend(self.extra.iter().cloned());
        args
    }

    fn can_hold_paused(&self) -> bool {
        self.kind == RuntimeKind::Runc
    }

    fn exec_prefix(&self, id: &str) -> Option<Vec<String>> {
        // Only a sandbox's GPU state is reached from inside (runc's is frozen from the host).
        (self.kind == RuntimeKind::Runsc).then(|| {
            let mut c = vec![self.binary.display().to_string()];
            c.extend(self.global_args());
            c.extend(["exec".to_string(), id.to_string()]);
            c
        })
    }

    fn streams_restore(&self) -> bool {
        self.restore_proxy.is_some()
    }

    fn guest_pids(&self, id: &str) -> Result<Vec<i32>, Error> {
        super::check_container_id(id)?;
        let out = self.run(&["ps", "--format", "json", id])?;
        parse_ps(&out).ok_or_else(|| Error::Protocol {
            runtime: self.kind.name().into(),
            reason: format!("`ps --format json {id}` printed `{}`", out.trim()),
        })
    }

    fn direct_dump(&self, id: &str, init: i32) -> Result<Option<super::DirectDump>, Error> {
        super::check_container_id(id)?;
        if self.kind != RuntimeKind::Runc {
            return Ok(None);
        }
        super::direct::runc_settings(id, &self.state_dir(id), init).map(Some)
    }

    fn state(&self, id: &str) -> Result<ContainerState, Error> {
        // Never on the runtime's command line unchecked (an id like `--help` is an option there).
        super::check_container_id(id)?;
        match self.run(&["state", id]) {
            Ok(out) => serde_json::from_str(&out).map_err(|e| Error::Protocol {
                runtime: self.kind.name().into(),
                reason: format!("`state {id}`: {e}"),
            }),
            Err(Error::Runtime { stderr, .. }) if says_no_such_container(&stderr) => {
                tracing::debug!("{stderr}");
                Err(self.no_such(id))
            }
            Err(e) => Err(e),
        }
    }

    fn list(&self) -> Result<Vec<ContainerState>, Error> {
        let out = self.run(&["list", "--format", "json"])?;
        // runc prints `null` when it knows no container.
        let list: Option<Vec<ContainerState>> =
            serde_json::from_str(&out).map_err(|e| Error::Protocol {
                runtime: self.kind.name().into(),
                reason: format!("`list --format json`: {e}"),
            })?;
        Ok(list.unwrap_or_default())
    }

    fn pause(&self, id: &str) -> Result<(), Error> {
        super::check_container_id(id)?;
        self.run(&["pause", id]).map(drop)
    }

    fn resume(&self, id: &str) -> Result<(), Error> {
        super::check_container_id(id)?;
        self.run(&["resume", id]).map(drop)
    }

    fn resume_command(&self, id: &str) -> Vec<String> {
        self.command_line("resume", id)
    }

    fn cli(&self) -> Option<OciCli> {
        Some(self.clone())
    }

    fn checkpoints_gpu_itself(&self) -> bool {
        // Newer runsc lists the flag in its checkpoint command's help (runsc of 2022 does not); the
        // help goes to stdout or stderr depending on the release, and its exit status says nothing.
        self.kind == RuntimeKind::Runsc
            && self
                .command()
                .args(["help", "checkpoint"])
                .output()
                .is_ok_and(|o| {
                    let text = [o.stdout, o.stderr].concat();
                    String::from_utf8_lossy(&text).contains("cuda-checkpoint-path")
                })
    }

    fn followed_image(&self) -> Option<&'static str> {
        // runsc 2022 writes its whole state into this one file, sequentially (no compression flag).
        (self.kind == RuntimeKind::Runsc).then_some("checkpoint.img")
    }

    fn checkpoint(&self, req: &CheckpointRequest<'_>) -> Result<(), Error> {
        super::check_container_id(req.id)?;
        let images = req.images.display().to_string();
        let mut args = vec!["checkpoint", "--image-path", &images];
        if self.kind == RuntimeKind::Runsc && req.leave_running {
            // runsc's own --leave-running restores the sandbox and then waits for it to exit.
            return Err(Error::Protocol {
                runtime: self.kind.name().into(),
                reason: "checkpoint --leave-running is not used with runsc (it waits for the container to exit)".into(),
            });
        }
        if self.kind == RuntimeKind::Runc {
            // CRIU's log and runc's descriptors.json go with the images, into the store.
            args.extend(["--work-path", &images]);
            if req.tcp_established {
                args.push("--tcp-established");
            }
        }
        if req.leave_running {
            args.push("--leave-running");
        }
        let tool;
        if let Some(path) = req.gpu_tool.filter(|_| self.kind == RuntimeKind::Runsc) {
            tool = format!("--cuda-checkpoint-path={}", path.display());
            args.push(&tool);
        }
        args.push(req.id);
        self.run(&args).map(drop)
    }

    fn restore(&self, req: &RestoreRequest<'_>) -> Result<(), Error> {
        super::check_container_id(req.id)?;
        let images = req.images.display().to_string();
        let bundle = req.bundle.display().to_string();
        // The restored container inherits the runtime's stdio: never a pipe of ours (we would wait for
        // its end for ever) nor a host file. runc's errors go to its `--log` in the work folder; runsc's
        // sandbox would keep a `--log` open for ever (and the images folder may be ingested), so its
        // stderr goes to a private file of its own.
        let tmp = std::env::temp_dir();
        // Removed when dropped, at the end of this call.
        let private = crate::util::private_temp_dir_in(&tmp, "gpu-checkpoint-restore.")
            .map_err(|source| Error::WorkDir { path: tmp, source })?;
        let log = match self.kind {
            RuntimeKind::Runc => req.images.join("runc-restore.log"),
            RuntimeKind::Runsc => private.path().join("runsc-restore.err"),
        };
        let log_s = log.display().to_string();
        let mut args = vec!["restore", "--detach"];
        if self.kind == RuntimeKind::Runc {
            args.splice(0..0, ["--log", log_s.as_str()]);
        }
        args.extend(["--image-path", &images, "--bundle", &bundle]);
        if self.kind == RuntimeKind::Runc {
            args.extend(["--work-path", &images]);
            if req.tcp_established {
                args.push("--tcp-established");
            }
        }
        args.push(req.id);
        let mut c = match (&self.restore_proxy, &self.criu) {
            // runc runs the proxy as its CRIU and passes it our environment, which names the real one.
            (Some(proxy), Some(criu)) if req.streamed => {
                let mut c = self.command_with(Some(proxy));
                c.env(crate::dump::swrk_proxy::REAL_CRIU_ENV, criu);
                c
            }
            _ if req.streamed => {
                return Err(Error::Protocol {
                    runtime: self.kind.name().into(),
                    reason: "a streamed restore without the CRIU stand-in".into(),
                })
            }
            _ => self.command(),
        };
        let stderr = match self.kind {
            RuntimeKind::Runc => Stdio::null(),
            RuntimeKind::Runsc => crate::util::create_new_private_file(&log)
                .map(Stdio::from)
                .unwrap_or_else(|_| Stdio::null()),
        };
        c.args(&args)
            .stdout(Stdio::null())
            .stderr(stderr)
            .current_dir(req.bundle);
        let status = c.status().map_err(|source| Error::Spawn {
            runtime: self.kind.name().into(),
            source,
        })?;
        if status.success() {
            return Ok(());
        }
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        let last = said.lines().rev().take(5).collect::<Vec<_>>();
        let mut text: Vec<&str> = last.into_iter().rev().collect();
        // runc only names CRIU's log, which goes with the work folder: its errors (or its end, or
        // what our CRIU stand-in noted there) are what says why.
        let criu_log = std::fs::read_to_string(req.images.join("restore.log")).unwrap_or_default();
        let errors: Vec<&str> = criu_log
            .lines()
            .filter(|l| l.contains("Error") || l.contains("gpu-checkpoint swrk proxy"))
            .collect();
        let tail: Vec<&str> = if errors.is_empty() {
            criu_log.lines().collect()
        } else {
            errors
        };
        if !tail.is_empty() {
            text.push("CRIU's restore.log:");
            text.extend(&tail[tail.len().saturating_sub(5)..]);
        }
        Err(self.failed(&args, &status, &text.join("\n")))
    }

    fn kill(&self, id: &str, signal: &str) -> Result<(), Error> {
        super::check_container_id(id)?;
        self.run(&["kill", id, signal]).map(drop)
    }

    fn delete(&self, id: &str, force: bool) -> Result<(), Error> {
        super::check_container_id(id)?;
        unmount_under(&self.state_dir(id));
        let mut args = vec!["delete"];
        if force {
            args.push("--force");
        }
        args.push(id);
        self.run(&args).map(drop)
    }
}

/// Unmounts (lazily, deepest first) every mount point at or under `dir`: what a failed or killed
/// `runc restore` leaves in the container's state folder (`criu-root`, a bind mount of the bundle's
/// rootfs, and CRIU's `.criu.cgyard.*`), which `runc delete -f` would otherwise empty, rootfs included.
pub fn unmount_under(dir: &Path) {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mount_path(p)))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points.dedup();
    for p in points {
        use std::os::unix::ffi::OsStrExt;
        let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else {
            continue;
        };
        // SAFETY: a valid NUL-terminated path; umount2 has no other preconditions.
        if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
            tracing::info!("unmounted {} left by the runtime", p.display());
        } else {
            let e = std::io::Error::last_os_error();
            tracing::warn!("could not unmount {}: {e}", p.display());
        }
    }
}

/// mountinfo writes space, tab, newline and backslash in paths as `\ooo` octal escapes.
fn unescape_mount_path(p: &str) -> String {
    let b = p.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The PIDs in `runsc ps --format json`'s answer: an array of process objects (`pid`) or of numbers
/// (runc's form).
pub(super) fn parse_ps(json: &str) -> Option<Vec<i32>> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v.as_array()?
        .iter()
        .map(|p| {
            let n = p.as_i64().or_else(|| {
                p.as_object()?
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case("pid"))?
                    .1
                    .as_i64()
            })?;
            i32::try_from(n).ok()
        })
        .collect()
}

/// Whether a failed `state` said the container does not exist. runc ("container does not exist") and
/// runsc ("loading container: file does not exist") say so only in words, with exit status 1. runsc
/// also says "loading container: open ROOT/SANDBOX_sandbox:ID.state: no such file or directory" when the
/// state file it found in its root is gone when it opens it: a container being deleted (seen right after
/// the guardian deleted a half-restored sandbox), which is no container either.
fn says_no_such_container(stderr: &str) -> bool {
    stderr.contains("does not exist")
        || (stderr.contains("loading container")
            && stderr.contains(".state: no such file or directory"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_way_the_runtimes_say_no_such_container_is_understood() {
        for said in [
            "container does not exist",
            "loading container: file does not exist",
            "loading container: open /run/runsc/gc-1_sandbox:gc-1.state: no such file or directory",
        ] {
            assert!(says_no_such_container(said), "{said}");
        }
        for said in [
            "loading container: open /run/runsc/gc-1_sandbox:gc-1.state: permission denied",
            "open /run/runsc/gc-1.lock: no such file or directory",
            "cannot exec: no such file or directory",
        ] {
            assert!(!says_no_such_container(said), "{said}");
        }
    }

    /// A stand-in for a runsc binary: `help checkpoint` prints `help`; `checkpoint ...` writes its
    /// arguments to `args` beside it.
    fn stand_in(dir: &Path, help: &str) -> OciCli {
        use std::os::unix::fs::PermissionsExt;
        let bin = dir.join("runsc");
        let args = dir.join("args");
        let script = format!(
            "#!/bin/sh\nfor a; do case $a in help) echo '{help}' >&2; exit 2;; checkpoint) echo \"$@\" > {}; exit 0;; esac; done\nexit 1\n",
            args.display()
        );
        std::fs::write(&bin, script).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o700)).unwrap();
        OciCli {
            kind: RuntimeKind::Runsc,
            binary: bin,
            criu: None,
            root: Some(dir.join("root")),
            extra: vec!["--platform=ptrace".into()],
            restore_proxy: None,
        }
    }

    #[test]
    fn a_runsc_listing_cuda_checkpoint_path_is_handed_the_tool_and_others_are_not_asked() {
        let dir = tempfile::tempdir().unwrap();
        let newer = stand_in(
            dir.path(),
            "  -cuda-checkpoint-path string\n    path to cuda-checkpoint inside the container",
        );
        assert!(newer.checkpoints_gpu_itself());
        let images = dir.path().join("images");
        let tool = Path::new("/usr/local/bin/cuda-checkpoint");
        newer
            .checkpoint(&CheckpointRequest {
                id: "sb",
                images: &images,
                leave_running: false,
                tcp_established: false,
                gpu_tool: Some(tool),
            })
            .unwrap();
        let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
        assert!(
            args.contains("checkpoint --image-path")
                && args.contains("--cuda-checkpoint-path=/usr/local/bin/cuda-checkpoint sb"),
            "{args}"
        );
        // runsc of 2022: no such flag in its help.
        let older = stand_in(dir.path(), "  -image-path string\n  -leave-running");
        assert!(!older.checkpoints_gpu_itself());
        // runc never freezes GPU state itself.
        let runc = OciCli {
            kind: RuntimeKind::Runc,
            ..newer
        };
        assert!(!runc.checkpoints_gpu_itself());
    }

    #[test]
    fn ps_answers_are_parsed() {
        let runsc =
            r#"[{"UID":0,"PID":1,"PPID":0,"C":0,"Cmd":"sh"},{"UID":0,"PID":7,"PPID":1,"Cmd":"w"}]"#;
        assert_eq!(parse_ps(runsc), Some(vec![1, 7]));
        assert_eq!(parse_ps("[1, 2]"), Some(vec![1, 2]));
        assert_eq!(parse_ps("{}"), None);
    }

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(
            unescape_mount_path(r"/run/runc/a\040b/criu-root"),
            "/run/runc/a b/criu-root"
        );
        assert_eq!(unescape_mount_path(r"/x\134y"), r"/x\y");
        assert_eq!(unescape_mount_path(r"/plain\04"), r"/plain\04");
    }

    #[test]
    fn runtime_names_parse_and_others_are_refused() {
        assert_eq!("runc".parse::<RuntimeKind>().unwrap(), RuntimeKind::Runc);
        assert_eq!("runsc".parse::<RuntimeKind>().unwrap().name(), "runsc");
        assert!("crun".parse::<RuntimeKind>().is_err());
    }
}
