//! A job that detects an inconsistent cut by itself: four SIMULATED ranks on two nodes (network
//! namespaces joined through the hub by veths) computing in lockstep over TCP (`gpu-sim-workload
//! --peers`: every step exchanges the step number and the device memory's checksum with every other
//! rank). A job checkpoint restores into ranks that go on in lockstep; the same ranks checkpointed one
//! at a time, at different moments, restore into a job that reports its broken lockstep. Needs root,
//! iproute2, etcd and CRIU: fails in CI without them, skips locally with the reason.
//!
//! TCP connections are checkpointed either with CRIU's `--tcp-established` (restored whole: no rank
//! connects again) or with `--tcp-close` (no state, restored closed, and the ranks connect again); either
//! way the peers check what a restored rank brings back, its step counter and device memory.
#![cfg(feature = "cluster")]

mod cluster_support;
#[path = "cluster_support/scene.rs"]
mod scene;
mod sim_support;

use std::time::{Duration, Instant};

use cluster_support::netns::{in_hub, Lab};
use scene::{node_of, Scene};
use sim_support::{assert_verified, checkpoint_args, status, text, wait_gone};

/// The ranks: 1 MiB of device memory, one 5 ms kernel a step (about a hundred steps a second on a
/// loaded machine), rank R listening on its node's address, port 7100 + R, its log in the scene's
/// folder. The agents checkpoint TCP connections as `tcp` says (`--tcp-close`, `--tcp-established`).
fn start(tcp: &str) -> Option<Scene> {
    Scene::start(
        &[tcp],
        |_| Vec::new(),
        |rank, lab: &Lab, dir| {
            let peers: Vec<String> = (0..4)
                .map(|r| format!("{}:{}", lab.addr(node_of(r)), 7100 + r))
                .collect();
            let log = dir.join(format!("rank-{rank}.log"));
            [
                "--mib",
                "1",
                "--workers",
                "1",
                "--kernel-us",
                "5000",
                "--rank",
                &rank.to_string(),
                "--peers",
                &peers.join(","),
                "--log",
                log.to_str().unwrap(),
            ]
            .map(String::from)
            .to_vec()
        },
    )
}

/// Each rank's lockstep report and step.
fn lockstep(pids: &[i32]) -> Vec<(String, u64)> {
    pids.iter()
        .map(|&p| {
            let st = status(p);
            (st["lockstep"].clone(), st["lockstep_step"].parse().unwrap())
        })
        .collect()
}

fn rank_logs(s: &Scene) -> String {
    (0..4)
        .map(|r| {
            let p = s.dir.path().join(format!("rank-{r}.log"));
            format!("--- rank {r}:\n{}", cluster_support::read(&p))
        })
        .collect()
}

/// Waits until every rank is past `step`, asserting on the way that none broke lockstep and that
/// their counters are never more than one apart. The ranks compute while they are read one after the
/// other, so two rounds of reads are compared: at the moment between them each rank's counter lay
/// between its two readings, and lockstep then held them one apart, so every first reading is at most
/// one above every second one.
fn assert_lockstep_past(s: &Scene, step: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (first, second) = (lockstep(&s.pids()), lockstep(&s.pids()));
        let all_ok = |v: &[(String, u64)]| v.iter().all(|(state, _)| state == "ok");
        assert!(
            all_ok(&first) && all_ok(&second),
            "{first:?} {second:?}\n{}",
            rank_logs(s)
        );
        let hi = first.iter().map(|x| x.1).max().unwrap();
        let lo = second.iter().map(|x| x.1).min().unwrap();
        assert!(hi <= lo + 1, "not in lockstep: {first:?} then {second:?}");
        if lo > step {
            return lo;
        }
        assert!(
            Instant::now() < deadline,
            "stuck at {second:?}\n{}",
            rank_logs(s)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Each rank's count of connections made.
fn connections(s: &Scene) -> Vec<u64> {
    s.pids()
        .iter()
        .map(|&p| status(p)["lockstep_connections"].parse().unwrap())
        .collect()
}

/// A job checkpoint (ranks stopped) and its restore; asserts the ranks go on in lockstep from where
/// the cut left them. Returns each rank's connections made before and after.
fn checkpoint_and_restore(s: &Scene) -> (Vec<u64>, Vec<u64>) {
    let before = assert_lockstep_past(s, 20);
    let conns = connections(s);
    let out = in_hub(
        &s.lab,
        &["job", "checkpoint", "--job", "train", "--lease-ttl", "10s"],
    );
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    wait_gone(&s.pids());

    let out = in_hub(&s.lab, &["job", "restore", &id, "--lease-ttl", "10s"]);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    // Back where the cut left them (no rank started again from 0), and computing on in lockstep.
    let first = lockstep(&s.pids());
    assert!(first.iter().all(|x| x.1 >= before), "{first:?} < {before}");
    let after = assert_lockstep_past(s, first.iter().map(|x| x.1).max().unwrap() + 50);
    assert!(after > before + 50);
    for &p in &s.pids() {
        assert_verified(p);
    }
    (conns, connections(s))
}

#[test]
fn a_job_checkpoint_of_lockstep_ranks_restores_into_ranks_that_go_on_in_lockstep() {
    let Some(s) = start("--tcp-close") else {
        return;
    };
    let (before, after) = checkpoint_and_restore(&s);
    // Restored closed: every rank connected again.
    assert!(
        before.iter().zip(&after).all(|(b, a)| a > b),
        "{before:?} {after:?}"
    );
}

#[test]
fn with_tcp_established_lockstep_ranks_come_back_with_their_connections_whole() {
    let Some(s) = start("--tcp-established") else {
        return;
    };
    let (before, after) = checkpoint_and_restore(&s);
    // CRIU put every connection back as it was: no rank had to connect again.
    assert_eq!(before, after);
}

#[test]
fn lockstep_ranks_checkpointed_one_at_a_time_report_the_inconsistent_cut_after_restore() {
    let Some(s) = start("--tcp-close") else {
        return;
    };
    assert_lockstep_past(&s, 20);
    // What per-process tools do: each rank checkpointed alone (left running), at its own moment.
    let store = s.store();
    let mut ids = Vec::new();
    for (rank, &pid) in s.pids().iter().enumerate() {
        let args = checkpoint_args(
            pid,
            &store,
            &["--leave-running", "--tcp-close", "--format", "json"],
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = s.on_node(node_of(rank), &args);
        assert!(out.status.success(), "rank {rank}: {}", text(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        ids.push(v["id"].as_str().unwrap().to_string());
        // The job runs on between the checkpoints, in lockstep (the detector sees nothing wrong yet).
        let at = lockstep(&s.pids())[rank].1;
        assert_lockstep_past(&s, at + 30);
    }
    for &p in &s.pids() {
        // SAFETY: killing the processes this test started.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    wait_gone(&s.pids());
    for (rank, id) in ids.iter().enumerate() {
        let args = ["restore", id, "--storage", store.to_str().unwrap()];
        let out = s.on_node(
            node_of(rank),
            &[&args[..], &["--gpu-backend", "sim"]].concat(),
        );
        assert!(out.status.success(), "rank {rank}: {}", text(&out));
    }
    // Every rank is back with its own memory intact, but the cut is not one moment: the ranks find
    // each other more than a step apart and say so.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = lockstep(&s.pids());
        if now.iter().any(|(state, _)| state == "broken") {
            break;
        }
        assert!(Instant::now() < deadline, "undetected: {now:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        rank_logs(&s).contains("LOCKSTEP BROKEN: rank "),
        "{}",
        rank_logs(&s)
    );
    for &p in &s.pids() {
        assert_verified(p);
    }
}
