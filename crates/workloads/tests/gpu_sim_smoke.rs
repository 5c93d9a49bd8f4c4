//! The SIMULATED GPU workload starts, says it is simulated, answers on its control socket, and removes
//! its device file when terminated. (Also makes `cargo test --workspace` build the binary for the other
//! crates' tests.)

use std::io::{BufRead, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::process::Command;

fn ask(pid: i32, line: &str) -> String {
    let addr = SocketAddr::from_abstract_name(format!("gpu-checkpoint-sim/{pid}")).unwrap();
    let mut s = UnixStream::connect_addr(&addr).unwrap();
    s.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut answer = String::new();
    BufReader::new(&s).read_line(&mut answer).unwrap();
    answer.trim().to_string()
}

#[test]
fn starts_answers_and_cleans_up() {
    let log = tempfile_path("sim-smoke.log");
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-sim-workload"))
        .args(["--daemon", "--mib", "1", "--log", &log])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let pid: i32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    let file = format!("/dev/shm/gpu-checkpoint-sim/{pid}-dev0");
    assert!(std::path::Path::new(&file).exists());
    assert_eq!(ask(pid, "STATE"), "OK running");
    assert!(ask(pid, "CHECKPOINT").starts_with("ERR 401 "));
    assert!(ask(pid, "VERIFY").starts_with("OK verified"));
    assert!(std::fs::read_to_string(&log)
        .unwrap()
        .contains("SIMULATED GPU"));
    // SAFETY: terminating the process this test started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    for _ in 0..100 {
        if !std::path::Path::new(&file).exists() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    panic!("{file} left behind after SIGTERM");
}

fn tempfile_path(name: &str) -> String {
    let p = std::env::temp_dir().join(format!("{}-{name}", std::process::id()));
    p.to_string_lossy().into_owned()
}
