//! A production S3 server for the long test lane: garage (built once by `scripts/install-garage.sh` into
//! a cache outside the clone), one node started on 127.0.0.1 on free ports with a private temporary
//! data/meta folder and config, its layout, key and bucket made by `garage server --single-node
//! --default-bucket`; killed and removed on drop. Shared by the library's and the CLI's tests.
//!
//! Garage takes 8 minutes or more to build, so its tests run only in the long lane (`scripts/test.sh
//! --long`, which sets [`LONG_TESTS_ENV`]); elsewhere they are skipped with the reason printed. In the long
//! lane a missing garage fails the test, as a missing component does in CI.

#![allow(dead_code)]

use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::s3::{free_port, private_dir, Endpoint};

/// The version `scripts/install-garage.sh` builds.
pub const GARAGE_VERSION: &str = "2.5.0";
/// Set to `1` by `scripts/test.sh --long`: the tests against garage run.
pub const LONG_TESTS_ENV: &str = "GPU_CHECKPOINT_LONG_TESTS";
/// The region garage is configured with (it checks the one requests are signed for).
const REGION: &str = "us-east-1";

/// Whether this is the long test lane.
pub fn long_lane() -> bool {
    std::env::var(LONG_TESTS_ENV).as_deref() == Ok("1")
}

/// Where garage is: `GPU_CHECKPOINT_GARAGE`, or where `scripts/install-garage.sh` puts it.
pub fn garage_binary() -> Result<PathBuf, String> {
    super::s3::cached_tool(
        "GPU_CHECKPOINT_GARAGE",
        &format!("garage-{GARAGE_VERSION}"),
        "garage",
    )
}

/// `n` random bytes as lowercase hex (keys and the RPC secret: fresh for every server).
fn random_hex(n: usize) -> String {
    let mut bytes = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("random bytes");
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// A running single-node garage with one bucket and one key allowed on it.
pub struct GarageServer {
    child: Child,
    pub endpoint: String,
    pub bucket: String,
    access_key: String,
    secret_key: String,
    /// Config, metadata, data and the server's log, private to this server.
    pub dir: tempfile::TempDir,
}

impl GarageServer {
    /// Starts a server in the long lane, or `None` (with the reason printed) outside it; in the long lane
    /// a missing garage fails.
    pub fn start() -> Option<GarageServer> {
        if !long_lane() {
            eprintln!(
                "SKIPPED: garage runs in the long test lane only (scripts/test.sh --long, or \
                 {LONG_TESTS_ENV}=1 after scripts/install-garage.sh)"
            );
            return None;
        }
        let bin = garage_binary().unwrap_or_else(|why| {
            panic!("the long test lane needs garage: {why} (scripts/install-garage.sh builds it)")
        });
        Some(GarageServer::start_with(&bin))
    }

    fn start_with(bin: &Path) -> GarageServer {
        let dir = private_dir("garage");
        // Garage's key format: an id `GK` + 12 bytes in hex, a secret of 32 bytes in hex.
        let access_key = format!("GK{}", random_hex(12));
        let secret_key = random_hex(32);
        let bucket = "ckpt".to_string();
        for _ in 0..5 {
            let (s3, rpc) = (free_port(), free_port());
            if let Some(child) = spawn(bin, dir.path(), s3, rpc, &access_key, &secret_key, &bucket)
            {
                return GarageServer {
                    child,
                    endpoint: format!("http://127.0.0.1:{s3}"),
                    bucket,
                    access_key,
                    secret_key,
                    dir,
                };
            }
        }
        let log = std::fs::read_to_string(dir.path().join("garage.log")).unwrap_or_default();
        panic!("garage did not start; its log:\n{log}");
    }

    /// Stops the server (a fault: the storage goes away).
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Endpoint for GarageServer {
    fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_key.clone()),
            ("AWS_REGION", REGION.into()),
        ]
    }

    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn bucket(&self) -> &str {
        &self.bucket
    }

    fn keys(&self) -> (&str, &str) {
        (&self.access_key, &self.secret_key)
    }
}

/// Writes the config (fresh ports and RPC secret; metadata and data in `dir`), starts garage in
/// single-node mode and waits until its S3 API answers; `None` when it exits first (a port was taken).
fn spawn(
    bin: &Path,
    dir: &Path,
    s3: u16,
    rpc: u16,
    access_key: &str,
    secret_key: &str,
    bucket: &str,
) -> Option<Child> {
    let config = dir.join("garage.toml");
    // A fresh layout each try: --single-node refuses a node that already has one from a failed start.
    for sub in ["meta", "data"] {
        let _ = std::fs::remove_dir_all(dir.join(sub));
    }
    let text = format!(
        "metadata_dir = \"{meta}\"\n\
         data_dir = \"{data}\"\n\
         db_engine = \"lmdb\"\n\
         replication_factor = 1\n\
         rpc_bind_addr = \"127.0.0.1:{rpc}\"\n\
         rpc_public_addr = \"127.0.0.1:{rpc}\"\n\
         rpc_secret = \"{secret}\"\n\
         [s3_api]\n\
         s3_region = \"{REGION}\"\n\
         api_bind_addr = \"127.0.0.1:{s3}\"\n",
        meta = dir.join("meta").display(),
        data = dir.join("data").display(),
        secret = random_hex(32),
    );
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        // The config holds the RPC secret: private, never a file someone else made.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&config)
            .expect("write garage.toml");
        f.write_all(text.as_bytes()).unwrap();
    }
    let log = std::fs::File::create(dir.join("garage.log")).unwrap();
    let child = Command::new(bin)
        .arg("-c")
        .arg(&config)
        .args(["server", "--single-node", "--default-bucket"])
        .env("GARAGE_DEFAULT_ACCESS_KEY", access_key)
        .env("GARAGE_DEFAULT_SECRET_KEY", secret_key)
        .env("GARAGE_DEFAULT_BUCKET", bucket)
        .env("RUST_LOG", "garage=warn")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("garage starts");
    // The S3 API is started after the layout, key and bucket are made.
    super::s3::listening(child, s3, Duration::from_secs(60))
}

impl Drop for GarageServer {
    fn drop(&mut self) {
        self.stop();
    }
}
