//! `export --format oci-checkpoint` and `import`: a real runc container's checkpoint written as the
//! podman/CRI-O checkpoint archive (its entries, its CRIU images byte-identical to the stored ones, never
//! overwriting a file), imported back into a store (deduplicated, verified, exported again unchanged) and
//! restored by runc from the imported checkpoint. Needs root, CRIU, runc and busybox-static: fails in CI
//! without them, skips locally.

mod container_support;

use container_support::*;
use gpu_checkpoint::store::{NoProgress, Store, StoreOptions};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Output;

fn json(o: &Output, what: &str) -> serde_json::Value {
    assert!(o.status.success(), "{what}: {}", text(o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The files of a stored checkpoint, read back through the store.
fn stored(store: &Path, id: &str, into: &Path) -> BTreeMap<String, Vec<u8>> {
    let s = Store::open(store, StoreOptions::default()).unwrap();
    s.materialize(id, into, &NoProgress).unwrap();
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(into).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            let name = e.file_name().to_string_lossy().into_owned();
            out.insert(name, std::fs::read(e.path()).unwrap());
        }
    }
    out
}

#[test]
fn a_runc_checkpoint_exports_as_a_podman_archive_and_imports_back_deduplicated() {
    let Some(scene) = Scene::memory("16") else {
        return;
    };
    let Scene {
        store,
        runc,
        bundle,
        dir,
    } = &scene;
    let id = scene.run("arch");
    let mem = bundle.rootfs().join("state/mem");
    let verified = || state_field(&mem, "verified");
    wait_for("the workload", &|| verified().is_some_and(|v| v > 0));
    let ck_id = checkpoint_container(store, runc, &id);
    let st = store.display().to_string();

    // Export: podman's layout, the images byte for byte.
    let archive = dir.path().join("ck.tar");
    let a = archive.display().to_string();
    let out = gc_run(&[
        "export",
        &ck_id,
        "--format",
        "oci-checkpoint",
        "-o",
        &a,
        "--storage",
        &st,
    ]);
    assert!(out.status.success(), "export: {}", text(&out));
    let files = archive_entries(&archive);
    let config: serde_json::Value = serde_json::from_slice(&files["config.dump"]).unwrap();
    assert_eq!(config["id"], id.as_str());
    assert_eq!(config["runtime"], "runc");
    assert_eq!(
        config["name"],
        id.as_str(),
        "a runc container's name is its id"
    );
    // spec.dump is the bundle's config.json, with the engine annotation checkpointctl reads added.
    let mut spec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bundle.dir.join("config.json")).unwrap()).unwrap();
    spec["annotations"]["io.container.manager"] = "libpod".into();
    let dumped: serde_json::Value = serde_json::from_slice(&files["spec.dump"]).unwrap();
    assert_eq!(dumped, spec, "spec.dump is the bundle's config.json");
    let images = stored(store, &ck_id, &dir.path().join("mat1"));
    assert!(images.contains_key("inventory.img") && images.contains_key("descriptors.json"));
    assert!(images.keys().any(|k| k.starts_with("pages-")));
    for (name, data) in &images {
        let in_archive = if name == "dump.log" || name == "stats-dump" {
            name.clone()
        } else {
            format!("checkpoint/{name}")
        };
        assert!(
            files.get(&in_archive) == Some(data),
            "{in_archive} differs from the stored {name}"
        );
    }
    assert_eq!(files.len(), images.len() + 2, "{:?}", files.keys());
    let mode = std::os::unix::fs::PermissionsExt::mode(&archive.metadata().unwrap().permissions());
    assert_eq!(mode & 0o077, 0, "the archive holds process memory: private");
    // An existing file is never overwritten.
    let again = gc_run(&["export", &ck_id, "-o", &a, "--storage", &st]);
    assert_eq!(again.status.code(), Some(2), "{}", text(&again));
    assert_eq!(archive_entries(&archive), files);

    // Import into a new store: verified; into the first store: deduplicated against the original.
    let store2 = dir.path().join("store2");
    let s2 = store2.display().to_string();
    let imp = import_archive(&archive, &store2);
    assert_eq!(imp["container"], id.as_str());
    let imp_id = imp["id"].as_str().unwrap().to_string();
    let v = gc_run(&["verify", &imp_id, "--storage", &s2]);
    assert!(v.status.success(), "verify: {}", text(&v));
    let dedup = import_archive(&archive, store);
    let (new, logical) = (
        dedup["stats"]["new_bytes"].as_u64().unwrap(),
        dedup["stats"]["logical_bytes"].as_u64().unwrap(),
    );
    assert!(logical > 16 << 20, "{logical}");
    assert!(
        new < 256 << 10,
        "only the metadata is new: {new} of {logical}"
    );

    // The imported checkpoint exports the same archive again.
    let archive2 = dir.path().join("ck2.tar");
    let out = export_archive(&store2, &imp_id, &archive2, &[]);
    assert!(out.status.success(), "export of the import: {}", text(&out));
    assert_eq!(archive_entries(&archive2), files);
    // Its root file system changes are the engine's own: a base to diff against is refused (exit 2).
    let a3 = dir.path().join("ck3.tar").display().to_string();
    let rootfs = bundle.rootfs().display().to_string();
    let out = gc_run(&[
        "export",
        &imp_id,
        "-o",
        &a3,
        "--storage",
        &s2,
        "--rootfs-base",
        &rootfs,
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--rootfs-base"), "{}", text(&out));
    assert!(!std::path::Path::new(&a3).exists());

    // runc restores the imported checkpoint, once told the bundle (the archive does not say where).
    let mut args = vec!["restore", &imp_id, "--container", &id, "--format", "json"];
    let sargs2 = store_args(&store2, runc);
    args.extend(sargs2.iter().map(String::as_str));
    let no_bundle = gc_run(&args);
    assert_eq!(no_bundle.status.code(), Some(2), "{}", text(&no_bundle));
    let b = bundle.dir.display().to_string();
    args.extend(["--bundle", &b]);
    json(&gc_run(&args), "restore of the import");
    assert_eq!(runc.state(&id).map(|s| s.0).as_deref(), Some("running"));
    let before = verified().unwrap();
    wait_for("the memory verified again", &|| {
        verified().is_some_and(|v| v > before)
    });
}
