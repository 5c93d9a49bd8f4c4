//! Which pages of a checkpoint go through userfaultfd, and where each lies: the [`Plan`] of a restore.
//!
//! Read out of the checkpoint's pagemaps (and the processes' mappings) before anything is restored, it
//! answers three questions: which bytes of each page image CRIU still reads itself (so materialization
//! writes only those, [`Plan::keep`]), which runs of lazy pages are copied into which process, split so
//! that one copy never crosses a mapping (the kernel refuses those), and, in a tree of processes, which
//! lazy pages are left to CRIU after all so that a parent and its children share them again (`cow.rs`);
//! for those, CRIU gets a pagemap without their `PE_LAZY` ([`Plan::pagemaps`]). Pure bookkeeping: no
//! system call here.

use std::collections::HashMap;

use crate::dump::images::{
    parse_mm, parse_pagemap, parse_pstree, write_pagemap, Mm, Pagemap, PagemapEntry, PE_LAZY,
    PE_PARENT, PE_PRESENT,
};
use crate::store::{CheckpointInfo, Store};

use super::cow::{self, Ranges};
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
    /// Byte ranges of the page image that CRIU reads itself (present and not lazy, or shared).
    pub(super) kept: Vec<(u64, u64)>,
    /// Bytes of lazy pages left to CRIU because the process shares them with its parent or a child.
    pub(super) shared: u64,
    /// The pagemap entries CRIU is to read instead of the dumped ones, when some pages recorded lazy
    /// are left to CRIU (`shared` > 0).
    pub(super) criu_entries: Option<Vec<PagemapEntry>>,
    /// Huge-page windows (`[start, end)`) wholly made of lazy pages in mappings the kernel backs with
    /// huge pages: collapsed back into huge pages once they are in (`crate::thp`).
    pub(super) huge: Vec<(u64, u64)>,
}

/// Which pages of a checkpoint go through userfaultfd, per process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(in crate::flows::restore) struct Plan {
    pub(super) tasks: Vec<Task>,
    /// Pagemap images (name, bytes) that replace the checkpoint's in CRIU's work folder: the pages
    /// shared between processes are not lazy there.
    pub(super) pagemaps: Vec<(String, Vec<u8>)>,
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
    /// Reads every process's pagemap (and mappings, and in a tree who is whose parent) out of
    /// checkpoint `info`.
    pub(in crate::flows::restore) fn of(
        store: &Store,
        info: &CheckpointInfo,
    ) -> crate::store::Result<Plan> {
        let page = page_size();
        let bad = |what: &str, e: String| other(format!("checkpoint {}: {what}: {e}", info.id));
        // (pid, pagemap image name, its bytes, parsed, the mappings)
        let mut procs: Vec<(i32, &str, Vec<u8>, Pagemap, Mm)> = Vec::new();
        for f in &info.files {
            let Some(pid) = f
                .path
                .strip_prefix("pagemap-")
                .and_then(|r| r.strip_suffix(".img"))
                .and_then(|p| p.parse::<i32>().ok())
            else {
                continue; // pagemap-shmem-*.img and everything else: restored by CRIU
            };
            let bytes = read_image(store, info, &f.path)?;
            let pm = parse_pagemap(&bytes).map_err(|e| bad(&f.path, e))?;
            let mm_name = format!("mm-{pid}.img");
            let mm = parse_mm(&read_image(store, info, &mm_name)?).map_err(|e| bad(&mm_name, e))?;
            procs.push((pid, &f.path, bytes, pm, mm));
        }
        // One process shares with nobody: no tree to read.
        let mut shared = if procs.len() > 1 {
            let parents = parents(store, info)?;
            let view: Vec<cow::Proc<'_>> = procs
                .iter()
                .map(|(pid, _, _, pm, mm)| cow::Proc {
                    pid: *pid,
                    ppid: parents.get(pid).copied(),
                    mm,
                    pagemap: pm,
                })
                .collect();
            cow::shared(&view, page)
        } else {
            HashMap::new()
        };
        let mut plan = Plan::default();
        let thp = crate::thp::collapse_mode();
        let huge = crate::thp::huge_page_size();
        for (pid, name, bytes, pm, mm) in &procs {
            let sh = shared.remove(pid).unwrap_or_default();
            let mut task = Task::of(*pid, pm, &mm.bounds(), page, &sh).map_err(|e| bad(name, e))?;
            task.huge = task.huge_windows(mm, thp, huge);
            if let Some(entries) = task.criu_entries.take() {
                let img = write_pagemap(bytes, &entries).map_err(|e| bad(name, e))?;
                plan.pagemaps.push((name.to_string(), img));
            }
            plan.tasks.push(task);
        }
        Ok(plan)
    }

    /// Bytes of lazy pages left to CRIU so that processes share them.
    pub(super) fn shared_bytes(&self) -> u64 {
        self.tasks.iter().map(|t| t.shared).sum()
    }

    /// Whether any page goes through userfaultfd.
    pub(super) fn is_empty(&self) -> bool {
        self.tasks.iter().all(|t| t.lazy.is_empty())
    }

    /// For [`Store::materialize_selected`]: a chunk of a page image is written only when CRIU reads some
    /// of its bytes; every other image is written whole, but for a pagemap the plan replaces (one of
    /// [`Plan::pagemaps`] is written in its place).
    pub(in crate::flows::restore) fn keep(&self, path: &str, off: u64, len: u64) -> bool {
        if self.pagemaps.iter().any(|(name, _)| name == path) {
            return false;
        }
        match self.tasks.iter().find(|t| t.pages == path) {
            Some(t) => t.kept.iter().any(|&(s, e)| s < off + len && off < e),
            None => true,
        }
    }
}

/// Each process's parent, from `pstree.img`; empty without that image (a checkpoint made by a stand-in
/// CRIU), which then restores as a set of unrelated processes.
fn parents(store: &Store, info: &CheckpointInfo) -> crate::store::Result<HashMap<i32, i32>> {
    let mut image = Vec::new();
    if store
        .stream_file(info, "pstree.img", &mut image, &crate::store::NoProgress)?
        .is_none()
    {
        return Ok(HashMap::new());
    }
    let tree = parse_pstree(&image)
        .map_err(|e| other(format!("checkpoint {}: pstree.img: {e}", info.id)))?;
    Ok(tree
        .into_iter()
        .map(|p| (p.pid as i32, p.ppid as i32))
        .collect())
}

impl Task {
    /// The task of process `pid` with pagemap `pm` and mappings `vmas` (bounds, sorted); the lazy pages
    /// in `shared` (sorted ranges) are left to CRIU.
    pub(super) fn of(
        pid: i32,
        pm: &Pagemap,
        vmas: &[(u64, u64)],
        page: u64,
        shared: &Ranges,
    ) -> Result<Task, String> {
        let mut task = Task {
            pid,
            pages: pm.pages_file(),
            lazy: Vec::new(),
            kept: Vec::new(),
            shared: 0,
            criu_entries: None,
            huge: Vec::new(),
        };
        // CRIU's pagemap, built only when some pages may change sides.
        let mut criu = (!shared.is_empty()).then(|| Vec::with_capacity(pm.entries.len()));
        let mut off = 0u64;
        for e in &pm.entries {
            if e.flags & PE_PARENT != 0 {
                return Err(
                    "pages in a parent checkpoint (incremental dumps are not supported)".into(),
                );
            }
            if e.flags & PE_PRESENT == 0 {
                if let Some(c) = criu.as_mut() {
                    c.push(*e);
                }
                continue; // no data in the image
            }
            let len = e
                .nr_pages
                .checked_mul(page)
                .ok_or("pagemap entry too large")?;
            if e.flags & PE_LAZY == 0 {
                if let Some(c) = criu.as_mut() {
                    c.push(*e);
                }
                task.kept.push((off, off + len));
                off += len;
                continue;
            }
            let end = e.vaddr.checked_add(len).ok_or("pagemap entry too large")?;
            for (from, to, is_shared) in cow::split(e.vaddr, end, shared) {
                let img = off + (from - e.vaddr);
                let mut flags = e.flags;
                if is_shared {
                    task.kept.push((img, img + (to - from)));
                    task.shared += to - from;
                    flags &= !PE_LAZY;
                } else {
                    task.push_lazy(from, to, img, vmas)?;
                }
                if let Some(c) = criu.as_mut() {
                    c.push(PagemapEntry {
                        vaddr: from,
                        nr_pages: (to - from) / page,
                        flags,
                    });
                }
            }
            off += len;
        }
        if task.shared > 0 {
            task.criu_entries = criu;
        }
        Ok(task)
    }

    /// The huge-page windows of its lazy memory (see [`Task::huge`]), under the kernel's `mode`.
    fn huge_windows(&self, mm: &Mm, mode: crate::thp::Mode, huge: u64) -> Vec<(u64, u64)> {
        let eligible: Vec<(u64, u64)> = mm
            .vmas
            .iter()
            .filter(|v| !v.is_guard() && crate::thp::eligible(mode, v))
            .map(|v| (v.start, v.end))
            .collect();
        let mut runs: Vec<(u64, u64)> = self
            .lazy
            .iter()
            .filter(|r| {
                eligible
                    .iter()
                    .any(|&(s, e)| s <= r.vaddr && r.vaddr + r.len <= e)
            })
            .map(|r| (r.vaddr, r.vaddr + r.len))
            .collect();
        runs.sort_unstable();
        crate::thp::windows(&runs, huge)
    }

    /// Adds the lazy pages `[va, end)`, at `img_off` in the page image, split at mapping bounds: one
    /// UFFDIO_COPY stays within one mapping.
    fn push_lazy(
        &mut self,
        mut va: u64,
        end: u64,
        mut img_off: u64,
        vmas: &[(u64, u64)],
    ) -> Result<(), String> {
        while va < end {
            // `vmas` is sorted and its mappings do not overlap: the first that ends past `va`.
            let &(_, vma_end) = vmas
                .get(vmas.partition_point(|&(_, e)| e <= va))
                .filter(|&&(s, _)| s <= va)
                .ok_or_else(|| format!("lazy pages at {va:#x} lie in no mapping"))?;
            let n = end.min(vma_end) - va;
            self.lazy.push(Run {
                vaddr: va,
                img_off,
                len: n,
            });
            va += n;
            img_off += n;
        }
        Ok(())
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
        let t = Task::of(9, &pm, &vmas, P, &vec![]).unwrap();
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
        let plan = Plan {
            tasks: vec![t],
            ..Plan::default()
        };
        assert!(!plan.is_empty());
        assert!(plan.keep("pages-3.img", P, 10), "overlaps the stack");
        assert!(!plan.keep("pages-3.img", 2 * P, 5 * P), "only lazy pages");
        assert!(plan.keep("core-9.img", 0, 100), "other images whole");
    }

    /// Pages shared with a parent or child leave the lazy runs for CRIU: kept in the image, and
    /// without `PE_LAZY` in the pagemap CRIU reads (entries cut where sharing starts and ends).
    #[test]
    fn shared_pages_are_left_to_criu_with_their_lazy_flag_cleared() {
        let pm = pagemap(&[
            (0x10000, 1, PE_PRESENT),           // a stack
            (0x20000, 8, PE_PRESENT | PE_LAZY), // pages 2..6 shared
            (0x90000, 1, PE_LAZY),              // not in the image
            (0x40000, 2, PE_PRESENT | PE_LAZY), // not shared
        ]);
        let vmas = [(0x10000, 0x11000), (0x20000, 0x28000), (0x40000, 0x42000)];
        let shared = vec![(0x22000, 0x26000), (0x30000, 0x31000)];
        let t = Task::of(9, &pm, &vmas, P, &shared).unwrap();
        assert_eq!(t.shared, 4 * P);
        assert_eq!(t.kept, vec![(0, P), (3 * P, 7 * P)]);
        let run = |vaddr, img_off, pages| Run {
            vaddr,
            img_off,
            len: pages * P,
        };
        assert_eq!(
            t.lazy,
            vec![
                run(0x20000, P, 2),
                run(0x26000, 7 * P, 2),
                run(0x40000, 9 * P, 2)
            ]
        );
        let e = |vaddr, nr_pages, flags| PagemapEntry {
            vaddr,
            nr_pages,
            flags,
        };
        assert_eq!(
            t.criu_entries.unwrap(),
            vec![
                e(0x10000, 1, PE_PRESENT),
                e(0x20000, 2, PE_PRESENT | PE_LAZY),
                e(0x22000, 4, PE_PRESENT),
                e(0x26000, 2, PE_PRESENT | PE_LAZY),
                e(0x90000, 1, PE_LAZY),
                e(0x40000, 2, PE_PRESENT | PE_LAZY),
            ]
        );
        // Sharing where the process has no lazy page changes nothing.
        let t = Task::of(9, &pm, &vmas, P, &vec![(0x10000, 0x11000)]).unwrap();
        assert_eq!((t.shared, t.criu_entries), (0, None));
    }

    /// Out of a stored checkpoint of a parent and its child (the images CRIU writes): the tree comes
    /// from `pstree.img`, and both pagemaps are replaced by ones where the common pages are not lazy.
    #[test]
    fn a_plan_of_a_tree_rewrites_the_pagemaps_of_what_parent_and_child_share() {
        use crate::dump::images::encode::{mm, uint};
        use crate::store::{NoProgress, StoreOptions};
        let t = tempfile::tempdir().unwrap();
        let store = Store::open(t.path(), StoreOptions::default()).unwrap();
        let ing = store.begin(None).unwrap();
        let dir = ing.staging_dir().to_path_buf();
        let base = 0x7f00_0000_0000u64;
        let entry = |pid: u64, ppid: u64| {
            let mut m = Vec::new();
            uint(1, pid, &mut m);
            uint(2, ppid, &mut m);
            uint(5, pid, &mut m);
            m
        };
        let images = [
            ("pstree.img", image(&[entry(10, 0), entry(11, 10)])),
            // The parent has 8 pages, the child the last 6 and 2 of its own past them.
            (
                "pagemap-10.img",
                image(&[
                    encode::pagemap_head(1),
                    encode::pagemap_entry(base, 8, PE_PRESENT | PE_LAZY),
                ]),
            ),
            (
                "pagemap-11.img",
                image(&[
                    encode::pagemap_head(2),
                    encode::pagemap_entry(base + 2 * P, 8, PE_PRESENT | PE_LAZY),
                ]),
            ),
            ("mm-10.img", image(&[mm(&[(base, base + 16 * P)])])),
            ("mm-11.img", image(&[mm(&[(base, base + 16 * P)])])),
            ("pages-1.img", vec![1u8; 8 * P as usize]),
            ("pages-2.img", vec![2u8; 8 * P as usize]),
        ];
        for (name, bytes) in &images {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        let info = ing.commit(serde_json::json!({}), &NoProgress).unwrap();

        let plan = Plan::of(&store, &info).unwrap();
        assert_eq!(plan.shared_bytes(), 2 * 6 * P);
        let criu_reads = |name: &str| {
            let (_, bytes) = plan.pagemaps.iter().find(|(n, _)| n == name).unwrap();
            parse_pagemap(bytes)
                .unwrap()
                .entries
                .iter()
                .map(|e| (e.vaddr, e.nr_pages, e.flags))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            criu_reads("pagemap-10.img"),
            vec![
                (base, 2, PE_PRESENT | PE_LAZY),
                (base + 2 * P, 6, PE_PRESENT)
            ]
        );
        assert_eq!(
            criu_reads("pagemap-11.img"),
            vec![
                (base + 2 * P, 6, PE_PRESENT),
                (base + 8 * P, 2, PE_PRESENT | PE_LAZY)
            ]
        );
        assert!(!plan.keep("pagemap-10.img", 0, 10), "written by the plan");
        assert!(plan.keep("pages-1.img", 2 * P, P), "shared: CRIU reads it");
        assert!(!plan.keep("pages-1.img", 0, 2 * P), "the parent's own");
        assert!(!plan.keep("pages-2.img", 6 * P, 2 * P), "the child's own");
        assert!(plan.keep("pstree.img", 0, 10));
        assert!(!plan.is_empty());

        // Without the tree (a stand-in CRIU's checkpoint) nothing is shared.
        let ing = store.begin(None).unwrap();
        for (name, bytes) in images.iter().skip(1) {
            std::fs::write(ing.staging_dir().join(name), bytes).unwrap();
        }
        let info = ing.commit(serde_json::json!({}), &NoProgress).unwrap();
        let plan = Plan::of(&store, &info).unwrap();
        assert_eq!((plan.shared_bytes(), plan.pagemaps.len()), (0, 0));
    }

    #[test]
    fn a_plan_refuses_what_it_cannot_restore() {
        let pm = pagemap(&[(0x20000, 1, PE_PRESENT | PE_LAZY)]);
        assert!(Task::of(1, &pm, &[(0x40000, 0x50000)], P, &vec![])
            .unwrap_err()
            .contains("no mapping"));
        let pm = pagemap(&[(0x20000, 1, PE_PARENT)]);
        assert!(Task::of(1, &pm, &[(0x20000, 0x21000)], P, &vec![])
            .unwrap_err()
            .contains("parent"));
    }
}
