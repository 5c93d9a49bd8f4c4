//! Workloads for tests and demos: small programs that keep evolving state in memory so that a restored
//! copy can prove it continued where the checkpoint left it. Nothing here is part of the tool.
//!
//! Every workload reports its state through a *state file*: fixed-size text records (`key=value ...`,
//! padded to [`RECORD`] bytes) rewritten in place through one descriptor kept open for the workload's
//! whole life. Two reasons: a reader outside sees the state at any time, and CRIU finds the file exactly
//! as the checkpoint saw it on restore (same path, same size: CRIU refuses to restore an open regular file
//! whose size changed).
//!
//! The state itself is a chain of values `v(n+1) = step(v(n))` that only memory carries from one tick to
//! the next, so `value == chain(seed, seq)` after a restore proves the memory came back, and `seq` larger
//! than at the checkpoint proves the process went on from there instead of starting over.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Size of one state record, newline included.
pub const RECORD: usize = 256;

/// One step of every workload's value chain (a 64-bit LCG: cheap, and easy to recompute in a test).
pub fn step(v: u64) -> u64 {
    v.wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
}

/// `step` applied `n` times to `seed`.
pub fn chain(seed: u64, n: u64) -> u64 {
    (0..n).fold(seed, |v, _| step(v))
}

/// The writer side of a state file: `slots` records, each rewritten in place.
pub struct StateFile {
    file: File,
}

impl StateFile {
    /// Creates (or truncates) the state file with `slots` blank records.
    pub fn create(path: &Path, slots: usize) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        let mut blank = vec![b' '; RECORD * slots];
        for i in 0..slots {
            blank[i * RECORD + RECORD - 1] = b'\n';
        }
        file.write_all_at(&blank, 0)?;
        Ok(StateFile { file })
    }

    /// Rewrites record `slot` with `text` (one `key=value ...` line, shorter than [`RECORD`]).
    pub fn write(&self, slot: usize, text: &str) -> io::Result<()> {
        let mut rec = [b' '; RECORD];
        let n = text.len().min(RECORD - 1);
        rec[..n].copy_from_slice(&text.as_bytes()[..n]);
        rec[RECORD - 1] = b'\n';
        // One pwrite of one record: a reader sees the old or the new record (or retries on a torn one).
        self.file.write_all_at(&rec, (slot * RECORD) as u64)
    }
}

/// One parsed state record.
pub type Record = BTreeMap<String, String>;

/// Reads every non-blank record of a state file.
pub fn read_state(path: &Path) -> io::Result<Vec<Record>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect())
}

/// Reads field `key` of a record as a number.
pub fn field_u64(rec: &Record, key: &str) -> Option<u64> {
    let v = rec.get(key)?;
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// Command-line options shared by the workloads: `--state FILE`, `--detach`, and `--key value` pairs.
#[derive(Debug, Default)]
pub struct Opts {
    pub state: Option<PathBuf>,
    pub detach: bool,
    pub rest: BTreeMap<String, String>,
}

impl Opts {
    pub fn parse(args: impl Iterator<Item = String>) -> Result<Self, String> {
        let mut o = Opts::default();
        let mut args = args.peekable();
        while let Some(a) = args.next() {
            let key = a
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument {a:?}"))?;
            match key {
                "detach" => o.detach = true,
                "state" => o.state = Some(args.next().ok_or("--state needs a path")?.into()),
                k => {
                    let v = args.next().ok_or_else(|| format!("--{k} needs a value"))?;
                    o.rest.insert(k.to_string(), v);
                }
            }
        }
        Ok(o)
    }

    /// A numeric option with a default.
    pub fn num(&self, key: &str, default: u64) -> Result<u64, String> {
        match self.rest.get(key) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| format!("--{key}: not a number: {v}")),
        }
    }

    pub fn path(&self, key: &str) -> Result<PathBuf, String> {
        self.rest
            .get(key)
            .map(PathBuf::from)
            .ok_or_else(|| format!("--{key} PATH is required"))
    }

    pub fn state_path(&self) -> Result<&Path, String> {
        self.state
            .as_deref()
            .ok_or_else(|| "--state FILE is required".to_string())
    }
}

/// Detaches the calling process so that a checkpoint test can kill it and restore it under the same PID:
/// fork, the child starts a new session (CRIU dumps a tree whose root leads its own session without
/// `--shell-job`), its parent exits, so the child is re-parented to init, which reaps it once it is killed
/// and frees its PID. Standard streams go to /dev/null and every inherited descriptor is closed, so none of
/// the caller's pipes end up in the checkpoint. The original process prints the child's PID on stdout and
/// exits 0; only the child returns.
///
/// Must be called before any thread is started.
pub fn detach() -> io::Result<()> {
    // SAFETY: plain syscalls on a single-threaded process; every return value is checked.
    unsafe {
        match libc::fork() {
            -1 => return Err(io::Error::last_os_error()),
            0 => {}
            child => {
                println!("{child}");
                use std::io::Write;
                let _ = io::stdout().flush();
                libc::_exit(0);
            }
        }
        if libc::setsid() < 0 {
            libc::_exit(1);
        }
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
    }
    Ok(())
}

/// Sleeps for `ms` milliseconds.
pub fn sleep_ms(ms: u64) {
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_is_step_repeated() {
        assert_eq!(chain(7, 0), 7);
        assert_eq!(chain(7, 3), step(step(step(7))));
        assert_ne!(chain(7, 1000), chain(7, 1001));
    }

    #[test]
    fn state_file_round_trip_keeps_size() {
        let d = std::env::temp_dir().join(format!("wl-state-{}", std::process::id()));
        let s = StateFile::create(&d, 3).unwrap();
        s.write(1, "seq=5 value=0x10").unwrap();
        s.write(0, "seq=1").unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().len(), 3 * RECORD as u64);
        let recs = read_state(&d).unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(field_u64(&recs[1], "value"), Some(16));
        assert_eq!(field_u64(&recs[0], "seq"), Some(1));
        std::fs::remove_file(&d).unwrap();
    }

    #[test]
    fn options_parse() {
        let o = Opts::parse(
            ["--state", "/x", "--detach", "--threads", "4"]
                .iter()
                .map(|s| s.to_string()),
        )
        .unwrap();
        assert!(o.detach);
        assert_eq!(o.state_path().unwrap(), Path::new("/x"));
        assert_eq!(o.num("threads", 1).unwrap(), 4);
        assert_eq!(o.num("other", 9).unwrap(), 9);
        assert!(Opts::parse(["oops".to_string()].into_iter()).is_err());
    }
}
