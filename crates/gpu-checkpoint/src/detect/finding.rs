//! What a process holds, as [`Finding`]s: their kinds, their evidence, and which of them are GPU state.
//!
//! Each finding carries its evidence (fds, path, address range, size, library, variable) so that a user
//! can check it by hand with `ls -l /proc/PID/fd` and `cat /proc/PID/maps`. [`super::classify`] makes them.

use serde::{Deserialize, Serialize};

/// The kinds of finding. Users script against these names: never rename one. The names are serde's and
/// strum's `kebab-case` of the variant (a test holds the two together).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "kebab-case")]
#[derive(strum::IntoStaticStr, strum::Display, strum::VariantArray)]
#[strum(serialize_all = "kebab-case")]
pub enum FindingKind {
    /// `/dev/nvidiactl` open: the process talks to the NVIDIA driver.
    NvidiaCtl,
    /// `/dev/nvidiaN` (a GPU), `/dev/nvidia-modeset` or `/dev/nvidia-nvswitchN` open.
    NvidiaDevice,
    /// `/dev/nvidia-uvm` or `/dev/nvidia-uvm-tools` open (normal for every CUDA process).
    NvidiaUvm,
    /// Shared mappings of `/dev/nvidia-uvm`: managed (UVM) memory ranges.
    ManagedMemory,
    /// Shared mappings of `/dev/nvidiactl` (driver / pinned host memory) or `/dev/nvidiaN` (BAR windows,
    /// device memory mapped to the host); with `--simulator`, the simulator's device memory.
    DeviceMapping,
    /// CUDA libraries loaded, the CUDA restore thread, or (with `--simulator`) the simulator's control socket.
    CudaLibrary,
    /// NVML loaded, or NVML lists the process as a compute process.
    Nvml,
    /// CUDA IPC: `/dev/shm/cuda.shm.*`, and other shared segments mapped by a GPU process.
    CudaIpc,
    /// NCCL: `/dev/shm/nccl-*`, libnccl, `NCCL_*` variables.
    Nccl,
    /// RDMA verbs devices (`/dev/infiniband/*`).
    Rdma,
    /// PCIe BARs mapped directly: sysfs `resource*` files, `/dev/mem`, VFIO.
    PciBar,
    /// MIG: `/dev/nvidia-caps/*`, `MIG-` device ids.
    Mig,
    /// MPS: `CUDA_MPS_*` variables, sockets into the MPS pipe folder, the MPS daemons themselves.
    Mps,
    /// AMD GPUs: `/dev/kfd`, `/dev/dri/renderD*` (with KFD or ROCm), HIP/ROCm libraries.
    AmdGpu,
    /// GPU-related variables (`CUDA_VISIBLE_DEVICES`, `NVIDIA_VISIBLE_DEVICES`, ...).
    GpuEnv,
    /// Something CRIU dumps only when given an option (a held file lock, a large deleted file, an
    /// established TCP connection, a UNIX socket connected outside the tree): `needs` says which, `remedy`
    /// names the checkpoint flag. Not GPU state and no blocker: a checkpoint without the flag is refused
    /// before the tree is touched.
    NeedsOption,
    /// Something CRIU cannot dump at all, found before the tree is touched (an io_uring instance, SysV
    /// shared memory of the host's IPC namespace, a terminal shared with processes outside the tree,
    /// another user's process without `CAP_SYS_RESOURCE`, a PID namespace without its init): `limit`
    /// names which, `remedy` what to do. Not GPU state and no blocker (the strategy is the GPU's); a
    /// checkpoint is refused before it touches the tree (docs/criu.md).
    CannotDump,
}

impl FindingKind {
    /// The name, as in JSON (`nvidia-ctl`, `managed-memory`, ...).
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// A CRIU option a checkpoint of a process needs (the `needs` of a `needs-option` finding). JSON:
/// `{"option": "ghost-limit", "bytes": 2097152}`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "option", rename_all = "kebab-case")]
pub enum NeededOption {
    /// A file lock is held (`--file-locks`).
    FileLocks,
    /// A deleted file holding `bytes` on disk is open: CRIU copies its contents only up to `--ghost-limit`.
    GhostLimit { bytes: u64 },
    /// A TCP connection is established (`--tcp-established`, or `--tcp-close`).
    TcpEstablished,
    /// A datagram socket (inode `inode`) is connected to a named socket outside the tree
    /// (`--ext-unix-sk`, or `--external unix[INODE]`).
    ExtUnixSk { inode: u64 },
    /// A resource CRIU can only treat as external (`--external RESOURCE`).
    External { resource: String },
    /// The tree shares a terminal or session with processes outside it (`--shell-job`).
    ShellJob,
}

impl NeededOption {
    /// The checkpoint flag that provides it (`--ghost-limit` rounded up to whole MiB).
    pub fn flag(&self) -> String {
        match self {
            NeededOption::FileLocks => "--file-locks".into(),
            NeededOption::GhostLimit { bytes } => {
                format!("--ghost-limit {}M", bytes.div_ceil(1 << 20))
            }
            NeededOption::TcpEstablished => "--tcp-established".into(),
            NeededOption::ExtUnixSk { .. } => "--ext-unix-sk".into(),
            NeededOption::External { resource } => format!("--external {resource}"),
            NeededOption::ShellJob => "--shell-job".into(),
        }
    }
}

/// What CRIU cannot dump (the `limit` of a `cannot-dump` finding). Users script against these names.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "kebab-case")]
#[derive(strum::IntoStaticStr, strum::Display, strum::VariantArray)]
#[strum(serialize_all = "kebab-case")]
pub enum Limit {
    /// An io_uring instance (`anon_inode:[io_uring]`).
    IoUring,
    /// SysV shared memory of the IPC namespace CRIU runs in (it dumps SysV IPC only with a namespace of
    /// the tree's own).
    SysvShm,
    /// `/dev/tty` of a session whose terminal another process holds ("ctty inheritance").
    Terminal,
    /// Another user's process, and no `CAP_SYS_RESOURCE` to read its resource limits.
    OtherUser,
    /// A PID namespace without its init in the tree, nested deeper, or whose session leader is outside.
    PidNamespace,
}

/// One thing found in one process.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Finding {
    pub kind: FindingKind,
    pub pid: i32,
    pub evidence: Evidence,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Why a finding was made. Only the fields that apply are present in JSON.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
pub struct Evidence {
    /// One human sentence.
    pub detail: String,
    /// Open file descriptors on `path`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fds: Vec<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// `0xSTART-0xEND` of the mapping, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// `0xSTART-0xEND` of each mapping, when there are several.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranges: Vec<String>,
    /// Bytes mapped (summed over `mappings`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Number of mappings summed in `size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mappings: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub library: Option<String>,
    /// `NAME=value` of a GPU variable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variable: Option<String>,
    /// GPU index (`/dev/nvidiaN`, NVML).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u32>,
    /// Thread id (the CUDA restore thread).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tid: Option<i32>,
    /// UNIX socket path (`@` = abstract namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket: Option<String>,
    /// True for the GPU simulator's state (tests and demos only; never on by default).
    #[serde(default, skip_serializing_if = "is_false")]
    pub simulated: bool,
    /// The CRIU option a `needs-option` finding asks for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub needs: Option<NeededOption>,
    /// What to do about a `needs-option` finding (the checkpoint flag to add) or a `cannot-dump` one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remedy: Option<String>,
    /// What a `cannot-dump` finding is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<Limit>,
}

impl Finding {
    /// True when the finding is GPU (or device) state the process holds, as opposed to context such as a
    /// variable or a loaded-but-unused library. Decides `gpu` in the report and which processes
    /// `--all` lists.
    pub fn is_state(&self) -> bool {
        let e = &self.evidence;
        match self.kind {
            FindingKind::NvidiaCtl
            | FindingKind::NvidiaDevice
            | FindingKind::NvidiaUvm
            | FindingKind::ManagedMemory
            | FindingKind::DeviceMapping
            // A BAR mapped from user space may well be a GPU's (the "BAR sliding" tools do exactly that).
            | FindingKind::PciBar => true,
            // RDMA blocks a checkpoint (see strategy) but is not GPU state: an MPI job without GPUs is
            // not what `--all` lists.
            FindingKind::Rdma => false,
            // /dev/nvidia-caps open, not a MIG- id in a variable.
            FindingKind::Mig => e.path.is_some(),
            // Listed by NVML (no library), not merely libnvidia-ml loaded.
            FindingKind::Nvml => e.library.is_none(),
            // /dev/kfd or a render node, not merely a ROCm library.
            FindingKind::AmdGpu => e.library.is_none(),
            FindingKind::CudaLibrary => e.simulated,
            FindingKind::CudaIpc
            | FindingKind::Nccl
            | FindingKind::Mps
            | FindingKind::GpuEnv
            | FindingKind::NeedsOption
            | FindingKind::CannotDump => false,
        }
    }

    /// True for NVIDIA state of a real (not simulated) GPU.
    pub fn is_nvidia_state(&self) -> bool {
        !self.evidence.simulated
            && match self.kind {
                FindingKind::NvidiaCtl
                | FindingKind::NvidiaDevice
                | FindingKind::NvidiaUvm
                | FindingKind::ManagedMemory
                | FindingKind::DeviceMapping => true,
                FindingKind::Mig | FindingKind::Nvml => self.is_state(),
                _ => false,
            }
    }
}
