//! Values shared by every backend: process states, CUDA result codes, GPU identities, device maps.

use super::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use strum::VariantArray;

/// `CUprocessState`, the driver's view of a process. Named in lower case (`running`, ...) in JSON, in
/// messages and as [`FromStr`] reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[derive(strum::IntoStaticStr, strum::Display, strum::VariantArray)]
#[strum(serialize_all = "lowercase")]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    /// A checkpoint or restore failed inside the driver; the process cannot continue on the GPU.
    Failed,
    /// Only with CUDA 13.4 custom storage (an operation is in progress).
    Checkpointing,
    Restoring,
}

impl ProcessState {
    /// Decodes `CUprocessState`; unknown values are an error rather than a guess.
    pub fn from_raw(v: u32) -> Option<Self> {
        Some(match v {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            3 => ProcessState::Failed,
            4 => ProcessState::Checkpointing,
            5 => ProcessState::Restoring,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Reads a state as `cuda-checkpoint --get-state` prints it: any case, surrounding blanks ignored.
/// (Not strum's `EnumString`, which neither trims nor reports `()`.)
impl FromStr for ProcessState {
    type Err = ();
    fn from_str(s: &str) -> std::result::Result<Self, ()> {
        let s = s.trim();
        ProcessState::VARIANTS
            .iter()
            .copied()
            .find(|v| v.as_str().eq_ignore_ascii_case(s))
            .ok_or(())
    }
}

/// The operations of the checkpoint API (for errors, timings and the manifest).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[derive(strum::IntoStaticStr, strum::VariantArray)]
#[strum(serialize_all = "kebab-case")]
pub enum Op {
    State,
    Lock,
    Checkpoint,
    Restore,
    Unlock,
    RestoreTid,
}

impl Op {
    /// The name used in JSON (`lock`, `restore-tid`, ...).
    pub fn key(self) -> &'static str {
        self.into()
    }

    /// The operation in words, for messages: the name, but for the two queries.
    pub fn as_str(self) -> &'static str {
        match self {
            Op::State => "state query",
            Op::RestoreTid => "restore thread id query",
            _ => self.key(),
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A failing `CUresult`, typed. The numbers are the driver's (cuda.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CuError {
    InvalidValue,
    OutOfMemory,
    NotInitialized,
    Deinitialized,
    NoDevice,
    InvalidDevice,
    InvalidContext,
    OperatingSystem,
    NotPermitted,
    IllegalState,
    NotFound,
    /// On lock: the timeout expired before submitted work finished; the process stays RUNNING.
    NotReady,
    NotSupported,
    Timeout,
    Unknown,
    Other(i32),
}

impl CuError {
    /// Maps a `CUresult`; `None` for `CUDA_SUCCESS`.
    pub fn from_code(code: i32) -> Option<Self> {
        Some(match code {
            0 => return None,
            1 => CuError::InvalidValue,
            2 => CuError::OutOfMemory,
            3 => CuError::NotInitialized,
            4 => CuError::Deinitialized,
            100 => CuError::NoDevice,
            101 => CuError::InvalidDevice,
            201 => CuError::InvalidContext,
            304 => CuError::OperatingSystem,
            401 => CuError::IllegalState,
            500 => CuError::NotFound,
            600 => CuError::NotReady,
            800 => CuError::NotPermitted,
            801 => CuError::NotSupported,
            909 => CuError::Timeout,
            999 => CuError::Unknown,
            other => CuError::Other(other),
        })
    }

    pub fn code(self) -> i32 {
        match self {
            CuError::InvalidValue => 1,
            CuError::OutOfMemory => 2,
            CuError::NotInitialized => 3,
            CuError::Deinitialized => 4,
            CuError::NoDevice => 100,
            CuError::InvalidDevice => 101,
            CuError::InvalidContext => 201,
            CuError::OperatingSystem => 304,
            CuError::IllegalState => 401,
            CuError::NotFound => 500,
            CuError::NotReady => 600,
            CuError::NotPermitted => 800,
            CuError::NotSupported => 801,
            CuError::Timeout => 909,
            CuError::Unknown => 999,
            CuError::Other(c) => c,
        }
    }

    /// The name in cuda.h.
    pub fn name(self) -> String {
        match self {
            CuError::InvalidValue => "CUDA_ERROR_INVALID_VALUE".into(),
            CuError::OutOfMemory => "CUDA_ERROR_OUT_OF_MEMORY".into(),
            CuError::NotInitialized => "CUDA_ERROR_NOT_INITIALIZED".into(),
            CuError::Deinitialized => "CUDA_ERROR_DEINITIALIZED".into(),
            CuError::NoDevice => "CUDA_ERROR_NO_DEVICE".into(),
            CuError::InvalidDevice => "CUDA_ERROR_INVALID_DEVICE".into(),
            CuError::InvalidContext => "CUDA_ERROR_INVALID_CONTEXT".into(),
            CuError::OperatingSystem => "CUDA_ERROR_OPERATING_SYSTEM".into(),
            CuError::IllegalState => "CUDA_ERROR_ILLEGAL_STATE".into(),
            CuError::NotFound => "CUDA_ERROR_NOT_FOUND".into(),
            CuError::NotReady => "CUDA_ERROR_NOT_READY".into(),
            CuError::NotPermitted => "CUDA_ERROR_NOT_PERMITTED".into(),
            CuError::NotSupported => "CUDA_ERROR_NOT_SUPPORTED".into(),
            CuError::Timeout => "CUDA_ERROR_TIMEOUT".into(),
            CuError::Unknown => "CUDA_ERROR_UNKNOWN".into(),
            CuError::Other(c) => format!("CUresult {c}"),
        }
    }

    /// Parses a `CUDA_ERROR_*` name (as `cuda-checkpoint` prints them).
    pub fn from_name(name: &str) -> Option<Self> {
        const KNOWN: [i32; 15] = [
            1, 2, 3, 4, 100, 101, 201, 304, 401, 500, 600, 800, 801, 909, 999,
        ];
        KNOWN
            .iter()
            .filter_map(|&c| CuError::from_code(c))
            .find(|e| e.name() == name)
    }

    /// What the code means for a checkpoint operation, in words a user can act on.
    pub fn meaning(self) -> &'static str {
        match self {
            CuError::NotReady => "lock timed out: submitted GPU work did not finish in time; the process keeps running",
            CuError::IllegalState => "the process is not in the state this operation needs",
            CuError::NotSupported => "the process uses GPU features the driver cannot checkpoint (UVM/managed memory, IPC, MPS, MIG) or the driver lacks the feature",
            CuError::OutOfMemory => "not enough GPU (or host) memory",
            CuError::OperatingSystem => "the driver hit an operating-system error",
            CuError::NotInitialized => "the process has no CUDA context (or the driver was not initialised)",
            CuError::NotFound => "no CUDA state found for the process",
            CuError::InvalidValue => "invalid argument",
            CuError::InvalidDevice | CuError::NoDevice => "no such or unusable GPU",
            CuError::NotPermitted => "not permitted",
            CuError::Timeout => "timed out",
            _ => "driver error",
        }
    }

    /// Codes that mean "nothing to checkpoint here" rather than a failure.
    pub fn is_no_cuda(self) -> bool {
        matches!(
            self,
            CuError::NotInitialized | CuError::NotSupported | CuError::NotFound
        )
    }

    pub fn is_permission(self) -> bool {
        matches!(self, CuError::NotPermitted)
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.name(), self.code(), self.meaning())
    }
}

/// A GPU's UUID (`CUuuid`, 16 bytes), written `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` as NVML and
/// nvidia-smi do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuUuid(pub [u8; 16]);

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let h = format!("{:032x}", u128::from_be_bytes(self.0));
        write!(
            f,
            "GPU-{}-{}-{}-{}-{}",
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        )
    }
}

impl FromStr for GpuUuid {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let body = s.trim();
        let body = body.strip_prefix("GPU-").unwrap_or(body);
        let hexdigits: String = body.chars().filter(|c| *c != '-').collect();
        // from_str_radix alone would take a sign.
        let value = (hexdigits.len() == 32 && hexdigits.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| u128::from_str_radix(&hexdigits, 16).ok())
            .flatten();
        let Some(value) = value else {
            return Err(Error::DeviceMap(format!(
                "`{s}` is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
            )));
        };
        Ok(GpuUuid(value.to_be_bytes()))
    }
}

impl Serialize for GpuUuid {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GpuUuid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// One restore remapping: the GPU a process was checkpointed on, and the GPU it continues on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPair {
    pub old: GpuUuid,
    pub new: GpuUuid,
}

/// A GPU as seen on a node (for the manifest and the restore-time match).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: GpuUuid,
    pub model: String,
    /// Total memory in bytes, when known.
    pub memory_bytes: Option<u64>,
}

/// One side of a `--device-map` entry: an index on a node, or a UUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceRef {
    Index(u32),
    Uuid(GpuUuid),
}

impl DeviceRef {
    fn resolve(self, gpus: &[GpuInfo], side: &str) -> Result<GpuUuid> {
        match self {
            DeviceRef::Uuid(u) => Ok(u),
            DeviceRef::Index(i) => gpus
                .iter()
                .find(|g| g.index == i)
                .map(|g| g.uuid)
                .ok_or_else(|| {
                    Error::DeviceMap(format!(
                        "{side} GPU index {i} does not exist ({} GPU(s) known there)",
                        gpus.len()
                    ))
                }),
        }
    }
}

impl FromStr for DeviceRef {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
            return s
                .parse()
                .map(DeviceRef::Index)
                .map_err(|_| Error::DeviceMap(format!("GPU index `{s}` is out of range")));
        }
        s.parse().map(DeviceRef::Uuid)
    }
}

/// `--device-map OLD=NEW,...` as given by the user (indices or UUIDs on either side).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceMap(pub Vec<(DeviceRef, DeviceRef)>);

impl FromStr for DeviceMap {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let mut out = Vec::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (old, new) = entry.split_once('=').ok_or_else(|| {
                Error::DeviceMap(format!(
                    "`{entry}` is not OLD=NEW (index or GPU UUID each side)"
                ))
            })?;
            out.push((old.parse()?, new.parse()?));
        }
        if out.is_empty() {
            return Err(Error::DeviceMap("empty device map".into()));
        }
        Ok(DeviceMap(out))
    }
}

impl DeviceMap {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Turns the map into UUID pairs. Indices on the left name GPUs in `old_gpus` (the checkpoint's),
    /// on the right in `new_gpus` (this node's). Each old GPU may appear once, and so may each new one:
    /// two checkpointed GPUs cannot share one target.
    pub fn resolve(&self, old_gpus: &[GpuInfo], new_gpus: &[GpuInfo]) -> Result<Vec<GpuPair>> {
        let mut pairs: Vec<GpuPair> = Vec::new();
        for (old, new) in &self.0 {
            let pair = GpuPair {
                old: old.resolve(old_gpus, "old")?,
                new: new.resolve(new_gpus, "new")?,
            };
            if pairs.iter().any(|p| p.old == pair.old) {
                return Err(Error::DeviceMap(format!("{} is mapped twice", pair.old)));
            }
            if pairs.iter().any(|p| p.new == pair.new) {
                return Err(Error::DeviceMap(format!(
                    "{} is the target of two GPUs",
                    pair.new
                )));
            }
            pairs.push(pair);
        }
        Ok(pairs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(i: u32, last: u8) -> GpuInfo {
        let mut u = [0u8; 16];
        u[15] = last;
        GpuInfo {
            index: i,
            uuid: GpuUuid(u),
            model: "X".into(),
            memory_bytes: None,
        }
    }

    #[test]
    fn curesult_mapping_round_trips() {
        assert_eq!(CuError::from_code(0), None);
        for (code, e) in [
            (1, CuError::InvalidValue),
            (2, CuError::OutOfMemory),
            (3, CuError::NotInitialized),
            (304, CuError::OperatingSystem),
            (401, CuError::IllegalState),
            (500, CuError::NotFound),
            (600, CuError::NotReady),
            (801, CuError::NotSupported),
            (909, CuError::Timeout),
            (12345, CuError::Other(12345)),
        ] {
            assert_eq!(CuError::from_code(code), Some(e));
            assert_eq!(e.code(), code);
        }
        assert_eq!(
            CuError::from_name("CUDA_ERROR_NOT_READY"),
            Some(CuError::NotReady)
        );
        assert_eq!(
            CuError::from_name("CUDA_ERROR_ILLEGAL_STATE"),
            Some(CuError::IllegalState)
        );
        assert_eq!(CuError::from_name("CUDA_ERROR_BOGUS"), None);
        assert!(CuError::NotReady.to_string().contains("timed out"));
    }

    #[test]
    fn process_state_codes() {
        assert_eq!(ProcessState::from_raw(0), Some(ProcessState::Running));
        assert_eq!(ProcessState::from_raw(2), Some(ProcessState::Checkpointed));
        assert_eq!(ProcessState::from_raw(5), Some(ProcessState::Restoring));
        assert_eq!(ProcessState::from_raw(6), None);
        assert_eq!("Locked\n".parse(), Ok(ProcessState::Locked));
    }

    /// strum's names (as_str or key, and Display unless it is words) are serde's.
    #[test]
    fn state_op_and_backend_names_are_the_json_names() {
        for s in ProcessState::VARIANTS {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
            assert_eq!(s.as_str().to_ascii_uppercase().parse(), Ok(*s));
        }
        assert_eq!(ProcessState::Checkpointed.to_string(), "checkpointed");
        assert_eq!(" restoring ".parse(), Ok(ProcessState::Restoring));
        assert_eq!("lock".parse::<ProcessState>(), Err(()));
        for op in Op::VARIANTS {
            assert_eq!(serde_json::to_value(op).unwrap(), op.key());
        }
        assert_eq!(Op::RestoreTid.key(), "restore-tid");
        assert_eq!(Op::RestoreTid.to_string(), "restore thread id query");
        assert_eq!(Op::State.to_string(), "state query");
        assert_eq!(Op::Checkpoint.to_string(), "checkpoint");
        for b in super::super::GpuBackend::VARIANTS {
            assert_eq!(serde_json::to_value(b).unwrap(), b.as_str());
        }
        assert_eq!(
            super::super::GpuBackend::CudaDriver.to_string(),
            "cuda-driver"
        );
    }

    #[test]
    fn uuid_text_round_trips() {
        let s = "GPU-0123abcd-4567-89ef-0123-456789abcdef";
        let u: GpuUuid = s.parse().unwrap();
        assert_eq!(u.to_string(), s);
        assert_eq!(
            "0123abcd-4567-89ef-0123-456789abcdef"
                .parse::<GpuUuid>()
                .unwrap(),
            u
        );
        assert!("GPU-1234".parse::<GpuUuid>().is_err());
        assert_eq!(s.to_uppercase().parse::<GpuUuid>().unwrap(), u);
        assert!("GPU-+123abcd-4567-89ef-0123-456789abcdef"
            .parse::<GpuUuid>()
            .is_err());
        let low = GpuUuid([0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xfe]);
        assert_eq!(low.to_string(), "GPU-00000001-0000-0000-0000-0000000000fe");
        assert!("GPU-0123abcd-4567-89ef-0123-456789abcdeZ"
            .parse::<GpuUuid>()
            .is_err());
        let j = serde_json::to_string(&u).unwrap();
        assert_eq!(serde_json::from_str::<GpuUuid>(&j).unwrap(), u);
    }

    #[test]
    fn device_map_parses_indices_and_uuids() {
        let m: DeviceMap = "0=1, GPU-00000000-0000-0000-0000-000000000002=0"
            .parse()
            .unwrap();
        assert_eq!(m.0.len(), 2);
        assert_eq!(m.0[0], (DeviceRef::Index(0), DeviceRef::Index(1)));
        let old = [gpu(0, 1), gpu(1, 2)];
        let new = [gpu(0, 0xa), gpu(1, 0xb)];
        let pairs = m.resolve(&old, &new).unwrap();
        assert_eq!(pairs[0].old, old[0].uuid);
        assert_eq!(pairs[0].new, new[1].uuid);
        assert_eq!(pairs[1].old, old[1].uuid);
        assert_eq!(pairs[1].new, new[0].uuid);
    }

    #[test]
    fn device_map_rejects_nonsense() {
        for bad in ["", "0", "0=", "a=b", "0=1,0=2", "0=1,1=1", "0=7"] {
            let r = bad
                .parse::<DeviceMap>()
                .and_then(|m| m.resolve(&[gpu(0, 1), gpu(1, 2)], &[gpu(0, 3), gpu(1, 4)]));
            assert!(r.is_err(), "`{bad}` should be refused");
        }
    }
}
