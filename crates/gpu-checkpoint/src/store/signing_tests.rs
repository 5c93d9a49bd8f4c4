use super::*;

fn key() -> SigningKey {
    let rng = ring::rand::SystemRandom::new();
    let doc = Ed25519KeyPair::generate_pkcs8(&rng).unwrap();
    SigningKey::from_pkcs8(doc.as_ref()).unwrap()
}

const MANIFEST: &[u8] = br#"{"format":"gpu-checkpoint-manifest","id":"x","files":[]}"#;

#[test]
fn a_signature_verifies_with_its_key_only_and_over_the_exact_bytes() {
    let k = key();
    let sig = k.sign_manifest(MANIFEST);
    let trusted = TrustedKeys::new(vec![k.public()]);
    assert_eq!(trusted.check(MANIFEST, Some(&sig)), Ok(k.public().id()));
    assert_eq!(
        Signature::of(MANIFEST, Some(&sig)),
        Signature::Signed {
            key_id: k.public().id()
        }
    );
    // Any flipped byte of the manifest, or one trailing byte more, breaks it.
    for i in 0..MANIFEST.len() {
        let mut m = MANIFEST.to_vec();
        m[i] ^= 0x01;
        let err = trusted.check(&m, Some(&sig)).unwrap_err();
        assert!(err.contains("does not match"), "{err}");
    }
    assert!(trusted
        .check(&[MANIFEST, b" "].concat(), Some(&sig))
        .is_err());
    // Another key: signed, but not trusted.
    let other = key();
    let err = TrustedKeys::new(vec![other.public()])
        .check(MANIFEST, Some(&sig))
        .unwrap_err();
    assert!(err.contains("not a trusted key"), "{err}");
    // Unsigned.
    assert!(trusted
        .check(MANIFEST, None)
        .unwrap_err()
        .contains("not signed"));
    assert_eq!(Signature::of(MANIFEST, None), Signature::Unsigned);
    // A signature made with another key, relabelled with the trusted public key.
    let forged = String::from_utf8(other.sign_manifest(MANIFEST))
        .unwrap()
        .replace(&B64.encode(other.public().0), &B64.encode(k.public().0));
    assert!(trusted.check(MANIFEST, Some(forged.as_bytes())).is_err());
    assert!(matches!(
        Signature::of(MANIFEST, Some(b"garbage")),
        Signature::Bad { .. }
    ));
}

#[test]
fn an_openssl_style_v1_pkcs8_key_signs() {
    // What `openssl genpkey -algorithm ed25519` writes: PKCS#8 version 1, the 32-byte seed only.
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend_from_slice(&[7u8; 32]);
    let pem = format!(
        "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n",
        B64.encode(&der)
    );
    let a = SigningKey::from_pkcs8(&der).unwrap();
    let b = SigningKey::from_pkcs8(pem.as_bytes()).unwrap();
    assert_eq!(a.public(), b.public());
    let sig = b.sign_manifest(MANIFEST);
    assert!(TrustedKeys::new(vec![a.public()])
        .check(MANIFEST, Some(&sig))
        .is_ok());
    assert!(SigningKey::from_pkcs8(
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
    )
    .is_err());
}

#[test]
fn public_keys_round_trip_through_their_text() {
    let k = key().public();
    let text = k.to_text();
    assert!(text.starts_with("ed25519 "));
    assert_eq!(PublicKey::parse(&format!("{text} node-7")).unwrap(), k);
    assert!(PublicKey::parse("ssh-ed25519 AAAA").is_err());
    assert!(PublicKey::parse("ed25519 AAAA").is_err());
    assert_eq!(k.id().len(), "ed25519:".len() + 16);
}

#[test]
fn key_files_are_made_private_and_refused_when_they_are_not() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("node.key");
    let public = generate_key_files(&out).unwrap();
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(SigningKey::load(&out).unwrap().public(), public);
    assert_eq!(TrustedKeys::load(&public_path(&out)).unwrap(), vec![public]);
    let again = generate_key_files(&out).unwrap_err();
    assert!(again.reason.contains("never overwritten"), "{again}");
    // Readable by others: refused, and the message never holds the key.
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = SigningKey::load(&out).unwrap_err().to_string();
    assert!(err.contains("mode 644"), "{err}");
    assert!(!err.contains("BEGIN"));
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o600)).unwrap();
    // A link to it: refused.
    let link = dir.path().join("link.key");
    std::os::unix::fs::symlink(&out, &link).unwrap();
    let err = SigningKey::load(&link).unwrap_err().to_string();
    assert!(err.contains("symbolic link"), "{err}");
    // A folder of public keys: every *.pub in it; refused when others may add one.
    let trusted = dir.path().join("trusted-keys");
    std::fs::create_dir(&trusted).unwrap();
    std::fs::copy(public_path(&out), trusted.join("node-1.pub")).unwrap();
    std::fs::write(trusted.join("README"), "not a key").unwrap();
    assert_eq!(TrustedKeys::load(&trusted).unwrap(), vec![public]);
    std::fs::set_permissions(&trusted, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert!(TrustedKeys::load(&trusted).is_err());
    std::fs::set_permissions(&trusted, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink(public_path(&out), trusted.join("node-2.pub")).unwrap();
    let err = TrustedKeys::load(&trusted).unwrap_err().to_string();
    assert!(err.contains("symbolic link"), "{err}");
    // A trust file others may change: refused.
    let pubfile = public_path(&out);
    std::fs::set_permissions(&pubfile, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert!(TrustedKeys::load(&pubfile).is_err());
    assert_eq!(
        KeyError {
            path: out,
            reason: String::new()
        }
        .exit_status(),
        ExitStatus::Usage
    );
}
