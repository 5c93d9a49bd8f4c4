//! Where etcd is and how to talk to it, for every cluster command (`agent`, `job ...`): etcdctl's flags
//! and environment variables, ours (`GPU_CHECKPOINT_ETCD_*`), and a file of the same variables that an
//! agent's systemd unit can hold (`EnvironmentFile=`) or any command can read (`--etcd-config`).
//!
//! Each setting is taken from the first of: the flag, `GPU_CHECKPOINT_ETCD_*`, `ETCDCTL_*`, the file.
//! Secret values are never printed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpu_checkpoint::flows::cluster::{EtcdConfig, EtcdCoordinator, Password};

use super::Exit;
use gpu_checkpoint::ExitStatus;

/// Where etcd is, and the TLS files and credentials to reach it with.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct EtcdArgs {
    /// etcd's client URLs, comma-separated (https://10.0.0.1:2379,...; also GPU_CHECKPOINT_ETCD or
    /// ETCDCTL_ENDPOINTS).
    #[arg(long, value_delimiter = ',', value_name = "URLS")]
    pub etcd: Vec<String>,
    /// The CA that signed etcd's server certificates (PEM; GPU_CHECKPOINT_ETCD_CACERT, ETCDCTL_CACERT).
    #[arg(long, value_name = "FILE")]
    pub cacert: Option<PathBuf>,
    /// This client's certificate, for etcd's --client-cert-auth (PEM; GPU_CHECKPOINT_ETCD_CERT,
    /// ETCDCTL_CERT).
    #[arg(long, value_name = "FILE")]
    pub cert: Option<PathBuf>,
    /// The client certificate's private key (PEM; GPU_CHECKPOINT_ETCD_KEY, ETCDCTL_KEY).
    #[arg(long, value_name = "FILE")]
    pub key: Option<PathBuf>,
    /// etcd's authentication: NAME or NAME:PASSWORD (GPU_CHECKPOINT_ETCD_USER, ETCDCTL_USER).
    #[arg(long, value_name = "NAME[:PASSWORD]")]
    pub user: Option<String>,
    /// The user's password (prefer GPU_CHECKPOINT_ETCD_PASSWORD, ETCDCTL_PASSWORD or --etcd-config:
    /// a command line is visible to every local user).
    #[arg(long, value_name = "PASSWORD", hide_default_value = true)]
    pub password: Option<String>,
    /// A file of GPU_CHECKPOINT_ETCD_* / ETCDCTL_* settings, one KEY=VALUE a line (the format of a
    /// systemd EnvironmentFile); owned by root or this user, and not readable by others when it holds
    /// a password (GPU_CHECKPOINT_ETCD_CONFIG).
    #[arg(long, value_name = "FILE")]
    pub etcd_config: Option<PathBuf>,
    /// Accept etcd without TLS or without credentials. Whoever can write to that etcd can then make
    /// the agents checkpoint, stop, restore and delete the members they registered: for demos and
    /// tests on loopback only.
    #[arg(long)]
    pub insecure_plaintext: bool,
}

impl EtcdArgs {
    /// The settings, from the flags, the environment and the config file.
    pub fn config(&self) -> super::Result<EtcdConfig> {
        let file = match self
            .etcd_config
            .clone()
            .or_else(|| std::env::var_os("GPU_CHECKPOINT_ETCD_CONFIG").map(PathBuf::from))
        {
            Some(path) => read_config_file(&path)?,
            None => Vec::new(),
        };
        resolve(self, &|k| std::env::var(k).ok(), &file)
    }

    /// Connects to etcd as [`EtcdArgs::config`] says; says so loudly when the operator accepted an
    /// insecure etcd.
    pub fn connect(&self) -> super::Result<Arc<EtcdCoordinator>> {
        let config = self.config()?;
        // Read once: the processes this one starts (CRIU, runc, the guardian, quiesce hooks) have no
        // use for etcd's credentials. Done before the client starts its threads.
        for k in ["GPU_CHECKPOINT_ETCD_PASSWORD", "ETCDCTL_PASSWORD"] {
            std::env::remove_var(k);
        }
        for k in ["GPU_CHECKPOINT_ETCD_USER", "ETCDCTL_USER"] {
            if std::env::var(k).is_ok_and(|u| u.contains(':')) {
                std::env::remove_var(k);
            }
        }
        let coord = EtcdCoordinator::connect(&config)?;
        if !coord.security().is_secure() {
            eprintln!(
                "gpu-checkpoint: WARNING: etcd at {} without {} (--insecure-plaintext): whoever can \
                 write to it can drive the agents",
                coord.endpoints(),
                if coord.security().tls { "credentials" } else { "TLS" },
            );
        }
        Ok(Arc::new(coord))
    }
}

/// The value of setting `name` (`CACERT`, `USER`, ...): `GPU_CHECKPOINT_ETCD_NAME`, then
/// `ETCDCTL_NAME`, from the environment, then from the file.
fn setting(
    name: &str,
    env: &dyn Fn(&str) -> Option<String>,
    file: &[(String, String)],
) -> Option<String> {
    let ours = if name.is_empty() {
        "GPU_CHECKPOINT_ETCD".to_string()
    } else {
        format!("GPU_CHECKPOINT_ETCD_{name}")
    };
    let etcdctl = format!(
        "ETCDCTL_{}",
        if name.is_empty() { "ENDPOINTS" } else { name }
    );
    let from_file = |k: &str| {
        file.iter()
            .rev()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    [&ours, &etcdctl]
        .iter()
        .find_map(|k| env(k).filter(|v| !v.is_empty()))
        .or_else(|| [&ours, &etcdctl].iter().find_map(|k| from_file(k)))
}

/// [`EtcdArgs::config`] with the environment and the file's lines given.
fn resolve(
    args: &EtcdArgs,
    env: &dyn Fn(&str) -> Option<String>,
    file: &[(String, String)],
) -> super::Result<EtcdConfig> {
    let get = |name: &str| setting(name, env, file);
    let path =
        |flag: &Option<PathBuf>, name: &str| flag.clone().or_else(|| get(name).map(PathBuf::from));
    let endpoints = if args.etcd.is_empty() {
        get("")
            .map(|v| {
                v.split(',')
                    .map(|e| e.trim().to_string())
                    .filter(|e| !e.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    } else {
        args.etcd.clone()
    };
    let (user, mut password) = match args.user.clone().or_else(|| get("USER")) {
        Some(u) => match u.split_once(':') {
            Some((name, pw)) => (Some(name.to_string()), Some(pw.to_string())),
            None => (Some(u), None),
        },
        None => (None, None),
    };
    if let Some(p) = args.password.clone().or_else(|| get("PASSWORD")) {
        password = Some(p);
    }
    Ok(EtcdConfig {
        endpoints,
        cacert: path(&args.cacert, "CACERT"),
        cert: path(&args.cert, "CERT"),
        key: path(&args.key, "KEY"),
        user,
        password: password.map(Password::new),
        insecure_plaintext: args.insecure_plaintext,
    })
}

/// The `KEY=VALUE` lines of an etcd config file (blank lines and `#` comments skipped, one pair of
/// quotes around a value taken off, as systemd does). The file must be root's or this user's and not
/// writable by others (it names the CA to trust), and not readable by others if it holds a password.
fn read_config_file(path: &Path) -> super::Result<Vec<(String, String)>> {
    use std::os::unix::fs::MetadataExt;
    let text = std::fs::read_to_string(path).map_err(|e| {
        Exit(
            ExitStatus::Usage,
            format!("reading the etcd config file {}: {e}", path.display()),
        )
    })?;
    let mut pairs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((k, v)) = line.split_once('=') else {
            // The line may hold a secret: say where, not what.
            return Err(Exit(
                ExitStatus::Usage,
                format!("{}, line {}: not KEY=VALUE", path.display(), n + 1),
            )
            .into());
        };
        let v = v.trim();
        let unquoted = ['"', '\'']
            .iter()
            .find_map(|q| v.strip_prefix(*q).and_then(|r| r.strip_suffix(*q)))
            .unwrap_or(v);
        pairs.push((k.trim().to_string(), unquoted.to_string()));
    }
    let meta = std::fs::metadata(path).map_err(super::Failure::other)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let secret = pairs
        .iter()
        .any(|(k, _)| k.ends_with("_PASSWORD") || k.ends_with("_USER"));
    let refuse = |why: String| -> super::Result<Vec<(String, String)>> {
        Err(Exit(
            ExitStatus::PermissionDenied,
            format!("etcd config file {}: {why}", path.display()),
        )
        .into())
    };
    if meta.uid() != 0 && meta.uid() != me {
        return refuse(format!(
            "owned by uid {}, not root or this user",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "writable by others (mode {:o}): chmod go-w",
            meta.mode() & 0o777
        ));
    }
    if secret && meta.mode() & 0o044 != 0 {
        return refuse(format!(
            "holds credentials but is readable by others (mode {:o}): chmod 600",
            meta.mode() & 0o777
        ));
    }
    Ok(pairs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn flags_then_our_variables_then_etcdctls_then_the_file() {
        let file = pairs(&[
            ("GPU_CHECKPOINT_ETCD", "https://file:2379"),
            ("ETCDCTL_CACERT", "/file/ca.pem"),
            ("GPU_CHECKPOINT_ETCD_USER", "agent:frompw"),
            ("ETCDCTL_KEY", "/file/key.pem"),
        ]);
        let e = env(&[
            ("ETCDCTL_ENDPOINTS", "https://a:2379,https://b:2379"),
            ("GPU_CHECKPOINT_ETCD_CACERT", "/env/ca.pem"),
            ("ETCDCTL_CACERT", "/etcdctl/ca.pem"),
            ("ETCDCTL_CERT", "/etcdctl/cert.pem"),
        ]);
        let args = EtcdArgs::default();
        let c = resolve(&args, &e, &file).unwrap();
        assert_eq!(c.endpoints, ["https://a:2379", "https://b:2379"]);
        assert_eq!(c.cacert.as_deref(), Some(Path::new("/env/ca.pem")));
        assert_eq!(c.cert.as_deref(), Some(Path::new("/etcdctl/cert.pem")));
        assert_eq!(c.key.as_deref(), Some(Path::new("/file/key.pem")));
        assert_eq!(c.user.as_deref(), Some("agent"));
        assert_eq!(c.password.as_ref().map(|p| p.reveal()), Some("frompw"));
        let flags = EtcdArgs {
            etcd: vec!["https://flag:2379".into()],
            cacert: Some("/flag/ca.pem".into()),
            user: Some("root".into()),
            password: Some("flagpw".into()),
            ..EtcdArgs::default()
        };
        let c = resolve(&flags, &e, &file).unwrap();
        assert_eq!(c.endpoints, ["https://flag:2379"]);
        assert_eq!(c.cacert.as_deref(), Some(Path::new("/flag/ca.pem")));
        assert_eq!(c.user.as_deref(), Some("root"));
        assert_eq!(c.password.as_ref().map(|p| p.reveal()), Some("flagpw"));
        // The file's endpoints when nothing else names any.
        let c = resolve(&EtcdArgs::default(), &env(&[]), &file).unwrap();
        assert_eq!(c.endpoints, ["https://file:2379"]);
    }

    #[test]
    fn a_config_file_must_be_private_when_it_holds_a_password() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("etcd.env");
        std::fs::write(
            &f,
            "# the agent's etcd\nGPU_CHECKPOINT_ETCD=https://e:2379\n\nETCDCTL_USER='agent'\nETCDCTL_PASSWORD=\"s3cret\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_config_file(&f).unwrap_err();
        assert!(e.to_string().contains("chmod 600"), "{e}");
        assert!(!e.to_string().contains("s3cret"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let p = read_config_file(&f).unwrap();
        assert_eq!(p[1], ("ETCDCTL_USER".to_string(), "agent".to_string()));
        assert_eq!(p[2].1, "s3cret");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o622)).unwrap();
        assert!(read_config_file(&f)
            .unwrap_err()
            .to_string()
            .contains("writable by others"));
        std::fs::write(&f, "ETCDCTL_PASSWORD s3cret\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let e = read_config_file(&f).unwrap_err().to_string();
        assert!(e.contains("line 1") && !e.contains("s3cret"), "{e}");
    }
}
