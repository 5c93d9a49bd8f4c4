use super::*;
use crate::dump::CriuOptions;
use crate::freeze::NoGpu;
use crate::store::{NoProgress, StoreOptions};

/// A child process standing in for a container's init, a store, and a fake runtime knowing it as `c1`.
fn setup(
    fail: Option<&'static str>,
) -> (tempfile::TempDir, Store, std::process::Child, FakeRuntime) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store"), StoreOptions::default()).unwrap();
    let init = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let mut rt = FakeRuntime::with_container("c1", init.id() as i32);
    rt.fail = fail;
    (dir, store, init, rt)
}

fn flow<'a>(rt: &'a FakeRuntime, gpu: &'a mut NoGpu, store: &'a Store) -> ContainerFlow<'a> {
    ContainerFlow {
        runtime: rt,
        gpu,
        store,
        progress: &NoProgress,
        direct: None,
        watch: &crate::flows::guardian::NoWatch,
        procs: &crate::proc::Live,
    }
}

fn calls(rt: &FakeRuntime) -> Vec<String> {
    rt.calls.borrow().clone()
}

#[test]
fn a_checkpoint_holds_the_container_paused_until_durable_then_deletes_it_and_restores_under_a_new_id(
) {
    let (_dir, store, mut init, rt) = setup(None);
    let mut gpu = NoGpu;
    let out = flow(&rt, &mut gpu, &store)
        .checkpoint(&ContainerCheckpointOptions::new("c1"))
        .unwrap();
    assert!(out.stopped);
    assert_eq!(calls(&rt), ["pause c1", "checkpoint c1", "delete c1"]);
    assert_eq!(rt.status("c1"), None, "deleted once durable");
    let _ = init.wait();
    let rec = out.manifest.container.as_ref().expect("container recorded");
    assert_eq!(rec.runtime, "runc");
    assert_eq!(rec.id, "c1");
    assert_eq!(rec.global_args, ["--root", "/fake"]);
    assert_eq!(rec.processes[0].pid, out.manifest.root_pid);
    // The manifest read back from the store says the same.
    let back =
        CheckpointManifest::from_metadata(&store.get(&out.info.id).unwrap().metadata).unwrap();
    assert_eq!(back.container.as_ref(), Some(rec));

    let restored = flow(&rt, &mut gpu, &store)
        .restore(&ContainerRestoreOptions {
            checkpoint: out.info.id.clone(),
            id: "c2".into(),
            bundle: None,
        })
        .unwrap();
    assert_eq!(restored.id, "c2");
    assert_eq!(rt.status("c2").as_deref(), Some("running"));
    // The same id again is refused: the runtime has it.
    let again = flow(&rt, &mut gpu, &store).restore(&ContainerRestoreOptions {
        checkpoint: out.info.id.clone(),
        id: "c2".into(),
        bundle: None,
    });
    assert!(
        matches!(again, Err(crate::Error::Container(Error::Exists { .. }))),
        "{again:?}"
    );
}

#[test]
fn a_failed_runtime_checkpoint_resumes_the_container_and_stores_nothing() {
    let (_dir, store, mut init, rt) = setup(Some("checkpoint"));
    let mut gpu = NoGpu;
    let err = flow(&rt, &mut gpu, &store)
        .checkpoint(&ContainerCheckpointOptions::new("c1"))
        .unwrap_err();
    assert!(err.to_string().contains("made to fail"), "{err}");
    assert_eq!(calls(&rt), ["pause c1", "checkpoint c1", "resume c1"]);
    assert_eq!(rt.status("c1").as_deref(), Some("running"));
    assert!(store.list().unwrap().is_empty(), "nothing stored");
    init.kill().unwrap();
    let _ = init.wait();
}

#[test]
fn leave_running_resumes_right_after_the_dump_and_keeps_the_container() {
    let (_dir, store, mut init, rt) = setup(None);
    let mut gpu = NoGpu;
    let mut opts = ContainerCheckpointOptions::new("c1");
    opts.leave_running = true;
    let out = flow(&rt, &mut gpu, &store).checkpoint(&opts).unwrap();
    assert!(!out.stopped);
    assert_eq!(calls(&rt), ["pause c1", "checkpoint c1", "resume c1"]);
    assert_eq!(rt.status("c1").as_deref(), Some("running"));
    // A failed restore (the runtime fails) deletes nothing of the checkpoint and leaves no container.
    let mut failing = FakeRuntime::default();
    failing.fail = Some("restore");
    let err = flow(&failing, &mut gpu, &store)
        .restore(&ContainerRestoreOptions {
            checkpoint: out.info.id.clone(),
            id: "c9".into(),
            bundle: None,
        })
        .unwrap_err();
    assert!(err.to_string().contains("made to fail"), "{err}");
    assert_eq!(failing.status("c9"), None);
    store.get(&out.info.id).expect("the checkpoint is intact");
    init.kill().unwrap();
    let _ = init.wait();
}

/// A stand-in for a sandbox whose host side holds (SIMULATED) GPU state: a process with a shared mapping
/// of a simulated device file. The GPU state is refused before anything is touched (exit 9).
#[test]
fn gpu_state_a_host_freeze_cannot_reach_is_refused_before_anything_is_touched() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("store"), StoreOptions::default()).unwrap();
    let script = "import mmap, os, sys, time\n\
        d = '/dev/shm/gpu-checkpoint-sim'\n\
        os.makedirs(d, exist_ok=True)\n\
        p = f'{d}/{os.getpid()}-dev0'\n\
        f = open(p, 'w+b'); f.truncate(4096)\n\
        m = mmap.mmap(f.fileno(), 4096, mmap.MAP_SHARED)\n\
        os.unlink(p); print('ready', flush=True); time.sleep(60)\n";
    let Ok(mut child) = std::process::Command::new("python3")
        .args(["-c", script])
        .stdout(std::process::Stdio::piped())
        .spawn()
    else {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "python3 is missing in CI (scripts/setup.sh installs it)"
        );
        eprintln!("SKIPPED: python3 is missing (scripts/setup.sh installs it)");
        return;
    };
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "ready");
    let mut rt = FakeRuntime::with_container("sb", child.id() as i32);
    rt.sandboxed = true;
    let mut gpu = NoGpu;
    let mut opts = ContainerCheckpointOptions::new("sb");
    opts.detect.simulator = true;
    let err = flow(&rt, &mut gpu, &store).checkpoint(&opts).unwrap_err();
    child.kill().unwrap();
    let _ = child.wait();
    assert!(err.to_string().contains("inside the sandbox"), "{err}");
    assert_eq!(
        crate::Classify::exit_status(&err),
        crate::ExitStatus::Unsupported
    );
    assert!(calls(&rt).is_empty(), "nothing touched: {:?}", calls(&rt));
    assert!(store.list().unwrap().is_empty());
}

/// A sandbox runtime whose checkpoint freezes the GPU state itself (newer runsc's
/// `--cuda-checkpoint-path`) is handed the tool and nothing of ours runs inside: the fake can run no
/// command inside a container, so the in-sandbox freeze (and its restore) would fail here. One that
/// cannot is not handed the tool, and that freeze is tried.
#[test]
fn a_runtime_that_freezes_the_sandbox_gpu_itself_is_handed_the_tool_and_nothing_runs_inside() {
    let tool = std::path::Path::new("/usr/local/bin/cuda-checkpoint");
    let (_dir, store, mut init, mut rt) = setup(None);
    rt.sandboxed = true;
    rt.gpu_itself = true;
    let mut gpu = NoGpu;
    let mut opts = ContainerCheckpointOptions::new("c1");
    opts.sandbox_gpu_tool = Some(tool.into());
    let out = flow(&rt, &mut gpu, &store).checkpoint(&opts).unwrap();
    let _ = init.wait();
    assert_eq!(rt.gpu_tool.borrow().as_deref(), Some(tool));
    let rec = out.manifest.container.as_ref().unwrap();
    assert!(rec.sandbox_gpu_by_runtime);
    assert_eq!(rec.sandbox_gpu_tool.as_deref(), Some(tool));
    assert!(rec.sandbox_gpu_pids.is_empty());
    let back =
        CheckpointManifest::from_metadata(&store.get(&out.info.id).unwrap().metadata).unwrap();
    assert_eq!(back.container.as_ref(), Some(rec));
    // Its restore put the state back: the flow runs nothing inside.
    flow(&rt, &mut gpu, &store)
        .restore(&ContainerRestoreOptions {
            checkpoint: out.info.id.clone(),
            id: "c2".into(),
            bundle: None,
        })
        .unwrap();
    assert_eq!(rt.status("c2").as_deref(), Some("running"));

    let (_dir, store, mut init, mut rt) = setup(None);
    rt.sandboxed = true;
    let err = flow(&rt, &mut gpu, &store).checkpoint(&opts).unwrap_err();
    assert!(
        err.to_string().contains("cannot run a command inside"),
        "{err}"
    );
    assert!(calls(&rt).is_empty(), "nothing touched: {:?}", calls(&rt));
    assert_eq!(*rt.gpu_tool.borrow(), None);
    init.kill().unwrap();
    let _ = init.wait();
}

/// A runtime offering the settings of a direct dump, as runc's state gives them.
fn direct_settings() -> DirectDump {
    DirectDump {
        settings: crate::dump::ContainerDump {
            root: "/nonexistent/bundle/rootfs".into(),
            ..Default::default()
        },
        options: CriuOptions {
            manage_cgroups: Some(crate::dump::CgroupMode::Soft),
            ..CriuOptions::default()
        },
        files: vec![(
            crate::flows::runtime::DESCRIPTORS.into(),
            b"[\"/dev/null\"]".to_vec(),
        )],
    }
}

#[test]
fn a_direct_dump_streams_criu_images_into_the_store_with_the_runtimes_files_and_no_runtime_checkpoint(
) {
    let (_dir, store, mut init, mut rt) = setup(None);
    rt.direct = Some(direct_settings());
    let criu = crate::dump::FakeCriu::new();
    let mut gpu = NoGpu;
    let mut f = flow(&rt, &mut gpu, &store);
    f.direct = Some(&criu);
    let mut opts = ContainerCheckpointOptions::new("c1");
    opts.tcp_established = true;
    let out = f.checkpoint(&opts).unwrap();
    assert!(out.direct && out.stopped);
    // Paused around CRIU's dump, runc's checkpoint never run, deleted once durable.
    assert_eq!(calls(&rt), ["direct-dump c1", "pause c1", "delete c1"]);
    let _ = init.wait();
    match criu.calls().as_slice() {
        [crate::dump::FakeCriuCall::Dump {
            pid,
            after,
            options,
            ..
        }] => {
            assert_eq!(*pid, out.manifest.root_pid);
            // With `--tcp-established` the container is left stopped, its connections locked, for the
            // kill (an outside peer keeps its connection).
            assert_eq!(*after, crate::dump::AfterDump::Stop);
            assert_eq!(options.manage_cgroups, Some(crate::dump::CgroupMode::Soft));
            assert!(options.tcp_established, "the user's options are added");
        }
        other => panic!("{other:?}"),
    }
    assert!(out.manifest.timings_ms.streamed);
    // The CRIU that dumped is the one recorded (asked for its version: none was given beforehand).
    assert_eq!(
        (
            out.manifest.criu.version.major,
            out.manifest.criu.version.minor
        ),
        (4, 1)
    );
    assert_eq!(out.manifest.criu.path, crate::dump::Criu::describe(&criu));
    // The images came as streams; the runtime's file went with them, as runc's restore reads it.
    let info = store.get(&out.info.id).unwrap();
    let names: Vec<&str> = info.files.iter().map(|f| f.path.as_str()).collect();
    assert!(names.contains(&"pages-1.img"), "{names:?}");
    assert!(
        names.contains(&crate::flows::runtime::DESCRIPTORS),
        "{names:?}"
    );
    let work = tempfile::tempdir().unwrap();
    store
        .materialize(&out.info.id, &work.path().join("m"), &NoProgress)
        .unwrap();
    assert_eq!(
        std::fs::read(
            work.path()
                .join("m")
                .join(crate::flows::runtime::DESCRIPTORS)
        )
        .unwrap(),
        b"[\"/dev/null\"]"
    );
}

/// Checkpoints `c1` with CRIU driven directly by `criu`, expecting it to fail.
fn direct_checkpoint_error(
    rt: &FakeRuntime,
    store: &Store,
    criu: &dyn crate::dump::Criu,
) -> crate::Error {
    let mut gpu = NoGpu;
    let mut f = flow(rt, &mut gpu, store);
    f.direct = Some(criu);
    f.checkpoint(&ContainerCheckpointOptions::new("c1"))
        .unwrap_err()
}

/// A CRIU named by the user is checked beside the container's discovery (`PendingCriu`); a too-old one
/// stops the checkpoint once the discovery is done, before the runtime is asked for anything else or the
/// container is paused.
#[test]
fn a_named_criu_that_fails_its_check_stops_the_checkpoint_before_the_container_is_touched() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, store, mut init, mut rt) = setup(None);
    rt.direct = Some(direct_settings());
    let old = dir.path().join("criu");
    std::fs::write(&old, "#!/bin/sh\necho 'Version: 3.17'\n").unwrap();
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o755)).unwrap();
    let criu = crate::dump::PendingCriu::start(old, crate::dump::CriuSource::Flag);
    let err = direct_checkpoint_error(&rt, &store, &criu);
    assert!(err.to_string().contains("3.17"), "{err}");
    assert!(calls(&rt).is_empty(), "{:?}", calls(&rt));
    assert_eq!(rt.status("c1").as_deref(), Some("running"));
    assert!(store.list().unwrap().is_empty(), "nothing stored");
    let _ = init.kill();
    let _ = init.wait();
}

#[test]
fn a_failed_direct_dump_resumes_the_container_and_stores_nothing() {
    let (_dir, store, mut init, mut rt) = setup(None);
    rt.direct = Some(direct_settings());
    let criu = crate::dump::FakeCriu::new();
    criu.fail_dumps("Error (criu/cr-dump.c:1): made to fail");
    let err = direct_checkpoint_error(&rt, &store, &criu);
    assert!(err.to_string().contains("made to fail"), "{err}");
    assert_eq!(calls(&rt), ["direct-dump c1", "pause c1", "resume c1"]);
    assert_eq!(rt.status("c1").as_deref(), Some("running"));
    assert!(store.list().unwrap().is_empty(), "nothing stored");
    // Asked to, the runtime's own checkpoint is used instead.
    let mut opts = ContainerCheckpointOptions::new("c1");
    opts.via_runtime = true;
    opts.leave_running = true;
    let mut gpu = NoGpu;
    let mut f = flow(&rt, &mut gpu, &store);
    f.direct = Some(&criu);
    let out = f.checkpoint(&opts).unwrap();
    assert!(!out.direct);
    assert_eq!(criu.calls().len(), 1, "CRIU not asked again");
    init.kill().unwrap();
    let _ = init.wait();
}

/// A checkpoint of `c1` by a fake runtime that restores streamed, and a bundle with a `config.json`.
fn streamed_checkpoint(
    dir: &std::path::Path,
    store: &Store,
    rt: &FakeRuntime,
) -> (CheckpointInfo, std::path::PathBuf) {
    let mut gpu = NoGpu;
    let mut opts = ContainerCheckpointOptions::new("c1");
    opts.leave_running = true;
    let out = flow(rt, &mut gpu, store).checkpoint(&opts).unwrap();
    let bundle = dir.join("bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    std::fs::write(
        bundle.join("config.json"),
        br#"{"process": {"terminal": false}}"#,
    )
    .unwrap();
    (out.info, bundle)
}

#[test]
fn a_streamed_restore_serves_the_images_to_the_runtime_and_writes_none() {
    let (dir, store, _init, mut rt) = setup(None);
    rt.streams = true;
    let (info, bundle) = streamed_checkpoint(dir.path(), &store, &rt);
    let mut gpu = NoGpu;
    let out = flow(&rt, &mut gpu, &store)
        .restore(&ContainerRestoreOptions {
            checkpoint: info.id.clone(),
            id: "c2".into(),
            bundle: Some(bundle.clone()),
        })
        .unwrap();
    assert!(out.streamed(), "{:?}", out.materialized_because);
    // The fake read the page image through the socket (it fails on a file), every byte of it.
    assert_eq!(
        rt.streamed_pages.borrow().as_deref(),
        Some(&vec![7u8; 1 << 20][..])
    );
    assert_eq!(rt.status("c2").as_deref(), Some("running"));

    // A terminal needs CRIU's RPC: the images are materialized, as before.
    std::fs::write(
        bundle.join("config.json"),
        br#"{"process": {"terminal": true}}"#,
    )
    .unwrap();
    *rt.streamed_pages.borrow_mut() = None;
    let out = flow(&rt, &mut gpu, &store)
        .restore(&ContainerRestoreOptions {
            checkpoint: info.id.clone(),
            id: "c3".into(),
            bundle: Some(bundle),
        })
        .unwrap();
    assert_eq!(
        out.materialized_because.as_deref(),
        Some("the container has a terminal")
    );
    assert!(rt.streamed_pages.borrow().is_none());
}

#[test]
fn a_damaged_chunk_fails_a_streamed_restore_with_the_stores_error_and_leaves_no_container() {
    let (dir, store, _init, mut rt) = setup(None);
    rt.streams = true;
    let (info, bundle) = streamed_checkpoint(dir.path(), &store, &rt);
    let pages = info.files.iter().find(|f| f.path == "pages-1.img").unwrap();
    let id = pages.chunks[0].id.as_ref().expect("a stored chunk");
    let hex = id.to_hex();
    let chunk = dir.path().join("store/chunks").join(&hex[..2]).join(&hex);
    let mut bytes = std::fs::read(&chunk).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&chunk, &bytes).unwrap();

    let mut gpu = NoGpu;
    let err = flow(&rt, &mut gpu, &store)
        .restore(&ContainerRestoreOptions {
            checkpoint: info.id.clone(),
            id: "c2".into(),
            bundle: Some(bundle),
        })
        .unwrap_err();
    assert!(matches!(err, crate::Error::Store(_)), "{err:?}");
    assert!(
        err.to_string().contains(&hex[..16]),
        "names the chunk: {err}"
    );
    assert!(
        calls(&rt).contains(&"restore c2".to_string()),
        "{:?}",
        calls(&rt)
    );
    assert_eq!(rt.status("c2"), None, "no container left");
    assert!(
        rt.streamed_pages.borrow().is_none(),
        "the fake got no whole image"
    );
    // The checkpoint is still there.
    assert!(store.get(&info.id).is_ok());
}
