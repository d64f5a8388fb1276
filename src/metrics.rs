//! The node's Prometheus metrics: one registry per node (so several nodes in one test process
//! keep theirs apart), every series present from startup.

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

use tokio::time::Instant;

use crate::node_state::NodeState;

/// Buckets for millisecond-scale durations, in seconds (1 ms .. 10 s).
const MS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Order actions and outcomes counted in `copier_orders_total`.
pub(crate) const ACTIONS: &[&str] = &["open", "close", "modify"];
pub(crate) const RESULTS: &[&str] = &["accepted", "rejected", "unknown", "unavailable"];

/// Outcomes in `copier_handoff_logins_total`: a login prepared for an offered account, raised at
/// this node's claim (and of those, raised with what it read ahead current), logged out
/// unclaimed, or not made (or not raised) for an error.
pub(crate) const HANDOFF_OUTCOMES: &[&str] = &["prepared", "raised", "current", "unused", "failed"];

/// The legs of a copy's latency in `copier_copy_leg_seconds`.
pub(crate) const LEGS: &[&str] = &[
    "master_fill_to_event",
    "event_to_decision",
    "decision_to_accept",
];

#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    pub owned_accounts: IntGauge,
    pub lease_valid: IntGauge,
    pub lease_cycle_duration: Histogram,
    pub lease_cycles: IntCounterVec,
    pub orders: IntCounterVec,
    pub orders_gated: IntCounter,
    pub reconciles: IntCounter,
    pub copy_latency: Histogram,
    pub events_published: IntCounter,
    pub rebalance_moves: IntCounter,
    pub handoff_logins: IntCounterVec,
    pub target_accounts: IntGauge,
    pub copies_skipped: IntCounter,
    pub db_synchronous: IntGauge,
    pub db_timeline: IntGauge,
    pub db_grace: prometheus::Gauge,
    pub db_failovers: IntCounter,
    pub accounts_claimable: IntGauge,
    pub broker_sessions: IntGauge,
    pub notify_queue_usage: prometheus::Gauge,
    pub copy_legs: prometheus::HistogramVec,
    pub lease_cycles_renew_only: IntCounter,
    pub claim_room: IntGauge,
    pub sessions_starting: IntGauge,
    pub db_pool_wait: Histogram,
    pub db_background_waiting: IntGauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let owned_accounts = IntGauge::new(
            "copier_owned_accounts",
            "Accounts this node owns and runs a session for",
        )
        .expect("valid metric");
        let lease_valid = IntGauge::new(
            "copier_lease_valid",
            "1 while the node holds a confirmed lease cycle (its gate is open), else 0",
        )
        .expect("valid metric");
        let lease_cycle_duration = Histogram::with_opts(
            HistogramOpts::new(
                "copier_lease_cycle_duration_seconds",
                "Time from sending the lease cycle's statement to its acknowledgement",
            )
            .buckets(MS_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let lease_cycles = IntCounterVec::new(
            Opts::new("copier_lease_cycles_total", "Lease cycles by result"),
            &["result"],
        )
        .expect("valid metric");
        let orders = IntCounterVec::new(
            Opts::new(
                "copier_orders_total",
                "Orders sent to brokers by action and result",
            ),
            &["action", "result"],
        )
        .expect("valid metric");
        let orders_gated = IntCounter::new(
            "copier_orders_gated_total",
            "Orders not sent because the account's gate (HoldsLease) was closed",
        )
        .expect("valid metric");
        let reconciles = IntCounter::new(
            "copier_reconciles_total",
            "Reconciles of a follower against a master's snapshot",
        )
        .expect("valid metric");
        let copy_latency = Histogram::with_opts(
            HistogramOpts::new("copier_copy_latency_seconds", "From a master event's arrival at the node to the broker's acknowledgement of the copy").buckets(MS_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let events_published = IntCounter::new(
            "copier_master_events_published_total",
            "Master events published by this node",
        )
        .expect("valid metric");
        let rebalance_moves = IntCounter::new(
            "copier_rebalance_moves_total",
            "Accounts this node handed off to reach its fair share",
        )
        .expect("valid metric");
        let handoff_logins = IntCounterVec::new(
            Opts::new(
                "copier_handoff_logins_total",
                "Logins prepared for accounts peers offered this node, by outcome (prepared, raised at the claim, current: raised with what it read ahead current, unused, failed)",
            ),
            &["outcome"],
        )
        .expect("valid metric");
        for outcome in HANDOFF_OUTCOMES {
            handoff_logins.with_label_values(&[outcome]);
        }
        let target_accounts = IntGauge::new(
            "copier_target_accounts",
            "This node's fair share of its platform's accounts",
        )
        .expect("valid metric");
        let copies_skipped = IntCounter::new(
            "copier_copies_skipped_total",
            "Master positions a link decided not to copy (each reason is in copy_skips)",
        )
        .expect("valid metric");
        for result in ["ok", "failed"] {
            lease_cycles.with_label_values(&[result]);
        }
        for action in ACTIONS {
            for result in RESULTS {
                orders.with_label_values(&[action, result]);
            }
        }
        let db_synchronous = IntGauge::new(
            "copier_db_synchronous",
            "1 when the database's commits wait for a synchronous standby, 0 when they do not (or not known yet)",
        )
        .expect("valid metric");
        let db_timeline = IntGauge::new(
            "copier_db_timeline",
            "The database's WAL timeline (a new one after a failover); -1 when it cannot be read",
        )
        .expect("valid metric");
        let db_grace = prometheus::Gauge::new(
            "copier_db_grace_seconds",
            "Seconds until claims resume after a database failover (0 outside a grace)",
        )
        .expect("valid metric");
        let db_failovers = IntCounter::new(
            "copier_db_failovers_total",
            "Database failovers this node saw (a new WAL timeline or system identifier)",
        )
        .expect("valid metric");
        let accounts_claimable = IntGauge::new(
            "copier_accounts_claimable",
            "Enabled accounts of this node's platform that are free or held by dead nodes, as its last lease cycle saw them",
        )
        .expect("valid metric");
        let broker_sessions = IntGauge::new(
            "copier_broker_sessions",
            "Account sessions of this node logged in to their broker",
        )
        .expect("valid metric");
        let notify_queue_usage = prometheus::Gauge::new(
            "copier_notify_queue_usage",
            "PostgreSQL's NOTIFY queue usage (0..1, pg_notification_queue_usage), read by the node's listener",
        )
        .expect("valid metric");
        let copy_legs = prometheus::HistogramVec::new(
            HistogramOpts::new(
                "copier_copy_leg_seconds",
                "A copy's latency by leg: master_fill_to_event (broker clock to database clock), event_to_decision (database clock to node clock), decision_to_accept (node clock)",
            )
            .buckets(MS_BUCKETS.to_vec()),
            &["leg"],
        )
        .expect("valid metric");
        for leg in LEGS {
            copy_legs.with_label_values(&[leg]);
        }
        let lease_cycles_renew_only = IntCounter::new(
            "copier_lease_cycles_renew_only_total",
            "Lease cycles that renewed and claimed nothing because the cycle before failed or ran late (over a quarter of the fence)",
        )
        .expect("valid metric");
        let claim_room = IntGauge::new(
            "copier_claim_room",
            "Accounts this node could still claim after its last lease cycle (under its capacity, its fair share and its sessions still starting)",
        )
        .expect("valid metric");
        let sessions_starting = IntGauge::new(
            "copier_sessions_starting",
            "Account sessions of this node claimed but not yet through their start-up (login and first reconcile)",
        )
        .expect("valid metric");
        let db_pool_wait = Histogram::with_opts(
            HistogramOpts::new(
                "copier_db_pool_wait_seconds",
                "Time a unit of the node's database work waited for a pooled connection",
            )
            .buckets(MS_BUCKETS.to_vec()),
        )
        .expect("valid metric");
        let db_background_waiting = IntGauge::new(
            "copier_db_background_waiting",
            "Units of background database work (session start-ups, reconciles) waiting for their turn",
        )
        .expect("valid metric");
        for c in [
            Box::new(lease_cycles_renew_only.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(claim_room.clone()),
            Box::new(sessions_starting.clone()),
            Box::new(db_pool_wait.clone()),
            Box::new(db_background_waiting.clone()),
            Box::new(owned_accounts.clone()),
            Box::new(lease_valid.clone()),
            Box::new(lease_cycle_duration.clone()),
            Box::new(lease_cycles.clone()),
            Box::new(orders.clone()),
            Box::new(orders_gated.clone()),
            Box::new(reconciles.clone()),
            Box::new(copy_latency.clone()),
            Box::new(events_published.clone()),
            Box::new(rebalance_moves.clone()),
            Box::new(handoff_logins.clone()),
            Box::new(target_accounts.clone()),
            Box::new(copies_skipped.clone()),
            Box::new(db_synchronous.clone()),
            Box::new(db_timeline.clone()),
            Box::new(db_grace.clone()),
            Box::new(db_failovers.clone()),
            Box::new(accounts_claimable.clone()),
            Box::new(broker_sessions.clone()),
            Box::new(notify_queue_usage.clone()),
            Box::new(copy_legs.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            owned_accounts,
            lease_valid,
            lease_cycle_duration,
            lease_cycles,
            orders,
            orders_gated,
            reconciles,
            copy_latency,
            events_published,
            rebalance_moves,
            handoff_logins,
            target_accounts,
            copies_skipped,
            db_synchronous,
            db_timeline,
            db_grace,
            db_failovers,
            accounts_claimable,
            broker_sessions,
            notify_queue_usage,
            copy_legs,
            lease_cycles_renew_only,
            claim_room,
            sessions_starting,
            db_pool_wait,
            db_background_waiting,
        }
    }

    /// The pool's series, for [`crate::db::Db::measured`].
    pub fn pool(&self) -> crate::db::PoolMeasures {
        crate::db::PoolMeasures {
            wait: self.db_pool_wait.clone(),
            background_waiting: self.db_background_waiting.clone(),
        }
    }

    /// Observes one leg of a copy's latency (`LEGS` names them).
    pub fn copy_leg(&self, leg: &str, seconds: f64) {
        self.copy_legs.with_label_values(&[leg]).observe(seconds);
    }

    /// Counts an order by action and outcome.
    pub fn order(&self, action: &str, result: &str) {
        self.orders.with_label_values(&[action, result]).inc();
    }

    /// The Prometheus text exposition, with the gauges taken from `state` now.
    pub fn render(&self, state: &NodeState) -> String {
        self.owned_accounts.set(state.owned.len() as i64);
        self.lease_valid.set(i64::from(state.trusted()));
        self.target_accounts
            .set(state.target.map(i64::from).unwrap_or(0));
        self.db_synchronous
            .set(i64::from(state.db.is_some_and(|d| d.synchronous)));
        self.db_timeline
            .set(state.db.and_then(|d| d.timeline).unwrap_or(-1));
        self.db_grace.set(state.grace_until.map_or(0.0, |g| {
            g.saturating_duration_since(Instant::now()).as_secs_f64()
        }));
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding never fails");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_present_from_startup() {
        let text = Metrics::new().render(&NodeState::default());
        for name in [
            "copier_owned_accounts 0",
            "copier_lease_valid 0",
            "copier_lease_cycle_duration_seconds_count 0",
            "copier_orders_total{action=\"open\",result=\"accepted\"} 0",
            "copier_orders_gated_total 0",
            "copier_reconciles_total 0",
            "copier_copy_latency_seconds_bucket{le=\"0.001\"} 0",
            "copier_copies_skipped_total 0",
            "copier_db_synchronous 0",
            "copier_db_timeline -1",
            "copier_db_grace_seconds 0",
            "copier_db_failovers_total 0",
            "copier_accounts_claimable 0",
            "copier_broker_sessions 0",
            "copier_notify_queue_usage 0",
            "copier_copy_leg_seconds_count{leg=\"decision_to_accept\"} 0",
            "copier_lease_cycles_renew_only_total 0",
            "copier_claim_room 0",
            "copier_sessions_starting 0",
            "copier_db_pool_wait_seconds_count 0",
            "copier_db_background_waiting 0",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }
}
