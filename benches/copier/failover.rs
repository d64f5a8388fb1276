//! Failover (kill -9) and hand-off (SIGTERM): until followers are served again.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::{Observer, Setup};
use crate::stats::Stats;
use crate::{Options, Pg, Report};
use anyhow::Context;
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::Side;
use serde::Serialize;
use tokio::time::Instant;

/// Time until followers are served again after a fault.
#[derive(Serialize)]
pub(crate) struct FailoverRow {
    pub(crate) fault: String,
    pub(crate) served_again: Stats,
    pub(crate) lease_ms: u64,
}

// ---------------------------------------------------------------------------------------------
// Failover and handoff: from kill -9 / SIGTERM of a node until every account it held is served
// again (a copy of a master order placed right after the fault reaches every follower).

pub(crate) async fn failover(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
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
        report.failover.push(FailoverRow {
            fault: name.to_string(),
            served_again: s,
            lease_ms: 3000,
        });
    }
    report.markdown.push(format!(
        "## Failover and handoff\n\nTwo node processes (lease 3 s, fence 1 s, cycle 500 ms), one master, {followers} followers spread by fair share. The node that started first is killed (`kill -9`) or stopped (SIGTERM) and the master opens a position at once; the time is from the signal until every follower has its copy (served again, not just owned). Floor for kill -9: the lease (3 s), which a crashed node's accounts must wait out.\n\n{md}"
    ));
    Ok(())
}
