//! `gpu-checkpoint key`: keys that sign checkpoint manifests (`checkpoint --sign-key`) and that restores
//! trust (`--trust-key`); docs/security.md, "Signed checkpoints".

use std::path::PathBuf;

use gpu_checkpoint::store::signing::{self, SigningKey};

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
