//! Numbers written for people: byte counts in reports, errors and the command-line tool.
//!
//! One formatter for every caller, so that a size reads the same in `detect`'s evidence, a blocker's
//! message and the store's summaries (`list`, `inspect`, `gc`, ...).

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
    use super::human_bytes;

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
