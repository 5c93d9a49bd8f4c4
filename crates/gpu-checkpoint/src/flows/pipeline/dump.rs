//! The dump with CRIU's images streamed into the store (`criu dump --stream`): while CRIU runs, a server
//! thread answers its image streamer connection and hands every image's pipe to a thread of its own that
//! feeds the store's streaming ingest; the store's workers cut, hash, compress and write as the pages come.
//! The images are written once, into the store: no staged copy is written and read back.
//!
//! A store failure (disk full) makes the image threads drop their pipes; CRIU then fails on the broken pipe
//! and lets the tree go on, exactly like a failed dump to disk. The store's own error is the one reported.
//!
//! Once the store has read every image (its readers are joined) nothing the tree writes reaches the
//! checkpoint, and a tree CRIU left stopped may run again: [`dump_tree`] then calls its `on_read` while
//! the store's workers may still be hashing, compressing and writing, and returns once they are done. With
//! `on_read` (a leave-running dump) the readers copy the pipes into memory as fast as CRIU fills them
//! ([`Ingest::streams_copying`]) instead of waiting for the workers to free their buffers, so the tree is
//! held stopped for about as long as CRIU takes to write its pages, not as long as the store takes to
//! store them.

use crate::dump::streamer::{serve_while, Listener, Mode};
use crate::dump::{Criu, DumpRequest};
use crate::exit::{Classify, ExitStatus};
use crate::flows::guardian::Event;
use crate::flows::save_log;
use crate::store::{Ingest, Progress, Store, Streamed};

/// Name of CRIU's dump log inside the checkpoint (stored with its images).
pub const DUMP_LOG: &str = "dump.log";

/// The outcome of a streamed dump: CRIU's, and the store's.
struct StreamedDump {
    pub dumped: Result<(), crate::dump::Error>,
    pub stored: crate::Result<Streamed>,
}

/// Runs `criu.dump(req)` (with `req.stream` set) while serving its images into `ingest`. `expected_bytes`
/// sizes the store's buffers (the tree's resident memory is a good guess). `on_read` (see [`dump_tree`]) is
/// called once CRIU succeeded and every image has been read without error, before the workers are done.
fn dump_streamed(
    criu: &dyn Criu,
    req: &DumpRequest<'_>,
    ingest: &Ingest,
    expected_bytes: u64,
    progress: &dyn Progress,
    on_read: Option<&mut dyn FnMut()>,
) -> StreamedDump {
    debug_assert!(req.stream);
    let listener = match Listener::bind(req.images_dir, Mode::Capture) {
        Ok(l) => l,
        Err(e) => {
            let at = format!(
                "listening for CRIU's images in {}",
                req.images_dir.display()
            );
            // CRIU never ran: its (our) error is the one to report, the store has nothing to say.
            return StreamedDump {
                dumped: Err(crate::dump::Error::io(at, e)),
                stored: Ok(Streamed::default()),
            };
        }
    };
    let streams = if on_read.is_some() {
        ingest.streams_copying(expected_bytes)
    } else {
        ingest.streams(expected_bytes)
    };
    progress.start("dump + store", expected_bytes);
    let (dumped, served) = std::thread::scope(|s| {
        for _ in 0..streams.workers() {
            s.spawn(|| streams.work(progress));
        }
        let add = |name: String, pipe| -> crate::Result<()> {
            tracing::debug!("image {name}: streaming into the store");
            Ok(streams.add(&name, pipe)?)
        };
        let result = serve_while(&listener, &|_| true, &add, || criu.dump(req));
        streams.close();
        // CRIU is done and every image thread has returned: the pipes are empty, the pages copied.
        if let (Ok(()), Ok(()), Some(f)) = (&result.0, &result.1, on_read) {
            f();
        }
        result
    });
    progress.finish();
    drop(listener); // the socket must not be taken for an image
    let stored = streams.finish();
    StreamedDump {
        dumped,
        stored: store_error_first(stored, served),
    }
}

/// A streaming session's result with its feeder's: the store's first error explains a broken pipe or a
/// failed read better than the feeder's view of it.
pub fn store_error_first(
    stored: crate::store::Result<Streamed>,
    fed: crate::Result<()>,
) -> crate::Result<Streamed> {
    match (stored, fed) {
        (Err(e), _) => Err(e.into()),
        (Ok(_), Err(e)) => Err(e),
        (Ok(s), Ok(())) => Ok(s),
    }
}

/// Tells the guardian what CRIU's dump left of the network, which it releases should the tool die before
/// the commit; a guardian that cannot be told leaves it to the flow's own undo.
pub fn tell_network(watch: &dyn crate::flows::Watch, hold: &crate::dump::NetworkHold) {
    if let Err(e) = watch.tell(&Event::Network(hold.clone())) {
        tracing::warn!("the guardian was not told of the locked network: {e}");
    }
}

/// CRIU dumps the tree into the staging folder, or straight into the store (`req.stream`: its buffers
/// sized for about `expected_bytes`, the tree's resident memory). Returns the
/// store's side of a streamed dump, which may have failed though CRIU finished (the caller's undo then
/// also continues the tree CRIU left stopped).
///
/// `on_read`, for a streamed dump of a tree that runs on: called once CRIU succeeded and the store has
/// copied every image out of CRIU's pipes, while its workers may still be storing them, so the caller can
/// continue the tree then; the store may still fail afterwards (the result says so). Not called when the
/// dump or a read failed, nor for a staged dump.
///
/// A failed dump is returned as the error, with CRIU's log copied out of the staging folder first (it
/// goes with the ingest); CRIU resumed the tree (or never stopped it). When the store gave up first (disk
/// full), CRIU only saw a broken pipe: the store's error says why.
pub fn dump_tree(
    criu: &dyn Criu,
    store: &Store,
    progress: &dyn Progress,
    req: &DumpRequest<'_>,
    ingest: &Ingest,
    expected_bytes: u64,
    on_read: Option<&mut dyn FnMut()>,
) -> crate::Result<Option<crate::Result<Streamed>>> {
    let (dumped, stored) = if req.stream {
        let d = dump_streamed(criu, req, ingest, expected_bytes, progress, on_read);
        (d.dumped, Some(d.stored))
    } else {
        (criu.dump(req), None)
    };
    let Err(e) = dumped else {
        return Ok(stored);
    };
    let e = keep_failed_log(store, ingest, e);
    match stored {
        Some(Err(store_err)) if store_err.exit_status() == ExitStatus::Storage => {
            tracing::debug!("{e}");
            Err(store_err)
        }
        Some(Err(store_err)) => {
            tracing::debug!("while CRIU failed, the store: {store_err}");
            Err(e.into())
        }
        _ => Err(e.into()),
    }
}

/// Copies CRIU's log out of the staging folder (which is about to go) into the store's `logs/` folder,
/// or the temporary folder when the store cannot take it (full disk), and points the error at the copy.
fn keep_failed_log(store: &Store, ingest: &Ingest, e: crate::dump::Error) -> crate::dump::Error {
    let src = ingest.staging_dir().join(DUMP_LOG);
    if !src.exists() {
        return e;
    }
    match save_log(
        store.local_dir(),
        &src,
        &format!("{}.dump.log", ingest.id()),
    ) {
        Some(kept) => e.with_log_path(kept),
        None => e,
    }
}
