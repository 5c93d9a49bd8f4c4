//! Refusals made before the tree is touched, from detect's findings: what CRIU dumps only with an option the
//! user did not give, and what it cannot dump at all. CRIU itself would find either only after freezing
//! the tree.

use super::Error;
use crate::detect::{self, FindingKind, NeededOption, Report};
use crate::dump::CriuOptions;

/// Refuses, before anything is touched, a tree holding what CRIU dumps only with an option the user did
/// not pass (detect's `needs-option` findings), on the command line or in CRIU's configuration files: CRIU
/// would otherwise fail after freezing it.
pub(super) fn check_options(pid: i32, report: &Report, criu: &CriuOptions) -> Result<(), Error> {
    let criu = criu.with_config_files();
    let unmet: Vec<(&detect::Finding, &NeededOption)> = report
        .findings
        .iter()
        .filter_map(|f| Some(f).zip(f.evidence.needs.as_ref()))
        .filter(|(_, n)| !criu.provides(n))
        .collect();
    if unmet.is_empty() {
        return Ok(());
    }
    // One --ghost-limit: the largest file's.
    let ghost = unmet
        .iter()
        .filter_map(|(_, n)| match n {
            NeededOption::GhostLimit { bytes } => Some(*bytes),
            _ => None,
        })
        .max();
    let mut flags: Vec<String> = Vec::new();
    for (_, n) in &unmet {
        let flag = match (n, ghost) {
            (NeededOption::GhostLimit { .. }, Some(bytes)) => {
                NeededOption::GhostLimit { bytes }.flag()
            }
            _ => n.flag(),
        };
        if !flags.contains(&flag) {
            flags.push(flag);
        }
    }
    let needs = unmet
        .iter()
        .map(|(f, n)| format!("pid {} needs {}: {}", f.pid, n.flag(), f.evidence.detail))
        .collect();
    Err(Error::NeedsOptions { pid, flags, needs })
}

/// Refuses, before anything is touched, a tree holding what CRIU cannot dump at all (detect's `cannot-dump`
/// findings: io_uring, SysV memory of the host's IPC namespace, another user's process without
/// `CAP_SYS_RESOURCE`, an inherited terminal, a PID namespace CRIU cannot take), each with its remedy.
pub(super) fn check_limits(pid: i32, report: &Report) -> Result<(), Error> {
    let limits: Vec<String> = report
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::CannotDump)
        .map(|f| {
            format!(
                "pid {} ({}): {}\n    remedy: {}",
                f.pid,
                f.evidence.limit.map_or("?", <&str>::from),
                f.evidence.detail,
                f.evidence.remedy.as_deref().unwrap_or("")
            )
        })
        .collect();
    if limits.is_empty() {
        Ok(())
    } else {
        Err(Error::CannotDump { pid, limits })
    }
}
