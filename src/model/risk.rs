//! A follower's risk limits as data (what a limit watches, over which period, what reaching it
//! does, and its state): stored by the database layer, judged by the copy engine
//! ([`crate::copier::risk`]), shown by the operator commands. The periods follow the broker's
//! server clock (see the judging module).

use std::fmt;

use crate::model::named::named;

named! {
    /// How long a limit's period lasts (`risk_limits.period`).
    pub enum Period as "period" {
        Daily = "daily": "from 00:00 to 24:00 on the broker's server clock",
        Weekly = "weekly": "from Monday 00:00 on the broker's server clock",
        Monthly = "monthly": "from the 1st of the month on the broker's server clock",
        Lifetime = "lifetime": "never ends; only an operator resets it",
    }
}

impl Period {
    /// The period holding `server_ms` (the server clock in Unix-epoch milliseconds, as shown):
    /// `2026-11-30`, `week of 2026-11-30` (its Monday), `2026-11`, or `lifetime`.
    pub fn key(self, server_ms: i64) -> String {
        let days = server_ms.div_euclid(86_400_000);
        match self {
            Period::Daily => {
                let (y, m, d) = civil(days);
                format!("{y:04}-{m:02}-{d:02}")
            }
            Period::Weekly => {
                // 1970-01-01 was a Thursday: Monday is 0.
                let monday = days - (days + 3).rem_euclid(7);
                let (y, m, d) = civil(monday);
                format!("week of {y:04}-{m:02}-{d:02}")
            }
            Period::Monthly => {
                let (y, m, _) = civil(days);
                format!("{y:04}-{m:02}")
            }
            Period::Lifetime => "lifetime".to_string(),
        }
    }
}

/// The (year, month, day) of a day count since 1970-01-01 (proleptic Gregorian).
fn civil(days: i64) -> (i64, u32, u32) {
    // Howard Hinnant's days-to-civil, eras of 400 years.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

named! {
    /// What a limit watches (`risk_limits.basis`).
    pub enum Basis as "basis" {
        Balance = "balance": "the account's balance",
        Equity = "equity": "the account's equity (balance and open profit)",
    }
}

named! {
    /// What reaching a limit does (`risk_limits.action`).
    pub enum RiskAction as "action" {
        /// No new copies until the limit resets; open copies follow the master as usual.
        CloseOnly = "close_only": "no new copies until the limit resets",
        /// Close every copy at once, then no new copies until the limit resets.
        CloseAll = "close_all": "close every copy at once, then no new copies until it resets",
    }
}

/// A limit's state in its period (stored on its row, written by the account's owner).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RiskState {
    /// The period `start_value` belongs to (`None`: not started, or reset by an operator).
    pub period_key: Option<String>,
    pub start_value: Option<f64>,
    /// Why the limit was reached in this period (`None`: not reached).
    pub hit: Option<String>,
}

/// One risk limit of a follower.
#[derive(Debug, Clone, PartialEq)]
pub struct RiskLimit {
    pub id: i64,
    pub period: Period,
    pub basis: Basis,
    /// `amount` is a percent of the period's starting value (else money, the account's currency).
    pub relative: bool,
    pub amount: f64,
    pub action: RiskAction,
    pub state: RiskState,
}

impl fmt::Display for RiskLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} drawdown of {}{}",
            self.period.as_str(),
            self.basis.as_str(),
            self.amount,
            if self.relative { " %" } else { "" }
        )
    }
}
