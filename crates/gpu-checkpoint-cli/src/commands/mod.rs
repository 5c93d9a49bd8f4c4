//! One file per subcommand. Each has an `Args` (clap) and a `run` that calls the library and prints.

#[cfg(feature = "cluster")]
pub mod agent;
pub mod archive;
pub mod checkpoint;
pub mod container;
pub mod criu_opts;
pub mod cuda;
pub mod delete;
pub mod detect;
pub mod doctor;
pub mod engine;
#[cfg(feature = "cluster")]
pub mod etcd_args;
pub mod gc;
pub mod guardian;
pub mod inspect;
#[cfg(feature = "cluster")]
pub mod job;
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

/// Starts the guardian (`gpu_checkpoint::flows::guardian`) that finishes or undoes a checkpoint's or
/// restore's work should this process be killed: this very binary, run as `gpu-checkpoint guardian`.
pub fn start_guardian() -> anyhow::Result<gpu_checkpoint::flows::guardian::Guardian> {
    let exe = std::env::current_exe()?;
    Ok(gpu_checkpoint::flows::guardian::Guardian::spawn(&exe)?)
}

/// Says on stderr that a deferred signal came while the command ran (what it means is in the result).
pub fn say_if_interrupted() {
    if let Some(sig) = gpu_checkpoint::interrupt::last_signal() {
        eprintln!("gpu-checkpoint: {sig} came while the tree was held; the step in progress was finished or undone before stopping");
    }
}
