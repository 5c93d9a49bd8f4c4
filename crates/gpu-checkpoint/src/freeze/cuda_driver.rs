//! The CUDA driver checkpoint API (`cuCheckpointProcess*`, driver >= 570), called in-process.
//!
//! `libcuda.so.1` is opened at run time, never linked: the tool must start (and explain what is missing)
//! on machines without an NVIDIA driver. The checkpoint functions are resolved through
//! `cuGetProcAddress` (the driver's versioned entry-point lookup) and, failing that, plain `dlsym`.
//!
//! The argument structs are 64 bytes in every CUDA release, but their fields moved (see [`ApiLayout`]);
//! the layout is chosen from `cuDriverGetVersion`, never assumed. Reserved bytes are always zero.

use super::types::{CuError, GpuInfo, GpuPair, GpuUuid, ProcessState};
use super::{Error, GpuBackend, GpuDriver, Op, Result, MIN_DRIVER_API};
use libloading::Library;
use std::ffi::{c_char, c_void, CStr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

mod abi;

pub use abi::{
    version_text, ApiLayout, CheckpointArgsV13_4, GpuPairRaw, LockArgs, ReservedArgs,
    RestoreArgsV13_0, RestoreArgsV13_3, RestoreArgsV13_4, UnlockArgs,
};

const LIBCUDA: &str = "libcuda.so.1";

type CuResult = i32;
type FnInit = unsafe extern "C" fn(u32) -> CuResult;
type FnDriverGetVersion = unsafe extern "C" fn(*mut i32) -> CuResult;
/// `cuGetProcAddress_v2(const char*, void**, int cudaVersion, cuuint64_t flags,
/// CUdriverProcAddressQueryResult*)`, CUDA 12.5+.
type FnGetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64, *mut i32) -> CuResult;
/// The CUDA 11.3-12.4 form without the query result.
type FnGetProcAddressV1 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64) -> CuResult;
type FnGetState = unsafe extern "C" fn(i32, *mut u32) -> CuResult;
type FnWithArgs = unsafe extern "C" fn(i32, *mut c_void) -> CuResult;
type FnRestoreTid = unsafe extern "C" fn(i32, *mut i32) -> CuResult;
type FnDeviceGetCount = unsafe extern "C" fn(*mut i32) -> CuResult;
type FnDeviceGet = unsafe extern "C" fn(*mut i32, i32) -> CuResult;
type FnDeviceGetUuid = unsafe extern "C" fn(*mut [u8; 16], i32) -> CuResult;
type FnDeviceGetName = unsafe extern "C" fn(*mut c_char, i32, i32) -> CuResult;
type FnDeviceTotalMem = unsafe extern "C" fn(*mut usize, i32) -> CuResult;

struct Fns {
    get_state: FnGetState,
    lock: FnWithArgs,
    checkpoint: FnWithArgs,
    restore: FnWithArgs,
    unlock: FnWithArgs,
    restore_tid: FnRestoreTid,
}

/// Timings of setting the driver up (reported with `-v` and in JSON).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SetupTimings {
    pub dlopen_ms: f64,
    pub resolve_ms: f64,
    /// `cuInit(0)`, once, when first needed (restore, GPU listing).
    pub cu_init_ms: Option<f64>,
}

pub struct CudaDriver {
    lib: Library,
    version: i32,
    /// The library is gpu-checkpoint's SIMULATED driver (`crates/cuda-sim`), found through
    /// `LD_LIBRARY_PATH` in a test or demo: it says so in every driver version we report.
    simulated: bool,
    layout: ApiLayout,
    fns: Fns,
    cu_init: FnInit,
    /// Result of our one `cuInit(0)`; `None` until it ran.
    init_result: Mutex<Option<std::result::Result<(), CuError>>>,
    timings: Mutex<SetupTimings>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn check(code: CuResult) -> std::result::Result<(), CuError> {
    match CuError::from_code(code) {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

impl CudaDriver {
    /// Loads libcuda, reads the driver version and resolves the checkpoint functions. Missing pieces
    /// become errors naming the driver release that has them.
    pub fn open() -> Result<Self> {
        let t0 = Instant::now();
        // SAFETY: loading the NVIDIA driver library runs its initialisers, which is what every CUDA
        // program does; we pass no callbacks into it.
        let lib = unsafe { Library::new(LIBCUDA) }.map_err(|e| Error::LibraryMissing {
            lib: LIBCUDA,
            reason: match std::error::Error::source(&e) {
                Some(cause) => format!("{e}: {cause}"),
                None => e.to_string(),
            },
        })?;
        let dlopen_ms = ms(t0.elapsed());
        let t1 = Instant::now();
        // SAFETY: the types match cuda.h's declarations of these two functions.
        let (cu_init, get_version) = unsafe {
            (
                *sym::<FnInit>(&lib, "cuInit", "?")?,
                *sym::<FnDriverGetVersion>(&lib, "cuDriverGetVersion", "?")?,
            )
        };
        let mut version = 0;
        // SAFETY: cuDriverGetVersion writes one int and needs no cuInit.
        check(unsafe { get_version(&mut version) }).map_err(|code| Error::DriverSetup {
            call: "cuDriverGetVersion",
            code,
        })?;
        let vtext = version_text(version);
        let layout = ApiLayout::for_version(version).ok_or_else(|| Error::SymbolMissing {
            symbol: "cuCheckpointProcessLock",
            version: vtext.clone(),
            needed: MIN_DRIVER_API,
        })?;
        let resolver = Resolver::new(&lib, version);
        // SAFETY: each type matches the function's declaration in cuda.h (args structs by pointer).
        let fns = unsafe {
            Fns {
                get_state: resolver.get("cuCheckpointProcessGetState", &vtext)?,
                lock: resolver.get("cuCheckpointProcessLock", &vtext)?,
                checkpoint: resolver.get("cuCheckpointProcessCheckpoint", &vtext)?,
                restore: resolver.get("cuCheckpointProcessRestore", &vtext)?,
                unlock: resolver.get("cuCheckpointProcessUnlock", &vtext)?,
                restore_tid: resolver.get("cuCheckpointProcessGetRestoreThreadId", &vtext)?,
            }
        };
        let resolve_ms = ms(t1.elapsed());
        // SAFETY: only the symbol's presence is looked at.
        let simulated =
            unsafe { lib.get::<*const c_void>(b"gpuCheckpointSimulatedDriver") }.is_ok();
        let driver = CudaDriver {
            lib,
            version,
            simulated,
            layout,
            fns,
            cu_init,
            init_result: Mutex::new(None),
            timings: Mutex::new(SetupTimings {
                dlopen_ms,
                resolve_ms,
                cu_init_ms: None,
            }),
        };
        if std::env::var("GPU_CHECKPOINT_CUDA_INIT").as_deref() == Ok("eager") {
            let _ = driver.ensure_init();
        }
        Ok(driver)
    }

    pub fn version(&self) -> i32 {
        self.version
    }

    pub fn layout(&self) -> ApiLayout {
        self.layout
    }

    /// What this driver can do beyond lock / checkpoint / restore / unlock, found at run time: `lock-timeout`
    /// (every release with the API), `gpu-migration` (restore onto other GPUs: 13.0+), `custom-storage`
    /// (13.4's device memory handed to the caller: the layout and `cuCheckpointOperationComplete` both
    /// there).
    pub fn capabilities(&self) -> Vec<&'static str> {
        let mut caps = vec!["lock-timeout"];
        if self.layout.supports_gpu_pairs() {
            caps.push("gpu-migration");
        }
        let resolver = Resolver::new(&self.lib, self.version);
        // SAFETY: only whether the symbol resolves is looked at; it is never called.
        let complete = unsafe { resolver.get::<*mut c_void>("cuCheckpointOperationComplete", "") };
        if self.layout == ApiLayout::V13_4 && complete.is_ok() {
            caps.push("custom-storage");
        }
        caps
    }

    pub fn setup_timings(&self) -> SetupTimings {
        self.timings.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// `cuInit(0)` once. Restore needs it (unless persistence mode is on), and so does listing GPUs;
    /// the other calls do not, so we do not pay for it there.
    fn ensure_init(&self) -> std::result::Result<(), CuError> {
        let mut guard = self.init_result.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = *guard {
            return r;
        }
        let t = Instant::now();
        // SAFETY: cuInit takes a flags word that must be 0.
        let r = check(unsafe { (self.cu_init)(0) });
        if let Ok(mut tm) = self.timings.lock() {
            tm.cu_init_ms = Some(ms(t.elapsed()));
        }
        *guard = Some(r);
        r
    }

    fn initialized(&self) -> bool {
        matches!(
            *self.init_result.lock().unwrap_or_else(|p| p.into_inner()),
            Some(Ok(()))
        )
    }

    /// Runs a call; if the driver says NOT_INITIALIZED and we never called cuInit, initialises and
    /// retries once (whether a caller must cuInit before these calls is not documented for every one).
    fn call(&self, op: Op, pid: i32, mut f: impl FnMut() -> CuResult) -> Result<()> {
        match check(f()) {
            Ok(()) => Ok(()),
            Err(CuError::NotInitialized) if !self.initialized() && self.ensure_init().is_ok() => {
                check(f()).map_err(|code| Error::cuda(op, pid, code))
            }
            Err(code) => Err(Error::cuda(op, pid, code)),
        }
    }

    fn cuda_gpus(&self) -> Result<Vec<GpuInfo>> {
        self.ensure_init().map_err(|code| Error::DriverSetup {
            call: "cuInit",
            code,
        })?;
        let setup = |call: &'static str| move |code| Error::DriverSetup { call, code };
        // SAFETY: types as declared in cuda.h; these are the stable _v2 entry points where relevant.
        unsafe {
            let count_fn = *sym::<FnDeviceGetCount>(&self.lib, "cuDeviceGetCount", "?")?;
            let get_fn = *sym::<FnDeviceGet>(&self.lib, "cuDeviceGet", "?")?;
            let uuid_fn = match sym::<FnDeviceGetUuid>(&self.lib, "cuDeviceGetUuid_v2", "?") {
                Ok(s) => *s,
                Err(_) => *sym::<FnDeviceGetUuid>(&self.lib, "cuDeviceGetUuid", "?")?,
            };
            let name_fn = *sym::<FnDeviceGetName>(&self.lib, "cuDeviceGetName", "?")?;
            let mem_fn = *sym::<FnDeviceTotalMem>(&self.lib, "cuDeviceTotalMem_v2", "?")?;
            let mut n = 0;
            check(count_fn(&mut n)).map_err(setup("cuDeviceGetCount"))?;
            let mut out = Vec::new();
            for i in 0..n {
                let mut dev = 0;
                check(get_fn(&mut dev, i)).map_err(setup("cuDeviceGet"))?;
                let mut uuid = [0u8; 16];
                check(uuid_fn(&mut uuid, dev)).map_err(setup("cuDeviceGetUuid"))?;
                let mut name = [0 as c_char; 256];
                check(name_fn(name.as_mut_ptr(), name.len() as i32, dev))
                    .map_err(setup("cuDeviceGetName"))?;
                let mut mem = 0usize;
                let memory_bytes = check(mem_fn(&mut mem, dev)).ok().map(|_| mem as u64);
                out.push(GpuInfo {
                    index: i as u32,
                    uuid: GpuUuid(uuid),
                    model: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                    memory_bytes,
                });
            }
            Ok(out)
        }
    }
}

/// Looks a symbol up with dlsym; `version` is for the error message.
///
/// # Safety
/// `T` must be the symbol's real type.
unsafe fn sym<'l, T>(
    lib: &'l Library,
    name: &'static str,
    version: &str,
) -> Result<libloading::Symbol<'l, T>> {
    lib.get::<T>(name.as_bytes())
        .map_err(|_| Error::SymbolMissing {
            symbol: name,
            version: version.to_string(),
            needed: MIN_DRIVER_API,
        })
}

/// Resolves driver entry points the way the CUDA runtime does: `cuGetProcAddress_v2` (12.5+), then the
/// older `cuGetProcAddress`, then dlsym.
struct Resolver<'l> {
    lib: &'l Library,
    version: i32,
    v2: Option<FnGetProcAddressV2>,
    v1: Option<FnGetProcAddressV1>,
}

impl<'l> Resolver<'l> {
    fn new(lib: &'l Library, version: i32) -> Self {
        // SAFETY: types as declared in cuda.h.
        unsafe {
            Resolver {
                lib,
                version,
                v2: lib
                    .get::<FnGetProcAddressV2>(b"cuGetProcAddress_v2")
                    .ok()
                    .map(|s| *s),
                v1: lib
                    .get::<FnGetProcAddressV1>(b"cuGetProcAddress")
                    .ok()
                    .map(|s| *s),
            }
        }
    }

    /// # Safety
    /// `T` must be a function pointer type matching the symbol.
    unsafe fn get<T: Copy>(&self, name: &'static str, vtext: &str) -> Result<T> {
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<*mut c_void>());
        let cname = std::ffi::CString::new(name).expect("symbol names have no NUL");
        let mut ptr: *mut c_void = std::ptr::null_mut();
        if let Some(v2) = self.v2 {
            let mut status = 0i32;
            if v2(cname.as_ptr(), &mut ptr, self.version, 0, &mut status) != 0 {
                ptr = std::ptr::null_mut();
            }
        }
        if ptr.is_null() {
            if let Some(v1) = self.v1 {
                if v1(cname.as_ptr(), &mut ptr, self.version, 0) != 0 {
                    ptr = std::ptr::null_mut();
                }
            }
        }
        if ptr.is_null() {
            if let Ok(s) = self.lib.get::<*mut c_void>(name.as_bytes()) {
                ptr = *s;
            }
        }
        if ptr.is_null() {
            return Err(Error::SymbolMissing {
                symbol: name,
                version: vtext.to_string(),
                needed: MIN_DRIVER_API,
            });
        }
        Ok(std::mem::transmute_copy::<*mut c_void, T>(&ptr))
    }
}

impl GpuDriver for CudaDriver {
    fn backend(&self) -> GpuBackend {
        GpuBackend::CudaDriver
    }

    fn simulated(&self) -> bool {
        self.simulated
    }

    fn supports_migration(&self) -> bool {
        self.layout.supports_gpu_pairs()
    }

    fn driver_version(&self) -> Option<String> {
        let cuda = version_text(self.version);
        if self.simulated {
            return Some(format!("SIMULATED CUDA {cuda} (gpu-checkpoint cuda-sim)"));
        }
        Some(match nvml_driver_version() {
            Some(d) => format!("{d} (CUDA {cuda})"),
            None => format!("CUDA {cuda}"),
        })
    }

    fn state(&self, pid: i32) -> Result<ProcessState> {
        let mut raw = u32::MAX;
        // SAFETY: writes one CUprocessState (an int-sized enum).
        self.call(Op::State, pid, || unsafe {
            (self.fns.get_state)(pid, &mut raw)
        })?;
        ProcessState::from_raw(raw).ok_or(Error::Cuda {
            op: Op::State,
            pid,
            code: CuError::Other(raw as i32),
            detail: Some(format!("unknown CUprocessState {raw}")),
        })
    }

    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<()> {
        let timeout_ms = timeout.map_or(0, |t| {
            (t.as_millis() as u64).clamp(1, u32::MAX as u64) as u32
        });
        let mut args = LockArgs {
            timeout_ms,
            ..Default::default()
        };
        // SAFETY: args is a zeroed CUcheckpointLockArgs that outlives the call.
        self.call(Op::Lock, pid, || unsafe {
            (self.fns.lock)(pid, (&mut args as *mut LockArgs).cast())
        })
    }

    fn checkpoint(&self, pid: i32) -> Result<()> {
        let mut plain = ReservedArgs::default();
        let mut v13_4 = CheckpointArgsV13_4 {
            custom_storage_info_out: std::ptr::null_mut(),
            reserved: [0; 7],
        };
        let args: *mut c_void = match self.layout {
            ApiLayout::V13_4 => (&mut v13_4 as *mut CheckpointArgsV13_4).cast(),
            _ => (&mut plain as *mut ReservedArgs).cast(),
        };
        // SAFETY: args points at the zeroed struct of the layout this driver expects.
        self.call(Op::Checkpoint, pid, || unsafe {
            (self.fns.checkpoint)(pid, args)
        })
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<()> {
        // The caller of restore must have initialised CUDA itself unless persistence mode is on.
        if let Err(code) = self.ensure_init() {
            return Err(Error::Cuda {
                op: Op::Restore,
                pid,
                code,
                detail: Some("cuInit(0) failed in gpu-checkpoint itself".into()),
            });
        }
        if !pairs.is_empty() && !self.layout.supports_gpu_pairs() {
            return Err(Error::MigrationUnsupported {
                version: version_text(self.version),
            });
        }
        let mut raw: Vec<GpuPairRaw> = pairs
            .iter()
            .map(|p| GpuPairRaw {
                old_uuid: p.old.0,
                new_uuid: p.new.0,
            })
            .collect();
        let (ptr, count) = if raw.is_empty() {
            (std::ptr::null_mut(), 0)
        } else {
            (raw.as_mut_ptr(), raw.len() as u32)
        };
        let mut a12 = ReservedArgs::default();
        let mut a13_0 = RestoreArgsV13_0 {
            gpu_pairs: ptr,
            gpu_pairs_count: count,
            reserved: [0; 44],
            reserved1: 0,
        };
        let mut a13_3 = RestoreArgsV13_3 {
            gpu_pairs: ptr,
            gpu_pairs_count: count,
            reserved: [0; 52],
        };
        let mut a13_4 = RestoreArgsV13_4 {
            gpu_pairs: ptr,
            gpu_pairs_count: count,
            padding0: 0,
            custom_storage_info_out: std::ptr::null_mut(),
            reserved: [0; 40],
        };
        let args: *mut c_void = match self.layout {
            ApiLayout::V12_8 => (&mut a12 as *mut ReservedArgs).cast(),
            ApiLayout::V13_0 => (&mut a13_0 as *mut RestoreArgsV13_0).cast(),
            ApiLayout::V13_3 => (&mut a13_3 as *mut RestoreArgsV13_3).cast(),
            ApiLayout::V13_4 => (&mut a13_4 as *mut RestoreArgsV13_4).cast(),
        };
        // SAFETY: args points at this driver's restore layout; `raw` outlives the call.
        let r = self.call(Op::Restore, pid, || unsafe {
            (self.fns.restore)(pid, args)
        });
        drop(raw);
        r
    }

    fn unlock(&self, pid: i32) -> Result<()> {
        let mut args = UnlockArgs::default();
        // SAFETY: zeroed CUcheckpointUnlockArgs.
        self.call(Op::Unlock, pid, || unsafe {
            (self.fns.unlock)(pid, (&mut args as *mut UnlockArgs).cast())
        })
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32> {
        let mut tid = 0;
        // SAFETY: writes one int.
        self.call(Op::RestoreTid, pid, || unsafe {
            (self.fns.restore_tid)(pid, &mut tid)
        })?;
        Ok(tid)
    }

    fn setup_timings(&self) -> Option<SetupTimings> {
        Some(CudaDriver::setup_timings(self))
    }

    fn process_gpus(&self, pid: i32) -> Option<Vec<GpuUuid>> {
        nvml_process_gpus(pid)
    }

    fn process_memory(&self, pid: i32) -> Option<Vec<super::GpuMemory>> {
        nvml_process_memory(pid)
    }

    fn free_memory(&self, gpu: &GpuUuid) -> Option<u64> {
        nvml_free_memory(gpu)
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>> {
        match nvml_gpus() {
            Some(g) => Ok(g),
            None => self.cuda_gpus(),
        }
    }
}

/// The GPUs NVML lists (nvidia-smi's indices), or `None` when NVML is not available.
pub fn nvml_gpus() -> Option<Vec<GpuInfo>> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let n = nvml.device_count().ok()?;
    let mut out = Vec::new();
    for i in 0..n {
        let d = nvml.device_by_index(i).ok()?;
        out.push(GpuInfo {
            index: i,
            uuid: d.uuid().ok()?.parse().ok()?,
            model: d.name().unwrap_or_default(),
            memory_bytes: d.memory_info().ok().map(|m| m.total),
        });
    }
    Some(out)
}

/// The GPUs on which NVML lists `pid` as a compute process.
pub fn nvml_process_gpus(pid: i32) -> Option<Vec<GpuUuid>> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let mut out = Vec::new();
    for i in 0..nvml.device_count().ok()? {
        let d = nvml.device_by_index(i).ok()?;
        let procs = d.running_compute_processes().ok()?;
        if procs.iter().any(|p| p.pid as i32 == pid) {
            out.push(d.uuid().ok()?.parse().ok()?);
        }
    }
    Some(out)
}

/// The device memory NVML counts for `pid` on each GPU it runs on.
pub fn nvml_process_memory(pid: i32) -> Option<Vec<super::GpuMemory>> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let mut out = Vec::new();
    for i in 0..nvml.device_count().ok()? {
        let d = nvml.device_by_index(i).ok()?;
        for p in d.running_compute_processes().ok()? {
            if p.pid as i32 != pid {
                continue;
            }
            if let nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) = p.used_gpu_memory {
                out.push(super::GpuMemory {
                    gpu: d.uuid().ok()?.parse().ok()?,
                    bytes,
                });
            }
        }
    }
    Some(out)
}

/// Free memory of a GPU, from NVML.
pub fn nvml_free_memory(gpu: &GpuUuid) -> Option<u64> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let d = nvml.device_by_uuid(gpu.to_string()).ok()?;
    d.memory_info().ok().map(|m| m.free)
}

/// The display driver version ("580.65.06") from NVML, when available.
pub fn nvml_driver_version() -> Option<String> {
    nvml_wrapper::Nvml::init().ok()?.sys_driver_version().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Classify;

    #[test]
    fn missing_library_is_an_error_naming_the_driver_not_a_panic() {
        // This machine class has no NVIDIA driver; on one that has it, opening must succeed or name
        // what is missing.
        match CudaDriver::open() {
            Ok(d) => assert!(d.version() >= 12080),
            Err(e) => {
                let s = e.to_string();
                assert!(s.contains("570") || s.contains("driver"), "{s}");
                assert_eq!(e.exit_status(), crate::ExitStatus::ToolMissing);
            }
        }
    }
}
