//! The follower's links: read them (a row that does not parse is reported with its id and
//! ignored), subscribe to each master's events before any snapshot of it is read, and reconcile
//! the masters whose links changed.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use tracing::{info, warn};

use super::Follower;
use super::send::Sent;
use crate::copier::intent;
use crate::copier::reconcile::Action;
use crate::db;
use crate::db::batch::Submitted;
use crate::hub::{Subscription, Topic};
use crate::model::link::{Link, LotMode};

/// The follower's copy links as last read, and what hangs off them.
#[derive(Default)]
pub(super) struct Links {
    pub(super) list: Vec<Link>,
    /// The links were read at least once (later changes reconcile the masters concerned).
    pub(super) loaded: bool,
    /// The session's first read failed: the list is empty, so the reconcile of every master
    /// owed then reads them first (a later failure keeps the links read before, re-read at the
    /// next tick or announcement).
    pub(super) stale: bool,
    /// Links that do not parse (shown on the status until mended).
    pub(super) bad: BTreeSet<String>,
    /// Links removed with `on_remove = 'close'` whose copies are still to be closed.
    pub(super) removed: Vec<db::copy::RemovedLink>,
    /// One subscription to each linked master's events.
    pub(super) subscriptions: HashMap<i64, Subscription>,
    /// The session's first read of the links, asked before its prepared login's fence was
    /// raised ([`super::Early`]): taken by the first load instead of a read of its own.
    pub(super) asked: Option<Submitted<Result<db::copy::FollowerLinks, String>>>,
}

impl Follower<'_> {
    /// Re-reads the links; subscribes to new masters (before any snapshot of theirs is read) and
    /// reconciles masters whose links changed. False if the task was stopped meanwhile.
    pub(super) async fn reload_links(&mut self) -> bool {
        self.load_links(true).await
    }

    /// As [`Self::reload_links`], leaving the reconciles to the caller (who reconciles every
    /// master anyway).
    pub(super) async fn reload_links_only(&mut self) -> bool {
        self.load_links(false).await
    }

    async fn load_links(&mut self, reconcile_changed: bool) -> bool {
        let loaded = self.load_links_only(reconcile_changed).await;
        if loaded && !self.links.removed.is_empty() {
            self.close_removed().await;
        }
        if loaded && !self.risk.limits.is_empty() {
            // Judged at once on a fresh reading (a limit added, changed or reset).
            self.report_funds().await;
        }
        loaded
    }

    /// Closes the copies of links removed with `on_remove = 'close'` (through the gate, retried
    /// by the next reconcile if a close fails), and forgets a removed link once none is open.
    pub(super) async fn close_removed(&mut self) {
        // Judged from the broker's positions as read now: the index may not have been filled
        // yet (a session's first link read comes before its first reconcile).
        match self.read_broker().await {
            Ok((orders, positions, history)) => {
                self.index.rebuild_orders(&orders);
                self.index.rebuild(&positions, &history);
            }
            Err(e) => {
                warn!(error = %e, "could not read the follower's positions to close a removed link's copies; retrying later");
                self.owe("broker read failed");
                return;
            }
        }
        for r in self.links.removed.clone() {
            let copies: Vec<(i64, i64)> = self
                .index
                .copies_of_link(r.magic)
                .flat_map(|(master_ticket, list)| {
                    list.iter().map(move |c| (master_ticket, c.ticket))
                })
                .collect();
            let pending: Vec<(i64, i64)> = self
                .index
                .pending_of_link(r.magic)
                .flat_map(|t| {
                    self.index
                        .pending((r.magic, t))
                        .iter()
                        .map(move |o| (t, o.ticket))
                })
                .collect();
            if copies.is_empty() && pending.is_empty() {
                let forgotten = self
                    .ctx
                    .node
                    .db
                    .run(async |conn| {
                        db::copy::forget_removed_link(
                            &mut *conn,
                            &self.ctx.node.node_id,
                            self.id,
                            self.ctx.epoch(),
                            r.link_id,
                        )
                        .await
                    })
                    .await;
                if forgotten.is_ok() {
                    info!(link_id = r.link_id, "removed link's copies all closed");
                    self.links.removed.retain(|x| x.link_id != r.link_id);
                }
                continue;
            }
            info!(
                link_id = r.link_id,
                copies = copies.len(),
                "link removed with on_remove = close: closing its copies"
            );
            let link = stand_in_link(r.link_id, r.master_id, r.magic);
            for (master_ticket, ticket) in pending {
                let action = Action::Cancel {
                    master_ticket,
                    ticket,
                    reason: "its link was removed (on_remove = close)",
                    client_order_id: intent::cancel(r.link_id, master_ticket, ticket),
                };
                if self.execute(&link, action, None, None).await == Sent::Gated {
                    return;
                }
            }
            for (master_ticket, ticket) in copies {
                let reason = "its link was removed (on_remove = close)";
                if self.close_copy(&link, master_ticket, ticket, reason).await == Sent::Gated {
                    return;
                }
            }
        }
    }

    /// Subscribes to the events of each of `masters` not subscribed to yet; false when the
    /// session was stopped meanwhile or the notification hub is gone.
    pub(super) async fn subscribe_masters(&mut self, masters: &HashSet<i64>) -> bool {
        for m in masters {
            if !self.links.subscriptions.contains_key(m) {
                let sub = tokio::select! {
                    _ = self.ctx.cancel.cancelled() => return false,
                    s = self.ctx.node.hub.subscribe(Topic::Master(*m), self.signals.clone()) => s,
                };
                match sub {
                    Some(s) => {
                        self.links.subscriptions.insert(*m, s);
                    }
                    None => return false,
                }
            }
        }
        true
    }

    pub(super) async fn load_links_only(&mut self, reconcile_changed: bool) -> bool {
        // Read with the other followers' of this node that ask meanwhile (one batch), unless
        // the session asked before its fence's raise.
        let loaded = match self.links.asked.take() {
            Some(asked) => asked.outcome().await,
            None => {
                self.ctx
                    .node
                    .links
                    .write(db::copy::LinksRead(self.id))
                    .await
            }
        }
        .and_then(|read| read);
        let rows = match loaded {
            Ok(read) => {
                self.max_open_copies = read.max_open_copies;
                self.links.removed = read.removed;
                self.take_risk_limits(read.risk);
                read.links
            }
            Err(e) if !self.links.loaded => {
                warn!(error = %e, "reading the follower's links failed at the session's start; read again with the reconcile owed");
                self.links.stale = true;
                self.owe("links read failed");
                return true;
            }
            Err(e) => {
                warn!(error = %e, "reading the follower's links failed; keeping the current ones");
                return true;
            }
        };
        self.links.stale = false;
        let mut links = Vec::new();
        let mut problems = BTreeSet::new();
        for row in rows {
            match row {
                Ok(link) => links.push(link),
                Err(problem) => {
                    if !self.links.bad.contains(&problem) {
                        warn!(problem = %problem, "ignoring a copy link that does not parse");
                    }
                    problems.insert(problem);
                }
            }
        }
        if problems != self.links.bad {
            self.links.bad = problems;
            let status = self.status.clone();
            self.set_status(&status);
        }
        if self.links.loaded && links == self.links.list {
            return true;
        }
        let wanted: HashSet<i64> = links.iter().map(|l| l.master_id).collect();
        if !self.subscribe_masters(&wanted).await {
            return false;
        }
        self.links.subscriptions.retain(|m, _| wanted.contains(m));
        let changed: BTreeMap<i64, ()> = links
            .iter()
            .filter(|l| !self.links.list.contains(l))
            .map(|l| (l.master_id, ()))
            .chain(
                self.links
                    .list
                    .iter()
                    .filter(|l| !links.contains(l))
                    .map(|l| (l.master_id, ())),
            )
            .collect();
        let first = !self.links.loaded;
        self.links.loaded = true;
        if !first {
            info!(links = links.len(), "copy links changed");
        }
        self.links.list = links;
        self.masters.retain(|m, _| wanted.contains(m));
        if self.links.list.is_empty() {
            self.set_status("follower: no copy links");
        }
        if !first {
            for m in changed.keys().filter(|m| wanted.contains(m)) {
                self.masters.remove(m);
                if reconcile_changed {
                    self.reconcile_master(*m, "copy link changed").await;
                }
            }
        }
        true
    }
}

impl Follower<'_> {
    /// Closes one copy outside a reconcile (a removed link's, or for a risk limit), through the
    /// gate, under the copy's own close intent.
    pub(super) async fn close_copy(
        &mut self,
        link: &Link,
        master_ticket: i64,
        ticket: i64,
        reason: &'static str,
    ) -> Sent {
        let action = Action::Close {
            master_ticket,
            ticket,
            reason,
            client_order_id: intent::close(link.id, master_ticket, ticket),
        };
        self.execute(link, action, None, None).await
    }
}

/// A link as closing its copies needs it, when the session does not hold the link itself (a
/// removed link, or one it cannot read): its id, master and magic; copying nothing.
pub(super) fn stand_in_link(id: i64, master_id: i64, magic: i64) -> Link {
    Link {
        id,
        master_id,
        enabled: false,
        magic,
        lot_mode: LotMode::Multiplier,
        lot_value: 1.0,
        reverse: false,
        copy_sl_tp: false,
        symbol_map: Default::default(),
        copy_existing: false,
        created_at_ms: 0,
        protections: Default::default(),
    }
}
