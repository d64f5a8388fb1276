//! The follower's risk limits at work: each reading of its balance and equity judges them
//! ([`crate::copier::risk::evaluate`]), stores what changed (fenced, and only over the state the
//! node last read, so an operator's reset is never undone), holds new copies while one is
//! reached, and closes every copy when a reached limit says `close_all`.

use std::collections::{BTreeSet, HashMap};

use tracing::{debug, info, warn};

use super::Follower;
use super::links::stand_in_link;
use super::send::Sent;
use crate::broker::types::AccountInfo;
use crate::copier::risk::{RiskAction, RiskLimit, RiskState, evaluate, evaluate_older};
use crate::db;
use crate::db::copy::Saved;

/// The follower's risk limits, each with its stored state.
#[derive(Default)]
pub(super) struct Guard {
    pub(super) limits: Vec<RiskLimit>,
    /// Limits judged on a reading whose state is not stored yet (a failed write), by id.
    pub(super) pending: HashMap<i64, RiskState>,
    /// Copy tickets a reached `close_all` limit closes, kept until each is closed.
    pub(super) closing: BTreeSet<i64>,
    /// Counts the changes of the limits and their periods (a limit added, changed, reset or
    /// removed; a period started): an older reading counts only if none came since it was
    /// asked for, so a value from before a reset, a new limit or a new period never reaches it.
    pub(super) changes: u64,
}

/// How a reading of the account's figures stands to the others taken.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Reading {
    /// The latest: its figures are the account's.
    Latest,
    /// Asked for before a reading taken since, when the limits had seen `asked_at` changes
    /// ([`Guard::changes`]): its figures are not the account's any more, but what it saw
    /// happened.
    Older { asked_at: u64 },
}

impl Follower<'_> {
    /// The state a limit is judged by: the one judged last, if not stored yet, else the stored.
    fn risk_state<'s>(&'s self, limit: &'s RiskLimit) -> &'s RiskState {
        self.risk.pending.get(&limit.id).unwrap_or(&limit.state)
    }

    /// True when any limit is reached in its current period.
    pub(super) fn risk_held(&self) -> bool {
        self.risk
            .limits
            .iter()
            .any(|l| self.risk_state(l).hit.is_some())
    }

    /// Takes freshly read limits: a judged state not stored yet is kept while the stored one is
    /// still what it was judged over (an operator's reset or a changed limit drops it).
    pub(super) fn take_risk_limits(&mut self, limits: Vec<RiskLimit>) {
        let before: HashMap<i64, RiskState> = self
            .risk
            .limits
            .iter()
            .map(|l| (l.id, l.state.clone()))
            .collect();
        self.risk.pending.retain(|id, _| {
            limits
                .iter()
                .any(|l| l.id == *id && before.get(id) == Some(&l.state))
        });
        if self.risk.limits != limits {
            self.risk.changes += 1;
        }
        self.risk.limits = limits;
        self.funds.risk_hold = self.risk_held();
    }

    /// Judges the limits on a reading of the account: the latest taken, or ([`Reading::Older`])
    /// one answered after a newer one was taken, which counts only a drawdown it saw
    /// ([`evaluate_older`]), and only if the limits and their periods are as they were when it
    /// was asked for.
    pub(super) async fn judge_risk(&mut self, info: &AccountInfo, reading: Reading) {
        if let Reading::Older { asked_at } = reading
            && asked_at != self.risk.changes
        {
            debug!(
                "an older reading of the account's figures: the risk limits changed since it was asked for, not judged"
            );
            return;
        }
        // The broker server's clock bounds the periods; without it, the node's UTC clock.
        let server_ms = info
            .server_time_ms
            .unwrap_or_else(crate::wall_clock::unix_ms);
        let was_held = self.funds.risk_hold;
        let mut reload = false;
        for i in 0..self.risk.limits.len() {
            let limit = self.risk.limits[i].clone();
            let judged = RiskLimit {
                state: self.risk_state(&limit).clone(),
                ..limit.clone()
            };
            let e = match reading {
                Reading::Latest => evaluate(&judged, info.balance, info.equity, server_ms),
                Reading::Older { .. } => {
                    evaluate_older(&judged, info.balance, info.equity, server_ms)
                }
            };
            if (&e.state.period_key, e.state.start_value)
                != (&judged.state.period_key, judged.state.start_value)
            {
                self.risk.changes += 1;
            }
            if e.newly_hit {
                warn!(
                    limit_id = limit.id,
                    limit = %limit,
                    action = limit.action.as_str(),
                    reason = e.state.hit.as_deref().unwrap_or_default(),
                    "risk limit reached: no new copies until it resets{}",
                    if limit.action == RiskAction::CloseAll {
                        "; closing every copy"
                    } else {
                        ""
                    }
                );
            }
            if e.new_period {
                info!(limit_id = limit.id, limit = %limit, "risk limit reset: a new period began");
            }
            if !e.changed && !self.risk.pending.contains_key(&limit.id) {
                continue;
            }
            let saved = self
                .ctx
                .node
                .db
                .run(async |conn| {
                    db::copy::save_risk_state(
                        conn,
                        &self.ctx.node.node_id,
                        self.id,
                        self.ctx.epoch(),
                        limit.id,
                        &limit.state,
                        &e.state,
                    )
                    .await
                })
                .await;
            match saved {
                Ok(Saved::Saved) => {
                    self.risk.limits[i].state = e.state;
                    self.risk.pending.remove(&limit.id);
                }
                Ok(Saved::NotOwner) => {
                    self.ctx.lost().await;
                    return;
                }
                Ok(Saved::Changed) => {
                    info!(
                        limit_id = limit.id,
                        "risk limit changed or reset meanwhile: reading the limits again"
                    );
                    self.risk.pending.remove(&limit.id);
                    reload = true;
                }
                // Kept as judged: it holds meanwhile, and the next reading stores it.
                Err(err) => {
                    warn!(limit_id = limit.id, error = %db::describe(&err), "storing a risk limit's state failed; retried at the next reading");
                    self.risk.pending.insert(limit.id, e.state);
                }
            }
        }
        if reload {
            // Boxed: reading links may reconcile, and a reconcile reads the funds again (it
            // comes back here with `reconcile_changed` false, so only once).
            Box::pin(self.load_links_only(false)).await;
        }
        let held = self.risk_held();
        if was_held && !held {
            info!("every risk limit is clear: new copies resume");
        }
        if held && !was_held {
            // Pending copies would be new copies when they fill: a reconcile cancels them now.
            self.owe_within("a risk limit was reached", std::time::Duration::ZERO);
        }
        self.funds.risk_hold = held;
        let close_all = self.risk.limits.iter().find_map(|l| {
            (l.action == RiskAction::CloseAll)
                .then(|| self.risk_state(l).hit.clone())
                .flatten()
        });
        if close_all.is_some() || !self.risk.closing.is_empty() {
            self.close_for_risk(close_all.is_some()).await;
        }
    }

    /// Closes the follower's copies for a reached `close_all` limit: with `capture`, every copy
    /// open now joins the set to close; the set is kept until each of them is closed (a close
    /// the broker refuses, e.g. outside the market's hours, is tried again at every reading),
    /// even if the limit resets meanwhile. Copies of links removed or unreadable are closed
    /// too: the set is every position carrying a copy marker.
    async fn close_for_risk(&mut self, capture: bool) {
        if !capture && self.risk.closing.is_empty() {
            return;
        }
        match self.read_broker().await {
            Ok((orders, positions, history)) => {
                self.index.rebuild_orders(&orders);
                self.index.rebuild(&positions, &history);
            }
            Err(e) => {
                warn!(error = %e, "could not read the follower's positions to close its copies for a risk limit; retrying at the next reading");
                return;
            }
        }
        let open: Vec<((i64, i64), i64)> = self.index.all_open().collect();
        if capture {
            self.risk
                .closing
                .extend(open.iter().map(|(_, ticket)| *ticket));
        }
        let open_tickets: std::collections::HashSet<i64> = open.iter().map(|(_, t)| *t).collect();
        self.risk.closing.retain(|t| open_tickets.contains(t));
        for ((magic, master_ticket), ticket) in open {
            if !self.risk.closing.contains(&ticket) {
                continue;
            }
            let link = self
                .links
                .list
                .iter()
                .find(|l| l.magic == magic)
                .cloned()
                .unwrap_or_else(|| stand_in_link(0, 0, magic));
            info!(
                link_id = link.id,
                master_ticket, ticket, "closing a copy: a risk limit with close_all was reached"
            );
            let reason = "a risk limit with close_all was reached";
            if self.close_copy(&link, master_ticket, ticket, reason).await == Sent::Gated {
                return;
            }
        }
    }
}
