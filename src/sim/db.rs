//! A model of the lease tables and of the statements the nodes run on them: the cycle
//! ([`crate::db::lease::CYCLE_SQL`]), releases and leaving. The one permitted stand-in for
//! PostgreSQL, for the simulator only; the differential test (`tests/it/model.rs`) runs the same
//! random sequences against this and against the real statements and compares every outcome.
//!
//! Time is the database's clock in milliseconds, set by the caller. Each statement is atomic and
//! sees one snapshot, as in PostgreSQL. Statements run one after another, except that
//! [`Model::cycle_beside`] runs a cycle beside another one not yet committed: it sees the state
//! from before that one and passes over the rows it locked (SKIP LOCKED), as PostgreSQL does.
//!
//! One choice PostgreSQL leaves to its plan is fixed here: new epochs are handed out in account id
//! order within a statement. The differential test compares what does not depend on it (which
//! epochs were kept, which are new and larger). Everything else is determined by the statements
//! (claims take the lowest ids first, free rows and dead nodes' rows alike).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use crate::db::lease::{
    Conflict, CycleOutcome, CycleParams, DatabaseView, LeaveOutcome, OwnedRow, Peer,
};

/// A `nodes` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRow {
    pub instance_id: String,
    pub platform: String,
    pub capacity: u32,
    pub lease_until: i64,
    pub renewed_at: i64,
    pub trust_until: i64,
    pub owned: u32,
    pub starting: u32,
}

/// A `trading_accounts` row (the lease columns).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountRow {
    pub platform: String,
    pub enabled: bool,
    pub node_id: Option<String>,
    pub lease_until: Option<i64>,
    pub owner_epoch: i64,
    pub claimed_at: Option<i64>,
}

impl AccountRow {
    /// A free account of a platform (what a claim may take besides dead nodes' rows).
    fn free_platform(&self) -> Option<&str> {
        (self.enabled && self.node_id.is_none()).then_some(self.platform.as_str())
    }

    /// An unowned row with no lease, as an `INSERT` makes it.
    pub fn new(platform: &str, enabled: bool) -> Self {
        AccountRow {
            platform: platform.to_string(),
            enabled,
            node_id: None,
            lease_until: None,
            owner_epoch: 0,
            claimed_at: None,
        }
    }
}

/// The `copier_database` row and the server it describes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Server {
    /// What the server reports now (`None`: unreadable).
    pub timeline: Option<i64>,
    pub system_id: Option<i64>,
    /// What the cycles recorded.
    pub recorded_timeline: Option<i64>,
    pub recorded_system_id: Option<i64>,
    pub era_offset: i64,
    pub claims_after: Option<i64>,
    pub failed_over_at: Option<i64>,
    pub max_lease_ms: Option<i64>,
}

/// The modelled database.
///
/// The account rows are reached through methods, which keep two indexes (rows by owner, free
/// rows by platform) so a statement touches what PostgreSQL's indexes would let it touch: the
/// simulator runs a million rows.
#[derive(Debug, Clone, Default)]
pub struct Model {
    pub now: i64,
    pub nodes: BTreeMap<String, NodeRow>,
    accounts: BTreeMap<i64, AccountRow>,
    /// Account ids by `node_id`.
    by_node: HashMap<String, BTreeSet<i64>>,
    /// Enabled rows without an owner, by platform.
    free: HashMap<String, BTreeSet<i64>>,
    /// `owner_epoch_seq`'s last value (`nextval` returns one more).
    pub seq: i64,
    pub server: Server,
    /// A deliberate bug, for the simulator's own tests only: no grace after a failover (claims
    /// go on, renewals are not limited to the kept rows). Never set outside them.
    pub no_grace: bool,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Model {
    /// A database whose server reports `timeline` and `system_id`, recorded as the baseline (as
    /// migration 7 records it).
    pub fn new(timeline: Option<i64>, system_id: Option<i64>) -> Self {
        Model {
            server: Server {
                timeline,
                system_id,
                recorded_timeline: timeline,
                recorded_system_id: system_id,
                ..Server::default()
            },
            ..Model::default()
        }
    }

    /// Every account row, by id.
    pub fn accounts(&self) -> impl Iterator<Item = (i64, &AccountRow)> {
        self.accounts.iter().map(|(id, a)| (*id, a))
    }

    pub fn account(&self, id: i64) -> Option<&AccountRow> {
        self.accounts.get(&id)
    }

    /// How many account rows there are.
    pub fn account_count(&self) -> usize {
        self.accounts.len()
    }

    /// The ids of the rows naming `node_id` as their owner.
    pub fn owned_by(&self, node_id: &str) -> impl Iterator<Item = i64> + '_ {
        self.by_node.get(node_id).into_iter().flatten().copied()
    }

    /// Inserts (or replaces) an account row.
    pub fn insert_account(&mut self, id: i64, row: AccountRow) {
        self.unindex(id);
        self.accounts.insert(id, row);
        self.index(id);
    }

    /// Changes an account row (an `UPDATE` from outside the lease statements).
    pub fn update_account(&mut self, id: i64, change: impl FnOnce(&mut AccountRow)) {
        self.unindex(id);
        if let Some(a) = self.accounts.get_mut(&id) {
            change(a);
        }
        self.index(id);
    }

    fn unindex(&mut self, id: i64) {
        let Some(a) = self.accounts.get(&id) else {
            return;
        };
        if let Some(n) = &a.node_id
            && let Some(set) = self.by_node.get_mut(n)
        {
            set.remove(&id);
            if set.is_empty() {
                self.by_node.remove(n);
            }
        }
        if let Some(p) = a.free_platform()
            && let Some(set) = self.free.get_mut(p)
        {
            set.remove(&id);
        }
    }

    fn index(&mut self, id: i64) {
        let Some(a) = self.accounts.get(&id) else {
            return;
        };
        if let Some(n) = &a.node_id {
            self.by_node.entry(n.clone()).or_default().insert(id);
        }
        if let Some(p) = a.free_platform() {
            self.free.entry(p.to_string()).or_default().insert(id);
        }
    }

    fn nextval(&mut self) -> i64 {
        self.seq += 1;
        self.seq
    }

    /// One cycle statement.
    pub fn cycle(&mut self, p: &CycleParams<'_>) -> CycleOutcome {
        self.cycle_beside(p, &BTreeSet::new()).0
    }

    /// One cycle statement run while another, uncommitted, holds row locks on `locked`: its
    /// `FOR UPDATE SKIP LOCKED` reads pass over them (it sees the state from before that other
    /// statement, which the caller gives it). Returns the outcome and the rows this statement
    /// locks: those it renews, the free and dead nodes' rows its claim reads take (up to the room
    /// from the free rows and up to the room from each dead node's), and those it claims.
    pub fn cycle_beside(
        &mut self,
        p: &CycleParams<'_>,
        locked: &BTreeSet<i64>,
    ) -> (CycleOutcome, BTreeSet<i64>) {
        let mut locks = BTreeSet::new();
        let now = self.now;
        let lease = ms(p.lease);
        // The statement sees one snapshot: everything it reads is read before it writes (its
        // writes touch only this node's membership and the rows it renews or claims, which the
        // reads below take before they change).
        let s = self.server.clone();
        let seq_before = self.seq;

        // The database itself: a failover, the grace, the era.
        let changed = matches!((s.timeline, s.recorded_timeline), (Some(a), Some(b)) if a != b)
            || matches!((s.system_id, s.recorded_system_id), (Some(a), Some(b)) if a != b);
        let longest_member = self
            .nodes
            .values()
            .map(|n| n.lease_until - n.renewed_at)
            .max()
            .unwrap_or(0)
            .max(0);
        let span = lease.max(s.max_lease_ms.unwrap_or(0)).max(longest_member) + 1000;
        let grace = if self.no_grace {
            0
        } else if changed {
            span
        } else {
            s.claims_after.map_or(0, |c| (c - now).max(0))
        };
        let base = s.timeline.or(s.recorded_timeline).unwrap_or(0);
        let next_era = (base + s.era_offset)
            .max(s.recorded_timeline.unwrap_or(0) + s.era_offset + 1)
            .max((seq_before >> 40) + 1);
        let noted = (s.timeline.is_some() && s.timeline != s.recorded_timeline)
            || (s.system_id.is_some() && s.system_id != s.recorded_system_id)
            || s.max_lease_ms.is_none_or(|m| m < lease);
        let mut era_start = None;
        if noted {
            let sv = &mut self.server;
            sv.recorded_timeline = sv.timeline.or(sv.recorded_timeline);
            sv.recorded_system_id = sv.system_id.or(sv.recorded_system_id);
            if changed {
                sv.era_offset = next_era - base;
                sv.claims_after = Some(now + span);
                sv.failed_over_at = Some(now);
                self.seq = next_era << 40;
                era_start = Some(self.seq);
            }
            sv.max_lease_ms = Some(sv.max_lease_ms.unwrap_or(lease).max(lease));
        }

        // What the statement reads of the others, before it writes anything.
        let peers: Vec<Peer> = self
            .nodes
            .iter()
            .filter(|(id, n)| n.platform == p.platform && id.as_str() != p.node_id)
            .map(|(id, n)| Peer {
                node_id: id.clone(),
                expires_in: Duration::from_millis((n.lease_until - now).max(0) as u64),
                live: n.lease_until >= now,
                trusted: n.lease_until >= now && n.trust_until >= now,
                capacity: n.capacity,
                owned: n.owned,
                starting: n.starting,
            })
            .collect();
        let dead_nodes: Vec<String> = self
            .nodes
            .iter()
            .filter(|(id, n)| n.lease_until < now && id.as_str() != p.node_id)
            .map(|(id, _)| id.clone())
            .collect();
        let mut dead_rows = 0usize;
        // Each dead node's claimable rows (passing over locked ones), lowest ids first (the
        // index is ordered).
        let mut dead_claimable: Vec<Vec<i64>> = Vec::new();
        for node in &dead_nodes {
            let mut of_node = Vec::new();
            for id in self.owned_by(node) {
                let a = &self.accounts[&id];
                if a.platform == p.platform && a.enabled {
                    dead_rows += 1;
                    if a.lease_until.is_some_and(|l| l < now) && !locked.contains(&id) {
                        of_node.push(id);
                    }
                }
            }
            dead_claimable.push(of_node);
        }
        let free_rows = self.free.get(p.platform).map_or(0, BTreeSet::len);

        // Membership.
        let member = match self.nodes.get(p.node_id) {
            Some(n) => n.instance_id == p.instance_id || n.lease_until < now,
            None => true,
        };
        let mut out = CycleOutcome {
            member,
            database: DatabaseView {
                timeline: s.timeline,
                failed_over: changed,
                grace: Duration::from_millis(grace as u64),
                era_start,
            },
            peers,
            free: (free_rows + dead_rows) as u64,
            ..CycleOutcome::default()
        };
        if member {
            self.nodes.insert(
                p.node_id.to_string(),
                NodeRow {
                    instance_id: p.instance_id.to_string(),
                    platform: p.platform.to_string(),
                    capacity: p.capacity,
                    lease_until: now + lease,
                    renewed_at: now,
                    trust_until: now + ms(p.trust),
                    owned: p.owned,
                    starting: p.starting,
                },
            );
            // Renewal (R1: an epoch is kept only while held and unexpired; during a grace only
            // the kept epochs are touched, at their epochs).
            let held: BTreeSet<i64> = p.held.iter().copied().collect();
            let kept: BTreeSet<i64> = p.kept.iter().copied().collect();
            let mine: Vec<i64> = self
                .owned_by(p.node_id)
                .filter(|id| grace == 0 || kept.contains(&self.accounts[id].owner_epoch))
                .collect();
            let mut wanted = 0u32;
            for id in mine {
                locks.insert(id);
                let a = self.accounts.get_mut(&id).expect("indexed");
                let keep = grace > 0
                    || (held.contains(&a.owner_epoch) && a.lease_until.is_some_and(|l| l >= now));
                a.lease_until = Some(now + lease);
                if !keep {
                    self.seq += 1;
                    a.owner_epoch = self.seq;
                    a.claimed_at = Some(now);
                }
                let is_wanted = a.enabled && a.platform == p.platform;
                wanted += u32::from(is_wanted);
                out.owned.push(OwnedRow {
                    id,
                    epoch: a.owner_epoch,
                    wanted: is_wanted,
                    claimed_ms: a.claimed_at.unwrap_or(0),
                });
            }
            // Claims: free rows and rows of dead nodes, lowest ids first, up to the room.
            let room = if grace > 0 {
                0
            } else {
                p.claim_limit.saturating_sub(wanted) as usize
            };
            if p.claim && room > 0 {
                let free = self
                    .free
                    .get(p.platform)
                    .into_iter()
                    .flatten()
                    .copied()
                    .filter(|id| !locked.contains(id))
                    .take(room);
                let read: BTreeSet<i64> = free
                    .chain(
                        dead_claimable
                            .iter()
                            .flat_map(|of_node| of_node.iter().copied().take(room)),
                    )
                    .collect();
                locks.extend(read.iter().copied());
                for id in read.into_iter().take(room) {
                    let epoch = self.nextval();
                    self.update_account(id, |a| {
                        a.node_id = Some(p.node_id.to_string());
                        a.lease_until = Some(now + lease);
                        a.owner_epoch = epoch;
                        a.claimed_at = Some(now);
                    });
                    out.owned.push(OwnedRow {
                        id,
                        epoch,
                        wanted: true,
                        claimed_ms: now,
                    });
                }
            }
        } else if let Some(n) = self.nodes.get(p.node_id) {
            out.conflict = Some(Conflict {
                instance_id: n.instance_id.clone(),
                expires_in: Duration::from_millis((n.lease_until - now).max(0) as u64),
            });
        }
        (out, locks)
    }

    /// Releases the node's rows at `epochs`; returns the ids released.
    pub fn release(&mut self, node_id: &str, epochs: &[i64]) -> Vec<i64> {
        let epochs: BTreeSet<i64> = epochs.iter().copied().collect();
        let out: Vec<i64> = self
            .owned_by(node_id)
            .filter(|id| epochs.contains(&self.accounts[id].owner_epoch))
            .collect();
        for id in &out {
            self.update_account(*id, |a| {
                a.node_id = None;
                a.lease_until = None;
            });
        }
        out
    }

    /// Clean shutdown: releases `epochs`, and deletes the membership of this instance if no other
    /// row names the node.
    /// As `db::lease::publish_owned`: the membership's published count, if this instance holds it.
    pub fn publish_owned(&mut self, node_id: &str, instance_id: &str, owned: u32) {
        if let Some(n) = self
            .nodes
            .get_mut(node_id)
            .filter(|n| n.instance_id == instance_id)
        {
            n.owned = owned;
        }
    }

    pub fn leave(&mut self, node_id: &str, instance_id: &str, epochs: &[i64]) -> LeaveOutcome {
        let released = self.release(node_id, epochs);
        let named = self.owned_by(node_id).next().is_some();
        let left = !named
            && self
                .nodes
                .get(node_id)
                .is_some_and(|n| n.instance_id == instance_id);
        if left {
            self.nodes.remove(node_id);
        }
        LeaveOutcome { released, left }
    }
}
