//! Whether CRIU's premapping of private memory would be refused here, which decides between the fast
//! restores and the staged one.
//!
//! Why: whenever CRIU cannot read a process's pages in place (`--stream`: a pipe cannot seek; `--lazy-pages`,
//! which the default userfaultfd restore uses), it *premaps* every private mapping before the restorer
//! moves it into place (`premap_priv_vmas` in criu/mem.c, `pr->pieok` false), and maps each one writable
//! (`vma->e->prot | PROT_WRITE`), whatever it was. A private mapping made writable is charged against the
//! kernel's commit limit. A reservation made `PROT_NONE` (MariaDB 11's InnoDB reserves 8 TiB of address
//! space for `innodb_buffer_pool_size_max`; CUDA, JVMs and Go reserve large ranges too) was never charged,
//! and with `vm.overcommit_memory=0` the kernel refuses any single charge larger than RAM + swap: CRIU fails
//! with `Unable to map ANON_VMA: Cannot allocate memory`. A staged restore reads the images in place
//! (`pr->pieok` true) and maps such a reservation as it was, as plain `criu restore` does; so the restore
//! chooses it when the premapping would not fit.

use std::fmt::Write as _;

use super::ids::store_file;
use crate::dump::images::Vma;
use crate::flows::ImageTransfer;
use crate::fmt::human_bytes;
use crate::store::{CheckpointInfo, Store};

/// How this restore moves the images: the flow's way, unless that needs CRIU to premap the processes'
/// private memory (the userfaultfd and streamed restores) and the kernel would refuse it here
/// ([`refusal`]): then staged, with the reason.
pub(super) fn transfer_for(
    chosen: ImageTransfer,
    store: &Store,
    info: &CheckpointInfo,
    pids: &[i32],
) -> crate::Result<(ImageTransfer, Option<String>)> {
    let Some(overcommit) = Overcommit::here() else {
        return Ok((chosen, None));
    };
    if chosen == ImageTransfer::Staged || overcommit.mode == 1 {
        return Ok((chosen, None));
    }
    let mut processes = Vec::with_capacity(pids.len());
    for pid in pids {
        let name = format!("mm-{pid}.img");
        let mut image = Vec::new();
        if store_file(store, info, &name, &mut image)? {
            match crate::dump::images::parse_mm_protections(&image) {
                Ok(vmas) => processes.push((*pid, vmas)),
                // Only a hint is lost: the restore goes the way asked, and CRIU reads the image itself.
                Err(reason) => {
                    tracing::debug!("{name}: {reason}: not checking CRIU's premap");
                    return Ok((chosen, None));
                }
            }
        }
    }
    Ok(match refusal(&processes, overcommit) {
        Some(why) => (
            ImageTransfer::Staged,
            Some(format!(
                "the {} restore has CRIU map every private mapping writable first, and {why}; a staged \
                 restore maps them in place, as plain criu restore does",
                if chosen == ImageTransfer::Stream {
                    "streamed"
                } else {
                    "default"
                }
            )),
        ),
        None => (chosen, None),
    })
}

/// CRIU's `VMA_EXT_PLUGIN`: a device mapping a plugin restores, never premapped.
const VMA_EXT_PLUGIN: u32 = 1 << 27;

/// The kernel's overcommit policy and the figures it checks a charge against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Overcommit {
    /// `vm.overcommit_memory`: 0 heuristic, 1 always, 2 strict.
    pub mode: u8,
    /// `MemTotal` + `SwapTotal`, in bytes (mode 0 refuses one charge above it).
    pub ram_and_swap: u64,
    /// `CommitLimit` - `Committed_AS`, in bytes (mode 2 refuses charges beyond it).
    pub commit_left: u64,
}

impl Overcommit {
    /// This machine's, from `/proc/sys/vm/overcommit_memory` and `/proc/meminfo`; `None` when the kernel
    /// does not say.
    pub fn here() -> Option<Overcommit> {
        let mode = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").ok()?;
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        Overcommit::parse(mode.trim(), &meminfo)
    }

    fn parse(mode: &str, meminfo: &str) -> Option<Overcommit> {
        let kib = |key: &str| {
            meminfo.lines().find_map(|l| {
                let v = l.strip_prefix(key)?.strip_prefix(':')?.trim();
                v.strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .map(|k| k << 10)
            })
        };
        Some(Overcommit {
            mode: mode.parse().ok()?,
            ram_and_swap: kib("MemTotal")? + kib("SwapTotal").unwrap_or(0),
            commit_left: kib("CommitLimit")?.saturating_sub(kib("Committed_AS")?),
        })
    }
}

/// What CRIU's premap charges for one mapping that the process itself was never charged for: a private
/// mapping without `PROT_WRITE` and without `MAP_NORESERVE` (which mode 0 does not charge), not a huge-page
/// or plugin mapping (never premapped).
fn new_charge(vma: &Vma, prot: u32) -> Option<u64> {
    let uncharged = vma.is_private()
        && !vma.is_guard()
        && prot & libc::PROT_WRITE as u32 == 0
        && vma.flags & (libc::MAP_NORESERVE | libc::MAP_HUGETLB) as u32 == 0
        && vma.status & VMA_EXT_PLUGIN == 0;
    uncharged.then(|| vma.end - vma.start)
}

/// Why the kernel would refuse CRIU's premap of `processes` (`(pid, mappings with their protection)`),
/// or `None` when it would not.
pub(super) fn refusal(processes: &[(i32, Vec<(Vma, u32)>)], oc: Overcommit) -> Option<String> {
    let charges = processes.iter().flat_map(|(pid, vmas)| {
        vmas.iter()
            .filter_map(move |(v, prot)| new_charge(v, *prot).map(|size| (*pid, v, size)))
    });
    let mut why = String::new();
    match oc.mode {
        0 => {
            let (pid, v, size) = charges.max_by_key(|(_, _, size)| *size)?;
            if size <= oc.ram_and_swap {
                return None;
            }
            let _ = write!(
                why,
                "process {pid} reserves {} at {:#x}-{:#x} without write access, more than this node's \
                 memory and swap ({}), which vm.overcommit_memory=0 refuses to map writable",
                human_bytes(size),
                v.start,
                v.end,
                human_bytes(oc.ram_and_swap)
            );
        }
        2 => {
            let total: u64 = charges.map(|(_, _, size)| size).sum();
            if total <= oc.commit_left {
                return None;
            }
            let _ = write!(
                why,
                "the tree's mappings without write access take {} to map writable, more than the {} \
                 vm.overcommit_memory=2 leaves under CommitLimit",
                human_bytes(total),
                human_bytes(oc.commit_left)
            );
        }
        _ => return None,
    }
    Some(why)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dump::images::{VMA_ANON_PRIVATE, VMA_AREA_REGULAR};

    fn anon(start: u64, end: u64, flags: i32) -> Vma {
        Vma {
            start,
            end,
            shmid: 0,
            flags: (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags) as u32,
            status: VMA_AREA_REGULAR | VMA_ANON_PRIVATE,
            madv: 0,
        }
    }

    const GIB: u64 = 1 << 30;
    const MEMINFO: &str = "MemTotal:       24576000 kB\nSwapTotal:      0 kB\n\
                           CommitLimit:    12288000 kB\nCommitted_AS:    2048000 kB\n";

    #[test]
    fn a_reservation_larger_than_memory_and_swap_is_refused_in_heuristic_mode() {
        let oc = Overcommit::parse("0", MEMINFO).unwrap();
        assert_eq!(oc.ram_and_swap, 24576000 << 10);
        assert_eq!(oc.commit_left, (12288000 - 2048000) << 10);
        // MariaDB 11's 8 TiB PROT_NONE reservation.
        let base = 0x7f00_0000_0000;
        let tree = vec![(7, vec![(anon(base, base + (8 << 40), 0), 0)])];
        let why = refusal(&tree, oc).unwrap();
        assert!(
            why.contains("process 7 reserves 8.0 TiB") && why.contains("overcommit_memory=0"),
            "{why}"
        );
        // The same with MAP_NORESERVE, or writable (charged when it was made), or small: fits.
        for (vma, prot) in [
            (anon(base, base + (8 << 40), libc::MAP_NORESERVE), 0),
            (anon(base, base + GIB, 0), 0),
            (
                anon(base, base + 20 * GIB, 0),
                libc::PROT_READ | libc::PROT_WRITE,
            ),
        ] {
            assert_eq!(refusal(&[(7, vec![(vma, prot as u32)])], oc), None);
        }
        // overcommit_memory=1 never refuses.
        let always = Overcommit { mode: 1, ..oc };
        assert_eq!(refusal(&tree, always), None);
    }

    #[test]
    fn strict_mode_sums_the_charges_against_the_commit_limit() {
        let oc = Overcommit::parse("2", MEMINFO).unwrap();
        let base = 0x7f00_0000_0000;
        let half = |n: u64| (anon(base + n * 6 * GIB, base + (n * 6 + 5) * GIB, 0), 0);
        // 5 GiB fits in the ~9.8 GiB left; two processes of 5 GiB each do not.
        assert_eq!(refusal(&[(1, vec![half(0)])], oc), None);
        let why = refusal(&[(1, vec![half(0)]), (2, vec![half(1)])], oc).unwrap();
        assert!(
            why.contains("10.0 GiB") && why.contains("CommitLimit"),
            "{why}"
        );
    }
}
