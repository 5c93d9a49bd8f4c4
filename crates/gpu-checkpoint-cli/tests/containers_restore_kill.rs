//! A runc container restore killed half-way leaves nothing behind: the tool SIGKILLed while CRIU reads
//! the images streamed from the store, right after `runc restore` returned, and during the GPU restore
//! of a SIMULATED GPU container, and while `runsc restore` runs (the guardian undoes it); runc's `criu
//! swrk` stand-in, and CRIU itself, killed while the images stream (the tool's own undo). Each time: no container in `runc list`, no mount under
//! runc's state folder, the store or the bundle, no process left in the container's cgroup, the rootfs intact, and
//! the checkpoint restores afterwards with its memory verified. Needs root, CRIU, runc and
//! busybox-static: fails in CI without them, skips locally.

mod container_support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use container_support::*;
use gpu_checkpoint::freeze::sim;

/// The runtime's containers go before the folder holding its state (fields drop in order).
struct Setup {
    store: PathBuf,
    runc: Runc,
    bundle: Bundle,
    dir: tempfile::TempDir,
}

fn setup(args: &[&str]) -> Option<Setup> {
    if !containers_ready() {
        return None;
    }
    setup_with(args, Runc::new)
}

fn setup_with(args: &[&str], runtime: fn(&Path) -> Runc) -> Option<Setup> {
    let dir = tempfile::tempdir().unwrap();
    Some(Setup {
        store: dir.path().join("store"),
        runc: runtime(dir.path()),
        bundle: Bundle::new(&dir.path().join("bundle"), args, &[]),
        dir,
    })
}

impl Setup {
    /// `gpu-checkpoint restore CKPT --container ID --gpu-backend sim`, started (not waited for).
    fn spawn_restore(&self, ckpt: &str, id: &str, fault: Option<&str>) -> Child {
        let mut c = Command::new(gpu_checkpoint());
        c.args(["restore", ckpt, "--container", id, "--gpu-backend", "sim"])
            .args(["--format", "json"])
            .args(store_args(&self.store, &self.runc))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // The restore's free-memory preflight counts every simulated process on the machine,
            // other tests' too: a simulated GPU large enough for them all.
            .env(gpu_checkpoint::freeze::sim::ENV_GPU_MIB, "65536");
        if let Some(f) = fault {
            c.env("GPU_CHECKPOINT_FAULT", f);
        }
        c.spawn().unwrap()
    }

    /// A restore that succeeds, its images streamed from the store.
    fn restore(&self, ckpt: &str, id: &str) {
        let o = self
            .spawn_restore(ckpt, id, None)
            .wait_with_output()
            .unwrap();
        assert!(o.status.success(), "restore: {}", text(&o));
        let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(out["streamed"], true, "{out}");
    }

    fn work(&self) -> PathBuf {
        self.store.join("container-work")
    }

    /// The container's processes, restored or half-restored: in container `id`'s cgroup (runc names it
    /// after the id; CRIU restores into it), or runsc's sandbox and gofer (given this state folder).
    fn in_container(&self, id: &str) -> Vec<i32> {
        let flag = format!("--root={}", self.runc.root.display());
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| {
                let argv = std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
                std::fs::read_to_string(format!("/proc/{p}/cgroup")).is_ok_and(|c| c.contains(id))
                    || argv.split(|&b| b == 0).any(|a| a == flag.as_bytes())
            })
            .collect()
    }

    /// What a killed restore must not leave: waits for the undo (the work folder gone is its last step),
    /// then checks the runtime, the mounts, the processes, the rootfs and the checkpoint.
    fn assert_nothing_left(&self, id: &str, what: &str) {
        let empty = |d: &Path| std::fs::read_dir(d).map_or(true, |mut e| e.next().is_none());
        wait_for(&format!("{what}: the work folder removed"), &|| {
            empty(&self.work())
        });
        assert_eq!(self.runc.state(id), None, "{what}: {:?}", self.runc.list());
        assert!(
            self.runc.list().is_empty(),
            "{what}: {:?}",
            self.runc.list()
        );
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        for root in [&self.runc.root, &self.store, &self.bundle.dir] {
            let left: Vec<&str> = mounts
                .lines()
                .filter(|l| {
                    l.split(' ')
                        .nth(4)
                        .is_some_and(|p| Path::new(p).starts_with(root))
                })
                .collect();
            assert!(
                left.is_empty(),
                "{what}: mounts left under {root:?}: {left:?}"
            );
        }
        wait_for(&format!("{what}: no process of the container"), &|| {
            self.in_container(id).is_empty()
        });
        let rootfs = self.bundle.rootfs();
        for f in ["bin/busybox", "bin/workload", "bin/gpu-sim-workload"] {
            assert!(rootfs.join(f).is_file(), "{what}: the rootfs lost {f}");
        }
        assert_eq!(listed(&self.store).len(), 1, "{what}: the checkpoint");
        assert!(self.dir.path().join("bundle/config.json").is_file());
    }
}

/// The first process of `root`'s tree (not `root`) whose command line `matches`.
fn descendant(root: i32, matches: &dyn Fn(&str) -> bool) -> Option<i32> {
    gpu_checkpoint::proc::process_tree(root)
        .into_iter()
        .skip(1)
        .find(|p| matches(&p.cmdline))
        .map(|p| p.pid)
}

/// Waits until `tool` has a descendant that `matches`; returns it.
fn wait_descendant(tool: &Child, what: &str, matches: &dyn Fn(&str) -> bool) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(p) = descendant(tool.id() as i32, matches) {
            return p;
        }
        assert!(Instant::now() < deadline, "{what} never ran");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn is_streaming_criu(argv: &str) -> bool {
    argv.contains("criu") && argv.contains("restore") && argv.contains("--stream")
}

fn killed_by_sigkill(tool: Child) {
    let o = tool.wait_with_output().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&o.status),
        Some(9),
        "killed, not finished: {}",
        text(&o)
    );
}

/// SIGKILLs `tool` while its descendant `step` (named `what`) still runs; returns once the tool and
/// its guardian are gone (the pipes of its output closed).
fn kill_while(tool: Child, step: i32, what: &str) {
    assert!(
        gpu_checkpoint::proc::is_alive(step),
        "{what} finished before the kill"
    );
    let t = Instant::now();
    // SAFETY: kill has no memory-safety preconditions; the tool is this test's child.
    assert_eq!(unsafe { libc::kill(tool.id() as i32, libc::SIGKILL) }, 0);
    killed_by_sigkill(tool);
    // Said, not asserted: the guardian holds the tool's stderr until it has undone the restore.
    eprintln!(
        "killed during {what}: undone {} ms after the kill",
        t.elapsed().as_millis()
    );
}

/// The memory workload's `verified` and `bad` counts.
fn memory(mem: &Path) -> (u64, Option<u64>) {
    let recs = gpu_checkpoint_workloads::read_state(mem).unwrap_or_default();
    let field = |k| {
        recs.first()
            .and_then(|r| gpu_checkpoint_workloads::field_u64(r, k))
    };
    (field("verified").unwrap_or(0), field("bad"))
}

#[test]
fn a_runc_restore_killed_half_way_leaves_nothing_and_the_checkpoint_restores() {
    let Some(s) = setup(&["exec workload memory --mib 192 --state /state/mem"]) else {
        return;
    };
    let id = format!("gc-{}-rkill", std::process::id());
    s.runc.run(&id, &s.bundle);
    let mem = s.bundle.rootfs().join("state/mem");
    wait_for("the memory workload", &|| memory(&mem).0 > 0);
    let ckpt = checkpoint_container(&s.store, &s.runc, &id);
    assert_eq!(s.runc.state(&id), None);

    // 1. The tool killed while CRIU reads the streamed images: the guardian lets runc fail, deletes.
    let tool = s.spawn_restore(&ckpt, &id, None);
    let criu = wait_descendant(&tool, "CRIU's streamed restore", &is_streaming_criu);
    std::thread::sleep(Duration::from_millis(50));
    kill_while(tool, criu, "CRIU's streamed restore");
    s.assert_nothing_left(&id, "killed while the images stream");

    // 2. The tool killed right after `runc restore` returned: the restored container runs; deleted.
    let tool = s.spawn_restore(&ckpt, &id, Some("restore.after-criu=kill"));
    killed_by_sigkill(tool);
    s.assert_nothing_left(&id, "killed after runc's restore");

    // 3. runc's `criu swrk` stand-in killed while the images stream: runc fails, CRIU goes on without
    // it; the tool's own undo kills CRIU's tree and deletes.
    let tool = s.spawn_restore(&ckpt, &id, None);
    let criu = wait_descendant(&tool, "CRIU's streamed restore", &is_streaming_criu);
    // The stand-in runs CRIU (runc's earlier `swrk` for its version check became CRIU itself).
    let proxy = gpu_checkpoint::proc::stat(criu).unwrap().ppid;
    let argv = std::fs::read(format!("/proc/{proxy}/cmdline")).unwrap();
    assert!(
        String::from_utf8_lossy(&argv).contains("swrk"),
        "CRIU's parent is the stand-in: {argv:?}"
    );
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: kill has no memory-safety preconditions; the stand-in is this test's grandchild.
    assert_eq!(unsafe { libc::kill(proxy, libc::SIGKILL) }, 0);
    let o = tool.wait_with_output().unwrap();
    assert!(!o.status.success(), "the restore failed: {}", text(&o));
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    // CRIU, restoring on without the stand-in, either was still at it when runc failed (the tool's undo
    // kills it: "left by the failed restore") or reached post-restore, where its action script finds
    // nobody to tell runc, fails, and CRIU kills the tree it restored before it ran. Either way:
    s.assert_nothing_left(&id, "the stand-in killed");

    // 4. CRIU itself SIGKILLed while the images stream: the stand-in and runc fail; the tool's undo
    // kills the tasks CRIU left half-restored.
    let tool = s.spawn_restore(&ckpt, &id, None);
    let criu = wait_descendant(&tool, "CRIU's streamed restore", &is_streaming_criu);
    std::thread::sleep(Duration::from_millis(50));
    // SAFETY: kill has no memory-safety preconditions; CRIU is this test's descendant.
    assert_eq!(unsafe { libc::kill(criu, libc::SIGKILL) }, 0);
    let o = tool.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    s.assert_nothing_left(&id, "CRIU killed");

    // And the checkpoint restores, streamed, its memory intact.
    s.restore(&ckpt, &id);
    assert!(
        !s.in_container(&id).is_empty(),
        "the restored container is seen"
    );
    let at = memory(&mem).0;
    wait_for("the memory verified again", &|| memory(&mem).0 > at);
    assert_eq!(memory(&mem).1, Some(0), "memory intact");
}

#[test]
fn a_gpu_container_restore_killed_during_its_gpu_restore_leaves_nothing() {
    let args = ["exec", "gpu-sim-workload", "--mib", "32", "--workers", "2"];
    let Some(s) = setup(&args) else { return };
    let id = format!("gc-{}-rkill-gpu", std::process::id());
    s.runc.run(&id, &s.bundle);
    let gpu_up = || {
        s.runc
            .state(&id)
            .is_some_and(|(st, pid)| st == "running" && sim::status(pid).is_ok())
    };
    wait_for("the GPU workload", &gpu_up);
    let mut args = vec!["checkpoint", "--container", &id, "--gpu-backend", "sim"];
    let sargs = store_args(&s.store, &s.runc);
    args.extend(sargs.iter().map(String::as_str));
    let o = gc_run(&args);
    assert!(o.status.success(), "checkpoint: {}", text(&o));
    let ckpt = listed(&s.store)[0]["id"].as_str().unwrap().to_string();

    // Killed with the GPU state restored, not unlocked: the guardian deletes the container.
    let tool = s.spawn_restore(&ckpt, &id, Some("container.gpu-restored=kill"));
    killed_by_sigkill(tool);
    s.assert_nothing_left(&id, "killed during the GPU restore");

    s.restore(&ckpt, &id);
    wait_for("the GPU workload restored", &gpu_up);
    let (_, init) = s.runc.state(&id).unwrap();
    assert_healthy(&[init]);
}

/// runsc: the tool killed while `runsc restore` runs (the images materialized: runsc cannot read them
/// streamed). The guardian lets it finish, deletes the sandbox and removes the work folder.
#[test]
fn a_runsc_restore_killed_half_way_leaves_nothing_and_the_checkpoint_restores() {
    if !runsc_ready() {
        return;
    }
    let counter = ["exec workload counter --state /state/c"];
    let Some(s) = setup_with(&counter, Runc::runsc) else {
        return;
    };
    let id = format!("gc-{}-rkill-rs", std::process::id());
    s.runc.run(&id, &s.bundle);
    let state = s.bundle.rootfs().join("state/c");
    let seq = || {
        gpu_checkpoint_workloads::read_state(&state)
            .ok()
            .and_then(|r| gpu_checkpoint_workloads::field_u64(r.first()?, "seq"))
            .unwrap_or(0)
    };
    wait_for("the counter", &|| seq() > 0);
    let ckpt = checkpoint_container(&s.store, &s.runc, &id);
    assert_eq!(s.runc.state(&id), None);

    let tool = s.spawn_restore(&ckpt, &id, None);
    let runsc_restore = wait_descendant(&tool, "runsc restore", &|a| {
        a.contains("runsc") && a.contains("restore") && a.contains(&id)
    });
    kill_while(tool, runsc_restore, "runsc's restore");
    s.assert_nothing_left(&id, "killed during runsc's restore");

    let o = s
        .spawn_restore(&ckpt, &id, None)
        .wait_with_output()
        .unwrap();
    assert!(o.status.success(), "restore: {}", text(&o));
    let at = seq();
    wait_for("the counter going on", &|| seq() > at);
}
