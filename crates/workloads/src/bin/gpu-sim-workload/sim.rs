//! The simulated driver: the worker threads that run "kernels" on device memory, and the checkpoint
//! state machine (running -> locked -> checkpointed -> locked -> running) with the driver's result codes.
//! One module because the two share one lock and one rule: device memory is touched by a worker only while
//! its kernel is in flight, and by the control thread only while none can be.
//!
//! Each request answers the line the control channel sends back (`OK ...` or `ERR <CUresult> ...`).

use std::collections::BTreeSet;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::content::{kernel_word, Geometry, BLOCK_WORDS};
use crate::device::{checksum, map_device, release_device, Device, DeviceRange, UUID_PREFIX};
use crate::options::fault_names;
use crate::protocol::{
    err, parse_gpu_pairs, ILLEGAL_STATE, INVALID_DEVICE, INVALID_VALUE, NOT_READY, NOT_SUPPORTED,
    OPERATING_SYSTEM, OUT_OF_MEMORY,
};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum State {
    Running,
    Locked,
    Checkpointed,
    Failed,
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            State::Running => "running",
            State::Locked => "locked",
            State::Checkpointed => "checkpointed",
            State::Failed => "failed",
        }
    }
}

pub struct Inner {
    pub state: State,
    /// A lock (or a VERIFY) is waiting: no new kernels start.
    draining: bool,
    in_flight: usize,
    steps: Vec<u64>,
    devices: Vec<Device>,
    pub faults: BTreeSet<String>,
}

impl Inner {
    /// ILLEGAL_STATE, as the driver answers a call made out of order, unless the process is `needed`.
    fn expect(&self, needed: State, call: &str) -> Result<(), String> {
        if self.state == needed {
            return Ok(());
        }
        Err(err(
            ILLEGAL_STATE,
            format!(
                "process is {}, {call} needs {}",
                self.state.name(),
                needed.name()
            ),
        ))
    }
}

pub struct Sim {
    inner: Mutex<Inner>,
    cv: Condvar,
    geometry: Geometry,
    kernel: Duration,
    /// A process that only loaded the library: no context, so the driver refuses almost everything.
    pub no_context: bool,
    /// The thread that serves the control channel (`RESTORE_TID`).
    pub control_tid: OnceLock<i32>,
    children: Vec<i32>,
}

impl Sim {
    /// A simulator running `workers` workers on `devices` of `bytes` bytes each.
    pub fn new(
        devices: Vec<Device>,
        bytes: usize,
        workers: usize,
        kernel: Duration,
        faults: BTreeSet<String>,
        no_context: bool,
        children: Vec<i32>,
    ) -> Self {
        Sim {
            inner: Mutex::new(Inner {
                state: State::Running,
                draining: false,
                in_flight: 0,
                steps: vec![0; workers],
                devices,
                faults,
            }),
            cv: Condvar::new(),
            geometry: Geometry::new(bytes, workers),
            kernel,
            no_context,
            control_tid: OnceLock::new(),
            children,
        }
    }

    pub fn lock_inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether fault `name` is set (from memory or the fault file), for the control channel.
    pub fn fault(&self, name: &str) -> bool {
        self.has_fault(&self.lock_inner(), name)
    }

    /// Faults from memory, plus the fault file (re-read every call).
    fn has_fault(&self, g: &Inner, name: &str) -> bool {
        if g.faults.contains(name) {
            return true;
        }
        std::env::var("GPU_SIM_FAULT_FILE")
            .ok()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map(|s| fault_names(&s).iter().any(|f| f == name))
            .unwrap_or(false)
    }

    /// Worker `w`: runs one kernel after the other, for ever, while the state lets it.
    pub fn worker(&self, w: usize) {
        loop {
            self.kernel(w, |_| ());
        }
    }

    /// Worker `w` runs one kernel (waiting while the state does not let it start), then `after` on the
    /// devices' memory while the kernel still counts as in flight, so that a lock or a checkpoint
    /// waits for it. Returns the worker's new step count and what `after` returned.
    pub fn kernel<T>(&self, w: usize, after: impl FnOnce(&[DeviceRange]) -> T) -> (u64, T) {
        let (step, devs): (u64, Vec<DeviceRange>) = {
            let mut g = self.lock_inner();
            while g.state != State::Running || g.draining {
                g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
            }
            g.in_flight += 1;
            (g.steps[w], g.devices.iter().map(|d| d.range).collect())
        };
        let start = self.geometry.block_of(w, step) * BLOCK_WORDS;
        for (dev, range) in devs.iter().enumerate() {
            // SAFETY: the block is this worker's alone (`Geometry` gives each worker its own blocks),
            // and while this kernel is in flight nothing remaps or reads the device: lock, checkpoint,
            // STATUS and VERIFY drain the kernels first.
            let block = unsafe { range.words_mut(start..start + BLOCK_WORDS) };
            for (k, word) in block.iter_mut().enumerate() {
                *word = kernel_word(dev, start + k, w, step);
            }
        }
        // The kernel's run time: a lock has to wait for it.
        std::thread::sleep(self.kernel);
        let out = after(&devs);
        let mut g = self.lock_inner();
        g.steps[w] += 1;
        g.in_flight -= 1;
        if g.in_flight == 0 {
            self.cv.notify_all();
        }
        (g.steps[w], out)
    }

    /// Stops new kernels and waits for those in flight; `None` timeout waits for ever.
    fn drain<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        timeout: Option<Duration>,
    ) -> (MutexGuard<'a, Inner>, bool) {
        g.draining = true;
        let deadline = timeout.map(|t| Instant::now() + t);
        while g.in_flight > 0 {
            match deadline {
                None => g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        g.draining = false;
                        self.cv.notify_all();
                        return (g, false);
                    }
                    g = self
                        .cv
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
        (g, true)
    }

    pub fn lock(&self, arg: &str) -> String {
        let Ok(ms) = arg.parse::<u64>() else {
            return err(INVALID_VALUE, format!("bad timeout `{arg}`"));
        };
        let timeout = (ms > 0).then(|| Duration::from_millis(ms));
        let g = self.lock_inner();
        if let Err(e) = g.expect(State::Running, "lock") {
            return e;
        }
        if self.has_fault(&g, "lock-timeout") {
            // Injected: the work in flight never finishes within the timeout.
            drop(g);
            match timeout {
                Some(t) => std::thread::sleep(t),
                None => loop {
                    std::thread::sleep(Duration::from_millis(20));
                    if !self.has_fault(&self.lock_inner(), "lock-timeout") {
                        break;
                    }
                },
            }
            if timeout.is_some() {
                return err(
                    NOT_READY,
                    format!("in-flight work did not finish within {ms} ms (simulated fault)"),
                );
            }
            return self.lock(arg);
        }
        let (mut g, drained) = self.drain(g, timeout);
        if !drained {
            return err(
                NOT_READY,
                format!("in-flight work did not finish within {ms} ms"),
            );
        }
        g.state = State::Locked;
        g.draining = false;
        "OK".into()
    }

    pub fn checkpoint(&self) -> String {
        let mut g = self.lock_inner();
        if let Err(e) = g.expect(State::Locked, "checkpoint") {
            return e;
        }
        if self.has_fault(&g, "checkpoint") {
            return err(
                NOT_SUPPORTED,
                "simulated checkpoint failure (fault injected); the process stays locked",
            );
        }
        for d in g.devices.iter_mut() {
            // SAFETY: locked, so no kernel is in flight and none starts; the device is mapped.
            let host = unsafe { d.range.all() }.to_vec();
            if let Err(e) = release_device(d.range) {
                g.state = State::Failed;
                return err(OPERATING_SYSTEM, e);
            }
            let _ = std::fs::remove_file(&d.path);
            d.host = Some(host);
        }
        g.state = State::Checkpointed;
        "OK".into()
    }

    pub fn restore(&self, arg: &str) -> String {
        let mut g = self.lock_inner();
        if let Err(e) = g.expect(State::Checkpointed, "restore") {
            return e;
        }
        if self.has_fault(&g, "restore-oom") {
            return err(
                OUT_OF_MEMORY,
                "not enough simulated device memory (fault injected); still checkpointed",
            );
        }
        if self.has_fault(&g, "restore") {
            return err(
                OPERATING_SYSTEM,
                "simulated restore failure (fault injected); still checkpointed",
            );
        }
        // GPU pairs: when given, they must cover every device, and name simulated GPUs.
        let mut new_uuids: Vec<String> = g.devices.iter().map(|d| d.uuid.clone()).collect();
        let pairs = parse_gpu_pairs(arg);
        if !pairs.is_empty() {
            for (i, d) in g.devices.iter().enumerate() {
                match pairs
                    .iter()
                    .find(|(old, _)| *old == d.uuid.to_ascii_lowercase())
                {
                    None => {
                        return err(
                            INVALID_VALUE,
                            format!("the GPU pairs do not cover {}", d.uuid),
                        )
                    }
                    Some((_, new))
                        if !new
                            .to_ascii_uppercase()
                            .starts_with(&UUID_PREFIX.to_ascii_uppercase()) =>
                    {
                        return err(INVALID_DEVICE, format!("{new} is not a simulated GPU"))
                    }
                    Some((_, new)) => new_uuids[i] = new.clone(),
                }
            }
        }
        let mut done = Vec::new();
        for (i, d) in g.devices.iter().enumerate() {
            match map_device(&d.path, d.range.bytes(), Some(d.range)) {
                Ok(_) => done.push(i),
                Err((code, msg)) => {
                    // All or nothing: put back the reservations of the devices already mapped.
                    for &j in &done {
                        let dj = &g.devices[j];
                        let _ = release_device(dj.range);
                        let _ = std::fs::remove_file(&dj.path);
                    }
                    return err(code, msg);
                }
            }
        }
        for (d, uuid) in g.devices.iter_mut().zip(new_uuids) {
            if let Some(host) = d.host.take() {
                // SAFETY: checkpointed, so the workers are blocked; the device was mapped just above.
                unsafe { d.range.all_mut() }.copy_from_slice(&host);
            }
            d.uuid = uuid;
        }
        g.state = State::Locked;
        "OK".into()
    }

    pub fn unlock(&self) -> String {
        let mut g = self.lock_inner();
        if let Err(e) = g.expect(State::Locked, "unlock") {
            return e;
        }
        g.state = State::Running;
        self.cv.notify_all();
        "OK".into()
    }

    /// Runs `f` on each device's memory while no kernel is in flight.
    fn with_quiet_memory<T>(&self, f: impl Fn(&Inner, usize, &[u64]) -> T) -> Vec<T> {
        let g = self.lock_inner();
        let was_draining = g.draining;
        let (mut g, _) = self.drain(g, None);
        let out = g
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| match &d.host {
                Some(h) => f(&g, i, h),
                // SAFETY: drained: no kernel is in flight and none starts while we hold the lock; without
                // a host copy the device is mapped.
                None => f(&g, i, unsafe { d.range.all() }),
            })
            .collect();
        g.draining = was_draining;
        self.cv.notify_all();
        out
    }

    /// The devices' checksums, comma-separated (as `STATUS` lists them).
    pub fn checksums(&self) -> String {
        self.with_quiet_memory(|_, _, m| checksum(m)).join(",")
    }

    pub fn status(&self) -> String {
        let sums = self.with_quiet_memory(|_, _, m| checksum(m));
        let g = self.lock_inner();
        let list = |v: Vec<String>| v.join(",");
        format!(
            "OK simulated=yes state={} pid={} steps={} devices={} bytes={} checksums={} uuids={} files={} faults={} children={}",
            g.state.name(),
            std::process::id(),
            list(g.steps.iter().map(u64::to_string).collect()),
            g.devices.len(),
            g.devices.first().map_or(0, |d| d.range.bytes()),
            list(sums),
            list(g.devices.iter().map(|d| d.uuid.clone()).collect()),
            list(g.devices.iter().map(|d| d.path.clone()).collect()),
            if g.faults.is_empty() { "none".into() } else { list(g.faults.iter().cloned().collect()) },
            if self.children.is_empty() { "none".into() } else { list(self.children.iter().map(i32::to_string).collect()) },
        )
    }

    pub fn verify(&self) -> String {
        let geo = self.geometry;
        let results = self.with_quiet_memory(|g, dev, mem| {
            mem.iter()
                .enumerate()
                .find(|(i, w)| **w != geo.expected(dev, *i, &g.steps))
                .map(|(i, w)| {
                    format!(
                        "device {dev} word {i}: {w:#x} != expected {:#x}",
                        geo.expected(dev, i, &g.steps)
                    )
                })
        });
        let bad: Vec<String> = results.into_iter().flatten().collect();
        if bad.is_empty() {
            let g = self.lock_inner();
            format!(
                "OK verified {} device(s) at steps {:?}",
                g.devices.len(),
                g.steps
            )
        } else {
            err(
                OPERATING_SYSTEM,
                format!("device memory corrupt: {}", bad.join("; ")),
            )
        }
    }
}
