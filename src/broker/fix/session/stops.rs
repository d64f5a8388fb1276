//! Protective stops: a position's stop loss and take profit as resting orders (cTrader's way),
//! placed, cancelled and replaced.

use super::*;

impl Shared {
    /// Places a resting order protecting position `p` (`kind` sl: a stop; tp: a limit) and
    /// waits for the venue to accept it.
    pub(super) async fn place_resting(
        &self,
        p: &Position,
        kind: &str,
        price: f64,
        base_id: &str,
    ) -> Result<(), BrokerError> {
        let contract = self.contract(&p.symbol).ok_or_else(|| {
            BrokerError::Rejected(Rejection::new(
                RejectCode::UnknownSymbol,
                format!("unknown symbol {}", p.symbol),
            ))
        })?;
        let mut cl = base_id.to_string();
        for attempt in 2..=50 {
            match self
                .ledger
                .order(self.writer.account_id, &cl)
                .await
                .map_err(unavailable)?
            {
                None => break,
                Some((_, state)) if state == "working" => return Ok(()),
                Some((known, state)) if state == "sent" => {
                    // Sent before without an answer: ask; accepted means in force.
                    let report = self.order_status(&known).await?;
                    if report.get(39) == Some("0") {
                        self.ledger
                            .set_state(self.writer.account_id, &cl, &["sent"], "working")
                            .await
                            .map_err(db_unknown)?;
                        return Ok(());
                    }
                    self.ledger
                        .set_state(self.writer.account_id, &cl, &["sent"], "rejected")
                        .await
                        .map_err(db_unknown)?;
                    cl = format!("{base_id}~{attempt}");
                }
                Some(_) => cl = format!("{base_id}~{attempt}"),
            }
        }
        let side = p.side.flip();
        let order = FixOrder {
            cl_ord_id: cl.clone(),
            kind: kind.to_string(),
            symbol: p.symbol.clone(),
            side: side_text(side).into(),
            quantity: p.volume * contract,
            position_id: Some(p.ticket),
            magic: p.magic,
            comment: p.comment.clone(),
            price: Some(price),
        };
        self.record(&order).await?;
        let mut body = vec![
            (11, cl.clone()),
            (55, p.symbol.clone()),
            (54, side_code(side).to_string()),
            (38, decimal(order.quantity)),
            (60, utc_timestamp(crate::wall_clock::unix_ms())),
            (59, "1".to_string()),
            (721, p.ticket.to_string()),
        ];
        if kind == "sl" {
            body.push((40, "3".into()));
            body.push((99, decimal(price)));
        } else {
            body.push((40, "2".into()));
            body.push((44, decimal(price)));
        }
        let report = self.send_order("D", &cl, &body, true).await?;
        match report.get(39) {
            Some("0") => {
                let by = if kind == "sl" {
                    ClosedBy::Sl
                } else {
                    ClosedBy::Tp
                };
                self.state().resting.insert(cl.clone(), by);
                self.ledger
                    .set_state(self.writer.account_id, &cl, &["sent"], "working")
                    .await
                    .map_err(db_unknown)?;
                Ok(())
            }
            _ => {
                let text = report.get(58).unwrap_or("rejected").to_string();
                self.ledger
                    .complete_order(self.writer.account_id, &cl, Err(&text))
                    .await
                    .map_err(db_unknown)?;
                Err(BrokerError::Rejected(Rejection::new(
                    reject_code(report.integer(103), &text),
                    text,
                )))
            }
        }
    }

    /// Cancels a resting order (OrderCancelRequest); gone already counts as cancelled.
    pub(super) async fn cancel_resting(&self, w: &ledger::Working) -> Result<(), BrokerError> {
        let cl = self.id("cxl");
        self.cancel_request(&cl, &w.cl_ord_id, &w.symbol, &w.side, w.quantity)
            .await?;
        self.state().resting.remove(&w.cl_ord_id);
        self.ledger
            .set_state(
                self.writer.account_id,
                &w.cl_ord_id,
                &["working", "sent"],
                "canceled",
            )
            .await
            .map_err(db_unknown)
    }

    /// Sends an OrderCancelRequest (ClOrdID `cl`) for order `orig` and waits for its answer: the
    /// cancel's report, or an OrderCancelReject.
    pub(super) async fn cancel_request(
        &self,
        cl: &str,
        orig: &str,
        symbol: &str,
        side: &str,
        quantity: f64,
    ) -> Result<Fields, BrokerError> {
        let (tx, rx) = oneshot::channel();
        self.state().orders.insert(cl.to_string(), tx);
        let body = [
            (11, cl.to_string()),
            (41, orig.to_string()),
            (55, symbol.to_string()),
            (54, side_code(side_parse(side)).to_string()),
            (38, decimal(quantity)),
            (60, utc_timestamp(crate::wall_clock::unix_ms())),
        ];
        if let Err(e) = self.send("F", &body) {
            self.state().orders.remove(cl);
            return Err(e);
        }
        match tokio::time::timeout(self.endpoint.request_timeout, rx).await {
            Ok(Ok(report)) => Ok(report),
            Ok(Err(_)) => Err(BrokerError::Unknown(format!(
                "cancel of {orig}: the FIX connection dropped"
            ))),
            Err(_) => {
                self.state().orders.remove(cl);
                Err(BrokerError::Unknown(format!(
                    "cancel of {orig}: no answer in time"
                )))
            }
        }
    }

    /// Makes position `ticket`'s resting stop loss and take profit what is asked.
    pub(super) async fn set_stops(
        &self,
        ticket: i64,
        sl: Option<f64>,
        tp: Option<f64>,
        base_id: &str,
    ) -> Result<(), BrokerError> {
        let Some(p) = self.position(ticket).await? else {
            return Err(BrokerError::Rejected(Rejection::new(
                RejectCode::UnknownTicket,
                format!("unknown ticket {ticket}"),
            )));
        };
        let working = self
            .ledger
            .working(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        for (kind, want) in [("sl", sl), ("tp", tp)] {
            let current: Vec<&ledger::Working> = working
                .iter()
                .filter(|w| w.position_id == ticket && w.kind == kind)
                .collect();
            let same = match (current.as_slice(), want) {
                ([one], Some(price)) => (one.price - price).abs() < 1e-9,
                ([], None) => true,
                _ => false,
            };
            if same {
                continue;
            }
            for w in current {
                self.cancel_resting(w).await?;
            }
            if let Some(price) = want {
                self.place_resting(&p, kind, price, &format!("{base_id}-{kind}"))
                    .await?;
            }
        }
        Ok(())
    }
}
