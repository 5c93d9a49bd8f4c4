//! The restore with CRIU's images streamed from the store (`criu restore --stream`): a server thread
//! answers CRIU's image requests from the checkpoint's manifest, and one thread per open image writes that
//! image's verified chunks into CRIU's pipe (chunks fetched and checked a few ahead, in parallel). Nothing is
//! materialized on disk, and CRIU never reads a byte that was not verified: a damaged chunk closes the
//! pipe before any of its bytes are written, CRIU fails on it, and the store's error is reported.

use crate::dump::streamer::{serve_while, Listener, Mode};
use crate::dump::{Criu, RestoreRequest};
use crate::store::{CheckpointInfo, Progress, Store};

/// Runs `criu.restore(req)` (with `req.stream` set) while serving the checkpoint's images. Returns CRIU's
/// result and the server's (the first store error, if any; a pipe CRIU closed early is CRIU's business).
pub fn restore_streamed(
    criu: &dyn Criu,
    req: &RestoreRequest<'_>,
    store: &Store,
    info: &CheckpointInfo,
    progress: &dyn Progress,
) -> (Result<i32, crate::dump::Error>, crate::Result<()>) {
    debug_assert!(req.stream);
    let listener = match Listener::bind(req.images_dir, Mode::Serve) {
        Ok(l) => l,
        Err(e) => {
            let e = crate::dump::Error::io(
                format!("listening for CRIU in {}", req.images_dir.display()),
                e,
            );
            return (Err(e), Ok(()));
        }
    };
    let exists = |name: &str| info.files.iter().any(|f| f.path == name);
    let send = |name: String, pipe| send_image(store, info, &name, &pipe, progress);
    progress.start("restore (streamed)", info.stats.logical_bytes);
    let result = serve_while(&listener, &exists, &send, || criu.restore(req));
    progress.finish();
    result
}

/// Writes image `name` into CRIU's `pipe`, every chunk verified first. A pipe CRIU closed early is not
/// an error here (it failed, or needed only part of the image): its own result says which.
pub fn send_image(
    store: &Store,
    info: &CheckpointInfo,
    name: &str,
    pipe: &std::fs::File,
    progress: &dyn Progress,
) -> crate::Result<()> {
    match store.stream_file_to_pipe(info, name, pipe, progress) {
        Ok(_) => Ok(()),
        Err(crate::store::Error::Io { source, .. })
            if source.kind() == std::io::ErrorKind::BrokenPipe =>
        {
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}
