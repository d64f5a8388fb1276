//! Symbols, prices and the trading rules the simulated trade server enforces.

use std::collections::{BTreeMap, HashMap};

use crate::broker::types::{Currency, Side, SymbolSpec};

/// The default symbols (docs/design/bridge-protocol.md), each also with a `.m` suffix.
const BASE: &[(&str, f64, f64, f64, &str)] = &[
    // symbol, price, contract size, point, profit currency
    ("EURUSD", 1.1000, 100_000.0, 0.00001, "USD"),
    ("GBPUSD", 1.2700, 100_000.0, 0.00001, "USD"),
    ("USDJPY", 150.00, 100_000.0, 0.001, "JPY"),
    ("XAUUSD", 2000.00, 100.0, 0.01, "USD"),
];

/// Tolerance when checking that a volume is a whole number of steps.
const STEP_EPSILON: f64 = 1e-7;

/// The market: symbol rules, current prices and trading hours.
#[derive(Debug, Clone)]
pub struct Market {
    symbols: BTreeMap<String, SymbolSpec>,
    base_prices: BTreeMap<String, f64>,
    ticks: u64,
    /// Each listed symbol's base symbol (`XAUUSD.m` -> `XAUUSD`).
    bases: HashMap<String, String>,
    /// Daily trading sessions by base symbol (absent: always open).
    sessions: HashMap<String, Sessions>,
    /// The switch over the sessions by base symbol: open or closed now, whatever they say.
    switched: HashMap<String, bool>,
}

/// A symbol's daily trading sessions on the server's clock (UTC here), each `[start, end)` in
/// minutes of the day; an end at or before its start runs past midnight (`22:00-06:00`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sessions(pub Vec<(u32, u32)>);

impl Sessions {
    /// Parses `HH:MM-HH:MM[,HH:MM-HH:MM...]` (`24:00` ends a day).
    pub fn parse(text: &str) -> Result<Sessions, String> {
        let minute = |t: &str| -> Result<u32, String> {
            let (h, m) = t
                .split_once(':')
                .filter(|(h, m)| {
                    !h.is_empty()
                        && !m.is_empty()
                        && h.len() <= 2
                        && m.len() == 2
                        && (h.to_string() + m).bytes().all(|b| b.is_ascii_digit())
                })
                .ok_or_else(|| format!("{t:?} is not HH:MM"))?;
            let (h, m): (u32, u32) = (
                h.parse().map_err(|_| format!("{t:?} is not HH:MM"))?,
                m.parse().map_err(|_| format!("{t:?} is not HH:MM"))?,
            );
            if m >= 60 || h > 24 || (h == 24 && m > 0) {
                return Err(format!("{t:?} is not a time of day"));
            }
            Ok(h * 60 + m)
        };
        let windows = text
            .split(',')
            .map(|w| {
                let (a, b) = w
                    .trim()
                    .split_once('-')
                    .ok_or_else(|| format!("{w:?} is not HH:MM-HH:MM"))?;
                let (start, end) = (minute(a.trim())?, minute(b.trim())?);
                if start == end {
                    return Err(format!(
                        "{w:?} is empty or ambiguous: a whole day is 00:00-24:00"
                    ));
                }
                Ok((start, end))
            })
            .collect::<Result<Vec<_>, String>>()?;
        if windows.is_empty() {
            return Err("no session".into());
        }
        Ok(Sessions(windows))
    }

    /// True when `now_ms` (Unix ms) falls in a session.
    pub fn open_at(&self, now_ms: i64) -> bool {
        let minute = (now_ms.rem_euclid(86_400_000) / 60_000) as u32;
        self.0.iter().any(|&(start, end)| {
            if start < end {
                (start..end).contains(&minute)
            } else {
                minute >= start || minute < end
            }
        })
    }
}

impl Default for Market {
    fn default() -> Self {
        Self::new()
    }
}

impl Market {
    pub fn new() -> Self {
        Self::with_suffixes(&["", ".m"])
    }

    /// The default symbols, each under every one of `suffixes` (`""`: the bare name), as a
    /// broker whose symbols carry its own suffix (`EURUSDpro`) lists them.
    pub fn with_suffixes(suffixes: &[&str]) -> Self {
        Self::with(suffixes, &std::collections::HashMap::new())
    }

    /// As [`Market::with_suffixes`], with contract sizes (units per lot) overridden by base
    /// symbol (`XAUUSD` -> 10 applies to every suffixed variant), as brokers differ.
    pub fn with(suffixes: &[&str], contracts: &std::collections::HashMap<String, f64>) -> Self {
        let mut symbols = BTreeMap::new();
        for (name, price, contract, point, profit) in BASE {
            for suffix in suffixes {
                let symbol = format!("{name}{suffix}");
                symbols.insert(
                    symbol.clone(),
                    SymbolSpec {
                        symbol,
                        price: *price,
                        volume_step: 0.01,
                        volume_min: 0.01,
                        volume_max: 100.0,
                        contract_size: contracts.get(*name).copied().unwrap_or(*contract),
                        point: *point,
                        profit_currency: profit.parse().ok(),
                    },
                );
            }
        }
        let base_prices = symbols.iter().map(|(k, s)| (k.clone(), s.price)).collect();
        let bases = BASE
            .iter()
            .flat_map(|(name, ..)| {
                suffixes
                    .iter()
                    .map(move |suffix| (format!("{name}{suffix}"), name.to_string()))
            })
            .collect();
        Market {
            symbols,
            base_prices,
            ticks: 0,
            bases,
            sessions: HashMap::new(),
            switched: HashMap::new(),
        }
    }

    /// Sets a price now (a test's or an operator's switch; the price walk, if on, moves around
    /// it): of `symbol` alone, or with `variants` of a base symbol and every suffixed variant
    /// (`EURUSD` moves `EURUSD.m` too). A base symbol that is not listed itself (every symbol
    /// suffixed) names its variants either way. Returns the symbols it moved, sorted.
    pub fn set_price(
        &mut self,
        symbol: &str,
        price: f64,
        variants: bool,
    ) -> Result<Vec<String>, String> {
        if !(price.is_finite() && price > 0.0) {
            return Err(format!("price {price} is not a positive number"));
        }
        let listed = self.symbols.contains_key(symbol);
        let is_base = (variants || !listed) && self.bases.values().any(|b| b == symbol);
        if !is_base && !listed {
            let known: Vec<&String> = self.symbols.keys().collect();
            return Err(format!(
                "unknown symbol {symbol} (this server has {known:?}, and their base symbols)"
            ));
        }
        let mut moved: Vec<String> = self
            .symbols
            .keys()
            .filter(|s| {
                s.as_str() == symbol
                    || (is_base && self.bases.get(s.as_str()).is_some_and(|b| b == symbol))
            })
            .cloned()
            .collect();
        moved.sort();
        for s in &moved {
            if let Some(spec) = self.symbols.get_mut(s) {
                spec.price = price;
            }
            self.base_prices.insert(s.clone(), price);
        }
        Ok(moved)
    }

    /// Trading sessions of `base` (and every suffixed variant); outside them orders on it are
    /// refused with `market closed`. An error for a name that is not a base symbol here.
    pub fn set_sessions(&mut self, base: &str, sessions: Sessions) -> Result<(), String> {
        self.check_base(base)?;
        self.sessions.insert(base.to_string(), sessions);
        Ok(())
    }

    /// Opens (`Some(true)`) or closes (`Some(false)`) `base`'s market now, whatever its sessions
    /// say, or hands it back to them (`None`).
    pub fn switch(&mut self, base: &str, open: Option<bool>) -> Result<(), String> {
        self.check_base(base)?;
        match open {
            Some(open) => self.switched.insert(base.to_string(), open),
            None => self.switched.remove(base),
        };
        Ok(())
    }

    fn check_base(&self, base: &str) -> Result<(), String> {
        if self.bases.values().any(|b| b == base) {
            return Ok(());
        }
        let mut known: Vec<&String> = self.bases.values().collect();
        known.sort();
        known.dedup();
        Err(format!(
            "{base} is not a base symbol of this server (trading hours apply to a base symbol and its suffixed variants: {known:?})"
        ))
    }

    /// `Err("market closed ...")` when `symbol`'s market is closed at `now_ms`.
    pub fn check_open(&self, symbol: &str, now_ms: i64) -> Result<(), String> {
        let Some(base) = self.bases.get(symbol) else {
            return Ok(());
        };
        let open = match self.switched.get(base) {
            Some(open) => *open,
            None => self.sessions.get(base).is_none_or(|s| s.open_at(now_ms)),
        };
        if open {
            Ok(())
        } else {
            Err(format!("market closed for {symbol}"))
        }
    }

    pub fn spec(&self, symbol: &str) -> Option<&SymbolSpec> {
        self.symbols.get(symbol)
    }

    pub fn specs(&self) -> Vec<SymbolSpec> {
        self.symbols.values().cloned().collect()
    }

    pub fn price(&self, symbol: &str) -> Option<f64> {
        self.symbols.get(symbol).map(|s| s.price)
    }

    /// Moves every price one tick along a deterministic wave (period 600 ticks, amplitude
    /// 0.5 %, a different phase per symbol), so runs are repeatable.
    pub fn tick(&mut self) {
        self.ticks += 1;
        for (i, (name, spec)) in self.symbols.iter_mut().enumerate() {
            let base = self.base_prices[name];
            let phase = i as f64 * 0.7;
            let wave = (self.ticks as f64 * std::f64::consts::TAU / 600.0 + phase).sin();
            spec.price = round_price(base * (1.0 + 0.005 * wave), base);
        }
    }

    /// Checks a volume against the symbol's step, minimum and maximum.
    pub fn check_volume(&self, symbol: &str, volume: f64) -> Result<(), String> {
        let spec = self
            .spec(symbol)
            .ok_or_else(|| format!("unknown symbol {symbol}"))?;
        check_volume(spec, volume)
    }

    /// How many units of `currency` one US dollar buys, from the bare symbols' prices
    /// (`EURUSD` for EUR, `USDJPY` for JPY); `None` for a currency the market cannot price.
    pub fn usd_in(&self, currency: Currency) -> Option<f64> {
        let c = currency.as_str();
        if c == "USD" {
            return Some(1.0);
        }
        if let Some(p) = self.price(&format!("{c}USD")).filter(|p| *p > 0.0) {
            return Some(1.0 / p);
        }
        self.price(&format!("USD{c}")).filter(|p| *p > 0.0)
    }

    /// Profit of `volume` lots of `side` from `open` to `close`, in US dollars.
    pub fn profit(&self, symbol: &str, side: Side, volume: f64, open: f64, close: f64) -> f64 {
        let Some(spec) = self.spec(symbol) else {
            return 0.0;
        };
        let quote = side.sign() * (close - open) * volume * spec.contract_size;
        // Profit is in the quote currency: USD for EURUSD, yen for USDJPY (converted at the
        // closing price).
        let pair = symbol.trim_end_matches(".m");
        if !pair.ends_with("USD") && pair.starts_with("USD") {
            quote / close
        } else {
            quote
        }
    }
}

/// Checks a volume against a symbol's step, minimum and maximum.
pub fn check_volume(spec: &SymbolSpec, volume: f64) -> Result<(), String> {
    if !volume.is_finite() || volume <= 0.0 {
        return Err(format!("invalid volume {volume}"));
    }
    if volume + STEP_EPSILON < spec.volume_min {
        return Err(format!(
            "volume {volume} below the minimum {} for {}",
            spec.volume_min, spec.symbol
        ));
    }
    if volume > spec.volume_max + STEP_EPSILON {
        return Err(format!(
            "volume {volume} above the maximum {} for {}",
            spec.volume_max, spec.symbol
        ));
    }
    let steps = volume / spec.volume_step;
    if (steps - steps.round()).abs() > STEP_EPSILON * 100.0 {
        return Err(format!(
            "volume {volume} is not a multiple of the step {} for {}",
            spec.volume_step, spec.symbol
        ));
    }
    Ok(())
}

/// A buy fills at most at its price limit, a sell at least at it.
pub fn check_price_limit(side: Side, price: f64, limit: Option<f64>) -> Result<(), String> {
    let beyond = match (side, limit) {
        (_, None) => false,
        (Side::Buy, Some(l)) => price > l + 1e-9,
        (Side::Sell, Some(l)) => price < l - 1e-9,
    };
    if beyond {
        return Err(format!(
            "price {price} is beyond the order's price limit {}",
            limit.unwrap_or_default()
        ));
    }
    Ok(())
}

/// Checks stop loss and take profit against the side and the current price: a buy's stop is
/// below the price and its target above; a sell's the other way round.
pub fn check_stops(side: Side, price: f64, sl: Option<f64>, tp: Option<f64>) -> Result<(), String> {
    for (name, level) in [("sl", sl), ("tp", tp)] {
        if let Some(v) = level
            && (!v.is_finite() || v <= 0.0)
        {
            return Err(format!("invalid {name} {v}"));
        }
    }
    let (below, above) = match side {
        Side::Buy => (sl, tp),
        Side::Sell => (tp, sl),
    };
    if let Some(v) = below
        && v >= price
    {
        return Err(format!(
            "invalid stops: {} {v} must be below the price {price} for a {side:?}",
            if side == Side::Buy { "sl" } else { "tp" }
        ));
    }
    if let Some(v) = above
        && v <= price
    {
        return Err(format!(
            "invalid stops: {} {v} must be above the price {price} for a {side:?}",
            if side == Side::Buy { "tp" } else { "sl" }
        ));
    }
    Ok(())
}

/// Rounds a price to the precision of its base (5 decimals for FX, 3 for JPY and gold).
fn round_price(price: f64, base: f64) -> f64 {
    let digits = if base >= 100.0 { 1000.0 } else { 100_000.0 };
    (price * digits).round() / digits
}

/// Rounds a volume to 2 decimals (the default step), for stored volumes after partial closes.
pub fn round_volume(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_symbols_and_prices() {
        let m = Market::new();
        for (s, p) in [
            ("EURUSD", 1.1),
            ("GBPUSD", 1.27),
            ("USDJPY", 150.0),
            ("XAUUSD", 2000.0),
            ("EURUSD.m", 1.1),
            ("XAUUSD.m", 2000.0),
        ] {
            assert_eq!(m.price(s), Some(p), "{s}");
        }
        assert!(m.price("BTCUSD").is_none());
    }

    #[test]
    fn a_price_moves_its_symbol_alone_or_with_variants_a_base_symbols_variants_too() {
        let mut m = Market::with_suffixes(&["", ".m", "pro"]);
        assert_eq!(m.set_price("EURUSD", 1.1, false).unwrap(), ["EURUSD"]);
        let moved = m.set_price("EURUSD", 1.2, true).unwrap();
        assert_eq!(moved, ["EURUSD", "EURUSD.m", "EURUSDpro"]);
        assert!(
            ["EURUSD", "EURUSD.m", "EURUSDpro"]
                .iter()
                .all(|s| m.spec(s).unwrap().price == 1.2)
        );
        assert_eq!(m.set_price("EURUSD.m", 1.3, true).unwrap(), ["EURUSD.m"]);
        assert_eq!(m.spec("EURUSD").unwrap().price, 1.2);
        // A base that is not listed itself (every symbol suffixed) still names its variants.
        let mut only = Market::with_suffixes(&["pro"]);
        assert_eq!(
            only.set_price("XAUUSD", 2100.0, false).unwrap(),
            ["XAUUSDpro"]
        );
        let unknown = only.set_price("EURJPY", 160.0, true).unwrap_err();
        assert!(unknown.contains("unknown symbol EURJPY"), "{unknown}");
    }

    #[test]
    fn volumes_follow_step_min_and_max() {
        let m = Market::new();
        for ok in [0.01, 0.1, 1.0, 1.23, 100.0] {
            assert!(m.check_volume("EURUSD", ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            (0.0, "invalid"),
            (0.005, "below the minimum"),
            (100.01, "above the maximum"),
            (0.015, "multiple of the step"),
            (f64::NAN, "invalid"),
        ] {
            let err = m.check_volume("EURUSD", bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
        assert!(
            m.check_volume("NOPE", 1.0)
                .unwrap_err()
                .contains("unknown symbol")
        );
    }

    #[test]
    fn stops_must_sit_on_the_right_side_of_the_price() {
        assert!(check_stops(Side::Buy, 1.1, Some(1.09), Some(1.11)).is_ok());
        assert!(check_stops(Side::Sell, 1.1, Some(1.11), Some(1.09)).is_ok());
        assert!(check_stops(Side::Buy, 1.1, Some(1.11), None).is_err());
        assert!(check_stops(Side::Sell, 1.1, None, Some(1.11)).is_err());
        assert!(check_stops(Side::Buy, 1.1, Some(-1.0), None).is_err());
    }

    #[test]
    fn profit_in_account_currency() {
        let m = Market::new();
        assert!((m.profit("EURUSD", Side::Buy, 1.0, 1.1, 1.101) - 100.0).abs() < 1e-6);
        assert!((m.profit("EURUSD", Side::Sell, 1.0, 1.1, 1.101) + 100.0).abs() < 1e-6);
        assert!((m.profit("XAUUSD", Side::Buy, 0.1, 2000.0, 2010.0) - 100.0).abs() < 1e-6);
        let jpy = m.profit("USDJPY", Side::Buy, 1.0, 150.0, 150.15);
        assert!((jpy - 15_000.0 / 150.15).abs() < 1e-6);
    }

    #[test]
    fn the_price_walk_is_deterministic_and_bounded() {
        let mut a = Market::new();
        let mut b = Market::new();
        for _ in 0..1000 {
            a.tick();
            b.tick();
        }
        assert_eq!(a.price("EURUSD"), b.price("EURUSD"));
        let p = a.price("EURUSD").unwrap();
        assert!((p - 1.1).abs() <= 1.1 * 0.0051, "{p}");
    }
}

#[cfg(test)]
mod session_tests {
    use super::*;

    const H: i64 = 3_600_000;

    #[test]
    fn sessions_open_and_close_by_the_minute_of_the_server_day() {
        let day = Sessions::parse("01:00-23:00").unwrap();
        let monday = 1_700_438_400_000; // 2023-11-20 00:00 UTC
        assert!(!day.open_at(monday));
        assert!(day.open_at(monday + H));
        assert!(day.open_at(monday + 23 * H - 1));
        assert!(!day.open_at(monday + 23 * H));
        let night = Sessions::parse("22:00-06:00, 12:00-12:30").unwrap();
        assert!(night.open_at(monday + 23 * H) && night.open_at(monday + 5 * H));
        assert!(!night.open_at(monday + 6 * H));
        assert!(night.open_at(monday + 12 * H + 29 * 60_000));
        assert!(!night.open_at(monday + 12 * H + 30 * 60_000));
        assert!(
            Sessions::parse("00:00-24:00")
                .unwrap()
                .open_at(monday + 23 * H + 59 * 60_000)
        );
        for bad in [
            "",
            "9-17",
            "09:00",
            "25:00-26:00",
            "09:60-10:00",
            "09:00-09:00",
            "+9:00-17:00",
            "09:0-17:00",
            "09:00-17:00,",
        ] {
            assert!(Sessions::parse(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn a_closed_market_refuses_every_variant_of_its_symbol_and_the_switch_overrides_sessions() {
        let mut m = Market::new();
        let monday = 1_700_438_400_000;
        m.set_sessions("XAUUSD", Sessions::parse("01:00-23:00").unwrap())
            .unwrap();
        assert!(
            m.set_sessions("XAUUSD.m", Sessions::parse("01:00-23:00").unwrap())
                .is_err(),
            "a suffixed name is not a base symbol"
        );
        assert!(m.switch("GOLD", Some(true)).is_err());
        for s in ["XAUUSD", "XAUUSD.m"] {
            let e = m.check_open(s, monday).unwrap_err();
            assert!(e.starts_with("market closed"), "{e}");
            assert!(m.check_open(s, monday + H).is_ok());
        }
        assert!(
            m.check_open("EURUSD", monday).is_ok(),
            "other symbols trade"
        );
        m.switch("XAUUSD", Some(true)).unwrap();
        assert!(m.check_open("XAUUSD.m", monday).is_ok());
        m.switch("XAUUSD", Some(false)).unwrap();
        assert!(m.check_open("XAUUSD", monday + H).is_err());
        m.switch("XAUUSD", None).unwrap();
        assert!(m.check_open("XAUUSD", monday + H).is_ok());
    }
}
