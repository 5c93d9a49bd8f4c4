//! Signed manifests: a checkpoint's manifest signed with a node's or a fleet's Ed25519 key, and restores
//! that trust only known keys.
//!
//! Hashes prove that a chunk is the one a manifest names; a signature proves who wrote the manifest. The
//! signature is a detached object beside the manifest (`manifests/ID.sig`, written before the manifest,
//! which stays the commit point) over the manifest's exact bytes as stored, so that a later build's
//! unknown fields never break it and no re-serialisation is needed: the signed message is
//! [`SIGNED_CONTEXT`] followed by those bytes (the context keeps a signature from meaning anything else).
//!
//! Keys: a private key is a PKCS#8 file (PEM or DER; what `openssl genpkey -algorithm ed25519` writes, or
//! `gpu-checkpoint key generate`), used only when it is a regular file of this user that no one else may
//! read, and never printed. A public key is one line, `ed25519 BASE64` (the 32 bytes), optionally followed
//! by a comment; its id ([`PublicKey::id`]) is `ed25519:` and 16 hex digits of its BLAKE3 hash.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use base64::Engine as _;
use ring::signature::{self, Ed25519KeyPair, KeyPair, UnparsedPublicKey};
use serde::{Deserialize, Serialize};

use crate::exit::{Classify, ExitStatus};

/// The environment variable `checkpoint` reads its `--sign-key` from.
pub const SIGN_KEY_ENV: &str = "GPU_CHECKPOINT_SIGN_KEY";
/// The environment variable `restore` and the other store commands read trusted public key files from
/// (several separated by `:`).
pub const TRUST_KEYS_ENV: &str = "GPU_CHECKPOINT_TRUST_KEYS";
/// What a signature signs before the manifest's bytes.
pub const SIGNED_CONTEXT: &[u8] = b"gpu-checkpoint manifest signature v1\n";
const SIGNATURE_FORMAT_NAME: &str = "gpu-checkpoint-signature";
/// Version of the signature object this build writes and reads.
pub const SIGNATURE_FORMAT_VERSION: u32 = 1;
const ALGORITHM: &str = "ed25519";
const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// A key file that cannot be used: bad input, exit status 2.
#[derive(Debug, thiserror::Error)]
#[error("key file {path}: {reason}")]
pub struct KeyError {
    pub path: PathBuf,
    pub reason: String,
}

impl Classify for KeyError {
    fn exit_status(&self) -> ExitStatus {
        ExitStatus::Usage
    }
}

fn key_error(path: &Path, reason: impl Into<String>) -> KeyError {
    KeyError {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// An Ed25519 public key.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PublicKey([u8; 32]);

impl PublicKey {
    /// Parses the text form, `ed25519 BASE64 [comment]`.
    pub fn parse(text: &str) -> Result<PublicKey, String> {
        let mut words = text.split_whitespace();
        match (words.next(), words.next()) {
            (Some(ALGORITHM), Some(b64)) => Self::from_base64(b64),
            _ => Err("not a public key (expected a line `ed25519 BASE64`)".into()),
        }
    }

    fn from_base64(b64: &str) -> Result<PublicKey, String> {
        let bytes = B64
            .decode(b64)
            .map_err(|e| format!("bad base64 in public key: {e}"))?;
        Ok(PublicKey(bytes.try_into().map_err(|b: Vec<u8>| {
            format!("an ed25519 public key has 32 bytes, not {}", b.len())
        })?))
    }

    /// The text form: `ed25519 BASE64`.
    pub fn to_text(&self) -> String {
        format!("{ALGORITHM} {}", B64.encode(self.0))
    }

    /// A short id: `ed25519:` and the first 16 hex digits of the BLAKE3 hash of the 32 bytes.
    pub fn id(&self) -> String {
        format!(
            "{ALGORITHM}:{}",
            &blake3::hash(&self.0).to_hex().as_str()[..16]
        )
    }

    fn verify(&self, message: &[&[u8]], sig: &[u8]) -> bool {
        let msg = message.concat();
        UnparsedPublicKey::new(&signature::ED25519, &self.0)
            .verify(&msg, sig)
            .is_ok()
    }
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.id())
    }
}

/// A private key to sign manifests with. Its `Debug` shows the key id only.
pub struct SigningKey {
    pair: Ed25519KeyPair,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKey({})", self.public().id())
    }
}

impl SigningKey {
    /// Reads a private key file: refused unless it is a regular file (not a link) of the user running the
    /// tool that no one else may read or write.
    pub fn load(path: &Path) -> Result<SigningKey, KeyError> {
        let (mut f, meta) = open_checked(path, false)?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me {
            return Err(key_error(
                path,
                format!(
                    "it belongs to uid {}, not to the user running the tool (uid {me}): a private key \
                     must be its user's own",
                    meta.uid()
                ),
            ));
        }
        if meta.mode() & 0o077 != 0 {
            return Err(key_error(
                path,
                format!(
                    "other users may read or change it (mode {:o}): a private key must be 0600 \
                     (chmod 600 {})",
                    meta.mode() & 0o7777,
                    path.display()
                ),
            ));
        }
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes)
            .map_err(|e| key_error(path, e.to_string()))?;
        Self::from_pkcs8(&bytes).map_err(|reason| key_error(path, reason))
    }

    /// A key from a PKCS#8 document, PEM (`-----BEGIN PRIVATE KEY-----`) or DER; version 1 (OpenSSL's) or
    /// 2 (with the public key, what [`generate_key_files`] writes).
    pub fn from_pkcs8(bytes: &[u8]) -> Result<SigningKey, String> {
        let der = if bytes.starts_with(b"-----BEGIN") {
            pem_body(bytes)?
        } else {
            bytes.to_vec()
        };
        let pair = Ed25519KeyPair::from_pkcs8_maybe_unchecked(&der)
            .map_err(|e| format!("not an Ed25519 private key in PKCS#8 ({e})"))?;
        Ok(SigningKey { pair })
    }

    pub fn public(&self) -> PublicKey {
        let mut b = [0u8; 32];
        b.copy_from_slice(self.pair.public_key().as_ref());
        PublicKey(b)
    }

    /// The signature object of a manifest's exact bytes (what goes to `manifests/ID.sig`).
    pub fn sign_manifest(&self, manifest: &[u8]) -> Vec<u8> {
        let sig = self.pair.sign(&[SIGNED_CONTEXT, manifest].concat());
        let object = SignatureFile {
            format: SIGNATURE_FORMAT_NAME.into(),
            version: SIGNATURE_FORMAT_VERSION,
            algorithm: ALGORITHM.into(),
            public_key: B64.encode(self.public().0),
            signature: B64.encode(sig.as_ref()),
        };
        let mut out = serde_json::to_vec(&object).expect("serialisable");
        out.push(b'\n');
        out
    }
}

/// Opens a key file (or, with `folder`, a folder of them) without following a link.
fn open_checked(path: &Path, folder: bool) -> Result<(File, std::fs::Metadata), KeyError> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => key_error(path, "it is a symbolic link; give the file itself"),
            _ => key_error(path, e.to_string()),
        })?;
    let meta = f.metadata().map_err(|e| key_error(path, e.to_string()))?;
    if !(meta.is_file() || folder && meta.is_dir()) {
        return Err(key_error(path, "not a regular file"));
    }
    Ok((f, meta))
}

fn pem_body(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let text = std::str::from_utf8(bytes).map_err(|_| "PEM that is not text")?;
    let mut lines = text.lines().map(str::trim);
    if lines.next() != Some("-----BEGIN PRIVATE KEY-----") {
        return Err("not a PKCS#8 PEM (expected -----BEGIN PRIVATE KEY-----)".into());
    }
    let body: String = lines
        .by_ref()
        .take_while(|l| *l != "-----END PRIVATE KEY-----")
        .collect();
    B64.decode(body)
        .map_err(|e| format!("bad base64 in PEM: {e}"))
}

/// The public keys a restore trusts.
#[derive(Clone, Debug, Default)]
pub struct TrustedKeys(Vec<PublicKey>);

impl TrustedKeys {
    pub fn new(keys: Vec<PublicKey>) -> TrustedKeys {
        TrustedKeys(keys)
    }

    /// Reads a public key file: one key per line (`ed25519 BASE64 [comment]`; empty lines and `#` comments
    /// skipped), or a folder of them (every `*.pub` file in it, such as `/etc/gpu-checkpoint/trusted-keys`).
    /// Refused when it (or a file in the folder) is a link, or others than its owner (this user or root)
    /// may change it: a key added there would be trusted.
    pub fn load(path: &Path) -> Result<Vec<PublicKey>, KeyError> {
        let (mut f, meta) = open_checked(path, true)?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if meta.uid() != me && meta.uid() != 0 {
            return Err(key_error(
                path,
                format!(
                    "it belongs to uid {}, not to this user (uid {me}) or root",
                    meta.uid()
                ),
            ));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(key_error(
                path,
                format!(
                    "other users may change it (mode {:o}): whoever can add a key there is trusted",
                    meta.mode() & 0o7777
                ),
            ));
        }
        if meta.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| key_error(path, e.to_string()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "pub"))
                .collect();
            files.sort();
            let mut keys = Vec::new();
            for file in &files {
                if std::fs::symlink_metadata(file).is_ok_and(|m| m.is_dir()) {
                    return Err(key_error(file, "a folder where a key file was expected"));
                }
                keys.extend(Self::load(file)?);
            }
            if keys.is_empty() {
                return Err(key_error(path, "holds no *.pub file with a public key"));
            }
            return Ok(keys);
        }
        let mut text = String::new();
        f.read_to_string(&mut text)
            .map_err(|e| key_error(path, e.to_string()))?;
        let keys = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| PublicKey::parse(l).map_err(|r| key_error(path, r)))
            .collect::<Result<Vec<_>, _>>()?;
        if keys.is_empty() {
            return Err(key_error(path, "holds no public key"));
        }
        Ok(keys)
    }

    pub fn keys(&self) -> &[PublicKey] {
        &self.0
    }

    /// Checks a checkpoint's signature object against its manifest's bytes and these keys: the key id that
    /// signed it, or why it is not trusted.
    pub fn check(&self, manifest: &[u8], sig: Option<&[u8]>) -> Result<String, String> {
        let Some(sig) = sig else {
            return Err("its manifest is not signed, and trusted keys were given".into());
        };
        match Signature::check(manifest, sig) {
            Err(reason) => Err(reason),
            Ok(key) if self.0.contains(&key) => Ok(key.id()),
            Ok(key) => Err(format!(
                "it is signed by key {}, not a trusted key",
                key.id()
            )),
        }
    }
}

#[derive(Serialize, Deserialize)]
struct SignatureFile {
    format: String,
    version: u32,
    algorithm: String,
    public_key: String,
    signature: String,
}

/// A checkpoint's signature as `list`, `inspect` and `verify` show it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Signature {
    Unsigned,
    /// A signature that matches the manifest, by this key.
    Signed {
        key_id: String,
    },
    /// A signature object that does not match the manifest or cannot be read.
    Bad {
        reason: String,
    },
}

impl Signature {
    /// What the signature object `sig` (if any) says of `manifest`.
    pub fn of(manifest: &[u8], sig: Option<&[u8]>) -> Signature {
        match sig.map(|s| Self::check(manifest, s)) {
            None => Signature::Unsigned,
            Some(Ok(key)) => Signature::Signed { key_id: key.id() },
            Some(Err(reason)) => Signature::Bad { reason },
        }
    }

    /// The key that signed `manifest` if `sig` is a valid signature of it.
    fn check(manifest: &[u8], sig: &[u8]) -> Result<PublicKey, String> {
        let f: SignatureFile = serde_json::from_slice(sig)
            .map_err(|e| format!("its signature object is unreadable: {e}"))?;
        if f.format != SIGNATURE_FORMAT_NAME {
            return Err(format!("its signature object has format {:?}", f.format));
        }
        if f.version > SIGNATURE_FORMAT_VERSION || f.algorithm != ALGORITHM {
            return Err(format!(
                "its signature is of version {} / {:?}, which this build does not read; upgrade \
                 gpu-checkpoint",
                f.version, f.algorithm
            ));
        }
        let key = PublicKey::from_base64(&f.public_key)?;
        let sig = B64
            .decode(&f.signature)
            .map_err(|e| format!("bad base64 in signature: {e}"))?;
        if !key.verify(&[SIGNED_CONTEXT, manifest], &sig) {
            return Err(format!(
                "its signature (key {}) does not match its manifest: the manifest was changed after \
                 it was signed, or the signature belongs to another one",
                key.id()
            ));
        }
        Ok(key)
    }

    /// Text for `list` and `inspect`.
    pub fn describe(&self) -> String {
        match self {
            Signature::Unsigned => "unsigned".into(),
            Signature::Signed { key_id } => format!("signed by {key_id}"),
            Signature::Bad { reason } => format!("BAD SIGNATURE: {reason}"),
        }
    }
}

/// Makes a new key pair: the private key written to `out` (PEM PKCS#8, mode 0600, created new: an existing
/// file or link there is refused), the public key to `out.pub` (its text form, a line; created new too).
/// Returns the public key.
pub fn generate_key_files(out: &Path) -> Result<PublicKey, KeyError> {
    let rng = ring::rand::SystemRandom::new();
    let doc = Ed25519KeyPair::generate_pkcs8(&rng)
        .map_err(|_| key_error(out, "the system's random source failed"))?;
    let key = SigningKey::from_pkcs8(doc.as_ref()).map_err(|r| key_error(out, r))?;
    let mut pem = String::from("-----BEGIN PRIVATE KEY-----\n");
    for line in B64.encode(doc.as_ref()).as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        pem.push('\n');
    }
    pem.push_str("-----END PRIVATE KEY-----\n");
    let public_path = public_path(out);
    write_new(out, pem.as_bytes(), 0o600)?;
    let line = format!("{}\n", key.public().to_text());
    if let Err(e) = write_new(&public_path, line.as_bytes(), 0o644) {
        let _ = std::fs::remove_file(out);
        return Err(e);
    }
    Ok(key.public())
}

/// Where [`generate_key_files`] writes the public key of the private key `out`: `out.pub`.
pub fn public_path(out: &Path) -> PathBuf {
    let mut p = out.as_os_str().to_owned();
    p.push(".pub");
    PathBuf::from(p)
}

fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), KeyError> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => {
                key_error(path, "exists already; a key file is never overwritten")
            }
            _ => key_error(path, e.to_string()),
        })?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(|e| {
        // What this call created, cut short (a full disk): not left as a key.
        let _ = std::fs::remove_file(path);
        key_error(path, e.to_string())
    })
}

#[cfg(test)]
#[path = "signing_tests.rs"]
mod tests;
