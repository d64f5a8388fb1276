//! What the demo watches and its last word: owners per node, the trade generator, and the final
//! check that no follower missed a copy or a close.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::Context;
use sqlx::PgConnection;
use tokio::time::Instant;

use crate::broker::client::BridgeClient;
use crate::broker::protocol::{PositionsResult, Request};
use crate::broker::types::{Position, Side};
use crate::broker::{BrokerError, RejectCode};
use crate::db;
use crate::sim_broker::tools;

/// How long the final check waits for the followers to catch up.
const CATCH_UP: Duration = Duration::from_secs(20);

/// The demo's last word on copying (L3): close every master position and wait until no follower
/// holds a copy; open one position on each master and wait until every follower holds exactly one
/// copy of it; close those and wait until the followers are flat again. Returns (followers
/// without their copy, copies left open after their master closed).
pub(super) async fn final_check(
    trader: &BridgeClient,
    masters: usize,
    links: &[(String, String)],
) -> anyhow::Result<(usize, usize)> {
    close_all(trader, masters).await?;
    let mut missed_closes = wait_flat(trader, links).await?;
    let mut tickets = HashMap::new();
    for m in 1..=masters {
        let login = format!("m{m}");
        let reply = trader
            .call(Request::hand_open(&login, "EURUSD", Side::Buy, 0.5))
            .await
            .with_context(|| format!("final check: opening on {login}"))?;
        let ticket = reply["ticket"]
            .as_i64()
            .with_context(|| format!("final check: no ticket in the reply for {login}"))?;
        tickets.insert(login, ticket);
    }
    let copied = |open: &[Position], ticket: i64| {
        open.iter()
            .filter(|p| crate::model::parse_marker(&p.comment) == Some(ticket))
            .count()
    };
    let since = Instant::now();
    let missed_copies = loop {
        let mut missing = 0;
        for (master, follower) in links {
            if copied(&positions_of(trader, follower).await?, tickets[master]) != 1 {
                missing += 1;
            }
        }
        if missing == 0 || since.elapsed() > CATCH_UP {
            break missing;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    close_all(trader, masters).await?;
    missed_closes += wait_flat(trader, links).await?;
    Ok((missed_copies, missed_closes))
}

/// An account's open positions; none for an account the broker has never seen log in.
async fn positions_of(trader: &BridgeClient, login: &str) -> anyhow::Result<Vec<Position>> {
    let value = match trader
        .call(Request::Positions {
            login: login.to_string(),
        })
        .await
    {
        Err(BrokerError::Rejected(r)) if r.code == RejectCode::UnknownLogin => {
            return Ok(Vec::new());
        }
        other => other.with_context(|| format!("reading the positions of {login}"))?,
    };
    Ok(serde_json::from_value::<PositionsResult>(value)?.positions)
}

async fn close_all(trader: &BridgeClient, masters: usize) -> anyhow::Result<()> {
    for m in 1..=masters {
        let login = format!("m{m}");
        for p in positions_of(trader, &login).await? {
            trader
                .call(Request::Close {
                    login: login.clone(),
                    fence: None,
                    ticket: p.ticket,
                    volume: None,
                    client_order_id: None,
                })
                .await
                .with_context(|| format!("final check: closing {} on {login}", p.ticket))?;
        }
    }
    Ok(())
}

/// Waits until no follower holds a position; returns how many are left after [`CATCH_UP`].
async fn wait_flat(trader: &BridgeClient, links: &[(String, String)]) -> anyhow::Result<usize> {
    let since = Instant::now();
    loop {
        let mut left = 0;
        for (_, follower) in links {
            left += positions_of(trader, follower).await?.len();
        }
        if left == 0 || since.elapsed() > CATCH_UP {
            return Ok(left);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One random hand trade on a random master. True if the broker accepted it.
pub(super) async fn trade(trader: &BridgeClient, masters: usize) -> bool {
    tools::random_trade(trader, &format!("m{}", fastrand::usize(1..=masters))).await
}

pub(super) async fn owners(conn: &mut PgConnection) -> Result<HashMap<i64, String>, sqlx::Error> {
    db::setup::live_owners(conn).await
}

pub(super) fn describe_owners(
    owners: &HashMap<i64, String>,
    nodes: usize,
    down: Option<usize>,
) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for o in owners.values() {
        *counts.entry(o.clone()).or_insert(0) += 1;
    }
    (1..=nodes)
        .map(|i| {
            let name = format!("demo-n{i}");
            let n = counts.get(&name).copied().unwrap_or(0);
            if down == Some(i - 1) {
                format!("{name}: down")
            } else {
                format!("{name}: {n}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}
