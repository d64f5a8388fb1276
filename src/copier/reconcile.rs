//! Reconcile (SPEC R2), as a pure plan: compare a master's snapshot with the follower's open
//! positions and history, by marker, and say what to send.
//!
//! * a master position with no copy, whose copy never existed on the follower: open one (if the
//!   link's rules copy it);
//! * a copy the follower closed itself (by hand, a stop, the broker): not owed, never reopened;
//! * a copy whose master position is gone: close it;
//! * a copy larger than the master's partial closes allow: trim it;
//! * stops that differ from the master's (under the link's rules): modify them;
//! * two open copies of one master position (which nothing should produce): close the extra.
//!
//! Executing the plan and planning again yields nothing to send: reconcile is idempotent.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::broker::types::{ClosedPosition, OpenOrder, Position, SymbolSpec};

use super::rules::{Inputs, Link, follower_stops, open_order, round_to_step, trimmed_volume};
use super::{MasterPosition, parse_marker};

/// One thing a reconcile sends (or decides not to).
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// `base` is set for a late copy (opened after the master closed part of its position):
    /// the master volume it was sized for, which later trims scale against (recorded in
    /// `copy_bases`, since the copy itself cannot carry it).
    Open {
        master_ticket: i64,
        order: OpenOrder,
        base: Option<f64>,
    },
    Close {
        master_ticket: i64,
        ticket: i64,
        reason: &'static str,
    },
    Trim {
        master_ticket: i64,
        ticket: i64,
        close_volume: f64,
        target: f64,
    },
    Modify {
        master_ticket: i64,
        ticket: i64,
        sl: Option<f64>,
        tp: Option<f64>,
    },
    Skip {
        master_ticket: i64,
        reason: String,
    },
}

impl Action {
    /// True for actions that send an order.
    pub fn sends(&self) -> bool {
        !matches!(self, Action::Skip { .. })
    }
}

/// The follower's open copies of `link`, by master ticket, oldest first.
pub fn copies<'a>(link: &Link, open: &'a [Position]) -> BTreeMap<i64, Vec<&'a Position>> {
    let mut out: BTreeMap<i64, Vec<&Position>> = BTreeMap::new();
    for p in open.iter().filter(|p| p.magic == link.magic) {
        if let Some(t) = parse_marker(&p.comment) {
            out.entry(t).or_default().push(p);
        }
    }
    for list in out.values_mut() {
        list.sort_by_key(|p| p.ticket);
    }
    out
}

/// Master tickets the follower ever held a copy of under `link`, from its history.
pub fn ever_copied(link: &Link, history: &[ClosedPosition]) -> HashSet<i64> {
    history
        .iter()
        .filter(|h| h.position.magic == link.magic)
        .filter_map(|h| parse_marker(&h.position.comment))
        .collect()
}

/// A copy's volume when it was opened: what is open plus everything closed of it.
pub fn original_volume(copy: &Position, history: &[ClosedPosition]) -> f64 {
    let closed: f64 = history
        .iter()
        .filter(|h| h.position.ticket == copy.ticket)
        .map(|h| h.position.volume)
        .sum();
    round_to_step(copy.volume + closed, 0.01)
}

fn same(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => (x - y).abs() < 1e-9,
        _ => false,
    }
}

/// What the follower knows besides its broker's reads.
#[derive(Debug, Default, Clone)]
pub struct Memory {
    /// Copy tickets of late copies -> the master volume they were sized for (other copies scale
    /// against the master's open volume).
    pub bases: HashMap<i64, f64>,
    /// Master tickets this session has already seen a copy of, per link magic: a broker read
    /// that comes back empty or partial (a glitch) must not make a copy look never-opened.
    pub copied: HashSet<(i64, i64)>,
}

/// What `link` owes its master's `snapshot` on this follower.
pub fn plan(
    link: &Link,
    snapshot: &[MasterPosition],
    open: &[Position],
    history: &[ClosedPosition],
    memory: &Memory,
    funds: &Inputs,
    specs: &HashMap<String, SymbolSpec>,
) -> Vec<Action> {
    let mut actions = Vec::new();
    let mut copies = copies(link, open);
    let mut ever = ever_copied(link, history);
    ever.extend(
        memory
            .copied
            .iter()
            .filter(|(magic, _)| *magic == link.magic)
            .map(|(_, t)| *t),
    );
    let bases = &memory.bases;
    let mut masters: Vec<&MasterPosition> = snapshot.iter().collect();
    masters.sort_by_key(|m| m.ticket);
    for m in masters {
        match copies.remove(&m.ticket) {
            Some(list) => {
                let (copy, extra) = list.split_first().expect("groups are never empty");
                for dup in extra {
                    actions.push(Action::Close {
                        master_ticket: m.ticket,
                        ticket: dup.ticket,
                        reason: "duplicate copy",
                    });
                }
                if let Some(spec) = specs.get(&copy.symbol) {
                    let base = bases.get(&copy.ticket).copied().unwrap_or(m.open_volume);
                    let target =
                        trimmed_volume(original_volume(copy, history), base, m.volume, spec);
                    let excess = round_to_step(copy.volume - target, spec.volume_step);
                    if excess + 1e-9 >= spec.volume_step {
                        actions.push(Action::Trim {
                            master_ticket: m.ticket,
                            ticket: copy.ticket,
                            close_volume: excess,
                            target,
                        });
                    }
                }
                if link.copy_sl_tp {
                    let (sl, tp) = follower_stops(link, m.sl, m.tp);
                    if !same(sl, copy.sl) || !same(tp, copy.tp) {
                        actions.push(Action::Modify {
                            master_ticket: m.ticket,
                            ticket: copy.ticket,
                            sl,
                            tp,
                        });
                    }
                }
            }
            None if ever.contains(&m.ticket) => {
                // The follower held a copy and closed it (by hand, a stop, the broker): not owed.
            }
            None => match open_order(link, m, funds, specs) {
                Ok(order) => {
                    let base = (m.volume + 1e-9 < m.open_volume).then_some(m.volume);
                    actions.push(Action::Open {
                        master_ticket: m.ticket,
                        order,
                        base,
                    });
                }
                Err(reason) => actions.push(Action::Skip {
                    master_ticket: m.ticket,
                    reason,
                }),
            },
        }
    }
    for (master_ticket, list) in copies {
        for copy in list {
            actions.push(Action::Close {
                master_ticket,
                ticket: copy.ticket,
                reason: "master position closed",
            });
        }
    }
    actions
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::types::{ClosedBy, Side};
    use crate::copier::marker;
    use crate::copier::rules::LotMode;

    fn link() -> Link {
        Link {
            id: 7,
            master_id: 1,
            enabled: true,
            magic: 100_007,
            lot_mode: LotMode::Multiplier,
            lot_value: 0.5,
            reverse: false,
            copy_sl_tp: true,
            symbol_map: HashMap::new(),
            copy_existing: false,
            created_at_ms: 1_000,
            protections: Default::default(),
        }
    }

    fn specs() -> HashMap<String, SymbolSpec> {
        ["EURUSD", "GBPUSD"]
            .iter()
            .map(|s| {
                (
                    s.to_string(),
                    SymbolSpec {
                        symbol: s.to_string(),
                        price: 1.1,
                        volume_step: 0.01,
                        volume_min: 0.01,
                        volume_max: 100.0,
                        contract_size: 100_000.0,
                    },
                )
            })
            .collect()
    }

    fn master(ticket: i64, volume: f64, open_volume: f64) -> MasterPosition {
        MasterPosition {
            ticket,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume,
            open_volume,
            open_price: 1.1,
            sl: Some(1.0),
            tp: None,
            magic: 0,
            first_seen_ms: Some(2_000),
        }
    }

    fn copy(ticket: i64, master_ticket: i64, volume: f64) -> Position {
        Position {
            ticket,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume,
            open_price: 1.1,
            sl: Some(1.0),
            tp: None,
            magic: 100_007,
            comment: marker(master_ticket),
            open_time_ms: 0,
        }
    }

    fn closed(p: &Position, volume: f64, remaining: f64) -> ClosedPosition {
        ClosedPosition {
            position: Position {
                volume,
                ..p.clone()
            },
            close_price: 1.1,
            close_time_ms: 0,
            closed_by: ClosedBy::Manual,
            remaining_volume: remaining,
            profit: 0.0,
        }
    }

    /// A follower that executes plans like a broker would.
    #[derive(Default)]
    struct Follower {
        open: Vec<Position>,
        history: Vec<ClosedPosition>,
        memory: Memory,
        next: i64,
    }

    impl Follower {
        fn execute(&mut self, actions: &[Action]) {
            for a in actions {
                match a {
                    Action::Open { order, base, .. } => {
                        self.next += 1;
                        if let Some(b) = base {
                            self.memory.bases.insert(900 + self.next, *b);
                        }
                        self.open.push(Position {
                            ticket: 900 + self.next,
                            symbol: order.symbol.clone(),
                            side: order.side,
                            volume: order.volume,
                            open_price: 1.1,
                            sl: order.sl,
                            tp: order.tp,
                            magic: order.magic,
                            comment: order.comment.clone(),
                            open_time_ms: 0,
                        });
                    }
                    Action::Close { ticket, .. } => {
                        let i = self.open.iter().position(|p| p.ticket == *ticket).unwrap();
                        let p = self.open.remove(i);
                        self.history.push(closed(&p, p.volume, 0.0));
                    }
                    Action::Trim {
                        ticket,
                        close_volume,
                        ..
                    } => {
                        let p = self.open.iter_mut().find(|p| p.ticket == *ticket).unwrap();
                        p.volume = round_to_step(p.volume - close_volume, 0.01);
                        let snapshot = p.clone();
                        self.history
                            .push(closed(&snapshot, *close_volume, snapshot.volume));
                    }
                    Action::Modify { ticket, sl, tp, .. } => {
                        let p = self.open.iter_mut().find(|p| p.ticket == *ticket).unwrap();
                        p.sl = *sl;
                        p.tp = *tp;
                    }
                    Action::Skip { .. } => {}
                }
            }
        }
    }

    fn run(f: &Follower, snapshot: &[MasterPosition]) -> Vec<Action> {
        plan(
            &link(),
            snapshot,
            &f.open,
            &f.history,
            &f.memory,
            &Inputs::default(),
            &specs(),
        )
    }

    #[test]
    fn opens_missing_copies_and_closes_orphans() {
        let f = Follower {
            open: vec![copy(1, 99, 0.5)],
            ..Default::default()
        };
        let actions = run(&f, &[master(10, 1.0, 1.0)]);
        assert!(
            matches!(&actions[0], Action::Open { master_ticket: 10, order, base: None } if order.volume == 0.5 && order.comment == "mc10")
        );
        assert_eq!(
            actions[1],
            Action::Close {
                master_ticket: 99,
                ticket: 1,
                reason: "master position closed"
            }
        );
        assert_eq!(actions.len(), 2);
    }

    #[test]
    fn a_copy_the_follower_closed_is_not_reopened() {
        let c = copy(1, 10, 0.5);
        let f = Follower {
            history: vec![closed(&c, 0.5, 0.0)],
            ..Default::default()
        };
        assert!(run(&f, &[master(10, 1.0, 1.0)]).is_empty());
    }

    #[test]
    fn partial_closes_trim_and_stops_follow() {
        let f = Follower {
            open: vec![Position {
                sl: None,
                ..copy(1, 10, 0.5)
            }],
            ..Default::default()
        };
        let actions = run(&f, &[master(10, 0.4, 1.0)]);
        assert_eq!(
            actions[0],
            Action::Trim {
                master_ticket: 10,
                ticket: 1,
                close_volume: 0.3,
                target: 0.2
            }
        );
        assert_eq!(
            actions[1],
            Action::Modify {
                master_ticket: 10,
                ticket: 1,
                sl: Some(1.0),
                tp: None
            }
        );
    }

    #[test]
    fn a_trim_counts_what_was_already_closed() {
        // The copy was 0.5, 0.3 of it already trimmed: at 0.2 it matches a master at 0.4 of 1.0.
        let c = copy(1, 10, 0.2);
        let f = Follower {
            open: vec![c.clone()],
            history: vec![closed(&c, 0.3, 0.2)],
            ..Default::default()
        };
        assert!(run(&f, &[master(10, 0.4, 1.0)]).is_empty());
    }

    #[test]
    fn a_late_copy_trims_against_the_volume_it_was_sized_for() {
        // Opened when the master was already down to 0.6 of 1.0: sized 0.3 for 0.6.
        let mut f = Follower::default();
        let first = run(&f, &[master(10, 0.6, 1.0)]);
        assert!(
            matches!(&first[0], Action::Open { order, base: Some(b), .. } if order.volume == 0.3 && *b == 0.6)
        );
        f.execute(&first);
        assert!(
            run(&f, &[master(10, 0.6, 1.0)]).is_empty(),
            "no trim while the master stays at 0.6"
        );
        assert!(
            matches!(&run(&f, &[master(10, 0.3, 1.0)])[0], Action::Trim { close_volume, target, .. } if *close_volume == 0.15 && *target == 0.15)
        );
    }

    #[test]
    fn a_copy_remembered_by_the_session_is_not_reopened_after_an_empty_read() {
        let mut f = Follower::default();
        f.memory.copied.insert((100_007, 10));
        assert!(
            run(&f, &[master(10, 1.0, 1.0)]).is_empty(),
            "an empty read is not proof the copy never existed"
        );
        f.memory.copied = [(555, 10)].into();
        assert_eq!(
            run(&f, &[master(10, 1.0, 1.0)]).len(),
            1,
            "memory is per link"
        );
    }

    #[test]
    fn an_extra_copy_is_closed() {
        let f = Follower {
            open: vec![copy(1, 10, 0.5), copy(2, 10, 0.5)],
            ..Default::default()
        };
        assert_eq!(
            run(&f, &[master(10, 1.0, 1.0)]),
            vec![Action::Close {
                master_ticket: 10,
                ticket: 2,
                reason: "duplicate copy"
            }]
        );
    }

    #[test]
    fn other_links_and_hand_trades_are_left_alone() {
        let mut foreign = copy(1, 10, 0.5);
        foreign.magic = 555;
        let hand = Position {
            magic: 0,
            comment: "my own".into(),
            ..copy(2, 0, 1.0)
        };
        let f = Follower {
            open: vec![foreign, hand],
            ..Default::default()
        };
        let actions = run(&f, &[]);
        assert!(actions.is_empty(), "{actions:?}");
    }

    #[test]
    fn reconcile_is_idempotent() {
        let snapshots = [
            vec![
                master(10, 1.0, 1.0),
                master(11, 0.3, 0.6),
                MasterPosition {
                    symbol: "GBPUSD".into(),
                    ..master(12, 2.0, 2.0)
                },
            ],
            vec![master(11, 0.2, 0.6), master(13, 0.02, 0.02)],
            vec![],
        ];
        let mut f = Follower {
            open: vec![copy(1, 99, 0.1)],
            ..Default::default()
        };
        for snap in &snapshots {
            let first = run(&f, snap);
            assert!(first.iter().any(Action::sends), "{first:?}");
            f.execute(&first);
            let second: Vec<Action> = run(&f, snap).into_iter().filter(Action::sends).collect();
            assert!(second.is_empty(), "second reconcile sends {second:?}");
        }
    }

    #[test]
    fn disabled_links_only_close() {
        let l = Link {
            enabled: false,
            ..link()
        };
        let f = Follower {
            open: vec![copy(1, 99, 0.5)],
            ..Default::default()
        };
        let actions = plan(
            &l,
            &[master(10, 1.0, 1.0)],
            &f.open,
            &f.history,
            &f.memory,
            &Inputs::default(),
            &specs(),
        );
        assert!(
            matches!(&actions[0], Action::Skip { master_ticket: 10, reason } if reason.contains("close-only"))
        );
        assert!(matches!(
            &actions[1],
            Action::Close {
                master_ticket: 99,
                ..
            }
        ));
    }
}
