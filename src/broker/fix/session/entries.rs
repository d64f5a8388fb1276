//! Entry orders (pending copies): loaded from the ledger, settled with the venue, read from its
//! mass status or one by one, and shown to the copy engine as pending orders.

use super::*;

impl Shared {
    /// Loads the entry orders in force from the ledger, so that a fill of one (reported on its
    /// own) opens a position under its marker.
    pub(super) async fn load_entries(&self) -> Result<(), BrokerError> {
        let rows = self
            .ledger
            .entries(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        let mut state = self.state();
        for e in &rows {
            state.entries.insert(e.cl_ord_id.clone(), EntryMark::of(e));
        }
        Ok(())
    }

    /// Asks the venue how entry order `e` stands (OrderStatusRequest) and records it in the
    /// ledger; returns it while it is in force. A fill names its position, whose marker the
    /// ledger then holds. A working order the venue no longer knows by its ClOrdID (a venue that
    /// forgets ClOrdIDs at a trading-day roll) is taken to rest still: cancelling it is then
    /// refused as unknown, and nothing is ever copied at market for it.
    /// `listed`: the venue's list of resting orders (OrderMassStatusRequest) was read just now
    /// and does not show it.
    pub(super) async fn settle_entry(
        &self,
        e: &Entry,
        listed: bool,
    ) -> Result<Option<Entry>, BrokerError> {
        let account = self.writer.account_id;
        let report = self.order_status(&e.as_order()).await?;
        let status = report.get(39).unwrap_or("");
        let text = report.get(58).unwrap_or("").to_string();
        let unknown = report.integer(103) == Some(5) || text.contains("unknown order");
        let forget = |state: &mut State| {
            state.entries.remove(&e.cl_ord_id);
        };
        if report.number(14).unwrap_or(0.0) > 0.0 {
            let Some(position) = report.integer(721) else {
                return Err(BrokerError::Unknown(format!(
                    "entry order {}: the venue's fill names no position (PosMaintRptID)",
                    e.cl_ord_id
                )));
            };
            let price = report.number(6).unwrap_or(e.price);
            let ticket = e
                .ticket
                .unwrap_or_else(|| order_ticket(report.get(37).unwrap_or("")));
            self.record_entry_fill(e, position, ticket, price).await?;
            return Ok(None);
        }
        let ended = |how: &'static str| async move {
            self.ledger
                .set_state(account, &e.cl_ord_id, &["sent", "working"], how)
                .await
                .map_err(db_unknown)?;
            forget(&mut self.state());
            Ok::<_, BrokerError>(None)
        };
        match status {
            "0" | "1" | "A" | "E" | "6" if !unknown => {
                let ticket = e
                    .ticket
                    .unwrap_or_else(|| order_ticket(report.get(37).unwrap_or("")));
                self.in_force(e, ticket).await.map(Some)
            }
            "5" => ended("replaced").await,
            "4" => ended("canceled").await,
            "C" => ended("expired").await,
            // Placed by another, unknown by its ClOrdID and not among the resting orders: gone
            // (its fill, if any, is an unmarked position like any of the master's trades).
            _ if unknown && e.state == "working" && listed && e.comment.is_empty() => {
                info!(account_id = account, cl_ord_id = %e.cl_ord_id, "an entry order placed by another is gone from the venue");
                ended("canceled").await
            }
            _ if unknown && e.state == "working" => {
                warn!(account_id = account, cl_ord_id = %e.cl_ord_id, "the venue no longer knows a working entry order by its ClOrdID: taken to rest still");
                Ok(Some(e.clone()))
            }
            _ => {
                // Sent, its answer lost, and now unknown by its ClOrdID: resting, if the venue's
                // list of resting orders shows it.
                if unknown
                    && !listed
                    && let Some(reports) = self.venue_orders().await?
                    && let Some(l) = reports
                        .iter()
                        .filter(|r| resting_report(r))
                        .filter_map(entry_of_report)
                        .find(|l| l.cl_ord_id == e.cl_ord_id)
                {
                    let ticket = l.ticket.unwrap_or_default();
                    return self.in_force(e, ticket).await.map(Some);
                }
                // Unknown, and the venue lists no resting orders: it may rest all the same (a
                // venue that forgot its ClOrdID); it stays sent, its outcome unknown, rather than
                // ever be placed a second time.
                if unknown && e.state == "sent" && self.state().mass_unsupported {
                    if let Some((position, price)) = self.adopt(&e.as_order()).await? {
                        let ticket = e.ticket.unwrap_or(position);
                        self.record_entry_fill(e, position, ticket, price).await?;
                    } else {
                        warn!(account_id = account, cl_ord_id = %e.cl_ord_id, "an entry order sent without an answer is unknown to a venue that lists no orders: its outcome stays unknown");
                    }
                    return Ok(None);
                }
                if unknown && let Some((position, price)) = self.adopt(&e.as_order()).await? {
                    let ticket = e.ticket.unwrap_or(position);
                    self.record_entry_fill(e, position, ticket, price).await?;
                    return Ok(None);
                }
                let why = if text.is_empty() {
                    format!("rejected (OrdStatus {status})")
                } else {
                    text
                };
                self.ledger
                    .complete_order(account, &e.cl_ord_id, Err(&why))
                    .await
                    .map_err(db_unknown)?;
                forget(&mut self.state());
                Ok(None)
            }
        }
    }

    /// Entry order `e` is in force as `ticket`: recorded so (a place or replace whose answer was
    /// not seen yet is done), and known to the session.
    pub(super) async fn in_force(&self, e: &Entry, ticket: i64) -> Result<Entry, BrokerError> {
        let account = self.writer.account_id;
        if e.state == "sent" {
            match &e.replaces {
                Some(old) => {
                    self.ledger
                        .entry_replaced(account, old, &e.cl_ord_id, ticket)
                        .await
                        .map_err(db_unknown)?;
                    self.state().entries.remove(old);
                }
                None => self
                    .ledger
                    .entry_working(account, &e.cl_ord_id, ticket)
                    .await
                    .map_err(db_unknown)?,
            }
        }
        let now = Entry {
            ticket: Some(ticket),
            state: "working".into(),
            ..e.clone()
        };
        self.state()
            .entries
            .insert(e.cl_ord_id.clone(), EntryMark::of(&now));
        Ok(now)
    }

    /// Entry order `e` filled, opening `position`: recorded (the order filled, the position
    /// under the order's ticket and marker), and the session shows the position so.
    pub(super) async fn record_entry_fill(
        &self,
        e: &Entry,
        position: i64,
        ticket: i64,
        price: f64,
    ) -> Result<(), BrokerError> {
        let fill = ledger::EntryFill {
            position_id: position,
            ticket,
            symbol: &e.symbol,
            side: &e.side,
            price,
        };
        self.ledger
            .entry_filled(self.writer.account_id, &e.cl_ord_id, fill)
            .await
            .map_err(db_unknown)?;
        let mut state = self.state();
        state.entries.remove(&e.cl_ord_id);
        state.aliases.insert(position, ticket);
        state
            .entry_positions
            .insert(position, (e.magic, e.comment.clone()));
        Ok(())
    }

    /// Every resting order at the venue (OrderMassStatusRequest), as its reports; `None` when
    /// the venue does not take the request.
    pub(super) async fn venue_orders(&self) -> Result<Option<Vec<Fields>>, BrokerError> {
        if self.state().mass_unsupported {
            return Ok(None);
        }
        let req = self.id("mass");
        let (tx, rx) = oneshot::channel();
        self.state().mass_requests.insert(
            req.clone(),
            Collect {
                expected: None,
                reports: Vec::new(),
                done: Some(tx),
            },
        );
        let body = [
            (584, req.clone()),
            (585, "7".to_string()),
            (1, self.login.clone()),
        ];
        if let Err(e) = self.send("AF", &body) {
            self.state().mass_requests.remove(&req);
            return Err(e);
        }
        let answer = tokio::time::timeout(self.endpoint.request_timeout, rx).await;
        self.state().mass_requests.remove(&req);
        match answer {
            Ok(Ok(Ok((reports, _)))) => Ok(Some(reports)),
            Ok(Ok(Err(why))) if self.state().mass_unsupported => {
                info!(account_id = self.writer.account_id, reason = %why, "the venue lists no orders: pending orders are the ones this adapter placed");
                Ok(None)
            }
            Ok(Ok(Err(why))) => Err(unavailable(why)),
            Ok(Err(_)) => Err(unavailable("the FIX connection dropped")),
            Err(_) => {
                // A venue that ignores the request (no reject, no answer) is not asked again in
                // this session.
                warn!(
                    account_id = self.writer.account_id,
                    "no answer to an OrderMassStatusRequest in time: pending orders are the ones this adapter placed, for this session"
                );
                self.state().mass_unsupported = true;
                Ok(None)
            }
        }
    }

    /// The account's pending orders: every entry order resting at the venue (the ones this
    /// adapter placed carry their marker and stops from the ledger; others are recorded, without
    /// a marker, when first listed), and the ledger's entry orders the venue does not list asked
    /// one by one how they ended (filled: the position is recorded under the order's ticket).
    pub(super) async fn read_orders(&self) -> Result<Vec<PendingOrder>, BrokerError> {
        // The ledger before the venue's list: an order recorded in between is then listed, never
        // taken for gone.
        let rows = self
            .ledger
            .entries(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        let venue = self.venue_orders().await?;
        // Resting entry orders, less any whose fill this session has seen meanwhile.
        let filled: HashSet<i64> = self.state().aliases.values().copied().collect();
        let listed: HashMap<String, Entry> = venue
            .iter()
            .flatten()
            .filter(|r| resting_report(r))
            .filter_map(entry_of_report)
            .filter(|e| e.ticket.is_none_or(|t| !filled.contains(&t)))
            .map(|e| (e.cl_ord_id.clone(), e))
            .collect();
        // A listed order is a row's when the ClOrdID and (once known) the ticket agree: another
        // party may use a ClOrdID again for another order.
        let same = |e: &Entry, l: &Entry| {
            e.cl_ord_id == l.cl_ord_id && e.ticket.is_none_or(|t| Some(t) == l.ticket)
        };
        let mut out: Vec<PendingOrder> = Vec::new();
        let mut keep = |now: &Entry| {
            if let Some(p) = self.pending_of(now) {
                // A replacement in force supersedes its original (the same ticket).
                out.retain(|o| o.ticket != p.ticket);
                out.push(p);
            }
        };
        for e in &rows {
            let now = match listed.get(&e.cl_ord_id).filter(|l| same(e, l)) {
                Some(l) if venue.is_some() => {
                    Some(self.in_force(e, l.ticket.unwrap_or_default()).await?)
                }
                _ => self.settle_entry(e, venue.is_some()).await?,
            };
            if let Some(now) = &now {
                keep(now);
            }
        }
        let mut others: Vec<&Entry> = listed
            .values()
            .filter(|l| !rows.iter().any(|e| same(e, l)))
            .collect();
        others.sort_by(|a, b| a.cl_ord_id.cmp(&b.cl_ord_id));
        for l in others {
            let known = self
                .ledger
                .entry(self.writer.account_id, &l.cl_ord_id)
                .await
                .map_err(unavailable)?;
            let now = match known {
                None => {
                    self.ledger
                        .record_entry(&self.writer, l)
                        .await
                        .map_err(unavailable)?;
                    l.clone()
                }
                // Recorded since the ledger was read (its report came meanwhile): in force.
                Some(row)
                    if matches!(row.state.as_str(), "sent" | "working")
                        && row.ticket.is_none_or(|t| Some(t) == l.ticket) =>
                {
                    self.in_force(&row, l.ticket.unwrap_or_default()).await?
                }
                // Ours, taken for refused (the venue did not know it when asked): it rests.
                Some(row) if row.state == "rejected" && !row.comment.is_empty() => {
                    warn!(account_id = self.writer.account_id, cl_ord_id = %row.cl_ord_id, "an entry order taken for refused rests at the venue: in force");
                    self.ledger
                        .entry_working(
                            self.writer.account_id,
                            &row.cl_ord_id,
                            l.ticket.unwrap_or_default(),
                        )
                        .await
                        .map_err(db_unknown)?;
                    Entry {
                        ticket: l.ticket,
                        state: "working".into(),
                        ..row
                    }
                }
                // The same ClOrdID for another order (another party's ids repeat across days):
                // shown, not recorded.
                Some(row) if row.ticket != l.ticket => {
                    warn!(account_id = self.writer.account_id, cl_ord_id = %row.cl_ord_id, "a resting order reuses a ClOrdID the ledger holds for another order: not recorded");
                    l.clone()
                }
                // Ended in the ledger (filled in part, say): not a pending order.
                Some(_) => continue,
            };
            self.state()
                .entries
                .insert(now.cl_ord_id.clone(), EntryMark::of(&now));
            keep(&now);
        }
        Ok(out)
    }

    /// An entry order in force as the copy engine sees a pending order.
    pub(super) fn pending_of(&self, e: &Entry) -> Option<PendingOrder> {
        let contract = self.contract(&e.symbol)?;
        Some(PendingOrder {
            ticket: e.ticket?,
            symbol: e.symbol.clone(),
            side: side_parse(&e.side),
            kind: if e.order_type == "stop" {
                PendingKind::Stop
            } else {
                PendingKind::Limit
            },
            price: e.price,
            volume: round_lots(e.quantity / contract),
            sl: e.sl,
            tp: e.tp,
            expiry_ms: e.expiry_ms,
            magic: e.magic,
            comment: e.comment.clone(),
            placed_ms: e.sent_ms,
        })
    }

    /// The entry order in force that the copy engine knows as `ticket`.
    pub(super) async fn entry_of_ticket(&self, ticket: i64) -> Result<Entry, BrokerError> {
        let rows = self
            .ledger
            .entries(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        rows.into_iter()
            .rfind(|e| e.ticket == Some(ticket) && e.state == "working")
            .ok_or_else(|| {
                BrokerError::Rejected(Rejection::new(
                    RejectCode::UnknownTicket,
                    format!("no pending order {ticket} in force"),
                ))
            })
    }

    /// The body of a NewOrderSingle or OrderCancelReplaceRequest for entry order `e`: a limit
    /// (Price) or stop (StopPx), good till cancelled or till its ExpireTime.
    pub(super) fn entry_body(&self, e: &Entry) -> Vec<(u32, String)> {
        let mut body = vec![
            (11, e.cl_ord_id.clone()),
            (55, e.symbol.clone()),
            (54, side_code(side_parse(&e.side)).to_string()),
            (38, decimal(e.quantity)),
            (60, utc_timestamp(crate::wall_clock::unix_ms())),
        ];
        if e.order_type == "stop" {
            body.push((40, "3".into()));
            body.push((99, decimal(e.price)));
        } else {
            body.push((40, "2".into()));
            body.push((44, decimal(e.price)));
        }
        match e.expiry_ms {
            Some(at) => {
                body.push((59, "6".into()));
                body.push((126, utc_timestamp(at)));
            }
            None => body.push((59, "1".into())),
        }
        body
    }
}

/// The refusal of a cancel or cancel/replace (OrderCancelReject, or a rejecting report): an
/// order the venue no longer has in force (filled, gone, unknown) is an unknown ticket.
pub(super) fn refusal_of_cancel(report: &Fields, text: String) -> Rejection {
    let lower = text.to_ascii_lowercase();
    let gone = report.msg_type() == "9"
        && (matches!(report.get(102), Some("0" | "1"))
            || matches!(report.get(39), Some("2" | "4" | "C" | "8")));
    if gone
        || lower.contains("unknown order")
        || lower.contains("no such")
        || lower.contains("too late")
    {
        Rejection::new(RejectCode::UnknownTicket, text)
    } else {
        Rejection::new(reject_code(report.integer(103), &text), text)
    }
}
