//! The lease cycle through PgBouncer (Debian's 1.18), beside the same cycle straight to
//! PostgreSQL in the same run: in session mode (the bounds SET once per connection) and in
//! transaction mode (every cycle one message: the bounds as `SET LOCAL` and the statement with
//! its parameters written in, `db::lease::cycle_on`). Floors: one `SELECT 1` round trip to PostgreSQL and
//! through PgBouncer.

use std::fmt::Write as _;
use std::time::Duration;

use crate::cycle::{fill, node_connection_with, steady_params};
use crate::stats::Stats;
use crate::{Options, Pg, Report};
use copier_node::db::lease::cycle_on;
use copier_node::db::{Pooler, Session, SessionBounds};
use copier_node::pgtmp::{PGBOUNCER, PgBouncer};
use serde::Serialize;
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

#[derive(Serialize)]
pub(crate) struct PoolerRow {
    pub(crate) path: String,
    pub(crate) owned: i64,
    pub(crate) cycle: Stats,
    pub(crate) select_1: Stats,
}

/// One `SELECT 1` round trip. Unnamed, so it is safe outside a transaction behind a
/// transaction pooler too.
async fn select_1(conn: &mut PgConnection) -> anyhow::Result<()> {
    sqlx::query("SELECT 1")
        .persistent(false)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub(crate) async fn pooler(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    if !std::path::Path::new(PGBOUNCER).exists() {
        println!("pooler: skipped, {PGBOUNCER} is not installed");
        report.markdown.push(format!(
            "## Lease cycle through PgBouncer\n\nNot measured: {PGBOUNCER} is not installed here.\n"
        ));
        return Ok(());
    }
    let (rows, owned) = if options.smoke {
        (10_000, 100)
    } else {
        (100_000, 1_000)
    };
    let runs = if options.smoke { 10 } else { 200 };
    let name = format!("bench_pooler_{owned}");
    let url = pg.database(&name).await?;
    let mut admin = PgConnection::connect(&url).await?;
    fill(&mut admin, "trading_accounts", rows, owned).await?;
    let held: Vec<i64> =
        sqlx::query_scalar("SELECT owner_epoch FROM trading_accounts WHERE node_id = 'x'")
            .fetch_all(&mut admin)
            .await?;
    let dir = std::env::temp_dir().join(format!("copier-bench-pgbouncer-{}", std::process::id()));
    let bounds = SessionBounds::for_fence(Duration::from_secs(60));
    let mut md = String::from(
        "| path | owned | cycle p50 / p99 | `SELECT 1` p50 / p99 | cycle ÷ direct cycle |\n|---|---:|---:|---:|---:|\n",
    );
    // The three paths side by side: every bouncer started and every connection open first,
    // then the cycles (and the `SELECT 1`s) taken in turns, one per path, so that whatever the
    // machine does meanwhile (a vacuum, another section's leftovers) weighs on each alike.
    let mut paths = Vec::new();
    for (path, mode) in [
        ("PostgreSQL directly", None),
        (
            "PgBouncer, session mode",
            Some(("session", Pooler::Session)),
        ),
        (
            "PgBouncer, transaction mode",
            Some(("transaction", Pooler::Transaction)),
        ),
    ] {
        let (bouncer, session, target) = match mode {
            None => (None, Session::direct(bounds), url.clone()),
            Some((pool_mode, pooler)) => {
                let server = url.clone();
                let d = dir.join(pool_mode);
                let b = tokio::task::spawn_blocking(move || {
                    PgBouncer::start(&d, &server, pool_mode, "extra_float_digits", 4)
                })
                .await??;
                let target = b.url(&name);
                (Some(b), Session { bounds, pooler }, target)
            }
        };
        let conn = node_connection_with(&target, session).await?;
        paths.push((path, session, conn, bouncer));
    }
    let params = steady_params(&held);
    let mut cycles: Vec<Vec<Duration>> = vec![Vec::new(); paths.len()];
    for i in 0..runs + 3 {
        for (k, (path, session, conn, _)) in paths.iter_mut().enumerate() {
            let t = Instant::now();
            let out = cycle_on(conn, session, &params).await?;
            if i >= 3 {
                cycles[k].push(t.elapsed());
            }
            anyhow::ensure!(
                out.owned.len() == held.len(),
                "{path}: the node kept {} of {} rows",
                out.owned.len(),
                held.len()
            );
        }
    }
    let mut selects: Vec<Vec<Duration>> = vec![Vec::new(); paths.len()];
    for i in 0..runs + 3 {
        for (k, (_, _, conn, _)) in paths.iter_mut().enumerate() {
            let t = Instant::now();
            select_1(conn).await?;
            if i >= 3 {
                selects[k].push(t.elapsed());
            }
        }
    }
    let direct_p50 = Stats::of(&cycles[0]).p50_ms;
    for (k, (path, _, conn, bouncer)) in paths.into_iter().enumerate() {
        let c = Stats::of(&cycles[k]);
        let s = Stats::of(&selects[k]);
        println!("pooler {path}: cycle {} select 1 {}", c.show(), s.show());
        let _ = writeln!(
            md,
            "| {path} | {owned} | {} | {} | {:.2}× |",
            c.show(),
            s.show(),
            c.p50_ms / direct_p50
        );
        report.pooler.push(PoolerRow {
            path: path.to_string(),
            owned,
            cycle: c,
            select_1: s,
        });
        conn.close().await?;
        drop(bouncer);
    }
    let _ = std::fs::remove_dir_all(&dir);
    admin.close().await?;
    report.markdown.push(format!(
        "## Lease cycle through PgBouncer\n\nOne node's whole cycle owning {owned} accounts (room for as many more) in a table of {rows} rows shaped as in \"Lease cycle\", {runs} cycles after 3 warm-up cycles on each path, one connection each, the paths taking turns cycle by cycle: straight to PostgreSQL, through PgBouncer 1.18 in session mode (`database_pooler = \"session\"`), and in transaction mode (`database_pooler = \"transaction\"`: each cycle is one simple-protocol message, `SET LOCAL` the bounds and the cycle statement with its parameters written in, one implicit transaction: one round trip as directly, with a parse and a plan each time where the direct connection reuses its prepared statement). Floor on each path: one `SELECT 1` round trip, p50 and p99 over {runs}, in turns as well.\n\n{md}"
    ));
    Ok(())
}
