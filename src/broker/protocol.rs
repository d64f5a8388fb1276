//! The bridge protocol's frames: one JSON object per line over TCP, in both directions
//! (docs/design/bridge-protocol.md is the reference a bridge implements).

use serde::{Deserialize, Serialize};

use super::RejectCode;
use super::types::{
    AccountInfo, ClosedPosition, PendingOrder, PlaceOrder, Position, PositionChange, Side,
    SymbolSpec,
};

/// Protocol version sent in `hello`.
pub const PROTOCOL_VERSION: u32 = 1;

/// A request from a client. `id` matches the reply; `login` names the account.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestFrame {
    pub id: u64,
    #[serde(flatten)]
    pub request: Request,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// First frame on a connection: who is calling (a node id, or `manual` for hand orders).
    Hello {
        client: String,
        protocol: u32,
    },
    /// Logs an account in on this connection and subscribes the connection to its position
    /// changes. `fence` is the caller's ownership epoch: lower than the highest seen for the
    /// login is refused; higher raises it. `password` is absent for accounts without one.
    Login {
        login: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        password: Option<String>,
        fence: Option<i64>,
    },
    /// Raises the login's fence to `fence` on a connection where the login is logged in (a
    /// prepared hand-off: logged in with no fence while the old owner still trades, raised once
    /// the account is claimed). Refused below the highest fence held; once acknowledged, every
    /// order with an older fence is refused. Only bridges whose `hello` lists the `fence`
    /// feature take it.
    Fence {
        login: String,
        fence: i64,
    },
    /// Ends this connection's subscription to the login.
    Logout {
        login: String,
    },
    Positions {
        login: String,
    },
    History {
        login: String,
    },
    Account {
        login: String,
    },
    Symbols,
    Open {
        login: String,
        fence: Option<i64>,
        symbol: String,
        side: Side,
        volume: f64,
        sl: Option<f64>,
        tp: Option<f64>,
        magic: i64,
        comment: String,
        client_order_id: Option<String>,
        /// The worst price the order may fill at; absent: any price.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        price_limit: Option<f64>,
    },
    Close {
        login: String,
        fence: Option<i64>,
        ticket: i64,
        volume: Option<f64>,
        client_order_id: Option<String>,
    },
    Modify {
        login: String,
        fence: Option<i64>,
        ticket: i64,
        sl: Option<f64>,
        tp: Option<f64>,
        client_order_id: Option<String>,
    },
    /// The account's pending orders.
    Orders {
        login: String,
    },
    /// Places a pending order (its fields beside `login` and `fence` on the wire).
    Place {
        login: String,
        fence: Option<i64>,
        #[serde(flatten)]
        order: PlaceOrder,
    },
    /// Changes a pending order's price, stops and expiry (each as given: `null` removes a stop
    /// or the expiry).
    Amend {
        login: String,
        fence: Option<i64>,
        ticket: i64,
        price: f64,
        sl: Option<f64>,
        tp: Option<f64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        expiry_ms: Option<i64>,
        client_order_id: Option<String>,
    },
    /// Cancels a pending order.
    Cancel {
        login: String,
        fence: Option<i64>,
        ticket: i64,
        client_order_id: Option<String>,
    },
    /// The simulated broker's fault switch (not part of what a bridge implements): refuse the
    /// next `count` orders of kind `order` (`open`, `close`, `modify`, `place`, `amend`,
    /// `cancel`) that nodes send for `login`, with `reason`.
    Refuse {
        login: String,
        order: String,
        count: u32,
        reason: String,
    },
    /// The simulated broker's price switch (not part of what a bridge implements): sets a
    /// symbol's price now (the price walk, if on, moves on from it).
    Price {
        symbol: String,
        price: f64,
        /// Also every suffixed variant of `symbol`, a base symbol (absent: false).
        #[serde(default)]
        variants: bool,
    },
    /// The simulated broker's market switch (not part of what a bridge implements): open
    /// (`true`) or close (`false`) the market of a base symbol and its suffixed variants now,
    /// or hand it back to its trading sessions (`null`).
    Market {
        symbol: String,
        open: Option<bool>,
    },
}

impl Request {
    /// A hand order as a person places it (client `manual`): open `volume` lots of `symbol` at
    /// market, with no fence, stops, magic or comment.
    pub fn hand_open(login: &str, symbol: &str, side: Side, volume: f64) -> Request {
        Request::Open {
            login: login.to_string(),
            fence: None,
            symbol: symbol.to_string(),
            side,
            volume,
            sl: None,
            tp: None,
            magic: 0,
            comment: String::new(),
            client_order_id: None,
            price_limit: None,
        }
    }
}

/// A line from the server: a reply to a request, or a pushed event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
#[allow(clippy::large_enum_variant)] // parsed one line at a time, never stored in bulk
pub enum ServerFrame {
    Reply(ReplyFrame),
    Event(EventFrame),
}

impl ServerFrame {
    /// Parses one line. A reply as the server writes it (`id` first) is parsed straight into
    /// its type: the untagged enum would buffer the whole line and try the variants in turn, and
    /// a follower's copy brings a reply and an event each. Anything else, or a reply that does
    /// not parse so, goes through the enum.
    pub fn parse(line: &str) -> Result<ServerFrame, serde_json::Error> {
        if line.starts_with(r#"{"id":"#)
            && let Ok(reply) = serde_json::from_str::<ReplyFrame>(line)
        {
            return Ok(ServerFrame::Reply(reply));
        }
        if line.starts_with(r#"{"event":"#)
            && let Ok(line) = serde_json::from_str::<EventLine>(line)
            && let Some(event) = line.into_frame()
        {
            return Ok(ServerFrame::Event(event));
        }
        serde_json::from_str(line)
    }
}

/// A position event read in one pass: [`EventFrame`]'s flattened, tagged change would buffer
/// the line twice over (the untagged frame, then the tag), and every copy brings its node an
/// event. The kinds whose body is a position, a closed position or a pending order; anything
/// else (`order_gone`, a kind this node does not know, a body missing) goes through the enum.
#[derive(Deserialize)]
struct EventLine {
    event: String,
    login: String,
    change: String,
    #[serde(default)]
    position: Option<Position>,
    #[serde(default)]
    closed: Option<ClosedPosition>,
    #[serde(default)]
    order: Option<PendingOrder>,
}

impl EventLine {
    fn into_frame(self) -> Option<EventFrame> {
        let change = match (self.change.as_str(), self.position, self.closed, self.order) {
            ("opened", Some(position), None, None) => PositionChange::Opened { position },
            ("modified", Some(position), None, None) => PositionChange::Modified { position },
            ("partially_closed", Some(position), Some(closed), None) => {
                PositionChange::PartiallyClosed { position, closed }
            }
            ("closed", None, Some(closed), None) => PositionChange::Closed { closed },
            ("order_placed", None, None, Some(order)) => PositionChange::OrderPlaced { order },
            ("order_changed", None, None, Some(order)) => PositionChange::OrderChanged { order },
            _ => return None,
        };
        Some(EventFrame {
            event: self.event,
            login: self.login,
            change,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplyFrame {
    pub id: u64,
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// Why a request failed. `rejected`: the server refused it and changed nothing (do not retry
/// blindly); `invalid`: the frame itself was malformed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub kind: String,
    pub reason: String,
    /// What kind of refusal (`rejected` only; absent from bridges that predate it, which then
    /// reads as the definitive `rejected`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<RejectCode>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventFrame {
    pub event: String,
    pub login: String,
    #[serde(flatten)]
    pub change: PositionChange,
}

/// `login` result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoginResult {
    #[serde(flatten)]
    pub account: AccountInfo,
    /// The highest fence the server now holds for the login.
    pub fence: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PositionsResult {
    pub positions: Vec<Position>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrdersResult {
    pub orders: Vec<PendingOrder>,
}

/// The server's answer to a placed, amended or cancelled pending order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OrderResult {
    pub ticket: i64,
    #[serde(default)]
    pub duplicate: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryResult {
    pub history: Vec<ClosedPosition>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SymbolsResult {
    pub symbols: Vec<SymbolSpec>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HelloResult {
    pub server: String,
    pub protocol: u32,
    /// Optional requests this bridge takes (absent from bridges that predate the list): `fence`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

/// The `hello` feature of bridges that take the `fence` request.
pub const FEATURE_FENCE: &str = "fence";

/// The `hello` feature of bridges whose stream is ordered with their replies: every change a
/// bridge made to a login (or learned of) before it answers a request reaches each connection
/// subscribed to the login before that reply. A prepared login then reads ahead of its claim,
/// and the changes up to the fence's reply bring the read current.
pub const FEATURE_ORDERED_STREAM: &str = "ordered_stream";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_the_documented_shape() {
        let frame = RequestFrame {
            id: 7,
            request: Request::Open {
                login: "1001".into(),
                fence: Some(42),
                symbol: "EURUSD".into(),
                side: Side::Buy,
                volume: 0.1,
                sl: None,
                tp: Some(1.2),
                magic: 100001,
                comment: "mc123".into(),
                client_order_id: Some("l1-m123-open".into()),
                price_limit: None,
            },
        };
        let text = serde_json::to_string(&frame).unwrap();
        assert_eq!(
            text,
            r#"{"id":7,"op":"open","login":"1001","fence":42,"symbol":"EURUSD","side":"buy","volume":0.1,"sl":null,"tp":1.2,"magic":100001,"comment":"mc123","client_order_id":"l1-m123-open"}"#
        );
        assert_eq!(serde_json::from_str::<RequestFrame>(&text).unwrap(), frame);
    }

    #[test]
    fn passwords_are_omitted_when_absent() {
        let frame = RequestFrame {
            id: 1,
            request: Request::Login {
                login: "1".into(),
                password: None,
                fence: Some(3),
            },
        };
        assert_eq!(
            serde_json::to_string(&frame).unwrap(),
            r#"{"id":1,"op":"login","login":"1","fence":3}"#
        );
    }

    #[test]
    fn server_frames_tell_replies_from_events() {
        let reply = ServerFrame::parse(
            r#"{"id":3,"ok":false,"error":{"kind":"rejected","reason":"stale fence"}}"#,
        )
        .unwrap();
        // The same reply with its fields in another order, through the enum.
        assert_eq!(
            ServerFrame::parse(
                r#"{"ok":false,"error":{"kind":"rejected","reason":"stale fence"},"id":3}"#
            )
            .unwrap(),
            reply
        );
        let ok = ServerFrame::parse(r#"{"id":4,"ok":true,"result":{"ticket":9}}"#).unwrap();
        let ServerFrame::Reply(ok) = ok else {
            panic!("{ok:?}")
        };
        assert_eq!(ok.result.unwrap()["ticket"], 9);
        assert!(matches!(
            reply,
            ServerFrame::Reply(ReplyFrame {
                id: 3,
                ok: false,
                ..
            })
        ));
        let event = ServerFrame::parse(
            r#"{"event":"position","login":"9","change":"opened","position":{"ticket":5,"symbol":"EURUSD","side":"sell","volume":1.0,"open_price":1.1,"sl":null,"tp":null,"magic":0,"comment":"","open_time_ms":1}}"#,
        )
        .unwrap();
        match event {
            ServerFrame::Event(e) => assert_eq!(e.change.ticket(), 5),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_place_request_carries_the_order_beside_login_and_fence() {
        let line = r#"{"id":4,"op":"place","login":"7","fence":3,"symbol":"EURUSD","side":"buy","kind":"limit","price":1.09,"volume":0.5,"sl":null,"tp":1.12,"magic":2,"comment":"mc9","client_order_id":"p1"}"#;
        let frame: RequestFrame = serde_json::from_str(line).unwrap();
        let Request::Place {
            login,
            fence,
            order,
        } = &frame.request
        else {
            panic!("{frame:?}");
        };
        assert_eq!((login.as_str(), *fence), ("7", Some(3)));
        assert_eq!(
            (
                order.kind,
                order.price,
                order.expiry_ms,
                order.client_order_id.as_deref()
            ),
            (
                crate::broker::types::PendingKind::Limit,
                1.09,
                None,
                Some("p1")
            )
        );
        let back: serde_json::Value = serde_json::to_value(&frame).unwrap();
        assert_eq!(back["price"], 1.09);
        assert_eq!(back["op"], "place");
    }

    /// The one-pass parse reads every change kind exactly as the enum does (and hands what it
    /// does not take, `order_gone`, to the enum).
    #[test]
    fn events_read_in_one_pass_as_the_enum_reads_them() {
        use crate::broker::types::{ClosedBy, OrderEnd, PendingKind};
        let position = Position {
            ticket: 5,
            symbol: "EURUSD".into(),
            side: Side::Sell,
            volume: 1.0,
            open_price: 1.1,
            sl: Some(1.2),
            tp: None,
            magic: 7,
            comment: "mc3".into(),
            open_time_ms: 1,
        };
        let closed = ClosedPosition {
            position: position.clone(),
            close_price: 1.09,
            close_time_ms: 2,
            closed_by: ClosedBy::Client,
            remaining_volume: 0.4,
            profit: 6.0,
        };
        let order = PendingOrder {
            ticket: 8,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            kind: PendingKind::Stop,
            price: 1.2,
            volume: 0.5,
            sl: None,
            tp: None,
            expiry_ms: Some(9),
            magic: 3,
            comment: "mc1".into(),
            placed_ms: 1,
        };
        for change in [
            PositionChange::Opened {
                position: position.clone(),
            },
            PositionChange::Modified {
                position: position.clone(),
            },
            PositionChange::PartiallyClosed {
                position,
                closed: closed.clone(),
            },
            PositionChange::Closed { closed },
            PositionChange::OrderPlaced {
                order: order.clone(),
            },
            PositionChange::OrderChanged { order },
            PositionChange::OrderGone {
                ticket: 8,
                end: OrderEnd::Cancelled,
            },
        ] {
            let frame = EventFrame {
                event: "position".into(),
                login: "9".into(),
                change,
            };
            let line = serde_json::to_string(&frame).unwrap();
            let one_pass = serde_json::from_str::<EventLine>(&line)
                .ok()
                .and_then(EventLine::into_frame);
            if matches!(frame.change, PositionChange::OrderGone { .. }) {
                assert!(one_pass.is_none(), "order_gone goes through the enum");
            } else {
                assert_eq!(one_pass.as_ref(), Some(&frame), "{line}");
            }
            let through_enum: ServerFrame = serde_json::from_str(&line).unwrap();
            assert_eq!(ServerFrame::parse(&line).unwrap(), through_enum, "{line}");
            assert_eq!(through_enum, ServerFrame::Event(frame));
        }
        // A body that does not fit its kind is the enum's to refuse, as before.
        let odd = r#"{"event":"position","login":"9","change":"opened"}"#;
        assert!(ServerFrame::parse(odd).is_err());
    }

    #[test]
    fn pending_order_events_round_trip_through_the_stream() {
        use crate::broker::types::{OrderEnd, PendingKind};
        let order = PendingOrder {
            ticket: 8,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            kind: PendingKind::Limit,
            price: 1.09,
            volume: 0.5,
            sl: None,
            tp: Some(1.12),
            expiry_ms: None,
            magic: 3,
            comment: "mc1".into(),
            placed_ms: 1,
        };
        for change in [
            PositionChange::OrderPlaced {
                order: order.clone(),
            },
            PositionChange::OrderChanged { order },
            PositionChange::OrderGone {
                ticket: 8,
                end: OrderEnd::Filled { position: 8 },
            },
            PositionChange::OrderGone {
                ticket: 8,
                end: OrderEnd::Expired,
            },
        ] {
            let line = serde_json::to_string(&EventFrame {
                event: "position".into(),
                login: "9".into(),
                change: change.clone(),
            })
            .unwrap();
            let ServerFrame::Event(back) = serde_json::from_str(&line).unwrap() else {
                panic!("{line} did not read as an event");
            };
            assert_eq!(back.change, change, "{line}");
            assert_eq!(back.change.ticket(), 8);
        }
        // The wire shape of a fill, as the protocol document shows it.
        let gone = serde_json::to_value(PositionChange::OrderGone {
            ticket: 8,
            end: OrderEnd::Filled { position: 8 },
        })
        .unwrap();
        assert_eq!(
            gone,
            serde_json::json!({"change": "order_gone", "ticket": 8, "end": "filled", "position": 8})
        );
    }
}
