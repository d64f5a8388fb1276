//! Fair share on scale-out: a new node gets its share within a few cycles, shares follow
//! capacities, a crashed node leaves the shares when its membership expires, and no account is
//! ever live on two nodes.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use copier_node::app::NodeHandle;
use tokio::time::Instant;

use crate::support::{FAST, IsolatedNode, TestDb, config, insert_accounts, start_node, wait_state};

const WAIT: Duration = Duration::from_secs(60);

/// Samples the nodes' published ownership until `done` holds, asserting on every sample that no
/// account is live on two nodes; returns the last sample.
async fn watch_disjoint(
    nodes: &[&tokio::sync::watch::Receiver<copier_node::lease::NodeState>],
    within: Duration,
    done: impl Fn(&[BTreeMap<i64, i64>]) -> bool,
) -> Vec<BTreeMap<i64, i64>> {
    let since = Instant::now();
    loop {
        let sample: Vec<BTreeMap<i64, i64>> =
            nodes.iter().map(|n| (*n.borrow().owned).clone()).collect();
        let mut seen: HashMap<i64, usize> = HashMap::new();
        for (i, owned) in sample.iter().enumerate() {
            for id in owned.keys() {
                if let Some(j) = seen.insert(*id, i) {
                    panic!("account {id} is live on nodes {j} and {i} at once");
                }
            }
        }
        if done(&sample) {
            return sample;
        }
        assert!(
            since.elapsed() < within,
            "not balanced within {within:?}: {:?}",
            sample.iter().map(|s| s.len()).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn within(n: usize, target: usize, margin: usize) -> bool {
    n + margin >= target && n <= target + margin
}

/// Nodes a and b sharing 300 accounts: a owned them all, then b joined and took its share.
async fn two_balanced_nodes(db: &TestDb) -> (NodeHandle, NodeHandle) {
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=300, "mt5").await;
    let a = start_node(&config(db, "a", 1000, FAST)).await;
    wait_state(&a.state, "a owns all", WAIT, |s| s.owned.len() == 300).await;
    let b = start_node(&config(db, "b", 1000, FAST)).await;
    watch_disjoint(&[&a.state, &b.state], WAIT, |s| {
        within(s[0].len(), 150, 15) && within(s[1].len(), 150, 15)
    })
    .await;
    (a, b)
}

#[tokio::test]
async fn a_third_node_gets_its_share_within_a_few_cycles() {
    let db = TestDb::new().await;
    let (a, b) = two_balanced_nodes(&db).await;

    let c = start_node(&config(&db, "c", 1000, FAST)).await;
    let started = Instant::now();
    let cycles_before = a.state.borrow().cycles;
    let last = watch_disjoint(&[&a.state, &b.state, &c.state], WAIT, |s| {
        s.iter().all(|o| within(o.len(), 100, 10))
            && s.iter().map(|o| o.len()).sum::<usize>() == 300
    })
    .await;
    let took = started.elapsed();
    let cycles = a.state.borrow().cycles - cycles_before;
    eprintln!(
        "scale-out 2 -> 3 nodes: {:?} accounts after {} ms ({cycles} cycles of a, counting those woken early by releases)",
        last.iter().map(|o| o.len()).collect::<Vec<_>>(),
        took.as_millis()
    );
    // 5 cycle periods at one step of 10 per period; 20 periods (10 s) is the loose bound.
    assert!(
        took <= Duration::from_millis(500) * 20,
        "took {took:?}: more than 20 cycle periods"
    );
    // Hysteresis: a node that started handing off may go on towards its share for a few more
    // cycles; then every move stops, with every node within its margin.
    let moves = |nodes: [&NodeHandle; 3]| -> Vec<u64> {
        nodes
            .iter()
            .map(|n| n.state.borrow().rebalance_moves)
            .collect()
    };
    let since = Instant::now();
    loop {
        let before = moves([&a, &b, &c]);
        for n in [&a, &b, &c] {
            let from = n.state.borrow().cycles;
            wait_state(&n.state, "four more cycles", WAIT, |s| s.cycles >= from + 4).await;
        }
        if moves([&a, &b, &c]) == before {
            break;
        }
        assert!(since.elapsed() < WAIT, "moves go on: {before:?}");
    }
    let counts: Vec<usize> = [&a, &b, &c]
        .iter()
        .map(|n| n.state.borrow().owned.len())
        .collect();
    assert!(
        counts.iter().all(|&n| within(n, 100, 10)) && counts.iter().sum::<usize>() == 300,
        "moves stopped at {counts:?}"
    );
    // Once counts stop moving, every node agrees on the same exact shares.
    for n in [&a, &b, &c] {
        wait_state(&n.state, "the exact share", WAIT, |s| s.target == Some(100)).await;
    }
    for n in [a, b, c] {
        n.shutdown();
        n.wait().await.unwrap();
    }
}

#[tokio::test]
async fn hand_offs_stay_bounded_per_cycle_period_when_releases_wake_the_nodes() {
    // Two shedding nodes announce every release, and each announcement wakes the other into a
    // cycle: those early cycles may claim but must not hand off again (at most one step, a tenth
    // of the share, per cycle period of 500 ms less 20 % jitter).
    let db = TestDb::new().await;
    let (a, b) = two_balanced_nodes(&db).await;
    let c = start_node(&config(&db, "c", 1000, FAST)).await;
    // (read no earlier than, hand-off decisions, read no later than) for a and b.
    let mut samples: [Vec<(Instant, u64, Instant)>; 2] = [Vec::new(), Vec::new()];
    let since = Instant::now();
    loop {
        for (i, n) in [&a, &b].into_iter().enumerate() {
            let before = Instant::now();
            let handoffs = n.state.borrow().handoffs;
            samples[i].push((before, handoffs, Instant::now()));
        }
        let counts: Vec<usize> = [&a, &b, &c]
            .iter()
            .map(|n| n.state.borrow().owned.len())
            .collect();
        if counts.iter().all(|&n| within(n, 100, 10)) && counts.iter().sum::<usize>() == 300 {
            break;
        }
        assert!(since.elapsed() < WAIT, "not balanced: {counts:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for (name, list) in ["a", "b"].iter().zip(&samples) {
        let total = list.last().unwrap().1 - list[0].1;
        assert!(
            total >= 2,
            "{name} made {total} hand-offs: the bound was never exercised"
        );
        for (i, (first_read_from, early, _)) in list.iter().enumerate() {
            for (_, later, second_read_by) in &list[i + 1..] {
                if later - early >= 2 {
                    // Two hand-off decisions between these reads, so they were at least the
                    // period (400 ms) apart; each is published in the same synchronous step as
                    // it is made, and `apart` can only overstate the distance between the reads.
                    let apart = second_read_by.saturating_duration_since(*first_read_from);
                    assert!(
                        apart >= Duration::from_millis(400),
                        "{name} made {} hand-offs within {apart:?}",
                        later - early
                    );
                    break;
                }
            }
        }
    }
    for n in [a, b, c] {
        n.shutdown();
        n.wait().await.unwrap();
    }
}

#[tokio::test]
async fn unequal_capacities_split_in_proportion() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=150, "mt5").await;
    let small = start_node(&config(&db, "small", 100, FAST)).await;
    let big = start_node(&config(&db, "big", 200, FAST)).await;
    let last = watch_disjoint(&[&small.state, &big.state], WAIT, |s| {
        within(s[0].len(), 50, 5) && within(s[1].len(), 100, 10) && s[0].len() + s[1].len() == 150
    })
    .await;
    eprintln!(
        "capacities 100:200 over 150 accounts -> {} : {}",
        last[0].len(),
        last[1].len()
    );
    wait_state(&small.state, "small's exact share", WAIT, |s| {
        s.target == Some(50)
    })
    .await;
    wait_state(&big.state, "big's exact share", WAIT, |s| {
        s.target == Some(100)
    })
    .await;
    for n in [small, big] {
        n.shutdown();
        n.wait().await.unwrap();
    }
}

#[tokio::test]
async fn a_crashed_node_leaves_the_shares_when_its_membership_expires() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=90, "mt5").await;
    let a = start_node(&config(&db, "a", 1000, FAST)).await;
    let b = start_node(&config(&db, "b", 1000, FAST)).await;
    let mut c = IsolatedNode::start(&config(&db, "c", 1000, FAST)).await;
    watch_disjoint(&[&a.state, &b.state, &c.state], WAIT, |s| {
        s.iter().all(|o| within(o.len(), 30, 3)) && s.iter().map(|o| o.len()).sum::<usize>() == 90
    })
    .await;
    wait_state(&a.state, "a's share of three", WAIT, |s| {
        s.target == Some(30)
    })
    .await;
    c.crash();
    // Once c's membership expires, the shares are computed over a and b only.
    wait_state(&a.state, "a's share of two", WAIT, |s| s.target == Some(45)).await;
    wait_state(&b.state, "b's share of two", WAIT, |s| s.target == Some(45)).await;
    watch_disjoint(&[&a.state, &b.state], WAIT, |s| {
        s[0].len() + s[1].len() == 90
    })
    .await;
    for n in [a, b] {
        n.shutdown();
        n.wait().await.unwrap();
    }
}

/// A node that died right after a claim published its `owned` from before the claim. Its rows
/// must still count in every survivor's total, or the shares add up to fewer accounts than
/// there are and its last rows sit unclaimed under shares that are all met (seen in the demo: one
/// account of a killed node stayed unowned until the node came back).
#[tokio::test]
async fn accounts_of_a_dead_node_that_never_published_them_are_still_taken() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=10, "mt5").await;
    // "ghost" holds accounts 7..=10 and is live for a few seconds more, but says it owns none.
    crate::support::insert_node(&mut conn, "ghost", "4 s", 0).await;
    sqlx::query(
        "UPDATE trading_accounts SET node_id = 'ghost', lease_until = now() + interval '4 s',
                owner_epoch = nextval('owner_epoch_seq'), claimed_at = now()
          WHERE id >= 7",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let a = start_node(&config(&db, "a", 1000, FAST)).await;
    // A cold start (six free, the ghost publishing none): a claims once its share holds still,
    // its half of the six it sees (the ghost is a member).
    wait_state(
        &a.state,
        "a owns its share of the six free accounts",
        WAIT,
        |s| s.owned.len() == 3,
    )
    .await;
    // The premise: a settled its share while the ghost was still a live member.
    wait_state(&a.state, "a has a share", WAIT, |s| s.target == Some(3)).await;
    let ghost_live: bool =
        sqlx::query_scalar("SELECT lease_until > now() FROM nodes WHERE node_id = 'ghost'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(
        ghost_live,
        "the machine was too slow to set the premise up; the ghost expired first"
    );
    wait_state(
        &a.state,
        "a owns all ten once the ghost expired",
        WAIT,
        |s| s.owned.len() == 10,
    )
    .await;
    a.shutdown();
    a.wait().await.unwrap();
}
