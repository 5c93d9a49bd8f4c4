//! Container ids, checked before any reaches a runtime's command line or a path.
//!
//! An id comes from the command line, a checkpoint's manifest, an archive or a coordination record: it is
//! untrusted input. runc accepts ids of letters, digits, `_`, `+`, `-` and `.`, other than `.` and `..`
//! (libcontainer's `validateID`); on top of that one must not start with `-` (the runtimes' command lines
//! would take it for an option: `runc state --help`) and must fit in a file name (the runtime's state folder
//! is named after it).

use super::Error;

/// The longest id: a file name.
const MAX_LEN: usize = 255;

/// Checks container id `id` (see the module's text): `Err` is a usage error (exit status 2) whose message
/// shows the id escaped (`{:?}`), never its raw bytes.
pub fn check_container_id(id: &str) -> Result<(), Error> {
    let bad = |reason: &str| {
        Err(Error::BadId {
            id: id.chars().take(MAX_LEN + 1).collect(),
            reason: reason.into(),
        })
    };
    if id.is_empty() {
        return bad("it is empty");
    }
    if id.len() > MAX_LEN {
        return bad("it is longer than 255 bytes");
    }
    if id.starts_with('-') {
        return bad("it starts with '-' (a runtime would read it as an option)");
    }
    if id == "." || id == ".." {
        return bad("it names a folder, not a container");
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'+' | b'-' | b'.'))
    {
        return bad("use letters, digits, '_', '+', '-' and '.' only (as runc does)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_like_runc_and_never_look_like_options() {
        for good in [
            "a",
            "web-1",
            "3f2a9c1b",
            "x_y+z.v",
            "A.B-C_D",
            &"a".repeat(255),
        ] {
            assert!(check_container_id(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "-",
            "--help",
            "-rf",
            ".",
            "..",
            "a/b",
            "../etc",
            "a b",
            "a\u{1b}[31m",
            "é",
            "a\0b",
            &"a".repeat(256),
        ] {
            let err = check_container_id(bad).unwrap_err();
            assert_eq!(
                crate::exit::Classify::exit_status(&err),
                crate::ExitStatus::Usage,
                "{bad:?}"
            );
            assert!(!err.to_string().contains('\u{1b}'), "{err}");
        }
    }
}
