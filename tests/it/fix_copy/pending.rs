//! Pending orders over FIX (issue 21): a master on the simulated broker whose clock runs two
//! hours ahead of UTC, followers on the QuickFIX venue (a FIX venue's clock is UTC), where the
//! pending copies are entry orders. Judged from the venue's resting orders, positions and journal.

use copier_node::broker::types::{PendingKind, Side};
use copier_node::sim_broker::tools::{self, HandOrder};

use super::{
    CopySetup, FixVenue, Positions, WAIT, server, venue, venue_journal, venue_positions,
    wait_status, wait_venue,
};
use crate::support::{FAST, LinkSpec, add_account, add_link, config, eventually, start_node};

const TWO_HOURS: i64 = 7_200_000;

/// An entry order resting at the venue.
#[derive(Debug, Clone, PartialEq)]
struct Resting {
    order_id: String,
    side: String,
    kind: String,
    price: f64,
    lots: f64,
    /// Unix ms (UTC); 0: good till cancelled.
    expiry_ms: i64,
}

fn venue_orders(v: &FixVenue, login: &str) -> Vec<Resting> {
    let reply = v.control(&format!("orders {login}"));
    let rest = reply.strip_prefix("ok").expect("orders answered");
    rest.split_whitespace()
        .map(|o| {
            let f: Vec<&str> = o.split(':').collect();
            assert_eq!(f[1], "EURUSD", "{o}");
            Resting {
                order_id: f[0].to_string(),
                side: f[2].to_string(),
                kind: f[3].to_string(),
                price: f[4].parse().unwrap(),
                lots: f[5].parse().unwrap(),
                expiry_ms: f[6].parse().unwrap(),
            }
        })
        .collect()
}

async fn wait_orders(
    v: &FixVenue,
    login: &str,
    what: &str,
    want: impl Fn(&[Resting]) -> bool,
) -> Vec<Resting> {
    eventually(format!("{login}: {what}"), WAIT, async || {
        let o = venue_orders(v, login);
        want(&o).then_some(o)
    })
    .await
}

/// The node's accepted requests of `action` on `login` for master ticket `ticket` (by the
/// intent's client order id, `l<link>-m<ticket>-...`).
fn accepted(v: &FixVenue, login: &str, action: &str, ticket: i64) -> usize {
    let intent = format!("-m{ticket}-");
    venue_journal(v)
        .iter()
        .filter(|l| l.login == login && l.action == action && l.accepted)
        .filter(|l| {
            l.client_order_id
                .as_deref()
                .is_some_and(|c| c.contains(&intent))
        })
        .count()
}

/// A master pending order of 0.4 lots on EURUSD (stops on the side its direction needs).
async fn place(
    s: &CopySetup,
    side: Side,
    kind: PendingKind,
    price: f64,
    expiry_ms: Option<i64>,
) -> i64 {
    crate::support::place_master_order(&s.addr, side, kind, price, expiry_ms).await
}

fn lots_close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

in_both_position_modes!(
    pending_copies_over_fix_are_entry_orders_replaced_filled_cancelled_and_expired
);
/// Place (the expiry converted from the master server's clock to UTC), amend by cancel/replace
/// (the OrderID kept), fill at the venue under the marker (the fill in the copy ledger, the
/// position given its stops), reverse, cancel, and expiry at the venue.
async fn pending_copies_over_fix_are_entry_orders_replaced_filled_cancelled_and_expired(
    positions: Positions,
) {
    let mut s = CopySetup::with("fix-pending", |o| {
        o.fence_check = false;
        o.dedupe = false;
        o.clock_offset_ms = TWO_HOURS;
    })
    .await;
    let v = venue(&s, &["f1", "f2"], positions);
    let fix = server(&v, "");
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 2, "follower", &fix, "f1").await;
    add_account(&mut s.conn, 3, "follower", &fix, "f2").await;
    add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let reversed = LinkSpec {
        reverse: true,
        ..Default::default()
    };
    add_link(&mut s.conn, 1, 3, reversed).await;
    let node = start_node(&config(&s.db, "fx-pending", 100, FAST)).await;
    for id in 2..=3 {
        wait_status(&mut s.conn, id, "follower: master").await;
    }

    // A buy limit below the market, expiring in an hour: on the master server's clock that is
    // three hours from now in UTC terms; at the venue (UTC) one hour.
    let in_an_hour = copier_node::wall_clock::unix_ms() + 3_600_000;
    let t = place(
        &s,
        Side::Buy,
        PendingKind::Limit,
        1.095,
        Some(in_an_hour + TWO_HOURS),
    )
    .await;
    let f1 = wait_orders(&v, "f1", "the entry order", |o| o.len() == 1).await;
    assert_eq!(
        (f1[0].side.as_str(), f1[0].kind.as_str(), f1[0].price),
        ("buy", "limit", 1.095)
    );
    assert!(lots_close(f1[0].lots, 0.4), "{f1:?}");
    assert_eq!(
        f1[0].expiry_ms, in_an_hour,
        "the same instant on the venue's clock (UTC, two hours behind the master's)"
    );
    let f2 = wait_orders(&v, "f2", "the reversed entry order", |o| o.len() == 1).await;
    assert_eq!(
        (f2[0].side.as_str(), f2[0].kind.as_str(), f2[0].price),
        ("sell", "stop", 1.095),
        "a buy limit reversed is a sell stop at the same price"
    );
    // The venue lists the order as soon as it rests; the node records it as working once the
    // venue's acknowledgement reaches it, which may come a moment later.
    let conn = &mut s.conn;
    let stops: (Option<f64>, Option<f64>) =
        eventually("f1's entry order working in the FIX ledger", WAIT, async || {
            sqlx::query_as(
                "SELECT sl, tp FROM fix_orders WHERE account_id = 2 AND kind = 'entry' AND state = 'working'",
            )
            .fetch_optional(&mut *conn)
            .await
            .unwrap()
        })
        .await;
    assert_eq!(
        stops,
        (Some(1.08), Some(1.12)),
        "kept for the fill's position"
    );

    // The master moves its order and makes it good till cancelled: a cancel/replace at the
    // venue, which keeps the order (its OrderID).
    crate::support::amend_master_order(&s.addr, t).await;
    for (login, first) in [("f1", &f1[0]), ("f2", &f2[0])] {
        let now = wait_orders(&v, login, "replaced at the master's price", |o| {
            o.len() == 1 && o[0].price == 1.093 && o[0].expiry_ms == 0
        })
        .await;
        assert_eq!(now[0].order_id, first.order_id, "{login}: the same order");
    }

    // The venue's price reaches both entry orders first: each fills and opens a position under
    // the marker, with the fill in the copy ledger as it happened.
    assert_eq!(v.control("quote EURUSD 1.09250 1.09260"), "ok 2");
    let p1 = wait_venue(&v, "f1", "the filled copy", |p| p.len() == 1).await;
    assert_eq!(p1[0].2, "buy");
    let p2 = wait_venue(&v, "f2", "the filled reversed copy", |p| p.len() == 1).await;
    assert_eq!(p2[0].2, "sell");
    assert!(venue_orders(&v, "f1").is_empty() && venue_orders(&v, "f2").is_empty());
    let conn = &mut s.conn;
    eventually("both fills in the copy ledger", WAIT, async || {
        let rows: Vec<(i64, bool)> = sqlx::query_as(
            "SELECT follower_id, found_by_reconcile FROM copy_ledger WHERE master_ticket = $1 ORDER BY follower_id",
        )
        .bind(t)
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        (rows.len() == 2).then_some(rows)
    })
    .await
    .iter()
    .for_each(|(id, found)| assert!(!found, "account {id}: recorded from the stream"));
    eventually("the filled copy's stops rest at the venue", WAIT, async || {
        let w: Vec<(String, f64)> = sqlx::query_as(
            "SELECT kind, price FROM fix_orders WHERE account_id = 2 AND kind IN ('sl', 'tp') AND state = 'working' ORDER BY kind",
        )
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        (w == [("sl".to_string(), 1.08), ("tp".to_string(), 1.12)]).then_some(())
    })
    .await;

    // Then the master's fills: the copies are there already. The master closes: they close.
    tools::set_price(&s.addr, "EURUSD", 1.092).await.unwrap();
    s.t.close("m1", t, None).await;
    for login in ["f1", "f2"] {
        wait_venue(&v, login, "closed with the master", |p| p.is_empty()).await;
        assert_eq!(
            (
                accepted(&v, login, "place", t),
                accepted(&v, login, "amend", t),
                accepted(&v, login, "open", t)
            ),
            (1, 1, 0),
            "{login}: one entry order, replaced once, which became the copy; no order at market"
        );
    }

    // A sell limit the master cancels: the entry orders are cancelled.
    let c = place(&s, Side::Sell, PendingKind::Limit, 1.105, None).await;
    wait_orders(&v, "f1", "the second entry order", |o| o.len() == 1).await;
    wait_orders(&v, "f2", "its reversed entry order", |o| {
        o.len() == 1 && o[0].kind == "stop" && o[0].side == "buy"
    })
    .await;
    tools::trade(&s.addr, "m1", HandOrder::Cancel { ticket: c })
        .await
        .unwrap();
    for login in ["f1", "f2"] {
        wait_orders(&v, login, "cancelled with the master's", |o| o.is_empty()).await;
        assert_eq!(accepted(&v, login, "cancel", c), 1, "{login}: one cancel");
    }

    // An order expiring in three seconds: its copy carries the same instant (UTC) and expires
    // with it; nothing is copied.
    let soon = copier_node::wall_clock::unix_ms() + 3_000;
    let e = place(
        &s,
        Side::Buy,
        PendingKind::Limit,
        1.085,
        Some(soon + TWO_HOURS),
    )
    .await;
    let resting = wait_orders(&v, "f1", "the expiring order's copy", |o| o.len() == 1).await;
    assert_eq!(resting[0].expiry_ms, soon);
    wait_orders(&v, "f1", "expired", |o| o.is_empty()).await;
    assert!(venue_positions(&v, "f1").is_empty());
    assert_eq!(accepted(&v, "f1", "place", e), 1, "not placed again");
    node.shutdown();
    node.wait().await.unwrap();
}

in_both_position_modes!(
    a_lost_entry_acknowledgement_is_resolved_and_the_master_filling_first_copies_once
);
/// An entry order whose acknowledgement is lost: its outcome is unknown, the next read resolves
/// it by OrderStatusRequest (working, its ticket recorded), and when the master's order fills
/// first the entry order is cancelled and the fill copied at market once, never twice.
async fn a_lost_entry_acknowledgement_is_resolved_and_the_master_filling_first_copies_once(
    positions: Positions,
) {
    let mut s = CopySetup::unprotected("fix-pending-lost").await;
    let v = venue(&s, &["f1"], positions);
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(
        &mut s.conn,
        2,
        "follower",
        &server(&v, "&timeout_ms=3000"),
        "f1",
    )
    .await;
    add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let node = start_node(&config(&s.db, "fx-pending-lost", 100, FAST)).await;
    wait_status(&mut s.conn, 2, "follower: master").await;

    assert_eq!(v.control("fault lose_reply on"), "ok");
    let t = place(&s, Side::Buy, PendingKind::Limit, 1.095, None).await;
    let resting = wait_orders(&v, "f1", "the entry order", |o| o.len() == 1).await;
    let conn = &mut s.conn;
    // Resting at the venue, while the node waits for an acknowledgement that never comes.
    eventually(
        "the entry order sent, its outcome unknown",
        WAIT,
        async || {
            sqlx::query_scalar::<_, String>(
                "SELECT state FROM fix_orders WHERE account_id = 2 AND kind = 'entry'",
            )
            .fetch_optional(&mut *conn)
            .await
            .unwrap()
            .filter(|state| state == "sent")
        },
    )
    .await;
    let (ticket,): (i64,) = eventually(
        "the entry order resolved as working by its status",
        WAIT,
        async || {
            sqlx::query_as::<_, (Option<i64>,)>(
                "SELECT ticket FROM fix_orders WHERE account_id = 2 AND kind = 'entry' AND state = 'working'",
            )
            .fetch_optional(&mut *conn)
            .await
            .unwrap()
            .and_then(|(t,)| t.map(|t| (t,)))
        },
    )
    .await;
    assert_eq!(
        ticket,
        (1i64 << 52) + resting[0].order_id.parse::<i64>().unwrap(),
        "the ticket is the venue's OrderID, numbered apart from positions"
    );
    assert_eq!(v.control("fault lose_reply off"), "ok");

    // Only the master's market reaches the price: the entry order is cancelled, then the fill
    // is copied at market.
    tools::set_price(&s.addr, "EURUSD", 1.094).await.unwrap();
    let p = wait_venue(&v, "f1", "the copy at market", |p| p.len() == 1).await;
    assert!(lots_close(p[0].3, 0.4) && p[0].2 == "buy", "{p:?}");
    assert!(
        venue_orders(&v, "f1").is_empty(),
        "the entry order was cancelled"
    );
    assert_eq!(
        (
            accepted(&v, "f1", "place", t),
            accepted(&v, "f1", "cancel", t),
            accepted(&v, "f1", "open", t)
        ),
        (1, 1, 1),
        "one entry order, cancelled, then one copy at market"
    );
    // The copy is the one copy of the master's position: the master's close closes it.
    s.t.close("m1", t, None).await;
    wait_venue(&v, "f1", "closed with the master", |p| p.is_empty()).await;
    assert_eq!(accepted(&v, "f1", "open", t), 1, "never copied twice");
    node.shutdown();
    node.wait().await.unwrap();
}

/// The copy engine's ticket of the venue's entry order `order_id` (and of the position its fill
/// opens): 2^52 plus the OrderID.
fn order_ticket(order_id: i64) -> i64 {
    (1i64 << 52) + order_id
}

in_both_position_modes!(
    a_fix_masters_entry_orders_are_copied_as_pending_orders_and_its_fill_as_the_same_ticket
);
/// A master on FIX: entry orders its trader places, amends and cancels at the venue (reported to
/// the master's session, and listed by OrderMassStatusRequest) are published and copied as
/// pending orders onto a follower on the simulated broker; the fill at the venue is the same
/// ticket as the order, so the follower cancels its pending copy and copies the fill at market
/// once; the master's close closes it.
async fn a_fix_masters_entry_orders_are_copied_as_pending_orders_and_its_fill_as_the_same_ticket(
    positions: Positions,
) {
    let mut s = CopySetup::unprotected("fix-master-pending").await;
    let v = venue(&s, &["m1"], positions);
    // One order rests before the node starts: listed by the first read of the master's orders.
    let early = super::hand(&v, "place m1 EURUSD sell limit 1.105 0.1");
    add_account(&mut s.conn, 1, "master", &server(&v, ""), "m1").await;
    add_account(&mut s.conn, 2, "follower", &s.addr, "f2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let node = start_node(&config(&s.db, "fx-master-pending", 100, FAST)).await;
    wait_status(&mut s.conn, 2, "follower: master").await;
    let copy_of = async |ticket: i64, what: &str, ok: &dyn Fn(&PendingOrderView) -> bool| {
        let marker = format!("mc{}", order_ticket(ticket));
        eventually(format!("f2: {what}"), WAIT, async || {
            tools::orders(&s.addr, "f2")
                .await
                .unwrap_or_default()
                .into_iter()
                .find(|o| o.comment == marker && o.magic == magic)
                .map(|o| PendingOrderView {
                    side: o.side,
                    kind: o.kind,
                    price: o.price,
                    volume: o.volume,
                })
                .filter(|o| ok(o))
        })
        .await
    };
    copy_of(
        early,
        "the copy of the order resting before the start",
        &|o| o.side == Side::Sell && o.kind == PendingKind::Limit && o.price == 1.105,
    )
    .await;

    // A buy limit placed by hand: published and copied; amended by hand: the copy follows.
    let id = super::hand(&v, "place m1 EURUSD buy limit 1.095 0.3");
    let c = copy_of(id, "the pending copy", &|_| true).await;
    assert_eq!(
        (c.side, c.kind, c.price, c.volume),
        (Side::Buy, PendingKind::Limit, 1.095, 0.3)
    );
    assert_eq!(v.control(&format!("amend m1 {id} 1.094")), "ok");
    copy_of(id, "amended with the master's order", &|o| o.price == 1.094).await;

    // The venue's price reaches the master's order first: it fills as a position of the same
    // ticket, so the pending copy is cancelled and the fill copied at market, once.
    tools::set_price(&s.addr, "EURUSD", 1.0941).await.unwrap();
    assert_eq!(v.control("quote EURUSD 1.09390 1.09400"), "ok 1");
    let marker = format!("mc{}", order_ticket(id));
    let copies = eventually("f2: the fill copied at market", WAIT, async || {
        let orders = tools::orders(&s.addr, "f2").await.ok()?;
        let positions = tools::positions(&s.addr, "f2").await.ok()?;
        let copies: Vec<_> = positions
            .into_iter()
            .filter(|p| p.comment == marker)
            .collect();
        (!orders.iter().any(|o| o.comment == marker) && copies.len() == 1).then_some(copies)
    })
    .await;
    assert_eq!((copies[0].side, copies[0].volume), (Side::Buy, 0.3));
    let published: Vec<i64> = sqlx::query_scalar(
        "SELECT (p->>'ticket')::bigint FROM master_state, jsonb_array_elements(positions) p WHERE master_id = 1",
    )
    .fetch_all(&mut s.conn)
    .await
    .unwrap();
    assert_eq!(
        published,
        vec![order_ticket(id)],
        "the master's position is published under its order's ticket"
    );

    // The trader closes the position at the venue: the copy closes.
    let at_venue = venue_positions(&v, "m1");
    super::hand(&v, &format!("close m1 {} 0.3", at_venue[0].0));
    eventually("f2: the copy closed with the master", WAIT, async || {
        let positions = tools::positions(&s.addr, "f2").await.ok()?;
        (!positions.iter().any(|p| p.comment == marker)).then_some(())
    })
    .await;

    // The early order, cancelled by hand: its copy is cancelled.
    assert_eq!(v.control(&format!("cancel m1 {early}")), "ok");
    let early_marker = format!("mc{}", order_ticket(early));
    eventually("f2: the early order's copy cancelled", WAIT, async || {
        let orders = tools::orders(&s.addr, "f2").await.ok()?;
        (!orders.iter().any(|o| o.comment == early_marker)).then_some(())
    })
    .await;
    let lines = crate::support::broker::journal(&s.dir.path("journal.jsonl"));
    let count = |action: &str, marker: &str| {
        lines
            .iter()
            .filter(|l| l.login == "f2" && l.action == action && l.accepted)
            .filter(|l| l.client != "manual" && l.comment.as_deref() == Some(marker))
            .count()
    };
    assert_eq!(
        (
            count("place", &marker),
            count("cancel", &marker),
            count("open", &marker)
        ),
        (1, 1, 1),
        "one pending copy, cancelled when the master filled first, then one copy at market"
    );
    assert_eq!(
        (count("place", &early_marker), count("open", &early_marker)),
        (1, 0)
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// What a test compares of a pending copy.
struct PendingOrderView {
    side: Side,
    kind: PendingKind,
    price: f64,
    volume: f64,
}

in_both_position_modes!(a_fix_masters_order_filled_between_owners_is_published_as_its_fill);
/// A FIX master's entry order fills while no node holds the master (the venue's report of it
/// reaches no session): the next owner asks the venue how the order it knew of ended, and
/// publishes the position under the order's ticket, so the follower cancels its pending copy and
/// copies the fill once (a position under another ticket would read as the order cancelled and a
/// new trade).
async fn a_fix_masters_order_filled_between_owners_is_published_as_its_fill(positions: Positions) {
    let mut s = CopySetup::unprotected("fix-master-pending-gap").await;
    let v = venue(&s, &["m1"], positions);
    add_account(&mut s.conn, 1, "master", &server(&v, ""), "m1").await;
    add_account(&mut s.conn, 2, "follower", &s.addr, "f2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let a = start_node(&config(&s.db, "fx-gap-a", 100, FAST)).await;
    wait_status(&mut s.conn, 2, "follower: master").await;
    let id = super::hand(&v, "place m1 EURUSD buy limit 1.095 0.3");
    let marker = format!("mc{}", order_ticket(id));
    eventually("f2: the pending copy", WAIT, async || {
        let orders = tools::orders(&s.addr, "f2").await.ok()?;
        orders
            .iter()
            .any(|o| o.comment == marker && o.magic == magic)
            .then_some(())
    })
    .await;
    let conn = &mut s.conn;
    eventually("the master's order in the FIX ledger", WAIT, async || {
        sqlx::query_scalar::<_, String>(
            "SELECT state FROM fix_orders WHERE account_id = 1 AND kind = 'entry'",
        )
        .fetch_optional(&mut *conn)
        .await
        .unwrap()
        .filter(|state| state == "working")
    })
    .await;
    a.shutdown();
    a.wait().await.unwrap();

    // No node runs: the order fills at the venue.
    tools::set_price(&s.addr, "EURUSD", 1.0951).await.unwrap();
    assert_eq!(v.control("quote EURUSD 1.09490 1.09500"), "ok 1");
    let b = start_node(&config(&s.db, "fx-gap-b", 100, FAST)).await;
    let copies = fill_copied(&s, magic, &marker).await;
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert_eq!(
        (copies[0].comment.as_str(), copies[0].volume),
        (marker.as_str(), 0.3),
        "the copy of the order's ticket"
    );
    let (state, ticket): (String, Option<i64>) = sqlx::query_as(
        "SELECT o.state, p.ticket FROM fix_orders o JOIN fix_positions p \
           ON p.account_id = o.account_id AND p.position_id = o.position_id \
          WHERE o.account_id = 1 AND o.kind = 'entry'",
    )
    .fetch_one(&mut s.conn)
    .await
    .unwrap();
    assert_eq!((state.as_str(), ticket), ("filled", Some(order_ticket(id))));
    // The trader closes it: the copy closes; one copy was ever opened.
    closed_with_the_master(&s, &v, magic).await;
    b.shutdown();
    b.wait().await.unwrap();
}

in_both_position_modes!(a_fix_masters_fill_reported_only_by_its_position_is_the_orders_ticket);
/// A FIX master whose venue reports other sessions' trades only as subscribed PositionReports
/// (no drop copy): its trader's entry order (resting before the node starts, so the first read
/// lists it) fills, and the position's report comes with no ExecutionReport of the fill. The
/// position is read with the orders first, so it is published under the order's ticket: the
/// follower cancels its pending copy and copies the fill once.
async fn a_fix_masters_fill_reported_only_by_its_position_is_the_orders_ticket(
    positions: Positions,
) {
    let mut s = CopySetup::unprotected("fix-master-pending-sub").await;
    let v = venue(&s, &["m1"], positions);
    assert_eq!(v.control("fault no_drop_copy on"), "ok");
    let id = super::hand(&v, "place m1 EURUSD buy limit 1.095 0.3");
    add_account(
        &mut s.conn,
        1,
        "master",
        &server(&v, "&updates=subscribe"),
        "m1",
    )
    .await;
    add_account(&mut s.conn, 2, "follower", &s.addr, "f2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let node = start_node(&config(&s.db, "fx-master-sub", 100, FAST)).await;
    wait_status(&mut s.conn, 2, "follower: master").await;
    let marker = format!("mc{}", order_ticket(id));
    eventually("f2: the pending copy", WAIT, async || {
        let orders = tools::orders(&s.addr, "f2").await.ok()?;
        orders.iter().any(|o| o.comment == marker).then_some(())
    })
    .await;
    tools::set_price(&s.addr, "EURUSD", 1.0951).await.unwrap();
    assert_eq!(v.control("quote EURUSD 1.09490 1.09500"), "ok 1");
    let copies = fill_copied(&s, magic, &marker).await;
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert_eq!(copies[0].comment, marker, "the copy of the order's ticket");
    closed_with_the_master(&s, &v, magic).await;
    node.shutdown();
    node.wait().await.unwrap();
}

/// The copies on bridge follower `f2` under link magic `magic`, once the pending copy marked
/// `marker` is gone and a copy is open (the master's fill copied at market).
async fn fill_copied(
    s: &CopySetup,
    magic: i64,
    marker: &str,
) -> Vec<copier_node::broker::types::Position> {
    eventually("f2: the fill copied at market", WAIT, async || {
        let orders = tools::orders(&s.addr, "f2").await.ok()?;
        let positions = tools::positions(&s.addr, "f2").await.ok()?;
        let copies: Vec<_> = positions.into_iter().filter(|p| p.magic == magic).collect();
        (!orders.iter().any(|o| o.comment == marker) && !copies.is_empty()).then_some(copies)
    })
    .await
}

/// The FIX master `m1`'s trader closes its one position (0.3 lots): `f2`'s copy closes, and the
/// node opened one copy in all.
async fn closed_with_the_master(s: &CopySetup, v: &FixVenue, magic: i64) {
    let at_venue = venue_positions(v, "m1");
    super::hand(v, &format!("close m1 {} 0.3", at_venue[0].0));
    eventually("f2: the copy closed with the master", WAIT, async || {
        let positions = tools::positions(&s.addr, "f2").await.ok()?;
        (!positions.iter().any(|p| p.magic == magic)).then_some(())
    })
    .await;
    let opens = crate::support::broker::journal(&s.dir.path("journal.jsonl"))
        .iter()
        .filter(|l| l.login == "f2" && l.action == "open" && l.accepted && l.client != "manual")
        .count();
    assert_eq!(opens, 1, "one copy of the master's one trade");
}
