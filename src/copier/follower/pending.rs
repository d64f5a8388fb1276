//! Executing pending-copy decisions (place, amend, cancel) and what their outcomes mean:
//!
//! | outcome | place | amend | cancel |
//! | --- | --- | --- | --- |
//! | before sending | recorded in `order_copies` (fenced): nothing is sent without the record | | |
//! | accepted | indexed, its ticket recorded | indexed | indexed and recorded as gone without a fill; if the master's order filled, a reconcile copies the fill at market now |
//! | rejected, market closed | retried with the reconcile backoff (a fill meanwhile is copied at market) | retried with the backoff | retried at least every 5 s (like a close) |
//! | rejected, definitive | not placed again (its fill is copied at market) | cancelled (an unknown ticket: in doubt until the next read) | an unknown ticket: in doubt until the next read (it may have filled) |
//! | unknown, unavailable | in doubt until the next read | retried | in doubt until the next read |
//!
//! "In doubt" means nothing is decided for the key until the follower's orders, positions and
//! history are read again (in that order): a cancel that came too late may have met a fill, and
//! the copy at market is made only when the read shows the pending copy gone without a fill.

use tracing::{info, warn};

use super::Follower;
use crate::broker::types::{
    AmendOrder, CancelOrder, OpenOrder, OrderEnd, PendingOrder, PlaceOrder, Position,
    PositionChange,
};
use crate::broker::{BrokerError, RejectCode};
use crate::copier::parse_marker;
use crate::copier::rules::Link;
use crate::db;
use crate::retry;

impl Follower<'_> {
    pub(super) async fn place(
        &mut self,
        link: &Link,
        master_ticket: i64,
        order: PlaceOrder,
    ) -> Result<(), BrokerError> {
        let key = (link.magic, master_ticket);
        // Recorded before it is sent: a crash between the two cannot make a later owner place
        // it again. Nothing is sent unless the record is written by the owner.
        match self.write_order_copy(link, master_ticket, None).await {
            Ok(true) => {}
            Ok(false) => {
                warn!(
                    link_id = link.id,
                    master_ticket,
                    "this node no longer owns the follower: the pending copy is not placed"
                );
                self.ctx.lost().await;
                return Err(BrokerError::Unavailable("no longer the owner".into()));
            }
            Err(e) => {
                warn!(link_id = link.id, master_ticket, error = %db::describe(&e), "recording the pending copy failed: not placed; retried");
                self.owe("pending copy not recorded");
                return Err(BrokerError::Unavailable(format!(
                    "recording the pending copy failed: {}",
                    db::describe(&e)
                )));
            }
        }
        // Once sent, never placed again by this session, whatever the outcome.
        self.index.placing(key);
        let result = {
            let _sending = self.ctx.node.orders.sending();
            self.api.place(order.clone()).await
        };
        match &result {
            Ok(ticket) => {
                info!(link_id = link.id, master_ticket, ticket, symbol = %order.symbol, side = ?order.side, kind = ?order.kind, price = order.price, volume = order.volume, expiry_ms = ?order.expiry_ms, "pending copy placed");
                self.index.order_placed(order.pending(*ticket, 0));
                self.record_order_copy(link, master_ticket, *ticket).await;
            }
            Err(BrokerError::Rejected(r)) if r.code == RejectCode::MarketClosed => {
                info!(link_id = link.id, master_ticket, reason = %r.reason, "market closed: the pending copy is placed when it opens");
                // Nothing rests: it may be placed again, and meanwhile a fill is copied at market.
                self.unplace(link, master_ticket).await;
                self.owe("pending copy waits: market closed");
            }
            Err(BrokerError::Unavailable(reason)) => {
                // Nothing was sent: as if never placed.
                warn!(link_id = link.id, master_ticket, reason = %reason, "the pending copy could not be sent; retried");
                self.unplace(link, master_ticket).await;
                self.owe("pending copy not sent");
            }
            Err(BrokerError::Rejected(r)) => {
                warn!(link_id = link.id, master_ticket, code = r.code.as_str(), reason = %r.reason, "the broker refused the pending copy: not placed again; the master order's fill is copied at market");
                self.index.mark_ended(key);
                self.end_order_copy(link, master_ticket, "refused").await;
            }
            Err(e) => {
                warn!(link_id = link.id, master_ticket, error = %e, "pending copy's outcome unknown: nothing is decided for it until the next read");
                self.index.doubt(key);
                self.owe("place outcome unknown");
            }
        }
        result.map(|_| ())
    }

    pub(super) async fn amend(
        &mut self,
        link: &Link,
        master_ticket: i64,
        order: AmendOrder,
    ) -> Result<(), BrokerError> {
        let ticket = order.ticket;
        let set = (order.price, order.sl, order.tp, order.expiry_ms);
        let result = {
            let _sending = self.ctx.node.orders.sending();
            self.api.amend(order).await
        };
        match &result {
            Ok(()) => {
                info!(
                    link_id = link.id,
                    master_ticket,
                    ticket,
                    price = set.0,
                    sl = ?set.1,
                    tp = ?set.2,
                    expiry_ms = ?set.3,
                    "pending copy amended"
                );
                self.index.order_amended(ticket, set);
            }
            Err(BrokerError::Rejected(r)) if r.code == RejectCode::MarketClosed => {
                self.owe("amend waits: market closed");
            }
            Err(BrokerError::Rejected(r)) if r.code == RejectCode::UnknownTicket => {
                // Gone (filled, cancelled): a read tells which.
                self.index.doubt((link.magic, master_ticket));
                self.owe_within("amended pending copy gone", std::time::Duration::ZERO);
            }
            Err(BrokerError::Rejected(r)) => {
                // Left at its old price it could fill where the master's order does not: it is
                // cancelled, and the master order's fill is copied at market.
                warn!(link_id = link.id, master_ticket, ticket, code = r.code.as_str(), reason = %r.reason, "the broker refused amending the pending copy: cancelling it");
                let cancel = CancelOrder {
                    ticket,
                    client_order_id: Some(crate::copier::intent::cancel(
                        link.id,
                        master_ticket,
                        ticket,
                    )),
                };
                let reason = "its amend was refused";
                let _ = self
                    .cancel(link, master_ticket, cancel, reason, false)
                    .await;
            }
            Err(e) => {
                warn!(link_id = link.id, master_ticket, ticket, error = %e, "amending the pending copy failed; retried");
                self.owe("amend failed");
            }
        }
        result
    }

    pub(super) async fn cancel(
        &mut self,
        link: &Link,
        master_ticket: i64,
        order: CancelOrder,
        reason: &str,
        master_filled: bool,
    ) -> Result<(), BrokerError> {
        let key = (link.magic, master_ticket);
        let ticket = order.ticket;
        let result = {
            let _sending = self.ctx.node.orders.sending();
            self.api.cancel(order).await
        };
        match &result {
            Ok(()) => {
                info!(
                    link_id = link.id,
                    master_ticket, ticket, reason, "pending copy cancelled"
                );
                self.index.order_gone(ticket, false);
                self.end_order_copy(link, master_ticket, "cancelled").await;
                if master_filled {
                    // Cancelled, so not filled: the fill is copied at market, by a reconcile
                    // that reads everything first (at once).
                    self.owe_within(
                        "the master's order filled and the pending copy is cancelled",
                        std::time::Duration::ZERO,
                    );
                }
            }
            Err(BrokerError::Rejected(r)) if r.code == RejectCode::MarketClosed => {
                self.owe_within("cancel waits: market closed", retry::MARKET_CLOSED);
            }
            Err(e) => {
                // Unknown ticket: it left the book (filled, expired, cancelled by hand); or the
                // outcome is unknown. Either way a read decides.
                info!(link_id = link.id, master_ticket, ticket, error = %e, "cancelling the pending copy did not confirm; nothing is decided for it until the next read");
                self.index.doubt(key);
                self.owe_within("cancel not confirmed", std::time::Duration::ZERO);
            }
        }
        result
    }

    /// One update of the follower's position stream. A pending copy's fill is recorded in the
    /// copy ledger as it happens (the `opened` update carries its price; it may come before or
    /// after the order's `order_gone`).
    pub(super) async fn on_position(&mut self, change: PositionChange) {
        let filled = match &change {
            PositionChange::Opened { position }
                if self.index.pending_key(position.ticket).is_some()
                    || self.fills.remove(&position.ticket) =>
            {
                Some(position.clone())
            }
            // The position a fill opened: the order's ticket at MT4/MT5 brokers, a new one over
            // FIX (announced before the position's own `opened`).
            PositionChange::OrderGone {
                ticket,
                end: OrderEnd::Filled { position },
            } if self.index.pending_key(*ticket).is_some() && !self.index.is_open(*position) => {
                self.fills.insert(*position);
                None
            }
            _ => None,
        };
        // A pending copy that left the book without a fill: recorded, so a later owner may copy
        // the master order's fill at market.
        let ended = match &change {
            PositionChange::OrderGone { ticket, end }
                if !matches!(end, OrderEnd::Filled { .. }) =>
            {
                self.index.order_key(*ticket).map(|key| {
                    (
                        key,
                        if matches!(end, OrderEnd::Expired) {
                            "expired"
                        } else {
                            "cancelled"
                        },
                    )
                })
            }
            _ => None,
        };
        self.index.apply(&change);
        if let Some(p) = filled {
            self.record_fill(&p).await;
            if p.sl.is_none() && p.tp.is_none() {
                // Filled without stops (a FIX entry order carries none): the order's are set.
                self.owe_within(
                    "a pending copy filled without stops",
                    std::time::Duration::ZERO,
                );
            }
        }
        if let Some(((magic, master_ticket), how)) = ended
            && let Some(link) = self.links.list.iter().find(|l| l.magic == magic).cloned()
        {
            self.end_order_copy(&link, master_ticket, how).await;
        }
    }

    async fn record_fill(&mut self, p: &Position) {
        let (Some(master_ticket), Some(link)) = (
            parse_marker(&p.comment),
            self.links.list.iter().find(|l| l.magic == p.magic).cloned(),
        ) else {
            return;
        };
        info!(
            link_id = link.id,
            master_ticket,
            ticket = p.ticket,
            price = p.open_price,
            "pending copy filled"
        );
        self.sending.copies += 1;
        let source = self.masters.get(&link.master_id).and_then(|v| {
            v.positions
                .iter()
                .find(|m| m.ticket == master_ticket)
                .cloned()
                .or_else(|| {
                    v.orders
                        .iter()
                        .find(|o| o.ticket == master_ticket)
                        .map(|o| o.as_position())
                })
        });
        let order = OpenOrder {
            symbol: p.symbol.clone(),
            side: p.side,
            volume: p.volume,
            sl: p.sl,
            tp: p.tp,
            magic: p.magic,
            comment: p.comment.clone(),
            client_order_id: None,
            price_limit: None,
        };
        let record = super::send::copy_record(
            &link,
            master_ticket,
            &order,
            p.ticket,
            p.open_price,
            source.as_ref(),
            super::send::Clocks {
                accepted_us: Some(crate::wall_clock::unix_us()),
                ..Default::default()
            },
        );
        self.record_copy(&record);
    }

    /// Forgets a place that put nothing on the book (its record too), so it may be sent again.
    async fn unplace(&mut self, link: &Link, master_ticket: i64) {
        self.index.unmark_placed((link.magic, master_ticket));
        let c = self.order_copy(link, master_ticket);
        let result = self
            .ctx
            .node
            .db
            .run(async |conn| {
                db::copy::ledger::forget_order_copy(
                    &mut *conn,
                    (&self.ctx.node.node_id, self.ctx.epoch()),
                    c,
                )
                .await
            })
            .await;
        // On failure the row stays, unended: a later owner waits for a read rather than copy at
        // market.
        self.fenced_write(
            result,
            master_ticket,
            "forgetting a pending copy that was not placed",
        )
        .await;
    }

    /// What a fenced write of the ledger of order copies came to: refused as no longer the
    /// owner stops the session; a failure is logged (`what` failed) and left to the next read.
    async fn fenced_write(
        &mut self,
        result: Result<bool, sqlx::Error>,
        master_ticket: i64,
        what: &str,
    ) {
        match result {
            Ok(true) => {}
            Ok(false) => self.ctx.lost().await,
            Err(e) => warn!(error = %db::describe(&e), master_ticket, "{what} failed"),
        }
    }

    fn order_copy(&self, link: &Link, master_ticket: i64) -> db::copy::ledger::OrderCopy<'_> {
        db::copy::ledger::OrderCopy {
            follower_id: self.id,
            server: &self.server,
            login: &self.login,
            link_id: link.id,
            master_id: link.master_id,
            master_ticket,
        }
    }

    async fn write_order_copy(
        &self,
        link: &Link,
        master_ticket: i64,
        ticket: Option<i64>,
    ) -> Result<bool, sqlx::Error> {
        let c = self.order_copy(link, master_ticket);
        self.ctx
            .node
            .db
            .run(async |conn| {
                db::copy::ledger::record_order_copy(
                    &mut *conn,
                    (&self.ctx.node.node_id, self.ctx.epoch()),
                    c,
                    ticket,
                )
                .await
            })
            .await
    }

    /// Records a pending copy's ticket in `order_copies` (fenced).
    pub(super) async fn record_order_copy(&mut self, link: &Link, master_ticket: i64, ticket: i64) {
        let result = self
            .write_order_copy(link, master_ticket, Some(ticket))
            .await;
        // On failure the next reconcile records it.
        self.fenced_write(result, master_ticket, "recording a pending copy's ticket")
            .await;
    }

    /// Records that a pending copy left the book without a fill (fenced).
    async fn end_order_copy(&mut self, link: &Link, master_ticket: i64, ended: &str) {
        let c = self.order_copy(link, master_ticket);
        let result = self
            .ctx
            .node
            .db
            .run(async |conn| {
                db::copy::ledger::end_order_copy(
                    &mut *conn,
                    (&self.ctx.node.node_id, self.ctx.epoch()),
                    c,
                    ended,
                )
                .await
            })
            .await;
        // On failure it is kept in memory for this session; a later owner waits for a read.
        self.fenced_write(result, master_ticket, "recording how a pending copy ended")
            .await;
    }

    /// After an ordered read (orders, then positions, then history): a pending copy whose ticket
    /// was on the book once and shows in none of them left without a fill (a fill is a position,
    /// or a closed one in the history), cancelled by hand or expired while no stream told this
    /// session. Recorded, so the master order's fill may be copied at market. A copy the copy
    /// ledger knows is not in question.
    pub(super) async fn settle_vanished(&mut self, m: i64, seen: &std::collections::HashSet<i64>) {
        for (ticket, key) in self.index.unresolved_orders() {
            if seen.contains(&ticket) || self.index.ever(key) || !self.index.pending(key).is_empty()
            {
                continue;
            }
            let Some(link) = self
                .links
                .list
                .iter()
                .find(|l| l.magic == key.0 && l.master_id == m)
                .cloned()
            else {
                continue;
            };
            info!(
                link_id = link.id,
                master_ticket = key.1,
                ticket,
                "pending copy gone without a fill (in no read of orders, positions or history)"
            );
            self.index.mark_ended(key);
            self.end_order_copy(&link, key.1, "vanished").await;
        }
    }

    /// Takes what the ledger of order copies says was ever placed (and which of those left the
    /// book without a fill), as read with the reconcile's other reads, and records the pending
    /// copies of master `m` a read shows whose ticket it lacks.
    pub(super) async fn sync_order_copies(
        &mut self,
        m: i64,
        orders: &[PendingOrder],
        placed: Vec<db::copy::ledger::Placed>,
    ) {
        let mut recorded = std::collections::HashSet::new();
        for (link_id, master_ticket, ticket, ended) in placed {
            if let Some(link) = self.links.list.iter().find(|l| l.id == link_id) {
                let key = (link.magic, master_ticket);
                self.index.mark_placed(key);
                if ended {
                    self.index.mark_ended(key);
                }
                if let Some(t) = ticket {
                    self.index.know_order(t, key);
                }
            }
            recorded.extend(ticket);
        }
        for link in self.links_of(m) {
            for o in orders
                .iter()
                .filter(|o| o.magic == link.magic && !recorded.contains(&o.ticket))
            {
                if let Some(master_ticket) = parse_marker(&o.comment) {
                    self.record_order_copy(&link, master_ticket, o.ticket).await;
                }
            }
        }
    }
}
