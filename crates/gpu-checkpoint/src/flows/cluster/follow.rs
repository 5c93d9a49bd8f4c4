//! A member's view of its operation (the agent's side): the operation's record, the coordinator's
//! decision and the members' states, kept current from one watch of the operation's keys that stays
//! open for the member's whole part ([`Coordinator::watch_stream`]). The decision arrives in the
//! watch's events, and so do the other members' states (an ordered operation's turn). Each wait used
//! to read the operation again and open a new watch, and again on every wake-up that brought only
//! another member's state: two requests per barrier and up to one more per other member, each queued
//! behind the members' work on a loaded node.

use std::collections::BTreeMap;
use std::time::Duration;

use super::coord::{CoordResult, Coordinator, Event, Revision, WatchStream};
use super::records::{self as rec, decode, MemberState, StateRecord};

pub(super) struct OpView<'c> {
    coord: &'c dyn Coordinator,
    prefix: String,
    op_key: String,
    decision_key: String,
    states_prefix: String,
    /// Opened at the first wait, from `rev`; opened again (from a new read) if it breaks.
    stream: Option<Box<dyn WatchStream + 'c>>,
    /// The revision the view is current to: changes up to it are in, older events are skipped.
    rev: Revision,
    /// The operation's record exists (its coordinator's lease lives, the operation is not ended).
    pub(super) exists: bool,
    /// The coordinator's decision (`go`, `commit`, `abort`), if written.
    pub(super) decision: Option<Vec<u8>>,
    states: BTreeMap<u32, MemberState>,
}

impl<'c> OpView<'c> {
    /// Operation `op` as the transaction that created it and its tasks left it, at revision `created`:
    /// its record, no decision, no member's state. Nothing is read: the watch from there brings the
    /// rest, in order.
    pub(super) fn at_start(coord: &'c dyn Coordinator, op: &str, created: Revision) -> Self {
        OpView {
            coord,
            prefix: rec::op_prefix(op),
            op_key: rec::op(op),
            decision_key: rec::decision(op),
            states_prefix: rec::states(op),
            stream: None,
            rev: created,
            exists: true,
            decision: None,
            states: BTreeMap::new(),
        }
    }

    /// Member `rank`'s state, if it wrote one.
    pub(super) fn state(&self, rank: u32) -> Option<&MemberState> {
        self.states.get(&rank)
    }

    /// Waits up to `timeout` for changes and applies them. A watch that stays quiet for all of
    /// `timeout` is followed by a read of the operation (one request): a node cut off from etcd sees
    /// no error on an open stream, only silence, and must learn that etcd is out of reach (the error
    /// returned). A broken stream is read past and opened again.
    pub(super) fn next(&mut self, timeout: Duration) -> CoordResult<()> {
        if self.stream.is_none() {
            self.stream = Some(self.coord.watch_stream(&self.prefix, self.rev)?);
        }
        let got = self.stream.as_mut().expect("opened above").next(timeout);
        match got {
            Ok(events) if !events.is_empty() => self.apply(&events),
            Ok(_) => self.read(),
            Err(e) => {
                tracing::debug!("the watch of {} broke ({e}); reading it again", self.prefix);
                self.stream = None;
                self.read()
            }
        }
    }

    /// The operation as etcd has it now (one range request).
    fn read(&mut self) -> CoordResult<()> {
        let (kvs, rev) = self.coord.range(&self.prefix)?;
        self.exists = kvs.iter().any(|kv| kv.key == self.op_key);
        self.decision = kvs
            .iter()
            .find(|kv| kv.key == self.decision_key)
            .map(|kv| kv.value.clone());
        self.states.clear();
        for kv in kvs
            .iter()
            .filter(|kv| kv.key.starts_with(&self.states_prefix))
        {
            let s: StateRecord = decode(&kv.key, &kv.value)?;
            self.states.insert(s.rank, s.state);
        }
        self.rev = self.rev.max(rev);
        Ok(())
    }

    /// Applies changes in their order; those the view has already (from a read) are skipped.
    fn apply(&mut self, events: &[Event]) -> CoordResult<()> {
        for e in events {
            if e.revision() <= self.rev {
                continue;
            }
            let key = e.key();
            let value = match e {
                Event::Put(kv) => Some(&kv.value),
                Event::Delete { .. } => None,
            };
            if key == self.op_key {
                self.exists = value.is_some();
            } else if key == self.decision_key {
                self.decision = value.cloned();
            } else if let Some(rank) = key.strip_prefix(&self.states_prefix) {
                match value {
                    Some(v) => {
                        let s: StateRecord = decode(key, v)?;
                        self.states.insert(s.rank, s.state);
                    }
                    None => {
                        if let Ok(rank) = rank.parse::<u32>() {
                            self.states.remove(&rank);
                        }
                    }
                }
            }
            self.rev = e.revision();
        }
        Ok(())
    }
}
