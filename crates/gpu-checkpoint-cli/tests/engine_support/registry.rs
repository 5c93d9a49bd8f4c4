//! The smallest OCI distribution registry containerd pulls from: one image layout, read-only, over plain
//! HTTP on 127.0.0.1 (containerd's resolver speaks HTTP to loopback hosts). containerd 2.1's CRI restore
//! pulls the checkpoint's base image by its digest reference before it looks at its own store; nothing
//! else is reachable here, and no traffic leaves the loopback interface.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";

/// Serves the layout until dropped.
pub struct Registry {
    /// `127.0.0.1:PORT`.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Registry {
    /// Serves the layout in `dir`, whose every tag is manifest `manifest` (hex digest).
    pub fn serve(dir: &Path, manifest: &str) -> Registry {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let blobs = dir.join("blobs/sha256");
        let manifest = manifest.to_string();
        let stopping = Arc::clone(&stop);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stopping.load(Ordering::Relaxed) {
                    return;
                }
                if let Ok(c) = conn {
                    let (blobs, manifest) = (blobs.clone(), manifest.clone());
                    std::thread::spawn(move || {
                        let _ = answer(c, &blobs, &manifest);
                    });
                }
            }
        });
        Registry { addr, stop }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accepting thread, which then sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

/// One request, one answer, connection closed.
fn answer(conn: TcpStream, blobs: &Path, manifest: &str) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header)? == 0 || header == "\r\n" || header == "\n" {
            break;
        }
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let head = method == "HEAD";
    let (kind, name) = match path.strip_prefix("/v2/") {
        Some("") => return respond(conn, 200, "application/json", None, b"{}", head),
        Some(rest) => match rest.rsplit_once('/') {
            Some((left, name)) => (left.rsplit('/').next().unwrap_or(""), name),
            None => ("", ""),
        },
        None => ("", ""),
    };
    let digest = match (kind, name.strip_prefix("sha256:")) {
        (_, Some(hex)) => hex.to_string(),
        // A tag: the one manifest.
        ("manifests", None) => manifest.to_string(),
        _ => String::new(),
    };
    let file: PathBuf = blobs.join(&digest);
    let ok = !digest.is_empty() && digest.bytes().all(|b| b.is_ascii_hexdigit()) && file.is_file();
    if !ok || !matches!(kind, "manifests" | "blobs") {
        return respond(conn, 404, "text/plain", None, b"not found", head);
    }
    let body = std::fs::read(&file)?;
    let mime = if kind == "manifests" {
        MANIFEST
    } else {
        "application/octet-stream"
    };
    respond(
        conn,
        200,
        mime,
        Some(&format!("sha256:{digest}")),
        &body,
        head,
    )
}

fn respond(
    mut conn: TcpStream,
    status: u16,
    mime: &str,
    digest: Option<&str>,
    body: &[u8],
    head: bool,
) -> std::io::Result<()> {
    let reason = if status == 200 { "OK" } else { "Not Found" };
    let mut out = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {mime}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if let Some(d) = digest {
        out.push_str(&format!("Docker-Content-Digest: {d}\r\n"));
    }
    out.push_str("\r\n");
    conn.write_all(out.as_bytes())?;
    if !head {
        conn.write_all(body)?;
    }
    conn.flush()
}
