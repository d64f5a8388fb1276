//! MT4's ticket lineage (issue 44), against the simulated broker's MT4 mode (`--mt4`): a partial
//! close gives the remainder a new ticket (`from #<old>`, the magic kept) and a stop close
//! rewrites the history's comment (`[sl]`), as a naive bridge passes them on. The follower is on
//! an MT4 server and the master on one that keeps its tickets, so what is tested is the node
//! following its copies' lineage. Both servers check no fence and deduplicate nothing; judged
//! from the follower server's positions and journal.

use std::time::Duration;

use copier_node::broker::types::{Position, Side};
use copier_node::sim_broker::server::{ServeOptions, SimBroker};
use copier_node::sim_broker::tools;

use crate::support::broker::journal;
use crate::support::fixture::CopySetup;
use crate::support::process::NodeProcess;
use crate::support::{FAST, LinkSpec, Trader, add_account, add_link, eventually};

const WAIT: Duration = Duration::from_secs(30);

fn lots_close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

async fn owner(conn: &mut sqlx::PgConnection, id: i64) -> Option<String> {
    sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// kill -9 of the node owning account `id`; returns once another node owns it.
async fn kill_owner(conn: &mut sqlx::PgConnection, nodes: &mut [NodeProcess], id: i64) {
    let victim = owner(conn, id).await.expect("owned");
    let idx = nodes.iter().position(|n| n.node_id == victim).unwrap();
    nodes[idx].kill9();
    eventually(format!("account {id} owned again"), WAIT, async || {
        owner(conn, id).await.filter(|o| *o != victim).map(|_| ())
    })
    .await;
}

/// A second simulated broker, in MT4's ways, checking no fence and deduplicating nothing, with
/// its journal in the test's scratch directory.
async fn mt4_broker(s: &CopySetup) -> (SimBroker, std::path::PathBuf) {
    let journal = s.dir.path("mt4-journal.jsonl");
    let broker = SimBroker::start(ServeOptions {
        fence_check: false,
        dedupe: false,
        mt4: true,
        ..ServeOptions::new("127.0.0.1:0", journal.clone())
    })
    .await
    .unwrap();
    (broker, journal)
}

#[tokio::test]
async fn an_mt4_copy_is_followed_through_renumbering_partial_closes_and_takeovers() {
    let mut s = CopySetup::unprotected("mt4-lineage").await;
    let (mt4, mt4_journal) = mt4_broker(&s).await;
    let mt4_addr = mt4.addr.to_string();
    let follower = Trader {
        addr: mt4_addr.clone(),
    };
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 2, "follower", &mt4_addr, "f2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let mut nodes: Vec<NodeProcess> = ["ma", "mb"]
        .iter()
        .map(|id| NodeProcess::spawn(&s.db, id, 100, FAST, &[]))
        .collect();
    let holding =
        async |what: &str, want: &dyn Fn(&[copier_node::broker::types::Position]) -> bool| {
            eventually(format!("f2: {what}"), WAIT, async || {
                let p = follower.positions("f2").await;
                want(&p).then_some(p)
            })
            .await
        };
    let copy_of = |volume: f64| {
        move |p: &[copier_node::broker::types::Position]| {
            p.len() == 1 && p[0].magic == magic && lots_close(p[0].volume, volume)
        }
    };

    // Copied, then the master closes part: the copy's trim renumbers it.
    let ticket = s.t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;
    let first = holding("the copy", &copy_of(1.0)).await;
    s.t.close("m1", ticket, Some(0.4)).await;
    let trimmed = holding("the copy trimmed to 0.6 under a new ticket", &copy_of(0.6)).await;
    assert_ne!(
        trimmed[0].ticket, first[0].ticket,
        "MT4 renumbers the remainder"
    );
    assert_eq!(trimmed[0].comment, format!("from #{}", first[0].ticket));

    // kill -9 of the follower's owner: the new owner knows the remainder by its lineage.
    kill_owner(&mut s.conn, &mut nodes, 2).await;
    s.t.close("m1", ticket, Some(0.3)).await;
    holding("the remainder trimmed to 0.3", &copy_of(0.3)).await;

    // A copy closed by its stop on the follower (the history's comment becomes `[sl]`): never
    // copied again, after another takeover too.
    let stopped =
        s.t.open("m1", "GBPUSD", Side::Buy, 0.2, Some(1.26), None)
            .await;
    holding("two copies", &|p| p.len() == 2).await;
    tools::set_price(&mt4_addr, "GBPUSD", 1.255).await.unwrap();
    holding("the stopped copy gone", &copy_of(0.3)).await;
    let history = tools::history(&mt4_addr, "f2").await.unwrap();
    assert!(
        history.iter().any(|h| h.position.comment == "[sl]"),
        "{history:?}"
    );
    nodes.push(NodeProcess::spawn(&s.db, "mc", 100, FAST, &[]));
    kill_owner(&mut s.conn, &mut nodes, 2).await;

    // The master closes both: the remainder is closed, nothing is left or reopened.
    s.t.close("m1", ticket, None).await;
    s.t.close("m1", stopped, None).await;
    holding("no copy", &|p| p.is_empty()).await;
    let lines = journal(&mt4_journal);
    let accepted = |action: &str| {
        lines
            .iter()
            .filter(|l| l.login == "f2" && l.action == action && l.accepted && l.client != "manual")
            .count()
    };
    assert_eq!(
        accepted("open"),
        2,
        "one open per master position: {lines:#?}"
    );
    // Two trims and the remainder's close: no copy closed as an orphan.
    assert_eq!(accepted("close"), 3, "{lines:#?}");
}

/// The master on an MT4 server: its partial close renumbers the position (`to #`, `from #`), and
/// its followers see a partial close: the copy is trimmed, never closed and opened again, also
/// when the master's owner is killed between two partial closes (the new owner follows the
/// renumbering from the stored snapshot). Judged from the follower's server (one that keeps its
/// tickets): its journal and positions.
#[tokio::test]
async fn an_mt4_masters_partial_closes_trim_its_copies_through_renumbering_and_a_takeover() {
    let mut s = CopySetup::unprotected("mt4-master").await;
    let (mt4, _) = mt4_broker(&s).await;
    let mt4_addr = mt4.addr.to_string();
    let master = Trader {
        addr: mt4_addr.clone(),
    };
    add_account(&mut s.conn, 1, "master", &mt4_addr, "m1").await;
    add_account(&mut s.conn, 2, "follower", &s.addr, "f2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let mut nodes: Vec<NodeProcess> = ["na", "nb"]
        .iter()
        .map(|id| NodeProcess::spawn(&s.db, id, 100, FAST, &[]))
        .collect();
    let copy_at = async |s: &CopySetup, what: &str, volume: f64| {
        eventually(format!("f2: {what}"), WAIT, async || {
            let p = s.t.positions("f2").await;
            (p.len() == 1 && p[0].magic == magic && lots_close(p[0].volume, volume))
                .then(|| p[0].clone())
        })
        .await
    };
    let master_rest = async |from: i64| {
        let p = master.positions("m1").await;
        assert_eq!(p.len(), 1, "{p:?}");
        assert_ne!(p[0].ticket, from, "MT4 renumbers the rest");
        assert_eq!(p[0].comment, format!("from #{from}"));
        p[0].ticket
    };

    let ticket = master
        .open("m1", "EURUSD", Side::Buy, 1.0, None, None)
        .await;
    let copy = copy_at(&s, "the copy", 1.0).await;
    master.close("m1", ticket, Some(0.4)).await;
    let trimmed = copy_at(&s, "the copy trimmed to 0.6", 0.6).await;
    assert_eq!(trimmed.ticket, copy.ticket, "the same copy, trimmed");
    let rest = master_rest(ticket).await;
    // `why`, asked with the broker's ticket now, answers for the position under its first one.
    let (code, out, err) = crate::support::process::run_to_end(
        &["why", "2", &rest.to_string(), "--json"],
        &[("DATABASE_URL", s.db.url.as_str())],
    );
    assert_eq!(code, 0, "{err}");
    let why: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(why[0]["master_ticket"], ticket, "{out}");
    assert!(
        why[0]["verdict"]
            .as_str()
            .is_some_and(|v| v.starts_with(&format!("copied as ticket {}", copy.ticket))),
        "{out}"
    );

    // kill -9 of the master's owner: the new owner knows 0.6 under `rest` is the position.
    kill_owner(&mut s.conn, &mut nodes, 1).await;
    master.close("m1", rest, Some(0.3)).await;
    copy_at(&s, "the copy trimmed to 0.3", 0.3).await;
    let last = master_rest(rest).await;
    master.close("m1", last, None).await;
    eventually("f2: the copy closed", WAIT, async || {
        s.t.positions("f2").await.is_empty().then_some(())
    })
    .await;

    let lines = journal(&s.dir.path("journal.jsonl"));
    let accepted: Vec<(String, Option<f64>)> = lines
        .iter()
        .filter(|l| l.login == "f2" && l.accepted && l.client != "manual")
        .filter(|l| l.action == "open" || l.action == "close")
        .map(|l| (l.action.clone(), l.volume))
        .collect();
    let actions: Vec<&str> = accepted.iter().map(|(a, _)| a.as_str()).collect();
    assert_eq!(
        actions,
        ["open", "close", "close", "close"],
        "one open, two trims and the close: {accepted:?}"
    );
    assert_eq!(
        (accepted[1].1, accepted[2].1),
        (Some(0.4), Some(0.3)),
        "the trims"
    );
}

/// R2 on an MT4 server (the follower on it, the master on one that keeps its tickets, neither
/// checking fences or deduplicating): a
/// copy the trim renumbered (its remainder `from #N`, without the marker) that the follower then
/// closes by hand, and another whose remainder its stop loss closes (the history says `[sl]`,
/// the lineage gone from it), are never opened again, while their master positions stay open
/// and trim again, across a takeover of the follower. Judged from the server's journal.
#[tokio::test]
async fn renumbered_copies_closed_by_hand_or_by_their_stop_are_never_opened_again() {
    let mut s = CopySetup::unprotected("mt4-r2").await;
    let (mt4, journal_path) = mt4_broker(&s).await;
    let addr = mt4.addr.to_string();
    let t = Trader { addr: addr.clone() };
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 2, "follower", &addr, "f2").await;
    let (_, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    let mut nodes: Vec<NodeProcess> = ["ra", "rb"]
        .iter()
        .map(|id| NodeProcess::spawn(&s.db, id, 100, FAST, &[]))
        .collect();
    let copies = async |what: &str, want: &dyn Fn(&[Position]) -> bool| {
        eventually(format!("f2: {what}"), WAIT, async || {
            let p: Vec<Position> = t
                .positions("f2")
                .await
                .into_iter()
                .filter(|p| p.magic == magic)
                .collect();
            want(&p).then_some(p)
        })
        .await
    };
    let of = |symbol: &'static str, volume: f64| {
        move |p: &Position| p.symbol == symbol && lots_close(p.volume, volume)
    };

    // Two master positions, each copied, then trimmed: both copies renumbered.
    let eur = s.t.open("m1", "EURUSD", Side::Buy, 1.0, None, None).await;
    let gbp =
        s.t.open("m1", "GBPUSD", Side::Buy, 0.4, Some(1.26), None)
            .await;
    copies("two copies", &|p| p.len() == 2).await;
    s.t.close("m1", eur, Some(0.4)).await;
    s.t.close("m1", gbp, Some(0.2)).await;
    let trimmed = copies("both trimmed", &|p| {
        p.len() == 2 && p.iter().any(of("EURUSD", 0.6)) && p.iter().any(of("GBPUSD", 0.2))
    })
    .await;
    assert!(
        trimmed.iter().all(|p| p.comment.starts_with("from #")),
        "MT4 renumbered both: {trimmed:?}"
    );
    // The follower closes one by hand; the other's stop loss closes it.
    let eur_rest = trimmed.iter().find(|p| p.symbol == "EURUSD").unwrap();
    t.close("f2", eur_rest.ticket, None).await;
    tools::set_price(&addr, "GBPUSD", 1.255).await.unwrap();
    copies("both copies gone", &|p| p.is_empty()).await;
    let history = tools::history(&addr, "f2").await.unwrap();
    assert!(
        history.iter().any(|h| h.position.comment == "[sl]"),
        "{history:?}"
    );

    // A takeover of the follower; the masters trim again: nothing is opened again.
    kill_owner(&mut s.conn, &mut nodes, 2).await;
    let masters = s.t.positions("m1").await;
    for p in &masters {
        s.t.close("m1", p.ticket, Some(0.1)).await;
    }
    // The new owner has reconciled (it copies a new master trade), and reopened nothing.
    let usd = s.t.open("m1", "USDJPY", Side::Sell, 0.1, None, None).await;
    copies("the new trade's copy", &|p| {
        p.len() == 1 && p[0].symbol == "USDJPY"
    })
    .await;
    let opens: Vec<String> = journal(&journal_path)
        .iter()
        .filter(|l| l.login == "f2" && l.action == "open" && l.accepted && l.client != "manual")
        .map(|l| l.comment.clone().unwrap_or_default())
        .collect();
    assert_eq!(
        opens,
        vec![format!("mc{eur}"), format!("mc{gbp}"), format!("mc{usd}")],
        "one open per master position, none again"
    );
}
