//! `churn`: `--mib N` (default 256) of pseudo-random memory whose mappings change all the time, for the
//! restore that lets a process run before all of its memory is in: every round it forks a child that
//! checks two blocks and exits, drops 64 KiB with `MADV_DONTNEED` (they must read as zeros, then are
//! written again), unmaps 64 KiB and maps fresh memory there, moves a MiB away with `mremap` and back,
//! and makes 64 KiB read-only for a moment (a mapping split without any event), checking the bytes after
//! each step; every 256 rounds it checks all of its memory.
//! Record: `pid rounds full bad` (and `why` at the first bad one).

use gpu_checkpoint_testdata::XorShift64;

use super::{pid, put, state, Opts};

const PAGE: usize = 4096;
const MIB: usize = 1 << 20;
const SLICE: usize = 64 << 10;

/// The bytes page `p` holds (or must hold again after being dropped and written).
fn fill_page(seed: u64, p: usize, out: &mut [u8]) {
    let mut rng = XorShift64::new(seed ^ (p as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    for w in out.chunks_exact_mut(8) {
        w.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
}

struct Mem {
    base: *mut u8,
    len: usize,
    seed: u64,
    /// A MiB of reserved address space `mremap` moves a block to and back from.
    spare: *mut u8,
}

impl Mem {
    fn bytes(&self, off: usize, len: usize) -> &[u8] {
        // SAFETY: `[off, off + len)` lies within the mapping, which is mapped whenever this is called.
        unsafe { std::slice::from_raw_parts(self.base.add(off), len) }
    }

    /// Writes the expected bytes into `[off, off + len)` (page-aligned).
    fn write(&self, off: usize, len: usize) {
        for p in (off / PAGE)..((off + len) / PAGE) {
            // SAFETY: the page lies within the mapping, mapped and writable here.
            let page = unsafe { std::slice::from_raw_parts_mut(self.base.add(p * PAGE), PAGE) };
            fill_page(self.seed, p, page);
        }
    }

    /// Whether `bytes` are what pages from `first_page` on must hold.
    fn check(&self, bytes: &[u8], first_page: usize) -> bool {
        let mut want = vec![0u8; PAGE];
        bytes.chunks(PAGE).enumerate().all(|(i, got)| {
            fill_page(self.seed, first_page + i, &mut want);
            got == want.as_slice()
        })
    }

    fn check_at(&self, off: usize, len: usize) -> bool {
        self.check(self.bytes(off, len), off / PAGE)
    }
}

fn os(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

/// One round on the blocks from `b` on; `Err` names what was wrong.
fn round(m: &Mem, b: usize) -> Result<(), String> {
    let blocks = m.len / MIB;
    let at = |k: usize| ((b + k) % blocks) * MIB;
    // Fresh mappings go into even blocks, `mremap` moves odd ones. While a restore still serves its
    // memory (`--resume early`) the restored range is registered with userfaultfd and a fresh mapping
    // is not, so the kernel keeps them apart as two mappings, and `mremap` of a range spanning both
    // fails (EFAULT) until the memory is in: a limit of restoring through userfaultfd (CRIU's lazy pages
    // share it), documented in docs/criu.md, not a lost byte.
    let even = |k: usize| ((b + k) % (blocks / 2)) * 2 * MIB;
    let odd = |k: usize| even(k) + MIB;
    if !m.check_at(at(0), MIB) {
        return Err(format!("block at {:#x}", at(0)));
    }
    // A child checks two blocks (its memory is the parent's at the fork) and says so by its exit status.
    // SAFETY: fork in a single-threaded process; the child only reads memory and exits.
    match unsafe { libc::fork() } {
        -1 => return Err(os("fork")),
        0 => {
            let good = m.check_at(at(1), MIB) && m.check_at(at(2), MIB);
            // SAFETY: leaving the child at once, without running the parent's exit handlers.
            unsafe { libc::_exit(if good { 0 } else { 1 }) }
        }
        child => {
            let mut status = 0;
            // SAFETY: waiting for our own child.
            unsafe { libc::waitpid(child, &mut status, 0) };
            if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
                return Err(format!("forked child saw wrong bytes (status {status:#x})"));
            }
        }
    }
    // Dropped memory reads as zeros, then is written again.
    let d = at(3) + SLICE;
    // SAFETY: a range within our mapping.
    if unsafe { libc::madvise(m.base.add(d).cast(), SLICE, libc::MADV_DONTNEED) } != 0 {
        return Err(os("madvise"));
    }
    if m.bytes(d, SLICE).iter().any(|&x| x != 0) {
        return Err("dropped memory does not read as zeros".into());
    }
    m.write(d, SLICE);
    // Unmapped memory, and fresh memory mapped in its place.
    let u = even(4) + 2 * SLICE;
    // SAFETY: a range within our mapping, mapped again at once.
    let p = unsafe {
        libc::munmap(m.base.add(u).cast(), SLICE);
        libc::mmap(
            m.base.add(u).cast(),
            SLICE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os("mmap"));
    }
    if m.bytes(u, SLICE).iter().any(|&x| x != 0) {
        return Err("fresh memory does not read as zeros".into());
    }
    m.write(u, SLICE);
    // A block moved away and back.
    let r = odd(5);
    // SAFETY: moving a MiB of our mapping onto the reserved spare MiB, then back into the hole it left.
    unsafe {
        let away = libc::mremap(
            m.base.add(r).cast(),
            MIB,
            MIB,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            m.spare.cast::<libc::c_void>(),
        );
        if away == libc::MAP_FAILED {
            return Err(os("mremap away"));
        }
        if !m.check(std::slice::from_raw_parts(away.cast::<u8>(), MIB), r / PAGE) {
            return Err("moved block".into());
        }
        let back = libc::mremap(
            away,
            MIB,
            MIB,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            m.base.add(r).cast::<libc::c_void>(),
        );
        if back == libc::MAP_FAILED {
            return Err(os("mremap back"));
        }
        // The spare MiB is a hole now: reserve it again.
        libc::mmap(
            m.spare.cast(),
            MIB,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | libc::MAP_NORESERVE,
            -1,
            0,
        );
    }
    if !m.check_at(r, MIB) {
        return Err("block moved back".into());
    }
    // A mapping split for a moment, with no event for it.
    let s = at(6) + 3 * SLICE;
    // SAFETY: a range within our mapping, made writable again right after.
    unsafe { libc::mprotect(m.base.add(s).cast(), SLICE, libc::PROT_READ) };
    let good = m.check_at(at(6), MIB);
    // SAFETY: as above.
    unsafe {
        libc::mprotect(
            m.base.add(s).cast(),
            SLICE,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    };
    if !good {
        return Err("block split by mprotect".into());
    }
    Ok(())
}

pub(super) fn churn(opts: &Opts) -> Result<(), String> {
    let mib = (opts.num("mib", 256)? as usize).max(8);
    let s = state(opts, 1)?;
    put(&s, 0, &format!("pid={} phase=filling mib={mib}", pid()))?;
    let len = mib * MIB;
    // SAFETY: fresh private mappings of our own, never unmapped (the process runs until killed).
    let (base, spare) = unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        let spare = libc::mmap(
            std::ptr::null_mut(),
            MIB,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        (base, spare)
    };
    if base == libc::MAP_FAILED || spare == libc::MAP_FAILED {
        return Err(os("mmap"));
    }
    let m = Mem {
        base: base.cast(),
        len,
        seed: opts.num("seed", 0x51ed_27a4_3c1b_9e0f)? | 1,
        spare: spare.cast(),
    };
    m.write(0, len);
    let (mut rounds, mut full, mut bad) = (0u64, 0u64, 0u64);
    let mut why = String::new();
    loop {
        if let Err(e) = round(&m, rounds as usize) {
            bad += 1;
            if why.is_empty() {
                why = format!(" why={}", e.replace(' ', "_"));
            }
        }
        rounds += 1;
        if rounds.is_multiple_of(256) {
            if m.check_at(0, len) {
                full += 1;
            } else {
                bad += 1;
            }
        }
        put(
            &s,
            0,
            &format!("pid={} rounds={rounds} full={full} bad={bad}{why}", pid()),
        )?;
    }
}
