//! Which device files the checkpoint has CRIU's devices plugin take (`dump::devices`), decided before the
//! tree is touched.
//!
//! Descriptors, not mappings: the plugin reopens a device node at the same descriptor number, which is all a
//! process that never mapped the device had of it. A process that maps the device is refused (nothing is
//! touched): its mapping's contents would not come back.

use std::path::{Path, PathBuf};

use super::Error;
use crate::detect::{FindingKind, Report};
use crate::dump::devices::is_nvidia_node;
use crate::freeze::has_cuda_context;

/// The nodes the plugin is to take besides NVIDIA's, or `None` when the tree needs no plugin: it holds no
/// NVIDIA node outside a CUDA context and the user named no device (`--reopen-device`).
pub(super) fn plan(
    pid: i32,
    report: &Report,
    given: &[PathBuf],
    proc_root: &Path,
) -> Result<Option<Vec<PathBuf>>, Error> {
    let mut needed = !given.is_empty();
    for p in report.processes.iter().filter(|p| !p.simulated) {
        if has_cuda_context(report, p.pid) {
            // Its device files are the GPU step's (the CUDA driver's checkpoint) business.
            continue;
        }
        let nvidia = |kinds: &[FindingKind]| {
            report.findings_of(p.pid).find_map(|f| {
                let path = f.evidence.path.as_deref()?;
                (kinds.contains(&f.kind) && is_nvidia_node(path)).then(|| path.to_string())
            })
        };
        if nvidia(&[FindingKind::NvidiaCtl, FindingKind::NvidiaDevice]).is_none() {
            continue;
        }
        if let Some(path) = nvidia(&[FindingKind::DeviceMapping]) {
            return Err(mapped(pid, p.pid, &path));
        }
        needed = true;
    }
    for p in &report.processes {
        let maps = proc_root.join(p.pid.to_string()).join("maps");
        // A process gone meanwhile is CRIU's to report; a captured tree may lack its maps.
        let Ok(text) = std::fs::read_to_string(&maps) else {
            continue;
        };
        if let Some(path) = given.iter().find(|g| maps_file(&text, g)) {
            return Err(mapped(pid, p.pid, &path.display().to_string()));
        }
    }
    Ok(needed.then(|| given.to_vec()))
}

fn mapped(pid: i32, process: i32, path: &str) -> Error {
    Error::DeviceMapped {
        pid,
        process,
        path: path.to_string(),
    }
}

/// Whether a `/proc/PID/maps` text maps `path` (the pathname is the sixth field, to the end of the line).
fn maps_file(maps: &str, path: &Path) -> bool {
    let Some(path) = path.to_str() else {
        return false;
    };
    maps.lines().any(|l| {
        l.splitn(6, ' ')
            .nth(5)
            .is_some_and(|name| name.trim_start() == path)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_name_the_device() {
        let maps = "7f00-7f01 rw-s 00000000 00:06 90    /dev/fuse\n\
                    7f02-7f03 r--p 00000000 08:01 12   /usr/lib/libc.so.6\n";
        assert!(maps_file(maps, Path::new("/dev/fuse")));
        assert!(!maps_file(maps, Path::new("/dev/fus")));
        assert!(!maps_file(maps, Path::new("/dev/nvidiactl")));
    }
}
