//! Helpers shared by the integration tests: a real PostgreSQL per test, nodes in-process (in
//! this runtime, or in a runtime of their own that a test can drop to simulate a crash) and as
//! real processes, and polling with a deadline.

pub mod broker;
pub mod chaos;
pub mod deadline;
pub mod faults;
pub mod fix;
pub mod fixture;
pub mod http;
pub mod patroni;
pub mod pg;
pub mod pgbouncer;
pub mod process;

use std::collections::BTreeMap;
use std::fmt::Display;
use std::sync::Once;
use std::time::Duration;

use copier_node::app::{self, NodeHandle, RunOptions};
use copier_node::broker::types::{ClosedPosition, Position, Side};
use copier_node::broker::{BrokerError, RejectCode};
use copier_node::config::{Config, Layers};
use copier_node::lease::NodeState;
use copier_node::sim_broker::tools::{self, HandOrder};
use sqlx::PgConnection;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use pg::TestDb;

/// Lease timings of a test node.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub lease: &'static str,
    pub fence: &'static str,
    pub cycle: &'static str,
}

/// Short timings for tests (e.g. lease 3 s, fence 1 s, cycle 500 ms).
pub const FAST: Timing = Timing {
    lease: "3s",
    fence: "1s",
    cycle: "500ms",
};

/// Logs go to a sink unless `TEST_LOG` is set.
pub fn init_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new("debug,sqlx=warn"))
                .with_test_writer()
                .try_init();
        }
    });
}

/// A node configuration for tests, built through the real configuration layers.
pub fn config(db: &TestDb, node_id: &str, capacity: u32, timing: Timing) -> Config {
    config_url(&db.url, node_id, capacity, timing)
}

/// As [`config`], reaching the database at `url` (e.g. through a chaos proxy).
pub fn config_url(url: &str, node_id: &str, capacity: u32, timing: Timing) -> Config {
    config_listen(url, url, node_id, capacity, timing)
}

/// As [`config_url`], with LISTEN on `listen_url`.
pub fn config_listen(
    url: &str,
    listen_url: &str,
    node_id: &str,
    capacity: u32,
    timing: Timing,
) -> Config {
    let flags = [
        ("database_url", Some(url.to_string())),
        ("listen_database_url", Some(listen_url.to_string())),
        ("platform", Some("mt5".to_string())),
        ("node_id", Some(node_id.to_string())),
        ("capacity", Some(capacity.to_string())),
        ("lease", Some(timing.lease.to_string())),
        ("fence", Some(timing.fence.to_string())),
        ("cycle", Some(timing.cycle.to_string())),
        ("http_listen", Some("127.0.0.1:0".to_string())),
    ];
    Layers::load(None, std::iter::empty(), &flags)
        .and_then(|l| l.resolve())
        .expect("test config")
}

/// Starts a node in this runtime.
pub async fn start_node(config: &Config) -> NodeHandle {
    start_node_with(config, RunOptions::default()).await
}

/// Starts a node in this runtime with options (e.g. a fault-injecting broker connector).
pub async fn start_node_with(config: &Config, options: RunOptions) -> NodeHandle {
    init_tracing();
    app::start(config, options, CancellationToken::new())
        .await
        .expect("starting a node")
}

/// A node in a runtime of its own: dropping that runtime stops every task and drops every
/// connection at once without a release, which is what a crash looks like to everyone else.
pub struct IsolatedNode {
    runtime: Option<tokio::runtime::Runtime>,
    pub state: tokio::sync::watch::Receiver<NodeState>,
}

impl IsolatedNode {
    pub async fn start(config: &Config) -> IsolatedNode {
        init_tracing();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let config = config.clone();
        let handle = runtime
            .spawn(async move {
                app::start(&config, RunOptions::default(), CancellationToken::new()).await
            })
            .await
            .unwrap()
            .expect("starting an isolated node");
        let state = handle.state.clone();
        // The handle lives in the node's runtime; the node stops when the runtime is dropped.
        runtime.spawn(async move {
            let _keep = handle;
            std::future::pending::<()>().await
        });
        IsolatedNode {
            runtime: Some(runtime),
            state,
        }
    }

    /// Stops everything at once, releasing nothing.
    pub fn crash(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for IsolatedNode {
    fn drop(&mut self) {
        self.crash();
    }
}

/// Polls `check` every 20 ms until it yields a value; panics naming `what` after `within`.
pub async fn eventually<T>(
    what: impl Display,
    within: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the node's state satisfies `f`.
pub async fn wait_state(
    node: &tokio::sync::watch::Receiver<NodeState>,
    what: &str,
    within: Duration,
    f: impl Fn(&NodeState) -> bool,
) -> NodeState {
    let mut rx = node.clone();
    match tokio::time::timeout(within, rx.wait_for(|s| f(s))).await {
        Ok(Ok(s)) => s.clone(),
        Ok(Err(_)) => panic!("node stopped while waiting for {what}"),
        Err(_) => panic!(
            "timed out after {within:?} waiting for {what}; node state: {:?}",
            *node.borrow()
        ),
    }
}

/// Inserts enabled follower accounts `ids` on `platform`.
pub async fn insert_accounts(
    conn: &mut PgConnection,
    ids: std::ops::RangeInclusive<i64>,
    platform: &str,
) {
    sqlx::query(
        "INSERT INTO trading_accounts (id, platform, role, server, login)
         SELECT g, $3, 'follower', '127.0.0.1:1', g::text FROM generate_series($1::bigint, $2::bigint) g",
    )
    .bind(*ids.start())
    .bind(*ids.end())
    .bind(platform)
    .execute(conn)
    .await
    .unwrap();
}

/// Every account's owner as the database sees it (expired leases count as unowned).
pub async fn owners(conn: &mut PgConnection) -> BTreeMap<i64, Option<String>> {
    sqlx::query_as::<_, (i64, Option<String>)>(
        "SELECT id, CASE WHEN lease_until >= now() THEN node_id END FROM trading_accounts ORDER BY id",
    )
    .fetch_all(conn)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// How many accounts each node owns (live leases only).
pub async fn counts(conn: &mut PgConnection) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for owner in owners(conn).await.into_values().flatten() {
        *out.entry(owner).or_insert(0) += 1;
    }
    out
}

/// Waits until `node_id` owns exactly `n` accounts (live leases).
pub async fn wait_owned(conn: &mut PgConnection, node_id: &str, n: usize, within: Duration) {
    eventually(
        format!("{node_id} to own {n} accounts"),
        within,
        async || (counts(conn).await.get(node_id) == Some(&n)).then_some(()),
    )
    .await;
}

/// The latest lease of `node_id` (or of all rows), as text for later comparison on the
/// database's clock. A node's is its membership's `lease_until`, which the cycle that renewed
/// its rows set to the same instant: it stays there after another node claims the rows (read
/// from the rows, it is gone once a quick claimer has taken them all).
pub async fn last_lease(conn: &mut PgConnection, node_id: Option<&str>) -> String {
    let sql = match node_id {
        Some(_) => "SELECT lease_until::text FROM nodes WHERE node_id = $1",
        None => "SELECT max(lease_until)::text FROM trading_accounts WHERE $1::text IS NULL",
    };
    let lease: Option<String> = sqlx::query_scalar(sql)
        .bind(node_id)
        .fetch_one(conn)
        .await
        .unwrap();
    lease.unwrap_or_else(|| panic!("no lease recorded for {node_id:?}"))
}

/// (earliest, latest) claim of `node_id`'s rows in milliseconds after `lease` (database clock).
pub async fn claimed_after(conn: &mut PgConnection, node_id: &str, lease: &str) -> (f64, f64) {
    sqlx::query_as(
        "SELECT extract(epoch FROM min(claimed_at) - $2::timestamptz)::float8 * 1000,
                extract(epoch FROM max(claimed_at) - $2::timestamptz)::float8 * 1000
           FROM trading_accounts WHERE node_id = $1",
    )
    .bind(node_id)
    .bind(lease)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// A node row (member of the `mt5` platform) live for `live` more, saying it owns `owned`.
pub async fn insert_node(conn: &mut PgConnection, node_id: &str, live: &str, owned: i32) {
    sqlx::query(
        "INSERT INTO nodes (node_id, instance_id, platform, capacity, lease_until, started_at,
                            renewed_at, trust_until, owned)
         VALUES ($1, $1 || '-1', 'mt5', 1000, now() + $2::interval, now(), now(),
                 now() + $2::interval, $3)",
    )
    .bind(node_id)
    .bind(live)
    .bind(owned)
    .execute(conn)
    .await
    .unwrap();
}

/// Inserts one account.
pub async fn add_account(conn: &mut PgConnection, id: i64, role: &str, server: &str, login: &str) {
    sqlx::query("INSERT INTO trading_accounts (id, platform, role, server, login) VALUES ($1, 'mt5', $2, $3, $4)")
        .bind(id)
        .bind(role)
        .bind(server)
        .bind(login)
        .execute(conn)
        .await
        .unwrap();
}

/// A copy link's settings (defaults as the schema's).
#[derive(Debug, Clone)]
pub struct LinkSpec {
    pub lot_mode: &'static str,
    pub lot_value: f64,
    pub reverse: bool,
    pub copy_sl_tp: bool,
    pub symbol_map: &'static str,
    pub copy_existing: bool,
}

impl Default for LinkSpec {
    fn default() -> Self {
        LinkSpec {
            lot_mode: "multiplier",
            lot_value: 1.0,
            reverse: false,
            copy_sl_tp: true,
            symbol_map: "{}",
            copy_existing: false,
        }
    }
}

/// A hand pending order: no stops, good till cancelled, no magic or comment.
/// Master `m1` on the simulated broker at `addr` places a pending order of 0.4 lots on EURUSD,
/// with stops on the side its direction needs; its ticket.
pub async fn place_master_order(
    addr: &str,
    side: Side,
    kind: copier_node::broker::types::PendingKind,
    price: f64,
    expiry_ms: Option<i64>,
) -> i64 {
    tools::trade(
        addr,
        "m1",
        HandOrder::Place(copier_node::broker::types::PlaceOrder {
            sl: Some(if side == Side::Buy { 1.08 } else { 1.12 }),
            tp: Some(if side == Side::Buy { 1.12 } else { 1.08 }),
            expiry_ms,
            ..pending_order("EURUSD", side, kind, price, 0.4)
        }),
    )
    .await
    .unwrap()
    .expect("a placed order's ticket")
}

/// Master `m1` on the simulated broker at `addr` moves its pending order `ticket` to 1.093 and
/// makes it good till cancelled (its stops as [`place_master_order`] set them for a buy).
pub async fn amend_master_order(addr: &str, ticket: i64) {
    tools::trade(
        addr,
        "m1",
        HandOrder::Amend {
            ticket,
            price: 1.093,
            sl: Some(1.08),
            tp: Some(1.12),
            expiry_ms: None,
        },
    )
    .await
    .unwrap();
}

pub fn pending_order(
    symbol: &str,
    side: Side,
    kind: copier_node::broker::types::PendingKind,
    price: f64,
    volume: f64,
) -> copier_node::broker::types::PlaceOrder {
    copier_node::broker::types::PlaceOrder {
        symbol: symbol.into(),
        side,
        kind,
        price,
        volume,
        sl: None,
        tp: None,
        expiry_ms: None,
        magic: 0,
        comment: String::new(),
        client_order_id: None,
    }
}

/// Inserts a link; returns (link id, magic).
pub async fn add_link(
    conn: &mut PgConnection,
    master: i64,
    follower: i64,
    spec: LinkSpec,
) -> (i64, i64) {
    sqlx::query_as(
        "INSERT INTO copy_links (master_id, follower_id, lot_mode, lot_value, reverse, copy_sl_tp, symbol_map, copy_existing)
         VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8) RETURNING id, magic",
    )
    .bind(master)
    .bind(follower)
    .bind(spec.lot_mode)
    .bind(spec.lot_value)
    .bind(spec.reverse)
    .bind(spec.copy_sl_tp)
    .bind(spec.symbol_map)
    .bind(spec.copy_existing)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Hand trades and reads on a simulated broker, in-process.
pub struct Trader {
    pub addr: String,
}

impl Trader {
    pub async fn open(
        &self,
        login: &str,
        symbol: &str,
        side: Side,
        volume: f64,
        sl: Option<f64>,
        tp: Option<f64>,
    ) -> i64 {
        let order = HandOrder::Open {
            symbol: symbol.into(),
            side,
            volume,
            sl,
            tp,
            magic: 0,
            comment: String::new(),
        };
        tools::trade(&self.addr, login, order)
            .await
            .unwrap()
            .unwrap()
    }

    pub async fn close(&self, login: &str, ticket: i64, volume: Option<f64>) {
        tools::trade(&self.addr, login, HandOrder::Close { ticket, volume })
            .await
            .unwrap();
    }

    pub async fn modify(&self, login: &str, ticket: i64, sl: Option<f64>, tp: Option<f64>) {
        tools::trade(&self.addr, login, HandOrder::Modify { ticket, sl, tp })
            .await
            .unwrap();
    }

    pub async fn positions(&self, login: &str) -> Vec<Position> {
        tools::positions(&self.addr, login)
            .await
            .unwrap_or_default()
    }

    /// The broker's record of `login`: its open positions and its closed ones; none of either for
    /// a login the broker never saw (it creates an account at its first login, and a follower
    /// the reference leaves without copies may not have logged in yet when a case ends). Any
    /// other failure of the read fails the test.
    pub async fn record(&self, login: &str) -> (Vec<Position>, Vec<ClosedPosition>) {
        fn known<T>(read: Result<Vec<T>, BrokerError>, what: &str, login: &str) -> Vec<T> {
            match read {
                Err(BrokerError::Rejected(r)) if r.code == RejectCode::UnknownLogin => Vec::new(),
                other => other.unwrap_or_else(|e| panic!("reading the {what} of {login}: {e}")),
            }
        }
        (
            known(
                tools::positions(&self.addr, login).await,
                "positions",
                login,
            ),
            known(tools::history(&self.addr, login).await, "history", login),
        )
    }

    /// The open copy of master ticket `master_ticket` under `magic` on `login`, once it exists.
    pub async fn copy_of(
        &self,
        login: &str,
        magic: i64,
        master_ticket: i64,
        within: Duration,
    ) -> Position {
        let marker = format!("mc{master_ticket}");
        eventually(
            format!("a copy of {master_ticket} on {login}"),
            within,
            async || {
                self.positions(login)
                    .await
                    .into_iter()
                    .find(|p| p.magic == magic && p.comment == marker)
            },
        )
        .await
    }

    /// Waits until `login`'s copy of `master_ticket` satisfies `f` (`None`: no open copy).
    pub async fn wait_copy(
        &self,
        login: &str,
        magic: i64,
        master_ticket: i64,
        within: Duration,
        what: &str,
        f: impl Fn(Option<&Position>) -> bool,
    ) {
        let marker = format!("mc{master_ticket}");
        eventually(
            format!("{login}'s copy of {master_ticket}: {what}"),
            within,
            async || {
                let ps = self.positions(login).await;
                f(ps.iter().find(|p| p.magic == magic && p.comment == marker)).then_some(())
            },
        )
        .await
    }
}

/// Transactions committed (or rolled back) in the database at `url` once every other connection
/// to it has ended (a backend's counts reach the statistics by its exit at the latest; those left
/// are ended): PostgreSQL's own count, to judge how many statements some work took.
pub async fn transactions_ended(url: &str) -> i64 {
    use sqlx::Connection;
    let mut c = PgConnection::connect(url).await.unwrap();
    eventually(
        "the database's other connections to end",
        Duration::from_secs(30),
        async || {
            let others: i64 = sqlx::query_scalar(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                  WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_one(&mut c)
            .await
            .unwrap();
            (others == 0).then_some(())
        },
    )
    .await;
    let n: i64 = sqlx::query_scalar(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    n
}

/// `jobs` read by a node's background batch reader (a new one, on a pool of its own to the
/// database at `url`) at once ([`write_at_once`]), then again one after another on another;
/// asserts that at once took far fewer transactions ([`transactions_ended`]: PostgreSQL's own
/// count) and returns its outcomes in the jobs' order.
pub async fn read_at_once_in_few_transactions<J: copier_node::db::batch::Batched + Clone>(
    url: &str,
    jobs: &[J],
) -> Vec<Result<J::Outcome, String>> {
    use copier_node::db::batch::BatchWriter;
    let reader = async || {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        let reader = BatchWriter::<J>::spawn_background(copier_node::db::Db::direct(pool.clone()));
        (reader, pool)
    };
    let before = transactions_ended(url).await;
    let (at_once, pool) = reader().await;
    let read = write_at_once(&at_once, jobs.to_vec()).await;
    drop(at_once);
    pool.close().await;
    let batched = transactions_ended(url).await - before;

    let before = transactions_ended(url).await;
    let (one_by_one, pool) = reader().await;
    for job in jobs {
        let _ = one_by_one.write(job.clone()).await.unwrap();
    }
    drop(one_by_one);
    pool.close().await;
    let one_by_one = transactions_ended(url).await - before;
    assert!(
        batched * 4 < one_by_one,
        "transactions: {batched} for the reads at once, {one_by_one} one after another"
    );
    read
}

/// Hands every job to a node's batch writer at once (each from its own task, as account tasks
/// do) and returns their outcomes in the jobs' order.
pub async fn write_at_once<J: copier_node::db::batch::Batched>(
    writer: &copier_node::db::batch::BatchWriter<J>,
    jobs: Vec<J>,
) -> Vec<Result<J::Outcome, String>> {
    let handles: Vec<_> = jobs
        .into_iter()
        .map(|j| {
            let writer = writer.clone();
            tokio::spawn(async move { writer.write(j).await })
        })
        .collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}
