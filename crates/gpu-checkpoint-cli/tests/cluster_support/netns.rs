//! Network namespaces for the cluster tests: a "hub" namespace that runs etcd (and the coordinator),
//! and one namespace per node, each joined to the hub by a veth pair (node `i`: 10.77.i.2 in the node,
//! 10.77.i.1 in the hub). Every address lives inside namespaces this test made; the machine's own
//! network is never touched. Removed on drop, also when the test fails (after the processes in them,
//! which the scene drops first).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Whether namespaces can be made here: root and a working `ip netns`. In CI their absence fails the
/// test; locally it is skipped with the reason printed.
pub fn netns_ready() -> bool {
    // SAFETY: geteuid has no preconditions.
    let why = if unsafe { libc::geteuid() } != 0 {
        Some("not running as root".to_string())
    } else {
        match Command::new("ip").args(["netns", "list"]).output() {
            Ok(o) if o.status.success() => None,
            Ok(o) => Some(format!(
                "`ip netns list` failed: {}",
                String::from_utf8_lossy(&o.stderr)
            )),
            Err(e) => Some(format!("no `ip` command (iproute2): {e}")),
        }
        .or_else(|| {
            gpu_checkpoint::path_search::which("nsenter")
                .is_none()
                .then(|| "no `nsenter` (util-linux)".to_string())
        })
    };
    match why {
        None => true,
        Some(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("the network namespace tests cannot run in CI: {why}")
        }
        Some(why) => {
            eprintln!("SKIPPED: {why}; the network namespace tests need root and iproute2");
            false
        }
    }
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The namespaces (hub first); deleted on drop.
pub struct Lab {
    pub hub: String,
    nodes: Vec<(String, String)>,
    made: Vec<String>,
}

impl Lab {
    /// The hub and a namespace per node in `nodes`, named after this test process and a count of
    /// its labs (unique while it runs).
    pub fn new(nodes: &[&str]) -> Lab {
        static LABS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = LABS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let tag = format!("gc{}x{n}", std::process::id());
        let mut lab = Lab {
            hub: format!("{tag}hub"),
            nodes: Vec::new(),
            made: Vec::new(),
        };
        lab.add_ns(&lab.hub.clone());
        for (i, node) in nodes.iter().enumerate() {
            let ns = format!("{tag}{node}");
            lab.add_ns(&ns);
            lab.link(i, &ns);
            lab.nodes.push((node.to_string(), ns));
        }
        // The hub forwards between the veths: its own namespace's sysctl, nobody else's.
        let out = Lab::exec(&lab.hub, Path::new("sh"))
            .args(["-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
            .output()
            .expect("nsenter");
        assert!(out.status.success(), "{out:?}");
        lab
    }

    /// Joins node `i`'s namespace `ns` to the hub: a veth pair, made inside the hub (its names are
    /// the hub's own) with its peer moved to the node, addresses, and the node's route through the hub
    /// (a lockstep job's ranks talk across nodes).
    fn link(&self, i: usize, ns: &str) {
        let (h, n) = (format!("h{i}"), format!("n{i}"));
        let hub = self.hub.as_str();
        ip(&[
            "-n", hub, "link", "add", &h, "type", "veth", "peer", "name", &n, "netns", ns,
        ]);
        ip(&[
            "-n",
            hub,
            "addr",
            "add",
            &format!("10.77.{i}.1/24"),
            "dev",
            &h,
        ]);
        ip(&["-n", hub, "link", "set", &h, "up"]);
        ip(&[
            "-n",
            ns,
            "addr",
            "add",
            &format!("10.77.{i}.2/24"),
            "dev",
            &n,
        ]);
        ip(&["-n", ns, "link", "set", &n, "up"]);
        let via = format!("10.77.{i}.1");
        ip(&["-n", ns, "route", "add", "default", "via", &via]);
    }

    fn add_ns(&mut self, ns: &str) {
        ip(&["netns", "add", ns]);
        self.made.push(ns.to_string());
        ip(&["-n", ns, "link", "set", "lo", "up"]);
    }

    fn index(&self, node: &str) -> usize {
        self.nodes.iter().position(|(n, _)| n == node).unwrap()
    }

    /// The namespace of `node`.
    pub fn ns(&self, node: &str) -> &str {
        &self.nodes[self.index(node)].1
    }

    /// `node`'s own address (the node end of its veth).
    pub fn addr(&self, node: &str) -> String {
        format!("10.77.{}.2", self.index(node))
    }

    /// etcd's URL as `node` reaches it (through its veth).
    pub fn etcd_url_from(&self, node: &str) -> String {
        self.etcd_urls_from(node, 1)
    }

    /// The URLs of the hub's `members` etcd members ([`start_etcd_members`]) as `node` reaches them.
    pub fn etcd_urls_from(&self, node: &str, members: usize) -> String {
        hub_urls(members).replace("127.0.0.1", &format!("10.77.{}.1", self.index(node)))
    }

    /// A command run inside network namespace `ns`, and only that one: `nsenter --net` (not `ip netns
    /// exec`, which makes a mount namespace of its own per command: CRIU, run by an agent, would then
    /// find its ranks in another mount namespace). nsenter execs the program: the child is it.
    pub fn exec(ns: &str, program: &Path) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{ns}"))
            .arg("--")
            .arg(program);
        c
    }

    /// Joins `node` to the hub again after [`Lab::cut`], as it was.
    pub fn heal(&self, node: &str) {
        let i = self.index(node);
        self.link(i, &self.nodes[i].1);
    }

    /// Cuts `node` off: its veth pair goes (deleting one end deletes both).
    pub fn cut(&self, node: &str) {
        ip(&[
            "-n",
            &self.hub,
            "link",
            "del",
            &format!("h{}", self.index(node)),
        ]);
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in self.made.iter().rev() {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A process run in a namespace ([`Lab::exec`]); SIGTERM on drop, SIGKILL if it does not stop.
pub struct NsProcess {
    child: Child,
    pub log: PathBuf,
}

impl NsProcess {
    pub fn spawn(mut cmd: Command, log: PathBuf) -> NsProcess {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("nsenter");
        NsProcess { child, log }
    }
}

impl NsProcess {
    /// SIGKILL, as a failed machine, and waits for it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for NsProcess {
    fn drop(&mut self) {
        // SAFETY: signalling a process this test started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().ok().flatten().is_none() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// etcd in the hub, listening on all of the hub's addresses (loopback and the veths' hub ends).
pub fn start_etcd(lab: &Lab, bin: &Path, dir: &Path) -> NsProcess {
    start_etcd_members(lab, bin, dir, 1).pop().unwrap()
}

/// The client port of etcd member `i` in the hub (the first one's is etcd's usual 2379).
fn client_port(i: usize) -> u16 {
    2379 + 10000 * i as u16
}

/// The hub's etcd URLs for `members` members, as the hub itself reaches them (loopback).
pub fn hub_urls(members: usize) -> String {
    (0..members)
        .map(|i| format!("http://127.0.0.1:{}", client_port(i)))
        .collect::<Vec<_>>()
        .join(",")
}

/// An etcd cluster of `members` members in the hub, each on its own ports, listening on all of the
/// hub's addresses (loopback and the veths' hub ends); returns once it answers.
pub fn start_etcd_members(lab: &Lab, bin: &Path, dir: &Path, members: usize) -> Vec<NsProcess> {
    let peer = |i: usize| format!("http://127.0.0.1:{}", client_port(i) + 1);
    let name = |i: usize| match (members, i) {
        (1, _) => "hub".to_string(),
        _ => format!("hub{i}"),
    };
    let initial: Vec<String> = (0..members)
        .map(|i| format!("{}={}", name(i), peer(i)))
        .collect();
    let etcd: Vec<NsProcess> = (0..members)
        .map(|i| {
            let data = dir.join(format!("etcd-{}", name(i)));
            gpu_checkpoint::util::create_private_dir_all(&data).unwrap();
            let mut cmd = Lab::exec(&lab.hub, bin);
            cmd.args(["--name", &name(i)])
                .arg("--data-dir")
                .arg(&data)
                .args([
                    "--listen-client-urls",
                    &format!("http://0.0.0.0:{}", client_port(i)),
                ])
                .args([
                    "--advertise-client-urls",
                    &format!("http://127.0.0.1:{}", client_port(i)),
                ])
                .args(["--listen-peer-urls", &peer(i)])
                .args(["--initial-advertise-peer-urls", &peer(i)])
                .args(["--initial-cluster", &initial.join(",")]);
            NsProcess::spawn(cmd, dir.join(format!("etcd-{}.log", name(i))))
        })
        .collect();
    let urls = hub_urls(members);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !in_hub_on(lab, &urls, &["job", "list"]).status.success() {
        assert!(
            Instant::now() < deadline,
            "etcd did not start in the hub: {}",
            super::read(&etcd[0].log)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    etcd
}

/// `gpu-checkpoint ARGS --etcd (the hub's loopback)` run in the hub: the coordinator's side.
pub fn in_hub(lab: &Lab, args: &[&str]) -> Output {
    in_hub_on(lab, "http://127.0.0.1:2379", args)
}

/// [`in_hub`] with etcd at `urls` (comma-separated, as the hub reaches them).
pub fn in_hub_on(lab: &Lab, urls: &str, args: &[&str]) -> Output {
    Lab::exec(&lab.hub, Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")))
        .args(args)
        .args(["--etcd", urls, "--insecure-plaintext"])
        .output()
        .unwrap()
}

/// `gpu-checkpoint job add ARGS` run in `node`'s namespace (on the member's node), through its agent
/// started with its folders in `dir`.
pub fn job_add_on(lab: &Lab, dir: &Path, node: &str, args: &[&str]) -> Output {
    Lab::exec(
        lab.ns(node),
        Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")),
    )
    .args(["job", "add", "--node", node])
    .args(args)
    .arg("--agent-socket")
    .arg(super::agent_socket(dir, node))
    .output()
    .unwrap()
}

/// `gpu-checkpoint agent` for `node` in its namespace, reaching etcd through its veth, with `extra`
/// arguments and environment `env`; returns once it is registered.
pub fn start_agent(
    lab: &Lab,
    node: &str,
    store: &Path,
    dir: &Path,
    ttl: &str,
    extra: &[&str],
    env: &[(&str, &str)],
) -> NsProcess {
    let agent = Agent {
        node,
        store,
        ttl,
        extra,
        env,
    };
    start_agent_on(lab, 1, dir, &agent)
}

/// What [`start_agent_on`] starts: the agent of `node` with its store, lease, `extra` arguments and
/// environment `env`.
pub struct Agent<'a> {
    pub node: &'a str,
    pub store: &'a Path,
    pub ttl: &'a str,
    pub extra: &'a [&'a str],
    pub env: &'a [(&'a str, &'a str)],
}

/// [`start_agent`] with the hub's etcd of `members` members ([`start_etcd_members`]); its log in `dir`.
pub fn start_agent_on(lab: &Lab, members: usize, dir: &Path, a: &Agent) -> NsProcess {
    let Agent {
        node,
        store,
        ttl,
        extra,
        env,
    } = *a;
    let mut cmd = Lab::exec(
        lab.ns(node),
        Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")),
    );
    let urls = lab.etcd_urls_from(node, members);
    cmd.args([
        "agent",
        "--etcd",
        &urls,
        "--insecure-plaintext",
        "--node",
        node,
    ])
    .args(super::agent_local_args(dir, node))
    .arg("--storage")
    .arg(store)
    .args(["--gpu-backend", "sim", "--lease-ttl", ttl, "-v"])
    .args(extra)
    .envs(env.iter().copied());
    let agent = NsProcess::spawn(cmd, dir.join(format!("agent-{node}.log")));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = in_hub_on(
            lab,
            &hub_urls(members),
            &["job", "list", "--format", "json"],
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        let agents = v["agents"].as_array().cloned().unwrap_or_default();
        if agents.iter().any(|a| a["node"] == node) {
            return agent;
        }
        assert!(
            Instant::now() < deadline,
            "agent {node} did not register: {}",
            super::read(&agent.log)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `gpu-checkpoint ARGS --quiesce sleep3` in the hub (a job checkpoint), `node` cut off a second
/// in: during the prepare phase, which the quiesce hook makes last at least 3 s.
pub fn cut_during_prepare(lab: &Lab, node: &str, args: &[&str]) -> Output {
    let hub = lab.hub.clone();
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let job = std::thread::spawn(move || {
        Lab::exec(&hub, Path::new(env!("CARGO_BIN_EXE_gpu-checkpoint")))
            .args(args)
            .args(["--quiesce", "sleep3", "--etcd", "http://127.0.0.1:2379"])
            .arg("--insecure-plaintext")
            .output()
            .unwrap()
    });
    std::thread::sleep(Duration::from_secs(1));
    lab.cut(node);
    job.join().unwrap()
}
