//! The cluster flow across network namespaces: etcd and the coordinator in a hub namespace, each agent
//! (and its node's SIMULATED ranks) in a namespace of its own joined to the hub by a veth pair, so that
//! an agent reaches etcd only over its link, and a link can be cut. Needs root, iproute2, etcd and CRIU:
//! fails in CI without them, skips locally with the reason.
#![cfg(feature = "cluster")]

mod cluster_support;
#[path = "cluster_support/scene.rs"]
mod scene;
mod sim_support;

use std::path::Path;
use std::process::Output;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cluster_support::netns::{cut_during_prepare, in_hub, Lab};
use gpu_checkpoint::freeze::sim;
use scene::Scene;
use sim_support::{assert_healthy, status, text};

/// Four plain SIMULATED ranks (4 MiB each), two per node.
fn start() -> Option<Scene> {
    start_with_faults("", "")
}

/// [`start`], the agent of node `at` run with `GPU_CHECKPOINT_FAULT=faults`.
fn start_with_faults(at: &str, faults: &str) -> Option<Scene> {
    Scene::start(
        &[],
        |node| match node == at {
            true => vec![("GPU_CHECKPOINT_FAULT", faults.to_string())],
            false => Vec::new(),
        },
        |_, _, _| ["--mib", "4"].map(String::from).to_vec(),
    )
}

/// `job checkpoint --job train ARGS` in the hub, with `GPU_CHECKPOINT_FAULT=faults`, in a thread.
fn job_checkpoint(s: &Scene, args: &[&str], faults: &str) -> JoinHandle<Output> {
    let mut cmd = Lab::exec(&s.lab.hub, Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")));
    cmd.args(["job", "checkpoint", "--job", "train", "--lease-ttl", "10s"])
        .args(args)
        .args(["--etcd", "http://127.0.0.1:2379", "--insecure-plaintext"])
        .env("GPU_CHECKPOINT_FAULT", faults);
    std::thread::spawn(move || cmd.output().unwrap())
}

/// Waits (up to `secs` seconds) until `done`.
fn wait_for(s: &Scene, secs: u64, what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done() {
        assert!(Instant::now() < deadline, "{what}\n{}", s.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn all_running(s: &Scene) -> bool {
    s.pids().iter().all(|&p| status(p)["state"] == "running")
}

#[test]
fn agents_in_network_namespaces_commit_and_one_cut_off_during_prepare_aborts_the_job() {
    let Some(s) = start() else { return };
    let ckpt = [
        "job",
        "checkpoint",
        "--job",
        "train",
        "--leave-running",
        "--lease-ttl",
        "10s",
    ];
    // Over the veths: a committed job checkpoint, every rank running on.
    let out = in_hub(&s.lab, &ckpt);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    assert_eq!(s.job_checkpoints(), 1);
    assert_eq!(sim_support::listed(&s.store()).len(), 4);
    assert_healthy(&s.pids());

    // b's link is cut while the members quiesce.
    let out = cut_during_prepare(&s.lab, "b", &ckpt);
    // Aborted: b's agent lease expired; a's members were told to undo, b's undid on their own (their
    // agent lost etcd, so no `go` could come).
    assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
    assert!(text(&out).contains("agent is gone"), "{}", text(&out));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while s.pids().iter().any(|&p| status(p)["state"] != "running") {
        assert!(std::time::Instant::now() < deadline, "{}", s.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_healthy(&s.pids());
    // Nothing committed, nothing more stored.
    assert_eq!(s.job_checkpoints(), 1);
    assert_eq!(sim_support::listed(&s.store()).len(), 4, "{}", s.logs());
}

#[test]
fn a_node_cut_off_during_the_dump_aborts_the_job_and_every_rank_runs_unlocked() {
    // b's agent holds its dumped members (before their store commit) for 4 s: b is cut off then.
    let Some(s) = start_with_faults("b", "checkpoint.after-dump=sleep:4000") else {
        return;
    };
    let job = job_checkpoint(&s, &[], "");
    wait_for(&s, 60, "b's agent never reached its dump", || {
        cluster_support::read(&s.agents[1].log).contains("injected fault at checkpoint.after-dump")
    });
    s.lab.cut("b");
    let out = job.join().unwrap();
    // Aborted: b's lease expired before it could say durable; a's members undo at the coordinator's
    // abort, b's at their agent's (etcd unreachable).
    assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
    assert!(text(&out).contains("agent is gone"), "{}", text(&out));
    wait_for(&s, 60, "a rank stayed stopped or locked", || {
        all_running(&s)
    });
    assert_healthy(&s.pids());
    assert_eq!(s.job_checkpoints(), 0);
    // a's member checkpoints are deleted; b's, committed in the store while b was cut off, are kept
    // (b cannot tell an abort from a commit it did not hear of), named by no job checkpoint.
    let kept: Vec<i64> = sim_support::listed(&s.store())
        .iter()
        .map(|c| c["metadata"]["root_pid"].as_i64().unwrap())
        .collect();
    assert!(
        kept.len() == 2 && kept.iter().all(|p| s.pids()[2..].contains(&(*p as i32))),
        "{kept:?}\n{}",
        s.logs()
    );
    // b back on the network: its agent learns that the job aborted and deletes them.
    s.lab.heal("b");
    wait_for(&s, 60, "b's kept member checkpoints stayed", || {
        sim_support::listed(&s.store()).is_empty()
    });
    assert_healthy(&s.pids());
}

#[test]
fn a_node_cut_off_after_its_members_are_durable_keeps_the_committed_job_checkpoint_restorable() {
    let Some(s) = start() else { return };
    // The coordinator waits 4 s once every member is durable, then commits: b is cut off in between,
    // so the commit happens while b's agent cannot hear of it.
    let job = job_checkpoint(&s, &[], "cluster.before-commit=sleep:4000");
    wait_for(&s, 60, "the members never became durable", || {
        sim_support::listed(&s.store()).len() == 4
    });
    s.lab.cut("b");
    let out = job.join().unwrap();
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(s.job_checkpoints(), 1);
    // b's agent, in doubt, kept its member checkpoints: the committed job checkpoint is whole.
    wait_for(&s, 60, "b's ranks were not put back running", || {
        s.pids()[2..]
            .iter()
            .all(|&p| sim::status(p).is_ok_and(|st| st["state"] == "running"))
    });
    assert_eq!(sim_support::listed(&s.store()).len(), 4, "{}", s.logs());
    // b back on the network: its agent learns that the job committed and keeps them.
    s.lab.heal("b");
    wait_for(&s, 60, "b's agent never learnt the outcome", || {
        cluster_support::read(&s.agents[1].log)
            .matches("is committed: member checkpoint")
            .count()
            == 2
    });
    assert_eq!(sim_support::listed(&s.store()).len(), 4, "{}", s.logs());

    // b is given up on: its ranks are stopped, and the job is restored on a.
    for &p in &s.pids()[2..] {
        // SAFETY: killing processes this test started.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    sim_support::wait_gone(&s.pids());
    let out = in_hub(
        &s.lab,
        &[
            "job",
            "restore",
            &id,
            "--node-map",
            "b=a",
            "--lease-ttl",
            "10s",
        ],
    );
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    assert_healthy(&s.pids());
}

#[test]
fn a_node_cut_off_for_less_than_its_lease_at_the_lock_barrier_does_not_stop_the_job_checkpoint() {
    // a's members report locked 4 s late: b's wait at the lock barrier, and its link goes for 2 s
    // meanwhile, well within b's 6 s lease.
    let Some(s) = start_with_faults("a", "cluster.member-locked=sleep:4000") else {
        return;
    };
    let job = job_checkpoint(&s, &["--leave-running"], "");
    wait_for(&s, 60, "a's members never locked", || {
        cluster_support::read(&s.agents[0].log).contains("injected fault at cluster.member-locked")
    });
    s.lab.cut("b");
    std::thread::sleep(Duration::from_secs(2));
    s.lab.heal("b");
    let out = job.join().unwrap();
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    assert_eq!(s.job_checkpoints(), 1);
    assert_eq!(sim_support::listed(&s.store()).len(), 4);
    assert_healthy(&s.pids());
}
