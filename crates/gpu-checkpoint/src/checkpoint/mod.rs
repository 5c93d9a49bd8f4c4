//! The checkpoint flow: detect -> plan -> GPU freeze -> CRIU dump -> store, nothing lost on failure.

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
