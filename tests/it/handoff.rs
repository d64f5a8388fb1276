//! Prepared fair-share hand-offs end to end: nodes in-process, real PostgreSQL, the simulated
//! broker as MT4/MT5 servers behave (no fence check, no client-order-id dedupe) with a slow
//! login. Judged from the broker's journal alone.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use copier_node::broker::types::Side;
use copier_node::db::lease::{Release, Releaser, Releasing};
use copier_node::handoff::Together;
use copier_node::sim_broker::server::{ServeOptions, SimBroker};
use sqlx::postgres::PgListener;

use crate::support::broker::journal;
use crate::support::fixture::CopySetup;
use crate::support::http::{get, sample};
use crate::support::{
    FAST, LinkSpec, add_account, add_link, config, eventually, start_node, wait_state,
};

const WAIT: Duration = Duration::from_secs(60);

/// A longer trust window than [`FAST`]'s, where a test asserts that no reconcile happens: a
/// lease cycle late under a loaded suite must not lapse a gate (a lapse rightly reconciles).
const UNHURRIED: crate::support::Timing = crate::support::Timing {
    lease: "10s",
    fence: "2s",
    cycle: "500ms",
};

/// What a real trade server's login costs, roughly; the old owner copies on meanwhile.
const LOGIN_DELAY: Duration = Duration::from_secs(2);

/// A node joins; the old owner offers the accounts it hands off, keeps copying while the new
/// node logs in ahead (a trade made after the offer is copied by the old owner), and only then
/// stops. The new owner raises its prepared login's fence (no second login), every order of the
/// old owner precedes that raise in the journal and every order of the new owner follows it, and
/// no trade is copied twice.
#[tokio::test]
async fn a_fair_share_move_prepares_the_receiver_while_the_old_owner_copies() {
    let (
        CopySetup {
            db,
            dir,
            broker,
            t,
            mut conn,
            ..
        },
        a,
    ) = seven_accounts_on_a("handoff-prepared").await;
    let first = t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;

    let mut offers = PgListener::connect(&db.url).await.unwrap();
    offers.listen("copier_handoff").await.unwrap();
    let mut releases = PgListener::connect(&db.url).await.unwrap();
    releases
        .listen(copier_node::channels::RELEASED)
        .await
        .unwrap();
    let b = start_node(&config(&db, "b", 100, FAST)).await;
    // The first follower offered to b: trade at once, while b logs in (LOGIN_DELAY).
    let offered = first_offer(&mut offers, "a", "b").await;
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
    let lines = copied_once_each(&dir, 2).await;

    // The trade made after the offer was copied to the offered follower by a, its old owner.
    assert_eq!(
        copied_by(&lines, &offered_login, during),
        "a",
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
    // b answered each offer that it would claim (it was below its share), so each of a's
    // releases named b.
    for _ in 0..3 {
        let n = tokio::time::timeout(WAIT, releases.recv())
            .await
            .expect("a release announced")
            .unwrap();
        assert_eq!(
            copier_node::channels::decode(n.channel(), n.payload()),
            Ok(copier_node::channels::Notice::Released {
                platform: "mt5".into(),
                release: copier_node::channels::Release {
                    from: "a".into(),
                    to: Some("b".into()),
                    leaving: false,
                    announced: false,
                    accounts: 1,
                }
            }),
            "{}",
            n.payload()
        );
    }
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
        assert_prepared_then_raised(&lines, login, "a", "b");
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

/// A fair-share move's release names its receiver and wakes that node alone. A receiver that
/// answered that it would claim but does not (it stopped, paused or filled up since) would leave
/// the account free until some node's next cycle: a second on, the old owner announces it again
/// naming nobody, so that the nodes with room wake for it. Here b is a member below its share
/// that answers every offer that it will claim, and never claims.
#[tokio::test]
async fn an_account_its_named_receiver_does_not_claim_is_announced_again_naming_nobody() {
    let (CopySetup { db, broker, .. }, a) = seven_accounts_on_a("handoff-unclaimed").await;
    let mut releases = ReleasesHeard::listen(&db.url).await;
    let b = FakeReceiver::start(&db.url, Some(true)).await;
    let named = releases.next_from_a().await;
    assert_eq!(named.to.as_deref(), Some("b"), "{named:?}");
    assert!(!named.leaving && named.accounts >= 1, "{named:?}");
    let again = loop {
        let release = releases.next_from_a().await;
        if release.to.is_none() {
            break release;
        }
    };
    assert!(!again.leaving, "{again:?}");
    assert!(again.accounts >= 1, "{again:?}");
    // Nobody took them meanwhile: a is above its share (and b, far below its own, is the one
    // to take them: a takes none back), b claims nothing.
    let mut conn = db.conn().await;
    let free: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id IS NULL")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(free >= i64::from(again.accounts), "{free} free");
    // a stops while b still answers (its shutdown offers b the accounts).
    a.shutdown();
    a.wait().await.unwrap();
    b.stop().await;
    broker.stop().await;
}

/// A stopping node's hand-offs are checked after its leave too: an account whose named receiver
/// does not claim it is announced again naming nobody a second after its release, although the
/// node that released it has left by then (it waits for its checks before it exits; the leave
/// after an announced departure wakes only a few nodes). Here b is a member below its share that
/// answers every offer that it will claim, and never claims.
#[tokio::test]
async fn a_stopping_nodes_hand_off_its_receiver_does_not_claim_is_announced_again_after_its_leave()
{
    let (CopySetup { db, broker, .. }, a) = seven_accounts_on_a("handoff-unclaimed-leave").await;
    let mut releases = ReleasesHeard::listen(&db.url).await;
    let b = FakeReceiver::start(&db.url, Some(true)).await;
    let moved = releases.next_from_a().await;
    assert_eq!(moved.to.as_deref(), Some("b"), "{moved:?}");
    a.shutdown();
    a.wait().await.unwrap();
    releases.shutdown_hand_offs_to_b_announced_again().await;
    b.stop().await;
    broker.stop().await;
}

/// The same through the binary: a stopping process exits only after the checks of its last
/// releases ran, so the hand-offs its receiver did not claim are announced again although the
/// process is gone (without that wait, it exits before the checks' second).
#[tokio::test]
async fn a_stopping_process_runs_the_checks_of_its_last_hand_offs_before_it_exits() {
    use crate::support::process::NodeProcess;
    let CopySetup {
        db,
        broker,
        mut conn,
        addr,
        ..
    } = CopySetup::with("handoff-unclaimed-exit", |o| {
        o.fence_check = false;
        o.dedupe = false;
    })
    .await;
    add_seven_accounts(&mut conn, &addr).await;
    let mut a = NodeProcess::spawn(&db, "a", 100, FAST, &[]);
    followers_reconciled(&mut conn).await;
    let mut releases = ReleasesHeard::listen(&db.url).await;
    let b = FakeReceiver::start(&db.url, Some(true)).await;
    let moved = releases.next_from_a().await;
    assert_eq!(moved.to.as_deref(), Some("b"), "{moved:?}");
    a.signal("TERM");
    let status = a.wait_exit(WAIT).await;
    assert!(status.success(), "{status}\n{}", a.output());
    releases.shutdown_hand_offs_to_b_announced_again().await;
    b.stop().await;
    broker.stop().await;
}

/// A release names its receiver only when the receiver answered that it will claim: one that
/// answers without saying so (an older node's answer) may not take the account up, and a
/// release named to it would wake nobody else. Here b answers every offer, ready, saying
/// nothing of claiming: a's release names nobody.
#[tokio::test]
async fn a_receiver_that_does_not_say_it_will_claim_is_not_named() {
    let (CopySetup { db, broker, .. }, a) = seven_accounts_on_a("handoff-unsaid").await;
    let mut releases = ReleasesHeard::listen(&db.url).await;
    let b = FakeReceiver::start(&db.url, None).await;
    let release = releases.next_from_a().await;
    assert_eq!(release.to, None, "{release:?}");
    assert!(!release.leaving && release.accounts >= 1, "{release:?}");
    // a stops while b still answers (its shutdown offers b the accounts).
    a.shutdown();
    a.wait().await.unwrap();
    b.stop().await;
    broker.stop().await;
}

/// The `copier_released` announcements of node a, as heard.
struct ReleasesHeard(PgListener);

impl ReleasesHeard {
    async fn listen(url: &str) -> ReleasesHeard {
        let mut listener = PgListener::connect(url).await.unwrap();
        listener
            .listen(copier_node::channels::RELEASED)
            .await
            .unwrap();
        ReleasesHeard(listener)
    }

    /// Once a has stopped with b as its receiver: what a announced, in order, up to its leave
    /// (the departure announced as it began, so the leave says `announced`; without that, this
    /// waits until `next_from_a` gives up), the shutdown's hand-offs named to b among them; then,
    /// after the leave, b having claimed none, each of those announced again naming nobody (with,
    /// at most, a fair-share move's accounts released in the second before the stop).
    async fn shutdown_hand_offs_to_b_announced_again(&mut self) {
        let mut named_at_shutdown = 0;
        let mut departed = false;
        loop {
            let release = self.next_from_a().await;
            if release.leaving && release.announced {
                break;
            }
            departed |= release.leaving;
            if departed && release.to.as_deref() == Some("b") {
                named_at_shutdown += release.accounts;
            }
        }
        assert!(departed, "the departure is announced before the leave");
        assert!(named_at_shutdown >= 1, "the shutdown hands accounts to b");
        let mut again = 0;
        while again < named_at_shutdown {
            let release = self.next_from_a().await;
            assert!(release.to.is_none() && !release.leaving, "{release:?}");
            again += release.accounts;
        }
    }

    async fn next_from_a(&mut self) -> copier_node::channels::Release {
        use copier_node::channels::{Notice, decode};
        loop {
            let n = tokio::time::timeout(WAIT, self.0.recv())
                .await
                .expect("a release announced")
                .unwrap();
            if let Ok(Notice::Released { release, .. }) = decode(n.channel(), n.payload())
                && release.from == "a"
            {
                return release;
            }
        }
    }
}

/// Node b, played by the test: a member below its share (its membership renewed every 200 ms,
/// capacity 100, claiming nothing) that answers every hand-off offered to it, ready, with
/// `claims` as its word on claiming, and never claims.
struct FakeReceiver {
    stop: tokio_util::sync::CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl FakeReceiver {
    async fn start(url: &str, claims: Option<bool>) -> FakeReceiver {
        use copier_node::channels::{Handoff, Notice, decode};
        use copier_node::db::lease::{self, CycleParams};
        let connect = async || {
            <sqlx::PgConnection as sqlx::Connection>::connect(url)
                .await
                .unwrap()
        };
        let mut offers = PgListener::connect(url).await.unwrap();
        offers.listen("copier_handoff").await.unwrap();
        let stop = tokio_util::sync::CancellationToken::new();
        let member = tokio::spawn({
            let (mut conn, stop) = (connect().await, stop.clone());
            async move {
                let mut every = tokio::time::interval(Duration::from_millis(200));
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = every.tick() => {}
                    }
                    let member = CycleParams {
                        node_id: "b",
                        instance_id: "ib",
                        platform: "mt5",
                        capacity: 100,
                        claim_limit: 0,
                        trust: Duration::from_secs(2),
                        owned: 0,
                        starting: 0,
                        lease: Duration::from_secs(3),
                        held: &[],
                        claim: false,
                        kept: &[],
                    };
                    lease::cycle(&mut conn, &member).await.unwrap();
                }
            }
        });
        let answers = tokio::spawn({
            let (mut conn, stop) = (connect().await, stop.clone());
            async move {
                loop {
                    let n = tokio::select! {
                        _ = stop.cancelled() => break,
                        n = offers.recv() => n.unwrap(),
                    };
                    let Ok(Notice::Handoff(offer)) = decode(n.channel(), n.payload()) else {
                        continue;
                    };
                    if offer.ready || offer.to != "b" {
                        continue;
                    }
                    let answer = Handoff {
                        ready: true,
                        claims,
                        ..offer
                    };
                    lease::announce_handoff(&mut conn, &answer.payload())
                        .await
                        .unwrap();
                }
            }
        });
        FakeReceiver {
            stop,
            tasks: vec![member, answers],
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        for task in self.tasks {
            task.await.unwrap();
        }
    }
}

/// A SIGTERM hand-off, prepared: the stopping node offers each account to the peer that will
/// take it and keeps copying behind its open gates (a trade made after the first offer is copied
/// by it) until that peer has logged in ahead; only then does it close the gate, finish, release
/// and leave. The peer raises each prepared login's fence (no second login): every order of the
/// stopping node precedes that raise in the journal and every order of the peer follows it, and
/// nothing is copied twice, with the broker's fence check and dedupe off. The peer is at its
/// own fair share when the offers come (no room of its own, as in a cluster at rest): the
/// departing node's share is what it takes.
#[tokio::test]
async fn a_sigterm_hand_off_prepares_the_receiver_while_the_stopping_node_copies() {
    let (
        CopySetup {
            db,
            dir,
            broker,
            t,
            mut conn,
            addr,
            ..
        },
        a,
    ) = seven_accounts_on_a("handoff-sigterm").await;
    // An eighth account (a follower of no master), so that the shares are even: four each.
    add_account(&mut conn, 8, "follower", &addr, "f8").await;
    wait_state(&a.state, "a owns the eighth account", WAIT, |s| {
        s.owned.len() == 8
    })
    .await;
    // b joins and takes its fair share first (the move tested above). What a holds when it
    // stops is read from the rows.
    let b = start_node(&config(&db, "b", 100, FAST)).await;
    let held_by_a = settled_split(&mut conn, &a, &b, 8).await;
    wait_state(&b.state, "b at its fair share", WAIT, |s| {
        s.target.is_some_and(|t| s.owned.len() as u32 >= t)
    })
    .await;
    assert!(
        (3..=4).contains(&held_by_a.len()),
        "a keeps its share of four (three, while a move is under way): {held_by_a:?}"
    );
    let first = t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;
    eventually("the first trade copied everywhere", WAIT, async || {
        let lines = journal(&dir.path("journal.jsonl"));
        let copied = lines
            .iter()
            .filter(|l| l.accepted && l.action == "open" && l.client != "manual")
            .filter(|l| l.comment.as_deref() == Some(format!("mc{first}").as_str()))
            .count();
        (copied == 6).then_some(())
    })
    .await;

    let mut offers = PgListener::connect(&db.url).await.unwrap();
    offers.listen("copier_handoff").await.unwrap();
    a.shutdown();
    // The first follower a offers to b as it stops: trade at once, while b logs in.
    let offered = first_offer(&mut offers, "a", "b").await;
    let during = t.open("m1", "GBPUSD", Side::Sell, 0.5, None, None).await;
    let offered_login = format!("f{offered}");
    a.wait().await.unwrap();
    wait_state(&b.state, "b owns every account", WAIT, |s| {
        s.owned.len() == 8
    })
    .await;
    t.close("m1", first, None).await;
    t.close("m1", during, None).await;
    let lines = copied_once_each(&dir, 2).await;
    assert!(held_by_a.contains(&offered_login), "{held_by_a:?}");
    assert_eq!(
        copied_by(&lines, &offered_login, during),
        "a",
        "the stopping node copies while the receiver prepares"
    );
    for login in &held_by_a {
        assert_prepared_then_raised(&lines, login, "a", "b");
    }
    // b raised a prepared login at each of its claims: at the move and at the stop, eight.
    let (_, metrics) = get(b.http_addr, "/metrics").await;
    assert_eq!(
        sample(&metrics, "copier_handoff_logins_total{outcome=\"raised\"}"),
        8.0
    );
    b.shutdown();
    b.wait().await.unwrap();
    broker.stop().await;
}

/// A shutdown's hand-offs are one step: each session copies on until every receiver of the step
/// has answered, then their gates close together, their releases go in one statement, and the
/// receiver claims them in one cycle (one gap for all, where answers a moment apart made
/// several, one behind the other). One follower is on a trade server whose logins are slow, so
/// the receiver answers for it a login after the others: a trade made meanwhile is still copied
/// by the stopping node, to every follower it holds. Judged by a trigger of the test's own, which
/// records in PostgreSQL the transaction of every change of an account's owner, and by the
/// brokers' journals (fence check and dedupe off): nothing copied twice.
#[tokio::test]
async fn a_shutdowns_hand_offs_close_together_and_move_in_one_release_and_one_claim() {
    let (setup, a, b, held_by_a, slow) = a_stopping_with_a_slow_follower("handoff-together").await;
    let CopySetup {
        db,
        dir,
        broker,
        t,
        mut conn,
        ..
    } = setup;
    let ids_of_a = ids_of(&held_by_a);
    record_owner_changes(&mut conn).await;
    answered_quick(&db, &a, &held_by_a).await;
    let during = t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;
    a.wait().await.unwrap();
    wait_state(&b.state, "b owns every account", WAIT, |s| {
        s.owned.len() == 7
    })
    .await;
    t.close("m1", during, None).await;

    // Every follower a held copied the trade made after b answered for the quick ones: a's
    // gates stayed open until b answered for the slow one too.
    let copies_of = |journal_file: &str| {
        let lines = journal(&dir.path(journal_file));
        let mut copies: HashMap<(String, Option<String>), Vec<String>> = HashMap::new();
        for l in lines
            .iter()
            .filter(|l| l.accepted && l.action == "open" && l.client != "manual")
        {
            copies
                .entry((l.login.clone(), l.comment.clone()))
                .or_default()
                .push(l.client.clone());
        }
        copies
    };
    eventually("the trade copied to every follower", WAIT, async || {
        let (quick_journal, slow_journal) = (copies_of("journal.jsonl"), copies_of("slow.jsonl"));
        let comment = Some(format!("mc{during}"));
        (2..=7)
            .all(|id| {
                let copies = if id == 7 {
                    &slow_journal
                } else {
                    &quick_journal
                };
                copies.contains_key(&(format!("f{id}"), comment.clone()))
            })
            .then_some(())
    })
    .await;
    let mut copies = copies_of("journal.jsonl");
    copies.extend(copies_of("slow.jsonl"));
    assert!(
        copies.values().all(|by| by.len() == 1),
        "copied twice: {copies:?}"
    );
    for login in &held_by_a {
        assert_eq!(
            copies[&(login.clone(), Some(format!("mc{during}")))],
            ["a"],
            "{login}: the stopping node copies until the step's last receiver answered"
        );
    }

    // One release of everything a held, and one claim of it by b.
    let changes = owner_changes(&mut conn).await;
    let moved = |from: Option<&str>, to: Option<&str>| {
        let these: Vec<&OwnerChange> = changes
            .iter()
            .filter(|c| c.old_node.as_deref() == from && c.new_node.as_deref() == to)
            .collect();
        let transactions: BTreeSet<&str> = these.iter().map(|c| c.xact.as_str()).collect();
        (
            these.iter().map(|c| c.id).collect::<BTreeSet<i64>>(),
            transactions.len(),
        )
    };
    assert_eq!(
        moved(Some("a"), None),
        (ids_of_a.clone(), 1),
        "a's accounts released in one transaction: {changes:?}"
    );
    assert_eq!(
        moved(None, Some("b")),
        (ids_of_a, 1),
        "and claimed by b in one: {changes:?}"
    );
    assert_eq!(
        changes.len(),
        2 * held_by_a.len(),
        "no other change of owner: {changes:?}"
    );
    b.shutdown();
    b.wait().await.unwrap();
    broker.stop().await;
    slow.stop().await;
}

/// A release announcement naming a node has it read the rows of the accounts it prepared for
/// hand-offs beside the claim it runs at once, instead of after the claim, when the claimed
/// sessions start. Judged by PostgreSQL's own view of the receiver's connections: with the
/// copy links locked by the test (an account row's read names its links, the claim does not),
/// an announcement naming the receiver while its prepared accounts are still the stopping
/// node's (waiting for a slow login's answer) leaves a row read of the receiver waiting for
/// the lock, with nothing claimed.
#[tokio::test]
async fn a_release_announcement_has_the_prepared_accounts_rows_read_beside_the_claim() {
    let (setup, a, b, held_by_a, slow) =
        a_stopping_with_a_slow_follower("handoff-rows-ahead").await;
    let CopySetup {
        db,
        broker,
        mut conn,
        ..
    } = setup;
    let quick = answered_quick(&db, &a, &held_by_a).await;

    let lock = locked(&db, "copy_links").await;
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(copier_node::channels::RELEASED)
        .bind(r#"mt5 {"from":"x","to":"b","accounts":1}"#)
        .execute(&mut conn)
        .await
        .unwrap();
    const ROW_READ: &str = "%FROM copy_links l WHERE l.follower_id = a.id%";
    eventually(
        "a row read of b waiting for the copy links",
        WAIT,
        async || (b_waiting_on_a_lock(&mut conn, ROW_READ).await > 0).then_some(()),
    )
    .await;
    let owners = owners_of(&mut conn, &quick).await;
    assert!(
        owners.iter().all(|(_, o, _)| o.as_deref() == Some("a")),
        "read ahead of any claim: the prepared accounts are still a's ({owners:?})"
    );
    unlock(lock).await;
    b_takes_every_account_and_stops(&mut conn, a, b, broker, slow).await;
}

/// A session started on a prepared login asks its first reads of the database (its links, its
/// masters' snapshots, its ledgers) before the login's fence is raised, so that the raise, a
/// round trip to the trade server, runs beside them instead of before them. With both trade
/// servers holding every fence raise and the copy ledger locked by the test, b's read of the
/// moved followers' ledgers waits on the lock while their raises are still unanswered, and only
/// after b's claim of them committed (the old owner's ledger rows are all in by then).
#[tokio::test]
async fn a_prepared_sessions_first_reads_go_beside_its_fence_raise() {
    let (setup, a, b, held_by_a, slow) =
        a_stopping_with_a_slow_follower("handoff-reads-beside-raise").await;
    let CopySetup {
        db,
        broker,
        mut conn,
        ..
    } = setup;
    const LEDGER_READ: &str = "%JOIN copy_ledger l%";
    broker.hold_fences(true);
    slow.hold_fences(true);
    // Nothing of b reads the ledger now: its sessions read it as they start.
    let lock = locked(&db, "copy_ledger").await;
    assert_eq!(b_waiting_on_a_lock(&mut conn, LEDGER_READ).await, 0);
    let quick = answered_quick(&db, &a, &held_by_a).await;
    eventually(
        "b claims the quick followers and reads their ledgers with their raises held",
        WAIT,
        async || (b_waiting_on_a_lock(&mut conn, LEDGER_READ).await > 0).then_some(()),
    )
    .await;
    // Read after b's claim of them committed, and before the trade server had their fences.
    for (id, owner, epoch) in owners_of(&mut conn, &quick).await {
        assert_eq!(owner.as_deref(), Some("b"), "account {id} claimed by b");
        let fence = broker.fence_of(&format!("f{id}"));
        assert!(
            fence.is_none_or(|f| f < epoch),
            "f{id}'s fence at the trade server is {fence:?}: b's epoch {epoch} was raised before its first reads"
        );
    }
    unlock(lock).await;
    broker.hold_fences(false);
    slow.hold_fences(false);
    b_takes_every_account_and_stops(&mut conn, a, b, broker, slow).await;
}

/// The releases of hand-offs closed together ([`Together`]) go in one statement once they all
/// came, even to a releaser that is idle (which sends a lone write at once); a member whose
/// session is slow to stop (its release not come within [`TOGETHER_WITHIN`]) does not hold the
/// others, and goes alone when it comes. Judged by the test's own trigger: the transaction of
/// each change of owner, as PostgreSQL ran it.
#[tokio::test]
async fn releases_closed_together_go_in_one_statement_without_waiting_for_a_straggler() {
    let db = crate::support::TestDb::new().await;
    let mut conn = db.conn().await;
    for id in 1..=5 {
        add_account(&mut conn, id, "follower", "127.0.0.1:1", &format!("f{id}")).await;
    }
    crate::support::insert_node(&mut conn, "n1", "1 minute", 5).await;
    sqlx::query(
        "UPDATE trading_accounts SET node_id = 'n1', owner_epoch = id * 10, \
         lease_until = now() + interval '1 minute'",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    record_owner_changes(&mut conn).await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let releaser = Releaser::spawn_pooled(copier_node::db::Db::direct(pool));
    let job = |id: i64| Releasing {
        node_id: "n1".into(),
        release: Release {
            account_id: id,
            epoch: id * 10,
            status: "released: shutdown".into(),
            to: None,
        },
    };
    let step = |ids: &[i64]| {
        let together = std::sync::Arc::new(Together::default());
        for &id in ids {
            together.join((id, id * 10));
        }
        together.seal();
        for &id in ids {
            together.answered((id, id * 10), false);
        }
        together
    };
    let released = async |handle: Option<tokio::sync::oneshot::Receiver<_>>| {
        let handle = handle.expect("a member closed with the others goes with them");
        let outcome = tokio::time::timeout(WAIT, async {
            let submitted: copier_node::handoff::ReleaseHandle = handle.await.unwrap();
            submitted.outcome().await
        })
        .await
        .expect("the releases closed together go without the member still stopping");
        assert_eq!(outcome, Ok(true), "released");
    };

    // Accounts 1 and 2 came; 3 is still stopping: 1 and 2 go without it, and 3 alone after.
    let together = step(&[1, 2, 3]);
    let one = together.release((1, 10), job(1), &releaser);
    let two = together.release((2, 20), job(2), &releaser);
    released(one).await;
    released(two).await;
    assert!(
        together.release((3, 30), job(3), &releaser).is_none(),
        "the straggler goes alone"
    );
    assert_eq!(releaser.write(job(3)).await, Ok(true));
    // Accounts 4 and 5 both came: they go at the second's coming, together.
    let together = step(&[4, 5]);
    let four = together.release((4, 40), job(4), &releaser);
    let five = together.release((5, 50), job(5), &releaser);
    released(four).await;
    released(five).await;

    let changes = owner_changes(&mut conn).await;
    let released_in = |ids: &[i64]| transactions_of(&changes, &ids.iter().copied().collect()).len();
    assert_eq!(released_in(&[1, 2]), 1, "{changes:?}");
    assert_eq!(released_in(&[1, 2, 3]), 2, "{changes:?}");
    assert_eq!(released_in(&[4, 5]), 1, "{changes:?}");
    assert_eq!(changes.len(), 5, "every account released once: {changes:?}");
}

/// Node a holding followers, one of them (`f7`) on a trade server whose logins take
/// [`LOGIN_DELAY`], beside node b at its fair share; `handoff_prepare` 10 s on a. Returns the
/// setup (the quick server's), both nodes, the logins a holds and the slow server.
async fn a_stopping_with_a_slow_follower(
    name: &str,
) -> (
    CopySetup,
    copier_node::app::NodeHandle,
    copier_node::app::NodeHandle,
    Vec<String>,
    SimBroker,
) {
    let mut setup = CopySetup::unprotected(name).await;
    let (conn, db) = (&mut setup.conn, &setup.db);
    let mut slow_options = ServeOptions::new("127.0.0.1:0", setup.dir.path("slow.jsonl"));
    slow_options.fence_check = false;
    slow_options.dedupe = false;
    slow_options.login_delay = LOGIN_DELAY;
    let slow = SimBroker::start(slow_options).await.unwrap();
    // A master and five followers on the quick server, follower 7 on the slow one. A fair-share
    // move hands the oldest claimed off first (the lowest ids, all claimed in one cycle), so a
    // keeps the slow follower.
    add_account(conn, 1, "master", &setup.addr, "m1").await;
    for id in 2..=7 {
        let server = if id == 7 {
            slow.addr.to_string()
        } else {
            setup.addr.clone()
        };
        add_account(conn, id, "follower", &server, &format!("f{id}")).await;
        add_link(conn, 1, id, LinkSpec::default()).await;
    }
    let mut a_config = config(db, "a", 100, FAST);
    a_config.handoff_prepare = Duration::from_secs(10);
    let a = start_node(&a_config).await;
    wait_state(&a.state, "a owns every account", WAIT, |s| {
        s.owned.len() == 7
    })
    .await;
    followers_reconciled(conn).await;
    let b = start_node(&config(db, "b", 100, FAST)).await;
    let held_by_a = settled_split(conn, &a, &b, 7).await;
    wait_state(&b.state, "b at its fair share", WAIT, |s| {
        s.target.is_some_and(|t| s.owned.len() as u32 >= t)
    })
    .await;
    assert!(
        held_by_a.contains(&"f7".to_string()) && !held_by_a.contains(&"m1".to_string()),
        "a keeps the newest ids, the slow follower among them, and b the master: {held_by_a:?}"
    );
    (setup, a, b, held_by_a, slow)
}

/// A connection of the test's own holding `table` locked against every reader until
/// [`unlock`].
async fn locked(db: &crate::support::TestDb, table: &str) -> sqlx::PgConnection {
    let mut lock = db.conn().await;
    sqlx::raw_sql(&format!(
        "BEGIN; LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"
    ))
    .execute(&mut lock)
    .await
    .unwrap();
    lock
}

async fn unlock(mut lock: sqlx::PgConnection) {
    sqlx::raw_sql("COMMIT").execute(&mut lock).await.unwrap();
}

/// How many of node b's statements whose text is `like` wait for a lock, by PostgreSQL's own
/// view of b's connections.
async fn b_waiting_on_a_lock(conn: &mut sqlx::PgConnection, like: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'copier-node b' \
         AND wait_event_type = 'Lock' AND query LIKE $1",
    )
    .bind(like)
    .fetch_one(conn)
    .await
    .unwrap()
}

/// Each of `ids`' owner and epoch as the database holds them now.
async fn owners_of(
    conn: &mut sqlx::PgConnection,
    ids: &BTreeSet<i64>,
) -> Vec<(i64, Option<String>, i64)> {
    sqlx::query_as(
        "SELECT id, node_id, owner_epoch FROM trading_accounts WHERE id = ANY($1) ORDER BY id",
    )
    .bind(ids.iter().copied().collect::<Vec<i64>>())
    .fetch_all(conn)
    .await
    .unwrap()
}

/// The end of [`a_stopping_with_a_slow_follower`]'s tests: a stops, b owns every account and
/// its followers reconcile, then b and both trade servers stop.
async fn b_takes_every_account_and_stops(
    conn: &mut sqlx::PgConnection,
    a: copier_node::app::NodeHandle,
    b: copier_node::app::NodeHandle,
    broker: SimBroker,
    slow: SimBroker,
) {
    a.wait().await.unwrap();
    wait_state(&b.state, "b owns every account", WAIT, |s| {
        s.owned.len() == 7
    })
    .await;
    followers_reconciled(conn).await;
    b.shutdown();
    b.wait().await.unwrap();
    broker.stop().await;
    slow.stop().await;
}

/// The ids of followers' `logins` (`f<id>`).
fn ids_of(logins: &[String]) -> BTreeSet<i64> {
    logins.iter().map(|l| l[1..].parse().unwrap()).collect()
}

/// Stops a (SIGTERM) and waits until b answered a's offers of the quick server's followers it
/// holds ([`a_stopping_with_a_slow_follower`]); the slow one's answer comes a login later.
/// Returns those followers' ids.
async fn answered_quick(
    db: &crate::support::TestDb,
    a: &copier_node::app::NodeHandle,
    held_by_a: &[String],
) -> BTreeSet<i64> {
    let mut answers = PgListener::connect(&db.url).await.unwrap();
    answers.listen("copier_handoff").await.unwrap();
    a.shutdown();
    let quick: BTreeSet<i64> = ids_of(held_by_a)
        .into_iter()
        .filter(|id| *id != 7)
        .collect();
    let mut answered = BTreeSet::new();
    tokio::time::timeout(WAIT, async {
        while answered != quick {
            let n = answers.recv().await.unwrap();
            let v: serde_json::Value = serde_json::from_str(n.payload()).unwrap();
            let id = v["account_id"].as_i64().unwrap();
            if v["ready"] == true && v["from"] == "a" && v["to"] == "b" {
                assert_ne!(id, 7, "the slow follower answered before the quick ones");
                answered.insert(id);
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("b answers for {quick:?}; answered {answered:?}"));
    quick
}

/// A change of an account's owner, as the test's trigger recorded it ([`record_owner_changes`]).
#[derive(Debug)]
struct OwnerChange {
    /// The transaction that made it (PostgreSQL's id).
    xact: String,
    id: i64,
    old_node: Option<String>,
    new_node: Option<String>,
}

/// From now on, every change of an account row's owner is recorded with the transaction that
/// made it, by a trigger of the test's own (read by [`owner_changes`]).
async fn record_owner_changes(conn: &mut sqlx::PgConnection) {
    sqlx::raw_sql(
        r#"
CREATE TABLE owner_changes (xact text NOT NULL, id bigint NOT NULL, old_node text, new_node text);
CREATE FUNCTION note_owner_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO owner_changes VALUES (pg_current_xact_id()::text, NEW.id, OLD.node_id, NEW.node_id);
    RETURN NEW;
END $$;
CREATE TRIGGER note_owner_change AFTER UPDATE ON trading_accounts FOR EACH ROW
    WHEN (OLD.node_id IS DISTINCT FROM NEW.node_id) EXECUTE FUNCTION note_owner_change();
"#,
    )
    .execute(conn)
    .await
    .unwrap();
}

async fn owner_changes(conn: &mut sqlx::PgConnection) -> Vec<OwnerChange> {
    let rows: Vec<(String, i64, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT xact, id, old_node, new_node FROM owner_changes")
            .fetch_all(conn)
            .await
            .unwrap();
    rows.into_iter()
        .map(|(xact, id, old_node, new_node)| OwnerChange {
            xact,
            id,
            old_node,
            new_node,
        })
        .collect()
}

/// The transactions that changed the owner of any of `ids`.
fn transactions_of<'a>(changes: &'a [OwnerChange], ids: &BTreeSet<i64>) -> BTreeSet<&'a str> {
    changes
        .iter()
        .filter(|c| ids.contains(&c.id))
        .map(|c| c.xact.as_str())
        .collect()
}

/// A prepared hand-off's receiver reads the account ahead of its claim, and its stream brings the
/// read current: its first order after the claim needs no read. Judged from the broker's journal
/// with every read journaled: for each follower the new node took, the new node read its pending
/// orders, positions and history between its prepared login and the raise, and read nothing of
/// it (nor the server's symbols) between the raise and its first order, a copy of a trade made
/// after the move. The reads are slow (as a real trade server's), and nothing is copied twice.
#[tokio::test]
async fn a_receivers_first_order_after_a_prepared_claim_needs_no_read() {
    let (
        CopySetup {
            db,
            dir,
            broker,
            t,
            mut conn,
            ..
        },
        a,
    ) = seven_accounts_on_a_with("handoff-read-ahead", |o| {
        o.journal_reads = true;
        o.login_delay = Duration::from_millis(300);
        o.read_delay = Duration::from_millis(200);
    })
    .await;
    let b = start_node(&config(&db, "b", 100, FAST)).await;
    let held_by_a = settled_split(&mut conn, &a, &b, 7).await;
    // b's sessions through their start (the trade below is then a copy each, not a snapshot a
    // slow start could find already closed).
    eventually("b's sessions started", WAIT, async || {
        let (_, metrics) = get(b.http_addr, "/metrics").await;
        (sample(&metrics, "copier_sessions_starting") == 0.0).then_some(())
    })
    .await;
    let trade = t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;
    t.close("m1", trade, None).await;
    let lines = copied_once_each(&dir, 1).await;

    let moved: Vec<String> = (2..=7)
        .map(|id| format!("f{id}"))
        .filter(|l| !held_by_a.contains(l))
        .collect();
    // b's share is three or more of the seven; the master may be one of them.
    let master_moved = !held_by_a.iter().any(|l| l == "m1");
    assert!(
        moved.len() + usize::from(master_moved) >= 3,
        "b took its share: a holds {held_by_a:?}"
    );
    const READS: [&str; 5] = ["positions", "history", "orders", "account", "symbols"];
    for login in &moved {
        let at_b: Vec<(usize, &copier_node::sim_broker::journal::JournalEntry)> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.client == "b" && l.login == *login)
            .collect();
        let prepared = at_b
            .iter()
            .find(|(_, l)| l.action == "login" && l.fence.is_none())
            .map(|(i, _)| *i)
            .unwrap_or_else(|| panic!("{login}: b made no prepared login"));
        let raise = at_b
            .iter()
            .find(|(_, l)| l.action == "login" && l.fence.is_some())
            .map(|(i, _)| *i)
            .unwrap_or_else(|| panic!("{login}: b never raised its fence"));
        let first_order = at_b
            .iter()
            .find(|(i, l)| *i > raise && l.login == *login && !READS.contains(&l.action.as_str()))
            .map(|(i, l)| (*i, l.action.as_str(), l.comment.clone()))
            .unwrap_or_else(|| panic!("{login}: b sent no order after its claim"));
        assert_eq!(
            (first_order.1, first_order.2.as_deref()),
            ("open", Some(format!("mc{trade}").as_str())),
            "{login}: b's first order copies the trade"
        );
        let read_ahead: Vec<&str> = at_b
            .iter()
            .filter(|(i, l)| *i > prepared && *i < raise && l.login == *login)
            .map(|(_, l)| l.action.as_str())
            .collect();
        for read in ["orders", "positions", "history"] {
            assert!(
                read_ahead.contains(&read),
                "{login}: b read {read:?} ahead of its claim: {read_ahead:?}"
            );
        }
        let read_after: Vec<&str> = at_b
            .iter()
            .filter(|(i, l)| *i > raise && *i < first_order.0 && READS.contains(&l.action.as_str()))
            .map(|(_, l)| l.action.as_str())
            .collect();
        assert!(
            read_after.is_empty(),
            "{login}: b read between its claim and its first order: {read_after:?}"
        );
    }
    // The master, if b took it, published its first snapshot from its read ahead: b read
    // nothing of it after the raise (its next reads come on its own periods, 15 s at the
    // earliest).
    if master_moved {
        let of_m1: Vec<(usize, &str, Option<i64>)> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| l.client == "b" && l.login == "m1")
            .map(|(i, l)| (i, l.action.as_str(), l.fence))
            .collect();
        let raise = of_m1
            .iter()
            .find(|(_, action, fence)| *action == "login" && fence.is_some())
            .map(|(i, ..)| *i)
            .expect("b raised m1's fence");
        let read_after: Vec<&str> = of_m1
            .iter()
            .filter(|(i, action, _)| *i > raise && READS.contains(action))
            .map(|(_, action, _)| *action)
            .collect();
        assert!(
            read_after.is_empty(),
            "m1: b read after its claim: {read_after:?}"
        );
    }
    // The server's symbols name no login: b read them once per prepared login (its read ahead)
    // and never for a session it started from one.
    let at_b = |action: &str, fenced: bool| {
        lines
            .iter()
            .filter(|l| l.client == "b" && l.action == action && l.fence.is_some() == fenced)
            .count()
    };
    assert_eq!(
        at_b("symbols", false),
        at_b("login", false),
        "b read the symbols once per read ahead"
    );
    // Every login b raised carried its read ahead, current.
    let (_, metrics) = get(b.http_addr, "/metrics").await;
    let raised = sample(&metrics, "copier_handoff_logins_total{outcome=\"raised\"}");
    assert!(raised >= 3.0, "{raised}");
    assert_eq!(
        sample(&metrics, "copier_handoff_logins_total{outcome=\"current\"}"),
        raised
    );
    for n in [a, b] {
        n.shutdown();
        n.wait().await.unwrap();
    }
    broker.stop().await;
}

/// A master's hand-off costs its followers no read: the new owner publishes the master's
/// snapshot under its epoch, and followers whose copies already follow exactly that take it
/// without reconciling (a reconcile reads each follower's broker account: with a slow trade
/// server every follower would stall). Judged from the journal with every read journaled: from
/// the master's raise at its new owner until every follower's copy of its position is closed,
/// the followers' node read no follower's positions, orders or history (what a reconcile reads;
/// the periodic funds read of `account` may fall in the window), and each copy was opened once.
#[tokio::test]
async fn a_masters_hand_off_costs_its_followers_no_read() {
    // b has room for the master (seven by capacity: a keeps the master until it stops, as the
    // helper says, and b takes it then).
    let (setup, a, b, held) = master_on_a_followers_on_b("handoff-master-moves", 7).await;
    let CopySetup {
        dir,
        broker,
        t,
        mut conn,
        ..
    } = setup;
    let published_at = async |conn: &mut sqlx::PgConnection| -> i64 {
        sqlx::query_scalar("SELECT epoch FROM master_state WHERE master_id = 1")
            .fetch_one(conn)
            .await
            .unwrap()
    };
    let old_epoch = published_at(&mut conn).await;
    a.shutdown();
    a.wait().await.unwrap();
    wait_state(&b.state, "b owns the master too", WAIT, |s| {
        s.owned.len() == 7
    })
    .await;
    // The new owner has published (a close before that would be in its first snapshot, which
    // the followers would then rightly reconcile against).
    eventually(
        "the master published under its new owner",
        WAIT,
        async || (published_at(&mut conn).await > old_epoch).then_some(()),
    )
    .await;
    // Every follower has moved on to the new owner's publication (taken or reconciled: the
    // journal judges which) before the master trades again, so that the close below is not
    // itself the news of the new epoch (a follower busy meanwhile would then rightly reconcile).
    let epoch = published_at(&mut conn).await;
    eventually(
        "every follower at the master's new epoch",
        WAIT,
        async || {
            let at: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM trading_accounts WHERE id BETWEEN 2 AND 7 AND status LIKE $1",
            )
            .bind(format!("follower: master 1 at epoch {epoch} %"))
            .fetch_one(&mut conn)
            .await
            .unwrap();
            (at == 6).then_some(())
        },
    )
    .await;
    t.close("m1", held, None).await;
    let lines = copied_once_each(&dir, 1).await;

    // From b's first login of the master (its prepared login, then the raise).
    let taken = lines
        .iter()
        .position(|l| l.client == "b" && l.login == "m1" && l.action == "login")
        .expect("b took the master through its login");
    assert!(
        lines[taken..].iter().any(|l| l.client == "b"
            && l.login == "m1"
            && l.action == "login"
            && l.fence.is_some()),
        "b raised the master's fence"
    );
    let last_close = lines
        .iter()
        .rposition(|l| l.client == "b" && l.action == "close" && l.accepted)
        .expect("b closed the copies");
    let reads = followers_read_by_b(&lines[taken..last_close]);
    assert!(
        reads.is_empty(),
        "b read its followers while the master moved: {reads:?}"
    );
    b.shutdown();
    b.wait().await.unwrap();
    broker.stop().await;
}

/// A trade while the master moves costs its followers no read either: the new owner's first
/// snapshot differs from what the copies follow by a position opened while no node held the
/// master, and the followers decide it as its open event would have been decided, from the
/// copies they know, instead of reconciling (a reconcile reads each follower's broker account:
/// with a slow trade server every follower would stall). a holds the master and stops; b, full
/// with the six followers, cannot take it; the master opens a position; c starts and takes the
/// master. Judged from the journal with every read journaled: from c's first login of the
/// master until the last copy of that position, b read no follower's positions, orders or
/// history; each position was copied once to each follower (the one held across the move
/// too), and every copy closed.
#[tokio::test]
async fn a_trade_while_the_master_moves_costs_its_followers_no_read() {
    // b, at capacity 6, has no room for the master once a stops.
    let (setup, a, b, held) =
        master_on_a_followers_on_b("handoff-master-trades-while-moving", 6).await;
    let CopySetup {
        db,
        dir,
        broker,
        t,
        mut conn,
        ..
    } = setup;
    a.shutdown();
    a.wait().await.unwrap();
    eventually("the master free", WAIT, async || {
        let owner: Option<String> =
            sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = 1")
                .fetch_one(&mut conn)
                .await
                .unwrap();
        owner.is_none().then_some(())
    })
    .await;
    // The master trades while no node holds it: its next owner's first snapshot carries it.
    let during = t.open("m1", "GBPUSD", Side::Sell, 1.0, None, None).await;
    let c = start_node(&config(&db, "c", 1, UNHURRIED)).await;
    eventually(
        "the position opened during the move copied everywhere",
        WAIT,
        async || {
            let lines = journal(&dir.path("journal.jsonl"));
            let copied = (2..=7)
                .filter(|id| {
                    lines.iter().any(|l| {
                        l.accepted
                            && l.action == "open"
                            && l.login == format!("f{id}")
                            && l.comment
                                .as_deref()
                                .is_some_and(|c| c.contains(&during.to_string()))
                    })
                })
                .count();
            (copied == 6).then_some(())
        },
    )
    .await;
    t.close("m1", held, None).await;
    t.close("m1", during, None).await;
    let lines = copied_once_each(&dir, 2).await;
    let taken = lines
        .iter()
        .position(|l| l.client == "c" && l.login == "m1" && l.action == "login")
        .expect("c took the master through its login");
    let last_copy = lines
        .iter()
        .rposition(|l| {
            l.client == "b"
                && l.action == "open"
                && l.accepted
                && l.comment
                    .as_deref()
                    .is_some_and(|c| c.contains(&during.to_string()))
        })
        .expect("b copied the position opened during the move");
    let reads = followers_read_by_b(&lines[taken..last_copy]);
    assert!(
        reads.is_empty(),
        "b read its followers to copy a trade made while the master moved: {reads:?}"
    );
    for n in [b, c] {
        n.shutdown();
        n.wait().await.unwrap();
    }
    broker.stop().await;
}

/// What node b read of its followers in `lines` that a reconcile reads (positions, history,
/// orders; the periodic funds read of `account` is not one), as (login, action).
fn followers_read_by_b(
    lines: &[copier_node::sim_broker::journal::JournalEntry],
) -> Vec<(&str, &str)> {
    lines
        .iter()
        .filter(|l| l.client == "b" && l.login.starts_with('f'))
        .filter(|l| ["positions", "history", "orders"].contains(&l.action.as_str()))
        .map(|l| (l.login.as_str(), l.action.as_str()))
        .collect()
}

/// The start of the master's-move tests: a slow trade server (every read 200 ms and journaled,
/// fence check and dedupe off, as MT4/MT5 servers); master 1 (`m1`) and six followers 2..=7
/// linked to it; node a holds the master alone and node b the followers, every follower
/// reconciled; then a position opened on the master (returned, with the setup and the nodes)
/// and copied to all six by b. Claims go by id: a, of capacity 1, takes the master, and keeps it
/// until it stops (with a larger a, or a larger share of it, a cycle reading b before b
/// published its claims could hand the master off early); b's capacity (`b_capacity`) says
/// whether it has room for the master once a stops.
async fn master_on_a_followers_on_b(
    name: &str,
    b_capacity: u32,
) -> (
    CopySetup,
    copier_node::app::NodeHandle,
    copier_node::app::NodeHandle,
    i64,
) {
    let mut setup = CopySetup::with(name, |o| {
        o.fence_check = false;
        o.dedupe = false;
        o.journal_reads = true;
        o.read_delay = Duration::from_millis(200);
    })
    .await;
    let addr = setup.addr.clone();
    add_account(&mut setup.conn, 1, "master", &addr, "m1").await;
    for id in 2..=7 {
        add_account(&mut setup.conn, id, "follower", &addr, &format!("f{id}")).await;
        add_link(&mut setup.conn, 1, id, LinkSpec::default()).await;
    }
    let a = start_node(&config(&setup.db, "a", 1, UNHURRIED)).await;
    wait_state(&a.state, "a owns the master", WAIT, |s| {
        s.owned.contains_key(&1)
    })
    .await;
    let b = start_node(&config(&setup.db, "b", b_capacity, UNHURRIED)).await;
    wait_state(&b.state, "b owns the followers", WAIT, |s| {
        s.owned.len() == 6
    })
    .await;
    followers_reconciled(&mut setup.conn).await;
    let held = setup
        .t
        .open("m1", "EURUSD", Side::Buy, 1.0, None, None)
        .await;
    let dir = &setup.dir;
    eventually("the held position copied everywhere", WAIT, async || {
        let copied = journal(&dir.path("journal.jsonl"))
            .iter()
            .filter(|l| l.accepted && l.action == "open" && l.client == "b")
            .count();
        (copied == 6).then_some(())
    })
    .await;
    (setup, a, b, held)
}

/// `login` moved from `old` to `new` by a prepared hand-off, judged from the journal: `new`
/// logged it in twice, first without a fence (the prepared login) and then with one (the raise),
/// every order of `old` precedes that raise and every order of `new` follows it.
fn assert_prepared_then_raised(
    lines: &[copier_node::sim_broker::journal::JournalEntry],
    login: &str,
    old: &str,
    new: &str,
) {
    let of: Vec<(usize, &copier_node::sim_broker::journal::JournalEntry)> = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.login == login)
        .collect();
    let new_logins: Vec<Option<i64>> = of
        .iter()
        .filter(|(_, l)| l.client == new && l.action == "login")
        .map(|(_, l)| l.fence)
        .collect();
    assert!(
        new_logins.len() == 2 && new_logins[0].is_none() && new_logins[1].is_some(),
        "{login}: {new}'s logins {new_logins:?} (expected a prepared login, then its raise)"
    );
    let raise = of
        .iter()
        .find(|(_, l)| l.client == new && l.action == "login" && l.fence.is_some())
        .map(|(i, _)| *i)
        .unwrap();
    // The raise fences the old owner out: above every fence the old owner logged in or sent
    // with (a raise to anything lower would leave its late orders passing a fence check).
    let raised = of[of.iter().position(|(i, _)| *i == raise).unwrap()]
        .1
        .fence;
    let old_highest = of
        .iter()
        .filter(|(_, l)| l.client == old)
        .filter_map(|(_, l)| l.fence)
        .max();
    assert!(
        raised > old_highest,
        "{login}: {new} raised the fence to {raised:?}, not above {old}'s {old_highest:?}"
    );
    for (i, l) in of.iter().filter(|(_, l)| l.action != "login") {
        if l.client == old {
            assert!(*i < raise, "{login}: {old} sent after {new}'s raise: {l:?}");
        } else if l.client == new {
            assert!(*i > raise, "{login}: {new} sent before its raise: {l:?}");
        }
    }
}

/// A master and six followers (fence check and dedupe off, a slow login), all owned by node a
/// (`handoff_prepare` 10 s), every follower's session reconciled.
async fn seven_accounts_on_a(name: &str) -> (CopySetup, copier_node::app::NodeHandle) {
    seven_accounts_on_a_with(name, |_| {}).await
}

/// As [`seven_accounts_on_a`], the broker's options then tuned.
async fn seven_accounts_on_a_with(
    name: &str,
    tune: impl FnOnce(&mut copier_node::sim_broker::ServeOptions),
) -> (CopySetup, copier_node::app::NodeHandle) {
    let mut setup = CopySetup::with(name, |o| {
        o.fence_check = false;
        o.dedupe = false;
        o.login_delay = LOGIN_DELAY;
        tune(o);
    })
    .await;
    let (conn, addr) = (&mut setup.conn, setup.addr.clone());
    add_seven_accounts(conn, &addr).await;
    let mut a_config = config(&setup.db, "a", 100, FAST);
    a_config.handoff_prepare = Duration::from_secs(10);
    let a = start_node(&a_config).await;
    wait_state(&a.state, "a owns every account", WAIT, |s| {
        s.owned.len() == 7
    })
    .await;
    followers_reconciled(conn).await;
    (setup, a)
}

/// A master (1, `m1`) and six followers of it (2 to 7, `f2` to `f7`) on the broker at `addr`.
async fn add_seven_accounts(conn: &mut sqlx::PgConnection, addr: &str) {
    add_account(conn, 1, "master", addr, "m1").await;
    for id in 2..=7 {
        add_account(conn, id, "follower", addr, &format!("f{id}")).await;
        add_link(conn, 1, id, LinkSpec::default()).await;
    }
}

/// Waits until every follower's session has reconciled with its master.
async fn followers_reconciled(conn: &mut sqlx::PgConnection) {
    eventually("follower sessions to reconcile", WAIT, async || {
        let ready: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM trading_accounts WHERE id BETWEEN 2 AND 7 AND status LIKE 'follower: master%'",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        (ready == 6).then_some(())
    })
    .await;
}

/// Waits until the rows show all `accounts` owned by a or b, b holding at least three, and both
/// nodes' sessions matching the rows (no move under way); returns the logins a holds.
async fn settled_split(
    conn: &mut sqlx::PgConnection,
    a: &copier_node::app::NodeHandle,
    b: &copier_node::app::NodeHandle,
    accounts: usize,
) -> Vec<String> {
    let mut last = (Vec::new(), 0, 0);
    let settled = tokio::time::timeout(WAIT, async {
        loop {
            let rows: Vec<(i64, Option<String>)> =
                sqlx::query_as("SELECT id, node_id FROM trading_accounts ORDER BY id")
                    .fetch_all(&mut *conn)
                    .await
                    .unwrap();
            let at = |node: &str| -> Vec<i64> {
                rows.iter()
                    .filter(|(_, n)| n.as_deref() == Some(node))
                    .map(|(id, _)| *id)
                    .collect()
            };
            let (at_a, at_b) = (at("a"), at("b"));
            let running_a: Vec<i64> = a.state.borrow().owned.keys().copied().collect();
            let running_b: Vec<i64> = b.state.borrow().owned.keys().copied().collect();
            if at_a.len() + at_b.len() == accounts
                && at_b.len() >= 3
                && at_a == running_a
                && at_b == running_b
            {
                break at_a;
            }
            last = (rows, running_a.len(), running_b.len());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let at_a = settled.unwrap_or_else(|_| {
        panic!(
            "the split did not settle in {WAIT:?}: rows {:?}, sessions at a {}, at b {}",
            last.0, last.1, last.2
        )
    });
    at_a.into_iter()
        .map(|id| {
            if id == 1 {
                "m1".into()
            } else {
                format!("f{id}")
            }
        })
        .collect()
}

/// The first follower `from` offers to `to` on `copier_handoff`.
async fn first_offer(offers: &mut PgListener, from: &str, to: &str) -> i64 {
    tokio::time::timeout(WAIT, async {
        loop {
            let n = offers.recv().await.unwrap();
            let v: serde_json::Value = serde_json::from_str(n.payload()).unwrap();
            let id = v["account_id"].as_i64().unwrap();
            if v["ready"] == false && v["from"] == from && v["to"] == to && id != 1 {
                break id;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{from} offers a follower to {to}"))
}

/// Waits until each of the six followers opened and closed `trades` copies, then checks S2 from
/// the journal (one accepted open per follower and master position, the copy's comment naming
/// it: `trades` per follower); returns the journal.
async fn copied_once_each(
    dir: &crate::support::broker::Scratch,
    trades: usize,
) -> Vec<copier_node::sim_broker::journal::JournalEntry> {
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
    eventually("every copy closed", WAIT, async || {
        let per = opens_and_closes(&journal(&dir.path("journal.jsonl")));
        (2..=7)
            .all(|id| {
                let login = format!("f{id}");
                per.get(&(login.clone(), "open".into())) >= Some(&trades)
                    && per.get(&(login, "close".into())) >= Some(&trades)
            })
            .then_some(())
    })
    .await;
    let lines = journal(&dir.path("journal.jsonl"));
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
    assert_eq!(copies.len(), 6 * trades, "{copies:?}");
    lines
}

/// Which node's client opened `login`'s copy of master ticket `ticket`.
fn copied_by<'a>(
    lines: &'a [copier_node::sim_broker::journal::JournalEntry],
    login: &str,
    ticket: i64,
) -> &'a str {
    lines
        .iter()
        .find(|l| {
            l.login == login
                && l.action == "open"
                && l.accepted
                && l.comment
                    .as_deref()
                    .is_some_and(|c| c.contains(&ticket.to_string()))
        })
        .map(|l| l.client.as_str())
        .unwrap_or_else(|| panic!("{login} has no copy of {ticket}"))
}
