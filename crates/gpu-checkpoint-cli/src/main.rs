//! The `gpu-checkpoint` binary: parses arguments, prints results and progress, and maps errors to exit
//! codes. All real work happens in the `gpu_checkpoint` library.

mod commands;
mod progress;

use clap::{Parser, Subcommand};
use gpu_checkpoint::ExitStatus;
use tracing_subscriber::EnvFilter;

#[derive(Parser)]
#[command(
    name = "gpu-checkpoint",
    version,
    about = "Checkpoint and restore GPU processes on Linux",
    long_about = None
)]
struct Cli {
    /// More log output on stderr (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short = 'v', long = "log-verbose", action = clap::ArgAction::Count, global = true)]
    log_verbose: u8,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Find the GPU state a process (tree) holds and decide how to checkpoint it.
    Detect(commands::detect::Args),
    /// Checkpoint a running process tree into a store.
    Checkpoint(commands::checkpoint::Args),
    /// Restore a checkpoint; prints the restored PID.
    Restore(commands::restore::Args),
    /// List the checkpoints in a store.
    List(commands::list::Args),
    /// Show one checkpoint's manifest.
    Inspect(commands::inspect::Args),
    /// Delete a checkpoint.
    Delete(commands::delete::Args),
    /// Release the network lock a --tcp-established checkpoint left on this node for its restore (its
    /// connections are then lost): when a restore failed and is given up.
    ReleaseNetworkLock(commands::network_lock::Args),
    /// Re-read and verify every chunk of one checkpoint or of the whole store.
    Verify(commands::verify::Args),
    /// Remove chunks that no checkpoint references.
    Gc(commands::gc::Args),
    /// Write a container checkpoint as podman's/CRI-O's checkpoint archive.
    Export(commands::archive::ExportArgs),
    /// Store a podman/CRI-O container checkpoint archive as a checkpoint.
    Import(commands::archive::ImportArgs),
    /// Make and show the keys that sign checkpoints (`checkpoint --sign-key`) and that restores trust
    /// (`--trust-key`).
    #[command(subcommand)]
    Key(commands::key::Command),
    /// Drive the CUDA checkpoint API directly (cuda-checkpoint parity).
    #[command(subcommand)]
    Cuda(commands::cuda::Command),
    /// Report what this machine has: CRIU, its version and `criu check`, GPU driver, NVML.
    Doctor(commands::doctor::Args),
    /// Run this node's agent for multi-node job checkpoints (foreground; etcd; stops on SIGTERM).
    #[cfg(feature = "cluster")]
    Agent(commands::agent::Args),
    /// Checkpoint and restore multi-node jobs through etcd (the coordinator's side).
    #[cfg(feature = "cluster")]
    #[command(subcommand)]
    Job(commands::job::Command),
    /// Configure a node's container engine (containerd, CRI-O, podman) to checkpoint and restore GPU
    /// containers through gpu-checkpoint (docs/kubernetes.md); --undo removes it.
    NodeSetup(commands::engine::SetupArgs),
    /// (internal) runc as the engines run it, with GPU-aware checkpoint and restore (node-setup's
    /// wrapper runs it).
    #[command(hide = true)]
    RuntimeWrapper(commands::engine::WrapperArgs),
    /// (internal) The process checkpoint and restore start to finish or undo their work if they die.
    #[command(hide = true)]
    Guardian(commands::guardian::Args),
}

fn init_logging(verbosity: u8) {
    let default = match verbosity {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    // Colour only for a person at a terminal: logs piped into files or other tools get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

fn main() {
    // runc runs us as its CRIU (`swrk FD`) for a streamed container restore (`dump/swrk_proxy.rs`).
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some((criu, fd)) = gpu_checkpoint::dump::swrk_proxy::proxy_call(&args) {
        std::process::exit(gpu_checkpoint::dump::swrk_proxy::run(&criu, fd));
    }
    // ... and CRIU runs us as the proxy's action script, which tells runc of the restored tree.
    if let Some(socket) = gpu_checkpoint::dump::swrk_notify::notify_call() {
        std::process::exit(gpu_checkpoint::dump::swrk_notify::notify(&socket));
    }
    let cli = Cli::parse();
    init_logging(cli.log_verbose);
    let result = match cli.command {
        Command::Detect(a) => commands::detect::run(a),
        Command::Checkpoint(a) => commands::checkpoint::run(a),
        Command::Restore(a) => commands::restore::run(a),
        Command::List(a) => commands::list::run(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Delete(a) => commands::delete::run(a),
        Command::ReleaseNetworkLock(a) => commands::network_lock::run(a),
        Command::Verify(a) => commands::verify::run(a),
        Command::Gc(a) => commands::gc::run(a),
        Command::Export(a) => commands::archive::export(a),
        Command::Import(a) => commands::archive::import(a),
        Command::Cuda(c) => commands::cuda::run(c),
        Command::Key(c) => commands::key::run(c),
        Command::Doctor(a) => commands::doctor::run(a),
        Command::Guardian(a) => commands::guardian::run(a),
        Command::NodeSetup(a) => commands::engine::setup(a),
        Command::RuntimeWrapper(a) => commands::engine::wrapper(a),
        #[cfg(feature = "cluster")]
        Command::Agent(a) => commands::agent::run(a),
        #[cfg(feature = "cluster")]
        Command::Job(c) => commands::job::run(c),
    };
    if let Err(err) = result {
        std::process::exit(report(&err) as i32);
    }
}

/// Prints an error as one clear line plus its causes; its exit code is the one it was given where it
/// entered the binary ([`commands::Failure`]). Control characters in the messages (from an archive, a
/// server, a runtime's output) are printed escaped, never raw to the terminal.
fn report(failure: &commands::Failure) -> ExitStatus {
    use gpu_checkpoint::fmt::escape_controls;
    let err = &failure.error;
    eprintln!("error: {}", escape_controls(&err.to_string()));
    for cause in err.chain().skip(1) {
        eprintln!("  caused by: {}", escape_controls(&cause.to_string()));
    }
    failure.status
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_command_line_definition_is_consistent() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }

    #[test]
    fn gpu_options_parse() {
        use clap::Parser;
        let cli = super::Cli::try_parse_from([
            "gpu-checkpoint",
            "checkpoint",
            "--pid",
            "5",
            "--storage",
            "/x",
            "--gpu-backend",
            "sim",
            "--lock-timeout",
            "250ms",
        ])
        .unwrap();
        let super::Command::Checkpoint(a) = cli.command else {
            panic!("checkpoint")
        };
        assert_eq!(
            a.lock_timeout.0,
            Some(std::time::Duration::from_millis(250))
        );
        let cli = super::Cli::try_parse_from([
            "gpu-checkpoint",
            "restore",
            "ID",
            "--storage",
            "/x",
            "--device-map",
            "0=1",
        ])
        .unwrap();
        let super::Command::Restore(a) = cli.command else {
            panic!("restore")
        };
        assert_eq!(a.device_map.as_deref(), Some("0=1"));
    }
}
