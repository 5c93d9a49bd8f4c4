//! The command line, parsed by clap. Its own module because the interface is a contract: the CLI's tests,
//! the docs and scripts start the simulator with these flags, so every flag, default and the exit status
//! 2 on bad arguments stay as they were when the parser was hand-written.

use std::collections::BTreeSet;

use clap::Parser;

/// A SIMULATED GPU process for gpu-checkpoint tests and demos (not a real GPU): device memory in
/// /dev/shm/gpu-checkpoint-sim/, the driver's checkpoint state machine on the control socket
/// @gpu-checkpoint-sim/PID, and fault injection.
#[derive(Parser, Debug)]
// A flag given twice keeps its last value (the hand-written parser did that; clap refuses by default).
#[command(name = "gpu-sim-workload", args_override_self = true)]
pub struct Options {
    /// Simulated GPUs (1-16).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub devices: usize,
    /// Device memory per GPU, in MiB (at least 1).
    #[arg(long, value_name = "M", default_value_t = 8)]
    pub mib: usize,
    /// Worker threads running kernels (1-64).
    #[arg(long, value_name = "W", default_value_t = 2)]
    pub workers: usize,
    /// Run time of one kernel, in microseconds (a lock waits for the kernels in flight).
    #[arg(long, value_name = "U", default_value_t = 200)]
    pub kernel_us: u64,
    /// More simulated GPU processes, forked: a process tree.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub children: usize,
    /// Children with no GPU at all.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub cpu_children: usize,
    /// Children like --no-context.
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub idle_children: usize,
    /// Answer like a process that loaded libcuda but made no context: no device memory, NOT_INITIALIZED.
    #[arg(long)]
    pub no_context: bool,
    /// Detach (fork + setsid); prints the PID once the process is ready.
    #[arg(long)]
    pub daemon: bool,
    /// Write the PID of the root simulated GPU process (the one --daemon prints) to PATH.
    // Hyphen values: the hand-written parser took whatever followed as the value.
    #[arg(long, value_name = "PATH", allow_hyphen_values = true)]
    pub pidfile: Option<String>,
    /// With --daemon: append stdout and stderr to PATH (default: /dev/null).
    #[arg(long, value_name = "PATH", allow_hyphen_values = true)]
    pub log: Option<String>,
    /// This process's rank in a lockstep job (with --peers).
    #[arg(long, value_name = "R", default_value_t = 0)]
    pub rank: usize,
    /// Compute in lockstep with the other ranks of a job: every rank's TCP address (HOST:PORT, rank
    /// order, this rank listens on its own); needs --workers 1.
    #[arg(long, value_name = "ADDRS", value_delimiter = ',')]
    pub peers: Vec<String>,
    /// Faults to inject, repeatable, names separated by commas or spaces: lock-timeout, checkpoint,
    /// restore, restore-oom (also from GPU_SIM_FAULTS, and the file named by GPU_SIM_FAULT_FILE).
    #[arg(long = "fault", value_name = "NAMES", allow_hyphen_values = true)]
    fault_args: Vec<String>,
    /// Faults from `GPU_SIM_FAULTS` and every `--fault`.
    #[arg(skip)]
    pub faults: BTreeSet<String>,
}

impl Options {
    /// The options of this process; exits 2 on bad arguments (clap's status for usage errors, and the
    /// hand-written parser's), 0 after `--help`.
    pub fn from_env() -> Self {
        let env_faults = std::env::var("GPU_SIM_FAULTS").ok();
        Self::parse().finish(env_faults.as_deref())
    }

    /// Collects the faults and checks the ranges clap does not.
    fn finish(mut self, env_faults: Option<&str>) -> Self {
        self.faults
            .extend(env_faults.map(fault_names).unwrap_or_default());
        for f in &self.fault_args {
            self.faults.extend(fault_names(f));
        }
        if self.devices == 0
            || self.devices > 16
            || self.mib == 0
            || self.workers == 0
            || self.workers > 64
        {
            crate::fatal("need 1-16 devices, >= 1 MiB each, 1-64 workers");
        }
        if !self.peers.is_empty() && (self.workers != 1 || self.rank >= self.peers.len()) {
            crate::fatal("--peers needs --workers 1 and a --rank below the number of peers");
        }
        self
    }
}

/// Fault names in `s`, separated by commas or white space; `none` names none (so `FAULT none` clears).
pub fn fault_names(s: &str) -> Vec<String> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|f| !f.is_empty() && *f != "none")
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Options::try_parse_from(std::iter::once("gpu-sim-workload").chain(args.iter().copied()))
    }

    #[test]
    fn defaults_are_those_of_the_hand_written_parser() {
        let o = parse(&[]).unwrap().finish(None);
        assert_eq!((o.devices, o.mib, o.workers, o.kernel_us), (1, 8, 2, 200));
        assert_eq!((o.children, o.cpu_children, o.idle_children), (0, 0, 0));
        assert!(!o.no_context && !o.daemon);
        assert_eq!((o.pidfile, o.log), (None, None));
        assert!(o.faults.is_empty());
    }

    #[test]
    fn every_flag_as_the_tests_and_docs_pass_it() {
        let o = parse(&[
            "--daemon",
            "--mib",
            "64",
            "--children",
            "2",
            "--devices",
            "3",
            "--workers",
            "4",
            "--kernel-us",
            "400000",
            "--cpu-children",
            "1",
            "--idle-children",
            "5",
            "--no-context",
            "--pidfile",
            "/tmp/p",
            "--log",
            "/tmp/l",
            "--fault",
            "restore,lock-timeout",
            "--fault",
            "checkpoint",
        ])
        .unwrap()
        .finish(Some("restore-oom none"));
        assert!(o.daemon && o.no_context);
        assert_eq!((o.mib, o.children, o.devices, o.workers), (64, 2, 3, 4));
        assert_eq!(
            (o.kernel_us, o.cpu_children, o.idle_children),
            (400000, 1, 5)
        );
        assert_eq!(o.pidfile.as_deref(), Some("/tmp/p"));
        assert_eq!(o.log.as_deref(), Some("/tmp/l"));
        let faults: Vec<&str> = o.faults.iter().map(String::as_str).collect();
        assert_eq!(
            faults,
            ["checkpoint", "lock-timeout", "restore", "restore-oom"]
        );
    }

    #[test]
    fn a_repeated_flag_keeps_its_last_value() {
        let o = parse(&["--mib", "1", "--mib", "2", "--daemon", "--daemon"]).unwrap();
        assert_eq!(o.mib, 2);
        assert!(o.daemon);
    }

    #[test]
    fn values_may_start_with_a_hyphen_where_they_are_paths() {
        let o = parse(&["--log", "-odd-name", "--fault", "-x"]).unwrap();
        assert_eq!(o.log.as_deref(), Some("-odd-name"));
    }

    #[test]
    fn bad_arguments_are_usage_errors() {
        for bad in [
            &["--mib"][..],
            &["--mib", "x"],
            &["--mib", "-1"],
            &["--bogus"],
            &["stray"],
        ] {
            let e = parse(bad).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
        }
        assert_eq!(parse(&["-h"]).unwrap_err().kind(), ErrorKind::DisplayHelp);
        assert_eq!(parse(&["--help"]).unwrap_err().exit_code(), 0);
    }

    #[test]
    fn fault_names_split_on_commas_and_spaces_and_skip_none() {
        assert_eq!(fault_names(" a,b  c,,none "), ["a", "b", "c"]);
        assert!(fault_names("none").is_empty());
    }
}
