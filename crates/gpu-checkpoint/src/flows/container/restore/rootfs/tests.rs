use super::*;

/// One entry of a test diff: name, kind, data (a link's target for a link).
type Entry<'a> = (&'a str, tar::EntryType, &'a [u8]);

/// A bundle (`config.json` naming `rootfs`) whose rootfs holds `keep` ("old") and `bin/sh`, and
/// images holding `oci/rootfs-diff.tar` of `entries` and `oci/deleted.files` of `deleted`.
fn setup(entries: &[Entry<'_>], deleted: &[&str]) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let bundle = dir.path().join("bundle");
    fs::create_dir_all(bundle.join("rootfs/bin")).unwrap();
    fs::write(
        bundle.join("config.json"),
        br#"{"root": {"path": "rootfs"}}"#,
    )
    .unwrap();
    fs::write(bundle.join("rootfs/keep"), "old").unwrap();
    fs::write(bundle.join("rootfs/bin/sh"), "sh").unwrap();
    let images = dir.path().join("images");
    fs::create_dir_all(images.join("oci")).unwrap();
    let mut b = tar::Builder::new(File::create(images.join(DIFF_TAR)).unwrap());
    for (name, kind, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_mode(0o644);
        // SAFETY: geteuid/getegid have no preconditions. Our own ids: chown to them works unprivileged.
        h.set_uid(unsafe { libc::geteuid() }.into());
        h.set_gid(unsafe { libc::getegid() }.into());
        h.set_mtime(0);
        match kind {
            tar::EntryType::Symlink | tar::EntryType::Link => {
                h.set_size(0);
                let target = std::str::from_utf8(data).unwrap();
                b.append_link(&mut h, name, target).unwrap();
            }
            _ => {
                h.set_size(data.len() as u64);
                // Names are written raw: the tar crate refuses to write `..` itself.
                h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
                h.set_cksum();
                b.append(&h, *data).unwrap();
            }
        }
    }
    b.finish().unwrap();
    fs::write(images.join(DELETED), serde_json::to_vec(deleted).unwrap()).unwrap();
    (dir, bundle, images)
}

/// Every path under `root` with its kind and contents (a link's target), for comparing states.
fn snapshot(root: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = fs::symlink_metadata(&p).unwrap();
            let what = if m.file_type().is_symlink() {
                format!("-> {}", fs::read_link(&p).unwrap().display())
            } else if m.is_dir() {
                stack.push(p.clone());
                "dir".into()
            } else if m.is_file() {
                fs::read_to_string(&p).unwrap()
            } else {
                "special".into()
            };
            out.push((p.strip_prefix(root).unwrap().to_path_buf(), what));
        }
    }
    out.sort();
    out
}

#[test]
fn changes_apply_and_are_undone_when_dropped_armed() {
    use tar::EntryType::{Directory, Regular, Symlink};
    let (dir, bundle, images) = setup(
        &[
            ("data/", Directory, b""),
            ("data/f", Regular, b"new"),
            ("keep", Regular, b"changed"),
            ("data/l", Symlink, b"../keep"),
        ],
        &["/bin/sh"],
    );
    let rootfs = bundle.join("rootfs");
    let before = snapshot(&rootfs);
    let applied = apply(&images, &bundle, dir.path()).unwrap().unwrap();
    assert_eq!(fs::read_to_string(rootfs.join("data/f")).unwrap(), "new");
    assert_eq!(fs::read_to_string(rootfs.join("keep")).unwrap(), "changed");
    assert_eq!(
        fs::read_link(rootfs.join("data/l")).unwrap(),
        Path::new("../keep")
    );
    assert!(!rootfs.join("bin/sh").exists());
    drop(applied);
    assert_eq!(snapshot(&rootfs), before, "undone");
    // Kept: the changes stay.
    apply(&images, &bundle, dir.path()).unwrap().unwrap().keep();
    assert_eq!(fs::read_to_string(rootfs.join("keep")).unwrap(), "changed");
}

/// The container, run by a restore that then fails, swaps a folder the changes went into for a
/// link out of its root file system: the undo does not follow it (the host's file of the same name
/// stays), puts back what it safely can, and says what it left.
#[test]
fn the_undo_never_follows_a_link_the_container_put_on_the_way() {
    use tar::EntryType::{Directory, Regular};
    let (dir, bundle, images) = setup(
        &[
            ("data/", Directory, b""),
            ("data/f", Regular, b"new"),
            ("keep", Regular, b"changed"),
        ],
        &[],
    );
    let rootfs = bundle.join("rootfs");
    let outside = dir.path().join("host");
    fs::create_dir(&outside).unwrap();
    fs::write(outside.join("f"), "the host's").unwrap();
    let applied = apply(&images, &bundle, dir.path()).unwrap().unwrap();
    fs::remove_dir_all(rootfs.join("data")).unwrap();
    std::os::unix::fs::symlink(&outside, rootfs.join("data")).unwrap();
    drop(applied);
    assert_eq!(fs::read_to_string(outside.join("f")).unwrap(), "the host's");
    assert_eq!(fs::read_to_string(rootfs.join("keep")).unwrap(), "old");
}

/// The tool dies with the changes applied (its guard never drops): the journal in the work folder
/// lets the guardian put everything back, a changed file included; a journal line cut short is
/// ignored.
#[test]
fn the_journal_puts_the_changes_back_without_the_guard() {
    use tar::EntryType::{Directory, Regular};
    let (dir, bundle, images) = setup(
        &[
            ("data/", Directory, b""),
            ("data/f", Regular, b"new"),
            ("keep", Regular, b"changed"),
        ],
        &["/bin/sh"],
    );
    let work = dir.path().join("work");
    fs::create_dir(&work).unwrap();
    let rootfs = bundle.join("rootfs");
    let before = snapshot(&rootfs);
    let mut applied = apply(&images, &bundle, &work).unwrap().unwrap();
    // What a death in the middle of a write leaves at the journal's end.
    let journal = applied
        .backup
        .as_ref()
        .unwrap()
        .path()
        .join("journal.jsonl");
    std::io::Write::write_all(
        &mut fs::OpenOptions::new().append(true).open(&journal).unwrap(),
        br#"{"Created":"nev"#,
    )
    .unwrap();
    let _kept_for_the_guardian = applied.backup.take().unwrap().keep();
    std::mem::forget(applied);
    assert_ne!(snapshot(&rootfs), before);
    let said = undo_left(&work);
    assert_eq!(snapshot(&rootfs), before, "put back: {said:?}");
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains("back as it was"), "{said:?}");
    assert!(undo_left(&dir.path().join("none")).is_empty());
}

#[test]
fn bad_entries_are_refused_before_anything_changes() {
    use tar::EntryType::{Block, Link, Regular, Symlink};
    let cases: [(&str, Vec<Entry<'_>>, &[&str], &str); 6] = [
        (
            "dot-dot",
            vec![("keep", Regular, b"x"), ("../out", Regular, b"x")],
            &[],
            "leaves",
        ),
        (
            "escaping link",
            vec![("l", Symlink, b"../../etc")],
            &[],
            "leaves",
        ),
        ("hard link", vec![("h", Link, b"keep")], &[], "only folders"),
        ("device", vec![("d", Block, b"")], &[], "only folders"),
        (
            "deleted outside",
            vec![("keep", Regular, b"x")],
            &["/../x"],
            "not a path inside",
        ),
        (
            "through a link",
            vec![("keep", Regular, b"x"), ("bin2/x", Regular, b"x")],
            &[],
            "through the link",
        ),
    ];
    for (what, entries, deleted, says) in cases {
        let (dir, bundle, images) = setup(&entries, deleted);
        let rootfs = bundle.join("rootfs");
        symlink("/etc", rootfs.join("bin2")).unwrap();
        let before = snapshot(&rootfs);
        let e = apply(&images, &bundle, dir.path()).err().expect(what);
        assert!(e.to_string().contains(says), "{what}: {e}");
        assert_eq!(
            crate::exit::Classify::exit_status(&e),
            crate::ExitStatus::Usage,
            "{what}"
        );
        assert_eq!(snapshot(&rootfs), before, "{what}: nothing changed");
    }
}

#[test]
fn a_failure_half_way_puts_everything_back() {
    use tar::EntryType::{Regular, Symlink};
    // The diff's own link on the way of a later entry: seen only while applying.
    let (dir, bundle, images) = setup(
        &[
            ("keep", Regular, b"changed"),
            ("a", Symlink, b"bin"),
            ("a/x", Regular, b"x"),
        ],
        &[],
    );
    let rootfs = bundle.join("rootfs");
    let before = snapshot(&rootfs);
    let e = apply(&images, &bundle, dir.path()).err().expect("refused");
    assert!(e.to_string().contains("through the link"), "{e}");
    assert_eq!(snapshot(&rootfs), before);
    assert!(!rootfs.join("bin/x").exists());
}

#[test]
fn a_special_file_is_not_removed_or_replaced() {
    use tar::EntryType::Regular;
    let (dir, bundle, images) = setup(&[("keep", Regular, b"changed")], &["/fifo"]);
    let rootfs = bundle.join("rootfs");
    let fifo =
        std::ffi::CString::new(rootfs.join("fifo").into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let before = snapshot(&rootfs);
    let e = apply(&images, &bundle, dir.path()).err().expect("refused");
    assert!(e.to_string().contains("special file"), "{e}");
    assert_eq!(snapshot(&rootfs), before, "the changed file put back");
}

#[test]
fn links_are_judged_as_the_container_reads_them() {
    assert!(link_stays_inside(
        Path::new("etc/mtab"),
        Path::new("/proc/mounts")
    ));
    assert!(link_stays_inside(Path::new("a/b/l"), Path::new("../../x")));
    assert!(!link_stays_inside(
        Path::new("a/b/l"),
        Path::new("../../../x")
    ));
    assert_eq!(inside(Path::new("/bin/nc")).unwrap(), Path::new("bin/nc"));
    assert!(inside(Path::new("./")).is_none() && inside(Path::new("a/../b")).is_none());
}
