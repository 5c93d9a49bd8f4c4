//! gpu-checkpoint: checkpoint and restore GPU processes on Linux.
//!
//! The crate is laid out in stages, in the order a checkpoint moves through them, and flows on top of them
//! (`docs/architecture.md` draws both):
//!
//! | stage | module | what it does |
//! |---|---|---|
//! | 1 | [`detect`] | read /proc (and NVML when present), classify GPU state, decide a strategy or refuse |
//! | 2 | [`freeze`] | lock / checkpoint / restore / unlock GPU state (CUDA driver API, `cuda-checkpoint`, simulator) |
//! | 3 | [`dump`] | dump and restore the CPU side with CRIU over its RPC |
//! | 4 | [`store`] | chunked, compressed, content-addressed, verified checkpoint images |
//!
//! The [`flows`] string the stages together: [`checkpoint`] (stages 1-4, a process tree), [`restore`] (the
//! way back: fetch + verify, CRIU restore, GPU restore + unlock), [`flows::container`] (a runc or runsc
//! container) and [`flows::cluster`] (a job of trees on many nodes, through etcd). The library returns typed
//! errors (each stage's own, and the flows' [`Error`] that wraps them); the `gpu-checkpoint` binary
//! parses arguments, prints and shows progress.

pub mod beneath;
pub mod detect;
pub mod dump;
pub mod exit;
pub mod fault;
pub mod fdpass;
pub mod flows;
pub mod fmt;
pub mod freeze;
pub mod interrupt;
pub mod path_search;
pub mod proc;
pub mod store;
pub mod thp;
pub mod util;
pub mod validate;

// The tests' pseudo-random data, as `crate::testdata` (a crate of its own, so that no build of the tool
// links it).
#[cfg(test)]
use gpu_checkpoint_testdata as testdata;

pub use exit::{Classify, ExitStatus};

/// Whether this build of the library holds its test support (`store::MemoryBackend`, the `test-support`
/// feature): a build of the tool never does (`tests/release_contents.rs` in the CLI crate checks it).
pub const TEST_SUPPORT: bool = cfg!(feature = "test-support");
pub use flows::{checkpoint, restore};
pub use flows::{Error, Result};
