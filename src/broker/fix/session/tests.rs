use super::*;

fn report(fields: &[(u32, &str)]) -> Fields {
    Fields(fields.iter().map(|(t, v)| (*t, v.to_string())).collect())
}

#[test]
fn entry_orders_are_read_from_reports_and_numbered_apart_from_positions() {
    assert_eq!(order_ticket("17"), (1 << 52) + 17);
    let other = order_ticket("ORD-9f3a");
    assert!((1 << 52..1 << 53).contains(&other), "{other}");
    assert_eq!(other, order_ticket("ORD-9f3a"), "stable across owners");
    assert!((1 << 52..1 << 53).contains(&order_ticket(&(1i64 << 60).to_string())));
    let stop = report(&[
        (11, "manual-4"),
        (37, "21"),
        (40, "3"),
        (54, "2"),
        (55, "EURUSD"),
        (38, "30000"),
        (99, "1.09"),
        (59, "6"),
        (126, "20261130-00:55:23.456"),
    ]);
    let e = entry_of_report(&stop).expect("an entry order");
    assert_eq!(
        (
            e.order_type.as_str(),
            e.side.as_str(),
            e.price,
            e.quantity,
            e.expiry_ms,
            e.ticket
        ),
        (
            "stop",
            "sell",
            1.09,
            30000.0,
            Some(1_796_000_123_456),
            Some((1 << 52) + 21)
        )
    );
    // A resting order protecting a position (PosMaintRptID) is no entry order, nor is a
    // market order.
    let protective = report(&[(11, "x"), (37, "2"), (40, "2"), (44, "1.1"), (721, "5")]);
    assert!(entry_of_report(&protective).is_none());
    assert!(entry_of_report(&report(&[(11, "y"), (37, "3"), (40, "1")])).is_none());
}

/// A positions read that timed out says what the venue sent: nothing, reports without a
/// count (no AO, no TotNumReports), or fewer reports than counted.
#[test]
fn a_positions_timeout_names_what_the_venue_sent() {
    let within = Duration::from_secs(5);
    let collect = |expected: Option<usize>, reports: usize| Collect {
        expected,
        reports: vec![report(&[(35, "AP")]); reports],
        done: None,
    };
    let nothing = positions_timeout(Some(&collect(None, 0)), within);
    assert!(
        nothing.contains("neither a RequestForPositionsAck (AO) nor a PositionReport"),
        "{nothing}"
    );
    let uncounted = positions_timeout(Some(&collect(None, 2)), within);
    assert!(
        uncounted.contains("2 PositionReports without a count")
            && uncounted.contains("no TotNumReports (727)"),
        "{uncounted}"
    );
    let short = positions_timeout(Some(&collect(Some(3), 1)), within);
    assert!(short.starts_with("1 of 3 PositionReports"), "{short}");
}

#[test]
fn final_reports_become_outcomes() {
    let filled = report(&[(39, "2"), (14, "20000"), (6, "1.1001"), (721, "77")]);
    assert_eq!(
        outcome_of(&filled),
        Outcome::Filled {
            position: 77,
            price: 1.1001,
            units: 20000.0
        }
    );
    let partial_then_cancelled = report(&[(39, "4"), (14, "5000"), (6, "1.1"), (721, "78")]);
    assert!(
        matches!(outcome_of(&partial_then_cancelled), Outcome::Filled { units, .. } if units == 5000.0)
    );
    let unfilled = report(&[(39, "4"), (14, "0")]);
    assert!(matches!(outcome_of(&unfilled), Outcome::Refused(r) if r.code == RejectCode::Slippage));
    let duplicate = report(&[(39, "8"), (103, "6"), (58, "duplicate ClOrdID")]);
    assert_eq!(outcome_of(&duplicate), Outcome::Duplicate);
    let symbol = report(&[(39, "8"), (103, "1"), (58, "unknown symbol")]);
    assert!(
        matches!(outcome_of(&symbol), Outcome::Refused(r) if r.code == RejectCode::UnknownSymbol)
    );
    let gone = report(&[(39, "8"), (103, "99"), (58, "no such position")]);
    assert!(
        matches!(outcome_of(&gone), Outcome::Refused(r) if r.code == RejectCode::UnknownTicket)
    );
    assert_eq!(reject_code(Some(2), ""), RejectCode::MarketClosed);
    assert_eq!(
        reject_code(Some(99), "Not enough margin"),
        RejectCode::NoMoney
    );
    assert_eq!(reject_code(None, "requote"), RejectCode::Requote);
}
