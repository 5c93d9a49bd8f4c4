//! Stage 2: freeze GPU state: lock -> checkpoint -> (CPU dump) -> restore -> unlock.
//!
//! One trait, [`GpuDriver`], stands at the boundary with the GPU driver. It has three implementations,
//! always chosen explicitly ([`GpuBackend`]):
//!
//! * [`cuda_driver`]: the CUDA driver checkpoint API (`cuCheckpointProcess*`, driver >= 570), loaded from
//!   `libcuda.so.1` at run time, so the tool runs (and says what is missing) on machines without a driver;
//! * [`cuda_cli`]: NVIDIA's `cuda-checkpoint` binary, for drivers 550-569 that lack the API;
//! * [`sim`]: the simulated GPU of the `gpu-sim-workload` program, for tests and demos only. `auto` never
//!   picks it.
//!
//! [`lifecycle`] encodes a process's GPU state machine in types, and [`group`] drives many processes in
//! parallel with the undo logic that keeps every process running when any step fails.

pub mod cuda_cli;
pub mod cuda_driver;
#[cfg(test)]
pub mod fake;
pub mod freeze_hook;
pub mod group;
pub mod hook;
pub mod lifecycle;
pub mod sim;
pub mod step;
mod types;

pub use cuda_driver::SetupTimings;
pub use freeze_hook::{has_cuda_context, FreezeHook, HookOptions};
pub use group::{
    freeze_all, plan, restore_all, Frozen, GroupOptions, Plan, ProcessRecord, Skipped, StepRecord,
};
pub use hook::{
    AfterLock, BeforeUnlock, FreezeContext, GpuHook, NoGpu, RestoreRecord, RestoredTree,
};
pub use lifecycle::{Checkpointed, GpuProcess, Locked, Running};
pub use step::{match_gpus, GpuMemory, GpuRecord, GpuStep, ThawRecord};
pub use types::{CuError, DeviceMap, DeviceRef, GpuInfo, GpuPair, GpuUuid, Op, ProcessState};

use crate::exit::{Classify, ExitStatus};
use std::sync::Arc;
use std::time::Duration;

/// The CUDA driver release that brought the in-process checkpoint API (`cuCheckpointProcess*`).
pub const MIN_DRIVER_API: &str = "NVIDIA driver >= 570 (CUDA 12.8)";
/// The release that brought GPU migration (restore onto other GPUs by UUID pairs).
pub const MIN_DRIVER_MIGRATION: &str = "NVIDIA driver >= 580 (CUDA 13.0)";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The driver (or the simulator, which speaks the same codes) refused or failed an operation.
    #[error("{op} of pid {pid} failed: {code}{}", detail.as_deref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Cuda {
        op: Op,
        pid: i32,
        code: CuError,
        detail: Option<String>,
    },
    #[error("cannot load {lib}: {reason}; the CUDA checkpoint API needs {MIN_DRIVER_API}")]
    LibraryMissing { lib: &'static str, reason: String },
    #[error("{symbol} not found in libcuda (driver API version {version}); it needs {needed}")]
    SymbolMissing {
        symbol: &'static str,
        version: String,
        needed: &'static str,
    },
    #[error("CUDA driver call {call} failed during set-up: {code}")]
    DriverSetup { call: &'static str, code: CuError },
    #[error("`cuda-checkpoint` not found on PATH (install it from NVIDIA's cuda-checkpoint repository, or use driver >= 570 with --gpu-backend cuda-driver)")]
    CliMissing,
    #[error("`{command}` failed: {reason}")]
    CliFailed { command: String, reason: String },
    #[error("no GPU checkpoint backend found: neither libcuda with the checkpoint API ({MIN_DRIVER_API}) nor `cuda-checkpoint` on PATH; {reason}")]
    NoBackend { reason: String },
    #[error("pid {pid} is not a simulated GPU process (no control socket @{}): {reason}", sim::socket_name(*pid))]
    SimUnreachable { pid: i32, reason: String },
    #[error("simulated GPU protocol error with pid {pid}: {reason}")]
    SimProtocol { pid: i32, reason: String },
    #[error("no such process: {pid}")]
    NoSuchProcess { pid: i32 },
    #[error("invalid device map: {0}")]
    DeviceMap(String),
    #[error("GPU migration (a device map) needs {MIN_DRIVER_MIGRATION}; this driver's API is version {version}")]
    MigrationUnsupported { version: String },
    #[error("the GPUs here do not match the checkpoint's: {0}; pass --device-map OLD=NEW,... to choose targets")]
    GpuMismatch(String),
    /// A restore would run a GPU out of memory, which leaves the process stuck for good (every later
    /// restore 304, unlock 401): refused before anything is restored.
    #[error("GPU {gpu} has {} free, and the checkpoint's processes need {} there; free it, or restore onto another GPU with --device-map", crate::fmt::human_bytes(*free), crate::fmt::human_bytes(*need))]
    NotEnoughGpuMemory { gpu: GpuUuid, need: u64, free: u64 },
    #[error("wrong GPU backend: {0}")]
    WrongBackend(String),
    #[error("the checkpoint's GPU record is unreadable: {0}")]
    Record(String),
    /// A tree with GPU state met the hook for trees without it ([`NoGpu`]).
    #[error("the tree holds GPU state (strategy `{strategy}`) but no GPU step is available in this build")]
    NoGpuStep {
        strategy: crate::detect::StrategyName,
    },
    /// A checkpoint with GPU state met the hook for trees without it ([`NoGpu`]).
    #[error("the checkpoint holds GPU state but no GPU step is available in this build")]
    NoGpuStepForRestore,
    /// The caller's [`AfterLock`] barrier said no (a job checkpoint aborted by its coordinator): every
    /// process was unlocked again, nothing was checkpointed. Or its [`BeforeUnlock`] barrier said no (a
    /// job restore aborted): nothing was unlocked, and the flow kills the restored copy.
    #[error("aborted while locked: {0}")]
    Aborted(String),
    /// Several processes failed in one group operation; the first error is the headline.
    #[error("{}", summarize(.0))]
    Many(Vec<Error>),
}

fn summarize(errors: &[Error]) -> String {
    match errors {
        [] => "no error".into(),
        [one] => one.to_string(),
        [first, rest @ ..] => format!("{first} (and {} more: {})", rest.len(), {
            let v: Vec<String> = rest.iter().map(|e| e.to_string()).collect();
            v.join("; ")
        }),
    }
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::LibraryMissing { .. }
            | Error::SymbolMissing { .. }
            | Error::CliMissing
            | Error::NoBackend { .. }
            | Error::MigrationUnsupported { .. } => ExitStatus::ToolMissing,
            Error::NoSuchProcess { .. } => ExitStatus::NoSuchProcess,
            Error::DeviceMap(_) | Error::WrongBackend(_) => ExitStatus::Usage,
            Error::GpuMismatch(_) | Error::NotEnoughGpuMemory { .. } => ExitStatus::Conflict,
            Error::Record(_) => ExitStatus::CheckpointInvalid,
            Error::NoGpuStep { .. } | Error::NoGpuStepForRestore => ExitStatus::Unsupported,
            Error::Cuda { code, .. } if code.is_permission() => ExitStatus::PermissionDenied,
            Error::Many(v) => v.first().map_or(ExitStatus::Failure, Error::exit_status),
            _ => ExitStatus::Failure,
        }
    }
}

impl Error {
    /// True when the process simply has no CUDA state to checkpoint (it loaded libcuda or NVML but never
    /// created a context, or it is not a simulated GPU process): such processes are left alone.
    pub fn is_no_cuda(&self) -> bool {
        match self {
            Error::Cuda { code, .. } => code.is_no_cuda(),
            Error::SimUnreachable { .. } => true,
            _ => false,
        }
    }

    /// The CUDA result code behind this error, if any.
    pub fn cu_error(&self) -> Option<CuError> {
        match self {
            Error::Cuda { code, .. } => Some(*code),
            _ => None,
        }
    }

    pub(crate) fn cuda(op: Op, pid: i32, code: CuError) -> Self {
        Error::Cuda {
            op,
            pid,
            code,
            detail: None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The GPU driver boundary: the per-process checkpoint operations of the CUDA driver.
///
/// Every call is synchronous and thread-safe, so that [`group`] can run one per process in parallel.
/// The state transitions are those of the CUDA driver (RUNNING -> LOCKED -> CHECKPOINTED -> LOCKED ->
/// RUNNING); [`lifecycle`] wraps them in types.
pub trait GpuDriver: Send + Sync {
    /// Which backend this is (`cuda-driver`, `cuda-cli`, `sim`, `fake`).
    fn backend(&self) -> GpuBackend;
    /// The driver version as text, when known (for the manifest and for error messages).
    fn driver_version(&self) -> Option<String>;
    /// The driver is a simulator (the `sim` backend, or the SIMULATED libcuda of `crates/cuda-sim`): only
    /// SIMULATED GPU processes may meet it, and only it may meet them.
    fn simulated(&self) -> bool {
        false
    }
    /// Restores onto other GPUs (a device map) are possible: driver 580 (CUDA 13.0) and later.
    fn supports_migration(&self) -> bool {
        true
    }
    fn state(&self, pid: i32) -> Result<ProcessState>;
    /// RUNNING -> LOCKED: blocks new GPU work and waits for submitted work, up to `timeout`
    /// (`None` = no limit). On expiry the driver answers NOT_READY and the process stays RUNNING.
    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<()>;
    /// LOCKED -> CHECKPOINTED: device memory moves into host memory, GPU references are released.
    fn checkpoint(&self, pid: i32) -> Result<()>;
    /// CHECKPOINTED -> LOCKED, onto the GPUs named by `pairs` (old UUID -> new UUID; empty = same GPUs).
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<()>;
    /// LOCKED -> RUNNING.
    fn unlock(&self, pid: i32) -> Result<()>;
    /// The thread id of the driver's restore thread inside the process.
    fn restore_thread_id(&self, pid: i32) -> Result<i32>;
    /// The GPUs this backend sees on this node, in index order.
    fn gpus(&self) -> Result<Vec<GpuInfo>>;
    /// The GPUs process `pid` uses, when the backend can tell (NVML's compute processes, the simulator).
    fn process_gpus(&self, _pid: i32) -> Option<Vec<GpuUuid>> {
        None
    }
    /// The device memory process `pid` holds on each GPU, when the backend can tell (NVML, the
    /// simulator): what its restore will need there.
    fn process_memory(&self, _pid: i32) -> Option<Vec<GpuMemory>> {
        None
    }
    /// Free memory of a GPU of this node, when the backend can tell (NVML, the simulator).
    fn free_memory(&self, _gpu: &GpuUuid) -> Option<u64> {
        None
    }
    /// What setting the backend up cost (cuda-driver: dlopen, symbol lookup, cuInit).
    fn setup_timings(&self) -> Option<SetupTimings> {
        None
    }
}

/// Which GPU driver boundary to use: `--gpu-backend`, and the backend a checkpoint's GPU record names.
///
/// Its names (`auto`, `cuda-driver`, ...) have one source, strum's kebab-case of the variants: text
/// ([`Self::as_str`], `Display`, `FromStr`), JSON (serde goes through the same two) and the command line
/// (the binary lists [`strum::VariantArray::VARIANTS`] with each one's documentation as its help, through
/// [`strum::EnumMessage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(into = "&'static str", try_from = "String")]
#[derive(
    strum::IntoStaticStr, strum::Display, strum::EnumString, strum::VariantArray, strum::EnumMessage,
)]
#[strum(serialize_all = "kebab-case")]
pub enum GpuBackend {
    /// cuda-driver when libcuda has the checkpoint API (driver >= 570), else cuda-cli when
    /// `cuda-checkpoint` is on PATH. Never the simulator.
    Auto,
    /// The CUDA driver API, in-process (libcuda.so.1, driver >= 570).
    CudaDriver,
    /// NVIDIA's `cuda-checkpoint` binary (drivers 550-569).
    CudaCli,
    /// The SIMULATED GPU of `gpu-sim-workload` (tests and demos only).
    Sim,
    /// The in-memory test implementation (`fake`): the library's unit tests only, so no build of the tool
    /// can name it.
    #[cfg(test)]
    Fake,
}

impl GpuBackend {
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// How serde reads a name (`try_from`): `FromStr`, with an error that lists the names.
impl TryFrom<String> for GpuBackend {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        use strum::VariantArray;
        s.parse().map_err(|_| {
            let names: Vec<&str> = GpuBackend::VARIANTS.iter().map(|b| b.as_str()).collect();
            Error::DeviceMap(format!("unknown GPU backend `{s}` ({})", names.join(", ")))
        })
    }
}

/// Opens the chosen backend. `Auto` prefers the in-process driver API and falls back to the
/// `cuda-checkpoint` binary; it never picks the simulator.
pub fn open(backend: GpuBackend) -> Result<Arc<dyn GpuDriver>> {
    match backend {
        GpuBackend::CudaDriver => Ok(Arc::new(cuda_driver::CudaDriver::open()?)),
        GpuBackend::CudaCli => Ok(Arc::new(cuda_cli::CudaCli::open()?)),
        GpuBackend::Sim => Ok(Arc::new(sim::SimDriver::new())),
        #[cfg(test)]
        GpuBackend::Fake => Ok(Arc::new(fake::FakeDriver::new())),
        GpuBackend::Auto => {
            let driver_err = match cuda_driver::CudaDriver::open() {
                Ok(d) => return Ok(Arc::new(d)),
                Err(e) => e,
            };
            match cuda_cli::CudaCli::open() {
                Ok(c) => Ok(Arc::new(c)),
                Err(cli_err) => Err(Error::NoBackend {
                    reason: format!("{driver_err}; {cli_err}"),
                }),
            }
        }
    }
}

/// What this machine offers for GPU checkpoints (for `gpu-checkpoint doctor`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Probe {
    /// The in-process API: the CUDA version of libcuda ...
    pub cuda_driver: Option<String>,
    /// ... or why it is unusable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_driver_error: Option<String>,
    /// The argument layout chosen for it (`12.8`, `13.0`, `13.3`, `13.4`).
    pub cuda_layout: Option<&'static str>,
    /// What it can do beyond the four operations ([`cuda_driver::CudaDriver::capabilities`]).
    pub cuda_capabilities: Vec<&'static str>,
    /// `cuda-checkpoint` on PATH.
    pub cuda_cli: Option<std::path::PathBuf>,
    /// The display driver version from NVML.
    pub nvml_driver: Option<String>,
    pub gpus: Vec<GpuInfo>,
    /// What `--gpu-backend auto` would pick.
    pub auto: Option<GpuBackend>,
}

/// Looks for every real backend without touching any process.
pub fn probe() -> Probe {
    let opened = cuda_driver::CudaDriver::open();
    let (cuda_driver, cuda_driver_error) = match &opened {
        Ok(d) => (d.driver_version(), None),
        Err(e) => (None, Some(e.to_string())),
    };
    let (cuda_layout, cuda_capabilities) = match &opened {
        Ok(d) => (Some(d.layout().name()), d.capabilities()),
        Err(_) => (None, Vec::new()),
    };
    // NVML lists the GPUs of a real node; the driver lists them where there is no NVML (the SIMULATED
    // libcuda).
    let nvml_gpus = cuda_driver::nvml_gpus().unwrap_or_default();
    let gpus = match &opened {
        Ok(d) if nvml_gpus.is_empty() => d.gpus().unwrap_or_default(),
        _ => nvml_gpus,
    };
    let cuda_cli = cuda_cli::CudaCli::open()
        .ok()
        .map(|c| c.path().to_path_buf());
    let auto = if cuda_driver.is_some() {
        Some(GpuBackend::CudaDriver)
    } else if cuda_cli.is_some() {
        Some(GpuBackend::CudaCli)
    } else {
        None
    };
    Probe {
        cuda_driver,
        cuda_driver_error,
        cuda_layout,
        cuda_capabilities,
        cuda_cli,
        nvml_driver: cuda_driver::nvml_driver_version(),
        gpus,
        auto,
    }
}

/// Checks that `pid` exists before asking a driver about it, so that "no such process" is not
/// mistaken for "no CUDA state".
pub fn ensure_process(pid: i32) -> Result<()> {
    if pid > 0 && crate::proc::pid_taken(pid) {
        Ok(())
    } else {
        Err(Error::NoSuchProcess { pid })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_round_trip_in_text_and_json() {
        use strum::VariantArray;
        for b in GpuBackend::VARIANTS {
            assert_eq!(b.as_str().parse::<GpuBackend>().unwrap(), *b);
            assert_eq!(b.to_string(), b.as_str());
            let json = serde_json::to_string(b).unwrap();
            assert_eq!(json, format!("\"{}\"", b.as_str()));
            assert_eq!(serde_json::from_str::<GpuBackend>(&json).unwrap(), *b);
            // Owned strings too (a manifest read through serde_json::Value).
            assert_eq!(
                serde_json::from_value::<GpuBackend>(b.as_str().into()).unwrap(),
                *b
            );
        }
        assert_eq!(GpuBackend::CudaDriver.as_str(), "cuda-driver");
        assert!("gpu".parse::<GpuBackend>().is_err());
        let err = serde_json::from_str::<GpuBackend>("\"gpu\"").unwrap_err();
        assert!(
            err.to_string()
                .contains("unknown GPU backend `gpu` (auto, cuda-driver"),
            "{err}"
        );
    }

    #[test]
    fn exit_statuses() {
        assert_eq!(Error::CliMissing.exit_status(), ExitStatus::ToolMissing);
        assert_eq!(
            Error::NoSuchProcess { pid: 1 }.exit_status(),
            ExitStatus::NoSuchProcess
        );
        assert_eq!(
            Error::GpuMismatch("x".into()).exit_status(),
            ExitStatus::Conflict
        );
        let e = Error::cuda(Op::Lock, 5, CuError::NotReady);
        assert_eq!(e.exit_status(), ExitStatus::Failure);
        assert!(e.to_string().contains("lock of pid 5"), "{e}");
        assert!(Error::cuda(Op::State, 5, CuError::NotInitialized).is_no_cuda());
        assert!(!Error::cuda(Op::State, 5, CuError::IllegalState).is_no_cuda());
    }

    #[test]
    fn many_errors_summarize_all() {
        let e = Error::Many(vec![
            Error::cuda(Op::Lock, 1, CuError::NotReady),
            Error::cuda(Op::Lock, 2, CuError::IllegalState),
        ]);
        let s = e.to_string();
        assert!(
            s.contains("pid 1") && s.contains("pid 2") && s.contains("1 more"),
            "{s}"
        );
    }

    #[test]
    fn ensure_process_finds_self_not_garbage() {
        ensure_process(std::process::id() as i32).unwrap();
        assert!(matches!(
            ensure_process(-4),
            Err(Error::NoSuchProcess { .. })
        ));
    }
}
