//! Reading CRIU's log: its `Error (file:line): ...` lines are what a user needs to see when CRIU fails,
//! since the RPC answer itself carries only an errno.

use std::path::Path;

use super::{Failure, FailureKind, Op};

/// How many error lines a failure shows; CRIU often logs a cascade, the last lines say the most.
const MAX_LINES: usize = 8;

/// Error lines CRIU logs and then carries on regardless; showing them would point users the wrong way.
const BENIGN: &[&str] = &[
    // CRIU tries to raise its own descriptor limit to fs.nr_open and continues with the old one when a
    // sandbox refuses (seen on Firecracker VMs).
    "rlimit: Can't setup RLIMIT_NOFILE for self",
];

/// The `Error (...)` lines of a CRIU log text (the last `MAX_LINES` of them), without timestamps.
pub fn error_lines(log: &str) -> Vec<String> {
    let mut lines: Vec<String> = log
        .lines()
        .filter_map(|l| l.find("Error (").map(|i| l[i..].trim_end().to_string()))
        .filter(|l| !BENIGN.iter().any(|b| l.contains(b)))
        .collect();
    if lines.len() > MAX_LINES {
        lines.drain(..lines.len() - MAX_LINES);
    }
    lines
}

/// The error lines of the log file at `path`; empty when it cannot be read (CRIU may have died before
/// opening it). The log is read lossily: CRIU logs file names, which need not be UTF-8.
pub fn log_error_lines(path: &Path) -> Vec<String> {
    std::fs::read(path)
        .map(|b| error_lines(&String::from_utf8_lossy(&b)))
        .unwrap_or_default()
}

/// Builds the failure of `op` from CRIU's errno, message and log, classifying it for the exit code.
pub(crate) fn failure(
    op: Op,
    errno: Option<i32>,
    message: Option<String>,
    log: Option<&Path>,
) -> Failure {
    let error_lines = log.map(log_error_lines).unwrap_or_default();
    let kind = classify(op, errno, &error_lines);
    Failure {
        op,
        errno,
        message,
        error_lines,
        log: log.map(Path::to_path_buf),
        kind,
    }
}

fn classify(op: Op, errno: Option<i32>, lines: &[String]) -> FailureKind {
    let said = |needle: &str| lines.iter().any(|l| l.contains(needle));
    if errno == Some(libc::ENOSPC)
        || errno == Some(libc::EDQUOT)
        || said("No space left on device")
        || said("Disk quota exceeded")
    {
        return FailureKind::StorageFull;
    }
    if op == Op::Dump && (errno == Some(libc::ESRCH) || said("No such process")) {
        return FailureKind::NoSuchProcess;
    }
    // CRIU asks the kernel for each PID with clone3(set_tid); a taken PID answers EEXIST.
    if op == Op::Restore && (errno == Some(libc::EEXIST) || said("File exists")) {
        return FailureKind::PidInUse;
    }
    // EPERM shows up in many places in a CRIU log; it means "not permitted" only for a non-root caller.
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root && (errno == Some(libc::EPERM) || said("Operation not permitted")) {
        return FailureKind::PermissionDenied;
    }
    FailureKind::Other
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
(00.000010) Version: 4.1.1 (gitid 0)
(00.001200) Dumping pages (type: 25 pid: 42)
(00.002000) Error (criu/page-xfer.c:123): Unable to write pages: No space left on device
(00.002100) Error (criu/mem.c:456): Can't dump page with parasite
(00.002200) Warn  (criu/x.c:1): not an error
";

    #[test]
    fn picks_error_lines_without_timestamps() {
        let lines = error_lines(LOG);
        assert_eq!(
            lines,
            vec![
                "Error (criu/page-xfer.c:123): Unable to write pages: No space left on device",
                "Error (criu/mem.c:456): Can't dump page with parasite",
            ]
        );
    }

    #[test]
    fn keeps_only_the_last_lines() {
        let log: String = (0..20)
            .map(|i| format!("(00.1) Error (criu/a.c:{i}): e{i}\n"))
            .collect();
        let lines = error_lines(&log);
        assert_eq!(lines.len(), MAX_LINES);
        assert!(lines.last().unwrap().ends_with("e19"));
    }

    #[test]
    fn classifies_disk_full_pid_in_use_and_gone() {
        assert_eq!(
            classify(Op::Dump, None, &error_lines(LOG)),
            FailureKind::StorageFull
        );
        let taken = vec!["Error (criu/cr-restore.c:1): Can't fork for 77: File exists".to_string()];
        assert_eq!(classify(Op::Restore, None, &taken), FailureKind::PidInUse);
        assert_eq!(classify(Op::Dump, None, &taken), FailureKind::Other);
        assert_eq!(
            classify(Op::Dump, Some(libc::ESRCH), &[]),
            FailureKind::NoSuchProcess
        );
    }

    /// Issue 18: CRIU's EBADRQC with no log said only "Invalid request code": the report says what failed.
    #[test]
    fn a_request_criu_could_not_set_up_is_explained() {
        let f = failure(Op::Restore, Some(libc::EBADRQC), None, None);
        let text = f.to_string();
        assert!(text.contains("Invalid request code"), "{text}");
        assert!(text.contains("could not set up the request"), "{text}");
        assert!(text.contains("images folder"), "{text}");
        let logged = Failure {
            error_lines: vec!["Error (criu/x.c:1): something else".into()],
            ..f
        };
        assert!(logged.hint().is_none(), "the log's own lines say why");
    }

    #[test]
    fn missing_log_gives_no_lines() {
        assert!(log_error_lines(Path::new("/nonexistent/criu.log")).is_empty());
    }
}
