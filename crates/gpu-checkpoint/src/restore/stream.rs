//! The restore with CRIU's images streamed from the store (`criu restore --stream`): a server thread
//! answers CRIU's image requests from the checkpoint's manifest, and one thread per open image writes that
//! image's verified chunks into CRIU's pipe (chunks fetched and checked a few ahead, in parallel). Nothing is
//! materialized on disk, and CRIU never reads a byte that was not verified: a damaged chunk closes the
//! pipe before any of its bytes are written, CRIU fails on it, and the store's error is reported.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::dump::streamer::{Listener, Mode};
use crate::dump::{Criu, RestoreRequest};
use crate::store::{CheckpointInfo, Progress, Store};

/// Runs `criu.restore(req)` (with `req.stream` set) while serving the checkpoint's images. Returns CRIU's
/// result and the server's (the first store error, if any; a pipe CRIU closed early is CRIU's business).
pub(super) fn restore_streamed(
    criu: &dyn Criu,
    req: &RestoreRequest<'_>,
    store: &Store,
    info: &CheckpointInfo,
    progress: &dyn Progress,
) -> (
    Result<i32, crate::dump::Error>,
    Result<(), crate::store::Error>,
) {
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
    let stop = AtomicBool::new(false);
    progress.start("restore (streamed)", info.stats.logical_bytes);
    let result = std::thread::scope(|s| {
        let server = s.spawn(|| serve(&listener, &stop, store, info, progress, s));
        let restored = criu.restore(req);
        stop.store(true, Ordering::SeqCst);
        let served = server
            .join()
            .unwrap_or_else(|_| Err(crate::store::Error::Other("image server panicked".into())));
        (restored, served)
    });
    progress.finish();
    result
}

fn serve<'scope>(
    listener: &Listener,
    stop: &AtomicBool,
    store: &'scope Store,
    info: &'scope CheckpointInfo,
    progress: &'scope dyn Progress,
    s: &'scope std::thread::Scope<'scope, '_>,
) -> Result<(), crate::store::Error> {
    let proto = |e: std::io::Error| {
        crate::store::Error::Other(format!("CRIU's image streamer connection: {e}"))
    };
    let Some(mut conn) = listener.accept(stop).map_err(proto)? else {
        return Ok(());
    };
    let mut sends = Vec::new();
    let result = (|| {
        while let Some(name) = conn.next_request().map_err(proto)? {
            let exists = info.files.iter().any(|f| f.path == name);
            tracing::debug!("CRIU asks for image {name} (exists: {exists})");
            conn.reply(exists).map_err(proto)?;
            if !exists {
                continue;
            }
            let pipe = conn.receive_pipe().map_err(proto)?;
            sends.push(s.spawn(move || {
                match store.stream_file_to_pipe(info, &name, &pipe, progress) {
                    Ok(_) => Ok(()),
                    // CRIU stopped reading (it failed, or needed only part of the image): its own result
                    // tells which.
                    Err(crate::store::Error::Io { source, .. })
                        if source.kind() == std::io::ErrorKind::BrokenPipe =>
                    {
                        Ok(())
                    }
                    Err(e) => Err(e),
                }
            }));
        }
        Ok(())
    })();
    crate::checkpoint::stream::join_images(result, sends)
}
