//! The real [`Coordinator`]: etcd's v3 API through the `etcd-client` crate (gRPC).
//!
//! The crate is async; the cluster flow is not. A small tokio runtime (two workers) owned by the
//! coordinator runs each call to completion (`block_on`), so that no async code leaks out of this file.
//! Every call has a deadline ([`CALL_TIMEOUT`]): a coordinator or agent that lost etcd must find out and
//! abort, not hang.

use std::time::Duration;

use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, ConnectOptions, DeleteOptions, EventType,
    GetOptions, PutOptions, Txn, TxnOp as EtcdTxnOp, WatchOptions,
};
use tokio::runtime::Runtime;

use super::coord::{
    Compare, CoordError, CoordResult, Coordinator, Event, Kv, LeaseId, Revision, TxnOp, WatchStream,
};

/// How long one etcd request may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to an etcd cluster; see the module documentation.
pub struct EtcdCoordinator {
    rt: Runtime,
    client: Client,
    endpoints: String,
}

fn request(e: impl std::fmt::Display) -> CoordError {
    CoordError::Request(e.to_string())
}

impl EtcdCoordinator {
    /// Connects to the endpoints (`http://127.0.0.1:2379,...`; a bare `host:port` is taken as http).
    pub fn connect(endpoints: &[String]) -> CoordResult<Self> {
        let joined = endpoints.join(",");
        let unreachable = |reason: String| CoordError::Unreachable {
            endpoints: joined.clone(),
            reason,
        };
        if endpoints.is_empty() {
            return Err(unreachable("no endpoint given".into()));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| unreachable(format!("starting the client's runtime: {e}")))?;
        let opts = ConnectOptions::new()
            .with_connect_timeout(CALL_TIMEOUT)
            .with_timeout(CALL_TIMEOUT);
        let client = rt
            .block_on(Client::connect(endpoints, Some(opts)))
            .map_err(|e| unreachable(e.to_string()))?;
        let c = EtcdCoordinator {
            rt,
            client,
            endpoints: joined.clone(),
        };
        // The client connects lazily: ask something now, so that a wrong address is said up front.
        c.range("/gpu-checkpoint/\u{0}")
            .map_err(|e| unreachable(e.to_string()))?;
        Ok(c)
    }

    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// Runs one request, again (up to [`TRIES`] times) when it was never sent: the client spreads
    /// requests over the endpoints, and one whose member is down refuses the connection; the next try goes
    /// to another. A request that may have reached etcd is never repeated (a transaction's second try
    /// would see its own first one).
    fn call<T, F, Fut>(&self, f: F) -> Result<T, etcd_client::Error>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        let mut tries = 1;
        loop {
            match self.rt.block_on(f(self.client.clone())) {
                Err(e) if tries < TRIES && never_sent(&e) => {
                    tracing::debug!("etcd request not sent ({e}); trying again");
                    std::thread::sleep(Duration::from_millis(50 * tries as u64));
                    tries += 1;
                }
                r => return r,
            }
        }
    }

    fn kv(kv: &etcd_client::KeyValue) -> Kv {
        Kv {
            key: String::from_utf8_lossy(kv.key()).into_owned(),
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
        }
    }
}

impl Coordinator for EtcdCoordinator {
    fn put(&self, key: &str, value: &[u8], lease: Option<LeaseId>) -> CoordResult<Revision> {
        let opts = lease.map(|l| PutOptions::new().with_lease(l));
        let r = self
            .call(|mut c| {
                let opts = opts.clone();
                async move { c.put(key, value, opts).await }
            })
            .map_err(|e| lease_or_request(e, lease))?;
        Ok(r.header().map_or(0, |h| h.revision()))
    }

    fn get(&self, key: &str) -> CoordResult<Option<Kv>> {
        let r = self
            .call(|mut c| async move { c.get(key, None).await })
            .map_err(request)?;
        Ok(r.kvs().first().map(Self::kv))
    }

    fn range(&self, prefix: &str) -> CoordResult<(Vec<Kv>, Revision)> {
        let r = self
            .call(|mut c| async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await })
            .map_err(request)?;
        let rev = r.header().map_or(0, |h| h.revision());
        Ok((r.kvs().iter().map(Self::kv).collect(), rev))
    }

    fn delete_prefix(&self, prefix: &str) -> CoordResult<u64> {
        let r = self
            .call(|mut c| async move {
                c.delete(prefix, Some(DeleteOptions::new().with_prefix()))
                    .await
            })
            .map_err(request)?;
        Ok(r.deleted().max(0) as u64)
    }

    fn grant(&self, ttl: Duration) -> CoordResult<LeaseId> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let r = self
            .call(|mut c| async move { c.lease_grant(secs, None).await })
            .map_err(request)?;
        Ok(r.id())
    }

    fn keep_alive(&self, lease: LeaseId) -> CoordResult<()> {
        let ttl = self.call(|mut c| async move {
            let (mut keeper, mut stream) = c.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            let answer = tokio::time::timeout(CALL_TIMEOUT, stream.message())
                .await
                .map_err(|_| etcd_client::Error::InvalidArgs("keep-alive timed out".into()))??;
            Ok::<_, etcd_client::Error>(answer.map_or(0, |a| a.ttl()))
        });
        match ttl.map_err(|e| lease_or_request(e, Some(lease)))? {
            // etcd answers a keep-alive of an expired lease with a TTL of 0.
            t if t <= 0 => Err(CoordError::LeaseLost(lease)),
            _ => Ok(()),
        }
    }

    fn revoke(&self, lease: LeaseId) -> CoordResult<()> {
        self.call(|mut c| async move { c.lease_revoke(lease).await })
            .map(drop)
            .map_err(|e| lease_or_request(e, Some(lease)))
    }

    fn txn(&self, when: &[Compare], then: &[TxnOp]) -> CoordResult<bool> {
        let compares: Vec<EtcdCompare> = when
            .iter()
            .map(|c| match c {
                // A key exists while its version (number of changes since creation) is above 0.
                Compare::Exists(k) => EtcdCompare::version(k.as_str(), CompareOp::Greater, 0),
                Compare::Missing(k) => EtcdCompare::version(k.as_str(), CompareOp::Equal, 0),
            })
            .collect();
        let ops: Vec<EtcdTxnOp> = then
            .iter()
            .map(|op| match op {
                TxnOp::Put { key, value, lease } => EtcdTxnOp::put(
                    key.as_str(),
                    value.clone(),
                    lease.map(|l| PutOptions::new().with_lease(l)),
                ),
                TxnOp::Delete(key) => EtcdTxnOp::delete(key.as_str(), None),
            })
            .collect();
        let txn = Txn::new().when(compares).and_then(ops);
        let r = self
            .call(|mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .map_err(request)?;
        Ok(r.succeeded())
    }

    fn watch(&self, prefix: &str, after: Revision, timeout: Duration) -> CoordResult<Vec<Event>> {
        self.watch_stream(prefix, after)?.next(timeout)
    }

    fn watch_stream<'a>(
        &'a self,
        prefix: &str,
        after: Revision,
    ) -> CoordResult<Box<dyn WatchStream + 'a>> {
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(after + 1);
        let stream = self
            .call(|mut c| {
                let opts = opts.clone();
                async move { c.watch(prefix, Some(opts)).await }
            })
            .map_err(request)?;
        Ok(Box::new(EtcdWatch {
            rt: &self.rt,
            stream,
        }))
    }
}

/// An open etcd watch: its gRPC stream stays open between [`WatchStream::next`] calls (the changes
/// meanwhile wait in it), and closes on drop, which ends the watch in etcd.
struct EtcdWatch<'a> {
    rt: &'a Runtime,
    stream: etcd_client::WatchStream,
}

impl WatchStream for EtcdWatch<'_> {
    fn next(&mut self, timeout: Duration) -> CoordResult<Vec<Event>> {
        let stream = &mut self.stream;
        self.rt.block_on(async {
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let msg = match tokio::time::timeout_at(deadline, stream.message()).await {
                    Err(_) => return Ok(Vec::new()),
                    Ok(m) => m.map_err(request)?,
                };
                let Some(resp) = msg else {
                    return Err(request("the watch stream ended"));
                };
                if resp.canceled() {
                    return Err(request(format!("watch canceled: {}", resp.cancel_reason())));
                }
                let events: Vec<Event> = resp
                    .events()
                    .iter()
                    .filter_map(|e| {
                        let kv = e.kv()?;
                        Some(match e.event_type() {
                            EventType::Put => Event::Put(EtcdCoordinator::kv(kv)),
                            EventType::Delete => Event::Delete {
                                key: String::from_utf8_lossy(kv.key()).into_owned(),
                                revision: kv.mod_revision(),
                            },
                        })
                    })
                    .collect();
                // The first answer only confirms the watch was created.
                if !events.is_empty() {
                    return Ok(events);
                }
            }
        })
    }
}

/// How often a request that could not be sent is tried.
const TRIES: u32 = 5;

/// The request failed before reaching etcd: the connection to the endpoint chosen was refused.
fn never_sent(e: &etcd_client::Error) -> bool {
    let text = e.to_string();
    text.contains("tcp connect error") || text.contains("Connection refused")
}

/// etcd says "requested lease not found" for a lease that expired: the caller must know it lost it.
fn lease_or_request(e: etcd_client::Error, lease: Option<LeaseId>) -> CoordError {
    match lease {
        Some(l) if e.to_string().contains("lease not found") => CoordError::LeaseLost(l),
        _ => request(e),
    }
}
