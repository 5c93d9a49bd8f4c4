//! A real S3-compatible server for tests: s3s-fs (built once by `scripts/install-s3s.sh` into a cache
//! outside the clone), started on 127.0.0.1 on a free port with a private temporary data folder, one bucket
//! made, killed and removed on drop. Shared by the library's and the CLI's tests.
//!
//! Where s3s-fs is missing, a test that needs it fails under `CI=true` and is skipped, with the reason
//! printed, elsewhere.

#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The version `scripts/install-s3s.sh` builds.
pub const S3S_FS_VERSION: &str = "0.14.1";
/// Test credentials (the server's own; never real ones).
pub const ACCESS_KEY: &str = "gpu-checkpoint-test";
pub const SECRET_KEY: &str = "gpu-checkpoint-test-secret";

/// Where s3s-fs is: `GPU_CHECKPOINT_S3S_FS`, or where `scripts/install-s3s.sh` puts it.
pub fn s3s_fs_binary() -> Result<PathBuf, String> {
    cached_tool(
        "GPU_CHECKPOINT_S3S_FS",
        &format!("s3s-fs-{S3S_FS_VERSION}"),
        "s3s-fs",
    )
}

/// A tool the project's install scripts build into the cache outside the clone: `$ENV_VAR` if set, else
/// `CACHE/DIR/bin/BIN` in `GPU_CHECKPOINT_CACHE` (default `/var/cache/gpu-checkpoint`) or
/// `~/.cache/gpu-checkpoint`, the caches the scripts use.
pub fn cached_tool(env_var: &str, dir: &str, bin: &str) -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var(env_var) {
        return Ok(PathBuf::from(p));
    }
    let mut caches = vec![PathBuf::from(
        std::env::var("GPU_CHECKPOINT_CACHE")
            .unwrap_or_else(|_| "/var/cache/gpu-checkpoint".into()),
    )];
    if let Ok(home) = std::env::var("HOME") {
        caches.push(Path::new(&home).join(".cache/gpu-checkpoint"));
    }
    caches
        .iter()
        .map(|c| c.join(dir).join("bin").join(bin))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            format!(
                "{dir} is not installed (looked in {})",
                caches
                    .iter()
                    .map(|c| c.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// What a client needs to reach an S3 server under test (s3s-fs here, garage in the long lane): tests
/// that run against either take this.
pub trait Endpoint {
    /// `s3://BUCKET/PREFIX`
    fn url(&self, prefix: &str) -> String;
    /// The environment a store client needs to reach the server (AWS variables, the standard way).
    fn env(&self) -> Vec<(&'static str, String)>;
    /// `http://127.0.0.1:PORT`
    fn endpoint(&self) -> &str;
    fn bucket(&self) -> &str;
    /// The access key id and the secret key (the server's own test credentials).
    fn keys(&self) -> (&str, &str);
}

impl Endpoint for S3Server {
    fn url(&self, prefix: &str) -> String {
        S3Server::url(self, prefix)
    }
    fn env(&self) -> Vec<(&'static str, String)> {
        S3Server::env(self)
    }
    fn endpoint(&self) -> &str {
        &self.endpoint
    }
    fn bucket(&self) -> &str {
        &self.bucket
    }
    fn keys(&self) -> (&str, &str) {
        (ACCESS_KEY, SECRET_KEY)
    }
}

/// A running s3s-fs with one bucket.
pub struct S3Server {
    child: Child,
    bin: PathBuf,
    port: u16,
    pub endpoint: String,
    pub bucket: String,
    /// The server's data folder (`data/BUCKET/KEY` is an object): tests damage objects there.
    pub data: tempfile::TempDir,
}

impl S3Server {
    /// Starts a server, or `None` (with the reason printed) where s3s-fs is missing outside CI.
    pub fn start() -> Option<S3Server> {
        let bin = match s3s_fs_binary() {
            Ok(b) => b,
            Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
                panic!("S3 tests cannot run in CI: {why} (scripts/setup.sh builds it)")
            }
            Err(why) => {
                eprintln!("SKIPPED: {why}; run scripts/install-s3s.sh to run the S3 tests");
                return None;
            }
        };
        Some(S3Server::start_with(&bin))
    }

    fn start_with(bin: &Path) -> S3Server {
        let data = private_dir("s3s");
        let bucket = "ckpt".to_string();
        // s3s-fs keeps a bucket as a folder of its root.
        std::fs::create_dir(data.path().join(&bucket)).unwrap();
        for _ in 0..5 {
            let port = free_port();
            if let Some(child) = spawn(bin, port, data.path()) {
                return S3Server {
                    child,
                    bin: bin.to_path_buf(),
                    port,
                    endpoint: format!("http://127.0.0.1:{port}"),
                    bucket,
                    data,
                };
            }
        }
        panic!("s3s-fs did not start");
    }

    /// Starts the server again after [`S3Server::stop`], on the same port with the same data.
    pub fn restart(&mut self) {
        self.stop();
        self.child = spawn(&self.bin, self.port, self.data.path()).expect("s3s-fs restarts");
    }

    /// `s3://BUCKET/PREFIX`
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }

    /// The environment a store client needs to reach this server (AWS variables, the standard way).
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_KEY.into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    /// The file s3s-fs keeps object `key` (bucket-relative) in.
    pub fn object_file(&self, key: &str) -> PathBuf {
        self.data.path().join(&self.bucket).join(key)
    }

    /// Stops the server (a fault: the storage goes away).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts s3s-fs on `port` and waits until it answers; `None` when it exits first (the port was taken).
fn spawn(bin: &Path, port: u16, data: &Path) -> Option<Child> {
    serve(
        Command::new(bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(data),
        port,
        Duration::from_secs(10),
    )
}

/// Starts the server `cmd` (its output discarded) and waits until it accepts connections on
/// 127.0.0.1:`port` ([`listening`]).
pub fn serve(cmd: &mut Command, port: u16, timeout: Duration) -> Option<Child> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?} does not start: {e}"));
    listening(child, port, timeout)
}

/// A port of 127.0.0.1 free when asked.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A private temporary folder (0700) for a server's data, named after it (`gpu-checkpoint-NAME.*`).
pub fn private_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("gpu-checkpoint-{name}."))
        .tempdir()
        .expect("a private folder")
}

/// `child`, a server, once it accepts connections on 127.0.0.1:`port`; `None` when it exits first (the
/// port was taken) or is not listening within `timeout` (then killed).
pub fn listening(mut child: Child, port: u16, timeout: Duration) -> Option<Child> {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if let Ok(Some(_)) = child.try_wait() {
            return None;
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some(child);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
