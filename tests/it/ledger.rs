//! The copy ledger end to end: every copy's row (tickets, prices, slippage, latency legs), the
//! `copies` command, and R2 held by the ledger when the follower's broker keeps no history.

use std::time::Duration;

use copier_node::app::RunOptions;
use copier_node::broker::types::Side;

use crate::support::faults::FaultyBrokers;
use crate::support::fixture::{CopySetup, master_and_follower};
use crate::support::http::{get, sample};
use crate::support::process::run_to_end;
use crate::support::{FAST, LinkSpec, config, eventually, start_node, start_node_with};

const WAIT: Duration = Duration::from_secs(20);

async fn wait_ready(conn: &mut sqlx::PgConnection) {
    eventually("the follower to reconcile", WAIT, async || {
        let st: Option<String> =
            sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = 2")
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        st.is_some_and(|t| t.starts_with("follower: master"))
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn every_copy_has_its_ledger_row_with_prices_and_latency_legs() {
    let mut s = CopySetup::new("ledger").await;
    let (link, magic) = master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    let node = start_node(&config(&s.db, "ledger-node", 10, FAST)).await;
    wait_ready(&mut s.conn).await;
    let ticket = s.t.open("m1", "EURUSD", Side::Sell, 0.3, None, None).await;
    let copy = s.t.copy_of("f2", magic, ticket, WAIT).await;
    let master_price = s.t.positions("m1").await[0].open_price;

    let out = eventually("the copy's ledger row", WAIT, async || {
        let (code, out, err) = run_to_end(
            &["copies", "2", "--json"],
            &[("DATABASE_URL", s.db.url.as_str())],
        );
        assert_eq!(code, 0, "{err}");
        let rows: serde_json::Value = serde_json::from_str(&out).unwrap();
        (rows.as_array().is_some_and(|r| r.len() == 1)).then_some(rows)
    })
    .await;
    let row = &out[0];
    assert_eq!(row["master_ticket"].as_i64(), Some(ticket));
    assert_eq!(row["follower_ticket"].as_i64(), Some(copy.ticket));
    assert_eq!(row["link_id"].as_i64(), Some(link));
    assert_eq!(row["side"], "sell");
    assert_eq!(row["requested_price"].as_f64(), Some(master_price));
    assert_eq!(row["filled_price"].as_f64(), Some(copy.open_price));
    let slippage = row["slippage"].as_f64().expect("slippage computed");
    assert!(
        (slippage - (master_price - copy.open_price)).abs() < 1e-9,
        "{row}"
    );
    let at = |k: &str| {
        row[k]
            .as_i64()
            .unwrap_or_else(|| panic!("{k} missing: {row}"))
    };
    // Each leg's two ends are recorded; the node-clock leg is ordered.
    let (fill, event, decided, accepted) = (
        at("master_fill_ms"),
        at("event_committed_ms"),
        at("decided_ms"),
        at("accepted_ms"),
    );
    assert!(decided <= accepted, "{row}");
    // All clocks are this machine's here: the legs are short and in order within a loose bound.
    assert!(event - fill > -1000 && decided - event > -1000, "{row}");
    // The same path in µs: the node-clock instants in order, each the ms column's instant.
    let (event_us, notice_us, decided_us, sent_us, accepted_us) = (
        at("event_committed_us"),
        at("notice_us"),
        at("decided_us"),
        at("sent_us"),
        at("accepted_us"),
    );
    assert!(
        notice_us <= decided_us && decided_us <= sent_us && sent_us <= accepted_us,
        "{row}"
    );
    assert_eq!(
        (decided_us.div_euclid(1000), accepted_us.div_euclid(1000)),
        (decided, accepted),
        "{row}"
    );
    assert!((event_us - event * 1000).abs() <= 1000, "{row}");
    assert!(notice_us - event_us > -1_000_000, "{row}");
    assert_eq!(row["found_by_reconcile"], false);

    let text = run_to_end(&["copies", "2"], &[("DATABASE_URL", s.db.url.as_str())]).1;
    assert!(
        text.contains(&format!("copy {} of master 1 ticket {ticket}", copy.ticket)),
        "{text}"
    );
    let metrics = get(node.http_addr, "/metrics").await.1;
    assert!(
        sample(
            &metrics,
            "copier_copy_leg_seconds_count{leg=\"decision_to_accept\"}"
        ) >= 1.0
    );
    node.shutdown();
}

/// Waits until node `node` owns follower 2 and its session has reconciled.
async fn reconciled_by(conn: &mut sqlx::PgConnection, node: &str) {
    eventually("the new session to reconcile", WAIT, async || {
        let by: Option<Option<String>> = sqlx::query_scalar(
            "SELECT node_id FROM trading_accounts WHERE id = 2 AND status LIKE 'follower: master%'",
        )
        .fetch_optional(&mut *conn)
        .await
        .unwrap();
        (by.flatten().as_deref() == Some(node)).then_some(())
    })
    .await;
}

/// A node in-process whose broker client shows follower f2 no history (as a broker that keeps
/// none).
async fn start_without_history(s: &CopySetup, id: &str) -> copier_node::app::NodeHandle {
    let brokers = FaultyBrokers::new(id);
    brokers
        .faults
        .no_history
        .lock()
        .unwrap()
        .insert("f2".into());
    start_node_with(
        &config(&s.db, id, 10, FAST),
        RunOptions {
            brokers: Some(brokers),
            ..Default::default()
        },
    )
    .await
}

/// A follower whose broker keeps no history (and, as MT4/MT5 servers, deduplicates nothing and
/// checks no fence): a copy closed by hand is still never reopened by a new session, because the
/// ledger remembers it was copied. Judged from the journal alone: one open request, ever.
#[tokio::test]
async fn a_copy_closed_by_hand_stays_closed_when_the_broker_keeps_no_history() {
    let mut s = CopySetup::unprotected("ledger-r2").await;
    let (_, magic) = master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    let first = start_without_history(&s, "r2-a").await;
    wait_ready(&mut s.conn).await;
    let ticket = s.t.open("m1", "GBPUSD", Side::Buy, 0.2, None, None).await;
    let copy = s.t.copy_of("f2", magic, ticket, WAIT).await;
    eventually("the copy's ledger row", WAIT, async || {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM copy_ledger WHERE follower_id = 2")
            .fetch_one(&mut s.conn)
            .await
            .unwrap();
        (n == 1).then_some(())
    })
    .await;
    // Closed by hand while no session watches the follower (nothing records it but the
    // broker, which keeps no history).
    first.shutdown();
    first.wait().await.unwrap();
    s.t.close("f2", copy.ticket, None).await;

    // A new session reads positions (the copy is gone) and no history at all.
    let second = start_without_history(&s, "r2-b").await;
    reconciled_by(&mut s.conn, "r2-b").await;
    // A later master trade is copied (the session works), and the closed copy is not reopened.
    let next = s.t.open("m1", "EURUSD", Side::Sell, 0.1, None, None).await;
    s.t.copy_of("f2", magic, next, WAIT).await;
    let opens = crate::support::broker::journal(&s.dir.path("journal.jsonl"))
        .into_iter()
        .filter(|l| l.login == "f2" && l.action == "open")
        .filter(|l| l.comment.as_deref() == Some(&format!("mc{ticket}")))
        .count();
    assert_eq!(opens, 1, "the copy closed by hand was asked for again");
    second.shutdown();
}

/// A follower whose broker keeps no history (no record of a partial close): a copy trimmed with
/// its master is not trimmed again by a new session, which takes the copy's opening volume from
/// the ledger rather than from what the broker shows open now (0.2 of a copy opened at 0.5, with
/// the master at 0.2 of 0.5, is already right; from 0.2 the ratio would cut it to 0.08). Judged
/// from the journal and the broker's positions: one trim, ever.
#[tokio::test]
async fn a_trimmed_copy_is_not_trimmed_again_by_a_new_session_when_the_broker_keeps_no_history() {
    let mut s = CopySetup::unprotected("ledger-trim").await;
    let (_, magic) = master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    let first = start_without_history(&s, "trim-a").await;
    wait_ready(&mut s.conn).await;
    let ticket = s.t.open("m1", "GBPUSD", Side::Buy, 0.5, None, None).await;
    let copy = s.t.copy_of("f2", magic, ticket, WAIT).await;
    assert_eq!(copy.volume, 0.5);
    s.t.close("m1", ticket, Some(0.3)).await;
    let volume_of = async |s: &CopySetup| {
        s.t.positions("f2")
            .await
            .into_iter()
            .find(|p| p.ticket == copy.ticket)
            .map(|p| p.volume)
    };
    eventually("the copy trimmed to 0.2", WAIT, async || {
        (volume_of(&s).await == Some(0.2)).then_some(())
    })
    .await;
    first.shutdown();
    first.wait().await.unwrap();

    // A new session reads the copy at 0.2 and no history of the trim.
    let second = start_without_history(&s, "trim-b").await;
    reconciled_by(&mut s.conn, "trim-b").await;
    // A later master trade is copied (the session has reconciled and works).
    let next = s.t.open("m1", "EURUSD", Side::Sell, 0.1, None, None).await;
    s.t.copy_of("f2", magic, next, WAIT).await;
    let trims: Vec<Option<f64>> = crate::support::broker::journal(&s.dir.path("journal.jsonl"))
        .into_iter()
        .filter(|l| {
            l.login == "f2" && l.accepted && l.action == "close" && l.ticket == Some(copy.ticket)
        })
        .map(|l| l.volume)
        .collect();
    assert_eq!(trims, vec![Some(0.3)], "the copy was trimmed once, by 0.3");
    assert_eq!(volume_of(&s).await, Some(0.2));
    second.shutdown();
}

/// A ledger row of a master account the master row no longer names (its login moved) does not
/// count: the same ticket number on the new account is another position, and is copied.
#[tokio::test]
async fn a_ticket_recorded_under_another_master_account_does_not_block_a_copy() {
    let mut s = CopySetup::new("ledger-master-moved").await;
    let (link, magic) = master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    // The simulated broker numbers positions from 1000001: the master's first position will be
    // that ticket. A row says it was copied when the master row named another account.
    sqlx::query(
        "INSERT INTO copy_ledger (follower_id, follower_ticket, server, login, link_id, master_id,
                                  master_server, master_login, master_ticket, symbol, side, volume,
                                  filled_price, node_id, owner_epoch)
         VALUES (2, 999, $1, 'f2', $2, 1, $1, 'm-before', 1000001, 'EURUSD', 'buy', 0.1, 1.1, 'x', 1)",
    )
    .bind(&s.addr)
    .bind(link)
    .execute(&mut s.conn)
    .await
    .unwrap();
    let node = start_node(&config(&s.db, "moved", 10, FAST)).await;
    wait_ready(&mut s.conn).await;
    let ticket = s.t.open("m1", "EURUSD", Side::Buy, 0.1, None, None).await;
    assert_eq!(
        ticket, 1_000_001,
        "the test's premise: the same ticket number"
    );
    s.t.copy_of("f2", magic, ticket, WAIT).await;
    node.shutdown();
}

/// A copy of master ticket 1000 by `follower_id` (login `f<id>` on `broker:1`, link `follower_id`),
/// recorded by node `n1` at `epoch`, as the copy-ledger writer's tests write it.
fn ledger_write(
    follower_id: i64,
    epoch: i64,
    ticket: i64,
) -> copier_node::db::copy::ledger::CopyWrite {
    use copier_node::db::copy::ledger::{CopyRecord, CopyWrite};

    CopyWrite {
        node_id: "n1".into(),
        follower_id,
        epoch,
        record: CopyRecord {
            server: "broker:1".into(),
            login: format!("f{follower_id}"),
            follower_ticket: ticket,
            link_id: follower_id,
            master_id: 1,
            master_ticket: 1000,
            symbol: "EURUSD".into(),
            side: "buy".into(),
            volume: 0.1,
            requested_price: Some(1.1),
            filled_price: 1.1001,
            slippage: None,
            slippage_bps: None,
            slippage_points: Some(1.0),
            master_fill_ms: Some(1),
            event_committed_ms: Some(2),
            decided_ms: None,
            accepted_ms: Some(4),
            event_committed_us: Some(2_000),
            notice_us: Some(2_500),
            decided_us: None,
            sent_us: Some(3_500),
            accepted_us: Some(4_000),
            found_by_reconcile: false,
            opened_volume: None,
        },
    }
}

/// The node's copy-ledger writer (one statement per batch): copies recorded at once by many followers
/// are each fenced by their own follower's (node, epoch) and written once, and a row the table
/// refuses fails alone.
#[tokio::test]
async fn copies_recorded_at_once_by_many_followers_are_each_fenced_and_written_once() {
    use copier_node::db::copy::ledger::CopyLedgerWriter;

    let db = crate::support::pg::TestDb::new().await;
    let mut conn = db.conn().await;
    crate::support::add_account(&mut conn, 1, "master", "broker:1", "m1").await;
    for id in 2..=21 {
        crate::support::add_account(&mut conn, id, "follower", "broker:1", &format!("f{id}")).await;
    }
    // Followers 2..=21 owned by node n1 at epoch 7; follower 21 since at epoch 8 (its old
    // owner's writes are stale).
    crate::support::insert_node(&mut conn, "n1", "1 minute", 20).await;
    sqlx::query(
        "UPDATE trading_accounts SET node_id = 'n1', owner_epoch = CASE WHEN id = 21 THEN 8 ELSE 7 END, \
         lease_until = now() + interval '1 minute' WHERE id >= 2",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let writer = CopyLedgerWriter::spawn(copier_node::db::Db::direct(pool));
    // 19 followers' copies (ten each), a stale owner's, and one copy twice, all at once.
    let mut jobs = Vec::new();
    for f in 2..=20 {
        for t in 0..10 {
            jobs.push(ledger_write(f, 7, f * 100 + t));
        }
    }
    jobs.push(ledger_write(21, 7, 2100));
    jobs.push(ledger_write(2, 7, 200));
    // A row the table refuses (its side): it fails alone, whatever batch it lands in.
    let mut bad = ledger_write(3, 7, 399);
    bad.record.side = "up".into();
    jobs.push(bad);
    let mut results = crate::support::write_at_once(&writer, jobs).await;
    let refused = results.pop().expect("the bad row's outcome");
    assert!(refused.is_err(), "{refused:?}");
    let results: Vec<bool> = results.into_iter().map(Result::unwrap).collect();
    assert_eq!(results.iter().filter(|r| **r).count(), 190, "{results:?}");
    assert!(!results[190], "the stale owner's copy is not written");
    assert!(
        !results[191],
        "a copy already recorded is not written again"
    );
    let (rows, stale, points): (i64, i64, f64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE follower_id = 21), sum(slippage_points) FROM copy_ledger",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((rows, stale, points), (190, 0, 190.0));
    let (master_login, decided): (String, Option<i64>) = sqlx::query_as(
        "SELECT master_login, decided_ms FROM copy_ledger WHERE follower_id = 5 AND follower_ticket = 503",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((master_login.as_str(), decided), ("m1", None));
    let us: Vec<Option<i64>> = sqlx::query_scalar(
        "SELECT ARRAY[event_committed_us, notice_us, decided_us, sent_us, accepted_us] \
           FROM copy_ledger WHERE follower_id = 5 AND follower_ticket = 503",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        us,
        [Some(2_000), Some(2_500), None, Some(3_500), Some(4_000)],
        "each µs instant in its own column"
    );
}

/// A writer that gives way to the node's orders writes a hurried queue at once: a session
/// ending waits for its ledger rows before its account is released, and the hand-off's receiver
/// for that release, so those rows do not wait for the other sessions' orders. Here an order
/// stays on its way throughout and the writer would give way for an hour: the first write goes
/// only once hurried; the next, not hurried, waits for the order (not written while it is on its
/// way) and goes once it is answered.
#[tokio::test]
async fn a_hurried_ledger_write_goes_while_the_nodes_orders_are_on_their_way() {
    use copier_node::db::batch::Orders;
    use copier_node::db::copy::ledger::CopyLedgerWriter;

    let db = crate::support::pg::TestDb::new().await;
    let mut conn = db.conn().await;
    crate::support::add_account(&mut conn, 1, "master", "broker:1", "m1").await;
    crate::support::add_account(&mut conn, 2, "follower", "broker:1", "f2").await;
    crate::support::insert_node(&mut conn, "n1", "1 minute", 20).await;
    sqlx::query(
        "UPDATE trading_accounts SET node_id = 'n1', owner_epoch = 7, \
         lease_until = now() + interval '1 minute' WHERE id = 2",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let orders = std::sync::Arc::new(Orders::default());
    let writer = CopyLedgerWriter::spawn_giving_way_within(
        copier_node::db::Db::direct(pool),
        orders.clone(),
        Duration::from_secs(3600),
    );
    let on_its_way = orders.sending();
    let hurried = writer.submit(ledger_write(2, 7, 201));
    writer.hurry();
    let written = tokio::time::timeout(WAIT, hurried.outcome())
        .await
        .expect("a hurried write goes while an order is on its way");
    assert_eq!(written, Ok(true));
    let in_ledger = async |conn: &mut sqlx::PgConnection, ticket: i64| -> bool {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM copy_ledger WHERE follower_id = 2 AND follower_ticket = $1)",
        )
        .bind(ticket)
        .fetch_one(conn)
        .await
        .unwrap()
    };
    assert!(in_ledger(&mut conn, 201).await, "the hurried row is in");
    // Not hurried: the writer gives way again.
    let waiting = writer.submit(ledger_write(2, 7, 202));
    assert!(
        !in_ledger(&mut conn, 202).await,
        "a write not hurried waits for the order on its way"
    );
    drop(on_its_way);
    assert_eq!(
        tokio::time::timeout(WAIT, waiting.outcome()).await,
        Ok(Ok(true)),
        "written once no order is on its way"
    );
    assert!(in_ledger(&mut conn, 202).await);
}

/// A follower sends no order while one of its earlier copies has no ledger row yet: a later owner
/// (or this session after a lost reply) decides from the ledger what was ever copied, so a copy
/// whose row is still on its way must not be followed by the next order. The ledger's table is
/// locked (writes wait; reads pass) after the first copy is sent; the master's second trade is
/// announced meanwhile, and its copy must wait for the lock's release. With the broker's fence
/// check and dedupe off; judged by the journal's times against the release.
#[tokio::test]
async fn no_order_leaves_while_an_earlier_copy_of_the_follower_has_no_ledger_row() {
    use sqlx::Connection;
    use sqlx::postgres::PgListener;

    let mut s = CopySetup::unprotected("ledger-before-order").await;
    let (_, magic) = master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    // A fence of 20 s: the ledger writer's lock wait may last 4 s (a fifth of it) before the
    // database gives up, well past how long the lock below is held.
    let timing = crate::support::Timing {
        lease: "60s",
        fence: "20s",
        cycle: "2s",
    };
    let node = start_node(&config(&s.db, "ledger-before-order", 10, timing)).await;
    wait_ready(&mut s.conn).await;
    let mut listener = PgListener::connect(&s.db.url).await.unwrap();
    listener
        .listen(&copier_node::channels::master(1))
        .await
        .unwrap();

    let mut locker = sqlx::PgConnection::connect(&s.db.url).await.unwrap();
    sqlx::raw_sql("BEGIN; LOCK TABLE copy_ledger IN SHARE MODE")
        .execute(&mut locker)
        .await
        .unwrap();
    let first = s.t.open("m1", "EURUSD", Side::Buy, 0.1, None, None).await;
    s.t.copy_of("f2", magic, first, WAIT).await;
    // The first copy's row is on its way: its insert waits for the lock.
    eventually(
        "the first copy's ledger row to wait for the lock",
        WAIT,
        async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
             WHERE c.relname = 'copy_ledger' AND NOT l.granted",
            )
            .fetch_one(&mut s.conn)
            .await
            .unwrap();
            (waiting > 0).then_some(())
        },
    )
    .await;
    let second = s.t.open("m1", "GBPUSD", Side::Buy, 0.2, None, None).await;
    // The second trade is announced (the node hears the same NOTIFY).
    loop {
        let n = tokio::time::timeout(WAIT, listener.recv())
            .await
            .expect("the second trade announced")
            .unwrap();
        let payload: serde_json::Value = serde_json::from_str(n.payload()).unwrap();
        if names_ticket(&payload, second) {
            break;
        }
    }
    let journal = s.dir.path("journal.jsonl");
    let copied = |ticket: i64| {
        crate::support::broker::journal(&journal)
            .into_iter()
            .find(|l| {
                l.login == "f2"
                    && l.action == "open"
                    && l.accepted
                    && l.comment.as_deref() == Some(&format!("mc{ticket}"))
            })
    };
    // While the first row waits, the second copy must not leave: held until it does (a failure)
    // or for a second (a quarter of the lock wait the database allows), whichever comes first.
    let held_until = tokio::time::Instant::now() + Duration::from_secs(1);
    while tokio::time::Instant::now() < held_until {
        assert!(
            copied(second).is_none(),
            "the second copy was sent while the first copy's ledger row was not written"
        );
        tokio::time::sleep(Duration::from_millis(20)).await; // polling interval
    }
    let released_ms = copier_node::wall_clock::unix_ms();
    sqlx::raw_sql("COMMIT").execute(&mut locker).await.unwrap();
    s.t.copy_of("f2", magic, second, WAIT).await;
    let sent = copied(second).expect("the second copy in the journal");
    assert!(
        sent.ts_ms >= released_ms,
        "the second copy left at {} ms, before the ledger was unlocked at {released_ms} ms",
        sent.ts_ms
    );
    let rows: Vec<i64> = sqlx::query_scalar(
        "SELECT master_ticket FROM copy_ledger WHERE follower_id = 2 ORDER BY master_ticket",
    )
    .fetch_all(&mut s.conn)
    .await
    .unwrap();
    assert!(rows.contains(&first), "the first copy's row: {rows:?}");
    let opens = crate::support::broker::journal(&journal)
        .iter()
        .filter(|l| l.login == "f2" && l.action == "open")
        .count();
    assert_eq!(opens, 2, "one order per master trade");
    node.shutdown();
}

/// Whether a master notice names `ticket` as a position's ticket anywhere in it.
fn names_ticket(v: &serde_json::Value, ticket: i64) -> bool {
    match v {
        serde_json::Value::Object(m) => m
            .iter()
            .any(|(k, v)| (k == "ticket" && v.as_i64() == Some(ticket)) || names_ticket(v, ticket)),
        serde_json::Value::Array(a) => a.iter().any(|v| names_ticket(v, ticket)),
        _ => false,
    }
}
