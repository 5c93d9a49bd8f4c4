//! The scene of the cluster tests with container members (`job add --container ID`): etcd (1 or 3
//! members) in a hub network namespace, agents a and b in namespaces of their own (b's link can be
//! cut), a runc container per node holding a SIMULATED GPU process, ranks 0 (a) and 1 (b) of job `jf`.
//! Included (`#[path]`) by the test files that use it, with `cluster_support` and `container_support`.
#![allow(dead_code)] // each test file uses its own subset

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cluster_support::netns::{
    hub_urls, in_hub_on, job_add_on, netns_ready, start_agent_on, start_etcd_members, Agent, Lab,
    NsProcess,
};
use crate::cluster_support::{etcd_bin, read};
use crate::container_support::*;
use gpu_checkpoint::freeze::sim;

/// The PID of container `id`'s GPU process (its init), once it runs and answers.
pub fn gpu_pid(runc: &Runc, id: &str) -> i32 {
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

/// The faults of issue 18 with container members: etcd in a hub namespace, agents a and b in
/// namespaces of their own (b's link can be cut), a runc container per node holding a SIMULATED GPU
/// process, ranks 0 (a) and 1 (b) of job `jf`. Fields drop in order: the agents first, the containers
/// (runc) after the namespaces.
pub struct Faults {
    pub agents: Vec<NsProcess>,
    /// etcd's members; one may be stopped ([`Faults::kill_etcd_member`]).
    pub etcd: Vec<Option<NsProcess>>,
    pub lab: Lab,
    pub runc: Runc,
    pub ids: Vec<String>,
    pub store: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Faults {
    /// The scene, b's agent run with `GPU_CHECKPOINT_FAULT=b_faults` (none if empty).
    pub fn start(b_faults: &str) -> Option<Faults> {
        Self::start_on(1, b_faults)
    }

    /// [`Faults::start`] on an etcd cluster of `members` members.
    pub fn start_on(members: usize, b_faults: &str) -> Option<Faults> {
        let bin = etcd_bin()?;
        if !containers_ready() || !netns_ready() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let runc = Runc::new(dir.path());
        let lab = Lab::new(&["a", "b"]);
        let etcd = start_etcd_members(&lab, &bin, dir.path(), members);
        let mut s = Faults {
            agents: Vec::new(),
            etcd: etcd.into_iter().map(Some).collect(),
            lab,
            runc,
            ids: Vec::new(),
            store: dir.path().join("store"),
            dir,
        };
        s.agents = vec![s.agent("a", ""), s.agent("b", b_faults)];
        // Each test of this binary has its own containers: the tests run in parallel, and one id for all
        // had them run, checkpoint and delete each other's containers.
        static SCENES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let scene = SCENES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        for (rank, node) in ["a", "b"].iter().enumerate() {
            let id = format!("gc-{}-f{scene}-{node}", std::process::id());
            let gpu = ["exec", "gpu-sim-workload", "--mib", "4", "--workers", "1"];
            let bundle = Bundle::new(&s.dir.path().join(format!("bundle-{node}")), &gpu, &[]);
            s.runc.run(&id, &bundle);
            let r = rank.to_string();
            let add = ["--job", "jf", "--rank", &r, "--container", &id];
            let out = job_add_on(&s.lab, s.dir.path(), node, &add);
            assert!(out.status.success(), "{}", text(&out));
            s.ids.push(id);
        }
        Some(s)
    }

    fn agent(&self, node: &str, faults: &str) -> NsProcess {
        let root = self.runc.root.display().to_string();
        let env: &[(&str, &str)] = match faults {
            "" => &[],
            f => &[("GPU_CHECKPOINT_FAULT", f)],
        };
        let extra = ["--runtime-root", root.as_str()];
        let agent = Agent {
            node,
            store: &self.store,
            ttl: "10s",
            extra: &extra,
            env,
        };
        start_agent_on(&self.lab, self.etcd.len(), self.dir.path(), &agent)
    }

    /// `gpu-checkpoint ARGS` run in the hub, with etcd's members as the hub reaches them.
    pub fn in_hub(&self, args: &[&str]) -> std::process::Output {
        in_hub_on(&self.lab, &hub_urls(self.etcd.len()), args)
    }

    /// `gpu-checkpoint ARGS` as [`Faults::in_hub`] runs it, with the environment `env`, not started.
    pub fn hub_command(&self, args: &[&str], env: &[(&str, &str)]) -> std::process::Command {
        let mut cmd = Lab::exec(
            &self.lab.hub,
            Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")),
        );
        cmd.args(args)
            .args(["--etcd", &hub_urls(self.etcd.len()), "--insecure-plaintext"])
            .envs(env.iter().copied());
        cmd
    }

    /// Stops etcd member `i` (SIGKILL), as a failed machine.
    pub fn kill_etcd_member(&mut self, i: usize) {
        if let Some(m) = self.etcd[i].take() {
            m.kill();
        }
    }

    /// b's agent started again, without faults (the old one, if alive, stopped first).
    pub fn restart_b(&mut self) {
        self.agents.pop();
        let b = self.agent("b", "");
        self.agents.push(b);
    }

    pub fn logs(&self) -> String {
        self.agents
            .iter()
            .map(|a| read(&a.log))
            .collect::<Vec<_>>()
            .join("\n---\n")
    }

    /// Each container's processes (host PIDs, init first).
    pub fn processes(&self) -> Vec<Vec<i32>> {
        self.ids.iter().map(|id| self.runc.pids(id)).collect()
    }

    /// The committed job checkpoints' ids.
    pub fn job_checkpoints(&self) -> Vec<String> {
        let out = self.in_hub(&["job", "list", "--format", "json"]);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["checkpoints"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_string())
            .collect()
    }

    /// Aborted and undone: within 40 s every container runs with the processes it had (`before`),
    /// its GPU process unlocked, verified and computing; nothing committed, no member checkpoint.
    pub fn assert_undone(&self, before: &[Vec<i32>]) {
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            let running = self.ids.iter().all(|id| {
                matches!(self.runc.state(id), Some((s, init)) if s == "running"
                    && sim::status(init).is_ok_and(|st| st["state"] == "running"))
            });
            if running && listed(&self.store).is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "not undone\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
        assert_eq!(self.processes(), before, "{}", self.logs());
        for id in &self.ids {
            assert_healthy(&[gpu_pid(&self.runc, id)]);
        }
        assert!(self.job_checkpoints().is_empty(), "{}", self.logs());
        assert!(listed(&self.store).is_empty(), "{:?}", listed(&self.store));
    }

    /// `job checkpoint` commits (both containers deleted, 2 member checkpoints more) and its restore
    /// brings both back, their GPU processes at or past their steps before, healthy.
    pub fn assert_commits_and_restores(&self) {
        let stored = listed(&self.store).len();
        let before: Vec<u64> = self
            .ids
            .iter()
            .map(|id| steps(gpu_pid(&self.runc, id)))
            .collect();
        let out = self.in_hub(&CHECKPOINT);
        assert!(out.status.success(), "{}\n{}", text(&out), self.logs());
        let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
        self.assert_deleted_then_restores(&id, stored + 2, &before);
    }

    /// Job checkpoint `id` is committed: the containers are gone, the store lists `stored` member
    /// checkpoints; its restore (retried while a dead coordinator's operation holds the job) brings
    /// the containers back at or past `before`, healthy.
    pub fn assert_deleted_then_restores(&self, id: &str, stored: usize, before: &[u64]) {
        for c in &self.ids {
            wait_for(&format!("container {c} deleted"), &|| {
                self.runc.state(c).is_none()
            });
        }
        assert_eq!(listed(&self.store).len(), stored, "{}", self.logs());
        let deadline = Instant::now() + Duration::from_secs(30);
        let out = loop {
            let out = self.in_hub(&["job", "restore", id, "--lease-ttl", "10s"]);
            if out.status.code() != Some(8) || Instant::now() > deadline {
                break out;
            }
            std::thread::sleep(Duration::from_millis(300));
        };
        assert!(out.status.success(), "{}\n{}", text(&out), self.logs());
        for (c, before) in self.ids.iter().zip(before) {
            let pid = gpu_pid(&self.runc, c);
            assert!(steps(pid) >= *before);
            assert_healthy(&[pid]);
        }
    }
}

pub const CHECKPOINT: [&str; 6] = ["job", "checkpoint", "--job", "jf", "--lease-ttl", "10s"];

impl Faults {
    /// Waits until an agent is registered for `node` (again).
    pub fn wait_registered(&self, node: &str) {
        wait_for(&format!("an agent registered for {node}"), &|| {
            let out = self.in_hub(&["job", "list", "--format", "json"]);
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
            let agents = v["agents"].as_array().cloned().unwrap_or_default();
            agents.iter().any(|a| a["node"] == node)
        });
    }

    /// `job checkpoint` run in the hub with the fault `POINT=kill`: it must die by it.
    pub fn kill_coordinator_at(&self, point: &str) {
        let fault = format!("{point}=kill");
        let out = self
            .hub_command(&CHECKPOINT, &[("GPU_CHECKPOINT_FAULT", &fault)])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), None, "not killed: {}", text(&out));
    }
}

impl Faults {
    /// etcd's keys under `prefix` and their values, read from the hub: a thread of this test joins the
    /// hub's network namespace (`setns` moves the calling thread only) and asks etcd there.
    pub fn etcd_range(&self, prefix: &str) -> Vec<(String, String)> {
        use gpu_checkpoint::flows::cluster::{Coordinator, EtcdConfig, EtcdCoordinator};
        use std::os::fd::AsRawFd;
        let ns = std::fs::File::open(format!("/run/netns/{}", self.lab.hub)).unwrap();
        let urls: Vec<String> = hub_urls(self.etcd.len())
            .split(',')
            .map(String::from)
            .collect();
        let prefix = prefix.to_string();
        std::thread::spawn(move || {
            // SAFETY: setns on a namespace file this thread holds open; it changes this thread alone.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            let c = EtcdCoordinator::connect(&EtcdConfig::insecure(&urls)).unwrap();
            let (kvs, _) = c.range(&prefix).unwrap();
            kvs.into_iter()
                .map(|kv| (kv.key, String::from_utf8_lossy(&kv.value).into_owned()))
                .collect()
        })
        .join()
        .unwrap()
    }

    /// The PIDs of processes in container `id`'s cgroup (runc names it after the id; CRIU restores into
    /// it): a container's processes, restored or half-restored.
    pub fn in_cgroup(id: &str) -> Vec<i32> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| {
                std::fs::read_to_string(format!("/proc/{p}/cgroup")).is_ok_and(|c| c.contains(id))
            })
            .collect()
    }

    /// The mount points under `root`, from this process's mount table.
    pub fn mounts_under(root: &Path) -> Vec<String> {
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| Path::new(p).starts_with(root))
            .map(String::from)
            .collect()
    }
}
