//! `scripts/capture-proc.sh`, the bug-report capture: it refuses a folder another user controls, and what it
//! writes holds no secret (environment values and command-line arguments that look like credentials).

use std::fs;
use std::os::unix::fs::{symlink, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/capture-proc.sh")
}

fn capture(pid: u32, out: &Path) -> Output {
    Command::new("bash")
        .arg(script())
        .arg(pid.to_string())
        .arg(out)
        .output()
        .unwrap()
}

/// Root is needed (to read another process's environ, to hand a folder to another user): in CI (`CI=true`)
/// its absence fails the test, locally the test is skipped with the reason.
fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() == 0 };
    if !root && std::env::var("CI").as_deref() == Ok("true") {
        panic!("capture-proc.sh tests need root, and CI runs as root");
    }
    root
}

/// A target ([`Target::start`]) and a temporary folder, where root is there ([`is_root`]; skipped
/// locally, saying `why` root is needed).
fn scene(why: &str) -> Option<(Target, tempfile::TempDir)> {
    if !is_root() {
        eprintln!("skipped: not root ({why})");
        return None;
    }
    Some((Target::start(), tempfile::tempdir().unwrap()))
}

/// Asserts that the capture refused its folder (exit 2): its error.
fn refused(o: &Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(2), "{err}");
    err
}

/// A shell holding secrets in its environment and on its command line, as real jobs do.
struct Target(Child);

impl Target {
    fn start() -> Target {
        let child = Command::new("bash")
            .args([
                "-c",
                "sleep 60; :",
                "job",
                "--password=hunter2-arg",
                "--api-key",
                "key-value-42",
                "https://alice:pw-in-url@example.invalid/x",
                "--steps=7",
            ])
            .env("GPU_API_KEY", "gpu-secret-1")
            .env("NVIDIA_TOKEN", "nv-secret-2")
            .env("CUDA_UPLOAD_URL", "https://bob:pw-in-env@example.invalid")
            .env("CUDA_VISIBLE_DEVICES", "0,1")
            .env("AWS_SECRET_ACCESS_KEY", "aws-secret-3")
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        // Until bash has exec'd, /proc shows the test binary's command line.
        std::thread::sleep(Duration::from_millis(200));
        Target(child)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn capture_holds_no_secret_and_keeps_gpu_evidence() {
    let Some((t, dir)) = scene("capture-proc.sh reads another process's environ") else {
        return;
    };
    let out = dir.path().join("cap");
    let o = capture(t.0.id(), &out);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pid = t.0.id().to_string();
    let environ = fs::read(out.join(&pid).join("environ")).unwrap();
    let cmdline = fs::read(out.join(&pid).join("cmdline")).unwrap();
    let all = [environ.clone(), cmdline.clone()].concat();
    let text = String::from_utf8_lossy(&all);
    for secret in [
        "hunter2-arg",
        "key-value-42",
        "pw-in-url",
        "gpu-secret-1",
        "nv-secret-2",
        "pw-in-env",
        "aws-secret-3",
    ] {
        assert!(!text.contains(secret), "{secret} leaked: {text:?}");
    }
    let env = String::from_utf8_lossy(&environ);
    // The variable names stay as evidence; harmless GPU values stay as they are.
    assert!(env.contains("CUDA_VISIBLE_DEVICES=0,1"), "{env:?}");
    assert!(env.contains("GPU_API_KEY=<redacted>"), "{env:?}");
    let cmd = String::from_utf8_lossy(&cmdline);
    assert!(
        cmd.contains("--steps=7") && cmd.contains("--api-key\0<redacted>"),
        "{cmd:?}"
    );
    assert_eq!(
        fs::metadata(&out).unwrap().mode() & 0o777,
        0o700,
        "the capture folder is private"
    );
}

#[test]
fn capture_refuses_a_folder_it_does_not_own_or_that_is_not_empty() {
    let Some((t, dir)) = scene("the test hands a folder to another user") else {
        return;
    };
    // A folder owned by someone else, with a link planted where the capture would write.
    let theirs = dir.path().join("theirs");
    fs::create_dir(&theirs).unwrap();
    let victim = dir.path().join("victim");
    fs::write(&victim, "root's file\n").unwrap();
    symlink(&victim, theirs.join("net")).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let err = refused(&capture(t.0.id(), &theirs));
    assert!(err.contains("owned by uid 65534"), "{err}");
    assert_eq!(fs::read_to_string(&victim).unwrap(), "root's file\n");

    // Our own folder, but not empty: refused too (a stale capture could hold planted links).
    let ours = dir.path().join("ours");
    fs::create_dir(&ours).unwrap();
    symlink(&victim, ours.join("net")).unwrap();
    refused(&capture(t.0.id(), &ours));
    assert_eq!(fs::read_to_string(&victim).unwrap(), "root's file\n");

    // A link in place of the folder.
    let link = dir.path().join("link");
    symlink(&victim, &link).unwrap();
    refused(&capture(t.0.id(), &link));
    assert_eq!(fs::read_to_string(&victim).unwrap(), "root's file\n");
}
