//! Benchmark (not a timed test: run it explicitly, it prints figures and ratios measured in the same run):
//!
//!   cargo test -p gpu-checkpoint-cli --test gpu_bench -- --ignored --nocapture
//!
//! 1. Freezing N SIMULATED GPU processes whose kernels run 50 ms each: all in parallel (what the
//!    checkpoint flow does) against one after the other (what a loop over `cuda-checkpoint` does).
//! 2. One state query in-process (the cuda-driver way) against spawning a process per call (the
//!    cuda-checkpoint way; the real utility also re-attaches to the driver, which this does not show).

mod sim_support;

use gpu_checkpoint::freeze::{self, group, GpuBackend, GpuDriver, GroupOptions};
use sim_support::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn parallel_freeze_vs_serial_and_in_process_vs_spawn() {
    const N: usize = 8;
    let procs: Vec<SimProcess> = (0..N)
        .map(|_| SimProcess::start(&["--mib", "16", "--workers", "1", "--kernel-us", "50000"]))
        .collect();
    let pids: Vec<i32> = procs.iter().map(|p| p.pid).collect();
    let d: Arc<dyn GpuDriver> = freeze::open(GpuBackend::Sim).unwrap();
    let opts = GroupOptions {
        lock_timeout: Some(Duration::from_secs(10)),
        ..GroupOptions::default()
    };
    let (mut par, mut ser) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        let f = group::freeze_all(&d, &pids, &opts).unwrap();
        par.push(t.elapsed().as_secs_f64() * 1000.0);
        f.thaw().unwrap();
        std::thread::sleep(Duration::from_millis(60));

        let t = Instant::now();
        for &p in &pids {
            d.lock(p, opts.lock_timeout).unwrap();
            d.checkpoint(p).unwrap();
        }
        ser.push(t.elapsed().as_secs_f64() * 1000.0);
        for &p in &pids {
            d.restore(p, &[]).unwrap();
            d.unlock(p).unwrap();
        }
        std::thread::sleep(Duration::from_millis(60));
    }
    let (p, s) = (median(par), median(ser));
    println!(
        "freeze {N} simulated GPU processes (16 MiB each, 50 ms kernels): parallel {p:.1} ms, serial {s:.1} ms, ratio serial/parallel {:.2}x",
        s / p
    );

    let (mut inproc, mut spawn) = (Vec::new(), Vec::new());
    let pid = pids[0].to_string();
    for _ in 0..20 {
        let t = Instant::now();
        d.state(pids[0]).unwrap();
        inproc.push(t.elapsed().as_secs_f64() * 1000.0);
        let t = Instant::now();
        let o = run(&["cuda", "state", "--pid", &pid, "--gpu-backend", "sim"]);
        assert!(o.status.success());
        spawn.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    let (i, sp) = (median(inproc), median(spawn));
    println!(
        "state query: in-process {i:.3} ms, a process per call {sp:.3} ms, ratio {:.0}x",
        sp / i
    );
    for p in &pids {
        assert_verified(*p);
    }
}
