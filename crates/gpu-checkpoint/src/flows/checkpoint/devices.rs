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
    for p in report.processes.iter().filter(|_| !given.is_empty()) {
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
    use serde_json::{json, Value};

    fn finding(kind: &str, pid: i32, path: &str, mappings: Option<u32>) -> Value {
        json!({"kind": kind, "pid": pid,
               "evidence": {"detail": "x", "path": path, "mappings": mappings}})
    }

    fn report(pids: &[i32], findings: Vec<Value>) -> Report {
        let processes: Vec<Value> = pids
            .iter()
            .map(|pid| json!({"pid": pid, "comm": "x", "ppid": 1, "strategy": "cuda-driver", "simulated": false}))
            .collect();
        serde_json::from_value(json!({
            "schema_version": 1, "pid": pids[0], "gpu": true, "processes": processes,
            "findings": findings, "strategy": {"name": "cuda-driver", "blockers": []},
            "driver_version": null, "elapsed_ms": 0.0
        }))
        .unwrap()
    }

    /// A /proc root with no process folders: only the report counts.
    fn no_proc() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn nvidia_nodes_without_a_context_need_the_plugin() {
        let proc_root = no_proc();
        // pid 1: a CUDA process (context: /dev/nvidia0 mapped); pid 2: a child forked without exec,
        // holding the descriptors and no mapping (CUDA marks its mappings do-not-fork).
        let r = report(
            &[1, 2],
            vec![
                finding("nvidia-ctl", 1, "/dev/nvidiactl", None),
                finding("device-mapping", 1, "/dev/nvidia0", Some(3)),
                finding("nvidia-ctl", 2, "/dev/nvidiactl", None),
                finding("nvidia-device", 2, "/dev/nvidia0", None),
            ],
        );
        assert_eq!(plan(1, &r, &[], proc_root.path()).unwrap(), Some(vec![]));
        // The CUDA process alone needs nothing: its files are the GPU step's.
        let r = report(
            &[1],
            vec![
                finding("nvidia-ctl", 1, "/dev/nvidiactl", None),
                finding("device-mapping", 1, "/dev/nvidia0", Some(3)),
            ],
        );
        assert_eq!(plan(1, &r, &[], proc_root.path()).unwrap(), None);
        // A device given by the user always takes the plugin.
        let given = vec![PathBuf::from("/dev/fuse")];
        assert_eq!(
            plan(1, &r, &given, proc_root.path()).unwrap(),
            Some(given.clone())
        );
    }

    #[test]
    fn a_mapping_that_remains_is_refused() {
        let proc_root = no_proc();
        // NVML-only (nvidia-smi): one page of /dev/nvidiactl mapped, no context.
        let r = report(
            &[5],
            vec![
                finding("nvidia-ctl", 5, "/dev/nvidiactl", None),
                finding("device-mapping", 5, "/dev/nvidiactl", Some(1)),
            ],
        );
        let e = plan(5, &r, &[], proc_root.path()).unwrap_err();
        assert!(
            matches!(&e, Error::DeviceMapped { process: 5, path, .. } if path == "/dev/nvidiactl"),
            "{e}"
        );
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::exit::ExitStatus::Unsupported
        );
        // A device named by the user and mapped by a process of the tree.
        std::fs::create_dir(proc_root.path().join("5")).unwrap();
        std::fs::write(
            proc_root.path().join("5/maps"),
            "7f00-7f01 rw-s 00000000 00:06 90    /dev/fuse\n",
        )
        .unwrap();
        let r = report(&[5], vec![]);
        let e = plan(5, &r, &[PathBuf::from("/dev/fuse")], proc_root.path()).unwrap_err();
        assert!(e.to_string().contains("maps /dev/fuse"), "{e}");
    }

    #[test]
    fn maps_name_the_device() {
        let maps = "7f00-7f01 rw-s 00000000 00:06 90    /dev/fuse\n\
                    7f02-7f03 r--p 00000000 08:01 12   /usr/lib/libc.so.6\n";
        assert!(maps_file(maps, Path::new("/dev/fuse")));
        assert!(!maps_file(maps, Path::new("/dev/fus")));
        assert!(!maps_file(maps, Path::new("/dev/nvidiactl")));
    }
}
