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
