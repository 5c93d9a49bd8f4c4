//! The flows: the checkpoint and the restore of a process tree, of a container ([`container`]) and of a
//! job on many nodes ([`cluster`]), built on the stages below them (`detect`, `freeze`, `dump`, `store`). A
//! flow owns the order of operations and the undo on failure; the stages know how to do one thing each.
//!
//! What the flows share lives here, not in one of them: the outside world they work with ([`Flow`]), how
//! images travel ([`ImageTransfer`]), the checkpoint's manifest ([`manifest`]) and where CRIU's logs are
//! kept ([`save_log`]). Each of the tree's flows adds its own `impl Flow` block (`Flow::checkpoint` in
//! [`checkpoint`], `Flow::restore` in [`restore`]). Known violation, until the flows become one pipeline
//! with targets (issue 29): the container flow imports inner pieces of the checkpoint and restore flows
//! (`checkpoint::freeze_phased`, `dump_tree`, `restore::stream::send_image`, ...), and [`guardian`] the
//! container flow's undo types.

pub mod checkpoint;
pub mod cluster;
pub mod container;
pub mod engine;
pub mod guardian;
mod logs;
pub mod manifest;
mod phases;
pub mod restore;
pub(crate) mod thaw;
pub(crate) mod workdir;

use std::time::Instant;

use crate::dump::{AfterDump, Criu};
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
/// or `FakeCriu` in unit tests, the GPU step or [`crate::freeze::NoGpu`], a store, a progress display).
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
    /// other images, a few MiB (the default restore where userfaultfd is available, `restore/uffd/`). The
    /// processes go on as soon as CRIU has restored them; a page they touch before it is copied is served
    /// on demand, from its verified chunk, ahead of the rest. The restore returns once every page is in.
    Uffd,
    /// [`ImageTransfer::Uffd`], with the processes resumed only once all of their memory is in (nothing
    /// they do ever waits on a page).
    UffdFilled,
}

impl ImageTransfer {
    /// Whether a checkpoint's dump streams its images (CRIU's `--stream`): unless staged, whether the
    /// tree runs on after it or not (see [`ImageTransfer::after_dump`] for how a tree left running stays
    /// safe).
    pub fn dump_streams(self) -> bool {
        self != ImageTransfer::Staged
    }

    /// What CRIU is told to do with the tree at the end of a checkpoint's dump, given whether the tree
    /// runs on after the checkpoint (`leave_running`).
    ///
    /// A streamed dump never lets CRIU resume the tree (`--leave-running`): CRIU's parasite vmsplices the
    /// frozen pages into a pipe and CRIU splices them on into the streamer's pipe (16 MiB), which moves
    /// references to the process's own pages, not copies; CRIU resumes the tree while those pages still
    /// wait in the pipe, and every write the tree makes before the store reads them lands in the
    /// checkpoint (a restored process got a mix of two moments and segfaulted). So CRIU leaves the tree
    /// stopped (`--leave-stopped`), and the checkpoint flow continues it itself once the store has read
    /// (copied) every image out of the pipes (`dump_tree`'s `on_read`, while the store may still be
    /// writing them), before its GPU state is put back and before the commit. Staged, each page is copied into a file before CRIU resumes the tree: CRIU lets it go.
    pub fn after_dump(self, leave_running: bool) -> AfterDump {
        if leave_running && !self.dump_streams() {
            AfterDump::KeepRunning
        } else {
            AfterDump::Stop
        }
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
    use crate::dump::AfterDump;

    /// Every dump streams but a staged one; only a staged one lets CRIU resume the tree.
    #[test]
    fn a_streamed_dump_leaves_the_tree_stopped_even_when_it_runs_on() {
        assert!(ImageTransfer::Stream.dump_streams());
        assert!(!ImageTransfer::Staged.dump_streams());
        assert_eq!(ImageTransfer::Stream.after_dump(true), AfterDump::Stop);
        assert_eq!(ImageTransfer::Stream.after_dump(false), AfterDump::Stop);
        assert_eq!(
            ImageTransfer::Staged.after_dump(true),
            AfterDump::KeepRunning
        );
        assert_eq!(ImageTransfer::Staged.after_dump(false), AfterDump::Stop);
    }

    /// Why [`ImageTransfer::after_dump`] never lets CRIU resume a streamed tree: what CRIU hands the
    /// streamer is the process's own pages, not a copy. Like CRIU's parasite, the page is vmspliced into a pipe; like
    /// CRIU's `write_pages_loc`, spliced on into the streamer's pipe; the "process" then writes it, and the
    /// streamer reads the write.
    #[test]
    fn pages_spliced_into_the_streamers_pipe_are_the_processs_own() {
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
