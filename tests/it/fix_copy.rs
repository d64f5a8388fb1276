//! The FIX adapter end to end: nodes in-process trading on the QuickFIX venue (and, mixed, on
//! the simulated broker), judged from the venue's journal and positions.

use std::time::Duration;

use copier_node::credentials::CredentialsKey;
use copier_node::sim_broker::journal::JournalEntry;
use sqlx::PgConnection;

use crate::support::broker::journal;
use crate::support::fix::{FixVenue, VenueAccount};
use crate::support::fixture::CopySetup;
use crate::support::{FAST, LinkSpec, add_account, add_link, config, eventually, start_node};

const WAIT: Duration = Duration::from_secs(30);

/// How the venue answers RequestForPositions. Every scenario here runs against both
/// (`in_both_position_modes!`): a venue that acknowledges first, and one that sends the reports
/// alone, as cTrader's FIX API does.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Positions {
    /// RequestForPositionsAck (AO) first, with the count.
    Acknowledged,
    /// PositionReports alone, each carrying the count, or one report saying there are none
    /// (`fault no_ao`).
    Unacknowledged,
}

impl Positions {
    /// Sets the venue to answer this way.
    fn apply(self, v: &FixVenue) {
        if self == Positions::Unacknowledged {
            assert_eq!(v.control("fault no_ao on"), "ok");
        }
    }
}

/// Scenario `$name(positions)` as two tests, `$name::with_the_ack` and `$name::without_the_ack`.
macro_rules! in_both_position_modes {
    ($name:ident) => {
        mod $name {
            use crate::fix_copy::Positions;

            #[tokio::test]
            async fn with_the_ack() {
                super::$name(Positions::Acknowledged).await;
            }

            #[tokio::test]
            async fn without_the_ack() {
                super::$name(Positions::Unacknowledged).await;
            }
        }
    };
}

mod handoff;
mod pending;

/// The venue with these accounts (no passwords), in the test's scratch directory, answering
/// positions requests as `positions` says.
fn venue(s: &CopySetup, logins: &[&str], positions: Positions) -> FixVenue {
    let accounts: Vec<VenueAccount<'_>> = logins
        .iter()
        .map(|login| VenueAccount {
            login,
            password: "",
        })
        .collect();
    let v = FixVenue::start(&s.dir.0, &accounts);
    positions.apply(&v);
    v
}

fn server(v: &FixVenue, extra: &str) -> String {
    format!(
        "fix://127.0.0.1:{}?target={}&heartbeat=1{extra}",
        v.port, v.comp_id
    )
}

/// The venue's positions of `login`: (ticket, symbol, side, lots).
fn venue_positions(v: &FixVenue, login: &str) -> Vec<(i64, String, String, f64)> {
    let reply = v.control(&format!("positions {login}"));
    let rest = reply.strip_prefix("ok").expect("positions answered");
    rest.split_whitespace()
        .map(|p| {
            let f: Vec<&str> = p.split(':').collect();
            (
                f[0].parse().unwrap(),
                f[1].to_string(),
                f[2].to_string(),
                f[3].parse().unwrap(),
            )
        })
        .collect()
}

fn hand(v: &FixVenue, command: &str) -> i64 {
    let reply = v.control(command);
    reply
        .strip_prefix("ok ")
        .unwrap_or_else(|| panic!("{command}: {reply}"))
        .parse()
        .unwrap()
}

fn venue_journal(v: &FixVenue) -> Vec<JournalEntry> {
    journal(&v.journal)
}

async fn wait_venue(
    v: &FixVenue,
    login: &str,
    what: &str,
    want: impl Fn(&[(i64, String, String, f64)]) -> bool,
) -> Vec<(i64, String, String, f64)> {
    eventually(format!("{login}: {what}"), WAIT, async || {
        let p = venue_positions(v, login);
        want(&p).then_some(p)
    })
    .await
}

async fn status_of(conn: &mut PgConnection, id: i64) -> String {
    sqlx::query_scalar::<_, Option<String>>("SELECT status FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await
        .unwrap()
        .unwrap_or_default()
}

async fn wait_status(conn: &mut PgConnection, id: i64, wants: &str) {
    eventually(
        format!("account {id}: status with {wants:?}"),
        WAIT,
        async || status_of(conn, id).await.contains(wants).then_some(()),
    )
    .await;
}

/// `login`'s positions at the venue and its journal lines, timed from `since` (wall ms): what a
/// failed assertion prints.
fn venue_story(v: &FixVenue, login: &str, since: i64) -> String {
    let lines: Vec<String> = venue_journal(v)
        .iter()
        .filter(|l| l.login == login)
        .map(|l| {
            format!(
                "  {:+} ms {} {} {:?} {:?} {:?} accepted={}",
                l.ts_ms - since,
                l.client,
                l.action,
                l.symbol,
                l.side,
                l.volume,
                l.accepted
            )
        })
        .collect();
    format!(
        "{login} at the venue: {:?}; its journal, ms from the freeze:\n{}",
        venue_positions(v, login),
        lines.join("\n")
    )
}

fn accepted_orders<'a>(lines: &'a [JournalEntry], login: &str) -> Vec<&'a JournalEntry> {
    lines
        .iter()
        .filter(|l| l.login == login && l.accepted && l.action != "login")
        .collect()
}

fn lots_close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

in_both_position_modes!(master_trades_copy_over_fix_and_between_protocols);
async fn master_trades_copy_over_fix_and_between_protocols(positions: Positions) {
    let mut s = CopySetup::new("fix-copy").await;
    let v = venue(&s, &["m1", "f1", "f2"], positions);
    let fix = server(&v, "");
    add_account(&mut s.conn, 1, "master", &fix, "m1").await;
    add_account(&mut s.conn, 2, "follower", &fix, "f1").await;
    add_account(&mut s.conn, 3, "follower", &fix, "f2").await;
    add_account(&mut s.conn, 4, "follower", &s.addr, "b4").await;
    add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    add_link(
        &mut s.conn,
        1,
        3,
        LinkSpec {
            reverse: true,
            lot_value: 2.0,
            symbol_map: r#"{"EURUSD": "GBPUSD"}"#,
            ..Default::default()
        },
    )
    .await;
    let (_, bridge_magic) = add_link(&mut s.conn, 1, 4, LinkSpec::default()).await;
    let node = start_node(&config(&s.db, "fx-node", 100, FAST)).await;
    for id in 2..=4 {
        wait_status(&mut s.conn, id, "follower: master").await;
    }

    // Open: every follower gets its copy, on its own protocol.
    let ticket = hand(&v, "open m1 EURUSD buy 0.5");
    let f1 = wait_venue(&v, "f1", "a copy", |p| p.len() == 1).await;
    assert_eq!((f1[0].1.as_str(), f1[0].2.as_str()), ("EURUSD", "buy"));
    assert!(lots_close(f1[0].3, 0.5), "{f1:?}");
    let f2 = wait_venue(&v, "f2", "a reversed, mapped copy", |p| p.len() == 1).await;
    assert_eq!((f2[0].1.as_str(), f2[0].2.as_str()), ("GBPUSD", "sell"));
    assert!(lots_close(f2[0].3, 1.0), "{f2:?}");
    let bridge = s.t.copy_of("b4", bridge_magic, ticket, WAIT).await;
    assert!(lots_close(bridge.volume, 0.5), "{bridge:?}");

    // Partial close, then full close.
    hand(&v, &format!("close m1 {ticket} 0.2"));
    wait_venue(&v, "f1", "the copy trimmed", |p| {
        p.len() == 1 && lots_close(p[0].3, 0.3)
    })
    .await;
    wait_venue(&v, "f2", "the copy trimmed", |p| {
        p.len() == 1 && lots_close(p[0].3, 0.6)
    })
    .await;
    hand(&v, &format!("close m1 {ticket} 0.3"));
    wait_venue(&v, "f1", "the copy closed", |p| p.is_empty()).await;
    wait_venue(&v, "f2", "the copy closed", |p| p.is_empty()).await;
    eventually("the bridge copy closed", WAIT, async || {
        s.t.positions("b4").await.is_empty().then_some(())
    })
    .await;

    // The venue's journal: one open, one trim, one close per FIX follower, each from this node.
    let lines = venue_journal(&v);
    for login in ["f1", "f2"] {
        let orders = accepted_orders(&lines, login);
        let actions: Vec<&str> = orders.iter().map(|l| l.action.as_str()).collect();
        assert_eq!(actions, ["open", "close", "close"], "{login}: {orders:?}");
        assert!(orders.iter().all(|l| l.client == "fx-node"), "{orders:?}");
        assert!(
            orders.iter().all(|l| l.client_order_id.is_some()),
            "every order carries its intent's ClOrdID: {orders:?}"
        );
    }
    // The ledger knows each copy's position and master ticket.
    let ledger: Vec<(i64, String, String)> = sqlx::query_as(
        "SELECT account_id, comment, state FROM fix_orders WHERE kind = 'open' ORDER BY account_id",
    )
    .fetch_all(&mut s.conn)
    .await
    .unwrap();
    let marker = format!("mc{ticket}");
    assert_eq!(
        ledger,
        vec![
            (2, marker.clone(), "filled".to_string()),
            (3, marker, "filled".to_string())
        ]
    );
    node.shutdown();
}

in_both_position_modes!(a_refused_fix_logon_shows_on_the_account_and_the_node_runs_on);
async fn a_refused_fix_logon_shows_on_the_account_and_the_node_runs_on(positions: Positions) {
    let mut s = CopySetup::new("fix-logon").await;
    let v = FixVenue::start(
        &s.dir.0,
        &[
            VenueAccount {
                login: "m1",
                password: "",
            },
            VenueAccount {
                login: "f1",
                password: "pw-right",
            },
            VenueAccount {
                login: "f2",
                password: "pw-two",
            },
        ],
    );
    positions.apply(&v);
    let key = CredentialsKey::generate();
    let fix = server(&v, "");
    add_account(&mut s.conn, 1, "master", &fix, "m1").await;
    add_account(&mut s.conn, 2, "follower", &fix, "f1").await;
    add_account(&mut s.conn, 3, "follower", &fix, "f2").await;
    for (id, password) in [(2, "pw-wrong"), (3, "pw-two")] {
        sqlx::query("UPDATE trading_accounts SET credentials = $2 WHERE id = $1")
            .bind(id)
            .bind(key.encrypt(password))
            .execute(&mut s.conn)
            .await
            .unwrap();
    }
    add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    add_link(&mut s.conn, 1, 3, LinkSpec::default()).await;
    let mut cfg = config(&s.db, "fx-logon", 100, FAST);
    cfg.credentials_key = Some(key);
    let node = start_node(&cfg).await;
    wait_status(&mut s.conn, 2, "refused the logon").await;
    wait_status(&mut s.conn, 3, "follower: master").await;
    hand(&v, "open m1 XAUUSD sell 0.1");
    wait_venue(&v, "f2", "a copy", |p| p.len() == 1).await;
    assert!(venue_positions(&v, "f1").is_empty());
    let lines = venue_journal(&v);
    assert!(
        lines.iter().any(|l| l.login == "f1"
            && l.action == "login"
            && !l.accepted
            && l.reason.as_deref() == Some("wrong password")),
        "the venue refused f1's password"
    );
    // The password itself is in no log of ours: the venue's journal never holds it either.
    let text = std::fs::read_to_string(&v.journal).unwrap();
    assert!(!text.contains("pw-wrong") && !text.contains("pw-two"));
    node.shutdown();
}

in_both_position_modes!(lost_fill_reports_are_resolved_without_a_duplicate);
/// Three ways a fill's report can go missing: never sent (resolved by OrderStatusRequest before
/// anything else is sent), never sent and the venue then forgets the ClOrdID (as after a
/// trading-day roll: the status answer is "unknown order", and the unmarked position the order
/// made is found and adopted rather than the order sent again), or sent while the connection
/// was down (resolved by the session's ResendRequest after the next logon). Every way the
/// follower ends with one copy.
async fn lost_fill_reports_are_resolved_without_a_duplicate(positions: Positions) {
    for fault in ["drop_after_fill", "drop_and_forget", "gap_after_fill"] {
        let mut s = CopySetup::new(&format!("fix-{fault}")).await;
        let v = venue(&s, &["m1", "f1"], positions);
        let fix = server(&v, "");
        add_account(&mut s.conn, 1, "master", &fix, "m1").await;
        add_account(&mut s.conn, 2, "follower", &fix, "f1").await;
        add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
        let node = start_node(&config(&s.db, "fx-lost", 100, FAST)).await;
        wait_status(&mut s.conn, 2, "follower: master").await;
        let switch = if fault == "drop_and_forget" {
            "drop_after_fill"
        } else {
            fault
        };
        assert_eq!(v.control(&format!("fault {switch} on")), "ok");
        let first = hand(&v, "open m1 EURUSD sell 0.3");
        // The fill happens; its report does not arrive on that connection.
        wait_venue(&v, "f1", "the copy filled", |p| p.len() == 1).await;
        if fault == "drop_and_forget" {
            assert_eq!(v.control("forget f1"), "ok");
        }
        assert_eq!(v.control(&format!("fault {switch} off")), "ok");
        // The follower carries on: a second master trade is copied after the first is resolved.
        let second = hand(&v, "open m1 EURUSD buy 0.2");
        let f1 = wait_venue(&v, "f1", "both copies", |p| p.len() == 2).await;
        // Settled: no third order shows up while the follower reconciles again.
        let ledger = eventually(format!("{fault}: the ledger resolved"), WAIT, async || {
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SELECT comment, state FROM fix_orders WHERE account_id = 2 ORDER BY sent_at",
            )
            .fetch_all(&mut s.conn)
            .await
            .unwrap();
            rows.iter()
                .all(|(_, state)| state == "filled")
                .then_some(rows)
        })
        .await;
        let comments: Vec<&str> = ledger.iter().map(|(c, _)| c.as_str()).collect();
        assert_eq!(
            comments,
            [format!("mc{first}"), format!("mc{second}")],
            "{fault}"
        );
        let lines = venue_journal(&v);
        let opens = accepted_orders(&lines, "f1");
        assert_eq!(
            opens.len(),
            2,
            "{fault}: exactly two orders filled: {opens:?}"
        );
        assert_eq!(f1.len(), 2);
        node.shutdown();
        drop(v);
    }
}

#[allow(clippy::disallowed_methods)] // compared with the venue's journal times (wall clock)
fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

async fn owner_of(conn: &mut PgConnection, id: i64) -> Option<String> {
    sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await
        .unwrap()
}

in_both_position_modes!(killed_and_frozen_owners_hand_fix_accounts_over_without_duplicates);
/// Node processes trading over FIX: the owner of the follower is killed (-9), then the next one
/// is frozen (SIGSTOP) past its lease and thawed. Judged from the venue's journal alone (the
/// venue checks no fence): each master trade copied once, and no order from the frozen owner
/// after the new owner's first. The takeover time of the frozen case is printed.
async fn killed_and_frozen_owners_hand_fix_accounts_over_without_duplicates(positions: Positions) {
    use crate::support::process::NodeProcess;

    let mut s = CopySetup::new("fix-failover").await;
    let v = venue(&s, &["m1", "f1"], positions);
    let fix = server(&v, "");
    add_account(&mut s.conn, 1, "master", &fix, "m1").await;
    add_account(&mut s.conn, 2, "follower", &fix, "f1").await;
    add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let mut nodes: Vec<NodeProcess> = ["fa", "fb"]
        .iter()
        .map(|id| NodeProcess::spawn(&s.db, id, 100, FAST, &[]))
        .collect();
    wait_status(&mut s.conn, 2, "follower: master").await;
    let copies = async |n: usize| {
        wait_venue(&v, "f1", &format!("{n} copies"), |p| p.len() == n).await;
    };
    let first = hand(&v, "open m1 EURUSD buy 0.1");
    copies(1).await;

    // kill -9 of the follower's owner.
    let victim = owner_of(&mut s.conn, 2).await.expect("owned");
    let idx = nodes.iter().position(|n| n.node_id == victim).unwrap();
    nodes[idx].kill9();
    eventually("the follower owned by the survivor", WAIT, async || {
        owner_of(&mut s.conn, 2)
            .await
            .filter(|o| *o != victim)
            .map(|_| ())
    })
    .await;
    hand(&v, "open m1 EURUSD sell 0.2");
    copies(2).await;
    // Half of the first master position closed: its copy trimmed once, and no later takeover
    // trims it again (its opening volume is recorded, not read from its current one).
    hand(&v, &format!("close m1 {first} 0.05"));
    let trimmed = |p: &[(i64, String, String, f64)]| {
        p.iter()
            .any(|(_, sym, side, lots)| sym == "EURUSD" && side == "buy" && lots_close(*lots, 0.05))
    };
    wait_venue(&v, "f1", "the first copy trimmed", |p| trimmed(p)).await;

    // A third node joins; then the follower's owner freezes past its lease.
    nodes.push(NodeProcess::spawn(&s.db, "fc", 100, FAST, &[]));
    nodes[2].wait_for_output("joined the cluster", WAIT).await;
    let frozen = owner_of(&mut s.conn, 2).await.expect("owned");
    let fidx = nodes.iter().position(|n| n.node_id == frozen).unwrap();
    nodes[fidx].signal("STOP");
    let froze_at = wall_ms();
    hand(&v, "open m1 XAUUSD buy 0.3");
    copies(3).await;
    let new_owner = owner_of(&mut s.conn, 2).await.expect("owned");
    // (Under load the frozen node once copied the trade itself: `kill` had returned before its
    // threads stopped. `signal("STOP")` now waits for them; the story shows any such case.)
    assert_ne!(
        new_owner,
        frozen,
        "the follower is still the frozen node's after its third copy; {}",
        venue_story(&v, "f1", froze_at)
    );
    let lines = venue_journal(&v);
    let logon = lines
        .iter()
        .find(|l| {
            l.login == "f1"
                && l.action == "login"
                && l.accepted
                && l.client == new_owner
                && l.ts_ms >= froze_at
        })
        .expect("the new owner's logon");
    let takeover_ms = logon.ts_ms - froze_at;
    eprintln!("FIX takeover from a frozen owner: {takeover_ms} ms (lease 3 s, heartbeat 1 s)");
    // Within the lease (3 s: the frozen owner's rows expire) and 5 s more: the venue notices
    // the frozen session within its heartbeats (1 s) and the new owner logs on at its next try.
    assert!(
        takeover_ms <= 3_000 + 5_000,
        "takeover took {takeover_ms} ms"
    );

    // Thawed, the old owner finds its lease gone and sends nothing.
    nodes[fidx].signal("CONT");
    nodes[fidx].wait_for_output("gate closed", WAIT).await;
    hand(&v, "open m1 GBPUSD sell 0.4");
    copies(4).await;
    assert!(trimmed(&venue_positions(&v, "f1")), "trimmed once, kept");

    let lines = venue_journal(&v);
    let orders: Vec<&JournalEntry> = accepted_orders(&lines, "f1");
    let opens: Vec<String> = orders
        .iter()
        .filter(|l| l.action == "open")
        .map(|l| {
            let id = l.client_order_id.clone().unwrap_or_default();
            id.split('~').next().unwrap_or("").to_string()
        })
        .collect();
    let mut distinct = opens.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(opens.len(), 4, "one open per master trade: {orders:?}");
    let trims = orders.iter().filter(|l| l.action == "close").count();
    assert_eq!(trims, 1, "one trim for one partial close: {orders:?}");
    assert_eq!(distinct.len(), 4, "no intent opened twice: {opens:?}");
    // Not even refused by the venue's ClOrdID check: no open request was sent twice at all (a
    // venue that deduplicates nothing would have executed a second one).
    let requests = lines
        .iter()
        .filter(|l| l.login == "f1" && l.action == "open")
        .count();
    assert_eq!(requests, 4, "one open request per master trade: {lines:?}");
    let first_new = orders
        .iter()
        .filter(|l| l.client == new_owner && l.ts_ms >= froze_at)
        .map(|l| l.ts_ms)
        .min()
        .expect("the new owner traded");
    let late: Vec<&JournalEntry> = lines
        .iter()
        .filter(|l| l.login == "f1" && l.action != "login" && l.client == frozen)
        .filter(|l| l.ts_ms >= first_new)
        .collect();
    assert!(
        late.is_empty(),
        "orders from the frozen owner after the new owner's first: {late:?}"
    );
}

in_both_position_modes!(without_drop_copy_master_trades_arrive_by_subscription_or_polling);
/// Without drop copy (the venue sends other sessions' trades to nobody), the master's trades
/// arrive by a positions subscription (SubscriptionRequestType=1) or by polling; both feed the
/// same copy engine.
async fn without_drop_copy_master_trades_arrive_by_subscription_or_polling(positions: Positions) {
    for updates in ["subscribe", "poll"] {
        let mut s = CopySetup::new(&format!("fix-{updates}")).await;
        let v = venue(&s, &["m1", "f1"], positions);
        assert_eq!(v.control("fault no_drop_copy on"), "ok");
        let master = server(&v, &format!("&updates={updates}&poll_ms=200"));
        add_account(&mut s.conn, 1, "master", &master, "m1").await;
        add_account(&mut s.conn, 2, "follower", &server(&v, ""), "f1").await;
        add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
        let node = start_node(&config(&s.db, "fx-updates", 100, FAST)).await;
        wait_status(&mut s.conn, 2, "follower: master").await;
        let ticket = hand(&v, "open m1 GBPUSD buy 0.4");
        wait_venue(&v, "f1", &format!("{updates}: a copy"), |p| {
            p.len() == 1 && lots_close(p[0].3, 0.4)
        })
        .await;
        hand(&v, &format!("close m1 {ticket} 0.1"));
        wait_venue(&v, "f1", &format!("{updates}: the copy trimmed"), |p| {
            p.len() == 1 && lots_close(p[0].3, 0.3)
        })
        .await;
        hand(&v, &format!("close m1 {ticket} 0.3"));
        wait_venue(&v, "f1", &format!("{updates}: the copy closed"), |p| {
            p.is_empty()
        })
        .await;
        let lines = venue_journal(&v);
        assert_eq!(
            accepted_orders(&lines, "f1").len(),
            3,
            "{updates}: open, trim, close"
        );
        node.shutdown();
    }
}

in_both_position_modes!(
    stops_are_resting_orders_replaced_on_change_and_a_stopped_copy_stays_closed
);
/// Stops on a FIX follower are resting orders on the copy's position (cTrader's way): set with
/// the copy, replaced when the master moves them, filled by the venue when the price reaches
/// one (the other is cancelled with the position), and a copy its stop loss closed is never
/// opened again.
async fn stops_are_resting_orders_replaced_on_change_and_a_stopped_copy_stays_closed(
    positions: Positions,
) {
    use copier_node::broker::types::Side;

    let mut s = CopySetup::new("fix-stops").await;
    let v = venue(&s, &["f1"], positions);
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 2, "follower", &server(&v, ""), "f1").await;
    add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let node = start_node(&config(&s.db, "fx-stops", 100, FAST)).await;
    wait_status(&mut s.conn, 2, "follower: master").await;

    let ticket =
        s.t.open("m1", "EURUSD", Side::Buy, 0.2, Some(1.09), Some(1.12))
            .await;
    let intent = format!("-m{ticket}-");
    let working = async |conn: &mut PgConnection| -> Vec<(String, f64)> {
        sqlx::query_as(
            "SELECT kind, price FROM fix_orders WHERE account_id = 2 AND state = 'working' ORDER BY kind",
        )
        .fetch_all(conn)
        .await
        .unwrap()
    };
    eventually(
        "the copy's stop loss and take profit rest at the venue",
        WAIT,
        async || {
            let w = working(&mut s.conn).await;
            (w == [("sl".to_string(), 1.09), ("tp".to_string(), 1.12)]).then_some(())
        },
    )
    .await;

    // The master moves its take profit: the resting limit is replaced, the stop stays.
    s.t.modify("m1", ticket, Some(1.09), Some(1.13)).await;
    eventually("the take profit replaced", WAIT, async || {
        let w = working(&mut s.conn).await;
        (w == [("sl".to_string(), 1.09), ("tp".to_string(), 1.13)]).then_some(())
    })
    .await;

    // The price falls through the stop: the venue closes the copy and cancels the limit.
    assert_eq!(v.control("quote EURUSD 1.08900 1.08910"), "ok 1");
    wait_venue(&v, "f1", "the copy stopped out", |p| p.is_empty()).await;
    eventually("the ledger shows the stop filled and no order in force", WAIT, async || {
        let states: Vec<(String, String)> = sqlx::query_as(
            "SELECT kind, state FROM fix_orders WHERE account_id = 2 AND kind IN ('sl', 'tp') ORDER BY sent_at",
        )
        .fetch_all(&mut s.conn)
        .await
        .unwrap();
        let sl_filled = states.iter().any(|(k, st)| k == "sl" && st == "filled");
        let none_working = states.iter().all(|(_, st)| st != "working");
        (sl_filled && none_working).then_some(())
    })
    .await;

    // The master's position is still open; a later master trade is copied, and the stopped copy
    // is never opened again (its close is in the ledger's history).
    s.t.open("m1", "GBPUSD", Side::Sell, 0.1, None, None).await;
    wait_venue(&v, "f1", "the next copy", |p| {
        p.len() == 1 && p[0].1 == "GBPUSD"
    })
    .await;
    let lines = venue_journal(&v);
    let reopened = lines
        .iter()
        .filter(|l| l.login == "f1" && l.action == "open" && l.accepted)
        .filter(|l| {
            l.client_order_id
                .as_deref()
                .is_some_and(|c| c.contains(&intent))
        })
        .count();
    assert_eq!(reopened, 1, "the stopped copy was opened once");
    let stopped = lines
        .iter()
        .filter(|l| l.login == "f1" && l.action == "close" && l.client == "stop")
        .count();
    assert_eq!(stopped, 1, "the venue's stop closed it");
    node.shutdown();
}

/// Master 1 (`m1`) on the venue, copied by follower 2 (`b2`) on the simulated broker: the venue
/// and the link's magic.
async fn fix_master_and_bridge_follower(s: &mut CopySetup) -> (FixVenue, i64) {
    let v = venue(s, &["m1"], Positions::Acknowledged);
    let fix = server(&v, "");
    add_account(&mut s.conn, 1, "master", &fix, "m1").await;
    add_account(&mut s.conn, 2, "follower", &s.addr, "b2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    (v, magic)
}

/// A FIX master's session re-reads its account inline when a publication failed (and after a
/// reconnect, or trust restored), while its periodic re-read may be under way beside its
/// updates. The adapter takes one request of an account at a time, and the re-read under way,
/// held in its positions read (fault point `COPIERTEST_FIX_HOLD_POSITIONS`, its periodic re-reads
/// started at once by `COPIERTEST_MASTER_SYNC`), has that turn: only the session's own loop,
/// waiting for the inline re-read, could finish it. A trade's publication fails (the snapshot's
/// table renamed away); the inline re-read that retries it drops the held one and reads
/// (reaching the held read itself); let go, with the table back, the trade is copied. Fails when
/// the inline re-read waits behind the one under way (the session hangs, shown by hand).
#[tokio::test]
async fn a_fix_masters_inline_reread_during_its_background_one_does_not_hang_it() {
    use crate::support::process::{NodeProcess, NodeSpec};

    let mut s = CopySetup::new("fix-reread-inline").await;
    let (v, magic) = fix_master_and_bridge_follower(&mut s).await;
    let (reread, hold) = (s.dir.path("reread"), s.dir.path("hold"));
    let mut node = NodeProcess::spawn_with(&NodeSpec {
        node_id: "fx".into(),
        capacity: 10,
        timing: FAST,
        database_url: s.db.url.clone(),
        listen_url: None,
        env: vec![
            (
                "COPIERTEST_MASTER_SYNC".into(),
                reread.display().to_string(),
            ),
            (
                "COPIERTEST_FIX_HOLD_POSITIONS".into(),
                hold.display().to_string(),
            ),
        ],
        extra: Vec::new(),
    });
    wait_status(&mut s.conn, 2, "follower: master").await;
    let first = hand(&v, "open m1 EURUSD buy 0.1");
    s.t.copy_of("b2", magic, first, WAIT).await;
    std::fs::write(&hold, b"hold").unwrap();
    std::fs::write(&reread, b"reread").unwrap();
    let held = "FIX positions read held";
    node.wait_for_output(held, WAIT).await;
    sqlx::query("ALTER TABLE master_state RENAME TO master_state_away")
        .execute(&mut s.conn)
        .await
        .unwrap();
    let second = hand(&v, "open m1 EURUSD sell 0.1");
    eventually(
        "the inline re-read at the held read too",
        WAIT,
        async || (node.output().matches(held).count() >= 2).then_some(()),
    )
    .await;
    sqlx::query("ALTER TABLE master_state_away RENAME TO master_state")
        .execute(&mut s.conn)
        .await
        .unwrap();
    std::fs::remove_file(&reread).unwrap();
    std::fs::remove_file(&hold).unwrap();
    s.t.copy_of("b2", magic, second, WAIT).await;
    node.signal("TERM");
    node.wait_exit(WAIT).await;
}

/// The venue logs the session out and resets its sequence numbers (both sides at 1, as venues do
/// at a trading-day roll), well below the node's after a day's messages (150 trades here): the
/// node's FIX session of the master connects again (QuickFIX's single-threaded initiator opens
/// no new connection after a venue's Logout: the engine builds it again, its first Logon
/// resetting both sides' numbers), re-reads the master, and a trade made meanwhile is copied.
/// Fails when the initiator is not built again (no new connection at all, shown by hand).
#[tokio::test]
async fn a_fix_master_logs_on_again_after_the_venue_resets_its_sequence_numbers() {
    logs_on_again_after_the_venue("fix-venue-reset", "reset m1").await;
}

/// The venue drops the connection with no Logout and starts its sequence numbers again at 1 (a
/// venue restarted without its store), well below the node's after 150 trades: the node's
/// session connects again, and the venue's answer to its Logon is numbered below what the
/// session expects. The next Logon resets both sides' numbers, and a trade made meanwhile is
/// copied. Fails when a Logon answer numbered too low does not make the next Logon reset (the
/// session logs out at every answer, for ever: shown by hand).
#[tokio::test]
async fn a_fix_master_logs_on_again_after_the_venue_starts_its_numbers_again_without_a_logout() {
    logs_on_again_after_the_venue("fix-venue-renumber", "renumber m1").await;
}

/// 150 trades of the FIX master copied, then the venue's `command` on its session, then a trade
/// made after it is copied too.
async fn logs_on_again_after_the_venue(name: &str, command: &str) {
    let mut s = CopySetup::new(name).await;
    let (v, magic) = fix_master_and_bridge_follower(&mut s).await;
    let node = start_node(&config(&s.db, "fx-node", 100, FAST)).await;
    wait_status(&mut s.conn, 2, "follower: master").await;
    let mut last = 0;
    for _ in 0..150 {
        last = hand(&v, "open m1 EURUSD buy 0.01");
    }
    s.t.copy_of("b2", magic, last, WAIT).await;
    assert_eq!(v.control(command), "ok");
    let after = hand(&v, "open m1 EURUSD sell 0.1");
    s.t.copy_of("b2", magic, after, WAIT).await;
    node.shutdown();
}
