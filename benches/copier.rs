//! copier-node benchmarks: copy latency, lease-cycle cost, claim storms, failover and handoff,
//! cost per account, and the notification path, each beside a floor measured in the same run.
//!
//!   cargo bench --bench copier                  # the full run: writes BENCHMARKS.md, benchmarks.json
//!   cargo test --bench copier -- --smoke        # a small version of every benchmark (CI)
//!   cargo bench --bench copier -- --only cycle  # one section (floors, cycle, storm, copy,
//!                                               #   failover, rebalance, cost, notify)
//!
//! Everything it needs starts here: a throwaway PostgreSQL cluster (or the server DATABASE_URL
//! names), the simulated broker in-process, and node processes of the real binary.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::{PositionChange, Side};
use copier_node::broker::{AccountLogin, Broker, SessionEvent};
use copier_node::db;
use copier_node::db::lease::{CycleParams, cycle};
use copier_node::lease::balance::{self, Knobs, Member};
use copier_node::pgtmp::{Server, prepare_dir};
use copier_node::sim_broker::{ServeOptions, SimBroker};
use serde::Serialize;
use sqlx::{Connection, Executor, PgConnection, Row};
use tokio::time::Instant;

/// Median, tail and maximum of a set of samples, in milliseconds.
#[derive(Debug, Clone, Serialize)]
struct Stats {
    runs: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl Stats {
    fn of(samples: &[Duration]) -> Stats {
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let at = |q: f64| {
            if ms.is_empty() {
                f64::NAN
            } else {
                ms[((ms.len() as f64 * q).ceil() as usize)
                    .saturating_sub(1)
                    .min(ms.len() - 1)]
            }
        };
        Stats {
            runs: ms.len(),
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: ms.last().copied().unwrap_or(f64::NAN),
        }
    }

    fn show(&self) -> String {
        format!("{:.2} / {:.2} ms", self.p50_ms, self.p99_ms)
    }
}

struct Options {
    smoke: bool,
    only: Option<String>,
    out: PathBuf,
}

#[derive(Default, Serialize)]
struct Report {
    machine: BTreeMap<String, String>,
    floors: BTreeMap<String, Stats>,
    cycle: Vec<serde_json::Value>,
    storm: Vec<serde_json::Value>,
    copy: Vec<serde_json::Value>,
    failover: Vec<serde_json::Value>,
    rebalance: Vec<serde_json::Value>,
    cost: Vec<serde_json::Value>,
    notify: Vec<serde_json::Value>,
    markdown: Vec<String>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let smoke = args.iter().any(|a| a == "--smoke");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let only = value("--only");
    // Only a full run of every section replaces the published results.
    let out = value("--out").map(PathBuf::from).unwrap_or_else(|| {
        if smoke {
            root.join("target/bench-smoke")
        } else if only.is_some() {
            root.join("target/bench-only")
        } else {
            root.clone()
        }
    });
    let options = Options { smoke, only, out };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    if let Err(e) = runtime.block_on(run(options)) {
        eprintln!("benchmark failed: {e:#}");
        std::process::exit(1);
    }
}

/// The database server for the run.
/// The server the benchmarks run on (`DATABASE_URL`'s, or a throwaway cluster) and the scratch
/// directory of the throwaway one.
struct Pg {
    admin_url: String,
    server: Server,
    dir: PathBuf,
}

impl Drop for Pg {
    fn drop(&mut self) {
        if let Some(cluster) = self.server.cluster.take() {
            let _ = cluster.stop("immediate");
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Pg {
    async fn start() -> anyhow::Result<Pg> {
        let dir = std::env::temp_dir().join(format!("copier-bench-{}", std::process::id()));
        prepare_dir(&dir)?;
        let server = Server::from_env_or_throwaway(&dir).await?;
        Ok(Pg {
            admin_url: server.admin_url.clone(),
            server,
            dir,
        })
    }

    /// A fresh migrated database; returns its URL.
    async fn database(&self, name: &str) -> anyhow::Result<String> {
        self.server.fresh_database(name).await
    }
}

fn wanted(options: &Options, section: &str) -> bool {
    options.only.as_deref().is_none_or(|o| o == section)
}

async fn run(options: Options) -> anyhow::Result<()> {
    std::fs::create_dir_all(&options.out)?;
    let pg = Pg::start().await?;
    let mut report = Report::default();
    machine(&mut report, &pg).await;
    floors(&options, &pg, &mut report).await?;
    if wanted(&options, "cycle") {
        lease_cycle(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "storm") {
        claim_storm(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "copy") {
        copy_latency(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "failover") {
        failover(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "rebalance") {
        rebalance(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "cost") {
        cost_per_account(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "notify") {
        notification_path(&options, &pg, &mut report).await?;
    }
    write(&options, &report)?;
    Ok(())
}

async fn machine(report: &mut Report, pg: &Pg) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(|l| l.to_string()))
        .unwrap_or_default();
    report.machine.insert("cpu".into(), cpu);
    report.machine.insert("cores".into(), cores.to_string());
    report.machine.insert(
        "memory".into(),
        mem.replace("MemTotal:", "").trim().to_string(),
    );
    if let Ok(mut c) = PgConnection::connect(&pg.admin_url).await
        && let Ok(v) = sqlx::query_scalar::<_, String>("SHOW server_version")
            .fetch_one(&mut c)
            .await
    {
        report.machine.insert("postgresql".into(), v);
    }
    report.machine.insert(
        "profile".into(),
        if cfg!(debug_assertions) {
            "debug (smoke)".into()
        } else {
            "release".into()
        },
    );
    report.machine.insert(
        "date".into(),
        String::from_utf8_lossy(
            &std::process::Command::new("date")
                .arg("-u")
                .arg("+%Y-%m-%d %H:%M UTC")
                .output()
                .map(|o| o.stdout)
                .unwrap_or_default(),
        )
        .trim()
        .to_string(),
    );
}

// ---------------------------------------------------------------------------------------------
// Floors: one PostgreSQL round trip, one single-row UPDATE, one NOTIFY delivered, one broker
// round trip.

async fn floors(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let n = if options.smoke { 30 } else { 300 };
    let url = pg.database("bench_floors").await?;
    let mut conn = PgConnection::connect(&url).await?;
    let mut select = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        sqlx::query("SELECT 1").execute(&mut conn).await?;
        select.push(t.elapsed());
    }
    conn.execute("CREATE TABLE floor_row (id int PRIMARY KEY, v bigint)")
        .await?;
    conn.execute("INSERT INTO floor_row VALUES (1, 0)").await?;
    let mut update = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        sqlx::query("UPDATE floor_row SET v = $1 WHERE id = 1")
            .bind(i as i64)
            .execute(&mut conn)
            .await?;
        update.push(t.elapsed());
    }
    let mut listener = sqlx::postgres::PgListener::connect(&url).await?;
    listener.listen("bench_floor").await?;
    let mut notify = Vec::new();
    for i in 0..n.min(100) {
        let t = Instant::now();
        sqlx::query("SELECT pg_notify('bench_floor', $1)")
            .bind(i.to_string())
            .execute(&mut conn)
            .await?;
        listener.recv().await?;
        notify.push(t.elapsed());
    }
    let dir = std::env::temp_dir().join(format!("copier-bench-floor-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let broker =
        SimBroker::start(ServeOptions::new("127.0.0.1:0", dir.join("journal.jsonl"))).await?;
    let client = BridgeClient::connect(broker.addr.to_string(), "bench");
    client.wait_ready(Duration::from_secs(10)).await?;
    let mut broker_rt = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let _ = client.call(Request::Symbols).await;
        broker_rt.push(t.elapsed());
    }
    client.close();
    broker.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    for (name, samples) in [
        ("pg_select_1", select),
        ("pg_single_row_update", update),
        ("notify_delivery", notify),
        ("broker_round_trip", broker_rt),
    ] {
        let s = Stats::of(&samples);
        println!("floor {name}: {}", s.show());
        report.floors.insert(name.into(), s);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Lease cycle: one node's whole cycle owning 100 / 1,000 / 10,000 accounts in tables of 10k,
// 100k and 1M rows, its own SQL beside the seed's statements on the seed's bare schema.

const SEED_RENEW: &str = "UPDATE seed_accounts SET lease_until = now() + make_interval(secs => 60) WHERE node_id = $1 AND platform = $2 AND enabled";
const SEED_CLAIM: &str = "UPDATE seed_accounts SET node_id = $1, lease_until = now() + make_interval(secs => 60)
    WHERE id IN (SELECT id FROM seed_accounts WHERE platform = $2 AND enabled AND (node_id IS NULL OR lease_until IS NULL OR lease_until < now())
                 ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED)";
const SEED_READ: &str =
    "SELECT id FROM seed_accounts WHERE node_id = $1 AND platform = $2 AND enabled";

/// A connection with a running node's session settings (`db::node_options`: bounds for a
/// generous fence, durable commits, no JIT), so the cycle is measured as a node runs it.
async fn node_connection(url: &str) -> anyhow::Result<PgConnection> {
    let options = db::node_options(
        &copier_node::config::Secret::new(url),
        "bench",
        db::SessionBounds::for_fence(Duration::from_secs(60)),
    )?;
    Ok(sqlx::ConnectOptions::connect(&options).await?)
}

async fn fill(conn: &mut PgConnection, table: &str, rows: i64, owned: i64) -> anyhow::Result<()> {
    // The note's shape: 80 % on the platform, 5 % disabled and unowned, every enabled row owned
    // by one of 100 live nodes; then the measured node x owns the first `owned` enabled rows of
    // its platform (claims go in id order).
    conn.execute("SET session_replication_role = replica")
        .await?;
    let (columns, extra) = if table == "trading_accounts" {
        conn.execute("INSERT INTO nodes SELECT 'n' || g, 'i', 'mt5', 100000, now() + interval '1 hour', now(), now(), now() + interval '1 hour', 0 FROM generate_series(1, 100) g ON CONFLICT DO NOTHING").await?;
        conn.execute("INSERT INTO nodes VALUES ('x', 'ix', 'mt5', 100000, now() + interval '1 hour', now(), now(), now() + interval '1 hour', 0) ON CONFLICT DO NOTHING").await?;
        (
            "id, platform, enabled, node_id, lease_until, role, server, login, owner_epoch",
            ", 'follower', 'h:1', g::text, g",
        )
    } else {
        ("id, platform, enabled, node_id, lease_until", "")
    };
    sqlx::query(&format!(
        "INSERT INTO {table} ({columns})
         SELECT g, CASE WHEN g % 5 = 0 THEN 'mt4' ELSE 'mt5' END, g % 20 <> 1,
                CASE WHEN g % 20 = 1 THEN NULL ELSE 'n' || (g % 100 + 1) END,
                CASE WHEN g % 20 = 1 THEN NULL ELSE now() + interval '1 hour' END{extra}
           FROM generate_series(1, $1) g"
    ))
    .bind(rows)
    .execute(&mut *conn)
    .await?;
    sqlx::query(&format!("UPDATE {table} SET node_id = 'x' WHERE id IN (SELECT id FROM {table} WHERE platform = 'mt5' AND enabled ORDER BY id LIMIT $1)"))
        .bind(owned)
        .execute(&mut *conn)
        .await?;
    conn.execute("SET session_replication_role = DEFAULT")
        .await?;
    conn.execute(format!("VACUUM ANALYZE {table}").as_str())
        .await?;
    Ok(())
}

async fn table_stats(conn: &mut PgConnection, table: &str) -> anyhow::Result<(i64, i64, i64)> {
    let r = sqlx::query(
        "SELECT n_tup_upd, n_tup_hot_upd, n_dead_tup FROM pg_stat_user_tables WHERE relname = $1",
    )
    .bind(table)
    .fetch_one(conn)
    .await?;
    Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?))
}

/// Makes `writer`'s pending statistics visible, then waits until `reader` sees at least
/// `expected_updates` more updates than `before`.
async fn settled_stats(
    writer: &mut PgConnection,
    reader: &mut PgConnection,
    table: &str,
    before: (i64, i64, i64),
    expected_updates: i64,
) -> anyhow::Result<(i64, i64, i64)> {
    writer.execute("SELECT pg_stat_force_next_flush()").await?;
    writer.execute("SELECT 1").await?;
    let since = Instant::now();
    loop {
        let now = table_stats(reader, table).await?;
        if now.0 - before.0 >= expected_updates || since.elapsed() > Duration::from_secs(10) {
            return Ok(now);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn lease_cycle(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let sizes: &[i64] = if options.smoke {
        &[10_000]
    } else {
        &[10_000, 100_000, 1_000_000]
    };
    let owned_counts: &[i64] = if options.smoke {
        &[100]
    } else {
        &[100, 1_000, 10_000]
    };
    let runs = if options.smoke { 10 } else { 40 };
    let floor = report.floors["pg_single_row_update"].p50_ms;
    let mut md = String::from(
        "| table rows | owned | node's cycle p50 / p99 | seed's statements p50 / p99 | seed ÷ node | node ÷ UPDATE floor | rows written / cycle | dead tuples / cycle | HOT renewals |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for &rows in sizes {
        for &owned in owned_counts.iter().filter(|o| **o * 4 <= rows) {
            let url = pg.database(&format!("bench_cycle_{rows}_{owned}")).await?;
            let mut conn = PgConnection::connect(&url).await?;
            fill(&mut conn, "trading_accounts", rows, owned).await?;
            let held: Vec<i64> =
                sqlx::query_scalar("SELECT owner_epoch FROM trading_accounts WHERE node_id = 'x'")
                    .fetch_all(&mut conn)
                    .await?;
            let mut node = node_connection(&url).await?;
            let params = CycleParams {
                node_id: "x",
                instance_id: "ix",
                platform: "mt5",
                // Room to claim, as a running node usually has: the claim runs (and finds
                // nothing, as in a steady state where every enabled row is owned).
                capacity: 2 * owned as u32,
                claim_limit: 2 * owned as u32,
                trust: Duration::from_secs(45),
                owned: held.len() as u32,
                lease: Duration::from_secs(60),
                held: &held,
                claim: true,
            };
            // Warm-up (prepares the statement, warms the cache), then measure.
            let initial = table_stats(&mut conn, "trading_accounts").await?;
            for _ in 0..3 {
                cycle(&mut node, &params).await?;
            }
            let before = settled_stats(
                &mut node,
                &mut conn,
                "trading_accounts",
                initial,
                3 * held.len() as i64,
            )
            .await?;
            let mut ours = Vec::new();
            for _ in 0..runs {
                let t = Instant::now();
                let out = cycle(&mut node, &params).await?;
                ours.push(t.elapsed());
                anyhow::ensure!(
                    out.owned.len() == held.len(),
                    "the node kept {} of {} rows",
                    out.owned.len(),
                    held.len()
                );
            }
            let after = settled_stats(
                &mut node,
                &mut conn,
                "trading_accounts",
                before,
                runs as i64 * held.len() as i64,
            )
            .await?;
            // The seed's statements on the seed's bare schema (primary key only), same data.
            conn.execute("CREATE TABLE seed_accounts (id bigint PRIMARY KEY, platform text NOT NULL, enabled boolean NOT NULL, node_id text, lease_until timestamptz)").await?;
            fill(&mut conn, "seed_accounts", rows, owned).await?;
            let mut seed = Vec::new();
            for i in 0..(runs + 3) {
                let t = Instant::now();
                let mut tx = node.begin().await?;
                sqlx::query(SEED_RENEW)
                    .bind("x")
                    .bind("mt5")
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(SEED_CLAIM)
                    .bind("x")
                    .bind("mt5")
                    .bind(owned) // capacity less owned, as the node above
                    .execute(&mut *tx)
                    .await?;
                let got: Vec<i64> = sqlx::query_scalar(SEED_READ)
                    .bind("x")
                    .bind("mt5")
                    .fetch_all(&mut *tx)
                    .await?;
                tx.commit().await?;
                if i >= 3 {
                    seed.push(t.elapsed());
                }
                anyhow::ensure!(got.len() == held.len());
            }
            let (o, s) = (Stats::of(&ours), Stats::of(&seed));
            let per = |d: i64| d as f64 / runs as f64;
            let (written, hot, dead) = (
                per(after.0 - before.0),
                after.1 - before.1,
                per(after.2 - before.2),
            );
            let hot_pct = if after.0 > before.0 {
                100.0 * hot as f64 / (after.0 - before.0) as f64
            } else {
                f64::NAN
            };
            println!(
                "cycle {rows} rows, {owned} owned: node {} vs seed {}; {written:.0} rows written, {dead:.0} dead, {hot_pct:.0}% HOT",
                o.show(),
                s.show()
            );
            let _ = writeln!(
                md,
                "| {rows} | {owned} | {} | {} | {:.1}× | {:.1}× | {written:.0} | {dead:.0} | {hot_pct:.0} % |",
                o.show(),
                s.show(),
                s.p50_ms / o.p50_ms,
                o.p50_ms / floor
            );
            report.cycle.push(serde_json::json!({"table_rows": rows, "owned": owned, "node": o, "seed": s, "rows_written_per_cycle": written, "dead_tuples_per_cycle": dead, "hot_percent": hot_pct}));
            drop(node);
            conn.close().await?;
        }
    }
    report.markdown.push(format!(
        "## Lease cycle\n\nOne node's whole cycle (one statement: membership, renewal, claim, read-back) owning N accounts, with room for N more, in a table of M rows shaped like the note's (80 % on the node's platform, 5 % disabled, every enabled row owned by one of 100 live nodes), {runs} cycles each after 3 warm-up cycles; beside it the seed's literal statements (renew, claim with `ORDER BY id LIMIT`, read back, in one transaction) on the seed's bare schema (primary key only), same data. Floor: one single-row UPDATE round trip, p50 {floor:.2} ms. Rows written, dead tuples and HOT share from `pg_stat_user_tables` over the measured cycles.\n\n{md}"
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Claim storm: 64 nodes of capacity 2,000 start at once against 100,000 free accounts.

async fn claim_storm(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let (nodes, capacity, rows) = if options.smoke {
        (8usize, 1000u32, 5_000i64)
    } else {
        (64, 2000, 100_000)
    };
    let runs = if options.smoke { 1 } else { 3 };
    let floor = report.floors["pg_single_row_update"].p50_ms;
    let mut times = Vec::new();
    let mut spreads = Vec::new();
    let (mut max_cycles, mut max_claiming) = (0, 0);
    for run in 0..runs {
        let url = pg.database(&format!("bench_storm_{run}")).await?;
        let mut conn = PgConnection::connect(&url).await?;
        sqlx::query("INSERT INTO trading_accounts (id, platform, role, server, login) SELECT g, 'mt5', 'follower', 'h:1', g::text FROM generate_series(1, $1) g")
            .bind(rows)
            .execute(&mut conn)
            .await?;
        conn.execute("VACUUM ANALYZE trading_accounts").await?;
        let mut conns = Vec::new();
        for _ in 0..nodes {
            conns.push(node_connection(&url).await?);
        }
        let start = Instant::now();
        let mut tasks = Vec::new();
        for (i, mut c) in conns.into_iter().enumerate() {
            tasks.push(tokio::spawn(async move {
                let node = format!("s{i}");
                let mut held: Vec<i64> = Vec::new();
                let mut ids: Vec<i64>;
                let (mut cycles, mut claiming) = (0, 0);
                loop {
                    let params = CycleParams {
                        node_id: &node,
                        instance_id: "i",
                        platform: "mt5",
                        capacity,
                        claim_limit: capacity,
                        trust: Duration::from_secs(45),
                        owned: held.len() as u32,
                        lease: Duration::from_secs(60),
                        held: &held,
                        claim: true,
                    };
                    let out = cycle(&mut c, &params).await?;
                    cycles += 1;
                    let before = held.len();
                    held = out.owned.iter().map(|r| r.epoch).collect();
                    ids = out.owned.iter().map(|r| r.id).collect();
                    if held.len() > before {
                        claiming += 1;
                    }
                    if held.len() == before && (out.free == 0 || held.len() as u32 >= capacity) {
                        break;
                    }
                }
                Ok::<_, anyhow::Error>((ids, cycles, claiming, start.elapsed()))
            }));
        }
        let mut owner: HashMap<i64, usize> = HashMap::new();
        let mut per_node = Vec::new();
        let mut done = Duration::ZERO;
        for (i, t) in tasks.into_iter().enumerate() {
            let (ids, cycles, claiming, at) = t.await??;
            max_cycles = max_cycles.max(cycles);
            max_claiming = max_claiming.max(claiming);
            done = done.max(at);
            per_node.push(ids.len());
            for id in ids {
                if let Some(j) = owner.insert(id, i) {
                    bail!("row {id} handed to both s{j} and s{i}");
                }
            }
        }
        let owned: i64 =
            sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id IS NOT NULL")
                .fetch_one(&mut conn)
                .await?;
        anyhow::ensure!(
            owned == rows && owner.len() as i64 == rows,
            "{owned} of {rows} owned"
        );
        per_node.sort_unstable();
        println!(
            "claim storm run {run}: {rows} rows by {nodes} nodes in {:?}; per node {}..{}",
            done,
            per_node[0],
            per_node[per_node.len() - 1]
        );
        times.push(done);
        spreads.push((per_node[0], per_node[per_node.len() - 1]));
    }
    let s = Stats::of(&times);
    let (lo, hi) = (
        spreads.iter().map(|s| s.0).min().unwrap_or(0),
        spreads.iter().map(|s| s.1).max().unwrap_or(0),
    );
    report.storm.push(serde_json::json!({"nodes": nodes, "capacity": capacity, "rows": rows, "time_to_all_owned": s, "rows_per_node_min": lo, "rows_per_node_max": hi, "double_hand_outs": 0, "max_cycles_per_node": max_cycles, "max_claiming_cycles_per_node": max_claiming}));
    report.markdown.push(format!(
        "## Claim storm\n\n{nodes} nodes of capacity {capacity} run the cycle statement at once against {rows} free accounts, each cycling back to back until its claim comes back empty and nothing is left free ({runs} runs). Every returned row is recorded: **0 rows handed to two nodes**. A node's cycles that claimed something are counted apart from its empty retries (a node that found every free row locked by a concurrent claim retries at once here; a running node waits for its next cycle).\n\n| time until all owned p50 / p99 | rows per node (min – max) | cycles that claimed, per node (max) | cycles in all, per node (max) | floor: single-row UPDATE |\n|---:|---:|---:|---:|---:|\n| {} | {lo} – {hi} | {max_claiming} | {max_cycles} | {floor:.2} ms |\n\nThe claim itself is first come, first served (as the note measured): the first nodes to run fill to capacity and the last may start empty; fair share then evens the nodes out through bounded hand-offs (see the README). The time is the database's work for all the claims on this 2-core machine shared with every client; compare it with the default `cycle` (20 s).\n",
        s.show()
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Node processes and accounts for the copy, failover and cost benchmarks.

struct Setup {
    url: String,
    broker: SimBroker,
    dir: PathBuf,
    nodes: Vec<tokio::process::Child>,
}

impl Setup {
    async fn new(
        pg: &Pg,
        name: &str,
        masters: usize,
        followers_per_master: usize,
    ) -> anyhow::Result<Setup> {
        let url = pg.database(name).await?;
        let dir = std::env::temp_dir().join(format!("copier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let broker =
            SimBroker::start(ServeOptions::new("127.0.0.1:0", dir.join("journal.jsonl"))).await?;
        let mut conn = PgConnection::connect(&url).await?;
        let server = broker.addr.to_string();
        sqlx::query("INSERT INTO trading_accounts (id, platform, role, server, login) SELECT g, 'mt5', 'master', $2, 'm' || g FROM generate_series(1, $1) g")
            .bind(masters as i64)
            .bind(&server)
            .execute(&mut conn)
            .await?;
        let followers = (masters * followers_per_master) as i64;
        sqlx::query("INSERT INTO trading_accounts (id, platform, role, server, login) SELECT 1000000 + g, 'mt5', 'follower', $2, 'f' || g FROM generate_series(1, $1) g")
            .bind(followers)
            .bind(&server)
            .execute(&mut conn)
            .await?;
        sqlx::query("INSERT INTO copy_links (master_id, follower_id) SELECT 1 + (g - 1) % $2, 1000000 + g FROM generate_series(1, $1) g")
            .bind(followers)
            .bind(masters as i64)
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        Ok(Setup {
            url,
            broker,
            dir,
            nodes: Vec::new(),
        })
    }

    fn spawn_node(&mut self, id: &str, timing: [&str; 6]) -> anyhow::Result<u32> {
        let log = std::fs::File::create(self.dir.join(format!("{id}.log")))?;
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_copier-node"))
            .args([
                "run",
                "--platform",
                "mt5",
                "--node-id",
                id,
                "--capacity",
                "100000",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(timing)
            .env("COPIER_DATABASE_URL", &self.url)
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().unwrap_or(0);
        self.nodes.push(child);
        Ok(pid)
    }

    async fn owners(&self) -> anyhow::Result<HashMap<i64, String>> {
        let mut c = PgConnection::connect(&self.url).await?;
        let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, node_id FROM trading_accounts WHERE node_id IS NOT NULL AND lease_until >= now()").fetch_all(&mut c).await?;
        c.close().await?;
        Ok(rows.into_iter().collect())
    }

    /// Waits until every account is owned, every follower session has reconciled, and ownership
    /// has been still for a second.
    async fn wait_settled(&self, accounts: usize, within: Duration) -> anyhow::Result<()> {
        let since = Instant::now();
        let mut previous = HashMap::new();
        let mut still = Instant::now();
        let mut c = PgConnection::connect(&self.url).await?;
        loop {
            let now = self.owners().await?;
            let ready: i64 = sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE role = 'master' OR status LIKE 'follower: master%'").fetch_one(&mut c).await?;
            if now.len() != accounts || now != previous || ready as usize != accounts {
                still = Instant::now();
            } else if still.elapsed() >= Duration::from_secs(1) {
                return Ok(());
            }
            previous = now;
            if since.elapsed() > within {
                bail!(
                    "not settled within {within:?}: {} of {accounts} owned, {ready} ready",
                    previous.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn stop(mut self) {
        for n in &mut self.nodes {
            if let Some(pid) = n.id() {
                let _ = tokio::process::Command::new("kill")
                    .arg("-TERM")
                    .arg(pid.to_string())
                    .status()
                    .await;
            }
        }
        for n in &mut self.nodes {
            if tokio::time::timeout(Duration::from_secs(15), n.wait())
                .await
                .is_err()
            {
                let _ = n.start_kill();
            }
        }
        self.broker.stop().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Watches the followers' position streams: the instant each copy of a master ticket opened.
struct Observer {
    _client: BridgeClient,
    arrivals: tokio::sync::mpsc::UnboundedReceiver<(String, i64, Instant)>,
}

impl Observer {
    async fn new(addr: &str, logins: &[String]) -> anyhow::Result<Observer> {
        let client = BridgeClient::connect(addr.to_string(), "bench-observer");
        client.wait_ready(Duration::from_secs(10)).await?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for login in logins {
            let mut session = client
                .login(&AccountLogin {
                    login: login.clone(),
                    password: None,
                    fence: None,
                })
                .await?;
            let tx = tx.clone();
            let login = login.clone();
            tokio::spawn(async move {
                let _api = session.api.clone();
                while let Some(ev) = session.events.recv().await {
                    if let SessionEvent::Position(PositionChange::Opened { position }) = ev
                        && let Some(t) = copier_node::copier::parse_marker(&position.comment)
                    {
                        let _ = tx.send((login.clone(), t, Instant::now()));
                    }
                }
            });
        }
        Ok(Observer {
            _client: client,
            arrivals: rx,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Copy latency: from the master's order accepted at the broker to each follower's copy accepted,
// for 1, 100 and 1,000 followers over 1, 2 and 4 nodes.

async fn copy_latency(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let configs: &[(usize, usize)] = if options.smoke {
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
    let trades = if options.smoke { 3 } else { 20 };
    let floor = report.floors["notify_delivery"].p50_ms + report.floors["broker_round_trip"].p50_ms;
    let mut md = String::from(
        "| followers | nodes | copy latency p50 | p99 | max | last follower served p50 / max | p50 ÷ floor | p99 ÷ floor |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
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
        let mut samples = Vec::new();
        let mut last = Vec::new();
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
        report.copy.push(serde_json::json!({"followers": followers, "nodes": nodes, "trades": trades, "latency": s, "last_follower": l, "floor_ms": floor}));
        trader.close();
        drop(observer);
        setup.stop().await;
    }
    report.markdown.push(format!(
        "## Copy latency\n\nFrom the master's order accepted at the broker (its reply at the benchmark) to each follower's copy accepted (its `opened` event at the benchmark, which watches every follower's position stream): {trades} master opens per row, every follower's copy a sample. Nodes are `copier-node run` processes; the master and followers spread over them by fair share. Floor, measured in the same run: one NOTIFY delivered to a listener after commit ({:.2} ms) plus one broker round trip ({:.2} ms) = {floor:.2} ms.\n\n{md}",
        report.floors["notify_delivery"].p50_ms, report.floors["broker_round_trip"].p50_ms
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Failover and handoff: from kill -9 / SIGTERM of a node until every account it held is served
// again (a copy of a master order placed right after the fault reaches every follower).

async fn failover(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let runs = if options.smoke { 1 } else { 5 };
    let followers = 10;
    let mut md = String::from(
        "| fault | until served again p50 / p99 (runs) | max | lease |\n|---|---:|---:|---:|\n",
    );
    for signal in ["KILL", "TERM"] {
        let mut samples = Vec::new();
        for run in 0..runs {
            let mut setup = Setup::new(
                pg,
                &format!("bench_failover_{}_{run}", signal.to_lowercase()),
                1,
                followers,
            )
            .await?;
            let timing = ["--lease", "3s", "--fence", "1s", "--cycle", "500ms"];
            let a = setup.spawn_node("fa", timing)?;
            setup
                .wait_settled(followers + 1, Duration::from_secs(60))
                .await?;
            setup.spawn_node("fb", timing)?;
            setup
                .wait_settled(followers + 1, Duration::from_secs(60))
                .await?;
            let logins: Vec<String> = (1..=followers).map(|g| format!("f{g}")).collect();
            let mut observer = Observer::new(&setup.broker.addr.to_string(), &logins).await?;
            let trader = BridgeClient::connect(setup.broker.addr.to_string(), "manual");
            trader.wait_ready(Duration::from_secs(10)).await?;
            let fault = Instant::now();
            let _ = tokio::process::Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(a.to_string())
                .status()
                .await;
            let reply = trader
                .call(Request::hand_open("m1", "EURUSD", Side::Buy, 0.1))
                .await?;
            let ticket = reply["ticket"].as_i64().context("ticket")?;
            let mut seen = HashSet::new();
            while seen.len() < followers {
                let (login, t, at) = tokio::time::timeout_at(
                    fault + Duration::from_secs(30),
                    observer.arrivals.recv(),
                )
                .await
                .context("not served again")?
                .context("observer ended")?;
                if t == ticket && seen.insert(login) && seen.len() == followers {
                    samples.push(at - fault);
                }
            }
            trader.close();
            drop(observer);
            setup.stop().await;
        }
        let s = Stats::of(&samples);
        let name = if signal == "KILL" {
            "kill -9"
        } else {
            "SIGTERM (handoff)"
        };
        println!(
            "{name}: served again after {} (max {:.0} ms)",
            s.show(),
            s.max_ms
        );
        let _ = writeln!(
            md,
            "| {name} | {} ({}) | {:.0} ms | 3 s |",
            s.show(),
            s.runs,
            s.max_ms
        );
        report
            .failover
            .push(serde_json::json!({"fault": name, "served_again": s, "lease_ms": 3000}));
    }
    report.markdown.push(format!(
        "## Failover and handoff\n\nTwo node processes (lease 3 s, fence 1 s, cycle 500 ms), one master, {followers} followers spread by fair share. The node that started first is killed (`kill -9`) or stopped (SIGTERM) and the master opens a position at once; the time is from the signal until every follower has its copy (served again, not just owned). Floor for kill -9: the lease (3 s), which a crashed node's accounts must wait out.\n\n{md}"
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Rebalancing: scale out from one node to four; the time until the accounts are spread evenly.

async fn rebalance(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let runs = if options.smoke { 1 } else { 3 };
    let (masters, per_master) = if options.smoke { (1, 19) } else { (2, 99) };
    let accounts = masters * (1 + per_master);
    let timing = ["--lease", "3s", "--fence", "1s", "--cycle", "500ms"];
    let cycle = Duration::from_millis(500);
    let knobs = Knobs::default();
    let member = |i: usize| Member {
        node_id: format!("r{i}"),
        capacity: 100_000,
    };
    let mut samples: BTreeMap<usize, Vec<Duration>> = BTreeMap::new();
    for run in 0..runs {
        let mut setup =
            Setup::new(pg, &format!("bench_rebalance_{run}"), masters, per_master).await?;
        setup.spawn_node("r1", timing)?;
        setup
            .wait_settled(accounts, Duration::from_secs(60))
            .await?;
        for k in 2..=4usize {
            let members: Vec<Member> = (1..=k).map(member).collect();
            let joined = Instant::now();
            setup.spawn_node(&format!("r{k}"), timing)?;
            loop {
                let mut owned: BTreeMap<String, u32> = BTreeMap::new();
                for node in setup.owners().await?.into_values() {
                    *owned.entry(node).or_default() += 1;
                }
                if balance::balanced(&owned, &members, accounts as u64, knobs) {
                    samples.entry(k).or_default().push(joined.elapsed());
                    break;
                }
                if joined.elapsed() > Duration::from_secs(120) {
                    bail!("{k} nodes: not balanced 120 s after r{k} started: {owned:?}");
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        setup.stop().await;
    }
    let mut md = String::from(
        "| scale-out | accounts | step-limited bound | until balanced p50 / p99 (runs) | max | p50 in cycles |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for (&k, times) in &samples {
        // The design's bound: each of the k - 1 nodes hands off at most a step of its new share
        // per cycle, until it is within the margin of that share.
        let before = balance::shares(&(1..k).map(member).collect::<Vec<_>>(), accounts as u64);
        let after = balance::shares(&(1..=k).map(member).collect::<Vec<_>>(), accounts as u64);
        let bound = before
            .iter()
            .map(|(n, &was)| {
                let target = after[n];
                let step = ((target as f64 * knobs.step).round() as u32).max(1);
                was.saturating_sub(target + balance::margin(target, knobs))
                    .div_ceil(step)
            })
            .max()
            .unwrap_or(0);
        let st = Stats::of(times);
        let cycles = st.p50_ms / cycle.as_secs_f64() / 1000.0;
        println!(
            "rebalance {} -> {k} nodes: balanced after {} (max {:.0} ms, {cycles:.1} cycles; the hand-off steps alone take {bound} cycles, plus start-up and first sight of the new node)",
            k - 1,
            st.show(),
            st.max_ms
        );
        let _ = writeln!(
            md,
            "| {} → {k} nodes | {accounts} | {bound} cycles | {} ({}) | {:.0} ms | {cycles:.1} |",
            k - 1,
            st.show(),
            st.runs,
            st.max_ms
        );
        report.rebalance.push(serde_json::json!({"from_nodes": k - 1, "to_nodes": k, "accounts": accounts, "bound_cycles": bound, "until_balanced": st, "cycle_ms": cycle.as_millis() as u64}));
    }
    report.markdown.push(format!(
        "## Rebalancing\n\nScale-out under fair share: one node (lease 3 s, fence 1 s, cycle 500 ms) owns {accounts} accounts ({masters} masters, their followers); a second, third and fourth node start one at a time, each once the previous step is balanced ({runs} runs). The time is from the new node's start until every account is owned and every node is within its margin of its share (default knobs: margin and step a tenth of the share). Floor: the bound the design sets, the cycles the most loaded node needs to come within its margin at one step per cycle. The measured time also holds the new node's start-up and the cycle in which the others first see it, and is counted in nominal cycles: a node's cycle is 500 ms less jitter, so it can come in under the bound.\n\n{md}"
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Cost per account: one node process owning 1,000 and 10,000 accounts with live sessions.

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

fn cpu_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

async fn cpu_percent(pid: u32, over: Duration) -> f64 {
    let hz = 100.0; // USER_HZ on Linux
    let (t0, c0) = (Instant::now(), cpu_ticks(pid));
    tokio::time::sleep(over).await; // the measurement window
    let (secs, ticks) = (t0.elapsed().as_secs_f64(), cpu_ticks(pid) - c0);
    100.0 * ticks as f64 / hz / secs
}

async fn cost_per_account(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let sizes: &[usize] = if options.smoke {
        &[100]
    } else {
        &[1_000, 10_000]
    };
    let window = if options.smoke {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(10)
    };
    let mut md = String::from(
        "| accounts | resident memory per account | CPU idle | CPU while masters trade (10 orders/s) |\n|---:|---:|---:|---:|\n",
    );
    for &accounts in sizes {
        let masters = (accounts / 100).max(1);
        let followers_per_master = accounts / masters - 1;
        let total = masters * (followers_per_master + 1);
        // Baseline: the same node with no account.
        let mut empty = Setup::new(pg, &format!("bench_cost0_{accounts}"), 0, 0).await?;
        let pid0 = empty.spawn_node(
            "cost-empty",
            ["--lease", "60s", "--fence", "15s", "--cycle", "20s"],
        )?;
        tokio::time::sleep(Duration::from_secs(2)).await; // let it start
        let base = rss_kib(pid0);
        empty.stop().await;
        let mut setup = Setup::new(
            pg,
            &format!("bench_cost_{accounts}"),
            masters,
            followers_per_master,
        )
        .await?;
        let pid = setup.spawn_node(
            "cost",
            ["--lease", "60s", "--fence", "15s", "--cycle", "20s"],
        )?;
        setup.wait_settled(total, Duration::from_secs(600)).await?;
        let rss = rss_kib(pid);
        let per = (rss.saturating_sub(base) as f64 * 1024.0) / total as f64;
        let idle = cpu_percent(pid, window).await;
        let trader = BridgeClient::connect(setup.broker.addr.to_string(), "manual");
        trader.wait_ready(Duration::from_secs(10)).await?;
        let trading = {
            let addr_masters = masters;
            let t = trader.clone();
            let generator = tokio::spawn(async move {
                let mut open: Vec<(String, i64)> = Vec::new();
                loop {
                    let m = format!("m{}", fastrand::usize(1..=addr_masters));
                    if open.len() > 20 || (!open.is_empty() && fastrand::bool()) {
                        let (login, ticket) = open.swap_remove(fastrand::usize(..open.len()));
                        let _ = t
                            .call(Request::Close {
                                login,
                                fence: None,
                                ticket,
                                volume: None,
                                client_order_id: None,
                            })
                            .await;
                    } else if let Ok(v) = t
                        .call(Request::hand_open(&m, "EURUSD", Side::Buy, 0.1))
                        .await
                        && let Some(ticket) = v["ticket"].as_i64()
                    {
                        open.push((m, ticket));
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await; // 10 master orders per second
                }
            });
            let busy = cpu_percent(pid, window).await;
            generator.abort();
            busy
        };
        trader.close();
        println!(
            "cost: {total} accounts: {:.1} KiB per account, CPU idle {idle:.1} %, trading {trading:.1} %",
            per / 1024.0
        );
        let _ = writeln!(
            md,
            "| {total} | {:.1} KiB | {idle:.1} % | {trading:.1} % |",
            per / 1024.0
        );
        report.cost.push(serde_json::json!({"accounts": total, "rss_bytes_per_account": per, "rss_kib_total": rss, "rss_kib_empty": base, "cpu_idle_percent": idle, "cpu_trading_percent": trading}));
        setup.stop().await;
    }
    report.markdown.push(format!(
        "## Cost per account\n\nOne `copier-node run` process owning every account (1 master per 100 accounts, the rest followers), each with a live broker session on the simulated broker (one connection). Memory: resident set minus that of the same node owning nothing, per account. CPU: share of one core over {}s, idle and while masters trade 10 orders per second (target: under 64 KiB per account).\n\n{md}",
        window.as_secs()
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The notification path: publication throughput (commits carrying NOTIFY are serialised),
// delivery latency with 1, 10 and 100 listeners, and what a stalled listener does.

async fn notification_path(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let url = pg.database("bench_notify").await?;
    let window = if options.smoke {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(3)
    };
    let mut md = String::from("| publishers | events/s |\n|---:|---:|\n");
    for publishers in [1usize, 4, 16] {
        let mut tasks = Vec::new();
        let end = Instant::now() + window;
        for _ in 0..publishers {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let mut c = PgConnection::connect(&url).await?;
                let mut n = 0u64;
                while Instant::now() < end {
                    sqlx::query("SELECT pg_notify('bench_tp', 'x')")
                        .execute(&mut c)
                        .await?;
                    n += 1;
                }
                Ok::<_, anyhow::Error>(n)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        let rate = total as f64 / window.as_secs_f64();
        println!("notify throughput with {publishers} publishers: {rate:.0}/s");
        let _ = writeln!(md, "| {publishers} | {rate:.0} |");
        report
            .notify
            .push(serde_json::json!({"publishers": publishers, "events_per_second": rate}));
    }
    let mut md2 = String::from("| listeners | delivery p50 | p99 | max |\n|---:|---:|---:|---:|\n");
    let counts: &[usize] = if options.smoke {
        &[1, 10]
    } else {
        &[1, 10, 100]
    };
    let sends = if options.smoke { 10 } else { 50 };
    for &listeners in counts {
        let (samples, _) = deliveries(&url, listeners, sends, false).await?;
        let s = Stats::of(&samples);
        println!("notify delivery to {listeners} listeners: {}", s.show());
        let _ = writeln!(
            md2,
            "| {listeners} | {:.2} ms | {:.2} ms | {:.2} ms |",
            s.p50_ms, s.p99_ms, s.max_ms
        );
        report
            .notify
            .push(serde_json::json!({"listeners": listeners, "delivery": s}));
    }
    let (stalled_samples, usage) = deliveries(&url, 10, sends, true).await?;
    let st = Stats::of(&stalled_samples);
    println!(
        "with a stalled listener: delivery {}; queue usage {usage:.6}",
        st.show()
    );
    report.notify.push(serde_json::json!({"listeners": 10, "stalled_listener": true, "delivery": st, "queue_usage_after": usage}));
    report.markdown.push(format!(
        "## Notification path\n\nMaster events reach followers' nodes through PostgreSQL's NOTIFY: commits carrying a NOTIFY are serialised on one lock, so this is the ceiling on events per second across all masters ({}s windows, each publisher an autocommit `pg_notify`).\n\n{md}\nDelivery latency, from sending the NOTIFY to its arrival at each listening connection ({sends} notifications, every listener a sample):\n\n{md2}\nA stalled listener (a connection that LISTENs and stops reading): the others' delivery stays {} ms p50 / {} ms p99, so a node that stops reading its LISTEN connection delays no one. `pg_notification_queue_usage()` after the run: {usage:.6}; at this volume the stalled connection's socket buffers absorbed everything. A listener stalled for long holds back the tail of PostgreSQL's shared queue (as its documentation says), and when the 8 GB queue fills every NOTIFY fails: the node's hub reads continuously, and on an error logs `LISTEN connection lost; reconnecting` and reconnects (the next reconcile repairs what it missed).\n",
        window.as_secs_f64(),
        (st.p50_ms * 100.0).round() / 100.0,
        (st.p99_ms * 100.0).round() / 100.0
    ));
    Ok(())
}

/// Sends `sends` notifications to `listeners` connections; optionally one more connection
/// listens and never reads. Returns every delivery latency and the queue usage at the end.
async fn deliveries(
    url: &str,
    listeners: usize,
    sends: usize,
    stalled: bool,
) -> anyhow::Result<(Vec<Duration>, f64)> {
    let channel = format!("bench_delivery_{listeners}_{stalled}");
    let _stall = if stalled {
        let mut c = PgConnection::connect(url).await?;
        c.execute(format!("LISTEN {channel}").as_str()).await?;
        Some(c)
    } else {
        None
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Instant)>();
    let mut tasks = Vec::new();
    for _ in 0..listeners {
        let mut l = sqlx::postgres::PgListener::connect(url).await?;
        l.listen(&channel).await?;
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..sends {
                let n = l.recv().await?;
                let _ = tx.send((n.payload().parse().unwrap_or(0), Instant::now()));
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    let mut sender = PgConnection::connect(url).await?;
    let mut sent_at = Vec::new();
    for i in 0..sends {
        sent_at.push(Instant::now());
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(&channel)
            .bind(i.to_string())
            .execute(&mut sender)
            .await?;
        tokio::time::sleep(Duration::from_millis(5)).await; // spacing, so each delivery is measured on its own
    }
    let mut samples = Vec::new();
    for _ in 0..(listeners * sends) {
        let (i, at) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .context("deliveries")?
            .context("listener ended")?;
        samples.push(at.saturating_duration_since(sent_at[i]));
    }
    for t in tasks {
        t.await??;
    }
    let usage: f64 = sqlx::query_scalar("SELECT pg_notification_queue_usage()")
        .fetch_one(&mut sender)
        .await?;
    Ok((samples, usage))
}

// ---------------------------------------------------------------------------------------------

fn write(options: &Options, report: &Report) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(options.out.join("benchmarks.json"), json)?;
    let mut md = String::from("# Benchmarks\n\n");
    let _ = writeln!(
        md,
        "Measured by `cargo bench --bench copier` (the harness is `benches/copier.rs`; raw figures in `benchmarks.json`). Every figure is a median (p50) and a tail (p99) over repeated runs, with the run count, beside a floor measured in the same run. Reproduce with the same command; `-- --only <section>` runs one section (its results go to `target/bench-only/`).\n"
    );
    let _ = writeln!(
        md,
        "Machine: {} ({} cores, {} memory), PostgreSQL {}, {} build, {}. Everything runs on this one machine: PostgreSQL (a throwaway cluster with `fsync = off` and `full_page_writes = off`, so a commit waits for the WAL write but not for the disk; the floors are measured on the same cluster), the simulated broker, the node processes and the benchmark itself share its cores.\n",
        report.machine.get("cpu").cloned().unwrap_or_default(),
        report.machine.get("cores").cloned().unwrap_or_default(),
        report.machine.get("memory").cloned().unwrap_or_default(),
        report
            .machine
            .get("postgresql")
            .cloned()
            .unwrap_or_default(),
        report.machine.get("profile").cloned().unwrap_or_default(),
        report.machine.get("date").cloned().unwrap_or_default()
    );
    md.push_str("## Floors\n\n| floor | p50 / p99 | runs |\n|---|---:|---:|\n");
    for (name, s) in &report.floors {
        let _ = writeln!(md, "| {name} | {} | {} |", s.show(), s.runs);
    }
    md.push('\n');
    for section in &report.markdown {
        md.push_str(section);
        md.push('\n');
    }
    std::fs::write(options.out.join("BENCHMARKS.md"), md)?;
    println!("wrote {}", options.out.join("BENCHMARKS.md").display());
    Ok(())
}
