//! podman for the container tests: private storage and state, runc as its runtime, our CRIU found on
//! PATH, and every container and image it made removed on drop.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{containers_ready, text, Bundle};

/// Whether podman can run here (besides [`containers_ready`]): a failure in CI, skipped locally.
pub fn podman_ready() -> bool {
    containers_ready() && super::installed("podman", "podman", |o| o.status.success())
}

/// A temporary folder for podman's storage and state: `None` where podman cannot run ([`podman_ready`]).
pub fn podman_folder() -> Option<tempfile::TempDir> {
    podman_ready().then(|| tempfile::tempdir().unwrap())
}

/// [`podman_folder`] and podman in it, with a local image `image` of a minimal root file system
/// ([`Podman::import_minimal_image`]).
pub fn podman_with_image(image: &str) -> Option<(tempfile::TempDir, Podman)> {
    let dir = podman_folder()?;
    let podman = Podman::new(dir.path());
    podman.import_minimal_image(image);
    Some((dir, podman))
}

/// podman with private storage and state, runc as its runtime, our CRIU found on PATH (podman asks for
/// `criu` by name; a wrapper script, since a link is not accepted as CRIU by podman's version check).
pub struct Podman {
    dir: PathBuf,
    path: String,
    /// A `containers.conf` (CONTAINERS_CONF) naming the runtime instead of `--runtime runc`.
    conf: Option<PathBuf>,
}

impl Podman {
    pub fn new(dir: &Path) -> Podman {
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
            conf: None,
        }
    }

    /// podman reading its runtime from `conf` (`CONTAINERS_CONF`), as `gpu-checkpoint node-setup
    /// --engine podman` writes it, instead of being told `--runtime runc`.
    pub fn with_conf(dir: &Path, conf: &Path) -> Podman {
        let mut p = Podman::new(dir);
        p.conf = Some(conf.to_path_buf());
        p
    }

    pub fn cmd(&self) -> Command {
        let mut c = Command::new("podman");
        c.arg("--root")
            .arg(self.dir.join("storage"))
            .arg("--runroot")
            .arg(self.dir.join("run"));
        match &self.conf {
            Some(conf) => c.env("CONTAINERS_CONF", conf),
            None => c.args(["--runtime", "runc"]),
        };
        c.args(["--cgroup-manager", "cgroupfs", "--events-backend", "file"])
            .env("PATH", &self.path)
            .stdin(std::process::Stdio::null());
        c
    }

    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.cmd().args(args).output().unwrap();
        assert!(o.status.success(), "podman {args:?}: {}", text(&o));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    }

    /// `podman container checkpoint EXTRA... --export ARCHIVE NAME`.
    pub fn export_checkpoint(&self, name: &str, archive: &Path, extra: &[&str]) {
        let a = archive.display().to_string();
        let mut args = vec!["container", "checkpoint"];
        args.extend_from_slice(extra);
        args.extend(["--export", &a, name]);
        self.ok(&args);
    }

    /// `podman container restore --import ARCHIVE EXTRA...`.
    pub fn import_checkpoint(&self, archive: &Path, extra: &[&str]) {
        let a = archive.display().to_string();
        let mut args = vec!["container", "restore", "--import", &a];
        args.extend_from_slice(extra);
        self.ok(&args);
    }

    /// A local image `name` made from a minimal root file system ([`Bundle::new`]'s) (`podman import`:
    /// no registry is reached).
    pub fn import_minimal_image(&self, name: &str) {
        let bundle = Bundle::new(&self.dir.join("image"), &["true"], &[]);
        self.import_rootfs(&bundle, name);
    }

    /// The counter the container's shell keeps in memory and writes out.
    pub fn counter(&self, name: &str) -> u64 {
        // The shell truncates the file, then writes it: read again if caught in between.
        for _ in 0..20 {
            if let Ok(n) = self.ok(&["exec", name, "busybox", "cat", "/tmp/c"]).parse() {
                return n;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        panic!("{name}: /tmp/c never held a number");
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

impl Podman {
    /// A local image `name` made from `bundle`'s root file system (`podman import`: no registry is
    /// reached).
    pub fn import_rootfs(&self, bundle: &Bundle, name: &str) {
        let layer = self.dir.join("rootfs.tar");
        super::tar_rootfs(&bundle.rootfs(), &layer);
        self.ok(&["import", &layer.display().to_string(), name]);
    }

    /// `podman run --detach` of `image` running the shell `script` with `env`, without a network and
    /// with the limits podman's runc path needs here.
    pub fn run_detached(&self, name: &str, image: &str, env: &[(&str, &str)], script: &str) {
        let env: Vec<String> = env.iter().map(|(k, v)| format!("--env={k}={v}")).collect();
        let mut args = vec![
            "run",
            "--detach",
            "--name",
            name,
            "--network",
            "none",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=4096:4096",
        ];
        args.extend(env.iter().map(String::as_str));
        args.extend([image, "sh", "-c", script]);
        self.ok(&args);
    }

    /// [`Podman::run_detached`], waiting until its counter (`/tmp/c`) reaches `at_least`.
    pub fn run_counter(&self, name: &str, image: &str, script: &str, at_least: u64) {
        self.run_detached(name, image, &[], script);
        super::wait_for("the counter", &|| {
            self.cmd()
                .args(["exec", name, "busybox", "cat", "/tmp/c"])
                .output()
                .ok()
                .and_then(|o| super::parse_counter(&o.stdout))
                .is_some_and(|c| c >= at_least)
        });
    }
}

/// A shell loop that counts in memory and writes the count to `/tmp/c` ten times a second.
pub const COUNTER: &str = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done";
