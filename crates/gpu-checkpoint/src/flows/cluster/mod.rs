//! The cluster flow: a consistent checkpoint (and restore) of a job made of process trees on many
//! nodes, coordinated through etcd. `docs/cluster.md` has the protocol and the commands.
//!
//! - [`coord`]: the boundary with etcd ([`Coordinator`]), [`EtcdCoordinator`] (feature `cluster`)
//!   and `MemoryCoordinator` (unit tests only);
//! - [`records`]: the key layout and the versioned records;
//! - [`job`]: the coordinator's side (`job checkpoint`, `job restore` from `job_restore.rs`, the reads
//!   of `list`/`status`); [`placement`]: where a restore puts each member;
//! - [`retention`]: deleting job checkpoints, periodic checkpoints with retention;
//! - [`agent`]: the agent's side, which drives the checkpoint flow through [`crate::flows::Phases`].
//!
//! Every member's local work is the single-node flows' (through [`agent::MemberWork`]), so a job's
//! abort is undone by the same guards as a failed checkpoint.

pub mod admit;
pub mod agent;
pub mod coord;
#[cfg(feature = "cluster")]
mod etcd;
pub mod etcd_config;
mod follow;
pub mod hooks;
pub mod job;
mod job_restore;
mod lease;
#[cfg(feature = "cluster")]
pub mod local;
mod member_error;
#[cfg(test)]
mod memory;
pub mod placement;
pub mod records;
pub mod register;
#[cfg(test)]
mod request_tests;
pub mod retention;
#[cfg(test)]
mod tests;
mod timings;
mod view;

use crate::exit::{Classify, ExitStatus};

pub use admit::{Admission, NodePolicy, Registration};
pub use agent::{run_agent, AgentOptions, MemberWork};
pub use coord::{CoordError, Coordinator, Event, Kv, LeaseId, Revision, WatchStream};
#[cfg(feature = "cluster")]
pub use etcd::EtcdCoordinator;
pub use etcd_config::{EtcdConfig, Password, Security};
pub use hooks::QuiesceHooks;
pub use job::{checkpoint_job, JobCheckpointOptions, Timeouts};
pub use job_restore::{
    parse_device_maps, parse_node_map, restore_job, JobRestoreOutcome, RestoredMember,
};
pub use lease::LeaseGuard;
#[cfg(feature = "cluster")]
pub use local::{LocalWork, LocalWorkOptions};
pub use member_error::MemberError;
#[cfg(test)]
pub use memory::MemoryCoordinator;
pub use placement::{Chosen, Placement};
pub use records::{
    AgentRecord, Cut, JobManifest, JobMember, JobTimings, MemberRecord, MemberState, Task,
};
pub use register::{register_member, RegisterError, RegistrationSocket, DEFAULT_SOCKET};
pub use retention::{
    apply_retention, delete_job_checkpoint, run_periodic, Deleted, PeriodicOptions, Round,
};

/// Errors of the cluster flow.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Coord(#[from] CoordError),
    #[error("{0}")]
    Usage(String),
    #[error(
        "no agent is registered for node {node} (start `gpu-checkpoint agent --node {node}` there)"
    )]
    NoAgent { node: String },
    #[error(
        "node {node} has no agent, and no agent can take its members (give --node-map, or start \
         `gpu-checkpoint agent` on a node with their GPUs and store): {why}"
    )]
    NoPlacement { node: String, why: String },
    #[error("no job checkpoint {id} in etcd")]
    NotFound { id: String },
    #[error("job checkpoint {id}'s manifest in etcd is not one this tool wrote: {why}")]
    Damaged { id: String, why: String },
    #[error("{what}")]
    Busy { what: String },
    #[error("job operation {id} aborted: {reason}; nothing was committed, and every member undid its part:{}", members.iter().map(|m| format!("\n  - {m}")).collect::<String>())]
    Aborted {
        id: String,
        reason: String,
        members: Vec<String>,
        /// The exit class of the member failure that made the abort, if one did.
        exit: Option<ExitStatus>,
    },
}

impl Classify for ClusterError {
    fn exit_status(&self) -> ExitStatus {
        match self {
            ClusterError::Coord(e) => e.exit_status(),
            ClusterError::Usage(_) => ExitStatus::Usage,
            ClusterError::NoAgent { .. }
            | ClusterError::NoPlacement { .. }
            | ClusterError::Busy { .. } => ExitStatus::Conflict,
            ClusterError::NotFound { .. } | ClusterError::Damaged { .. } => {
                ExitStatus::CheckpointInvalid
            }
            // A member's own failure keeps its class (3 no such process, 4 not permitted, 6
            // storage...); an abort for the operation's own reasons is 1.
            ClusterError::Aborted { exit, .. } => exit.unwrap_or(ExitStatus::Failure),
        }
    }
}
