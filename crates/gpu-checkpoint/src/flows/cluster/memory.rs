//! The in-memory [`Coordinator`]: etcd's semantics that the protocol relies on (one revision counter,
//! leases deleting their keys on expiry, atomic transactions, watches from a revision), in one process,
//! for unit tests of the protocol. Tests expire a lease on purpose with [`MemoryCoordinator::expire`].

use std::collections::{BTreeMap, HashMap};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::coord::{
    Compare, CoordError, CoordResult, Coordinator, Event, Kv, LeaseId, Revision, TxnOp,
};

#[derive(Default)]
struct State {
    revision: Revision,
    keys: BTreeMap<String, (Vec<u8>, Revision, Option<LeaseId>)>,
    leases: HashMap<LeaseId, (Duration, Instant)>,
    next_lease: LeaseId,
    /// Every change, in order (tests are short: nothing is compacted).
    history: Vec<Event>,
}

impl State {
    fn put(&mut self, key: &str, value: &[u8], lease: Option<LeaseId>) -> CoordResult<()> {
        if let Some(l) = lease {
            if !self.leases.contains_key(&l) {
                return Err(CoordError::LeaseLost(l));
            }
        }
        self.revision += 1;
        self.keys
            .insert(key.to_string(), (value.to_vec(), self.revision, lease));
        self.history.push(Event::Put(Kv {
            key: key.to_string(),
            value: value.to_vec(),
            mod_revision: self.revision,
        }));
        Ok(())
    }

    fn delete(&mut self, key: &str) -> bool {
        if self.keys.remove(key).is_none() {
            return false;
        }
        self.revision += 1;
        self.history.push(Event::Delete {
            key: key.to_string(),
            revision: self.revision,
        });
        true
    }

    /// Ends `lease`, deleting its keys (as etcd does when it expires or is revoked).
    fn end_lease(&mut self, lease: LeaseId) {
        self.leases.remove(&lease);
        let keys: Vec<String> = self
            .keys
            .iter()
            .filter(|(_, (_, _, l))| *l == Some(lease))
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            self.delete(&k);
        }
    }

    fn expire_due(&mut self) {
        let now = Instant::now();
        let due: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, (_, deadline))| *deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for l in due {
            self.end_lease(l);
        }
    }
}

/// The in-memory coordination service; see the module documentation.
#[derive(Default)]
pub struct MemoryCoordinator {
    state: Mutex<State>,
    changed: Condvar,
}

impl MemoryCoordinator {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        g.expire_due();
        g
    }

    /// Expires `lease` now, as if its holder had died: its keys go, watchers see them go.
    pub fn expire(&self, lease: LeaseId) {
        self.lock().end_lease(lease);
        self.changed.notify_all();
    }

    /// The leases alive now.
    pub fn leases(&self) -> Vec<LeaseId> {
        self.lock().leases.keys().copied().collect()
    }
}

impl Coordinator for MemoryCoordinator {
    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> CoordResult<Revision> {
        let mut g = self.lock();
        g.put(key, value, lease)?;
        self.changed.notify_all();
        Ok(g.revision)
    }

    fn get(&self, key: &str) -> CoordResult<Option<Kv>> {
        Ok(self.lock().keys.get(key).map(|(v, rev, _)| Kv {
            key: key.to_string(),
            value: v.clone(),
            mod_revision: *rev,
        }))
    }

    fn range(&self, prefix: &str) -> CoordResult<(Vec<Kv>, Revision)> {
        let g = self.lock();
        let kvs = g
            .keys
            .range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, (v, rev, _))| Kv {
                key: k.clone(),
                value: v.clone(),
                mod_revision: *rev,
            })
            .collect();
        Ok((kvs, g.revision))
    }

    fn delete_prefix(&self, prefix: &str) -> CoordResult<u64> {
        let mut g = self.lock();
        let keys: Vec<String> = g
            .keys
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        for k in &keys {
            g.delete(k);
        }
        self.changed.notify_all();
        Ok(keys.len() as u64)
    }

    fn grant(&self, ttl: Duration) -> CoordResult<LeaseId> {
        let mut g = self.lock();
        g.next_lease += 1;
        let id = g.next_lease;
        g.leases.insert(id, (ttl, Instant::now() + ttl));
        Ok(id)
    }

    fn keep_alive(&self, lease: LeaseId) -> CoordResult<()> {
        let mut g = self.lock();
        match g.leases.get_mut(&lease) {
            Some((ttl, deadline)) => {
                *deadline = Instant::now() + *ttl;
                Ok(())
            }
            None => Err(CoordError::LeaseLost(lease)),
        }
    }

    fn revoke(&self, lease: LeaseId) -> CoordResult<()> {
        self.expire(lease);
        Ok(())
    }

    fn txn(&self, when: &[Compare], then: &[TxnOp]) -> CoordResult<bool> {
        let mut g = self.lock();
        let holds = when.iter().all(|c| match c {
            Compare::Exists(k) => g.keys.contains_key(k),
            Compare::Missing(k) => !g.keys.contains_key(k),
        });
        if !holds {
            return Ok(false);
        }
        for op in then {
            match op {
                TxnOp::Put { key, value, lease } => g.put(key, value, *lease)?,
                TxnOp::Delete(key) => {
                    g.delete(key);
                }
            }
        }
        self.changed.notify_all();
        Ok(true)
    }

    fn watch(&self, prefix: &str, after: Revision, timeout: Duration) -> CoordResult<Vec<Event>> {
        let deadline = Instant::now() + timeout;
        let mut g = self.lock();
        loop {
            let events: Vec<Event> = g
                .history
                .iter()
                .filter(|e| e.revision() > after && e.key().starts_with(prefix))
                .cloned()
                .collect();
            let now = Instant::now();
            if !events.is_empty() || now >= deadline {
                return Ok(events);
            }
            // Wake up at least every 50 ms: leases expire by the clock, not by a call.
            let wait = (deadline - now).min(Duration::from_millis(50));
            g = self
                .changed
                .wait_timeout(g, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            g.expire_due();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expired_lease_takes_its_keys_and_watchers_see_them_go() {
        let c = MemoryCoordinator::new();
        let lease = c.grant(Duration::from_millis(100)).unwrap();
        let rev = c.put("/a/x", b"1", Some(lease)).unwrap();
        c.put("/a/y", b"2", None).unwrap();
        assert_eq!(c.range("/a/").unwrap().0.len(), 2);
        let events = c.watch("/a/", rev, Duration::from_secs(5)).unwrap();
        assert!(
            matches!(&events[..], [Event::Put(kv)] if kv.key == "/a/y"),
            "{events:?}"
        );
        let after = events[0].revision();
        // Not refreshed: it expires by itself.
        let events = c.watch("/a/", after, Duration::from_secs(5)).unwrap();
        assert!(
            matches!(&events[..], [Event::Delete { key, .. }] if key == "/a/x"),
            "{events:?}"
        );
        assert!(c.get("/a/x").unwrap().is_none());
        assert!(matches!(c.keep_alive(lease), Err(CoordError::LeaseLost(_))));
        assert!(c.put("/a/z", b"3", Some(lease)).is_err());
    }

    #[test]
    fn a_transaction_applies_only_when_its_conditions_hold() {
        let c = MemoryCoordinator::new();
        let put = |k: &str| TxnOp::Put {
            key: k.into(),
            value: b"v".to_vec(),
            lease: None,
        };
        assert!(!c
            .txn(&[Compare::Exists("/op".into())], &[put("/m")])
            .unwrap());
        assert!(c.get("/m").unwrap().is_none());
        c.put("/op", b"", None).unwrap();
        assert!(c
            .txn(
                &[Compare::Exists("/op".into()), Compare::Missing("/m".into())],
                &[put("/m"), TxnOp::Delete("/op".into())]
            )
            .unwrap());
        assert!(c.get("/m").unwrap().is_some());
        assert!(c.get("/op").unwrap().is_none());
    }
}
