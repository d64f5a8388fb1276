//! Orders: recorded in the ledger before they leave, sent, and their outcome completed from the
//! venue's report, or settled by OrderStatusRequest when the report never came.

use super::*;

impl Shared {
    /// Writes an order to the ledger before it is sent; refused (nothing to send) when this
    /// node no longer owns the account at its epoch.
    pub(super) async fn record(&self, order: &FixOrder) -> Result<(), BrokerError> {
        if self
            .ledger
            .record_order(&self.writer, order)
            .await
            .map_err(unavailable)?
        {
            return Ok(());
        }
        Err(stale_fence(&self.writer))
    }

    /// OrderStatusRequest for every order of the ledger without an outcome.
    pub(super) async fn resolve_unresolved(&self) -> Result<(), BrokerError> {
        let open = self
            .ledger
            .unresolved(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        for order in open
            .iter()
            .filter(|o| o.kind == "open" || o.kind == "close")
        {
            // Still unknown (the venue says it is working): it stays `sent`, and its intent is
            // blocked until the venue says how it ended.
            if let Outcome::Unknown(why) = self.settle(order).await? {
                warn!(account_id = self.writer.account_id, cl_ord_id = %order.cl_ord_id, why, "a FIX order's outcome is still unknown");
            }
        }
        for e in self
            .ledger
            .entries(self.writer.account_id)
            .await
            .map_err(unavailable)?
            .iter()
            .filter(|e| e.state == "sent")
        {
            self.settle_entry(e, false).await?;
        }
        for order in open.iter().filter(|o| o.kind == "sl" || o.kind == "tp") {
            let report = self.order_status(order).await?;
            let state = if report.get(39) == Some("0") {
                "working"
            } else {
                "rejected"
            };
            self.ledger
                .set_state(self.writer.account_id, &order.cl_ord_id, &["sent"], state)
                .await
                .map_err(db_unknown)?;
        }
        Ok(())
    }

    /// How an order recorded earlier ended, asked of the venue by OrderStatusRequest and
    /// written to the ledger. A venue that does not know the ClOrdID may have forgotten it (a
    /// reset, a new trading day): an opening order is then matched against the account's
    /// unmarked positions before it is called never received.
    pub(super) async fn settle(&self, order: &FixOrder) -> Result<Outcome, BrokerError> {
        let report = self.order_status(order).await?;
        let status = report.get(39).unwrap_or("");
        let cum = report.number(14).unwrap_or(0.0);
        let text = report.get(58).unwrap_or("").to_string();
        let unknown = report.integer(103) == Some(5) || text.contains("unknown order");
        let outcome = if cum > 0.0 {
            outcome_of(&report)
        } else if unknown {
            match self.adopt(order).await? {
                Some((position, price)) => Outcome::Filled {
                    position,
                    price,
                    units: order.quantity,
                },
                None => Outcome::Refused(Rejection::new(
                    RejectCode::Rejected,
                    "the venue never received the order",
                )),
            }
        } else if matches!(status, "8" | "4" | "C") {
            outcome_of(&report)
        } else {
            Outcome::Unknown(format!(
                "order {} is still working at the venue (OrdStatus {status})",
                order.cl_ord_id
            ))
        };
        self.record_outcome(order, &outcome).await?;
        Ok(outcome)
    }

    /// An unmarked open position that an opening order the venue forgot could have made: same
    /// symbol, side and quantity, and no other order of the ledger opened it.
    pub(super) async fn adopt(&self, order: &FixOrder) -> Result<Option<(i64, f64)>, BrokerError> {
        if order.kind != "open" && order.kind != "entry" {
            return Ok(None);
        }
        let contract = self.contract(&order.symbol).unwrap_or(1.0);
        let (positions, _) = self.request_positions().await?;
        let known = self
            .ledger
            .positions(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        let marked: HashSet<i64> = known
            .iter()
            .filter(|k| !k.comment.is_empty() || k.magic != 0)
            .map(|k| k.position_id)
            .collect();
        Ok(positions
            .iter()
            .filter(|p| !marked.contains(&p.ticket))
            .filter(|p| p.symbol == order.symbol && side_text(p.side) == order.side)
            .filter(|p| {
                (p.volume * contract - order.quantity).abs() <= 1e-6 * order.quantity.max(1.0)
            })
            .max_by_key(|p| p.ticket)
            .map(|p| (p.ticket, p.open_price)))
    }

    pub(super) async fn order_status(&self, order: &FixOrder) -> Result<Fields, BrokerError> {
        let (tx, rx) = oneshot::channel();
        self.state().statuses.insert(order.cl_ord_id.clone(), tx);
        let side = side_code(side_parse(&order.side));
        self.send(
            "H",
            &[
                (11, order.cl_ord_id.clone()),
                (55, order.symbol.clone()),
                (54, side.to_string()),
            ],
        )?;
        tokio::time::timeout(self.endpoint.request_timeout, rx)
            .await
            .map_err(|_| unavailable("no answer to an OrderStatusRequest in time"))?
            .map_err(|_| unavailable("the FIX connection dropped"))
    }

    /// Records an order's own final report in the ledger; returns it as an outcome.
    pub(super) async fn complete(
        &self,
        order: &FixOrder,
        m: &Fields,
    ) -> Result<Outcome, BrokerError> {
        let outcome = outcome_of(m);
        self.record_outcome(order, &outcome).await?;
        Ok(outcome)
    }

    pub(super) async fn record_outcome(
        &self,
        order: &FixOrder,
        outcome: &Outcome,
    ) -> Result<(), BrokerError> {
        let account = self.writer.account_id;
        let cl = &order.cl_ord_id;
        match &outcome {
            Outcome::Filled {
                position,
                price,
                units,
            } => {
                // The lots filled: an opening order's are the position's opening volume.
                let fill = ledger::Fill {
                    position_id: *position,
                    price: *price,
                    lots: self
                        .contract(&order.symbol)
                        .map_or(0.0, |c| round_lots(units / c)),
                };
                self.ledger
                    .complete_order(account, cl, Ok(fill))
                    .await
                    .map_err(db_unknown)?;
            }
            Outcome::Refused(r) => {
                self.ledger
                    .complete_order(account, cl, Err(&r.reason))
                    .await
                    .map_err(db_unknown)?;
            }
            Outcome::Duplicate | Outcome::Unknown(_) => {}
        }
        Ok(())
    }

    /// Sends a NewOrderSingle recorded in the ledger and waits for its report: a final one, or
    /// (`resting`) the New that acknowledges a resting order. Not sent: the ledger row goes (the
    /// next attempt may use the ClOrdID). Sent without an answer: the outcome is unknown.
    pub(super) async fn send_order(
        &self,
        msg_type: &str,
        cl: &str,
        body: &[(u32, String)],
        resting: bool,
    ) -> Result<Fields, BrokerError> {
        let what = if resting { "resting order" } else { "order" };
        let (tx, rx) = oneshot::channel();
        let forget = |state: &mut State| {
            state.orders.remove(cl);
            state.acks.remove(cl);
        };
        {
            let mut state = self.state();
            state.orders.insert(cl.to_string(), tx);
            if resting {
                state.acks.insert(cl.to_string());
            }
        }
        if let Err(e) = self.send(msg_type, body) {
            forget(&mut self.state());
            let _ = self.ledger.forget_order(self.writer.account_id, cl).await;
            return Err(e);
        }
        match tokio::time::timeout(self.endpoint.request_timeout, rx).await {
            Ok(Ok(report)) => Ok(report),
            Ok(Err(_)) => Err(BrokerError::Unknown(format!(
                "{what} {cl}: the FIX connection dropped before its report"
            ))),
            Err(_) => {
                forget(&mut self.state());
                Err(BrokerError::Unknown(format!(
                    "{what} {cl}: no report in time"
                )))
            }
        }
    }

    /// Sends an order (recorded in the ledger first) and waits for its final report.
    pub(super) async fn place(
        &self,
        base_id: &str,
        order: FixOrder,
        limit: Option<f64>,
        position: Option<i64>,
    ) -> Result<(String, Outcome, bool), BrokerError> {
        // A ClOrdID the ledger has already: how it ended (never a resend of it); a new attempt
        // (`~N`) only when the venue says it definitively did not execute, or (a close) filled
        // only part.
        let mut cl = base_id.to_string();
        let mut attempt = 1;
        loop {
            attempt += 1;
            if attempt > 50 {
                return Err(BrokerError::Rejected(Rejection::new(
                    RejectCode::Rejected,
                    format!("{base_id}: 50 attempts refused; not sent again"),
                )));
            }
            let Some((known, state)) = self
                .ledger
                .order(self.writer.account_id, &cl)
                .await
                .map_err(unavailable)?
            else {
                break;
            };
            if state != "rejected" {
                match self.settle(&known).await? {
                    Outcome::Refused(_) => {}
                    Outcome::Filled { units, .. }
                        if known.kind == "close" && units + 1e-9 < known.quantity => {}
                    Outcome::Unknown(why) => return Err(BrokerError::Unknown(why)),
                    outcome => return Ok((cl, outcome, true)),
                }
            }
            cl = format!("{base_id}~{attempt}");
        }
        let order = FixOrder {
            cl_ord_id: cl.clone(),
            ..order
        };
        self.record(&order).await?;
        let mut body = vec![
            (11, cl.clone()),
            (55, order.symbol.clone()),
            (54, side_code(side_parse(&order.side)).to_string()),
            (38, decimal(order.quantity)),
            (60, utc_timestamp(crate::wall_clock::unix_ms())),
        ];
        match limit {
            Some(price) => {
                body.push((40, "2".into()));
                body.push((44, decimal(price)));
                body.push((59, "3".into()));
            }
            None => body.push((40, "1".into())),
        }
        if let Some(p) = position {
            body.push((721, p.to_string()));
        }
        let report = self.send_order("D", &cl, &body, false).await?;
        if outcome_of(&report) == Outcome::Duplicate {
            // The venue executed this ClOrdID before: ask what came of it.
            return match self.settle(&order).await? {
                Outcome::Unknown(why) => Err(BrokerError::Unknown(why)),
                outcome => Ok((cl, outcome, true)),
            };
        }
        let outcome = self.complete(&order, &report).await?;
        Ok((cl, outcome, false))
    }
}

/// How an order ended, from its final ExecutionReport.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Outcome {
    Filled {
        position: i64,
        price: f64,
        units: f64,
    },
    Refused(Rejection),
    /// The venue refused the ClOrdID as one it executed before.
    Duplicate,
    /// Not known how it ended (still working, or a fill that names no position).
    Unknown(String),
}

pub(super) fn outcome_of(m: &Fields) -> Outcome {
    let status = m.get(39).unwrap_or("");
    let cum = m.number(14).unwrap_or(0.0);
    let text = m.get(58).unwrap_or("").to_string();
    let reason = m.integer(103);
    match status {
        "2" | "1" | "4" | "C" if cum > 0.0 => match m.integer(721) {
            Some(position) => Outcome::Filled {
                position,
                price: m.number(6).unwrap_or(0.0),
                units: cum,
            },
            None => Outcome::Unknown("the venue's fill names no position (PosMaintRptID)".into()),
        },
        "8" if reason == Some(6) => Outcome::Duplicate,
        "8" if reason == Some(5) || text.contains("unknown order") => Outcome::Refused(
            Rejection::new(RejectCode::Rejected, "the venue never received the order"),
        ),
        "4" | "C" => Outcome::Refused(Rejection::new(
            RejectCode::Slippage,
            if text.is_empty() {
                "the order was cancelled unfilled (price beyond its limit)".to_string()
            } else {
                text
            },
        )),
        _ => Outcome::Refused(Rejection::new(
            reject_code(reason, &text),
            if text.is_empty() {
                format!("rejected (OrdStatus {status})")
            } else {
                text
            },
        )),
    }
}
