//! `gpu-checkpoint detect`: find the GPU state of a process (tree) or of the whole node, and say how it
//! can be checkpointed. The library does the work; this file parses arguments and prints.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use gpu_checkpoint::detect::{self, DetectOptions, FindingKind, Report, StrategyName};
use gpu_checkpoint::fmt::human_bytes;

use super::Format;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["pid", "all", "container"])))]
pub struct Args {
    /// The process to inspect.
    #[arg(long, value_name = "PID", value_parser = clap::value_parser!(i32).range(1..))]
    pub pid: Option<i32>,

    /// Include every descendant of --pid (checkpoints act on process trees).
    #[arg(long, requires = "pid")]
    pub tree: bool,

    /// Every process on this node that holds GPU state (NVML when present, and a /proc scan).
    #[arg(long, conflicts_with_all = ["pid", "tree"])]
    pub all: bool,

    /// Every process of a container (its id in `--runtime`): those sharing its cgroups, GPU processes
    /// by NVML when present and /proc otherwise. JSON: `{"container": {...}, "report": REPORT}`.
    #[arg(long, value_name = "ID", conflicts_with_all = ["pid", "all", "tree"])]
    pub container: Option<String>,
    #[command(flatten)]
    pub runtime: super::container::RuntimeArgs,

    /// Output format. JSON is stable (schema_version 1) and documented in docs/detect.md.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,

    /// Show everything in the text report: every finding with its evidence, blockers, notes.
    #[arg(long)]
    pub verbose: bool,

    /// Read a /proc tree captured with scripts/capture-proc.sh instead of this machine's /proc.
    #[arg(long, value_name = "DIR", default_value = "/proc")]
    pub proc_root: PathBuf,

    /// Recognise the GPU simulator's devices. For tests and demos only: it is never a real GPU.
    #[arg(long)]
    pub simulator: bool,
}

pub fn run(args: Args) -> super::Result<()> {
    let opts = DetectOptions {
        proc_root: args.proc_root.clone(),
        tree: args.tree,
        // NVML costs a driver attach (tens of ms or more): ask it for the node-wide view, where it finds
        // processes /proc cannot attribute; a single pid's /proc is authoritative.
        nvml: args.all,
        simulator: args.simulator,
    };
    if let Some(id) = &args.container {
        let (about, report) = super::container::detect(&args.runtime, id, args.simulator)?;
        match args.format {
            Format::Json => {
                super::print_json(&serde_json::json!({"container": about, "report": report}))?
            }
            Format::Text => {
                println!(
                    "container {id} ({}, {}): {} process(es)",
                    about["runtime"].as_str().unwrap_or_default(),
                    about["status"].as_str().unwrap_or_default(),
                    about["processes"].as_array().map_or(0, Vec::len)
                );
                print!("{}", render_text(&report, args.verbose));
            }
        }
        return Ok(());
    }
    let report = match args.pid {
        Some(pid) => detect::detect_pid(pid, &opts),
        None => detect::detect_all(&opts),
    }?;
    for note in &report.notes {
        tracing::info!("{note}");
    }
    match args.format {
        Format::Json => super::print_json(&report)?,
        Format::Text => {
            print!("{}", render_text(&report, args.verbose));
            // What would checkpoint this tree's GPU state here: only for the live /proc (a captured tree
            // comes from another machine, whose driver this one says nothing about).
            let live = args.proc_root == std::path::Path::new("/proc");
            let nvidia = report
                .processes
                .iter()
                .any(|p| matches!(p.strategy, StrategyName::CudaDriver | StrategyName::CudaCli));
            if live && nvidia {
                println!("{}", driver_here());
            }
        }
    }
    Ok(())
}

/// The CUDA checkpoint API this machine offers: version, argument layout, capabilities (as `doctor`).
fn driver_here() -> String {
    use gpu_checkpoint::freeze::{cuda_driver::CudaDriver, GpuDriver};
    match CudaDriver::open() {
        Ok(d) => format!(
            "driver here: {} (argument layout {}; {})",
            d.driver_version().unwrap_or_default(),
            d.layout().name(),
            d.capabilities().join(", ")
        ),
        Err(e) => format!("driver here: the in-process checkpoint API is not available: {e}"),
    }
}

fn strategy_meaning(name: StrategyName, simulated: bool) -> &'static str {
    match name {
        StrategyName::None => "no GPU state: CRIU alone",
        StrategyName::CudaDriver if simulated => "CUDA driver checkpoint API (simulated GPU)",
        StrategyName::CudaDriver => "CUDA driver checkpoint API, in process (driver >= 570)",
        StrategyName::CudaCli => "the cuda-checkpoint binary (drivers 550-569)",
        StrategyName::Amdgpu => "CRIU's amdgpu plugin",
        StrategyName::Unsupported => "cannot be checkpointed safely; see the blockers",
    }
}

/// A short human report; everything with `verbose`.
pub fn render_text(r: &Report, verbose: bool) -> String {
    let mut s = String::new();
    let scope = match r.pid {
        Some(pid) if r.processes.len() > 1 => {
            format!("pid {pid} and {} descendant(s)", r.processes.len() - 1)
        }
        Some(pid) => format!("pid {pid}"),
        None => format!(
            "{} process(es) with GPU state on this node",
            r.processes.len()
        ),
    };
    let _ = writeln!(
        s,
        "{scope}: strategy {} ({})",
        r.strategy.name,
        strategy_meaning(r.strategy.name, r.simulated())
    );
    for b in &r.strategy.blockers {
        let _ = writeln!(s, "  blocker {} (pid {}): {}", b.kind, b.pid, b.message);
        let _ = writeln!(s, "    remedy: {}", b.remedy);
    }
    for c in &r.strategies {
        let verdict = if c.chosen { "chosen" } else { "not chosen" };
        let _ = writeln!(s, "  strategy {:<11} {verdict}: {}", c.strategy, c.why);
    }
    if r.ordered {
        let _ = writeln!(
            s,
            "  order: processes share CUDA IPC memory: the GPU step locks them one after another, root \
             first, and restores and unlocks them in the same order (checkpoint does so by itself)"
        );
    }
    // Not blockers, but a checkpoint without the flag is refused: say so whatever the verbosity.
    for f in r
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::NeedsOption)
    {
        if let Some(need) = &f.evidence.needs {
            let _ = writeln!(
                s,
                "  needs {} (pid {}): {}",
                need.flag(),
                f.pid,
                f.evidence.detail
            );
        }
    }
    // Not blockers of the GPU strategy, but a checkpoint is refused: say so whatever the verbosity.
    for f in r
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::CannotDump)
    {
        let limit = f.evidence.limit.map_or("?", <&str>::from);
        let _ = writeln!(
            s,
            "  cannot dump {limit} (pid {}): {}\n    remedy: {}",
            f.pid,
            f.evidence.detail,
            f.evidence.remedy.as_deref().unwrap_or("")
        );
    }
    // What a checkpoint does about a forked child's windows onto its parent's CUDA context.
    for m in r.inherited_mappings() {
        let _ = writeln!(
            s,
            "  replaces (pid {}): {} mapping(s) of {} inherited across fork without a CUDA context ({}): \
             zeroed shared memory there after a restore",
            m.pid,
            m.ranges.len(),
            m.path,
            m.ranges.join(", ")
        );
    }
    for p in &r.processes {
        let mut line = format!(
            "  {:>7} {:<15} {:<11} {}",
            p.pid,
            p.comm,
            p.strategy.as_str(),
            summarize(r, p.pid)
        );
        if p.simulated {
            line.push_str(" (simulated GPU)");
        }
        let _ = writeln!(s, "{}", line.trim_end());
        if verbose {
            let _ = writeln!(s, "          ppid {}", p.ppid);
            if let Some(cg) = &p.cgroup {
                let _ = writeln!(
                    s,
                    "          cgroup {cg}{}",
                    p.container_id
                        .as_ref()
                        .map(|c| format!(" (container {c})"))
                        .unwrap_or_default()
                );
            }
            if !p.nspid.is_empty() {
                let _ = writeln!(s, "          pid in nested namespaces: {:?}", p.nspid);
            }
            for f in r.findings_of(p.pid) {
                let _ = writeln!(
                    s,
                    "          {:<15} {}{}",
                    f.kind.as_str(),
                    f.evidence.detail,
                    if f.evidence.simulated {
                        " [simulated]"
                    } else {
                        ""
                    }
                );
            }
        }
    }
    let driver = r.driver_version.as_deref().unwrap_or("unknown");
    let _ = writeln!(
        s,
        "NVIDIA driver {driver}; GPU state in scope: {}; {:.2} ms",
        if r.gpu { "yes" } else { "no" },
        r.elapsed_ms
    );
    if verbose {
        for n in &r.notes {
            let _ = writeln!(s, "note: {n}");
        }
    } else if !r.findings.is_empty() {
        let _ = writeln!(s, "(--verbose shows every finding and its evidence)");
    }
    s
}

/// `nvidia-ctl, nvidia-device x2, device-mapping 1.1 GiB, cuda-library` for one process.
fn summarize(r: &Report, pid: i32) -> String {
    let mut by_kind: BTreeMap<FindingKind, (usize, u64)> = BTreeMap::new();
    for f in r.findings_of(pid) {
        let e = by_kind.entry(f.kind).or_default();
        e.0 += 1;
        if f.evidence.mappings.is_some() {
            e.1 += f.evidence.size.unwrap_or(0);
        }
    }
    if by_kind.is_empty() {
        return "no GPU state".to_string();
    }
    by_kind
        .into_iter()
        .map(|(k, (n, bytes))| {
            let mut t = k.as_str().to_string();
            if n > 1 {
                let _ = write!(t, " x{n}");
            }
            if bytes > 0 {
                let _ = write!(t, " {}", human_bytes(bytes));
            }
            t
        })
        .collect::<Vec<_>>()
        .join(", ")
}
