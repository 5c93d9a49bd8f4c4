//! Helpers shared by the library's integration tests.

pub mod s3;
