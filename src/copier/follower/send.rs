//! Executing a decision: the gate right before anything reaches the broker, the order, what its
//! outcome means (docs/copying.md, Decisions), and the records that outlive the session.
//!
//! | outcome | open | close, trim, stop change |
//! | --- | --- | --- |
//! | accepted | copy indexed (from the reply: the stream may come later) | indexed |
//! | rejected, transient (market closed, requote) | retried until `max_delay_ms`, then `too_late` (final) | retried until confirmed |
//! | rejected, definitive | final skip (`rejected`, `slippage`): never retried | retried until confirmed (an unknown ticket: closed, or renumbered by MT4; a read tells) |
//! | unknown, unavailable | reconcile by marker first, then as transient | reconcile, then retried |
//! | gate closed | not sent; reconcile when trust returns | the same |

use tracing::{debug, info, warn};

use super::Follower;
use crate::broker::types::OpenOrder;
use crate::broker::types::{AmendOrder, CancelOrder, CloseOrder, ModifyOrder};
use crate::broker::{BrokerError, RejectCode};
use crate::copier::intent;
use crate::copier::reconcile::Action;
use crate::copier::rules::{Link, SkipCode, fixed_stops};
use crate::db;
use crate::db::copy::ledger::CopyRecord;
use crate::model::MasterPosition;
use crate::retry;

/// The orders a follower session sent and the records they owe.
#[derive(Default)]
pub(super) struct Sending {
    /// Copies opened this session.
    pub(super) copies: u64,
    /// Actions carried out this session (sent, skipped or waited: each may write a record).
    pub(super) actions: u64,
    /// Ledger rows handed to the node's writer whose outcome is not looked at yet (by the copy's
    /// ticket).
    pub(super) ledger: Vec<(i64, crate::db::batch::Submitted<bool>)>,
    /// Transient refusals already recorded this session (one history row per kind).
    pub(super) noted: std::collections::HashSet<(i64, i64, SkipCode)>,
}

/// What became of one action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sent {
    /// The broker accepted the order.
    Accepted,
    /// Sent but rejected, or its outcome is unknown.
    Failed,
    /// Nothing to send (a skip or a wait).
    Nothing,
    /// The gate refused it.
    Gated,
}

impl Follower<'_> {
    /// Sends one action. `Gated` when the gate refused it (the rest of a plan is not sent either).
    /// Carries out one action of the plan. `source`: the master position it copies, as the
    /// follower knows it (its price and times go to the copy ledger).
    /// `heard_us`: when the master event's notice it acts on reached the node (Unix µs; `None`
    /// when a reconcile decided it).
    pub(super) async fn execute(
        &mut self,
        link: &Link,
        action: Action,
        source: Option<&MasterPosition>,
        heard_us: Option<i64>,
    ) -> Sent {
        self.sending.actions += 1;
        let decided_us = crate::wall_clock::unix_us();
        let master_ticket = action.master_ticket();
        match &action {
            Action::Skip { code, reason, .. } => {
                self.decided(link, master_ticket, *code, reason).await;
                return Sent::Nothing;
            }
            Action::Wait { reason, .. } => {
                self.transient(link, master_ticket, SkipCode::Waiting, reason)
                    .await;
                return Sent::Nothing;
            }
            _ => {}
        }
        // The ledger rows of this follower's earlier copies are in before its next order: a copy
        // is never closed here while its row could still be lost (a write fenced out because
        // the account moved meanwhile), when only the broker's history would tell it was made.
        // Waited for while the gate holds: a database that stops answering closes the gate, and
        // the order is then refused (gated, owed) instead of waiting on the database unseen.
        let flushed = self.sending.ledger.is_empty() || self.flush_ledger_while_trusted().await;
        // HoldsLease, right before anything reaches the broker.
        if !flushed || !self.ctx.gate.holds() {
            warn!(
                link_id = link.id,
                master_ticket, "gate closed: order not sent (a reconcile runs once trust returns)"
            );
            self.ctx.node.metrics.orders_gated.inc();
            self.owe("gate closed");
            return Sent::Gated;
        }
        crate::failpoints::failpoint!(
            "COPIERTEST_PAUSE_AFTER_GATE",
            "holding an order after its gate check"
        );
        let (kind, result) = match action {
            Action::Open { order, base, .. } => {
                let sent_us = crate::wall_clock::unix_us();
                let result = {
                    let _sending = self.ctx.node.orders.sending();
                    self.api.open(order.clone()).await
                };
                match &result {
                    Ok(fill) => {
                        self.sending.copies += 1;
                        // What was opened: a venue's fill may be less than asked.
                        let opened = OpenOrder {
                            volume: fill.volume.unwrap_or(order.volume),
                            ..order.clone()
                        };
                        info!(link_id = link.id, master_ticket, ticket = fill.ticket, symbol = %order.symbol, side = ?order.side, volume = opened.volume, asked = order.volume, duplicate = fill.duplicate, "copy opened");
                        self.index
                            .opened(opened.position(fill.ticket, fill.price, 0));
                        let mut record = copy_record(
                            link,
                            master_ticket,
                            &opened,
                            fill.ticket,
                            fill.price,
                            source,
                            Clocks {
                                notice_us: heard_us,
                                decided_us: Some(decided_us),
                                sent_us: Some(sent_us),
                                accepted_us: Some(crate::wall_clock::unix_us()),
                            },
                        );
                        if fill.duplicate && fill.volume.is_none() {
                            // The first attempt's fill, which may have been sized otherwise: what
                            // it opened is not known from this reply.
                            record.opened_volume = None;
                        }
                        self.record_copy(&record);
                        if let Some(master_volume) = base {
                            self.record_base(link, master_ticket, fill.ticket, master_volume)
                                .await;
                        }
                        self.set_fixed_stops(link, master_ticket, &order, fill.ticket, fill.price)
                            .await;
                    }
                    Err(BrokerError::Rejected(r)) if r.code.transient() => {
                        let code = if r.code == RejectCode::MarketClosed {
                            SkipCode::MarketClosed
                        } else {
                            SkipCode::Requote
                        };
                        self.transient(link, master_ticket, code, &r.reason).await;
                    }
                    Err(BrokerError::Rejected(r)) => {
                        let code = if r.code == RejectCode::Slippage {
                            SkipCode::Slippage
                        } else {
                            SkipCode::Rejected
                        };
                        let reason =
                            format!("rejected by the broker ({}): {}", r.code.as_str(), r.reason);
                        self.decided(link, master_ticket, code, &reason).await;
                    }
                    Err(e) => {
                        warn!(link_id = link.id, master_ticket, error = %e, "copy outcome unknown or not sent: reconciling by marker before anything is retried");
                        self.transient(link, master_ticket, SkipCode::Unavailable, &e.to_string())
                            .await;
                    }
                }
                ("open", result.map(|_| ()))
            }
            Action::Close {
                ticket,
                reason,
                client_order_id,
                ..
            } => {
                let order = CloseOrder {
                    ticket,
                    volume: None,
                    client_order_id: Some(client_order_id),
                };
                (
                    "close",
                    self.close(link, master_ticket, order, reason).await,
                )
            }
            Action::Trim {
                ticket,
                close_volume,
                client_order_id,
                ..
            } => {
                let order = CloseOrder {
                    ticket,
                    volume: Some(close_volume),
                    client_order_id: Some(client_order_id),
                };
                let reason = "master position partially closed";
                (
                    "close",
                    self.close(link, master_ticket, order, reason).await,
                )
            }
            Action::Modify {
                ticket,
                sl,
                tp,
                client_order_id,
                ..
            } => {
                let order = ModifyOrder {
                    ticket,
                    sl,
                    tp,
                    client_order_id: Some(client_order_id),
                };
                let result = {
                    let _sending = self.ctx.node.orders.sending();
                    self.api.modify(order).await
                };
                match &result {
                    Ok(()) => {
                        info!(
                            link_id = link.id,
                            master_ticket,
                            ticket,
                            ?sl,
                            ?tp,
                            "copy stops modified"
                        );
                        self.index.stops(ticket, sl, tp);
                    }
                    Err(BrokerError::Rejected(r)) if r.code == RejectCode::UnknownTicket => {
                        // Closed, or (MT4) renumbered by a trim whose remainder the index does
                        // not know yet: a read tells, and the remainder gets its stops.
                        debug!(
                            ticket,
                            "the copy's ticket is gone; reconciling to find out whether it was renumbered"
                        );
                        self.index.reduced(ticket, 0.0);
                        self.owe("a copy's ticket is gone");
                    }
                    Err(e) => {
                        warn!(link_id = link.id, master_ticket, ticket, error = %e, "modifying a copy's stops failed; retried until confirmed");
                        self.owe("modify failed");
                    }
                }
                ("modify", result)
            }
            Action::Place { order, .. } => ("place", self.place(link, master_ticket, order).await),
            Action::Amend {
                ticket,
                price,
                sl,
                tp,
                expiry_ms,
                client_order_id,
                ..
            } => {
                let order = AmendOrder {
                    ticket,
                    price,
                    sl,
                    tp,
                    expiry_ms,
                    client_order_id: Some(client_order_id),
                };
                ("amend", self.amend(link, master_ticket, order).await)
            }
            Action::Cancel {
                ticket,
                reason,
                client_order_id,
                ..
            } => {
                let order = CancelOrder {
                    ticket,
                    client_order_id: Some(client_order_id),
                };
                // With the master's position open, its order filled.
                let filled = source.is_some();
                (
                    "cancel",
                    self.cancel(link, master_ticket, order, reason, filled)
                        .await,
                )
            }
            Action::Skip { .. } | Action::Wait { .. } => unreachable!("handled above"),
        };
        let outcome = match &result {
            Ok(()) => "accepted",
            Err(BrokerError::Rejected(_)) => "rejected",
            Err(BrokerError::Unknown(_)) => "unknown",
            Err(BrokerError::Unavailable(_)) => "unavailable",
        };
        self.ctx.node.metrics.order(kind, outcome);
        if result.is_ok() {
            Sent::Accepted
        } else {
            Sent::Failed
        }
    }

    /// Closes all or part of a copy; retried (through a reconcile) until the broker confirms it.
    async fn close(
        &mut self,
        link: &Link,
        master_ticket: i64,
        order: CloseOrder,
        reason: &str,
    ) -> Result<(), BrokerError> {
        let ticket = order.ticket;
        let result = {
            let _sending = self.ctx.node.orders.sending();
            self.api.close(order).await
        };
        match &result {
            Ok(fill) => {
                info!(
                    link_id = link.id,
                    master_ticket,
                    ticket,
                    closed = fill.closed_volume,
                    remaining = fill.remaining_volume,
                    reason,
                    "copy closed"
                );
                self.index.reduced(ticket, fill.remaining_volume);
            }
            Err(BrokerError::Rejected(r)) if r.code == RejectCode::UnknownTicket => {
                // Closed, or (MT4) renumbered by an earlier trim whose remainder the index does
                // not know yet: a read tells, and the remainder is closed or trimmed then.
                debug!(
                    ticket,
                    "the copy's ticket is gone; reconciling to find out whether it was renumbered"
                );
                self.index.reduced(ticket, 0.0);
                self.owe("a copy's ticket is gone");
            }
            Err(BrokerError::Rejected(r)) if r.code == RejectCode::MarketClosed => {
                // Never dropped: tried again every few seconds until the market opens.
                info!(link_id = link.id, master_ticket, ticket, reason = %r.reason, "market closed: the copy's close is queued and sent when it opens");
                self.owe_within("close queued: market closed", retry::MARKET_CLOSED);
            }
            Err(e) => {
                warn!(link_id = link.id, master_ticket, ticket, error = %e, "closing a copy failed; retried until the broker confirms it");
                self.owe("close failed");
            }
        }
        result.map(|_| ())
    }

    /// Right after a fill, the link's stops in points, counted from the copy's own price (the
    /// order carried none of them). A failure leaves it to the next reconcile, which sets them
    /// from the copy's open price too.
    async fn set_fixed_stops(
        &mut self,
        link: &Link,
        master_ticket: i64,
        order: &OpenOrder,
        ticket: i64,
        price: f64,
    ) {
        let p = &link.protections;
        if p.sl_points.is_none() && p.tp_points.is_none() {
            return;
        }
        let Some(spec) = self.specs.get(&order.symbol) else {
            return;
        };
        let Ok((sl, tp)) = fixed_stops(link, order.side, price, spec, (order.sl, order.tp)) else {
            return;
        };
        let modify = ModifyOrder {
            ticket,
            sl,
            tp,
            client_order_id: Some(intent::stops(link.id, master_ticket, ticket, (0, 0))),
        };
        let result = {
            let _sending = self.ctx.node.orders.sending();
            self.api.modify(modify).await
        };
        match result {
            Ok(()) => {
                info!(
                    link_id = link.id,
                    master_ticket,
                    ticket,
                    ?sl,
                    ?tp,
                    "copy's fixed stops set from its fill"
                );
                self.index.stops(ticket, sl, tp);
            }
            Err(e) => {
                warn!(link_id = link.id, master_ticket, ticket, error = %e, "setting the copy's fixed stops failed; the next reconcile sets them");
                self.owe("fixed stops not set");
            }
        }
    }

    /// A final decision not to copy: logged, counted, recorded (fenced), and respected by every
    /// later reconcile, on any node.
    async fn decided(&mut self, link: &Link, master_ticket: i64, code: SkipCode, reason: &str) {
        if !self.memory.decided.insert((link.id, master_ticket)) {
            return;
        }
        info!(
            link_id = link.id,
            master_ticket,
            code = code.as_str(),
            reason,
            "not copied (final)"
        );
        self.ctx.node.metrics.copies_skipped.inc();
        self.record(link, master_ticket, code, reason, true).await;
    }

    /// A refusal for now: retried by a reconcile (within the link's `max_delay_ms`, after which
    /// the decision is `too_late`); recorded once per session and kind as history.
    async fn transient(&mut self, link: &Link, master_ticket: i64, code: SkipCode, reason: &str) {
        self.owe(code.as_str());
        if !self.sending.noted.insert((link.id, master_ticket, code)) {
            return;
        }
        info!(
            link_id = link.id,
            master_ticket,
            code = code.as_str(),
            reason,
            "not copied yet; retrying"
        );
        self.record(link, master_ticket, code, reason, false).await;
    }

    async fn record(
        &mut self,
        link: &Link,
        master_ticket: i64,
        code: SkipCode,
        reason: &str,
        is_final: bool,
    ) {
        let result = self
            .ctx
            .node
            .db
            .run(async |conn| {
                db::copy::record_decision(
                    &mut *conn,
                    &self.ctx.node.node_id,
                    self.id,
                    self.ctx.epoch(),
                    link.id,
                    master_ticket,
                    code.as_str(),
                    reason,
                    is_final,
                )
                .await
            })
            .await;
        match result {
            Ok(true) => {}
            Ok(false) => self.ctx.lost().await,
            Err(e) => {
                warn!(error = %db::describe(&e), link_id = link.id, master_ticket, "recording a copy decision failed")
            }
        }
    }

    /// Hands a copy to the ledger's writer (fenced) and observes its latency legs. The session
    /// goes on meanwhile (the writer gives way to the node's orders in flight, so a fan-out's
    /// rows are written after its orders): the outcome is looked at later
    /// ([`Self::ledger_written`]), and the write is waited for before this follower's next
    /// order, before the ledger is read and before the session ends (so the row is in before
    /// the copy can be closed here and before the account can be released).
    pub(super) fn record_copy(&mut self, record: &CopyRecord) {
        // Slippage in points of the follower's symbol, when its broker gives the point size.
        let point = self
            .specs
            .get(&record.symbol)
            .map(|s| s.point)
            .filter(|p| p.is_finite() && *p > 0.0);
        let record = CopyRecord {
            server: self.server.clone(),
            login: self.login.clone(),
            slippage_points: record
                .slippage
                .zip(point)
                .map(|(s, p)| (s / p * 10.0).round() / 10.0),
            ..record.clone()
        };
        let metrics = &self.ctx.node.metrics;
        // Each leg in seconds: from the µs instants where both ends have one, else from the ms
        // ones (the master's fill is the broker's, in ms).
        let seconds = |us: (Option<i64>, Option<i64>), ms: (Option<i64>, Option<i64>)| {
            us.0.zip(us.1)
                .map(|(from, to)| (to - from).max(0) as f64 / 1e6)
                .or_else(|| {
                    ms.0.zip(ms.1)
                        .map(|(from, to)| (to - from).max(0) as f64 / 1e3)
                })
        };
        let legs = [
            (
                "master_fill_to_event",
                seconds(
                    (None, None),
                    (record.master_fill_ms, record.event_committed_ms),
                ),
            ),
            (
                "event_to_decision",
                seconds(
                    (record.event_committed_us, record.decided_us),
                    (record.event_committed_ms, record.decided_ms),
                ),
            ),
            (
                "decision_to_accept",
                seconds(
                    (record.decided_us, record.accepted_us),
                    (record.decided_ms, record.accepted_ms),
                ),
            ),
        ];
        for (leg, took) in legs {
            if let Some(took) = took {
                metrics.copy_leg(leg, took);
            }
        }
        let ticket = record.follower_ticket;
        let submitted = self
            .ctx
            .node
            .copy_ledger
            .submit(db::copy::ledger::CopyWrite {
                node_id: self.ctx.node.node_id.clone(),
                follower_id: self.id,
                epoch: self.ctx.epoch(),
                record,
            });
        self.sending.ledger.push((ticket, submitted));
        // What finished meanwhile is looked at now (a long session keeps no list of them).
        self.ledger_written();
    }

    /// [`Self::flush_ledger`] for as long as the gate holds: true once every earlier row is in,
    /// false if the gate's trust ran out first (the writes not finished stay submitted and are
    /// waited for before the next order).
    async fn flush_ledger_while_trusted(&mut self) -> bool {
        loop {
            if !self.ctx.gate.holds() {
                return false;
            }
            let Some(deadline) = self.ctx.gate.deadline() else {
                return false;
            };
            let Some((ticket, submitted)) = self.sending.ledger.first_mut() else {
                return true;
            };
            let ticket = *ticket;
            let outcome = tokio::select! {
                outcome = submitted.outcome_mut() => Some(outcome),
                // Trust runs out: the loop sees whether a renewal moved the deadline meanwhile.
                _ = tokio::time::sleep_until(deadline) => None,
            };
            if let Some(outcome) = outcome {
                ledger_outcome(ticket, outcome);
                self.sending.ledger.remove(0);
            }
        }
    }

    /// Waits for every ledger write of the session still under way (before the ledger is read,
    /// and before the session ends).
    pub(super) async fn flush_ledger(&mut self) {
        for (ticket, submitted) in std::mem::take(&mut self.sending.ledger) {
            ledger_outcome(ticket, submitted.outcome().await);
        }
    }

    /// [`Self::flush_ledger`] at the session's end, the writer hurried: the account's release
    /// waits for these rows, and a hand-off's receiver for that release, so they do not wait
    /// for the node's other orders ([`crate::db::batch::BatchWriter::hurry`]).
    pub(super) async fn finish_ledger(&mut self) {
        if !self.sending.ledger.is_empty() {
            self.ctx.node.copy_ledger.hurry();
        }
        self.flush_ledger().await;
    }

    /// Takes the outcomes of the ledger writes that have finished (logged, and forgotten).
    fn ledger_written(&mut self) {
        self.sending
            .ledger
            .retain_mut(|(ticket, submitted)| match submitted.try_outcome() {
                Some(outcome) => {
                    ledger_outcome(*ticket, outcome);
                    false
                }
                None => true,
            });
    }

    async fn record_base(
        &mut self,
        link: &Link,
        master_ticket: i64,
        copy_ticket: i64,
        master_volume: f64,
    ) {
        self.memory.bases.insert(copy_ticket, master_volume);
        let result = self
            .ctx
            .node
            .db
            .run(async |conn| {
                db::copy::record_base(
                    &mut *conn,
                    &self.ctx.node.node_id,
                    self.id,
                    self.ctx.epoch(),
                    copy_ticket,
                    link.id,
                    master_ticket,
                    master_volume,
                )
                .await
            })
            .await;
        if let Err(e) = result {
            warn!(error = %db::describe(&e), copy_ticket, "recording a late copy's base volume failed; later trims scale against the master's open volume");
        }
    }
}

/// Logs what became of a copy's ledger row.
fn ledger_outcome(ticket: i64, outcome: Result<bool, String>) {
    match outcome {
        Ok(true) => {}
        Ok(false) => debug!(
            ticket,
            "copy already in the ledger, or the follower is no longer owned"
        ),
        Err(why) => {
            warn!(error = %why, ticket, "recording a copy in the ledger failed; the next reconcile records it")
        }
    }
}

/// A copy's instants on the follower node's clock (Unix µs), where it went through them: the
/// notice of the master event it copies received, its decision, its order handed to the broker
/// connection, and the broker's reply. A copy without a reply is one a reconcile found.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Clocks {
    pub(super) notice_us: Option<i64>,
    pub(super) decided_us: Option<i64>,
    pub(super) sent_us: Option<i64>,
    pub(super) accepted_us: Option<i64>,
}

/// The ledger's row for a copy of `master_ticket` under `link`, filled as `ticket` at `price`.
pub(super) fn copy_record(
    link: &Link,
    master_ticket: i64,
    order: &OpenOrder,
    ticket: i64,
    price: f64,
    source: Option<&MasterPosition>,
    clocks: Clocks,
) -> CopyRecord {
    let ms = |us: Option<i64>| us.map(|us| us.div_euclid(1000));
    let requested = source.map(|m| m.open_price).filter(|p| *p > 0.0);
    // Positive when the copy filled worse than the master's price, for the copy's side.
    let slippage = requested.map(|r| (price - r) * order.side.sign());
    CopyRecord {
        server: String::new(),
        login: String::new(),
        follower_ticket: ticket,
        link_id: link.id,
        master_id: link.master_id,
        master_ticket,
        symbol: order.symbol.clone(),
        side: if order.side == crate::broker::types::Side::Buy {
            "buy"
        } else {
            "sell"
        }
        .into(),
        volume: order.volume,
        requested_price: requested,
        filled_price: price,
        slippage,
        slippage_bps: slippage.zip(requested).map(|(s, r)| s / r * 10_000.0),
        slippage_points: None,
        master_fill_ms: source.and_then(|m| m.open_time_ms),
        event_committed_ms: source.and_then(|m| m.first_seen_ms),
        decided_ms: ms(clocks.decided_us),
        accepted_ms: ms(clocks.accepted_us),
        event_committed_us: source.and_then(|m| m.first_seen_us),
        notice_us: clocks.notice_us,
        decided_us: clocks.decided_us,
        sent_us: clocks.sent_us,
        accepted_us: clocks.accepted_us,
        found_by_reconcile: clocks.accepted_us.is_none(),
        opened_volume: Some(order.volume),
    }
}
