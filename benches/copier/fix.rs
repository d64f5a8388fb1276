//! Copy latency over FIX beside the bridge, in the same run: one master and one follower on one
//! node, the master's trades placed by hand at the venue.

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

#[path = "../../tests/fix/venue.rs"]
#[allow(dead_code)] // the tests use more of the venue than the benchmark does
mod venue;
use venue::{FixVenue, VenueAccount};

#[derive(Serialize)]
pub(crate) struct FixRow {
    pub(crate) protocol: &'static str,
    pub(crate) trades: usize,
    pub(crate) latency: Stats,
    pub(crate) floor_ms: f64,
}

pub(crate) async fn fix_latency(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
    let trades = if options.smoke { 3 } else { 30 };
    let floor = report.floors["notify_delivery"].p50_ms + report.floors["broker_round_trip"].p50_ms;
    let mut md = String::from(
        "| protocol | trades | copy latency p50 | p99 | max | p50 ÷ floor |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for protocol in ["bridge", "fix"] {
        let mut setup = Setup::new(pg, &format!("bench_fix_{protocol}"), 1, 1).await?;
        let venue = (protocol == "fix").then(|| {
            FixVenue::start(
                &setup.dir,
                &[
                    VenueAccount {
                        login: "m1",
                        password: "",
                    },
                    VenueAccount {
                        login: "f1",
                        password: "",
                    },
                ],
            )
        });
        let journal_path = match &venue {
            Some(v) => {
                let mut c = PgConnection::connect(&setup.url).await?;
                sqlx::query("UPDATE trading_accounts SET server = $1")
                    .bind(format!("fix://127.0.0.1:{}?target={}", v.port, v.comp_id))
                    .execute(&mut c)
                    .await?;
                c.close().await?;
                v.journal.clone()
            }
            None => setup.dir.join("journal.jsonl"),
        };
        setup.spawn_node("x0", ["--lease", "10s", "--fence", "3s", "--cycle", "2s"])?;
        setup.wait_settled(2, Duration::from_secs(120)).await?;
        let trader = BridgeClient::connect(setup.broker.addr.to_string(), "manual");
        trader.wait_ready(Duration::from_secs(10)).await?;
        let mut samples = Vec::new();
        for i in 0..trades {
            let side = if i % 2 == 0 { Side::Buy } else { Side::Sell };
            let ticket = match &venue {
                Some(v) => {
                    let side = if side == Side::Buy { "buy" } else { "sell" };
                    let reply = v.control(&format!("open m1 EURUSD {side} 0.1"));
                    reply
                        .strip_prefix("ok ")
                        .and_then(|t| t.parse().ok())
                        .with_context(|| format!("the venue's hand open: {reply}"))?
                }
                None => trader
                    .call(Request::hand_open("m1", "EURUSD", side, 0.1))
                    .await?["ticket"]
                    .as_i64()
                    .context("ticket")?,
            };
            let (master, copy) =
                wait_journal(&journal_path, "the copy", |l| fills(l, ticket)).await?;
            samples.push(Duration::from_millis((copy - master).max(0) as u64));
            // Close it again (not measured), and wait for the copy's close.
            match &venue {
                Some(v) => {
                    v.control(&format!("close m1 {ticket} 0.1"));
                }
                None => {
                    trader
                        .call(Request::Close {
                            login: "m1".into(),
                            fence: None,
                            ticket,
                            volume: None,
                            client_order_id: None,
                        })
                        .await?;
                }
            }
            wait_journal(&journal_path, "the copy's close", |lines| {
                copy_closed(lines, ticket).then_some(())
            })
            .await?;
            tokio::time::sleep(Duration::from_millis(100)).await; // spacing between measured trades
        }
        let s = Stats::of(&samples);
        println!("copy latency over {protocol}: {}", s.show());
        let _ = writeln!(
            md,
            "| {protocol} | {trades} | {:.2} ms | {:.2} ms | {:.2} ms | {:.1}× |",
            s.p50_ms,
            s.p99_ms,
            s.max_ms,
            s.p50_ms / floor
        );
        report.fix.push(FixRow {
            protocol,
            trades,
            latency: s,
            floor_ms: floor,
        });
        trader.close();
        drop(venue);
        setup.stop().await;
    }
    report.markdown.push(format!(
        "## Copy latency over FIX beside the bridge\n\nOne master and one follower on one node, {trades} master opens per protocol: from the master's fill to the copy's fill, both by the venue's own clock (its journal, millisecond resolution). The bridge rows use the simulated broker; the FIX rows the QuickFIX test venue (`tests/fix/acceptor.cpp`), with the master's trades arriving by drop copy and every copy recorded in the FIX ledger before it is sent (one more database round trip than the bridge). Floor, measured in the same run: one NOTIFY delivered after commit plus one broker round trip = {floor:.2} ms.\n\n{md}"
    ));
    Ok(())
}
