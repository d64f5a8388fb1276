//! Copy rules per link, as pure functions: which master positions a link copies, with what
//! symbol, side, volume and stops.

use std::collections::HashMap;

use crate::broker::types::{Currency, OpenOrder, Side, SymbolSpec};
use crate::model::named::named;

pub use crate::model::link::{Link, LotMode, Protections, Sides};

use super::{MasterPosition, intent, marker};

/// What a decision needs besides the link and the position: the money figures of the ratio and
/// risk lot modes and of the equity stop, and the time of the decision.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Inputs {
    pub follower_balance: f64,
    pub follower_equity: f64,
    pub master_balance: Option<f64>,
    pub master_equity: Option<f64>,
    /// The currencies the follower's and the master's figures count in (`None`: not reported;
    /// then the two are taken to count in the same one, as before currencies were read).
    pub follower_currency: Option<Currency>,
    pub master_currency: Option<Currency>,
    /// The moment of the decision on the database's clock (Unix ms), when known (`max_delay_ms`).
    pub now_ms: Option<i64>,
    /// The follower reached one of its risk limits in the current period: close-only.
    pub risk_hold: bool,
    /// The follower has risk limits and its balance and equity could not be read just now: no
    /// new copy until they can (a wait).
    pub risk_unread: bool,
}

/// The follower's symbol for a master symbol, or why there is none. In order: the link's
/// explicit map; the same name on the follower's broker; else the one follower symbol with the
/// same core once each broker's prefix and suffix are stripped (`EURUSD.m` -> `EURUSD` ->
/// `EURUSDpro`). Checked against the follower broker's symbol list. The second value is true
/// for a match by core (the caller also checks the prices agree).
pub fn follower_symbol(
    link: &Link,
    master_symbol: &str,
    specs: &HashMap<String, SymbolSpec>,
) -> Result<(String, bool), String> {
    if let Some(mapped) = link.symbol_map.get(master_symbol) {
        return if specs.contains_key(mapped) {
            Ok((mapped.clone(), false))
        } else {
            Err(format!(
                "symbol {mapped} is unknown on the follower's broker (the link maps {master_symbol} to it)"
            ))
        };
    }
    if specs.contains_key(master_symbol) {
        return Ok((master_symbol.to_string(), false));
    }
    let Some(core) = symbol_core(master_symbol) else {
        return Err(format!(
            "symbol {master_symbol} is unknown on the follower's broker (map it in the link's symbol_map)"
        ));
    };
    let mut candidates: Vec<&String> = specs
        .keys()
        .filter(|s| symbol_core(s).as_deref() == Some(core.as_str()))
        .collect();
    candidates.sort();
    match candidates.as_slice() {
        [one] => Ok(((*one).clone(), true)),
        [] => Err(format!(
            "symbol {master_symbol} is unknown on the follower's broker (nor any symbol like {core})"
        )),
        many => {
            // The bare core itself wins over suffixed variants (EURUSD over EURUSD.pro).
            if let Some(bare) = many.iter().find(|s| s.as_str() == core) {
                return Ok(((*bare).clone(), true));
            }
            let names: Vec<&str> = many.iter().map(|s| s.as_str()).collect();
            Err(format!(
                "symbol {master_symbol} matches several symbols on the follower's broker ({}): map it in the link's symbol_map",
                names.join(", ")
            ))
        }
    }
}

/// A symbol's core: its parts between separators (`.`, `_`, `-`, `#`, `+`, `!`, `/`), each
/// without lowercase letters before or after, joined, keeping only parts that are then capitals
/// and digits (`EURUSD.m`, `mEURUSD`, `EURUSDpro`, `EURUSD_i`, `EUR/USD` all give `EURUSD`;
/// `US30_Z24` gives `US30Z24`, not `US30`). `None` (match by exact name only) when fewer than
/// three capitals or digits remain (`Bitcoin`, `Brent`) or a part has lowercase inside.
pub fn symbol_core(symbol: &str) -> Option<String> {
    let mut core = String::new();
    for part in symbol.split(['.', '_', '-', '#', '+', '!', '/']) {
        let trimmed = part
            .trim_start_matches(|c: char| c.is_ascii_lowercase())
            .trim_end_matches(|c: char| c.is_ascii_lowercase());
        if trimmed.is_empty() {
            continue;
        }
        if !trimmed
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
        {
            return None;
        }
        core.push_str(trimmed);
    }
    (core.len() >= 3).then_some(core)
}

/// The copy's side: the master's, or the opposite when the link reverses.
pub fn follower_side(link: &Link, side: Side) -> Side {
    if link.reverse { side.flip() } else { side }
}

/// The copy's (sl, tp): the master's, swapped when the link reverses (the master's take profit
/// is where a reversed copy must stop its loss); none when the link does not copy stops, each
/// dropped by its own switch (`copy_sl`, `copy_tp`), and the stop loss brought within the link's
/// `max_sl_distance` of the master's open price.
pub fn follower_stops(link: &Link, m: &MasterPosition) -> (Option<f64>, Option<f64>) {
    let (sl, tp) = match (link.copy_sl_tp, link.reverse) {
        (false, _) => (None, None),
        (true, false) => (m.sl, m.tp),
        (true, true) => (m.tp, m.sl),
    };
    let p = &link.protections;
    let sl = sl.filter(|_| p.copy_sl);
    let tp = tp.filter(|_| p.copy_tp);
    let sl = match (sl, p.max_sl_distance) {
        (Some(s), Some(cap)) => Some(match follower_side(link, m.side) {
            Side::Buy => s.max(m.open_price - cap),
            Side::Sell => s.min(m.open_price + cap),
        }),
        (s, _) => s,
    };
    (sl, tp)
}

/// The link's fixed stops in points (`sl_points`, `tp_points`), measured on the copy's `side`
/// from `open` in points of the follower's symbol, in place of the master's `(sl, tp)`; what
/// the link does not fix stays as given. An error when the symbol's point size is unknown.
pub fn fixed_stops(
    link: &Link,
    side: Side,
    open: f64,
    spec: &SymbolSpec,
    (sl, tp): (Option<f64>, Option<f64>),
) -> Result<(Option<f64>, Option<f64>), String> {
    let p = &link.protections;
    if p.sl_points.is_none() && p.tp_points.is_none() {
        return Ok((sl, tp));
    }
    let point = spec.point;
    if !(point.is_finite() && point > 0.0) {
        return Err(format!(
            "the link sets stops in points, but the follower's broker gives no point size for {}",
            spec.symbol
        ));
    }
    // Away from the price by whole points, rounded to the point (no float noise in the order).
    let at = |points: f64, up: bool| {
        let price = if up {
            open + points * point
        } else {
            open - points * point
        };
        (price / point).round() * point
    };
    let buy = side == Side::Buy;
    Ok((
        p.sl_points.map(|n| at(n, !buy)).or(sl),
        p.tp_points.map(|n| at(n, buy)).or(tp),
    ))
}

named! {
    /// Why a link does not copy a master position, as a closed set (stored in
    /// `copy_skips.code`); a human message goes beside it.
    pub enum SkipCode as "code" {
        LinkDisabled = "link_disabled": "the link is disabled: close-only",
        CloseOnly = "close_only": "the link's close_only protection",
        Filtered = "filtered": "the link's symbols, magics or sides filter",
        OpenedBeforeLink = "opened_before_link":
            "open before the link took effect, and the link does not copy existing positions",
        TooLate = "too_late": "past the link's max_delay_ms",
        EquityStop = "equity_stop": "the follower's equity is at or below the link's equity_stop",
        RiskLimit = "risk_limit": "the follower reached one of its risk limits",
        SymbolNotFound = "symbol_not_found": "the follower's broker has no such symbol",
        BelowMinVolume = "below_min_volume": "the volume rounds below the symbol's minimum",
        InvalidVolume = "invalid_volume": "the computed volume is not a positive number",
        BelowMinTrade = "below_min_trade": "the master's volume is below min_master_lot",
        NoStopLoss = "no_stop_loss": "risk_percent without a stop loss on the copy",
        UnknownPoint = "unknown_point":
            "stops in points on a symbol whose point size the broker does not give",
        Slippage = "slippage": "the fill would have been beyond max_slippage",
        Rejected = "rejected": "the broker refused the open definitively",
        MarketClosed = "market_closed": "transient, retried: the market is closed",
        Requote = "requote": "transient, retried: the broker asked for a new price",
        Unavailable = "unavailable":
            "transient, retried: the broker could not be reached, or an outcome is being resolved",
        Waiting = "waiting": "transient, retried: an input is not known yet",
    }
}

impl SkipCode {
    /// True for the codes of a final decision: the link never copies that master position.
    /// (Every code is listed: a new one decides here whether it is final.)
    pub fn is_final(self) -> bool {
        match self {
            SkipCode::LinkDisabled
            | SkipCode::CloseOnly
            | SkipCode::Filtered
            | SkipCode::OpenedBeforeLink
            | SkipCode::TooLate
            | SkipCode::EquityStop
            | SkipCode::RiskLimit
            | SkipCode::SymbolNotFound
            | SkipCode::BelowMinVolume
            | SkipCode::InvalidVolume
            | SkipCode::BelowMinTrade
            | SkipCode::NoStopLoss
            | SkipCode::UnknownPoint
            | SkipCode::Slippage
            | SkipCode::Rejected => true,
            SkipCode::MarketClosed
            | SkipCode::Requote
            | SkipCode::Unavailable
            | SkipCode::Waiting => false,
        }
    }
}

/// Why a copy is not opened now.
#[derive(Debug, Clone, PartialEq)]
pub enum NotNow {
    /// Final: the link never copies this master position (docs/copying.md, Protections: a protection's skip is final).
    Skip(SkipCode, String),
    /// An input is missing (e.g. the master's balance, not read yet): decide again once it is
    /// known. A wait, not a skip.
    Wait(String),
}

impl NotNow {
    pub fn message(&self) -> &str {
        match self {
            NotNow::Skip(_, m) | NotNow::Wait(m) => m,
        }
    }

    pub fn code(&self) -> SkipCode {
        match self {
            NotNow::Skip(code, _) => *code,
            NotNow::Wait(_) => SkipCode::Waiting,
        }
    }
}

fn skip(code: SkipCode, message: impl Into<String>) -> NotNow {
    NotNow::Skip(code, message.into())
}

/// Why a link does not copy a master position at all (before any volume is computed).
pub fn eligibility(link: &Link, position: &MasterPosition, inputs: &Inputs) -> Result<(), NotNow> {
    let p = &link.protections;
    if !link.enabled {
        return Err(skip(SkipCode::LinkDisabled, "link disabled: close-only"));
    }
    if p.close_only {
        return Err(skip(
            SkipCode::CloseOnly,
            "link is close-only: no new copies",
        ));
    }
    if inputs.risk_hold {
        return Err(skip(
            SkipCode::RiskLimit,
            "the follower reached a risk limit: no new copies until it resets (see risk_limits)",
        ));
    }
    if inputs.risk_unread {
        return Err(NotNow::Wait(
            "the follower has risk limits and its balance and equity could not be read: waiting until they can".into(),
        ));
    }
    if let Some(symbols) = &p.symbols
        && !symbols.contains(&position.symbol)
    {
        return Err(skip(
            SkipCode::Filtered,
            format!(
                "master symbol {} is not in the link's symbols {symbols:?}",
                position.symbol
            ),
        ));
    }
    if let Some(magics) = &p.magics
        && !magics.contains(&position.magic)
    {
        return Err(skip(
            SkipCode::Filtered,
            format!(
                "master magic {} is not in the link's magics {magics:?}",
                position.magic
            ),
        ));
    }
    match (p.sides, position.side) {
        (Sides::Buy, Side::Sell) => {
            return Err(skip(
                SkipCode::Filtered,
                "the link copies only the master's buys",
            ));
        }
        (Sides::Sell, Side::Buy) => {
            return Err(skip(
                SkipCode::Filtered,
                "the link copies only the master's sells",
            ));
        }
        _ => {}
    }
    match position.first_seen_ms {
        Some(seen) if seen < link.created_at_ms && !link.copy_existing => {
            return Err(skip(
                SkipCode::OpenedBeforeLink,
                format!(
                    "position was open before the link took effect (first recorded {seen} ms, link {} ms) and the link does not copy existing positions",
                    link.created_at_ms
                ),
            ));
        }
        _ => {}
    }
    if let Some(late) = too_late(link, position, inputs) {
        return Err(late);
    }
    if let Some(stop) = p.equity_stop
        && inputs.follower_equity <= stop
    {
        return Err(skip(
            SkipCode::EquityStop,
            format!(
                "equity stop: the follower's equity {:.2} is at or below the link's equity_stop {stop:.2}",
                inputs.follower_equity
            ),
        ));
    }
    Ok(())
}

/// The `too_late` skip when a copy decided at `inputs.now_ms` would open more than the link's
/// `max_delay_ms` after the master's session first recorded the position. Without a
/// `max_delay_ms` nothing is too late: a retried open is retried while the master position is
/// open.
pub fn too_late(link: &Link, position: &MasterPosition, inputs: &Inputs) -> Option<NotNow> {
    let (max, seen, now) = (
        link.protections.max_delay_ms?,
        position.first_seen_ms?,
        inputs.now_ms?,
    );
    (now - seen > max).then(|| {
        skip(
            SkipCode::TooLate,
            format!(
                "too late: the copy would open {} ms after the master position was first recorded, over the link's max_delay_ms {max}",
                now - seen
            ),
        )
    })
}

/// Rounds to the nearest multiple of `step` (with a guard against binary fractions).
pub fn round_to_step(volume: f64, step: f64) -> f64 {
    if step <= 0.0 {
        return volume;
    }
    let steps = (volume / step + 1e-9).round();
    ((steps * step) * 1e8).round() / 1e8
}

/// Rounds down to a multiple of `step` (a cap is never exceeded by rounding).
fn floor_to_step(volume: f64, step: f64) -> f64 {
    if step <= 0.0 {
        return volume;
    }
    let steps = (volume / step + 1e-9).floor();
    ((steps * step) * 1e8).round() / 1e8
}

/// How many units of `to` one unit of `from` is worth, from the follower broker's prices (the
/// broker the copy trades on): a symbol whose core is `from` then `to` (its price), or `to` then
/// `from` (one over its price), with the broker's prefix or suffix (`EURUSD.m`). 1 for the same
/// currency; `None` when the broker lists no such pair with a price.
pub fn conversion_rate(
    from: Currency,
    to: Currency,
    specs: &HashMap<String, SymbolSpec>,
) -> Option<f64> {
    if from == to {
        return Some(1.0);
    }
    let direct = format!("{from}{to}");
    let inverse = format!("{to}{from}");
    let price = |core: &str| {
        let mut found: Vec<&SymbolSpec> = specs
            .values()
            .filter(|s| s.price > 0.0 && symbol_core(&s.symbol).as_deref() == Some(core))
            .collect();
        // The bare name first, then the others by name: one answer for one price list.
        found.sort_by(|a, b| (a.symbol != core, &a.symbol).cmp(&(b.symbol != core, &b.symbol)));
        found.first().map(|s| s.price)
    };
    price(&direct).or_else(|| price(&inverse).map(|p| 1.0 / p))
}

/// `amount` in `from`, in `to`: converted when both currencies are known and differ (a missing
/// rate is a wait, never a guess); as is when either is unknown (both then count alike).
fn convert(
    amount: f64,
    from: Option<Currency>,
    to: Option<Currency>,
    specs: &HashMap<String, SymbolSpec>,
    what: &str,
) -> Result<f64, NotNow> {
    match (from, to) {
        (Some(f), Some(t)) => conversion_rate(f, t, specs)
            .map(|rate| amount * rate)
            .ok_or_else(|| {
                NotNow::Wait(format!(
                    "{what}: the follower's broker quotes no pair converting {f} to {t} (waiting for one)"
                ))
            }),
        _ => Ok(amount),
    }
}

/// The copy's volume for a master volume, rounded to the follower symbol's step and capped at
/// its maximum and the link's `max_lot`; below the minimum it is skipped (with the reason),
/// never silently resized. `stop_distance` is the distance from the copy's open price to its
/// stop loss (for `risk_percent`).
pub fn copy_volume(
    link: &Link,
    master_volume: f64,
    funds: &Inputs,
    spec: &SymbolSpec,
    stop_distance: Option<f64>,
    specs: &HashMap<String, SymbolSpec>,
) -> Result<f64, NotNow> {
    let raw = match link.lot_mode {
        LotMode::Fixed => link.lot_value,
        LotMode::Multiplier => master_volume * link.lot_value,
        LotMode::BalanceRatio => {
            let master = funds.master_balance.filter(|b| *b > 0.0).ok_or_else(|| {
                NotNow::Wait(
                    "balance_ratio needs the master's balance, which is not known yet".into(),
                )
            })?;
            let follower = convert(
                funds.follower_balance,
                funds.follower_currency,
                funds.master_currency,
                specs,
                "balance_ratio",
            )?;
            master_volume * follower / master * link.lot_value
        }
        LotMode::EquityRatio => {
            let master = funds.master_equity.filter(|e| *e > 0.0).ok_or_else(|| {
                NotNow::Wait(
                    "equity_ratio needs the master's equity, which is not known yet".into(),
                )
            })?;
            let follower = convert(
                funds.follower_equity,
                funds.follower_currency,
                funds.master_currency,
                specs,
                "equity_ratio",
            )?;
            master_volume * follower / master * link.lot_value
        }
        LotMode::RiskPercent => {
            let distance = stop_distance.filter(|d| *d > 0.0).ok_or_else(|| skip(
                SkipCode::NoStopLoss,
                "risk_percent needs a stop loss on the copy (the master position has none, or the link does not copy stops)",
            ))?;
            // A lot's loss at the stop counts in the symbol's profit currency; the risk in the
            // follower's.
            let loss_per_lot = convert(
                distance * spec.contract_size,
                spec.profit_currency,
                funds.follower_currency,
                specs,
                "risk_percent",
            )?;
            funds.follower_equity * link.lot_value / 100.0 / loss_per_lot
        }
    };
    if !raw.is_finite() || raw <= 0.0 {
        return Err(skip(
            SkipCode::InvalidVolume,
            format!("computed volume {raw} is not positive"),
        ));
    }
    let mut rounded = round_to_step(raw, spec.volume_step).min(spec.volume_max);
    if let Some(cap) = link.protections.max_lot
        && rounded > cap
    {
        rounded = floor_to_step(cap, spec.volume_step);
    }
    if rounded + 1e-9 < spec.volume_min
        && link.protections.use_min_lot
        && link
            .protections
            .max_lot
            .is_none_or(|cap| cap + 1e-9 >= spec.volume_min)
    {
        // The link asks for the broker's minimum rather than no copy.
        return Ok(spec.volume_min);
    }
    if rounded + 1e-9 < spec.volume_min {
        return Err(skip(
            SkipCode::BelowMinVolume,
            format!(
                "volume {raw:.4} rounds to {rounded} on {}, below its minimum {}: skipped, not resized",
                spec.symbol, spec.volume_min
            ),
        ));
    }
    Ok(rounded)
}

/// The order that copies `position` under `link`, or why it is not copied.
pub fn open_order(
    link: &Link,
    position: &MasterPosition,
    funds: &Inputs,
    specs: &HashMap<String, SymbolSpec>,
) -> Result<OpenOrder, NotNow> {
    eligibility(link, position, funds)?;
    if let Some(min) = link.protections.min_master_lot
        && position.volume + 1e-9 < min
    {
        return Err(skip(
            SkipCode::BelowMinTrade,
            format!(
                "the master's {} lots are below the link's min_master_lot {min}",
                position.volume
            ),
        ));
    }
    let (symbol, by_core) = follower_symbol(link, &position.symbol, specs)
        .map_err(|why| skip(SkipCode::SymbolNotFound, why))?;
    let spec = specs.get(&symbol).ok_or_else(|| {
        skip(
            SkipCode::SymbolNotFound,
            format!("symbol {symbol} is unknown on the follower's broker"),
        )
    })?;
    // A name alike is not proof of the same instrument: its price must be near the master's.
    if by_core
        && spec.price > 0.0
        && position.open_price > 0.0
        && (spec.price / position.open_price - 1.0).abs() > 0.1
    {
        return Err(skip(
            SkipCode::SymbolNotFound,
            format!(
                "symbol {symbol} on the follower's broker looks like {} but trades at {} against the master's {}: map it in the link's symbol_map",
                position.symbol, spec.price, position.open_price
            ),
        ));
    }
    let side = follower_side(link, position.side);
    let master_stops = follower_stops(link, position);
    // Fixed stops count from the copy's own fill, which the order cannot know: the order carries
    // none of them (a stop measured from the master's older price could sit on the wrong side of
    // a late copy's market and get the open refused), and they are set right after the fill.
    // Here they only size `risk_percent` and are checked for a point size.
    let (sl, _) = fixed_stops(link, side, position.open_price, spec, master_stops)
        .map_err(|why| skip(SkipCode::UnknownPoint, why))?;
    let p = &link.protections;
    let order_stops = (
        master_stops.0.filter(|_| p.sl_points.is_none()),
        master_stops.1.filter(|_| p.tp_points.is_none()),
    );
    // Sized by notional value: a lot is not the same amount on every broker (XAUUSD is 100 oz
    // on one, 10 on another), so the master's volume counts in the follower's lots.
    let master_volume = match position.contract_size {
        Some(c) if link.lot_mode.sized_by_notional() && c > 0.0 && spec.contract_size > 0.0 => {
            position.volume * c / spec.contract_size
        }
        _ => position.volume,
    };
    // The risk of a copy: from the master's open price (where the copy means to open) to the
    // copy's own stop loss (the master's take profit when the link reverses; none when the link
    // does not copy stops).
    let stop_distance = sl.map(|s| (position.open_price - s).abs());
    let volume = copy_volume(link, master_volume, funds, spec, stop_distance, specs)?;
    let price_limit = link.protections.max_slippage.map(|s| match side {
        Side::Buy => position.open_price + s,
        Side::Sell => position.open_price - s,
    });
    Ok(OpenOrder {
        symbol,
        side,
        volume,
        sl: order_stops.0,
        tp: order_stops.1,
        magic: link.magic,
        comment: marker(position.ticket),
        client_order_id: Some(intent::open(link.id, position.ticket)),
        price_limit,
    })
}

/// What a copy's volume should be after the master closed part of its position: the copy's
/// original volume scaled like the master's, rounded to the step, never below the minimum while
/// the master position is open.
pub fn trimmed_volume(
    copy_original: f64,
    master_open_volume: f64,
    master_volume: f64,
    spec: &SymbolSpec,
) -> f64 {
    if master_open_volume <= 0.0 {
        return copy_original;
    }
    let target = round_to_step(
        copy_original * master_volume / master_open_volume,
        spec.volume_step,
    );
    target.max(spec.volume_min).min(copy_original)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(symbol: &str) -> SymbolSpec {
        SymbolSpec {
            symbol: symbol.into(),
            price: 1.1,
            volume_step: 0.01,
            volume_min: 0.01,
            volume_max: 100.0,
            contract_size: 100_000.0,
            point: 0.00001,
            profit_currency: None,
        }
    }

    fn link() -> Link {
        Link {
            id: 7,
            master_id: 1,
            enabled: true,
            magic: 100_007,
            lot_mode: LotMode::Multiplier,
            lot_value: 1.0,
            reverse: false,
            copy_sl_tp: true,
            symbol_map: HashMap::new(),
            copy_existing: false,
            created_at_ms: 1_000,
            protections: Default::default(),
        }
    }

    fn position(volume: f64) -> MasterPosition {
        MasterPosition {
            ticket: 42,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume,
            open_volume: volume,
            open_price: 1.1,
            sl: Some(1.09),
            tp: Some(1.12),
            magic: 0,
            first_seen_ms: Some(2_000),
            first_seen_us: None,
            open_time_ms: None,
            contract_size: None,
            broker_ticket: None,
        }
    }

    fn specs() -> HashMap<String, SymbolSpec> {
        ["EURUSD", "EURUSD.m"]
            .iter()
            .map(|s| (s.to_string(), spec(s)))
            .collect()
    }

    #[test]
    fn lot_modes_compute_and_round_to_the_step() {
        let funds = Inputs {
            follower_balance: 5_000.0,
            follower_equity: 2_500.0,
            master_balance: Some(10_000.0),
            master_equity: Some(10_000.0),
            now_ms: None,
            ..Inputs::default()
        };
        let cases = [
            (LotMode::Fixed, 0.3, 1.0, Ok(0.3)),
            (LotMode::Multiplier, 2.0, 0.5, Ok(1.0)),
            (LotMode::Multiplier, 0.5, 1.0 / 3.0, Ok(0.17)),
            (LotMode::BalanceRatio, 1.0, 0.5, Ok(0.25)),
            (LotMode::BalanceRatio, 2.0, 0.37, Ok(0.37)),
            (LotMode::EquityRatio, 1.0, 0.4, Ok(0.1)),
            (LotMode::EquityRatio, 1.0, 1.0, Ok(0.25)),
            (LotMode::Multiplier, 300.0, 1.0, Ok(100.0)),
        ];
        for (mode, value, master_volume, want) in cases {
            let l = Link {
                lot_mode: mode,
                lot_value: value,
                ..link()
            };
            assert_eq!(
                copy_volume(&l, master_volume, &funds, &spec("EURUSD"), None, &specs()),
                want,
                "{mode:?} {value} {master_volume}"
            );
        }
    }

    #[test]
    fn below_the_minimum_is_skipped_with_a_reason() {
        let l = Link {
            lot_value: 0.1,
            ..link()
        };
        let err = copy_volume(
            &l,
            0.04,
            &Inputs::default(),
            &spec("EURUSD"),
            None,
            &specs(),
        )
        .unwrap_err();
        assert_eq!(err.code(), SkipCode::BelowMinVolume);
        assert!(
            err.message().contains("below its minimum 0.01")
                && err.message().contains("not resized"),
            "{err:?}"
        );
    }

    #[test]
    fn a_missing_master_balance_or_equity_is_a_wait_not_a_skip() {
        for mode in [LotMode::BalanceRatio, LotMode::EquityRatio] {
            let ratio = Link {
                lot_mode: mode,
                ..link()
            };
            let err = copy_volume(
                &ratio,
                1.0,
                &Inputs::default(),
                &spec("EURUSD"),
                None,
                &specs(),
            )
            .unwrap_err();
            assert!(
                matches!(&err, NotNow::Wait(m) if m.contains("not known yet")),
                "{mode:?}: {err:?}"
            );
            assert!(!err.code().is_final());
        }
    }

    #[test]
    fn reverse_flips_the_side_and_swaps_the_stops() {
        let l = Link {
            reverse: true,
            ..link()
        };
        let o = open_order(&l, &position(1.0), &Inputs::default(), &specs()).unwrap();
        assert_eq!((o.side, o.sl, o.tp), (Side::Sell, Some(1.12), Some(1.09)));
        let plain = open_order(&link(), &position(1.0), &Inputs::default(), &specs()).unwrap();
        assert_eq!(
            (plain.side, plain.sl, plain.tp),
            (Side::Buy, Some(1.09), Some(1.12))
        );
        let no_stops = Link {
            copy_sl_tp: false,
            ..link()
        };
        let o = open_order(&no_stops, &position(1.0), &Inputs::default(), &specs()).unwrap();
        assert_eq!((o.sl, o.tp), (None, None));
    }

    #[test]
    fn orders_carry_magic_marker_and_client_order_id() {
        let o = open_order(&link(), &position(1.0), &Inputs::default(), &specs()).unwrap();
        assert_eq!(
            (o.magic, o.comment.as_str(), o.client_order_id.as_deref()),
            (100_007, "mc42", Some("l7-m42-open"))
        );
    }

    #[test]
    fn volumes_count_in_the_followers_lots_by_notional_value() {
        let mut gold = specs();
        gold.insert(
            "EURUSD".into(),
            SymbolSpec {
                contract_size: 10_000.0, // a tenth of the master's 100,000
                ..spec("EURUSD")
            },
        );
        let m = MasterPosition {
            contract_size: Some(100_000.0),
            ..position(0.3)
        };
        assert_eq!(
            open_order(&link(), &m, &Inputs::default(), &gold)
                .unwrap()
                .volume,
            3.0
        );
        // A fixed size is the follower's lots, whatever the master's contract.
        let mut fixed = link();
        fixed.lot_mode = LotMode::Fixed;
        fixed.lot_value = 0.5;
        assert_eq!(
            open_order(&fixed, &m, &Inputs::default(), &gold)
                .unwrap()
                .volume,
            0.5
        );
        // Without the master's contract size: lots as they are.
        assert_eq!(
            open_order(&link(), &position(0.3), &Inputs::default(), &gold)
                .unwrap()
                .volume,
            0.3
        );
    }

    #[test]
    fn stop_loss_and_take_profit_are_copied_separately_and_the_stop_capped() {
        let m = position(1.0); // buy at 1.1, sl 1.09, tp 1.12
        let mut l = link();
        assert_eq!(follower_stops(&l, &m), (Some(1.09), Some(1.12)));
        l.protections.copy_tp = false;
        assert_eq!(follower_stops(&l, &m), (Some(1.09), None));
        l.protections.copy_tp = true;
        l.protections.copy_sl = false;
        assert_eq!(follower_stops(&l, &m), (None, Some(1.12)));
        l.protections.copy_sl = true;
        l.protections.max_sl_distance = Some(0.005);
        let (sl, _) = follower_stops(&l, &m);
        assert!((sl.unwrap() - 1.095).abs() < 1e-12, "{sl:?}");
        // A reversed copy sells: its stop is the master's take profit, capped above the price.
        l.reverse = true;
        let (sl, tp) = follower_stops(&l, &m);
        assert!((sl.unwrap() - 1.105).abs() < 1e-12, "{sl:?}");
        assert_eq!(tp, Some(1.09));
        // The switch for all stops still rules.
        l.copy_sl_tp = false;
        assert_eq!(follower_stops(&l, &m), (None, None));
    }

    #[test]
    fn the_minimum_lot_replaces_a_skip_and_small_master_trades_are_not_copied() {
        let mut l = link();
        l.lot_value = 0.001; // 1 lot -> 0.001, below the minimum 0.01
        let skipped = open_order(&l, &position(1.0), &Inputs::default(), &specs()).unwrap_err();
        assert!(
            skipped.message().contains("below its minimum"),
            "{}",
            skipped.message()
        );
        l.protections.use_min_lot = true;
        assert_eq!(
            open_order(&l, &position(1.0), &Inputs::default(), &specs())
                .unwrap()
                .volume,
            0.01
        );
        // Not past a cap below the minimum.
        l.protections.max_lot = Some(0.005);
        assert!(open_order(&l, &position(1.0), &Inputs::default(), &specs()).is_err());
        let mut l = link();
        l.protections.min_master_lot = Some(0.5);
        let small = open_order(&l, &position(0.2), &Inputs::default(), &specs()).unwrap_err();
        assert!(
            small.message().contains("min_master_lot"),
            "{}",
            small.message()
        );
        assert!(open_order(&l, &position(0.5), &Inputs::default(), &specs()).is_ok());
    }

    #[test]
    fn symbols_resolve_across_prefixes_and_suffixes_against_the_followers_list() {
        for (symbol, core) in [
            ("EURUSD", Some("EURUSD")),
            ("EURUSD.m", Some("EURUSD")),
            ("EURUSDpro", Some("EURUSD")),
            ("mEURUSD", Some("EURUSD")),
            ("EURUSD_i", Some("EURUSD")),
            ("EUR/USD", Some("EURUSD")),
            ("BTC/USD", Some("BTCUSD")),
            ("#US30.cash", Some("US30")),
            ("US30_Z24", Some("US30Z24")),
            ("XAUUSD+", Some("XAUUSD")),
            ("Bitcoin", None),
            ("Brent", None),
            ("btcusd", None),
        ] {
            assert_eq!(symbol_core(symbol).as_deref(), core, "{symbol}");
        }
        let list = |names: &[&str]| -> HashMap<String, SymbolSpec> {
            names
                .iter()
                .map(|n| {
                    (
                        n.to_string(),
                        SymbolSpec {
                            symbol: n.to_string(),
                            ..specs()["EURUSD"].clone()
                        },
                    )
                })
                .collect()
        };
        let l = link();
        // Stripped on the master's side, added on the follower's.
        assert_eq!(
            follower_symbol(&l, "EURUSD.m", &list(&["EURUSDpro", "GBPUSDpro"])),
            Ok(("EURUSDpro".into(), true))
        );
        // A separated pair is not some other pair that shares a currency; names too short to
        // tell apart match only exactly.
        assert!(follower_symbol(&l, "EUR/USD", &list(&["BTC/USD"])).is_err());
        assert!(follower_symbol(&l, "Bitcoin", &list(&["Brent"])).is_err());
        // The same name wins; then the bare core over other variants.
        assert_eq!(
            follower_symbol(&l, "EURUSD.m", &list(&["EURUSD.m", "EURUSD"])),
            Ok(("EURUSD.m".into(), false))
        );
        assert_eq!(
            follower_symbol(&l, "EURUSD.m", &list(&["EURUSD", "EURUSD.pro"])),
            Ok(("EURUSD".into(), true))
        );
        // Alike by name but far in price: not the same instrument.
        let far_list: HashMap<String, SymbolSpec> = [(
            "EURUSDpro".to_string(),
            SymbolSpec {
                symbol: "EURUSDpro".into(),
                price: 2.0,
                ..spec("EURUSD")
            },
        )]
        .into_iter()
        .collect();
        let far_master = MasterPosition {
            symbol: "EURUSD.x".into(),
            ..position(1.0)
        };
        let far = open_order(&l, &far_master, &Inputs::default(), &far_list).unwrap_err();
        assert!(far.message().contains("trades at 2"), "{}", far.message());
        // Nothing, or several without a bare one: a skip naming the candidates.
        let none = follower_symbol(&l, "EURUSD.m", &list(&["GBPUSD"])).unwrap_err();
        assert!(none.contains("EURUSD.m is unknown"), "{none}");
        let many = follower_symbol(&l, "EURUSD", &list(&["EURUSD.a", "EURUSDpro"])).unwrap_err();
        assert!(many.contains("EURUSD.a, EURUSDpro"), "{many}");
        let skipped = open_order(
            &l,
            &MasterPosition {
                symbol: "GBPUSD.x".into(),
                ..position(1.0)
            },
            &Inputs::default(),
            &list(&["EURUSD"]),
        )
        .unwrap_err();
        assert!(
            skipped.message().contains("GBPUSD.x is unknown"),
            "{}",
            skipped.message()
        );
    }

    #[test]
    fn the_symbol_map_renames_and_unknown_symbols_are_skipped() {
        let mut l = link();
        l.symbol_map.insert("EURUSD".into(), "EURUSD.m".into());
        assert_eq!(
            open_order(&l, &position(1.0), &Inputs::default(), &specs())
                .unwrap()
                .symbol,
            "EURUSD.m"
        );
        l.symbol_map.insert("EURUSD".into(), "EURUSD.x".into());
        assert!(
            open_order(&l, &position(1.0), &Inputs::default(), &specs())
                .unwrap_err()
                .message()
                .contains("EURUSD.x is unknown")
        );
    }

    #[test]
    fn links_copy_only_later_positions_unless_copy_existing() {
        let earlier = MasterPosition {
            first_seen_ms: Some(500),
            first_seen_us: None,
            open_time_ms: None,
            contract_size: None,
            ..position(1.0)
        };
        assert!(
            eligibility(&link(), &earlier, &Inputs::default())
                .unwrap_err()
                .message()
                .contains("before the link took effect")
        );
        assert!(
            eligibility(
                &Link {
                    copy_existing: true,
                    ..link()
                },
                &earlier,
                &Inputs::default()
            )
            .is_ok()
        );
        assert!(eligibility(&link(), &position(1.0), &Inputs::default()).is_ok());
        assert!(
            eligibility(
                &Link {
                    enabled: false,
                    ..link()
                },
                &position(1.0),
                &Inputs::default()
            )
            .unwrap_err()
            .message()
            .contains("close-only")
        );
    }

    #[test]
    fn protections_stop_new_copies_each_with_its_reason() {
        let with = |p: Protections| Link {
            protections: p,
            ..link()
        };
        let equity = |e: f64| Inputs {
            follower_equity: e,
            ..Inputs::default()
        };
        let at = |now: i64| Inputs {
            now_ms: Some(now),
            ..Inputs::default()
        };
        let sell = MasterPosition {
            side: Side::Sell,
            ..position(1.0)
        };
        let magic5 = MasterPosition {
            magic: 5,
            ..position(1.0)
        };
        let none = Inputs::default();
        let p = Protections::default;
        // (link, position, inputs, Err containing / None for Ok)
        let held = Inputs {
            risk_hold: true,
            ..Inputs::default()
        };
        let unread = Inputs {
            risk_unread: true,
            ..Inputs::default()
        };
        let cases: Vec<(Link, MasterPosition, Inputs, Option<&str>)> = vec![
            (with(p()), position(1.0), none, None),
            (with(p()), position(1.0), held, Some("reached a risk limit")),
            (
                with(Protections {
                    close_only: true,
                    ..p()
                }),
                position(1.0),
                none,
                Some("close-only"),
            ),
            (
                with(Protections {
                    symbols: Some(vec!["GBPUSD".into()]),
                    ..p()
                }),
                position(1.0),
                none,
                Some("master symbol EURUSD is not in the link's symbols"),
            ),
            (
                with(Protections {
                    symbols: Some(vec!["EURUSD".into()]),
                    ..p()
                }),
                position(1.0),
                none,
                None,
            ),
            (
                with(Protections {
                    magics: Some(vec![5]),
                    ..p()
                }),
                position(1.0),
                none,
                Some("master magic 0 is not in the link's magics"),
            ),
            (
                with(Protections {
                    magics: Some(vec![5]),
                    ..p()
                }),
                magic5,
                none,
                None,
            ),
            (
                with(Protections {
                    sides: Sides::Sell,
                    ..p()
                }),
                position(1.0),
                none,
                Some("only the master's sells"),
            ),
            (
                with(Protections {
                    sides: Sides::Buy,
                    ..p()
                }),
                sell.clone(),
                none,
                Some("only the master's buys"),
            ),
            (
                with(Protections {
                    sides: Sides::Sell,
                    ..p()
                }),
                sell,
                none,
                None,
            ),
            // Sides filter the master's side, before `reverse`.
            (
                Link {
                    reverse: true,
                    ..with(Protections {
                        sides: Sides::Buy,
                        ..p()
                    })
                },
                position(1.0),
                none,
                None,
            ),
            // First recorded at 2 000 ms.
            (
                with(Protections {
                    max_delay_ms: Some(1_000),
                    ..p()
                }),
                position(1.0),
                at(3_000),
                None,
            ),
            (
                with(Protections {
                    max_delay_ms: Some(1_000),
                    ..p()
                }),
                position(1.0),
                at(3_001),
                Some(
                    "1001 ms after the master position was first recorded, over the link's max_delay_ms 1000",
                ),
            ),
            (
                with(Protections {
                    equity_stop: Some(1_000.0),
                    ..p()
                }),
                position(1.0),
                equity(1_000.5),
                None,
            ),
            (
                with(Protections {
                    equity_stop: Some(1_000.0),
                    ..p()
                }),
                position(1.0),
                equity(1_000.0),
                Some(
                    "equity stop: the follower's equity 1000.00 is at or below the link's equity_stop 1000.00",
                ),
            ),
        ];
        // Risk limits whose figures could not be read: a wait, not a final decision.
        let waiting = eligibility(&with(p()), &position(1.0), &unread).unwrap_err();
        assert_eq!(waiting.code(), SkipCode::Waiting);
        assert!(
            waiting.message().contains("could not be read"),
            "{waiting:?}"
        );
        for (l, position, inputs, want) in cases {
            let got = eligibility(&l, &position, &inputs);
            match want {
                None => assert_eq!(got, Ok(()), "{:?}", l.protections),
                Some(text) => {
                    let err = got.unwrap_err();
                    assert!(
                        err.message().contains(text) && err.code().is_final(),
                        "{:?}: {err:?}",
                        l.protections
                    );
                }
            }
        }
    }

    #[test]
    fn max_lot_caps_without_rounding_over_the_cap() {
        let capped = |cap: f64| Link {
            protections: Protections {
                max_lot: Some(cap),
                ..Protections::default()
            },
            ..link()
        };
        let s = spec("EURUSD");
        let none = Inputs::default();
        assert_eq!(
            copy_volume(&capped(0.155), 1.0, &none, &s, None, &specs()),
            Ok(0.15)
        );
        assert_eq!(
            copy_volume(&capped(0.5), 0.3, &none, &s, None, &specs()),
            Ok(0.3)
        );
        assert_eq!(
            copy_volume(&capped(2.0), 3.0, &none, &s, None, &specs()),
            Ok(2.0)
        );
        assert!(
            copy_volume(&capped(0.005), 1.0, &none, &s, None, &specs())
                .unwrap_err()
                .message()
                .contains("below its minimum")
        );
    }

    #[test]
    fn risk_percent_sizes_by_the_copys_stop_loss() {
        let risk = Link {
            lot_mode: LotMode::RiskPercent,
            lot_value: 1.0,
            ..link()
        };
        let inputs = Inputs {
            follower_equity: 10_000.0,
            ..Inputs::default()
        };
        // 1 % of 10 000 = 100; the stop is 0.01 away and a lot moves 100 000 per 1.0: 0.1 lots.
        let o = open_order(&risk, &position(1.0), &inputs, &specs()).unwrap();
        assert_eq!(o.volume, 0.1);
        // Reversed, the copy's stop is the master's take profit (0.02 away): half the volume.
        let reversed = Link {
            reverse: true,
            ..risk.clone()
        };
        let o = open_order(&reversed, &position(1.0), &inputs, &specs()).unwrap();
        assert_eq!((o.side, o.volume), (Side::Sell, 0.05));
        let no_stop = MasterPosition {
            sl: None,
            ..position(1.0)
        };
        for (l, p) in [
            (risk.clone(), no_stop),
            (
                Link {
                    copy_sl_tp: false,
                    ..risk.clone()
                },
                position(1.0),
            ),
        ] {
            assert!(
                open_order(&l, &p, &inputs, &specs())
                    .unwrap_err()
                    .message()
                    .contains("risk_percent needs a stop loss")
            );
        }
    }

    #[test]
    fn max_slippage_becomes_the_orders_price_limit_on_the_copys_side() {
        let slip = Link {
            protections: Protections {
                max_slippage: Some(0.0005),
                ..Protections::default()
            },
            ..link()
        };
        let none = Inputs::default();
        let o = open_order(&slip, &position(1.0), &none, &specs()).unwrap();
        assert_eq!((o.side, o.price_limit), (Side::Buy, Some(1.1005)));
        let reversed = Link {
            reverse: true,
            ..slip
        };
        let o = open_order(&reversed, &position(1.0), &none, &specs()).unwrap();
        assert_eq!(o.side, Side::Sell);
        assert!((o.price_limit.unwrap() - 1.0995).abs() < 1e-12);
        let plain = open_order(&link(), &position(1.0), &none, &specs()).unwrap();
        assert_eq!(plain.price_limit, None);
    }

    fn priced(symbol: &str, price: f64, profit: &str) -> SymbolSpec {
        SymbolSpec {
            price,
            profit_currency: Some(profit.parse().unwrap()),
            ..spec(symbol)
        }
    }

    fn ccy(c: &str) -> Option<Currency> {
        Some(c.parse().unwrap())
    }

    #[test]
    fn conversion_rates_come_from_the_followers_quotes_either_way_round() {
        let specs: HashMap<String, SymbolSpec> =
            [("EURUSD.m", 1.25, "USD"), ("USDJPY", 150.0, "JPY")]
                .iter()
                .map(|(s, p, c)| (s.to_string(), priced(s, *p, c)))
                .collect();
        let rate =
            |a: &str, b: &str| conversion_rate(a.parse().unwrap(), b.parse().unwrap(), &specs);
        assert_eq!(rate("USD", "USD"), Some(1.0));
        assert_eq!(
            rate("EUR", "USD"),
            Some(1.25),
            "EURUSD.m's price, suffix and all"
        );
        assert_eq!(rate("USD", "EUR"), Some(0.8), "one over it");
        assert_eq!(rate("USD", "JPY"), Some(150.0));
        assert_eq!(
            rate("EUR", "JPY"),
            None,
            "no EURJPY quoted: no guess through USD"
        );
    }

    #[test]
    fn ratio_modes_convert_the_followers_money_into_the_masters_currency() {
        let specs: HashMap<String, SymbolSpec> = [("EURUSD", priced("EURUSD", 1.25, "USD"))]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let funds = Inputs {
            follower_balance: 8_000.0,
            follower_equity: 8_000.0,
            master_balance: Some(10_000.0),
            master_equity: Some(10_000.0),
            follower_currency: ccy("EUR"),
            master_currency: ccy("USD"),
            now_ms: None,
            risk_hold: false,
            risk_unread: false,
        };
        let l = Link {
            lot_mode: LotMode::BalanceRatio,
            lot_value: 1.0,
            ..link()
        };
        // 8,000 EUR is 10,000 USD: the same size as the master's.
        assert_eq!(
            copy_volume(&l, 1.0, &funds, &specs["EURUSD"], None, &specs),
            Ok(1.0)
        );
        let same = Inputs {
            follower_currency: ccy("USD"),
            ..funds
        };
        assert_eq!(
            copy_volume(&l, 1.0, &same, &specs["EURUSD"], None, &specs),
            Ok(0.8)
        );
        // A currency the broker cannot convert: a wait, never a guess.
        let yen = Inputs {
            follower_currency: ccy("JPY"),
            ..funds
        };
        let err = copy_volume(&l, 1.0, &yen, &specs["EURUSD"], None, &specs).unwrap_err();
        assert!(
            matches!(&err, NotNow::Wait(why) if why.contains("converting JPY to USD")),
            "{err:?}"
        );
        // Unknown currencies count alike (as before currencies were read).
        let unknown = Inputs {
            follower_currency: None,
            ..funds
        };
        assert_eq!(
            copy_volume(&l, 1.0, &unknown, &specs["EURUSD"], None, &specs),
            Ok(0.8)
        );
    }

    #[test]
    fn risk_percent_counts_the_loss_at_the_stop_in_the_followers_currency() {
        let specs: HashMap<String, SymbolSpec> = [
            ("EURUSD", priced("EURUSD", 1.25, "USD")),
            ("USDJPY", priced("USDJPY", 150.0, "JPY")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let l = Link {
            lot_mode: LotMode::RiskPercent,
            lot_value: 1.0,
            ..link()
        };
        let eur = Inputs {
            follower_equity: 10_000.0,
            follower_currency: ccy("EUR"),
            ..Inputs::default()
        };
        // 1 % of 10,000 EUR = 100 EUR. A 0.01 stop on EURUSD loses 1,000 USD a lot = 800 EUR.
        assert_eq!(
            copy_volume(&l, 1.0, &eur, &specs["EURUSD"], Some(0.01), &specs),
            Ok(0.13)
        );
        // On USDJPY the loss counts in yen: 1.5 yen a unit is 150,000 JPY a lot; no EURJPY pair.
        let err = copy_volume(&l, 1.0, &eur, &specs["USDJPY"], Some(1.5), &specs).unwrap_err();
        assert!(matches!(err, NotNow::Wait(_)), "{err:?}");
        let usd = Inputs {
            follower_currency: ccy("USD"),
            ..eur
        };
        // 100 USD against 150,000 JPY = 1,000 USD a lot: 0.1 lots.
        assert_eq!(
            copy_volume(&l, 1.0, &usd, &specs["USDJPY"], Some(1.5), &specs),
            Ok(0.1)
        );
    }

    #[test]
    fn fixed_stops_sit_their_points_from_the_open_price_on_the_copys_side() {
        let mut l = link();
        l.protections.sl_points = Some(200.0);
        l.protections.tp_points = Some(500.0);
        let s = spec("EURUSD");
        let master = (Some(1.05), Some(1.2));
        let (sl, tp) = fixed_stops(&l, Side::Buy, 1.1, &s, master).unwrap();
        assert!((sl.unwrap() - 1.098).abs() < 1e-9 && (tp.unwrap() - 1.105).abs() < 1e-9);
        let (sl, tp) = fixed_stops(&l, Side::Sell, 1.1, &s, master).unwrap();
        assert!((sl.unwrap() - 1.102).abs() < 1e-9 && (tp.unwrap() - 1.095).abs() < 1e-9);
        // Only the stop loss fixed: the master's take profit stays.
        l.protections.tp_points = None;
        assert_eq!(
            fixed_stops(&l, Side::Buy, 1.1, &s, master).unwrap().1,
            Some(1.2)
        );
        // No fixed stops: the master's as given.
        assert_eq!(fixed_stops(&link(), Side::Buy, 1.1, &s, master), Ok(master));
        // A symbol without a point size: a skip with its code, at the open.
        let unknown = SymbolSpec { point: 0.0, ..s };
        assert!(fixed_stops(&l, Side::Buy, 1.1, &unknown, master).is_err());
        let mut pos = position(1.0);
        pos.sl = Some(1.05);
        let err = open_order(
            &l,
            &pos,
            &Inputs::default(),
            &[("EURUSD".to_string(), unknown)].into_iter().collect(),
        )
        .unwrap_err();
        assert_eq!(err.code(), SkipCode::UnknownPoint);
        // Stops in points apply without copy_sl_tp, and risk_percent sizes by them.
        let mut risk = link();
        risk.copy_sl_tp = false;
        risk.lot_mode = LotMode::RiskPercent;
        risk.lot_value = 1.0;
        risk.protections.sl_points = Some(100.0);
        let funds = Inputs {
            follower_equity: 10_000.0,
            ..Inputs::default()
        };
        let order = open_order(&risk, &position(1.0), &funds, &specs()).unwrap();
        // 100 points = 0.001: 100 USD a lot; 1 % of 10,000 is 100: one lot.
        assert_eq!(order.volume, 1.0);
        // The order carries no fixed stop: it is set from the fill (a stop counted from the
        // master's older price could sit on the wrong side of a late copy's market).
        assert_eq!((order.sl, order.tp), (None, None));
        let mut with_master_tp = risk.clone();
        with_master_tp.copy_sl_tp = true;
        let mut pos = position(1.0);
        pos.tp = Some(1.2);
        let order = open_order(&with_master_tp, &pos, &funds, &specs()).unwrap();
        assert_eq!(
            (order.sl, order.tp),
            (None, Some(1.2)),
            "the master's take profit still goes with the order"
        );
    }

    #[test]
    fn partial_closes_scale_the_copy_in_proportion() {
        let s = spec("EURUSD");
        assert_eq!(trimmed_volume(0.5, 1.0, 0.6, &s), 0.3);
        assert_eq!(trimmed_volume(0.33, 1.0, 0.5, &s), 0.17);
        assert_eq!(
            trimmed_volume(0.01, 1.0, 0.5, &s),
            0.01,
            "never below the minimum while the master is open"
        );
        assert_eq!(trimmed_volume(0.5, 1.0, 1.0, &s), 0.5);
        assert_eq!(round_to_step(0.1 + 0.2, 0.01), 0.3);
    }
}
