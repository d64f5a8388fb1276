//! A master's session and the updates its stream queued before its first read.

use std::time::Duration;

use copier_node::broker::types::Side;
use copier_node::copier::events::{MasterEvent, MasterNotice};
use sqlx::postgres::PgListener;

use crate::support::broker::journal;
use crate::support::fixture::CopySetup;
use crate::support::{
    FAST, LinkSpec, add_account, add_link, config, eventually, start_node, wait_state,
};

const WAIT: Duration = Duration::from_secs(60);

/// The stream of a master's session starts at its login; its first read (slow, as on a real
/// trade server) answers later. What the stream queued meanwhile is older than that read: a
/// position opened and closed before it, and partial closes it already shows. The session
/// publishes none of it again after its snapshot: no follower ever copies the position that had
/// closed, and no published partial close grows a position. Judged from the broker's journal
/// (every read journaled: the trades all precede the session's first read of the positions) and
/// the master's announcements as any follower hears them.
#[tokio::test]
async fn a_master_publishes_nothing_older_than_its_first_read() {
    let CopySetup {
        db,
        dir,
        broker,
        t,
        mut conn,
        addr,
        ..
    } = CopySetup::with("master-stale-stream", |o| {
        o.fence_check = false;
        o.dedupe = false;
        o.journal_reads = true;
        o.read_delay = Duration::from_secs(2);
    })
    .await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    add_account(&mut conn, 2, "follower", &addr, "f2").await;
    add_link(&mut conn, 1, 2, LinkSpec::default()).await;
    let mut announced = PgListener::connect(&db.url).await.unwrap();
    announced.listen("copier_master_1").await.unwrap();
    let node = start_node(&config(&db, "a", 100, FAST)).await;
    wait_state(&node.state, "a owns both", WAIT, |s| s.owned.len() == 2).await;
    // The master's session logged in: its first read is at least a slow read away.
    eventually("the master's login", WAIT, async || {
        journal(&dir.path("journal.jsonl"))
            .iter()
            .any(|l| l.client == "a" && l.login == "m1" && l.action == "login" && l.accepted)
            .then_some(())
    })
    .await;
    let gone = t.open("m1", "EURUSD", Side::Buy, 0.5, None, None).await;
    t.close("m1", gone, None).await;
    let kept = t.open("m1", "EURUSD", Side::Sell, 0.7, None, None).await;
    t.close("m1", kept, Some(0.6)).await;
    t.close("m1", kept, Some(0.04)).await;
    // The follower settles on the one position left.
    eventually("f2's copy of what is left", WAIT, async || {
        let copies = t.positions("f2").await;
        (copies.len() == 1 && (copies[0].volume - 0.06).abs() < 1e-9).then_some(())
    })
    .await;

    let lines = journal(&dir.path("journal.jsonl"));
    let last_trade = lines
        .iter()
        .rposition(|l| l.client == "manual" && ["open", "close"].contains(&l.action.as_str()))
        .expect("the trades");
    let first_read = lines
        .iter()
        .position(|l| l.client == "a" && l.login == "m1" && l.action == "positions")
        .expect("the master's session read its positions");
    assert!(
        last_trade < first_read,
        "precondition: the trades precede the session's first read of the positions"
    );
    assert!(
        !lines.iter().any(|l| l.login == "f2"
            && l.action == "open"
            && l.comment.as_deref() == Some(&format!("mc{gone}"))),
        "f2 copied a position that had closed before the master's first read"
    );
    // Every announcement so far, up to a mark of the test's own sent after them.
    sqlx::query("SELECT pg_notify('copier_master_1', 'end of the test')")
        .execute(&mut conn)
        .await
        .unwrap();
    let mut notices = Vec::new();
    loop {
        let n = tokio::time::timeout(WAIT, announced.recv())
            .await
            .expect("the test's mark")
            .unwrap();
        if n.payload() == "end of the test" {
            break;
        }
        notices.push(serde_json::from_str::<MasterNotice>(n.payload()).unwrap());
    }
    assert!(!notices.is_empty(), "the master announced its snapshot");
    for n in &notices {
        match &n.event {
            MasterEvent::Open { position } => assert_ne!(
                position.ticket, gone,
                "the closed position published as open (seq {})",
                n.seq
            ),
            MasterEvent::Partial { before, after, .. } => assert!(
                after < before,
                "a partial close that grows the position: {before} -> {after} (seq {})",
                n.seq
            ),
            _ => {}
        }
    }
    node.shutdown();
    node.wait().await.unwrap();
    broker.stop().await;
}
