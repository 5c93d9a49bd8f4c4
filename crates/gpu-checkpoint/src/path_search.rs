//! Finding a program on `$PATH` (CRIU, `cuda-checkpoint`), with one meaning of "executable" for both the
//! search and a path the user names.
//!
//! Hand-written rather than the `which` crate: that crate (whose only dependency here would be libc) judges
//! a file by `access(2)` with the real uid, expands `~` in `$PATH` and makes relative entries absolute;
//! these two functions keep the tool's long-standing rule (a regular file with any execute bit) and paths
//! as `$PATH` spells them.

use std::path::{Path, PathBuf};

/// The first `dir/name` over the directories of `$PATH`, in order, that [`is_executable`]; `None` when
/// `$PATH` is unset or no directory has one.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

/// A regular file (after following links) with at least one execute bit set. Whether this user may run
/// it is left to the spawn, whose error names the file.
pub fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn file(dir: &Path, name: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn executable_means_a_file_with_an_execute_bit() {
        let d = tempfile::tempdir().unwrap();
        assert!(is_executable(&file(d.path(), "x", 0o755)));
        assert!(is_executable(&file(d.path(), "owner-only", 0o700)));
        assert!(!is_executable(&file(d.path(), "plain", 0o644)));
        assert!(!is_executable(d.path()), "a directory is not a program");
        assert!(!is_executable(&d.path().join("absent")));
    }

    #[test]
    fn finds_a_program_on_path_and_nothing_else() {
        // `sh` is on PATH wherever these tests run; a name no directory has is not.
        let sh = which("sh").expect("sh on PATH");
        assert!(sh.ends_with("sh") && is_executable(&sh), "{}", sh.display());
        assert_eq!(which("gpu-checkpoint-no-such-program"), None);
    }
}
