//! The records gpu-checkpoint and its CRIU plugin (`crates/criu-devices`, `libgpu_checkpoint_devices.so`)
//! exchange about device files CRIU cannot dump, and which device nodes the plugin takes.
//!
//! While dumping, the plugin appends one [`ReopenedDevice`] line ([`ReopenedDevice::line`]) per open file it
//! takes to the record file named by [`ENV_RECORD`]; the tool reads them back ([`parse_records`]) into the
//! checkpoint's manifest (serde). On restore the tool writes the manifest's records into a new record file,
//! and the plugin reopens each one CRIU asks for by id. Which nodes the plugin takes: [`is_taken`] (NVIDIA's
//! and those named in [`ENV_ALLOW`]).
//!
//! The record file lives only for one CRIU run, between a tool and the plugin beside it; the manifest's
//! copy is the lasting one (serde: a new field needs `#[serde(default)]` to read older manifests).
//! `gpu_checkpoint::dump::devices` holds the tool's side (the plugin's private folder, its environment).

use serde::{Deserialize, Serialize};

/// The plugin's record file: appended to while dumping, read while restoring.
pub const ENV_RECORD: &str = "GPU_CHECKPOINT_DEVICES_RECORD";
/// Device nodes the plugin takes besides NVIDIA's, separated by `:`.
pub const ENV_ALLOW: &str = "GPU_CHECKPOINT_DEVICES_ALLOW";
/// Set (to `1`) when the plugin is to let CRIU record inherited NVIDIA mappings and replace them on restore.
pub const ENV_REPLACE: &str = "GPU_CHECKPOINT_DEVICES_REPLACE_MAPPINGS";

/// One open file of a device node, as the plugin saw it while dumping: the manifest's `devices` entries.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ReopenedDevice {
    /// CRIU's id of the open file (shared by every descriptor and process holding it).
    pub id: u32,
    /// The device node (`/dev/nvidiactl`).
    pub path: String,
    /// The file's status flags (`fcntl(F_GETFL)`): access mode, `O_NONBLOCK`, ...
    pub flags: i32,
    /// The node's device number (`st_rdev`), checked again before it is reopened.
    pub rdev: u64,
}

impl ReopenedDevice {
    /// The record file's line: `id flags rdev path` (decimal; the path last, it may hold spaces).
    pub fn line(&self) -> String {
        format!("{} {} {} {}\n", self.id, self.flags, self.rdev, self.path)
    }

    /// The flags to reopen with: the access mode and the status flags that make sense for a device;
    /// never `O_CREAT`, `O_TRUNC` or `O_EXCL`.
    pub fn open_flags(&self) -> i32 {
        let keep =
            libc::O_ACCMODE | libc::O_NONBLOCK | libc::O_APPEND | libc::O_SYNC | libc::O_DSYNC;
        (self.flags & keep) | libc::O_NOCTTY
    }
}

/// Reads a record file's lines.
pub fn parse_records(text: &str) -> Result<Vec<ReopenedDevice>, String> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let bad = || {
            format!(
                "line {}: expected `id flags rdev path`, got {line:?}",
                n + 1
            )
        };
        let mut parts = line.splitn(4, ' ');
        let mut field = || parts.next().ok_or_else(bad);
        let id = field()?.parse().map_err(|_| bad())?;
        let flags = field()?.parse().map_err(|_| bad())?;
        let rdev = field()?.parse().map_err(|_| bad())?;
        let path = field()?;
        if !path.starts_with('/') {
            return Err(bad());
        }
        out.push(ReopenedDevice {
            id,
            path: path.to_string(),
            flags,
            rdev,
        });
    }
    Ok(out)
}

/// The NVIDIA device nodes the plugin always takes: `/dev/nvidiactl`, `/dev/nvidiaN`, `/dev/nvidia-modeset`,
/// `/dev/nvidia-uvm(-tools)` and `/dev/nvidia-caps/nvidia-capN`: every node an NVML client or a forked
/// child holds. Processes with a CUDA context hold none of them once the GPU step has checkpointed them,
/// so whatever CRIU meets belongs to a process without one (NVML opens the UVM node without using it;
/// MIG instances, whose capabilities are `nvidia-capN` too, are refused by detect).
pub fn is_nvidia_node(path: &str) -> bool {
    let number = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    if let Some(cap) = path.strip_prefix("/dev/nvidia-caps/nvidia-cap") {
        return number(cap);
    }
    match path.strip_prefix("/dev/nvidia") {
        Some("ctl" | "-modeset" | "-uvm" | "-uvm-tools") => true,
        Some(n) => number(n),
        None => false,
    }
}

/// `/dev/nvidiaN` and `/dev/nvidia-uvm`: the nodes whose mappings a child forked without exec keeps of its
/// CUDA parent, which the plugin replaces with zeroed shared memory ([`ENV_REPLACE`]).
pub fn is_replaceable_node(path: &str) -> bool {
    match path.strip_prefix("/dev/nvidia") {
        Some("-uvm") => true,
        Some(n) => !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()),
        None => false,
    }
}

/// Whether the plugin takes `path`, given [`ENV_ALLOW`]'s value.
pub fn is_taken(path: &str, allow: Option<&str>) -> bool {
    is_nvidia_node(path) || allow.is_some_and(|a| a.split(':').any(|p| !p.is_empty() && p == path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip() {
        let d = [
            ReopenedDevice {
                id: 7,
                path: "/dev/nvidiactl".into(),
                flags: libc::O_RDWR | libc::O_NONBLOCK,
                rdev: (195 << 8) | 255,
            },
            ReopenedDevice {
                id: 12,
                path: "/dev/odd name".into(),
                flags: libc::O_RDONLY,
                rdev: 1,
            },
        ];
        let text: String = d.iter().map(ReopenedDevice::line).collect();
        assert_eq!(parse_records(&text).unwrap(), d);
        assert_eq!(parse_records("").unwrap(), vec![]);
        for bad in ["7 2 3", "x 2 3 /dev/a", "7 2 3 dev/a", "7 2 -3 /dev/a"] {
            assert!(parse_records(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reopen_flags_never_create() {
        let d = ReopenedDevice {
            id: 1,
            path: "/dev/fuse".into(),
            flags: libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_EXCL | libc::O_NONBLOCK,
            rdev: 0,
        };
        assert_eq!(
            d.open_flags(),
            libc::O_RDWR | libc::O_NONBLOCK | libc::O_NOCTTY
        );
    }

    #[test]
    fn which_nodes_are_taken() {
        for p in [
            "/dev/nvidiactl",
            "/dev/nvidia0",
            "/dev/nvidia12",
            "/dev/nvidia-modeset",
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia-caps/nvidia-cap1",
        ] {
            assert!(is_taken(p, None), "{p}");
        }
        for p in [
            "/dev/nvidia",
            "/dev/nvidia0x",
            "/dev/fuse",
            "/dev/nvidia-caps/x",
            "/dev/nvidia-caps/nvidia-cap",
        ] {
            assert!(!is_taken(p, None), "{p}");
        }
        assert!(is_taken("/dev/fuse", Some("/dev/a:/dev/fuse")));
        assert!(!is_taken("/dev/fus", Some("/dev/fuse")));
        assert!(!is_taken("", Some("")));
    }
}
