//! The cluster flow across network namespaces: etcd and the coordinator in a hub namespace, each agent
//! (and its node's SIMULATED ranks) in a namespace of its own joined to the hub by a veth pair, so that
//! an agent reaches etcd only over its link, and a link can be cut. Needs root, iproute2, etcd and CRIU:
//! fails in CI without them, skips locally with the reason.
#![cfg(feature = "cluster")]

mod cluster_support;
mod sim_support;

use std::path::Path;
use std::time::Duration;

use cluster_support::netns::{in_hub, netns_ready, start_agent, start_etcd, Lab, NsProcess};
use cluster_support::{etcd_bin, read};
use sim_support::{assert_healthy, criu_ready, status, text, SimProcess};

// Dropped in this order: the ranks, the agents, etcd, then the namespaces and the folder.
struct Scene {
    ranks: Vec<SimProcess>,
    agents: Vec<NsProcess>,
    _etcd: NsProcess,
    lab: Lab,
    dir: tempfile::TempDir,
}

impl Scene {
    /// Two nodes, "a" and "b", two ranks each, one store shared by both agents.
    fn start() -> Option<Scene> {
        let bin = etcd_bin()?;
        if !criu_ready() || !netns_ready() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let lab = Lab::new(&["a", "b"]);
        let etcd = start_etcd(&lab, &bin, dir.path());
        let store = dir.path().join("store");
        // Agents' leases of 6 s: the cut agent is noticed 6 s after its last refresh.
        let agents = ["a", "b"]
            .iter()
            .map(|n| start_agent(&lab, n, &store, dir.path(), "6s"))
            .collect();
        let mut ranks = Vec::new();
        for rank in 0..4 {
            let node = if rank < 2 { "a" } else { "b" };
            // Each rank in its node's namespace, as a node's processes share its network.
            let out = Lab::exec(lab.ns(node), &sim_support::sim_workload())
                .args(["--daemon", "--mib", "4"])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", text(&out));
            let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
            ranks.push(SimProcess {
                pid,
                children: Vec::new(),
            });
            let (r, p) = (rank.to_string(), pid.to_string());
            let add = ["job", "add", "--job", "train", "--rank", &r, "--node", node];
            let out = in_hub(&lab, &[&add[..], &["--pid", &p]].concat());
            assert!(out.status.success(), "{}", text(&out));
        }
        Some(Scene {
            ranks,
            agents,
            _etcd: etcd,
            lab,
            dir,
        })
    }

    fn pids(&self) -> Vec<i32> {
        self.ranks.iter().map(|r| r.pid).collect()
    }

    fn store(&self) -> std::path::PathBuf {
        self.dir.path().join("store")
    }

    fn logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| format!("--- {}:\n{}", a.log.display(), read(&a.log)))
            .collect()
    }

    fn job_checkpoints(&self) -> usize {
        let out = in_hub(&self.lab, &["job", "list", "--format", "json"]);
        assert!(out.status.success(), "{}", text(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["checkpoints"].as_array().unwrap().len()
    }
}

#[test]
fn agents_in_network_namespaces_commit_and_one_cut_off_during_prepare_aborts_the_job() {
    let Some(s) = Scene::start() else { return };
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
