//! The read-ahead's order against the workers, alone and through a whole restore.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::store::backend::{Backend, MemoryBackend, ObjectMeta};
use crate::store::{ChunkParams, NoProgress, Result, Store, StoreOptions};

#[test]
fn the_prefetcher_stays_ahead_by_at_most_its_window_and_stops() {
    let p = Prefetcher::new(3);
    let fetched = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        s.spawn(|| p.run(100, &|i| fetched.lock().unwrap().push(i)));
        let wait_for = |n: usize| {
            let t0 = Instant::now();
            while fetched.lock().unwrap().len() < n {
                assert!(t0.elapsed().as_secs() < 10, "prefetcher stuck");
                std::thread::yield_now();
            }
        };
        wait_for(3);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(*fetched.lock().unwrap(), vec![0, 1, 2], "nothing taken yet");
        // Tasks 3 and 4 were taken before their turn came: not announced.
        p.taken(5);
        wait_for(6);
        std::thread::sleep(Duration::from_millis(50));
        p.stop();
    });
    assert_eq!(
        *fetched.lock().unwrap(),
        vec![0, 1, 2, 5, 6, 7],
        "5 taken + 3 ahead"
    );
}

#[test]
fn a_task_taken_before_the_prefetcher_reached_it_is_not_announced() {
    let p = Prefetcher::new(4);
    p.taken(2);
    let fetched = Mutex::new(Vec::new());
    p.run(6, &|i| fetched.lock().unwrap().push(i));
    assert_eq!(*fetched.lock().unwrap(), vec![2, 3, 4, 5]);
}

#[test]
fn a_worker_taking_the_task_being_announced_waits_for_the_announcement() {
    let p = Prefetcher::new(4);
    let events = Mutex::new(Vec::new());
    let started = (Mutex::new(false), Condvar::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            p.run(1, &|_| {
                *started.0.lock().unwrap() = true;
                started.1.notify_all();
                std::thread::sleep(Duration::from_millis(100));
                events.lock().unwrap().push("announced");
            })
        });
        let mut go = started.0.lock().unwrap();
        while !*go {
            go = started.1.wait(go).unwrap();
        }
        drop(go);
        p.taken(1);
        events.lock().unwrap().push("read");
    });
    assert_eq!(*events.lock().unwrap(), vec!["announced", "read"]);
}

/// A memory backend that counts fetches the way the S3 backend makes them: a prefetch starts a fetch and
/// stays pending until a read takes it; a read with none pending fetches. Its first prefetch is slow
/// to start (it waits, at most `SLOW`, until a worker read its key): the late read-ahead that S3's
/// latency makes likely, made certain.
struct CountingFetches {
    inner: MemoryBackend,
    state: Mutex<Fetches>,
    read: Condvar,
}

#[derive(Default)]
struct Fetches {
    per_key: HashMap<String, usize>,
    pending: HashMap<String, ()>,
    read: Vec<String>,
    prefetches: usize,
}

const SLOW: Duration = Duration::from_millis(300);

impl Backend for CountingFetches {
    fn location(&self) -> &str {
        self.inner.location()
    }
    fn init(&self) -> Result<()> {
        self.inner.init()
    }
    fn check_writable(&self) -> Result<()> {
        self.inner.check_writable()
    }
    fn put(&self, key: &str, parts: &[&[u8]], durable: bool) -> Result<()> {
        self.inner.put(key, parts, durable)
    }
    fn sync(&self, keys: &[String]) -> Result<()> {
        self.inner.sync(keys)
    }
    fn get(&self, key: &str, buf: &mut Vec<u8>) -> Result<bool> {
        let mut st = self.state.lock().unwrap();
        if st.pending.remove(key).is_none() {
            *st.per_key.entry(key.to_owned()).or_default() += 1;
        }
        st.read.push(key.to_owned());
        self.read.notify_all();
        drop(st);
        self.inner.get(key, buf)
    }
    fn get_range(&self, key: &str, range: Range<u64>, buf: &mut Vec<u8>) -> Result<bool> {
        self.inner.get_range(key, range, buf)
    }
    fn head(&self, key: &str) -> Result<Option<ObjectMeta>> {
        self.inner.head(key)
    }
    fn list(&self, prefix: &str, f: &mut dyn FnMut(ObjectMeta)) -> Result<()> {
        self.inner.list(prefix, f)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(key)
    }
    fn prefetch(&self, key: &str) {
        let mut st = self.state.lock().unwrap();
        st.prefetches += 1;
        if st.prefetches == 1 {
            let t0 = Instant::now();
            while !st.read.iter().any(|k| k == key) && t0.elapsed() < SLOW {
                st = self.read.wait_timeout(st, SLOW / 10).unwrap().0;
            }
        }
        if st.pending.insert(key.to_owned(), ()).is_none() {
            *st.per_key.entry(key.to_owned()).or_default() += 1;
        }
    }
    fn work_root(&self) -> Option<&Path> {
        self.inner.work_root()
    }
}

#[test]
fn a_restore_fetches_every_chunk_once_and_leaves_no_read_ahead_pending() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(CountingFetches {
        inner: MemoryBackend::new(dir.path()),
        state: Mutex::default(),
        read: Condvar::new(),
    });
    let opts = StoreOptions {
        zstd_level: 1,
        compress: true,
        threads: 2,
        chunking: ChunkParams {
            min_size: 4096,
            avg_size: 16384,
            max_size: 65536,
        },
    };
    let store = Store::with_backend(backend.clone(), opts).unwrap();
    let ing = store.begin(Some("job")).unwrap();
    let pages = crate::testdata::XorShift64::new(0x9e37_79b9).bytes(1 << 20);
    std::fs::write(ing.staging_dir().join("pages-1.img"), &pages).unwrap();
    let info = ing.commit(serde_json::json!({}), &NoProgress).unwrap();
    let chunks: Vec<String> = info.files[0]
        .chunks
        .iter()
        .map(|c| crate::store::backend::chunk_key(&c.id.unwrap()))
        .collect();
    assert!(chunks.len() > 20, "{} chunks", chunks.len());

    *backend.state.lock().unwrap() = Fetches::default();
    let out = dir.path().join("out");
    store.materialize("job", &out, &NoProgress).unwrap();
    assert!(std::fs::read(out.join("pages-1.img")).unwrap() == pages);
    let st = backend.state.lock().unwrap();
    assert!(st.prefetches > 0, "nothing was read ahead");
    for key in &chunks {
        assert_eq!(st.per_key.get(key), Some(&1), "{key} fetched so many times");
    }
    assert!(
        st.pending.is_empty(),
        "read-ahead left pending: {:?}",
        st.pending
    );
}
