//! Tests of the fill, copying into this test process's own memory through a real userfaultfd (where the
//! kernel lets an unprivileged test open one; skipped with the reason otherwise).

use super::*;
use crate::dump::images::{PE_LAZY, PE_PRESENT};
use crate::flows::restore::uffd::plan::tests::pagemap;
use crate::flows::restore::uffd::plan::Task;
use crate::store::{ChunkParams, NoProgress, StoreOptions};
use crate::testdata::XorShift64;

const P: u64 = 4096;

/// A private anonymous mapping of `pages` pages of this process, registered with a userfaultfd, unmapped
/// on drop.
struct Mem {
    base: u64,
    len: usize,
}

impl Mem {
    fn new(pages: u64, uffd: &OwnedFd) -> Mem {
        use nix::sys::mman::{mmap_anonymous, MapFlags, ProtFlags};
        let len = (pages * P) as usize;
        // SAFETY: a fresh mapping of our own, unmapped on drop.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                std::num::NonZeroUsize::new(len).unwrap(),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .unwrap();
        let base = ptr.as_ptr() as u64;
        sys::register_missing(uffd.as_raw_fd(), base, len as u64).unwrap();
        Mem { base, len }
    }

    /// Its bytes: only once nothing is registered any more, or every page is in (a missing page of a
    /// registered range would block the reader).
    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is ours and readable for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.base as *const u8, self.len) }
    }
}

impl Drop for Mem {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `new`; no slice of it outlives `self`.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

fn uffd() -> Option<OwnedFd> {
    match sys::open(libc::O_CLOEXEC | libc::O_NONBLOCK) {
        Ok(fd) => {
            sys::handshake(fd.as_raw_fd()).unwrap();
            Some(fd)
        }
        Err(e) => {
            eprintln!("skipped: userfaultfd unavailable here ({e})");
            None
        }
    }
}

/// A store holding `img` as page image `pages-3.img`, cut into small content-defined chunks that do not
/// fall on page bounds (as builds before page-aligned cuts stored them).
fn store_with(img: &[u8]) -> (tempfile::TempDir, Store, CheckpointInfo) {
    let t = tempfile::tempdir().unwrap();
    let store = Store::open(
        t.path(),
        StoreOptions {
            chunking: ChunkParams {
                min_size: 6 * 1024,
                avg_size: 10 * 1024,
                max_size: 32 * 1024,
            },
            threads: 3,
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let ing = store.begin(None).unwrap();
    // Stored under another name so that it is cut like any file, not on page bounds.
    std::fs::write(ing.staging_dir().join("image-3"), img).unwrap();
    let mut info = ing.commit(serde_json::json!({}), &NoProgress).unwrap();
    info.files[0].path = "pages-3.img".into();
    assert!(
        info.files[0]
            .chunks
            .iter()
            .any(|c| !(c.len as u64).is_multiple_of(P)),
        "chunks cut pages"
    );
    (t, store, info)
}

/// The page image of the tests: 38 pages, of which pages 2..38 are lazy: a zero run, random data, and a
/// compressible run (zero, raw and compressed chunks).
fn image() -> Vec<u8> {
    let mut img = vec![0u8; (38 * P) as usize];
    let mut rng = XorShift64::new(0x9e37_79b9_7f4a_7c15);
    for (i, b) in img.iter_mut().enumerate() {
        let x = rng.next_u64();
        *b = match (i as u64) / P {
            0..=1 => 0x55,      // kept: CRIU's part
            2..=9 => 0,         // zero chunks
            10..=25 => x as u8, // raw chunks
            _ => b"abc"[i % 3], // compressed chunks
        };
    }
    img
}

/// The memory of a test, its page image stored, and the plan that fills one from the other.
struct Setup {
    mem: Mem,
    img: Vec<u8>,
    _dir: tempfile::TempDir,
    store: Store,
    info: CheckpointInfo,
    plan: Plan,
}

fn setup(fd: &OwnedFd) -> Setup {
    let pages = 40u64;
    let mem = Mem::new(pages, fd);
    let img = image();
    let (dir, store, info) = store_with(&img);
    let plan = plan_for(mem.base, pages);
    Setup {
        mem,
        img,
        _dir: dir,
        store,
        info,
        plan,
    }
}

fn plan_for(base: u64, pages: u64) -> Plan {
    let pm = pagemap(&[
        (base, 2, PE_PRESENT),
        (base + 2 * P, 36, PE_PRESENT | PE_LAZY),
    ]);
    let task = Task::of(77, &pm, &[(base, base + pages * P)], P, &vec![]).unwrap();
    Plan {
        tasks: vec![task],
        ..Plan::default()
    }
}

#[test]
fn the_background_fill_copies_pages_cut_by_chunk_bounds_into_a_registered_mapping() {
    let Some(fd) = uffd() else { return };
    assert!(super::super::available());
    let t = setup(&fd);
    let (mem, img, info) = (&t.mem, &t.img, &t.info);
    let filler = Filler::new(&t.plan, &t.store, info);
    filler.add_process(77, fd);
    filler.fill_in_background(&NoProgress).unwrap();
    let stats = filler.stats();
    filler.close();
    assert_eq!(stats.processes, 1);
    assert_eq!(stats.copied_bytes + stats.zero_bytes, 36 * P);
    assert!(stats.zero_bytes > 0, "the zero run was not copied");
    let got = mem.bytes();
    assert!(
        got[..(2 * P) as usize].iter().all(|&b| b == 0),
        "CRIU's pages are not ours to copy"
    );
    assert!(
        got[(2 * P) as usize..(38 * P) as usize] == img[(2 * P) as usize..],
        "the lazy pages"
    );
    assert!(got[(38 * P) as usize..].iter().all(|&b| b == 0));
}

/// A fault puts its chunks ahead of the background fill: with no background fill at all, the urgent path
/// alone copies the page a fault asked for (the page cut by a chunk boundary assembled from both sides),
/// and a page dropped meanwhile (`MADV_DONTNEED`'s event) is never copied but answered with zeros.
#[test]
fn a_fault_is_served_from_its_chunk_and_dropped_memory_is_not_copied() {
    let Some(fd) = uffd() else { return };
    let t = setup(&fd);
    let (mem, img, info) = (&t.mem, &t.img, &t.info);
    let filler = Filler::new(&t.plan, &t.store, info);
    let space = filler.add_process(77, fd);
    // The process dropped pages 30..32 before they came.
    filler.dropped(&space, mem.base + 30 * P, mem.base + 32 * P);
    // A page in the random run, one cut by a chunk boundary, and a dropped one.
    let cut = info.files[0]
        .chunks
        .iter()
        .scan(0u64, |at, c| {
            *at += c.len as u64;
            Some(*at)
        })
        .find(|&b| b > 10 * P && b < 28 * P && b % P != 0)
        .expect("a chunk boundary inside a page of the random run")
        / P
        * P;
    let faults = [mem.base + 12 * P + 5, mem.base + cut, mem.base + 31 * P];
    /// Stops the fill when dropped: a failed assertion must not leave the scope waiting for the thread.
    struct StopOnDrop<'f, 'a>(&'f Filler<'a>);
    impl Drop for StopOnDrop<'_, '_> {
        fn drop(&mut self) {
            self.0.stop();
        }
    }
    std::thread::scope(|s| {
        let _stop = StopOnDrop(&filler);
        let urgent = s.spawn(|| filler.serve_urgent());
        for a in faults {
            filler.fault(&space, a).unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while [12 * P, cut]
            .iter()
            .any(|&o| lock(&space.pending).find(mem.base + o).is_some())
        {
            assert!(
                std::time::Instant::now() < deadline,
                "faults not served: {:?}",
                filler.take_error()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        filler.stop();
        urgent.join().unwrap();
    });
    assert!(filler.take_error().is_none());
    let left = lock(&space.pending).bytes();
    assert!(left > 0 && left < 34 * P, "only the faults' chunks: {left}");
    // The last holder of the descriptor: with it gone, untouched pages read as zeros instead of waiting.
    drop(space);
    filler.close();
    let got = mem.bytes();
    for o in [12 * P, cut] {
        let r = o as usize..(o + P) as usize;
        assert!(
            got[r.clone()] == img[r],
            "page at {o} served from its chunks"
        );
    }
    assert!(
        got[(30 * P) as usize..(32 * P) as usize]
            .iter()
            .all(|&b| b == 0),
        "dropped pages read as zeros"
    );
    assert_eq!(filler.stats().dropped_bytes, 2 * P);
}
