//! moto's S3 server (a mock of AWS from PyPI, installed once by `scripts/install-moto.sh` into a cache
//! outside the clone) for the long test lane: one more S3 server the backend conformance suite runs
//! against, never the only one. Started on 127.0.0.1 on a free port (it keeps objects in memory), one bucket
//! made, killed on drop. Skipped outside the long lane, a failure inside it when missing, like garage.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command};
use std::time::Duration;

use super::garage::{long_lane, LONG_TESTS_ENV};
use super::s3::Endpoint;

/// The version `scripts/install-moto.sh` installs.
pub const MOTO_VERSION: &str = "5.2.5";

/// A running moto server with one bucket (it takes any credentials).
pub struct MotoServer {
    child: Child,
    pub endpoint: String,
    pub bucket: String,
}

impl MotoServer {
    /// Starts a server in the long lane, or `None` (with the reason printed) outside it; in the long lane
    /// a missing moto fails.
    pub fn start() -> Option<MotoServer> {
        if !long_lane() {
            eprintln!(
                "SKIPPED: moto's server runs in the long test lane only (scripts/test.sh --long, or \
                 {LONG_TESTS_ENV}=1 after scripts/install-moto.sh)"
            );
            return None;
        }
        let bin = super::s3::cached_tool(
            "GPU_CHECKPOINT_MOTO",
            &format!("moto-{MOTO_VERSION}"),
            "moto_server",
        )
        .unwrap_or_else(|why| {
            panic!("the long test lane needs moto: {why} (scripts/install-moto.sh installs it)")
        });
        for _ in 0..5 {
            let port = super::s3::free_port();
            let started = super::s3::serve(
                Command::new(&bin).args(["-H", "127.0.0.1", "-p", &port.to_string()]),
                port,
                Duration::from_secs(60),
            );
            if let Some(child) = started {
                let server = MotoServer {
                    child,
                    endpoint: format!("http://127.0.0.1:{port}"),
                    bucket: "ckpt".into(),
                };
                server.create_bucket();
                return Some(server);
            }
        }
        panic!("moto_server did not start");
    }

    /// `PUT /BUCKET`: moto's server does not check signatures, so a plain request makes the bucket.
    fn create_bucket(&self) {
        let addr = self.endpoint.trim_start_matches("http://");
        let mut conn = TcpStream::connect(addr).expect("reach moto");
        write!(
            conn,
            "PUT /{} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.bucket
        )
        .unwrap();
        let mut answer = String::new();
        conn.read_to_string(&mut answer).unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 200"),
            "create bucket: {answer}"
        );
    }
}

impl Endpoint for MotoServer {
    fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        let (access, secret) = self.keys();
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", access.into()),
            ("AWS_SECRET_ACCESS_KEY", secret.into()),
            ("AWS_REGION", "us-east-1".into()),
        ]
    }

    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn bucket(&self) -> &str {
        &self.bucket
    }

    fn keys(&self) -> (&str, &str) {
        (super::s3::ACCESS_KEY, super::s3::SECRET_KEY)
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
