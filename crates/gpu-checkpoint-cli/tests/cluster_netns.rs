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
use std::time::Duration;

use cluster_support::netns::{in_hub, Lab};
use scene::Scene;
use sim_support::{assert_healthy, status, text};

/// Four plain SIMULATED ranks (4 MiB each), two per node.
fn start() -> Option<Scene> {
    Scene::start(
        &[],
        |_| Vec::new(),
        |_, _, _| ["--mib", "4"].map(String::from).to_vec(),
    )
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

    // b's link is cut while the members quiesce (the prepare phase lasts at least 3 s).
    let hub = s.lab.hub.clone();
    let job = std::thread::spawn(move || {
        Lab::exec(&hub, Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")))
            .args(ckpt)
            .args(["--quiesce", "sleep 3", "--etcd", "http://127.0.0.1:2379"])
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_secs(1));
    s.lab.cut("b");
    let out = job.join().unwrap();
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
