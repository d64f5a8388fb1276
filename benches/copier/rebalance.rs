//! Rebalancing on scale-out under fair share.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::Setup;
use crate::stats::Stats;
use crate::{Options, Pg, Report};
use anyhow::bail;
use copier_node::lease::balance::{self, Knobs, Member};
use serde::Serialize;
use tokio::time::Instant;

/// One scale-out step under fair share.
#[derive(Serialize)]
pub(crate) struct RebalanceRow {
    pub(crate) from_nodes: usize,
    pub(crate) to_nodes: usize,
    pub(crate) accounts: usize,
    pub(crate) bound_cycles: u32,
    pub(crate) until_balanced: Stats,
    pub(crate) cycle_ms: u64,
}

// ---------------------------------------------------------------------------------------------
// Rebalancing: scale out from one node to four; the time until the accounts are spread evenly.

pub(crate) async fn rebalance(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
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
        report.rebalance.push(RebalanceRow {
            from_nodes: k - 1,
            to_nodes: k,
            accounts,
            bound_cycles: bound,
            until_balanced: st,
            cycle_ms: cycle.as_millis() as u64,
        });
    }
    report.markdown.push(format!(
        "## Rebalancing\n\nScale-out under fair share: one node (lease 3 s, fence 1 s, cycle 500 ms) owns {accounts} accounts ({masters} masters, their followers); a second, third and fourth node start one at a time, each once the previous step is balanced ({runs} runs). The time is from the new node's start until every account is owned and every node is within its margin of its share (default knobs: margin and step a tenth of the share). Floor: the bound the design sets, the cycles the most loaded node needs to come within its margin at one step per cycle. The measured time also holds the new node's start-up and the cycle in which the others first see it, and is counted in nominal cycles: a node's cycle is 500 ms less jitter, so it can come in under the bound.\n\n{md}"
    ));
    Ok(())
}
