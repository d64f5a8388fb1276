//! Memory and CPU per account.

use std::fmt::Write as _;
use std::time::Duration;

use crate::nodes::Setup;
use crate::{Options, Pg, Report};
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::Side;
use serde::Serialize;
use tokio::time::Instant;

/// Memory and CPU per account.
#[derive(Serialize)]
pub(crate) struct CostRow {
    pub(crate) accounts: usize,
    pub(crate) rss_bytes_per_account: f64,
    pub(crate) rss_kib_total: u64,
    pub(crate) rss_kib_empty: u64,
    pub(crate) cpu_idle_percent: f64,
    pub(crate) cpu_trading_percent: f64,
}

// ---------------------------------------------------------------------------------------------
// Cost per account: one node process owning 1,000 and 10,000 accounts with live sessions.

pub(crate) fn rss_kib(pid: u32) -> u64 {
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

pub(crate) fn cpu_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

pub(crate) async fn cpu_percent(pid: u32, over: Duration) -> f64 {
    let hz = 100.0; // USER_HZ on Linux
    let (t0, c0) = (Instant::now(), cpu_ticks(pid));
    tokio::time::sleep(over).await; // the measurement window
    let (secs, ticks) = (t0.elapsed().as_secs_f64(), cpu_ticks(pid) - c0);
    100.0 * ticks as f64 / hz / secs
}

pub(crate) async fn cost_per_account(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
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
        let trader = BridgeClient::connect(setup.broker.addr.clone(), "manual");
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
        report.cost.push(CostRow {
            accounts: total,
            rss_bytes_per_account: per,
            rss_kib_total: rss,
            rss_kib_empty: base,
            cpu_idle_percent: idle,
            cpu_trading_percent: trading,
        });
        setup.stop().await;
    }
    report.markdown.push(format!(
        "## Cost per account\n\nOne `copier-node run` process owning every account (1 master per 100 accounts, the rest followers), each with a live broker session on the simulated broker (one connection). Memory: resident set minus that of the same node owning nothing, per account. CPU: share of one core over {}s, idle and while masters trade 10 orders per second (target: under 64 KiB per account).\n\n{md}",
        window.as_secs()
    ));
    Ok(())
}
