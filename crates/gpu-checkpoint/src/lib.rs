//! gpu-checkpoint: checkpoint and restore GPU processes on Linux.
//!
//! The crate is laid out by pipeline stage, in the order a checkpoint moves through them:
//!
//! | stage | module | what it does |
//! |---|---|---|
//! | 1 | [`detect`] | read /proc (and NVML when present), classify GPU state, decide a strategy or refuse |
//! | 2 | [`freeze`] | lock / checkpoint / restore / unlock GPU state (CUDA driver API, `cuda-checkpoint`, simulator) |
//! | 3 | [`dump`] | dump and restore the CPU side with CRIU over its RPC |
//! | 4 | [`store`] | chunked, compressed, content-addressed, verified checkpoint images |
//! | 5 | [`restore`] | fetch + verify, CRIU restore, GPU restore + unlock |
//!
//! [`checkpoint`] strings stages 1-4 together into the checkpoint flow; [`restore`] does the way back.
//! The library returns typed errors ([`Error`]); the `gpu-checkpoint` binary parses arguments, prints and
//! shows progress.

pub mod detect;
pub mod dump;
pub mod error;
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
pub mod testdata;
pub mod thp;
pub mod util;

pub use error::{Error, Result};
pub use exit::{Classify, ExitStatus};
pub use flows::{checkpoint, restore};
