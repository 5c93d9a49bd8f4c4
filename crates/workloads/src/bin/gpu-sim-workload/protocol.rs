//! The control channel: the abstract UNIX socket `@gpu-checkpoint-sim/<pid>`, one request line per
//! connection, one answer line (`OK ...` or `ERR <CUresult> <message>`). Its own module because the
//! library's `freeze::sim` client speaks exactly this: request names, argument syntax and result codes
//! are a contract, apart from how the simulator carries the requests out.

use std::io::{BufRead, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener};
use std::time::Duration;

use crate::lockstep::Lockstep;
use crate::options::fault_names;
use crate::sim::Sim;

// CUresult codes the simulator answers with (cuda.h numbers).
pub const INVALID_VALUE: i32 = 1;
pub const OUT_OF_MEMORY: i32 = 2;
pub const NOT_INITIALIZED: i32 = 3;
pub const INVALID_DEVICE: i32 = 101;
pub const OPERATING_SYSTEM: i32 = 304;
pub const ILLEGAL_STATE: i32 = 401;
pub const NOT_READY: i32 = 600;
pub const NOT_SUPPORTED: i32 = 801;

/// An error answer.
pub fn err(code: i32, msg: impl AsRef<str>) -> String {
    format!("ERR {code} {}", msg.as_ref())
}

/// The GPU pairs of `RESTORE old=new,...`: old UUIDs lower-cased (compared without case), new ones as
/// given. Entries without `=` are skipped.
pub fn parse_gpu_pairs(arg: &str) -> Vec<(String, String)> {
    arg.split(',')
        .filter(|p| !p.trim().is_empty())
        .filter_map(|p| p.split_once('='))
        .map(|(a, b)| (a.trim().to_ascii_lowercase(), b.trim().to_string()))
        .collect()
}

/// Binds the control socket of process `pid`.
pub fn bind(pid: u32) -> Result<UnixListener, String> {
    let addr = SocketAddr::from_abstract_name(format!("gpu-checkpoint-sim/{pid}").as_bytes())
        .map_err(|e| e.to_string())?;
    UnixListener::bind_addr(&addr)
        .map_err(|e| format!("cannot bind @gpu-checkpoint-sim/{pid}: {e}"))
}

/// Answers requests for ever; `STATUS` also reports the lockstep of a rank (`--peers`).
pub fn serve(listener: &UnixListener, sim: &Sim, lockstep: Option<&Lockstep>) -> ! {
    loop {
        // accept() is restarted after CRIU restores the listening socket; transient errors just loop.
        let Ok((stream, _)) = listener.accept() else {
            continue;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            continue;
        }
        let cmd = line.split_whitespace().next().unwrap_or("").to_string();
        let driver_call = matches!(cmd.as_str(), "LOCK" | "CHECKPOINT" | "RESTORE" | "UNLOCK");
        if driver_call {
            record_event(&format!("{cmd} begin"));
        }
        let mut answer = handle(sim, &line);
        if driver_call {
            record_event(&format!("{cmd} {}", &answer[..answer.len().min(3)].trim()));
        }
        if let (Some(l), true) = (lockstep, answer.starts_with("OK simulated=")) {
            answer = format!("{answer} {}", l.status());
        }
        let _ = (&stream).write_all(format!("{answer}\n").as_bytes());
        // `slow-close`: the connection stays open a while after the answer, as it can when this
        // thread is descheduled between the two (a loaded machine): a client must not take the
        // answer for the end of the connection.
        if sim.fault("slow-close") {
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

/// Appends `PID EVENT` to the file named by `GPU_SIM_EVENT_FILE`, if set: the driver calls in the
/// order they happened across processes (one `O_APPEND` write per line), for tests of the order in
/// which a job's members are locked and restored. Read at every call, so a restored copy records too.
/// `GPU_SIM_EVENT_TAG`, if set, is written in place of the PID: processes in containers have PIDs of
/// their own PID namespace, the same in every container.
fn record_event(event: &str) {
    let Some(path) = std::env::var_os("GPU_SIM_EVENT_FILE") else {
        return;
    };
    let who = std::env::var("GPU_SIM_EVENT_TAG").unwrap_or_else(|_| std::process::id().to_string());
    let line = format!("{who} {event}\n");
    let _ = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
}

/// The answer to one request line.
fn handle(sim: &Sim, line: &str) -> String {
    let (cmd, arg) = line
        .trim()
        .split_once(' ')
        .map(|(c, a)| (c, a.trim()))
        .unwrap_or((line.trim(), ""));
    if sim.no_context && !matches!(cmd, "STATUS" | "FAULT") {
        return err(
            NOT_INITIALIZED,
            "no CUDA context in this process (it only loaded the library)",
        );
    }
    match cmd {
        "STATE" => format!("OK {}", sim.lock_inner().state.name()),
        "LOCK" => sim.lock(arg),
        "CHECKPOINT" => sim.checkpoint(),
        "RESTORE" => sim.restore(arg),
        "UNLOCK" => sim.unlock(),
        "RESTORE_TID" => format!("OK {}", sim.control_tid.get().copied().unwrap_or(0)),
        "STATUS" => sim.status(),
        "VERIFY" => sim.verify(),
        "FAULT" => {
            let mut g = sim.lock_inner();
            g.faults = fault_names(arg).into_iter().collect();
            "OK".into()
        }
        _ => err(INVALID_VALUE, format!("unknown request `{cmd}`")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn gpu_pairs_are_trimmed_and_old_uuids_lower_cased() {
        assert_eq!(
            parse_gpu_pairs(" GPU-A = GPU-B ,, junk,gpu-c=GPU-D"),
            [
                ("gpu-a".to_string(), "GPU-B".to_string()),
                ("gpu-c".to_string(), "GPU-D".to_string())
            ]
        );
        assert!(parse_gpu_pairs("").is_empty());
    }

    #[test]
    fn requests_follow_the_state_machine_and_its_codes() {
        // No devices and no workers: the state machine alone.
        let sim = Sim::new(
            Vec::new(),
            1 << 20,
            1,
            Duration::ZERO,
            BTreeSet::new(),
            false,
            Vec::new(),
        );
        assert_eq!(handle(&sim, "STATE\n"), "OK running");
        assert_eq!(
            handle(&sim, "CHECKPOINT"),
            err(ILLEGAL_STATE, "process is running, checkpoint needs locked")
        );
        assert!(handle(&sim, "LOCK soon").starts_with("ERR 1 "));
        assert_eq!(handle(&sim, "LOCK 100"), "OK");
        assert_eq!(handle(&sim, "CHECKPOINT"), "OK");
        assert_eq!(handle(&sim, "STATE"), "OK checkpointed");
        assert_eq!(handle(&sim, "FAULT restore-oom"), "OK");
        assert!(handle(&sim, "RESTORE").starts_with("ERR 2 "));
        assert_eq!(handle(&sim, "FAULT none"), "OK");
        assert_eq!(handle(&sim, "RESTORE"), "OK");
        assert_eq!(handle(&sim, "UNLOCK"), "OK");
        assert!(handle(&sim, "VERIFY").starts_with("OK verified 0 device(s)"));
        assert!(handle(&sim, "STATUS").contains(" state=running "));
        assert!(handle(&sim, "BOGUS").starts_with("ERR 1 unknown request"));
    }

    #[test]
    fn a_process_without_context_answers_not_initialized() {
        let sim = Sim::new(
            Vec::new(),
            1 << 20,
            1,
            Duration::ZERO,
            BTreeSet::new(),
            true,
            Vec::new(),
        );
        assert!(handle(&sim, "STATE").starts_with("ERR 3 "));
        assert!(handle(&sim, "STATUS").starts_with("OK simulated=yes"));
    }
}
