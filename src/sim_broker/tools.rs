//! The hand tools: place, close and modify trades on a simulated account, place, amend and cancel
//! its pending orders, and list its positions, orders and history, from another terminal. Hand orders are sent as client `manual`, without a fence.

use std::time::Duration;

use crate::broker::BrokerError;
use crate::broker::client::BridgeClient;
use crate::broker::protocol::{HistoryResult, OrderResult, OrdersResult, PositionsResult, Request};
use crate::broker::types::{
    CloseFill, ClosedPosition, OpenFill, PendingOrder, PlaceOrder, Position, Side,
};

/// The client name of hand orders in the journal.
pub use super::book::MANUAL;

/// How long a hand tool waits for the broker.
const TOOL_TIMEOUT: Duration = Duration::from_secs(10);

/// A hand order.
#[derive(Debug, Clone, PartialEq)]
pub enum HandOrder {
    Open {
        symbol: String,
        side: Side,
        volume: f64,
        sl: Option<f64>,
        tp: Option<f64>,
        magic: i64,
        comment: String,
    },
    Close {
        ticket: i64,
        volume: Option<f64>,
    },
    Modify {
        ticket: i64,
        sl: Option<f64>,
        tp: Option<f64>,
    },
    /// A pending order (the ticket is returned).
    Place(PlaceOrder),
    /// A pending order's new price, stops and expiry.
    Amend {
        ticket: i64,
        price: f64,
        sl: Option<f64>,
        tp: Option<f64>,
        expiry_ms: Option<i64>,
    },
    Cancel {
        ticket: i64,
    },
}

async fn connect(broker: &str) -> Result<BridgeClient, BrokerError> {
    // One attempt first, so an unreachable broker fails at once with the reason.
    match tokio::time::timeout(TOOL_TIMEOUT, tokio::net::TcpStream::connect(broker)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return Err(BrokerError::Unavailable(format!(
                "cannot reach the broker at {broker}: {e}"
            )));
        }
        Err(_) => {
            return Err(BrokerError::Unavailable(format!(
                "cannot reach the broker at {broker}: no answer within {TOOL_TIMEOUT:?}"
            )));
        }
    }
    let client = BridgeClient::with_timeout(broker, MANUAL, TOOL_TIMEOUT);
    client.wait_ready(TOOL_TIMEOUT).await?;
    Ok(client)
}

/// The fault switch: makes the broker refuse the next `count` node requests of kind `order`
/// (`open`, `close`, `modify`, `place`, `amend`, `cancel`, `account`) on `login` with `reason`
/// (`count` 0 lifts it).
pub async fn refuse(
    broker: &str,
    login: &str,
    order: &str,
    count: u32,
    reason: &str,
) -> Result<(), BrokerError> {
    let client = connect(broker).await?;
    let result = client
        .call(Request::Refuse {
            login: login.into(),
            order: order.into(),
            count,
            reason: reason.into(),
        })
        .await;
    client.close();
    result.map(|_| ())
}

/// Opens (`Some(true)`) or closes (`Some(false)`) a base symbol's market on the simulated broker
/// now, or hands it back to its trading sessions (`None`).
pub async fn set_market(broker: &str, symbol: &str, open: Option<bool>) -> Result<(), BrokerError> {
    let client = connect(broker).await?;
    let result = client
        .call(Request::Market {
            symbol: symbol.into(),
            open,
        })
        .await;
    client.close();
    result.map(|_| ())
}

/// A login's pending orders.
pub async fn orders(broker: &str, login: &str) -> Result<Vec<PendingOrder>, BrokerError> {
    let client = connect(broker).await?;
    let value = client
        .call(Request::Orders {
            login: login.into(),
        })
        .await;
    client.close();
    let result: OrdersResult =
        serde_json::from_value(value?).map_err(|e| BrokerError::Unknown(e.to_string()))?;
    Ok(result.orders)
}

/// Sets a symbol's price on the simulated broker now; the symbols it moved.
pub async fn set_price(broker: &str, symbol: &str, price: f64) -> Result<Vec<String>, BrokerError> {
    set_price_of(broker, symbol, price, false).await
}

/// Sets a price on the simulated broker now: of `symbol` alone, or with `variants` of a base
/// symbol and every suffixed variant; the symbols it moved.
pub async fn set_price_of(
    broker: &str,
    symbol: &str,
    price: f64,
    variants: bool,
) -> Result<Vec<String>, BrokerError> {
    let client = connect(broker).await?;
    let result = client
        .call(Request::Price {
            symbol: symbol.into(),
            price,
            variants,
        })
        .await;
    client.close();
    let moved = result?
        .get("symbols")
        .and_then(|s| serde_json::from_value(s.clone()).ok())
        .unwrap_or_default();
    Ok(moved)
}

/// Sends a hand order; for an open, returns the new ticket.
pub async fn trade(
    broker: &str,
    login: &str,
    order: HandOrder,
) -> Result<Option<i64>, BrokerError> {
    let client = connect(broker).await?;
    let login = login.to_string();
    let request = match order {
        HandOrder::Open {
            symbol,
            side,
            volume,
            sl,
            tp,
            magic,
            comment,
        } => Request::Open {
            login,
            fence: None,
            symbol,
            side,
            volume,
            sl,
            tp,
            magic,
            comment,
            client_order_id: None,
            price_limit: None,
        },
        HandOrder::Close { ticket, volume } => Request::Close {
            login,
            fence: None,
            ticket,
            volume,
            client_order_id: None,
        },
        HandOrder::Modify { ticket, sl, tp } => Request::Modify {
            login,
            fence: None,
            ticket,
            sl,
            tp,
            client_order_id: None,
        },
        HandOrder::Place(order) => Request::Place {
            login,
            fence: None,
            order,
        },
        HandOrder::Amend {
            ticket,
            price,
            sl,
            tp,
            expiry_ms,
        } => Request::Amend {
            login,
            fence: None,
            ticket,
            price,
            sl,
            tp,
            expiry_ms,
            client_order_id: None,
        },
        HandOrder::Cancel { ticket } => Request::Cancel {
            login,
            fence: None,
            ticket,
            client_order_id: None,
        },
    };
    if matches!(request, Request::Place { .. }) {
        let value = client.call(request).await?;
        client.close();
        let placed: OrderResult =
            serde_json::from_value(value).map_err(|e| BrokerError::Unknown(e.to_string()))?;
        return Ok(Some(placed.ticket));
    }
    let is_open = matches!(request, Request::Open { .. });
    let is_close = matches!(request, Request::Close { .. });
    let value = client.call(request).await?;
    client.close();
    if is_open {
        let fill: OpenFill =
            serde_json::from_value(value).map_err(|e| BrokerError::Unknown(e.to_string()))?;
        return Ok(Some(fill.ticket));
    }
    if is_close {
        let _: CloseFill =
            serde_json::from_value(value).map_err(|e| BrokerError::Unknown(e.to_string()))?;
    }
    Ok(None)
}

/// The account's open positions.
pub async fn positions(broker: &str, login: &str) -> Result<Vec<Position>, BrokerError> {
    let client = connect(broker).await?;
    let value = client
        .call(Request::Positions {
            login: login.to_string(),
        })
        .await?;
    client.close();
    let r: PositionsResult =
        serde_json::from_value(value).map_err(|e| BrokerError::Unknown(e.to_string()))?;
    Ok(r.positions)
}

/// The account's closed positions (every full or partial close).
pub async fn history(broker: &str, login: &str) -> Result<Vec<ClosedPosition>, BrokerError> {
    let client = connect(broker).await?;
    let value = client
        .call(Request::History {
            login: login.to_string(),
        })
        .await?;
    client.close();
    let r: HistoryResult =
        serde_json::from_value(value).map_err(|e| BrokerError::Unknown(e.to_string()))?;
    Ok(r.history)
}

/// One random hand trade on `login`, as a trade generator makes them (the demo, the fault suite):
/// an open while few positions are open (0.1 to 2 lots of a random default symbol), otherwise a
/// partial close of half, a stop change 1 % around the open price, or a full close. True if the
/// broker accepted it.
pub async fn random_trade(client: &BridgeClient, login: &str) -> bool {
    let login = login.to_string();
    let positions = match client
        .call(Request::Positions {
            login: login.clone(),
        })
        .await
    {
        Ok(v) => serde_json::from_value::<PositionsResult>(v)
            .map(|r| r.positions)
            .unwrap_or_default(),
        Err(_) => Vec::new(), // a new account: nothing open yet
    };
    let symbols = ["EURUSD", "GBPUSD", "XAUUSD"];
    let request = if positions.len() < 2 || (positions.len() < 4 && fastrand::bool()) {
        Request::hand_open(
            &login,
            symbols[fastrand::usize(..symbols.len())],
            if fastrand::bool() {
                Side::Buy
            } else {
                Side::Sell
            },
            fastrand::u32(1..=20) as f64 / 10.0,
        )
    } else {
        let p = &positions[fastrand::usize(..positions.len())];
        match fastrand::u8(0..3) {
            0 if p.volume >= 0.2 => Request::Close {
                login,
                fence: None,
                ticket: p.ticket,
                volume: Some(((p.volume * 50.0).round() / 100.0).max(0.1)),
                client_order_id: None,
            },
            1 => {
                let (sl, tp) = match p.side {
                    Side::Buy => (p.open_price * 0.99, p.open_price * 1.01),
                    Side::Sell => (p.open_price * 1.01, p.open_price * 0.99),
                };
                let r = |v: f64| (v * 1000.0).round() / 1000.0;
                Request::Modify {
                    login,
                    fence: None,
                    ticket: p.ticket,
                    sl: Some(r(sl)),
                    tp: Some(r(tp)),
                    client_order_id: None,
                }
            }
            _ => Request::Close {
                login,
                fence: None,
                ticket: p.ticket,
                volume: None,
                client_order_id: None,
            },
        }
    };
    client.call(request).await.is_ok()
}
