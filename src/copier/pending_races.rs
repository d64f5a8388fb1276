//! Property test of the pending-order decisions against the races a real follower meets: the
//! follower's pending copy fills (or expires, or is cancelled by hand) at any moment, including
//! while a cancel is on its way; replies are lost (the request executed, the node does not know);
//! stream updates arrive late (a fill's position before or after its order's end); a place
//! whose reply was lost lands at the server later; master events are dropped (a gap: reconcile).
//! For random master histories (place, amend, cancel, fill, close of pending orders) it checks,
//! at every step, that
//! no master ticket ever got two copies (a fill of a pending copy and an order at market count
//! alike) nor two pending copies, and after the follower settles, that it holds exactly what the
//! master does: one copy per open master position, none of a closed one, no pending copy of an
//! order that is gone.
//!
//! The decisions are the production ones ([`plan`], [`plan_key`], [`apply_event`],
//! [`CopyIndex`]); what is modelled is the broker and the session's sequencing (an event at
//! exactly seq + 1 is decided at once, anything else reconciles; a reconcile owed is run at a
//! random later step, events meanwhile take the event path; a reconcile reads orders, then
//! positions, then history; an open that a non-open event finds owed is left to a reconcile).
//! The checker is the server's own record: what it created, per master ticket.

use std::collections::{HashMap, HashSet, VecDeque};

use proptest::prelude::*;

use super::convergence::specs;
use super::events::MasterEvent;
use super::index::CopyIndex;
use super::reconcile::{Action, Memory, PendingCopies, Situation, apply_event, plan, plan_key};
use super::rules::{Inputs, Link, LotMode};
use super::{MasterOrder, MasterPosition, parse_marker};
use crate::broker::types::{
    ClosedBy, ClosedPosition, OrderEnd, PendingKind, PendingOrder, Position, PositionChange, Side,
    SymbolSpec,
};

const MAGIC: i64 = 100_007;

fn link() -> Link {
    Link {
        id: 7,
        master_id: 1,
        enabled: true,
        magic: MAGIC,
        lot_mode: LotMode::Multiplier,
        lot_value: 1.0,
        reverse: false,
        copy_sl_tp: false,
        symbol_map: HashMap::new(),
        copy_existing: true,
        created_at_ms: 0,
        protections: Default::default(),
    }
}

/// The follower's trade server. It keeps its own count of what it created per master ticket:
/// the checker reads nothing else.
#[derive(Debug, Default)]
struct Server {
    orders: Vec<PendingOrder>,
    open: Vec<Position>,
    history: Vec<ClosedPosition>,
    next: i64,
    /// Master ticket -> positions created for it (pending copies filled, orders at market).
    created: HashMap<i64, u32>,
    /// Master ticket -> pending copies placed for it.
    placed: HashMap<i64, u32>,
}

fn master_of(comment: &str) -> i64 {
    parse_marker(comment).expect("only copies on the follower")
}

impl Server {
    fn ticket(&mut self) -> i64 {
        self.next += 1;
        9_000 + self.next
    }

    fn close(&mut self, ticket: i64) -> Option<PositionChange> {
        let i = self.open.iter().position(|p| p.ticket == ticket)?;
        let p = self.open.remove(i);
        let closed = ClosedPosition {
            position: p,
            close_price: 1.1,
            close_time_ms: 0,
            closed_by: ClosedBy::Client,
            remaining_volume: 0.0,
            profit: 0.0,
        };
        self.history.push(closed.clone());
        Some(PositionChange::Closed { closed })
    }

    /// The follower's market reaches resting order `i`: it fills under its own ticket.
    fn fill(&mut self, i: usize) -> Vec<PositionChange> {
        let o = self.orders.remove(i);
        *self.created.entry(master_of(&o.comment)).or_default() += 1;
        let p = Position {
            ticket: o.ticket,
            symbol: o.symbol.clone(),
            side: o.side,
            volume: o.volume,
            open_price: o.price,
            sl: o.sl,
            tp: o.tp,
            magic: o.magic,
            comment: o.comment.clone(),
            open_time_ms: 0,
        };
        self.open.push(p.clone());
        vec![
            PositionChange::OrderGone {
                ticket: o.ticket,
                end: OrderEnd::Filled { position: o.ticket },
            },
            PositionChange::Opened { position: p },
        ]
    }

    /// Resting order `i` leaves the book without a fill (expired, cancelled by hand).
    fn vanish(&mut self, i: usize) -> PositionChange {
        let o = self.orders.remove(i);
        PositionChange::OrderGone {
            ticket: o.ticket,
            end: OrderEnd::Expired,
        }
    }

    /// Executes one action. `Ok(update)`, or `Err(())` for an unknown ticket.
    fn execute(&mut self, action: &Action) -> Result<Vec<PositionChange>, ()> {
        match action {
            Action::Open {
                master_ticket,
                order,
                ..
            } => {
                *self.created.entry(*master_ticket).or_default() += 1;
                let p = order.position(self.ticket(), 1.1, 0);
                self.open.push(p.clone());
                Ok(vec![PositionChange::Opened { position: p }])
            }
            Action::Close { ticket, .. } => self.close(*ticket).map(|c| vec![c]).ok_or(()),
            Action::Trim { .. } | Action::Modify { .. } => {
                panic!("no partial closes or stops in this model: {action:?}")
            }
            Action::Place {
                master_ticket,
                order,
            } => {
                *self.placed.entry(*master_ticket).or_default() += 1;
                let o = order.pending(self.ticket(), 0);
                self.orders.push(o.clone());
                Ok(vec![PositionChange::OrderPlaced { order: o }])
            }
            Action::Amend { ticket, price, .. } => {
                let o = self
                    .orders
                    .iter_mut()
                    .find(|o| o.ticket == *ticket)
                    .ok_or(())?;
                o.price = *price;
                Ok(vec![PositionChange::OrderChanged { order: o.clone() }])
            }
            Action::Cancel { ticket, .. } => {
                let i = self
                    .orders
                    .iter()
                    .position(|o| o.ticket == *ticket)
                    .ok_or(())?;
                self.orders.remove(i);
                Ok(vec![PositionChange::OrderGone {
                    ticket: *ticket,
                    end: OrderEnd::Cancelled,
                }])
            }
            Action::Skip { .. } | Action::Wait { .. } => Ok(Vec::new()),
        }
    }
}

/// The master's snapshot.
#[derive(Debug, Default, Clone)]
struct Master {
    positions: Vec<MasterPosition>,
    orders: Vec<MasterOrder>,
}

/// The follower session, as `follower/mod.rs`, `send.rs` and `pending.rs` sequence it.
#[derive(Debug, Default)]
struct Session {
    server: Server,
    index: CopyIndex,
    memory: Memory,
    /// The copy ledger and the ledger of order copies: master tickets recorded.
    ledger: HashSet<i64>,
    placed_ledger: HashSet<i64>,
    view: Option<(i64, Master)>,
    stream: VecDeque<PositionChange>,
    owed: bool,
    /// Places whose reply was lost before they reached the server: executed at the start of a
    /// later step (a request that lands after the node gave up on it).
    late: Vec<Action>,
}

impl Session {
    fn situation<'a>(
        &'a self,
        specs: &'a HashMap<String, SymbolSpec>,
        funds: &'a Inputs,
        seq: i64,
    ) -> Situation<'a> {
        Situation {
            memory: &self.memory,
            funds,
            specs,
            at: (1, seq),
            pending: PendingCopies::default(),
        }
    }

    /// Sends a plan. `lose`: the replies to places and cancels of this step are lost (the
    /// server executed them). `open_allowed`: false on the event path of a non-open event.
    fn send(&mut self, actions: Vec<Action>, master: &Master, open_allowed: bool, lose: bool) {
        for a in actions {
            let key = (MAGIC, a.master_ticket());
            match &a {
                Action::Open { .. } if !open_allowed => {
                    self.owed = true;
                    continue;
                }
                Action::Skip { master_ticket, .. } => {
                    self.memory.decided.insert((7, *master_ticket));
                    continue;
                }
                Action::Wait { .. } => {
                    self.owed = true;
                    continue;
                }
                Action::Place { .. } => {
                    self.index.mark_placed(key);
                    if lose {
                        // Timed out here; it reaches the server later.
                        self.index.doubt(key);
                        self.owed = true;
                        self.late.push(a);
                        continue;
                    }
                }
                _ => {}
            }
            let result = self.server.execute(&a);
            match (&a, &result) {
                (Action::Open { master_ticket, .. }, Ok(changes)) => {
                    if let Some(PositionChange::Opened { position }) = changes.first() {
                        self.index.opened(position.clone());
                        self.ledger.insert(*master_ticket);
                    }
                }
                (Action::Close { ticket, .. }, _) => self.index.reduced(*ticket, 0.0),
                (Action::Cancel { .. }, Ok(_)) if lose => {
                    self.index.doubt(key);
                    self.owed = true;
                }
                (Action::Place { master_ticket, .. }, Ok(changes)) => {
                    if let Some(PositionChange::OrderPlaced { order }) = changes.first() {
                        self.index.order_placed(order.clone());
                        self.placed_ledger.insert(*master_ticket);
                    }
                }
                (
                    Action::Amend {
                        ticket,
                        price,
                        sl,
                        tp,
                        expiry_ms,
                        ..
                    },
                    Ok(_),
                ) => self
                    .index
                    .order_amended(*ticket, (*price, *sl, *tp, *expiry_ms)),
                (
                    Action::Cancel {
                        ticket,
                        master_ticket,
                        ..
                    },
                    Ok(_),
                ) => {
                    self.index.order_gone(*ticket, false);
                    if master.positions.iter().any(|p| p.ticket == *master_ticket) {
                        // owe_within(0): the fill is copied by a reconcile, at once.
                        self.owed = true;
                    }
                }
                (Action::Cancel { .. }, Err(())) => {
                    self.index.doubt(key);
                    self.owed = true;
                }
                _ => {}
            }
            if let Ok(changes) = result {
                self.stream.extend(changes);
            }
        }
    }

    fn drain(&mut self, n: usize) {
        for _ in 0..n.min(self.stream.len()) {
            let c = self.stream.pop_front().expect("len checked");
            self.index.apply(&c);
        }
    }

    /// Reads orders, positions and history (in that order), the ledgers, and the master's
    /// snapshot; plans every ticket.
    /// `between`: one of the follower's orders fills between the read of the orders and that of
    /// the positions.
    fn reconcile(&mut self, seq: i64, master: &Master, lose: bool, between: Option<usize>) {
        self.owed = false;
        let orders = self.server.orders.clone();
        self.index.rebuild_orders(&orders);
        if let Some(n) = between
            && !self.server.orders.is_empty()
        {
            let changes = self.server.fill(n % self.server.orders.len());
            self.stream.extend(changes);
        }
        let open = self.server.open.clone();
        self.index.rebuild(&open, &self.server.history);
        // The ledgers learn what these reads showed, no more.
        for p in &open {
            self.ledger.insert(master_of(&p.comment));
        }
        for o in &orders {
            self.placed_ledger.insert(master_of(&o.comment));
        }
        for t in &self.ledger {
            self.index.mark_ever((MAGIC, *t));
        }
        for t in &self.placed_ledger {
            self.index.mark_placed((MAGIC, *t));
        }
        // As `settle_vanished`: a pending copy once on the book and in none of the reads left
        // without a fill.
        let seen: HashSet<i64> = orders
            .iter()
            .map(|o| o.ticket)
            .chain(open.iter().map(|p| p.ticket))
            .chain(self.server.history.iter().map(|h| h.position.ticket))
            .collect();
        for (ticket, key) in self.index.unresolved_orders() {
            if !seen.contains(&ticket)
                && !self.index.ever(key)
                && self.index.pending(key).is_empty()
            {
                self.index.mark_ended(key);
            }
        }
        let (specs, funds) = (specs(), Inputs::default());
        let actions = plan(
            &link(),
            &master.positions,
            &master.orders,
            &self.index,
            &self.situation(&specs, &funds, seq),
        );
        self.view = Some((seq, master.clone()));
        self.send(actions, master, true, lose);
    }

    fn on_event(
        &mut self,
        seq: i64,
        event: &MasterEvent,
        master: &Master,
        (lose, between): (bool, Option<usize>),
    ) {
        let Some((have, view)) = &mut self.view else {
            return self.reconcile(seq, master, lose, between);
        };
        if seq <= *have {
            return;
        }
        if seq != *have + 1 {
            return self.reconcile(seq, master, lose, between);
        }
        apply_event(&mut view.positions, &mut view.orders, event);
        *have = seq;
        let ticket = match event {
            MasterEvent::Open { position } => position.ticket,
            MasterEvent::Close { ticket } | MasterEvent::OrderGone { ticket } => *ticket,
            MasterEvent::OrderSet { order } => order.ticket,
            other => panic!("not produced here: {other:?}"),
        };
        let position = view.positions.iter().find(|p| p.ticket == ticket).cloned();
        let order = view.orders.iter().find(|o| o.ticket == ticket).cloned();
        let view = view.clone();
        let (specs, funds) = (specs(), Inputs::default());
        let actions = plan_key(
            &link(),
            ticket,
            position.as_ref(),
            order.as_ref(),
            &self.index,
            &self.situation(&specs, &funds, seq),
        );
        let open_allowed = matches!(event, MasterEvent::Open { .. });
        self.send(actions, &view, open_allowed, lose);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Place {
        buy: bool,
        limit: bool,
    },
    Amend {
        pick: usize,
        up: bool,
    },
    Cancel {
        pick: usize,
    },
    Fill {
        pick: usize,
    },
    Close {
        pick: usize,
    },
    /// The follower's market fills one of its resting orders (its stream announcing the
    /// position before the order's end, or after).
    FollowerFill {
        pick: usize,
        opened_first: bool,
    },
    /// One of the follower's resting orders expires or is cancelled by hand.
    FollowerGone {
        pick: usize,
    },
    /// The owed reconcile's time comes.
    Retry,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<bool>(), any::<bool>()).prop_map(|(buy, limit)| Op::Place { buy, limit }),
        2 => (any::<usize>(), any::<bool>()).prop_map(|(pick, up)| Op::Amend { pick, up }),
        2 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
        3 => any::<usize>().prop_map(|pick| Op::Fill { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Close { pick }),
        3 => (any::<usize>(), any::<bool>())
            .prop_map(|(pick, opened_first)| Op::FollowerFill { pick, opened_first }),
        1 => any::<usize>().prop_map(|pick| Op::FollowerGone { pick }),
        2 => Just(Op::Retry),
    ]
}

/// Per step: the op, whether its event is delivered (else dropped: a gap), whether the
/// follower's replies in that step are lost, how many stream updates arrive after it, and which
/// of the follower's orders (if any) fills between a reconcile's read of the orders and of the
/// positions in that step.
type Step = (Op, bool, bool, u8, Option<usize>);

fn step() -> impl Strategy<Value = Step> {
    (
        op(),
        prop::bool::weighted(0.85),
        prop::bool::weighted(0.15),
        0u8..4,
        prop::option::weighted(0.3, any::<usize>()),
    )
}

fn check_counts(s: &Session, at: &str) -> Result<(), TestCaseError> {
    for (t, n) in &s.server.created {
        prop_assert!(*n <= 1, "{at}: master ticket {t} got {n} copies");
    }
    for (t, n) in &s.server.placed {
        prop_assert!(*n <= 1, "{at}: master ticket {t} got {n} pending copies");
    }
    Ok(())
}

fn run(steps: &[Step]) -> Result<(), TestCaseError> {
    let mut master = Master::default();
    let mut s = Session::default();
    let mut seq = 0;
    let mut next_ticket = 100;
    s.reconcile(seq, &master, false, None);
    for (i, (op, delivered, lose, arrivals, between)) in steps.iter().enumerate() {
        // Late requests land at a random later step (here: steps without stream arrivals), so
        // a reconcile may read before they do.
        if *arrivals == 0 {
            for a in std::mem::take(&mut s.late) {
                if let Ok(changes) = s.server.execute(&a) {
                    s.stream.extend(changes);
                }
            }
        }
        let pick = |n: usize, len: usize| (len > 0).then(|| n % len);
        let event = match op {
            Op::Place { buy, limit } => {
                next_ticket += 1;
                let o = MasterOrder {
                    ticket: next_ticket,
                    symbol: "EURUSD".into(),
                    side: if *buy { Side::Buy } else { Side::Sell },
                    kind: if *limit {
                        PendingKind::Limit
                    } else {
                        PendingKind::Stop
                    },
                    price: 1.09,
                    volume: 1.0,
                    sl: None,
                    tp: None,
                    expiry_ms: None,
                    expiry_utc_ms: None,
                    magic: 0,
                    first_seen_ms: Some(1),
                    first_seen_us: None,
                    contract_size: None,
                };
                master.orders.push(o.clone());
                Some(MasterEvent::OrderSet { order: o })
            }
            Op::Amend { pick: n, up } => pick(*n, master.orders.len()).map(|i| {
                let o = &mut master.orders[i];
                o.price += if *up { 0.001 } else { -0.001 };
                MasterEvent::OrderSet { order: o.clone() }
            }),
            Op::Cancel { pick: n } => pick(*n, master.orders.len()).map(|i| {
                let o = master.orders.remove(i);
                MasterEvent::OrderGone { ticket: o.ticket }
            }),
            Op::Fill { pick: n } => pick(*n, master.orders.len()).map(|i| {
                let o = master.orders.remove(i);
                let position = MasterPosition {
                    first_seen_ms: Some(2),
                    first_seen_us: None,
                    ..o.as_position()
                };
                master.positions.push(position.clone());
                MasterEvent::Open { position }
            }),
            Op::Close { pick: n } => pick(*n, master.positions.len()).map(|i| {
                let p = master.positions.remove(i);
                MasterEvent::Close { ticket: p.ticket }
            }),
            Op::FollowerFill {
                pick: n,
                opened_first,
            } => {
                if let Some(i) = pick(*n, s.server.orders.len()) {
                    let mut changes = s.server.fill(i);
                    if *opened_first {
                        changes.reverse();
                    }
                    s.stream.extend(changes);
                }
                None
            }
            Op::FollowerGone { pick: n } => {
                if let Some(i) = pick(*n, s.server.orders.len()) {
                    let change = s.server.vanish(i);
                    s.stream.push_back(change);
                }
                None
            }
            Op::Retry => {
                if s.owed {
                    s.reconcile(seq, &master, *lose, *between);
                }
                None
            }
        };
        if let Some(event) = event {
            seq += 1;
            if *delivered {
                s.on_event(seq, &event, &master, (*lose, *between));
            }
        }
        s.drain(*arrivals as usize);
        check_counts(&s, &format!("step {i} ({op:?})"))?;
    }
    // Settle: late requests land, every update arrives, reconciles run until nothing is owed.
    for a in std::mem::take(&mut s.late) {
        if let Ok(changes) = s.server.execute(&a) {
            s.stream.extend(changes);
        }
    }
    for _ in 0..4 {
        s.drain(usize::MAX);
        s.reconcile(seq, &master, false, None);
    }
    s.drain(usize::MAX);
    check_counts(&s, "settled")?;
    prop_assert!(!s.owed, "still owed after settling");
    for m in &master.positions {
        let copies = s
            .server
            .open
            .iter()
            .filter(|p| master_of(&p.comment) == m.ticket)
            .count();
        prop_assert_eq!(copies, 1, "copies of open master position {}", m.ticket);
    }
    for p in &s.server.open {
        let t = master_of(&p.comment);
        prop_assert!(
            master.positions.iter().any(|m| m.ticket == t)
                || master.orders.iter().any(|o| o.ticket == t),
            "copy of {} open, but the master holds neither its position nor its order",
            t
        );
    }
    for o in &s.server.orders {
        let t = master_of(&o.comment);
        let rests = master.orders.iter().find(|m| m.ticket == t);
        prop_assert!(
            rests.is_some(),
            "pending copy of {} rests, the master's order is gone",
            t
        );
        prop_assert_eq!(
            Some(o.price),
            rests.map(|m| m.price),
            "pending copy of {} not amended",
            t
        );
        prop_assert!(
            !s.server.open.iter().any(|p| master_of(&p.comment) == t),
            "pending copy of {} rests beside its copy",
            t
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn pending_copies_never_double_and_settle_to_the_masters_state(
        steps in prop::collection::vec(step(), 1..50),
    ) {
        run(&steps)?;
    }
}
