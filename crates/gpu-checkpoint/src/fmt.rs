//! Text written for people: byte counts in reports, errors and the command-line tool, and untrusted text
//! made safe to print.
//!
//! One formatter for every caller, so that a size reads the same in `detect`'s evidence, a blocker's
//! message and the store's summaries (`list`, `inspect`, `gc`, ...).

use std::borrow::Cow;

/// `s` with every control character but newline and tab escaped (`\u{1b}`, `\r`, `\0`...): text that came
/// from an archive, a server, a record or a runtime's output may hold terminal escapes, which would
/// otherwise reach the user's terminal (rewrite what it shows, set its title, ...) from an error message.
pub fn escape_controls(s: &str) -> Cow<'_, str> {
    let unsafe_char = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !s.chars().any(unsafe_char) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Binary units above bytes, up to the largest a u64 can reach in practice.
const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];

/// `512 B`, `64.0 KiB`, `1.5 GiB`: whole bytes below 1 KiB, else one decimal in the largest binary unit
/// that keeps the number at least 1 (PiB at most).
pub fn human_bytes(n: u64) -> String {
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

#[cfg(test)]
mod tests {
    use super::{escape_controls, human_bytes};

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert!(matches!(
            escape_controls("plain ü\n\tok"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            escape_controls("a\u{1b}]0;title\u{7}b\rc\u{9b}d\u{0}\u{7f}"),
            "a\\u{1b}]0;title\\u{7}b\\rc\\u{9b}d\\u{0}\\u{7f}"
        );
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.0 KiB");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(64 * 1024), "64.0 KiB");
        assert_eq!(human_bytes(3 << 30), "3.0 GiB");
        assert_eq!(human_bytes(5 << 40), "5.0 TiB");
        assert_eq!(human_bytes(3 << 50), "3.0 PiB");
        // Past the last unit the number grows instead of the unit.
        assert_eq!(human_bytes(u64::MAX), "16384.0 PiB");
    }
}
