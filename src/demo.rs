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

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use sqlx::{Connection, PgConnection};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::broker::client::BridgeClient;
use crate::broker::protocol::{PositionsResult, Request};
use crate::broker::types::{Position, Side};
use crate::broker::{BrokerError, RejectCode};
use crate::credentials::CredentialsKey;
use crate::db;
use crate::lease::balance::{self, Knobs, Member};
use crate::pgtmp::{Server, prepare_dir};
use crate::secret::Secret;
use crate::sim_broker::journal::{self, JournalEntry};
use crate::sim_broker::{ServeOptions, SimBroker, tools};

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

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Latency {
    pub p50: i64,
    pub p99: i64,
    pub max: i64,
    pub samples: usize,
}

const NODE_TIMINGS: [&str; 6] = ["--lease", "3s", "--fence", "1s", "--cycle", "500ms"];

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
                let owners = owners(&mut conn).await.unwrap_or_default();
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
    for child in scratch.nodes.iter_mut().flatten() {
        if let Some(pid) = child.id() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
    }
    for child in scratch.nodes.iter_mut().flatten() {
        if tokio::time::timeout(Duration::from_secs(15), child.wait())
            .await
            .is_err()
        {
            let _ = child.start_kill();
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

async fn connect(url: &str) -> anyhow::Result<PgConnection> {
    Ok(db::admin_connect(&Secret::new(url)).await?)
}

/// A fresh, migrated database on `DATABASE_URL`'s server, or on a throwaway cluster.
async fn start_database(scratch: &mut Scratch) -> anyhow::Result<String> {
    let server = Server::from_env_or_throwaway(&scratch.dir).await?;
    match &server.cluster {
        Some(cluster) => say(&format!(
            "throwaway PostgreSQL on 127.0.0.1:{}",
            cluster.port
        )),
        None => say("using the server DATABASE_URL names (a fresh database, dropped at the end)"),
    }
    let name = format!(
        "copier_demo_{}_{:06x}",
        std::process::id(),
        fastrand::u32(..0xffffff)
    );
    let url = server.fresh_database(&name).await;
    scratch.database = Some((server, name));
    url
}

/// Masters and followers with a mix of link settings. Returns (master login, follower login) of
/// every link.
async fn seed(
    url: &str,
    broker: &str,
    options: &DemoOptions,
    key: &CredentialsKey,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut conn = connect(url).await?;
    let settings = [
        ("multiplier", 1.0, false, "{}"),
        ("multiplier", 0.5, false, "{}"),
        ("fixed", 0.1, false, "{}"),
        ("multiplier", 1.0, true, "{}"),
        (
            "balance_ratio",
            1.0,
            false,
            r#"{"EURUSD": "EURUSD.m", "GBPUSD": "GBPUSD.m"}"#,
        ),
    ];
    let mut id = 1i64;
    let mut links = Vec::new();
    for m in 1..=options.masters {
        let master = id;
        id += 1;
        db::setup::add_account(&mut conn, master, "mt5", "master", broker, &format!("m{m}"))
            .await?;
        for f in 0..options.followers_per_master {
            let follower = id;
            id += 1;
            links.push((format!("m{m}"), format!("f{follower}")));
            db::setup::add_account(
                &mut conn,
                follower,
                "mt5",
                "follower",
                broker,
                &format!("f{follower}"),
            )
            .await?;
            let (mode, value, reverse, map) = settings[f % settings.len()];
            db::setup::add_link(&mut conn, master, follower, mode, value, reverse, map).await?;
        }
    }
    // A password per account (the simulated broker keeps the one an account first logged in
    // with), stored as `copier-node credentials encrypt` would.
    for id in db::setup::account_ids(&mut conn).await? {
        let value = key.encrypt(&format!("demo-password-{id}-{}", fastrand::u64(..)));
        db::setup::set_credentials(&mut conn, id, &value).await?;
    }
    let _ = conn.close().await;
    say(&format!(
        "{} masters, {} followers (multiplier, fixed, reverse, balance ratio, symbol map); broker passwords encrypted at rest",
        options.masters,
        links.len()
    ));
    Ok(links)
}

fn spawn_node(
    exe: &Path,
    url: &str,
    key: &CredentialsKey,
    dir: &Path,
    i: usize,
    capacity: usize,
) -> anyhow::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("node-{}.log", i + 1)))?;
    Command::new(exe)
        .arg("run")
        .args([
            "--platform",
            "mt5",
            "--node-id",
            &format!("demo-n{}", i + 1),
            "--capacity",
            &capacity.to_string(),
            "--http-listen",
            "127.0.0.1:0",
        ])
        .args(NODE_TIMINGS)
        .env("COPIER_DATABASE_URL", url)
        .env("COPIER_CREDENTIALS_KEY", key.encode())
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // A process group of its own: a terminal's Ctrl-C interrupts the demo, not its nodes (the
        // demo runs its final check and stops them itself).
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .context("starting a node process")
}

/// How long the final check waits for the followers to catch up.
const CATCH_UP: Duration = Duration::from_secs(20);

/// The demo's last word on copying (L3): close every master position and wait until no follower
/// holds a copy; open one position on each master and wait until every follower holds exactly one
/// copy of it; close those and wait until the followers are flat again. Returns (followers
/// without their copy, copies left open after their master closed).
async fn final_check(
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
async fn trade(trader: &BridgeClient, masters: usize) -> bool {
    tools::random_trade(trader, &format!("m{}", fastrand::usize(1..=masters))).await
}

async fn owners(conn: &mut PgConnection) -> Result<HashMap<i64, String>, sqlx::Error> {
    db::setup::live_owners(conn).await
}

fn describe_owners(owners: &HashMap<i64, String>, nodes: usize, down: Option<usize>) -> String {
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

/// The broker's journal so far (the in-process broker writes whole lines, so a read never meets
/// a half-written one; an unreadable journal counts as empty for the progress line).
fn read_journal(path: &Path) -> Vec<JournalEntry> {
    journal::read(path).unwrap_or_default()
}

/// What the journal says about the copies.
pub(crate) struct Stats {
    pub copies: usize,
    pub duplicates: usize,
    pub node_orders: usize,
    /// Copies whose master order came while no move (failover, hand-off) was under way.
    pub latency: Option<Latency>,
    /// Copies whose master order came during a move.
    pub moved: Option<Latency>,
}

impl Latency {
    fn of(mut samples: Vec<i64>) -> Option<Latency> {
        samples.sort_unstable();
        (!samples.is_empty()).then(|| Latency {
            p50: samples[samples.len() / 2],
            p99: samples[((samples.len() as f64 * 0.99).ceil() as usize)
                .saturating_sub(1)
                .min(samples.len() - 1)],
            max: samples[samples.len() - 1],
            samples: samples.len(),
        })
    }

    fn describe(l: &Option<Latency>) -> String {
        match l {
            Some(l) => format!("p50 {} ms, p99 {} ms ({} copies)", l.p50, l.p99, l.samples),
            None => "-".into(),
        }
    }
}

impl Stats {
    /// Counts from journal lines: accepted opens by nodes (copies), (login, marker) pairs opened
    /// more than once (duplicates), and the time from each master open to each of its copies,
    /// split by whether the master's order came during a move: a window of `moves` (journal
    /// clock, ms), or after `moving_since` (a move still under way).
    pub(crate) fn from(
        journal: &[JournalEntry],
        moves: &[(i64, i64)],
        moving_since: Option<i64>,
    ) -> Stats {
        let during_move = |ts: i64| {
            moves.iter().any(|(a, b)| ts >= *a && ts <= *b) || moving_since.is_some_and(|a| ts >= a)
        };
        let is_node = |l: &JournalEntry| l.client != "manual" && l.action != "login";
        let mut opens: HashMap<(String, String), usize> = HashMap::new();
        let mut master_open: HashMap<i64, i64> = HashMap::new();
        let mut live = Vec::new();
        let mut moved = Vec::new();
        for l in journal {
            if l.client == "manual"
                && l.action == "open"
                && l.accepted
                && let Some(t) = l.ticket
            {
                master_open.insert(t, l.ts_ms);
            }
        }
        let mut node_orders = 0;
        for l in journal.iter().filter(|l| is_node(l)) {
            node_orders += 1;
            if l.action == "open" && l.accepted {
                let comment = l.comment.clone().unwrap_or_default();
                *opens.entry((l.login.clone(), comment.clone())).or_insert(0) += 1;
                if let Some(t) = crate::model::parse_marker(&comment)
                    && let Some(m) = master_open.get(&t)
                {
                    let ts = l.ts_ms;
                    if during_move(*m) {
                        moved.push(ts - m);
                    } else {
                        live.push(ts - m);
                    }
                }
            }
        }
        Stats {
            copies: opens.values().sum(),
            duplicates: opens.values().filter(|n| **n > 1).count(),
            node_orders,
            latency: Latency::of(live),
            moved: Latency::of(moved),
        }
    }
}
