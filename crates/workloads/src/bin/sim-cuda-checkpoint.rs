//! sim-cuda-checkpoint: a SIMULATED stand-in for NVIDIA's `cuda-checkpoint` utility, for tests only.
//!
//! It takes the utility's flags (`--get-state --pid P`, `--action lock|checkpoint|restore|unlock --pid P
//! [--timeout MS] [--device-map OLD=NEW,...]`, `--toggle --pid P`, `--get-restore-tid --pid P`; and, for
//! tests only, `--verify --pid P` and `--status --pid P`, the simulator's own checks) and
//! drives a `gpu-sim-workload` through the simulator's control channel, an abstract socket of the
//! caller's network namespace. That is why it exists: inside a gVisor sandbox the channel belongs to the
//! sandbox's own network stack, which only a tool run there (`runsc exec`) reaches. Its failures name the
//! `CUDA_ERROR_*` the simulator answered, as the real utility prints the driver's, so the `cuda-cli`
//! backend maps them the same way. Every answer and error says SIMULATED on stderr.

use gpu_checkpoint::freeze::sim::SimDriver;
use gpu_checkpoint::freeze::{GpuDriver, GpuPair, GpuUuid, ProcessState};
use std::time::Duration;

fn usage() -> ! {
    eprintln!(
        "sim-cuda-checkpoint (SIMULATED cuda-checkpoint): --get-state --pid P | --action lock|checkpoint|restore|unlock --pid P [--timeout MS] [--device-map A=B,...] | --toggle --pid P | --get-restore-tid --pid P"
    );
    std::process::exit(2)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let Some(pid) = value("--pid").and_then(|p| p.parse::<i32>().ok()) else {
        usage()
    };
    let sim = SimDriver::new();
    let result = if has("--verify") {
        // Not a flag of the real utility: the simulator's own check of its device memory, for tests
        // that can reach the simulator only from inside the sandbox.
        gpu_checkpoint::freeze::sim::verify(pid).map(|v| println!("{v}"))
    } else if has("--status") {
        gpu_checkpoint::freeze::sim::status(pid).map(|m| {
            let kv: Vec<String> = m.iter().map(|(k, v)| format!("{k}={v}")).collect();
            println!("{}", kv.join(" "))
        })
    } else if has("--get-state") {
        sim.state(pid).map(|s| println!("{}", s.as_str()))
    } else if has("--get-restore-tid") {
        sim.restore_thread_id(pid).map(|t| println!("{t}"))
    } else if has("--toggle") {
        // The real utility's toggle: a running process is locked and checkpointed, a checkpointed one
        // restored and unlocked.
        match sim.state(pid) {
            Ok(ProcessState::Checkpointed) => sim.restore(pid, &[]).and_then(|()| sim.unlock(pid)),
            Ok(_) => sim.lock(pid, None).and_then(|()| sim.checkpoint(pid)),
            Err(e) => Err(e),
        }
    } else {
        match value("--action").as_deref() {
            Some("lock") => {
                let timeout = value("--timeout")
                    .and_then(|t| t.parse::<u64>().ok())
                    .map(Duration::from_millis);
                sim.lock(pid, timeout)
            }
            Some("checkpoint") => sim.checkpoint(pid),
            Some("restore") => {
                let pairs = value("--device-map")
                    .map(|m| parse_map(&m))
                    .unwrap_or_default();
                sim.restore(pid, &pairs)
            }
            Some("unlock") => sim.unlock(pid),
            _ => usage(),
        }
    };
    if let Err(e) = result {
        eprintln!("SIMULATED cuda-checkpoint: {e}");
        std::process::exit(1);
    }
    eprintln!("SIMULATED cuda-checkpoint: done");
}

/// `OLD=NEW,...` with GPU UUIDs, as the real utility's `--device-map`.
fn parse_map(map: &str) -> Vec<GpuPair> {
    map.split(',')
        .filter_map(|p| p.split_once('='))
        .filter_map(|(a, b)| {
            Some(GpuPair {
                old: a.parse::<GpuUuid>().ok()?,
                new: b.parse::<GpuUuid>().ok()?,
            })
        })
        .collect()
}
