//! The floor for `n` copies: `n` market orders sent at once, with no copier in the way, by
//! separate OS processes (one per node of the row, each with one bridge connection, as a node's
//! follower sessions share the node's one connection per server) to the simulated broker in its
//! own process, as the copies are.
//!
//! A sender is this benchmark's own executable started again with `--floor-sender`: it logs its
//! share of the floor's accounts in (with a fence, as a node's follower sessions are; a task per
//! session takes the session's own position events, as the node's follower tasks do), says
//! `ready`, and then for each `open <marker> <buy|sell>` line on its stdin sends one market order
//! per session at once (the copies' marker comment and a client order id of the copies' form) and
//! answers `done <go> <replies>`: the instant it read the line and each reply's (Unix µs); `close`
//! closes them again (not timed). Each order is timed from its own sender's `go`, so the pipe and
//! the sender's wake-up are not in the floor (a node's decision starts its order the same way).

use std::collections::HashSet;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use crate::nodes::Observer;
use crate::stats::Stats;
use crate::trades::{between, opens_by_ticket};
use anyhow::{Context, bail};
use copier_node::broker::client::BridgeClient;
use copier_node::broker::types::{CloseOrder, OpenOrder, Side};
use copier_node::broker::{AccountLogin, Broker, TradeApi};
use copier_node::sim_broker::journal::JournalEntry;
use copier_node::wall_clock::unix_us;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::time::Instant;

/// A floor round's orders carry the copies' marker (`mc<id>`, so their frames are the copies'
/// size) with ids no master ticket reaches.
const FLOOR_MARKER: i64 = 1_000_000_000;

/// The floor's logins: `x0` .. `x<n-1>`.
fn login(i: usize) -> String {
    format!("x{i}")
}

/// One sender process, as the benchmark drives it.
struct Sender {
    child: Child,
    /// Taken (closed) to end the sender.
    stdin: Option<ChildStdin>,
    stdout: Lines<BufReader<ChildStdout>>,
}

impl Sender {
    async fn say(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .context("a floor sender already ended")?;
        stdin.write_all(format!("{line}\n").as_bytes()).await?;
        stdin.flush().await?;
        Ok(())
    }

    async fn hear(&mut self) -> anyhow::Result<String> {
        match tokio::time::timeout(Duration::from_secs(120), self.stdout.next_line()).await {
            Ok(Ok(Some(line))) => Ok(line),
            Ok(Ok(None)) => bail!("a floor sender ended: {:?}", self.child.try_wait()),
            Ok(Err(e)) => Err(e.into()),
            Err(_) => bail!("a floor sender did not answer within 120 s"),
        }
    }
}

/// The floor's rounds over one copy row: the senders, an observer watching every floor account
/// (the instrument that times the copies at the benchmark), and what each round measured.
pub(crate) struct OrdersFloor {
    senders: Vec<Sender>,
    observer: Observer,
    n: usize,
    /// The first floor account of each sender, and one past the last sender's.
    bounds: Vec<usize>,
    /// Each round's marker and each sender's `go` (Unix µs), for the journal's figures.
    starts: Vec<(i64, Vec<i64>)>,
    /// Every order's time to its reply, at its sender.
    each: Vec<Duration>,
    /// The last reply's, per round.
    last: Vec<Duration>,
    /// Every order's time to its `opened` event at the observer.
    each_observed: Vec<Duration>,
    /// The last `opened` event's, per round.
    last_observed: Vec<Duration>,
}

/// What a row's floor rounds measured.
pub(crate) struct FloorFigures {
    pub(crate) each: Stats,
    pub(crate) last: Stats,
    pub(crate) each_observed: Stats,
    pub(crate) last_observed: Stats,
    /// By the broker's journal alone: each order's acceptance, and the last's, from the round's
    /// start.
    pub(crate) each_journal: Stats,
    pub(crate) last_journal: Stats,
    /// The last order's by the journal, per round in order (to pair each with its trade).
    pub(crate) rounds_journal: Vec<Duration>,
}

impl OrdersFloor {
    /// Starts `senders` sender processes for `n` floor accounts on `broker`, and the observer.
    pub(crate) async fn start(
        broker: &str,
        n: usize,
        senders: usize,
    ) -> anyhow::Result<OrdersFloor> {
        let logins: Vec<String> = (0..n).map(login).collect();
        let observer = Observer::new(broker, &logins).await?;
        let exe = std::env::current_exe().context("the benchmark's own executable")?;
        let mut started = Vec::with_capacity(senders);
        let bounds: Vec<usize> = (0..=senders).map(|c| c * n / senders).collect();
        for c in 0..senders {
            let (from, to) = (bounds[c], bounds[c + 1]);
            let mut child = tokio::process::Command::new(&exe)
                .args(["--floor-sender", broker, &format!("floor{c}")])
                .args([from.to_string(), (to - from).to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .spawn()
                .context("starting a floor sender")?;
            let stdin = child.stdin.take().context("a sender's stdin")?;
            let stdout = BufReader::new(child.stdout.take().context("a sender's stdout")?).lines();
            started.push(Sender {
                child,
                stdin: Some(stdin),
                stdout,
            });
        }
        for s in &mut started {
            let line = s.hear().await?;
            anyhow::ensure!(line == "ready", "a floor sender said {line:?}, not ready");
        }
        Ok(OrdersFloor {
            senders: started,
            observer,
            n,
            bounds,
            starts: Vec::new(),
            each: Vec::new(),
            last: Vec::new(),
            each_observed: Vec::new(),
            last_observed: Vec::new(),
        })
    }

    /// One round: the time to its last `opened` event at the observer.
    pub(crate) async fn round(&mut self) -> anyhow::Result<Duration> {
        let side = if self.starts.len().is_multiple_of(2) {
            "buy"
        } else {
            "sell"
        };
        let marker = FLOOR_MARKER + self.starts.len() as i64;
        let start = Instant::now();
        for s in &mut self.senders {
            s.say(&format!("open {marker} {side}")).await?;
        }
        let deadline = start + Duration::from_secs(60);
        let mut seen = HashSet::new();
        let mut observed = Duration::ZERO;
        while seen.len() < self.n {
            let (login, t, at) = tokio::time::timeout_at(deadline, self.observer.arrivals.recv())
                .await
                .context("the floor's orders were not all observed")?
                .context("the floor's observer ended")?;
            if t == marker && seen.insert(login) {
                observed = at.saturating_duration_since(start);
                self.each_observed.push(observed);
            }
        }
        self.last_observed.push(observed);
        let mut slowest = Duration::ZERO;
        let mut gos = Vec::with_capacity(self.senders.len());
        for s in &mut self.senders {
            let line = s.hear().await?;
            let (go, replies) = line
                .strip_prefix("done ")
                .and_then(|rest| rest.split_once(' '))
                .with_context(|| format!("a floor sender said {line:?}, not done"))?;
            let go: i64 = go.parse().context("a sender's go")?;
            gos.push(go);
            for at in replies.split(',').filter(|r| !r.is_empty()) {
                let at: i64 = at.parse().context("a reply's instant")?;
                let took = between(go, at);
                slowest = slowest.max(took);
                self.each.push(took);
            }
        }
        self.last.push(slowest);
        self.starts.push((marker, gos));
        // Closed again, so the floor accounts' positions stay few (not timed).
        for s in &mut self.senders {
            s.say("close").await?;
        }
        for s in &mut self.senders {
            let line = s.hear().await?;
            anyhow::ensure!(line == "closed", "a floor sender said {line:?}, not closed");
        }
        Ok(observed)
    }

    /// Ends the senders; the figures, the journal's from `journal`.
    pub(crate) async fn close(mut self, journal: &[JournalEntry]) -> anyhow::Result<FloorFigures> {
        for s in &mut self.senders {
            s.stdin.take();
        }
        for s in &mut self.senders {
            if tokio::time::timeout(Duration::from_secs(10), s.child.wait())
                .await
                .is_err()
            {
                let _ = s.child.start_kill();
            }
        }
        let opens = opens_by_ticket(journal);
        let mut each_journal = Vec::new();
        let mut last_journal = Vec::new();
        for (marker, gos) in &self.starts {
            let orders = opens.get(marker).map(Vec::as_slice).unwrap_or_default();
            anyhow::ensure!(
                orders.len() == self.n,
                "the journal holds {} of the floor round {marker}'s {} orders",
                orders.len(),
                self.n
            );
            let mut took = Vec::with_capacity(orders.len());
            for (login, _, at) in orders {
                let i: usize = login
                    .strip_prefix('x')
                    .and_then(|i| i.parse().ok())
                    .with_context(|| format!("a floor order on {login}"))?;
                // Its sender: the one whose accounts run from bounds[c] to bounds[c + 1].
                let c = self.bounds.partition_point(|b| *b <= i) - 1;
                took.push(between(gos[c], *at));
            }
            last_journal.push(took.iter().copied().max().unwrap_or_default());
            each_journal.extend(took);
        }
        Ok(FloorFigures {
            each: Stats::of(&self.each),
            last: Stats::of(&self.last),
            each_observed: Stats::of(&self.each_observed),
            last_observed: Stats::of(&self.last_observed),
            each_journal: Stats::of(&each_journal),
            last_journal: Stats::of(&last_journal),
            rounds_journal: last_journal,
        })
    }
}

/// The sender process: `--floor-sender <broker> <client name> <first account> <accounts>`.
pub(crate) fn sender_main(args: &[String]) -> ! {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    match runtime.block_on(sender(args)) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("floor sender failed: {e:#}");
            std::process::exit(1)
        }
    }
}

async fn sender(args: &[String]) -> anyhow::Result<()> {
    let [broker, name, first, count] = args else {
        bail!("usage: --floor-sender <broker> <client name> <first account> <accounts>");
    };
    let first: usize = first.parse().context("first account")?;
    let count: usize = count.parse().context("accounts")?;
    let client = BridgeClient::connect(broker.clone(), name.clone());
    client.wait_ready(Duration::from_secs(10)).await?;
    let mut sessions: Vec<(usize, Arc<dyn TradeApi>)> = Vec::with_capacity(count);
    for i in first..first + count {
        let session = client
            .login(&AccountLogin {
                login: login(i),
                password: None,
                fence: Some(1),
                account_id: None,
            })
            .await?;
        sessions.push((i, session.api));
        // The session's own events, taken as they come (the node's follower task does so); the
        // stream ends with the session.
        let mut events = session.events;
        tokio::spawn(async move { while events.recv().await.is_some() {} });
    }
    let mut out = tokio::io::stdout();
    out.write_all(b"ready\n").await?;
    out.flush().await?;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut opened = Vec::new();
    while let Some(line) = lines.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["open", marker, side] => {
                let go = unix_us();
                let marker: i64 = marker.parse().context("marker")?;
                let side = if *side == "buy" {
                    Side::Buy
                } else {
                    Side::Sell
                };
                let mut sends = tokio::task::JoinSet::new();
                for (i, api) in &sessions {
                    let (i, api) = (*i, api.clone());
                    sends.spawn(async move {
                        let fill = api
                            .open(OpenOrder {
                                symbol: "EURUSD".into(),
                                side,
                                volume: 0.1,
                                sl: None,
                                tp: None,
                                magic: 0,
                                comment: format!("mc{marker}"),
                                client_order_id: Some(format!("l{i}-m{marker}-open")),
                                price_limit: None,
                            })
                            .await
                            .context("the floor's order")?;
                        Ok::<_, anyhow::Error>((api, fill.ticket, unix_us()))
                    });
                }
                let mut replies = Vec::with_capacity(sessions.len());
                while let Some(done) = sends.join_next().await {
                    let (api, ticket, at) = done??;
                    replies.push(at.to_string());
                    opened.push((api, ticket));
                }
                format!("done {go} {}", replies.join(","))
            }
            ["close"] => {
                let mut closes = tokio::task::JoinSet::new();
                for (api, ticket) in opened.drain(..) {
                    closes.spawn(async move {
                        api.close(CloseOrder {
                            ticket,
                            volume: None,
                            client_order_id: None,
                        })
                        .await
                    });
                }
                while let Some(done) = closes.join_next().await {
                    done??;
                }
                "closed".to_string()
            }
            _ => bail!("a floor sender cannot {line:?}"),
        };
        out.write_all(format!("{answer}\n").as_bytes()).await?;
        out.flush().await?;
    }
    client.close();
    Ok(())
}
