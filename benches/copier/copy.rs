//! Copy latency at fan-outs of 1, 100, 200 and 1,000 followers.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::Duration;

use crate::legs::{LegsUs, legs_us};
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
    /// Where the time goes: each live copy's path in µs, from the copy ledger and the journal.
    pub(crate) legs_us: LegsUs,
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
    /// (both by the journal).
    pub(crate) paired_ratio_p50: f64,
}

// ---------------------------------------------------------------------------------------------
// Copy latency: from the master's order accepted at the broker to each follower's copy accepted,
// for 1, 100, 200 and 1,000 followers over 1, 2 and 4 nodes.

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
            (200, 1),
            (200, 2),
            (200, 4),
            (1000, 1),
            (1000, 2),
            (1000, 4),
        ]
    };
    let trades = options.trades.unwrap_or(if options.smoke { 3 } else { 20 });
    let floor = report.floors["notify_delivery"].p50_ms + report.floors["broker_round_trip"].p50_ms;
    let mut md = String::from(
        "| followers | nodes | copy latency p50 | p99 | max | last follower served p50 / max | by the journal: each p50 / p99 | the last p50 | p50 ÷ floor | p99 ÷ floor |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut floor_md = String::from(
        "| followers | nodes | N orders at once, by the journal: each p50 / p99 | the last p50 / max | the last reply p50 | the last observed p50 | last follower served, by the journal p50 / p99 | observed p50 | ÷ the floor, by the journal (p50 / p99) | ÷ the floor, observed | per trade, ÷ its own round (by the journal, p50) | ÷ (the floor + the master's leg, by the journal) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut legs_md = String::from(
        "| followers | nodes | copies | master fill → event committed | → notice received | → decided | → order sent | → at the broker | → reply received |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    // The master's leg (its fill published and announced, up to a follower's decision): one
    // follower's copy less its one order, by the journal, from the one-follower row.
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
            floor_rounds.round().await?;
        }
        let s = Stats::of(&samples);
        let l = Stats::of(&last);
        println!(
            "copy latency {followers} followers over {nodes} nodes: {} (max {:.2} ms); last follower {:.2} ms p50",
            s.show(),
            s.max_ms,
            l.p50_ms
        );
        // The broker's journal, read once: every copy of the measured trades and every floor
        // order by its one clock.
        let journal = copier_node::sim_broker::journal::read(&setup.dir.join("journal.jsonl"))?;
        let legs = legs_us(&setup.url, &journal, followers * trades).await?;
        let (each_journal, last_journal) = copies_by_the_journal(&journal, &tickets, followers)?;
        let (sj, lj) = (Stats::of(&each_journal), Stats::of(&last_journal));
        let _ = writeln!(
            md,
            "| {followers} | {nodes} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} / {:.2} ms | {} | {:.2} ms | {:.1}× | {:.1}× |",
            s.p50_ms,
            s.p99_ms,
            s.max_ms,
            l.p50_ms,
            l.max_ms,
            sj.show(),
            lj.p50_ms,
            s.p50_ms / floor,
            s.p99_ms / floor
        );
        let f = floor_rounds.close(&journal).await?;
        // Per trade: its last follower served over the floor round right after it.
        let mut paired: Vec<f64> = last_journal
            .iter()
            .zip(&f.rounds_journal)
            .map(|(copy, floor)| copy.as_secs_f64() / floor.as_secs_f64().max(1e-6))
            .collect();
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
            _ if followers == 1 => {
                master_leg = Some((lj.p50_ms - f.last_journal.p50_ms).max(0.0));
                "(gives the leg)".to_string()
            }
            Some(leg) => format!("{:.1}×", lj.p50_ms / (f.last_journal.p50_ms + leg)),
            None => "(no one-follower row before it)".to_string(),
        };
        let _ = writeln!(
            floor_md,
            "| {followers} | {nodes} | {} | {:.2} / {:.2} ms | {:.2} ms | {:.2} ms | {} | {:.2} ms | {:.1}× / {:.1}× | {:.1}× | {paired_p50:.1}× | {with_leg} |",
            f.each_journal.show(),
            f.last_journal.p50_ms,
            f.last_journal.max_ms,
            f.last.p50_ms,
            f.last_observed.p50_ms,
            lj.show(),
            l.p50_ms,
            lj.p50_ms / f.last_journal.p50_ms,
            lj.p99_ms / f.last_journal.p99_ms,
            l.p50_ms / f.last_observed.p50_ms
        );
        let _ = writeln!(
            legs_md,
            "| {followers} | {nodes} | {} | {} | {} | {} | {} | {} | {} |",
            legs.copies,
            legs.fill_to_event.show_us(),
            legs.event_to_notice.show_us(),
            legs.notice_to_decided.show_us(),
            legs.decided_to_sent.show_us(),
            legs.sent_to_broker.show_us(),
            legs.broker_to_reply.show_us()
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
            legs_us: legs,
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
        "## Copy latency\n\nFrom the master's order accepted at the broker (its reply at the benchmark) to each follower's copy accepted (its `opened` event at the benchmark, which watches every follower's position stream): {trades} master opens per row, every follower's copy a sample; and by the broker's journal alone, from the master's fill to each copy's journal line (see below). Nodes are `copier-node run` processes; the master and followers spread over them by fair share. Floor, measured in the same run: one NOTIFY delivered to a listener after commit ({:.2} ms) plus one broker round trip ({:.2} ms) = {floor:.2} ms (a follower on the master's own node has heard the event without the NOTIFY since 2026-12-07).\n\n{md}\n### Where the time goes\n\nThe same copies' path, each leg p50 / p99 in microseconds (every copy a sample), from the copy ledger's µs instants joined with the broker's journal, all on this machine's one wall clock: the master's fill (its journal line, stamped as the broker takes the request) to the event committed (the database's clock when the master's session first recorded the position, in the publish statement), to the notice received by the follower's node (its LISTEN connection; on the master's own node, since 2026-12-07, handed over by the master's session once the event is stored), to the follower's decision (its session's turn), to the order handed to the node's broker connection (after any wait for the copy ledger), to the order at the broker (the copy's journal line), to the broker's reply back at the follower's session. Runs before 2026-12-05 showed three legs on the ledger's millisecond clocks.\n\n{legs_md}\n### The floor for N orders\n\nIn the same run, one round after each measured trade (after the 200 ms that follow it, in which its master position and the copies are closed): as many market orders as the row has followers, sent at once with no copier in the way, {trades} rounds. They are sent by as many separate OS processes as the row has nodes, each with one bridge connection to the broker (a node has one per server), to the simulated broker in a process of its own, as the copies are. Each sender process logs its share of the floor's accounts in as a node's follower sessions are: with a fence, its orders carrying the fence and a client order id of the copies' form, its own position events coming back to it (taken by a task of its own). The floor's accounts are watched as the followers are, so the broker sends the same events in both. Each order is timed from the instant its sender read the benchmark's go (its sender's wall clock, as a node's order starts from its decision) three ways: to its journal line (the same machine's wall clock, stamped as the broker takes the request), to its reply at its sender, and, from the benchmark's go, to its `opened` event at an observer watching every floor account. The copies are timed from the master's fill to each copy's journal line, and at the observer as in the table above. The last follower served divided by the floor's last order, both by the journal, says how far the copies are from what the broker connections allow (the p50 over the p50, and the p99 over the p99); the observed ratio is beside it. The paired column divides each trade's last follower served by the round after it (the machine as that trade found it; both by the journal) and takes the median. The floor leaves out the master's leg, which no copy can skip: the master's fill reaching its session, published and announced to the followers' node. The last column adds it, measured in the same run by the journal as the one-follower row's copy less its one floor order ({:.2} ms). Runs before 2026-12-05 sent the floor from the benchmark's own process, whose runtime also ran the simulated broker, and timed it by its replies and at the observer; runs before 2026-12-02 timed it by the replies only.\n\n{floor_md}",
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
