//! Many live accounts on one machine: time until steady, logins per account, live copies, failed
//! lease cycles and warnings per node; and for the hand-off row, a SIGTERM and a `kill -9` of the
//! node holding the most accounts, until every account is owned again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::{Observer, Setup};
use crate::stats::Stats;
use crate::trades::{between, opens_by_ticket, send_signal};
use crate::{Options, Pg, Report};
use anyhow::Context;
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::Side;
use copier_node::sim_broker::journal::JournalEntry;
use serde::Serialize;
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

/// One scale run.
#[derive(Clone, Serialize)]
pub(crate) struct ScaleRow {
    pub(crate) name: String,
    pub(crate) accounts: usize,
    pub(crate) nodes: usize,
    pub(crate) capacity: usize,
    /// Lease, fence and cycle, as given to every node.
    pub(crate) timing: String,
    /// From the first node's start until every account is owned and every follower has
    /// reconciled (`None`: not within the bound).
    pub(crate) until_steady_s: Option<f64>,
    /// What was reached at the bound, when not steady: (owned, ready).
    pub(crate) reached: (i64, i64),
    /// The nodes' accepted logins in the broker's journal over the accounts.
    pub(crate) logins_per_account: f64,
    /// Live master trades placed from 30 s after the start, each copied by its followers.
    pub(crate) trades: usize,
    /// By the broker's journal: the master's fill to the last of its followers' copies.
    pub(crate) last_follower: Stats,
    /// Trades not copied to every follower within 30 s.
    pub(crate) trades_missed: usize,
    /// `lease cycle failed` lines, over every node's log, after the start was steady.
    pub(crate) cycles_failed_after_steady: usize,
    /// `deadlock detected` anywhere in the nodes' logs.
    pub(crate) deadlocks: usize,
    /// WARN lines per node: the most and the total.
    pub(crate) warnings_max_per_node: usize,
    pub(crate) warnings_total: usize,
    /// The three most frequent warnings, with their counts.
    pub(crate) top_warnings: Vec<(String, usize)>,
    /// SIGTERM of the node holding the most accounts: until every account is owned again.
    pub(crate) sigterm: Option<Fault>,
    /// Then `kill -9` of the node holding the most: until every account is owned again.
    pub(crate) kill: Option<Fault>,
}

/// A node stopped or killed in a scale run.
#[derive(Clone, Serialize)]
pub(crate) struct Fault {
    /// Accounts the node held.
    pub(crate) held: i64,
    /// From the signal until every account is owned by a live node again (`None`: not within
    /// the bound).
    pub(crate) until_owned_s: Option<f64>,
    /// Of the node's accounts, those another node claimed only after their lease ran out (the
    /// owner neither released nor renewed them): none on a SIGTERM within the grace.
    pub(crate) left_to_the_lease: i64,
    /// Live master trades placed from the signal until every account was owned again, one a
    /// second on masters spread over the accounts.
    pub(crate) trades: usize,
    /// By the broker's journal: each of those trades' master fill to the last of its followers'
    /// copies.
    pub(crate) last_follower: Stats,
    /// Of those trades, the ones not copied to every follower within 30 s of the last.
    pub(crate) trades_missed: usize,
}

/// A scale run's shape.
#[derive(Clone)]
struct Shape {
    name: String,
    masters: usize,
    followers_per_master: usize,
    nodes: usize,
    capacity: usize,
    timing: [&'static str; 6],
    /// The cycle of `timing`: the start is steady once no account has been claimed for two.
    cycle: Duration,
    /// The live trades start this long after the start (30 s; the smoke's sooner).
    live_after: Duration,
    faults: bool,
}

const STEADY_WITHIN: Duration = Duration::from_secs(300);
const COPIED_WITHIN: Duration = Duration::from_secs(30);

pub(crate) async fn scale(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let shapes: Vec<Shape> = if options.smoke {
        vec![Shape {
            name: "smoke".into(),
            masters: 4,
            followers_per_master: 10,
            nodes: 3,
            capacity: 100_000,
            timing: ["--lease", "3s", "--fence", "1s", "--cycle", "500ms"],
            cycle: Duration::from_millis(500),
            live_after: Duration::from_secs(1),
            faults: true,
        }]
    } else {
        vec![
            Shape {
                name: "20,000 over 4 nodes, SIGTERM and kill -9".into(),
                masters: 200,
                followers_per_master: 100,
                nodes: 4,
                capacity: 100_000,
                timing: ["--lease", "20s", "--fence", "5s", "--cycle", "2s"],
                cycle: Duration::from_secs(2),
                live_after: Duration::from_secs(30),
                faults: true,
            },
            Shape {
                name: "100,000 over 10 nodes, default timing".into(),
                masters: 1000,
                followers_per_master: 100,
                nodes: 10,
                capacity: 12_000,
                timing: ["--lease", "60s", "--fence", "15s", "--cycle", "20s"],
                cycle: Duration::from_secs(20),
                live_after: Duration::from_secs(30),
                faults: false,
            },
            Shape {
                name: "100,000 over 10 nodes, short lease".into(),
                masters: 1000,
                followers_per_master: 100,
                nodes: 10,
                capacity: 12_000,
                timing: ["--lease", "20s", "--fence", "5s", "--cycle", "2s"],
                cycle: Duration::from_secs(2),
                live_after: Duration::from_secs(30),
                faults: false,
            },
        ]
    };
    let trades = if options.smoke { 3 } else { 10 };
    let mut md = String::from(
        "| run | accounts | nodes (capacity) | lease / fence / cycle | until steady | logins per account | last of 100 followers p50 / p99 (trades, missed) | lease cycles failed after steady | deadlocks | warnings per node: most / total | most frequent warnings |\n|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|\n",
    );
    let mut faults_md = String::from(
        "| run | fault | accounts the node held | until every account owned again | left to their lease | last of 100 followers meanwhile p50 / p99 (trades, missed) |\n|---|---|---:|---:|---:|---:|\n",
    );
    for (i, shape) in shapes.iter().enumerate() {
        if options.scale_rows.as_ref().is_some_and(|r| !r.contains(&i)) {
            continue;
        }
        // A run that fails is reported as such, and the next runs: at these sizes a failure is a
        // finding, not a broken harness (the smoke, small, still fails the benchmark).
        let row = match run(pg, shape, trades, &format!("bench_scale_{i}")).await {
            Ok(row) => row,
            Err(e) if !options.smoke => {
                println!("scale {}: failed: {e:#}", shape.name);
                let _ = writeln!(
                    md,
                    "| {} | {} | {} ({}) | {} / {} / {} | failed: {} | | | | | | |",
                    shape.name,
                    shape.masters * (shape.followers_per_master + 1),
                    shape.nodes,
                    shape.capacity,
                    shape.timing[1],
                    shape.timing[3],
                    shape.timing[5],
                    format!("{e:#}").replace('|', "/")
                );
                continue;
            }
            Err(e) => return Err(e),
        };
        let line = summary(&row);
        println!("scale: {line}");
        let _ = writeln!(md, "{line}");
        for (fault, f) in [("SIGTERM", &row.sigterm), ("kill -9", &row.kill)] {
            if let Some(f) = f {
                println!(
                    "scale {}: {fault} of a node holding {}: every account owned again after {:?} s, {} left to their lease, last follower meanwhile {} ({} trades, {} missed)",
                    row.name,
                    f.held,
                    f.until_owned_s,
                    f.left_to_the_lease,
                    f.last_follower.show(),
                    f.trades,
                    f.trades_missed
                );
                let _ = writeln!(
                    faults_md,
                    "| {} | {fault} | {} | {} | {} | {} ({}, {}) |",
                    row.name,
                    f.held,
                    f.until_owned_s
                        .map_or("not within 120 s".to_string(), |s| format!("{s:.1} s")),
                    f.left_to_the_lease,
                    f.last_follower.show(),
                    f.trades,
                    f.trades_missed
                );
            }
        }
        report.scale.push(row);
    }
    let searched = if options.smoke
        || options
            .scale_rows
            .as_ref()
            .is_some_and(|r| !r.contains(&SEARCH_ROW))
    {
        String::new()
    } else {
        let search = largest(
            pg,
            &shapes[SEARCH_FROM],
            report
                .scale
                .iter()
                .find(|r| r.name == shapes[SEARCH_FROM].name),
            trades,
        )
        .await;
        let md = search.markdown();
        report.scale_search = Some(search);
        md
    };
    report.markdown.push(format!(
        "## Many accounts on one machine\n\nMasters of 100 followers each (the default link), every account with a live session on the simulated broker in its own process, its protections off (`--no-fence-check --no-dedupe`, as real MT4/MT5 servers); node processes of the given capacity and timing, all started at once. Until steady: from the start until every account is owned and every follower has reconciled, and fair share has stopped moving them (the later of the last claim and the moment everything was owned and ready, once no account has been claimed for two cycles; bounded at {} s: beyond it, what was owned and ready then). Logins per account: the nodes' accepted logins in the broker's journal over the accounts, before any fault (1.0 when no session started twice; an account moved by fair share at the start logs in again). Then, from 30 s after the start, {trades} live master trades, one after the other on masters spread over the accounts, each timed by the broker's journal from the master's fill to the last of its 100 followers' copies (missed: not every copy within {} s). Failed lease cycles are the nodes' `lease cycle failed` lines after the start was steady; warnings are every WARN line of every node's log over the whole run. The machine is the one of every section: PostgreSQL, the broker, every node and the benchmark share its cores.\n\n{md}\nThe hand-off row then stops (SIGTERM) the node holding the most accounts and, once every account is owned again, kills (`kill -9`) the node then holding the most: the time from the signal until every account is owned by a live node again (bounded at 120 s), and how many of the node's accounts another node claimed only after their lease ran out (not released by their owner); meanwhile, from the signal until every account is owned again, a live master trade a second on masters spread over the accounts (about a quarter of each master's followers on the stopped node), each timed by the journal to the last of its 100 followers' copies (missed: not every copy within {} s of the last trade).\n\n{faults_md}{searched}",
        STEADY_WITHIN.as_secs(),
        COPIED_WITHIN.as_secs(),
        COPIED_WITHIN.as_secs()
    ));
    Ok(())
}

/// A row's line of the section's table.
fn summary(row: &ScaleRow) -> String {
    let copied = last_follower(row);
    let top: Vec<String> = row
        .top_warnings
        .iter()
        .map(|(w, n)| format!("`{w}` ({n})"))
        .collect();
    format!(
        "| {} | {} | {} ({}) | {} | {} | {:.3} | {} ({}, {}) | {} | {} | {} / {} | {} |",
        row.name,
        row.accounts,
        row.nodes,
        row.capacity,
        row.timing,
        seconds(row.until_steady_s, row.reached, row.accounts),
        row.logins_per_account,
        copied,
        row.trades,
        row.trades_missed,
        row.cycles_failed_after_steady,
        row.deadlocks,
        row.warnings_max_per_node,
        row.warnings_total,
        if top.is_empty() {
            "none".to_string()
        } else {
            top.join(", ")
        }
    )
}

/// The last of the followers' copies, p50 / p99, or that none was copied.
fn last_follower(row: &ScaleRow) -> String {
    if row.last_follower.runs == 0 {
        "none copied".to_string()
    } else {
        row.last_follower.show()
    }
}

/// `--scale-rows` index of the search for the largest count served with every goal met.
const SEARCH_ROW: usize = 3;
/// The shape the search varies (its count of masters): 10 nodes at the default timing.
const SEARCH_FROM: usize = 1;
/// The goals of a steady machine (issue 45): logins per account at most this...
const GOAL_LOGINS: f64 = 1.05;
/// ... and the last of 100 followers' copies of live trades within this, at the p99.
const GOAL_P99_MS: f64 = 50.0;
/// The search stops once the count met and the count missed are this many masters apart (or
/// after [`SEARCH_PROBES`] runs).
const SEARCH_STEP: usize = 125;
const SEARCH_PROBES: usize = 3;

/// The search for the largest count this machine serves steadily.
#[derive(Serialize)]
pub(crate) struct Search {
    /// The goals, as the report states them.
    pub(crate) goals: String,
    /// Every run of the search (the section's own row of that shape first, when it ran).
    pub(crate) probes: Vec<ScaleRow>,
    /// Whether each probe met every goal, and if not which it missed.
    pub(crate) missed: Vec<Vec<String>>,
    /// The largest count that met every goal (`None`: none did).
    pub(crate) largest_met: Option<usize>,
    /// The smallest count that missed one (`None`: none did).
    pub(crate) smallest_missed: Option<usize>,
}

/// Which goals a run missed (none: it met them all).
fn goals_missed(row: &ScaleRow) -> Vec<String> {
    let mut missed = Vec::new();
    if row.until_steady_s.is_none() {
        missed.push(format!("not steady within {} s", STEADY_WITHIN.as_secs()));
    }
    if row.logins_per_account > GOAL_LOGINS {
        missed.push(format!("{:.3} logins per account", row.logins_per_account));
    }
    if row.cycles_failed_after_steady > 0 {
        missed.push(format!(
            "{} lease cycles failed",
            row.cycles_failed_after_steady
        ));
    }
    if row.deadlocks > 0 {
        missed.push(format!("{} deadlocks", row.deadlocks));
    }
    if row.trades_missed > 0 || row.last_follower.runs == 0 {
        missed.push(format!(
            "{} trades not copied to every follower",
            row.trades_missed.max(1)
        ));
    } else if row.last_follower.p99_ms > GOAL_P99_MS {
        missed.push(format!("p99 {:.1} ms", row.last_follower.p99_ms));
    }
    missed
}

/// Bisects the count of masters of `shape` (100 followers each) between what met the goals and
/// what missed them, from the shape's own count (its row of this run when given): at most
/// [`SEARCH_PROBES`] more runs, down to [`SEARCH_STEP`] masters apart. A count that met them at
/// the shape's own size is tried once larger, up to the nodes' capacity.
async fn largest(pg: &Pg, shape: &Shape, first: Option<&ScaleRow>, trades: usize) -> Search {
    let per_master = shape.followers_per_master + 1;
    let mut probes: Vec<(usize, ScaleRow)> = Vec::new();
    let mut met: Option<usize> = None;
    let mut missed: Option<usize> = None;
    let mut next = Some(shape.masters);
    let mut runs = 0;
    while let Some(masters) = next {
        let row = match first.filter(|r| r.accounts == masters * per_master) {
            Some(row) => Ok(row.clone()),
            None if runs == SEARCH_PROBES => break,
            None => {
                runs += 1;
                let probe = Shape {
                    name: format!("search: {} accounts", masters * per_master),
                    masters,
                    ..shape.clone()
                };
                run(pg, &probe, trades, &format!("bench_scale_search_{masters}")).await
            }
        };
        let ok = match &row {
            Ok(row) => goals_missed(row).is_empty(),
            Err(_) => false,
        };
        match row {
            Ok(row) => {
                println!(
                    "scale search: {} {}",
                    summary(&row),
                    if ok { "met" } else { "missed" }
                );
                probes.push((masters, row));
            }
            Err(e) => println!("scale search: {masters} masters failed: {e:#}"),
        }
        if ok {
            met = met.max(Some(masters));
        } else {
            missed = Some(missed.map_or(masters, |m| m.min(masters)));
        }
        let lo = met.unwrap_or(0);
        next = match missed {
            // Nothing missed yet: once larger, within the nodes' capacity.
            None => {
                let larger = masters + masters * 3 / 20;
                (masters == shape.masters && larger * per_master <= shape.nodes * shape.capacity)
                    .then_some(larger)
            }
            Some(hi) if hi - lo <= SEARCH_STEP => None,
            Some(hi) => Some((lo + hi) / 2),
        };
    }
    probes.sort_by_key(|(m, _)| *m);
    let missed_goals = probes.iter().map(|(_, r)| goals_missed(r)).collect();
    Search {
        goals: format!(
            "steady within {} s, at most {GOAL_LOGINS} logins per account, no lease cycle failed after the start was steady, no deadlock, every live trade copied to its 100 followers with the last copy within {GOAL_P99_MS} ms at the p99",
            STEADY_WITHIN.as_secs()
        ),
        probes: probes.into_iter().map(|(_, r)| r).collect(),
        missed: missed_goals,
        largest_met: met.map(|m| m * per_master),
        smallest_missed: missed.map(|m| m * per_master),
    }
}

impl Search {
    fn markdown(&self) -> String {
        let mut md = format!(
            "\n### The largest count served steadily\n\nThe default-timing row's shape (10 nodes), its count of masters bisected between a count that met every goal and one that missed one, in {} more runs at most: the goals are {}.\n\n| accounts | until steady | logins per account | last of 100 followers p50 / p99 (trades, missed) | lease cycles failed after steady | goals |\n|---:|---:|---:|---:|---:|---|\n",
            SEARCH_PROBES, self.goals
        );
        for (row, missed) in self.probes.iter().zip(&self.missed) {
            let _ = writeln!(
                md,
                "| {} | {} | {:.3} | {} ({}, {}) | {} | {} |",
                row.accounts,
                seconds(row.until_steady_s, row.reached, row.accounts),
                row.logins_per_account,
                last_follower(row),
                row.trades,
                row.trades_missed,
                row.cycles_failed_after_steady,
                if missed.is_empty() {
                    "met".to_string()
                } else {
                    format!("missed: {}", missed.join(", "))
                }
            );
        }
        let _ = writeln!(
            md,
            "\n{}",
            match (self.largest_met, self.smallest_missed) {
                (Some(met), Some(missed)) => format!(
                    "Largest count served with every goal met in this run: {met} accounts ({missed} missed one)."
                ),
                (Some(met), None) => format!(
                    "Every count tried met every goal, up to {met} accounts (the largest tried)."
                ),
                (None, Some(missed)) =>
                    format!("No count tried met every goal, down to {missed} accounts."),
                (None, None) => "No run of the search finished.".to_string(),
            }
        );
        md
    }
}

/// "12.3 s", or what was reached when not steady.
fn seconds(s: Option<f64>, (owned, ready): (i64, i64), accounts: usize) -> String {
    s.map_or_else(
        || {
            format!(
                "not within {} s ({owned} of {accounts} owned, {ready} ready)",
                STEADY_WITHIN.as_secs()
            )
        },
        |s| format!("{s:.1} s"),
    )
}

async fn run(pg: &Pg, shape: &Shape, trades: usize, db: &str) -> anyhow::Result<ScaleRow> {
    let mut setup = Setup::with_broker(
        pg,
        db,
        shape.masters,
        shape.followers_per_master,
        &["--no-fence-check", "--no-dedupe"],
    )
    .await?;
    let accounts = shape.masters * (shape.followers_per_master + 1);
    let mut conn = PgConnection::connect(&setup.url).await?;
    let start = Instant::now();
    let start_db: f64 = sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
        .fetch_one(&mut conn)
        .await?;
    let mut pids = HashMap::new();
    for n in 0..shape.nodes {
        let id = format!("s{n}");
        let pid = setup.spawn_node_with(&id, shape.capacity, shape.timing)?;
        pids.insert(id, pid);
    }
    // Steady: every account owned, every master published and every follower reconciled, and
    // no account claimed for two cycles (fair share done moving them). The time is the later of
    // the last claim (the database's clock) and the start of the streak in which everything was
    // owned and ready.
    let mut streak: Option<f64> = None;
    let (until_steady_s, reached) = loop {
        let (owned, ready, last_claim, quiet): (i64, i64, Option<f64>, Option<f64>) =
            sqlx::query_as(
                "SELECT count(*) FILTER (WHERE node_id IS NOT NULL AND lease_until >= now()), \
                        count(*) FILTER (WHERE role = 'master' OR status LIKE 'follower: master%'), \
                        extract(epoch FROM max(claimed_at))::float8 - $1, \
                        extract(epoch FROM clock_timestamp() - max(claimed_at))::float8 \
                   FROM trading_accounts",
            )
            .bind(start_db)
            .fetch_one(&mut conn)
            .await?;
        let all = owned as usize == accounts && ready as usize == accounts;
        streak = if all {
            streak.or(Some(start.elapsed().as_secs_f64()))
        } else {
            None
        };
        if let Some(since) = streak
            && quiet.unwrap_or(0.0) >= 2.0 * shape.cycle.as_secs_f64()
        {
            break (Some(since.max(last_claim.unwrap_or(0.0))), (owned, ready));
        }
        if start.elapsed() > STEADY_WITHIN {
            break (None, (owned, ready));
        }
        tokio::time::sleep(Duration::from_millis(500)).await; // polling the database's count
    };
    let failed_before: usize = logs(&setup, &pids)
        .iter()
        .map(|l| count(l, "lease cycle failed"))
        .sum();
    // Live trades from 30 s after the start, on masters spread over the accounts.
    tokio::time::sleep_until(start + shape.live_after).await;
    let masters: Vec<usize> = (0..trades)
        .map(|t| 1 + t * shape.masters / trades)
        .collect();
    let watched: Vec<String> = masters
        .iter()
        .flat_map(|m| {
            (0..shape.followers_per_master).map(move |k| format!("f{}", k * shape.masters + m))
        })
        .collect();
    let mut observer = Observer::new(&setup.broker.addr, &watched).await?;
    let trader = BridgeClient::connect(setup.broker.addr.clone(), "manual");
    trader.wait_ready(Duration::from_secs(10)).await?;
    let mut placed = Vec::with_capacity(trades);
    let mut missed = 0;
    for (t, m) in masters.iter().enumerate() {
        let login = format!("m{m}");
        let side = if t % 2 == 0 { Side::Buy } else { Side::Sell };
        let ticket = trader
            .call(Request::hand_open(&login, "EURUSD", side, 0.1))
            .await?["ticket"]
            .as_i64()
            .context("ticket")?;
        placed.push((login, ticket));
        // Its copies, at the observer (the journal times them afterwards).
        let deadline = Instant::now() + COPIED_WITHIN;
        let mut seen = HashSet::new();
        while seen.len() < shape.followers_per_master {
            match tokio::time::timeout_at(deadline, observer.arrivals.recv()).await {
                Ok(Some((login, copied, _))) if copied == ticket => {
                    seen.insert(login);
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => {
                    missed += 1;
                    break;
                }
            }
        }
    }
    drop(observer);
    // Logins before any fault: the start's, and any session that started twice since.
    let logins = copier_node::sim_broker::journal::read(&setup.dir.join("journal.jsonl"))?
        .iter()
        .filter(|l| l.action == "login" && l.accepted && pids.contains_key(&l.client))
        .count();
    let (sigterm, kill) = if shape.faults {
        let live = Live {
            trader: &trader,
            journal: setup.dir.join("journal.jsonl"),
            masters: shape.masters,
            followers: shape.followers_per_master,
        };
        let sigterm = fault(&mut conn, &pids, "TERM", accounts, &live).await?;
        let kill = fault(&mut conn, &pids, "KILL", accounts, &live).await?;
        (Some(sigterm), Some(kill))
    } else {
        (None, None)
    };
    trader.close();
    conn.close().await?;
    let journal = copier_node::sim_broker::journal::read(&setup.dir.join("journal.jsonl"))?;
    let last = last_copies(&journal, &placed, shape.followers_per_master);
    let logs = logs(&setup, &pids);
    let failed_after: usize = logs
        .iter()
        .map(|l| count(l, "lease cycle failed"))
        .sum::<usize>()
        .saturating_sub(failed_before);
    let warnings: Vec<usize> = logs.iter().map(|l| count(l, " WARN ")).collect();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for line in logs.iter().flat_map(|l| l.lines()) {
        if let Some(rest) = line.split_once(" WARN ").map(|(_, r)| r) {
            // The message: the words before the first `key=value` field.
            let message: Vec<&str> = rest
                .split_whitespace()
                .take_while(|w| !w.contains('='))
                .collect();
            *kinds.entry(message.join(" ")).or_default() += 1;
        }
    }
    let mut top: Vec<(String, usize)> = kinds.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(3);
    let row = ScaleRow {
        name: shape.name.to_string(),
        accounts,
        nodes: shape.nodes,
        capacity: shape.capacity,
        timing: format!(
            "{} / {} / {}",
            shape.timing[1], shape.timing[3], shape.timing[5]
        ),
        until_steady_s,
        reached,
        logins_per_account: logins as f64 / accounts as f64,
        trades,
        last_follower: Stats::of(&last),
        trades_missed: missed,
        cycles_failed_after_steady: failed_after,
        deadlocks: logs.iter().map(|l| count(l, "deadlock detected")).sum(),
        warnings_max_per_node: warnings.iter().copied().max().unwrap_or(0),
        warnings_total: warnings.iter().sum(),
        top_warnings: top,
        sigterm,
        kill,
    };
    setup.stop().await;
    Ok(row)
}

/// Every node's log so far.
fn logs(setup: &Setup, pids: &HashMap<String, u32>) -> Vec<String> {
    pids.keys()
        .map(|id| std::fs::read_to_string(setup.dir.join(format!("{id}.log"))).unwrap_or_default())
        .collect()
}

fn count(text: &str, what: &str) -> usize {
    text.matches(what).count()
}

/// Per trade copied to all `followers`: the master's fill to its last copy, by the journal.
fn last_copies(
    journal: &[JournalEntry],
    placed: &[(String, i64)],
    followers: usize,
) -> Vec<Duration> {
    let fills: HashMap<(&str, i64), i64> = journal
        .iter()
        .filter(|l| l.action == "open" && l.accepted)
        .filter_map(|l| Some(((l.login.as_str(), l.ticket?), l.ts_us?)))
        .collect();
    let copies = opens_by_ticket(journal);
    placed
        .iter()
        .filter_map(|(login, ticket)| {
            let fill = *fills.get(&(login.as_str(), *ticket))?;
            let copies = copies.get(ticket)?;
            (copies.len() >= followers)
                .then(|| copies.iter().map(|(_, _, at)| between(fill, *at)).max())
                .flatten()
        })
        .collect()
}

/// Live trades during a fault: who places them, where the journal that times them is, and the
/// shape of the accounts.
struct Live<'a> {
    trader: &'a BridgeClient,
    journal: std::path::PathBuf,
    masters: usize,
    followers: usize,
}

impl Live<'_> {
    /// Opens a position on the `n`th of ten masters spread over the accounts.
    async fn trade(&self, n: usize) -> anyhow::Result<(String, i64)> {
        let login = format!("m{}", 1 + (n % 10) * self.masters / 10);
        let side = if n.is_multiple_of(2) {
            Side::Buy
        } else {
            Side::Sell
        };
        let ticket = self
            .trader
            .call(Request::hand_open(&login, "EURUSD", side, 0.1))
            .await?["ticket"]
            .as_i64()
            .context("ticket")?;
        Ok((login, ticket))
    }

    /// Waits until every one of `placed` is copied to all its followers by the journal, at
    /// most [`COPIED_WITHIN`]; each one's last copy, and how many were not all copied.
    async fn copied(&self, placed: &[(String, i64)]) -> anyhow::Result<(Vec<Duration>, usize)> {
        let deadline = Instant::now() + COPIED_WITHIN;
        loop {
            let journal = copier_node::sim_broker::journal::read(&self.journal)?;
            let last = last_copies(&journal, placed, self.followers);
            if last.len() == placed.len() || Instant::now() >= deadline {
                let missed = placed.len() - last.len();
                return Ok((last, missed));
            }
            tokio::time::sleep(Duration::from_millis(500)).await; // polling the journal file
        }
    }
}

/// Signals the live node holding the most accounts; until every account is owned by a live node
/// again (at most 120 s), with a live trade a second meanwhile.
async fn fault(
    conn: &mut PgConnection,
    pids: &HashMap<String, u32>,
    signal: &str,
    accounts: usize,
    live: &Live<'_>,
) -> anyhow::Result<Fault> {
    let (victim, held): (String, i64) = sqlx::query_as(
        "SELECT node_id, count(*) FROM trading_accounts WHERE node_id IS NOT NULL AND lease_until >= now() \
          GROUP BY node_id ORDER BY count(*) DESC, node_id LIMIT 1",
    )
    .fetch_one(&mut *conn)
    .await?;
    let pid = *pids.get(&victim).context("the busiest node's process")?;
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM trading_accounts WHERE node_id = $1")
        .bind(&victim)
        .fetch_all(&mut *conn)
        .await?;
    // An observer of the benchmark's own: every change of an account's owner, in order. A
    // release hands the row to no one (node_id NULL) before another node claims it; an account
    // left to its lease goes from the old owner straight to the next.
    for sql in [
        "CREATE TABLE IF NOT EXISTS bench_moves (seq bigserial PRIMARY KEY, id bigint, old_node text, new_node text)",
        "CREATE OR REPLACE FUNCTION bench_move() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN INSERT INTO bench_moves (id, old_node, new_node) VALUES (NEW.id, OLD.node_id, NEW.node_id); RETURN NULL; END $$",
        "DROP TRIGGER IF EXISTS bench_move ON trading_accounts",
        "CREATE TRIGGER bench_move AFTER UPDATE OF node_id ON trading_accounts FOR EACH ROW \
         WHEN (OLD.node_id IS DISTINCT FROM NEW.node_id) EXECUTE FUNCTION bench_move()",
    ] {
        sqlx::query(sql).execute(&mut *conn).await?;
    }
    let signalled = Instant::now();
    send_signal(pid, signal)
        .await
        .with_context(|| format!("signalling {victim}"))?;
    let mut placed = Vec::new();
    let mut next_trade = signalled;
    let until_owned_s = loop {
        if Instant::now() >= next_trade {
            placed.push(live.trade(placed.len()).await?);
            next_trade += Duration::from_secs(1);
        }
        let owned: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM trading_accounts WHERE node_id IS NOT NULL AND node_id <> $1 \
                AND lease_until >= now()",
        )
        .bind(&victim)
        .fetch_one(&mut *conn)
        .await?;
        if owned as usize == accounts {
            break Some(signalled.elapsed().as_secs_f64());
        }
        if signalled.elapsed() > Duration::from_secs(120) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await; // polling the database's count
    };
    let left: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT DISTINCT ON (id) id, new_node FROM bench_moves \
                                WHERE old_node = $1 AND id = ANY($2) ORDER BY id, seq) m \
          WHERE new_node IS NOT NULL",
    )
    .bind(&victim)
    .bind(&ids)
    .fetch_one(&mut *conn)
    .await?;
    let (last, trades_missed) = live.copied(&placed).await?;
    Ok(Fault {
        held,
        until_owned_s,
        left_to_the_lease: left,
        trades: placed.len(),
        last_follower: Stats::of(&last),
        trades_missed,
    })
}
