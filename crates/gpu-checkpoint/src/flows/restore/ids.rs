//! The IDs a restore gives back, as the checkpoint recorded them (`pstree.img`), and in which PID namespace
//! they must be free.

use super::Error;
use crate::flows::CheckpointManifest;
use crate::store::{CheckpointInfo, Store};

/// The IDs a restore gives back, as the checkpoint recorded them.
pub(super) struct RecordedIds {
    /// The tree's PIDs followed by the IDs of its other threads (`pstree.img`), as they must be free in
    /// this PID namespace; empty for a tree that is a PID namespace of its own.
    pub host: Vec<i32>,
    /// The tree's PIDs in this namespace at checkpoint time (empty for a namespace of its own).
    pub host_pids: Vec<i32>,
    /// The processes' IDs as CRIU recorded them (`pstree.img`): its images are named after them.
    pub images: Vec<i32>,
    /// The root was the init of its own PID namespace (`unshare --fork --pid`): CRIU recorded the
    /// namespace's IDs (the root is 1) and restores the tree into a new namespace, as `criu restore` does,
    /// so none of them can be in use, and the restored tree gets new PIDs here.
    pub own_namespace: bool,
}

impl RecordedIds {
    /// A checkpoint without `pstree.img` (made by a stand-in CRIU) has only the PIDs.
    pub fn of(
        store: &Store,
        info: &CheckpointInfo,
        manifest: &CheckpointManifest,
    ) -> crate::Result<RecordedIds> {
        let pids = manifest.pids();
        let mut ids = RecordedIds {
            host: pids.clone(),
            images: pids.clone(),
            host_pids: pids,
            own_namespace: false,
        };
        let mut image = Vec::new();
        if !store_file(store, info, "pstree.img", &mut image)? {
            return Ok(ids);
        }
        let tree =
            crate::dump::images::parse_pstree(&image).map_err(|reason| Error::BadManifest {
                id: info.id.clone(),
                reason: format!("pstree.img: {reason}"),
            })?;
        ids.images = tree.iter().map(|p| p.pid as i32).collect();
        // CRIU's IDs are those of the root's PID namespace: the same as ours, unless the root was the
        // init of a namespace of its own.
        if tree
            .first()
            .is_some_and(|root| root.pid as i32 != manifest.root_pid)
        {
            ids.host.clear();
            ids.host_pids.clear();
            ids.own_namespace = true;
            return Ok(ids);
        }
        for tid in tree.iter().flat_map(|p| &p.threads) {
            let tid = *tid as i32;
            if !ids.host.contains(&tid) {
                ids.host.push(tid);
            }
        }
        Ok(ids)
    }
}

/// Reads image `name` of a checkpoint into `out`; false when the checkpoint has no such file.
pub(super) fn store_file(
    store: &Store,
    info: &CheckpointInfo,
    name: &str,
    out: &mut Vec<u8>,
) -> crate::Result<bool> {
    Ok(store
        .stream_file(info, name, out, &crate::store::NoProgress)?
        .is_some())
}
