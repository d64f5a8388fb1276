//! Database access: connection settings, migrations, and one module per concern, each holding
//! every SQL statement of that concern as a documented function.
//!
//! Statements are plain `sqlx::query` with runtime binding; every statement is exercised by the
//! integration tests against a real PostgreSQL.

pub mod admin;
pub mod batch;
pub mod cluster;
pub mod copy;
pub mod credentials;
pub mod events;
pub mod fix;
pub mod lease;
pub mod migrate;
pub mod replication;
pub mod setup;
pub mod status;
pub mod together;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, PgConnection};

use crate::secret::Secret;

/// What sits between a node and PostgreSQL (the `database_pooler` setting): it decides how
/// connection bounds are set and whether statements may be prepared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooler {
    /// Nothing, or a pooler that passes startup options on: the bounds go in the startup packet.
    None,
    /// A pooler in session mode (PgBouncer `pool_mode = session`): the bounds are `SET` after
    /// connecting, since PgBouncer before 1.20 refuses or drops startup options.
    Session,
    /// A pooler in transaction mode (PgBouncer `pool_mode = transaction`): every unit of work is
    /// an explicit transaction that sets the bounds with `SET LOCAL`, with no prepared statement
    /// outliving it (the lease cycle is one message instead: [`lease::cycle_on`]); LISTEN goes
    /// to `listen_database_url` or is replaced by `events_poll`.
    Transaction,
}

/// Server-side bounds every connection of a running node sets (guarantee S1, docs/guarantees.md), derived from the fence
/// so a stalled client can never hold row locks anywhere near as long as the fence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionBounds {
    /// `statement_timeout`: a third of the fence.
    pub statement: Duration,
    /// `lock_timeout`: a fifth of the fence; a cycle never queues behind a stuck lock for long.
    pub lock: Duration,
    /// `idle_in_transaction_session_timeout`: a third of the fence. The cycle is one autocommit
    /// statement, so a node is never idle inside a transaction of its own; this catches any
    /// future multi-statement transaction whose client stalls.
    pub idle_in_transaction: Duration,
}

impl SessionBounds {
    /// Bounds for a node whose fence is `fence` (at least 1 ms each).
    pub fn for_fence(fence: Duration) -> Self {
        let at_least = |d: Duration| d.max(Duration::from_millis(1));
        SessionBounds {
            statement: at_least(fence / 3),
            lock: at_least(fence / 5),
            idle_in_transaction: at_least(fence / 3),
        }
    }

    /// Bounds of the lease cycle's own connection: still below the fence (a stalled cycle holds
    /// its row locks no longer), but longer than any statement of the node's own work may run
    /// ([`SessionBounds::for_fence`]: a third of the fence). The cycle's lock wait (half the
    /// fence) outlasts whatever lock such a statement holds, so a cycle never fails because the
    /// node is busy with its own sessions; its statement (two thirds of the fence) has room to
    /// finish after that wait. The client side still cuts a cycle at the trust deadline.
    pub fn for_cycle(fence: Duration) -> Self {
        let at_least = |d: Duration| d.max(Duration::from_millis(1));
        SessionBounds {
            statement: at_least(fence * 2 / 3),
            lock: at_least(fence / 2),
            idle_in_transaction: at_least(fence / 3),
        }
    }

    /// Bounds of the node's releases ([`Db::bounded`]): their lock wait (two thirds of the
    /// fence, the cycle's statement bound) outwaits the node's own lease cycle, which holds every
    /// row of the node while it renews them. With the node's other statements' lock wait (a fifth
    /// of the fence), a shutdown's releases on a loaded database, where a cycle takes seconds,
    /// each timed out behind one and none got through until the grace ran out. A release
    /// waiting for the cycle holds none of the rows the cycle locks (both lock in id order, and
    /// the cycle had locked them first); still below the fence.
    pub fn for_release(fence: Duration) -> Self {
        let at_least = |d: Duration| d.max(Duration::from_millis(1));
        SessionBounds {
            statement: at_least(fence * 3 / 4),
            lock: at_least(fence * 2 / 3),
            idle_in_transaction: at_least(fence / 3),
        }
    }
}

/// Connection options for a running node: the bounds above, `synchronous_commit = on` (an
/// acknowledged renewal or claim must survive a database restart), `jit = off`, and an
/// application name that shows the node in `pg_stat_activity`. All sent in the startup packet:
/// no extra round trip.
///
/// JIT is off because the node's statements are short and index-driven, but the cycle's
/// estimated cost grows with the table (the dead-node lookup is costed for a node owning a
/// hundredth of it): at 1M rows the estimate passes `jit_above_cost` and compiling the
/// expressions took 60 ms of a cycle whose execution takes 2 ms (BENCHMARKS.md).
pub fn node_options(
    url: &Secret,
    node_id: &str,
    session: Session,
) -> Result<PgConnectOptions, sqlx::Error> {
    let ms = |d: Duration| d.as_millis().to_string();
    let bounds = session.bounds;
    let options = PgConnectOptions::from_str(url.expose())?
        .application_name(&format!("copier-node {node_id}"));
    match session.pooler {
        Pooler::None => {}
        // PgBouncer before 1.20 refuses startup options (or drops them, with
        // `ignore_startup_parameters`): the bounds are set after connecting instead.
        Pooler::Session => return Ok(options),
        // Behind a transaction pooler consecutive transactions may run on different servers: the
        // statement cache is off (nothing on the client refers to a statement after its
        // transaction), the statements the driver still names are dropped as each unit begins,
        // and the bounds are set in every transaction ([`Session::begin`]).
        Pooler::Transaction => return Ok(options.statement_cache_capacity(0)),
    }
    Ok(options.options([
        ("statement_timeout", ms(bounds.statement)),
        ("lock_timeout", ms(bounds.lock)),
        (
            "idle_in_transaction_session_timeout",
            ms(bounds.idle_in_transaction),
        ),
        ("synchronous_commit", "on".to_string()),
        ("jit", "off".to_string()),
    ]))
}

/// How a node's connections get their bounds: in the startup packet (directly to PostgreSQL, or
/// a pooler that passes startup options on), or, behind a session pooler (`database_pooler =
/// "session"`), by `SET` right after connecting; either way every new connection is checked
/// before it is used ([`open_session`]). Behind a transaction pooler (`database_pooler =
/// "transaction"`) a `SET` does not stick and one connection of the node's maps to many server
/// connections, so every unit of work is an explicit transaction that begins by setting the
/// bounds with `SET LOCAL` ([`Session::begin`], [`Db::run`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    pub bounds: SessionBounds,
    pub pooler: Pooler,
}

impl Session {
    /// Straight to PostgreSQL (or a pooler that passes startup options on).
    pub fn direct(bounds: SessionBounds) -> Self {
        Session {
            bounds,
            pooler: Pooler::None,
        }
    }

    /// Behind a transaction pooler: the one message (one round trip) that begins a unit of work:
    /// `BEGIN`, `DEALLOCATE ALL`, and the bounds as `SET LOCAL`, which hold until its COMMIT or
    /// ROLLBACK on whichever server the pooler chose. None otherwise (statements run as they
    /// are).
    ///
    /// `DEALLOCATE ALL`: the driver names its prepared statements `sqlx_s_<n>` per client
    /// connection, even with its statement cache off, and never closes them then; a server
    /// connection shared by many clients would collect them, and another client's `sqlx_s_1`
    /// fails with "already exists". Dropping the server's statements when a unit begins leaves only
    /// this unit's own there until it ends (the pooler keeps the server for the whole transaction).
    pub fn begin(&self) -> Option<String> {
        self.set_local()
            .map(|bounds| format!("BEGIN; DEALLOCATE ALL; {bounds}"))
    }

    /// Behind a transaction pooler: the bounds as `SET LOCAL` statements (for the start of a
    /// transaction). None otherwise.
    pub fn set_local(&self) -> Option<String> {
        (self.pooler == Pooler::Transaction).then(|| set_local(self.bounds))
    }
}

/// `bounds` as `SET LOCAL` statements, with `synchronous_commit = on` and `jit = off`.
fn set_local(b: SessionBounds) -> String {
    let ms = |d: Duration| d.as_millis();
    format!(
        "SET LOCAL statement_timeout = '{}ms'; SET LOCAL lock_timeout = '{}ms'; SET LOCAL idle_in_transaction_session_timeout = '{}ms'; SET LOCAL synchronous_commit = on; SET LOCAL jit = off",
        ms(b.statement),
        ms(b.lock),
        ms(b.idle_in_transaction)
    )
}

/// Runs one unit of work on `conn`: as it is, or, behind a transaction pooler, inside a
/// transaction begun with the bounds ([`Session::begin`]) and committed when `work` succeeds
/// (rolled back when it fails). Keep broker calls and other waits out of `work`: behind a
/// transaction pooler it holds a server connection for its whole length.
pub async fn run_on<T>(
    conn: &mut PgConnection,
    session: &Session,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    run_begun(conn, session.begin(), work).await
}

/// Runs `work` on `conn`: as it is, or inside a transaction begun by `begin` and committed when
/// `work` succeeds (rolled back when it fails).
async fn run_begun<T>(
    conn: &mut PgConnection,
    begin: Option<String>,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    match begin {
        None => work(conn).await,
        Some(begin) => {
            let mut tx = conn.begin_with(begin).await?;
            let out = work(&mut tx).await?;
            tx.commit().await?;
            Ok(out)
        }
    }
}

/// A pooled connection whose unit of work has not finished: closed when dropped.
struct Unfinished(Option<sqlx::pool::PoolConnection<sqlx::Postgres>>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

/// How many units of background work ([`Db::background`]) may hold or wait for pooled connections
/// at once: half of [`node_pool`]'s connections, so the other half always serves live work.
pub const BACKGROUND_UNITS: usize = 4;

/// What a node measures of its pool (series of the node's registry, made by its metrics).
#[derive(Debug, Clone)]
pub struct PoolMeasures {
    /// Seconds each unit of work waited for a pooled connection.
    pub wait: prometheus::Histogram,
    /// Units of background work waiting for their turn.
    pub background_waiting: prometheus::IntGauge,
}

/// The node's pool and how a unit of work runs on it ([`run_on`]): every statement of a running
/// node other than the lease cycle's (which has a connection of its own) goes through here.
/// Live work (a master's event, a copy's fenced records) runs at once ([`Db::run`]); background
/// reads (a session's start-up, periodic reconciles) take turns ([`Db::background`]), so however
/// many sessions start or reconcile, they never hold more than [`BACKGROUND_UNITS`] connections.
#[derive(Debug, Clone)]
pub struct Db {
    pool: PgPool,
    session: Arc<Session>,
    turns: Arc<tokio::sync::Semaphore>,
    measures: Option<PoolMeasures>,
    /// Every unit of work is a transaction that sets the session's bounds with `SET LOCAL`,
    /// whatever the pooler ([`Db::bounded`]).
    bounded: bool,
    /// A batch writer's (fault point `COPIERTEST_POOL_HOG` spares it: [`Db::batching`]).
    #[cfg(feature = "failpoints")]
    batching: bool,
}

impl Db {
    pub fn new(pool: PgPool, session: Session) -> Db {
        Db {
            pool,
            session: Arc::new(session),
            turns: Arc::new(tokio::sync::Semaphore::new(BACKGROUND_UNITS)),
            measures: None,
            bounded: false,
            #[cfg(feature = "failpoints")]
            batching: false,
        }
    }

    /// The same pool, each unit of work a transaction that begins by setting `bounds` with
    /// `SET LOCAL` in place of the connection's (one message with the `BEGIN`): for the work
    /// whose lock wait must differ from the node's other statements' (releases,
    /// [`SessionBounds::for_release`]).
    pub fn bounded(&self, bounds: SessionBounds) -> Db {
        Db {
            session: Arc::new(Session {
                bounds,
                pooler: self.session.pooler,
            }),
            bounded: true,
            ..self.clone()
        }
    }

    /// The same pool, for a [`batch::BatchWriter`]: a writer holds one connection at a time
    /// however many sessions wait on it, so the fault point that loads the pool with the
    /// sessions' own units of work (`COPIERTEST_POOL_HOG`) spares its batches (which every
    /// session's start goes through: hogged, no session would get as far as loading the pool).
    pub(crate) fn batching(#[allow(unused_mut)] mut self) -> Db {
        #[cfg(feature = "failpoints")]
        {
            self.batching = true;
        }
        self
    }

    /// The same pool, measured into `measures`.
    pub fn measured(mut self, measures: PoolMeasures) -> Db {
        self.measures = Some(measures);
        self
    }

    /// Runs `work` as [`Db::run`] does, once a background turn is free: for reads that can wait
    /// (a session's start-up, a reconcile), never for a live event's work.
    pub async fn background<T>(
        &self,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        /// Counts a unit as waiting until its turn comes or it is dropped.
        struct Waiting<'a>(Option<&'a prometheus::IntGauge>);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                if let Some(g) = self.0 {
                    g.dec();
                }
            }
        }
        let waiting = Waiting(self.measures.as_ref().map(|m| &m.background_waiting));
        if let Some(g) = waiting.0 {
            g.inc();
        }
        let turn = self.turns.acquire().await;
        drop(waiting);
        let _turn = turn.map_err(|_| sqlx::Error::PoolClosed)?;
        self.run(work).await
    }

    /// A pool straight to PostgreSQL (tests, tools).
    pub fn direct(pool: PgPool) -> Db {
        Db::new(
            pool,
            Session::direct(SessionBounds::for_fence(Duration::from_secs(15))),
        )
    }

    /// Runs `work` on a pooled connection as one unit of work ([`run_on`]). A unit that does
    /// not finish (an error, or its future dropped by a timeout) may leave its connection inside
    /// a transaction, even an aborted one the next BEGIN would fail on: that connection is
    /// closed instead of going back to the pool.
    pub async fn run<T>(
        &self,
        work: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let asked = tokio::time::Instant::now();
        let acquired = self.pool.acquire().await;
        if let Some(m) = &self.measures {
            m.wait.observe(asked.elapsed().as_secs_f64());
        }
        let mut unit = Unfinished(Some(acquired?));
        let conn = unit.0.as_mut().expect("just acquired");
        #[cfg(feature = "failpoints")]
        if !self.batching && crate::failpoints::active("COPIERTEST_POOL_HOG") {
            // The node's own work saturating its pool: every unit first keeps its connection busy
            // on the server until the statement timeout cuts it, then fails.
            tracing::debug!("fault injection: pooled unit of work hogging its connection");
            sqlx::query("SELECT pg_sleep(3600)")
                .execute(&mut **conn)
                .await?;
        }
        // A bounded pool's unit sets its bounds whatever the pooler (with `DEALLOCATE ALL`
        // behind a transaction pooler, as every unit there).
        let begin = if self.bounded {
            Some(
                self.session
                    .begin()
                    .unwrap_or_else(|| format!("BEGIN; {}", set_local(self.session.bounds))),
            )
        } else {
            self.session.begin()
        };
        let out = run_begun(conn, begin, work).await;
        if out.is_ok() {
            // Finished: back to the pool.
            drop(unit.0.take());
        }
        out
    }

    /// The pool itself (statements run on it directly skip [`run_on`]: tests only).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// Makes a new connection fit for a node: behind a session pooler, sets the bounds; then checks
/// with `current_setting` that `statement_timeout`, `lock_timeout` and
/// `idle_in_transaction_session_timeout` are set and no longer than the bounds and that
/// `synchronous_commit` is `on`. A connection without them is refused (an error naming the
/// setting), so a pooler that silently drops startup options (PgBouncer before 1.20 with
/// `ignore_startup_parameters = options`) never carries a lease cycle or an order's writes.
pub async fn open_session(
    conn: &mut sqlx::PgConnection,
    session: &Session,
) -> Result<(), sqlx::Error> {
    let b = session.bounds;
    if session.pooler == Pooler::Transaction {
        // Nothing sticks to a connection here: every unit of work sets the bounds itself
        // (`SET LOCAL` in its BEGIN, so they cannot be lost on the way).
        return Ok(());
    }
    if session.pooler == Pooler::Session {
        let ms = |d: Duration| d.as_millis();
        for set in [
            format!("SET statement_timeout = '{}ms'", ms(b.statement)),
            format!("SET lock_timeout = '{}ms'", ms(b.lock)),
            format!(
                "SET idle_in_transaction_session_timeout = '{}ms'",
                ms(b.idle_in_transaction)
            ),
            "SET synchronous_commit = on".to_string(),
            "SET jit = off".to_string(),
        ] {
            sqlx::query(&set).execute(&mut *conn).await?;
        }
    }
    let (statement, lock, idle, sync): (String, String, String, String) = sqlx::query_as(
        "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),
                current_setting('idle_in_transaction_session_timeout'), current_setting('synchronous_commit')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let mut problems = Vec::new();
    for (name, value, bound) in [
        ("statement_timeout", &statement, b.statement),
        ("lock_timeout", &lock, b.lock),
        (
            "idle_in_transaction_session_timeout",
            &idle,
            b.idle_in_transaction,
        ),
    ] {
        match parse_setting(value) {
            Some(d) if !d.is_zero() && d <= bound + Duration::from_millis(1) => {}
            _ => problems.push(format!(
                "{name} is {value:?}, not at most {}ms",
                bound.as_millis()
            )),
        }
    }
    if sync != "on" {
        problems.push(format!("synchronous_commit is {sync:?}, not on"));
    }
    if problems.is_empty() {
        return Ok(());
    }
    Err(sqlx::Error::InvalidArgument(format!(
        "the connection lacks the node's safety bounds ({}): a pooler dropped them (PgBouncer before 1.20 drops or refuses startup options: set `database_pooler = \"session\"`), or the server overrides them",
        problems.join("; ")
    )))
}

/// A duration setting as `current_setting` shows it (`"333ms"`, `"5s"`, `"1min"`, `"0"`).
fn parse_setting(v: &str) -> Option<Duration> {
    let digits = v.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let n: u64 = digits.parse().ok()?;
    let ms = match &v[digits.len()..] {
        "" | "ms" => n,
        "us" => return Some(Duration::from_micros(n)),
        "s" => n * 1000,
        "min" => n * 60_000,
        "h" => n * 3_600_000,
        "d" => n * 86_400_000,
        _ => return None,
    };
    Some(Duration::from_millis(ms))
}

/// `url` with its database name replaced by `db`; the rest (user, host, port, query) is kept.
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map(|(b, q)| (b, Some(q)))
        .unwrap_or((url, None));
    let start = base.find("://").map(|i| i + 3).unwrap_or(0);
    let end = base[start..]
        .find('/')
        .map(|i| start + i)
        .unwrap_or(base.len());
    let mut out = format!("{}/{db}", &base[..end]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// Options for administrative commands (`migrate`, `status`): no short timeouts, because a
/// migration's advisory lock and index builds may take longer than any fence.
pub fn admin_options(url: &Secret) -> Result<PgConnectOptions, sqlx::Error> {
    Ok(PgConnectOptions::from_str(url.expose())?.application_name("copier-node admin"))
}

/// Why an administrative connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum AdminConnectError {
    /// The URL does not parse (a configuration error).
    #[error("invalid `database_url`: {0}")]
    InvalidUrl(String),
    /// The server could not be reached or refused the connection.
    #[error("cannot connect to the database: {0}")]
    Unreachable(String),
}

/// One connection for an administrative command (`migrate`, `status`, `credentials rotate`,
/// the demo's own reads), with [`admin_options`]; errors never show the URL.
pub async fn admin_connect(url: &Secret) -> Result<sqlx::PgConnection, AdminConnectError> {
    use sqlx::ConnectOptions;
    admin_options(url)
        .map_err(|e| AdminConnectError::InvalidUrl(describe(&e)))?
        .connect()
        .await
        .map_err(|e| AdminConnectError::Unreachable(describe(&e)))
}

/// How long a pooled connection may sit idle and still be handed out without a ping.
const PING_AFTER_IDLE: Duration = Duration::from_secs(1);

/// How many connections a node's pool holds ([`node_pool`]).
pub const POOL_SIZE: u32 = 8;

/// The pool for a node's non-cycle work (publications, reconcile reads, status writes,
/// releases); connects lazily, and [`warm`] opens every connection ahead of need. The cycle has a connection of its own. A connection idle for
/// [`PING_AFTER_IDLE`] or longer is pinged before it is handed out (a dead one is closed and
/// another taken: after a restart or failover, stale connections are found before use); one
/// in steady use is not, so a burst of work (a thousand followers' copies, a hundred masters'
/// events) costs no extra round trip per unit. A connection that broke since its last use
/// fails that one unit of work, which closes it ([`Db::run`]); callers treat such an error as
/// any database error (whether it committed is unknown).
pub fn node_pool(options: PgConnectOptions, acquire_timeout: Duration, session: Session) -> PgPool {
    PgPoolOptions::new()
        // A slow acquire is the histogram `copier_db_pool_wait_seconds` ([`Db::run`]), not a
        // warning per acquire: a node short of connections for a while would log thousands.
        .acquire_slow_level(log::LevelFilter::Debug)
        .max_connections(POOL_SIZE)
        // Kept open once [`warm`] opened them: a connection closed for idleness is replaced.
        .min_connections(POOL_SIZE)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_AFTER_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .after_connect(move |conn, _meta| {
            Box::pin(async move { open_session(conn, &session).await })
        })
        .connect_lazy_with(options)
}

/// Opens every connection of a node's pool ([`POOL_SIZE`]) one after another, and hands them
/// back to it: run once as the node starts. Left to open as work needs them, a pool used by a
/// few steady units opened the rest in a burst, inside the burst's own time: traced on
/// 2026-12-07 in a SIGTERM hand-off's receiver, two or three connections opened while the moved
/// followers' first reads waited, each several milliseconds on a busy machine (the connection,
/// its authentication and the bounds' check), which those followers' first copies waited for.
/// A database that cannot be reached now ends the warm-up (logged at debug): the connections
/// then open as work needs them, as before.
pub async fn warm(pool: PgPool) {
    let mut held = Vec::new();
    while held.len() < POOL_SIZE as usize {
        match pool.acquire().await {
            Ok(conn) => held.push(conn),
            Err(e) => {
                tracing::debug!(opened = held.len(), error = %describe(&e), "the pool's warm-up stopped; its other connections open as work needs them");
                return;
            }
        }
    }
}

/// The one connection of a node's batch writer ([`batch::BatchWriter`]: the master publisher, the
/// copy ledger's writer), each its own: master events never queue behind the pool's other work
/// (a thousand followers' reconcile reads, the copy ledger) for a connection, and the connection
/// stays warm (connected at start, kept alive by its writer, never closed for idleness). It runs
/// its statements with `plan_cache_mode = force_generic_plan`: left to choose, PostgreSQL plans
/// the publish statement (a CTE over `unnest`ed arrays) afresh on every execution, because the
/// custom plans it compares against look cheaper, and that planning cost a millisecond of every
/// master event at 100,000 accounts (0.3 ms with the generic plan, an index nested loop).
/// Behind a transaction pooler nothing is prepared (no statement cache), so nothing changes there.
/// Otherwise as [`node_pool`] (the same options and bounds, checked on connect).
pub fn writer_pool(
    options: PgConnectOptions,
    acquire_timeout: Duration,
    session: Session,
) -> PgPool {
    let options = match session.pooler {
        Pooler::None => options.options([("plan_cache_mode", "force_generic_plan")]),
        Pooler::Session | Pooler::Transaction => options,
    };
    PgPoolOptions::new()
        .acquire_slow_level(log::LevelFilter::Debug)
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .acquire_timeout(acquire_timeout)
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_AFTER_IDLE {
                    sqlx::Connection::ping(conn).await?;
                }
                Ok(true)
            })
        })
        .after_connect(move |conn, _meta| {
            Box::pin(async move {
                open_session(conn, &session).await?;
                if session.pooler == Pooler::Session {
                    sqlx::query("SET plan_cache_mode = force_generic_plan")
                        .execute(&mut *conn)
                        .await?;
                }
                Ok(())
            })
        })
        .connect_lazy_with(options)
}

/// How often an idle batch writer keeps its connection in use (a ping), so the pool never pings
/// it on the way to a write ([`PING_AFTER_IDLE`]) and a dead connection is found and replaced
/// between writes rather than by one.
pub const KEEPALIVE: Duration = Duration::from_millis(700);

/// Describes a database error without the connection string (which may carry a password).
pub fn describe(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_string(),
        },
        sqlx::Error::PoolTimedOut => "timed out waiting for a database connection".to_string(),
        sqlx::Error::Io(io) => format!("database connection failed: {io}"),
        sqlx::Error::Configuration(_) => "invalid database URL".to_string(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_well_below_the_fence() {
        let b = SessionBounds::for_fence(Duration::from_secs(15));
        assert_eq!(b.statement, Duration::from_secs(5));
        assert_eq!(b.lock, Duration::from_secs(3));
        assert!(b.idle_in_transaction < Duration::from_secs(15));
        let tiny = SessionBounds::for_fence(Duration::from_millis(2));
        assert!(tiny.statement >= Duration::from_millis(1));
    }

    #[test]
    fn the_cycle_outwaits_every_other_statement_of_the_node_and_stays_below_the_fence() {
        for fence in [3u64, 1_000, 5_000, 15_000] {
            let fence = Duration::from_millis(fence);
            let (cycle, work) = (
                SessionBounds::for_cycle(fence),
                SessionBounds::for_fence(fence),
            );
            assert!(cycle.lock > work.statement, "fence {fence:?}");
            assert!(cycle.statement > cycle.lock, "fence {fence:?}");
            assert!(cycle.statement < fence && cycle.idle_in_transaction < fence);
        }
    }

    #[test]
    fn with_database_replaces_only_the_database_name() {
        assert_eq!(
            with_database("postgres://u:p@h:5432/old?sslmode=disable", "new"),
            "postgres://u:p@h:5432/new?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "new"), "postgres://h/new");
        assert_eq!(
            with_database("postgresql://h/old", "new"),
            "postgresql://h/new"
        );
    }

    #[test]
    fn configuration_errors_do_not_echo_the_url() {
        let err = node_options(
            &Secret::new("postgres://u:hunter2@h:notaport/db"),
            "n",
            Session::direct(SessionBounds::for_fence(Duration::from_secs(1))),
        )
        .map(|_| ())
        .unwrap_err();
        assert!(!describe(&err).contains("hunter2"));
    }
}
