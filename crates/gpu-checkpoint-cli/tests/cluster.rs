//! The cluster flow with its real components: etcd (started here on loopback), `gpu-checkpoint agent`
//! processes, `gpu-checkpoint job` as the coordinator, real CRIU, and jobs whose members are SIMULATED
//! GPU processes (gpu-sim-workload). A job checkpoint either commits (every member stopped, restorable
//! on the same or swapped nodes) or aborts with every rank running, unlocked and correct and nothing kept,
//! whichever member fails and whoever dies. Needs etcd (and root + CRIU for the job tests): fails in CI
//! without them, skips locally with the reason.
#![cfg(feature = "cluster")]

mod cluster_support;
mod sim_support;

use std::time::Duration;

use cluster_support::*;
use gpu_checkpoint::flows::cluster::{CoordError, Coordinator, EtcdConfig, EtcdCoordinator, Event};
use gpu_checkpoint::freeze::sim;
use sim_support::{assert_healthy, criu_ready, status, strings, wait_gone, SimProcess};

#[test]
fn the_etcd_coordinator_keeps_the_promises_the_protocol_relies_on() {
    let Some(bin) = etcd_bin() else { return };
    let dir = tempfile::tempdir().unwrap();
    let etcd = Etcd::start(&bin, dir.path(), 1);
    let c = etcd.client();
    let rev = c.put("/t/a", b"1", None).unwrap();
    let lease = c.grant(Duration::from_secs(1)).unwrap();
    c.put("/t/b", b"2", Some(lease)).unwrap();
    let (kvs, _) = c.range("/t/").unwrap();
    assert_eq!(
        kvs.iter().map(|k| k.key.as_str()).collect::<Vec<_>>(),
        ["/t/a", "/t/b"]
    );
    // A transaction applies only when its conditions hold.
    use gpu_checkpoint::flows::cluster::coord::{Compare, TxnOp};
    let put_c = [TxnOp::Put {
        key: "/t/c".into(),
        value: b"3".to_vec(),
        lease: None,
    }];
    assert!(!c.txn(&[Compare::Missing("/t/a".into())], &put_c).unwrap());
    assert!(c.get("/t/c").unwrap().is_none());
    assert!(c.txn(&[Compare::Exists("/t/a".into())], &put_c).unwrap());
    assert_eq!(c.get("/t/c").unwrap().unwrap().value, b"3");
    // A watch sees what happened after a revision.
    let events = c.watch("/t/", rev, Duration::from_secs(5)).unwrap();
    assert!(
        matches!(&events[0], Event::Put(kv) if kv.key == "/t/b"),
        "{events:?}"
    );
    // A watch that stays open delivers the changes from that revision, then later ones as they come,
    // each once, and nothing when nothing changes.
    let mut stream = c.watch_stream("/t/", rev).unwrap();
    let mut seen = Vec::new();
    while seen.len() < events.len() {
        let more = stream.next(Duration::from_secs(5)).unwrap();
        assert!(!more.is_empty(), "{seen:?}");
        seen.extend(more);
    }
    assert_eq!(seen, events);
    let later = c.put("/t/d", b"4", None).unwrap();
    let more = stream.next(Duration::from_secs(5)).unwrap();
    assert!(
        matches!(&more[..], [Event::Put(kv)] if kv.key == "/t/d" && kv.mod_revision == later),
        "{more:?}"
    );
    assert!(stream.next(Duration::from_millis(300)).unwrap().is_empty());
    drop(stream);
    // A lease not refreshed expires, and its keys go with it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while c.get("/t/b").unwrap().is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "the lease never expired"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let refresh = c.keep_alive(lease);
    assert!(
        matches!(refresh, Err(CoordError::LeaseLost(_))),
        "{refresh:?}"
    );
    // Nobody at the address: said up front, and the binary exits 5 (a missing component).
    let port = etcd.urls[0]
        .rsplit(':')
        .next()
        .unwrap()
        .parse::<u16>()
        .unwrap();
    let nobody = format!("http://127.0.0.1:{}", port.wrapping_add(7));
    assert!(matches!(
        EtcdCoordinator::connect(&EtcdConfig::insecure(std::slice::from_ref(&nobody))),
        Err(CoordError::Unreachable { .. })
    ));
    let out = gc(&["job", "list", "--insecure-plaintext", "--etcd", &nobody]);
    assert_eq!(out.status.code(), Some(5), "{out:?}");
}

/// A job on two agents ("a" and "b", two ranks each), one store shared by both.
/// One scene at a time: each is an etcd, two agents, four ranks and CRIU dumps; two at once on CI's 2
/// cores make lease refreshes late enough to expire (a correct abort, but not what the test checks).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

// Dropped in this order: the ranks, the agents (deregistering), etcd, the folder, then the next scene may
// start.
struct Scene {
    ranks: Vec<SimProcess>,
    agents: Vec<Agent>,
    etcd: Etcd,
    store: std::path::PathBuf,
    _dir: tempfile::TempDir,
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl Scene {
    /// `None` (skipped locally, a failure in CI) without etcd, root or CRIU.
    fn start(agent_env: &[(&str, &[(&str, &str)])]) -> Option<Scene> {
        Self::start_on(1, agent_env)
    }

    /// [`Scene::start`] on an etcd cluster of `etcd_size` members.
    fn start_on(etcd_size: usize, agent_env: &[(&str, &[(&str, &str)])]) -> Option<Scene> {
        let bin = etcd_bin()?;
        if !criu_ready() {
            return None;
        }
        let turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::tempdir().unwrap();
        let store = dir.path().join("store");
        let etcd = Etcd::start(&bin, dir.path(), etcd_size);
        let agents = ["a", "b"]
            .iter()
            .map(|node| {
                let env = agent_env
                    .iter()
                    .find(|(n, _)| n == node)
                    .map_or(&[][..], |(_, e)| e);
                Agent::start(&etcd, node, &store, dir.path(), env)
            })
            .collect();
        let ranks = Vec::new();
        let mut s = Scene {
            ranks,
            agents,
            etcd,
            store,
            _dir: dir,
            _turn: turn,
        };
        for rank in 0..4 {
            s.add_rank(rank, &[]);
        }
        Some(s)
    }

    fn add_rank(&mut self, rank: usize, extra: &[&str]) {
        let mut args = vec!["--mib", "4"];
        args.extend_from_slice(extra);
        let p = SimProcess::start(&args);
        let node = if rank < 2 { "a" } else { "b" };
        let (r, pid) = (rank.to_string(), p.pid.to_string());
        let args = ["--job", "train", "--rank", &r, "--pid", &pid];
        let out = job_add(self._dir.path(), node, &args);
        assert!(out.status.success(), "{out:?}");
        if rank < self.ranks.len() {
            self.ranks[rank] = p;
        } else {
            self.ranks.push(p);
        }
    }

    fn pids(&self) -> Vec<i32> {
        self.ranks.iter().map(|r| r.pid).collect()
    }

    fn job(&self, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
        // Leases of 10 s: the tests share 2 cores with everything else CI runs, and a lease whose refresh
        // comes late expires (the job then aborts, correctly, but not as the test means).
        let ttl: &[&str] = match args.first() {
            Some(&"checkpoint") | Some(&"restore") if !args.contains(&"--lease-ttl") => {
                &["--lease-ttl", "10s"]
            }
            _ => &[],
        };
        std::process::Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
            .arg("job")
            .args(args)
            .args(ttl)
            .args(["--etcd", &self.etcd.url_list(), "--insecure-plaintext"])
            .envs(env.iter().copied())
            .output()
            .unwrap()
    }

    fn logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| format!("--- agent {}:\n{}", a.node, read(&a.log)))
            .collect()
    }

    /// Every rank runs, unlocked, its device memory intact, and computes on.
    fn assert_all_running(&self) {
        for p in self.pids() {
            assert_eq!(
                status(p)["state"],
                "running",
                "rank pid {p}; {}",
                self.logs()
            );
        }
        assert_healthy(&self.pids());
    }

    fn job_checkpoints(&self) -> Vec<serde_json::Value> {
        let out = self.job(&["list", "--format", "json"], &[]);
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["checkpoints"].as_array().unwrap().clone()
    }

    /// The member checkpoints in the shared store.
    fn stored(&self) -> usize {
        sim_support::listed(&self.store).len()
    }
}

fn text(o: &std::process::Output) -> String {
    sim_support::text(o)
}

#[test]
fn a_job_on_two_agents_is_checkpointed_with_one_cut_and_restored_on_swapped_nodes() {
    let Some(s) = Scene::start(&[]) else { return };
    // The node's quiesce hook the job names runs for every member, before its lock, with its rank
    // and PID (`record`, see `agent_local_args`).
    let hook = s.store.with_file_name("quiesced");
    let ckpt = ["checkpoint", "--job", "train", "--format", "json"];
    let out = s.job(&[&ckpt[..], &["--quiesce", "record"]].concat(), &[]);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let mut quiesced: Vec<String> = read(&hook).lines().map(String::from).collect();
    quiesced.sort();
    let expected: Vec<String> = (0..4)
        .map(|r| format!("train {r} {}", s.pids()[r]))
        .collect();
    assert_eq!(quiesced, expected);
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = m["id"].as_str().unwrap().to_string();
    let members = m["members"].as_array().unwrap();
    assert_eq!(members.len(), 4);
    assert_eq!(members[2]["node"], "b");
    assert!(
        members
            .iter()
            .all(|x| !x["gpus"].as_array().unwrap().is_empty()),
        "{m}"
    );
    assert!(m["cut"]["locked_unix_ms"].as_u64() <= m["cut"]["committed_unix_ms"].as_u64());
    // Committed: every member stopped, the manifest in etcd and in the store.
    wait_gone(&s.pids());
    assert_eq!(s.job_checkpoints().len(), 1);
    assert_eq!(s.stored(), 4);
    let kept = std::fs::read(s.store.join("jobs").join(format!("{id}.json"))).unwrap();
    let kept: serde_json::Value = serde_json::from_slice(&kept).unwrap();
    assert_eq!(kept["members"], m["members"]);
    assert!(!s.logs().contains("keeping job checkpoint"), "{}", s.logs());
    // A device map for a node no member is restored on, or a malformed one: refused up front (2).
    for bad in ["c:0=1", "b:0=x", "0=1"] {
        let out = s.job(&["restore", &id, "--device-map", bad], &[]);
        assert_eq!(out.status.code(), Some(2), "{bad}: {}", text(&out));
    }
    // Restored with the members of a on b and of b on a, those now on b onto b's other (SIMULATED)
    // GPU: every rank runs on with its device memory.
    let out = s.job(
        &[
            "restore",
            &id,
            "--node-map",
            "a=b,b=a",
            "--device-map",
            "b:0=1",
            "--format",
            "json",
        ],
        &[],
    );
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let restored: Vec<i32> = r["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["pid"].as_i64().unwrap() as i32)
        .collect();
    assert_eq!(
        restored,
        s.pids(),
        "CRIU restores each member under its PID"
    );
    assert_eq!(r["members"][0]["node"], "b");
    s.assert_all_running();
    for (rank, gpu) in [(0, 1), (1, 1), (2, 0), (3, 0)] {
        assert_eq!(
            status(s.pids()[rank])["uuids"],
            sim::sim_gpu_uuid(gpu).to_string(),
            "rank {rank}"
        );
    }
}

#[test]
fn a_node_gone_since_the_checkpoint_gets_a_free_agent_with_its_gpus_and_store() {
    let Some(mut s) = Scene::start(&[]) else {
        return;
    };
    let out = s.job(&["checkpoint", "--job", "train", "--format", "json"], &[]);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let id = m["id"].as_str().unwrap().to_string();
    // Each member records its GPUs' models and its agent's store, for a restore elsewhere.
    assert_eq!(m["members"][2]["gpu_models"][0], sim::SIM_MODEL, "{m}");
    assert_eq!(m["members"][2]["storage"], s.store.to_str().unwrap(), "{m}");
    wait_gone(&s.pids());
    // Node b is gone; c is up, but keeps another store: nothing fits, and nothing is touched (8).
    assert!(s.agents.pop().unwrap().stop(libc::SIGTERM).is_some());
    let dir = s._dir.path().to_path_buf();
    let elsewhere = dir.join("other-store");
    s.agents
        .push(Agent::start(&s.etcd, "c", &elsewhere, &dir, &[]));
    let out = s.job(&["restore", &id], &[]);
    assert_eq!(out.status.code(), Some(8), "{}\n{}", text(&out), s.logs());
    for part in [
        "node b has no agent",
        "a: other members are restored there",
        "c: its store is",
    ] {
        assert!(text(&out).contains(part), "{part:?}: {}", text(&out));
    }
    for p in s.pids() {
        let proc = std::path::PathBuf::from(format!("/proc/{p}"));
        assert!(!proc.exists(), "pid {p} restored by a refused restore");
    }
    // d has the store and (SIMULATED) GPUs of the same model: b's members go there, a's stay on a.
    s.agents.push(Agent::start(
        &s.etcd,
        "d",
        &s.store,
        &dir,
        &[(sim::ENV_GPUS, "3")],
    ));
    let out = s.job(&["restore", &id, "--format", "json"], &[]);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    assert!(
        text(&out).contains("node b has no agent: its members were restored on d (device map GPU-"),
        "{}",
        text(&out)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let nodes = strings(&r["members"], "node");
    assert_eq!(nodes, ["a", "a", "d", "d"], "{r}");
    assert_eq!(r["placed"][0]["from"], "b", "{r}");
    assert_eq!(r["placed"][0]["to"], "d", "{r}");
    s.assert_all_running();
}

#[test]
fn a_member_whose_gpu_checkpoint_fails_aborts_the_job_and_every_rank_runs_unlocked() {
    let Some(mut s) = Scene::start(&[]) else {
        return;
    };
    // Rank 3's simulated GPU fails its checkpoint, after every member locked.
    s.add_rank(3, &["--fault", "checkpoint"]);
    let out = s.job(&["checkpoint", "--job", "train"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
    assert!(text(&out).contains("aborted"), "{}", text(&out));
    assert!(text(&out).contains("rank 3"), "{}", text(&out));
    // The members undo as soon as they see the abort (the coordinator waits for them, within limits).
    wait_all_running_and_nothing_kept(&s);
}

/// Agent b is SIGKILLed at `point` of its members' checkpoint: the job aborts; b's guardian undoes b's
/// members (whatever they reached), the coordinator's abort a's.
fn agent_killed_at(point: &str) {
    let fault = format!("{point}=kill");
    let kill = [("GPU_CHECKPOINT_FAULT", fault.as_str())];
    let Some(s) = Scene::start(&[("b", &kill)]) else {
        return;
    };
    let out = s.job(&["checkpoint", "--job", "train"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
    assert!(text(&out).contains("agent is gone"), "{}", text(&out));
    wait_all_running_and_nothing_kept(&s);
}

#[test]
fn an_agent_killed_while_its_member_is_locked_aborts_the_job() {
    agent_killed_at("cluster.member-locked");
}

#[test]
fn an_agent_killed_before_its_lock_aborts_the_job() {
    agent_killed_at("checkpoint.before-freeze");
}

#[test]
fn an_agent_killed_during_its_dump_aborts_the_job() {
    // After CRIU's dump, before the store commit: b's members are stopped with their GPU state
    // checkpointed; b's guardian puts it back and continues them.
    agent_killed_at("checkpoint.after-dump");
}

#[test]
fn an_agent_killed_while_its_members_are_restored_and_locked_aborts_the_job_restore_and_kills_every_copy(
) {
    // Agent b dies at the restore's barrier: its member is restored, GPU state back and still locked.
    let kill = [("GPU_CHECKPOINT_FAULT", "cluster.member-restored=kill")];
    let Some(s) = Scene::start(&[("b", &kill)]) else {
        return;
    };
    let out = s.job(&["checkpoint", "--job", "train"], &[]);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    wait_gone(&s.pids());
    let cps = s.job_checkpoints();
    let id = cps[0]["id"].as_str().unwrap();
    let out = s.job(&["restore", id], &[]);
    assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
    assert!(text(&out).contains("agent is gone"), "{}", text(&out));
    // a's copies are killed by the abort, b's by b's guardian: none runs on; the checkpoint is kept.
    wait_gone(&s.pids());
    assert_eq!(s.job_checkpoints().len(), 1, "{}", s.logs());
}

fn coordinator_killed(point: &str) -> Option<(Scene, std::process::Output)> {
    let s = Scene::start(&[])?;
    let fault = format!("{point}=kill");
    let out = s.job(
        &["checkpoint", "--job", "train", "--lease-ttl", "10s"],
        &[("GPU_CHECKPOINT_FAULT", &fault)],
    );
    assert_eq!(out.status.code(), None, "killed: {}", text(&out));
    Some((s, out))
}

#[test]
fn a_coordinator_killed_before_the_commit_leaves_every_rank_running_and_nothing_kept() {
    let Some((s, _)) = coordinator_killed("cluster.before-commit") else {
        return;
    };
    // The agents see the operation's lease expire without a commit, and undo.
    wait_all_running_and_nothing_kept(&s);
}

#[test]
fn a_coordinator_killed_during_the_prepare_phase_leaves_every_rank_running_and_nothing_kept() {
    let Some((s, _)) = coordinator_killed("cluster.prepare") else {
        return;
    };
    // The tasks went out: members lock (or are on their way) and wait until the operation's lease
    // expires; then each undoes and says so (its state stays under its agent's lease). Before that the
    // ranks may not even be locked yet: wait for the four "aborted" first.
    let c = s.etcd.client();
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let (kvs, _) = c.range("/gpu-checkpoint/v1/ops/").unwrap();
        let op_gone = !kvs.iter().any(|kv| kv.key.ends_with("/op"));
        let aborted = kvs
            .iter()
            .filter(|kv| String::from_utf8_lossy(&kv.value).contains("\"state\":\"aborted\""))
            .count();
        if op_gone && aborted == 4 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{kvs:?}\n{}",
            s.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    wait_all_running_and_nothing_kept(&s);
}

#[test]
fn a_coordinator_killed_after_the_commit_leaves_a_job_checkpoint_that_restores() {
    let Some((s, _)) = coordinator_killed("cluster.after-commit") else {
        return;
    };
    // Committed: the agents finish (stop the members) although the coordinator is gone.
    wait_gone(&s.pids());
    let cps = s.job_checkpoints();
    assert_eq!(cps.len(), 1, "{}", s.logs());
    let id = cps[0]["id"].as_str().unwrap();
    // The dead coordinator's operation holds the job until its lease runs out.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let out = loop {
        let out = s.job(&["restore", id], &[]);
        if out.status.code() != Some(8) || std::time::Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    s.assert_all_running();
}

/// Waits until every rank runs and nothing is kept, or fails with the agents' logs.
fn wait_all_running_and_nothing_kept(s: &Scene) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while s.stored() > 0 || s.pids().iter().any(|&p| status(p)["state"] != "running") {
        assert!(std::time::Instant::now() < deadline, "{}", s.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    s.assert_all_running();
    assert!(s.job_checkpoints().is_empty());
}

#[test]
fn an_etcd_member_stopped_during_the_prepare_phase_commits_or_aborts_cleanly() {
    let Some(mut s) = Scene::start_on(3, &[]) else {
        return;
    };
    // The prepare phase lasts at least a second (the quiesce hook); one of the three etcd members is
    // stopped in the middle of it.
    let urls = s.etcd.url_list();
    let job = std::thread::spawn(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
            .args(["job", "checkpoint", "--job", "train", "--format", "json"])
            .args([
                "--quiesce",
                "sleep1",
                "--lease-ttl",
                "10s",
                "--etcd",
                &urls,
                "--insecure-plaintext",
            ])
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_millis(500));
    s.etcd.kill_member(0);
    let out = job.join().unwrap();
    if out.status.success() {
        // Committed: it restores, every rank runs on.
        let m: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        wait_gone(&s.pids());
        let r = s.job(&["restore", m["id"].as_str().unwrap()], &[]);
        assert!(r.status.success(), "{}\n{}", text(&r), s.logs());
        s.assert_all_running();
    } else {
        assert_eq!(out.status.code(), Some(1), "{}\n{}", text(&out), s.logs());
        wait_all_running_and_nothing_kept(&s);
    }
}

#[test]
fn periodic_job_checkpoints_keep_the_newest_two_and_the_newest_restores() {
    use std::io::BufRead;
    let Some(s) = Scene::start(&[]) else { return };
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .args([
            "job",
            "checkpoint",
            "--job",
            "train",
            "--every",
            "2s",
            "--keep",
            "2",
        ])
        .args(["--lease-ttl", "10s", "--etcd", &s.etcd.url_list()])
        .arg("--insecure-plaintext")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Each committed round prints its id; after the fourth, SIGTERM (the round under way, if any,
    // finishes first).
    let mut ids = Vec::new();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let deadline = std::time::Instant::now() + Duration::from_secs(180);
    while ids.len() < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "{ids:?}\n{}",
            s.logs()
        );
        match lines.next() {
            Some(line) => ids.push(line.unwrap()),
            None => panic!("the periodic command ended: {ids:?}\n{}", s.logs()),
        }
        // Between rounds the job runs on (--leave-running is implied).
        assert!(
            s.pids().iter().all(|&p| status(p)["state"] == "running"),
            "{}",
            s.logs()
        );
    }
    // SAFETY: signalling the command this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{stderr}\n{}", s.logs());
    assert!(
        stderr.contains("retention deleted job checkpoint"),
        "{stderr}"
    );
    // A fifth round may have committed before the signal came: the newest two of all are kept.
    ids.extend(lines.map_while(Result::ok));
    let listed: Vec<String> = s
        .job_checkpoints()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(listed, ids[ids.len() - 2..], "{stderr}");
    // Only their member checkpoints (2 x 4) and manifest copies are left in the store.
    assert_eq!(s.stored(), 8, "{stderr}\n{}", s.logs());
    let mut copies: Vec<String> = std::fs::read_dir(s.store.join("jobs"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    copies.sort();
    let mut expected: Vec<String> = listed.iter().map(|id| format!("{id}.json")).collect();
    expected.sort();
    assert_eq!(copies, expected);
    // `job delete` of the older one: gone from etcd, its member checkpoints from the store; again: 7.
    let older = &listed[0];
    let out = s.job(&["delete", older], &[]);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    assert_eq!(s.job_checkpoints().len(), 1);
    assert_eq!(s.stored(), 4, "{}", s.logs());
    assert_eq!(s.job(&["delete", older], &[]).status.code(), Some(7));
    // The ranks ran on; stopped now, the newest job checkpoint brings every one back.
    s.assert_all_running();
    for p in s.pids() {
        // SAFETY: signalling processes this test started.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    wait_gone(&s.pids());
    let out = s.job(&["restore", ids.last().unwrap()], &[]);
    assert!(out.status.success(), "{}\n{}", text(&out), s.logs());
    s.assert_all_running();
}
