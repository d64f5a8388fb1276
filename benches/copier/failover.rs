//! Failover (kill -9) and hand-off (SIGTERM): until the other node serves every follower.

use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::Setup;
use crate::stats::Stats;
use crate::trades::served_again;
use crate::{Options, Pg, Report};
use anyhow::Context;
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::Side;
use serde::Serialize;

/// Time until the other node serves every follower after a fault.
#[derive(Serialize)]
pub(crate) struct FailoverRow {
    pub(crate) fault: String,
    /// From the signal to the last copy of the first master trade that the other node copied to
    /// every follower (the broker's journal, which names each copy's sender).
    pub(crate) served_again: Stats,
    /// Every copy of the master trades placed from the signal until then: master fill to copy.
    pub(crate) copies_meanwhile: Stats,
    /// How many of those copies the signalled node sent.
    pub(crate) sent_by_the_signalled_node: usize,
    pub(crate) lease_ms: u64,
}

// ---------------------------------------------------------------------------------------------
// Failover and handoff: from kill -9 / SIGTERM of a node until the other node serves every
// follower (a copy of a master order, sent by the other node, reaches every follower).

pub(crate) async fn failover(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
    let runs = if options.smoke { 1 } else { 5 };
    let followers = 10;
    let mut md = String::from(
        "| fault | until the other node served every follower p50 / p99 (runs) | max | copies meanwhile p50 / p99 (copies) | of them sent by the signalled node | lease |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for signal in ["KILL", "TERM"] {
        let mut samples = Vec::new();
        let mut meanwhile = Vec::new();
        let mut by_signalled = 0;
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
            let trader = BridgeClient::connect(setup.broker.addr.clone(), "manual");
            trader.wait_ready(Duration::from_secs(10)).await?;
            let journal = setup.dir.join("journal.jsonl");
            let served = served_again(&journal, followers, ("fa", "fb"), a, signal, async || {
                trader
                    .call(Request::hand_open("m1", "EURUSD", Side::Buy, 0.1))
                    .await?["ticket"]
                    .as_i64()
                    .context("ticket")
            })
            .await?;
            samples.push(served.after);
            meanwhile.extend(served.meanwhile);
            by_signalled += served.by_the_signalled;
            trader.close();
            setup.stop().await;
        }
        let s = Stats::of(&samples);
        let m = Stats::of(&meanwhile);
        let name = if signal == "KILL" {
            "kill -9"
        } else {
            "SIGTERM (handoff)"
        };
        println!(
            "{name}: the other node served every follower after {} (max {:.0} ms); copies meanwhile {}, {by_signalled} sent by the signalled node",
            s.show(),
            s.max_ms,
            m.show()
        );
        let _ = writeln!(
            md,
            "| {name} | {} ({}) | {:.0} ms | {} ({}) | {by_signalled} | 3 s |",
            s.show(),
            s.runs,
            s.max_ms,
            m.show(),
            m.runs
        );
        report.failover.push(FailoverRow {
            fault: name.to_string(),
            served_again: s,
            copies_meanwhile: m,
            sent_by_the_signalled_node: by_signalled,
            lease_ms: 3000,
        });
    }
    report.markdown.push(format!(
        "## Failover and handoff\n\nTwo node processes (lease 3 s, fence 1 s, cycle 500 ms), one master, {followers} followers spread by fair share. The node that started first is killed (`kill -9`) or stopped (SIGTERM); from the signal on, the master opens a position, waits for every follower's copy and opens the next, until one is copied to every follower by the other node. The time runs from the signal (the benchmark's wall clock, read just before it sends the signal) to that position's last copy in the broker's journal (its `ts_us`, the same machine's wall clock, stamped as the broker takes the request). The journal names each copy's sender, so a copy the signalled node sent (a stopping node copies on while its prepared receiver logs in) does not count as served by the other. Every copy of those positions is also timed from the master's fill. Floor for kill -9: the lease (3 s), which a crashed node's accounts must wait out.\n\n{md}"
    ));
    Ok(())
}
