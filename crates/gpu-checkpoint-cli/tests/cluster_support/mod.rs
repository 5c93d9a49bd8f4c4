//! The cluster tests' real components: etcd started on free loopback ports with a private data folder
//! (killed on drop), and `gpu-checkpoint agent` processes (stopped on drop).
#![allow(dead_code)] // each test file uses its own subset

pub mod netns;
pub mod pki;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use gpu_checkpoint::flows::cluster::{Coordinator, EtcdConfig, EtcdCoordinator};

/// The etcd binary (the distribution's package, scripts/install-etcd.sh), when there is one. In CI its
/// absence fails the test; locally the test is skipped with the reason printed.
pub fn etcd_bin() -> Option<PathBuf> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let found = BIN.get_or_init(|| {
        gpu_checkpoint::path_search::which("etcd")
            .or_else(|| Some(PathBuf::from("/usr/bin/etcd")).filter(|p| p.exists()))
            .ok_or_else(|| "etcd is not installed".to_string())
    });
    match found {
        Ok(p) => Some(p.clone()),
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("the cluster tests cannot run in CI: {why} (scripts/setup.sh installs it)")
        }
        Err(why) => {
            eprintln!("SKIPPED: {why}; run scripts/setup.sh as root to run the cluster tests");
            None
        }
    }
}

/// A port nobody listens on now (the kernel's choice; etcd binds it right after).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One etcd member on loopback.
struct Member {
    child: Child,
}

/// What [`Etcd::wait_ready`]'s error says where a port etcd was given was taken before it bound it.
const PORT_TAKEN: &str = " (its port was taken meanwhile)";

/// An etcd cluster on 127.0.0.1 (1 or 3 members), its data in private folders of `dir`; killed on drop.
pub struct Etcd {
    members: Vec<Option<Member>>,
    pub urls: Vec<String>,
    /// The secure setup ([`Etcd::start_secure`]): its CA and certificates, and the user files.
    pub pki: Option<pki::Pki>,
    /// How the test itself talks to it (as root, where it is secure).
    config: EtcdConfig,
    /// The first member's Prometheus metrics, plaintext on loopback (`--listen-metrics-urls`): how
    /// many requests of each kind etcd answered ([`Etcd::requests`]).
    metrics: String,
}

impl Etcd {
    /// Plaintext etcd, without authentication: the tests of the protocol (`--insecure-plaintext`).
    pub fn start(bin: &Path, dir: &Path, size: usize) -> Etcd {
        Self::start_with(bin, dir, size, None)
    }

    /// One etcd member as docs/cluster.md sets it up: TLS with client certificates (`--client-cert-auth`)
    /// and authentication, the users and roles of [`pki::USERS`].
    pub fn start_secure(bin: &Path, dir: &Path) -> Etcd {
        let pki = pki::Pki::make(&dir.join("pki"));
        let etcd = Self::start_with(bin, dir, 1, Some(pki));
        let pki = etcd.pki.as_ref().unwrap();
        pki.enable_auth(&etcd.urls[0]);
        etcd
    }

    fn start_with(bin: &Path, dir: &Path, size: usize, mut pki: Option<pki::Pki>) -> Etcd {
        for attempt in 1.. {
            let mut etcd = Self::spawn(bin, dir, size, pki.take());
            match etcd.wait_ready(dir) {
                Ok(()) => return etcd,
                // Another process took a port between `free_port` and etcd's bind: again, on new ports.
                Err(e) if attempt < 3 && e.contains(PORT_TAKEN) => {
                    pki = etcd.pki.take();
                    drop(etcd);
                    for i in 0..size {
                        let _ = std::fs::remove_dir_all(dir.join(format!("etcd-{i}")));
                    }
                }
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    fn spawn(bin: &Path, dir: &Path, size: usize, pki: Option<pki::Pki>) -> Etcd {
        let scheme = if pki.is_some() { "https" } else { "http" };
        let tls = pki
            .as_ref()
            .map(|p| p.etcd_server_args())
            .unwrap_or_default();
        let clients: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let metrics: Vec<String> = (0..size)
            .map(|_| format!("http://127.0.0.1:{}", free_port()))
            .collect();
        let peers: Vec<u16> = (0..size).map(|_| free_port()).collect();
        let initial: Vec<String> = peers
            .iter()
            .enumerate()
            .map(|(i, p)| format!("e{i}=http://127.0.0.1:{p}"))
            .collect();
        let mut members = Vec::new();
        for i in 0..size {
            let data = dir.join(format!("etcd-{i}"));
            gpu_checkpoint::util::create_private_dir_all(&data).unwrap();
            let log = std::fs::File::create(dir.join(format!("etcd-{i}.log"))).unwrap();
            let client = format!("{scheme}://127.0.0.1:{}", clients[i]);
            let peer = format!("http://127.0.0.1:{}", peers[i]);
            let child = Command::new(bin)
                .args(["--name", &format!("e{i}")])
                .arg("--data-dir")
                .arg(&data)
                .args(["--listen-client-urls", &client])
                .args(["--advertise-client-urls", &client])
                .args(["--listen-peer-urls", &peer])
                .args(["--initial-advertise-peer-urls", &peer])
                .args(["--initial-cluster", &initial.join(",")])
                .args([
                    "--initial-cluster-token",
                    &format!("t{}", std::process::id()),
                ])
                .args(&tls)
                .args(["--listen-metrics-urls", &metrics[i]])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start etcd");
            members.push(Some(Member { child }));
        }
        let urls: Vec<String> = clients
            .iter()
            .map(|p| format!("{scheme}://127.0.0.1:{p}"))
            .collect();
        let config = match &pki {
            None => EtcdConfig::insecure(&urls),
            Some(p) => EtcdConfig {
                endpoints: urls.clone(),
                cacert: Some(p.path("ca.crt").into()),
                cert: Some(p.path("root.crt").into()),
                key: Some(p.path("root.key").into()),
                ..EtcdConfig::default()
            },
        };
        Etcd {
            members,
            urls,
            pki,
            config,
            metrics: metrics[0].clone(),
        }
    }

    /// Waits until the cluster answers; `Err` with what went wrong (naming [`PORT_TAKEN`] where
    /// another process holds one of its ports).
    fn wait_ready(&mut self, dir: &Path) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // A member that exited (its port taken by another process between `free_port` and its
            // bind) would leave the test talking to whoever holds the port.
            for (i, m) in self.members.iter_mut().flatten().enumerate() {
                if let Ok(Some(st)) = m.child.try_wait() {
                    let log = std::fs::read_to_string(dir.join(format!("etcd-{i}.log")))
                        .unwrap_or_default();
                    let taken = if log.contains("address already in use") {
                        PORT_TAKEN
                    } else {
                        ""
                    };
                    return Err(format!("etcd member {i} exited ({st}){taken}: {log}"));
                }
            }
            if let Ok(c) = EtcdCoordinator::connect(&self.config) {
                // Ours is empty: a `/ready` already there is another test's etcd on a port that was
                // free a moment before.
                if let Ok(Some(_)) = c.get("/ready") {
                    return Err(format!(
                        "another etcd answers on {:?}{PORT_TAKEN}",
                        self.urls
                    ));
                }
                if c.put("/ready", b"1", None).is_ok() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(dir.join("etcd-0.log")).unwrap_or_default();
                return Err(format!("etcd did not start: {log}"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn url_list(&self) -> String {
        self.urls.join(",")
    }

    /// The requests the first member answered so far, by kind: `unary Method` (each call) and
    /// `stream Method` (each message received on a stream: a watch created, a lease kept alive), from
    /// its gRPC metrics (`grpc_server_handled_total`, `grpc_server_msg_received_total`).
    pub fn requests(&self) -> std::collections::BTreeMap<String, f64> {
        use std::io::{Read, Write};
        let addr = self.metrics.trim_start_matches("http://");
        let mut conn = std::net::TcpStream::connect(addr).expect("etcd's metrics");
        conn.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
        let mut body = String::new();
        conn.read_to_string(&mut body).unwrap();
        let mut out = std::collections::BTreeMap::new();
        for line in body.lines() {
            let (kind, rest) = if let Some(r) = line.strip_prefix("grpc_server_handled_total{") {
                ("unary", r)
            } else if let Some(r) = line.strip_prefix("grpc_server_msg_received_total{") {
                ("stream", r)
            } else {
                continue;
            };
            let (labels, value) = rest.split_once("} ").unwrap_or_default();
            let label = |k: &str| {
                labels
                    .split(',')
                    .find_map(|l| l.strip_prefix(&format!("{k}=\"")))
                    .map(|v| v.trim_end_matches('"').to_string())
                    .unwrap_or_default()
            };
            let unary = label("grpc_type") == "unary";
            if (kind == "unary") != unary {
                continue;
            }
            let n: f64 = value.trim().parse().unwrap_or(0.0);
            *out.entry(format!("{kind} {}", label("grpc_method")))
                .or_default() += n;
        }
        out
    }

    /// The test's own client: root, where etcd is secure.
    pub fn client(&self) -> EtcdCoordinator {
        EtcdCoordinator::connect(&self.config).unwrap()
    }

    /// How agents and job commands reach it: plaintext, accepted explicitly; or, where it is secure,
    /// as user `gpu-checkpoint` through a private config file (an agent unit's `EnvironmentFile`).
    pub fn client_args(&self) -> Vec<String> {
        match &self.pki {
            None => vec![
                "--etcd".into(),
                self.url_list(),
                "--insecure-plaintext".into(),
            ],
            Some(p) => {
                let file = p.config_file(&self.url_list(), "gpu-checkpoint");
                vec!["--etcd-config".into(), file.display().to_string()]
            }
        }
    }

    /// Stops member `i` (SIGKILL), as a failed machine.
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut m) = self.members[i].take() {
            let _ = m.child.kill();
            let _ = m.child.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
    }
}

/// A `gpu-checkpoint agent` process; SIGTERM on drop (SIGKILL if it does not stop).
pub struct Agent {
    pub node: String,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Agent {
    pub fn start(etcd: &Etcd, node: &str, store: &Path, dir: &Path, env: &[(&str, &str)]) -> Agent {
        Self::spawn(etcd, node, store, dir, env, "10s", &[])
    }

    /// [`Agent::start`] with a lease of `ttl` (the benchmark's loaded machine needs a longer one) and
    /// `extra` arguments for the agent.
    pub fn spawn(
        etcd: &Etcd,
        node: &str,
        store: &Path,
        dir: &Path,
        env: &[(&str, &str)],
        ttl: &str,
        extra: &[&str],
    ) -> Agent {
        let log = dir.join(format!("agent-{node}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
            .arg("agent")
            .args(etcd.client_args())
            .args(["--node", node])
            .args(agent_local_args(dir, node))
            .arg("--storage")
            .arg(store)
            .args(["--gpu-backend", "sim", "--lease-ttl", ttl, "-v"])
            .args(extra)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start the agent");
        let c = etcd.client();
        let deadline = Instant::now() + Duration::from_secs(20);
        let key = format!("/gpu-checkpoint/v1/agents/{node}");
        while c.get(&key).unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "agent {node} did not register: {}",
                read(&log)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Agent {
            node: node.into(),
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map_or(0, |c| c.id() as i32)
    }

    /// Sends `sig` and waits for the agent to exit; returns how it did.
    pub fn stop(&mut self, sig: i32) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        // SAFETY: signalling a process this test started.
        unsafe { libc::kill(child.id() as i32, sig) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return Some(st);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return child.wait().ok();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop(libc::SIGTERM);
    }
}

/// The local socket of `node`'s agent started in `dir`, where `job add` registers its members.
pub fn agent_socket(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("agent-{node}.sock"))
}

/// The agent's own folders in `dir` (its socket, its state: the members registered through it) and
/// the tests' quiesce hooks, scripts in `dir`: `sleep1` and `sleep3` (a prepare phase that lasts), and
/// `record` (appends `JOB RANK PID` to `dir/quiesced`).
pub fn agent_local_args(dir: &Path, node: &str) -> Vec<String> {
    use std::os::unix::fs::PermissionsExt;
    let state = dir.join(format!("agent-{node}.state"));
    let mut args = vec![
        "--socket".into(),
        agent_socket(dir, node).display().to_string(),
        "--state-dir".into(),
        state.display().to_string(),
    ];
    let record = format!(
        "echo $GPU_CHECKPOINT_JOB $GPU_CHECKPOINT_RANK $GPU_CHECKPOINT_PID >> {}",
        dir.join("quiesced").display()
    );
    for (name, body) in [
        ("sleep1", "sleep 1"),
        ("sleep3", "sleep 3"),
        ("record", &record),
    ] {
        let path = dir.join(format!("hook-{name}"));
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        args.push("--quiesce-hook".into());
        args.push(format!("{name}={}", path.display()));
    }
    args
}

/// `gpu-checkpoint job add ARGS` on `node`, through its agent started in `dir`.
pub fn job_add(dir: &Path, node: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .args(["job", "add", "--node", node])
        .args(args)
        .arg("--agent-socket")
        .arg(agent_socket(dir, node))
        .output()
        .expect("run gpu-checkpoint job add")
}

pub fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_default()
}

/// Runs `gpu-checkpoint` with `args`.
pub fn gc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .args(args)
        .output()
        .expect("run gpu-checkpoint")
}
