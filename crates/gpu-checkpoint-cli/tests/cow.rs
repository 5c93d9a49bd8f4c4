//! Copy-on-write sharing across a checkpoint and restore, with real CRIU: a parent that filled its
//! memory before forking readers holds one copy of it for the whole tree, and must hold one copy after a
//! restore too, whichever way the memory comes back, in both modes (stopped, and `--leave-running` with
//! the original killed before the restore), and as after plain `criu dump` / `criu restore` in the same
//! test (a failure of plain CRIU is reported loudly and does not fail the test). Needs root and CRIU:
//! fails in CI without them, skips locally with the reason.

mod common;

use std::path::Path;

use common::programs::*;
use common::*;
use gpu_checkpoint_workloads::{read_state, Record};

const MIB: u64 = 64;
const CHILDREN: u64 = 4;

/// The tree's proportional set size, in KiB: what its memory really costs, each shared page counted
/// once in all (shared by N processes, 1/N in each).
fn tree_pss_kib(root: i32) -> u64 {
    let pids: Vec<i32> = gpu_checkpoint::proc::process_tree(root)
        .iter()
        .map(|p| p.pid)
        .collect();
    assert_eq!(pids.len() as u64, CHILDREN + 1, "the whole tree: {pids:?}");
    pids.iter()
        .map(|p| {
            let rollup = std::fs::read_to_string(format!("/proc/{p}/smaps_rollup")).unwrap();
            rollup
                .lines()
                .find_map(|l| l.strip_prefix("Pss:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no Pss in /proc/{p}/smaps_rollup: {rollup}"))
        })
        .sum()
}

/// Every process of the tree has checked its memory `after` more times than in `before` (or at least
/// once, without `before`), and found it right each time, under the PID it had.
fn all_verified(w: &Workload, what: &str, before: Option<&[Record]>, after: u64) -> Vec<Record> {
    let recs = w.wait_state(what, |r| {
        r.len() as u64 == CHILDREN + 1
            && r.iter().all(|p| {
                let at = before.map_or(0, |b| num(&b[num(p, "proc") as usize], "verified"));
                num(p, "verified") >= at + after
            })
    });
    for r in &recs {
        assert_eq!(num(r, "bad"), 0, "{recs:?}");
        if let Some(b) = before {
            let i = num(r, "proc") as usize;
            assert_eq!(r["pid"], b[i]["pid"], "same PID");
            assert_eq!(r["checksum"], b[i]["checksum"]);
        }
    }
    recs
}

/// After a restore: every process reads its memory right again (past where it was at the checkpoint,
/// under the PID it had), and the tree holds about one copy of it (`before_kib`: the tree's PSS before
/// the checkpoint).
fn comes_back_sharing(w: &Workload, what: &str, at_checkpoint: &[Record], before_kib: u64) {
    all_verified(
        w,
        "every process re-verified its memory",
        Some(at_checkpoint),
        2,
    );
    let after_kib = tree_pss_kib(w.pid);
    assert!(
        after_kib * 2 < before_kib * 3,
        "{what}: the tree's PSS went from {} MiB to {} MiB: parent and children no longer share \
         their memory",
        before_kib >> 10,
        after_kib >> 10
    );
}

/// Restores checkpoint `id` with `extra` and checks the tree comes back sharing its memory
/// ([`comes_back_sharing`]). Returns the restore's JSON.
fn restore_shares(
    w: &Workload,
    store: &Path,
    id: &str,
    extra: &[&str],
    at_checkpoint: &[Record],
    before_kib: u64,
) -> serde_json::Value {
    let mut args = vec![
        "restore",
        id,
        "--storage",
        store.to_str().unwrap(),
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    let out: serde_json::Value = serde_json::from_str(&ok(&gc(&args))).unwrap();
    assert_eq!(out["pid"], w.pid);
    comes_back_sharing(w, &format!("restore {extra:?}"), at_checkpoint, before_kib);
    out
}

/// The pre-fork tree, its state file in a new folder `dir/name` (a state file left by another tree would
/// answer for this one until it starts writing), once every process has verified its memory, and its
/// PSS then (about one copy).
fn start_tree(dir: &Path, name: &str) -> (Workload, u64) {
    let dir = dir.join(name);
    std::fs::create_dir(&dir).unwrap();
    let mib = MIB.to_string();
    let children = CHILDREN.to_string();
    let w = Workload::start(
        "cow",
        &dir,
        &["--mib", &mib, "--children", &children, "--verify-ms", "300"],
    );
    all_verified(&w, "parent and children verified their memory", None, 1);
    let before_kib = tree_pss_kib(w.pid);
    assert!(
        before_kib < (MIB << 10) * 3 / 2,
        "the workload shares its memory to begin with: {before_kib} KiB"
    );
    (w, before_kib)
}

/// Checkpoints the tree through `via` in `mode` into `work`: returns what to restore and the state
/// records as the checkpoint left them. The state file is then blanked (same size: CRIU checks it), so
/// that what it shows next comes from the restored copy.
fn take(via: Via, mode: Mode, w: &Workload, work: &Path) -> (Taken, Vec<Record>) {
    let mut at = None;
    let taken = via.checkpoint(mode, w.pid, work, &[], || {
        let now = read_state(&w.state).unwrap();
        all_verified(w, "the original going on", Some(&now), 1);
        at = Some(now);
    });
    let at_checkpoint = at.unwrap_or_else(|| read_state(&w.state).unwrap());
    w.blank_state();
    (taken, at_checkpoint)
}

/// A pre-fork tree (the parent fills 64 MiB, four children read it), checkpointed in `mode` and
/// restored the default way (memory through userfaultfd) and streamed: the tree's PSS stays about what
/// it was (one copy shared, not five), and every process still reads the right bytes, its own included
/// (a page of the common memory it rewrote, a MiB only it filled). Plain CRIU first, the same checks.
fn a_pre_fork_tree(mode: Mode) {
    if !criu_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();

    Via::Plain.case(&format!("a pre-fork tree sharing memory, {mode}"), || {
        let (w, before_kib) = start_tree(dir.path(), "plain");
        let (taken, at_checkpoint) = take(Via::Plain, mode, &w, dir.path());
        taken.restore(w.pid, &[]);
        comes_back_sharing(&w, "plain CRIU", &at_checkpoint, before_kib);
    });

    let (w, before_kib) = start_tree(dir.path(), "ours");
    let (taken, at_checkpoint) = take(Via::Ours, mode, &w, dir.path());
    let Taken::Ours { store, id, ck } = taken else {
        unreachable!()
    };
    assert_eq!(ck["processes"], CHILDREN + 1, "{ck}");

    // The default restore: the shared memory is left to CRIU, which shares it as it forks.
    let out = restore_shares(&w, &store, &id, &[], &at_checkpoint, before_kib);
    let shared = out["timings_ms"]["uffd"]["shared_bytes"].as_u64().unwrap();
    assert!(
        shared >= (CHILDREN + 1) * (MIB << 20),
        "parent and children leave the memory to CRIU: {out}"
    );
    // What each process has alone still goes through userfaultfd.
    let copied = out["timings_ms"]["uffd"]["copied_bytes"].as_u64().unwrap();
    assert!(copied >= (CHILDREN + 1) << 20, "{out}");

    // Streamed to CRIU.
    w.kill_and_wait_free();
    w.blank_state();
    restore_shares(&w, &store, &id, &["--stream"], &at_checkpoint, before_kib);
}

both_modes!(a_pre_fork_tree:
    a_pre_fork_tree_keeps_sharing_its_memory_after_restore,
    a_pre_fork_tree_keeps_sharing_its_memory_after_a_leave_running_checkpoint);
