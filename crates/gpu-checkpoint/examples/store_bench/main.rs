//! Store benchmark (issue 5 figures): ingest, unchanged re-checkpoint and materialize of a CRIU-like image
//! folder, against `cp -r`, `tar | zstd -1` and `zstd -1` in the same run. Prints figures and ratios.
//!
//! ```text
//! cargo run --release -p gpu-checkpoint --example store_bench -- [--dir DIR] [--size-gib N] [--level L (0: none)]
//!           [--threads N] [--rounds N] [--keep] [--src IMAGES] [--parts]
//! ```
//! `--parts` measures instead the ingest's CPU time against the sum of its parts (`parts.rs`).
//! DIR (default /var/tmp/gpu-checkpoint-store-bench) must be on the disk under test; it is emptied first.
//! `--src IMAGES` benchmarks an existing image folder (say, real CRIU images) instead of generating one; it
//! is copied into DIR first (not timed) and left untouched.
//! Every step starts after a `sync`, with the source folder in the page cache for all contenders. Each round
//! runs every contender once, alternating; the figures are medians over the rounds, wall and CPU time
//! (user + system: on a busy machine the wall time mostly says how much CPU the scheduler handed out).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use gpu_checkpoint::store::{NoProgress, Store, StoreOptions};
use gpu_checkpoint_testdata::XorShift64;

mod parts;

const PAGE: usize = 4096;

struct Args {
    dir: PathBuf,
    size_gib: f64,
    level: i32,
    threads: usize,
    rounds: usize,
    keep: bool,
    /// An existing image folder (real CRIU images) instead of the generated one.
    src: Option<PathBuf>,
    /// Ingest against the sum of its parts instead of against `cp -r` and `tar | zstd`.
    parts: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        dir: PathBuf::from("/var/tmp/gpu-checkpoint-store-bench"),
        size_gib: 4.0,
        level: StoreOptions::default().zstd_level,
        threads: 0,
        rounds: 3,
        keep: false,
        src: None,
        parts: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--dir" => a.dir = PathBuf::from(val()),
            "--size-gib" => a.size_gib = val().parse().expect("--size-gib N"),
            "--level" => a.level = val().parse().expect("--level L"),
            "--threads" => a.threads = val().parse().expect("--threads N"),
            "--rounds" => a.rounds = val().parse().expect("--rounds N"),
            "--keep" => a.keep = true,
            "--src" => a.src = Some(PathBuf::from(val())),
            "--parts" => a.parts = true,
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// A CRIU-like page image: runs of 1-1024 pages (4 KiB-4 MiB) of one kind. About 30% zero pages, 30% random
/// (incompressible: heaps of encrypted or already compressed data, weights), 20% copies of a few hundred
/// recurring pages (shared libraries, replicated buffers), 20% compressible (text, sparse structures).
fn write_pages(path: &Path, bytes: u64, seed: u64) -> std::io::Result<()> {
    let mut rng = XorShift64::new(seed | 1);
    let mut f = std::io::BufWriter::with_capacity(8 << 20, fs::File::create(path)?);
    let mut recurring = vec![0u8; 256 * PAGE];
    rng.fill_bytes(&mut recurring);
    let mut page = vec![0u8; PAGE];
    let mut written = 0u64;
    while written < bytes {
        let kind = rng.next_u64() % 10;
        let run = 1 + (rng.next_u64() % 1024) as usize;
        for _ in 0..run {
            match kind {
                0..=2 => page.fill(0),
                3..=5 => rng.fill_bytes(&mut page),
                6 | 7 => {
                    let k = (rng.next_u64() % 256) as usize;
                    page.copy_from_slice(&recurring[k * PAGE..(k + 1) * PAGE]);
                }
                _ => {
                    // Small integers and pointers with zero high bytes, as in typical heap data.
                    for w in page.chunks_mut(8) {
                        let v = rng.next_u64() % 4096;
                        w.copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
            f.write_all(&page)?;
            written += PAGE as u64;
        }
    }
    f.flush()
}

fn make_source(src: &Path, bytes: u64) {
    fs::create_dir_all(src).unwrap();
    write_pages(&src.join("pages-1.img"), bytes, 42).unwrap();
    let mut rng = XorShift64::new(7);
    for (name, len) in [
        ("pagemap-1.img", 200_000),
        ("mm-1.img", 30_000),
        ("core-1.img", 9_000),
        ("fs-1.img", 100),
        ("inventory.img", 60),
        ("files.img", 4_000),
    ] {
        let mut b = vec![0u8; len];
        rng.fill_bytes(&mut b);
        fs::write(src.join(name), b).unwrap();
    }
}

/// User and system CPU seconds so far of `who` (`RUSAGE_SELF` or `RUSAGE_CHILDREN`).
fn rusage(who: libc::c_int) -> (f64, f64) {
    // SAFETY: getrusage fills the struct we pass.
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(who, &mut r) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (tv(r.ru_utime), tv(r.ru_stime))
}

/// CPU seconds (user + system) of this process and of its waited-for children so far.
fn cpu_times() -> (f64, f64) {
    let get = |who| {
        let (user, sys) = rusage(who);
        user + sys
    };
    (get(libc::RUSAGE_SELF), get(libc::RUSAGE_CHILDREN))
}

/// Wall and CPU time of one step.
#[derive(Clone, Copy, Default)]
struct Cost {
    wall: f64,
    cpu: f64,
}

/// Runs a shell command; its cost is its wall time and its children's CPU time.
fn sh(cmd: &str) -> Cost {
    let (_, c0) = cpu_times();
    let t = Instant::now();
    let st = Command::new("sh").arg("-c").arg(cmd).status().unwrap();
    assert!(st.success(), "{cmd} failed");
    Cost {
        wall: t.elapsed().as_secs_f64(),
        cpu: cpu_times().1 - c0,
    }
}

/// Runs a step in this process; its cost is its wall time and this process's CPU time.
fn here<T>(f: impl FnOnce() -> T) -> (T, Cost) {
    let (c0, _) = cpu_times();
    let t = Instant::now();
    let r = f();
    let cost = Cost {
        wall: t.elapsed().as_secs_f64(),
        cpu: cpu_times().0 - c0,
    };
    (r, cost)
}

fn sync() {
    sh("sync");
}

fn du(path: &Path) -> u64 {
    let out = Command::new("du").arg("-sb").arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn peak_rss_mib() -> f64 {
    status_mib("VmHWM:")
}

fn rss_mib() -> f64 {
    status_mib("VmRSS:")
}

fn status_mib(key: &str) -> f64 {
    let s = fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

fn reset_peak_rss() {
    // Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    let _ = fs::write("/proc/self/clear_refs", "5");
}

/// A checkpoint of `src` (hard-linked into the staging folder, untimed) committed into `store`: what the
/// commit cost.
fn timed_commit(store: &Store, src: &Path) -> (gpu_checkpoint::store::CheckpointInfo, Cost) {
    let ing = store.begin(Some("bench")).unwrap();
    link_into(src, ing.staging_dir());
    here(|| {
        ing.commit(serde_json::json!({"bench": true}), &NoProgress)
            .unwrap()
    })
}

/// Hard-links every file of `src` into a staging folder: the ingest consumes (removes) its staging folder,
/// and linking keeps the source intact without copying it first.
fn link_into(src: &Path, staging: &Path) {
    for e in fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        fs::hard_link(e.path(), staging.join(e.file_name())).unwrap();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Costs of one contender over all rounds.
#[derive(Default)]
struct Series(Vec<Cost>);

impl Series {
    fn wall(&self) -> f64 {
        median(self.0.iter().map(|c| c.wall).collect())
    }
    fn cpu(&self) -> f64 {
        median(self.0.iter().map(|c| c.cpu).collect())
    }
    fn all(&self) -> String {
        let w: Vec<String> = self.0.iter().map(|c| format!("{:.2}", c.wall)).collect();
        w.join(" ")
    }
}

fn row(label: &str, s: &Series) {
    println!(
        "  {label:<24} {:7.2} s wall (median of {}: {}), {:6.2} s CPU",
        s.wall(),
        s.0.len(),
        s.all(),
        s.cpu()
    );
}

fn ratio(label: &str, a: &Series, b: &Series, target: &str) {
    println!(
        "  {label:<34} wall {:5.2}   CPU {:5.2}   {target}",
        a.wall() / b.wall(),
        a.cpu() / b.cpu()
    );
}

fn main() {
    let a = parse_args();
    // --parts runs none of the outside tools but `sync` and `du`.
    let tools: &[&str] = if a.parts {
        &["du"]
    } else {
        &["zstd", "tar", "cp", "diff", "du"]
    };
    for &tool in tools {
        let found = Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool}"))
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !found {
            eprintln!("store_bench needs `{tool}` (the baselines run it); install it, e.g. apt-get install -y {tool}");
            std::process::exit(5);
        }
    }
    let bytes = (a.size_gib * (1u64 << 30) as f64) as u64;
    let _ = fs::remove_dir_all(&a.dir);
    fs::create_dir_all(&a.dir).unwrap();
    let src = a.dir.join("src");
    let t = Instant::now();
    match &a.src {
        Some(images) => {
            sh(&format!("cp -r {} {}", images.display(), src.display()));
        }
        None => make_source(&src, bytes),
    }
    let logical = du(&src);
    eprintln!(
        "prepared {:.2} GiB in {:.1} s",
        logical as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64()
    );
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    sync();

    // --level 0: no compression (`checkpoint --compression none`).
    let opts = StoreOptions {
        zstd_level: a.level.max(1),
        compress: a.level > 0,
        threads: a.threads,
        ..StoreOptions::default()
    };
    if a.parts {
        parts::run(&a.dir, &src, &opts, a.rounds);
        if !a.keep {
            let _ = fs::remove_dir_all(&a.dir);
        }
        return;
    }
    let [mut cp, mut cp_sync, mut tar, mut ingest, mut reingest, mut cp_back, mut mat]: [Series;
        7] = Default::default();
    let (mut first_bytes, mut second_bytes, mut stored, mut tar_size) = (0, 0, 0, 0);
    let (mut ingest_rss, mut mat_rss, mut base_rss, mut zero, mut comp) =
        (0f64, 0f64, 0f64, 0, 0.0);
    for round in 0..a.rounds {
        eprintln!("round {}/{}", round + 1, a.rounds);
        let store_dir = a.dir.join("store");
        let cp_dst = a.dir.join("cp");
        let back_cp = a.dir.join("back-cp");
        let back = a.dir.join("back-store");
        let tar_out = a.dir.join("images.tar.zst");
        for p in [&store_dir, &cp_dst, &back_cp, &back] {
            let _ = fs::remove_dir_all(p);
        }
        let _ = fs::remove_file(&tar_out);
        sync();
        let store = Store::open(&store_dir, opts.clone()).unwrap();

        // 1. Ingest: cp -r, our ingest, tar | zstd -1, each after a sync, the source cached for all.
        let c = sh(&format!("cp -r {} {}", src.display(), cp_dst.display()));
        cp.0.push(c);
        let s = sh("sync");
        cp_sync.0.push(Cost {
            wall: c.wall + s.wall,
            cpu: c.cpu + s.cpu,
        });

        reset_peak_rss();
        base_rss = base_rss.max(rss_mib());
        let (first, c) = timed_commit(&store, &src);
        ingest.0.push(c);
        ingest_rss = ingest_rss.max(peak_rss_mib());
        sync();

        tar.0.push(sh(&format!(
            "tar -C {} -cf - . | zstd -1 -q -o {}",
            src.display(),
            tar_out.display()
        )));
        sync();

        // 2. An unchanged re-checkpoint.
        let (second, c) = timed_commit(&store, &src);
        reingest.0.push(c);
        sync();

        // 3. Materialize vs cp -r back (from the cp copy, equally cached).
        cp_back.0.push(sh(&format!(
            "cp -r {} {}",
            cp_dst.display(),
            back_cp.display()
        )));
        sync();
        reset_peak_rss();
        let (_, c) = here(|| store.materialize(&first.id, &back, &NoProgress).unwrap());
        mat.0.push(c);
        mat_rss = mat_rss.max(peak_rss_mib());
        sync();
        sh(&format!(
            "cmp {} {}",
            src.join("pages-1.img").display(),
            back.join("pages-1.img").display()
        ));

        first_bytes = first.stats.new_bytes + first.stats.manifest_bytes;
        second_bytes = second.stats.new_bytes + second.stats.manifest_bytes;
        stored = du(&store_dir.join("chunks"));
        tar_size = fs::metadata(&tar_out).unwrap().len();
        zero = first.stats.zero_bytes;
        comp = first.stats.compression_ratio;
    }
    let zstd_out = a.dir.join("pages.zst");
    sh(&format!(
        "zstd -1 -q -o {} {}",
        zstd_out.display(),
        src.join("pages-1.img").display()
    ));
    let zstd_size = fs::metadata(&zstd_out).unwrap().len();
    let gib = logical as f64 / (1u64 << 30) as f64;
    let load_end = fs::read_to_string("/proc/loadavg").unwrap_or_default();

    println!(
        "store benchmark: {gib:.2} GiB CRIU-like image folder in {}",
        a.dir.display()
    );
    println!(
        "  zstd level {}, threads {}, {} cores; loadavg before: {}; after: {}",
        opts.zstd_level,
        if opts.threads == 0 {
            "all".to_string()
        } else {
            opts.threads.to_string()
        },
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        load.trim(),
        load_end.trim()
    );
    println!("ingest (ours is durable: every chunk and the manifest synced)");
    row("cp -r", &cp);
    row("cp -r + sync", &cp_sync);
    row("tar | zstd -1", &tar);
    row("gpu-checkpoint ingest", &ingest);
    println!("  peak RSS of the ingest {ingest_rss:.0} MiB (the benchmark process held {base_rss:.0} MiB before)");
    ratio(
        "ingest / cp -r",
        &ingest,
        &cp,
        "(1.25 target retired: see --parts)",
    );
    ratio("ingest / (cp -r + sync)", &ingest, &cp_sync, "");
    ratio("ingest / tar|zstd -1", &ingest, &tar, "(target < 1)");
    println!("unchanged re-checkpoint");
    row("first", &ingest);
    row("second", &reingest);
    println!("  bytes written: first {first_bytes}, second {second_bytes}");
    println!(
        "  second / first: bytes {:.4}% (target < 2%), wall {:.1}% CPU {:.1}% (target < 30%)",
        100.0 * second_bytes as f64 / first_bytes as f64,
        100.0 * reingest.wall() / ingest.wall(),
        100.0 * reingest.cpu() / ingest.cpu()
    );
    println!("materialize (ours verifies every chunk)");
    row("cp -r back", &cp_back);
    row("gpu-checkpoint", &mat);
    println!("  peak RSS of materialize {mat_rss:.0} MiB");
    ratio("materialize / cp -r", &mat, &cp_back, "(target <= 1.25)");
    println!("size");
    println!("  logical               {logical:>14} bytes");
    println!(
        "  store (chunks)        {stored:>14} bytes  ({:.2}x smaller; {zero} zero bytes not stored, compression {comp:.2}x)",
        logical as f64 / stored as f64
    );
    println!("  tar | zstd -1         {tar_size:>14} bytes");
    println!("  zstd -1 (pages file)  {zstd_size:>14} bytes");
    println!(
        "  store / tar|zstd -1   {:.3}  (target <= 1)",
        stored as f64 / tar_size as f64
    );
    println!(
        "memory budget max(64 MiB, 1%) = {:.0} MiB",
        gpu_checkpoint::store::memory_budget(logical) as f64 / (1u64 << 20) as f64
    );

    if !a.keep {
        let _ = fs::remove_dir_all(&a.dir);
    }
}
