//! A lease kept alive by a thread of its own for as long as its guard lives, and revoked when the guard
//! drops (its keys go at once instead of after the TTL). A holder that dies stops refreshing it: after
//! the TTL etcd deletes its keys, which is how the others learn it is gone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{RecvTimeoutError, Sender};

use super::coord::{CoordError, CoordResult, Coordinator, LeaseId};

/// See the module documentation.
pub struct LeaseGuard {
    coord: Arc<dyn Coordinator>,
    id: LeaseId,
    lost: Arc<AtomicBool>,
    stop: Option<Sender<()>>,
    keeper: Option<JoinHandle<()>>,
}

impl LeaseGuard {
    /// Grants a lease of `ttl` and refreshes it every third of it.
    pub fn grant(coord: Arc<dyn Coordinator>, ttl: Duration) -> CoordResult<LeaseGuard> {
        let id = coord.grant(ttl)?;
        let lost = Arc::new(AtomicBool::new(false));
        let (stop, stopped) = crossbeam_channel::unbounded::<()>();
        let keeper = {
            let coord = Arc::clone(&coord);
            let lost = Arc::clone(&lost);
            std::thread::Builder::new()
                .name(format!("lease-{id:x}"))
                .spawn(move || {
                    let every = (ttl / 3).max(Duration::from_millis(100));
                    // A message or a closed channel both mean: stop.
                    while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(every) {
                        match coord.keep_alive(id) {
                            Ok(()) => {}
                            Err(CoordError::LeaseLost(_)) => {
                                tracing::error!(
                                    "etcd lease {id:x} expired: this process's keys are gone"
                                );
                                lost.store(true, Ordering::SeqCst);
                                return;
                            }
                            // etcd unreachable for a moment: the next try may work before the TTL.
                            Err(e) => tracing::warn!("refreshing etcd lease {id:x}: {e}"),
                        }
                    }
                })
                .map_err(|e| CoordError::Request(format!("starting the lease keeper: {e}")))?
        };
        Ok(LeaseGuard {
            coord,
            id,
            lost,
            stop: Some(stop),
            keeper: Some(keeper),
        })
    }

    pub fn id(&self) -> LeaseId {
        self.id
    }

    /// The lease expired (a refresh came too late): keys put with it are gone.
    pub fn lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Stops refreshing without revoking: the keys stay until the TTL runs out, as if this process had
    /// died (fault tests).
    pub fn abandon(mut self) {
        self.stop_keeper();
        self.lost.store(true, Ordering::SeqCst);
    }

    fn stop_keeper(&mut self) {
        drop(self.stop.take());
        if let Some(k) = self.keeper.take() {
            let _ = k.join();
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        let abandoned = self.keeper.is_none();
        self.stop_keeper();
        if !abandoned {
            if let Err(e) = self.coord.revoke(self.id) {
                tracing::warn!("revoking etcd lease {:x}: {e}", self.id);
            }
        }
    }
}
