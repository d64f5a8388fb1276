//! The [`TradeApi`] the copy engine calls: each call one operation at a time per account (the
//! `ops` lock), over the dispatcher's cache, the ledger and the venue.

use super::*;

impl TradeApi for SessionApi {
    fn logout(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            // Nothing of this session goes out again: the engine logs out and stops.
            self.0.stop.cancel();
            self.0.engine.stop().await;
            info!(
                account_id = self.0.writer.account_id,
                "FIX session logged out"
            );
        })
    }

    fn positions(&self) -> BoxFuture<'_, Result<Vec<Position>, BrokerError>> {
        Box::pin(async move {
            let _op = self.0.ops.lock().await;
            crate::failpoints::failpoint!(
                "COPIERTEST_FIX_HOLD_POSITIONS",
                "FIX positions read held (the account's turn taken)"
            );
            let positions = self.0.read_positions().await?;
            Ok(positions.into_iter().map(|p| self.0.shown(p)).collect())
        })
    }

    fn history(&self) -> BoxFuture<'_, Result<Vec<ClosedPosition>, BrokerError>> {
        Box::pin(async move {
            let rows = self
                .0
                .ledger
                .positions(self.0.writer.account_id)
                .await
                .map_err(unavailable)?;
            Ok(rows.into_iter().filter_map(history_entry).collect())
        })
    }

    fn account(&self) -> BoxFuture<'_, Result<AccountInfo, BrokerError>> {
        Box::pin(async {
            Err(unavailable(
                "account balance and equity are not read over FIX",
            ))
        })
    }

    fn symbols(&self) -> BoxFuture<'_, Result<Vec<SymbolSpec>, BrokerError>> {
        Box::pin(async move { Ok(self.0.state().symbols.values().cloned().collect()) })
    }

    fn open(&self, order: OpenOrder) -> BoxFuture<'_, Result<OpenFill, BrokerError>> {
        Box::pin(async move {
            let s = &self.0;
            let _op = s.ops.lock().await;
            let contract = s.listed_contract(&order.symbol)?;
            let base = order
                .client_order_id
                .clone()
                .unwrap_or_else(|| s.id(&format!("{}-open", s.writer.node_id)));
            let record = FixOrder {
                cl_ord_id: base.clone(),
                kind: "open".into(),
                symbol: order.symbol.clone(),
                side: side_text(order.side).into(),
                quantity: order.volume * contract,
                position_id: None,
                magic: order.magic,
                comment: order.comment.clone(),
                price: None,
            };
            let (cl, outcome, prior) = s.place(&base, record, order.price_limit, None).await?;
            match outcome {
                Outcome::Filled {
                    position,
                    price,
                    units,
                } => {
                    // The cache learns the marker the ledger holds.
                    if let Some(p) = s.state().positions.get_mut(&position) {
                        p.magic = order.magic;
                        p.comment = order.comment.clone();
                    }
                    // Stops are resting orders placed after the fill; one that fails leaves the
                    // copy without it, and the next reconcile sets it again.
                    if (order.sl.is_some() || order.tp.is_some())
                        && let Err(e) = s.set_stops(position, order.sl, order.tp, &cl).await
                    {
                        warn!(ticket = position, error = %e, "setting a new FIX position's stops failed; the next reconcile retries");
                    }
                    Ok(OpenFill {
                        ticket: position,
                        price,
                        volume: Some(round_lots(units / contract)),
                        duplicate: prior,
                    })
                }
                Outcome::Refused(r) => Err(BrokerError::Rejected(r)),
                Outcome::Duplicate => Err(BrokerError::Unknown(format!(
                    "order {cl}: the venue calls it a duplicate but reports no fill"
                ))),
                Outcome::Unknown(why) => Err(BrokerError::Unknown(format!("order {cl}: {why}"))),
            }
        })
    }

    fn close(&self, order: CloseOrder) -> BoxFuture<'_, Result<CloseFill, BrokerError>> {
        Box::pin(async move {
            let s = &self.0;
            let _op = s.ops.lock().await;
            let Some(p) = s.position(s.venue_position(order.ticket)).await? else {
                return Err(BrokerError::Rejected(Rejection::new(
                    RejectCode::UnknownTicket,
                    format!("unknown ticket {}", order.ticket),
                )));
            };
            let Some(contract) = s.contract(&p.symbol) else {
                return Err(BrokerError::Rejected(Rejection::new(
                    RejectCode::UnknownSymbol,
                    format!("unknown symbol {}", p.symbol),
                )));
            };
            let lots = order.volume.unwrap_or(p.volume).min(p.volume);
            let base = order
                .client_order_id
                .clone()
                .unwrap_or_else(|| s.id(&format!("{}-close{}", s.writer.node_id, order.ticket)));
            let record = FixOrder {
                cl_ord_id: base.clone(),
                kind: "close".into(),
                symbol: p.symbol.clone(),
                side: side_text(p.side.flip()).into(),
                quantity: lots * contract,
                position_id: Some(p.ticket),
                magic: p.magic,
                comment: p.comment.clone(),
                price: None,
            };
            let (cl, outcome, prior) = s.place(&base, record, None, Some(p.ticket)).await?;
            match outcome {
                Outcome::Filled { price, units, .. } => {
                    let closed = round_lots(units / contract);
                    Ok(CloseFill {
                        ticket: order.ticket,
                        closed_volume: closed,
                        remaining_volume: round_lots((p.volume - closed).max(0.0)),
                        price,
                        duplicate: prior,
                    })
                }
                Outcome::Refused(r) => Err(BrokerError::Rejected(r)),
                Outcome::Duplicate => Err(BrokerError::Unknown(format!(
                    "order {cl}: the venue calls it a duplicate but reports no fill"
                ))),
                Outcome::Unknown(why) => Err(BrokerError::Unknown(format!("order {cl}: {why}"))),
            }
        })
    }

    fn modify(&self, order: ModifyOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let s = &self.0;
            let _op = s.ops.lock().await;
            let base = order
                .client_order_id
                .clone()
                .unwrap_or_else(|| s.id(&format!("{}-stops{}", s.writer.node_id, order.ticket)));
            s.set_stops(s.venue_position(order.ticket), order.sl, order.tp, &base)
                .await
        })
    }

    // Pending orders are entry orders (limit and stop orders that open a position).
    fn orders(&self) -> BoxFuture<'_, Result<Vec<PendingOrder>, BrokerError>> {
        Box::pin(async move {
            let s = &self.0;
            let _op = s.ops.lock().await;
            s.read_orders().await
        })
    }

    fn place(&self, order: PlaceOrder) -> BoxFuture<'_, Result<i64, BrokerError>> {
        Box::pin(async move {
            let s = &self.0;
            let _op = s.ops.lock().await;
            let contract = s.listed_contract(&order.symbol)?;
            let base = order
                .client_order_id
                .clone()
                .unwrap_or_else(|| s.id(&format!("{}-entry", s.writer.node_id)));
            // A ClOrdID the ledger has already: what came of it (never a resend); a new attempt
            // (`~N`) only after a definitive refusal.
            let mut cl = base.clone();
            for attempt in 2..=50 {
                let Some(known) = s
                    .ledger
                    .entry(s.writer.account_id, &cl)
                    .await
                    .map_err(unavailable)?
                else {
                    break;
                };
                let known = if known.state == "sent" {
                    s.settle_entry(&known, false).await?;
                    s.ledger
                        .entry(s.writer.account_id, &cl)
                        .await
                        .map_err(unavailable)?
                        .unwrap_or(known)
                } else {
                    known
                };
                match (known.state.as_str(), known.ticket) {
                    ("rejected", _) => cl = format!("{base}~{attempt}"),
                    (_, Some(ticket)) => return Ok(ticket),
                    (state, None) => {
                        return Err(BrokerError::Unknown(format!(
                            "entry order {cl}: {state} at the venue without an order id"
                        )));
                    }
                }
            }
            let entry = Entry {
                cl_ord_id: cl.clone(),
                symbol: order.symbol.clone(),
                side: side_text(order.side).into(),
                quantity: order.volume * contract,
                order_type: match order.kind {
                    PendingKind::Limit => "limit".into(),
                    PendingKind::Stop => "stop".into(),
                },
                price: order.price,
                sl: order.sl,
                tp: order.tp,
                expiry_ms: order.expiry_ms,
                magic: order.magic,
                comment: order.comment.clone(),
                ticket: None,
                replaces: None,
                state: "sent".into(),
                sent_ms: crate::wall_clock::unix_ms(),
            };
            if !s
                .ledger
                .record_entry(&s.writer, &entry)
                .await
                .map_err(unavailable)?
            {
                return Err(stale_fence(&s.writer));
            }
            s.state().entries.insert(cl.clone(), EntryMark::of(&entry));
            let body = s.entry_body(&entry);
            let report = match s.send_order("D", &cl, &body, true).await {
                Ok(report) => report,
                Err(e) => {
                    if matches!(e, BrokerError::Unavailable(_)) {
                        s.state().entries.remove(&cl);
                    }
                    return Err(e);
                }
            };
            let ticket = order_ticket(report.get(37).unwrap_or(""));
            match report.get(39) {
                Some("0") | Some("1") | Some("A") => {
                    s.ledger
                        .entry_working(s.writer.account_id, &cl, ticket)
                        .await
                        .map_err(db_unknown)?;
                    if let Some(mark) = s.state().entries.get_mut(&cl) {
                        mark.ticket = Some(ticket);
                    }
                    Ok(ticket)
                }
                // Filled at once (a marketable entry order): the fill opened its position.
                Some("2") => Ok(ticket),
                _ => {
                    s.state().entries.remove(&cl);
                    let text = report.get(58).unwrap_or("rejected").to_string();
                    s.ledger
                        .complete_order(s.writer.account_id, &cl, Err(&text))
                        .await
                        .map_err(db_unknown)?;
                    Err(BrokerError::Rejected(Rejection::new(
                        reject_code(report.integer(103), &text),
                        text,
                    )))
                }
            }
        })
    }

    // A new price or expiry is an OrderCancelReplaceRequest (the venue keeps the OrderID, so the
    // ticket stays); new stops alone change only what the position gets once it fills.
    fn amend(&self, order: AmendOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let s = &self.0;
            let _op = s.ops.lock().await;
            let account = s.writer.account_id;
            let e = s.entry_of_ticket(order.ticket).await?;
            if (e.price - order.price).abs() < 1e-12 && e.expiry_ms == order.expiry_ms {
                return s
                    .ledger
                    .entry_stops(account, &e.cl_ord_id, order.sl, order.tp)
                    .await
                    .map_err(db_unknown);
            }
            let mut cl = order
                .client_order_id
                .clone()
                .unwrap_or_else(|| s.id(&format!("{}-amend", s.writer.node_id)));
            let base = cl.clone();
            while s
                .ledger
                .entry(account, &cl)
                .await
                .map_err(unavailable)?
                .is_some()
            {
                cl = s.id(&format!("{base}~"));
            }
            let next = Entry {
                cl_ord_id: cl.clone(),
                price: order.price,
                sl: order.sl,
                tp: order.tp,
                expiry_ms: order.expiry_ms,
                replaces: Some(e.cl_ord_id.clone()),
                state: "sent".into(),
                ..e.clone()
            };
            if !s
                .ledger
                .record_entry(&s.writer, &next)
                .await
                .map_err(unavailable)?
            {
                return Err(stale_fence(&s.writer));
            }
            s.state().entries.insert(cl.clone(), EntryMark::of(&next));
            let mut body = s.entry_body(&next);
            body.push((41, e.cl_ord_id.clone()));
            let report = match s.send_order("G", &cl, &body, true).await {
                Ok(report) => report,
                Err(err) => {
                    if matches!(err, BrokerError::Unavailable(_)) {
                        s.state().entries.remove(&cl);
                    }
                    return Err(err);
                }
            };
            if report.msg_type() == "8" && matches!(report.get(39), Some("0" | "1" | "A")) {
                let ticket = e.ticket.unwrap_or(order.ticket);
                s.ledger
                    .entry_replaced(account, &e.cl_ord_id, &cl, ticket)
                    .await
                    .map_err(db_unknown)?;
                s.state().entries.remove(&e.cl_ord_id);
                return Ok(());
            }
            s.state().entries.remove(&cl);
            let text = report.get(58).unwrap_or("replace refused").to_string();
            s.ledger
                .complete_order(account, &cl, Err(&text))
                .await
                .map_err(db_unknown)?;
            Err(BrokerError::Rejected(refusal_of_cancel(&report, text)))
        })
    }

    fn cancel(&self, order: CancelOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let s = &self.0;
            let _op = s.ops.lock().await;
            let e = s.entry_of_ticket(order.ticket).await?;
            // The intent's id, made unique per request (a cancel not confirmed is sent again).
            let cl = s.id(order.client_order_id.as_deref().unwrap_or("cxl"));
            let report = s
                .cancel_request(&cl, &e.cl_ord_id, &e.symbol, &e.side, e.quantity)
                .await?;
            if report.msg_type() == "8" && report.get(39) == Some("4") {
                s.ledger
                    .set_state(
                        s.writer.account_id,
                        &e.cl_ord_id,
                        &["working", "sent"],
                        "canceled",
                    )
                    .await
                    .map_err(db_unknown)?;
                s.state().entries.remove(&e.cl_ord_id);
                return Ok(());
            }
            let text = report.get(58).unwrap_or("cancel refused").to_string();
            Err(BrokerError::Rejected(refusal_of_cancel(&report, text)))
        })
    }
}
