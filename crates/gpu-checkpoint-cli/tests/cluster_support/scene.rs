//! The network namespace tests' scene: etcd in the hub, nodes "a" and "b" with an agent each (one store
//! shared by both), ranks 0-1 on a and 2-3 on b, registered as job "train". Included by the test files
//! that use it (with `cluster_support` and `sim_support`).
#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};
use std::process::Output;

use crate::cluster_support::netns::{
    in_hub, job_add_on, netns_ready, start_agent, start_etcd, Lab, NsProcess,
};
use crate::cluster_support::{etcd_bin, read};
use crate::sim_support::{self, criu_ready, text, SimProcess};

/// The node rank `rank` runs on.
pub fn node_of(rank: usize) -> &'static str {
    if rank < 2 {
        "a"
    } else {
        "b"
    }
}

// Dropped in this order: the ranks, the agents, etcd, then the namespaces and the folder.
pub struct Scene {
    pub ranks: Vec<SimProcess>,
    pub agents: Vec<NsProcess>,
    _etcd: NsProcess,
    pub lab: Lab,
    pub dir: tempfile::TempDir,
    // One scene at a time: the agents' leases and the lockstep ranks need the 2 shared cores.
    _one: std::sync::MutexGuard<'static, ()>,
}

impl Scene {
    /// Agents with `agent_args` and, for node N, the environment `agent_env(N)`; rank R started as
    /// `gpu-sim-workload --daemon rank_args(R)` in its node's namespace. `None` (skipped, with the
    /// reason printed) where etcd, CRIU, root or iproute2 are missing outside CI.
    pub fn start(
        agent_args: &[&str],
        agent_env: impl Fn(&str) -> Vec<(&'static str, String)>,
        rank_args: impl Fn(usize, &Lab, &Path) -> Vec<String>,
    ) -> Option<Scene> {
        let bin = etcd_bin()?;
        if !criu_ready() || !netns_ready() {
            return None;
        }
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let one = ONE.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let lab = Lab::new(&["a", "b"]);
        let etcd = start_etcd(&lab, &bin, dir.path());
        let store = dir.path().join("store");
        // Agents' leases of 6 s: a cut agent is noticed 6 s after its last refresh.
        let agents = ["a", "b"]
            .iter()
            .map(|n| {
                let env = agent_env(n);
                let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
                start_agent(&lab, n, &store, dir.path(), "6s", agent_args, &env)
            })
            .collect();
        let mut ranks = Vec::new();
        for rank in 0..4 {
            let node = node_of(rank);
            // Each rank in its node's namespace, as a node's processes share its network.
            let out = Lab::exec(lab.ns(node), &sim_support::sim_workload())
                .env("GPU_SIM_EVENT_FILE", dir.path().join("sim-events"))
                .arg("--daemon")
                .args(rank_args(rank, &lab, dir.path()))
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", text(&out));
            let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
            ranks.push(SimProcess {
                pid,
                children: Vec::new(),
            });
            let (r, p) = (rank.to_string(), pid.to_string());
            let add = ["--job", "train", "--rank", &r, "--pid", &p];
            let out = job_add_on(&lab, dir.path(), node, &add);
            assert!(out.status.success(), "{}", text(&out));
        }
        Some(Scene {
            ranks,
            agents,
            _etcd: etcd,
            lab,
            dir,
            _one: one,
        })
    }

    pub fn pids(&self) -> Vec<i32> {
        self.ranks.iter().map(|r| r.pid).collect()
    }

    pub fn store(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// The ranks' driver calls so far, in order (`gpu-sim-workload`'s `GPU_SIM_EVENT_FILE`): (rank,
    /// call, `begin`/`OK`/`ERR`).
    pub fn sim_events(&self) -> Vec<(usize, String, String)> {
        let pids = self.pids();
        read(&self.dir.path().join("sim-events"))
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let pid: i32 = f.next()?.parse().ok()?;
                let rank = pids.iter().position(|&p| p == pid)?;
                Some((rank, f.next()?.to_string(), f.next()?.to_string()))
            })
            .collect()
    }

    /// The agents' logs, for failure messages.
    pub fn logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| format!("--- {}:\n{}", a.log.display(), read(&a.log)))
            .collect()
    }

    pub fn job_checkpoints(&self) -> usize {
        let out = in_hub(&self.lab, &["job", "list", "--format", "json"]);
        assert!(out.status.success(), "{}", text(&out));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["checkpoints"].as_array().unwrap().len()
    }

    /// `gpu-checkpoint ARGS` run in `node`'s namespace (a per-process checkpoint or restore there).
    pub fn on_node(&self, node: &str, args: &[&str]) -> Output {
        Lab::exec(
            self.lab.ns(node),
            Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")),
        )
        .args(args)
        .output()
        .unwrap()
    }
}
