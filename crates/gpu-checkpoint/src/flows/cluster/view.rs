//! The coordinator's view of an operation's members: their states and which agents are alive. It is read
//! once (two ranges) and then kept current from the changes a watch reports, so that waiting for N
//! members costs a constant number of etcd requests, where reading both prefixes again on every change
//! cost two round trips per member and step (the coordinator's etcd time grew with the job's size). The
//! watch is opened once and stays open for the operation: a watch opened again at each wake-up put its
//! opening's round trip between one member's state and the next.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::coord::{CoordError, Coordinator, Event, Revision, WatchStream};
use super::records::{self as rec, decode, MemberState, StateRecord};

pub(super) struct View<'a> {
    coord: &'a dyn Coordinator,
    /// One watch of the root (the states and the agents' registrations), from the first wait on.
    stream: Option<Box<dyn WatchStream + 'a>>,
    states_prefix: String,
    /// The members' states, by key (a delete names only the key).
    states: BTreeMap<String, StateRecord>,
    /// The keys of the agents registered (their leases alive).
    agents: BTreeSet<String>,
    /// The revision the view is current to: a watch from there misses nothing.
    rev: Revision,
    /// Summed over the waits: barrier skew and watch wake-up (see [`super::JobTimings`]).
    pub(super) skew_ms: f64,
    pub(super) wake_ms: f64,
}

impl<'a> View<'a> {
    /// Reads operation `id`'s member states and the agents.
    pub(super) fn read(coord: &'a dyn Coordinator, id: &str) -> Result<View<'a>, CoordError> {
        let states_prefix = rec::states(id);
        let (states, rev) = coord.range(&states_prefix)?;
        // Read after the states: a change to the agents between the two reads is replayed by the watch
        // (from the first read's revision) over a newer read, which leaves each key at its last value.
        let (agents, _) = coord.range(&rec::agents())?;
        let mut view = View {
            coord,
            stream: None,
            states_prefix,
            states: BTreeMap::new(),
            agents: agents.into_iter().map(|kv| kv.key).collect(),
            rev,
            skew_ms: 0.0,
            wake_ms: 0.0,
        };
        for kv in states {
            view.states
                .insert(kv.key.clone(), decode(&kv.key, &kv.value)?);
        }
        Ok(view)
    }

    /// Waits up to `wait` for changes and applies them. A broken watch is the error, and the next
    /// call opens it again from where the view is.
    pub(super) fn next(&mut self, wait: Duration) -> Result<(), CoordError> {
        if self.stream.is_none() {
            self.stream = Some(self.coord.watch_stream(rec::ROOT, self.rev)?);
        }
        match self.stream.as_mut().expect("opened above").next(wait) {
            Ok(events) => self.apply(&events),
            Err(e) => {
                self.stream = None;
                Err(e)
            }
        }
    }

    /// Applies changes the watch reported, in their order.
    fn apply(&mut self, events: &[Event]) -> Result<(), CoordError> {
        for e in events {
            let key = e.key();
            if key.starts_with(&self.states_prefix) {
                match e {
                    Event::Put(kv) => {
                        self.states
                            .insert(kv.key.clone(), decode(&kv.key, &kv.value)?);
                    }
                    Event::Delete { key, .. } => {
                        self.states.remove(key);
                    }
                }
            } else if key.starts_with(&rec::agents()) {
                match e {
                    Event::Put(kv) => self.agents.insert(kv.key.clone()),
                    Event::Delete { key, .. } => self.agents.remove(key),
                };
            }
            self.rev = self.rev.max(e.revision());
        }
        Ok(())
    }

    /// Whether `node`'s agent is registered.
    pub(super) fn alive(&self, node: &str) -> bool {
        self.agents.contains(&rec::agent(node))
    }

    /// Every one of `ranks` reached the state waited for: adds the time from the first to the last
    /// writing it (members' clocks) to `skew_ms`, and from the last write until now to `wake_ms`.
    pub(super) fn arrived(&mut self, ranks: BTreeSet<u32>) {
        let times = self.states.values().filter(|s| ranks.contains(&s.rank));
        let times: Vec<u64> = times.map(|s| s.at_unix_ms).collect();
        if let (Some(first), Some(last)) = (times.iter().min(), times.iter().max()) {
            self.skew_ms += (last - first) as f64;
            self.wake_ms += rec::now_ms().saturating_sub(*last) as f64;
        }
    }

    /// The members' states, by rank.
    pub(super) fn by_rank(&self) -> BTreeMap<u32, MemberState> {
        self.states
            .values()
            .map(|s| (s.rank, s.state.clone()))
            .collect()
    }
}
