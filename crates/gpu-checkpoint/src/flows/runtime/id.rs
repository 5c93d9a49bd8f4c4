//! Container ids, checked before any reaches a runtime's command line or a path.
//!
//! An id comes from the command line, a checkpoint's manifest, an archive or a coordination record: it is
//! untrusted input, checked by [`crate::validate::container_id`] (runc's rule, no leading `-`, a file
//! name's length), the same rule the cluster flow applies to ids read from etcd.

use super::Error;

/// Checks container id `id` ([`crate::validate::container_id`]'s rule): `Err` is a usage error (exit
/// status 2) whose message shows the id escaped, never its raw bytes.
pub fn check_container_id(id: &str) -> Result<(), Error> {
    crate::validate::container_id(id).map_err(|reason| Error::BadId { reason })
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
