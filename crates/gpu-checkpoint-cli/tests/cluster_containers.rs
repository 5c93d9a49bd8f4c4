//! A job whose members are given by container (`job add --container ID`): each agent resolves its
//! members through the container flow (the runtime's checkpoint with the GPU frozen from the host), in
//! the job's two phases. Real etcd, 2 agents, one runc container per node running a SIMULATED GPU
//! process; the second test with `--ordered`, a member's failed dump and the agents in network
//! namespaces. Needs root, CRIU, runc, busybox-static and etcd (and iproute2 for the namespaces): fails
//! in CI without them, skips locally.
#![cfg(feature = "cluster")]

mod cluster_support;
mod container_support;

use std::path::Path;
use std::time::{Duration, Instant};

use cluster_support::netns::{in_hub, netns_ready, start_agent, start_etcd, Lab};
use cluster_support::{etcd_bin, gc, read, Agent, Etcd};
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
    let _agents: Vec<Agent> = ["a", "b"]
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
    let gpu_pid = |id: &str| gpu_pid(&runc, id);
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
}

/// The PID of container `id`'s GPU process (its init), once it runs and answers.
fn gpu_pid(runc: &Runc, id: &str) -> i32 {
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
}

/// The driver calls of the containers' GPU processes so far, in order: (rank, call, begin/OK/ERR),
/// from the file they share (`GPU_SIM_EVENT_TAG` is their rank).
fn events(dir: &Path) -> Vec<(usize, String, String)> {
    read(&dir.join("events").join("sim-events"))
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let rank = f.next()?.parse().ok()?;
            Some((rank, f.next()?.to_string(), f.next()?.to_string()))
        })
        .collect()
}

#[test]
fn an_ordered_job_of_gpu_containers_in_network_namespaces_undoes_a_failed_dump_then_commits_and_restores_in_rank_order(
) {
    let Some(bin) = etcd_bin() else { return };
    if !containers_ready() || !netns_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let runc = Runc::new(dir.path());
    let lab = Lab::new(&["a", "b"]);
    let _etcd = start_etcd(&lab, &bin, dir.path());
    let store = dir.path().join("store");
    let root = runc.root.display().to_string();
    let extra = ["--runtime-root", root.as_str()];
    // b's runtime fails its checkpoints (as runc itself would, EIO): the job's dump fails there.
    let fault = [("GPU_CHECKPOINT_FAULT", "container.runtime-checkpoint=eio")];
    let agent = |node: &str, env: &[(&str, &str)]| {
        start_agent(&lab, node, &store, dir.path(), "10s", &extra, env)
    };
    let mut agents = vec![agent("a", &[]), agent("b", &fault)];
    let events_dir = dir.path().join("events");
    std::fs::create_dir(&events_dir).unwrap();
    let mut ids = Vec::new();
    for (rank, node) in ["a", "b"].iter().enumerate() {
        let id = format!("gc-{}-ord-{node}", std::process::id());
        // Rank 0's kernels take longer: locks started together would finish in reverse rank order.
        let kernel_us = ((2 - rank) * 400_000).to_string();
        let gpu = [
            "exec",
            "gpu-sim-workload",
            "--mib",
            "4",
            "--workers",
            "1",
            "--kernel-us",
            &kernel_us,
        ];
        let env = [
            "GPU_SIM_EVENT_FILE=/events/sim-events".to_string(),
            format!("GPU_SIM_EVENT_TAG={rank}"),
        ];
        let env: Vec<&str> = env.iter().map(String::as_str).collect();
        let bundle = Bundle::new(&dir.path().join(format!("bundle-{node}")), &gpu, &env);
        // One events file for both containers, bound in from the test's folder.
        let config = bundle.dir.join("config.json");
        let mut c: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&config).unwrap()).unwrap();
        c["mounts"].as_array_mut().unwrap().push(serde_json::json!({
            "destination": "/events", "type": "bind",
            "source": events_dir, "options": ["rbind", "rw"],
        }));
        std::fs::write(&config, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
        runc.run(&id, &bundle);
        let r = rank.to_string();
        let add = ["job", "add", "--job", "jo", "--rank", &r, "--node", node];
        let out = in_hub(&lab, &[&add[..], &["--container", &id]].concat());
        assert!(out.status.success(), "{}", text(&out));
        ids.push(id);
    }
    let logs = |agents: &[cluster_support::netns::NsProcess]| {
        agents
            .iter()
            .map(|a| read(&a.log))
            .collect::<Vec<_>>()
            .join("\n---\n")
    };
    let ckpt = [
        "job",
        "checkpoint",
        "--job",
        "jo",
        "--ordered",
        "--lease-ttl",
        "10s",
    ];

    // 1. b's dump fails: aborted (exit 1), both containers running again with their GPU processes
    // unlocked and computing, nothing committed, no member checkpoint kept.
    let out = in_hub(&lab, &ckpt);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}\n{}",
        text(&out),
        logs(&agents)
    );
    assert!(text(&out).contains("rank 1 on node b"), "{}", text(&out));
    let seen = events(dir.path());
    assert!(sim_support::in_rank_order(&seen, "LOCK", 2), "{seen:?}");
    for id in &ids {
        assert_eq!(
            runc.state(id).map(|s| s.0).as_deref(),
            Some("running"),
            "{id}"
        );
        assert_healthy(&[gpu_pid(&runc, id)]);
    }
    let out = in_hub(&lab, &["job", "list", "--format", "json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["checkpoints"], serde_json::json!([]), "{list}");
    assert!(listed(&store).is_empty(), "{:?}", listed(&store));

    // 2. b's agent again, without the fault: the ordered job checkpoint commits, in rank order.
    agents.pop();
    agents.push(agent("b", &[]));
    let before: Vec<u64> = ids.iter().map(|id| steps(gpu_pid(&runc, id))).collect();
    let seen = events(dir.path()).len();
    let out = in_hub(&lab, &ckpt);
    assert!(out.status.success(), "{}\n{}", text(&out), logs(&agents));
    let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let locks = events(dir.path())[seen..].to_vec();
    assert!(sim_support::in_rank_order(&locks, "LOCK", 2), "{locks:?}");
    for c in &ids {
        assert_eq!(runc.state(c), None, "container {c} still exists");
    }
    assert_eq!(listed(&store).len(), 2);

    // 3. Its restore, not told, restores and unlocks the containers in rank order.
    let seen = events(dir.path()).len();
    let out = in_hub(&lab, &["job", "restore", &id, "--lease-ttl", "10s"]);
    assert!(out.status.success(), "{}\n{}", text(&out), logs(&agents));
    let restore = events(dir.path())[seen..].to_vec();
    assert!(
        sim_support::in_rank_order(&restore, "RESTORE", 2),
        "{restore:?}"
    );
    assert!(
        sim_support::in_rank_order(&restore, "UNLOCK", 2),
        "{restore:?}"
    );
    for (c, before) in ids.iter().zip(before) {
        let pid = gpu_pid(&runc, c);
        assert!(steps(pid) >= before);
        assert_healthy(&[pid]);
    }
}
