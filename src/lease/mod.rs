//! The lease loop: one cycle statement per period, the node's trust deadline, and the order in
//! which a confirmed cycle reaches the account gates.
//!
//! Per cycle: read `t0` (monotonic) -> run the cycle statement under a bound -> on the
//! acknowledged result, hand it to the supervisor, which closes the gates of accounts no longer
//! owned and extends the others to `t0 + lease - fence`. A failed cycle extends nothing: the
//! gates close at their deadline whatever the database does, and reopen only after a successful
//! renewal. Peers' membership expiries schedule an extra claim for the moment their leases end
//! (failover at expiry), and a peer's release announcement triggers a claim at once (handoff).

pub mod balance;
pub mod core;

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

pub use self::core::Core;
use crate::config::{NodeConfig, show};
use crate::db;
use crate::metrics::Metrics;
pub use crate::node_state::{NodeState, Phase};
use crate::supervisor::{Event, NodeHost, Supervisor};

/// How long a shutdown waits for account tasks to finish their work in flight before it
/// releases what has stopped and exits. Deployments give the process longer than this to stop
/// (systemd `TimeoutStopSec`, Kubernetes `terminationGracePeriodSeconds`).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Added to a peer's membership expiry before claiming its rows: the claim needs
/// `lease_until < now()` on the database's clock, and the expiry was read mid-statement.
pub(crate) const EXPIRY_SLACK: Duration = Duration::from_millis(25);

/// How soon a node with room claims again when free accounts remain after a cycle.
pub(crate) const RECLAIM_SOON: Duration = Duration::from_millis(10);

/// How many of a node's sessions may be starting at once (claimed, not yet logged in and
/// reconciled): a cycle claims no more than leaves room for, so a cold start of many accounts
/// is paced by how fast they start, and the database and brokers are not asked for every
/// account's start-up reads and login at once.
pub const STARTING_AT_ONCE: usize = 1000;

// A receiver prepares as many hand-offs at once as it may start sessions: it can claim no more.
const _: () = assert!(crate::handoff::MAX_PREPARED == STARTING_AT_ONCE);

/// When the node's claims wait for its own sessions to start (admission bounds them and more
/// than this many are still starting), it keeps its cycle period and claims again early only
/// once no more than this many are still starting: such a claim admits at least half of
/// [`STARTING_AT_ONCE`], so the renewal of everything the node holds is not repeated for a few
/// accounts at a time.
pub const ADMIT_WHEN_STARTING: usize = STARTING_AT_ONCE / 2;

/// That early claim comes no sooner than this after the end of the cycle that found the claims
/// waiting...
pub(crate) const ADMIT_AGAIN: Duration = Duration::from_secs(1);

/// ... nor sooner than this many times that cycle's duration (whichever is later): on a slow
/// database the admission cycles take at most a tenth of the node's time.
pub(crate) const ADMIT_SPACING: u32 = 10;

/// Fraction of the period that jitter may remove (jitter only ever shortens a cycle).
pub(crate) const JITTER: f64 = 0.2;

/// Why a node stopped on its own.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(
        "node id `{node_id}` is in use by another live process (instance {other}): its membership was still being renewed after this process waited a full lease ({lease}); exiting having taken nothing. Give every replica a distinct node_id (e.g. the pod name, or copier-node@<n>)"
    )]
    NodeIdInUse {
        node_id: String,
        other: String,
        lease: String,
    },
    #[error(
        "node id `{node_id}` was taken over by another instance ({other}) while this process could not renew its membership; exiting without touching its accounts (the other instance re-claims them with new epochs)"
    )]
    NodeIdTakenOver { node_id: String, other: String },
}

/// Everything the loop needs; built by the app.
pub struct LeaseLoop {
    pub node: NodeConfig,
    pub instance_id: String,
    pub connect: PgConnectOptions,
    /// How the connection gets its safety bounds (checked before it carries a cycle).
    pub session: db::Session,
    pub supervisor: Supervisor,
    pub events: mpsc::UnboundedReceiver<Event>,
    pub wake: Arc<crate::hub::Wake>,
    /// The node's sessions still starting: claims that wait for them run once enough are through.
    pub starting: Arc<crate::session::Starting>,
    pub state: watch::Sender<NodeState>,
    pub metrics: Arc<Metrics>,
}

impl LeaseLoop {
    /// Runs until `shutdown` fires and the node has released what it holds, or until the node id
    /// turns out to belong to another live process.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), NodeError> {
        let LeaseLoop {
            node,
            instance_id,
            connect,
            session,
            supervisor,
            mut events,
            wake,
            starting,
            state,
            metrics,
        } = self;
        let mut core = Core::new(
            node,
            instance_id,
            supervisor,
            state,
            metrics,
            fastrand::Rng::new(),
        );
        let mut conn: Option<PgConnection> = None;
        let mut next = Instant::now();
        // Cycles since the database's replication promise was last read.
        let mut unread: u32 = 0;
        // A release announcement woke the loop: its next cycle may claim what this node
        // prepared, and the supervisor's host asks for their rows beside it.
        let mut woken = false;
        wake.set_room(core.room());
        loop {
            let lapse_at = core.lapse_at();
            let draining = core.draining();
            let far = Instant::now() + Duration::from_secs(3600);
            // While a cycle runs (its branch below), nothing else is polled: session exits,
            // release replies and the shutdown wait for its read-back to be applied. The core
            // relies on it: a release that commits just after a cycle's snapshot must still be
            // in flight when that read-back is applied, or the read-back would restart the
            // released account at its old epoch (the simulator found what breaks without it).
            tokio::select! {
                biased;
                _ = shutdown.cancelled(), if draining.is_none() => {
                    if core.begin_shutdown(Instant::now()) {
                        // Tell the peers now that this node leaves their fair shares.
                        next = Instant::now();
                    }
                }
                Some(event) = events.recv() => core.handle(event),
                _ = sleep_until(lapse_at.unwrap_or(far)), if lapse_at.is_some() => {
                    core.lapsed(Instant::now());
                }
                _ = sleep_until(draining.unwrap_or(far)), if draining.is_some() => {
                    warn!(unfinished = core.supervisor.unfinished_epochs().len(), "shutdown grace ran out: releasing the accounts whose sessions stopped; the rest move when their leases expire");
                    break;
                }
                _ = sleep_until(next) => {
                    wake.room_until(Instant::now() + core.late_after());
                    if std::mem::take(&mut woken) {
                        core.supervisor.claims_soon();
                    }
                    next = cycle(&mut core, &connect, &session, &mut conn, &mut unread).await?;
                    core.supervisor.claims_over();
                }
                _ = wake.notified(), if draining.is_none() => {
                    debug!("release announced by a peer (or listener reconnected): claiming now");
                    next = Instant::now();
                    woken = true;
                }
                _ = starting.at_most(ADMIT_WHEN_STARTING), if core.awaits_admission() && draining.is_none() => {
                    if let Some(at) = core.admission() {
                        debug!(starting = starting.count(), "enough of the node's sessions started: claiming again");
                        next = next.min(at.max(Instant::now()));
                    }
                }
            }
            // What the hub and the hand-off receiver go by until the next turn.
            wake.set_room(core.room());
            if core.drained() {
                break;
            }
        }
        leave(&core, &connect, &session, &mut conn).await;
        core.publish(|s| s.phase = Phase::Stopped);
        Ok(())
    }
}

/// Runs one cycle and returns when the next one is due.
async fn cycle(
    core: &mut Core<NodeHost>,
    connect: &PgConnectOptions,
    session: &db::Session,
    conn: &mut Option<PgConnection>,
    unread: &mut u32,
) -> Result<Instant, NodeError> {
    crate::failpoints::failpoint!(
        "COPIERTEST_STALL_CYCLE",
        "lease loop stalled before a cycle"
    );
    let t0 = Instant::now();
    let prepared = core.prepare(t0);
    let bound = prepared.bound;
    let params = core.params(&prepared);
    let new_connection = conn.is_none();
    let result = timeout(bound, async {
        if conn.is_none() {
            let mut fresh = connect.connect().await?;
            db::open_session(&mut fresh, session).await?;
            *conn = Some(fresh);
        }
        let c = conn.as_mut().expect("connected above");
        db::lease::cycle_on(c, session, &params).await
    })
    .await;
    let acknowledged = Instant::now();
    let outcome = match result {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) => {
            *conn = None;
            return Ok(core.failed(acknowledged, db::describe(&e)));
        }
        Err(_) => {
            *conn = None;
            return Ok(core.failed(
                acknowledged,
                format!("no answer within {} (connection dropped)", show(bound)),
            ));
        }
    };
    let next = core.acknowledged(t0, acknowledged, &outcome)?;
    if let Some(owned) = core.take_owned_to_publish() {
        publish_owned(core, session, conn, owned).await;
    }
    if core.take_departure() {
        announce_departure(core, session, conn).await;
    }
    *unread += 1;
    if outcome.member && (new_connection || *unread >= REPLICATION_EVERY) {
        *unread = 0;
        read_replication(core, session, conn).await;
    }
    Ok(next)
}

/// Publishes what the node owns after a cycle that claimed ([`Core::take_owned_to_publish`]).
/// A failure costs only accuracy: the next cycle publishes it anyway.
async fn publish_owned(
    core: &Core<NodeHost>,
    session: &db::Session,
    conn: &mut Option<PgConnection>,
    owned: u32,
) {
    let (node_id, instance_id) = (&core.node.node_id, &core.instance_id);
    if let Err(error) = after_cycle(core, session, conn, async |c| {
        db::lease::publish_owned(c, node_id, instance_id, owned).await
    })
    .await
    {
        debug!(error = %error, "could not publish the accounts owned after the cycle's claims; the next cycle does");
    }
}

/// Tells every peer that this node left the fair shares, after its shutdown's first cycle
/// ([`Core::take_departure`]). A failure costs only time: the peers learn it at their next
/// cycles, and the hand-offs that find no receiver ready release their accounts to whoever has
/// room.
async fn announce_departure(
    core: &mut Core<NodeHost>,
    session: &db::Session,
    conn: &mut Option<PgConnection>,
) {
    let (node_id, platform) = (&core.node.node_id, &core.node.platform);
    match after_cycle(core, session, conn, async |c| {
        db::lease::announce_departure(c, node_id, platform).await
    })
    .await
    {
        Ok(()) => {
            core.note_departure_announced();
            info!("departure announced: the peers count their shares without this node")
        }
        Err(error) => {
            warn!(error = %error, "could not announce the departure; the peers learn it at their next cycles")
        }
    }
}

/// A statement right after a confirmed cycle, on the cycle's connection, bounded by a late
/// cycle's time (it holds up the loop). On failure the connection may be mid-statement: it is
/// dropped, and the next cycle opens a new one.
async fn after_cycle(
    core: &Core<NodeHost>,
    session: &db::Session,
    conn: &mut Option<PgConnection>,
    work: impl AsyncFnOnce(&mut PgConnection) -> Result<(), sqlx::Error>,
) -> Result<(), String> {
    let Some(c) = conn.as_mut() else {
        return Err("no connection".into());
    };
    let error = match timeout(core.late_after(), db::run_on(c, session, work)).await {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(e)) => db::describe(&e),
        Err(_) => format!("no answer within {}", show(core.late_after())),
    };
    *conn = None;
    Err(error)
}

/// How many cycles the database's replication promise may go unread: it changes without a new
/// connection when the cluster manager drops to asynchronous replication (Patroni with
/// `synchronous_mode` when the synchronous standby fails) or raises it again, and
/// `copier_db_synchronous` must follow within a few cycles.
const REPLICATION_EVERY: u32 = 3;

/// After a cycle on a new connection, and every [`REPLICATION_EVERY`] cycles: what the database
/// promises, published, and a change logged (a new timeline: a failover of the database, which
/// may have lost acknowledged writes; commits starting or ceasing to wait for a standby). Read
/// after the cycle, so it never delays a renewal; a failure here changes nothing.
async fn read_replication(
    core: &Core<NodeHost>,
    session: &db::Session,
    conn: &mut Option<PgConnection>,
) {
    let conn_slot = conn;
    let Some(conn) = conn_slot.as_mut() else {
        return;
    };
    let read = db::run_on(conn, session, async |c| db::replication::read(c).await);
    let Ok(Ok(now)) = timeout(core.node.fence, read).await else {
        // The connection may be mid-statement or inside a transaction: the next cycle opens a
        // new one, as after a failed cycle.
        *conn_slot = None;
        return;
    };
    let before = core.state().db;
    match (before.and_then(|b| b.timeline), now.timeline) {
        (Some(old), Some(new)) if old != new => warn!(
            old_timeline = old,
            timeline = new,
            "the database is on a new timeline: it failed over, and writes the old primary acknowledged may be lost"
        ),
        _ if before.is_some_and(|b| b.synchronous != now.synchronous) => warn!(
            synchronous = now.synchronous,
            "database: {}",
            if now.synchronous {
                "commits wait for a synchronous standby again"
            } else {
                "commits no longer wait for a standby (a failover may lose the last ones)"
            }
        ),
        _ if before.is_none() => info!(
            timeline = ?now.timeline,
            synchronous = now.synchronous,
            "database: {}",
            if now.synchronous {
                "commits wait for a synchronous standby"
            } else {
                "commits do not wait for a standby (a failover may lose the last ones)"
            }
        ),
        _ => {}
    }
    core.publish(|s| s.db = Some(now));
}

/// Releases every row whose task has returned, deletes the membership (if nothing else names the
/// node) and announces it, so peers claim at once.
async fn leave(
    core: &Core<NodeHost>,
    connect: &PgConnectOptions,
    session: &db::Session,
    conn: &mut Option<PgConnection>,
) {
    // The rows of the last cycle, some of them handed off since: the leave frees and locks only
    // those still this node's (see `db::lease::RELEASE_SQL`), so a peer claiming the others
    // does not skip them.
    let (held, kept) = core.leave_rows();
    let announced = core.departure_announced();
    let node = &core.node;
    let mut retry = crate::retry::LEAVE.start();
    let give_up = Instant::now() + node.lease.saturating_sub(node.fence);
    loop {
        let attempt = timeout(node.fence, async {
            if conn.is_none() {
                let mut fresh = connect.connect().await?;
                db::open_session(&mut fresh, session).await?;
                *conn = Some(fresh);
            }
            let c = conn.as_mut().expect("connected above");
            db::run_on(c, session, async |c| {
                db::lease::leave(
                    c,
                    &node.node_id,
                    &core.instance_id,
                    &node.platform,
                    &held,
                    announced,
                )
                .await
            })
            .await
        })
        .await;
        match attempt {
            Ok(Ok(out)) => {
                info!(
                    released = out.released.len(),
                    kept,
                    left = out.left,
                    "released accounts and left the cluster"
                );
                return;
            }
            Ok(Err(e)) => {
                *conn = None;
                warn!(error = %db::describe(&e), "release at shutdown failed");
            }
            Err(_) => {
                *conn = None;
                warn!("release at shutdown timed out");
            }
        }
        let delay = retry.failed();
        if Instant::now() + delay >= give_up {
            error!(
                accounts = held.len(),
                "could not release at shutdown: the accounts move to other nodes when their leases expire"
            );
            return;
        }
        tokio::time::sleep(delay).await;
    }
}

/// Delay before retrying after the n-th consecutive failed cycle (n >= 1): from a tenth of the
/// period, doubling, capped at one period.
pub fn retry_delay(failures: u32, cycle: Duration) -> Duration {
    crate::retry::lease_cycle(cycle).delay(failures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loop_that_finishes_no_cycle_for_a_lease_is_unhealthy() {
        let t0 = Instant::now();
        let lease = Duration::from_secs(3);
        let state = |phase, last: Option<Instant>| NodeState {
            phase,
            last_cycle_at: last,
            lease,
            ..NodeState::default()
        };
        let later = |d: u64| t0 + Duration::from_millis(d);
        assert_eq!(
            state(Phase::Running, Some(t0)).unhealthy(later(3_000)),
            None
        );
        let stuck = state(Phase::Running, Some(t0)).unhealthy(later(3_001));
        assert!(
            stuck
                .as_deref()
                .is_some_and(|w| w.contains("no cycle finished for 3.0s")),
            "{stuck:?}"
        );
        assert!(
            state(Phase::Draining, Some(t0))
                .unhealthy(later(9_000))
                .is_some()
        );
        // Waiting for the database at start is not stuck (liveness holds during an outage).
        assert_eq!(state(Phase::Starting, None).unhealthy(later(60_000)), None);
        assert_eq!(
            state(Phase::Stopped, Some(t0)).unhealthy(t0).as_deref(),
            Some("stopped")
        );
    }

    #[test]
    fn retries_back_off_to_one_cycle() {
        let cycle = Duration::from_secs(20);
        assert_eq!(retry_delay(1, cycle), Duration::from_secs(2));
        assert_eq!(retry_delay(2, cycle), Duration::from_secs(4));
        assert_eq!(retry_delay(4, cycle), Duration::from_secs(16));
        assert_eq!(retry_delay(5, cycle), cycle);
        assert_eq!(retry_delay(500, cycle), cycle);
        assert_eq!(
            retry_delay(1, Duration::from_millis(50)),
            Duration::from_millis(10)
        );
    }
}
