//! Node processes and accounts for the copy, failover, rebalance and cost sections.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::Pg;
use anyhow::{Context, bail};
use copier_node::broker::client::BridgeClient;
use copier_node::broker::types::PositionChange;
use copier_node::broker::{AccountLogin, Broker, SessionEvent};
use sqlx::{Connection, PgConnection};
use tokio::time::Instant;

/// The node binary the benchmark runs (`COPIER_BENCH_NODE`: another build of it, for A/B runs).
fn node_binary() -> std::ffi::OsString {
    std::env::var_os("COPIER_BENCH_NODE")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_copier-node").into())
}

/// The simulated broker as a process of its own (`copier-node sim-broker serve`), as the nodes
/// are: no benchmark task shares its runtime.
pub(crate) struct BrokerProcess {
    child: tokio::process::Child,
    pub(crate) addr: String,
}

impl BrokerProcess {
    /// Starts it on a free port with its journal at `dir/journal.jsonl` and its log at
    /// `dir/broker.log`; `args` are more `serve` flags.
    pub(crate) async fn start(
        dir: &std::path::Path,
        args: &[&str],
    ) -> anyhow::Result<BrokerProcess> {
        let log_path = dir.join("broker.log");
        let log = std::fs::File::create(&log_path)?;
        // This build's broker, also in A/B runs of another build's nodes.
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_copier-node"))
            .args([
                "sim-broker",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--journal",
            ])
            .arg(dir.join("journal.jsonl"))
            .args(args)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            if let Some(rest) = text.split("sim-broker listening on ").nth(1) {
                let addr = rest
                    .split_whitespace()
                    .next()
                    .context("the broker's address")?;
                return Ok(BrokerProcess {
                    child,
                    addr: addr.to_string(),
                });
            }
            if let Some(status) = child.try_wait()? {
                bail!("the simulated broker exited ({status}): {text}");
            }
            if Instant::now() > deadline {
                bail!("the simulated broker did not start within 20 s: {text}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGTERM, then wait (at most 10 s, then kill).
    pub(crate) async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = tokio::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Node processes and accounts for the copy, failover and cost benchmarks.

pub(crate) struct Setup {
    pub(crate) url: String,
    pub(crate) broker: BrokerProcess,
    pub(crate) dir: PathBuf,
    pub(crate) nodes: Vec<tokio::process::Child>,
}

impl Setup {
    pub(crate) async fn new(
        pg: &Pg,
        name: &str,
        masters: usize,
        followers_per_master: usize,
    ) -> anyhow::Result<Setup> {
        Self::with_broker(pg, name, masters, followers_per_master, &[]).await
    }

    /// As [`Setup::new`], with more flags for the simulated broker (`sim-broker serve`).
    pub(crate) async fn with_broker(
        pg: &Pg,
        name: &str,
        masters: usize,
        followers_per_master: usize,
        broker_args: &[&str],
    ) -> anyhow::Result<Setup> {
        let url = pg.database(name).await?;
        let dir = std::env::temp_dir().join(format!("copier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let broker = BrokerProcess::start(&dir, broker_args).await?;
        let mut conn = PgConnection::connect(&url).await?;
        let server = broker.addr.clone();
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

    pub(crate) fn spawn_node<'a>(
        &mut self,
        id: &str,
        timing: impl IntoIterator<Item = &'a str>,
    ) -> anyhow::Result<u32> {
        self.spawn_node_with(id, 100_000, timing)
    }

    /// As [`Setup::spawn_node`], with a capacity of `capacity` accounts.
    pub(crate) fn spawn_node_with<'a>(
        &mut self,
        id: &str,
        capacity: usize,
        timing: impl IntoIterator<Item = &'a str>,
    ) -> anyhow::Result<u32> {
        let log = std::fs::File::create(self.dir.join(format!("{id}.log")))?;
        let child = tokio::process::Command::new(node_binary())
            .args([
                "run",
                "--platform",
                "mt5",
                "--node-id",
                id,
                "--capacity",
                &capacity.to_string(),
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(timing)
            .env("COPIER_DATABASE_URL", &self.url)
            .env_remove("DATABASE_URL")
            // The benchmark's own settings are not the node's: a `COPIER_` variable that names
            // no configuration key is a warning the run would count against the node.
            .env_remove("COPIER_BENCH_KEEP")
            .env_remove("COPIER_BENCH_NODE_LOG")
            .env_remove("COPIER_BENCH_NODE")
            // `COPIER_BENCH_NODE_LOG=warn,copier_node::lease=debug`: more of the nodes' logs,
            // while looking into a run (warnings are counted by level, whatever else is logged).
            .env(
                "RUST_LOG",
                std::env::var("COPIER_BENCH_NODE_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let pid = child.id().unwrap_or(0);
        self.nodes.push(child);
        Ok(pid)
    }

    pub(crate) async fn owners(&self) -> anyhow::Result<HashMap<i64, String>> {
        let mut c = PgConnection::connect(&self.url).await?;
        let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, node_id FROM trading_accounts WHERE node_id IS NOT NULL AND lease_until >= now()").fetch_all(&mut c).await?;
        c.close().await?;
        Ok(rows.into_iter().collect())
    }

    /// Waits until every account is owned, every follower session has reconciled, and ownership
    /// has been still for a second.
    pub(crate) async fn wait_settled(
        &self,
        accounts: usize,
        within: Duration,
    ) -> anyhow::Result<()> {
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

    pub(crate) async fn stop(mut self) {
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
        // `COPIER_BENCH_KEEP=1` keeps the logs and the journal, while looking into a run.
        if std::env::var_os("COPIER_BENCH_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Watches the followers' position streams: the instant each copy of a master ticket opened.
pub(crate) struct Observer {
    pub(crate) _client: BridgeClient,
    pub(crate) arrivals: tokio::sync::mpsc::UnboundedReceiver<(String, i64, Instant)>,
}

impl Observer {
    pub(crate) async fn new(addr: &str, logins: &[String]) -> anyhow::Result<Observer> {
        let client = BridgeClient::connect(addr.to_string(), "bench-observer");
        client.wait_ready(Duration::from_secs(10)).await?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for login in logins {
            let mut session = client
                .login(&AccountLogin {
                    login: login.clone(),
                    password: None,
                    fence: None,
                    account_id: None,
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
