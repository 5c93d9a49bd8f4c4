//! The strategies detect weighs for a scope, why each was or was not chosen, and a strategy forced by the
//! user (`checkpoint --strategy`), refused with a reason where the report says it cannot work.

use serde::{Deserialize, Serialize};

use super::report::{Considered, Report};
use super::strategy::{StrategyName, MIN_DRIVER_API, MIN_DRIVER_CLI};

/// What `checkpoint --strategy` asks for. Users script against these names.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
#[derive(strum::IntoStaticStr, strum::Display, strum::VariantArray, strum::EnumString)]
#[strum(serialize_all = "kebab-case")]
pub enum StrategyChoice {
    /// What detect decides.
    #[default]
    Auto,
    /// CRIU alone.
    None,
    /// The CUDA driver API, in-process.
    CudaDriver,
    /// NVIDIA's `cuda-checkpoint` binary.
    CudaCli,
    /// Never: asked for only to be told why (the seeds proposed it as a fallback).
    BarSliding,
}

/// Why `--strategy bar-sliding` is refused, and what to do instead (docs/gpu.md has the details).
pub const BAR_SLIDING: &str = "\"BAR sliding\" (moving the BAR0 PRAMIN window across VRAM) cannot \
     checkpoint a process: it reads raw physical VRAM at MB/s while racing the driver, is disabled on \
     GH100's coherent path, and cannot restore anything, because page tables, channels, engine contexts and \
     driver objects are re-created by a new driver instance at other placements. Use --strategy auto (the \
     CUDA driver's own checkpoint, driver >= 570) and free what it cannot save (managed memory, IPC before \
     driver 610, MIG, MPS) first; see docs/gpu.md";

/// Facts about a report's processes that the reasons quote.
struct Facts {
    nvidia: usize,
    /// Processes holding NVIDIA device files without a CUDA context.
    contextless: usize,
    simulated: usize,
    amd: usize,
    driver: Option<u32>,
}

impl Facts {
    fn of(r: &Report) -> Facts {
        let count =
            |f: &dyn Fn(&super::ProcessReport) -> bool| r.processes.iter().filter(|p| f(p)).count();
        let gpu = |p: &super::ProcessReport| {
            matches!(
                p.strategy,
                StrategyName::CudaDriver | StrategyName::CudaCli | StrategyName::Unsupported
            ) && r.findings_of(p.pid).any(|f| f.is_nvidia_state())
        };
        let contextless = |p: &super::ProcessReport| {
            p.strategy == StrategyName::None && r.findings_of(p.pid).any(|f| f.is_nvidia_state())
        };
        Facts {
            nvidia: count(&|p| !p.simulated && gpu(p)),
            contextless: count(&contextless),
            simulated: count(&|p| p.simulated),
            amd: count(&|p| p.strategy == StrategyName::Amdgpu),
            driver: r
                .driver_version
                .as_deref()
                .and_then(super::parse::driver_major),
        }
    }
}

/// The strategies detect weighed for `r`, the chosen one marked.
pub fn considered(r: &Report) -> Vec<Considered> {
    let f = Facts::of(r);
    let chosen = r.strategy.name;
    let blocked = chosen == StrategyName::Unsupported;
    let one = |s: &str, is: bool, why: String| Considered {
        strategy: s.into(),
        chosen: is,
        why,
    };
    let gpu_procs = f.nvidia + f.simulated + f.amd;
    let none_why = if gpu_procs == 0 && !blocked && f.contextless > 0 {
        format!(
            "no process holds a CUDA context: CRIU alone dumps the tree; the NVIDIA device files {} \
             process(es) hold without one are reopened on restore (docs/criu.md)",
            f.contextless
        )
    } else if gpu_procs == 0 && !blocked {
        "no process holds GPU state: CRIU alone dumps the tree".to_string()
    } else if gpu_procs == 0 {
        "CRIU alone cannot dump what the blockers name".to_string()
    } else {
        format!("{gpu_procs} process(es) hold GPU state, which CRIU alone cannot save")
    };
    let nvidia_why = |api: bool| -> String {
        if blocked {
            return "blocked: see the blockers".into();
        }
        if f.nvidia + f.simulated == 0 {
            return "no NVIDIA GPU state".into();
        }
        if f.simulated > 0 && f.nvidia == 0 {
            return if api {
                "SIMULATED GPU processes: the simulator speaks the driver API".into()
            } else {
                "cuda-checkpoint cannot drive the SIMULATED GPU".into()
            };
        }
        match (api, f.driver) {
            (true, Some(d)) if d < MIN_DRIVER_API => {
                format!(
                    "driver {d} has no in-process checkpoint API ({MIN_DRIVER_API} is the first)"
                )
            }
            (true, Some(d)) => format!("driver {d} has the in-process API: no process per call"),
            (true, None) => {
                "driver version unknown: the API is checked before the tree is touched".into()
            }
            (false, Some(d)) if (MIN_DRIVER_CLI..MIN_DRIVER_API).contains(&d) => {
                format!("driver {d} (550-569) has only the cuda-checkpoint binary")
            }
            (false, _) => "the in-process API does the same without a process per call \
                           (cuda-checkpoint is for drivers 550-569; --strategy cuda-cli forces it)"
                .into(),
        }
    };
    vec![
        one("none", chosen == StrategyName::None, none_why),
        one(
            "cuda-driver",
            chosen == StrategyName::CudaDriver,
            nvidia_why(true),
        ),
        one(
            "cuda-cli",
            chosen == StrategyName::CudaCli,
            nvidia_why(false),
        ),
        one(
            "amdgpu",
            chosen == StrategyName::Amdgpu,
            if f.amd > 0 {
                "AMD GPU state (/dev/kfd): CRIU's amdgpu plugin (checkpoints refuse it for now)"
                    .into()
            } else {
                "no AMD GPU state".into()
            },
        ),
        one(
            "bar-sliding",
            false,
            "never: reading VRAM through the BAR0 window cannot restore a process (docs/gpu.md)"
                .into(),
        ),
    ]
}

/// Whether `choice` can work for the scope `r` describes: the strategy to use (`None` for auto: the
/// report's), or why not.
pub fn check(choice: StrategyChoice, r: &Report) -> Result<Option<StrategyName>, String> {
    let f = Facts::of(r);
    let decided = r.strategy.name;
    match choice {
        StrategyChoice::Auto => Ok(None),
        StrategyChoice::BarSliding => Err(BAR_SLIDING.into()),
        StrategyChoice::None if decided == StrategyName::None => Ok(Some(StrategyName::None)),
        StrategyChoice::None => Err(format!(
            "the tree holds GPU state (detect says {decided}): CRIU alone would fail on its device \
             files or lose its device memory; use --strategy auto"
        )),
        _ if decided == StrategyName::Unsupported => {
            Err("detect refuses the tree: see the blockers".into())
        }
        _ if f.nvidia + f.simulated == 0 => Err(format!(
            "no NVIDIA GPU state in the tree (detect says {decided}): nothing for {choice} to \
             checkpoint; use --strategy auto"
        )),
        StrategyChoice::CudaDriver => match f.driver {
            Some(d) if d < MIN_DRIVER_API => Err(format!(
                "driver {d} has no in-process checkpoint API ({MIN_DRIVER_API} is the first); use \
                 --strategy cuda-cli"
            )),
            _ => Ok(Some(StrategyName::CudaDriver)),
        },
        StrategyChoice::CudaCli if f.simulated > 0 => {
            Err("cuda-checkpoint cannot drive SIMULATED GPU processes".into())
        }
        StrategyChoice::CudaCli => Ok(Some(StrategyName::CudaCli)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn report(strategy: &str, simulated: bool, nvidia: bool, driver: Option<&str>) -> Report {
        let findings = if nvidia {
            vec![json!({"kind": "device-mapping", "pid": 1,
                        "evidence": {"detail": "x", "path": "/dev/nvidia0", "mappings": 3}})]
        } else {
            vec![]
        };
        serde_json::from_value(json!({
            "schema_version": 1, "pid": 1, "gpu": nvidia || simulated,
            "processes": [{"pid": 1, "comm": "x", "ppid": 0, "strategy": strategy, "simulated": simulated}],
            "findings": findings, "strategy": {"name": strategy, "blockers": []},
            "driver_version": driver, "elapsed_ms": 0.0
        }))
        .unwrap()
    }

    #[test]
    fn bar_sliding_is_always_refused_with_the_reason() {
        let e = check(
            StrategyChoice::BarSliding,
            &report("none", false, false, None),
        )
        .unwrap_err();
        assert!(
            e.contains("cannot restore") && e.contains("--strategy auto"),
            "{e}"
        );
    }

    #[test]
    fn forced_strategies_are_refused_where_they_cannot_work() {
        let cpu = report("none", false, false, None);
        assert_eq!(
            check(StrategyChoice::None, &cpu),
            Ok(Some(StrategyName::None))
        );
        assert!(check(StrategyChoice::CudaDriver, &cpu).is_err());
        let gpu = report("cuda-driver", false, true, Some("580.65.06"));
        assert!(check(StrategyChoice::None, &gpu)
            .unwrap_err()
            .contains("GPU state"));
        assert_eq!(
            check(StrategyChoice::CudaDriver, &gpu),
            Ok(Some(StrategyName::CudaDriver))
        );
        assert_eq!(
            check(StrategyChoice::CudaCli, &gpu),
            Ok(Some(StrategyName::CudaCli))
        );
        let old = report("cuda-cli", false, true, Some("560.35.03"));
        assert!(check(StrategyChoice::CudaDriver, &old)
            .unwrap_err()
            .contains("570"));
        let sim = report("cuda-driver", true, false, None);
        assert!(check(StrategyChoice::CudaCli, &sim)
            .unwrap_err()
            .contains("SIMULATED"));
        assert_eq!(check(StrategyChoice::Auto, &sim), Ok(None));
    }

    #[test]
    fn every_strategy_is_listed_with_a_reason_and_one_is_chosen() {
        let gpu = report("cuda-driver", false, true, Some("580.65.06"));
        let c = considered(&gpu);
        let names: Vec<&str> = c.iter().map(|c| c.strategy.as_str()).collect();
        assert_eq!(
            names,
            ["none", "cuda-driver", "cuda-cli", "amdgpu", "bar-sliding"]
        );
        assert_eq!(c.iter().filter(|c| c.chosen).count(), 1);
        assert!(c[1].chosen && c[1].why.contains("580"), "{c:?}");
        assert!(c[0].why.contains("1 process"), "{c:?}");
        assert!(c[2].why.contains("550-569"), "{c:?}");
        let cpu = considered(&report("none", false, false, None));
        assert!(cpu[0].chosen);
        assert_eq!(cpu[1].why, "no NVIDIA GPU state");
    }
}
