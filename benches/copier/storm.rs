//! Claim storms: many nodes starting at once against free accounts.

use std::collections::HashMap;
use std::time::Duration;

use crate::cycle::node_connection;
use crate::stats::Stats;
use crate::{Options, Pg, Report};
use anyhow::bail;
use copier_node::db::lease::{CycleParams, cycle};
use serde::Serialize;
use sqlx::{Connection, Executor, PgConnection};
use tokio::time::Instant;

/// One claim storm.
#[derive(Serialize)]
pub(crate) struct StormRow {
    pub(crate) nodes: usize,
    pub(crate) capacity: u32,
    pub(crate) rows: i64,
    pub(crate) time_to_all_owned: Stats,
    pub(crate) rows_per_node_min: usize,
    pub(crate) rows_per_node_max: usize,
    pub(crate) double_hand_outs: u32,
    pub(crate) max_cycles_per_node: u64,
    pub(crate) max_claiming_cycles_per_node: u64,
    /// Cycles that failed (a lock or statement timeout under the storm) and were run again, as a
    /// node runs a failed cycle again: over every run and node.
    pub(crate) failed_cycles: u64,
}

// ---------------------------------------------------------------------------------------------
// Claim storm: 64 nodes of capacity 2,000 start at once against 100,000 free accounts.

pub(crate) async fn claim_storm(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (nodes, capacity, rows) = if options.smoke {
        (8usize, 1000u32, 5_000i64)
    } else {
        (64, 2000, 100_000)
    };
    let runs = if options.smoke { 1 } else { 3 };
    let floor = report.floors["pg_single_row_update"].p50_ms;
    let mut times = Vec::new();
    let mut spreads = Vec::new();
    let (mut max_cycles, mut max_claiming, mut failed_cycles) = (0, 0, 0);
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
                let (mut cycles, mut claiming, mut failed) = (0, 0, 0u64);
                loop {
                    let params = CycleParams {
                        node_id: &node,
                        instance_id: "i",
                        platform: "mt5",
                        capacity,
                        claim_limit: capacity,
                        trust: Duration::from_secs(45),
                        owned: held.len() as u32,
                        starting: 0,
                        lease: Duration::from_secs(60),
                        held: &held,
                        claim: true,
                        kept: &[],
                    };
                    let out = match cycle(&mut c, &params).await {
                        Ok(out) => out,
                        // Nothing of a failed cycle was kept: run it again, as a node does.
                        Err(e) if failed < 100 => {
                            failed += 1;
                            eprintln!("claim storm: {node}'s cycle failed, run again: {e}");
                            continue;
                        }
                        Err(e) => return Err(anyhow::Error::from(e)),
                    };
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
                Ok::<_, anyhow::Error>((ids, cycles, claiming, failed, start.elapsed()))
            }));
        }
        let mut owner: HashMap<i64, usize> = HashMap::new();
        let mut per_node = Vec::new();
        let mut done = Duration::ZERO;
        for (i, t) in tasks.into_iter().enumerate() {
            let (ids, cycles, claiming, failed, at) = t.await??;
            failed_cycles += failed;
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
    report.storm.push(StormRow {
        nodes,
        capacity,
        rows,
        time_to_all_owned: s.clone(),
        rows_per_node_min: lo,
        rows_per_node_max: hi,
        double_hand_outs: 0,
        max_cycles_per_node: max_cycles,
        max_claiming_cycles_per_node: max_claiming,
        failed_cycles,
    });
    report.markdown.push(format!(
        "## Claim storm\n\n{nodes} nodes of capacity {capacity} run the cycle statement at once against {rows} free accounts, each cycling back to back until its claim comes back empty and nothing is left free ({runs} runs). Every returned row is recorded: **0 rows handed to two nodes**. A node's cycles that claimed something are counted apart from its empty retries (a node that found every free row locked by a concurrent claim retries at once here; a running node waits for its next cycle). A cycle that fails (its lock wait or statement cut by the node's bounds under the storm) is run again, as a node runs it again, and counted.\n\n| time until all owned p50 / p99 | rows per node (min – max) | cycles that claimed, per node (max) | cycles in all, per node (max) | cycles failed and run again (all runs) | floor: single-row UPDATE |\n|---:|---:|---:|---:|---:|---:|\n| {} | {lo} – {hi} | {max_claiming} | {max_cycles} | {failed_cycles} | {floor:.2} ms |\n\nThe claim itself is first come, first served: the first nodes to run fill to capacity and the last may start empty; fair share then evens the nodes out through bounded hand-offs (see [fair share](docs/operating.md#fair-share)). The time is the database's work for all the claims on this 2-core machine shared with every client; compare it with the default `cycle` (20 s).\n",
        s.show()
    ));
    Ok(())
}
