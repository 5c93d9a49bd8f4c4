//! The simulated GPU (tests and demos only): a client for the control channel of `gpu-sim-workload`.
//!
//! Contract with the workload (and with `detect`, which recognises simulated GPU processes only when
//! its simulator option is on):
//! * device memory is a `MAP_SHARED` mapping of a file `/dev/shm/gpu-checkpoint-sim/<pid>-dev<N>`;
//! * the control channel is the abstract UNIX stream socket `@gpu-checkpoint-sim/<pid>` (abstract, so
//!   nothing is left on disk when the process dies, and CRIU dumps and restores it as a listening socket);
//! * one request line per connection, one answer line: `OK [payload]` or `ERR <CUresult> <message>`.
//!   Requests: `STATE`, `LOCK <timeout ms, 0 = none>`, `CHECKPOINT`, `RESTORE [old=new,...]`, `UNLOCK`,
//!   `RESTORE_TID`, `STATUS`, `VERIFY`, `FAULT <name,...|none>`.
//!
//! The answers use the CUDA driver's result codes, so errors are mapped exactly as the driver's are.

use super::types::{CuError, GpuInfo, GpuPair, GpuUuid, ProcessState};
use super::{Error, GpuBackend, GpuDriver, GpuMemory, Op, Result};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

/// Where simulated device memory lives.
pub const SHM_DIR: &str = "/dev/shm/gpu-checkpoint-sim";
/// Number of simulated GPUs on this node (default 2).
pub const ENV_GPUS: &str = "GPU_CHECKPOINT_SIM_GPUS";
/// Model name of every simulated GPU: never mistaken for real hardware.
pub const SIM_MODEL: &str = "SIMULATED GPU (gpu-checkpoint-sim)";
/// Memory of each simulated GPU unless [`ENV_GPU_MIB`] says otherwise.
pub const SIM_GPU_MEMORY: u64 = 1 << 30;
/// Memory of each simulated GPU, in MiB (tests of the restore's free-memory preflight make it small).
pub const ENV_GPU_MIB: &str = "GPU_CHECKPOINT_SIM_GPU_MIB";

/// The memory of each simulated GPU.
pub fn sim_gpu_memory() -> u64 {
    std::env::var(ENV_GPU_MIB)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(SIM_GPU_MEMORY, |mib| mib << 20)
}
/// Operations that move memory wait this long for an answer; lock waits for its own timeout plus this.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);

/// The abstract socket name (without the leading NUL / `@`).
pub fn socket_name(pid: i32) -> String {
    format!("gpu-checkpoint-sim/{pid}")
}

/// The device memory file of a simulated process's device `dev`.
pub fn device_file(pid: i32, dev: u32) -> std::path::PathBuf {
    std::path::Path::new(SHM_DIR).join(format!("{pid}-dev{dev}"))
}

/// The UUID of simulated GPU `index`: a fixed, recognisable pattern.
pub fn sim_gpu_uuid(index: u32) -> GpuUuid {
    let mut u = [0u8; 16];
    u[..4].copy_from_slice(&[0x51, 0x6d, 0x67, 0x70]);
    u[12..].copy_from_slice(&index.to_be_bytes());
    GpuUuid(u)
}

/// The simulated GPUs of this node.
pub fn sim_gpus() -> Vec<GpuInfo> {
    let n = std::env::var(ENV_GPUS)
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        .unwrap_or(2);
    (0..n)
        .map(|i| GpuInfo {
            index: i,
            uuid: sim_gpu_uuid(i),
            model: SIM_MODEL.to_string(),
            memory_bytes: Some(sim_gpu_memory()),
        })
        .collect()
}

/// Sends one request to the simulated process `pid` and returns the payload of its `OK` answer.
pub fn request(pid: i32, op: Op, line: &str, timeout: Duration) -> Result<String> {
    let unreachable = |reason: String| Error::SimUnreachable { pid, reason };
    let mut stream = connect(pid).map_err(|e| unreachable(e.to_string()))?;
    let protocol = |reason: String| Error::SimProtocol { pid, reason };
    stream
        .set_read_timeout(Some(timeout))
        .map_err(|e| protocol(e.to_string()))?;
    stream
        .write_all(format!("{line}\n").as_bytes())
        .map_err(|e| protocol(format!("sending `{line}`: {e}")))?;
    let mut answer = String::new();
    let mut reader = BufReader::new(&stream);
    reader
        .read_line(&mut answer)
        .map_err(|e| protocol(format!("waiting for the answer to `{line}`: {e}")))?;
    // The simulator closes its end after answering. Until it has, the process holds a socket connected
    // to this one, outside its tree, which a detect of the tree right after (the next checkpoint of a
    // job member, in this same agent) would take for a connection CRIU cannot dump: wait for its end
    // (EOF comes only once its descriptor is closed), bounded by the same timeout.
    let _ = reader.read_to_end(&mut Vec::new());
    parse_answer(pid, op, answer.trim_end())
}

/// Connects to the control socket of the simulated process `pid` (a PID of this PID namespace).
///
/// A process in a container names its socket with the PID it sees itself under (the last of `NSpid`),
/// and abstract sockets belong to a network namespace: a container's is reached by a short-lived thread
/// that enters the process's network namespace, connects, and ends (`setns` of a network namespace acts
/// on the calling thread only; the connected socket works from any thread afterwards).
fn connect(pid: i32) -> std::io::Result<UnixStream> {
    let status = std::fs::read(format!("/proc/{pid}/status"))?;
    let own = crate::detect::parse::parse_nspid(&status)
        .last()
        .copied()
        .unwrap_or(pid);
    let addr = SocketAddr::from_abstract_name(socket_name(own).as_bytes())?;
    let theirs = std::fs::metadata(format!("/proc/{pid}/ns/net"));
    let ours = std::fs::metadata("/proc/thread-self/ns/net");
    let same_net = match (&theirs, &ours) {
        (Ok(a), Ok(b)) => {
            use std::os::unix::fs::MetadataExt;
            (a.dev(), a.ino()) == (b.dev(), b.ino())
        }
        // Without the namespace links (a restricted /proc), try our own namespace.
        _ => true,
    };
    if same_net {
        return UnixStream::connect_addr(&addr);
    }
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    std::thread::scope(|s| {
        s.spawn(|| {
            match nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET) {
                Ok(()) => {}
                // gVisor's sentry has no setns (EOPNOTSUPP) and shows other namespace links than the
                // host would: inside a sandbox the caller shares the network stack, so try ours.
                Err(nix::errno::Errno::EOPNOTSUPP | nix::errno::Errno::ENOSYS) => {}
                Err(e) => return Err(e.into()),
            }
            UnixStream::connect_addr(&addr)
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("the connecting thread panicked")))
    })
}

fn parse_answer(pid: i32, op: Op, answer: &str) -> Result<String> {
    if let Some(rest) = answer.strip_prefix("OK") {
        return Ok(rest.trim().to_string());
    }
    if let Some(rest) = answer.strip_prefix("ERR ") {
        let (code, msg) = rest.split_once(' ').unwrap_or((rest, ""));
        if let Some(code) = code.parse::<i32>().ok().and_then(CuError::from_code) {
            return Err(Error::Cuda {
                op,
                pid,
                code,
                detail: (!msg.is_empty()).then(|| format!("simulated GPU: {msg}")),
            });
        }
    }
    Err(Error::SimProtocol {
        pid,
        reason: format!("unexpected answer `{answer}`"),
    })
}

/// `STATUS`: the simulator's own report (state, steps per worker, device checksums, faults) as key=value.
pub fn status(pid: i32) -> Result<BTreeMap<String, String>> {
    let s = request(pid, Op::State, "STATUS", ANSWER_TIMEOUT)?;
    Ok(s.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect())
}

/// `VERIFY`: the simulator recomputes what its device memory must hold from its step counters.
pub fn verify(pid: i32) -> Result<String> {
    request(pid, Op::State, "VERIFY", ANSWER_TIMEOUT)
}

/// `FAULT`: injects faults (`lock-timeout`, `checkpoint`, `restore`, `restore-oom`) or clears them (`none`).
pub fn inject_fault(pid: i32, faults: &str) -> Result<()> {
    request(pid, Op::State, &format!("FAULT {faults}"), ANSWER_TIMEOUT).map(drop)
}

/// The simulator backend.
#[derive(Debug, Default)]
pub struct SimDriver;

impl SimDriver {
    pub fn new() -> Self {
        SimDriver
    }
}

impl GpuDriver for SimDriver {
    fn backend(&self) -> GpuBackend {
        GpuBackend::Sim
    }

    fn driver_version(&self) -> Option<String> {
        Some("SIMULATED (gpu-sim-workload protocol 1)".into())
    }

    fn simulated(&self) -> bool {
        true
    }

    fn state(&self, pid: i32) -> Result<ProcessState> {
        let s = request(pid, Op::State, "STATE", ANSWER_TIMEOUT)?;
        s.parse().map_err(|_| Error::SimProtocol {
            pid,
            reason: format!("unknown state `{s}`"),
        })
    }

    fn lock(&self, pid: i32, timeout: Option<Duration>) -> Result<()> {
        let ms = timeout.map_or(0, |t| t.as_millis().max(1));
        let wait = timeout.unwrap_or(Duration::from_secs(3600)) + ANSWER_TIMEOUT;
        request(pid, Op::Lock, &format!("LOCK {ms}"), wait).map(drop)
    }

    fn checkpoint(&self, pid: i32) -> Result<()> {
        request(pid, Op::Checkpoint, "CHECKPOINT", ANSWER_TIMEOUT).map(drop)
    }

    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<()> {
        let map: Vec<String> = pairs
            .iter()
            .map(|p| format!("{}={}", p.old, p.new))
            .collect();
        let line = format!("RESTORE {}", map.join(","));
        request(pid, Op::Restore, line.trim_end(), ANSWER_TIMEOUT).map(drop)
    }

    fn unlock(&self, pid: i32) -> Result<()> {
        request(pid, Op::Unlock, "UNLOCK", ANSWER_TIMEOUT).map(drop)
    }

    fn restore_thread_id(&self, pid: i32) -> Result<i32> {
        let s = request(pid, Op::RestoreTid, "RESTORE_TID", ANSWER_TIMEOUT)?;
        s.parse().map_err(|_| Error::SimProtocol {
            pid,
            reason: format!("bad thread id `{s}`"),
        })
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>> {
        Ok(sim_gpus())
    }

    fn process_memory(&self, pid: i32) -> Option<Vec<GpuMemory>> {
        let st = status(pid).ok()?;
        let bytes: u64 = st.get("bytes")?.parse().ok()?;
        st.get("uuids")?
            .split(',')
            .map(|u| {
                Some(GpuMemory {
                    gpu: u.parse().ok()?,
                    bytes,
                })
            })
            .collect()
    }

    /// The GPU's memory less what the live simulated processes hold on it (a checkpointed one holds none:
    /// its device memory went to host memory).
    fn free_memory(&self, gpu: &GpuUuid) -> Option<u64> {
        let mut pids: Vec<i32> = std::fs::read_dir(SHM_DIR)
            .ok()?
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.split_once("-dev")?.0.parse().ok()
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        let used: u64 = pids
            .into_iter()
            .filter(|&p| crate::proc::is_alive(p))
            .filter(|&p| self.state(p).is_ok_and(|s| s != ProcessState::Checkpointed))
            .filter_map(|p| self.process_memory(p))
            .flatten()
            .filter(|m| m.gpu == *gpu)
            .map(|m| m.bytes)
            .sum();
        Some(sim_gpu_memory().saturating_sub(used))
    }

    fn process_gpus(&self, pid: i32) -> Option<Vec<GpuUuid>> {
        let st = status(pid).ok()?;
        st.get("uuids")?
            .split(',')
            .map(|u| u.parse().ok())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_map_to_cuda_errors() {
        assert_eq!(parse_answer(1, Op::State, "OK running").unwrap(), "running");
        assert_eq!(parse_answer(1, Op::Unlock, "OK").unwrap(), "");
        let e = parse_answer(1, Op::Lock, "ERR 600 in-flight work did not finish").unwrap_err();
        assert_eq!(e.cu_error(), Some(CuError::NotReady));
        assert!(e.to_string().contains("in-flight"), "{e}");
        let e = parse_answer(1, Op::Unlock, "ERR 401 not locked").unwrap_err();
        assert_eq!(e.cu_error(), Some(CuError::IllegalState));
        assert!(matches!(
            parse_answer(1, Op::Lock, "garbage"),
            Err(Error::SimProtocol { .. })
        ));
    }

    #[test]
    fn no_simulated_process_means_no_cuda() {
        // Our own test process has no control socket.
        let e = SimDriver.state(std::process::id() as i32).unwrap_err();
        assert!(e.is_no_cuda(), "{e}");
    }

    #[test]
    fn simulated_gpus_are_labelled() {
        let g = sim_gpus();
        assert!(!g.is_empty());
        assert!(g.iter().all(|g| g.model.contains("SIMULATED")));
        assert_ne!(sim_gpu_uuid(0), sim_gpu_uuid(1));
    }
}
