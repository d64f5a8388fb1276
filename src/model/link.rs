//! A copy link as sessions use it: the row of `copy_links`, parsed (the SQL that reads it is in
//! [`crate::db::copy`]; the rules that apply it in [`crate::copier::rules`]).

use std::collections::HashMap;

use crate::model::named::named;

named! {
    /// How a copy's volume is computed from the master's (`copy_links.lot_mode`).
    pub enum LotMode as "lot_mode" {
        /// Always `lot_value` lots.
        Fixed = "fixed": "always lot_value lots",
        /// Master volume × `lot_value`.
        Multiplier = "multiplier": "the master's volume times lot_value",
        /// Master volume × follower balance / master balance × `lot_value`.
        BalanceRatio = "balance_ratio":
            "the master's volume times follower balance / master balance, times lot_value",
        /// Master volume × follower equity / master equity × `lot_value`.
        EquityRatio = "equity_ratio":
            "the master's volume times follower equity / master equity, times lot_value",
        /// Whatever volume risks `lot_value` percent of the follower's equity between the
        /// copy's open price and its stop loss (contract size × distance per lot; a copy
        /// without a stop loss is skipped).
        RiskPercent = "risk_percent":
            "the volume that risks lot_value percent of the follower's equity at the stop loss",
    }
}

impl LotMode {
    /// The master's figures the mode sizes from: (balance, equity). A copy waits until they
    /// are read.
    pub fn needs_master_funds(self) -> (bool, bool) {
        match self {
            LotMode::BalanceRatio => (true, false),
            LotMode::EquityRatio => (false, true),
            LotMode::Fixed | LotMode::Multiplier | LotMode::RiskPercent => (false, false),
        }
    }

    /// True when the mode scales the master's volume counted in the follower's lots (its
    /// notional value: the two brokers' contract sizes may differ). `fixed` is already in the
    /// follower's lots; `risk_percent` sizes from the follower's own contract.
    pub fn sized_by_notional(self) -> bool {
        match self {
            LotMode::Multiplier | LotMode::BalanceRatio | LotMode::EquityRatio => true,
            LotMode::Fixed | LotMode::RiskPercent => false,
        }
    }
}

named! {
    /// Which of the master's sides a link copies, before `reverse` (`copy_links.sides`).
    pub enum Sides as "sides" {
        Both = "both": "buys and sells",
        Buy = "buy": "the master's buys only",
        Sell = "sell": "the master's sells only",
    }
}

named! {
    /// How a link copies a master's pending orders (`copy_links.pending_orders`).
    pub enum PendingOrders as "pending_orders" {
        Copy = "copy": "placed as pending copies, amended and cancelled with the master's",
        FillOnly = "fill_only": "not copied while pending; the position copied at its fill",
    }
}

named! {
    /// What removing a link does to the copies it made (`copy_links.on_remove`).
    pub enum OnRemove as "on_remove" {
        Leave = "leave": "they stay open, no longer managed",
        Close = "close": "the follower's node closes them",
    }
}

/// A link's protections: each only ever stops or shrinks a new copy (docs/copying.md, Protections).
#[derive(Debug, Clone, PartialEq)]
pub struct Protections {
    /// Copy only these master symbols (`None`: all).
    pub symbols: Option<Vec<String>>,
    /// Copy only master positions with these magic numbers (`None`: all).
    pub magics: Option<Vec<i64>>,
    pub sides: Sides,
    /// Copy nothing new; open copies still follow the master.
    pub close_only: bool,
    /// Cap on a copy's volume.
    pub max_lot: Option<f64>,
    /// No copy opened more than this long after the master position was first recorded.
    pub max_delay_ms: Option<i64>,
    /// The worst fill a copy accepts, as a distance from the master's open price.
    pub max_slippage: Option<f64>,
    /// No new copies while the follower's equity is at or below this.
    pub equity_stop: Option<f64>,
    /// Copy the stop loss (with `copy_sl_tp`).
    pub copy_sl: bool,
    /// Copy the take profit (with `copy_sl_tp`).
    pub copy_tp: bool,
    /// The farthest a copy's stop loss may be from the master's open price (price units).
    pub max_sl_distance: Option<f64>,
    /// A copy that rounds below the broker's minimum lot is opened at the minimum, not skipped.
    pub use_min_lot: bool,
    /// Master positions smaller than this (lots) are not copied.
    pub min_master_lot: Option<f64>,
    /// The link opens no copy while it holds this many.
    pub max_open_copies: Option<i64>,
    /// A fixed stop loss this many points (of the follower's symbol) from the copy's open
    /// price, instead of the master's.
    pub sl_points: Option<f64>,
    /// A fixed take profit this many points from the copy's open price, instead of the master's.
    pub tp_points: Option<f64>,
    /// The link's `pending_orders = 'fill_only'`: a master's pending order is not copied as a
    /// pending order; its fill is copied, at market.
    pub fill_only: bool,
}

impl Default for Protections {
    fn default() -> Self {
        Protections {
            symbols: None,
            magics: None,
            sides: Sides::Both,
            close_only: false,
            max_lot: None,
            max_delay_ms: None,
            max_slippage: None,
            equity_stop: None,
            copy_sl: true,
            copy_tp: true,
            max_sl_distance: None,
            use_min_lot: false,
            min_master_lot: None,
            max_open_copies: None,
            sl_points: None,
            tp_points: None,
            fill_only: false,
        }
    }
}

/// One copy link, as a follower session uses it.
#[derive(Debug, Clone, PartialEq)]
pub struct Link {
    pub id: i64,
    pub master_id: i64,
    /// A disabled link copies nothing new; its open copies still follow the master's closes.
    pub enabled: bool,
    pub magic: i64,
    pub lot_mode: LotMode,
    pub lot_value: f64,
    pub reverse: bool,
    pub copy_sl_tp: bool,
    /// Master symbol -> follower symbol.
    pub symbol_map: HashMap<String, String>,
    pub copy_existing: bool,
    /// When the link took effect (database clock, Unix ms).
    pub created_at_ms: i64,
    pub protections: Protections,
}
