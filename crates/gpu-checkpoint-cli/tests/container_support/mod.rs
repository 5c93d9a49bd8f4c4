//! Real runc containers for the container tests: a minimal bundle built by the test (static busybox, the
//! test workloads and the shared libraries they load), a private runtime root per test, and containers
//! deleted on drop (after unmounting what a failed restore left: `runc delete -f` would otherwise empty
//! the bundle's rootfs).

#![allow(dead_code)] // each test file uses a different subset

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use gpu_checkpoint::flows::container::unmount_under;

pub mod podman;

#[path = "../sim_support/mod.rs"]
pub mod sim_support;
pub use sim_support::*;

/// Whether real runc containers can run here: root, our CRIU, runc and a static busybox. In CI their
/// absence fails the test; locally it is skipped with the reason.
pub fn containers_ready() -> bool {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    if !criu_ready() {
        return false;
    }
    let ready = READY.get_or_init(|| {
        let runc = Command::new("runc").arg("--version").output();
        if !runc.is_ok_and(|o| o.status.success()) {
            return Err("runc is not installed".into());
        }
        if !Path::new(BUSYBOX).is_file() {
            return Err(format!("{BUSYBOX} (busybox-static) is missing"));
        }
        Ok(())
    });
    common::needs(
        "container",
        ready,
        "scripts/install-containers.sh installs them",
    )
}

/// Whether real runsc sandboxes can run here (besides [`containers_ready`]): runsc installed. In CI its
/// absence fails the test; locally it is skipped with the reason.
pub fn runsc_ready() -> bool {
    containers_ready() && installed("runsc", "runsc", |o| !o.stdout.is_empty())
}

/// Whether `BINARY --version` answers as `ok` says, for the `tests` tests ([`common::needs`]: a failure
/// in CI, skipped locally).
pub fn installed(tests: &str, binary: &str, ok: fn(&std::process::Output) -> bool) -> bool {
    let found = match Command::new(binary).arg("--version").output() {
        Ok(o) if ok(&o) => Ok(()),
        _ => Err(format!("{binary} is not installed")),
    };
    common::needs(tests, &found, "scripts/install-containers.sh installs it")
}

/// A unique container id: tests run in parallel, and runc names each container's cgroup after it.
pub fn cid(name: &str) -> String {
    format!("gc-{}-{name}", std::process::id())
}

/// A temporary folder holding a runtime with a state folder of its own (`--root`) and a bundle, beside a
/// store path. Fields drop in order: the runtime's containers are deleted before the folder that holds the
/// runtime's state goes (dropped first, the folder took the state with it and left every container
/// running).
pub struct Scene {
    pub store: PathBuf,
    pub runc: Runc,
    pub bundle: Bundle,
    pub dir: tempfile::TempDir,
}

impl Scene {
    /// runc, its bundle running `args` with `env`: `None` where containers cannot run here
    /// ([`containers_ready`]).
    pub fn runc(args: &[&str], env: &[&str]) -> Option<Scene> {
        containers_ready().then(|| Scene::with(Runc::new, args, env))
    }

    /// [`Scene::runc`] running `workload memory --mib MIB` (its state in `/state/mem`).
    pub fn memory(mib: &str) -> Option<Scene> {
        Scene::runc(
            &[&format!(
                "exec workload memory --mib {mib} --state /state/mem"
            )],
            &[],
        )
    }

    /// [`Scene::runc`] with runsc ([`runsc_ready`]).
    pub fn runsc(args: &[&str], env: &[&str]) -> Option<Scene> {
        runsc_ready().then(|| Scene::with(Runc::runsc, args, env))
    }

    fn with(runtime: fn(&Path) -> Runc, args: &[&str], env: &[&str]) -> Scene {
        let dir = tempfile::tempdir().unwrap();
        Scene {
            store: dir.path().join("store"),
            runc: runtime(dir.path()),
            bundle: Bundle::new(&dir.path().join("bundle"), args, env),
            dir,
        }
    }

    /// Runs the bundle as container `name` made unique ([`cid`]): its id.
    pub fn run(&self, name: &str) -> String {
        let id = cid(name);
        self.runc.run(&id, &self.bundle);
        id
    }

    /// `gpu-checkpoint ARGS` on the store and the runtime, with `env` added.
    pub fn gc(&self, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
        Command::new(gpu_checkpoint())
            .args(args)
            .args(store_args(&self.store, &self.runc))
            .envs(env.iter().copied())
            .output()
            .unwrap()
    }
}

/// busybox-static's binary.
const BUSYBOX: &str = "/bin/busybox";

/// A bundle: `config.json` and `rootfs/` with busybox, `workload` and `gpu-sim-workload`.
pub struct Bundle {
    pub dir: PathBuf,
}

impl Bundle {
    /// A bundle in `dir` whose container runs the shell command `args` (joined), with `env` added.
    pub fn new(dir: &Path, args: &[&str], env: &[&str]) -> Bundle {
        let rootfs = dir.join("rootfs");
        for d in ["bin", "proc", "sys", "dev", "tmp", "state"] {
            std::fs::create_dir_all(rootfs.join(d)).unwrap();
        }
        std::fs::copy(BUSYBOX, rootfs.join("bin/busybox")).unwrap();
        for applet in ["sh", "ip", "nc", "sleep", "cat"] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        for bin in [common::workload_bin(), sim_workload()] {
            std::fs::copy(&bin, rootfs.join("bin").join(bin.file_name().unwrap())).unwrap();
            copy_libraries(&bin, &rootfs);
        }
        let out = Command::new("runc")
            .args(["spec", "--bundle"])
            .arg(dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "runc spec: {out:?}");
        let path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let script = args.join(" ");
        let process = &mut config["process"];
        process["terminal"] = false.into();
        process["args"] = serde_json::json!(["sh", "-c", script]);
        for e in env {
            process["env"].as_array_mut().unwrap().push((*e).into());
        }
        // Bringing the container's own loopback up (`ip link set lo up`) needs CAP_NET_ADMIN (in its
        // network namespace).
        for set in process["capabilities"]
            .as_object_mut()
            .unwrap()
            .values_mut()
        {
            set.as_array_mut().unwrap().push("CAP_NET_ADMIN".into());
        }
        config["root"]["readonly"] = false.into();
        std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        Bundle {
            dir: dir.to_path_buf(),
        }
    }

    /// The container joins `ns` by path instead of a network namespace of its own.
    pub fn join_netns(&self, ns: &NetNs) {
        let path = self.dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for n in config["linux"]["namespaces"].as_array_mut().unwrap() {
            if n["type"] == "network" {
                n["path"] = ns.path().into();
            }
        }
        std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    }

    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
}

/// Copies the shared libraries `bin` loads (as `ldd` lists them) into `rootfs` at the same paths.
pub fn copy_libraries(bin: &Path, rootfs: &Path) {
    let out = Command::new("ldd").arg(bin).output().unwrap();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        let Some(path) = path.filter(|p| p.starts_with('/')) else {
            continue;
        };
        let dest = rootfs.join(path.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
        if !dest.exists() {
            std::fs::copy(path, &dest).unwrap();
        }
    }
}

/// runc (or runsc) with a private state folder (`--root`), whose containers are deleted on drop.
pub struct Runc {
    pub root: PathBuf,
    /// `runc` or `runsc`.
    pub binary: &'static str,
    /// More global flags (runsc: `--platform=ptrace --network=none`, all that works here).
    pub global: Vec<&'static str>,
}

impl Runc {
    pub fn new(dir: &Path) -> Runc {
        Runc::with_root_in(dir, "runc", Vec::new())
    }

    /// runsc, on the platform that works here (kvm hangs) and without a network (its only mode here).
    pub fn runsc(dir: &Path) -> Runc {
        Runc::with_root_in(dir, "runsc", vec!["--platform=ptrace", "--network=none"])
    }

    /// `binary` with `global` flags, its state in `dir/BINARY-root`.
    fn with_root_in(dir: &Path, binary: &'static str, global: Vec<&'static str>) -> Runc {
        let root = dir.join(format!("{binary}-root"));
        std::fs::create_dir_all(&root).unwrap();
        Runc {
            root,
            binary,
            global,
        }
    }

    pub fn cmd(&self) -> Command {
        let mut c = Command::new(self.binary);
        c.arg("--root").arg(&self.root).args(&self.global);
        c.stdin(Stdio::null());
        c
    }

    /// The gpu-checkpoint arguments that name this runtime, its root and its flags.
    pub fn args(&self) -> Vec<String> {
        let mut a = vec![
            "--runtime".to_string(),
            self.binary.to_string(),
            "--runtime-root".to_string(),
            self.root.display().to_string(),
        ];
        a.extend(self.global.iter().map(|g| format!("--runtime-arg={g}")));
        a
    }

    /// `runc run -d`: the container's stdio is /dev/null (CRIU cannot restore host files or our pipes).
    pub fn run(&self, id: &str, bundle: &Bundle) {
        let st = self
            .cmd()
            .args(["run", "--detach", "--bundle"])
            .arg(&bundle.dir)
            .arg(id)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(st.success(), "{} run {id}", self.binary);
    }

    /// `runc state`: `(status, init pid)`, `None` when runc does not know the container.
    pub fn state(&self, id: &str) -> Option<(String, i32)> {
        let out = self.cmd().args(["state", id]).output().unwrap();
        if !out.status.success() {
            return None;
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        Some((v["status"].as_str()?.to_string(), v["pid"].as_i64()? as i32))
    }

    /// The ids and statuses `runc list` shows.
    pub fn list(&self) -> Vec<(String, String)> {
        let out = self
            .cmd()
            .args(["list", "--format", "json"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        (
                            c["id"].as_str().unwrap_or_default().to_string(),
                            c["status"].as_str().unwrap_or_default().to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// `runc exec ID ARGS...` -> stdout.
    pub fn exec(&self, id: &str, args: &[&str]) -> String {
        let out = self.cmd().args(["exec", id]).args(args).output().unwrap();
        assert!(out.status.success(), "runc exec {id} {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The host PIDs of container `id`'s processes, init first.
    pub fn pids(&self, id: &str) -> Vec<i32> {
        let (_, init) = self.state(id).expect("container exists");
        gpu_checkpoint::flows::runtime::members(init)
            .iter()
            .map(|m| m.pid)
            .collect()
    }
}

/// The container ids a runtime's state folder names: runc keeps a folder per container; runsc keeps
/// files named `ID_sandbox:SANDBOX.state` (and `.lock`) side by side, whose names are not ids (`runsc
/// delete` of such a name fails, which leaked every runsc sandbox these tests started).
fn state_ids(names: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut ids: Vec<String> = names
        .into_iter()
        .map(|n| match n.split_once("_sandbox:") {
            Some((id, _)) => id.to_string(),
            None => n,
        })
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

impl Drop for Runc {
    fn drop(&mut self) {
        let names: Vec<String> = std::fs::read_dir(&self.root)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        for id in state_ids(names) {
            unmount_under(&self.root.join(&id));
            let _ = self.cmd().args(["delete", "--force", &id]).output();
        }
    }
}

/// A named network namespace (`ip netns add`), its loopback up, deleted when dropped: what CNI-based
/// engines give a container to join by path.
pub struct NetNs(pub String);

impl NetNs {
    /// `None` (skipped with the reason; a failure in CI) where `ip` (iproute2) is missing.
    pub fn add(name: &str) -> Option<NetNs> {
        let has_ip = Command::new("ip")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success());
        if !has_ip {
            assert_ne!(
                std::env::var("CI").as_deref(),
                Ok("true"),
                "`ip` (iproute2) is missing in CI: scripts/install-containers.sh installs it"
            );
            eprintln!("SKIPPED: `ip` (iproute2) is missing; run scripts/setup.sh as root");
            return None;
        }
        let ns = NetNs(name.to_string());
        for args in [
            &["netns", "add", name][..],
            &["-n", name, "link", "set", "lo", "up"],
        ] {
            let st = Command::new("ip").args(args).status().unwrap();
            assert!(st.success(), "ip {args:?}");
        }
        Some(ns)
    }

    pub fn path(&self) -> String {
        format!("/run/netns/{}", self.0)
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.0])
            .status();
    }
}

/// Whether a child of process `pid` (of any of its threads) has a command line (its arguments joined by
/// NUL bytes) that `matches`: how the kill tests see the tool's CRIU or runtime at work.
pub fn has_child(pid: i32, matches: &dyn Fn(&str) -> bool) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|t| {
        let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        kids.split_whitespace().any(|k| {
            let argv = std::fs::read(format!("/proc/{k}/cmdline")).unwrap_or_default();
            matches(&String::from_utf8_lossy(&argv))
        })
    })
}

/// The gpu-checkpoint arguments that name the store and the runtime.
pub fn store_args(store: &Path, runc: &Runc) -> Vec<String> {
    let mut a = vec!["--storage".to_string(), store.display().to_string()];
    a.extend(runc.args());
    a
}

/// Every regular file of a tar archive (zstd-compressed or not), by name; a name twice fails.
pub fn archive_entries(archive: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let raw = std::fs::read(archive).unwrap();
    let data = if raw.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        zstd::decode_all(&raw[..]).unwrap()
    } else {
        raw
    };
    let mut tar = tar::Archive::new(&data[..]);
    let mut out = std::collections::BTreeMap::new();
    for e in tar.entries().unwrap() {
        let mut e = e.unwrap();
        if e.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let name = e.path().unwrap().display().to_string();
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut e, &mut bytes).unwrap();
        assert!(out.insert(name.clone(), bytes).is_none(), "{name} twice");
    }
    out
}

/// Number field `key` of the first record of the workload state file `path`, once it has one.
pub fn state_field(path: &Path, key: &str) -> Option<u64> {
    let recs = gpu_checkpoint_workloads::read_state(path).ok()?;
    gpu_checkpoint_workloads::field_u64(recs.first()?, key)
}

/// Waits up to 20 s for `ok`, failing with `what`.
pub fn wait_for(what: &str, ok: &dyn Fn() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Runs gpu-checkpoint with `args` alone (no store or runtime arguments added).
pub fn gc_run(args: &[&str]) -> std::process::Output {
    Command::new(gpu_checkpoint()).args(args).output().unwrap()
}

/// `gpu-checkpoint checkpoint --container ID` into `store` (the container stops) -> the checkpoint's id.
pub fn checkpoint_container(store: &Path, runc: &Runc, id: &str) -> String {
    let mut args = vec!["checkpoint", "--container", id, "--format", "json"];
    let sargs = store_args(store, runc);
    args.extend(sargs.iter().map(String::as_str));
    let o = gc_run(&args);
    assert!(o.status.success(), "checkpoint: {}", text(&o));
    let ck: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    ck["id"].as_str().unwrap().to_string()
}

/// `gpu-checkpoint import ARCHIVE --storage STORE --format json`, asserting success: its JSON.
pub fn import_archive(archive: &Path, store: &Path) -> serde_json::Value {
    let (a, s) = (archive.display().to_string(), store.display().to_string());
    let o = gc_run(&["import", &a, "--storage", &s, "--format", "json"]);
    assert!(o.status.success(), "import of {a}: {}", text(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// `gpu-checkpoint export ID -o TO --storage STORE EXTRA...`.
pub fn export_archive(store: &Path, id: &str, to: &Path, extra: &[&str]) -> std::process::Output {
    let (t, s) = (to.display().to_string(), store.display().to_string());
    let mut args = vec!["export", id, "-o", &t, "--storage", &s];
    args.extend_from_slice(extra);
    gc_run(&args)
}

/// Writes a tar of `rootfs`'s contents to `out` (an image layer).
pub fn tar_rootfs(rootfs: &Path, out: &Path) {
    let st = Command::new("tar")
        .arg("-C")
        .arg(rootfs)
        .arg("-cf")
        .arg(out)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success(), "tar of {}", rootfs.display());
}

/// The number a container's shell counter wrote (`cat /tmp/c`'s output), if it is one.
pub fn parse_counter(out: &[u8]) -> Option<u64> {
    String::from_utf8_lossy(out).trim().parse().ok()
}

/// `gpu-checkpoint node-setup --engine ENGINE` as docs/kubernetes.md says, into `prefix` (the tests'
/// own folder), with the SIMULATED GPU backend and the runc on PATH; its output.
pub fn node_setup(engine: &str, prefix: &Path) -> String {
    let runc = gpu_checkpoint::path_search::which("runc").expect("runc on PATH");
    let o = gc_run(&[
        "node-setup",
        "--engine",
        engine,
        "--prefix",
        &prefix.display().to_string(),
        "--runc",
        &runc.display().to_string(),
        "--gpu-backend",
        "sim",
    ]);
    assert!(o.status.success(), "node-setup: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The SIMULATED GPU processes of the container whose init `init()` says, once `n` of them answer.
pub fn wait_gpu_processes(what: &str, init: &mut dyn FnMut() -> i32, n: usize) -> Vec<i32> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let pids: Vec<i32> = gpu_checkpoint::flows::runtime::members(init())
            .iter()
            .map(|m| m.pid)
            .filter(|&p| gpu_checkpoint::freeze::sim::status(p).is_ok())
            .collect();
        if pids.len() >= n {
            return pids;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: {pids:?} of {n} GPU processes up"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The record gpu-checkpoint's wrapper put into an engine's checkpoint archive (beside CRIU's images),
/// read as JSON.
pub fn archived_gpu_record(archive: &Path) -> serde_json::Value {
    let files = archive_entries(archive);
    assert!(
        files.contains_key("checkpoint/inventory.img"),
        "CRIU's images in the archive: {:?}",
        files.keys()
    );
    let rec = files
        .get("checkpoint/gpu-checkpoint.json")
        .unwrap_or_else(|| panic!("no GPU record in the archive: {:?}", files.keys()));
    serde_json::from_slice(rec).unwrap()
}

/// The record says our freeze stage froze the GPU state.
pub fn assert_frozen_by_us(rec: &serde_json::Value) {
    let by = rec["frozen_by"].as_str().unwrap_or_default();
    assert!(by.contains("gpu-checkpoint"), "{rec}");
}
