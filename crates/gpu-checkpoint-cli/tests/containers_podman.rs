//! The podman checkpoint archive round trip with the real podman (4.3.1, `--runtime runc`, our CRIU
//! through a wrapper on PATH): `podman container checkpoint --export` (zstd) → `gpu-checkpoint import`
//! (stored, verified) → `gpu-checkpoint export` (the same files, byte for byte) → `podman container
//! restore --import`, the restored container's shell state carried on. Needs root, CRIU, runc, podman and
//! busybox-static: fails in CI without them, skips locally.

mod container_support;

use container_support::podman::*;
use container_support::*;

#[test]
fn a_podman_checkpoint_goes_through_the_store_and_podman_restores_it() {
    if !podman_ready() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let podman = Podman::new(dir.path());
    // A local image from the test's minimal root file system (no registry is reached).
    let bundle = Bundle::new(&dir.path().join("bundle"), &["true"], &[]);
    let image = "localhost/gpu-checkpoint-test:1";
    podman.import_rootfs(&bundle, image);
    let name = format!("gc-{}-podman", std::process::id());
    podman.run_counter(&name, image, COUNTER, 20);
    let long_id = podman.ok(&["inspect", "--format", "{{.Id}}", &name]);

    // podman's archive (zstd, its default) into the store.
    let theirs = dir.path().join("podman.tar.zst");
    podman.ok(&[
        "container",
        "checkpoint",
        "--export",
        &theirs.display().to_string(),
        &name,
    ]);
    let at_checkpoint = {
        let files = archive_entries(&theirs);
        assert!(
            files.contains_key("checkpoint/inventory.img"),
            "{:?}",
            files.keys()
        );
        files
    };
    let store = dir.path().join("store");
    let s = store.display().to_string();
    let o = gc_run(&[
        "import",
        &theirs.display().to_string(),
        "--storage",
        &s,
        "--format",
        "json",
    ]);
    assert!(o.status.success(), "import: {}", text(&o));
    let imp: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(imp["container"], long_id.as_str());
    let id = imp["id"].as_str().unwrap();
    let v = gc_run(&["verify", id, "--storage", &s]);
    assert!(v.status.success(), "verify: {}", text(&v));

    // Out again: the same files as podman wrote, and podman restores it.
    let ours = dir.path().join("ours.tar");
    let o = gc_run(&[
        "export",
        id,
        "-o",
        &ours.display().to_string(),
        "--storage",
        &s,
    ]);
    assert!(o.status.success(), "export: {}", text(&o));
    assert_eq!(archive_entries(&ours), at_checkpoint);
    podman.ok(&["rm", "--force", &name]);
    podman.ok(&[
        "container",
        "restore",
        "--import",
        &ours.display().to_string(),
    ]);
    let state = podman.ok(&["inspect", "--format", "{{.State.Status}}", &name]);
    assert_eq!(state, "running");
    // The shell's counter goes on from where it was, not from 1: its memory came back.
    let restored_at = podman.counter(&name);
    assert!(restored_at >= 20, "counter restarted: {restored_at}");
    wait_for("the restored counter", &|| {
        podman.counter(&name) > restored_at
    });
}
