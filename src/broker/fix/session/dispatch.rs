//! What the engine receives: session events, and application messages (ExecutionReports,
//! position answers and reports, rejects, security lists) applied to the cache or handed to
//! whoever awaits them.

use super::*;

impl Shared {
    /// Everything the engine reports, in order.
    pub(super) fn on_engine(self: &Arc<Self>, event: EngineEvent, ever_online: &mut bool) {
        match event {
            EngineEvent::LoggedOn => {
                let again = *ever_online;
                *ever_online = true;
                self.link.send_replace(Link::Online);
                if again {
                    info!(
                        account_id = self.writer.account_id,
                        "FIX session logged on again"
                    );
                    let _ = self.events.send(SessionEvent::Reconnected);
                    if self.endpoint.updates == Updates::Subscribe {
                        let body = self.subscription_request();
                        if let Err(e) = self.send("AN", &body) {
                            warn!(error = %e, "re-subscribing to FIX positions failed");
                        }
                    }
                }
            }
            EngineEvent::LoggedOut => {
                if *self.link.borrow() == Link::Online {
                    self.link.send_replace(Link::Offline);
                }
                // Whatever was awaited will not come on this connection: outcomes unknown.
                let mut state = self.state();
                state.orders.clear();
                state.statuses.clear();
                state.acks.clear();
                state.security_requests.clear();
                state.security_parts.clear();
                let mut dropped: Vec<(String, Collect)> =
                    state.positions_requests.drain().collect();
                dropped.extend(state.mass_requests.drain());
                for (_, mut c) in dropped {
                    if let Some(done) = c.done.take() {
                        let _ = done.send(Err("the FIX connection dropped".into()));
                    }
                }
            }
            EngineEvent::LogoutText(text) => {
                if *self.link.borrow() != Link::Online {
                    warn!(account_id = self.writer.account_id, reason = %text, "the venue refused the FIX logon");
                    if *ever_online {
                        let _ = self.events.send(SessionEvent::LoginLost(format!(
                            "the venue refused the logon: {text}"
                        )));
                    }
                    self.link.send_replace(Link::Refused(text));
                } else {
                    info!(account_id = self.writer.account_id, reason = %text, "the venue logged the FIX session out");
                }
            }
            EngineEvent::Failed(e) => {
                warn!(account_id = self.writer.account_id, error = %e, "the FIX engine failed");
                self.link.send_replace(Link::Refused(e));
            }
            EngineEvent::App(fields) => self.on_app(fields),
        }
    }

    pub(super) fn on_app(self: &Arc<Self>, m: Fields) {
        match m.msg_type() {
            "8" => self.on_execution(m),
            "AO" => {
                let req = m.get(710).unwrap_or("").to_string();
                let total = m.integer(727).unwrap_or(0).max(0) as usize;
                let result = m.integer(728).unwrap_or(0);
                let mut state = self.state();
                let changes = state.changes;
                // PosReqResult 2: no positions found, an empty answer.
                let (result, total) = if result == 2 { (0, 0) } else { (result, total) };
                if let Some(c) = state.positions_requests.get_mut(&req) {
                    if result != 0 {
                        let why = m.get(58).unwrap_or("request refused").to_string();
                        if let Some(done) = c.done.take() {
                            let _ = done.send(Err(format!(
                                "RequestForPositions refused ({result}): {why}"
                            )));
                        }
                        state.positions_requests.remove(&req);
                    } else {
                        c.expected = Some(total);
                        if c.reports.len() >= total
                            && let Some(mut c) = state.positions_requests.remove(&req)
                            && let Some(done) = c.done.take()
                        {
                            let _ = done.send(Ok((c.reports, changes)));
                        }
                    }
                }
            }
            "AP" => {
                let req = m.get(710).unwrap_or("").to_string();
                let mut state = self.state();
                let changes = state.changes;
                if let Some(c) = state.positions_requests.get_mut(&req) {
                    // Venues that send no RequestForPositionsAck count the reports on each
                    // (TotNumReports 727), and answer "none" with one report of PosReqResult
                    // 728 = 2 that holds no position.
                    match m.integer(728).unwrap_or(0) {
                        0 => {
                            if c.expected.is_none() {
                                c.expected = m.integer(727).map(|n| n.max(0) as usize);
                            }
                            c.reports.push(m);
                        }
                        2 => c.expected = Some(c.reports.len()),
                        result => {
                            let why = m.get(58).unwrap_or("request refused").to_string();
                            if let Some(done) = c.done.take() {
                                let _ = done.send(Err(format!(
                                    "RequestForPositions refused ({result}): {why}"
                                )));
                            }
                            state.positions_requests.remove(&req);
                            return;
                        }
                    }
                    if c.expected.is_some_and(|n| c.reports.len() >= n)
                        && let Some(mut c) = state.positions_requests.remove(&req)
                        && let Some(done) = c.done.take()
                    {
                        let _ = done.send(Ok((c.reports, changes)));
                    }
                    return;
                }
                if state.subscription.as_deref() == Some(req.as_str()) {
                    drop(state);
                    if let Some(p) = self.position_of_report(&m) {
                        // A position never seen while entry orders rest may be one's fill, whose
                        // report may come later or never: read with the orders first, so that it
                        // shows under the order's ticket.
                        let unseen = {
                            let state = self.state();
                            p.volume > 0.0
                                && !state.entries.is_empty()
                                && !state.positions.contains_key(&p.ticket)
                                && !state.aliases.contains_key(&p.ticket)
                        };
                        if unseen {
                            self.refresh();
                        } else {
                            self.apply_report(p);
                        }
                    }
                }
            }
            "9" => {
                // OrderCancelReject: to whoever cancels (by the cancel's ClOrdID).
                let cl = m.get(11).unwrap_or("").to_string();
                let mut state = self.state();
                state.acks.remove(&cl);
                if let Some(done) = state.orders.remove(&cl) {
                    drop(state);
                    let _ = done.send(m);
                }
            }
            "j" if m.get(372) == Some("AF") => {
                let why = m.get(58).unwrap_or("").to_string();
                let mut state = self.state();
                state.mass_unsupported = true;
                for (_, mut c) in state.mass_requests.drain() {
                    if let Some(done) = c.done.take() {
                        let _ = done.send(Err(format!(
                            "the venue does not take OrderMassStatusRequest: {why}"
                        )));
                    }
                }
            }
            "y" => {
                let req = m.get(320).unwrap_or("").to_string();
                let mut state = self.state();
                let mut parts = state.security_parts.remove(&req).unwrap_or_default();
                parts.extend(m.0.iter().cloned());
                if m.get(893) == Some("N") {
                    state.security_parts.insert(req, parts);
                } else if let Some(done) = state.security_requests.remove(&req) {
                    let _ = done.send(Fields(parts));
                }
            }
            other => debug!(msg_type = other, "FIX message not used"),
        }
    }

    pub(super) fn on_execution(self: &Arc<Self>, m: Fields) {
        let cl = m.get(11).unwrap_or("").to_string();
        let exec_type = m.get(150).unwrap_or("");
        let status = m.get(39).unwrap_or("");
        if exec_type == "I" {
            // An OrderMassStatusRequest's report (MassStatusReqID), or an OrderStatusRequest's
            // answer: they change nothing at the venue.
            let mut state = self.state();
            if let Some(req) = m.get(584) {
                let req = req.to_string();
                if let Some(c) = state.mass_requests.get_mut(&req) {
                    // TotNumReports (911) may be absent: LastRptRequested (912) ends the list.
                    let total = m.integer(911).map(|t| t.max(0) as usize);
                    let last = m.get(912) == Some("Y");
                    c.expected = total.or(c.expected);
                    if total != Some(0) && m.get(11).is_some_and(|c| c != "NONE") {
                        c.reports.push(m);
                    }
                    if (last || c.expected.is_some_and(|n| c.reports.len() >= n))
                        && let Some(mut c) = state.mass_requests.remove(&req)
                        && let Some(done) = c.done.take()
                    {
                        let _ = done.send(Ok((c.reports, 0)));
                    }
                }
                return;
            }
            if let Some(done) = state.statuses.remove(&cl) {
                drop(state);
                let _ = done.send(m);
            }
            return;
        }
        let is_fill = matches!(exec_type, "F" | "1" | "2") && m.number(32).unwrap_or(0.0) > 0.0;
        if is_fill {
            let exec_id = m.get(17).unwrap_or("").to_string();
            let fresh = exec_id.is_empty() || self.state().exec_ids.insert(exec_id);
            if fresh {
                self.apply_fill(&m);
            }
        }
        // Final states (and status answers, and a resting order's New) go to whoever waits for
        // the ClOrdID; a resting order's unsolicited end (filled, or cancelled by the venue
        // because its position is gone) goes to the ledger.
        let mut state = self.state();
        let awaited =
            matches!(status, "2" | "4" | "8" | "C") || (status == "0" && state.acks.contains(&cl));
        if awaited && let Some(done) = state.orders.remove(&cl) {
            state.acks.remove(&cl);
            drop(state);
            let _ = done.send(m);
        } else if matches!(status, "2" | "4") && state.resting.contains_key(&cl) {
            state.resting.remove(&cl);
            drop(state);
            let (pool, account) = (self.ledger.clone(), self.writer.account_id);
            let end = if status == "2" { "filled" } else { "canceled" };
            tokio::spawn(async move {
                let _ = pool
                    .set_state(account, &cl, &["working", "sent"], end)
                    .await;
            });
        } else if matches!(exec_type, "0" | "5")
            && status == "0"
            && let Some(e) = entry_of_report(&m)
            && state
                .entries
                .get(&cl)
                .is_none_or(|k| k.ticket.is_some_and(|t| Some(t) != e.ticket))
        {
            // An entry order another placed (or replaced), as the venue reports it: recorded,
            // then announced.
            let orig = m.get(41).filter(|_| exec_type == "5").map(str::to_string);
            if let Some(o) = &orig {
                state.entries.remove(o);
            }
            state.entries.insert(cl.clone(), EntryMark::of(&e));
            drop(state);
            let change = self.pending_of(&e).map(|order| {
                if orig.is_some() {
                    PositionChange::OrderChanged { order }
                } else {
                    PositionChange::OrderPlaced { order }
                }
            });
            self.record_foreign(e, change);
        } else if matches!(status, "4" | "C") {
            // An entry order the venue ended (expired, or cancelled other than by our waiting
            // cancel): announced, and recorded.
            let orig = m.get(41).unwrap_or("");
            let entry = [cl.as_str(), orig]
                .into_iter()
                .find(|c| state.entries.contains_key(*c))
                .map(str::to_string);
            if let Some(entry) = entry {
                let mark = state.entries.remove(&entry);
                drop(state);
                let ticket = mark
                    .and_then(|k| k.ticket)
                    .unwrap_or_else(|| order_ticket(m.get(37).unwrap_or("")));
                let (end, how) = if status == "C" {
                    (OrderEnd::Expired, "expired")
                } else {
                    (OrderEnd::Cancelled, "canceled")
                };
                info!(account_id = self.writer.account_id, cl_ord_id = %entry, ticket, how, "a FIX entry order ended at the venue");
                self.emit(PositionChange::OrderGone { ticket, end });
                let (pool, account) = (self.ledger.clone(), self.writer.account_id);
                tokio::spawn(async move {
                    let _ = pool
                        .set_state(account, &entry, &["working", "sent"], how)
                        .await;
                });
            }
        }
    }

    /// Applies a fill (ours, or another session's by drop copy) to the cached positions.
    pub(super) fn apply_fill(&self, m: &Fields) {
        let (Some(position_id), Some(side), Some(symbol)) =
            (m.integer(721), side_of(m.get(54)), m.get(55))
        else {
            return;
        };
        let Some(contract) = self.contract(symbol) else {
            warn!(
                symbol,
                "a fill on a symbol the SecurityList lacks is not tracked"
            );
            return;
        };
        let lots = m.number(32).unwrap_or(0.0) / contract;
        let price = m.number(31).or_else(|| m.number(6)).unwrap_or(0.0);
        let mut state = self.state();
        let by = match m.get(11) {
            Some(c) if c.starts_with("manual") => ClosedBy::Manual,
            Some(c) => state.resting.get(c).copied().unwrap_or(ClosedBy::Client),
            None => ClosedBy::Client,
        };
        state.changes += 1;
        let known = state.positions.get(&position_id).cloned();
        match known {
            Some(mut p) if p.side != side => {
                let closed_volume = lots.min(p.volume);
                let remaining = round_lots(p.volume - closed_volume);
                let closed = ClosedPosition {
                    position: Position {
                        volume: closed_volume,
                        ..p.clone()
                    },
                    close_price: price,
                    close_time_ms: crate::wall_clock::unix_ms(),
                    closed_by: by,
                    remaining_volume: remaining,
                    profit: (price - p.open_price) * p.side.sign() * closed_volume * contract,
                };
                if remaining <= 0.0 {
                    state.positions.remove(&position_id);
                    drop(state);
                    self.emit(PositionChange::Closed { closed });
                    let pool = self.ledger.clone();
                    let account = self.writer.account_id;
                    tokio::spawn(async move {
                        let _ = pool.seen_closed(account, position_id, Some(price)).await;
                    });
                } else {
                    p.volume = remaining;
                    state.positions.insert(position_id, p.clone());
                    drop(state);
                    self.emit(PositionChange::PartiallyClosed {
                        position: p,
                        closed,
                    });
                }
            }
            Some(_) => {
                warn!(
                    position_id,
                    "a fill adding to an open FIX position is not supported; reconcile reads it"
                );
            }
            None => {
                // An entry order's fill opens a position under the entry's marker; its order is
                // announced gone (filled) before the position opens.
                let cl = m.get(11).unwrap_or("").to_string();
                let entry = state.entries.get(&cl).cloned();
                if entry.is_some() && m.get(39) == Some("2") {
                    state.entries.remove(&cl);
                }
                let (magic, comment) = entry
                    .as_ref()
                    .map(|e| (e.magic, e.comment.clone()))
                    .unwrap_or_default();
                let p = Position {
                    ticket: position_id,
                    symbol: symbol.to_string(),
                    side,
                    volume: round_lots(lots),
                    open_price: price,
                    sl: None,
                    tp: None,
                    magic,
                    comment: comment.clone(),
                    open_time_ms: crate::wall_clock::unix_ms(),
                };
                state.positions.insert(position_id, p.clone());
                if entry.is_some() && m.get(39) == Some("1") {
                    warn!(account_id = self.writer.account_id, cl_ord_id = %cl, position_id, "an entry order filled in part: the rest is not followed (its fill, if any, is another position)");
                }
                // One position per order ticket: a second position from the same order (the
                // rest of a partial fill) shows as itself.
                let ticket = entry
                    .as_ref()
                    .map(|e| {
                        e.ticket
                            .unwrap_or_else(|| order_ticket(m.get(37).unwrap_or("")))
                    })
                    .filter(|t| !state.aliases.values().any(|a| a == t));
                if let Some(ticket) = ticket {
                    state.entry_positions.insert(position_id, (magic, comment));
                    state.aliases.insert(position_id, ticket);
                }
                drop(state);
                if let Some(ticket) = ticket {
                    // The position is the order's ticket from now on (as at MT4/MT5 servers).
                    info!(account_id = self.writer.account_id, cl_ord_id = %cl, ticket, position_id, price, "a FIX entry order filled");
                    self.emit(PositionChange::OrderGone {
                        ticket,
                        end: OrderEnd::Filled { position: ticket },
                    });
                    let (pool, account) = (self.ledger.clone(), self.writer.account_id);
                    let (symbol, side) = (symbol.to_string(), side_text(side));
                    tokio::spawn(async move {
                        let fill = ledger::EntryFill {
                            position_id,
                            ticket,
                            symbol: &symbol,
                            side,
                            price,
                        };
                        if let Err(e) = pool.entry_filled(account, &cl, fill).await {
                            warn!(account_id = account, cl_ord_id = %cl, error = %e, "recording a FIX entry order's fill failed; the next read of the orders records it");
                        }
                    });
                }
                self.emit(PositionChange::Opened { position: p });
            }
        }
    }
}

/// A mass status line of an order still resting (New, partly filled, pending a change).
pub(super) fn resting_report(m: &Fields) -> bool {
    m.get(39)
        .is_none_or(|s| matches!(s, "0" | "1" | "A" | "E" | "6"))
}

/// `change` with its positions under the tickets the copy engine knows them by (`aliases`: an
/// entry order's fill shows under the order's ticket).
pub(super) fn shown_change(aliases: &HashMap<i64, i64>, change: PositionChange) -> PositionChange {
    let shown = |mut p: Position| {
        if let Some(t) = aliases.get(&p.ticket) {
            p.ticket = *t;
        }
        p
    };
    let shown_closed = |mut c: ClosedPosition| {
        c.position = shown(c.position);
        c
    };
    match change {
        PositionChange::Opened { position } => PositionChange::Opened {
            position: shown(position),
        },
        PositionChange::Modified { position } => PositionChange::Modified {
            position: shown(position),
        },
        PositionChange::PartiallyClosed { position, closed } => PositionChange::PartiallyClosed {
            position: shown(position),
            closed: shown_closed(closed),
        },
        PositionChange::Closed { closed } => PositionChange::Closed {
            closed: shown_closed(closed),
        },
        order => order,
    }
}

/// An entry order (a limit or stop that opens a position: no PosMaintRptID) as a report of the
/// venue shows it (New, Replaced, or a mass status line), recorded in force without a marker.
pub(super) fn entry_of_report(m: &Fields) -> Option<Entry> {
    let order_type = match m.get(40)? {
        "2" => "limit",
        "3" => "stop",
        _ => return None,
    };
    if m.get(721).is_some() {
        return None;
    }
    let side = side_of(m.get(54))?;
    let price = if order_type == "stop" {
        m.number(99)?
    } else {
        m.number(44)?
    };
    let expiry_ms = match m.get(59) {
        Some("6") => m.get(126).and_then(parse_utc_timestamp),
        _ => None,
    };
    Some(Entry {
        cl_ord_id: m.get(11).filter(|c| !c.is_empty())?.to_string(),
        symbol: m.get(55)?.to_string(),
        side: side_text(side).into(),
        quantity: m.number(38)?,
        order_type: order_type.into(),
        price,
        sl: None,
        tp: None,
        expiry_ms,
        magic: 0,
        comment: String::new(),
        ticket: Some(order_ticket(m.get(37)?)),
        replaces: None,
        state: "working".into(),
        sent_ms: crate::wall_clock::unix_ms(),
    })
}
