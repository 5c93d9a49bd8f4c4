//! Helpers shared by the library's integration tests.

pub mod garage;
pub mod moto;
pub mod s3;
