//! Stage 3: dump and restore the CPU side of a process tree with CRIU (>= 4.0) over its RPC.

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
