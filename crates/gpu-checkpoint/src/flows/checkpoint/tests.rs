//! The flows' ordering and undo, with the fake CRIU, a recording GPU hook, a real store in a temporary
//! folder, and real (harmless) child processes as the trees.

use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;

use super::*;
use crate::dump::{FakeCriu, FakeCriuCall};
use crate::flows::guardian::Event;
use crate::flows::pipeline::GpuThawGuard;
use crate::flows::{logs_dir, save_log, ImageTransfer};
use crate::freeze::step::{RecordedProcess, RECORD_SCHEMA};
use crate::freeze::ThawRecord;
use crate::freeze::{FreezeContext, GpuBackend, GpuHook, GpuRecord, RestoreRecord, RestoredTree};
use crate::restore::Target;
use crate::store::{NoProgress, StoreOptions};

/// A GPU hook that records its calls (and how many CRIU calls had happened at each), and fails on demand.
pub(super) struct RecordingGpu {
    criu: Arc<FakeCriu>,
    events: Arc<Mutex<Vec<(String, usize)>>>,
    fail_freeze: bool,
    fail_thaw: bool,
    fail_finish: bool,
    /// What the last freeze returned, for restore to compare against.
    frozen: Option<GpuRecord>,
    /// A process to look at when thawing: whether it was stopped then.
    pub(super) watch: Option<i32>,
    pub(super) stopped_at_thaw: Option<bool>,
}

impl RecordingGpu {
    pub(super) fn new(criu: &Arc<FakeCriu>) -> Self {
        RecordingGpu {
            criu: Arc::clone(criu),
            events: Arc::default(),
            fail_freeze: false,
            fail_thaw: false,
            fail_finish: false,
            frozen: None,
            watch: None,
            stopped_at_thaw: None,
        }
    }

    fn record(&self, what: &str) {
        let n = self.criu.calls().len();
        self.events.lock().unwrap().push((what.to_string(), n));
    }

    pub(super) fn events(&self) -> Vec<(String, usize)> {
        self.events.lock().unwrap().clone()
    }
}

/// What [`RecordingGpu`] "freezes" in the tree rooted at `pid`: one process, the root, recognisable in
/// the manifest and in what restore hands back.
fn frozen_record(pid: i32) -> GpuRecord {
    GpuRecord {
        schema: RECORD_SCHEMA,
        ordered: false,
        backend: GpuBackend::Fake,
        driver_version: None,
        gpus: vec![],
        lock_timeout_ms: None,
        processes: vec![RecordedProcess {
            pid,
            gpus: vec![],
            memory: vec![],
            steps: vec![],
        }],
        skipped: vec![],
        timings: Default::default(),
        thaw: None,
    }
}

fn injected() -> crate::freeze::Error {
    crate::freeze::Error::NoGpuStep {
        strategy: StrategyName::CudaDriver,
    }
}

impl GpuHook for RecordingGpu {
    fn name(&self) -> &str {
        "recording"
    }
    fn freeze(
        &mut self,
        ctx: &FreezeContext<'_>,
    ) -> Result<Option<GpuRecord>, crate::freeze::Error> {
        self.record("freeze");
        assert!(ctx.pids.contains(&ctx.root_pid));
        if self.fail_freeze {
            return Err(injected());
        }
        self.frozen = Some(frozen_record(ctx.root_pid));
        Ok(self.frozen.clone())
    }
    fn thaw(&mut self) -> Result<Option<ThawRecord>, crate::freeze::Error> {
        self.record("thaw");
        if let Some(pid) = self.watch {
            self.stopped_at_thaw = Some(tree::stat(pid).is_some_and(|s| s.state == 'T'));
        }
        if self.fail_thaw {
            return Err(injected());
        }
        Ok(None)
    }
    fn committed(&mut self) {
        self.record("committed");
    }
    fn prepare_restore(&mut self, record: Option<&GpuRecord>) -> Result<(), crate::freeze::Error> {
        self.record("prepare");
        assert_eq!(
            record,
            self.frozen.as_ref(),
            "gets back what freeze returned"
        );
        assert!(record.is_some());
        Ok(())
    }
    fn finish_restore(
        &mut self,
        _record: Option<&GpuRecord>,
        tree: &RestoredTree<'_>,
    ) -> Result<Option<RestoreRecord>, crate::freeze::Error> {
        self.record("finish");
        assert!(tree.root_pid > 0);
        if self.fail_finish {
            return Err(injected());
        }
        tree.restored().map(|()| None)
    }
}

/// A child that sleeps; reaped on drop so its PID is freed.
pub(super) struct Sleeper(Child);

/// `sleep 60` as a service runs: leading its own session, away from any terminal (detect asks for
/// --shell-job otherwise, as CRIU does).
fn sleep_command() -> Command {
    use std::process::Stdio;
    let mut cmd = Command::new("sleep");
    cmd.arg("60")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    tree::in_own_session(&mut cmd);
    cmd
}

impl Sleeper {
    pub(super) fn start() -> Sleeper {
        Sleeper(sleep_command().spawn().unwrap())
    }
    pub(super) fn pid(&self) -> i32 {
        self.0.id() as i32
    }
    pub(super) fn running(&self) -> bool {
        tree::stat(self.pid()).is_some_and(|s| !s.is_dying() && s.state != 'T')
    }
    pub(super) fn reap(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        self.reap();
    }
}

/// A guardian stand-in: records what the flow tells it, and refuses to hear on demand.
#[derive(Default)]
struct Told {
    events: Mutex<Vec<Event>>,
    deaf: bool,
}

impl crate::flows::Watch for Told {
    fn tell(&self, event: &Event) -> Result<(), crate::flows::guardian::Error> {
        if self.deaf {
            return Err(crate::flows::guardian::Error::Lost("deaf".into()));
        }
        self.events.lock().unwrap().push(event.clone());
        Ok(())
    }
}

pub(super) struct Scene {
    _dir: tempfile::TempDir,
    pub(super) store: Store,
    pub(super) criu: Arc<FakeCriu>,
    pub(super) images: ImageTransfer,
    told: Told,
}

impl Scene {
    pub(super) fn new() -> Scene {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("store"), StoreOptions::default()).unwrap();
        Scene {
            _dir: dir,
            store,
            criu: Arc::new(FakeCriu::new()),
            images: ImageTransfer::Stream,
            told: Told::default(),
        }
    }

    /// A scene with a tree to checkpoint and a GPU hook that records what it is asked.
    pub(super) fn with_tree() -> (Scene, Sleeper, RecordingGpu) {
        let s = Scene::new();
        let gpu = RecordingGpu::new(&s.criu);
        (s, Sleeper::start(), gpu)
    }

    /// [`Scene::with_tree`] whose CRIU leaves a file the store refuses (the commit fails after the dump),
    /// the GPU hook watching the tree.
    pub(super) fn with_tree_and_odd_file() -> (Scene, Sleeper, RecordingGpu) {
        let (s, p, mut gpu) = Scene::with_tree();
        s.criu.leave_odd_file();
        gpu.watch = Some(p.pid());
        (s, p, gpu)
    }

    /// Nothing of a failed checkpoint is kept: no checkpoint, no staging folder.
    pub(super) fn assert_nothing_kept(&self) {
        assert!(self.store.list().unwrap().is_empty());
        assert!(self.staging_empty());
    }

    pub(super) fn told(&self) -> Vec<Event> {
        self.told.events.lock().unwrap().clone()
    }

    pub(super) fn checkpoint(
        &self,
        gpu: &mut RecordingGpu,
        opts: &CheckpointOptions,
    ) -> crate::Result<CheckpointOutcome> {
        self.checkpoint_phased(gpu, opts, &Alone)
    }

    /// The flows on this scene: its CRIU, store and guardian, the live processes.
    fn flow<'a>(&'a self, gpu: &'a mut RecordingGpu) -> Flow<'a> {
        Flow {
            criu: &*self.criu,
            gpu,
            store: &self.store,
            progress: &NoProgress,
            images: self.images,
            watch: &self.told,
            procs: &crate::proc::Live,
        }
    }

    pub(super) fn checkpoint_phased(
        &self,
        gpu: &mut RecordingGpu,
        opts: &CheckpointOptions,
        phases: &dyn Phases,
    ) -> crate::Result<CheckpointOutcome> {
        self.flow(gpu).checkpoint_phased(opts, phases)
    }

    fn restore(
        &self,
        gpu: &mut RecordingGpu,
        id: &str,
    ) -> crate::Result<crate::restore::RestoreOutcome> {
        self.flow(gpu).restore(&Target::Checkpoint(id.to_string()))
    }

    /// Checkpoints a sleeping process (which then exits), and starts another that the fake's restores
    /// name as the restored copy. Returns the checkpoint id and that stand-in.
    fn checkpoint_and_stand_in(&self, gpu: &mut RecordingGpu) -> (String, Sleeper) {
        let mut p = Sleeper::start();
        let id = self
            .checkpoint(gpu, &CheckpointOptions::new(p.pid()))
            .unwrap()
            .info
            .id;
        p.reap();
        let copy = Sleeper::start();
        self.criu.restore_as(copy.pid());
        (id, copy)
    }

    pub(super) fn staging_empty(&self) -> bool {
        let staging = self.store.local_dir().unwrap().join("staging");
        !staging.exists() || std::fs::read_dir(staging).unwrap().next().is_none()
    }
}

pub(super) fn names(events: &[(String, usize)]) -> Vec<&str> {
    events.iter().map(|e| e.0.as_str()).collect()
}

#[test]
fn default_checkpoint_freezes_before_the_dump_and_stops_the_tree_after_the_commit() {
    let (s, mut p, mut gpu) = Scene::with_tree();
    let mut opts = CheckpointOptions::new(p.pid());
    opts.name = Some("job".into());
    let out = s.checkpoint(&mut gpu, &opts).unwrap();
    assert_eq!(
        gpu.events(),
        vec![("freeze".to_string(), 0), ("committed".to_string(), 1)],
        "no thaw: the checkpoint is durable (after the dump), then the tree is killed"
    );
    assert_eq!(
        s.criu.calls(),
        vec![FakeCriuCall::Dump {
            pid: p.pid(),
            images_dir: s
                .store
                .local_dir()
                .unwrap()
                .join("staging")
                .join(&out.info.id),
            after: AfterDump::Stop,
            options: CriuOptions::default(),
            stream: true,
        }]
    );
    assert!(out.stopped && !p.running());
    p.reap();
    let listed = s.store.list().unwrap();
    assert_eq!(listed.len(), 1);
    let m = CheckpointManifest::from_metadata(&listed[0].metadata).unwrap();
    assert_eq!(m.root_pid, p.pid());
    assert_eq!(m.gpu_step, "recording");
    assert_eq!(m.gpu_record().unwrap(), Some(frozen_record(p.pid())));
    assert_eq!(m.process_tree[0].comm, "sleep");
    assert_eq!(m.criu.version.major, 4);
    assert!(m.sizes.pages_bytes > 0 && m.sizes.image_files >= 3);
    assert!(listed[0].files.iter().any(|f| f.path == DUMP_LOG));
    assert!(s.staging_empty());
}

#[test]
fn failed_dump_thaws_keeps_the_tree_running_and_stores_nothing() {
    // Streamed, the fake fails after its images went to the store; staged, before writing any.
    for images in [ImageTransfer::Stream, ImageTransfer::Staged] {
        failed_dump_case(images);
    }
}

fn failed_dump_case(images: ImageTransfer) {
    let mut s = Scene::new();
    s.images = images;
    let p = Sleeper::start();
    s.criu
        .fail_dumps("Unable to write pages: No space left on device");
    let mut gpu = RecordingGpu::new(&s.criu);
    let err = s
        .checkpoint(&mut gpu, &CheckpointOptions::new(p.pid()))
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Storage, "{err}");
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    assert!(p.running());
    s.assert_nothing_kept();
    // The log left the staging folder before it went, and the error points at it.
    let f = match &err {
        crate::Error::Dump(e) => e.failure().unwrap().clone(),
        other => panic!("{other}"),
    };
    let log = f.log.unwrap();
    assert!(
        log.starts_with(logs_dir(s.store.local_dir().unwrap())),
        "{}",
        log.display()
    );
    assert!(std::fs::read_to_string(&log)
        .unwrap()
        .contains("No space left"));
    assert!(err.to_string().contains("CRIU log:"));
}

#[test]
fn failed_store_write_continues_the_stopped_tree_and_thaws() {
    let (s, p, mut gpu) = Scene::with_tree_and_odd_file();
    let err = s
        .checkpoint(&mut gpu, &CheckpointOptions::new(p.pid()))
        .unwrap_err();
    assert!(matches!(err, crate::Error::Store(_)), "{err}");
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    // Continued first: the GPU restore runs in the processes themselves, which a stopped one cannot do.
    assert_eq!(gpu.stopped_at_thaw, Some(false));
    // The fake left the tree stopped like CRIU's leave_stopped; the flow continued it.
    assert!(tree::wait_until(Duration::from_secs(5), || {
        if p.running() {
            vec![]
        } else {
            vec![p.pid()]
        }
    })
    .is_empty());
    s.assert_nothing_kept();
}

#[test]
fn the_gpu_guard_thaws_once_unless_committed() {
    let criu = Arc::new(FakeCriu::new());
    let mut gpu = RecordingGpu::new(&criu);
    drop(GpuThawGuard::new(&mut gpu));
    assert_eq!(names(&gpu.events()), ["thaw"], "dropped: thawed");

    let mut gpu = RecordingGpu::new(&criu);
    gpu.fail_thaw = true;
    let mut guard = GpuThawGuard::new(&mut gpu);
    assert_eq!(guard.name(), "recording");
    assert!(guard.thaw().is_err());
    drop(guard);
    assert_eq!(
        names(&gpu.events()),
        ["thaw"],
        "a failed explicit thaw is not tried again"
    );

    let mut gpu = RecordingGpu::new(&criu);
    GpuThawGuard::new(&mut gpu).committed();
    assert_eq!(names(&gpu.events()), ["committed"], "never thawed");

    let mut gpu = RecordingGpu::new(&criu);
    let mut guard = GpuThawGuard::new(&mut gpu);
    guard.thaw().unwrap();
    guard.committed();
    assert_eq!(
        names(&gpu.events()),
        ["thaw"],
        "thawed: nothing left frozen to keep"
    );
}

#[test]
fn the_continue_guard_continues_a_stopped_tree_unless_disarmed() {
    let p = Sleeper::start();
    let stop = || {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(p.pid(), libc::SIGSTOP) };
        let stopped = tree::wait_until(Duration::from_secs(5), || {
            if p.running() {
                vec![p.pid()]
            } else {
                vec![]
            }
        });
        assert!(stopped.is_empty(), "SIGSTOP took no effect");
    };
    stop();
    drop(ContinueGuard::new(
        &crate::proc::Live,
        &[p.pid()],
        &[],
        true,
    ));
    assert!(p.running(), "dropped: continued");

    stop();
    assert_eq!(
        ContinueGuard::new(&crate::proc::Live, &[p.pid()], &[], true)
            .disarm()
            .pids(),
        vec![p.pid()]
    );
    drop(ContinueGuard::new(
        &crate::proc::Live,
        &[p.pid()],
        &[],
        false,
    ));
    std::thread::sleep(Duration::from_millis(50));
    assert!(!p.running(), "disarmed, or never stopped: left alone");
}

#[test]
fn failed_freeze_never_dumps() {
    let (s, p, mut gpu) = Scene::with_tree();
    gpu.fail_freeze = true;
    s.checkpoint(&mut gpu, &CheckpointOptions::new(p.pid()))
        .unwrap_err();
    assert!(s.criu.calls().is_empty());
    assert_eq!(names(&gpu.events()), ["freeze"]);
    assert!(p.running());
    s.assert_nothing_kept();
}

#[test]
fn gone_process_and_busy_pid_are_refused_before_anything() {
    let s = Scene::new();
    let mut p = Sleeper::start();
    let pid = p.pid();
    let _held = lock_pid(pid).unwrap();
    let mut gpu = RecordingGpu::new(&s.criu);
    let err = s
        .checkpoint(&mut gpu, &CheckpointOptions::new(pid))
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Conflict, "{err}");
    p.reap();
    let err = s
        .checkpoint(&mut gpu, &CheckpointOptions::new(pid))
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::NoSuchProcess, "{err}");
    assert!(gpu.events().is_empty() && s.criu.calls().is_empty());
}

#[test]
fn restore_refuses_a_taken_pid_and_a_failed_restore_keeps_the_checkpoint() {
    let (s, p, mut gpu) = Scene::with_tree();
    let mut opts = CheckpointOptions::new(p.pid());
    opts.leave_running = true;
    let id = s.checkpoint(&mut gpu, &opts).unwrap().info.id;
    // Both images the fake dumped are in the checkpoint (a restore below once found no pages-1.img).
    let files: Vec<String> = s
        .store
        .get(&id)
        .unwrap()
        .files
        .into_iter()
        .map(|f| f.path)
        .collect();
    for image in [format!("core-{}.img", p.pid()), "pages-1.img".into()] {
        assert!(files.contains(&image), "{image} missing from {files:?}");
    }

    // The original still runs under the PID.
    let err = s.restore(&mut gpu, &id).unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Conflict);
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("PID {}", p.pid())) && msg.contains("sleep"),
        "{msg}"
    );
    assert!(p.running());
    drop(p);

    s.criu.fail_restores("Can't restore: injected");
    let err = s.restore(&mut gpu, &id).unwrap_err();
    assert!(err.to_string().contains("injected"), "{err}");
    assert!(s.store.get(&id).is_ok());
    assert!(s
        .store
        .verify(Some(&id), &NoProgress)
        .unwrap()
        .into_result()
        .is_ok());
    let work = s.store.local_dir().unwrap().join("restore-work");
    assert!(!work.exists() || std::fs::read_dir(work).unwrap().next().is_none());
}

#[test]
fn failed_gpu_restore_kills_the_restored_tree() {
    let s = Scene::new();
    let mut gpu = RecordingGpu::new(&s.criu);
    let (id, copy) = s.checkpoint_and_stand_in(&mut gpu);
    gpu.fail_finish = true;
    s.restore(&mut gpu, &id).unwrap_err();
    assert_eq!(
        names(&gpu.events()),
        ["freeze", "committed", "prepare", "finish"]
    );
    assert!(!copy.running(), "the half-restored copy must not run on");
    assert!(s.store.get(&id).is_ok());

    gpu.fail_finish = false;
    let copy2 = Sleeper::start();
    s.criu.restore_as(copy2.pid());
    let out = s.restore(&mut gpu, &id).unwrap();
    assert_eq!(out.pid, copy2.pid());
    assert!(out.log.is_some_and(|l| l.exists()));
}

/// The userfaultfd restore's failure paths, with a fake CRIU that cannot send descriptors: the copy at the
/// post-restore notification fails, so the restore fails naming why and the checkpoint stays; and a CRIU
/// that restores without notifying must not leave its copy running with memory never copied.
#[test]
fn a_uffd_restore_that_cannot_copy_the_memory_fails_and_leaves_nothing_running() {
    let s = Scene {
        images: ImageTransfer::Uffd,
        ..Scene::new()
    };
    s.criu.image_bytes(64 << 10).lazy_memory();
    let mut gpu = RecordingGpu::new(&s.criu);
    let (id, copy) = s.checkpoint_and_stand_in(&mut gpu);
    let err = s.restore(&mut gpu, &id).unwrap_err();
    assert!(err.to_string().contains("sent no userfaultfd"), "{err}");
    assert!(s.store.get(&id).is_ok(), "the checkpoint stays");

    s.criu.skip_notifications();
    let err = s.restore(&mut gpu, &id).unwrap_err();
    assert!(err.to_string().contains("not copied"), "{err}");
    assert!(!copy.running(), "a copy without its memory must not run on");
    assert!(s.store.get(&id).is_ok(), "the checkpoint stays");
}

#[test]
fn a_store_manifest_that_is_not_a_checkpoint_of_ours_is_refused() {
    let s = Scene::new();
    let ingest = s.store.begin(Some("foreign")).unwrap();
    std::fs::write(ingest.staging_dir().join("x.img"), b"x").unwrap();
    ingest
        .commit(json!({"made_by": "someone else"}), &NoProgress)
        .unwrap();
    let mut gpu = RecordingGpu::new(&s.criu);
    let err = s.restore(&mut gpu, "foreign").unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid, "{err}");
    assert!(
        err.to_string()
            .contains("not a gpu-checkpoint checkpoint manifest"),
        "{err}"
    );
    assert!(s.criu.calls().is_empty() && gpu.events().is_empty());
}

/// The images CRIU hands over, by name and content (CRIU's log differs between runs).
fn image_chunks(
    info: &crate::store::CheckpointInfo,
) -> Vec<(String, u64, Vec<crate::store::ChunkRef>)> {
    info.files
        .iter()
        .filter(|f| f.path != DUMP_LOG)
        .map(|f| (f.path.clone(), f.size, f.chunks.clone()))
        .collect()
}

#[test]
fn streamed_and_staged_checkpoints_store_the_same_images() {
    let mut infos = Vec::new();
    let p = Sleeper::start();
    for images in [ImageTransfer::Stream, ImageTransfer::Staged] {
        let mut s = Scene::new();
        s.images = images;
        // Several chunks, so that the streamed page image goes through the pooled, parallel path.
        s.criu.image_bytes(5 << 20);
        let mut gpu = RecordingGpu::new(&s.criu);
        let mut opts = CheckpointOptions::new(p.pid());
        opts.leave_running = true;
        let out = s.checkpoint(&mut gpu, &opts).unwrap();
        assert_eq!(out.manifest.sizes.pages_bytes, 5 << 20, "{images:?}");
        assert_eq!(
            out.manifest.sizes.image_files, 3,
            "{images:?}: core, pages, log"
        );
        assert!(s.staging_empty());
        infos.push(out.info);
    }
    assert_eq!(image_chunks(&infos[0]), image_chunks(&infos[1]));
}

#[test]
fn a_streamed_restore_feeds_criu_the_stored_pages() {
    let s = Scene::new();
    s.criu.image_bytes(3 << 20).restore_as(4242);
    let p = Sleeper::start();
    let mut gpu = RecordingGpu::new(&s.criu);
    let mut opts = CheckpointOptions::new(p.pid());
    opts.leave_running = true;
    let out = s.checkpoint(&mut gpu, &opts).unwrap();
    drop(p);
    let restored = s.restore(&mut gpu, &out.info.id).unwrap();
    assert_eq!(restored.pid, 4242);
    let pages = s
        .criu
        .calls()
        .into_iter()
        .find_map(|c| match c {
            FakeCriuCall::Restore { pages, .. } => pages,
            _ => None,
        })
        .expect("the fake read its pages from the streamer");
    assert_eq!(pages, vec![0xa5; 3 << 20]);
}

/// The CRIU options a checkpoint is taken with reach CRIU's dump, are kept in the manifest, and reach
/// CRIU's restore again where CRIU needs them there, with the restore's own on top.
#[test]
fn criu_options_reach_the_dump_the_manifest_and_the_restore() {
    use crate::dump::{CgroupMode, NetworkLock};
    let (s, mut p, mut gpu) = Scene::with_tree();
    let mut opts = CheckpointOptions::new(p.pid());
    opts.criu = CriuOptions {
        file_locks: true,
        tcp_established: true,
        ghost_limit: Some(4 << 20),
        external: vec!["mnt[/data]:data".into()],
        manage_cgroups: Some(CgroupMode::Soft),
        network_lock: Some(NetworkLock::Skip),
        skip_mnt: vec!["/proc/sys".into()],
        ..CriuOptions::default()
    };
    let out = s.checkpoint(&mut gpu, &opts).unwrap();
    p.reap();
    let dumped = s.criu.calls();
    assert!(
        matches!(&dumped[..], [FakeCriuCall::Dump { options, .. }] if *options == opts.criu),
        "{dumped:?}"
    );
    let listed = s.store.list().unwrap();
    let m = CheckpointManifest::from_metadata(&listed[0].metadata).unwrap();
    assert_eq!(m.options.criu, opts.criu);
    assert_eq!(listed[0].metadata["options"]["file_locks"], true);
    assert_eq!(listed[0].metadata["options"]["ghost_limit"], 4 << 20);

    let copy = Sleeper::start();
    s.criu.restore_as(copy.pid());
    let given = CriuOptions {
        tcp_established: true,
        external: vec!["mnt[data]:/srv/data".into()],
        ..CriuOptions::default()
    };
    let flow = |gpu: &mut RecordingGpu, given: &CriuOptions| {
        s.flow(gpu)
            .restore_with(&Target::Checkpoint(out.info.id.clone()), given)
    };
    flow(&mut gpu, &given).unwrap();
    let Some(FakeCriuCall::Restore { options, .. }) = s.criu.calls().pop() else {
        panic!("no restore call")
    };
    assert_eq!(options, opts.criu.restore_options(&given).unwrap().options);
    assert!(options.file_locks && options.tcp_established);
    assert_eq!(options.network_lock, Some(NetworkLock::Skip));
    assert_eq!(options.manage_cgroups, Some(CgroupMode::Soft));
    assert_eq!(options.external, ["mnt[data]:/srv/data"]);
    assert_eq!(options.ghost_limit, None, "a dump-only option");

    // A flag that contradicts the checkpoint is refused before CRIU is asked.
    let calls = s.criu.calls().len();
    let contradicting = CriuOptions {
        shell_job: true,
        ..CriuOptions::default()
    };
    let err = flow(&mut gpu, &contradicting).unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Usage, "{err}");
    assert!(err.to_string().contains("--shell-job"), "{err}");
    assert_eq!(s.criu.calls().len(), calls);
}

/// A child that holds a `flock` on a file of its own (inherited from the test, which locked it).
fn locked_sleeper(dir: &std::path::Path) -> Sleeper {
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let file = std::fs::File::create(dir.join("held.lock")).unwrap();
    // SAFETY: flock on a descriptor we own.
    assert_eq!(unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) }, 0);
    let fd = file.as_raw_fd();
    let mut cmd = sleep_command();
    // SAFETY: only dup2 and fcntl (async-signal-safe) between fork and exec. The copy is not close-on-exec;
    // where the file already is descriptor 9 (tests running beside this one decide the numbers), dup2 does
    // nothing and the flag must be cleared instead, or exec closes it and the child holds no lock.
    unsafe {
        cmd.pre_exec(move || {
            let r = if fd == 9 {
                libc::fcntl(fd, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 9)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    // The child's descriptor shares the open file, and with it the lock.
    drop(file);
    Sleeper(child)
}

/// A tree holding a file lock, checkpointed without `--file-locks`, is refused before the GPU step or
/// CRIU touch it, naming the flag (CRIU would refuse only after freezing it); with the flag it goes.
#[test]
fn a_held_lock_without_file_locks_is_refused_before_anything_is_touched() {
    let s = Scene::new();
    let p = locked_sleeper(s._dir.path());
    let mut gpu = RecordingGpu::new(&s.criu);
    let mut opts = CheckpointOptions::new(p.pid());
    opts.leave_running = true;
    let err = s.checkpoint(&mut gpu, &opts).unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Unsupported, "{err}");
    assert!(err.to_string().contains("add --file-locks"), "{err}");
    assert!(gpu.events().is_empty(), "the GPU step was not touched");
    assert!(s.criu.calls().is_empty(), "CRIU was not asked");
    assert!(p.running());
    assert!(s.store.list().unwrap().is_empty());

    opts.criu.file_locks = true;
    s.checkpoint(&mut gpu, &opts).unwrap();
    assert!(matches!(
        &s.criu.calls()[..],
        [FakeCriuCall::Dump { options, .. }] if options.file_locks
    ));
}

#[test]
fn a_store_that_fails_while_streaming_continues_the_tree_and_keeps_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(crate::store::MemoryBackend::new(dir.path()));
    let store = Store::with_backend(backend.clone(), StoreOptions::default()).unwrap();
    let criu = Arc::new(FakeCriu::new());
    criu.image_bytes(6 << 20);
    let p = Sleeper::start();
    let mut gpu = RecordingGpu::new(&criu);
    backend
        .fail_chunk_writes
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let err = Flow {
        criu: &*criu,
        gpu: &mut gpu,
        store: &store,
        progress: &NoProgress,
        images: ImageTransfer::Stream,
        watch: &crate::flows::guardian::NoWatch,
        procs: &crate::proc::Live,
    }
    .checkpoint(&CheckpointOptions::new(p.pid()))
    .unwrap_err();
    // The store's error (disk full), not CRIU's broken pipe.
    assert_eq!(err.exit_status(), ExitStatus::Storage, "{err}");
    assert!(matches!(err, crate::Error::Store(_)), "{err}");
    assert_eq!(names(&gpu.events()), ["freeze", "thaw"]);
    assert!(p.running());
    assert!(store.list().unwrap().is_empty());
}

/// A store that is not a local folder (the memory store here, S3 later) has no `logs/` of its own: a
/// failed dump's log goes to the temporary folder, not to a relative path named after the store.
#[test]
fn logs_of_a_store_that_is_not_a_folder_go_to_the_temporary_folder() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::with_backend(
        Arc::new(crate::store::MemoryBackend::new(dir.path())),
        StoreOptions::default(),
    )
    .unwrap();
    assert_eq!(store.local_dir(), None);
    let src = dir.path().join("dump.log");
    std::fs::write(&src, "Error (criu/cr-dump.c:1): test\n").unwrap();
    let name = format!("test-{}.dump.log", std::process::id());
    let kept = save_log(store.local_dir(), &src, &name).unwrap();
    assert_eq!(kept, crate::flows::fallback_logs_dir().join(&name));
    assert_eq!(
        std::fs::read_to_string(&kept).unwrap(),
        "Error (criu/cr-dump.c:1): test\n"
    );
    std::fs::remove_file(kept).unwrap();
    // A local store keeps them in its own folder.
    let local = Store::open(&dir.path().join("store"), StoreOptions::default()).unwrap();
    assert_eq!(local.local_dir(), Some(dir.path().join("store").as_path()));
}

#[test]
fn the_guardian_is_told_each_step_before_it_happens() {
    let (s, mut p, mut gpu) = Scene::with_tree();
    let pid = p.pid();
    let out = s
        .checkpoint(&mut gpu, &CheckpointOptions::new(pid))
        .unwrap();
    p.reap();
    assert_eq!(
        s.told(),
        vec![
            Event::Checkpoint {
                pids: vec![pid],
                leave_running: false,
                stopped: vec![]
            },
            Event::Durable
        ]
    );
    let copy = Sleeper::start();
    s.criu.restore_as(copy.pid());
    s.restore(&mut gpu, &out.info.id).unwrap();
    assert_eq!(
        s.told().last(),
        Some(&Event::Restore { pids: vec![pid] }),
        "the restore names the PIDs it will create before CRIU runs"
    );
}

#[test]
fn a_guardian_that_cannot_be_told_stops_the_checkpoint_before_anything_is_touched() {
    let mut s = Scene::new();
    s.told.deaf = true;
    let p = Sleeper::start();
    let mut gpu = RecordingGpu::new(&s.criu);
    let err = s
        .checkpoint(&mut gpu, &CheckpointOptions::new(p.pid()))
        .unwrap_err();
    assert!(err.to_string().contains("guardian"), "{err}");
    assert!(gpu.events().is_empty(), "no GPU step: {:?}", gpu.events());
    assert!(s.criu.calls().is_empty(), "no dump: {:?}", s.criu.calls());
    assert!(tree::is_alive(p.pid()));
    s.assert_nothing_kept();
}

#[test]
fn a_stopped_tree_is_refused_not_checkpointed() {
    let s = Scene::new();
    let p = Sleeper::start();
    // SAFETY: stopping our own child.
    unsafe { libc::kill(p.pid(), libc::SIGSTOP) };
    let left = tree::wait_until(Duration::from_secs(5), || {
        if tree::stat(p.pid()).is_some_and(|st| st.state == 'T') {
            vec![]
        } else {
            vec![p.pid()]
        }
    });
    assert!(left.is_empty(), "the child stopped");
    let mut gpu = RecordingGpu::new(&s.criu);
    let err = s
        .checkpoint(&mut gpu, &CheckpointOptions::new(p.pid()))
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::Unsupported, "{err}");
    assert!(err.to_string().contains("kill -CONT"), "{err}");
    assert!(s.criu.calls().is_empty(), "{:?}", s.criu.calls());
    assert!(s.store.list().unwrap().is_empty());
    // SAFETY: continuing our own child so that it can be killed and reaped.
    unsafe { libc::kill(p.pid(), libc::SIGCONT) };
}

#[test]
fn a_process_stopped_on_purpose_is_checkpointed_with_allow_stopped_and_stays_stopped_when_undone() {
    // With --leave-running too: a streamed dump continues the tree before the commit (which fails
    // here), and that continue, like the undo, spares what was stopped before.
    for leave_running in [false, true] {
        let s = Scene::new();
        let p = Sleeper::start();
        // SAFETY: stopping our own child.
        unsafe { libc::kill(p.pid(), libc::SIGSTOP) };
        assert!(tree::wait_until(Duration::from_secs(5), || {
            if p.running() {
                vec![p.pid()]
            } else {
                vec![]
            }
        })
        .is_empty());
        // A store failure after the dump: the undo continues what ran, not what was stopped before.
        s.criu.leave_odd_file();
        let mut gpu = RecordingGpu::new(&s.criu);
        let mut opts = CheckpointOptions::new(p.pid());
        opts.allow_stopped = true;
        opts.leave_running = leave_running;
        let err = s.checkpoint(&mut gpu, &opts).unwrap_err();
        assert!(matches!(err, crate::Error::Store(_)), "{err}");
        assert!(
            matches!(
                s.criu.calls().as_slice(),
                [FakeCriuCall::Dump {
                    after: AfterDump::Stop,
                    stream: true,
                    ..
                }]
            ),
            "{:?}",
            s.criu.calls()
        );
        std::thread::sleep(Duration::from_millis(100));
        assert!(!p.running(), "stopped on purpose: left stopped");
        assert_eq!(
            s.told()[0],
            Event::Checkpoint {
                pids: vec![p.pid()],
                leave_running,
                stopped: vec![p.pid()]
            },
            "the guardian knows not to continue it"
        );
        // SAFETY: continuing our own child so that it can be killed and reaped.
        unsafe { libc::kill(p.pid(), libc::SIGCONT) };
    }
}

/// With pretend processes (nothing spawned): a PID no live process holds (here a zombie) is refused
/// before CRIU, the GPU step, the guardian or the store are touched.
#[test]
fn a_pid_no_live_process_holds_is_refused_before_anything_is_touched() {
    let s = Scene::new();
    let procs = crate::proc::FakeProcesses::default();
    procs.add(4242, 1, 'Z');
    let mut gpu = RecordingGpu::new(&s.criu);
    let err = Flow {
        procs: &procs,
        ..s.flow(&mut gpu)
    }
    .checkpoint(&CheckpointOptions::new(4242))
    .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::NoSuchProcess, "{err}");
    assert!(s.criu.calls().is_empty(), "CRIU was not asked");
    assert!(gpu.events().is_empty(), "the GPU step was not touched");
    assert!(s.told().is_empty(), "nothing for the guardian to undo");
    assert!(procs.signals().is_empty());
}

/// A tree that survives its kill once the checkpoint is durable is named in the error, with the
/// checkpoint it belongs to (kept: it is durable).
#[test]
fn a_tree_that_survives_its_kill_after_the_commit_is_named() {
    let procs = crate::proc::FakeProcesses::default();
    procs.add(200, 1, 'T').add(201, 200, 'T').survives_kill(201);
    let held: Box<dyn pipeline::Held> = Box::new(TreeHeld {
        tree: ContinueGuard::new(&procs, &[200, 201], &[], true),
        started: Instant::now(),
        paused: None,
    });
    let err = held.stop("ck-1").unwrap_err();
    assert!(
        matches!(&err, crate::Error::Checkpoint(Error::NotStopped { id, pids }) if id == "ck-1" && pids == &[201]),
        "{err}"
    );
    assert_eq!(procs.state(200), Some('Z'));
    assert!(
        !procs.signals().contains(&(200, libc::SIGCONT)),
        "a durable checkpoint's tree is not put back"
    );
}

/// A `--tcp-established` checkpoint that stops the tree records CRIU's network lock its dump logged (the
/// table, this boot, the tree's namespace): the lock stays for the restore. One that leaves the tree
/// running released it, and records none. The record goes through the manifest's JSON whole; a manifest
/// without the field (older ones, a checkpoint that left no lock) reads as none.
#[test]
fn the_network_lock_left_for_the_restore_is_recorded_and_older_manifests_read_without_it() {
    use crate::dump::KeptNetworkLock;
    use std::os::unix::fs::MetadataExt;
    for leave_running in [false, true] {
        let (s, mut p, mut gpu) = Scene::with_tree();
        s.criu.lock_connection_in("CRIU-fake-run-1");
        let mut opts = CheckpointOptions::new(p.pid());
        opts.leave_running = leave_running;
        opts.criu.tcp_established = true;
        let ns = std::fs::metadata(format!("/proc/{}/ns/net", p.pid()))
            .unwrap()
            .ino();
        s.checkpoint(&mut gpu, &opts).unwrap();
        if !leave_running {
            p.reap();
        }
        let metadata = s.store.list().unwrap()[0].metadata.clone();
        let m = CheckpointManifest::from_metadata(&metadata).unwrap();
        if leave_running {
            assert_eq!(m.kept_network_lock, None, "released: {metadata}");
            assert!(metadata.get("kept_network_lock").is_none(), "{metadata}");
            continue;
        }
        let expected = KeptNetworkLock {
            boot_id: crate::dump::boot_id().unwrap(),
            host: m.host.hostname.clone(),
            netns: ns,
            // The namespace's cookie (`kept_lock.rs` tests it).
            netns_cookie: m.kept_network_lock.as_ref().and_then(|l| l.netns_cookie),
            nft_tables: vec!["CRIU-fake-run-1".into()],
            iptables_rules: Vec::new(),
            iptables_chain: false,
        };
        assert_eq!(m.kept_network_lock.as_ref(), Some(&expected));
        assert_eq!(
            metadata["kept_network_lock"]["nft_tables"],
            json!(["CRIU-fake-run-1"])
        );
        assert!(metadata["kept_network_lock"]
            .get("iptables_rules")
            .is_none());
        let again = serde_json::to_value(&m).unwrap();
        assert_eq!(CheckpointManifest::from_metadata(&again).unwrap(), m);
        // As a gpu-checkpoint from before the field wrote it.
        let mut older = metadata.clone();
        older.as_object_mut().unwrap().remove("kept_network_lock");
        let read = CheckpointManifest::from_metadata(&older).unwrap();
        assert_eq!(read.kept_network_lock, None);
        assert_eq!(read.id, m.id);
    }
}
