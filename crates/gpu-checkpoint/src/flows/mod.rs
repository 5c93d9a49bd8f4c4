//! The flows: the checkpoint and the restore (and next the container and cluster flows), built on the
//! stages below them (`detect`, `freeze`, `dump`, `store`). A flow owns the order of operations and the undo
//! on failure; the stages know how to do one thing each.
//!
//! What the flows share lives here, not in one of them, so that no flow reaches into another: the outside
//! world they work with ([`Flow`]), how images travel ([`ImageTransfer`]), the checkpoint's manifest
//! ([`manifest`]) and where CRIU's logs are kept ([`save_log`]). Each flow adds its own `impl Flow` block
//! (`Flow::checkpoint` in [`checkpoint`], `Flow::restore` in [`restore`]).

pub mod checkpoint;
pub mod cluster;
pub mod container;
pub mod guardian;
mod logs;
pub mod manifest;
mod phases;
pub mod restore;
pub(crate) mod thaw;

use std::time::Instant;

use crate::dump::Criu;
use crate::freeze::GpuHook;
use crate::store::{Progress, Store};
pub use guardian::{Event, Watch};
pub use phases::{Alone, NotCommitted, Phases};

pub use logs::{fallback_logs_dir, logs_dir, save_log};
pub use manifest::{
    CheckpointManifest, ContainerProcess, ContainerRecord, CriuInfo, HostInfo, OptionsRecord,
    PhaseTimings, Sizes,
};

/// The outside world the checkpoint and restore flows work with, each chosen by the caller (real CRIU
/// or [`crate::dump::FakeCriu`], the GPU step or [`crate::freeze::NoGpu`], a store, a progress display).
pub struct Flow<'a> {
    pub criu: &'a dyn Criu,
    pub gpu: &'a mut dyn GpuHook,
    pub store: &'a Store,
    pub progress: &'a dyn Progress,
    /// How CRIU's images travel between CRIU and the store.
    pub images: ImageTransfer,
    /// Who is told each step, to finish or undo it should this process die ([`guardian`]).
    pub watch: &'a dyn Watch,
}

/// How CRIU's images travel between CRIU and the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImageTransfer {
    /// Through CRIU's image streamer (`--stream`): pipes straight into the store's chunker on checkpoint,
    /// and from verified chunks straight to CRIU on restore. The images are written and read once.
    #[default]
    Stream,
    /// Through files: CRIU writes its images into a staging folder that the store then ingests, and
    /// restore materializes them into a work folder first. Twice the disk traffic; for CRIUs or setups
    /// where streaming does not work.
    Staged,
    /// Restore only (a checkpoint streams): the processes' private memory is copied from the store
    /// straight into them through userfaultfd, and CRIU restores everything else from a folder of the
    /// other images, a few MiB (the default restore where userfaultfd is available, `restore/uffd/`).
    Uffd,
}

impl ImageTransfer {
    /// Whether a checkpoint's dump streams its images (CRIU's `--stream`), given whether the tree runs on
    /// right after it (`leave_running`).
    ///
    /// A tree left running is dumped through files: streamed, its memory could be stored as it is *after*
    /// it resumed. CRIU's parasite vmsplices the frozen pages into a pipe and CRIU splices them on into the
    /// streamer's pipe (16 MiB), which moves references to the process's own pages, not copies; CRIU then
    /// lets the tree go while those pages still wait in the pipe, and every write the tree makes before
    /// the store reads them lands in the checkpoint. Under load the store reads late, and the restored
    /// process got a mix of two moments (it segfaulted). Written to a file, each page is copied into the
    /// page cache before CRIU resumes the tree. A stopped tree never writes again, so it streams.
    pub fn dump_streams(self, leave_running: bool) -> bool {
        self != ImageTransfer::Staged && !leave_running
    }

    /// `Staged` when asked for (the CLI's `--staged`), else the default, `Stream`.
    pub fn staged_if(staged: bool) -> ImageTransfer {
        if staged {
            ImageTransfer::Staged
        } else {
            ImageTransfer::Stream
        }
    }
}

/// Milliseconds since `since`, as the flows' timings record them.
pub(crate) fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsRawFd;

    use super::ImageTransfer;

    /// Why [`ImageTransfer::dump_streams`] refuses a tree left running: what CRIU hands the streamer is
    /// the process's own pages, not a copy. Like CRIU's parasite, the page is vmspliced into a pipe; like
    /// CRIU's `write_pages_loc`, spliced on into the streamer's pipe; the "process" then writes it, and the
    /// streamer reads the write.
    #[test]
    fn pages_spliced_into_the_streamers_pipe_are_the_processs_own() {
        assert!(ImageTransfer::Stream.dump_streams(false));
        assert!(!ImageTransfer::Stream.dump_streams(true));
        assert!(!ImageTransfer::Staged.dump_streams(false));

        let mut page = vec![b'A'; 4096].into_boxed_slice();
        let at = page.as_mut_ptr();
        let (r1, w1) = nix::unistd::pipe().unwrap();
        let (r2, w2) = nix::unistd::pipe().unwrap();
        let iov = libc::iovec {
            iov_base: at.cast(),
            iov_len: page.len(),
        };
        // SAFETY: one valid iovec over `page`, which outlives the read below.
        let n = unsafe { libc::vmsplice(w1.as_raw_fd(), &iov, 1, 0) };
        assert_eq!(n, 4096);
        // SAFETY: plain splice between two pipes we own.
        let n = unsafe {
            libc::splice(
                r1.as_raw_fd(),
                std::ptr::null_mut(),
                w2.as_raw_fd(),
                std::ptr::null_mut(),
                4096,
                libc::SPLICE_F_MOVE,
            )
        };
        assert_eq!(n, 4096);
        // The tree resumes and writes its memory (volatile: the compiler must not drop the write).
        // SAFETY: `at` points into `page`, which is ours and alive.
        unsafe { std::ptr::write_volatile(at, b'B') };
        let mut got = vec![0u8; 4096];
        std::fs::File::from(r2).read_exact(&mut got).unwrap();
        assert_eq!(
            got[0], b'B',
            "the write after the splice is what the streamer reads"
        );
        drop(page);
    }
}
