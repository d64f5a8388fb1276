//! The copy engine end to end: real PostgreSQL, the simulated broker, nodes in-process.

use std::collections::HashMap;
use std::time::Duration;

use copier_node::broker::types::Side;
use copier_node::sim_broker::journal::JournalEntry;
use sqlx::{Connection, Executor};

use crate::support::broker::{Scratch, journal};
use crate::support::fixture::{CopySetup, master_and_follower};
use crate::support::http::{get, sample};
use crate::support::{
    FAST, LinkSpec, TestDb, Trader, add_account, add_link, config, eventually, start_node,
    wait_state,
};

const WAIT: Duration = Duration::from_secs(15);

/// A hub of node `node_id` (mt5) on the database at `url`, waking `wake`, as a node starts one.
fn hub_at(
    url: &str,
    node_id: &str,
    wake: std::sync::Arc<copier_node::hub::Wake>,
) -> copier_node::hub::Hub {
    copier_node::hub::Hub::spawn(
        url.parse().unwrap(),
        "mt5".into(),
        node_id.into(),
        wake,
        tokio_util::sync::CancellationToken::new(),
    )
}

/// Waits until master `master`'s published snapshot holds position `ticket`.
async fn published(conn: &mut sqlx::PgConnection, master: i64, ticket: i64) {
    eventually(
        format!("master {master}'s published position {ticket}"),
        WAIT,
        async || {
            let positions: Option<String> =
                sqlx::query_scalar("SELECT positions::text FROM master_state WHERE master_id = $1")
                    .bind(master)
                    .fetch_optional(&mut *conn)
                    .await
                    .unwrap();
            positions
                .filter(|p| p.contains(&ticket.to_string()))
                .map(|_| ())
        },
    )
    .await;
}

/// Waits until account `id`'s status is one `wanted` accepts.
async fn status_becomes(
    conn: &mut sqlx::PgConnection,
    id: i64,
    what: &str,
    wanted: impl Fn(&str) -> bool,
) {
    eventually(what, WAIT, async || {
        let status: Option<String> =
            sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = $1")
                .bind(id)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
        status.filter(|s| wanted(s)).map(|_| ())
    })
    .await;
}

/// A node process whose account sessions each hold before their login (each has read its row),
/// once `sessions` of them do; let go by removing the returned file.
async fn held_at_login(
    db: &TestDb,
    dir: &Scratch,
    sessions: usize,
) -> (crate::support::process::NodeProcess, std::path::PathBuf) {
    let hold = dir.path("hold");
    std::fs::write(&hold, b"hold").unwrap();
    let node =
        crate::support::process::NodeProcess::spawn_with(&crate::support::process::NodeSpec {
            node_id: "a".into(),
            capacity: 10,
            timing: FAST,
            database_url: db.url.clone(),
            listen_url: None,
            env: vec![("COPIERTEST_HOLD_START".into(), hold.display().to_string())],
            extra: Vec::new(),
        });
    eventually(
        format!("{sessions} sessions held at their login"),
        WAIT,
        async || {
            (node
                .output()
                .matches("account session held before its login")
                .count()
                == sessions)
                .then_some(())
        },
    )
    .await;
    (node, hold)
}

/// Waits until every follower's session has reconciled with its master once.
async fn followers_ready(conn: &mut sqlx::PgConnection, ids: &[i64]) {
    eventually("follower sessions to reconcile", WAIT, async || {
        let ready: i64 = sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE id = ANY($1) AND status LIKE 'follower: master%'")
            .bind(ids)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        (ready == ids.len() as i64).then_some(())
    })
    .await;
}

fn close(a: Option<f64>, b: f64) -> bool {
    a.is_some_and(|a| (a - b).abs() < 1e-9)
}

#[tokio::test]
async fn master_trades_reach_followers_on_another_node_under_every_rule() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("copy-rules").await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    for id in 2..=7 {
        add_account(&mut conn, id, "follower", &addr, &format!("f{id}")).await;
    }
    let specs = [
        (
            2,
            LinkSpec {
                lot_value: 2.0,
                ..Default::default()
            },
        ),
        (
            3,
            LinkSpec {
                lot_mode: "fixed",
                lot_value: 0.05,
                ..Default::default()
            },
        ),
        (
            4,
            LinkSpec {
                lot_mode: "balance_ratio",
                lot_value: 1.0,
                ..Default::default()
            },
        ),
        (
            5,
            LinkSpec {
                lot_mode: "equity_ratio",
                lot_value: 0.5,
                ..Default::default()
            },
        ),
        (
            6,
            LinkSpec {
                reverse: true,
                ..Default::default()
            },
        ),
        (
            7,
            LinkSpec {
                symbol_map: r#"{"EURUSD": "EURUSD.m"}"#,
                copy_sl_tp: false,
                ..Default::default()
            },
        ),
    ];
    let mut magic = HashMap::new();
    for (f, spec) in specs {
        magic.insert(f, add_link(&mut conn, 1, f, spec).await.1);
    }
    // The master on node a, the followers on node b.
    let a = start_node(&config(&db, "a", 1, FAST)).await;
    wait_state(&a.state, "a owns the master", WAIT, |s| {
        s.owned.contains_key(&1)
    })
    .await;
    let b = start_node(&config(&db, "b", 100, FAST)).await;
    wait_state(&b.state, "b owns the followers", WAIT, |s| {
        s.owned.len() == 6
    })
    .await;
    followers_ready(&mut conn, &[2, 3, 4, 5, 6, 7]).await;

    let ticket = t
        .open("m1", "EURUSD", Side::Buy, 1.0, Some(1.09), Some(1.12))
        .await;
    let expect = [
        (2, "EURUSD", Side::Buy, 2.0),
        (3, "EURUSD", Side::Buy, 0.05),
        (4, "EURUSD", Side::Buy, 1.0),
        (5, "EURUSD", Side::Buy, 0.5),
        (6, "EURUSD", Side::Sell, 1.0),
        (7, "EURUSD.m", Side::Buy, 1.0),
    ];
    for (f, symbol, side, volume) in expect {
        let c = t.copy_of(&format!("f{f}"), magic[&f], ticket, WAIT).await;
        assert_eq!(
            (c.symbol.as_str(), c.side, c.volume),
            (symbol, side, volume),
            "follower {f}"
        );
        match f {
            6 => assert_eq!(
                (c.sl, c.tp),
                (Some(1.12), Some(1.09)),
                "reverse swaps the stops"
            ),
            7 => assert_eq!((c.sl, c.tp), (None, None), "copy_sl_tp off"),
            _ => assert_eq!((c.sl, c.tp), (Some(1.09), Some(1.12))),
        }
    }

    t.modify("m1", ticket, Some(1.08), Some(1.13)).await;
    for f in 2..=7 {
        let (sl, tp) = match f {
            6 => (1.13, 1.08),
            7 => continue,
            _ => (1.08, 1.13),
        };
        t.wait_copy(
            &format!("f{f}"),
            magic[&f],
            ticket,
            WAIT,
            "stops modified",
            |c| c.is_some_and(|c| close(c.sl, sl) && close(c.tp, tp)),
        )
        .await;
    }

    t.close("m1", ticket, Some(0.4)).await;
    for (f, volume) in [(2, 1.2), (3, 0.03), (4, 0.6), (5, 0.3), (6, 0.6), (7, 0.6)] {
        t.wait_copy(
            &format!("f{f}"),
            magic[&f],
            ticket,
            WAIT,
            "trimmed in proportion",
            |c| c.is_some_and(|c| (c.volume - volume).abs() < 1e-9),
        )
        .await;
    }
    t.close("m1", ticket, None).await;
    for f in 2..=7 {
        t.wait_copy(&format!("f{f}"), magic[&f], ticket, WAIT, "closed", |c| {
            c.is_none()
        })
        .await;
    }

    // Every follower order carried the link's magic, the marker, a client order id and the
    // follower's epoch as its fence, and came from node b.
    let epochs: HashMap<String, i64> = sqlx::query_as::<_, (String, i64)>(
        "SELECT login, owner_epoch FROM trading_accounts WHERE role = 'follower'",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let lines = journal(&dir.path("journal.jsonl"));
    let opens: Vec<_> = lines
        .iter()
        .filter(|l| l.action == "open" && l.client == "b")
        .collect();
    assert_eq!(opens.len(), 6);
    for l in &opens {
        let login = l.login.as_str();
        let f: i64 = login[1..].parse().unwrap();
        assert!(l.accepted);
        assert_eq!(l.magic, Some(magic[&f]));
        assert_eq!(l.comment.as_deref(), Some(format!("mc{ticket}").as_str()));
        assert_eq!(l.fence, Some(epochs[login]));
        assert!(
            l.client_order_id
                .as_deref()
                .unwrap()
                .ends_with(&format!("-m{ticket}-open"))
        );
    }
    a.shutdown();
    b.shutdown();
    a.wait().await.unwrap();
    b.wait().await.unwrap();
    broker.stop().await;
}

#[tokio::test]
async fn a_copy_closed_by_hand_is_not_reopened_and_a_second_reconcile_sends_nothing() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("copy-hand").await;
    let (_, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    let node = start_node(&config(&db, "a", 10, FAST)).await;
    followers_ready(&mut conn, &[2]).await;
    let t1 = t.open("m1", "GBPUSD", Side::Sell, 0.3, None, None).await;
    let t2 = t.open("m1", "EURUSD", Side::Buy, 0.2, None, None).await;
    let c1 = t.copy_of("f2", magic, t1, WAIT).await;
    t.copy_of("f2", magic, t2, WAIT).await;
    t.close("f2", c1.ticket, None).await; // the follower's owner closes a copy by hand
    node.shutdown();
    node.wait().await.unwrap();

    let follower_orders = || {
        journal(&dir.path("journal.jsonl"))
            .into_iter()
            .filter(|l| l.login == "f2" && l.action != "login" && l.client != "manual")
            .count()
    };
    let before = follower_orders();
    assert_eq!(before, 2, "two copies opened");
    // Each restart starts new sessions that reconcile first: nothing to send, twice.
    for round in 0..2 {
        let node = start_node(&config(&db, &format!("r{round}"), 10, FAST)).await;
        eventually("the restarted follower to reconcile", WAIT, async || {
            let s: Option<String> = sqlx::query_scalar(
                "SELECT status FROM trading_accounts WHERE id = 2 AND node_id = $1",
            )
            .bind(format!("r{round}"))
            .fetch_optional(&mut conn)
            .await
            .unwrap()
            .flatten();
            s.filter(|s| s.starts_with("follower: master")).map(|_| ())
        })
        .await;
        node.shutdown();
        node.wait().await.unwrap();
        assert_eq!(follower_orders(), before, "reconcile {round} sent orders");
    }
    let open = t.positions("f2").await;
    assert_eq!(open.len(), 1, "the hand-closed copy stays closed: {open:?}");
    assert_eq!(open[0].comment, format!("mc{t2}"));
    broker.stop().await;
}

#[tokio::test]
async fn a_new_link_copies_only_later_positions_unless_copy_existing() {
    let CopySetup {
        db,
        dir: _dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("copy-existing").await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    add_account(&mut conn, 2, "follower", &addr, "f2").await;
    add_account(&mut conn, 3, "follower", &addr, "f3").await;
    let node = start_node(&config(&db, "a", 10, FAST)).await;
    wait_state(&node.state, "a owns all", WAIT, |s| s.owned.len() == 3).await;
    let p1 = t.open("m1", "EURUSD", Side::Buy, 0.1, None, None).await;
    eventually("the master to publish p1", WAIT, async || {
        let text: Option<String> =
            sqlx::query_scalar("SELECT positions::text FROM master_state WHERE master_id = 1")
                .fetch_optional(&mut conn)
                .await
                .unwrap();
        text.filter(|t| t.contains(&p1.to_string())).map(|_| ())
    })
    .await;
    // The database's clock moves on past p1's first sighting before the links are created.
    conn.execute("SELECT pg_sleep(0.01)").await.unwrap();
    let (later_only, m2) = add_link(&mut conn, 1, 2, LinkSpec::default()).await;
    let (_, m3) = add_link(
        &mut conn,
        1,
        3,
        LinkSpec {
            copy_existing: true,
            ..Default::default()
        },
    )
    .await;
    t.copy_of("f3", m3, p1, WAIT).await;
    let reason: String = eventually("the skip to be recorded", WAIT, async || {
        sqlx::query_scalar(
            "SELECT reason FROM copy_skips WHERE link_id = $1 AND master_ticket = $2",
        )
        .bind(later_only)
        .bind(p1)
        .fetch_optional(&mut conn)
        .await
        .unwrap()
    })
    .await;
    assert!(reason.contains("before the link took effect"), "{reason}");
    let p2 = t.open("m1", "EURUSD", Side::Sell, 0.1, None, None).await;
    t.copy_of("f2", m2, p2, WAIT).await;
    t.copy_of("f3", m3, p2, WAIT).await;
    assert!(
        !t.positions("f2")
            .await
            .iter()
            .any(|p| p.comment == format!("mc{p1}")),
        "p1 is never copied to f2"
    );
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;
}

/// Milliseconds from the master's accepted order to each follower's accepted copy, from the
/// journal (one clock: the broker's).
fn latencies(lines: &[JournalEntry], master_login: &str, action: &str, ticket: i64) -> Vec<i64> {
    let master_ts = lines
        .iter()
        .find(|l| {
            l.login == master_login && l.action == action && l.accepted && l.ticket == Some(ticket)
        })
        .map(|l| l.ts_ms)
        .expect("the master's order is journaled");
    let marker = format!("mc{ticket}");
    let mut out: Vec<i64> = lines
        .iter()
        .filter(|l| {
            l.login != master_login
                && l.action == action
                && l.accepted
                && l.comment.as_deref() == Some(marker.as_str())
        })
        .map(|l| l.ts_ms)
        .map(|ts| ts - master_ts)
        .collect();
    out.sort_unstable();
    out
}

#[tokio::test]
async fn one_master_and_twenty_followers_on_two_node_processes() {
    use crate::support::broker::BrokerProcess;
    use crate::support::process::NodeProcess;
    use crate::support::{counts, wait_owned};

    let db = TestDb::new().await;
    let dir = Scratch::new("copy-20");
    let broker = BrokerProcess::spawn(&dir, &[]).await;
    let t = Trader {
        addr: broker.addr.clone(),
    };
    let mut conn = db.conn().await;
    add_account(&mut conn, 1, "master", &broker.addr, "m1").await;
    let mut magic = HashMap::new();
    for f in 2..=21 {
        add_account(&mut conn, f, "follower", &broker.addr, &format!("f{f}")).await;
        let spec = LinkSpec {
            lot_value: if f % 2 == 0 { 1.0 } else { 0.5 },
            reverse: f % 5 == 0,
            ..Default::default()
        };
        magic.insert(f, add_link(&mut conn, 1, f, spec).await.1);
    }
    let mut a = NodeProcess::spawn(&db, "a", 1, FAST, &[]);
    wait_owned(&mut conn, "a", 1, WAIT).await;
    let mut b = NodeProcess::spawn(&db, "b", 100, FAST, &[]);
    wait_owned(&mut conn, "b", 20, WAIT).await;
    assert_eq!(
        counts(&mut conn).await.get("a"),
        Some(&1),
        "the master stays on node a"
    );
    let ids: Vec<i64> = (2..=21).collect();
    followers_ready(&mut conn, &ids).await;

    let p1 = t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;
    let p2 = t.open("m1", "XAUUSD", Side::Sell, 0.4, None, None).await;
    for f in 2..=21 {
        let want_volume = if f % 2 == 0 { 1.0 } else { 0.5 };
        let c = t.copy_of(&format!("f{f}"), magic[&f], p1, WAIT).await;
        let want_side = if f % 5 == 0 { Side::Sell } else { Side::Buy };
        assert_eq!((c.side, c.volume), (want_side, want_volume), "follower {f}");
        t.copy_of(&format!("f{f}"), magic[&f], p2, WAIT).await;
    }
    t.close("m1", p1, Some(0.5)).await;
    t.close("m1", p2, None).await;
    for f in 2..=21 {
        let want = if f % 2 == 0 { 0.5 } else { 0.25 };
        let login = format!("f{f}");
        t.wait_copy(&login, magic[&f], p1, WAIT, "trimmed", |c| {
            c.is_some_and(|c| (c.volume - want).abs() < 1e-9)
        })
        .await;
        t.wait_copy(&login, magic[&f], p2, WAIT, "closed", |c| c.is_none())
            .await;
    }

    let lines = journal(&dir.path("journal.jsonl"));
    let mut accepted_opens: HashMap<(String, String), usize> = HashMap::new();
    for l in lines
        .iter()
        .filter(|l| l.action == "open" && l.accepted && l.client != "manual")
    {
        *accepted_opens
            .entry((l.login.clone(), l.comment.clone().unwrap()))
            .or_default() += 1;
    }
    assert_eq!(accepted_opens.len(), 40);
    assert!(
        accepted_opens.values().all(|n| *n == 1),
        "no duplicate copies: {accepted_opens:?}"
    );
    for (what, action, ticket) in [("open", "open", p1), ("close", "close", p2)] {
        let lat = latencies(&lines, "m1", action, ticket);
        assert_eq!(lat.len(), 20, "{what}: every follower");
        eprintln!(
            "copy latency of a master {what} to 20 followers over two node processes (broker clock): min {} ms, median {} ms, max {} ms",
            lat[0],
            lat[lat.len() / 2],
            lat[lat.len() - 1]
        );
        assert!(lat[lat.len() - 1] < 2000, "{what} latencies {lat:?}");
    }
    for n in [&mut a, &mut b] {
        n.signal("TERM");
        assert!(n.wait_exit(WAIT).await.success(), "{}", n.output());
    }
}

/// The reason recorded for not copying `master_ticket` under `link`, once there is one.
async fn skip_reason(conn: &mut sqlx::PgConnection, link: i64, master_ticket: i64) -> String {
    eventually(
        format!("a recorded reason for link {link} not copying {master_ticket}"),
        WAIT,
        async || {
            sqlx::query_scalar::<_, String>(
                "SELECT reason FROM copy_skips WHERE link_id = $1 AND master_ticket = $2",
            )
            .bind(link)
            .bind(master_ticket)
            .fetch_optional(&mut *conn)
            .await
            .unwrap()
        },
    )
    .await
}

#[tokio::test]
async fn protections_stop_or_shrink_new_copies_and_record_why() {
    let CopySetup {
        db,
        dir: _dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::new("copy-protections").await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    for id in 2..=11 {
        add_account(&mut conn, id, "follower", &addr, &format!("f{id}")).await;
    }
    // (follower, link settings, protection as SQL)
    let settings: [(i64, LinkSpec, &str); 8] = [
        (2, LinkSpec::default(), "symbols = '{GBPUSD}'"),
        (3, LinkSpec::default(), "sides = 'sell'"),
        (4, LinkSpec::default(), "close_only = true"),
        (5, LinkSpec::default(), "max_lot = 0.2"),
        (
            6,
            LinkSpec {
                symbol_map: r#"{"EURUSD": "GBPUSD"}"#,
                ..Default::default()
            },
            "max_slippage = 0.0001",
        ),
        (7, LinkSpec::default(), "equity_stop = 20000"),
        (8, LinkSpec::default(), "magics = '{7}'"),
        (
            9,
            LinkSpec {
                lot_mode: "risk_percent",
                lot_value: 1.0,
                ..Default::default()
            },
            "sides = 'both'",
        ),
    ];
    let mut links = HashMap::new();
    for (f, spec, protection) in settings {
        let (id, magic) = add_link(&mut conn, 1, f, spec).await;
        conn.execute(format!("UPDATE copy_links SET {protection} WHERE id = {id}").as_str())
            .await
            .unwrap();
        links.insert(f, (id, magic));
    }
    let node = start_node(&config(&db, "a", 100, FAST)).await;
    wait_state(&node.state, "a owns every account", WAIT, |s| {
        s.owned.len() == 11
    })
    .await;
    followers_ready(&mut conn, &[2, 3, 4, 5, 6, 7, 8, 9]).await;

    // 1 % of the follower's 10 000 over a stop 0.01 away, at 100 000 per lot: 0.1 lots.
    let ticket = t
        .open("m1", "EURUSD", Side::Buy, 0.5, Some(1.09), None)
        .await;
    let (_, magic5) = links[&5];
    let capped = t.copy_of("f5", magic5, ticket, WAIT).await;
    assert!(close(Some(capped.volume), 0.2), "max_lot: {capped:?}");
    let (_, magic9) = links[&9];
    let sized = t.copy_of("f9", magic9, ticket, WAIT).await;
    assert!(close(Some(sized.volume), 0.1), "risk_percent: {sized:?}");
    for (f, why) in [
        (2, "master symbol EURUSD is not in the link's symbols"),
        (3, "the link copies only the master's sells"),
        (4, "close-only"),
        (6, "beyond the order's price limit"),
        (
            7,
            "equity stop: the follower's equity 10000.00 is at or below the link's equity_stop 20000.00",
        ),
        (8, "master magic 0 is not in the link's magics"),
    ] {
        let reason = skip_reason(&mut conn, links[&f].0, ticket).await;
        assert!(reason.contains(why), "follower {f}: {reason}");
        assert!(
            t.positions(&format!("f{f}")).await.is_empty(),
            "follower {f} got a copy"
        );
    }

    // A master position with magic 7 passes follower 8's filter.
    let with_magic = copier_node::sim_broker::tools::trade(
        &addr,
        "m1",
        copier_node::sim_broker::tools::HandOrder::Open {
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume: 0.1,
            sl: None,
            tp: None,
            magic: 7,
            comment: String::new(),
        },
    )
    .await
    .unwrap()
    .unwrap();
    let (_, magic8) = links[&8];
    t.copy_of("f8", magic8, with_magic, WAIT).await;

    // Late copies: links created once the first position is more than a second old, both
    // copying existing positions; the one with max_delay_ms 1000 does not copy it, the one
    // without a limit does (within the reconcile a new link triggers).
    eventually("the position to be over a second old", WAIT, async || {
        let age: i64 = sqlx::query_scalar(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint - min((p->>'first_seen_ms')::bigint)
               FROM master_state, jsonb_array_elements(positions) p WHERE master_id = 1",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        (age > 1_100).then_some(())
    })
    .await;
    let existing = LinkSpec {
        copy_existing: true,
        ..Default::default()
    };
    // Created with its protection in one transaction: link changes are announced at commit, and
    // a session would copy at once under a link committed without it.
    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    let (late, _) = add_link(&mut tx, 1, 10, existing.clone()).await;
    tx.execute(format!("UPDATE copy_links SET max_delay_ms = 1000 WHERE id = {late}").as_str())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let (_, magic11) = add_link(&mut conn, 1, 11, existing).await;
    t.copy_of("f11", magic11, ticket, Duration::from_secs(30))
        .await;
    let reason = skip_reason(&mut conn, late, ticket).await;
    assert!(
        reason.contains("too late") && reason.contains("over the link's max_delay_ms 1000"),
        "{reason}"
    );
    // No copy of the old position under the late link (a younger position, such as the one
    // with magic 7 opened since, may be copied: it is within the limit).
    let marker = format!("mc{ticket}");
    assert!(
        !t.positions("f10").await.iter().any(|p| p.comment == marker),
        "the late link copied a position older than its max_delay_ms"
    );

    let (_, metrics) = get(node.http_addr, "/metrics").await;
    assert!(
        sample(&metrics, "copier_copies_skipped_total") >= 7.0,
        "{metrics}"
    );

    // Protections only ever hold back new copies: closes follow the master as always.
    t.close("m1", ticket, None).await;
    t.close("m1", with_magic, None).await;
    for f in [5, 8, 9, 11] {
        eventually(format!("f{f} flat"), WAIT, async || {
            t.positions(&format!("f{f}")).await.is_empty().then_some(())
        })
        .await;
    }
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;
}

/// A release names the hand-off's receiver: the hub wakes that node's lease loop, but not a
/// node with room nor one at its share; a release naming nobody wakes a node with room (about as
/// many of them as accounts released: each with odds that fall with the peers below their
/// shares), and a departure every peer; a node's own release wakes no one. Notices reach the hub
/// in commit order, so a hand-off offer sent after each release, once heard, shows the release
/// was dispatched.
#[tokio::test]
async fn a_release_wakes_its_named_receiver_or_a_few_peers_with_room_but_not_one_at_its_share() {
    use copier_node::channels::{HANDOFF, Handoff, RELEASED, Release, Room, released_payload};
    use copier_node::hub::{Signal, Topic, Wake};
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let wake = std::sync::Arc::new(Wake::default());
    let hub = hub_at(&db.url, "c", wake.clone());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let _offers = hub.subscribe(Topic::HandoffOffers, tx).await.unwrap();
    // The wake every (re)connection gives.
    tokio::time::timeout(WAIT, wake.notified())
        .await
        .expect("the wake after connecting");
    let mut marker = 0;
    let mut woken = async |release: Release, room: Room| -> bool {
        wake.set_room(room);
        marker += 1;
        let offer = Handoff {
            ready: false,
            account_id: marker,
            from: "a".into(),
            to: "c".into(),
            claims: None,
            leaving: false,
        };
        sqlx::query("SELECT pg_notify($1, $2), pg_notify($3, $4)")
            .bind(RELEASED)
            .bind(released_payload("mt5", &release))
            .bind(HANDOFF)
            .bind(offer.payload())
            .execute(&mut conn)
            .await
            .unwrap();
        loop {
            let signal = tokio::time::timeout(WAIT, rx.recv())
                .await
                .expect("the marker offer")
                .unwrap();
            if signal == Signal::Handoff(offer.clone()) {
                break;
            }
        }
        tokio::select! {
            biased;
            _ = wake.notified() => true,
            _ = std::future::ready(()) => false,
        }
    };
    let release = |to: Option<&str>, accounts: u32| Release {
        from: "a".into(),
        to: to.map(str::to_string),
        leaving: false,
        announced: false,
        accounts,
    };
    let at_share = Room::default();
    // Room, and as many peers below their shares as there are: the odds are one in billions.
    let among_many = Room {
        lacks: 2,
        peers_below: u32::MAX,
        takes_over: true,
    };
    let alone = Room {
        lacks: 2,
        peers_below: 0,
        takes_over: true,
    };
    assert!(
        !woken(release(Some("b"), 1), at_share).await,
        "a peer at its share woke for b's release"
    );
    assert!(
        woken(release(Some("c"), 1), at_share).await,
        "the named receiver did not wake"
    );
    assert!(
        !woken(release(Some("b"), 1), alone).await,
        "a peer with room woke for b's release"
    );
    assert!(
        !woken(release(None, 1), at_share).await,
        "a release naming nobody woke a peer at its share"
    );
    assert!(
        woken(release(None, 1), alone).await,
        "a release naming nobody did not wake the one peer with room"
    );
    assert!(
        !woken(release(None, 1), among_many).await,
        "a release of one account woke a peer among countless ones with room"
    );
    assert!(
        woken(release(None, u32::MAX), among_many).await,
        "a release of countless accounts did not wake a peer with room"
    );
    let departure = Release {
        from: "a".into(),
        to: None,
        leaving: true,
        announced: false,
        accounts: 0,
    };
    assert!(
        woken(departure, at_share).await,
        "a departure did not wake a peer at its share"
    );
    let own = Release {
        from: "c".into(),
        to: None,
        leaving: true,
        announced: false,
        accounts: 0,
    };
    assert!(!woken(own, alone).await, "its own release woke the node");
}

/// Hand-off notices reach only who waits for them: an answer to this node's offer of an account
/// reaches that offer's waiter alone (a shutdown waits for thousands at once, and every answer
/// sent to every waiter made the node's hub the bottleneck of its own hand-off), an offer to
/// this node reaches the receiving side alone, and notices between other nodes reach no one.
/// Notices reach the hub in commit order, so a last offer, once heard, shows every earlier one
/// was dispatched.
#[tokio::test]
async fn hand_off_answers_reach_only_the_offer_of_their_account() {
    use copier_node::channels::{HANDOFF, Handoff};
    use copier_node::hub::{Signal, Topic};
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let hub = hub_at(&db.url, "c", Default::default());
    let subscribe = async |topic: Topic| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (hub.subscribe(topic, tx).await.unwrap(), rx)
    };
    let (_o, mut offers) = subscribe(Topic::HandoffOffers).await;
    let mut answers = Vec::new();
    for account in 1..=3 {
        answers.push(subscribe(Topic::HandoffAnswer(account)).await);
    }
    let notice = |ready: bool, account_id: i64, from: &str, to: &str| Handoff {
        ready,
        account_id,
        from: from.into(),
        to: to.into(),
        claims: Some(true),
        leaving: false,
    };
    let sent = [
        notice(true, 2, "c", "b"),  // b's answer to c's offer of 2
        notice(true, 1, "a", "c"),  // c's answer to a's offer of 1: not for c's waiters
        notice(false, 3, "c", "b"), // c's own offer of 3
        notice(false, 1, "a", "b"), // an offer to another node
        notice(true, 3, "c", "b"),  // b's answer to c's offer of 3
        notice(false, 9, "a", "c"), // an offer to c: the last, heard by the receiving side
    ];
    for n in &sent {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(HANDOFF)
            .bind(n.payload())
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let heard = tokio::time::timeout(WAIT, offers.recv())
        .await
        .expect("the offer to this node")
        .unwrap();
    assert_eq!(heard, Signal::Handoff(sent[5].clone()));
    assert!(offers.try_recv().is_err(), "the receiving side heard more");
    let mut got: Vec<Vec<Signal>> = Vec::new();
    for (_, rx) in answers.iter_mut() {
        let mut mine = Vec::new();
        while let Ok(s) = rx.try_recv() {
            mine.push(s);
        }
        got.push(mine);
    }
    assert_eq!(
        got,
        [
            vec![],
            vec![Signal::Handoff(sent[0].clone())],
            vec![Signal::Handoff(sent[4].clone())]
        ],
        "each offer's waiter hears its own answer alone"
    );
}

#[tokio::test]
async fn link_and_account_row_changes_are_announced_to_that_accounts_subscribers_only() {
    use copier_node::hub::{Signal, Topic};
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    add_account(&mut conn, 1, "master", "127.0.0.1:1", "m1").await;
    add_account(&mut conn, 2, "follower", "127.0.0.1:1", "f2").await;
    add_account(&mut conn, 3, "follower", "127.0.0.1:1", "f3").await;
    let hub = hub_at(&db.url, "t", Default::default());
    let (tx2, mut rx2) = tokio::sync::mpsc::unbounded_channel();
    let (tx3, mut rx3) = tokio::sync::mpsc::unbounded_channel();
    let _s2 = hub.subscribe(Topic::Account(2), tx2).await.unwrap();
    let _s3 = hub.subscribe(Topic::Account(3), tx3).await.unwrap();
    let mut heard = async |what: &str| {
        let signal = tokio::time::timeout(WAIT, rx2.recv())
            .await
            .unwrap_or_else(|_| panic!("no announcement for follower 2 after {what}"));
        assert_eq!(signal, Some(Signal::AccountChanged), "{what}");
    };
    let (link, _) = add_link(&mut conn, 1, 2, LinkSpec::default()).await;
    heard("an insert").await;
    conn.execute(format!("UPDATE copy_links SET lot_value = 3 WHERE id = {link}").as_str())
        .await
        .unwrap();
    heard("an update").await;
    conn.execute(format!("DELETE FROM copy_links WHERE id = {link}").as_str())
        .await
        .unwrap();
    heard("a delete").await;
    // Announcements arrive in commit order on one connection: follower 3's would be here by now.
    assert!(
        rx3.try_recv().is_err(),
        "follower 3 heard about follower 2's links"
    );
    // The account's own row: a lease renewal or a status write is not announced; a change of
    // what the session logged in with is.
    conn.execute("UPDATE trading_accounts SET lease_until = now(), owner_epoch = owner_epoch + 1, status = 'y', balance = 1 WHERE id = 2")
        .await
        .unwrap();
    for (set, what) in [
        ("server = '127.0.0.1:2'", "a new server"),
        ("login = 'f2b'", "a new login"),
        ("credentials = 'enc:v1:x'", "new credentials"),
        ("role = 'master'", "a new role"),
    ] {
        conn.execute(format!("UPDATE trading_accounts SET {set} WHERE id = 2").as_str())
            .await
            .unwrap();
        heard(what).await;
    }
    // A marker on follower 3, after which nothing more may be queued for follower 2.
    conn.execute("UPDATE trading_accounts SET server = '127.0.0.1:3' WHERE id = 3")
        .await
        .unwrap();
    let marker = tokio::time::timeout(WAIT, rx3.recv()).await.unwrap();
    assert_eq!(marker, Some(Signal::AccountChanged));
    assert!(
        rx2.try_recv().is_err(),
        "a renewal or status write was announced"
    );
}

/// Between brokers whose symbols carry their own suffixes, a copy finds its symbol without a
/// map: the master's suffix stripped, the follower's found in its broker's list.
#[tokio::test]
async fn symbols_resolve_between_brokers_with_different_suffixes() {
    use copier_node::sim_broker::server::{ServeOptions, SimBroker};

    let mut s = CopySetup::new("copy-suffixes").await;
    let other = SimBroker::start(ServeOptions {
        symbol_suffixes: vec!["pro".to_string()],
        ..ServeOptions::new("127.0.0.1:0", s.dir.path("journal-pro.jsonl"))
    })
    .await
    .unwrap();
    let pro = Trader {
        addr: other.addr.to_string(),
    };
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 2, "follower", &other.addr.to_string(), "f2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let node = start_node(&config(&s.db, "suffixes", 10, FAST)).await;
    followers_ready(&mut s.conn, &[2]).await;
    let eur = s.t.open("m1", "EURUSD.m", Side::Buy, 0.2, None, None).await;
    let gold = s.t.open("m1", "XAUUSD", Side::Sell, 0.1, None, None).await;
    assert_eq!(
        pro.copy_of("f2", magic, eur, WAIT).await.symbol,
        "EURUSDpro"
    );
    assert_eq!(
        pro.copy_of("f2", magic, gold, WAIT).await.symbol,
        "XAUUSDpro"
    );
    node.shutdown();
    other.stop().await;
}

/// A link's stops-and-sizes settings on a node: the take profit not copied, the stop loss
/// brought within its cap, the broker's minimum lot used instead of a skip, small master trades
/// not copied (recorded with their code), and a copy beyond the link's maximum held back until
/// a copy closes.
#[tokio::test]
async fn stops_and_sizes_settings_shape_and_limit_copies() {
    let mut s = CopySetup::new("copy-sizes").await;
    let (link, magic) = crate::support::fixture::master_and_follower(
        &mut s.conn,
        &s.addr,
        LinkSpec {
            lot_value: 0.001,
            ..Default::default()
        },
    )
    .await;
    sqlx::query(
        "UPDATE copy_links SET copy_tp = false, max_sl_distance = 0.005, use_min_lot = true,
                min_master_lot = 0.05, max_open_copies = 2 WHERE id = $1",
    )
    .bind(link)
    .execute(&mut s.conn)
    .await
    .unwrap();
    let node = start_node(&config(&s.db, "sizes", 10, FAST)).await;
    followers_ready(&mut s.conn, &[2]).await;
    let first =
        s.t.open("m1", "EURUSD", Side::Buy, 1.0, Some(1.05), Some(1.2))
            .await;
    let copy = s.t.copy_of("f2", magic, first, WAIT).await;
    assert_eq!(copy.volume, 0.01, "the broker's minimum, not a skip");
    assert_eq!(copy.tp, None, "the take profit is not copied");
    let master_open = s.t.positions("m1").await[0].open_price;
    assert!(
        (copy.sl.unwrap() - (master_open - 0.005)).abs() < 1e-9,
        "the stop loss capped at 0.005 from the master's price: {copy:?}"
    );
    let small = s.t.open("m1", "EURUSD", Side::Buy, 0.01, None, None).await;
    let second = s.t.open("m1", "GBPUSD", Side::Sell, 1.0, None, None).await;
    s.t.copy_of("f2", magic, second, WAIT).await;
    let third = s.t.open("m1", "XAUUSD", Side::Buy, 1.0, None, None).await;
    let code = |ticket: i64| {
        let url = s.db.url.clone();
        async move {
            let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
            sqlx::query_as::<_, (String, bool)>(
                "SELECT code, final FROM copy_skips WHERE link_id = $1 AND master_ticket = $2
                  ORDER BY decided_at DESC LIMIT 1",
            )
            .bind(link)
            .bind(ticket)
            .fetch_optional(&mut c)
            .await
            .unwrap()
        }
    };
    let (small_code, third_code) = eventually("both decisions recorded", WAIT, async || {
        let (a, b) = (code(small).await, code(third).await);
        a.zip(b)
    })
    .await;
    assert_eq!(small_code, ("below_min_trade".to_string(), true));
    assert_eq!(
        third_code,
        ("waiting".to_string(), false),
        "held back, not refused"
    );
    assert_eq!(s.t.positions("f2").await.len(), 2);
    // A copy closes with its master: the held-back position is copied then.
    s.t.close("m1", first, None).await;
    s.t.copy_of("f2", magic, third, WAIT).await;
    assert_eq!(s.t.positions("f2").await.len(), 2);
    node.shutdown();
}

/// Sized by notional value: a lot of gold is 100 oz on the master's broker and 10 on the
/// follower's, so a multiplier-1 copy of 0.3 lots is 3 lots there.
#[tokio::test]
async fn copies_are_sized_by_notional_value_across_contract_sizes() {
    use copier_node::sim_broker::server::{ServeOptions, SimBroker};

    let mut s = CopySetup::new("copy-notional").await;
    let other = SimBroker::start(ServeOptions {
        contract_sizes: [("XAUUSD".to_string(), 10.0)].into_iter().collect(),
        ..ServeOptions::new("127.0.0.1:0", s.dir.path("journal-small.jsonl"))
    })
    .await
    .unwrap();
    let small = Trader {
        addr: other.addr.to_string(),
    };
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 2, "follower", &other.addr.to_string(), "f2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let node = start_node(&config(&s.db, "notional", 10, FAST)).await;
    followers_ready(&mut s.conn, &[2]).await;
    let gold = s.t.open("m1", "XAUUSD", Side::Buy, 0.3, None, None).await;
    let eur = s.t.open("m1", "EURUSD", Side::Buy, 0.3, None, None).await;
    assert_eq!(small.copy_of("f2", magic, gold, WAIT).await.volume, 3.0);
    assert_eq!(
        small.copy_of("f2", magic, eur, WAIT).await.volume,
        0.3,
        "same contract: same lots"
    );
    node.shutdown();
    other.stop().await;
}

/// Between accounts in different currencies, a balance-ratio copy converts the follower's
/// balance at its broker's price; a link's fixed stop sits its points from the copy's own open
/// price; the ledger shows slippage in points; the follower's own max_open_copies holds back a
/// copy from any link while it holds that many.
#[tokio::test]
async fn copies_across_currencies_with_stops_in_points_and_a_follower_limit() {
    use copier_node::sim_broker::server::{ServeOptions, SimBroker};

    let mut s = CopySetup::new("copy-currencies").await;
    let euro = SimBroker::start(ServeOptions {
        currencies: [("f2".to_string(), "EUR".parse().unwrap())]
            .into_iter()
            .collect(),
        balances: [("f2".to_string(), 8_000.0)].into_iter().collect(),
        ..ServeOptions::new("127.0.0.1:0", s.dir.path("journal-eur.jsonl"))
    })
    .await
    .unwrap();
    let eur_broker = Trader {
        addr: euro.addr.to_string(),
    };
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 3, "master", &s.addr, "m3").await;
    add_account(&mut s.conn, 2, "follower", &euro.addr.to_string(), "f2").await;
    let (link, magic) = add_link(
        &mut s.conn,
        1,
        2,
        LinkSpec {
            lot_mode: "balance_ratio",
            ..Default::default()
        },
    )
    .await;
    let (_, other_magic) = add_link(&mut s.conn, 3, 2, LinkSpec::default()).await;
    s.conn
        .execute(
            format!(
                "UPDATE copy_links SET sl_points = 200 WHERE id = {link};
                 UPDATE trading_accounts SET max_open_copies = 2 WHERE id = 2"
            )
            .as_str(),
        )
        .await
        .unwrap();
    let node = start_node(&config(&s.db, "currencies", 10, FAST)).await;
    followers_ready(&mut s.conn, &[2]).await;
    // The master's balance (10,000 USD) must be known before a ratio copy is sized.
    let url = s.db.url.clone();
    let currency = |id: i64| {
        let url = url.clone();
        async move {
            let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
            sqlx::query_scalar::<_, Option<String>>(
                "SELECT currency FROM trading_accounts WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&mut c)
            .await
            .unwrap()
        }
    };
    let (master_ccy, follower_ccy) = eventually("currencies reported", WAIT, async || {
        currency(1).await.zip(currency(2).await)
    })
    .await;
    assert_eq!((master_ccy.as_str(), follower_ccy.as_str()), ("USD", "EUR"));
    let first = s.t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;
    let copy = eur_broker.copy_of("f2", magic, first, WAIT).await;
    // 8,000 EUR at the follower broker's EURUSD 1.1 is 8,800 USD: 0.88 of the master's 10,000.
    assert_eq!(copy.volume, 0.88);
    let placed = eventually(
        "the fixed stop at 200 points from the copy's price",
        WAIT,
        async || {
            let c = eur_broker
                .positions("f2")
                .await
                .into_iter()
                .find(|p| p.ticket == copy.ticket)?;
            c.sl.filter(|sl| (sl - (c.open_price - 0.002)).abs() < 1e-9)
                .map(|_| c)
        },
    )
    .await;
    assert_eq!(placed.tp, None);
    let points: Option<f64> = eventually("the ledger row", WAIT, async || {
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query_scalar::<_, Option<f64>>(
            "SELECT slippage_points FROM copy_ledger WHERE follower_id = 2 AND master_ticket = $1",
        )
        .bind(first)
        .fetch_optional(&mut c)
        .await
        .unwrap()
    })
    .await;
    assert!(points.is_some(), "slippage in points recorded");
    // The follower's limit counts copies from every link.
    let second = s.t.open("m3", "GBPUSD", Side::Sell, 0.1, None, None).await;
    eur_broker.copy_of("f2", other_magic, second, WAIT).await;
    let third = s.t.open("m3", "EURUSD", Side::Buy, 0.1, None, None).await;
    let waiting = eventually("the third copy held back", WAIT, async || {
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query_as::<_, (String, bool, String)>(
            "SELECT code, final, reason FROM copy_skips WHERE master_ticket = $1
              ORDER BY decided_at DESC LIMIT 1",
        )
        .bind(third)
        .fetch_optional(&mut c)
        .await
        .unwrap()
    })
    .await;
    assert_eq!((waiting.0.as_str(), waiting.1), ("waiting", false));
    assert!(
        waiting.2.contains("follower holds its max_open_copies"),
        "{waiting:?}"
    );
    assert_eq!(eur_broker.positions("f2").await.len(), 2);
    // One copy closes with its master: the held-back one is copied then.
    s.t.close("m1", first, None).await;
    eur_broker.copy_of("f2", other_magic, third, WAIT).await;
    assert_eq!(eur_broker.positions("f2").await.len(), 2);
    node.shutdown();
    euro.stop().await;
}

/// A node whose LISTEN connection points nowhere, polling `master_state` every `poll`.
fn polling_without_listen(
    s: &CopySetup,
    node_id: &str,
    poll: Duration,
) -> copier_node::config::Config {
    let mut cfg = crate::support::config_listen(
        &s.db.url,
        "postgres://nobody@127.0.0.1:1/nowhere",
        node_id,
        10,
        FAST,
    );
    cfg.events_poll = Some(poll);
    cfg
}

/// Events without LISTEN: with `events_poll` set, the node never needs the LISTEN connection (here
/// it points nowhere) and followers copy opens and closes from polling `master_state`.
#[tokio::test]
async fn followers_learn_of_master_events_by_polling_without_listen() {
    let mut s = CopySetup::new("copy-poll").await;
    let (_, magic) = master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    let cfg = polling_without_listen(&s, "poller", Duration::from_millis(50));
    let node = start_node(&cfg).await;
    followers_ready(&mut s.conn, &[2]).await;
    let ticket = s.t.open("m1", "EURUSD", Side::Buy, 0.3, None, None).await;
    let copy = s.t.copy_of("f2", magic, ticket, WAIT).await;
    assert_eq!(copy.volume, 0.3);
    s.t.close("m1", ticket, None).await;
    eventually("the copy closed with its master", WAIT, async || {
        s.t.positions("f2")
            .await
            .iter()
            .all(|p| p.ticket != copy.ticket)
            .then_some(())
    })
    .await;
    node.shutdown();
}

/// A master's session hands its events to the followers on its own node as soon as they are
/// stored. With events polled once a minute (no LISTEN) and followers reconciling every three
/// minutes (their first after half of that at least), a follower on its master's node copies an
/// open at once; without the hand-over it would wait for the next poll.
#[tokio::test]
async fn a_follower_on_its_masters_node_hears_its_events_without_waiting_for_the_database() {
    let mut s = CopySetup::new("copy-same-node").await;
    let (_, magic) = master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    let mut cfg = polling_without_listen(&s, "alone", Duration::from_secs(60));
    cfg.reconcile_every = Duration::from_secs(180);
    let node = start_node(&cfg).await;
    followers_ready(&mut s.conn, &[2]).await;
    let ticket = s.t.open("m1", "EURUSD", Side::Buy, 0.3, None, None).await;
    let copy = s.t.copy_of("f2", magic, ticket, WAIT).await;
    assert_eq!(copy.volume, 0.3);
    node.shutdown();
}

/// What the hub passes on of a master's events: each (epoch, seq) once, whether it came first
/// from the master's session on this node (`Hub::deliver`) or by NOTIFY, and nothing older than
/// what was passed on; after a database failover (the sequence may rewind) it forgets what was.
#[tokio::test]
async fn a_masters_events_reach_its_subscribers_once_by_whichever_way_comes_first() {
    use copier_node::copier::events::{MasterEvent, MasterNotice};
    use copier_node::hub::{Signal, Topic};
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let hub = hub_at(&db.url, "h", Default::default());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let _subscription = hub.subscribe(Topic::Master(7), tx).await.unwrap();
    let notice = |epoch: i64, seq: i64| MasterNotice {
        master: 7,
        epoch,
        seq,
        event: MasterEvent::Close { ticket: seq },
    };
    let mut announce = async |epoch: i64, seq: i64| {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(copier_node::channels::master(7))
            .bind(serde_json::to_string(&notice(epoch, seq)).unwrap())
            .execute(&mut conn)
            .await
            .unwrap();
    };
    // The next signal: a notice's (epoch, seq), or None for the failover.
    let mut next = async |what: &str| match tokio::time::timeout(WAIT, rx.recv()).await {
        Ok(Some(Signal::Notice(n, _))) => Some((n.epoch, n.seq)),
        Ok(Some(Signal::FailedOver)) => None,
        other => panic!("{what}: no signal ({other:?})"),
    };
    hub.deliver(notice(5, 1));
    let what = "delivered on the node, no NOTIFY sent";
    assert_eq!(next(what).await, Some((5, 1)), "{what}");
    announce(5, 1).await;
    announce(4, 9).await;
    announce(5, 2).await;
    let what = "the NOTIFY of the event delivered, and an older one, are not passed on";
    assert_eq!(next(what).await, Some((5, 2)), "{what}");
    hub.deliver(notice(5, 2));
    hub.deliver(notice(5, 3));
    let what = "an event heard by NOTIFY first is not passed on again when delivered";
    assert_eq!(next(what).await, Some((5, 3)), "{what}");
    hub.failed_over();
    assert_eq!(next("the failover told").await, None);
    announce(5, 2).await;
    let what = "after a failover an event at a sequence heard before is passed on";
    assert_eq!(next(what).await, Some((5, 2)), "{what}");
}

/// A link's instruction for its removal: removed with `on_remove = 'close'`, its copies are
/// closed by the follower's node (and its `removed_links` row forgotten once none is open);
/// removed with the default `leave`, its copies stay open.
#[tokio::test]
async fn removing_a_link_closes_or_leaves_its_copies_as_it_says() {
    let mut s = CopySetup::unprotected("copy-removal").await;
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 3, "master", &s.addr, "m3").await;
    add_account(&mut s.conn, 2, "follower", &s.addr, "f2").await;
    let (closing, closing_magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let (leaving, leaving_magic) = add_link(&mut s.conn, 3, 2, LinkSpec::default()).await;
    sqlx::query("UPDATE copy_links SET on_remove = 'close' WHERE id = $1")
        .bind(closing)
        .execute(&mut s.conn)
        .await
        .unwrap();
    let node = start_node(&config(&s.db, "removal", 10, FAST)).await;
    followers_ready(&mut s.conn, &[2]).await;
    let a = s.t.open("m1", "EURUSD", Side::Buy, 0.1, None, None).await;
    let b = s.t.open("m1", "GBPUSD", Side::Sell, 0.2, None, None).await;
    let c = s.t.open("m3", "EURUSD", Side::Sell, 0.3, None, None).await;
    s.t.copy_of("f2", closing_magic, a, WAIT).await;
    s.t.copy_of("f2", closing_magic, b, WAIT).await;
    let kept = s.t.copy_of("f2", leaving_magic, c, WAIT).await;
    for link in [closing, leaving] {
        sqlx::query("DELETE FROM copy_links WHERE id = $1")
            .bind(link)
            .execute(&mut s.conn)
            .await
            .unwrap();
    }
    eventually("the closing link's copies closed", WAIT, async || {
        let open = s.t.positions("f2").await;
        (open.len() == 1).then_some(())
    })
    .await;
    let open = s.t.positions("f2").await;
    assert_eq!(
        open[0].ticket, kept.ticket,
        "the leaving link's copy stays: {open:?}"
    );
    let url = s.db.url.clone();
    eventually("the removed link forgotten", WAIT, async || {
        let mut c = sqlx::PgConnection::connect(&url).await.unwrap();
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM removed_links")
            .fetch_one(&mut c)
            .await
            .unwrap();
        (n == 0).then_some(())
    })
    .await;
    // The master closing its positions now changes nothing on the follower.
    s.t.close("m3", c, None).await;
    assert_eq!(s.t.positions("f2").await.len(), 1);
    node.shutdown();
}

/// A LISTEN connection waiting out a long backoff (the database was gone a while) reconnects as
/// soon as the lease loop reports the database back, instead of up to its cap later: after a
/// failover, copying waits for LISTEN (docs/operating.md, "Patroni and HAProxy").
#[tokio::test]
async fn a_listen_connection_in_backoff_reconnects_when_the_database_is_back() {
    use copier_node::hub::Topic;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let db = TestDb::new().await;
    // A front for the database that refuses (accepts and drops) until opened, counting attempts.
    let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = front.local_addr().unwrap().port();
    let attempts = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicBool::new(false));
    let server = db.server_addr();
    let (a, o) = (attempts.clone(), open.clone());
    tokio::spawn(async move {
        while let Ok((mut client, _)) = front.accept().await {
            a.fetch_add(1, Ordering::SeqCst);
            if !o.load(Ordering::SeqCst) {
                continue; // dropped: the connection fails at once
            }
            let server = server.clone();
            tokio::spawn(async move {
                if let Ok(mut upstream) = tokio::net::TcpStream::connect(server).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                }
            });
        }
    });
    let hub = hub_at(&db.url_via(port), "t", Default::default());
    let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
    let subscriber = hub.clone();
    let subscribed =
        tokio::spawn(async move { subscriber.subscribe(Topic::Master(1), tx).await.is_some() });
    // Six failed attempts: the hub now waits 6.4 s before its next one (retry::LISTEN).
    eventually("six failed LISTEN connections", WAIT, async || {
        (attempts.load(Ordering::SeqCst) >= 6).then_some(())
    })
    .await;
    let failed = attempts.load(Ordering::SeqCst);
    open.store(true, Ordering::SeqCst);
    let told = tokio::time::Instant::now();
    hub.database_back();
    let confirmed = tokio::time::timeout(Duration::from_secs(3), subscribed)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "the LISTEN was not confirmed within 3 s of the database being back (its backoff had {failed} failures behind it)"
            )
        })
        .unwrap();
    assert!(confirmed, "the hub stopped");
    eprintln!(
        "LISTEN confirmed {} ms after the database was reported back",
        told.elapsed().as_millis()
    );
}

/// A batch of reads the database refuses (here a lock wait past the timeout) fails every read in
/// it at once: none is read again alone while its session waits. Once the first read's answer is
/// in, the lock is gone, so a read tried again alone would now succeed: every read failing shows
/// that none was.
#[tokio::test]
async fn a_batch_of_reads_the_database_refuses_fails_every_read_at_once() {
    use copier_node::db::copy::{ReconcileRead, ReconcileReader};
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use std::str::FromStr;

    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    add_account(&mut conn, 1, "master", "broker:1", "m1").await;
    let followers: Vec<i64> = (2..=21).collect();
    for &f in &followers {
        add_account(&mut conn, f, "follower", "broker:1", &format!("f{f}")).await;
        add_link(&mut conn, 1, f, LinkSpec::default()).await;
    }
    let mut blocker = db.conn().await;
    let mut tx = sqlx::Connection::begin(&mut blocker).await.unwrap();
    tx.execute("LOCK TABLE master_state IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let options = PgConnectOptions::from_str(&db.url)
        .unwrap()
        .options([("lock_timeout", "200ms")]);
    let pool = PgPoolOptions::new().connect_with(options).await.unwrap();
    let reader = ReconcileReader::spawn_background(copier_node::db::Db::direct(pool.clone()));
    let mut handles: Vec<_> = followers
        .iter()
        .map(|&f| {
            let reader = reader.clone();
            tokio::spawn(async move {
                reader
                    .write(ReconcileRead {
                        follower: f,
                        master: 1,
                    })
                    .await
                    .and_then(|read| read.map(|_| ()))
            })
        })
        .collect();
    let rest = handles.split_off(1);
    let first = handles.pop().unwrap().await.unwrap();
    tx.commit().await.unwrap();
    let mut outcomes = vec![first];
    for h in rest {
        outcomes.push(h.await.unwrap());
    }
    for (f, outcome) in followers.iter().zip(&outcomes) {
        let e = outcome
            .as_ref()
            .expect_err(&format!("follower {f}'s read was tried again alone"));
        assert!(e.contains("lock"), "follower {f}: {e}");
    }
    // The lock gone, the same reads succeed.
    for &f in &followers {
        let read = reader
            .write(ReconcileRead {
                follower: f,
                master: 1,
            })
            .await;
        assert!(matches!(read, Ok(Ok(_))), "follower {f}: {read:?}");
    }
}

/// The readers of a session's start (its links and limits; its master's snapshot and funds with
/// its bases and final decisions; its copy ledgers) send a batch's statements as one message:
/// one transaction a batch (PostgreSQL's own count is the judge), where they took one per
/// statement (four, four and two), each a round trip behind the node's other work on a busy
/// machine (a hand-off's receiver waited 6 ms for its followers' links). The statements then
/// carry their parameters as literals and their rows come back as text: every value reads as the
/// same statements with bound parameters read it (quotes, backslashes, commas and braces in the
/// text, arrays, JSON, NULLs).
#[tokio::test]
async fn a_readers_batch_is_one_message_and_reads_every_value_as_a_bound_statement_does() {
    use copier_node::db::copy::ledger::{copied_of, placed_of};
    use copier_node::db::copy::{
        LedgerRead, LedgerReader, LinksRead, LinksReader, ReconcileRead, ReconcileReader,
        load_bases, load_decided, load_links, master_state,
    };

    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let server = r#"broker:'q\1,{"x"}"#;
    let login = r#"f'2\,{}"#;
    add_account(&mut conn, 1, "master", server, "m1").await;
    add_account(&mut conn, 2, "follower", server, login).await;
    let (link, _) = add_link(&mut conn, 1, 2, LinkSpec::default()).await;
    let tricky = [
        r#"EUR,USD"#,
        r#"a"b"#,
        r#"it's"#,
        r#"back\slash"#,
        "{brace}",
        "NULL",
    ];
    sqlx::query(
        r#"UPDATE copy_links SET symbols = $2, magics = '{7,-5}', sides = 'buy', close_only = true,
               symbol_map = '{"EUR''USD": "X,\"Y\\", "NULL": "{}"}', max_lot = 1.25, sl_points = NULL
         WHERE id = $1"#,
    )
    .bind(link)
    .bind(&tricky[..])
    .execute(&mut conn)
    .await
    .unwrap();
    let setup = [
        "UPDATE trading_accounts SET max_open_copies = 3 WHERE id = 2",
        "INSERT INTO risk_limits (account_id, period, basis, relative, amount, action)
         VALUES (2, 'lifetime', 'equity', true, 5, 'close_all')",
        r#"INSERT INTO master_state (master_id, epoch, seq, positions, updated_at)
           VALUES (1, 7, 3, '[{"ticket": 11, "symbol": "it''s,{x}", "side": "buy", "volume": 1.0, "open_volume": 1.0, "open_price": 1.1, "sl": null, "tp": null, "magic": 0}]', now())"#,
        "UPDATE trading_accounts SET balance = 5000, equity = 5100.5, currency = 'USD' WHERE id = 1",
        "INSERT INTO copy_bases (follower_id, copy_ticket, link_id, master_ticket, master_volume)
         VALUES (2, 901, $1, 11, 2.5)",
        "INSERT INTO copy_skips (link_id, master_ticket, follower_id, reason, decided_at, code, final)
         VALUES ($1, 12, 2, 'filtered', now(), 'filtered', true)",
        "INSERT INTO copy_ledger (follower_id, follower_ticket, server, login, link_id, master_id,
                                  master_server, master_login, master_ticket, symbol, side, volume,
                                  filled_price, node_id, owner_epoch, opened_volume)
         VALUES (2, 501, $2, $3, $1, 1, $2, 'm1', 11, 'EURUSD', 'buy', 1.0, 1.1, 'n', 1, 0.75)",
        "INSERT INTO order_copies (follower_id, server, login, link_id, master_id, master_server,
                                   master_login, master_ticket, follower_ticket, ended, node_id,
                                   owner_epoch)
         VALUES (2, $2, $3, $1, 1, $2, 'm1', 13, 613, NULL, 'n', 1),
                (2, $2, $3, $1, 1, $2, 'm1', 14, NULL, 'cancelled', 'n', 1)",
    ];
    for sql in setup {
        // Each binds what it names: $1 the link, $2 and $3 the server and the login.
        let mut query = sqlx::query(sql);
        if sql.contains("$1") {
            query = query.bind(link);
        }
        if sql.contains("$2") {
            query = query.bind(server).bind(login);
        }
        query.execute(&mut conn).await.unwrap();
    }

    // As bound statements read it (the binary format).
    let links = load_links(&mut conn, 2).await.unwrap();
    let state = master_state(&mut conn, 1).await.unwrap();
    let bases = load_bases(&mut conn, 2).await.unwrap();
    let decided = load_decided(&mut conn, 2).await.unwrap();
    let key = (2, server.to_string(), login.to_string());
    let copied = copied_of(&mut conn, std::slice::from_ref(&key))
        .await
        .unwrap();
    let placed = placed_of(&mut conn, std::slice::from_ref(&key))
        .await
        .unwrap();
    conn.close().await.unwrap();
    let parsed = links[0].as_ref().expect("the link parses");
    assert_eq!(
        parsed.protections.symbols.as_deref(),
        Some(&tricky.map(String::from)[..])
    );
    assert_eq!(parsed.symbol_map["EUR'USD"], r#"X,"Y\"#);
    assert_eq!(copied[&key], [(link, 11, 501, Some(0.75))]);

    // Each reader: a batch of one follower's read, ten times one after another, against the
    // same pool set up and closed with no read.
    let per_read = async |read: &dyn Fn(copier_node::db::Db) -> BoxedReads| -> f64 {
        let mut ended = [0_i64; 2];
        for (n, reads) in [(0, 0), (1, 10)] {
            let before = crate::support::transactions_ended(&db.url).await;
            let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
            if reads > 0 {
                read(copier_node::db::Db::direct(pool.clone())).await;
            }
            pool.close().await;
            ended[n] = crate::support::transactions_ended(&db.url).await - before;
        }
        (ended[1] - ended[0]) as f64 / 10.0
    };
    let links_read = |db| -> BoxedReads {
        let links = links.clone();
        Box::pin(async move {
            let reader = LinksReader::spawn_background(db);
            for _ in 0..10 {
                let read = reader.write(LinksRead(2)).await.unwrap().unwrap();
                assert_eq!(read.links, links, "the links read together");
                assert_eq!(read.max_open_copies, Some(3));
                assert_eq!(read.risk.len(), 1);
            }
        })
    };
    let basis_read = |db| -> BoxedReads {
        let (state, bases, decided) = (state.clone(), bases.clone(), decided.clone());
        Box::pin(async move {
            let reader = ReconcileReader::spawn_background(db);
            for _ in 0..10 {
                let read = reader
                    .write(ReconcileRead {
                        follower: 2,
                        master: 1,
                    })
                    .await
                    .unwrap()
                    .unwrap();
                let mut expected = state.clone().expect("master 1 published");
                expected.now_ms = read.state.as_ref().map_or(0, |s| s.now_ms);
                assert_eq!(read.state, Some(expected), "the snapshot read together");
                assert_eq!(
                    (read.master_funds.balance, read.master_funds.equity),
                    (Some(5000.0), Some(5100.5))
                );
                assert_eq!((&read.bases, &read.decided), (&bases, &decided));
            }
        })
    };
    let ledger_read = |db| -> BoxedReads {
        let (key, copied, placed) = (key.clone(), copied.clone(), placed.clone());
        Box::pin(async move {
            let reader = LedgerReader::spawn_background(db);
            for _ in 0..10 {
                let read = reader
                    .write(LedgerRead {
                        follower: key.0,
                        server: key.1.clone(),
                        login: key.2.clone(),
                    })
                    .await
                    .unwrap();
                assert_eq!(read.copied, copied[&key], "the copies read together");
                let (mut got, mut expected) = (read.placed.clone(), placed[&key].clone());
                got.sort_by_key(|p| p.1);
                expected.sort_by_key(|p| p.1);
                assert_eq!(got, expected, "the pending copies read together");
            }
        })
    };
    for (what, read) in [
        ("links", &links_read as &dyn Fn(_) -> BoxedReads),
        ("reconcile", &basis_read),
        ("ledger", &ledger_read),
    ] {
        let transactions = per_read(read).await;
        assert!(
            transactions < 1.5,
            "the {what} reader: {transactions} transactions a batch of one read"
        );
    }
}

type BoxedReads = std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

/// Followers' reconcile reads made at about the same time go to the database together: far
/// fewer transactions than reads (PostgreSQL's own count is the judge, beside the same reads made
/// one after another), and each follower gets its own: its master's snapshot and funds, its own
/// bases, final decisions, ledger rows and pending copies; a master that never published reads
/// as none, and a master whose snapshot does not parse fails its own followers' reads alone.
#[tokio::test]
async fn reconcile_reads_at_once_go_in_a_few_statements_and_each_follower_gets_its_own() {
    use copier_node::db::copy::{LedgerRead, LedgerReader, ReconcileRead, ReconcileReader};

    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for (m, login) in [(1, "m1"), (100, "m100"), (200, "m200")] {
        add_account(&mut conn, m, "master", "broker:1", login).await;
    }
    let followers: Vec<i64> = (2..=41).collect();
    let mut link_of = HashMap::new();
    for &f in &followers {
        add_account(&mut conn, f, "follower", "broker:1", &format!("f{f}")).await;
        link_of.insert(f, add_link(&mut conn, 1, f, LinkSpec::default()).await.0);
    }
    // Master 1 published one position and has funds; master 100's snapshot does not parse;
    // master 200 never published. Follower 4 has a late-copy base, follower 5 a final decision,
    // follower 6 a copy in the ledger (and one on another login it no longer trades), follower 7
    // two pending copies, one of them cancelled (and one on another login).
    conn.execute(
        r#"INSERT INTO master_state (master_id, epoch, seq, positions, updated_at)
           VALUES (1, 7, 3, '[{"ticket": 11, "symbol": "EURUSD", "side": "buy", "volume": 1.0, "open_volume": 1.0, "open_price": 1.1, "sl": null, "tp": null, "magic": 0}]', now()),
                  (100, 1, 1, '[{"ticket": "not a number"}]', now());
           UPDATE trading_accounts SET balance = 5000, equity = 5100, currency = 'USD' WHERE id = 1;
           INSERT INTO copy_bases (follower_id, copy_ticket, link_id, master_ticket, master_volume)
           SELECT 4, 901, id, 11, 2.5 FROM copy_links WHERE follower_id = 4;
           INSERT INTO copy_skips (link_id, master_ticket, follower_id, reason, decided_at, code, final)
           SELECT id, 12, 5, 'filtered', now(), 'filtered', true FROM copy_links WHERE follower_id = 5;
           INSERT INTO copy_ledger (follower_id, follower_ticket, server, login, link_id, master_id,
                                    master_server, master_login, master_ticket, symbol, side, volume,
                                    filled_price, node_id, owner_epoch)
           SELECT 6, t, 'broker:1', l, id, 1, 'broker:1', 'm1', 11, 'EURUSD', 'buy', 1.0, 1.1, 'n', 1
             FROM copy_links, (VALUES (501, 'f6'), (502, 'old6')) v(t, l) WHERE follower_id = 6;
           INSERT INTO order_copies (follower_id, server, login, link_id, master_id, master_server,
                                     master_login, master_ticket, follower_ticket, ended, node_id,
                                     owner_epoch)
           SELECT 7, 'broker:1', l, id, 1, 'broker:1', 'm1', t, t + 600, e, 'n', 1
             FROM copy_links, (VALUES (13, 'f7', NULL), (14, 'f7', 'cancelled'), (15, 'old7', NULL))
                  v(t, l, e) WHERE follower_id = 7"#,
    )
    .await
    .unwrap();
    conn.close().await.unwrap();

    let url = db.url.clone();
    let committed = async || crate::support::transactions_ended(&url).await;
    let pool = async || sqlx::PgPool::connect(&db.url).await.unwrap();
    let mut asked: Vec<ReconcileRead> = followers
        .iter()
        .map(|&f| ReconcileRead {
            follower: f,
            master: 1,
        })
        .collect();
    asked.push(ReconcileRead {
        follower: 3,
        master: 100,
    });
    asked.push(ReconcileRead {
        follower: 3,
        master: 200,
    });
    let ledger: Vec<LedgerRead> = followers
        .iter()
        .map(|&f| LedgerRead {
            follower: f,
            server: "broker:1".into(),
            login: format!("f{f}"),
        })
        .collect();

    let before = committed().await;
    let p = pool().await;
    let reader = ReconcileReader::spawn_background(copier_node::db::Db::direct(p.clone()));
    let ledger_reader = LedgerReader::spawn_background(copier_node::db::Db::direct(p.clone()));
    let read = crate::support::write_at_once(&reader, asked.clone()).await;
    let copied = crate::support::write_at_once(&ledger_reader, ledger.clone()).await;
    drop((reader, ledger_reader));
    p.close().await;
    let batched = committed().await - before;

    let before = committed().await;
    let p = pool().await;
    let reader = ReconcileReader::spawn_background(copier_node::db::Db::direct(p.clone()));
    let ledger_reader = LedgerReader::spawn_background(copier_node::db::Db::direct(p.clone()));
    for r in &asked {
        let _ = reader.write(*r).await.unwrap();
    }
    for r in &ledger {
        ledger_reader.write(r.clone()).await.unwrap();
    }
    drop((reader, ledger_reader));
    p.close().await;
    let one_by_one = committed().await - before;
    assert!(
        batched * 4 < one_by_one,
        "transactions: {batched} for the reads at once, {one_by_one} one after another"
    );

    for (r, got) in asked.iter().zip(&read) {
        let got = got.as_ref().expect("the reader answers");
        match r.master {
            100 => {
                let e = got.as_ref().unwrap_err();
                assert!(e.starts_with("master 100's published state"), "{e}");
                continue;
            }
            200 => {
                let basis = got.as_ref().unwrap();
                assert_eq!(basis.state, None, "master 200 never published");
                assert_eq!(basis.master_funds.balance, None);
                continue;
            }
            _ => {}
        }
        let basis = got
            .as_ref()
            .unwrap_or_else(|e| panic!("follower {}: {e}", r.follower));
        let state = basis.state.as_ref().expect("master 1 published");
        assert_eq!((state.epoch, state.seq), (7, 3));
        assert_eq!(
            state.positions.iter().map(|p| p.ticket).collect::<Vec<_>>(),
            [11]
        );
        assert_eq!(
            (basis.master_funds.balance, basis.master_funds.equity),
            (Some(5000.0), Some(5100.0))
        );
        let bases: Vec<(i64, f64)> = basis.bases.iter().map(|(t, v)| (*t, *v)).collect();
        let decided: Vec<(i64, i64)> = basis.decided.iter().copied().collect();
        match r.follower {
            4 => assert_eq!(bases, [(901, 2.5)]),
            5 => assert_eq!(decided, [(link_of[&5], 12)]),
            f => assert!(
                bases.is_empty() && decided.is_empty(),
                "follower {f}: {bases:?} {decided:?}"
            ),
        }
    }
    for (r, got) in ledger.iter().zip(copied) {
        let got = got.expect("the reader answers");
        if r.follower == 6 {
            assert_eq!(
                got.copied,
                [(link_of[&6], 11, 501, None)],
                "the copy on f6 only"
            );
        } else {
            assert!(got.copied.is_empty(), "follower {}: {got:?}", r.follower);
        }
        if r.follower == 7 {
            let mut placed = got.placed.clone();
            placed.sort_by_key(|p| p.1);
            assert_eq!(
                placed,
                [
                    (link_of[&7], 13, Some(613), false),
                    (link_of[&7], 14, Some(614), true)
                ],
                "the pending copies on f7 only"
            );
        } else {
            assert!(got.placed.is_empty(), "follower {}: {got:?}", r.follower);
        }
    }
}

/// The account rows of sessions starting at about the same time (a node claiming or receiving
/// thousands of accounts) are read together: far fewer transactions than rows (PostgreSQL's own
/// count is the judge, beside the same reads made one after another), each session gets its own
/// row (server, login, credentials), a row that is gone reads as none, and a row whose role no
/// session runs fails that account's read alone.
#[tokio::test]
async fn account_rows_read_at_once_go_in_a_few_statements_and_each_session_gets_its_own() {
    use copier_node::db::copy::{AccountRead, Role};

    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let ids: Vec<i64> = (1..=120).collect();
    for &id in &ids {
        let role = if id % 10 == 1 { "master" } else { "follower" };
        add_account(
            &mut conn,
            id,
            role,
            &format!("broker:{}", id % 3),
            &format!("l{id}"),
        )
        .await;
    }
    // Account 7 carries stored credentials; account 8's role is one no session runs (the
    // schema's check, dropped here, forbids it).
    conn.execute(
        "UPDATE trading_accounts SET credentials = 'v1:stored' WHERE id = 7;
         ALTER TABLE trading_accounts DROP CONSTRAINT trading_accounts_role_check;
         UPDATE trading_accounts SET role = 'observer' WHERE id = 8",
    )
    .await
    .unwrap();
    conn.close().await.unwrap();
    let mut asked: Vec<AccountRead> = ids.iter().map(|&id| AccountRead(id)).collect();
    asked.push(AccountRead(999)); // no such account

    let read = crate::support::read_at_once_in_few_transactions(&db.url, &asked).await;

    for (r, got) in asked.iter().zip(&read) {
        let got = got.as_ref().expect("the reader answers");
        match r.0 {
            8 => {
                let e = got.as_ref().unwrap_err();
                assert!(e.contains("account 8") && e.contains("observer"), "{e}");
            }
            999 => assert!(matches!(got, Ok(None)), "{got:?}"),
            id => {
                let row = got
                    .as_ref()
                    .unwrap_or_else(|e| panic!("account {id}: {e}"))
                    .as_ref()
                    .unwrap_or_else(|| panic!("account {id} read as gone"));
                let role = if id % 10 == 1 {
                    Role::Master
                } else {
                    Role::Follower
                };
                assert_eq!(
                    (row.id, row.role, row.server.clone(), row.login.clone()),
                    (id, role, format!("broker:{}", id % 3), format!("l{id}"))
                );
                assert_eq!(
                    row.credentials.as_ref().map(|c| c.expose().to_string()),
                    (id == 7).then(|| "v1:stored".to_string()),
                    "account {id}'s credentials"
                );
            }
        }
    }
}

/// A master's snapshot taken by its followers at about the same time (the master moved to a new
/// owner, and each follower on a node reads what it published) is read together: far fewer
/// transactions than followers (PostgreSQL's own count is the judge, beside the same reads made
/// one after another), and each follower gets the whole state; a master that never published
/// reads as none, and a master whose snapshot does not parse fails its own followers' reads
/// alone, naming it.
#[tokio::test]
async fn a_snapshot_read_by_many_followers_at_once_goes_in_a_few_statements() {
    use copier_node::db::copy::MasterStateRead;

    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for (m, login) in [(1, "m1"), (100, "m100"), (200, "m200")] {
        add_account(&mut conn, m, "master", "broker:1", login).await;
    }
    conn.execute(
        r#"INSERT INTO master_state (master_id, epoch, seq, positions, updated_at)
           VALUES (1, 7, 3, '[{"ticket": 11, "symbol": "EURUSD", "side": "buy", "volume": 1.0, "open_volume": 1.0, "open_price": 1.1, "sl": null, "tp": null, "magic": 0}]', now()),
                  (100, 1, 1, '[{"ticket": "not a number"}]', now())"#,
    )
    .await
    .unwrap();
    conn.close().await.unwrap();
    // Sixty followers of master 1, and a few of the two others.
    let mut asked: Vec<MasterStateRead> = (0..60).map(|_| MasterStateRead(1)).collect();
    asked.extend([100, 200, 100, 200].map(MasterStateRead));

    let read = crate::support::read_at_once_in_few_transactions(&db.url, &asked).await;

    for (r, got) in asked.iter().zip(&read) {
        let got = got.as_ref().expect("the reader answers");
        match r.0 {
            1 => {
                let state = got
                    .as_ref()
                    .unwrap_or_else(|e| panic!("master 1: {e}"))
                    .as_ref()
                    .expect("master 1 published");
                assert_eq!((state.epoch, state.seq), (7, 3));
                assert_eq!(
                    state.positions.iter().map(|p| p.ticket).collect::<Vec<_>>(),
                    [11]
                );
                assert!(!state.before_failover);
            }
            100 => {
                let e = got.as_ref().unwrap_err();
                assert!(e.contains("master 100"), "{e}");
            }
            _ => assert!(matches!(got, Ok(None)), "master {}: {got:?}", r.0),
        }
    }
}

/// A node's followers read their links together (`LinksReader`): read at once, forty followers'
/// links, limits on open copies, removed links and risk limits go in a few statements, not four
/// for each (PostgreSQL's own count of the test database's transactions is the judge, beside the
/// same reads made one after another), and each follower gets its own: a link whose settings do
/// not parse (a symbol map to a number, a list of symbols holding a null) is reported with its
/// id among its follower's links, and a risk limit that another
/// release wrote (a period this one does not know) fails its follower's read alone.
#[tokio::test]
async fn links_read_at_once_go_in_a_few_statements_and_each_follower_gets_its_own() {
    use copier_node::db::copy::{LinksRead, LinksReader};

    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    add_account(&mut conn, 1, "master", "broker:1", "m1").await;
    let followers: Vec<i64> = (2..=41).collect();
    let mut link_of = HashMap::new();
    for &f in &followers {
        add_account(&mut conn, f, "follower", "broker:1", &format!("f{f}")).await;
        link_of.insert(f, add_link(&mut conn, 1, f, LinkSpec::default()).await);
    }
    // Follower 3: a link to a second master whose symbol map maps a symbol to a number.
    add_account(&mut conn, 100, "master", "broker:1", "m100").await;
    let (bad_link, _) = add_link(
        &mut conn,
        100,
        3,
        LinkSpec {
            symbol_map: r#"{"EURUSD": 1}"#,
            ..LinkSpec::default()
        },
    )
    .await;
    // Follower 4: its own limit on open copies. Follower 5: its link removed, to be closed.
    // Follower 8: a list of symbols holding a null.
    conn.execute("UPDATE copy_links SET symbols = ARRAY['EURUSD', NULL] WHERE follower_id = 8")
        .await
        .unwrap();
    conn.execute("UPDATE trading_accounts SET max_open_copies = 5 WHERE id = 4")
        .await
        .unwrap();
    conn.execute("UPDATE copy_links SET on_remove = 'close' WHERE follower_id = 5; DELETE FROM copy_links WHERE follower_id = 5")
        .await
        .unwrap();
    // Follower 6: a risk limit; follower 7: one with a period another release wrote.
    conn.execute(
        "INSERT INTO risk_limits (account_id, period, basis, relative, amount, action)
         VALUES (6, 'lifetime', 'equity', true, 5, 'close_all');
         ALTER TABLE risk_limits DROP CONSTRAINT risk_limits_period_check;
         INSERT INTO risk_limits (account_id, period, basis, relative, amount, action)
         VALUES (7, 'fortnightly', 'equity', true, 5, 'close_all')",
    )
    .await
    .unwrap();
    let (risk6, risk7): (i64, i64) = sqlx::query_as(
        "SELECT min(id) FILTER (WHERE account_id = 6), min(id) FILTER (WHERE account_id = 7) FROM risk_limits",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();

    let url = db.url.clone();
    let committed = async || crate::support::transactions_ended(&url).await;
    let reader = async || {
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        (
            LinksReader::spawn_background(copier_node::db::Db::direct(pool.clone())),
            pool,
        )
    };
    let before = committed().await;
    let (links, pool) = reader().await;
    let mut asked: Vec<LinksRead> = followers.iter().map(|f| LinksRead(*f)).collect();
    asked.push(LinksRead(999));
    let read = crate::support::write_at_once(&links, asked).await;
    drop(links);
    pool.close().await;
    let batched = committed().await - before;

    let before = committed().await;
    let (links, pool) = reader().await;
    for f in &followers {
        links.write(LinksRead(*f)).await.unwrap().ok();
    }
    drop(links);
    pool.close().await;
    let one_by_one = committed().await - before;
    assert!(
        batched * 4 < one_by_one,
        "transactions: {batched} for the reads at once, {one_by_one} one after another"
    );

    let read: HashMap<i64, _> = followers
        .iter()
        .copied()
        .chain([999])
        .zip(read.into_iter().map(|r| r.expect("the reader answers")))
        .collect();
    for &f in &followers {
        let Ok(got) = &read[&f] else {
            assert_eq!(f, 7, "only follower 7's read fails: {:?}", read[&f]);
            let e = read[&f].as_ref().unwrap_err();
            assert!(
                e.contains(&format!("risk_limits row {risk7}")) && e.contains("fortnightly"),
                "{e}"
            );
            continue;
        };
        let ids: Vec<Result<(i64, i64), String>> = got
            .links
            .iter()
            .map(|l| {
                l.as_ref()
                    .map(|l| (l.id, l.master_id))
                    .map_err(Clone::clone)
            })
            .collect();
        match f {
            3 => {
                assert_eq!(ids[0], Ok((link_of[&3].0, 1)));
                let e = ids[1].as_ref().unwrap_err();
                assert!(
                    e.starts_with(&format!("copy link {bad_link}: symbol_map")),
                    "{e}"
                );
                assert_eq!(ids.len(), 2);
            }
            8 => {
                let e = ids[0].as_ref().unwrap_err();
                assert!(
                    e.starts_with(&format!("copy link {}: symbols", link_of[&8].0)),
                    "{e}"
                );
            }
            5 => {
                assert!(ids.is_empty(), "{ids:?}");
                assert_eq!(got.removed.len(), 1);
                assert_eq!(
                    (
                        got.removed[0].link_id,
                        got.removed[0].master_id,
                        got.removed[0].magic
                    ),
                    (link_of[&5].0, 1, link_of[&5].1)
                );
            }
            _ => assert_eq!(ids, [Ok((link_of[&f].0, 1))], "follower {f}"),
        }
        assert_eq!(
            got.max_open_copies,
            (f == 4).then_some(5),
            "follower {f}'s limit on open copies"
        );
        if f != 5 {
            assert!(got.removed.is_empty(), "follower {f}: {:?}", got.removed);
        }
        let risk: Vec<i64> = got.risk.iter().map(|r| r.id).collect();
        assert_eq!(
            risk,
            if f == 6 { vec![risk6] } else { vec![] },
            "follower {f}"
        );
    }
    let nobody = read[&999]
        .as_ref()
        .expect("a follower with no row reads nothing");
    assert!(
        nobody.links.is_empty() && nobody.max_open_copies.is_none() && nobody.risk.is_empty(),
        "{nobody:?}"
    );
}

/// A slow trade server's answer to the follower's periodic reading of its figures (every five
/// seconds for a follower with risk limits) holds up none of its copies. Once its copy is open,
/// every read is answered six seconds after it is asked (the journal records a read as it is
/// answered), longer than the readings' period, so a session that waited for its reading would
/// be waiting for one nearly all the time. The master closes as soon as a slow reading has been
/// answered, the next one already asked: the follower's close comes before that next reading's
/// answer in the journal. Fails when the session waits for its reading before it takes the next
/// event (the close then comes after it). The broker's protections are off.
#[tokio::test]
async fn a_slow_reading_of_the_followers_figures_holds_up_no_copy() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::with("copy-slow-reading", |o| {
        o.fence_check = false;
        o.dedupe = false;
        o.journal_reads = true;
    })
    .await;
    let (_, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    // A limit out of reach: the follower's figures are read every five seconds.
    conn.execute(
        "INSERT INTO risk_limits (account_id, period, basis, relative, amount, action)
         VALUES (2, 'lifetime', 'equity', true, 90, 'close_only')",
    )
    .await
    .unwrap();
    let node = start_node(&config(&db, "a", 10, FAST)).await;
    followers_ready(&mut conn, &[2]).await;
    let ticket = t.open("m1", "EURUSD", Side::Buy, 0.2, None, None).await;
    t.copy_of("f2", magic, ticket, WAIT).await;

    let journal_path = dir.path("journal.jsonl");
    let is_reading = |l: &JournalEntry| l.login == "f2" && l.client == "a" && l.action == "account";
    broker.set_read_delay(Duration::from_secs(6));
    let before = journal(&journal_path)
        .iter()
        .filter(|l| is_reading(l))
        .count();
    eventually(
        "a slow reading of the follower's figures",
        Duration::from_secs(60),
        async || {
            let readings = journal(&journal_path)
                .iter()
                .filter(|l| is_reading(l))
                .count();
            (readings > before).then_some(())
        },
    )
    .await;
    t.close("m1", ticket, None).await;
    eventually(
        "the follower's copy closed",
        Duration::from_secs(60),
        async || t.positions("f2").await.is_empty().then_some(()),
    )
    .await;
    broker.set_read_delay(Duration::ZERO);
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;

    let lines = journal(&journal_path);
    let close = lines
        .iter()
        .position(|l| l.login == "f2" && l.client == "a" && l.action == "close")
        .expect("the follower's close");
    let answered_before = lines[..close].iter().filter(|l| is_reading(l)).count();
    assert_eq!(
        answered_before,
        before + 1,
        "the follower's close waited for its next reading of its figures"
    );
}

/// A follower's session subscribes to the masters its row named as it was read, and asks for
/// their snapshots beside its links; its links, as read after, decide what it copies, each from
/// its own master's snapshot. Master 1 has published a position. Held (a fault-injection point)
/// between the read of its row and its login, the follower's links change: the link from
/// master 1 is removed, and one from master 3 is added that copies existing positions, with a
/// position opened on master 3. Let go, the follower copies master 3's position (a master its
/// row did not name) and never master 1's (read ahead for it, its link gone). Judged from the
/// broker's journal, its protections off. Fails when master 1's snapshot, read ahead, is taken
/// for master 3's (shown by hand), or when a master the row did not name is never read.
#[tokio::test]
async fn a_followers_links_changed_after_its_row_was_read_decide_what_it_copies() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::unprotected("copy-first-reads").await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    add_account(&mut conn, 3, "master", &addr, "m3").await;
    // Master 1 publishes its position (no follower yet).
    let first_position = t.open("m1", "EURUSD", Side::Buy, 0.3, None, None).await;
    let node = start_node(&config(&db, "pre", 10, FAST)).await;
    published(&mut conn, 1, first_position).await;
    node.shutdown();
    node.wait().await.unwrap();

    add_account(&mut conn, 2, "follower", &addr, "f2").await;
    let (old_link, _) = add_link(&mut conn, 1, 2, LinkSpec::default()).await;
    // Every session holds at its login: each has read its row.
    let (mut node, hold) = held_at_login(&db, &dir, 3).await;
    conn.execute(format!("DELETE FROM copy_links WHERE id = {old_link}").as_str())
        .await
        .unwrap();
    let existing = LinkSpec {
        copy_existing: true,
        ..LinkSpec::default()
    };
    let (_, magic) = add_link(&mut conn, 3, 2, existing).await;
    let third = t.open("m3", "GBPUSD", Side::Sell, 0.2, None, None).await;
    std::fs::remove_file(&hold).unwrap();
    t.copy_of("f2", magic, third, WAIT).await;
    status_becomes(&mut conn, 2, "f2's reconcile of master 3", |s| {
        s.starts_with("follower: master 3")
    })
    .await;
    node.signal("TERM");
    node.wait_exit(WAIT).await;
    broker.stop().await;

    let copied = journal(&dir.path("journal.jsonl")).into_iter().any(|l| {
        l.login == "f2"
            && l.action == "open"
            && l.comment.as_deref() == Some(&format!("mc{first_position}"))
    });
    assert!(
        !copied,
        "f2 copied master 1's position, whose link was removed"
    );
}

/// A follower whose first read of its links fails (the links table renamed away for the moment
/// between its row's read and its login) reads them again with the reconcile it then owes, and
/// copies its master's position: not a session left without links until its next re-read of
/// them (a minute) or the background reconcile (three). Judged from the broker's positions.
/// Fails when a failed first read leaves the session copying nothing until then.
#[tokio::test]
async fn a_followers_failed_first_links_read_is_read_again_and_it_copies() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::unprotected("copy-links-read-fails").await;
    let (_, magic) = master_and_follower(&mut conn, &addr, LinkSpec::default()).await;
    let ticket = t.open("m1", "EURUSD", Side::Buy, 0.3, None, None).await;
    let (mut node, hold) = held_at_login(&db, &dir, 2).await;
    conn.execute("ALTER TABLE copy_links RENAME TO copy_links_away")
        .await
        .unwrap();
    std::fs::remove_file(&hold).unwrap();
    eventually("f2's first links read failing", WAIT, async || {
        node.output()
            .contains("reading the follower's links failed")
            .then_some(())
    })
    .await;
    // Its status says so (not that it has no links) while the reads fail.
    status_becomes(&mut conn, 2, "f2's status", |s| {
        s == "follower: copy links not read yet (retrying)"
    })
    .await;
    conn.execute("ALTER TABLE copy_links_away RENAME TO copy_links")
        .await
        .unwrap();
    t.copy_of("f2", magic, ticket, WAIT).await;
    node.signal("TERM");
    node.wait_exit(WAIT).await;
    broker.stop().await;
}

/// A reconcile times its decisions by the database's clock at its snapshot's read plus the time
/// since: a follower's broker reads that answer late count against a link's `max_delay_ms`.
/// Master 1's position, recorded well within the limit when a link copying existing positions
/// with `max_delay_ms` 2000 is added, is judged too late once the follower's three reads (a
/// second each) are through, and never copied. Fails when the decision is timed at the
/// snapshot's read alone (the copy is made, a second or more older than the limit allows).
#[tokio::test]
async fn a_reconcile_times_its_decisions_after_its_slow_reads_of_the_follower() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::unprotected("copy-decision-clock").await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    add_account(&mut conn, 2, "follower", &addr, "f2").await;
    let node = start_node(&config(&db, "a", 10, FAST)).await;
    status_becomes(&mut conn, 2, "f2's session, with no links yet", |s| {
        s == "follower: no copy links"
    })
    .await;
    let ticket = t.open("m1", "EURUSD", Side::Buy, 0.3, None, None).await;
    published(&mut conn, 1, ticket).await;
    broker.set_read_delay(Duration::from_secs(1));
    let existing = LinkSpec {
        copy_existing: true,
        ..Default::default()
    };
    // With its limit in one transaction (link changes are announced at commit).
    let mut tx = sqlx::Connection::begin(&mut conn).await.unwrap();
    let (link, _) = add_link(&mut tx, 1, 2, existing).await;
    tx.execute(format!("UPDATE copy_links SET max_delay_ms = 2000 WHERE id = {link}").as_str())
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let reason = skip_reason(&mut conn, link, ticket).await;
    assert!(
        reason.contains("too late") && reason.contains("over the link's max_delay_ms 2000"),
        "{reason}"
    );
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;
    let copied = journal(&dir.path("journal.jsonl"))
        .into_iter()
        .any(|l| l.login == "f2" && l.action == "open");
    assert!(!copied, "f2 copied a position past its link's max_delay_ms");
}

/// Sessions whose tasks wake together (their fence raises answered in one read of the broker's
/// socket, their rows in one batch) send their first reads in one batch: the reader lets the
/// tasks woken beside the first sender run before it takes its batch, though the runtime runs
/// the task woken last (the reader, woken by that first job) first. PostgreSQL's own count of
/// the test database's transactions is the judge, beside the same pool reading one row (the
/// driver's own first queries of a connection included in both). One worker thread, so that
/// the order the tasks run in is the runtime's alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn reads_sent_by_tasks_woken_together_go_in_one_batch() {
    use copier_node::db::copy::{AccountRead, AccountReader};
    const TASKS: i64 = 10;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    for id in 1..=TASKS {
        add_account(&mut conn, id, "follower", "127.0.0.1:1", &format!("f{id}")).await;
    }
    conn.close().await.unwrap();
    let transactions = async |tasks: i64| -> i64 {
        let before = crate::support::transactions_ended(&db.url).await;
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        {
            let reader = AccountReader::spawn_background(copier_node::db::Db::direct(pool.clone()));
            // The last task to reach the barrier wakes the others, on the worker, and sends
            // its read first.
            let together = std::sync::Arc::new(tokio::sync::Barrier::new(tasks as usize));
            let reads: Vec<_> = (1..=tasks)
                .map(|id| {
                    let (reader, together) = (reader.clone(), together.clone());
                    tokio::spawn(async move {
                        together.wait().await;
                        reader.write(AccountRead(id)).await
                    })
                })
                .collect();
            for read in reads {
                let row = read.await.unwrap().unwrap().unwrap();
                assert!(row.is_some(), "every account's row is read");
            }
        }
        pool.close().await;
        crate::support::transactions_ended(&db.url).await - before
    };
    let alone = transactions(1).await;
    let together = transactions(TASKS).await;
    assert_eq!(
        together, alone,
        "one batch for the reads of {TASKS} tasks woken together: as many transactions as one read"
    );
}
