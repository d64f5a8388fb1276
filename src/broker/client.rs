//! The node's side of the bridge protocol: one TCP connection per trade server, shared by every
//! account session of the node on that server (10,000 sessions cost 10,000 map entries and
//! channels, not 10,000 connections).
//!
//! Requests carry an id and wait for the matching reply. A request made while disconnected is
//! not sent ([`BrokerError::Unavailable`]); one in flight when the connection drops, or without a
//! reply in time, has an unknown outcome ([`BrokerError::Unknown`]): the caller finds out from
//! positions and history (or retries with the same client order id, which the server
//! deduplicates) before sending anything new. After a reconnect the client says hello, logs
//! every session in again with its fence, and tells each session it reconnected.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::protocol::{
    FEATURE_FENCE, FEATURE_ORDERED_STREAM, HelloResult, HistoryResult, LoginResult, OrderResult,
    OrdersResult, PROTOCOL_VERSION, PositionsResult, ReplyFrame, Request, RequestFrame,
    ServerFrame, SymbolsResult,
};
use super::types::{
    AccountInfo, AmendOrder, CancelOrder, CloseFill, CloseOrder, ClosedPosition, ModifyOrder,
    OpenFill, OpenOrder, PendingOrder, PlaceOrder, Position, SymbolSpec,
};
use super::{
    AccountLogin, BoxFuture, Broker, BrokerError, PreparedLogin, ReadAhead, RejectCode, Rejection,
    Session, SessionEvent, TradeApi,
};

/// How long a request waits for its reply before its outcome is called unknown.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest server line accepted.
const MAX_LINE: u64 = 16 * 1024 * 1024;

/// A connection to one trade server, shared by many account sessions.
#[derive(Clone)]
pub struct BridgeClient {
    inner: Arc<Inner>,
    /// Closes the connection when the last handle is dropped.
    _close: Arc<CloseOnDrop>,
}

struct CloseOnDrop(CancellationToken);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

impl std::fmt::Debug for BridgeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BridgeClient")
            .field("addr", &self.inner.addr)
            .finish()
    }
}

struct Inner {
    addr: String,
    client_name: String,
    request_timeout: Duration,
    next_id: AtomicU64,
    next_session: AtomicU64,
    state: Mutex<State>,
    /// The bridge's `hello` listed the `fence` request.
    fence_request: AtomicBool,
    /// The bridge's `hello` listed `ordered_stream`: a change made before a request reaches
    /// this connection before that request's reply.
    ordered_stream: AtomicBool,
    ready: watch::Sender<bool>,
    cancel: CancellationToken,
}

#[derive(Default)]
struct State {
    /// Lines for the live connection's writer; `None` while disconnected.
    writer: Option<mpsc::UnboundedSender<String>>,
    /// Hello and re-logins done: ordinary requests may be sent.
    ready: bool,
    pending: HashMap<u64, oneshot::Sender<Result<ReplyFrame, BrokerError>>>,
    sessions: HashMap<u64, SessionEntry>,
    /// Session ids by login: a position event reaches its login's sessions without a scan of
    /// every session on the connection (thousands, under this lock).
    by_login: HashMap<String, Vec<u64>>,
}

struct SessionEntry {
    login: String,
    password: Option<crate::secret::Secret>,
    fence: Option<i64>,
    events: mpsc::UnboundedSender<SessionEvent>,
}

impl BridgeClient {
    /// Starts connecting to `addr` (`host:port`) as `client_name` (the node id, or `manual`).
    /// Returns at once; requests wait for the connection up to the request timeout.
    pub fn connect(addr: impl Into<String>, client_name: impl Into<String>) -> Self {
        Self::with_timeout(addr, client_name, DEFAULT_REQUEST_TIMEOUT)
    }

    pub fn with_timeout(
        addr: impl Into<String>,
        client_name: impl Into<String>,
        request_timeout: Duration,
    ) -> Self {
        let (ready, _) = watch::channel(false);
        let inner = Arc::new(Inner {
            addr: addr.into(),
            client_name: client_name.into(),
            request_timeout,
            next_id: AtomicU64::new(1),
            next_session: AtomicU64::new(1),
            state: Mutex::new(State::default()),
            fence_request: AtomicBool::new(false),
            ordered_stream: AtomicBool::new(false),
            ready,
            cancel: CancellationToken::new(),
        });
        tokio::spawn(connection_loop(
            Arc::downgrade(&inner),
            inner.cancel.clone(),
        ));
        let close = Arc::new(CloseOnDrop(inner.cancel.clone()));
        BridgeClient {
            inner,
            _close: close,
        }
    }

    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// Waits until the connection is up (hello done), at most `within`.
    pub async fn wait_ready(&self, within: Duration) -> Result<(), BrokerError> {
        let mut rx = self.inner.ready.subscribe();
        match tokio::time::timeout(within, rx.wait_for(|r| *r)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(BrokerError::Unavailable(format!(
                "no connection to {} within {within:?}",
                self.inner.addr
            ))),
        }
    }

    /// Sends one request and returns its result (for tools that speak the protocol directly).
    pub async fn call(&self, request: Request) -> Result<serde_json::Value, BrokerError> {
        self.inner.call(request, false).await
    }

    /// Number of live sessions on this connection.
    pub fn session_count(&self) -> usize {
        self.inner
            .state
            .lock()
            .expect("bridge state")
            .sessions
            .len()
    }

    /// Closes the connection for good.
    pub fn close(&self) {
        self.inner.cancel.cancel();
    }
}

impl Broker for BridgeClient {
    fn login<'a>(
        &'a self,
        account: &'a AccountLogin,
    ) -> BoxFuture<'a, Result<Session, BrokerError>> {
        Box::pin(async move {
            self.wait_ready(self.inner.request_timeout).await?;
            let result = self.inner.login(account, account.fence).await?;
            let (id, events) = self.inner.register(account, account.fence);
            let api = Arc::new(SessionApi {
                inner: self.inner.clone(),
                id,
                login: account.login.clone(),
                fence: account.fence,
            });
            Ok(Session {
                api,
                events,
                account: result.account,
                ahead: None,
            })
        })
    }

    fn prepare<'a>(
        &'a self,
        account: &'a AccountLogin,
    ) -> BoxFuture<'a, Result<Box<dyn PreparedLogin>, BrokerError>> {
        Box::pin(async move {
            self.wait_ready(self.inner.request_timeout).await?;
            if !self.inner.fence_request.load(Ordering::Relaxed) {
                return Err(BrokerError::Rejected(Rejection::new(
                    RejectCode::InvalidRequest,
                    format!(
                        "the bridge at {} does not take `fence` requests (not in its hello)",
                        self.inner.addr
                    ),
                )));
            }
            // No fence: the old owner's orders still pass. A reconnect logs in again the same
            // way until the fence is raised.
            self.inner.login(account, None).await?;
            let (id, events) = self.inner.register(account, None);
            Ok(Box::new(PreparedBridge {
                inner: self.inner.clone(),
                id: Some(id),
                login: account.login.clone(),
                events: Some(events),
                ahead: None,
            }) as Box<dyn PreparedLogin>)
        })
    }
}

/// A login of [`Broker::prepare`]: registered with no fence until raised.
struct PreparedBridge {
    inner: Arc<Inner>,
    /// `None` once handed to the raised session.
    id: Option<u64>,
    login: String,
    events: Option<mpsc::UnboundedReceiver<SessionEvent>>,
    /// What [`PreparedLogin::read_ahead`] read, its stream's changes since still to apply.
    ahead: Option<Box<ReadAhead>>,
}

impl Drop for PreparedBridge {
    fn drop(&mut self) {
        if let Some(id) = self.id {
            self.inner.end_session(id, &self.login);
        }
    }
}

impl PreparedLogin for PreparedBridge {
    fn read_ahead(&mut self) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            if !self.inner.ordered_stream.load(Ordering::Relaxed) {
                return Err(BrokerError::Rejected(Rejection::new(
                    RejectCode::InvalidRequest,
                    format!(
                        "the bridge at {} does not promise an ordered stream (`{FEATURE_ORDERED_STREAM}` not in its hello): what it reads ahead could be stale at the claim",
                        self.inner.addr
                    ),
                )));
            }
            let login = || self.login.clone();
            // Read at once: a slow trade server's reads overlap.
            let (orders, positions, history, symbols) = tokio::try_join!(
                self.inner.call(Request::Orders { login: login() }, false),
                self.inner
                    .call(Request::Positions { login: login() }, false),
                self.inner.call(Request::History { login: login() }, false),
                self.inner.call(Request::Symbols, false),
            )?;
            let orders: OrdersResult = decode(orders)?;
            let positions: PositionsResult = decode(positions)?;
            let history: HistoryResult = decode(history)?;
            let symbols: SymbolsResult = decode(symbols)?;
            self.ahead = Some(Box::new(ReadAhead {
                orders: orders.orders,
                positions: positions.positions,
                history: history.history,
                symbols: symbols.symbols,
            }));
            Ok(())
        })
    }

    fn raise(mut self: Box<Self>, fence: i64) -> BoxFuture<'static, Result<Session, BrokerError>> {
        Box::pin(async move {
            let result: LoginResult = decode(
                self.inner
                    .call(
                        Request::Fence {
                            login: self.login.clone(),
                            fence,
                        },
                        false,
                    )
                    .await?,
            )?;
            let id = self.id.take().expect("raised once");
            // What the stream carried while prepared: with a read ahead, the changes bring it
            // current (the fence's reply came after every change made before the fence: the
            // `ordered_stream` promise); a reconnect may have lost some, and the session then
            // reads. Without one, older than the reads the session starts with: dropped, as a
            // fresh login would not have heard it.
            let mut events = self.events.take().expect("raised once");
            let mut ahead = self.ahead.take();
            while let Ok(event) = events.try_recv() {
                match (&mut ahead, event) {
                    (Some(state), SessionEvent::Position(change)) => state.apply(&change),
                    (Some(_), _) => ahead = None,
                    (None, _) => {}
                }
            }
            if let Some(s) = self
                .inner
                .state
                .lock()
                .expect("bridge state")
                .sessions
                .get_mut(&id)
            {
                // A reconnect logs the session in again with the raised fence.
                s.fence = Some(fence);
            }
            let api = Arc::new(SessionApi {
                inner: self.inner.clone(),
                id,
                login: self.login.clone(),
                fence: Some(fence),
            });
            Ok(Session {
                api,
                events,
                account: result.account,
                ahead,
            })
        })
    }
}

impl Inner {
    /// Logs `account` in with `fence` (its own is not used: a prepared login sends none).
    async fn login(
        &self,
        account: &AccountLogin,
        fence: Option<i64>,
    ) -> Result<LoginResult, BrokerError> {
        decode(
            self.call(
                Request::Login {
                    login: account.login.clone(),
                    password: account.password.as_ref().map(|p| p.expose().to_string()),
                    fence,
                },
                false,
            )
            .await?,
        )
    }

    /// Registers a logged-in session (for its events and for logging in again after a
    /// reconnect, with `fence`).
    fn register(
        &self,
        account: &AccountLogin,
        fence: Option<i64>,
    ) -> (u64, mpsc::UnboundedReceiver<SessionEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock().expect("bridge state");
        state.sessions.insert(
            id,
            SessionEntry {
                login: account.login.clone(),
                password: account.password.clone(),
                fence,
                events: tx,
            },
        );
        state
            .by_login
            .entry(account.login.clone())
            .or_default()
            .push(id);
        (id, rx)
    }

    /// Forgets a session; logs its login out when no other session of this connection uses it.
    fn end_session(&self, session: u64, login: &str) {
        let mut state = self.state.lock().expect("bridge state");
        state.sessions.remove(&session);
        let still_used = match state.by_login.get_mut(login) {
            Some(ids) => {
                ids.retain(|id| *id != session);
                !ids.is_empty()
            }
            None => false,
        };
        if !still_used {
            state.by_login.remove(login);
        }
        if !still_used && let Some(writer) = &state.writer {
            // Best effort; the reply is ignored.
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let frame = RequestFrame {
                id,
                request: Request::Logout {
                    login: login.to_string(),
                },
            };
            let _ = writer.send(serde_json::to_string(&frame).expect("requests serialise"));
        }
    }

    /// Sends a request; `internal` requests (hello, re-logins) may go before the connection is
    /// ready.
    async fn call(
        &self,
        request: Request,
        internal: bool,
    ) -> Result<serde_json::Value, BrokerError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let line =
            serde_json::to_string(&RequestFrame { id, request }).expect("requests serialise");
        let (tx, rx) = oneshot::channel();
        {
            let mut state = self.state.lock().expect("bridge state");
            let Some(writer) = state.writer.clone().filter(|_| state.ready || internal) else {
                return Err(BrokerError::Unavailable(format!(
                    "not connected to {}",
                    self.addr
                )));
            };
            state.pending.insert(id, tx);
            if writer.send(line).is_err() {
                state.pending.remove(&id);
                return Err(BrokerError::Unavailable(format!(
                    "not connected to {}",
                    self.addr
                )));
            }
        }
        let reply = match tokio::time::timeout(self.request_timeout, rx).await {
            Ok(Ok(reply)) => reply?,
            Ok(Err(_)) => {
                return Err(BrokerError::Unknown(format!(
                    "connection to {} closed before the reply",
                    self.addr
                )));
            }
            Err(_) => {
                self.state.lock().expect("bridge state").pending.remove(&id);
                return Err(BrokerError::Unknown(format!(
                    "no reply from {} within {:?}",
                    self.addr, self.request_timeout
                )));
            }
        };
        if reply.ok {
            Ok(reply.result.unwrap_or(serde_json::Value::Null))
        } else {
            let (reason, code) = reply
                .error
                .map(|e| {
                    // An `invalid` reply: the bridge did not understand the request.
                    let code = e
                        .code
                        .or((e.kind == "invalid").then_some(RejectCode::InvalidRequest));
                    (e.reason, code)
                })
                .unwrap_or_else(|| ("no reason given".into(), None));
            Err(BrokerError::Rejected(Rejection::new(
                code.unwrap_or(RejectCode::Rejected),
                reason,
            )))
        }
    }

    /// Marks the connection down: every request in flight has an unknown outcome.
    fn disconnected(&self) {
        let pending = {
            let mut state = self.state.lock().expect("bridge state");
            state.writer = None;
            state.ready = false;
            std::mem::take(&mut state.pending)
        };
        self.ready.send_replace(false);
        for (_, tx) in pending {
            let _ = tx.send(Err(BrokerError::Unknown(format!(
                "connection to {} lost before the reply",
                self.addr
            ))));
        }
    }
}

async fn connection_loop(inner: std::sync::Weak<Inner>, cancel: CancellationToken) {
    let mut retry = crate::retry::BROKER_CONNECTION.start();
    let mut connected_before = false;
    loop {
        let Some(client) = inner.upgrade() else {
            return;
        };
        let addr = client.addr.clone();
        let attempt = tokio::select! {
            _ = cancel.cancelled() => return,
            r = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(&addr)) => r,
        };
        match attempt {
            Ok(Ok(stream)) => {
                retry.reset();
                let _ = stream.set_nodelay(true);
                serve_connection(&client, stream, connected_before, &cancel).await;
                connected_before = true;
                client.disconnected();
                if cancel.is_cancelled() {
                    return;
                }
                warn!(broker = %addr, "broker connection lost; reconnecting");
            }
            Ok(Err(e)) => debug!(broker = %addr, error = %e, "broker connection failed"),
            Err(_) => debug!(broker = %addr, "broker connection timed out"),
        }
        drop(client);
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(retry.failed()) => {}
        }
    }
}

/// Runs one connection until it fails: hello, re-login of every session, then traffic.
async fn serve_connection(
    client: &Arc<Inner>,
    stream: TcpStream,
    reconnect: bool,
    cancel: &CancellationToken,
) {
    let (read, mut write) = stream.into_split();
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let writer = tokio::spawn(async move {
        while let Some(line) = rx.recv().await {
            let mut buf = line.into_bytes();
            buf.push(b'\n');
            while let Ok(more) = rx.try_recv() {
                buf.extend_from_slice(more.as_bytes());
                buf.push(b'\n');
            }
            if write.write_all(&buf).await.is_err() {
                return;
            }
        }
    });
    client.state.lock().expect("bridge state").writer = Some(tx);
    let reader = tokio::spawn(read_loop(Arc::downgrade(client), read));

    let setup = async {
        let hello: HelloResult = decode(
            client
                .call(
                    Request::Hello {
                        client: client.client_name.clone(),
                        protocol: PROTOCOL_VERSION,
                    },
                    true,
                )
                .await?,
        )?;
        debug!(broker = %client.addr, server = %hello.server, features = ?hello.features, "connected");
        client.fence_request.store(
            hello.features.iter().any(|f| f == FEATURE_FENCE),
            Ordering::Relaxed,
        );
        client.ordered_stream.store(
            hello.features.iter().any(|f| f == FEATURE_ORDERED_STREAM),
            Ordering::Relaxed,
        );
        // Log every session in again, lowest fence first, so a newer owner's fence wins.
        let mut sessions: Vec<(u64, String, Option<crate::secret::Secret>, Option<i64>)> = client
            .state
            .lock()
            .expect("bridge state")
            .sessions
            .iter()
            .map(|(id, s)| (*id, s.login.clone(), s.password.clone(), s.fence))
            .collect();
        sessions.sort_by_key(|s| s.3);
        for (id, login, password, fence) in sessions {
            let result = client
                .call(
                    Request::Login {
                        login: login.clone(),
                        password: password.map(|p| p.expose().to_string()),
                        fence,
                    },
                    true,
                )
                .await;
            let event = match result {
                Ok(_) => SessionEvent::Reconnected,
                Err(BrokerError::Rejected(r)) => SessionEvent::LoginLost(r.reason),
                Err(e) => return Err(e),
            };
            let state = client.state.lock().expect("bridge state");
            if let Some(s) = state.sessions.get(&id) {
                let _ = s.events.send(event);
            }
        }
        Ok::<(), BrokerError>(())
    };
    match setup.await {
        Ok(()) => {
            client.state.lock().expect("bridge state").ready = true;
            client.ready.send_replace(true);
            if reconnect {
                info!(broker = %client.addr, "broker connection restored; sessions logged in again");
            }
        }
        Err(e) => {
            warn!(broker = %client.addr, error = %e, "broker handshake failed");
            reader.abort();
            writer.abort();
            return;
        }
    }
    tokio::select! {
        _ = cancel.cancelled() => {}
        _ = reader => {}
    }
    writer.abort();
}

async fn read_loop(inner: std::sync::Weak<Inner>, read: tokio::net::tcp::OwnedReadHalf) {
    let mut reader = BufReader::new(read);
    let mut line = String::new();
    loop {
        line.clear();
        match (&mut reader).take(MAX_LINE).read_line(&mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        let frame = match ServerFrame::parse(line.trim_end()) {
            Ok(f) => f,
            Err(e) => {
                warn!(broker = %inner.addr, error = %e, "unreadable line from the broker; ignored");
                continue;
            }
        };
        let mut state = inner.state.lock().expect("bridge state");
        match frame {
            ServerFrame::Reply(reply) => {
                if let Some(tx) = state.pending.remove(&reply.id) {
                    let _ = tx.send(Ok(reply));
                }
            }
            ServerFrame::Event(event) => {
                let state = &*state;
                let ids = state.by_login.get(&event.login).map(Vec::as_slice);
                for s in ids
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|id| state.sessions.get(id))
                {
                    let _ = s.events.send(SessionEvent::Position(event.change.clone()));
                }
            }
        }
    }
}

/// One account's session: every order carries the session's fence.
struct SessionApi {
    inner: Arc<Inner>,
    id: u64,
    login: String,
    fence: Option<i64>,
}

impl Drop for SessionApi {
    fn drop(&mut self) {
        self.inner.end_session(self.id, &self.login);
    }
}

impl TradeApi for SessionApi {
    fn positions(&self) -> BoxFuture<'_, Result<Vec<Position>, BrokerError>> {
        Box::pin(async move {
            let r: PositionsResult = decode(
                self.inner
                    .call(
                        Request::Positions {
                            login: self.login.clone(),
                        },
                        false,
                    )
                    .await?,
            )?;
            Ok(r.positions)
        })
    }

    fn history(&self) -> BoxFuture<'_, Result<Vec<ClosedPosition>, BrokerError>> {
        Box::pin(async move {
            let r: HistoryResult = decode(
                self.inner
                    .call(
                        Request::History {
                            login: self.login.clone(),
                        },
                        false,
                    )
                    .await?,
            )?;
            Ok(r.history)
        })
    }

    fn account(&self) -> BoxFuture<'_, Result<AccountInfo, BrokerError>> {
        Box::pin(async move {
            decode(
                self.inner
                    .call(
                        Request::Account {
                            login: self.login.clone(),
                        },
                        false,
                    )
                    .await?,
            )
        })
    }

    fn symbols(&self) -> BoxFuture<'_, Result<Vec<SymbolSpec>, BrokerError>> {
        Box::pin(async move {
            let r: SymbolsResult = decode(self.inner.call(Request::Symbols, false).await?)?;
            Ok(r.symbols)
        })
    }

    fn open(&self, order: OpenOrder) -> BoxFuture<'_, Result<OpenFill, BrokerError>> {
        Box::pin(async move {
            let request = Request::Open {
                login: self.login.clone(),
                fence: self.fence,
                symbol: order.symbol,
                side: order.side,
                volume: order.volume,
                sl: order.sl,
                tp: order.tp,
                magic: order.magic,
                comment: order.comment,
                client_order_id: order.client_order_id,
                price_limit: order.price_limit,
            };
            decode(self.inner.call(request, false).await?)
        })
    }

    fn close(&self, order: CloseOrder) -> BoxFuture<'_, Result<CloseFill, BrokerError>> {
        Box::pin(async move {
            let request = Request::Close {
                login: self.login.clone(),
                fence: self.fence,
                ticket: order.ticket,
                volume: order.volume,
                client_order_id: order.client_order_id,
            };
            decode(self.inner.call(request, false).await?)
        })
    }

    fn modify(&self, order: ModifyOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let request = Request::Modify {
                login: self.login.clone(),
                fence: self.fence,
                ticket: order.ticket,
                sl: order.sl,
                tp: order.tp,
                client_order_id: order.client_order_id,
            };
            self.inner.call(request, false).await.map(|_| ())
        })
    }

    fn orders(&self) -> BoxFuture<'_, Result<Vec<PendingOrder>, BrokerError>> {
        Box::pin(async move {
            let request = Request::Orders {
                login: self.login.clone(),
            };
            let r: OrdersResult = decode(self.inner.call(request, false).await?)?;
            Ok(r.orders)
        })
    }

    fn place(&self, order: PlaceOrder) -> BoxFuture<'_, Result<i64, BrokerError>> {
        Box::pin(async move {
            let request = Request::Place {
                login: self.login.clone(),
                fence: self.fence,
                order,
            };
            let r: OrderResult = decode(self.inner.call(request, false).await?)?;
            Ok(r.ticket)
        })
    }

    fn amend(&self, order: AmendOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let request = Request::Amend {
                login: self.login.clone(),
                fence: self.fence,
                ticket: order.ticket,
                price: order.price,
                sl: order.sl,
                tp: order.tp,
                expiry_ms: order.expiry_ms,
                client_order_id: order.client_order_id,
            };
            self.inner.call(request, false).await.map(|_| ())
        })
    }

    fn cancel(&self, order: CancelOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let request = Request::Cancel {
                login: self.login.clone(),
                fence: self.fence,
                ticket: order.ticket,
                client_order_id: order.client_order_id,
            };
            self.inner.call(request, false).await.map(|_| ())
        })
    }
}

fn decode<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, BrokerError> {
    // A reply we cannot read is a reply whose effect we do not know.
    serde_json::from_value(value)
        .map_err(|e| BrokerError::Unknown(format!("unreadable reply: {e}")))
}
