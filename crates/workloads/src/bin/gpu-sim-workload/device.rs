//! The simulated device memory: a `MAP_SHARED` mapping of a file in /dev/shm per simulated GPU, replaced
//! by an inaccessible reservation of the same addresses while checkpointed (as CUDA keeps its virtual
//! address reservations), and mapped again at those addresses on restore.
//!
//! A mapping is shared by several threads: every worker writes its own blocks while its kernel runs, and
//! the control thread reads or rewrites all of it while no kernel runs. So the memory is reached through
//! [`DeviceRange`], an address range whose accessors hand out only the part a caller owns, for as long as
//! it owns it; never one `&mut` over the whole device to every thread at once.

use std::ffi::CString;
use std::ops::Range;

use crate::protocol::{INVALID_VALUE, OPERATING_SYSTEM, OUT_OF_MEMORY};

/// Where the device files live.
pub const SHM_DIR: &str = "/dev/shm/gpu-checkpoint-sim";
/// UUID prefix of simulated GPUs (the library's `sim_gpu_uuid`): "Qmgp".
pub const UUID_PREFIX: &str = "GPU-516d6770-";

/// One simulated device.
pub struct Device {
    pub range: DeviceRange,
    pub path: String,
    pub uuid: String,
    /// The host copy while CHECKPOINTED (ordinary anonymous process memory).
    pub host: Option<Vec<u64>>,
}

/// The addresses of one device's memory. Copied freely (to the workers too); reaching the memory through
/// it is `unsafe`, and each caller states why no other thread touches the words it takes meanwhile.
#[derive(Clone, Copy)]
pub struct DeviceRange {
    addr: *mut u64,
    bytes: usize,
}

// SAFETY: only an address travels; every access through it is an unsafe method whose caller guarantees
// exclusive (or read-only shared) use of the words it reaches.
unsafe impl Send for DeviceRange {}

impl DeviceRange {
    pub fn bytes(self) -> usize {
        self.bytes
    }

    fn words(self) -> usize {
        self.bytes / 8
    }

    /// Words `range` of the device for writing, cut to the device's end (a range past it gives an empty
    /// slice).
    ///
    /// # Safety
    /// The range is mapped, and no other thread reads or writes these words while the slice lives.
    pub unsafe fn words_mut<'a>(self, range: Range<usize>) -> &'a mut [u64] {
        let end = range.end.min(self.words());
        let start = range.start.min(end);
        // SAFETY: inside the mapping (cut above); exclusive by the caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.addr.add(start), end - start) }
    }

    /// The whole device for writing.
    ///
    /// # Safety
    /// As [`DeviceRange::words_mut`], for every word: no kernel runs and nothing else reads it.
    pub unsafe fn all_mut<'a>(self) -> &'a mut [u64] {
        // SAFETY: the caller's guarantee.
        unsafe { self.words_mut(0..self.words()) }
    }

    /// The whole device for reading.
    ///
    /// # Safety
    /// The device is mapped and no thread writes it while the slice lives (no kernel in flight).
    pub unsafe fn all<'a>(self) -> &'a [u64] {
        // SAFETY: a live mapping of `bytes` bytes; read-only by the caller's guarantee.
        unsafe { std::slice::from_raw_parts(self.addr, self.words()) }
    }
}

fn last_os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

/// Creates the device file and maps it at `at`'s addresses (or anywhere when `None`). Errors carry the
/// CUresult the driver would answer.
pub fn map_device(
    path: &str,
    bytes: usize,
    at: Option<DeviceRange>,
) -> Result<DeviceRange, (i32, String)> {
    let _ = std::fs::remove_file(path);
    // A restore into another container finds its own, empty /dev/shm: the "device" is there again, as
    // a real GPU's device nodes are in a container given the GPU.
    if let Some(dir) = std::path::Path::new(path).parent() {
        if let Err(e) = std::fs::create_dir_all(dir) {
            return Err((OPERATING_SYSTEM, format!("creating {}: {e}", dir.display())));
        }
    }
    let c = CString::new(path).map_err(|e| (INVALID_VALUE, e.to_string()))?;
    let at = at.map_or(std::ptr::null_mut(), |r| r.addr);
    // SAFETY: plain syscalls on a path we own; every result is checked. MAP_FIXED only over a range of
    // our own (the reservation `release_device` left).
    unsafe {
        let fd = libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
            0o600,
        );
        if fd < 0 {
            return Err((
                OPERATING_SYSTEM,
                format!("open {path}: {}", last_os_error()),
            ));
        }
        // Allocate every page now: running out of "device memory" must be an error here, not a
        // SIGBUS on first touch.
        let r = libc::posix_fallocate(fd, 0, bytes as libc::off_t);
        if r != 0 {
            libc::close(fd);
            libc::unlink(c.as_ptr());
            let code = if r == libc::ENOSPC {
                OUT_OF_MEMORY
            } else {
                OPERATING_SYSTEM
            };
            return Err((
                code,
                format!(
                    "allocating {bytes} bytes of simulated device memory: {}",
                    std::io::Error::from_raw_os_error(r)
                ),
            ));
        }
        let flags = libc::MAP_SHARED | if at.is_null() { 0 } else { libc::MAP_FIXED };
        let p = libc::mmap(
            at.cast(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        );
        let e = last_os_error();
        libc::close(fd);
        if p == libc::MAP_FAILED {
            libc::unlink(c.as_ptr());
            return Err((OPERATING_SYSTEM, format!("mmap {path}: {e}")));
        }
        Ok(DeviceRange {
            addr: p.cast(),
            bytes,
        })
    }
}

/// Replaces a device mapping by an inaccessible anonymous reservation of the same range, so that the
/// addresses stay ours (as CUDA keeps its virtual address reservations) and CRIU sees no device file.
pub fn release_device(range: DeviceRange) -> Result<(), String> {
    // SAFETY: MAP_FIXED over our own mapping of exactly this range.
    let p = unsafe {
        libc::mmap(
            range.addr.cast(),
            range.bytes,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("reserving the device range: {}", last_os_error()));
    }
    Ok(())
}

/// A short BLAKE3 of device words (the same bytes the device file holds), for `STATUS`.
pub fn checksum(ws: &[u64]) -> String {
    // SAFETY: viewing initialised u64s as bytes.
    let bytes = unsafe { std::slice::from_raw_parts(ws.as_ptr().cast::<u8>(), ws.len() * 8) };
    blake3::hash(bytes).to_hex()[..16].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_maps_releases_and_maps_again_at_the_same_addresses() {
        let dir = std::env::temp_dir().join(format!("sim-dev-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dev0").to_string_lossy().into_owned();
        let r = map_device(&path, 1 << 16, None).unwrap();
        // SAFETY: this test's own mapping, one thread.
        unsafe { r.all_mut() }.fill(7);
        // SAFETY: as above; ranges past the end come back cut.
        assert_eq!(unsafe { r.words_mut(8190..9000) }.len(), 2);
        assert!(unsafe { r.words_mut(9000..9512) }.is_empty());
        release_device(r).unwrap();
        let again = map_device(&path, 1 << 16, Some(r)).unwrap();
        assert_eq!(again.addr, r.addr);
        // SAFETY: as above; a fresh file reads zeros.
        assert!(unsafe { again.all() }.iter().all(|w| *w == 0));
        release_device(again).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
