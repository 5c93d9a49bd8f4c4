//! Detection latency, printed (not asserted): per process, `--all` on this node, `--all` on this node
//! with 1000 extra processes, and `--all` on a synthetic /proc tree of 1000 processes. Each `--all`
//! figure comes with baselines measured alternately in the same run:
//!
//! - "naive": detect every process in full (read all its files, classify), no cheap filter;
//! - "procfs": the same cheap filter (maps + fd links), read through the `procfs` crate, then the same
//!   full detection of the candidates.
//!
//! Targets: < 5 ms per process, < 200 ms for a node of 1000 processes.
//!
//! `cargo bench -p gpu-checkpoint --bench detect [-- --quick]`

#[cfg(any(target_os = "linux", target_os = "android"))]
fn main() {
    linux::main()
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn main() {
    println!("detect benchmark: Linux only (it reads /proc)");
}

#[cfg(any(target_os = "linux", target_os = "android"))]
mod linux {
    use std::fs;
    use std::os::unix::fs::symlink;
    use std::path::Path;
    use std::process::{Child, Command, Stdio};
    use std::time::Instant;

    use gpu_checkpoint::detect::paths::classify_path;
    use gpu_checkpoint::detect::{detect_all, detect_pid, DetectOptions};

    struct Stats {
        median: f64,
        p90: f64,
        min: f64,
    }

    fn stats(mut v: Vec<f64>) -> Stats {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        Stats {
            median: v[v.len() / 2],
            p90: v[(v.len() * 9 / 10).min(v.len() - 1)],
            min: v[0],
        }
    }

    fn ms(f: &mut dyn FnMut()) -> f64 {
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64() * 1000.0
    }

    /// Runs the candidates alternately, `rounds` times each, after one warm-up round.
    fn compare(rounds: usize, fs_: &mut [(&str, &mut dyn FnMut())]) -> Vec<(String, Stats)> {
        for (_, f) in fs_.iter_mut() {
            f();
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); fs_.len()];
        for _ in 0..rounds {
            for (i, (_, f)) in fs_.iter_mut().enumerate() {
                times[i].push(ms(*f));
            }
        }
        fs_.iter()
            .zip(times)
            .map(|((n, _), t)| (n.to_string(), stats(t)))
            .collect()
    }

    fn print_compare(title: &str, res: &[(String, Stats)]) {
        println!("{title}");
        let ours = res[0].1.median;
        for (name, s) in res {
            println!(
                "  {name:<34} median {:>8.2} ms  p90 {:>8.2} ms  min {:>8.2} ms  ({:.2}x ours)",
                s.median,
                s.p90,
                s.min,
                s.median / ours
            );
        }
    }

    fn opts(root: &Path, simulator: bool) -> DetectOptions {
        DetectOptions {
            proc_root: root.to_path_buf(),
            tree: false,
            nvml: false,
            simulator,
        }
    }

    /// Baseline 1: detect every process in full.
    fn naive_all(root: &Path) -> usize {
        let o = opts(root, false);
        let mut gpu = 0;
        for e in fs::read_dir(root).unwrap().filter_map(|e| e.ok()) {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            if let Ok(r) = detect_pid(pid, &o) {
                gpu += r.gpu as usize;
            }
        }
        gpu
    }

    /// Baseline 2: the cheap filter through the procfs crate, then full detection of candidates.
    fn procfs_all(root: &Path) -> usize {
        let o = opts(root, false);
        let mut gpu = 0;
        let device = |p: &str| classify_path(p).is_device();
        for p in procfs::process::all_processes_with_root(root)
            .unwrap()
            .filter_map(|p| p.ok())
        {
            let mapped = p.maps().map(|m| {
                m.iter().any(|m| match &m.pathname {
                    procfs::process::MMapPath::Path(path) => device(&path.to_string_lossy()),
                    _ => false,
                })
            });
            let candidate = mapped.unwrap_or(false)
                || p.fd()
                    .map(|fds| {
                        fds.filter_map(|f| f.ok()).any(|f| match f.target {
                            procfs::process::FDTarget::Path(path) => {
                                device(&path.to_string_lossy())
                            }
                            _ => false,
                        })
                    })
                    .unwrap_or(false);
            if candidate {
                if let Ok(r) = detect_pid(p.pid, &o) {
                    gpu += r.gpu as usize;
                }
            }
        }
        gpu
    }

    fn ours_all(root: &Path) -> usize {
        detect_all(&opts(root, false))
            .map(|r| r.processes.len())
            .unwrap_or(0)
    }

    fn count_pids(root: &Path) -> usize {
        fs::read_dir(root)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .ok()
                    .and_then(|e| {
                        e.file_name()
                            .to_str()
                            .map(|s| s.bytes().all(|b| b.is_ascii_digit()))
                    })
                    .unwrap_or(false)
            })
            .count()
    }

    fn node(title: &str, root: &Path, rounds: usize) {
        let n = count_pids(root);
        let gpu = ours_all(root);
        assert_eq!(
            gpu,
            naive_all(root),
            "baseline and ours disagree on {title}"
        );
        let res = compare(
            rounds,
            &mut [
                ("ours (detect --all)", &mut || {
                    ours_all(root);
                }),
                ("naive: every process in full", &mut || {
                    naive_all(root);
                }),
                ("procfs crate filter + full", &mut || {
                    procfs_all(root);
                }),
            ],
        );
        print_compare(
            &format!("{title}: {n} processes, {gpu} with GPU state  [target < 200 ms for 1000]"),
            &res,
        );
    }

    fn per_process(title: &str, root: &Path, pid: i32, tree: bool, simulator: bool, rounds: usize) {
        let o = DetectOptions {
            tree,
            ..opts(root, simulator)
        };
        let r = detect_pid(pid, &o).expect("detect");
        let mut f = || {
            detect_pid(pid, &o).unwrap();
        };
        let res = compare(rounds, &mut [("detect --pid", &mut f)]);
        let s = &res[0].1;
        println!(
            "  {title:<52} {:>2} proc(s) strategy {:<11} median {:>6.3} ms  p90 {:>6.3} ms  [target < 5 ms]",
            r.processes.len(),
            r.strategy.name.as_str(),
            s.median,
            s.p90
        );
    }

    /// Sleeping processes that die with the benchmark.
    struct Sleepers(Vec<Child>);

    impl Drop for Sleepers {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
            }
            for c in &mut self.0 {
                let _ = c.wait();
            }
        }
    }

    // ---------- a synthetic node: 1000 processes, 5% of them with a PyTorch-sized CUDA layout ----------

    fn w(path: &Path, data: impl AsRef<[u8]>) {
        fs::write(path, data).unwrap();
    }

    fn synth_process(root: &Path, pid: i32, gpu: bool) {
        let d = root.join(pid.to_string());
        fs::create_dir_all(d.join("fd")).unwrap();
        let comm = if gpu { "python" } else { "worker" };
        let mut stat = format!("{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560");
        for _ in 0..44 {
            stat.push_str(" 0");
        }
        w(&d.join("stat"), stat + "\n");
        w(
            &d.join("status"),
            format!(
                "Name:\t{comm}\nTgid:\t{pid}\nPid:\t{pid}\nPPid:\t1\nNSpid:\t{pid}\nThreads:\t4\n"
            ),
        );
        w(&d.join("comm"), format!("{comm}\n"));
        w(&d.join("cgroup"), "0::/system.slice/app.service\n");
        let mut env = String::new();
        for i in 0..30 {
            env.push_str(&format!("VAR_{i}=<redacted>\0"));
        }
        if gpu {
            env.push_str("CUDA_VISIBLE_DEVICES=0\0NCCL_DEBUG=WARN\0");
        }
        w(&d.join("environ"), env);
        let mut maps = String::new();
        let mut addr: u64 = 0x5500_0000_0000;
        let mut line = |perms: &str, path: &str, size: u64| {
            maps.push_str(&format!(
                "{addr:x}-{:x} {perms} 00000000 08:01 1234 {path}\n",
                addr + size
            ));
            addr += size + 0x1000;
        };
        // A typical dynamically linked program: ~30 libraries x 4 mappings, heap, anonymous areas.
        for lib in 0..30 {
            for perms in ["r--p", "r-xp", "r--p", "rw-p"] {
                line(
                    perms,
                    &format!("/usr/lib/x86_64-linux-gnu/lib{lib}.so.1"),
                    0x10000,
                );
            }
        }
        for _ in 0..20 {
            line("rw-p", "", 0x21000);
        }
        if gpu {
            // PyTorch-sized: ~150 nvidiactl windows, reservations, nvidia0 windows, CUDA libraries.
            for _ in 0..150 {
                line("rw-s", "/dev/nvidiactl", 0x200000);
                line("---p", "", 0x200000);
            }
            for _ in 0..8 {
                line("rw-s", "/dev/nvidia0", 0x10000);
            }
            for lib in [
                "libcuda.so.570.86.15",
                "libcudart.so.12",
                "libnccl.so.2",
                "libnvidia-ml.so.1",
            ] {
                line(
                    "r-xp",
                    &format!("/usr/lib/x86_64-linux-gnu/{lib}"),
                    0x100000,
                );
            }
        }
        w(&d.join("maps"), maps);
        let mut fds = vec!["/dev/null", "/dev/pts/0", "/dev/pts/0"];
        fds.extend(std::iter::repeat_n("socket:[12345]", 6));
        fds.extend(std::iter::repeat_n("/var/log/app.log", 6));
        if gpu {
            fds.extend([
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia0",
                "/dev/nvidiactl",
                "/dev/nvidia0",
            ]);
        }
        for (i, t) in fds.iter().enumerate() {
            symlink(t, d.join("fd").join(i.to_string())).unwrap();
        }
        for t in 0..4 {
            let td = d.join("task").join((pid + t).to_string());
            fs::create_dir_all(&td).unwrap();
            w(
                &td.join("comm"),
                if t == 1 && gpu {
                    "cuda00001400006\n"
                } else {
                    "worker\n"
                },
            );
        }
    }

    fn synth_node(root: &Path, n: i32) {
        for i in 0..n {
            synth_process(root, 10_000 + i * 10, i % 20 == 0);
        }
        fs::create_dir_all(root.join("net")).unwrap();
        w(
            &root.join("net/unix"),
            "Num       RefCount Protocol Flags    Type St Inode Path\n",
        );
        fs::create_dir_all(root.join("driver/nvidia")).unwrap();
        w(
            &root.join("driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Release Build\n",
        );
    }

    pub fn main() {
        let quick = std::env::args().any(|a| a == "--quick");
        let rounds = if quick { 5 } else { 21 };
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let proc_ = Path::new("/proc");
        println!(
            "detect benchmark ({} rounds each, medians; candidates run alternately)",
            rounds
        );

        println!("per process:");
        let me = std::process::id() as i32;
        per_process(
            "live: this benchmark process",
            proc_,
            me,
            false,
            false,
            rounds * 10,
        );
        let sleeper = Sleepers(vec![Command::new("sleep")
            .arg("600")
            .stdin(Stdio::null())
            .spawn()
            .unwrap()]);
        per_process(
            "live: a sleep process",
            proc_,
            sleeper.0[0].id() as i32,
            false,
            false,
            rounds * 10,
        );
        for (dir, pid, tree) in [
            ("real/malloc-462", 462, false),
            ("real/torch-470", 470, false),
            ("proc/pytorch-nccl", 7000, false),
            ("proc/tree", 8000, true),
        ] {
            per_process(
                &format!("capture {dir}{}", if tree { " --tree" } else { "" }),
                &fixtures.join(dir),
                pid,
                tree,
                false,
                rounds * 10,
            );
        }
        drop(sleeper);

        let synth = tempfile::tempdir().unwrap();
        synth_node(synth.path(), 1000);
        node(
            "--all, synthetic node (generated --proc-root)",
            synth.path(),
            rounds,
        );

        node("--all, this node as it is", proc_, rounds);

        let extra = if quick { 200 } else { 1000 };
        let t = Instant::now();
        let sleepers = Sleepers(
            (0..extra)
                .map(|_| {
                    Command::new("sleep")
                        .arg("600")
                        .stdin(Stdio::null())
                        .spawn()
                        .unwrap()
                })
                .collect(),
        );
        println!(
            "(started {extra} sleep processes in {:.0} ms)",
            t.elapsed().as_secs_f64() * 1000.0
        );
        node(
            &format!("--all, this node + {extra} sleep processes"),
            proc_,
            rounds,
        );
        drop(sleepers);
    }
}
