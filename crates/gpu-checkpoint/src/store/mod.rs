//! Stage 4: the checkpoint store: chunked, compressed, content-addressed, verified images.

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
