//! How a cluster command reaches etcd, and whether that is safe enough to act on: the endpoints, the TLS
//! files (the CA that signed etcd's server certificates, a client certificate and its key), etcd's own
//! credentials (a user and password), and the operator's explicit switch for plaintext demos.
//!
//! The agent runs as root and does what etcd's records say, so by default a cluster command refuses an
//! etcd it cannot authenticate (no TLS, no CA) or that cannot authenticate it (neither a client
//! certificate nor a user): [`EtcdConfig::check`]. `docs/security.md` has the trust model.

use std::path::PathBuf;

use super::coord::CoordError;

/// A password: kept out of `Debug` output, logs and error messages.
#[derive(Clone, PartialEq, Eq)]
pub struct Password(String);

impl Password {
    pub fn new(p: impl Into<String>) -> Self {
        Password(p.into())
    }

    /// The password itself, for the one place that sends it (the etcd client's authentication).
    pub fn reveal(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Password {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Password(hidden)")
    }
}

/// Where etcd is and how to talk to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client URLs: `https://10.0.0.1:2379`, or bare `host:port` (TLS when a CA is given).
    pub endpoints: Vec<String>,
    /// The CA that signed etcd's server certificates (PEM): etcdctl's `--cacert`.
    pub cacert: Option<PathBuf>,
    /// This client's certificate (PEM), for etcd's `--client-cert-auth`: etcdctl's `--cert`.
    pub cert: Option<PathBuf>,
    /// Its private key (PEM): etcdctl's `--key`.
    pub key: Option<PathBuf>,
    /// etcd's authentication: the user (with `password`). Without it, etcd takes the client
    /// certificate's common name as the user.
    pub user: Option<String>,
    pub password: Option<Password>,
    /// The operator accepts plaintext or unauthenticated etcd (demos and tests on loopback): anyone who
    /// reaches etcd can then drive the agents.
    pub insecure_plaintext: bool,
}

/// What [`EtcdConfig::check`] found: whether the connection will be TLS, and authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Security {
    pub tls: bool,
    pub authenticated: bool,
}

impl Security {
    /// TLS and credentials both.
    pub fn is_secure(self) -> bool {
        self.tls && self.authenticated
    }
}

impl EtcdConfig {
    /// Plaintext endpoints, accepted explicitly: for tests and demos on loopback.
    pub fn insecure(endpoints: &[String]) -> Self {
        EtcdConfig {
            endpoints: endpoints.to_vec(),
            insecure_plaintext: true,
            ..EtcdConfig::default()
        }
    }

    pub fn endpoints_text(&self) -> String {
        self.endpoints.join(",")
    }

    /// Checks the combination before anything is sent: every endpoint of one kind, a CA for TLS, a key
    /// with its certificate, a password with its user; and refuses plaintext or unauthenticated etcd
    /// unless [`EtcdConfig::insecure_plaintext`] says the operator accepts it.
    pub fn check(&self) -> Result<Security, CoordError> {
        let bad = |why: String| Err(CoordError::Config(why));
        if self.endpoints.is_empty() {
            return bad(
                "no etcd endpoint given (--etcd, GPU_CHECKPOINT_ETCD or ETCDCTL_ENDPOINTS)".into(),
            );
        }
        let plain = self.endpoints.iter().filter(|e| e.starts_with("http://"));
        let plain = plain.count();
        if plain > 0 && plain < self.endpoints.len() {
            return bad(format!(
                "etcd endpoints {}: some http://, some not; use one scheme for all",
                self.endpoints_text()
            ));
        }
        if let Some(e) = self
            .endpoints
            .iter()
            .find(|e| e.contains("://") && !e.starts_with("http://") && !e.starts_with("https://"))
        {
            return bad(format!(
                "etcd endpoint {e:?}: not http://, https:// or host:port"
            ));
        }
        let https = self.endpoints.iter().any(|e| e.starts_with("https://"));
        if plain > 0 && (self.cacert.is_some() || self.cert.is_some()) {
            return bad(format!(
                "TLS files given, but the etcd endpoints {} are http://: use https://",
                self.endpoints_text()
            ));
        }
        if https && self.cacert.is_none() {
            return bad(
                "TLS to etcd needs the CA that signed its server certificates: --cacert FILE \
                 (GPU_CHECKPOINT_ETCD_CACERT, ETCDCTL_CACERT)"
                    .into(),
            );
        }
        match (&self.cert, &self.key) {
            (Some(_), None) => return bad("--cert needs its private key: --key FILE".into()),
            (None, Some(_)) => return bad("--key needs its certificate: --cert FILE".into()),
            _ => {}
        }
        match (&self.user, &self.password) {
            (Some(u), None) => {
                return bad(format!(
                    "etcd user {u:?} without a password (--user NAME:PASSWORD, --password, \
                     GPU_CHECKPOINT_ETCD_PASSWORD or ETCDCTL_PASSWORD)"
                ))
            }
            (None, Some(_)) => return bad("a password without a user (--user NAME)".into()),
            _ => {}
        }
        let security = Security {
            tls: self.cacert.is_some(),
            authenticated: self.cert.is_some() || self.user.is_some(),
        };
        if !security.is_secure() && !self.insecure_plaintext {
            let mut missing = Vec::new();
            if !security.tls {
                missing.push("TLS (https:// endpoints and --cacert)");
            }
            if !security.authenticated {
                missing.push("credentials (--cert/--key, or --user)");
            }
            return Err(CoordError::Insecure {
                endpoints: self.endpoints_text(),
                missing: missing.join(" and "),
            });
        }
        Ok(security)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(endpoints: &[&str]) -> EtcdConfig {
        EtcdConfig {
            endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
            ..EtcdConfig::default()
        }
    }

    #[test]
    fn plaintext_or_unauthenticated_etcd_is_refused_unless_the_operator_accepts_it() {
        let plain = cfg(&["http://127.0.0.1:2379"]);
        let e = plain.check().unwrap_err();
        assert!(matches!(e, CoordError::Insecure { .. }), "{e}");
        assert!(e.to_string().contains("--insecure-plaintext"), "{e}");
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::exit::ExitStatus::Usage
        );
        // TLS alone is not enough: etcd must know who is asking.
        let tls = EtcdConfig {
            cacert: Some("/ca.pem".into()),
            ..cfg(&["https://e:2379"])
        };
        let e = tls.check().unwrap_err().to_string();
        assert!(e.contains("credentials") && !e.contains("TLS ("), "{e}");
        let with_cert = EtcdConfig {
            cert: Some("/c.pem".into()),
            key: Some("/k.pem".into()),
            ..tls.clone()
        };
        assert!(with_cert.check().unwrap().is_secure());
        let with_user = EtcdConfig {
            user: Some("agent".into()),
            password: Some(Password::new("pw")),
            ..tls.clone()
        };
        assert!(with_user.check().unwrap().is_secure());
        // Bare host:port is TLS when a CA is given (as etcdctl).
        let bare = EtcdConfig {
            endpoints: vec!["e:2379".into()],
            ..with_user.clone()
        };
        assert!(bare.check().unwrap().is_secure());
        let accepted = EtcdConfig {
            insecure_plaintext: true,
            ..plain
        };
        assert!(!accepted.check().unwrap().is_secure());
    }

    #[test]
    fn incomplete_settings_are_said_before_anything_is_sent() {
        let tls = |f: fn(&mut EtcdConfig)| {
            let mut c = EtcdConfig {
                cacert: Some("/ca.pem".into()),
                user: Some("u".into()),
                password: Some(Password::new("p")),
                ..cfg(&["https://e:2379"])
            };
            f(&mut c);
            c.check().map(drop).unwrap_err().to_string()
        };
        assert!(tls(|c| c.cacert = None).contains("--cacert"));
        assert!(tls(|c| c.password = None).contains("without a password"));
        assert!(tls(|c| c.cert = Some("/c".into())).contains("--key"));
        assert!(tls(|c| c.endpoints.push("http://x:1".into())).contains("one scheme"));
        assert!(tls(|c| c.endpoints = vec!["http://x:1".into()]).contains("are http://"));
        assert!(tls(|c| c.endpoints.clear()).contains("no etcd endpoint"));
        assert!(tls(|c| c.endpoints = vec!["unix://x".into()]).contains("not http://"));
    }

    #[test]
    fn a_password_never_shows_in_debug_output() {
        let c = EtcdConfig {
            user: Some("u".into()),
            password: Some(Password::new("s3cret")),
            ..cfg(&["https://e:2379"])
        };
        assert!(!format!("{c:?}").contains("s3cret"));
        assert_eq!(c.password.unwrap().reveal(), "s3cret");
    }
}
