//! Stage 1: read /proc (maps, fds, environ, threads, cgroups) and NVML; classify GPU state; decide a
//! strategy, or refuse with blockers and remedies.
//!
//! - [`source`]: the /proc root (live or a captured tree, one code path)
//! - [`parse`]: parsers for maps, stat, status, environ, cgroup, net/unix, the driver version
//! - [`process`]: reading one process into a [`process::ProcessSnapshot`]
//! - [`paths`]: what a path names (device files, shared segments, GPU libraries)
//! - [`classify`]: classifying a snapshot into [`Finding`]s
//! - [`context`]: whether a process holding NVIDIA device files has a CUDA context
//! - [`needs`]: what CRIU will need an option for (locks, deleted files, TCP, external UNIX sockets)
//! - [`limits`]: what CRIU cannot dump at all (io_uring, the host's SysV memory, another user's process
//!   without `CAP_SYS_RESOURCE`, inherited terminals, PID namespaces), or only as a shell job
//! - [`unix_diag`]: which UNIX socket is connected to which (the live kernel's `NETLINK_SOCK_DIAG`)
//! - [`finding`]: the [`Finding`]s, their kinds and evidence
//! - [`strategy`]: deciding a [`StrategyName`] per process and for the scope, with [`Blocker`]s
//! - [`nvml`]: NVML behind the [`nvml::GpuInventory`] trait
//! - [`report`]: the [`Report`] printed as JSON and embedded in checkpoint manifests
//!
//! See `docs/detect.md` for the user-facing description and the measured latency.

pub mod choice;
pub mod classify;
mod connections;
pub mod context;
mod error;
pub mod finding;
pub mod limits;
pub mod needs;
pub mod nvml;
pub mod parse;
pub mod paths;
pub mod process;
pub mod report;
mod scan;
pub mod source;
pub mod strategy;
pub mod unix_diag;

use std::path::PathBuf;

pub use choice::StrategyChoice;
pub use error::Error;
pub use finding::{Evidence, Finding, FindingKind, Limit, NeededOption};
pub use report::{Considered, InheritedMapping, ProcessReport, Report, SCHEMA_VERSION};
pub use strategy::{Blocker, BlockerKind, StrategyDecision, StrategyName};

use nvml::GpuInventory;

/// What to look at and how.
#[derive(Clone, Debug)]
pub struct DetectOptions {
    /// The /proc tree to read: the live `/proc` (default) or a captured tree.
    pub proc_root: PathBuf,
    /// Include every descendant of the process (checkpoints act on trees).
    pub tree: bool,
    /// Ask NVML too. Only used on the live `/proc`; NVML's absence is a note, not an error.
    pub nvml: bool,
    /// Recognise the GPU simulator's devices. Tests and demos only: off by default, and never implied.
    pub simulator: bool,
}

impl Default for DetectOptions {
    fn default() -> Self {
        DetectOptions {
            proc_root: PathBuf::from("/proc"),
            tree: false,
            nvml: false,
            simulator: false,
        }
    }
}

/// Detects the GPU state of one process (and its descendants with `opts.tree`).
///
/// Errors: the process does not exist or is a kernel thread or a thread id, its files are unreadable,
/// or `proc_root` is not a /proc tree. Descendants that exit during the scan are left out silently.
pub fn detect_pid(pid: i32, opts: &DetectOptions) -> Result<Report, Error> {
    let (inventory, note) = load_inventory(opts);
    let mut report = detect_pid_with(pid, opts, inventory.as_deref())?;
    report.notes.splice(0..0, note);
    Ok(report)
}

/// Detects every process on the node that holds GPU state: NVML's compute processes (live /proc only)
/// and every process whose fds or maps name a GPU device.
pub fn detect_all(opts: &DetectOptions) -> Result<Report, Error> {
    let (inventory, note) = load_inventory(opts);
    let mut report = detect_all_with(opts, inventory.as_deref())?;
    report.notes.splice(0..0, note);
    Ok(report)
}

pub use scan::{detect_all_with, detect_pid_with};

/// Loads NVML when asked and when reading the live /proc (a captured tree's processes are not this
/// machine's). Its absence is normal: a note, not an error.
fn load_inventory(opts: &DetectOptions) -> (Option<Box<dyn GpuInventory>>, Option<String>) {
    if !opts.nvml {
        return (None, None);
    }
    if opts.proc_root != std::path::Path::new("/proc") {
        return (
            None,
            Some("NVML not asked: --proc-root is not this machine's /proc".into()),
        );
    }
    match nvml::NvmlInventory::load() {
        Ok(n) => (Some(Box::new(n)), None),
        Err(note) => (None, Some(note)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strum::VariantArray;

    /// The names users script against: strum's (as_str and Display, from one attribute) are serde's.
    #[test]
    fn names_are_the_json_names() {
        for k in FindingKind::VARIANTS {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
        }
        for s in StrategyName::VARIANTS {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
        for b in BlockerKind::VARIANTS {
            assert_eq!(serde_json::to_value(b).unwrap(), b.as_str());
        }
        for l in Limit::VARIANTS {
            assert_eq!(serde_json::to_value(l).unwrap(), <&str>::from(l));
        }
        assert_eq!(Limit::IoUring.to_string(), "io-uring");
        assert_eq!(FindingKind::NvidiaCtl.as_str(), "nvidia-ctl");
        assert_eq!(FindingKind::PciBar.to_string(), "pci-bar");
        assert_eq!(StrategyName::CudaDriver.as_str(), "cuda-driver");
        assert_eq!(BlockerKind::DriverTooOld.to_string(), "driver-too-old");
    }
}
