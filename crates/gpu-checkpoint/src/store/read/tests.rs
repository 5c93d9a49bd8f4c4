//! The read-ahead's order against the workers, alone and through a whole restore.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::*;
use crate::store::backend::{Backend, MemoryBackend, ObjectMeta, ReadBackend};
use crate::store::{NoProgress, Result, Store, StoreOptions};

#[test]
fn the_prefetcher_stays_ahead_by_at_most_its_window_and_stops() {
    let p = Prefetcher::new(3, u64::MAX);
    let fetched = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        s.spawn(|| p.run(100, &|_| 1, &|i| fetched.lock().unwrap().push(i)));
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
    let p = Prefetcher::new(4, u64::MAX);
    p.taken(2);
    let fetched = Mutex::new(Vec::new());
    p.run(6, &|_| 1, &|i| fetched.lock().unwrap().push(i));
    assert_eq!(*fetched.lock().unwrap(), vec![2, 3, 4, 5]);
}

#[test]
fn a_worker_taking_the_task_being_announced_waits_for_the_announcement() {
    let p = Prefetcher::new(4, u64::MAX);
    let events = Mutex::new(Vec::new());
    let started = (Mutex::new(false), Condvar::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            p.run(1, &|_| 1, &|_| {
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
/// stays pending (its bytes held, as S3's are in memory) until a read takes it; a read with none pending
/// fetches. `late_first`: its first prefetch is slow to start (it waits, at most `SLOW`, until a worker
/// read its key): the late read-ahead that S3's latency makes likely, made certain. Otherwise every read
/// is slow (2 ms, a GET's latency) and the read path is told the read-ahead is held in memory.
struct CountingFetches {
    inner: MemoryBackend,
    state: Mutex<Fetches>,
    read: Condvar,
    late_first: bool,
}

impl CountingFetches {
    fn new(dir: &Path, late_first: bool) -> CountingFetches {
        CountingFetches {
            inner: MemoryBackend::new(dir),
            state: Mutex::default(),
            read: Condvar::new(),
            late_first,
        }
    }
}

#[derive(Default)]
struct Fetches {
    per_key: HashMap<String, usize>,
    /// Prefetched and not read yet, with their bytes.
    pending: HashMap<String, u64>,
    read: Vec<String>,
    prefetches: usize,
    pending_bytes: u64,
    most_bytes: u64,
    most_chunks: usize,
}

/// A store in `dir` on a [`CountingFetches`] backend (`late_first` as its own) holding one checkpoint
/// of `len` pseudo-random bytes (`seed`) in `pages-1.img`: the backend, the store, the checkpoint and
/// its bytes.
fn counted_pages(
    dir: &std::path::Path,
    late_first: bool,
    seed: u64,
    len: usize,
) -> (Arc<CountingFetches>, Store, CheckpointInfo, Vec<u8>) {
    let backend = Arc::new(CountingFetches::new(dir, late_first));
    let store = Store::with_backend(backend.clone(), StoreOptions::small_chunks()).unwrap();
    let ing = store.begin(Some("job")).unwrap();
    let pages = crate::testdata::XorShift64::new(seed).bytes(len);
    std::fs::write(ing.staging_dir().join("pages-1.img"), &pages).unwrap();
    let info = ing.commit(serde_json::json!({}), &NoProgress).unwrap();
    (backend, store, info, pages)
}

const SLOW: Duration = Duration::from_millis(300);

impl ReadBackend for CountingFetches {
    fn location(&self) -> &str {
        self.inner.location()
    }
    fn get(&self, key: &str, buf: &mut Vec<u8>) -> Result<bool> {
        if !self.late_first {
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut st = self.state.lock().unwrap();
        match st.pending.remove(key) {
            Some(n) => st.pending_bytes -= n,
            None => *st.per_key.entry(key.to_owned()).or_default() += 1,
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
    fn prefetch(&self, key: &str) {
        let n = self.inner.head(key).unwrap().map_or(0, |m| m.size);
        let mut st = self.state.lock().unwrap();
        st.prefetches += 1;
        if self.late_first && st.prefetches == 1 {
            let t0 = Instant::now();
            while !st.read.iter().any(|k| k == key) && t0.elapsed() < SLOW {
                st = self.read.wait_timeout(st, SLOW / 10).unwrap().0;
            }
        }
        if st.pending.insert(key.to_owned(), n).is_none() {
            *st.per_key.entry(key.to_owned()).or_default() += 1;
            st.pending_bytes += n;
        }
        st.most_bytes = st.most_bytes.max(st.pending_bytes);
        st.most_chunks = st.most_chunks.max(st.pending.len());
    }
    fn read_ahead_in_memory(&self) -> bool {
        !self.late_first
    }
    fn work_root(&self) -> Option<&Path> {
        self.inner.work_root()
    }
}

impl Backend for CountingFetches {
    crate::store::backend::forward_writes!(
        inner: init, check_writable, put, sync, delete, memory_in_flight
    );
}

#[test]
fn a_restore_fetches_every_chunk_once_and_leaves_no_read_ahead_pending() {
    let dir = tempfile::tempdir().unwrap();
    let (backend, store, info, pages) = counted_pages(dir.path(), true, 0x9e37_79b9, 1 << 20);
    let chunks: Vec<String> = info.files[0]
        .chunks
        .iter()
        .map(|c| crate::store::backend::chunk_key(&c.id.unwrap()))
        .collect();
    assert!(chunks.len() > 20, "{} chunks", chunks.len());

    // Whether the prefetcher gets ahead of the workers at all is up to the scheduler (on a loaded machine
    // the workers may fetch everything first): try a few times for a restore that read ahead; every try
    // must fetch each chunk exactly once and leave nothing pending.
    for attempt in 0..5 {
        *backend.state.lock().unwrap() = Fetches::default();
        let out = dir.path().join(format!("out{attempt}"));
        store.materialize("job", &out, &NoProgress).unwrap();
        assert!(std::fs::read(out.join("pages-1.img")).unwrap() == pages);
        let st = backend.state.lock().unwrap();
        for key in &chunks {
            assert_eq!(st.per_key.get(key), Some(&1), "{key} fetched so many times");
        }
        assert!(
            st.pending.is_empty(),
            "read-ahead left pending: {:?}",
            st.pending
        );
        if st.prefetches > 0 {
            return;
        }
    }
    panic!("nothing was read ahead in 5 restores");
}

#[test]
fn the_prefetcher_holds_at_most_its_bytes_ahead_of_slow_workers() {
    // Sizes 1..=7 bytes, at most 10 held (but never fewer than one task), 100 tasks allowed by count: only
    // the bytes bound the window.
    let size = |i: usize| (i % 7 + 1) as u64;
    let p = Prefetcher::new(100, 10);
    let most = Mutex::new(0u64);
    let announced = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            p.run(60, &size, &|i| {
                announced.lock().unwrap().push(i);
                let held = p.held_bytes();
                let mut m = most.lock().unwrap();
                *m = (*m).max(held);
            })
        });
        // A slow worker: takes a task every millisecond.
        for i in 0..60 {
            std::thread::sleep(Duration::from_millis(1));
            p.taken(i + 1);
        }
        p.stop();
    });
    let most = *most.lock().unwrap();
    assert!(most <= 10, "{most} bytes held ahead, bound 10");
    assert!(most >= 7, "the window was never used ({most} bytes)");
    let announced = announced.lock().unwrap();
    assert!(announced.windows(2).all(|w| w[0] < w[1]), "{announced:?}");
}

#[test]
fn a_restore_from_a_backend_holding_read_ahead_in_memory_stays_within_the_plan_and_reads_far_ahead()
{
    let dir = tempfile::tempdir().unwrap();
    let (backend, store, info, pages) = counted_pages(dir.path(), false, 0x5eed, 2 << 20);
    let plan = read_plan(&store.inner, &info);
    assert!(plan.ahead_bytes < u64::MAX && plan.workers >= 1, "{plan:?}");

    *backend.state.lock().unwrap() = Fetches::default();
    let out = dir.path().join("out");
    store.materialize("job", &out, &NoProgress).unwrap();
    assert!(std::fs::read(out.join("pages-1.img")).unwrap() == pages);
    let st = backend.state.lock().unwrap();
    assert!(
        st.most_bytes <= plan.ahead_bytes,
        "{} bytes held ahead, plan {}",
        st.most_bytes,
        plan.ahead_bytes
    );
    // Deeper than the page cache's 16 (and the chunks the workers hold being read): with a slow GET, the
    // requests in flight are what keep a restore from an object store fast.
    assert!(
        st.most_chunks > PREFETCH_AHEAD + plan.workers,
        "only {} chunks read ahead ({} workers)",
        st.most_chunks,
        plan.workers
    );
    assert!(
        st.pending.is_empty(),
        "left pending: {:?}",
        st.pending.keys()
    );
}

/// Readers of the caller's own (the userfaultfd fill's urgent path) share the memory budget with the
/// workers: where the budget bounds the workers, they are fewer by as many.
#[test]
fn readers_beside_the_workers_share_their_memory_budget() {
    let dir = tempfile::tempdir().unwrap();
    let opts = crate::store::StoreOptions {
        threads: 64,
        ..Default::default()
    };
    let store = Store::open(dir.path(), opts).unwrap();
    let ing = store.begin(None).unwrap();
    std::fs::write(ing.staging_dir().join("pages-1.img"), b"x").unwrap();
    let mut info = ing.commit(serde_json::json!({}), &NoProgress).unwrap();
    // 20 GiB of images: a budget of 1% (205 MiB, less the reserve), 10 MiB per reader of 4 MiB chunks.
    info.stats.logical_bytes = 20 << 30;
    let alone = read_plan(&store.inner, &info);
    let beside = super::read_plan_beside(&store.inner, &info, 2);
    assert_eq!(alone.workers, 19, "{alone:?}");
    assert_eq!(beside.workers, 17, "{beside:?}");
}
