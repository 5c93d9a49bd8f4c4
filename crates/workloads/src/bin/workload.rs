//! `workload KIND --state FILE [--detach] [options]`: processes for checkpoint tests and the demo.
//!
//! Kinds (each ticks forever, rewriting its records in the state file; see the crate docs):
//! - `sample`   the demo's program: a step counter and value chain plus a 16 MiB table it keeps changing
//! - `counter`  single-threaded value chain                                  record: seq value
//! - `threads`  `--threads N` threads, one chain each                        records: thread seq value
//! - `pipes`    `--children N` forked children answering over pipes         records: child pid rounds value errors
//! - `sockets`  a listening TCP socket on 127.0.0.1 (answers `seq value`), a listening UNIX socket at
//!   `--unix PATH` (same answer), and a UNIX socketpair ping-pong between two threads; with
//!   `--tcp-pair 1` also an established loopback TCP connection with the same ping-pong (checkpointing it
//!   needs `--tcp-established`)
//! - `files`    `--dir D`: a shared file mapping, a private read-only file mapping, and an append-only log
//!   written through one open descriptor
//! - `memory`   `--mib N` of pseudo-random memory, re-verified against its BLAKE3 checksum every
//!   `--verify-ms MS` (default 200; 0: never, the process then idles, as the benchmark wants);
//!   `--content mixed` fills it like a real heap instead: runs of zero, random, recurring and
//!   compressible pages; `--huge 1` asks for transparent huge pages for it (`MADV_HUGEPAGE`)
//! - `cow`      `--mib N` (default 128) of pseudo-random private memory filled by the parent, then
//!   `--children K` (default 4) forked children that read it, so parent and children share its pages
//!   (copy-on-write); each process also has a page and a MiB of its own in the same mapping, and
//!   re-verifies its view every `--verify-ms MS` (default 500)      records: proc pid checksum verified bad
//! - `generations` `--mib N` (default 64) of memory, one thread, no pause: each generation checks that
//!   every page holds the previous generation's number, then writes its own into every page; a page
//!   of another generation (a restored snapshot of two moments: torn) ends it with exit 3
//!   records: pid gen torn (and page found, when torn)
//! - `churn`    `--mib N` (default 256) of memory whose mappings keep changing (fork, `MADV_DONTNEED`,
//!   `munmap`, `mremap`, `mprotect`), checked at each step (`workload/churn.rs`)
//!   record: pid rounds full bad
//!
//! `--detach` daemonizes first (see [`gpu_checkpoint_workloads::detach`]) and prints the PID.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gpu_checkpoint_testdata::XorShift64;
use gpu_checkpoint_workloads::{detach, sleep_ms, step, Opts, StateFile};

#[path = "workload/churn.rs"]
mod churn;

/// Tick of the workloads: fast enough that a test sees progress within a fraction of a second.
const TICK_MS: u64 = 20;

fn main() {
    let mut args = std::env::args().skip(1);
    let kind = args.next().unwrap_or_default();
    let opts = match Opts::parse(args) {
        Ok(o) => o,
        Err(e) => fail(&e),
    };
    if opts.detach {
        if let Err(e) = detach() {
            fail(&format!("detach: {e}"));
        }
    }
    let result = match kind.as_str() {
        "sample" => sample(&opts),
        "counter" => counter(&opts),
        "threads" => threads(&opts),
        "pipes" => pipes(&opts),
        "sockets" => sockets(&opts),
        "files" => files(&opts),
        "memory" => memory(&opts),
        "cow" => cow(&opts),
        "generations" => generations(&opts),
        "churn" => churn::churn(&opts),
        _ => Err(format!(
            "unknown workload {kind:?} (sample, counter, threads, pipes, sockets, files, memory, cow, generations, churn)"
        )),
    };
    if let Err(e) = result {
        fail(&e);
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("workload: {msg}");
    std::process::exit(2)
}

fn state(opts: &Opts, slots: usize) -> Result<StateFile, String> {
    let p = opts.state_path()?;
    StateFile::create(p, slots).map_err(|e| format!("{}: {e}", p.display()))
}

fn put(s: &StateFile, slot: usize, text: &str) -> Result<(), String> {
    s.write(slot, text)
        .map_err(|e| format!("writing state: {e}"))
}

fn pid() -> u32 {
    std::process::id()
}

/// The demo's program: a value chain plus a table it keeps rewriting, both only in memory.
fn sample(opts: &Opts) -> Result<(), String> {
    let s = state(opts, 1)?;
    let seed = opts.num("seed", 1)?;
    // 16 MiB, every page written at start: a zeroed allocation would stay unbacked (never dumped) until
    // touched, and the demo is meant to carry real memory across the checkpoint.
    let mut table: Vec<u64> = (0..2u64 << 20).map(|i| step(seed ^ i)).collect();
    let (mut seq, mut v) = (0u64, seed);
    loop {
        seq += 1;
        v = step(v);
        let len = table.len();
        table[(v as usize) % len] ^= v;
        let digest = table.iter().fold(0u64, |a, x| a.rotate_left(5) ^ x);
        put(
            &s,
            0,
            &format!(
                "pid={} seq={seq} value={v:#x} table_digest={digest:#x}",
                pid()
            ),
        )?;
        sleep_ms(100);
    }
}

fn counter(opts: &Opts) -> Result<(), String> {
    let s = state(opts, 1)?;
    let seed = opts.num("seed", 1)?;
    let (mut seq, mut v) = (0u64, seed);
    loop {
        seq += 1;
        v = step(v);
        put(&s, 0, &format!("pid={} seq={seq} value={v:#x}", pid()))?;
        sleep_ms(TICK_MS);
    }
}

fn threads(opts: &Opts) -> Result<(), String> {
    let n = opts.num("threads", 4)? as usize;
    let s = Arc::new(state(opts, n)?);
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let s = Arc::clone(&s);
            std::thread::spawn(move || -> Result<(), String> {
                let (mut seq, mut v) = (0u64, i as u64 + 1);
                loop {
                    seq += 1;
                    v = step(v);
                    put(&s, i, &format!("thread={i} seq={seq} value={v:#x}"))?;
                    sleep_ms(TICK_MS);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| "a thread panicked".to_string())??;
    }
    Ok(())
}

/// Parent and `--children N` forked children; the parent sends each child its value, the child answers
/// `step(value)` on its own pipe, and the parent checks the answer.
fn pipes(opts: &Opts) -> Result<(), String> {
    let n = opts.num("children", 2)? as usize;
    let s = state(opts, n)?;
    let mut links = Vec::new();
    for _ in 0..n {
        let (to_child, from_parent) = pipe()?;
        let (to_parent, from_child) = pipe()?;
        // SAFETY: the process is single-threaded here (no thread was started), so fork is sound.
        match unsafe { libc::fork() } {
            -1 => return Err(format!("fork: {}", std::io::Error::last_os_error())),
            0 => {
                drop(to_child);
                drop(from_child);
                child_loop(from_parent, to_parent);
            }
            child => {
                drop(from_parent);
                drop(to_parent);
                links.push((child, to_child, from_child));
            }
        }
    }
    let mut values: Vec<u64> = (0..n as u64).map(|i| i + 100).collect();
    let mut rounds = vec![0u64; n];
    let mut errors = vec![0u64; n];
    loop {
        for (i, (child, to, from)) in links.iter_mut().enumerate() {
            to.write_all(&values[i].to_le_bytes())
                .map_err(|e| format!("pipe to child {i}: {e}"))?;
            let mut b = [0u8; 8];
            from.read_exact(&mut b)
                .map_err(|e| format!("pipe from child {i}: {e}"))?;
            let answer = u64::from_le_bytes(b);
            if answer != step(values[i]) {
                errors[i] += 1;
            }
            values[i] = answer;
            rounds[i] += 1;
            put(
                &s,
                i,
                &format!(
                    "child={i} pid={child} rounds={} value={:#x} errors={}",
                    rounds[i], values[i], errors[i]
                ),
            )?;
        }
        sleep_ms(TICK_MS);
    }
}

fn child_loop(mut from: std::fs::File, mut to: std::fs::File) -> ! {
    let mut b = [0u8; 8];
    // The parent's end closing (it was killed) ends the child.
    while from.read_exact(&mut b).is_ok() {
        if to
            .write_all(&step(u64::from_le_bytes(b)).to_le_bytes())
            .is_err()
        {
            break;
        }
    }
    std::process::exit(0)
}

fn pipe() -> Result<(std::fs::File, std::fs::File), String> {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`, which we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(format!("pipe: {}", std::io::Error::last_os_error()));
    }
    use std::os::fd::FromRawFd;
    // SAFETY: both descriptors are fresh and owned by nobody else.
    Ok(unsafe {
        (
            std::fs::File::from_raw_fd(fds[1]),
            std::fs::File::from_raw_fd(fds[0]),
        )
    })
}

/// A listening TCP socket and a listening UNIX socket that answer the current state, and a socketpair
/// ping-pong between two threads.
fn sockets(opts: &Opts) -> Result<(), String> {
    let s = Arc::new(state(opts, 1)?);
    let tcp = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("tcp bind: {e}"))?;
    let port = tcp.local_addr().map_err(|e| e.to_string())?.port();
    let unix_path = opts.path("unix")?;
    let _ = std::fs::remove_file(&unix_path);
    let unix = UnixListener::bind(&unix_path).map_err(|e| format!("unix bind: {e}"))?;
    let seq = Arc::new(AtomicU64::new(0));
    let value = Arc::new(AtomicU64::new(1));
    let answer = {
        let (seq, value) = (Arc::clone(&seq), Arc::clone(&value));
        move || {
            format!(
                "seq={} value={:#x}\n",
                seq.load(Ordering::SeqCst),
                value.load(Ordering::SeqCst)
            )
        }
    };
    {
        let answer = answer.clone();
        std::thread::spawn(move || {
            for mut c in tcp.incoming().flatten() {
                let _ = c.write_all(answer().as_bytes());
            }
        });
    }
    std::thread::spawn(move || {
        for mut c in unix.incoming().flatten() {
            let _ = c.write_all(answer().as_bytes());
        }
    });
    let (mut a, mut b) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
    std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        while b.read_exact(&mut buf).is_ok() {
            if b.write_all(&step(u64::from_le_bytes(buf)).to_le_bytes())
                .is_err()
            {
                break;
            }
        }
    });
    // An established TCP connection to ourselves, echoing like the socketpair.
    let mut tcp_pair = if opts.num("tcp-pair", 0)? == 1 {
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("tcp bind: {e}"))?;
        let client = std::net::TcpStream::connect(l.local_addr().map_err(|e| e.to_string())?)
            .map_err(|e| format!("tcp connect: {e}"))?;
        let (server, _) = l.accept().map_err(|e| format!("tcp accept: {e}"))?;
        echo_steps(server);
        Some((client, 0u64, 7u64))
    } else {
        None
    };
    let (mut rounds, mut pair_value, mut errors) = (0u64, 5u64, 0u64);
    loop {
        let got = ping(&mut a, pair_value).map_err(|e| format!("socketpair: {e}"))?;
        if got != step(pair_value) {
            errors += 1;
        }
        pair_value = got;
        rounds += 1;
        let mut tcp_fields = String::new();
        if let Some((c, tcp_rounds, tcp_value)) = tcp_pair.as_mut() {
            let got = ping(c, *tcp_value).map_err(|e| format!("tcp pair: {e}"))?;
            if got != step(*tcp_value) {
                errors += 1;
            }
            *tcp_value = got;
            *tcp_rounds += 1;
            tcp_fields = format!(" tcp_rounds={tcp_rounds} tcp_value={tcp_value:#x}");
        }
        let n = seq.fetch_add(1, Ordering::SeqCst) + 1;
        let v = step(value.load(Ordering::SeqCst));
        value.store(v, Ordering::SeqCst);
        put(
            &s,
            0,
            &format!(
                "pid={} seq={n} value={v:#x} port={port} pair_rounds={rounds} pair_value={pair_value:#x} errors={errors}{tcp_fields}",
                pid()
            ),
        )?;
        sleep_ms(TICK_MS);
    }
}

/// Answers every 8-byte value read from `s` with `step(value)`, on a thread of its own.
fn echo_steps<S: Read + Write + Send + 'static>(mut s: S) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 8];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&step(u64::from_le_bytes(buf)).to_le_bytes())
                .is_err()
            {
                break;
            }
        }
    });
}

/// Sends `v` and reads the answer.
fn ping<S: Read + Write>(s: &mut S, v: u64) -> std::io::Result<u64> {
    s.write_all(&v.to_le_bytes())?;
    let mut buf = [0u8; 8];
    s.read_exact(&mut buf)?;
    Ok(u64::from_le_bytes(buf))
}

/// File-backed mappings and open files, in `--dir D`:
/// - `shared.bin` (64 KiB) mapped MAP_SHARED: slot 0 holds the tick number, slot `seq % 8191 + 1` holds
///   `seq` (the file is the memory: readers outside see it change);
/// - `ro.bin` (64 KiB of a known pattern) mapped MAP_PRIVATE read-only, re-checked every tick;
/// - `log.txt`: one fixed-size line per tick appended through one descriptor (its offset must survive).
fn files(opts: &Opts) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let dir = opts.path("dir")?;
    let s = state(opts, 1)?;
    const LEN: usize = 64 << 10;
    let shared_f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join("shared.bin"))
        .map_err(|e| format!("shared.bin: {e}"))?;
    shared_f.set_len(LEN as u64).map_err(|e| e.to_string())?;
    let ro_pattern: Vec<u8> = (0..LEN).map(|i| (i * 31 % 251) as u8).collect();
    std::fs::write(dir.join("ro.bin"), &ro_pattern).map_err(|e| format!("ro.bin: {e}"))?;
    let ro_f = std::fs::File::open(dir.join("ro.bin")).map_err(|e| e.to_string())?;
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(dir.join("log.txt"))
        .map_err(|e| format!("log.txt: {e}"))?;
    // SAFETY: fresh mappings of files we just sized; we only touch them within LEN.
    let (shared, ro) = unsafe {
        let shared = libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            shared_f.as_raw_fd(),
            0,
        );
        let ro = libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            ro_f.as_raw_fd(),
            0,
        );
        if shared == libc::MAP_FAILED || ro == libc::MAP_FAILED {
            return Err(format!("mmap: {}", std::io::Error::last_os_error()));
        }
        (
            std::slice::from_raw_parts_mut(shared.cast::<u64>(), LEN / 8),
            std::slice::from_raw_parts(ro.cast::<u8>(), LEN),
        )
    };
    drop(shared_f);
    drop(ro_f);
    let (mut seq, mut v) = (0u64, 3u64);
    loop {
        seq += 1;
        v = step(v);
        shared[0] = seq;
        shared[(seq as usize) % (LEN / 8 - 1) + 1] = seq;
        let ro_ok = ro == ro_pattern.as_slice();
        log.write_all(format!("{seq:020}\n").as_bytes())
            .map_err(|e| format!("log.txt: {e}"))?;
        put(
            &s,
            0,
            &format!(
                "pid={} seq={seq} value={v:#x} ro_ok={} log_lines={seq}",
                pid(),
                u8::from(ro_ok)
            ),
        )?;
        sleep_ms(TICK_MS);
    }
}

/// xorshift64: fast enough to fill a GiB in about a second, incompressible for the store.
fn fill_random(buf: &mut [u64], seed: u64) {
    for (w, x) in buf.iter_mut().zip(XorShift64::new(seed)) {
        *w = x;
    }
}

/// Words per 4 KiB page.
const PAGE_WORDS: usize = 512;

/// Memory shaped like a real heap, as the store benchmark's images are: runs of 1-256 pages, about 30% zero
/// pages (present: each is written once, so CRIU dumps it), 30% random, 20% recurring (one of 64 pages,
/// as shared buffers or replicated tables are) and 20% compressible (small integers and pointers whose
/// high bytes are zero).
fn fill_mixed(buf: &mut [u64], seed: u64) {
    let mut rng = XorShift64::new(seed);
    let recurring: Vec<u64> = rng.by_ref().take(64 * PAGE_WORDS).collect();
    let pages = buf.len() / PAGE_WORDS;
    let mut p = 0;
    while p < pages {
        let r = rng.next_u64();
        let run = ((r >> 8) % 256 + 1) as usize;
        let end = (p + run).min(pages);
        for page in buf[p * PAGE_WORDS..end * PAGE_WORDS].chunks_exact_mut(PAGE_WORDS) {
            match r % 10 {
                0..=2 => {
                    // A volatile store: the compiler may drop plain stores of zero into zeroed memory,
                    // and the page would then never be touched and not be dumped at all.
                    // SAFETY: `page` is an exclusively borrowed, aligned slice of 512 words.
                    unsafe { std::ptr::write_volatile(page.as_mut_ptr(), 0) }
                }
                3..=5 => page.iter_mut().for_each(|w| *w = rng.next_u64()),
                6..=7 => {
                    let k = (rng.next_u64() % 64) as usize;
                    page.copy_from_slice(&recurring[k * PAGE_WORDS..(k + 1) * PAGE_WORDS]);
                }
                _ => page
                    .iter_mut()
                    .for_each(|w| *w = rng.next_u64() & 0x0000_7fff_0000_00ff),
            }
        }
        p = end;
    }
}

/// `--mib N` of pseudo-random (or `--content mixed`) memory, hashed once, then re-verified in a loop.
fn memory(opts: &Opts) -> Result<(), String> {
    let mib = opts.num("mib", 1024)? as usize;
    let s = state(opts, 1)?;
    put(&s, 0, &format!("pid={} phase=filling mib={mib}", pid()))?;
    let mut buf = vec![0u64; mib << 17];
    if opts.num("huge", 0)? == 1 {
        // Before the first touch: the kernel then backs it with huge pages where it can (THP `madvise`).
        let start = (buf.as_mut_ptr() as usize).next_multiple_of(4096);
        let end = (buf.as_mut_ptr() as usize + (mib << 20)) & !4095;
        // SAFETY: advice on whole pages of memory we own; the buffer stays valid.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    let seed = opts.num("seed", 0x9e37_79b9_7f4a_7c15)? | 1;
    match opts.rest.get("content").map(String::as_str) {
        None | Some("random") => fill_random(&mut buf, seed),
        Some("mixed") => fill_mixed(&mut buf, seed),
        Some(other) => return Err(format!("--content: random or mixed, not {other:?}")),
    }
    let bytes = |b: &[u64]| -> blake3::Hash {
        // SAFETY: viewing initialized u64s as bytes.
        let s = unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u8>(), b.len() * 8) };
        blake3::hash(s)
    };
    let sum = bytes(&buf);
    let (mut verified, mut bad) = (0u64, 0u64);
    let every = opts.num("verify-ms", 200)?;
    loop {
        put(
            &s,
            0,
            &format!(
                "pid={} phase=verifying mib={mib} checksum={} verified={verified} bad={bad}",
                pid(),
                &sum.to_hex()[..16]
            ),
        )?;
        if every == 0 {
            // Idle, holding the memory: nothing competes with the checkpoint for the CPU.
            sleep_ms(60_000);
            continue;
        }
        sleep_ms(every);
        if bytes(&buf) == sum {
            verified += 1;
        } else {
            bad += 1;
        }
    }
}

/// A pre-fork tree: the parent fills `--mib N` of private memory, then forks `--children K` that read
/// it. Until one of them writes a page, the kernel keeps one copy of it for all of them, which a restore
/// must keep (the tree's PSS is what the tests measure). The same mapping also holds what a restore must
/// not share: after the fork every process (parent too) rewrites one page of the common memory (its
/// `proc` number's) and fills one MiB of its own past it (a MiB per process, untouched in the others), so
/// each sees different bytes. Record `proc` 0 is the parent, 1..=K the children; each re-hashes its whole
/// view of the mapping every `--verify-ms` and counts matches and mismatches.
fn cow(opts: &Opts) -> Result<(), String> {
    let mib = opts.num("mib", 128)? as usize;
    let children = opts.num("children", 4)? as usize;
    let every = opts.num("verify-ms", 500)?.max(1);
    let seed = opts.num("seed", 0x2545_f491_4f6c_dd1d)? | 1;
    let s = state(opts, children + 1)?;
    // A mapping of its own (not the allocator's), so that the memory is one private area in parent and
    // children alike: the common part, then one MiB per process.
    let len = (mib + children + 1) << 20;
    // SAFETY: a fresh private anonymous mapping, never unmapped (the process runs until killed).
    let mem = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if mem == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: the mapping is `len` bytes, aligned, and only this slice refers to it in this process.
    let buf = unsafe { std::slice::from_raw_parts_mut(mem.cast::<u64>(), len / 8) };
    const MIB_WORDS: usize = 1 << 17;
    fill_random(&mut buf[..mib * MIB_WORDS], seed);
    let mut me = 0;
    for i in 1..=children {
        // SAFETY: the process is single-threaded (no thread was started), so fork is sound.
        match unsafe { libc::fork() } {
            -1 => return Err(format!("fork: {}", std::io::Error::last_os_error())),
            0 => {
                me = i;
                break;
            }
            _ => {}
        }
    }
    // What only this process has: one page of the common memory rewritten, one MiB of its own.
    let page = me * PAGE_WORDS;
    if page + PAGE_WORDS <= mib * MIB_WORDS {
        fill_random(&mut buf[page..page + PAGE_WORDS], seed ^ (me as u64 + 1));
    }
    let own = (mib + me) * MIB_WORDS;
    fill_random(&mut buf[own..own + MIB_WORDS], !seed ^ me as u64);
    let buf: &[u64] = buf; // read-only from here on
    let hash = |b: &[u64]| {
        // SAFETY: viewing initialized u64s as bytes.
        blake3::hash(unsafe { std::slice::from_raw_parts(b.as_ptr().cast::<u8>(), b.len() * 8) })
    };
    let sum = hash(buf);
    let (mut verified, mut bad) = (0u64, 0u64);
    loop {
        if hash(buf) == sum {
            verified += 1;
        } else {
            bad += 1;
        }
        put(
            &s,
            me,
            &format!(
                "proc={me} pid={} mib={mib} checksum={} verified={verified} bad={bad}",
                pid(),
                &sum.to_hex()[..16]
            ),
        )?;
        sleep_ms(every);
    }
}

/// `--mib N` of memory whose pages all hold one generation number between generations. A checkpoint is
/// one moment of the process, so a restored copy finds every page as that moment left it: the pages
/// written so far in the generation under way hold its number, the others the previous one, and the
/// copy finishes the generation from where the registers say it was. A checkpoint that stored some pages
/// as they were later (a torn snapshot: CRIU let the process run while the store still had to read
/// pages that are references to its own) gives the copy a page of a later generation: the next check
/// finds it. Pages are checked bottom up and written top down, so that the top pages (the last CRIU
/// dumps) are written again as early as possible in every generation. Single-threaded, without pauses:
/// the faster a generation, the sooner a later one reaches the pages a torn snapshot took late.
fn generations(opts: &Opts) -> Result<(), String> {
    let mib = opts.num("mib", 64)? as usize;
    let s = state(opts, 1)?;
    let pages = mib << 8;
    let mut buf = vec![0u64; pages * PAGE_WORDS];
    let page = |buf: &mut [u64], p: usize| buf[p * PAGE_WORDS..].as_mut_ptr();
    // Generation 0: every page written once, so that every page is present (and dumped).
    for p in 0..pages {
        // SAFETY: a word inside `buf`, which is ours (volatile: the compiler must not drop a write of
        // zero into zeroed memory, nor keep a page's word in a register across generations).
        unsafe { std::ptr::write_volatile(page(&mut buf, p), 0) };
    }
    let mut gen = 0u64;
    let mut said = std::time::Instant::now();
    let report = |gen: u64, torn: &str| {
        put(
            &s,
            0,
            &format!("pid={} gen={gen} mib={mib} torn={torn}", pid()),
        )
    };
    report(gen, "0")?;
    loop {
        for p in 0..pages {
            // SAFETY: as above.
            let found = unsafe { std::ptr::read_volatile(page(&mut buf, p)) };
            if found != gen {
                report(gen, &format!("1 page={p} found={found}"))?;
                eprintln!(
                    "workload: TORN: page {p} of {pages} holds generation {found}, not {gen}"
                );
                std::process::exit(3);
            }
        }
        gen += 1;
        for p in (0..pages).rev() {
            // SAFETY: as above.
            unsafe { std::ptr::write_volatile(page(&mut buf, p), gen) };
        }
        if said.elapsed() >= std::time::Duration::from_millis(50) {
            report(gen, "0")?;
            said = std::time::Instant::now();
        }
    }
}
