//! Copying the lazy pages into the restored processes: every chunk of a page image that holds lazy pages
//! is read and verified out of the store and copied into each address space that still waits for some of
//! its bytes, with `UFFDIO_COPY`.
//!
//! Two paths feed the copies. The background fill reads every chunk on the store's workers, in image order
//! ([`Filler::fill_in_background`]). A page fault (a process that runs before all of its memory is in
//! touches a page not there yet, or CRIU's restorer touches one) puts its chunk at the head of the urgent
//! queue, which a few threads of their own read and copy first ([`Filler::serve_urgent`]): whatever the
//! processes (and a GPU driver restoring their device memory out of it) touch comes ahead of the rest. A
//! chunk is read once, by whichever path claims it first.
//!
//! Nothing reaches a process before its chunk is verified. While a process runs, what is pending follows
//! its mappings ([`Pending`]): the server reads each event under the write side of [`Filler::gate`], and a
//! copy looks up what is pending and copies it under the read side, so a copy never lands where the
//! process has just unmapped or dropped memory. A copy the kernel refuses because such an event is waiting
//! to be read (`EAGAIN`) is looked up again once it has been.
//!
//! Chunks are content-defined and pages need not be (checkpoints before page-aligned cuts), so a page cut
//! by a chunk boundary is assembled from the chunks on either side before it is copied; all-zero chunks are
//! not copied at all (once the registration is gone their pages read as zeros, as untouched anonymous
//! memory does, and a fault there before that gets the zero page).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use crate::store::{CheckpointInfo, ChunkSink, Progress, Store};

use super::pending::{Pending, Piece};
use super::plan::Plan;
use super::sys::{self, page_size, Copied};
use super::{copy_error, other};

/// What a restore through userfaultfd copied.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct FillStats {
    pub processes: u64,
    /// Bytes copied into the processes.
    pub copied_bytes: u64,
    /// Bytes of all-zero chunks, left to read as zeros.
    pub zero_bytes: u64,
    /// Page faults served (CRIU's restorer touches a few pages of lazy memory itself; processes resumed
    /// before their memory is in touch more).
    pub faults_served: u64,
    /// Bytes of memory processes share with their parent or children (copy-on-write), left to CRIU so
    /// that they go on sharing it instead of each getting a copy here (counted once per process).
    pub shared_bytes: u64,
    /// Bytes a running process unmapped or dropped before they were copied (never copied).
    pub dropped_bytes: u64,
    /// Processes forked while their memory was coming in (each got what was still pending in its parent).
    pub forks: u64,
    /// `mremap`, `munmap` and `MADV_DONTNEED` calls of running processes while their memory came in.
    pub mapping_changes: u64,
    /// Bytes collapsed back into huge pages once in (memory the kernel backs with huge pages, which
    /// userfaultfd copies in 4 KiB pages), and the time that took (ms).
    pub huge_bytes: u64,
    pub huge_ms: f64,
}

/// Chunk states: not read yet, being read by a worker, copied wherever it was pending.
const TODO: u8 = 0;
const CLAIMED: u8 = 1;
const DONE: u8 = 2;

/// One page image: where its chunks start, and how far each is.
struct Image {
    name: String,
    starts: Vec<u64>,
    lens: Vec<u64>,
    state: Vec<AtomicU8>,
}

impl Image {
    /// The chunk holding image byte `off`.
    fn chunk_at(&self, off: u64) -> Option<usize> {
        let ci = self.starts.partition_point(|&s| s <= off).checked_sub(1)?;
        (off < self.starts[ci] + self.lens[ci]).then_some(ci)
    }
}

/// A page cut by a chunk boundary: its bytes so far, and how many are filled.
type PartialPage = (Vec<u8>, u64);

/// One address space being filled: a restored process, or a child it forked meanwhile.
pub(super) struct Space {
    /// The process (for a forked child: its parent, whose memory it started from).
    pub(super) pid: i32,
    /// Its page image, in [`Filler::images`].
    image: usize,
    pub(super) uffd: OwnedFd,
    pending: Mutex<Pending>,
    /// Its memory is gone (it exited, or called `exec`): nothing more is copied into it.
    gone: AtomicBool,
}

/// The fill of one restore: see the module documentation.
pub(super) struct Filler<'a> {
    plan: &'a Plan,
    store: &'a Store,
    info: &'a CheckpointInfo,
    images: Vec<Image>,
    spaces: RwLock<Vec<Arc<Space>>>,
    /// Read side: a copy looks up what is pending and copies it. Write side: the server reads events that
    /// change what is pending.
    pub(super) gate: RwLock<()>,
    /// Pages cut by a chunk boundary, being assembled: (image, image offset of the page) -> (bytes, how
    /// many are filled).
    partial: Mutex<HashMap<(usize, u64), PartialPage>>,
    /// Chunks a fault waits for: (image, chunk).
    urgent: Mutex<VecDeque<(usize, usize)>>,
    urgent_cond: Condvar,
    stop: AtomicBool,
    error: Mutex<Option<crate::store::Error>>,
    copied: AtomicU64,
    zero: AtomicU64,
    faults: AtomicU64,
    dropped: AtomicU64,
    forks: AtomicU64,
    processes: AtomicU64,
    changes: AtomicU64,
}

impl<'a> Filler<'a> {
    pub(super) fn new(plan: &'a Plan, store: &'a Store, info: &'a CheckpointInfo) -> Filler<'a> {
        let mut images: Vec<Image> = Vec::new();
        for t in plan.tasks.iter().filter(|t| !t.lazy.is_empty()) {
            if images.iter().any(|i| i.name == t.pages) {
                continue;
            }
            let (mut starts, mut lens) = (Vec::new(), Vec::new());
            if let Some(f) = info.files.iter().find(|f| f.path == t.pages) {
                let mut at = 0u64;
                for c in &f.chunks {
                    starts.push(at);
                    lens.push(c.len as u64);
                    at += c.len as u64;
                }
            }
            let state = starts.iter().map(|_| AtomicU8::new(TODO)).collect();
            images.push(Image {
                name: t.pages.clone(),
                starts,
                lens,
                state,
            });
        }
        Filler {
            plan,
            store,
            info,
            images,
            spaces: RwLock::new(Vec::new()),
            gate: RwLock::new(()),
            partial: Mutex::new(HashMap::new()),
            urgent: Mutex::new(VecDeque::new()),
            urgent_cond: Condvar::new(),
            stop: AtomicBool::new(false),
            error: Mutex::new(None),
            copied: AtomicU64::new(0),
            zero: AtomicU64::new(0),
            faults: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            forks: AtomicU64::new(0),
            processes: AtomicU64::new(0),
            changes: AtomicU64::new(0),
        }
    }

    pub(super) fn spaces(&self) -> Vec<Arc<Space>> {
        self.spaces
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Process `pid`'s userfaultfd, as CRIU sent it: its lazy memory is pending from now on. A process the
    /// plan has nothing lazy for keeps its descriptor only until the end.
    pub(super) fn add_process(&self, pid: i32, uffd: OwnedFd) -> Arc<Space> {
        let task = self.plan.tasks.iter().find(|t| t.pid == pid);
        let image = task.and_then(|t| self.images.iter().position(|i| i.name == t.pages));
        let pending = match (task, image) {
            (Some(t), Some(_)) => {
                self.processes.fetch_add(1, Ordering::Relaxed);
                Pending::new(t.lazy.iter().map(|r| Piece {
                    vaddr: r.vaddr,
                    img_off: r.img_off,
                    len: r.len,
                }))
            }
            _ => Pending::default(),
        };
        self.push(pid, image.unwrap_or(usize::MAX), uffd, pending)
    }

    fn push(&self, pid: i32, image: usize, uffd: OwnedFd, pending: Pending) -> Arc<Space> {
        let space = Arc::new(Space {
            pid,
            image,
            uffd,
            pending: Mutex::new(pending),
            gone: AtomicBool::new(false),
        });
        self.spaces
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(space.clone());
        space
    }

    /// Whether process `pid` sent its descriptor.
    pub(super) fn has_process(&self, pid: i32) -> bool {
        self.spaces().iter().any(|s| s.pid == pid)
    }

    /// `parent` forked; `uffd` is the child's. Called with the gate held for writing (no copy under way),
    /// so the child starts from exactly what is pending in the parent.
    pub(super) fn forked(&self, parent: &Space, uffd: OwnedFd) -> Arc<Space> {
        let pending = parent
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        self.forks.fetch_add(1, Ordering::Relaxed);
        self.push(parent.pid, parent.image, uffd, pending)
    }

    /// `[start, end)` of `space` was unmapped or dropped (gate held for writing).
    pub(super) fn dropped(&self, space: &Space, start: u64, end: u64) {
        let n = lock(&space.pending).drop_range(start, end);
        self.dropped.fetch_add(n, Ordering::Relaxed);
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// `mremap` in `space` (gate held for writing).
    pub(super) fn remapped(&self, space: &Space, from: u64, to: u64, len: u64) {
        lock(&space.pending).remap(from, to, len);
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// A thread of `space` waits for the page at `addr`: its chunk (both, for a page cut by a chunk
    /// boundary) goes to the head of the urgent queue; a page nothing is pending for gets the zero page
    /// (it was never in the checkpoint, or the process dropped it).
    pub(super) fn fault(&self, space: &Space, addr: u64) -> crate::store::Result<()> {
        self.faults.fetch_add(1, Ordering::Relaxed);
        let page = page_size();
        let addr = addr - addr % page;
        let img = lock(&space.pending).find(addr);
        let fd = space.uffd.as_raw_fd();
        let Some(img) = img.filter(|_| space.image < self.images.len()) else {
            return match sys::zeropage(fd, addr, page) {
                Ok(()) => Ok(()),
                // There already (another path copied it), or a mapping change waits: wake the thread,
                // which faults again if it must.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::EAGAIN)) => {
                    sys::wake(fd, addr, page).map_err(|e| copy_error(space.pid, addr, page, e))
                }
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Ok(()),
                Err(e) => Err(copy_error(space.pid, addr, page, e)),
            };
        };
        let image = &self.images[space.image];
        let mut queue = lock(&self.urgent);
        for at in [img, img + page - 1] {
            if let Some(ci) = image.chunk_at(at) {
                if image.state[ci].load(Ordering::Acquire) == TODO
                    && !queue.contains(&(space.image, ci))
                {
                    queue.push_front((space.image, ci));
                }
            }
        }
        drop(queue);
        self.urgent_cond.notify_one();
        Ok(())
    }

    /// Serves the urgent queue until [`Filler::stop`]: one chunk at a time, read on this thread.
    pub(super) fn serve_urgent(&self) {
        let mut reader = match self.store.chunk_reader(self.info) {
            Ok(r) => r,
            Err(e) => return self.fail(e),
        };
        loop {
            let next = {
                let mut q = lock(&self.urgent);
                loop {
                    if self.stop.load(Ordering::SeqCst) {
                        return;
                    }
                    if let Some(n) = q.pop_front() {
                        break n;
                    }
                    q = self
                        .urgent_cond
                        .wait_timeout(q, Duration::from_millis(50))
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            };
            let (im, ci) = next;
            let image = &self.images[im];
            if !self.claim(im, ci) {
                continue;
            }
            let read = reader.read_at(&image.name, image.starts[ci], &mut |off, len, bytes| {
                self.copy_chunk(im, off, len, bytes)
            });
            match read {
                Ok(_) => image.state[ci].store(DONE, Ordering::Release),
                Err(e) => return self.fail(e),
            }
        }
    }

    fn claim(&self, im: usize, ci: usize) -> bool {
        self.images[im].state[ci]
            .compare_exchange(TODO, CLAIMED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Reads every chunk with pending bytes on the store's workers and copies it; returns once every
    /// chunk is copied (the urgent path's too) or at the first error.
    pub(super) fn fill_in_background(&self, progress: &dyn Progress) -> crate::store::Result<()> {
        let total: u64 = self.spaces().iter().map(|s| lock(&s.pending).bytes()).sum();
        progress.start("restore memory (userfaultfd)", total);
        let result = (|| {
            for (im, image) in self.images.iter().enumerate() {
                let sink = Background { filler: self, im };
                self.store
                    .visit_chunks(self.info, &image.name, &sink, progress)?
                    .ok_or_else(|| {
                        other(format!(
                            "checkpoint {} has no page image {}",
                            self.info.id, image.name
                        ))
                    })?;
            }
            // Chunks the urgent path claimed may still be in flight.
            while self
                .images
                .iter()
                .any(|i| i.state.iter().any(|s| s.load(Ordering::Acquire) == CLAIMED))
            {
                if let Some(e) = self.failure() {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            self.check_complete()
        })();
        progress.finish();
        result.map_err(|e| {
            // The first error is the one to report (the caller takes it): this one may only say that
            // another path failed first.
            self.fail(e);
            self.failure().expect("just recorded")
        })
    }

    /// After every chunk: nothing may be left pending but in processes that are gone.
    fn check_complete(&self) -> crate::store::Result<()> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        if let Some(&(im, page_off)) = lock(&self.partial).keys().next() {
            return Err(other(format!(
                "the page at image offset {page_off} of {} was not complete after every chunk was \
                 read (a damaged checkpoint)",
                self.images[im].name
            )));
        }
        for s in self.spaces() {
            let left = lock(&s.pending).bytes();
            if left > 0 && !s.gone.load(Ordering::Relaxed) {
                return Err(other(format!(
                    "process {}: {left} bytes of its memory were not copied after every chunk was read",
                    s.pid
                )));
            }
        }
        Ok(())
    }

    /// Copies chunk `[off, off + len)` of image `im` (its verified bytes; `None`: all zeros) into every
    /// space that waits for some of it, looking again after each mapping change that stopped a copy.
    fn copy_chunk(
        &self,
        im: usize,
        off: u64,
        len: u64,
        bytes: Option<&[u8]>,
    ) -> crate::store::Result<()> {
        let page = page_size();
        let end = off + len;
        // The pages this chunk completes, with their bytes: its whole pages, and a page cut by either of
        // its ends once the chunk on the other side has come too.
        let mut whole: Vec<(u64, std::borrow::Cow<'_, [u8]>)> = Vec::new();
        let (first, last) = (off.next_multiple_of(page), end - end % page);
        if let Some(d) = bytes {
            if first < last {
                let s = &d[(first - off) as usize..(last - off) as usize];
                whole.push((first, std::borrow::Cow::Borrowed(s)));
            }
        }
        let head_end = first.min(end);
        let tail_start = last.max(head_end);
        for (a, b) in [(off, head_end), (tail_start, end)] {
            if a < b {
                if let Some(p) = self.assemble(im, off, a, b, bytes) {
                    whole.push(p);
                }
            }
        }
        if bytes.is_none() {
            self.zero
                .fetch_add(last.saturating_sub(first), Ordering::Relaxed);
        }
        loop {
            let gate = self.gate.read().unwrap_or_else(|e| e.into_inner());
            let mut again = false;
            for space in self.spaces().iter().filter(|s| s.image == im) {
                if space.gone.load(Ordering::Relaxed) {
                    continue;
                }
                if bytes.is_none() && first < last {
                    // Zeros: nothing to copy, nothing pending any more (a fault gets the zero page).
                    lock(&space.pending).done(first, last - first);
                }
                for (at, data) in &whole {
                    match self.copy_into(space, *at, data)? {
                        Copied::All => {}
                        Copied::Again(_) => again = true,
                        Copied::Gone => space.gone.store(true, Ordering::Relaxed),
                    }
                }
            }
            drop(gate);
            if !again {
                return Ok(());
            }
            if let Some(e) = self.failure() {
                return Err(e);
            }
            // An event waits to be read: the server takes the gate for it as soon as we let go.
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Copies image bytes `data` at image offset `at` (whole pages) into `space`, where they are pending.
    fn copy_into(&self, space: &Space, at: u64, data: &[u8]) -> crate::store::Result<Copied> {
        let pieces = lock(&space.pending).within(at, data.len() as u64);
        for p in pieces {
            let src = &data[(p.img_off - at) as usize..(p.img_off - at + p.len) as usize];
            let copied = self.copy_piece(space, p.vaddr, src)?;
            let done = match copied {
                Copied::All => p.len,
                Copied::Again(n) => n,
                Copied::Gone => return Ok(Copied::Gone),
            };
            lock(&space.pending).done(p.img_off, done);
            self.copied.fetch_add(done, Ordering::Relaxed);
            if done < p.len {
                return Ok(copied);
            }
        }
        Ok(Copied::All)
    }

    /// One `UFFDIO_COPY` of `src` to `vaddr`, halved where it crosses a mapping's end: a running process
    /// may split a mapping (`mprotect` of a part) without an event, and one copy must stay in one mapping.
    fn copy_piece(&self, space: &Space, vaddr: u64, src: &[u8]) -> crate::store::Result<Copied> {
        let page = page_size() as usize;
        match sys::copy(space.uffd.as_raw_fd(), vaddr, src) {
            Ok(c) => Ok(c),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) && src.len() > page => {
                let half = (src.len() / page / 2) * page;
                match self.copy_piece(space, vaddr, &src[..half])? {
                    Copied::All => {}
                    other => return Ok(other),
                }
                Ok(
                    match self.copy_piece(space, vaddr + half as u64, &src[half..])? {
                        Copied::Again(n) => Copied::Again(half as u64 + n),
                        c => c,
                    },
                )
            }
            Err(e) => Err(copy_error(space.pid, vaddr, src.len() as u64, e)),
        }
    }

    /// Adds bytes `[a, b)` of chunk `[off, ..)` to the page they belong to; returns the page once it is
    /// complete.
    fn assemble<'d>(
        &self,
        im: usize,
        off: u64,
        a: u64,
        b: u64,
        bytes: Option<&[u8]>,
    ) -> Option<(u64, std::borrow::Cow<'d, [u8]>)> {
        let page = page_size();
        let page_start = a - a % page;
        let mut map = lock(&self.partial);
        let slot = map
            .entry((im, page_start))
            .or_insert_with(|| (vec![0u8; page as usize], 0));
        if let Some(d) = bytes {
            slot.0[(a - page_start) as usize..(b - page_start) as usize]
                .copy_from_slice(&d[(a - off) as usize..(b - off) as usize]);
        }
        slot.1 += b - a;
        if slot.1 < page {
            return None;
        }
        let (buf, _) = map.remove(&(im, page_start)).expect("present");
        Some((page_start, std::borrow::Cow::Owned(buf)))
    }

    /// Records the first error and stops every path.
    pub(super) fn fail(&self, e: crate::store::Error) {
        lock(&self.error).get_or_insert(e);
        self.stop();
    }

    /// The first error, as a store error (the restore's own errors travel as `Sink`).
    pub(super) fn failure(&self) -> Option<crate::store::Error> {
        lock(&self.error).as_ref().map(|e| other(e.to_string()))
    }

    /// The first error itself, taken out.
    pub(super) fn take_error(&self) -> Option<crate::store::Error> {
        lock(&self.error).take()
    }

    pub(super) fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        self.urgent_cond.notify_all();
    }

    pub(super) fn stats(&self) -> FillStats {
        FillStats {
            processes: self.processes.load(Ordering::Relaxed),
            copied_bytes: self.copied.load(Ordering::Relaxed),
            zero_bytes: self.zero.load(Ordering::Relaxed),
            faults_served: self.faults.load(Ordering::Relaxed),
            shared_bytes: self.plan.shared_bytes(),
            dropped_bytes: self.dropped.load(Ordering::Relaxed),
            forks: self.forks.load(Ordering::Relaxed),
            mapping_changes: self.changes.load(Ordering::Relaxed),
            huge_bytes: 0,
            huge_ms: 0.0,
        }
    }

    /// Every space's descriptor, dropped: the registrations go, and the processes fault normally from now
    /// on.
    pub(super) fn close(&self) {
        self.spaces
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
}

/// The background fill's sink for image `im`: a chunk is read only where something is pending, and only
/// when the urgent path has not taken it.
struct Background<'f, 'a> {
    filler: &'f Filler<'a>,
    im: usize,
}

impl ChunkSink for Background<'_, '_> {
    fn wants(&self, off: u64, len: u64) -> bool {
        self.filler
            .spaces()
            .iter()
            .filter(|s| s.image == self.im)
            .any(|s| !lock(&s.pending).within(off, len).is_empty())
    }

    fn claim(&self, off: u64, _len: u64) -> bool {
        // Before the claim: a fill slowed down here leaves the chunk to a fault meanwhile.
        crate::fault::at("restore.memory");
        if self.filler.stop.load(Ordering::Relaxed) {
            return false;
        }
        let image = &self.filler.images[self.im];
        image
            .chunk_at(off)
            .is_some_and(|ci| self.filler.claim(self.im, ci))
    }

    fn other_readers(&self) -> usize {
        super::URGENT_THREADS
    }

    fn visit(&self, off: u64, len: u64, bytes: Option<&[u8]>) -> crate::store::Result<()> {
        if let Some(e) = self.filler.failure() {
            return Err(e);
        }
        self.filler.copy_chunk(self.im, off, len, bytes)?;
        let image = &self.filler.images[self.im];
        if let Some(ci) = image.chunk_at(off) {
            image.state[ci].store(DONE, Ordering::Release);
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
#[path = "fill_tests.rs"]
mod tests;
