//! One file per subcommand. Each has an `Args` (clap) and a `run` that calls the library and prints.

pub mod checkpoint;
pub mod criu_opts;
pub mod cuda;
pub mod delete;
pub mod detect;
pub mod doctor;
pub mod gc;
pub mod inspect;
pub mod list;
pub mod restore;
pub mod verify;

use gpu_checkpoint::ExitStatus;

/// Output format shared by the subcommands that print reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    #[default]
    Text,
    Json,
}

/// An error that carries its own exit status, for failures detected in the binary itself
/// (for example a bad argument combination that clap cannot express).
#[derive(Debug)]
pub struct Exit(pub ExitStatus, pub String);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.1)
    }
}

impl std::error::Error for Exit {}

/// Shorthand for a usage error (exit 2).
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    Exit(ExitStatus::Usage, msg.into()).into()
}
