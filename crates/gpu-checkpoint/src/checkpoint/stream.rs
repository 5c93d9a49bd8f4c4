//! The dump with CRIU's images streamed into the store (`criu dump --stream`): while CRIU runs, a server
//! thread answers its image streamer connection and hands every image's pipe to a thread of its own that
//! feeds the store's streaming ingest; the store's workers cut, hash, compress and write as the pages come.
//! The images are written once, into the store: no staged copy is written and read back.
//!
//! A store failure (disk full) makes the image threads drop their pipes; CRIU then fails on the broken pipe
//! and lets the tree go on, exactly like a failed dump to disk. The store's own error is the one reported.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::dump::streamer::{Listener, Mode};
use crate::dump::{Criu, DumpRequest};
use crate::store::{Ingest, Progress, Streamed, Streams};

/// The outcome of a streamed dump: CRIU's, and the store's.
pub(super) struct StreamedDump {
    pub dumped: Result<(), crate::dump::Error>,
    pub stored: Result<Streamed, crate::store::Error>,
}

/// Runs `criu.dump(req)` (with `req.stream` set) while serving its images into `ingest`. `expected_bytes`
/// sizes the store's buffers (the tree's resident memory is a good guess).
pub(super) fn dump_streamed(
    criu: &dyn Criu,
    req: &DumpRequest<'_>,
    ingest: &Ingest,
    expected_bytes: u64,
    progress: &dyn Progress,
) -> StreamedDump {
    debug_assert!(req.stream);
    let listener = match Listener::bind(req.images_dir, Mode::Capture) {
        Ok(l) => l,
        Err(e) => {
            return StreamedDump {
                dumped: Err(crate::dump::Error::io(
                    format!(
                        "listening for CRIU's images in {}",
                        req.images_dir.display()
                    ),
                    e,
                )),
                stored: Err(crate::store::Error::Other("no image was received".into())),
            }
        }
    };
    let streams = ingest.streams(expected_bytes);
    let stop = AtomicBool::new(false);
    progress.start("dump + store", expected_bytes);
    let (dumped, served) = std::thread::scope(|s| {
        for _ in 0..streams.workers() {
            s.spawn(|| streams.work(progress));
        }
        let server = s.spawn(|| serve(&listener, &stop, &streams, s));
        let dumped = criu.dump(req);
        stop.store(true, Ordering::SeqCst);
        let served = server
            .join()
            .unwrap_or_else(|_| Err(crate::store::Error::Other("image server panicked".into())));
        streams.close();
        (dumped, served)
    });
    progress.finish();
    drop(listener); // the socket must not be taken for an image
    let stored = streams.finish();
    StreamedDump {
        dumped,
        // The store's first error explains a broken pipe better than the server's view of it.
        stored: match (stored, served) {
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(e),
            (Ok(s), Ok(())) => Ok(s),
        },
    }
}

/// Answers CRIU's connection until CRIU hangs up: one thread per image. Returns the first failure.
fn serve<'scope>(
    listener: &Listener,
    stop: &AtomicBool,
    streams: &'scope Streams<'scope>,
    s: &'scope std::thread::Scope<'scope, '_>,
) -> Result<(), crate::store::Error> {
    let proto = |e: std::io::Error| {
        crate::store::Error::Other(format!("CRIU's image streamer connection: {e}"))
    };
    let Some(mut conn) = listener.accept(stop).map_err(proto)? else {
        return Ok(()); // CRIU finished (failed) without connecting; its own error says why
    };
    let mut images = Vec::new();
    let result = (|| {
        while let Some(name) = conn.next_request().map_err(proto)? {
            let pipe = conn.receive_pipe().map_err(proto)?;
            tracing::debug!("image {name}: streaming into the store");
            images.push(s.spawn(move || streams.add(&name, pipe)));
        }
        Ok(())
    })();
    join_images(result, images)
}

/// Waits for every image thread; the result is the server's own error, else the first thread's.
pub(crate) fn join_images(
    server: Result<(), crate::store::Error>,
    images: Vec<std::thread::ScopedJoinHandle<'_, Result<(), crate::store::Error>>>,
) -> Result<(), crate::store::Error> {
    let mut first = server.err();
    for t in images {
        let r = t
            .join()
            .unwrap_or_else(|_| Err(crate::store::Error::Other("image thread panicked".into())));
        if let (None, Err(e)) = (&first, r) {
            first = Some(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// The resident memory of the tree, in bytes: about what CRIU's page images will hold.
pub(super) fn resident_bytes(pids: &[i32]) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/statm")).ok())
        .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * page
}
