//! gpu-sim-workload: a SIMULATED GPU process, for tests and demos on machines without a GPU.
//!
//! It behaves towards gpu-checkpoint the way a CUDA process behaves towards the driver:
//! * "device memory" is a `MAP_SHARED` mapping of `/dev/shm/gpu-checkpoint-sim/<pid>-dev<N>` (the
//!   simulated device), one per simulated GPU;
//! * worker threads keep running "kernels" on it: deterministic writes, so the content is a function of
//!   the per-worker step counters and can be verified at any time (`VERIFY`);
//! * a control channel, the abstract UNIX socket `@gpu-checkpoint-sim/<pid>`, answers the driver's
//!   checkpoint calls with its state machine and result codes: `STATE`, `LOCK <ms>`, `CHECKPOINT`,
//!   `RESTORE [old=new,...]`, `UNLOCK`, `RESTORE_TID`, plus `STATUS`, `VERIFY`, `FAULT <names|none>`;
//! * LOCK blocks new kernels and waits for the ones in flight, up to the timeout (then NOT_READY, and the
//!   process keeps running); CHECKPOINT copies device memory into ordinary process memory, replaces the
//!   device mapping with an inaccessible reservation and deletes the device file, so CRIU dumps plain
//!   memory; RESTORE maps a new device file at the same addresses and copies the contents back.
//! * faults can be injected at each step: `--fault NAME` (repeatable), `GPU_SIM_FAULTS=a,b`, the control
//!   message `FAULT a,b`, or the file named by `GPU_SIM_FAULT_FILE` (read at every call, so it reaches a
//!   copy restored by CRIU). Names: `lock-timeout`, `checkpoint`, `restore`, `restore-oom`.
//! * `GPU_SIM_EVENT_FILE=PATH`: every driver call (LOCK, CHECKPOINT, RESTORE, UNLOCK) appends `PID CALL
//!   begin` and `PID CALL OK|ERR` to PATH, so tests see the order of the calls across processes
//!   (`GPU_SIM_EVENT_TAG`, if set, in place of the PID: for processes in containers).
//!
//! Options (`--help`): [`options::Options`]; tests, scripts and docs start it as
//! `gpu-sim-workload --daemon --mib 64 --children 2`.
//!
//! Modules, one job each: [`options`] (the command line), [`content`] (what device memory must hold),
//! [`device`] (mapping and releasing device memory), [`sim`] (workers and the checkpoint state machine),
//! [`protocol`] (the control socket's requests and answers), [`process`] (daemon, process tree, ready
//! pipe, signals), [`lockstep`] (`--peers`: the ranks of a job computing in lockstep over TCP).
//! This file puts one simulated GPU process together.

mod content;
mod device;
mod lockstep;
mod options;
mod process;
mod protocol;
mod sim;

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use content::initial_word;
use device::{map_device, Device, SHM_DIR, UUID_PREFIX};
use options::Options;
use process::ReadyFd;
use sim::Sim;

/// Exits 2 with `msg` on stderr: bad arguments, and failures to start (the launcher and the tests see
/// a process that did not start the same way).
fn fatal(msg: &str) -> ! {
    eprintln!("gpu-sim-workload (SIMULATED GPU): {msg}");
    std::process::exit(2)
}

fn main() {
    let o = Options::from_env();
    let ready = o.daemon.then(|| process::daemonize(o.log.as_deref()));
    // Fork the children before any thread exists.
    let total = o.children + o.cpu_children + o.idle_children;
    let children = process::fork_children(total, |i, ready| {
        if i < o.children {
            run_gpu_process(&o, o.no_context, Vec::new(), Some(ready))
        } else if i < o.children + o.idle_children {
            run_gpu_process(&o, true, Vec::new(), Some(ready))
        } else {
            process::run_cpu_child(ready)
        }
    });
    if let Some(p) = &o.pidfile {
        process::write_pidfile(p);
    }
    run_gpu_process(&o, o.no_context, children, ready);
}

/// Sets up this process's simulated GPU and serves the control channel for ever.
fn run_gpu_process(o: &Options, no_context: bool, children: Vec<i32>, ready: Option<ReadyFd>) -> ! {
    let pid = std::process::id();
    let bytes = o.mib << 20;
    if let Err(e) = std::fs::create_dir_all(SHM_DIR) {
        fatal(&format!("cannot create {SHM_DIR}: {e}"));
    }
    let mut devices = Vec::new();
    // A process that only loaded the library has no device memory: just the control channel.
    let device_count = if no_context { 0 } else { o.devices };
    for d in 0..device_count {
        let path = format!("{SHM_DIR}/{pid}-dev{d}");
        let range = map_device(&path, bytes, None).unwrap_or_else(|(_, m)| fatal(&m));
        // SAFETY: a fresh mapping; no worker runs yet.
        for (i, w) in unsafe { range.all_mut() }.iter_mut().enumerate() {
            *w = initial_word(d, i);
        }
        devices.push(Device {
            range,
            path,
            uuid: format!("{UUID_PREFIX}0000-0000-0000-0000{:08x}", d),
            host: None,
        });
    }
    process::delete_on_terminate(devices.iter().map(|d| d.path.as_str()));
    let listener = protocol::bind(pid).unwrap_or_else(|e| fatal(&e));
    let sim = Arc::new(Sim::new(
        devices,
        bytes,
        o.workers,
        Duration::from_micros(o.kernel_us),
        o.faults.clone(),
        no_context,
        children,
    ));
    let _ = sim.control_tid.set(process::gettid());
    // A lockstep rank's one worker is its steps' kernel (lockstep.rs), not a free-running one.
    let lockstep = (!no_context && !o.peers.is_empty()).then(|| {
        let l = lockstep::Lockstep::new(o.rank, o.peers.clone(), sim.checksums());
        l.start(Arc::clone(&sim)).unwrap_or_else(|e| fatal(&e));
        l
    });
    if !no_context && lockstep.is_none() {
        for w in 0..o.workers {
            let s = Arc::clone(&sim);
            std::thread::spawn(move || s.worker(w));
        }
    }
    println!(
        "gpu-sim-workload: SIMULATED GPU process pid={pid} devices={} x {} MiB workers={} (not a real GPU)",
        o.devices, o.mib, o.workers
    );
    let _ = std::io::stdout().flush();
    if let Some(fd) = ready {
        process::notify_ready(fd);
    }
    protocol::serve(&listener, &sim, lockstep.as_deref())
}
