//! The multi-process fault suite: real `copier-node` processes, each behind its own chaos proxies
//! to PostgreSQL (one for its lease and write connections, one for LISTEN), one simulated broker
//! process as the witness, masters trading continuously, faults injected, and a checker that
//! reads the journal (`checker`). Scenarios are in `scenarios`.
//!
//! `COPIER_SUITE_ROUNDS=N` repeats every scenario N times with random timings (the long mode).

pub mod checker;
mod failover;
pub mod oracle;
mod patroni;
mod scenarios;

use std::collections::HashMap;
use std::time::Duration;

use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::{HistoryResult, PositionsResult, Request};
use copier_node::broker::types::{ClosedPosition, Position};
use copier_node::copier::rules::{Link, LotMode};
use copier_node::pgtmp::{Cluster, PgBinaries, as_postgres, prepare_dir};
use sqlx::Connection;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::support::broker::{BrokerProcess, Scratch};
use crate::support::chaos::{ChaosProxy, Mode};
use crate::support::patroni::Patroni;
use crate::support::process::{NodeProcess, NodeSpec};
use crate::support::{FAST, TestDb, Timing, add_account};

/// The suite's timings (lease 3 s, fence 1 s, cycle 500 ms).
pub const TIMING: Timing = FAST;
pub const FENCE_MS: i64 = 1000;
/// Clock and scheduling slack allowed in the S1 gap check.
pub const TOLERANCE_MS: i64 = 150;

/// How many times each scenario runs (`COPIER_SUITE_ROUNDS`, default 1).
pub fn rounds() -> usize {
    std::env::var("COPIER_SUITE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
        .max(1)
}

/// A random duration in [lo, hi] for the long mode (just `lo` in a single round).
pub fn jitter(lo: Duration, hi: Duration) -> Duration {
    if rounds() == 1 {
        lo
    } else {
        lo + (hi - lo).mul_f64(fastrand::f64())
    }
}

enum Database {
    Shared(TestDb),
    Private {
        cluster: Cluster,
        url: String,
        _dir: Scratch,
    },
    /// Two members under Patroni behind HAProxy ([`crate::support::patroni`]).
    Patroni {
        patroni: Patroni,
        _dir: Scratch,
    },
}

/// A streaming standby of a private cluster, made with `pg_basebackup`, replicating through a
/// chaos proxy: hanging it lets commits reach the primary only (asynchronous replication's lost
/// tail, on demand).
pub struct Standby {
    pub cluster: Cluster,
    pub replication: ChaosProxy,
    _dir: Scratch,
}

/// One node process and its proxies.
pub struct SuiteNode {
    pub id: String,
    pub process: NodeProcess,
    pub db_proxy: ChaosProxy,
    pub listen_proxy: ChaosProxy,
}

/// A copy link as the checker needs it.
#[derive(Debug, Clone)]
pub struct SuiteLink {
    pub link: Link,
    pub master_login: String,
    pub follower_id: i64,
    pub follower_login: String,
}

pub struct Suite {
    pub name: String,
    pub dir: Scratch,
    db: Database,
    pub broker: BrokerProcess,
    pub broker_port: u16,
    pub nodes: Vec<SuiteNode>,
    pub links: Vec<SuiteLink>,
    pub masters: Vec<String>,
    generator: Option<(CancellationToken, JoinHandle<usize>)>,
    started: Instant,
    /// Timings of the nodes started from now on, and the fence the checker holds them to.
    pub timing: crate::support::Timing,
    pub fence_ms: i64,
    pub standby: Option<Standby>,
    /// Releases the observer recorded before a fault took the database that held them.
    observed: Vec<checker::Release>,
    /// After a failover: the promoted standby's URL and address.
    promoted: Option<(String, String)>,
    /// The broker runs in MT4's ways (`--mt4`): the oracle reads its records through
    /// [`oracle::as_tickets_kept`].
    mt4: bool,
}

impl Suite {
    /// A suite on the shared test PostgreSQL.
    pub async fn new(name: &str, broker_args: &[&str]) -> Suite {
        let db = TestDb::new().await;
        Self::build(name, Database::Shared(db), broker_args).await
    }

    /// A suite on a PostgreSQL cluster of its own (for restarting it).
    pub async fn with_private_cluster(name: &str, broker_args: &[&str]) -> Suite {
        let dir = Scratch::new(&format!("{name}-pg"));
        let root = dir.0.join("pg");
        let bins = PgBinaries::find().unwrap();
        let cluster = tokio::task::spawn_blocking(move || {
            Cluster::init(&bins, &root).unwrap();
            Cluster::start(&bins, &root).unwrap()
        })
        .await
        .unwrap();
        let url = cluster.url("postgres");
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        copier_node::db::migrate::apply(&mut conn).await.unwrap();
        conn.close().await.unwrap();
        Self::build(
            name,
            Database::Private {
                cluster,
                url,
                _dir: dir,
            },
            broker_args,
        )
        .await
    }

    /// A suite on a Patroni cluster (two members, etcd, HAProxy): nodes reach the primary through
    /// HAProxy, whichever member it is.
    pub async fn on_patroni(name: &str, broker_args: &[&str], synchronous: bool) -> Suite {
        let dir = Scratch::new(&format!("{name}-patroni"));
        let root = dir.0.clone();
        let patroni = tokio::task::spawn_blocking(move || Patroni::start(&root, synchronous))
            .await
            .unwrap();
        let mut conn = tokio::time::timeout(
            Duration::from_secs(30),
            sqlx::PgConnection::connect(&patroni.url("postgres")),
        )
        .await
        .expect("connecting through HAProxy took over 30 s")
        .unwrap();
        tokio::time::timeout(
            Duration::from_secs(60),
            copier_node::db::migrate::apply(&mut conn),
        )
        .await
        .expect("migrating through HAProxy took over 60 s")
        .unwrap();
        conn.close().await.unwrap();
        Self::build(name, Database::Patroni { patroni, _dir: dir }, broker_args).await
    }

    /// The Patroni cluster (panics for other suites).
    pub fn patroni(&mut self) -> &mut Patroni {
        match &mut self.db {
            Database::Patroni { patroni, .. } => patroni,
            _ => panic!("this suite runs without Patroni"),
        }
    }

    async fn build(name: &str, db: Database, broker_args: &[&str]) -> Suite {
        let dir = Scratch::new(name);
        let broker_port = crate::support::broker::free_port();
        let mut args: Vec<String> = vec![
            "--state".into(),
            dir.path("broker-state.jsonl").display().to_string(),
        ];
        args.extend(broker_args.iter().map(|s| s.to_string()));
        let arg_refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let broker = BrokerProcess::spawn_on(&dir, broker_port, &arg_refs).await;
        let mut suite = Suite {
            name: name.to_string(),
            dir,
            db,
            broker,
            broker_port,
            nodes: Vec::new(),
            links: Vec::new(),
            masters: Vec::new(),
            generator: None,
            started: Instant::now(),
            mt4: broker_args.contains(&"--mt4"),
            timing: TIMING,
            fence_ms: FENCE_MS,
            standby: None,
            observed: Vec::new(),
            promoted: None,
        };
        suite.observe_ownership().await;
        suite.seed().await;
        suite
    }

    /// The checker's own observer of the lease rows: a trigger of this test (not the product's)
    /// records every change of an account's owner, by the database's clock, so that a release
    /// is known from the database itself and never from what a node says about itself.
    async fn observe_ownership(&self) {
        let mut conn = self.conn().await;
        for statement in [
            "CREATE TABLE suite_ownership (
                 at          timestamptz NOT NULL DEFAULT clock_timestamp(),
                 account_id  bigint NOT NULL,
                 login       text   NOT NULL,
                 from_node   text,
                 to_node     text,
                 owner_epoch bigint NOT NULL)",
            "CREATE FUNCTION suite_ownership_changed() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO suite_ownership (account_id, login, from_node, to_node, owner_epoch)
                 VALUES (NEW.id, NEW.login, OLD.node_id, NEW.node_id, NEW.owner_epoch);
                 RETURN NULL;
             END $$",
            "CREATE TRIGGER suite_ownership AFTER UPDATE ON trading_accounts FOR EACH ROW
             WHEN (OLD.node_id IS DISTINCT FROM NEW.node_id OR OLD.owner_epoch <> NEW.owner_epoch)
             EXECUTE FUNCTION suite_ownership_changed()",
        ] {
            sqlx::query(statement).execute(&mut conn).await.unwrap();
        }
    }

    /// The observer's record in the database now reachable: releases (an owner's row set free,
    /// `node_id` to NULL), with when.
    async fn read_releases(&self) -> Vec<checker::Release> {
        let Ok(Ok(mut conn)) = tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::PgConnection::connect(&self.url()),
        )
        .await
        else {
            return Vec::new();
        };
        let rows: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT login, from_node, (extract(epoch FROM at) * 1000)::bigint
               FROM suite_ownership WHERE from_node IS NOT NULL AND to_node IS NULL ORDER BY at",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap_or_default();
        rows.into_iter()
            .map(|(login, node, at_ms)| checker::Release { login, node, at_ms })
            .collect()
    }

    /// Keeps what the observer recorded so far outside the database: called before a fault
    /// that may take the primary (and the tail it never replicated) away, since a release it
    /// committed did happen, even if the promoted standby never received it.
    pub async fn keep_observed(&mut self) {
        for r in self.read_releases().await {
            if !self
                .observed
                .iter()
                .any(|o| o.login == r.login && o.node == r.node && o.at_ms == r.at_ms)
            {
                self.observed.push(r);
            }
        }
    }

    /// Every release the observer saw: the record kept before faults, and the database's now.
    pub async fn releases(&self) -> Vec<checker::Release> {
        let mut out = self.observed.clone();
        for r in self.read_releases().await {
            if !out
                .iter()
                .any(|o| o.login == r.login && o.node == r.node && o.at_ms == r.at_ms)
            {
                out.push(r);
            }
        }
        out
    }

    /// Every change of owner the observer saw: (login, from, to, at ms).
    pub async fn ownership_changes(&self) -> Vec<(String, Option<String>, Option<String>, i64)> {
        let mut conn = self.conn().await;
        sqlx::query_as(
            "SELECT login, from_node, to_node, (extract(epoch FROM at) * 1000)::bigint
               FROM suite_ownership WHERE from_node IS DISTINCT FROM to_node ORDER BY at",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap()
    }

    /// A suite on a private cluster with a streaming standby (see [`Standby`]), caught up.
    pub async fn with_standby(name: &str, broker_args: &[&str]) -> Suite {
        let mut s = Self::with_private_cluster(name, broker_args).await;
        let replication = ChaosProxy::start(s.server_addr()).await;
        let dir = Scratch::new(&format!("{name}-standby"));
        let root = dir.0.join("pg");
        let bins = PgBinaries::find().unwrap();
        let port = replication.port.to_string();
        let cluster = tokio::task::spawn_blocking(move || {
            prepare_dir(&root).unwrap();
            let out = as_postgres(&bins.tool("pg_basebackup"))
                .arg("-D")
                .arg(root.join("data"))
                .args(["-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
                .args(["-R", "-X", "stream", "-c", "fast"])
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "pg_basebackup failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            Cluster::start(&bins, &root).unwrap()
        })
        .await
        .unwrap();
        s.standby = Some(Standby {
            cluster,
            replication,
            _dir: dir,
        });
        s.standby_caught_up().await;
        s
    }

    /// Waits until the standby has replayed everything the primary has written.
    pub async fn standby_caught_up(&self) {
        let mut conn = self.conn().await;
        crate::support::eventually(
            format!("{}: the standby to catch up", self.name),
            Duration::from_secs(60),
            async || {
                let caught_up: bool = sqlx::query_scalar(
                    "SELECT coalesce(bool_and(replay_lsn >= pg_current_wal_lsn()), false)
                       FROM pg_stat_replication WHERE state = 'streaming'",
                )
                .fetch_one(&mut conn)
                .await
                .unwrap();
                caught_up.then_some(())
            },
        )
        .await;
    }

    /// From now on commits reach the primary only (the standby's replication hangs).
    pub fn cut_replication(&self) {
        self.standby
            .as_ref()
            .expect("a suite with a standby")
            .replication
            .set(Mode::Hang);
    }

    /// The primary dies (`immediate`, as a crash), the standby is promoted, and every node's
    /// proxies send new connections to it and cut the open ones (a hung proxy stays hung).
    /// Returns when the promoted standby accepts writes.
    pub async fn fail_over(&mut self) {
        self.keep_observed().await;
        let standby = self.standby.as_ref().expect("a suite with a standby");
        let primary = self.cluster().clone();
        let promoted = standby.cluster.clone();
        let bins = PgBinaries::find().unwrap();
        tokio::task::spawn_blocking(move || {
            primary.stop("immediate").unwrap();
            let out = as_postgres(&bins.tool("pg_ctl"))
                .arg("-D")
                .arg(promoted.root.join("data"))
                .args(["-w", "-t", "60", "promote"])
                .stdin(std::process::Stdio::null())
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "pg_ctl promote failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        })
        .await
        .unwrap();
        let addr = format!("127.0.0.1:{}", standby.cluster.port);
        self.promoted = Some((standby.cluster.url("postgres"), addr.clone()));
        for n in &self.nodes {
            n.db_proxy.retarget(addr.clone());
            n.listen_proxy.retarget(addr.clone());
        }
    }

    pub fn url(&self) -> String {
        if let Some((url, _)) = &self.promoted {
            return url.clone();
        }
        match &self.db {
            Database::Shared(db) => db.url.clone(),
            Database::Private { url, .. } => url.clone(),
            Database::Patroni { patroni, .. } => patroni.url("postgres"),
        }
    }

    fn server_addr(&self) -> String {
        if let Some((_, addr)) = &self.promoted {
            return addr.clone();
        }
        match &self.db {
            Database::Shared(db) => db.server_addr(),
            Database::Private { cluster, .. } => format!("127.0.0.1:{}", cluster.port),
            Database::Patroni { patroni, .. } => patroni.addr(),
        }
    }

    fn url_via(&self, port: u16) -> String {
        let url = self.url();
        let start = url.find("://").map(|i| i + 3).unwrap_or(0);
        let end = url[start..]
            .find('/')
            .map(|i| start + i)
            .unwrap_or(url.len());
        let authority = &url[start..end];
        let userinfo = authority
            .rsplit_once('@')
            .map(|(u, _)| format!("{u}@"))
            .unwrap_or_default();
        format!("{}{userinfo}127.0.0.1:{port}{}", &url[..start], &url[end..])
    }

    /// The private cluster (panics for suites on the shared one).
    pub fn cluster(&self) -> &Cluster {
        match &self.db {
            Database::Private { cluster, .. } => cluster,
            _ => panic!("this suite runs without a private cluster"),
        }
    }

    /// A connection to the suite's database (30 s to connect, so a connect that hangs fails and
    /// says so instead of stalling the scenario).
    pub async fn conn(&self) -> sqlx::PgConnection {
        tokio::time::timeout(
            Duration::from_secs(30),
            sqlx::PgConnection::connect(&self.url()),
        )
        .await
        .unwrap_or_else(|_| panic!("{}: connecting to the database took over 30 s", self.name))
        .unwrap()
    }

    /// Two masters (ids 1, 2: the lowest, so a node of capacity 2 started first owns them) with
    /// three followers each: plain, half-size, and reversed copies.
    async fn seed(&mut self) {
        let mut conn = self.conn().await;
        let addr = self.broker.addr.clone();
        for m in 1..=2 {
            let login = format!("m{m}");
            add_account(&mut conn, m, "master", &addr, &login).await;
            self.masters.push(login);
        }
        let mut follower = 3;
        for master in 1..=2i64 {
            for (lot_value, reverse) in [(1.0, false), (0.5, false), (1.0, true)] {
                let login = format!("f{follower}");
                add_account(&mut conn, follower, "follower", &addr, &login).await;
                let (link_id, magic): (i64, i64) = sqlx::query_as(
                    "INSERT INTO copy_links (master_id, follower_id, lot_value, reverse) VALUES ($1, $2, $3, $4) RETURNING id, magic",
                )
                .bind(master)
                .bind(follower)
                .bind(lot_value)
                .bind(reverse)
                .fetch_one(&mut conn)
                .await
                .unwrap();
                self.links.push(SuiteLink {
                    link: Link {
                        id: link_id,
                        master_id: master,
                        enabled: true,
                        magic,
                        lot_mode: LotMode::Multiplier,
                        lot_value,
                        reverse,
                        copy_sl_tp: true,
                        symbol_map: HashMap::new(),
                        // Every master position is eligible: links exist before any trade.
                        copy_existing: true,
                        created_at_ms: 0,
                        protections: Default::default(),
                    },
                    master_login: format!("m{master}"),
                    follower_id: follower,
                    follower_login: login,
                });
                follower += 1;
            }
        }
    }

    pub fn follower_ids(&self) -> Vec<i64> {
        self.links.iter().map(|l| l.follower_id).collect()
    }

    /// Starts a node process behind two fresh proxies.
    pub async fn start_node(
        &mut self,
        id: &str,
        capacity: u32,
        env: Vec<(String, String)>,
    ) -> usize {
        let db_proxy = ChaosProxy::start(self.server_addr()).await;
        let listen_proxy = ChaosProxy::start(self.server_addr()).await;
        let spec = NodeSpec {
            node_id: id.to_string(),
            capacity,
            timing: self.timing,
            database_url: self.url_via(db_proxy.port),
            listen_url: Some(self.url_via(listen_proxy.port)),
            env,
            extra: Vec::new(),
        };
        let process = NodeProcess::spawn_with(&spec);
        self.nodes.push(SuiteNode {
            id: id.to_string(),
            process,
            db_proxy,
            listen_proxy,
        });
        self.nodes.len() - 1
    }

    pub fn node(&mut self, id: &str) -> &mut SuiteNode {
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("no node {id}"))
    }

    /// Accounts each node owns under a live lease.
    pub async fn owners(&self) -> HashMap<i64, String> {
        let mut conn = self.conn().await;
        let rows: Vec<(i64, String)> = sqlx::query_as("SELECT id, node_id FROM trading_accounts WHERE node_id IS NOT NULL AND lease_until >= now()")
            .fetch_all(&mut conn)
            .await
            .unwrap_or_default();
        rows.into_iter().collect()
    }

    /// Waits until the accounts `ids` are all owned, none by a node in `not`; returns the time.
    pub async fn wait_owned_by_others(
        &self,
        ids: &[i64],
        not: &[&str],
        within: Duration,
    ) -> Duration {
        let since = Instant::now();
        loop {
            let owners = self.owners().await;
            if ids
                .iter()
                .all(|i| owners.get(i).is_some_and(|o| !not.contains(&o.as_str())))
            {
                return since.elapsed();
            }
            assert!(
                since.elapsed() < within,
                "{}: accounts {ids:?} not owned by other nodes within {within:?}: {owners:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until every account is owned and ownership has not changed for three cycle periods
    /// (at least a second: fair share settled); returns the owners.
    pub async fn wait_stable(&self) -> HashMap<i64, String> {
        // Moves go at most one per cycle period, each after its receiver's answer: unchanged
        // for three periods (at least 1 s) is settled, not a pause between two moves.
        let cycle = copier_node::config::parse_duration(self.timing.cycle).expect("a cycle");
        let settled = (cycle * 3).max(Duration::from_secs(1));
        let since = Instant::now();
        let mut previous = HashMap::new();
        let mut stable_since = Instant::now();
        loop {
            let now = self.owners().await;
            if now.len() != 8 || now != previous {
                stable_since = Instant::now();
            } else if stable_since.elapsed() >= settled {
                return now;
            }
            previous = now;
            assert!(
                since.elapsed() < Duration::from_secs(30),
                "{}: ownership never settled: {previous:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The node owning the most followers (ties: the lowest node id).
    pub async fn busiest_follower_node(&self) -> String {
        let mut count: std::collections::BTreeMap<String, usize> = Default::default();
        for (id, node) in self.owners().await {
            if id > 2 {
                *count.entry(node).or_insert(0) += 1;
            }
        }
        let max = count.values().copied().max().expect("followers are owned");
        count
            .into_iter()
            .find(|(_, n)| *n == max)
            .map(|(node, _)| node)
            .unwrap()
    }

    /// The accounts a node owns now.
    pub async fn owned_by(&self, node: &str) -> Vec<i64> {
        let mut ids: Vec<i64> = self
            .owners()
            .await
            .into_iter()
            .filter(|(_, o)| o == node)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Waits until every follower session has reconciled once.
    pub async fn wait_ready(&self) {
        let ids = self.follower_ids();
        let since = Instant::now();
        let mut conn = self.conn().await;
        loop {
            let ready: i64 = sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE id = ANY($1) AND status LIKE 'follower: master%'")
                .bind(&ids)
                .fetch_one(&mut conn)
                .await
                .unwrap();
            if ready == ids.len() as i64 {
                return;
            }
            assert!(
                since.elapsed() < Duration::from_secs(30),
                "{}: followers not ready",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the trade generator: every 150 ms a random open, modify, partial or full close on a
    /// random master.
    pub fn start_trading(&mut self) {
        let cancel = CancellationToken::new();
        let addr = self.broker.addr.clone();
        let masters = self.masters.clone();
        let token = cancel.clone();
        let task = tokio::spawn(async move {
            let client = BridgeClient::with_timeout(addr, "manual", Duration::from_secs(2));
            let mut accepted = 0;
            while !token.is_cancelled() {
                let login = masters[fastrand::usize(..masters.len())].clone();
                if copier_node::sim_broker::tools::random_trade(&client, &login).await {
                    accepted += 1;
                }
                tokio::select! {
                    _ = token.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(150)) => {}
                }
            }
            accepted
        });
        self.generator = Some((cancel, task));
    }

    /// Stops the generator; returns how many master orders it placed.
    pub async fn stop_trading(&mut self) -> usize {
        let Some((cancel, task)) = self.generator.take() else {
            return 0;
        };
        cancel.cancel();
        task.await.unwrap()
    }

    /// L3: waits until every follower's copies match its master's positions under the link's
    /// rules (nothing left to send); returns how long that took.
    pub async fn converged(&self, within: Duration) -> Duration {
        let since = Instant::now();
        let client =
            BridgeClient::with_timeout(self.broker.addr.clone(), "manual", Duration::from_secs(5));
        let mut last;
        loop {
            match self.pending(&client).await {
                Ok(pending) if pending.is_empty() => return since.elapsed(),
                Ok(pending) => last = pending.join("; "),
                Err(e) => last = e,
            }
            assert!(
                since.elapsed() < within,
                "{}: not converged within {within:?}: {last}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// What the followers still owe, by the independent oracle ([`oracle`]).
    async fn pending(&self, client: &BridgeClient) -> Result<Vec<String>, String> {
        let mut out = Vec::new();
        // On an MT4 broker: each ticket's comment as it was opened, by login (the journal).
        let lines = if self.mt4 {
            checker::load(&self.dir.path("journal.jsonl"))
        } else {
            Vec::new()
        };
        let kept = |login: &str, account: oracle::Account| {
            if !self.mt4 {
                return account;
            }
            let opened: HashMap<i64, String> = lines
                .iter()
                .filter(|l| l.login == login && l.action == "open" && l.accepted)
                .filter_map(|l| Some((l.ticket?, l.comment.clone().unwrap_or_default())))
                .collect();
            oracle::as_tickets_kept(&account, &opened)
        };
        for l in &self.links {
            let (m_open, m_hist) = read(client, &l.master_login).await?;
            let (f_open, f_hist) = read(client, &l.follower_login).await?;
            out.extend(oracle::owed(
                &oracle::Expect {
                    follower: l.follower_login.clone(),
                    magic: l.link.magic,
                    lot_value: l.link.lot_value,
                    reverse: l.link.reverse,
                },
                &kept(
                    &l.master_login,
                    oracle::Account {
                        open: m_open,
                        history: m_hist,
                    },
                ),
                &kept(
                    &l.follower_login,
                    oracle::Account {
                        open: f_open,
                        history: f_hist,
                    },
                ),
            ));
        }
        Ok(out)
    }

    /// The copy ledger against the broker's journal: every copy a node opened (an accepted open
    /// carrying a copy marker) has its ledger row, and every row names a copy the journal shows
    /// (an accepted open, or an accepted pending copy: its fill keeps the order's ticket).
    /// Copies whose reply was lost are recorded by the next reconcile: this waits for it.
    pub async fn ledger_matches_journal(&self, within: Duration) {
        let deadline = Instant::now() + within;
        let mut conn = self.conn().await;
        loop {
            let lines = checker::load(&self.dir.path("journal.jsonl"));
            let copies = |action: &str| -> std::collections::BTreeSet<(String, i64)> {
                lines
                    .iter()
                    .filter(|l| l.action == action && l.accepted && l.client != "manual")
                    .filter(|l| l.comment.as_deref().is_some_and(|c| c.starts_with("mc")))
                    .filter_map(|l| Some((l.login.clone(), l.ticket?)))
                    .collect()
            };
            let journal = copies("open");
            // A pending copy's fill keeps its ticket: its row names an accepted place.
            let placed = copies("place");
            let rows: Vec<(String, i64)> =
                sqlx::query_as("SELECT login, follower_ticket FROM copy_ledger")
                    .fetch_all(&mut conn)
                    .await
                    .unwrap();
            let ledger: std::collections::BTreeSet<(String, i64)> = rows.into_iter().collect();
            let missing: Vec<_> = journal.difference(&ledger).collect();
            let extra: Vec<_> = ledger
                .iter()
                .filter(|r| !journal.contains(*r) && !placed.contains(*r))
                .collect();
            if missing.is_empty() && extra.is_empty() {
                eprintln!(
                    "[{}] copy ledger: {} rows, one per copy in the journal",
                    self.name,
                    ledger.len()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{}: the copy ledger does not match the journal: copies without a row {missing:?}; rows without a copy {extra:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Checks the journal and prints the figures; returns the handovers seen. Releases are the
    /// observer's ([`Suite::releases`]), never the nodes' word.
    pub async fn check(&self, expect_stale_accepted: bool) -> Vec<checker::Handover> {
        let lines = checker::load(&self.dir.path("journal.jsonl"));
        let dups = checker::duplicates(&lines);
        let stale = checker::stale_accepted(&lines);
        let handovers = checker::handovers(&lines);
        let releases = self.releases().await;
        let violations =
            checker::single_owner_violations(&lines, self.fence_ms, TOLERANCE_MS, &releases);
        let node_orders = lines
            .iter()
            .filter(|l| l.client != "manual" && l.action != "login")
            .count();
        eprintln!(
            "[{}] {:.1}s: {} journal lines, {} node orders, {} handovers (min gap {} ms), {} stale orders rejected, {} accepted, {} duplicates",
            self.name,
            self.started.elapsed().as_secs_f64(),
            lines.len(),
            node_orders,
            handovers.len(),
            handovers
                .iter()
                .map(|h| h.gap_ms)
                .min()
                .map(|g| g.to_string())
                .unwrap_or_else(|| "-".into()),
            checker::stale_rejected(&lines),
            stale.len(),
            dups.len()
        );
        if !expect_stale_accepted {
            assert!(dups.is_empty(), "{}: S2 duplicates: {dups:?}", self.name);
            assert!(
                stale.is_empty(),
                "{}: stale orders accepted: {stale:?}",
                self.name
            );
            assert!(
                violations.is_empty(),
                "{}: S1 seen from the broker: {violations:?}",
                self.name
            );
        }
        handovers
    }
}

impl Drop for Suite {
    fn drop(&mut self) {
        // Nodes first (their processes are killed with them), then a private cluster.
        self.nodes.clear();
        if let Database::Private { cluster, .. } = &self.db {
            let _ = cluster.stop("immediate");
        }
        if let Some(standby) = &self.standby {
            let _ = standby.cluster.stop("immediate");
        }
    }
}

fn decode<T: serde::de::DeserializeOwned>(
    r: Result<serde_json::Value, copier_node::broker::BrokerError>,
) -> Result<T, String> {
    serde_json::from_value(r.map_err(|e| e.to_string())?).map_err(|e| e.to_string())
}

async fn read(
    client: &BridgeClient,
    login: &str,
) -> Result<(Vec<Position>, Vec<ClosedPosition>), String> {
    let p: PositionsResult = match client
        .call(Request::Positions {
            login: login.into(),
        })
        .await
    {
        Err(copier_node::broker::BrokerError::Rejected(r))
            if r.code == copier_node::broker::RejectCode::UnknownLogin =>
        {
            PositionsResult {
                positions: Vec::new(),
            }
        }
        other => decode(other)?,
    };
    let h: HistoryResult = match client
        .call(Request::History {
            login: login.into(),
        })
        .await
    {
        Err(copier_node::broker::BrokerError::Rejected(r))
            if r.code == copier_node::broker::RejectCode::UnknownLogin =>
        {
            HistoryResult {
                history: Vec::new(),
            }
        }
        other => decode(other)?,
    };
    Ok((p.positions, h.history))
}
