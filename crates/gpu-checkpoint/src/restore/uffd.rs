//! Restore with the processes' private memory copied from the store straight into them through
//! userfaultfd (`restore --uffd`), instead of through CRIU.
//!
//! Why: a streamed restore cannot get under about 1.22x plain `criu restore` (`docs/criu.md`): in stream
//! mode CRIU premaps every private mapping and reads its pages from a pipe, while a plain restore reads
//! page-cache files into place; a staged restore pays a whole extra copy. Here no page goes through CRIU:
//! 1. The checkpoint's pagemaps say which pages CRIU may leave to a userfaultfd handler (`PE_LAZY`:
//!    private anonymous memory that is not a stack), and where each page lies in the page image.
//! 2. The images are materialized without those pages: the page images become sparse files holding only
//!    the pages CRIU still reads itself (stacks, a few MiB at most).
//! 3. CRIU restores with `--lazy-pages`: it maps the memory, registers it with one userfaultfd per process
//!    and sends each descriptor over `lazy-pages.socket` in its work folder (CRIU's own protocol with its
//!    `lazy-pages` daemon: the PID as a 32-bit integer, then the descriptor as `SCM_RIGHTS`).
//! 4. At CRIU's `post-restore` notification every process is restored and none runs yet. We then copy
//!    every lazy page out of its verified chunk into its process (`UFFDIO_COPY`, chunk by chunk on all
//!    workers; raw chunks straight from their mapped files), close the userfaultfds, and only then answer.
//!    The processes resume with all of their memory and without a registration: no page fault and no
//!    userfaultfd event (fork, mremap, munmap) ever has to be served, so nothing depends on this process
//!    staying alive afterwards. Pages of all-zero chunks are not copied at all: with the registration
//!    gone they read as zeros, as untouched anonymous memory does.
//! 5. A failure (a damaged chunk, a copy the kernel refuses, a process CRIU sent no descriptor for)
//!    answers the notification with an error: CRIU then kills the restored tree, and the checkpoint is
//!    left as it was.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::criu_images::{parse_pagemap, parse_vmas, PE_LAZY, PE_PARENT, PE_PRESENT};
use crate::store::{CheckpointInfo, Progress, Store};

/// The socket CRIU connects to (criu/uffd.c, `LAZY_PAGES_SOCK_NAME`), in its work folder.
pub const SOCKET: &str = "lazy-pages.socket";
/// What CRIU sends on the socket once the restore is done (criu/uffd.c), after the descriptors.
const RESTORE_FINISHED: i32 = 0x5253_5446;

/// `_IOWR(0xAA, 0x03, struct uffdio_copy)` (linux/userfaultfd.h).
const UFFDIO_COPY: libc::c_ulong = 0xC028_AA03;

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    /// Bytes copied, or a negative errno.
    copy: i64,
}

/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xC018_AA3F;
/// `UFFD_API`.
const UFFD_API: u64 = 0xAA;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

/// Whether this process may use userfaultfd (kernel support, and no seccomp filter or sysctl in the way)
/// and the kernel speaks its API: `restore` copies memory through it by default and streams to CRIU
/// otherwise. Only the basic service is needed (missing-page copies into anonymous memory, which CRIU
/// registers): the processes never run with a registration, so no event feature is.
pub fn available() -> bool {
    // SAFETY: plain syscall; a descriptor it returns is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd < 0 {
        return false;
    }
    // SAFETY: the descriptor was just opened and nothing else owns it; it closes on drop.
    let fd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as RawFd) };
    let mut api = UffdioApi {
        api: UFFD_API,
        features: 0,
        ioctls: 0,
    };
    // SAFETY: UFFDIO_API with a valid struct on our descriptor.
    unsafe { libc::ioctl(fd.as_raw_fd(), UFFDIO_API, &mut api as *mut UffdioApi) == 0 }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

/// Lazy pages of one process that are consecutive in memory, in one mapping, and in its page image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    vaddr: u64,
    /// Offset in the page image.
    img_off: u64,
    len: u64,
}

/// What to copy into one process.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Task {
    pid: i32,
    /// Its page image, `pages-N.img`.
    pages: String,
    /// Lazy runs in page-image order.
    lazy: Vec<Run>,
    /// Byte ranges of the page image that CRIU reads itself (present, not lazy).
    kept: Vec<(u64, u64)>,
}

/// Which pages of a checkpoint go through userfaultfd, per process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Plan {
    tasks: Vec<Task>,
}

/// What a restore through userfaultfd copied.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct FillStats {
    pub processes: u64,
    /// Bytes copied into the processes.
    pub copied_bytes: u64,
    /// Bytes of all-zero chunks, left to read as zeros.
    pub zero_bytes: u64,
    /// Page faults served while CRIU restored (its restorer touches a few pages of lazy memory itself).
    pub faults_served: u64,
}

fn other(msg: String) -> crate::store::Error {
    crate::store::Error::Other(msg)
}

/// The whole image `name` of checkpoint `info`, read and verified out of the store.
fn read_image(store: &Store, info: &CheckpointInfo, name: &str) -> crate::store::Result<Vec<u8>> {
    let mut out = Vec::new();
    match store.stream_file(info, name, &mut out, &crate::store::NoProgress)? {
        Some(_) => Ok(out),
        None => Err(other(format!("checkpoint {} has no image {name}", info.id))),
    }
}

impl Plan {
    /// Reads every process's pagemap (and mappings) out of checkpoint `info`.
    pub(super) fn of(store: &Store, info: &CheckpointInfo) -> crate::store::Result<Plan> {
        let page = page_size();
        let mut tasks = Vec::new();
        for f in &info.files {
            let Some(pid) = f
                .path
                .strip_prefix("pagemap-")
                .and_then(|r| r.strip_suffix(".img"))
                .and_then(|p| p.parse::<i32>().ok())
            else {
                continue; // pagemap-shmem-*.img and everything else: restored by CRIU
            };
            let bad = |what: &str, e: String| other(format!("checkpoint {}: {what}: {e}", info.id));
            let pm =
                parse_pagemap(&read_image(store, info, &f.path)?).map_err(|e| bad(&f.path, e))?;
            let mm_name = format!("mm-{pid}.img");
            let vmas =
                parse_vmas(&read_image(store, info, &mm_name)?).map_err(|e| bad(&mm_name, e))?;
            tasks.push(Task::of(pid, &pm, &vmas, page).map_err(|e| bad(&f.path, e))?);
        }
        Ok(Plan { tasks })
    }

    /// Whether any page goes through userfaultfd.
    pub(super) fn is_empty(&self) -> bool {
        self.tasks.iter().all(|t| t.lazy.is_empty())
    }

    /// For [`Store::materialize_selected`]: a chunk of a page image is written only when CRIU reads some
    /// of its bytes; every other image is written whole.
    pub(super) fn keep(&self, path: &str, off: u64, len: u64) -> bool {
        match self.tasks.iter().find(|t| t.pages == path) {
            Some(t) => t.kept.iter().any(|&(s, e)| s < off + len && off < e),
            None => true,
        }
    }

    /// Copies every lazy page into its process through the userfaultfd CRIU sent for it, then closes the
    /// descriptors (see the module documentation).
    pub(super) fn fill(
        &self,
        store: &Store,
        info: &CheckpointInfo,
        mut uffds: HashMap<i32, OwnedFd>,
        progress: &dyn Progress,
    ) -> crate::store::Result<FillStats> {
        let mut stats = FillStats::default();
        let total: u64 = self.tasks.iter().flat_map(|t| &t.lazy).map(|r| r.len).sum();
        progress.start("restore memory (userfaultfd)", total);
        let result = (|| {
            for task in self.tasks.iter().filter(|t| !t.lazy.is_empty()) {
                let uffd = uffds.get(&task.pid).ok_or_else(|| {
                    other(format!(
                        "CRIU sent no userfaultfd for process {} (its memory cannot be restored)",
                        task.pid
                    ))
                })?;
                let (copied, zero) = task.fill(store, info, uffd.as_raw_fd(), progress)?;
                stats.processes += 1;
                stats.copied_bytes += copied;
                stats.zero_bytes += zero;
            }
            Ok(stats)
        })();
        progress.finish();
        // Closing drops the registrations: the processes will fault normally from now on.
        uffds.clear();
        result
    }
}

impl Task {
    fn of(
        pid: i32,
        pm: &super::criu_images::Pagemap,
        vmas: &[(u64, u64)],
        page: u64,
    ) -> Result<Task, String> {
        let mut task = Task {
            pid,
            pages: pm.pages_file(),
            lazy: Vec::new(),
            kept: Vec::new(),
        };
        let mut off = 0u64;
        for e in &pm.entries {
            if e.flags & PE_PARENT != 0 {
                return Err(
                    "pages in a parent checkpoint (incremental dumps are not supported)".into(),
                );
            }
            if e.flags & PE_PRESENT == 0 {
                continue; // no data in the image
            }
            let len = e
                .nr_pages
                .checked_mul(page)
                .ok_or("pagemap entry too large")?;
            if e.flags & PE_LAZY == 0 {
                task.kept.push((off, off + len));
            } else {
                // Split at mapping bounds: one UFFDIO_COPY stays within one mapping.
                let (mut va, end) = (e.vaddr, e.vaddr + len);
                while va < end {
                    // `vmas` is sorted and its mappings do not overlap: the first that ends past `va`.
                    let &(_, vma_end) = vmas
                        .get(vmas.partition_point(|&(_, e)| e <= va))
                        .filter(|&&(s, _)| s <= va)
                        .ok_or_else(|| format!("lazy pages at {va:#x} lie in no mapping"))?;
                    let n = end.min(vma_end) - va;
                    task.lazy.push(Run {
                        vaddr: va,
                        img_off: off + (va - e.vaddr),
                        len: n,
                    });
                    va += n;
                }
            }
            off += len;
        }
        Ok(task)
    }

    /// Copies this process's lazy pages; returns (bytes copied, bytes of zero chunks skipped).
    fn fill(
        &self,
        store: &Store,
        info: &CheckpointInfo,
        uffd: RawFd,
        progress: &dyn Progress,
    ) -> crate::store::Result<(u64, u64)> {
        let page = page_size();
        let overlapping = |off: u64, len: u64| {
            // Runs are in image order and do not overlap: binary search for the first that ends after `off`.
            let first = self.lazy.partition_point(|r| r.img_off + r.len <= off);
            self.lazy[first..]
                .iter()
                .take_while(move |r| r.img_off < off + len)
        };
        // Pages cut by a chunk boundary (chunks are content-defined, pages are not), assembled from the
        // chunks on either side: image offset of the page -> (bytes, how many are filled).
        let partial: Mutex<HashMap<u64, (Vec<u8>, u64)>> = Mutex::new(HashMap::new());
        let copied = AtomicU64::new(0);
        let zero = AtomicU64::new(0);
        let want = |off: u64, len: u64| overlapping(off, len).next().is_some();
        let visit = |off: u64, len: u64, bytes: Option<&[u8]>| -> crate::store::Result<()> {
            let end = off + len;
            for run in overlapping(off, len) {
                let (a, b) = (off.max(run.img_off), end.min(run.img_off + run.len));
                let to = |img: u64| run.vaddr + (img - run.img_off);
                let mut p = a;
                while p < b {
                    let page_start = p - p % page;
                    if p == page_start && page_start + page <= b {
                        // Whole pages, from `p` to the last page that ends within the chunk.
                        let q = b - b % page;
                        match bytes {
                            Some(d) => {
                                uffd_copy(uffd, to(p), &d[(p - off) as usize..(q - off) as usize])
                                    .map_err(|e| copy_error(self.pid, to(p), q - p, e))?;
                                copied.fetch_add(q - p, Ordering::Relaxed);
                            }
                            None => {
                                zero.fetch_add(q - p, Ordering::Relaxed);
                            }
                        }
                        p = q;
                        continue;
                    }
                    // Part of a page cut by the chunk's start or end.
                    let q = b.min(page_start + page);
                    let mut map = partial.lock().unwrap_or_else(|e| e.into_inner());
                    let slot = map
                        .entry(page_start)
                        .or_insert_with(|| (vec![0u8; page as usize], 0));
                    if let Some(d) = bytes {
                        slot.0[(p - page_start) as usize..(q - page_start) as usize]
                            .copy_from_slice(&d[(p - off) as usize..(q - off) as usize]);
                    }
                    slot.1 += q - p;
                    if slot.1 == page {
                        let (buf, _) = map.remove(&page_start).expect("present");
                        drop(map);
                        uffd_copy(uffd, to(page_start), &buf)
                            .map_err(|e| copy_error(self.pid, to(page_start), page, e))?;
                        copied.fetch_add(page, Ordering::Relaxed);
                    }
                    p = q;
                }
            }
            Ok(())
        };
        store
            .visit_chunks(info, &self.pages, &want, &visit, progress)?
            .ok_or_else(|| {
                other(format!(
                    "checkpoint {} has no page image {} for process {}",
                    info.id, self.pages, self.pid
                ))
            })?;
        let left = partial.into_inner().unwrap_or_else(|e| e.into_inner());
        if let Some(page_start) = left.keys().min() {
            return Err(other(format!(
                "process {}: the page at image offset {page_start} of {} was not complete after \
                 every chunk was read (a damaged checkpoint)",
                self.pid, self.pages
            )));
        }
        Ok((copied.into_inner(), zero.into_inner()))
    }
}

fn copy_error(pid: i32, addr: u64, len: u64, e: std::io::Error) -> crate::store::Error {
    other(format!(
        "cannot copy {len} bytes into process {pid} at {addr:#x} (UFFDIO_COPY): {e}"
    ))
}

/// `UFFDIO_COPY` of `src` to `dst` (page-aligned, whole pages), resumed after partial copies.
fn uffd_copy(uffd: RawFd, dst: u64, src: &[u8]) -> std::io::Result<()> {
    let len = src.len() as u64;
    let mut done = 0u64;
    while done < len {
        let mut c = UffdioCopy {
            dst: dst + done,
            src: src.as_ptr() as u64 + done,
            len: len - done,
            mode: 0,
            copy: 0,
        };
        // SAFETY: UFFDIO_COPY reads `len - done` bytes at `src + done`, which `src` holds, and writes
        // the kernel's result into `c`.
        let r = unsafe { libc::ioctl(uffd, UFFDIO_COPY, &mut c as *mut UffdioCopy) };
        if c.copy > 0 {
            done += c.copy as u64;
        }
        if r == 0 {
            continue;
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            // Partly done (the part is counted above), or the mappings changed under the copy: go on.
            Some(libc::EAGAIN) => {}
            // A page that is there already (served during the restore, or by a second fault): skip.
            Some(libc::EEXIST) => done += page_size(),
            _ => return Err(e),
        }
    }
    Ok(())
}

/// Runs `criu.restore(req)` with lazy pages, filling the memory at the post-restore notification (see
/// the module documentation). `req.images_dir` holds the images [`Plan::keep`] selected. Returns CRIU's
/// result and the fill's (its error, when it made CRIU fail, is the one to report).
pub(super) fn restore(
    criu: &dyn crate::dump::Criu,
    req: &crate::dump::RestoreRequest<'_>,
    store: &Store,
    info: &CheckpointInfo,
    plan: &Plan,
    progress: &dyn Progress,
) -> (
    Result<i32, crate::dump::Error>,
    crate::store::Result<FillStats>,
) {
    if plan.is_empty() {
        // Nothing CRIU would leave to us: an ordinary restore from the (whole) images.
        return (criu.restore(req), Ok(FillStats::default()));
    }
    let socket = match LazySocket::bind(req.images_dir) {
        Ok(s) => s,
        Err(e) => {
            let e = crate::dump::Error::io(
                format!("listening for CRIU in {}", req.images_dir.display()),
                e,
            );
            return (Err(e), Ok(FillStats::default()));
        }
    };
    let server = Server {
        socket: &socket,
        plan,
        store,
        info,
        uffds: Mutex::new(HashMap::new()),
        stop: AtomicBool::new(false),
        served: AtomicU64::new(0),
    };
    let outcome: Mutex<Option<crate::store::Result<FillStats>>> = Mutex::new(None);
    let (restored, serve_result) = std::thread::scope(|s| {
        let serving = s.spawn(|| server.run());
        let serving = Mutex::new(Some(serving));
        // Stops the fault server (the restorer is done touching memory) and returns its result.
        let stop_serving = || -> crate::store::Result<()> {
            server.stop.store(true, Ordering::SeqCst);
            match serving.lock().unwrap_or_else(|e| e.into_inner()).take() {
                Some(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(other("the page-fault server panicked".into()))),
                None => Ok(()),
            }
        };
        let hook = || -> Result<(), String> {
            let filled = stop_serving().and_then(|()| {
                let uffds =
                    std::mem::take(&mut *server.uffds.lock().unwrap_or_else(|e| e.into_inner()));
                plan.fill(store, info, uffds, progress)
            });
            let verdict = filled.as_ref().map(|_| ()).map_err(|e| e.to_string());
            *outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(filled);
            verdict
        };
        let req = crate::dump::RestoreRequest {
            lazy_pages: true,
            post_restore: Some(&hook),
            ..req.clone()
        };
        let restored = criu.restore(&req);
        (restored, stop_serving())
    });
    let filled = outcome
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_else(|| match (&restored, serve_result) {
            // CRIU failed before its notification; a fault-server error would say why, else CRIU's
            // own error does.
            (Err(_), served) => served.map(|()| FillStats::default()),
            // Restored without the notification: the memory was never copied, and with the
            // descriptors closed it would read as zeros. The caller must not let it run.
            (Ok(_), _) => Err(other(
                "CRIU restored without a post-restore notification: the memory was not copied"
                    .into(),
            )),
        })
        .map(|mut st| {
            st.faults_served = server.served.into_inner();
            st
        });
    (restored, filled)
}

/// `struct uffd_msg` (linux/userfaultfd.h): the event, then its arguments.
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdMsg {
    event: u8,
    _reserved: [u8; 7],
    /// For a page fault: flags, address, thread id.
    arg: [u64; 3],
}

const UFFD_EVENT_PAGEFAULT: u8 = 0x12;

/// `_IOWR(0xAA, 0x04, struct uffdio_zeropage)`.
const UFFDIO_ZEROPAGE: libc::c_ulong = 0xC020_AA04;

/// CRIU's side of the restore before the post-restore notification: receives the userfaultfds as CRIU
/// sends them, and answers the page faults CRIU's restorer causes itself (it touches a few pages of lazy
/// memory while completing a process, e.g. the thread's rseq area). The processes are not running yet,
/// so no other event can come.
struct Server<'a> {
    socket: &'a LazySocket,
    plan: &'a Plan,
    store: &'a Store,
    info: &'a CheckpointInfo,
    uffds: Mutex<HashMap<i32, OwnedFd>>,
    stop: AtomicBool,
    served: AtomicU64,
}

impl Server<'_> {
    /// Until `stop`: accept CRIU's connection, take descriptors, serve faults.
    fn run(&self) -> crate::store::Result<()> {
        let io = |what: &str, e: std::io::Error| other(format!("{what}: {e}"));
        let mut conn: Option<UnixStream> = None;
        let mut conn_open = true;
        while !self.stop.load(Ordering::SeqCst) {
            let uffds: Vec<(i32, RawFd)> = self
                .uffds
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .map(|(p, f)| (*p, f.as_raw_fd()))
                .collect();
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(uffds.len() + 1);
            let head = match &conn {
                None => self.socket.listener.as_raw_fd(),
                Some(c) if conn_open => c.as_raw_fd(),
                Some(_) => -1, // poll ignores negative descriptors
            };
            fds.push(libc::pollfd {
                fd: head,
                events: libc::POLLIN,
                revents: 0,
            });
            fds.extend(uffds.iter().map(|&(_, fd)| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            }));
            // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 20) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(io("waiting for CRIU", e));
            }
            if fds[0].revents != 0 {
                match conn.as_mut() {
                    None => match self.socket.listener.accept() {
                        Ok((c, _)) => {
                            c.set_nonblocking(false)
                                .and_then(|()| c.set_read_timeout(Some(Duration::from_secs(5))))
                                .map_err(|e| io("CRIU's lazy-pages connection", e))?;
                            conn = Some(c);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(io("accepting CRIU's lazy-pages connection", e)),
                    },
                    Some(c) => {
                        let mut word = [0u8; 4];
                        match c.read(&mut word[..1]) {
                            Ok(0) => conn_open = false,
                            Ok(_) => {
                                c.read_exact(&mut word[1..])
                                    .map_err(|e| io("reading CRIU's lazy-pages message", e))?;
                                let pid = i32::from_ne_bytes(word);
                                if pid > 0 && pid != RESTORE_FINISHED {
                                    let fd =
                                        recv_fd(c).map_err(|e| io("receiving a userfaultfd", e))?;
                                    self.uffds
                                        .lock()
                                        .unwrap_or_else(|e| e.into_inner())
                                        .insert(pid, fd);
                                }
                                // pid < 0: a zombie (no memory); RESTORE_FINISHED: nothing to do.
                            }
                            Err(e) => return Err(io("reading CRIU's lazy-pages message", e)),
                        }
                    }
                }
            }
            for (k, &(pid, fd)) in uffds.iter().enumerate() {
                if fds[k + 1].revents != 0 {
                    self.drain(pid, fd)?;
                }
            }
        }
        // CRIU writes "restore finished" on the connection later: keep it open until the socket goes.
        *self.socket.conn.lock().unwrap_or_else(|e| e.into_inner()) = conn;
        Ok(())
    }

    /// Handles every event queued on process `pid`'s userfaultfd.
    fn drain(&self, pid: i32, uffd: RawFd) -> crate::store::Result<()> {
        loop {
            let mut msg = UffdMsg {
                event: 0,
                _reserved: [0; 7],
                arg: [0; 3],
            };
            let size = std::mem::size_of::<UffdMsg>();
            // SAFETY: reading at most `size` bytes into `msg`, a plain-old-data struct of that size.
            let n = unsafe { libc::read(uffd, (&mut msg as *mut UffdMsg).cast(), size) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                return match e.kind() {
                    std::io::ErrorKind::WouldBlock => Ok(()),
                    std::io::ErrorKind::Interrupted => continue,
                    _ => Err(other(format!("reading process {pid}'s userfaultfd: {e}"))),
                };
            }
            if n as usize != size {
                return Err(other(format!(
                    "short userfaultfd message ({n} bytes) from process {pid}"
                )));
            }
            if msg.event != UFFD_EVENT_PAGEFAULT {
                return Err(other(format!(
                    "process {pid}: userfaultfd event {:#x} while CRIU restored it (only page \
                     faults are expected before it runs)",
                    msg.event
                )));
            }
            self.serve_fault(pid, uffd, msg.arg[1])?;
        }
    }

    /// Copies the page at `addr` (or a zero page, if the checkpoint holds none there) into process `pid`.
    fn serve_fault(&self, pid: i32, uffd: RawFd, addr: u64) -> crate::store::Result<()> {
        let page = page_size();
        let addr = addr - addr % page;
        let task = self.plan.tasks.iter().find(|t| t.pid == pid);
        let run = task.and_then(|t| {
            let i = t.lazy.partition_point(|r| r.vaddr + r.len <= addr);
            t.lazy.get(i).filter(|r| r.vaddr <= addr)
        });
        let result = match (task, run) {
            (Some(task), Some(run)) => {
                let img = run.img_off + (addr - run.vaddr);
                let buf = Mutex::new(vec![0u8; page as usize]);
                let want = |off: u64, len: u64| off < img + page && img < off + len;
                let visit = |off: u64, len: u64, bytes: Option<&[u8]>| {
                    if let Some(d) = bytes {
                        let (a, b) = (off.max(img), (off + len).min(img + page));
                        buf.lock().unwrap_or_else(|e| e.into_inner())
                            [(a - img) as usize..(b - img) as usize]
                            .copy_from_slice(&d[(a - off) as usize..(b - off) as usize]);
                    }
                    Ok(())
                };
                self.store.visit_chunks(
                    self.info,
                    &task.pages,
                    &want,
                    &visit,
                    &crate::store::NoProgress,
                )?;
                let buf = buf.into_inner().unwrap_or_else(|e| e.into_inner());
                uffd_copy(uffd, addr, &buf)
            }
            // Not in the checkpoint: the page was never touched, it reads as zeros.
            _ => uffd_zeropage(uffd, addr, page),
        };
        match result {
            Ok(()) => {}
            // Served already (two threads faulted on it).
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(copy_error(pid, addr, page, e)),
        }
        self.served.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

fn uffd_zeropage(uffd: RawFd, addr: u64, len: u64) -> std::io::Result<()> {
    #[repr(C)]
    struct UffdioZeropage {
        start: u64,
        len: u64,
        mode: u64,
        zeropage: i64,
    }
    let mut z = UffdioZeropage {
        start: addr,
        len,
        mode: 0,
        zeropage: 0,
    };
    // SAFETY: UFFDIO_ZEROPAGE with a valid struct; the kernel writes its result into `z`.
    if unsafe { libc::ioctl(uffd, UFFDIO_ZEROPAGE, &mut z as *mut UffdioZeropage) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The socket CRIU sends the userfaultfds over, listening in CRIU's work folder; removed on drop.
pub(super) struct LazySocket {
    listener: UnixListener,
    path: PathBuf,
    /// CRIU's connection, kept open until CRIU is done: it writes "restore finished" on it after the
    /// post-restore notification, and would get a broken pipe if we had hung up.
    conn: Mutex<Option<UnixStream>>,
}

impl LazySocket {
    /// Only root may connect: whoever sends a descriptor there gets memory written into it.
    pub(super) fn bind(dir: &Path) -> std::io::Result<LazySocket> {
        let path = dir.join(SOCKET);
        let listener = crate::dump::streamer::bind_in(dir, SOCKET)?;
        Ok(LazySocket {
            listener,
            path,
            conn: Mutex::new(None),
        })
    }
}

impl Drop for LazySocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One descriptor sent with `SCM_RIGHTS` (CRIU sends it with a one-byte payload).
fn recv_fd(conn: &UnixStream) -> std::io::Result<OwnedFd> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use std::os::fd::FromRawFd;
    let mut byte = [0u8; 1];
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!(RawFd);
    let msg = recvmsg::<()>(
        conn.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(std::io::Error::from)?;
    for c in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            if let Some(&fd) = fds.first() {
                // SAFETY: the kernel just installed `fd` in our table for us; nobody else owns it.
                return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
            }
        }
    }
    Err(std::io::Error::other(
        "CRIU sent a PID without its userfaultfd",
    ))
}

#[cfg(test)]
mod tests {
    use super::super::criu_images::{encode, image, parse_pagemap};
    use super::*;
    use crate::testdata::XorShift64;

    const P: u64 = 4096;

    fn pagemap(entries: &[(u64, u64, u32)]) -> super::super::criu_images::Pagemap {
        let mut msgs = vec![encode::pagemap_head(3)];
        msgs.extend(
            entries
                .iter()
                .map(|&(va, n, f)| encode::pagemap_entry(va, n, f)),
        );
        parse_pagemap(&image(&msgs)).unwrap()
    }

    #[test]
    fn a_plan_splits_lazy_runs_at_mappings_and_keeps_what_criu_reads() {
        let pm = pagemap(&[
            (0x10000, 2, PE_PRESENT),           // a stack: CRIU reads it
            (0x20000, 4, PE_PRESENT | PE_LAZY), // spans two mappings
            (0x90000, 1, PE_LAZY),              // not in the image (page server): nothing to do
            (0x30000, 1, PE_PRESENT | PE_LAZY),
        ]);
        let vmas = [(0x10000, 0x12000), (0x20000, 0x22000), (0x22000, 0x31000)];
        let t = Task::of(9, &pm, &vmas, P).unwrap();
        assert_eq!(t.pages, "pages-3.img");
        assert_eq!(t.kept, vec![(0, 2 * P)]);
        assert_eq!(
            t.lazy,
            vec![
                Run {
                    vaddr: 0x20000,
                    img_off: 2 * P,
                    len: 2 * P
                },
                Run {
                    vaddr: 0x22000,
                    img_off: 4 * P,
                    len: 2 * P
                },
                Run {
                    vaddr: 0x30000,
                    img_off: 6 * P,
                    len: P
                },
            ]
        );
        let plan = Plan { tasks: vec![t] };
        assert!(!plan.is_empty());
        assert!(plan.keep("pages-3.img", P, 10), "overlaps the stack");
        assert!(!plan.keep("pages-3.img", 2 * P, 5 * P), "only lazy pages");
        assert!(plan.keep("core-9.img", 0, 100), "other images whole");
    }

    #[test]
    fn a_plan_refuses_what_it_cannot_restore() {
        let pm = pagemap(&[(0x20000, 1, PE_PRESENT | PE_LAZY)]);
        assert!(Task::of(1, &pm, &[(0x40000, 0x50000)], P)
            .unwrap_err()
            .contains("no mapping"));
        let pm = pagemap(&[(0x20000, 1, PE_PARENT)]);
        assert!(Task::of(1, &pm, &[(0x20000, 0x21000)], P)
            .unwrap_err()
            .contains("parent"));
    }

    /// The copy itself, into this test process's own memory through a real userfaultfd (where the kernel
    /// lets an unprivileged test open one; skipped with the reason otherwise).
    #[test]
    fn fill_copies_pages_cut_by_chunk_bounds_into_a_registered_mapping() {
        use crate::store::{ChunkParams, NoProgress, StoreOptions};
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) } as i32;
        if fd < 0 {
            eprintln!(
                "skipped: userfaultfd unavailable here ({})",
                std::io::Error::last_os_error()
            );
            return;
        }
        // SAFETY: `fd` was just opened and is owned here.
        let uffd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        #[repr(C)]
        struct Register {
            start: u64,
            len: u64,
            mode: u64,
            ioctls: u64,
        }
        assert!(available());
        let mut api = UffdioApi {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API on our descriptor with a valid struct.
        assert_eq!(unsafe { libc::ioctl(fd, UFFDIO_API, &mut api) }, 0);

        // The "process memory": 40 pages, of which a page image holds 36 lazily (pages 2..38).
        let pages = 40u64;
        // SAFETY: a fresh private anonymous mapping, unmapped at the end.
        let mem = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                (pages * P) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(mem, libc::MAP_FAILED);
        let base = mem as u64;
        let mut reg = Register {
            start: base,
            len: pages * P,
            mode: 1, // MISSING
            ioctls: 0,
        };
        // SAFETY: UFFDIO_REGISTER (_IOWR(0xAA, 0x00, 32 bytes)) of our own mapping.
        assert_eq!(unsafe { libc::ioctl(fd, 0xC020_AA00, &mut reg) }, 0);

        // A page image whose chunks (small, content-defined) do not fall on page bounds: a zero run,
        // random data, and a compressible run.
        let mut img = vec![0u8; (38 * P) as usize];
        let mut rng = XorShift64::new(0x9e37_79b9_7f4a_7c15);
        for (i, b) in img.iter_mut().enumerate() {
            let x = rng.next_u64();
            *b = match (i as u64) / P {
                0..=1 => 0x55,      // kept: CRIU's part
                2..=9 => 0,         // zero chunks
                10..=25 => x as u8, // raw chunks
                _ => b"abc"[i % 3], // compressed chunks
            };
        }
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(
            t.path(),
            StoreOptions {
                chunking: ChunkParams {
                    min_size: 6 * 1024,
                    avg_size: 10 * 1024,
                    max_size: 32 * 1024,
                },
                threads: 3,
                ..StoreOptions::default()
            },
        )
        .unwrap();
        let ing = store.begin(None).unwrap();
        std::fs::write(ing.staging_dir().join("pages-3.img"), &img).unwrap();
        let info = ing
            .commit(serde_json::json!({}), &crate::store::NoProgress)
            .unwrap();
        assert!(
            info.files[0]
                .chunks
                .iter()
                .any(|c| !(c.len as u64).is_multiple_of(P)),
            "chunks cut pages"
        );

        let pm = pagemap(&[
            (base, 2, PE_PRESENT),
            (base + 2 * P, 36, PE_PRESENT | PE_LAZY),
        ]);
        let task = Task::of(77, &pm, &[(base, base + pages * P)], P).unwrap();
        let plan = Plan { tasks: vec![task] };
        let stats = plan
            .fill(&store, &info, HashMap::from([(77, uffd)]), &NoProgress)
            .unwrap();
        assert_eq!(stats.processes, 1);
        assert_eq!(stats.copied_bytes + stats.zero_bytes, 36 * P);
        assert!(stats.zero_bytes > 0, "the zero run was not copied");
        // SAFETY: the mapping is ours and readable; the registration went with the closed descriptor, so
        // untouched pages read as zeros instead of blocking.
        let got = unsafe { std::slice::from_raw_parts(mem as *const u8, (pages * P) as usize) };
        assert!(
            got[..(2 * P) as usize].iter().all(|&b| b == 0),
            "CRIU's pages are not ours to copy"
        );
        assert!(
            got[(2 * P) as usize..(38 * P) as usize] == img[(2 * P) as usize..],
            "the lazy pages"
        );
        assert!(got[(38 * P) as usize..].iter().all(|&b| b == 0));
        // SAFETY: unmapping the mapping made above; `got` is not used after this.
        unsafe { libc::munmap(mem, (pages * P) as usize) };
    }
}
