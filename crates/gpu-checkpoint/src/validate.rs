//! Checks of values that come from outside (a command line, a record read from etcd, a store): what
//! may become part of a path, a key, or another program's command line. A leaf module: every stage and
//! flow may use it.

/// The longest container id: it names the runtime's state folder, a file name.
const MAX_CONTAINER_ID: usize = 255;

/// A container id, by runc's rule (libcontainer's `validateID`: letters, digits, `_`, `+`, `-`, `.`, not
/// `.` or `..`), not beginning with `-` (an id reaches the runtime's command line, `runc state ID`, where
/// it would read as an option) and fitting in a file name (the runtime's state folder is named after it).
/// The error says which rule it broke, quoting the id escaped.
pub fn container_id(id: &str) -> Result<(), String> {
    let reason = if id.is_empty() {
        "it is empty"
    } else if id.len() > MAX_CONTAINER_ID {
        "it is longer than 255 bytes"
    } else if id.starts_with('-') {
        "it starts with '-' (a runtime would read it as an option)"
    } else if id == "." || id == ".." {
        "it names a folder, not a container"
    } else if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'+' | b'-' | b'.'))
    {
        "use letters, digits, '_', '+', '-' and '.' only (as runc does)"
    } else {
        return Ok(());
    };
    Err(format!("container id {:?}: {reason}", printable(id)))
}

/// A store's checkpoint id (`STAMP-RANDOM`): 1-128 of `A-Z a-z 0-9 . _ -`, not beginning with `.` or
/// `-`. Never a path: it names a file inside the store.
pub fn checkpoint_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && !id.starts_with(['.', '-'])
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!("checkpoint id {:?} is not one", printable(id)))
    }
}

/// A process to act on: a positive PID other than init's (1). 0 and negative numbers mean process
/// groups to `kill(2)`.
pub fn pid(pid: i32) -> Result<(), String> {
    if pid > 1 {
        Ok(())
    } else {
        Err(format!("PID {pid} is not a process this tool acts on"))
    }
}

/// `text` safe to print: control characters (terminal escapes among them) escaped, at most 200
/// characters. For values from records and archives in messages and logs.
pub fn printable(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars().take(200) {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    if text.chars().nth(200).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_are_runcs_without_a_leading_dash() {
        for good in ["web", "gc-1234-job-a", "a.b_c+d", "0"] {
            assert!(container_id(good).is_ok(), "{good}");
        }
        for bad in ["", "-", "--help", "a/b", "..", ".", "a b", "x\n", "é"] {
            assert!(container_id(bad).is_err(), "{bad:?}");
        }
        assert!(container_id("--help")
            .unwrap_err()
            .contains("starts with '-'"));
        assert!(container_id(&"a".repeat(255)).is_ok());
        assert!(container_id(&"a".repeat(256)).is_err());
    }

    #[test]
    fn checkpoint_ids_never_leave_the_store() {
        assert!(checkpoint_id("20261128T080000-0a1b2c3d").is_ok());
        for bad in ["", "../x", "a/b", ".hidden", "-x", "x\0y", &"a".repeat(129)] {
            assert!(checkpoint_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn pids_that_mean_groups_or_init_are_refused() {
        assert!(pid(42).is_ok());
        for bad in [0, 1, -1, -42] {
            assert!(pid(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn printed_values_carry_no_terminal_escapes() {
        assert_eq!(printable("a\u{1b}[2Jb\n"), "a\\u{1b}[2Jb\\n");
        assert_eq!(printable("node n1's \"x\""), "node n1's \"x\"");
        assert_eq!(printable(&"x".repeat(300)).chars().count(), 201);
    }
}
