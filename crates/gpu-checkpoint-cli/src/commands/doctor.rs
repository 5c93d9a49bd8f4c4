//! `gpu-checkpoint doctor`: what this machine has for checkpointing: CRIU (where, which version, how it
//! was found) and `criu check`'s verdict, the kernel, whether we run as root (and with
//! `CAP_SYS_RESOURCE`, without which CRIU cannot dump other users' processes), and the GPU checkpoint
//! backends (a machine without a GPU is fine: CPU-only trees need none).

use std::path::PathBuf;

use gpu_checkpoint::dump::{discover, Criu, CriuRpc};
use gpu_checkpoint::flows::HostInfo;
use gpu_checkpoint::ExitStatus;
use serde_json::json;

use super::{Exit, Format};

#[derive(clap::Args)]
pub struct Args {
    /// The CRIU binary to check (default: the one checkpoint would use).
    #[arg(long, value_name = "PATH")]
    pub criu: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t)]
    pub format: Format,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let host = HostInfo::current();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let (criu, problem) = match discover(args.criu.as_deref()) {
        Ok(found) => {
            let check = CriuRpc::from_found(&found).check();
            let (verdict, problem) = match &check {
                Ok(c) if c.ok => (json!({"ok": true, "output": c.output}), None),
                Ok(c) => (
                    json!({"ok": false, "output": c.output}),
                    Some("`criu check` failed: this kernel lacks features CRIU needs".to_string()),
                ),
                Err(e) => (
                    json!({"ok": false, "error": e.to_string()}),
                    Some(e.to_string()),
                ),
            };
            (
                json!({
                    "found": true,
                    "path": found.path,
                    "source": found.source,
                    "version": found.version.to_string(),
                    "check": verdict,
                }),
                problem,
            )
        }
        Err(e) => (
            json!({"found": false, "error": e.to_string()}),
            Some(e.to_string()),
        ),
    };
    // Not being root also makes `criu check` fail: say the cause, not the symptom.
    let problem = if criu["found"] == json!(true) && !root {
        Some("not running as root: checkpoint and restore need root".to_string())
    } else {
        problem
    };
    // What `criu check` does not look at ("Looks good." all the same), but checkpoints meet.
    let mut warnings = Vec::new();
    let cap_sys_resource = gpu_checkpoint::detect::limits::has_cap_sys_resource();
    if root && !cap_sys_resource {
        warnings.push(
            "no CAP_SYS_RESOURCE (a container that drops it): CRIU cannot read the resource limits of \
             another user's process (\"Can't get rlimit\"), so trees with processes of other users (nginx \
             or PostgreSQL workers, anything that drops privileges) cannot be checkpointed here; \
             checkpoint refuses them before touching them. Grant it (--cap-add SYS_RESOURCE) to \
             checkpoint them"
                .to_string(),
        );
    }
    let report = json!({
        "host": host,
        "root": root,
        "cap_sys_resource": cap_sys_resource,
        "warnings": warnings,
        "criu": criu,
        // How `restore` moves memory by default: through userfaultfd when it is there, else streamed.
        "userfaultfd": gpu_checkpoint::restore::uffd_available(),
        "huge_pages": huge_pages(),
        "gpu": gpu_checkpoint::freeze::probe(),
        "ok": problem.is_none(),
    });
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Text => print_text(&report),
    }
    match problem {
        None => Ok(()),
        Some(p) => {
            let status = if criu["found"] == json!(false) {
                ExitStatus::ToolMissing
            } else if !root {
                ExitStatus::PermissionDenied
            } else {
                ExitStatus::Failure
            };
            Err(Exit(status, p).into())
        }
    }
}

/// Transparent huge pages: the mode, and what copying into fresh memory costs here with 4 KiB pages and
/// with huge pages (the CUDA driver stages device memory in the process's anonymous memory: on an H200,
/// `always` made its checkpoint 1.4-1.6x faster than `madvise`, docs/hardware.md).
fn huge_pages() -> serde_json::Value {
    use gpu_checkpoint::thp;
    let (small, huge) = thp::copy_speed(64 << 20);
    json!({
        "mode": thp::mode().map(thp::Mode::as_str),
        "defrag": thp::defrag(),
        "size": thp::huge_page_size(),
        "copy_gb_per_s_4k": (small * 100.0).round() / 100.0,
        "copy_gb_per_s_huge": huge.map(|h| (h * 100.0).round() / 100.0),
    })
}

fn print_text(r: &serde_json::Value) {
    let s = |v: &serde_json::Value| v.as_str().unwrap_or("?").to_string();
    println!(
        "host        {} (kernel {}, {})",
        s(&r["host"]["hostname"]),
        s(&r["host"]["kernel"]),
        s(&r["host"]["arch"])
    );
    println!(
        "root        {}",
        if r["root"] == json!(true) {
            "yes"
        } else {
            "no"
        }
    );
    let c = &r["criu"];
    if c["found"] == json!(true) {
        println!(
            "criu        {} (version {}, found via {})",
            s(&c["path"]),
            s(&c["version"]),
            s(&c["source"])
        );
        let check = &c["check"];
        let verdict = if check["ok"] == json!(true) {
            "ok"
        } else {
            "FAILED"
        };
        let limited = r["warnings"].as_array().is_some_and(|w| !w.is_empty());
        println!(
            "criu check  {verdict}{}",
            if limited && check["ok"] == json!(true) {
                " (what criu check does not look at: see the warnings below)"
            } else {
                ""
            }
        );
        let text = check["output"]
            .as_str()
            .or(check["error"].as_str())
            .unwrap_or("");
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            println!("            {line}");
        }
    } else {
        println!("criu        not found: {}", s(&c["error"]));
    }
    println!(
        "userfaultfd {}",
        if r["userfaultfd"] == json!(true) {
            "yes (restore copies memory straight into the processes)"
        } else {
            "no (restore streams memory to CRIU: about 2x slower)"
        }
    );
    let h = &r["huge_pages"];
    let speed = match (h["copy_gb_per_s_4k"].as_f64(), h["copy_gb_per_s_huge"].as_f64()) {
        (Some(s4), Some(sh)) if s4 > 0.0 => format!(
            "copying into fresh memory here: {s4:.1} GB/s in 4 KiB pages, {sh:.1} GB/s in huge pages ({:.2}x)",
            sh / s4
        ),
        (Some(s4), _) => format!("copying into fresh memory here: {s4:.1} GB/s in 4 KiB pages"),
        _ => String::new(),
    };
    let advice = match h["mode"].as_str() {
        Some("always") => "a GPU driver's staging memory is in huge pages",
        Some("madvise") => {
            "a GPU driver's staging memory is in 4 KiB pages: with `always` an H200's driver checkpoint \
             was 1.4-1.6x faster (echo always > /sys/kernel/mm/transparent_hugepage/enabled)"
        }
        Some(_) => "huge pages are off: a GPU driver's copies run on 4 KiB pages",
        None => "no transparent huge pages in this kernel",
    };
    println!(
        "huge pages  {} (defrag {}): {advice}; {speed}",
        s(&h["mode"]),
        s(&h["defrag"])
    );
    let g = &r["gpu"];
    match (&g["cuda_driver"], &g["cuda_driver_error"]) {
        (serde_json::Value::String(v), _) => {
            println!(
                "cuda-driver {v} (checkpoint API in libcuda; argument layout {}; {})",
                s(&g["cuda_layout"]),
                g["cuda_capabilities"]
                    .as_array()
                    .map(|c| c.iter().map(s).collect::<Vec<_>>().join(", "))
                    .unwrap_or_default()
            )
        }
        (_, e) => println!("cuda-driver unavailable: {}", s(e)),
    }
    match g["cuda_cli"].as_str() {
        Some(p) => println!("cuda-cli    {p}"),
        None => println!("cuda-cli    no cuda-checkpoint on PATH"),
    }
    if let Some(d) = g["nvml_driver"].as_str() {
        println!("driver      {d}");
    }
    for gpu in g["gpus"].as_array().into_iter().flatten() {
        println!(
            "gpu {}       {} {} ({} bytes)",
            gpu["index"],
            s(&gpu["model"]),
            s(&gpu["uuid"]),
            gpu["memory_bytes"]
        );
    }
    println!(
        "gpu backend auto -> {}",
        g["auto"]
            .as_str()
            .unwrap_or("none (CPU-only checkpoints work; GPU trees need a driver >= 550)")
    );
    for w in r["warnings"].as_array().into_iter().flatten() {
        println!("warning     {}", s(w));
    }
}
