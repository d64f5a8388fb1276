//! One logged-in FIX account: the dispatcher that reads what the engine receives, and the
//! [`TradeApi`] the copy engine calls.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::engine::{Engine, EngineConfig, EngineEvent, POLL};
use super::ledger::{Ledger, LedgerError};
use super::msg::{Fields, decimal, parse_utc_timestamp, utc_timestamp};
use super::{FixEndpoint, Updates};
use crate::broker::types::{
    AccountInfo, AmendOrder, CancelOrder, CloseFill, CloseOrder, ClosedBy, ClosedPosition,
    ModifyOrder, OpenFill, OpenOrder, OrderEnd, PendingKind, PendingOrder, PlaceOrder, Position,
    PositionChange, Side, SymbolSpec,
};
use crate::broker::{
    BoxFuture, BrokerError, RejectCode, Rejection, Session, SessionEvent, TradeApi,
};
use crate::model::fix::{self as ledger, Entry, FixOrder, FixPosition, Writer};
use crate::secret::Secret;

pub(super) struct LoginArgs {
    pub endpoint: FixEndpoint,
    pub ledger: std::sync::Arc<dyn Ledger>,
    pub node_id: String,
    pub account_id: i64,
    pub epoch: i64,
    pub login: String,
    pub password: Option<Secret>,
}

/// Where the session is, as the dispatcher sees it.
#[derive(Debug, Clone, PartialEq)]
enum Link {
    Connecting,
    Online,
    /// A Logon was refused, with the venue's reason.
    Refused(String),
    Offline,
}

/// A RequestForPositions' reports, and how many changes the cache had seen when they completed.
type Answer = Result<(Vec<Fields>, u64), String>;

/// A RequestForPositions being answered.
struct Collect {
    expected: Option<usize>,
    reports: Vec<Fields>,
    done: Option<oneshot::Sender<Answer>>,
}

struct Shared {
    endpoint: FixEndpoint,
    /// The account's login at the venue (Account, tag 1, of position requests).
    login: String,
    ledger: std::sync::Arc<dyn Ledger>,
    writer: Writer,
    engine: Engine,
    link: watch::Sender<Link>,
    events: mpsc::UnboundedSender<SessionEvent>,
    next_id: AtomicU64,
    state: Mutex<State>,
    /// Held by every operation that reads positions or sends orders (the API calls, the poll):
    /// one at a time per account, so no answer older than the last applied is applied, and no
    /// status request races an order for the same ClOrdID.
    ops: tokio::sync::Mutex<()>,
    stop: CancellationToken,
}

#[derive(Default)]
struct State {
    /// Contract sizes and rules by symbol, from the SecurityList.
    symbols: HashMap<String, SymbolSpec>,
    /// The account's open positions (volumes in lots).
    positions: BTreeMap<i64, Position>,
    /// Reports awaited by ClOrdID (final states only; also New for the ClOrdIDs in `acks`).
    orders: HashMap<String, oneshot::Sender<Fields>>,
    /// OrderStatusRequest answers awaited by ClOrdID (ExecType I), apart from order reports.
    statuses: HashMap<String, oneshot::Sender<Fields>>,
    /// SecurityList fragments received so far (LastFragment 893=N), by request.
    security_parts: HashMap<String, Vec<(u32, String)>>,
    /// Resting orders being placed: their New acknowledgement is what is awaited.
    acks: HashSet<String>,
    /// The account's resting orders by ClOrdID: what a fill of one closes by (stop or limit).
    resting: HashMap<String, ClosedBy>,
    /// Entry orders (pending copies) by ClOrdID while they may rest or fill: the ticket the copy
    /// engine knows each by, and the marker the position it opens carries.
    entries: HashMap<String, EntryMark>,
    /// Markers of positions entry orders opened, for reads before the ledger has them.
    entry_positions: HashMap<i64, (i64, String)>,
    /// Positions entry orders opened (PosMaintRptID), with the order's ticket the copy engine
    /// knows each by (as MT4/MT5 positions keep their order's ticket).
    aliases: HashMap<i64, i64>,
    /// A background read of the orders and positions is queued (`refresh`), not started yet.
    refresh_queued: bool,
    /// Changes of entry orders placed by others, by ticket, held back while the order is being
    /// recorded in the ledger (how many records are under way, and the changes held): a master
    /// publishes an order only once a later owner can ask the venue how it ended.
    recording: HashMap<i64, (usize, Vec<PositionChange>)>,
    /// OrderMassStatusRequest answers being collected, by MassStatusReqID.
    mass_requests: HashMap<String, Collect>,
    /// The venue refused OrderMassStatusRequest (BusinessMessageReject): the orders read is then
    /// the ledger's entry orders, each asked by OrderStatusRequest.
    mass_unsupported: bool,
    positions_requests: HashMap<String, Collect>,
    security_requests: HashMap<String, oneshot::Sender<Fields>>,
    /// ExecIDs applied (a resent report is applied once).
    exec_ids: HashSet<String>,
    /// PosReqID of the positions subscription, if any.
    subscription: Option<String>,
    /// Fills and reports applied to `positions` so far: a positions answer completed at an
    /// earlier count is older than the cache and must not overwrite it.
    changes: u64,
}

/// What the session knows of an entry order in force.
#[derive(Debug, Clone)]
struct EntryMark {
    ticket: Option<i64>,
    magic: i64,
    comment: String,
}

impl EntryMark {
    fn of(e: &Entry) -> Self {
        EntryMark {
            ticket: e.ticket,
            magic: e.magic,
            comment: e.comment.clone(),
        }
    }
}

/// Entry orders' tickets start here: venues number orders and positions apart, and the copy
/// engine keeps both in one space of tickets (an entry order's fill takes its order's ticket).
/// Below 2^53, so a ticket survives any JSON parser on the way (bridges, dashboards).
const ORDER_TICKETS: i64 = 1 << 52;

/// The copy engine's ticket for the venue's order `order_id` (OrderID, 37, which a
/// cancel/replace keeps): 2^52 plus the number, or plus a hash of an id that is not a number
/// below 2^52.
fn order_ticket(order_id: &str) -> i64 {
    match order_id.parse::<i64>() {
        Ok(n) if (0..ORDER_TICKETS).contains(&n) => ORDER_TICKETS + n,
        _ => {
            let h = order_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            ORDER_TICKETS + (h % (ORDER_TICKETS as u64)) as i64
        }
    }
}

/// Ends the session (logout, engine stopped) when the last API handle goes.
struct SessionApi(Arc<Shared>);

impl Drop for SessionApi {
    fn drop(&mut self) {
        self.0.stop.cancel();
    }
}

fn unavailable(e: impl std::fmt::Display) -> BrokerError {
    BrokerError::Unavailable(e.to_string())
}

fn db_unknown(e: LedgerError) -> BrokerError {
    BrokerError::Unknown(format!("the FIX order ledger: {e}"))
}

pub(super) async fn login(args: LoginArgs) -> Result<Session, BrokerError> {
    let config = EngineConfig {
        host: args.endpoint.host.clone(),
        port: args.endpoint.port,
        sender_comp_id: args
            .endpoint
            .sender
            .clone()
            .unwrap_or_else(|| args.login.clone()),
        target_comp_id: args.endpoint.target.clone(),
        sender_sub_id: args.endpoint.sub.clone(),
        node_id: args.node_id.clone(),
        username: args.login.clone(),
        password: args.password,
        heartbeat_secs: args.endpoint.heartbeat_secs,
        reconnect_secs: 1,
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    // A previous session of this account in this process may still be logging out.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let engine = loop {
        if let Some(engine) = Engine::start(config.clone(), tx.clone()) {
            break engine;
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(unavailable(format!(
                "{}: a previous session of this account is still closing",
                config.identity()
            )));
        }
        tokio::time::sleep(POLL).await;
    };
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (link, mut link_rx) = watch::channel(Link::Connecting);
    let shared = Arc::new(Shared {
        endpoint: args.endpoint,
        login: args.login.clone(),
        ledger: args.ledger,
        writer: Writer {
            account_id: args.account_id,
            node_id: args.node_id,
            epoch: args.epoch,
        },
        engine,
        link,
        events: events_tx,
        // From the clock: a later session of the same owner epoch never repeats an id.
        next_id: AtomicU64::new(crate::wall_clock::unix_ms().max(1) as u64),
        state: Mutex::new(State::default()),
        ops: tokio::sync::Mutex::new(()),
        stop: CancellationToken::new(),
    });
    // The dispatcher holds only a weak reference: the session ends with its last API handle.
    let weak = Arc::downgrade(&shared);
    let stop = shared.stop.clone();
    tokio::spawn(async move {
        let mut ever_online = false;
        loop {
            let event = tokio::select! {
                _ = stop.cancelled() => break,
                e = rx.recv() => match e { Some(e) => e, None => break },
            };
            let Some(shared) = weak.upgrade() else { break };
            shared.on_engine(event, &mut ever_online);
        }
    });
    let api = Arc::new(SessionApi(shared.clone()));
    // Logon: the venue accepts one logon per session identity, so this waits for the previous
    // owner's session to be gone (up to about two heartbeat intervals after it froze).
    let wait = Duration::from_secs(u64::from(shared.endpoint.heartbeat_secs) * 3 + 10);
    let outcome = tokio::time::timeout(wait, async {
        loop {
            match link_rx.borrow_and_update().clone() {
                Link::Online => return Ok(()),
                Link::Refused(why) => return Err(why),
                _ => {}
            }
            if link_rx.changed().await.is_err() {
                return Err("the FIX session ended".to_string());
            }
        }
    })
    .await;
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(why)) => {
            let lower = why.to_ascii_lowercase();
            let code = if lower.contains("password")
                || lower.contains("credential")
                || lower.contains("user")
            {
                RejectCode::InvalidCredentials
            } else {
                RejectCode::Rejected
            };
            return Err(BrokerError::Rejected(Rejection::new(
                code,
                format!("the venue refused the logon: {why}"),
            )));
        }
        Err(_) => {
            return Err(unavailable(format!(
                "{}: no logon within {wait:?}",
                config.identity()
            )));
        }
    }
    info!(session = %config.identity(), account_id = shared.writer.account_id, "FIX session logged on");
    shared.load_symbols().await?;
    if shared.endpoint.updates == Updates::Subscribe {
        shared.subscribe().await?;
    }
    // Resolves orders a previous owner left without an outcome, and fills the position cache.
    {
        let _op = shared.ops.lock().await;
        shared.load_entries().await?;
        shared.read_positions().await?;
    }
    if shared.endpoint.updates == Updates::Poll {
        let weak = Arc::downgrade(&shared);
        let stop = shared.stop.clone();
        let every = shared.endpoint.poll;
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(every) => {}
                }
                let Some(shared) = weak.upgrade() else { break };
                let _op = shared.ops.lock().await;
                if let Err(e) = shared.read_positions().await {
                    debug!(error = %e, "polling FIX positions failed");
                }
            }
        });
    }
    Ok(Session {
        api,
        events: events_rx,
        account: AccountInfo {
            balance: 0.0,
            equity: 0.0,
            currency: None,
            server_time_ms: None,
        },
    })
}

fn side_code(side: Side) -> &'static str {
    match side {
        Side::Buy => "1",
        Side::Sell => "2",
    }
}

fn side_of(code: Option<&str>) -> Option<Side> {
    match code? {
        "1" => Some(Side::Buy),
        "2" => Some(Side::Sell),
        _ => None,
    }
}

fn side_parse(text: &str) -> Side {
    if text == "buy" { Side::Buy } else { Side::Sell }
}

fn side_text(side: Side) -> &'static str {
    match side {
        Side::Buy => "buy",
        Side::Sell => "sell",
    }
}

/// The typed code of a rejection, from OrdRejReason (103) and Text (58).
fn reject_code(reason: Option<i64>, text: &str) -> RejectCode {
    let t = text.to_ascii_lowercase();
    match reason {
        Some(1) => return RejectCode::UnknownSymbol,
        Some(2) => return RejectCode::MarketClosed,
        Some(13) => return RejectCode::InvalidVolume,
        Some(5) => return RejectCode::UnknownTicket,
        _ => {}
    }
    if t.contains("stops") || t.contains("stop price") {
        RejectCode::InvalidStops
    } else if t.contains("no such position") || t.contains("unknown position") {
        RejectCode::UnknownTicket
    } else if t.contains("market closed") || t.contains("market is closed") {
        RejectCode::MarketClosed
    } else if t.contains("requote") || t.contains("off quotes") {
        RejectCode::Requote
    } else if t.contains("margin") || t.contains("money") || t.contains("funds") {
        RejectCode::NoMoney
    } else if t.contains("quantity") || t.contains("volume") {
        RejectCode::InvalidVolume
    } else if t.contains("symbol") {
        RejectCode::UnknownSymbol
    } else {
        RejectCode::Rejected
    }
}

impl Shared {
    fn id(&self, prefix: &str) -> String {
        format!(
            "{prefix}-{}-{}",
            self.writer.epoch,
            self.next_id.fetch_add(1, Ordering::Relaxed)
        )
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("fix session state")
    }

    fn send(&self, msg_type: &str, body: &[(u32, String)]) -> Result<(), BrokerError> {
        match self.engine.send(msg_type, body) {
            Ok(true) => Ok(()),
            Ok(false) => Err(unavailable("the FIX session is not logged on")),
            Err(e) => Err(unavailable(format!(
                "the FIX engine refused a message: {e}"
            ))),
        }
    }

    /// Announces a change, positions under the tickets the copy engine knows them by; held
    /// back, in order, while the order of that ticket is being recorded (`record_foreign`).
    /// Under the state lock, so that changes go out in the order they were made.
    fn emit(&self, change: PositionChange) {
        let mut state = self.state();
        let change = shown_change(&state.aliases, change);
        let ticket = match &change {
            PositionChange::Opened { position } | PositionChange::Modified { position } => {
                position.ticket
            }
            PositionChange::PartiallyClosed { position, .. } => position.ticket,
            PositionChange::Closed { closed } => closed.position.ticket,
            PositionChange::OrderPlaced { order } | PositionChange::OrderChanged { order } => {
                order.ticket
            }
            PositionChange::OrderGone { ticket, .. } => *ticket,
        };
        if let Some((_, held)) = state.recording.get_mut(&ticket) {
            held.push(change);
            return;
        }
        let _ = self.events.send(SessionEvent::Position(change));
    }

    /// Reads the orders and positions in the background (as an API call would), announcing what
    /// changed.
    fn refresh(self: &Arc<Self>) {
        {
            let mut state = self.state();
            if state.refresh_queued {
                return;
            }
            state.refresh_queued = true;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let Some(me) = weak.upgrade() else { return };
            let _op = me.ops.lock().await;
            me.state().refresh_queued = false;
            if let Err(e) = me.read_positions().await {
                debug!(account_id = me.writer.account_id, error = %e, "reading FIX positions after a report failed");
            }
        });
    }

    /// Records entry order `e`, placed by another, in the ledger (fenced: only the owner does),
    /// then announces `change` and whatever changed of the order meanwhile.
    fn record_foreign(self: &Arc<Self>, e: Entry, change: Option<PositionChange>) {
        let ticket = e.ticket.unwrap_or_default();
        {
            let mut state = self.state();
            let slot = state.recording.entry(ticket).or_default();
            slot.0 += 1;
            slot.1.extend(change);
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            let Some(me) = weak.upgrade() else { return };
            // Not recorded (the database failed): the order is not announced (the next read of
            // the orders records it, and what the master publishes then is what a later owner can
            // resolve); its fill or end, if any came meanwhile, still is. Recorded, or not this
            // node's to record: announced.
            let recorded = match me.ledger.record_entry(&me.writer, &e).await {
                Ok(_) => true,
                Err(err) => {
                    warn!(account_id = me.writer.account_id, cl_ord_id = %e.cl_ord_id, error = %err, "recording an entry order placed by another failed: not announced; the next read of the orders records it");
                    false
                }
            };
            let mut state = me.state();
            match state.recording.get_mut(&ticket) {
                Some(slot) if slot.0 > 1 => slot.0 -= 1,
                _ => {
                    let held = state
                        .recording
                        .remove(&ticket)
                        .map(|slot| slot.1)
                        .unwrap_or_default();
                    for change in held {
                        let announces_order = matches!(
                            change,
                            PositionChange::OrderPlaced { .. }
                                | PositionChange::OrderChanged { .. }
                        );
                        if recorded || !announces_order {
                            let _ = me.events.send(SessionEvent::Position(change));
                        }
                    }
                }
            }
        });
    }

    /// A position under the ticket the copy engine knows it by: an entry order's fill carries
    /// the order's ticket, every other position its PosMaintRptID.
    fn shown(&self, mut p: Position) -> Position {
        if let Some(t) = self.state().aliases.get(&p.ticket) {
            p.ticket = *t;
        }
        p
    }

    /// The venue's position id (PosMaintRptID) of the copy engine's `ticket`.
    fn venue_position(&self, ticket: i64) -> i64 {
        self.state()
            .aliases
            .iter()
            .find(|(_, t)| **t == ticket)
            .map_or(ticket, |(p, _)| *p)
    }

    /// Everything the engine reports, in order.
    fn on_engine(self: &Arc<Self>, event: EngineEvent, ever_online: &mut bool) {
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

    fn on_app(self: &Arc<Self>, m: Fields) {
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

    fn on_execution(self: &Arc<Self>, m: Fields) {
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

    /// The contract size of a symbol the venue lists; refused as unknown otherwise.
    fn listed_contract(&self, symbol: &str) -> Result<f64, BrokerError> {
        self.contract(symbol).ok_or_else(|| {
            BrokerError::Rejected(Rejection::new(
                RejectCode::UnknownSymbol,
                format!("unknown symbol {symbol} (not in the venue's SecurityList)"),
            ))
        })
    }

    fn contract(&self, symbol: &str) -> Option<f64> {
        self.state()
            .symbols
            .get(symbol)
            .map(|s| s.contract_size)
            .filter(|c| *c > 0.0)
    }

    /// Applies a fill (ours, or another session's by drop copy) to the cached positions.
    fn apply_fill(&self, m: &Fields) {
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

    /// A PositionReport as a position (volume 0: the position is gone).
    fn position_of_report(&self, m: &Fields) -> Option<Position> {
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
    fn apply_report(&self, now: Position) {
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

    async fn load_symbols(&self) -> Result<(), BrokerError> {
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

    fn subscription_request(&self) -> Vec<(u32, String)> {
        let req = self.id("sub");
        self.state().subscription = Some(req.clone());
        self.positions_request(req, true)
    }

    fn positions_request(&self, req: String, subscribe: bool) -> Vec<(u32, String)> {
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

    async fn subscribe(&self) -> Result<(), BrokerError> {
        let body = self.subscription_request();
        self.send("AN", &body)
    }

    /// RequestForPositions: every open position of the account, as the venue reports them.
    async fn request_positions(&self) -> Result<(Vec<Position>, u64), BrokerError> {
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
    async fn read_positions(&self) -> Result<Vec<Position>, BrokerError> {
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
    async fn mark(&self, mut positions: Vec<Position>) -> Result<Vec<Position>, BrokerError> {
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
    async fn record_seen(&self, positions: &[Position]) -> Result<(), BrokerError> {
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

    /// Writes an order to the ledger before it is sent; refused (nothing to send) when this
    /// node no longer owns the account at its epoch.
    async fn record(&self, order: &FixOrder) -> Result<(), BrokerError> {
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

    /// Places a resting order protecting position `p` (`kind` sl: a stop; tp: a limit) and
    /// waits for the venue to accept it.
    async fn place_resting(
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
    async fn cancel_resting(&self, w: &ledger::Working) -> Result<(), BrokerError> {
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
    async fn cancel_request(
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
    async fn set_stops(
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

    /// Announces what changed between the cache and a read.
    fn announce(&self, before: &BTreeMap<i64, Position>, positions: &[Position]) {
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

    /// OrderStatusRequest for every order of the ledger without an outcome.
    async fn resolve_unresolved(&self) -> Result<(), BrokerError> {
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
    async fn settle(&self, order: &FixOrder) -> Result<Outcome, BrokerError> {
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
    async fn adopt(&self, order: &FixOrder) -> Result<Option<(i64, f64)>, BrokerError> {
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

    async fn order_status(&self, order: &FixOrder) -> Result<Fields, BrokerError> {
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
    async fn complete(&self, order: &FixOrder, m: &Fields) -> Result<Outcome, BrokerError> {
        let outcome = outcome_of(m);
        self.record_outcome(order, &outcome).await?;
        Ok(outcome)
    }

    async fn record_outcome(&self, order: &FixOrder, outcome: &Outcome) -> Result<(), BrokerError> {
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
    async fn send_order(
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
    async fn place(
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

    /// Loads the entry orders in force from the ledger, so that a fill of one (reported on its
    /// own) opens a position under its marker.
    async fn load_entries(&self) -> Result<(), BrokerError> {
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
    async fn settle_entry(&self, e: &Entry, listed: bool) -> Result<Option<Entry>, BrokerError> {
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
    async fn in_force(&self, e: &Entry, ticket: i64) -> Result<Entry, BrokerError> {
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
    async fn record_entry_fill(
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
    async fn venue_orders(&self) -> Result<Option<Vec<Fields>>, BrokerError> {
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
    async fn read_orders(&self) -> Result<Vec<PendingOrder>, BrokerError> {
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
    fn pending_of(&self, e: &Entry) -> Option<PendingOrder> {
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
    async fn entry_of_ticket(&self, ticket: i64) -> Result<Entry, BrokerError> {
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
    fn entry_body(&self, e: &Entry) -> Vec<(u32, String)> {
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

    /// A position from the cache, or (not there) from a fresh read.
    async fn position(&self, ticket: i64) -> Result<Option<Position>, BrokerError> {
        if let Some(p) = self.state().positions.get(&ticket).cloned() {
            return Ok(Some(p));
        }
        let positions = self.read_positions().await?;
        Ok(positions.into_iter().find(|p| p.ticket == ticket))
    }
}

/// Why a RequestForPositions had no complete answer in time, as the venue behaved: the count
/// comes from RequestForPositionsAck (AO) or from TotNumReports (727) on the reports.
fn positions_timeout(c: Option<&Collect>, within: Duration) -> String {
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
fn history_entry(r: FixPosition) -> Option<ClosedPosition> {
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

fn closed_of(p: &Position, volume: f64, remaining: f64) -> ClosedPosition {
    ClosedPosition {
        position: Position {
            volume: round_lots(volume),
            ..p.clone()
        },
        close_price: p.open_price,
        close_time_ms: crate::wall_clock::unix_ms(),
        closed_by: ClosedBy::Manual,
        remaining_volume: round_lots(remaining),
        profit: 0.0,
    }
}

fn round_lots(v: f64) -> f64 {
    (v * 1e8).round() / 1e8
}

/// How an order ended, from its final ExecutionReport.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
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

fn outcome_of(m: &Fields) -> Outcome {
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
                    position, price, ..
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

/// A mass status line of an order still resting (New, partly filled, pending a change).
fn resting_report(m: &Fields) -> bool {
    m.get(39)
        .is_none_or(|s| matches!(s, "0" | "1" | "A" | "E" | "6"))
}

/// `change` with its positions under the tickets the copy engine knows them by (`aliases`: an
/// entry order's fill shows under the order's ticket).
fn shown_change(aliases: &HashMap<i64, i64>, change: PositionChange) -> PositionChange {
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
fn entry_of_report(m: &Fields) -> Option<Entry> {
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

/// The refusal of a cancel or cancel/replace (OrderCancelReject, or a rejecting report): an
/// order the venue no longer has in force (filled, gone, unknown) is an unknown ticket.
fn refusal_of_cancel(report: &Fields, text: String) -> Rejection {
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

fn stale_fence(w: &Writer) -> BrokerError {
    BrokerError::Rejected(Rejection::new(
        RejectCode::StaleFence,
        format!(
            "account {} is no longer owned by this node at epoch {}: the order was not sent",
            w.account_id, w.epoch
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(fields: &[(u32, &str)]) -> Fields {
        Fields(fields.iter().map(|(t, v)| (*t, v.to_string())).collect())
    }

    #[test]
    fn entry_orders_are_read_from_reports_and_numbered_apart_from_positions() {
        assert_eq!(order_ticket("17"), (1 << 52) + 17);
        let other = order_ticket("ORD-9f3a");
        assert!((1 << 52..1 << 53).contains(&other), "{other}");
        assert_eq!(other, order_ticket("ORD-9f3a"), "stable across owners");
        assert!((1 << 52..1 << 53).contains(&order_ticket(&(1i64 << 60).to_string())));
        let stop = report(&[
            (11, "manual-4"),
            (37, "21"),
            (40, "3"),
            (54, "2"),
            (55, "EURUSD"),
            (38, "30000"),
            (99, "1.09"),
            (59, "6"),
            (126, "20261130-00:55:23.456"),
        ]);
        let e = entry_of_report(&stop).expect("an entry order");
        assert_eq!(
            (
                e.order_type.as_str(),
                e.side.as_str(),
                e.price,
                e.quantity,
                e.expiry_ms,
                e.ticket
            ),
            (
                "stop",
                "sell",
                1.09,
                30000.0,
                Some(1_796_000_123_456),
                Some((1 << 52) + 21)
            )
        );
        // A resting order protecting a position (PosMaintRptID) is no entry order, nor is a
        // market order.
        let protective = report(&[(11, "x"), (37, "2"), (40, "2"), (44, "1.1"), (721, "5")]);
        assert!(entry_of_report(&protective).is_none());
        assert!(entry_of_report(&report(&[(11, "y"), (37, "3"), (40, "1")])).is_none());
    }

    /// A positions read that timed out says what the venue sent: nothing, reports without a
    /// count (no AO, no TotNumReports), or fewer reports than counted.
    #[test]
    fn a_positions_timeout_names_what_the_venue_sent() {
        let within = Duration::from_secs(5);
        let collect = |expected: Option<usize>, reports: usize| Collect {
            expected,
            reports: vec![report(&[(35, "AP")]); reports],
            done: None,
        };
        let nothing = positions_timeout(Some(&collect(None, 0)), within);
        assert!(
            nothing.contains("neither a RequestForPositionsAck (AO) nor a PositionReport"),
            "{nothing}"
        );
        let uncounted = positions_timeout(Some(&collect(None, 2)), within);
        assert!(
            uncounted.contains("2 PositionReports without a count")
                && uncounted.contains("no TotNumReports (727)"),
            "{uncounted}"
        );
        let short = positions_timeout(Some(&collect(Some(3), 1)), within);
        assert!(short.starts_with("1 of 3 PositionReports"), "{short}");
    }

    #[test]
    fn final_reports_become_outcomes() {
        let filled = report(&[(39, "2"), (14, "20000"), (6, "1.1001"), (721, "77")]);
        assert_eq!(
            outcome_of(&filled),
            Outcome::Filled {
                position: 77,
                price: 1.1001,
                units: 20000.0
            }
        );
        let partial_then_cancelled = report(&[(39, "4"), (14, "5000"), (6, "1.1"), (721, "78")]);
        assert!(
            matches!(outcome_of(&partial_then_cancelled), Outcome::Filled { units, .. } if units == 5000.0)
        );
        let unfilled = report(&[(39, "4"), (14, "0")]);
        assert!(
            matches!(outcome_of(&unfilled), Outcome::Refused(r) if r.code == RejectCode::Slippage)
        );
        let duplicate = report(&[(39, "8"), (103, "6"), (58, "duplicate ClOrdID")]);
        assert_eq!(outcome_of(&duplicate), Outcome::Duplicate);
        let symbol = report(&[(39, "8"), (103, "1"), (58, "unknown symbol")]);
        assert!(
            matches!(outcome_of(&symbol), Outcome::Refused(r) if r.code == RejectCode::UnknownSymbol)
        );
        let gone = report(&[(39, "8"), (103, "99"), (58, "no such position")]);
        assert!(
            matches!(outcome_of(&gone), Outcome::Refused(r) if r.code == RejectCode::UnknownTicket)
        );
        assert_eq!(reject_code(Some(2), ""), RejectCode::MarketClosed);
        assert_eq!(
            reject_code(Some(99), "Not enough margin"),
            RejectCode::NoMoney
        );
        assert_eq!(reject_code(None, "requote"), RejectCode::Requote);
    }
}
