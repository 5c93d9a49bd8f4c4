//! What a process holds: classify its maps, fds, variables, sockets and threads into [`Finding`]s.
//!
//! Each finding carries its evidence (fds, path, address range, size, library, variable) so that a user
//! can check it by hand with `ls -l /proc/PID/fd` and `cat /proc/PID/maps`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::parse::{socket_inode, MapEntry};
use super::process::ProcessSnapshot;
use crate::fmt::human_bytes;

/// The kinds of finding. Users script against these names: never rename one.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "kebab-case")]
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
}

impl FindingKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::NvidiaCtl => "nvidia-ctl",
            FindingKind::NvidiaDevice => "nvidia-device",
            FindingKind::NvidiaUvm => "nvidia-uvm",
            FindingKind::ManagedMemory => "managed-memory",
            FindingKind::DeviceMapping => "device-mapping",
            FindingKind::CudaLibrary => "cuda-library",
            FindingKind::Nvml => "nvml",
            FindingKind::CudaIpc => "cuda-ipc",
            FindingKind::Nccl => "nccl",
            FindingKind::Rdma => "rdma",
            FindingKind::PciBar => "pci-bar",
            FindingKind::Mig => "mig",
            FindingKind::Mps => "mps",
            FindingKind::AmdGpu => "amd-gpu",
            FindingKind::GpuEnv => "gpu-env",
        }
    }
}

impl std::fmt::Display for FindingKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
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
            FindingKind::CudaIpc | FindingKind::Nccl | FindingKind::Mps | FindingKind::GpuEnv => {
                false
            }
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

/// Prefix of the GPU simulator's device-memory files (tests and demos only).
pub const SIM_SHM_PREFIX: &str = "/dev/shm/gpu-checkpoint-sim/";
/// Prefix of the GPU simulator's control socket, in the abstract namespace (tests and demos only).
pub const SIM_SOCKET_PREFIX: &str = "@gpu-checkpoint-sim/";
/// The abstract socket every CUDA process listens on (`@cuda-uvmfd-<pidns inode>-<pid>@`, driver 580): the
/// driver's channel for passing UVM fds between processes. It stays while the process is checkpointed.
pub const CUDA_UVMFD_SOCKET_PREFIX: &str = "@cuda-uvmfd-";
/// Where MPS puts its pipes unless `CUDA_MPS_PIPE_DIRECTORY` says otherwise.
pub const DEFAULT_MPS_PIPE_DIR: &str = "/tmp/nvidia-mps";

/// What a path names, for classification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathClass {
    NvidiaCtl,
    /// `/dev/nvidiaN`.
    NvidiaGpu(u32),
    /// `/dev/nvidia-modeset`, `/dev/nvidia-nvswitchN`, `/dev/nvidia-nvlink`, ...
    NvidiaOther,
    NvidiaUvm,
    /// `/dev/nvidia-caps/nvidia-capN` of a MIG instance (GPU or compute instance access).
    NvidiaCaps,
    /// `/dev/nvidia-caps/nvidia-cap1` and `-cap2`: the MIG *config* and *monitor* capabilities, which
    /// NVML users (nvidia-smi, PyTorch) open even with MIG disabled. Not MIG use (docs/hardware.md).
    NvidiaCapsMgmt,
    Kfd,
    RenderNode,
    Rdma,
    /// sysfs `resource*`, `/dev/mem`, `/dev/vfio/*`.
    PciBar,
    ShmCudaIpc,
    ShmNccl,
    ShmSim,
    ShmOther,
    Other,
}

impl PathClass {
    /// A device file whose mere presence (open or mapped) makes a process worth a full read in a node
    /// scan. Render nodes are left out: alone they are any GPU's (they count next to `/dev/kfd`).
    pub fn is_device(self) -> bool {
        matches!(
            self,
            PathClass::NvidiaCtl
                | PathClass::NvidiaGpu(_)
                | PathClass::NvidiaOther
                | PathClass::NvidiaUvm
                | PathClass::NvidiaCaps
                | PathClass::NvidiaCapsMgmt
                | PathClass::Kfd
                | PathClass::Rdma
                | PathClass::PciBar
        )
    }
}

/// Classifies a device or file path (from maps or an fd link).
pub fn classify_path(path: &str) -> PathClass {
    if let Some(rest) = path.strip_prefix("/dev/nvidia") {
        return match rest {
            "ctl" => PathClass::NvidiaCtl,
            "-uvm" | "-uvm-tools" => PathClass::NvidiaUvm,
            _ if rest.starts_with("-caps") => {
                // Minors 1 and 2 are "config" and "monitor" in /proc/driver/nvidia-caps/mig-minors.
                match rest.rsplit("nvidia-cap").next() {
                    Some("1") | Some("2") => PathClass::NvidiaCapsMgmt,
                    _ => PathClass::NvidiaCaps,
                }
            }
            _ if !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()) => rest
                .parse()
                .map(PathClass::NvidiaGpu)
                .unwrap_or(PathClass::NvidiaOther),
            _ if rest.starts_with('-') => PathClass::NvidiaOther,
            _ => PathClass::Other,
        };
    }
    if path == "/dev/kfd" {
        return PathClass::Kfd;
    }
    if path.starts_with("/dev/dri/renderD") {
        return PathClass::RenderNode;
    }
    if path.starts_with("/dev/infiniband/") {
        return PathClass::Rdma;
    }
    if path == "/dev/mem" || path.starts_with("/dev/vfio/") || is_sysfs_pci_resource(path) {
        return PathClass::PciBar;
    }
    if let Some(name) = path.strip_prefix("/dev/shm/") {
        return if name.starts_with("cuda.shm.") {
            PathClass::ShmCudaIpc
        } else if name.starts_with("nccl-") {
            PathClass::ShmNccl
        } else if path.starts_with(SIM_SHM_PREFIX) {
            PathClass::ShmSim
        } else {
            PathClass::ShmOther
        };
    }
    PathClass::Other
}

/// `/sys/bus/pci/devices/0000:01:00.0/resource1`, `/sys/devices/pci0000:00/.../resource0_wc`.
fn is_sysfs_pci_resource(path: &str) -> bool {
    if !(path.starts_with("/sys/bus/pci/devices/") || path.starts_with("/sys/devices/pci")) {
        return false;
    }
    let base = path.rsplit('/').next().unwrap_or("");
    base.strip_prefix("resource").is_some_and(|n| {
        !n.is_empty()
            && n.trim_end_matches("_wc")
                .bytes()
                .all(|b| b.is_ascii_digit())
    })
}

/// GPU libraries, by file-name prefix, and the finding kind each implies.
const LIBRARIES: &[(&str, FindingKind)] = &[
    ("libcuda.so", FindingKind::CudaLibrary),
    ("libcudart", FindingKind::CudaLibrary),
    ("libnvidia-ml.so", FindingKind::Nvml),
    ("libnccl", FindingKind::Nccl),
    ("libamdhip64", FindingKind::AmdGpu),
    ("libhsa-runtime64", FindingKind::AmdGpu),
];

fn library_kind(path: &str) -> Option<FindingKind> {
    let base = path.rsplit('/').next()?;
    LIBRARIES
        .iter()
        .find(|(prefix, _)| base.starts_with(prefix))
        .map(|(_, k)| *k)
}

/// What classification needs besides the process itself.
pub struct ClassifyContext<'a> {
    /// Recognise the GPU simulator's devices (tests and demos only).
    pub simulator: bool,
    /// Path of a UNIX socket inode (from `net/unix`), when it has one.
    pub socket_path: &'a dyn Fn(u64) -> Option<String>,
}

/// Accumulates the mappings or fds of one (kind, path).
#[derive(Default)]
struct Acc {
    fds: Vec<i32>,
    ranges: Vec<(u64, u64)>,
    size: u64,
    mappings: u32,
    gpu: Option<u32>,
    simulated: bool,
}

impl Acc {
    fn add_map(&mut self, m: &MapEntry) {
        self.ranges.push((m.start, m.end));
        self.size += m.size();
        self.mappings += 1;
    }

    /// (`address`, `ranges`) of the evidence: one range, or each of several.
    fn address(&self) -> (Option<String>, Vec<String>) {
        let fmt = |(a, b): &(u64, u64)| format!("{a:#x}-{b:#x}");
        match self.ranges.as_slice() {
            [] => (None, Vec::new()),
            [one] => (Some(fmt(one)), Vec::new()),
            many => (None, many.iter().map(fmt).collect()),
        }
    }
}

/// Classifies one process. `threads` is called only for processes with NVIDIA state (reading every
/// thread's name costs one file per thread).
pub fn classify(
    snap: &ProcessSnapshot,
    ctx: &ClassifyContext<'_>,
    threads: &mut dyn FnMut() -> Vec<(i32, String)>,
) -> Vec<Finding> {
    let pid = snap.pid;
    // (kind, path) -> accumulated evidence, ordered so that reports are stable.
    let mut acc: BTreeMap<(FindingKind, String), Acc> = BTreeMap::new();
    let mut other_shm: BTreeMap<String, Acc> = BTreeMap::new();
    let mut libraries: BTreeMap<String, FindingKind> = BTreeMap::new();
    let mut sockets: Vec<(FindingKind, i32, String, bool)> = Vec::new();

    for (fd, target) in &snap.fds {
        let class = classify_path(target);
        let kind = match class {
            PathClass::NvidiaCtl => FindingKind::NvidiaCtl,
            PathClass::NvidiaGpu(_) | PathClass::NvidiaOther | PathClass::NvidiaCapsMgmt => {
                FindingKind::NvidiaDevice
            }
            PathClass::NvidiaUvm => FindingKind::NvidiaUvm,
            PathClass::NvidiaCaps => FindingKind::Mig,
            PathClass::Kfd | PathClass::RenderNode => FindingKind::AmdGpu,
            PathClass::Rdma => FindingKind::Rdma,
            PathClass::PciBar => FindingKind::PciBar,
            PathClass::ShmCudaIpc => FindingKind::CudaIpc,
            PathClass::ShmNccl => FindingKind::Nccl,
            PathClass::ShmSim | PathClass::ShmOther => continue,
            PathClass::Other => {
                if let Some(inode) = socket_inode(target) {
                    if let Some(path) = (ctx.socket_path)(inode) {
                        if ctx.simulator && path.starts_with(SIM_SOCKET_PREFIX) {
                            sockets.push((FindingKind::CudaLibrary, *fd, path, true));
                        } else if path.starts_with(CUDA_UVMFD_SOCKET_PREFIX) {
                            sockets.push((FindingKind::CudaLibrary, *fd, path, false));
                        } else if is_mps_socket(&path, snap) {
                            sockets.push((FindingKind::Mps, *fd, path, false));
                        }
                    }
                }
                continue;
            }
        };
        let a = acc.entry((kind, target.clone())).or_default();
        a.fds.push(*fd);
        if let PathClass::NvidiaGpu(n) = class {
            a.gpu = Some(n);
        }
    }

    let mut driver_uvm_seen = false;
    for m in &snap.maps {
        let Some(path) = m.path.as_deref() else {
            continue;
        };
        if !path.starts_with('/') {
            continue; // [heap], [stack], [vdso], ...
        }
        let class = classify_path(path);
        let kind = match class {
            PathClass::NvidiaCtl
            | PathClass::NvidiaGpu(_)
            | PathClass::NvidiaOther
            | PathClass::NvidiaCapsMgmt => FindingKind::DeviceMapping,
            PathClass::NvidiaUvm if !driver_uvm_seen && is_driver_uvm_mapping(m) => {
                driver_uvm_seen = true;
                FindingKind::DeviceMapping
            }
            PathClass::NvidiaUvm => FindingKind::ManagedMemory,
            PathClass::NvidiaCaps => FindingKind::Mig,
            PathClass::Kfd | PathClass::RenderNode => FindingKind::AmdGpu,
            PathClass::Rdma => FindingKind::Rdma,
            PathClass::PciBar => FindingKind::PciBar,
            PathClass::ShmCudaIpc => FindingKind::CudaIpc,
            PathClass::ShmNccl => FindingKind::Nccl,
            PathClass::ShmSim => {
                if ctx.simulator && m.shared {
                    let a = acc
                        .entry((FindingKind::DeviceMapping, path.to_string()))
                        .or_default();
                    a.add_map(m);
                    a.simulated = true;
                }
                continue;
            }
            PathClass::ShmOther => {
                if m.shared {
                    other_shm.entry(path.to_string()).or_default().add_map(m);
                }
                continue;
            }
            PathClass::Other => {
                if let Some(k) = library_kind(path) {
                    libraries.entry(path.to_string()).or_insert(k);
                }
                continue;
            }
        };
        // Device memory is mapped shared; a private mapping of a device file is not state we track.
        if !m.shared
            && matches!(
                kind,
                FindingKind::DeviceMapping | FindingKind::ManagedMemory
            )
        {
            continue;
        }
        let a = acc.entry((kind, path.to_string())).or_default();
        a.add_map(m);
        if let PathClass::NvidiaGpu(n) = class {
            a.gpu = Some(n);
        }
    }

    // A CUDA process that holds no NVIDIA device file but still has the driver's UVM socket: the
    // driver checkpointed it (real capture malloc-checkpointed-462).
    let nvidia_devices = acc
        .keys()
        .any(|(k, _)| matches!(k, FindingKind::NvidiaCtl | FindingKind::NvidiaDevice));
    let mut out: Vec<Finding> = Vec::new();
    let finding = |kind, evidence| Finding {
        kind,
        pid,
        evidence,
    };
    for ((kind, path), a) in acc {
        let mapped = a.mappings > 0;
        let detail = describe(kind, &path, &a);
        let (address, ranges) = a.address();
        out.push(finding(
            kind,
            Evidence {
                detail,
                fds: a.fds,
                address,
                ranges,
                size: mapped.then_some(a.size),
                mappings: mapped.then_some(a.mappings),
                gpu: a.gpu,
                simulated: a.simulated,
                path: Some(path),
                ..Default::default()
            },
        ));
    }
    for (kind, fd, path, simulated) in sockets {
        let detail = if simulated {
            format!("fd {fd} is the GPU simulator's control socket {path} (simulated CUDA process)")
        } else if kind == FindingKind::Mps {
            format!("fd {fd} is a socket in the MPS pipe folder: {path}")
        } else if nvidia_devices {
            format!("fd {fd} is the CUDA driver's UVM channel {path} (every CUDA process has one)")
        } else {
            format!(
                "fd {fd} is the CUDA driver's UVM channel {path}, yet no NVIDIA device file is open: \
                 the driver has checkpointed this process (its CUDA calls block until it is restored)"
            )
        };
        out.push(finding(
            kind,
            Evidence {
                detail,
                fds: vec![fd],
                socket: Some(path),
                simulated,
                ..Default::default()
            },
        ));
    }
    let amd_device = out
        .iter()
        .any(|f| f.kind == FindingKind::AmdGpu && f.evidence.path.as_deref() == Some("/dev/kfd"));
    for (path, kind) in libraries {
        out.push(finding(
            kind,
            Evidence {
                detail: format!("{} loaded", path.rsplit('/').next().unwrap_or(&path)),
                library: Some(path),
                ..Default::default()
            },
        ));
    }
    let amd_software = out
        .iter()
        .any(|f| f.kind == FindingKind::AmdGpu && f.evidence.library.is_some());
    // A render node alone is any GPU's (Intel, a desktop compositor): count it only next to KFD or ROCm.
    if !amd_device && !amd_software {
        out.retain(|f| {
            !(f.kind == FindingKind::AmdGpu
                && f.evidence
                    .path
                    .as_deref()
                    .is_some_and(|p| p.starts_with("/dev/dri/")))
        });
    }

    for (name, value) in &snap.env {
        let variable = Some(format!("{name}={value}"));
        let kind = if name.starts_with("CUDA_MPS_") {
            FindingKind::Mps
        } else if name.starts_with("NCCL_") {
            FindingKind::Nccl
        } else {
            FindingKind::GpuEnv
        };
        out.push(finding(
            kind,
            Evidence {
                detail: format!("{name}={value}"),
                variable: variable.clone(),
                ..Default::default()
            },
        ));
        if name.ends_with("VISIBLE_DEVICES") && value.contains("MIG-") {
            out.push(finding(
                FindingKind::Mig,
                Evidence {
                    detail: format!("{name} names a MIG instance"),
                    variable,
                    ..Default::default()
                },
            ));
        }
    }
    // The MPS control daemon and server themselves (comm is cut to 15 bytes).
    if snap.stat.comm.starts_with("nvidia-cuda-mps") {
        out.push(finding(
            FindingKind::Mps,
            Evidence {
                detail: format!("process {} is an MPS daemon", snap.stat.comm),
                ..Default::default()
            },
        ));
    }

    let has_state = out.iter().any(Finding::is_state);
    if has_state {
        for (path, a) in other_shm {
            out.push(finding(
                FindingKind::CudaIpc,
                Evidence {
                    detail: format!(
                        "shared segment {path} mapped by a GPU process (may carry IPC handles)"
                    ),
                    address: a.address().0,
                    ranges: a.address().1,
                    size: Some(a.size),
                    mappings: Some(a.mappings),
                    path: Some(path),
                    ..Default::default()
                },
            ));
        }
    }
    if out.iter().any(Finding::is_nvidia_state) {
        if let Some((tid, comm)) = restore_thread(&threads()) {
            out.push(finding(
                FindingKind::CudaLibrary,
                Evidence {
                    detail: format!(
                        "thread {tid} ({comm}) looks like the CUDA restore thread (by its name; the driver API is the authority)"
                    ),
                    tid: Some(tid),
                    ..Default::default()
                },
            ));
        }
    }
    out
}

/// Highest address of the driver's own `/dev/nvidia-uvm` mapping: it lies in the low region CUDA reserves
/// at 0x200000000 (0x204a00000 on driver 580), far below where managed allocations are mapped.
const DRIVER_UVM_BELOW: u64 = 0x10_0000_0000;
/// Size of the driver's own `/dev/nvidia-uvm` mapping (2 MiB on driver 580).
const DRIVER_UVM_MAX_SIZE: u64 = 2 << 20;

/// Every CUDA process maps `/dev/nvidia-uvm` once for the driver itself (`204a00000-204c00000 rw-s
/// 204a00000 ... /dev/nvidia-uvm` on driver 580, see docs/hardware.md): that mapping is not managed
/// memory. At most one such mapping, small and in the low reserved region, is taken for it (maps come in
/// address order, so it is the lowest); every other mapping of the device is managed memory
/// (`cudaMallocManaged` maps its allocations at their own address, in the mmap area).
fn is_driver_uvm_mapping(m: &MapEntry) -> bool {
    m.shared && m.size() <= DRIVER_UVM_MAX_SIZE && m.end <= DRIVER_UVM_BELOW
}

/// The CUDA restore thread is named `cuda` + hex digits (an undocumented driver detail, distinct from
/// `cuda-EvtHandlr`); trust the name only when exactly one thread carries such a name.
fn restore_thread(threads: &[(i32, String)]) -> Option<(i32, String)> {
    let mut it = threads.iter().filter(|(_, comm)| {
        comm.strip_prefix("cuda")
            .is_some_and(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()))
    });
    let first = it.next()?;
    it.next().is_none().then(|| first.clone())
}

fn is_mps_socket(path: &str, snap: &ProcessSnapshot) -> bool {
    let dir = snap
        .env
        .iter()
        .find(|(n, _)| n == "CUDA_MPS_PIPE_DIRECTORY")
        .map(|(_, v)| v.trim_end_matches('/'))
        .filter(|v| !v.is_empty())
        .unwrap_or(DEFAULT_MPS_PIPE_DIR);
    path.strip_prefix(dir).is_some_and(|r| r.starts_with('/'))
}

fn describe(kind: FindingKind, path: &str, a: &Acc) -> String {
    let fds = match a.fds.as_slice() {
        [] => String::new(),
        [fd] => format!("fd {fd}"),
        fds if fds.len() <= 4 => format!(
            "fds {}",
            fds.iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        fds => format!("{} fds", fds.len()),
    };
    let maps = match a.ranges.as_slice() {
        [] => String::new(),
        [(lo, hi)] => format!(
            "1 mapping of {path}, {} at {lo:#x}-{hi:#x}",
            human_bytes(a.size)
        ),
        many => format!(
            "{} mappings of {path}, {} in all, lowest at {:#x}",
            many.len(),
            human_bytes(a.size),
            many.iter().map(|r| r.0).min().unwrap_or(0)
        ),
    };
    let what = match kind {
        FindingKind::NvidiaCtl => "NVIDIA control device open",
        FindingKind::NvidiaDevice if path.starts_with("/dev/nvidia-caps/") => {
            "MIG config/monitor capability open (NVML opens it with MIG off; not MIG use)"
        }
        FindingKind::NvidiaDevice => "NVIDIA device open",
        FindingKind::NvidiaUvm => "NVIDIA UVM device open",
        FindingKind::ManagedMemory => "managed (UVM) memory",
        FindingKind::DeviceMapping if a.simulated => "simulated device memory",
        FindingKind::DeviceMapping if path == "/dev/nvidiactl" => "driver / pinned host memory",
        FindingKind::DeviceMapping if path == "/dev/nvidia-uvm" => {
            "the driver's own UVM mapping (every CUDA process has one; not managed memory)"
        }
        FindingKind::DeviceMapping if path.starts_with("/dev/nvidia-caps/") => {
            "MIG config/monitor capability (NVML opens it with MIG off; not MIG use)"
        }
        FindingKind::DeviceMapping => "GPU memory or BAR window mapped to the host",
        FindingKind::Mig => "MIG capability device",
        FindingKind::AmdGpu => "AMD GPU device",
        FindingKind::Rdma => "RDMA device",
        FindingKind::PciBar => "PCIe BAR mapped directly",
        FindingKind::CudaIpc => "CUDA IPC segment",
        FindingKind::Nccl => "NCCL shared segment",
        _ => "device",
    };
    match (fds.is_empty(), maps.is_empty()) {
        (false, true) => format!("{what}: {path} ({fds})"),
        (true, false) => format!("{what}: {maps}"),
        (false, false) => format!("{what}: {maps} ({fds})"),
        (true, true) => format!("{what}: {path}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_paths() {
        assert_eq!(classify_path("/dev/nvidiactl"), PathClass::NvidiaCtl);
        assert_eq!(classify_path("/dev/nvidia3"), PathClass::NvidiaGpu(3));
        assert_eq!(classify_path("/dev/nvidia-uvm"), PathClass::NvidiaUvm);
        assert_eq!(classify_path("/dev/nvidia-uvm-tools"), PathClass::NvidiaUvm);
        assert_eq!(classify_path("/dev/nvidia-modeset"), PathClass::NvidiaOther);
        assert_eq!(
            classify_path("/dev/nvidia-nvswitch0"),
            PathClass::NvidiaOther
        );
        assert_eq!(
            classify_path("/dev/nvidia-caps/nvidia-cap21"),
            PathClass::NvidiaCaps
        );
        assert_eq!(
            classify_path("/dev/nvidia-caps/nvidia-cap1"),
            PathClass::NvidiaCapsMgmt
        );
        assert_eq!(
            classify_path("/dev/nvidia-caps/nvidia-cap2"),
            PathClass::NvidiaCapsMgmt
        );
        assert_eq!(
            classify_path("/dev/nvidia-caps/nvidia-cap12"),
            PathClass::NvidiaCaps
        );
        assert_eq!(classify_path("/dev/nvidiafoo"), PathClass::Other);
        assert_eq!(classify_path("/dev/kfd"), PathClass::Kfd);
        assert_eq!(classify_path("/dev/dri/renderD128"), PathClass::RenderNode);
        assert_eq!(classify_path("/dev/infiniband/uverbs0"), PathClass::Rdma);
        assert_eq!(
            classify_path("/sys/bus/pci/devices/0000:01:00.0/resource1"),
            PathClass::PciBar
        );
        assert_eq!(
            classify_path("/sys/devices/pci0000:00/0000:00:02.0/resource0_wc"),
            PathClass::PciBar
        );
        assert_eq!(
            classify_path("/sys/devices/pci0000:00/0000:00:02.0/config"),
            PathClass::Other
        );
        assert_eq!(classify_path("/dev/mem"), PathClass::PciBar);
        assert_eq!(classify_path("/dev/vfio/12"), PathClass::PciBar);
        assert_eq!(
            classify_path("/dev/shm/cuda.shm.123.4"),
            PathClass::ShmCudaIpc
        );
        assert_eq!(classify_path("/dev/shm/nccl-abc"), PathClass::ShmNccl);
        assert_eq!(
            classify_path("/dev/shm/gpu-checkpoint-sim/1/mem"),
            PathClass::ShmSim
        );
        assert_eq!(classify_path("/dev/shm/other"), PathClass::ShmOther);
        assert_eq!(classify_path("/usr/lib/libc.so.6"), PathClass::Other);
    }

    #[test]
    fn libraries() {
        assert_eq!(
            library_kind("/usr/lib/x86_64-linux-gnu/libcuda.so.570.86.15"),
            Some(FindingKind::CudaLibrary)
        );
        assert_eq!(
            library_kind("/opt/x/libcudart.so.12"),
            Some(FindingKind::CudaLibrary)
        );
        assert_eq!(
            library_kind("/x/libnvidia-ml.so.1"),
            Some(FindingKind::Nvml)
        );
        assert_eq!(library_kind("/x/libnccl.so.2"), Some(FindingKind::Nccl));
        assert_eq!(
            library_kind("/opt/rocm/lib/libamdhip64.so.6"),
            Some(FindingKind::AmdGpu)
        );
        assert_eq!(library_kind("/x/libcudnn.so.9"), None);
    }

    #[test]
    fn restore_thread_needs_exactly_one_candidate() {
        let t = |v: &[(i32, &str)]| {
            v.iter()
                .map(|(a, b)| (*a, b.to_string()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            restore_thread(&t(&[
                (1, "python"),
                (2, "cuda-EvtHandlr"),
                (3, "cuda00001400006")
            ])),
            Some((3, "cuda00001400006".to_string()))
        );
        assert_eq!(restore_thread(&t(&[(3, "cuda0a"), (4, "cuda0b")])), None);
        assert_eq!(restore_thread(&t(&[(2, "cuda-EvtHandlr")])), None);
    }
}
