//! The protocol's etcd requests, counted: the coordinator's and each member's are as many in a job of
//! 8 members as in a job of 1 (on the in-memory etcd, agents in threads, as `tests.rs`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::records as rec;
use super::tests::{opts, Cluster};
use super::*;

/// An etcd that counts the reads and writes made through it (not its lease's refreshes, which follow
/// the clock), and apart the watches opened; with `only`, those of keys under one of those prefixes.
struct Counting {
    inner: Arc<dyn Coordinator>,
    requests: std::sync::atomic::AtomicUsize,
    watches: std::sync::atomic::AtomicUsize,
    only: Vec<String>,
}

impl Counting {
    fn new(inner: Arc<dyn Coordinator>, only: &[String]) -> Counting {
        Counting {
            inner,
            requests: Default::default(),
            watches: Default::default(),
            only: only.to_vec(),
        }
    }

    fn counts(&self, key: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| key.starts_with(p.as_str()))
    }

    fn count(&self) {
        self.requests.fetch_add(1, Ordering::SeqCst);
    }

    fn count_key(&self, key: &str) {
        if self.counts(key) {
            self.count();
        }
    }

    /// The requests and watches counted since the last call.
    fn take(&self) -> (usize, usize) {
        (
            self.requests.swap(0, Ordering::SeqCst),
            self.watches.swap(0, Ordering::SeqCst),
        )
    }
}

impl Coordinator for Counting {
    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> coord::CoordResult<Revision> {
        self.count_key(key);
        self.inner.put(key, value, lease)
    }
    fn get(&self, key: &str) -> coord::CoordResult<Option<Kv>> {
        self.count_key(key);
        self.inner.get(key)
    }
    fn range(&self, prefix: &str) -> coord::CoordResult<(Vec<Kv>, Revision)> {
        self.count_key(prefix);
        self.inner.range(prefix)
    }
    fn delete_prefix(&self, prefix: &str) -> coord::CoordResult<u64> {
        self.count_key(prefix);
        self.inner.delete_prefix(prefix)
    }
    fn grant(&self, ttl: Duration) -> coord::CoordResult<LeaseId> {
        self.count_key("");
        self.inner.grant(ttl)
    }
    fn keep_alive(&self, lease: LeaseId) -> coord::CoordResult<()> {
        self.inner.keep_alive(lease)
    }
    fn revoke(&self, lease: LeaseId) -> coord::CoordResult<()> {
        self.count_key("");
        self.inner.revoke(lease)
    }
    fn txn(&self, when: &[coord::Compare], then: &[coord::TxnOp]) -> coord::CoordResult<bool> {
        let key = |op: &coord::TxnOp| match op {
            coord::TxnOp::Put { key, .. } | coord::TxnOp::Delete(key) => key.clone(),
        };
        if then.iter().any(|op| self.counts(&key(op))) {
            self.count();
        }
        self.inner.txn(when, then)
    }
    // A watch waits for others: its waiting is not counted, its opening (a request) is, apart.
    fn watch(&self, prefix: &str, after: Revision, t: Duration) -> coord::CoordResult<Vec<Event>> {
        if self.counts(prefix) {
            self.watches.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.watch(prefix, after, t)
    }
    fn watch_stream<'a>(
        &'a self,
        prefix: &str,
        after: Revision,
    ) -> coord::CoordResult<Box<dyn WatchStream + 'a>> {
        if self.counts(prefix) {
            self.watches.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.watch_stream(prefix, after)
    }
}

#[test]
fn a_job_checkpoints_etcd_requests_do_not_grow_with_its_members() {
    let nodes = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let c = Cluster::start(&nodes, &[]);
    c.add("one", 0, "a");
    for (rank, node) in nodes.iter().enumerate() {
        c.add("eight", rank as u32, node);
    }
    let requests = |job: &str| {
        let counting = Arc::new(Counting::new(c.arc(), &[]));
        let m = checkpoint_job(Arc::clone(&counting) as Arc<dyn Coordinator>, &opts(job));
        assert!(m.is_ok(), "{m:?}");
        counting.take()
    };
    let (one, eight) = (requests("one"), requests("eight"));
    // Reading every member's state again on each of their changes made it about 2 per member and step.
    assert_eq!(
        one.0, eight.0,
        "1 member: {one:?} requests, 8 members: {eight:?}"
    );
    // One watch for the whole operation (before: one more on each wake-up, 2 and 4 in a run).
    assert_eq!((one.1, eight.1), (1, 1));
}

#[test]
fn a_members_etcd_requests_do_not_grow_with_its_jobs_members_and_it_opens_one_watch() {
    let nodes = ["a", "b", "c", "d", "e", "f", "g", "h"];
    // The agents' requests about operations (states, decisions, manifests), not their registrations,
    // leases or task watches.
    let only = [format!("{}ops/", rec::ROOT), rec::checkpoints()];
    let counting = std::sync::OnceLock::new();
    let c = Cluster::start_on(Arc::new(MemoryCoordinator::new()), &nodes, &[], |inner| {
        let counted = counting.get_or_init(|| Arc::new(Counting::new(inner, &only)));
        Arc::clone(counted) as Arc<dyn Coordinator>
    });
    let counting = counting.get().unwrap();
    c.add("one", 0, "a");
    for (rank, node) in nodes.iter().enumerate() {
        c.add("eight", rank as u32, node);
    }
    let per_member = |job: &str, members: usize| {
        counting.take();
        checkpoint_job(c.arc(), &opts(job)).unwrap();
        let (requests, watches) = counting.take();
        (
            requests as f64 / members as f64,
            watches as f64 / members as f64,
        )
    };
    let (one, eight) = (per_member("one", 1), per_member("eight", 8));
    // Before: a read and a new watch at each barrier, and a new watch on every wake-up that brought
    // another member's state (more of them, the more members).
    assert_eq!(
        one, eight,
        "(requests, watches) per member: 1 member {one:?}, 8 {eight:?}"
    );
    // Its states (locked, durable, done) and the committed manifest; the decisions come by its watch.
    assert_eq!(one, (4.0, 1.0));
}
