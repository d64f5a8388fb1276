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

/// How far a trade server's clock runs from this host's, from the server time it showed just
/// now (`AccountInfo::server_time_ms`), rounded to the second: servers keep their own time zone
/// (whole hours or half hours from UTC), and a request's round trip is no part of that. `None`
/// when the server shows no time.
pub fn server_offset_ms(server_time_ms: Option<i64>) -> Option<i64> {
    server_time_ms.map(|t| ((t - unix_ms()) as f64 / 1000.0).round() as i64 * 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_offsets_are_whole_seconds_from_this_clock() {
        let two_hours = 2 * 3_600_000;
        let offset = server_offset_ms(Some(unix_ms() + two_hours + 120)).unwrap();
        assert_eq!(offset, two_hours);
        assert_eq!(server_offset_ms(Some(unix_ms() - 1_600)), Some(-2_000));
        assert_eq!(server_offset_ms(None), None);
    }
}
