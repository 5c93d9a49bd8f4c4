//! `gpu-checkpoint checkpoint`: checkpoint a running process tree into a store.

use std::path::PathBuf;

use gpu_checkpoint::checkpoint::CheckpointOptions;
use gpu_checkpoint::detect::StrategyChoice;
use gpu_checkpoint::dump::{discover, CriuRpc};
use gpu_checkpoint::flows::{Alone, CheckpointManifest, ImageTransfer};
use gpu_checkpoint::freeze::{GpuBackend, GroupOptions, HookOptions};
use gpu_checkpoint::store::{CheckpointInfo, Store, StoreOptions};
use serde_json::json;

use super::criu_opts::CriuArgs;
use super::cuda::{parse_timeout, GpuArgs, Timeout};
use super::list::StoreArgs;
use super::Format;
use crate::progress::{bytes, Bar};

#[derive(clap::Args)]
pub struct Args {
    /// Root of the process tree to checkpoint.
    #[arg(long, value_name = "PID", value_parser = clap::value_parser!(i32).range(1..), required_unless_present = "container", conflicts_with = "container")]
    pub pid: Option<i32>,
    /// Checkpoint a container instead: its id in the runtime (`--runtime`). Its GPU processes are frozen
    /// from the host; a runc container is dumped by our CRIU with runc's settings for it, its images
    /// streamed into the store, and restores with `runc restore` (docs/containers.md).
    #[arg(long, value_name = "ID")]
    pub container: Option<String>,
    /// With `--container` (runc): let runc dump the container (`runc checkpoint` into a staging folder,
    /// then stored) instead of driving CRIU directly: slower, for what the direct dump refuses (runc's
    /// own network configuration).
    #[arg(long, requires = "container")]
    pub runtime_checkpoint: bool,
    /// With `--container` (runsc): a cuda-checkpoint-compatible tool, as a path inside the sandbox,
    /// that freezes the GPU state inside the gVisor sandbox: handed to `runsc checkpoint
    /// --cuda-checkpoint-path` where the runsc has it (its restore puts the state back), else run by
    /// `runsc exec` on the sandbox's own PIDs and again by the restore. `sim-cuda-checkpoint` is the
    /// SIMULATED stand-in.
    #[arg(long, value_name = "PATH", requires = "container")]
    pub cuda_checkpoint_path: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub runtime: super::container::RuntimeArgs,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Keep the tree running after the checkpoint (default: stop it once the checkpoint is durable).
    #[arg(long)]
    pub leave_running: bool,
    /// A name for the checkpoint (restore accepts it in place of the id: its newest checkpoint).
    #[arg(long)]
    pub name: Option<String>,
    /// The CRIU binary to use (default: $GPU_CHECKPOINT_CRIU, then `criu` on PATH if >= 4.0, then the
    /// project's own from scripts/install-criu.sh).
    #[arg(long, value_name = "PATH")]
    pub criu: Option<PathBuf>,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Tests and demos only: treat SIMULATED GPU processes (gpu-sim-workload) as GPU processes with a
    /// backend other than `sim`, to drive the real `cuda-driver` backend through the SIMULATED libcuda.so.1
    /// of crates/cuda-sim (named by LD_LIBRARY_PATH). Refused when the driver loaded is a real one.
    #[arg(long)]
    pub simulated_gpus: bool,
    /// How to checkpoint GPU state: `auto` (what detect decides), or one forced: `none` (CRIU alone),
    /// `cuda-driver` (the driver API in-process), `cuda-cli` (NVIDIA's cuda-checkpoint binary). Refused
    /// (exit 9) where detect says it cannot work; `bar-sliding` is always refused, with the reason.
    #[arg(long, value_name = "auto|none|cuda-driver|cuda-cli", default_value = "auto", value_parser = parse_strategy)]
    pub strategy: StrategyChoice,
    /// Lock the tree's CUDA processes one after another (root first), and restore and unlock them in the
    /// same order, instead of all at once: what processes sharing CUDA IPC memory need (driver >= 610).
    /// On by itself where detect finds such sharing.
    #[arg(long)]
    pub ordered: bool,
    /// Checkpoint processes of the tree that are stopped on purpose (SIGSTOP, job control) as they are:
    /// they stay stopped, and come back stopped, as with plain CRIU. Without it a stopped tree is refused
    /// (exit 9): an earlier interrupted checkpoint may have left it so.
    #[arg(long)]
    pub allow_stopped: bool,
    /// How long locking a CUDA process may wait for its submitted GPU work (10s, 500ms; 0: no limit).
    /// On expiry every process is unlocked and keeps running.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_timeout)]
    pub lock_timeout: Timeout,
    /// How new chunks are stored: `zstd` (level 1), `zstd:N` (levels 1-19; higher is smaller and slower),
    /// or `none` (raw: the fastest checkpoint and restore, the most disk).
    #[arg(long, value_name = "none|zstd[:N]", default_value = "zstd", value_parser = parse_compression)]
    pub compression: Compression,
    /// Write CRIU's images to a staging folder first and store them afterwards, instead of streaming them
    /// straight into the store (CRIU's --stream, the default): twice the disk traffic; for a CRIU or
    /// setup where streaming fails.
    #[arg(long)]
    pub staged: bool,
    /// A device node CRIU cannot dump (e.g. /dev/fuse) whose open descriptors are recorded and reopened at
    /// the same descriptor numbers on restore (CRIU's devices plugin); repeatable. NVIDIA nodes held
    /// without a CUDA context are always handled so. Refused (exit 9) where a process maps the device.
    #[arg(long, value_name = "PATH", value_parser = parse_device)]
    pub reopen_device: Vec<PathBuf>,
    #[command(flatten)]
    pub criu_opts: CriuArgs,
    #[command(flatten)]
    pub sign: super::key::SignArgs,
}

impl Args {
    /// The store options of the checkpoint: compression, and the signing key (read and checked here,
    /// before anything is touched: a bad key file is exit 2).
    pub(super) fn store_options(&self) -> super::Result<StoreOptions> {
        Ok(StoreOptions {
            sign_key: self.sign.key()?,
            ..self.compression.store_options()
        })
    }
}

/// The store's compression setting for a checkpoint's new chunks.
#[derive(Clone, Copy, Debug)]
pub struct Compression(Option<i32>);

fn parse_compression(s: &str) -> Result<Compression, String> {
    let level = match s {
        "none" => return Ok(Compression(None)),
        "zstd" => StoreOptions::default().zstd_level,
        _ => s
            .strip_prefix("zstd:")
            .and_then(|n| n.parse::<i32>().ok())
            .filter(|n| (1..=19).contains(n))
            .ok_or_else(|| format!("expected none, zstd or zstd:N with N in 1..=19, got '{s}'"))?,
    };
    Ok(Compression(Some(level)))
}

impl Compression {
    pub(super) fn store_options(self) -> StoreOptions {
        let defaults = StoreOptions::default();
        StoreOptions {
            compress: self.0.is_some(),
            zstd_level: self.0.unwrap_or(defaults.zstd_level),
            ..defaults
        }
    }
}

pub fn run(args: Args) -> super::Result<()> {
    let pid = match (args.pid, args.container.clone()) {
        (Some(pid), None) => pid,
        (None, Some(id)) => return super::container::checkpoint(args, &id),
        _ => return Err(super::usage("give --pid PID or --container ID")),
    };
    let criu_options = args.criu_opts.options()?;
    let store_options = args.store_options()?;
    let found = discover(args.criu.as_deref())?;
    let criu = CriuRpc::from_found(&found);
    // What refuses without touching anything refuses before the store folder is created, too.
    gpu_checkpoint::dump::Criu::check_permitted(&criu)?;
    if !gpu_checkpoint::proc::is_alive(pid) {
        return Err(gpu_checkpoint::checkpoint::Error::NoSuchProcess { pid }.into());
    }
    let store = args.store.open_or_create(store_options)?;
    let progress = Bar::new(args.store.format == Format::Text);
    let backend = backend_for(args.strategy, args.gpu.gpu_backend)?;
    let gpu = gpu_options(backend, args.lock_timeout.0, args.ordered);
    let node = super::node(store)?.with_criu(Box::new(criu));
    let mut opts = CheckpointOptions::new(pid);
    opts.name = args.name;
    opts.leave_running = args.leave_running;
    opts.criu = criu_options;
    // The simulator is recognised only when asked for, never silently.
    opts.detect.simulator = backend == GpuBackend::Sim || args.simulated_gpus;
    opts.strategy = args.strategy;
    opts.allow_stopped = args.allow_stopped;
    opts.reopen_devices = args.reopen_device;
    let images = ImageTransfer::staged_if(args.staged);
    let out = super::finished(node.checkpoint(&opts, gpu, images, &progress, &Alone))?;

    let t = &out.timings;
    let n = out.manifest.process_tree.len();
    let what = format!(
        "{} of pid {pid} ({n} process{}, strategy {})",
        out.info
            .name
            .as_deref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default(),
        if n == 1 { "" } else { "es" },
        out.manifest.strategy,
    );
    let (dump, write) = if t.streamed {
        ("dump + store (streamed)", "commit")
    } else {
        ("dump", "write")
    };
    let mut lines = vec![format!(
        "detect {:.0} ms, freeze {:.0} ms, {dump} {:.0} ms, {write} {:.0} ms, stop {:.0} ms; total {:.0} ms",
        t.detect, t.freeze, t.dump, t.write, t.stop, t.total
    )];
    if !out.stopped {
        lines.push(format!(
            "the tree was held stopped {:.0} ms ({})",
            t.paused,
            if t.continued {
                "until the store had read every image"
            } else {
                "while CRIU wrote its images"
            }
        ));
    }
    lines.extend(gpu_summary(&out.manifest));
    for d in &out.manifest.devices {
        lines.push(format!("{} recorded: reopened on restore", d.path));
    }
    let done = if out.stopped {
        "the process tree was stopped"
    } else {
        "the process tree keeps running"
    };
    let summary = Summary {
        info: &out.info,
        manifest: &out.manifest,
        stopped: out.stopped,
        timings: serde_json::to_value(t).map_err(super::Failure::other)?,
    };
    let json = json!({"pid": pid, "devices": out.manifest.devices});
    summary.print(node.store(), args.store.format, (&what, &lines, done), json)?;
    Ok(())
}

/// The GPU step's settings of a checkpoint: `backend`, locking each CUDA process for at most
/// `lock_timeout`, one after another when `ordered`.
pub(super) fn gpu_options(
    backend: GpuBackend,
    lock_timeout: Option<std::time::Duration>,
    ordered: bool,
) -> HookOptions {
    HookOptions {
        backend,
        group: GroupOptions {
            lock_timeout,
            ordered,
        },
        device_map: None,
    }
}

/// A finished checkpoint, of a process tree or a container, as `checkpoint` prints it.
pub(super) struct Summary<'a> {
    pub info: &'a CheckpointInfo,
    pub manifest: &'a CheckpointManifest,
    pub stopped: bool,
    pub timings: serde_json::Value,
}

impl Summary<'_> {
    /// Prints the checkpoint: its id on stdout; in text, on stderr, `what` it is of with its sizes, then
    /// `lines` and what became of the tree (`done`) with its manifest; in JSON, the fields every
    /// checkpoint has and `fields`.
    pub(super) fn print(
        &self,
        store: &Store,
        format: Format,
        (what, lines, done): (&str, &[String], &str),
        fields: serde_json::Value,
    ) -> super::Result {
        let (info, manifest) = (self.info, self.manifest);
        let manifest_path = store.manifest_location(&info.id);
        if format == Format::Json {
            let mut v = json!({
                "id": info.id,
                "name": info.name,
                "processes": manifest.process_tree.len(),
                "strategy": manifest.strategy,
                "stopped": self.stopped,
                "manifest": manifest_path,
                "timings_ms": self.timings,
                "gpu": manifest.gpu,
                "sizes": manifest.sizes,
                "stats": info.stats,
                "kept_network_lock": manifest.kept_network_lock,
            });
            if let (Some(v), serde_json::Value::Object(more)) = (v.as_object_mut(), fields) {
                v.extend(more);
            }
            return super::print_json(&v);
        }
        let s = &info.stats;
        println!("{}", info.id);
        eprintln!(
            "checkpoint {}{what}: {} of images, {} stored ({} new)",
            info.id,
            bytes(manifest.sizes.image_bytes),
            bytes(s.stored_bytes),
            bytes(s.new_bytes),
        );
        for line in lines {
            eprintln!("  {line}");
        }
        if let Some(lock) = &manifest.kept_network_lock {
            eprintln!(
                "  CRIU's network lock stays on this node until a restore succeeds: {} (`release-network-lock {}` gives the connections up)",
                lock.describe(),
                info.id
            );
        }
        eprintln!("  {done}; manifest {manifest_path}");
        Ok(())
    }
}

/// One line about the GPU step, from the manifest's `gpu` record (none without GPU state).
fn gpu_summary(manifest: &CheckpointManifest) -> Option<String> {
    let rec = manifest.gpu_record().ok()??;
    let skipped = if rec.skipped.is_empty() {
        String::new()
    } else {
        format!(", {} left alone (no CUDA context)", rec.skipped.len())
    };
    Some(format!(
        "gpu: {} CUDA process(es) via {} ({}): lock {:.0} ms, GPU checkpoint {:.0} ms{skipped}",
        rec.processes.len(),
        rec.backend,
        rec.driver_version
            .as_deref()
            .unwrap_or("driver version unknown"),
        rec.timings.lock_ms,
        rec.timings.checkpoint_ms,
    ))
}

/// A character device node, as the kernel names it in `/proc/PID/fd` (links resolved).
fn parse_device(s: &str) -> Result<PathBuf, String> {
    use std::os::unix::fs::FileTypeExt;
    let path = std::fs::canonicalize(s).map_err(|e| format!("{s}: {e}"))?;
    let meta = std::fs::metadata(&path).map_err(|e| format!("{s}: {e}"))?;
    if !meta.file_type().is_char_device() {
        return Err(format!("{s}: not a character device"));
    }
    match path.to_str() {
        Some(p) if !p.contains(':') && !p.contains('\n') => Ok(path),
        _ => Err(format!(
            "{s}: a device path with ':' or a line break is not supported"
        )),
    }
}

fn parse_strategy(s: &str) -> Result<StrategyChoice, String> {
    s.parse().map_err(|_| {
        format!("{s:?}: one of auto, none, cuda-driver, cuda-cli (bar-sliding is refused, with the reason)")
    })
}

/// The GPU backend a forced strategy means: `--strategy cuda-cli` is the cuda-checkpoint binary, whatever
/// `--gpu-backend auto` would pick; a `--gpu-backend` that contradicts the strategy is a usage error.
pub(super) fn backend_for(
    strategy: StrategyChoice,
    chosen: GpuBackend,
) -> super::Result<GpuBackend> {
    let wanted = match strategy {
        StrategyChoice::CudaDriver => GpuBackend::CudaDriver,
        StrategyChoice::CudaCli => GpuBackend::CudaCli,
        _ => return Ok(chosen),
    };
    match chosen {
        GpuBackend::Auto => Ok(wanted),
        // The simulator speaks the driver API.
        GpuBackend::Sim if strategy == StrategyChoice::CudaDriver => Ok(GpuBackend::Sim),
        b if b == wanted => Ok(b),
        b => Err(super::usage(format!(
            "--strategy {strategy} contradicts --gpu-backend {b}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_settings_parse_and_reach_the_store() {
        let none = parse_compression("none").unwrap().store_options();
        assert!(!none.compress);
        assert_eq!(none.compression_level(), None);
        let default = parse_compression("zstd").unwrap().store_options();
        assert_eq!(
            default.compression_level(),
            Some(StoreOptions::default().zstd_level)
        );
        assert_eq!(
            parse_compression("zstd:7")
                .unwrap()
                .store_options()
                .compression_level(),
            Some(7)
        );
        for bad in ["zstd:0", "zstd:20", "lz4", "zstd:x", ""] {
            assert!(parse_compression(bad).is_err(), "{bad} accepted");
        }
    }
}
