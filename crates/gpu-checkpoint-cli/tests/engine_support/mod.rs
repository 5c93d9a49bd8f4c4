//! A real containerd (2.x, from `.deps/containerd`: scripts/install-containerd.sh) per test, on a private
//! socket, root and state folder, configured the way docs/kubernetes.md tells an operator (`gpu-checkpoint
//! node-setup --engine containerd`, with `--prefix` for a folder of the test's own), and driven through
//! its CRI API with the `cri-client` crate, as the kubelet does. Its images are made here: one OCI image
//! of the tests' minimal root file system (static busybox, `gpu-sim-workload`), which is also the pods'
//! pause image (no registry is reached), imported with containerd's `ctr`.

#![allow(dead_code)] // each test file uses a different subset

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cri_client::api;
use cri_client::Cri;

use crate::container_support::{containers_ready, Bundle};

pub mod registry;

/// runc's root under containerd's runc shim (`/run/containerd/runc/NAMESPACE`, whatever containerd's
/// own state folder).
pub const RUNC_ROOT: &str = "/run/containerd/runc/k8s.io";

/// The prefix scripts/install-containerd.sh fills.
pub fn containerd_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../.deps/containerd/bin")
}

/// Whether containerd tests can run here (besides [`containers_ready`]): containerd 2.x installed. In
/// CI its absence fails the test; locally it is skipped with the reason.
pub fn containerd_ready() -> bool {
    if !containers_ready() {
        return false;
    }
    if containerd_bin().join("containerd").is_file() {
        return true;
    }
    let why = "containerd 2.x is not installed in .deps/containerd";
    crate::container_support::common::needs(
        "containerd",
        &Err(why.into()),
        "scripts/install-containerd.sh installs it",
    )
}

/// The SIMULATED GPU processes of the tests answer on abstract sockets named after their PIDs inside
/// their container; the tests' pods use the node's network namespace, so two such containers must not
/// run at once: the containerd tests of one binary take turns.
pub fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

/// One node: a containerd configured by `node-setup`, and a CRI client of it. Stopped (its pods removed)
/// on drop.
pub struct Node {
    pub dir: PathBuf,
    pub prefix: PathBuf,
    pub socket: PathBuf,
    child: Child,
    pub cri: Cri,
}

/// Deletes the containers under containerd's runc root whose bundle is under `under`, or, without one,
/// whose bundle is gone (a test run that died left them; with the node's network namespace shared, a
/// SIMULATED GPU process of theirs would hold the control socket a new one needs).
fn delete_runc_containers(under: Option<&Path>) {
    let out = Command::new("runc")
        .args(["--root", RUNC_ROOT, "list", "--format", "json"])
        .output();
    let list: serde_json::Value = out
        .ok()
        .and_then(|o| serde_json::from_slice(&o.stdout).ok())
        .unwrap_or_default();
    for c in list.as_array().into_iter().flatten() {
        let (Some(id), Some(bundle)) = (c["id"].as_str(), c["bundle"].as_str()) else {
            continue;
        };
        let ours = match under {
            Some(dir) => Path::new(bundle).starts_with(dir),
            None => !Path::new(bundle).exists(),
        };
        if ours {
            gpu_checkpoint::flows::container::unmount_under(&Path::new(RUNC_ROOT).join(id));
            let _ = Command::new("runc")
                .args(["--root", RUNC_ROOT, "delete", "--force", id])
                .output();
        }
    }
}

impl Node {
    /// A node in `dir` whose containerd (and so its runc shims and our wrapper) runs with `env`.
    pub fn start(dir: &Path, env: &[(&str, &str)]) -> Node {
        delete_runc_containers(None);
        let prefix = dir.join("node");
        let conf = prefix.join("etc/containerd/config.toml");
        std::fs::create_dir_all(conf.parent().unwrap()).unwrap();
        std::fs::create_dir_all(dir.join("cni")).unwrap();
        let socket = dir.join("c.sock");
        let d = |p: &str| dir.join(p).display().to_string();
        // What an operator's config.toml holds (private folders here); node-setup adds what it needs.
        // The pause container's oom_score_adj (-998) is below ours, which this machine does not let us
        // lower: containerd keeps its containers' at or above its own.
        std::fs::write(
            &conf,
            format!(
                "version = 3\nroot = '{}'\nstate = '{}'\n\n[grpc]\n  address = '{}'\n\n\
                 [plugins.'io.containerd.cri.v1.images']\n  snapshotter = 'native'\n\n\
                 [plugins.'io.containerd.cri.v1.images'.pinned_images]\n  sandbox = '{}'\n\n\
                 [plugins.'io.containerd.cri.v1.runtime']\n  enable_cdi = false\n  \
                 restrict_oom_score_adj = true\n\n\
                 [plugins.'io.containerd.cri.v1.runtime'.cni]\n  conf_dir = '{}'\n\n\
                 [plugins.'io.containerd.internal.v1.opt']\n  path = '{}'\n",
                d("root"),
                d("state"),
                socket.display(),
                image().name,
                d("cni"),
                d("opt"),
            ),
        )
        .unwrap();
        // docs/kubernetes.md's node setup, into the test's prefix.
        crate::container_support::node_setup("containerd", &prefix);
        let criu = gpu_checkpoint::dump::discover(None).unwrap().path;
        // containerd checks for a CRIU on its PATH before a checkpoint (runc is given ours anyway).
        let path = format!(
            "{}:{}:{}",
            containerd_bin().display(),
            criu.parent().unwrap().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let log = std::fs::File::create(dir.join("containerd.log")).unwrap();
        let child = Command::new(containerd_bin().join("containerd"))
            .arg("--config")
            .arg(&conf)
            .env("PATH", &path)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let cri = loop {
            if socket.exists() {
                if let Ok(mut c) = Cri::connect(&socket, Duration::from_secs(120)) {
                    if c.version().is_ok() {
                        break c;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "containerd did not start: {}",
                std::fs::read_to_string(dir.join("containerd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        };
        let node = Node {
            dir: dir.to_path_buf(),
            prefix,
            socket,
            child,
            cri,
        };
        node.import(&image().tar);
        node
    }

    /// `ctr images import` into the CRI's namespace.
    pub fn import(&self, tar: &Path) {
        crate::container_support::common::run_ok(
            Command::new(containerd_bin().join("ctr"))
                .arg("--address")
                .arg(&self.socket)
                .args(["-n", "k8s.io", "images", "import"])
                .arg(tar),
            "ctr import",
        );
    }

    /// A pod in the node's network namespace (no CNI here).
    pub fn pod_config(&self, name: &str) -> api::PodSandboxConfig {
        api::PodSandboxConfig {
            metadata: Some(api::PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: "default".into(),
                attempt: 0,
            }),
            log_directory: self.dir.join("logs").display().to_string(),
            linux: Some(api::LinuxPodSandboxConfig {
                security_context: Some(api::LinuxSandboxSecurityContext {
                    namespace_options: Some(namespaces()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// `RunPodSandbox`: the pod's id and config.
    pub fn pod(&mut self, name: &str) -> (String, api::PodSandboxConfig) {
        let config = self.pod_config(name);
        let id = self.cri.run_pod(&config).expect("RunPodSandbox");
        (id, config)
    }

    /// `ContainerStatus`'s state.
    pub fn state(&mut self, id: &str) -> i32 {
        self.cri
            .status(id)
            .expect("ContainerStatus")
            .status
            .map_or(-1, |s| s.state)
    }

    /// The container's init PID on the host (the verbose status's `info`).
    pub fn init_pid(&mut self, id: &str) -> i32 {
        let st = self.cri.status(id).expect("ContainerStatus");
        let info: serde_json::Value =
            serde_json::from_str(st.info.get("info").map_or("{}", String::as_str)).unwrap();
        info["pid"].as_i64().unwrap_or(0) as i32
    }

    /// The host PIDs of the container's processes, init first.
    pub fn pids(&mut self, id: &str) -> Vec<i32> {
        let init = self.init_pid(id);
        gpu_checkpoint::flows::runtime::members(init)
            .iter()
            .map(|m| m.pid)
            .collect()
    }

    /// `ExecSync ... cat PATH`, parsed.
    pub fn read_number(&mut self, id: &str, path: &str) -> Option<u64> {
        let out = self.cri.exec(id, &["cat", path]).ok()?;
        crate::container_support::parse_counter(&out.stdout)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for c in self.cri.list().unwrap_or_default() {
            let _ = self.cri.remove(&c.id, Duration::ZERO);
        }
        // Sandboxes go with their pause containers: listed through the containers' pod ids above,
        // and every pod the tests made is named in `pods`.
        let pods: Vec<String> =
            std::fs::read_dir(self.dir.join("state/io.containerd.grpc.v1.cri/sandboxes"))
                .map(|d| {
                    d.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
        for p in pods {
            let _ = self.cri.remove_pod(&p);
        }
        // SAFETY: signalling the containerd this test started.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        // Shims of this node that outlived it (their command line names its socket).
        let ours = self.socket.display().to_string();
        let pids = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok());
        for pid in pids {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.contains("containerd-shim") && cmdline.contains(&ours) {
                // SAFETY: a shim of the containerd this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        // What containerd lost track of (a restore whose wrapper died, say).
        delete_runc_containers(Some(&self.dir));
        gpu_checkpoint::flows::container::unmount_under(&self.dir);
    }
}

/// The network namespace of the node (no CNI), a PID namespace of the container's own, IPC of the pod.
fn namespaces() -> api::NamespaceOption {
    api::NamespaceOption {
        network: api::NamespaceMode::Node as i32,
        pid: api::NamespaceMode::Container as i32,
        ipc: api::NamespaceMode::Pod as i32,
        target_id: String::new(),
    }
}

/// A container config: `script` run by the image's shell, with `env`.
pub fn container_config(
    name: &str,
    image: &str,
    script: &str,
    env: &[(&str, &str)],
) -> api::ContainerConfig {
    api::ContainerConfig {
        metadata: Some(api::ContainerMetadata {
            name: name.into(),
            attempt: 0,
        }),
        image: Some(api::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        command: vec!["/bin/sh".into(), "-c".into(), script.into()],
        envs: env
            .iter()
            .map(|(k, v)| api::KeyValue {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        log_path: format!("{name}.log"),
        linux: Some(api::LinuxContainerConfig {
            security_context: Some(api::LinuxContainerSecurityContext {
                namespace_options: Some(namespaces()),
                ..Default::default()
            }),
        }),
        ..Default::default()
    }
}

/// The tests' image: an OCI image layout of the tests' minimal root file system, served by a registry
/// on the loopback interface (containerd 2.1's CRI restore pulls the checkpoint's base image by its
/// digest reference, even when the node has it), and as an archive for `ctr images import`. Made once
/// per test binary.
pub struct TestImage {
    /// `127.0.0.1:PORT/gpu-checkpoint-test:1`.
    pub name: String,
    /// `127.0.0.1:PORT/gpu-checkpoint-test@sha256:...`: what the CRI records as its image ref.
    pub digest_ref: String,
    /// The archive naming both.
    pub tar: PathBuf,
    _registry: registry::Registry,
}

/// Where this test binary keeps its image: a folder of this process's under cargo's temporary folder,
/// removed at exit (a static is never dropped) and, should a run have died, by the next run.
fn image_dir() -> PathBuf {
    extern "C" fn remove_at_exit() {
        let _ = std::fs::remove_dir_all(image_dir());
    }
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let parent = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        for e in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let dead = name
                .strip_prefix("engine-image.")
                .and_then(|pid| pid.parse::<i32>().ok())
                .is_some_and(|pid| !gpu_checkpoint::proc::is_alive(pid));
            if dead {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        // SAFETY: registers a plain function, run once at exit.
        unsafe { libc::atexit(remove_at_exit) };
        parent.join(format!("engine-image.{}", std::process::id()))
    })
    .clone()
}

pub fn image() -> &'static TestImage {
    static IMAGE: OnceLock<TestImage> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let dir = image_dir();
        let layout = dir.join("layout");
        std::fs::create_dir_all(&layout).unwrap();
        let bundle = Bundle::new(&dir.join("bundle"), &["true"], &[]);
        // The CPU workload is not used here (90 MiB of a debug build).
        std::fs::remove_file(bundle.rootfs().join("bin/workload")).unwrap();
        for applet in ["usleep", "echo"] {
            let _ = std::os::unix::fs::symlink("busybox", bundle.rootfs().join("bin").join(applet));
        }
        let manifest = oci_layout(&bundle.rootfs(), &layout);
        std::fs::remove_dir_all(&bundle.dir).unwrap();
        let registry = registry::Registry::serve(&layout, &manifest);
        let repo = format!("{}/gpu-checkpoint-test", registry.addr);
        let name = format!("{repo}:1");
        let digest_ref = format!("{repo}@sha256:{manifest}");
        let tar = dir.join("image.tar");
        oci_archive(&layout, &manifest, &[&name, &digest_ref], &tar);
        TestImage {
            name,
            digest_ref,
            tar,
            _registry: registry,
        }
    })
}

fn sha256(path: &Path) -> String {
    let o = Command::new("sha256sum").arg(path).output().unwrap();
    assert!(o.status.success());
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// Writes an OCI image layout of `rootfs` (one uncompressed layer, a default command that sleeps, as a
/// pause image's) into `dir`; returns the manifest's digest (hex).
pub fn oci_layout(rootfs: &Path, dir: &Path) -> String {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let blob = |path: &Path| -> (String, u64) {
        let digest = sha256(path);
        let size = std::fs::metadata(path).unwrap().len();
        std::fs::rename(path, blobs.join(&digest)).unwrap();
        (digest, size)
    };
    let layer = dir.join("layer.tar");
    crate::container_support::tar_rootfs(rootfs, &layer);
    let (layer_digest, layer_size) = blob(&layer);
    let write_json = |file: &str, v: serde_json::Value| -> (String, u64) {
        let p = dir.join(file);
        std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
        blob(&p)
    };
    let (config_digest, config_size) = write_json(
        "config.json",
        serde_json::json!({
            "architecture": "amd64", "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["/bin/sleep", "2147483647"]},
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
        }),
    );
    let (manifest, _) = write_json(
        "manifest.json",
        serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": format!("sha256:{config_digest}"), "size": config_size},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": format!("sha256:{layer_digest}"), "size": layer_size}],
        }),
    );
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    manifest
}

/// An archive of the layout in `dir` whose index names manifest `manifest` as each of `names`.
pub fn oci_archive(dir: &Path, manifest: &str, names: &[&str], out: &Path) {
    let size = std::fs::metadata(dir.join("blobs/sha256").join(manifest))
        .unwrap()
        .len();
    let manifests: Vec<serde_json::Value> = names
        .iter()
        .map(|n| {
            serde_json::json!({
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{manifest}"), "size": size,
                "annotations": {"io.containerd.image.name": n},
            })
        })
        .collect();
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "manifests": manifests}))
            .unwrap(),
    )
    .unwrap();
    let st = Command::new("tar")
        .arg("-C")
        .arg(dir)
        .arg("-cf")
        .arg(out)
        .args(["oci-layout", "index.json", "blobs"])
        .status()
        .unwrap();
    assert!(st.success(), "tar of the image layout");
}

/// The files of a checkpoint archive, by name.
pub fn archive(path: &Path) -> BTreeMap<String, Vec<u8>> {
    crate::container_support::archive_entries(path)
}
