//! `--container ID` of `checkpoint`, `restore` and `detect`: the container flow
//! (`gpu_checkpoint::flows::container`) with the runtime's command line as its runtime.

use std::path::PathBuf;

use gpu_checkpoint::detect::DetectOptions;
use gpu_checkpoint::dump::{discover, named, Criu, CriuRpc, PendingCriu};
use gpu_checkpoint::flows::container::{
    self, ContainerCheckpointOptions, ContainerRestoreOptions, OciCli, RuntimeKind,
};
use gpu_checkpoint::flows::{Alone, CheckpointManifest, Node};
use gpu_checkpoint::freeze::GpuBackend;
use serde_json::json;

use super::Format;
use crate::progress::Bar;

/// The container runtime's options, shared by the three commands.
#[derive(clap::Args, Debug, Clone)]
pub struct RuntimeArgs {
    /// The container runtime: `runc` (CRIU does the CPU side, with our CRIU) or `runsc` (gVisor's own
    /// checkpoint; see docs/containers.md).
    #[arg(
        long,
        value_name = "runc|runsc",
        default_value = "runc",
        requires = "container"
    )]
    pub runtime: RuntimeKind,
    /// The runtime's state folder (its global `--root`), where it is not the default.
    #[arg(long, value_name = "DIR", requires = "container")]
    pub runtime_root: Option<PathBuf>,
    /// A global flag for the runtime, e.g. `--runtime-arg=--platform=ptrace` for runsc; repeatable.
    /// Recorded in the checkpoint and given again on restore.
    #[arg(
        long,
        value_name = "ARG",
        allow_hyphen_values = true,
        requires = "container"
    )]
    pub runtime_arg: Vec<String>,
}

impl RuntimeArgs {
    /// The runtime's command line, told our CRIU (runc only).
    fn open(&self, criu: Option<PathBuf>) -> super::Result<OciCli> {
        Ok(OciCli::find(
            self.runtime,
            criu,
            self.runtime_root.clone(),
            self.runtime_arg.clone(),
        )?)
    }
}

/// Our CRIU, for runc's `--criu` and the manifest (runsc checkpoints by itself).
fn our_criu(kind: RuntimeKind, given: Option<&std::path::Path>) -> super::Result<Option<CriuRpc>> {
    if kind != RuntimeKind::Runc {
        return Ok(None);
    }
    let criu = CriuRpc::from_found(&discover(given)?);
    criu.check_permitted()?;
    Ok(Some(criu))
}

/// Our CRIU for a runc checkpoint, and its path (runc's `--criu`): one the user named is checked
/// (`criu --version`) on a thread while the flow asks runc for the container (both start a binary, slow on
/// a cold cache); the flow waits for it before it touches anything. Otherwise discovery as for every
/// command. `None` for runsc, which checkpoints by itself.
fn criu_for_checkpoint(
    kind: RuntimeKind,
    given: Option<&std::path::Path>,
) -> super::Result<Option<(PathBuf, Box<dyn Criu>)>> {
    if kind != RuntimeKind::Runc {
        return Ok(None);
    }
    if let Some((path, source)) = named(given) {
        let criu = PendingCriu::start(path, source);
        criu.check_permitted()?;
        return Ok(Some((criu.path().to_path_buf(), Box::new(criu))));
    }
    Ok(our_criu(kind, given)?.map(|c| (c.path().to_path_buf(), Box::new(c) as Box<dyn Criu>)))
}

/// `checkpoint --container ID`.
pub fn checkpoint(args: super::checkpoint::Args, id: &str) -> super::Result<()> {
    let store_options = args.store_options()?;
    let criu = criu_for_checkpoint(args.runtime.runtime, args.criu.as_deref())?;
    let (criu_path, criu) = criu.unzip();
    let runtime = args.runtime.open(criu_path)?;
    let store = args.store.open_or_create(store_options)?;
    let progress = Bar::new(args.store.format == Format::Text);
    let backend = super::checkpoint::backend_for(args.strategy, args.gpu.gpu_backend)?;
    let gpu = super::checkpoint::gpu_options(backend, args.lock_timeout.0, args.ordered);
    let node = with_criu(super::node(store)?, criu);
    let mut opts = ContainerCheckpointOptions::new(id);
    opts.name = args.name;
    opts.leave_running = args.leave_running;
    opts.via_runtime = args.runtime_checkpoint;
    say_if_simulated(args.cuda_checkpoint_path.as_deref());
    opts.sandbox_gpu_tool = args.cuda_checkpoint_path;
    opts.tcp_established = args.criu_opts.options()?.tcp_established;
    // The simulator is recognised only when asked for, never silently.
    opts.detect.simulator = backend == GpuBackend::Sim || args.simulated_gpus;
    let out = super::finished(node.checkpoint_container(&runtime, &opts, gpu, &progress, &Alone))?;
    if let Some(c) = out
        .manifest
        .container
        .as_ref()
        .filter(|c| c.sandbox_gpu_by_runtime)
    {
        eprintln!(
            "{}'s own checkpoint froze the sandbox's GPU state (--cuda-checkpoint-path); its restore puts it back",
            c.runtime
        );
    }
    let (t, rt) = (&out.timings, runtime.kind().name());
    let what = format!(
        " of {rt} container {id} ({} process(es), strategy {})",
        out.manifest.process_tree.len(),
        out.manifest.strategy,
    );
    let lines = [format!(
        "detect {:.0} ms, freeze {:.0} ms, pause {:.0} ms, {rt} checkpoint {:.0} ms, write {:.0} ms, stop {:.0} ms; total {:.0} ms",
        t.detect, t.freeze, t.pause, t.runtime_checkpoint, t.write, t.stop, t.total
    )];
    let done = if out.stopped {
        "the container was deleted"
    } else {
        "the container keeps running"
    };
    let summary = super::checkpoint::Summary {
        info: &out.info,
        manifest: &out.manifest,
        stopped: out.stopped,
        timings: serde_json::to_value(t).map_err(super::Failure::other)?,
    };
    let json = json!({
        "container": out.manifest.container,
        "pid": out.manifest.root_pid,
        "dump": if out.direct { "direct" } else { "runtime" },
    });
    summary.print(node.store(), args.store.format, (&what, &lines, done), json)?;
    Ok(())
}

/// The in-sandbox tool is the simulator's stand-in: said, never silent.
fn say_if_simulated(tool: Option<&std::path::Path>) {
    if tool.and_then(|t| t.file_name()) == Some(std::ffi::OsStr::new("sim-cuda-checkpoint")) {
        eprintln!("SIMULATED GPU: the sandbox's GPU state is frozen by sim-cuda-checkpoint, a stand-in for cuda-checkpoint");
    }
}

/// `node`, with our CRIU where we have one.
fn with_criu(node: Node, criu: Option<Box<dyn Criu>>) -> Node {
    match criu {
        Some(c) => node.with_criu(c),
        None => node,
    }
}

/// `restore CHECKPOINT --container ID`.
pub fn restore(args: super::restore::Args, id: &str) -> super::Result<()> {
    let Some(checkpoint) = args.checkpoint.clone() else {
        return Err(super::usage(
            "--container needs a CHECKPOINT (id or name), not --metadata",
        ));
    };
    let store = args.store.open_cached(args.cache_dir.as_deref())?;
    // The runtime's flags: those given, else the checkpoint's.
    let info = store.get(&checkpoint)?;
    let manifest = CheckpointManifest::from_metadata(&info.metadata).ok();
    let lock = manifest.as_ref().and_then(|m| m.kept_network_lock.clone());
    let record = manifest.and_then(|m| m.container);
    say_if_simulated(record.as_ref().and_then(|c| c.sandbox_gpu_tool.as_deref()));
    let recorded = record.map(|c| c.global_args).unwrap_or_default();
    let mut rt = args.runtime.clone();
    if rt.runtime_root.is_none() && rt.runtime_arg.is_empty() {
        let mut it = recorded.into_iter();
        while let Some(a) = it.next() {
            match (a.as_str(), rt.runtime_root.is_none()) {
                ("--root", true) => rt.runtime_root = it.next().map(PathBuf::from),
                _ => rt.runtime_arg.push(a),
            }
        }
    }
    let criu = our_criu(rt.runtime, args.criu.as_deref())?;
    let mut runtime = rt.open(criu.as_ref().map(|c| c.path().to_path_buf()))?;
    // runc's CRIU reads the images streamed from the store through this binary, run as its `criu swrk`.
    if let Ok(exe) = std::env::current_exe() {
        runtime = runtime.with_restore_proxy(exe);
    }
    let progress = Bar::new(args.store.format == Format::Text);
    let gpu = super::restore::gpu_options(&args.gpu, args.device_map.as_deref())?;
    // Its guardian deletes the half-restored container and the work folder should this process die
    // mid-way.
    let node = super::node(store)?;
    let opts = ContainerRestoreOptions {
        checkpoint,
        id: id.to_string(),
        bundle: args.bundle.clone(),
    };
    let restored = node.restore_container(&runtime, &opts, gpu, &progress, None);
    if restored.is_err() {
        let more = format!(" --container {id}");
        super::network_lock::say_if_kept(&info.id, lock.as_ref(), &args.store.storage, &more);
    }
    let out = super::finished(restored)?;
    match args.store.format {
        Format::Json => {
            let v = json!({
                "id": out.checkpoint,
                "container": out.id,
                "runtime": runtime.kind().name(),
                "pid": out.pid,
                "timings_ms": out.timings,
                "gpu": out.gpu,
                "streamed": out.streamed(),
                "materialized_because": out.materialized_because,
            });
            super::print_json(&v)?;
        }
        Format::Text => {
            println!("{}", out.pid);
            let t = &out.timings;
            let fetch = if out.streamed() {
                "images streamed from the store".to_string()
            } else {
                format!("fetch {:.0} ms", t.fetch)
            };
            eprintln!(
                "restored checkpoint {} as {} container {} (init pid {}): {fetch}, {} restore {:.0} ms, gpu {:.0} ms; total {:.0} ms",
                out.checkpoint, runtime.kind().name(), out.id, out.pid, runtime.kind().name(), t.runtime_restore, t.gpu, t.total
            );
        }
    }
    Ok(())
}

/// `detect --container ID`: the report of the container's processes, and which they are.
pub fn detect(
    rt: &RuntimeArgs,
    id: &str,
    simulator: bool,
) -> super::Result<(serde_json::Value, gpu_checkpoint::detect::Report)> {
    let runtime = rt.open(None)?;
    let found = container::discover(
        &runtime,
        id,
        &DetectOptions {
            tree: true,
            nvml: true,
            simulator,
            ..DetectOptions::default()
        },
    )?;
    let about = json!({
        "runtime": runtime.kind().name(),
        "id": id,
        "status": found.state.status,
        "bundle": found.state.bundle,
        "processes": found.processes,
    });
    Ok((about, found.report))
}
