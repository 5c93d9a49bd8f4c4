//! Copying the lazy pages into the restored processes: every chunk of a page image that holds lazy pages
//! is read and verified out of the store (on all of its workers, raw chunks straight from their mapped
//! files) and copied into its process with `UFFDIO_COPY`, at CRIU's post-restore notification.
//!
//! Chunks are content-defined and pages are not, so a page cut by a chunk boundary is assembled from the
//! chunks on either side before it is copied; all-zero chunks are not copied at all (with the registration
//! gone their pages read as zeros, as untouched anonymous memory does).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::store::{CheckpointInfo, Progress, Store};

use super::plan::{Plan, Task};
use super::sys::{self, page_size};
use super::{copy_error, other};

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
    /// Bytes of memory processes share with their parent or children (copy-on-write), left to CRIU so
    /// that they go on sharing it instead of each getting a copy here (counted once per process).
    pub shared_bytes: u64,
}

impl Plan {
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
                                sys::copy(uffd, to(p), &d[(p - off) as usize..(q - off) as usize])
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
                        sys::copy(uffd, to(page_start), &buf)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dump::images::{PE_LAZY, PE_PRESENT};
    use crate::flows::restore::uffd::plan::tests::pagemap;
    use crate::testdata::XorShift64;

    const P: u64 = 4096;

    /// The copy itself, into this test process's own memory through a real userfaultfd (where the kernel
    /// lets an unprivileged test open one; skipped with the reason otherwise).
    #[test]
    fn fill_copies_pages_cut_by_chunk_bounds_into_a_registered_mapping() {
        use crate::store::{ChunkParams, NoProgress, StoreOptions};
        let uffd = match sys::open(libc::O_CLOEXEC) {
            Ok(fd) => fd,
            Err(e) => {
                eprintln!("skipped: userfaultfd unavailable here ({e})");
                return;
            }
        };
        assert!(super::super::available());
        sys::handshake(uffd.as_raw_fd()).unwrap();

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
        sys::register_missing(uffd.as_raw_fd(), base, pages * P).unwrap();

        // A page image whose chunks (small, content-defined) do not fall on page bounds, as builds before
        // page-aligned cuts stored them (stored under another name so that it is cut like any file): a
        // zero run, random data, and a compressible run.
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
        std::fs::write(ing.staging_dir().join("image-3"), &img).unwrap();
        let mut info = ing
            .commit(serde_json::json!({}), &crate::store::NoProgress)
            .unwrap();
        info.files[0].path = "pages-3.img".into();
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
        let task = Task::of(77, &pm, &[(base, base + pages * P)], P, &vec![]).unwrap();
        let plan = Plan {
            tasks: vec![task],
            ..Plan::default()
        };
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
