//! The CRIU options `checkpoint` and `restore` share, named as CRIU, runc and Podman name them. A
//! checkpoint records them in its manifest; a restore takes the dump-time ones from there (given again
//! they must agree: scripts written for plain CRIU pass them on both sides) and adds its own.

use std::path::PathBuf;

use gpu_checkpoint::dump::options::parse_size;
use gpu_checkpoint::dump::{CgroupMode, CriuOptions, NetworkLock};

use super::usage;

#[derive(clap::Args, Debug, Default)]
#[command(next_help_heading = "CRIU options (a restore takes the checkpoint's; see docs/criu.md)")]
pub struct CriuArgs {
    /// Checkpoint established TCP connections (CRIU's --tcp-established).
    #[arg(long)]
    pub tcp_established: bool,
    /// The tree was started from a shell and shares its terminal/session (CRIU's --shell-job).
    #[arg(long)]
    pub shell_job: bool,
    /// Checkpoint and restore file locks (POSIX, OFD, flock): an SQLite database, a pid file.
    #[arg(long)]
    pub file_locks: bool,
    /// Largest deleted-but-open file whose contents go into the checkpoint (4M, 512K, bytes; CRIU's
    /// default 1M).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub ghost_limit: Option<u32>,
    /// Allow UNIX datagram sockets connected to a named socket outside the tree (/dev/log).
    #[arg(long)]
    pub ext_unix_sk: bool,
    /// An external resource, CRIU's --external syntax (`mnt[PATH]:KEY`, `unix[INO]`, `net[INO]:KEY`,
    /// `file[MNT:INO]`, ...); repeatable. A restore takes its own (CRIU's restore syntax).
    #[arg(long, value_name = "RES")]
    pub external: Vec<String>,
    /// Leave out TCP connections still being set up.
    #[arg(long)]
    pub skip_in_flight: bool,
    /// Link deleted files that still have another name back instead of failing.
    #[arg(long)]
    pub link_remap: bool,
    /// How CRIU handles the tree's cgroups: none, props, soft (alone), full, strict, ignore.
    #[arg(long, value_name = "MODE", num_args = 0..=1, require_equals = true,
          default_missing_value = "soft", value_parser = parse_enum::<CgroupMode>)]
    pub manage_cgroups: Option<CgroupMode>,
    /// How CRIU keeps the network quiet around TCP connections: iptables, nftables (default), skip.
    #[arg(long, value_name = "METHOD", value_parser = parse_enum::<NetworkLock>)]
    pub network_lock: Option<NetworkLock>,
    /// Restore TCP connections closed (and checkpoint them without their state).
    #[arg(long)]
    pub tcp_close: bool,
    /// A mount point to leave out of the checkpoint; repeatable.
    #[arg(long, value_name = "PATH")]
    pub skip_mnt: Vec<String>,
    /// Allow mounts whose master is outside the tree.
    #[arg(long)]
    pub enable_external_masters: bool,
    /// A CRIU configuration file (CRIU's own format: one option a line, without the dashes) for options
    /// without a flag here; each command takes its own.
    #[arg(long, value_name = "FILE")]
    pub criu_config: Option<PathBuf>,
}

/// Any of the library's option enums, by CRIU's name.
fn parse_enum<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr + strum::VariantArray + std::fmt::Display,
{
    s.parse().map_err(|_| {
        let names: Vec<String> = T::VARIANTS.iter().map(|v| v.to_string()).collect();
        format!("expected one of {}", names.join(", "))
    })
}

impl CriuArgs {
    /// The library's options; a configuration file that is not there is a usage error here rather than
    /// CRIU's after the tree was frozen.
    pub fn options(&self) -> super::Result<CriuOptions> {
        let config_file = match &self.criu_config {
            Some(f) if !f.is_file() => {
                return Err(usage(format!(
                    "--criu-config {}: no such file",
                    f.display()
                )))
            }
            Some(f) => Some(std::path::absolute(f).map_err(super::Failure::other)?),
            None => None,
        };
        Ok(CriuOptions {
            tcp_established: self.tcp_established,
            shell_job: self.shell_job,
            file_locks: self.file_locks,
            ghost_limit: self.ghost_limit,
            ext_unix_sk: self.ext_unix_sk,
            external: self.external.clone(),
            skip_in_flight: self.skip_in_flight,
            link_remap: self.link_remap,
            manage_cgroups: self.manage_cgroups,
            network_lock: self.network_lock,
            tcp_close: self.tcp_close,
            skip_mnt: self.skip_mnt.clone(),
            enable_external_masters: self.enable_external_masters,
            config_file,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        criu: CriuArgs,
    }

    fn parse(args: &[&str]) -> Result<CriuOptions, String> {
        let mut v = vec!["x"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v)
            .map_err(|e| e.to_string())
            .and_then(|c| c.criu.options().map_err(|e| e.to_string()))
    }

    #[test]
    fn criu_flags_parse_as_criu_spells_them() {
        let o = parse(&[
            "--file-locks",
            "--ghost-limit",
            "4M",
            "--ext-unix-sk",
            "--external",
            "mnt[/data]:data",
            "--external",
            "unix[42]",
            "--skip-in-flight",
            "--link-remap",
            "--manage-cgroups",
            "--network-lock",
            "skip",
            "--tcp-close",
            "--skip-mnt",
            "/proc/sys",
            "--enable-external-masters",
            "--tcp-established",
            "--shell-job",
        ])
        .unwrap();
        assert!(o.file_locks && o.ext_unix_sk && o.skip_in_flight && o.link_remap);
        assert!(o.tcp_close && o.enable_external_masters && o.tcp_established && o.shell_job);
        assert_eq!(o.ghost_limit, Some(4 << 20));
        assert_eq!(o.external, ["mnt[/data]:data", "unix[42]"]);
        assert_eq!(o.manage_cgroups, Some(CgroupMode::Soft), "no value: soft");
        assert_eq!(o.network_lock, Some(NetworkLock::Skip));
        assert_eq!(o.skip_mnt, ["/proc/sys"]);

        assert_eq!(
            parse(&["--manage-cgroups=strict"]).unwrap().manage_cgroups,
            Some(CgroupMode::Strict)
        );
        assert_eq!(
            parse(&["--ghost-limit", "512K"]).unwrap().ghost_limit,
            Some(512 << 10)
        );
        assert_eq!(
            parse(&["--ghost-limit", "1048576"]).unwrap().ghost_limit,
            Some(1 << 20)
        );
        for bad in [
            &["--ghost-limit", "lots"][..],
            &["--manage-cgroups=sometimes"],
            &["--network-lock", "ufw"],
            &["--criu-config", "/nonexistent/criu.conf"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
        let err = parse(&["--network-lock", "ufw"]).unwrap_err();
        assert!(err.contains("iptables, nftables, skip"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("criu.conf");
        std::fs::write(&conf, "file-locks\n").unwrap();
        let o = parse(&["--criu-config", conf.to_str().unwrap()]).unwrap();
        assert_eq!(o.config_file.as_deref(), Some(conf.as_path()));
        assert_eq!(parse(&[]).unwrap(), CriuOptions::default());
    }
}
