//! The podman checkpoint archive round trip with the real podman (4.3.1, `--runtime runc`, our CRIU
//! through a wrapper on PATH): `podman container checkpoint --export` (zstd) → `gpu-checkpoint import`
//! (stored, verified) → `gpu-checkpoint export` (the same files, byte for byte) → `podman container
//! restore --import`, the restored container's shell state carried on. Needs root, CRIU, runc, podman and
//! busybox-static: fails in CI without them, skips locally.

mod container_support;

use container_support::podman::*;
use container_support::*;
use std::path::Path;

#[test]
fn a_podman_checkpoint_goes_through_the_store_and_podman_restores_it() {
    // A local image from the test's minimal root file system (no registry is reached).
    let image = "localhost/gpu-checkpoint-test:1";
    let name = cid("podman");
    let Some((dir, podman)) = podman_with_image(image) else {
        return;
    };
    podman.run_counter(&name, image, COUNTER, 20);
    let long_id = podman.ok(&["inspect", "--format", "{{.Id}}", &name]);

    // podman's archive (zstd, its default) into the store.
    let theirs = dir.path().join("podman.tar.zst");
    podman.export_checkpoint(&name, &theirs, &[]);
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
    let imp = import_archive(&theirs, &store);
    assert_eq!(imp["container"], long_id.as_str());
    let id = imp["id"].as_str().unwrap();
    let v = gc_run(&["verify", id, "--storage", &store.display().to_string()]);
    assert!(v.status.success(), "verify: {}", text(&v));

    // Out again: the same files as podman wrote, and podman restores it.
    let ours = dir.path().join("ours.tar");
    let o = export_archive(&store, id, &ours, &[]);
    assert!(o.status.success(), "export: {}", text(&o));
    assert_eq!(archive_entries(&ours), at_checkpoint);
    podman.ok(&["rm", "--force", &name]);
    podman.import_checkpoint(&ours, &[]);
    let state = podman.ok(&["inspect", "--format", "{{.State.Status}}", &name]);
    assert_eq!(state, "running");
    // The shell's counter goes on from where it was, not from 1: its memory came back.
    let restored_at = podman.counter(&name);
    assert!(restored_at >= 20, "counter restarted: {restored_at}");
    wait_for("the restored counter", &|| {
        podman.counter(&name) > restored_at
    });
}

/// `gpu-checkpoint ARGS...` with `fault` injected (`GPU_CHECKPOINT_FAULT`).
fn gc_with_fault(args: &[&str], fault: &str) -> std::process::Output {
    std::process::Command::new(gpu_checkpoint())
        .args(args)
        .env("GPU_CHECKPOINT_FAULT", fault)
        .output()
        .unwrap()
}

#[test]
fn a_podman_archives_root_file_system_changes_are_applied_by_a_runc_restore() {
    let image = "localhost/gpu-checkpoint-diff:1";
    let Some((dir, podman)) = podman_with_image(image) else {
        return;
    };
    let name = cid("diff");
    // The container adds a file and a folder and removes one of the image's files. (It does not change
    // one: podman 4.3.1 leaves changed files out of its rootfs-diff.tar.)
    let script =
        format!("echo added > /new.txt; mkdir /data; echo x > /data/f; rm /bin/nc; {COUNTER}");
    podman.run_counter(&name, image, &script, 20);
    let theirs = dir.path().join("podman.tar.zst");
    podman.export_checkpoint(&name, &theirs, &[]);
    let files = archive_entries(&theirs);
    assert!(files.contains_key("rootfs-diff.tar"), "{:?}", files.keys());
    let deleted: Vec<String> = serde_json::from_slice(&files["deleted.files"]).unwrap();
    assert_eq!(deleted, ["/bin/nc"]);
    let store = dir.path().join("store");
    let ck = import_archive(&theirs, &store)["id"]
        .as_str()
        .unwrap()
        .to_string();

    // runc restores it into a bundle of the image's files, with the container's own spec (its mounts are
    // podman's, which stay until the podman container is removed).
    let bundle = Bundle::new(&dir.path().join("restore"), &["true"], &[]);
    // The image's root folder is read-only (0555) in podman's storage; CRIU checks the mode.
    let rootfs = bundle.rootfs();
    std::fs::set_permissions(&rootfs, std::os::unix::fs::PermissionsExt::from_mode(0o555)).unwrap();
    let mut spec: serde_json::Value = serde_json::from_slice(&files["spec.dump"]).unwrap();
    spec["root"]["path"] = bundle.rootfs().display().to_string().into();
    spec["root"]["readonly"] = false.into();
    std::fs::write(
        bundle.dir.join("config.json"),
        serde_json::to_vec(&spec).unwrap(),
    )
    .unwrap();
    let runc = Runc::new(dir.path());
    let id = cid("diffr");
    let b = bundle.dir.display().to_string();
    let mut args = vec!["restore", &ck, "--container", &id, "--bundle", &b];
    let sargs = store_args(&store, &runc);
    args.extend(sargs.iter().map(String::as_str));
    let is_untouched = || {
        !rootfs.join("new.txt").exists()
            && !rootfs.join("data").exists()
            && rootfs.join("bin/nc").symlink_metadata().is_ok()
    };
    // A restore that fails half-way through the changes, or in the runtime, leaves the rootfs as it was;
    // so does the guardian when the tool is SIGKILLed right after the changes (it did not: the added files
    // stayed and /bin/nc was gone).
    for fault in [
        "container.rootfs-apply=eio",
        "container.runtime-restore=eio",
        "container.rootfs-applied=kill",
    ] {
        let o = gc_with_fault(&args, fault);
        assert!(!o.status.success(), "{fault}: {}", text(&o));
        if fault.ends_with("=kill") {
            assert_eq!(o.status.code(), None, "{fault}: killed: {}", text(&o));
            wait_for("the guardian's undo of the rootfs", &is_untouched);
        }
        assert!(is_untouched(), "{fault}: the rootfs changed");
        assert_eq!(runc.state(&id), None, "{fault}");
    }

    let o = gc_run(&args);
    assert!(o.status.success(), "restore: {}", text(&o));
    assert_eq!(runc.state(&id).map(|s| s.0).as_deref(), Some("running"));
    assert_eq!(runc.exec(&id, &["cat", "/new.txt"]), "added\n");
    assert_eq!(runc.exec(&id, &["cat", "/data/f"]), "x\n");
    assert!(
        rootfs.join("bin/nc").symlink_metadata().is_err(),
        "deleted.files applied"
    );
    let counter = || -> u64 {
        // The shell truncates the file, then writes it: read again if caught in between.
        (0..20)
            .find_map(|_| {
                let n = runc.exec(&id, &["cat", "/tmp/c"]).trim().parse().ok();
                if n.is_none() {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                n
            })
            .expect("/tmp/c never held a number")
    };
    let at = counter();
    assert!(at >= 20, "the shell's memory came back: {at}");
    wait_for("the restored counter", &|| counter() > at);
}

#[test]
fn podman_restores_an_export_of_our_runc_checkpoint_given_the_image() {
    let Some(dir) = podman_folder() else { return };
    let podman = Podman::new(dir.path());
    // A runc container whose bundle is also a podman image. podman's image root folder is 0555 and
    // CRIU checks the root's mode on restore: the bundle's is made the same.
    // Once the image is made from it, the container adds a file (the root folder is 0555 and runc's
    // default capabilities do not override it: into /state), removes one of the image's and keeps
    // a file of its own open (CRIU's restore needs that one in the root file system): the archive must
    // carry them for podman, which restores on top of the image.
    let script = format!(
        "echo added > /state/new.txt; rm /bin/nc; exec 3>>/state/app.log; echo start >&3; {COUNTER}"
    );
    let bundle = Bundle::new(&dir.path().join("bundle"), &[&script], &[]);
    let rootfs = bundle.rootfs();
    std::fs::set_permissions(&rootfs, std::os::unix::fs::PermissionsExt::from_mode(0o555)).unwrap();
    let image = "localhost/gpu-checkpoint-ours:1";
    podman.import_rootfs(&bundle, image);
    let image_id = podman.ok(&["image", "inspect", "--format", "{{.Id}}", image]);
    let runc = Runc::new(dir.path());
    let id = cid("ours");
    runc.run(&id, &bundle);
    let count = |c: std::io::Result<String>| c.ok().and_then(|c| c.trim().parse::<u64>().ok());
    wait_for("the counter", &|| {
        count(std::fs::read_to_string(rootfs.join("tmp/c"))).is_some_and(|c| c >= 20)
    });
    let store = dir.path().join("store");
    let ck = checkpoint_container(&store, &runc, &id);
    let ck = ck.as_str();
    // Empty when the checkpoint froze the shell between truncating and writing it.
    let at = count(std::fs::read_to_string(rootfs.join("tmp/c"))).unwrap_or(0);
    let export = |to: &str, extra: &[&str]| export_archive(&store, ck, Path::new(to), extra);

    // Without the image podman cannot restore it: it looks the empty image name up.
    let plain = dir.path().join("plain.tar").display().to_string();
    assert!(export(&plain, &[]).status.success());
    let o = podman
        .cmd()
        .args(["container", "restore", "--import", &plain])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        text(&o).contains("repository name must have at least one component"),
        "{}",
        text(&o)
    );
    // A wrong id is refused by export (exit 2).
    let bad = dir.path().join("bad.tar").display().to_string();
    let o = export(&bad, &["--podman-image", image, "--podman-image-id", "abc"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));

    // The root file system changes, against the image's root file system.
    let base = podman.ok(&["image", "mount", &image_id]);
    let ours = dir.path().join("ours.tar").display().to_string();
    let o = export(
        &ours,
        &[
            "--podman-image",
            image,
            "--podman-image-id",
            &image_id,
            "--rootfs-base",
            &base,
        ],
    );
    assert!(o.status.success(), "export: {}", text(&o));
    let files = archive_entries(Path::new(&ours));
    let deleted: Vec<String> = serde_json::from_slice(&files["deleted.files"]).unwrap();
    assert_eq!(deleted, ["/bin/nc"]);
    let mut diff = tar::Archive::new(&files["rootfs-diff.tar"][..]);
    let mut carried: Vec<String> = diff
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    carried.sort();
    assert_eq!(
        carried,
        ["state/app.log", "state/new.txt", "tmp/c"],
        "{}",
        text(&o)
    );
    podman.ok(&["image", "unmount", &image_id]);
    podman.import_checkpoint(Path::new(&ours), &[]);
    let state = podman.ok(&["inspect", "--format", "{{.State.Status}}", &id]);
    assert_eq!(state, "running");
    assert_eq!(
        podman.ok(&["inspect", "--format", "{{.ImageName}}", &id]),
        image
    );
    assert_eq!(
        podman.ok(&["exec", &id, "busybox", "cat", "/state/new.txt"]),
        "added"
    );
    assert_eq!(
        podman.ok(&["exec", &id, "busybox", "cat", "/state/app.log"]),
        "start"
    );
    let o = podman
        .cmd()
        .args(["exec", &id, "busybox", "test", "-e", "/bin/nc"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "/bin/nc was removed by the container");
    // The shell's counter goes on from where it was when checkpointed, under podman.
    let restored_at = podman.counter(&id);
    assert!(restored_at >= at, "counter restarted: {restored_at} < {at}");
    wait_for("the restored counter", &|| {
        podman.counter(&id) > restored_at
    });
    podman.ok(&["stop", "--time", "1", &id]);
}
