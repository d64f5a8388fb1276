//! The grace after a database failover and the keep rules, driven through the cycle statement
//! against a real PostgreSQL. A failover is staged by making `copier_database` remember another
//! timeline (or another system identifier, for a restored dump): to the cycle that is exactly
//! what a promoted standby looks like. The real thing (a standby that lost the tail, promoted)
//! is the fault suite's `failover` scenarios.

use std::time::Duration;

use copier_node::db::lease::{self, CycleOutcome, CycleParams};
use sqlx::PgConnection;

use crate::support::{TestDb, eventually, insert_accounts};

const LEASE: Duration = Duration::from_secs(3);
/// The grace is the longest lease plus a second.
const GRACE: Duration = Duration::from_secs(4);

async fn cycle(conn: &mut PgConnection, node_id: &str, held: &[i64], kept: &[i64]) -> CycleOutcome {
    let p = CycleParams {
        node_id,
        instance_id: node_id,
        platform: "mt5",
        capacity: 1000,
        claim_limit: 1000,
        trust: Duration::from_secs(2),
        owned: held.len() as u32,
        starting: 0,
        lease: LEASE,
        held,
        claim: true,
        kept,
    };
    lease::cycle(conn, &p).await.unwrap()
}

fn epochs(out: &CycleOutcome) -> Vec<i64> {
    out.owned.iter().map(|r| r.epoch).collect()
}

fn ids(out: &CycleOutcome) -> Vec<i64> {
    let mut ids: Vec<i64> = out.owned.iter().map(|r| r.id).collect();
    ids.sort_unstable();
    ids
}

/// The row as the database holds it: (node, epoch).
async fn row(conn: &mut PgConnection, id: i64) -> (Option<String>, i64) {
    sqlx::query_as("SELECT node_id, owner_epoch FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await
        .unwrap()
}

async fn exec(conn: &mut PgConnection, sql: &str) {
    sqlx::query(sql).execute(conn).await.unwrap();
}

/// One cycle of node `long`, claiming nothing, with `lease`: the cluster remembers the longest
/// lease any node ran with (the grace after a failover covers it).
async fn run_once_with_lease(conn: &mut PgConnection, lease: Duration) {
    let long = CycleParams {
        node_id: "long",
        instance_id: "long",
        platform: "mt5",
        capacity: 1,
        claim_limit: 1,
        trust: lease * 3 / 4,
        owned: 0,
        starting: 0,
        lease,
        held: &[],
        claim: false,
        kept: &[],
    };
    lease::cycle(conn, &long).await.unwrap();
}

/// Makes the database look as if it had just failed over: the recorded timeline is an older one.
async fn stage_failover(conn: &mut PgConnection) {
    let n = sqlx::query(
        "UPDATE copier_database SET timeline = timeline - 1 WHERE timeline IS NOT NULL",
    )
    .execute(conn)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(n, 1, "an earlier cycle recorded the timeline");
}

/// Cycles `node` (holding and keeping nothing) until its claims are allowed again.
async fn after_grace(conn: &mut PgConnection, node: &str) -> CycleOutcome {
    eventually(
        format!("the grace to end for {node}"),
        GRACE * 5,
        async || {
            let out = cycle(conn, node, &[], &[]).await;
            out.database.grace.is_zero().then_some(out)
        },
    )
    .await
}

#[tokio::test]
async fn the_first_cycle_records_the_timeline_and_starts_no_grace() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=3, "mt5").await;
    let out = cycle(&mut conn, "a", &[], &[]).await;
    assert_eq!(ids(&out), vec![1, 2, 3], "claims as usual");
    assert!(!out.database.failed_over);
    assert!(out.database.grace.is_zero());
    let timeline = out
        .database
        .timeline
        .expect("a plain server shows its timeline");
    assert!(timeline >= 1);
    let recorded: Option<i32> = sqlx::query_scalar("SELECT timeline FROM copier_database")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(recorded.map(i64::from), Some(timeline));
}

#[tokio::test]
async fn after_a_failover_nothing_is_claimed_until_the_grace_ends() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=6, "mt5").await;
    let a = cycle(&mut conn, "a", &[], &[]).await;
    assert_eq!(a.owned.len(), 6);
    // a hands 4..=6 back (the new primary shows them free) and then the database fails over.
    exec(
        &mut conn,
        "UPDATE trading_accounts SET node_id = NULL, lease_until = NULL WHERE id >= 4",
    )
    .await;
    stage_failover(&mut conn).await;

    // A node whose first cycle comes after the failover: it sees the change and claims nothing.
    let b = cycle(&mut conn, "b", &[], &[]).await;
    assert!(
        b.database.failed_over,
        "b's cycle is the first on the new timeline"
    );
    assert!(
        b.database.grace >= LEASE && b.database.grace <= GRACE,
        "grace of the longest lease plus a margin: {:?}",
        b.database.grace
    );
    assert!(
        b.owned.is_empty(),
        "claimed during the grace: {:?}",
        b.owned
    );
    // Free rows stay free for a too, and another cycle does not start the grace again.
    let kept: Vec<i64> = a
        .owned
        .iter()
        .filter(|r| r.id <= 3)
        .map(|r| r.epoch)
        .collect();
    let a2 = cycle(&mut conn, "a", &epochs(&a), &kept).await;
    assert!(!a2.database.failed_over, "the change was noted once");
    assert!(!a2.database.grace.is_zero());
    assert_eq!(
        ids(&a2),
        vec![1, 2, 3],
        "a keeps what it held, claims nothing"
    );
    for id in 4..=6 {
        assert_eq!(row(&mut conn, id).await.0, None, "account {id} stayed free");
    }
    // (a stopped renewing, so its rows are claimable by then as well.)
    let b = after_grace(&mut conn, "b").await;
    for id in 4..=6 {
        assert!(
            ids(&b).contains(&id),
            "claims resume once the grace is over: {:?}",
            ids(&b)
        );
    }
}

#[tokio::test]
async fn during_a_grace_only_rows_held_without_a_break_are_kept_and_at_their_epochs() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=4, "mt5").await;
    let a = cycle(&mut conn, "a", &[], &[]).await;
    let epoch_of = |id: i64| a.owned.iter().find(|r| r.id == id).unwrap().epoch;
    // Account 1: held throughout, but the new primary lost its last renewal (expired there).
    exec(
        &mut conn,
        "UPDATE trading_accounts SET lease_until = now() - interval '1 s' WHERE id = 1",
    )
    .await;
    // Account 2: a had released it (and someone else claimed it), both commits lost: the new
    // primary shows a at its old epoch, unexpired. a's last cycle still listed it as held.
    // Account 3: a let it lapse (its gate closed) before the failover; the row looks fine.
    // Account 4: held throughout, nothing lost.
    stage_failover(&mut conn).await;
    let kept = [epoch_of(1), epoch_of(4)];
    let out = cycle(&mut conn, "a", &epochs(&a), &kept).await;
    assert!(out.database.failed_over);
    assert_eq!(ids(&out), vec![1, 4], "kept exactly the continuous ones");
    for id in [1, 4] {
        assert_eq!(
            row(&mut conn, id).await,
            (Some("a".into()), epoch_of(id)),
            "account {id} renewed at its epoch, even where the new primary showed it expired"
        );
    }
    for id in [2, 3] {
        assert_eq!(
            row(&mut conn, id).await,
            (Some("a".into()), epoch_of(id)),
            "account {id} neither renewed nor re-claimed with a new epoch during the grace"
        );
    }
    // After the grace, a re-claims 2 and 3 with new epochs (its sessions restart and reconcile).
    let out = eventually("the grace to end", GRACE * 5, async || {
        let out = cycle(&mut conn, "a", &kept, &kept).await;
        out.database.grace.is_zero().then_some(out)
    })
    .await;
    assert_eq!(ids(&out), vec![1, 2, 3, 4]);
    for r in &out.owned {
        if r.id == 2 || r.id == 3 {
            assert_ne!(r.epoch, epoch_of(r.id), "account {} got a new epoch", r.id);
        }
    }
}

#[tokio::test]
async fn epochs_after_a_failover_or_a_restore_are_above_every_earlier_one() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    let a = cycle(&mut conn, "a", &[], &[]).await;
    let before = *epochs(&a).iter().max().unwrap();
    // The lost tail: the sequence itself rewound (it lives in the WAL too).
    exec(&mut conn, "SELECT setval('owner_epoch_seq', 1)").await;
    exec(
        &mut conn,
        "UPDATE trading_accounts SET node_id = NULL, lease_until = NULL",
    )
    .await;
    stage_failover(&mut conn).await;
    let first = cycle(&mut conn, "b", &[], &[]).await;
    let era_start = first
        .database
        .era_start
        .expect("the detecting cycle moved the sequence");
    let timeline = first.database.timeline.unwrap();
    assert_eq!(era_start, timeline << 40, "the era is the timeline");
    let b = after_grace(&mut conn, "b").await;
    assert_eq!(b.owned.len(), 2);
    for e in epochs(&b) {
        assert!(e > before && e > era_start, "epoch {e} after {before}");
    }
    let failover_max = *epochs(&b).iter().max().unwrap();

    // A dump restored onto another cluster: same timeline number, another system identifier.
    exec(
        &mut conn,
        "UPDATE copier_database SET system_id = system_id + 1",
    )
    .await;
    exec(&mut conn, "SELECT setval('owner_epoch_seq', 1)").await;
    exec(
        &mut conn,
        "UPDATE trading_accounts SET node_id = NULL, lease_until = NULL",
    )
    .await;
    let first = cycle(&mut conn, "c", &[], &[]).await;
    assert!(
        first.database.failed_over,
        "another system identifier is a failover too"
    );
    assert_eq!(
        first.database.era_start,
        Some((timeline + 1) << 40),
        "the era moves on though the timeline number did not"
    );
    let c = after_grace(&mut conn, "c").await;
    for e in epochs(&c) {
        assert!(e > failover_max, "epoch {e} after {failover_max}");
    }
}

#[tokio::test]
async fn a_node_that_lost_a_claim_with_the_tail_keeps_nothing_of_it() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=1, "mt5").await;
    let first = cycle(&mut conn, "a", &[], &[]).await;
    let epoch = first.owned[0].epoch;
    // The claim was lost: the new primary shows the account free.
    exec(
        &mut conn,
        "UPDATE trading_accounts SET node_id = NULL, lease_until = NULL",
    )
    .await;
    stage_failover(&mut conn).await;
    // a's gate is still open: it keeps the epoch, but there is no such row to keep.
    let a = cycle(&mut conn, "a", &[epoch], &[epoch]).await;
    assert!(a.owned.is_empty(), "a learns it does not own the account");
    let b = cycle(&mut conn, "b", &[], &[]).await;
    assert!(
        b.owned.is_empty(),
        "nobody claims it while a's gate may be open"
    );
    assert_eq!(row(&mut conn, 1).await.0, None);
}

#[tokio::test]
async fn status_shows_the_failover_and_the_grace() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=1, "mt5").await;
    cycle(&mut conn, "a", &[], &[]).await;
    // A node that ran with a 600 s lease makes the grace 601 s: the two `status` processes
    // below read it while it lasts however slowly they start (a 4 s grace could end first).
    let long_lease = Duration::from_secs(600);
    run_once_with_lease(&mut conn, long_lease).await;
    stage_failover(&mut conn).await;
    assert!(cycle(&mut conn, "b", &[], &[]).await.database.failed_over);
    let url = db.url.clone();
    let (json, text) = tokio::task::spawn_blocking(move || {
        let env = [("DATABASE_URL", url.as_str())];
        let json = crate::support::process::run_to_end(&["status", "--json"], &env);
        let text = crate::support::process::run_to_end(&["status"], &env);
        (json, text)
    })
    .await
    .unwrap();
    assert_eq!((json.0, text.0), (0, 0), "{} {}", json.2, text.2);
    let doc: serde_json::Value = serde_json::from_str(json.1.trim()).unwrap();
    assert!(doc["database_failed_over_ms"].is_i64(), "{doc}");
    let grace = doc["database_grace_ms"].as_i64().unwrap();
    assert!(
        grace > 0 && grace <= (long_lease + Duration::from_secs(1)).as_millis() as i64,
        "{grace}"
    );
    assert!(
        text.1.contains("ago: no claims for") && text.1.contains("(grace)"),
        "{}",
        text.1
    );
}

/// A whole node through a (staged) failover: it keeps its accounts at their epochs, counts the
/// failover, publishes the grace, and claims again after it.
#[tokio::test]
async fn a_node_keeps_its_accounts_through_a_failover_and_shows_the_grace() {
    use crate::support::{FAST, config, start_node, wait_state};
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=3, "mt5").await;
    let a = start_node(&config(&db, "a", 100, FAST)).await;
    wait_state(&a.state, "a owns 3", GRACE * 5, |s| s.owned.len() == 3).await;
    let before = (*a.state.borrow().owned).clone();
    stage_failover(&mut conn).await;
    // A fourth account appears meanwhile: nobody may claim it during the grace.
    insert_accounts(&mut conn, 4..=4, "mt5").await;
    wait_state(&a.state, "a saw the failover", GRACE * 5, |s| {
        s.db_failovers == 1 && s.grace_until.is_some()
    })
    .await;
    assert_eq!(
        *a.state.borrow().owned,
        before,
        "kept every account at its epoch, claimed nothing"
    );
    let claimed_at_grace_end = wait_state(&a.state, "the grace to end", GRACE * 5, |s| {
        s.grace_until.is_none() && s.owned.len() == 4
    })
    .await;
    let (claimed_ms, claims_after_ms): (i64, i64) = sqlx::query_as(
        "SELECT (extract(epoch FROM a.claimed_at) * 1000)::bigint,
                (extract(epoch FROM d.claims_after) * 1000)::bigint
           FROM trading_accounts a, copier_database d WHERE a.id = 4",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert!(
        claimed_ms >= claims_after_ms,
        "account 4 claimed at {claimed_ms}, before the grace ended at {claims_after_ms}: {claimed_at_grace_end:?}"
    );
    a.shutdown();
    a.wait().await.unwrap();
}

#[tokio::test]
async fn the_grace_covers_the_longest_lease_any_node_ever_ran_with() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=1, "mt5").await;
    // A node with a 20 s lease ran once; its membership is gone from the new primary (the lost
    // tail, or it was forgotten), but the cluster remembers the lease.
    run_once_with_lease(&mut conn, Duration::from_secs(20)).await;
    exec(&mut conn, "DELETE FROM nodes WHERE node_id = 'long'").await;
    stage_failover(&mut conn).await;
    let out = cycle(&mut conn, "a", &[], &[]).await;
    assert!(out.database.failed_over);
    assert!(
        out.database.grace >= Duration::from_secs(20),
        "a 3 s node's grace covers the 20 s lease: {:?}",
        out.database.grace
    );
}

#[tokio::test]
async fn the_era_moves_above_the_sequences_own() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=1, "mt5").await;
    cycle(&mut conn, "a", &[], &[]).await;
    // Epochs of era 5 were handed out (say, on a cluster this one was restored from).
    exec(
        &mut conn,
        "SELECT setval('owner_epoch_seq', (5::bigint << 40) + 3)",
    )
    .await;
    stage_failover(&mut conn).await;
    let out = cycle(&mut conn, "b", &[], &[]).await;
    assert_eq!(out.database.era_start, Some(6 << 40));
}

#[tokio::test]
async fn after_a_failover_a_master_without_a_snapshot_is_not_a_master_without_positions() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    assert!(
        copier_node::db::copy::master_state(&mut conn, 42)
            .await
            .unwrap()
            .is_none(),
        "before any failover: the master never published"
    );
    insert_accounts(&mut conn, 1..=1, "mt5").await;
    cycle(&mut conn, "a", &[], &[]).await;
    stage_failover(&mut conn).await;
    cycle(&mut conn, "a", &[], &[]).await;
    let state = copier_node::db::copy::master_state(&mut conn, 42)
        .await
        .unwrap()
        .expect("after a failover a missing snapshot may have been lost");
    assert!(state.before_failover && state.positions.is_empty());
}

#[tokio::test]
async fn the_database_itself_refuses_new_epochs_during_the_grace() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    let a = cycle(&mut conn, "a", &[], &[]).await;
    exec(
        &mut conn,
        "UPDATE trading_accounts SET node_id = NULL, lease_until = NULL WHERE id = 2",
    )
    .await;
    stage_failover(&mut conn).await;
    cycle(&mut conn, "b", &[], &[]).await;
    // What an older binary's cycle does: claim a free row with a new epoch, and re-claim its own.
    let claimed = sqlx::query(
        "UPDATE trading_accounts SET node_id = 'old', lease_until = now() + interval '3 s',
                owner_epoch = nextval('owner_epoch_seq')
          WHERE id = 2",
    )
    .execute(&mut conn)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(claimed, 0, "a claim during the grace is skipped");
    let epoch_1 = a.owned.iter().find(|r| r.id == 1).unwrap().epoch;
    let renewed = sqlx::query(
        "UPDATE trading_accounts SET lease_until = now() + interval '3 s' WHERE id = 1",
    )
    .execute(&mut conn)
    .await
    .unwrap()
    .rows_affected();
    assert_eq!(renewed, 1, "a renewal at the same epoch goes through");
    assert_eq!(row(&mut conn, 1).await, (Some("a".into()), epoch_1));
    assert_eq!(row(&mut conn, 2).await.0, None);
}
