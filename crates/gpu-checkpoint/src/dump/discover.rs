//! Finding a CRIU that is new enough.
//!
//! Order: an explicit path (`--criu PATH`), then `GPU_CHECKPOINT_CRIU`, then `criu` on `PATH` when its
//! version is at least [`MIN_VERSION`], then the project's own prefix (`.deps/criu/bin/criu`, filled by
//! `scripts/install-criu.sh`). An explicit choice that is too old is an error, never silently replaced: the
//! user asked for that binary. A too-old `criu` on `PATH` is skipped (distributions still ship 3.x) and
//! named in the error if nothing else is found.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{CriuVersion, Error, MIN_VERSION};
use crate::path_search::which;

/// Environment variable naming the CRIU binary to use.
pub const ENV_CRIU: &str = "GPU_CHECKPOINT_CRIU";

/// Where the project's prefix keeps its CRIU wrapper, relative to the repository root.
const PREFIX_CRIU: &str = ".deps/criu/bin/criu";

/// How the CRIU in use was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CriuSource {
    /// `--criu PATH`.
    Flag,
    /// `GPU_CHECKPOINT_CRIU`.
    Env,
    /// `criu` on `PATH`.
    Path,
    /// The project's own prefix (`scripts/install-criu.sh`).
    ProjectPrefix,
}

/// A usable CRIU.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FoundCriu {
    pub path: PathBuf,
    pub source: CriuSource,
    pub version: CriuVersion,
}

/// Finds a CRIU >= [`MIN_VERSION`]; `explicit` is the `--criu` flag.
pub fn discover(explicit: Option<&Path>) -> Result<FoundCriu, Error> {
    if let Some(path) = explicit {
        return require(path, CriuSource::Flag);
    }
    if let Some(path) = std::env::var_os(ENV_CRIU).filter(|v| !v.is_empty()) {
        return require(Path::new(&path), CriuSource::Env);
    }
    let mut tried = Vec::new();
    match which("criu") {
        Some(path) => {
            if let Some(found) = recent(path, CriuSource::Path, " on PATH", &mut tried) {
                return Ok(found);
            }
        }
        None => tried.push("no `criu` on PATH".into()),
    }
    for path in prefix_candidates() {
        if !path.exists() {
            tried.push(format!("{} (absent)", path.display()));
        } else if let Some(found) = recent(path, CriuSource::ProjectPrefix, "", &mut tried) {
            return Ok(found);
        }
    }
    Err(Error::NotFound { tried })
}

/// The CRIU at `path` if it is recent enough; else what is wrong with it goes to `tried`, the path
/// followed by `where_`.
fn recent(
    path: PathBuf,
    source: CriuSource,
    where_: &str,
    tried: &mut Vec<String>,
) -> Option<FoundCriu> {
    match probe(&path) {
        Ok(version) if version >= MIN_VERSION => Some(FoundCriu {
            path,
            source,
            version,
        }),
        Ok(version) => {
            tried.push(format!("{}{where_} is {version}, too old", path.display()));
            None
        }
        Err(e) => {
            tried.push(format!("{}{where_}: {e}", path.display()));
            None
        }
    }
}

/// The CRIU the user named (`--criu PATH`, else `GPU_CHECKPOINT_CRIU`), without running it: the one
/// [`discover`] takes whatever its version (a too-old one is an error, never replaced). `None`: discovery
/// searches, and which CRIU it takes depends on versions.
pub fn named(explicit: Option<&Path>) -> Option<(PathBuf, CriuSource)> {
    if let Some(path) = explicit {
        return Some((path.to_path_buf(), CriuSource::Flag));
    }
    std::env::var_os(ENV_CRIU)
        .filter(|v| !v.is_empty())
        .map(|p| (PathBuf::from(p), CriuSource::Env))
}

pub(super) fn require(path: &Path, source: CriuSource) -> Result<FoundCriu, Error> {
    let version = probe(path)?;
    if version < MIN_VERSION {
        return Err(Error::TooOld {
            path: path.to_path_buf(),
            version,
        });
    }
    Ok(FoundCriu {
        path: path.to_path_buf(),
        source,
        version,
    })
}

/// Runs `criu --version`: cheap, and works even for a CRIU whose RPC service is broken on this kernel.
fn probe(path: &Path) -> Result<CriuVersion, Error> {
    let mut attempt = 0;
    let out = loop {
        match Command::new(path).arg("--version").output() {
            // A script just written by a test may still be open in a child another thread forked.
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && attempt < 5 => {
                attempt += 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(source) => {
                return Err(Error::Spawn {
                    path: path.to_path_buf(),
                    source,
                })
            }
            Ok(out) => break out,
        }
    };
    let text = String::from_utf8_lossy(&out.stdout);
    parse_version_output(&text).ok_or_else(|| Error::Protocol {
        path: path.to_path_buf(),
        detail: format!(
            "`--version` printed no version (exit {}): {}{}",
            out.status,
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    })
}

/// Parses `criu --version` output ("Version: 4.1.1", optionally followed by "GitID: ...").
pub fn parse_version_output(text: &str) -> Option<CriuVersion> {
    let v = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?
        .trim();
    let mut parts = v.split('.').map(|p| p.trim().parse::<u32>());
    let major = parts.next()?.ok()?;
    let minor = parts.next().unwrap_or(Ok(0)).ok()?;
    let sublevel = parts.next().unwrap_or(Ok(0)).ok()?;
    Some(CriuVersion {
        major,
        minor,
        sublevel,
    })
}

/// The project prefix, looked for above the running binary (target/<profile>/gpu-checkpoint, or a test
/// binary under target/<profile>/deps) and above this crate's sources (a build from the repository).
fn prefix_candidates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        for dir in exe.ancestors().skip(1).take(5) {
            let p = dir.join(PREFIX_CRIU);
            if p.exists() {
                out.push(p);
                break;
            }
        }
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let p = repo.join(PREFIX_CRIU);
    if !out.iter().any(|o| same_file(o, &p)) {
        out.push(p);
    }
    out
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Classify;

    #[test]
    fn parses_release_and_git_versions() {
        let v = parse_version_output("Version: 4.1.1\n").unwrap();
        assert_eq!((v.major, v.minor, v.sublevel), (4, 1, 1));
        let v = parse_version_output("Version: 3.17\nGitID: v3.17-1-gabc\n").unwrap();
        assert_eq!((v.major, v.minor, v.sublevel), (3, 17, 0));
        assert!(v < MIN_VERSION);
        assert!(parse_version_output("criu: unknown option").is_none());
        assert!(parse_version_output("Version: x.y").is_none());
    }

    #[test]
    fn explicit_path_that_is_not_criu_is_an_error() {
        let err = discover(Some(Path::new("/nonexistent/criu"))).unwrap_err();
        assert!(matches!(err, Error::Spawn { .. }), "{err}");
        assert_eq!(err.exit_status(), crate::ExitStatus::ToolMissing);
    }

    #[test]
    fn explicit_too_old_criu_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let fake = d.path().join("criu");
        std::fs::write(&fake, "#!/bin/sh\necho 'Version: 3.17'\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = discover(Some(&fake)).unwrap_err();
        assert!(matches!(err, Error::TooOld { .. }), "{err}");
        assert!(err.to_string().contains("3.17.0"), "{err}");
    }
}
