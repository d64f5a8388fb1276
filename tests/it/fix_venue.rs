//! The FIX 4.4 test venue itself (QuickFIX C++ under our business logic), driven by a plain FIX
//! client: what the FIX adapter will be proven against must first be right on its own.

use std::time::Duration;

use crate::support::broker::Scratch;
use crate::support::fix::{FixClient, FixVenue, VenueAccount};

const WAIT: Duration = Duration::from_secs(10);

fn venue(dir: &Scratch) -> FixVenue {
    FixVenue::start(
        &dir.0,
        &[
            VenueAccount {
                login: "f1",
                password: "pw-f1",
            },
            VenueAccount {
                login: "m1",
                password: "pw-m1",
            },
        ],
    )
}

async fn logged_on(v: &FixVenue, login: &str, password: &str) -> FixClient {
    let mut c = FixClient::connect(v.port, login, &v.comp_id).await;
    c.logon(login, password, "node-a", true).await;
    let reply = c.expect("A", WAIT).await;
    assert_eq!(reply.get(141), Some("Y"), "the reset is acknowledged");
    c
}

fn journal(v: &FixVenue) -> Vec<copier_node::sim_broker::journal::JournalEntry> {
    copier_node::sim_broker::journal::read(&v.journal).expect("the simulated broker's format")
}

#[tokio::test]
async fn a_wrong_password_is_refused_and_journaled_a_right_one_logs_on() {
    let dir = Scratch::new("fix-logon");
    let v = venue(&dir);
    let mut bad = FixClient::connect(v.port, "f1", &v.comp_id).await;
    bad.logon("f1", "nope", "node-a", true).await;
    let out = bad.expect("5", WAIT).await;
    assert!(
        out.get(58).is_some_and(|t| t.contains("wrong password")),
        "{out:?}"
    );
    assert!(bad.closed(WAIT).await);
    logged_on(&v, "f1", "pw-f1").await;
    let lines = journal(&v);
    let logins: Vec<(bool, Option<&str>, &str)> = lines
        .iter()
        .filter(|l| l.action == "login")
        .map(|l| (l.accepted, l.reason.as_deref(), l.client.as_str()))
        .collect();
    assert_eq!(
        logins,
        vec![
            (false, Some("wrong password"), "node-a"),
            (true, None, "node-a")
        ]
    );
}

#[tokio::test]
async fn orders_fill_duplicates_are_refused_and_status_requests_answer() {
    let dir = Scratch::new("fix-orders");
    let v = venue(&dir);
    let mut c = logged_on(&v, "f1", "pw-f1").await;
    let open = [
        (11, "c-open-1"),
        (54, "1"),
        (55, "EURUSD"),
        (38, "20000"),
        (40, "1"),
        (60, "20261130-12:00:00"),
    ];
    c.send("D", &[(50, "node-a")], &open).await;
    let er = c.expect("8", WAIT).await;
    assert_eq!((er.get(150), er.get(39)), (Some("F"), Some("2")), "{er:?}");
    let position = er.get(721).expect("the position id").to_string();
    assert_eq!(er.get(31), Some("1.1001"), "bought at the ask");

    // The same ClOrdID again: refused as a duplicate, nothing filled.
    c.send("D", &[(50, "node-a")], &open).await;
    let dup = c.expect("8", WAIT).await;
    assert_eq!(
        (dup.get(150), dup.get(103)),
        (Some("8"), Some("6")),
        "{dup:?}"
    );

    // A partial close names the position (tag 721) and takes the other side.
    c.send(
        "D",
        &[(50, "node-a")],
        &[
            (11, "c-trim-1"),
            (54, "2"),
            (55, "EURUSD"),
            (38, "5000"),
            (40, "1"),
            (60, "20261130-12:00:01"),
            (721, &position),
        ],
    )
    .await;
    let trim = c.expect("8", WAIT).await;
    assert_eq!(
        (trim.get(39), trim.get(721)),
        (Some("2"), Some(position.as_str()))
    );
    assert_eq!(
        v.control("positions f1"),
        format!("ok {position}:EURUSD:buy:0.15")
    );

    // A close naming no position id, or a position on another symbol: refused, the venue runs on.
    for (cl, symbol, pos) in [
        ("c-bad-1", "EURUSD", "abc"),
        ("c-bad-2", "GBPUSD", position.as_str()),
    ] {
        c.send(
            "D",
            &[(50, "node-a")],
            &[
                (11, cl),
                (54, "2"),
                (55, symbol),
                (38, "1000"),
                (40, "1"),
                (60, "20261130-12:00:02"),
                (721, pos),
            ],
        )
        .await;
        let refused = c.expect("8", WAIT).await;
        assert_eq!(
            (refused.get(39), refused.get(103)),
            (Some("8"), Some("99")),
            "{refused:?}"
        );
    }

    // Order status: the filled order, and an order the venue never saw.
    c.send("H", &[], &[(11, "c-open-1"), (54, "1"), (55, "EURUSD")])
        .await;
    let st = c.expect("8", WAIT).await;
    assert_eq!((st.get(150), st.get(39)), (Some("I"), Some("2")), "{st:?}");
    c.send("H", &[], &[(11, "never-sent"), (54, "1"), (55, "EURUSD")])
        .await;
    let unknown = c.expect("8", WAIT).await;
    assert_eq!((unknown.get(39), unknown.get(103)), (Some("8"), Some("5")));

    let orders: Vec<(String, bool, Option<String>)> = journal(&v)
        .into_iter()
        .filter(|l| l.action != "login")
        .map(|l| (l.action, l.accepted, l.client_order_id))
        .collect();
    assert_eq!(
        orders,
        vec![
            ("open".into(), true, Some("c-open-1".into())),
            ("open".into(), false, Some("c-open-1".into())),
            ("close".into(), true, Some("c-trim-1".into())),
            ("close".into(), false, Some("c-bad-1".into())),
            ("close".into(), false, Some("c-bad-2".into())),
        ]
    );
}

#[tokio::test]
async fn positions_are_reported_and_the_hand_clients_trades_reach_the_account_session() {
    let dir = Scratch::new("fix-positions");
    let v = venue(&dir);
    let first = v.control("open m1 XAUUSD sell 0.5");
    assert!(first.starts_with("ok "), "{first}");
    let mut c = logged_on(&v, "m1", "pw-m1").await;
    // RequestForPositions, subscribed: an ack, then one report per open position.
    c.send(
        "AN",
        &[],
        &[
            (710, "req-1"),
            (724, "0"),
            (263, "1"),
            (1, "m1"),
            (581, "1"),
            (715, "20261130"),
            (60, "20261130-12:00:00"),
        ],
    )
    .await;
    let ack = c.expect("AO", WAIT).await;
    assert_eq!(ack.get(727), Some("1"));
    let ap = c.expect("AP", WAIT).await;
    assert_eq!((ap.get(55), ap.get(705)), (Some("XAUUSD"), Some("50")));
    // A trade by the hand client: the execution report (drop copy) and a pushed position report.
    let second = v.control("open m1 EURUSD buy 1");
    let ticket = second.strip_prefix("ok ").unwrap().to_string();
    let er = c.expect("8", WAIT).await;
    assert_eq!(
        (er.get(721), er.get(54), er.get(32)),
        (Some(ticket.as_str()), Some("1"), Some("100000"))
    );
    let pushed = c.expect("AP", WAIT).await;
    assert_eq!(
        (pushed.get(721), pushed.get(704)),
        (Some(ticket.as_str()), Some("100000"))
    );
}

#[tokio::test]
async fn a_fill_whose_report_was_lost_to_a_dropped_connection_is_found_by_its_status() {
    let dir = Scratch::new("fix-drop");
    let v = venue(&dir);
    let mut c = logged_on(&v, "f1", "pw-f1").await;
    assert_eq!(v.control("fault drop_after_fill on"), "ok");
    c.send(
        "D",
        &[(50, "node-a")],
        &[
            (11, "c-lost"),
            (54, "2"),
            (55, "GBPUSD"),
            (38, "10000"),
            (40, "1"),
            (60, "20261130-12:00:00"),
        ],
    )
    .await;
    assert!(
        c.closed(WAIT).await,
        "the venue drops the connection before the report"
    );
    assert_eq!(v.control("fault drop_after_fill off"), "ok");
    let mut again = logged_on(&v, "f1", "pw-f1").await;
    again
        .send("H", &[], &[(11, "c-lost"), (54, "2"), (55, "GBPUSD")])
        .await;
    let st = again.expect("8", WAIT).await;
    assert_eq!(
        (st.get(39), st.get(32)),
        (Some("2"), Some("10000")),
        "filled: {st:?}"
    );
    assert!(v.control("positions f1").contains(":GBPUSD:sell:0.1"));
}

#[tokio::test]
async fn a_sequence_reset_by_the_venue_logs_the_session_out_and_a_reset_logon_resumes() {
    let dir = Scratch::new("fix-reset");
    let v = venue(&dir);
    let mut c = logged_on(&v, "f1", "pw-f1").await;
    // The venue registers the session as logged on just after it answers the Logon.
    crate::support::eventually("the venue to reset the session", WAIT, async || {
        (v.control("reset f1") == "ok").then_some(())
    })
    .await;
    c.expect("5", WAIT).await;
    // The venue closes the old connection; only then may the session log on again.
    assert!(c.closed(WAIT).await);
    // The venue expects 1 again: a logon at 1 *without* ResetSeqNumFlag is accepted.
    let mut again = FixClient::connect(v.port, "f1", &v.comp_id).await;
    again.logon("f1", "pw-f1", "node-a", false).await;
    let reply = again.expect("A", WAIT).await;
    assert_eq!(reply.get(34), Some("1"), "{reply:?}");
    again
        .send("H", &[], &[(11, "never-sent"), (54, "1"), (55, "EURUSD")])
        .await;
    let st = again.expect("8", WAIT).await;
    assert_eq!(
        st.get(34),
        Some("2"),
        "the venue's numbers started again: {st:?}"
    );
}

#[tokio::test]
async fn the_security_list_gives_every_symbol_its_contract_size() {
    let dir = Scratch::new("fix-securities");
    let v = venue(&dir);
    let mut c = logged_on(&v, "f1", "pw-f1").await;
    c.send("x", &[], &[(320, "sec-1"), (559, "4")]).await;
    let list = c.expect("y", WAIT).await;
    assert_eq!(list.get(146), Some("3"), "{list:?}");
    let symbols: Vec<(&str, &str)> = list.all(55).into_iter().zip(list.all(231)).collect();
    assert_eq!(
        symbols,
        vec![
            ("EURUSD", "100000"),
            ("GBPUSD", "100000"),
            ("XAUUSD", "100")
        ]
    );
}

/// One logon per account, as venues that allow one session per account: a second Logon while
/// the first session is connected is dropped (QuickFIX's acceptor) and journaled as refused; a
/// Logout is journaled, and after it the account logs on again.
#[tokio::test]
async fn a_second_logon_while_one_is_open_is_refused_and_a_logout_frees_the_account() {
    let dir = Scratch::new("fix-one-logon");
    let v = venue(&dir);
    let mut first = logged_on(&v, "f1", "pw-f1").await;
    let mut second = FixClient::connect(v.port, "f1", &v.comp_id).await;
    second.logon("f1", "pw-f1", "node-b", true).await;
    assert!(second.closed(WAIT).await, "the second logon is dropped");
    first.send("5", &[(50, "node-a")], &[]).await;
    first.expect("5", WAIT).await;
    assert!(first.closed(WAIT).await);
    let mut third = FixClient::connect(v.port, "f1", &v.comp_id).await;
    third.logon("f1", "pw-f1", "node-b", true).await;
    third.expect("A", WAIT).await;
    let lines = journal(&v);
    let seen: Vec<(&str, &str, bool, Option<&str>)> = lines
        .iter()
        .filter(|l| l.action == "login" || l.action == "logout")
        .map(|l| {
            (
                l.action.as_str(),
                l.client.as_str(),
                l.accepted,
                l.reason.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            ("login", "node-a", true, None),
            (
                "login",
                "node-b",
                false,
                Some("a session of this account is already logged on")
            ),
            ("logout", "node-a", true, None),
            ("login", "node-b", true, None),
        ]
    );
}

/// With `no_ao`, RequestForPositions is answered by PositionReports alone, each counting them
/// (TotNumReports 727), and "none" by one report of PosReqResult 2.
#[tokio::test]
async fn without_the_ack_position_reports_carry_their_count() {
    let dir = Scratch::new("fix-no-ao");
    let v = venue(&dir);
    assert_eq!(v.control("fault no_ao on"), "ok");
    let mut c = logged_on(&v, "f1", "pw-f1").await;
    let ask = async |c: &mut FixClient, req: &str| {
        c.send(
            "AN",
            &[(50, "node-a")],
            &[
                (710, req),
                (724, "0"),
                (1, "f1"),
                (581, "1"),
                (715, "20261130"),
                (60, "20261130-12:00:00"),
            ],
        )
        .await;
    };
    ask(&mut c, "r1").await;
    let none = c.recv(WAIT).await.expect("an answer");
    assert_eq!(
        (none.msg_type(), none.get(710), none.get(728), none.get(727)),
        ("AP", Some("r1"), Some("2"), Some("0")),
        "{none:?}"
    );
    for lots in ["0.1", "0.2"] {
        v.control(&format!("open f1 EURUSD buy {lots}"));
    }
    ask(&mut c, "r2").await;
    let mut reports = 0;
    while reports < 2 {
        let m = c.recv(WAIT).await.expect("PositionReports");
        assert_ne!(m.msg_type(), "AO", "no RequestForPositionsAck: {m:?}");
        if m.msg_type() == "AP" && m.get(710) == Some("r2") {
            assert_eq!((m.get(728), m.get(727)), (Some("0"), Some("2")), "{m:?}");
            reports += 1;
        }
    }
}
