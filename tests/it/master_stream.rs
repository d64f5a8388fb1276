//! A master's session and the updates its stream queued before its first read.

use std::time::Duration;

use copier_node::broker::types::Side;
use copier_node::copier::events::{MasterEvent, MasterNotice};
use sqlx::postgres::PgListener;

use copier_node::sim_broker::journal::JournalEntry;

use crate::support::broker::journal;
use crate::support::fixture::{CopySetup, master_and_follower};
use crate::support::process::{NodeProcess, NodeSpec};
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

/// How long each read takes in the re-read tests: far longer than a copy.
const SLOW_READ: Duration = Duration::from_secs(2);

/// A master and its follower on one node process whose master session re-reads its broker in
/// the background (fault point `COPIERTEST_MASTER_SYNC`: while the returned file exists, each
/// re-read is asked for as soon as the last is answered), a copy made first; then every read
/// takes [`SLOW_READ`] and is answered as of its request (a real trade server's answer), and
/// the re-reads start. The broker's protections are off; every read is journaled when asked.
struct Rereading {
    setup: CopySetup,
    node: NodeProcess,
    trigger: std::path::PathBuf,
    /// The master's position open before the re-reads started (copied).
    open: i64,
}

impl Rereading {
    async fn start(name: &str) -> Rereading {
        let mut setup = CopySetup::with(name, |o| {
            o.fence_check = false;
            o.dedupe = false;
            o.journal_reads = true;
            o.reads_as_of_request = true;
        })
        .await;
        let (_, magic) =
            master_and_follower(&mut setup.conn, &setup.addr, LinkSpec::default()).await;
        let trigger = setup.dir.path("reread");
        let node = NodeProcess::spawn_with(&NodeSpec {
            node_id: "a".into(),
            capacity: 10,
            timing: FAST,
            database_url: setup.db.url.clone(),
            listen_url: None,
            env: vec![(
                "COPIERTEST_MASTER_SYNC".into(),
                trigger.display().to_string(),
            )],
            extra: Vec::new(),
        });
        let open = setup
            .t
            .open("m1", "EURUSD", Side::Buy, 0.2, None, None)
            .await;
        setup.t.copy_of("f2", magic, open, WAIT).await;
        setup.broker.set_read_delay(SLOW_READ);
        std::fs::write(&trigger, b"reread").unwrap();
        Rereading {
            setup,
            node,
            trigger,
            open,
        }
    }

    /// The master's reads of `action` by the node, as journaled (when asked).
    fn reads(&self, action: &str) -> Vec<JournalEntry> {
        journal(&self.setup.dir.path("journal.jsonl"))
            .into_iter()
            .filter(|l| l.client == "a" && l.login == "m1" && l.action == action)
            .collect()
    }

    /// Waits for the master's next read of `action` asked after any journaled so far; returns
    /// when it was asked (µs).
    async fn next_read(&self, action: &str) -> i64 {
        let before = self.reads(action).len();
        eventually(
            format!("the master's next {action} read"),
            WAIT,
            async || self.reads(action).get(before).map(us),
        )
        .await
    }

    /// A master trade, once the follower's copy is in the journal (the journal, not a read of
    /// the follower's positions: each read takes [`SLOW_READ`]): its ticket.
    async fn trade_copied(&self, side: Side) -> i64 {
        let ticket = self
            .setup
            .t
            .open("m1", "EURUSD", side, 0.1, None, None)
            .await;
        let path = self.setup.dir.path("journal.jsonl");
        eventually(format!("the copy of {ticket}"), WAIT, async || {
            copy_in(&journal(&path), ticket)
        })
        .await;
        ticket
    }

    async fn stop(mut self) -> Vec<JournalEntry> {
        std::fs::remove_file(&self.trigger).unwrap();
        self.setup.broker.set_read_delay(Duration::ZERO);
        self.node.signal("TERM");
        self.node.wait_exit(WAIT).await;
        self.setup.broker.stop().await;
        journal(&self.setup.dir.path("journal.jsonl"))
    }
}

fn us(l: &JournalEntry) -> i64 {
    l.ts_us.expect("journaled in microseconds")
}

/// When the follower's copy of master ticket `ticket` was journaled (µs), if it was.
fn copy_in(lines: &[JournalEntry], ticket: i64) -> Option<i64> {
    lines
        .iter()
        .find(|l| {
            l.login == "f2"
                && l.action == "open"
                && l.comment.as_deref() == Some(&format!("mc{ticket}"))
        })
        .map(us)
}

/// When the follower's copy of master ticket `ticket` was journaled (µs).
fn copied_at(lines: &[JournalEntry], ticket: i64) -> i64 {
    copy_in(lines, ticket).expect("the follower's copy")
}

/// When a read asked at `asked` (µs) is answered.
fn answered(asked: i64) -> i64 {
    asked + i64::try_from(SLOW_READ.as_micros()).unwrap()
}

/// The master session's periodic re-read of its broker (every two minutes: three reads, each
/// hundreds of milliseconds on a real trade server) holds up none of its publications. A master
/// trade made just after a re-read's first read was asked is copied before that read is
/// answered: in the journal, the follower's copy comes within the read's [`SLOW_READ`]. Fails
/// when the session waits for its re-read before it takes the next update (the copy then comes
/// after all three reads, shown by hand).
#[tokio::test]
async fn a_masters_slow_reread_of_its_broker_holds_up_no_copy() {
    let r = Rereading::start("master-slow-reread").await;
    let asked = r.next_read("orders").await;
    let ticket = r.trade_copied(Side::Sell).await;
    let lines = r.stop().await;
    let trade = lines
        .iter()
        .find(|l| l.login == "m1" && l.action == "open" && l.ticket == Some(ticket))
        .map(us)
        .expect("the master's trade");
    assert!(
        asked < trade,
        "precondition: the re-read's read was asked before the trade"
    );
    let (copy, answered) = (copied_at(&lines, ticket), answered(asked));
    assert!(
        copy < answered,
        "the copy ({copy} µs) waited for the master's re-read asked at {asked} µs (answered at {answered} µs)"
    );
}

/// A re-read asked before a change is older than it: the master session does not take it. The
/// master closes its position just after a re-read's positions read was asked (which answers,
/// as a real server's does, with the position still open); once that re-read is over (the next
/// one has asked for its orders), the master's published snapshot (`master_state`, what is
/// judged: the product's output, held to the close in the broker's journal) does not list the
/// closed position, and the follower's copy stays closed. Fails when the session takes every
/// re-read whatever came meanwhile (shown by hand: the snapshot lists it again).
#[tokio::test]
async fn a_masters_reread_asked_before_a_close_does_not_undo_it() {
    let mut r = Rereading::start("master-stale-reread").await;
    let open = r.open;
    let asked = r.next_read("positions").await;
    r.setup.t.close("m1", open, None).await;
    eventually("the follower's copy closed", WAIT, async || {
        journal(&r.setup.dir.path("journal.jsonl"))
            .iter()
            .any(|l| l.login == "f2" && l.action == "close")
            .then_some(())
    })
    .await;
    // The next re-read is asked only once this one is over.
    eventually("the next re-read", WAIT, async || {
        r.reads("orders")
            .iter()
            .any(|l| us(l) > asked)
            .then_some(())
    })
    .await;
    let listed: bool = sqlx::query_scalar(
        "SELECT positions @> jsonb_build_array(jsonb_build_object('ticket', $1::bigint))
         FROM master_state WHERE master_id = 1",
    )
    .bind(open)
    .fetch_one(&mut r.setup.conn)
    .await
    .unwrap();
    let lines = r.stop().await;
    let close = lines
        .iter()
        .find(|l| l.login == "m1" && l.action == "close" && l.ticket == Some(open))
        .map(us)
        .expect("the master's close");
    assert!(
        asked < close,
        "precondition: the re-read's positions read was asked before the close"
    );
    assert!(
        !listed,
        "the master's snapshot lists position {open} again after its close"
    );
    assert!(
        !lines
            .iter()
            .filter(|l| l.login == "f2" && l.action == "open")
            .any(|l| us(l) > close),
        "the follower opened a copy after the master's close"
    );
}

/// A master whose every re-read is outrun by a change still has its broker compared: after two
/// re-reads in a row dropped (a trade made while each was read), the next is read inline, and a
/// trade made just after its first read was asked waits for it: in the journal, the follower's
/// copy comes after that re-read's last read (history, asked once its orders and positions were
/// answered). Fails when every re-read runs beside the work whatever was dropped before (the
/// copy then comes within the first read, shown by hand).
#[tokio::test]
async fn a_master_whose_rereads_are_each_outrun_reads_the_next_inline() {
    let r = Rereading::start("master-outrun-rereads").await;
    for _ in 0..2 {
        r.next_read("orders").await;
        r.trade_copied(Side::Buy).await;
    }
    let asked = r.next_read("orders").await;
    let ticket = r.trade_copied(Side::Sell).await;
    let lines = r.stop().await;
    let copy = copied_at(&lines, ticket);
    // The re-read's last read (history), asked once its orders and positions were answered.
    let last = lines
        .iter()
        .filter(|l| l.client == "a" && l.login == "m1" && l.action == "history")
        .map(us)
        .find(|&at| at > asked)
        .expect("the re-read's history read");
    assert!(
        last < copy,
        "the copy ({copy} µs) came before the re-read asked at {asked} µs had read its orders and positions (its history read asked at {last} µs): it was not read inline"
    );
}
