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
    /// When (ms since the epoch) the tasks went out, and `go` and `commit` were written: the members'
    /// reports of when they learnt of them are measured from these.
    pub(super) sent_unix_ms: u64,
    pub(super) go_unix_ms: u64,
    pub(super) commit_unix_ms: u64,
}

impl Clock {
    /// The operation starts now.
    pub(super) fn start() -> Clock {
        let now = Instant::now();
        Clock {
            started: now,
            phase: now,
            timings: JobTimings::default(),
            sent_unix_ms: 0,
            go_unix_ms: 0,
            commit_unix_ms: 0,
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
    /// less its waits at the barriers), the longest wait, the largest etcd time, and the latest task
    /// pick-up and decision deliveries (each from the coordinator's time of sending it).
    pub(super) fn members_done(&mut self, states: &BTreeMap<u32, MemberState>) {
        let t = &mut self.timings;
        // Members' clocks against the coordinator's: 0 where either is unknown.
        let after = |seen: u64, sent: u64| match (seen, sent) {
            (0, _) | (_, 0) => 0.0,
            _ => seen.saturating_sub(sent) as f64,
        };
        for s in states.values() {
            if let MemberState::Done {
                work_ms,
                waited_ms,
                etcd_ms,
                picked_up_unix_ms,
                saw_go_unix_ms,
                saw_commit_unix_ms,
            } = s
            {
                t.member_work_max = t.member_work_max.max(*work_ms - *waited_ms);
                t.member_waited_max = t.member_waited_max.max(*waited_ms);
                t.member_etcd_max = t.member_etcd_max.max(*etcd_ms);
                let pickup = after(*picked_up_unix_ms, self.sent_unix_ms);
                t.task_pickup = t.task_pickup.max(pickup);
                t.go_delivery = t.go_delivery.max(after(*saw_go_unix_ms, self.go_unix_ms));
                let commit = after(*saw_commit_unix_ms, self.commit_unix_ms);
                t.commit_delivery = t.commit_delivery.max(commit);
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
        (clock.sent_unix_ms, clock.go_unix_ms, clock.commit_unix_ms) = (1000, 2000, 3000);
        let done = |work_ms, waited_ms, etcd_ms, seen: [u64; 3]| MemberState::Done {
            work_ms,
            waited_ms,
            etcd_ms,
            picked_up_unix_ms: seen[0],
            saw_go_unix_ms: seen[1],
            saw_commit_unix_ms: seen[2],
        };
        let states = BTreeMap::from([
            (0, done(100.0, 60.0, 3.0, [1004, 2001, 3009])),
            (1, done(90.0, 20.0, 5.0, [1002, 2007, 3001])),
            // An older agent's: nothing known.
            (3, done(10.0, 5.0, 1.0, [0, 0, 0])),
            (2, MemberState::Aborted),
        ]);
        clock.members_done(&states);
        let t = &clock.timings;
        assert_eq!(
            (t.task_pickup, t.go_delivery, t.commit_delivery),
            (4.0, 7.0, 9.0)
        );
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
