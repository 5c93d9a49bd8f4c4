//! Our checkpoint archives read by the real checkpointctl (1.3.0, installed by
//! scripts/install-checkpointctl.sh): `checkpointctl show` and `inspect` of an export of a runc
//! container's checkpoint taken by `checkpoint --container`, and of an export of an imported podman
//! archive. Needs root, CRIU, runc, podman, busybox-static and checkpointctl: fails in CI without them,
//! skips locally.

mod container_support;

use container_support::podman::*;
use container_support::*;
use std::path::{Path, PathBuf};
use std::process::Command;

/// checkpointctl: `GPU_CHECKPOINT_CHECKPOINTCTL`, the project's prefix, or PATH's.
fn checkpointctl() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("GPU_CHECKPOINT_CHECKPOINTCTL") {
        return Some(p.into());
    }
    let ours =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.deps/checkpointctl/bin/checkpointctl");
    if ours.is_file() {
        return Some(ours);
    }
    let on_path = Command::new("checkpointctl").arg("--help").output();
    on_path
        .is_ok_and(|o| o.status.success())
        .then(|| "checkpointctl".into())
}

fn checkpointctl_ready() -> Option<PathBuf> {
    if !podman_ready() {
        return None;
    }
    let found = checkpointctl();
    if found.is_none() {
        let why = "checkpointctl is not installed (scripts/install-checkpointctl.sh installs it)";
        if std::env::var("CI").as_deref() == Ok("true") {
            panic!("the checkpointctl test cannot run in CI: {why}");
        }
        eprintln!("SKIPPED: {why}; run scripts/setup.sh as root");
    }
    found
}

/// `checkpointctl ARGS... ARCHIVE` -> stdout, asserting success.
fn ctl(bin: &Path, args: &[&str], archive: &Path) -> String {
    let o = Command::new(bin).args(args).arg(archive).output().unwrap();
    assert!(o.status.success(), "checkpointctl {args:?}: {}", text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn export(store: &Path, id: &str, to: &Path) {
    let o = export_archive(store, id, to, &["--format", "oci-checkpoint"]);
    assert!(o.status.success(), "export: {}", text(&o));
}

/// checkpointctl's way of printing a size (`lib/metadata.go`'s `ByteToString`).
fn size_text(b: u64) -> String {
    if b < 1024 {
        return format!("{b} B");
    }
    let (mut div, mut exp, mut n) = (1024u64, 0, b / 1024);
    while n >= 1024 {
        div *= 1024;
        exp += 1;
        n /= 1024;
    }
    format!("{:.1} {}iB", b as f64 / div as f64, b"KMGTPE"[exp] as char)
}

/// What checkpointctl should count as the checkpoint's size: every file under `checkpoint/`.
fn checkpoint_size(archive: &Path) -> u64 {
    archive_entries(archive)
        .iter()
        .filter(|(n, _)| n.starts_with("checkpoint/"))
        .map(|(_, d)| d.len() as u64)
        .sum()
}

/// checkpointctl's output lines without the tree's drawing, sorted (it prints annotations in Go's
/// random map order, so which is drawn last varies), less the lines naming the archive's path.
fn without_path(out: &str) -> Vec<&str> {
    let mut lines: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with("Displaying container checkpoint"))
        .map(|l| l.trim_start_matches(['│', '├', '└', '─', ' ']))
        .collect();
    lines.sort_unstable();
    lines
}

#[test]
fn checkpointctl_reads_the_archives_we_export() {
    let Some(bin) = checkpointctl_ready() else {
        return;
    };
    // A runc container checkpointed by gpu-checkpoint, exported.
    let Some(s) = Scene::memory("8") else { return };
    let (store, runc, bundle, dir) = (&s.store, &s.runc, &s.bundle, &s.dir);
    let id = format!("gc{}", std::process::id() % 100_000);
    runc.run(&id, bundle);
    let mem = bundle.rootfs().join("state/mem");
    wait_for("the workload", &|| {
        gpu_checkpoint_workloads::read_state(&mem).is_ok_and(|r| !r.is_empty())
    });
    let ck = checkpoint_container(store, runc, &id);
    let ours = dir.path().join("runc.tar");
    export(store, &ck, &ours);
    let show = ctl(&bin, &["show"], &ours);
    // The table's row: container (the id: a runc container's name), no image, id, runtime, a creation
    // time, the engine of the archive's format, and the size of our CRIU images.
    let row = show
        .lines()
        .find(|l| l.contains(&id))
        .unwrap_or_else(|| panic!("no row for {id}:\n{show}"));
    let cells: Vec<&str> = row.split('|').map(str::trim).collect();
    let size = size_text(checkpoint_size(&ours));
    assert!(size.ends_with("MiB"), "8 MiB of memory: {size}");
    assert_eq!(cells[1..4], [id.as_str(), "", id.as_str()], "{show}");
    assert_eq!(cells[4], "runc", "{show}");
    assert!(
        cells[5].starts_with("20") && cells[5].ends_with('Z'),
        "{show}"
    );
    assert_eq!(cells[6..8], ["Podman", size.as_str()], "{show}");
    // inspect reads CRIU's statistics and the process tree out of our images.
    let inspect = ctl(&bin, &["inspect", "--all"], &ours);
    for want in [
        format!("├── ID: {id}"),
        "├── Runtime: runc".into(),
        format!("│   └── Memory pages size: {size}"),
        "├── CRIU dump statistics".into(),
        "[REG 3]  /state/mem".into(),
        "io.container.manager: libpod".into(),
    ] {
        assert!(inspect.contains(&want), "{want:?} not in:\n{inspect}");
    }
    assert!(
        inspect.contains("Pages written: 2"),
        "about 2100 pages:\n{inspect}"
    );

    // A podman archive whose container wrote a file, imported and exported again: checkpointctl
    // says about our export exactly what it says about podman's own archive.
    let podman = Podman::new(dir.path());
    let image = "localhost/gpu-checkpoint-ctl:1";
    podman.import_rootfs(bundle, image);
    let name = cid("ctlpod");
    let script = format!("echo hi > /new; {COUNTER}");
    podman.run_counter(&name, image, &script, 5);
    let long_id = podman.ok(&["inspect", "--format", "{{.Id}}", &name]);
    let theirs = dir.path().join("podman.tar.zst");
    podman.export_checkpoint(&name, &theirs, &[]);
    let imp = import_archive(&theirs, store);
    let again = dir.path().join("podman-again.tar");
    export(store, imp["id"].as_str().unwrap(), &again);
    let show = ctl(&bin, &["show"], &again);
    for want in [
        &name,
        image,
        &long_id[..12],
        "runc",
        "Podman",
        "ROOT FS DIFF SIZE",
    ] {
        assert!(show.contains(want), "{want:?} not in:\n{show}");
    }
    assert_eq!(
        without_path(&show),
        without_path(&ctl(&bin, &["show"], &theirs))
    );
    let inspect = ctl(&bin, &["inspect", "--all"], &again);
    assert!(inspect.contains("├── CRIU dump statistics"), "{inspect}");
    assert_eq!(
        without_path(&inspect),
        without_path(&ctl(&bin, &["inspect", "--all"], &theirs))
    );
}
