//! Reading a measured trade out of a broker's journal: the master's fill and its copy's, and the
//! copy's close (shared by the sections that time copies by the broker's own clock).

use std::path::Path;
use std::time::Duration;

use anyhow::bail;
use copier_node::sim_broker::journal::{self, JournalEntry};
use tokio::time::Instant;

/// The master's fill and the copy's fill of master ticket `ticket` (master `m1`, follower `f1`),
/// by the broker's clock.
pub(crate) fn fills(lines: &[JournalEntry], ticket: i64) -> Option<(i64, i64)> {
    let master = lines.iter().find(|l| {
        l.login == "m1" && l.action == "open" && l.accepted && l.ticket == Some(ticket)
    })?;
    let intent = format!("-m{ticket}-open");
    let copy = lines.iter().find(|l| {
        l.login == "f1"
            && l.action == "open"
            && l.accepted
            && l.client_order_id
                .as_deref()
                .is_some_and(|c| c.contains(&intent))
    })?;
    Some((master.ts_ms, copy.ts_ms))
}

/// The master's partial close of `ticket` and the trim of its copy: their journal times.
pub(crate) fn trimmed(lines: &[JournalEntry], ticket: i64) -> Option<(i64, i64)> {
    let master = lines.iter().find(|l| {
        l.login == "m1" && l.action == "close" && l.accepted && l.ticket == Some(ticket)
    })?;
    let intent = format!("-m{ticket}-");
    let trim = lines.iter().find(|l| {
        l.login == "f1"
            && l.action == "close"
            && l.accepted
            && l.client_order_id
                .as_deref()
                .is_some_and(|c| c.contains(&intent) && c.contains("-trim"))
    })?;
    Some((master.ts_ms, trim.ts_ms))
}

/// Whether the copy of master ticket `ticket` has been closed.
pub(crate) fn copy_closed(lines: &[JournalEntry], ticket: i64) -> bool {
    let intent = format!("-m{ticket}-");
    lines.iter().any(|l| {
        l.login == "f1"
            && l.action == "close"
            && l.accepted
            && l.client_order_id
                .as_deref()
                .is_some_and(|c| c.contains(&intent) && c.contains("-close"))
    })
}

/// Polls the journal until `f` finds what it looks for (at most a minute).
pub(crate) async fn wait_journal<T>(
    path: &Path,
    what: &str,
    f: impl Fn(&[JournalEntry]) -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let lines = journal::read(path)?;
        if let Some(v) = f(&lines) {
            return Ok(v);
        }
        if Instant::now() > deadline {
            bail!("{what}: not in the journal within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
