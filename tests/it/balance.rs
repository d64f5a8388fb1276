//! Fair share on scale-out: a new node gets its share within a few cycles, shares follow
//! capacities, a crashed node leaves the shares when its membership expires, and no account is
//! ever live on two nodes.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

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

#[tokio::test]
async fn a_third_node_gets_its_share_within_a_few_cycles() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=300, "mt5").await;
    let a = start_node(&config(&db, "a", 1000, FAST)).await;
    wait_state(&a.state, "a owns all", WAIT, |s| s.owned.len() == 300).await;
    let b = start_node(&config(&db, "b", 1000, FAST)).await;
    watch_disjoint(&[&a.state, &b.state], WAIT, |s| {
        within(s[0].len(), 150, 15) && within(s[1].len(), 150, 15)
    })
    .await;

    let c = start_node(&config(&db, "c", 1000, FAST)).await;
    let started = Instant::now();
    let cycles_before = a.state.borrow().cycles;
    let last = watch_disjoint(&[&a.state, &b.state, &c.state], WAIT, |s| {
        s.iter().all(|o| within(o.len(), 100, 10))
            && s.iter().map(|o| o.len()).sum::<usize>() == 300
    })
    .await;
    let cycles = a.state.borrow().cycles - cycles_before;
    eprintln!(
        "scale-out 2 -> 3 nodes: {:?} accounts after {} ms ({cycles} cycles of a)",
        last.iter().map(|o| o.len()).collect::<Vec<_>>(),
        started.elapsed().as_millis()
    );
    assert!(cycles <= 20, "took {cycles} cycles");
    // Moves stop once everyone is within the margin.
    let moves: Vec<u64> = [&a, &b, &c]
        .iter()
        .map(|n| n.state.borrow().rebalance_moves)
        .collect();
    for _ in 0..4 {
        wait_state(&a.state, "another cycle", WAIT, |s| {
            s.cycles > cycles_before + cycles
        })
        .await;
    }
    let settled: Vec<u64> = [&a, &b, &c]
        .iter()
        .map(|n| n.state.borrow().rebalance_moves)
        .collect();
    assert_eq!(moves, settled, "no more moves once within the margin");
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
