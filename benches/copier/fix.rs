//! Copy latency over FIX beside the bridge, in the same run: one master and one follower on one
//! node, the master's trades (opens and partial closes) placed by hand at the venue; and a
//! SIGTERM hand-off over both, timed by the copies the receiving node sent.

use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::Setup;
use crate::stats::Stats;
use crate::trades::{copy_closed, fills, served_again, trimmed, wait_journal};
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
    /// From the master's partial close to the copy's trim.
    pub(crate) trim: Stats,
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
        "| protocol | trades | copy latency p50 | p99 | max | p50 ÷ floor | trim latency p50 / p99 |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    for protocol in ["bridge", "fix"] {
        let mut setup = Setup::new(pg, &format!("bench_fix_{protocol}"), 1, 1).await?;
        let (venue, journal_path) = on_broker(&setup, protocol, &["m1", "f1"]).await?;
        setup.spawn_node("x0", ["--lease", "10s", "--fence", "3s", "--cycle", "2s"])?;
        setup.wait_settled(2, Duration::from_secs(120)).await?;
        let trader = BridgeClient::connect(setup.broker.addr.clone(), "manual");
        trader.wait_ready(Duration::from_secs(10)).await?;
        let mut samples = Vec::new();
        let mut trims = Vec::new();
        for i in 0..trades {
            let side = if i % 2 == 0 { Side::Buy } else { Side::Sell };
            let ticket = hand_open(venue.as_ref(), &trader, side).await?;
            samples.push(wait_journal(&journal_path, "the copy", |l| fills(l, ticket)).await?);
            // Half of it closed: the copy's trim, timed the same way.
            hand_close(venue.as_ref(), &trader, ticket, Some(0.1)).await?;
            trims.push(
                wait_journal(&journal_path, "the copy's trim", |l| trimmed(l, ticket)).await?,
            );
            // Closed (not measured), and the copy's close awaited.
            hand_close(venue.as_ref(), &trader, ticket, None).await?;
            wait_journal(&journal_path, "the copy's close", |lines| {
                copy_closed(lines, ticket).then_some(())
            })
            .await?;
            tokio::time::sleep(Duration::from_millis(100)).await; // spacing between measured trades
        }
        let s = Stats::of(&samples);
        let t = Stats::of(&trims);
        println!(
            "copy latency over {protocol}: {}; trims {}",
            s.show(),
            t.show()
        );
        let _ = writeln!(
            md,
            "| {protocol} | {trades} | {:.2} ms | {:.2} ms | {:.2} ms | {:.1}× | {} |",
            s.p50_ms,
            s.p99_ms,
            s.max_ms,
            s.p50_ms / floor,
            t.show()
        );
        report.fix.push(FixRow {
            protocol,
            trades,
            latency: s,
            trim: t,
            floor_ms: floor,
        });
        trader.close();
        drop(venue);
        setup.stop().await;
    }
    report.markdown.push(format!(
        "## Copy latency over FIX beside the bridge\n\nOne master and one follower on one node, {trades} master opens per protocol: from the master's fill to the copy's fill, both by the venue's own clock (its journal's microsecond `ts_us`); then the master closes half of each position, and the trim latency runs from the master's partial close to the copy's (the copy's opening volume is recorded once, so no later reconcile trims it again). The bridge rows use the simulated broker; the FIX rows the QuickFIX test venue (`tests/fix/acceptor.cpp`), with the master's trades arriving by drop copy and every copy recorded in the FIX ledger before it is sent (one more database round trip than the bridge). Floor, measured in the same run: one NOTIFY delivered after commit plus one broker round trip = {floor:.2} ms.\n\n{md}"
    ));
    Ok(())
}

#[derive(Serialize)]
pub(crate) struct FixHandoffRow {
    pub(crate) protocol: &'static str,
    pub(crate) followers: usize,
    /// From the SIGTERM to the last follower's copy of the first master trade that the receiving
    /// node copied to every follower (the journal's clock, which names each copy's sender).
    pub(crate) served_again: Stats,
    /// Every copy of the master trades placed from the signal until then: master fill to copy.
    pub(crate) copies_meanwhile: Stats,
    /// How many of those copies the stopping node sent (it copies on while a prepared receiver
    /// logs in).
    pub(crate) sent_by_the_stopping_node: usize,
}

/// A SIGTERM hand-off over FIX beside the bridge, in the same run: one master and ten followers
/// on two nodes; the node that started first is stopped, and from the signal on the master opens
/// a position, waits for its copies, and opens the next, until the receiving node (the journal
/// names each copy's sender) has copied one to every follower.
pub(crate) async fn fix_handoff(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
    let runs = if options.smoke { 1 } else { 5 };
    let followers = 10;
    let mut md = String::from(
        "| protocol | followers | until the receiver served every follower p50 / p99 (runs) | max | copies meanwhile p50 / p99 (copies) | of them sent by the stopping node |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for protocol in ["bridge", "fix"] {
        let mut samples = Vec::new();
        let mut meanwhile = Vec::new();
        let mut by_stopping = 0;
        for run in 0..runs {
            let mut setup = Setup::new(
                pg,
                &format!("bench_fix_handoff_{protocol}_{run}"),
                1,
                followers,
            )
            .await?;
            let logins: Vec<String> = std::iter::once("m1".to_string())
                .chain((1..=followers).map(|g| format!("f{g}")))
                .collect();
            let logins: Vec<&str> = logins.iter().map(String::as_str).collect();
            let (venue, journal_path) = on_broker(&setup, protocol, &logins).await?;
            let timing = ["--lease", "3s", "--fence", "1s", "--cycle", "500ms"];
            let first = setup.spawn_node("ha", timing)?;
            setup
                .wait_settled(followers + 1, Duration::from_secs(120))
                .await?;
            setup.spawn_node("hb", timing)?;
            setup
                .wait_settled(followers + 1, Duration::from_secs(120))
                .await?;
            let trader = BridgeClient::connect(setup.broker.addr.clone(), "manual");
            trader.wait_ready(Duration::from_secs(10)).await?;
            let run = served_again(
                &journal_path,
                followers,
                ("ha", "hb"),
                first,
                "TERM",
                async || hand_open(venue.as_ref(), &trader, Side::Buy).await,
            )
            .await?;
            meanwhile.extend(run.meanwhile);
            by_stopping += run.by_the_signalled;
            samples.push(run.after);
            trader.close();
            drop(venue);
            setup.stop().await;
        }
        let s = Stats::of(&samples);
        let m = Stats::of(&meanwhile);
        println!(
            "SIGTERM hand-off over {protocol}: the receiver served every follower after {}; copies meanwhile {}, {by_stopping} sent by the stopping node",
            s.show(),
            m.show()
        );
        let _ = writeln!(
            md,
            "| {protocol} | {followers} | {} ({}) | {:.0} ms | {} ({}) | {by_stopping} |",
            s.show(),
            s.runs,
            s.max_ms,
            m.show(),
            m.runs
        );
        report.fix_handoff.push(FixHandoffRow {
            protocol,
            followers,
            served_again: s,
            copies_meanwhile: m,
            sent_by_the_stopping_node: by_stopping,
        });
    }
    report.markdown.push(format!(
        "## Hand-off over FIX beside the bridge\n\nOne master and {followers} followers on two node processes (lease 3 s, fence 1 s, cycle 500 ms), all on the simulated broker (bridge) or all on the QuickFIX test venue (FIX); the node that started first gets SIGTERM, and from the signal on the master opens a position, waits for every follower's copy and opens the next, until one is copied to every follower by the receiving node: the time from the signal (the benchmark's wall clock) to that position's last copy in the broker's journal (its `ts_us`, the same machine's wall clock; the journal names each copy's sender, so a copy the stopping node sent does not count as served by the receiver). Every copy of those positions is also timed from the master's fill. Over FIX a session identity (SenderCompID, TargetCompID) holds one logon at a time: the stopping node logs each account out (and waits for the venue's answer) before its release commits, and the new owner's logon, the positions and orders it reads and its drop-copy subscription all come after the release. Over the bridge the SIGTERM hand-off is prepared: the receiving node logs each account in without a fence while the stopping node still copies, and raises the fence after its claim (see [prepared hand-offs](docs/design/prepared-handoff.md)).\n\n{md}"
    ));
    Ok(())
}

/// Puts `setup`'s accounts on the protocol's broker: the simulated one (`bridge`), or a QuickFIX
/// test venue started here for `logins` (`fix`), the accounts pointed at it. Returns the venue
/// (it stops when dropped) and the journal that times the trades.
async fn on_broker(
    setup: &Setup,
    protocol: &str,
    logins: &[&str],
) -> anyhow::Result<(Option<FixVenue>, std::path::PathBuf)> {
    if protocol != "fix" {
        return Ok((None, setup.dir.join("journal.jsonl")));
    }
    let accounts: Vec<VenueAccount> = logins
        .iter()
        .map(|login| VenueAccount {
            login,
            password: "",
        })
        .collect();
    let venue = FixVenue::start(&setup.dir, &accounts);
    let mut c = PgConnection::connect(&setup.url).await?;
    sqlx::query("UPDATE trading_accounts SET server = $1")
        .bind(format!(
            "fix://127.0.0.1:{}?target={}",
            venue.port, venue.comp_id
        ))
        .execute(&mut c)
        .await?;
    c.close().await?;
    let journal = venue.journal.clone();
    Ok((Some(venue), journal))
}

/// The master's (`m1`) position `ticket` closed by hand at its broker: `volume` lots of it, or
/// all.
async fn hand_close(
    venue: Option<&FixVenue>,
    trader: &BridgeClient,
    ticket: i64,
    volume: Option<f64>,
) -> anyhow::Result<()> {
    match venue {
        Some(v) => {
            // The venue closes lots given; 1000 lots is more than any test position.
            let lots = volume.unwrap_or(1000.0);
            let reply = v.control(&format!("close m1 {ticket} {lots}"));
            anyhow::ensure!(reply.starts_with("ok"), "the venue's hand close: {reply}");
        }
        None => {
            trader
                .call(Request::Close {
                    login: "m1".into(),
                    fence: None,
                    ticket,
                    volume,
                    client_order_id: None,
                })
                .await?;
        }
    }
    Ok(())
}

/// The master's (`m1`) market order of 0.2 EURUSD placed by hand at its broker: its ticket.
async fn hand_open(
    venue: Option<&FixVenue>,
    trader: &BridgeClient,
    side: Side,
) -> anyhow::Result<i64> {
    match venue {
        Some(v) => {
            let side = if side == Side::Buy { "buy" } else { "sell" };
            let reply = v.control(&format!("open m1 EURUSD {side} 0.2"));
            reply
                .strip_prefix("ok ")
                .and_then(|t| t.parse().ok())
                .with_context(|| format!("the venue's hand open: {reply}"))
        }
        None => trader
            .call(Request::hand_open("m1", "EURUSD", side, 0.2))
            .await?["ticket"]
            .as_i64()
            .context("ticket"),
    }
}
