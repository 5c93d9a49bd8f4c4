//! The restore flow: fetch + verify, CRIU restore, GPU restore (optionally onto other GPUs) + unlock.
//!
//! Order, and why:
//! 1. Find the checkpoint (id, name, or the path of its manifest) and read its manifest.
//! 2. Refuse early when a PID of the tree is taken: CRIU restores every process under its original PID.
//!    A zombie holding one is waited for a little (its parent may be about to reap it; init does so
//!    lazily on some systems), anything else is a conflict naming the PID and its holder.
//! 3. The GPU step checks this node can take the GPU state ([`crate::freeze::GpuHook::prepare_restore`]).
//! 4. The images go to CRIU one of three ways ([`ImageTransfer`]), every chunk verified first: by default
//!    the images without the processes' private memory are materialized into a private folder and the
//!    memory is copied into the processes through userfaultfd while CRIU holds them stopped (`uffd/`);
//!    or every image is streamed to CRIU through pipes (`stream.rs`); or every image is materialized.
//! 5. CRIU restores the tree detached (re-parented to init); the GPU step restores its GPU state, waits
//!    at the job restore's barrier if any ([`Flow::restore_phased`]), then unlocks it; if that fails
//!    (or the barrier says no) the restored tree is killed.
//! 6. CRIU's restore log is kept in the store's `logs/` folder; the temporary folder is removed.
//!
//! Nothing here changes the checkpoint: a failed restore can be tried again, and a checkpoint can be
//! restored again once the first copy has exited.

mod ids;
mod preflight;
mod premap;
pub(crate) mod stream;
mod uffd;
mod workdir;

pub use workdir::remove_stale_work_dirs;
use workdir::WorkDir;

pub use uffd::{available as uffd_available, FillStats};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{ms, save_log, CheckpointManifest, Flow, ImageTransfer};
use crate::dump::devices::PluginDir;
use crate::dump::{CriuOptions, FailureKind, RestoreRequest};
use crate::exit::{Classify, ExitStatus};
use crate::fault;
use crate::flows::guardian::Event;
use crate::freeze::{BeforeUnlock, RestoreRecord, RestoredTree};
use crate::interrupt::InterruptGuard;
use crate::proc as tree;
use crate::store::{CheckpointInfo, Store};

/// Name of CRIU's restore log in the images folder (and, prefixed with the id, in `logs/`).
pub const RESTORE_LOG: &str = "restore.log";

/// How long a zombie holding one of the tree's PIDs may take to be reaped before we call it a conflict.
const ZOMBIE_WAIT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot restore checkpoint {id}: PID {pid} is in use by {holder}{}", if *zombie { " (a zombie its parent has not reaped)" } else { "" })]
    PidInUse {
        id: String,
        pid: i32,
        /// `comm (pid N, parent M)` of the process holding the PID.
        holder: String,
        zombie: bool,
    },
    #[error("checkpoint {id}: {reason}")]
    BadManifest { id: String, reason: String },
    /// Copying the processes' memory through userfaultfd failed: the kernel refused a copy, CRIU's lazy-pages
    /// socket said something unexpected, or an image the copy needs was missing or unreadable.
    #[error("{0}")]
    Uffd(String),
    #[error("cannot restore checkpoint {id}: its memory pages need {}, and this node has {} available; free memory first (the checkpoint is intact)", crate::fmt::human_bytes(*need), crate::fmt::human_bytes(*available))]
    NotEnoughMemory {
        id: String,
        need: u64,
        available: u64,
    },
    #[error("interrupted by {signal} before anything was restored; the checkpoint is intact")]
    Interrupted { signal: String },
    #[error("restore of checkpoint {id}: {reason}")]
    Options { id: String, reason: String },
    #[error("cannot restore checkpoint {id}: its process held {path} open (reopened on restore), and {reason} here; the checkpoint is intact")]
    Device {
        id: String,
        path: String,
        reason: String,
    },
    #[error("cannot create a work folder for the images: {} ({source})", path.display())]
    WorkDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl Classify for Error {
    fn exit_status(&self) -> ExitStatus {
        match self {
            Error::PidInUse { .. } | Error::NotEnoughMemory { .. } | Error::Device { .. } => {
                ExitStatus::Conflict
            }
            Error::BadManifest { .. } => ExitStatus::CheckpointInvalid,
            Error::Uffd(_) => ExitStatus::Failure,
            Error::Interrupted { .. } => ExitStatus::Interrupted,
            Error::Options { .. } => ExitStatus::Usage,
            Error::WorkDir { source, .. } => crate::exit::io_exit_status(source),
        }
    }
}

impl ImageTransfer {
    /// How a restore moves the images unless told otherwise: `Uffd` where this process may use
    /// userfaultfd (0.6x plain `criu restore`'s time for 4 GiB here, against 1.3x streamed), else `Stream`.
    pub fn default_restore() -> ImageTransfer {
        if uffd::available() {
            ImageTransfer::Uffd
        } else {
            ImageTransfer::Stream
        }
    }
}

/// Which checkpoint to restore.
#[derive(Debug, Clone)]
pub enum Target {
    /// An id, or a name (its newest checkpoint).
    Checkpoint(String),
    /// The path of a checkpoint's manifest in the store (`restore --metadata PATH`).
    Manifest(PathBuf),
}

/// Timings of one restore, in milliseconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Timings {
    /// Reading and verifying the images out of the store into a work folder (0 when `streamed`).
    pub fetch: f64,
    /// CRIU's restore; when `streamed`, the images were read and verified out of the store meanwhile;
    /// through userfaultfd, until every page was in (the GPU step included, which ran meanwhile).
    pub restore: f64,
    /// CRIU read the images from the store through pipes ([`ImageTransfer::Stream`]).
    pub streamed: bool,
    /// The memory went into the processes through userfaultfd ([`ImageTransfer::Uffd`]): what was
    /// copied (the copy is part of `restore`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uffd: Option<uffd::FillStats>,
    /// Why the restore was staged instead of the transfer asked for (CRIU's premapping would not fit
    /// here: `premap.rs`); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staged_instead: Option<String>,
    /// The GPU step (restore + unlock, and a job restore's wait for the other members between them); 0
    /// without GPU state. Where the processes resume before all of their memory is in, it runs while the
    /// memory comes in.
    pub gpu: f64,
    /// From the start until the processes ran again (CRIU resumed them; a GPU process's device state
    /// is back only once the GPU step is done).
    pub resumed: Option<f64>,
    /// From the start until all of the processes' memory was in.
    pub memory_in: Option<f64>,
    /// From the start until the GPU step was done (before `memory_in` where it overlapped the memory's
    /// coming in: the GPU restore reads the device memory the driver staged in the processes' memory, and
    /// its faults are served first).
    pub gpu_done: f64,
    pub total: f64,
}

/// A finished restore.
#[derive(Debug, Clone)]
pub struct RestoreOutcome {
    pub id: String,
    /// The restored root's PID.
    pub pid: i32,
    /// CRIU's restore log, kept.
    pub log: Option<PathBuf>,
    pub timings: Timings,
    /// The GPU step's restore (`None` without GPU state).
    pub gpu: Option<RestoreRecord>,
}

impl Flow<'_> {
    /// Finds the checkpoint `target` names.
    pub fn find(&self, target: &Target) -> crate::Result<(CheckpointInfo, CheckpointManifest)> {
        let info = match target {
            Target::Checkpoint(id) => self.store.get(id)?,
            Target::Manifest(path) => self.store.get_by_manifest_path(path)?,
        };
        let manifest = CheckpointManifest::from_metadata(&info.metadata).map_err(|reason| {
            Error::BadManifest {
                id: info.id.clone(),
                reason,
            }
        })?;
        Ok((info, manifest))
    }

    /// Restores a checkpoint; see the module documentation for the order.
    pub fn restore(&mut self, target: &Target) -> crate::Result<RestoreOutcome> {
        self.restore_with(target, &CriuOptions::default())
    }

    /// [`Flow::restore`] with the CRIU flags given to the restore: its own (`--external`,
    /// `--criu-config`, ...) on top of the checkpoint's, and dump-time flags that must agree with the
    /// checkpoint's ([`CriuOptions::restore_options`]).
    pub fn restore_with(
        &mut self,
        target: &Target,
        given: &CriuOptions,
    ) -> crate::Result<RestoreOutcome> {
        self.restore_phased(target, given, None)
    }

    /// [`Flow::restore_with`] for a member of a job restore: once the tree's GPU state is restored, and
    /// before it is unlocked, the flow waits at `before_unlock` ([`BeforeUnlock`]) for the rest of the
    /// job; if that says no, the restored copy is killed (never unlocked) and the checkpoint kept.
    pub fn restore_phased(
        &mut self,
        target: &Target,
        given: &CriuOptions,
        before_unlock: Option<&BeforeUnlock<'_>>,
    ) -> crate::Result<RestoreOutcome> {
        let started = Instant::now();
        // From the moment CRIU starts creating processes, a signal is deferred until the copy is whole
        // (or killed): a half-restored copy must not be left behind.
        let interrupt = InterruptGuard::new();
        self.criu.check_permitted()?;
        let (info, manifest) = self.find(target)?;
        if let Some(c) = &manifest.container {
            // Its images are the runtime's: only the runtime can put the container back together.
            return Err(Error::Options {
                id: info.id.clone(),
                reason: format!(
                    "it is a checkpoint of {} container {}: restore it with --container ID",
                    c.runtime, c.id
                ),
            }
            .into());
        }
        let criu_options = manifest
            .options
            .criu
            .restore_options(given)
            .map_err(|reason| Error::Options {
                id: info.id.clone(),
                reason,
            })?
            .options;
        // CRIU gives every thread back its ID too: those must be free as well as the PIDs. A tree that
        // is a PID namespace of its own is restored into a new one, where every ID is free.
        let ids = ids::RecordedIds::of(self.store, &info, &manifest)?;
        check_pids_free(&info.id, &ids.host)?;
        let mut pids = ids.host_pids.clone();
        if let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") {
            preflight::check_host_memory(&info.id, manifest.sizes.pages_bytes, &meminfo)?;
        }
        let (images, staged_instead) =
            premap::transfer_for(self.images, self.store, &info, &ids.images)?;
        if let Some(why) = &staged_instead {
            tracing::warn!("restoring checkpoint {} staged: {why}", info.id);
        }
        let gpu_record = manifest.gpu_record()?;
        if ids.own_namespace && gpu_record.as_ref().is_some_and(|r| !r.processes.is_empty()) {
            // The GPU step finds its processes by the PIDs they had, which a new namespace changes.
            return Err(Error::Options {
                id: info.id.clone(),
                reason:
                    "its tree is a PID namespace of its own and holds GPU state: restoring GPU \
                         state into a new PID namespace is not supported"
                        .into(),
            }
            .into());
        }
        self.gpu.prepare_restore(gpu_record.as_ref())?;

        if let Some(dir) = self.store.local_dir() {
            // What killed restores left: a restore needs free space on the store's disk.
            match remove_stale_work_dirs(dir) {
                Ok(0) => {}
                Ok(n) => tracing::info!("removed {n} work folder(s) of interrupted restores"),
                Err(e) => tracing::debug!("looking for interrupted restores' work folders: {e}"),
            }
        }
        // The device files CRIU's devices plugin reopens: the same nodes must be here.
        preflight::check_devices(&info.id, &manifest.devices)?;
        // Mappings a forked child inherited from its CUDA parent are replaced by the plugin, too.
        let replace = !crate::detect::context::inherited_mappings(&manifest.detect).is_empty();
        let plugin = (!manifest.devices.is_empty() || replace)
            .then(|| PluginDir::for_restore(&manifest.devices, replace))
            .transpose()?;
        let criu_env = plugin.as_ref().map(PluginDir::env).unwrap_or_default();
        let work = WorkDir::create(self.store.local_dir(), &info.id)?;
        // Should this process die from here on, the guardian kills what CRIU created of the copy.
        self.watch.tell(&Event::Restore {
            pids: ids.host.clone(),
        })?;
        fault::at("restore.before-criu");
        if interrupt.interrupted() {
            return Err(Error::Interrupted {
                signal: crate::interrupt::last_signal().unwrap_or_else(|| "a signal".into()),
            }
            .into());
        }
        let req = RestoreRequest {
            images_dir: work.path(),
            log_file: RESTORE_LOG,
            options: &criu_options,
            stream: images == ImageTransfer::Stream,
            lazy_pages: false,
            post_restore: None,
            env: &criu_env,
        };
        let mut uffd_stats = None;
        // The GPU step: restore and unlock, after CRIU (while the memory comes in, when the processes
        // resume before it is all there: the GPU restore's faults are served first).
        let own_namespace = ids.own_namespace;
        let mut gpu_step = |pid: i32| {
            fault::at("restore.after-criu");
            let t = Instant::now();
            // A tree restored into a new PID namespace has new PIDs (and no GPU state: refused above).
            let tree_pids: Vec<i32> = if own_namespace {
                tree::process_tree(pid).iter().map(|p| p.pid).collect()
            } else {
                pids.clone()
            };
            let r = self.gpu.finish_restore(
                gpu_record.as_ref(),
                &RestoredTree {
                    root_pid: pid,
                    pids: &tree_pids,
                    before_unlock,
                },
            );
            (r, ms(t), ms(started))
        };
        let (fetch, restore_ms, restored, gpu_done, resumed, memory_in) = if images.uffd() {
            // The images without the memory userfaultfd fills (a few MiB), then CRIU with the fill at its
            // post-restore notification.
            let t = Instant::now();
            let plan = uffd::Plan::of(self.store, &info)?;
            self.store.materialize_selected(
                &info,
                work.path(),
                &|path, off, len| plan.keep(path, off, len),
                self.progress,
            )?;
            let fetch = ms(t);
            let t = Instant::now();
            let resume = if images == ImageTransfer::UffdFilled {
                uffd::Resume::Filled
            } else {
                uffd::Resume::Early
            };
            let hold = GuardianHold(self.watch);
            let out = uffd::restore(
                self.criu,
                &req,
                self.store,
                &info,
                &plan,
                self.progress,
                resume,
                &hold,
                &mut gpu_step,
            );
            let since = |at: Option<Instant>| at.map(|a| ms_between(started, a));
            match (&out.restored, out.filled) {
                (Err(_), Err(store_err)) => {
                    // A damaged chunk, or a copy the kernel refused, is why CRIU failed: say that.
                    keep_log(self.store, &info.id, work.path());
                    return Err(store_err.into());
                }
                (Ok(pid), Err(store_err)) => {
                    // Restored, but its memory did not come: it must not run on.
                    keep_log(self.store, &info.id, work.path());
                    kill_restored(*pid, &pids);
                    return Err(store_err.into());
                }
                (_, Ok(stats)) => uffd_stats = Some(stats),
            }
            let (resumed, memory_in) = (since(out.resumed), since(out.memory_in));
            (fetch, ms(t), out.restored, out.then, resumed, memory_in)
        } else if req.stream {
            // Fetching overlaps CRIU's restore: CRIU reads every image from the store's verified chunks.
            let t = Instant::now();
            let (restored, served) =
                stream::restore_streamed(self.criu, &req, self.store, &info, self.progress);
            let took = ms(t);
            if let (Err(_), Err(store_err)) = (&restored, served) {
                // A damaged chunk (or a store that cannot be read) is why CRIU failed: say that.
                keep_log(self.store, &info.id, work.path());
                return Err(store_err);
            }
            let at = Some(ms(started));
            (0.0, took, restored, None, at, at)
        } else {
            let t = Instant::now();
            self.store
                .materialize(&info.id, work.path(), self.progress)?;
            let fetch = ms(t);
            let t = Instant::now();
            let restored = self.criu.restore(&req);
            let at = Some(ms(started));
            (fetch, ms(t), restored, None, at, at)
        };
        let log = keep_log(self.store, &info.id, work.path());
        let pid = match restored {
            Ok(pid) => pid,
            Err(e) => {
                let e = match &log {
                    Some(l) => e.with_log_path(l.clone()),
                    None => e,
                };
                // A PID taken between our check and CRIU's fork: say by whom.
                if e.failure().map(|f| f.kind) == Some(FailureKind::PidInUse) {
                    if let Err(conflict) = check_pids_free_now(&info.id, &ids.host) {
                        tracing::debug!("CRIU: {e}");
                        return Err(conflict.into());
                    }
                }
                return Err(e.into());
            }
        };

        let (gpu, gpu_ms, gpu_done) = gpu_done.unwrap_or_else(|| gpu_step(pid));
        if ids.own_namespace {
            // Its PIDs in this namespace are new: the restored tree as it runs is the tree.
            pids = tree::process_tree(pid).iter().map(|p| p.pid).collect();
        }
        let gpu = match gpu {
            Ok(v) => v,
            Err(e) => {
                // A copy whose GPU state did not come back (or whose job restore aborted) must not run on.
                kill_restored(pid, &pids);
                return Err(e.into());
            }
        };
        Ok(RestoreOutcome {
            id: info.id,
            pid,
            log,
            timings: Timings {
                fetch,
                restore: restore_ms,
                streamed: req.stream,
                uffd: uffd_stats,
                staged_instead,
                gpu: gpu_ms,
                resumed,
                memory_in,
                gpu_done,
                total: ms(started),
            },
            gpu,
        })
    }
}

impl ImageTransfer {
    /// Whether a restore copies the memory through userfaultfd.
    fn uffd(self) -> bool {
        matches!(self, ImageTransfer::Uffd | ImageTransfer::UffdFilled)
    }
}

/// Milliseconds from `a` to `b`.
fn ms_between(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64() * 1000.0
}

/// The guardian holds a copy of each userfaultfd while the processes run before their memory is in.
struct GuardianHold<'w>(&'w dyn crate::flows::Watch);

impl uffd::Hold for GuardianHold<'_> {
    fn hold(&self, fds: &[std::os::fd::RawFd]) {
        if let Err(e) = self.0.tell(&Event::Memory { fds: fds.to_vec() }) {
            tracing::warn!("the guardian cannot hold the restore's userfaultfds: {e}");
        }
    }

    fn release(&self) {
        if let Err(e) = self.0.tell(&Event::MemoryIn) {
            tracing::debug!("telling the guardian the memory is in: {e}");
        }
    }
}

/// Kills a restored tree that must not run on (its memory or GPU state did not come back).
fn kill_restored(root: i32, recorded: &[i32]) {
    let left = tree::kill_tree(&tree_of(root, recorded), Duration::from_secs(10));
    if !left.is_empty() {
        tracing::error!("restored processes {left:?} could not be stopped");
    }
}

/// The restored tree as it runs now, plus the recorded PIDs (a process may have exited already).
fn tree_of(root: i32, recorded: &[i32]) -> Vec<i32> {
    let mut pids: Vec<i32> = tree::process_tree(root).iter().map(|p| p.pid).collect();
    for p in recorded {
        if !pids.contains(p) {
            pids.push(*p);
        }
    }
    pids
}

/// Copies CRIU's restore log into the store's `logs/` folder as `ID.restore-<unix ms>.log`.
fn keep_log(store: &Store, id: &str, work: &Path) -> Option<PathBuf> {
    let src = work.join(RESTORE_LOG);
    if !src.exists() {
        return None;
    }
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0);
    save_log(
        store.local_dir(),
        &src,
        &format!("{id}.restore-{stamp}.log"),
    )
}

/// Fails when a PID of the tree is held by a live process, after giving dying ones (exiting, or zombies
/// waiting to be reaped: the checkpointed process itself, right after a checkpoint) [`ZOMBIE_WAIT`] to
/// free it.
fn check_pids_free(id: &str, pids: &[i32]) -> Result<(), Error> {
    let dying = || {
        pids.iter()
            .copied()
            .filter(|p| tree::stat(*p).is_some_and(|s| s.is_dying()))
            .collect::<Vec<_>>()
    };
    tree::wait_until(ZOMBIE_WAIT, dying);
    check_pids_free_now(id, pids)
}

fn check_pids_free_now(id: &str, pids: &[i32]) -> Result<(), Error> {
    for &pid in pids {
        if let Some(s) = tree::stat(pid) {
            return Err(Error::PidInUse {
                id: id.to_string(),
                pid,
                holder: format!("{} (pid {pid}, parent {})", s.comm, s.ppid),
                zombie: s.is_zombie(),
            });
        }
    }
    Ok(())
}
