//! Which device files the checkpoint has CRIU's devices plugin take (`dump::devices`), decided before the
//! tree is touched.
//!
//! Descriptors: the plugin reopens a device node at the same descriptor number, which is all a process that
//! never mapped the device had of it. Mappings: those a child forked without exec keeps of its CUDA
//! parent's `/dev/nvidiaN` and `/dev/nvidia-uvm` (it cannot use them: the context is the parent's) are
//! replaced by zeroed shared memory at the same addresses on restore; any other mapping of a device the
//! plugin would take is refused (nothing is touched): its contents would not come back.

use std::path::{Path, PathBuf};

use super::Error;
use crate::detect::context::contextless_mappings;
use crate::detect::InheritedMapping;
use crate::detect::{FindingKind, Report};
use crate::dump::devices::is_nvidia_node;
use crate::freeze::has_cuda_context;

/// What the plugin is to do in a dump.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// The nodes it takes besides NVIDIA's (`--reopen-device`).
    pub allow: Vec<PathBuf>,
    /// The inherited NVIDIA mappings it lets CRIU record, to be replaced on restore.
    pub replaced: Vec<InheritedMapping>,
}

/// The plugin's work, or `None` when the tree needs no plugin: it holds no NVIDIA node outside a CUDA
/// context and the user named no device (`--reopen-device`).
pub(super) fn plan(
    pid: i32,
    report: &Report,
    given: &[PathBuf],
    proc_root: &Path,
) -> Result<Option<Plan>, Error> {
    let mut needed = !given.is_empty();
    let replaced = report.inherited_mappings();
    for p in report.processes.iter().filter(|p| !p.simulated) {
        if has_cuda_context(report, p.pid) {
            // Its device files are the GPU step's (the CUDA driver's checkpoint) business.
            continue;
        }
        let held = |kinds: &[FindingKind]| {
            report.findings_of(p.pid).any(|f| {
                kinds.contains(&f.kind) && f.evidence.path.as_deref().is_some_and(is_nvidia_node)
            })
        };
        let maps = contextless_mappings(report.findings_of(p.pid));
        if let Some(f) = maps.control.first() {
            // detect blocks this (`device-mapping`); kept so that no plan ever lets it through.
            return Err(mapped(
                pid,
                p.pid,
                f.evidence.path.as_deref().unwrap_or("?"),
            ));
        }
        needed |= !maps.inherited.is_empty()
            || held(&[
                FindingKind::NvidiaCtl,
                FindingKind::NvidiaDevice,
                FindingKind::NvidiaUvm,
                FindingKind::Mig,
            ]);
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
    Ok(needed.then(|| Plan {
        allow: given.to_vec(),
        replaced,
    }))
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
        // pid 1: a CUDA process (context: /dev/nvidiactl mapped many times); pid 2: an NVML client
        // holding the descriptors and no mapping.
        let r = report(
            &[1, 2],
            vec![
                finding("nvidia-ctl", 1, "/dev/nvidiactl", None),
                finding("device-mapping", 1, "/dev/nvidiactl", Some(27)),
                finding("nvidia-ctl", 2, "/dev/nvidiactl", None),
                finding("nvidia-device", 2, "/dev/nvidia0", None),
            ],
        );
        assert_eq!(
            plan(1, &r, &[], proc_root.path()).unwrap(),
            Some(Plan::default())
        );
        // The CUDA process alone needs nothing: its files are the GPU step's.
        let r = report(
            &[1],
            vec![
                finding("nvidia-ctl", 1, "/dev/nvidiactl", None),
                finding("device-mapping", 1, "/dev/nvidiactl", Some(27)),
            ],
        );
        assert_eq!(plan(1, &r, &[], proc_root.path()).unwrap(), None);
        // A device given by the user always takes the plugin.
        let given = vec![PathBuf::from("/dev/fuse")];
        assert_eq!(
            plan(1, &r, &given, proc_root.path())
                .unwrap()
                .unwrap()
                .allow,
            given
        );
    }

    #[test]
    fn a_forked_childs_inherited_mappings_are_replaced() {
        // The hardware's fork-without-exec child: the parent's descriptors and two /dev/nvidia0
        // windows, no /dev/nvidiactl mapping.
        let proc_root = no_proc();
        let mut child = finding("device-mapping", 2, "/dev/nvidia0", Some(2));
        child["evidence"]["ranges"] =
            json!(["0x200600000-0x200800000", "0x7f1e00000000-0x7f1e00010000"]);
        let r = report(
            &[1, 2],
            vec![
                finding("device-mapping", 1, "/dev/nvidiactl", Some(27)),
                finding("nvidia-ctl", 2, "/dev/nvidiactl", None),
                finding("nvidia-uvm", 2, "/dev/nvidia-uvm", None),
                child,
            ],
        );
        let p = plan(1, &r, &[], proc_root.path()).unwrap().unwrap();
        assert_eq!(
            p.replaced,
            [InheritedMapping {
                pid: 2,
                path: "/dev/nvidia0".into(),
                ranges: vec![
                    "0x200600000-0x200800000".into(),
                    "0x7f1e00000000-0x7f1e00010000".into()
                ],
            }]
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
