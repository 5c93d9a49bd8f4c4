//! What a path names: NVIDIA, AMD, RDMA and PCI device files, shared-memory segments, GPU libraries.
//!
//! The same rules serve the full classification ([`super::classify`]) and the node scan's quick test of
//! whether a process is worth reading at all ([`PathClass::is_device`]).

use super::finding::FindingKind;

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

    /// The GPU a `/dev/nvidiaN` names.
    pub fn gpu(self) -> Option<u32> {
        match self {
            PathClass::NvidiaGpu(n) => Some(n),
            _ => None,
        }
    }

    /// The finding that holding such a path makes. `None`: holding it is no finding by itself. An open
    /// shared segment says nothing until it is mapped, and [`super::classify`] looks at the simulator's
    /// memory, other segments, sockets and libraries apart.
    ///
    /// Mapped NVIDIA devices are memory: `/dev/nvidia-uvm` is managed memory (the driver's own small
    /// mapping of it aside, which `classify` tells apart by its address), the others are device, pinned
    /// or BAR memory.
    pub fn kind(self, hold: Hold) -> Option<FindingKind> {
        use FindingKind as K;
        use PathClass as P;
        Some(match (self, hold) {
            (P::NvidiaCtl, Hold::Open) => K::NvidiaCtl,
            (P::NvidiaGpu(_) | P::NvidiaOther | P::NvidiaCapsMgmt, Hold::Open) => K::NvidiaDevice,
            (P::NvidiaUvm, Hold::Open) => K::NvidiaUvm,
            (P::NvidiaCtl | P::NvidiaGpu(_) | P::NvidiaOther | P::NvidiaCapsMgmt, Hold::Mapped) => {
                K::DeviceMapping
            }
            (P::NvidiaUvm, Hold::Mapped) => K::ManagedMemory,
            (P::NvidiaCaps, _) => K::Mig,
            (P::Kfd | P::RenderNode, _) => K::AmdGpu,
            (P::Rdma, _) => K::Rdma,
            (P::PciBar, _) => K::PciBar,
            (P::ShmCudaIpc, _) => K::CudaIpc,
            (P::ShmNccl, _) => K::Nccl,
            (P::ShmSim | P::ShmOther | P::Other, _) => return None,
        })
    }
}

/// How a process holds a path: an fd open on it, or a mapping of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    Open,
    Mapped,
}

/// How a path is recognised (see [`RULES`]).
enum Rule {
    /// The path is exactly this.
    Is(&'static str, PathClass),
    /// The path starts with this.
    Under(&'static str, PathClass),
    /// Names with numbers in them need a closer look: `Some` decides, `None` passes on.
    Test(fn(&str) -> Option<PathClass>),
}

/// Every path detection recognises, tried in order: the first rule that matches decides; a path no rule
/// matches is [`PathClass::Other`].
const RULES: &[Rule] = &[
    Rule::Test(nvidia_device),
    Rule::Is("/dev/kfd", PathClass::Kfd),
    Rule::Under("/dev/dri/renderD", PathClass::RenderNode),
    Rule::Under("/dev/infiniband/", PathClass::Rdma),
    Rule::Is("/dev/mem", PathClass::PciBar),
    Rule::Under("/dev/vfio/", PathClass::PciBar),
    Rule::Test(sysfs_pci_resource),
    Rule::Under("/dev/shm/cuda.shm.", PathClass::ShmCudaIpc),
    Rule::Under("/dev/shm/nccl-", PathClass::ShmNccl),
    Rule::Under(SIM_SHM_PREFIX, PathClass::ShmSim),
    Rule::Under("/dev/shm/", PathClass::ShmOther),
];

/// Classifies a device or file path (from maps or an fd link).
pub fn classify_path(path: &str) -> PathClass {
    RULES
        .iter()
        .find_map(|rule| match *rule {
            Rule::Is(p, class) => (path == p).then_some(class),
            Rule::Under(p, class) => path.starts_with(p).then_some(class),
            Rule::Test(test) => test(path),
        })
        .unwrap_or(PathClass::Other)
}

/// Everything under `/dev/nvidia`: the control and UVM devices, GPUs by number, MIG capabilities, and
/// the rest (`-modeset`, `-nvswitchN`, ...). A name that only starts like them (`/dev/nvidiafoo`) is none.
fn nvidia_device(path: &str) -> Option<PathClass> {
    let rest = path.strip_prefix("/dev/nvidia")?;
    Some(match rest {
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
    })
}

/// A PCI BAR through sysfs: `/sys/bus/pci/devices/0000:01:00.0/resource1`,
/// `/sys/devices/pci0000:00/.../resource0_wc`.
fn sysfs_pci_resource(path: &str) -> Option<PathClass> {
    if !(path.starts_with("/sys/bus/pci/devices/") || path.starts_with("/sys/devices/pci")) {
        return None;
    }
    let base = path.rsplit('/').next().unwrap_or("");
    base.strip_prefix("resource")
        .is_some_and(|n| {
            !n.is_empty()
                && n.trim_end_matches("_wc")
                    .bytes()
                    .all(|b| b.is_ascii_digit())
        })
        .then_some(PathClass::PciBar)
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

pub(super) fn library_kind(path: &str) -> Option<FindingKind> {
    let base = path.rsplit('/').next()?;
    LIBRARIES
        .iter()
        .find(|(prefix, _)| base.starts_with(prefix))
        .map(|(_, k)| *k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_paths() {
        for (path, class) in [
            ("/dev/nvidiactl", PathClass::NvidiaCtl),
            ("/dev/nvidia3", PathClass::NvidiaGpu(3)),
            ("/dev/nvidia-uvm", PathClass::NvidiaUvm),
            ("/dev/nvidia-uvm-tools", PathClass::NvidiaUvm),
            ("/dev/nvidia-modeset", PathClass::NvidiaOther),
            ("/dev/nvidia-nvswitch0", PathClass::NvidiaOther),
            ("/dev/nvidia-caps/nvidia-cap21", PathClass::NvidiaCaps),
            ("/dev/nvidia-caps/nvidia-cap1", PathClass::NvidiaCapsMgmt),
            ("/dev/nvidia-caps/nvidia-cap2", PathClass::NvidiaCapsMgmt),
            ("/dev/nvidia-caps/nvidia-cap12", PathClass::NvidiaCaps),
            ("/dev/nvidiafoo", PathClass::Other),
            ("/dev/kfd", PathClass::Kfd),
            ("/dev/dri/renderD128", PathClass::RenderNode),
            ("/dev/infiniband/uverbs0", PathClass::Rdma),
            (
                "/sys/bus/pci/devices/0000:01:00.0/resource1",
                PathClass::PciBar,
            ),
            (
                "/sys/devices/pci0000:00/0000:00:02.0/resource0_wc",
                PathClass::PciBar,
            ),
            (
                "/sys/devices/pci0000:00/0000:00:02.0/config",
                PathClass::Other,
            ),
            ("/dev/mem", PathClass::PciBar),
            ("/dev/vfio/12", PathClass::PciBar),
            ("/dev/shm/cuda.shm.123.4", PathClass::ShmCudaIpc),
            ("/dev/shm/nccl-abc", PathClass::ShmNccl),
            ("/dev/shm/gpu-checkpoint-sim/1/mem", PathClass::ShmSim),
            ("/dev/shm/other", PathClass::ShmOther),
            ("/usr/lib/libc.so.6", PathClass::Other),
        ] {
            assert_eq!(classify_path(path), class, "{path}");
        }
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
    fn open_and_mapped_devices_make_different_findings() {
        let k = |c: PathClass, h| c.kind(h);
        assert_eq!(
            k(PathClass::NvidiaCtl, Hold::Open),
            Some(FindingKind::NvidiaCtl)
        );
        assert_eq!(
            k(PathClass::NvidiaCtl, Hold::Mapped),
            Some(FindingKind::DeviceMapping)
        );
        assert_eq!(
            k(PathClass::NvidiaGpu(1), Hold::Open),
            Some(FindingKind::NvidiaDevice)
        );
        assert_eq!(
            k(PathClass::NvidiaUvm, Hold::Mapped),
            Some(FindingKind::ManagedMemory)
        );
        assert_eq!(k(PathClass::ShmNccl, Hold::Open), Some(FindingKind::Nccl));
        assert_eq!(k(PathClass::ShmOther, Hold::Mapped), None);
        assert_eq!(k(PathClass::Other, Hold::Open), None);
        assert_eq!(PathClass::NvidiaGpu(3).gpu(), Some(3));
        assert_eq!(PathClass::NvidiaCtl.gpu(), None);
    }
}
