//! The direct dump of a runc container: our CRIU with the settings runc's own checkpoint would give it
//! ([`DirectDump`], read from runc's state by the runtime seam), the images streamed into the store and
//! runc's own files written beside them, so that `runc restore` still restores them.

use super::Error;
use crate::dump::{AfterDump, Criu, CriuOptions, DumpRequest};
use crate::flows::runtime::DirectDump;
use crate::store::{Progress, Store};

/// Whether the direct dump leaves the (paused) container's processes stopped rather than running:
/// with `--tcp-established` when the container is to be stopped. CRIU's `--leave-running` takes the
/// connections out of repair mode and unlocks the network after the dump, so the kill once the
/// checkpoint is durable would close them (FIN) under a peer outside the container, which then sees the
/// connection end; left stopped, they stay in repair mode and locked until the restore (as under `runc
/// checkpoint` without `--leave-running`), and are closed silently.
pub(super) fn leaves_stopped(opts: &super::ContainerCheckpointOptions) -> bool {
    opts.tcp_established && !opts.leave_running
}

/// Dumps the (paused) container with our CRIU and the runtime's settings, its images streamed into
/// the store, the runtime's files (`descriptors.json`) written next to them. Returns the store's side
/// of the dump; on error CRIU left the container as it was (paused: the caller's guard resumes it).
pub(super) fn dump_direct(
    criu: &dyn Criu,
    d: &DirectDump,
    found: &super::Discovered,
    ((store, progress, ingest), expected_bytes): (
        (&Store, &dyn Progress, &crate::store::Ingest),
        u64,
    ),
    opts: &super::ContainerCheckpointOptions,
) -> crate::Result<Option<crate::store::Streamed>> {
    for (name, bytes) in &d.files {
        let path = ingest.staging_dir().join(name);
        let mut f = crate::util::create_new_private_file(&path).map_err(Error::io_at(&path))?;
        std::io::Write::write_all(&mut f, bytes).map_err(Error::io_at(&path))?;
    }
    let options = CriuOptions {
        tcp_established: opts.tcp_established,
        ..d.options.clone()
    };
    let req = DumpRequest {
        pid: found.state.pid,
        images_dir: ingest.staging_dir(),
        log_file: crate::flows::pipeline::DUMP_LOG,
        // The container is paused: it stays so until the checkpoint is durable (or resumed).
        // `KeepRunning` streams safely here, unlike a process checkpoint's (`ImageTransfer::after_dump`):
        // CRIU puts the container's freezer back as it found it, frozen, so nothing writes the pages
        // still in the pipes, and the flow resumes the container only once this returns, the store
        // having read every image.
        after: if leaves_stopped(opts) {
            AfterDump::Stop
        } else {
            AfterDump::KeepRunning
        },
        options: &options,
        stream: true,
        env: &[],
        container: Some(&d.settings),
    };
    let stored = crate::flows::pipeline::dump_tree(
        criu,
        store,
        progress,
        &req,
        ingest,
        expected_bytes,
        None,
    )?;
    stored.transpose()
}

/// The runtime's own checkpoint runs with `--leave-running` (so that a failure can resume the container):
/// CRIU then unlocks the connections after the dump, and the kill once the checkpoint is durable closes
/// them. A peer outside the container sees its connection end (FIN) while the container is gone; a
/// restore brings back a connection that peer has given up. Said before anything is done.
pub(super) fn warn_outside_peers(pids: &[i32], runtime: &str) {
    let outside = crate::dump::outside_connections(pids);
    if !outside.is_empty() {
        tracing::warn!(
            "--tcp-established through {runtime}'s own checkpoint: {} connection(s) with a peer outside the container ({}): the peer will see it closed when the container stops, and the restored end will not reach it; the direct dump (without --runtime-checkpoint) keeps them (docs/containers.md)",
            outside.len(),
            outside.join(", ")
        );
    }
}
