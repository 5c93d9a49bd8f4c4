//! NVIDIA's `cuda-checkpoint` binary as a backend, for drivers 550-569 that lack the in-process API.
//!
//! Every call spawns the utility, which attaches to the driver again (a production user measured
//! 2.67 s per `--get-state`); the `cuda-driver` backend avoids that and is preferred by `auto`.

use super::types::{CuError, GpuInfo, GpuPair, ProcessState};
use super::{Error, GpuBackend, GpuDriver, Op, Result};
use crate::path_search::{is_executable, which};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The utility's name on PATH.
pub const BINARY: &str = "cuda-checkpoint";
/// Overrides the utility's location (a path).
pub const ENV_PATH: &str = "GPU_CHECKPOINT_CUDA_CHECKPOINT";

pub struct CudaCli {
    path: PathBuf,
    /// A command the utility runs under, e.g. `runsc [global args] exec ID`: the utility then runs
    /// inside a gVisor sandbox, on the sandbox's (guest) PIDs, where the application's CUDA state is.
    wrapper: Vec<String>,
}

impl CudaCli {
    /// Uses `$GPU_CHECKPOINT_CUDA_CHECKPOINT`, else `cuda-checkpoint` from PATH.
    pub fn open() -> Result<Self> {
        if let Some(p) = std::env::var_os(ENV_PATH) {
            let p = PathBuf::from(p);
            return if is_executable(&p) {
                Ok(CudaCli {
                    path: p,
                    wrapper: Vec::new(),
                })
            } else {
                Err(Error::CliFailed {
                    command: p.display().to_string(),
                    reason: format!("{ENV_PATH} does not name an executable file"),
                })
            };
        }
        which(BINARY)
            .map(|path| CudaCli {
                path,
                wrapper: Vec::new(),
            })
            .ok_or(Error::CliMissing)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Uses the utility at `path` (tests point this at a stand-in script).
    pub fn with_path(path: impl Into<PathBuf>) -> Self {
        CudaCli {
            path: path.into(),
            wrapper: Vec::new(),
        }
    }

    /// The utility at `path` as seen by the command `wrapper` runs it under (`runsc ... exec ID`: a
    /// path inside the sandbox); PIDs are then those the wrapped command sees.
    pub fn wrapped(wrapper: Vec<String>, path: impl Into<PathBuf>) -> Self {
        CudaCli {
            path: path.into(),
            wrapper,
        }
    }

    /// Runs the utility; success returns stdout. A failure is mapped to the CUDA error it names, if any.
    fn run(&self, op: Op, pid: i32, args: &[String]) -> Result<String> {
        let mut cmd = match self.wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(&self.path);
                c
            }
            None => Command::new(&self.path),
        };
        let out = cmd.args(args).output().map_err(|e| Error::CliFailed {
            command: self.command_line(args),
            reason: e.to_string(),
        })?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if out.status.success() {
            return Ok(stdout);
        }
        let text = format!("{stdout}\n{stderr}");
        let detail = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" | ");
        match find_cuda_error(&text) {
            Some(code) => Err(Error::Cuda {
                op,
                pid,
                code,
                detail: Some(format!("cuda-checkpoint: {detail}")),
            }),
            None => Err(Error::CliFailed {
                command: self.command_line(args),
                reason: format!("{} ({detail})", out.status),
            }),
        }
    }

    fn command_line(&self, args: &[String]) -> String {
        self.wrapper
            .iter()
            .cloned()
            .chain(std::iter::once(self.path.display().to_string()))
            .chain(args.iter().cloned())
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn action(&self, op: Op, pid: i32, action: &str, extra: &[String]) -> Result<()> {
        let mut args = vec![
            "--action".to_string(),
            action.to_string(),
            "--pid".to_string(),
            pid.to_string(),
        ];
        args.extend_from_slice(extra);
        self.run(op, pid, &args).map(drop)
    }

    /// Runs a query (`flag`: `--get-state`, `--get-restore-tid`) on `pid` and reads the answer out of its
    /// output with `parse`; output it cannot read is an error that shows it.
    fn query<T>(
        &self,
        op: Op,
        pid: i32,
        flag: &str,
        parse: impl FnOnce(&str) -> Option<T>,
    ) -> Result<T> {
        let out = self.run(op, pid, &[flag.into(), "--pid".into(), pid.to_string()])?;
        parse(&out).ok_or_else(|| Error::CliFailed {
            command: format!("{BINARY} {flag} --pid {pid}"),
            reason: format!("unexpected output `{}`", out.trim()),
        })
    }
}

/// Finds a `CUDA_ERROR_*` name in the utility's output (it prints the driver's error names).
fn find_cuda_error(text: &str) -> Option<CuError> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("CUDA_ERROR_"))
        .find_map(CuError::from_name)
}

impl GpuDriver for CudaCli {
    fn backend(&self) -> GpuBackend {
        GpuBackend::CudaCli
    }

    fn driver_version(&self) -> Option<String> {
        super::cuda_driver::nvml_driver_version()
    }

    fn state(&self, pid: i32) -> Result<ProcessState> {
        self.query(Op::State, pid, "--get-state", |out| {
            out.split_whitespace()
                .find_map(|w| w.parse::<ProcessState>().ok())
        })
    }

    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<()> {
        let extra = match timeout {
            Some(t) => vec!["--timeout".to_string(), t.as_millis().max(1).to_string()],
            None => vec![],
        };
        self.action(Op::Lock, pid, "lock", &extra)
    }

    fn checkpoint(&self, pid: i32) -> Result<()> {
        self.action(Op::Checkpoint, pid, "checkpoint", &[])
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<()> {
        let extra = if pairs.is_empty() {
            vec![]
        } else {
            let map: Vec<String> = pairs
                .iter()
                .map(|p| format!("{}={}", p.old, p.new))
                .collect();
            vec!["--device-map".to_string(), map.join(",")]
        };
        self.action(Op::Restore, pid, "restore", &extra)
    }

    fn unlock(&self, pid: i32) -> Result<()> {
        self.action(Op::Unlock, pid, "unlock", &[])
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32> {
        self.query(Op::RestoreTid, pid, "--get-restore-tid", |out| {
            out.split(|c: char| !c.is_ascii_digit())
                .rfind(|w| !w.is_empty())
                .and_then(|w| w.parse().ok())
        })
    }

    fn process_gpus(&self, pid: i32) -> Option<Vec<super::GpuUuid>> {
        super::cuda_driver::nvml_process_gpus(pid)
    }

    fn process_memory(&self, pid: i32) -> Option<Vec<super::GpuMemory>> {
        super::cuda_driver::nvml_process_memory(pid)
    }

    fn free_memory(&self, gpu: &super::GpuUuid) -> Option<u64> {
        super::cuda_driver::nvml_free_memory(gpu)
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>> {
        // The utility cannot list GPUs; NVML can (drivers >= 550 ship it).
        super::cuda_driver::nvml_gpus().ok_or_else(|| Error::LibraryMissing {
            lib: "libnvidia-ml.so.1",
            reason: "NVML could not be initialised to list this node's GPUs".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A stand-in for NVIDIA's utility (test implementation): a shell script that keeps one process's
    /// state in a file and answers like `cuda-checkpoint` does, logging every invocation.
    fn fake_utility(dir: &Path) -> PathBuf {
        let script = dir.join("fake-cuda-checkpoint");
        let state = dir.join("state");
        let log = dir.join("calls");
        std::fs::write(&state, "running").unwrap();
        let body = format!(
            r#"#!/bin/sh
echo "$@" >> {log}
st=$(cat {state})
case "$1" in
  --get-state) echo "$st"; exit 0;;
  --get-restore-tid) echo "4242"; exit 0;;
  --action)
    case "$2:$st" in
      lock:running)
        if [ "$5" = "--timeout" ] && [ "$6" = "1" ]; then echo "Could not lock: CUDA_ERROR_NOT_READY" >&2; exit 1; fi
        echo locked > {state};;
      checkpoint:locked) echo checkpointed > {state};;
      restore:checkpointed) echo locked > {state};;
      unlock:locked) echo running > {state};;
      *) echo "Could not $2 process $4: CUDA_ERROR_ILLEGAL_STATE" >&2; exit 1;;
    esac; exit 0;;
  *) echo "usage" >&2; exit 2;;
esac
"#,
            log = log.display(),
            state = state.display()
        );
        std::fs::write(&script, body).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        script
    }

    #[test]
    fn drives_the_utility_through_the_lifecycle() {
        let d = tempfile::tempdir().unwrap();
        let cli = CudaCli::with_path(fake_utility(d.path()));
        assert_eq!(cli.state(77).unwrap(), ProcessState::Running);
        cli.lock(77, Some(Duration::from_secs(3))).unwrap();
        assert_eq!(cli.state(77).unwrap(), ProcessState::Locked);
        cli.checkpoint(77).unwrap();
        assert_eq!(cli.state(77).unwrap(), ProcessState::Checkpointed);
        let pair = GpuPair {
            old: "GPU-00000000-0000-0000-0000-000000000001".parse().unwrap(),
            new: "GPU-00000000-0000-0000-0000-000000000002".parse().unwrap(),
        };
        cli.restore(77, &[pair]).unwrap();
        cli.unlock(77).unwrap();
        assert_eq!(cli.state(77).unwrap(), ProcessState::Running);
        assert_eq!(cli.restore_thread_id(77).unwrap(), 4242);
        let calls = std::fs::read_to_string(d.path().join("calls")).unwrap();
        assert!(
            calls.contains("--action lock --pid 77 --timeout 3000"),
            "{calls}"
        );
        assert!(
            calls.contains("--action restore --pid 77 --device-map GPU-00000000-0000-0000-0000-000000000001=GPU-00000000-0000-0000-0000-000000000002"),
            "{calls}"
        );
    }

    #[test]
    fn maps_the_utility_errors() {
        let d = tempfile::tempdir().unwrap();
        let cli = CudaCli::with_path(fake_utility(d.path()));
        let e = cli.checkpoint(5).unwrap_err();
        assert_eq!(e.cu_error(), Some(CuError::IllegalState), "{e}");
        let e = cli.lock(5, Some(Duration::from_millis(1))).unwrap_err();
        assert_eq!(e.cu_error(), Some(CuError::NotReady), "{e}");
        assert_eq!(cli.state(5).unwrap(), ProcessState::Running);
    }

    #[test]
    fn missing_utility_is_a_clear_error() {
        let cli = CudaCli::with_path("/nonexistent/cuda-checkpoint");
        let e = cli.state(1).unwrap_err();
        assert!(matches!(e, Error::CliFailed { .. }), "{e}");
        assert!(e.to_string().contains("/nonexistent/cuda-checkpoint"));
    }

    #[test]
    fn finds_error_names_in_text() {
        assert_eq!(
            find_cuda_error("error: CUDA_ERROR_OUT_OF_MEMORY."),
            Some(CuError::OutOfMemory)
        );
        assert_eq!(find_cuda_error("nothing here"), None);
    }
}
