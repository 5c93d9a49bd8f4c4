//! A `--leave-running` checkpoint is one moment of the process, with real CRIU and the default
//! (streamed) dump: the `generations` workload rewrites a word of every page of 64 MiB in a tight loop
//! and checks, at the start of every generation, that every page holds the previous one; its restored
//! copy goes on doing so. A snapshot of two moments (torn) makes it exit 3 with `torn=1` in its state.
//!
//! The tear it guards against: streamed, the pages CRIU hands the store are references to the process's
//! own (vmsplice + splice), so a tree CRIU resumes while the last of them still wait in the pipe writes
//! into the checkpoint. A streamed `--leave-running` dump therefore has CRIU leave the tree stopped, and
//! the tool continues it once the store has read every image (docs/criu.md). With CRIU made to resume a
//! streamed tree again (the old way), this test failed 8 of 10 runs beside two CPU hogs (5 copies found
//! a page of another generation, 3 died at once); as it is, it passed 10 of 10 the same way.
//!
//! Needs root and CRIU: fails in CI without them, skips locally with the reason.

mod common;

use common::*;

/// The `gen` and `torn` fields of the workload's record.
fn generation(w: &Workload) -> (u64, u64) {
    let r = gpu_checkpoint_workloads::read_state(&w.state).unwrap();
    (num(&r[0], "gen"), num(&r[0], "torn"))
}

#[test]
fn a_leave_running_checkpoint_of_a_process_rewriting_its_memory_restores_one_moment() {
    let Some((dir, store)) = criu_scene() else {
        return;
    };
    let w = Workload::start("generations", dir.path(), &["--mib", "64"]);
    w.wait_state("a few generations", |r| {
        r.len() == 1 && num(&r[0], "gen") >= 3
    });
    // Three rounds: each restored copy is checkpointed in turn, so a tear has three chances to show.
    for round in 0..3 {
        let ck = checkpoint(w.pid, &store, &["--leave-running"]);
        assert_eq!(ck["stopped"], false);
        let (at, _) = generation(&w);
        let on = w.wait_state("the original going on", |r| num(&r[0], "gen") > at + 20);
        assert_eq!(
            num(&on[0], "torn"),
            0,
            "round {round}: the original: {on:?}"
        );
        w.kill_and_wait_free();
        // What the file shows from now on comes from the copy.
        w.blank_state();
        let pid = restore(ck["id"].as_str().unwrap(), &store);
        assert_eq!(pid, w.pid);
        // A copy that crashed (a torn stack or heap) has nothing more to say.
        let first = w.wait_state("the copy's first record", |r| r.len() == 1 || !w.alive());
        assert_eq!(first.len(), 1, "round {round}: the copy died at once");
        let from = num(&first[0], "gen");
        let r = w.wait_state("the copy going on (or torn)", |r| {
            num(&r[0], "torn") != 0 || num(&r[0], "gen") > from + 20 || !w.alive()
        });
        assert_eq!(
            num(&r[0], "torn"),
            0,
            "round {round}: the restored copy found pages of two moments: {r:?}"
        );
        assert!(
            w.alive() && !w.stopped(),
            "round {round}: the copy runs: {r:?}"
        );
        let t = &ck["timings_ms"];
        assert_eq!(t["streamed"], true, "{t}");
        assert_eq!(t["continued"], true, "the tool continued the tree: {t}");
    }
}
