//! Wires a node together: database, migrations check, status writer, LISTEN, supervisor and the
//! lease loop; runs it until a shutdown future resolves.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use sqlx::{ConnectOptions, Connection};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::account::NodeServices;
use crate::brokers::{BrokerConnector, Brokers};
use crate::config::{Config, show};
use crate::db::{self, SessionBounds};
use crate::http;
use crate::hub::Hub;
use crate::lease::{LeaseLoop, NodeState};
use crate::metrics::Metrics;
use crate::status_writer;
use crate::supervisor::{Event, NodeShared, Supervisor};
use crate::trust::MonoBase;
use tokio::net::TcpListener;

/// How often a node deletes memberships of long-dead nodes that own nothing.
const FORGET_DEAD_NODES_EVERY: Duration = Duration::from_secs(300);

/// Options of `copier-node run` beyond the configuration.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Apply pending migrations before starting instead of refusing.
    pub migrate: bool,
    /// Where account sessions get their brokers (default: a bridge connection per server).
    pub brokers: Option<Arc<dyn BrokerConnector>>,
}

/// A running node.
#[derive(Debug)]
pub struct NodeHandle {
    /// The node as it sees itself, updated after every cycle and ownership change.
    pub state: watch::Receiver<NodeState>,
    /// Where `/healthz`, `/readyz` and `/metrics` are served.
    pub http_addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
}

impl NodeHandle {
    /// Starts a clean shutdown (as SIGTERM does).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits for the node to stop; `Err` if it stopped on its own with an error.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.task.await.context("the node task panicked")?
    }

    /// True once the node has stopped.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}

/// After the lease loop ends (every session was stopped within the shutdown grace,
/// [`crate::lease::SHUTDOWN_GRACE`], or given up on), how long account and background tasks get
/// to return before the node stops without them.
const TASKS_STOP_WITHIN: Duration = Duration::from_secs(1);
/// How long the checks of the last releases get at shutdown: each waits
/// [`crate::supervisor::UNCLAIMED_AFTER`] after its release, then runs one statement.
const CHECKS_WITHIN: Duration =
    Duration::from_secs(crate::supervisor::UNCLAIMED_AFTER.as_secs() + 1);
/// How long the status writer gets for its last batch at shutdown.
const STATUS_FLUSH_WITHIN: Duration = Duration::from_secs(2);

/// Runs a node until `shutdown` resolves (then releases everything and returns) or until it
/// stops on its own (a node id held by another live process).
pub async fn run(
    config: Config,
    options: RunOptions,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    tokio::pin!(shutdown);
    let mut handle = tokio::select! {
        h = start(&config, options, CancellationToken::new()) => h?,
        _ = &mut shutdown => {
            // Waiting for the database (or for migrations): nothing was claimed, so nothing is
            // released, and a stop asked for during an outage is a clean stop (exit 0: a
            // systemd unit is not marked failed).
            info!("shutdown requested before the node started: it held nothing; stopped");
            return Ok(());
        }
    };
    tokio::select! {
        _ = &mut shutdown => handle.shutdown(),
        result = &mut handle.task => return result.context("the node task panicked")?,
    }
    handle.wait().await
}

/// Starts a node: waits for the database, checks (or applies) migrations, then spawns the node's
/// tasks. Returns once the node runs; `shutdown` stops it cleanly.
pub async fn start(
    config: &Config,
    options: RunOptions,
    shutdown: CancellationToken,
) -> anyhow::Result<NodeHandle> {
    let node = config.node()?;
    let span = info_span!("node", node_id = %node.node_id);
    async {
        let instance_id = format!("{:016x}", fastrand::u64(..));
        info!(
            platform = %node.platform,
            instance_id = %instance_id,
            capacity = node.capacity,
            lease = %show(node.lease),
            fence = %show(node.fence),
            cycle = %show(node.cycle),
            "starting copier-node {}",
            env!("CARGO_PKG_VERSION")
        );
        let session = db::Session {
            bounds: SessionBounds::for_fence(node.fence),
            pooler: config.database_pooler,
        };
        let node_options = db::node_options(&config.database_url, &node.node_id, session)
            .context("invalid `database_url`")?;
        // LISTEN never goes through a transaction pooler (the configuration requires a separate
        // `listen_database_url` or `events_poll` there): its connection is a direct one.
        let listen_session = match session.pooler {
            db::Pooler::Transaction => db::Session::direct(session.bounds),
            _ => session,
        };
        let listen_options =
            db::node_options(&config.listen_database_url, &node.node_id, listen_session)
                .context("invalid `listen_database_url`")?;

        // Health and metrics first: liveness holds while the node waits for its database.
        let metrics = Arc::new(Metrics::new());
        let (state_tx, state_rx) = watch::channel(NodeState {
            node_id: node.node_id.clone(),
            instance_id: instance_id.clone(),
            lease: node.lease,
            ..NodeState::default()
        });
        let http_listener = TcpListener::bind(config.http_listen)
            .await
            .with_context(|| format!("cannot listen on `http_listen` {}", config.http_listen))?;
        let http_addr = http_listener.local_addr()?;
        info!(%http_addr, "serving /healthz, /readyz and /metrics on {http_addr}");
        let http_cancel = CancellationToken::new();
        tokio::spawn(http::serve(
            http_listener,
            state_rx.clone(),
            metrics.clone(),
            http_cancel.clone(),
        ));

        check_schema(config, session, options.migrate, &shutdown).await?;

        let node_pool = db::node_pool(
            node_options.clone(),
            node.lease.saturating_sub(node.fence),
            session,
        );
        tokio::spawn(db::warm(node_pool.clone()));
        let pool = db::Db::new(node_pool, session).measured(metrics.pool());
        // Each batch writer's own connection (see `db::writer_pool`).
        let writer_db = || {
            db::Db::new(
                db::writer_pool(
                    node_options.clone(),
                    node.lease.saturating_sub(node.fence),
                    session,
                ),
                session,
            )
        };
        let (event_tx, event_rx) = mpsc::unbounded_channel::<Event>();
        let (lost_tx, mut lost_rx) = mpsc::unbounded_channel();
        let lost_for_tasks = lost_tx.clone();
        let writer_cancel = CancellationToken::new();
        let (status, writer) = status_writer::spawn(
            pool.clone(),
            node.node_id.clone(),
            lost_tx,
            writer_cancel.clone(),
        );
        {
            let event_tx = event_tx.clone();
            tokio::spawn(async move {
                while let Some(lost) = lost_rx.recv().await {
                    let _ = event_tx.send(Event::Lost(lost));
                }
            });
        }
        let tracker = TaskTracker::new();
        let checks = TaskTracker::new();
        let wake = Arc::new(crate::hub::Wake::default());
        let background = CancellationToken::new();
        // Spawned inside the node's span, so its log lines carry node_id.
        let hub = match config.events_poll {
            Some(every) => Hub::spawn_polling(
                node_options.clone(),
                session,
                node.platform.clone(),
                every,
                wake.clone(),
                background.clone(),
            ),
            None => Hub::spawn_measured(
                listen_options,
                node.platform.clone(),
                node.node_id.clone(),
                wake.clone(),
                background.clone(),
                Some(metrics.notify_queue_usage.clone()),
            ),
        };
        let orders = Arc::new(crate::db::batch::Orders::default());
        let services = Arc::new(NodeServices {
            node_id: node.node_id.clone(),
            copy_ledger: crate::db::copy::ledger::CopyLedgerWriter::spawn_giving_way(
                writer_db(),
                orders.clone(),
            ),
            orders,
            master_publisher: crate::db::copy::MasterPublisher::spawn(writer_db()),
            links: crate::db::copy::LinksReader::spawn_background(pool.clone()),
            releaser: crate::db::lease::Releaser::spawn_pooled(
                pool.bounded(SessionBounds::for_release(node.fence)),
            ),
            unclaimed: crate::db::lease::UnclaimedAnnouncer::spawn_pooled(pool.clone()),
            handoff_notices: crate::db::lease::HandoffAnnouncer::spawn_pooled(pool.clone()),
            accounts: crate::db::copy::AccountReader::spawn_background(pool.clone()),
            reconciles: crate::db::copy::ReconcileReader::spawn_background(pool.clone()),
            ledger_reads: crate::db::copy::LedgerReader::spawn_background(pool.clone()),
            master_states: crate::db::copy::MasterStateReader::spawn_background(pool.clone()),
            db: pool.clone(),
            hub,
            brokers: options.brokers.clone().unwrap_or_else(|| {
                Arc::new(Brokers::new(node.node_id.clone()).with_database(pool.clone()))
            }),
            lost: lost_for_tasks,
            metrics: metrics.clone(),
            credentials_key: config.credentials_key.clone(),
            reconcile_every: config.reconcile_every,
            // Offers need LISTEN: without it no answer (nor offer) arrives.
            starting: crate::session::Starting::new(metrics.sessions_starting.clone()),
            handoffs: crate::session::Handoffs::new(
                node.node_id.clone(),
                if config.events_poll.is_some() {
                    Duration::ZERO
                } else {
                    config.handoff_prepare
                },
            ),
        });
        let shared = NodeShared {
            services: services.clone(),
            status,
            base: MonoBase::new(),
            tracker: tracker.clone(),
            checks: checks.clone(),
            sessions: background.child_token(),
        };
        let background_tasks = TaskTracker::new();
        if config.events_poll.is_none() {
            // Prepares logins for the accounts peers offer this node (a node shutting down
            // prepares nothing).
            background_tasks.spawn(
                crate::handoff::serve(services.clone(), shutdown.child_token()).in_current_span(),
            );
        }
        background_tasks.spawn(
            forget_dead_nodes(pool.clone(), node.platform.clone(), background.clone())
                .in_current_span(),
        );

        // The cycle's own connection, with bounds that outwait the node's other statements.
        let cycle_session = db::Session {
            bounds: SessionBounds::for_cycle(node.fence),
            pooler: config.database_pooler,
        };
        let lease_loop = LeaseLoop {
            node: node.clone(),
            instance_id,
            connect: db::node_options(&config.database_url, &node.node_id, cycle_session)
                .context("invalid `database_url`")?,
            session: cycle_session,
            supervisor: Supervisor::new(shared, event_tx),
            events: event_rx,
            wake,
            starting: services.starting.clone(),
            state: state_tx,
            metrics,
        };
        let loop_shutdown = shutdown.clone();
        let task = tokio::spawn(
            async move {
                let result = lease_loop.run(loop_shutdown).await;
                // Also cancels every account session still running (their tokens are children).
                background.cancel();
                tracker.close();
                background_tasks.close();
                // Tasks left running were given the shutdown grace; they end with the process.
                let _ = tokio::time::timeout(TASKS_STOP_WITHIN, tracker.wait()).await;
                let _ = tokio::time::timeout(TASKS_STOP_WITHIN, background_tasks.wait()).await;
                // The last releases' checks (announced again if still free a second on: the
                // receiver a shutdown named did not claim), before the pool closes.
                checks.close();
                let _ = tokio::time::timeout(CHECKS_WITHIN, checks.wait()).await;
                services.brokers.close_all();
                writer_cancel.cancel();
                let _ = tokio::time::timeout(STATUS_FLUSH_WITHIN, writer).await;
                pool.close().await;
                http_cancel.cancel();
                match &result {
                    Ok(()) => info!("node stopped"),
                    Err(e) => tracing::error!(error = %e, "node stopped"),
                }
                result.map_err(anyhow::Error::from)
            }
            .in_current_span(),
        );
        Ok(NodeHandle {
            state: state_rx,
            http_addr,
            shutdown,
            task,
        })
    }
    .instrument(span)
    .await
}

/// Waits for the database (logging each failed attempt), then refuses pending migrations
/// unless `--migrate`, in which case it applies them.
async fn check_schema(
    config: &Config,
    session: db::Session,
    migrate: bool,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    if migrate && session.pooler == db::Pooler::Transaction {
        bail!(
            "`--migrate` cannot run through a transaction pooler (`database_pooler = \"transaction\"`: migrations hold a session-level advisory lock): run `copier-node migrate` against PostgreSQL directly, then start the node without `--migrate`"
        );
    }
    let admin = db::admin_options(&config.database_url).context("invalid `database_url`")?;
    let mut retry = crate::retry::DATABASE_AT_START.start();
    let mut conn = loop {
        let attempt = tokio::time::timeout(Duration::from_secs(10), admin.connect()).await;
        if let Ok(Ok(conn)) = attempt {
            break conn;
        }
        let delay = retry.failed();
        match attempt {
            Ok(Err(e)) => {
                warn!(error = %db::describe(&e), retry_in_ms = delay.as_millis() as u64, "database unreachable; retrying")
            }
            _ => warn!(
                retry_in_ms = delay.as_millis() as u64,
                "database did not answer within 10s; retrying"
            ),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.cancelled() => bail!("shut down while waiting for the database"),
        }
    };
    if migrate {
        let applied = db::migrate::apply(&mut conn)
            .await
            .context("applying migrations")?;
        if !applied.is_empty() {
            info!(?applied, "migrations applied");
        }
    }
    let state = db::run_on(&mut conn, &session, async |c| {
        db::migrate::schema_state(c).await
    })
    .await
    .context("reading the schema version")?;
    if let Some(refusal) = state.refusal() {
        bail!("{refusal}");
    }
    if !state.unknown.is_empty() {
        warn!(versions = ?state.unknown, "the database has migrations this binary does not know (a newer binary applied them); running anyway, as migrations are additive");
    }
    let _ = conn.close().await;
    Ok(())
}

async fn forget_dead_nodes(pool: db::Db, platform: String, cancel: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(FORGET_DEAD_NODES_EVERY) => {}
            _ = cancel.cancelled() => return,
        }
        let result = pool
            .run(async |c| db::lease::forget_dead_nodes(c, &platform).await)
            .await;
        match result {
            Ok(0) => {}
            Ok(n) => info!(
                nodes = n,
                "forgot memberships of nodes dead for over an hour"
            ),
            Err(e) => {
                warn!(error = %db::describe(&e), "could not clean up dead memberships (retried later)")
            }
        }
    }
}
