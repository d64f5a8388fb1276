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

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};
use tokio::sync::{Notify, mpsc, watch};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::config::{NodeConfig, show};
use crate::db;
use crate::db::lease::{CycleOutcome, CycleParams};
use crate::metrics::Metrics;
pub use crate::node_state::{NodeState, Phase};
use crate::supervisor::{Event, Supervisor};
use crate::trust;

/// How long a shutdown waits for account tasks to finish their work in flight before it
/// releases what has stopped and exits. Deployments give the process longer than this to stop
/// (systemd `TimeoutStopSec`, Kubernetes `terminationGracePeriodSeconds`).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Added to a peer's membership expiry before claiming its rows: the claim needs
/// `lease_until < now()` on the database's clock, and the expiry was read mid-statement.
const EXPIRY_SLACK: Duration = Duration::from_millis(25);

/// How soon a node with room claims again when free accounts remain after a cycle.
const RECLAIM_SOON: Duration = Duration::from_millis(10);

/// Fraction of the period that jitter may remove (jitter only ever shortens a cycle).
const JITTER: f64 = 0.2;

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
    pub supervisor: Supervisor,
    pub events: mpsc::UnboundedReceiver<Event>,
    pub wake: Arc<Notify>,
    pub state: watch::Sender<NodeState>,
    pub metrics: Arc<Metrics>,
}

/// Mutable bookkeeping of a running loop.
struct Run {
    conn: Option<PgConnection>,
    /// Epochs of every row the last confirmed cycle returned (renewed as they are next time).
    held: Vec<i64>,
    /// Rows wanted by this node after the last cycle (counts against capacity).
    wanted: usize,
    deadline: Option<Instant>,
    last_ack: Option<Instant>,
    lapse_logged: bool,
    member_ever: bool,
    conflict_since: Option<Instant>,
    failures: u32,
    draining: Option<Instant>,
    /// Fair share from the last cycle's view of the platform.
    target: Option<u32>,
    /// Handing accounts off until back at the share (hysteresis).
    shedding: bool,
    /// When this node last handed accounts off: at most one step per cycle period, however
    /// often peers' release announcements wake the loop early.
    last_handoff: Option<Instant>,
    /// The database's timeline as the last cycle saw it.
    timeline: Option<i64>,
    /// A cycle has reported on the database before.
    database_seen: bool,
    /// Until when claims wait (a grace after a database failover).
    grace_until: Option<Instant>,
}

impl LeaseLoop {
    /// Runs until `shutdown` fires and the node has released what it holds, or until the node id
    /// turns out to belong to another live process.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<(), NodeError> {
        let mut run = Run {
            conn: None,
            held: Vec::new(),
            wanted: 0,
            deadline: None,
            last_ack: None,
            lapse_logged: false,
            member_ever: false,
            conflict_since: None,
            failures: 0,
            draining: None,
            target: None,
            shedding: false,
            last_handoff: None,
            timeline: None,
            database_seen: false,
            grace_until: None,
        };
        let mut next = Instant::now();
        loop {
            let lapse_at = run.deadline.filter(|_| !run.lapse_logged);
            let far = Instant::now() + Duration::from_secs(3600);
            tokio::select! {
                biased;
                _ = shutdown.cancelled(), if run.draining.is_none() => {
                    info!(accounts = self.supervisor.owned().len(), "shutdown requested: closing every gate, stopping account sessions, then releasing");
                    self.supervisor.begin_shutdown();
                    run.draining = Some(Instant::now() + SHUTDOWN_GRACE);
                    self.publish(&run, |s| s.phase = Phase::Draining);
                }
                Some(event) = self.events.recv() => {
                    self.supervisor.handle(event);
                    self.publish(&run, |_| {});
                }
                _ = sleep_until(lapse_at.unwrap_or(far)), if lapse_at.is_some() => {
                    run.lapse_logged = true;
                    let since = run.last_ack.map(|a| a.elapsed().as_secs_f64()).unwrap_or_default();
                    warn!(accounts = self.supervisor.owned().len(), seconds_since_confirmed_renewal = format!("{since:.1}"), "gate closed: lease trust lapsed; no order is sent until a renewal succeeds");
                    self.publish(&run, |_| {});
                }
                _ = sleep_until(run.draining.unwrap_or(far)), if run.draining.is_some() => {
                    warn!(unfinished = self.supervisor.unfinished_epochs().len(), "shutdown grace ran out: releasing the accounts whose sessions stopped; the rest move when their leases expire");
                    break;
                }
                _ = sleep_until(next) => {
                    next = self.cycle(&mut run).await?;
                }
                _ = self.wake.notified(), if run.draining.is_none() => {
                    debug!("release announced by a peer (or listener reconnected): claiming now");
                    next = Instant::now();
                }
            }
            if run.draining.is_some() && self.supervisor.is_idle() {
                break;
            }
        }
        self.leave(&mut run).await;
        self.publish(&run, |s| s.phase = Phase::Stopped);
        Ok(())
    }

    /// Runs one cycle and returns when the next one is due.
    async fn cycle(&mut self, run: &mut Run) -> Result<Instant, NodeError> {
        crate::failpoints::failpoint!(
            "COPIERTEST_STALL_CYCLE",
            "lease loop stalled before a cycle"
        );
        let lease = self.node.lease;
        let window = lease.saturating_sub(self.node.fence);
        let t0 = Instant::now();
        // While trusted, no cycle may run past the trust deadline; while gated, a full window.
        let bound = match run.deadline {
            Some(d) if trust::holds(t0, d) => (d - t0).min(window),
            _ => window,
        };
        // Gates open without a break up to now: the only rows kept through a database grace.
        let kept: Vec<i64> = if run.deadline.is_some_and(|d| trust::holds(t0, d)) {
            self.supervisor.owned().into_values().collect()
        } else {
            Vec::new()
        };
        let params = CycleParams {
            node_id: &self.node.node_id,
            instance_id: &self.instance_id,
            platform: &self.node.platform,
            capacity: self.node.capacity,
            claim_limit: run
                .target
                .map_or(self.node.capacity, |t| t.min(self.node.capacity)),
            trust: window,
            owned: self.supervisor.owned().len() as u32,
            lease,
            held: &run.held,
            claim: run.draining.is_none(),
            kept: &kept,
        };
        let connect = &self.connect;
        let new_connection = run.conn.is_none();
        let conn_slot = &mut run.conn;
        let result = timeout(bound, async {
            if conn_slot.is_none() {
                *conn_slot = Some(connect.connect().await?);
            }
            let conn = conn_slot.as_mut().expect("connected above");
            db::lease::cycle(conn, &params).await
        })
        .await;
        let acknowledged = Instant::now();
        let outcome = match result {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(e)) => return Ok(self.failed(run, db::describe(&e))),
            Err(_) => {
                return Ok(self.failed(
                    run,
                    format!("no answer within {} (connection dropped)", show(bound)),
                ));
            }
        };
        if !outcome.member {
            return self.conflict(run, &outcome, acknowledged);
        }
        let deadline = trust::deadline(t0, lease, self.node.fence);
        self.metrics
            .lease_cycle_duration
            .observe((acknowledged - t0).as_secs_f64());
        self.metrics.lease_cycles.with_label_values(&["ok"]).inc();
        if run.failures > 0 || run.lapse_logged {
            let since = run
                .last_ack
                .map(|a| (acknowledged - a).as_secs_f64())
                .unwrap_or_default();
            info!(
                seconds_since_previous_renewal = format!("{since:.1}"),
                failed_cycles = run.failures,
                "lease cycle succeeded again"
            );
        }
        if !run.member_ever {
            info!(instance_id = %self.instance_id, "joined the cluster (membership registered)");
        }
        run.member_ever = true;
        run.conflict_since = None;
        run.failures = 0;
        run.lapse_logged = false;
        run.last_ack = Some(acknowledged);
        // Gates first (the supervisor closes what is no longer ours), then the node's deadline.
        let restored = self
            .supervisor
            .apply(&outcome.owned, acknowledged, deadline) as u64;
        run.deadline = Some(deadline);
        run.held = outcome.owned.iter().map(|r| r.epoch).collect();
        run.wanted = outcome.owned.iter().filter(|r| r.wanted).count();
        self.watch_database(run, &outcome.database, acknowledged);
        self.metrics.accounts_claimable.set(outcome.free as i64);
        // Nobody can claim during a grace: handing accounts off would only leave them unowned.
        let moved = if outcome.database.grace.is_zero() {
            self.rebalance(run, &outcome)
        } else {
            0
        };
        let cycle_ms = (acknowledged - t0).as_secs_f64() * 1000.0;
        debug!(
            owned = run.wanted,
            cycle_ms = format!("{cycle_ms:.2}"),
            "lease cycle"
        );
        self.publish(run, |s| {
            s.phase = if run.draining.is_some() {
                Phase::Draining
            } else {
                Phase::Running
            };
            s.cycles += 1;
            s.last_cycle_at = Some(Instant::now());
            s.last_error = None;
            s.trust_restorations += restored;
            s.target = run.target;
            s.rebalance_moves += moved;
            s.handoffs += u64::from(moved > 0);
        });
        if new_connection {
            self.read_replication(run).await;
        }
        Ok(self.schedule(run, t0, acknowledged, &outcome))
    }

    /// What the cycle saw of the database: a failover (a new timeline, or a grace this node had
    /// not seen) makes every follower drop its masters' (epoch, seq), which may have rewound
    /// with the lost tail, and reconcile; the grace is published for `/metrics` and logged.
    fn watch_database(
        &mut self,
        run: &mut Run,
        db: &db::lease::DatabaseView,
        acknowledged: Instant,
    ) {
        let timeline_changed =
            matches!((run.timeline, db.timeline), (Some(old), Some(new)) if old != new);
        // A grace this node had not seen (another node detected the failover, or the timeline
        // cannot be read and only the system identifier changed); not on the node's first cycle,
        // when its sessions have nothing to forget yet.
        let grace_began = !db.grace.is_zero() && run.grace_until.is_none() && run.database_seen;
        run.database_seen = true;
        if db.failed_over || timeline_changed || grace_began {
            warn!(
                old_timeline = ?run.timeline,
                timeline = ?db.timeline,
                detected_here = db.failed_over,
                grace_s = format!("{:.1}", db.grace.as_secs_f64()),
                kept = run.held.len(),
                era_start = ?db.era_start,
                "database failed over: writes the old primary acknowledged may be lost; keeping only the accounts whose gates stayed open, claiming nothing until the grace ends, and reconciling every follower"
            );
            self.metrics.db_failovers.inc();
            self.supervisor.database_failed_over();
            self.publish(run, |s| s.db_failovers += 1);
        }
        if db.timeline.is_some() {
            run.timeline = db.timeline;
        }
        let until = (!db.grace.is_zero()).then(|| acknowledged + db.grace);
        if run.grace_until.is_some() && until.is_none() {
            info!("database grace over: claiming again");
        }
        run.grace_until = until;
        let timeline = db.timeline;
        self.publish(run, |s| {
            s.grace_until = until;
            if let Some(d) = s.db.as_mut() {
                d.timeline = timeline.or(d.timeline);
            }
        });
    }

    /// After a cycle on a new connection: what the database promises, published, and a changed
    /// timeline (a failover of the database, which may have lost acknowledged writes) logged.
    /// Read after the cycle, so it never delays a renewal; a failure here changes nothing.
    async fn read_replication(&mut self, run: &mut Run) {
        let Some(conn) = run.conn.as_mut() else {
            return;
        };
        let bound = self.node.fence;
        let Ok(Ok(now)) = timeout(bound, db::replication::read(conn)).await else {
            return;
        };
        let before = self.state.borrow().db;
        match (before.and_then(|b| b.timeline), now.timeline) {
            (Some(old), Some(new)) if old != new => warn!(
                old_timeline = old,
                timeline = new,
                "the database is on a new timeline: it failed over, and writes the old primary acknowledged may be lost"
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
        self.publish(run, |s| s.db = Some(now));
    }

    /// Computes this node's fair share from the cycle's view of the platform and hands off what
    /// is above it (bounded per cycle, with hysteresis). Returns the accounts handed off.
    fn rebalance(&mut self, run: &mut Run, outcome: &CycleOutcome) -> u64 {
        let owned = self.supervisor.owned().len() as u32;
        let me = &self.node.node_id;
        let mut members = vec![balance::Member {
            node_id: me.clone(),
            capacity: self.node.capacity,
        }];
        members.extend(
            outcome
                .peers
                .iter()
                .filter(|p| p.trusted)
                .map(|p| balance::Member {
                    node_id: p.node_id.clone(),
                    capacity: p.capacity,
                }),
        );
        let total = owned as u64
            + outcome
                .peers
                .iter()
                .filter(|p| p.live)
                .map(|p| p.owned as u64)
                .sum::<u64>()
            + outcome.free;
        let shares = balance::shares(&members, total);
        let target = shares.get(me).copied().unwrap_or(0);
        if run.target != Some(target) {
            info!(
                target,
                owned,
                live_nodes = members.len(),
                total,
                "fair share"
            );
        }
        run.target = Some(target);
        self.metrics.target_accounts.set(target as i64);
        if run.draining.is_some() {
            return 0;
        }
        // Cycles woken early (a peer's release announcement) claim, but hand nothing off: moves
        // stay bounded per cycle period, and two shedding nodes cannot wake each other into a
        // cascade of hand-offs.
        let period = self.node.cycle.mul_f64(1.0 - JITTER);
        if run.last_handoff.is_some_and(|at| at.elapsed() < period) {
            return 0;
        }
        let knobs = balance::Knobs {
            margin: self.node.rebalance_margin,
            step: self.node.rebalance_step,
        };
        // A peer far below its share (a node that just joined) while no account is free.
        let starved = outcome.free == 0
            && outcome.peers.iter().filter(|p| p.trusted).any(|p| {
                let share = shares.get(&p.node_id).copied().unwrap_or(0);
                p.owned + balance::margin(share, knobs) < share
            });
        let n = balance::to_release(owned, target, starved, &mut run.shedding, knobs);
        if n == 0 {
            return 0;
        }
        let moved = self.supervisor.rebalance(n as usize);
        if !moved.is_empty() {
            run.last_handoff = Some(Instant::now());
        }
        info!(
            handing_off = moved.len(),
            owned, target, starved, "rebalancing: above the fair share, handing accounts off"
        );
        self.metrics.rebalance_moves.inc_by(moved.len() as u64);
        moved.len() as u64
    }

    /// When the next cycle runs: a jittered period after `t0`, or earlier if a peer's membership
    /// (and so every lease it holds) expires before that and this node has room to claim.
    fn schedule(
        &self,
        run: &Run,
        t0: Instant,
        acknowledged: Instant,
        outcome: &CycleOutcome,
    ) -> Instant {
        let period = self.node.cycle.mul_f64(1.0 - JITTER * fastrand::f64());
        let mut next = t0 + period;
        let limit = run
            .target
            .map_or(self.node.capacity, |t| t.min(self.node.capacity)) as usize;
        let room = limit.saturating_sub(run.wanted) > 0;
        if let Some(end) = run.grace_until {
            // Nothing can be claimed before the grace ends: one cycle per period until then (not
            // the quick re-claims below, which would spin on free rows nobody may take), and one
            // right after it.
            if room && run.draining.is_none() {
                next = next.min(end + EXPIRY_SLACK);
            }
            return next;
        }
        if room && run.draining.is_none() && outcome.free > 0 {
            // Free accounts and room under a share that just grew (a peer left, accounts were
            // added): claim them now rather than a cycle later.
            next = next.min(acknowledged + RECLAIM_SOON);
        }
        if room && run.draining.is_none() {
            for peer in outcome.peers.iter().filter(|p| p.live) {
                let at = acknowledged + peer.expires_in + EXPIRY_SLACK;
                if at < next {
                    info!(peer = %peer.node_id, expires_in_ms = peer.expires_in.as_millis() as u64, "peer stopped renewing: claiming its accounts when its leases expire");
                    next = at;
                }
            }
        }
        next
    }

    fn failed(&mut self, run: &mut Run, reason: String) -> Instant {
        self.metrics
            .lease_cycles
            .with_label_values(&["failed"])
            .inc();
        run.conn = None;
        run.failures += 1;
        let backoff = retry_delay(run.failures, self.node.cycle);
        let trusted = run
            .deadline
            .is_some_and(|d| trust::holds(Instant::now(), d));
        warn!(error = %reason, attempt = run.failures, retry_in_ms = backoff.as_millis() as u64, trusted, "lease cycle failed");
        // What a failed cycle could not see is not reported as seen (the nodes that can see
        // the database report it).
        self.metrics.accounts_claimable.set(0);
        self.publish(run, |s| {
            s.failed_cycles += 1;
            s.last_cycle_at = Some(Instant::now());
            s.last_error = Some(reason.clone());
        });
        Instant::now() + backoff
    }

    /// The membership upsert did not match: another live instance holds this node id.
    fn conflict(
        &mut self,
        run: &mut Run,
        outcome: &CycleOutcome,
        acknowledged: Instant,
    ) -> Result<Instant, NodeError> {
        let (other, expires_in) = outcome
            .conflict
            .as_ref()
            .map(|c| (c.instance_id.clone(), c.expires_in))
            .unwrap_or_else(|| ("unknown".into(), Duration::ZERO));
        if run.member_ever {
            error!(other_instance = %other, "this node's membership was taken over by another instance");
            self.supervisor.begin_shutdown();
            return Err(NodeError::NodeIdTakenOver {
                node_id: self.node.node_id.clone(),
                other,
            });
        }
        let since = *run.conflict_since.get_or_insert(acknowledged);
        // A crashed predecessor's membership expires within one lease of the first sighting;
        // one more cycle of margin covers a slow statement. Still held then: a live duplicate.
        if acknowledged - since >= self.node.lease + self.node.cycle {
            return Err(NodeError::NodeIdInUse {
                node_id: self.node.node_id.clone(),
                other,
                lease: show(self.node.lease),
            });
        }
        warn!(other_instance = %other, expires_in_ms = expires_in.as_millis() as u64, "node id is held by another instance (a crashed predecessor, or a live duplicate): waiting for its membership to expire; taking nothing meanwhile");
        self.publish(run, |s| s.phase = Phase::WaitingForNodeId);
        let retry = (expires_in + EXPIRY_SLACK).min(self.node.cycle);
        Ok(acknowledged + retry)
    }

    /// Releases every row whose task has returned, deletes the membership (if nothing else
    /// names the node) and announces it, so peers claim at once.
    async fn leave(&mut self, run: &mut Run) {
        let unfinished = self.supervisor.unfinished_epochs();
        let epochs: Vec<i64> = run
            .held
            .iter()
            .copied()
            .filter(|e| !unfinished.contains(e))
            .collect();
        let kept: HashSet<i64> = run
            .held
            .iter()
            .copied()
            .filter(|e| unfinished.contains(e))
            .collect();
        let mut retry = crate::retry::LEAVE.start();
        let give_up = Instant::now() + self.node.lease.saturating_sub(self.node.fence);
        loop {
            let attempt = timeout(self.node.fence, async {
                if run.conn.is_none() {
                    run.conn = Some(self.connect.connect().await?);
                }
                let conn = run.conn.as_mut().expect("connected above");
                db::lease::leave(
                    conn,
                    &self.node.node_id,
                    &self.instance_id,
                    &self.node.platform,
                    &epochs,
                )
                .await
            })
            .await;
            match attempt {
                Ok(Ok(out)) => {
                    info!(
                        released = out.released.len(),
                        kept = kept.len(),
                        left = out.left,
                        "released accounts and left the cluster"
                    );
                    return;
                }
                Ok(Err(e)) => {
                    run.conn = None;
                    warn!(error = %db::describe(&e), "release at shutdown failed");
                }
                Err(_) => {
                    run.conn = None;
                    warn!("release at shutdown timed out");
                }
            }
            let delay = retry.failed();
            if Instant::now() + delay >= give_up {
                error!(
                    accounts = epochs.len(),
                    "could not release at shutdown: the accounts move to other nodes when their leases expire"
                );
                return;
            }
            tokio::time::sleep(delay).await;
        }
    }

    fn publish(&self, run: &Run, change: impl FnOnce(&mut NodeState)) {
        let owned = Arc::new(self.supervisor.owned());
        self.state.send_modify(|s| {
            s.trusted_until = run.deadline;
            s.owned = owned;
            change(s);
        });
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
