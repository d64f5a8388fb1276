//! The FIX adapter's ledger rows (`migrations/0008_fix_ledger.sql`,
//! `migrations/0015_fix_entry_orders.sql`, `migrations/0016_fix_opened_volume.sql`): orders
//! written before they are sent, the positions seen with their copy markers, entry orders. Shared
//! by the adapter (which reaches the ledger through [`crate::broker::fix::Ledger`]) and the
//! database layer (which stores them), neither depending on the other.

/// An order of the ledger.
#[derive(Debug, Clone, PartialEq)]
pub struct FixOrder {
    pub cl_ord_id: String,
    pub kind: String,
    pub symbol: String,
    pub side: String,
    pub quantity: f64,
    pub position_id: Option<i64>,
    pub magic: i64,
    pub comment: String,
    /// A resting order's stop or limit price.
    pub price: Option<f64>,
}

/// A resting order in force: a position's stop loss (`sl`) or take profit (`tp`).
#[derive(Debug, Clone, PartialEq)]
pub struct Working {
    pub cl_ord_id: String,
    pub kind: String,
    pub position_id: i64,
    pub price: f64,
    pub side: String,
    pub symbol: String,
    pub quantity: f64,
}
#[derive(Debug, Clone, PartialEq)]
pub struct FixPosition {
    pub position_id: i64,
    pub symbol: String,
    pub side: String,
    pub volume: f64,
    pub open_price: f64,
    pub magic: i64,
    pub comment: String,
    pub opened_ms: i64,
    pub closed_ms: Option<i64>,
    pub close_price: Option<f64>,
    /// The ticket the copy engine knows it by, when not `position_id` (an entry order's fill).
    pub ticket: Option<i64>,
    /// Lots when it opened, recorded once (`migrations/0016_fix_opened_volume.sql`); `None`
    /// before its first sighting or fill is recorded.
    pub opened_volume: Option<f64>,
}

/// Who writes: the account and the writer's ownership of it.
#[derive(Debug, Clone)]
pub struct Writer {
    pub account_id: i64,
    pub node_id: String,
    pub epoch: i64,
}

/// An order's fill: the position it opened or reduced, its price, and the lots it filled.
#[derive(Debug, Clone, Copy)]
pub struct Fill {
    pub position_id: i64,
    pub price: f64,
    pub lots: f64,
}

/// An entry order of the ledger (`migrations/0015_fix_entry_orders.sql`): a pending copy placed
/// over FIX, as recorded before it was sent and as the venue has reported it since.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub cl_ord_id: String,
    pub symbol: String,
    pub side: String,
    /// Units (lots times the contract size).
    pub quantity: f64,
    /// `limit` or `stop`.
    pub order_type: String,
    pub price: f64,
    pub sl: Option<f64>,
    pub tp: Option<f64>,
    /// Unix ms (UTC), when it expires; `None`: good till cancelled.
    pub expiry_ms: Option<i64>,
    pub magic: i64,
    pub comment: String,
    /// The copy engine's ticket for it, once the venue acknowledged it.
    pub ticket: Option<i64>,
    /// The ClOrdID this one replaces (a cancel/replace).
    pub replaces: Option<String>,
    pub state: String,
    pub sent_ms: i64,
}

impl Entry {
    /// The ledger's order view of it (what an OrderStatusRequest names).
    pub fn as_order(&self) -> FixOrder {
        FixOrder {
            cl_ord_id: self.cl_ord_id.clone(),
            kind: "entry".into(),
            symbol: self.symbol.clone(),
            side: self.side.clone(),
            quantity: self.quantity,
            position_id: None,
            magic: self.magic,
            comment: self.comment.clone(),
            price: Some(self.price),
        }
    }
}

/// The fill of an entry order: the position it opened and the order's ticket.
#[derive(Debug, Clone, Copy)]
pub struct EntryFill<'a> {
    pub position_id: i64,
    pub ticket: i64,
    pub symbol: &'a str,
    pub side: &'a str,
    pub price: f64,
}
