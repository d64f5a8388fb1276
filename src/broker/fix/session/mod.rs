//! One logged-in FIX account: its state, the login, and the helpers every part shares. The parts
//! each own one concern: [`dispatch`] (what the engine receives), [`positions`] (the positions and
//! the account's history), [`orders`] (orders and their outcomes), [`stops`] (protective resting
//! orders), [`entries`] (entry orders: pending copies), and [`api`] (the [`TradeApi`] the copy
//! engine calls).

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

mod api;
mod dispatch;
mod entries;
mod orders;
mod positions;
mod stops;
#[cfg(test)]
mod tests;

use dispatch::*;
use entries::*;
use orders::*;
use positions::*;

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
        ahead: None,
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

fn stale_fence(w: &Writer) -> BrokerError {
    BrokerError::Rejected(Rejection::new(
        RejectCode::StaleFence,
        format!(
            "account {} is no longer owned by this node at epoch {}: the order was not sent",
            w.account_id, w.epoch
        ),
    ))
}
