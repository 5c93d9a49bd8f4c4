//! Deciding how to checkpoint: one strategy per process and one for the whole scope, or a refusal with
//! blockers a user can act on.

use serde::{Deserialize, Serialize};

use super::context::{contextless_mappings, has_cuda_context};
use super::finding::{Finding, FindingKind};
use crate::fmt::human_bytes;

/// How a process (tree) can be checkpointed. Users script against these names (serde's and strum's
/// `kebab-case` of the variant).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "kebab-case")]
#[derive(strum::IntoStaticStr, strum::Display, strum::VariantArray)]
#[strum(serialize_all = "kebab-case")]
pub enum StrategyName {
    /// No GPU state: CRIU alone.
    #[default]
    None,
    /// The CUDA driver checkpoint API, in-process (driver >= 570).
    CudaDriver,
    /// The `cuda-checkpoint` binary (drivers 550-569).
    CudaCli,
    /// CRIU's amdgpu plugin.
    Amdgpu,
    /// Refused: see the blockers.
    Unsupported,
}

impl StrategyName {
    /// The name, as in JSON (`cuda-driver`, ...).
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Order used to combine the processes of a tree: the strategy that needs the most wins.
    fn rank(self) -> u8 {
        match self {
            StrategyName::None => 0,
            StrategyName::Amdgpu => 1,
            StrategyName::CudaDriver => 2,
            StrategyName::CudaCli => 3,
            StrategyName::Unsupported => 4,
        }
    }
}

/// Why a checkpoint is refused. Users script against these names (serde's and strum's `kebab-case` of
/// the variant).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[serde(rename_all = "kebab-case")]
#[derive(strum::IntoStaticStr, strum::Display, strum::VariantArray)]
#[strum(serialize_all = "kebab-case")]
pub enum BlockerKind {
    ManagedMemory,
    CudaIpc,
    Mig,
    Mps,
    PciBar,
    Rdma,
    DriverTooOld,
    /// A process without a CUDA context maps `/dev/nvidiactl` (an NVML client such as nvidia-smi).
    DeviceMapping,
}

impl BlockerKind {
    /// The name, as in JSON (`managed-memory`, ...).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// One reason to refuse, with the evidence in `message` and what the user can do in `remedy`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Blocker {
    pub kind: BlockerKind,
    pub pid: i32,
    pub message: String,
    pub remedy: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct StrategyDecision {
    pub name: StrategyName,
    pub blockers: Vec<Blocker>,
}

/// The oldest driver with any checkpoint support (`cuda-checkpoint --toggle`).
pub const MIN_DRIVER_CLI: u32 = 550;
/// The first driver with the in-process checkpoint API (`cuCheckpointProcess*`).
pub const MIN_DRIVER_API: u32 = 570;
/// The first driver that checkpoints CUDA IPC, for all processes of one job together.
pub const MIN_DRIVER_IPC: u32 = 610;

/// What the strategy of a process depends on besides its findings.
#[derive(Clone, Copy, Debug)]
pub struct Scope {
    /// NVIDIA driver major version, when known.
    pub driver_major: Option<u32>,
    /// The whole process tree is in scope (`--tree`): IPC between its processes can be checkpointed
    /// together on drivers >= 610.
    pub tree: bool,
}

/// The strategy of one process, and whether the GPU it uses is the simulator.
pub fn decide_process(
    pid: i32,
    findings: &[Finding],
    scope: Scope,
) -> (StrategyName, Vec<Blocker>, bool) {
    let mine = || findings.iter().filter(move |f| f.pid == pid);
    let nvidia = mine().any(Finding::is_nvidia_state);
    // NVIDIA device files without a CUDA context (NVML only, a child forked without exec): nothing for
    // the GPU step; CRIU's devices plugin reopens the descriptors (docs/criu.md).
    let context = nvidia && has_cuda_context(mine());
    let simulated = !nvidia && mine().any(|f| f.evidence.simulated && f.is_state());
    let amd = mine().any(|f| f.kind == FindingKind::AmdGpu && f.is_state());
    let gpu = nvidia || simulated || amd;

    let mut blockers = Vec::new();
    let mut block = |kind, message: String, remedy: &str| {
        blockers.push(Blocker {
            kind,
            pid,
            message,
            remedy: remedy.to_string(),
        })
    };

    // One blocker per kind, its message joining the evidence of every finding behind it.
    let evidence = |pred: &dyn Fn(&Finding) -> bool| -> Option<String> {
        let details: Vec<&str> = mine()
            .filter(|f| pred(f))
            .map(|f| f.evidence.detail.as_str())
            .collect();
        (!details.is_empty()).then(|| details.join("; "))
    };

    // Devices CRIU cannot dump, GPU or not.
    if let Some(ev) = evidence(&|f| f.kind == FindingKind::PciBar) {
        block(BlockerKind::PciBar, ev, PCI_BAR_REMEDY);
    }
    if let Some(ev) = evidence(&|f| f.kind == FindingKind::Rdma) {
        block(
            BlockerKind::Rdma,
            ev,
            "CRIU cannot checkpoint RDMA verbs state: close the RDMA resources first (e.g. NCCL_IB_DISABLE=1 \
             for a single-node job), or checkpoint at the application level",
        );
    }
    if nvidia && !context {
        let held = contextless_mappings(mine());
        if let Some(ev) = join(&held.control) {
            block(
                BlockerKind::DeviceMapping,
                format!("no CUDA context, yet it maps the NVIDIA control device: {ev}"),
                NVML_MAPPING_REMEDY,
            );
        }
    }

    if gpu {
        let managed: Vec<&Finding> = mine()
            .filter(|f| f.kind == FindingKind::ManagedMemory)
            .collect();
        if !managed.is_empty() {
            let size: u64 = managed.iter().filter_map(|f| f.evidence.size).sum();
            let n: u32 = managed.iter().filter_map(|f| f.evidence.mappings).sum();
            block(
                BlockerKind::ManagedMemory,
                format!(
                    "managed (UVM) memory: {n} mapping(s) of /dev/nvidia-uvm, {} in all",
                    human_bytes(size)
                ),
                "the CUDA checkpoint does not support managed memory (cudaMallocManaged): driver 580 \
                 refuses it (NOT_SUPPORTED) and older drivers can leave the process broken. Allocate with \
                 cudaMalloc instead, or wait for driver support",
            );
        }
        let ipc_ok = scope.tree && scope.driver_major.is_some_and(|d| d >= MIN_DRIVER_IPC);
        if let Some(ev) = evidence(&is_ipc_channel).filter(|_| !ipc_ok) {
            block(
                BlockerKind::CudaIpc,
                format!("CUDA IPC between processes: {ev}"),
                "drivers before 610 cannot checkpoint CUDA IPC; with driver >= 610, checkpoint the \
                 whole job at once (--tree on its top process) and set NCCL_CUMEM_ENABLE=0",
            );
        }
        if let Some(ev) = evidence(&|f| f.kind == FindingKind::Mig) {
            block(
                BlockerKind::Mig,
                ev,
                "the driver does not support checkpointing processes on MIG instances: run the job on a \
                 whole GPU (MIG disabled) to checkpoint it",
            );
        }
        if let Some(ev) = evidence(&|f| f.kind == FindingKind::Mps) {
            block(
                BlockerKind::Mps,
                format!("MPS client or daemon: {ev}"),
                "the CUDA checkpoint does not support MPS: run the job outside MPS (unset CUDA_MPS_* and \
                 stop the MPS daemon for its GPUs)",
            );
        }
        if context {
            if let Some(d) = scope.driver_major.filter(|d| *d < MIN_DRIVER_CLI) {
                block(
                    BlockerKind::DriverTooOld,
                    format!("NVIDIA driver {d} has no checkpoint support (550 is the first)"),
                    "upgrade the NVIDIA driver to >= 570 (in-process API; 550-569 work through the \
                     cuda-checkpoint binary)",
                );
            }
        }
    }

    let name = if !blockers.is_empty() {
        StrategyName::Unsupported
    } else if context {
        match scope.driver_major {
            Some(d) if d < MIN_DRIVER_API => StrategyName::CudaCli,
            // Unknown driver (a capture without driver/nvidia/version): the freeze stage checks the API
            // is there before it touches the process.
            _ => StrategyName::CudaDriver,
        }
    } else if simulated {
        StrategyName::CudaDriver
    } else if amd {
        StrategyName::Amdgpu
    } else {
        StrategyName::None
    };
    (name, blockers, simulated)
}

/// The details of several findings, joined.
fn join(findings: &[&Finding]) -> Option<String> {
    let d: Vec<&str> = findings
        .iter()
        .map(|f| f.evidence.detail.as_str())
        .collect();
    (!d.is_empty()).then(|| d.join("; "))
}

/// The remedy of a `device-mapping` blocker: an NVML client's mapping of the control device is state of a
/// driver client that a restored process will not have.
pub const NVML_MAPPING_REMEDY: &str = "reopening its NVIDIA descriptors cannot bring back what that \
     mapping holds (state of a driver client the restored process will not have): stop the NVML client in \
     this process before the checkpoint and start it again after the restore (nvidia-smi, DCGM and other \
     monitoring agents belong to a node: run one on each node rather than migrating it), or checkpoint a \
     tree without it. A child forked from a CUDA process that kept such mappings: start it with exec \
     (multiprocessing's spawn or forkserver instead of fork), or fork before CUDA is initialised";

/// The remedy of a `pci-bar` blocker. It says plainly that "BAR sliding" is no way out: the seeds of this
/// project proposed it as a universal fallback, and users will ask.
pub const PCI_BAR_REMEDY: &str = "unmap the BAR (or stop the process that maps it) before checkpointing: \
     neither CRIU nor the CUDA checkpoint can save a raw BAR mapping. \"BAR sliding\" (moving the BAR0 \
     PRAMIN window across VRAM) is no fallback: it only reads raw VRAM, at MB/s and racing the driver, and \
     cannot restore state, because page tables, channels and engine contexts are re-created elsewhere by a \
     new driver instance";

/// Segments through which GPU processes exchange IPC handles. Other shared segments of a GPU process
/// are reported but do not block: CRIU dumps shared memory itself.
pub(crate) fn is_ipc_channel(f: &Finding) -> bool {
    let path = f.evidence.path.as_deref().unwrap_or("");
    (f.kind == FindingKind::CudaIpc && path.starts_with("/dev/shm/cuda.shm."))
        || (f.kind == FindingKind::Nccl && path.starts_with("/dev/shm/nccl-"))
}

/// The strategy of the whole scope from those of its processes.
pub fn combine(per_process: &[(StrategyName, Vec<Blocker>)]) -> StrategyDecision {
    let blockers: Vec<Blocker> = per_process
        .iter()
        .flat_map(|(_, b)| b.iter().cloned())
        .collect();
    let name = per_process
        .iter()
        .map(|(n, _)| *n)
        .max_by_key(|n| n.rank())
        .unwrap_or_default();
    StrategyDecision { name, blockers }
}
