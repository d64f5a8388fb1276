//! Positions: the SecurityList, RequestForPositions (with or without its acknowledgement), the
//! cache read and marked from the ledger, and what was seen recorded there (the account's history).

use super::*;

impl Shared {
    /// A PositionReport as a position (volume 0: the position is gone).
    pub(super) fn position_of_report(&self, m: &Fields) -> Option<Position> {
        let ticket = m.integer(721)?;
        let symbol = m.get(55)?;
        let contract = self.contract(symbol)?;
        let long = m.number(704).unwrap_or(0.0);
        let short = m.number(705).unwrap_or(0.0);
        let (side, units) = if long >= short {
            (Side::Buy, long - short)
        } else {
            (Side::Sell, short - long)
        };
        Some(Position {
            ticket,
            symbol: symbol.to_string(),
            side,
            volume: round_lots(units / contract),
            open_price: m.number(730).unwrap_or(0.0),
            sl: None,
            tp: None,
            magic: 0,
            comment: String::new(),
            open_time_ms: crate::wall_clock::unix_ms(),
        })
    }

    /// A subscribed PositionReport: the position as it is now (or gone).
    pub(super) fn apply_report(&self, now: Position) {
        let mut state = self.state();
        state.changes += 1;
        let before = state.positions.get(&now.ticket).cloned();
        match before {
            None if now.volume > 0.0 => {
                state.positions.insert(now.ticket, now.clone());
                drop(state);
                self.emit(PositionChange::Opened { position: now });
            }
            Some(p) if now.volume + 1e-9 < p.volume => {
                let closed_volume = round_lots(p.volume - now.volume);
                let closed = ClosedPosition {
                    position: Position {
                        volume: closed_volume,
                        ..p.clone()
                    },
                    close_price: p.open_price,
                    close_time_ms: crate::wall_clock::unix_ms(),
                    closed_by: ClosedBy::Manual,
                    remaining_volume: now.volume,
                    profit: 0.0,
                };
                if now.volume <= 0.0 {
                    state.positions.remove(&now.ticket);
                    drop(state);
                    self.emit(PositionChange::Closed { closed });
                } else {
                    let mut left = p.clone();
                    left.volume = now.volume;
                    state.positions.insert(now.ticket, left.clone());
                    drop(state);
                    self.emit(PositionChange::PartiallyClosed {
                        position: left,
                        closed,
                    });
                }
            }
            _ => {}
        }
    }

    pub(super) async fn load_symbols(&self) -> Result<(), BrokerError> {
        let req = self.id("sec");
        let (tx, rx) = oneshot::channel();
        self.state().security_requests.insert(req.clone(), tx);
        self.send("x", &[(320, req.clone()), (559, "4".into())])?;
        let list = tokio::time::timeout(self.endpoint.request_timeout, rx)
            .await
            .map_err(|_| unavailable("no SecurityList in time"))?
            .map_err(|_| unavailable("the FIX connection dropped"))?;
        let mut symbols = HashMap::new();
        for member in list.group(55) {
            let (Some(symbol), Some(contract)) = (member.get(55), member.number(231)) else {
                continue;
            };
            if contract <= 0.0 {
                continue;
            }
            let lot = member.number(561).map_or(0.01, |u| u / contract);
            let min = member.number(562).map_or(lot, |u| u / contract);
            symbols.insert(
                symbol.to_string(),
                SymbolSpec {
                    symbol: symbol.to_string(),
                    price: 0.0,
                    volume_step: lot,
                    volume_min: min,
                    volume_max: member.number(1140).map_or(1.0e6, |u| u / contract),
                    contract_size: contract,
                    // MinPriceIncrement (969) and Currency (15), when the venue sends them.
                    point: member.number(969).unwrap_or(0.0),
                    profit_currency: member.get(15).and_then(|c| c.parse().ok()),
                },
            );
        }
        debug!(symbols = symbols.len(), "FIX SecurityList read");
        self.state().symbols = symbols;
        Ok(())
    }

    pub(super) fn subscription_request(&self) -> Vec<(u32, String)> {
        let req = self.id("sub");
        self.state().subscription = Some(req.clone());
        self.positions_request(req, true)
    }

    pub(super) fn positions_request(&self, req: String, subscribe: bool) -> Vec<(u32, String)> {
        let mut body = vec![
            (710, req),
            (724, "0".to_string()),
            (1, self.login.clone()),
            (581, "1".to_string()),
            (
                715,
                utc_timestamp(crate::wall_clock::unix_ms())[..8].to_string(),
            ),
            (60, utc_timestamp(crate::wall_clock::unix_ms())),
        ];
        if subscribe {
            body.push((263, "1".to_string()));
        }
        body
    }

    pub(super) async fn subscribe(&self) -> Result<(), BrokerError> {
        let body = self.subscription_request();
        self.send("AN", &body)
    }

    /// RequestForPositions: every open position of the account, as the venue reports them.
    pub(super) async fn request_positions(&self) -> Result<(Vec<Position>, u64), BrokerError> {
        let req = self.id("pos");
        let (tx, rx) = oneshot::channel();
        self.state().positions_requests.insert(
            req.clone(),
            Collect {
                expected: None,
                reports: Vec::new(),
                done: Some(tx),
            },
        );
        let body = self.positions_request(req.clone(), false);
        if let Err(e) = self.send("AN", &body) {
            self.state().positions_requests.remove(&req);
            return Err(e);
        }
        let reports = tokio::time::timeout(self.endpoint.request_timeout, rx).await;
        let left = self.state().positions_requests.remove(&req);
        let (reports, changes) = reports
            .map_err(|_| {
                unavailable(positions_timeout(
                    left.as_ref(),
                    self.endpoint.request_timeout,
                ))
            })?
            .map_err(|_| unavailable("the FIX connection dropped"))?
            .map_err(unavailable)?;
        // Every report must map to a position: one that does not (a symbol the SecurityList
        // lacked, no PosMaintRptID) fails the read, after one reload of the SecurityList; a read
        // that silently dropped a position would make it look closed.
        let mut positions = Vec::with_capacity(reports.len());
        let mut reloaded = false;
        for r in &reports {
            let mut mapped = self.position_of_report(r);
            if mapped.is_none() && !reloaded && r.integer(721).is_some() {
                reloaded = true;
                self.load_symbols().await?;
                mapped = self.position_of_report(r);
            }
            match mapped {
                Some(p) if p.volume > 0.0 => positions.push(p),
                Some(_) => {}
                None => {
                    return Err(unavailable(format!(
                        "a PositionReport the adapter cannot read (position {:?}, symbol {:?}: \
                         not in the venue's SecurityList, or no PosMaintRptID)",
                        r.get(721),
                        r.get(55)
                    )));
                }
            }
        }
        Ok((positions, changes))
    }

    /// Resolves orders without an outcome, reads the positions, marks them from the ledger,
    /// records what opened and closed, and refreshes the cache (announcing differences).
    pub(super) async fn read_positions(&self) -> Result<Vec<Position>, BrokerError> {
        self.resolve_unresolved().await?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (mut positions, changes) = self.request_positions().await?;
            // A position not seen before while entry orders rest may be the fill of one whose
            // report never came (a dropped connection, a fill while no node held the account):
            // their ends are asked first, so that it shows under its order's ticket. Should
            // that fail, such positions stay out of this read (a copy later, never a wrong
            // trade); every other position, and every close, is read as usual.
            let unseen: HashSet<i64> = {
                let state = self.state();
                if state.entries.is_empty() {
                    HashSet::new()
                } else {
                    positions
                        .iter()
                        .map(|p| p.ticket)
                        .filter(|t| {
                            !state.positions.contains_key(t) && !state.aliases.contains_key(t)
                        })
                        .collect()
                }
            };
            if !unseen.is_empty()
                && let Err(e) = self.read_orders().await
            {
                warn!(account_id = self.writer.account_id, positions = ?unseen, error = %e, "reading the entry orders failed: positions never seen are left out of this read until it succeeds");
                positions.retain(|p| !unseen.contains(&p.ticket));
            }
            let positions = self.mark(positions).await?;
            // A fill applied after the venue answered makes the answer older than the cache:
            // ask again rather than let it undo the fill (a stale read would announce a close).
            if self.state().changes != changes {
                if attempt < 5 {
                    continue;
                }
                return Ok(positions);
            }
            self.record_seen(&positions).await?;
            let mut state = self.state();
            if state.changes == changes {
                let before = std::mem::take(&mut state.positions);
                state.positions = positions.iter().map(|p| (p.ticket, p.clone())).collect();
                drop(state);
                self.announce(&before, &positions);
            }
            return Ok(positions);
        }
    }

    /// Copy markers and first sightings from the ledger.
    pub(super) async fn mark(
        &self,
        mut positions: Vec<Position>,
    ) -> Result<Vec<Position>, BrokerError> {
        let known = self
            .ledger
            .positions(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        let by_id: HashMap<i64, &FixPosition> = known.iter().map(|k| (k.position_id, k)).collect();
        let working = self
            .ledger
            .working(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        {
            let mut state = self.state();
            for k in &known {
                if let Some(t) = k.ticket {
                    state.aliases.insert(k.position_id, t);
                }
            }
        }
        let fills = self.state().entry_positions.clone();
        for p in &mut positions {
            if let Some(k) = by_id.get(&p.ticket) {
                p.magic = k.magic;
                p.comment = k.comment.clone();
                p.open_time_ms = k.opened_ms;
            }
            if p.magic == 0
                && p.comment.is_empty()
                && let Some((magic, comment)) = fills.get(&p.ticket)
            {
                p.magic = *magic;
                p.comment = comment.clone();
            }
            for w in working.iter().filter(|w| w.position_id == p.ticket) {
                match w.kind.as_str() {
                    "sl" => p.sl = Some(w.price),
                    "tp" => p.tp = Some(w.price),
                    _ => {}
                }
            }
        }
        let mut state = self.state();
        for w in &working {
            let by = if w.kind == "sl" {
                ClosedBy::Sl
            } else {
                ClosedBy::Tp
            };
            state.resting.insert(w.cl_ord_id.clone(), by);
        }
        Ok(positions)
    }

    /// Records a current read in the ledger: positions seen open, and ledger positions gone.
    pub(super) async fn record_seen(&self, positions: &[Position]) -> Result<(), BrokerError> {
        let known = self
            .ledger
            .positions(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        let by_id: HashMap<i64, &FixPosition> = known.iter().map(|k| (k.position_id, k)).collect();
        let open: HashSet<i64> = positions.iter().map(|p| p.ticket).collect();
        for p in positions {
            let stale = by_id
                .get(&p.ticket)
                .is_none_or(|k| (k.volume - p.volume).abs() > 1e-9);
            if stale {
                let row = FixPosition {
                    position_id: p.ticket,
                    symbol: p.symbol.clone(),
                    side: side_text(p.side).into(),
                    volume: p.volume,
                    open_price: p.open_price,
                    magic: p.magic,
                    comment: p.comment.clone(),
                    opened_ms: p.open_time_ms,
                    closed_ms: None,
                    close_price: None,
                    ticket: None,
                    opened_volume: None,
                };
                self.ledger
                    .seen_open(self.writer.account_id, &row)
                    .await
                    .map_err(unavailable)?;
            }
        }
        for k in &known {
            if k.closed_ms.is_none() && !open.contains(&k.position_id) {
                self.ledger
                    .seen_closed(self.writer.account_id, k.position_id, None)
                    .await
                    .map_err(unavailable)?;
            }
        }
        // A resting order whose position is gone is gone with it (venues cancel them).
        let working = self
            .ledger
            .working(self.writer.account_id)
            .await
            .map_err(unavailable)?;
        for w in working.iter().filter(|w| !open.contains(&w.position_id)) {
            self.ledger
                .set_state(
                    self.writer.account_id,
                    &w.cl_ord_id,
                    &["working"],
                    "canceled",
                )
                .await
                .map_err(unavailable)?;
        }
        Ok(())
    }

    /// Announces what changed between the cache and a read.
    pub(super) fn announce(&self, before: &BTreeMap<i64, Position>, positions: &[Position]) {
        for p in positions {
            match before.get(&p.ticket) {
                None => self.emit(PositionChange::Opened {
                    position: p.clone(),
                }),
                Some(b) if p.volume + 1e-9 < b.volume => {
                    self.emit(PositionChange::PartiallyClosed {
                        position: p.clone(),
                        closed: closed_of(b, b.volume - p.volume, p.volume),
                    })
                }
                _ => {}
            }
        }
        let open: HashSet<i64> = positions.iter().map(|p| p.ticket).collect();
        for (ticket, b) in before {
            if !open.contains(ticket) {
                self.emit(PositionChange::Closed {
                    closed: closed_of(b, b.volume, 0.0),
                });
            }
        }
    }

    /// A position from the cache, or (not there) from a fresh read.
    pub(super) async fn position(&self, ticket: i64) -> Result<Option<Position>, BrokerError> {
        if let Some(p) = self.state().positions.get(&ticket).cloned() {
            return Ok(Some(p));
        }
        let positions = self.read_positions().await?;
        Ok(positions.into_iter().find(|p| p.ticket == ticket))
    }
}

/// Why a RequestForPositions had no complete answer in time, as the venue behaved: the count
/// comes from RequestForPositionsAck (AO) or from TotNumReports (727) on the reports.
pub(super) fn positions_timeout(c: Option<&Collect>, within: Duration) -> String {
    match c {
        Some(Collect {
            expected: Some(n),
            reports,
            ..
        }) => format!(
            "{} of {n} PositionReports within {within:?} of RequestForPositions",
            reports.len()
        ),
        Some(Collect { reports, .. }) if !reports.is_empty() => format!(
            "{} PositionReports without a count within {within:?} of RequestForPositions: the \
             venue sent no RequestForPositionsAck (AO) and no TotNumReports (727)",
            reports.len()
        ),
        _ => format!(
            "no answer to RequestForPositions within {within:?}: neither a \
             RequestForPositionsAck (AO) nor a PositionReport (AP)"
        ),
    }
}

/// A ledger position as history: closed, or (still open) the lots closed of it since it opened
/// (`opened_volume - volume`, one entry for every partial close so far: the copy engine scales a
/// trim against a copy's opening volume, which it reads as current plus closed). An open
/// position nothing was closed of is not history.
pub(super) fn history_entry(r: FixPosition) -> Option<ClosedPosition> {
    let (volume, remaining, close_time_ms) = match r.closed_ms {
        Some(closed_ms) => (r.volume, 0.0, closed_ms),
        None => {
            let closed = round_lots(r.opened_volume? - r.volume);
            if closed <= 0.0 {
                return None;
            }
            (closed, r.volume, r.opened_ms)
        }
    };
    Some(ClosedPosition {
        position: Position {
            ticket: r.ticket.unwrap_or(r.position_id),
            symbol: r.symbol,
            side: side_parse(&r.side),
            volume,
            open_price: r.open_price,
            sl: None,
            tp: None,
            magic: r.magic,
            comment: r.comment,
            open_time_ms: r.opened_ms,
        },
        close_price: r.close_price.unwrap_or(r.open_price),
        close_time_ms,
        closed_by: ClosedBy::Client,
        remaining_volume: remaining,
        profit: 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(volume: f64, opened_volume: Option<f64>, closed_ms: Option<i64>) -> FixPosition {
        FixPosition {
            position_id: 9,
            symbol: "EURUSD".into(),
            side: "buy".into(),
            volume,
            open_price: 1.1,
            magic: 7,
            comment: "mc3".into(),
            opened_ms: 1_000,
            closed_ms,
            close_price: closed_ms.map(|_| 1.2),
            ticket: None,
            opened_volume,
        }
    }

    /// The adapter's history of an open position is what was closed of it since it opened
    /// (opening lots less current lots), with the rest still open; a position nothing was closed
    /// of, or whose opening lots are not recorded yet, is no history; a closed one is its last
    /// lots, closed.
    #[test]
    fn an_open_positions_history_is_what_was_closed_of_its_opening_lots() {
        let trimmed = history_entry(row(0.6, Some(1.0), None)).expect("a partial close");
        assert_eq!(
            (trimmed.position.volume, trimmed.remaining_volume),
            (0.4, 0.6)
        );
        assert!(history_entry(row(1.0, Some(1.0), None)).is_none());
        assert!(history_entry(row(0.6, None, None)).is_none());
        let closed = history_entry(row(0.6, Some(1.0), Some(2_000))).expect("a close");
        assert_eq!(
            (
                closed.position.volume,
                closed.remaining_volume,
                closed.close_time_ms
            ),
            (0.6, 0.0, 2_000)
        );
    }
}
