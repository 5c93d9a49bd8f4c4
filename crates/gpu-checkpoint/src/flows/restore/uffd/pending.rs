//! The lazy memory of one restored address space that is not in it yet, and where each piece of it lies
//! in the page image: what the fill still has to copy, kept right while the process runs.
//!
//! A process that runs before all of its memory is in may change its mappings meanwhile, and CRIU's
//! userfaultfds report each change before it takes effect: `mremap` moves pending pieces to other
//! addresses, `munmap` and `MADV_DONTNEED` drop them (the memory is gone, or reads as zeros from then on:
//! copying the checkpoint's bytes there would be wrong), and a fork gives the child a copy of what is
//! pending in the parent (the pages already in were copied by the fork itself). Pieces are keyed by their
//! offset in the page image, which never changes: the fill asks by chunk, a fault by address.
//!
//! Pure bookkeeping: no system call here.

use std::collections::BTreeMap;

/// A pending piece: `len` bytes of the page image that belong at `vaddr` now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Piece {
    pub(super) vaddr: u64,
    pub(super) img_off: u64,
    pub(super) len: u64,
}

/// Pending pieces of one address space, disjoint in the image and in memory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Pending {
    /// Image offset -> (address, length).
    pieces: BTreeMap<u64, (u64, u64)>,
}

impl Pending {
    /// Pending memory made of `pieces` (disjoint).
    pub(super) fn new(pieces: impl IntoIterator<Item = Piece>) -> Pending {
        Pending {
            pieces: pieces
                .into_iter()
                .filter(|p| p.len > 0)
                .map(|p| (p.img_off, (p.vaddr, p.len)))
                .collect(),
        }
    }

    #[cfg(test)]
    pub(super) fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// Bytes pending.
    pub(super) fn bytes(&self) -> u64 {
        self.pieces.values().map(|&(_, len)| len).sum()
    }

    fn all(&self) -> impl Iterator<Item = Piece> + '_ {
        self.pieces.iter().map(|(&img_off, &(vaddr, len))| Piece {
            vaddr,
            img_off,
            len,
        })
    }

    /// The pending parts of image bytes `[off, off + len)`, with their addresses now.
    pub(super) fn within(&self, off: u64, len: u64) -> Vec<Piece> {
        let end = off + len;
        // The last piece starting at or before `off` may reach into the range.
        let first = self
            .pieces
            .range(..=off)
            .next_back()
            .map_or(off, |(&k, _)| k);
        self.pieces
            .range(first..end)
            .filter_map(|(&img_off, &(vaddr, plen))| {
                let (a, b) = (img_off.max(off), (img_off + plen).min(end));
                (a < b).then(|| Piece {
                    vaddr: vaddr + (a - img_off),
                    img_off: a,
                    len: b - a,
                })
            })
            .collect()
    }

    /// The image offset of the pending byte at address `addr`, if it is pending.
    pub(super) fn find(&self, addr: u64) -> Option<u64> {
        self.all()
            .find(|p| p.vaddr <= addr && addr < p.vaddr + p.len)
            .map(|p| p.img_off + (addr - p.vaddr))
    }

    /// Image bytes `[off, off + len)` are in now (or need not be): no longer pending.
    pub(super) fn done(&mut self, off: u64, len: u64) {
        for p in self.within(off, len) {
            self.cut(p);
        }
    }

    /// Removes piece `p` (a part of one stored piece) from it, keeping what lies on either side.
    fn cut(&mut self, p: Piece) {
        let (&start, &(vaddr, len)) = self
            .pieces
            .range(..=p.img_off)
            .next_back()
            .expect("a part of a stored piece");
        self.pieces.remove(&start);
        if start < p.img_off {
            self.pieces.insert(start, (vaddr, p.img_off - start));
        }
        let (end, p_end) = (start + len, p.img_off + p.len);
        if p_end < end {
            self.pieces
                .insert(p_end, (vaddr + (p_end - start), end - p_end));
        }
    }

    /// The parts of pending pieces whose addresses fall in `[start, end)`.
    fn at(&self, start: u64, end: u64) -> Vec<Piece> {
        self.all()
            .filter_map(|p| {
                let (a, b) = (p.vaddr.max(start), (p.vaddr + p.len).min(end));
                (a < b).then(|| Piece {
                    vaddr: a,
                    img_off: p.img_off + (a - p.vaddr),
                    len: b - a,
                })
            })
            .collect()
    }

    /// `[start, end)` was unmapped, or dropped (`MADV_DONTNEED`: it reads as zeros now): nothing pending
    /// there is to be copied any more. Returns the bytes dropped.
    pub(super) fn drop_range(&mut self, start: u64, end: u64) -> u64 {
        let gone = self.at(start, end);
        for p in &gone {
            self.cut(*p);
        }
        gone.iter().map(|p| p.len).sum()
    }

    /// `mremap` moved `[from, from + len)` to `to`: what was pending there is pending at the new address.
    pub(super) fn remap(&mut self, from: u64, to: u64, len: u64) {
        let moved = self.at(from, from + len);
        for p in &moved {
            self.cut(*p);
        }
        for p in moved {
            self.pieces.insert(p.img_off, (p.vaddr - from + to, p.len));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = 4096;

    fn piece(vaddr: u64, img_off: u64, len: u64) -> Piece {
        Piece {
            vaddr,
            img_off,
            len,
        }
    }

    fn two_runs() -> Pending {
        // Two mappings' runs: 8 pages at 0x100000 (image 0..8), 4 pages at 0x200000 (image 8..12).
        Pending::new([piece(0x100000, 0, 8 * P), piece(0x200000, 8 * P, 4 * P)])
    }

    #[test]
    fn chunks_take_their_part_and_leave_the_rest_pending() {
        let mut p = two_runs();
        assert_eq!(p.bytes(), 12 * P);
        // A chunk across the two runs.
        assert_eq!(
            p.within(6 * P, 4 * P),
            vec![piece(0x106000, 6 * P, 2 * P), piece(0x200000, 8 * P, 2 * P)]
        );
        p.done(6 * P, 4 * P);
        assert_eq!(p.bytes(), 8 * P);
        assert_eq!(p.within(0, 12 * P).len(), 2);
        assert_eq!(p.find(0x106000), None, "copied");
        assert_eq!(p.find(0x105fff), Some(6 * P - 1));
        assert_eq!(p.find(0x202000), Some(10 * P));
        p.done(0, 12 * P);
        assert!(p.is_empty());
    }

    #[test]
    fn dropped_memory_is_not_copied_and_moved_memory_is_found_at_its_new_address() {
        let mut p = two_runs();
        // MADV_DONTNEED of two pages in the middle of the first run.
        assert_eq!(p.drop_range(0x102000, 0x104000), 2 * P);
        assert_eq!(p.within(2 * P, 2 * P), vec![]);
        assert_eq!(p.find(0x104000), Some(4 * P));
        // mremap of the second run, and of the first run's tail, elsewhere.
        p.remap(0x200000, 0x900000, 4 * P);
        p.remap(0x106000, 0x800000, 0x10000);
        assert_eq!(p.find(0x200000), None);
        assert_eq!(p.find(0x901000), Some(9 * P));
        assert_eq!(p.find(0x801000), Some(7 * P));
        assert_eq!(
            p.within(5 * P, 5 * P),
            vec![
                piece(0x105000, 5 * P, P),
                piece(0x800000, 6 * P, 2 * P),
                piece(0x900000, 8 * P, 2 * P)
            ]
        );
        // munmap of everything left at the new place of the second run.
        assert_eq!(p.drop_range(0x900000, 0x904000), 4 * P);
        assert_eq!(
            p.bytes(),
            6 * P,
            "pages 0, 1, 4, 5 where they were, 6, 7 moved"
        );
        assert_eq!(
            p.bytes(),
            p.within(0, 12 * P).iter().map(|x| x.len).sum::<u64>()
        );
        // A fork copies what is pending; the copies then go their own ways.
        let mut child = p.clone();
        child.done(0, P);
        assert_eq!(p.find(0x100000), Some(0));
        assert_eq!(child.find(0x100000), None);
    }
}
