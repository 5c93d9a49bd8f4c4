//! What a checkpoint taken through the engines' path carries for its restore (KEP-6274: the driver stack,
//! the GPUs and their memory, checked before anything is created), kept in the engine's own archive as
//! one more file of its images folder, and which GPUs a container was given.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::Error;
use crate::detect::StrategyName;
use crate::flows::manifest::ContainerProcess;
use crate::freeze::{DeviceMap, DeviceRef, GpuInfo, GpuRecord, GpuUuid};

/// The record's file in the images folder (`checkpoint/gpu-checkpoint.json` in the engines' archives).
pub const RECORD_FILE: &str = "gpu-checkpoint.json";
/// `schema` of [`ArchiveRecord`].
pub const RECORD_SCHEMA: &str = "gpu-checkpoint/engine-checkpoint";
/// The newest layout this build reads; bump on incompatible changes.
pub const RECORD_VERSION: u32 = 1;

/// The variable the NVIDIA container toolkit and device plugin name a container's GPUs with.
pub const GPU_ENV: &str = "NVIDIA_VISIBLE_DEVICES";

/// See the module documentation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArchiveRecord {
    pub schema: String,
    pub version: u32,
    pub tool_version: String,
    /// The runtime's container id at checkpoint time.
    pub container: String,
    /// Its processes (host PID, PID inside the container): the restore finds them again through the
    /// latter.
    pub processes: Vec<ContainerProcess>,
    pub strategy: StrategyName,
    /// Who froze the GPU state: `gpu-checkpoint` and its backend (`cuda-driver`, `cuda-cli`, `sim`).
    pub frozen_by: Option<String>,
    /// The GPUs the container was given ([`GPU_ENV`] of its spec, as this node's UUIDs), in order; `None`
    /// when its spec names none.
    pub given_gpus: Option<Vec<GpuUuid>>,
    /// The freeze stage's record: driver version, this node's GPUs (models, memory), each CUDA process's
    /// GPUs, device memory and lock / checkpoint steps. `None`: no GPU state.
    pub gpu: Option<GpuRecord>,
    /// The container ran on after the checkpoint.
    pub leave_running: bool,
}

impl ArchiveRecord {
    /// Writes the record into the images folder `images`.
    pub fn write(&self, images: &Path) -> Result<(), Error> {
        let path = images.join(RECORD_FILE);
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| Error::Io(format!("{e}")))?;
        // Before runc's checkpoint the folder may not exist yet (runc makes it, private, as here).
        crate::util::create_private_dir_all(images)
            .map_err(|e| Error::Io(format!("creating {}: {e}", images.display())))?;
        crate::util::write_atomic(&path, &bytes)
            .map_err(|e| Error::Io(format!("writing {}: {e}", path.display())))
    }

    /// The record in `images`, `None` when there is none (a checkpoint taken without us, or of a
    /// container without GPU state by an older wrapper). One from a newer gpu-checkpoint is refused.
    pub fn read(images: &Path) -> Result<Option<ArchiveRecord>, Error> {
        let path = images.join(RECORD_FILE);
        let bad = |reason: String| Error::Record {
            path: path.clone(),
            reason,
        };
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(bad(e.to_string())),
        };
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        if v.get("schema").and_then(|s| s.as_str()) != Some(RECORD_SCHEMA) {
            return Err(bad(format!("not a {RECORD_SCHEMA} record")));
        }
        let version = v.get("version").and_then(|s| s.as_u64()).unwrap_or(0);
        if version == 0 || version > u64::from(RECORD_VERSION) {
            return Err(bad(format!(
                "version {version}; this gpu-checkpoint reads up to {RECORD_VERSION}"
            )));
        }
        let rec: ArchiveRecord = serde_json::from_value(v).map_err(|e| bad(e.to_string()))?;
        // The freeze stage's own record checks its own schema.
        if let Some(g) = &rec.gpu {
            let value = serde_json::to_value(g).map_err(|e| bad(e.to_string()))?;
            GpuRecord::from_manifest(&value).map_err(|e| bad(e.to_string()))?;
        }
        Ok(Some(rec))
    }

    /// The record's GPU state, when it holds any.
    pub fn gpu_state(&self) -> Option<&GpuRecord> {
        self.gpu.as_ref().filter(|g| !g.processes.is_empty())
    }

    /// The checkpoint's GPUs, in order: those the container was given, else those its processes used.
    pub fn checkpoint_gpus(&self) -> Vec<GpuUuid> {
        if let Some(given) = self.given_gpus.as_ref().filter(|g| !g.is_empty()) {
            return given.clone();
        }
        let mut used: Vec<&GpuInfo> = self
            .gpu_state()
            .map(GpuRecord::used_gpus)
            .unwrap_or_default();
        used.sort_by_key(|g| g.index);
        used.iter().map(|g| g.uuid).collect()
    }
}

/// What a container's spec says of its GPUs ([`GPU_ENV`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Given {
    /// The variable is not set.
    Unset,
    /// `none`, `void` or empty: no GPU.
    Nothing,
    /// `all`: every GPU of the node.
    All,
    /// Indices or UUIDs, in the order given.
    Some(Vec<DeviceRef>),
}

/// The GPUs the OCI spec `spec` (a bundle's `config.json`) gives its container.
pub fn given_gpus(spec: &serde_json::Value) -> Result<Given, String> {
    let value = spec["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str()?.strip_prefix(GPU_ENV)?.strip_prefix('='))
        .next_back();
    let Some(value) = value.map(str::trim) else {
        return Ok(Given::Unset);
    };
    match value {
        "" | "none" | "void" => Ok(Given::Nothing),
        "all" => Ok(Given::All),
        list => list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                if s.starts_with("MIG-") {
                    return Err(format!(
                        "{GPU_ENV} names a MIG instance ({s}): the CUDA checkpoint does not support MIG"
                    ));
                }
                s.parse::<DeviceRef>().map_err(|e| e.to_string())
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Given::Some),
    }
}

/// `given` as GPUs of this node (`node`), in its order; `None` for [`Given::Unset`]. A GPU that is not on
/// this node is an error naming it.
pub fn resolve(given: &Given, node: &[GpuInfo]) -> Result<Option<Vec<GpuInfo>>, String> {
    match given {
        Given::Unset => Ok(None),
        Given::Nothing => Ok(Some(Vec::new())),
        Given::All => Ok(Some(node.to_vec())),
        Given::Some(refs) => refs
            .iter()
            .map(|r| {
                node.iter()
                    .find(|g| match r {
                        DeviceRef::Index(i) => g.index == *i,
                        DeviceRef::Uuid(u) => g.uuid == *u,
                    })
                    .cloned()
                    .ok_or_else(|| {
                        let name = match r {
                            DeviceRef::Index(i) => format!("GPU {i}"),
                            DeviceRef::Uuid(u) => u.to_string(),
                        };
                        format!("the container was given {name}, which is not on this node")
                    })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
    }
}

/// The device map of a restore: the checkpoint's GPUs, in order, onto the GPUs the new container was
/// given, in order (KEP-6274). Fewer GPUs given than the checkpoint had is an error.
pub fn restore_map(record: &ArchiveRecord, given: &[GpuInfo]) -> Result<DeviceMap, String> {
    let old = record.checkpoint_gpus();
    if old.len() > given.len() {
        let names = |v: Vec<String>| {
            if v.is_empty() {
                "none".into()
            } else {
                v.join(", ")
            }
        };
        return Err(format!(
            "the checkpoint ran on {} GPU(s) ({}); the container was given {} ({})",
            old.len(),
            names(old.iter().map(ToString::to_string).collect()),
            given.len(),
            names(given.iter().map(|g| g.uuid.to_string()).collect()),
        ));
    }
    Ok(DeviceMap(
        old.iter()
            .zip(given)
            .map(|(o, n)| (DeviceRef::Uuid(*o), DeviceRef::Uuid(n.uuid)))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::freeze::sim::{sim_gpu_uuid, sim_gpus};

    fn spec(env: &[&str]) -> serde_json::Value {
        serde_json::json!({"process": {"env": env}})
    }

    #[test]
    fn the_gpus_a_spec_gives() {
        assert_eq!(given_gpus(&spec(&["PATH=/bin"])).unwrap(), Given::Unset);
        assert_eq!(
            given_gpus(&spec(&["NVIDIA_VISIBLE_DEVICES=void"])).unwrap(),
            Given::Nothing
        );
        assert_eq!(
            given_gpus(&spec(&["NVIDIA_VISIBLE_DEVICES=all"])).unwrap(),
            Given::All
        );
        let u = sim_gpu_uuid(1);
        let g = given_gpus(&spec(&[&format!("NVIDIA_VISIBLE_DEVICES={u},0")])).unwrap();
        assert_eq!(
            g,
            Given::Some(vec![DeviceRef::Uuid(u), DeviceRef::Index(0)])
        );
        // The last setting wins, as in a process environment.
        let g = given_gpus(&spec(&[
            "NVIDIA_VISIBLE_DEVICES=0",
            "NVIDIA_VISIBLE_DEVICES=1",
        ]))
        .unwrap();
        assert_eq!(g, Given::Some(vec![DeviceRef::Index(1)]));
        let e = given_gpus(&spec(&["NVIDIA_VISIBLE_DEVICES=MIG-1234"])).unwrap_err();
        assert!(e.contains("MIG"), "{e}");
        assert!(given_gpus(&spec(&["NVIDIA_VISIBLE_DEVICES=GPU-zz"])).is_err());
    }

    #[test]
    fn given_gpus_resolve_on_this_node_in_order() {
        let node = sim_gpus();
        let g = Given::Some(vec![DeviceRef::Uuid(node[1].uuid), DeviceRef::Index(0)]);
        let r = resolve(&g, &node).unwrap().unwrap();
        assert_eq!(r, vec![node[1].clone(), node[0].clone()]);
        assert_eq!(resolve(&Given::Unset, &node).unwrap(), None);
        assert_eq!(
            resolve(&Given::All, &node).unwrap().unwrap().len(),
            node.len()
        );
        let e = resolve(&Given::Some(vec![DeviceRef::Uuid(sim_gpu_uuid(9))]), &node).unwrap_err();
        assert!(e.contains("not on this node"), "{e}");
    }

    #[test]
    fn the_checkpoints_gpus_map_in_order_onto_the_given_ones() {
        let node = sim_gpus();
        let mut rec = ArchiveRecord {
            schema: RECORD_SCHEMA.into(),
            version: RECORD_VERSION,
            tool_version: "t".into(),
            container: "c".into(),
            processes: vec![],
            strategy: StrategyName::CudaDriver,
            frozen_by: None,
            given_gpus: Some(vec![node[0].uuid]),
            gpu: None,
            leave_running: true,
        };
        let map = restore_map(&rec, &node[1..]).unwrap();
        assert_eq!(
            map.0,
            vec![(DeviceRef::Uuid(node[0].uuid), DeviceRef::Uuid(node[1].uuid))]
        );
        let e = restore_map(&rec, &[]).unwrap_err();
        assert!(e.contains("given 0 (none)"), "{e}");
        rec.given_gpus = None;
        assert!(restore_map(&rec, &[]).unwrap().0.is_empty());
    }

    #[test]
    fn the_record_round_trips_and_a_newer_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ArchiveRecord::read(dir.path()).unwrap().is_none());
        let rec = ArchiveRecord {
            schema: RECORD_SCHEMA.into(),
            version: RECORD_VERSION,
            tool_version: "t".into(),
            container: "c".into(),
            processes: vec![ContainerProcess { pid: 10, ns_pid: 1 }],
            strategy: StrategyName::None,
            frozen_by: None,
            given_gpus: None,
            gpu: None,
            leave_running: false,
        };
        rec.write(dir.path()).unwrap();
        assert_eq!(ArchiveRecord::read(dir.path()).unwrap(), Some(rec));
        std::fs::write(
            dir.path().join(RECORD_FILE),
            format!(
                r#"{{"schema": "{RECORD_SCHEMA}", "version": {}}}"#,
                RECORD_VERSION + 1
            ),
        )
        .unwrap();
        let e = ArchiveRecord::read(dir.path()).unwrap_err();
        assert!(e.to_string().contains("reads up to"), "{e}");
    }
}
