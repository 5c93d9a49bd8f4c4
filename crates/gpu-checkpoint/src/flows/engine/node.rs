//! `gpu-checkpoint node-setup`: what one node needs for the engines' path, and its undo.
//!
//! Written (under `--prefix`, `/` by default):
//! - `usr/local/libexec/gpu-checkpoint/gpu-checkpoint`: a copy of this binary;
//! - `usr/local/libexec/gpu-checkpoint/runc`: the runtime the engine is told to run (a script that runs
//!   the copy as `runtime-wrapper` with the node's configuration);
//! - `usr/local/lib/gpu-checkpoint/criu-plugins/`: an empty folder, CRIU's plugin folder for runc's
//!   CRIU (no cuda plugin acts beside us);
//! - `etc/gpu-checkpoint/node.json`: the node's configuration ([`NodeConfig`]);
//! - `var/log/gpu-checkpoint/`: where the guardian of a wrapper that died says what it put back;
//! - the engine's drop-in: containerd `etc/containerd/conf.d/50-gpu-checkpoint.toml` (runc's
//!   `BinaryName`; containerd 2.1 reads `conf.d` only where its `config.toml` imports it, so an
//!   `imports` line is added to a `config.toml` that has none, and removed by the undo), CRI-O
//!   `etc/crio/crio.conf.d/50-gpu-checkpoint.conf` (`runtime_path`, CRIU support on), podman
//!   `etc/containers/containers.conf.d/50-gpu-checkpoint.conf` (the default runtime).
//!
//! `--host-root DIR` writes under DIR while the files name each other without it (a DaemonSet's pod
//! with the node's root mounted at DIR). The engine reads its drop-in when it restarts.

use std::path::{Path, PathBuf};

use super::{Error, NodeConfig, CONFIG_SCHEMA, CONFIG_VERSION};
use crate::freeze::GpuBackend;

/// The engines `node-setup` configures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, strum::EnumString, strum::Display)]
#[strum(serialize_all = "lowercase")]
pub enum EngineKind {
    Containerd,
    Crio,
    Podman,
}

/// What to set up.
#[derive(Debug, Clone)]
pub struct NodeSetup {
    pub engine: EngineKind,
    /// Where the files go (`/` on a node).
    pub prefix: PathBuf,
    /// Part of `prefix` the files do not name each other with (a pod's mount of the node's root).
    pub host_root: Option<PathBuf>,
    /// This binary, copied into the node.
    pub binary: PathBuf,
    /// The real runc.
    pub runc: PathBuf,
    /// The CRIU runc is given.
    pub criu: Option<PathBuf>,
    pub gpu_backend: GpuBackend,
    pub lock_timeout_ms: Option<u64>,
}

const LIBEXEC: &str = "usr/local/libexec/gpu-checkpoint";
const PLUGINS: &str = "usr/local/lib/gpu-checkpoint/criu-plugins";
const CONFIG: &str = "etc/gpu-checkpoint/node.json";
const GUARDIAN_LOG: &str = "var/log/gpu-checkpoint/guardian.log";
const CONTAINERD_CONFIG: &str = "etc/containerd/config.toml";
/// Where node-setup notes that it added the `imports` line (the undo removes it then only).
const IMPORTS_ADDED: &str = "etc/gpu-checkpoint/containerd-imports-added";

fn drop_in(engine: EngineKind) -> &'static str {
    match engine {
        EngineKind::Containerd => "etc/containerd/conf.d/50-gpu-checkpoint.toml",
        EngineKind::Crio => "etc/crio/crio.conf.d/50-gpu-checkpoint.conf",
        EngineKind::Podman => "etc/containers/containers.conf.d/50-gpu-checkpoint.conf",
    }
}

fn io(what: &Path, e: std::io::Error) -> Error {
    Error::Io(format!("{}: {e}", what.display()))
}

impl NodeSetup {
    /// `rel` under the prefix: where it is written.
    fn at(&self, rel: &str) -> PathBuf {
        self.prefix.join(rel)
    }

    /// `rel` as the files name it (without `host_root`).
    fn named(&self, rel: &str) -> PathBuf {
        let written = self.at(rel);
        match &self.host_root {
            Some(root) => Path::new("/").join(written.strip_prefix(root).unwrap_or(&written)),
            None => written,
        }
    }

    /// The runtime to give the engine.
    pub fn wrapper(&self) -> PathBuf {
        self.named(&format!("{LIBEXEC}/runc"))
    }

    fn engine_drop_in(&self) -> String {
        let wrapper = toml_string(&self.wrapper());
        match self.engine {
            EngineKind::Containerd => format!(
                "# Written by gpu-checkpoint node-setup (docs/kubernetes.md): runc through gpu-checkpoint.\n\
                 version = 3\n\n\
                 [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]\n  \
                 runtime_type = 'io.containerd.runc.v2'\n\n\
                 [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]\n  \
                 BinaryName = {wrapper}\n"
            ),
            EngineKind::Crio => format!(
                "# Written by gpu-checkpoint node-setup (docs/kubernetes.md): runc through gpu-checkpoint.\n\
                 [crio.runtime]\nenable_criu_support = true\n\n\
                 [crio.runtime.runtimes.runc]\nruntime_path = {wrapper}\n"
            ),
            EngineKind::Podman => format!(
                "# Written by gpu-checkpoint node-setup (docs/kubernetes.md): runc through gpu-checkpoint.\n\
                 [engine]\nruntime = \"gpu-checkpoint\"\n\n\
                 [engine.runtimes]\ngpu-checkpoint = [{wrapper}]\n"
            ),
        }
    }

    /// Writes everything (see the module documentation); returns what it did, one line each.
    pub fn install(&self) -> Result<Vec<String>, Error> {
        let mut done = Vec::new();
        if self.runc.file_name().is_some_and(|n| n == "runc")
            && std::fs::read_to_string(&self.runc).is_ok_and(|s| s.contains("runtime-wrapper"))
        {
            return Err(Error::Io(format!(
                "{} is gpu-checkpoint's own wrapper; name the real runc with --runc",
                self.runc.display()
            )));
        }
        let libexec = self.at(LIBEXEC);
        std::fs::create_dir_all(&libexec).map_err(|e| io(&libexec, e))?;
        let binary = self.at(&format!("{LIBEXEC}/gpu-checkpoint"));
        if std::fs::canonicalize(&self.binary).ok() != std::fs::canonicalize(&binary).ok() {
            // Copied beside, then renamed over: a running wrapper keeps its binary.
            let tmp = binary.with_extension("new");
            std::fs::copy(&self.binary, &tmp).map_err(|e| io(&tmp, e))?;
            std::fs::rename(&tmp, &binary).map_err(|e| io(&binary, e))?;
            done.push(format!("installed {}", binary.display()));
        }
        let plugins = self.at(PLUGINS);
        std::fs::create_dir_all(&plugins).map_err(|e| io(&plugins, e))?;
        let logs = self.at(GUARDIAN_LOG);
        if let Some(dir) = logs.parent() {
            crate::util::create_private_dir_all(dir).map_err(|e| io(dir, e))?;
        }
        let config = NodeConfig {
            schema: CONFIG_SCHEMA.into(),
            version: CONFIG_VERSION,
            runtime: self.runc.clone(),
            criu: self.criu.clone(),
            criu_plugins: Some(self.named(PLUGINS)),
            gpu_backend: self.gpu_backend,
            lock_timeout_ms: self.lock_timeout_ms,
            guardian_log: Some(self.named(GUARDIAN_LOG)),
        };
        let config_path = self.at(CONFIG);
        write(
            &config_path,
            &serde_json::to_vec_pretty(&config).map_err(|e| Error::Io(e.to_string()))?,
            0o644,
        )?;
        done.push(format!("wrote {}", config_path.display()));
        let script = format!(
            "#!/bin/sh\n# Written by gpu-checkpoint node-setup (docs/kubernetes.md): runc, with GPU-aware \
             checkpoint and restore.\nexec {} runtime-wrapper --config {} -- \"$@\"\n",
            sh_quote(&self.named(&format!("{LIBEXEC}/gpu-checkpoint"))),
            sh_quote(&self.named(CONFIG)),
        );
        let wrapper = self.at(&format!("{LIBEXEC}/runc"));
        write(&wrapper, script.as_bytes(), 0o755)?;
        done.push(format!("wrote {} (the engine's runc)", wrapper.display()));
        let drop_in_path = self.at(drop_in(self.engine));
        write(&drop_in_path, self.engine_drop_in().as_bytes(), 0o644)?;
        done.push(format!("wrote {}", drop_in_path.display()));
        if self.engine == EngineKind::Containerd {
            done.extend(self.containerd_imports()?);
        }
        Ok(done)
    }

    /// containerd 2.1 reads `conf.d` only through an `imports` line of its `config.toml`.
    fn containerd_imports(&self) -> Result<Option<String>, Error> {
        let main = self.at(CONTAINERD_CONFIG);
        let text = match std::fs::read_to_string(&main) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(&main, e)),
        };
        let conf_d = self.named("etc/containerd/conf.d");
        let wanted = format!("{}/*.toml", conf_d.display());
        let line = imports_line(&conf_d);
        let imports = text.lines().find(|l| l.trim_start().starts_with("imports"));
        match imports {
            Some(l) if l.contains(&wanted) => Ok(None),
            Some(l) => Err(Error::Io(format!(
                "{} has its own `{}`: add '{wanted}' to it",
                main.display(),
                l.trim()
            ))),
            None => {
                // A top-level key goes before the first table.
                let body = if text.is_empty() {
                    format!("version = 3\n{line}\n")
                } else {
                    format!("{line}\n{text}")
                };
                write(&main, body.as_bytes(), 0o644)?;
                write(&self.at(IMPORTS_ADDED), line.as_bytes(), 0o644)?;
                Ok(Some(format!("added `{line}` to {}", main.display())))
            }
        }
    }
}

/// Removes what [`NodeSetup::install`] wrote for `engine` under `prefix`, and the shared files once no
/// engine uses them; returns what it did.
pub fn undo(engine: EngineKind, prefix: &Path) -> Result<Vec<String>, Error> {
    let mut done = Vec::new();
    let mut remove = |path: PathBuf| -> Result<(), Error> {
        match std::fs::remove_file(&path) {
            Ok(()) => {
                done.push(format!("removed {}", path.display()));
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io(&path, e)),
        }
    };
    remove(prefix.join(drop_in(engine)))?;
    if engine == EngineKind::Containerd && prefix.join(IMPORTS_ADDED).exists() {
        let main = prefix.join(CONTAINERD_CONFIG);
        // The line node-setup wrote names the conf.d folder as the files do (the note holds it).
        let added = std::fs::read_to_string(prefix.join(IMPORTS_ADDED)).unwrap_or_default();
        if let Ok(text) = std::fs::read_to_string(&main) {
            let kept: String = text
                .lines()
                .filter(|l| l.trim() != added.trim())
                .map(|l| format!("{l}\n"))
                .collect();
            write(&main, kept.as_bytes(), 0o644)?;
        }
        remove(prefix.join(IMPORTS_ADDED))?;
    }
    let in_use = [EngineKind::Containerd, EngineKind::Crio, EngineKind::Podman]
        .iter()
        .any(|e| prefix.join(drop_in(*e)).exists());
    if !in_use {
        remove(prefix.join(LIBEXEC).join("runc"))?;
        remove(prefix.join(LIBEXEC).join("gpu-checkpoint"))?;
        remove(prefix.join(CONFIG))?;
        let ours = [
            LIBEXEC,
            PLUGINS,
            "usr/local/lib/gpu-checkpoint",
            "etc/gpu-checkpoint",
            // Kept when the guardian wrote to it.
            "var/log/gpu-checkpoint",
        ];
        for dir in ours {
            // Only when empty: never what someone else put there.
            let _ = std::fs::remove_dir(prefix.join(dir));
        }
    }
    Ok(done)
}

/// containerd's `imports` line for the drop-ins of `conf_d`.
fn imports_line(conf_d: &Path) -> String {
    format!("imports = [{}]", toml_string(&conf_d.join("*.toml")))
}

/// Writes `bytes` to `path` (its folders made), with `mode`, through a temporary file renamed over.
fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    crate::util::write_atomic(path, bytes).map_err(|e| io(path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|e| io(path, e))
}

fn sh_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', "'\\''"))
}

/// A TOML basic string.
fn toml_string(p: &Path) -> String {
    serde_json::to_string(&p.display().to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup(dir: &Path, engine: EngineKind) -> NodeSetup {
        let exe = dir.join("gpu-checkpoint-built");
        std::fs::write(&exe, b"#!/bin/sh\n").unwrap();
        NodeSetup {
            engine,
            prefix: dir.join("node"),
            host_root: None,
            binary: exe,
            runc: "/usr/sbin/runc".into(),
            criu: Some("/opt/criu".into()),
            gpu_backend: GpuBackend::Auto,
            lock_timeout_ms: Some(10_000),
        }
    }

    #[test]
    fn containerd_setup_writes_the_drop_in_and_its_import_and_the_undo_removes_them() {
        let dir = tempfile::tempdir().unwrap();
        let s = setup(dir.path(), EngineKind::Containerd);
        let main = s.at(CONTAINERD_CONFIG);
        std::fs::create_dir_all(main.parent().unwrap()).unwrap();
        let original = "version = 3\n[grpc]\n  address = '/run/c.sock'\n";
        std::fs::write(&main, original).unwrap();
        s.install().unwrap();
        let conf = std::fs::read_to_string(&main).unwrap();
        let line = imports_line(&s.at("etc/containerd/conf.d"));
        assert!(conf.starts_with(&format!("{line}\n{original}")), "{conf}");
        let drop = std::fs::read_to_string(s.at(drop_in(EngineKind::Containerd))).unwrap();
        assert!(
            drop.contains(&format!("BinaryName = \"{}\"", s.wrapper().display())),
            "{drop}"
        );
        let script = std::fs::read_to_string(s.at(&format!("{LIBEXEC}/runc"))).unwrap();
        assert!(script.contains("runtime-wrapper --config"), "{script}");
        let config = NodeConfig::read(&s.at(CONFIG)).unwrap();
        assert_eq!(config.runtime, Path::new("/usr/sbin/runc"));
        assert_eq!(config.criu_plugins, Some(s.at(PLUGINS)));
        // Again: the same files, the import not added twice.
        s.install().unwrap();
        let again = std::fs::read_to_string(&main).unwrap();
        assert_eq!(again.matches("imports").count(), 1);
        undo(EngineKind::Containerd, &s.prefix).unwrap();
        assert_eq!(std::fs::read_to_string(&main).unwrap(), original);
        assert!(!s.at(drop_in(EngineKind::Containerd)).exists());
        assert!(!s.at(CONFIG).exists());
        assert!(!s.at(LIBEXEC).exists());
    }

    #[test]
    fn a_host_root_is_written_under_and_named_without() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = setup(dir.path(), EngineKind::Podman);
        s.host_root = Some(s.prefix.clone());
        s.install().unwrap();
        let drop = std::fs::read_to_string(s.at(drop_in(EngineKind::Podman))).unwrap();
        assert!(
            drop.contains("gpu-checkpoint = [\"/usr/local/libexec/gpu-checkpoint/runc\"]"),
            "{drop}"
        );
        // Another engine's setup keeps the shared files when one is undone.
        let mut crio = setup(dir.path(), EngineKind::Crio);
        crio.host_root = s.host_root.clone();
        crio.install().unwrap();
        undo(EngineKind::Podman, &s.prefix).unwrap();
        assert!(s.at(CONFIG).exists());
        undo(EngineKind::Crio, &s.prefix).unwrap();
        assert!(!s.at(CONFIG).exists());
    }
}
