//! The copy engine's data, shared by the copier, the database layer and the notification hub
//! without any of them depending on another for it: master positions and markers, master
//! events ([`events`]) and copy links ([`link`]).

pub mod events;
pub mod fix;
pub mod link;
pub mod named;
pub mod risk;
pub mod trade;

use serde::{Deserialize, Serialize};

use trade::{PendingKind, Side};

/// A master position as published in the master's snapshot and events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MasterPosition {
    pub ticket: i64,
    pub symbol: String,
    pub side: Side,
    /// Volume open now.
    pub volume: f64,
    /// Volume when first recorded (partial closes scale copies against it).
    pub open_volume: f64,
    pub open_price: f64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    /// The master position's magic number (0 for none; snapshots before it was recorded read 0).
    #[serde(default)]
    pub magic: i64,
    /// When a master session first recorded the position, on the database's clock (Unix ms);
    /// `None` until the database stamps it.
    pub first_seen_ms: Option<i64>,
    /// The same instant in microseconds (`None` in snapshots from before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_seen_us: Option<i64>,
    /// When the master's broker filled it, on the broker's clock (Unix ms; `None` when the
    /// broker did not say, or in snapshots from before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_time_ms: Option<i64>,
    /// Units per lot of the symbol on the master's broker (sizing by notional value), when the
    /// master session knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contract_size: Option<f64>,
    /// The master broker's ticket for the position now, when it is not `ticket`: MT4 gives the
    /// remainder of a partial close a new ticket (`from #<old>`), and the position keeps the
    /// ticket it opened under, which its copies' markers name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub broker_ticket: Option<i64>,
}

/// A master's pending (limit or stop) order as published beside its positions. Its fill opens a
/// position under the same ticket, so the copy of the order and the copy of its fill share one
/// marker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MasterOrder {
    pub ticket: i64,
    pub symbol: String,
    pub side: Side,
    pub kind: PendingKind,
    pub price: f64,
    pub volume: f64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    /// When it expires on the master server's clock (`None`: good till cancelled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry_ms: Option<i64>,
    /// The same instant in UTC: the master server's clock less its offset from the node's clock
    /// when the order was first seen (followers add their own server's offset).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expiry_utc_ms: Option<i64>,
    #[serde(default)]
    pub magic: i64,
    /// When a master session first recorded the order (database clock, Unix ms); `None` until the
    /// database stamps it.
    pub first_seen_ms: Option<i64>,
    /// The same instant in microseconds (`None` in snapshots from before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_seen_us: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contract_size: Option<f64>,
}

impl MasterOrder {
    /// The order as a position at its price: what a copy of it is sized and filtered as.
    pub fn as_position(&self) -> MasterPosition {
        MasterPosition {
            ticket: self.ticket,
            symbol: self.symbol.clone(),
            side: self.side,
            volume: self.volume,
            open_volume: self.volume,
            open_price: self.price,
            sl: self.sl,
            tp: self.tp,
            magic: self.magic,
            first_seen_ms: self.first_seen_ms,
            first_seen_us: self.first_seen_us,
            open_time_ms: None,
            contract_size: self.contract_size,
            broker_ticket: None,
        }
    }
}

/// The comment that marks a copy of master ticket `ticket`.
pub fn marker(master_ticket: i64) -> String {
    format!("mc{master_ticket}")
}

/// The master ticket a copy's comment names, if it is a marker.
pub fn parse_marker(comment: &str) -> Option<i64> {
    comment.strip_prefix("mc")?.parse().ok()
}
