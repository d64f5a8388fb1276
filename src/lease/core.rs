//! The lease loop's decisions, without input or output: what a cycle asks of the database, what a
//! confirmed cycle does to the gates (through the supervisor), the fair share and the hand-offs,
//! when the next cycle runs, what a failed cycle or a taken node id means, and what a shutdown
//! releases. Time comes in as instants, the database's answer as a [`CycleOutcome`], randomness
//! from the generator the core was given; the supervisor's effects go through its [`Host`].
//!
//! Two drivers run it: [`super::LeaseLoop`] (the node: tokio timers, a PostgreSQL connection, the
//! account tasks) and the deterministic simulator (`crate::sim`: simulated time, the database
//! model, a model broker). Neither holds a copy of these rules.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::balance;
use super::{
    ADMIT_AGAIN, ADMIT_SPACING, ADMIT_WHEN_STARTING, EXPIRY_SLACK, JITTER, NodeError, RECLAIM_SOON,
    SHUTDOWN_GRACE, STARTING_AT_ONCE, retry_delay,
};
use crate::config::{NodeConfig, show};
use crate::db::lease::{CycleOutcome, CycleParams, DatabaseView};
use crate::metrics::Metrics;
use crate::node_state::{NodeState, Phase};
use crate::supervisor::{Event, Host, Supervisor};
use crate::trust;

/// One node's lease state and the rules that move it.
pub struct Core<H: Host> {
    pub node: NodeConfig,
    pub instance_id: String,
    pub supervisor: Supervisor<H>,
    state: watch::Sender<NodeState>,
    metrics: Arc<Metrics>,
    rng: fastrand::Rng,
    /// Every row the last confirmed cycle returned, as (account id, epoch).
    held: Vec<(i64, i64)>,
    /// Their epochs, which the next cycle renews as they are.
    held_epochs: Vec<i64>,
    /// Rows wanted by this node after the last cycle (counts against capacity).
    wanted: usize,
    deadline: Option<Instant>,
    last_ack: Option<Instant>,
    lapse_logged: bool,
    member_ever: bool,
    conflict_since: Option<Instant>,
    failures: u32,
    /// The last cycle failed or ran late ([`Core::late_after`]): the next one renews and claims
    /// nothing, so a loaded database spends its time on keeping the node's leases first.
    late: bool,
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
    /// The peers and the claimable rows the last confirmed cycle saw (who can receive this
    /// node's accounts when it shuts down).
    peers: Vec<crate::db::lease::Peer>,
    free: u64,
    /// Claims wait for the node's own sessions to start (admission): the earliest the next
    /// cycle may claim again, once enough of them are through ([`Core::admission`]).
    admit_at: Option<Instant>,
    /// Why the next cycle runs when it does.
    next_cause: NextCycle,
    /// Whether the node may claim yet, after a cold start ([`Core::settle`]).
    joining: Joining,
    /// The peers far below their shares, and since when ([`Core::starving`]).
    starving: std::collections::HashMap<String, Instant>,
    /// How many trusted peers were below their shares at the last cycle, by their published
    /// counts ([`Core::room`]).
    peers_below: u32,
    /// Since when this node's cycles have seen accounts still free after their claims, without
    /// a break ([`Core::orphans`]), and how many were left free then: the clock starts again
    /// whenever fewer are.
    free_since: Option<(Instant, u64)>,
    /// How many accounts this node may own after its next cycle's claims when that is beyond
    /// its share (0: its share bounds them): accounts left free for a period, which the peers
    /// whose shares they are in do not claim ([`Core::orphans`]).
    orphans_limit: u32,
    /// The platform's account counts of the last cycles, and when ([`Core::total`]).
    totals: std::collections::VecDeque<(Instant, u64)>,
    /// Shutting down: where the departure's announcement stands ([`Core::take_departure`]).
    departure: Option<Departure>,
    /// What the node owns after a cycle that claimed, still to be published
    /// ([`Core::take_owned_to_publish`]).
    owned_to_publish: Option<u32>,
}

/// A shutdown's announcement that the node left the fair shares ([`Core::take_departure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Departure {
    /// A cycle published it: to be announced.
    Due,
    /// Being announced.
    Taken,
    /// Announced ([`Core::note_departure_announced`]).
    Announced,
}

/// A node that starts while more accounts are free than its live peers own (a cold start, of
/// one node or of a fleet) claims nothing until its fair share holds still: in a fleet's cold
/// start each node's first cycles see only the nodes registered before it, so the first of a
/// thousand would each claim up to their capacity and then hand half of it off, a period at a
/// time (the 1,000-node simulation: nearly all of its releases, and the cycles they woke).
/// A node joining a running cluster claims at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Joining {
    /// No cycle seen yet: the first claims nothing.
    New,
    /// Counting: when the first count was acknowledged, and the last count and when.
    Settling {
        since: Instant,
        at: Instant,
        target: u32,
    },
    /// Claims as its share allows.
    Settled,
}

/// Why a node's next cycle runs when it does ([`Core::next_cause`]): its period, or one of the
/// reasons to run earlier. The simulator counts cycles by it (beside those a release
/// announcement woke), which is how the herd report says where the cycles above the period's
/// come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NextCycle {
    /// The jittered cycle period.
    Period,
    /// A peer's membership (and so its leases) expires first: a claim right after.
    PeerExpiry,
    /// Right after a database grace ends.
    GraceEnd,
    /// A cold start: count the share again before claiming ([`SETTLE_EVERY`]).
    Settling,
    /// Room and accounts free: claim them now rather than a period later.
    ClaimSoon,
    /// After a failed cycle, its backoff.
    Retry,
}

impl NextCycle {
    pub fn name(self) -> &'static str {
        match self {
            NextCycle::Period => "period",
            NextCycle::PeerExpiry => "peer expiry",
            NextCycle::GraceEnd => "grace end",
            NextCycle::Settling => "settling",
            NextCycle::ClaimSoon => "claim soon",
            NextCycle::Retry => "retry",
        }
    }
}

/// `next` moved to `at`, for `cause`, when `at` comes first.
fn sooner(next: &mut (Instant, NextCycle), at: Instant, cause: NextCycle) {
    if at < next.0 {
        *next = (at, cause);
    }
}

/// How often a node whose claims wait for its share to hold still ([`Joining`]) counts it
/// again, as a fraction of its cycle period; it waits at most one period in all.
const SETTLE_EVERY: u32 = 8;

/// What the next cycle asks of the database, fixed at its `t0`.
#[derive(Debug, Clone)]
pub struct Prepared {
    /// How long the statement may take: while trusted, never past the trust deadline.
    pub bound: Duration,
    kept: Vec<i64>,
    claim_limit: u32,
    claim: bool,
    owned: u32,
    starting: u32,
}

impl<H: Host> Core<H> {
    pub fn new(
        node: NodeConfig,
        instance_id: String,
        supervisor: Supervisor<H>,
        state: watch::Sender<NodeState>,
        metrics: Arc<Metrics>,
        rng: fastrand::Rng,
    ) -> Self {
        Core {
            node,
            instance_id,
            supervisor,
            state,
            metrics,
            rng,
            held: Vec::new(),
            held_epochs: Vec::new(),
            wanted: 0,
            deadline: None,
            last_ack: None,
            lapse_logged: false,
            member_ever: false,
            conflict_since: None,
            failures: 0,
            late: false,
            draining: None,
            target: None,
            shedding: false,
            last_handoff: None,
            timeline: None,
            database_seen: false,
            grace_until: None,
            peers: Vec::new(),
            free: 0,
            admit_at: None,
            next_cause: NextCycle::Period,
            joining: Joining::New,
            starving: std::collections::HashMap::new(),
            peers_below: 0,
            free_since: None,
            orphans_limit: 0,
            totals: std::collections::VecDeque::new(),
            departure: None,
            owned_to_publish: None,
        }
    }

    /// True once, after the first cycle of a shutdown was confirmed (it published that this
    /// node no longer counts for fair shares): time to announce the departure, so that every
    /// peer counts its larger share before it is asked to take this node's accounts.
    pub fn take_departure(&mut self) -> bool {
        if self.departure == Some(Departure::Due) {
            self.departure = Some(Departure::Taken);
            return true;
        }
        false
    }

    /// The departure announcement (after [`Core::take_departure`]) was sent: the peers count
    /// their shares without this node, and the leave's release needs to wake only as many of
    /// them as its accounts ([`crate::channels::Release::announced`]).
    pub fn note_departure_announced(&mut self) {
        self.departure = Some(Departure::Announced);
    }

    /// Whether [`Core::note_departure_announced`] was called.
    pub fn departure_announced(&self) -> bool {
        self.departure == Some(Departure::Announced)
    }

    /// What to publish as this node's `owned` right after a cycle that claimed rows (the cycle
    /// published what it owned when it began), once; `None` after any other cycle.
    pub fn take_owned_to_publish(&mut self) -> Option<u32> {
        self.owned_to_publish.take()
    }

    /// Why the next cycle runs when the last confirmed or failed cycle said it would.
    pub fn next_cause(&self) -> NextCycle {
        self.next_cause
    }

    /// Whether claims wait for the node's sessions to start, and if so the earliest a cycle may
    /// claim again: the lease loop runs that cycle once no more than [`ADMIT_WHEN_STARTING`] sessions are
    /// still starting, and otherwise keeps its period. Taken: asked once per wait.
    pub fn admission(&mut self) -> Option<Instant> {
        self.admit_at.take()
    }

    /// As [`Core::admission`], without taking it.
    pub fn awaits_admission(&self) -> bool {
        self.admit_at.is_some()
    }

    /// The node's trust deadline from its last confirmed cycle.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// When the shutdown grace ends, once a shutdown began.
    pub fn draining(&self) -> Option<Instant> {
        self.draining
    }

    /// The fair share from the last cycle's view.
    pub fn target(&self) -> Option<u32> {
        self.target
    }

    /// The cycle starting at `t0`: its bound, and the rows to keep through a database grace
    /// (the gates open without a break up to `t0`).
    pub fn prepare(&self, t0: Instant) -> Prepared {
        let window = self.node.lease.saturating_sub(self.node.fence);
        let trusted = self.deadline.is_some_and(|d| trust::holds(t0, d));
        // While trusted, no cycle may run past the trust deadline; while gated, a full window.
        let bound = match self.deadline {
            Some(d) if trusted => (d - t0).min(window),
            _ => window,
        };
        let owned = self.supervisor.owned();
        // A late cycle renews only, but for accounts nobody claims ([`Core::orphans`]).
        let claim = self.draining.is_none() && (!self.late || self.orphans_limit > 0);
        if self.draining.is_none() && !claim {
            self.metrics.lease_cycles_renew_only.inc();
        }
        Prepared {
            bound,
            kept: if trusted {
                owned.values().copied().collect()
            } else {
                Vec::new()
            },
            claim_limit: if self.joining == Joining::Settled {
                let limit = if self.late {
                    self.orphans_limit
                } else {
                    self.share_limit().max(self.orphans_limit)
                };
                limit
                    .min(self.node.capacity)
                    .min(self.admitted(owned.len()))
            } else {
                0
            },
            claim,
            // Published for the peers' shares, hand-offs still waiting included.
            owned: (owned.len() + self.supervisor.handing_off()) as u32,
            starting: u32::try_from(self.supervisor.starting()).unwrap_or(u32::MAX),
        }
    }

    /// Below its fair share and able to claim at its next cycle (a member that knows its share,
    /// its last cycle on time, not shutting down, past a cold start's count): a node that claims
    /// what is handed off to it (a receiver without room answers an offer that it will not, and
    /// a fair-share move is then called off), and that a release to another node or to nobody
    /// wakes too ([`crate::channels::Release::wakes`]).
    pub fn has_room(&self) -> bool {
        self.claims_next()
            && self
                .target
                .is_some_and(|t| (self.supervisor.running() as u32) < t.min(self.node.capacity))
    }

    /// A member that claims at its next cycle: not shutting down, its last cycle on time, past
    /// a cold start's count.
    fn claims_next(&self) -> bool {
        self.draining.is_none() && !self.late && self.joining == Joining::Settled
    }

    /// [`Core::has_room`] as much as the node lacks to its share, beside what its peers lack:
    /// which releases wake it ([`crate::channels::Release::wakes`]).
    ///
    /// With it, whether the node takes what a departing peer hands it: [`Core::has_room`] with
    /// its capacity in place of its share (a departing peer's share is split among the nodes
    /// that stay, so their next cycles claim beyond their present shares).
    pub fn room(&self) -> crate::channels::Room {
        let running = self.supervisor.running() as u32;
        let takes_over =
            self.claims_next() && self.target.is_some() && running < self.node.capacity;
        if !self.has_room() {
            return crate::channels::Room {
                takes_over,
                ..crate::channels::Room::default()
            };
        }
        crate::channels::Room {
            lacks: self.share_limit().saturating_sub(running),
            peers_below: self.peers_below,
            takes_over,
        }
    }

    /// The most accounts the node may own by its capacity and fair share.
    fn share_limit(&self) -> u32 {
        self.target
            .map_or(self.node.capacity, |t| t.min(self.node.capacity))
    }

    /// The most accounts the node may own by what it can start: the `running` sessions, plus
    /// as many new ones as [`STARTING_AT_ONCE`] leaves room for beside those still starting.
    fn admitted(&self, running: usize) -> u32 {
        let can_start = STARTING_AT_ONCE.saturating_sub(self.supervisor.starting());
        u32::try_from(running + can_start).unwrap_or(u32::MAX)
    }

    /// The statement's parameters for a prepared cycle.
    pub fn params<'a>(&'a self, p: &'a Prepared) -> CycleParams<'a> {
        CycleParams {
            node_id: &self.node.node_id,
            instance_id: &self.instance_id,
            platform: &self.node.platform,
            capacity: self.node.capacity,
            claim_limit: p.claim_limit,
            // A node shutting down publishes no trust: its peers leave it out of their fair
            // shares, so the accounts it releases one by one have room to go at once.
            trust: if self.draining.is_some() {
                Duration::ZERO
            } else {
                self.node.lease.saturating_sub(self.node.fence)
            },
            owned: p.owned,
            starting: p.starting,
            lease: self.node.lease,
            held: &self.held_epochs,
            claim: p.claim,
            kept: &p.kept,
        }
    }

    /// Applies a cycle sent at `t0` whose COMMIT was acknowledged at `acknowledged`; returns when
    /// the next cycle runs, or why the node must stop.
    pub fn acknowledged(
        &mut self,
        t0: Instant,
        acknowledged: Instant,
        outcome: &CycleOutcome,
    ) -> Result<Instant, NodeError> {
        if !outcome.member {
            return self.conflict(outcome, acknowledged);
        }
        let deadline = trust::deadline(t0, self.node.lease, self.node.fence);
        self.metrics
            .lease_cycle_duration
            .observe((acknowledged - t0).as_secs_f64());
        self.metrics.lease_cycles.with_label_values(&["ok"]).inc();
        if self.failures > 0 || self.lapse_logged {
            let since = self
                .last_ack
                .map(|a| (acknowledged - a).as_secs_f64())
                .unwrap_or_default();
            info!(
                seconds_since_previous_renewal = format!("{since:.1}"),
                failed_cycles = self.failures,
                "lease cycle succeeded again"
            );
            self.supervisor.database_back();
        }
        if !self.member_ever {
            info!(instance_id = %self.instance_id, "joined the cluster (membership registered)");
        }
        self.member_ever = true;
        self.conflict_since = None;
        self.note_lateness(acknowledged - t0);
        self.failures = 0;
        self.lapse_logged = false;
        self.last_ack = Some(acknowledged);
        // Rows this cycle claimed: new to this node (not a row it renewed at a new epoch after
        // its lease ran out, nor one it is stopping). The statement counted them free too, in
        // the snapshot it claimed from.
        let claimed = {
            let held: std::collections::HashSet<i64> = self.held_epochs.iter().copied().collect();
            outcome
                .owned
                .iter()
                .filter(|r| !held.contains(&r.epoch) && self.supervisor.gate(r.id).is_none())
                .count() as u64
        };
        // Gates first (the supervisor closes what is no longer ours), then the node's deadline.
        let restored = self
            .supervisor
            .apply(&outcome.owned, acknowledged, deadline) as u64;
        self.deadline = Some(deadline);
        self.held = outcome.owned.iter().map(|r| (r.id, r.epoch)).collect();
        self.held_epochs = outcome.owned.iter().map(|r| r.epoch).collect();
        self.owned_to_publish = (claimed > 0).then(|| {
            u32::try_from(self.supervisor.owned().len() + self.supervisor.handing_off())
                .unwrap_or(u32::MAX)
        });
        self.wanted = outcome.owned.iter().filter(|r| r.wanted).count();
        self.watch_database(&outcome.database, acknowledged);
        self.metrics.accounts_claimable.set(outcome.free as i64);
        self.peers = outcome.peers.clone();
        self.free = outcome.free;
        let left = outcome.free.saturating_sub(claimed);
        self.free_since = match self.free_since {
            _ if left == 0 => None,
            Some((since, then)) if left >= then => Some((since, then)),
            // Claims go on (a fleet's cold start, a crash's accounts): nobody is stuck yet.
            _ => Some((acknowledged, left)),
        };
        self.orphans_limit = 0;
        // Nobody can claim during a grace: handing accounts off would only leave them unowned.
        let moved = if outcome.database.grace.is_zero() {
            self.rebalance(outcome, left, acknowledged)
        } else {
            0
        };
        // Nothing is claimed during a grace: its cycles are no counts of the share.
        if outcome.database.grace.is_zero() {
            self.settle(outcome, acknowledged);
        }
        let cycle_ms = (acknowledged - t0).as_secs_f64() * 1000.0;
        debug!(
            owned = self.wanted,
            cycle_ms = format!("{cycle_ms:.2}"),
            "lease cycle"
        );
        let draining = self.draining.is_some();
        if draining && self.departure.is_none() {
            self.departure = Some(Departure::Due);
        }
        let target = self.target;
        self.publish(|s| {
            s.phase = if draining {
                Phase::Draining
            } else {
                Phase::Running
            };
            s.cycles += 1;
            s.last_cycle_at = Some(acknowledged);
            s.last_error = None;
            s.trust_restorations += restored;
            s.target = target;
            s.rebalance_moves += moved;
            s.handoffs += u64::from(moved > 0);
        });
        Ok(self.schedule(t0, acknowledged, outcome, left))
    }

    /// What the cycle saw of the database: a failover (a new timeline, or a grace this node had
    /// not seen) makes every follower drop its masters' (epoch, seq), which may have rewound
    /// with the lost tail, and reconcile; the grace is published for `/metrics` and logged.
    fn watch_database(&mut self, db: &DatabaseView, acknowledged: Instant) {
        let timeline_changed =
            matches!((self.timeline, db.timeline), (Some(old), Some(new)) if old != new);
        // A grace this node had not seen (another node detected the failover, or the timeline
        // cannot be read and only the system identifier changed); not on the node's first cycle,
        // when its sessions have nothing to forget yet.
        let grace_began = !db.grace.is_zero() && self.grace_until.is_none() && self.database_seen;
        self.database_seen = true;
        if db.failed_over || timeline_changed || grace_began {
            warn!(
                old_timeline = ?self.timeline,
                timeline = ?db.timeline,
                detected_here = db.failed_over,
                grace_s = format!("{:.1}", db.grace.as_secs_f64()),
                kept = self.held.len(),
                era_start = ?db.era_start,
                "database failed over: writes the old primary acknowledged may be lost; keeping only the accounts whose gates stayed open, claiming nothing until the grace ends, and reconciling every follower"
            );
            self.metrics.db_failovers.inc();
            self.supervisor.database_failed_over();
            self.publish(|s| s.db_failovers += 1);
        }
        if db.timeline.is_some() {
            self.timeline = db.timeline;
        }
        let until = (!db.grace.is_zero()).then(|| acknowledged + db.grace);
        if self.grace_until.is_some() && until.is_none() {
            info!("database grace over: claiming again");
        }
        self.grace_until = until;
        let timeline = db.timeline;
        self.publish(|s| {
            s.grace_until = until;
            if let Some(d) = s.db.as_mut() {
                d.timeline = timeline.or(d.timeline);
            }
        });
    }

    /// Computes this node's fair share from the cycle's view of the platform and hands off what
    /// is above it (bounded per cycle, with hysteresis). `left`: the rows still free after the
    /// cycle's claims (its count of free rows includes what it claimed). Returns the accounts
    /// handed off.
    fn rebalance(&mut self, outcome: &CycleOutcome, left: u64, now: Instant) -> u64 {
        let owned = self.supervisor.owned().len() as u32;
        let me = self.node.node_id.clone();
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
        // Hand-offs waiting for their receivers are nobody else's yet: counted (as this node
        // publishes them), or the total would shrink and every share with it.
        let seen = owned as u64
            + self.supervisor.handing_off() as u64
            + outcome
                .peers
                .iter()
                .filter(|p| p.live)
                .map(|p| p.owned as u64)
                .sum::<u64>()
            + left;
        let total = self.total(seen, now);
        let shares = balance::shares(&members, total);
        let target = shares.get(&me).copied().unwrap_or(0);
        if self.target != Some(target) {
            info!(
                target,
                owned,
                live_nodes = members.len(),
                total,
                "fair share"
            );
        }
        self.target = Some(target);
        self.metrics.target_accounts.set(target as i64);
        let starving = self.starving(outcome, &shares, now);
        self.peers_below = outcome
            .peers
            .iter()
            .filter(|p| p.trusted && p.owned < shares.get(&p.node_id).copied().unwrap_or(0))
            .count() as u32;
        self.orphans_limit = self.orphans(outcome, &shares, left, now);
        if self.draining.is_some() {
            return 0;
        }
        // Cycles woken early (a peer's release announcement) claim, but hand nothing off: moves
        // stay bounded per cycle period, and two shedding nodes cannot wake each other into a
        // cascade of hand-offs.
        let period = self.node.cycle.mul_f64(1.0 - JITTER);
        if self.last_handoff.is_some_and(|at| now - at < period) {
            return 0;
        }
        let knobs = self.knobs();
        // A peer far below its share (a node that just joined) while no account is free, for
        // a period at least: each node publishes what it owned when its cycle began, so a peer
        // that has just claimed its share looks starved until its next cycle (in a cold start,
        // every peer at once, and every node above its share would hand accounts off to them).
        let starved = outcome.free == 0 && starving;
        let n = balance::to_release(owned, target, starved, &mut self.shedding, knobs);
        if n == 0 {
            return 0;
        }
        // A peer below its share that is starting as many sessions as it may at once could not
        // take the accounts up: the move waits until it has room (admission, across the
        // cluster), rather than leave them unowned meanwhile.
        if let Some(busy) = outcome.peers.iter().find(|p| {
            p.trusted
                && p.starting as usize >= STARTING_AT_ONCE
                && p.owned < shares.get(&p.node_id).copied().unwrap_or(0)
        }) {
            debug!(
                peer = %busy.node_id,
                starting = busy.starting,
                "fair share: waiting for the receiver to have room to start sessions before handing off"
            );
            return 0;
        }
        // Who is expected to claim each account: the trusted peers furthest below their
        // shares, one account at a time (the receivers prepare their logins meanwhile).
        let mut deficits: Vec<(i64, &str)> = outcome
            .peers
            .iter()
            .filter(|p| p.trusted)
            .map(|p| {
                let share = shares.get(&p.node_id).copied().unwrap_or(0);
                (i64::from(share) - i64::from(p.owned), p.node_id.as_str())
            })
            .collect();
        let mut receivers = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let Some(best) = deficits.iter_mut().filter(|d| d.0 > 0).max_by_key(|d| d.0) else {
                break;
            };
            best.0 -= 1;
            receivers.push(best.1.to_string());
        }
        // No more than the peers below their shares lack: an account nobody is expected to
        // claim stays.
        let moved = self
            .supervisor
            .rebalance((n as usize).min(receivers.len()), &receivers);
        if moved.is_empty() {
            return 0;
        }
        self.last_handoff = Some(now);
        info!(
            handing_off = moved.len(),
            owned, target, starved, "rebalancing: above the fair share, handing accounts off"
        );
        self.metrics.rebalance_moves.inc_by(moved.len() as u64);
        moved.len() as u64
    }

    /// How many accounts this node may own after its next cycle's claims, for accounts nobody
    /// claims (0: none such). A free account is in the share of some node below its share,
    /// which claims it within moments (woken by the release, at its lease's expiry, or soon
    /// after a cycle that left accounts free), unless that node cannot: a node whose cycles run
    /// late renews only, for as long as they do (the simulator: an account free for 84 s, both
    /// of its nodes overloaded into renewing only). So once accounts have been
    /// free after every one of this node's cycles for a period (and for twice
    /// [`crate::supervisor::UNCLAIMED_AFTER`] at least: the old owner's second announcement and
    /// the claims it wakes come first):
    /// * a node at its share (or above), while no peer is far below its own share (the accounts
    ///   are that peer's), claims its part of them beyond its share: the free accounts split
    ///   over itself and its trusted peers at their shares, within the rebalance margin;
    /// * a node whose cycles run late claims one, whatever its share: with every node
    ///   overloaded, an account served late is better than one served by nobody, and one
    ///   account a period adds little to a late cycle.
    ///
    /// Not while a peer below its share is starting more sessions than admission lets wait (it
    /// claims as they get through), nor in a fleet's cold start (more accounts free than owned:
    /// the nodes still count their shares), nor during a shutdown; and the period starts again
    /// whenever fewer accounts are left free than when it began (claims go on). What was claimed
    /// beyond a share goes back by the fair share's moves once its peer has room.
    fn orphans(
        &mut self,
        outcome: &CycleOutcome,
        shares: &std::collections::BTreeMap<String, u32>,
        left: u64,
        now: Instant,
    ) -> u32 {
        let period = self
            .node
            .cycle
            .mul_f64(1.0 - JITTER)
            .max(crate::supervisor::UNCLAIMED_AFTER * 2);
        let share = |p: &crate::db::lease::Peer| shares.get(&p.node_id).copied().unwrap_or(0);
        let admitting = outcome
            .peers
            .iter()
            .any(|p| p.trusted && p.owned < share(p) && p.starting as usize > ADMIT_WHEN_STARTING);
        // A fleet's cold start (more accounts free than the nodes own): the nodes still count
        // their shares, and those that settled first would take the others' accounts.
        let owned = self.wanted as u64
            + outcome
                .peers
                .iter()
                .filter(|p| p.live)
                .map(|p| u64::from(p.owned))
                .sum::<u64>();
        if self.draining.is_some()
            || admitting
            || left > owned
            || self
                .free_since
                .is_none_or(|(since, _)| now - since < period)
        {
            return 0;
        }
        let limit = self.share_limit();
        let n = if self.late {
            1
        } else if self.wanted as u32 >= limit && self.starving.is_empty() {
            let peers_at_share = outcome
                .peers
                .iter()
                .filter(|p| p.trusted && p.owned >= share(p))
                .count() as u64;
            // Within the rebalance margin, which moves nothing back: in a fleet's cold start
            // the nodes that settled first see most accounts free for a period, and claiming up
            // to their capacities would hand the surplus off for many periods after.
            let within =
                (limit + balance::margin(limit, self.knobs())).saturating_sub(self.wanted as u32);
            u32::try_from(left.div_ceil(1 + peers_at_share))
                .unwrap_or(u32::MAX)
                .min(within)
        } else {
            // Below its share and on time: it claims them as it is. Or a peer is far below its
            // share (a node that restarted, a node that just joined): the free accounts are
            // its, and taking them would only make more moves to it; if its cycles run late,
            // it claims one a period itself (above).
            return 0;
        };
        let n = n.min(self.node.capacity.saturating_sub(self.wanted as u32));
        if n == 0 {
            return 0;
        }
        let free_for_s = format!(
            "{:.1}",
            (now - self.free_since.map_or(now, |(since, _)| since)).as_secs_f64()
        );
        if self.late {
            warn!(
                free = left,
                free_for_s,
                "accounts free for a period while this node's cycles run late: claiming one anyway"
            );
        } else {
            info!(
                free = left,
                claiming_beyond_share = n,
                free_for_s,
                "accounts free for a period while this node is at its fair share (their nodes are not claiming them): claiming some beyond the share"
            );
        }
        self.wanted as u32 + n
    }

    /// The platform's accounts as the shares count them: the most of the counts `seen` over the
    /// last two periods. Each node publishes what it owned when its cycle began, so the
    /// accounts claimed since by peers are neither free nor counted, for up to a period: the
    /// count of one cycle falls short while claims go on (in a cold start of a thousand nodes
    /// in the simulator), every share with it, and nodes at their true shares handed accounts
    /// off. Accounts removed count on for two periods at most (the shares are a little
    /// high meanwhile, which moves nothing).
    fn total(&mut self, seen: u64, now: Instant) -> u64 {
        let window = self.node.cycle * 2;
        while self
            .totals
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > window)
        {
            self.totals.pop_front();
        }
        self.totals.push_back((now, seen));
        self.totals.iter().map(|(_, n)| *n).max().unwrap_or(seen)
    }

    /// Whether some peer has been far below its share (by more than its margin) for a period:
    /// notes when each such peer was first seen so, and forgets the others.
    fn starving(
        &mut self,
        outcome: &CycleOutcome,
        shares: &std::collections::BTreeMap<String, u32>,
        now: Instant,
    ) -> bool {
        let knobs = self.knobs();
        let below: std::collections::HashSet<&str> = outcome
            .peers
            .iter()
            .filter(|p| p.trusted)
            .filter(|p| {
                let share = shares.get(&p.node_id).copied().unwrap_or(0);
                p.owned + balance::margin(share, knobs) < share
            })
            .map(|p| p.node_id.as_str())
            .collect();
        self.starving.retain(|id, _| below.contains(id.as_str()));
        for id in below {
            self.starving.entry(id.to_string()).or_insert(now);
        }
        // A period as the peers' cycles keep it (jitter only shortens it).
        let period = self.node.cycle.mul_f64(1.0 - JITTER);
        self.starving.values().any(|since| now - *since >= period)
    }

    /// Whether the node may claim from its next cycle on ([`Joining`]): at once unless more
    /// accounts are free than its live peers own (a cold start, not a node joining a running
    /// cluster); otherwise once two counts of its share, a [`SETTLE_EVERY`]th of a period apart,
    /// agree within the rebalance margin (the shares move by far more while the nodes are still
    /// registering), or a period after its first cycle whatever they say.
    fn settle(&mut self, outcome: &CycleOutcome, now: Instant) {
        let Some(target) = self.target else {
            return;
        };
        let fleet_start = outcome.free
            > outcome
                .peers
                .iter()
                .filter(|p| p.live)
                .map(|p| u64::from(p.owned))
                .sum::<u64>();
        self.joining = match self.joining {
            Joining::New if fleet_start => {
                info!(
                    target,
                    free = outcome.free,
                    "cold start (more accounts free than the live peers own): claiming once the fair share holds still"
                );
                Joining::Settling {
                    since: now,
                    at: now,
                    target,
                }
            }
            // A cycle woken sooner (a release, the listener's first connection) is no second
            // count: counts a moment apart agree whoever is still registering.
            settling @ Joining::Settling { since, at, .. }
                if now - at < self.node.cycle / SETTLE_EVERY && now - since < self.node.cycle =>
            {
                settling
            }
            Joining::Settling {
                since,
                target: seen,
                ..
            } if seen.abs_diff(target) > balance::margin(target, self.knobs())
                && now - since < self.node.cycle =>
            {
                Joining::Settling {
                    since,
                    at: now,
                    target,
                }
            }
            Joining::Settling { .. } => {
                info!(target, "fair share settled: claiming");
                Joining::Settled
            }
            Joining::New | Joining::Settled => Joining::Settled,
        };
    }

    /// When the next cycle runs: a jittered period after `t0`, or earlier: when a peer's
    /// membership (and so every lease it holds) expires before that and this node has room to
    /// claim; soon when it has room and accounts are still free after this cycle's claims
    /// (`left`). While its claims wait for its own start-ups, the loop is woken once enough are
    /// through ([`Core::admission`]).
    ///
    /// A node at its share does not run early to count the total again: the shares count the
    /// most accounts seen over two periods ([`Core::total`]) and every node publishes what it
    /// owns right after a cycle that claimed ([`Core::take_owned_to_publish`]), so the shares
    /// add up to at least what is owned and free, and whatever is free is some node's room.
    /// (Such recounts, up to four in a row, were a fifth of the 1,000-node simulation's cycles
    /// once its faults were over: every node at its share counted again whenever a crash freed
    /// accounts that the nodes below their shares were about to claim.)
    fn schedule(
        &mut self,
        t0: Instant,
        acknowledged: Instant,
        outcome: &CycleOutcome,
        left: u64,
    ) -> Instant {
        let (next, cause) = self.next_cycle(t0, acknowledged, outcome, left);
        self.next_cause = cause;
        next
    }

    /// [`Core::schedule`]'s instant, and why.
    fn next_cycle(
        &mut self,
        t0: Instant,
        acknowledged: Instant,
        outcome: &CycleOutcome,
        left: u64,
    ) -> (Instant, NextCycle) {
        let period = self.node.cycle.mul_f64(1.0 - JITTER * self.rng.f64());
        let mut next = (t0 + period, NextCycle::Period);
        if matches!(self.joining, Joining::Settling { .. }) && self.draining.is_none() {
            sooner(
                &mut next,
                acknowledged + self.node.cycle / SETTLE_EVERY,
                NextCycle::Settling,
            );
            return next;
        }
        let limit = self.share_limit() as usize;
        let room = limit.saturating_sub(self.wanted) > 0;
        let admitted = self.admitted(self.supervisor.owned().len()) as usize;
        self.metrics
            .claim_room
            .set(limit.min(admitted).saturating_sub(self.wanted) as i64);
        self.admit_at = None;
        // Claims wait for start-ups when admission is what bounds them and less than half of it
        // is open: a cycle would claim a few accounts and renew all the node holds.
        let admission_bounds = admitted < limit
            && (admitted <= self.wanted || self.supervisor.starting() > ADMIT_WHEN_STARTING);
        if room && admission_bounds && self.draining.is_none() && outcome.free > 0 {
            // Free accounts wait while this node's sessions still start (admission). Each cycle
            // renews every row the node holds, so polling with cycles until some are through
            // (or claiming again at once the few whose start-ups ended during the cycle) made a
            // node of 10,000 accounts spend most of the database on renewals (the scale
            // benchmark: a cycle a second at 0.4 s each on ten nodes, and the start-ups starved
            // behind them). The loop waits for enough start-ups to end, a claim worth its cycle,
            // and claims then: no sooner than `ADMIT_AGAIN`, nor than ten of this cycle's
            // durations (at most a tenth of the node's time in admission cycles, however slow
            // the database is).
            let took = acknowledged.saturating_duration_since(t0);
            self.admit_at = Some(acknowledged + ADMIT_AGAIN.max(took * ADMIT_SPACING));
            if admitted > self.wanted {
                // Room for some: a peer whose leases expire is still claimed from at once.
                self.at_peer_expiry(&mut next, acknowledged, outcome);
            }
            return next;
        }
        if let Some(end) = self.grace_until {
            // Nothing can be claimed before the grace ends: one cycle per period until then (not
            // the quick re-claims below, which would spin on free rows nobody may take), and one
            // right after it.
            if room && self.draining.is_none() {
                sooner(&mut next, end + EXPIRY_SLACK, NextCycle::GraceEnd);
            }
            return next;
        }
        if room && self.draining.is_none() && left > 0 && !self.late {
            // Free accounts and room under a share that just grew (a peer left, accounts were
            // added): claim them now rather than a cycle later.
            sooner(&mut next, acknowledged + RECLAIM_SOON, NextCycle::ClaimSoon);
        }
        if room && self.draining.is_none() {
            self.at_peer_expiry(&mut next, acknowledged, outcome);
        }
        next
    }

    /// `next`, or earlier when a live peer's membership (and so every lease it holds) expires
    /// before it: a claim right after that moment.
    fn at_peer_expiry(
        &self,
        next: &mut (Instant, NextCycle),
        acknowledged: Instant,
        outcome: &CycleOutcome,
    ) {
        for peer in outcome.peers.iter().filter(|p| p.live) {
            let at = acknowledged + peer.expires_in + EXPIRY_SLACK;
            if at < next.0 {
                info!(peer = %peer.node_id, expires_in_ms = peer.expires_in.as_millis() as u64, "peer stopped renewing: claiming its accounts when its leases expire");
                sooner(next, at, NextCycle::PeerExpiry);
            }
        }
    }

    fn knobs(&self) -> balance::Knobs {
        balance::Knobs {
            margin: self.node.rebalance_margin,
            step: self.node.rebalance_step,
        }
    }

    /// A cycle taking longer than this is late: a quarter of the fence, below the bound of the
    /// node's other statements (a third), far above a cycle on a healthy database (milliseconds).
    pub fn late_after(&self) -> Duration {
        self.node.fence / 4
    }

    /// Whether the next cycle claims, from how long this one took: a late cycle makes the next
    /// one renew only (but for accounts nobody claims, [`Core::orphans`]); the first cycle on
    /// time claims again.
    fn note_lateness(&mut self, took: Duration) {
        let late = took > self.late_after();
        if late && !self.late {
            warn!(
                cycle_ms = took.as_millis() as u64,
                late_after_ms = self.late_after().as_millis() as u64,
                "lease cycle ran late: renewing only, claiming nothing until a cycle is on time again"
            );
        } else if !late && self.late && self.failures == 0 {
            info!(
                cycle_ms = took.as_millis() as u64,
                "lease cycle on time again: claiming again"
            );
        }
        self.late = late;
    }

    /// A cycle failed at `now` (an error, or no answer within its bound); returns when to retry.
    pub fn failed(&mut self, now: Instant, reason: String) -> Instant {
        self.metrics
            .lease_cycles
            .with_label_values(&["failed"])
            .inc();
        self.failures += 1;
        self.late = true;
        // The retry renews only: no claim waits for start-ups meanwhile, and none is made for
        // accounts nobody claims.
        self.admit_at = None;
        self.orphans_limit = 0;
        let backoff = retry_delay(self.failures, self.node.cycle);
        let trusted = self.deadline.is_some_and(|d| trust::holds(now, d));
        warn!(error = %reason, attempt = self.failures, retry_in_ms = backoff.as_millis() as u64, trusted, "lease cycle failed");
        // What a failed cycle could not see is not reported as seen (the nodes that can see
        // the database report it).
        self.metrics.accounts_claimable.set(0);
        self.publish(|s| {
            s.failed_cycles += 1;
            s.last_cycle_at = Some(now);
            s.last_error = Some(reason.clone());
        });
        self.next_cause = NextCycle::Retry;
        now + backoff
    }

    /// The membership upsert did not match: another live instance holds this node id.
    fn conflict(
        &mut self,
        outcome: &CycleOutcome,
        acknowledged: Instant,
    ) -> Result<Instant, NodeError> {
        self.admit_at = None;
        let (other, expires_in) = outcome
            .conflict
            .as_ref()
            .map(|c| (c.instance_id.clone(), c.expires_in))
            .unwrap_or_else(|| ("unknown".into(), Duration::ZERO));
        if self.member_ever {
            error!(other_instance = %other, "this node's membership was taken over by another instance");
            self.supervisor.begin_shutdown();
            return Err(NodeError::NodeIdTakenOver {
                node_id: self.node.node_id.clone(),
                other,
            });
        }
        let since = *self.conflict_since.get_or_insert(acknowledged);
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
        self.publish(|s| s.phase = Phase::WaitingForNodeId);
        let retry = (expires_in + EXPIRY_SLACK).min(self.node.cycle);
        self.next_cause = if retry < self.node.cycle {
            NextCycle::PeerExpiry
        } else {
            NextCycle::Period
        };
        Ok(acknowledged + retry)
    }

    /// When the node's trust lapses unless a renewal comes first (once per lapse).
    pub fn lapse_at(&self) -> Option<Instant> {
        self.deadline.filter(|_| !self.lapse_logged)
    }

    /// The trust deadline passed at `now` without a renewal: every gate is closed by its own
    /// deadline already; this records and reports it.
    pub fn lapsed(&mut self, now: Instant) {
        self.lapse_logged = true;
        let since = self
            .last_ack
            .map(|a| (now - a).as_secs_f64())
            .unwrap_or_default();
        warn!(
            accounts = self.supervisor.owned().len(),
            seconds_since_confirmed_renewal = format!("{since:.1}"),
            "gate closed: lease trust lapsed; no order is sent until a renewal succeeds"
        );
        self.publish(|_| {});
    }

    /// A shutdown was requested at `now` (L2). Each account a trusted peer can take is handed
    /// off to it as a fair-share move is: offered, copying on behind its open gate until that
    /// peer has logged in ahead (at most `handoff_prepare`), then its gate closes, its orders in
    /// flight finish and it is released, one account at a time; the rest stop at once and are
    /// released when the node leaves. True when a cycle should run now: it publishes that this
    /// node no longer counts for fair share, so the peers have room for what it releases.
    pub fn begin_shutdown(&mut self, now: Instant) -> bool {
        let receivers = if self.supervisor.handoff_wait().is_zero() {
            Vec::new()
        } else {
            self.shutdown_receivers()
        };
        let offered = receivers.len();
        info!(
            accounts = self.supervisor.owned().len(),
            offered,
            "shutdown requested: handing accounts to the peers that can take them (copying on until each receiver has logged in), closing the other gates at once, then releasing"
        );
        self.supervisor.begin_shutdown_handing_off(&receivers);
        self.draining = Some(now + SHUTDOWN_GRACE + self.supervisor.handoff_wait());
        self.publish(|s| s.phase = Phase::Draining);
        offered > 0
    }

    /// Who takes this node's accounts when it leaves, one receiver per account in the order
    /// the supervisor hands them off: the trusted peers' fair shares without this node, each
    /// peer receiving up to what it lacks of its share (none when nobody is trusted).
    fn shutdown_receivers(&self) -> Vec<String> {
        let owned = self.supervisor.owned().len() as u64 + self.supervisor.handing_off() as u64;
        let trusted: Vec<&crate::db::lease::Peer> =
            self.peers.iter().filter(|p| p.trusted).collect();
        let members: Vec<balance::Member> = trusted
            .iter()
            .map(|p| balance::Member {
                node_id: p.node_id.clone(),
                capacity: p.capacity,
            })
            .collect();
        let total = owned
            + self
                .peers
                .iter()
                .filter(|p| p.live)
                .map(|p| p.owned as u64)
                .sum::<u64>()
            + self.free;
        let shares = balance::shares(&members, total);
        let mut deficits: Vec<(i64, &str)> = trusted
            .iter()
            .map(|p| {
                let share = shares.get(&p.node_id).copied().unwrap_or(0);
                (i64::from(share) - i64::from(p.owned), p.node_id.as_str())
            })
            .collect();
        let mut receivers = Vec::new();
        for _ in 0..owned {
            let Some(best) = deficits.iter_mut().filter(|d| d.0 > 0).max_by_key(|d| d.0) else {
                break;
            };
            best.0 -= 1;
            receivers.push(best.1.to_string());
        }
        receivers
    }

    /// An event from a session, a release or the status writer.
    pub fn handle(&mut self, event: Event) {
        self.supervisor.handle(event);
        self.publish(|_| {});
    }

    /// Shutting down, and nothing left running or releasing: time to leave.
    pub fn drained(&self) -> bool {
        self.draining.is_some() && self.supervisor.is_idle()
    }

    /// What leaving releases: the rows (account id, epoch) whose sessions have returned (the
    /// others move when their leases expire), and how many are kept back.
    pub fn leave_rows(&self) -> (Vec<(i64, i64)>, usize) {
        let unfinished = self.supervisor.unfinished_epochs();
        let (kept, released): (Vec<_>, Vec<_>) = self
            .held
            .iter()
            .copied()
            .partition(|(_, e)| unfinished.contains(e));
        (released, kept.len())
    }

    /// The node's state as last published.
    pub fn state(&self) -> watch::Ref<'_, NodeState> {
        self.state.borrow()
    }

    /// Publishes the node's state (for `/healthz`, `/status` and the metrics).
    pub fn publish(&self, change: impl FnOnce(&mut NodeState)) {
        if self.state.is_closed() {
            return;
        }
        let owned = Arc::new(self.supervisor.owned());
        let deadline = self.deadline;
        self.state.send_modify(|s| {
            s.trusted_until = deadline;
            s.owned = owned;
            change(s);
        });
    }
}
