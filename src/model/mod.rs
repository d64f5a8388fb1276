//! The copy engine's data, shared by the copier, the database layer and the notification hub
//! without any of them depending on another for it: master positions and markers, master
//! events ([`events`]) and copy links ([`link`]).

pub mod events;
pub(crate) mod link;

use serde::{Deserialize, Serialize};

use crate::broker::types::Side;

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
    /// When the master's broker filled it, on the broker's clock (Unix ms; `None` when the
    /// broker did not say, or in snapshots from before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub open_time_ms: Option<i64>,
    /// Units per lot of the symbol on the master's broker (sizing by notional value), when the
    /// master session knows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contract_size: Option<f64>,
}

/// The comment that marks a copy of master ticket `ticket`.
pub fn marker(master_ticket: i64) -> String {
    format!("mc{master_ticket}")
}

/// The master ticket a copy's comment names, if it is a marker.
pub fn parse_marker(comment: &str) -> Option<i64> {
    comment.strip_prefix("mc")?.parse().ok()
}
