//! Copy rules per link, as pure functions: which master positions a link copies, with what
//! symbol, side, volume and stops.

use std::collections::HashMap;
use std::str::FromStr;

use crate::broker::types::{OpenOrder, Side, SymbolSpec};

use super::{MasterPosition, client_order_id, marker};

/// How a copy's volume is computed from the master's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LotMode {
    /// Always `lot_value` lots.
    Fixed,
    /// Master volume × `lot_value`.
    Multiplier,
    /// Master volume × follower balance / master balance × `lot_value`.
    BalanceRatio,
    /// Master volume × follower equity / master equity × `lot_value`.
    EquityRatio,
}

impl FromStr for LotMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fixed" => Ok(LotMode::Fixed),
            "multiplier" => Ok(LotMode::Multiplier),
            "balance_ratio" => Ok(LotMode::BalanceRatio),
            "equity_ratio" => Ok(LotMode::EquityRatio),
            other => Err(format!("unknown lot_mode {other:?}")),
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
}

/// Money figures the ratio lot modes need.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Funds {
    pub follower_balance: f64,
    pub follower_equity: f64,
    pub master_balance: Option<f64>,
    pub master_equity: Option<f64>,
}

/// The follower's symbol for a master symbol.
pub fn follower_symbol(link: &Link, master_symbol: &str) -> String {
    link.symbol_map
        .get(master_symbol)
        .cloned()
        .unwrap_or_else(|| master_symbol.to_string())
}

/// The copy's side: the master's, or the opposite when the link reverses.
pub fn follower_side(link: &Link, side: Side) -> Side {
    if link.reverse { side.flip() } else { side }
}

/// The copy's (sl, tp): the master's, swapped when the link reverses (the master's take profit
/// is where a reversed copy must stop its loss), none when the link does not copy stops.
pub fn follower_stops(link: &Link, sl: Option<f64>, tp: Option<f64>) -> (Option<f64>, Option<f64>) {
    match (link.copy_sl_tp, link.reverse) {
        (false, _) => (None, None),
        (true, false) => (sl, tp),
        (true, true) => (tp, sl),
    }
}

/// Why a link does not copy a master position at all (before any volume is computed).
pub fn eligibility(link: &Link, position: &MasterPosition) -> Result<(), String> {
    if !link.enabled {
        return Err("link disabled: close-only".into());
    }
    match position.first_seen_ms {
        Some(seen) if seen < link.created_at_ms && !link.copy_existing => Err(format!(
            "position was open before the link took effect (first recorded {seen} ms, link {} ms) and the link does not copy existing positions",
            link.created_at_ms
        )),
        _ => Ok(()),
    }
}

/// Rounds to the nearest multiple of `step` (with a guard against binary fractions).
pub fn round_to_step(volume: f64, step: f64) -> f64 {
    if step <= 0.0 {
        return volume;
    }
    let steps = (volume / step + 1e-9).round();
    ((steps * step) * 1e8).round() / 1e8
}

/// The copy's volume for a master volume, rounded to the follower symbol's step and capped at
/// its maximum; below the minimum it is skipped (with the reason), never silently resized.
pub fn copy_volume(
    link: &Link,
    master_volume: f64,
    funds: &Funds,
    spec: &SymbolSpec,
) -> Result<f64, String> {
    let raw = match link.lot_mode {
        LotMode::Fixed => link.lot_value,
        LotMode::Multiplier => master_volume * link.lot_value,
        LotMode::BalanceRatio => {
            let master = funds
                .master_balance
                .filter(|b| *b > 0.0)
                .ok_or("balance_ratio needs the master's balance, which is not known yet")?;
            master_volume * funds.follower_balance / master * link.lot_value
        }
        LotMode::EquityRatio => {
            let master = funds
                .master_equity
                .filter(|e| *e > 0.0)
                .ok_or("equity_ratio needs the master's equity, which is not known yet")?;
            master_volume * funds.follower_equity / master * link.lot_value
        }
    };
    if !raw.is_finite() || raw <= 0.0 {
        return Err(format!("computed volume {raw} is not positive"));
    }
    let rounded = round_to_step(raw, spec.volume_step).min(spec.volume_max);
    if rounded + 1e-9 < spec.volume_min {
        return Err(format!(
            "volume {raw:.4} rounds to {rounded} on {}, below its minimum {}: skipped, not resized",
            spec.symbol, spec.volume_min
        ));
    }
    Ok(rounded)
}

/// The order that copies `position` under `link`, or why it is not copied.
pub fn open_order(
    link: &Link,
    position: &MasterPosition,
    funds: &Funds,
    specs: &HashMap<String, SymbolSpec>,
) -> Result<OpenOrder, String> {
    eligibility(link, position)?;
    let symbol = follower_symbol(link, &position.symbol);
    let spec = specs
        .get(&symbol)
        .ok_or_else(|| format!("symbol {symbol} is unknown on the follower's broker"))?;
    let volume = copy_volume(link, position.volume, funds, spec)?;
    let (sl, tp) = follower_stops(link, position.sl, position.tp);
    Ok(OpenOrder {
        symbol,
        side: follower_side(link, position.side),
        volume,
        sl,
        tp,
        magic: link.magic,
        comment: marker(position.ticket),
        client_order_id: Some(client_order_id(link.id, position.ticket, "open")),
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

    pub fn spec(symbol: &str) -> SymbolSpec {
        SymbolSpec {
            symbol: symbol.into(),
            price: 1.1,
            volume_step: 0.01,
            volume_min: 0.01,
            volume_max: 100.0,
            contract_size: 100_000.0,
        }
    }

    pub fn link() -> Link {
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
        }
    }

    pub fn position(volume: f64) -> MasterPosition {
        MasterPosition {
            ticket: 42,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume,
            open_volume: volume,
            open_price: 1.1,
            sl: Some(1.09),
            tp: Some(1.12),
            first_seen_ms: Some(2_000),
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
        let funds = Funds {
            follower_balance: 5_000.0,
            follower_equity: 2_500.0,
            master_balance: Some(10_000.0),
            master_equity: Some(10_000.0),
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
                copy_volume(&l, master_volume, &funds, &spec("EURUSD")),
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
        let err = copy_volume(&l, 0.04, &Funds::default(), &spec("EURUSD")).unwrap_err();
        assert!(
            err.contains("below its minimum 0.01") && err.contains("not resized"),
            "{err}"
        );
        let ratio = Link {
            lot_mode: LotMode::BalanceRatio,
            ..link()
        };
        assert!(
            copy_volume(&ratio, 1.0, &Funds::default(), &spec("EURUSD"))
                .unwrap_err()
                .contains("master's balance")
        );
    }

    #[test]
    fn reverse_flips_the_side_and_swaps_the_stops() {
        let l = Link {
            reverse: true,
            ..link()
        };
        let o = open_order(&l, &position(1.0), &Funds::default(), &specs()).unwrap();
        assert_eq!((o.side, o.sl, o.tp), (Side::Sell, Some(1.12), Some(1.09)));
        let plain = open_order(&link(), &position(1.0), &Funds::default(), &specs()).unwrap();
        assert_eq!(
            (plain.side, plain.sl, plain.tp),
            (Side::Buy, Some(1.09), Some(1.12))
        );
        let no_stops = Link {
            copy_sl_tp: false,
            ..link()
        };
        let o = open_order(&no_stops, &position(1.0), &Funds::default(), &specs()).unwrap();
        assert_eq!((o.sl, o.tp), (None, None));
    }

    #[test]
    fn orders_carry_magic_marker_and_client_order_id() {
        let o = open_order(&link(), &position(1.0), &Funds::default(), &specs()).unwrap();
        assert_eq!(
            (o.magic, o.comment.as_str(), o.client_order_id.as_deref()),
            (100_007, "mc42", Some("l7-m42-open"))
        );
    }

    #[test]
    fn the_symbol_map_renames_and_unknown_symbols_are_skipped() {
        let mut l = link();
        l.symbol_map.insert("EURUSD".into(), "EURUSD.m".into());
        assert_eq!(
            open_order(&l, &position(1.0), &Funds::default(), &specs())
                .unwrap()
                .symbol,
            "EURUSD.m"
        );
        l.symbol_map.insert("EURUSD".into(), "EURUSD.x".into());
        assert!(
            open_order(&l, &position(1.0), &Funds::default(), &specs())
                .unwrap_err()
                .contains("EURUSD.x is unknown")
        );
    }

    #[test]
    fn links_copy_only_later_positions_unless_copy_existing() {
        let earlier = MasterPosition {
            first_seen_ms: Some(500),
            ..position(1.0)
        };
        assert!(
            eligibility(&link(), &earlier)
                .unwrap_err()
                .contains("before the link took effect")
        );
        assert!(
            eligibility(
                &Link {
                    copy_existing: true,
                    ..link()
                },
                &earlier
            )
            .is_ok()
        );
        assert!(eligibility(&link(), &position(1.0)).is_ok());
        assert!(
            eligibility(
                &Link {
                    enabled: false,
                    ..link()
                },
                &position(1.0)
            )
            .unwrap_err()
            .contains("close-only")
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
