//! A CRIU plugin (CRIU 4.x plugin ABI, version 0.2.0) for device files CRIU cannot dump.
//!
//! CRIU dlopens every `*.so` in `CRIU_LIBS_DIR` and reads `CR_PLUGIN_DESC`. For a descriptor of a file type
//! it does not know (a character device other than a terminal or a memory device), CRIU asks its plugins
//! `DUMP_EXT_FILE(fd, id)` (`fd`: CRIU's own copy of the descriptor) and, on restore, inside the process it
//! restores, `RESTORE_EXT_FILE(id)`, which returns a new descriptor that CRIU moves to the original number.
//!
//! This plugin takes only character devices that are NVIDIA device nodes or named in
//! `GPU_CHECKPOINT_DEVICES_ALLOW`, and only when gpu-checkpoint named its record file in
//! `GPU_CHECKPOINT_DEVICES_RECORD`; every other file is "not mine" (`-ENOTSUP`). See
//! `gpu_checkpoint::dump::devices` for the tool's side and `gpu_checkpoint_device_records` for the record
//! format.
//!
//! With `GPU_CHECKPOINT_DEVICES_REPLACE_MAPPINGS=1` it also answers `HANDLE_DEVICE_VMA` for mappings of
//! `/dev/nvidiaN` and `/dev/nvidia-uvm` (what a child forked without exec keeps of its CUDA parent): CRIU
//! then records the mapping without contents, and on restore calls `UPDATE_VMA_MAP`, where the plugin hands
//! it a descriptor of `/dev/zero` to map instead: zeroed shared memory at the same address. Nothing panics across the
//! C boundary: each hook runs under `catch_unwind` and answers an errno instead.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;

use gpu_checkpoint_device_records::{
    is_replaceable_node, is_taken, parse_records, ReopenedDevice, ENV_ALLOW, ENV_RECORD,
    ENV_REPLACE,
};

/// `CRIU_PLUGIN_GEN_VERSION(0, 2, 0)`.
const PLUGIN_VERSION: c_uint = 2 << 8;
/// `CR_PLUGIN_HOOK__MAX` in CRIU 4.2.
const MAX_HOOKS: usize = 13;
const HOOK_DUMP_EXT_FILE: usize = 2;
const HOOK_RESTORE_EXT_FILE: usize = 3;
const HOOK_HANDLE_DEVICE_VMA: usize = 7;
const HOOK_UPDATE_VMA_MAP: usize = 8;

/// CRIU's `cr_plugin_desc_t`.
#[repr(C)]
pub struct PluginDesc {
    name: *const c_char,
    init: Option<unsafe extern "C" fn(c_int) -> c_int>,
    exit: Option<unsafe extern "C" fn(c_int, c_int)>,
    version: c_uint,
    max_hooks: c_uint,
    hooks: [*const c_void; MAX_HOOKS],
}

// SAFETY: the descriptor is never written after it is built; CRIU only reads it.
unsafe impl Sync for PluginDesc {}

const fn hooks() -> [*const c_void; MAX_HOOKS] {
    let mut h = [std::ptr::null(); MAX_HOOKS];
    h[HOOK_DUMP_EXT_FILE] = dump_ext_file as *const c_void;
    h[HOOK_RESTORE_EXT_FILE] = restore_ext_file as *const c_void;
    h[HOOK_HANDLE_DEVICE_VMA] = handle_device_vma as *const c_void;
    h[HOOK_UPDATE_VMA_MAP] = update_vma_map as *const c_void;
    h
}

/// What CRIU looks up (`dlsym(h, "CR_PLUGIN_DESC")`).
#[no_mangle]
pub static CR_PLUGIN_DESC: PluginDesc = PluginDesc {
    name: c"gpu-checkpoint-devices".as_ptr(),
    init: Some(init),
    exit: Some(exit),
    version: PLUGIN_VERSION,
    max_hooks: MAX_HOOKS as c_uint,
    hooks: hooks(),
};

unsafe extern "C" fn init(_stage: c_int) -> c_int {
    0
}

unsafe extern "C" fn exit(_stage: c_int, _ret: c_int) {}

/// Runs `f` and turns a panic into `-EIO`.
fn guarded(f: impl FnOnce() -> c_int) -> c_int {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(-libc::EIO)
}

fn errno_of(e: &std::io::Error) -> c_int {
    -e.raw_os_error().unwrap_or(libc::EIO)
}

/// `DUMP_EXT_FILE`: records a descriptor of a device node this plugin takes; `-ENOTSUP` for any other.
unsafe extern "C" fn dump_ext_file(fd: c_int, id: c_int) -> c_int {
    guarded(|| match dump_one(fd, id) {
        Ok(true) => 0,
        Ok(false) => -libc::ENOTSUP,
        Err(e) => errno_of(&e),
    })
}

fn dump_one(fd: c_int, id: c_int) -> std::io::Result<bool> {
    let Some(record) = std::env::var_os(ENV_RECORD).filter(|r| !r.is_empty()) else {
        return Ok(false);
    };
    let Ok(id) = u32::try_from(id) else {
        return Ok(false);
    };
    // SAFETY: an all-zero stat is a valid value for fstat to overwrite.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid stat buffer; a bad `fd` makes fstat fail, nothing else.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFCHR {
        return Ok(false);
    }
    let link = std::fs::read_link(format!("/proc/self/fd/{fd}"))?;
    let Some(path) = link.to_str() else {
        return Ok(false);
    };
    let allow = std::env::var(ENV_ALLOW).ok();
    if path.contains('\n') || !is_taken(path, allow.as_deref()) {
        return Ok(false);
    }
    // SAFETY: F_GETFL takes no argument and only reads the descriptor's flags.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let line = ReopenedDevice {
        id,
        path: path.to_string(),
        flags,
        rdev: st.st_rdev,
    }
    .line();
    // One write of one line, O_APPEND: whole lines even if CRIU ever dumped from several processes.
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(record)?;
    f.write_all(line.as_bytes())?;
    Ok(true)
}

/// `RESTORE_EXT_FILE`: opens the recorded node again and returns the new descriptor; `-ENOTSUP` for an id
/// it did not record.
unsafe extern "C" fn restore_ext_file(id: c_int) -> c_int {
    guarded(|| match restore_one(id) {
        Ok(Some(fd)) => fd,
        Ok(None) => -libc::ENOTSUP,
        Err(e) => errno_of(&e),
    })
}

fn restore_one(id: c_int) -> std::io::Result<Option<c_int>> {
    let Some(record) = std::env::var_os(ENV_RECORD).filter(|r| !r.is_empty()) else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(record)?;
    let records = parse_records(&text)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let Some(dev) = records.iter().find(|d| i64::from(d.id) == i64::from(id)) else {
        return Ok(None);
    };
    let path = CString::new(std::path::Path::new(&dev.path).as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    Ok(Some(open_same(&path, dev)?))
}

/// Opens `path` with the recorded flags and checks it is the same character device; never creates.
fn open_same(path: &CStr, dev: &ReopenedDevice) -> std::io::Result<c_int> {
    // SAFETY: `path` is a valid C string; the flags hold no O_CREAT, so no mode argument is read.
    let fd = unsafe { libc::open(path.as_ptr(), dev.open_flags()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: an all-zero stat is a valid value for fstat to overwrite; `fd` is ours.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let same = unsafe { libc::fstat(fd, &mut st) } == 0
        && st.st_mode & libc::S_IFMT == libc::S_IFCHR
        && st.st_rdev == dev.rdev;
    if !same {
        // SAFETY: `fd` is ours and not used again.
        unsafe { libc::close(fd) };
        return Err(std::io::Error::from_raw_os_error(libc::ENODEV));
    }
    Ok(fd)
}

/// Whether the tool asked for inherited NVIDIA mappings to be replaced (and named a record file: the
/// plugin acts only for gpu-checkpoint).
fn replacing() -> bool {
    std::env::var_os(ENV_RECORD).is_some_and(|r| !r.is_empty())
        && std::env::var(ENV_REPLACE).as_deref() == Ok("1")
}

/// Whether a mapping of the file at `path` (a character device when `chr`) is one this plugin lets CRIU
/// record for replacement.
fn replaces(path: &str, chr: bool, replacing: bool) -> bool {
    replacing && chr && is_replaceable_node(path)
}

/// `HANDLE_DEVICE_VMA`: 0 for a mapping of an NVIDIA node this dump replaces (CRIU records it as a shared
/// mapping of the node, without contents), `-ENOTSUP` for any other.
unsafe extern "C" fn handle_device_vma(fd: c_int, st: *const libc::stat) -> c_int {
    guarded(|| {
        // SAFETY: CRIU passes the stat of the mapping's file, valid for the call (or null).
        let chr =
            unsafe { st.as_ref() }.is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFCHR);
        let path = std::fs::read_link(format!("/proc/self/fd/{fd}")).ok();
        let path = path.as_deref().and_then(|p| p.to_str()).unwrap_or("");
        if replaces(path, chr, replacing()) {
            0
        } else {
            -libc::ENOTSUP
        }
    })
}

thread_local! {
    /// The `/dev/zero` descriptor handed to CRIU in this (restored) process: CRIU maps every replaced
    /// mapping of one node through the first descriptor it got and closes it in its restorer, so handing
    /// the same one again opens nothing CRIU would leave behind.
    static ZERO: std::cell::Cell<Option<c_int>> = const { std::cell::Cell::new(None) };
}

/// A descriptor of `/dev/zero` (read-write: a shared writable mapping needs it), opened once per process.
fn zero_fd() -> std::io::Result<c_int> {
    if let Some(fd) = ZERO.with(|z| z.get()) {
        return Ok(fd);
    }
    // SAFETY: a valid C string; no O_CREAT, so no mode argument is read.
    let fd = unsafe { libc::open(c"/dev/zero".as_ptr(), libc::O_RDWR | libc::O_NOCTTY) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    ZERO.with(|z| z.set(Some(fd)));
    Ok(fd)
}

/// `UPDATE_VMA_MAP`: for a mapping of an NVIDIA node recorded for replacement, 1 with a descriptor of
/// `/dev/zero` (offset 0) for CRIU to map in its place; `-ENOTSUP` for any other.
unsafe extern "C" fn update_vma_map(
    path: *const c_char,
    _addr: u64,
    _old_pgoff: u64,
    new_pgoff: *mut u64,
    plugin_fd: *mut c_int,
) -> c_int {
    guarded(|| {
        if path.is_null() || new_pgoff.is_null() || plugin_fd.is_null() {
            return -libc::ENOTSUP;
        }
        // SAFETY: CRIU passes the file's recorded path, a NUL-terminated string.
        let path = unsafe { CStr::from_ptr(path) }.to_str().unwrap_or("");
        if !replaces(path, true, replacing()) {
            return -libc::ENOTSUP;
        }
        match zero_fd() {
            Ok(fd) => {
                // SAFETY: both pointers are CRIU's out-parameters, checked non-null above.
                unsafe {
                    *new_pgoff = 0;
                    *plugin_fd = fd;
                }
                1
            }
            Err(e) => errno_of(&e),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_inherited_nvidia_mappings_are_replaced_and_only_when_asked() {
        for p in ["/dev/nvidia0", "/dev/nvidia3", "/dev/nvidia-uvm"] {
            assert!(replaces(p, true, true), "{p}");
            assert!(!replaces(p, true, false), "{p} without the tool asking");
            assert!(!replaces(p, false, true), "{p} not a character device");
        }
        // An NVML client's page of the control device is state: never replaced (detect refuses it).
        for p in [
            "/dev/nvidiactl",
            "/dev/nvidia-modeset",
            "/dev/fuse",
            "/dev/zero",
        ] {
            assert!(!replaces(p, true, true), "{p}");
        }
    }

    #[test]
    fn the_replacement_maps_shared_and_writable_and_is_opened_once() {
        let fd = zero_fd().unwrap();
        assert_eq!(zero_fd().unwrap(), fd, "one descriptor per process");
        // SAFETY: a fresh shared mapping of /dev/zero, written and unmapped here only.
        unsafe {
            let len = 2 << 20;
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            let b = p as *mut u8;
            assert_eq!(*b.add(len - 1), 0, "zeroed");
            *b = 7;
            assert_eq!(*b, 7);
            libc::munmap(p, len);
        }
    }
}
