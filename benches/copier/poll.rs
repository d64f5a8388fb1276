//! Events without LISTEN: copy latency when followers poll `master_state` beside LISTEN in the
//! same run, and what one poll costs the database when a node follows 1,000 or 10,000 masters.

use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::Setup;
use crate::stats::Stats;
use crate::trades::{copy_closed, fills, wait_journal};
use crate::{Options, Pg, Report};
use anyhow::Context;
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::Side;
use serde::Serialize;
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

#[derive(Serialize)]
pub(crate) struct PollRow {
    pub(crate) events: String,
    pub(crate) trades: usize,
    pub(crate) latency: Stats,
    pub(crate) floor_ms: f64,
}

#[derive(Serialize)]
pub(crate) struct PollCostRow {
    pub(crate) masters: usize,
    pub(crate) statement: Stats,
    pub(crate) floor_ms: f64,
}

pub(crate) async fn poll_latency(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
    let trades = if options.smoke { 3 } else { 30 };
    let floor = report.floors["notify_delivery"].p50_ms + report.floors["broker_round_trip"].p50_ms;
    let mut md = String::from(
        "| events | trades | copy latency p50 | p99 | max | p50 ÷ floor |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for (events, poll) in [
        ("LISTEN", None),
        ("poll 100ms", Some("100ms")),
        ("poll 20ms", Some("20ms")),
    ] {
        let mut setup = Setup::new(
            pg,
            &format!("bench_poll_{}", poll.unwrap_or("listen")),
            1,
            1,
        )
        .await?;
        let journal_path = setup.dir.join("journal.jsonl");
        let mut flags = vec!["--lease", "10s", "--fence", "3s", "--cycle", "2s"];
        if let Some(every) = poll {
            flags.extend(["--events-poll", every]);
        }
        setup.spawn_node("x0", flags)?;
        setup.wait_settled(2, Duration::from_secs(120)).await?;
        let trader = BridgeClient::connect(setup.broker.addr.clone(), "manual");
        trader.wait_ready(Duration::from_secs(10)).await?;
        let mut samples = Vec::new();
        for i in 0..trades {
            let side = if i % 2 == 0 { Side::Buy } else { Side::Sell };
            let ticket = trader
                .call(Request::hand_open("m1", "EURUSD", side, 0.1))
                .await?["ticket"]
                .as_i64()
                .context("ticket")?;
            samples.push(wait_journal(&journal_path, "the copy", |l| fills(l, ticket)).await?);
            trader
                .call(Request::Close {
                    login: "m1".into(),
                    fence: None,
                    ticket,
                    volume: None,
                    client_order_id: None,
                })
                .await?;
            wait_journal(&journal_path, "the copy's close", |lines| {
                copy_closed(lines, ticket).then_some(())
            })
            .await?;
            // Spacing, and off the poll's phase (a trade lands anywhere in the interval).
            tokio::time::sleep(Duration::from_millis(97 + 13 * (i as u64 % 7))).await;
        }
        let s = Stats::of(&samples);
        println!("copy latency with {events}: {}", s.show());
        let _ = writeln!(
            md,
            "| {events} | {trades} | {:.2} ms | {:.2} ms | {:.2} ms | {:.1}× |",
            s.p50_ms,
            s.p99_ms,
            s.max_ms,
            s.p50_ms / floor
        );
        report.poll.push(PollRow {
            events: events.to_string(),
            trades,
            latency: s,
            floor_ms: floor,
        });
        trader.close();
        setup.stop().await;
    }

    // What one poll costs: the node reads every subscribed master's (epoch, seq) in one
    // statement, whatever the number of followers (1,000 followers of 1,000 masters is the worst
    // case: every follower its own master).
    let url = pg.database("bench_poll_cost").await?;
    let mut c = PgConnection::connect(&url).await?;
    let select_floor = report.floors["pg_select_1"].p50_ms;
    let mut cost = String::from(
        "| masters followed by the node | one poll p50 | p99 | polls a second at 100 ms | p50 ÷ one round trip |\n|---:|---:|---:|---:|---:|\n",
    );
    let runs = if options.smoke { 5 } else { 200 };
    for masters in [1_000usize, 10_000] {
        sqlx::query(
            "INSERT INTO trading_accounts (id, platform, role, server, login)
             SELECT g, 'mt5', 'master', 'h:1', 'm' || g FROM generate_series(1, $1) g
             ON CONFLICT DO NOTHING",
        )
        .bind(masters as i64)
        .execute(&mut c)
        .await?;
        sqlx::query(
            "INSERT INTO master_state (master_id, epoch, seq, positions, updated_at)
             SELECT g, 1, g, '[]', now() FROM generate_series(1, $1) g
             ON CONFLICT DO NOTHING",
        )
        .bind(masters as i64)
        .execute(&mut c)
        .await?;
        sqlx::query("ANALYZE master_state").execute(&mut c).await?;
        let ids: Vec<i64> = (1..=masters as i64).collect();
        let mut samples = Vec::new();
        for _ in 0..runs {
            let t = Instant::now();
            let rows: Vec<(i64, i64, i64)> = sqlx::query_as(
                "SELECT master_id, epoch, seq FROM master_state WHERE master_id = ANY($1)",
            )
            .bind(&ids)
            .fetch_all(&mut c)
            .await?;
            samples.push(t.elapsed());
            anyhow::ensure!(rows.len() == masters, "every master read");
        }
        let s = Stats::of(&samples);
        println!("one poll of {masters} masters: {}", s.show());
        let _ = writeln!(
            cost,
            "| {masters} | {:.2} ms | {:.2} ms | 10 | {:.0}× |",
            s.p50_ms,
            s.p99_ms,
            s.p50_ms / select_floor
        );
        report.poll_cost.push(PollCostRow {
            masters,
            statement: s,
            floor_ms: select_floor,
        });
    }
    c.close().await?;
    report.markdown.push(format!(
        "## Events without LISTEN\n\nOne master and one follower on one node, {trades} master opens each: from the master's fill to the copy's fill by the broker's clock, with events by LISTEN and by polling `master_state` (`events_poll`). Floor, measured in the same run: one NOTIFY delivered after commit plus one broker round trip = {floor:.2} ms. A poll adds on average half its interval.\n\n{md}\nWhat polling costs the database: one statement per node per interval, reading every master the node's followers follow (so 1,000 followers of one master cost one row; 1,000 followers of 1,000 masters, 1,000 rows), beside one `SELECT 1` round trip ({select_floor:.3} ms) in the same run. A cheap count of free accounts (the lease loop's wake) rides along.\n\n{cost}"
    ));
    Ok(())
}
