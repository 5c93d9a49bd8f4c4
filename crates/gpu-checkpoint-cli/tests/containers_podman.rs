//! The podman checkpoint archive round trip with the real podman (4.3.1, `--runtime runc`, our CRIU
//! through a wrapper on PATH): `podman container checkpoint --export` (zstd) → `gpu-checkpoint import`
//! (stored, verified) → `gpu-checkpoint export` (the same files, byte for byte) → `podman container
//! restore --import`, the restored container's shell state carried on. Needs root, CRIU, runc, podman and
//! busybox-static: fails in CI without them, skips locally.

mod container_support;

use container_support::*;
use std::path::{Path, PathBuf};
use std::process::Command;

fn podman_ready() -> bool {
    if !containers_ready() {
        return false;
    }
    let ok = Command::new("podman")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok && std::env::var("CI").as_deref() == Ok("true") {
        panic!("podman tests cannot run in CI: podman is not installed (scripts/install-containers.sh installs it)");
    }
    if !ok {
        eprintln!("SKIPPED: podman is not installed; run scripts/setup.sh as root");
    }
    ok
}

/// podman with private storage and state, runc as its runtime, our CRIU found on PATH (podman asks for
/// `criu` by name; a wrapper script, since a link is not accepted as CRIU by podman's version check).
struct Podman {
    dir: PathBuf,
    path: String,
}

impl Podman {
    fn new(dir: &Path) -> Podman {
        let bin = dir.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let criu = gpu_checkpoint::dump::discover(None).unwrap().path;
        let wrapper = bin.join("criu");
        std::fs::write(
            &wrapper,
            format!("#!/bin/sh\nexec '{}' \"$@\"\n", criu.display()),
        )
        .unwrap();
        std::fs::set_permissions(
            &wrapper,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        Podman {
            dir: dir.to_path_buf(),
            path,
        }
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new("podman");
        c.arg("--root")
            .arg(self.dir.join("storage"))
            .arg("--runroot")
            .arg(self.dir.join("run"))
            .args([
                "--runtime",
                "runc",
                "--cgroup-manager",
                "cgroupfs",
                "--events-backend",
                "file",
            ])
            .env("PATH", &self.path)
            .stdin(std::process::Stdio::null());
        c
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.cmd().args(args).output().unwrap();
        assert!(o.status.success(), "podman {args:?}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// The counter the container's shell keeps in memory and writes out.
    fn counter(&self, name: &str) -> u64 {
        self.ok(&["exec", name, "busybox", "cat", "/tmp/c"])
            .parse()
            .unwrap()
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.cmd().args(["rm", "--all", "--force"]).output();
        let _ = self.cmd().args(["rmi", "--all", "--force"]).output();
        // podman's storage keeps its overlay folder mounted (private) on itself: the temporary folder
        // goes only once that is gone.
        gpu_checkpoint::flows::container::unmount_under(&self.dir);
    }
}

#[test]
fn a_podman_checkpoint_goes_through_the_store_and_podman_restores_it() {
    if !podman_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let podman = Podman::new(dir.path());
    // A local image from the test's minimal root file system (no registry is reached).
    let bundle = Bundle::new(&dir.path().join("bundle"), &["true"], &[]);
    let layer = dir.path().join("rootfs.tar");
    let st = Command::new("tar")
        .arg("-C")
        .arg(bundle.rootfs())
        .arg("-cf")
        .arg(&layer)
        .arg(".")
        .status()
        .unwrap();
    assert!(st.success());
    let image = "localhost/gpu-checkpoint-test:1";
    podman.ok(&["import", &layer.display().to_string(), image]);
    let name = format!("gc-{}-podman", std::process::id());
    let script = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done";
    podman.ok(&[
        "run",
        "--detach",
        "--name",
        &name,
        "--network",
        "none",
        "--ulimit",
        "nofile=1024:1024",
        "--ulimit",
        "nproc=4096:4096",
        image,
        "sh",
        "-c",
        script,
    ]);
    wait_for("the counter", &|| podman.counter(&name) >= 20);
    let long_id = podman.ok(&["inspect", "--format", "{{.Id}}", &name]);

    // podman's archive (zstd, its default) into the store.
    let theirs = dir.path().join("podman.tar.zst");
    podman.ok(&[
        "container",
        "checkpoint",
        "--export",
        &theirs.display().to_string(),
        &name,
    ]);
    let at_checkpoint = {
        let files = archive_entries(&theirs);
        assert!(
            files.contains_key("checkpoint/inventory.img"),
            "{:?}",
            files.keys()
        );
        files
    };
    let store = dir.path().join("store");
    let s = store.display().to_string();
    let o = gc_run(&[
        "import",
        &theirs.display().to_string(),
        "--storage",
        &s,
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "import: {}", text(&o));
    let imp: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(imp["container"], long_id.as_str());
    let id = imp["id"].as_str().unwrap();
    let v = gc_run(&["verify", id, "--storage", &s]);
    assert!(v.status.success(), "verify: {}", text(&v));

    // Out again: the same files as podman wrote, and podman restores it.
    let ours = dir.path().join("ours.tar");
    let o = gc_run(&[
        "export",
        id,
        "-o",
        &ours.display().to_string(),
        "--storage",
        &s,
    ]);
    assert!(o.status.success(), "export: {}", text(&o));
    assert_eq!(archive_entries(&ours), at_checkpoint);
    podman.ok(&["rm", "--force", &name]);
    podman.ok(&[
        "container",
        "restore",
        "--import",
        &ours.display().to_string(),
    ]);
    let state = podman.ok(&["inspect", "--format", "{{.State.Status}}", &name]);
    assert_eq!(state, "running");
    // The shell's counter goes on from where it was, not from 1: its memory came back.
    let restored_at = podman.counter(&name);
    assert!(restored_at >= 20, "counter restarted: {restored_at}");
    wait_for("the restored counter", &|| {
        podman.counter(&name) > restored_at
    });
}
