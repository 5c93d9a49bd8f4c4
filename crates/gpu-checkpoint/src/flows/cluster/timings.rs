//! The coordinator's timings bookkeeping: how long each phase of a job operation took, how much of it
//! was the coordinator's own etcd requests, and what the members reported of their work. Kept apart
//! from the protocol (`job.rs`) so that the benchmark's breakdown can grow without touching it.

use std::cell::Cell;
use std::collections::BTreeMap;
use std::time::Instant;

use super::records::MemberState;
use super::JobTimings;
use crate::flows::ms;

/// The time spent in the coordinator's etcd requests (not in watches, which wait for the members):
/// the protocol's own round trips, in milliseconds.
#[derive(Debug, Default)]
pub(super) struct EtcdTime(Cell<f64>);

impl EtcdTime {
    /// Runs `f` (an etcd request) and counts its time.
    pub(super) fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.0.set(self.0.get() + ms(t));
        r
    }

    pub(super) fn ms(&self) -> f64 {
        self.0.get()
    }
}

/// A job operation's timings as they are taken: the operation's start, the current phase's start, and
/// the [`JobTimings`] filled in phase by phase.
#[derive(Debug)]
pub(super) struct Clock {
    started: Instant,
    phase: Instant,
    pub(super) timings: JobTimings,
}

impl Clock {
    /// The operation starts now.
    pub(super) fn start() -> Clock {
        let now = Instant::now();
        Clock {
            started: now,
            phase: now,
            timings: JobTimings::default(),
        }
    }

    /// A phase starts now.
    pub(super) fn phase(&mut self) {
        self.phase = Instant::now();
    }

    /// The milliseconds since the current phase started.
    pub(super) fn lap(&self) -> f64 {
        ms(self.phase)
    }

    /// Takes the members' own figures from their `done` states: the slowest member's work (its part
    /// less its waits at the barriers), the longest wait, the largest etcd time.
    pub(super) fn members_done(&mut self, states: &BTreeMap<u32, MemberState>) {
        let t = &mut self.timings;
        for s in states.values() {
            if let MemberState::Done {
                work_ms,
                waited_ms,
                etcd_ms,
            } = s
            {
                t.member_work_max = t.member_work_max.max(*work_ms - *waited_ms);
                t.member_waited_max = t.member_waited_max.max(*waited_ms);
                t.member_etcd_max = t.member_etcd_max.max(*etcd_ms);
            }
        }
    }

    /// The operation ended: its total, the coordinator's etcd time and the barriers' figures (barrier
    /// skew, watch wake-ups) summed over its waits.
    pub(super) fn finish(mut self, etcd: &EtcdTime, barriers: (f64, f64)) -> JobTimings {
        self.timings.total = ms(self.started);
        self.timings.etcd = etcd.ms();
        (self.timings.barrier_skew, self.timings.watch_wake) = barriers;
        self.timings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slowest_members_figures_are_taken_from_their_done_states() {
        let mut clock = Clock::start();
        let states = BTreeMap::from([
            (
                0,
                MemberState::Done {
                    work_ms: 100.0,
                    waited_ms: 60.0,
                    etcd_ms: 3.0,
                },
            ),
            (
                1,
                MemberState::Done {
                    work_ms: 90.0,
                    waited_ms: 20.0,
                    etcd_ms: 5.0,
                },
            ),
            (2, MemberState::Aborted),
        ]);
        clock.members_done(&states);
        let etcd = EtcdTime::default();
        etcd.time(|| ());
        let t = clock.finish(&etcd, (7.0, 2.0));
        assert_eq!(t.member_work_max, 70.0);
        assert_eq!(t.member_waited_max, 60.0);
        assert_eq!(t.member_etcd_max, 5.0);
        assert_eq!((t.barrier_skew, t.watch_wake), (7.0, 2.0));
        assert!(t.total >= t.etcd);
    }
}
