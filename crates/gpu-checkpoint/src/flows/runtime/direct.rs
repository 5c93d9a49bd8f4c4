//! What runc's own checkpoint would tell CRIU about a container, read from runc's state: the settings
//! with which the container flow drives CRIU directly (`flows/container/direct.rs`), so that the images
//! stream into the store (no staged copy) and `runc restore` still restores them.
//!
//! runc 1.1's `checkpoint` (libcontainer's `Checkpoint`, read in runc's sources) tells CRIU: the
//! container's init PID and root file system; every bind mount, the `/sys/fs/cgroup/*` bind mounts of a
//! cgroup v1 host without a cgroup namespace, every masked file (named `/dev/null`) and every device node
//! as an external mount, keyed by its path in the container (its restore maps the same keys back); the
//! freezer cgroup; the network namespace dumped empty (runc does not manage interfaces); a network or PID
//! namespace the container joined by path as external (`net[INODE]:extRootNetNS`); `--manage-cgroups`;
//! the CRIU configuration file of the `org.criu.config` annotation (default `/etc/criu/runc.conf`). It
//! writes the init's standard descriptors (`external_descriptors` of its state) as `descriptors.json`
//! next to the images, which its restore reads. All of it comes from runc's state file
//! (`ROOT/ID/state.json`), where runc keeps the container's configuration.
//!
//! Not taken over: runc's own network configuration (`config.networks` other than loopback: runc locks
//! and unlocks it around the dump through CRIU's notifications, which a streamed dump cannot answer):
//! refused with the advice to let runc checkpoint (`--runtime-checkpoint`).

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::Error;
use crate::dump::{CgroupMode, ContainerDump, CriuOptions, NetworkLock};

/// The name runc's restore reads the init's standard descriptors from, in the images folder.
pub const DESCRIPTORS: &str = "descriptors.json";

/// Where runc keeps its default CRIU configuration file (used when the container names none).
const RUNC_CRIU_CONFIG: &str = "/etc/criu/runc.conf";

/// What a direct dump of a container needs: CRIU's settings and options, and the files written next to
/// the images for the runtime's restore.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DirectDump {
    pub settings: ContainerDump,
    /// CRIU options of the container (external namespaces, cgroups, configuration file); the flow adds
    /// the user's (`--tcp-established`).
    pub options: CriuOptions,
    /// Files written into the images folder: (name, contents).
    pub files: Vec<(String, Vec<u8>)>,
}

/// The part of runc's `state.json` a dump needs (runc 1.1's field names).
#[derive(Debug, Deserialize)]
struct RuncState {
    config: RuncConfig,
    #[serde(default)]
    cgroup_paths: HashMap<String, String>,
    /// `null` when runc recorded none: written back as it is.
    #[serde(default)]
    external_descriptors: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
struct RuncConfig {
    rootfs: PathBuf,
    // A missing `Option` is `None` (serde's rule for `Option` fields).
    mounts: Option<Vec<RuncMount>>,
    mask_paths: Option<Vec<String>>,
    devices: Option<Vec<RuncDevice>>,
    namespaces: Option<Vec<RuncNamespace>>,
    networks: Option<Vec<RuncNetwork>>,
    labels: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
struct RuncMount {
    #[serde(default)]
    device: String,
    destination: String,
}

#[derive(Debug, Deserialize)]
struct RuncDevice {
    path: String,
}

#[derive(Debug, Deserialize)]
struct RuncNamespace {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: String,
}

#[derive(Debug, Deserialize)]
struct RuncNetwork {
    #[serde(rename = "type", default)]
    kind: String,
}

/// Reads the dump settings of runc container `id` (state folder `state_dir`, init `init` on the host).
pub fn runc_settings(id: &str, state_dir: &Path, init: i32) -> Result<DirectDump, Error> {
    let path = state_dir.join("state.json");
    let unreadable = |e: &dyn std::fmt::Display| Error::Protocol {
        runtime: "runc".into(),
        reason: format!(
            "its state {} cannot be read ({e}); --runtime-checkpoint lets runc dump the container",
            path.display()
        ),
    };
    let text = std::fs::read(&path).map_err(|e| unreadable(&e))?;
    let state: RuncState = serde_json::from_slice(&text).map_err(|e| unreadable(&e))?;
    from_state(id, &state, Path::new(&format!("/proc/{init}")))
}

/// The settings from a parsed state; `proc` is the init's `/proc/PID` (its root and mounts).
fn from_state(id: &str, state: &RuncState, proc: &Path) -> Result<DirectDump, Error> {
    let config = &state.config;
    if let Some(n) = config
        .networks
        .iter()
        .flatten()
        .find(|n| n.kind != "loopback")
    {
        return Err(Error::Unsupported {
            id: id.into(),
            reason: format!(
                "runc configures its network itself (a {:?} interface), which it detaches and attaches around its own dump; let runc checkpoint it: --runtime-checkpoint",
                n.kind
            ),
        });
    }
    let namespaces = config.namespaces.as_deref().unwrap_or_default();
    let has_ns = |kind: &str| namespaces.iter().any(|n| n.kind == kind);
    let mut ext_mounts = Vec::new();
    // Recorded under its own path, the key runc's restore maps to the mount's source.
    let same = |ext: &mut Vec<(String, String)>, dest: &str| {
        let d = clean(dest);
        ext.push((d.clone(), d));
    };
    for m in config.mounts.iter().flatten() {
        match m.device.as_str() {
            "bind" => same(&mut ext_mounts, &m.destination),
            // On cgroup v1 without a cgroup namespace runc bind-mounts each hierarchy of the host under
            // the destination: the container's own mount table names them.
            "cgroup" if !cgroup2_unified() && !has_ns("NEWCGROUP") => {
                for p in cgroup_mounts_under(proc, &clean(&m.destination)) {
                    same(&mut ext_mounts, &p);
                }
            }
            _ => {}
        }
    }
    // A masked file is /dev/null bound over it; a masked folder is an empty tmpfs of the container's.
    for p in config.mask_paths.iter().flatten() {
        let inside = proc.join("root").join(p.trim_start_matches('/'));
        if std::fs::metadata(&inside).is_ok_and(|m| !m.is_dir()) {
            ext_mounts.push((clean(p), "/dev/null".into()));
        }
    }
    for d in config.devices.iter().flatten() {
        same(&mut ext_mounts, &d.path);
    }
    let mut options = CriuOptions {
        manage_cgroups: Some(CgroupMode::Soft),
        ..CriuOptions::default()
    };
    for (kind, name) in [("NEWNET", "net"), ("NEWPID", "pid")] {
        let Some(ns) = namespaces
            .iter()
            .find(|n| n.kind == kind && !n.path.is_empty())
        else {
            continue;
        };
        let ino = std::fs::metadata(&ns.path)
            .map_err(|e| Error::Protocol {
                runtime: "runc".into(),
                reason: format!("the container's {name} namespace {}: {e}", ns.path),
            })?
            .ino();
        let key = format!("extRoot{}{}NS", name[..1].to_uppercase(), &name[1..]);
        options.external.push(format!("{name}[{ino}]:{key}"));
    }
    let annotation = config
        .labels
        .iter()
        .flatten()
        .find_map(|l| l.strip_prefix("org.criu.config="));
    options.config_file = match annotation {
        Some("") => None,
        Some(file) => Some(file.into()),
        None => Some(PathBuf::from(RUNC_CRIU_CONFIG)),
    }
    // CRIU's command line refuses a configuration file that is not there (its RPC ignores it).
    .filter(|p| p.is_file());
    // runc leaves the lock method to CRIU's RPC default, iptables, or to the configuration file where it
    // names one: so does the direct dump (our own default is nftables; a method on CRIU's command line
    // would override the file's).
    if options.config_file_network_lock().is_none() {
        options.network_lock = Some(NetworkLock::Iptables);
    }
    let freeze_cgroup = state
        .cgroup_paths
        .get("freezer")
        .or_else(|| state.cgroup_paths.get("").filter(|_| cgroup2_unified()))
        .map(PathBuf::from);
    let descriptors =
        serde_json::to_vec(&state.external_descriptors).map_err(|e| Error::Protocol {
            runtime: "runc".into(),
            reason: format!("encoding {DESCRIPTORS}: {e}"),
        })?;
    Ok(DirectDump {
        settings: ContainerDump {
            root: config.rootfs.clone(),
            freeze_cgroup,
            ext_mounts,
            empty_net_ns: true,
        },
        options,
        files: vec![(DESCRIPTORS.into(), descriptors)],
    })
}

/// A mount destination as runc keys it: absolute, without `.`/`..`/double or trailing slashes.
fn clean(dest: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in dest.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

/// The host's cgroups are cgroup v2 only.
fn cgroup2_unified() -> bool {
    Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

/// The cgroup (v1) mount points directly under `dir` in the mount table of the process at `proc`, as
/// that process sees them.
fn cgroup_mounts_under(proc: &Path, dir: &str) -> Vec<String> {
    let info = std::fs::read_to_string(proc.join("mountinfo")).unwrap_or_default();
    info.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            (right.split(' ').next() == Some("cgroup")).then_some(left.split(' ').nth(4)?)
        })
        .filter(|p| Path::new(p).parent() == Some(Path::new(dir)))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(extra: serde_json::Value) -> RuncState {
        let mut v = serde_json::json!({
            "config": {
                "rootfs": "/b/rootfs",
                "mounts": [
                    {"device": "proc", "source": "proc", "destination": "/proc"},
                    {"device": "bind", "source": "/data", "destination": "/mnt/data/"},
                ],
                "mask_paths": ["/proc/self/status", "/proc/no-such-file", "/proc/self"],
                "devices": [{"path": "/dev/null"}],
                "namespaces": [{"type": "NEWNET", "path": ""}, {"type": "NEWPID", "path": "/proc/self/ns/pid"}],
                "networks": [{"type": "loopback"}],
                "labels": ["bundle=/b"],
            },
            "cgroup_paths": {"freezer": "/sys/fs/cgroup/freezer/c1"},
            "external_descriptors": ["/dev/null", "pipe:[123]", "/dev/null"],
        });
        if let (Some(o), Some(e)) = (v["config"].as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn runcs_settings_come_from_its_state() {
        let d = from_state("c1", &state(serde_json::json!({})), Path::new("/proc/self")).unwrap();
        assert_eq!(d.settings.root, Path::new("/b/rootfs"));
        assert_eq!(
            d.settings.freeze_cgroup.as_deref(),
            Some(Path::new("/sys/fs/cgroup/freezer/c1"))
        );
        assert!(d.settings.empty_net_ns);
        let ext = &d.settings.ext_mounts;
        assert!(
            ext.contains(&("/mnt/data".into(), "/mnt/data".into())),
            "{ext:?}"
        );
        // A masked file that exists is named /dev/null; a missing one and a folder are left out.
        assert!(ext.contains(&("/proc/self/status".into(), "/dev/null".into())));
        assert!(!ext
            .iter()
            .any(|(k, _)| k == "/proc/no-such-file" || k == "/proc/self"));
        assert!(ext.contains(&("/dev/null".into(), "/dev/null".into())));
        // The PID namespace joined by path is external, under runc's key; the net one is its own.
        let ino = std::fs::metadata("/proc/self/ns/pid").unwrap().ino();
        assert_eq!(d.options.external, [format!("pid[{ino}]:extRootPidNS")]);
        assert_eq!(d.options.manage_cgroups, Some(CgroupMode::Soft));
        assert_eq!(d.options.network_lock, Some(NetworkLock::Iptables));
        assert_eq!(d.files[0].0, DESCRIPTORS);
        assert_eq!(d.files[0].1, br#"["/dev/null","pipe:[123]","/dev/null"]"#);
    }

    #[test]
    fn runcs_own_network_configuration_is_refused() {
        let s = state(serde_json::json!({"networks": [{"type": "loopback"}, {"type": "veth"}]}));
        let e = from_state("c1", &s, Path::new("/proc/self")).unwrap_err();
        assert!(e.to_string().contains("--runtime-checkpoint"), "{e}");
    }

    #[test]
    fn a_criu_configuration_annotation_is_used_and_an_empty_one_means_none() {
        let file = std::env::current_exe().unwrap();
        let label = format!("org.criu.config={}", file.display());
        let d = from_state(
            "c1",
            &state(serde_json::json!({ "labels": [label] })),
            Path::new("/proc/self"),
        )
        .unwrap();
        assert_eq!(d.options.config_file.as_deref(), Some(file.as_path()));
        // The file (this test binary) names no lock method: runc's RPC default.
        assert_eq!(d.options.network_lock, Some(NetworkLock::Iptables));
        let conf = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(conf.path(), "# ours\n--network-lock skip\n").unwrap();
        let label = format!("org.criu.config={}", conf.path().display());
        let s = state(serde_json::json!({ "labels": [label] }));
        let d = from_state("c1", &s, Path::new("/proc/self")).unwrap();
        assert_eq!(d.options.network_lock, None, "the file decides");
        let s = state(serde_json::json!({"labels": ["org.criu.config="]}));
        let d = from_state("c1", &s, Path::new("/proc/self")).unwrap();
        assert_eq!(d.options.config_file, None);
    }

    #[test]
    fn a_missing_or_foreign_state_is_a_clear_error_naming_the_fallback() {
        let dir = tempfile::tempdir().unwrap();
        let e = runc_settings("c1", dir.path(), 1).unwrap_err();
        assert!(e.to_string().contains("--runtime-checkpoint"), "{e}");
        std::fs::write(dir.path().join("state.json"), br#"{"config": {}}"#).unwrap();
        let e = runc_settings("c1", dir.path(), 1).unwrap_err();
        assert!(e.to_string().contains("rootfs"), "{e}");
    }

    #[test]
    fn destinations_are_cleaned_like_runcs() {
        assert_eq!(clean("/a//b/./c/"), "/a/b/c");
        assert_eq!(clean("a/../b"), "/b");
    }
}
