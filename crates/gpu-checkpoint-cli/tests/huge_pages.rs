//! Memory that was in transparent huge pages comes back in huge pages: the userfaultfd restore copies
//! 4 KiB pages, then collapses what a huge page can hold (`MADV_COLLAPSE`). Real CRIU, as root.

mod common;

use common::*;

/// `AnonHugePages` of a process, in KiB.
fn anon_huge_kib(pid: i32) -> u64 {
    gpu_checkpoint::thp::anon_huge_bytes(&pid.to_string()) >> 10
}

#[test]
fn memory_in_huge_pages_comes_back_in_huge_pages_both_ways_of_resuming() {
    let Some((dir, store)) = criu_scene() else {
        return;
    };
    if gpu_checkpoint::thp::mode() == Some(gpu_checkpoint::thp::Mode::Never) {
        eprintln!("SKIPPED: transparent huge pages are off on this kernel");
        return;
    }
    let (w, checksum) = memory_workload_with(dir.path(), &["--mib", "256", "--huge", "1"]);
    let before = anon_huge_kib(w.pid);
    if before < 128 << 10 {
        eprintln!("SKIPPED: the workload got {before} kB of huge pages (no free huge pages here?)");
        return;
    }
    let ck = checkpoint(w.pid, &store, &[]);
    let id = ck["id"].as_str().unwrap();
    for resume in ["early", "filled"] {
        // What the state file shows next comes from the restored copy.
        w.blank_state();
        let s = store.to_str().unwrap();
        let args = [
            "restore",
            id,
            "--storage",
            s,
            "--format",
            "json",
            "--resume",
            resume,
        ];
        let out = ok(&gc(&args));
        let out: serde_json::Value = serde_json::from_str(&out).unwrap();
        let after = anon_huge_kib(w.pid);
        assert!(
            after >= before * 9 / 10,
            "{resume}: {after} kB of huge pages after the restore, {before} kB before: {out}"
        );
        assert!(
            out["timings_ms"]["uffd"]["huge_bytes"].as_u64().unwrap() >= before << 10 >> 1,
            "{out}"
        );
        let r = w.wait_state("re-verified after the restore", |r| {
            r.len() == 1 && r[0].contains_key("verified")
        });
        assert_eq!(num(&r[0], "bad"), 0, "{r:?}");
        assert_eq!(r[0]["checksum"], checksum);
        w.kill_and_wait_free();
    }
}
