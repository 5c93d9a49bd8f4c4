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
pub mod key;
pub mod list;
pub mod network_lock;
pub mod restore;
pub mod verify;

use gpu_checkpoint::{Classify, ExitStatus};

/// Output format shared by the subcommands that print reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    #[default]
    Text,
    Json,
}

/// An error detected in the binary itself, with its exit status (for example a bad argument combination
/// that clap cannot express).
#[derive(Debug)]
pub struct Exit(pub ExitStatus, pub String);

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.1)
    }
}

impl std::error::Error for Exit {}

impl Classify for Exit {
    fn exit_status(&self) -> ExitStatus {
        self.0
    }
}

/// A failed command as the binary reports it: the error with its causes, and its exit status, taken at
/// the one place an error enters the binary: the `From` of any [`Classify`] type (every library error
/// and [`Exit`]), so that no error reaches the report without its class and no list of types is kept.
#[derive(Debug)]
pub struct Failure {
    pub status: ExitStatus,
    pub error: anyhow::Error,
}

impl<E: Classify + Send + Sync + 'static> From<E> for Failure {
    fn from(e: E) -> Self {
        Failure {
            status: e.exit_status(),
            error: anyhow::Error::new(e),
        }
    }
}

impl Failure {
    /// A failure of the binary's own (printing, a file of its own) that no documented class names (exit 1).
    pub fn other(e: impl Into<anyhow::Error>) -> Self {
        Failure {
            status: ExitStatus::Failure,
            error: e.into(),
        }
    }

    /// Says where it happened, keeping the class.
    pub fn context(self, what: impl std::fmt::Display + Send + Sync + 'static) -> Self {
        Failure {
            status: self.status,
            error: self.error.context(what),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

/// What a command returns.
pub type Result<T = ()> = std::result::Result<T, Failure>;

/// Shorthand for a usage error (exit 2).
pub fn usage(msg: impl Into<String>) -> Failure {
    Exit(ExitStatus::Usage, msg.into()).into()
}

/// Prints `v` as pretty JSON on stdout (a command's `--format json`).
pub fn print_json(v: &impl serde::Serialize) -> Result {
    println!(
        "{}",
        serde_json::to_string_pretty(v).map_err(Failure::other)?
    );
    Ok(())
}

/// This node's flows on `store`, each operation guarded by a guardian
/// (`gpu_checkpoint::flows::guardian`) that finishes or undoes its work should this process be killed:
/// this very binary, run as `gpu-checkpoint guardian`.
pub fn node(store: gpu_checkpoint::store::Store) -> Result<gpu_checkpoint::flows::Node> {
    let exe = std::env::current_exe().map_err(Failure::other)?;
    Ok(gpu_checkpoint::flows::Node::new(store).guarded_by(exe))
}

/// A flow's `result`, said on stderr first if a deferred signal came while it ran (what it means is in
/// the result).
pub fn finished<T>(result: gpu_checkpoint::Result<T>) -> Result<T> {
    say_if_interrupted();
    Ok(result?)
}

/// Says on stderr that a deferred signal came while the command ran (what it means is in the result).
pub fn say_if_interrupted() {
    if let Some(sig) = gpu_checkpoint::interrupt::last_signal() {
        eprintln!("gpu-checkpoint: {sig} came while the tree was held; the step in progress was finished or undone before stopping");
    }
}
