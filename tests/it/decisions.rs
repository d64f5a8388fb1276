//! The follower's decisions end to end (issue 13): a node in-process, real PostgreSQL, and the
//! simulated broker behaving as real MT4/MT5 servers do (no fence check, no client-order-id
//! deduplication) unless a test says otherwise. Each test names the decision it proves.

use std::collections::HashMap;
use std::time::Duration;

use copier_node::app::NodeHandle;
use copier_node::broker::types::Side;
use copier_node::copier::MasterPosition;
use copier_node::copier::events::{MasterEvent, MasterNotice};
use copier_node::sim_broker::journal::JournalEntry;
use copier_node::sim_broker::server::ServeOptions;
use copier_node::sim_broker::tools::{self, HandOrder};

use crate::support::broker::journal;
use crate::support::fixture::CopySetup;
use crate::support::{
    FAST, LinkSpec, add_account, add_link, config, eventually, start_node, wait_state,
};

mod pending;

const WAIT: Duration = Duration::from_secs(15);

/// The broker's protections: off is how real MT4/MT5 servers behave.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Broker {
    /// No fence check, no client-order-id deduplication.
    Unprotected,
    /// Both on (the simulated broker's default).
    Protected,
}

/// The fixture of every test here, with the methods below.
type Fixture = CopySetup;

async fn fixture(name: &str, broker: Broker, tune: impl FnOnce(&mut ServeOptions)) -> Fixture {
    CopySetup::with(name, |options| {
        if broker == Broker::Unprotected {
            options.fence_check = false;
            options.dedupe = false;
        }
        tune(options);
    })
    .await
}

impl CopySetup {
    /// Master 1 (`m1`) and followers 2.. (`f2`, ...), each follower linked with its spec.
    async fn accounts(&mut self, links: Vec<LinkSpec>) -> HashMap<i64, (i64, i64)> {
        add_account(&mut self.conn, 1, "master", &self.addr, "m1").await;
        let mut out = HashMap::new();
        for (i, spec) in links.into_iter().enumerate() {
            let f = i as i64 + 2;
            add_account(&mut self.conn, f, "follower", &self.addr, &format!("f{f}")).await;
            out.insert(f, add_link(&mut self.conn, 1, f, spec).await);
        }
        out
    }

    /// One node owning every account, its followers reconciled once.
    async fn node(&mut self, id: &str, accounts: usize) -> NodeHandle {
        let node = start_node(&config(&self.db, id, 100, FAST)).await;
        wait_state(&node.state, "the node owns every account", WAIT, |s| {
            s.owned.len() == accounts
        })
        .await;
        self.followers_ready().await;
        node
    }

    async fn followers_ready(&mut self) {
        let conn = &mut self.conn;
        eventually("every follower reconciled", WAIT, async || {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM trading_accounts WHERE role = 'follower' AND enabled AND coalesce(status, '') NOT LIKE 'follower: master%'",
            )
            .fetch_one(&mut *conn)
            .await
            .unwrap();
            (waiting == 0).then_some(())
        })
        .await;
    }

    /// Makes the broker refuse the next `count` node orders of kind `order` on `login`.
    async fn refuse(&self, login: &str, order: &str, count: u32, reason: &str) {
        tools::refuse(&self.addr, login, order, count, reason)
            .await
            .unwrap();
    }

    /// Journal lines of node orders of `action` carrying `comment`.
    fn orders(&self, action: &str, comment: &str) -> Vec<JournalEntry> {
        journal(&self.dir.path("journal.jsonl"))
            .into_iter()
            .filter(|l| {
                l.client != "manual" && l.action == action && l.comment.as_deref() == Some(comment)
            })
            .collect()
    }

    /// Waits until a decision with `code` (and `final`) is recorded about (link, master ticket).
    async fn wait_decision(&mut self, link: i64, master_ticket: i64, code: &str, is_final: bool) {
        let conn = &mut self.conn;
        eventually(
            format!("a {code} decision (final {is_final}) about {master_ticket}"),
            WAIT,
            async || {
                let n: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM copy_skips WHERE link_id = $1 AND master_ticket = $2 AND code = $3 AND final = $4",
                )
                .bind(link)
                .bind(master_ticket)
                .bind(code)
                .bind(is_final)
                .fetch_one(&mut *conn)
                .await
                .unwrap();
                (n > 0).then_some(())
            },
        )
        .await;
    }

    /// Every decision recorded about (link, master ticket), oldest first: (code, final).
    async fn decisions(&mut self, link: i64, master_ticket: i64) -> Vec<(String, bool)> {
        sqlx::query_as(
            "SELECT code, final FROM copy_skips WHERE link_id = $1 AND master_ticket = $2 ORDER BY id",
        )
        .bind(link)
        .bind(master_ticket)
        .fetch_all(&mut self.conn)
        .await
        .unwrap()
    }

    async fn open(&self, volume: f64) -> i64 {
        self.t
            .open("m1", "EURUSD", Side::Buy, volume, None, None)
            .await
    }
}

/// Item 0: the master's balance not known yet when its first trade arrives is a wait. The copy is
/// made as soon as the balance is known, without waiting for a reconcile (the background one is
/// minutes away), and no final skip is recorded.
#[tokio::test]
async fn a_ratio_follower_waits_for_the_masters_balance_instead_of_skipping() {
    let mut fx = fixture("dec-wait", Broker::Unprotected, |_| {}).await;
    let links = fx
        .accounts(vec![LinkSpec {
            lot_mode: "balance_ratio",
            lot_value: 1.0,
            ..Default::default()
        }])
        .await;
    let (link, magic) = links[&2];
    // As on a master whose bridge cannot read its account yet: its session never reports a
    // balance (the row's stays NULL), so no follower can have read one.
    fx.refuse("m1", "account", u32::MAX, "no connection").await;
    let node = fx.node("a", 2).await;
    let ticket = fx.open(0.5).await;
    fx.wait_decision(link, ticket, "waiting", false).await;
    // The master's session reports its balance.
    sqlx::query("UPDATE trading_accounts SET balance = 10000, equity = 10000 WHERE id = 1")
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let copy = fx.t.copy_of("f2", magic, ticket, WAIT).await;
    assert_eq!(copy.volume, 0.5);
    assert_eq!(
        fx.decisions(link, ticket).await,
        vec![("waiting".to_string(), false)],
        "a wait is history, never a final skip"
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// Item 1: two copies of one master position (an earlier incident, or a copy placed by hand
/// with the copy's marker) are closed under two client order ids, so a deduplicating broker
/// swallows neither close.
#[tokio::test]
async fn two_copies_of_one_master_position_are_both_closed_when_the_master_closes() {
    for broker in [Broker::Protected, Broker::Unprotected] {
        let mut fx = fixture("dec-two-copies", broker, |_| {}).await;
        let links = fx.accounts(vec![LinkSpec::default()]).await;
        let (_, magic) = links[&2];
        let node = fx.node("a", 2).await;
        let ticket = fx.open(0.4).await;
        let first = fx.t.copy_of("f2", magic, ticket, WAIT).await;
        // A second position with the copy's magic and comment, placed by hand.
        let second = tools::trade(
            &fx.addr,
            "f2",
            HandOrder::Open {
                symbol: "EURUSD".into(),
                side: Side::Buy,
                volume: 0.4,
                sl: None,
                tp: None,
                magic,
                comment: format!("mc{ticket}"),
            },
        )
        .await
        .unwrap()
        .unwrap();
        assert_ne!(first.ticket, second);
        fx.t.close("m1", ticket, None).await;
        let t = &fx.t;
        eventually(
            format!("{broker:?}: both copies of {ticket} closed"),
            WAIT,
            async || {
                let open = t.positions("f2").await;
                (!open.iter().any(|p| p.comment == format!("mc{ticket}"))).then_some(())
            },
        )
        .await;
        let closes: Vec<String> = fx
            .orders("close", &format!("mc{ticket}"))
            .into_iter()
            .filter(|l| l.accepted)
            .map(|l| l.client_order_id.clone().unwrap())
            .collect();
        assert_eq!(closes.len(), 2, "{broker:?}: {closes:?}");
        assert_ne!(closes[0], closes[1], "one intent, one id");
        node.shutdown();
        node.wait().await.unwrap();
    }
}

/// Item 2: a protection's skip is final for that master position: lifting the protection, a
/// reconcile, and another node after a failover all leave it uncopied; positions opened
/// afterwards are copied.
#[tokio::test]
async fn a_protections_skip_is_final_on_every_node_even_after_the_protection_is_lifted() {
    let mut fx = fixture("dec-final", Broker::Unprotected, |_| {}).await;
    let links = fx.accounts(vec![LinkSpec::default()]).await;
    let (link, magic) = links[&2];
    sqlx::query("UPDATE copy_links SET close_only = true WHERE id = $1")
        .bind(link)
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let a = fx.node("a", 2).await;
    let held_back = fx.open(0.3).await;
    fx.wait_decision(link, held_back, "close_only", true).await;
    sqlx::query("UPDATE copy_links SET close_only = false WHERE id = $1")
        .bind(link)
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let later = fx.open(0.2).await;
    fx.t.copy_of("f2", magic, later, WAIT).await;
    // The owner changes (clean hand-off to b); b reconciles from scratch.
    a.shutdown();
    a.wait().await.unwrap();
    let b = fx.node("b", 2).await;
    let later2 = fx.open(0.1).await;
    fx.t.copy_of("f2", magic, later2, WAIT).await;
    assert!(
        fx.orders("open", &format!("mc{held_back}")).is_empty(),
        "the skipped position was never sent, on either node"
    );
    assert_eq!(
        fx.decisions(link, held_back).await,
        vec![("close_only".to_string(), true)],
        "decided once"
    );
    b.shutdown();
    b.wait().await.unwrap();
}

/// Item 2: a definitive rejection of an open is recorded and never sent again, not even by the
/// reconcile a link change causes.
#[tokio::test]
async fn a_definitive_rejection_is_recorded_and_never_sent_again() {
    let mut fx = fixture("dec-rejected", Broker::Unprotected, |_| {}).await;
    let links = fx.accounts(vec![LinkSpec::default()]).await;
    let (link, magic) = links[&2];
    let node = fx.node("a", 2).await;
    fx.refuse("f2", "open", 1, "not enough money").await;
    let rejected = fx.open(0.3).await;
    fx.wait_decision(link, rejected, "rejected", true).await;
    let reason: String = sqlx::query_scalar(
        "SELECT reason FROM copy_skips WHERE link_id = $1 AND master_ticket = $2 AND final",
    )
    .bind(link)
    .bind(rejected)
    .fetch_one(&mut fx.conn)
    .await
    .unwrap();
    assert!(
        reason.contains("no_money"),
        "the broker's code is kept: {reason}"
    );
    // A real change to the link reconciles its master.
    sqlx::query("UPDATE copy_links SET max_lot = 50 WHERE id = $1")
        .bind(link)
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let later = fx.open(0.2).await;
    fx.t.copy_of("f2", magic, later, WAIT).await;
    let conn = &mut fx.conn;
    eventually("the link change's reconcile", WAIT, async || {
        let status: String = sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = 2")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        status.contains("copies sent").then_some(())
    })
    .await;
    let sent = fx.orders("open", &format!("mc{rejected}"));
    assert_eq!(sent.len(), 1, "sent once, rejected, not retried: {sent:?}");
    assert!(!sent[0].accepted);
    node.shutdown();
    node.wait().await.unwrap();
}

/// Item 2: a transient refusal of an open (market closed) is retried until the link's
/// `max_delay_ms`, then recorded as `too_late` and never sent again; without `max_delay_ms` it is
/// retried until the market opens, and copied then.
#[tokio::test]
async fn a_transient_refusal_is_retried_until_max_delay_then_expires() {
    let mut fx = fixture("dec-transient", Broker::Unprotected, |_| {}).await;
    let links = fx
        .accounts(vec![LinkSpec::default(), LinkSpec::default()])
        .await;
    let (bounded, _) = links[&2];
    let (_, unbounded_magic) = links[&3];
    sqlx::query("UPDATE copy_links SET max_delay_ms = 1500 WHERE id = $1")
        .bind(bounded)
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let node = fx.node("a", 3).await;
    fx.refuse("f2", "open", 10_000, "market closed").await;
    fx.refuse("f3", "open", 10_000, "market closed").await;
    let ticket = fx.open(0.3).await;
    fx.wait_decision(bounded, ticket, "too_late", true).await;
    let tried = |fx: &Fixture, login: &str| {
        journal(&fx.dir.path("journal.jsonl"))
            .into_iter()
            .filter(|l| l.login == login && l.action == "open" && l.client != "manual")
            .count()
    };
    assert!(tried(&fx, "f2") >= 2, "retried before it expired");
    // The market opens: the unbounded link's retry copies; the expired one stays expired.
    fx.refuse("f2", "open", 0, "market closed").await;
    fx.refuse("f3", "open", 0, "market closed").await;
    fx.t.copy_of("f3", unbounded_magic, ticket, Duration::from_secs(45))
        .await;
    let after = tried(&fx, "f2");
    let later = fx.open(0.2).await;
    fx.t.copy_of("f3", unbounded_magic, later, WAIT).await;
    assert_eq!(
        journal(&fx.dir.path("journal.jsonl"))
            .iter()
            .filter(
                |l| l.login == "f2" && l.comment.as_deref() == Some(format!("mc{ticket}").as_str())
            )
            .filter(|l| l.accepted)
            .count(),
        0,
        "the expired open was never executed"
    );
    assert!(
        tried(&fx, "f2") <= after + 1,
        "only the later position was sent"
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// Item 2: a close and a stop change the broker refuses are retried until it confirms them;
/// they never expire.
#[tokio::test]
async fn a_refused_close_and_stop_change_are_retried_until_confirmed() {
    let mut fx = fixture("dec-close-retry", Broker::Unprotected, |_| {}).await;
    let links = fx.accounts(vec![LinkSpec::default()]).await;
    let (_, magic) = links[&2];
    let node = fx.node("a", 2).await;
    let ticket = fx.open(0.3).await;
    fx.t.copy_of("f2", magic, ticket, WAIT).await;
    fx.refuse("f2", "modify", 3, "market closed").await;
    fx.t.modify("m1", ticket, Some(1.05), Some(1.2)).await;
    fx.t.wait_copy("f2", magic, ticket, WAIT, "stops follow", |c| {
        c.is_some_and(|c| c.sl == Some(1.05) && c.tp == Some(1.2))
    })
    .await;
    fx.refuse("f2", "close", 3, "market closed").await;
    fx.t.close("m1", ticket, None).await;
    fx.t.wait_copy("f2", magic, ticket, WAIT, "closed", |c| c.is_none())
        .await;
    let closes = fx.orders("close", &format!("mc{ticket}"));
    let refused = closes.iter().filter(|l| !l.accepted).count();
    assert_eq!(refused, 3, "{closes:?}");
    assert_eq!(closes.len(), 4, "retried until closed, then nothing more");
    let modifies = fx.orders("modify", &format!("mc{ticket}"));
    assert_eq!(modifies.iter().filter(|l| l.accepted).count(), 1);
    node.shutdown();
    node.wait().await.unwrap();
}

/// Item 3: partial closes on the event path scale the copy's original volume, as reconcile does
/// (it scaled the current copy before, and two quick partial closes then disagreed with
/// reconcile by a step); with replies sent before their stream updates as well as after.
#[tokio::test]
async fn partial_closes_on_the_event_path_agree_with_reconcile_in_either_reply_order() {
    for reply_first in [false, true] {
        let mut fx = fixture("dec-partials", Broker::Unprotected, |o| {
            o.reply_first = reply_first
        })
        .await;
        let links = fx
            .accounts(vec![LinkSpec {
                lot_value: 0.33,
                ..Default::default()
            }])
            .await;
        let (_, magic) = links[&2];
        let node = fx.node("a", 2).await;
        let ticket = fx.open(1.0).await;
        let copy = fx.t.copy_of("f2", magic, ticket, WAIT).await;
        assert_eq!(copy.volume, 0.33);
        fx.t.close("m1", ticket, Some(0.5)).await;
        fx.t.close("m1", ticket, Some(0.25)).await;
        // 0.33 x 0.25 / 1.0 = 0.0825: 0.08. Scaling the current copy instead gives 0.09.
        fx.t.wait_copy("f2", magic, ticket, WAIT, "trimmed to 0.08", |c| {
            c.is_some_and(|c| (c.volume - 0.08).abs() < 1e-9)
        })
        .await;
        let trims: f64 = fx
            .orders("close", &format!("mc{ticket}"))
            .iter()
            .filter(|l| l.accepted)
            .map(|l| l.volume.unwrap())
            .sum();
        assert!(
            (trims - 0.25).abs() < 1e-9,
            "reply_first {reply_first}: trimmed {trims} in all"
        );
        node.shutdown();
        node.wait().await.unwrap();
    }
}

/// The ratio modes on unequal balances (every account had 10,000 before, so they could not be
/// told from `multiplier`), and one follower with two masters.
#[tokio::test]
async fn ratio_modes_size_by_unequal_balances_and_a_follower_copies_two_masters() {
    let mut fx = fixture("dec-ratio", Broker::Unprotected, |o| {
        o.balances = [("m1".to_string(), 20_000.0), ("f2".to_string(), 5_000.0)].into();
    })
    .await;
    let links = fx
        .accounts(vec![
            LinkSpec {
                lot_mode: "balance_ratio",
                lot_value: 1.0,
                ..Default::default()
            },
            LinkSpec {
                lot_mode: "equity_ratio",
                lot_value: 2.0,
                ..Default::default()
            },
        ])
        .await;
    // Follower 2 also copies master 9 (balance 10,000) one to one.
    add_account(&mut fx.conn, 9, "master", &fx.addr, "m9").await;
    let (_, m9_magic) = add_link(&mut fx.conn, 9, 2, LinkSpec::default()).await;
    let node = fx.node("a", 4).await;
    let ticket = fx.open(1.0).await;
    // f2: 1.0 x 5,000 / 20,000 = 0.25; f3 (10,000): 1.0 x 10,000 / 20,000 x 2 = 1.0.
    let c2 = fx.t.copy_of("f2", links[&2].1, ticket, WAIT).await;
    let c3 = fx.t.copy_of("f3", links[&3].1, ticket, WAIT).await;
    assert_eq!((c2.volume, c3.volume), (0.25, 1.0));
    let other = fx.t.open("m9", "GBPUSD", Side::Sell, 0.7, None, None).await;
    let c9 = fx.t.copy_of("f2", m9_magic, other, WAIT).await;
    assert_eq!((c9.side, c9.volume), (Side::Sell, 0.7));
    fx.t.close("m1", ticket, None).await;
    fx.t.wait_copy("f2", links[&2].1, ticket, WAIT, "closed", |c| c.is_none())
        .await;
    assert!(
        fx.t.positions("f2")
            .await
            .iter()
            .any(|p| p.ticket == c9.ticket),
        "the other master's copy stays"
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// Item 4: a live edit of an account's login (the same holds for its server, role and
/// credentials) restarts its session from the new row, without a node restart. The new login is
/// reconciled from scratch; copies held on the old login are left as they are, unmanaged.
#[tokio::test]
async fn a_changed_login_is_picked_up_live_and_the_old_logins_copies_are_left() {
    let mut fx = fixture("dec-login-edit", Broker::Unprotected, |_| {}).await;
    let links = fx.accounts(vec![LinkSpec::default()]).await;
    let (_, magic) = links[&2];
    let node = fx.node("a", 2).await;
    let ticket = fx.open(0.3).await;
    let old = fx.t.copy_of("f2", magic, ticket, WAIT).await;
    sqlx::query("UPDATE trading_accounts SET login = 'f2b' WHERE id = 2")
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let new = fx.t.copy_of("f2b", magic, ticket, WAIT).await;
    assert_eq!(new.volume, 0.3);
    fx.t.close("m1", ticket, None).await;
    fx.t.wait_copy("f2b", magic, ticket, WAIT, "closed on the new login", |c| {
        c.is_none()
    })
    .await;
    assert!(
        fx.t.positions("f2")
            .await
            .iter()
            .any(|p| p.ticket == old.ticket),
        "the old login's copy is left as it is"
    );
    let logins: Vec<String> = journal(&fx.dir.path("journal.jsonl"))
        .into_iter()
        .filter(|l| l.action == "login" && l.client == "a")
        .map(|l| l.login.clone())
        .collect();
    assert!(
        logins.iter().filter(|l| *l == "f2b").count() == 1,
        "one login to the new account: {logins:?}"
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// Writes master 1's published state directly (as its session would), optionally announcing
/// `event` as (epoch, seq): the tests below play the master's side themselves.
async fn publish_by_hand(
    conn: &mut sqlx::PgConnection,
    epoch: i64,
    seq: i64,
    positions: &[MasterPosition],
    event: Option<MasterEvent>,
) {
    sqlx::query(
        "INSERT INTO master_state (master_id, epoch, seq, positions, updated_at) VALUES (1, $1, $2, $3::jsonb, now())
         ON CONFLICT (master_id) DO UPDATE SET epoch = $1, seq = $2, positions = $3::jsonb, updated_at = now()",
    )
    .bind(epoch)
    .bind(seq)
    .bind(serde_json::to_string(positions).unwrap())
    .execute(&mut *conn)
    .await
    .unwrap();
    if let Some(event) = event {
        let notice = MasterNotice {
            master: 1,
            epoch,
            seq,
            event,
        };
        sqlx::query("SELECT pg_notify('copier_master_1', $1)")
            .bind(serde_json::to_string(&notice).unwrap())
            .execute(&mut *conn)
            .await
            .unwrap();
    }
}

fn master_position(ticket: i64, volume: f64) -> MasterPosition {
    MasterPosition {
        ticket,
        symbol: "EURUSD".into(),
        side: Side::Buy,
        volume,
        open_volume: volume,
        open_price: 1.1,
        sl: None,
        tp: None,
        magic: 0,
        // Recorded long after any link here took effect.
        first_seen_ms: Some(4_000_000_000_000),
        first_seen_us: None,
        open_time_ms: None,
        contract_size: None,
        broker_ticket: None,
    }
}

/// A follower whose master is played by the test (the master account is disabled, so no session
/// publishes for it): node `a` owns follower 2 only.
async fn hand_played_master(
    name: &str,
    reconcile_every: Option<Duration>,
) -> (Fixture, i64, NodeHandle) {
    let mut fx = fixture(name, Broker::Unprotected, |_| {}).await;
    let links = fx.accounts(vec![LinkSpec::default()]).await;
    sqlx::query("UPDATE trading_accounts SET enabled = false WHERE id = 1")
        .execute(&mut fx.conn)
        .await
        .unwrap();
    publish_by_hand(&mut fx.conn, 7, 1, &[master_position(901, 0.1)], None).await;
    let mut cfg = config(&fx.db, "a", 100, FAST);
    if let Some(every) = reconcile_every {
        cfg.reconcile_every = every;
    }
    let node = start_node(&cfg).await;
    wait_state(&node.state, "a owns the follower", WAIT, |s| {
        s.owned.len() == 1
    })
    .await;
    let magic = links[&2].1;
    fx.t.copy_of("f2", magic, 901, WAIT).await;
    (fx, magic, node)
}

/// A pure gap in one epoch's sequence (seq 3 after 1) sends the follower back to the snapshot:
/// it copies what the missed event 2 opened, not only what event 3 announces.
#[tokio::test]
async fn a_sequence_gap_on_one_epoch_reconciles_to_the_snapshot() {
    let (mut fx, magic, node) = hand_played_master("dec-gap", None).await;
    let snapshot = [
        master_position(901, 0.1),
        master_position(902, 0.2),
        master_position(903, 0.3),
    ];
    publish_by_hand(
        &mut fx.conn,
        7,
        3,
        &snapshot,
        Some(MasterEvent::Open {
            position: snapshot[2].clone(),
        }),
    )
    .await;
    fx.t.copy_of("f2", magic, 903, WAIT).await;
    let missed = fx.t.copy_of("f2", magic, 902, WAIT).await;
    assert_eq!(missed.volume, 0.2);
    node.shutdown();
    node.wait().await.unwrap();
}

/// A master's last event lost without a trace (no later event shows a gap, the LISTEN connection
/// never dropped) is repaired by the background reconcile (`reconcile_every`).
#[tokio::test]
async fn the_background_reconcile_repairs_a_lost_last_event() {
    let (mut fx, magic, node) =
        hand_played_master("dec-lost-last", Some(Duration::from_secs(2))).await;
    // Published, never announced.
    publish_by_hand(
        &mut fx.conn,
        7,
        2,
        &[master_position(901, 0.1), master_position(902, 0.2)],
        None,
    )
    .await;
    fx.t.copy_of("f2", magic, 902, WAIT).await;
    // And the lost close of 901.
    publish_by_hand(&mut fx.conn, 7, 3, &[master_position(902, 0.2)], None).await;
    fx.t.wait_copy("f2", magic, 901, WAIT, "closed", |c| c.is_none())
        .await;
    node.shutdown();
    node.wait().await.unwrap();
}

/// A stale owner (a lower epoch, or another node) publishes nothing and announces nothing, and
/// its skip and late-copy base records are refused too; the current owner's are stored.
#[tokio::test]
async fn a_stale_owners_publish_decision_and_base_writes_are_refused_without_a_notify() {
    use copier_node::db::copy::{Published, publish, record_base, record_decision};
    use sqlx::postgres::PgListener;
    let mut fx = fixture("dec-stale-writes", Broker::Unprotected, |_| {}).await;
    let links = fx.accounts(vec![LinkSpec::default()]).await;
    let link = links[&2].0;
    // The accounts' broker is unreachable: node a owns them, and its sessions stay at login.
    sqlx::query("UPDATE trading_accounts SET server = '127.0.0.1:1'")
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let node = start_node(&config(&fx.db, "a", 100, FAST)).await;
    wait_state(&node.state, "a owns both", WAIT, |s| s.owned.len() == 2).await;
    let epoch = |id: i64| {
        let owned = node.state.borrow().owned.clone();
        owned[&id]
    };
    let (master_epoch, follower_epoch) = (epoch(1), epoch(2));
    let mut listener = PgListener::connect(&fx.db.url).await.unwrap();
    listener.listen("copier_master_1").await.unwrap();
    let positions = [master_position(901, 0.1)];
    let event = MasterEvent::Open {
        position: positions[0].clone(),
    };
    let c = &mut fx.conn;
    for (who, e) in [("a", master_epoch - 1), ("b", master_epoch)] {
        let r = publish(c, who, 1, e, 1, (&positions, &[]), &event)
            .await
            .unwrap();
        assert_eq!(r, Published::Refused, "{who} at epoch {e}");
    }
    for (who, e) in [("a", follower_epoch - 1), ("b", follower_epoch)] {
        assert!(
            !record_decision(c, who, 2, e, link, 901, "close_only", "x", true)
                .await
                .unwrap(),
            "{who} at epoch {e}"
        );
        assert!(
            !record_base(c, who, 2, e, 5_001, link, 901, 0.05)
                .await
                .unwrap(),
            "{who} at epoch {e}"
        );
    }
    let stored: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM copy_skips) + (SELECT count(*) FROM copy_bases) + (SELECT count(*) FROM master_state)",
    )
    .fetch_one(&mut *c)
    .await
    .unwrap();
    assert_eq!(stored, 0, "nothing stale was stored");
    // The owner's publish is stored and announced, and it is the first notice on the channel.
    let r = publish(c, "a", 1, master_epoch, 1, (&positions, &[]), &event)
        .await
        .unwrap();
    assert!(matches!(r, Published::Stored { .. }));
    let first = tokio::time::timeout(WAIT, listener.recv())
        .await
        .unwrap()
        .unwrap();
    let notice: MasterNotice = serde_json::from_str(first.payload()).unwrap();
    assert_eq!((notice.epoch, notice.seq), (master_epoch, 1));
    assert!(
        record_decision(
            c,
            "a",
            2,
            follower_epoch,
            link,
            901,
            "close_only",
            "x",
            true
        )
        .await
        .unwrap()
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// A publish the database stored but whose outcome the master's session never learnt (here: its
/// next seq found already stored, as after a lost reply) is followed by a snapshot that keeps the
/// stored first-seen time: a position is never stamped twice (a later stamp would make followers
/// read it as younger than it is, past a link's delay limits).
#[tokio::test]
async fn a_snapshot_after_a_lost_publish_reply_keeps_the_stored_first_seen_time() {
    let mut fx = fixture("dec-first-seen-kept", Broker::Unprotected, |_| {}).await;
    fx.accounts(vec![LinkSpec::default()]).await;
    let node = fx.node("a", 2).await;
    let (epoch, seq): (i64, i64) =
        sqlx::query_as("SELECT epoch, seq FROM master_state WHERE master_id = 1")
            .fetch_one(&mut fx.conn)
            .await
            .unwrap();
    // The master's next publish as if committed with its reply lost: the position the broker is
    // about to open (its first ticket), first seen long ago.
    const SEEN: i64 = 1_700_000_000_000;
    let mut position = master_position(1_000_001, 0.4);
    position.first_seen_ms = Some(SEEN);
    publish_by_hand(&mut fx.conn, epoch, seq + 1, &[position], None).await;
    let ticket = fx.open(0.4).await;
    assert_eq!(ticket, 1_000_001, "the broker's first ticket");
    // The session's own publish of seq + 1 is refused: it re-reads, then publishes a snapshot.
    let conn = &mut fx.conn;
    eventually(
        "the master's snapshot after the stored seq",
        WAIT,
        async || {
            let stored: i64 =
                sqlx::query_scalar("SELECT seq FROM master_state WHERE master_id = 1")
                    .fetch_one(&mut *conn)
                    .await
                    .unwrap();
            (stored > seq + 1).then_some(())
        },
    )
    .await;
    let stored: Option<i64> = sqlx::query_scalar(
        "SELECT (positions -> 0 ->> 'first_seen_ms')::bigint FROM master_state WHERE master_id = 1",
    )
    .fetch_one(&mut fx.conn)
    .await
    .unwrap();
    assert_eq!(
        stored,
        Some(SEEN),
        "the snapshot kept the stored first-seen time"
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// A publish stamps what goes out without a first-seen time with the database's clock, once:
/// the stored snapshot (positions and orders) and the announced open event carry the same stamp,
/// which the outcome reports; a first-seen time already there is kept; a JSON string holding the
/// stamp's key text is left as it is; the snapshot is stored in ticket order whatever order it
/// was handed in. Read from the stored JSON and the NOTIFY payload, not through the product. The
/// notice a master hands its own node's followers (`announced`) is the one its NOTIFY carries,
/// for an open and a new pending order.
#[tokio::test]
async fn a_publish_stamps_what_it_first_records_with_the_database_clock_once() {
    use copier_node::broker::types::PendingKind;
    use copier_node::copier::MasterOrder;
    use copier_node::db::copy::{Published, announced, publish, stamp_first_seen};
    use sqlx::postgres::PgListener;

    let db = crate::support::pg::TestDb::new().await;
    let mut conn = db.conn().await;
    add_account(&mut conn, 1, "master", "broker:1", "m1").await;
    crate::support::insert_node(&mut conn, "n1", "1 minute", 1).await;
    sqlx::query(
        "UPDATE trading_accounts SET node_id = 'n1', owner_epoch = 3, lease_until = now() + interval '1 minute'",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen("copier_master_1").await.unwrap();
    const SEEN: i64 = 1_700_000_000_000;
    let tricky = r#"X"first_seen_ms":null"#;
    let mut new = master_position(5, 0.1);
    new.first_seen_ms = None;
    new.symbol = tricky.into();
    let known = master_position(7, 0.2);
    let known = MasterPosition {
        first_seen_ms: Some(SEEN),
        first_seen_us: None,
        ..known
    };
    let order = MasterOrder {
        ticket: 9,
        symbol: "EURUSD".into(),
        side: Side::Sell,
        kind: PendingKind::Limit,
        price: 1.2,
        volume: 0.3,
        sl: None,
        tp: None,
        expiry_ms: None,
        expiry_utc_ms: None,
        magic: 0,
        first_seen_ms: None,
        first_seen_us: None,
        contract_size: None,
    };
    let clock = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint";
    let before: i64 = sqlx::query_scalar(clock)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    // Handed in out of ticket order.
    let mut positions = vec![known.clone(), new.clone()];
    let mut orders = vec![order.clone()];
    let event = MasterEvent::Open {
        position: new.clone(),
    };
    let outcome = publish(&mut conn, "n1", 1, 3, 1, (&positions, &orders), &event)
        .await
        .unwrap();
    let after: i64 = sqlx::query_scalar(clock)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let Published::Stored { first_seen } = outcome else {
        panic!("the owner's publish was refused: {outcome:?}");
    };
    let (stamp, stamp_us) = (first_seen.ms, first_seen.us);
    assert!(
        (before..=after).contains(&stamp),
        "stamped {stamp}, the database's clock read {before}..{after}"
    );
    assert!(
        (stamp * 1000 - stamp_us).abs() <= 500,
        "the µs stamp {stamp_us} is the ms stamp {stamp}'s instant"
    );
    let stored_us: (Option<i64>, Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT (positions -> 0 ->> 'first_seen_us')::bigint, (positions -> 1 ->> 'first_seen_us')::bigint, \
                (orders -> 0 ->> 'first_seen_us')::bigint FROM master_state WHERE master_id = 1",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        stored_us,
        (Some(stamp_us), None, Some(stamp_us)),
        "the new position and order stamped in µs too, the known one left without"
    );
    let stored: (i64, Option<i64>, String, i64, Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT (positions -> 0 ->> 'ticket')::bigint, (positions -> 0 ->> 'first_seen_ms')::bigint, \
                positions -> 0 ->> 'symbol', (positions -> 1 ->> 'ticket')::bigint, \
                (positions -> 1 ->> 'first_seen_ms')::bigint, (orders -> 0 ->> 'first_seen_ms')::bigint \
           FROM master_state WHERE master_id = 1",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        stored,
        (
            5,
            Some(stamp),
            tricky.to_string(),
            7,
            Some(SEEN),
            Some(stamp)
        ),
        "stored in ticket order; the new position and order stamped, the known one kept, the string untouched"
    );
    let notice = tokio::time::timeout(WAIT, listener.recv())
        .await
        .unwrap()
        .unwrap();
    let notice: serde_json::Value = serde_json::from_str(notice.payload()).unwrap();
    assert_eq!(notice["position"]["first_seen_ms"], stamp, "{notice}");
    assert_eq!(notice["position"]["first_seen_us"], stamp_us, "{notice}");
    assert_eq!(notice["position"]["symbol"], tricky, "{notice}");
    assert_eq!(
        announced(1, (3, 1), event.clone(), first_seen),
        serde_json::from_value::<MasterNotice>(notice.clone()).unwrap(),
        "the open as its master's node delivers it and as announced"
    );
    // The caller's copy of what was stored, stamped the same way; the next publish stamps nothing.
    stamp_first_seen(first_seen, &mut positions, &mut orders);
    assert_eq!(
        (
            positions[1].first_seen_ms,
            positions[0].first_seen_ms,
            orders[0].first_seen_ms
        ),
        (Some(stamp), Some(SEEN), Some(stamp))
    );
    assert_eq!(
        (
            positions[1].first_seen_us,
            positions[0].first_seen_us,
            orders[0].first_seen_us
        ),
        (Some(stamp_us), None, Some(stamp_us)),
        "the known position keeps its time, and gains no µs one"
    );
    let c = &mut conn;
    eventually("the database's clock moves on", WAIT, async || {
        let now: i64 = sqlx::query_scalar(clock).fetch_one(&mut *c).await.unwrap();
        (now > stamp).then_some(())
    })
    .await;
    let outcome = publish(
        &mut conn,
        "n1",
        1,
        3,
        2,
        (&positions, &orders),
        &MasterEvent::Snapshot,
    )
    .await
    .unwrap();
    assert!(matches!(outcome, Published::Stored { .. }), "{outcome:?}");
    let again: (Option<i64>, Option<i64>) = sqlx::query_as(
        "SELECT (positions -> 0 ->> 'first_seen_ms')::bigint, (orders -> 0 ->> 'first_seen_ms')::bigint \
           FROM master_state WHERE master_id = 1",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(again, (Some(stamp), Some(stamp)), "stamped once");
    // A new pending order's event.
    let placed = MasterOrder {
        ticket: 11,
        ..order.clone()
    };
    orders.push(placed.clone());
    let event = MasterEvent::OrderSet { order: placed };
    let outcome = publish(&mut conn, "n1", 1, 3, 3, (&positions, &orders), &event)
        .await
        .unwrap();
    let Published::Stored { first_seen } = outcome else {
        panic!("the owner's publish was refused: {outcome:?}");
    };
    let mut payloads = Vec::new();
    while payloads.len() < 2 {
        let n = tokio::time::timeout(WAIT, listener.recv())
            .await
            .unwrap()
            .unwrap();
        payloads.push(n.payload().to_string());
    }
    let heard: MasterNotice = serde_json::from_str(&payloads[1]).unwrap();
    assert_eq!(
        (heard.seq, heard.event.kind()),
        (3, "order_set"),
        "{payloads:?}"
    );
    assert_eq!(
        announced(1, (3, 3), event, first_seen),
        heard,
        "the new order as its master's node delivers it and as announced"
    );
}

/// The node's master publisher (one statement and one commit per batch): events published at
/// once by many masters are each fenced by their own master's (node, epoch), stored only if their
/// (epoch, seq) follows, announced on their own channel only if stored, and share commits; the
/// same master twice in one batch is published in turn.
#[tokio::test]
async fn events_published_at_once_by_many_masters_are_each_fenced_and_announced_once() {
    use copier_node::db::copy::{MasterPublisher, PublishWrite, Published};
    use sqlx::postgres::PgListener;

    let db = crate::support::pg::TestDb::new().await;
    let mut conn = db.conn().await;
    for id in 1..=20 {
        crate::support::add_account(&mut conn, id, "master", "broker:1", &format!("m{id}")).await;
    }
    // Masters owned by node n1 at epoch 7; master 20 since at epoch 8 (its old owner is stale);
    // master 19 has published up to (7, 5).
    crate::support::insert_node(&mut conn, "n1", "1 minute", 20).await;
    sqlx::query(
        "UPDATE trading_accounts SET node_id = 'n1', owner_epoch = CASE WHEN id = 20 THEN 8 ELSE 7 END, \
         lease_until = now() + interval '1 minute'",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO master_state (master_id, epoch, seq, positions, orders, updated_at, timeline) \
         VALUES (19, 7, 5, '[]', '[]', now(), copier_timeline())",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    let channels: Vec<String> = (1..=20).map(|m| format!("copier_master_{m}")).collect();
    listener
        .listen_all(channels.iter().map(String::as_str))
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let publisher = MasterPublisher::spawn(copier_node::db::Db::direct(pool));
    let write = |master: i64, epoch: i64, seq: i64| {
        let positions = [master_position(master * 100, 0.1)];
        let event = MasterEvent::Open {
            position: positions[0].clone(),
        };
        PublishWrite::new("n1", master, (epoch, seq), (&positions, &[]), &event)
    };
    // Masters 1..=18 publish seq 1; 19 skips a seq, then publishes the next; 20's stale owner
    // publishes; master 1's event twice.
    let mut jobs: Vec<PublishWrite> = (1..=18).map(|m| write(m, 7, 1)).collect();
    jobs.push(write(19, 7, 7));
    jobs.push(write(19, 7, 6));
    jobs.push(write(20, 7, 1));
    jobs.push(write(1, 7, 1));
    let stored: Vec<bool> = crate::support::write_at_once(&publisher, jobs)
        .await
        .into_iter()
        .map(|r| matches!(r.unwrap(), Published::Stored { .. }))
        .collect();
    let mut expected = vec![true; 18];
    expected.extend([false, true, false, false]);
    assert_eq!(stored, expected);
    // One notice per stored event, on its master's channel, with its (epoch, seq).
    let mut notices = Vec::new();
    while notices.len() < 19 {
        let n = tokio::time::timeout(WAIT, listener.recv())
            .await
            .expect("a notice per stored event")
            .unwrap();
        let notice: MasterNotice = serde_json::from_str(n.payload()).unwrap();
        assert_eq!(n.channel(), format!("copier_master_{}", notice.master));
        notices.push((notice.master, notice.epoch, notice.seq));
    }
    notices.sort();
    let mut want: Vec<(i64, i64, i64)> = (1..=18).map(|m| (m, 7, 1)).collect();
    want.push((19, 7, 6));
    assert_eq!(notices, want);
    // And nothing else: a last event on master 1's channel is the next one received.
    sqlx::query("SELECT pg_notify('copier_master_1', '{}')")
        .execute(&mut conn)
        .await
        .unwrap();
    let last = tokio::time::timeout(WAIT, listener.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(last.payload(), "{}", "no notice for a refused event");
    let (states, commits): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT updated_at) FROM master_state")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(states, 19);
    assert!(
        commits < states,
        "events published at once share commits: {commits} commits for {states} events"
    );
}

/// A link row whose settings do not parse is reported with its id on the follower's status and
/// ignored; the follower's other links copy. A role outside master/follower cannot be stored.
#[tokio::test]
async fn a_malformed_link_is_reported_and_the_others_copy_and_a_bad_role_is_refused() {
    let mut fx = fixture("dec-malformed", Broker::Unprotected, |_| {}).await;
    let links = fx.accounts(vec![LinkSpec::default()]).await;
    add_account(&mut fx.conn, 9, "master", &fx.addr, "m9").await;
    let (bad, _) = add_link(&mut fx.conn, 9, 2, LinkSpec::default()).await;
    sqlx::query(r#"UPDATE copy_links SET symbol_map = '{"EURUSD": 5}' WHERE id = $1"#)
        .bind(bad)
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let node = start_node(&config(&fx.db, "a", 100, FAST)).await;
    wait_state(&node.state, "a owns all", WAIT, |s| s.owned.len() == 3).await;
    let ticket = fx.open(0.3).await;
    fx.t.copy_of("f2", links[&2].1, ticket, WAIT).await;
    let conn = &mut fx.conn;
    let status: String = eventually("the bad link reported", WAIT, async || {
        let s: Option<String> = sqlx::query_scalar(
            "SELECT status FROM trading_accounts WHERE id = 2 AND status LIKE 'error:%'",
        )
        .fetch_optional(&mut *conn)
        .await
        .unwrap();
        s
    })
    .await;
    assert!(
        status.contains(&format!("copy link {bad}")) && status.contains("symbol_map"),
        "{status}"
    );
    // Mended, the link copies and the error goes.
    sqlx::query(r#"UPDATE copy_links SET symbol_map = '{}' WHERE id = $1"#)
        .bind(bad)
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let conn = &mut fx.conn;
    eventually("the error cleared", WAIT, async || {
        let s: String = sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = 2")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        (!s.starts_with("error:")).then_some(())
    })
    .await;
    let err = sqlx::query("UPDATE trading_accounts SET role = 'slave' WHERE id = 2")
        .execute(&mut fx.conn)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("check constraint"), "{err}");
    node.shutdown();
    node.wait().await.unwrap();
}

/// Issue 21, market hours: the follower's server trades XAUUSD in sessions (the master's server
/// around the clock). An open outside them is retried within the link's `max_delay_ms` and then
/// recorded as expired (`too_late`), never sent once the market opens; a close outside them is
/// queued and sent when the market opens: never dropped.
#[tokio::test]
async fn market_hours_expire_a_late_open_and_queue_a_close_until_the_market_opens() {
    use copier_node::sim_broker::market::Sessions;
    use copier_node::sim_broker::server::SimBroker;
    let mut fx = fixture("dec-hours", Broker::Unprotected, |_| {}).await;
    // The follower's server: XAUUSD's one session starts two hours from now, so it is closed now.
    let minute = (copier_node::wall_clock::unix_ms().rem_euclid(86_400_000) / 60_000) as u32;
    let (start, end) = ((minute + 120) % 1440, (minute + 180) % 1440);
    let session = format!(
        "{:02}:{:02}-{:02}:{:02}",
        start / 60,
        start % 60,
        end / 60,
        end % 60
    );
    let mut options = ServeOptions::new("127.0.0.1:0", fx.dir.path("journal-f.jsonl"));
    options.fence_check = false;
    options.dedupe = false;
    options
        .sessions
        .insert("XAUUSD".into(), Sessions::parse(&session).unwrap());
    let follower_broker = SimBroker::start(options).await.unwrap();
    let f_addr = follower_broker.addr.to_string();
    add_account(&mut fx.conn, 1, "master", &fx.addr, "m1").await;
    add_account(&mut fx.conn, 2, "follower", &f_addr, "f2").await;
    let (link, magic) = add_link(&mut fx.conn, 1, 2, LinkSpec::default()).await;
    sqlx::query("UPDATE copy_links SET max_delay_ms = 3000 WHERE id = $1")
        .bind(link)
        .execute(&mut fx.conn)
        .await
        .unwrap();
    let node = fx.node("a", 2).await;
    let follower = crate::support::Trader {
        addr: f_addr.clone(),
    };
    let f_path = fx.dir.path("journal-f.jsonl");
    let f_journal = || journal(&f_path);

    // EURUSD trades: copied at once.
    let eur = fx.open(0.1).await;
    follower.copy_of("f2", magic, eur, WAIT).await;
    // XAUUSD outside its session: refused as market closed, retried, then expired.
    let late = fx.t.open("m1", "XAUUSD", Side::Buy, 0.1, None, None).await;
    fx.wait_decision(link, late, "too_late", true).await;
    let refused: Vec<JournalEntry> = f_journal()
        .into_iter()
        .filter(|l| l.action == "open" && l.comment.as_deref() == Some(&format!("mc{late}")))
        .collect();
    assert!(
        refused.len() >= 2
            && refused.iter().all(|l| !l.accepted
                && l.reason
                    .as_deref()
                    .is_some_and(|r| r.starts_with("market closed"))),
        "retried while the market was closed, each refused: {refused:?}"
    );

    // The market opens (the broker's switch): a new XAUUSD trade is copied, the expired one
    // never is.
    tools::set_market(&f_addr, "XAUUSD", Some(true))
        .await
        .unwrap();
    let gold = fx.t.open("m1", "XAUUSD", Side::Buy, 0.2, None, None).await;
    follower.copy_of("f2", magic, gold, WAIT).await;
    // It closes again; the master closes its position: the copy's close is queued.
    tools::set_market(&f_addr, "XAUUSD", Some(false))
        .await
        .unwrap();
    fx.t.close("m1", gold, None).await;
    let refused_closes = || -> Vec<i64> {
        f_journal()
            .into_iter()
            .filter(|l| {
                l.action == "close"
                    && l.comment.as_deref() == Some(&format!("mc{gold}"))
                    && !l.accepted
            })
            .map(|l| l.ts_ms)
            .collect()
    };
    // Nine refusals: the follower's backoff (250 ms doubling) would wait 8 s, then 16 s between
    // the last tries; a queued close is tried at least every 5 s (retry::MARKET_CLOSED), so it
    // goes out within seconds of the market opening, however long it was closed.
    let tries = eventually(
        "the copy's close refused nine times (market closed)",
        Duration::from_secs(90),
        async || Some(refused_closes()).filter(|t| t.len() >= 9),
    )
    .await;
    let longest = tries.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(
        longest < 10_000,
        "a queued close waited {longest} ms between tries (at most 5 s plus scheduling): {tries:?}"
    );
    assert!(
        follower
            .positions("f2")
            .await
            .iter()
            .any(|p| p.comment == format!("mc{gold}")),
        "the copy stays open while the market is closed"
    );
    // Back to its sessions: still closed. Then the market opens: the queued close goes out.
    tools::set_market(&f_addr, "XAUUSD", None).await.unwrap();
    tools::set_market(&f_addr, "XAUUSD", Some(true))
        .await
        .unwrap();
    follower
        .wait_copy(
            "f2",
            magic,
            gold,
            WAIT,
            "closed once the market opened",
            |c| c.is_none(),
        )
        .await;
    let journal = f_journal();
    let accepted = |action: &str, ticket: i64| {
        journal
            .iter()
            .filter(|l| {
                l.action == action
                    && l.accepted
                    && l.comment.as_deref() == Some(&format!("mc{ticket}"))
            })
            .count()
    };
    assert_eq!(
        accepted("open", late),
        0,
        "the expired open was never executed"
    );
    assert_eq!((accepted("open", gold), accepted("close", gold)), (1, 1));
    assert_eq!(accepted("open", eur), 1);
    node.shutdown();
    node.wait().await.unwrap();
    follower_broker.stop().await;
}

/// Issue 21, risk limits: two followers of one master, each with a lifetime equity drawdown limit
/// of 5 % (lifetime, so the test holds across midnight; periods are rule tests): f2's closes
/// every copy, f3's is close-only. A price move costs each 10 %: f2's copy is closed by its node,
/// f3's stays and follows the master; neither copies anything new (final `risk_limit`). The
/// price comes back, so f3's equity is whole again: a node taking f3 over still holds, from the
/// stored hit alone. An operator's reset lets new copies through again.
#[tokio::test]
async fn a_reached_drawdown_limit_closes_the_copies_and_holds_across_owners_until_reset() {
    let mut fx = fixture("dec-risk", Broker::Unprotected, |_| {}).await;
    let links = fx
        .accounts(vec![LinkSpec::default(), LinkSpec::default()])
        .await;
    let ((link2, magic2), (link3, magic3)) = (links[&2], links[&3]);
    sqlx::query(
        "INSERT INTO risk_limits (account_id, period, basis, relative, amount, action)
         VALUES (2, 'lifetime', 'equity', true, 5, 'close_all'),
                (3, 'lifetime', 'equity', true, 5, 'close_only')",
    )
    .execute(&mut fx.conn)
    .await
    .unwrap();
    let node = fx.node("a", 3).await;
    let state =
        async |fx: &mut Fixture, account: i64| -> (Option<String>, Option<f64>, Option<String>) {
            sqlx::query_as(
                "SELECT period_key, start_value, hit_reason FROM risk_limits WHERE account_id = $1",
            )
            .bind(account)
            .fetch_one(&mut fx.conn)
            .await
            .unwrap()
        };
    // The first reading started each period at the follower's equity.
    for account in [2, 3] {
        let started = eventually("the limit's period started", WAIT, async || {
            let (key, start, _) = state(&mut fx, account).await;
            key.zip(start)
        })
        .await;
        assert_eq!(started, ("lifetime".to_string(), 10_000.0));
    }
    let first = fx.open(1.0).await;
    fx.t.copy_of("f2", magic2, first, WAIT).await;
    fx.t.copy_of("f3", magic3, first, WAIT).await;
    // EURUSD falls 100 pips: 1,000 lost on one lot, 10 % of each follower's equity.
    tools::set_price(&fx.addr, "EURUSD", 1.09).await.unwrap();
    fx.t.wait_copy("f2", magic2, first, WAIT, "closed by the risk limit", |c| {
        c.is_none()
    })
    .await;
    for account in [2, 3] {
        let reason = eventually("the hit stored", WAIT, async || {
            state(&mut fx, account).await.2
        })
        .await;
        assert!(
            reason.contains("lifetime equity drawdown 1000.00 from 10000.00"),
            "{reason}"
        );
    }
    assert_eq!(
        fx.orders("close", &format!("mc{first}")).len(),
        1,
        "only f2's copy is closed"
    );
    assert!(
        fx.t.positions("m1").await.iter().any(|p| p.ticket == first),
        "the master's position is untouched"
    );
    // Nothing new while they hold.
    let second = fx.open(0.5).await;
    fx.wait_decision(link2, second, "risk_limit", true).await;
    fx.wait_decision(link3, second, "risk_limit", true).await;

    // The price comes back: f3's equity is 10,000 again (its copy stayed open). Another node
    // takes the followers over and still holds f3, from the stored hit alone.
    node.shutdown();
    node.wait().await.unwrap();
    tools::set_price(&fx.addr, "EURUSD", 1.1).await.unwrap();
    let node = fx.node("b", 3).await;
    let third = fx.open(0.3).await;
    fx.wait_decision(link3, third, "risk_limit", true).await;
    let decided_by: String = sqlx::query_scalar(
        "SELECT node_id FROM copy_skips WHERE link_id = $1 AND master_ticket = $2",
    )
    .bind(link3)
    .bind(third)
    .fetch_one(&mut fx.conn)
    .await
    .unwrap();
    assert_eq!(decided_by, "b");
    // The close-only follower's copy still follows the master.
    fx.t.close("m1", first, None).await;
    fx.t.wait_copy("f3", magic3, first, WAIT, "closed with the master", |c| {
        c.is_none()
    })
    .await;

    // The operator resets f3's limit (as `copier-node risk reset` does): new copies resume, from
    // a new starting value.
    sqlx::query(
        "UPDATE risk_limits SET period_key = NULL, start_value = NULL, hit_at = NULL, hit_reason = NULL WHERE account_id = 3",
    )
    .execute(&mut fx.conn)
    .await
    .unwrap();
    eventually("f3's limit started again", WAIT, async || {
        let (key, start, hit) = state(&mut fx, 3).await;
        (key.is_some() && start.is_some() && hit.is_none()).then_some(())
    })
    .await;
    let fourth = fx.open(0.2).await;
    fx.t.copy_of("f3", magic3, fourth, WAIT).await;
    fx.wait_decision(link2, fourth, "risk_limit", true).await;
    for t in [second, third] {
        assert!(
            fx.orders("open", &format!("mc{t}")).is_empty(),
            "a position opened during the hold is never copied"
        );
    }
    let closes: Vec<_> = fx
        .orders("close", &format!("mc{first}"))
        .into_iter()
        .filter(|l| l.accepted)
        .map(|l| (l.login, l.client))
        .collect();
    assert_eq!(
        closes,
        vec![
            ("f2".to_string(), "a".to_string()),
            ("f3".to_string(), "b".to_string())
        ],
        "each copy closed once: f2's by the limit, f3's with the master"
    );
    node.shutdown();
    node.wait().await.unwrap();
}

/// Every read of the broker takes [`OLDER_READ`] in the tests of older readings.
const OLDER_READ: Duration = Duration::from_secs(5);

/// A follower whose periodic reading (every five seconds with risk limits) is outrun by an inline
/// one, judged from the broker's journal, with the node that owns it. Every read takes
/// [`OLDER_READ`] and is answered as of its request, as a real trade server answers (and is
/// journaled then); the broker's protections are off. With the follower's limits `limits`
/// (`risk_limits` rows of account 2) and its copy of a one-lot master position open, EURUSD falls
/// 100 pips (10 % of the follower's equity) until a periodic reading is asked (`dip`), then comes
/// back at once, and `outrun` makes the follower read its figures inline (whole again) before
/// the dip's reading answers: checked from the journal.
struct OlderReading {
    fx: Fixture,
    node: NodeHandle,
    journal: std::path::PathBuf,
    dip: JournalEntry,
}

/// What makes the follower read its figures inline.
enum Outrun {
    /// The master opens a position: the follower reads before its new copy.
    Trade,
    /// An operator's statement changing the limits: the follower reads to judge them at once.
    Operator(&'static str),
}

impl OlderReading {
    async fn start(name: &str, limits: &str, outrun: Outrun) -> OlderReading {
        let mut fx = fixture(name, Broker::Unprotected, |o| {
            o.journal_reads = true;
            o.reads_as_of_request = true;
        })
        .await;
        let links = fx.accounts(vec![LinkSpec::default()]).await;
        let (_, magic) = links[&2];
        sqlx::query(&format!(
            "INSERT INTO risk_limits (account_id, period, basis, relative, amount, action) VALUES {limits}"
        ))
        .execute(&mut fx.conn)
        .await
        .unwrap();
        let node = fx.node("a", 2).await;
        let ticket = fx.open(1.0).await;
        fx.t.copy_of("f2", magic, ticket, WAIT).await;
        let started: Vec<Option<f64>> =
            sqlx::query_scalar("SELECT start_value FROM risk_limits WHERE account_id = 2")
                .fetch_all(&mut fx.conn)
                .await
                .unwrap();
        assert!(
            started.iter().all(|s| *s == Some(10_000.0)),
            "every limit's period started at the opening balance: {started:?}"
        );

        let journal = fx.dir.path("journal.jsonl");
        fx.broker.set_read_delay(OLDER_READ);
        tools::set_price(&fx.addr, "EURUSD", 1.09).await.unwrap();
        let before = Self::readings_in(&journal).len();
        let dip = eventually(
            "a reading of the follower's figures asked in the dip",
            Duration::from_secs(30),
            async || Self::readings_in(&journal).get(before).cloned(),
        )
        .await;
        tools::set_price(&fx.addr, "EURUSD", 1.1).await.unwrap();
        match outrun {
            Outrun::Trade => {
                fx.open(0.1).await;
            }
            Outrun::Operator(sql) => {
                sqlx::query(sql).execute(&mut fx.conn).await.unwrap();
            }
        }
        let inline = eventually(
            "the follower's inline reading",
            Duration::from_secs(30),
            async || Self::readings_in(&journal).get(before + 1).cloned(),
        )
        .await;
        assert!(
            inline.ts_ms < dip.ts_ms + OLDER_READ.as_millis() as i64,
            "the next reading ({inline:?}) was asked after the dip's answered ({dip:?}): the test \
             did not outrun it"
        );
        OlderReading {
            fx,
            node,
            journal,
            dip,
        }
    }

    /// The node's readings of the follower's figures, in the order they were asked.
    fn readings_in(journal: &std::path::Path) -> Vec<JournalEntry> {
        crate::support::broker::journal(journal)
            .into_iter()
            .filter(|l| l.login == "f2" && l.client == "a" && l.action == "account")
            .collect()
    }

    /// The follower's accepted closes, from the journal.
    fn closes(&self) -> Vec<JournalEntry> {
        journal(&self.journal)
            .into_iter()
            .filter(|l| l.login == "f2" && l.action == "close" && l.accepted)
            .collect()
    }

    async fn stop(self) {
        self.fx.broker.set_read_delay(Duration::ZERO);
        self.node.shutdown();
        self.node.wait().await.unwrap();
    }
}

/// The dip happened, though a newer reading was taken since (the master opened a position; the
/// follower read before copying it): it reaches the follower's `close_all` limit of 5 %, and
/// both copies are closed, once each (judged from the journal). Its figures are no longer the
/// account's: the equity the node reports in `trading_accounts` never shows the dip, up to the
/// answer of a reading asked after the first close. Fails when the older reading is dropped (no
/// close) and when it is taken as the account's figures (the dip reported after the close).
#[tokio::test]
async fn a_followers_reading_outrun_by_a_newer_one_counts_its_drawdown_but_not_its_figures() {
    let mut r = OlderReading::start(
        "dec-risk-older-reading",
        "(2, 'lifetime', 'equity', true, 5, 'close_all')",
        Outrun::Trade,
    )
    .await;
    let floor = 10_000.0 * 0.95;
    // The equity the node reports, watched until a reading asked after the copy's close has
    // answered (and the status writer's batch had time to land).
    let mut lowest = f64::INFINITY;
    let mut watched_until: Option<i64> = None;
    let give_up = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            tokio::time::Instant::now() < give_up,
            "the follower's copy was not closed by its limit (a drawdown its older reading saw)"
        );
        let equity: Option<f64> =
            sqlx::query_scalar("SELECT equity FROM trading_accounts WHERE id = 2")
                .fetch_one(&mut r.fx.conn)
                .await
                .unwrap();
        lowest = lowest.min(equity.unwrap_or(f64::INFINITY));
        if watched_until.is_none()
            && let Some(close) = r.closes().first()
        {
            watched_until = OlderReading::readings_in(&r.journal)
                .iter()
                .find(|l| l.ts_ms > close.ts_ms)
                .map(|l| l.ts_ms + OLDER_READ.as_millis() as i64 + 1_000);
        }
        if watched_until.is_some_and(|end| copier_node::wall_clock::unix_ms() > end) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closes: Vec<i64> = r.closes().iter().filter_map(|l| l.ticket).collect();
    let distinct: std::collections::BTreeSet<i64> = closes.iter().copied().collect();
    assert_eq!(
        (closes.len(), distinct.len()),
        (2, 2),
        "both copies closed once by the limit: {closes:?}"
    );
    assert!(r.fx.t.positions("f2").await.is_empty(), "no copy left open");
    assert!(
        lowest >= floor,
        "the node reported the dip's equity {lowest} (below {floor}) from a reading older than \
         one it had taken"
    );
    r.stop().await;
}

/// What an older reading saw before a limit existed does not count toward it: the operator adds
/// the `close_all` limit of 5 % after the dip's reading was asked (the follower has a limit out
/// of reach before), and its period starts at the inline reading. The dip's reading answers, and
/// the session's next periodic reading (asked only once that one was judged) is asked: the copy
/// is still open, never closed (judged from the journal). Fails when an older reading is judged
/// against limits or periods newer than it (the copy closed).
#[tokio::test]
async fn a_followers_older_reading_counts_nothing_toward_a_limit_added_since() {
    let r = OlderReading::start(
        "dec-risk-older-reading-new-limit",
        "(2, 'lifetime', 'balance', true, 90, 'close_only')",
        Outrun::Operator(
            "INSERT INTO risk_limits (account_id, period, basis, relative, amount, action)
             VALUES (2, 'lifetime', 'equity', true, 5, 'close_all')",
        ),
    )
    .await;
    let dip = r.dip.clone();
    eventually(
        "a periodic reading asked after the dip's was judged",
        Duration::from_secs(60),
        async || {
            OlderReading::readings_in(&r.journal)
                .iter()
                .filter(|l| l.ts_ms > dip.ts_ms)
                .nth(1)
                .cloned()
        },
    )
    .await;
    assert_eq!(
        r.closes(),
        Vec::<JournalEntry>::new(),
        "the follower's copy was closed by a limit added after the reading that saw the dip"
    );
    assert!(
        r.fx.t.positions("f2").await.iter().any(|p| p.volume == 1.0),
        "the copy is open"
    );
    r.stop().await;
}

/// Master and follower on one server (one price): the master's pending order is copied as a
/// pending order, and the price reaching it fills both at once. The copy is the pending copy's
/// fill: the master's fill (published with its order gone in the same event) neither closes it
/// nor adds a copy at market.
#[tokio::test]
async fn a_pending_order_filling_on_both_sides_at_once_is_copied_once() {
    use copier_node::broker::types::{PendingKind, PlaceOrder};
    let mut fx = fixture("dec-pending-both", Broker::Unprotected, |_| {}).await;
    let links = fx.accounts(vec![LinkSpec::default()]).await;
    let (_, magic) = links[&2];
    let node = fx.node("a", 2).await;
    let ticket = tools::trade(
        &fx.addr,
        "m1",
        HandOrder::Place(PlaceOrder {
            tp: Some(1.12),
            ..crate::support::pending_order("EURUSD", Side::Buy, PendingKind::Limit, 1.095, 0.4)
        }),
    )
    .await
    .unwrap()
    .expect("a placed order's ticket");
    let marker = format!("mc{ticket}");
    eventually("the pending copy", WAIT, async || {
        let orders = tools::orders(&fx.addr, "f2").await.ok()?;
        orders.iter().any(|o| o.comment == marker).then_some(())
    })
    .await;
    // The price comes down to it: both fill.
    tools::set_price(&fx.addr, "EURUSD", 1.094).await.unwrap();
    let copy = fx.t.copy_of("f2", magic, ticket, WAIT).await;
    assert_eq!((copy.volume, copy.tp), (0.4, Some(1.12)));
    // Settled: a market trade after it is copied (so every event before it was handled), and
    // the fill's copy is still the one copy.
    let market = fx.open(0.1).await;
    fx.t.copy_of("f2", magic, market, WAIT).await;
    let copies: Vec<_> =
        fx.t.positions("f2")
            .await
            .into_iter()
            .filter(|p| p.comment == marker)
            .collect();
    assert_eq!(copies.len(), 1, "{copies:?}");
    assert_eq!(
        copies[0].ticket, copy.ticket,
        "never closed and copied again"
    );
    assert_eq!(
        (
            fx.orders("place", &marker).len(),
            fx.orders("open", &marker).len(),
            fx.orders("close", &marker).len()
        ),
        (1, 0, 0),
        "one pending copy, no order at market, nothing closed"
    );
    node.shutdown();
    node.wait().await.unwrap();
}
