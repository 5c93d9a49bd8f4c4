//! `gpu-checkpoint key`: keys that sign checkpoint manifests (`checkpoint --sign-key`) and that restores
//! trust (`--trust-key`); docs/security.md, "Signed checkpoints".

use std::path::PathBuf;
use std::sync::Arc;

use gpu_checkpoint::store::signing::{self, SigningKey, TrustedKeys};

/// `--sign-key`: what `checkpoint` and the agent sign their checkpoints with.
#[derive(clap::Args)]
pub struct SignArgs {
    /// Sign each checkpoint's manifest with this Ed25519 private key (PKCS#8, PEM or DER: `gpu-checkpoint
    /// key generate`, or `openssl genpkey -algorithm ed25519`; a file of this user, mode 0600, not a
    /// link), so that restores given its public key (`--trust-key`) accept it (docs/security.md).
    #[arg(long, value_name = "FILE", env = signing::SIGN_KEY_ENV)]
    pub sign_key: Option<PathBuf>,
}

impl SignArgs {
    /// The key, read and checked (exit 2 if it cannot be used): before anything is touched.
    pub fn key(&self) -> super::Result<Option<Arc<SigningKey>>> {
        Ok(match &self.sign_key {
            Some(path) => Some(Arc::new(SigningKey::load(path)?)),
            None => None,
        })
    }
}

/// `--trust-key`: the keys whose checkpoints a restore (and `inspect`, `verify`, the agent) accepts.
#[derive(clap::Args)]
pub struct TrustArgs {
    /// Use only checkpoints whose manifest a key of this public key file signed (`ed25519 BASE64` lines:
    /// `gpu-checkpoint key generate` writes one), or of a folder of such `*.pub` files; repeatable, or
    /// several separated by `:` in the variable. A restore, `inspect` or `verify` of any other checkpoint (unsigned, signed by another
    /// key, or changed since it was signed) is refused (exit 4) before anything of it is read.
    #[arg(long = "trust-key", value_name = "PUBFILE", env = signing::TRUST_KEYS_ENV, value_delimiter = ':')]
    pub trust_keys: Vec<PathBuf>,
}

impl TrustArgs {
    /// The keys, each file checked (exit 2 if one cannot be used); `None` without any.
    pub fn keys(&self) -> super::Result<Option<Arc<TrustedKeys>>> {
        if self.trust_keys.is_empty() {
            return Ok(None);
        }
        let mut keys = Vec::new();
        for path in &self.trust_keys {
            keys.extend(TrustedKeys::load(path)?);
        }
        Ok(Some(Arc::new(TrustedKeys::new(keys))))
    }
}

#[derive(clap::Subcommand)]
pub enum Command {
    /// Make a new Ed25519 key pair: the private key to FILE (PKCS#8 PEM, mode 0600), the public key to
    /// FILE.pub and stdout (`ed25519 BASE64`). Never overwrites a file.
    Generate(GenerateArgs),
    /// Print the public key (and its id on stderr) of a private key file.
    Public(PublicArgs),
}

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// Where the private key goes (must not exist).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

#[derive(clap::Args)]
pub struct PublicArgs {
    /// A private key file (PKCS#8, PEM or DER: `openssl genpkey -algorithm ed25519` writes one).
    #[arg(value_name = "FILE")]
    pub key: PathBuf,
}

pub fn run(cmd: Command) -> super::Result<()> {
    let public = match cmd {
        Command::Generate(a) => {
            let public = signing::generate_key_files(&a.out)?;
            eprintln!(
                "gpu-checkpoint: private key {} (keep it secret; 0600), public key {}",
                a.out.display(),
                signing::public_path(&a.out).display()
            );
            public
        }
        Command::Public(a) => SigningKey::load(&a.key)?.public(),
    };
    println!("{}", public.to_text());
    eprintln!("gpu-checkpoint: key id {}", public.id());
    Ok(())
}
