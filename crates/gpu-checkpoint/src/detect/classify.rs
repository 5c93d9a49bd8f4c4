//! Classifying one process: its maps, fds, variables, sockets and threads become [`Finding`]s.

use std::collections::BTreeMap;

use super::finding::{Evidence, Finding, FindingKind};
use super::parse::{socket_inode, MapEntry};
use super::paths::{
    classify_path, library_kind, PathClass, CUDA_UVMFD_SOCKET_PREFIX, DEFAULT_MPS_PIPE_DIR,
    SIM_SOCKET_PREFIX,
};
use super::process::ProcessSnapshot;
use crate::fmt::human_bytes;

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
