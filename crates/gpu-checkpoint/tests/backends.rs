//! One conformance suite, run against every backend: the local folder, the in-memory one, and (with the
//! `s3` feature) real S3 servers started on 127.0.0.1 for each test: s3s-fs, and garage and moto's server in
//! the long test lane (`scripts/test.sh --long`). The same objects, the same checkpoints, the same damage, the same gc,
//! whatever the storage.

mod common;

use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use gpu_checkpoint::store::backend::{chunk_key, LEASES};
use gpu_checkpoint::store::{
    Backend, Error, LocalBackend, MemoryBackend, NoProgress, Objects, Progress, Store,
    StoreOptions, GRACE,
};
#[cfg(feature = "s3")]
use gpu_checkpoint::store::{ObjectMeta, ReadBackend};
use gpu_checkpoint::{Classify, ExitStatus};

use common::pseudo_random as random;

/// A backend under test, with what the suite needs to play with time.
struct Fixture {
    backend: Arc<dyn Backend>,
    dir: tempfile::TempDir,
    /// Makes every stored object older by the given time (gc's grace period).
    age: Box<dyn Fn(Duration)>,
    /// Whether the backend is a local folder (flock, no grace period).
    local: bool,
    #[cfg(feature = "s3")]
    _server: Option<Box<dyn common::s3::Endpoint>>,
}

impl Fixture {
    fn store(&self) -> Store {
        Store::with_backend(self.backend.clone(), StoreOptions::small_chunks()).unwrap()
    }
}

/// Sets the modification time of every file under `dir` back by `by`.
fn age_files(dir: &Path, by: Duration) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if entry.file_type().unwrap().is_dir() {
            age_files(&path, by);
        } else {
            let f = fs::File::options().write(true).open(&path).unwrap();
            let m = f.metadata().unwrap().modified().unwrap();
            f.set_modified(m - by).unwrap();
        }
    }
}

fn local() -> Option<Fixture> {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("store");
    let backend = Arc::new(LocalBackend::new(&root));
    Some(Fixture {
        backend,
        age: Box::new(move |by| age_files(&root, by)),
        dir,
        local: true,
        #[cfg(feature = "s3")]
        _server: None,
    })
}

fn memory() -> Option<Fixture> {
    let dir = tempfile::tempdir().unwrap();
    let mem = Arc::new(MemoryBackend::new(&dir.path().join("work")));
    let aged = mem.clone();
    Some(Fixture {
        backend: mem,
        age: Box::new(move |by| aged.age(by)),
        dir,
        local: false,
        #[cfg(feature = "s3")]
        _server: None,
    })
}

/// A backend as the suite uses it, and how to make its objects older.
#[cfg(feature = "s3")]
type WithAge = (Arc<dyn Backend>, Box<dyn Fn(Duration)>);

/// A store client on the S3 server `server` (prefix `site/a`); `wrap` gives the backend the suite uses
/// and how to age its objects.
#[cfg(feature = "s3")]
fn s3_client(
    server: Box<dyn common::s3::Endpoint>,
    wrap: impl FnOnce(Arc<dyn Backend>) -> WithAge,
) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let (access, secret) = server.keys();
    let config = gpu_checkpoint::store::backend::S3Config {
        bucket: server.bucket().into(),
        prefix: "site/a".into(),
        endpoint: Some(server.endpoint().into()),
        region: "us-east-1".into(),
        access_key_id: Some(access.into()),
        secret_access_key: Some(secret.into()),
        session_token: None,
        retry_timeout: Duration::from_secs(5),
        work_dir: Some(dir.path().join("work")),
    };
    fs::create_dir(dir.path().join("work")).unwrap();
    let backend = Arc::new(gpu_checkpoint::store::backend::S3Backend::new(config).unwrap());
    let (backend, age) = wrap(backend);
    Fixture {
        backend,
        age,
        dir,
        local: false,
        _server: Some(server),
    }
}

#[cfg(feature = "s3")]
fn s3() -> Option<Fixture> {
    let server = common::s3::S3Server::start()?;
    // s3s-fs's Last-Modified is its file's mtime: aged on its disk.
    let objects = server.object_file("site/a");
    Some(s3_client(Box::new(server), move |b| {
        (b, Box::new(move |by| age_files(&objects, by)))
    }))
}

/// s3s-fs through a local read-through cache of chunks ([`CachedBackend`](gpu_checkpoint::store::backend::CachedBackend),
/// what `restore --cache-dir` uses): the same semantics as the server alone.
#[cfg(feature = "s3")]
fn cached() -> Option<Fixture> {
    let server = common::s3::S3Server::start()?;
    let objects = server.object_file("site/a");
    Some(s3_client(Box::new(server), move |b| {
        let cache = tempfile::tempdir().unwrap();
        let backend =
            gpu_checkpoint::store::backend::CachedBackend::new(b, &cache.path().join("c")).unwrap();
        // The closure keeps the cache folder for the fixture's life.
        let age = move |by| {
            let _ = &cache;
            age_files(&objects, by)
        };
        (Arc::new(backend), Box::new(age))
    }))
}

/// Garage (the long test lane): its objects' times cannot be set, so the client sees them older through
/// [`Aged`].
#[cfg(feature = "s3")]
fn garage() -> Option<Fixture> {
    let server = common::garage::GarageServer::start()?;
    Some(s3_client(Box::new(server), aged))
}

/// moto's server (the long test lane), aged like garage.
#[cfg(feature = "s3")]
fn moto() -> Option<Fixture> {
    let server = common::moto::MotoServer::start()?;
    Some(s3_client(Box::new(server), aged))
}

/// `b` seen through [`Aged`], and how to age it.
#[cfg(feature = "s3")]
fn aged(b: Arc<dyn Backend>) -> WithAge {
    let aged = Arc::new(Aged {
        inner: b,
        shifts: Default::default(),
    });
    let a = aged.clone();
    (aged, Box::new(move |by| a.age(by)))
}

/// A backend that shows the chunks stored so far as older than the server says, by the times given to
/// [`Aged::age`]: gc's grace period made to pass on a server whose object times cannot be set. Chunks
/// written after an `age` call keep their real time.
#[cfg(feature = "s3")]
struct Aged {
    inner: Arc<dyn Backend>,
    /// (when `age` was called, by how much)
    shifts: std::sync::Mutex<Vec<(SystemTime, Duration)>>,
}

#[cfg(feature = "s3")]
impl Aged {
    fn age(&self, by: Duration) {
        self.shifts.lock().unwrap().push((SystemTime::now(), by));
    }

    fn shifted(&self, mut meta: ObjectMeta) -> ObjectMeta {
        if meta.key.starts_with(gpu_checkpoint::store::backend::CHUNKS) {
            if let Some(m) = meta.modified {
                let by: Duration = self
                    .shifts
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(at, _)| m <= *at)
                    .map(|(_, by)| *by)
                    .sum();
                meta.modified = Some(m - by);
            }
        }
        meta
    }
}

#[cfg(feature = "s3")]
impl ReadBackend for Aged {
    fn location(&self) -> &str {
        self.inner.location()
    }
    fn describe(&self, key: &str) -> String {
        self.inner.describe(key)
    }
    fn get(&self, key: &str, buf: &mut Vec<u8>) -> gpu_checkpoint::store::Result<bool> {
        self.inner.get(key, buf)
    }
    fn get_range(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
        buf: &mut Vec<u8>,
    ) -> gpu_checkpoint::store::Result<bool> {
        self.inner.get_range(key, range, buf)
    }
    fn head(&self, key: &str) -> gpu_checkpoint::store::Result<Option<ObjectMeta>> {
        Ok(self.inner.head(key)?.map(|m| self.shifted(m)))
    }
    fn list(
        &self,
        prefix: &str,
        f: &mut dyn FnMut(ObjectMeta),
    ) -> gpu_checkpoint::store::Result<()> {
        self.inner.list(prefix, &mut |m| f(self.shifted(m)))
    }
    fn prefetch(&self, key: &str) {
        self.inner.prefetch(key)
    }
    fn requests_in_flight(&self) -> usize {
        self.inner.requests_in_flight()
    }
    fn work_root(&self) -> Option<&Path> {
        self.inner.work_root()
    }
}

#[cfg(feature = "s3")]
impl Backend for Aged {
    fn init(&self) -> gpu_checkpoint::store::Result<()> {
        self.inner.init()
    }
    fn check_writable(&self) -> gpu_checkpoint::store::Result<()> {
        self.inner.check_writable()
    }
    fn put(&self, key: &str, parts: &[&[u8]], durable: bool) -> gpu_checkpoint::store::Result<()> {
        self.inner.put(key, parts, durable)
    }
    fn sync(&self, keys: &[String]) -> gpu_checkpoint::store::Result<()> {
        self.inner.sync(keys)
    }
    fn delete(&self, key: &str) -> gpu_checkpoint::store::Result<bool> {
        self.inner.delete(key)
    }
}

/// Runs each test against every backend: `local::NAME`, `memory::NAME`, `s3::NAME`, `cached::NAME` (s3s-fs
/// through a read cache) and (the long lane) `garage::NAME` and `moto::NAME`.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod local { $( #[test] fn $name() { if let Some(f) = super::local() { super::$name(&f) } } )* }
        mod memory { $( #[test] fn $name() { if let Some(f) = super::memory() { super::$name(&f) } } )* }
        #[cfg(feature = "s3")]
        mod s3 { $( #[test] fn $name() { if let Some(f) = super::s3() { super::$name(&f) } } )* }
        #[cfg(feature = "s3")]
        mod cached { $( #[test] fn $name() { if let Some(f) = super::cached() { super::$name(&f) } } )* }
        #[cfg(feature = "s3")]
        mod garage { $( #[test] fn $name() { if let Some(f) = super::garage() { super::$name(&f) } } )* }
        #[cfg(feature = "s3")]
        mod moto { $( #[test] fn $name() { if let Some(f) = super::moto() { super::$name(&f) } } )* }
    };
}

conformance!(
    objects_are_written_whole_read_by_range_listed_by_prefix_and_deleted,
    a_large_object_round_trips,
    checkpoints_round_trip_and_an_unchanged_one_writes_nothing,
    damage_is_found_by_verify_and_stops_a_restore,
    gc_keeps_what_manifests_reference_and_young_chunks,
    a_writer_announces_itself_and_gc_waits_for_it,
    a_chunk_taken_while_a_writer_reused_it_fails_the_commit,
    list_inspect_and_delete_by_name,
    a_read_after_a_write_or_delete_sees_it_even_if_prefetched_before,
    signed_manifests_are_used_only_when_a_trusted_key_signed_these_bytes,
);

fn a_read_after_a_write_or_delete_sees_it_even_if_prefetched_before(f: &Fixture) {
    let b = &*f.backend;
    b.init().unwrap();
    let mut buf = Vec::new();
    for (i, rewrite) in [true, false].into_iter().enumerate() {
        let key = format!("x/prefetched-{i}");
        b.put(&key, &[b"old"], true).unwrap();
        // Read ahead and done (a read that stopped early leaves such a prefetch behind).
        b.prefetch(&key);
        std::thread::sleep(Duration::from_millis(300));
        if rewrite {
            b.put(&key, &[b"new"], true).unwrap();
            assert!(b.get(&key, &mut buf).unwrap());
            assert_eq!(buf, b"new", "a prefetch from before the write was served");
        } else {
            b.delete(&key).unwrap();
            assert!(
                !b.get(&key, &mut buf).unwrap(),
                "a deleted object was served"
            );
        }
    }
}

fn objects_are_written_whole_read_by_range_listed_by_prefix_and_deleted(f: &Fixture) {
    let b = &*f.backend;
    b.init().unwrap();
    b.check_writable().unwrap();
    let mut buf = Vec::new();
    assert!(!b.get("x/missing", &mut buf).unwrap());
    assert!(b.head("x/missing").unwrap().is_none());
    b.put("x/one", &[b"hello ", b"world"], true).unwrap();
    b.put("x/sub/two", &[b"2"], false).unwrap();
    b.put("y/three", &[b"3"], false).unwrap();
    b.sync(&["x/sub/two".into(), "y/three".into()]).unwrap();
    assert!(b.get("x/one", &mut buf).unwrap());
    assert_eq!(buf, b"hello world");
    assert!(b.get_range("x/one", 6..11, &mut buf).unwrap());
    assert_eq!(buf, b"world");
    // A range past the end gives what there is.
    assert!(b.get_range("x/one", 6..100, &mut buf).unwrap());
    assert_eq!(buf, b"world");
    let head = b.head("x/one").unwrap().unwrap();
    assert_eq!((head.key.as_str(), head.size), ("x/one", 11));
    let age = SystemTime::now()
        .duration_since(head.modified.unwrap())
        .unwrap_or_default();
    assert!(age < Duration::from_secs(300), "modified {age:?} ago");
    let mut keys = Vec::new();
    b.list("x/", &mut |m| keys.push(m.key)).unwrap();
    keys.sort();
    assert_eq!(keys, ["x/one", "x/sub/two"]);
    // Write-once by content: the same bytes again are fine.
    b.put("x/one", &[b"hello world"], true).unwrap();
    b.delete("x/one").unwrap();
    assert!(!b.get("x/one", &mut buf).unwrap());
    let mut keys = Vec::new();
    b.list("x/", &mut |m| keys.push(m.key)).unwrap();
    assert_eq!(keys, ["x/sub/two"]);
}

fn a_large_object_round_trips(f: &Fixture) {
    // Larger than one multipart part on S3: sent in parts, read back whole.
    let b = &*f.backend;
    b.init().unwrap();
    let big = random(40 << 20, 9);
    b.put("manifests/big.json", &[&big[..1000], &big[1000..]], true)
        .unwrap();
    let mut buf = Vec::new();
    assert!(b.get("manifests/big.json", &mut buf).unwrap());
    assert!(buf == big, "the object came back different");
    assert!(b
        .get_range("manifests/big.json", (30 << 20)..(30 << 20) + 7, &mut buf)
        .unwrap());
    assert_eq!(buf, big[30 << 20..(30 << 20) + 7]);
}

fn write_images(dir: &Path, seed: u64) {
    let mut pages = random(600_000, seed);
    pages[100_000..300_000].fill(0);
    fs::write(dir.join("pages-1.img"), &pages).unwrap();
    fs::write(dir.join("core-1.img"), b"core").unwrap();
    fs::write(dir.join("empty.img"), b"").unwrap();
}

fn checkpoint(store: &Store, name: &str, seed: u64) -> gpu_checkpoint::store::CheckpointInfo {
    let ing = store.begin(Some(name)).unwrap();
    write_images(ing.staging_dir(), seed);
    ing.commit(serde_json::json!({"seed": seed}), &NoProgress)
        .unwrap()
}

fn same_images(dir: &Path, seed: u64) {
    let want = tempfile::tempdir().unwrap();
    write_images(want.path(), seed);
    for name in ["pages-1.img", "core-1.img", "empty.img"] {
        assert!(
            fs::read(dir.join(name)).unwrap() == fs::read(want.path().join(name)).unwrap(),
            "{name} differs"
        );
    }
}

fn checkpoints_round_trip_and_an_unchanged_one_writes_nothing(f: &Fixture) {
    let store = f.store();
    let first = checkpoint(&store, "job", 1);
    assert!(first.stats.new_chunks > 5);
    let out = f.dir.path().join("out");
    store.materialize("job", &out, &NoProgress).unwrap();
    same_images(&out, 1);
    // Streamed in order, as a streamed restore reads it.
    let mut streamed = Vec::new();
    store
        .stream_file(&first, "pages-1.img", &mut streamed, &NoProgress)
        .unwrap()
        .unwrap();
    assert!(streamed == fs::read(out.join("pages-1.img")).unwrap());
    let again = checkpoint(&store, "job", 1);
    assert_eq!(
        again.stats.new_chunks, 0,
        "an unchanged checkpoint wrote chunks"
    );
    assert_eq!(again.stats.new_bytes, 0);
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    assert_eq!(store.list().unwrap().len(), 2);
    // No lease is left behind.
    let mut leases = 0;
    f.backend.list(LEASES, &mut |_| leases += 1).unwrap();
    assert_eq!(leases, 0);
}

/// Flips the last byte of chunk `id`'s object, through the backend itself.
/// The id of the first chunk of `file` in checkpoint `info`.
fn first_chunk(
    info: &gpu_checkpoint::store::CheckpointInfo,
    file: &str,
) -> gpu_checkpoint::store::chunk::ChunkId {
    let f = info.files.iter().find(|f| f.path == file).unwrap();
    f.chunks[0].id.unwrap()
}

fn damage(b: &dyn Backend, id: &gpu_checkpoint::store::chunk::ChunkId) {
    let key = chunk_key(id);
    let mut obj = Vec::new();
    assert!(b.get(&key, &mut obj).unwrap());
    *obj.last_mut().unwrap() ^= 0x40;
    b.put(&key, &[&obj], true).unwrap();
}

fn damage_is_found_by_verify_and_stops_a_restore(f: &Fixture) {
    let store = f.store();
    let info = checkpoint(&store, "job", 2);
    let victim = first_chunk(&info, "pages-1.img");
    damage(&*f.backend, &victim);
    let report = store.verify(None, &NoProgress).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert_eq!(report.problems[0].chunk, Some(victim.to_hex()));
    let err = store
        .materialize(&info.id, &f.dir.path().join("out"), &NoProgress)
        .unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid, "{err}");
    assert!(
        !f.dir.path().join("out").exists(),
        "a partial image was left"
    );
    // A re-checkpoint of the same bytes writes the damaged chunk again.
    let again = checkpoint(&store, "job", 2);
    assert!(again.stats.new_chunks >= 1);
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
}

fn gc_keeps_what_manifests_reference_and_young_chunks(f: &Fixture) {
    let store = f.store();
    let keep = checkpoint(&store, "keep", 3);
    let gone = checkpoint(&store, "gone", 4);
    store.delete(&gone.id).unwrap();
    let report = store.gc().unwrap();
    assert_eq!(report.checkpoints, 1);
    if f.local {
        // The lock kept writers away: everything unreferenced goes at once.
        assert!(report.chunks_removed > 0);
    } else {
        // No lock: chunks younger than the grace period stay (a writer may have just written them).
        assert_eq!(report.chunks_removed, 0, "{report:?}");
        assert!(report.chunks_too_young > 0);
        (f.age)(GRACE + Duration::from_secs(60));
        let report = store.gc().unwrap();
        assert!(report.chunks_removed > 0, "{report:?}");
    }
    let out = f.dir.path().join("out");
    store.materialize(&keep.id, &out, &NoProgress).unwrap();
    same_images(&out, 3);
    assert!(store.verify(None, &NoProgress).unwrap().is_ok());
    let again = store.gc().unwrap();
    assert_eq!(again.chunks_removed, 0);
}

/// Progress that stalls an ingest's workers, after each stored its first chunk, until released.
struct Gate {
    reached: AtomicBool,
    open: AtomicBool,
    /// Lengths of the chunks stored so far.
    lens: std::sync::Mutex<Vec<u64>>,
}

impl Gate {
    fn new() -> Gate {
        Gate {
            reached: AtomicBool::new(false),
            open: AtomicBool::new(false),
            lens: Default::default(),
        }
    }

    /// Waits until a chunk of `len` bytes was stored.
    fn wait_for(&self, len: u64) {
        while !self.lens.lock().unwrap().contains(&len) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Progress for Gate {
    fn start(&self, _: &str, _: u64) {}
    fn advance(&self, len: u64) {
        self.lens.lock().unwrap().push(len);
        self.reached.store(true, Ordering::SeqCst);
        while !self.open.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    fn finish(&self) {}
}

fn a_writer_announces_itself_and_gc_waits_for_it(f: &Fixture) {
    let store = f.store();
    // Chunks that only a deleted checkpoint referenced, old enough for gc: the writer reuses them.
    let old = checkpoint(&store, "old", 5);
    store.delete(&old.id).unwrap();
    (f.age)(GRACE + Duration::from_secs(60));
    let ing = store.begin(Some("new")).unwrap();
    write_images(ing.staging_dir(), 5);
    let gate = Gate::new();
    let (info, gc) = std::thread::scope(|s| {
        let writer = s.spawn(|| ing.commit(serde_json::Value::Null, &gate).unwrap());
        while !gate.reached.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if !f.local {
            let mut leases = Vec::new();
            f.backend.list(LEASES, &mut |m| leases.push(m.key)).unwrap();
            assert_eq!(leases.len(), 1, "the writer's lease: {leases:?}");
        }
        let gc = s.spawn(|| store.gc().unwrap());
        std::thread::sleep(Duration::from_millis(300));
        assert!(!gc.is_finished(), "gc did not wait for the writer");
        gate.open.store(true, Ordering::SeqCst);
        (writer.join().unwrap(), gc.join().unwrap())
    });
    assert_eq!(info.stats.new_chunks, 0, "the writer reused the old chunks");
    assert!(gc.waited_ms >= 250, "{gc:?}");
    let out = f.dir.path().join("out");
    store.materialize("new", &out, &NoProgress).unwrap();
    same_images(&out, 5);
}

fn a_chunk_taken_while_a_writer_reused_it_fails_the_commit(f: &Fixture) {
    if f.local {
        return; // the lock makes this impossible there (store.rs tests gc against a writer)
    }
    let store = f.store();
    let old = checkpoint(&store, "old", 6);
    let ing = store.begin(Some("new")).unwrap();
    write_images(ing.staging_dir(), 6);
    let gate = Gate::new();
    // core-1.img's one chunk (4 bytes), the first piece the workers take: reused, and checked once the
    // gate has seen it.
    let taken = first_chunk(&old, "core-1.img");
    let err = std::thread::scope(|s| {
        let writer = s.spawn(|| ing.commit(serde_json::Value::Null, &gate));
        gate.wait_for(4);
        // What a gc on another node that did not see the lease would do.
        f.backend.delete_chunk(&taken).unwrap();
        gate.open.store(true, Ordering::SeqCst);
        writer.join().unwrap().unwrap_err()
    });
    assert!(matches!(err, Error::Conflict(_)), "{err}");
    assert_eq!(
        store.list().unwrap().len(),
        1,
        "the failed checkpoint is listed"
    );
}

fn list_inspect_and_delete_by_name(f: &Fixture) {
    let store = f.store();
    let a = checkpoint(&store, "a", 7);
    let b = checkpoint(&store, "b", 8);
    assert_eq!(store.get("b").unwrap().id, b.id);
    assert!(store.manifest_location(&a.id).contains(&a.id));
    assert_eq!(store.manifest_path(&a.id).is_some(), f.local);
    store.delete("a").unwrap();
    let err = store.get("a").unwrap_err();
    assert_eq!(err.exit_status(), ExitStatus::CheckpointInvalid);
    let ids: Vec<String> = store.list().unwrap().into_iter().map(|i| i.id).collect();
    assert_eq!(ids, [b.id]);
}

/// A store handle on the fixture's backend with `edit` applied to its options.
fn store_with(f: &Fixture, edit: impl FnOnce(&mut StoreOptions)) -> Store {
    let mut opts = StoreOptions::small_chunks();
    edit(&mut opts);
    Store::with_backend(f.backend.clone(), opts).unwrap()
}

fn signed_manifests_are_used_only_when_a_trusted_key_signed_these_bytes(f: &Fixture) {
    use gpu_checkpoint::store::signing::{self, Signature, SigningKey, TrustedKeys};
    let key_file = f.dir.path().join("node.key");
    let public = signing::generate_key_files(&key_file).unwrap();
    let key = Arc::new(SigningKey::load(&key_file).unwrap());
    let signer = store_with(f, |o| o.sign_key = Some(key.clone()));
    let signed = checkpoint(&signer, "job", 3);
    let plain = checkpoint(&f.store(), "plain", 4);
    let trusting = |keys| {
        store_with(f, |o| {
            o.trusted_keys = Some(Arc::new(TrustedKeys::new(keys)))
        })
    };
    let trust = trusting(vec![public]);
    let refused = |store: &Store, id: &str, why: &str| {
        let out = f.dir.path().join("refused");
        let err = store.materialize(id, &out, &NoProgress).unwrap_err();
        assert_eq!(err.exit_status(), ExitStatus::PermissionDenied, "{err}");
        assert!(err.to_string().contains(why), "{err}");
        assert!(!out.exists(), "something was restored");
    };

    // Signed: restores with its key; list and inspect see who signed it.
    let out = f.dir.path().join("out");
    trust.materialize("job", &out, &NoProgress).unwrap();
    same_images(&out, 3);
    let by = Signature::Signed {
        key_id: public.id(),
    };
    assert_eq!(trust.signature(&signed.id).unwrap(), by);
    assert_eq!(f.store().signature(&plain.id).unwrap(), Signature::Unsigned);
    let report = trust.verify(Some("job"), &NoProgress).unwrap();
    assert!(report.is_ok(), "{:?}", report.problems);
    assert_eq!(report.signatures[&signed.id], by);

    // Unsigned, or signed by a key not trusted: refused before anything is read.
    refused(&trust, &plain.id, "not signed");
    refused(&trust, "plain", "not signed");
    let other = SigningKey::from_pkcs8(&fs::read(&key_file).unwrap()).unwrap();
    assert_eq!(other.public(), public);
    let stranger = f.dir.path().join("stranger.key");
    let stranger = signing::generate_key_files(&stranger).unwrap();
    refused(&trusting(vec![stranger]), &signed.id, "not a trusted key");
    // Without trusted keys nothing changes: an unsigned checkpoint restores.
    f.store()
        .materialize(&plain.id, &f.dir.path().join("plain"), &NoProgress)
        .unwrap();

    // The signed manifest's chunk list swapped for the unsigned checkpoint's (checksum made right): its
    // signature no longer matches; refused with trusted keys, reported by verify either way.
    let mut edited = signed.clone();
    edited.files = plain.files.clone();
    let bytes = gpu_checkpoint::store::manifest::encode(&edited);
    f.backend
        .put(
            &gpu_checkpoint::store::backend::manifest_key(&signed.id),
            &[&bytes],
            true,
        )
        .unwrap();
    refused(&trust, &signed.id, "does not match");
    let report = trust.verify(None, &NoProgress).unwrap();
    assert_eq!(report.problems.len(), 2, "{:?}", report.problems);
    let report = f.store().verify(Some(&signed.id), &NoProgress).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert!(matches!(
        report.signatures[&signed.id],
        Signature::Bad { .. }
    ));

    // Trusted keys never keep a checkpoint from being deleted.
    let doomed = checkpoint(&f.store(), "doomed", 6);
    trust.delete(&doomed.id).unwrap();
    // Deleting a checkpoint deletes its signature; gc removes a signature whose manifest is gone.
    let sig_key = gpu_checkpoint::store::backend::signature_key;
    let mut buf = Vec::new();
    signer.delete(&signed.id).unwrap();
    assert!(!f.backend.get(&sig_key(&signed.id), &mut buf).unwrap());
    let orphan = checkpoint(&signer, "orphan", 5);
    f.backend
        .delete(&gpu_checkpoint::store::backend::manifest_key(&orphan.id))
        .unwrap();
    // A local store's signature cut short by a crash (its temporary name) goes too.
    let temp = f.dir.path().join("store/manifests/.x.sig.tmp.1.2.3");
    if f.local {
        fs::write(&temp, b"{").unwrap();
    }
    (f.age)(GRACE * 2);
    let report = signer.gc().unwrap();
    assert_eq!(report.orphan_signatures_removed, 1);
    assert!(!temp.exists());
    assert_eq!(report.stale_temp_removed, f.local as u64);
    assert!(!f.backend.get(&sig_key(&orphan.id), &mut buf).unwrap());
}
