//! Finding a container's processes from the host and detect's report of them, and whether that report
//! refuses a checkpoint: shared by the container flow and the engines' path (`flows/engine`).

use super::{members, ContainerRuntime, ContainerState, Error};
use crate::detect::{self, DetectOptions, Report, StrategyName};

/// The container's processes and detect's report of them, for `detect --container` and the checkpoint.
#[derive(Debug, Clone)]
pub struct Discovered {
    pub state: ContainerState,
    pub processes: Vec<crate::flows::runtime::Member>,
    pub report: Report,
}

/// Finds container `id`'s processes and detect's report of its tree (GPU processes by NVML where
/// present, /proc otherwise), keeping only what shares the container's cgroups.
pub fn discover(
    runtime: &dyn ContainerRuntime,
    id: &str,
    opts: &DetectOptions,
) -> crate::Result<Discovered> {
    super::check_container_id(id)?;
    let state = runtime.state(id)?;
    if state.status != "running" || state.pid <= 0 {
        return Err(Error::NotRunning {
            id: id.into(),
            status: state.status,
        }
        .into());
    }
    discover_in(state, opts)
}

/// [`discover`] of a container whose state the caller has (running, or paused by its engine).
pub fn discover_in(state: ContainerState, opts: &DetectOptions) -> crate::Result<Discovered> {
    let id = state.id.as_str();
    let processes = members(state.pid);
    if processes.is_empty() {
        return Err(Error::Processes {
            id: id.into(),
            reason: format!("its init (pid {}) is gone", state.pid),
        }
        .into());
    }
    let mut report = detect::detect_pid(
        state.pid,
        &DetectOptions {
            tree: true,
            ..opts.clone()
        },
    )?;
    // The tree of init could hold a process moved to another cgroup: not the container's.
    report
        .processes
        .retain(|p| processes.iter().any(|m| m.pid == p.pid));
    Ok(Discovered {
        state,
        processes,
        report,
    })
}

/// Why detect's `report` of a container refuses its checkpoint (strategy `unsupported`: each blocker
/// with its process and evidence), `None` when it does not.
pub fn blocked(report: &Report) -> Option<String> {
    if report.strategy.name != StrategyName::Unsupported {
        return None;
    }
    let blockers = report
        .strategy
        .blockers
        .iter()
        .map(|b| format!("\n  - pid {} {}: {}", b.pid, b.kind, b.message))
        .collect::<String>();
    Some(format!("its GPU state cannot be checkpointed:{blockers}"))
}
