//! Store benchmark (issue 5 figures): ingest, unchanged re-checkpoint and materialize of a CRIU-like image
//! folder, against `cp -r`, `tar | zstd -1` and `zstd -1` in the same run. Prints figures and ratios.
//!
//! ```text
//! cargo run --release -p gpu-checkpoint --example store_bench -- [--dir DIR] [--size-gib N] [--level L]
//!           [--threads N] [--keep]
//! ```
//! DIR (default /var/tmp/gpu-checkpoint-store-bench) must be on the disk under test; it is emptied first.
//! Every step starts after a `sync`, with the source folder in the page cache for all contenders.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpu_checkpoint::store::{NoProgress, Store, StoreOptions};

const PAGE: usize = 4096;

struct Args {
    dir: PathBuf,
    size_gib: f64,
    level: i32,
    threads: usize,
    keep: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        dir: PathBuf::from("/var/tmp/gpu-checkpoint-store-bench"),
        size_gib: 4.0,
        level: StoreOptions::default().zstd_level,
        threads: 0,
        keep: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{arg} needs a value"));
        match arg.as_str() {
            "--dir" => a.dir = PathBuf::from(val()),
            "--size-gib" => a.size_gib = val().parse().expect("--size-gib N"),
            "--level" => a.level = val().parse().expect("--level L"),
            "--threads" => a.threads = val().parse().expect("--threads N"),
            "--keep" => a.keep = true,
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// xorshift64: fast enough to generate gigabytes of incompressible data.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// A CRIU-like page image: runs of 1-1024 pages (4 KiB-4 MiB) of one kind. About 30% zero pages, 30% random
/// (incompressible: heaps of encrypted or already compressed data, weights), 20% copies of a few hundred
/// recurring pages (shared libraries, replicated buffers), 20% compressible (text, sparse structures).
fn write_pages(path: &Path, bytes: u64, seed: u64) -> std::io::Result<()> {
    let mut rng = Rng(seed | 1);
    let mut f = std::io::BufWriter::with_capacity(8 << 20, fs::File::create(path)?);
    let mut recurring = vec![0u8; 256 * PAGE];
    rng.fill(&mut recurring);
    let mut page = vec![0u8; PAGE];
    let mut written = 0u64;
    while written < bytes {
        let kind = rng.next() % 10;
        let run = 1 + (rng.next() % 1024) as usize;
        for _ in 0..run {
            match kind {
                0..=2 => page.fill(0),
                3..=5 => rng.fill(&mut page),
                6 | 7 => {
                    let k = (rng.next() % 256) as usize;
                    page.copy_from_slice(&recurring[k * PAGE..(k + 1) * PAGE]);
                }
                _ => {
                    // Small integers and pointers with zero high bytes, as in typical heap data.
                    for w in page.chunks_mut(8) {
                        let v = rng.next() % 4096;
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
    let mut rng = Rng(7);
    for (name, len) in [
        ("pagemap-1.img", 200_000),
        ("mm-1.img", 30_000),
        ("core-1.img", 9_000),
        ("fs-1.img", 100),
        ("inventory.img", 60),
        ("files.img", 4_000),
    ] {
        let mut b = vec![0u8; len];
        rng.fill(&mut b);
        fs::write(src.join(name), b).unwrap();
    }
}

fn sh(cmd: &str) -> Duration {
    let t = Instant::now();
    let st = Command::new("sh").arg("-c").arg(cmd).status().unwrap();
    assert!(st.success(), "{cmd} failed");
    t.elapsed()
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
    let s = fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

fn reset_peak_rss() {
    // Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    let _ = fs::write("/proc/self/clear_refs", "5");
}

/// Hard-links every file of `src` into a staging folder: the ingest consumes (removes) its staging folder,
/// and linking keeps the source intact without copying it first.
fn link_into(src: &Path, staging: &Path) {
    for e in fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        fs::hard_link(e.path(), staging.join(e.file_name())).unwrap();
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn main() {
    let a = parse_args();
    let bytes = (a.size_gib * (1u64 << 30) as f64) as u64;
    let _ = fs::remove_dir_all(&a.dir);
    fs::create_dir_all(&a.dir).unwrap();
    let src = a.dir.join("src");
    let t = Instant::now();
    make_source(&src, bytes);
    let logical = du(&src);
    eprintln!(
        "generated {:.2} GiB in {:.1} s",
        logical as f64 / (1u64 << 30) as f64,
        secs(t.elapsed())
    );
    let load = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    sync();

    let opts = StoreOptions {
        zstd_level: a.level,
        threads: a.threads,
        ..StoreOptions::default()
    };
    let store_dir = a.dir.join("store");
    let store = Store::open(&store_dir, opts.clone()).unwrap();

    // 1. cp -r, then our ingest, then tar | zstd -1 (each after a sync, the source cached for all).
    let cp_dst = a.dir.join("cp");
    let cp = sh(&format!("cp -r {} {}", src.display(), cp_dst.display()));
    let cp_sync = cp + sh("sync");

    reset_peak_rss();
    let ing = store.begin(Some("bench")).unwrap();
    link_into(&src, ing.staging_dir());
    let t = Instant::now();
    let first = ing
        .commit(serde_json::json!({"bench": true}), &NoProgress)
        .unwrap();
    let ingest = t.elapsed();
    let ingest_rss = peak_rss_mib();
    sync();

    let tar_out = a.dir.join("images.tar.zst");
    let tar = sh(&format!(
        "tar -C {} -cf - . | zstd -1 -q -o {}",
        src.display(),
        tar_out.display()
    ));
    sync();
    let zstd_out = a.dir.join("pages.zst");
    sh(&format!(
        "zstd -1 -q -o {} {}",
        zstd_out.display(),
        src.join("pages-1.img").display()
    ));
    sync();

    // 2. An unchanged re-checkpoint.
    let ing = store.begin(Some("bench")).unwrap();
    link_into(&src, ing.staging_dir());
    let t = Instant::now();
    let second = ing
        .commit(serde_json::json!({"bench": true}), &NoProgress)
        .unwrap();
    let reingest = t.elapsed();
    sync();

    // 3. Materialize vs cp -r back (from the cp copy, equally cached).
    let back_cp = a.dir.join("back-cp");
    let cp_back = sh(&format!("cp -r {} {}", cp_dst.display(), back_cp.display()));
    sync();
    reset_peak_rss();
    let back = a.dir.join("back-store");
    let t = Instant::now();
    store.materialize(&first.id, &back, &NoProgress).unwrap();
    let mat = t.elapsed();
    let mat_rss = peak_rss_mib();
    sync();
    let same = sh(&format!(
        "cmp {} {}",
        src.join("pages-1.img").display(),
        back.join("pages-1.img").display()
    ));
    let _ = same;

    let stored = du(&store_dir.join("chunks"));
    let tar_size = fs::metadata(&tar_out).unwrap().len();
    let zstd_size = fs::metadata(&zstd_out).unwrap().len();
    let gib = logical as f64 / (1u64 << 30) as f64;
    let load_end = fs::read_to_string("/proc/loadavg").unwrap_or_default();

    println!(
        "store benchmark: {gib:.2} GiB CRIU-like image folder in {}",
        a.dir.display()
    );
    println!(
        "  zstd level {}, threads {}, {} cores, loadavg before {} after {}",
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
    println!("ingest");
    println!(
        "  cp -r                 {:7.2} s   ({:.2} s with sync)",
        secs(cp),
        secs(cp_sync)
    );
    println!("  tar | zstd -1         {:7.2} s", secs(tar));
    println!(
        "  gpu-checkpoint ingest {:7.2} s   (durable; sync {:.2} s; peak RSS {:.0} MiB)",
        secs(ingest),
        first.stats.sync_ms as f64 / 1000.0,
        ingest_rss
    );
    println!(
        "  ratio ingest / cp -r          {:.2}  (target <= 1.25)",
        secs(ingest) / secs(cp)
    );
    println!(
        "  ratio ingest / (cp -r + sync) {:.2}",
        secs(ingest) / secs(cp_sync)
    );
    println!(
        "  ratio ingest / tar|zstd -1    {:.2}  (target < 1)",
        secs(ingest) / secs(tar)
    );
    println!("unchanged re-checkpoint");
    println!(
        "  first  wrote {:>14} bytes in {:.2} s",
        first.stats.new_bytes + first.stats.manifest_bytes,
        secs(ingest)
    );
    println!(
        "  second wrote {:>14} bytes in {:.2} s",
        second.stats.new_bytes + second.stats.manifest_bytes,
        secs(reingest)
    );
    println!(
        "  ratio bytes {:.4}% (target < 2%), time {:.1}% (target < 30%)",
        100.0 * (second.stats.new_bytes + second.stats.manifest_bytes) as f64
            / (first.stats.new_bytes + first.stats.manifest_bytes) as f64,
        100.0 * secs(reingest) / secs(ingest)
    );
    println!("materialize");
    println!("  cp -r back            {:7.2} s", secs(cp_back));
    println!(
        "  gpu-checkpoint        {:7.2} s   (every chunk verified; peak RSS {:.0} MiB)",
        secs(mat),
        mat_rss
    );
    println!(
        "  ratio materialize / cp -r     {:.2}  (target <= 1.25)",
        secs(mat) / secs(cp_back)
    );
    println!("size");
    println!("  logical               {:>14} bytes", logical);
    println!("  store (chunks)        {:>14} bytes  ({:.2}x smaller; zero {} B, dedup {:.2}x, compression {:.2}x)",
        stored, logical as f64 / stored as f64, first.stats.zero_bytes, first.stats.dedup_ratio, first.stats.compression_ratio);
    println!("  zstd -1 (pages file)  {:>14} bytes", zstd_size);
    println!("  tar | zstd -1         {:>14} bytes", tar_size);
    println!(
        "  ratio store / tar|zstd -1     {:.3}  (target <= 1)",
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
