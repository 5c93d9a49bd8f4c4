//! A job whose members are given by container (`job add --container ID`): each agent resolves its
//! members through the container flow (the runtime's checkpoint with the GPU frozen from the host), in
//! the job's two phases. Real etcd, 2 agents, one runc container per node running a SIMULATED GPU
//! process; the second test with `--ordered`, a member's failed dump and the agents in network
//! namespaces; the others (`Faults`, cluster_support/container_scene.rs) with issue 18's faults: an agent killed before and after its lock
//! and during its dump, the coordinator killed before and after the commit, a node cut off during
//! prepare and during its dump (the remaining faults are in cluster_containers_faults.rs). Needs root, CRIU, runc, busybox-static and etcd (and iproute2 for the
//! namespaces): fails in CI without them, skips locally.
#![cfg(feature = "cluster")]

mod cluster_support;
#[path = "cluster_support/container_scene.rs"]
mod container_scene;
mod container_support;

use std::path::Path;

use cluster_support::netns::{
    cut_during_prepare, in_hub, job_add_on, netns_ready, start_agent, start_etcd, Lab,
};
use cluster_support::{etcd_bin, gc, job_add, read, Agent, Etcd};
use container_scene::{gpu_pid, Faults, CHECKPOINT};
use container_support::*;

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
        let etcd = ["--etcd", &etcd_url, "--insecure-plaintext"];
        gc(&[&["job"], args, ttl, &etcd].concat())
    };
    let mut ids = Vec::new();
    for (rank, node) in ["a", "b"].iter().enumerate() {
        let id = format!("gc-{}-job-{node}", std::process::id());
        let gpu = ["exec", "gpu-sim-workload", "--mib", "4", "--workers", "1"];
        let bundle = Bundle::new(&dir.path().join(format!("bundle-{node}")), &gpu, &[]);
        runc.run(&id, &bundle);
        let r = rank.to_string();
        let add = ["--job", "jc", "--rank", &r, "--container", &id];
        let out = job_add(dir.path(), node, &add);
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
    // Each agent's runc restore had CRIU read the images streamed from the store.
    for (agent, id) in agents.iter().zip(&ids) {
        let log = std::fs::read_to_string(&agent.log).unwrap();
        let said = format!("restored container {id}: images streamed from the store");
        assert!(log.contains(&said), "agent {}: {log}", agent.node);
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
        let add = ["--job", "jo", "--rank", &r, "--container", &id];
        let out = job_add_on(&lab, dir.path(), node, &add);
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

/// b's agent is SIGKILLed at `point` of its container member's checkpoint: the job aborts, b's
/// guardian undoes b's container (whatever it reached), the coordinator's abort a's; b's agent
/// started again, a job checkpoint commits and restores.
fn container_agent_killed_at(point: &str) {
    let Some(mut s) = Faults::start(&format!("{point}=kill")) else {
        return;
    };
    let before = s.processes();
    let out = in_hub(&s.lab, &CHECKPOINT);
    assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
    assert!(text(&out).contains("agent is gone"), "{}", text(&out));
    assert!(
        read(&s.agents[1].log).contains(&format!("injected fault at {point}")),
        "{}",
        s.logs()
    );
    s.assert_undone(&before);
    s.restart_b();
    s.assert_undone(&before);
    s.assert_commits_and_restores();
}

#[test]
fn an_agent_killed_after_its_container_member_locked_aborts_the_job_and_the_containers_run_on() {
    // The container's GPU process is locked, the container not yet paused.
    container_agent_killed_at("cluster.member-locked");
}

#[test]
fn an_agent_killed_before_its_containers_lock_aborts_the_job_and_the_containers_run_on() {
    container_agent_killed_at("checkpoint.before-freeze");
}

#[test]
fn an_agent_killed_during_its_containers_dump_aborts_the_job_and_the_containers_run_on() {
    // After runc's (direct) dump, before the store commit: the container is paused and its GPU
    // state checkpointed; b's guardian puts the GPU state back and resumes it.
    container_agent_killed_at("checkpoint.after-dump");
}

#[test]
fn a_coordinator_killed_after_committing_a_job_of_containers_leaves_it_committed_and_restorable() {
    let Some(s) = Faults::start("") else { return };
    let before: Vec<u64> = s.ids.iter().map(|id| steps(gpu_pid(&s.runc, id))).collect();
    s.kill_coordinator_at("cluster.after-commit");
    // Killed after the commit's transaction: the job checkpoint is committed, never half so.
    let cps = s.job_checkpoints();
    assert_eq!(cps.len(), 1, "{}", s.logs());
    // The agents finish without the coordinator: both containers checkpointed and deleted.
    s.assert_deleted_then_restores(&cps[0], 2, &before);
}

#[test]
fn a_coordinator_killed_before_committing_a_job_of_containers_leaves_them_running_and_nothing_kept()
{
    let Some(s) = Faults::start("") else { return };
    let before = s.processes();
    // Every member durable (its container paused, GPU state checkpointed, member checkpoint stored):
    // the agents see the operation's lease expire without a commit and undo all of it.
    s.kill_coordinator_at("cluster.before-commit");
    s.assert_undone(&before);
}

#[test]
fn a_node_cut_off_during_the_prepare_of_a_job_of_containers_aborts_it_and_a_later_one_commits() {
    let Some(s) = Faults::start("") else { return };
    let before = s.processes();
    // b's link is cut while the members quiesce.
    let out = cut_during_prepare(&s.lab, "b", &CHECKPOINT);
    assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
    assert!(text(&out).contains("agent is gone"), "{}", text(&out));
    s.assert_undone(&before);
    // b's link back as it was: b's agent (the same process) registers again under a new lease, and a
    // new job checkpoint commits (before: the agent ended on its lost lease, and node b had none).
    s.lab.heal("b");
    s.wait_registered("b");
    s.assert_commits_and_restores();
}

#[test]
fn a_node_cut_off_during_its_containers_dump_aborts_the_job_and_resolves_its_kept_checkpoint() {
    // b's agent holds its dumped container (paused, GPU state checkpointed, before the store commit)
    // for 4 s: b is cut off then.
    let Some(s) = Faults::start("checkpoint.after-dump=sleep:4000") else {
        return;
    };
    let before = s.processes();
    let hub = s.lab.hub.clone();
    let job = std::thread::spawn(move || {
        Lab::exec(&hub, Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")))
            .args(CHECKPOINT)
            .args(["--etcd", "http://127.0.0.1:2379", "--insecure-plaintext"])
            .output()
            .unwrap()
    });
    wait_for("b's agent at its dump", &|| {
        read(&s.agents[1].log).contains("injected fault at checkpoint.after-dump")
    });
    s.lab.cut("b");
    let out = job.join().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
    assert!(text(&out).contains("agent is gone"), "{}", text(&out));
    // b's member checkpoint, stored while b was cut off, is kept in doubt (named by no job
    // checkpoint) with its container running again; a's is deleted.
    wait_for("b's container running with its checkpoint kept", &|| {
        let kept = listed(&s.store);
        kept.len() == 1
            && kept[0]["metadata"]["container"]["id"] == s.ids[1].as_str()
            && s.runc
                .state(&s.ids[1])
                .is_some_and(|(st, _)| st == "running")
    });
    // b back on the network: its agent learns of the abort and deletes it, and registers again.
    s.lab.heal("b");
    s.assert_undone(&before);
    s.wait_registered("b");
    s.assert_commits_and_restores();
}
