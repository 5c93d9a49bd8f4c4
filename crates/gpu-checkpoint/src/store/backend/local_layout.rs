//! The local backend's folder as a whole: opening it (the owner check, creating a new store atomically,
//! upgrading an old one), permissions put back, and what dead writers left removed.

use std::io::{self, Read};
use std::path::Path;
use std::sync::atomic::Ordering;

use super::super::objects::{check_marker, marker, STORE_FILE, STORE_FORMAT_VERSION};
use super::super::trust::{self, narrower, Access};
use super::super::StaleCleanup;
use super::{writable_error, LocalBackend};
use crate::beneath::{Beneath, Kind};
use crate::store::error::{Error, Result};
use crate::util::{create_private_dir_all, DIR_MODE, FILE_MODE};

/// The folders every store has.
const LAYOUT: [&str; 3] = ["chunks", "manifests", "staging"];

impl LocalBackend {
    /// Opens the store folder (creating a new store where there is none), checks that its owner is trusted
    /// and its layout, and returns it held open with what this process may do with it.
    pub(super) fn open_store(&self) -> Result<(Beneath, Access)> {
        // A file (or anything but a folder) given as the storage is a usage error, not an I/O failure.
        match std::fs::metadata(&self.root) {
            Ok(m) if !m.is_dir() => {
                return Err(Error::Invalid(format!(
                    "storage {} is not a folder",
                    self.root.display()
                )))
            }
            Ok(_) => {}
            // Missing: a new store (its parents too, all 0700; several openers at once are fine).
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                create_private_dir_all(&self.root).map_err(|e| writable_error(&self.root, e))?
            }
            Err(e) => return Err(Error::io("cannot look at", &self.root)(e)),
        }
        let dir = Beneath::open(&self.root).map_err(|e| match e.kind() {
            io::ErrorKind::PermissionDenied => Error::Unreadable {
                path: self.root.as_path().into(),
                source: e,
            },
            _ => Error::io("cannot open", &self.root)(e),
        })?;
        // An empty folder of this user made for the store (`mkdir` with a umask of 002) becomes private
        // before it is checked: nothing is in it to distrust.
        if trust::own_empty_folder(&dir) {
            dir.set_mode("", DIR_MODE)
                .map_err(|e| writable_error(dir.path(), e))?;
        }
        let root_access = trust::check_root(&dir, self.owners)?;
        // Another opener may be creating the store right now: its marker is written last, so a second look
        // finds it once the layout is complete.
        for _ in 0..3 {
            match self.read_marker(&dir)? {
                Some(bytes) => {
                    let access = narrower(root_access, trust::check_layout(&dir, self.owners)?);
                    let version =
                        check_marker(&bytes, &dir.join(STORE_FILE).display().to_string())?;
                    if access == Access::ReadWrite {
                        self.tidy(&dir, version)?;
                    }
                    return Ok((dir, access));
                }
                None if root_access != Access::ReadWrite => {
                    return Err(Error::BadStore {
                        path: self.root.as_path().into(),
                        reason:
                            "is not a gpu-checkpoint store (no store.json), and another user's \
                                 folder: nothing is made in it"
                                .into(),
                    })
                }
                None => {
                    if self.create_layout(&dir)? {
                        trust::check_layout(&dir, self.owners)?;
                        return Ok((dir, root_access));
                    }
                }
            }
        }
        Err(Error::Conflict(format!(
            "{}: another process keeps changing the folder while it is made a store",
            self.root.display()
        )))
    }

    /// The marker's bytes, `None` when there is none. Anything but a regular file in its place is
    /// refused by the layout check, with the reason.
    fn read_marker(&self, dir: &Beneath) -> Result<Option<Vec<u8>>> {
        let at = dir.join(STORE_FILE);
        match dir.open_regular(STORE_FILE) {
            Ok(Some(mut f)) => {
                let mut bytes = Vec::new();
                f.read_to_end(&mut bytes)
                    .map_err(Error::io("cannot read", &at))?;
                Ok(Some(bytes))
            }
            Ok(None) => match dir.symlink_metadata(STORE_FILE) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
                // Missing at the open, there now: another opener has just made the store. The caller
                // looks again.
                Ok(m) if m.is_file() => Ok(None),
                _ => {
                    trust::check_layout(dir, self.owners)?;
                    Err(Error::BadStore {
                        path: at.into(),
                        reason: "is not a regular file".into(),
                    })
                }
            },
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => Err(Error::Unreadable {
                path: at.into(),
                source: e,
            }),
            Err(e) => Err(Error::io("cannot read", at)(e)),
        }
    }

    /// Makes a new store in the held folder, which must be empty or hold only what another opener making
    /// the same store at this moment puts there (empty layout folders, a temporary marker): several
    /// checkpoints started at once into a missing folder all get the one store (issue 26). `false` when a
    /// marker appeared meanwhile (the store exists: read it).
    fn create_layout(&self, dir: &Beneath) -> Result<bool> {
        let not_empty = || Error::BadStore {
            path: self.root.as_path().into(),
            reason:
                "is not empty and not a gpu-checkpoint store (no store.json); use an empty or new \
                     folder"
                    .into(),
        };
        let marker_now = || dir.symlink_metadata(STORE_FILE).is_ok();
        let entries = dir
            .entries_stat("")
            .map_err(Error::io("cannot list", dir.path()))?;
        for e in entries {
            let name = e.name.to_str().unwrap_or("");
            let ours = match e.kind {
                _ if name == STORE_FILE => return Ok(false),
                Kind::Dir if LAYOUT.contains(&name) => {
                    dir.entries(name).is_ok_and(|x| x.is_empty())
                }
                Kind::File if name == "lock" => e.len == 0,
                Kind::File => name.starts_with(&format!(".{STORE_FILE}.tmp.")),
                _ => false,
            };
            if !ours {
                // What looked foreign may be the first files of a store made meanwhile.
                return if marker_now() {
                    Ok(false)
                } else {
                    Err(not_empty())
                };
            }
        }
        for folder in LAYOUT {
            dir.create_dir_all(folder, DIR_MODE)
                .map_err(|e| writable_error(&dir.join(folder), e))?;
        }
        // The folder may have existed (an empty folder the user made): make it private too.
        dir.set_mode("", DIR_MODE)
            .map_err(|e| writable_error(dir.path(), e))?;
        // Last: a marker is only ever seen over a complete layout. Several makers write the same bytes.
        self.write_marker(dir)
            .map_err(|e| writable_error(dir.path(), e))?;
        Ok(true)
    }

    /// Writes the marker of this build's store version, atomically and durably.
    pub(super) fn write_marker(&self, dir: &Beneath) -> io::Result<()> {
        self.put_durable(dir, STORE_FILE, &marker())
    }

    /// What opening a store of this user does besides checking it: a missing layout folder made again
    /// (someone cleaned up by hand; they hold nothing to keep), an older marker upgraded, loosened
    /// permissions of the folders and manifests put back (`verify` also checks every chunk).
    fn tidy(&self, dir: &Beneath, version: u32) -> Result<()> {
        if version < STORE_FORMAT_VERSION {
            self.upgrade_marker(dir, version);
        }
        for folder in LAYOUT {
            if dir.symlink_metadata(folder).is_err() {
                dir.create_dir_all(folder, DIR_MODE)
                    .map_err(|e| writable_error(&dir.join(folder), e))?;
            }
        }
        super::super::files::warn_modes(&self.root, &self.restore_modes(dir, false));
        Ok(())
    }

    /// Marks a store of an older version as this build's before anything is written to it: builds of the
    /// older version would misread what this one writes (compressed chunks in chunk format version 2 read
    /// as damaged), and the marker makes them refuse the store instead, naming the versions. A store whose
    /// marker cannot be rewritten (a read-only mount, an immutable folder) still opens for reading (verify,
    /// restore), and `check_writable` then refuses writes.
    fn upgrade_marker(&self, dir: &Beneath, from: u32) {
        match self.write_marker(dir) {
            Ok(()) => tracing::debug!(
                "{}: store format version {from} marked {STORE_FORMAT_VERSION}",
                self.root.display()
            ),
            Err(e) => {
                self.old_marker.store(true, Ordering::Relaxed);
                tracing::debug!(
                    "{}: store format version {from} left as it is ({e}); the store is read only",
                    self.root.display()
                );
            }
        }
    }

    /// Puts every store path's permissions back to 0700 (folders) and 0600 (files) where they differ;
    /// with `chunks`, the chunk files and their folders too. Returns what differed.
    pub(super) fn restore_modes(&self, dir: &Beneath, chunks: bool) -> Vec<String> {
        let mut found = Vec::new();
        let fix = |rel: &str, mode: u32, want: u32, found: &mut Vec<String>| {
            if mode != want {
                found.push(describe_fix(dir, rel, mode, want));
            }
        };
        for (rel, want) in [
            ("", DIR_MODE),
            ("chunks", DIR_MODE),
            ("manifests", DIR_MODE),
        ]
        .into_iter()
        .chain([
            ("staging", DIR_MODE),
            (STORE_FILE, FILE_MODE),
            ("lock", FILE_MODE),
        ]) {
            if let Ok(meta) = dir.symlink_metadata(rel) {
                use std::os::unix::fs::MetadataExt;
                if !meta.file_type().is_symlink() {
                    fix(rel, meta.mode() & 0o7777, want, &mut found);
                }
            }
        }
        let files_in = |folder: &str, found: &mut Vec<String>| {
            for e in dir.entries_stat(folder).into_iter().flatten() {
                if e.kind == Kind::File {
                    let rel = format!("{folder}/{}", e.name.to_string_lossy());
                    fix(&rel, e.mode, FILE_MODE, found);
                }
            }
        };
        files_in("manifests", &mut found);
        if chunks {
            for sub in dir.entries_stat("chunks").into_iter().flatten() {
                if sub.kind == Kind::Dir {
                    let rel = format!("chunks/{}", sub.name.to_string_lossy());
                    fix(&rel, sub.mode, DIR_MODE, &mut found);
                    files_in(&rel, &mut found);
                }
            }
        }
        found
    }

    /// Removes what dead writers left: staging folders and temporary objects. Never through a link: a
    /// link in their place is removed itself.
    pub(super) fn remove_stale(&self) -> Result<StaleCleanup> {
        let dir = self.writable()?;
        let mut out = StaleCleanup::default();
        let listed = |folder: &str| match dir.entries_stat(folder) {
            Ok(e) => Ok(e),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(Error::io("cannot list", dir.join(folder))(e)),
        };
        for entry in listed("staging")? {
            let rel = Path::new("staging").join(&entry.name);
            match dir.remove_all(&rel) {
                Ok(bytes) => out.bytes += bytes,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("cannot remove stale staging", dir.join(&rel))(e)),
            }
            out.staging_dirs += 1;
        }
        let mut remove_temps = |folder: &str| -> Result<()> {
            for entry in listed(folder)? {
                let name = entry.name.to_string_lossy();
                // A manifest's or a signature's temporary (`.ID.json.tmp.*`, `.ID.sig.tmp.*`).
                if name.starts_with(".tmp.")
                    || name.contains(".json.tmp.")
                    || name.contains(".sig.tmp.")
                {
                    let rel = format!("{folder}/{name}");
                    match dir.remove_file(&rel) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) => {
                            return Err(Error::io("cannot remove temporary", dir.join(&rel))(e))
                        }
                    }
                    if entry.kind == Kind::File {
                        out.bytes += entry.len;
                    }
                    out.temp_objects += 1;
                }
            }
            Ok(())
        };
        remove_temps("manifests")?;
        for sub in listed("chunks")? {
            if sub.kind == Kind::Dir {
                remove_temps(&format!("chunks/{}", sub.name.to_string_lossy()))?;
            }
        }
        Ok(out)
    }
}

/// Puts `rel`'s mode back to `want` and says what it did (or why it could not: another owner, a
/// read-only mount).
fn describe_fix(dir: &Beneath, rel: &str, mode: u32, want: u32) -> String {
    let path = dir.join(rel);
    match dir.set_mode(rel, want) {
        Ok(_) => format!("{} was {mode:04o}, now {want:04o}", path.display()),
        Err(e) => format!(
            "{} is {mode:04o}, should be {want:04o}, and cannot be changed: {e}",
            path.display()
        ),
    }
}
