//! Events per database: master events published through the node's statement, one commit per
//! event (as every master published before) or in batches (the node's `MasterPublisher`), beside
//! a bare autocommit `pg_notify` in the same run.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::stats::Stats;
use crate::{Options, Pg, Report};
use copier_node::copier::MasterPosition;
use copier_node::copier::events::MasterEvent;
use copier_node::db::Db;
use copier_node::db::copy::{MasterPublisher, PublishWrite, Published};
use serde::Serialize;
use sqlx::postgres::{PgListener, PgPoolOptions};
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

#[derive(Serialize)]
pub(crate) struct EventsRow {
    path: String,
    masters: usize,
    nodes: usize,
    /// The rate the masters were paced to (none: each as fast as its outcomes come back).
    offered_per_second: Option<f64>,
    events_per_second: f64,
    /// From the publish call to its outcome at the master's task.
    publish: Stats,
    /// From the publish call to the NOTIFY's arrival at a listening connection.
    delivery: Stats,
}

/// How the masters' events reach the database.
#[derive(Clone, Copy, PartialEq)]
enum Path {
    /// A bare `pg_notify` per event, autocommit: the ceiling of one commit per event.
    BareNotify,
    /// The node's publish statement, one statement and commit per event.
    PerEvent,
    /// The node's publisher: the events queued at once in one statement and commit.
    Batched,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::BareNotify => "bare pg_notify, a commit per event (floor)",
            Path::PerEvent => "publish statement, a commit per event",
            Path::Batched => "publish statement, batched per node",
        }
    }
}

pub(crate) async fn events(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let url = pg.database("bench_events").await?;
    let window = if options.smoke {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(3)
    };
    let most = if options.smoke { 100 } else { 1000 };
    {
        let mut c = PgConnection::connect(&url).await?;
        for n in 1..=4 {
            sqlx::query(
                "INSERT INTO nodes (node_id, instance_id, platform, capacity, lease_until, started_at,
                                    renewed_at, trust_until, owned)
                 VALUES ('n' || $1, 'n' || $1 || '-1', 'mt5', 100000, now() + interval '1 hour',
                         now(), now(), now() + interval '1 hour', 0)",
            )
            .bind(n)
            .execute(&mut c)
            .await?;
        }
        // Master g on node n((g - 1) % 4 + 1) at epoch 1.
        sqlx::query(
            "INSERT INTO trading_accounts (id, platform, role, server, login, node_id, owner_epoch, lease_until)
             SELECT g, 'mt5', 'master', 'h:1', 'm' || g, 'n' || ((g - 1) % 4 + 1), 1,
                    now() + interval '1 hour'
               FROM generate_series(1, $1) g",
        )
        .bind(most as i64)
        .execute(&mut c)
        .await?;
    }
    let mut runs: Vec<(Path, usize, usize, Option<f64>)> = vec![
        (Path::BareNotify, 1, 1, None),
        (Path::BareNotify, 4, 4, None),
    ];
    for (masters, nodes) in [(100, 1), (most, 1), (most, 4)] {
        runs.push((Path::PerEvent, masters, nodes, None));
        runs.push((Path::Batched, masters, nodes, None));
    }
    // The same masters paced: at the rate one commit per event reached before, and at four
    // times it (which only batches carry).
    let paced = if options.smoke { 500.0 } else { 5000.0 };
    runs.push((Path::PerEvent, most, 1, Some(paced)));
    runs.push((Path::Batched, most, 1, Some(paced)));
    runs.push((Path::Batched, most, 1, Some(4.0 * paced)));
    let mut md = String::from(
        "| path | masters | nodes | offered events/s | events/s | ÷ bare pg_notify, one publisher | publish p50 / p99 | delivered p50 / p99 |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let mut floor = f64::NAN;
    let mut seqs: HashMap<i64, i64> = HashMap::new();
    for (path, masters, nodes, offered) in runs {
        let row = run(&url, (path, masters, nodes, offered), window, &mut seqs).await?;
        if path == Path::BareNotify && nodes == 1 {
            floor = row.events_per_second;
        }
        println!(
            "events: {} with {masters} masters on {nodes} nodes, offered {offered:?}/s: {:.0}/s, publish {}, delivered {}",
            path.name(),
            row.events_per_second,
            row.publish.show(),
            row.delivery.show()
        );
        let what = if path == Path::BareNotify {
            format!(
                "| {} | – | {masters} connection{} |",
                path.name(),
                if masters == 1 { "" } else { "s" }
            )
        } else {
            format!("| {} | {masters} | {nodes} |", path.name())
        };
        let offered = offered.map_or("as fast as they go".to_string(), |r| format!("{r:.0}"));
        let _ = writeln!(
            md,
            "{what} {offered} | {:.0} | {:.1}× | {:.2} / {:.2} ms | {:.2} / {:.2} ms |",
            row.events_per_second,
            row.events_per_second / floor,
            row.publish.p50_ms,
            row.publish.p99_ms,
            row.delivery.p50_ms,
            row.delivery.p99_ms
        );
        report.events.push(row);
    }
    report.markdown.push(format!(
        "## Events per database\n\nMaster events as the node publishes them (the fenced statement: snapshot, (epoch, seq) and NOTIFY; one open position per snapshot), every master publishing its next event as soon as its last one's outcome is back (or paced: the masters' events spread evenly at the offered rate), for {}s: one statement and commit per event (how every master published before), or through the node's publisher, which sends the events its masters queued meanwhile in one statement and one commit (the benchmark gives each node a pool of 8 connections with the server's default plan caching, shared by both paths; a node's publisher has one connection of its own with generic plans). PostgreSQL serialises commits that carry a NOTIFY, so one commit per event caps the events a database announces a second; beside them, in the same run, that cap: a bare autocommit `pg_notify` per event from 1 and 4 connections. Publish: from the call to its outcome at the master's task; delivered: from the call to the NOTIFY's arrival at a listening connection (the event leg of a copy at that rate; ten masters sampled).\n\n{md}",
        window.as_secs_f64()
    ));
    Ok(())
}

/// The samples one run collects.
#[derive(Default)]
struct Samples {
    published: Vec<Duration>,
    /// When each sampled master's (master, seq) publish was called.
    started: HashMap<(i64, i64), Instant>,
    delivered: Vec<Duration>,
}

async fn run(
    url: &str,
    (path, masters, nodes, offered): (Path, usize, usize, Option<f64>),
    window: Duration,
    seqs: &mut HashMap<i64, i64>,
) -> anyhow::Result<EventsRow> {
    let samples = Arc::new(Mutex::new(Samples::default()));
    // The sampled masters: ten, spread over the nodes.
    let mut sampled: Vec<i64> = (1..=10).map(|k| (k * masters / 10).max(1) as i64).collect();
    sampled.dedup();
    let mut listener = PgListener::connect(url).await?;
    let channel = |m: i64| {
        if path == Path::BareNotify {
            "bench_events".to_string()
        } else {
            copier_node::channels::master(m)
        }
    };
    for &m in &sampled {
        listener.listen(&channel(m)).await?;
    }
    let end = Instant::now() + window;
    let listening = {
        let samples = samples.clone();
        tokio::spawn(async move {
            while let Ok(Ok(n)) =
                tokio::time::timeout_at(end + Duration::from_secs(1), listener.recv()).await
            {
                let at = Instant::now();
                let key = if path == Path::BareNotify {
                    n.payload()
                        .split_once(' ')
                        .and_then(|(m, s)| Some((m.parse().ok()?, s.parse().ok()?)))
                } else {
                    serde_json::from_str::<serde_json::Value>(n.payload())
                        .ok()
                        .and_then(|v| Some((v["master"].as_i64()?, v["seq"].as_i64()?)))
                };
                let mut s = samples.lock().unwrap();
                if let Some(started) = key.and_then(|k| s.started.remove(&k)) {
                    s.delivered.push(at - started);
                }
            }
        })
    };
    let mut tasks = Vec::new();
    for node in 0..nodes {
        let pool = PgPoolOptions::new()
            .max_connections(if path == Path::BareNotify { 1 } else { 8 })
            .connect(url)
            .await?;
        let db = Db::direct(pool);
        let publisher = MasterPublisher::spawn(db.clone());
        // The masters of this node: every nodes-th, as the accounts were spread.
        for m in (1..=masters as i64).filter(|m| ((m - 1) as usize % 4) % nodes == node) {
            let (db, publisher, samples) = (db.clone(), publisher.clone(), samples.clone());
            let owner = format!("n{}", (m - 1) % 4 + 1);
            let sample = sampled.contains(&m);
            let mut seq = seqs.get(&m).copied().unwrap_or(0);
            tasks.push(tokio::spawn(async move {
                let position = MasterPosition {
                    ticket: 1,
                    symbol: "EURUSD".into(),
                    side: copier_node::broker::types::Side::Buy,
                    volume: 0.1,
                    open_volume: 0.1,
                    open_price: 1.1,
                    sl: None,
                    tp: None,
                    magic: 0,
                    first_seen_ms: None,
                    first_seen_us: None,
                    open_time_ms: None,
                    contract_size: None,
                    broker_ticket: None,
                };
                let event = MasterEvent::Open {
                    position: position.clone(),
                };
                let positions = [position];
                let mut n = 0u64;
                // Paced: one event a period, the masters' phases spread over it.
                let period = offered.map(|r| Duration::from_secs_f64(masters as f64 / r));
                let mut next = Instant::now()
                    + period.map_or(Duration::ZERO, |p| p.mul_f64(m as f64 / masters as f64));
                while Instant::now() < end {
                    if let Some(period) = period {
                        tokio::time::sleep_until(next).await;
                        next = (next + period).max(Instant::now());
                        if Instant::now() >= end {
                            break;
                        }
                    }
                    seq += 1;
                    let start = Instant::now();
                    if sample {
                        samples.lock().unwrap().started.insert((m, seq), start);
                    }
                    let write = PublishWrite::new(&owner, m, (1, seq), (&positions, &[]), &event);
                    let outcome = match path {
                        Path::BareNotify => db
                            .run(async |c| {
                                sqlx::query("SELECT pg_notify('bench_events', $1)")
                                    .bind(format!("{m} {seq}"))
                                    .execute(&mut *c)
                                    .await
                                    .map(|_| Published::Refused)
                            })
                            .await
                            .map_err(|e| e.to_string())?,
                        Path::PerEvent => db
                            .run(async |c| {
                                copier_node::db::copy::publish_many(c, std::slice::from_ref(&write))
                                    .await
                            })
                            .await
                            .map_err(|e| e.to_string())?
                            .pop()
                            .unwrap_or(Published::Refused),
                        Path::Batched => publisher.write(write).await?,
                    };
                    if path != Path::BareNotify && outcome == Published::Refused {
                        return Err(format!("master {m}'s event {seq} was refused"));
                    }
                    samples.lock().unwrap().published.push(start.elapsed());
                    n += 1;
                }
                Ok::<_, String>((m, seq, n))
            }));
        }
    }
    let mut total = 0;
    for t in tasks {
        let (m, seq, n) = t.await?.map_err(|e| anyhow::anyhow!(e))?;
        if path != Path::BareNotify {
            seqs.insert(m, seq);
        }
        total += n;
    }
    listening.await?;
    let s = samples.lock().unwrap();
    Ok(EventsRow {
        path: path.name().to_string(),
        masters,
        nodes,
        offered_per_second: offered,
        events_per_second: total as f64 / window.as_secs_f64(),
        publish: Stats::of(&s.published),
        delivery: Stats::of(&s.delivered),
    })
}
