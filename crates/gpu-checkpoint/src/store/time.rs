//! UTC time stamps for manifests and ids, written by humantime (RFC 3339).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `t` within what RFC 3339 writes: humantime panics on a time before 1970 and fails after 9999.
fn clamped(t: SystemTime) -> SystemTime {
    // 9999-12-31T23:59:59.999Z
    let last = UNIX_EPOCH + Duration::from_millis(253_402_300_799_999);
    t.clamp(UNIX_EPOCH, last)
}

/// `2026-11-20T23:35:01.123Z`
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(clamped(t)).to_string()
}

/// `20261120T233501Z`
pub fn id_stamp(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(clamped(t))
        .to_string()
        .replace(['-', ':'], "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        let t = UNIX_EPOCH + Duration::from_millis(1_795_217_701_123);
        assert_eq!(rfc3339(t), "2026-11-20T23:35:01.123Z");
        assert_eq!(id_stamp(t), "20261120T233501Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(id_stamp(leap), "20000229T000000Z");
    }

    #[test]
    fn times_out_of_range_are_clamped_not_a_panic() {
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(rfc3339(before), "1970-01-01T00:00:00.000Z");
        let far = UNIX_EPOCH + Duration::from_secs(400_000_000_000);
        assert_eq!(rfc3339(far), "9999-12-31T23:59:59.999Z");
        assert_eq!(id_stamp(far), "99991231T235959Z");
    }
}
