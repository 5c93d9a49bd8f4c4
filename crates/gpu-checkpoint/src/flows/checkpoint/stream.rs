//! The dump with CRIU's images streamed into the store (`criu dump --stream`): while CRIU runs, a server
//! thread answers its image streamer connection and hands every image's pipe to a thread of its own that
//! feeds the store's streaming ingest; the store's workers cut, hash, compress and write as the pages come.
//! The images are written once, into the store: no staged copy is written and read back.
//!
//! A store failure (disk full) makes the image threads drop their pipes; CRIU then fails on the broken pipe
//! and lets the tree go on, exactly like a failed dump to disk. The store's own error is the one reported.

use crate::dump::streamer::{serve_while, Listener, Mode};
use crate::dump::{Criu, DumpRequest};
use crate::store::{Ingest, Progress, Streamed};

/// The outcome of a streamed dump: CRIU's, and the store's.
pub(super) struct StreamedDump {
    pub dumped: Result<(), crate::dump::Error>,
    pub stored: crate::Result<Streamed>,
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
    let streams = ingest.streams(expected_bytes);
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
pub(in crate::flows) fn store_error_first(
    stored: crate::store::Result<Streamed>,
    fed: crate::Result<()>,
) -> crate::Result<Streamed> {
    match (stored, fed) {
        (Err(e), _) => Err(e.into()),
        (Ok(_), Err(e)) => Err(e),
        (Ok(s), Ok(())) => Ok(s),
    }
}

/// The resident memory of the tree, in bytes: about what CRIU's page images will hold.
pub(in crate::flows) fn resident_bytes(pids: &[i32]) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
    pids.iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/statm")).ok())
        .filter_map(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * page
}
