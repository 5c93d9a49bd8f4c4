//! Issue 26: a store is trusted only if its owner is, nothing planted in a store leads the tool out of
//! it, and bad input (container ids, archives, a full disk) gets its documented exit status. Every attack
//! is played by a real second user (`setpriv` to uid 65534) against the binary run as root.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpu_checkpoint::store::{NoProgress, Store, StoreOptions};

mod common;

/// The second user: `nobody` on Debian-like systems.
const OTHER: u32 = 65534;

/// A temporary folder, where these tests can run (root, `setpriv`): in CI (`CI=true`) their absence fails
/// the test, locally it is skipped with the reason ([`common::needs`]).
fn ready_folder() -> Option<tempfile::TempDir> {
    // SAFETY: geteuid has no preconditions.
    let found = if unsafe { libc::geteuid() } != 0 {
        Err("not running as root".into())
    } else if Command::new("setpriv").arg("--version").output().is_err() {
        Err("no setpriv (util-linux)".into())
    } else {
        Ok(())
    };
    common::needs("store trust", &found, "CI runs as root, with util-linux")
        .then(|| tempfile::tempdir().unwrap())
}

fn bin<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .args(args)
        .env_remove("GPU_CHECKPOINT_TRUST_STORE_OWNER")
        .env_remove("GPU_CHECKPOINT_STORAGE")
        .output()
        .unwrap()
}

/// Runs `args` as the second user.
fn as_other(args: &[&OsStr]) {
    common::run_ok(
        Command::new("setpriv")
            .args([
                format!("--reuid={OTHER}"),
                format!("--regid={OTHER}"),
                "--clear-groups".into(),
                "--".into(),
            ])
            .args(args),
        &format!("as uid {OTHER}: {args:?}"),
    );
}

/// The second user replaces `what` in the store by a link to `target`.
fn plant_link(store: &Path, what: &str, target: &Path) {
    let at = store.join(what);
    as_other(&["rm".as_ref(), "-rf".as_ref(), at.as_os_str()]);
    as_other(&[
        "ln".as_ref(),
        "-s".as_ref(),
        target.as_os_str(),
        at.as_os_str(),
    ]);
}

fn code_and_stderr(out: &Output) -> (Option<i32>, String) {
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn chown_tree(path: &Path, uid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid)).unwrap();
    if fs::symlink_metadata(path).unwrap().is_dir() {
        for e in fs::read_dir(path).unwrap() {
            chown_tree(&e.unwrap().path(), uid);
        }
    }
}

/// Every path under `root` with its mode, owner, size and modification time: what must not change.
fn snapshot(root: &Path) -> BTreeMap<PathBuf, (u32, u32, u64, i64, i64)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = fs::symlink_metadata(&p).unwrap();
        out.insert(
            p.clone(),
            (m.mode(), m.uid(), m.len(), m.mtime(), m.mtime_nsec()),
        );
        if m.is_dir() {
            stack.extend(fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        }
    }
    out
}

/// A folder the second user can enter, holding a store with one checkpoint (made by root, then given to
/// `owner`) and a folder of root's (`victim`, files 0644) that nothing may touch.
struct Scene {
    dir: tempfile::TempDir,
    store: PathBuf,
    victim: PathBuf,
    id: String,
}

/// `None` where these tests cannot run ([`ready_folder`]).
fn scene(owner: u32) -> Option<Scene> {
    let dir = ready_folder()?;
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let store = dir.path().join("store");
    let s = Store::open(&store, StoreOptions::default()).unwrap();
    let ing = s.begin(Some("job")).unwrap();
    fs::write(ing.staging_dir().join("pages-1.img"), vec![7u8; 300_000]).unwrap();
    fs::write(ing.staging_dir().join("core-1.img"), b"core").unwrap();
    let id = ing
        .commit(serde_json::json!({"pid": 1}), &NoProgress)
        .unwrap()
        .id;
    drop(s);
    chown_tree(&store, owner);
    let victim = dir.path().join("victim");
    fs::create_dir_all(victim.join("ID.sub")).unwrap();
    for f in ["a", "b", "ID.sub/c"] {
        fs::write(victim.join(f), "root's").unwrap();
        fs::set_permissions(victim.join(f), fs::Permissions::from_mode(0o644)).unwrap();
    }
    Some(Scene {
        dir,
        store,
        victim,
        id,
    })
}

impl Scene {
    fn victim_untouched(&self) {
        for f in ["a", "b", "ID.sub/c"] {
            let p = self.victim.join(f);
            let m = fs::metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert_eq!(m.mode() & 0o777, 0o644, "{} was chmodded", p.display());
            assert_eq!(fs::read_to_string(&p).unwrap(), "root's");
        }
    }

    fn run(&self, args: &[&str]) -> (Option<i32>, String) {
        let mut all: Vec<&OsStr> = args.iter().map(OsStr::new).collect();
        all.extend([OsStr::new("--storage"), self.store.as_os_str()]);
        code_and_stderr(&bin(all))
    }
}

/// The first attack: `gc` run by root on a store of another user deleted the contents of a folder
/// outside the store through a `staging` link that user planted.
#[test]
fn gc_never_empties_a_folder_through_a_planted_staging_link() {
    let Some(s) = scene(OTHER) else { return };
    plant_link(&s.store, "staging", &s.victim);
    let (code, err) = s.run(&["gc"]);
    assert_eq!(code, Some(4), "{err}");
    assert!(
        err.contains("belongs to") && err.contains("--trust-store-owner"),
        "{err}"
    );
    s.victim_untouched();
    // Trusted read-only: the link is still refused, and nothing is removed anywhere.
    let (code, err) = s.run(&["gc", "--trust-store-owner", "nobody"]);
    assert_eq!(code, Some(4), "{err}");
    assert!(err.contains("symbolic link"), "{err}");
    s.victim_untouched();
}

/// The second: `list` chmodded 0600 every file of a folder outside the store through a `manifests` link.
#[test]
fn list_never_chmods_through_a_planted_manifests_link() {
    let Some(s) = scene(OTHER) else { return };
    plant_link(&s.store, "manifests", &s.victim);
    for args in [&["list"][..], &["list", "--trust-store-owner", "65534"]] {
        let (code, err) = s.run(args);
        assert_eq!(code, Some(4), "{args:?}: {err}");
        s.victim_untouched();
    }
}

/// The third: a `lock` link made root create a file anywhere (opened with O_CREAT, without O_NOFOLLOW).
#[test]
fn a_planted_lock_link_makes_root_create_nothing() {
    let Some(s) = scene(OTHER) else { return };
    let target = s.dir.path().join("made-by-root");
    plant_link(&s.store, "lock", &target);
    for args in [
        &["verify"][..],
        &["gc"],
        &["verify", "--trust-store-owner", "nobody"],
    ] {
        let (code, err) = s.run(args);
        assert_eq!(code, Some(4), "{args:?}: {err}");
        assert!(!target.exists(), "{args:?} created {}", target.display());
    }
}

/// A work folder link: the sweep of killed restores' folders (run by `gc` and every restore) must not
/// remove folders of another place through `restore-work`, planted by the store's owner (another user) or
/// found in one's own store.
#[test]
fn no_sweep_through_a_planted_restore_work_link() {
    for owner in [OTHER, 0] {
        let Some(s) = scene(owner) else { return };
        let link = s.store.join("restore-work");
        if owner == OTHER {
            plant_link(&s.store, "restore-work", &s.victim);
        } else {
            std::os::unix::fs::symlink(&s.victim, &link).unwrap();
        }
        let (code, err) = s.run(&["gc"]);
        assert_eq!(code, Some(4), "owner {owner}: {err}");
        assert!(s.victim.join("ID.sub").is_dir(), "owner {owner}: swept");
        s.victim_untouched();
    }
}

/// A store of another user is refused with the reason (exit 4); `--trust-store-owner` reads it and
/// changes nothing in it (not even the permissions the open puts back in one's own store), and every
/// command that would write is refused (exit 6).
#[test]
fn another_users_store_is_refused_and_only_read_when_trusted() {
    let Some(s) = scene(OTHER) else { return };
    let manifest = s.store.join("manifests").join(format!("{}.json", s.id));
    as_other(&["chmod".as_ref(), "0644".as_ref(), manifest.as_os_str()]);
    let before = snapshot(&s.store);
    for cmd in ["list", "verify", "gc"] {
        let (code, err) = s.run(&[cmd]);
        assert_eq!(code, Some(4), "{cmd}: {err}");
        assert!(err.contains("belongs to nobody (uid 65534)"), "{err}");
    }
    let (code, err) = s.run(&["list", "--format", "json", "--trust-store-owner", "nobody"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, err) = s.run(&["verify", "--trust-store-owner", "nobody"]);
    assert_eq!(code, Some(0), "{err}");
    let (code, err) = s.run(&["inspect", &s.id, "--trust-store-owner", "nobody"]);
    assert_eq!(code, Some(0), "{err}");
    for args in [&["delete", s.id.as_str()][..], &["gc"]] {
        let mut args = args.to_vec();
        args.extend(["--trust-store-owner", "nobody"]);
        let (code, err) = s.run(&args);
        assert_eq!(code, Some(6), "{args:?}: {err}");
        assert!(err.contains("trusted for reading only"), "{err}");
    }
    // An import writes: refused too, into the store of another user trusted or not.
    let src = s.dir.path().join("a.tar");
    common::podman_archive(&src, 10_000);
    let (code, err) = s.run(&["import", src.to_str().unwrap()]);
    assert_eq!(code, Some(4), "{err}");
    let (code, err) = s.run(&[
        "import",
        src.to_str().unwrap(),
        "--trust-store-owner",
        "nobody",
    ]);
    assert_eq!(code, Some(6), "{err}");
    assert_eq!(
        snapshot(&s.store),
        before,
        "a store trusted read-only was changed"
    );
    let (code, err) = s.run(&["list", "--trust-store-owner", "no-such-user-here"]);
    assert_eq!(code, Some(2), "{err}");
}

/// A store (or a folder above it) that others can write is refused: they could have planted anything.
#[test]
fn a_store_others_can_write_is_refused() {
    let Some(s) = scene(0) else { return };
    fs::set_permissions(s.store.join("chunks"), fs::Permissions::from_mode(0o777)).unwrap();
    let (code, err) = s.run(&["list"]);
    assert_eq!(code, Some(4), "{err}");
    assert!(err.contains("can be changed by other users"), "{err}");
    fs::set_permissions(s.store.join("chunks"), fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(s.run(&["list"]).0, Some(0));
    fs::set_permissions(s.dir.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let (code, err) = s.run(&["list"]);
    assert_eq!(code, Some(4), "{err}");
    assert!(err.contains("they could put a folder of theirs"), "{err}");
    // Sticky (like /tmp): no one can rename another's entry there.
    fs::set_permissions(s.dir.path(), fs::Permissions::from_mode(0o1777)).unwrap();
    assert_eq!(s.run(&["list"]).0, Some(0));
}

/// Issue 26: six first checkpoints started at once into a store folder that did not exist yet: four
/// failed ("is not empty and not a gpu-checkpoint store"). Six `import` processes at once, many rounds:
/// all succeed, into one store.
#[test]
fn concurrent_first_writers_make_one_store() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("a.tar");
    common::podman_archive(&src, 20_000);
    for round in 0..8 {
        let store = dir.path().join(format!("r{round}")).join("store");
        let children: Vec<_> = (0..6)
            .map(|_| {
                Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
                    .arg("import")
                    .arg(&src)
                    .arg("--storage")
                    .arg(&store)
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for c in children {
            let out = c.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "round {round}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let s = Store::open(&store, StoreOptions::default()).unwrap();
        assert_eq!(s.list().unwrap().len(), 6, "round {round}");
    }
}

/// A mounted tmpfs of a few MiB, unmounted (and removed) on drop.
struct SmallDisk(tempfile::TempDir);

impl SmallDisk {
    fn mount(mib: u32) -> SmallDisk {
        let dir = tempfile::tempdir().unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={mib}m,mode=0700"))
            .arg("tmpfs")
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(st.success(), "mount a {mib} MiB tmpfs: {st}");
        SmallDisk(dir)
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

/// An import that fills the store's disk is "storage full" (exit 6), not a bad archive (it said "not a
/// readable tar archive", exit 2); and a garbage archive's bytes (terminal escapes) are never printed raw.
#[test]
fn import_on_a_full_disk_is_exit_6_and_garbage_is_printed_escaped() {
    let Some(dir) = ready_folder() else { return };
    let src = dir.path().join("big.tar");
    common::podman_archive(&src, 8 << 20);
    let disk = SmallDisk::mount(4);
    let out = bin([
        OsStr::new("import"),
        src.as_os_str(),
        OsStr::new("--storage"),
        disk.0.path().join("store").as_os_str(),
    ]);
    let (code, err) = code_and_stderr(&out);
    assert_eq!(code, Some(6), "{err}");
    assert!(err.contains("No space left"), "{err}");
    assert!(!err.contains("not a readable tar archive"), "{err}");

    let garbage = dir.path().join("garbage.tar");
    let mut bytes = b"name\x1b[2J\x1b]0;pwned\x07\x1b[31m".to_vec();
    bytes.resize(1536, b'\x1b');
    fs::write(&garbage, &bytes).unwrap();
    let out = bin([
        OsStr::new("import"),
        garbage.as_os_str(),
        OsStr::new("--storage"),
        dir.path().join("store").as_os_str(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        !out.stderr.iter().any(|b| *b == 0x1b || *b == 0x07),
        "raw control bytes printed: {:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("\\u{1b}"));
}

/// `detect --container=--help` ran `runc state --help`: a container id is checked before any runtime is
/// run (here a stand-in `runc` on PATH that records every call).
#[test]
fn a_container_id_never_reaches_the_runtime_unchecked() {
    let dir = tempfile::tempdir().unwrap();
    let calls = dir.path().join("calls");
    let runc = dir.path().join("runc");
    fs::write(
        &runc,
        format!("#!/bin/sh\necho \"$@\" >> {}\nexit 1\n", calls.display()),
    )
    .unwrap();
    fs::set_permissions(&runc, fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for id in ["--help", "-x", "../../etc", "a/b", "", "..", "a\u{1b}b"] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
            .arg("detect")
            .arg(format!("--container={id}"))
            .env("PATH", &path)
            .output()
            .unwrap();
        let (code, err) = code_and_stderr(&out);
        assert_eq!(code, Some(2), "{id:?}: {err}");
        assert!(err.contains("bad container id"), "{id:?}: {err}");
        assert!(
            !calls.exists(),
            "{id:?} reached runc: {:?}",
            fs::read_to_string(&calls)
        );
    }
    // A good id does reach it (the stand-in then fails): the check is what kept the others out.
    let out = Command::new(env!("CARGO_BIN_EXE_gpu-checkpoint"))
        .args(["detect", "--container=web-1"])
        .env("PATH", &path)
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(2));
    assert!(fs::read_to_string(&calls).unwrap().contains("state web-1"));
}
