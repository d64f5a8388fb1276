//! Reading a measured trade out of a broker's journal: the master's fill and its copy's, the
//! copy's close, and who sent each copy (shared by the sections that time copies by the broker's
//! own clock).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use copier_node::sim_broker::journal::{self, JournalEntry};
use tokio::time::Instant;

/// A journal line's instant in Unix microseconds (`ts_us`; a journal without it, at millisecond
/// resolution).
fn us(l: &JournalEntry) -> i64 {
    l.ts_us.unwrap_or(l.ts_ms * 1000)
}

/// From one journal instant to a later one (µs; none if it is earlier).
pub(crate) fn between(from_us: i64, to_us: i64) -> Duration {
    Duration::from_micros((to_us - from_us).max(0) as u64)
}

/// Every accepted open in the journal whose client order id is a copy's (`l<link>-m<ticket>-open`,
/// which the floor's orders carry too), by the master ticket it names: (login, sender, µs) each.
/// One pass over the journal, for the sections that read a large one once.
pub(crate) fn opens_by_ticket(
    lines: &[JournalEntry],
) -> std::collections::HashMap<i64, Vec<(String, String, i64)>> {
    let mut by = std::collections::HashMap::<i64, Vec<_>>::new();
    for l in lines.iter().filter(|l| l.action == "open" && l.accepted) {
        let ticket = l
            .client_order_id
            .as_deref()
            .and_then(|c| c.strip_suffix("-open"))
            .and_then(|c| c.rsplit_once("-m"))
            .and_then(|(_, t)| t.parse().ok());
        if let Some(ticket) = ticket {
            by.entry(ticket)
                .or_default()
                .push((l.login.clone(), l.client.clone(), us(l)));
        }
    }
    by
}

/// The master's (`m1`) accepted opens: ticket to µs.
pub(crate) fn master_opens(lines: &[JournalEntry]) -> std::collections::HashMap<i64, i64> {
    lines
        .iter()
        .filter(|l| l.login == "m1" && l.action == "open" && l.accepted)
        .filter_map(|l| Some((l.ticket?, us(l))))
        .collect()
}

/// The copies of master ticket `ticket` (master `m1`) on followers `f1..=fN`, once all are in:
/// (sender, instant in µs) each, and the master's fill instant in µs.
pub(crate) fn copies_of(
    lines: &[JournalEntry],
    ticket: i64,
    followers: usize,
) -> Option<(i64, Vec<(String, i64)>)> {
    let master = lines.iter().find(|l| {
        l.login == "m1" && l.action == "open" && l.accepted && l.ticket == Some(ticket)
    })?;
    let intent = format!("-m{ticket}-open");
    let copies: Vec<(String, i64)> = (1..=followers)
        .filter_map(|g| {
            let login = format!("f{g}");
            lines
                .iter()
                .find(|l| {
                    l.login == login
                        && l.action == "open"
                        && l.accepted
                        && l.client_order_id
                            .as_deref()
                            .is_some_and(|c| c.contains(&intent))
                })
                .map(|l| (l.client.clone(), us(l)))
        })
        .collect();
    (copies.len() == followers).then_some((us(master), copies))
}

/// Sends `signal` (`TERM`, `KILL`) to process `pid`.
pub(crate) async fn send_signal(pid: u32, signal: &str) -> anyhow::Result<()> {
    let status = tokio::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .await?;
    anyhow::ensure!(status.success(), "kill -{signal} {pid} failed: {status}");
    Ok(())
}

/// A node stopped (SIGTERM) or killed (`kill -9`), until the receiving node serves every
/// follower, by the broker's journal (and the signal's instant on the same wall clock).
pub(crate) struct ServedAgain {
    /// From the signal to the last copy of the first master trade that the receiving node copied
    /// to every follower.
    pub(crate) after: Duration,
    /// Every copy of the master trades placed from the signal until then: master fill to copy.
    pub(crate) meanwhile: Vec<Duration>,
    /// How many of those copies the signalled node sent (a stopping node copies on while a
    /// prepared receiver logs in).
    pub(crate) by_the_signalled: usize,
}

/// Sends `signal` to the node process `pid` (node id `node`); from the signal on, `open` places a
/// master trade by hand, the journal is read until every one of `followers` has its copy, and the
/// next is placed, until one is copied to every follower by node `receiver` (the journal names
/// each copy's sender, so a copy the signalled node sent does not count as served by the
/// receiver). At most a minute from the signal.
pub(crate) async fn served_again(
    journal: &Path,
    followers: usize,
    (node, receiver): (&str, &str),
    pid: u32,
    signal: &str,
    mut open: impl AsyncFnMut() -> anyhow::Result<i64>,
) -> anyhow::Result<ServedAgain> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let signalled = copier_node::wall_clock::unix_us();
    send_signal(pid, signal).await?;
    let mut meanwhile = Vec::new();
    let mut by_the_signalled = 0;
    loop {
        if Instant::now() > deadline {
            bail!(
                "{receiver} did not copy a master trade to every follower within 60 s of the {signal} of {node}"
            );
        }
        let ticket = open().await?;
        let (master, copies) = wait_journal(journal, "every follower's copy", |l| {
            copies_of(l, ticket, followers)
        })
        .await?;
        for (_, at) in &copies {
            meanwhile.push(between(master, *at));
        }
        by_the_signalled += copies.iter().filter(|(c, _)| c == node).count();
        if copies.iter().all(|(c, _)| c == receiver) {
            let last = copies
                .iter()
                .map(|(_, at)| *at)
                .max()
                .context("no copies")?;
            return Ok(ServedAgain {
                after: between(signalled, last),
                meanwhile,
                by_the_signalled,
            });
        }
    }
}

/// From the master's fill to the copy's fill of master ticket `ticket` (master `m1`, follower
/// `f1`), by the broker's clock.
pub(crate) fn fills(lines: &[JournalEntry], ticket: i64) -> Option<Duration> {
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
    Some(between(us(master), us(copy)))
}

/// From the master's partial close of `ticket` to the trim of its copy, by the broker's clock.
pub(crate) fn trimmed(lines: &[JournalEntry], ticket: i64) -> Option<Duration> {
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
    Some(between(us(master), us(trim)))
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
