//! The node as its observers see it: the lease loop writes it after every cycle and ownership
//! change; `/healthz`, `/readyz`, `/metrics` and the tests read it. A leaf module, so the
//! readers need not depend on the lease loop.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::trust;

/// The node as its observers (tests, health endpoints, logs) see it.
#[derive(Debug, Clone, Default)]
pub struct NodeState {
    pub node_id: String,
    pub instance_id: String,
    pub phase: Phase,
    /// Successful cycles so far.
    pub cycles: u64,
    /// Failed cycles so far.
    pub failed_cycles: u64,
    /// The node's trust deadline from its last confirmed cycle.
    pub trusted_until: Option<Instant>,
    /// Accounts with a live session: id -> epoch.
    pub owned: Arc<BTreeMap<i64, i64>>,
    /// The last cycle failure, until a cycle succeeds.
    pub last_error: Option<String>,
    /// How many account gates were trusted again after their trust lapsed (each such account's
    /// task was told to reconcile before acting).
    pub trust_restorations: u64,
    /// This node's fair share of the platform's accounts, once it knows its peers.
    pub target: Option<u32>,
    /// Accounts handed off to rebalance, so far.
    pub rebalance_moves: u64,
    /// Hand-off decisions (cycles that handed at least one account off), so far.
    pub handoffs: u64,
    /// When the last cycle attempt finished (succeeded or failed): the loop is alive.
    pub last_cycle_at: Option<Instant>,
    /// The lease length: a running node whose loop finished no cycle for this long is stuck.
    pub lease: Duration,
    /// What the database promises (read at each new lease connection); `None` until read.
    pub db: Option<crate::db::replication::Replication>,
    /// Until when claims wait after a database failover (the grace); `None` outside one.
    pub grace_until: Option<Instant>,
    /// Database failovers this node saw.
    pub db_failovers: u64,
}

impl NodeState {
    /// Why the node is not healthy, if it is not: stopped, or its lease loop finished no cycle
    /// (successful or failed: a database outage is not a stuck loop, since retries come at
    /// least once a cycle) for a whole lease while running.
    pub fn unhealthy(&self, now: Instant) -> Option<String> {
        match self.phase {
            Phase::Stopped => Some("stopped".into()),
            Phase::Running | Phase::Draining | Phase::WaitingForNodeId => {
                let since = now.saturating_duration_since(self.last_cycle_at?);
                (since > self.lease).then(|| {
                    format!(
                        "lease loop stuck: no cycle finished for {:.1}s (lease {:.1}s)",
                        since.as_secs_f64(),
                        self.lease.as_secs_f64()
                    )
                })
            }
            Phase::Starting => None,
        }
    }

    /// True while the node holds a confirmed lease cycle (readiness).
    pub fn trusted(&self) -> bool {
        self.trusted_until
            .is_some_and(|d| trust::holds(Instant::now(), d))
    }
}

/// Where the node is in its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Phase {
    #[default]
    Starting,
    /// Another instance holds this node id; waiting for its membership to expire.
    WaitingForNodeId,
    Running,
    Draining,
    Stopped,
}
