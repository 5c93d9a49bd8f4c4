//! `gpu-checkpoint restore`: restore a checkpoint detached and print the restored PID.

use std::path::PathBuf;

use gpu_checkpoint::dump::{discover, CriuRpc};
use gpu_checkpoint::flows::{CheckpointManifest, ImageTransfer};
use gpu_checkpoint::freeze::{DeviceMap, HookOptions};
use gpu_checkpoint::restore::Target;
use serde_json::json;

use super::criu_opts::CriuArgs;
use super::cuda::GpuArgs;
use super::list::StoreArgs;
use super::{usage, Format};
use crate::progress::Bar;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoint id, or name (its newest checkpoint).
    #[arg(required_unless_present = "metadata", conflicts_with = "metadata")]
    pub checkpoint: Option<String>,
    /// The checkpoint's manifest file in the store (as `inspect` shows it) instead of its id.
    #[arg(long, value_name = "PATH")]
    pub metadata: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
    /// A local read-through cache folder for a store on S3: chunks fetched are checked and kept there
    /// (a private folder of this user: created 0700, refused if it is a link, another user's or open to
    /// others), and a later restore on this node reads them from it without a request; a cached chunk that
    /// fails its check is fetched again. Ignored for a store in a folder.
    #[arg(long, value_name = "DIR", env = "GPU_CHECKPOINT_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// The CRIU binary to use (default: $GPU_CHECKPOINT_CRIU, then `criu` on PATH if >= 4.0, then the
    /// project's own from scripts/install-criu.sh).
    #[arg(long, value_name = "PATH")]
    pub criu: Option<PathBuf>,
    #[command(flatten)]
    pub gpu: GpuArgs,
    /// Restore GPU state onto other GPUs: OLD=NEW,... (indices or GPU-... UUIDs; old indices are the
    /// checkpoint's, new ones this node's). Without it, this node must have the same GPU count and models.
    #[arg(long, value_name = "OLD=NEW,...")]
    pub device_map: Option<String>,
    /// Materialize all images into a work folder before CRIU reads them: twice the disk traffic; for a
    /// CRIU or setup where neither default works.
    #[arg(long, conflicts_with = "stream")]
    pub staged: bool,
    /// Stream every image, memory included, to CRIU through pipes (CRIU's --stream) instead of copying
    /// the memory straight into the processes through userfaultfd (the default where userfaultfd is
    /// available: CRIU restores the rest from a few MiB of other images while the store copies the
    /// memory on all cores, and the processes resume with all of it).
    #[arg(long)]
    pub stream: bool,
    /// When the restored processes go on, with memory copied through userfaultfd: `early` (the default)
    /// as soon as CRIU has restored them, the pages they touch before the copy reaches them served on
    /// demand from verified chunks (the command still returns once every page is in); `filled` only once
    /// all of their memory is in.
    #[arg(long, value_enum, default_value_t = Resume::Early)]
    pub resume: Resume,
    /// CRIU's dump-time flags (--tcp-established, --file-locks, ...) are accepted for scripts written for
    /// plain CRIU, but the checkpoint decides them; the restore's own are --external, --criu-config,
    /// --manage-cgroups and --tcp-close.
    #[command(flatten)]
    pub criu_opts: CriuArgs,
    /// Restore a container checkpoint as container ID (the checkpointed one's id or a new one), managed
    /// by its runtime afterwards. The runtime's flags default to the checkpoint's.
    #[arg(long, value_name = "ID")]
    pub container: Option<String>,
    #[command(flatten)]
    pub runtime: super::container::RuntimeArgs,
    /// The bundle to restore the container into (default: the checkpointed container's).
    #[arg(long, value_name = "DIR", requires = "container")]
    pub bundle: Option<PathBuf>,
}

/// `restore --resume`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Resume {
    Early,
    Filled,
}

/// One line on stderr for the CRIU flags given again that the checkpoint decides anyway (and the notes of
/// [`gpu_checkpoint::dump::CriuOptions::restore_options`]); a flag that contradicts the checkpoint is the
/// restore's own error.
fn say_what_the_checkpoint_decides(
    id: &str,
    manifest: &CheckpointManifest,
    given: &gpu_checkpoint::dump::CriuOptions,
) {
    if let Ok(r) = manifest.options.criu.restore_options(given) {
        if !r.decided.is_empty() {
            eprintln!(
                "gpu-checkpoint: {}: checkpoint {id} was taken with {}; the restore applies it from there",
                r.decided.join(", "),
                if r.decided.len() == 1 { "this" } else { "these" }
            );
        }
        for note in r.notes {
            eprintln!("gpu-checkpoint: note: {note}");
        }
    }
}

pub fn run(args: Args) -> super::Result<()> {
    if let Some(id) = args.container.clone() {
        return super::container::restore(args, &id);
    }
    let target = match (args.checkpoint, args.metadata) {
        (Some(c), None) => Target::Checkpoint(c),
        (None, Some(m)) => Target::Manifest(m),
        _ => return Err(usage("give a CHECKPOINT or --metadata PATH, not both")),
    };
    let given = args.criu_opts.options()?;
    let found = discover(args.criu.as_deref())?;
    let criu = CriuRpc::from_found(&found);
    let store = args.store.open_cached(args.cache_dir.as_deref())?;
    let progress = Bar::new(args.store.format == Format::Text);
    let gpu = gpu_options(&args.gpu, args.device_map.as_deref())?;
    let images = if args.staged {
        ImageTransfer::Staged
    } else if args.stream {
        ImageTransfer::Stream
    } else {
        match (ImageTransfer::default_restore(), args.resume) {
            (ImageTransfer::Uffd, Resume::Filled) => ImageTransfer::UffdFilled,
            (t, _) => t,
        }
    };
    let node = super::node(store)?.with_criu(Box::new(criu));
    let (info, manifest) = node.find(&target)?;
    say_what_the_checkpoint_decides(&info.id, &manifest, &given);
    let restored = node.restore(&target, &given, images, gpu, &progress, None);
    if restored.is_err() {
        let lock = manifest.kept_network_lock.as_ref();
        super::network_lock::say_if_kept(&info.id, lock, &args.store.storage, "");
    }
    let out = super::finished(restored)?;
    match args.store.format {
        Format::Json => {
            let v = json!({
                "id": out.id,
                "pid": out.pid,
                "timings_ms": out.timings,
                "log": out.log,
                "gpu": out.gpu,
            });
            super::print_json(&v)?;
        }
        Format::Text => {
            // stdout carries the PID alone, for `pid=$(gpu-checkpoint restore ...)`.
            println!("{}", out.pid);
            let t = &out.timings;
            let images = if let Some(u) = &t.uffd {
                format!(
                    "fetch {:.0} ms, restore {:.0} ms ({} MiB of memory copied through userfaultfd)",
                    t.fetch,
                    t.restore,
                    u.copied_bytes >> 20
                )
            } else if t.streamed {
                format!("restore (streamed from the store) {:.0} ms", t.restore)
            } else {
                format!("fetch {:.0} ms, restore {:.0} ms", t.fetch, t.restore)
            };
            let resumed = match (t.resumed, t.memory_in) {
                (Some(r), Some(m)) if m > r + 0.5 => {
                    format!("; ran again after {r:.0} ms, all memory in after {m:.0} ms")
                }
                (Some(r), _) => format!("; ran again after {r:.0} ms"),
                _ => String::new(),
            };
            eprintln!(
                "restored checkpoint {} as pid {}: {images}, gpu {:.0} ms; total {:.0} ms{resumed}",
                out.id, out.pid, t.gpu, t.total
            );
        }
    }
    Ok(())
}

/// The GPU step's settings of a restore: `--gpu-backend`, and `--device-map` onto this node's GPUs.
pub(super) fn gpu_options(gpu: &GpuArgs, device_map: Option<&str>) -> super::Result<HookOptions> {
    Ok(HookOptions {
        backend: gpu.gpu_backend,
        device_map: device_map.map(str::parse::<DeviceMap>).transpose()?,
        ..HookOptions::default()
    })
}
