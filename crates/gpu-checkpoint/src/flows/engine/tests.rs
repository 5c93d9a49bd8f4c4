//! The wrapper's decisions without an engine: what reaches the real runc, when, and what is refused
//! before it runs. The fake runtime knows one container whose init is a child of this test; "runc" is a
//! closure that records its command lines.

use std::cell::RefCell;
use std::ffi::OsString;
use std::path::Path;

use super::record::{ArchiveRecord, RECORD_SCHEMA, RECORD_VERSION};
use super::*;
use crate::detect::StrategyName;
use crate::flows::guardian::NoWatch;
use crate::flows::runtime::FakeRuntime;
use crate::freeze::step::{RecordedProcess, StepTimings};
use crate::freeze::GpuRecord;

fn config() -> NodeConfig {
    NodeConfig {
        schema: CONFIG_SCHEMA.into(),
        version: CONFIG_VERSION,
        runtime: "/usr/sbin/runc".into(),
        criu: Some("/our/criu".into()),
        criu_plugins: None,
        gpu_backend: GpuBackend::Sim,
        lock_timeout_ms: None,
        guardian_log: None,
    }
}

fn call(line: &str) -> RuncCall {
    let args: Vec<OsString> = line.split_whitespace().map(OsString::from).collect();
    RuncCall::parse(&args)
}

/// Runs `f` with an engine for `line` whose real runc is recorded (and answers `code`).
fn with_engine<T>(
    rt: &FakeRuntime,
    line: &str,
    code: i32,
    f: impl FnOnce(&mut Engine<'_>) -> T,
) -> (T, Vec<String>) {
    let config = config();
    let call = call(line);
    let ran = RefCell::new(Vec::new());
    let real = |l: &[OsString]| -> Result<i32, Error> {
        let l: Vec<String> = l.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        ran.borrow_mut().push(l.join(" "));
        Ok(code)
    };
    let mut engine = Engine {
        config: &config,
        call: &call,
        runtime: rt,
        real: &real,
        watch: &NoWatch,
    };
    let out = f(&mut engine);
    (out, ran.into_inner())
}

#[test]
fn a_container_without_gpu_state_goes_to_runc_with_our_criu_and_our_record() {
    let dir = tempfile::tempdir().unwrap();
    let mut init = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let rt = FakeRuntime::with_container("c1", init.id() as i32);
    let images = dir.path().join("images");
    let line = format!("--root /r checkpoint --image-path {} c1", images.display());
    let (out, ran) = with_engine(&rt, &line, 0, |e| e.checkpoint());
    assert_eq!(out.unwrap(), 0);
    assert_eq!(ran, [format!("--criu /our/criu {line}")]);
    let rec = ArchiveRecord::read(&images).unwrap().unwrap();
    assert_eq!(rec.strategy, StrategyName::None);
    assert_eq!(rec.container, "c1");
    assert!(rec.gpu.is_none() && rec.frozen_by.is_none());
    // runc's own failure is the wrapper's.
    let (out, _) = with_engine(&rt, &line, 1, |e| e.checkpoint());
    assert_eq!(out.unwrap(), 1);
    let _ = init.kill();
    let _ = init.wait();
    // A container runc does not know: runc says so.
    let (out, ran) = with_engine(&rt, "checkpoint gone", 1, |e| e.checkpoint());
    assert_eq!(out.unwrap(), 1);
    assert_eq!(ran, ["--criu /our/criu checkpoint gone"]);
}

/// A record whose one CUDA process used simulated GPU 0.
fn gpu_record(images: &Path) {
    let gpus = crate::freeze::sim::sim_gpus();
    let rec = ArchiveRecord {
        schema: RECORD_SCHEMA.into(),
        version: RECORD_VERSION,
        tool_version: "t".into(),
        container: "c1".into(),
        processes: vec![],
        strategy: StrategyName::CudaDriver,
        frozen_by: Some("gpu-checkpoint, GPU backend sim".into()),
        given_gpus: Some(vec![gpus[0].uuid]),
        gpu: Some(GpuRecord {
            schema: crate::freeze::step::RECORD_SCHEMA,
            backend: GpuBackend::Sim,
            driver_version: Some("SIMULATED".into()),
            gpus,
            lock_timeout_ms: None,
            ordered: false,
            processes: vec![RecordedProcess {
                pid: 10,
                gpus: vec![],
                memory: vec![],
                steps: vec![],
            }],
            skipped: vec![],
            timings: StepTimings::default(),
            thaw: None,
        }),
        leave_running: false,
    };
    rec.write(images).unwrap();
}

#[test]
fn a_gpu_restore_is_refused_before_runc_runs() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let bundle = dir.path().join("bundle");
    std::fs::create_dir_all(&bundle).unwrap();
    let spec = |env: &[&str]| {
        let v = serde_json::json!({"process": {"env": env}});
        std::fs::write(bundle.join("config.json"), v.to_string()).unwrap();
    };
    let rt = FakeRuntime::default();
    let line = |detach: &str| {
        format!(
            "--root /r restore {detach} --image-path {} --bundle {} c2",
            images.display(),
            bundle.display()
        )
    };
    // No record: runc restores as it would.
    let (out, ran) = with_engine(&rt, &line("-d"), 0, |e| e.restore());
    assert_eq!(out.unwrap(), None);
    assert!(ran.is_empty(), "the caller execs runc");

    gpu_record(&images);
    let refused = |l: &str, env: &[&str], why: &str| {
        spec(env);
        let (out, ran) = with_engine(&rt, l, 0, |e| e.restore());
        let e = out.unwrap_err();
        assert!(e.to_string().contains(why), "{why:?} not in {e}");
        assert!(e.to_string().contains("nothing was created"), "{e}");
        assert!(ran.is_empty(), "runc ran: {ran:?}");
    };
    let gpu1 = format!(
        "NVIDIA_VISIBLE_DEVICES={}",
        crate::freeze::sim::sim_gpu_uuid(1)
    );
    let gpu9 = format!(
        "NVIDIA_VISIBLE_DEVICES={}",
        crate::freeze::sim::sim_gpu_uuid(9)
    );
    refused(&line(""), &[&gpu1], "--detach");
    refused(&line("-d"), &[], "given no GPU");
    refused(
        &line("-d"),
        &["NVIDIA_VISIBLE_DEVICES=void"],
        "given no GPU",
    );
    refused(&line("-d"), &[&gpu9], "not on this node");
    refused(&line("-d"), &["NVIDIA_VISIBLE_DEVICES=MIG-1"], "MIG");
    // A newer record: refused as unreadable.
    std::fs::write(
        images.join(RECORD_FILE),
        format!(r#"{{"schema": "{RECORD_SCHEMA}", "version": 99}}"#),
    )
    .unwrap();
    let (out, ran) = with_engine(&rt, &line("-d"), 0, |e| e.restore());
    assert!(out.unwrap_err().to_string().contains("reads up to"));
    assert!(ran.is_empty());
}

#[test]
fn only_checkpoint_and_restore_of_one_container_are_ours() {
    let c = config();
    assert!(matches!(
        plan(&call("--root /r checkpoint c1"), &c),
        Plan::Checkpoint
    ));
    assert!(matches!(plan(&call("restore -d c1"), &c), Plan::Restore));
    match plan(&call("--root /r state c1"), &c) {
        Plan::Exec(l) => assert_eq!(l, call("--root /r state c1").args, "unchanged"),
        _ => panic!("state is runc's"),
    }
    match plan(&call("checkpoint"), &c) {
        Plan::Exec(l) => assert_eq!(l[..2], [OsString::from("--criu"), "/our/criu".into()]),
        _ => panic!("no id: runc says what is wrong"),
    }
}
