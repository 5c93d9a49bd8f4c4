//! The real [`Coordinator`]: etcd's v3 API through the `etcd-client` crate (gRPC).
//!
//! The crate is async; the cluster flow is not. A small tokio runtime (two workers) owned by the
//! coordinator runs each call to completion (`block_on`), so that no async code leaks out of this file.
//! Every call has a deadline ([`CALL_TIMEOUT`]): a coordinator or agent that lost etcd must find out and
//! abort, not hang.

use std::time::Duration;

use etcd_client::{
    Certificate, Client, Compare as EtcdCompare, CompareOp, ConnectOptions, DeleteOptions,
    EventType, GetOptions, Identity, PutOptions, TlsOptions, Txn, TxnOp as EtcdTxnOp, WatchOptions,
};
use tokio::runtime::Runtime;

use super::coord::{
    Compare, CoordError, CoordResult, Coordinator, Event, Kv, LeaseId, Revision, TxnOp, WatchStream,
};
use super::etcd_config::{EtcdConfig, Security};

/// How long one etcd request may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// A connection to an etcd cluster; see the module documentation.
pub struct EtcdCoordinator {
    rt: Runtime,
    client: Client,
    endpoints: String,
    security: Security,
}

impl EtcdCoordinator {
    /// Connects as `config` says, after [`EtcdConfig::check`] (plaintext or unauthenticated etcd is
    /// refused unless the operator accepted it). A server certificate the CA did not sign, a client
    /// certificate etcd rejects, wrong credentials or a user that may not read the project's keys are
    /// [`CoordError::Denied`]; an etcd that does not answer is [`CoordError::Unreachable`].
    pub fn connect(config: &EtcdConfig) -> CoordResult<Self> {
        let security = config.check()?;
        let joined = config.endpoints_text();
        let unreachable = |reason: String| CoordError::Unreachable {
            endpoints: joined.clone(),
            reason,
        };
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(CALL_TIMEOUT)
            .with_timeout(CALL_TIMEOUT);
        if security.tls {
            opts = opts.with_tls(tls_options(config)?);
        }
        if let (Some(user), Some(password)) = (&config.user, &config.password) {
            // etcd's tokens expire (5 minutes idle by default): the client authenticates again.
            opts = opts
                .with_user(user.clone(), password.reveal())
                .with_auto_token_refresh(true);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .map_err(|e| unreachable(format!("starting the client's runtime: {e}")))?;
        let client = rt
            .block_on(Client::connect(&config.endpoints, Some(opts)))
            .map_err(|e| refused_at_connect(&e, config))?;
        let c = EtcdCoordinator {
            rt,
            client,
            endpoints: joined.clone(),
            security,
        };
        // The client connects lazily: ask something now, so that a wrong address (or certificate, or
        // credentials) is said up front.
        let probe = c.call(|mut cl| async move { cl.get("/gpu-checkpoint/\u{0}", None).await });
        probe.map_err(|e| refused_at_connect(&e, config))?;
        Ok(c)
    }

    pub fn endpoints(&self) -> &str {
        &self.endpoints
    }

    /// Whether this connection is TLS and authenticated.
    pub fn security(&self) -> Security {
        self.security
    }

    /// An etcd error as a [`CoordError`]: refusals and unreachable endpoints by their kind.
    fn error(&self, e: etcd_client::Error) -> CoordError {
        classify(&e, &self.endpoints)
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
            .map_err(|e| self.lease_or_request(e, lease))?;
        Ok(r.header().map_or(0, |h| h.revision()))
    }

    fn get(&self, key: &str) -> CoordResult<Option<Kv>> {
        let r = self
            .call(|mut c| async move { c.get(key, None).await })
            .map_err(|e| self.error(e))?;
        Ok(r.kvs().first().map(Self::kv))
    }

    fn range(&self, prefix: &str) -> CoordResult<(Vec<Kv>, Revision)> {
        let r = self
            .call(|mut c| async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await })
            .map_err(|e| self.error(e))?;
        let rev = r.header().map_or(0, |h| h.revision());
        Ok((r.kvs().iter().map(Self::kv).collect(), rev))
    }

    fn delete_prefix(&self, prefix: &str) -> CoordResult<u64> {
        let r = self
            .call(|mut c| async move {
                c.delete(prefix, Some(DeleteOptions::new().with_prefix()))
                    .await
            })
            .map_err(|e| self.error(e))?;
        Ok(r.deleted().max(0) as u64)
    }

    fn grant(&self, ttl: Duration) -> CoordResult<LeaseId> {
        let secs = ttl.as_secs_f64().ceil().max(1.0) as i64;
        let r = self
            .call(|mut c| async move { c.lease_grant(secs, None).await })
            .map_err(|e| self.error(e))?;
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
        match ttl.map_err(|e| self.lease_or_request(e, Some(lease)))? {
            // etcd answers a keep-alive of an expired lease with a TTL of 0.
            t if t <= 0 => Err(CoordError::LeaseLost(lease)),
            _ => Ok(()),
        }
    }

    fn revoke(&self, lease: LeaseId) -> CoordResult<()> {
        self.call(|mut c| async move { c.lease_revoke(lease).await })
            .map(drop)
            .map_err(|e| self.lease_or_request(e, Some(lease)))
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
            .map_err(|e| self.error(e))?;
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
            .map_err(|e| self.error(e))?;
        Ok(Box::new(EtcdWatch {
            rt: &self.rt,
            stream,
            endpoints: &self.endpoints,
        }))
    }
}

/// An open etcd watch: its gRPC stream stays open between [`WatchStream::next`] calls (the changes
/// meanwhile wait in it), and closes on drop, which ends the watch in etcd.
struct EtcdWatch<'a> {
    rt: &'a Runtime,
    stream: etcd_client::WatchStream,
    endpoints: &'a str,
}

impl WatchStream for EtcdWatch<'_> {
    fn next(&mut self, timeout: Duration) -> CoordResult<Vec<Event>> {
        let stream = &mut self.stream;
        let endpoints = self.endpoints;
        let request = |e: String| CoordError::Request(e);
        self.rt.block_on(async {
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let msg = match tokio::time::timeout_at(deadline, stream.message()).await {
                    Err(_) => return Ok(Vec::new()),
                    Ok(m) => m.map_err(|e| classify(&e, endpoints))?,
                };
                let Some(resp) = msg else {
                    return Err(request("the watch stream ended".into()));
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

impl EtcdCoordinator {
    /// etcd says "requested lease not found" for a lease that expired: the caller must know it lost it.
    fn lease_or_request(&self, e: etcd_client::Error, lease: Option<LeaseId>) -> CoordError {
        match lease {
            Some(l) if e.to_string().contains("lease not found") => CoordError::LeaseLost(l),
            _ => self.error(e),
        }
    }
}

/// The TLS settings of `config`: its CA, and its client certificate and key if given.
fn tls_options(config: &EtcdConfig) -> CoordResult<TlsOptions> {
    let read = |what: &str, p: &std::path::Path| {
        std::fs::read(p).map_err(|e| CoordError::Config(format!("{what} {}: {e}", p.display())))
    };
    let mut tls = TlsOptions::new();
    if let Some(ca) = &config.cacert {
        tls = tls.ca_certificate(Certificate::from_pem(read("--cacert", ca)?));
    }
    if let (Some(cert), Some(key)) = (&config.cert, &config.key) {
        tls = tls.identity(Identity::from_pem(
            read("--cert", cert)?,
            read("--key", key)?,
        ));
    }
    Ok(tls)
}

/// What an etcd error means for the caller. gRPC statuses carry etcd's own refusals (authentication
/// failed, permission denied); transport errors carry TLS's (found in the error's sources, where rustls
/// names the certificate problem) and unreachable endpoints.
fn classify(e: &etcd_client::Error, endpoints: &str) -> CoordError {
    let denied = |reason: String| CoordError::Denied {
        endpoints: endpoints.to_string(),
        reason,
    };
    if let etcd_client::Error::GRpcStatus(status) = e {
        let msg = status.message();
        return match i32::from(status.code()) {
            grpc::PERMISSION_DENIED => denied(format!(
                "{msg} (the etcd user lacks access to the keys under /gpu-checkpoint/: see its role)"
            )),
            grpc::UNAUTHENTICATED => denied(msg.to_string()),
            grpc::INVALID_ARGUMENT | grpc::FAILED_PRECONDITION
                if msg.contains("authentication") || msg.contains("user") =>
            {
                denied(msg.to_string())
            }
            _ if is_tls(e) => denied(tls_reason(e)),
            grpc::UNAVAILABLE | grpc::DEADLINE_EXCEEDED => CoordError::Unreachable {
                endpoints: endpoints.to_string(),
                reason: chain(e),
            },
            _ => CoordError::Request(chain(e)),
        };
    }
    if is_tls(e) {
        return denied(tls_reason(e));
    }
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => {
            CoordError::Unreachable {
                endpoints: endpoints.to_string(),
                reason: chain(e),
            }
        }
        _ => CoordError::Request(chain(e)),
    }
}

/// [`classify`] for the first requests of a connection: etcd with `--client-cert-auth` checks the
/// client's certificate after a TLS 1.3 handshake has completed on the client's side, and then closes
/// the connection, which the client sees as a closed stream or a cancelled request rather than the
/// alert it sent.
fn refused_at_connect(e: &etcd_client::Error, config: &EtcdConfig) -> CoordError {
    let endpoints = config.endpoints_text();
    let text = chain(e);
    let server_cert = text.contains("UnknownIssuer") || text.contains("invalid peer certificate");
    let closed = [
        "connection closed",
        "BrokenPipe",
        "Canceled",
        "stream closed",
        "BadCertificate",
        "CertificateRequired",
        "alert",
    ];
    if config.cacert.is_some() && !server_cert && closed.iter().any(|w| text.contains(w)) {
        let hint = if config.cert.is_none() {
            "etcd ended the TLS connection: it requires a client certificate (--cert, --key)"
        } else {
            "etcd ended the TLS connection: it did not accept this client's certificate (--cert: \
             signed by a CA etcd trusts, its --trusted-ca-file?)"
        };
        return CoordError::Denied {
            endpoints,
            reason: format!("{hint} ({text})"),
        };
    }
    classify(e, &endpoints)
}

/// The gRPC status codes etcd answers with (their numbers are the gRPC protocol's).
mod grpc {
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const PERMISSION_DENIED: i32 = 7;
    pub const FAILED_PRECONDITION: i32 = 9;
    pub const UNAVAILABLE: i32 = 14;
    pub const UNAUTHENTICATED: i32 = 16;
}

/// The error and its sources, joined: tonic's own message ("transport error") says little.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// A TLS failure: rustls's words for a certificate it did not accept or an alert etcd sent.
fn is_tls(e: &etcd_client::Error) -> bool {
    let text = chain(e);
    [
        "certificate",
        "CertificateRequired",
        "HandshakeFailure",
        "tls handshake",
        "alert",
    ]
    .iter()
    .any(|w| text.contains(w))
}

/// A TLS failure said for people: which side refused, and what to check.
fn tls_reason(e: &etcd_client::Error) -> String {
    let text = chain(e);
    let hint = if text.contains("UnknownIssuer") || text.contains("invalid peer certificate") {
        "etcd's server certificate is not signed by the CA given (--cacert), or does not name the \
         endpoint's address"
    } else if text.contains("CertificateRequired")
        || text.contains("BadCertificate")
        || text.contains("alert")
    {
        "etcd did not accept this client's certificate (none given, or not signed by a CA etcd \
         trusts: --cert, --key)"
    } else {
        "the TLS handshake failed"
    };
    format!("{hint} ({text})")
}
