//! Stage 2: freeze GPU state: lock -> checkpoint -> (CPU dump) -> restore -> unlock, through the CUDA driver API, the cuda-checkpoint binary, or the simulator (tests and demos only).

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
