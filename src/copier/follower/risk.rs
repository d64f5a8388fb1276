//! The follower's risk limits at work: each reading of its balance and equity judges them
//! ([`crate::copier::risk::evaluate`]), stores what changed (fenced), holds new copies while one
//! is reached, and closes every copy when a reached limit says `close_all`.

use tracing::{info, warn};

use super::Follower;
use crate::broker::types::AccountInfo;
use crate::copier::intent;
use crate::copier::reconcile::Action;
use crate::copier::risk::{RiskAction, evaluate};
use crate::db;

use super::send::Sent;

impl Follower<'_> {
    pub(super) async fn judge_risk(&mut self, info: &AccountInfo) {
        // The broker server's clock bounds the periods; without it, the node's UTC clock.
        let server_ms = info
            .server_time_ms
            .unwrap_or_else(crate::wall_clock::unix_ms);
        let mut close_all = None;
        let mut held = false;
        for i in 0..self.risk.len() {
            let limit = self.risk[i].clone();
            let e = evaluate(&limit, info.balance, info.equity, server_ms);
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
            if let Some(reason) = &e.state.hit {
                held = true;
                if limit.action == RiskAction::CloseAll {
                    close_all = Some(reason.clone());
                }
            }
            if e.changed {
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
                            &e.state,
                        )
                        .await
                    })
                    .await;
                match saved {
                    // Stored: the next reading starts from it.
                    Ok(true) => self.risk[i].state = e.state,
                    Ok(false) => {
                        self.ctx.lost().await;
                        return;
                    }
                    // Kept unstored: the next reading judges again and stores it then; the hold
                    // applies meanwhile.
                    Err(e) => {
                        warn!(limit_id = limit.id, error = %db::describe(&e), "storing a risk limit's state failed; retried at the next reading")
                    }
                }
            }
        }
        if self.funds.risk_hold && !held {
            info!("every risk limit is clear: new copies resume");
        }
        self.funds.risk_hold = held;
        if let Some(reason) = close_all {
            self.close_every_copy(&reason).await;
        }
    }

    /// Closes every copy of every link (through the gate; a close that fails is retried by the
    /// next reconcile and the next reading, which finds the limit still reached).
    async fn close_every_copy(&mut self, reason: &str) {
        match super::read_follower(self.api.as_ref()).await {
            Ok((positions, history)) => self.index.rebuild(&positions, &history),
            Err(e) => {
                warn!(error = %e, "could not read the follower's positions to close its copies for a risk limit; retrying");
                self.owe("broker read failed");
                return;
            }
        }
        for link in self.links.clone() {
            let copies: Vec<(i64, i64)> = self
                .index
                .copies_of_link(link.magic)
                .flat_map(|(master_ticket, list)| {
                    list.iter().map(move |c| (master_ticket, c.ticket))
                })
                .collect();
            for (master_ticket, ticket) in copies {
                info!(
                    link_id = link.id,
                    master_ticket,
                    ticket,
                    reason,
                    "closing a copy: a risk limit with close_all was reached"
                );
                let action = Action::Close {
                    master_ticket,
                    ticket,
                    reason: "a risk limit with close_all was reached",
                    client_order_id: intent::close(link.id, master_ticket, ticket),
                };
                if self.execute(&link, action, None).await == Sent::Gated {
                    return;
                }
            }
        }
    }
}
