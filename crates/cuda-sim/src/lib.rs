//! A SIMULATED `libcuda.so.1`, for tests and demos only: the CUDA driver's checkpoint API at the ABI level,
//! so that gpu-checkpoint's real `cuda-driver` backend (dlopen, `cuGetProcAddress`, the per-version argument
//! layouts, `cuInit` before a restore) runs end to end on machines without a GPU.
//!
//! Each `cuCheckpointProcess*` call is checked as the real driver would check it: the 64 argument bytes
//! read at `cuda.h`'s offsets for the simulated version ([`args`]), reserved bytes zero, the GPU pair list
//! covering every GPU the process uses and naming GPUs that exist, `cuInit` done before a restore. It is
//! then forwarded to the target `gpu-sim-workload`'s control socket, which keeps the process's state
//! machine (legal transitions, lock timeouts, injected faults) and answers with the documented `CUresult`
//! codes.
//!
//! It is never installed and never found by itself: the build leaves it as `libcuda.so`, and a test or
//! demo links it as `libcuda.so.1` into a folder of its own named by `LD_LIBRARY_PATH`. It says SIMULATED
//! wherever it speaks: on stderr when first used, in the GPU names, and through the
//! `gpuCheckpointSimulatedDriver` symbol that gpu-checkpoint looks for to label its driver version.
//!
//! `GPU_CHECKPOINT_SIM_CUDA_VERSION` picks the CUDA version it reports (`12.8`, `13.0`, `13.3`, `13.4`, or
//! `cuDriverGetVersion`'s number such as `13040`; default 13.4); `GPU_CHECKPOINT_SIM_GPUS` how many GPUs
//! it has (as the simulator).

#![allow(non_snake_case)] // the driver's own names

pub mod args;

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, RefUnwindSafe, UnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use args::{Layout, Parsed, ARGS_SIZE};
use gpu_checkpoint::freeze::{sim, Error, GpuUuid, Op};

/// `CUresult` values used here.
const SUCCESS: i32 = 0;
const INVALID_VALUE: i32 = 1;
const NOT_INITIALIZED: i32 = 3;
const INVALID_DEVICE: i32 = 101;
const NOT_FOUND: i32 = 500;
const NOT_SUPPORTED: i32 = 801;
const UNKNOWN: i32 = 999;
/// `CU_GET_PROC_ADDRESS_SUCCESS` / `_SYMBOL_NOT_FOUND`.
const PROC_FOUND: i32 = 0;
const PROC_NOT_FOUND: i32 = 1;

/// What the control socket is given for one answer (a lock waits as long as its timeout on top).
const ANSWER: Duration = Duration::from_secs(10);

static INIT: AtomicBool = AtomicBool::new(false);

/// The CUDA version reported, as `cuDriverGetVersion` encodes it (1000 * major + 10 * minor).
fn version() -> i32 {
    static V: OnceLock<i32> = OnceLock::new();
    *V.get_or_init(|| {
        let v = std::env::var("GPU_CHECKPOINT_SIM_CUDA_VERSION").unwrap_or_default();
        let parsed = match v.split_once('.') {
            Some((maj, min)) => maj
                .parse::<i32>()
                .ok()
                .zip(min.parse::<i32>().ok())
                .map(|(a, b)| a * 1000 + b * 10),
            None => v.parse().ok(),
        };
        let v = parsed.unwrap_or(13040);
        eprintln!(
            "libcuda.so.1: SIMULATED CUDA driver {}.{} (gpu-checkpoint's cuda-sim, tests and demos only)",
            v / 1000,
            (v % 1000) / 10
        );
        v
    })
}

fn layout() -> Option<Layout> {
    Layout::of(version())
}

/// Runs an entry point's body; a panic must not unwind into the caller's C frames.
fn guarded(f: impl FnOnce() -> i32 + UnwindSafe) -> i32 {
    catch_unwind(f).unwrap_or(UNKNOWN)
}

/// Says why a call was refused (the driver only returns a code; the simulator also explains).
fn refuse(call: &str, code: i32, why: &str) -> i32 {
    eprintln!("libcuda.so.1 (SIMULATED): {call}: {why}");
    code
}

/// The `CUresult` for a failed request to the simulated process.
fn code_of(pid: i32, e: &Error) -> i32 {
    match e {
        Error::Cuda { code, .. } => code.code(),
        // Not a simulated GPU process: the driver finds no CUDA state in it.
        Error::SimUnreachable { .. } if std::path::Path::new(&format!("/proc/{pid}")).exists() => {
            NOT_FOUND
        }
        Error::SimUnreachable { .. } => INVALID_VALUE,
        _ => UNKNOWN,
    }
}

/// Sends `line` to process `pid`'s simulator; `wait` on top of the usual answer time.
fn forward(pid: i32, op: Op, line: &str, wait: Duration) -> Result<String, i32> {
    sim::request(pid, op, line, ANSWER + wait).map_err(|e| code_of(pid, &e))
}

/// Copies the 64 argument bytes; null is INVALID_VALUE.
///
/// # Safety
/// A non-null `p` must point at 64 readable bytes.
unsafe fn read_args(p: *const c_void) -> Option<[u8; ARGS_SIZE]> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller passes a 64-byte argument struct, as the API requires.
    Some(unsafe { std::ptr::read_unaligned(p.cast::<[u8; ARGS_SIZE]>()) })
}

/// The marker gpu-checkpoint looks for: this libcuda is a simulator.
#[no_mangle]
pub extern "C" fn gpuCheckpointSimulatedDriver() -> *const c_char {
    c"SIMULATED CUDA driver (gpu-checkpoint cuda-sim)".as_ptr()
}

/// # Safety
/// As `cuInit`.
#[no_mangle]
pub unsafe extern "C" fn cuInit(flags: u32) -> i32 {
    guarded(|| {
        version();
        if flags != 0 {
            return INVALID_VALUE;
        }
        INIT.store(true, Ordering::SeqCst);
        SUCCESS
    })
}

/// # Safety
/// `v` must be null or point at an int.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut i32) -> i32 {
    guarded(|| {
        if v.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, an int as the API says.
        unsafe { *v = version() };
        SUCCESS
    })
}

/// The entry points `cuGetProcAddress` hands out, by name.
fn entry_point(name: &str) -> Option<*mut c_void> {
    let checkpoint_api = layout().is_some();
    let p: *mut c_void = match name {
        "cuInit" => cuInit as *mut c_void,
        "cuDriverGetVersion" => cuDriverGetVersion as *mut c_void,
        "cuCheckpointProcessGetState" if checkpoint_api => {
            cuCheckpointProcessGetState as *mut c_void
        }
        "cuCheckpointProcessLock" if checkpoint_api => cuCheckpointProcessLock as *mut c_void,
        "cuCheckpointProcessCheckpoint" if checkpoint_api => {
            cuCheckpointProcessCheckpoint as *mut c_void
        }
        "cuCheckpointProcessRestore" if checkpoint_api => cuCheckpointProcessRestore as *mut c_void,
        "cuCheckpointProcessUnlock" if checkpoint_api => cuCheckpointProcessUnlock as *mut c_void,
        "cuCheckpointProcessGetRestoreThreadId" if checkpoint_api => {
            cuCheckpointProcessGetRestoreThreadId as *mut c_void
        }
        "cuDeviceGetCount" => cuDeviceGetCount as *mut c_void,
        "cuDeviceGet" => cuDeviceGet as *mut c_void,
        "cuDeviceGetUuid" | "cuDeviceGetUuid_v2" => cuDeviceGetUuid_v2 as *mut c_void,
        "cuDeviceGetName" => cuDeviceGetName as *mut c_void,
        "cuDeviceTotalMem" | "cuDeviceTotalMem_v2" => cuDeviceTotalMem_v2 as *mut c_void,
        // CUDA 13.4's custom storage, offered only when asked for: what the public documentation says of
        // it is enough to detect it, not to simulate its data path (docs/gpu.md).
        "cuCheckpointOperationComplete" if layout() == Some(Layout::V13_4) && custom_storage() => {
            cuCheckpointOperationComplete as *mut c_void
        }
        _ => return None,
    };
    Some(p)
}

/// # Safety
/// As `cuGetProcAddress_v2`: `symbol` a C string, `pfn` and `status` null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    _cuda_version: i32,
    flags: u64,
    status: *mut i32,
) -> i32 {
    guarded(|| {
        if symbol.is_null() || pfn.is_null() || flags != 0 {
            return INVALID_VALUE;
        }
        // SAFETY: a C string, as the API says.
        let name = unsafe { CStr::from_ptr(symbol) }.to_string_lossy();
        let found = entry_point(&name);
        // SAFETY: non-null out-pointers of the documented types.
        unsafe {
            *pfn = found.unwrap_or(std::ptr::null_mut());
            if !status.is_null() {
                *status = if found.is_some() {
                    PROC_FOUND
                } else {
                    PROC_NOT_FOUND
                };
            }
        }
        if found.is_some() {
            SUCCESS
        } else {
            NOT_FOUND
        }
    })
}

/// # Safety
/// As `cuGetProcAddress` (CUDA 11.3-12.4).
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    cuda_version: i32,
    flags: u64,
) -> i32 {
    // SAFETY: the same contract, without the status output.
    unsafe { cuGetProcAddress_v2(symbol, pfn, cuda_version, flags, std::ptr::null_mut()) }
}

/// `GPU_CHECKPOINT_SIM_CUSTOM_STORAGE=1`: the simulated 13.4 driver offers custom storage.
fn custom_storage() -> bool {
    std::env::var("GPU_CHECKPOINT_SIM_CUSTOM_STORAGE").as_deref() == Ok("1")
}

/// Ends a custom-storage operation. Not simulated: the simulator never hands out a handle. Not exported by
/// name either, so that a driver without custom storage is simulated too: only `cuGetProcAddress` hands
/// it out, when [`custom_storage`] says so.
extern "C" fn cuCheckpointOperationComplete(_handle: *mut c_void) -> i32 {
    refuse(
        "cuCheckpointOperationComplete",
        NOT_SUPPORTED,
        "custom storage is detected but not simulated",
    )
}

/// # Safety
/// `state` null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: i32, state: *mut u32) -> i32 {
    guarded(|| {
        if state.is_null() {
            return INVALID_VALUE;
        }
        let s = match forward(pid, Op::State, "STATE", Duration::ZERO) {
            Ok(s) => s,
            Err(code) => return code,
        };
        let raw = match s.as_str() {
            "running" => 0,
            "locked" => 1,
            "checkpointed" => 2,
            "failed" => 3,
            other => return refuse("cuCheckpointProcessGetState", UNKNOWN, other),
        };
        // SAFETY: non-null, a CUprocessState.
        unsafe { *state = raw };
        SUCCESS
    })
}

/// # Safety
/// `args` null or a 64-byte `CUcheckpointLockArgs`.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessLock(pid: i32, a: *mut c_void) -> i32 {
    guarded(|| {
        // SAFETY: forwarded from our caller's contract.
        let Some(b) = (unsafe { read_args(a) }) else {
            return INVALID_VALUE;
        };
        let timeout_ms = match args::lock(&b) {
            Ok(Parsed::Lock { timeout_ms }) => timeout_ms,
            Ok(_) => return UNKNOWN,
            Err(why) => return refuse("cuCheckpointProcessLock", INVALID_VALUE, &why),
        };
        // 0: no timeout (the driver waits for submitted work as long as it takes).
        let wait = if timeout_ms == 0 {
            Duration::from_secs(3600)
        } else {
            Duration::from_millis(timeout_ms.into())
        };
        status(forward(pid, Op::Lock, &format!("LOCK {timeout_ms}"), wait))
    })
}

/// # Safety
/// `args` null or a 64-byte `CUcheckpointCheckpointArgs`.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessCheckpoint(pid: i32, a: *mut c_void) -> i32 {
    guarded(|| {
        let Some(layout) = layout() else {
            return NOT_FOUND;
        };
        // SAFETY: forwarded from our caller's contract.
        let Some(b) = (unsafe { read_args(a) }) else {
            return INVALID_VALUE;
        };
        if let Err(why) = args::checkpoint(layout, &b) {
            return refuse("cuCheckpointProcessCheckpoint", INVALID_VALUE, &why);
        }
        status(forward(pid, Op::Checkpoint, "CHECKPOINT", Duration::ZERO))
    })
}

/// # Safety
/// `args` null or a 64-byte `CUcheckpointRestoreArgs`; its pair list `gpuPairsCount` readable pairs.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessRestore(pid: i32, a: *mut c_void) -> i32 {
    guarded(|| {
        let call = "cuCheckpointProcessRestore";
        let Some(layout) = layout() else {
            return NOT_FOUND;
        };
        // The caller needs persistence mode or its own cuInit (the simulated node has no persistence mode).
        if !INIT.load(Ordering::SeqCst) {
            return refuse(
                call,
                NOT_INITIALIZED,
                "cuInit was not called in this process",
            );
        }
        // SAFETY: forwarded from our caller's contract.
        let Some(b) = (unsafe { read_args(a) }) else {
            return INVALID_VALUE;
        };
        let (ptr, count) = match args::restore(layout, &b) {
            Ok(Parsed::Restore { pairs, count }) => (pairs, count as usize),
            Ok(_) => return UNKNOWN,
            Err(why) => return refuse(call, INVALID_VALUE, &why),
        };
        let pairs: Vec<(GpuUuid, GpuUuid)> = if count == 0 {
            Vec::new()
        } else {
            // SAFETY: the caller's list of `count` CUcheckpointGpuPair (two 16-byte CUuuids each).
            let raw = unsafe { std::slice::from_raw_parts(ptr as *const [u8; 32], count) };
            raw.iter()
                .map(|p| {
                    let (old, new) = p.split_at(16);
                    (
                        GpuUuid(old.try_into().expect("16")),
                        GpuUuid(new.try_into().expect("16")),
                    )
                })
                .collect()
        };
        if let Err((code, why)) = check_pairs(pid, &pairs) {
            return refuse(call, code, &why);
        }
        let map: Vec<String> = pairs.iter().map(|(o, n)| format!("{o}={n}")).collect();
        let line = format!("RESTORE {}", map.join(","));
        status(forward(pid, Op::Restore, line.trim_end(), Duration::ZERO))
    })
}

/// A pair list must cover every GPU the process used, and name GPUs this node has (same chip: every
/// simulated GPU is the same model).
fn check_pairs(pid: i32, pairs: &[(GpuUuid, GpuUuid)]) -> Result<(), (i32, String)> {
    if pairs.is_empty() {
        return Ok(());
    }
    let used: Vec<GpuUuid> = sim::status(pid)
        .ok()
        .and_then(|st| {
            st.get("uuids")?
                .split(',')
                .map(|u| u.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    if let Some(missing) = used.iter().find(|u| !pairs.iter().any(|(o, _)| o == *u)) {
        return Err((
            INVALID_VALUE,
            format!("the GPU pairs do not cover {missing}, which the process used"),
        ));
    }
    let here = sim::sim_gpus();
    if let Some((_, n)) = pairs
        .iter()
        .find(|(_, n)| !here.iter().any(|g| g.uuid == *n))
    {
        return Err((INVALID_DEVICE, format!("no GPU {n} on this node")));
    }
    Ok(())
}

/// # Safety
/// `args` null or a 64-byte `CUcheckpointUnlockArgs`.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessUnlock(pid: i32, a: *mut c_void) -> i32 {
    guarded(|| {
        // SAFETY: forwarded from our caller's contract.
        let Some(b) = (unsafe { read_args(a) }) else {
            return INVALID_VALUE;
        };
        if let Err(why) = args::unlock(&b) {
            return refuse("cuCheckpointProcessUnlock", INVALID_VALUE, &why);
        }
        status(forward(pid, Op::Unlock, "UNLOCK", Duration::ZERO))
    })
}

/// # Safety
/// `tid` null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessGetRestoreThreadId(pid: i32, tid: *mut i32) -> i32 {
    guarded(|| {
        if tid.is_null() {
            return INVALID_VALUE;
        }
        match forward(pid, Op::RestoreTid, "RESTORE_TID", Duration::ZERO) {
            Ok(s) => match s.parse() {
                // SAFETY: non-null, an int.
                Ok(t) => unsafe {
                    *tid = t;
                    SUCCESS
                },
                Err(_) => UNKNOWN,
            },
            Err(code) => code,
        }
    })
}

fn status(r: Result<String, i32>) -> i32 {
    match r {
        Ok(_) => SUCCESS,
        Err(code) => code,
    }
}

/// The device calls need `cuInit`, as on a real driver.
fn device(ordinal: i32) -> Result<gpu_checkpoint::freeze::GpuInfo, i32> {
    if !INIT.load(Ordering::SeqCst) {
        return Err(NOT_INITIALIZED);
    }
    usize::try_from(ordinal)
        .ok()
        .and_then(|i| sim::sim_gpus().into_iter().nth(i))
        .ok_or(INVALID_DEVICE)
}

/// The driver's one-value device queries: device `dev` (after `cuInit`) and `out` non-null, or their error;
/// then `value` of that device written through `out`.
///
/// # Safety
/// `out` null or writable.
unsafe fn device_query<T: RefUnwindSafe>(
    out: *mut T,
    dev: i32,
    value: impl FnOnce(gpu_checkpoint::freeze::GpuInfo) -> T + UnwindSafe,
) -> i32 {
    guarded(|| match (device(dev), out.is_null()) {
        (Err(c), _) => c,
        (_, true) => INVALID_VALUE,
        (Ok(g), false) => {
            // SAFETY: non-null, and writable by the caller's contract.
            unsafe { *out = value(g) };
            SUCCESS
        }
    })
}

/// # Safety
/// `n` null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut i32) -> i32 {
    guarded(|| {
        if !INIT.load(Ordering::SeqCst) {
            return NOT_INITIALIZED;
        }
        if n.is_null() {
            return INVALID_VALUE;
        }
        // SAFETY: non-null, an int.
        unsafe { *n = sim::sim_gpus().len() as i32 };
        SUCCESS
    })
}

/// # Safety
/// `dev` null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut i32, ordinal: i32) -> i32 {
    // The device handle is its ordinal.
    // SAFETY: `dev` null or a writable CUdevice (an int).
    unsafe { device_query(dev, ordinal, |_| ordinal) }
}

/// # Safety
/// `uuid` null or 16 writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: i32) -> i32 {
    // SAFETY: `uuid` null or a writable CUuuid.
    unsafe { device_query(uuid, dev, |g| g.uuid.0) }
}

/// # Safety
/// `name` null or `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: i32, dev: i32) -> i32 {
    guarded(|| {
        let g = match device(dev) {
            Ok(g) => g,
            Err(c) => return c,
        };
        let Ok(len) = usize::try_from(len) else {
            return INVALID_VALUE;
        };
        if name.is_null() || len == 0 {
            return INVALID_VALUE;
        }
        let text = g.model.as_bytes();
        let n = text.len().min(len - 1);
        // SAFETY: `len` writable bytes; n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), name, n);
            *name.add(n) = 0;
        }
        SUCCESS
    })
}

/// # Safety
/// `bytes` null or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: i32) -> i32 {
    // SAFETY: `bytes` null or a writable size_t.
    unsafe { device_query(bytes, dev, |g| g.memory_bytes.unwrap_or(0) as usize) }
}

/// The codes this library returns are the driver's (a test ties them to gpu-checkpoint's table).
#[cfg(test)]
mod tests {
    use super::*;
    use gpu_checkpoint::freeze::CuError;

    #[test]
    fn codes_are_the_documented_ones() {
        for (code, e) in [
            (INVALID_VALUE, CuError::InvalidValue),
            (NOT_INITIALIZED, CuError::NotInitialized),
            (INVALID_DEVICE, CuError::InvalidDevice),
            (NOT_FOUND, CuError::NotFound),
            (UNKNOWN, CuError::Unknown),
        ] {
            assert_eq!(CuError::from_code(code), Some(e));
        }
    }

    #[test]
    fn entry_points_are_found_by_name_and_unknown_ones_are_not() {
        let mut p = std::ptr::null_mut();
        let mut st = -1;
        let name = c"cuCheckpointProcessLock";
        // SAFETY: valid pointers.
        let r = unsafe { cuGetProcAddress_v2(name.as_ptr(), &mut p, 13040, 0, &mut st) };
        assert_eq!((r, st), (SUCCESS, PROC_FOUND));
        assert_eq!(p, cuCheckpointProcessLock as *mut c_void);
        let name = c"cuNoSuchThing";
        // SAFETY: valid pointers.
        let r = unsafe { cuGetProcAddress_v2(name.as_ptr(), &mut p, 13040, 0, &mut st) };
        assert_eq!((r, st), (NOT_FOUND, PROC_NOT_FOUND));
        assert!(p.is_null());
    }

    #[test]
    fn devices_need_cuinit_and_are_labelled_simulated() {
        let mut n = 0;
        // SAFETY: valid pointers.
        unsafe {
            assert_eq!(cuInit(1), INVALID_VALUE);
            assert_eq!(cuInit(0), SUCCESS);
            assert_eq!(cuDeviceGetCount(&mut n), SUCCESS);
            assert!(n > 0);
            let mut name = [0 as c_char; 64];
            assert_eq!(cuDeviceGetName(name.as_mut_ptr(), 64, 0), SUCCESS);
            assert!(CStr::from_ptr(name.as_ptr())
                .to_string_lossy()
                .contains("SIMULATED"));
            let mut d = 0;
            assert_eq!(cuDeviceGet(&mut d, n), INVALID_DEVICE);
        }
    }

    #[test]
    fn a_process_without_a_simulator_has_no_cuda_state() {
        let mut s = 9;
        // SAFETY: valid pointers.
        let r = unsafe { cuCheckpointProcessGetState(std::process::id() as i32, &mut s) };
        assert_eq!(r, NOT_FOUND);
        // SAFETY: valid pointers; a PID that does not exist.
        let r = unsafe { cuCheckpointProcessGetState(i32::MAX - 1, &mut s) };
        assert_eq!(r, INVALID_VALUE);
        // SAFETY: a null argument struct.
        assert_eq!(
            unsafe { cuCheckpointProcessLock(1, std::ptr::null_mut()) },
            INVALID_VALUE
        );
    }
}
