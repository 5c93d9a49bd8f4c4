//! The store on an S3-compatible object store (AWS S3, MinIO, Ceph RGW, garage, R2, s3s-fs), through the
//! `object_store` crate: request signing, retries with backoff on throttling and 5xx, multipart uploads,
//! path-style requests for servers other than AWS. The store's objects live under `s3://BUCKET/PREFIX/`
//! with the same keys as a local store's files.
//!
//! The store's workers are threads, the client is async: the backend runs a small tokio runtime of its own
//! and blocks on it. To keep tens of requests in flight without tens of workers, chunk puts are sent in the
//! background (bounded by count and bytes; [`Backend::sync`] waits for them and reports their failures, and
//! the first failure fails every later put at once), and reads announced with [`ReadBackend::prefetch`] are
//! fetched ahead.
//!
//! What is assumed of the server (see `docs/store.md`): a PUT is atomic and durable when answered; GET,
//! HEAD and LIST after a PUT or DELETE see it (read-after-write consistency); nothing conditional
//! (`If-None-Match` may be ignored), and no versioning or object lock that would keep deleted chunks.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig,
    WriteMultipart,
};
use tokio::sync::Semaphore;

use super::objects::{check_marker, marker, STORE_FILE, STORE_FORMAT_VERSION};
use super::{Backend, ObjectMeta, ReadBackend};
use crate::store::error::{Error, Result};

/// Puts in flight at most (tens: each waits a round trip, and S3 serves thousands per prefix per second).
const MAX_PUTS: usize = 32;
/// Bytes of puts in flight at most, in KiB: what the background sending holds. Part of the memory
/// budget's floor (64 MiB, of which the pipeline's own buffers need 46 MiB at 4 MiB chunks), so two
/// maximum chunks; 32 MiB put checkpoints of 256 MiB and 1 GiB at 109-121 MiB of peak RSS (`docs/store.md`).
const MAX_PUT_KIB: u32 = 8 * 1024;
/// Reads fetched ahead at most, a backstop: the read path bounds its read-ahead by bytes within the
/// memory budget ([`ReadBackend::read_ahead_in_memory`]) and announces no more than fit, since an
/// announcement this drops is fetched later by a worker, one request at a time (`docs/store.md`).
const MAX_PREFETCH: usize = 64;
/// Objects above this are sent in parts (multipart upload), of this size each.
const MULTIPART_PART: usize = 16 << 20;

/// Where and how to reach the object store.
#[derive(Clone)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix inside the bucket (no leading or trailing `/`; empty for the bucket's root).
    pub prefix: String,
    /// Another server than AWS: `http://HOST:PORT` (path-style requests are used then).
    pub endpoint: Option<String>,
    pub region: String,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub session_token: Option<String>,
    /// How long a request is retried (with backoff) before it fails.
    pub retry_timeout: Duration,
    /// A local folder for staging folders (the system's temporary folder when `None`).
    pub work_dir: Option<PathBuf>,
}

impl std::fmt::Debug for S3Config {
    /// Never the secrets.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field(
                "access_key_id",
                &self.access_key_id.as_ref().map(|_| "(set)"),
            )
            .finish_non_exhaustive()
    }
}

/// Set to a number of seconds to change how long an S3 request is retried (default 30).
pub const S3_RETRY_TIMEOUT_ENV: &str = "GPU_CHECKPOINT_S3_RETRY_TIMEOUT";

impl S3Config {
    /// The configuration of `BUCKET/PREFIX` (an `s3://` URL without its scheme) the standard way: the AWS
    /// environment variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
    /// `AWS_REGION` or `AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL`), else the shared credentials and config
    /// files (`AWS_PROFILE`, default `default`; `AWS_SHARED_CREDENTIALS_FILE`, `AWS_CONFIG_FILE`).
    pub fn from_env(url: &str) -> Result<S3Config> {
        let (bucket, prefix) = url.split_once('/').unwrap_or((url, ""));
        let prefix = prefix.trim_matches('/');
        if bucket.is_empty() || prefix.split('/').any(|c| c == "." || c == "..") {
            return Err(Error::Invalid(format!(
                "storage s3://{url}: expected s3://BUCKET or s3://BUCKET/PREFIX"
            )));
        }
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let profile = profile::Profile::load(var("AWS_PROFILE").as_deref().unwrap_or("default"));
        let (access_key_id, secret_access_key, session_token) = match var("AWS_ACCESS_KEY_ID") {
            Some(id) => (
                Some(id),
                var("AWS_SECRET_ACCESS_KEY"),
                var("AWS_SESSION_TOKEN"),
            ),
            None => (
                profile.get("aws_access_key_id"),
                profile.get("aws_secret_access_key"),
                profile.get("aws_session_token"),
            ),
        };
        let retry_timeout = var(S3_RETRY_TIMEOUT_ENV)
            .and_then(|s| s.parse().ok())
            .map_or(Duration::from_secs(30), Duration::from_secs);
        Ok(S3Config {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
            endpoint: var("AWS_ENDPOINT_URL_S3")
                .or_else(|| var("AWS_ENDPOINT_URL"))
                .or_else(|| profile.get("endpoint_url")),
            region: var("AWS_REGION")
                .or_else(|| var("AWS_DEFAULT_REGION"))
                .or_else(|| profile.get("region"))
                .unwrap_or_else(|| "us-east-1".into()),
            access_key_id,
            secret_access_key,
            session_token,
            retry_timeout,
            work_dir: None,
        })
    }
}

/// The shared credentials and config files of the AWS tools, read as far as this backend needs (a
/// profile's keys, region and endpoint).
mod profile {
    use std::collections::HashMap;

    pub(super) struct Profile(HashMap<String, String>);

    impl Profile {
        pub(super) fn load(name: &str) -> Profile {
            let home = std::env::var("HOME").unwrap_or_default();
            let file = |var: &str, default: &str| {
                std::env::var(var).unwrap_or_else(|_| format!("{home}/.aws/{default}"))
            };
            let mut keys = HashMap::new();
            // In the config file a profile other than the default is `[profile NAME]`.
            let config_section = if name == "default" {
                name.to_owned()
            } else {
                format!("profile {name}")
            };
            for (path, section) in [
                (file("AWS_CONFIG_FILE", "config"), config_section.as_str()),
                (file("AWS_SHARED_CREDENTIALS_FILE", "credentials"), name),
            ] {
                if let Ok(text) = std::fs::read_to_string(path) {
                    read_section(&text, section, &mut keys);
                }
            }
            Profile(keys)
        }

        pub(super) fn get(&self, key: &str) -> Option<String> {
            self.0.get(key).cloned()
        }
    }

    fn read_section(text: &str, section: &str, keys: &mut HashMap<String, String>) {
        let mut inside = false;
        for line in text.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                inside = name.trim() == section;
            } else if let (true, Some((k, v))) = (inside, line.split_once('=')) {
                keys.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
            }
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn sections_are_read_by_name() {
            let mut keys = Default::default();
            let text = "[default]\naws_access_key_id = A\n[profile other]\nregion=eu\n";
            super::read_section(text, "profile other", &mut keys);
            assert_eq!(keys.get("region").map(String::as_str), Some("eu"));
            assert!(!keys.contains_key("aws_access_key_id"));
        }
    }
}

type PutTask = tokio::task::JoinHandle<std::result::Result<(), (String, object_store::Error)>>;

/// The S3 backend.
pub struct S3Backend {
    store: Arc<AmazonS3>,
    rt: tokio::runtime::Runtime,
    /// `PREFIX/` or empty.
    prefix: String,
    location: String,
    work_dir: Option<PathBuf>,
    puts: Mutex<Vec<PutTask>>,
    put_count: Arc<Semaphore>,
    put_bytes: Arc<Semaphore>,
    /// The first background put that failed: every later put and sync fails with it.
    failed: Arc<Mutex<Option<(String, std::io::ErrorKind)>>>,
    prefetched: Mutex<HashMap<String, tokio::task::JoinHandle<object_store::Result<Bytes>>>>,
}

impl S3Backend {
    pub fn new(config: S3Config) -> Result<S3Backend> {
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(5),
                    base: 2.0,
                },
                // The timeout bounds the retries, not a count: ten quick backoffs end within two
                // seconds, shorter than a throttling server needs to recover.
                max_retries: usize::MAX,
                retry_timeout: config.retry_timeout,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(120))
                    .with_pool_max_idle_per_host(MAX_PUTS + MAX_PREFETCH),
            );
        if let Some(endpoint) = &config.endpoint {
            builder = builder
                .with_endpoint(endpoint)
                .with_allow_http(endpoint.starts_with("http://"))
                .with_virtual_hosted_style_request(false);
        }
        if let Some(id) = &config.access_key_id {
            builder = builder.with_access_key_id(id);
        }
        if let Some(secret) = &config.secret_access_key {
            builder = builder.with_secret_access_key(secret);
        }
        if let Some(token) = &config.session_token {
            builder = builder.with_token(token);
        }
        let location = if config.prefix.is_empty() {
            format!("s3://{}", config.bucket)
        } else {
            format!("s3://{}/{}", config.bucket, config.prefix)
        };
        let store = builder.build().map_err(|e| {
            // object_store's configuration errors name keys, never their values.
            Error::Invalid(format!("storage {location}: {e}"))
        })?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("s3")
            .enable_all()
            .build()
            .map_err(|e| Error::Internal(format!("cannot start the S3 client's runtime: {e}")))?;
        Ok(S3Backend {
            store: Arc::new(store),
            rt,
            prefix: if config.prefix.is_empty() {
                String::new()
            } else {
                format!("{}/", config.prefix)
            },
            location,
            work_dir: config.work_dir,
            puts: Mutex::default(),
            put_count: Arc::new(Semaphore::new(MAX_PUTS)),
            put_bytes: Arc::new(Semaphore::new(MAX_PUT_KIB as usize)),
            failed: Arc::default(),
            prefetched: Mutex::default(),
        })
    }

    fn path(&self, key: &str) -> ObjectPath {
        ObjectPath::from(format!("{}{key}", self.prefix))
    }

    fn error(&self, op: &'static str, key: &str, e: object_store::Error) -> Error {
        Error::Io {
            op,
            path: self.describe(key).into(),
            source: io_error(e),
        }
    }

    fn check_failed(&self) -> Result<()> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            // Of the first failure's kind: a server gone or throttling is still storage (exit 6).
            Some((first, kind)) => Err(Error::Io {
                op: "cannot write",
                path: self.location.as_str().into(),
                source: std::io::Error::new(*kind, format!("an earlier write failed: {first}")),
            }),
            None => Ok(()),
        }
    }

    /// Sends one object: in one PUT, or in parts when it is large.
    async fn send(store: Arc<AmazonS3>, path: ObjectPath, body: Bytes) -> object_store::Result<()> {
        if body.len() <= MULTIPART_PART {
            return store.put(&path, PutPayload::from(body)).await.map(|_| ());
        }
        let upload = store.put_multipart(&path).await?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, MULTIPART_PART);
        for part in body.chunks(MULTIPART_PART) {
            writer.wait_for_capacity(4).await?;
            writer.put(body.slice_ref(part));
        }
        writer.finish().await.map(|_| ())
    }
}

/// An object store error as an `io::Error` of the kind the store's exit statuses know: denied access is
/// "permission denied" and a server that kept failing (down, throttling, 5xx) until the retries ran out
/// is "timed out", both storage (exit 6); the rest a failure. The message never holds a credential.
fn io_error(e: object_store::Error) -> std::io::Error {
    std::io::Error::new(error_kind(&e), e.to_string())
}

fn error_kind(e: &object_store::Error) -> std::io::ErrorKind {
    use std::io::ErrorKind;
    match e {
        object_store::Error::NotFound { .. } => ErrorKind::NotFound,
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => ErrorKind::PermissionDenied,
        object_store::Error::Generic { .. } if retried(&e.to_string()) => ErrorKind::TimedOut,
        _ => ErrorKind::Other,
    }
}

/// Whether a request error says it was retried ("... after 7 retries, max_retries: ..."): only throttling,
/// 5xx, timeouts and connection failures are retried; a request the server refused outright is not. The
/// client's error type is not public, so its message is what there is to read
/// (`s3_throttling.rs` fails if that message changes).
fn retried(message: &str) -> bool {
    message
        .split_once("after ")
        .and_then(|(_, rest)| rest.split_once(" retries"))
        .and_then(|(n, _)| n.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 0)
}

/// A read's bytes into `buf`: `Ok(true)`, or `Ok(false)` where there is no such object.
fn take_bytes(got: object_store::Result<Bytes>, buf: &mut Vec<u8>) -> object_store::Result<bool> {
    match got {
        Ok(bytes) => {
            buf.clear();
            buf.extend_from_slice(&bytes);
            Ok(true)
        }
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

fn meta(prefix: &str, m: object_store::ObjectMeta) -> Option<ObjectMeta> {
    let key = m.location.as_ref().strip_prefix(prefix)?.to_owned();
    Some(ObjectMeta {
        key,
        size: m.size,
        modified: Some(SystemTime::from(m.last_modified)),
    })
}

impl ReadBackend for S3Backend {
    fn location(&self) -> &str {
        &self.location
    }

    fn get(&self, key: &str, buf: &mut Vec<u8>) -> Result<bool> {
        let ahead = self
            .prefetched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
        let got = match ahead {
            Some(task) => self
                .rt
                .block_on(task)
                .map_err(|e| Error::Internal(format!("an S3 read panicked: {e}")))?,
            None => self
                .rt
                .block_on(async { self.store.get(&self.path(key)).await?.bytes().await }),
        };
        take_bytes(got, buf).map_err(|e| self.error("cannot read", key, e))
    }

    fn get_range(&self, key: &str, range: Range<u64>, buf: &mut Vec<u8>) -> Result<bool> {
        let path = self.path(key);
        let got = self.rt.block_on(async {
            let opts = object_store::GetOptions {
                range: Some(object_store::GetRange::Bounded(range.clone())),
                ..Default::default()
            };
            self.store.get_opts(&path, opts).await?.bytes().await
        });
        match take_bytes(got, buf) {
            // A range past the end of a shorter object (S3 answers 416).
            Err(e) if e.to_string().contains("416") || e.to_string().contains("Range") => {
                let mut whole = Vec::new();
                if !self.get(key, &mut whole)? {
                    return Ok(false);
                }
                let end = (range.end as usize).min(whole.len());
                let start = (range.start as usize).min(end);
                buf.clear();
                buf.extend_from_slice(&whole[start..end]);
                Ok(true)
            }
            r => r.map_err(|e| self.error("cannot read", key, e)),
        }
    }

    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        match self.rt.block_on(self.store.head(&self.path(key))) {
            Ok(m) => Ok(meta(&self.prefix, m)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("cannot look at", key, e)),
        }
    }

    fn list(&self, prefix: &str, f: &mut dyn FnMut(ObjectMeta)) -> Result<()> {
        // object_store lists by whole path segments: list the folder the prefix ends in, filter the rest.
        let (dir, _) = prefix.rsplit_once('/').unwrap_or(("", prefix));
        let full = format!("{}{dir}", self.prefix);
        let full = full.trim_end_matches('/');
        let list_path = (!full.is_empty()).then(|| ObjectPath::from(full));
        let mut stream = self.store.list(list_path.as_ref());
        loop {
            match self.rt.block_on(stream.try_next()) {
                Ok(Some(m)) => {
                    if let Some(m) = meta(&self.prefix, m).filter(|m| m.key.starts_with(prefix)) {
                        f(m);
                    }
                }
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.error("cannot list", prefix, e)),
            }
        }
    }

    fn prefetch(&self, key: &str) {
        let mut ahead = self.prefetched.lock().unwrap_or_else(|p| p.into_inner());
        if ahead.len() >= MAX_PREFETCH || ahead.contains_key(key) {
            return;
        }
        let (store, path) = (self.store.clone(), self.path(key));
        let task = self
            .rt
            .spawn(async move { store.get(&path).await?.bytes().await });
        ahead.insert(key.to_owned(), task);
    }

    fn requests_in_flight(&self) -> usize {
        MAX_PUTS
    }

    fn read_ahead_in_memory(&self) -> bool {
        true
    }

    fn work_root(&self) -> Option<&Path> {
        self.work_dir.as_deref()
    }
}

impl Backend for S3Backend {
    fn init(&self) -> Result<()> {
        let mut bytes = Vec::new();
        if self.get(STORE_FILE, &mut bytes)? {
            let version = check_marker(&bytes, &self.describe(STORE_FILE))?;
            if version < STORE_FORMAT_VERSION {
                // Older builds would misread what this one writes: mark the store this build's. Without
                // write access it stays as it is and is still read (check_writable refuses writes anyway).
                if let Err(e) = self.put(STORE_FILE, &[&marker()], true) {
                    tracing::debug!(
                        "{}: store format version {version} left as it is ({e})",
                        self.location
                    );
                }
            }
            return Ok(());
        }
        // A new store: only its marker (an object store has no folders to make). A listing first, so that a
        // prefix full of something else is not taken over.
        let mut other = None;
        self.list("", &mut |m| {
            other.get_or_insert(m.key);
        })?;
        if let Some(key) = other {
            return Err(Error::BadStore {
                path: self.location.as_str().into(),
                reason: format!(
                    "holds objects ({key}, ...) and no {STORE_FILE}: not a gpu-checkpoint store; use \
                     an empty prefix"
                ),
            });
        }
        self.put(STORE_FILE, &[&marker()], true)
    }

    fn check_writable(&self) -> Result<()> {
        // Really write (and delete) an object: missing permissions or an unreachable server show up here,
        // before any process is touched.
        let key = format!(
            "{}probe.{}.{}",
            super::LEASES,
            std::process::id(),
            crate::store::random_u32()
        );
        let unwritable = |e: Error| match e {
            Error::Io { path, source, .. } => Error::Unwritable { path, source },
            e => e,
        };
        self.put(&key, &[b"gpu-checkpoint write probe\n"], true)
            .map_err(unwritable)?;
        self.delete(&key).map(|_| ()).map_err(unwritable)
    }

    fn put(&self, key: &str, parts: &[&[u8]], durable: bool) -> Result<()> {
        self.check_failed()?;
        self.forget_prefetch(key);
        if let Some(e) = crate::fault::io_error("store.write") {
            return Err(Error::io("cannot write", self.describe(key))(e));
        }
        let body = Bytes::from(parts.concat());
        let path = self.path(key);
        if durable {
            return self
                .rt
                .block_on(Self::send(self.store.clone(), path, body))
                .map_err(|e| self.error("cannot write", key, e));
        }
        // In the background, once there is room: the caller goes on hashing and compressing.
        let kib = (body.len().div_ceil(1024) as u32).clamp(1, MAX_PUT_KIB);
        let permits = self.rt.block_on(async {
            let count = self.put_count.clone().acquire_owned().await;
            let bytes = self.put_bytes.clone().acquire_many_owned(kib).await;
            (count, bytes)
        });
        let (store, failed, key) = (self.store.clone(), self.failed.clone(), key.to_owned());
        let task = self.rt.spawn(async move {
            let _permits = permits;
            Self::send(store, path, body).await.map_err(|e| {
                failed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(|| (format!("{key}: {e}"), error_kind(&e)));
                (key, e)
            })
        });
        let mut puts = self.puts.lock().unwrap_or_else(|p| p.into_inner());
        puts.retain(|t| !t.is_finished());
        puts.push(task);
        Ok(())
    }

    fn sync(&self, _keys: &[String]) -> Result<()> {
        // Every background put of this process, not only `keys`: a put the caller has forgotten is still
        // better finished than cut off.
        let tasks = std::mem::take(&mut *self.puts.lock().unwrap_or_else(|p| p.into_inner()));
        let mut first = None;
        for t in tasks {
            match self.rt.block_on(t) {
                Ok(Ok(())) => {}
                Ok(Err((key, e))) => {
                    first.get_or_insert_with(|| self.error("cannot write", &key, e));
                }
                Err(e) => {
                    first
                        .get_or_insert_with(|| Error::Internal(format!("an S3 put panicked: {e}")));
                }
            }
        }
        match first {
            Some(e) => Err(e),
            None => self.check_failed(),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.forget_prefetch(key);
        // S3 answers a DELETE of a missing key with success: whether there was one is not known.
        match self.rt.block_on(self.store.delete(&self.path(key))) {
            Ok(()) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.error("cannot delete", key, e)),
        }
    }

    fn memory_in_flight(&self) -> u64 {
        MAX_PUT_KIB as u64 * 1024
    }
}

impl S3Backend {
    /// Drops (and cancels) a prefetch of `key` nobody read: this process is writing or deleting the
    /// object, and a later read must see that, not the bytes fetched before. (A read that stopped early, a
    /// restore that met a damaged chunk, leaves its prefetches behind; a re-checkpoint that writes the
    /// damaged chunk again and a verify after it, through the same handle, read it again.)
    fn forget_prefetch(&self, key: &str) {
        let stale = self
            .prefetched
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
        if let Some(t) = stale {
            t.abort();
        }
    }
}

impl Drop for S3Backend {
    fn drop(&mut self) {
        // Prefetches nobody read: cancelled, not waited for.
        for (_, t) in self
            .prefetched
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
        {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::store::backend::Backend;
    use crate::store::plan::{memory_budget, Plan, RESERVE};
    use crate::store::ChunkParams;

    #[test]
    fn a_checkpoint_through_s3_plans_within_the_64_mib_floor() {
        // No request is made: building the client only.
        let s3 = super::S3Backend::new(super::S3Config {
            bucket: "b".into(),
            prefix: String::new(),
            endpoint: Some("http://127.0.0.1:9".into()),
            region: "us-east-1".into(),
            access_key_id: Some("k".into()),
            secret_access_key: Some("s".into()),
            session_token: None,
            retry_timeout: std::time::Duration::from_secs(1),
            work_dir: None,
        })
        .unwrap();
        let taken = s3.memory_in_flight();
        assert!(taken >= super::MAX_PUT_KIB as u64 * 1024);
        for threads in [1, 2, 16] {
            let p = Plan::within(1 << 30, taken, threads, ChunkParams::default(), 1);
            assert!(
                p.memory() + taken + RESERVE <= memory_budget(1 << 30),
                "{p:?} + {taken} in flight over 64 MiB"
            );
        }
    }

    #[test]
    fn only_retried_request_errors_count_as_storage_unreachable() {
        let throttled = "Generic S3 error: Error performing PUT http://h/b/k in 3.1s, after 9 retries, \
                         max_retries: 18446744073709551615, retry_timeout: 3s - Server returned non-2xx \
                         status code: 503 Service Unavailable";
        assert!(super::retried(throttled));
        let refused = "Generic S3 error: Error performing PUT http://h/b/k in 2ms, after 0 retries, \
                       max_retries: 1, retry_timeout: 3s - Server returned non-2xx status code: 400";
        assert!(!super::retried(refused));
        assert!(!super::retried(
            "Generic S3 error: cannot parse the listing"
        ));
    }
}
