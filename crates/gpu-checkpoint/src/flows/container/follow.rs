//! The runtime's image stored while the runtime still writes it (runsc's `checkpoint.img`): ours then
//! takes about the runtime's own checkpoint plus a short tail, instead of the checkpoint and then a
//! whole read of the image.
//!
//! runsc (2022) opens `checkpoint.img` with `O_CREAT|O_EXCL` (no pipe can be put in its place) and writes
//! it from start to end. A reader follows the growing file: it reads to its current end and waits for
//! more while the runtime runs. An empty read is the image's true end only when the runtime was seen to
//! have exited with success *before* that read: before, it may just not have written the rest yet, so
//! the file's size is never taken as final until then. Should the runtime fail, the reader fails too, and
//! the streaming session with it: nothing of it is committed.
//!
//! runsc's command line returns only after the sandbox answered its checkpoint call, which it does once
//! the image is written: its writes are in the file (the page cache) when our wait for the command ends.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::{CheckpointRequest, ContainerRuntime, Error};
use crate::store::{Ingest, Progress, Streamed};

/// How long a reader at the file's current end waits before looking again (an exit wakes it at once).
/// Short next to the runtime's write rate: at most this much of the tail's latency comes from it.
const POLL: Duration = Duration::from_millis(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writer {
    Running,
    Succeeded,
    Failed,
}

/// What the readers of a growing file know of its writer; the thread that waits for the writer tells it
/// how it ended ([`Follow::finished`]).
pub struct Follow {
    writer: Mutex<Writer>,
    ended: Condvar,
}

impl Default for Follow {
    fn default() -> Self {
        Follow {
            writer: Mutex::new(Writer::Running),
            ended: Condvar::new(),
        }
    }
}

impl Follow {
    /// The writer ended: with success (its file is whole), or not (its file is to be discarded).
    pub fn finished(&self, ok: bool) {
        *self.writer.lock().unwrap_or_else(|p| p.into_inner()) = if ok {
            Writer::Succeeded
        } else {
            Writer::Failed
        };
        self.ended.notify_all();
    }

    fn writer(&self) -> Writer {
        *self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits up to [`POLL`] while the writer runs.
    fn pause(&self) {
        let w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if *w == Writer::Running {
            drop(self.ended.wait_timeout(w, POLL));
        }
    }

    /// Opens `path` once the writer has created it. `None`: the writer ended with success without
    /// creating it; an error if it failed first.
    pub fn open(&self, path: &Path) -> io::Result<Option<FollowReader<'_>>> {
        loop {
            let writer = self.writer();
            match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
            {
                Ok(file) => return Ok(Some(FollowReader { file, follow: self })),
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                Err(_) => {}
            }
            match writer {
                Writer::Running => self.pause(),
                Writer::Succeeded => return Ok(None),
                Writer::Failed => return Err(failed()),
            }
        }
    }
}

fn failed() -> io::Error {
    io::Error::other("the runtime's checkpoint failed: its image is discarded")
}

/// Reads a file its writer is still writing, to the end it has once the writer succeeded.
pub struct FollowReader<'a> {
    file: File,
    follow: &'a Follow,
}

impl Read for FollowReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            // Looked at before the read: a writer seen done had written all by then.
            let writer = self.follow.writer();
            if writer == Writer::Failed {
                return Err(failed());
            }
            match self.file.read(buf) {
                Ok(0) if writer == Writer::Succeeded => return Ok(0),
                Ok(0) => self.follow.pause(),
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// What [`checkpoint_following`] did: the runtime's checkpoint, and the store's side of its image.
pub(super) struct Followed {
    pub dumped: Result<(), Error>,
    pub stored: crate::Result<Streamed>,
}

/// Runs the runtime's checkpoint into `req.images` while storing its image `name` into `ingest` as it
/// grows. `expected_bytes` sizes the store's buffers.
pub(super) fn checkpoint_following(
    runtime: &dyn ContainerRuntime,
    req: &CheckpointRequest<'_>,
    name: &str,
    (ingest, progress, expected_bytes): (&Ingest, &dyn Progress, u64),
) -> Followed {
    let streams = ingest.streams(expected_bytes);
    let follow = Follow::default();
    let path = req.images.join(name);
    progress.start("checkpoint + store", expected_bytes);
    let (dumped, added) = std::thread::scope(|s| {
        for _ in 0..streams.workers() {
            s.spawn(|| streams.work(progress));
        }
        let reader = s.spawn(|| -> crate::Result<()> {
            let opened = follow.open(&path).map_err(Error::io_at(&path))?;
            match opened {
                Some(r) => Ok(streams.add_bulk(name, r)?),
                None => Ok(()),
            }
        });
        let dumped = runtime.checkpoint(req);
        follow.finished(dumped.is_ok());
        let added = reader.join().unwrap_or_else(|_| {
            Err(crate::store::Error::Internal("image reader panicked".into()).into())
        });
        streams.close();
        (dumped, added)
    });
    progress.finish();
    let stored = streams.finish();
    Followed {
        dumped,
        stored: crate::flows::pipeline::store_error_first(stored, added),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A writer that writes `data` in pieces with pauses (as runsc does, slower than we read), then ends
    /// with `ok`; returns what a follower read.
    fn follow_slow_writer(data: &[u8], ok: bool) -> io::Result<Vec<u8>> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.img");
        let follow = Follow::default();
        std::thread::scope(|s| {
            let reader = s.spawn(|| -> io::Result<Vec<u8>> {
                let mut out = Vec::new();
                follow
                    .open(&path)?
                    .expect("created")
                    .read_to_end(&mut out)?;
                Ok(out)
            });
            std::thread::sleep(Duration::from_millis(20)); // the reader waits for the file
            let mut f = File::options()
                .write(true)
                .create_new(true)
                .open(&path)
                .unwrap();
            for piece in data.chunks(data.len() / 7 + 1) {
                f.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(15));
            }
            drop(f);
            follow.finished(ok);
            reader.join().unwrap()
        })
    }

    #[test]
    fn a_follower_reads_the_whole_file_a_slow_writer_wrote_and_only_after_it_succeeded() {
        let data: Vec<u8> = (0..300_001u32).map(|i| (i % 251) as u8).collect();
        let read = follow_slow_writer(&data, true).unwrap();
        assert_eq!(read.len(), data.len());
        assert!(read == data, "the follower's bytes differ from the file");
    }

    #[test]
    fn a_follower_fails_when_the_writer_fails() {
        let data = vec![5u8; 100_000];
        let e = follow_slow_writer(&data, false).unwrap_err();
        assert!(e.to_string().contains("failed"), "{e}");
    }

    #[test]
    fn a_writer_that_succeeds_without_the_file_gives_no_reader_and_one_that_fails_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let follow = Follow::default();
        follow.finished(true);
        assert!(follow.open(&dir.path().join("none")).unwrap().is_none());
        let follow = Follow::default();
        follow.finished(false);
        assert!(follow.open(&dir.path().join("none")).is_err());
    }
}
