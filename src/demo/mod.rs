//! `copier-node demo`: the whole system on one machine. A throwaway PostgreSQL (or a fresh
//! database on the server `DATABASE_URL` names), the simulated broker, masters with followers on
//! various link settings, and a trade generator. The nodes scale out from one to four while the
//! masters trade (each joins once the previous one has its share), so fair share is visible;
//! then the busiest node is killed (kill -9) and restarted, about every 25 s, so failover is
//! visible. At the end a final check closes every master position and copies one more: no
//! follower may miss a copy or a close. Everything it creates is removed when it stops (Ctrl-C,
//! or `--duration`).
//!
//! The node processes run in a process group of their own: Ctrl-C in a terminal interrupts the
//! demo alone, which then runs its final check and stops the nodes with SIGTERM itself.

mod check;
mod setup;
mod stats;

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use sqlx::{Connection, PgConnection};
use tokio::process::Child;
use tokio::time::Instant;

use crate::broker::client::BridgeClient;
use crate::credentials::CredentialsKey;
use crate::db;
use crate::lease::balance::{self, Knobs, Member};
use crate::pgtmp::{Server, prepare_dir};
use crate::sim_broker::{ServeOptions, SimBroker};

/// What the demo runs.
#[derive(Debug, Clone)]
pub(crate) struct DemoOptions {
    pub duration: Option<Duration>,
    pub json: bool,
    /// Nodes at the end of the scale-out: the first starts alone, the next every `join_every`.
    pub nodes: usize,
    pub join_every: Duration,
    pub masters: usize,
    pub followers_per_master: usize,
    /// When the first node is killed, and how long it stays down; then every `kill_every`.
    pub first_kill: Duration,
    pub down_for: Duration,
    pub kill_every: Duration,
}

/// Progress lines go to stdout, or to stderr under `--json` (stdout then carries only the summary).
static PROGRESS_TO_STDERR: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            duration: None,
            json: false,
            nodes: 4,
            join_every: Duration::from_secs(3),
            masters: 4,
            followers_per_master: 5,
            first_kill: Duration::from_secs(18),
            down_for: Duration::from_secs(6),
            kill_every: Duration::from_secs(25),
        }
    }
}

/// The demo's result (`--json` prints it as the last line).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DemoSummary {
    pub duration_s: f64,
    pub nodes: usize,
    pub masters: usize,
    pub followers: usize,
    pub master_orders: usize,
    /// Copies opened on followers (accepted opens sent by nodes).
    pub copies: usize,
    /// (follower, marker) pairs with more than one accepted open: must be 0.
    pub duplicates: usize,
    /// Orders nodes sent, accepted or not.
    pub node_orders: usize,
    pub failovers: usize,
    /// Milliseconds from a node's kill until all its accounts were owned by others.
    pub failover_ms: Vec<i64>,
    /// Milliseconds from a node's start (scale-out or restart) until the accounts were spread
    /// evenly again (every node within its fair-share margin).
    pub rebalance_ms: Vec<i64>,
    /// Final check: followers without a copy of their master's last position, and copies still
    /// open after their master's position closed. Both must be 0.
    pub missed_copies: usize,
    pub missed_closes: usize,
    /// Copy latency (master order to copy, both as the broker journals them) of copies sent
    /// live: their master's order came while no failover or hand-off was under way.
    pub copy_latency_ms: Option<Latency>,
    /// The same for copies that waited for a failover or a hand-off (the master's order came
    /// between a node's kill or start and the end of the move).
    pub copy_latency_moved_ms: Option<Latency>,
}

/// Everything the demo started; dropping it stops and removes everything.
struct Scratch {
    dir: PathBuf,
    /// The server, and the demo's database on it (dropped at the end when the server is not a
    /// throwaway one).
    database: Option<(Server, String)>,
    nodes: Vec<Option<Child>>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for child in self.nodes.iter_mut().flatten() {
            let _ = child.start_kill();
        }
        if let Some((server, name)) = self.database.take()
            && server.cluster.is_none()
        {
            let admin_url = server.admin_url.clone();
            // A blocking runtime of its own: this may run while the demo's runtime unwinds.
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .ok()?;
                rt.block_on(async {
                    let mut c = PgConnection::connect(&admin_url).await.ok()?;
                    db::setup::drop_database(&mut c, &name).await.ok()
                })
            })
            .join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs the demo until `duration` passes or `shutdown` resolves.
pub(crate) async fn run(
    options: DemoOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<DemoSummary> {
    let dir = std::env::temp_dir().join(format!(
        "copier-demo-{}-{:08x}",
        std::process::id(),
        fastrand::u32(..)
    ));
    prepare_dir(&dir)?;
    PROGRESS_TO_STDERR.store(options.json, std::sync::atomic::Ordering::Relaxed);
    let mut scratch = Scratch {
        dir: dir.clone(),
        database: None,
        nodes: Vec::new(),
    };
    say(&format!("copier-node demo: working in {}", dir.display()));

    let url = start_database(&mut scratch).await?;
    let broker =
        SimBroker::start(ServeOptions::new("127.0.0.1:0", dir.join("journal.jsonl"))).await?;
    let broker_addr = broker.addr.to_string();
    say(&format!(
        "simulated broker on {broker_addr}, journal {}",
        dir.join("journal.jsonl").display()
    ));
    // Every account logs in with its own broker password, stored encrypted; the nodes share the
    // key, and only the session that logs an account in decrypts its password.
    let key = CredentialsKey::generate();
    let links = seed(&url, &broker_addr, &options, &key).await?;
    let followers = links.len();

    let exe = std::env::current_exe().context("finding this binary")?;
    // Every node could hold every account: fair share, not capacity, spreads them.
    let accounts = options.masters * (1 + options.followers_per_master);
    let capacity = accounts;
    scratch
        .nodes
        .push(Some(spawn_node(&exe, &url, &key, &dir, 0, capacity)?));
    say(&format!(
        "started demo-n1 (capacity {capacity}; lease 3s, fence 1s, cycle 500ms); {} more join, each once the previous one has its share; then the busiest node is killed and restarted about every {}s; Ctrl-C runs the final check and stops everything",
        options.nodes.saturating_sub(1),
        options.kill_every.as_secs()
    ));

    let trader = BridgeClient::connect(broker_addr.clone(), "manual");
    trader.wait_ready(Duration::from_secs(10)).await?;
    let started = Instant::now();
    let end = options.duration.map(|d| started + d);
    tokio::pin!(shutdown);
    let mut trade_tick = tokio::time::interval(Duration::from_millis(400));
    let mut show_tick = tokio::time::interval(Duration::from_secs(1));
    let mut poll_tick = tokio::time::interval(Duration::from_millis(200));
    let mut next_join = started + options.join_every;
    let mut next_kill = started + options.first_kill;
    let mut down: Option<(usize, Instant, HashSet<i64>)> = None;
    let mut failovers: Vec<i64> = Vec::new();
    let mut pending_failover: Option<(Instant, HashSet<i64>, String)> = None;
    let mut rebalances: Vec<i64> = Vec::new();
    // The newest node start (a join or a restart), until the accounts are spread evenly over the
    // running nodes. The next node joins, and the first kill comes, only once they are.
    let mut pending_balance: Option<(Instant, String)> = None;
    let mut master_orders = 0usize;
    // Wall-clock windows (the broker's journal clock) of failovers and hand-offs: copies whose
    // master order falls in one waited for a move, not for the copier.
    let mut moves: Vec<(i64, i64)> = Vec::new();
    let mut move_started: Option<i64> = None;
    let mut conn = connect(&url).await?;
    loop {
        let end_sleep = tokio::time::sleep_until(
            end.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600)),
        );
        tokio::select! {
            _ = &mut shutdown => break,
            _ = end_sleep, if end.is_some() => break,
            _ = trade_tick.tick() => {
                if trade(&trader, options.masters).await {
                    master_orders += 1;
                }
            }
            _ = poll_tick.tick() => {
                let owners = owners(&mut conn).await.unwrap_or_default();
                if let Some((since, accounts, node)) = &pending_failover
                    && accounts.iter().all(|a| owners.get(a).is_some_and(|o| o != node))
                {
                    let ms = since.elapsed().as_millis() as i64;
                    say(&format!("failover: all {} accounts of {node} owned by other nodes {ms} ms after its kill", accounts.len()));
                    failovers.push(ms);
                    pending_failover = None;
                    if pending_balance.is_none() && let Some(start) = move_started.take() {
                        moves.push((start, crate::sim_broker::server::now_ms()));
                    }
                }
                if let Some((since, node)) = &pending_balance {
                    let members: Vec<Member> = scratch
                        .nodes
                        .iter()
                        .enumerate()
                        .filter(|(_, c)| c.is_some())
                        .map(|(i, _)| Member { node_id: format!("demo-n{}", i + 1), capacity: capacity as u32 })
                        .collect();
                    let mut owned: BTreeMap<String, u32> = BTreeMap::new();
                    for o in owners.values() {
                        *owned.entry(o.clone()).or_default() += 1;
                    }
                    if balance::balanced(&owned, &members, accounts as u64, Knobs::default()) {
                        let ms = since.elapsed().as_millis() as i64;
                        say(&format!(
                            "balanced: {} ({ms} ms after {node} started)",
                            describe_owners(&owners, scratch.nodes.len(), None)
                        ));
                        rebalances.push(ms);
                        pending_balance = None;
                        if pending_failover.is_none() && let Some(start) = move_started.take() {
                            moves.push((start, crate::sim_broker::server::now_ms()));
                        }
                    }
                }
            }
            _ = show_tick.tick() => {
                let owners = match owners(&mut conn).await {
                    Ok(owners) => owners,
                    Err(e) => {
                        say(&format!("reading the owners failed: {}", db::describe(&e)));
                        Default::default()
                    }
                };
                let journal = read_journal(&dir.join("journal.jsonl"));
                let stats = Stats::from(&journal, &moves, move_started);
                say(&format!(
                    "[{:>4}s] {} | copies {} | duplicates {} | latency live {}, during moves {} | {}",
                    started.elapsed().as_secs(),
                    describe_owners(&owners, scratch.nodes.len(), down.as_ref().map(|d| d.0)),
                    stats.copies,
                    stats.duplicates,
                    Latency::describe(&stats.latency),
                    Latency::describe(&stats.moved),
                    plural(failovers.len(), "failover")
                ));
                let now = Instant::now();
                if scratch.nodes.len() < options.nodes && pending_balance.is_none() && now >= next_join {
                    let i = scratch.nodes.len();
                    scratch.nodes.push(Some(spawn_node(&exe, &url, &key, &dir, i, capacity)?));
                    say(&format!("scale-out: started demo-n{} ({} nodes)", i + 1, i + 1));
                    pending_balance = Some((now, format!("demo-n{}", i + 1)));
                    move_started.get_or_insert(crate::sim_broker::server::now_ms());
                    next_join = now + options.join_every;
                }
                if scratch.nodes.len() == options.nodes
                    && pending_balance.is_none()
                    && down.is_none()
                    && now >= next_kill
                {
                    // Kill the node that owns the most accounts.
                    let mut per: BTreeMap<String, HashSet<i64>> = BTreeMap::new();
                    for (a, o) in &owners {
                        per.entry(o.clone()).or_default().insert(*a);
                    }
                    if let Some((node, accounts)) = per.into_iter().max_by_key(|(_, a)| a.len()) {
                        let i: usize = node.trim_start_matches("demo-n").parse::<usize>().unwrap_or(1) - 1;
                        if let Some(Some(child)) = scratch.nodes.get_mut(i) {
                            let _ = child.start_kill();
                            let _ = child.wait().await;
                            say(&format!("kill -9 {node} (it owned {} accounts); it comes back in {}s", accounts.len(), options.down_for.as_secs()));
                            scratch.nodes[i] = None;
                            pending_failover = Some((now, accounts.clone(), node));
                            down = Some((i, now, accounts));
                            move_started.get_or_insert(crate::sim_broker::server::now_ms());
                        }
                    }
                    next_kill = now + options.kill_every;
                }
                if let Some((i, since, _)) = &down
                    && since.elapsed() >= options.down_for
                {
                    let i = *i;
                    scratch.nodes[i] = Some(spawn_node(&exe, &url, &key, &dir, i, capacity)?);
                    say(&format!("restarted demo-n{}", i + 1));
                    pending_balance = Some((Instant::now(), format!("demo-n{}", i + 1)));
                    move_started.get_or_insert(crate::sim_broker::server::now_ms());
                    down = None;
                }
            }
        }
    }
    if let Some((i, _, _)) = down.take() {
        say(&format!(
            "restarted demo-n{} (it was down) before the final check",
            i + 1
        ));
        scratch.nodes[i] = Some(spawn_node(&exe, &url, &key, &dir, i, capacity)?);
        move_started.get_or_insert(crate::sim_broker::server::now_ms());
    }
    say("final check: closing every master position, then copying one more");
    let (missed_copies, missed_closes) = final_check(&trader, options.masters, &links).await?;
    say(&format!(
        "final check: {missed_copies} missed copies, {missed_closes} missed closes"
    ));
    say("stopping: SIGTERM to every node, then removing everything");
    stop_nodes(&mut scratch.nodes).await;
    if missed_copies + missed_closes > 0 {
        say("the nodes' last warnings and errors (their logs are removed next):");
        for line in log_warnings(&dir, scratch.nodes.len(), 30) {
            say(&line);
        }
    }
    let _ = conn.close().await;
    trader.close();
    broker.stop().await;
    let journal = read_journal(&dir.join("journal.jsonl"));
    let stats = Stats::from(&journal, &moves, move_started);
    let summary = DemoSummary {
        duration_s: started.elapsed().as_secs_f64(),
        nodes: options.nodes,
        masters: options.masters,
        followers,
        master_orders,
        copies: stats.copies,
        duplicates: stats.duplicates,
        node_orders: stats.node_orders,
        failovers: failovers.len(),
        failover_ms: failovers,
        rebalance_ms: rebalances,
        missed_copies,
        missed_closes,
        copy_latency_ms: stats.latency,
        copy_latency_moved_ms: stats.moved,
    };
    drop(scratch);
    say(&format!(
        "done: {} master orders, {} copies, {} duplicates, {} missed, {}; copy latency live {}, during failovers and hand-offs {}; everything removed ({})",
        summary.master_orders,
        summary.copies,
        summary.duplicates,
        summary.missed_copies + summary.missed_closes,
        plural(summary.failovers, "failover"),
        Latency::describe(&summary.copy_latency_ms),
        Latency::describe(&summary.copy_latency_moved_ms),
        dir.display()
    ));
    if options.json {
        println!(
            "{}",
            serde_json::to_string(&summary).expect("the summary serialises")
        );
    }
    Ok(summary)
}

fn say(line: &str) {
    use std::io::Write;
    if PROGRESS_TO_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
        let _ = writeln!(std::io::stderr().lock(), "{line}");
    } else {
        let _ = writeln!(std::io::stdout().lock(), "{line}");
    }
}

/// `1 failover`, `2 failovers`.
fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

use check::{describe_owners, final_check, owners, trade};
use setup::{connect, log_warnings, seed, spawn_node, start_database, stop_nodes};
use stats::read_journal;
pub(crate) use stats::{Latency, Stats};
