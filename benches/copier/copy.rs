//! Copy latency at fan-outs of 1, 100 and 1,000 followers.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::{Observer, Setup};
use crate::stats::Stats;
use crate::{Options, Pg, Report};
use anyhow::Context;
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::{CloseOrder, OpenOrder, Side};
use copier_node::broker::{AccountLogin, Broker, TradeApi};
use serde::Serialize;
use tokio::time::Instant;

/// Copy latency at one fan-out.
#[derive(Serialize)]
pub(crate) struct CopyRow {
    pub(crate) followers: usize,
    pub(crate) nodes: usize,
    pub(crate) trades: usize,
    pub(crate) latency: Stats,
    pub(crate) last_follower: Stats,
    pub(crate) floor_ms: f64,
    /// Where the time goes, from the copy ledger's legs (millisecond clocks).
    pub(crate) legs: Legs,
    /// The floor for this fan-out: as many orders sent at once over as many connections as
    /// there are nodes, with no copier in the way; time until each reply, and until the last.
    pub(crate) orders_floor: Stats,
    pub(crate) orders_floor_last: Stats,
    /// The same orders timed by their `opened` events at an observer, as the copies are: until
    /// each, and until the last.
    pub(crate) orders_floor_observed: Stats,
    pub(crate) orders_floor_observed_last: Stats,
    /// The median over trades of the last follower served ÷ the floor round run right after it
    /// (its last order observed).
    pub(crate) paired_ratio_p50: f64,
}

/// The floor for `n` copies: `n` market orders sent at once by `n` account sessions logged in
/// over `connections` bridge connections to the same broker (as the nodes' follower sessions are
/// spread over their own connections, one per node), with no copier in the way. A session is the
/// node's: logged in with a fence, its orders carrying it and a client order id, its position
/// events coming back to it (a task per session takes them, as the node's follower tasks do), so
/// the broker does for the floor's orders what it does for the copies. A round runs right after
/// each measured trade, so the two are compared under the same load of the machine. Each order is
/// timed twice: by its reply, and by its `opened` event at an observer watching every floor
/// account, the instrument that times the copies (whose observed time includes the broker's event
/// to the observer and the observer's turn; the reply does not).
struct OrdersFloor {
    clients: Vec<BridgeClient>,
    sessions: Vec<std::sync::Arc<dyn TradeApi>>,
    observer: Observer,
    n: usize,
    rounds: usize,
    /// Every order's time to its reply.
    each: Vec<Duration>,
    /// The last reply's, per round.
    last: Vec<Duration>,
    /// Every order's time to its `opened` event at the observer.
    each_observed: Vec<Duration>,
    /// The last `opened` event's, per round.
    last_observed: Vec<Duration>,
}

/// A floor round's orders carry the copies' marker (`mc<id>`, so their frames are the copies'
/// size) with ids no master ticket reaches.
const FLOOR_MARKER: i64 = 1_000_000_000;

impl OrdersFloor {
    async fn connect(broker: &str, n: usize, connections: usize) -> anyhow::Result<OrdersFloor> {
        let mut clients = Vec::new();
        for c in 0..connections {
            let client = BridgeClient::connect(broker.to_string(), format!("floor{c}"));
            client.wait_ready(Duration::from_secs(10)).await?;
            clients.push(client);
        }
        let logins: Vec<String> = (0..n).map(|i| format!("x{i}")).collect();
        let observer = Observer::new(broker, &logins).await?;
        let mut sessions = Vec::with_capacity(n);
        for (i, login) in logins.iter().enumerate() {
            let session = clients[i % connections]
                .login(&AccountLogin {
                    login: login.clone(),
                    password: None,
                    fence: Some(1),
                    account_id: None,
                })
                .await?;
            sessions.push(session.api);
            // The session's own events, taken as they come (the node's follower task does so);
            // the stream ends with the session.
            let mut events = session.events;
            tokio::spawn(async move { while events.recv().await.is_some() {} });
        }
        Ok(OrdersFloor {
            clients,
            sessions,
            observer,
            n,
            rounds: 0,
            each: Vec::new(),
            last: Vec::new(),
            each_observed: Vec::new(),
            last_observed: Vec::new(),
        })
    }

    /// One round: the time to its last `opened` event at the observer.
    async fn round(&mut self) -> anyhow::Result<Duration> {
        let side = if self.rounds.is_multiple_of(2) {
            Side::Buy
        } else {
            Side::Sell
        };
        let marker = FLOOR_MARKER + self.rounds as i64;
        self.rounds += 1;
        let start = Instant::now();
        let mut sends = tokio::task::JoinSet::new();
        for (i, api) in self.sessions.iter().enumerate() {
            let api = api.clone();
            sends.spawn(async move {
                let fill = api
                    .open(OpenOrder {
                        symbol: "EURUSD".into(),
                        side,
                        volume: 0.1,
                        sl: None,
                        tp: None,
                        magic: 0,
                        comment: format!("mc{marker}"),
                        client_order_id: Some(format!("l{i}-m{marker}-open")),
                        price_limit: None,
                    })
                    .await
                    .context("the floor's order")?;
                Ok::<_, anyhow::Error>((api, fill.ticket, start.elapsed()))
            });
        }
        let mut slowest = Duration::ZERO;
        let mut opened = Vec::with_capacity(self.n);
        while let Some(done) = sends.join_next().await {
            let (api, ticket, took) = done??;
            slowest = slowest.max(took);
            self.each.push(took);
            opened.push((api, ticket));
        }
        self.last.push(slowest);
        let deadline = start + Duration::from_secs(60);
        let mut seen = HashSet::new();
        let mut observed = Duration::ZERO;
        while seen.len() < self.n {
            let (login, t, at) = tokio::time::timeout_at(deadline, self.observer.arrivals.recv())
                .await
                .context("the floor's orders were not all observed")?
                .context("the floor's observer ended")?;
            if t == marker && seen.insert(login) {
                observed = at.saturating_duration_since(start);
                self.each_observed.push(observed);
            }
        }
        self.last_observed.push(observed);
        // Close them again, so the floor accounts' positions stay few (not timed).
        let mut closes = tokio::task::JoinSet::new();
        for (api, ticket) in opened {
            closes.spawn(async move {
                api.close(CloseOrder {
                    ticket,
                    volume: None,
                    client_order_id: None,
                })
                .await
            });
        }
        while let Some(done) = closes.join_next().await {
            done??;
        }
        Ok(observed)
    }

    /// (each reply, last reply, each observed, last observed).
    fn close(self) -> (Stats, Stats, Stats, Stats) {
        drop(self.sessions);
        for c in self.clients {
            c.close();
        }
        (
            Stats::of(&self.each),
            Stats::of(&self.last),
            Stats::of(&self.each_observed),
            Stats::of(&self.last_observed),
        )
    }
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
        "| followers | nodes | N orders at once, replies: each p50 / p99 | the last p50 / max | observed: each p50 / p99 | the last p50 / max | last follower served p50 | ÷ the last observed p50 | ÷ the last reply p50 | per trade, ÷ its own round (observed, p50) | ÷ (the last observed p50 + the master's leg) |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut legs_md = String::from(
        "| followers | nodes | copies | master fill → event committed p50 / p99 | event → follower decided p50 / p99 | decided → broker accepted p50 / p99 |\n|---:|---:|---:|---:|---:|---:|\n",
    );
    // The master's leg (its fill published and announced, up to a follower's decision): one
    // follower's copy less its one order, from the first row.
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
        let mut observer = Observer::new(&setup.broker.addr.to_string(), &logins).await?;
        let trader = BridgeClient::connect(setup.broker.addr.to_string(), "manual");
        trader.wait_ready(Duration::from_secs(10)).await?;
        let mut floor_rounds =
            OrdersFloor::connect(&setup.broker.addr.to_string(), followers, nodes).await?;
        let mut samples = Vec::new();
        let mut last = Vec::new();
        // Per trade: its last follower served over the floor round right after it.
        let mut paired = Vec::new();
        for i in 0..trades {
            let side = if i % 2 == 0 { Side::Buy } else { Side::Sell };
            let request = Request::hand_open("m1", "EURUSD", side, 0.1);
            let reply = trader.call(request).await?;
            let accepted = Instant::now();
            let ticket = reply["ticket"].as_i64().context("ticket")?;
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
        let (floor_each, floor_last, observed_each, observed_last) = floor_rounds.close();
        paired.sort_by(|a, b| a.total_cmp(b));
        let paired_p50 = paired[(paired.len() - 1) / 2];
        println!(
            "orders floor {followers} orders over {nodes} connections: replies each {}, last {}; observed each {}, last {} (copies: last follower {:.2} ms p50, {:.2}x the last observed, {:.2}x the last reply; paired {paired_p50:.2}x)",
            floor_each.show(),
            floor_last.show(),
            observed_each.show(),
            observed_last.show(),
            l.p50_ms,
            l.p50_ms / observed_last.p50_ms,
            l.p50_ms / floor_last.p50_ms
        );
        let with_leg = match master_leg {
            None => {
                master_leg = Some((l.p50_ms - observed_last.p50_ms).max(0.0));
                "(gives the leg)".to_string()
            }
            Some(leg) => format!("{:.1}×", l.p50_ms / (observed_last.p50_ms + leg)),
        };
        let _ = writeln!(
            floor_md,
            "| {followers} | {nodes} | {} | {:.2} / {:.2} ms | {} | {:.2} / {:.2} ms | {:.2} ms | {:.1}× | {:.1}× | {paired_p50:.1}× | {with_leg} |",
            floor_each.show(),
            floor_last.p50_ms,
            floor_last.max_ms,
            observed_each.show(),
            observed_last.p50_ms,
            observed_last.max_ms,
            l.p50_ms,
            l.p50_ms / observed_last.p50_ms,
            l.p50_ms / floor_last.p50_ms
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
            floor_ms: floor,
            legs,
            orders_floor: floor_each,
            orders_floor_last: floor_last,
            orders_floor_observed: observed_each,
            orders_floor_observed_last: observed_last,
            paired_ratio_p50: paired_p50,
        });
        trader.close();
        drop(observer);
        setup.stop().await;
    }
    report.markdown.push(format!(
        "## Copy latency\n\nFrom the master's order accepted at the broker (its reply at the benchmark) to each follower's copy accepted (its `opened` event at the benchmark, which watches every follower's position stream): {trades} master opens per row, every follower's copy a sample. Nodes are `copier-node run` processes; the master and followers spread over them by fair share. Floor, measured in the same run: one NOTIFY delivered to a listener after commit ({:.2} ms) plus one broker round trip ({:.2} ms) = {floor:.2} ms.\n\n{md}\n### Where the time goes\n\nThe same copies' legs from the copy ledger (every copy a sample; each clock at millisecond resolution, so a leg under a millisecond reads 0 or 1): the master's fill at its broker to the event committed by the master's session, the event to the follower's decision (NOTIFY delivery and the follower session's turn), and the decision to the broker's acceptance (the order's round trip, including any wait for the node's broker connection).\n\n{legs_md}\n### The floor for N orders\n\nIn the same run, one round after each measured trade (after the 200 ms that follow it, in which its master position and the copies are closed): as many market orders as the row has followers, sent at once by as many account sessions logged in over as many bridge connections to the same broker as the row has nodes (each node has one per server), with no copier in the way, {trades} rounds. A floor session is what a node's follower session is to the broker: logged in with a fence, its orders carrying the fence and a client order id, its own position events coming back to it (taken by a task of its own). Each order is timed twice: by its reply, and by its `opened` event at an observer watching every floor account, the instrument that times the copies (the event leaves the broker after the reply and waits for the observer's turn, so the observed floor is the like-for-like one). The floor's accounts are watched as the followers are, so the broker sends the same events in both. Runs before 2026-12-02 watched the followers only and timed the floor by its replies; runs before the second of 2026-12-02 sent the floor's orders as bare requests (no session, no client order id), so the broker sent each of their fills to the observer alone where it sends each copy's to the observer and the follower's session. The last follower served divided by the last order observed says how far the copies are from what the broker connections allow; the paired column divides each trade's last follower served by the round after it (the machine as that trade found it, its last order observed), and takes the median. That floor leaves out the master's leg, which no copy can skip: the master's fill reaching its session, published and announced to the followers' node. The last column adds it, measured in the same run as the one-follower row's copy less its one order observed ({:.2} ms).\n\n{floor_md}",
        report.floors["notify_delivery"].p50_ms,
        report.floors["broker_round_trip"].p50_ms,
        master_leg.unwrap_or(f64::NAN)
    ));
    Ok(())
}
