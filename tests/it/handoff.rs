//! Prepared fair-share hand-offs end to end: nodes in-process, real PostgreSQL, the simulated
//! broker as MT4/MT5 servers behave (no fence check, no client-order-id dedupe) with a slow
//! login. Judged from the broker's journal alone.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use copier_node::broker::types::Side;
use sqlx::postgres::PgListener;

use crate::support::broker::journal;
use crate::support::fixture::CopySetup;
use crate::support::http::{get, sample};
use crate::support::{
    FAST, LinkSpec, add_account, add_link, config, eventually, start_node, wait_state,
};

const WAIT: Duration = Duration::from_secs(60);

/// What a real trade server's login costs, roughly; the old owner copies on meanwhile.
const LOGIN_DELAY: Duration = Duration::from_secs(2);

/// A node joins; the old owner offers the accounts it hands off, keeps copying while the new
/// node logs in ahead (a trade made after the offer is copied by the old owner), and only then
/// stops. The new owner raises its prepared login's fence (no second login), every order of the
/// old owner precedes that raise in the journal and every order of the new owner follows it, and
/// no trade is copied twice.
#[tokio::test]
async fn a_fair_share_move_prepares_the_receiver_while_the_old_owner_copies() {
    let CopySetup {
        db,
        dir,
        broker,
        addr,
        t,
        mut conn,
    } = CopySetup::with("handoff-prepared", |o| {
        o.fence_check = false;
        o.dedupe = false;
        o.login_delay = LOGIN_DELAY;
    })
    .await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    for id in 2..=7 {
        add_account(&mut conn, id, "follower", &addr, &format!("f{id}")).await;
        add_link(&mut conn, 1, id, LinkSpec::default()).await;
    }
    // Everything on a; then b joins and fair share moves three accounts to it (7 = 4 + 3).
    let mut a_config = config(&db, "a", 100, FAST);
    a_config.handoff_prepare = Duration::from_secs(10);
    let a = start_node(&a_config).await;
    wait_state(&a.state, "a owns every account", WAIT, |s| {
        s.owned.len() == 7
    })
    .await;
    eventually("follower sessions to reconcile", WAIT, async || {
        let ready: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM trading_accounts WHERE id BETWEEN 2 AND 7 AND status LIKE 'follower: master%'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        (ready == 6).then_some(())
    })
    .await;
    let first = t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;

    let mut offers = PgListener::connect(&db.url).await.unwrap();
    offers.listen("copier_handoff").await.unwrap();
    let b = start_node(&config(&db, "b", 100, FAST)).await;
    // The first follower offered to b: trade at once, while b logs in (LOGIN_DELAY).
    let offered: i64 = tokio::time::timeout(WAIT, async {
        loop {
            let n = offers.recv().await.unwrap();
            let v: serde_json::Value = serde_json::from_str(n.payload()).unwrap();
            let id = v["account_id"].as_i64().unwrap();
            if v["ready"] == false && v["from"] == "a" && v["to"] == "b" && id != 1 {
                break id;
            }
        }
    })
    .await
    .expect("a offers a follower to b");
    let during = t.open("m1", "GBPUSD", Side::Sell, 0.5, None, None).await;
    let offered_login = format!("f{offered}");

    // Fair share settles: b holds its share of three.
    wait_state(&b.state, "b holds its share", WAIT, |s| s.owned.len() == 3).await;
    eventually("a's hand-offs to finish", WAIT, async || {
        (a.state.borrow().owned.len() == 4).then_some(())
    })
    .await;
    t.close("m1", first, None).await;
    t.close("m1", during, None).await;
    let opens_and_closes = |lines: &[copier_node::sim_broker::journal::JournalEntry]| {
        let mut per: HashMap<(String, String), usize> = HashMap::new();
        for l in lines
            .iter()
            .filter(|l| l.accepted && l.client != "manual" && l.action != "login")
        {
            *per.entry((l.login.clone(), l.action.clone())).or_default() += 1;
        }
        per
    };
    // Both trades opened and closed on all six followers.
    eventually("every copy closed", WAIT, async || {
        let per = opens_and_closes(&journal(&dir.path("journal.jsonl")));
        (2..=7)
            .all(|id| {
                let login = format!("f{id}");
                per.get(&(login.clone(), "open".into())) >= Some(&2)
                    && per.get(&(login, "close".into())) >= Some(&2)
            })
            .then_some(())
    })
    .await;

    let lines = journal(&dir.path("journal.jsonl"));
    // S2: one accepted open per follower and master position (the copy's comment names it).
    let mut copies: HashMap<(&str, Option<&str>), usize> = HashMap::new();
    for l in lines
        .iter()
        .filter(|l| l.accepted && l.action == "open" && l.client != "manual")
    {
        *copies
            .entry((l.login.as_str(), l.comment.as_deref()))
            .or_default() += 1;
    }
    assert!(copies.values().all(|n| *n == 1), "copied twice: {copies:?}");
    assert_eq!(copies.len(), 12, "{copies:?}");

    // The trade made after the offer was copied to the offered follower by a, its old owner.
    let during_copy = lines
        .iter()
        .find(|l| {
            l.login == offered_login
                && l.action == "open"
                && l.accepted
                && l.comment
                    .as_deref()
                    .is_some_and(|c| c.contains(&during.to_string()))
        })
        .expect("the trade made during the preparation was copied");
    assert_eq!(
        during_copy.client, "a",
        "the old owner copies while the receiver prepares"
    );

    // Every account b took (the master too, if it moved): its logins at b were one prepared
    // login (no fence) and one raise (a fence), and a's orders all precede that raise, b's all
    // follow it.
    let owners: BTreeMap<i64, String> =
        sqlx::query_as("SELECT id, node_id FROM trading_accounts WHERE node_id IS NOT NULL")
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let login_of = |id: i64| {
        if id == 1 {
            "m1".to_string()
        } else {
            format!("f{id}")
        }
    };
    let moved: Vec<String> = owners
        .iter()
        .filter(|(_, n)| n.as_str() == "b")
        .map(|(id, _)| login_of(*id))
        .collect();
    assert_eq!(moved.len(), 3, "{owners:?}");
    assert!(moved.contains(&offered_login), "{moved:?}");
    let logged_in_at_b: std::collections::BTreeSet<&str> = lines
        .iter()
        .filter(|l| l.client == "b" && l.action == "login")
        .map(|l| l.login.as_str())
        .collect();
    assert_eq!(
        logged_in_at_b,
        moved.iter().map(String::as_str).collect(),
        "b logged in exactly the accounts it took"
    );
    for login in &moved {
        let of: Vec<(usize, &copier_node::sim_broker::journal::JournalEntry)> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| &l.login == login)
            .collect();
        let b_logins: Vec<Option<i64>> = of
            .iter()
            .filter(|(_, l)| l.client == "b" && l.action == "login")
            .map(|(_, l)| l.fence)
            .collect();
        assert!(
            b_logins.len() == 2 && b_logins[0].is_none() && b_logins[1].is_some(),
            "{login}: b's logins {b_logins:?} (expected a prepared login, then its raise)"
        );
        let raise = of
            .iter()
            .find(|(_, l)| l.client == "b" && l.action == "login" && l.fence.is_some())
            .map(|(i, _)| *i)
            .unwrap();
        for (i, l) in of.iter().filter(|(_, l)| l.action != "login") {
            match l.client.as_str() {
                "a" => assert!(*i < raise, "{login}: a sent after b's raise: {l:?}"),
                "b" => assert!(*i > raise, "{login}: b sent before its raise: {l:?}"),
                _ => {}
            }
        }
    }
    // b's metrics count the same: three prepared logins raised at its claims.
    let (_, metrics) = get(b.http_addr, "/metrics").await;
    for (outcome, n) in [("prepared", 3.0), ("raised", 3.0), ("failed", 0.0)] {
        assert_eq!(
            sample(
                &metrics,
                &format!("copier_handoff_logins_total{{outcome=\"{outcome}\"}}")
            ),
            n,
            "{outcome}"
        );
    }
    for n in [a, b] {
        n.shutdown();
        n.wait().await.unwrap();
    }
    broker.stop().await;
}
