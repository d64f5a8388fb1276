//! The words of a trade that every layer speaks: a side, a pending order's kind, a currency.
//! Defined here, at the bottom, so that the broker adapter, the database layer and the copy
//! engine share them without depending on one another.

use serde::{Deserialize, Serialize};

/// Direction of a position or order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    Buy,
    Sell,
}

impl Side {
    pub fn flip(self) -> Side {
        match self {
            Side::Buy => Side::Sell,
            Side::Sell => Side::Buy,
        }
    }

    /// +1 for buy, -1 for sell.
    pub fn sign(self) -> f64 {
        match self {
            Side::Buy => 1.0,
            Side::Sell => -1.0,
        }
    }
}

impl std::str::FromStr for Side {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "buy" => Ok(Side::Buy),
            "sell" => Ok(Side::Sell),
            other => Err(format!("expected buy or sell, got {other:?}")),
        }
    }
}

/// How a pending order fills: a limit order when the price comes to its price from the side it
/// waits on (a buy limit below the market, a sell limit above), a stop order when the price
/// breaks through it (a buy stop above the market, a sell stop below).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PendingKind {
    Limit,
    Stop,
}

/// A currency code: three capital letters (ISO 4217: `USD`, `EUR`, `JPY`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Currency([u8; 3]);

impl Currency {
    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("ASCII letters by construction")
    }
}

impl std::str::FromStr for Currency {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let b = s.as_bytes();
        if b.len() == 3 && b.iter().all(u8::is_ascii_uppercase) {
            Ok(Currency([b[0], b[1], b[2]]))
        } else {
            Err(format!(
                "`{s}` is not a currency code (three capital letters, e.g. USD)"
            ))
        }
    }
}

impl TryFrom<String> for Currency {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Currency> for String {
    fn from(c: Currency) -> String {
        c.as_str().to_string()
    }
}

impl std::fmt::Display for Currency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for Currency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
