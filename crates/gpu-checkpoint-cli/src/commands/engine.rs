//! `node-setup` (what a node needs for the engines' path, and its undo) and the hidden
//! `runtime-wrapper` (runc as the engines run it, `gpu_checkpoint::flows::engine`).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

use gpu_checkpoint::flows::container::{OciCli, RuntimeKind};
use gpu_checkpoint::flows::engine::node::{self, EngineKind, NodeSetup};
use gpu_checkpoint::flows::engine::{self, Engine, NodeConfig, Plan, RuncCall};

use super::cuda::{gpu_backend_parser, parse_timeout, Timeout};
use gpu_checkpoint::freeze::GpuBackend;

#[derive(clap::Args, Debug)]
pub struct WrapperArgs {
    /// The node's configuration (`gpu-checkpoint node-setup` writes it).
    #[arg(long, value_name = "FILE")]
    config: PathBuf,
    /// runc's command line, as the engine gives it.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "RUNC_ARGS"
    )]
    args: Vec<OsString>,
}

/// `runtime-wrapper --config FILE -- RUNC_ARGS...`: exits with runc's exit code, or ours when we
/// refuse or fail: the reason on one line, first (containerd's shim keeps only the first line of a failed
/// checkpoint's output), and in runc's `--log`, where the engines read a failed restore's reason.
pub fn wrapper(a: WrapperArgs) -> super::Result<()> {
    let config = NodeConfig::read(&a.config)?;
    let call = RuncCall::parse(&a.args);
    let line = match engine::plan(&call, &config) {
        Plan::Exec(line) => line,
        Plan::Checkpoint | Plan::Restore => {
            let out = ours(&call, &config);
            let simulated = || {
                if config.simulated() {
                    eprintln!("SIMULATED GPU: this node's GPU backend is the simulator (tests and demos only)");
                }
            };
            if out.is_ok() {
                simulated();
            }
            match out {
                Ok(Some(code)) => std::process::exit(code),
                Ok(None) => call.with_criu(config.criu.as_deref()),
                Err(e) => {
                    let chain: Vec<String> = e.error.chain().map(ToString::to_string).collect();
                    let msg = format!("gpu-checkpoint: {}", chain.join(": ").replace('\n', " "));
                    eprintln!("{msg}");
                    simulated();
                    engine::log_error(&call, &msg);
                    std::process::exit(e.status as i32);
                }
            }
        }
    };
    let e = Command::new(&config.runtime)
        .args(&line)
        .envs(engine::runc_env(&config))
        .exec();
    Err(super::Failure::other(anyhow::anyhow!(
        "running {}: {e}",
        config.runtime.display()
    )))
}

/// Our checkpoint or restore around runc's; `None`: hand the command line to runc as it is.
fn ours(call: &RuncCall, config: &NodeConfig) -> super::Result<Option<i32>> {
    let runtime = OciCli::at(
        RuntimeKind::Runc,
        config.runtime.clone(),
        None,
        call.global_value("root").map(PathBuf::from),
        call.other_global_args(),
    );
    let real = |line: &[OsString]| -> Result<i32, engine::Error> {
        let status = Command::new(&config.runtime)
            .args(line)
            .envs(engine::runc_env(config))
            .status()
            .map_err(|e| engine::Error::Io(format!("running {}: {e}", config.runtime.display())))?;
        use std::os::unix::process::ExitStatusExt;
        Ok(status
            .code()
            .unwrap_or_else(|| 128 + status.signal().unwrap_or(0)))
    };
    // Puts the GPU state back, or deletes a half-restored container, should this process die.
    let log = match &config.guardian_log {
        Some(path) => std::process::Stdio::from(
            std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .map_err(super::Failure::other)?,
        ),
        None => std::process::Stdio::null(),
    };
    let guardian = gpu_checkpoint::flows::guardian::Guardian::spawn_logging(
        &std::env::current_exe().map_err(super::Failure::other)?,
        log,
    )?;
    let mut flow = Engine {
        config,
        call,
        runtime: &runtime,
        real: &real,
        watch: &guardian,
    };
    let out = if call.command.as_deref() == Some("checkpoint") {
        Some(flow.checkpoint()?)
    } else {
        flow.restore()?
    };
    super::say_if_interrupted();
    Ok(out)
}

#[derive(clap::Args, Debug)]
pub struct SetupArgs {
    /// The engine to configure: containerd (its CRI, so the kubelet's checkpoint API), crio, podman.
    #[arg(long, value_name = "containerd|crio|podman")]
    engine: EngineKind,
    /// Remove what an earlier node-setup of this engine wrote (the shared files once no engine uses
    /// them).
    #[arg(long)]
    undo: bool,
    /// Where the files go and what they name each other with (default: the node's root).
    #[arg(long, value_name = "DIR", default_value = "/")]
    prefix: PathBuf,
    /// Write under DIR, naming files without it: the node's root mounted at DIR (a DaemonSet's pod).
    #[arg(long, value_name = "DIR", conflicts_with = "prefix")]
    host_root: Option<PathBuf>,
    /// The real runc (default: `runc` on PATH).
    #[arg(long, value_name = "PATH")]
    runc: Option<PathBuf>,
    /// The CRIU (>= 4) runc is given (default: found as for `checkpoint`).
    #[arg(long, value_name = "PATH")]
    criu: Option<PathBuf>,
    /// The GPU backend of this node's checkpoints.
    #[arg(long, value_parser = gpu_backend_parser(), default_value_t = GpuBackend::Auto)]
    gpu_backend: GpuBackend,
    /// How long locking a CUDA process may wait for its submitted GPU work (0: no limit).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_timeout)]
    lock_timeout: Timeout,
}

/// `node-setup --engine E [--undo]`.
pub fn setup(a: SetupArgs) -> super::Result<()> {
    let prefix = a.host_root.clone().unwrap_or(a.prefix);
    let done = if a.undo {
        node::undo(a.engine, &prefix)?
    } else {
        let runc = match a.runc {
            Some(r) => r,
            None => gpu_checkpoint::path_search::which("runc")
                .ok_or_else(|| super::usage("runc is not on PATH: name it with --runc"))?,
        };
        let criu = match a.criu {
            Some(c) => Some(c),
            None => Some(gpu_checkpoint::dump::discover(None)?.path),
        };
        let setup = NodeSetup {
            engine: a.engine,
            prefix,
            host_root: a.host_root,
            binary: std::env::current_exe().map_err(super::Failure::other)?,
            runc,
            criu,
            gpu_backend: a.gpu_backend,
            lock_timeout_ms: a.lock_timeout.0.map(|d| d.as_millis() as u64),
        };
        let mut done = setup.install()?;
        done.push(format!(
            "restart {} to use {} as its runc",
            a.engine,
            setup.wrapper().display()
        ));
        done
    };
    for line in done {
        println!("{line}");
    }
    Ok(())
}
