//! Signed checkpoints through the binary: `key generate`, `checkpoint --sign-key`, and `restore`,
//! `inspect`, `verify`, `list` with `--trust-key` (docs/security.md, "Signed checkpoints"). The first test
//! needs neither root nor CRIU (the checkpoints are made through the library); the second checkpoints and
//! restores a real process (root and CRIU: fails in CI without them, skips locally with the reason).

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use common::*;
use gpu_checkpoint::store::signing::SigningKey;
use gpu_checkpoint::store::{manifest, CheckpointInfo, NoProgress, Store, StoreOptions};

/// `key generate --out DIR/NAME`: the private key's path and the public key's file.
fn generate(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
    let key = dir.join(name);
    let out = ok(&gc(&["key", "generate", "--out", key.to_str().unwrap()]));
    let public = dir.join(format!("{name}.pub"));
    assert_eq!(out, fs::read_to_string(&public).unwrap());
    assert!(out.starts_with("ed25519 "), "{out}");
    (key, public)
}

fn mode(p: &Path) -> u32 {
    fs::metadata(p).unwrap().permissions().mode() & 0o777
}

/// Replaces the files of checkpoint `of`'s manifest with those of `with` (a valid manifest, checksum
/// included, naming another checkpoint's chunks: what a store writer could put there). Returns the
/// original bytes.
fn swap_files(manifest_path: &Path, with: &CheckpointInfo) -> Vec<u8> {
    let original = fs::read(manifest_path).unwrap();
    let mut info = manifest::decode(&original).unwrap();
    info.files = with.files.clone();
    fs::write(manifest_path, manifest::encode(&info)).unwrap();
    original
}

fn commit(store: &Store, name: &str, seed: u8) -> CheckpointInfo {
    let ing = store.begin(Some(name)).unwrap();
    let pages = ing.staging_dir().join("pages-1.img");
    fs::write(pages, [seed; 300_000]).unwrap();
    ing.commit(serde_json::json!({}), &NoProgress).unwrap()
}

#[test]
fn keys_are_made_private_and_store_commands_show_and_check_signatures() {
    let t = tempfile::tempdir().unwrap();
    let (key, public) = generate(t.path(), "node.key");
    assert_eq!(mode(&key), 0o600);
    let private = fs::read_to_string(&key).unwrap();
    // Never overwritten; bad input is exit 2.
    let again = gc(&["key", "generate", "--out", key.to_str().unwrap()]);
    assert!(fails_with(&again, 2).contains("never overwritten"));
    assert_eq!(fs::read_to_string(&key).unwrap(), private);
    // `key public` prints the same public key, and nothing prints the private one.
    let shown = gc(&["key", "public", key.to_str().unwrap()]);
    assert_eq!(ok(&shown), fs::read_to_string(&public).unwrap());
    let body = private.lines().nth(1).unwrap();
    assert!(!text(&shown.stdout).contains(body) && !text(&shown.stderr).contains(body));

    // A key OpenSSL made (PKCS#8 version 1) signs too.
    let openssl_key = t.path().join("openssl.key");
    let made = Command::new("openssl")
        .args(["genpkey", "-algorithm", "ed25519", "-out"])
        .arg(&openssl_key)
        .output()
        .map_err(|e| format!("openssl: {e}"))
        .and_then(|o| o.status.success().then_some(()).ok_or(text(&o.stderr)));
    let openssl = needs(
        "openssl key",
        &made,
        "openssl is installed with the base system",
    );
    if openssl {
        fs::set_permissions(&openssl_key, fs::Permissions::from_mode(0o600)).unwrap();
        ok(&gc(&["key", "public", openssl_key.to_str().unwrap()]));
    }
    let signing_key = if openssl { &openssl_key } else { &key };
    let trust_file = t.path().join("trusted.pub");
    let signer_public = ok(&gc(&["key", "public", signing_key.to_str().unwrap()]));
    fs::write(&trust_file, format!("# the fleet's key\n{signer_public}")).unwrap();

    let dir = t.path().join("store");
    let plain_store = Store::open(&dir, StoreOptions::default()).unwrap();
    let signer = Store::open(
        &dir,
        StoreOptions {
            sign_key: Some(Arc::new(SigningKey::load(signing_key).unwrap())),
            ..StoreOptions::default()
        },
    )
    .unwrap();
    let signed = commit(&signer, "job", 1);
    let plain = commit(&plain_store, "plain", 2);
    let storage = dir.to_str().unwrap();
    let trust = trust_file.to_str().unwrap();
    let key_id = signer.signature(&signed.id).unwrap();
    let gpu_checkpoint::store::signing::Signature::Signed { key_id } = key_id else {
        panic!("{key_id:?}")
    };

    // list and inspect say who signed what.
    let list: serde_json::Value = serde_json::from_str(&ok(&gc(&[
        "list",
        "--storage",
        storage,
        "--format",
        "json",
    ])))
    .unwrap();
    assert_eq!(list[0]["signature"]["status"], "signed");
    assert_eq!(list[0]["signature"]["key_id"], key_id.as_str());
    assert_eq!(list[1]["signature"]["status"], "unsigned");
    let listed = ok(&gc(&["list", "--storage", storage]));
    assert!(
        listed.contains("SIGNED") && listed.contains(&key_id),
        "{listed}"
    );
    let inspected = ok(&gc(&["inspect", &signed.id, "--storage", storage]));
    assert!(
        inspected.contains(&format!("signed by {key_id}")),
        "{inspected}"
    );

    // With the trusted key: the signed one passes, the unsigned one is refused (4; verify: 7).
    ok(&gc(&[
        "verify",
        "job",
        "--storage",
        storage,
        "--trust-key",
        trust,
    ]));
    let refused = gc(&[
        "inspect",
        "plain",
        "--storage",
        storage,
        "--trust-key",
        trust,
    ]);
    assert!(fails_with(&refused, 4).contains("not signed"));
    let verified = gc(&["verify", "--storage", storage, "--trust-key", trust]);
    fails_with(&verified, 7);
    assert!(text(&verified.stdout).contains("untrusted"));
    // Through the variable too.
    let by_env = Command::new(gc_bin())
        .args(["inspect", "plain", "--storage", storage])
        .env("GPU_CHECKPOINT_TRUST_KEYS", trust)
        .output()
        .unwrap();
    fails_with(&by_env, 4);

    // The signed manifest's chunk list swapped for another checkpoint's: refused, reported by verify.
    let path = signer.manifest_path(&signed.id).unwrap();
    let original = swap_files(&path, &plain);
    let refused = gc(&["inspect", "job", "--storage", storage, "--trust-key", trust]);
    assert!(fails_with(&refused, 4).contains("does not match"));
    let verified = gc(&["verify", "job", "--storage", storage]);
    fails_with(&verified, 7);
    assert!(text(&verified.stdout).contains("BAD SIGNATURE"));
    fs::write(&path, original).unwrap();
    ok(&gc(&[
        "inspect",
        "job",
        "--storage",
        storage,
        "--trust-key",
        trust,
    ]));

    // Key files others may read or change are refused (2), and so are links.
    fs::set_permissions(&trust_file, fs::Permissions::from_mode(0o666)).unwrap();
    let loose = gc(&["inspect", "job", "--storage", storage, "--trust-key", trust]);
    assert!(fails_with(&loose, 2).contains("other users may change it"));
    fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
    let mut sleeper = Command::new("sleep").arg("60").spawn().unwrap();
    let pid = sleeper.id().to_string();
    let loose = gc(&[
        "checkpoint",
        "--pid",
        &pid,
        "--storage",
        storage,
        "--sign-key",
        key.to_str().unwrap(),
    ]);
    let err = fails_with(&loose, 2);
    assert!(err.contains("mode 644") && !err.contains(body), "{err}");
    assert!(
        sleeper.try_wait().unwrap().is_none(),
        "the process was touched"
    );
    let _ = sleeper.kill();
    let _ = sleeper.wait();

    // gc removes a signature whose manifest is gone.
    fs::remove_file(&path).unwrap();
    let report: serde_json::Value =
        serde_json::from_str(&ok(&gc(&["gc", "--storage", storage, "--format", "json"]))).unwrap();
    assert_eq!(report["orphan_signatures_removed"], 1);
    assert!(!dir
        .join("manifests")
        .join(format!("{}.sig", signed.id))
        .exists());
}

/// `import --sign-key` signs what it stores, so that a podman archive imported into a store restores
/// where only signed checkpoints do; without the key the import is unsigned, and refused there. A bad
/// key file is refused before anything is stored. Needs neither root nor CRIU.
#[test]
fn an_imported_archive_is_signed_with_the_sign_key() {
    let t = tempfile::tempdir().unwrap();
    let (key, public) = generate(t.path(), "node.key");
    let archive = t.path().join("c1.tar");
    podman_archive(&archive, 20_000);
    let dir = t.path().join("store");
    let storage = dir.to_str().unwrap();
    let import = |name: &str, key: Option<&Path>| {
        let mut args = vec!["import", archive.to_str().unwrap(), "--name", name];
        args.extend(["--storage", storage, "--format", "json"]);
        if let Some(k) = key {
            args.extend(["--sign-key", k.to_str().unwrap()]);
        }
        gc(&args)
    };
    let signed: serde_json::Value =
        serde_json::from_str(&ok(&import("signed", Some(&key)))).unwrap();
    ok(&import("plain", None));
    let trust = public.to_str().unwrap();
    let inspect = |name: &str| gc(&["inspect", name, "--storage", storage, "--trust-key", trust]);
    let shown = ok(&inspect("signed"));
    assert!(shown.contains("signed by ed25519:"), "{shown}");
    assert!(shown.contains(signed["id"].as_str().unwrap()), "{shown}");
    assert!(fails_with(&inspect("plain"), 4).contains("not signed"));

    // A key others may read: refused (2) before anything is stored.
    fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
    fails_with(&import("loose", Some(&key)), 2);
    let listed = ok(&gc(&["list", "--storage", storage]));
    assert!(!listed.contains("loose"), "{listed}");
    assert!(listed.contains("plain"), "{listed}");
}

#[test]
fn a_signed_checkpoint_restores_only_with_its_trust_key_and_unchanged() {
    let Some((dir, store, w)) = criu_counter(3) else {
        return;
    };
    let (key, public) = generate(dir.path(), "node.key");
    let (_, stranger) = generate(dir.path(), "stranger.key");
    let key = key.to_str().unwrap();
    // Signed through the variable (how a fleet's nodes are set up), the tree left running.
    let signed = run_checkpoint_env(
        w.pid,
        &store,
        &["--format", "json", "--leave-running"],
        &[("GPU_CHECKPOINT_SIGN_KEY", key)],
    );
    let signed: serde_json::Value = serde_json::from_str(&ok(&signed)).unwrap();
    let plain = checkpoint(w.pid, &store, &[]);
    assert!(!w.alive());
    let stopped_at = num(
        &gpu_checkpoint_workloads::read_state(&w.state).unwrap()[0],
        "seq",
    );
    wait_pid_free(w.pid);
    let id = signed["id"].as_str().unwrap();
    let trust = public.to_str().unwrap();
    let restore_fails = |target: &str, trust: &str, why: &str| {
        let out = gc(&restore_args(target, &store, &["--trust-key", trust]));
        assert!(fails_with(&out, 4).contains(why));
        assert!(!w.alive(), "a refused restore ran the checkpoint");
    };
    // Unsigned, or signed by a key not trusted: refused before anything is restored.
    restore_fails(plain["id"].as_str().unwrap(), trust, "not signed");
    restore_fails(id, stranger.to_str().unwrap(), "not a trusted key");
    // The manifest edited to name the unsigned checkpoint's chunks: refused.
    let s = Store::open(&store, StoreOptions::default()).unwrap();
    let path = s.manifest_path(id).unwrap();
    let original = swap_files(&path, &s.get(plain["id"].as_str().unwrap()).unwrap());
    restore_fails(id, trust, "does not match");
    // By its manifest's path as well.
    let by_path = gc(&[
        "restore",
        "--metadata",
        path.to_str().unwrap(),
        "--storage",
        store.to_str().unwrap(),
        "--trust-key",
        trust,
    ]);
    fails_with(&by_path, 4);
    fs::write(&path, original).unwrap();
    // As signed, with its key: restored, and it goes on.
    let pid = restore_with(id, &store, &["--trust-key", trust]);
    assert_eq!(pid, w.pid);
    w.wait_state("progress after the signed restore", |r| {
        num(&r[0], "seq") > stopped_at + 2
    });
    w.kill_and_wait_free();
}
