//! `gpu-checkpoint cuda ...`: cuda-checkpoint parity, on any backend, with per-call timings.
//!
//! Semantics follow NVIDIA's utility: `state` prints the state word; `lock`, `checkpoint`, `restore`,
//! `unlock` make one driver transition each and fail like the driver (a failed `checkpoint` leaves the
//! process LOCKED); `toggle` goes RUNNING -> LOCKED -> CHECKPOINTED or CHECKPOINTED -> LOCKED -> RUNNING, and
//! unlike the utility, a toggle that fails half-way puts the process back where it was.

use super::Format;
use clap::builder::TypedValueParser;
use gpu_checkpoint::freeze::{
    self, DeviceMap, DeviceRef, GpuBackend, GpuDriver, GpuPair, Op, ProcessState,
};
use serde::Serialize;
use std::time::{Duration, Instant};
use strum::{EnumMessage, VariantArray};

/// `--gpu-backend`'s parser: the library's names and, as each one's help, its documentation (clap's way
/// of writing help: one line, no final period), so that the names have one source
/// ([`GpuBackend`]'s).
pub fn gpu_backend_parser() -> impl TypedValueParser<Value = GpuBackend> {
    let values = GpuBackend::VARIANTS.iter().map(|b| {
        let doc = b.get_documentation().unwrap_or_default();
        let help = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        clap::builder::PossibleValue::new(b.as_str()).help(help.trim_end_matches('.').to_string())
    });
    clap::builder::PossibleValuesParser::new(values)
        .map(|name| name.parse::<GpuBackend>().expect("one of the listed names"))
}

/// A `--lock-timeout`; `None` means no limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timeout(pub Option<Duration>);

/// Parses `--lock-timeout`: `10s`, `500ms`, `1.5` (seconds), `1.5s`, anything humantime reads (`2m`,
/// `1h 30m`), or `0` for no limit. Out-of-range values are an error, not a panic.
pub fn parse_timeout(s: &str) -> Result<Timeout, String> {
    let s = s.trim();
    let bad = || format!("`{s}` is not a duration (10s, 500ms, 1.5)");
    // Fractions of seconds, which humantime does not take, the way scripts have passed them so far.
    let decimal = s
        .strip_suffix("ms")
        .map(|n| (n, 0.001))
        .or_else(|| s.strip_suffix('s').map(|n| (n, 1.0)))
        .unwrap_or((s, 1.0));
    let d = match decimal.0.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => {
            Duration::try_from_secs_f64(v * decimal.1).map_err(|_| bad())?
        }
        Ok(_) => return Err(bad()),
        Err(_) => humantime::parse_duration(s).map_err(|_| bad())?,
    };
    Ok(Timeout((!d.is_zero()).then_some(d)))
}

/// `--gpu-backend` and `--lock-timeout` for the checkpoint and restore commands.
#[derive(clap::Args, Debug)]
pub struct GpuArgs {
    /// GPU checkpoint backend (only used when the tree holds GPU state).
    #[arg(long, value_parser = gpu_backend_parser(), default_value_t = GpuBackend::Auto, env = "GPU_CHECKPOINT_GPU_BACKEND")]
    pub gpu_backend: GpuBackend,
}

/// Options every `cuda` subcommand takes.
#[derive(clap::Args, Debug)]
pub struct Common {
    /// The process.
    #[arg(long)]
    pub pid: i32,
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    #[arg(long, value_parser = gpu_backend_parser(), default_value_t = GpuBackend::Auto, env = "GPU_CHECKPOINT_GPU_BACKEND")]
    pub gpu_backend: GpuBackend,
}

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Print the CUDA checkpoint state of a process (running, locked, checkpointed, failed).
    State(Common),
    /// RUNNING -> LOCKED: block new CUDA calls and wait for submitted work.
    Lock {
        #[command(flatten)]
        common: Common,
        /// Give up after this many milliseconds (the process keeps running); 0 or absent: no limit.
        #[arg(long, value_name = "MS")]
        timeout: Option<u64>,
    },
    /// LOCKED -> CHECKPOINTED: move device memory into host memory and release the GPU.
    Checkpoint(Common),
    /// CHECKPOINTED -> LOCKED: bring device memory back (optionally onto other GPUs).
    Restore {
        #[command(flatten)]
        common: Common,
        /// OLD=NEW,... GPU indices or UUIDs (GPU-xxxxxxxx-...); needs driver >= 580.
        #[arg(long, value_name = "OLD=NEW,...")]
        device_map: Option<String>,
    },
    /// LOCKED -> RUNNING.
    Unlock(Common),
    /// RUNNING -> CHECKPOINTED (lock + checkpoint) or CHECKPOINTED -> RUNNING (restore + unlock).
    Toggle {
        #[command(flatten)]
        common: Common,
        /// Lock timeout in milliseconds when toggling a running process.
        #[arg(long, value_name = "MS")]
        timeout: Option<u64>,
        #[arg(long, value_name = "OLD=NEW,...")]
        device_map: Option<String>,
    },
    /// Print the thread id of the CUDA restore thread inside the process.
    RestoreTid(Common),
}

/// One driver call and how long it took.
#[derive(Serialize, Debug)]
struct Call {
    op: Op,
    ok: bool,
    ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

#[derive(Serialize, Debug)]
struct Report {
    pid: i32,
    backend: GpuBackend,
    #[serde(skip_serializing_if = "Option::is_none")]
    driver_version: Option<String>,
    action: &'static str,
    ok: bool,
    /// The state after the action (a separate, timed query).
    #[serde(skip_serializing_if = "Option::is_none")]
    state: Option<ProcessState>,
    #[serde(skip_serializing_if = "Option::is_none")]
    restore_tid: Option<i32>,
    calls: Vec<Call>,
    /// cuda-driver only: dlopen, symbol resolution and cuInit times.
    #[serde(skip_serializing_if = "Option::is_none")]
    setup: Option<freeze::SetupTimings>,
    open_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl Report {
    fn got_state(&mut self, state: &ProcessState) {
        self.state = Some(*state);
    }

    fn got_tid(&mut self, tid: &i32) {
        self.restore_tid = Some(*tid);
    }
}

struct Session {
    driver: std::sync::Arc<dyn GpuDriver>,
    report: Report,
}

impl Session {
    fn open(c: &Common, action: &'static str) -> super::Result<Self> {
        if c.pid <= 0 {
            return Err(super::usage(format!(
                "--pid {} is not a process id (a CUDA checkpoint acts on one process)",
                c.pid
            )));
        }
        let t = Instant::now();
        let backend = c.gpu_backend;
        let driver = freeze::open(backend)?;
        let open_ms = t.elapsed().as_secs_f64() * 1000.0;
        let mut s = Session {
            driver,
            report: Report {
                pid: c.pid,
                backend,
                driver_version: None,
                action,
                ok: false,
                state: None,
                restore_tid: None,
                calls: Vec::new(),
                setup: None,
                open_ms,
                error: None,
            },
        };
        s.report.backend = s.driver().backend();
        s.report.driver_version = s.driver().driver_version();
        tracing::info!(
            "backend {} ({}) opened in {open_ms:.1} ms",
            s.report.backend,
            s.report
                .driver_version
                .as_deref()
                .unwrap_or("version unknown")
        );
        freeze::ensure_process(c.pid)?;
        Ok(s)
    }

    fn driver(&self) -> &dyn GpuDriver {
        self.driver.as_ref()
    }

    /// Runs and times one driver call.
    fn call<T>(
        &mut self,
        op: Op,
        f: impl FnOnce(&dyn GpuDriver) -> freeze::Result<T>,
    ) -> freeze::Result<T> {
        let t = Instant::now();
        let r = f(self.driver());
        let ms = t.elapsed().as_secs_f64() * 1000.0;
        tracing::info!(
            "{op} of pid {}: {} in {ms:.3} ms",
            self.report.pid,
            if r.is_ok() { "ok" } else { "failed" }
        );
        self.report.calls.push(Call {
            op,
            ok: r.is_ok(),
            ms,
            error: r.as_ref().err().map(|e| e.to_string()),
        });
        r
    }

    fn pairs(&mut self, map: Option<&str>) -> super::Result<Vec<GpuPair>> {
        let Some(map) = map else {
            return Ok(Vec::new());
        };
        let map: DeviceMap = map.parse()?;
        // Indices need this node's GPU list; UUIDs do not (so no NVML needed for them).
        let needs_list = map
            .0
            .iter()
            .any(|(a, b)| matches!(a, DeviceRef::Index(_)) || matches!(b, DeviceRef::Index(_)));
        let gpus = if needs_list {
            self.driver().gpus().map_err(|e| {
                super::Failure::from(e)
                    .context("listing this node's GPUs to resolve --device-map indices")
            })?
        } else {
            Vec::new()
        };
        Ok(map.resolve(&gpus, &gpus)?)
    }

    fn finish(mut self, format: Format, result: freeze::Result<()>) -> super::Result<()> {
        self.report.setup = self.driver.setup_timings();
        self.report.ok = result.is_ok();
        if result.is_ok() && self.report.state.is_none() && self.report.action != "restore-tid" {
            let pid = self.report.pid;
            self.report.state = self.call(Op::State, |d| d.state(pid)).ok();
        }
        self.report.error = result.as_ref().err().map(|e| e.to_string());
        match format {
            Format::Json => super::print_json(&self.report)?,
            Format::Text => {
                if self.report.action == "state" {
                    if let Some(s) = self.report.state {
                        println!("{s}");
                    }
                } else if let Some(tid) = self.report.restore_tid {
                    println!("{tid}");
                }
                let total: f64 = self.report.calls.iter().map(|c| c.ms).sum();
                tracing::info!("driver calls took {total:.3} ms in all");
            }
        }
        result.map_err(Into::into)
    }
}

fn timeout(ms: Option<u64>) -> Option<Duration> {
    ms.filter(|&m| m > 0).map(Duration::from_millis)
}

pub fn run(cmd: Command) -> super::Result<()> {
    match cmd {
        Command::State(c) => {
            let state = |d: &dyn GpuDriver| d.state(c.pid);
            ask(&c, "state", Op::State, state, Report::got_state)
        }
        Command::Lock {
            common: c,
            timeout: t,
        } => single(&c, "lock", Op::Lock, |d| d.lock(c.pid, timeout(t))),
        Command::Checkpoint(c) => single(&c, "checkpoint", Op::Checkpoint, |d| d.checkpoint(c.pid)),
        Command::Restore {
            common: c,
            device_map,
        } => {
            let mut s = Session::open(&c, "restore")?;
            let pairs = s.pairs(device_map.as_deref())?;
            let r = s.call(Op::Restore, |d| d.restore(c.pid, &pairs));
            s.finish(c.format, r)
        }
        Command::Unlock(c) => single(&c, "unlock", Op::Unlock, |d| d.unlock(c.pid)),
        Command::RestoreTid(c) => {
            let tid = |d: &dyn GpuDriver| d.restore_thread_id(c.pid);
            ask(&c, "restore-tid", Op::RestoreTid, tid, Report::got_tid)
        }
        Command::Toggle {
            common: c,
            timeout: t,
            device_map,
        } => {
            let mut s = Session::open(&c, "toggle")?;
            let pairs = s.pairs(device_map.as_deref())?;
            let r = toggle(&mut s, c.pid, timeout(t), &pairs);
            s.finish(c.format, r)
        }
    }
}

/// A command that is one call `f` of the driver, reported as `action`.
fn single(
    c: &Common,
    action: &'static str,
    op: Op,
    f: impl FnOnce(&dyn GpuDriver) -> freeze::Result<()>,
) -> super::Result<()> {
    ask(c, action, op, f, |_, _| {})
}

/// [`single`] for a query: the report keeps what `keep` takes of the answer.
fn ask<T>(
    c: &Common,
    action: &'static str,
    op: Op,
    f: impl FnOnce(&dyn GpuDriver) -> freeze::Result<T>,
    keep: impl FnOnce(&mut Report, &T),
) -> super::Result<()> {
    let mut s = Session::open(c, action)?;
    let r = s.call(op, f);
    if let Ok(v) = &r {
        keep(&mut s.report, v);
    }
    s.finish(c.format, r.map(drop))
}

/// RUNNING -> CHECKPOINTED or CHECKPOINTED -> RUNNING; a failure half-way is undone.
fn toggle(
    s: &mut Session,
    pid: i32,
    timeout: Option<Duration>,
    pairs: &[GpuPair],
) -> freeze::Result<()> {
    match s.call(Op::State, |d| d.state(pid))? {
        ProcessState::Running => {
            s.call(Op::Lock, |d| d.lock(pid, timeout))?;
            if let Err(e) = s.call(Op::Checkpoint, |d| d.checkpoint(pid)) {
                // Keep the process running: this is where NVIDIA's utility leaves it locked.
                if let Err(u) = s.call(Op::Unlock, |d| d.unlock(pid)) {
                    return Err(freeze::Error::Many(vec![e, u]));
                }
                return Err(e);
            }
            Ok(())
        }
        ProcessState::Checkpointed => {
            s.call(Op::Restore, |d| d.restore(pid, pairs))?;
            s.call(Op::Unlock, |d| d.unlock(pid))
        }
        other => Err(freeze::Error::Cuda {
            op: Op::State,
            pid,
            code: freeze::CuError::IllegalState,
            detail: Some(format!(
                "toggle needs a running or checkpointed process; it is {other} (use `cuda unlock` or `cuda restore`)"
            )),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_timeouts_parse() {
        assert_eq!(
            parse_timeout("10s"),
            Ok(Timeout(Some(Duration::from_secs(10))))
        );
        assert_eq!(
            parse_timeout("250ms"),
            Ok(Timeout(Some(Duration::from_millis(250))))
        );
        assert_eq!(
            parse_timeout("1.5"),
            Ok(Timeout(Some(Duration::from_millis(1500))))
        );
        assert_eq!(parse_timeout("0"), Ok(Timeout(None)));
        assert!(parse_timeout("-1s").is_err());
        assert!(parse_timeout("soon").is_err());
        // humantime's forms, and a value too large for a Duration (a panic before humantime).
        assert_eq!(
            parse_timeout("2m 30s"),
            Ok(Timeout(Some(Duration::from_secs(150))))
        );
        assert!(parse_timeout("99999999999999999999s").is_err());
    }
}
