//! A fault-injecting HTTP proxy in front of the S3 server, on 127.0.0.1: it answers a chosen share of
//! requests with `503 SlowDown` (what S3 says when it throttles), delays requests (a slow server), and
//! counts what the client sent (the bytes an unchanged re-checkpoint costs, the chunks a restore fetches).
//!
//! Each request gets its own connection to the server: the proxy adds `Connection: close` on both sides,
//! so it never has to find where a response ends; it only reads a request's head and, by its
//! `Content-Length`, its body (the S3 client sends no chunked bodies). The signature stays valid: the
//! `Host` header is passed on as it came, and `Connection` is not a signed header.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const SLOW_DOWN: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>\
    <Message>Please reduce your request rate.</Message><RequestId>proxy</RequestId></Error>";

#[derive(Default)]
struct Shared {
    /// Throttle one request in this many (0: none, 1: all).
    throttle_one_in: AtomicU64,
    delay_ms: AtomicU64,
    requests: AtomicU64,
    throttled: AtomicU64,
    /// PUTs of chunk objects that reached the server.
    chunk_puts: AtomicU64,
    /// GETs of chunk objects that reached the server.
    chunk_gets: AtomicU64,
    /// Request bytes (heads and bodies) passed on to the server.
    bytes_sent: AtomicU64,
    stop: AtomicBool,
}

/// The proxy; stops accepting on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// A proxy in front of the server at `upstream` (`http://HOST:PORT`), passing everything on.
    pub fn start(upstream: &str) -> FaultProxy {
        let upstream: SocketAddr = upstream
            .trim_start_matches("http://")
            .parse()
            .expect("HOST:PORT");
        let listener = TcpListener::bind("127.0.0.1:0").expect("a free port");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared::default());
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || {
                    // A connection the client or the server broke is the client's to retry.
                    let _ = serve(client, upstream, &s);
                });
            }
        });
        FaultProxy { addr, shared }
    }

    /// `http://127.0.0.1:PORT`
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Answers one request in `n` with 503 SlowDown from now on (0: none, 1: every request).
    pub fn throttle_one_in(&self, n: u64) {
        self.shared.throttle_one_in.store(n, Ordering::SeqCst);
    }

    /// Holds every request this long before passing it on.
    pub fn delay(&self, d: Duration) {
        self.shared
            .delay_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    pub fn requests(&self) -> u64 {
        self.shared.requests.load(Ordering::SeqCst)
    }

    pub fn throttled(&self) -> u64 {
        self.shared.throttled.load(Ordering::SeqCst)
    }

    pub fn chunk_puts(&self) -> u64 {
        self.shared.chunk_puts.load(Ordering::SeqCst)
    }

    pub fn chunk_gets(&self) -> u64 {
        self.shared.chunk_gets.load(Ordering::SeqCst)
    }

    pub fn bytes_sent(&self) -> u64 {
        self.shared.bytes_sent.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the accepting thread so that it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

/// One request: throttled, or passed on (after the delay) with its answer relayed.
fn serve(mut client: TcpStream, upstream: SocketAddr, s: &Shared) -> std::io::Result<()> {
    let (head, rest) = read_head(&mut client)?;
    let Some(head) = head else { return Ok(()) };
    let text = String::from_utf8_lossy(&head).into_owned();
    let request_line = text.lines().next().unwrap_or_default().to_owned();
    let length: u64 = text
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    let n = s.requests.fetch_add(1, Ordering::SeqCst);
    let delay = s.delay_ms.load(Ordering::SeqCst);
    if delay > 0 {
        std::thread::sleep(Duration::from_millis(delay));
    }
    let mut body = rest;
    if (body.len() as u64) < length {
        let mut more = Vec::new();
        (&mut client)
            .take(length - body.len() as u64)
            .read_to_end(&mut more)?;
        body.extend_from_slice(&more);
    }
    let one_in = s.throttle_one_in.load(Ordering::SeqCst);
    if one_in > 0 && n.is_multiple_of(one_in) {
        s.throttled.fetch_add(1, Ordering::SeqCst);
        let answer = format!(
            "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
             Connection: close\r\n\r\n{SLOW_DOWN}",
            SLOW_DOWN.len()
        );
        return client.write_all(answer.as_bytes());
    }
    // The head again, with `Connection: close` in place of whatever the client asked.
    let mut out = String::new();
    for line in text.split("\r\n").filter(|l| !l.is_empty()) {
        if !line.to_ascii_lowercase().starts_with("connection:") {
            out.push_str(line);
            out.push_str("\r\n");
        }
    }
    out.push_str("Connection: close\r\n\r\n");
    let mut server = TcpStream::connect(upstream)?;
    server.write_all(out.as_bytes())?;
    server.write_all(&body)?;
    s.bytes_sent
        .fetch_add((out.len() + body.len()) as u64, Ordering::SeqCst);
    if request_line.starts_with("PUT ") && request_line.contains("/chunks/") {
        s.chunk_puts.fetch_add(1, Ordering::SeqCst);
    }
    if request_line.starts_with("GET ") && request_line.contains("/chunks/") {
        s.chunk_gets.fetch_add(1, Ordering::SeqCst);
    }
    std::io::copy(&mut server, &mut client)?;
    client.shutdown(std::net::Shutdown::Both)
}

/// A request's head (through the blank line) and the body bytes read with it; no head when the client
/// closed first.
fn read_head(client: &mut TcpStream) -> std::io::Result<(Option<Vec<u8>>, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut block = [0u8; 16 * 1024];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buf.split_off(end + 4);
            return Ok((Some(buf), rest));
        }
        let n = client.read(&mut block)?;
        if n == 0 {
            return Ok((None, Vec::new()));
        }
        buf.extend_from_slice(&block[..n]);
    }
}
