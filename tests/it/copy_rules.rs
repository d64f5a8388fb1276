//! The copy rules as a property: random links and random master histories, copied by a real node
//! (its follower sessions' event path and reconcile, as they run in production) onto the simulated
//! broker with its fence check and deduplication off, judged by a reference model written here
//! from the documented rules (docs/copying.md: lot modes, rounding, the minimum, partial closes,
//! sides and stops). The model takes nothing from the product: the master's history is what this
//! test traded by hand, the links are what it configured, and the followers' state is read from
//! the broker. No function of the copy rules (`plan`, `plan_ticket`, `rules`) is called.
//!
//! The followers must settle on the reference at random points of the history (the trades after
//! one meet live copies) and at its end. Besides that, no copy may have been closed entirely
//! before its master position (the broker's history of both accounts), and the journal must show
//! one accepted open per follower and master position.
//!
//! Each case starts the node after a random number of the master's trades: those are met by the
//! followers' first reconcile, the rest by the event path. A case's seed is printed; one replays
//! with `COPIER_RULES_SEED=<seed>`.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use copier_node::broker::types::{Position, Side};

use crate::suite::oracle::{Account, Expect, closed_while_master_open};
use crate::support::broker::journal;
use crate::support::fixture::CopySetup;
use crate::support::{FAST, LinkSpec, add_account, add_link, config, start_node, wait_state};

const WAIT: Duration = Duration::from_secs(30);
const FOLLOWERS: i64 = 4;
const STEP: f64 = 0.01;

/// One link as the test configured it.
#[derive(Debug, Clone, Copy)]
struct Rule {
    fixed: bool,
    lot_value: f64,
    reverse: bool,
    copy_sl_tp: bool,
}

impl Rule {
    fn draw(rng: &mut fastrand::Rng) -> Rule {
        let fixed = rng.u32(..3) == 0;
        let lot_value = if fixed {
            [0.01, 0.05, 0.1, 1.0][rng.usize(..4)]
        } else {
            // 0.001 sizes every copy below the minimum: nothing is copied.
            [0.5, 1.0, 2.0, 0.333, 1.5, 0.001][rng.usize(..6)]
        };
        Rule {
            fixed,
            lot_value,
            reverse: rng.bool(),
            copy_sl_tp: rng.bool(),
        }
    }

    fn spec(&self) -> LinkSpec {
        LinkSpec {
            lot_mode: if self.fixed { "fixed" } else { "multiplier" },
            lot_value: self.lot_value,
            reverse: self.reverse,
            copy_sl_tp: self.copy_sl_tp,
            ..Default::default()
        }
    }
}

/// A master position as this test traded it.
#[derive(Debug, Clone)]
struct Traded {
    symbol: &'static str,
    side: Side,
    /// Its volume after its open and after each partial close.
    volumes: Vec<f64>,
    /// The first of `volumes` a copy can have been sized for: the volume it had when the node
    /// started (a copy is made from what the master holds when the follower decides; a follower
    /// that decides late sizes on what is left then, docs/copying.md "Partial closes").
    sized_from: usize,
    sl: Option<f64>,
    tp: Option<f64>,
    open: bool,
}

impl Traded {
    fn volume(&self) -> f64 {
        *self.volumes.last().unwrap()
    }
}

/// The multiples of the step nearest to `v`: one, or both at a tie (the product rounds halves
/// up, but a float product like 0.7 x 0.5 may land either side of the half).
fn nearest_steps(v: f64) -> Vec<f64> {
    let steps = v / STEP;
    let (lo, hi) = (steps.floor(), steps.ceil());
    let tie = (steps - lo - 0.5).abs() < 1e-6;
    if tie {
        vec![lo * STEP, hi * STEP]
    } else {
        vec![steps.round() * STEP]
    }
}

/// What a follower may hold of one master position under `rule`.
#[derive(Debug)]
struct Expected {
    symbol: &'static str,
    side: Side,
    /// The volumes the copy may hold (one per volume it may have been sized for, both at a tie).
    volumes: Vec<f64>,
    sl: Option<f64>,
    tp: Option<f64>,
    /// No copy is also right (sized for one volume it rounds below the minimum, for another not).
    or_none: bool,
}

/// The reference: what the follower should hold of `m`, `None` when no copy may be open.
fn expected(rule: &Rule, m: &Traded) -> Option<Expected> {
    if !m.open {
        return None;
    }
    let mut volumes = Vec::new();
    let mut or_none = false;
    for base in &m.volumes[m.sized_from..] {
        // The copy's size when it opened: the lot mode, rounded to the nearest step; below the
        // minimum (one step) it is skipped.
        let raw = if rule.fixed {
            rule.lot_value
        } else {
            base * rule.lot_value
        };
        let opened: Vec<f64> = nearest_steps(raw)
            .into_iter()
            .filter(|v| *v >= STEP - 1e-9)
            .collect();
        or_none |= opened.is_empty();
        // Partial closes: the same proportion of what the copy opened with, to the nearest step,
        // never below the minimum and never above what it opened with.
        for o in opened {
            for v in nearest_steps(o * m.volume() / base) {
                volumes.push(v.clamp(STEP, o));
            }
        }
    }
    if volumes.is_empty() {
        return None;
    }
    let side = match (rule.reverse, m.side) {
        (false, side) => side,
        (true, Side::Buy) => Side::Sell,
        (true, Side::Sell) => Side::Buy,
    };
    let (sl, tp) = match (rule.copy_sl_tp, rule.reverse) {
        (false, _) => (None, None),
        (true, false) => (m.sl, m.tp),
        (true, true) => (m.tp, m.sl),
    };
    Some(Expected {
        symbol: m.symbol,
        side,
        volumes,
        sl,
        tp,
        or_none,
    })
}

fn same(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => (a - b).abs() < 1e-9,
        _ => false,
    }
}

/// Every difference between what `login` holds (`positions`, its copies under `magic`) and the
/// reference.
fn differences(
    login: &str,
    rule: &Rule,
    magic: i64,
    traded: &BTreeMap<i64, Traded>,
    positions: &[Position],
) -> Vec<String> {
    let mut out = Vec::new();
    let mut copies: HashMap<&str, Vec<&Position>> = HashMap::new();
    for p in positions.iter().filter(|p| p.magic == magic) {
        copies.entry(p.comment.as_str()).or_default().push(p);
    }
    for (ticket, m) in traded {
        let marker = format!("mc{ticket}");
        let held = copies.remove(marker.as_str()).unwrap_or_default();
        match (expected(rule, m), held.as_slice()) {
            (None, []) => {}
            (None, held) => out.push(format!(
                "{login}: {} copies of {ticket}, none expected",
                held.len()
            )),
            (Some(e), []) if e.or_none => {}
            (Some(_), []) => out.push(format!("{login}: no copy of {ticket}")),
            (Some(e), [c]) => {
                let volume_ok = e.volumes.iter().any(|v| (c.volume - v).abs() < 1e-6);
                if c.symbol != e.symbol
                    || c.side != e.side
                    || !volume_ok
                    || !same(c.sl, e.sl)
                    || !same(c.tp, e.tp)
                {
                    out.push(format!(
                        "{login}: copy of {ticket} is {} {:?} {} sl {:?} tp {:?}; expected {e:?}",
                        c.symbol, c.side, c.volume, c.sl, c.tp
                    ));
                }
            }
            (Some(_), held) => out.push(format!("{login}: {} copies of {ticket}", held.len())),
        }
    }
    for (comment, held) in copies {
        out.push(format!(
            "{login}: {} positions {comment:?} copy no traded position",
            held.len()
        ));
    }
    out
}

/// The stops a position of `symbol` and `side` may carry, one of two sets.
fn stops(symbol: &str, side: Side, second: bool) -> (f64, f64) {
    let price = if symbol == "EURUSD" { 1.10 } else { 1.27 };
    let d = if second { 0.02 } else { 0.01 };
    match side {
        Side::Buy => (price - d, price + d),
        Side::Sell => (price + d, price - d),
    }
}

async fn trade(
    rng: &mut fastrand::Rng,
    s: &CopySetup,
    traded: &mut BTreeMap<i64, Traded>,
) -> String {
    let open: Vec<i64> = traded
        .iter()
        .filter(|(_, m)| m.open)
        .map(|(t, _)| *t)
        .collect();
    let roll = if open.is_empty() { 0 } else { rng.u32(..10) };
    match roll {
        0..=2 => {
            let symbol = if rng.bool() { "EURUSD" } else { "GBPUSD" };
            let side = if rng.bool() { Side::Buy } else { Side::Sell };
            let volume = [0.01, 0.05, 0.1, 0.25, 0.5, 0.7, 1.0, 2.0][rng.usize(..8)];
            let (sl, tp) = if rng.bool() {
                let (sl, tp) = stops(symbol, side, false);
                (Some(sl), Some(tp))
            } else {
                (None, None)
            };
            let ticket = s.t.open("m1", symbol, side, volume, sl, tp).await;
            traded.insert(
                ticket,
                Traded {
                    symbol,
                    side,
                    volumes: vec![volume],
                    sized_from: 0,
                    sl,
                    tp,
                    open: true,
                },
            );
            format!("open {ticket} {symbol} {side:?} {volume} sl {sl:?} tp {tp:?}")
        }
        3..=6 => {
            let ticket = open[rng.usize(..open.len())];
            let m = traded.get_mut(&ticket).unwrap();
            let steps = (m.volume() / STEP).round() as u32;
            if steps < 2 {
                s.t.close("m1", ticket, None).await;
                m.open = false;
                return format!("close {ticket}");
            }
            // Often all but the last step: what is left scales copies down to their minimum.
            let part = if rng.u32(..3) == 0 {
                steps - 1
            } else {
                rng.u32(1..steps)
            };
            let part = f64::from(part) * STEP;
            s.t.close("m1", ticket, Some(part)).await;
            let left = ((m.volume() - part) / STEP).round() * STEP;
            m.volumes.push(left);
            format!("close {part} of {ticket}, {left} left")
        }
        7 => {
            let ticket = open[rng.usize(..open.len())];
            let m = traded.get_mut(&ticket).unwrap();
            let (sl, tp) = stops(m.symbol, m.side, rng.bool());
            s.t.modify("m1", ticket, Some(sl), Some(tp)).await;
            (m.sl, m.tp) = (Some(sl), Some(tp));
            format!("stops of {ticket}: sl {sl} tp {tp}")
        }
        _ => {
            let ticket = open[rng.usize(..open.len())];
            s.t.close("m1", ticket, None).await;
            traded.get_mut(&ticket).unwrap().open = false;
            format!("close {ticket}")
        }
    }
}

/// One random case; returns how many copies the followers held at its settle points, all as the
/// reference says.
async fn case(seed: u64) -> usize {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut s = CopySetup::unprotected("copy-rules").await;
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    let mut links = Vec::new();
    for f in 2..2 + FOLLOWERS {
        let mut rule = Rule::draw(&mut rng);
        // Every case also has a small fixed lot (its trims meet the minimum) and a reversed
        // link copying stops (they swap).
        match f {
            3 => (rule.fixed, rule.lot_value) = (true, 0.01),
            4 => (rule.reverse, rule.copy_sl_tp) = (true, true),
            _ => {}
        }
        add_account(&mut s.conn, f, "follower", &s.addr, &format!("f{f}")).await;
        let (_, magic) = add_link(&mut s.conn, 1, f, rule.spec()).await;
        links.push((format!("f{f}"), rule, magic));
    }
    let trades = rng.usize(6..=14);
    // Mostly early: the partial closes that follow meet copies already made.
    let before_node = rng.usize(0..=trades / 3);
    let mut traded: BTreeMap<i64, Traded> = BTreeMap::new();
    let mut history = vec![format!("links: {links:?}")];
    let mut node = None;
    let mut held = 0;
    for i in 0..=trades {
        if i == before_node {
            history.push("node starts".into());
            for m in traded.values_mut() {
                m.sized_from = m.volumes.len() - 1;
            }
            node = Some(start(&s).await);
        }
        // Now and then, and at the end, the followers must settle on the reference: the trades
        // after a settle meet copies already made (trims, stop changes, closes of live copies).
        if node.is_some() && (i == trades || rng.u32(..3) == 0) {
            history.push("settle".into());
            held += settle(seed, &s, &links, &traded, &history).await;
        }
        if i < trades {
            history.push(trade(&mut rng, &s, &mut traded).await);
        }
    }
    let node = node.expect("started at or before the last trade");
    // Never below the minimum while the master position is open: no copy was closed entirely
    // before its master position, by the broker's record of both accounts.
    let account = async |login: &str| {
        let (open, history) = s.t.record(login).await;
        Account { open, history }
    };
    let master = account("m1").await;
    for (login, rule, magic) in &links {
        let link = Expect {
            follower: login.clone(),
            magic: *magic,
            lot_value: rule.lot_value,
            reverse: rule.reverse,
        };
        let early = closed_while_master_open(&link, &master, &account(login).await);
        assert!(
            early.is_empty(),
            "seed {seed}: {early:?}\nhistory:\n  {}",
            history.join("\n  ")
        );
    }
    // S2, from the journal: one accepted open per follower and master position, ever.
    let mut opens: HashMap<(String, String), u32> = HashMap::new();
    for l in journal(&s.dir.path("journal.jsonl"))
        .into_iter()
        .filter(|l| l.accepted && l.action == "open" && l.client != "manual")
    {
        *opens
            .entry((l.login, l.comment.unwrap_or_default()))
            .or_default() += 1;
    }
    let twice: Vec<_> = opens.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "seed {seed}: copied twice: {twice:?}\nhistory:\n  {}",
        history.join("\n  ")
    );
    node.shutdown();
    node.wait().await.unwrap();
    s.broker.stop().await;
    held
}

/// Waits until the followers hold what the reference says, or fails naming every difference;
/// returns how many copies they hold.
async fn settle(
    seed: u64,
    s: &CopySetup,
    links: &[(String, Rule, i64)],
    traded: &BTreeMap<i64, Traded>,
    history: &[String],
) -> usize {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut held = 0;
        let mut diffs = Vec::new();
        for (login, rule, magic) in links {
            let positions = s.t.positions(login).await;
            held += positions.iter().filter(|p| p.magic == *magic).count();
            diffs.extend(differences(login, rule, *magic, traded, &positions));
        }
        if diffs.is_empty() {
            return held;
        }
        if tokio::time::Instant::now() >= deadline {
            // What the broker saw, to tell a decision not made from an order refused.
            let lines: Vec<String> = journal(&s.dir.path("journal.jsonl"))
                .into_iter()
                .filter(|l| l.action != "login")
                .map(|l| {
                    format!(
                        "{} {} {} {:?} {:?} {:?} {} {:?}",
                        l.client,
                        l.login,
                        l.action,
                        l.ticket,
                        l.volume,
                        l.comment,
                        l.accepted,
                        l.reason
                    )
                })
                .collect();
            panic!(
                "seed {seed} (replay: COPIER_RULES_SEED={seed}): the followers did not settle on the reference in {WAIT:?}:\n  {}\nhistory:\n  {}\njournal:\n  {}",
                diffs.join("\n  "),
                history.join("\n  "),
                lines.join("\n  ")
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn start(s: &CopySetup) -> copier_node::app::NodeHandle {
    let node = start_node(&config(&s.db, "a", 100, FAST)).await;
    wait_state(&node.state, "the node owns every account", WAIT, |st| {
        st.owned.len() == 1 + FOLLOWERS as usize
    })
    .await;
    node
}

/// Random links and master histories (opens with and without stops, partial closes, stop
/// changes, closes), met by reconcile and by events, leave every follower holding what the
/// reference model says, with nothing copied twice.
#[tokio::test]
async fn random_links_and_master_histories_copy_as_the_documented_rules_say() {
    let replay = std::env::var("COPIER_RULES_SEED").ok();
    let seeds: Vec<u64> = match &replay {
        Some(s) => vec![s.parse().expect("COPIER_RULES_SEED is a number")],
        None => (0..8).map(|_| fastrand::u64(..)).collect(),
    };
    let mut held = 0;
    for seed in seeds {
        eprintln!("copy rules, seed {seed} (replay: COPIER_RULES_SEED={seed})");
        held += case(seed).await;
    }
    eprintln!("{held} copies checked against the reference");
    // Eight cases leave copies to check; one replayed case may end with none held.
    assert!(held > 0 || replay.is_some(), "no case left a copy to check");
}
