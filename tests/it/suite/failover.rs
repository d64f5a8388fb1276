//! PostgreSQL itself failing over and forgetting its last commits (issue 16), with a real
//! primary, a real standby made by `pg_basebackup` replicating through a chaos proxy, and the
//! standby promoted by `pg_ctl promote`. Replication is cut first, so claims, releases and
//! hand-offs commit on the primary only: the promoted standby has never heard of them.
//!
//! Leases are longer than the failover takes (lease 20 s, fence 5 s), or every gate would close
//! before the danger could show. Judged from the journal alone, with the simulated broker's fence
//! check and client-id deduplication both off: no duplicate, no order by an old owner after the
//! new owner's first, no epoch used by two owners; and every follower converges after the grace.

use std::time::Duration;

use tokio::time::Instant;

use super::{Suite, checker};
use crate::support::Timing;
use crate::support::chaos::Mode;

/// Lease 20 s, fence 5 s: a node trusts a renewal for 15 s.
const SLOW: Timing = Timing {
    lease: "20s",
    fence: "5s",
    cycle: "1s",
};
const UNPROTECTED: &[&str] = &["--no-fence-check", "--no-dedupe"];
const WAIT: Duration = Duration::from_secs(90);

/// Lets the masters trade for `d` (the workload, not a wait for a condition).
async fn trade_for(s: &mut Suite, d: Duration) {
    if s.generator.is_none() {
        s.start_trading();
    }
    tokio::time::sleep(d).await;
}

/// A node cut off from the database: its gates close at its own deadline; then it reaches the
/// new primary (and learns what it owns there).
async fn reconnect_after_its_deadline(s: &mut Suite, node: &str) {
    s.node(node)
        .process
        .wait_for_output("gate closed: lease trust lapsed", WAIT)
        .await;
    s.node(node).db_proxy.set(Mode::Forward);
}

/// Every account's (id, epoch).
async fn epochs(s: &Suite) -> Vec<(i64, i64)> {
    let mut conn = s.conn().await;
    sqlx::query_as("SELECT id, owner_epoch FROM trading_accounts ORDER BY id")
        .fetch_all(&mut conn)
        .await
        .unwrap()
}

async fn wait_owned(s: &Suite, node: &str, n: usize) {
    let since = Instant::now();
    while s.owned_by(node).await.len() < n {
        assert!(
            since.elapsed() < WAIT,
            "{}: {node} does not own {n} accounts: {:?}",
            s.name,
            s.owners().await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A lost release and re-claim: a hands accounts to b on the primary only, so the new primary
/// shows them as a's, at a's old epochs, unexpired, while b (cut off from the database) keeps
/// copying them on its trust until its deadline. Node c first connects after the failover.
#[tokio::test]
async fn a_hand_off_the_new_primary_never_saw_gives_no_account_two_owners() {
    let mut s = Suite::with_standby("suite-failover", UNPROTECTED).await;
    s.timing = SLOW;
    s.fence_ms = 5000;
    s.start_node("a", 100, Vec::new()).await;
    wait_owned(&s, "a", 8).await;
    s.wait_ready().await;
    trade_for(&mut s, Duration::from_secs(2)).await;
    s.standby_caught_up().await;

    // From here on commits reach the primary only.
    s.cut_replication();
    s.start_node("b", 100, Vec::new()).await;
    // The hand-off (a's releases, b's claims) and b's first copies: all on the lost tail.
    wait_owned(&s, "b", 4).await;
    let handed: Vec<i64> = s.owned_by("b").await;
    trade_for(&mut s, Duration::from_secs(3)).await;
    let epochs_before = epochs(&s).await;

    // b loses the database (its LISTEN connection stays, so it keeps copying on its trust),
    // then the primary dies and the standby is promoted.
    s.node("b").db_proxy.set(Mode::Hang);
    let promoted_at = Instant::now();
    s.fail_over().await;
    eprintln!(
        "[{}] primary killed, standby promoted in {} ms; accounts handed to b on the lost tail: {handed:?}",
        s.name,
        promoted_at.elapsed().as_millis()
    );
    // A node whose first cycle comes after the failover.
    s.start_node("c", 100, Vec::new()).await;
    s.node("a")
        .process
        .wait_for_output("database failed over", WAIT)
        .await;
    reconnect_after_its_deadline(&mut s, "b").await;

    finish_after_failover(&mut s, promoted_at, &epochs_before).await;
}

/// A lost claim: b claims a free account on the primary only, so the new primary shows it free,
/// while b (cut off from the database) keeps copying it on its trust until its deadline. Node c,
/// whose first cycle comes after the failover, has room for it: without the grace it would claim
/// it at once.
#[tokio::test]
async fn a_claim_the_new_primary_never_saw_is_not_granted_again_until_the_grace_ends() {
    let mut s = Suite::with_standby("suite-failover-claim", UNPROTECTED).await;
    s.timing = SLOW;
    s.fence_ms = 5000;
    // a's capacity leaves account 8 free (a claims in id order).
    s.start_node("a", 7, Vec::new()).await;
    wait_owned(&s, "a", 7).await;
    trade_for(&mut s, Duration::from_secs(2)).await;
    s.standby_caught_up().await;

    s.cut_replication();
    // b's fair share (capacity 1 of 8) is exactly the free account: no hand-off, one claim.
    s.start_node("b", 1, Vec::new()).await;
    wait_owned(&s, "b", 1).await;
    assert_eq!(s.owned_by("b").await, vec![8]);
    trade_for(&mut s, Duration::from_secs(3)).await;
    let epochs_before = epochs(&s).await;

    s.node("b").db_proxy.set(Mode::Hang);
    let promoted_at = Instant::now();
    s.fail_over().await;
    let free: Option<String> = {
        let mut conn = s.conn().await;
        sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = 8")
            .fetch_one(&mut conn)
            .await
            .unwrap()
    };
    assert_eq!(free, None, "the new primary never saw b's claim");
    s.start_node("c", 100, Vec::new()).await;
    s.node("c")
        .process
        .wait_for_output("joined the cluster", WAIT)
        .await;
    reconnect_after_its_deadline(&mut s, "b").await;
    finish_after_failover(&mut s, promoted_at, &epochs_before).await;
}

/// Waits until every account is owned again (the grace is over), lets trading run, and judges:
/// convergence, no claim inside the grace (from the database), epochs above every earlier one,
/// and the journal (duplicates, S1 gaps against the 5 s fence, no epoch used twice).
async fn finish_after_failover(s: &mut Suite, promoted_at: Instant, epochs_before: &[(i64, i64)]) {
    // Every account owned again once the grace is over, and copying resumes.
    let since = Instant::now();
    while s.owners().await.len() < 8 {
        assert!(
            since.elapsed() < WAIT,
            "{}: not every account owned after the grace: {:?}",
            s.name,
            s.owners().await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let owned_again = promoted_at.elapsed();
    trade_for(s, Duration::from_secs(3)).await;
    let orders = s.stop_trading().await;
    let converged = s.converged(WAIT).await;
    eprintln!(
        "[{}] {orders} master orders; copying resumed (every account owned again) {} ms after the promotion; converged {} ms after trading stopped",
        s.name,
        owned_again.as_millis(),
        converged.as_millis()
    );

    let mut conn = s.conn().await;
    // Nothing was claimed between the failover's detection and the end of the grace.
    let (grace_claims, detected): (i64, bool) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE a.claimed_at >= d.failed_over_at AND a.claimed_at < d.claims_after),
                bool_or(d.failed_over_at IS NOT NULL)
           FROM trading_accounts a, copier_database d",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert!(detected, "the failover was detected");
    assert_eq!(grace_claims, 0, "claims during the grace");
    // Every account the new primary handed out again has an epoch above every earlier one.
    let max_before = epochs_before.iter().map(|(_, e)| *e).max().unwrap();
    let after = epochs(s).await;
    for ((id, old), (_, new)) in epochs_before.iter().zip(&after) {
        assert!(
            new == old || *new > max_before,
            "account {id}: epoch {new} after the failover is not above every earlier one ({max_before})"
        );
    }
    s.check(false).await;
    let lines = checker::load(&s.dir.path("journal.jsonl"));
    let reused = checker::epochs_reused(&lines);
    assert!(reused.is_empty(), "{}: {reused:?}", s.name);
}

/// `copier_db_synchronous` follows the database's promise on the node's own connection, within a
/// few cycles: 1 once commits wait for the standby (`synchronous_standby_names` set and the
/// configuration reloaded, as Patroni's `synchronous_mode` does), 0 once they no longer do (as
/// Patroni drops to asynchronous replication when its synchronous standby fails). The database's
/// own view (`pg_stat_replication.sync_state`) confirms each state first.
#[tokio::test]
async fn copier_db_synchronous_follows_the_database_without_a_new_connection() {
    let mut s = Suite::with_standby("suite-sync-gauge", UNPROTECTED).await;
    s.start_node("a", 100, Vec::new()).await;
    let mut conn = s.conn().await;
    for (names, sync_state, gauge) in [
        ("", "async", 0.0),
        ("'*'", "sync", 1.0),
        ("''", "async", 0.0),
    ] {
        if !names.is_empty() {
            sqlx::query(&format!(
                "ALTER SYSTEM SET synchronous_standby_names = {names}"
            ))
            .execute(&mut conn)
            .await
            .unwrap();
            sqlx::query("SELECT pg_reload_conf()")
                .execute(&mut conn)
                .await
                .unwrap();
        }
        crate::support::eventually(format!("the standby {sync_state}"), WAIT, async || {
            let state: Option<String> =
                sqlx::query_scalar("SELECT sync_state FROM pg_stat_replication LIMIT 1")
                    .fetch_optional(&mut conn)
                    .await
                    .unwrap();
            (state.as_deref() == Some(sync_state)).then_some(())
        })
        .await;
        let node = &s.node("a").process;
        crate::support::eventually(format!("copier_db_synchronous {gauge}"), WAIT, async || {
            (node.metric("copier_db_synchronous").await == Some(gauge)).then_some(())
        })
        .await;
    }
}
