//! A master's session: follow the master's positions through the broker's stream and publish
//! each change as an event (epoch = the master's ownership generation, seq + 1 per event), in
//! one fenced statement with the snapshot after it.
//!
//! At start (a new owner: a new epoch), after a broker reconnect, after trust lapsed and came
//! back, and every few minutes, the session compares the broker's positions with the published
//! snapshot and publishes the difference as one `snapshot` event (followers reconcile to it).
//!
//! Glitch guard: a position missing from a positions read is dropped from the snapshot only if
//! the master's history confirms it closed; an empty or partial read never closes copies. The
//! stream's `closed` event carries the closing history entry itself.
//!
//! MT4's renumbering: a partial close on an MT4 server closes the ticket whole (its history
//! entry's comment `to #<new>`) and opens the remainder under a new ticket (`from #<old>`, same
//! symbol and side). The position keeps the ticket it opened under, which its copies' markers
//! name, with the broker's ticket now beside it (`broker_ticket`, kept in the snapshot so a new
//! owner follows it too): followers see a partial close, not a close and a new position.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::events::MasterEvent;
use super::index::lineage;
use super::{MasterOrder, MasterPosition, spread_interval};
use crate::broker::types::{
    AccountInfo, ClosedPosition, OrderEnd, PendingOrder, Position, PositionChange,
};
use crate::broker::{BrokerError, ReadAhead, SessionEvent, TradeApi};
use crate::db;
use crate::db::copy::{AccountRow, Published};
use crate::future::BoxFuture;
use crate::hub::{Signal, Topic};
use crate::session::{AccountContext, Ended};
use crate::status_writer::StatusUpdate;

/// A read of the master: its pending orders (`None`: its bridge lists none), positions and
/// history.
type Read = (
    Option<Vec<PendingOrder>>,
    Vec<Position>,
    Vec<ClosedPosition>,
);

/// A master's positions and history as read.
type Positions = (Vec<Position>, Vec<ClosedPosition>);

/// What a sync asked of the trade server, as answered (judged by [`Master::take_reading`]).
struct Reading {
    /// `None` when not asked: the bridge lists no pending orders.
    orders: Option<Result<Vec<PendingOrder>, BrokerError>>,
    /// `None` when not asked: the orders' read failed (both are read again together).
    broker: Option<Result<Positions, BrokerError>>,
}

/// How often the session re-reads the broker to catch a lost stream event, and reports
/// balance and equity.
const BACKGROUND_SYNC: Duration = Duration::from_secs(120);
/// Background re-reads dropped in a row (a change came while each was read) before the next one
/// is read inline ([`Rereads`]).
const NOT_TAKEN_AT_MOST: u32 = 2;
const FUNDS_EVERY: Duration = Duration::from_secs(30);
/// How soon a failed publication is retried (as a snapshot).
const RETRY: Duration = Duration::from_millis(500);

struct Master<'a> {
    ctx: &'a AccountContext,
    id: i64,
    /// What the broker shows (with first-seen times from the published snapshot).
    view: BTreeMap<i64, MasterPosition>,
    /// What is stored in `master_state` under this epoch.
    published: BTreeMap<i64, MasterPosition>,
    /// The pending orders the broker shows, and those stored.
    orders: BTreeMap<i64, MasterOrder>,
    published_orders: BTreeMap<i64, MasterOrder>,
    /// How far the master server's clock runs from this node's (expiries are published in UTC).
    offset_ms: i64,
    /// The bridge refused the `orders` request: not asked again this session.
    orders_unsupported: bool,
    seq: i64,
    /// A change could not be published: publish a snapshot when the database answers again.
    dirty: bool,
    /// Units per lot by symbol on the master's broker (positions carry theirs for sizing by
    /// notional value).
    contracts: HashMap<String, f64>,
    /// Broker tickets seen no longer open (a read's history closing the position whole while the
    /// read shows it open no more, or a close):
    /// a ticket is never opened again, so an `opened` for one is an update older than what was
    /// read, queued on the stream since the login.
    gone: HashSet<i64>,
    /// Changes taken (stream updates, reads, publications): a background re-read asked for
    /// before the latest is older than the view, and not taken.
    changes: u64,
}

/// Runs the master session until stopped.
pub async fn run(ctx: &AccountContext, row: &AccountRow) -> anyhow::Result<Ended> {
    let Some(mut session) = ctx.login(row).await? else {
        return Ok(Ended::Stopped);
    };
    let ended = serve(ctx, row, &mut session).await;
    ctx.logout(&session).await;
    ended
}

/// The logged-in session's work until it ends.
async fn serve(
    ctx: &AccountContext,
    row: &AccountRow,
    session: &mut crate::broker::Session,
) -> anyhow::Result<Ended> {
    info!(
        balance = session.account.balance,
        "master logged in; publishing its positions"
    );
    let offset_ms = crate::wall_clock::server_offset_ms(session.account.server_time_ms);
    // What a prepared login read ahead of the claim, current at the raise: the first snapshot
    // is published from it, with the figures the fence's reply carried, without a read.
    let ahead = session.ahead.take();
    if ahead.is_some() {
        info!(
            "publishing from what the prepared login read ahead of the claim: no read of the trade server first"
        );
    }
    if ahead.is_some() && session.account.complete() {
        // The fence's reply carried the figures, with the currency and the server's clock.
        store_funds(ctx, session.account);
    } else {
        report_funds(ctx, session.api.as_ref()).await;
    }
    // Changes to the row (server, login, role, credentials) are announced: start again from it.
    let (tx, mut changes) = mpsc::unbounded_channel();
    let _row_changes = tokio::select! {
        _ = ctx.cancel.cancelled() => return Ok(Ended::Stopped),
        s = ctx.node.hub.subscribe(Topic::Account(row.id), tx) => match s {
            Some(s) => s,
            None => bail!("the notification hub stopped"),
        },
    };
    let mut m = Master {
        ctx,
        id: row.id,
        view: BTreeMap::new(),
        published: BTreeMap::new(),
        orders: BTreeMap::new(),
        published_orders: BTreeMap::new(),
        offset_ms: offset_ms.unwrap_or(0),
        orders_unsupported: false,
        seq: 0,
        dirty: false,
        gone: HashSet::new(),
        changes: 0,
        contracts: match match &ahead {
            Some(a) => Ok(a.symbols.clone()),
            None => session.api.symbols().await,
        } {
            Ok(list) => list
                .into_iter()
                .filter(|s| s.contract_size > 0.0)
                .map(|s| (s.symbol, s.contract_size))
                .collect(),
            Err(e) => {
                warn!(error = %e, "the master's symbols could not be read: copies are sized without its contract sizes");
                HashMap::new()
            }
        },
    };
    // A prepared hand-off's master is live work: its followers' copies wait for its first
    // publication, and the session starts among the moved followers' start-up reads, which
    // take the background turns.
    if !m.load(ahead.is_some()).await? {
        return Ok(Ended::Stopped);
    }
    // A new owner always publishes once under its epoch, so followers reconcile early.
    m.sync_from(session.api.as_ref(), true, ahead).await?;
    ctx.started();
    let mut background = spread_interval(BACKGROUND_SYNC);
    let mut funds = spread_interval(FUNDS_EVERY);
    // The periodic reading of the master's figures runs beside its events: a slow trade server's
    // answer (hundreds of milliseconds) holds up no publication, and so no follower's copy.
    let mut reading: Option<BoxFuture<'static, Result<AccountInfo, BrokerError>>> = None;
    let mut rereads = Rereads::default();
    loop {
        let retry = tokio::time::sleep(RETRY);
        tokio::select! {
            _ = ctx.cancel.cancelled() => return Ok(Ended::Stopped),
            _ = ctx.gate.restored() => rereads.inline(&mut m, session.api.as_ref(), false).await?,
            event = session.events.recv() => match event {
                Some(SessionEvent::Position(change)) => m.on_change(change).await?,
                Some(SessionEvent::Reconnected) => {
                    info!("master broker session reconnected: publishing what changed meanwhile");
                    rereads.inline(&mut m, session.api.as_ref(), false).await?;
                }
                Some(SessionEvent::LoginLost(reason)) => bail!("the broker refused the master's login after a reconnect: {reason}"),
                None => bail!("the broker session ended"),
            },
            signal = changes.recv() => match signal {
                Some(Signal::AccountChanged | Signal::Gap) => {
                    if let Some(new) = ctx.changed_row(row).await {
                        return Ok(Ended::RowChanged(Box::new(new)));
                    }
                }
                Some(Signal::FailedOver) => {
                    // The stored (epoch, seq) may have rewound with the lost tail: follow what
                    // the new primary holds, and publish the whole snapshot again.
                    info!("the database failed over: re-reading the stored sequence and publishing a snapshot");
                    m.dirty = true;
                    m.reload_seq().await;
                }
                Some(Signal::Notice(..) | Signal::MasterChanged(_) | Signal::Handoff(_)) => {}
                None => bail!("the notification hub stopped"),
            },
            _ = retry, if m.dirty => rereads.inline(&mut m, session.api.as_ref(), true).await?,
            _ = background.tick() => rereads.start(&mut m, &session.api).await?,
            _ = sync_asked(), if rereads.under_way.is_none() => rereads.start(&mut m, &session.api).await?,
            read = async { rereads.under_way.as_mut().expect("a re-read under way").1.as_mut().await }, if rereads.under_way.is_some() => {
                rereads.answered(&mut m, session.api.as_ref(), read).await?;
            }
            read = async { reading.as_mut().expect("a reading under way").await }, if reading.is_some() => {
                reading = None;
                if let Some(offset) = read.ok().and_then(|info| store_funds(ctx, info)) {
                    m.offset_ms = offset;
                }
            }
            _ = funds.tick() => {
                reading.get_or_insert_with(|| {
                    let api = session.api.clone();
                    Box::pin(async move { api.account().await })
                });
            }
        }
        if ctx.cancel.is_cancelled() {
            return Ok(Ended::Stopped);
        }
    }
}

/// The periodic re-read of the master's broker, which catches an update the stream lost. It runs
/// beside the session's work (a slow trade server's three reads take a second or more, and a
/// session waiting for them would publish nothing meanwhile), and is taken only if the session
/// took no change while it was read: a server answers as of the request, so an older read would
/// undo a newer change. One dropped [`NOT_TAKEN_AT_MOST`] times in a row is read inline next, as
/// a reconnect's is (the updates wait for it): an active master still has its broker compared.
#[derive(Default)]
struct Rereads {
    /// The re-read asked for, with the changes taken then.
    under_way: Option<(u64, BoxFuture<'static, Reading>)>,
    /// Re-reads dropped in a row.
    not_taken: u32,
}

impl Rereads {
    /// Starts a re-read unless one is under way.
    async fn start(&mut self, m: &mut Master<'_>, api: &Arc<dyn TradeApi>) -> anyhow::Result<()> {
        if self.under_way.is_some() {
            return Ok(());
        }
        if self.not_taken >= NOT_TAKEN_AT_MOST {
            info!(
                dropped = self.not_taken,
                "the master's broker is re-read inline: its last re-reads were each older than a change"
            );
            return self.inline(m, api.as_ref(), false).await;
        }
        let api = api.clone();
        let orders_unsupported = m.orders_unsupported;
        self.under_way = Some((
            m.changes,
            Box::pin(async move { read_server(api.as_ref(), orders_unsupported).await }),
        ));
        Ok(())
    }

    /// Re-reads the broker inline (the updates wait for it), dropping the re-read under way
    /// first: it would be older, and a bridge that takes one request of an account at a time
    /// (FIX's) would hold the inline read behind it, while only this session's loop, waiting
    /// here, could finish it.
    async fn inline(
        &mut self,
        m: &mut Master<'_>,
        api: &dyn TradeApi,
        force: bool,
    ) -> anyhow::Result<()> {
        self.under_way = None;
        self.not_taken = 0;
        m.sync(api, force).await
    }

    /// Takes the re-read under way, as answered: compared and published unless a change was
    /// taken since it was asked for.
    async fn answered(
        &mut self,
        m: &mut Master<'_>,
        api: &dyn TradeApi,
        reading: Reading,
    ) -> anyhow::Result<()> {
        let (asked_at, _) = self.under_way.take().expect("a re-read under way");
        if asked_at != m.changes {
            self.not_taken += 1;
            debug!(
                not_taken = self.not_taken,
                "the re-read of the master's broker is older than a change taken since: dropped"
            );
            return Ok(());
        }
        self.not_taken = 0;
        match m.take_reading(reading) {
            Some(read) => m.apply_read(api, false, read).await,
            None => Ok(()),
        }
    }
}

/// Reports balance and equity; the server's clock offset, when it shows its time.
async fn report_funds(ctx: &AccountContext, api: &dyn TradeApi) -> Option<i64> {
    let info = api.account().await.ok()?;
    store_funds(ctx, info)
}

/// Reports the master's figures as read (or as the fence's reply carried them); the server's
/// clock offset.
fn store_funds(ctx: &AccountContext, info: AccountInfo) -> Option<i64> {
    ctx.status.send(StatusUpdate {
        account_id: ctx.account_id,
        epoch: ctx.epoch(),
        status: None,
        balance: Some(info.balance),
        equity: Some(info.equity),
        currency: info.currency,
    });
    crate::wall_clock::server_offset_ms(info.server_time_ms)
}

impl Master<'_> {
    /// Loads the published state (`live`: at once, as live work; otherwise in a background
    /// turn); false if the task was stopped meanwhile.
    async fn load(&mut self, live: bool) -> anyhow::Result<bool> {
        let mut retry = crate::retry::MASTER_PUBLISH.start();
        loop {
            let db = &self.ctx.node.db;
            let id = self.id;
            let result = if live {
                db.run(async |conn| db::copy::master_state(&mut *conn, id).await)
                    .await
            } else {
                db.background(async |conn| db::copy::master_state(&mut *conn, id).await)
                    .await
            };
            match result {
                Ok(state) => {
                    if let Some(state) = state {
                        let positions: BTreeMap<i64, MasterPosition> =
                            state.positions.into_iter().map(|p| (p.ticket, p)).collect();
                        let orders: BTreeMap<i64, MasterOrder> =
                            state.orders.into_iter().map(|o| (o.ticket, o)).collect();
                        self.view = positions.clone();
                        self.orders = orders.clone();
                        if state.epoch == self.ctx.epoch() {
                            self.published = positions;
                            self.published_orders = orders;
                            self.seq = state.seq;
                        }
                    }
                    return Ok(true);
                }
                Err(e) => {
                    warn!(error = %db::describe(&e), "reading the master's published state failed; retrying");
                    tokio::select! {
                        _ = self.ctx.cancel.cancelled() => return Ok(false),
                        _ = tokio::time::sleep(retry.failed()) => {}
                    }
                }
            }
        }
    }

    /// The master's pending orders (`None`: its bridge lists none), positions and history as
    /// `reading` answered them; `None` (and the sync owed) when a read failed.
    fn take_reading(&mut self, reading: Reading) -> Option<Read> {
        let orders = match reading.orders {
            None => None,
            Some(Ok(orders)) => Some(orders),
            Some(Err(e)) if lists_no_orders(&e) => {
                // A bridge older than pending orders: its fills are copied as positions.
                info!(reason = %e, "the master's bridge lists no pending orders: only their fills are published");
                self.orders_unsupported = true;
                self.orders.clear();
                None
            }
            Some(Err(e)) => {
                // Positions without orders could show an order gone that filled meanwhile:
                // both are read again together.
                warn!(error = %e, "reading the master's pending orders failed; keeping the published snapshot");
                self.dirty = true;
                return None;
            }
        };
        match reading.broker {
            Some(Ok((positions, history))) => Some((orders, positions, history)),
            Some(Err(e)) => {
                warn!(error = %e, "reading the master's positions failed; keeping the published snapshot");
                self.dirty = true;
                None
            }
            None => {
                self.dirty = true;
                None
            }
        }
    }

    /// Compares the broker with the view and publishes a snapshot if anything differs (or if
    /// `force`). A read failure leaves everything as it was (the next sync retries).
    async fn sync(&mut self, api: &dyn TradeApi, force: bool) -> anyhow::Result<()> {
        self.sync_from(api, force, None).await
    }

    /// [`Self::sync`], from `ahead` instead of a read when there is one (a prepared login's,
    /// current at the raise).
    async fn sync_from(
        &mut self,
        api: &dyn TradeApi,
        force: bool,
        ahead: Option<Box<ReadAhead>>,
    ) -> anyhow::Result<()> {
        let read = match ahead {
            Some(a) => (Some(a.orders), a.positions, a.history),
            None => {
                let reading = read_server(api, self.orders_unsupported).await;
                match self.take_reading(reading) {
                    Some(read) => read,
                    None => return Ok(()),
                }
            }
        };
        self.apply_read(api, force, read).await
    }

    /// Compares `read` with the view and publishes a snapshot if anything differs (or if
    /// `force`).
    async fn apply_read(
        &mut self,
        api: &dyn TradeApi,
        force: bool,
        (orders, positions, history): Read,
    ) -> anyhow::Result<()> {
        self.changes += 1;
        let open: HashSet<i64> = positions.iter().map(|p| p.ticket).collect();
        self.gone.extend(
            history
                .iter()
                .filter(|h| h.remaining_volume <= 0.0)
                .map(|h| h.position.ticket)
                .filter(|t| !open.contains(t)),
        );
        if self.contracts.is_empty()
            && let Ok(list) = api.symbols().await
        {
            // The read failed at login: sizing by notional value needs it.
            self.contracts = list
                .into_iter()
                .filter(|s| s.contract_size > 0.0)
                .map(|s| (s.symbol, s.contract_size))
                .collect();
        }
        let known_orders = self.orders.clone();
        if let Some(orders) = orders {
            self.orders = orders
                .iter()
                .map(|o| {
                    let known = self.orders.get(&o.ticket);
                    let mut m = from_order(o, known, self.offset_ms);
                    if m.contract_size.is_none() {
                        m.contract_size = self.contracts.get(&m.symbol).copied();
                    }
                    (o.ticket, m)
                })
                .collect();
        }
        let mut next = merge_view(&self.view, &positions, &history);
        for p in next.values_mut() {
            if p.contract_size.is_none() {
                p.contract_size = self.contracts.get(&p.symbol).copied();
            }
            // First seen as the fill of a known pending order (its `opened` update missed, or
            // the previous owner died after the fill): it counts from the order's volume, which
            // pending copies were sized for, whatever was closed of it since.
            if !self.view.contains_key(&p.ticket)
                && let Some(o) = known_orders.get(&p.ticket)
            {
                p.open_volume = p.open_volume.max(o.volume);
            }
        }
        // An order that filled between the two reads shows in both: it is the position now.
        self.orders.retain(|t, _| !next.contains_key(t));
        for (ticket, p) in &self.view {
            if !next.contains_key(ticket) {
                info!(master_ticket = ticket, symbol = %p.symbol, "master position closed (confirmed by history)");
            }
        }
        let kept = self
            .view
            .keys()
            .filter_map(|t| next.get(t))
            .filter(|p| !positions.iter().any(|q| q.ticket == now_ticket(p)))
            .count();
        if kept > 0 {
            warn!(
                positions = kept,
                "master positions missing from the positions read but not closed in history: kept (glitch guard)"
            );
        }
        self.view = next;
        if force
            || self.dirty
            || self.view != self.published
            || self.orders != self.published_orders
            || self.seq == 0
        {
            self.publish(MasterEvent::Snapshot).await?;
        }
        Ok(())
    }

    /// Turns one broker change into an event and publishes it.
    async fn on_change(&mut self, change: PositionChange) -> anyhow::Result<()> {
        self.changes += 1;
        let event = match change {
            PositionChange::Opened { position } if self.gone.contains(&position.ticket) => {
                // Queued before a read that showed it closed: the read is newer.
                debug!(
                    ticket = position.ticket,
                    "an update older than the last read (its position is closed): ignored"
                );
                return Ok(());
            }
            PositionChange::Opened { position } => {
                let known = self
                    .published_of(position.ticket)
                    .or_else(|| self.remainder_of(&position));
                if let Some(ticket) = known.filter(|t| *t != position.ticket) {
                    // MT4's remainder of a partial close (followed from the closed part's
                    // `to #`, a read, or here): the same position, as large as it shows.
                    let p = self.view.get_mut(&ticket).expect("found in the view");
                    // Equal: nothing new. Larger: older than what was read (a remainder only
                    // shrinks).
                    if position.volume > p.volume - 1e-9 {
                        if (position.volume - p.volume).abs() < 1e-9 {
                            p.broker_ticket = Some(position.ticket);
                        }
                        return Ok(());
                    }
                    p.broker_ticket = Some(position.ticket);
                    let before = p.volume;
                    p.volume = position.volume;
                    let event = MasterEvent::Partial {
                        ticket,
                        before,
                        after: position.volume,
                    };
                    if self.dirty {
                        return self.publish(MasterEvent::Snapshot).await;
                    }
                    return self.publish(event).await;
                }
                if known.is_some() {
                    // Known from a read; an order of its ticket left behind goes now.
                    if self.orders.remove(&position.ticket).is_some() {
                        return self.publish(MasterEvent::Snapshot).await;
                    }
                    return Ok(());
                }
                if lineage(&position.comment, "from #").is_some() {
                    // Perhaps the remainder of a renumbering whose events were lost: a read of
                    // positions and history tells (and publishes it as new if it is).
                    debug!(ticket = position.ticket, comment = %position.comment, "a position names a ticket this session does not know: reading the account");
                    self.dirty = true;
                    return Ok(());
                }
                let mut p = from_broker(&position, None);
                p.contract_size = self.contracts.get(&p.symbol).copied();
                // A pending order's fill: the order leaves the snapshot in the same event, and
                // the position counts from the order's volume (pending copies were sized for it).
                if let Some(o) = self.orders.remove(&p.ticket) {
                    p.open_volume = p.open_volume.max(o.volume);
                }
                self.view.insert(p.ticket, p.clone());
                MasterEvent::Open { position: p }
            }
            PositionChange::Modified { position } => {
                let Some(ticket) = self.published_of(position.ticket) else {
                    return Ok(());
                };
                let p = self.view.get_mut(&ticket).expect("found in the view");
                if p.sl == position.sl && p.tp == position.tp {
                    return Ok(());
                }
                p.sl = position.sl;
                p.tp = position.tp;
                MasterEvent::Modify {
                    ticket,
                    sl: position.sl,
                    tp: position.tp,
                }
            }
            PositionChange::PartiallyClosed { position, .. } => {
                let Some(ticket) = self.published_of(position.ticket) else {
                    return Ok(());
                };
                let p = self.view.get_mut(&ticket).expect("found in the view");
                if position.volume > p.volume - 1e-9 {
                    // A partial close only shrinks a position: this one is no news, or older
                    // than what was read.
                    debug!(
                        ticket,
                        volume = position.volume,
                        known = p.volume,
                        "a partial close that does not shrink the position (an update older than the last read): ignored"
                    );
                    return Ok(());
                }
                let before = p.volume;
                p.volume = position.volume;
                MasterEvent::Partial {
                    ticket,
                    before,
                    after: position.volume,
                }
            }
            PositionChange::Closed { closed } => {
                self.gone.insert(closed.position.ticket);
                // An order of the same ticket (its fill's) cannot rest any more either.
                let order_left = self.orders.remove(&closed.position.ticket).is_some();
                let Some(ticket) = self.published_of(closed.position.ticket) else {
                    if order_left {
                        // Its fill's position was never published (an update older than the
                        // last read): the order leaves the snapshot now.
                        return self.publish(MasterEvent::Snapshot).await;
                    }
                    return Ok(());
                };
                let p = self.view.get_mut(&ticket).expect("found in the view");
                match lineage(&closed.position.comment, "to #") {
                    // MT4 closed the ticket to renumber the rest (a part of it, not all): the
                    // position goes on under the new ticket, whatever order the remainder's
                    // `opened` comes in. Its volume is the broker's word, from that `opened`
                    // (or the next read), never worked out here.
                    Some(rest) if closed.position.volume < p.volume - 1e-9 => {
                        debug!(
                            master_ticket = ticket,
                            broker_ticket = rest,
                            "master position renumbered by a partial close"
                        );
                        p.broker_ticket = Some(rest);
                        return Ok(());
                    }
                    _ => {
                        self.view.remove(&ticket);
                        MasterEvent::Close { ticket }
                    }
                }
            }
            // A late update of an order that has already filled changes nothing, nor one whose
            // fill's position is closed already (an update older than the last read).
            PositionChange::OrderPlaced { order } | PositionChange::OrderChanged { order }
                if self.view.contains_key(&order.ticket) || self.gone.contains(&order.ticket) =>
            {
                return Ok(());
            }
            PositionChange::OrderPlaced { order } | PositionChange::OrderChanged { order } => {
                let mut o = from_order(&order, self.orders.get(&order.ticket), self.offset_ms);
                if o.contract_size.is_none() {
                    o.contract_size = self.contracts.get(&o.symbol).copied();
                }
                if self.orders.get(&o.ticket) == Some(&o) {
                    return Ok(());
                }
                self.orders.insert(o.ticket, o.clone());
                MasterEvent::OrderSet { order: o }
            }
            // A fill leaves the order in the snapshot until its position is seen (the `opened`
            // update, or the next read): published apart, "order gone" then "opened" would read
            // in between as an order cancelled, and followers would close copies that filled.
            PositionChange::OrderGone {
                end: OrderEnd::Filled { .. },
                ..
            } => return Ok(()),
            PositionChange::OrderGone { ticket, .. } => {
                if self.orders.remove(&ticket).is_none() {
                    return Ok(());
                }
                MasterEvent::OrderGone { ticket }
            }
        };
        if self.dirty {
            // An earlier change is still unpublished: the snapshot carries both.
            return self.publish(MasterEvent::Snapshot).await;
        }
        self.publish(event).await
    }

    /// The published ticket of the position the broker now calls `broker` (its own, or the one
    /// an MT4 remainder opened under).
    fn published_of(&self, broker: i64) -> Option<i64> {
        if self
            .view
            .get(&broker)
            .is_some_and(|p| now_ticket(p) == broker)
        {
            return Some(broker);
        }
        self.view
            .values()
            .find(|p| p.broker_ticket == Some(broker))
            .map(|p| p.ticket)
    }

    /// The published ticket of the position `position` is MT4's remainder of (`from #<old>`, the
    /// same symbol and side), if it is one this view holds.
    fn remainder_of(&self, position: &Position) -> Option<i64> {
        let old = lineage(&position.comment, "from #")?;
        let ticket = self.published_of(old)?;
        continues(&self.view[&ticket], position).then_some(ticket)
    }

    /// Publishes `event` with the current view as (epoch, seq + 1).
    async fn publish(&mut self, event: MasterEvent) -> anyhow::Result<()> {
        let epoch = self.ctx.epoch();
        let seq = self.seq + 1;
        let positions: Vec<MasterPosition> = self.view.values().cloned().collect();
        let orders: Vec<MasterOrder> = self.orders.values().cloned().collect();
        let write = db::copy::PublishWrite::new(
            &self.ctx.node.node_id,
            self.id,
            (epoch, seq),
            (&positions, &orders),
            &event,
        );
        let result = self.ctx.node.master_publisher.write(write).await;
        match result {
            Ok(Published::Stored { first_seen }) => {
                debug!(seq, kind = event.kind(), "master event published");
                // Its followers on this node hear it now, not after the NOTIFY's round trip.
                self.ctx.node.hub.deliver(db::copy::announced(
                    self.id,
                    (epoch, seq),
                    event,
                    first_seen,
                ));
                self.ctx.node.metrics.events_published.inc();
                self.seq = seq;
                self.dirty = false;
                let (mut positions, mut orders) = (positions, orders);
                db::copy::stamp_first_seen(first_seen, &mut positions, &mut orders);
                self.adopt_stored(positions, orders);
                self.ctx.set_status(format!(
                    "master: published epoch {epoch} seq {seq} ({} open positions, {} pending orders)",
                    self.published.len(),
                    self.published_orders.len()
                ));
                Ok(())
            }
            Ok(Published::Refused) => self.refused(epoch, seq).await,
            Err(e) => {
                // Committed or not, we cannot tell: re-read before publishing again (as a snapshot).
                warn!(error = %e, seq, kind = event.kind(), "publishing a master event failed; will publish a snapshot");
                self.dirty = true;
                self.reload_seq().await;
                Ok(())
            }
        }
    }

    /// The publish matched nothing: either this epoch no longer owns the master, or the stored
    /// seq is ahead (an earlier publish committed without our seeing the reply).
    async fn refused(&mut self, epoch: i64, seq: i64) -> anyhow::Result<()> {
        let owned = self
            .ctx
            .node
            .db
            .run(async |conn| {
                db::copy::still_owned(&mut *conn, &self.ctx.node.node_id, self.id, epoch).await
            })
            .await;
        match owned {
            Ok(false) => {
                warn!(
                    seq,
                    "publish refused: this node no longer owns the master at this epoch; stopping its session"
                );
                self.ctx.lost().await;
                Ok(())
            }
            Ok(true) => {
                warn!(
                    seq,
                    "publish refused: the stored sequence moved on; re-reading and publishing a snapshot"
                );
                self.dirty = true;
                self.reload_seq().await;
                Ok(())
            }
            Err(e) => {
                warn!(error = %db::describe(&e), "checking ownership after a refused publish failed; retrying as a snapshot");
                self.dirty = true;
                Ok(())
            }
        }
    }

    /// Takes the stored seq of this epoch, if any, so the next publish follows it.
    async fn reload_seq(&mut self) {
        let state = self
            .ctx
            .node
            .db
            .run(async |conn| db::copy::master_state(&mut *conn, self.id).await)
            .await;
        if let Ok(Some(state)) = state
            && state.epoch == self.ctx.epoch()
        {
            self.seq = state.seq;
            // A publish whose reply was lost may have stored (and announced) first-seen times:
            // the next snapshot keeps them rather than stamping the positions again.
            self.adopt_stored(state.positions, state.orders);
        }
    }

    /// Takes what the database stored as published, and its first-seen times (the database's
    /// clock, stamped once) into the view.
    fn adopt_stored(&mut self, positions: Vec<MasterPosition>, orders: Vec<MasterOrder>) {
        self.published = positions.into_iter().map(|p| (p.ticket, p)).collect();
        for (t, p) in &self.published {
            if let Some(v) = self.view.get_mut(t) {
                v.first_seen_ms = p.first_seen_ms;
                v.first_seen_us = p.first_seen_us;
            }
        }
        self.published_orders = orders.into_iter().map(|o| (o.ticket, o)).collect();
        for (t, o) in &self.published_orders {
            if let Some(v) = self.orders.get_mut(t) {
                v.first_seen_ms = o.first_seen_ms;
                v.first_seen_us = o.first_seen_us;
            }
        }
    }
}

/// Reads the master's pending orders (unless its bridge lists none), then its positions and
/// history: orders first, so an order that fills between the reads is in the positions.
async fn read_server(api: &dyn TradeApi, orders_unsupported: bool) -> Reading {
    let orders = if orders_unsupported {
        None
    } else {
        Some(api.orders().await)
    };
    let broker = match &orders {
        Some(Err(e)) if !lists_no_orders(e) => None,
        _ => Some(read_broker(api).await),
    };
    Reading { orders, broker }
}

/// The bridge refused the `orders` request as unknown: it predates pending orders.
fn lists_no_orders(e: &BrokerError) -> bool {
    matches!(e, BrokerError::Rejected(r) if r.code == crate::broker::RejectCode::InvalidRequest)
}

/// Fault point `COPIERTEST_MASTER_SYNC`: while its file exists, the periodic re-read of the
/// broker ([`Rereads`]) starts again as soon as the last one is over (the tests' way to a
/// re-read under way; the period is two minutes).
#[cfg(feature = "failpoints")]
async fn sync_asked() {
    if std::env::var_os("COPIERTEST_MASTER_SYNC").is_none() {
        return std::future::pending::<()>().await;
    }
    while !crate::failpoints::active("COPIERTEST_MASTER_SYNC") {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(not(feature = "failpoints"))]
async fn sync_asked() {
    std::future::pending::<()>().await;
}

async fn read_broker(api: &dyn TradeApi) -> Result<Positions, BrokerError> {
    let positions = api.positions().await?;
    let history = api.history().await?;
    Ok((positions, history))
}

fn from_broker(p: &Position, known: Option<&MasterPosition>) -> MasterPosition {
    MasterPosition {
        ticket: p.ticket,
        symbol: p.symbol.clone(),
        side: p.side,
        volume: p.volume,
        open_volume: known.map_or(p.volume, |k| k.open_volume),
        open_price: p.open_price,
        sl: p.sl,
        tp: p.tp,
        magic: p.magic,
        first_seen_ms: known.and_then(|k| k.first_seen_ms),
        first_seen_us: known.and_then(|k| k.first_seen_us),
        open_time_ms: (p.open_time_ms > 0)
            .then_some(p.open_time_ms)
            .or(known.and_then(|k| k.open_time_ms)),
        contract_size: known.and_then(|k| k.contract_size),
        broker_ticket: None,
    }
}

/// A pending order as published: its expiry also in UTC (the server's clock less `offset_ms`,
/// kept from when it was first seen while the expiry is unchanged, so a re-measured offset does
/// not make followers amend), its first-seen time kept.
fn from_order(o: &PendingOrder, known: Option<&MasterOrder>, offset_ms: i64) -> MasterOrder {
    let expiry_utc_ms = match known {
        Some(k) if k.expiry_ms == o.expiry_ms => k.expiry_utc_ms,
        _ => o.expiry_ms.map(|e| e - offset_ms),
    };
    MasterOrder {
        ticket: o.ticket,
        symbol: o.symbol.clone(),
        side: o.side,
        kind: o.kind,
        price: o.price,
        volume: o.volume,
        sl: o.sl,
        tp: o.tp,
        expiry_ms: o.expiry_ms,
        expiry_utc_ms,
        magic: o.magic,
        first_seen_ms: known.and_then(|k| k.first_seen_ms),
        first_seen_us: known.and_then(|k| k.first_seen_us),
        contract_size: known.and_then(|k| k.contract_size),
    }
}

/// The master's view after a positions read: every position the broker shows (keeping known
/// first-seen times and open volumes), plus every known position the read lacks whose close
/// the history does not confirm (glitch guard).
pub fn merge_view(
    known: &BTreeMap<i64, MasterPosition>,
    positions: &[Position],
    history: &[ClosedPosition],
) -> BTreeMap<i64, MasterPosition> {
    let open: HashMap<i64, &Position> = positions.iter().map(|p| (p.ticket, p)).collect();
    // A known position's broker ticket now, followed through MT4's renumbering (a closing
    // entry `to #<new>` that closed only a part of what the lineage held), and whether the
    // history shows it closed: (ticket, closed). A closing entry that took all it held is a
    // close whatever its comment says (on another broker `to #123` is only a comment).
    let follow = |k: &MasterPosition| -> (i64, bool) {
        let (mut t, mut held) = (now_ticket(k), k.volume);
        let mut seen = HashSet::new();
        loop {
            if open.contains_key(&t) {
                return (t, false);
            }
            let Some(h) = history
                .iter()
                .find(|h| h.position.ticket == t && h.remaining_volume <= 0.0)
            else {
                return (t, false); // not closed as far as the history shows
            };
            match lineage(&h.position.comment, "to #") {
                Some(rest) if h.position.volume < held - 1e-9 && seen.insert(t) => {
                    held -= h.position.volume;
                    t = rest;
                }
                _ => return (t, true),
            }
        }
    };
    let mut published: HashMap<i64, i64> = HashMap::new();
    for (ticket, k) in known {
        let (t, _) = follow(k);
        if open
            .get(&t)
            .is_some_and(|p| t == now_ticket(k) || continues(k, p))
        {
            published.entry(t).or_insert(*ticket);
        }
    }
    let mut next: BTreeMap<i64, MasterPosition> = BTreeMap::new();
    for p in positions {
        let ticket = published.get(&p.ticket).copied().unwrap_or(p.ticket);
        let mut m = from_broker(p, known.get(&ticket));
        m.ticket = ticket;
        m.broker_ticket = (p.ticket != ticket).then_some(p.ticket);
        next.insert(ticket, m);
    }
    for (ticket, k) in known {
        if next.contains_key(ticket) {
            continue;
        }
        // Kept unless the history shows it closed (glitch guard).
        let (_, closed) = follow(k);
        if !closed {
            next.insert(*ticket, k.clone());
        }
    }
    next
}

/// The broker's ticket for a position of the view now.
fn now_ticket(p: &MasterPosition) -> i64 {
    p.broker_ticket.unwrap_or(p.ticket)
}

/// Whether `p` can be MT4's remainder of `known`: the same symbol, side and open price (MT4
/// keeps them), and no more than it held.
fn continues(known: &MasterPosition, p: &Position) -> bool {
    known.symbol == p.symbol
        && known.side == p.side
        && (known.open_price - p.open_price).abs() < 1e-9
        && p.volume <= known.volume + 1e-9
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::types::{ClosedBy, Side};

    fn pos(ticket: i64, volume: f64) -> Position {
        Position {
            ticket,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume,
            open_price: 1.1,
            sl: None,
            tp: None,
            magic: 0,
            comment: String::new(),
            open_time_ms: 0,
        }
    }

    fn known(ticket: i64, volume: f64, seen: i64) -> MasterPosition {
        MasterPosition {
            first_seen_ms: Some(seen),
            first_seen_us: None,
            open_time_ms: None,
            contract_size: None,
            ..from_broker(&pos(ticket, volume), None)
        }
    }

    #[test]
    fn an_empty_read_closes_nothing_without_history() {
        let k: BTreeMap<i64, MasterPosition> =
            [(1, known(1, 1.0, 5)), (2, known(2, 0.5, 6))].into();
        assert_eq!(
            merge_view(&k, &[], &[]),
            k,
            "an empty positions read is a glitch until history says otherwise"
        );
    }

    #[test]
    fn history_confirms_closes_and_new_positions_appear() {
        let k: BTreeMap<i64, MasterPosition> =
            [(1, known(1, 1.0, 5)), (2, known(2, 0.5, 6))].into();
        let closed = ClosedPosition {
            position: pos(1, 1.0),
            close_price: 1.1,
            close_time_ms: 0,
            closed_by: ClosedBy::Client,
            remaining_volume: 0.0,
            profit: 0.0,
        };
        let next = merge_view(&k, &[pos(2, 0.3), pos(3, 2.0)], &[closed]);
        assert!(!next.contains_key(&1));
        assert_eq!(
            (
                next[&2].volume,
                next[&2].open_volume,
                next[&2].first_seen_ms
            ),
            (0.3, 0.5, Some(6))
        );
        assert_eq!((next[&3].open_volume, next[&3].first_seen_ms), (2.0, None));
    }

    #[test]
    fn a_partial_close_in_history_does_not_drop_the_position() {
        let k: BTreeMap<i64, MasterPosition> = [(1, known(1, 1.0, 5))].into();
        let partial = ClosedPosition {
            position: pos(1, 0.4),
            close_price: 1.1,
            close_time_ms: 0,
            closed_by: ClosedBy::Client,
            remaining_volume: 0.6,
            profit: 0.0,
        };
        assert!(merge_view(&k, &[], &[partial]).contains_key(&1));
    }

    /// MT4 renumbers the rest of a partial close (twice here: 1 -> 7 -> 9): the read shows 9
    /// `from #7` and the history 1 `to #7`, 7 `to #9`. The position stays 1, smaller, its opening
    /// volume and first sighting kept, with the broker's ticket beside it; a later read that
    /// starts from there follows it too, and its close (nothing left, no `to #`) ends it.
    #[test]
    fn an_mt4_remainder_is_the_position_it_was_split_from() {
        let k: BTreeMap<i64, MasterPosition> = [(1, known(1, 1.0, 5))].into();
        let part = |ticket: i64, volume: f64, to: i64| ClosedPosition {
            position: Position {
                comment: format!("to #{to}"),
                ..pos(ticket, volume)
            },
            close_price: 1.1,
            close_time_ms: 0,
            closed_by: ClosedBy::Client,
            remaining_volume: 0.0,
            profit: 0.0,
        };
        let rest = Position {
            comment: "from #7".into(),
            ..pos(9, 0.3)
        };
        let history = [part(1, 0.4, 7), part(7, 0.3, 9)];
        let next = merge_view(&k, std::slice::from_ref(&rest), &history);
        assert_eq!(next.keys().copied().collect::<Vec<_>>(), vec![1]);
        assert_eq!(
            (
                next[&1].volume,
                next[&1].open_volume,
                next[&1].first_seen_ms,
                next[&1].broker_ticket
            ),
            (0.3, 1.0, Some(5), Some(9))
        );
        // Without the remainder in the read (a glitch), the renumbering alone closes nothing.
        assert!(merge_view(&k, &[], &history).contains_key(&1));
        // A new owner's read, from the stored snapshot: still 1; closed once 9 closes whole.
        let again = merge_view(&next, std::slice::from_ref(&rest), &history);
        assert_eq!(again, next);
        let closed = ClosedPosition {
            position: rest.clone(),
            close_price: 1.1,
            close_time_ms: 0,
            closed_by: ClosedBy::Client,
            remaining_volume: 0.0,
            profit: 0.0,
        };
        assert!(merge_view(&next, &[], &[history[0].clone(), closed]).is_empty());
        // Another symbol under a `from #` comment is not the position's remainder.
        let stranger = Position {
            symbol: "GBPUSD".into(),
            ..rest.clone()
        };
        let next = merge_view(&k, &[stranger], &history);
        assert!(next.contains_key(&9) && next.contains_key(&1));
    }

    /// On a broker that keeps its tickets, comments that merely read like MT4's are comments: a
    /// full close commented `to #123` (no such ticket) closes the position, and a new position
    /// commented `from #1` at another price is a position of its own.
    #[test]
    fn comments_that_look_like_mt4_lineage_are_only_comments() {
        let k: BTreeMap<i64, MasterPosition> = [(1, known(1, 1.0, 5))].into();
        let closed = ClosedPosition {
            position: Position {
                comment: "to #123".into(),
                ..pos(1, 1.0)
            },
            close_price: 1.1,
            close_time_ms: 0,
            closed_by: ClosedBy::Client,
            remaining_volume: 0.0,
            profit: 0.0,
        };
        assert!(merge_view(&k, &[], std::slice::from_ref(&closed)).is_empty());
        let other = Position {
            comment: "from #1".into(),
            open_price: 1.2,
            ..pos(2, 0.5)
        };
        let next = merge_view(&k, std::slice::from_ref(&other), &[]);
        assert_eq!(next.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!((next[&1].volume, next[&2].broker_ticket), (1.0, None));
    }
}
