//! Whole nodes in-process against a real PostgreSQL: claiming, expiry, disable, loss, trust.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use sqlx::{Connection, Executor};
use tokio::time::Instant;

use crate::support::{
    FAST, IsolatedNode, TestDb, Timing, config, counts, eventually, insert_accounts, last_lease,
    owners, start_node, wait_state,
};

/// Sixteen nodes starting together (a cold start: each counts its share until it holds still,
/// then claims) claim every row, each exactly once.
#[tokio::test]
async fn sixteen_nodes_claim_a_thousand_rows_each_exactly_once() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=1000, "mt5").await;
    const CAPACITY: usize = 70; // 16 x 70 = 1120: capacity binds for the first claimers.
    let configs: Vec<_> = (0..16)
        .map(|n| config(&db, &format!("n{n:02}"), CAPACITY as u32, FAST))
        .collect();
    let nodes = futures_join(configs.iter().map(start_node)).await;

    // Every row claimed: once every node has claimed (settled its share), and two cycles more.
    for node in &nodes {
        wait_state(&node.state, "a claim", Duration::from_secs(30), |s| {
            !s.owned.is_empty()
        })
        .await;
        let from = node.state.borrow().cycles;
        wait_state(
            &node.state,
            "two cycles more",
            Duration::from_secs(30),
            |s| s.cycles >= from + 2,
        )
        .await;
    }
    let never: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM trading_accounts WHERE owner_epoch = 0 ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    assert!(
        never.is_empty(),
        "all rows claimed within two cycles of every node's first claim; never claimed: {never:?}"
    );
    // Fair share then moves some (a row is free for a moment between a release and its claim);
    // once that settles (no change for half a second), every row is owned, no node is over
    // capacity, and every node's view agrees with the database.
    let mut previous = BTreeMap::new();
    let db_owners = eventually("ownership to settle", Duration::from_secs(60), async || {
        let now = owners(&mut conn).await;
        let settled = now == previous
            && now.values().all(Option::is_some)
            && nodes
                .iter()
                .map(|n| n.state.borrow().owned.len())
                .sum::<usize>()
                == 1000;
        previous = now.clone();
        if !settled {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        settled.then_some(now)
    })
    .await;
    let per_node = counts(&mut conn).await;
    for (node, n) in &per_node {
        assert!(*n <= CAPACITY, "{node} owns {n} > capacity {CAPACITY}");
    }

    // Every row is owned by exactly one node, and each node's view matches the database's.
    let mut seen: BTreeMap<i64, String> = BTreeMap::new();
    for node in &nodes {
        let state = node.state.borrow().clone();
        assert!(state.owned.len() <= CAPACITY);
        for id in state.owned.keys() {
            if let Some(other) = seen.insert(*id, state.node_id.clone()) {
                panic!("account {id} is live on both {other} and {}", state.node_id);
            }
            assert_eq!(
                db_owners[id].as_deref(),
                Some(state.node_id.as_str()),
                "account {id}"
            );
        }
    }
    assert_eq!(seen.len(), 1000);
    for node in nodes {
        node.shutdown();
        node.wait().await.unwrap();
    }
}

async fn futures_join<F: Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut out = Vec::new();
    let handles: Vec<_> = futures.collect();
    for f in handles {
        out.push(f.await);
    }
    out
}

#[tokio::test]
async fn a_node_that_stops_renewing_keeps_its_rows_until_lease_until_passes() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=30, "mt5").await;
    // a keeps everything (a margin of its whole share): this test is about expiry, not balance.
    let mut a_config = config(&db, "a", 100, FAST);
    a_config.rebalance_margin = 1.0;
    let mut a = IsolatedNode::start(&a_config).await;
    wait_state(&a.state, "a owns all", Duration::from_secs(10), |s| {
        s.owned.len() == 30
    })
    .await;
    let b = start_node(&config(&db, "b", 100, FAST)).await;
    wait_state(&b.state, "b's first cycle", Duration::from_secs(10), |s| {
        s.cycles >= 1
    })
    .await;
    assert!(
        b.state.borrow().owned.is_empty(),
        "b claims nothing while a renews"
    );

    a.crash();
    let last_lease = last_lease(&mut conn, None).await;
    wait_state(&b.state, "b owns a's rows", Duration::from_secs(15), |s| {
        s.owned.len() == 30
    })
    .await;
    let early: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM trading_accounts WHERE claimed_at <= $1::timestamptz ORDER BY id",
    )
    .bind(&last_lease)
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert!(
        early.is_empty(),
        "rows {early:?} were claimed before a's last lease_until ({last_lease})"
    );
    b.shutdown();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn disabled_rows_are_released_in_the_owners_next_cycle() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=10, "mt5").await;
    let node = start_node(&config(&db, "a", 100, FAST)).await;
    wait_state(&node.state, "a owns all", Duration::from_secs(10), |s| {
        s.owned.len() == 10
    })
    .await;
    let cycles_at_disable = node.state.borrow().cycles;
    conn.execute("UPDATE trading_accounts SET enabled = false WHERE id IN (2, 5, 7)")
        .await
        .unwrap();
    let released = eventually("disabled rows released", Duration::from_secs(10), async || {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE id IN (2, 5, 7) AND node_id IS NULL AND lease_until IS NULL")
            .fetch_one(&mut conn)
            .await
            .unwrap();
        (n == 3).then(|| node.state.borrow().cycles)
    })
    .await;
    assert!(
        released <= cycles_at_disable + 2,
        "released by cycle {released}, disabled after cycle {cycles_at_disable}"
    );
    let state = wait_state(
        &node.state,
        "sessions stopped",
        Duration::from_secs(5),
        |s| s.owned.len() == 7,
    )
    .await;
    assert!(!state.owned.contains_key(&2));
    let status: String = sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = 5")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(status, "released: disabled");
    // Nobody claims a disabled row.
    let other = start_node(&config(&db, "b", 100, FAST)).await;
    wait_state(
        &other.state,
        "b's second cycle",
        Duration::from_secs(10),
        |s| s.cycles >= 2,
    )
    .await;
    let taken = other.state.borrow().owned.clone();
    assert!(
        !taken.contains_key(&2) && !taken.contains_key(&5) && !taken.contains_key(&7),
        "b took a disabled account: {taken:?}"
    );
    for n in [node, other] {
        n.shutdown();
        n.wait().await.unwrap();
    }
}

#[tokio::test]
async fn an_account_taken_away_is_dropped_by_the_node() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=3, "mt5").await;
    let node = start_node(&config(&db, "a", 100, FAST)).await;
    wait_state(&node.state, "a owns all", Duration::from_secs(10), |s| {
        s.owned.len() == 3
    })
    .await;
    // An operator hands account 2 to another (registered) node by hand.
    conn.execute(
        "INSERT INTO nodes VALUES ('z', 'zz', 'mt5', 1, now() + interval '1 hour', now(), now())",
    )
    .await
    .unwrap();
    conn.execute("UPDATE trading_accounts SET node_id = 'z', owner_epoch = nextval('owner_epoch_seq') WHERE id = 2").await.unwrap();
    let state = wait_state(
        &node.state,
        "account 2 dropped",
        Duration::from_secs(10),
        |s| s.owned.len() == 2,
    )
    .await;
    assert!(!state.owned.contains_key(&2));
    let owner: String = sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = 2")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(owner, "z", "the node never writes a row it lost");
    node.shutdown();
    node.wait().await.unwrap();
    let owner: String = sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = 2")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(owner, "z", "shutdown releases only what the node owns");
}

#[tokio::test]
async fn a_slow_renewal_does_not_extend_trust_beyond_t0_plus_lease_minus_fence() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    // A 10 s fence makes the cycle's lock_timeout 2 s: the held lock (seen, then 250 ms) is
    // let go well inside it on a loaded machine (with a 2 s fence, 400 ms left ~100 ms of slack,
    // and a cycle timed out on the lock would be followed by a later one, failing the check).
    let timing = Timing {
        lease: "30s",
        fence: "10s",
        cycle: "1s",
    };
    let window = Duration::from_secs(20);
    let node = start_node(&config(&db, "a", 100, timing)).await;
    let owning = wait_state(&node.state, "a owns both", Duration::from_secs(10), |s| {
        s.owned.len() == 2
    })
    .await;
    // One cycle more: the count the node publishes after the cycle that claimed (an `UPDATE` of
    // its membership) is done, so the only statement the lock below can hold is a cycle.
    wait_state(
        &node.state,
        "a cycle after the claim",
        Duration::from_secs(10),
        |s| s.cycles > owning.cycles,
    )
    .await;
    let failed = node.state.borrow().failed_cycles;

    // Hold the node's membership row so its next cycle waits on the lock (below its lock_timeout).
    let mut blocker = db.conn().await;
    let mut tx = blocker.begin().await.unwrap();
    // A table lock, not a row lock: it takes no transaction id, so it does not hold back the
    // cluster's pruning horizon (which disturbs `renewals_are_hot_updates` running alongside).
    tx.execute("LOCK TABLE nodes IN SHARE MODE").await.unwrap();
    let mut watcher = db.conn().await;
    eventually("the cycle to wait on the lock", Duration::from_secs(10), async || {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE application_name = 'copier-node a' AND wait_event_type = 'Lock' AND query LIKE '%copier_timeline()%')",
        )
        .fetch_one(&mut watcher)
        .await
        .unwrap();
        waiting.then_some(())
    })
    .await;
    // The cycle's t0 was read before this instant, and it is the one in flight: cycles run one
    // at a time, so the next one counted is this one (not one acknowledged before the lock).
    let seen_blocked = Instant::now();
    let cycles = node.state.borrow().cycles;
    tokio::time::sleep(Duration::from_millis(250)).await; // the stall being simulated
    tx.commit().await.unwrap();
    let released_at = Instant::now();
    let state = wait_state(
        &node.state,
        "the slow cycle to complete",
        Duration::from_secs(10),
        |s| s.cycles > cycles,
    )
    .await;
    assert_eq!(
        state.failed_cycles, failed,
        "the blocked cycle itself completed: {:?}",
        state.last_error
    );
    let deadline = state
        .trusted_until
        .expect("trusted after a successful cycle");
    assert!(
        deadline <= seen_blocked + window,
        "trust must count from t0 (before the statement), not from the acknowledgement"
    );
    assert!(
        deadline + Duration::from_millis(200) < released_at + window,
        "a deadline counted from the acknowledgement would be at least {:?} later",
        released_at - seen_blocked
    );
    node.shutdown();
    node.wait().await.unwrap();
}

#[tokio::test]
async fn the_gate_closes_at_the_deadline_when_renewals_fail_and_reopens_after_a_renewal() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    let node = start_node(&config(&db, "a", 100, FAST)).await;
    let state = wait_state(&node.state, "a owns both", Duration::from_secs(10), |s| {
        s.owned.len() == 2 && s.trusted()
    })
    .await;
    let epochs = state.owned.clone();

    // Every cycle now fails on the membership lock (lock_timeout is a fifth of the fence).
    let mut blocker = db.conn().await;
    let mut tx = blocker.begin().await.unwrap();
    // A table lock, not a row lock: it takes no transaction id, so it does not hold back the
    // cluster's pruning horizon (which disturbs `renewals_are_hot_updates` running alongside).
    tx.execute("LOCK TABLE nodes IN SHARE MODE").await.unwrap();
    let before = node.state.borrow().trusted_until.unwrap();
    let cycles_at_lock = node.state.borrow().cycles;
    let closed = wait_state(
        &node.state,
        "the gate to close",
        Duration::from_secs(10),
        |s| !s.trusted(),
    )
    .await;
    let closed_at = Instant::now();
    assert!(closed.failed_cycles > 0);
    assert!(
        closed.cycles <= cycles_at_lock + 1,
        "no renewal succeeded while the table was locked"
    );
    let deadline = closed.trusted_until.unwrap();
    assert!(deadline >= before, "the deadline never moves back");
    assert!(
        closed_at >= deadline,
        "the gate closes only at its deadline"
    );
    assert!(closed.last_error.is_some());

    tx.rollback().await.unwrap();
    let open = wait_state(
        &node.state,
        "the gate to reopen",
        Duration::from_secs(10),
        |s| s.trusted(),
    )
    .await;
    assert!(open.trusted_until.unwrap() > deadline);
    // The lease itself had not expired (lease 3 s > fence-window 2 s + lock wait): same epochs.
    assert!(open.last_error.is_none());
    let still: HashSet<i64> = open.owned.values().copied().collect();
    let before: HashSet<i64> = epochs.values().copied().collect();
    if still == before {
        // Renewed within the lease: the same gates reopened, and their tasks were told.
        assert!(
            open.trust_restorations >= 2,
            "both accounts' tasks learn that trust came back"
        );
    } else {
        // The lease ran out first (a slow machine): re-claimed with new epochs, new tasks.
        assert!(
            still.is_disjoint(&before),
            "never a mix of old and new epochs"
        );
    }
    node.shutdown();
    node.wait().await.unwrap();
}

async fn update_stats(conn: &mut sqlx::PgConnection) -> (i64, i64) {
    sqlx::query_as("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'trading_accounts'")
        .fetch_one(conn)
        .await
        .unwrap()
}

#[tokio::test]
async fn renewals_are_hot_updates() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=200, "mt5").await;
    let node = start_node(&config(&db, "a", 200, FAST)).await;
    // Past the claim (which changes node_id, an indexed column, so it cannot be HOT).
    wait_state(&node.state, "steady state", Duration::from_secs(30), |s| {
        s.cycles >= 4 && s.owned.len() == 200
    })
    .await;
    // Statistics reach the shared view up to a second after each transaction: compare two
    // snapshots taken at least eight cycles' worth of renewals apart.
    let (upd0, hot0) = eventually(
        "the claim in the statistics",
        Duration::from_secs(20),
        async || {
            let s = update_stats(&mut conn).await;
            (s.0 >= 400).then_some(s)
        },
    )
    .await;
    let (upd1, hot1) = eventually(
        "eight more renewals in the statistics",
        Duration::from_secs(30),
        async || {
            let s = update_stats(&mut conn).await;
            (s.0 >= upd0 + 200 * 8).then_some(s)
        },
    )
    .await;
    node.shutdown();
    node.wait().await.unwrap();
    let (updates, hot) = (upd1 - upd0, hot1 - hot0);
    eprintln!("{hot} HOT of {updates} renewals in steady state");
    assert!(
        hot as f64 >= updates as f64 * 0.95,
        "{hot} HOT of {updates} renewals"
    );
}

/// A node opens its pool's connections as it starts, not in the burst that first needs them: a
/// hand-off's receiver opened two or three while its moved followers' first reads waited, each
/// several milliseconds on a busy machine. Judged by PostgreSQL: an idle node that owns nothing
/// soon holds the pool's connections (`pg_stat_activity`, by the node's application name),
/// besides the lease cycle's.
#[tokio::test]
async fn a_node_opens_its_pools_connections_as_it_starts() {
    let db = crate::support::TestDb::new().await;
    let node = crate::support::start_node(&crate::support::config(
        &db,
        "warm",
        10,
        crate::support::FAST,
    ))
    .await;
    let mut watcher = db.conn().await;
    crate::support::eventually(
        "the node's pool connections open",
        Duration::from_secs(20),
        async || {
            let open: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'copier-node warm'",
            )
            .fetch_one(&mut watcher)
            .await
            .unwrap();
            (open > i64::from(copier_node::db::POOL_SIZE)).then_some(())
        },
    )
    .await;
    node.shutdown();
    node.wait().await.unwrap();
}
