//! The GPU step of the checkpoint and restore flows: which processes to freeze, the record kept in the
//! manifest, and the restore-time check that this node can take the checkpoint's GPU state.

use super::group::{self, Frozen, GroupOptions, Plan, ProcessRecord, Skipped};
use super::types::{DeviceMap, GpuInfo, GpuPair, GpuUuid, Op};
use super::{Error, GpuBackend, GpuDriver, Result};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Instant;

/// What [`super::GpuHook::thaw`] did: the GPU restore + unlock of each process `freeze` handled, with timings.
/// After a `--leave-running` checkpoint the GPU record keeps it as `thaw`.
pub type ThawRecord = Vec<ProcessRecord>;

/// Version of [`GpuRecord`]'s layout; bump on incompatible changes.
pub const RECORD_SCHEMA: u32 = 1;

/// One CUDA process of a checkpoint, as its [`GpuRecord`] keeps it (named apart from the typestate
/// [`super::GpuProcess`], which is a live process, and from [`ProcessRecord`], the transitions alone).
/// Device memory a process held on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuMemory {
    pub gpu: GpuUuid,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedProcess {
    pub pid: i32,
    /// The GPUs it used, when the backend can tell (NVML, or the simulator).
    #[serde(default)]
    pub gpus: Vec<GpuUuid>,
    /// The device memory it held on each, when the backend can tell: the restore's preflight checks
    /// the target GPUs have it free.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory: Vec<GpuMemory>,
    /// Its GPU transitions at checkpoint time, with timings.
    pub steps: Vec<group::StepRecord>,
}

/// Wall-clock times of the GPU step (parallel over processes).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepTimings {
    pub plan_ms: f64,
    pub freeze_ms: f64,
    /// The slowest process's lock and checkpoint.
    pub lock_ms: f64,
    pub checkpoint_ms: f64,
}

/// What the manifest keeps under `gpu`: enough to restore, and to explain what happened.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuRecord {
    pub schema: u32,
    pub backend: GpuBackend,
    pub driver_version: Option<String>,
    /// This node's GPUs at checkpoint time.
    pub gpus: Vec<GpuInfo>,
    pub lock_timeout_ms: Option<u64>,
    /// Locked one after another in the tree's order (processes sharing CUDA IPC memory): the restore
    /// restores and unlocks them in the same order.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ordered: bool,
    pub processes: Vec<RecordedProcess>,
    /// Processes of the tree left alone (no CUDA context).
    pub skipped: Vec<Skipped>,
    pub timings: StepTimings,
    /// With `--leave-running`: the GPU restore + unlock right after the dump, per process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thaw: Option<ThawRecord>,
}

impl GpuRecord {
    /// Reads a manifest's `gpu` (`null`: the checkpoint holds no GPU state). A record from a newer
    /// gpu-checkpoint is refused before it is parsed: its layout may have changed in ways that would
    /// otherwise be misread rather than rejected.
    pub fn from_manifest(value: &serde_json::Value) -> Result<Option<GpuRecord>> {
        if value.is_null() {
            return Ok(None);
        }
        let schema = value.get("schema").and_then(serde_json::Value::as_u64);
        if schema.is_some_and(|s| s > u64::from(RECORD_SCHEMA)) {
            return Err(Error::Record(format!(
                "GPU record schema {} is newer than this gpu-checkpoint understands ({RECORD_SCHEMA})",
                schema.unwrap_or_default()
            )));
        }
        serde_json::from_value(value.clone())
            .map(Some)
            .map_err(|e| Error::Record(e.to_string()))
    }

    pub fn pids(&self) -> Vec<i32> {
        self.processes.iter().map(|p| p.pid).collect()
    }

    /// The record with each process's PID replaced by `new_pid`'s answer: a container comes back from
    /// its runtime under new host PIDs (its processes keep only their PIDs inside its namespace), and
    /// the GPU restore acts on the PIDs of the record. PIDs it has no answer for stay.
    pub fn with_pids(&self, new_pid: impl Fn(i32) -> Option<i32>) -> GpuRecord {
        let mut r = self.clone();
        for p in &mut r.processes {
            p.pid = new_pid(p.pid).unwrap_or(p.pid);
        }
        for s in &mut r.skipped {
            s.pid = new_pid(s.pid).unwrap_or(s.pid);
        }
        r
    }

    /// The GPUs the checkpointed processes used: those reported per process, or every GPU of the node
    /// when the backend could not tell.
    pub fn used_gpus(&self) -> Vec<&GpuInfo> {
        let named: Vec<GpuUuid> = self
            .processes
            .iter()
            .flat_map(|p| p.gpus.iter().copied())
            .collect();
        if named.is_empty() {
            return self.gpus.iter().collect();
        }
        self.gpus
            .iter()
            .filter(|g| named.contains(&g.uuid))
            .collect()
    }
}

fn max_ms(records: &[ProcessRecord], op: Op) -> f64 {
    records.iter().map(|r| r.ms(op)).fold(0.0, f64::max)
}

/// The GPU step: owns the driver and, between freeze and thaw, the frozen processes.
pub struct GpuStep {
    driver: Arc<dyn GpuDriver>,
    opts: GroupOptions,
    frozen: Option<Frozen>,
}

impl GpuStep {
    pub fn new(driver: Arc<dyn GpuDriver>, opts: GroupOptions) -> Self {
        GpuStep {
            driver,
            opts,
            frozen: None,
        }
    }

    pub fn driver(&self) -> &Arc<dyn GpuDriver> {
        &self.driver
    }

    pub fn backend(&self) -> GpuBackend {
        self.driver.backend()
    }

    /// Sorts `candidates` (the tree's processes detect found GPU state in) into CUDA processes and
    /// processes left alone, then locks and checkpoints the CUDA ones. On error every process runs as
    /// before (see [`group::freeze_all`]).
    pub fn freeze(&mut self, candidates: &[i32]) -> Result<GpuRecord> {
        self.freeze_with(candidates, None)
    }

    /// [`GpuStep::freeze`], waiting at `after_lock` once every CUDA process is locked (see
    /// [`group::freeze_all_with`]).
    pub fn freeze_with(
        &mut self,
        candidates: &[i32],
        after_lock: Option<&super::AfterLock<'_>>,
    ) -> Result<GpuRecord> {
        let t = Instant::now();
        let plan: Plan = group::plan(self.driver.as_ref(), candidates)?;
        for s in &plan.skipped {
            tracing::info!("pid {} has no CUDA state; left alone: {}", s.pid, s.reason);
        }
        let plan_ms = t.elapsed().as_secs_f64() * 1000.0;
        let gpus = self.driver.gpus().unwrap_or_else(|e| {
            tracing::warn!("cannot list this node's GPUs for the manifest: {e}");
            Vec::new()
        });
        let per_process: Vec<(i32, Vec<GpuUuid>, Vec<GpuMemory>)> = plan
            .cuda
            .iter()
            .map(|&pid| {
                (
                    pid,
                    self.driver.process_gpus(pid).unwrap_or_default(),
                    self.driver.process_memory(pid).unwrap_or_default(),
                )
            })
            .collect();
        let t = Instant::now();
        let frozen = group::freeze_all_with(&self.driver, &plan.cuda, &self.opts, after_lock)?;
        let freeze_ms = t.elapsed().as_secs_f64() * 1000.0;
        let records = frozen.records().to_vec();
        self.frozen = Some(frozen);
        Ok(GpuRecord {
            schema: RECORD_SCHEMA,
            backend: self.driver.backend(),
            driver_version: self.driver.driver_version(),
            gpus,
            lock_timeout_ms: self.opts.lock_timeout.map(|d| d.as_millis() as u64),
            ordered: self.opts.ordered,
            processes: per_process
                .into_iter()
                .map(|(pid, gpus, memory)| RecordedProcess {
                    pid,
                    gpus,
                    memory,
                    steps: records
                        .iter()
                        .find(|r| r.pid == pid)
                        .map(|r| r.steps.clone())
                        .unwrap_or_default(),
                })
                .collect(),
            skipped: plan.skipped,
            thaw: None,
            timings: StepTimings {
                plan_ms,
                freeze_ms,
                lock_ms: max_ms(&records, Op::Lock),
                checkpoint_ms: max_ms(&records, Op::Checkpoint),
            },
        })
    }

    /// GPU restore + unlock of the frozen processes (after a `--leave-running` dump, or on failure).
    /// Does nothing when nothing is frozen.
    pub fn thaw(&mut self) -> Result<Vec<ProcessRecord>> {
        match self.frozen.take() {
            None => Ok(Vec::new()),
            Some(f) => f.thaw().map_err(|(e, _)| e),
        }
    }

    /// The checkpoint is durable and the tree is about to be stopped: its processes stay CHECKPOINTED.
    pub fn committed(&mut self) {
        if let Some(f) = self.frozen.take() {
            f.finish();
        }
    }

    /// Checks that this node can take `record`'s GPU state and returns the GPU pairs to restore with.
    pub fn prepare_restore(
        &self,
        record: &GpuRecord,
        map: Option<&DeviceMap>,
    ) -> Result<Vec<GpuPair>> {
        if record.processes.is_empty() {
            return Ok(Vec::new());
        }
        let node = self.driver.gpus()?;
        let pairs = match_gpus(record, &node, map)?;
        check_free_memory(self.driver.as_ref(), record, &pairs)?;
        // Refused here, before CRIU restores anything, rather than by the driver after it.
        if pairs.iter().any(|p| p.old != p.new) && !self.driver.supports_migration() {
            return Err(Error::MigrationUnsupported {
                version: self.driver.driver_version().unwrap_or_default(),
            });
        }
        Ok(pairs)
    }

    /// After CRIU restored the tree: restore every process's GPU state, then unlock all. On error
    /// nothing was unlocked; the caller stops the restored copy.
    pub fn finish_restore(
        &self,
        record: &GpuRecord,
        pairs: &[GpuPair],
    ) -> Result<Vec<ProcessRecord>> {
        self.finish_restore_with(record, pairs, &|| Ok(()))
    }

    /// [`GpuStep::finish_restore`], waiting at `before_unlock` once every process's GPU state is
    /// restored and before any is unlocked (see [`group::restore_all_with`]).
    pub fn finish_restore_with(
        &self,
        record: &GpuRecord,
        pairs: &[GpuPair],
        before_unlock: &(dyn Fn() -> Result<()> + Sync),
    ) -> Result<Vec<ProcessRecord>> {
        group::restore_all_with(
            &self.driver,
            &record.pids(),
            pairs,
            record.ordered,
            before_unlock,
        )
        .map_err(|(e, _)| e)
    }
}

/// The restore's preflight against the known stuck-process failure: a GPU restore that runs out of device
/// memory leaves the process stuck for good. Each target GPU (after the device map) must have free what
/// the checkpoint's processes held on the GPUs mapped to it. Skipped for a GPU whose free memory the
/// backend cannot tell.
fn check_free_memory(driver: &dyn GpuDriver, record: &GpuRecord, pairs: &[GpuPair]) -> Result<()> {
    let target = |old: &GpuUuid| pairs.iter().find(|p| p.old == *old).map_or(*old, |p| p.new);
    let mut need: Vec<(GpuUuid, u64)> = Vec::new();
    for m in record.processes.iter().flat_map(|p| &p.memory) {
        let t = target(&m.gpu);
        match need.iter_mut().find(|(g, _)| *g == t) {
            Some((_, n)) => *n += m.bytes,
            None => need.push((t, m.bytes)),
        }
    }
    for (gpu, need) in need {
        if let Some(free) = driver.free_memory(&gpu) {
            if free < need {
                return Err(Error::NotEnoughGpuMemory { gpu, need, free });
            }
        }
    }
    Ok(())
}

fn describe(gpus: &[&GpuInfo]) -> String {
    if gpus.is_empty() {
        return "no GPU".into();
    }
    let v: Vec<String> = gpus
        .iter()
        .map(|g| format!("{} {} ({})", g.index, g.model, g.uuid))
        .collect();
    v.join(", ")
}

/// Decides the GPU pairs for a restore on a node with `node` GPUs.
///
/// Without a map: the node must have as many GPUs as the checkpoint's node, of the same models (index
/// by index); the driver restores onto the same indices, so no pairs are passed. With a map: every GPU
/// the checkpoint used must be mapped (or be present here under its own UUID), onto a GPU of the same
/// model with at least as much memory.
pub fn match_gpus(
    record: &GpuRecord,
    node: &[GpuInfo],
    map: Option<&DeviceMap>,
) -> Result<Vec<GpuPair>> {
    let used = record.used_gpus();
    let Some(map) = map else {
        let saved: Vec<&GpuInfo> = record.gpus.iter().collect();
        let here: Vec<&GpuInfo> = node.iter().collect();
        let same =
            saved.len() == here.len() && saved.iter().zip(&here).all(|(a, b)| a.model == b.model);
        if !same {
            return Err(Error::GpuMismatch(format!(
                "the checkpoint was taken with {}; this node has {}",
                describe(&saved),
                describe(&here)
            )));
        }
        return Ok(Vec::new());
    };
    let mut pairs = map.resolve(&record.gpus, node)?;
    for old in &used {
        if pairs.iter().any(|p| p.old == old.uuid) {
            continue;
        }
        if node.iter().any(|g| g.uuid == old.uuid) && !pairs.iter().any(|p| p.new == old.uuid) {
            pairs.push(GpuPair {
                old: old.uuid,
                new: old.uuid,
            });
        } else {
            return Err(Error::GpuMismatch(format!(
                "GPU {} ({}) used by the checkpoint is neither here nor in --device-map",
                old.uuid, old.model
            )));
        }
    }
    for p in &pairs {
        let new = node.iter().find(|g| g.uuid == p.new).ok_or_else(|| {
            Error::GpuMismatch(format!("target GPU {} is not on this node", p.new))
        })?;
        if let Some(old) = record.gpus.iter().find(|g| g.uuid == p.old) {
            if old.model != new.model {
                return Err(Error::GpuMismatch(format!(
                    "{} is a {}, its target {} a {} (restore needs the same chip)",
                    old.uuid, old.model, new.uuid, new.model
                )));
            }
            if let (Some(a), Some(b)) = (old.memory_bytes, new.memory_bytes) {
                if b < a {
                    return Err(Error::GpuMismatch(format!(
                        "target {} has {b} bytes of memory, less than {} had ({a})",
                        new.uuid, old.uuid
                    )));
                }
            }
        }
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeDriver;
    use super::super::{CuError, ProcessState};
    use super::*;

    fn gpu(index: u32, last: u8, model: &str) -> GpuInfo {
        let mut u = [0u8; 16];
        u[15] = last;
        GpuInfo {
            index,
            uuid: GpuUuid(u),
            model: model.into(),
            memory_bytes: Some(80 << 30),
        }
    }

    fn record(gpus: Vec<GpuInfo>, used: Vec<GpuUuid>) -> GpuRecord {
        GpuRecord {
            schema: RECORD_SCHEMA,
            ordered: false,
            backend: GpuBackend::Fake,
            driver_version: None,
            gpus,
            lock_timeout_ms: Some(10_000),
            processes: vec![RecordedProcess {
                memory: vec![],
                pid: 1,
                gpus: used,
                steps: vec![],
            }],
            skipped: vec![],
            thaw: None,
            timings: StepTimings::default(),
        }
    }

    #[test]
    fn same_count_and_models_need_no_map() {
        let r = record(vec![gpu(0, 1, "H200"), gpu(1, 2, "H200")], vec![]);
        let here = [gpu(0, 9, "H200"), gpu(1, 8, "H200")];
        assert_eq!(match_gpus(&r, &here, None).unwrap(), vec![]);
        let e = match_gpus(&r, &here[..1], None).unwrap_err();
        assert!(matches!(e, Error::GpuMismatch(_)), "{e}");
        assert!(e.to_string().contains("--device-map"), "{e}");
        let other = [gpu(0, 9, "H200"), gpu(1, 8, "A100")];
        assert!(match_gpus(&r, &other, None).is_err());
    }

    #[test]
    fn a_map_must_cover_the_used_gpus_with_the_same_chip() {
        let r = record(
            vec![gpu(0, 1, "H200"), gpu(1, 2, "H200")],
            vec![GpuUuid({
                let mut u = [0; 16];
                u[15] = 2;
                u
            })],
        );
        let here = [gpu(0, 9, "H200"), gpu(1, 8, "A100")];
        // Only GPU 1 (…02) was used: mapping it to local 0 is enough.
        let pairs = match_gpus(&r, &here, Some(&"1=0".parse().unwrap())).unwrap();
        assert_eq!(pairs.len(), 1);
        assert_eq!(pairs[0].new, here[0].uuid);
        // Onto another chip: refused.
        let e = match_gpus(&r, &here, Some(&"1=1".parse().unwrap())).unwrap_err();
        assert!(e.to_string().contains("same chip"), "{e}");
        // Map that leaves the used GPU out, and it is not here: refused.
        let e = match_gpus(&r, &here, Some(&"0=0".parse().unwrap())).unwrap_err();
        assert!(e.to_string().contains("neither here nor"), "{e}");
    }

    #[test]
    fn step_freezes_only_cuda_processes_and_records_timings() {
        let d = Arc::new(FakeDriver::new());
        d.add(10);
        d.add(11);
        let dd: Arc<dyn GpuDriver> = d.clone();
        let mut step = GpuStep::new(dd, GroupOptions::default());
        let rec = step.freeze(&[10, 11, 12]).unwrap();
        assert_eq!(rec.pids(), vec![10, 11]);
        assert_eq!(rec.skipped.len(), 1);
        assert_eq!(rec.skipped[0].pid, 12);
        assert_eq!(rec.processes[0].steps.len(), 2);
        let json = serde_json::to_value(&rec).unwrap();
        assert_eq!(serde_json::from_value::<GpuRecord>(json).unwrap(), rec);
        assert_eq!(d.state(10).unwrap(), ProcessState::Checkpointed);
        step.thaw().unwrap();
        assert_eq!(d.state(10).unwrap(), ProcessState::Running);
        assert_eq!(d.state(11).unwrap(), ProcessState::Running);
    }

    #[test]
    fn committed_keeps_state_and_restore_brings_it_back() {
        let d = Arc::new(FakeDriver::new());
        d.add(20);
        let dd: Arc<dyn GpuDriver> = d.clone();
        let mut step = GpuStep::new(Arc::clone(&dd), GroupOptions::default());
        let rec = step.freeze(&[20]).unwrap();
        step.committed();
        drop(step);
        assert_eq!(d.state(20).unwrap(), ProcessState::Checkpointed);
        let step = GpuStep::new(dd, GroupOptions::default());
        let pairs = step.prepare_restore(&rec, None).unwrap();
        d.fail_next(20, Op::Restore, CuError::OutOfMemory);
        assert!(step.finish_restore(&rec, &pairs).is_err());
        step.finish_restore(&rec, &pairs).unwrap();
        assert_eq!(d.state(20).unwrap(), ProcessState::Running);
    }

    #[test]
    fn the_manifest_reads_and_writes_the_record_as_it_always_did() {
        // As the GPU hook wrote it when it handed the flow JSON: `thaw` only when a thaw returned one.
        let written = serde_json::json!({
            "schema": 1, "backend": "fake", "driver_version": null, "gpus": [], "lock_timeout_ms": 10000,
            "processes": [{"pid": 1, "gpus": [], "steps": [{"op": "lock", "ok": true, "ms": 1.5}]}],
            "skipped": [{"pid": 2, "reason": "no CUDA context"}],
            "timings": {"plan_ms": 0.5, "freeze_ms": 2.0, "lock_ms": 1.5, "checkpoint_ms": 0.0},
        });
        let rec = GpuRecord::from_manifest(&written).unwrap().unwrap();
        assert_eq!(rec.pids(), vec![1]);
        assert_eq!(serde_json::to_value(&rec).unwrap(), written);
        let mut thawed = written.clone();
        thawed["thaw"] = serde_json::json!([{"pid": 1, "steps": []}]);
        let rec = GpuRecord::from_manifest(&thawed).unwrap().unwrap();
        assert_eq!(rec.thaw, Some(vec![ProcessRecord::new(1)]));
        assert_eq!(serde_json::to_value(&rec).unwrap(), thawed);
        // No GPU state: `null`, both ways.
        assert_eq!(
            GpuRecord::from_manifest(&serde_json::Value::Null).unwrap(),
            None
        );
        assert!(serde_json::to_value(None::<GpuRecord>).unwrap().is_null());
        // A newer record is refused by its schema, before its layout is looked at.
        let e = GpuRecord::from_manifest(&serde_json::json!({"schema": RECORD_SCHEMA + 1}))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "the checkpoint's GPU record is unreadable: GPU record schema 2 is newer than this \
             gpu-checkpoint understands (1)"
        );
        assert!(matches!(
            GpuRecord::from_manifest(&serde_json::json!({"schema": 1})),
            Err(Error::Record(_))
        ));
    }
}
