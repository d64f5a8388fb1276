//! Risk limits over time, per follower, as pure functions: which period a moment of the broker's
//! server clock falls in, and whether a drawdown limit is reached in it.
//!
//! A limit measures the drawdown of the follower's balance or equity from its value at the start
//! of the period (the first reading in it), in money (`absolute`) or in percent of that value
//! (`relative`). Periods are bounded by the broker's server clock, read as the trade server shows
//! it (MT4/MT5 servers count their trading day in their own time zone, commonly UTC+2/+3, and
//! report it as a plain date and time): a day from 00:00 to 24:00 server time, a week from
//! Monday 00:00, a month from the 1st. `lifetime` never ends; only an operator resets it.

pub use crate::model::risk::{Basis, Period, RiskAction, RiskLimit, RiskState};

/// A limit judged on one reading of the account.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The state to keep (equal to the limit's unless something changed).
    pub state: RiskState,
    /// The state differs from the stored one: write it.
    pub changed: bool,
    /// The limit was reached on this reading (not before in this period).
    pub newly_hit: bool,
    /// A new period began (a limit reached in the last one no longer holds).
    pub new_period: bool,
}

/// Judges `limit` on a reading of the account's `balance` and `equity` at `server_ms` (the broker
/// server's clock). The first reading of a period sets its starting value; the limit is reached
/// when the drawdown from it is at least the amount (relative: that percent of the starting
/// value), and stays reached until the period ends or an operator resets it.
pub fn evaluate(limit: &RiskLimit, balance: f64, equity: f64, server_ms: i64) -> Evaluation {
    let value = match limit.basis {
        Basis::Balance => balance,
        Basis::Equity => equity,
    };
    let key = limit.period.key(server_ms);
    let old = &limit.state;
    let unchanged = Evaluation {
        state: old.clone(),
        changed: false,
        newly_hit: false,
        new_period: false,
    };
    if !value.is_finite() {
        return unchanged;
    }
    // Keys of one kind sort as their periods do: a reading from an earlier period (a clock that
    // stepped back, or a reading without the server's time) starts nothing.
    let new_period = match old.period_key.as_deref() {
        None => true,
        Some(stored) => key.as_str() > stored,
    };
    let mut state = if new_period || old.start_value.is_none() {
        // A period starts from a real value: an empty account, or a broker's zero before it
        // has the figures, would make a relative limit unreachable for the whole period.
        if value <= 0.0 {
            return unchanged;
        }
        RiskState {
            period_key: Some(key),
            start_value: Some(value),
            hit: None,
        }
    } else {
        old.clone()
    };
    let mut newly_hit = false;
    if state.hit.is_none()
        && let Some(start) = state.start_value
    {
        let drawdown = start - value;
        let allowed = if limit.relative {
            start * limit.amount / 100.0
        } else {
            limit.amount
        };
        if drawdown >= allowed {
            state.hit = Some(format!(
                "{} {} drawdown {:.2} from {:.2} ({:.2} % of it) reached the limit of {}{}",
                limit.period.as_str(),
                limit.basis.as_str(),
                drawdown,
                start,
                100.0 * drawdown / start,
                limit.amount,
                if limit.relative { " %" } else { "" }
            ));
            newly_hit = true;
        }
    }
    Evaluation {
        changed: state != *old,
        state,
        newly_hit,
        new_period: new_period && old.period_key.is_some() && old.hit.is_some(),
    }
}

/// Judges `limit` on a reading older than the account's latest (a periodic reading answered
/// after a newer one was taken): what it saw happened, so a drawdown it shows within the
/// limit's current period reaches the limit. It starts no period and sets no starting value
/// (those come from the latest reading), and a reading from another period counts for nothing.
pub fn evaluate_older(limit: &RiskLimit, balance: f64, equity: f64, server_ms: i64) -> Evaluation {
    let key = limit.period.key(server_ms);
    if limit.state.start_value.is_none() || limit.state.period_key.as_deref() != Some(&key) {
        return Evaluation {
            state: limit.state.clone(),
            changed: false,
            newly_hit: false,
            new_period: false,
        };
    }
    evaluate(limit, balance, equity, server_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-11-30 (a Monday) 00:00 on the server's clock.
    const MONDAY: i64 = 1_795_996_800_000;
    const H: i64 = 3_600_000;

    fn limit(period: Period, basis: Basis, relative: bool, amount: f64) -> RiskLimit {
        RiskLimit {
            id: 1,
            period,
            basis,
            relative,
            amount,
            action: RiskAction::CloseOnly,
            state: RiskState::default(),
        }
    }

    #[test]
    fn periods_follow_the_server_calendar() {
        assert_eq!(Period::Daily.key(MONDAY), "2026-11-30");
        assert_eq!(Period::Daily.key(MONDAY - 1), "2026-11-29");
        assert_eq!(Period::Weekly.key(MONDAY), "week of 2026-11-30");
        assert_eq!(
            Period::Weekly.key(MONDAY + 6 * 24 * H + 23 * H),
            "week of 2026-11-30"
        );
        assert_eq!(Period::Weekly.key(MONDAY - 1), "week of 2026-11-23");
        assert_eq!(Period::Monthly.key(MONDAY), "2026-11");
        assert_eq!(Period::Monthly.key(MONDAY + 24 * H), "2026-12");
        assert_eq!(Period::Daily.key(0), "1970-01-01");
        assert_eq!(Period::Daily.key(951_782_400_000), "2000-02-29");
        assert_eq!(Period::Weekly.key(0), "week of 1969-12-29");
        assert_eq!(Period::Lifetime.key(MONDAY), "lifetime");
    }

    #[test]
    fn the_first_reading_of_a_period_sets_its_start_and_a_drawdown_reaches_the_limit() {
        let mut l = limit(Period::Daily, Basis::Equity, true, 5.0);
        let first = evaluate(&l, 10_000.0, 10_000.0, MONDAY + H);
        assert!(first.changed && !first.newly_hit);
        assert_eq!(first.state.start_value, Some(10_000.0));
        assert_eq!(first.state.period_key.as_deref(), Some("2026-11-30"));
        l.state = first.state;
        // 4.99 % down: not yet; the state does not change.
        let near = evaluate(&l, 10_000.0, 9_501.0, MONDAY + 2 * H);
        assert!(!near.changed && !near.newly_hit);
        // 5 % down (equity; the balance is untouched): reached.
        let hit = evaluate(&l, 10_000.0, 9_500.0, MONDAY + 3 * H);
        assert!(hit.changed && hit.newly_hit);
        let reason = hit.state.hit.clone().unwrap();
        assert!(
            reason.contains("daily equity drawdown 500.00 from 10000.00") && reason.contains("5 %"),
            "{reason}"
        );
        l.state = hit.state;
        // Equity recovers: still reached until the period ends.
        let later = evaluate(&l, 10_000.0, 10_200.0, MONDAY + 4 * H);
        assert!(!later.changed && later.state.hit.is_some());
        // The next server day starts clean from its first reading.
        let next = evaluate(&l, 10_000.0, 10_200.0, MONDAY + 24 * H);
        assert!(next.changed && next.new_period && next.state.hit.is_none());
        assert_eq!(next.state.start_value, Some(10_200.0));
    }

    #[test]
    fn absolute_limits_count_money_and_balance_limits_ignore_floating_losses() {
        let mut l = limit(Period::Lifetime, Basis::Balance, false, 300.0);
        l.state = evaluate(&l, 5_000.0, 5_000.0, MONDAY).state;
        let floating = evaluate(&l, 5_000.0, 4_000.0, MONDAY + H);
        assert!(!floating.newly_hit, "equity is not the basis");
        let realised = evaluate(&l, 4_700.0, 4_700.0, MONDAY + 400 * 24 * H);
        assert!(realised.newly_hit, "lifetime spans every day");
        assert!(!evaluate(&l, 4_700.01, 4_700.01, MONDAY).newly_hit);
    }

    #[test]
    fn an_operator_reset_starts_a_period_again_from_the_current_value() {
        let mut l = limit(Period::Weekly, Basis::Equity, true, 10.0);
        l.state = RiskState {
            period_key: None,
            start_value: None,
            hit: None,
        };
        let e = evaluate(&l, 8_000.0, 8_000.0, MONDAY + 3 * 24 * H);
        assert!(e.changed && !e.newly_hit && !e.new_period);
        assert_eq!(e.state.start_value, Some(8_000.0));
        assert_eq!(e.state.period_key.as_deref(), Some("week of 2026-11-30"));
    }

    #[test]
    fn no_period_starts_from_an_empty_or_unreadable_value() {
        let l = limit(Period::Daily, Basis::Balance, true, 5.0);
        for bad in [0.0, -10.0, f64::NAN, f64::INFINITY] {
            let e = evaluate(&l, bad, bad, MONDAY);
            assert!(!e.changed && e.state == RiskState::default(), "{bad}");
        }
        // The first real value starts it.
        assert_eq!(
            evaluate(&l, 1_000.0, 1_000.0, MONDAY).state.start_value,
            Some(1_000.0)
        );
    }

    #[test]
    fn a_reading_from_an_earlier_period_clears_nothing() {
        let mut l = limit(Period::Daily, Basis::Equity, false, 100.0);
        l.state = evaluate(&l, 1_000.0, 1_000.0, MONDAY + 2 * H).state;
        l.state = evaluate(&l, 1_000.0, 900.0, MONDAY + 3 * H).state;
        assert!(l.state.hit.is_some());
        // The clock steps back over midnight (or a reading comes without the server's time).
        let back = evaluate(&l, 1_000.0, 1_000.0, MONDAY - H);
        assert!(!back.changed && back.state.hit.is_some());
    }

    #[test]
    fn an_absolute_limit_counts_from_any_start() {
        let mut l = limit(Period::Lifetime, Basis::Equity, false, 50.0);
        l.state = RiskState {
            period_key: Some("lifetime".into()),
            start_value: Some(20.0),
            hit: None,
        };
        assert!(evaluate(&l, 20.0, -30.0, MONDAY).newly_hit);
    }

    #[test]
    fn an_older_reading_reaches_the_limit_only_within_the_current_period() {
        let mut l = limit(Period::Daily, Basis::Equity, false, 100.0);
        // No period yet: an older reading starts none.
        let unstarted = evaluate_older(&l, 1_000.0, 1_000.0, MONDAY + 2 * H);
        assert!(!unstarted.changed && unstarted.state.period_key.is_none());
        l.state = evaluate(&l, 1_000.0, 1_000.0, MONDAY + 2 * H).state;
        // A drawdown it saw in this period reaches the limit, from the period's start.
        let dip = evaluate_older(&l, 1_000.0, 880.0, MONDAY + H);
        assert!(dip.newly_hit && dip.changed);
        assert_eq!(dip.state.start_value, Some(1_000.0));
        // One from the day before counts for nothing (the plain judgement would measure it
        // from today's start), and one from the next day starts nothing.
        assert!(evaluate(&l, 1_000.0, 880.0, MONDAY - H).newly_hit);
        let yesterday = evaluate_older(&l, 1_000.0, 880.0, MONDAY - H);
        assert!(!yesterday.changed && !yesterday.newly_hit);
        let tomorrow = evaluate_older(&l, 1_000.0, 1_200.0, MONDAY + 25 * H);
        assert!(!tomorrow.changed && !tomorrow.new_period);
    }
}
