//! The report: what `detect` prints as JSON and what the checkpoint manifest embeds. Users script against
//! it: fields are only ever added, and `schema_version` says which shape this is.

use serde::{Deserialize, Serialize};

use super::context::{contextless_mappings, has_cuda_context};
use super::finding::Finding;
use super::strategy::{StrategyDecision, StrategyName};

/// Version of the report's JSON shape.
pub const SCHEMA_VERSION: u32 = 1;

/// One strategy detect weighed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Considered {
    /// `none`, `cuda-driver`, `cuda-cli`, `amdgpu`, `bar-sliding`.
    pub strategy: String,
    pub chosen: bool,
    /// Why it was, or was not, chosen.
    pub why: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Report {
    /// Always [`SCHEMA_VERSION`] for reports written by this version.
    pub schema_version: u32,
    /// The process asked about (`--pid`), or null for `--all`.
    pub pid: Option<i32>,
    /// Any GPU state in scope.
    pub gpu: bool,
    pub processes: Vec<ProcessReport>,
    pub findings: Vec<Finding>,
    /// The strategy for the whole scope, with every process's blockers.
    pub strategy: StrategyDecision,
    /// Every strategy weighed, and why it was or was not chosen (absent in reports before it existed).
    #[serde(default)]
    pub strategies: Vec<Considered>,
    /// Processes of the tree share CUDA IPC memory (allowed from driver 610 on, for a whole tree): the
    /// GPU step must lock them one after another and restore and unlock them in the same order. Absent
    /// when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub ordered: bool,
    /// NVIDIA driver version (`570.86.15`), or null when unknown.
    pub driver_version: Option<String>,
    /// Time detection took.
    pub elapsed_ms: f64,
    /// Remarks for the human reader (NVML absent, processes skipped); not part of the JSON.
    #[serde(skip)]
    pub notes: Vec<String>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ProcessReport {
    pub pid: i32,
    pub comm: String,
    pub ppid: i32,
    pub strategy: StrategyName,
    /// The GPU this process uses is the GPU simulator (tests and demos only). Absent when false.
    #[serde(default, skip_serializing_if = "is_false")]
    pub simulated: bool,
    /// cgroup path (v2, or the first hierarchy's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup: Option<String>,
    /// Container id found in the cgroup path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// The pid in each nested PID namespace, outermost first (present when the process is in a child
    /// namespace, e.g. a container).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nspid: Vec<i32>,
}

impl Report {
    /// Findings of one process.
    pub fn findings_of(&self, pid: i32) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(move |f| f.pid == pid)
    }

    /// True when any process in scope uses the GPU simulator.
    pub fn simulated(&self) -> bool {
        self.processes.iter().any(|p| p.simulated)
    }
}

/// Mappings of an NVIDIA node that a process without a CUDA context inherited from its parent (a child
/// forked without exec): a checkpoint replaces them by zeroed shared memory at the same addresses.
#[derive(Serialize, Clone, Debug, PartialEq, Eq)]
pub struct InheritedMapping {
    pub pid: i32,
    /// The node (`/dev/nvidia0`).
    pub path: String,
    /// `0xSTART-0xEND` of each mapping.
    pub ranges: Vec<String>,
}

impl Report {
    /// The inherited NVIDIA mappings of every real (not simulated) process without a CUDA context. The
    /// checkpoint and its restore both derive them from the report the manifest keeps.
    pub fn inherited_mappings(&self) -> Vec<InheritedMapping> {
        let mut out = Vec::new();
        for p in self.processes.iter().filter(|p| !p.simulated) {
            if has_cuda_context(self.findings_of(p.pid)) {
                continue;
            }
            for f in contextless_mappings(self.findings_of(p.pid)).inherited {
                out.push(InheritedMapping {
                    pid: p.pid,
                    path: f.evidence.path.clone().unwrap_or_default(),
                    ranges: f
                        .evidence
                        .address
                        .iter()
                        .chain(&f.evidence.ranges)
                        .cloned()
                        .collect(),
                });
            }
        }
        out
    }
}
