//! Copy latency across hand-offs: a master trading steadily while its followers change nodes (a
//! fair-share move as a second node joins; a SIGTERM hand-off), beside the same load with no
//! hand-off, with the copy ledger's legs of the same copies.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::time::Duration;

use crate::legs::{Legs, legs};
use crate::nodes::{Observer, Setup};
use crate::stats::Stats;
use crate::{Options, Pg, Report};
use anyhow::Context;
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use copier_node::broker::types::Side;
use serde::Serialize;
use tokio::time::Instant;

/// One scenario: every copy of a stream of master opens, timed.
#[derive(Serialize)]
pub(crate) struct HandoffRow {
    pub(crate) scenario: String,
    pub(crate) followers: usize,
    /// Follower accounts whose owner changed during the stream.
    pub(crate) moved: usize,
    pub(crate) copies: usize,
    /// Copies that had not arrived 30 s after the last master open.
    pub(crate) missed: usize,
    pub(crate) latency: Stats,
    /// The copies to the followers that moved (before, during and after their move).
    pub(crate) moved_latency: Stats,
    pub(crate) legs: Legs,
}

#[derive(Clone, Copy, PartialEq)]
enum Scenario {
    Steady,
    /// No hand-off, with the slow trade server of the rows below.
    SlowSteady,
    FairShareMove,
    Sigterm,
    /// A fair-share move with a broker whose login takes [`SLOW_LOGIN`]: the receiver logs in
    /// ahead of the release (prepared), or only after its claim (`--handoff-prepare 0s`).
    SlowLoginMove {
        prepared: bool,
    },
    /// A SIGTERM hand-off with that broker, prepared (each account copies on at the stopping
    /// node until its receiver has logged in ahead) or not (every gate closes at once).
    SlowLoginSigterm {
        prepared: bool,
    },
    /// A prepared SIGTERM hand-off with that broker of the node holding the master: the master
    /// moves too, so every follower's copies wait for its new session's first publication.
    SlowLoginSigtermMaster,
}

/// The slow trade server of the [`Scenario::SlowLoginMove`] rows: its login, and each read.
const SLOW_LOGIN: Duration = Duration::from_millis(300);
const SLOW_READ: Duration = Duration::from_millis(200);

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Scenario::Steady => "no hand-off (two nodes)",
            Scenario::SlowSteady => "no hand-off, slow trade server (two nodes)",
            Scenario::FairShareMove => "fair-share move (a second node joins)",
            Scenario::Sigterm => "SIGTERM hand-off (one of two nodes stops)",
            Scenario::SlowLoginMove { prepared: true } => {
                "fair-share move, slow trade server, prepared (default)"
            }
            Scenario::SlowLoginMove { prepared: false } => {
                "fair-share move, slow trade server, not prepared (`handoff_prepare = 0s`)"
            }
            Scenario::SlowLoginSigterm { prepared: true } => {
                "SIGTERM hand-off, slow trade server, prepared (default)"
            }
            Scenario::SlowLoginSigterm { prepared: false } => {
                "SIGTERM hand-off, slow trade server, not prepared (`handoff_prepare = 0s`)"
            }
            Scenario::SlowLoginSigtermMaster => {
                "SIGTERM hand-off of the master's node, slow trade server, prepared (default)"
            }
        }
    }

    /// On the slow trade server.
    fn slow(self) -> bool {
        matches!(
            self,
            Scenario::SlowSteady
                | Scenario::SlowLoginMove { .. }
                | Scenario::SlowLoginSigterm { .. }
                | Scenario::SlowLoginSigtermMaster
        )
    }

    /// A row where accounts change hands.
    fn moves_any(self) -> bool {
        !matches!(self, Scenario::Steady | Scenario::SlowSteady)
    }

    fn moves(self) -> bool {
        matches!(
            self,
            Scenario::FairShareMove | Scenario::SlowLoginMove { .. }
        )
    }
}

pub(crate) async fn handoff(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let followers = if options.smoke { 4 } else { 20 };
    let trades = if options.smoke { 10 } else { 60 };
    let spacing = Duration::from_millis(100);
    let timing = ["--lease", "3s", "--fence", "1s", "--cycle", "500ms"];
    let floor = report.floors["notify_delivery"].p50_ms + report.floors["broker_round_trip"].p50_ms;
    let mut md = String::from(
        "| scenario | followers moved | copies (missed) | copy latency p50 / p99 | max | p99 ÷ floor | moved followers' copies p50 / p99 | their p99 ÷ no hand-off's | master fill → event p50 / p99 | event → decided p50 / p99 | decided → accepted p50 / p99 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    // Each hand-off row's moved followers against the copies of the same load without one, on
    // the same broker (measured first in this run).
    let mut no_handoff_p99: HashMap<bool, f64> = HashMap::new();
    for (i, scenario) in [
        Scenario::Steady,
        Scenario::FairShareMove,
        Scenario::Sigterm,
        Scenario::SlowSteady,
        Scenario::SlowLoginMove { prepared: true },
        Scenario::SlowLoginMove { prepared: false },
        Scenario::SlowLoginSigterm { prepared: true },
        Scenario::SlowLoginSigterm { prepared: false },
        Scenario::SlowLoginSigtermMaster,
    ]
    .into_iter()
    .enumerate()
    {
        let slow_login = format!("{}ms", SLOW_LOGIN.as_millis());
        let slow_read = format!("{}ms", SLOW_READ.as_millis());
        let slow = scenario.slow();
        let broker_args: &[&str] = if slow {
            &["--login-delay", &slow_login, "--read-delay", &slow_read]
        } else {
            &[]
        };
        let mut setup =
            Setup::with_broker(pg, &format!("bench_handoff_{i}"), 1, followers, broker_args)
                .await?;
        let mut timing = timing.to_vec();
        if matches!(
            scenario,
            Scenario::SlowLoginMove { prepared: false }
                | Scenario::SlowLoginSigterm { prepared: false }
        ) {
            timing.extend(["--handoff-prepare", "0s"]);
        }
        let timing = timing.as_slice();
        let mut pids = HashMap::new();
        pids.insert("ha", setup.spawn_node("ha", timing.iter().copied())?);
        setup
            .wait_settled(followers + 1, Duration::from_secs(60))
            .await?;
        if !scenario.moves() {
            pids.insert("hb", setup.spawn_node("hb", timing.iter().copied())?);
            setup
                .wait_settled(followers + 1, Duration::from_secs(60))
                .await?;
        }
        let before = setup.owners().await?;
        // Which node a SIGTERM stops: where fair share left the master decides whether it moves
        // too, so each row names it (the one holding the master, or the other).
        let master_node = before
            .iter()
            .find(|(id, _)| **id < 1_000_000)
            .map(|(_, node)| node.clone())
            .context("the master is owned")?;
        let master_pid = pids[master_node.as_str()];
        let other_pid = pids
            .iter()
            .find(|(node, _)| **node != master_node)
            .map(|(_, pid)| *pid);
        let logins: Vec<String> = (1..=followers).map(|g| format!("f{g}")).collect();
        let mut observer = Observer::new(&setup.broker.addr.clone(), &logins).await?;
        let trader = BridgeClient::connect(setup.broker.addr.clone(), "manual");
        trader.wait_ready(Duration::from_secs(10)).await?;
        // A steady stream of master opens; the hand-off starts a fifth of the way in.
        let mut sent: HashMap<i64, Instant> = HashMap::new();
        let mut arrivals = Vec::new();
        for t in 0..trades {
            if t == trades / 5 {
                match scenario {
                    Scenario::Steady | Scenario::SlowSteady => {}
                    Scenario::FairShareMove | Scenario::SlowLoginMove { .. } => {
                        setup.spawn_node("hb", timing.iter().copied())?;
                    }
                    Scenario::Sigterm
                    | Scenario::SlowLoginSigterm { .. }
                    | Scenario::SlowLoginSigtermMaster => {
                        let pid = if scenario == Scenario::SlowLoginSigtermMaster {
                            master_pid
                        } else {
                            other_pid.context("two nodes run")?
                        };
                        let _ = tokio::process::Command::new("kill")
                            .arg("-TERM")
                            .arg(pid.to_string())
                            .status()
                            .await;
                    }
                }
            }
            let side = if t % 2 == 0 { Side::Buy } else { Side::Sell };
            let reply = trader
                .call(Request::hand_open("m1", "EURUSD", side, 0.1))
                .await?;
            sent.insert(reply["ticket"].as_i64().context("ticket")?, Instant::now());
            while let Ok(a) = observer.arrivals.try_recv() {
                arrivals.push(a);
            }
            tokio::time::sleep(spacing).await; // the stream's pace, not a synchronisation
        }
        let expected = trades * followers;
        let deadline = Instant::now() + Duration::from_secs(30);
        let arrived = |arrivals: &[(String, i64, Instant)]| {
            arrivals
                .iter()
                .filter(|(_, t, _)| sent.contains_key(t))
                .map(|(login, t, _)| (login.clone(), *t))
                .collect::<HashSet<_>>()
                .len()
        };
        while arrived(&arrivals) < expected {
            match tokio::time::timeout_at(deadline, observer.arrivals.recv()).await {
                Ok(Some(a)) => arrivals.push(a),
                _ => break,
            }
        }
        let mut seen = HashSet::new();
        let timed: Vec<(&str, Duration)> = arrivals
            .iter()
            .filter_map(|(login, t, at)| {
                let from = sent.get(t)?;
                seen.insert((login.clone(), *t))
                    .then(|| (login.as_str(), at.saturating_duration_since(*from)))
            })
            .collect();
        let samples: Vec<Duration> = timed.iter().map(|(_, d)| *d).collect();
        let after = setup.owners().await?;
        let moved_logins: HashSet<String> = before
            .iter()
            .filter(|(id, node)| **id >= 1_000_000 && after.get(id) != Some(*node))
            .map(|(id, _)| format!("f{}", id - 1_000_000))
            .collect();
        let moved = moved_logins.len();
        let s = Stats::of(&samples);
        let moved_s = Stats::of(
            &timed
                .iter()
                .filter(|(login, _)| moved_logins.contains(*login))
                .map(|(_, d)| *d)
                .collect::<Vec<_>>(),
        );
        if !scenario.moves_any() {
            no_handoff_p99.insert(slow, s.p99_ms);
        }
        let (moved_cell, ratio_cell) = if moved == 0 {
            ("–".to_string(), "–".to_string())
        } else {
            (
                moved_s.show(),
                no_handoff_p99
                    .get(&slow)
                    .map_or("–".into(), |p99| format!("{:.1}×", moved_s.p99_ms / p99)),
            )
        };
        let legs = legs(&setup.url, samples.len()).await?;
        let missed = expected - samples.len();
        println!(
            "{}: {} copies ({missed} missed), {moved} followers moved, latency {} (max {:.2} ms)",
            scenario.name(),
            samples.len(),
            s.show(),
            s.max_ms
        );
        let _ = writeln!(
            md,
            "| {} | {moved} | {} ({missed}) | {} | {:.2} ms | {:.1}× | {moved_cell} | {ratio_cell} | {} | {} | {} |",
            scenario.name(),
            samples.len(),
            s.show(),
            s.max_ms,
            s.p99_ms / floor,
            legs.fill_to_event.show(),
            legs.event_to_decision.show(),
            legs.decision_to_accept.show()
        );
        report.handoff.push(HandoffRow {
            scenario: scenario.name().to_string(),
            followers,
            moved,
            copies: samples.len(),
            missed,
            latency: s,
            moved_latency: moved_s,
            legs,
        });
        trader.close();
        drop(observer);
        setup.stop().await;
    }
    report.markdown.push(format!(
        "## Copy latency across hand-offs\n\nOne master and {followers} followers on node processes (lease 3 s, fence 1 s, cycle 500 ms); the master opens a position every {} ms, {trades} in all, and every follower's copy is timed from the master's order accepted to the copy's `opened` event at the benchmark (as in the copy latency section). A fifth of the way in: nothing (two nodes share the accounts by fair share throughout), a second node starts (the first hands it its fair share, prepared as below: each moved account is released by its owner once the newcomer has logged it in ahead or the preparation's bound passed, then claimed by the newcomer at once on the release's announcement), or one of two nodes gets SIGTERM (it hands each account to the other, prepared as below, and releases it; the other claims it at once): the node not holding the master, except in the last row, where the master's node stops and the master moves too, so every follower's copies wait for its new session's first publication. The legs are the same copies' from the copy ledger (millisecond clocks). A hand-off moves an account only after its old owner's gate closed and its release committed: the new owner's session logs in, reads the follower and its masters, and only then sends; the copies caught in between wait for it (the p99 and max). The last six rows use a slow trade server, whose every login takes {} ms and every read (positions, history, pending orders, account, symbols) {} ms (`sim-broker --login-delay --read-delay`, as a real trade server's take hundreds of milliseconds): the same load without a hand-off, then the fair-share move and the SIGTERM hand-off, each prepared (the default: the old owner offers each account to the node that will take it and copies on until that node has logged in without a fence and read the account ahead, then releases; the receiver raises the fence after its claim and starts from what it read, brought current by its stream) and not prepared (`--handoff-prepare 0s`: the receiver logs in and reads after its claim; on SIGTERM every gate closes at once), and last the SIGTERM of the master's node, prepared. The moved followers' copies are every copy to a follower whose owner changed, over the whole stream, and their p99 is set against the p99 of the row without a hand-off on the same broker. Floor: one NOTIFY delivered plus one broker round trip ({floor:.2} ms).\n\n{md}",
        spacing.as_millis(),
        SLOW_LOGIN.as_millis(),
        SLOW_READ.as_millis()
    ));
    Ok(())
}
