//! Where a copy's time goes, from the copy ledger: its legs at millisecond resolution (every
//! ledger row), and the microsecond path of live copies joined with the broker's journal.

use std::collections::HashMap;
use std::time::Duration;

use crate::stats::Stats;
use crate::trades::{between, master_opens};
use copier_node::sim_broker::journal::JournalEntry;
use serde::Serialize;
use sqlx::Connection;
use tokio::time::Instant;

/// The copy ledger's rows of `url`, once `expected` are in (at most 10 s: a copy's row is written
/// just after its acceptance).
async fn ledger_rows<T>(url: &str, sql: &str, expected: usize) -> anyhow::Result<Vec<T>>
where
    T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
{
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let rows = loop {
        let rows: Vec<T> = sqlx::query_as(sql).fetch_all(&mut conn).await?;
        if rows.len() >= expected || Instant::now() >= deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    conn.close().await?;
    Ok(rows)
}

/// A copy's legs as the copy ledger records them (each clock at millisecond resolution): the
/// master's fill at its broker to the event committed (the master's session), the event to the
/// follower's decision (NOTIFY delivery, the follower session's wake-up and decision), and the
/// decision to the broker's acceptance (the order's round trip, and any wait for the broker
/// connection).
#[derive(Serialize)]
pub(crate) struct Legs {
    pub(crate) copies: usize,
    pub(crate) fill_to_event: Stats,
    pub(crate) event_to_decision: Stats,
    pub(crate) decision_to_accept: Stats,
}

/// A ledger row's clocks: master fill, event committed, decided, accepted (Unix ms).
type LegClocks = (Option<i64>, Option<i64>, Option<i64>, Option<i64>);

/// The legs of every copy in the ledger of `url` (waiting up to 10 s for `expected` rows: a copy's
/// row is written just after its acceptance).
pub(crate) async fn legs(url: &str, expected: usize) -> anyhow::Result<Legs> {
    let rows: Vec<LegClocks> = ledger_rows(
        url,
        "SELECT master_fill_ms, event_committed_ms, decided_ms, accepted_ms FROM copy_ledger",
        expected,
    )
    .await?;
    let leg = |pick: fn(&LegClocks) -> Option<(i64, i64)>| {
        let samples: Vec<Duration> = rows
            .iter()
            .filter_map(pick)
            .map(|(from, to)| Duration::from_millis((to - from).max(0) as u64))
            .collect();
        Stats::of(&samples)
    };
    Ok(Legs {
        copies: rows.len(),
        fill_to_event: leg(|r| r.0.zip(r.1)),
        event_to_decision: leg(|r| r.1.zip(r.2)),
        decision_to_accept: leg(|r| r.2.zip(r.3)),
    })
}

/// A live copy's path in microseconds, every copy a sample: the master's fill at the broker (its
/// journal line) to the event committed (the database's clock), to the notice received by the
/// follower's node, to the follower's decision, to its order handed to the broker connection,
/// to the order at the broker (its journal line), to the broker's reply back at the node. All on
/// this one machine's wall clock.
#[derive(Serialize)]
pub(crate) struct LegsUs {
    pub(crate) copies: usize,
    pub(crate) fill_to_event: Stats,
    pub(crate) event_to_notice: Stats,
    pub(crate) notice_to_decided: Stats,
    pub(crate) decided_to_sent: Stats,
    pub(crate) sent_to_broker: Stats,
    pub(crate) broker_to_reply: Stats,
}

/// A ledger row's µs path: login, follower ticket, master ticket, event committed, notice
/// received, decided, sent, accepted.
type PathUs = (
    String,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    Option<i64>,
);

/// The µs path of every live copy in the ledger of `url` (waiting as [`legs`] does for
/// `expected` rows), joined with the broker's `journal`: a row whose copy or master fill the
/// journal lacks is an error naming it.
pub(crate) async fn legs_us(
    url: &str,
    journal: &[JournalEntry],
    expected: usize,
) -> anyhow::Result<LegsUs> {
    let rows: Vec<PathUs> = ledger_rows(
        url,
        "SELECT login, follower_ticket, master_ticket, event_committed_us, notice_us, decided_us, \
                sent_us, accepted_us FROM copy_ledger WHERE NOT found_by_reconcile",
        expected,
    )
    .await?;
    let masters = master_opens(journal);
    let at_broker: HashMap<(&str, i64), i64> = journal
        .iter()
        .filter(|l| l.action == "open" && l.accepted)
        .filter_map(|l| Some(((l.login.as_str(), l.ticket?), l.ts_us?)))
        .collect();
    let mut legs: [Vec<Duration>; 6] = Default::default();
    for (login, ticket, master_ticket, event, notice, decided, sent, accepted) in &rows {
        let fill = *masters.get(master_ticket).ok_or_else(|| {
            anyhow::anyhow!(
                "master ticket {master_ticket} of {login}'s copy {ticket} is not in the journal"
            )
        })?;
        let broker = *at_broker
            .get(&(login.as_str(), *ticket))
            .ok_or_else(|| anyhow::anyhow!("{login}'s copy {ticket} is not in the journal"))?;
        let path = [
            Some(fill),
            *event,
            *notice,
            *decided,
            *sent,
            Some(broker),
            *accepted,
        ];
        for (leg, ends) in legs.iter_mut().zip(path.windows(2)) {
            if let [Some(from), Some(to)] = ends {
                leg.push(between(*from, *to));
            }
        }
    }
    let [
        fill_to_event,
        event_to_notice,
        notice_to_decided,
        decided_to_sent,
        sent_to_broker,
        broker_to_reply,
    ] = legs.map(|l| Stats::of(&l));
    Ok(LegsUs {
        copies: rows.len(),
        fill_to_event,
        event_to_notice,
        notice_to_decided,
        decided_to_sent,
        sent_to_broker,
        broker_to_reply,
    })
}
