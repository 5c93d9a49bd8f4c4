//! The secure setup of docs/cluster.md, made by the tests as an operator would: a CA and certificates
//! (openssl), etcd serving TLS and checking client certificates, etcd's authentication with a role
//! limited to the project's key prefix (etcdctl).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The users the tests' etcd knows: `root`, `gpu-checkpoint` (read and write under `/gpu-checkpoint/`:
/// agents and job commands) and `reader` (read only there). Their passwords are these; a test checks
/// that none is ever printed.
pub const USERS: [(&str, &str); 3] = [
    ("root", "root-Secret-1"),
    ("gpu-checkpoint", "agent-Secret-2"),
    ("reader", "reader-Secret-3"),
];

pub fn password(user: &str) -> &'static str {
    USERS
        .iter()
        .find(|(u, _)| *u == user)
        .map(|(_, p)| *p)
        .unwrap()
}

/// A CA with a server certificate for 127.0.0.1 and a client certificate per user (its common name is
/// the user, as etcd's `--client-cert-auth` reads it), and a second, unrelated CA with a client
/// certificate of its own (`rogue`): what etcd must not accept.
pub struct Pki {
    pub dir: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    succeeds(Command::new("openssl").args(args).current_dir(dir));
}

/// Runs `cmd` (openssl or etcdctl, which scripts/install-etcd.sh installs), asserting that it succeeds.
fn succeeds(cmd: &mut Command) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?} (scripts/install-etcd.sh installs it): {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Pki {
    pub fn make(dir: &Path) -> Pki {
        gpu_checkpoint::util::create_private_dir_all(dir).unwrap();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        for ca in ["ca", "rogue-ca"] {
            let subj = format!("/CN=gpu-checkpoint test {ca}");
            let args = ["req", "-x509", "-days", "2", "-subj", &subj];
            let out = [
                "-keyout",
                &format!("{ca}.key"),
                "-out",
                &format!("{ca}.crt"),
            ];
            openssl(dir, &[&args[..], &ec, &out].concat());
        }
        let sign = |name: &str, cn: &str, ca: &str, ext: &str| {
            std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
            let (key, csr, crt) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.crt"),
            );
            let subj = format!("/CN={cn}");
            let req = ["req", "-subj", &subj, "-keyout", &key, "-out", &csr];
            openssl(dir, &[&req[..], &ec].concat());
            let (ca_crt, ca_key, extfile) = (
                format!("{ca}.crt"),
                format!("{ca}.key"),
                format!("{name}.ext"),
            );
            openssl(
                dir,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    &ca_crt,
                    "-CAkey",
                    &ca_key,
                    "-CAcreateserial",
                    "-days",
                    "2",
                    "-out",
                    &crt,
                    "-extfile",
                    &extfile,
                ],
            );
        };
        sign(
            "server",
            "etcd",
            "ca",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        );
        for (user, _) in USERS {
            sign(user, user, "ca", "extendedKeyUsage=clientAuth\n");
        }
        sign(
            "rogue",
            "gpu-checkpoint",
            "rogue-ca",
            "extendedKeyUsage=clientAuth\n",
        );
        Pki {
            dir: dir.to_path_buf(),
        }
    }

    pub fn path(&self, file: &str) -> String {
        self.dir.join(file).display().to_string()
    }

    /// etcd's own TLS flags: serve with the server certificate, accept clients the CA signed only.
    pub fn etcd_server_args(&self) -> Vec<String> {
        vec![
            "--client-cert-auth".into(),
            "--trusted-ca-file".into(),
            self.path("ca.crt"),
            "--cert-file".into(),
            self.path("server.crt"),
            "--key-file".into(),
            self.path("server.key"),
        ]
    }

    /// etcdctl as `root` (by its certificate), against `url`.
    pub fn etcdctl(&self, url: &str, args: &[&str]) {
        succeeds(
            Command::new("etcdctl")
                .args(["--endpoints", url, "--cacert", &self.path("ca.crt")])
                .args([
                    "--cert",
                    &self.path("root.crt"),
                    "--key",
                    &self.path("root.key"),
                ])
                .args(args),
        );
    }

    /// docs/cluster.md's users and roles, then `auth enable`.
    pub fn enable_auth(&self, url: &str) {
        for (user, pw) in USERS {
            self.etcdctl(
                url,
                &["user", "add", user, &format!("--new-user-password={pw}")],
            );
        }
        self.etcdctl(url, &["user", "grant-role", "root", "root"]);
        let prefix = "/gpu-checkpoint/";
        for (role, perm, user) in [
            ("gpu-checkpoint", "readwrite", "gpu-checkpoint"),
            ("gpu-checkpoint-read", "read", "reader"),
        ] {
            self.etcdctl(url, &["role", "add", role]);
            self.etcdctl(
                url,
                &[
                    "role",
                    "grant-permission",
                    role,
                    "--prefix=true",
                    perm,
                    prefix,
                ],
            );
            self.etcdctl(url, &["user", "grant-role", user, role]);
        }
        self.etcdctl(url, &["auth", "enable"]);
    }

    /// The etcd settings of `user`, as an agent's systemd unit would hold them: a private file of
    /// GPU_CHECKPOINT_ETCD_* lines (its certificate, and its password).
    pub fn config_file(&self, url: &str, user: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.join(format!("{user}.env"));
        let text = format!(
            "# etcd for gpu-checkpoint, as user {user}\nGPU_CHECKPOINT_ETCD={url}\n\
             GPU_CHECKPOINT_ETCD_CACERT={}\nGPU_CHECKPOINT_ETCD_CERT={}\nGPU_CHECKPOINT_ETCD_KEY={}\n\
             GPU_CHECKPOINT_ETCD_USER={user}\nGPU_CHECKPOINT_ETCD_PASSWORD='{}'\n",
            self.path("ca.crt"),
            self.path(&format!("{user}.crt")),
            self.path(&format!("{user}.key")),
            password(user),
        );
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        path
    }
}
