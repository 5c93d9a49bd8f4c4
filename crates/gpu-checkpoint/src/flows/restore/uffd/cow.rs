//! Which pages a parent and its children share after CRIU restores them (copy-on-write), so that the
//! userfaultfd restore leaves exactly those to CRIU instead of copying one private copy into each.
//!
//! After a fork, parent and child share every private page until one of them writes it; CRIU dumps
//! each process's pages in full (a shared page is in both page images) and gets the sharing back at
//! restore (criu/mem.c): it pairs each of a child's private mappings with the parent's mapping at the
//! same bounds (`prepare_cow_vmas`, `check_cow_vmas`), fills the parent's memory, forks the child,
//! which inherits it, and then for each page of the child compares the image's bytes with the inherited
//! ones (`restore_priv_vma_content`): equal pages stay shared, the others are written (a private copy)
//! and inherited pages the child does not have are dropped. Pages it leaves to userfaultfd (`PE_LAZY`)
//! take no part: the parent's are not there to inherit when the child forks, the child's are dropped
//! and copied in later, one copy per process.
//!
//! So a page stays shared only when CRIU reads it itself on both sides. This module finds the pages
//! where that can matter, by CRIU's own rules: in a mapping CRIU pairs between a process and its parent,
//! the pages both have in their images. Both sides' copies of those are left to CRIU; the other lazy
//! pages still go through userfaultfd. A page whose two copies differ is written by CRIU as a private
//! copy, as it would be anyway.
//!
//! Pure bookkeeping over the parsed images: no system call here.

use std::collections::HashMap;

use crate::dump::images::{Mm, Pagemap, Vma, PE_PRESENT};

/// Sorted, disjoint address ranges `[start, end)`.
pub(super) type Ranges = Vec<(u64, u64)>;

/// One restored process, as far as sharing with its parent goes.
pub(super) struct Proc<'a> {
    pub(super) pid: i32,
    /// Its parent in the checkpoint's tree (`None`: the root, or a tree without `pstree.img`).
    pub(super) ppid: Option<i32>,
    pub(super) mm: &'a Mm,
    pub(super) pagemap: &'a Pagemap,
}

/// Per process, the ranges CRIU restores itself so that it shares them with its parent or its
/// children (see the module documentation). Processes with nothing to share are absent.
pub(super) fn shared(procs: &[Proc<'_>], page: u64) -> HashMap<i32, Ranges> {
    let by_pid: HashMap<i32, &Proc<'_>> = procs.iter().map(|p| (p.pid, p)).collect();
    let mut out: HashMap<i32, Ranges> = HashMap::new();
    for child in procs {
        let Some(parent) = child.ppid.and_then(|pp| by_pid.get(&pp)) else {
            continue; // no parent whose memory CRIU restores (the root, a helper, a zombie)
        };
        // Another executable maps nothing the child inherited (criu/mem.c, `prepare_cow_vmas`).
        if child.mm.exe_file_id != parent.mm.exe_file_id {
            continue;
        }
        let both = intersect(
            &present(child.pagemap, page),
            &present(parent.pagemap, page),
        );
        let common = intersect(&paired(child.mm, parent.mm), &both);
        if common.is_empty() {
            continue;
        }
        for pid in [child.pid, parent.pid] {
            out.entry(pid).or_default().extend_from_slice(&common);
        }
    }
    for ranges in out.values_mut() {
        *ranges = merged(std::mem::take(ranges));
    }
    out
}

/// The mappings of `child` CRIU pairs with one of `parent`'s (criu/mem.c, `prepare_cow_vmas_for`: the
/// same start, then `check_cow_vmas`).
fn paired(child: &Mm, parent: &Mm) -> Ranges {
    // Guard areas come after every mapping in the image, where CRIU's pairing stops.
    let by_start: HashMap<u64, &Vma> = parent
        .vmas
        .iter()
        .filter(|v| !v.is_guard())
        .map(|v| (v.start, v))
        .collect();
    let pairs = child
        .vmas
        .iter()
        .filter(|v| !v.is_guard())
        .filter(|v| by_start.get(&v.start).is_some_and(|p| can_share(v, p)));
    merged(pairs.map(|v| (v.start, v.end)).collect())
}

/// criu/mem.c, `check_cow_vmas`: the same bounds, both private, no huge pages, the same growth
/// direction and kind (anonymous or not), and for files the same file.
fn can_share(vma: &Vma, pvma: &Vma) -> bool {
    let (anon, down, huge) = (
        libc::MAP_ANONYMOUS as u32,
        libc::MAP_GROWSDOWN as u32,
        libc::MAP_HUGETLB as u32,
    );
    vma.end == pvma.end
        && vma.is_private()
        && pvma.is_private()
        && (vma.flags | pvma.flags) & huge == 0
        && (vma.flags ^ pvma.flags) & (down | anon) == 0
        && (vma.flags & anon != 0 || vma.shmid == pvma.shmid)
}

/// The addresses whose pages are in the process's page image.
fn present(pm: &Pagemap, page: u64) -> Ranges {
    merged(
        pm.entries
            .iter()
            .filter(|e| e.flags & PE_PRESENT != 0)
            .map(|e| {
                let len = e.nr_pages.saturating_mul(page);
                (e.vaddr, e.vaddr.saturating_add(len))
            })
            .collect(),
    )
}

/// Sorted, with overlapping and touching ranges joined.
fn merged(mut r: Ranges) -> Ranges {
    r.retain(|&(s, e)| s < e);
    r.sort_unstable();
    let mut out: Ranges = Vec::with_capacity(r.len());
    for (s, e) in r {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// The addresses in both `a` and `b`.
fn intersect(a: &Ranges, b: &Ranges) -> Ranges {
    let (mut i, mut j, mut out) = (0, 0, Vec::new());
    while i < a.len() && j < b.len() {
        let (s, e) = (a[i].0.max(b[j].0), a[i].1.min(b[j].1));
        if s < e {
            out.push((s, e));
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    out
}

/// `[start, end)` cut at the bounds of `shared` (sorted, disjoint): `(from, to, in shared)` in order.
pub(super) fn split(start: u64, end: u64, shared: &[(u64, u64)]) -> Vec<(u64, u64, bool)> {
    let mut out = Vec::new();
    let mut at = start;
    for &(s, e) in &shared[shared.partition_point(|&(_, e)| e <= start)..] {
        if s >= end {
            break;
        }
        if at < s {
            out.push((at, s, false));
        }
        let to = e.min(end);
        out.push((at.max(s), to, true));
        at = to;
    }
    if at < end {
        out.push((at, end, false));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dump::images::{PagemapEntry, VMA_ANON_PRIVATE, VMA_AREA_GUARD, VMA_AREA_REGULAR};

    const P: u64 = 4096;

    fn anon(start: u64, end: u64) -> Vma {
        Vma {
            start,
            end,
            shmid: 0,
            flags: (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32,
            status: VMA_AREA_REGULAR | VMA_ANON_PRIVATE,
            madv: 0,
        }
    }

    fn pm(runs: &[(u64, u64)]) -> Pagemap {
        Pagemap {
            pages_id: 1,
            entries: runs
                .iter()
                .map(|&(vaddr, n)| PagemapEntry {
                    vaddr,
                    nr_pages: n,
                    flags: PE_PRESENT,
                })
                .collect(),
        }
    }

    #[test]
    fn ranges_merge_intersect_and_split() {
        assert_eq!(
            merged(vec![(5, 9), (1, 3), (3, 4), (8, 12), (20, 20)]),
            vec![(1, 4), (5, 12)]
        );
        assert_eq!(
            intersect(&vec![(0, 10), (20, 30)], &vec![(5, 25), (28, 40)]),
            vec![(5, 10), (20, 25), (28, 30)]
        );
        assert_eq!(
            split(0, 100, &[(10, 20), (30, 40), (90, 200)]),
            vec![
                (0, 10, false),
                (10, 20, true),
                (20, 30, false),
                (30, 40, true),
                (40, 90, false),
                (90, 100, true)
            ]
        );
        assert_eq!(split(50, 60, &[(10, 20)]), vec![(50, 60, false)]);
        assert_eq!(split(50, 60, &[(0, 100)]), vec![(50, 60, true)]);
    }

    /// A parent with two children and a grandchild, as after forks: what each shares is where its
    /// mapping pairs with its parent's and both have pages.
    #[test]
    fn shared_pages_follow_criu_pairing_rules() {
        let heap = anon(0x10000, 0x20000);
        let guard = Vma {
            status: VMA_AREA_GUARD,
            ..anon(0x10000, 0x11000)
        };
        let parent_mm = Mm {
            exe_file_id: 1,
            vmas: vec![heap, anon(0x30000, 0x40000), anon(0x50000, 0x60000), guard],
        };
        // Child 2: the heap (pages from 0x12000 on), the second mapping grown (other bounds), a file
        // mapping in place of the third.
        let child_mm = Mm {
            exe_file_id: 1,
            vmas: vec![
                heap,
                anon(0x30000, 0x48000),
                other_file_at(0x50000, 0x60000),
            ],
        };
        let parent_pm = pm(&[(0x10000, 16), (0x30000, 16), (0x50000, 16)]);
        // Past the heap's end too (0x12000..0x26000), and in the two mappings that do not pair.
        let child_pm = pm(&[(0x12000, 20), (0x30000, 16), (0x50000, 16)]);
        let grandchild_pm = pm(&[(0x10000, 2)]); // where its parent has no page

        let other_exe = Mm {
            exe_file_id: 2,
            vmas: vec![heap],
        };
        let procs = [
            Proc {
                pid: 1,
                ppid: None,
                mm: &parent_mm,
                pagemap: &parent_pm,
            },
            Proc {
                pid: 2,
                ppid: Some(1),
                mm: &child_mm,
                pagemap: &child_pm,
            },
            Proc {
                pid: 3,
                ppid: Some(2),
                mm: &child_mm,
                pagemap: &grandchild_pm,
            },
            Proc {
                pid: 4,
                ppid: Some(1),
                mm: &other_exe,
                pagemap: &parent_pm,
            },
            Proc {
                pid: 5,
                ppid: Some(99), // a parent CRIU does not restore memory for
                mm: &parent_mm,
                pagemap: &parent_pm,
            },
        ];
        let got = shared(&procs, P);
        assert_eq!(got[&1], vec![(0x12000, 0x20000)], "the heap's common pages");
        assert_eq!(
            got[&2],
            vec![(0x12000, 0x20000)],
            "with its parent; nothing with its child, which has no page in common"
        );
        assert!(!got.contains_key(&3));
        assert!(!got.contains_key(&4), "another executable");
        assert!(!got.contains_key(&5));

        fn other_file_at(start: u64, end: u64) -> Vma {
            Vma {
                flags: libc::MAP_PRIVATE as u32,
                status: VMA_AREA_REGULAR | crate::dump::images::VMA_FILE_PRIVATE,
                shmid: 9,
                ..anon(start, end)
            }
        }
    }

    #[test]
    fn criu_pairs_only_mappings_of_the_same_kind() {
        let a = anon(0x1000, 0x5000);
        assert!(can_share(&a, &a));
        let mut huge = a;
        huge.flags |= libc::MAP_HUGETLB as u32;
        assert!(!can_share(&a, &huge) && !can_share(&huge, &huge));
        let mut down = a;
        down.flags |= libc::MAP_GROWSDOWN as u32;
        assert!(!can_share(&a, &down) && can_share(&down, &down));
        let mut shared_anon = a;
        shared_anon.status = VMA_AREA_REGULAR;
        assert!(!can_share(&a, &shared_anon), "not private");
        assert!(!can_share(&a, &anon(0x1000, 0x6000)), "other bounds");
        let file = |shmid| Vma {
            shmid,
            flags: libc::MAP_PRIVATE as u32,
            status: VMA_AREA_REGULAR | crate::dump::images::VMA_FILE_PRIVATE,
            ..a
        };
        assert!(can_share(&file(3), &file(3)) && !can_share(&file(3), &file(4)));
    }
}
