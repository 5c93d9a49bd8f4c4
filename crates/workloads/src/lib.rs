//! Workloads for tests and demos: small programs that keep evolving state in memory so that a restored
//! copy can prove it continued where the checkpoint left it. Nothing here is part of the tool.
