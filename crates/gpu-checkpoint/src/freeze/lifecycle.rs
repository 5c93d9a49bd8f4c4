//! A process's GPU state machine in types.
//!
//! ```text
//!   Running --lock--> Locked --checkpoint--> Checkpointed
//!      ^                 |  ^                     |
//!      +-----unlock------+  +-------restore-------+
//! ```
//!
//! Each handle only offers the moves the driver allows from its state, and consumes itself: a
//! `Checkpointed` cannot be unlocked, a `Running` cannot be checkpointed. A failed move gives the handle
//! back ([`Failed`]) in the state the driver leaves a process in after that failure (a timed-out lock
//! leaves it RUNNING, a failed checkpoint LOCKED, a failed restore CHECKPOINTED), so undo code is typed too.

use super::types::{GpuPair, ProcessState};
use super::{Error, GpuDriver, Result};
use std::sync::Arc;
use std::time::Duration;

/// A move that did not happen: the handle, unchanged, and why.
pub struct Failed<H> {
    pub handle: H,
    pub error: Error,
}

impl<H> std::fmt::Debug for Failed<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Failed({})", self.error)
    }
}

macro_rules! handle {
    ($name:ident, $doc:literal) => {
        #[doc = $doc]
        pub struct $name {
            driver: Arc<dyn GpuDriver>,
            pid: i32,
        }

        impl $name {
            pub fn pid(&self) -> i32 {
                self.pid
            }

            pub fn driver(&self) -> &Arc<dyn GpuDriver> {
                &self.driver
            }

            /// A handle for a process whose state the caller has just established (a state query of
            /// the whole group, or a CRIU restore that brings processes back CHECKPOINTED).
            #[allow(dead_code)] // generated for every state; the flows use some of them
            pub(crate) fn assume(driver: Arc<dyn GpuDriver>, pid: i32) -> Self {
                $name { driver, pid }
            }

            fn fail<T>(self, error: Error) -> std::result::Result<T, Failed<Self>> {
                Err(Failed {
                    handle: self,
                    error,
                })
            }

            /// What the driver answered to a move: the handle of the state it led `to`, or this one back.
            fn moved<T>(
                self,
                answer: Result<()>,
                to: fn(Arc<dyn GpuDriver>, i32) -> T,
            ) -> std::result::Result<T, Failed<Self>> {
                match answer {
                    Ok(()) => Ok(to(self.driver, self.pid)),
                    Err(e) => self.fail(e),
                }
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({})", stringify!($name), self.pid)
            }
        }
    };
}

handle!(Running, "A CUDA process whose GPU work runs.");
handle!(
    Locked,
    "A CUDA process whose GPU work is blocked and drained; its device memory is still on the GPU."
);
handle!(
    Checkpointed,
    "A CUDA process whose device memory is in its host memory and whose GPU references are released: \
     CRIU can dump it now."
);

/// What a state query found, as a handle that allows exactly the legal moves.
#[derive(Debug)]
pub enum GpuProcess {
    Running(Running),
    Locked(Locked),
    Checkpointed(Checkpointed),
    /// FAILED, or an operation in progress (13.4 custom storage): nothing can be done from here.
    Other {
        pid: i32,
        state: ProcessState,
    },
}

impl GpuProcess {
    /// Asks the driver where `pid` stands.
    pub fn observe(driver: &Arc<dyn GpuDriver>, pid: i32) -> Result<Self> {
        let driver = Arc::clone(driver);
        Ok(match driver.state(pid)? {
            ProcessState::Running => GpuProcess::Running(Running { driver, pid }),
            ProcessState::Locked => GpuProcess::Locked(Locked { driver, pid }),
            ProcessState::Checkpointed => GpuProcess::Checkpointed(Checkpointed { driver, pid }),
            state => GpuProcess::Other { pid, state },
        })
    }

    pub fn state(&self) -> ProcessState {
        match self {
            GpuProcess::Running(_) => ProcessState::Running,
            GpuProcess::Locked(_) => ProcessState::Locked,
            GpuProcess::Checkpointed(_) => ProcessState::Checkpointed,
            GpuProcess::Other { state, .. } => *state,
        }
    }
}

impl Running {
    /// RUNNING -> LOCKED, waiting at most `timeout` for submitted work (`None`: no limit).
    pub fn lock(self, timeout: Option<Duration>) -> std::result::Result<Locked, Failed<Self>> {
        let answer = self.driver.lock(self.pid, timeout);
        self.moved(answer, Locked::assume)
    }
}

impl Locked {
    /// LOCKED -> CHECKPOINTED.
    pub fn checkpoint(self) -> std::result::Result<Checkpointed, Failed<Self>> {
        let answer = self.driver.checkpoint(self.pid);
        self.moved(answer, Checkpointed::assume)
    }

    /// LOCKED -> RUNNING.
    pub fn unlock(self) -> std::result::Result<Running, Failed<Self>> {
        let answer = self.driver.unlock(self.pid);
        self.moved(answer, Running::assume)
    }

    pub fn restore_thread_id(&self) -> Result<i32> {
        self.driver.restore_thread_id(self.pid)
    }
}

impl Checkpointed {
    /// CHECKPOINTED -> LOCKED, onto the GPUs `pairs` name (empty: the same GPUs).
    pub fn restore(self, pairs: &[GpuPair]) -> std::result::Result<Locked, Failed<Self>> {
        let answer = self.driver.restore(self.pid, pairs);
        self.moved(answer, Locked::assume)
    }

    pub fn restore_thread_id(&self) -> Result<i32> {
        self.driver.restore_thread_id(self.pid)
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeDriver;
    use super::super::CuError;
    use super::*;

    #[test]
    fn the_full_cycle_moves_through_every_state() {
        let d = Arc::new(FakeDriver::new());
        d.add(10);
        let dd: Arc<dyn GpuDriver> = d.clone();
        let GpuProcess::Running(r) = GpuProcess::observe(&dd, 10).unwrap() else {
            panic!("a new process runs");
        };
        let l = r.lock(Some(Duration::from_secs(1))).unwrap();
        assert_eq!(d.state(10).unwrap(), ProcessState::Locked);
        let c = l.checkpoint().unwrap();
        assert_eq!(d.state(10).unwrap(), ProcessState::Checkpointed);
        let l = c.restore(&[]).unwrap();
        let r = l.unlock().unwrap();
        assert_eq!(r.pid(), 10);
        assert_eq!(d.state(10).unwrap(), ProcessState::Running);
    }

    #[test]
    fn a_failed_move_hands_back_the_same_state() {
        let d = Arc::new(FakeDriver::new());
        d.add(11);
        d.fail_next(11, super::super::Op::Lock, CuError::NotReady);
        let dd: Arc<dyn GpuDriver> = d.clone();
        let GpuProcess::Running(r) = GpuProcess::observe(&dd, 11).unwrap() else {
            panic!()
        };
        let failed = r.lock(None).unwrap_err();
        assert_eq!(failed.error.cu_error(), Some(CuError::NotReady));
        // Still a Running handle: the only thing it can do is try to lock again.
        let l = failed.handle.lock(None).unwrap();
        assert_eq!(l.pid(), 11);
    }

    #[test]
    fn observe_gives_the_handle_of_the_current_state() {
        let d = Arc::new(FakeDriver::new());
        d.add(12);
        d.lock(12, None).unwrap();
        let dd: Arc<dyn GpuDriver> = d.clone();
        assert!(matches!(
            GpuProcess::observe(&dd, 12).unwrap(),
            GpuProcess::Locked(_)
        ));
        d.checkpoint(12).unwrap();
        assert_eq!(
            GpuProcess::observe(&dd, 12).unwrap().state(),
            ProcessState::Checkpointed
        );
    }
}
