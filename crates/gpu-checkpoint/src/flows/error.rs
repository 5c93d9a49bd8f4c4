//! The flows' error: what a flow returns, one of the stages' errors it strings together or its own.
//!
//! Each stage and flow has its own error enum (`detect::Error`, `store::Error`, `checkpoint::Error`, ...),
//! each classifying itself into an exit code ([`Classify`], in the leaf module [`crate::exit`]).
//! [`enum@Error`] wraps them for code that strings several together (the flows) and keeps each one's class;
//! it lives with the flows, so that no stage names the layer above it. The binary gets the class where an
//! error enters it, from the `Classify` of whatever type it is (the compiler checks that every one has it).

use thiserror::Error;

use crate::exit::{Classify, ExitStatus};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Detect(#[from] crate::detect::Error),
    #[error(transparent)]
    Freeze(#[from] crate::freeze::Error),
    #[error(transparent)]
    Dump(#[from] crate::dump::Error),
    #[error(transparent)]
    Store(#[from] crate::store::Error),
    #[error(transparent)]
    Checkpoint(#[from] crate::flows::checkpoint::Error),
    #[error(transparent)]
    Restore(#[from] crate::flows::restore::Error),
    #[error(transparent)]
    Pipeline(#[from] crate::flows::pipeline::Error),
    #[error(transparent)]
    Guardian(#[from] crate::flows::guardian::Error),
    #[error(transparent)]
    Container(#[from] crate::flows::runtime::Error),
    #[error(transparent)]
    Engine(#[from] crate::flows::engine::Error),
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::Detect(e) => e.exit_status(),
            Error::Freeze(e) => e.exit_status(),
            Error::Dump(e) => e.exit_status(),
            Error::Store(e) => e.exit_status(),
            Error::Checkpoint(e) => e.exit_status(),
            Error::Restore(e) => e.exit_status(),
            Error::Pipeline(e) => e.exit_status(),
            Error::Guardian(e) => e.exit_status(),
            Error::Container(e) => e.exit_status(),
            Error::Engine(e) => e.exit_status(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stage_error_keeps_its_class_through_the_flows_error() {
        let store = crate::store::Error::Conflict("busy".into());
        assert_eq!(store.exit_status(), ExitStatus::Conflict);
        let wrapped = Error::from(crate::store::Error::Conflict("busy".into()));
        assert_eq!(wrapped.exit_status(), ExitStatus::Conflict);
    }
}
