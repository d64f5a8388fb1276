//! A follower's session: copy its masters' events onto the follower's broker account, one at a
//! time, and reconcile whenever continuity is in doubt.
//!
//! Order of business (SPEC section 2): log in with the epoch as the fence (the server learns
//! the new owner's fence before anything else), LISTEN to every master of the follower's links
//! (confirmed), then reconcile each master against its snapshot, remembering the snapshot's
//! (epoch, seq). An event at exactly seq + 1 of that epoch is applied; one at or below it (or of
//! an older epoch) is dropped; anything else (a gap, a new epoch, a snapshot event) reconciles.
//! So do a LISTEN reconnect, a broker reconnect, trust that lapsed and came back, an order whose
//! outcome is unknown, a failed close, and a timer every few minutes.
//!
//! Every order is preceded by the gate check for this (account, epoch); a refused order is
//! logged and not queued: the reconcile after the gate reopens does what is still owed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::MasterPosition;
use super::events::{MasterEvent, MasterNotice};
use super::reconcile::{Action, Memory, plan};
use super::rules::{Inputs, Link, LotMode, follower_stops, open_order, round_to_step};
use super::{client_order_id, parse_marker, spread_interval};
use crate::account::AccountContext;
use crate::broker::types::{
    CloseOrder, ClosedPosition, ModifyOrder, Position, PositionChange, SymbolSpec,
};
use crate::broker::{BrokerError, SessionEvent, TradeApi};
use crate::db;
use crate::db::copy::AccountRow;
use crate::hub::{Signal, Subscription, Topic};
use crate::status_writer::StatusUpdate;

/// A slow reconcile of every master, so a lost last event is repaired too.
const BACKGROUND_RECONCILE: Duration = Duration::from_secs(180);
/// How often links are re-read regardless: a trigger on `copy_links` announces every change, so
/// this only repairs an announcement lost in a way the LISTEN connection did not notice.
const LINKS_EVERY: Duration = Duration::from_secs(60);
/// How often balance and equity are reported.
const FUNDS_EVERY: Duration = Duration::from_secs(30);
/// First and longest delay before a reconcile that is owed (after an unknown outcome, a failed
/// close, a read error) is retried.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// The follower's copies as last seen, by (magic, master ticket).
#[derive(Debug, Default)]
struct Book {
    open: HashMap<(i64, i64), Position>,
    ever: HashSet<(i64, i64)>,
}

impl Book {
    fn rebuild(&mut self, open: &[Position], history: &[ClosedPosition]) {
        self.open.clear();
        self.ever.clear();
        for p in open {
            if let Some(t) = parse_marker(&p.comment) {
                self.open.insert((p.magic, t), p.clone());
                self.ever.insert((p.magic, t));
            }
        }
        for h in history {
            if let Some(t) = parse_marker(&h.position.comment) {
                self.ever.insert((h.position.magic, t));
            }
        }
    }

    fn apply(&mut self, change: &PositionChange) {
        match change {
            PositionChange::Opened { position }
            | PositionChange::Modified { position }
            | PositionChange::PartiallyClosed { position, .. } => {
                if let Some(t) = parse_marker(&position.comment) {
                    self.open.insert((position.magic, t), position.clone());
                    self.ever.insert((position.magic, t));
                }
            }
            PositionChange::Closed { closed } => {
                if let Some(t) = parse_marker(&closed.position.comment) {
                    self.open.remove(&(closed.position.magic, t));
                    self.ever.insert((closed.position.magic, t));
                }
            }
        }
    }
}

struct Follower<'a> {
    ctx: &'a AccountContext,
    id: i64,
    api: Arc<dyn TradeApi>,
    signals: mpsc::UnboundedSender<Signal>,
    links: Vec<Link>,
    /// The links were read at least once (later changes reconcile the masters concerned).
    links_loaded: bool,
    bad_links: HashSet<String>,
    subscriptions: HashMap<i64, Subscription>,
    specs: HashMap<String, SymbolSpec>,
    funds: Inputs,
    master_funds: HashMap<i64, (Option<f64>, Option<f64>)>,
    /// Per master: the (epoch, seq) the copies match.
    applied: HashMap<i64, (i64, i64)>,
    book: Book,
    /// Late-copy bases and every copy this session has seen (the book's `ever` only grows).
    memory: Memory,
    skipped: HashSet<(i64, i64)>,
    /// A reconcile is owed; retried at `retry_at`.
    owed: bool,
    retry_delay: Duration,
    retry_at: Instant,
    copies_sent: u64,
}

/// Runs the follower session until stopped.
pub async fn run(ctx: &AccountContext, row: &AccountRow) -> anyhow::Result<()> {
    let Some(mut session) = ctx.login(row).await? else {
        return Ok(());
    };
    info!(
        balance = session.account.balance,
        "follower logged in (fence raised); reconciling before anything else"
    );
    let (tx, mut signals) = mpsc::unbounded_channel();
    // Link changes are announced; listen before the first read so none is missed.
    let _links_changes = tokio::select! {
        _ = ctx.cancel.cancelled() => return Ok(()),
        s = ctx.node.hub.subscribe(Topic::Links(row.id), tx.clone()) => match s {
            Some(s) => s,
            None => bail!("the notification hub stopped"),
        },
    };
    let mut f = Follower {
        ctx,
        id: row.id,
        api: session.api.clone(),
        signals: tx,
        links: Vec::new(),
        links_loaded: false,
        bad_links: HashSet::new(),
        subscriptions: HashMap::new(),
        specs: HashMap::new(),
        funds: Inputs {
            follower_balance: session.account.balance,
            follower_equity: session.account.equity,
            ..Inputs::default()
        },
        master_funds: HashMap::new(),
        applied: HashMap::new(),
        book: Book::default(),
        memory: Memory::default(),
        skipped: HashSet::new(),
        owed: false,
        retry_delay: RETRY_FIRST,
        retry_at: Instant::now(),
        copies_sent: 0,
    };
    f.report_funds().await;
    if !f.reload_links().await {
        return Ok(());
    }
    f.reconcile_all("session start").await;
    let mut background = spread_interval(BACKGROUND_RECONCILE);
    let mut links = spread_interval(LINKS_EVERY);
    let mut funds = spread_interval(FUNDS_EVERY);
    loop {
        let retry_at = f.retry_at;
        tokio::select! {
            biased;
            _ = ctx.cancel.cancelled() => return Ok(()),
            _ = ctx.gate.restored() => f.reconcile_all("lease trust restored after a lapse").await,
            event = session.events.recv() => match event {
                Some(SessionEvent::Position(change)) => f.book.apply(&change),
                Some(SessionEvent::Reconnected) => f.reconcile_all("broker reconnected").await,
                Some(SessionEvent::LoginLost(reason)) => bail!("the broker refused the follower's login after a reconnect: {reason}"),
                None => bail!("the broker session ended"),
            },
            signal = signals.recv() => match signal {
                Some(Signal::Notice(n, received)) => f.on_notice(n, received).await,
                Some(Signal::LinksChanged) => {
                    if !f.reload_links().await {
                        return Ok(());
                    }
                }
                Some(Signal::Gap) => {
                    // Link changes may have been missed too; every master is reconciled below.
                    if !f.reload_links_only().await {
                        return Ok(());
                    }
                    f.reconcile_all("master notifications may have been lost (LISTEN reconnected)").await;
                }
                None => bail!("the notification hub stopped"),
            },
            _ = tokio::time::sleep_until(retry_at), if f.owed && ctx.gate.holds() => f.reconcile_all("retrying an owed reconcile").await,
            _ = links.tick() => {
                if !f.reload_links().await {
                    return Ok(());
                }
            }
            _ = background.tick() => f.reconcile_all("background reconcile").await,
            _ = funds.tick() => {
                f.report_funds().await;
                let masters: Vec<i64> = f.master_funds.keys().copied().collect();
                for m in masters {
                    f.refresh_master_funds(m).await;
                }
            }
        }
    }
}

impl Follower<'_> {
    fn links_of(&self, master: i64) -> Vec<Link> {
        self.links
            .iter()
            .filter(|l| l.master_id == master)
            .cloned()
            .collect()
    }

    fn owe(&mut self, why: &str) {
        if !self.owed {
            debug!(why, "reconcile owed");
        }
        self.owed = true;
        self.retry_at = Instant::now() + self.retry_delay;
        self.retry_delay = (self.retry_delay * 2).min(RETRY_MAX);
    }

    async fn report_funds(&mut self) {
        if let Ok(info) = self.api.account().await {
            self.funds.follower_balance = info.balance;
            self.funds.follower_equity = info.equity;
            self.ctx.status.send(StatusUpdate {
                account_id: self.id,
                epoch: self.ctx.epoch(),
                status: None,
                balance: Some(info.balance),
                equity: Some(info.equity),
            });
        }
    }

    /// Re-reads the links; subscribes to new masters (before any snapshot of theirs is read) and
    /// reconciles masters whose links changed. False if the task was stopped meanwhile.
    async fn reload_links(&mut self) -> bool {
        self.load_links(true).await
    }

    /// As [`Self::reload_links`], leaving the reconciles to the caller (who reconciles every
    /// master anyway).
    async fn reload_links_only(&mut self) -> bool {
        self.load_links(false).await
    }

    async fn load_links(&mut self, reconcile_changed: bool) -> bool {
        let loaded = async {
            let mut conn = self.ctx.node.pool.acquire().await?;
            db::copy::load_links(&mut conn, self.id).await
        }
        .await;
        let rows = match loaded {
            Ok(rows) => rows,
            Err(e) => {
                warn!(error = %db::describe(&e), "reading the follower's links failed; keeping the current ones");
                return true;
            }
        };
        let mut links = Vec::new();
        for row in rows {
            match row {
                Ok(link) => links.push(link),
                Err(problem) => {
                    if self.bad_links.insert(problem.clone()) {
                        warn!(problem = %problem, "ignoring a copy link that does not parse");
                        self.ctx.set_status(format!("error: {problem}"));
                    }
                }
            }
        }
        if self.links_loaded && links == self.links {
            return true;
        }
        let wanted: HashSet<i64> = links.iter().map(|l| l.master_id).collect();
        for m in &wanted {
            if !self.subscriptions.contains_key(m) {
                let sub = tokio::select! {
                    _ = self.ctx.cancel.cancelled() => return false,
                    s = self.ctx.node.hub.subscribe(Topic::Master(*m), self.signals.clone()) => s,
                };
                match sub {
                    Some(s) => {
                        self.subscriptions.insert(*m, s);
                    }
                    None => return false,
                }
            }
        }
        self.subscriptions.retain(|m, _| wanted.contains(m));
        let changed: BTreeMap<i64, ()> = links
            .iter()
            .filter(|l| !self.links.contains(l))
            .map(|l| (l.master_id, ()))
            .chain(
                self.links
                    .iter()
                    .filter(|l| !links.contains(l))
                    .map(|l| (l.master_id, ())),
            )
            .collect();
        let first = !self.links_loaded;
        self.links_loaded = true;
        if !first {
            info!(links = links.len(), "copy links changed");
        }
        self.links = links;
        self.applied.retain(|m, _| wanted.contains(m));
        if self.links.is_empty() {
            self.ctx.set_status("follower: no copy links");
        }
        if !first {
            for m in changed.keys().filter(|m| wanted.contains(m)) {
                self.applied.remove(m);
                if reconcile_changed {
                    self.reconcile_master(*m, "copy link changed").await;
                }
            }
        }
        true
    }

    async fn reconcile_all(&mut self, why: &str) {
        self.owed = false;
        let masters: Vec<i64> = self
            .links
            .iter()
            .map(|l| l.master_id)
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        if masters.is_empty() {
            self.ctx.set_status("follower: no copy links");
            return;
        }
        for m in masters {
            self.reconcile_master(m, why).await;
        }
        if !self.owed {
            self.retry_delay = RETRY_FIRST;
        }
    }

    /// Reconciles the follower's copies of master `m` to its snapshot.
    async fn reconcile_master(&mut self, m: i64, why: &str) {
        self.ctx.node.metrics.reconciles.inc();
        if !self.ctx.gate.holds() {
            warn!(
                master_id = m,
                why, "gate closed: reconcile deferred until trust returns"
            );
            self.owe("gate closed");
            return;
        }
        if self.specs.is_empty() {
            match self.api.symbols().await {
                Ok(list) => self.specs = list.into_iter().map(|s| (s.symbol.clone(), s)).collect(),
                Err(e) => {
                    warn!(error = %e, "reading the follower broker's symbols failed");
                    self.owe("symbols unavailable");
                    return;
                }
            }
        }
        let db_read = async {
            let mut conn = self.ctx.node.pool.acquire().await?;
            let state = db::copy::master_state(&mut conn, m).await?;
            let funds = db::copy::account_funds(&mut conn, m).await?;
            let bases = db::copy::load_bases(&mut conn, self.id).await?;
            Ok::<_, sqlx::Error>((state, funds, bases))
        }
        .await;
        let (state, master_funds, bases) = match db_read {
            Ok(x) => x,
            Err(e) => {
                warn!(master_id = m, error = %db::describe(&e), "reconcile could not read the master's snapshot; retrying later");
                self.applied.remove(&m);
                self.owe("database unavailable");
                return;
            }
        };
        self.master_funds.insert(m, master_funds);
        self.memory.bases = bases;
        let (positions, history) = match read_follower(self.api.as_ref()).await {
            Ok(x) => x,
            Err(e) => {
                warn!(master_id = m, error = %e, "reconcile could not read the follower's positions; retrying later");
                self.applied.remove(&m);
                self.owe("broker read failed");
                return;
            }
        };
        // Keep what this session saw copied: a read that lost positions must not make a copy
        // look never-opened (the broker's client order id dedupe is the second line).
        self.memory.copied.extend(self.book.ever.iter().copied());
        self.book.rebuild(&positions, &history);
        self.memory.copied.extend(self.book.ever.iter().copied());
        let (epoch, seq, snapshot, now_ms) = match state {
            Some(s) => (s.epoch, s.seq, s.positions, Some(s.now_ms)),
            None => (0, 0, Vec::new(), None),
        };
        if self.has_equity_stop(m) {
            self.report_funds().await;
        }
        let funds = Inputs {
            now_ms,
            ..self.funds_for(m)
        };
        let mut sent = 0;
        for link in self.links_of(m) {
            let actions = plan(
                &link,
                &snapshot,
                &positions,
                &history,
                &self.memory,
                &funds,
                &self.specs,
            );
            for action in actions {
                if action.sends() {
                    sent += 1;
                }
                if self.execute(&link, action).await == Sent::Gated {
                    break;
                }
            }
        }
        self.applied.insert(m, (epoch, seq));
        if sent > 0 {
            info!(master_id = m, why, orders = sent, epoch, seq, "reconciled");
        } else {
            debug!(
                master_id = m,
                why, epoch, seq, "reconciled: nothing to send"
            );
        }
        self.ctx.set_status(format!(
            "follower: master {m} at epoch {epoch} seq {seq}; {} copies sent",
            self.copies_sent
        ));
    }

    /// True when a link of master `m` stops copying at an equity level: the follower's equity is
    /// read fresh before deciding on a new copy.
    fn has_equity_stop(&self, m: i64) -> bool {
        self.links
            .iter()
            .any(|l| l.master_id == m && l.protections.equity_stop.is_some())
    }

    /// True when a ratio link of master `m` lacks the master's balance or equity.
    fn needs_master_funds(&self, m: i64) -> bool {
        let (balance, equity) = self.master_funds.get(&m).copied().unwrap_or((None, None));
        self.links.iter().any(|l| {
            l.master_id == m
                && ((l.lot_mode == LotMode::BalanceRatio && balance.is_none())
                    || (l.lot_mode == LotMode::EquityRatio && equity.is_none()))
        })
    }

    async fn refresh_master_funds(&mut self, m: i64) {
        let result = async {
            let mut conn = self.ctx.node.pool.acquire().await?;
            db::copy::account_funds(&mut conn, m).await
        }
        .await;
        if let Ok(funds) = result {
            self.master_funds.insert(m, funds);
        }
    }

    fn funds_for(&self, m: i64) -> Inputs {
        let (balance, equity) = self.master_funds.get(&m).copied().unwrap_or((None, None));
        Inputs {
            master_balance: balance,
            master_equity: equity,
            ..self.funds
        }
    }

    async fn on_notice(&mut self, n: MasterNotice, received: Instant) {
        let Some(&(epoch, seq)) = self.applied.get(&n.master) else {
            if self.links.iter().any(|l| l.master_id == n.master) {
                self.reconcile_master(n.master, "event before the first reconcile")
                    .await;
            }
            return;
        };
        if n.epoch < epoch || (n.epoch == epoch && n.seq <= seq) {
            debug!(
                master_id = n.master,
                epoch = n.epoch,
                seq = n.seq,
                "event already covered; dropped"
            );
            return;
        }
        if n.epoch != epoch || n.seq != seq + 1 || n.event == MasterEvent::Snapshot {
            let why = if n.event == MasterEvent::Snapshot {
                "master published a snapshot"
            } else if n.epoch != epoch {
                "master changed owner (new epoch)"
            } else {
                "gap in the master's sequence"
            };
            self.reconcile_master(n.master, why).await;
            return;
        }
        self.applied.insert(n.master, (n.epoch, n.seq));
        if matches!(n.event, MasterEvent::Open { .. }) {
            if self.needs_master_funds(n.master) {
                self.refresh_master_funds(n.master).await;
            }
            if self.has_equity_stop(n.master) {
                self.report_funds().await;
            }
        }
        for link in self.links_of(n.master) {
            if let Some(action) = self.event_action(&link, &n.event, received)
                && self.execute(&link, action).await == Sent::Accepted
            {
                self.ctx
                    .node
                    .metrics
                    .copy_latency
                    .observe(received.elapsed().as_secs_f64());
            }
        }
    }

    /// What an event asks of one link, given the copies as last seen. `received`: when the
    /// event arrived at this node.
    fn event_action(&self, link: &Link, event: &MasterEvent, received: Instant) -> Option<Action> {
        match event {
            MasterEvent::Snapshot => None,
            MasterEvent::Open { position } => {
                let key = (link.magic, position.ticket);
                if self.book.ever.contains(&key) || self.memory.copied.contains(&key) {
                    return None;
                }
                // An open event is published when the master's session first records the position
                // (its `first_seen_ms`, database clock) and delivered within milliseconds, so the
                // decision's time is that plus how long the event has waited here.
                let inputs = Inputs {
                    now_ms: position
                        .first_seen_ms
                        .map(|seen| seen + received.elapsed().as_millis() as i64),
                    ..self.funds_for(link.master_id)
                };
                Some(open_action(link, position, &inputs, &self.specs))
            }
            MasterEvent::Close { ticket } => {
                let copy = self.book.open.get(&(link.magic, *ticket))?;
                Some(Action::Close {
                    master_ticket: *ticket,
                    ticket: copy.ticket,
                    reason: "master position closed",
                })
            }
            MasterEvent::Partial {
                ticket,
                before,
                after,
            } => {
                let copy = self.book.open.get(&(link.magic, *ticket))?;
                let spec = self.specs.get(&copy.symbol)?;
                if *before <= 0.0 {
                    return None;
                }
                let target = round_to_step(copy.volume * after / before, spec.volume_step)
                    .max(spec.volume_min)
                    .min(copy.volume);
                let excess = round_to_step(copy.volume - target, spec.volume_step);
                (excess + 1e-9 >= spec.volume_step).then_some(Action::Trim {
                    master_ticket: *ticket,
                    ticket: copy.ticket,
                    close_volume: excess,
                    target,
                })
            }
            MasterEvent::Modify { ticket, sl, tp } => {
                if !link.copy_sl_tp {
                    return None;
                }
                let copy = self.book.open.get(&(link.magic, *ticket))?;
                let (sl, tp) = follower_stops(link, *sl, *tp);
                (copy.sl != sl || copy.tp != tp).then_some(Action::Modify {
                    master_ticket: *ticket,
                    ticket: copy.ticket,
                    sl,
                    tp,
                })
            }
        }
    }

    /// Sends one action. `Gated` when the gate refused it (the rest of a plan is not sent either).
    async fn execute(&mut self, link: &Link, action: Action) -> Sent {
        let master_ticket = match &action {
            Action::Open { master_ticket, .. }
            | Action::Close { master_ticket, .. }
            | Action::Trim { master_ticket, .. }
            | Action::Modify { master_ticket, .. }
            | Action::Skip { master_ticket, .. } => *master_ticket,
        };
        if let Action::Skip { reason, .. } = &action {
            self.skip(link, master_ticket, reason).await;
            return Sent::Nothing;
        }
        // HoldsLease, right before anything reaches the broker.
        if !self.ctx.gate.holds() {
            warn!(
                link_id = link.id,
                master_ticket, "gate closed: order not sent (a reconcile runs once trust returns)"
            );
            self.ctx.node.metrics.orders_gated.inc();
            self.owe("gate closed");
            return Sent::Gated;
        }
        failpoint_after_gate().await;
        let (kind, result): (&str, Result<(), BrokerError>) = match action {
            Action::Open { order, base, .. } => {
                let (symbol, side, volume) = (order.symbol.clone(), order.side, order.volume);
                match self.api.open(order.clone()).await {
                    Ok(fill) => {
                        self.copies_sent += 1;
                        info!(link_id = link.id, master_ticket, ticket = fill.ticket, %symbol, ?side, volume, duplicate = fill.duplicate, "copy opened");
                        let position = Position {
                            ticket: fill.ticket,
                            symbol,
                            side,
                            volume,
                            open_price: fill.price,
                            sl: order.sl,
                            tp: order.tp,
                            magic: order.magic,
                            comment: order.comment,
                            open_time_ms: 0,
                        };
                        self.book.apply(&PositionChange::Opened { position });
                        if let Some(master_volume) = base {
                            self.record_base(link, master_ticket, fill.ticket, master_volume)
                                .await;
                        }
                        ("open", Ok(()))
                    }
                    Err(BrokerError::Rejected(reason)) => {
                        warn!(link_id = link.id, master_ticket, reason = %reason, "copy rejected by the broker; not retried");
                        self.skip(
                            link,
                            master_ticket,
                            &format!("rejected by the broker: {reason}"),
                        )
                        .await;
                        ("open", Err(BrokerError::Rejected(reason)))
                    }
                    Err(e) => {
                        warn!(link_id = link.id, master_ticket, error = %e, "copy outcome unknown or not sent: reconciling by marker before anything is retried");
                        self.owe("open outcome unknown");
                        ("open", Err(e))
                    }
                }
            }
            Action::Close { ticket, reason, .. } => {
                let order = CloseOrder {
                    ticket,
                    volume: None,
                    client_order_id: Some(client_order_id(link.id, master_ticket, "close")),
                };
                match self.api.close(order).await {
                    Ok(fill) => {
                        info!(
                            link_id = link.id,
                            master_ticket,
                            ticket,
                            volume = fill.closed_volume,
                            reason,
                            "copy closed"
                        );
                        ("close", Ok(()))
                    }
                    Err(BrokerError::Rejected(r)) if r.contains("unknown ticket") => {
                        debug!(ticket, "copy already closed");
                        ("close", Err(BrokerError::Rejected(r)))
                    }
                    Err(e) => {
                        warn!(link_id = link.id, master_ticket, ticket, error = %e, "closing a copy failed; retried until it is confirmed closed");
                        self.owe("close failed");
                        ("close", Err(e))
                    }
                }
            }
            Action::Trim {
                ticket,
                close_volume,
                target,
                ..
            } => {
                let id = client_order_id(
                    link.id,
                    master_ticket,
                    &format!("trim{}", (target * 100.0).round() as i64),
                );
                let order = CloseOrder {
                    ticket,
                    volume: Some(close_volume),
                    client_order_id: Some(id),
                };
                match self.api.close(order).await {
                    Ok(fill) => {
                        info!(
                            link_id = link.id,
                            master_ticket,
                            ticket,
                            closed = fill.closed_volume,
                            remaining = fill.remaining_volume,
                            "copy partially closed"
                        );
                        ("close", Ok(()))
                    }
                    Err(e) => {
                        warn!(link_id = link.id, master_ticket, ticket, error = %e, "partial close of a copy failed; reconciling");
                        self.owe("trim failed");
                        ("close", Err(e))
                    }
                }
            }
            Action::Modify { ticket, sl, tp, .. } => match self
                .api
                .modify(ModifyOrder {
                    ticket,
                    sl,
                    tp,
                    client_order_id: None,
                })
                .await
            {
                Ok(()) => {
                    info!(
                        link_id = link.id,
                        master_ticket,
                        ticket,
                        ?sl,
                        ?tp,
                        "copy stops modified"
                    );
                    ("modify", Ok(()))
                }
                Err(BrokerError::Rejected(r)) => {
                    warn!(link_id = link.id, master_ticket, ticket, reason = %r, "modifying a copy's stops was rejected");
                    ("modify", Err(BrokerError::Rejected(r)))
                }
                Err(e) => {
                    warn!(link_id = link.id, master_ticket, ticket, error = %e, "modifying a copy's stops failed; reconciling");
                    self.owe("modify failed");
                    ("modify", Err(e))
                }
            },
            Action::Skip { .. } => unreachable!("handled above"),
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

    /// Logs and records (once per link and ticket) why a master position is not copied.
    async fn skip(&mut self, link: &Link, master_ticket: i64, reason: &str) {
        if !self.skipped.insert((link.id, master_ticket)) {
            return;
        }
        info!(link_id = link.id, master_ticket, reason, "not copied");
        self.ctx.node.metrics.copies_skipped.inc();
        let result = async {
            let mut conn = self.ctx.node.pool.acquire().await?;
            db::copy::record_skip(
                &mut conn,
                &self.ctx.node.node_id,
                self.id,
                self.ctx.epoch(),
                link.id,
                master_ticket,
                reason,
            )
            .await
        }
        .await;
        match result {
            Ok(true) => {}
            Ok(false) => self.ctx.lost().await,
            Err(e) => warn!(error = %db::describe(&e), "recording a skipped copy failed"),
        }
    }

    async fn record_base(
        &mut self,
        link: &Link,
        master_ticket: i64,
        copy_ticket: i64,
        master_volume: f64,
    ) {
        self.memory.bases.insert(copy_ticket, master_volume);
        let result = async {
            let mut conn = self.ctx.node.pool.acquire().await?;
            db::copy::record_base(
                &mut conn,
                &self.ctx.node.node_id,
                self.id,
                self.ctx.epoch(),
                copy_ticket,
                link.id,
                master_ticket,
                master_volume,
            )
            .await
        }
        .await;
        if let Err(e) = result {
            warn!(error = %db::describe(&e), copy_ticket, "recording a late copy's base volume failed; later trims scale against the master's open volume");
        }
    }
}

/// Fault injection for the fault suite: when `COPIERTEST_PAUSE_AFTER_GATE` names a file, an order
/// whose gate check passed while that file exists is held after the check and before the send
/// until the file is removed: a process frozen between its gate check and its order, on demand.
/// Unset (always, outside the fault suite), this is one cached lookup per order.
async fn failpoint_after_gate() {
    static PATH: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    let Some(path) =
        PATH.get_or_init(|| std::env::var_os("COPIERTEST_PAUSE_AFTER_GATE").map(Into::into))
    else {
        return;
    };
    if path.exists() {
        warn!(path = %path.display(), "fault injection: holding an order after its gate check");
        while path.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        warn!("fault injection: sending the held order");
    }
}

/// What became of one action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    /// The broker accepted the order.
    Accepted,
    /// Sent but rejected, or its outcome is unknown.
    Failed,
    /// Nothing to send (a skip).
    Nothing,
    /// The gate refused it.
    Gated,
}

fn open_action(
    link: &Link,
    position: &MasterPosition,
    funds: &Inputs,
    specs: &HashMap<String, SymbolSpec>,
) -> Action {
    match open_order(link, position, funds, specs) {
        Ok(order) => Action::Open {
            master_ticket: position.ticket,
            order,
            base: (position.volume + 1e-9 < position.open_volume).then_some(position.volume),
        },
        Err(reason) => Action::Skip {
            master_ticket: position.ticket,
            reason,
        },
    }
}

async fn read_follower(
    api: &dyn TradeApi,
) -> Result<(Vec<Position>, Vec<ClosedPosition>), BrokerError> {
    let positions = api.positions().await?;
    let history = api.history().await?;
    Ok((positions, history))
}
