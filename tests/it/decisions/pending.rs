//! Pending orders end to end (issue 21): a master on one simulated broker (UTC), followers on
//! another whose clock runs two hours ahead (`--utc-offset +02:00`), both without fence check or
//! deduplication. Judged from the follower broker's orders, positions and journal.

use copier_node::broker::types::{PendingKind, PendingOrder, Side};
use copier_node::sim_broker::server::{ServeOptions, SimBroker};
use copier_node::sim_broker::tools::{self, HandOrder};

use super::{Broker, WAIT, fixture};
use crate::support::broker::journal;
use crate::support::{LinkSpec, Trader, add_account, add_link, eventually};

const TWO_HOURS: i64 = 7_200_000;

struct Sides {
    fx: super::Fixture,
    /// The followers' broker.
    follower: Trader,
    _follower_broker: SimBroker,
}

/// Master `m1` on the fixture's broker; followers `f2`.. on a second broker two hours ahead,
/// linked with `links` (each spec with its `pending_orders` setting).
async fn two_servers(name: &str, links: Vec<(LinkSpec, &str)>) -> (Sides, Vec<i64>) {
    let mut fx = fixture(name, Broker::Unprotected, |_| {}).await;
    let mut options = ServeOptions::new("127.0.0.1:0", fx.dir.path("journal-f.jsonl"));
    options.fence_check = false;
    options.dedupe = false;
    options.clock_offset_ms = TWO_HOURS;
    let follower_broker = SimBroker::start(options).await.unwrap();
    let f_addr = follower_broker.addr.to_string();
    add_account(&mut fx.conn, 1, "master", &fx.addr, "m1").await;
    let mut magics = Vec::new();
    for (i, (spec, pending)) in links.into_iter().enumerate() {
        let f = i as i64 + 2;
        add_account(&mut fx.conn, f, "follower", &f_addr, &format!("f{f}")).await;
        let (link, magic) = add_link(&mut fx.conn, 1, f, spec).await;
        sqlx::query("UPDATE copy_links SET pending_orders = $2 WHERE id = $1")
            .bind(link)
            .bind(pending)
            .execute(&mut fx.conn)
            .await
            .unwrap();
        magics.push(magic);
    }
    (
        Sides {
            fx,
            follower: Trader { addr: f_addr },
            _follower_broker: follower_broker,
        },
        magics,
    )
}

impl Sides {
    async fn place(
        &self,
        side: Side,
        kind: PendingKind,
        price: f64,
        expiry_ms: Option<i64>,
    ) -> i64 {
        crate::support::place_master_order(&self.fx.addr, side, kind, price, expiry_ms).await
    }

    /// The pending copy of master order `ticket` on `login`, once `ok` holds for it.
    async fn pending_copy(
        &self,
        login: &str,
        ticket: i64,
        what: &str,
        ok: impl Fn(&PendingOrder) -> bool,
    ) -> PendingOrder {
        let marker = format!("mc{ticket}");
        eventually(format!("{login}: {what}"), WAIT, async || {
            tools::orders(&self.follower.addr, login)
                .await
                .unwrap_or_default()
                .into_iter()
                .find(|o| o.comment == marker && ok(o))
        })
        .await
    }

    async fn no_pending_copy(&self, login: &str, ticket: i64, what: &str) {
        let marker = format!("mc{ticket}");
        eventually(format!("{login}: {what}"), WAIT, async || {
            let orders = tools::orders(&self.follower.addr, login).await.ok()?;
            (!orders.iter().any(|o| o.comment == marker)).then_some(())
        })
        .await;
    }

    /// The follower broker's accepted node requests of `action` on `login` carrying `comment`
    /// (amends and cancels carry their order's).
    fn accepted(&self, login: &str, action: &str, comment: &str) -> usize {
        journal(&self.fx.dir.path("journal-f.jsonl"))
            .into_iter()
            .filter(|l| {
                l.client != "manual"
                    && l.login == login
                    && l.action == action
                    && l.accepted
                    && l.comment.as_deref() == Some(comment)
            })
            .count()
    }

    async fn price(&self, addr: &str, price: f64) {
        tools::set_price(addr, "EURUSD", price).await.unwrap();
    }

    /// Every position on `login` carrying master ticket `ticket`'s marker.
    async fn copies(&self, login: &str, ticket: i64) -> Vec<copier_node::broker::types::Position> {
        let marker = format!("mc{ticket}");
        self.follower
            .positions(login)
            .await
            .into_iter()
            .filter(|p| p.comment == marker)
            .collect()
    }
}

/// Place, amend (price and expiry), fill under the same marker, reverse, fill-only, cancel and
/// expiry, with the expiry converted between the two servers' clocks.
#[tokio::test]
async fn pending_orders_are_copied_amended_filled_and_cancelled_under_one_marker() {
    let reversed = LinkSpec {
        reverse: true,
        ..Default::default()
    };
    let (mut s, magics) = two_servers(
        "dec-pending",
        vec![
            (LinkSpec::default(), "copy"),
            (reversed, "copy"),
            (LinkSpec::default(), "fill_only"),
        ],
    )
    .await;
    let node = s.fx.node("a", 4).await;
    let m_addr = s.fx.addr.clone();
    let f_addr = s.follower.addr.clone();

    // A buy limit below the market, expiring in an hour on the master's (UTC) clock.
    let expiry = copier_node::wall_clock::unix_ms() + 3_600_000;
    let t = s
        .place(Side::Buy, PendingKind::Limit, 1.095, Some(expiry))
        .await;
    let copy = s.pending_copy("f2", t, "the pending copy", |_| true).await;
    assert_eq!(
        (
            copy.side,
            copy.kind,
            copy.price,
            copy.volume,
            copy.sl,
            copy.tp,
            copy.magic
        ),
        (
            Side::Buy,
            PendingKind::Limit,
            1.095,
            0.4,
            Some(1.08),
            Some(1.12),
            magics[0]
        )
    );
    assert_eq!(
        copy.expiry_ms,
        Some(expiry + TWO_HOURS),
        "the same instant on the follower server's clock (two hours ahead)"
    );
    let rev = s
        .pending_copy("f3", t, "the reversed pending copy", |_| true)
        .await;
    assert_eq!(
        (rev.side, rev.kind, rev.price, rev.sl, rev.tp),
        (Side::Sell, PendingKind::Stop, 1.095, Some(1.12), Some(1.08)),
        "a buy limit reversed is a sell stop at the same price, its stops swapped"
    );

    // The master moves its order and makes it good till cancelled: the copies follow.
    crate::support::amend_master_order(&m_addr, t).await;
    for login in ["f2", "f3"] {
        s.pending_copy(login, t, "amended to the master's price, no expiry", |o| {
            o.price == 1.093 && o.expiry_ms.is_none()
        })
        .await;
    }
    assert!(
        tools::orders(&f_addr, "f4").await.unwrap().is_empty(),
        "a fill-only link places nothing"
    );

    // The follower's market reaches the price first: the pending copies fill (kept while the
    // master's order rests); then the master's: the fill-only link copies it at market.
    s.price(&f_addr, 1.092).await;
    for (login, magic, side) in [("f2", magics[0], Side::Buy), ("f3", magics[1], Side::Sell)] {
        let c = s.follower.copy_of(login, magic, t, WAIT).await;
        assert_eq!((c.side, c.volume), (side, 0.4), "{login}");
    }
    // Each fill is in the copy ledger as it happened (not found later by a reconcile).
    let conn = &mut s.fx.conn;
    eventually("the fills in the copy ledger", WAIT, async || {
        let rows: Vec<(String, bool, Option<f64>)> = sqlx::query_as(
            "SELECT login, found_by_reconcile, requested_price FROM copy_ledger WHERE master_ticket = $1 ORDER BY login",
        )
        .bind(t)
        .fetch_all(&mut *conn)
        .await
        .unwrap();
        (rows.len() == 2).then_some(rows)
    })
    .await
    .iter()
    .for_each(|(login, found, requested)| {
        assert!(!found, "{login}: recorded from the stream");
        assert_eq!(*requested, Some(1.093), "{login}: requested at the order's price");
    });
    s.price(&m_addr, 1.092).await;
    let f4 = s.follower.copy_of("f4", magics[2], t, WAIT).await;
    assert_eq!((f4.side, f4.volume), (Side::Buy, 0.4));
    // The master closes its position: every copy closes.
    s.fx.t.close("m1", t, None).await;
    for (login, magic) in [("f2", magics[0]), ("f3", magics[1]), ("f4", magics[2])] {
        s.follower
            .wait_copy(login, magic, t, WAIT, "closed with the master", |c| {
                c.is_none()
            })
            .await;
    }
    let marker = format!("mc{t}");
    for login in ["f2", "f3"] {
        assert_eq!(
            (
                s.accepted(login, "place", &marker),
                s.accepted(login, "open", &marker)
            ),
            (1, 0),
            "{login}: one pending copy, which became the copy; no order at market"
        );
    }
    assert_eq!(
        (
            s.accepted("f4", "place", &marker),
            s.accepted("f4", "open", &marker)
        ),
        (0, 1),
        "fill-only: one copy at market"
    );

    // A sell limit the master cancels: the pending copy is cancelled.
    s.price(&m_addr, 1.1).await;
    s.price(&f_addr, 1.1).await;
    let c = s.place(Side::Sell, PendingKind::Limit, 1.105, None).await;
    s.pending_copy("f2", c, "the second pending copy", |_| true)
        .await;
    tools::trade(&m_addr, "m1", HandOrder::Cancel { ticket: c })
        .await
        .unwrap();
    s.no_pending_copy("f2", c, "cancelled with the master's order")
        .await;
    assert_eq!(s.accepted("f2", "cancel", &format!("mc{c}")), 1);

    // An order expiring in two seconds: its copy expires at the same instant on the follower's
    // server (its converted expiry), and nothing is copied.
    let soon = copier_node::wall_clock::unix_ms() + 2_000;
    let e = s
        .place(Side::Buy, PendingKind::Limit, 1.09, Some(soon))
        .await;
    let copy = s
        .pending_copy("f2", e, "the expiring order's copy", |_| true)
        .await;
    assert_eq!(copy.expiry_ms, Some(soon + TWO_HOURS));
    s.no_pending_copy("f2", e, "expired with the master's")
        .await;
    assert!(s.copies("f2", e).await.is_empty());
    assert_eq!(
        s.accepted("f2", "place", &format!("mc{e}")),
        1,
        "an expired pending copy is not placed again"
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// The master's order fills while the follower's copy is still pending: the copy is cancelled,
/// and only once the cancel is confirmed is the fill copied at market.
#[tokio::test]
async fn the_master_filling_first_cancels_the_pending_copy_then_copies_at_market() {
    let (mut s, magics) =
        two_servers("dec-pending-fill", vec![(LinkSpec::default(), "copy")]).await;
    let node = s.fx.node("a", 2).await;
    let m_addr = s.fx.addr.clone();
    let t = s.place(Side::Buy, PendingKind::Limit, 1.095, None).await;
    let pending = s.pending_copy("f2", t, "the pending copy", |_| true).await;
    // Only the master's market reaches the price.
    s.price(&m_addr, 1.094).await;
    let copy = s.follower.copy_of("f2", magics[0], t, WAIT).await;
    assert_ne!(
        copy.ticket, pending.ticket,
        "a market copy, not the pending copy's fill"
    );
    assert!(
        tools::orders(&s.follower.addr, "f2")
            .await
            .unwrap()
            .is_empty()
    );
    let marker = format!("mc{t}");
    let lines: Vec<(String, bool)> = journal(&s.fx.dir.path("journal-f.jsonl"))
        .into_iter()
        .filter(|l| l.client != "manual" && l.login == "f2")
        .filter(|l| l.comment.as_deref() == Some(&marker) || l.ticket == Some(pending.ticket))
        .filter(|l| l.action != "login")
        .map(|l| (l.action, l.accepted))
        .collect();
    assert_eq!(
        lines,
        vec![
            ("place".to_string(), true),
            ("cancel".to_string(), true),
            ("open".to_string(), true)
        ],
        "place, cancel confirmed, then the copy at market"
    );
    assert_eq!(s.copies("f2", t).await.len(), 1);
    node.shutdown();
    node.wait().await.unwrap();
}

/// The follower's copy fills first, then the master cancels its order: the copy is closed.
#[tokio::test]
async fn the_master_cancelling_after_the_copy_filled_closes_the_copy() {
    let (mut s, magics) =
        two_servers("dec-pending-cancel", vec![(LinkSpec::default(), "copy")]).await;
    let node = s.fx.node("a", 2).await;
    let m_addr = s.fx.addr.clone();
    let f_addr = s.follower.addr.clone();
    let t = s.place(Side::Sell, PendingKind::Stop, 1.095, None).await;
    s.pending_copy("f2", t, "the pending copy", |_| true).await;
    s.price(&f_addr, 1.094).await;
    s.follower.copy_of("f2", magics[0], t, WAIT).await;
    tools::trade(&m_addr, "m1", HandOrder::Cancel { ticket: t })
        .await
        .unwrap();
    s.follower
        .wait_copy(
            "f2",
            magics[0],
            t,
            WAIT,
            "closed: the master cancelled",
            |c| c.is_none(),
        )
        .await;
    assert_eq!(s.accepted("f2", "close", &format!("mc{t}")), 1);
    node.shutdown();
    node.wait().await.unwrap();
}

/// The `order_copies` row of master ticket `ticket` on follower 2: (its ticket, how it ended).
async fn order_copy(
    conn: &mut sqlx::PgConnection,
    ticket: i64,
) -> Vec<(Option<i64>, Option<String>)> {
    sqlx::query_as(
        "SELECT follower_ticket, ended FROM order_copies WHERE follower_id = 2 AND master_ticket = $1",
    )
    .bind(ticket)
    .fetch_all(conn)
    .await
    .unwrap()
}

/// A pending copy cancelled by hand on the follower (its stream says so while the session runs,
/// or an ordered read finds it gone after a restart) is not placed again, and the master order's
/// fill is then copied at market: both ends are recorded in `order_copies`.
#[tokio::test]
async fn a_pending_copy_cancelled_by_hand_is_not_placed_again_and_the_fill_is_copied_at_market() {
    let (mut s, magics) =
        two_servers("dec-pending-hand", vec![(LinkSpec::default(), "copy")]).await;
    let node = s.fx.node("a", 2).await;
    let (m_addr, f_addr) = (s.fx.addr.clone(), s.follower.addr.clone());
    let hand_cancel = async |ticket: i64| {
        tools::trade(&f_addr, "f2", HandOrder::Cancel { ticket })
            .await
            .unwrap();
    };

    // While the session runs: the stream tells it.
    let t = s.place(Side::Buy, PendingKind::Limit, 1.095, None).await;
    let copy = s.pending_copy("f2", t, "the pending copy", |_| true).await;
    hand_cancel(copy.ticket).await;
    let conn = &mut s.fx.conn;
    eventually("the hand cancel recorded", WAIT, async || {
        let rows = order_copy(&mut *conn, t).await;
        (rows == vec![(Some(copy.ticket), Some("cancelled".to_string()))]).then_some(())
    })
    .await;

    // While no session runs: the next one's ordered read finds it gone.
    let u = s.place(Side::Buy, PendingKind::Limit, 1.093, None).await;
    let second = s
        .pending_copy("f2", u, "the second pending copy", |_| true)
        .await;
    node.shutdown();
    node.wait().await.unwrap();
    hand_cancel(second.ticket).await;
    let node = s.fx.node("b", 2).await;
    let conn = &mut s.fx.conn;
    eventually("the vanished copy recorded", WAIT, async || {
        let rows = order_copy(&mut *conn, u).await;
        (rows == vec![(Some(second.ticket), Some("vanished".to_string()))]).then_some(())
    })
    .await;

    // Both master orders fill: each copied once, at market; neither pending copy placed again.
    s.price(&m_addr, 1.09).await;
    for ticket in [t, u] {
        let c = s.follower.copy_of("f2", magics[0], ticket, WAIT).await;
        assert_eq!(c.volume, 0.4);
        let marker = format!("mc{ticket}");
        assert_eq!(
            (
                s.accepted("f2", "place", &marker),
                s.accepted("f2", "open", &marker)
            ),
            (1, 1),
            "{marker}"
        );
    }
    node.shutdown();
    node.wait().await.unwrap();
}

/// A pending copy refused because the follower's market is closed put nothing on the book: it is
/// forgotten and placed once the market opens.
#[tokio::test]
async fn a_pending_copy_refused_while_the_market_is_closed_is_placed_when_it_opens() {
    let (mut s, _) = two_servers("dec-pending-closed", vec![(LinkSpec::default(), "copy")]).await;
    let node = s.fx.node("a", 2).await;
    let f_addr = s.follower.addr.clone();
    tools::set_market(&f_addr, "EURUSD", Some(false))
        .await
        .unwrap();
    let t = s.place(Side::Buy, PendingKind::Limit, 1.095, None).await;
    let marker = format!("mc{t}");
    let path = s.fx.dir.path("journal-f.jsonl");
    eventually("a place refused: market closed", WAIT, async || {
        journal(&path)
            .iter()
            .any(|l| {
                l.action == "place"
                    && !l.accepted
                    && l.comment.as_deref() == Some(marker.as_str())
                    && l.reason
                        .as_deref()
                        .is_some_and(|r| r.starts_with("market closed"))
            })
            .then_some(())
    })
    .await;
    tools::set_market(&f_addr, "EURUSD", Some(true))
        .await
        .unwrap();
    let copy = s
        .pending_copy("f2", t, "placed once the market opened", |_| true)
        .await;
    assert_eq!(s.accepted("f2", "place", &marker), 1);
    let conn = &mut s.fx.conn;
    eventually("its record", WAIT, async || {
        let rows = order_copy(&mut *conn, t).await;
        (rows == vec![(Some(copy.ticket), None)]).then_some(())
    })
    .await;
    node.shutdown();
    node.wait().await.unwrap();
}
