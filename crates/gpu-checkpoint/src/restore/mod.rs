//! Stage 5: the restore flow: fetch + verify, CRIU restore, GPU restore (optionally onto other GPUs) + unlock.

use crate::error::ExitStatus;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Other(String),
}

impl Error {
    pub fn exit_status(&self) -> ExitStatus {
        ExitStatus::Failure
    }
}
