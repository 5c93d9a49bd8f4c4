//! Why a member's part of a job operation failed, with its exit class, which travels with the
//! member's `failed` state through etcd (`exit`) so that the coordinator's command exits as a
//! single-node command would have (3 no such process, 4 not permitted, 6 storage, ...).

use crate::exit::{Classify, ExitStatus};

#[derive(Debug, thiserror::Error)]
pub enum MemberError {
    /// A stage or single-node flow failed (its own class).
    #[error(transparent)]
    Flow(#[from] crate::Error),
    /// The node does not allow what the task asks: a member its agent did not register, a
    /// checkpoint that is not one of the job's member checkpoints, a quiesce hook it was not given.
    #[error("{0}")]
    Refused(String),
    #[error("no process {0} on this node")]
    NoSuchProcess(i32),
    /// A task record that cannot be carried out as it is (a missing field, a bad value).
    #[error("{0}")]
    BadTask(String),
    /// The node's quiesce hook failed: the application did not reach its boundary.
    #[error("{0}")]
    Quiesce(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// A member's failure as its agent reported it in etcd: its message and exit class.
    #[error("{message}")]
    Reported { message: String, exit: ExitStatus },
}

impl MemberError {
    pub fn io(what: String, source: std::io::Error) -> Self {
        MemberError::Io { what, source }
    }
}

impl Classify for MemberError {
    fn exit_status(&self) -> ExitStatus {
        match self {
            MemberError::Flow(e) => e.exit_status(),
            MemberError::Refused(_) => ExitStatus::PermissionDenied,
            MemberError::NoSuchProcess(_) => ExitStatus::NoSuchProcess,
            MemberError::BadTask(_) => ExitStatus::Usage,
            MemberError::Quiesce(_) => ExitStatus::Failure,
            MemberError::Io { source, .. } => crate::exit::io_exit_status(source),
            MemberError::Reported { exit, .. } => *exit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_members_failure_keeps_its_exit_class() {
        let gone = crate::Error::from(crate::store::Error::Conflict("busy".into()));
        assert_eq!(MemberError::from(gone).exit_status(), ExitStatus::Conflict);
        assert_eq!(
            MemberError::Refused("not registered".into()).exit_status(),
            ExitStatus::PermissionDenied
        );
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(
            MemberError::io("writing".into(), full).exit_status(),
            ExitStatus::Storage
        );
        let code = ExitStatus::NoSuchProcess as i32;
        let back = MemberError::Reported {
            message: "x".into(),
            exit: ExitStatus::from_code(code).unwrap(),
        };
        assert_eq!(back.exit_status(), ExitStatus::NoSuchProcess);
    }
}
