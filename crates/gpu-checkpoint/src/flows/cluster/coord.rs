//! The cluster flow's boundary with its coordination service (etcd): a small key-value interface with
//! leases, transactions and a blocking watch, which is all the two-phase protocol needs.
//!
//! [`super::EtcdCoordinator`] (feature `cluster`) is the real one, `MemoryCoordinator` the test
//! one (unit tests of the protocol, with faults such as an expired lease made on purpose). The calls
//! block: the rest of the code base is synchronous, and the etcd client's async runtime stays inside its
//! implementation.

use std::time::Duration;

/// A lease: keys put with it disappear when it expires (its holder stopped refreshing it: it died, or
/// lost etcd). Agents register with one, coordinators hold their operation with one.
pub type LeaseId = i64;

/// etcd's revision: a counter of every change to the store, shared by all keys.
pub type Revision = i64;

/// One key and its value, with the revision of its last change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kv {
    pub key: String,
    pub value: Vec<u8>,
    pub mod_revision: Revision,
}

/// A change seen by [`Coordinator::watch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Put(Kv),
    /// The key was deleted, or its lease expired.
    Delete {
        key: String,
        revision: Revision,
    },
}

impl Event {
    pub fn key(&self) -> &str {
        match self {
            Event::Put(kv) => &kv.key,
            Event::Delete { key, .. } => key,
        }
    }

    pub fn revision(&self) -> Revision {
        match self {
            Event::Put(kv) => kv.mod_revision,
            Event::Delete { revision, .. } => *revision,
        }
    }
}

/// A condition of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key exists.
    Exists(String),
    /// The key does not exist.
    Missing(String),
}

/// A write of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    Put {
        key: String,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete(String),
}

/// What went wrong talking to the coordination service.
#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error("cannot reach etcd at {endpoints}: {reason}")]
    Unreachable { endpoints: String, reason: String },
    /// etcd or its TLS refused us, or we refused it: an unknown server certificate (wrong CA), no or a
    /// rejected client certificate, a wrong user or password, a user without access to the keys.
    #[error("etcd at {endpoints} refused: {reason}")]
    Denied { endpoints: String, reason: String },
    /// The connection settings do not fit together (or a TLS file cannot be read).
    #[error("etcd settings: {0}")]
    Config(String),
    /// Plaintext or unauthenticated etcd, not accepted by the operator.
    #[error(
        "refusing to use etcd at {endpoints} without {missing}: whoever can write to that etcd could \
         drive the agents, which run as root. Set up TLS and credentials (docs/cluster.md, \
         \"Secure setup\"), or pass --insecure-plaintext to accept this for a demo or test"
    )]
    Insecure { endpoints: String, missing: String },
    #[error("etcd: {0}")]
    Request(String),
    #[error("etcd lease {0:x} expired or was revoked")]
    LeaseLost(LeaseId),
}

pub type CoordResult<T> = Result<T, CoordError>;

impl crate::exit::Classify for CoordError {
    fn exit_status(&self) -> crate::exit::ExitStatus {
        match self {
            // etcd is a component the command needs, like CRIU.
            CoordError::Unreachable { .. } => crate::exit::ExitStatus::ToolMissing,
            CoordError::Denied { .. } => crate::exit::ExitStatus::PermissionDenied,
            CoordError::Config(_) | CoordError::Insecure { .. } => crate::exit::ExitStatus::Usage,
            CoordError::Request(_) | CoordError::LeaseLost(_) => crate::exit::ExitStatus::Failure,
        }
    }
}

/// The coordination service, as the cluster flow uses it. Keys are UTF-8 strings; values are bytes
/// (JSON records, see `records.rs`).
pub trait Coordinator: Send + Sync {
    /// Puts `value` at `key`, attached to `lease` when given. Returns the store's revision after it.
    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> CoordResult<Revision>;
    /// The key, if present.
    fn get(&self, key: &str) -> CoordResult<Option<Kv>>;
    /// Every key under `prefix`, in key order, and the store's revision at the time of the read (a watch
    /// from there on misses nothing).
    fn range(&self, prefix: &str) -> CoordResult<(Vec<Kv>, Revision)>;
    /// Deletes every key under `prefix`; returns how many there were.
    fn delete_prefix(&self, prefix: &str) -> CoordResult<u64>;
    /// A new lease of `ttl` (rounded up to whole seconds, etcd's unit).
    fn grant(&self, ttl: Duration) -> CoordResult<LeaseId>;
    /// Refreshes the lease once; [`CoordError::LeaseLost`] when it has expired already.
    fn keep_alive(&self, lease: LeaseId) -> CoordResult<()>;
    /// Ends the lease now, deleting its keys.
    fn revoke(&self, lease: LeaseId) -> CoordResult<()>;
    /// Applies `then` atomically if every condition of `when` holds; returns whether it did.
    fn txn(&self, when: &[Compare], then: &[TxnOp]) -> CoordResult<bool>;
    /// The changes under `prefix` after revision `after`, waiting up to `timeout` for the first (an
    /// empty list: none came).
    fn watch(&self, prefix: &str, after: Revision, timeout: Duration) -> CoordResult<Vec<Event>>;
    /// A watch of `prefix` from after revision `after` that stays open: one request to open it, then its
    /// changes as they come, where each [`Coordinator::watch`] opens one again (a round trip per
    /// wake-up). The default asks `watch` again on each [`WatchStream::next`], from the last change
    /// seen: for coordinators without streams (the in-memory one, whose calls cost nothing).
    fn watch_stream<'a>(
        &'a self,
        prefix: &str,
        after: Revision,
    ) -> CoordResult<Box<dyn WatchStream + 'a>> {
        Ok(Box::new(Rewatch {
            coord: self,
            prefix: prefix.to_string(),
            after,
        }))
    }
}

/// An open watch ([`Coordinator::watch_stream`]): every change under its prefix, in order, once.
pub trait WatchStream: Send {
    /// The next changes, waiting up to `timeout` for the first (an empty list: none came).
    fn next(&mut self, timeout: Duration) -> CoordResult<Vec<Event>>;
}

/// [`Coordinator::watch_stream`]'s default: a [`Coordinator::watch`] per call, from the last change.
struct Rewatch<'a, C: ?Sized> {
    coord: &'a C,
    prefix: String,
    after: Revision,
}

impl<C: Coordinator + ?Sized> WatchStream for Rewatch<'_, C> {
    fn next(&mut self, timeout: Duration) -> CoordResult<Vec<Event>> {
        let events = self.coord.watch(&self.prefix, self.after, timeout)?;
        self.after = events
            .iter()
            .map(Event::revision)
            .fold(self.after, Revision::max);
        Ok(events)
    }
}
