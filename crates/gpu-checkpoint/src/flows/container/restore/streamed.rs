//! The container restore with CRIU's images streamed from the store: the runtime's restore runs while the
//! store serves the images on CRIU's image-streamer socket in the images folder, each chunk verified
//! before CRIU gets a byte of it (as `flows/pipeline/serve.rs` does for a process). Nothing but the
//! runtime's own `descriptors.json` is written into the folder: no materialized copy.
//!
//! runc drives CRIU over its RPC, which cannot stream; the runtime gets there through our `criu swrk`
//! stand-in (`dump/swrk_proxy.rs`), which runs CRIU's `restore --stream` with runc's settings. It does
//! not translate everything runc may ask for, so this path is taken only where nothing of that kind is
//! expected ([`why_not`]); the other restores materialize the images as before.

use std::path::Path;

use super::super::{ContainerRuntime, Error, RestoreRequest};
use crate::dump::streamer::{serve_while, Listener, Mode};
use crate::store::{CheckpointInfo, Progress, Store};

/// The runtime's own file next to CRIU's images: runc reads it itself (the init's descriptors).
const DESCRIPTORS: &str = "descriptors.json";

/// `None` when checkpoint `info` can be restored into `bundle` with streamed images; otherwise why not
/// (logged; the images are then materialized).
pub(super) fn why_not(
    runtime: &dyn ContainerRuntime,
    info: &CheckpointInfo,
    bundle: &Path,
) -> Option<String> {
    if !runtime.streams_restore() {
        return Some(format!("{} cannot restore streamed images", runtime.name()));
    }
    let has = |name: &str| info.files.iter().any(|f| f.path == name);
    // CRIU's images and runc's file, nothing else of ours: an imported archive's `oci/` files (its
    // root file system changes) are applied from a folder.
    if !has("inventory.img") || !has(DESCRIPTORS) {
        return Some(
            "the checkpoint does not hold CRIU's images and runc's descriptors.json".into(),
        );
    }
    if info.files.iter().any(|f| f.path.contains('/')) {
        return Some("the checkpoint holds files of an imported archive".into());
    }
    bundle_refuses(bundle)
}

/// What in the bundle's `config.json` needs more of CRIU's RPC than the stand-in gives runc: prestart
/// hooks (run at CRIU's `setup-namespaces` notification), a terminal (`orphan-pts-master`), and a CRIU
/// configuration file (`org.criu.config`, else runc's `/etc/criu/runc.conf`), which on the RPC
/// overrides runc's settings and on CRIU's command line would not.
fn bundle_refuses(bundle: &Path) -> Option<String> {
    let path = bundle.join("config.json");
    let config: serde_json::Value = match std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
    {
        Some(c) => c,
        None => return Some(format!("{} is not readable JSON", path.display())),
    };
    let hooks = &config["hooks"];
    for kind in ["prestart", "createRuntime"] {
        if hooks[kind].as_array().is_some_and(|h| !h.is_empty()) {
            return Some(format!("the bundle has {kind} hooks"));
        }
    }
    if config["process"]["terminal"].as_bool() == Some(true) {
        return Some("the container has a terminal".into());
    }
    // CRIU ignores a file that does not exist, and so does the stand-in.
    let file = match config["annotations"]["org.criu.config"].as_str() {
        Some("") => return None,
        Some(file) => file,
        None => "/etc/criu/runc.conf",
    };
    Path::new(file)
        .exists()
        .then(|| format!("the CRIU configuration file {file} applies"))
}

/// Runs the runtime's restore of `req` (`req.streamed` set, `req.images` the private work folder) while
/// serving the checkpoint's images. The store's error comes first: a damaged chunk closes CRIU's pipe
/// before any of its bytes, CRIU fails on it, and the runtime's error says only that.
pub(super) fn restore(
    runtime: &dyn ContainerRuntime,
    req: &RestoreRequest<'_>,
    store: &Store,
    info: &CheckpointInfo,
    progress: &dyn Progress,
) -> crate::Result<()> {
    debug_assert!(req.streamed);
    let work_error = |source| Error::WorkDir {
        path: req.images.to_path_buf(),
        source,
    };
    let descriptors = req.images.join(DESCRIPTORS);
    let mut file = crate::util::create_new_private_file(&descriptors).map_err(work_error)?;
    store.stream_file(info, DESCRIPTORS, &mut file, progress)?;
    drop(file);
    let listener = Listener::bind(req.images, Mode::Serve).map_err(work_error)?;
    let exists = |name: &str| name != DESCRIPTORS && info.files.iter().any(|f| f.path == name);
    let send = |name: String, pipe| {
        crate::flows::pipeline::send_image(store, info, &name, &pipe, progress)
    };
    progress.start("restore (streamed)", info.stats.logical_bytes);
    let (restored, served) = serve_while(&listener, &exists, &send, || {
        let restored = runtime.restore(req);
        if restored.is_err() {
            // CRIU can outlive a failed runtime restore (runc's `criu swrk` stand-in killed: seen here
            // left stopped), holding the image pipe the store would write into for ever.
            super::kill_leftovers(req.images);
        }
        restored
    });
    progress.finish();
    served?;
    restored.map_err(Into::into)
}
