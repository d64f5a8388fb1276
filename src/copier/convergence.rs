//! Property test of the follower's decisions: for random master histories (opens, partial and
//! full closes, stop changes, copies closed by hand on the follower) and random delivery (events
//! dropped, repeated, cut by gaps, or replaced by the master's whole snapshot as a new owner
//! publishes it; stream updates before or after replies), the event path plus
//! reconcile reaches the state that reconcile with perfect knowledge reaches, never holds two
//! copies of one master position, and never reopens a copy the follower closed.
//!
//! The decisions are the production ones ([`plan`], [`plan_ticket`], [`apply_event`],
//! [`changed_tickets`], [`CopyIndex`]); what is modelled here is the broker and the session's
//! sequencing (an event at exactly seq + 1 is applied, a snapshot's changed tickets are decided
//! as their events, anything else reconciles; an open a non-open event finds owed is left to the
//! next reconcile).

use std::collections::{HashMap, HashSet, VecDeque};

use proptest::prelude::*;

use super::events::MasterEvent;
use super::index::CopyIndex;
use super::reconcile::{
    Action, Memory, Situation, apply_event, changed_tickets, plan, plan_ticket,
};
use super::rules::{Inputs, Link, LotMode};
use super::{MasterPosition, parse_marker};
use crate::broker::types::{ClosedBy, ClosedPosition, Position, PositionChange, Side, SymbolSpec};

pub(super) fn specs() -> HashMap<String, SymbolSpec> {
    [(
        "EURUSD".to_string(),
        SymbolSpec {
            symbol: "EURUSD".into(),
            price: 1.1,
            volume_step: 0.01,
            volume_min: 0.01,
            volume_max: 100.0,
            contract_size: 100_000.0,
            point: 0.00001,
            profit_currency: None,
        },
    )]
    .into()
}

fn r2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// The follower's trade server: executes what it is sent, records what it executed.
#[derive(Debug, Default, Clone)]
struct Server {
    open: Vec<Position>,
    history: Vec<ClosedPosition>,
    next: i64,
    /// Master ticket -> accepted opens of a copy of it.
    opens: HashMap<i64, u32>,
    /// Master tickets whose copy was closed by hand.
    hand_closed: HashSet<i64>,
    /// Master tickets opened again after a hand close (must stay empty).
    reopened: Vec<i64>,
}

impl Server {
    fn close_part(&mut self, ticket: i64, volume: f64, by: ClosedBy) -> Option<PositionChange> {
        let i = self.open.iter().position(|p| p.ticket == ticket)?;
        let before = self.open[i].clone();
        let volume = volume.min(before.volume);
        let remaining = r2(before.volume - volume);
        let closed = ClosedPosition {
            position: Position {
                volume,
                ..before.clone()
            },
            close_price: 1.1,
            close_time_ms: 0,
            closed_by: by,
            remaining_volume: remaining,
            profit: 0.0,
        };
        self.history.push(closed.clone());
        if remaining <= 1e-9 {
            self.open.remove(i);
            Some(PositionChange::Closed { closed })
        } else {
            self.open[i].volume = remaining;
            Some(PositionChange::PartiallyClosed {
                position: self.open[i].clone(),
                closed,
            })
        }
    }

    /// Executes one order; the stream update it causes.
    fn execute(&mut self, action: &Action) -> Option<PositionChange> {
        match action {
            Action::Open {
                master_ticket,
                order,
                ..
            } => {
                *self.opens.entry(*master_ticket).or_default() += 1;
                if self.hand_closed.contains(master_ticket) {
                    self.reopened.push(*master_ticket);
                }
                self.next += 1;
                let p = order.position(5_000 + self.next, 1.1, 0);
                self.open.push(p.clone());
                Some(PositionChange::Opened { position: p })
            }
            Action::Close { ticket, .. } => self.close_part(*ticket, f64::MAX, ClosedBy::Client),
            Action::Trim {
                ticket,
                close_volume,
                ..
            } => self.close_part(*ticket, *close_volume, ClosedBy::Client),
            Action::Modify { ticket, sl, tp, .. } => {
                let p = self.open.iter_mut().find(|p| p.ticket == *ticket)?;
                p.sl = *sl;
                p.tp = *tp;
                Some(PositionChange::Modified {
                    position: p.clone(),
                })
            }
            Action::Skip { .. } | Action::Wait { .. } => None,
            Action::Place { .. } | Action::Amend { .. } | Action::Cancel { .. } => {
                panic!("a pending-order action without any master order: {action:?}")
            }
        }
    }

    fn copy_of(&self, master_ticket: i64) -> Vec<&Position> {
        self.open
            .iter()
            .filter(|p| parse_marker(&p.comment) == Some(master_ticket))
            .collect()
    }
}

/// A follower: its server, its index, and what it remembers of the master.
#[derive(Debug, Default)]
struct Follower {
    server: Server,
    index: CopyIndex,
    memory: Memory,
    /// The snapshot followed and its seq (`None` before the first reconcile).
    view: Option<(i64, Vec<MasterPosition>)>,
    /// Stream updates not yet delivered (the reply is always applied at once).
    stream: VecDeque<PositionChange>,
    owed: bool,
}

impl Follower {
    fn send(&mut self, link: &Link, actions: Vec<Action>, open_allowed: bool) {
        for a in actions {
            if matches!(a, Action::Open { .. }) && !open_allowed {
                self.owed = true;
                continue;
            }
            if let Action::Skip { master_ticket, .. } = &a {
                // A final decision, as the session records it.
                self.memory.decided.insert((link.id, *master_ticket));
            }
            let change = self.server.execute(&a);
            // The reply, as the session applies it.
            match (&a, &change) {
                (Action::Open { .. }, Some(PositionChange::Opened { position })) => {
                    self.index.opened(position.clone())
                }
                (Action::Close { ticket, .. }, _) => self.index.reduced(*ticket, 0.0),
                (
                    Action::Trim { ticket, .. },
                    Some(PositionChange::PartiallyClosed { position, .. }),
                ) => self.index.reduced(*ticket, position.volume),
                (Action::Trim { ticket, .. }, _) => self.index.reduced(*ticket, 0.0),
                (Action::Modify { ticket, sl, tp, .. }, _) => self.index.stops(*ticket, *sl, *tp),
                _ => {}
            }
            if let Some(c) = change {
                self.stream.push_back(c);
            }
            if let Action::Open { base: Some(b), .. } = &a
                && let Some(PositionChange::Opened { position }) = self.stream.back()
            {
                self.memory.bases.insert(position.ticket, *b);
            }
        }
    }

    fn drain_stream(&mut self, n: usize) {
        for _ in 0..n.min(self.stream.len()) {
            let c = self.stream.pop_front().expect("len checked");
            self.index.apply(&c);
        }
    }

    fn reconcile(&mut self, link: &Link, seq: i64, snapshot: &[MasterPosition]) {
        self.drain_stream(usize::MAX);
        self.index.rebuild(&self.server.open, &self.server.history);
        let specs = specs();
        let actions = plan(
            link,
            snapshot,
            &[],
            &self.index,
            &Situation {
                memory: &self.memory,
                funds: &Inputs::default(),
                specs: &specs,
                at: (1, seq),
                pending: Default::default(),
            },
        );
        self.send(link, actions, true);
        self.view = Some((seq, snapshot.to_vec()));
        self.owed = false;
    }

    fn on_event(
        &mut self,
        link: &Link,
        seq: i64,
        event: &MasterEvent,
        snapshot: &[MasterPosition],
    ) {
        if self.owed {
            self.reconcile(link, seq, snapshot);
            return;
        }
        let Some((have, view)) = &mut self.view else {
            self.reconcile(link, seq, snapshot);
            return;
        };
        if seq <= *have {
            return;
        }
        if seq != *have + 1 {
            self.reconcile(link, seq, snapshot);
            return;
        }
        apply_event(view, &mut Vec::new(), event);
        *have = seq;
        let ticket = match event {
            MasterEvent::Open { position } => position.ticket,
            MasterEvent::Close { ticket }
            | MasterEvent::Partial { ticket, .. }
            | MasterEvent::Modify { ticket, .. } => *ticket,
            MasterEvent::Snapshot
            | MasterEvent::OrderSet { .. }
            | MasterEvent::OrderGone { .. } => {
                return;
            }
        };
        let position = view.iter().find(|p| p.ticket == ticket).cloned();
        self.decide(
            link,
            seq,
            ticket,
            position.as_ref(),
            matches!(event, MasterEvent::Open { .. }),
        );
    }

    /// Decides one master ticket as the session does (`plan_ticket` against the copies it
    /// knows) and sends what it decided, an open only when `open_allowed`.
    fn decide(
        &mut self,
        link: &Link,
        seq: i64,
        ticket: i64,
        position: Option<&MasterPosition>,
        open_allowed: bool,
    ) {
        let specs = specs();
        let actions = plan_ticket(
            link,
            ticket,
            position,
            &self.index,
            &Situation {
                memory: &self.memory,
                funds: &Inputs::default(),
                specs: &specs,
                at: (1, seq),
                pending: Default::default(),
            },
        );
        self.send(link, actions, open_allowed);
    }

    /// A snapshot at `seq` instead of the event (a new owner's first publication, which the
    /// session takes as the events it stands for: each changed ticket decided from the copies
    /// it knows, an open only for a new position; as in production, it reconciles instead when
    /// a reconcile is owed or the snapshot is no newer than its view).
    fn on_snapshot(&mut self, link: &Link, seq: i64, snapshot: &[MasterPosition]) {
        if self.owed {
            self.reconcile(link, seq, snapshot);
            return;
        }
        let Some((have, view)) = &mut self.view else {
            self.reconcile(link, seq, snapshot);
            return;
        };
        if seq <= *have {
            self.reconcile(link, seq, snapshot);
            return;
        }
        let changed = changed_tickets(view, &[], snapshot, &[]);
        *view = snapshot.to_vec();
        *have = seq;
        for (ticket, is_open) in changed {
            let position = snapshot.iter().find(|p| p.ticket == ticket);
            self.decide(link, seq, ticket, position, is_open);
        }
    }

    fn hand_close(&mut self, master_ticket: i64) {
        let tickets: Vec<i64> = self
            .server
            .copy_of(master_ticket)
            .iter()
            .map(|p| p.ticket)
            .collect();
        for t in tickets {
            if let Some(c) = self.server.close_part(t, f64::MAX, ClosedBy::Manual) {
                self.stream.push_back(c);
            }
        }
        self.server.hand_closed.insert(master_ticket);
    }
}

#[derive(Debug, Clone)]
enum Op {
    Open { tenths: u32, buy: bool, stops: bool },
    Partial { pick: usize, quarter: u8 },
    Close { pick: usize },
    Modify { pick: usize, shift: u8 },
    HandClose { pick: usize },
}

#[derive(Debug, Clone, Copy)]
enum Delivery {
    Deliver,
    Drop,
    Repeat,
    /// Not the event but the master's whole snapshot after it (its new owner's first).
    Snapshot,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u32..=20, any::<bool>(), any::<bool>())
            .prop_map(|(tenths, buy, stops)| Op::Open { tenths, buy, stops }),
        2 => (any::<usize>(), 1u8..=3).prop_map(|(pick, quarter)| Op::Partial { pick, quarter }),
        2 => any::<usize>().prop_map(|pick| Op::Close { pick }),
        2 => (any::<usize>(), 0u8..4).prop_map(|(pick, shift)| Op::Modify { pick, shift }),
        1 => any::<usize>().prop_map(|pick| Op::HandClose { pick }),
    ]
}

fn delivery() -> impl Strategy<Value = Delivery> {
    prop_oneof![
        6 => Just(Delivery::Deliver),
        2 => Just(Delivery::Drop),
        1 => Just(Delivery::Repeat),
        1 => Just(Delivery::Snapshot),
    ]
}

fn link(lot: u8, reverse: bool, copy_sl_tp: bool) -> Link {
    Link {
        id: 7,
        master_id: 1,
        enabled: true,
        magic: 100_007,
        lot_mode: LotMode::Multiplier,
        lot_value: [1.0, 0.5, 0.33, 2.0, 0.1][lot as usize % 5],
        reverse,
        copy_sl_tp,
        symbol_map: HashMap::new(),
        copy_existing: true,
        created_at_ms: 0,
        protections: Default::default(),
    }
}

/// How the two followers' copies of the master's open positions differ, if they do. One
/// difference is by design: a copy made late, of a master position already partly closed, is
/// sized from what is left, and is skipped (a final decision) if that rounds below the symbol's
/// minimum, where a copy made in time was kept at the minimum while it was trimmed.
fn differ(a: &Follower, b: &Follower, link: &Link, master: &[MasterPosition]) -> Option<String> {
    for m in master {
        let (ca, cb) = (a.server.copy_of(m.ticket), b.server.copy_of(m.ticket));
        let late_below_minimum = a.memory.decided.contains(&(link.id, m.ticket))
            && m.volume * link.lot_value < 0.01 - 1e-9;
        if ca.is_empty() && cb.len() == 1 && late_below_minimum {
            continue;
        }
        if ca.len() != cb.len() {
            return Some(format!(
                "copies of {}: {} vs {}",
                m.ticket,
                ca.len(),
                cb.len()
            ));
        }
        if let (Some(x), Some(y)) = (ca.first(), cb.first()) {
            // A copy opened late is sized from the master's volume then; one opened in time and
            // trimmed since, from its original: the two may differ by one step.
            if x.side != y.side
                || (x.sl, x.tp) != (y.sl, y.tp)
                || (x.volume - y.volume).abs() > 0.01 + 1e-9
            {
                return Some(format!("copy of {}: {x:?} vs {y:?}", m.ticket));
            }
        }
    }
    None
}

/// Runs one history; returns (event path follower, reconcile-only follower, final snapshot).
/// Panics (naming the step) if the event path, having received every event so far in order,
/// differs from reconcile with perfect knowledge before any repair.
fn run(link: &Link, ops: &[(Op, Delivery, u8)]) -> (Follower, Follower, Vec<MasterPosition>) {
    let mut master: Vec<MasterPosition> = Vec::new();
    let mut next_ticket = 100;
    let mut seq = 0;
    let mut lossless = true;
    let mut a = Follower::default();
    let mut b = Follower::default();
    a.reconcile(link, seq, &master);
    b.reconcile(link, seq, &master);
    for (op, delivery, stream) in ops {
        let pick = |i: usize| (!master.is_empty()).then(|| i % master.len());
        let event = match op {
            Op::Open { tenths, buy, stops } => {
                next_ticket += 1;
                let volume = *tenths as f64 / 10.0;
                let position = MasterPosition {
                    ticket: next_ticket,
                    symbol: "EURUSD".into(),
                    side: if *buy { Side::Buy } else { Side::Sell },
                    volume,
                    open_volume: volume,
                    open_price: 1.1,
                    sl: stops.then_some(if *buy { 1.0 } else { 1.2 }),
                    tp: stops.then_some(if *buy { 1.2 } else { 1.0 }),
                    magic: 0,
                    first_seen_ms: Some(1),
                    first_seen_us: None,
                    open_time_ms: None,
                    contract_size: None,
                    broker_ticket: None,
                };
                master.push(position.clone());
                Some(MasterEvent::Open { position })
            }
            Op::Partial { pick: i, quarter } => pick(*i).and_then(|i| {
                let before = master[i].volume;
                let after = r2(before * (4 - *quarter) as f64 / 4.0);
                (after >= 0.01 && after < before).then(|| {
                    master[i].volume = after;
                    MasterEvent::Partial {
                        ticket: master[i].ticket,
                        before,
                        after,
                    }
                })
            }),
            Op::Close { pick: i } => pick(*i).map(|i| {
                let p = master.remove(i);
                MasterEvent::Close { ticket: p.ticket }
            }),
            Op::Modify { pick: i, shift } => pick(*i).map(|i| {
                let m = &mut master[i];
                let d = *shift as f64 / 100.0;
                let (sl, tp) = match m.side {
                    Side::Buy => (1.0 + d, 1.2 + d),
                    Side::Sell => (1.2 + d, 1.0 + d),
                };
                m.sl = Some(sl);
                m.tp = Some(tp);
                MasterEvent::Modify {
                    ticket: m.ticket,
                    sl: m.sl,
                    tp: m.tp,
                }
            }),
            Op::HandClose { pick: i } => {
                if let Some(i) = pick(*i) {
                    let t = master[i].ticket;
                    // Only where both followers hold the copy: the states stay comparable.
                    if !a.server.copy_of(t).is_empty() && !b.server.copy_of(t).is_empty() {
                        a.hand_close(t);
                        b.hand_close(t);
                    }
                }
                None
            }
        };
        let Some(event) = event else {
            continue;
        };
        seq += 1;
        match delivery {
            Delivery::Deliver => a.on_event(link, seq, &event, &master),
            Delivery::Drop => lossless = false,
            // The snapshot holds every change so far, those of events dropped before it too:
            // from here the event path must again be where perfect knowledge is.
            Delivery::Snapshot => {
                a.on_snapshot(link, seq, &master);
                lossless = true;
            }
            Delivery::Repeat => {
                a.on_event(link, seq, &event, &master);
                a.on_event(link, seq, &event, &master);
            }
        }
        a.drain_stream(*stream as usize);
        b.reconcile(link, seq, &master);
        // Every event so far arrived (in order, some twice): the event path alone must already
        // be where perfect knowledge is, before any repair.
        let in_order = lossless && !a.owed && a.view.as_ref().is_some_and(|(have, _)| *have == seq);
        if in_order && let Some(d) = differ(&a, &b, link, &master) {
            panic!("after event {seq} ({event:?}), every event delivered: {d}");
        }
    }
    // The background reconcile, then the settled state.
    a.reconcile(link, seq, &master);
    a.drain_stream(usize::MAX);
    b.drain_stream(usize::MAX);
    (a, b, master)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn the_event_path_and_reconcile_reach_the_same_follower_state(
        lot in 0u8..5,
        reverse in any::<bool>(),
        copy_sl_tp in any::<bool>(),
        ops in prop::collection::vec((op(), delivery(), 0u8..3), 1..40),
    ) {
        let link = link(lot, reverse, copy_sl_tp);
        let (a, b, master) = run(&link, &ops);
        for (name, f) in [("event path", &a), ("reconcile only", &b)] {
            for (t, n) in &f.server.opens {
                prop_assert!(*n <= 1, "{name}: master ticket {t} copied {n} times");
            }
            prop_assert!(f.server.reopened.is_empty(), "{name}: reopened {:?}", f.server.reopened);
        }
        prop_assert_eq!(differ(&a, &b, &link, &master), None);
        for m in &master {
            prop_assert!(a.server.copy_of(m.ticket).len() <= 1, "two copies of {}", m.ticket);
        }
        let open: HashSet<i64> = master.iter().map(|m| m.ticket).collect();
        for f in [&a, &b] {
            for p in &f.server.open {
                let t = parse_marker(&p.comment).expect("only copies on the follower");
                prop_assert!(open.contains(&t), "copy of closed master ticket {t} still open");
            }
        }
        // Settled: a further reconcile sends nothing.
        let specs = specs();
        let index = CopyIndex::from_read(&a.server.open, &a.server.history);
        let again = plan(&link, &master, &[], &index, &Situation {
            memory: &a.memory,
            funds: &Inputs::default(),
            specs: &specs,
            at: (1, 9_999),
            pending: Default::default(),
        });
        let sends: Vec<&Action> = again.iter().filter(|x| x.sends()).collect();
        prop_assert!(sends.is_empty(), "not settled: {sends:?}");
    }
}
