//! Helpers shared by the library's integration tests.

#![allow(dead_code)] // each test file uses its own subset

pub mod garage;
pub mod moto;
pub mod s3;

use gpu_checkpoint_testdata::XorShift64;

/// Whether a test can run here (`ready`). Where it cannot, CI (`CI=true`) fails it (`in_ci`: why CI can
/// run it); elsewhere it is skipped with the reason printed (`skipped`).
pub fn runs_here(ready: bool, skipped: &str, in_ci: &str) -> bool {
    if !ready {
        assert_ne!(std::env::var("CI").as_deref(), Ok("true"), "{in_ci}");
        eprintln!("skipped: {skipped}");
    }
    ready
}

/// These tests' seed spread (`seed * golden ratio`, not `testdata::random_bytes`'s `(seed + 1) * ...`): the
/// bytes they were written against, kept as they were.
pub fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    XorShift64::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1).bytes(n)
}
