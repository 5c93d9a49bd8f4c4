//! The fleet's trust model with its real components (issue 26): etcd as docs/cluster.md secures it
//! (TLS, client certificates checked by etcd, authentication, a role limited to `/gpu-checkpoint/`),
//! `gpu-checkpoint agent` and `job` as clients of it, real CRIU and SIMULATED GPU processes.
//!
//! - Good credentials work; a wrong CA, no client certificate, one from another CA, a wrong password, a
//!   user that may only read, and plaintext are each refused with their exit code, and nothing is done.
//! - The attacks of issue 26, by someone who can write the project's keys in etcd (the strongest
//!   network attacker: the agent's own role): a quiesce command, a task for a process nobody
//!   registered, restore and delete tasks on a checkpoint no job made, and a job manifest whose id
//!   walks out of the store. Each did its harm on 99f1f33; each is refused now.
//!
//! Needs etcd, etcdctl, openssl, root and CRIU: fails in CI without them, skips locally with the reason.
#![cfg(feature = "cluster")]

mod cluster_support;
mod sim_support;

use std::process::Output;
use std::time::{Duration, Instant};

use cluster_support::pki::{password, USERS};
use cluster_support::*;
use gpu_checkpoint::flows::cluster::{Coordinator, EtcdConfig, EtcdCoordinator, Password};
use sim_support::{assert_healthy, criu_ready, listed, text, SimProcess};

/// Secure etcd, one agent (`n1`) on it, a store; dropped agent first.
struct Secure {
    agent: Agent,
    etcd: Etcd,
    store: std::path::PathBuf,
    dir: tempfile::TempDir,
}

impl Secure {
    fn start() -> Option<Secure> {
        let bin = etcd_bin()?;
        if !criu_ready() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let etcd = Etcd::start_secure(&bin, dir.path());
        let store = dir.path().join("store");
        let agent = Agent::start(&etcd, "n1", &store, dir.path(), &[]);
        Some(Secure {
            agent,
            etcd,
            store,
            dir,
        })
    }

    /// [`Secure::start`] with a SIMULATED GPU process registered as rank 0 of job `train`.
    fn with_rank() -> Option<(Secure, SimProcess)> {
        let s = Secure::start()?;
        let rank = SimProcess::start(&["--mib", "4"]);
        s.add(0, rank.pid);
        Some((s, rank))
    }

    fn pki(&self, file: &str) -> String {
        self.etcd.pki.as_ref().unwrap().path(file)
    }

    /// `gpu-checkpoint job ARGS` with `etcd` as its etcd settings.
    fn job(&self, args: &[&str], etcd: &[String]) -> Output {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
            .arg("job")
            .args(args)
            .args(etcd)
            .output()
            .unwrap();
        assert_no_secret(&text(&out));
        out
    }

    /// etcd settings: the CA `ca`, the client certificate of `cert` (none if empty) and user `user`
    /// with `password` (none if empty), given as flags and ETCDCTL-style values.
    fn creds(&self, ca: &str, cert: &str, user: &str, password: &str) -> Vec<String> {
        let mut v = vec![
            "--etcd".into(),
            self.etcd.url_list(),
            "--cacert".into(),
            self.pki(ca),
        ];
        if !cert.is_empty() {
            v.extend(["--cert".into(), self.pki(&format!("{cert}.crt"))]);
            v.extend(["--key".into(), self.pki(&format!("{cert}.key"))]);
        }
        if !user.is_empty() {
            v.extend(["--user".into(), format!("{user}:{password}")]);
        }
        v
    }

    /// The agent's etcd access as an attacker who can write the project's keys holds it: user
    /// `gpu-checkpoint`, with its certificate.
    fn writer(&self) -> EtcdCoordinator {
        EtcdCoordinator::connect(&EtcdConfig {
            endpoints: self.etcd.urls.clone(),
            cacert: Some(self.pki("ca.crt").into()),
            cert: Some(self.pki("gpu-checkpoint.crt").into()),
            key: Some(self.pki("gpu-checkpoint.key").into()),
            user: Some("gpu-checkpoint".into()),
            password: Some(Password::new(password("gpu-checkpoint"))),
            insecure_plaintext: false,
        })
        .unwrap()
    }

    fn add(&self, rank: u32, pid: i32) {
        let (r, p) = (rank.to_string(), pid.to_string());
        let out = job_add(
            self.dir.path(),
            "n1",
            &["--job", "train", "--rank", &r, "--pid", &p],
        );
        assert!(out.status.success(), "{}", text(&out));
    }

    fn log(&self) -> String {
        read(&self.agent.log)
    }

    fn job_checkpoints(&self) -> usize {
        let (kvs, _) = self
            .etcd
            .client()
            .range("/gpu-checkpoint/v1/checkpoints/")
            .unwrap();
        kvs.len()
    }
}

/// No password of the tests' users appears in `text`.
fn assert_no_secret(text: &str) {
    for (user, pw) in USERS {
        assert!(!text.contains(pw), "{user}'s password printed: {text}");
    }
}

#[test]
fn secure_etcd_takes_good_credentials_and_refuses_each_bad_one_before_anything_is_done() {
    let Some((s, rank)) = Secure::with_rank() else {
        return;
    };
    let ckpt = ["checkpoint", "--job", "train", "--leave-running"];
    // Good: the agent's credentials from its config file (TLS, its certificate, user and password).
    let good = s.etcd.client_args();
    let out = s.job(&ckpt, &good);
    assert!(out.status.success(), "{}\n{}", text(&out), s.log());
    assert_eq!(s.job_checkpoints(), 1);
    // The same as flags, the password from ETCDCTL_PASSWORD.
    let mut flags = s.creds("ca.crt", "gpu-checkpoint", "", "");
    flags.extend(["--user".into(), "gpu-checkpoint".into()]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .args(["job", "list"])
        .args(&flags)
        .env("ETCDCTL_PASSWORD", password("gpu-checkpoint"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("agent n1"));

    let pw = password("gpu-checkpoint");
    let plain = s.etcd.url_list().replace("https://", "http://");
    let cases: Vec<(&str, Vec<String>, i32, &str)> = vec![
        (
            "a CA that did not sign etcd's certificate",
            s.creds("rogue-ca.crt", "gpu-checkpoint", "gpu-checkpoint", pw),
            4,
            "not signed by the CA",
        ),
        (
            "no client certificate",
            s.creds("ca.crt", "", "gpu-checkpoint", pw),
            4,
            "requires a client certificate",
        ),
        (
            "a client certificate of another CA",
            s.creds("ca.crt", "rogue", "gpu-checkpoint", pw),
            4,
            "refused",
        ),
        (
            "a wrong password",
            s.creds("ca.crt", "gpu-checkpoint", "gpu-checkpoint", "wrong"),
            4,
            "authentication failed",
        ),
        (
            "a user that may only read",
            s.creds("ca.crt", "reader", "reader", password("reader")),
            4,
            "permission denied",
        ),
        (
            "plaintext",
            vec!["--etcd".into(), plain.clone()],
            2,
            "--insecure-plaintext",
        ),
    ];
    for (what, creds, code, says) in cases {
        let out = s.job(&ckpt, &creds);
        assert_eq!(out.status.code(), Some(code), "{what}: {}", text(&out));
        assert!(text(&out).contains(says), "{what}: {}", text(&out));
        // Nothing was done: no job checkpoint, no operation left, the member computes on.
        assert_eq!(s.job_checkpoints(), 1, "{what}");
        let (ops, _) = s.etcd.client().range("/gpu-checkpoint/v1/ops/").unwrap();
        assert!(ops.is_empty(), "{what}: {ops:?}");
        sim_support::assert_progress(rank.pid);
    }
    assert_eq!(listed(&s.store).len(), 1);
    assert_healthy(&[rank.pid]);
    // An agent with a read-only user cannot register: it says so and exits 4.
    let reader = s
        .etcd
        .pki
        .as_ref()
        .unwrap()
        .config_file(&s.etcd.url_list(), "reader");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .args([
            "agent",
            "--etcd-config",
            reader.to_str().unwrap(),
            "--node",
            "n2",
        ])
        .arg("--storage")
        .arg(&s.store)
        .args(agent_local_args(s.dir.path(), "n2"))
        .args(["--gpu-backend", "sim"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(4), "{}", text(&out));
    assert!(text(&out).contains("permission denied"), "{}", text(&out));
    assert_no_secret(&text(&out));
    assert_no_secret(&s.log());
}

/// Writes an operation `op` of job `train` as a forger would (raw JSON, as with curl on etcd's gateway):
/// the operation record, the decision `commit`, the manifest `manifest` if any, and `task` for rank 0
/// on node n1.
fn forge(
    c: &dyn Coordinator,
    op: &str,
    task: serde_json::Value,
    manifest: Option<serde_json::Value>,
) {
    let root = "/gpu-checkpoint/v1";
    let head = serde_json::json!({"schema": "gpu-checkpoint/cluster", "schema_version": 1});
    let with_head = |mut v: serde_json::Value| {
        v.as_object_mut()
            .unwrap()
            .extend(head.as_object().unwrap().clone());
        serde_json::to_vec(&v).unwrap()
    };
    let member = task["member"].clone();
    let record = serde_json::json!({"id": op, "job": "train", "kind": task["kind"],
        "members": [member], "started_unix_ms": 1});
    c.put(&format!("{root}/ops/{op}/op"), &with_head(record), None)
        .unwrap();
    c.put(&format!("{root}/ops/{op}/decision"), b"commit", None)
        .unwrap();
    if let Some(m) = manifest {
        c.put(&format!("{root}/checkpoints/{op}"), &with_head(m), None)
            .unwrap();
    }
    let mut t = serde_json::json!({"op": op, "job": "train", "leave_running": false,
        "lock_timeout_ms": null, "quiesce": null, "checkpoint": null});
    t.as_object_mut()
        .unwrap()
        .extend(task.as_object().unwrap().clone());
    c.put(
        &format!("{root}/tasks/n1/{op}/00000000"),
        &with_head(t),
        None,
    )
    .unwrap();
}

/// Waits (up to 60 s) for the agent's answer to operation `op`'s rank 0: its state record.
fn answered(s: &Secure, op: &str) -> serde_json::Value {
    let key = format!("/gpu-checkpoint/v1/ops/{op}/members/00000000");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(kv) = s.etcd.client().get(&key).unwrap() {
            let v: serde_json::Value = serde_json::from_slice(&kv.value).unwrap();
            if v["state"] != "locked" && v["state"] != "durable" {
                return v;
            }
        }
        assert!(Instant::now() < deadline, "no answer to {op}: {}", s.log());
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn member(pid: i32) -> serde_json::Value {
    serde_json::json!({"rank": 0, "node": "n1", "pid": pid, "container": null})
}

#[test]
fn a_forged_quiesce_command_is_never_run() {
    let Some((s, rank)) = Secure::with_rank() else {
        return;
    };
    let pwned = s.dir.path().join("pwned");
    let cmd = format!("id > {}", pwned.display());
    let task = serde_json::json!({"kind": "checkpoint", "member": member(rank.pid),
        "leave_running": true, "quiesce": cmd});
    forge(&s.writer(), "evil-1", task, None);
    let state = answered(&s, "evil-1");
    assert_eq!(state["state"], "failed", "{state}");
    assert!(s.log().contains("quiesce hook"), "{}", s.log());
    assert!(
        !pwned.exists(),
        "the forged quiesce command ran: {}",
        read(&pwned)
    );
    assert!(listed(&s.store).is_empty());
    assert_healthy(&[rank.pid]);
}

#[test]
fn a_forged_task_for_a_process_nobody_registered_leaves_it_alone() {
    let Some(s) = Secure::start() else { return };
    let victim = SimProcess::start(&["--mib", "4"]);
    let task = serde_json::json!({"kind": "checkpoint", "member": member(victim.pid)});
    forge(&s.writer(), "evil-2", task, None);
    let state = answered(&s, "evil-2");
    assert_eq!(state["state"], "failed", "{state}");
    assert_eq!(state["exit"], 4, "{state}");
    assert!(
        state["error"].as_str().unwrap().contains("not registered"),
        "{state}"
    );
    // Not checkpointed, not stopped, not killed.
    assert!(listed(&s.store).is_empty(), "{:?}", listed(&s.store));
    assert_healthy(&[victim.pid]);
}

#[test]
fn forged_restore_and_delete_tasks_leave_a_checkpoint_no_job_made_alone() {
    let Some(s) = Secure::start() else { return };
    // A plain checkpoint of the node's store, of no job.
    let victim = SimProcess::start(&["--mib", "4"]);
    let args = sim_support::checkpoint_args(victim.pid, &s.store, &["--format", "json"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let id = sim_support::json_ok(&args)["id"]
        .as_str()
        .unwrap()
        .to_string();
    sim_support::wait_gone(&[victim.pid]);
    let forged = |op: &str, kind: &str| {
        let task = serde_json::json!({"kind": kind, "member": member(victim.pid),
            "checkpoint": id, "job_checkpoint": "evil-1"});
        forge(&s.writer(), op, task, None);
        answered(&s, op)
    };
    let restored = forged("evil-3", "restore");
    assert_eq!(restored["state"], "failed", "{restored}");
    assert!(
        restored["error"].as_str().unwrap().contains("not rank 0's"),
        "{restored}"
    );
    assert!(
        !gpu_checkpoint::proc::is_alive(victim.pid),
        "the forged restore ran it again"
    );
    let deleted = forged("evil-4", "delete");
    assert_eq!(deleted["state"], "failed", "{deleted}");
    assert_eq!(deleted["exit"], 4, "{deleted}");
    let kept = listed(&s.store);
    assert!(
        kept.iter().any(|c| c["id"] == id.as_str()),
        "the forged delete removed it: {kept:?}"
    );
}

#[test]
fn a_job_manifest_whose_id_walks_out_of_the_store_writes_nothing_there() {
    // A registered member: the forger may checkpoint it (an etcd writer may run job operations), but
    // the manifest it forges names a file outside the store.
    let Some((s, rank)) = Secure::with_rank() else {
        return;
    };
    let outside = s.dir.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let manifest = serde_json::json!({"id": "../../outside/PWN", "job": "train",
        "leave_running": true, "members": [],
        "cut": {"started_unix_ms": 1, "locked_unix_ms": 1, "committed_unix_ms": 1},
        "timings_ms": {"prepare": 0, "checkpoint": 0, "commit": 0, "release": 0, "total": 0, "etcd": 0}});
    let task = serde_json::json!({"kind": "checkpoint", "member": member(rank.pid),
        "leave_running": true});
    forge(&s.writer(), "evil-5", task, Some(manifest));
    let state = answered(&s, "evil-5");
    assert!(
        state["state"] == "done" || state["state"] == "failed",
        "{state}"
    );
    let written: Vec<_> = std::fs::read_dir(&outside).unwrap().flatten().collect();
    assert!(written.is_empty(), "written outside the store: {written:?}");
    assert!(s.log().contains("names job checkpoint"), "{}", s.log());
    assert_healthy(&[rank.pid]);
}
