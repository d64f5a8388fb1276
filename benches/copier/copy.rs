//! Copy latency at fan-outs of 1, 100 and 1,000 followers.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::{Observer, Setup};
use crate::orders_floor::OrdersFloor;
use crate::stats::Stats;
use crate::trades::{between, master_opens, opens_by_ticket};
use crate::{Options, Pg, Report};
use anyhow::Context;
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::Side;
use serde::Serialize;
use tokio::time::Instant;

/// Copy latency at one fan-out.
#[derive(Serialize)]
pub(crate) struct CopyRow {
    pub(crate) followers: usize,
    pub(crate) nodes: usize,
    pub(crate) trades: usize,
    /// Timed at the benchmark: the master's reply to each copy's `opened` event.
    pub(crate) latency: Stats,
    pub(crate) last_follower: Stats,
    /// Timed by the broker's journal alone: the master's fill to each copy's acceptance.
    pub(crate) latency_journal: Stats,
    pub(crate) last_follower_journal: Stats,
    pub(crate) floor_ms: f64,
    /// Where the time goes, from the copy ledger's legs (millisecond clocks).
    pub(crate) legs: Legs,
    /// The floor for this fan-out: as many orders sent at once by as many sender processes
    /// (one connection each) as there are nodes, with no copier in the way; time until each
    /// reply, and until the last.
    pub(crate) orders_floor: Stats,
    pub(crate) orders_floor_last: Stats,
    /// The same orders timed by their `opened` events at an observer, as the copies are: until
    /// each, and until the last.
    pub(crate) orders_floor_observed: Stats,
    pub(crate) orders_floor_observed_last: Stats,
    /// The same orders timed by the broker's journal (each acceptance from the round's start),
    /// as the copies' journal figures are: each, and the last.
    pub(crate) orders_floor_journal: Stats,
    pub(crate) orders_floor_journal_last: Stats,
    /// The median over trades of the last follower served ÷ the floor round run right after it
    /// (its last order observed).
    pub(crate) paired_ratio_p50: f64,
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
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let rows: Vec<LegClocks> = loop {
        let rows = sqlx::query_as(
            "SELECT master_fill_ms, event_committed_ms, decided_ms, accepted_ms FROM copy_ledger",
        )
        .fetch_all(&mut conn)
        .await?;
        if rows.len() >= expected || Instant::now() >= deadline {
            break rows;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    conn.close().await?;
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

// ---------------------------------------------------------------------------------------------
// Copy latency: from the master's order accepted at the broker to each follower's copy accepted,
// for 1, 100 and 1,000 followers over 1, 2 and 4 nodes.

pub(crate) async fn copy_latency(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
    let configs: &[(usize, usize)] = if let Some(rows) = &options.rows {
        rows
    } else if options.smoke {
        &[(1, 1), (10, 2)]
    } else {
        &[
            (1, 1),
            (100, 1),
            (100, 2),
            (100, 4),
            (1000, 1),
            (1000, 2),
            (1000, 4),
        ]
    };
    let trades = options.trades.unwrap_or(if options.smoke { 3 } else { 20 });
    let floor = report.floors["notify_delivery"].p50_ms + report.floors["broker_round_trip"].p50_ms;
    let mut md = String::from(
        "| followers | nodes | copy latency p50 | p99 | max | last follower served p50 / max | p50 ÷ floor | p99 ÷ floor |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut floor_md = String::from(
        "| followers | nodes | N orders at once, by the journal: each p50 / p99 | the last p50 / max | the last reply p50 | the last observed p50 | last follower served, by the journal p50 / p99 | observed p50 | ÷ the floor, by the journal | ÷ the floor, observed | per trade, ÷ its own round (observed, p50) | ÷ (the floor + the master's leg, by the journal) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut legs_md = String::from(
        "| followers | nodes | copies | master fill → event committed p50 / p99 | event → follower decided p50 / p99 | decided → broker accepted p50 / p99 |\n|---:|---:|---:|---:|---:|---:|\n",
    );
    // The master's leg (its fill published and announced, up to a follower's decision): one
    // follower's copy less its one order, by the journal, from the first row.
    let mut master_leg: Option<f64> = None;
    for &(followers, nodes) in configs {
        let mut setup =
            Setup::new(pg, &format!("bench_copy_{followers}_{nodes}"), 1, followers).await?;
        for i in 0..nodes {
            setup.spawn_node(
                &format!("c{i}"),
                ["--lease", "10s", "--fence", "3s", "--cycle", "2s"],
            )?;
        }
        setup
            .wait_settled(followers + 1, Duration::from_secs(300))
            .await?;
        let logins: Vec<String> = (1..=followers).map(|g| format!("f{g}")).collect();
        let mut observer = Observer::new(&setup.broker.addr, &logins).await?;
        let trader = BridgeClient::connect(setup.broker.addr.clone(), "manual");
        trader.wait_ready(Duration::from_secs(10)).await?;
        let mut floor_rounds = OrdersFloor::start(&setup.broker.addr, followers, nodes).await?;
        let mut samples = Vec::new();
        let mut last = Vec::new();
        // Per trade: its last follower served over the floor round right after it.
        let mut paired = Vec::new();
        let mut tickets = Vec::with_capacity(trades);
        for i in 0..trades {
            let side = if i % 2 == 0 { Side::Buy } else { Side::Sell };
            let request = Request::hand_open("m1", "EURUSD", side, 0.1);
            let reply = trader.call(request).await?;
            let accepted = Instant::now();
            let ticket = reply["ticket"].as_i64().context("ticket")?;
            tickets.push(ticket);
            let mut seen = HashSet::new();
            let deadline = accepted + Duration::from_secs(60);
            while seen.len() < followers {
                let (login, t, at) = tokio::time::timeout_at(deadline, observer.arrivals.recv())
                    .await
                    .context("copies did not all arrive")?
                    .context("observer ended")?;
                if t == ticket && seen.insert(login) {
                    samples.push(at.saturating_duration_since(accepted));
                    if seen.len() == followers {
                        last.push(at.saturating_duration_since(accepted));
                    }
                }
            }
            let served = *last.last().expect("every follower served");
            // Close it again, so positions stay few; the closes are not measured.
            trader
                .call(Request::Close {
                    login: "m1".into(),
                    fence: None,
                    ticket,
                    volume: None,
                    client_order_id: None,
                })
                .await?;
            tokio::time::sleep(Duration::from_millis(200)).await; // spacing between measured trades
            // The floor's round, on the machine as this trade found it (its closes done).
            let floor_round = floor_rounds.round().await?;
            paired.push(served.as_secs_f64() / floor_round.as_secs_f64().max(1e-6));
        }
        let s = Stats::of(&samples);
        let l = Stats::of(&last);
        println!(
            "copy latency {followers} followers over {nodes} nodes: {} (max {:.2} ms); last follower {:.2} ms p50",
            s.show(),
            s.max_ms,
            l.p50_ms
        );
        let _ = writeln!(
            md,
            "| {followers} | {nodes} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} / {:.2} ms | {:.1}× | {:.1}× |",
            s.p50_ms,
            s.p99_ms,
            s.max_ms,
            l.p50_ms,
            l.max_ms,
            s.p50_ms / floor,
            s.p99_ms / floor
        );
        let legs = legs(&setup.url, followers * trades).await?;
        // The broker's journal, read once: every copy of the measured trades and every floor
        // order by its one clock.
        let journal = copier_node::sim_broker::journal::read(&setup.dir.join("journal.jsonl"))?;
        let (each_journal, last_journal) = copies_by_the_journal(&journal, &tickets, followers)?;
        let (sj, lj) = (Stats::of(&each_journal), Stats::of(&last_journal));
        let f = floor_rounds.close(&journal).await?;
        paired.sort_by(|a, b| a.total_cmp(b));
        let paired_p50 = paired[(paired.len() - 1) / 2];
        println!(
            "orders floor {followers} orders from {nodes} processes: by the journal each {}, last {}; replies last {}; observed last {} (copies: last follower by the journal {}, {:.2}x the floor; observed {:.2} ms, {:.2}x; paired {paired_p50:.2}x)",
            f.each_journal.show(),
            f.last_journal.show(),
            f.last.show(),
            f.last_observed.show(),
            lj.show(),
            lj.p50_ms / f.last_journal.p50_ms,
            l.p50_ms,
            l.p50_ms / f.last_observed.p50_ms
        );
        let with_leg = match master_leg {
            None => {
                master_leg = Some((lj.p50_ms - f.last_journal.p50_ms).max(0.0));
                "(gives the leg)".to_string()
            }
            Some(leg) => format!("{:.1}×", lj.p50_ms / (f.last_journal.p50_ms + leg)),
        };
        let _ = writeln!(
            floor_md,
            "| {followers} | {nodes} | {} | {:.2} / {:.2} ms | {:.2} ms | {:.2} ms | {} | {:.2} ms | {:.1}× | {:.1}× | {paired_p50:.1}× | {with_leg} |",
            f.each_journal.show(),
            f.last_journal.p50_ms,
            f.last_journal.max_ms,
            f.last.p50_ms,
            f.last_observed.p50_ms,
            lj.show(),
            l.p50_ms,
            lj.p50_ms / f.last_journal.p50_ms,
            l.p50_ms / f.last_observed.p50_ms
        );
        let _ = writeln!(
            legs_md,
            "| {followers} | {nodes} | {} | {} | {} | {} |",
            legs.copies,
            legs.fill_to_event.show(),
            legs.event_to_decision.show(),
            legs.decision_to_accept.show()
        );
        report.copy.push(CopyRow {
            followers,
            nodes,
            trades,
            latency: s,
            last_follower: l,
            latency_journal: sj,
            last_follower_journal: lj,
            floor_ms: floor,
            legs,
            orders_floor: f.each,
            orders_floor_last: f.last,
            orders_floor_observed: f.each_observed,
            orders_floor_observed_last: f.last_observed,
            orders_floor_journal: f.each_journal,
            orders_floor_journal_last: f.last_journal,
            paired_ratio_p50: paired_p50,
        });
        trader.close();
        drop(observer);
        setup.stop().await;
    }
    report.markdown.push(format!(
        "## Copy latency\n\nFrom the master's order accepted at the broker (its reply at the benchmark) to each follower's copy accepted (its `opened` event at the benchmark, which watches every follower's position stream): {trades} master opens per row, every follower's copy a sample. Nodes are `copier-node run` processes; the master and followers spread over them by fair share. Floor, measured in the same run: one NOTIFY delivered to a listener after commit ({:.2} ms) plus one broker round trip ({:.2} ms) = {floor:.2} ms.\n\n{md}\n### Where the time goes\n\nThe same copies' legs from the copy ledger (every copy a sample; each clock at millisecond resolution, so a leg under a millisecond reads 0 or 1): the master's fill at its broker to the event committed by the master's session, the event to the follower's decision (NOTIFY delivery and the follower session's turn), and the decision to the broker's acceptance (the order's round trip, including any wait for the node's broker connection).\n\n{legs_md}\n### The floor for N orders\n\nIn the same run, one round after each measured trade (after the 200 ms that follow it, in which its master position and the copies are closed): as many market orders as the row has followers, sent at once with no copier in the way, {trades} rounds. They are sent by as many separate OS processes as the row has nodes, each with one bridge connection to the broker (a node has one per server), to the simulated broker in a process of its own, as the copies are. Each sender process logs its share of the floor's accounts in as a node's follower sessions are: with a fence, its orders carrying the fence and a client order id of the copies' form, its own position events coming back to it (taken by a task of its own). The floor's accounts are watched as the followers are, so the broker sends the same events in both. Each order is timed three ways: by the broker's journal (its acceptance, on the journal's microsecond clock, from the instant the benchmark told the senders to go), by its reply at its sender, and by its `opened` event at an observer watching every floor account. The copies are timed the same ways: by the journal from the master's fill to each copy's acceptance, and at the observer as in the table above. The journal is the one clock of both, so the journal's ratio is the like-for-like one: the last follower served divided by the floor's last order says how far the copies are from what the broker connections allow. The paired column divides each trade's last follower served by the round after it (the machine as that trade found it; both observed) and takes the median. The floor leaves out the master's leg, which no copy can skip: the master's fill reaching its session, published and announced to the followers' node. The last column adds it, measured in the same run by the journal as the one-follower row's copy less its one floor order ({:.2} ms). Runs before 2026-12-05 sent the floor from the benchmark's own process, whose runtime also ran the simulated broker, and timed it by the observer only; runs before 2026-12-02 timed it by the replies.\n\n{floor_md}",
        report.floors["notify_delivery"].p50_ms,
        report.floors["broker_round_trip"].p50_ms,
        master_leg.unwrap_or(f64::NAN)
    ));
    Ok(())
}

/// Every copy of the master's `tickets` on followers `f1..=fN` by the broker's journal alone:
/// (each copy's acceptance from the master's fill, each trade's last).
fn copies_by_the_journal(
    journal: &[copier_node::sim_broker::journal::JournalEntry],
    tickets: &[i64],
    followers: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let masters = master_opens(journal);
    let opens = opens_by_ticket(journal);
    let (mut each, mut last) = (Vec::new(), Vec::new());
    for ticket in tickets {
        let master = *masters
            .get(ticket)
            .with_context(|| format!("the master's ticket {ticket} is not in the journal"))?;
        let copies = opens.get(ticket).map(Vec::as_slice).unwrap_or_default();
        let served: HashSet<&str> = copies.iter().map(|(login, _, _)| login.as_str()).collect();
        anyhow::ensure!(
            copies.len() == followers && served.len() == followers,
            "the journal holds {} copies of master ticket {ticket} on {} followers, not one on each of {followers}",
            copies.len(),
            served.len()
        );
        let took: Vec<Duration> = copies
            .iter()
            .map(|(_, _, at)| between(master, *at))
            .collect();
        last.push(took.iter().copied().max().unwrap_or_default());
        each.extend(took);
    }
    Ok((each, last))
}
