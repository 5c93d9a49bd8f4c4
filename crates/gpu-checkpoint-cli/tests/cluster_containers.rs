//! A job whose members are given by container (`job add --container ID`): each agent resolves its
//! members through the container flow (the runtime's checkpoint with the GPU frozen from the host), in
//! the job's two phases. Real etcd, 2 agents, one runc container per node running a SIMULATED GPU
//! process. Needs root, CRIU, runc, busybox-static and etcd: fails in CI without them, skips locally.
#![cfg(feature = "cluster")]

mod cluster_support;
mod container_support;

use std::time::{Duration, Instant};

use cluster_support::{etcd_bin, gc, Agent, Etcd};
use container_support::*;
use gpu_checkpoint::freeze::sim;

#[test]
fn a_job_of_gpu_containers_on_two_agents_is_checkpointed_and_restored_by_container() {
    let Some(bin) = etcd_bin() else { return };
    if !containers_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // Declared before the agents and etcd, so dropped after them: the containers go last.
    let runc = Runc::new(dir.path());
    let etcd = Etcd::start(&bin, dir.path(), 1);
    let store = dir.path().join("store");
    let root = runc.root.display().to_string();
    let extra = ["--runtime-root", root.as_str()];
    let agents: Vec<Agent> = ["a", "b"]
        .iter()
        .map(|n| Agent::spawn(&etcd, n, &store, dir.path(), &[], "10s", &extra))
        .collect();
    let etcd_url = etcd.url_list();
    let job = |args: &[&str]| {
        let ttl: &[&str] = match args[0] {
            "checkpoint" | "restore" => &["--lease-ttl", "10s"],
            _ => &[],
        };
        gc(&[&["job"], args, ttl, &["--etcd", &etcd_url]].concat())
    };
    let mut ids = Vec::new();
    for (rank, node) in ["a", "b"].iter().enumerate() {
        let id = format!("gc-{}-job-{node}", std::process::id());
        let gpu = ["exec", "gpu-sim-workload", "--mib", "4", "--workers", "1"];
        let bundle = Bundle::new(&dir.path().join(format!("bundle-{node}")), &gpu, &[]);
        runc.run(&id, &bundle);
        let r = rank.to_string();
        let out = job(&[
            "add",
            "--job",
            "jc",
            "--rank",
            &r,
            "--node",
            node,
            "--container",
            &id,
        ]);
        assert!(out.status.success(), "{}", text(&out));
        ids.push(id);
    }
    let gpu_pid = |id: &str| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some((status, init)) = runc.state(id) {
                if status == "running" && sim::status(init).is_ok() {
                    return init;
                }
            }
            assert!(Instant::now() < deadline, "container {id} is not up");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let before: Vec<u64> = ids.iter().map(|id| steps(gpu_pid(id))).collect();

    let out = job(&["checkpoint", "--job", "jc"]);
    assert!(out.status.success(), "{}", text(&out));
    let ckpt = String::from_utf8_lossy(&out.stdout).trim().to_string();
    // Committed: each container checkpointed by its node's agent, then deleted from its runtime.
    for id in &ids {
        assert_eq!(runc.state(id), None, "container {id} still exists");
    }
    let listed = listed(&store);
    assert_eq!(listed.len(), 2);
    assert!(listed
        .iter()
        .all(|c| c["metadata"]["container"]["runtime"] == "runc"));

    let out = job(&["restore", &ckpt]);
    assert!(out.status.success(), "{}", text(&out));
    // Both containers back in their runtime, their GPU processes where the cut left them, computing.
    for (id, before) in ids.iter().zip(before) {
        let pid = gpu_pid(id);
        assert!(steps(pid) >= before);
        assert_healthy(&[pid]);
    }
    // Each agent's runc restore had CRIU read the images streamed from the store.
    for (agent, id) in agents.iter().zip(&ids) {
        let log = std::fs::read_to_string(&agent.log).unwrap();
        let said = format!("restored container {id}: images streamed from the store");
        assert!(log.contains(&said), "agent {}: {log}", agent.node);
    }
}
