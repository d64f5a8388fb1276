//! What a broker session deals in: positions, closed positions, orders, fills, account figures.
//! These are also the wire protocol's JSON shapes (docs/design/bridge-protocol.md).

use serde::{Deserialize, Serialize};

/// Shared with the copy engine's data, where they are defined (`model` depends on nothing).
pub use crate::model::trade::{Currency, PendingKind, Side};

/// An open position. A hedging account keeps the ticket through partial closes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Position {
    pub ticket: i64,
    pub symbol: String,
    pub side: Side,
    pub volume: f64,
    pub open_price: f64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    pub magic: i64,
    pub comment: String,
    /// When the server opened it (Unix milliseconds, the server's clock).
    pub open_time_ms: i64,
}

/// Who closed (part of) a position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClosedBy {
    /// A client order (a node, through the protocol).
    Client,
    /// The stop loss was hit.
    Sl,
    /// The take profit was hit.
    Tp,
    /// A hand order (client `manual`).
    Manual,
}

/// One close (full or partial) in the account's history: the position as it was, with the
/// closed volume as `volume` and what remained open after it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClosedPosition {
    #[serde(flatten)]
    pub position: Position,
    pub close_price: f64,
    pub close_time_ms: i64,
    pub closed_by: ClosedBy,
    /// Volume still open after this close (0 for a full close).
    pub remaining_volume: f64,
    /// Realised profit of this close, in the account currency.
    pub profit: f64,
}

/// Account figures.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AccountInfo {
    pub balance: f64,
    pub equity: f64,
    /// The currency balance and equity count in (`None`: the broker did not say, or said
    /// something that is not a currency code: unknown, never a refused reply).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_currency"
    )]
    pub currency: Option<Currency>,
    /// The trade server's clock when it answered, as it shows it (MT4/MT5 `TimeCurrent()`: the
    /// server's local date and time, written as milliseconds since 1970-01-01 00:00 of that
    /// clock); risk limits' days, weeks and months follow it. `None`: not reported (the node's
    /// UTC clock is used instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_time_ms: Option<i64>,
}

impl AccountInfo {
    /// Figures a session may start from without reading `account`: the currency copies are
    /// converted by and the server's clock pending copies' expiries are shifted by are both
    /// there (the protocol asks them of `account` only; a login's or fence's reply may leave
    /// them out).
    pub fn complete(&self) -> bool {
        self.currency.is_some() && self.server_time_ms.is_some()
    }
}

/// A currency from a broker: a code that is not one (`USDT`, `USc`) reads as unknown, so one odd
/// field never makes a whole reply unreadable.
fn lenient_currency<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Currency>, D::Error> {
    let text: Option<String> = Option::deserialize(d)?;
    Ok(text.and_then(|t| t.parse().ok()))
}

/// A symbol's trading rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SymbolSpec {
    pub symbol: String,
    pub price: f64,
    pub volume_step: f64,
    pub volume_min: f64,
    pub volume_max: f64,
    /// Units of the base per 1.0 lot (100 000 for FX, 100 for gold).
    pub contract_size: f64,
    /// The smallest price change (0.00001 for a five-digit EURUSD; 0: not known).
    #[serde(default)]
    pub point: f64,
    /// The currency a position's profit counts in before the broker converts it (the quote
    /// currency: USD for EURUSD and XAUUSD, JPY for USDJPY); `None`: not known (or not a
    /// currency code).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "lenient_currency"
    )]
    pub profit_currency: Option<Currency>,
}

/// A market order to open a position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenOrder {
    pub symbol: String,
    pub side: Side,
    pub volume: f64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    /// The copy link's magic number (0 for none).
    pub magic: i64,
    /// `mc<masterTicket>` for copies.
    pub comment: String,
    /// Derived from (link, master ticket, action): a bridge that supports it deduplicates.
    pub client_order_id: Option<String>,
    /// The worst price the order may fill at (the most a buy pays, the least a sell gets); the
    /// broker rejects the order rather than fill beyond it. `None`: any price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_limit: Option<f64>,
}

impl OpenOrder {
    /// The position this order opens once filled as `ticket` at `price`.
    pub fn position(&self, ticket: i64, price: f64, open_time_ms: i64) -> Position {
        Position {
            ticket,
            symbol: self.symbol.clone(),
            side: self.side,
            volume: self.volume,
            open_price: price,
            sl: self.sl,
            tp: self.tp,
            magic: self.magic,
            comment: self.comment.clone(),
            open_time_ms,
        }
    }
}

/// Closes all (`volume: None`) or part of a position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CloseOrder {
    pub ticket: i64,
    pub volume: Option<f64>,
    pub client_order_id: Option<String>,
}

/// Sets a position's stop loss and take profit (`None` removes one).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModifyOrder {
    pub ticket: i64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    pub client_order_id: Option<String>,
}

/// The server's answer to an accepted open.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpenFill {
    pub ticket: i64,
    pub price: f64,
    /// The volume opened, when the server says: a FIX venue's fill of an order with a price
    /// limit (IOC) may be partial. Absent: the volume asked (a bridge's open fills in full or
    /// is refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<f64>,
    /// True when the server had already executed this client order id and returned the
    /// original fill instead of opening again.
    #[serde(default)]
    pub duplicate: bool,
}

/// The server's answer to an accepted close.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CloseFill {
    pub ticket: i64,
    pub closed_volume: f64,
    pub remaining_volume: f64,
    pub price: f64,
    #[serde(default)]
    pub duplicate: bool,
}

/// A pending order resting on the server until it fills, is cancelled, or expires.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingOrder {
    pub ticket: i64,
    pub symbol: String,
    pub side: Side,
    pub kind: PendingKind,
    /// The price it fills at or beyond.
    pub price: f64,
    pub volume: f64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    /// When it expires on the server's clock (Unix ms as the server shows it); `None`: good
    /// till cancelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry_ms: Option<i64>,
    pub magic: i64,
    pub comment: String,
    /// When the server placed it (its clock).
    pub placed_ms: i64,
}

/// A pending order to place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlaceOrder {
    pub symbol: String,
    pub side: Side,
    pub kind: PendingKind,
    pub price: f64,
    pub volume: f64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    /// When it expires on the server's clock (absent: good till cancelled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry_ms: Option<i64>,
    pub magic: i64,
    pub comment: String,
    pub client_order_id: Option<String>,
}

impl PlaceOrder {
    /// The order as it rests once placed as `ticket` at `placed_ms` (the server's clock).
    pub fn pending(&self, ticket: i64, placed_ms: i64) -> PendingOrder {
        PendingOrder {
            ticket,
            symbol: self.symbol.clone(),
            side: self.side,
            kind: self.kind,
            price: self.price,
            volume: self.volume,
            sl: self.sl,
            tp: self.tp,
            expiry_ms: self.expiry_ms,
            magic: self.magic,
            comment: self.comment.clone(),
            placed_ms,
        }
    }
}

/// A pending order's new price, stops and expiry (each as given: `None` removes a stop or the
/// expiry).
#[derive(Debug, Clone, PartialEq)]
pub struct AmendOrder {
    pub ticket: i64,
    pub price: f64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    pub expiry_ms: Option<i64>,
    pub client_order_id: Option<String>,
}

/// A pending order to cancel.
#[derive(Debug, Clone, PartialEq)]
pub struct CancelOrder {
    pub ticket: i64,
    pub client_order_id: Option<String>,
}

/// How a pending order left the book.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "end", rename_all = "snake_case")]
pub enum OrderEnd {
    /// Filled: the position it opened (same ticket as the order).
    Filled {
        position: i64,
    },
    Cancelled,
    Expired,
}

/// A change to an account's positions, pushed by the server to every session of that login.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum PositionChange {
    Opened {
        position: Position,
    },
    Modified {
        position: Position,
    },
    /// Part closed: `position` is what remains open.
    PartiallyClosed {
        position: Position,
        closed: ClosedPosition,
    },
    Closed {
        closed: ClosedPosition,
    },
    /// A pending order was placed.
    OrderPlaced {
        order: PendingOrder,
    },
    /// A pending order's price, stops or expiry changed: `order` is what it is now.
    OrderChanged {
        order: PendingOrder,
    },
    /// A pending order left the book (a fill also sends `opened` for its position).
    OrderGone {
        ticket: i64,
        #[serde(flatten)]
        end: OrderEnd,
    },
}

impl PositionChange {
    /// The position's ticket, or the pending order's.
    pub fn ticket(&self) -> i64 {
        match self {
            PositionChange::Opened { position }
            | PositionChange::Modified { position }
            | PositionChange::PartiallyClosed { position, .. } => position.ticket,
            PositionChange::Closed { closed } => closed.position.ticket,
            PositionChange::OrderPlaced { order } | PositionChange::OrderChanged { order } => {
                order.ticket
            }
            PositionChange::OrderGone { ticket, .. } => *ticket,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_odd_currency_reads_as_unknown_never_as_a_refused_reply() {
        let read = |json: &str| serde_json::from_str::<AccountInfo>(json).unwrap().currency;
        assert_eq!(read(r#"{"balance":1,"equity":1,"currency":"USDT"}"#), None);
        assert_eq!(read(r#"{"balance":1,"equity":1,"currency":"USc"}"#), None);
        assert_eq!(read(r#"{"balance":1,"equity":1}"#), None);
        assert_eq!(
            read(r#"{"balance":1,"equity":1,"currency":"EUR"}"#).map(String::from),
            Some("EUR".to_string())
        );
        let spec: SymbolSpec = serde_json::from_str(
            r#"{"symbol":"X","price":1,"volume_step":0.01,"volume_min":0.01,"volume_max":1,"contract_size":1,"profit_currency":"??"}"#,
        )
        .unwrap();
        assert_eq!((spec.profit_currency, spec.point), (None, 0.0));
    }
}
