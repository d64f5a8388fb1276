//! The lease statements themselves, driven directly against a real PostgreSQL.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use copier_node::db::lease::{self, CycleParams};
use copier_node::db::status::{self, Outcome, StatusUpdate};
use sqlx::{Executor, PgConnection, Row};

use crate::support::{TestDb, eventually, insert_accounts};

const LEASE: Duration = Duration::from_secs(3);

fn params<'a>(
    node_id: &'a str,
    instance_id: &'a str,
    capacity: u32,
    held: &'a [i64],
) -> CycleParams<'a> {
    CycleParams {
        node_id,
        instance_id,
        platform: "mt5",
        capacity,
        claim_limit: capacity,
        trust: Duration::from_secs(2),
        owned: held.len() as u32,
        starting: 0,
        lease: LEASE,
        held,
        claim: true,
        kept: &[],
    }
}

async fn wait_expired(conn: &mut PgConnection, node_id: &str) {
    eventually(format!("leases of {node_id} to expire"), Duration::from_secs(10), async || {
        let live: i64 = sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id = $1 AND lease_until >= now()")
            .bind(node_id)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        let member_live: bool = sqlx::query_scalar("SELECT coalesce(bool_or(lease_until >= now()), false) FROM nodes WHERE node_id = $1")
            .bind(node_id)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        (live == 0 && !member_live).then_some(())
    })
    .await;
}

#[tokio::test]
async fn concurrent_claims_never_hand_a_row_to_two_claimers() {
    let db = TestDb::new().await;
    let mut setup = db.conn().await;
    insert_accounts(&mut setup, 1..=1000, "mt5").await;
    insert_accounts(&mut setup, 1001..=1100, "mt4").await;
    sqlx::query("UPDATE trading_accounts SET enabled = false WHERE id % 50 = 0")
        .execute(&mut setup)
        .await
        .unwrap();

    // 32 claimers of capacity 40 race, cycle after cycle, each on its own connection, under a
    // lease no race outlasts: a row taken from a claimer whose lease had lapsed would be a
    // rightful claim, not two owners (with the 3 s lease, a claimer finishing its rounds early
    // on a loaded machine lost row 1 to one still racing 3 s later, as it should).
    const RACE_LEASE: Duration = Duration::from_secs(600);
    let mut tasks = Vec::new();
    for n in 0..32 {
        let db_url = db.url.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn: PgConnection = sqlx::Connection::connect(&db_url).await.unwrap();
            let node = format!("claimer-{n}");
            let mut held: Vec<i64> = Vec::new();
            let mut rounds = Vec::new();
            for _ in 0..4 {
                let cycle = CycleParams {
                    lease: RACE_LEASE,
                    trust: RACE_LEASE / 2,
                    ..params(&node, "i", 40, &held)
                };
                let out = lease::cycle(&mut conn, &cycle).await.unwrap();
                assert!(out.member);
                held = out.owned.iter().map(|r| r.epoch).collect();
                rounds.push(out.owned);
            }
            (node, rounds)
        }));
    }
    let mut final_owned: HashMap<i64, String> = HashMap::new();
    let mut final_epoch: HashMap<i64, i64> = HashMap::new();
    let mut claimed_by: HashMap<i64, String> = HashMap::new();
    for t in tasks {
        let (node, rounds) = t.await.unwrap();
        for owned in &rounds {
            assert!(owned.len() <= 40, "{node} over capacity: {}", owned.len());
            // No lease lapses in the race: a row reported by two claimers, in any round, was
            // handed to both.
            for row in owned {
                if let Some(other) = claimed_by.insert(row.id, node.clone())
                    && other != node
                {
                    panic!("row {} handed to both {other} and {node}", row.id);
                }
            }
        }
        for row in rounds.last().unwrap() {
            final_epoch.insert(row.id, row.epoch);
            if let Some(other) = final_owned.insert(row.id, node.clone()) {
                panic!("row {} handed to both {other} and {node}", row.id);
            }
        }
    }
    let expected: HashSet<i64> = (1..=1000).filter(|id| id % 50 != 0).collect();
    let got: HashSet<i64> = final_owned.keys().copied().collect();
    assert_eq!(
        got, expected,
        "every enabled mt5 row owned once; no disabled or mt4 row claimed"
    );
    // The database agrees with what the claimers were told.
    let rows: Vec<(i64, Option<String>, i64)> = sqlx::query_as(
        "SELECT id, node_id, owner_epoch FROM trading_accounts WHERE platform = 'mt5' AND enabled",
    )
    .fetch_all(&mut setup)
    .await
    .unwrap();
    for (id, node, epoch) in rows {
        assert_eq!(
            node.as_deref(),
            final_owned.get(&id).map(String::as_str),
            "row {id}"
        );
        assert_eq!(Some(&epoch), final_epoch.get(&id), "row {id}'s epoch");
    }
}

#[tokio::test]
async fn a_claim_takes_at_most_the_free_capacity() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=20, "mt5").await;
    let first = lease::cycle(&mut conn, &params("a", "i", 5, &[]))
        .await
        .unwrap();
    assert_eq!(first.owned.len(), 5);
    let held: Vec<i64> = first.owned.iter().map(|r| r.epoch).collect();
    let again = lease::cycle(&mut conn, &params("a", "i", 8, &held))
        .await
        .unwrap();
    assert_eq!(again.owned.len(), 8, "renews 5 and claims 3 more");
    let renewed: HashMap<i64, i64> = again.owned.iter().map(|r| (r.id, r.epoch)).collect();
    for r in &first.owned {
        assert_eq!(renewed[&r.id], r.epoch, "a live held row keeps its epoch");
    }
}

#[tokio::test]
async fn renewal_never_revives_an_expired_lease() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=3, "mt5").await;
    let first = lease::cycle(&mut conn, &params("a", "i", 10, &[]))
        .await
        .unwrap();
    let held: Vec<i64> = first.owned.iter().map(|r| r.epoch).collect();
    wait_expired(&mut conn, "a").await;
    let before: HashMap<i64, i64> = first.owned.iter().map(|r| (r.id, r.epoch)).collect();
    let again = lease::cycle(&mut conn, &params("a", "i", 10, &held))
        .await
        .unwrap();
    assert_eq!(again.owned.len(), 3);
    for r in &again.owned {
        assert!(
            r.epoch > before[&r.id],
            "row {} expired, so it must be claimed again with a new epoch (R1)",
            r.id
        );
    }
}

async fn snapshot(conn: &mut PgConnection) -> Vec<(i64, String, i64, String)> {
    sqlx::query_as(
        "SELECT id, node_id, owner_epoch, lease_until::text FROM trading_accounts ORDER BY id",
    )
    .fetch_all(conn)
    .await
    .unwrap()
}

#[tokio::test]
async fn rows_left_by_an_earlier_instance_are_claimed_again_with_new_epochs() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=4, "mt5").await;
    let first = lease::cycle(&mut conn, &params("a", "first", 10, &[]))
        .await
        .unwrap();
    assert_eq!(first.owned.len(), 4);
    let before = snapshot(&mut conn).await;

    // A second instance with the same node id while the first is live changes nothing.
    let second = lease::cycle(&mut conn, &params("a", "second", 10, &[]))
        .await
        .unwrap();
    assert!(!second.member);
    assert!(second.owned.is_empty());
    let conflict = second.conflict.expect("the live instance is reported");
    assert_eq!(conflict.instance_id, "first");
    assert!(conflict.expires_in <= LEASE);
    assert_eq!(
        snapshot(&mut conn).await,
        before,
        "a refused instance writes nothing"
    );

    // Once the first instance's membership has expired, the second takes over and re-claims.
    wait_expired(&mut conn, "a").await;
    let second = lease::cycle(&mut conn, &params("a", "second", 10, &[]))
        .await
        .unwrap();
    assert!(second.member);
    let old: HashMap<i64, i64> = first.owned.iter().map(|r| (r.id, r.epoch)).collect();
    assert_eq!(second.owned.len(), 4);
    for r in &second.owned {
        assert!(
            r.epoch > old[&r.id],
            "row {} re-claimed with a new epoch",
            r.id
        );
    }
    let instance: String = sqlx::query_scalar("SELECT instance_id FROM nodes WHERE node_id = 'a'")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(instance, "second");
}

#[tokio::test]
async fn a_dead_nodes_rows_are_claimed_only_after_their_leases_expire() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=6, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 6, &[]))
        .await
        .unwrap();
    assert_eq!(a.owned.len(), 6);
    let a_lease: String = sqlx::query_scalar("SELECT max(lease_until)::text FROM trading_accounts")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    let b = lease::cycle(&mut conn, &params("b", "ib", 10, &[]))
        .await
        .unwrap();
    assert!(b.owned.is_empty(), "live leases are not claimable");
    assert_eq!(b.peers.len(), 1);
    assert!(b.peers[0].expires_in <= LEASE && b.peers[0].expires_in > Duration::ZERO);
    wait_expired(&mut conn, "a").await;
    let b = lease::cycle(&mut conn, &params("b", "ib", 10, &[]))
        .await
        .unwrap();
    assert_eq!(b.owned.len(), 6, "an expired node's rows are claimed");
    let early: i64 = sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id = 'b' AND claimed_at <= $1::timestamptz")
        .bind(&a_lease)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        early, 0,
        "no row was claimed before its lease_until ({a_lease})"
    );
}

#[tokio::test]
async fn a_fenced_write_is_rejected_after_another_node_took_the_account_over() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=1, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 1, &[]))
        .await
        .unwrap();
    let epoch_a = a.owned[0].epoch;
    let write = |node: &'static str, epoch: i64, text: &str| {
        let batch = vec![StatusUpdate {
            account_id: 1,
            epoch,
            status: Some(text.into()),
            balance: Some(1.0),
            equity: None,
            currency: Some("EUR".parse().unwrap()),
        }];
        (node, batch)
    };
    let (node, batch) = write("a", epoch_a, "from a");
    assert_eq!(
        status::write_batch(&mut conn, node, &batch).await.unwrap(),
        written(&[(1, epoch_a)])
    );

    wait_expired(&mut conn, "a").await;
    let b = lease::cycle(&mut conn, &params("b", "ib", 1, &[]))
        .await
        .unwrap();
    let epoch_b = b.owned[0].epoch;
    assert!(epoch_b > epoch_a);
    let (node, batch) = write("a", epoch_a, "stale write from a");
    assert!(
        status::write_batch(&mut conn, node, &batch).await.unwrap() == Outcome::default(),
        "the old owner's write must match nothing (neither written nor busy: lost)"
    );
    let (node, batch) = write("b", epoch_a, "b with a's epoch");
    assert!(
        status::write_batch(&mut conn, node, &batch).await.unwrap() == Outcome::default(),
        "the right node with a stale epoch matches nothing"
    );
    let (node, batch) = write("b", epoch_b, "from b");
    assert_eq!(
        status::write_batch(&mut conn, node, &batch).await.unwrap(),
        written(&[(1, epoch_b)])
    );
    let stored: String = sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(stored, "from b");
}

/// A batch's outcome with these pairs written and none busy.
fn written(pairs: &[(i64, i64)]) -> Outcome {
    Outcome {
        written: pairs.to_vec(),
        busy: Vec::new(),
    }
}

#[tokio::test]
async fn a_status_write_passes_over_a_row_another_statement_holds_and_reports_it_busy() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=3, "mt5").await;
    let out = lease::cycle(&mut conn, &params("a", "ia", 3, &[]))
        .await
        .unwrap();
    let epoch = |id: i64| out.owned.iter().find(|r| r.id == id).unwrap().epoch;
    let batch: Vec<StatusUpdate> = (1..=3)
        .map(|id| StatusUpdate {
            account_id: id,
            epoch: epoch(id),
            status: Some("connected".into()),
            balance: None,
            equity: None,
            currency: None,
        })
        .collect();
    // Row 2 held as the lease cycle's renewal holds it, in a transaction left open.
    let mut holder = db.conn().await;
    holder.execute("BEGIN").await.unwrap();
    holder
        .execute("SELECT FROM trading_accounts WHERE id = 2 FOR NO KEY UPDATE")
        .await
        .unwrap();
    // A write that waited for the row would fail here on its lock timeout.
    conn.execute("SET lock_timeout = '10s'").await.unwrap();
    let first = status::write_batch(&mut conn, "a", &batch).await.unwrap();
    let mut done = first.written.clone();
    done.sort();
    assert_eq!(done, vec![(1, epoch(1)), (3, epoch(3))]);
    assert_eq!(
        first.busy,
        vec![(2, epoch(2))],
        "the held row is busy, not lost"
    );
    let status_of = async |conn: &mut PgConnection, id: i64| -> Option<String> {
        sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = $1")
            .bind(id)
            .fetch_one(conn)
            .await
            .unwrap()
    };
    assert_eq!(
        status_of(&mut conn, 2).await,
        None,
        "the held row is untouched"
    );
    holder.execute("COMMIT").await.unwrap();
    assert_eq!(
        status::write_batch(&mut conn, "a", &batch[1..2])
            .await
            .unwrap(),
        written(&[(2, epoch(2))]),
        "written once the row is free"
    );
    assert_eq!(status_of(&mut conn, 2).await.as_deref(), Some("connected"));
}

#[tokio::test]
async fn a_lost_and_reclaimed_account_refuses_writes_with_the_old_epoch() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=1, "mt5").await;
    let first = lease::cycle(&mut conn, &params("a", "ia", 1, &[]))
        .await
        .unwrap();
    let old = first.owned[0].epoch;
    wait_expired(&mut conn, "a").await;
    // Same node, same instance, lease lapsed: the renewal re-claims with a new epoch (ABA).
    let again = lease::cycle(&mut conn, &params("a", "ia", 1, &[old]))
        .await
        .unwrap();
    let new = again.owned[0].epoch;
    assert!(new > old);
    let stale = vec![StatusUpdate {
        account_id: 1,
        epoch: old,
        status: Some("stale".into()),
        balance: None,
        equity: None,
        currency: None,
    }];
    assert!(status::write_batch(&mut conn, "a", &stale).await.unwrap() == Outcome::default());
    let status: Option<String> =
        sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = 1")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(status, None);
}

#[tokio::test]
async fn release_is_fenced_by_epoch_and_announced() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 2, &[]))
        .await
        .unwrap();
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener
        .listen(copier_node::channels::RELEASED)
        .await
        .unwrap();
    let e1 = a.owned.iter().find(|r| r.id == 1).unwrap().epoch;
    for (node, row, what) in [
        ("a", (1, e1 + 1000), "a wrong epoch releases nothing"),
        ("a", (2, e1), "another account's epoch releases nothing"),
        ("b", (1, e1), "another node releases nothing"),
    ] {
        assert!(
            lease::release(&mut conn, node, &[row], "x", None)
                .await
                .unwrap()
                .is_empty(),
            "{what}"
        );
    }
    assert_eq!(
        lease::release(&mut conn, "a", &[(1, e1)], "released: test", Some("b"))
            .await
            .unwrap(),
        vec![1]
    );
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("announcement")
        .unwrap();
    let named = copier_node::channels::Release {
        from: "a".into(),
        to: Some("b".into()),
        leaving: false,
        announced: false,
        accounts: 1,
    };
    assert_eq!(
        copier_node::channels::decode(n.channel(), n.payload()),
        Ok(copier_node::channels::Notice::Released {
            platform: "mt5".into(),
            release: named
        }),
        "the release names its receiver: {}",
        n.payload()
    );
    let row: (Option<String>, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT node_id, lease_until::text, status FROM trading_accounts WHERE id = 1",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(row, (None, None, Some("released: test".into())));

    // A row released disabled is nobody's to claim: its release wakes no one. (Notifications
    // arrive in commit order, so the marker sent after it is the next one heard.)
    let e2 = a.owned.iter().find(|r| r.id == 2).unwrap().epoch;
    sqlx::query("UPDATE trading_accounts SET enabled = false WHERE id = 2")
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        lease::release(&mut conn, "a", &[(2, e2)], "released: disabled", None)
            .await
            .unwrap(),
        vec![2]
    );
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(copier_node::channels::RELEASED)
        .execute(&mut conn)
        .await
        .unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("marker")
        .unwrap();
    assert_eq!(
        n.payload(),
        "marker",
        "the disabled row's release was announced"
    );
}

/// Accounts released to a receiver are announced again, naming nobody, only while they are
/// still free: one announcement per platform with how many are; none once they are claimed or
/// disabled, and the ids still free are returned.
#[tokio::test]
async fn accounts_still_free_are_announced_again_naming_nobody() {
    use copier_node::channels::{Notice, RELEASED, Release, decode};
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=3, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 3, &[]))
        .await
        .unwrap();
    let held: Vec<(i64, i64)> = a.owned.iter().map(|r| (r.id, r.epoch)).collect();
    lease::release(&mut conn, "a", &held, "released: rebalanced", Some("b"))
        .await
        .unwrap();
    sqlx::query("UPDATE trading_accounts SET enabled = false WHERE id = 3")
        .execute(&mut conn)
        .await
        .unwrap();
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen(RELEASED).await.unwrap();
    let mut next = async || {
        let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .expect("an announcement or the marker")
            .unwrap();
        (n.payload() != "marker").then(|| decode(n.channel(), n.payload()))
    };
    // 1 and 2 free, 3 disabled.
    let mut still = lease::announce_unclaimed(&mut conn, "a", &[1, 2, 3])
        .await
        .unwrap();
    still.sort();
    assert_eq!(still, [1, 2]);
    assert_eq!(
        next().await,
        Some(Ok(Notice::Released {
            platform: "mt5".into(),
            release: Release {
                from: "a".into(),
                to: None,
                leaving: false,
                announced: false,
                accounts: 2,
            }
        }))
    );
    // c claims 1 and 2: nothing is free, nothing is announced (the marker comes next).
    lease::cycle(&mut conn, &params("c", "ic", 3, &[]))
        .await
        .unwrap();
    assert!(
        lease::announce_unclaimed(&mut conn, "a", &[1, 2, 3])
            .await
            .unwrap()
            .is_empty()
    );
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(RELEASED)
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(next().await, None, "announced with nothing free");
}

/// A node's releases outwait its own lease cycle. The cycle holds every row of the node while it
/// renews them, for seconds on a loaded database: longer than the node's other statements wait
/// for a lock (a fifth of the fence). Held here as the cycle holds them, in an open transaction,
/// until the release has waited past that wait, the release then goes through.
#[tokio::test]
async fn a_release_outwaits_the_nodes_lease_cycle_holding_its_rows() {
    use copier_node::db::lease::{Release, Releaser, Releasing};
    use copier_node::db::{Db, Session, SessionBounds};

    let fence = Duration::from_secs(3);
    let node_bounds = SessionBounds::for_fence(fence);
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 2, &[]))
        .await
        .unwrap();
    let epoch = a.owned.iter().find(|r| r.id == 1).unwrap().epoch;
    // The node's pool: its connections carry the node's bounds, as `node_options` sets them.
    let ms = |d: Duration| d.as_millis().to_string();
    let options = db
        .url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .unwrap()
        .options([
            ("statement_timeout", ms(node_bounds.statement)),
            ("lock_timeout", ms(node_bounds.lock)),
            (
                "idle_in_transaction_session_timeout",
                ms(node_bounds.idle_in_transaction),
            ),
        ]);
    let session = Session::direct(node_bounds);
    let node_db = Db::new(
        copier_node::db::node_pool(options, Duration::from_secs(5), session),
        session,
    );
    let releaser = Releaser::spawn_pooled(node_db.bounded(SessionBounds::for_release(fence)));

    let mut cycle = db.conn().await;
    cycle.execute("BEGIN").await.unwrap();
    cycle
        .execute("SELECT FROM trading_accounts WHERE node_id = 'a' ORDER BY id FOR NO KEY UPDATE")
        .await
        .unwrap();
    let release = tokio::spawn(releaser.write(Releasing {
        node_id: "a".into(),
        release: Release {
            account_id: 1,
            epoch,
            status: "released: shutdown".into(),
            to: None,
        },
    }));
    // Until the release has waited for the rows longer than the node's other statements would
    // (or has ended: it gave up).
    let past = node_bounds.lock + Duration::from_millis(300);
    eventually(
        "the release waiting for the held rows past the node's lock wait",
        Duration::from_secs(10),
        async || {
            let waiting: bool = sqlx::query_scalar(
                "SELECT count(*) > 0 FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND query LIKE '%WITH wanted AS%'
                    AND clock_timestamp() - query_start > make_interval(secs => $1)",
            )
            .bind(past.as_secs_f64())
            .fetch_one(&mut conn)
            .await
            .unwrap();
            (waiting || release.is_finished()).then_some(())
        },
    )
    .await;
    cycle.execute("COMMIT").await.unwrap();
    assert_eq!(
        release.await.unwrap(),
        Ok(true),
        "the release gave up behind the cycle"
    );
    let node: Option<String> =
        sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = 1")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(node, None, "released");
}

/// A node's releases made at about the same time (a shutdown handing thousands off) go to the
/// database together: far fewer transactions than releases (PostgreSQL's own count is the judge,
/// beside the same releases made one after another), each row with its own status, one
/// announcement for each receiver named (and one naming no one) with how many accounts it
/// released, and a row no longer at the
/// epoch asked for is left as it is and reported so.
#[tokio::test]
async fn releases_at_once_go_in_a_few_statements_each_with_its_status_and_receiver() {
    use copier_node::db::lease::{Release, Releaser, Releasing};

    const N: i64 = 60;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2 * N + 1, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", (2 * N + 1) as u32, &[]))
        .await
        .unwrap();
    assert_eq!(a.owned.len() as i64, 2 * N + 1);
    let epoch: HashMap<i64, i64> = a.owned.iter().map(|r| (r.id, r.epoch)).collect();
    sqlx::Connection::close(conn).await.unwrap();
    let receiver = |id: i64| match id % 3 {
        0 => Some("b".to_string()),
        1 => Some("c".to_string()),
        _ => None,
    };
    let status = |id: i64| {
        if id % 2 == 0 {
            "released: shutdown"
        } else {
            "released: rebalanced"
        }
    };
    let job = |id: i64, epoch: i64| Releasing {
        node_id: "a".into(),
        release: Release {
            account_id: id,
            epoch,
            status: status(id).into(),
            to: receiver(id),
        },
    };
    let releaser = async || {
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        (
            Releaser::spawn_pooled(copier_node::db::Db::direct(pool.clone())),
            pool,
        )
    };

    let before = crate::support::transactions_ended(&db.url).await;
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener
        .listen(copier_node::channels::RELEASED)
        .await
        .unwrap();
    let (writer, pool) = releaser().await;
    // Accounts 1..=N at once, and the last account at an epoch it is no longer at.
    let mut jobs: Vec<Releasing> = (1..=N).map(|id| job(id, epoch[&id])).collect();
    jobs.push(job(2 * N + 1, epoch[&(2 * N + 1)] + 1000));
    let outcomes = crate::support::write_at_once(&writer, jobs).await;
    let mut expected = vec![Ok(true); N as usize];
    expected.push(Ok(false));
    assert_eq!(outcomes, expected);
    let mut c = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_notify($1, 'marker')")
        .bind(copier_node::channels::RELEASED)
        .execute(&mut *c)
        .await
        .unwrap();
    drop(c);
    let mut heard = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .expect("announcements and the marker")
            .unwrap();
        if n.payload() == "marker" {
            break;
        }
        match copier_node::channels::decode(n.channel(), n.payload()) {
            Ok(copier_node::channels::Notice::Released { platform, release }) => {
                assert_eq!((platform.as_str(), release.from.as_str()), ("mt5", "a"));
                heard.push((release.to, release.accounts));
            }
            other => panic!("not a release: {other:?}"),
        }
    }
    heard.sort();
    let third = (N / 3) as u32;
    assert_eq!(
        heard,
        [
            (None, third),
            (Some("b".to_string()), third),
            (Some("c".to_string()), third)
        ],
        "one announcement per receiver named, with the accounts it released"
    );
    drop(writer);
    pool.close().await;
    drop(listener);
    let batched = crate::support::transactions_ended(&db.url).await - before;

    let before = crate::support::transactions_ended(&db.url).await;
    let (writer, pool) = releaser().await;
    for id in N + 1..=2 * N {
        assert_eq!(writer.write(job(id, epoch[&id])).await, Ok(true));
    }
    drop(writer);
    pool.close().await;
    let one_by_one = crate::support::transactions_ended(&db.url).await - before;
    assert!(
        batched * 4 < one_by_one,
        "transactions: {batched} for the releases at once, {one_by_one} one after another"
    );

    let mut conn = db.conn().await;
    let rows: Vec<(i64, Option<String>, Option<String>)> =
        sqlx::query_as("SELECT id, node_id, status FROM trading_accounts ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    for (id, node, got) in rows {
        if id == 2 * N + 1 {
            assert_eq!(node.as_deref(), Some("a"), "account {id} was not released");
        } else {
            assert_eq!(
                (node, got.as_deref()),
                (None, Some(status(id))),
                "account {id}"
            );
        }
    }
}

/// A node's hand-off offers and answers made at about the same time (a shutdown offering
/// thousands of accounts, a receiver answering them) go to the database together: far fewer
/// transactions than notices (PostgreSQL's own count is the judge, beside the same notices sent
/// one after another), and every one is heard, each with its own payload, one notification each.
#[tokio::test]
async fn hand_off_notices_at_once_go_in_a_few_statements_and_each_is_heard() {
    use copier_node::channels::{Handoff, Notice, decode};
    use copier_node::db::lease::{HandoffAnnouncer, HandoffNotice};

    const N: i64 = 200;
    let db = TestDb::new().await;
    let offer = |id: i64| Handoff {
        ready: id % 2 == 0,
        account_id: id,
        from: "a".into(),
        to: format!("n{}", id % 3),
        claims: (id % 2 == 0).then_some(id % 4 == 0),
        leaving: id % 5 == 0,
    };
    let announcer = async || {
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        (
            HandoffAnnouncer::spawn_pooled(copier_node::db::Db::direct(pool.clone())),
            pool,
        )
    };
    let heard = async |listener: &mut sqlx::postgres::PgListener, n: i64| {
        let mut heard = Vec::new();
        while heard.len() < n as usize {
            let notice = tokio::time::timeout(Duration::from_secs(5), listener.recv())
                .await
                .unwrap_or_else(|_| panic!("{} notices heard of {n}", heard.len()))
                .unwrap();
            match decode(notice.channel(), notice.payload()) {
                Ok(Notice::Handoff(h)) => heard.push(h),
                other => panic!("not a hand-off notice: {other:?}"),
            }
        }
        heard.sort_by_key(|h| h.account_id);
        heard
    };

    // (Counting ends the other connections: the listener connects after.)
    let before = crate::support::transactions_ended(&db.url).await;
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener
        .listen(copier_node::channels::HANDOFF)
        .await
        .unwrap();
    let (writer, pool) = announcer().await;
    let jobs: Vec<HandoffNotice> = (1..=N)
        .map(|id| HandoffNotice(offer(id).payload()))
        .collect();
    let outcomes = crate::support::write_at_once(&writer, jobs).await;
    assert_eq!(outcomes, vec![Ok(()); N as usize]);
    assert_eq!(
        heard(&mut listener, N).await,
        (1..=N).map(offer).collect::<Vec<_>>(),
        "each notice heard once, with its own payload"
    );
    drop(writer);
    pool.close().await;
    drop(listener);
    let batched = crate::support::transactions_ended(&db.url).await - before;

    let before = crate::support::transactions_ended(&db.url).await;
    let (writer, pool) = announcer().await;
    for id in N + 1..=2 * N {
        assert_eq!(
            writer.write(HandoffNotice(offer(id).payload())).await,
            Ok(())
        );
    }
    drop(writer);
    pool.close().await;
    let one_by_one = crate::support::transactions_ended(&db.url).await - before;
    assert!(
        batched * 4 < one_by_one,
        "transactions: {batched} for the notices at once, {one_by_one} one after another"
    );
}

#[tokio::test]
async fn leaving_keeps_the_membership_while_a_row_still_names_the_node() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 2, &[]))
        .await
        .unwrap();
    let e1 = a.owned.iter().find(|r| r.id == 1).unwrap().epoch;
    // Account 2's task "did not stop": only account 1 is released; the membership stays.
    let out = lease::leave(&mut conn, "a", "ia", "mt5", &[(1, e1)], true)
        .await
        .unwrap();
    assert_eq!(out.released, vec![1]);
    assert!(!out.left);
    let all: Vec<(i64, i64)> = a.owned.iter().map(|r| (r.id, r.epoch)).collect();
    let out = lease::leave(&mut conn, "a", "ia", "mt5", &all, true)
        .await
        .unwrap();
    assert_eq!(out.released, vec![2]);
    assert!(out.left);
    let nodes: i64 = sqlx::query_scalar("SELECT count(*) FROM nodes")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(nodes, 0);
}

/// A release or a leave may name a row the node released already (a shutdown's leave names its
/// last cycle's rows, some of them handed off since; a release retried after a lost reply names
/// rows its first try freed). Neither locks such a row: a peer's claim, which skips locked rows,
/// takes it while the statement's transaction is still open, instead of at its next cycle.
#[tokio::test]
async fn a_release_or_leave_naming_a_row_released_already_leaves_it_to_a_peers_claim() {
    use sqlx::Connection;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let mut peer = db.conn().await;
    insert_accounts(&mut conn, 1..=3, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 3, &[]))
        .await
        .unwrap();
    let held: Vec<(i64, i64)> = a.owned.iter().map(|r| (r.id, r.epoch)).collect();
    assert_eq!(held.len(), 3);
    let hand_off = |id: i64| lease::Release {
        account_id: id,
        epoch: held.iter().find(|(held, _)| *held == id).unwrap().1,
        status: "released: handed off".into(),
        to: Some("b".into()),
    };
    // A peer's claim of one row, run while a statement of a's is open; the claim skips locked
    // rows and must not wait for one either, so a wait here is a failure, not a slow machine.
    let claim_beside = async |peer: &mut PgConnection, node: &str, what: &str| -> Vec<i64> {
        let params = params(node, node, 1, &[]);
        let out = tokio::time::timeout(Duration::from_secs(30), lease::cycle(peer, &params))
            .await
            .unwrap_or_else(|_| panic!("{node}'s claim waited for {what}"))
            .unwrap();
        out.owned.iter().map(|r| r.id).collect()
    };

    // Account 1 handed off, and its release retried: the retry frees nothing and locks nothing.
    let freed = lease::release_each(&mut conn, "a", &[hand_off(1)]).await;
    assert_eq!(freed.unwrap(), vec![1]);
    let mut tx = conn.begin().await.unwrap();
    let again = lease::release_each(&mut tx, "a", &[hand_off(1)]).await;
    assert_eq!(again.unwrap(), Vec::<i64>::new(), "the retry frees nothing");
    assert_eq!(
        claim_beside(&mut peer, "b", "the retried release").await,
        vec![1],
        "b claimed account 1 while the retried release's transaction was open"
    );
    tx.rollback().await.unwrap();

    // Account 2 handed off; the leave names all three rows of a's last cycle: it releases
    // account 3 (still a's, so locked until the leave commits), and leaves account 2 alone.
    let freed = lease::release_each(&mut conn, "a", &[hand_off(2)]).await;
    assert_eq!(freed.unwrap(), vec![2]);
    let mut tx = conn.begin().await.unwrap();
    let out = lease::leave(&mut tx, "a", "ia", "mt5", &held, true).await;
    assert_eq!(out.unwrap().released, vec![3]);
    assert_eq!(
        claim_beside(&mut peer, "c", "the leave").await,
        vec![2],
        "c claimed account 2 while the leave's transaction was open"
    );
    tx.commit().await.unwrap();
}

/// After a cycle that claimed, the node publishes what it owns now (the cycle published what it
/// owned when it began); only its own instance's membership is written.
#[tokio::test]
async fn the_count_owned_after_a_claim_is_published_by_its_instance_alone() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=3, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 3, &[]))
        .await
        .unwrap();
    assert_eq!(a.owned.len(), 3);
    let published = async |conn: &mut sqlx::PgConnection| -> i32 {
        sqlx::query_scalar("SELECT owned FROM nodes WHERE node_id = 'a'")
            .fetch_one(conn)
            .await
            .unwrap()
    };
    assert_eq!(
        published(&mut conn).await,
        0,
        "the cycle: what it owned as it began"
    );
    lease::publish_owned(&mut conn, "a", "another", 3)
        .await
        .unwrap();
    assert_eq!(
        published(&mut conn).await,
        0,
        "another instance writes nothing"
    );
    lease::publish_owned(&mut conn, "a", "ia", 3).await.unwrap();
    assert_eq!(published(&mut conn).await, 3);
}

/// A node's departure is announced as it begins (its shutdown's first cycle) and again as it
/// leaves, both as leaving, so that every peer counts its larger share (a release naming no one
/// wakes only a few of the peers with room); the leave's counts the accounts it released, and
/// says whether the departure was announced before (then the peers counted already, and the
/// accounts wake as a release naming nobody does).
#[tokio::test]
async fn a_departure_is_announced_as_leaving_when_it_begins_and_when_the_node_leaves() {
    use copier_node::channels::{Notice, RELEASED, Release, decode};
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    let a = lease::cycle(&mut conn, &params("a", "ia", 2, &[]))
        .await
        .unwrap();
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen(RELEASED).await.unwrap();
    let leaving = |accounts: u32, announced: bool| Notice::Released {
        platform: "mt5".into(),
        release: Release {
            from: "a".into(),
            to: None,
            leaving: true,
            announced,
            accounts,
        },
    };
    let mut heard = async || {
        let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .expect("an announcement")
            .unwrap();
        decode(n.channel(), n.payload())
    };
    lease::announce_departure(&mut conn, "a", "mt5")
        .await
        .unwrap();
    assert_eq!(
        heard().await,
        Ok(leaving(0, false)),
        "as the shutdown begins"
    );
    // The first leave releases account 1 (account 2's session "did not stop") after an
    // announcement that did not go out; the second, account 2 after one that did.
    let held = |id: i64| (id, a.owned.iter().find(|r| r.id == id).unwrap().epoch);
    let out = lease::leave(&mut conn, "a", "ia", "mt5", &[held(1)], false)
        .await
        .unwrap();
    assert_eq!((out.released, out.left), (vec![1], false));
    assert_eq!(
        heard().await,
        Ok(leaving(1, false)),
        "as it leaves, with the account it released, waking every peer"
    );
    let out = lease::leave(&mut conn, "a", "ia", "mt5", &[held(2)], true)
        .await
        .unwrap();
    assert_eq!((out.released, out.left), (vec![2], true));
    assert_eq!(
        heard().await,
        Ok(leaving(1, true)),
        "its departure announced before: the peers counted already"
    );
}

#[tokio::test]
async fn an_account_row_cannot_name_a_node_without_membership() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let err = conn
        .execute("INSERT INTO trading_accounts (id, platform, role, server, login, node_id, lease_until) VALUES (1, 'mt5', 'follower', 'h:1', '1', 'ghost', now())")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("foreign key"), "{err}");
    let err = conn
        .execute("INSERT INTO trading_accounts (id, platform, role, server, login) VALUES (1, 'mt5', 'slave', 'h:1', '1')")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("check constraint"), "{err}");
}

/// Every (node type, relation, index) in an EXPLAIN (FORMAT JSON) plan.
fn plan_nodes(plan: &serde_json::Value, out: &mut Vec<(String, String, String)>) {
    if let Some(obj) = plan.as_object() {
        if let Some(kind) = obj.get("Node Type").and_then(|v| v.as_str()) {
            let rel = obj
                .get("Relation Name")
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_string();
            let index = obj
                .get("Index Name")
                .and_then(|v| v.as_str())
                .unwrap_or("")
                .to_string();
            out.push((kind.to_string(), rel, index));
        }
        for v in obj.values() {
            plan_nodes(v, out);
        }
    } else if let Some(list) = plan.as_array() {
        for v in list {
            plan_nodes(v, out);
        }
    }
}

#[tokio::test]
async fn node_connections_carry_the_session_bounds_durable_commits_and_no_jit() {
    let db = TestDb::new().await;
    let options = copier_node::db::node_options(
        &copier_node::config::Secret::new(db.url.clone()),
        "x",
        copier_node::db::Session::direct(copier_node::db::SessionBounds::for_fence(
            Duration::from_millis(1500),
        )),
    )
    .unwrap();
    let mut conn = sqlx::ConnectOptions::connect(&options).await.unwrap();
    for (setting, wanted) in [
        ("statement_timeout", "500ms"),
        ("lock_timeout", "300ms"),
        ("idle_in_transaction_session_timeout", "500ms"),
        ("synchronous_commit", "on"),
        ("jit", "off"),
        ("application_name", "copier-node x"),
    ] {
        let value: String = sqlx::query_scalar(&format!("SHOW {setting}"))
            .fetch_one(&mut conn)
            .await
            .unwrap();
        assert_eq!(value, wanted, "{setting}");
    }
}

/// An `int8[]` literal of `ids`.
fn array_literal(ids: &[i64]) -> String {
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!("'{{{}}}'", ids.join(","))
}

/// `PREPARE`s `sql` as `name` (with its parameters' types) and has the session take generic
/// plans until `RESET plan_cache_mode`: an `EXPLAIN` of `EXECUTE name(..)` then shows the generic
/// plan a prepared statement settles on after five executions.
async fn prepare_generic(conn: &mut PgConnection, name: &str, sql: &str) {
    conn.execute(format!("PREPARE {name} AS {sql}").as_str())
        .await
        .unwrap();
    conn.execute("SET plan_cache_mode = force_generic_plan")
        .await
        .unwrap();
}

/// `EXPLAIN (<options>)` of a steady-state cycle of node x holding `held`: the plan for these
/// values, or with `generic` the generic plan a prepared statement settles on after five
/// executions. That one goes through `PREPARE` and `EXECUTE`: an `EXPLAIN` of a statement with
/// bound parameters plans it with their values, whatever `plan_cache_mode` says.
async fn explain_cycle(
    conn: &mut PgConnection,
    options: &str,
    held: &[i64],
    generic: bool,
) -> Vec<sqlx::postgres::PgRow> {
    if !generic {
        return sqlx::query(&format!("EXPLAIN ({options}) {}", lease::CYCLE_SQL))
            .bind("x")
            .bind("ix")
            .bind("mt5")
            .bind(200i32)
            .bind(3000i64)
            .bind(held)
            .bind(true)
            .bind(200i32)
            .bind(2000i64)
            .bind(100i32)
            .bind(held)
            .bind(0i32)
            .fetch_all(conn)
            .await
            .unwrap();
    }
    prepare_generic(
        conn,
        "cycle(text, text, text, int4, int8, int8[], bool, int4, int8, int4, int8[], int4)",
        lease::CYCLE_SQL,
    )
    .await;
    let rows = sqlx::query(&format!(
        "EXPLAIN ({options}) EXECUTE cycle('x', 'ix', 'mt5', 200, 3000, {h}, true, 200, 2000, 100, {h}, 0)",
        h = array_literal(held)
    ))
    .fetch_all(&mut *conn)
    .await
    .unwrap();
    conn.execute("RESET plan_cache_mode").await.unwrap();
    conn.execute("DEALLOCATE cycle").await.unwrap();
    rows
}

#[tokio::test]
async fn at_a_million_rows_the_cycle_is_index_driven_and_renewals_stay_hot() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // The note's shape: 80 % of rows on the platform, 5 % disabled and unowned, every enabled row
    // owned by one of 100 live nodes, except one dead node's rows (expired) and 100 free rows.
    conn.execute(
        "INSERT INTO nodes SELECT 'n' || g, 'i', 'mt5', 20000, now() + interval '1 hour', now(), now()
           FROM generate_series(1, 100) g",
    )
    .await
    .unwrap();
    conn.execute(
        "UPDATE nodes SET lease_until = now() - interval '1 minute' WHERE node_id = 'n100'",
    )
    .await
    .unwrap();
    conn.execute("SET session_replication_role = replica")
        .await
        .unwrap(); // skip the FK checks of the bulk load
    conn.execute(
        "INSERT INTO trading_accounts (id, platform, role, server, login, enabled, node_id, lease_until, owner_epoch)
         SELECT g, CASE WHEN g % 5 = 0 THEN 'mt4' ELSE 'mt5' END, 'follower', 'h:1', g::text, g % 20 <> 1,
                CASE WHEN g % 20 = 1 OR g % 10007 = 3 THEN NULL ELSE 'n' || (g % 100 + 1) END,
                CASE WHEN g % 20 = 1 OR g % 10007 = 3 THEN NULL
                     WHEN g % 100 + 1 = 100 THEN now() - interval '1 minute'
                     ELSE now() + interval '1 hour' END,
                g
           FROM generate_series(1, 1000000) g",
    )
    .await
    .unwrap();
    conn.execute("SET session_replication_role = DEFAULT")
        .await
        .unwrap();
    conn.execute("ANALYZE trading_accounts").await.unwrap();
    conn.execute("ANALYZE nodes").await.unwrap();

    // The node's first cycle (membership, claims); then the plan of a steady-state cycle, both
    // custom (as for the first executions) and generic (what a prepared statement settles on).
    let first = lease::cycle(&mut conn, &params("x", "ix", 100, &[]))
        .await
        .unwrap();
    assert_eq!(first.owned.len(), 100);
    let held: Vec<i64> = first.owned.iter().map(|r| r.epoch).collect();
    for (mode, generic) in [("custom plan", false), ("generic plan", true)] {
        let plan: serde_json::Value = explain_cycle(&mut conn, "FORMAT JSON", &held, generic).await
            [0]
        .try_get(0)
        .unwrap();
        // The held epochs are looked up in a hash, not searched linearly per row (a generic
        // plan cannot hash `= ANY ($6)`: quadratic in the number of accounts held).
        let text: Vec<String> = explain_cycle(&mut conn, "VERBOSE", &held, generic)
            .await
            .iter()
            .map(|r| r.try_get(0).unwrap())
            .collect();
        let text = text.join("\n");
        let hashed = text.matches("(hashed SubPlan").count();
        assert!(
            hashed >= 2 && !text.contains("ANY ($6)"),
            "{mode}: held epochs not looked up by hash: {text}"
        );
        let mut nodes = Vec::new();
        plan_nodes(&plan, &mut nodes);
        let scans: Vec<_> = nodes
            .iter()
            .filter(|(kind, rel, _)| kind == "Seq Scan" && rel == "trading_accounts")
            .collect();
        assert!(
            scans.is_empty(),
            "{mode}: the cycle scans trading_accounts: {nodes:?}"
        );
        let indexes: Vec<&str> = nodes.iter().map(|(_, _, i)| i.as_str()).collect();
        for wanted in [
            "trading_accounts_node_idx",
            "trading_accounts_free_idx",
            "trading_accounts_pkey",
        ] {
            assert!(
                indexes.contains(&wanted),
                "{mode}: {wanted} unused: {nodes:?}"
            );
        }
    }

    // Renewals of the node's 100 rows among a million are HOT.
    let stats = async |conn: &mut sqlx::PgConnection| -> (i64, i64) {
        sqlx::query_as("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'trading_accounts'")
            .fetch_one(conn)
            .await
            .unwrap()
    };
    let mut held = held;
    let mut timings = Vec::new();
    let mut work = db.conn().await;
    // Let the claim's own statistics arrive first.
    let base = eventually(
        "the claim in the statistics",
        Duration::from_secs(20),
        async || {
            let s = stats(&mut conn).await;
            (s.0 >= 100).then_some(s)
        },
    )
    .await;
    for _ in 0..10 {
        let t = tokio::time::Instant::now();
        let out = lease::cycle(&mut work, &params("x", "ix", 200, &held))
            .await
            .unwrap();
        timings.push(t.elapsed());
        held = out.owned.iter().map(|r| r.epoch).collect();
    }
    work.execute("SELECT pg_stat_force_next_flush()")
        .await
        .unwrap();
    drop(work);
    let claimed_in_loop = held.len() as i64 - 100; // the 200-capacity cycles claimed more once
    let after = eventually(
        "the renewals in the statistics",
        Duration::from_secs(20),
        async || {
            let s = stats(&mut conn).await;
            (s.0 >= base.0 + 100 * 10).then_some(s)
        },
    )
    .await;
    let (upd, hot) = (after.0 - base.0, after.1 - base.1);
    timings.sort();
    eprintln!(
        "1M rows: cycle median {:?}, max {:?}; {hot} HOT of {upd} updates ({claimed_in_loop} claims)",
        timings[timings.len() / 2],
        timings[timings.len() - 1]
    );
    let renewals = upd - claimed_in_loop;
    assert!(
        hot as f64 >= renewals as f64 * 0.9,
        "{hot} HOT of {renewals} renewals"
    );
}

/// The rows an executed plan produced and filtered out, summed over its nodes and their loops
/// (`EXPLAIN (ANALYZE, FORMAT JSON)`): the work of a join re-reading a whole input for every row
/// of the other shows here as the product of the two sizes.
fn plan_work(plan: &serde_json::Value) -> f64 {
    let mut work = 0.0;
    if let Some(obj) = plan.as_object() {
        if obj.contains_key("Node Type") {
            let get = |key: &str| obj.get(key).and_then(|v| v.as_f64()).unwrap_or(0.0);
            // Rows and rows removed are averages per loop.
            work += get("Actual Loops")
                * (get("Actual Rows")
                    + get("Rows Removed by Filter")
                    + get("Rows Removed by Join Filter"));
        }
        work += obj.values().map(plan_work).sum::<f64>();
    } else if let Some(list) = plan.as_array() {
        work += list.iter().map(plan_work).sum::<f64>();
    }
    work
}

/// Asserts that the executed plan `plan` (of `what`) did at most `bound` rows of work
/// ([`plan_work`]).
fn assert_linear(plan: &serde_json::Value, bound: f64, what: &str) {
    let work = plan_work(plan);
    assert!(work <= bound, "{what} produced {work} rows: {plan}");
}

/// Found in the 20,000-account benchmark: autovacuum analysed `trading_accounts` while every row
/// was still free, so the planner took `node_id = $me` for one row where a node held 5,000; it
/// joined the cycle's renewal to its locked rows, and the status write to its batch, by
/// re-reading one side for every row of the other, and each statement took about a second until
/// the next analyse; a release and a node's leaving had the same shape. The work of each of
/// them must stay linear in the table under such statistics, in the plan for the values bound
/// and in the generic plan a prepared statement settles on.
#[tokio::test]
async fn with_statistics_taken_while_every_row_was_free_the_node_statements_stay_linear() {
    use copier_node::channels::RELEASED;
    const ROWS: i64 = 20_000;
    const HELD: i64 = 5_000;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.execute("ALTER TABLE trading_accounts SET (autovacuum_enabled = false)")
        .await
        .unwrap();
    conn.execute(
        "INSERT INTO nodes (node_id, instance_id, platform, capacity, lease_until, started_at, renewed_at)
         VALUES ('x', 'ix', 'mt5', 200, now() + interval '1 hour', now(), now())",
    )
    .await
    .unwrap();
    conn.execute(
        format!(
            "INSERT INTO trading_accounts (id, platform, role, server, login)
             SELECT g, 'mt5', 'follower', 'h:1', g::text FROM generate_series(1, {ROWS}) g"
        )
        .as_str(),
    )
    .await
    .unwrap();
    conn.execute("ANALYZE trading_accounts").await.unwrap();
    conn.execute("ANALYZE nodes").await.unwrap();
    conn.execute(
        format!(
            "UPDATE trading_accounts SET node_id = 'x', lease_until = now() + interval '1 hour',
                    owner_epoch = id, claimed_at = now()
              WHERE id <= {HELD}"
        )
        .as_str(),
    )
    .await
    .unwrap();
    // Each row held at its id as epoch.
    let held: Vec<i64> = (1..=HELD).collect();
    let pairs: Vec<(i64, i64)> = held.iter().map(|&id| (id, id)).collect();
    let batch: Vec<StatusUpdate> = (1..=1000)
        .map(|id| StatusUpdate {
            account_id: id,
            epoch: id,
            status: Some("follower: ok".into()),
            balance: Some(1000.0),
            equity: Some(1000.0),
            currency: None,
        })
        .collect();
    let bound = 20.0 * ROWS as f64;
    // The generic plans of the cycle and the status write, the ones a prepared statement settles
    // on after five executions (through `PREPARE` and `EXECUTE`, as `explain_cycle` says why).
    let cycle: serde_json::Value = explain_cycle(&mut conn, "ANALYZE, FORMAT JSON", &held, true)
        .await[0]
        .try_get(0)
        .unwrap();
    assert_linear(
        &cycle,
        bound,
        &format!("generic plan: the cycle of a node holding {HELD} of {ROWS} rows"),
    );
    prepare_generic(
        &mut conn,
        "write(text, bigint[], bigint[], text[], float8[], float8[], text[])",
        status::WRITE_SQL,
    )
    .await;
    let write: serde_json::Value = sqlx::query_scalar(&format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE write('x', {t}, {t},
             array_fill('follower: ok'::text, ARRAY[1000]), array_fill(1000.0::float8, ARRAY[1000]),
             array_fill(1000.0::float8, ARRAY[1000]), array_fill(NULL::text, ARRAY[1000]))",
        t = array_literal(&(1..=1000).collect::<Vec<i64>>())
    ))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_linear(
        &write,
        bound,
        &format!("generic plan: a status write of 1000 of the node's {HELD} rows"),
    );
    // A shutdown's release of 1,000 of the node's rows, and the node leaving with all it holds
    // (each rolled back).
    let (release, free) = generic_rolled_back(
        &mut conn,
        "release(text, bigint[], bigint[], text[], text, text[])",
        lease::RELEASE_SQL,
        &format!(
            "release('x', {t}, {t}, array_fill('released: shutdown'::text, ARRAY[1000]),
                     '{RELEASED}', array_fill('y'::text, ARRAY[1000]))",
            t = array_literal(&(1..=1000).collect::<Vec<i64>>())
        ),
    )
    .await;
    assert_linear(
        &release,
        bound,
        &format!("generic plan: a release of 1000 of the node's {HELD} rows"),
    );
    assert_eq!(free, ROWS - HELD + 1000, "rows free after the release");
    let (leave, free) = generic_rolled_back(
        &mut conn,
        "leave(text, text, bigint[], text, text, bool, bigint[])",
        lease::LEAVE_SQL,
        &format!(
            "leave('x', 'ix', {h}, 'mt5', '{RELEASED}', false, {h})",
            h = array_literal(&held)
        ),
    )
    .await;
    assert_linear(
        &leave,
        bound,
        &format!("generic plan: the node leaving with its {HELD} rows"),
    );
    assert_eq!(free, ROWS, "rows free after the leave");
    conn.execute("RESET plan_cache_mode").await.unwrap();
    // The cycle and the write did their work: the cycle kept the node's rows, the write wrote
    // its batch.
    assert_eq!(
        owned_and_written(&mut conn).await,
        (HELD, 1000),
        "generic plans"
    );

    // Then each statement's plan for the values bound.
    let cycle: serde_json::Value = explain_cycle(&mut conn, "ANALYZE, FORMAT JSON", &held, false)
        .await[0]
        .try_get(0)
        .unwrap();
    assert_linear(
        &cycle,
        bound,
        &format!("custom plan: the cycle of a node holding {HELD} of {ROWS} rows"),
    );
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", status::WRITE_SQL);
    let write: serde_json::Value = status::bind_batch(&explain, "x", &batch)
        .fetch_one(&mut conn)
        .await
        .unwrap()
        .try_get(0)
        .unwrap();
    assert_linear(
        &write,
        bound,
        &format!("custom plan: a status write of 1000 of the node's {HELD} rows"),
    );
    assert_eq!(
        owned_and_written(&mut conn).await,
        (HELD, 1000),
        "custom plans"
    );
    // A shutdown's release of 1,000 of them, and the node leaving with all it holds.
    let releases: Vec<lease::Release> = (1..=1000)
        .map(|id| lease::Release {
            account_id: id,
            epoch: id,
            status: "released: shutdown".into(),
            to: Some("y".into()),
        })
        .collect();
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", lease::RELEASE_SQL);
    let (release, free) =
        explain_rolled_back(&mut conn, lease::bind_release(&explain, "x", &releases)).await;
    assert_linear(
        &release,
        bound,
        &format!("custom plan: a release of 1000 of the node's {HELD} rows"),
    );
    assert_eq!(free, ROWS - HELD + 1000, "rows free after the release");
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) {}", lease::LEAVE_SQL);
    let (leave, free) = explain_rolled_back(
        &mut conn,
        lease::bind_leave(&explain, "x", "ix", "mt5", &pairs, false),
    )
    .await;
    assert_linear(
        &leave,
        bound,
        &format!("custom plan: the node leaving with its {HELD} rows"),
    );
    assert_eq!(free, ROWS, "rows free after the leave");
}

/// How many rows node x holds at the epoch it was given (its id), and how many carry the status
/// the test writes; clears that status for the next write.
async fn owned_and_written(conn: &mut PgConnection) -> (i64, i64) {
    let counts = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE node_id = 'x' AND owner_epoch = id),
                count(*) FILTER (WHERE status = 'follower: ok')
           FROM trading_accounts",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    conn.execute("UPDATE trading_accounts SET status = NULL")
        .await
        .unwrap();
    counts
}

/// The generic plan of `sql` (a statement that frees rows), prepared as `name` and executed as
/// `call` ([`prepare_generic`]), run in a transaction rolled back ([`explain_rolled_back`]).
async fn generic_rolled_back(
    conn: &mut PgConnection,
    name: &str,
    sql: &str,
    call: &str,
) -> (serde_json::Value, i64) {
    prepare_generic(conn, name, sql).await;
    let explain = format!("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {call}");
    explain_rolled_back(conn, sqlx::query(&explain)).await
}

/// Runs `explain` (an `EXPLAIN (ANALYZE, FORMAT JSON)` of a statement that frees rows) in a
/// transaction rolled back: its plan, and how many rows were free before the rollback.
async fn explain_rolled_back(
    conn: &mut PgConnection,
    explain: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
) -> (serde_json::Value, i64) {
    conn.execute("BEGIN").await.unwrap();
    let plan = explain
        .fetch_one(&mut *conn)
        .await
        .unwrap()
        .try_get(0)
        .unwrap();
    let free = sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id IS NULL")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    conn.execute("ROLLBACK").await.unwrap();
    (plan, free)
}

#[tokio::test]
async fn long_dead_memberships_that_own_nothing_are_forgotten() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    conn.execute(
        "INSERT INTO nodes VALUES
           ('gone', 'i', 'mt5', 1, now() - interval '2 hours', now(), now()),
           ('recent', 'i', 'mt5', 1, now() - interval '5 minutes', now(), now()),
           ('holding', 'i', 'mt5', 1, now() - interval '2 hours', now(), now()),
           ('other-platform', 'i', 'mt4', 1, now() - interval '2 hours', now(), now())",
    )
    .await
    .unwrap();
    conn.execute("INSERT INTO trading_accounts (id, platform, role, server, login, node_id, lease_until) VALUES (1, 'mt5', 'follower', 'h:1', '1', 'holding', now() - interval '2 hours')")
        .await
        .unwrap();
    assert_eq!(lease::forget_dead_nodes(&mut conn, "mt5").await.unwrap(), 1);
    let left: Vec<String> = sqlx::query_scalar("SELECT node_id FROM nodes ORDER BY node_id")
        .fetch_all(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, ["holding", "other-platform", "recent"]);
}

/// Whether an error is PostgreSQL's deadlock detector breaking a wait cycle (SQLSTATE 40P01).
fn is_deadlock(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("40P01"))
}

/// The (id, epoch) of every row `node` owns, in random order.
async fn owned_shuffled(
    conn: &mut PgConnection,
    node: &str,
    rng: &mut fastrand::Rng,
) -> Vec<(i64, i64)> {
    let mut rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, owner_epoch FROM trading_accounts WHERE node_id = $1")
            .bind(node)
            .fetch_all(conn)
            .await
            .unwrap();
    rng.shuffle(&mut rows);
    rows
}

#[tokio::test]
async fn the_cycle_never_deadlocks_with_the_nodes_other_writes_to_its_rows() {
    // A node's cycle renews every row it owns while, on other connections, the same node writes
    // its accounts' statuses in batches and releases accounts, each batch in whatever order its
    // callers gathered it (here: shuffled). Every statement that locks several account rows must
    // lock them in one order (ascending id), or two of them wait for each other and PostgreSQL
    // breaks the cycle by failing one (SQLSTATE 40P01): a lease cycle lost to the node's own work.
    // The judge is PostgreSQL's own error, from every statement of every connection.
    const ROWS: i64 = 1500;
    let db = TestDb::new().await;
    let mut setup = db.conn().await;
    insert_accounts(&mut setup, 1..=ROWS, "mt5").await;
    let long = Duration::from_secs(600);
    let first = lease::cycle(
        &mut setup,
        &CycleParams {
            lease: long,
            trust: long / 2,
            ..params("n", "i", ROWS as u32, &[])
        },
    )
    .await
    .unwrap();
    assert_eq!(first.owned.len(), ROWS as usize);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let connect = async || -> PgConnection { sqlx::Connection::connect(&db.url).await.unwrap() };

    let cycles = {
        let mut conn = connect().await;
        let stop = stop.clone();
        let mut held: Vec<i64> = first.owned.iter().map(|r| r.epoch).collect();
        tokio::spawn(async move {
            let mut deadlocks = 0;
            for _ in 0..30 {
                let p = CycleParams {
                    lease: long,
                    trust: long / 2,
                    owned: held.len() as u32,
                    ..params("n", "i", ROWS as u32, &held)
                };
                match lease::cycle(&mut conn, &p).await {
                    Ok(out) => held = out.owned.iter().map(|r| r.epoch).collect(),
                    Err(e) if is_deadlock(&e) => deadlocks += 1,
                    Err(e) => panic!("cycle: {e}"),
                }
            }
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            deadlocks
        })
    };
    let statuses = {
        let mut conn = connect().await;
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(1);
            let mut deadlocks = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let batch: Vec<StatusUpdate> = owned_shuffled(&mut conn, "n", &mut rng)
                    .await
                    .into_iter()
                    .map(|(account_id, epoch)| StatusUpdate {
                        account_id,
                        epoch,
                        status: Some("connected".into()),
                        balance: Some(1.0),
                        equity: None,
                        currency: None,
                    })
                    .collect();
                match status::write_batch(&mut conn, "n", &batch).await {
                    Ok(_) => {}
                    Err(e) if is_deadlock(&e) => deadlocks += 1,
                    Err(e) => panic!("status batch: {e}"),
                }
            }
            deadlocks
        })
    };
    let releases = {
        let mut conn = connect().await;
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(2);
            let mut deadlocks = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let some: Vec<(i64, i64)> = owned_shuffled(&mut conn, "n", &mut rng)
                    .await
                    .into_iter()
                    .take(500)
                    .collect();
                match lease::release(&mut conn, "n", &some, "released: test", None).await {
                    Ok(_) => {}
                    Err(e) if is_deadlock(&e) => deadlocks += 1,
                    Err(e) => panic!("release: {e}"),
                }
            }
            deadlocks
        })
    };
    let (c, s, r) = (
        cycles.await.unwrap(),
        statuses.await.unwrap(),
        releases.await.unwrap(),
    );
    assert_eq!(
        (c, s, r),
        (0, 0, 0),
        "deadlocks (cycles, status batches, releases): PostgreSQL broke wait cycles between the node's own statements"
    );
}
