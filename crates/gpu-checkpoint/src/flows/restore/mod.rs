//! The restore of a process tree: the pipeline's restore target for CRIU's images (`flows/pipeline`
//! owns the order: find, refuse, GPU check, work folder, restore, GPU restore + unlock).
//!
//! What this target adds, and why:
//! 1. Find the checkpoint (id, name, or the path of its manifest) and read its manifest; a container's
//!    is refused (only its runtime can put it back together).
//! 2. Refuse early when a PID of the tree is taken: CRIU restores every process under its original PID.
//!    A zombie holding one is waited for a little (its parent may be about to reap it; init does so
//!    lazily on some systems), anything else is a conflict naming the PID and its holder. Refuse, too,
//!    when the node lacks the memory, or CRIU's premapping would not fit (then staged instead).
//! 3. (The pipeline: the GPU step checks this node can take the GPU state.)
//! 4. The images go to CRIU one of three ways ([`ImageTransfer`]), every chunk verified first: by default
//!    the images without the processes' private memory are materialized into a private folder and the
//!    memory is copied into the processes through userfaultfd while CRIU holds them stopped (`uffd/`);
//!    or every image is streamed to CRIU through pipes (`pipeline/serve.rs`); or every image is
//!    materialized.
//! 5. CRIU restores the tree detached (re-parented to init); the GPU step restores its GPU state, waits
//!    at the job restore's barrier if any ([`Flow::restore_phased`]), then unlocks it; if that fails
//!    (or the barrier says no) the restored tree is killed.
//! 6. CRIU's restore log is kept in the store's `logs/` folder; the work folder is removed.
//!
//! Nothing here changes the checkpoint: a failed restore can be tried again, and a checkpoint can be
//! restored again once the first copy has exited.

mod ids;
mod preflight;
mod premap;
mod uffd;
mod workdir;

pub use workdir::remove_stale_work_dirs;
use workdir::WorkDir;

pub use uffd::{available as uffd_available, FillStats};

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::pipeline::{
    Discard, Found, GpuRestore, GpuStep, RestoreContext, RestoreTarget, Restored,
};
use super::{ms, save_log, CheckpointManifest, Flow, ImageTransfer, Watch};
use crate::dump::devices::PluginDir;
use crate::dump::{Criu, CriuOptions, FailureKind, RestoreRequest};
use crate::exit::{Classify, ExitStatus};
use crate::flows::guardian::Event;
use crate::freeze::{BeforeUnlock, GpuRecord, RestoreRecord, RestoredTree};
use crate::proc::Processes;
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
        find(self.store, target)
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
        let mut tree = CriuRestore::new((self.criu, self.procs), self.images, target, given);
        let out = self.pipeline().restore(&mut tree, before_unlock)?;
        let t = out.timings;
        Ok(RestoreOutcome {
            id: out.id,
            pid: out.pid,
            log: tree.log,
            timings: Timings {
                fetch: t.fetch,
                restore: t.restore,
                streamed: tree.images == ImageTransfer::Stream,
                uffd: tree.uffd_stats,
                staged_instead: tree.staged_instead,
                gpu: t.gpu,
                resumed: tree.resumed,
                memory_in: tree.memory_in,
                gpu_done: t.gpu_done,
                total: t.total,
            },
            gpu: out.gpu,
        })
    }
}

/// The checkpoint `target` names in `store`, and its manifest.
pub(in crate::flows) fn find(
    store: &Store,
    target: &Target,
) -> crate::Result<(CheckpointInfo, CheckpointManifest)> {
    let info = match target {
        Target::Checkpoint(id) => store.get(id)?,
        Target::Manifest(path) => store.get_by_manifest_path(path)?,
    };
    let manifest =
        CheckpointManifest::from_metadata(&info.metadata).map_err(|reason| Error::BadManifest {
            id: info.id.clone(),
            reason,
        })?;
    Ok((info, manifest))
}

/// A process tree CRIU restores from the checkpoint's images: the pipeline's target for
/// [`Flow::restore`].
struct CriuRestore<'a> {
    criu: &'a dyn Criu,
    procs: &'a dyn Processes,
    /// How the images go to CRIU: as asked, then as this checkpoint allows.
    images: ImageTransfer,
    target: &'a Target,
    given: &'a CriuOptions,
    /// What [`RestoreTarget::check`] decided.
    criu_options: CriuOptions,
    ids: Option<ids::RecordedIds>,
    staged_instead: Option<String>,
    plugin: Option<PluginDir>,
    work: Option<WorkDir>,
    /// What the restore left: CRIU's log kept, and what userfaultfd copied.
    log: Option<PathBuf>,
    uffd_stats: Option<FillStats>,
    /// When the processes ran again, and when all of their memory was in (ms from the start).
    resumed: Option<f64>,
    memory_in: Option<f64>,
    /// The restored tree's PIDs: the recorded ones, or (a new PID namespace) those it runs with.
    pids: Vec<i32>,
}

impl<'a> CriuRestore<'a> {
    fn new(
        (criu, procs): (&'a dyn Criu, &'a dyn Processes),
        images: ImageTransfer,
        target: &'a Target,
        given: &'a CriuOptions,
    ) -> Self {
        CriuRestore {
            criu,
            procs,
            images,
            target,
            given,
            criu_options: CriuOptions::default(),
            ids: None,
            staged_instead: None,
            plugin: None,
            work: None,
            log: None,
            uffd_stats: None,
            resumed: None,
            memory_in: None,
            pids: Vec::new(),
        }
    }

    fn ids(&self) -> &ids::RecordedIds {
        self.ids.as_ref().expect("checked")
    }
}

impl<'a> RestoreTarget<'a> for CriuRestore<'a> {
    fn find(&mut self, store: &Store) -> crate::Result<(CheckpointInfo, CheckpointManifest)> {
        self.criu.check_permitted()?;
        let (info, manifest) = find(store, self.target)?;
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
        Ok((info, manifest))
    }

    fn check(&mut self, found: &Found<'_>, gpu_record: Option<&GpuRecord>) -> crate::Result<()> {
        let (store, info, manifest) = (found.store, found.info, found.manifest);
        self.criu_options = manifest
            .options
            .criu
            .restore_options(self.given)
            .map_err(|reason| Error::Options {
                id: info.id.clone(),
                reason,
            })?
            .options;
        // CRIU gives every thread back its ID too: those must be free as well as the PIDs. A tree that
        // is a PID namespace of its own is restored into a new one, where every ID is free.
        let ids = ids::RecordedIds::of(store, info, manifest)?;
        check_pids_free(self.procs, &info.id, &ids.host)?;
        self.pids = ids.host_pids.clone();
        if let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") {
            preflight::check_host_memory(&info.id, manifest.sizes.pages_bytes, &meminfo)?;
        }
        let (images, staged_instead) = premap::transfer_for(self.images, store, info, &ids.images)?;
        if let Some(why) = &staged_instead {
            tracing::warn!("restoring checkpoint {} staged: {why}", info.id);
        }
        (self.images, self.staged_instead) = (images, staged_instead);
        if ids.own_namespace && gpu_record.is_some_and(|r| !r.processes.is_empty()) {
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
        self.ids = Some(ids);
        Ok(())
    }

    fn prepare(&mut self, found: &Found<'_>) -> crate::Result<PathBuf> {
        let (store, info, manifest) = (found.store, found.info, found.manifest);
        if let Some(dir) = store.local_dir() {
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
        let replace = !manifest.detect.inherited_mappings().is_empty();
        self.plugin = (!manifest.devices.is_empty() || replace)
            .then(|| PluginDir::for_restore(&manifest.devices, replace))
            .transpose()?;
        let work = WorkDir::create(store.local_dir(), &info.id)?;
        let path = work.path().to_path_buf();
        self.work = Some(work);
        Ok(path)
    }

    fn tell(&mut self, watch: &dyn Watch, _work: &Path) -> crate::Result<()> {
        // Should this process die from here on, the guardian kills what CRIU created of the copy.
        watch.tell(&Event::Restore {
            pids: self.ids().host.clone(),
        })?;
        Ok(())
    }

    fn restore(
        &mut self,
        ctx: &RestoreContext<'_>,
        gpu: &mut GpuStep<'_>,
    ) -> crate::Result<Restored<'a>> {
        let (store, info, progress, work) = (ctx.store, ctx.info, ctx.progress, ctx.work);
        let criu_env = self.plugin.as_ref().map(PluginDir::env).unwrap_or_default();
        let req = RestoreRequest {
            images_dir: work,
            log_file: RESTORE_LOG,
            options: &self.criu_options,
            stream: self.images == ImageTransfer::Stream,
            lazy_pages: false,
            post_restore: None,
            env: &criu_env,
        };
        let criu_done = |at: &mut Self| {
            let now = Some(ms(ctx.started));
            (at.resumed, at.memory_in) = (now, now);
        };
        let (fetch, restored) = if self.images.uffd() {
            // The images without the memory userfaultfd fills (a few MiB), then CRIU with the fill at its
            // post-restore notification.
            let t = Instant::now();
            let plan = uffd::Plan::of(store, info)?;
            store.materialize_selected(
                info,
                work,
                &|path, off, len| plan.keep(path, off, len),
                progress,
            )?;
            let fetch = ms(t);
            let resume = if self.images == ImageTransfer::UffdFilled {
                uffd::Resume::Filled
            } else {
                uffd::Resume::Early
            };
            // The GPU step, right after CRIU: while the memory comes in, when the processes resume
            // before it is all there (the GPU restore's faults are served first).
            let (procs, own_namespace, pids) = (self.procs, self.ids().own_namespace, &self.pids);
            let gpu_step = |pid: i32| {
                // A tree restored into a new PID namespace has new PIDs (and no GPU state: refused
                // in `check`).
                let tree_pids: Vec<i32> = if own_namespace {
                    procs.tree(pid).iter().map(|p| p.pid).collect()
                } else {
                    pids.clone()
                };
                gpu.run(pid, |step| finish_gpu(step, &tree_pids));
            };
            let hold = GuardianHold(ctx.watch);
            let out = uffd::restore(
                self.criu, &req, store, info, &plan, progress, resume, &hold, gpu_step,
            );
            let since = |at: Option<Instant>| at.map(|a| ms_between(ctx.started, a));
            (self.resumed, self.memory_in) = (since(out.resumed), since(out.memory_in));
            let restored = out.restored;
            match (&restored, out.filled) {
                (Err(_), Err(store_err)) => {
                    // A damaged chunk, or a copy the kernel refused, is why CRIU failed: say that.
                    keep_log(store, &info.id, work);
                    return Err(store_err.into());
                }
                (Ok(pid), Err(store_err)) => {
                    // Restored, but its memory did not come: it must not run on.
                    keep_log(store, &info.id, work);
                    kill_restored(self.procs, *pid, &self.pids);
                    return Err(store_err.into());
                }
                (_, Ok(stats)) => self.uffd_stats = Some(stats),
            }
            (fetch, restored)
        } else if req.stream {
            // Fetching overlaps CRIU's restore: CRIU reads every image from the store's verified chunks.
            let (restored, served) =
                super::pipeline::restore_streamed(self.criu, &req, store, info, progress);
            if let (Err(_), Err(store_err)) = (&restored, served) {
                // A damaged chunk (or a store that cannot be read) is why CRIU failed: say that.
                keep_log(store, &info.id, work);
                return Err(store_err);
            }
            criu_done(self);
            (0.0, restored)
        } else {
            let t = Instant::now();
            store.materialize(&info.id, work, progress)?;
            let restored = self.criu.restore(&req);
            criu_done(self);
            (ms(t), restored)
        };
        self.log = keep_log(store, &info.id, work);
        let pid = match restored {
            Ok(pid) => pid,
            Err(e) => {
                let e = match &self.log {
                    Some(l) => e.with_log_path(l.clone()),
                    None => e,
                };
                // A PID taken between our check and CRIU's fork: say by whom.
                if e.failure().map(|f| f.kind) == Some(FailureKind::PidInUse) {
                    let host = &self.ids().host;
                    if let Err(conflict) = check_pids_free_now(self.procs, &info.id, host) {
                        tracing::debug!("CRIU: {e}");
                        return Err(conflict.into());
                    }
                }
                return Err(e.into());
            }
        };
        if self.ids().own_namespace {
            // Its PIDs in this namespace are new: the restored tree as it runs is the tree.
            self.pids = self.procs.tree(pid).iter().map(|p| p.pid).collect();
        }
        Ok(Restored {
            root_pid: pid,
            fetch_ms: fetch,
            discard: Box::new(KillRestored {
                procs: self.procs,
                root: pid,
                pids: self.pids.clone(),
                armed: true,
            }),
        })
    }

    fn restore_gpu(&mut self, step: GpuRestore<'_>) -> crate::Result<Option<RestoreRecord>> {
        finish_gpu(step, &self.pids)
    }
}

/// The GPU step's restore + unlock of the tree `pids`.
fn finish_gpu(step: GpuRestore<'_>, pids: &[i32]) -> crate::Result<Option<RestoreRecord>> {
    let tree = RestoredTree {
        root_pid: step.root_pid,
        pids,
        before_unlock: step.before_unlock,
    };
    Ok(step.gpu.finish_restore(step.record.as_ref(), &tree)?)
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
struct GuardianHold<'w>(&'w dyn Watch);

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

/// A restored tree, killed when dropped unless kept: its memory or GPU state did not come back.
struct KillRestored<'a> {
    procs: &'a dyn Processes,
    root: i32,
    pids: Vec<i32>,
    armed: bool,
}

impl Discard for KillRestored<'_> {
    fn keep(mut self: Box<Self>) {
        self.armed = false;
    }
}

impl Drop for KillRestored<'_> {
    fn drop(&mut self) {
        if self.armed {
            kill_restored(self.procs, self.root, &self.pids);
        }
    }
}

/// Kills a restored tree that must not run on (its memory or GPU state did not come back).
fn kill_restored(procs: &dyn Processes, root: i32, recorded: &[i32]) {
    let left = procs
        .hold(&tree_of(procs, root, recorded))
        .kill(Duration::from_secs(10));
    if !left.is_empty() {
        tracing::error!("restored processes {left:?} could not be stopped");
    }
}

/// The restored tree as it runs now, plus the recorded PIDs (a process may have exited already).
fn tree_of(procs: &dyn Processes, root: i32, recorded: &[i32]) -> Vec<i32> {
    let mut pids: Vec<i32> = procs.tree(root).iter().map(|p| p.pid).collect();
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
fn check_pids_free(procs: &dyn Processes, id: &str, pids: &[i32]) -> Result<(), Error> {
    let dying = || {
        pids.iter()
            .copied()
            .filter(|p| procs.stat(*p).is_some_and(|s| s.is_dying()))
            .collect::<Vec<_>>()
    };
    crate::proc::wait_until(ZOMBIE_WAIT, dying);
    check_pids_free_now(procs, id, pids)
}

fn check_pids_free_now(procs: &dyn Processes, id: &str, pids: &[i32]) -> Result<(), Error> {
    for &pid in pids {
        if let Some(s) = procs.stat(pid) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::FakeProcesses;

    #[test]
    fn a_pid_held_by_a_live_process_is_a_conflict_naming_its_holder() {
        let procs = FakeProcesses::default();
        procs.add(300, 1, 'S');
        let e = check_pids_free(&procs, "ck", &[299, 300]).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::PidInUse {
                    pid: 300,
                    zombie: false,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("fake300 (pid 300, parent 1)"), "{e}");
    }

    #[test]
    fn a_zombie_holding_a_pid_is_waited_for_until_its_parent_reaps_it() {
        let procs = FakeProcesses::default();
        procs.add(310, 1, 'Z');
        let reaper = {
            let procs = procs.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                procs.reap(310);
            })
        };
        check_pids_free(&procs, "ck", &[310]).unwrap();
        reaper.join().unwrap();
        assert_eq!(procs.state(310), None);
    }
}
