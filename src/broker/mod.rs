//! The broker adapter: the only way the rest of the node reaches a trade server.
//!
//! [`Broker::login`] opens an account session with the account's ownership epoch as its fence
//! (so the server learns a new owner's fence before that owner reconciles) and its credentials
//! when the row has them. A [`Session`] reads positions, history and account figures, sends
//! orders (each carrying the fence, and the client order id, magic number and comment the caller
//! gives), and receives the account's position changes as [`SessionEvent`]s.
//!
//! [`client::BridgeClient`] implements it over the bridge protocol (`docs/design/bridge-protocol.md`);
//! the simulated broker speaks that protocol, and so can a bridge to a real MT4/MT5 terminal or a
//! FIX session.

pub mod client;
pub mod fix;
pub mod protocol;
pub mod types;

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::secret::Secret;
use types::{
    AccountInfo, AmendOrder, CancelOrder, CloseFill, CloseOrder, ClosedPosition, ModifyOrder,
    OpenFill, OpenOrder, PendingOrder, PlaceOrder, Position, PositionChange, SymbolSpec,
};

/// Adapters return boxed futures, so they can be used as trait objects.
pub use crate::future::BoxFuture;

/// Why a broker call failed, and so what the caller may do next.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BrokerError {
    /// The server refused the request and changed nothing: do not retry it blindly (its code
    /// says whether a later attempt may succeed).
    #[error("rejected by the broker: {0}")]
    Rejected(Rejection),
    /// The request may have been executed (the connection dropped after it was sent, or no
    /// reply came in time): find out from positions and history before sending anything again.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    /// Nothing was sent (no connection): safe to try again later.
    #[error("broker unavailable: {0}")]
    Unavailable(String),
}

/// Why a server refused a request, as a closed set: the bridge protocol's `code` (a bridge that
/// sends none, or a code this node does not know, reads as [`RejectCode::Rejected`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectCode {
    /// The symbol does not exist on this server.
    UnknownSymbol,
    /// Volume outside the symbol's minimum, maximum or step (or more than the position holds).
    InvalidVolume,
    /// Stop loss or take profit on the wrong side of the price, or not a price.
    InvalidStops,
    /// The price moved beyond the order's price limit.
    Slippage,
    /// The server offers a new price: try again.
    Requote,
    /// The symbol's market is closed now: try again when it opens.
    MarketClosed,
    /// Not enough free margin.
    NoMoney,
    /// The ticket is not an open position of the account.
    UnknownTicket,
    /// A fence below the highest the server has seen for the login.
    StaleFence,
    /// Login refused: wrong password.
    InvalidCredentials,
    /// The login does not exist on the server.
    UnknownLogin,
    /// The bridge did not understand the request (an `invalid` reply: e.g. a request this
    /// bridge predates).
    InvalidRequest,
    /// Any other refusal: definitive.
    #[serde(other)]
    Rejected,
}

impl RejectCode {
    /// True when the same request may succeed later (the server is not refusing the request
    /// itself, only now): such an open is retried within the link's `max_delay_ms`.
    pub fn transient(self) -> bool {
        matches!(self, RejectCode::Requote | RejectCode::MarketClosed)
    }

    /// The code as the protocol and the skip records spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectCode::UnknownSymbol => "unknown_symbol",
            RejectCode::InvalidVolume => "invalid_volume",
            RejectCode::InvalidStops => "invalid_stops",
            RejectCode::Slippage => "slippage",
            RejectCode::Requote => "requote",
            RejectCode::MarketClosed => "market_closed",
            RejectCode::NoMoney => "no_money",
            RejectCode::UnknownTicket => "unknown_ticket",
            RejectCode::StaleFence => "stale_fence",
            RejectCode::InvalidCredentials => "invalid_credentials",
            RejectCode::UnknownLogin => "unknown_login",
            RejectCode::InvalidRequest => "invalid_request",
            RejectCode::Rejected => "rejected",
        }
    }
}

/// A refusal: its code (what the node decides by) and the server's reason (for people).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub code: RejectCode,
    pub reason: String,
}

impl Rejection {
    pub fn new(code: RejectCode, reason: impl Into<String>) -> Self {
        Rejection {
            code,
            reason: reason.into(),
        }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// What an account session logs in with. `password` never reaches a log line.
#[derive(Debug, Clone)]
pub struct AccountLogin {
    pub login: String,
    pub password: Option<Secret>,
    /// The ownership epoch: sent at login and with every order.
    pub fence: Option<i64>,
    /// The account row's id (the FIX adapter's ledger is kept by it; the bridge ignores it).
    pub account_id: Option<i64>,
}

/// Something that happened to a session outside its own calls.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // position changes are the common case, not the outlier
pub enum SessionEvent {
    /// The account's positions changed (by anyone: this session, another client, the server).
    Position(PositionChange),
    /// The connection dropped and came back; the session is logged in again. Changes may have
    /// been missed meanwhile: reconcile.
    Reconnected,
    /// Logging in again after a reconnect was refused (e.g. a newer owner's fence): the session
    /// is dead and must stop.
    LoginLost(String),
}

/// Orders and reads for one logged-in account.
pub trait TradeApi: Send + Sync {
    fn positions(&self) -> BoxFuture<'_, Result<Vec<Position>, BrokerError>>;
    fn history(&self) -> BoxFuture<'_, Result<Vec<ClosedPosition>, BrokerError>>;
    fn account(&self) -> BoxFuture<'_, Result<AccountInfo, BrokerError>>;
    fn symbols(&self) -> BoxFuture<'_, Result<Vec<SymbolSpec>, BrokerError>>;
    fn open(&self, order: OpenOrder) -> BoxFuture<'_, Result<OpenFill, BrokerError>>;
    fn close(&self, order: CloseOrder) -> BoxFuture<'_, Result<CloseFill, BrokerError>>;
    fn modify(&self, order: ModifyOrder) -> BoxFuture<'_, Result<(), BrokerError>>;
    /// False when the adapter places no pending orders (copies of a master's pending orders are
    /// then made from their fills, at market).
    fn places_orders(&self) -> bool {
        true
    }
    /// The account's pending orders.
    fn orders(&self) -> BoxFuture<'_, Result<Vec<PendingOrder>, BrokerError>>;
    /// Places a pending order; its ticket.
    fn place(&self, order: PlaceOrder) -> BoxFuture<'_, Result<i64, BrokerError>>;
    fn amend(&self, order: AmendOrder) -> BoxFuture<'_, Result<(), BrokerError>>;
    fn cancel(&self, order: CancelOrder) -> BoxFuture<'_, Result<(), BrokerError>>;
    /// Ends the session at the trade server and returns once it has ended there (the adapter
    /// bounds the wait). The account task calls it before its account is released, so that the
    /// next owner's login finds the account's session free: a FIX venue takes one logon per
    /// session identity. Nothing is sent through the api afterwards. The default does nothing:
    /// a bridge session logs out when its last handle is dropped, and a bridge takes a login
    /// while another is open.
    fn logout(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

/// A logged-in account. Dropping every clone of `api` logs it out.
pub struct Session {
    pub api: Arc<dyn TradeApi>,
    pub events: mpsc::UnboundedReceiver<SessionEvent>,
    /// Balance and equity at login.
    pub account: AccountInfo,
    /// What a prepared login read of the account ahead of its claim, current at the raise
    /// ([`PreparedLogin::read_ahead`]); `None` for any other login: the session reads.
    pub ahead: Option<Box<ReadAhead>>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("account", &self.account)
            .finish()
    }
}

/// A login made ahead of a hand-off by the account's next owner: logged in without a fence (so
/// the old owner's orders still pass), its position changes queued, and no way to send an order
/// until [`PreparedLogin::raise`]. Dropping it logs out.
pub trait PreparedLogin: Send {
    /// Reads the account's pending orders, positions, history and the server's symbols while
    /// prepared, and keeps them to be brought current at the raise from the position changes
    /// the login heard meanwhile. Refused with [`RejectCode::InvalidRequest`] by a broker whose
    /// stream could leave them stale at the raise (one that does not promise, in its `hello`,
    /// that every change made before a request reaches the connection before that request's
    /// reply): its session reads after the raise.
    fn read_ahead(&mut self) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async {
            Err(BrokerError::Rejected(Rejection::new(
                RejectCode::InvalidRequest,
                "this broker cannot read an account ahead of its claim",
            )))
        })
    }

    /// Raises the login's fence to `fence` (the new owner's epoch, once its claim committed) and
    /// returns the session; every order of it carries that fence. Once this returns, the
    /// server refuses every order with an older fence (where it checks fences). The session
    /// carries the [`ReadAhead`] brought current, when one was read and the stream is whole.
    fn raise(self: Box<Self>, fence: i64) -> BoxFuture<'static, Result<Session, BrokerError>>;
}

/// An account as a prepared login read it ahead of its claim: its pending orders, positions and
/// history, and the server's symbols. Brought current with [`ReadAhead::apply`] from every
/// position change heard since the login, in order, it is the account as the server holds it
/// after the last of them, whether a change reached the read or not: each change carries the
/// whole position or order it leaves, and a close's history entry is added once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReadAhead {
    pub orders: Vec<PendingOrder>,
    pub positions: Vec<Position>,
    pub history: Vec<ClosedPosition>,
    pub symbols: Vec<SymbolSpec>,
}

impl ReadAhead {
    /// Applies one position change heard on the login's stream.
    pub fn apply(&mut self, change: &PositionChange) {
        match change {
            PositionChange::Opened { position } | PositionChange::Modified { position } => {
                self.put_position(position)
            }
            PositionChange::PartiallyClosed { position, closed } => {
                // MT4 renumbers the remainder: the closed ticket is gone from the open ones.
                self.positions
                    .retain(|p| p.ticket != closed.position.ticket);
                self.put_position(position);
                self.add_history(closed);
            }
            PositionChange::Closed { closed } => {
                self.positions
                    .retain(|p| p.ticket != closed.position.ticket);
                self.add_history(closed);
            }
            PositionChange::OrderPlaced { order } | PositionChange::OrderChanged { order } => {
                match self.orders.iter_mut().find(|o| o.ticket == order.ticket) {
                    Some(o) => *o = order.clone(),
                    None => self.orders.push(order.clone()),
                }
            }
            PositionChange::OrderGone { ticket, .. } => self.orders.retain(|o| o.ticket != *ticket),
        }
    }

    fn put_position(&mut self, position: &Position) {
        match self
            .positions
            .iter_mut()
            .find(|p| p.ticket == position.ticket)
        {
            Some(p) => *p = position.clone(),
            None => self.positions.push(position.clone()),
        }
    }

    /// A close's history entry, unless the read already holds it: one close of a ticket is told
    /// from another by when it happened and what it left open (each close leaves less). A
    /// bridge that lists `ordered_stream` gives a close's event the entry its `history` shows.
    fn add_history(&mut self, closed: &ClosedPosition) {
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let same = |h: &ClosedPosition| {
            h.position.ticket == closed.position.ticket
                && h.close_time_ms == closed.close_time_ms
                && near(h.remaining_volume, closed.remaining_volume)
                && near(h.position.volume, closed.position.volume)
        };
        if !self.history.iter().any(same) {
            self.history.push(closed.clone());
        }
    }
}

/// A trade server the node can log accounts in to.
pub trait Broker: Send + Sync {
    fn login<'a>(
        &'a self,
        account: &'a AccountLogin,
    ) -> BoxFuture<'a, Result<Session, BrokerError>>;

    /// Logs `account` in ahead of a hand-off, without raising its fence (`account.fence` is
    /// ignored). Refused with [`RejectCode::InvalidRequest`] by a broker that cannot: over FIX
    /// one logon per session identity leaves no room for a second, and a bridge whose `hello`
    /// does not list `fence` could not raise it later.
    fn prepare<'a>(
        &'a self,
        _account: &'a AccountLogin,
    ) -> BoxFuture<'a, Result<Box<dyn PreparedLogin>, BrokerError>> {
        Box::pin(async {
            Err(BrokerError::Rejected(Rejection::new(
                RejectCode::InvalidRequest,
                "this broker cannot log an account in ahead of a hand-off",
            )))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use types::Side;

    fn position(ticket: i64, volume: f64) -> Position {
        Position {
            ticket,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume,
            open_price: 1.1,
            sl: None,
            tp: None,
            magic: 7,
            comment: "mc1".into(),
            open_time_ms: 1,
        }
    }

    fn closed(ticket: i64, volume: f64, remaining: f64, at: i64) -> ClosedPosition {
        ClosedPosition {
            position: position(ticket, volume),
            close_price: 1.2,
            close_time_ms: at,
            closed_by: types::ClosedBy::Client,
            remaining_volume: remaining,
            profit: 0.0,
        }
    }

    /// A bridge may tell an MT4 partial close as one change: the closed ticket's part, and the
    /// remainder under a new ticket. The read then holds the remainder alone, and the part once
    /// however often it is heard.
    #[test]
    fn a_renumbered_partial_close_leaves_the_remainder_alone_and_its_part_once() {
        let mut ahead = ReadAhead {
            positions: vec![position(10, 1.0)],
            ..ReadAhead::default()
        };
        let change = PositionChange::PartiallyClosed {
            position: position(11, 0.6),
            closed: closed(10, 0.4, 0.6, 5),
        };
        ahead.apply(&change);
        ahead.apply(&change);
        assert_eq!(ahead.positions, vec![position(11, 0.6)]);
        assert_eq!(ahead.history, vec![closed(10, 0.4, 0.6, 5)]);
        // A second close of the remainder at the same instant is another entry.
        ahead.apply(&PositionChange::Closed {
            closed: closed(11, 0.6, 0.0, 5),
        });
        assert!(ahead.positions.is_empty());
        assert_eq!(ahead.history.len(), 2);
    }
}
