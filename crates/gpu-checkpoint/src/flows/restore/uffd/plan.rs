//! Which pages of a checkpoint go through userfaultfd, and where each lies: the [`Plan`] of a restore.
//!
//! Read out of the checkpoint's pagemaps (and the processes' mappings) before anything is restored, it
//! answers two questions: which bytes of each page image CRIU still reads itself (so materialization writes
//! only those, [`Plan::keep`]), and which runs of lazy pages are copied into which process, split so that
//! one copy never crosses a mapping (the kernel refuses those). Pure bookkeeping: no system call here.

use crate::dump::images::{parse_pagemap, parse_vmas, PE_LAZY, PE_PARENT, PE_PRESENT};
use crate::store::{CheckpointInfo, Store};

use super::other;
use super::sys::page_size;

/// Lazy pages of one process that are consecutive in memory, in one mapping, and in its page image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) vaddr: u64,
    /// Offset in the page image.
    pub(super) img_off: u64,
    pub(super) len: u64,
}

/// What to copy into one process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Task {
    pub(super) pid: i32,
    /// Its page image, `pages-N.img`.
    pub(super) pages: String,
    /// Lazy runs in page-image order.
    pub(super) lazy: Vec<Run>,
    /// Byte ranges of the page image that CRIU reads itself (present, not lazy).
    pub(super) kept: Vec<(u64, u64)>,
}

/// Which pages of a checkpoint go through userfaultfd, per process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(in crate::flows::restore) struct Plan {
    pub(super) tasks: Vec<Task>,
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
    pub(in crate::flows::restore) fn of(
        store: &Store,
        info: &CheckpointInfo,
    ) -> crate::store::Result<Plan> {
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
    pub(in crate::flows::restore) fn keep(&self, path: &str, off: u64, len: u64) -> bool {
        match self.tasks.iter().find(|t| t.pages == path) {
            Some(t) => t.kept.iter().any(|&(s, e)| s < off + len && off < e),
            None => true,
        }
    }
}

impl Task {
    pub(super) fn of(
        pid: i32,
        pm: &crate::dump::images::Pagemap,
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
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::dump::images::{encode, image, parse_pagemap};

    const P: u64 = 4096;

    pub(in crate::flows::restore::uffd) fn pagemap(
        entries: &[(u64, u64, u32)],
    ) -> crate::dump::images::Pagemap {
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
}
