//! What a master publishes: one notice per event on its channel ([`crate::channels::master`]),
//! carrying the master's ownership epoch and the event's sequence number within it.

use serde::{Deserialize, Serialize};

use super::{MasterOrder, MasterPosition};

/// One published event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MasterNotice {
    pub master: i64,
    pub epoch: i64,
    pub seq: i64,
    #[serde(flatten)]
    pub event: MasterEvent,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MasterEvent {
    /// The snapshot changed in a way followers should reconcile to (a session start, a new
    /// epoch, changes seen after a reconnect).
    Snapshot,
    Open {
        position: MasterPosition,
    },
    Close {
        ticket: i64,
    },
    /// Part of a position closed: its volume went from `before` to `after`.
    Partial {
        ticket: i64,
        before: f64,
        after: f64,
    },
    Modify {
        ticket: i64,
        sl: Option<f64>,
        tp: Option<f64>,
    },
    /// A pending order was placed or changed: `order` is what it is now.
    OrderSet {
        order: MasterOrder,
    },
    /// A pending order left the book (filled: its position follows as `open`; cancelled; expired).
    OrderGone {
        ticket: i64,
    },
}

impl MasterEvent {
    pub fn kind(&self) -> &'static str {
        match self {
            MasterEvent::Snapshot => "snapshot",
            MasterEvent::Open { .. } => "open",
            MasterEvent::Close { .. } => "close",
            MasterEvent::Partial { .. } => "partial",
            MasterEvent::Modify { .. } => "modify",
            MasterEvent::OrderSet { .. } => "order_set",
            MasterEvent::OrderGone { .. } => "order_gone",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::trade::Side;

    #[test]
    fn notices_fit_a_notify_payload() {
        let n = MasterNotice {
            master: 17,
            epoch: 123_456_789,
            seq: 42,
            event: MasterEvent::Open {
                position: MasterPosition {
                    ticket: 1_000_001,
                    symbol: "XAUUSD.m".into(),
                    side: Side::Sell,
                    volume: 12.34,
                    open_volume: 12.34,
                    open_price: 2000.123,
                    sl: Some(2010.0),
                    tp: Some(1990.0),
                    magic: 0,
                    first_seen_ms: Some(1_796_000_000_000),
                    first_seen_us: None,
                    open_time_ms: None,
                    contract_size: None,
                    broker_ticket: None,
                },
            },
        };
        let text = serde_json::to_string(&n).unwrap();
        assert!(
            text.len() < 8000,
            "NOTIFY payloads must stay under 8000 bytes"
        );
        assert!(
            text.starts_with(r#"{"master":17,"epoch":123456789,"seq":42,"kind":"open""#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<MasterNotice>(&text).unwrap(), n);
    }
}
