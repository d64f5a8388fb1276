//! The simulated trade server on the network: one task per connection, one lock around the
//! book, journal and state file, so each request is decided, journaled, persisted and
//! broadcast in one order before its reply is sent.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};

use super::book::{Book, Effects};
use super::journal::{Journal, JournalEntry};
use super::market::Sessions;
use super::store::Store;
use crate::broker::RejectCode;
use crate::broker::protocol::{
    ErrorBody, EventFrame, FEATURE_FENCE, FEATURE_ORDERED_STREAM, HelloResult, HistoryResult,
    OrdersResult, PROTOCOL_VERSION, PositionsResult, ReplyFrame, Request, RequestFrame,
    SymbolsResult,
};
use crate::broker::types::{AccountInfo, Currency};
use crate::broker::types::{CloseOrder, ModifyOrder, OpenOrder, PositionChange};

/// Longest request line accepted (a request is a few hundred bytes).
const MAX_LINE: usize = 64 * 1024;

/// How the server runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: String,
    pub journal: PathBuf,
    pub state: Option<PathBuf>,
    /// Reject logins and orders whose fence is below the highest seen (on by default).
    pub fence_check: bool,
    /// Execute a client order id once, answering a repeat with the first result (on by
    /// default; MT4/MT5 servers do not).
    pub dedupe: bool,
    /// Send each reply before the position updates it caused, to the connection that asked
    /// (off by default: updates first); every other connection has them at once either way.
    pub reply_first: bool,
    /// Balance of a new account.
    pub balance: f64,
    /// Balances of named new accounts (login -> balance), overriding `balance`.
    pub balances: HashMap<String, f64>,
    /// Move prices every this often and trigger stop loss / take profit (off by default:
    /// prices then stay at their defaults).
    pub price_walk: Option<Duration>,
    /// The symbol list: the default symbols under these suffixes (default: bare and `.m`).
    pub symbol_suffixes: Vec<String>,
    /// Contract sizes (units per lot) by base symbol, overriding the defaults.
    pub contract_sizes: HashMap<String, f64>,
    /// Currencies of named accounts (login -> currency); others count in US dollars.
    pub currencies: HashMap<String, Currency>,
    /// Daily trading sessions by base symbol (others trade around the clock): outside them
    /// orders on the symbol are refused with `market closed`.
    pub sessions: HashMap<String, Sessions>,
    /// How far the server's clock runs from UTC: the server time it shows, and the clock its
    /// pending orders' expiries are on.
    pub clock_offset_ms: i64,
    /// How long a `login` takes before it is answered (and takes effect), as a real trade
    /// server's login takes hundreds of milliseconds; other requests on the connection are not
    /// held up by it.
    pub login_delay: Duration,
    /// How long each read (`positions`, `history`, `orders`, `account`, `symbols`) takes
    /// before it is answered (read when answered), as a slow trade server's reads take hundreds
    /// of milliseconds; other requests on the connection are not held up by it.
    pub read_delay: Duration,
    /// Answer a delayed read with the account as it was when the read was asked (journaled
    /// then), as a real trade server's reply is its state when it took the request: a change
    /// made during the delay is not in it. Off: as it is when answered.
    pub reads_as_of_request: bool,
    /// Journal every read too (`action` the read's op, `login` empty for `symbols`), so that
    /// a check can tell from the journal alone what a client read and when.
    pub journal_reads: bool,
    /// Take the `fence` request and list it in `hello` (on by default; off: a bridge that
    /// predates it, answering `invalid`).
    pub fence_request: bool,
    /// MT4's ways: partial closes renumber the remainder and rewrite comments, stop closes
    /// rewrite the history's comment (off by default: MT5's hedging accounts).
    pub mt4: bool,
}

impl ServeOptions {
    pub fn new(listen: impl Into<String>, journal: impl Into<PathBuf>) -> Self {
        ServeOptions {
            listen: listen.into(),
            journal: journal.into(),
            state: None,
            fence_check: true,
            dedupe: true,
            reply_first: false,
            balance: 10_000.0,
            balances: HashMap::new(),
            price_walk: None,
            symbol_suffixes: vec![String::new(), ".m".to_string()],
            contract_sizes: HashMap::new(),
            currencies: HashMap::new(),
            sessions: HashMap::new(),
            clock_offset_ms: 0,
            login_delay: Duration::ZERO,
            read_delay: Duration::ZERO,
            reads_as_of_request: false,
            journal_reads: false,
            fence_request: true,
            mt4: false,
        }
    }
}

struct Core {
    book: Book,
    journal: Journal,
    store: Option<Store>,
    /// login -> connection id -> that connection's outbound lines.
    subscribers: HashMap<String, HashMap<u64, mpsc::UnboundedSender<String>>>,
    /// Send replies before the updates they caused, to the connection that asked: its updates
    /// wait here until its reply is queued (every other connection has them at once).
    reply_first: bool,
    deferred: HashMap<u64, Vec<(String, PositionChange)>>,
    /// The connection whose request is being handled (its updates are the deferred ones).
    requester: u64,
    journal_reads: bool,
}

struct Shared {
    core: Mutex<Core>,
    next_conn: AtomicU64,
    login_delay: Duration,
    /// [`ServeOptions::read_delay`] in microseconds (changed by [`SimBroker::set_read_delay`]).
    read_delay_us: AtomicU64,
    reads_as_of_request: bool,
    fence_request: bool,
    /// While `true`, a fence's raise waits before it is answered ([`SimBroker::hold_fences`]).
    fences_held: tokio::sync::watch::Sender<bool>,
}

/// A running server.
pub struct SimBroker {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl SimBroker {
    /// Binds, loads the state file (if any) and starts serving.
    pub async fn start(options: ServeOptions) -> anyhow::Result<SimBroker> {
        let mut book = Book::new(options.balance, options.fence_check);
        book.set_dedupe(options.dedupe);
        book.set_mt4(options.mt4);
        book.set_clock_offset(options.clock_offset_ms);
        let suffixes: Vec<&str> = options.symbol_suffixes.iter().map(String::as_str).collect();
        book.set_symbols(&suffixes, &options.contract_sizes);
        for (login, balance) in &options.balances {
            book.set_opening_balance(login, *balance);
        }
        for (login, currency) in &options.currencies {
            book.set_currency(login, *currency);
        }
        for (symbol, sessions) in &options.sessions {
            book.market
                .set_sessions(symbol, sessions.clone())
                .map_err(|e| anyhow::anyhow!("--session {symbol}: {e}"))?;
        }
        let store = match &options.state {
            Some(path) => Some(Store::open(path, &mut book)?),
            None => None,
        };
        let journal = Journal::open(&options.journal)
            .with_context(|| format!("opening journal {}", options.journal.display()))?;
        let listener = TcpListener::bind(&options.listen)
            .await
            .with_context(|| format!("binding {}", options.listen))?;
        let addr = listener.local_addr()?;
        info!(%addr, accounts = book.account_count(), clock_offset_ms = options.clock_offset_ms, fence_check = options.fence_check, dedupe = options.dedupe, reply_first = options.reply_first, state = ?options.state, "sim-broker listening on {addr}");
        let shared = Arc::new(Shared {
            core: Mutex::new(Core {
                book,
                journal,
                store,
                subscribers: HashMap::new(),
                reply_first: options.reply_first,
                deferred: HashMap::new(),
                requester: 0,
                journal_reads: options.journal_reads,
            }),
            next_conn: AtomicU64::new(1),
            login_delay: options.login_delay,
            read_delay_us: AtomicU64::new(
                u64::try_from(options.read_delay.as_micros()).unwrap_or(u64::MAX),
            ),
            reads_as_of_request: options.reads_as_of_request,
            fence_request: options.fence_request,
            fences_held: tokio::sync::watch::Sender::new(false),
        });
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            listener,
            shared.clone(),
            options.price_walk,
            shutdown.clone(),
        ));
        Ok(SimBroker {
            addr,
            shared,
            shutdown,
            task,
        })
    }

    /// From now on every read waits `delay` before it is answered (a trade server turning slow
    /// under a running session; reads already waiting keep their delay).
    pub fn set_read_delay(&self, delay: Duration) {
        self.shared.read_delay_us.store(
            u64::try_from(delay.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// While `held`, every fence raised (a prepared login's `fence` request) waits before it is
    /// answered, and in effect; let go, those waiting are answered at once (a trade server slow
    /// to answer one kind of request, for the tests).
    pub fn hold_fences(&self, held: bool) {
        self.shared.fences_held.send_replace(held);
    }

    /// The highest fence `login` has been held with (its logins' and orders'), as the server
    /// knows it now.
    pub fn fence_of(&self, login: &str) -> Option<i64> {
        let core = self.shared.core.lock().expect("core");
        core.book.account(login).and_then(|a| a.fence)
    }

    /// Stops accepting, closes every connection, and waits.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}

async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    price_walk: Option<Duration>,
    shutdown: CancellationToken,
) {
    let tracker = TaskTracker::new();
    if let Some(period) = price_walk {
        tracker.spawn(ticker(shared.clone(), period, shutdown.clone()));
    }
    tracker.spawn(expirer(shared.clone(), shutdown.clone()));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                    tracker.spawn(connection(shared.clone(), stream, id, peer, shutdown.clone()));
                }
                Err(e) => {
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
    info!("sim-broker stopped");
}

/// What the server did on its own (a tick, an expiry, a price set): stored, then streamed.
fn apply_server_changes(
    core: &mut Core,
    events: Vec<(String, PositionChange)>,
    records: &[super::book::Record],
) {
    if let Some(store) = core.store.as_mut()
        && let Err(e) = store.append(records)
    {
        error!(error = %e, "writing the state file failed");
    }
    broadcast(core, events);
}

async fn ticker(shared: Arc<Shared>, period: Duration, shutdown: CancellationToken) {
    let mut interval = tokio::time::interval(period);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = interval.tick() => {}
        }
        let mut core = shared.core.lock().expect("sim-broker state lock");
        let (events, records) = core.book.tick(now_ms());
        apply_server_changes(&mut core, events, &records);
    }
}

/// Drops pending orders at their expiry, with or without a price walk (4 times a second).
async fn expirer(shared: Arc<Shared>, shutdown: CancellationToken) {
    let mut interval = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = interval.tick() => {}
        }
        let mut core = shared.core.lock().expect("sim-broker state lock");
        let (events, records) = core.book.expire(now_ms());
        if records.is_empty() {
            continue;
        }
        apply_server_changes(&mut core, events, &records);
    }
}

async fn connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    id: u64,
    peer: SocketAddr,
    shutdown: CancellationToken,
) {
    let (read, write) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        let mut w = BufWriter::new(write);
        while let Some(line) = rx.recv().await {
            if w.write_all(line.as_bytes()).await.is_err() || w.write_all(b"\n").await.is_err() {
                return;
            }
            // Write whatever else is queued, then flush once.
            while let Ok(more) = rx.try_recv() {
                if w.write_all(more.as_bytes()).await.is_err() || w.write_all(b"\n").await.is_err()
                {
                    return;
                }
            }
            if w.flush().await.is_err() {
                return;
            }
        }
    });
    let mut reader = BufReader::new(read);
    let mut conn = Conn {
        id,
        client: None,
        subscriptions: Arc::new(Mutex::new(HashSet::new())),
        tx: tx.clone(),
    };
    let mut line = String::new();
    // Cancelled when this connection ends or the server stops (its delayed logins end with it).
    let closed = shutdown.child_token();
    loop {
        line.clear();
        let mut limited = (&mut reader).take(MAX_LINE as u64 + 1);
        let read = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = limited.read_line(&mut line) => r,
        };
        match read {
            Ok(0) => break,
            Ok(_) if line.len() > MAX_LINE => {
                let _ = tx.send(invalid(0, "request line too long"));
                break;
            }
            Ok(_) => {
                if line.trim().is_empty() {
                    continue;
                }
                let frame = conn
                    .client
                    .as_ref()
                    .and_then(|_| serde_json::from_str::<RequestFrame>(line.trim_end()).ok());
                let delay = frame
                    .as_ref()
                    .map_or(Duration::ZERO, |f| delay_of(&shared, &f.request));
                let fence_held = *shared.fences_held.borrow()
                    && frame
                        .as_ref()
                        .is_some_and(|f| matches!(f.request, Request::Fence { .. }));
                // A read as of its request: answered now, sent after the delay.
                let as_of_request = shared.reads_as_of_request
                    && frame.is_some_and(|f| read_of(&f.request).is_some());
                if !delay.is_zero() || fence_held {
                    // A slow login or read: answered (and in effect, or read) after the delay,
                    // while the connection's other requests go on; dropped with the connection
                    // or the server.
                    let (shared, mut conn, line) =
                        (shared.clone(), conn.clone(), line.trim_end().to_string());
                    let closed = closed.clone();
                    let now = as_of_request.then(|| handle(&shared, &mut conn, &line));
                    let mut held = shared.fences_held.subscribe();
                    tokio::spawn(async move {
                        let wait = async {
                            tokio::time::sleep(delay).await;
                            if fence_held {
                                let _ = held.wait_for(|held| !held).await;
                            }
                        };
                        tokio::select! {
                            _ = wait => {}
                            _ = closed.cancelled() => return,
                        }
                        let reply = now.unwrap_or_else(|| handle(&shared, &mut conn, &line));
                        let _ = conn.tx.send(reply);
                    });
                    continue;
                }
                let reply = handle(&shared, &mut conn, line.trim_end());
                let mut core = shared.core.lock().expect("sim-broker state lock");
                // Only this connection's own updates were held back (every other connection
                // had them when the change was made: the `ordered_stream` promise).
                let deferred = core.deferred.remove(&id).unwrap_or_default();
                if tx.send(reply).is_err() {
                    break;
                }
                broadcast_where(&mut core, deferred, |c| c == id);
            }
            Err(e) => {
                warn!(%peer, error = %e, "connection read failed");
                break;
            }
        }
    }
    closed.cancel();
    {
        let mut core = shared.core.lock().expect("sim-broker state lock");
        core.deferred.remove(&id);
        for login in conn.subscriptions.lock().expect("subscriptions").iter() {
            if let Some(subs) = core.subscribers.get_mut(login) {
                subs.remove(&id);
            }
        }
    }
    drop(conn);
    drop(tx);
    writer.abort();
}

#[derive(Clone)]
struct Conn {
    id: u64,
    client: Option<String>,
    /// Logins this connection is subscribed to (shared with its delayed logins).
    subscriptions: Arc<Mutex<HashSet<String>>>,
    tx: mpsc::UnboundedSender<String>,
}

fn handle(shared: &Shared, conn: &mut Conn, line: &str) -> String {
    let frame: RequestFrame = match serde_json::from_str(line) {
        Ok(f) => f,
        Err(e) => {
            let id = serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("id").and_then(|i| i.as_u64()))
                .unwrap_or(0);
            return invalid(id, &format!("malformed request: {e}"));
        }
    };
    let id = frame.id;
    let client = match (&frame.request, &conn.client) {
        (Request::Hello { client, protocol }, _) => {
            if *protocol != PROTOCOL_VERSION {
                return invalid(
                    id,
                    &format!(
                        "unsupported protocol {protocol}; this server speaks {PROTOCOL_VERSION}"
                    ),
                );
            }
            if client.trim().is_empty() {
                return invalid(id, "hello needs a client name");
            }
            conn.client = Some(client.clone());
            return ok(
                id,
                &HelloResult {
                    server: format!("copier-node sim-broker {}", env!("CARGO_PKG_VERSION")),
                    protocol: PROTOCOL_VERSION,
                    // A read as of its request may miss a change whose update went out before
                    // its reply: not the `ordered_stream` promise.
                    features: [
                        shared.fence_request.then_some(FEATURE_FENCE),
                        (!shared.reads_as_of_request).then_some(FEATURE_ORDERED_STREAM),
                    ]
                    .into_iter()
                    .flatten()
                    .map(str::to_string)
                    .collect(),
                },
            );
        }
        (_, None) => return invalid(id, "send hello first"),
        (_, Some(c)) => c.clone(),
    };
    // One instant for the request: its journal line's ms and µs are the same clock's reading.
    let now_us = now_us();
    let now = now_us.div_euclid(1000);
    let mut core = shared.core.lock().expect("sim-broker state lock");
    core.requester = conn.id;
    if core.journal_reads
        && let Some((op, login)) = read_of(&frame.request)
    {
        let mut entry = JournalEntry::new(now, login, &client, op);
        entry.ts_us = Some(now_us);
        entry.accepted = true;
        if let Err(e) = core.journal.append(&entry) {
            error!(error = %e, "writing the journal failed");
            return rejected(id, "the server could not write its journal");
        }
    }
    match frame.request {
        Request::Hello { .. } => unreachable!("handled above"),
        Request::Login {
            login,
            password,
            fence,
        } => {
            let effects = core
                .book
                .login(&client, &login, password.as_deref(), fence, now);
            let accepted = effects.result.is_ok();
            let reply = commit(&mut core, id, effects, now_us);
            if accepted {
                core.subscribers
                    .entry(login.clone())
                    .or_default()
                    .insert(conn.id, conn.tx.clone());
                conn.subscriptions
                    .lock()
                    .expect("subscriptions")
                    .insert(login);
            }
            reply
        }
        Request::Fence { .. } if !shared.fence_request => {
            invalid(id, "unknown op fence (this bridge predates it)")
        }
        Request::Fence { login, fence } => {
            if !conn
                .subscriptions
                .lock()
                .expect("subscriptions")
                .contains(&login)
            {
                return rejected(
                    id,
                    &format!("login {login} is not logged in on this connection"),
                );
            }
            let effects = core.book.raise_fence(&client, &login, fence, now);
            commit(&mut core, id, effects, now_us)
        }
        Request::Logout { login } => {
            if let Some(subs) = core.subscribers.get_mut(&login) {
                subs.remove(&conn.id);
            }
            conn.subscriptions
                .lock()
                .expect("subscriptions")
                .remove(&login);
            ok(id, &serde_json::json!({}))
        }
        Request::Positions { login } => match core.book.account(&login) {
            Some(a) => ok(
                id,
                &PositionsResult {
                    positions: a.positions.values().cloned().collect(),
                },
            ),
            None => rejected(id, &format!("unknown login {login}")),
        },
        Request::History { login } => match core.book.account(&login) {
            Some(a) => ok(
                id,
                &HistoryResult {
                    history: a.history.clone(),
                },
            ),
            None => rejected(id, &format!("unknown login {login}")),
        },
        Request::Account { login } => match core
            .book
            .refused(&client, &login, "account")
            .map(|()| core.book.info(&login))
        {
            // A bridge that cannot read the account yet (the fault switch's `account`).
            Err(reason) => rejected(id, &reason),
            Ok(None) => rejected(id, &format!("unknown login {login}")),
            // Its clock: UTC plus its offset (`--utc-offset`).
            Ok(Some(info)) => ok(
                id,
                &AccountInfo {
                    server_time_ms: Some(core.book.server_ms(now_ms())),
                    ..info
                },
            ),
        },
        Request::Refuse {
            login,
            order,
            count,
            reason,
        } => {
            const ORDERS: [&str; 7] = [
                "open", "close", "modify", "place", "amend", "cancel", "account",
            ];
            if !ORDERS.contains(&order.as_str()) {
                return invalid(
                    id,
                    &format!("refuse: unknown order {order:?} ({})", ORDERS.join(", ")),
                );
            }
            core.book.refuse(&login, &order, count, &reason);
            ok(id, &serde_json::json!({}))
        }
        Request::Market { symbol, open } => match core.book.market.switch(&symbol, open) {
            Ok(()) => ok(id, &serde_json::json!({})),
            Err(reason) => invalid(id, &reason),
        },
        Request::Price {
            symbol,
            price,
            variants,
        } => match core.book.market.set_price(&symbol, price, variants) {
            Ok(moved) => {
                // The new price triggers what it reaches (stops, pending orders), as a tick does.
                let (events, records) = core.book.trigger(now);
                apply_server_changes(&mut core, events, &records);
                ok(id, &serde_json::json!({ "symbols": moved }))
            }
            Err(reason) => invalid(id, &reason),
        },
        Request::Orders { login } => match core.book.account(&login) {
            Some(_) => ok(
                id,
                &OrdersResult {
                    orders: core.book.orders(&login),
                },
            ),
            None => rejected(id, &format!("unknown login {login}")),
        },
        Request::Place {
            login,
            fence,
            order,
        } => {
            let effects = core.book.place(&client, &login, fence, &order, now);
            commit(&mut core, id, effects, now_us)
        }
        Request::Amend {
            login,
            fence,
            ticket,
            price,
            sl,
            tp,
            expiry_ms,
            client_order_id,
        } => {
            let effects = core.book.amend(
                &client,
                &login,
                fence,
                ticket,
                (price, sl, tp, expiry_ms),
                &client_order_id,
                now,
            );
            commit(&mut core, id, effects, now_us)
        }
        Request::Cancel {
            login,
            fence,
            ticket,
            client_order_id,
        } => {
            let effects = core
                .book
                .cancel(&client, &login, fence, ticket, &client_order_id, now);
            commit(&mut core, id, effects, now_us)
        }
        Request::Symbols => ok(
            id,
            &SymbolsResult {
                symbols: core.book.symbols(),
            },
        ),
        Request::Open {
            login,
            fence,
            symbol,
            side,
            volume,
            sl,
            tp,
            magic,
            comment,
            client_order_id,
            price_limit,
        } => {
            let order = OpenOrder {
                symbol,
                side,
                volume,
                sl,
                tp,
                magic,
                comment,
                client_order_id,
                price_limit,
            };
            let effects = core.book.open(&client, &login, fence, &order, now);
            commit(&mut core, id, effects, now_us)
        }
        Request::Close {
            login,
            fence,
            ticket,
            volume,
            client_order_id,
        } => {
            let effects = core.book.close(
                &client,
                &login,
                fence,
                &CloseOrder {
                    ticket,
                    volume,
                    client_order_id,
                },
                now,
            );
            commit(&mut core, id, effects, now_us)
        }
        Request::Modify {
            login,
            fence,
            ticket,
            sl,
            tp,
            client_order_id,
        } => {
            let effects = core.book.modify(
                &client,
                &login,
                fence,
                &ModifyOrder {
                    ticket,
                    sl,
                    tp,
                    client_order_id,
                },
                now,
            );
            commit(&mut core, id, effects, now_us)
        }
    }
}

/// How long `request` waits before it is answered: a login the login delay, a read the read
/// delay.
fn delay_of(shared: &Shared, request: &Request) -> Duration {
    match request {
        Request::Login { .. } => shared.login_delay,
        _ if read_of(request).is_some() => {
            Duration::from_micros(shared.read_delay_us.load(Ordering::Relaxed))
        }
        _ => Duration::ZERO,
    }
}

/// A read's op and login (empty for the server's symbols); `None` for any other request.
fn read_of(request: &Request) -> Option<(&'static str, &str)> {
    match request {
        Request::Positions { login } => Some(("positions", login)),
        Request::History { login } => Some(("history", login)),
        Request::Orders { login } => Some(("orders", login)),
        Request::Account { login } => Some(("account", login)),
        Request::Symbols => Some(("symbols", "")),
        _ => None,
    }
}

/// Journals, persists and broadcasts what an operation did, then builds its reply.
fn commit<T: Serialize>(core: &mut Core, id: u64, mut effects: Effects<T>, now_us: i64) -> String {
    if let Some(entry) = effects.journal.as_mut() {
        // The line's instant in microseconds, when it is the request's (the same millisecond).
        if entry.ts_ms == now_us.div_euclid(1000) {
            entry.ts_us = Some(now_us);
        }
    }
    if let Some(entry) = &effects.journal
        && let Err(e) = core.journal.append(entry)
    {
        error!(error = %e, "writing the journal failed");
        return rejected(id, "the server could not write its journal");
    }
    if let Some(store) = core.store.as_mut()
        && let Err(e) = store.append(&effects.records)
    {
        error!(error = %e, path = %store.path().display(), "writing the state file failed");
    }
    if core.reply_first {
        let requester = core.requester;
        broadcast_where(core, effects.events.clone(), |c| c != requester);
        core.deferred
            .entry(requester)
            .or_default()
            .extend(effects.events);
    } else {
        broadcast(core, effects.events);
    }
    match effects.result {
        Ok(result) => ok(id, &result),
        Err(reason) => rejected(id, &reason),
    }
}

fn broadcast(core: &mut Core, events: Vec<(String, PositionChange)>) {
    broadcast_where(core, events, |_| true);
}

/// Pushes `events` to the connections subscribed to their logins that `to` keeps.
fn broadcast_where(
    core: &mut Core,
    events: Vec<(String, PositionChange)>,
    to: impl Fn(u64) -> bool,
) {
    for (login, change) in events {
        let Some(subs) = core.subscribers.get_mut(&login) else {
            continue;
        };
        if !subs.keys().any(|c| to(*c)) {
            continue;
        }
        let frame = EventFrame {
            event: "position".into(),
            login: login.clone(),
            change,
        };
        let line = serde_json::to_string(&frame).expect("event frames serialise");
        subs.retain(|c, tx| !to(*c) || tx.send(line.clone()).is_ok());
    }
}

fn ok<T: Serialize>(id: u64, result: &T) -> String {
    let frame = ReplyFrame {
        id,
        ok: true,
        result: Some(serde_json::to_value(result).expect("results serialise")),
        error: None,
    };
    serde_json::to_string(&frame).expect("replies serialise")
}

fn rejected(id: u64, reason: &str) -> String {
    error_frame(id, "rejected", reason, Some(reject_code(reason)))
}

fn invalid(id: u64, reason: &str) -> String {
    error_frame(id, "invalid", reason, None)
}

/// The protocol's code for one of this server's reasons (every reason it gives starts with one
/// of these phrases; the table test below sends each kind of bad request).
pub fn reject_code(reason: &str) -> RejectCode {
    const CODES: &[(&str, RejectCode)] = &[
        ("unknown symbol", RejectCode::UnknownSymbol),
        ("invalid volume", RejectCode::InvalidVolume),
        ("volume", RejectCode::InvalidVolume),
        ("close volume", RejectCode::InvalidVolume),
        ("invalid stops", RejectCode::InvalidStops),
        ("invalid sl", RejectCode::InvalidStops),
        ("invalid tp", RejectCode::InvalidStops),
        ("price ", RejectCode::Slippage),
        ("market closed", RejectCode::MarketClosed),
        ("not enough money", RejectCode::NoMoney),
        ("requote", RejectCode::Requote),
        ("unknown ticket", RejectCode::UnknownTicket),
        ("stale fence", RejectCode::StaleFence),
        ("invalid credentials", RejectCode::InvalidCredentials),
        ("unknown login", RejectCode::UnknownLogin),
    ];
    CODES
        .iter()
        .find(|(prefix, _)| reason.starts_with(prefix))
        .map(|(_, code)| *code)
        .unwrap_or(RejectCode::Rejected)
}

fn error_frame(id: u64, kind: &str, reason: &str, code: Option<RejectCode>) -> String {
    let frame = ReplyFrame {
        id,
        ok: false,
        result: None,
        error: Some(ErrorBody {
            kind: kind.into(),
            reason: reason.into(),
            code,
        }),
    };
    serde_json::to_string(&frame).expect("replies serialise")
}

/// The server's wall clock in Unix milliseconds: journal timestamps and open/close times, as
/// a trade server stamps them. Never used for lease decisions.
pub fn now_ms() -> i64 {
    crate::wall_clock::unix_ms()
}

/// The same clock in Unix microseconds (the journal's `ts_us`).
pub fn now_us() -> i64 {
    crate::wall_clock::unix_us()
}
