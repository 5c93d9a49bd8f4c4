//! Whether a process holding NVIDIA device files has a CUDA context, told by what /proc shows.
//!
//! The driver cannot tell: on driver 580 a process without a context (nvidia-smi, an NVML agent, a child
//! forked without exec from a CUDA process) answers the state query with RUNNING and accepts a lock
//! (docs/hardware.md). Its maps can: a context maps `/dev/nvidiactl` many times (27 mappings, 70 MiB in
//! every real capture under `tests/fixtures/real/`), besides `/dev/nvidia0` and the driver's 2 MiB
//! `/dev/nvidia-uvm` range. An NVML client maps at most a page of `/dev/nvidiactl` (nvidia-smi: one 4 KiB
//! page; `pynvml`: none), and a child forked without exec keeps only the parent's `/dev/nvidiaN`
//! mappings (the driver marks the rest do-not-fork).

use super::finding::{Finding, FindingKind};

/// More `/dev/nvidiactl` mappings than this make a CUDA context (a context makes about 27; an NVML
/// client at most one).
pub const CONTEXT_CTL_MAPPINGS: u32 = 4;

/// Whether `findings` (one process's) show a CUDA context: many `/dev/nvidiactl` mappings, or NVML
/// listing the process as a compute process (only processes with a context are listed).
pub fn has_cuda_context<'a>(findings: impl IntoIterator<Item = &'a Finding>) -> bool {
    findings.into_iter().any(|f| match f.kind {
        FindingKind::DeviceMapping => {
            f.evidence.path.as_deref() == Some("/dev/nvidiactl")
                && f.evidence.mappings.unwrap_or(1) > CONTEXT_CTL_MAPPINGS
        }
        FindingKind::Nvml => f.evidence.library.is_none(),
        _ => false,
    })
}

/// What a process without a CUDA context maps of the NVIDIA devices, by what can be done about it.
#[derive(Debug, Default, PartialEq)]
pub struct ContextlessMappings<'a> {
    /// Mappings of `/dev/nvidiactl` (an NVML client's page): its state lives in the driver, behind a
    /// client the restored process will not have; refused.
    pub control: Vec<&'a Finding>,
    /// Mappings of `/dev/nvidiaN` or `/dev/nvidia-uvm` (what a child forked without exec keeps of its
    /// parent's context): the child cannot use them (the context is the parent's); replaced on restore
    /// by zeroed shared memory at the same addresses.
    pub inherited: Vec<&'a Finding>,
}

/// Sorts the NVIDIA `device-mapping` findings of a process without a context (`findings` are its own).
pub fn contextless_mappings<'a>(
    findings: impl IntoIterator<Item = &'a Finding>,
) -> ContextlessMappings<'a> {
    let mut out = ContextlessMappings::default();
    for f in findings {
        if f.kind != FindingKind::DeviceMapping || f.evidence.simulated {
            continue;
        }
        match f.evidence.path.as_deref() {
            Some("/dev/nvidiactl") => out.control.push(f),
            Some(p) if is_replaceable_node(p) => out.inherited.push(f),
            _ => {}
        }
    }
    out
}

/// The nodes whose mappings a forked child keeps (shared with the CRIU plugin, which replaces them).
pub use gpu_checkpoint_device_records::is_replaceable_node;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::Evidence;

    fn mapping(path: &str, mappings: u32) -> Finding {
        Finding {
            kind: FindingKind::DeviceMapping,
            pid: 1,
            evidence: Evidence {
                path: Some(path.into()),
                mappings: Some(mappings),
                ..Default::default()
            },
        }
    }

    #[test]
    fn a_context_maps_the_control_device_many_times() {
        assert!(has_cuda_context(&[mapping("/dev/nvidiactl", 27)]));
        // nvidia-smi: one page; a forked child: only the parent's /dev/nvidia0 windows.
        assert!(!has_cuda_context(&[mapping("/dev/nvidiactl", 1)]));
        assert!(!has_cuda_context(&[mapping("/dev/nvidia0", 2)]));
        assert!(!has_cuda_context(&[mapping("/dev/nvidia-uvm", 1)]));
        let listed = Finding {
            kind: FindingKind::Nvml,
            pid: 1,
            evidence: Evidence {
                gpu: Some(0),
                ..Default::default()
            },
        };
        assert!(has_cuda_context(&[listed]));
    }

    #[test]
    fn contextless_mappings_are_sorted_by_what_can_be_done() {
        let f = [
            mapping("/dev/nvidiactl", 1),
            mapping("/dev/nvidia0", 2),
            mapping("/dev/nvidia-uvm", 1),
            mapping("/dev/nvidia-caps/nvidia-cap1", 1),
        ];
        let m = contextless_mappings(&f);
        assert_eq!(m.control, [&f[0]]);
        assert_eq!(m.inherited, [&f[1], &f[2]]);
        assert!(is_replaceable_node("/dev/nvidia12"));
        assert!(!is_replaceable_node("/dev/nvidiactl"));
        assert!(!is_replaceable_node("/dev/nvidia-modeset"));
    }
}
