use super::*;

#[test]
fn store_and_archive_names_map_both_ways() {
    for (stored, archived) in [
        ("pages-1.img", "checkpoint/pages-1.img"),
        ("descriptors.json", "checkpoint/descriptors.json"),
        ("dump.log", "dump.log"),
        ("stats-dump", "stats-dump"),
        ("oci/config.dump", "config.dump"),
        ("oci/rootfs-diff.tar", "rootfs-diff.tar"),
        ("oci/artifacts/x", "artifacts/x"),
        ("oci/checkpoint/sub/y", "checkpoint/sub/y"),
    ] {
        assert_eq!(archive_name(stored), archived, "{stored}");
        if !TOP_LEVEL.contains(&stored) {
            assert_eq!(stored_name(archived), stored, "{archived}");
        }
    }
}

#[test]
fn spec_dump_names_the_engine_unless_the_bundle_does() {
    let p = Path::new("config.json");
    let plain = spec_dump(
        p,
        br#"{"ociVersion": "1.0.2", "root": {"path": "rootfs"}}"#.to_vec(),
    );
    let v: serde_json::Value = serde_json::from_slice(&plain.unwrap()).unwrap();
    assert_eq!(v["annotations"]["io.container.manager"], "libpod");
    assert_eq!(v["root"]["path"], "rootfs");
    let cri = br#"{"annotations": {"io.container.manager": "cri-o", "a": "b"}}"#.to_vec();
    assert_eq!(
        spec_dump(p, cri.clone()).unwrap(),
        cri,
        "kept byte for byte"
    );
    assert!(spec_dump(p, b"[1]".to_vec()).is_err());
    assert!(spec_dump(p, br#"{"annotations": 1}"#.to_vec()).is_err());
}

#[test]
fn entries_that_leave_the_folder_are_refused() {
    let a = Path::new("a.tar");
    assert_eq!(
        safe_entry_path(a, Path::new("./checkpoint/x.img")).unwrap(),
        "checkpoint/x.img"
    );
    assert!(safe_entry_path(a, Path::new("../x")).is_err());
    assert!(safe_entry_path(a, Path::new("/etc/passwd")).is_err());
    assert!(safe_entry_path(a, Path::new("checkpoint/../../x")).is_err());
}

/// One archive entry: name, kind, data.
type Entry<'a> = (&'a str, tar::EntryType, &'a [u8]);

/// An archive of `entries`.
fn archive(dir: &Path, entries: &[Entry<'_>]) -> PathBuf {
    let path = dir.join("a.tar");
    let mut b = tar::Builder::new(File::create(&path).unwrap());
    for (name, kind, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_size(data.len() as u64);
        h.set_mode(0o600);
        if *kind == tar::EntryType::Symlink {
            h.set_size(0);
            b.append_link(&mut h, name, "/etc/shadow").unwrap();
        } else {
            b.append_data(&mut h, name, *data).unwrap();
        }
    }
    b.finish().unwrap();
    path
}

#[test]
fn a_bad_archive_stores_nothing() {
    use tar::EntryType::{Regular, Symlink};
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s"), crate::store::StoreOptions::default()).unwrap();
    let config: &[u8] = br#"{"id": "c1", "name": "c1", "runtime": "runc", "createdTime": "x"}"#;
    let cases: [(&str, Vec<Entry<'_>>, &str); 4] = [
        (
            "no config",
            vec![("checkpoint/inventory.img", Regular, b"i")],
            "no config.dump",
        ),
        (
            "no images",
            vec![("config.dump", Regular, config)],
            "no checkpoint/inventory.img",
        ),
        (
            "a link",
            vec![
                ("config.dump", Regular, config),
                ("checkpoint/x", Symlink, b""),
            ],
            "not a regular file",
        ),
        (
            "bad json",
            vec![
                ("config.dump", Regular, b"{"),
                ("checkpoint/inventory.img", Regular, b"i"),
            ],
            "config.dump",
        ),
    ];
    for (what, entries, says) in cases {
        let a = archive(dir.path(), &entries);
        let e = import_oci(&store, &a, None, &crate::store::NoProgress).unwrap_err();
        assert!(e.to_string().contains(says), "{what}: {e}");
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::ExitStatus::Usage,
            "{what}"
        );
        assert!(store.list().unwrap().is_empty(), "{what}: nothing stored");
    }
    let good = archive(
        dir.path(),
        &[
            ("config.dump", Regular, config),
            ("checkpoint/inventory.img", Regular, b"inv"),
        ],
    );
    let out = import_oci(&store, &good, Some("n"), &crate::store::NoProgress).unwrap();
    assert_eq!(
        (out.container.as_str(), out.runtime.as_str()),
        ("c1", "runc")
    );
    let mut paths: Vec<_> = out.info.files.iter().map(|f| f.path.clone()).collect();
    paths.sort();
    assert_eq!(paths, ["inventory.img", "oci/config.dump"]);
}
