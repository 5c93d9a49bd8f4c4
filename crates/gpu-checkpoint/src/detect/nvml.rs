//! NVML, behind a trait: which processes the driver says use a GPU, and the driver version.
//!
//! NVML is loaded at run time (`libnvidia-ml.so.1`); a machine without it is normal and yields a note,
//! never an error. NVML misses processes it cannot see (other PID namespaces, NVML-less drivers, AMD),
//! so detection always scans /proc as well.

/// One compute process as the driver reports it (what `nvidia-smi --query-compute-apps` lists: a PID on a
/// GPU, not yet a process detect has looked at).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ComputeProcess {
    /// PID as NVML reports it (the host's, or the caller's namespace's on newer drivers).
    pub pid: u32,
    /// GPU index.
    pub gpu: u32,
    /// Device memory in use, when the driver says.
    pub used_memory: Option<u64>,
}

/// The boundary to NVML. [`NvmlInventory`] is the real one; tests use [`StaticInventory`].
pub trait GpuInventory {
    /// Driver version (`570.86.15`), when known.
    fn driver_version(&self) -> Option<String>;
    /// Every compute process on every GPU.
    fn compute_processes(&self) -> Result<Vec<ComputeProcess>, String>;
}

/// A fixed answer, for tests.
#[derive(Clone, Debug, Default)]
pub struct StaticInventory {
    pub driver_version: Option<String>,
    pub processes: Vec<ComputeProcess>,
}

impl GpuInventory for StaticInventory {
    fn driver_version(&self) -> Option<String> {
        self.driver_version.clone()
    }
    fn compute_processes(&self) -> Result<Vec<ComputeProcess>, String> {
        Ok(self.processes.clone())
    }
}

/// The real NVML.
pub struct NvmlInventory {
    nvml: nvml_wrapper::Nvml,
}

impl NvmlInventory {
    /// Loads NVML. The error is a one-line note for the user (`NVML not available: ...`).
    pub fn load() -> Result<Self, String> {
        // The unversioned name exists only where development files are installed: try the runtime
        // soname first.
        let nvml = nvml_wrapper::Nvml::builder()
            .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
            .init()
            .or_else(|_| nvml_wrapper::Nvml::init())
            .map_err(|e| format!("NVML not available ({e}); scanned /proc only"))?;
        Ok(NvmlInventory { nvml })
    }
}

impl GpuInventory for NvmlInventory {
    fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    fn compute_processes(&self) -> Result<Vec<ComputeProcess>, String> {
        let count = self
            .nvml
            .device_count()
            .map_err(|e| format!("NVML device count: {e}"))?;
        let mut out = Vec::new();
        for i in 0..count {
            let dev = self
                .nvml
                .device_by_index(i)
                .map_err(|e| format!("NVML device {i}: {e}"))?;
            let procs = dev
                .running_compute_processes()
                .map_err(|e| format!("NVML compute processes of GPU {i}: {e}"))?;
            out.extend(procs.into_iter().map(|p| ComputeProcess {
                pid: p.pid,
                gpu: i,
                used_memory: match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => Some(b),
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
                },
            }));
        }
        Ok(out)
    }
}
