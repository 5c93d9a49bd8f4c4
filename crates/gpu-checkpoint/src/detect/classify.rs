//! Classifying one process: its maps, fds, variables, sockets and threads become [`Finding`]s.
//!
//! Two passes. The fds and maps are gathered per (kind, path), as [`PathClass::kind`] says, so that forty
//! mappings of one device make one finding; then what was gathered, the variables and the threads become
//! findings in a fixed order (devices, sockets, libraries, variables, shared segments, the restore
//! thread), so that reports are stable.

use std::collections::BTreeMap;

use super::finding::{Evidence, Finding, FindingKind};
use super::needs::{self, ClassifyContext};
use super::parse::{socket_inode, MapEntry};
use super::paths::{
    classify_path, library_kind, Hold, PathClass, CUDA_UVMFD_SOCKET_PREFIX, DEFAULT_MPS_PIPE_DIR,
    SIM_SOCKET_PREFIX,
};
use super::process::ProcessSnapshot;
use crate::fmt::human_bytes;

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

    /// The evidence of a device or GPU segment held as `kind`.
    fn evidence(self, kind: FindingKind, path: String) -> Evidence {
        let mapped = self.mappings > 0;
        let detail = describe(kind, &path, &self);
        let (address, ranges) = self.address();
        Evidence {
            detail,
            fds: self.fds,
            address,
            ranges,
            size: mapped.then_some(self.size),
            mappings: mapped.then_some(self.mappings),
            gpu: self.gpu,
            simulated: self.simulated,
            path: Some(path),
            ..Default::default()
        }
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

/// What one process holds, gathered from its fds and maps.
#[derive(Default)]
struct Holdings {
    /// Device files and GPU segments by (kind, path), ordered so that reports are stable.
    devices: BTreeMap<(FindingKind, String), Acc>,
    /// Other shared segments: reported only for a process with GPU state (they may carry IPC handles).
    other_shm: BTreeMap<String, Acc>,
    /// GPU libraries loaded, by path.
    libraries: BTreeMap<String, FindingKind>,
    /// Sockets that are findings, in fd order: (what, fd, socket path).
    sockets: Vec<(Socket, i32, String)>,
    /// The driver's own `/dev/nvidia-uvm` mapping has been seen (see [`is_driver_uvm_mapping`]).
    driver_uvm_seen: bool,
}

impl Holdings {
    fn device(&mut self, kind: FindingKind, path: &str, class: PathClass) -> &mut Acc {
        let a = self.devices.entry((kind, path.to_string())).or_default();
        if let Some(n) = class.gpu() {
            a.gpu = Some(n);
        }
        a
    }

    /// An open fd: a device, or a socket of interest. An open shared segment counts only once mapped.
    fn add_fd(&mut self, fd: i32, target: &str, snap: &ProcessSnapshot, ctx: &ClassifyContext<'_>) {
        let class = classify_path(target);
        if let Some(kind) = class.kind(Hold::Open) {
            self.device(kind, target, class).fds.push(fd);
        } else if class == PathClass::Other {
            let socket = socket_inode(target).and_then(|inode| (ctx.socket_path)(inode));
            if let Some(path) = socket {
                if let Some(what) = Socket::of(&path, snap, ctx.simulator) {
                    self.sockets.push((what, fd, path));
                }
            }
        }
    }

    /// One line of maps: device memory, a shared segment, or a GPU library.
    fn add_map(&mut self, m: &MapEntry, simulator: bool) {
        // [heap], [stack], [vdso], ... and anonymous mappings name no file.
        let Some(path) = m.path.as_deref().filter(|p| p.starts_with('/')) else {
            return;
        };
        let class = classify_path(path);
        let kind =
            if class == PathClass::NvidiaUvm && !self.driver_uvm_seen && is_driver_uvm_mapping(m) {
                self.driver_uvm_seen = true;
                Some(FindingKind::DeviceMapping)
            } else {
                class.kind(Hold::Mapped)
            };
        match (kind, class) {
            // Device memory is mapped shared; a private mapping of a device file is not state we track.
            (Some(FindingKind::DeviceMapping | FindingKind::ManagedMemory), _) if !m.shared => {}
            (Some(kind), _) => self.device(kind, path, class).add_map(m),
            (None, PathClass::ShmSim) if simulator && m.shared => {
                let a = self.device(FindingKind::DeviceMapping, path, class);
                a.add_map(m);
                a.simulated = true;
            }
            (None, PathClass::ShmOther) if m.shared => {
                self.other_shm
                    .entry(path.to_string())
                    .or_default()
                    .add_map(m);
            }
            (None, PathClass::Other) => {
                if let Some(k) = library_kind(path) {
                    self.libraries.entry(path.to_string()).or_insert(k);
                }
            }
            (None, _) => {}
        }
    }
}

/// The UNIX sockets that are findings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Socket {
    /// The GPU simulator's control socket (with `--simulator` only).
    Simulator,
    /// The CUDA driver's UVM channel ([`CUDA_UVMFD_SOCKET_PREFIX`]).
    CudaUvm,
    /// A socket in the MPS pipe folder: an MPS client.
    Mps,
}

impl Socket {
    fn of(path: &str, snap: &ProcessSnapshot, simulator: bool) -> Option<Socket> {
        if simulator && path.starts_with(SIM_SOCKET_PREFIX) {
            Some(Socket::Simulator)
        } else if path.starts_with(CUDA_UVMFD_SOCKET_PREFIX) {
            Some(Socket::CudaUvm)
        } else if is_mps_socket(path, snap) {
            Some(Socket::Mps)
        } else {
            None
        }
    }

    fn finding(self, fd: i32, path: String, nvidia_devices: bool) -> (FindingKind, Evidence) {
        let (kind, detail) = match self {
            Socket::Simulator => (
                FindingKind::CudaLibrary,
                format!("fd {fd} is the GPU simulator's control socket {path} (simulated CUDA process)"),
            ),
            Socket::Mps => (
                FindingKind::Mps,
                format!("fd {fd} is a socket in the MPS pipe folder: {path}"),
            ),
            Socket::CudaUvm if nvidia_devices => (
                FindingKind::CudaLibrary,
                format!("fd {fd} is the CUDA driver's UVM channel {path} (every CUDA process has one)"),
            ),
            // A CUDA process that holds no NVIDIA device file but still has the driver's UVM socket:
            // the driver checkpointed it (real capture malloc-checkpointed-462).
            Socket::CudaUvm => (
                FindingKind::CudaLibrary,
                format!(
                    "fd {fd} is the CUDA driver's UVM channel {path}, yet no NVIDIA device file is open: \
                     the driver has checkpointed this process (its CUDA calls block until it is restored)"
                ),
            ),
        };
        let evidence = Evidence {
            detail,
            fds: vec![fd],
            socket: Some(path),
            simulated: self == Socket::Simulator,
            ..Default::default()
        };
        (kind, evidence)
    }
}

/// GPU variables by name prefix, and the finding each makes; every other GPU variable (those the
/// environ parser keeps, see [`super::parse::GPU_ENV_PREFIXES`]) is [`FindingKind::GpuEnv`].
const VARIABLES: &[(&str, FindingKind)] = &[
    ("CUDA_MPS_", FindingKind::Mps),
    ("NCCL_", FindingKind::Nccl),
];

/// The findings of one GPU variable: its kind, and MIG when it names a MIG instance.
fn variable_findings(name: &str, value: &str) -> Vec<(FindingKind, Evidence)> {
    let kind = VARIABLES
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map_or(FindingKind::GpuEnv, |(_, k)| *k);
    let variable = Some(format!("{name}={value}"));
    let mut out = vec![(
        kind,
        Evidence {
            detail: format!("{name}={value}"),
            variable: variable.clone(),
            ..Default::default()
        },
    )];
    if name.ends_with("VISIBLE_DEVICES") && value.contains("MIG-") {
        out.push((
            FindingKind::Mig,
            Evidence {
                detail: format!("{name} names a MIG instance"),
                variable,
                ..Default::default()
            },
        ));
    }
    out
}

/// Classifies one process. `threads` is called only for processes with NVIDIA state (reading every
/// thread's name costs one file per thread).
pub fn classify(
    snap: &ProcessSnapshot,
    ctx: &ClassifyContext<'_>,
    threads: &mut dyn FnMut() -> Vec<(i32, String)>,
) -> Vec<Finding> {
    let mut held = Holdings::default();
    for (fd, target) in &snap.fds {
        held.add_fd(*fd, target, snap, ctx);
    }
    for m in &snap.maps {
        held.add_map(m, ctx.simulator);
    }
    let Holdings {
        devices,
        other_shm,
        libraries,
        sockets,
        ..
    } = held;

    let finding = |(kind, evidence): (FindingKind, Evidence)| Finding {
        kind,
        pid: snap.pid,
        evidence,
    };
    let nvidia_devices = devices
        .keys()
        .any(|(k, _)| matches!(k, FindingKind::NvidiaCtl | FindingKind::NvidiaDevice));
    // A render node alone is any GPU's (Intel, a desktop compositor): count it only next to KFD or ROCm.
    let amd = devices
        .keys()
        .any(|(k, p)| *k == FindingKind::AmdGpu && p == "/dev/kfd")
        || libraries.values().any(|k| *k == FindingKind::AmdGpu);
    let mut out: Vec<Finding> = Vec::new();
    for ((kind, path), a) in devices {
        if !(kind == FindingKind::AmdGpu && path.starts_with("/dev/dri/") && !amd) {
            out.push(finding((kind, a.evidence(kind, path))));
        }
    }
    for (what, fd, path) in sockets {
        out.push(finding(what.finding(fd, path, nvidia_devices)));
    }
    for (path, kind) in libraries {
        let detail = format!("{} loaded", path.rsplit('/').next().unwrap_or(&path));
        let library = Some(path);
        out.push(finding((
            kind,
            Evidence {
                detail,
                library,
                ..Default::default()
            },
        )));
    }
    for (name, value) in &snap.env {
        out.extend(variable_findings(name, value).into_iter().map(finding));
    }
    // The MPS control daemon and server themselves (comm is cut to 15 bytes).
    if snap.stat.comm.starts_with("nvidia-cuda-mps") {
        let detail = format!("process {} is an MPS daemon", snap.stat.comm);
        out.push(finding((
            FindingKind::Mps,
            Evidence {
                detail,
                ..Default::default()
            },
        )));
    }

    // What CRIU will need an option for, GPU or not.
    out.extend(needs::findings(snap, ctx).into_iter().map(finding));
    if out.iter().any(Finding::is_state) {
        for (path, a) in other_shm {
            let (address, ranges) = a.address();
            let detail =
                format!("shared segment {path} mapped by a GPU process (may carry IPC handles)");
            out.push(finding((
                FindingKind::CudaIpc,
                Evidence {
                    detail,
                    address,
                    ranges,
                    size: Some(a.size),
                    mappings: Some(a.mappings),
                    path: Some(path),
                    ..Default::default()
                },
            )));
        }
    }
    if out.iter().any(Finding::is_nvidia_state) {
        if let Some((tid, comm)) = restore_thread(&threads()) {
            let detail = format!(
                "thread {tid} ({comm}) looks like the CUDA restore thread (by its name; the driver API is the authority)"
            );
            out.push(finding((
                FindingKind::CudaLibrary,
                Evidence {
                    detail,
                    tid: Some(tid),
                    ..Default::default()
                },
            )));
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

    #[test]
    fn variables_by_prefix_and_mig_ids() {
        use FindingKind::*;
        let kinds = |n: &str, v: &str| -> Vec<FindingKind> {
            variable_findings(n, v)
                .into_iter()
                .map(|(k, _)| k)
                .collect()
        };
        assert_eq!(kinds("CUDA_MPS_PIPE_DIRECTORY", "/x"), [Mps]);
        assert_eq!(kinds("NCCL_IB_DISABLE", "1"), [Nccl]);
        assert_eq!(kinds("CUDA_VISIBLE_DEVICES", "0"), [GpuEnv]);
        assert_eq!(kinds("CUDA_VISIBLE_DEVICES", "MIG-1234"), [GpuEnv, Mig]);
    }
}
