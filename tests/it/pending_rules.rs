//! Pending orders as a property: random master histories of pending orders (places of the four
//! kinds, amends, cancels, price moves that fill them, closes of what filled), copied by a real
//! node (its follower sessions' event path and reconcile, as they run in production) onto the
//! simulated broker with its fence check and deduplication off, judged by a reference written
//! here from docs/copying.md "Pending orders": a resting master order has one pending copy of the
//! same kind and price (under `reverse`, the other side and the other kind: both fill on the same
//! move), sized as a position; a filled one has one copy open (its pending copy filled, or the
//! fill copied at market); a cancelled or closed one has none. The master's orders and positions
//! are what this test traded and what the broker's record says filled; the links are what it
//! configured; the followers' state is read from the broker. No decision of the product (`plan`,
//! `plan_key`, `plan_ticket`, the rules) is called.
//!
//! Besides the settle points, the broker's record of each follower (open positions and history)
//! must never show two positions for one master order: a copy of a fill is made once, whichever
//! way. A case's seed is printed; one replays with `COPIER_PENDING_SEED=<seed>`.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use copier_node::broker::types::{PendingKind, Side};
use copier_node::sim_broker::tools::{self, HandOrder};

use crate::support::fixture::CopySetup;
use crate::support::{FAST, LinkSpec, add_account, add_link, config, start_node, wait_state};

const WAIT: Duration = Duration::from_secs(30);
const FOLLOWERS: i64 = 3;
const TICK: f64 = 0.001;
const START: f64 = 1.1;

/// One link as the test configured it.
#[derive(Debug, Clone, Copy)]
struct Rule {
    fixed: bool,
    lot_value: f64,
    reverse: bool,
}

impl Rule {
    fn volume(&self, master: f64) -> f64 {
        let raw = if self.fixed {
            self.lot_value
        } else {
            master * self.lot_value
        };
        (raw / 0.01).round() * 0.01
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Resting,
    Open,
    Gone,
}

/// A master order as this test placed it and the broker filled it.
#[derive(Debug, Clone)]
struct Order {
    side: Side,
    kind: PendingKind,
    price: f64,
    volume: f64,
    state: State,
    /// Its prices before amends not yet settled: the follower's copy may still rest at one.
    earlier: Vec<f64>,
    /// A price move reached one of those while the master's order rested: the copy may have
    /// filled there, and a copy that fills first is kept while the master's order rests.
    copy_may_have_filled: bool,
}

impl Order {
    /// Whether a market at `price` fills this order's kind at `at` (a reversed copy, of the
    /// other side and kind, fills on the same move).
    fn reached(&self, at: f64, price: f64) -> bool {
        match (self.side, self.kind) {
            (Side::Buy, PendingKind::Limit) | (Side::Sell, PendingKind::Stop) => price <= at + 1e-9,
            (Side::Sell, PendingKind::Limit) | (Side::Buy, PendingKind::Stop) => price >= at - 1e-9,
        }
    }
}

fn other(side: Side) -> Side {
    match side {
        Side::Buy => Side::Sell,
        Side::Sell => Side::Buy,
    }
}

fn other_kind(kind: PendingKind) -> PendingKind {
    match kind {
        PendingKind::Limit => PendingKind::Stop,
        PendingKind::Stop => PendingKind::Limit,
    }
}

/// A price for a `side` `kind` order on the right side of the market at `market`.
fn price_for(rng: &mut fastrand::Rng, side: Side, kind: PendingKind, market: f64) -> f64 {
    let ticks = f64::from(rng.u32(1..=5)) * TICK;
    let below = matches!(
        (side, kind),
        (Side::Buy, PendingKind::Limit) | (Side::Sell, PendingKind::Stop)
    );
    let p = if below {
        market - ticks
    } else {
        market + ticks
    };
    (p / TICK).round() * TICK
}

/// Every difference between what `login` holds and the reference.
async fn differences(
    s: &CopySetup,
    login: &str,
    rule: &Rule,
    magic: i64,
    orders: &BTreeMap<i64, Order>,
) -> Vec<String> {
    let mut out = Vec::new();
    // The broker's record, read in full: a failed read (a login the node has not logged in yet)
    // is a difference, never an empty book.
    let (resting, open) = match (
        tools::orders(&s.addr, login).await,
        tools::positions(&s.addr, login).await,
    ) {
        (Ok(resting), Ok(open)) => (resting, open),
        (orders, positions) => {
            out.push(format!("{login}: unread: {orders:?} {positions:?}"));
            return out;
        }
    };
    // The followers trade only through the node: anything not a copy of a master order is wrong.
    let markers: HashSet<String> = orders.keys().map(|t| format!("mc{t}")).collect();
    for o in &resting {
        if o.magic != magic || !markers.contains(&o.comment) {
            out.push(format!("{login}: order {o:?} copies no master order"));
        }
    }
    for p in &open {
        if p.magic != magic || !markers.contains(&p.comment) {
            out.push(format!("{login}: position {p:?} copies no master order"));
        }
    }
    for (ticket, m) in orders {
        let marker = format!("mc{ticket}");
        let copies: Vec<_> = resting
            .iter()
            .filter(|o| o.magic == magic && o.comment == marker)
            .collect();
        let held: Vec<_> = open
            .iter()
            .filter(|p| p.magic == magic && p.comment == marker)
            .collect();
        let volume = rule.volume(m.volume);
        let (side, kind) = if rule.reverse {
            (other(m.side), other_kind(m.kind))
        } else {
            (m.side, m.kind)
        };
        match m.state {
            State::Resting => {
                let pending = copies.len() == 1
                    && held.is_empty()
                    && copies[0].side == side
                    && copies[0].kind == kind
                    && (copies[0].price - m.price).abs() < 1e-9
                    && (copies[0].volume - volume).abs() < 1e-6;
                // The follower's copy filled first (at a price the master's order had before an
                // amend): one copy open, kept while the master's order rests.
                let filled_first = m.copy_may_have_filled
                    && copies.is_empty()
                    && held.len() == 1
                    && held[0].side == side
                    && (held[0].volume - volume).abs() < 1e-6;
                let right = pending || filled_first;
                if !right {
                    out.push(format!(
                        "{login}: order {ticket} rests as {:?} {:?} {} x {volume}: copies {copies:?}, positions {held:?}",
                        side, kind, m.price
                    ));
                }
            }
            State::Open => {
                let right = copies.is_empty()
                    && held.len() == 1
                    && held[0].side == side
                    && (held[0].volume - volume).abs() < 1e-6;
                if !right {
                    out.push(format!(
                        "{login}: order {ticket} filled ({side:?} {volume}): copies {copies:?}, positions {held:?}"
                    ));
                }
            }
            State::Gone => {
                if !copies.is_empty() || !held.is_empty() {
                    out.push(format!(
                        "{login}: order {ticket} is gone: copies {copies:?}, positions {held:?}"
                    ));
                }
            }
        }
    }
    out
}

/// One step of the master's history; what it did.
async fn step(
    rng: &mut fastrand::Rng,
    s: &CopySetup,
    market: &mut f64,
    orders: &mut BTreeMap<i64, Order>,
) -> String {
    let resting: Vec<i64> = orders
        .iter()
        .filter(|(_, o)| o.state == State::Resting)
        .map(|(t, _)| *t)
        .collect();
    let open: Vec<i64> = orders
        .iter()
        .filter(|(_, o)| o.state == State::Open)
        .map(|(t, _)| *t)
        .collect();
    let roll = rng.u32(..10);
    if roll < 4 || (resting.is_empty() && open.is_empty()) {
        let side = if rng.bool() { Side::Buy } else { Side::Sell };
        let kind = if rng.bool() {
            PendingKind::Limit
        } else {
            PendingKind::Stop
        };
        let price = price_for(rng, side, kind, *market);
        let volume = [0.1, 0.2, 0.5, 1.0][rng.usize(..4)];
        let ticket = tools::trade(
            &s.addr,
            "m1",
            HandOrder::Place(crate::support::pending_order(
                "EURUSD", side, kind, price, volume,
            )),
        )
        .await
        .unwrap()
        .expect("a placed order's ticket");
        orders.insert(
            ticket,
            Order {
                side,
                kind,
                price,
                volume,
                state: State::Resting,
                earlier: Vec::new(),
                copy_may_have_filled: false,
            },
        );
        return format!("place {ticket} {side:?} {kind:?} {price:.3} x {volume}");
    }
    if roll == 4 && !resting.is_empty() {
        let ticket = resting[rng.usize(..resting.len())];
        let o = orders.get_mut(&ticket).unwrap();
        let price = price_for(rng, o.side, o.kind, *market);
        o.earlier.push(o.price);
        tools::trade(
            &s.addr,
            "m1",
            HandOrder::Amend {
                ticket,
                price,
                sl: None,
                tp: None,
                expiry_ms: None,
            },
        )
        .await
        .unwrap();
        o.price = price;
        return format!("amend {ticket} to {price:.3}");
    }
    if roll == 5 && !resting.is_empty() {
        let ticket = resting[rng.usize(..resting.len())];
        tools::trade(&s.addr, "m1", HandOrder::Cancel { ticket })
            .await
            .unwrap();
        orders.get_mut(&ticket).unwrap().state = State::Gone;
        return format!("cancel {ticket}");
    }
    if roll == 6 && !open.is_empty() {
        let ticket = open[rng.usize(..open.len())];
        s.t.close("m1", ticket, None).await;
        orders.get_mut(&ticket).unwrap().state = State::Gone;
        return format!("close {ticket}");
    }
    // The price moves: what it reaches fills, on the master and on the followers alike.
    let ticks = f64::from(rng.u32(1..=6)) * TICK;
    let to = if rng.bool() {
        *market + ticks
    } else {
        *market - ticks
    };
    *market = ((to / TICK).round() * TICK).clamp(START - 0.02, START + 0.02);
    tools::set_price(&s.addr, "EURUSD", *market).await.unwrap();
    // Which master orders filled: the broker's record, not the product's.
    let still: HashSet<i64> = tools::orders(&s.addr, "m1")
        .await
        .unwrap()
        .iter()
        .map(|o| o.ticket)
        .collect();
    let positions: HashSet<i64> = tools::positions(&s.addr, "m1")
        .await
        .unwrap()
        .iter()
        .map(|p| p.ticket)
        .collect();
    let mut filled = Vec::new();
    for o in orders.values_mut() {
        if o.state == State::Resting && o.earlier.iter().any(|at| o.reached(*at, *market)) {
            o.copy_may_have_filled = true;
        }
    }
    for (ticket, o) in orders.iter_mut() {
        if o.state == State::Resting && !still.contains(ticket) {
            assert!(
                positions.contains(ticket),
                "master order {ticket} left the book without a position"
            );
            o.state = State::Open;
            filled.push(*ticket);
        }
    }
    format!("price {:.3}: filled {filled:?}", *market)
}

/// What the cases did: copies held at settle points (pending and open), and how many master
/// orders were amended, cancelled and filled.
#[derive(Debug, Default)]
struct Tally {
    held: usize,
    amended: usize,
    cancelled: usize,
    filled: usize,
}

/// One random case, added to `tally`.
async fn case(seed: u64, tally: &mut Tally) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut s = CopySetup::unprotected("pending-rules").await;
    tools::set_price(&s.addr, "EURUSD", START).await.unwrap();
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    let mut links = Vec::new();
    for f in 2..2 + FOLLOWERS {
        // f2 a multiplier link, f3 the same reversed, f4 a fixed lot reversed or not.
        let rule = match f {
            2 | 3 => Rule {
                fixed: false,
                lot_value: [0.5, 1.0, 2.0][rng.usize(..3)],
                reverse: f == 3,
            },
            _ => Rule {
                fixed: true,
                lot_value: [0.05, 0.1][rng.usize(..2)],
                reverse: rng.bool(),
            },
        };
        add_account(&mut s.conn, f, "follower", &s.addr, &format!("f{f}")).await;
        let spec = LinkSpec {
            lot_mode: if rule.fixed { "fixed" } else { "multiplier" },
            lot_value: rule.lot_value,
            reverse: rule.reverse,
            ..Default::default()
        };
        let (_, magic) = add_link(&mut s.conn, 1, f, spec).await;
        links.push((format!("f{f}"), rule, magic));
    }
    let steps = rng.usize(8..=16);
    let before_node = rng.usize(0..=steps / 3);
    let mut market = START;
    let mut orders: BTreeMap<i64, Order> = BTreeMap::new();
    let mut history = vec![format!("links: {links:?}")];
    let mut node = None;
    for i in 0..=steps {
        if i == before_node {
            history.push("node starts".into());
            let n = start_node(&config(&s.db, "a", 100, FAST)).await;
            wait_state(&n.state, "the node owns every account", WAIT, |st| {
                st.owned.len() == 1 + FOLLOWERS as usize
            })
            .await;
            node = Some(n);
        }
        if node.is_some() && (i == steps || rng.u32(..3) == 0) {
            history.push("settle".into());
            tally.held += settle(seed, &s, &links, &orders, &history).await;
            // Settled: every copy is at its order's current price, or filled.
            for o in orders.values_mut() {
                o.earlier.clear();
            }
        }
        if i < steps {
            let did = step(&mut rng, &s, &mut market, &mut orders).await;
            tally.amended += usize::from(did.starts_with("amend"));
            tally.cancelled += usize::from(did.starts_with("cancel"));
            tally.filled += usize::from(did.contains("filled [") && !did.contains("filled []"));
            history.push(did);
        }
    }
    // A last trade at market, copied by every follower: the master's events are handled in
    // order, so everything before it was handled too. Only then is the record judged.
    let last = s.t.open("m1", "EURUSD", Side::Buy, 0.1, None, None).await;
    orders.insert(
        last,
        Order {
            side: Side::Buy,
            kind: PendingKind::Limit,
            price: market,
            volume: 0.1,
            state: State::Open,
            earlier: Vec::new(),
            copy_may_have_filled: false,
        },
    );
    history.push(format!("open {last} at market: the last trade"));
    settle(seed, &s, &links, &orders, &history).await;
    // Never two positions for one master order on a follower, by the broker's record (open and
    // closed), whichever way the copy came.
    for (login, _, magic) in &links {
        let mut tickets: BTreeMap<String, HashSet<i64>> = BTreeMap::new();
        let (open, closed) = s.t.record(login).await;
        for p in open {
            if p.magic == *magic {
                tickets.entry(p.comment).or_default().insert(p.ticket);
            }
        }
        for c in closed {
            if c.position.magic == *magic {
                tickets
                    .entry(c.position.comment)
                    .or_default()
                    .insert(c.position.ticket);
            }
        }
        let twice: Vec<_> = tickets.iter().filter(|(_, t)| t.len() > 1).collect();
        assert!(
            twice.is_empty(),
            "seed {seed}: {login} copied a master order twice: {twice:?}\nhistory:\n  {}",
            history.join("\n  ")
        );
    }
    let node = node.expect("started at or before the last step");
    node.shutdown();
    node.wait().await.unwrap();
    s.broker.stop().await;
}

/// Waits until the followers hold what the reference says, or fails naming every difference;
/// returns how many copies they hold.
async fn settle(
    seed: u64,
    s: &CopySetup,
    links: &[(String, Rule, i64)],
    orders: &BTreeMap<i64, Order>,
    history: &[String],
) -> usize {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let mut diffs = Vec::new();
        for (login, rule, magic) in links {
            diffs.extend(differences(s, login, rule, *magic, orders).await);
        }
        if diffs.is_empty() {
            return links.len() * orders.values().filter(|o| o.state != State::Gone).count();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "seed {seed} (replay: COPIER_PENDING_SEED={seed}): the followers did not settle on the reference in {WAIT:?}:\n  {}\nhistory:\n  {}",
            diffs.join("\n  "),
            history.join("\n  ")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Random master histories of pending orders (places, amends, cancels, fills by the price,
/// closes), met by reconcile and by events, leave every follower holding what the reference
/// says, with no master order copied twice.
#[tokio::test]
async fn random_master_pending_orders_copy_as_the_documented_rules_say() {
    let replay = std::env::var("COPIER_PENDING_SEED").ok();
    let mut tally = Tally::default();
    let exercised = |t: &Tally| t.held > 0 && t.amended > 0 && t.cancelled > 0 && t.filled > 0;
    match &replay {
        Some(s) => {
            let seed = s.parse().expect("COPIER_PENDING_SEED is a number");
            case(seed, &mut tally).await;
        }
        // Six cases, and more (up to 24) while they have not met every kind of step: six alone
        // now and then met no cancel or no amend (each comes a few times in six cases), and
        // the run failed for the draw, not for the product.
        None => {
            for n in 0..24 {
                if n >= 6 && exercised(&tally) {
                    break;
                }
                let seed = fastrand::u64(..);
                eprintln!("pending rules, seed {seed} (replay: COPIER_PENDING_SEED={seed})");
                case(seed, &mut tally).await;
            }
        }
    }
    eprintln!("{tally:?}");
    // The cases met what the test is named for: copies to check, amends, cancels and fills
    // (a replayed case alone need not have met them all).
    assert!(
        replay.is_some() || exercised(&tally),
        "the cases did not exercise every kind of step: {tally:?}"
    );
}
