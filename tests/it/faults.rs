//! The copy engine under faults: lost notifications, lost replies, broker glitches, gated nodes,
//! takeovers, and live link changes. Each ends converged with no duplicate in the journal.

use std::collections::HashMap;
use std::time::Duration;

use copier_node::app::RunOptions;
use copier_node::broker::types::Side;
use sqlx::Executor;

use crate::support::broker::{BrokerProcess, Scratch, journal, start_sim};
use crate::support::chaos::{ChaosProxy, Mode};
use crate::support::faults::FaultyBrokers;
use crate::support::fixture::{CopySetup, master_and_follower};
use crate::support::http::{get, sample};
use crate::support::process::NodeProcess;
use crate::support::{
    FAST, LinkSpec, TestDb, Trader, add_account, add_link, config, config_listen, config_url,
    eventually, start_node, start_node_with, wait_owned, wait_state,
};

const WAIT: Duration = Duration::from_secs(20);

/// Accepted copy opens per (login, comment), from the journal: every value must be 1.
fn accepted_opens(path: &std::path::Path) -> HashMap<(String, String), usize> {
    let mut out = HashMap::new();
    for l in journal(path)
        .iter()
        .filter(|l| l.action == "open" && l.accepted && l.client != "manual")
    {
        *out.entry((l.login.clone(), l.comment.clone().unwrap()))
            .or_insert(0) += 1;
    }
    out
}

fn assert_no_duplicates(path: &std::path::Path) {
    let opens = accepted_opens(path);
    let dups: Vec<_> = opens.iter().filter(|(_, n)| **n > 1).collect();
    assert!(dups.is_empty(), "duplicate copies: {dups:?}");
}

/// Waits until the follower's status says its session reconciled.
async fn reconciled(conn: &mut sqlx::PgConnection, id: i64) {
    eventually(format!("follower {id} to reconcile"), WAIT, async || {
        let s: Option<String> =
            sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = $1")
                .bind(id)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        s.filter(|s| s.starts_with("follower: master")).map(|_| ())
    })
    .await;
}

#[tokio::test]
async fn a_cut_listen_connection_is_repaired_by_a_reconcile_without_duplicates() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("fault-listen").await;
    let (_, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    let a = start_node(&config(&db, "a", 1, FAST)).await;
    wait_state(&a.state, "a owns the master", WAIT, |s| {
        s.owned.contains_key(&1)
    })
    .await;
    // The follower's node LISTENs through a proxy; its other connections are direct.
    let proxy = ChaosProxy::start(db.server_addr()).await;
    let b = start_node(&config_listen(
        &db.url,
        &db.url_via(proxy.port),
        "b",
        10,
        FAST,
    ))
    .await;
    reconciled(&mut conn, 2).await;
    let p0 = t.open("m1", "EURUSD", Side::Buy, 0.1, None, None).await;
    t.copy_of("f2", magic, p0, WAIT).await;

    // Notifications stop arriving; the master keeps trading.
    proxy.set(Mode::Hang);
    let p1 = t.open("m1", "GBPUSD", Side::Sell, 0.2, None, None).await;
    t.close("m1", p0, None).await;
    let p2 = t.open("m1", "EURUSD", Side::Buy, 0.3, None, None).await;
    // The connection is cut: the hub reconnects and every subscriber reconciles.
    proxy.set(Mode::Forward);
    proxy.cut();
    t.copy_of("f2", magic, p1, WAIT).await;
    t.copy_of("f2", magic, p2, WAIT).await;
    t.wait_copy("f2", magic, p0, WAIT, "closed", |c| c.is_none())
        .await;
    assert_no_duplicates(&dir.path("journal.jsonl"));
    for n in [a, b] {
        n.shutdown();
        n.wait().await.unwrap();
    }
    broker.stop().await;
}

#[tokio::test]
async fn an_empty_master_positions_read_closes_nothing() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("fault-glitch").await;
    let (_, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    let first = start_node(&config(&db, "a", 10, FAST)).await;
    reconciled(&mut conn, 2).await;
    let p = t.open("m1", "EURUSD", Side::Buy, 0.5, None, None).await;
    t.copy_of("f2", magic, p, WAIT).await;
    first.shutdown();
    first.wait().await.unwrap();

    // A new owner whose broker reads of the master come back empty (positions and history).
    let brokers = FaultyBrokers::new("g");
    brokers.faults.set_empty_reads("m1", true);
    let glitchy = start_node_with(
        &config(&db, "g", 10, FAST),
        RunOptions {
            brokers: Some(brokers.clone()),
            ..Default::default()
        },
    )
    .await;
    let epoch: i64 = sqlx::query_scalar("SELECT owner_epoch FROM trading_accounts WHERE id = 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    // The new master session published under its epoch, still with the position.
    let positions: String = eventually("the new owner's snapshot", WAIT, async || {
        sqlx::query_scalar(
            "SELECT positions::text FROM master_state WHERE master_id = 1 AND epoch = $1",
        )
        .bind(epoch)
        .fetch_optional(&mut conn)
        .await
        .unwrap()
    })
    .await;
    assert!(
        positions.contains(&p.to_string()),
        "an empty read must not drop the position: {positions}"
    );
    reconciled(&mut conn, 2).await;
    t.copy_of("f2", magic, p, Duration::from_millis(10)).await; // still open
    let closes = journal(&dir.path("journal.jsonl"))
        .iter()
        .filter(|l| l.login == "f2" && l.action == "close")
        .count();
    assert_eq!(closes, 0, "no copy was closed");

    // Reads recover; a real close still reaches the follower.
    brokers.faults.set_empty_reads("m1", false);
    t.close("m1", p, None).await;
    t.wait_copy("f2", magic, p, WAIT, "closed", |c| c.is_none())
        .await;
    glitchy.shutdown();
    glitchy.wait().await.unwrap();
    broker.stop().await;
}

#[tokio::test]
async fn an_empty_follower_read_does_not_reopen_a_copy() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("fault-fglitch").await;
    let (link, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    let brokers = FaultyBrokers::new("a");
    let node = start_node_with(
        &config(&db, "a", 10, FAST),
        RunOptions {
            brokers: Some(brokers.clone()),
            ..Default::default()
        },
    )
    .await;
    reconciled(&mut conn, 2).await;
    let p = t.open("m1", "EURUSD", Side::Buy, 0.5, None, None).await;
    t.copy_of("f2", magic, p, WAIT).await;
    // The follower's reads now come back empty; a link change makes it reconcile.
    brokers.faults.set_empty_reads("f2", true);
    let changed_at: String = sqlx::query_scalar(&format!(
        "UPDATE copy_links SET lot_value = 2 WHERE id = {link} RETURNING now()::text"
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    // The link change makes the session reconcile (which rewrites its status).
    eventually("the reconcile after the link change", WAIT, async || {
        let after: bool = sqlx::query_scalar(
            "SELECT status_at > $1::timestamptz FROM trading_accounts WHERE id = 2",
        )
        .bind(&changed_at)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        after.then_some(())
    })
    .await;
    let opens = accepted_opens(&dir.path("journal.jsonl"));
    assert_eq!(opens.get(&("f2".to_string(), format!("mc{p}"))), Some(&1));
    let sent = journal(&dir.path("journal.jsonl"))
        .iter()
        .filter(|l| l.login == "f2" && l.action == "open")
        .count();
    assert_eq!(
        sent, 1,
        "the session remembered its copy: nothing was even sent again"
    );
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;
}

#[tokio::test]
async fn an_order_whose_reply_is_lost_is_not_sent_twice() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("fault-lost").await;
    let (_, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    let brokers = FaultyBrokers::new("a");
    brokers
        .faults
        .lose_open_reply
        .lock()
        .unwrap()
        .insert("f2".into());
    let node = start_node_with(
        &config(&db, "a", 10, FAST),
        RunOptions {
            brokers: Some(brokers.clone()),
            ..Default::default()
        },
    )
    .await;
    reconciled(&mut conn, 2).await;
    let p = t.open("m1", "EURUSD", Side::Buy, 0.5, None, None).await;
    t.copy_of("f2", magic, p, WAIT).await;
    // The reply was lost; the follower reconciles by marker before anything is retried.
    eventually("the lost reply", WAIT, async || {
        (!brokers.faults.lost_replies.lock().unwrap().is_empty()).then_some(())
    })
    .await;
    // The owed reconcile runs a quarter of a second later; watch two seconds for a second send.
    let until = tokio::time::Instant::now() + Duration::from_secs(2);
    while tokio::time::Instant::now() < until {
        let sent = journal(&dir.path("journal.jsonl"))
            .iter()
            .filter(|l| l.login == "f2" && l.action == "open")
            .count();
        assert_eq!(sent, 1, "the copy whose reply was lost was sent again");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let p2 = t.open("m1", "GBPUSD", Side::Buy, 0.1, None, None).await;
    t.copy_of("f2", magic, p2, WAIT).await; // the session kept working; by now it has reconciled
    let sent = journal(&dir.path("journal.jsonl"))
        .iter()
        .filter(|l| {
            l.login == "f2"
                && l.action == "open"
                && l.comment.as_deref() == Some(format!("mc{p}").as_str())
        })
        .count();
    assert_eq!(sent, 1, "the copy whose reply was lost was not sent again");
    assert_no_duplicates(&dir.path("journal.jsonl"));
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;
}

#[tokio::test]
async fn with_the_database_hung_past_the_trust_window_no_order_reaches_the_broker() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("fault-gated").await;
    let (_, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    let a = start_node(&config(&db, "a", 1, FAST)).await;
    wait_state(&a.state, "a owns the master", WAIT, |s| {
        s.owned.contains_key(&1)
    })
    .await;
    // b's lease and write connections go through a proxy; its LISTEN is direct, so master
    // events keep reaching it while its gate is closed.
    let proxy = ChaosProxy::start(db.server_addr()).await;
    let b = start_node(&config_listen(
        &db.url_via(proxy.port),
        &db.url,
        "b",
        10,
        FAST,
    ))
    .await;
    reconciled(&mut conn, 2).await;

    proxy.set(Mode::Hang);
    wait_state(&b.state, "b's gate to close", WAIT, |s| !s.trusted()).await;
    let gated_lines = journal(&dir.path("journal.jsonl")).len();
    let p = t.open("m1", "EURUSD", Side::Buy, 0.4, None, None).await;
    // The event reaches b within milliseconds; give it a full second to (not) act.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while tokio::time::Instant::now() < deadline {
        let sent = journal(&dir.path("journal.jsonl"))
            .into_iter()
            .skip(gated_lines)
            .filter(|l| l.login == "f2")
            .count();
        assert_eq!(sent, 0, "a gated node sent an order");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.set(Mode::Forward);
    // Trust returns (or the lease was re-claimed with a new epoch): the reconcile catches up.
    t.copy_of("f2", magic, p, WAIT).await;
    assert_no_duplicates(&dir.path("journal.jsonl"));
    for n in [a, b] {
        n.shutdown();
        n.wait().await.unwrap();
    }
    broker.stop().await;
}

#[tokio::test]
async fn disabling_and_removing_a_link_behave_as_documented() {
    let CopySetup {
        db,
        dir: _dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::unprotected("fault-links").await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    add_account(&mut conn, 2, "follower", &addr, "f2").await;
    add_account(&mut conn, 3, "follower", &addr, "f3").await;
    let (disabled, m2) = add_link(&mut conn, 1, 2, LinkSpec::default()).await;
    let (removed, m3) = add_link(&mut conn, 1, 3, LinkSpec::default()).await;
    let node = start_node(&config(&db, "a", 10, FAST)).await;
    reconciled(&mut conn, 2).await;
    reconciled(&mut conn, 3).await;
    let p1 = t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;
    t.copy_of("f2", m2, p1, WAIT).await;
    t.copy_of("f3", m3, p1, WAIT).await;

    // Each session hears of its own link changes: f2 has seen its link disabled once it has
    // reconciled for the change (the only reconcile this node runs meanwhile).
    let reconciles = async || {
        sample(
            &get(node.http_addr, "/metrics").await.1,
            "copier_reconciles_total",
        )
    };
    let before = reconciles().await;
    conn.execute(format!("UPDATE copy_links SET enabled = false WHERE id = {disabled}").as_str())
        .await
        .unwrap();
    conn.execute(format!("DELETE FROM copy_links WHERE id = {removed}").as_str())
        .await
        .unwrap();
    eventually("f3 to notice its link is gone", WAIT, async || {
        let s: Option<String> =
            sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = 3")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        (s.as_deref() == Some("follower: no copy links")).then_some(())
    })
    .await;
    eventually("f2 to reconcile with its disabled link", WAIT, async || {
        (reconciles().await > before).then_some(())
    })
    .await;
    // A disabled link opens nothing new (the reason is recorded) ...
    let p2 = t.open("m1", "GBPUSD", Side::Buy, 1.0, None, None).await;
    let reason: String = eventually("the close-only skip", WAIT, async || {
        sqlx::query_scalar(
            "SELECT reason FROM copy_skips WHERE link_id = $1 AND master_ticket = $2",
        )
        .bind(disabled)
        .bind(p2)
        .fetch_optional(&mut conn)
        .await
        .unwrap()
    })
    .await;
    assert!(reason.contains("close-only"), "{reason}");
    // ... but still follows its open copies' partial and full closes; a removed link's copy is
    // left alone.
    t.close("m1", p1, Some(0.5)).await;
    t.wait_copy("f2", m2, p1, WAIT, "trimmed", |c| {
        c.is_some_and(|c| (c.volume - 0.5).abs() < 1e-9)
    })
    .await;
    t.close("m1", p1, None).await;
    t.wait_copy("f2", m2, p1, WAIT, "closed", |c| c.is_none())
        .await;
    let f3 = t.positions("f3").await;
    assert_eq!(f3.len(), 1, "the removed link's copy stays open, unmanaged");
    assert_eq!(
        (f3[0].comment.as_str(), f3[0].volume),
        (format!("mc{p1}").as_str(), 1.0)
    );
    assert!(
        !t.positions("f2")
            .await
            .iter()
            .chain(f3.iter())
            .any(|p| p.comment == format!("mc{p2}"))
    );
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;
}

#[tokio::test]
async fn master_and_follower_takeovers_after_kill9_converge_without_duplicates() {
    let db = TestDb::new().await;
    let dir = Scratch::new("fault-takeover");
    let broker = BrokerProcess::spawn(&dir, &[]).await;
    let t = Trader {
        addr: broker.addr.clone(),
    };
    let mut conn = db.conn().await;
    add_account(&mut conn, 1, "master", &broker.addr, "m1").await;
    let mut magic = HashMap::new();
    for f in 2..=6 {
        add_account(&mut conn, f, "follower", &broker.addr, &format!("f{f}")).await;
        magic.insert(f, add_link(&mut conn, 1, f, LinkSpec::default()).await.1);
    }
    let mut a = NodeProcess::spawn(&db, "a", 1, FAST, &[]);
    wait_owned(&mut conn, "a", 1, WAIT).await;
    let mut b = NodeProcess::spawn(&db, "b", 100, FAST, &[]);
    wait_owned(&mut conn, "b", 5, WAIT).await;
    let mut c = NodeProcess::spawn(&db, "c", 100, FAST, &[]);
    c.wait_for_output("joined the cluster", WAIT).await;
    for f in 2..=6 {
        reconciled(&mut conn, f).await;
    }
    let p1 = t.open("m1", "EURUSD", Side::Buy, 0.2, None, None).await;
    for f in 2..=6 {
        t.copy_of(&format!("f{f}"), magic[&f], p1, WAIT).await;
    }

    // The master's node dies; the master keeps trading while its lease runs out.
    a.kill9();
    let p2 = t.open("m1", "GBPUSD", Side::Sell, 0.3, None, None).await;
    t.close("m1", p1, Some(0.1)).await;
    eventually("the master to be taken over", WAIT, async || {
        let owner: Option<String> = sqlx::query_scalar(
            "SELECT node_id FROM trading_accounts WHERE id = 1 AND lease_until > now()",
        )
        .fetch_optional(&mut conn)
        .await
        .unwrap()
        .flatten();
        owner.filter(|o| o != "a").map(|_| ())
    })
    .await;
    for f in 2..=6 {
        t.copy_of(&format!("f{f}"), magic[&f], p2, WAIT).await;
        t.wait_copy(&format!("f{f}"), magic[&f], p1, WAIT, "trimmed", |c| {
            c.is_some_and(|c| (c.volume - 0.1).abs() < 1e-9)
        })
        .await;
    }

    // The followers' node dies; the master closes meanwhile.
    b.kill9();
    t.close("m1", p2, None).await;
    let p3 = t.open("m1", "EURUSD", Side::Sell, 0.1, None, None).await;
    wait_owned(&mut conn, "c", 6, Duration::from_secs(30)).await;
    for f in 2..=6 {
        let login = format!("f{f}");
        t.wait_copy(&login, magic[&f], p2, WAIT, "closed", |c| c.is_none())
            .await;
        t.copy_of(&login, magic[&f], p3, WAIT).await;
    }
    assert_no_duplicates(&dir.path("journal.jsonl"));
    c.signal("TERM");
    assert!(c.wait_exit(WAIT).await.success(), "{}", c.output());
}

#[tokio::test]
async fn a_stale_owners_late_order_is_rejected_by_the_brokers_fence() {
    use copier_node::broker::client::BridgeClient;
    use copier_node::broker::types::OpenOrder;
    use copier_node::broker::{AccountLogin, Broker, BrokerError};

    let db = TestDb::new().await;
    let dir = Scratch::new("fault-fence");
    let broker = start_sim(&dir).await;
    let addr = broker.addr.to_string();
    let mut conn = db.conn().await;
    add_account(&mut conn, 2, "follower", &addr, "f2").await;
    // The old owner's session, logged in with its epoch, then frozen.
    let old = start_node(&config(&db, "old", 10, FAST)).await;
    let old_epoch = wait_state(&old.state, "old owns f2", WAIT, |s| {
        s.owned.contains_key(&2)
    })
    .await
    .owned[&2];
    let stale_client = BridgeClient::connect(addr.clone(), "old");
    let stale = stale_client
        .login(&AccountLogin {
            login: "f2".into(),
            password: None,
            fence: Some(old_epoch),
            account_id: None,
        })
        .await
        .unwrap();
    old.shutdown();
    old.wait().await.unwrap();
    // A new owner claims and logs in with its (higher) epoch.
    let new = start_node(&config(&db, "new", 10, FAST)).await;
    let new_epoch = wait_state(&new.state, "new owns f2", WAIT, |s| {
        s.owned.contains_key(&2)
    })
    .await
    .owned[&2];
    assert!(new_epoch > old_epoch);
    eventually("the new owner's login", WAIT, async || {
        journal(&dir.path("journal.jsonl"))
            .iter()
            .any(|l| l.action == "login" && l.fence == Some(new_epoch))
            .then_some(())
    })
    .await;
    // The frozen process wakes and sends: the trade server itself refuses it.
    let order = OpenOrder {
        symbol: "EURUSD".into(),
        side: Side::Buy,
        volume: 0.1,
        sl: None,
        tp: None,
        magic: 1,
        comment: "mc1".into(),
        client_order_id: None,
        price_limit: None,
    };
    let err = stale.api.open(order).await.unwrap_err();
    assert!(
        matches!(&err, BrokerError::Rejected(r) if r.reason.contains("stale fence")),
        "{err:?}"
    );
    new.shutdown();
    new.wait().await.unwrap();
    broker.stop().await;
}

#[tokio::test]
async fn a_node_cut_from_the_database_recovers_and_copies_what_it_missed() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("fault-cut").await;
    let (_, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    let a = start_node(&config(&db, "a", 1, FAST)).await;
    wait_state(&a.state, "a owns the master", WAIT, |s| {
        s.owned.contains_key(&1)
    })
    .await;
    let proxy = ChaosProxy::start(db.server_addr()).await;
    let b = start_node(&config_url(&db.url_via(proxy.port), "b", 10, FAST)).await;
    reconciled(&mut conn, 2).await;
    proxy.set(Mode::Hang);
    let p = t.open("m1", "EURUSD", Side::Buy, 0.2, None, None).await;
    wait_state(&b.state, "b gated", WAIT, |s| !s.trusted()).await;
    proxy.set(Mode::Forward);
    proxy.cut();
    t.copy_of("f2", magic, p, WAIT).await;
    assert_no_duplicates(&dir.path("journal.jsonl"));
    for n in [a, b] {
        n.shutdown();
        n.wait().await.unwrap();
    }
    broker.stop().await;
}

/// Pending orders with a broken bridge: the reply to a pending copy is lost (the copy is found by
/// its marker and never placed twice), and a follower whose bridge refuses the `orders` request
/// (one older than pending orders) places none and copies the fill at market. The broker without
/// fence check or deduplication.
#[tokio::test]
async fn a_lost_place_reply_places_once_and_a_bridge_without_orders_copies_the_fill() {
    use copier_node::broker::types::PendingKind;
    use copier_node::sim_broker::tools::{self, HandOrder};
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::unprotected("fault-pending").await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    add_account(&mut conn, 2, "follower", &addr, "f2").await;
    add_account(&mut conn, 3, "follower", &addr, "f3").await;
    let (_, magic2) = add_link(&mut conn, 1, 2, LinkSpec::default()).await;
    let (_, magic3) = add_link(&mut conn, 1, 3, LinkSpec::default()).await;
    let brokers = FaultyBrokers::new("a");
    brokers
        .faults
        .lose_place_reply
        .lock()
        .unwrap()
        .insert("f2".into());
    brokers.faults.no_orders.lock().unwrap().insert("f3".into());
    let node = start_node_with(
        &config(&db, "a", 10, FAST),
        RunOptions {
            brokers: Some(brokers.clone()),
            ..Default::default()
        },
    )
    .await;
    reconciled(&mut conn, 2).await;
    reconciled(&mut conn, 3).await;
    let ticket = tools::trade(
        &addr,
        "m1",
        HandOrder::Place(crate::support::pending_order(
            "EURUSD",
            Side::Buy,
            PendingKind::Limit,
            1.095,
            0.3,
        )),
    )
    .await
    .unwrap()
    .expect("a placed order's ticket");
    let marker = format!("mc{ticket}");
    eventually("the lost place reply", WAIT, async || {
        (!brokers.faults.lost_replies.lock().unwrap().is_empty()).then_some(())
    })
    .await;
    // The reconcile the lost reply owes finds the pending copy by its marker and records it.
    eventually("the pending copy recorded", WAIT, async || {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM order_copies WHERE follower_id = 2 AND master_ticket = $1",
        )
        .bind(ticket)
        .fetch_one(&mut conn)
        .await
        .unwrap();
        (n == 1).then_some(())
    })
    .await;
    let places = |login: &str| {
        journal(&dir.path("journal.jsonl"))
            .iter()
            .filter(|l| {
                l.login == login
                    && l.action == "place"
                    && l.client != "manual"
                    && l.comment.as_deref() == Some(marker.as_str())
            })
            .count()
    };
    assert_eq!(
        places("f2"),
        1,
        "placed once, its lost reply resolved by a read"
    );
    assert_eq!(
        places("f3"),
        0,
        "a bridge without orders gets no pending copy"
    );
    // Both fill at the price: f2's pending copy becomes its copy; f3 gets a copy at market.
    tools::set_price(&addr, "EURUSD", 1.094).await.unwrap();
    t.copy_of("f2", magic2, ticket, WAIT).await;
    t.copy_of("f3", magic3, ticket, WAIT).await;
    let lines = journal(&dir.path("journal.jsonl"));
    let count = |login: &str, action: &str| {
        lines
            .iter()
            .filter(|l| {
                l.login == login
                    && l.action == action
                    && l.accepted
                    && l.client != "manual"
                    && l.comment.as_deref() == Some(marker.as_str())
            })
            .count()
    };
    assert_eq!((count("f2", "place"), count("f2", "open")), (1, 0));
    assert_eq!((count("f3", "place"), count("f3", "open")), (0, 1));
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;
}
