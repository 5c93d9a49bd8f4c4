//! Helpers shared by the library's integration tests.

pub mod garage;
pub mod s3;
