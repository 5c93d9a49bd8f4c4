//! Transparent huge pages: the kernel's mode, which mappings may be in huge pages, and collapsing a
//! restored process's memory back into them.
//!
//! Why it matters here: the CUDA driver stages device memory in the process's anonymous memory, and its
//! copy speed depends on the page size (on an H200, `docs/hardware.md`: with `always` the driver's
//! checkpoint of 8 GiB took 4.8-5.2 s against 6.6 s with `madvise`, its restore 2.2-2.7 s against 2.4 s).
//! Memory copied into a process through userfaultfd comes back in 4 KiB pages whatever it was in before
//! (`UFFDIO_COPY` has no huge-page form for anonymous memory), so the restore collapses the 2 MiB ranges
//! that a huge page can hold once they are in (`MADV_COLLAPSE`, through `process_madvise`, Linux 6.1+).

use std::io;
use std::path::Path;

use crate::dump::images::Vma;

/// `MADV_COLLAPSE` (linux/mman.h; not in every libc yet).
const MADV_COLLAPSE: i32 = 25;

const SYSFS: &str = "/sys/kernel/mm/transparent_hugepage";

/// `/sys/kernel/mm/transparent_hugepage/enabled`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Every anonymous mapping that does not refuse them (`MADV_NOHUGEPAGE`).
    Always,
    /// Only mappings that ask for them (`MADV_HUGEPAGE`).
    Madvise,
    Never,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Always => "always",
            Mode::Madvise => "madvise",
            Mode::Never => "never",
        }
    }
}

/// `GPU_CHECKPOINT_HUGE_PAGES=leave` leaves restored memory in 4 KiB pages (khugepaged collapses it at its
/// own pace): the collapse copies every window once more, under the process's mmap lock.
pub const HUGE_PAGES_ENV: &str = "GPU_CHECKPOINT_HUGE_PAGES";

/// The mode a restore collapses windows under: the kernel's, or `Never` where the kernel has none or the
/// user said `leave` ([`HUGE_PAGES_ENV`]).
pub fn collapse_mode() -> Mode {
    if std::env::var(HUGE_PAGES_ENV).is_ok_and(|v| v.trim() == "leave") {
        return Mode::Never;
    }
    mode().unwrap_or(Mode::Never)
}

/// The selected word of a sysfs choice line (`always [madvise] never`).
fn selected(line: &str) -> Option<&str> {
    let at = line.find('[')? + 1;
    let end = line[at..].find(']')?;
    Some(&line[at..at + end])
}

/// The kernel's mode, `None` where it has no transparent huge pages.
pub fn mode() -> Option<Mode> {
    mode_in(Path::new(SYSFS))
}

fn mode_in(dir: &Path) -> Option<Mode> {
    let line = std::fs::read_to_string(dir.join("enabled")).ok()?;
    match selected(&line)? {
        "always" => Some(Mode::Always),
        "madvise" => Some(Mode::Madvise),
        "never" => Some(Mode::Never),
        _ => None,
    }
}

/// The kernel's defrag setting (what a fault does when no huge page is free), as its word.
pub fn defrag() -> Option<String> {
    let line = std::fs::read_to_string(Path::new(SYSFS).join("defrag")).ok()?;
    selected(&line).map(str::to_string)
}

/// The size of a huge page (`hpage_pmd_size`; 2 MiB on x86-64).
pub fn huge_page_size() -> u64 {
    std::fs::read_to_string(Path::new(SYSFS).join("hpage_pmd_size"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(2 << 20)
}

/// Whether the kernel would back mapping `vma` with huge pages under `mode`: private anonymous memory
/// that asked for them, or (`always`) that did not refuse them.
pub fn eligible(mode: Mode, vma: &Vma) -> bool {
    let anon_private = vma.flags & (libc::MAP_ANONYMOUS | libc::MAP_PRIVATE) as u32
        == (libc::MAP_ANONYMOUS | libc::MAP_PRIVATE) as u32;
    let asked = vma.madv & (1 << libc::MADV_HUGEPAGE) != 0;
    let refused = vma.madv & (1 << libc::MADV_NOHUGEPAGE) != 0;
    anon_private
        && !refused
        && match mode {
            Mode::Always => true,
            Mode::Madvise => asked,
            Mode::Never => false,
        }
}

/// The huge-page-aligned windows (`[start, end)`, `huge` bytes each) that lie wholly within `ranges`
/// (sorted, disjoint; adjacent ones count as one).
pub fn windows(ranges: &[(u64, u64)], huge: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < ranges.len() {
        let (start, mut end) = ranges[i];
        while i + 1 < ranges.len() && ranges[i + 1].0 == end {
            i += 1;
            end = ranges[i].1;
        }
        let mut w = start.next_multiple_of(huge);
        while w + huge <= end {
            out.push((w, w + huge));
            w += huge;
        }
        i += 1;
    }
    out
}

/// Asks the kernel to collapse `windows` of process `pid` into huge pages (`process_madvise` with
/// `MADV_COLLAPSE`). Returns the bytes it took; an error where the kernel cannot do it at all.
pub fn collapse(pid: i32, windows: &[(u64, u64)]) -> io::Result<u64> {
    use std::os::fd::AsRawFd;
    let pidfd = crate::proc::pidfd_open(pid)?;
    let mut done = 0u64;
    // The kernel takes at most UIO_MAXIOV (1024) ranges per call.
    for part in windows.chunks(1024) {
        let iov: Vec<libc::iovec> = part
            .iter()
            .map(|&(s, e)| libc::iovec {
                iov_base: s as *mut libc::c_void,
                iov_len: (e - s) as usize,
            })
            .collect();
        // SAFETY: process_madvise reads `iov.len()` iovecs describing the other process's memory; it
        // never touches ours through them.
        let n = unsafe {
            libc::syscall(
                libc::SYS_process_madvise,
                pidfd.as_raw_fd(),
                iov.as_ptr(),
                iov.len(),
                MADV_COLLAPSE,
                0u32,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            // Some range could not be collapsed (no huge page free, a page shared or swapped): the
            // others may still have been.
            if done > 0 || e.raw_os_error() == Some(libc::EAGAIN) {
                continue;
            }
            return Err(e);
        }
        done += n as u64;
    }
    Ok(done)
}

/// What copying into fresh anonymous memory costs here, in 4 KiB pages and in huge pages: the driver's
/// staging copy is such a copy. `bytes` copied each way (best of three); GB/s each way, `None` for huge
/// pages where the kernel gave none (mode `never`, or none free).
pub fn copy_speed(bytes: usize) -> (f64, Option<f64>) {
    let src = vec![0x5au8; bytes];
    let huge = huge_page_size() as usize;
    let once = |advice: i32| -> Option<f64> {
        use nix::sys::mman::{mmap_anonymous, MapFlags, ProtFlags};
        let len = bytes + huge;
        // SAFETY: a fresh mapping of our own, unmapped below.
        let map = unsafe {
            mmap_anonymous(
                None,
                std::num::NonZeroUsize::new(len)?,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .ok()?
        .as_ptr();
        let start = (map as usize).next_multiple_of(huge);
        // SAFETY: advice on, then a copy into, `bytes` of the mapping just made (`start` lies within its
        // first huge page); unmapped right after.
        let (secs, got_huge) = unsafe {
            libc::madvise(start as *mut libc::c_void, bytes, advice);
            let t = std::time::Instant::now();
            std::ptr::copy_nonoverlapping(src.as_ptr(), start as *mut u8, bytes);
            let secs = t.elapsed().as_secs_f64();
            // The kernel's count of this process's huge pages says whether it gave any.
            let got = advice != libc::MADV_HUGEPAGE || anon_huge_bytes("self") > 0;
            libc::munmap(map, len);
            (secs, got)
        };
        got_huge.then(|| bytes as f64 / secs / 1e9)
    };
    let best = |advice| (0..3).filter_map(|_| once(advice)).reduce(f64::max);
    let small = best(libc::MADV_NOHUGEPAGE).unwrap_or(0.0);
    let huge = match mode() {
        Some(Mode::Never) | None => None,
        _ => best(libc::MADV_HUGEPAGE),
    };
    (small, huge)
}

/// `AnonHugePages` of process `pid` (a PID, or `self`), in bytes.
pub fn anon_huge_bytes(pid: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("AnonHugePages:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib << 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mode_is_the_bracketed_word() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("enabled"), "always [madvise] never\n").unwrap();
        assert_eq!(mode_in(d.path()), Some(Mode::Madvise));
        std::fs::write(d.path().join("enabled"), "[always] madvise never\n").unwrap();
        assert_eq!(mode_in(d.path()), Some(Mode::Always));
        assert_eq!(mode_in(&d.path().join("none")), None);
    }

    #[test]
    fn eligible_mappings_and_whole_windows() {
        let anon = Vma {
            start: 0,
            end: 8 << 20,
            shmid: 0,
            flags: (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u32,
            status: 0,
            madv: 0,
        };
        let asked = Vma {
            madv: 1 << libc::MADV_HUGEPAGE,
            ..anon
        };
        let refused = Vma {
            madv: 1 << libc::MADV_NOHUGEPAGE,
            ..anon
        };
        let file = Vma {
            flags: libc::MAP_PRIVATE as u32,
            ..asked
        };
        assert!(eligible(Mode::Always, &anon) && !eligible(Mode::Madvise, &anon));
        assert!(eligible(Mode::Madvise, &asked) && !eligible(Mode::Never, &asked));
        assert!(!eligible(Mode::Always, &refused) && !eligible(Mode::Always, &file));
        const M: u64 = 1 << 20;
        // 1 MiB..7 MiB holds the windows at 2 and 4 MiB; two adjacent runs make one range.
        assert_eq!(
            windows(&[(M, 3 * M), (3 * M, 7 * M), (9 * M, 11 * M)], 2 * M),
            vec![(2 * M, 4 * M), (4 * M, 6 * M)]
        );
    }
}
