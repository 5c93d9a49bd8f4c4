//! The restore's preflight on host memory: the checkpoint's memory pages must fit in what this node has
//! available, or the restored copy would be killed by the OOM killer half-way (with GPU state out, the
//! known stuck-process failure). The GPU side (free device memory per target GPU) is the freeze stage's
//! (`GpuStep::prepare_restore`). And the device nodes CRIU's devices plugin reopens must be here.

use std::os::unix::fs::{FileTypeExt, MetadataExt};

use super::Error;
use crate::dump::devices::ReopenedDevice;

/// Refuses (exit 8) a checkpoint whose reopened device nodes are missing here, or are not the same
/// character devices (device number) as where it was taken.
pub(super) fn check_devices(id: &str, devices: &[ReopenedDevice]) -> Result<(), Error> {
    for d in devices {
        let reason = match std::fs::metadata(&d.path) {
            Err(e) => format!("it cannot be reached ({e})"),
            Ok(m) if !m.file_type().is_char_device() => "it is not a character device".into(),
            Ok(m) if m.rdev() != d.rdev => format!(
                "it is another device (number {}:{}, was {}:{})",
                libc::major(m.rdev()),
                libc::minor(m.rdev()),
                libc::major(d.rdev),
                libc::minor(d.rdev)
            ),
            Ok(_) => continue,
        };
        return Err(Error::Device {
            id: id.to_string(),
            path: d.path.clone(),
            reason,
        });
    }
    Ok(())
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn available(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|l| {
        let kib = l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?;
        kib.trim().parse::<u64>().ok().map(|k| k << 10)
    })
}

/// Refuses (exit 8, with the numbers) a checkpoint whose `need` bytes of memory pages exceed what
/// `meminfo` says is available; passes when the kernel does not say.
pub(super) fn check_host_memory(id: &str, need: u64, meminfo: &str) -> Result<(), Error> {
    match available(meminfo) {
        Some(available) if available < need => Err(Error::NotEnoughMemory {
            id: id.to_string(),
            need,
            available,
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exit::{Classify, ExitStatus};

    #[test]
    fn reopened_devices_must_be_the_same_nodes() {
        let null = |path: &str, rdev: u64| ReopenedDevice {
            id: 1,
            path: path.into(),
            flags: libc::O_RDWR,
            rdev,
        };
        // /dev/null is character device 1:3 everywhere.
        let dev_null = libc::makedev(1, 3);
        assert!(check_devices("c", &[null("/dev/null", dev_null)]).is_ok());
        for (d, why) in [
            (
                null("/dev/null", libc::makedev(10, 229)),
                "another device (number 1:3, was 10:229)",
            ),
            (null("/dev/no-such-node", dev_null), "cannot be reached"),
            (null("/", dev_null), "not a character device"),
        ] {
            let e = check_devices("c", &[d]).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
            assert_eq!(e.exit_status(), ExitStatus::Conflict);
        }
    }

    const MEMINFO: &str =
        "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:    2048 kB\n";

    #[test]
    fn a_checkpoint_larger_than_the_available_memory_is_refused_with_the_numbers() {
        assert_eq!(available(MEMINFO), Some(2 << 20));
        check_host_memory("x", 2 << 20, MEMINFO).unwrap();
        let e = check_host_memory("x", 3 << 20, MEMINFO).unwrap_err();
        assert_eq!(e.exit_status(), ExitStatus::Conflict);
        let text = e.to_string();
        assert!(
            text.contains("3.0 MiB") && text.contains("2.0 MiB"),
            "{text}"
        );
        // A kernel that does not say: nothing to check against.
        check_host_memory("x", u64::MAX, "MemTotal: 1 kB\n").unwrap();
    }
}
