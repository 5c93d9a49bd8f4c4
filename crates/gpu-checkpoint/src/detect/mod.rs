//! Stage 1: read /proc (maps, fds, environ, threads, cgroups) and NVML; classify GPU state; decide a strategy.

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
