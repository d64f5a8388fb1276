//! The lease cycle's cost, ours beside the seed's statements.

use std::fmt::Write as _;
use std::time::Duration;

use crate::stats::Stats;
use crate::{Options, Pg, Report};
use copier_node::db;
use copier_node::db::lease::{CycleParams, cycle};
use serde::Serialize;
use sqlx::{Connection, Executor, PgConnection, Row};
use tokio::time::Instant;

/// One lease-cycle measurement (`benchmarks.json`'s `cycle`).
#[derive(Serialize)]
pub(crate) struct CycleRow {
    pub(crate) table_rows: i64,
    pub(crate) owned: i64,
    pub(crate) node: Stats,
    pub(crate) seed: Stats,
    pub(crate) rows_written_per_cycle: f64,
    pub(crate) dead_tuples_per_cycle: f64,
    pub(crate) hot_percent: f64,
}

// ---------------------------------------------------------------------------------------------
// Lease cycle: one node's whole cycle owning 100 / 1,000 / 10,000 accounts in tables of 10k,
// 100k and 1M rows, its own SQL beside the seed's statements on its bare schema.

pub(crate) const SEED_RENEW: &str = "UPDATE seed_accounts SET lease_until = now() + make_interval(secs => 60) WHERE node_id = $1 AND platform = $2 AND enabled";
pub(crate) const SEED_CLAIM: &str = "UPDATE seed_accounts SET node_id = $1, lease_until = now() + make_interval(secs => 60)
    WHERE id IN (SELECT id FROM seed_accounts WHERE platform = $2 AND enabled AND (node_id IS NULL OR lease_until IS NULL OR lease_until < now())
                 ORDER BY id LIMIT $3 FOR UPDATE SKIP LOCKED)";
pub(crate) const SEED_READ: &str =
    "SELECT id FROM seed_accounts WHERE node_id = $1 AND platform = $2 AND enabled";

/// A connection with a running node's session settings (`db::node_options`: bounds for a
/// generous fence, durable commits, no JIT), so the cycle is measured as a node runs it.
pub(crate) async fn node_connection(url: &str) -> anyhow::Result<PgConnection> {
    let session = db::Session::direct(db::SessionBounds::for_fence(Duration::from_secs(60)));
    node_connection_with(url, session).await
}

/// As [`node_connection`], for `session` (behind a pooler: the bounds set as the node sets them).
pub(crate) async fn node_connection_with(
    url: &str,
    session: db::Session,
) -> anyhow::Result<PgConnection> {
    let options = db::node_options(&copier_node::config::Secret::new(url), "bench", session)?;
    let mut conn = sqlx::ConnectOptions::connect(&options).await?;
    db::open_session(&mut conn, &session).await?;
    Ok(conn)
}

/// The measured node `x`'s cycle in a steady state: holding `held`, with room to claim as many
/// more (the claim runs, and finds nothing when every enabled row is owned).
pub(crate) fn steady_params(held: &[i64]) -> CycleParams<'_> {
    CycleParams {
        node_id: "x",
        instance_id: "ix",
        platform: "mt5",
        capacity: 2 * held.len() as u32,
        claim_limit: 2 * held.len() as u32,
        trust: Duration::from_secs(45),
        owned: held.len() as u32,
        starting: 0,
        lease: Duration::from_secs(60),
        held,
        claim: true,
        kept: &[],
    }
}

pub(crate) async fn fill(
    conn: &mut PgConnection,
    table: &str,
    rows: i64,
    owned: i64,
) -> anyhow::Result<()> {
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

pub(crate) async fn table_stats(
    conn: &mut PgConnection,
    table: &str,
) -> anyhow::Result<(i64, i64, i64)> {
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
pub(crate) async fn settled_stats(
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

pub(crate) async fn lease_cycle(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
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
            // Room to claim, as a running node usually has.
            let params = steady_params(&held);
            // The fill's own update (`owned` rows, not HOT: it sets node_id) is counted before
            // the window opens: flushed late, it landed among the measured cycles (a run read
            // 98 % HOT renewals and 250 dead tuples a cycle at 10,000 owned of 1M rows).
            let initial =
                settled_stats(&mut conn, &mut node, "trading_accounts", (0, 0, 0), owned).await?;
            // Warm-up (prepares the statement, warms the cache), then measure.
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
            // The seed's statements on its bare schema (primary key only), same data.
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
            report.cycle.push(CycleRow {
                table_rows: rows,
                owned,
                node: o,
                seed: s,
                rows_written_per_cycle: written,
                dead_tuples_per_cycle: dead,
                hot_percent: hot_pct,
            });
            drop(node);
            conn.close().await?;
        }
    }
    report.markdown.push(format!(
        "## Lease cycle\n\nOne node's whole cycle (one statement: membership, renewal, claim, read-back) owning N accounts, with room for N more, in a table of M rows shaped like a large deployment's (80 % on the node's platform, 5 % disabled, every enabled row owned by one of 100 live nodes), {runs} cycles each after 3 warm-up cycles; beside it the original design's literal statements (renew, claim with `ORDER BY id LIMIT`, read back, in one transaction) on its bare schema (primary key only), same data. Floor: one single-row UPDATE round trip, p50 {floor:.2} ms. Rows written, dead tuples and HOT share from `pg_stat_user_tables` over the measured cycles.\n\n{md}"
    ));
    Ok(())
}
