//! Executing pending-copy decisions (place, amend, cancel) and what their outcomes mean:
//!
//! | outcome | place | amend | cancel |
//! | --- | --- | --- | --- |
//! | accepted | indexed, recorded in `order_copies` | indexed | indexed as gone; if the master's order filled, a reconcile copies the fill at market now |
//! | rejected, market closed | retried (a reconcile within 5 s) | retried | retried |
//! | rejected, definitive | not placed again (its fill is copied at market) | left as it is | an unknown ticket: in doubt until the next read (it may have filled) |
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
        // Once sent, never placed again by this session, whatever the outcome.
        self.index.mark_placed(key);
        let result = self.api.place(order.clone()).await;
        match &result {
            Ok(ticket) => {
                info!(link_id = link.id, master_ticket, ticket, symbol = %order.symbol, side = ?order.side, kind = ?order.kind, price = order.price, volume = order.volume, expiry_ms = ?order.expiry_ms, "pending copy placed");
                self.index.order_placed(PendingOrder {
                    ticket: *ticket,
                    symbol: order.symbol.clone(),
                    side: order.side,
                    kind: order.kind,
                    price: order.price,
                    volume: order.volume,
                    sl: order.sl,
                    tp: order.tp,
                    expiry_ms: order.expiry_ms,
                    magic: order.magic,
                    comment: order.comment.clone(),
                    placed_ms: 0,
                });
                self.record_order_copy(link, master_ticket, *ticket).await;
            }
            Err(BrokerError::Rejected(r)) if r.code == RejectCode::MarketClosed => {
                info!(link_id = link.id, master_ticket, reason = %r.reason, "market closed: the pending copy is placed when it opens");
                self.unplace(key);
                self.owe_within("pending copy waits: market closed", retry::MARKET_CLOSED);
            }
            Err(BrokerError::Rejected(r)) => {
                warn!(link_id = link.id, master_ticket, code = r.code.as_str(), reason = %r.reason, "the broker refused the pending copy: not placed again; the master order's fill is copied at market");
            }
            Err(e) => {
                warn!(link_id = link.id, master_ticket, error = %e, "pending copy's outcome unknown: nothing is decided for it until the next read");
                self.index.doubt(key);
                self.owe("place outcome unknown");
            }
        }
        result.map(|_| ())
    }

    /// A place the broker refused only for now (the market is closed): it may be sent again.
    fn unplace(&mut self, key: crate::copier::index::Key) {
        self.index.unmark_placed(key);
    }

    pub(super) async fn amend(
        &mut self,
        link: &Link,
        master_ticket: i64,
        order: AmendOrder,
    ) -> Result<(), BrokerError> {
        let ticket = order.ticket;
        let set = (order.price, order.sl, order.tp, order.expiry_ms);
        let result = self.api.amend(order).await;
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
                self.owe_within("amend waits: market closed", retry::MARKET_CLOSED);
            }
            Err(BrokerError::Rejected(r)) => {
                // Gone (filled, cancelled) or refused as it is: the next read tells.
                warn!(link_id = link.id, master_ticket, ticket, code = r.code.as_str(), reason = %r.reason, "the broker refused amending the pending copy");
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
        let result = self.api.cancel(order).await;
        match &result {
            Ok(()) => {
                info!(
                    link_id = link.id,
                    master_ticket, ticket, reason, "pending copy cancelled"
                );
                self.index.order_gone(ticket, false);
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
            PositionChange::OrderGone {
                ticket,
                end: OrderEnd::Filled { .. },
            } if self.index.pending_key(*ticket).is_some() && !self.index.is_open(*ticket) => {
                self.fills.insert(*ticket);
                None
            }
            _ => None,
        };
        self.index.apply(&change);
        if let Some(p) = filled {
            self.record_fill(&p).await;
        }
    }

    async fn record_fill(&mut self, p: &Position) {
        let (Some(master_ticket), Some(link)) = (
            parse_marker(&p.comment),
            self.links.iter().find(|l| l.magic == p.magic).cloned(),
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
        self.copies_sent += 1;
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
            None,
            Some(crate::wall_clock::unix_ms()),
        );
        self.record_copy(&record).await;
    }

    /// Records a pending copy in `order_copies` (fenced), so no later session places it again.
    pub(super) async fn record_order_copy(&mut self, link: &Link, master_ticket: i64, ticket: i64) {
        let result = self
            .ctx
            .node
            .db
            .run(async |conn| {
                db::copy::ledger::record_order_copy(
                    &mut *conn,
                    (&self.ctx.node.node_id, self.id, self.ctx.epoch()),
                    (&self.server, &self.login),
                    (ticket, link.id, link.master_id, master_ticket),
                )
                .await
            })
            .await;
        if let Err(e) = result {
            warn!(error = %db::describe(&e), ticket, "recording a pending copy failed; the next reconcile records it");
        }
    }

    /// Reads what the ledger of order copies says was ever placed, and records the pending
    /// copies of master `m` a read shows that have no row yet. False when it cannot be read.
    pub(super) async fn sync_order_copies(&mut self, m: i64, orders: &[PendingOrder]) -> bool {
        let placed = self
            .ctx
            .node
            .db
            .run(async |conn| {
                db::copy::ledger::placed(&mut *conn, self.id, &self.server, &self.login).await
            })
            .await;
        let placed = match placed {
            Ok(p) => p,
            Err(e) => {
                warn!(error = %db::describe(&e), "reading the ledger of order copies failed; nothing is decided until it can be read");
                return false;
            }
        };
        let mut recorded = std::collections::HashSet::new();
        for (link_id, master_ticket, ticket) in placed {
            if let Some(link) = self.links.iter().find(|l| l.id == link_id) {
                self.index.mark_placed((link.magic, master_ticket));
            }
            recorded.insert(ticket);
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
        true
    }
}
