//! The in-memory test implementation of [`GpuDriver`]: the driver's state machine for any number of
//! pretend processes, with failures injected per process and operation, and a log of every call.
//! Used by unit tests of the lifecycle, the group logic and the flows; never chosen by `auto`.

use super::types::{CuError, GpuInfo, GpuPair, ProcessState};
use super::{sim, Error, GpuBackend, GpuDriver, Op, Result};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
struct Inner {
    states: HashMap<i32, ProcessState>,
    /// One-shot failures: the next `op` on `pid` fails with the code.
    next: HashMap<(i32, Op), CuError>,
    /// Sticky failures.
    always: HashMap<(i32, Op), CuError>,
    calls: Vec<(i32, Op)>,
    delay: Option<Duration>,
}

#[derive(Default)]
pub struct FakeDriver {
    inner: Mutex<Inner>,
}

impl FakeDriver {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Adds a CUDA process in RUNNING.
    pub fn add(&self, pid: i32) {
        self.with(|i| i.states.insert(pid, ProcessState::Running));
    }

    pub fn fail_next(&self, pid: i32, op: Op, code: CuError) {
        self.with(|i| i.next.insert((pid, op), code));
    }

    pub fn fail_always(&self, pid: i32, op: Op, code: CuError) {
        self.with(|i| i.always.insert((pid, op), code));
    }

    /// Every operation sleeps this long (to show that group operations overlap).
    pub fn set_delay(&self, d: Duration) {
        self.with(|i| i.delay = Some(d));
    }

    pub fn calls(&self) -> Vec<(i32, Op)> {
        self.with(|i| i.calls.clone())
    }

    /// Runs one transition: `from` -> `to`, with injected failures and the driver's ILLEGAL_STATE.
    fn transition(&self, pid: i32, op: Op, from: ProcessState, to: ProcessState) -> Result<()> {
        let delay = self.with(|i| {
            i.calls.push((pid, op));
            i.delay
        });
        if let Some(d) = delay {
            std::thread::sleep(d);
        }
        self.with(|i| {
            let injected = i
                .next
                .remove(&(pid, op))
                .or_else(|| i.always.get(&(pid, op)).copied());
            let state = *i
                .states
                .get(&pid)
                .ok_or(Error::cuda(op, pid, CuError::NotInitialized))?;
            if let Some(code) = injected {
                return Err(Error::cuda(op, pid, code));
            }
            if state != from {
                return Err(Error::Cuda {
                    op,
                    pid,
                    code: CuError::IllegalState,
                    detail: Some(format!("process is {state}, {op} needs {from}")),
                });
            }
            i.states.insert(pid, to);
            Ok(())
        })
    }
}

impl GpuDriver for FakeDriver {
    fn backend(&self) -> GpuBackend {
        GpuBackend::Fake
    }

    fn driver_version(&self) -> Option<String> {
        Some("fake".into())
    }

    fn state(&self, pid: i32) -> Result<ProcessState> {
        self.with(|i| {
            i.calls.push((pid, Op::State));
            i.states
                .get(&pid)
                .copied()
                .ok_or(Error::cuda(Op::State, pid, CuError::NotInitialized))
        })
    }

    fn lock(&self, pid: i32, _timeout: Option<Duration>) -> Result<()> {
        self.transition(pid, Op::Lock, ProcessState::Running, ProcessState::Locked)
    }

    fn checkpoint(&self, pid: i32) -> Result<()> {
        self.transition(
            pid,
            Op::Checkpoint,
            ProcessState::Locked,
            ProcessState::Checkpointed,
        )
    }

    fn restore(&self, pid: i32, _pairs: &[GpuPair]) -> Result<()> {
        self.transition(
            pid,
            Op::Restore,
            ProcessState::Checkpointed,
            ProcessState::Locked,
        )
    }

    fn unlock(&self, pid: i32) -> Result<()> {
        self.transition(pid, Op::Unlock, ProcessState::Locked, ProcessState::Running)
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32> {
        self.state(pid).map(|_| pid)
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>> {
        Ok(sim::sim_gpus())
    }
}
