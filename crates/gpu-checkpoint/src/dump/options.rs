//! The CRIU options of a dump or restore: what users of CRIU, runc and Podman pass (`--file-locks`,
//! `--ghost-limit`, `--external`, ...), how each reaches CRIU (the RPC's `criu_opts`, or the command line
//! for a streamed dump or restore), and which of them a restore needs again.
//!
//! One [`CriuOptions`] serves both directions: the checkpoint records it in its manifest, and the restore
//! derives its own from that record ([`CriuOptions::restore_options`]), because CRIU needs several of them
//! on both sides (`--file-locks` restores the locks only when given again; `--tcp-close` must be) while
//! others mean something only to the dump. Every field exists in the RPC of rust-criu 0.6 (CRIU's
//! `rpc.proto`), so nothing here needs CRIU's configuration file; `config_file` passes one for the rest.

use std::path::{Path, PathBuf};

use rust_criu::rust_criu_protobuf::rpc;
use serde::{Deserialize, Serialize};

use crate::detect::finding::NeededOption;

/// CRIU's default limit for the contents of a deleted file it copies into the images (`--ghost-limit`).
pub const DEFAULT_GHOST_LIMIT: u64 = 1 << 20;

/// How CRIU handles the tree's cgroups (`--manage-cgroups[=MODE]`); the names are CRIU's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[derive(strum::EnumString, strum::IntoStaticStr, strum::Display, strum::VariantArray)]
#[strum(serialize_all = "lowercase")]
pub enum CgroupMode {
    None,
    Props,
    Soft,
    Full,
    Strict,
    Ignore,
}

/// How CRIU keeps the network quiet while it works on TCP connections (`--network-lock`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[derive(strum::EnumString, strum::IntoStaticStr, strum::Display, strum::VariantArray)]
#[strum(serialize_all = "lowercase")]
pub enum NetworkLock {
    Iptables,
    Nftables,
    Skip,
}

impl NetworkLock {
    /// The method used when none is given: `GPU_CHECKPOINT_NETWORK_LOCK`, else nftables. CRIU's RPC would
    /// default to iptables, an external command many hosts lack; nftables goes through the libnftables
    /// the project's CRIU carries.
    pub fn default_method() -> NetworkLock {
        std::env::var("GPU_CHECKPOINT_NETWORK_LOCK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(NetworkLock::Nftables)
    }
}

/// The CRIU options of a dump (as the checkpoint records them) or of a restore. The JSON names are the
/// manifest's `options` (fields are only ever added; a missing one reads as its default).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CriuOptions {
    /// Established TCP connections are dumped and restored (`--tcp-established`).
    pub tcp_established: bool,
    /// The tree is a shell job: its session/terminal belong to someone else (`--shell-job`).
    pub shell_job: bool,
    /// File locks (POSIX, OFD, flock) are dumped and restored (`--file-locks`).
    pub file_locks: bool,
    /// Largest deleted file whose contents CRIU copies into the images, in bytes (`--ghost-limit`; CRIU's
    /// default is [`DEFAULT_GHOST_LIMIT`]).
    pub ghost_limit: Option<u32>,
    /// UNIX datagram sockets connected to a named socket outside the tree are allowed (`--ext-unix-sk`).
    pub ext_unix_sk: bool,
    /// External resources, in CRIU's `--external` syntax (`mnt[PATH]:KEY`, `unix[INO]`, `net[INO]:KEY`,
    /// `file[MNT:INO]`, ...): the dump's on a checkpoint, the restore's own on a restore.
    pub external: Vec<String>,
    /// TCP connections still being set up are left out (`--skip-in-flight`).
    pub skip_in_flight: bool,
    /// Deleted files that still have a name elsewhere are linked back (`--link-remap`).
    pub link_remap: bool,
    /// `--manage-cgroups=MODE`; `None`: CRIU's default.
    pub manage_cgroups: Option<CgroupMode>,
    /// `--network-lock`; `None`: [`NetworkLock::default_method`] where CRIU locks the network at all.
    pub network_lock: Option<NetworkLock>,
    /// TCP connections are restored closed (`--tcp-close`; CRIU needs it on restore when the dump had it).
    pub tcp_close: bool,
    /// Mount points left out of the dump (`--skip-mnt`).
    pub skip_mnt: Vec<String>,
    /// Mounts with a master outside the tree are allowed (`--enable-external-masters`).
    pub enable_external_masters: bool,
    /// A CRIU configuration file, CRIU's own format (`--criu-config`, the RPC's `config_file`).
    pub config_file: Option<PathBuf>,
}

/// What a restore is given: the options CRIU needs, and what the user should hear about the flags they
/// passed that the checkpoint decides already.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreOptions {
    pub options: CriuOptions,
    /// The flags given to the restore that the checkpoint decides already (with the same value).
    pub decided: Vec<String>,
    /// Remarks for the user (a checkpoint taken with a configuration file the restore was not given).
    pub notes: Vec<String>,
}

/// Parses a size the way CRIU's `--ghost-limit` does: bytes, or a number with `K`, `M` or `G` (powers of
/// 1024; `KiB`, `MB` and lower case are accepted too). It must fit CRIU's RPC field (32 bits).
pub fn parse_size(s: &str) -> Result<u32, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("expected a size such as 4M, 512K or 1048576, got '{s}'"))?;
    let unit = unit.trim().to_ascii_lowercase();
    let shift = match unit.trim_end_matches("ib").trim_end_matches('b') {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        _ => return Err(format!("unknown size unit in '{s}' (use K, M or G)")),
    };
    n.checked_shl(shift)
        .filter(|b| b >> shift == n)
        .and_then(|b| u32::try_from(b).ok())
        .ok_or_else(|| format!("'{s}' is too large: CRIU takes at most 4294967295 bytes"))
}

/// `2M`, `1536K` or `1000`: the shortest exact way to write `bytes` for `--ghost-limit`.
pub fn format_size(bytes: u64) -> String {
    for (shift, unit) in [(30, "G"), (20, "M"), (10, "K")] {
        if bytes != 0 && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

impl CriuOptions {
    /// True when these options give CRIU what `need` says a process needs.
    pub fn provides(&self, need: &NeededOption) -> bool {
        match need {
            NeededOption::FileLocks => self.file_locks,
            NeededOption::GhostLimit { bytes } => {
                self.ghost_limit.map_or(DEFAULT_GHOST_LIMIT, u64::from) >= *bytes
            }
            // Closing them on restore is CRIU's other way to dump established connections.
            NeededOption::TcpEstablished => self.tcp_established || self.tcp_close,
            NeededOption::ExtUnixSk { inode } => {
                self.ext_unix_sk || self.external.contains(&format!("unix[{inode}]"))
            }
            NeededOption::External { resource } => self.external.contains(resource),
            NeededOption::ShellJob => self.shell_job,
        }
    }

    /// These options with what CRIU's configuration files add to them, as far as this type names it: CRIU
    /// reads `/etc/criu/default.conf`, `~/.criu/default.conf`, `$CRIU_CONFIG_FILE` and then `config_file`
    /// itself, so an option given there is given (a checkpoint must not refuse a tree for a `file-locks`
    /// that CRIU will get from a file).
    pub fn with_config_files(&self) -> CriuOptions {
        let mut files: Vec<PathBuf> = vec!["/etc/criu/default.conf".into()];
        if let Some(home) = std::env::var_os("HOME") {
            files.push(Path::new(&home).join(".criu/default.conf"));
        }
        if let Some(env) = std::env::var_os("CRIU_CONFIG_FILE") {
            files.push(env.into());
        }
        files.extend(self.config_file.clone());
        let mut out = self.clone();
        for f in files {
            if let Ok(text) = std::fs::read_to_string(&f) {
                out.add_config(&text);
            }
        }
        out
    }

    /// Folds in the options of one CRIU configuration file (one option a line, its dashes optional, its
    /// argument after a space; `#` starts a comment). Options this type does not name are CRIU's alone.
    fn add_config(&mut self, text: &str) {
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            let (name, value) = match line.split_once(char::is_whitespace) {
                Some((n, v)) => (n, Some(v.trim().trim_matches('"'))),
                None => (line, None),
            };
            let name = name.trim_start_matches('-');
            let name = name.split_once('=').map_or(name, |(n, _)| n);
            match (name, value) {
                ("tcp-established", _) => self.tcp_established = true,
                ("shell-job" | "j", _) => self.shell_job = true,
                ("file-locks" | "l", _) => self.file_locks = true,
                ("ext-unix-sk" | "x", _) => self.ext_unix_sk = true,
                ("tcp-close", _) => self.tcp_close = true,
                ("skip-in-flight", _) => self.skip_in_flight = true,
                ("link-remap", _) => self.link_remap = true,
                ("enable-external-masters", _) => self.enable_external_masters = true,
                ("ghost-limit", Some(v)) => self.ghost_limit = parse_size(v).ok(),
                ("external", Some(v)) => self.external.push(v.to_string()),
                ("skip-mnt", Some(v)) => self.skip_mnt.push(v.to_string()),
                ("network-lock", Some(v)) => self.network_lock = v.parse().ok(),
                _ => {}
            }
        }
    }

    /// The options the restore of a checkpoint taken with `self` passes to CRIU, given the flags the user
    /// passed to the restore (`given`). The checkpoint decides every dump-time option: a flag of the
    /// restore that asks for something else is an error naming it, one that agrees is listed in
    /// `decided`. The restore's own are its `--external` (CRIU's restore syntax), `--criu-config`,
    /// `--manage-cgroups` and `--tcp-close` (restore connections closed).
    pub fn restore_options(&self, given: &CriuOptions) -> Result<RestoreOptions, String> {
        let mut decided = Vec::new();
        let mut check = |flag: &str, recorded: Option<String>, asked: Option<String>| {
            match (recorded, asked) {
                (_, None) => Ok(()),
                (r, Some(a)) if r.as_ref() == Some(&a) => {
                    decided.push(flag_text(flag, &a));
                    Ok(())
                }
                (r, Some(a)) => Err(format!(
                    "{} contradicts the checkpoint, taken {}: the setting comes from the checkpoint \
                     (CRIU's images were made with it); drop the flag, or take a new checkpoint with it",
                    flag_text(flag, &a),
                    match r {
                        Some(r) => format!("with {}", flag_text(flag, &r)),
                        None => format!("without {flag}"),
                    }
                )),
            }
        };
        let on = |b: bool| b.then(String::new);
        let list = |v: &[String]| (!v.is_empty()).then(|| v.join(","));
        let r = self;
        check(
            "--tcp-established",
            on(r.tcp_established),
            on(given.tcp_established),
        )?;
        check("--shell-job", on(r.shell_job), on(given.shell_job))?;
        check("--file-locks", on(r.file_locks), on(given.file_locks))?;
        check("--ext-unix-sk", on(r.ext_unix_sk), on(given.ext_unix_sk))?;
        check(
            "--skip-in-flight",
            on(r.skip_in_flight),
            on(given.skip_in_flight),
        )?;
        check("--link-remap", on(r.link_remap), on(given.link_remap))?;
        check(
            "--enable-external-masters",
            on(r.enable_external_masters),
            on(given.enable_external_masters),
        )?;
        let size = |v: Option<u32>| v.map(|b| format_size(b.into()));
        check(
            "--ghost-limit",
            size(r.ghost_limit),
            size(given.ghost_limit),
        )?;
        check("--skip-mnt", list(&r.skip_mnt), list(&given.skip_mnt))?;
        // CRIU reads the lock method from the images; without a recorded one it was the default of the
        // checkpoint's time, which we cannot contradict.
        let lock = |v: Option<NetworkLock>| v.map(|m| m.to_string());
        let mut notes = Vec::new();
        match (r.network_lock, given.network_lock) {
            (Some(_), _) => check("--network-lock", lock(r.network_lock), lock(given.network_lock))?,
            (None, Some(m)) => notes.push(format!(
                "--network-lock {m} changes nothing: CRIU takes the method from the checkpoint's images"
            )),
            (None, None) => {}
        }
        if r.tcp_close && given.tcp_close {
            decided.push("--tcp-close".into());
        }
        if let (Some(f), None) = (&r.config_file, &given.config_file) {
            notes.push(format!(
                "the checkpoint was taken with --criu-config {}; pass --criu-config again if its options \
                 matter to the restore",
                f.display()
            ));
        }
        let options = CriuOptions {
            tcp_established: r.tcp_established,
            shell_job: r.shell_job,
            file_locks: r.file_locks,
            ext_unix_sk: r.ext_unix_sk,
            network_lock: r.network_lock,
            // CRIU refuses a restore without it when the dump had it; on its own it restores the
            // established connections of a checkpoint closed.
            tcp_close: r.tcp_close || given.tcp_close,
            manage_cgroups: given.manage_cgroups.or(r.manage_cgroups),
            external: given.external.clone(),
            config_file: given.config_file.clone(),
            // Dump-only: the images carry their effect.
            ghost_limit: None,
            skip_in_flight: false,
            link_remap: false,
            skip_mnt: Vec::new(),
            enable_external_masters: false,
        };
        Ok(RestoreOptions {
            options,
            decided,
            notes,
        })
    }

    /// The options for CRIU's RPC (`criu_opts`) of a dump or restore.
    pub(super) fn apply_rpc(&self, opts: &mut rpc::Criu_opts) {
        opts.set_shell_job(self.shell_job);
        if self.tcp_established {
            opts.set_tcp_established(true);
        }
        if let Some(lock) = self.network_lock_for() {
            opts.set_network_lock(match lock {
                NetworkLock::Iptables => rpc::Criu_network_lock_method::IPTABLES,
                NetworkLock::Nftables => rpc::Criu_network_lock_method::NFTABLES,
                NetworkLock::Skip => rpc::Criu_network_lock_method::SKIP,
            });
        }
        if self.file_locks {
            opts.set_file_locks(true);
        }
        if let Some(limit) = self.ghost_limit {
            opts.set_ghost_limit(limit);
        }
        if self.ext_unix_sk {
            opts.set_ext_unix_sk(true);
        }
        opts.external = self.external.clone();
        if self.skip_in_flight {
            opts.set_tcp_skip_in_flight(true);
        }
        if self.link_remap {
            opts.set_link_remap(true);
        }
        if let Some(mode) = self.manage_cgroups {
            opts.set_manage_cgroups(mode != CgroupMode::Ignore);
            opts.set_manage_cgroups_mode(match mode {
                CgroupMode::None => rpc::Criu_cg_mode::CG_NONE,
                CgroupMode::Props => rpc::Criu_cg_mode::PROPS,
                CgroupMode::Soft => rpc::Criu_cg_mode::SOFT,
                CgroupMode::Full => rpc::Criu_cg_mode::FULL,
                CgroupMode::Strict => rpc::Criu_cg_mode::STRICT,
                CgroupMode::Ignore => rpc::Criu_cg_mode::IGNORE,
            });
        }
        if self.tcp_close {
            opts.set_tcp_close(true);
        }
        opts.skip_mnt = self.skip_mnt.clone();
        if self.enable_external_masters {
            opts.set_ext_masters(true);
        }
        if let Some(file) = &self.config_file {
            opts.set_config_file(absolute(file).display().to_string());
        }
    }

    /// The same options as `criu dump|restore` arguments (streamed dumps and restores run the command).
    pub(super) fn cli_args(&self) -> Vec<String> {
        let mut args: Vec<String> = Vec::new();
        let mut flag = |on: bool, name: &str| {
            if on {
                args.push(name.into());
            }
        };
        flag(self.shell_job, "--shell-job");
        flag(self.tcp_established, "--tcp-established");
        flag(self.file_locks, "--file-locks");
        flag(self.ext_unix_sk, "--ext-unix-sk");
        flag(self.skip_in_flight, "--skip-in-flight");
        flag(self.link_remap, "--link-remap");
        flag(self.tcp_close, "--tcp-close");
        flag(self.enable_external_masters, "--enable-external-masters");
        if let Some(lock) = self.network_lock_for() {
            args.extend(["--network-lock".into(), lock.to_string()]);
        }
        if let Some(limit) = self.ghost_limit {
            args.extend(["--ghost-limit".into(), limit.to_string()]);
        }
        for e in &self.external {
            args.extend(["--external".into(), e.clone()]);
        }
        if let Some(mode) = self.manage_cgroups {
            args.push(format!("--manage-cgroups={mode}"));
        }
        for m in &self.skip_mnt {
            args.extend(["--skip-mnt".into(), m.clone()]);
        }
        if let Some(file) = &self.config_file {
            args.extend(["--config".into(), absolute(file).display().to_string()]);
        }
        args
    }

    /// The network lock method to pass: the one given, else the default where CRIU locks the network
    /// (established connections) and `config_file` does not name one: CRIU's command line (and RPC) would
    /// override the file's.
    fn network_lock_for(&self) -> Option<NetworkLock> {
        self.network_lock.or_else(|| {
            (self.tcp_established && self.config_file_network_lock().is_none())
                .then(NetworkLock::default_method)
        })
    }

    /// The network lock method `config_file` names, if any.
    /// The network lock method CRIU uses: ours, else the configuration file's, else the default.
    pub fn effective_network_lock(&self) -> NetworkLock {
        self.network_lock
            .or_else(|| self.config_file_network_lock())
            .unwrap_or_else(NetworkLock::default_method)
    }

    pub fn config_file_network_lock(&self) -> Option<NetworkLock> {
        let text = std::fs::read_to_string(self.config_file.as_ref()?).ok()?;
        let mut named = CriuOptions::default();
        named.add_config(&text);
        named.network_lock
    }
}

/// `--flag` or `--flag VALUE`.
fn flag_text(flag: &str, value: &str) -> String {
    if value.is_empty() {
        flag.to_string()
    } else {
        format!("{flag} {value}")
    }
}

/// CRIU resolves a relative path from its own working folder, which is the images folder (not ours).
fn absolute(p: &Path) -> PathBuf {
    std::path::absolute(p).unwrap_or_else(|_| p.to_path_buf())
}

#[cfg(test)]
mod tests;
