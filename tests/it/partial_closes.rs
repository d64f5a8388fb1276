//! Property (issue 39): a copy's volume follows its master's partial closes by the documented
//! formula, whatever reconciles, takeovers (kill -9) and hand-offs (SIGTERM) come between them
//! and in whatever order, over a bridge follower and a FIX follower at once; repeating any of
//! them changes nothing once a copy matches.
//!
//! The formula (docs/copying.md), computed here in whole hundredths of a lot:
//!   copy opened  = round(lot value x master opened, 0.01)
//!   copy target  = max(0.01, round(copy opened x master now / master opened, 0.01)), at most
//!                  copy opened
//! where `round` takes halves up. Judged from outside facts only: the master's own trades (this
//! test places them), the links this test configured, the simulated broker's positions and
//! journal, and the FIX venue's positions and journal. The broker's fence check and
//! deduplication are off, as on MT4/MT5 servers.
//!
//! Each run draws its cases from a seed it prints; `COPIER_PARTIAL_SEED=<n>` replays one. An odd
//! seed runs the simulated broker (the master's and the bridge follower's) in MT4's ways: every
//! partial close, the master's and the copy's, renumbers the position.

use std::time::Duration;

use copier_node::broker::types::Side;

use crate::support::fix::{FixVenue, VenueAccount};
use crate::support::fixture::CopySetup;
use crate::support::process::NodeProcess;
use crate::support::{LinkSpec, Timing, add_account, add_link, eventually};

const WAIT: Duration = Duration::from_secs(40);

/// Short leases, so takeovers after kill -9 take seconds.
const TIMING: Timing = Timing {
    lease: "3s",
    fence: "1s",
    cycle: "500ms",
};

/// What happens next to the master position or the nodes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    /// The master closes this many hundredths of a lot.
    PartialClose(i64),
    /// Every node runs at least two background reconciles of its followers.
    Reconcile,
    /// kill -9 of a node; a fresh node starts in its place.
    Takeover,
    /// SIGTERM of a node; a fresh node starts in its place.
    Handoff,
}

/// Rounds `num / den` (both positive) to the nearest whole number, halves up.
fn round_half_up(num: i64, den: i64) -> i64 {
    (2 * num + den) / (2 * den)
}

/// One follower's link and what its copy must hold, in hundredths of a lot.
#[derive(Debug, Clone, Copy)]
struct Follower {
    /// The copy's volume when it opened.
    opened: i64,
}

impl Follower {
    fn new(lot_value: i64, master_opened: i64) -> Follower {
        Follower {
            opened: round_half_up(lot_value * master_opened, 100),
        }
    }

    /// The documented trim target for the master's current volume.
    fn target(&self, master_opened: i64, master_now: i64) -> i64 {
        round_half_up(self.opened * master_now, master_opened).clamp(1, self.opened)
    }
}

/// A case: the master's opening volume and the steps.
#[derive(Debug, Clone)]
struct Case {
    master_opened: i64,
    steps: Vec<Step>,
}

/// The links' multipliers a run draws from, in hundredths.
const MULTIPLIERS: [i64; 5] = [50, 100, 150, 200, 30];

fn draw(rng: &mut fastrand::Rng) -> Case {
    let master_opened = rng.i64(60..=300);
    let mut steps = vec![
        Step::PartialClose(0),
        Step::PartialClose(0),
        Step::Takeover,
        Step::Handoff,
        Step::Reconcile,
    ];
    for _ in 0..rng.usize(0..=2) {
        steps.push(
            [
                Step::PartialClose(0),
                Step::Reconcile,
                Step::Takeover,
                Step::Handoff,
            ][rng.usize(0..4)],
        );
    }
    rng.shuffle(&mut steps);
    // Each partial close takes part of what is left, leaving at least 0.01 open.
    let mut left = master_opened;
    for s in &mut steps {
        if let Step::PartialClose(n) = s {
            *n = rng.i64(1..=(left / 2).max(1)).min(left - 1);
            left -= *n;
        }
    }
    steps.retain(|s| *s != Step::PartialClose(0));
    Case {
        master_opened,
        steps,
    }
}

fn lots(hundredths: i64) -> f64 {
    hundredths as f64 / 100.0
}

fn hundredths(lots: f64) -> i64 {
    (lots * 100.0).round() as i64
}

/// The venue's open positions of `login`, in hundredths of a lot.
fn venue_volumes(v: &FixVenue, login: &str) -> Vec<i64> {
    let reply = v.control(&format!("positions {login}"));
    reply
        .strip_prefix("ok")
        .expect("positions answered")
        .split_whitespace()
        .map(|p| hundredths(p.split(':').nth(3).unwrap().parse().unwrap()))
        .collect()
}

struct World {
    s: CopySetup,
    v: FixVenue,
    nodes: Vec<NodeProcess>,
    started: usize,
    rng: fastrand::Rng,
    /// The links' multipliers (bridge follower, FIX follower), in hundredths.
    multipliers: (i64, i64),
}

impl World {
    fn spawn_node(&mut self) {
        self.started += 1;
        let id = format!("pc{}", self.started);
        self.nodes.push(NodeProcess::spawn(
            &self.s.db,
            &id,
            100,
            TIMING,
            &["--reconcile-every", "1s"],
        ));
    }

    /// The master's one open position's ticket now (in MT4's ways, a partial close renumbers it).
    async fn master_ticket(&self) -> i64 {
        let open = self.s.t.positions("m1").await;
        assert_eq!(open.len(), 1, "the master's one position: {open:?}");
        open[0].ticket
    }

    /// The open copies' volumes: (bridge follower, FIX follower).
    async fn copies(&self) -> (Vec<i64>, Vec<i64>) {
        let bridge = self
            .s
            .t
            .positions("b2")
            .await
            .iter()
            .map(|p| hundredths(p.volume))
            .collect();
        (bridge, venue_volumes(&self.v, "f3"))
    }

    /// Waits until each follower holds exactly one copy of the wanted volume.
    async fn converged(&self, what: &str, bridge: i64, fix: i64) {
        eventually(
            format!(
                "{what}: copies of {} (bridge) and {} (FIX)",
                lots(bridge),
                lots(fix)
            ),
            WAIT,
            async || {
                let (b, f) = self.copies().await;
                (b == [bridge] && f == [fix]).then_some(())
            },
        )
        .await;
    }

    /// The node owning account `id`, as its row says.
    async fn owner(&mut self, id: i64) -> Option<String> {
        sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = $1")
            .bind(id)
            .fetch_one(&mut self.s.conn)
            .await
            .unwrap()
    }

    /// Waits until every node owning a follower has run at least `n` more reconciles.
    async fn reconciled(&mut self, n: f64) {
        let owners = [self.owner(2).await, self.owner(3).await];
        let mut before = Vec::new();
        for node in self
            .nodes
            .iter()
            .filter(|node| owners.contains(&Some(node.node_id.clone())))
        {
            before.push((node, self.reconciles(node).await));
        }
        for (node, b) in before {
            eventually(format!("{} reconciling", node.node_id), WAIT, async || {
                (self.reconciles(node).await >= b + n).then_some(())
            })
            .await;
        }
    }

    async fn reconciles(&self, node: &NodeProcess) -> f64 {
        eventually(format!("{}'s /metrics", node.node_id), WAIT, async || {
            node.metric("copier_reconciles_total").await
        })
        .await
    }

    /// Accounts 1-3 owned by live nodes, as the rows say.
    async fn all_owned(&mut self) {
        let live: Vec<String> = self.nodes.iter().map(|n| n.node_id.clone()).collect();
        eventually("every account owned by a live node", WAIT, async || {
            let owners: Vec<Option<String>> = sqlx::query_scalar(
                "SELECT node_id FROM trading_accounts WHERE id IN (1, 2, 3) ORDER BY id",
            )
            .fetch_all(&mut self.s.conn)
            .await
            .ok()?;
            owners
                .iter()
                .all(|o| o.as_ref().is_some_and(|o| live.contains(o)))
                .then_some(())
        })
        .await;
    }

    /// Logins accepted for `login` in a journal so far.
    fn logins(lines: &[copier_node::sim_broker::journal::JournalEntry], login: &str) -> usize {
        lines
            .iter()
            .filter(|l| l.login == login && l.action == "login" && l.accepted)
            .count()
    }

    fn bridge_journal(&self) -> Vec<copier_node::sim_broker::journal::JournalEntry> {
        crate::support::broker::journal(&self.s.dir.path("journal.jsonl"))
    }

    fn venue_journal(&self) -> Vec<copier_node::sim_broker::journal::JournalEntry> {
        crate::support::broker::journal(&self.v.journal)
    }

    /// Accepted closes (trims and closes) of `login`'s copies in a journal.
    fn closes(lines: &[copier_node::sim_broker::journal::JournalEntry], login: &str) -> usize {
        lines
            .iter()
            .filter(|l| l.login == login && l.action == "close" && l.accepted)
            .count()
    }
}

async fn run_case(w: &mut World, case: &Case) {
    let bridge = Follower::new(w.multipliers.0, case.master_opened);
    let fix = Follower::new(w.multipliers.1, case.master_opened);
    w.s.t
        .open(
            "m1",
            "EURUSD",
            Side::Buy,
            lots(case.master_opened),
            None,
            None,
        )
        .await;
    w.converged("opened", bridge.opened, fix.opened).await;
    let bridge_closes = World::closes(&w.bridge_journal(), "b2");
    let fix_closes = World::closes(&w.venue_journal(), "f3");
    let mut trims = (0, 0);
    let mut master_now = case.master_opened;
    let mut want = (bridge.opened, fix.opened);
    for step in &case.steps {
        match *step {
            Step::PartialClose(n) => {
                let ticket = w.master_ticket().await;
                w.s.t.close("m1", ticket, Some(lots(n))).await;
                master_now -= n;
                let next = (
                    bridge.target(case.master_opened, master_now),
                    fix.target(case.master_opened, master_now),
                );
                trims.0 += usize::from(next.0 != want.0);
                trims.1 += usize::from(next.1 != want.1);
                want = next;
            }
            Step::Reconcile => w.reconciled(2.0).await,
            Step::Takeover | Step::Handoff => {
                // The owner of one follower goes; the sessions it held start again elsewhere,
                // as the brokers' journals show by their logins.
                let account = 2 + i64::from(w.rng.bool());
                let owner = w.owner(account).await.expect("owned");
                let moved = (
                    w.owner(2).await.as_ref() == Some(&owner),
                    w.owner(3).await.as_ref() == Some(&owner),
                );
                let logins = (
                    World::logins(&w.bridge_journal(), "b2"),
                    World::logins(&w.venue_journal(), "f3"),
                );
                let victim = w.nodes.iter().position(|n| n.node_id == owner).unwrap();
                let mut node = w.nodes.remove(victim);
                if *step == Step::Takeover {
                    node.kill9();
                } else {
                    node.signal("TERM");
                    node.wait_exit(WAIT).await;
                }
                w.spawn_node();
                w.all_owned().await;
                // Every session the victim held started again elsewhere; others did not move.
                eventually("the moved sessions logged in again", WAIT, async || {
                    let now = (
                        World::logins(&w.bridge_journal(), "b2"),
                        World::logins(&w.venue_journal(), "f3"),
                    );
                    (now.0 >= logins.0 + usize::from(moved.0)
                        && now.1 >= logins.1 + usize::from(moved.1))
                    .then_some(())
                })
                .await;
                w.reconciled(1.0).await;
            }
        }
        w.converged(&format!("after {step:?}"), want.0, want.1)
            .await;
    }
    // Once matched, more reconciles change nothing: no trim beyond those the formula asks for.
    w.reconciled(2.0).await;
    w.converged("after the last reconciles", want.0, want.1)
        .await;
    assert_eq!(
        (
            World::closes(&w.bridge_journal(), "b2") - bridge_closes,
            World::closes(&w.venue_journal(), "f3") - fix_closes,
        ),
        trims,
        "one trim per change of the target, no more: {case:?}"
    );
    let ticket = w.master_ticket().await;
    w.s.t.close("m1", ticket, None).await;
    eventually("the copies closed", WAIT, async || {
        let (b, f) = w.copies().await;
        (b.is_empty() && f.is_empty()).then_some(())
    })
    .await;
}

#[tokio::test]
async fn trims_follow_the_master_through_reconciles_takeovers_and_handoffs_on_bridge_and_fix() {
    let seed = std::env::var("COPIER_PARTIAL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    eprintln!("COPIER_PARTIAL_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let multipliers = (
        MULTIPLIERS[rng.usize(0..MULTIPLIERS.len())],
        MULTIPLIERS[rng.usize(0..MULTIPLIERS.len())],
    );
    // The venue answers positions requests with RequestForPositionsAck, or (as cTrader does)
    // with the reports alone: a rebuild must read the same positions either way.
    let without_ack = fastrand::Rng::with_seed(seed ^ 0xa0).bool(); // apart: old seeds replay
    // The simulated broker (master and bridge follower) keeps its tickets, or renumbers a
    // partially closed position as MT4 does (`--mt4`).
    let mt4 = seed % 2 == 1;
    let s = CopySetup::with("partial-closes", |o| {
        o.fence_check = false;
        o.dedupe = false;
        o.mt4 = mt4;
    })
    .await;
    let v = FixVenue::start(
        &s.dir.0,
        &[VenueAccount {
            login: "f3",
            password: "",
        }],
    );
    if without_ack {
        assert_eq!(v.control("fault no_ao on"), "ok");
    }
    let mut w = World {
        s,
        v,
        nodes: Vec::new(),
        started: 0,
        rng,
        multipliers,
    };
    let fix = format!(
        "fix://127.0.0.1:{}?target={}&heartbeat=1",
        w.v.port, w.v.comp_id
    );
    add_account(&mut w.s.conn, 1, "master", &w.s.addr, "m1").await;
    add_account(&mut w.s.conn, 2, "follower", &w.s.addr, "b2").await;
    add_account(&mut w.s.conn, 3, "follower", &fix, "f3").await;
    for (id, value) in [(2, multipliers.0), (3, multipliers.1)] {
        let spec = LinkSpec {
            lot_value: lots(value),
            ..LinkSpec::default()
        };
        add_link(&mut w.s.conn, 1, id, spec).await;
    }
    w.spawn_node();
    w.spawn_node();
    w.all_owned().await;
    eprintln!(
        "multipliers (bridge, FIX): {multipliers:?}; positions without an ack: {without_ack}; MT4's ways: {mt4}"
    );
    for n in 0..3 {
        let case = draw(&mut w.rng);
        eprintln!("case {n}: {case:?}");
        run_case(&mut w, &case).await;
    }
}

#[test]
fn the_formula_rounds_halves_up_and_keeps_within_the_opening_volume() {
    let f = Follower::new(50, 125); // 0.625 rounds to 0.63
    assert_eq!(f.opened, 63);
    assert_eq!(f.target(125, 50), 25); // 0.63 x 0.5 / 1.25 = 0.252
    assert_eq!(f.target(125, 1), 1, "never below the minimum while open");
    assert_eq!(f.target(125, 125), 63, "never above the opening volume");
    assert_eq!(Follower::new(100, 40).target(40, 10), 10);
}
