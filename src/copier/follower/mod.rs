//! A follower's session: copy its masters' events onto the follower's broker account, one at a
//! time, and reconcile whenever continuity is in doubt.
//!
//! Order of business (docs/copying.md, Reconcile): log in with the epoch as the fence (the
//! server learns the new owner's fence before anything else), LISTEN to every master of the
//! follower's links (confirmed; with a prepared login, before its fence's raise, and the first
//! reads of the database asked then too: [`Early`]), then reconcile each master against its
//! snapshot, remembering the snapshot and its
//! (epoch, seq). An event at exactly seq + 1 of that epoch is applied to the remembered snapshot
//! and the affected ticket is decided exactly as reconcile decides it ([`plan_ticket`]); one at
//! or below it (or of an older epoch) is dropped; anything else (a gap, a new epoch, a snapshot
//! event) reconciles. So do a LISTEN reconnect, a broker reconnect, trust that lapsed and came
//! back, an order whose outcome is unknown, a failed close, an input not known yet, and a timer
//! every few minutes.
//!
//! * [`links`]: reading the follower's links and subscribing to their masters;
//! * [`send`]: executing decisions: the gate right before every order, then the broker, and the
//!   records (final skips, late-copy bases).
//!
//! Every order is preceded by the gate check for this (account, epoch); a refused order is
//! logged and not queued: the reconcile after the gate reopens does what is still owed.

mod links;
mod pending;
mod risk;
mod send;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::events::{MasterEvent, MasterNotice};
use super::index::CopyIndex;
use super::reconcile::{
    Action, Memory, PendingCopies, Situation, apply_event, changed_tickets, limit_follower_copies,
    limit_open_copies, plan, plan_key,
};
use super::rules::{Inputs, Link};
use super::{MasterOrder, MasterPosition, spread_interval};
use crate::broker::types::{AccountInfo, ClosedPosition, PendingOrder, Position, SymbolSpec};
use crate::broker::{BrokerError, ReadAhead, SessionEvent, TradeApi};
use crate::db;
use crate::db::batch::Submitted;
use crate::db::copy::AccountRow;
use crate::hub::{Signal, Subscription, Topic};
use crate::session::{AccountContext, Ended};
use crate::status_writer::StatusUpdate;
use risk::Reading;
use send::Sent;

/// How often links are re-read regardless: a trigger on `copy_links` announces every change, so
/// this only repairs an announcement lost in a way the LISTEN connection did not notice.
const LINKS_EVERY: Duration = Duration::from_secs(60);
/// How often balance and equity are reported.
const FUNDS_EVERY: Duration = Duration::from_secs(30);
/// How often a follower with risk limits reads its balance and equity to judge them (also
/// before every new copy).
const RISK_EVERY: Duration = Duration::from_secs(5);

/// A master's snapshot as the follower's copies follow it.
#[derive(Debug, Clone)]
struct MasterView {
    epoch: i64,
    seq: i64,
    positions: Vec<MasterPosition>,
    orders: Vec<MasterOrder>,
}

/// A follower session's state. What one concern alone touches is grouped with the file that
/// owns it: the links ([`links::Links`]), the risk limits ([`risk::Guard`]), the orders sent and
/// their records ([`send::Sending`]), the owed reconcile ([`Owing`]); the rest is read and
/// written across the session's files.
struct Follower<'a> {
    ctx: &'a AccountContext,
    id: i64,
    /// The broker account this session trades (the copy ledger's rows are per account).
    server: String,
    login: String,
    api: Arc<dyn TradeApi>,
    signals: mpsc::UnboundedSender<Signal>,
    links: links::Links,
    /// The status last set (shown again after the links' problems change).
    status: String,
    specs: HashMap<String, SymbolSpec>,
    /// Whether the broker places pending copies, and its clock's offset.
    pending: PendingCopies,
    funds: Inputs,
    master_funds: HashMap<i64, db::copy::Funds>,
    /// The follower's own limit on open copies, over all its links.
    max_open_copies: Option<i64>,
    risk: risk::Guard,
    /// Per master: the snapshot the copies match, at its (epoch, seq).
    masters: HashMap<i64, MasterView>,
    /// The follower's copies by marker.
    index: CopyIndex,
    /// Late-copy bases and final decisions (from the database).
    memory: Memory,
    sending: send::Sending,
    owing: Owing,
    /// Pending copies whose fill the stream announced, until their position's update arrives.
    fills: HashSet<i64>,
    /// What a prepared login read ahead of the claim, current at the raise: the session start's
    /// first read of the trade server (and its symbols), then gone.
    ahead: Option<Box<ReadAhead>>,
    /// The database's part of the session's first reconcile, read beside its links: taken by
    /// that reconcile when nothing was carried out (and no ledger row written) since the read,
    /// then gone.
    first: Option<FirstReads>,
    /// Readings of the account's figures made inline ([`Follower::report_funds`]): a reading
    /// beside the session's work asked for before the latest of them is older: its figures are
    /// not taken, though a drawdown it saw counts toward the risk limits.
    inline_readings: u64,
}

/// A periodic reading of the account's figures under way beside the session's work.
struct Background {
    /// [`Follower::inline_readings`] when it was asked for: one made since is newer.
    inline_readings: u64,
    /// [`risk::Guard::changes`] when it was asked for.
    risk_changes: u64,
    answer: crate::future::BoxFuture<'static, Result<AccountInfo, BrokerError>>,
}

/// A session's first reads of the database: its row's masters' snapshots (with the follower's
/// bases and decisions) and its ledgers, asked for before its links are read (the masters
/// subscribed to before: nothing they publish after the read is missed) and answered meanwhile.
struct FirstReads {
    bases: HashMap<i64, Submitted<Result<db::copy::ReconcileBasis, String>>>,
    ledgers: Submitted<db::copy::LedgerRows>,
    /// [`send::Sending::actions`] when they were asked for: an action since may have written
    /// what they read.
    actions: u64,
}

/// A reconcile is owed; retried at `at` ([`crate::retry::FOLLOWER_RECONCILE`]).
struct Owing {
    due: bool,
    retry: crate::retry::Retry,
    at: Instant,
}

/// Runs the follower session until stopped.
pub async fn run(ctx: &AccountContext, row: &AccountRow) -> anyhow::Result<Ended> {
    // A prepared login is raised by a round trip to the trade server: the session's first
    // reads of the database are asked before it, to be answered meanwhile.
    let early = if ctx.node.handoffs.holds(row.id) {
        match Early::ask(ctx, row).await? {
            Some(early) => Some(early),
            None => return Ok(Ended::Stopped),
        }
    } else {
        None
    };
    let Some(mut session) = ctx.login(row).await? else {
        return Ok(Ended::Stopped);
    };
    let ended = follow(ctx, row, &mut session, early).await;
    ctx.logout(&session).await;
    ended
}

/// What a session with a prepared login asks of the database before the login's fence is
/// raised: the subscriptions its first reads need (the account's changes, its row's masters'
/// events), then those reads (its links, its masters' snapshots, its ledgers), all as a fresh
/// session asks them after its login. The claim has committed, so the old owner's release has
/// too, and with it every ledger row of the old owner's session (written before the session
/// ended, and the release waits for that); nothing but this session writes them now.
struct Early {
    tx: mpsc::UnboundedSender<Signal>,
    signals: mpsc::UnboundedReceiver<Signal>,
    changes: Subscription,
    masters: HashMap<i64, Subscription>,
    first: FirstReads,
    links: Submitted<Result<db::copy::FollowerLinks, String>>,
}

impl Early {
    /// `None` if the session was stopped meanwhile.
    async fn ask(ctx: &AccountContext, row: &AccountRow) -> anyhow::Result<Option<Early>> {
        let (tx, signals) = mpsc::unbounded_channel();
        let Some(changes) = subscribe(ctx, Topic::Account(row.id), &tx).await? else {
            return Ok(None);
        };
        let mut masters = HashMap::new();
        for &m in &row.masters {
            let Some(sub) = subscribe(ctx, Topic::Master(m), &tx).await? else {
                return Ok(None);
            };
            masters.insert(m, sub);
        }
        let first = FirstReads {
            bases: masters
                .keys()
                .map(|&m| (m, ask_basis(ctx, row.id, m)))
                .collect(),
            ledgers: ask_ledgers(ctx, row.id, &row.server, &row.login),
            actions: send::Sending::default().actions,
        };
        let links = ctx.node.links.submit(db::copy::LinksRead(row.id));
        Ok(Some(Early {
            tx,
            signals,
            changes,
            masters,
            first,
            links,
        }))
    }
}

/// Subscribes the session to `topic`: `None` if it was stopped meanwhile.
async fn subscribe(
    ctx: &AccountContext,
    topic: Topic,
    tx: &mpsc::UnboundedSender<Signal>,
) -> anyhow::Result<Option<Subscription>> {
    tokio::select! {
        _ = ctx.cancel.cancelled() => Ok(None),
        s = ctx.node.hub.subscribe(topic, tx.clone()) => match s {
            Some(s) => Ok(Some(s)),
            None => bail!("the notification hub stopped"),
        },
    }
}

/// The logged-in session: its state, then its work until it ends.
async fn follow(
    ctx: &AccountContext,
    row: &AccountRow,
    session: &mut crate::broker::Session,
    early: Option<Early>,
) -> anyhow::Result<Ended> {
    info!(
        balance = session.account.balance,
        "follower logged in (fence raised); reconciling before anything else"
    );
    // Link and row changes are announced; listen before the first read so none is missed.
    let (tx, mut signals, _changes, links, first) = match early {
        Some(e) => {
            let links = links::Links {
                subscriptions: e.masters,
                asked: Some(e.links),
                ..links::Links::default()
            };
            (e.tx, e.signals, e.changes, links, Some(e.first))
        }
        None => {
            let (tx, signals) = mpsc::unbounded_channel();
            let Some(changes) = subscribe(ctx, Topic::Account(row.id), &tx).await? else {
                return Ok(Ended::Stopped);
            };
            (tx, signals, changes, links::Links::default(), None)
        }
    };
    let mut f = Follower {
        ctx,
        id: row.id,
        server: row.server.clone(),
        login: row.login.clone(),
        api: session.api.clone(),
        signals: tx,
        links,
        status: "follower: logged in".into(),
        specs: HashMap::new(),
        pending: PendingCopies {
            unsupported: !session.api.places_orders(),
            offset_ms: crate::wall_clock::server_offset_ms(session.account.server_time_ms)
                .unwrap_or(0),
        },
        funds: Inputs {
            follower_balance: session.account.balance,
            follower_equity: session.account.equity,
            follower_currency: session.account.currency,
            ..Inputs::default()
        },
        master_funds: HashMap::new(),
        max_open_copies: None,
        risk: risk::Guard::default(),
        masters: HashMap::new(),
        index: CopyIndex::default(),
        memory: Memory::default(),
        sending: send::Sending::default(),
        owing: Owing {
            due: false,
            retry: crate::retry::FOLLOWER_RECONCILE.start(),
            at: Instant::now(),
        },
        fills: HashSet::new(),
        ahead: session.ahead.take(),
        first,
        inline_readings: 0,
    };
    let ended = serve(&mut f, session, row, &mut signals).await;
    // The session's ledger rows are in before it ends (and so before the account is released).
    f.finish_ledger().await;
    ended
}

/// The session's work from its first reconcile until it ends.
async fn serve(
    f: &mut Follower<'_>,
    session: &mut crate::broker::Session,
    row: &AccountRow,
    signals: &mut mpsc::UnboundedReceiver<Signal>,
) -> anyhow::Result<Ended> {
    let ctx = f.ctx;
    if f.ahead.is_some() {
        info!(
            "starting from what the prepared login read ahead of the claim: no read of the trade server before the first order"
        );
    }
    if f.ahead.is_some() && session.account.complete() {
        // The fence's reply carried the figures, with the currency and the server's clock.
        f.take_funds(Ok(session.account)).await;
    } else {
        f.report_funds().await;
    }
    // The masters the row named as it was read: subscribed to now, their snapshots and the
    // ledgers asked for before the links are read, so that the first reconcile waits for one
    // turn of the database fewer (a master the links no longer name is dropped with its
    // subscription; one they name anew is read by its reconcile, as any).
    let hinted: HashSet<i64> = row.masters.iter().copied().collect();
    if !f.subscribe_masters(&hinted).await {
        return Ok(Ended::Stopped);
    }
    if f.first.is_none() {
        f.first = Some(FirstReads {
            bases: hinted.iter().map(|&m| (m, f.ask_basis(m))).collect(),
            ledgers: f.ask_ledgers(),
            actions: f.sending.actions,
        });
    }
    if !f.reload_links().await {
        return Ok(Ended::Stopped);
    }
    f.reconcile_all("session start").await;
    // Current at the raise only: what came since is on the stream, and a later reconcile reads.
    f.ahead = None;
    f.first = None;
    ctx.started();
    // A slow reconcile of every master, so a lost last event is repaired too.
    let mut background = spread_interval(ctx.node.reconcile_every);
    let mut links = spread_interval(LINKS_EVERY);
    let mut funds = spread_interval(FUNDS_EVERY);
    let mut risk_check = spread_interval(RISK_EVERY);
    // The periodic reading of the account's figures runs beside the session's work: a slow trade
    // server's answer (hundreds of milliseconds) holds up no copy. Taken when it answers (one at
    // a time), unless an inline reading was made since it was asked for (then only judged by
    // the risk limits).
    let mut reading: Option<Background> = None;
    loop {
        let retry_at = f.owing.at;
        tokio::select! {
            biased;
            _ = ctx.cancel.cancelled() => return Ok(Ended::Stopped),
            _ = ctx.gate.restored() => f.reconcile_all("lease trust restored after a lapse").await,
            event = session.events.recv() => match event {
                Some(SessionEvent::Position(change)) => f.on_position(change).await,
                Some(SessionEvent::Reconnected) => f.reconcile_all("broker reconnected").await,
                Some(SessionEvent::LoginLost(reason)) => bail!("the broker refused the follower's login after a reconnect: {reason}"),
                None => bail!("the broker session ended"),
            },
            signal = signals.recv() => match signal {
                Some(Signal::Notice(n, received)) => f.on_notice(n, received).await,
                Some(Signal::AccountChanged) => {
                    if let Some(new) = ctx.changed_row(row).await {
                        return Ok(Ended::RowChanged(Box::new(new)));
                    }
                    if !f.reload_links().await {
                        return Ok(Ended::Stopped);
                    }
                }
                Some(Signal::Gap) => {
                    if let Some(new) = ctx.changed_row(row).await {
                        return Ok(Ended::RowChanged(Box::new(new)));
                    }
                    // Link changes may have been missed too; every master is reconciled below.
                    if !f.reload_links_only().await {
                        return Ok(Ended::Stopped);
                    }
                    f.reconcile_all("master notifications may have been lost (LISTEN reconnected)").await;
                }
                Some(Signal::FailedOver) => {
                    // The lost tail may have rewound the masters' sequence numbers: what we
                    // remember could make us drop new events as old ones.
                    f.masters.clear();
                    f.reconcile_all("the database failed over (its last commits may be lost)").await;
                }
                Some(Signal::MasterChanged(m)) => f.reconcile_master(m, "the master published (polled)").await,
                // Not subscribed to hand-offs.
                Some(Signal::Handoff(_)) => {}
                None => bail!("the notification hub stopped"),
            },
            _ = tokio::time::sleep_until(retry_at), if f.owing.due && ctx.gate.holds() => f.reconcile_all("retrying an owed reconcile").await,
            _ = links.tick() => {
                if !f.reload_links().await {
                    return Ok(Ended::Stopped);
                }
            }
            _ = background.tick() => f.reconcile_all("background reconcile").await,
            read = async { reading.as_mut().expect("a reading under way").answer.as_mut().await }, if reading.is_some() => {
                let asked = reading.take().expect("a reading under way");
                if asked.inline_readings == f.inline_readings {
                    f.take_funds(read).await;
                } else {
                    f.take_older_funds(read, asked.risk_changes).await;
                }
            }
            _ = risk_check.tick(), if !f.risk.limits.is_empty() || !f.risk.closing.is_empty() => {
                reading.get_or_insert_with(|| f.read_funds());
            }
            _ = funds.tick() => {
                reading.get_or_insert_with(|| f.read_funds());
                let masters: Vec<i64> = f.master_funds.keys().copied().collect();
                for m in masters {
                    f.refresh_master_funds(m).await;
                }
            }
        }
    }
}

impl Follower<'_> {
    /// Takes what the ledger says this follower ever copied, as read with the reconcile's other
    /// reads (R2 then holds whatever history the broker keeps), and records the copies of master
    /// `m` a read shows that have no row yet (an order whose reply was lost, found by its marker).
    fn sync_ledger(
        &mut self,
        m: i64,
        open: &[Position],
        masters: &[MasterPosition],
        copied: Vec<db::copy::ledger::Copied>,
    ) {
        let magics: HashMap<i64, i64> = self.links.list.iter().map(|l| (l.id, l.magic)).collect();
        let mut recorded: HashSet<i64> = HashSet::new();
        for (link_id, master_ticket, ticket, volume) in copied {
            if let Some(magic) = magics.get(&link_id) {
                self.index.mark_ever((*magic, master_ticket));
                // Its ticket too: an MT4 remainder names it (`from #<ticket>`).
                self.index.learn(ticket, (*magic, master_ticket));
                // And what it opened with, whatever history the broker still keeps.
                if let Some(volume) = volume {
                    self.index.learn_opening(ticket, volume);
                }
            }
            recorded.insert(ticket);
        }
        for link in self.links_of(m) {
            for p in open
                .iter()
                .filter(|p| p.magic == link.magic && !recorded.contains(&p.ticket))
            {
                // By its marker, or (an MT4 remainder) by its lineage: recorded too, so that a
                // later owner knows it even once the history no longer shows where it came from.
                let Some(master_ticket) = crate::copier::parse_marker(&p.comment)
                    .or_else(|| self.index.key_of(p.ticket).map(|k| k.1))
                else {
                    continue;
                };
                let order = crate::broker::types::OpenOrder {
                    symbol: p.symbol.clone(),
                    side: p.side,
                    volume: self.index.original_volume(p),
                    sl: None,
                    tp: None,
                    magic: p.magic,
                    comment: p.comment.clone(),
                    client_order_id: None,
                    price_limit: None,
                };
                let source = masters.iter().find(|mp| mp.ticket == master_ticket);
                let record = send::copy_record(
                    &link,
                    master_ticket,
                    &order,
                    p.ticket,
                    p.open_price,
                    source,
                    send::Clocks::default(),
                );
                self.record_copy(&record);
            }
        }
    }

    fn links_of(&self, master: i64) -> Vec<Link> {
        self.links
            .list
            .iter()
            .filter(|l| l.master_id == master)
            .cloned()
            .collect()
    }

    /// Sets the follower's status; while a link does not parse the status names it first, as
    /// an error (`copier-node status` lists the account as in error).
    fn set_status(&mut self, text: &str) {
        self.status = text.to_string();
        if self.links.bad.is_empty() {
            self.ctx.set_status(text);
        } else {
            let problems: Vec<&str> = self.links.bad.iter().map(String::as_str).collect();
            self.ctx
                .set_status(format!("error: {}; {text}", problems.join("; ")));
        }
    }

    /// A reconcile is owed: retried after the backoff, or earlier if one is owed already (a
    /// later failure never pushes an owed retry further out).
    fn owe(&mut self, why: &str) {
        let at = Instant::now() + self.owing.retry.failed();
        if !self.owing.due {
            debug!(why, "reconcile owed");
            self.owing.at = at;
        } else {
            self.owing.at = self.owing.at.min(at);
        }
        self.owing.due = true;
    }

    /// As [`Self::owe`], retried within `at_most` however long the backoff has grown.
    fn owe_within(&mut self, why: &str, at_most: std::time::Duration) {
        self.owe(why);
        self.owing.at = self.owing.at.min(Instant::now() + at_most);
    }

    async fn report_funds(&mut self) {
        // A reading under way beside the work was asked for earlier: its answer would be older
        // than this one's, and is not taken.
        self.inline_readings += 1;
        let read = self.api.account().await;
        self.take_funds(read).await;
    }

    /// Asks the node's reader for master `m`'s snapshot and funds with this follower's late-copy
    /// bases and final decisions (with the node's other followers' reads of the moment: one
    /// batch, a background turn).
    fn ask_basis(&self, m: i64) -> Submitted<Result<db::copy::ReconcileBasis, String>> {
        ask_basis(self.ctx, self.id, m)
    }

    /// Asks the node's reader for what the follower ever copied and placed (one batch, a
    /// background turn).
    fn ask_ledgers(&self) -> Submitted<db::copy::LedgerRows> {
        ask_ledgers(self.ctx, self.id, &self.server, &self.login)
    }

    /// A reading of the account's figures that borrows nothing of the session (taken by
    /// [`Self::take_funds`] when it answers).
    fn read_funds(&self) -> Background {
        let api = self.api.clone();
        Background {
            inline_readings: self.inline_readings,
            risk_changes: self.risk.changes,
            answer: Box::pin(async move { api.account().await }),
        }
    }

    /// Takes the account's figures as read (or as the fence's reply carried them).
    async fn take_funds(&mut self, read: Result<AccountInfo, BrokerError>) {
        // With risk limits, no new copy is decided on figures that could not be read.
        self.funds.risk_unread = read.is_err() && !self.risk.limits.is_empty();
        if let Ok(info) = read {
            if let Some(offset) = crate::wall_clock::server_offset_ms(info.server_time_ms) {
                self.pending.offset_ms = offset;
            }
            self.funds.follower_balance = info.balance;
            self.funds.follower_equity = info.equity;
            self.funds.follower_currency = info.currency.or(self.funds.follower_currency);
            if !self.risk.limits.is_empty() || !self.risk.closing.is_empty() {
                self.judge_risk(&info, Reading::Latest).await;
            }
            self.ctx.status.send(StatusUpdate {
                account_id: self.id,
                epoch: self.ctx.epoch(),
                status: None,
                balance: Some(info.balance),
                equity: Some(info.equity),
                currency: info.currency,
            });
        }
    }

    /// A reading beside the work answered after a newer one was taken inline: its figures are
    /// older and not taken, but a drawdown it saw happened, and counts toward the risk limits
    /// (as they were when it was asked for).
    async fn take_older_funds(&mut self, read: Result<AccountInfo, BrokerError>, asked_at: u64) {
        let Ok(info) = read else { return };
        debug!(
            equity = info.equity,
            "a reading of the account's figures answered after a newer one: judged by the risk limits only"
        );
        if !self.risk.limits.is_empty() {
            self.judge_risk(&info, Reading::Older { asked_at }).await;
        }
    }

    async fn reconcile_all(&mut self, why: &str) {
        self.owing.due = false;
        // The session's first read of its links failed: read again, or this reconcile would
        // skip every master they name.
        if self.links.stale && !self.load_links_only(false).await {
            return;
        }
        if !self.links.removed.is_empty() {
            self.close_removed().await;
        }
        let masters: Vec<i64> = self
            .links
            .list
            .iter()
            .map(|l| l.master_id)
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        if masters.is_empty() {
            self.set_status(if self.links.stale {
                "follower: copy links not read yet (retrying)"
            } else {
                "follower: no copy links"
            });
            return;
        }
        for m in masters {
            self.reconcile_master(m, why).await;
        }
        if !self.owing.due {
            self.owing.retry.reset();
        }
    }

    /// A reconcile of master `m` that could not decide: the snapshot the copies matched is
    /// forgotten (they are not known to match any) and a reconcile of every master is owed.
    fn reconcile_later(&mut self, m: i64, why: &str) {
        self.masters.remove(&m);
        self.owe(why);
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
        if self.specs.is_empty()
            && let Some(ahead) = self.ahead.as_mut()
            && !ahead.symbols.is_empty()
        {
            let list = std::mem::take(&mut ahead.symbols);
            self.specs = list.into_iter().map(|s| (s.symbol.clone(), s)).collect();
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
        // The session's first reads, asked for beside its links, if they hold this master and
        // nothing was carried out since (nothing this session wrote is missing from them).
        let first = self
            .first
            .take()
            .filter(|r| r.actions == self.sending.actions && self.sending.ledger.is_empty())
            .and_then(|mut r| r.bases.remove(&m).map(|b| (b, r.ledgers)));
        let (basis, ledgers) = match first {
            Some(asked) => asked,
            None => {
                // This session's own ledger rows first, so the reads below see them.
                self.flush_ledger().await;
                (self.ask_basis(m), self.ask_ledgers())
            }
        };
        // Read at once (neither waits for the other). Nothing but this session writes the
        // follower's ledgers while it owns the account.
        let (db_read, ledgers) = tokio::join!(
            async { basis.outcome().await.and_then(|read| read) },
            ledgers.outcome()
        );
        let db::copy::ReconcileBasis {
            state,
            master_funds,
            bases,
            decided,
            read_at,
        } = match db_read {
            Ok(x) => x,
            Err(e) => {
                warn!(master_id = m, error = %e, "reconcile could not read the master's snapshot; retrying later");
                return self.reconcile_later(m, "database unavailable");
            }
        };
        if state.as_ref().is_some_and(|s| s.before_failover) {
            // Deciding from it could close copies of positions the master still holds; its
            // owner publishes again after the failover (and that notice reconciles).
            info!(
                master_id = m,
                why,
                "master snapshot written before the database failed over: waiting for its owner to publish again"
            );
            return self.reconcile_later(m, "master snapshot from before the database failover");
        }
        let ledgers = match ledgers {
            Ok(l) => l,
            Err(e) => {
                // Without the ledger a copy the follower closed could look never made: decide
                // nothing until it can be read (and read nothing of the broker for it).
                warn!(master_id = m, error = %e, "reading the copy ledgers failed; nothing is decided until they can be read");
                return self.reconcile_later(m, "copy ledger read failed");
            }
        };
        self.master_funds.insert(m, master_funds);
        self.memory.bases = bases;
        // Decisions recorded by this session whose write failed still count.
        self.memory.decided.extend(decided);
        let (orders, positions, history) = match self.read_broker().await {
            Ok(x) => x,
            Err(e) => {
                warn!(master_id = m, error = %e, "reconcile could not read the follower's positions; retrying later");
                return self.reconcile_later(m, "broker read failed");
            }
        };
        self.index.rebuild_orders(&orders);
        self.index.rebuild(&positions, &history);
        let view = match state {
            Some(s) => (
                MasterView {
                    epoch: s.epoch,
                    seq: s.seq,
                    positions: s.positions,
                    orders: s.orders,
                },
                Some(s.now_ms),
            ),
            None => (
                MasterView {
                    epoch: 0,
                    seq: 0,
                    positions: Vec::new(),
                    orders: Vec::new(),
                },
                None,
            ),
        };
        let (view, now_ms) = view;
        self.sync_ledger(m, &positions, &view.positions, ledgers.copied);
        self.sync_order_copies(m, &orders, ledgers.placed).await;
        // Copy tickets the ledger taught the index may resolve MT4 remainders of this read.
        if self.index.take_learned() {
            self.index.rebuild(&positions, &history);
        }
        let seen: HashSet<i64> = orders
            .iter()
            .map(|o| o.ticket)
            .chain(positions.iter().map(|p| p.ticket))
            .chain(history.iter().map(|h| h.position.ticket))
            .collect();
        self.settle_vanished(m, &seen).await;
        if self.has_equity_stop(m) {
            self.report_funds().await;
        }
        // The database's clock now: the snapshot's read plus the time since (the reads of the
        // follower's broker and ledgers, an early read of a session's start).
        let funds = Inputs {
            now_ms: now_ms.map(|ms| ms + read_at.elapsed().as_millis() as i64),
            ..self.funds_for(m)
        };
        let mut sent = 0;
        let mut follower_open = self.index.open_copies();
        for link in self.links_of(m) {
            let actions = plan(
                &link,
                &view.positions,
                &view.orders,
                &self.index,
                &Situation {
                    memory: &self.memory,
                    funds: &funds,
                    specs: &self.specs,
                    at: (view.epoch, view.seq),
                    pending: self.pending,
                },
            );
            let actions = limit_follower_copies(self.max_open_copies, actions, &mut follower_open);
            for action in actions {
                if action.sends() {
                    sent += 1;
                }
                let source = view
                    .positions
                    .iter()
                    .find(|p| p.ticket == action.master_ticket())
                    .cloned();
                if self.execute(&link, action, source.as_ref(), None).await == Sent::Gated {
                    break;
                }
            }
        }
        let (epoch, seq) = (view.epoch, view.seq);
        self.masters.insert(m, view);
        if sent > 0 {
            info!(master_id = m, why, orders = sent, epoch, seq, "reconciled");
        } else {
            debug!(
                master_id = m,
                why, epoch, seq, "reconciled: nothing to send"
            );
        }
        self.report_master(m, epoch, seq);
    }

    /// The account's status: the master's (epoch, seq) its copies follow now.
    fn report_master(&mut self, m: i64, epoch: i64, seq: i64) {
        self.set_status(&format!(
            "follower: master {m} at epoch {epoch} seq {seq}; {} copies sent",
            self.sending.copies
        ));
    }

    /// True when a link of master `m` stops copying at an equity level, or the follower has risk
    /// limits: its balance and equity are read fresh before deciding on a new copy.
    fn has_equity_stop(&self, m: i64) -> bool {
        !self.risk.limits.is_empty()
            || self
                .links
                .list
                .iter()
                .any(|l| l.master_id == m && l.protections.equity_stop.is_some())
    }

    /// True when a ratio link of master `m` lacks the master's balance or equity.
    fn needs_master_funds(&self, m: i64) -> bool {
        let f = self.master_funds.get(&m).copied().unwrap_or_default();
        self.links.list.iter().any(|l| {
            let (balance, equity) = l.lot_mode.needs_master_funds();
            l.master_id == m && ((balance && f.balance.is_none()) || (equity && f.equity.is_none()))
        })
    }

    async fn refresh_master_funds(&mut self, m: i64) {
        let result = self
            .ctx
            .node
            .db
            .run(async |conn| db::copy::account_funds(&mut *conn, m).await)
            .await;
        if let Ok(funds) = result {
            self.master_funds.insert(m, funds);
        }
    }

    fn funds_for(&self, m: i64) -> Inputs {
        let f = self.master_funds.get(&m).copied().unwrap_or_default();
        Inputs {
            master_balance: f.balance,
            master_equity: f.equity,
            master_currency: f.currency,
            ..self.funds
        }
    }

    async fn on_notice(&mut self, n: std::sync::Arc<MasterNotice>, received: Instant) {
        // When the notice reached the node, on the wall clock the copy ledger's instants use.
        let heard_us = crate::wall_clock::unix_us() - received.elapsed().as_micros() as i64;
        let Some(view) = self.masters.get(&n.master) else {
            if self.links.list.iter().any(|l| l.master_id == n.master) {
                self.reconcile_master(n.master, "event before the first reconcile")
                    .await;
            }
            return;
        };
        let (epoch, seq) = (view.epoch, view.seq);
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
            if (n.epoch != epoch || n.event == MasterEvent::Snapshot)
                && self.take_snapshot(n.master, received, heard_us).await
            {
                return;
            }
            self.reconcile_master(n.master, why).await;
            return;
        }
        let Some(ticket) = event_ticket(&n.event) else {
            return;
        };
        let view = self.masters.get_mut(&n.master).expect("checked above");
        apply_event(&mut view.positions, &mut view.orders, &n.event);
        view.seq = n.seq;
        let is_open = matches!(n.event, MasterEvent::Open { .. });
        self.decide(
            n.master,
            ticket,
            is_open,
            Clock::Event,
            (n.epoch, n.seq),
            received,
            heard_us,
        )
        .await;
    }

    /// Decides the copies of master `m`'s `ticket` as the view now holds it (an event's, or a
    /// snapshot's change taken as its event): from the follower's copies as this session knows
    /// them, without a read of its broker. An open is copied only when `is_open` (the ticket's
    /// position is new); otherwise a copy found owed is left to a reconcile.
    #[allow(clippy::too_many_arguments)]
    async fn decide(
        &mut self,
        m: i64,
        ticket: i64,
        is_open: bool,
        clock: Clock,
        at: (i64, i64),
        received: Instant,
        heard_us: i64,
    ) {
        let Some(view) = self.masters.get(&m) else {
            return;
        };
        let position = view.positions.iter().find(|p| p.ticket == ticket).cloned();
        let order = view.orders.iter().find(|o| o.ticket == ticket).cloned();
        if is_open {
            if self.needs_master_funds(m) {
                self.refresh_master_funds(m).await;
            }
            if self.has_equity_stop(m) {
                self.report_funds().await;
            }
        }
        // An open event is published when the master's session first records the position
        // (its `first_seen_ms`, database clock) and delivered within milliseconds, so the
        // decision's time is that plus how long the event has waited here. Other events carry
        // no clock: a copy they find owed is left to a reconcile, which reads the database's.
        // A snapshot's changes are decided on the clock of its read, as a reconcile's are.
        let now_ms = match clock {
            Clock::Event => position
                .as_ref()
                .and_then(|p| p.first_seen_ms)
                .filter(|_| is_open)
                .map(|seen| seen + received.elapsed().as_millis() as i64),
            Clock::Read(now_ms, read_at) => Some(now_ms + read_at.elapsed().as_millis() as i64),
        };
        let funds = Inputs {
            now_ms,
            ..self.funds_for(m)
        };
        for link in self.links_of(m) {
            let actions = plan_key(
                &link,
                ticket,
                position.as_ref(),
                order.as_ref(),
                &self.index,
                &Situation {
                    memory: &self.memory,
                    funds: &funds,
                    specs: &self.specs,
                    at,
                    pending: self.pending,
                },
            );
            // Live, every open copy counts (a reconcile tells those that are being closed).
            let open_copies = self.index.copies_of_link(link.magic).count()
                + self.index.pending_of_link(link.magic).count();
            let actions = limit_open_copies(&link, actions, open_copies);
            let mut follower_open = self.index.open_copies();
            let actions = limit_follower_copies(self.max_open_copies, actions, &mut follower_open);
            for action in actions {
                if !is_open && matches!(action, Action::Open { .. }) {
                    self.owe("a copy is owed; a reconcile decides it on the database's clock");
                    continue;
                }
                let opens = matches!(action, Action::Open { .. });
                match self
                    .execute(&link, action, position.as_ref(), Some(heard_us))
                    .await
                {
                    Sent::Accepted if opens => self
                        .ctx
                        .node
                        .metrics
                        .copy_latency
                        .observe(received.elapsed().as_secs_f64()),
                    Sent::Gated => break,
                    _ => {}
                }
            }
        }
    }
}

impl Follower<'_> {
    /// A snapshot the master published (a new owner's first, or its owner's after a doubt),
    /// taken at its (epoch, seq) without a reconcile, and true. Where it holds exactly the
    /// positions and orders the copies follow already, there is nothing to decide: a reconcile
    /// would read the follower's broker account for nothing (a master's hand-off would stall
    /// every follower for its reads). Where it differs (the master traded while it moved, or
    /// its old owner's last events were lost), each ticket that differs is decided as its event
    /// would have been ([`Follower::decide`]): from the copies this session knows, which its
    /// broker stream keeps current, so a trade during the move is copied without a read
    /// either. False, and nothing taken, when a reconcile is owed (the session's own view may
    /// be stale), the gate is closed, the snapshot is from before a failover or no newer than
    /// the view, or the read fails: then the caller reconciles.
    async fn take_snapshot(&mut self, m: i64, received: Instant, heard_us: i64) -> bool {
        if self.owing.due || !self.ctx.gate.holds() {
            return false;
        }
        // Read with the other followers' reads of it: every follower of the master takes the
        // same snapshot at about the same time.
        let read = self
            .ctx
            .node
            .master_states
            .write(db::copy::MasterStateRead(m))
            .await
            .and_then(|read| read);
        let read_at = Instant::now();
        let Ok(Some(state)) = read else {
            return false;
        };
        let Some(view) = self.masters.get_mut(&m) else {
            return false;
        };
        let by_ticket = |mut p: Vec<MasterPosition>, mut o: Vec<MasterOrder>| {
            p.sort_by_key(|p| p.ticket);
            o.sort_by_key(|o| o.ticket);
            (p, o)
        };
        if state.before_failover || (state.epoch, state.seq) <= (view.epoch, view.seq) {
            return false;
        }
        let (positions, orders) = by_ticket(state.positions, state.orders);
        let changed = changed_tickets(&view.positions, &view.orders, &positions, &orders);
        let at = (state.epoch, state.seq);
        view.epoch = state.epoch;
        view.seq = state.seq;
        view.positions = positions;
        view.orders = orders;
        self.report_master(m, at.0, at.1);
        if changed.is_empty() {
            debug!(
                master_id = m,
                epoch = at.0,
                seq = at.1,
                "the master's snapshot holds what the copies follow: taken, nothing to reconcile"
            );
            return true;
        }
        info!(
            master_id = m,
            epoch = at.0,
            seq = at.1,
            changed = changed.len(),
            "the master's snapshot differs from what the copies follow: each change decided as its event, without a reconcile"
        );
        for (ticket, is_open) in changed {
            self.decide(
                m,
                ticket,
                is_open,
                Clock::Read(state.now_ms, read_at),
                at,
                received,
                heard_us,
            )
            .await;
        }
        true
    }
}

/// The master ticket an event concerns.
/// The clock a decision's `now_ms` comes from ([`Follower::decide`]).
#[derive(Debug, Clone, Copy)]
enum Clock {
    /// An event's: an open's first record plus how long its notice waited here.
    Event,
    /// A read's: the database clock when the snapshot was read, plus how long ago that was
    /// (the changes of one snapshot are decided one after the other).
    Read(i64, Instant),
}

fn event_ticket(event: &MasterEvent) -> Option<i64> {
    match event {
        MasterEvent::Snapshot => None,
        MasterEvent::Open { position } => Some(position.ticket),
        MasterEvent::OrderSet { order } => Some(order.ticket),
        MasterEvent::Close { ticket }
        | MasterEvent::Partial { ticket, .. }
        | MasterEvent::Modify { ticket, .. }
        | MasterEvent::OrderGone { ticket } => Some(*ticket),
    }
}

impl Follower<'_> {
    /// The follower's pending orders, positions and history, read in that order: a pending copy
    /// that fills between the reads is among the positions (or, closed already, in the history),
    /// never in none of them. A bridge that does not understand the `orders` request (an
    /// `invalid` reply: one older than pending orders) holds none the node placed: the session
    /// then places none either, and copies pending orders from their fills. Any other failure
    /// fails the read (an empty list would hide resting pending copies).
    pub(super) async fn read_broker(
        &mut self,
    ) -> Result<(Vec<PendingOrder>, Vec<Position>, Vec<ClosedPosition>), BrokerError> {
        if let Some(ahead) = self.ahead.take() {
            let ReadAhead {
                orders,
                positions,
                history,
                ..
            } = *ahead;
            return Ok((orders, positions, history));
        }
        let orders = match self.api.orders().await {
            Ok(orders) => orders,
            Err(BrokerError::Rejected(r))
                if r.code == crate::broker::RejectCode::InvalidRequest =>
            {
                if !self.pending.unsupported {
                    info!(reason = %r.reason, "the follower's bridge lists no pending orders: pending orders are copied from their fills, at market");
                    self.pending.unsupported = true;
                }
                Vec::new()
            }
            Err(e) => return Err(e),
        };
        let positions = self.api.positions().await?;
        let history = self.api.history().await?;
        Ok((orders, positions, history))
    }
}

/// Asks the node's reader for master `m`'s snapshot with follower `follower`'s bases and
/// decisions (one batch with the other sessions' asks).
fn ask_basis(
    ctx: &AccountContext,
    follower: i64,
    m: i64,
) -> Submitted<Result<db::copy::ReconcileBasis, String>> {
    ctx.node.reconciles.submit(db::copy::ReconcileRead {
        follower,
        master: m,
    })
}

/// Asks the node's reader for what follower `follower` ever copied and placed on its broker
/// account (one batch, a background turn).
fn ask_ledgers(
    ctx: &AccountContext,
    follower: i64,
    server: &str,
    login: &str,
) -> Submitted<db::copy::LedgerRows> {
    ctx.node.ledger_reads.submit(db::copy::LedgerRead {
        follower,
        server: server.to_string(),
        login: login.to_string(),
    })
}
