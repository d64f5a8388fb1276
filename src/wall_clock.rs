//! The wall clock, for facts that are wall-clock time by definition: timestamps a trade server
//! stamps, FIX TransactTime, the copy ledger's decision and acceptance instants. Never for lease
//! trust, gates or deadlines: those run on tokio's monotonic `Instant` (`src/trust.rs`).

/// Unix milliseconds now (0 if the system clock is before 1970).
#[allow(clippy::disallowed_methods)] // the one place wall-clock time is read
pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The same clock in Unix microseconds (journal timestamps of sub-millisecond resolution).
#[allow(clippy::disallowed_methods)] // the wall clock, as `unix_ms`
pub fn unix_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// How far a trade server's clock runs from this host's, from the server time it showed just
/// now (`AccountInfo::server_time_ms`), rounded to a quarter of an hour: servers keep their own
/// time zone (whole, half or quarter hours from UTC), and neither a request's round trip nor an
/// MT4-style server time that is the last tick's (seconds or minutes behind in a quiet market) is
/// part of that. `None` when the server shows no time.
pub fn server_offset_ms(server_time_ms: Option<i64>) -> Option<i64> {
    const QUARTER_HOUR: f64 = 900_000.0;
    server_time_ms.map(|t| ((t - unix_ms()) as f64 / QUARTER_HOUR).round() as i64 * 900_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_offsets_are_whole_quarter_hours_from_this_clock() {
        let two_hours = 2 * 3_600_000;
        let offset = server_offset_ms(Some(unix_ms() + two_hours + 120)).unwrap();
        assert_eq!(offset, two_hours);
        // A last tick's time three minutes old is still UTC+2.
        assert_eq!(
            server_offset_ms(Some(unix_ms() + two_hours - 180_000)),
            Some(two_hours)
        );
        // Nepal: UTC+5:45.
        let nepal = 5 * 3_600_000 + 45 * 60_000;
        assert_eq!(
            server_offset_ms(Some(unix_ms() + nepal + 2_000)),
            Some(nepal)
        );
        assert_eq!(server_offset_ms(Some(unix_ms() - 1_600)), Some(0));
        assert_eq!(server_offset_ms(None), None);
    }
}
