//! L3, judged independently of the product: what each follower should hold, computed here from
//! the broker's record of both accounts (open positions and history) and the link's settings as
//! the test configured them, with arithmetic written for this check alone. No function of the
//! product's decision code (rules, index, plan) is called, and nothing the product wrote or
//! logged is taken as a fact: not the master's snapshot, not the copy ledger, not `copy_bases`.
//!
//! The suite's links are plain (multiplier 1.0 or 0.5, reverse or not, stops copied, no
//! protections, links made before any trade) and nothing closes a copy by hand, so:
//!
//! * every open master position has exactly one open copy per link, on the link's side, with the
//!   master's stops (swapped when reversed), and a volume of its original volume scaled like the
//!   master's (never below 0.01);
//! * a copy opened with the link's multiple of a volume the master position had before the copy
//!   opened: its opening volume, or (a copy made late, after a partial close) what was left then,
//!   which its trims then scale against;
//! * no copy is open whose master position is closed;
//! * no copy was closed entirely while its master position was still open, unless another copy
//!   of the same master position was open then (an extra copy, closed by rule).

use std::collections::HashMap;

use copier_node::broker::types::{ClosedPosition, Position, Side};

/// What the oracle needs of one link.
#[derive(Debug, Clone)]
pub struct Expect {
    pub follower: String,
    pub magic: i64,
    pub lot_value: f64,
    pub reverse: bool,
}

/// One account as the broker shows it.
#[derive(Debug, Clone, Default)]
pub struct Account {
    pub open: Vec<Position>,
    pub history: Vec<ClosedPosition>,
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn ticket_of(comment: &str) -> Option<i64> {
    comment.strip_prefix("mc")?.parse().ok()
}

fn original(ticket: i64, open: f64, history: &[ClosedPosition]) -> f64 {
    round2(
        open + history
            .iter()
            .filter(|h| h.position.ticket == ticket)
            .map(|h| h.position.volume)
            .sum::<f64>(),
    )
}

fn close_enough(a: Option<f64>, b: Option<f64>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(x), Some(y)) => (x - y).abs() < 1e-6,
        _ => false,
    }
}

/// The volumes master position `ticket` held before `until_ms` (broker clock): what it opened
/// with, and what was left after each partial close since, from the broker's history.
fn levels(ticket: i64, original: f64, history: &[ClosedPosition], until_ms: i64) -> Vec<f64> {
    let mut closes: Vec<&ClosedPosition> = history
        .iter()
        .filter(|h| h.position.ticket == ticket)
        .collect();
    closes.sort_by_key(|h| h.close_time_ms);
    let mut left = original;
    let mut out = vec![original];
    for h in closes.into_iter().filter(|h| h.close_time_ms <= until_ms) {
        left = round2(left - h.position.volume);
        if left > 1e-9 {
            out.push(left);
        }
    }
    out
}

/// Everything the follower still owes under `link`. Empty when converged.
pub fn owed(link: &Expect, master: &Account, follower: &Account) -> Vec<String> {
    let mut out = Vec::new();
    let who = &link.follower;
    let mut copies: HashMap<i64, Vec<&Position>> = HashMap::new();
    for p in follower.open.iter().filter(|p| p.magic == link.magic) {
        if let Some(t) = ticket_of(&p.comment) {
            copies.entry(t).or_default().push(p);
        }
    }
    for m in &master.open {
        let list = copies.remove(&m.ticket).unwrap_or_default();
        let [copy] = list.as_slice() else {
            out.push(format!(
                "{who}: master ticket {} has {} open copies, wants 1",
                m.ticket,
                list.len()
            ));
            continue;
        };
        let side = if link.reverse {
            match m.side {
                Side::Buy => Side::Sell,
                Side::Sell => Side::Buy,
            }
        } else {
            m.side
        };
        if copy.side != side {
            out.push(format!(
                "{who}: copy {} is {:?}, wants {side:?}",
                copy.ticket, copy.side
            ));
        }
        let (sl, tp) = if link.reverse {
            (m.tp, m.sl)
        } else {
            (m.sl, m.tp)
        };
        if !close_enough(copy.sl, sl) || !close_enough(copy.tp, tp) {
            out.push(format!(
                "{who}: copy {} stops {:?}/{:?}, wants {sl:?}/{tp:?}",
                copy.ticket, copy.sl, copy.tp
            ));
        }
        let master_original = original(m.ticket, m.volume, &master.history);
        let copy_original = original(copy.ticket, copy.volume, &follower.history);
        // The master volumes the copy may have been sized from: those the position held before
        // the copy opened (a copy made late sizes from what is left, and scales against it).
        let bases: Vec<f64> = levels(
            m.ticket,
            master_original,
            &master.history,
            copy.open_time_ms,
        )
        .into_iter()
        .filter(|base| (copy_original - base * link.lot_value).abs() <= 0.005 + 1e-6)
        .collect();
        if bases.is_empty() {
            out.push(format!(
                "{who}: copy {} opened at {copy_original} lots, wants {} x a volume master ticket {} held before it opened ({master_original} at first)",
                copy.ticket, link.lot_value, m.ticket
            ));
            continue;
        }
        // The exact scaled volume; the copy holds it rounded to the 0.01 step, either way at a
        // tie (0.185 may be 0.18 or 0.19).
        let want = |base: f64| (copy_original * m.volume / base).clamp(0.01, copy_original);
        if !bases
            .iter()
            .any(|b| (copy.volume - want(*b)).abs() <= 0.005 + 1e-6)
        {
            out.push(format!(
                "{who}: copy {} holds {} lots, wants {} ({copy_original} scaled by the master's {} of {})",
                copy.ticket,
                copy.volume,
                want(bases[0]),
                m.volume,
                bases[0]
            ));
        }
    }
    for (t, list) in copies {
        for c in list {
            out.push(format!(
                "{who}: copy {} of master ticket {t} is open, the master position is closed",
                c.ticket
            ));
        }
    }
    out.extend(closed_while_master_open(link, master, follower));
    out
}

/// Copies closed entirely while their master position was open, with no other copy of it open
/// at that moment.
pub fn closed_while_master_open(
    link: &Expect,
    master: &Account,
    follower: &Account,
) -> Vec<String> {
    let master_closed_at: HashMap<i64, i64> = master
        .history
        .iter()
        .filter(|h| h.remaining_volume <= 1e-9)
        .map(|h| (h.position.ticket, h.close_time_ms))
        .collect();
    let master_open: std::collections::HashSet<i64> =
        master.open.iter().map(|p| p.ticket).collect();
    // Every copy ticket ever held per master ticket, with its open and close times.
    let mut spans: HashMap<i64, Vec<(i64, i64, i64)>> = HashMap::new();
    let closed_at: HashMap<i64, i64> = follower
        .history
        .iter()
        .filter(|h| h.remaining_volume <= 1e-9)
        .map(|h| (h.position.ticket, h.close_time_ms))
        .collect();
    let all = follower
        .open
        .iter()
        .chain(follower.history.iter().map(|h| &h.position))
        .filter(|p| p.magic == link.magic);
    let mut seen = std::collections::HashSet::new();
    for p in all {
        if let Some(t) = ticket_of(&p.comment)
            && seen.insert(p.ticket)
        {
            let end = closed_at.get(&p.ticket).copied().unwrap_or(i64::MAX);
            spans
                .entry(t)
                .or_default()
                .push((p.ticket, p.open_time_ms, end));
        }
    }
    let mut out = Vec::new();
    for (t, list) in &spans {
        let master_end = if master_open.contains(t) {
            i64::MAX
        } else {
            match master_closed_at.get(t) {
                Some(at) => *at,
                None => continue, // not the master's (another link's marker space)
            }
        };
        for (ticket, _, end) in list {
            if *end == i64::MAX || *end >= master_end {
                continue;
            }
            let other_open = list
                .iter()
                .any(|(o, start, stop)| o != ticket && *start <= *end && *stop >= *end);
            if !other_open {
                out.push(format!(
                    "{}: copy {ticket} of master ticket {t} was closed at {end} ms while the master position was open (until {})",
                    link.follower,
                    if master_end == i64::MAX { "now".to_string() } else { format!("{master_end} ms") }
                ));
            }
        }
    }
    out
}

/// An MT4 server's record of an account as a server that keeps its tickets would show it. MT4
/// closes a partially closed ticket whole (its history entry: the part closed, comment
/// `to #<new>`) and opens the rest under a new ticket (comment `from #<old>`). Here every ticket
/// of such a lineage becomes its first one, with that one's comment as it was opened (from the
/// broker's journal: `opened`, ticket -> comment), and each `to #` entry a partial close whose
/// `remaining_volume` is what the lineage held after it. Worked out from the broker's records
/// alone, for the oracle above.
pub fn as_tickets_kept(account: &Account, opened: &HashMap<i64, String>) -> Account {
    let lineage = |comment: &str, prefix: &str| -> Option<i64> {
        comment.strip_prefix(prefix)?.trim().parse().ok()
    };
    // Old ticket -> the ticket its rest went on under, and back.
    let next: HashMap<i64, i64> = account
        .history
        .iter()
        .filter_map(|h| Some((h.position.ticket, lineage(&h.position.comment, "to #")?)))
        .collect();
    let prev: HashMap<i64, i64> = next.iter().map(|(a, b)| (*b, *a)).collect();
    let first = |mut t: i64| {
        let mut seen = std::collections::HashSet::new();
        while let Some(&p) = prev.get(&t) {
            if !seen.insert(t) {
                break;
            }
            t = p;
        }
        t
    };
    // What a ticket of a lineage held when it opened: its own open volume and closes, and its
    // rest's, down the chain.
    let held = |t: i64| -> f64 {
        let mut total = 0.0;
        let mut cur = Some(t);
        let mut seen = std::collections::HashSet::new();
        while let Some(c) = cur.filter(|c| seen.insert(*c)) {
            total += account
                .open
                .iter()
                .filter(|p| p.ticket == c)
                .map(|p| p.volume)
                .sum::<f64>();
            total += account
                .history
                .iter()
                .filter(|h| h.position.ticket == c)
                .map(|h| h.position.volume)
                .sum::<f64>();
            cur = next.get(&c).copied();
        }
        round2(total)
    };
    let renamed = |p: &Position| -> Position {
        let root = first(p.ticket);
        if root == p.ticket {
            return p.clone();
        }
        Position {
            ticket: root,
            comment: opened.get(&root).cloned().unwrap_or_default(),
            ..p.clone()
        }
    };
    let open = account.open.iter().map(renamed).collect();
    let history = account
        .history
        .iter()
        .map(|h| {
            let root = first(h.position.ticket);
            let mut position = renamed(&h.position);
            let remaining_volume = match next.get(&h.position.ticket) {
                Some(&rest) => held(rest),
                None => h.remaining_volume,
            };
            // Every entry carries its first ticket's comment as opened: MT4 rewrites a closed
            // part's to `to #`, and a stop's close to `[sl]` / `[tp]`.
            if let Some(comment) = opened.get(&root) {
                position.comment = comment.clone();
            }
            ClosedPosition {
                position,
                remaining_volume,
                ..h.clone()
            }
        })
        .collect();
    Account { open, history }
}

#[cfg(test)]
mod tests {
    use super::*;
    use copier_node::broker::types::ClosedBy;

    fn pos(ticket: i64, comment: &str, side: Side, volume: f64, open_ms: i64) -> Position {
        Position {
            ticket,
            symbol: "EURUSD".into(),
            side,
            volume,
            open_price: 1.1,
            sl: None,
            tp: None,
            magic: if comment.is_empty() { 0 } else { 500 },
            comment: comment.into(),
            open_time_ms: open_ms,
        }
    }

    fn closed(p: &Position, volume: f64, remaining: f64, at: i64) -> ClosedPosition {
        ClosedPosition {
            position: Position {
                volume,
                ..p.clone()
            },
            close_price: 1.1,
            close_time_ms: at,
            closed_by: ClosedBy::Client,
            remaining_volume: remaining,
            profit: 0.0,
        }
    }

    fn link() -> Expect {
        Expect {
            follower: "f".into(),
            magic: 500,
            lot_value: 0.5,
            reverse: true,
        }
    }

    #[test]
    fn a_matching_follower_owes_nothing() {
        let m = pos(10, "", Side::Buy, 0.6, 0);
        let master = Account {
            open: vec![m.clone()],
            history: vec![closed(&m, 0.4, 0.6, 5)],
        };
        // Copied at 0.5 of 1.0, trimmed to 0.3 after the master closed 0.4.
        let c = pos(90, "mc10", Side::Sell, 0.3, 1);
        let follower = Account {
            open: vec![c.clone()],
            history: vec![closed(&c, 0.2, 0.3, 6)],
        };
        assert_eq!(owed(&link(), &master, &follower), Vec::<String>::new());
    }

    #[test]
    fn a_copy_made_late_is_sized_from_what_was_left_and_scales_against_it() {
        // The master opened 1.0, closed 0.4 before the copy (0.5 of what was left: 0.3) opened,
        // then 0.3 more: 0.3 left, so the copy holds 0.15.
        let m = pos(10, "", Side::Buy, 0.3, 0);
        let master = Account {
            open: vec![m.clone()],
            history: vec![closed(&m, 0.4, 0.6, 5), closed(&m, 0.3, 0.3, 20)],
        };
        let c = pos(90, "mc10", Side::Sell, 0.15, 10);
        let follower = Account {
            open: vec![c.clone()],
            history: vec![closed(&c, 0.15, 0.15, 21)],
        };
        assert_eq!(owed(&link(), &master, &follower), Vec::<String>::new());
        // Sized from a volume the master never held before the copy: owed.
        let wrong = pos(90, "mc10", Side::Sell, 0.2, 10);
        let follower = Account {
            open: vec![wrong],
            history: vec![],
        };
        let text = owed(&link(), &master, &follower).join("\n");
        assert!(text.contains("opened at 0.2 lots"), "{text}");
    }

    #[test]
    fn wrong_side_size_missing_extra_and_orphan_copies_are_owed() {
        let master = Account {
            open: vec![
                pos(10, "", Side::Buy, 1.0, 0),
                pos(11, "", Side::Buy, 1.0, 0),
            ],
            history: vec![],
        };
        let follower = Account {
            open: vec![
                pos(90, "mc10", Side::Buy, 0.4, 1),
                pos(91, "mc12", Side::Sell, 0.5, 1),
            ],
            history: vec![],
        };
        let text = owed(&link(), &master, &follower).join("\n");
        for want in [
            "copy 90 is Buy, wants Sell",
            "copy 90 opened at 0.4 lots, wants 0.5 x a volume",
            "master ticket 11 has 0 open copies",
            "copy 91 of master ticket 12 is open",
        ] {
            assert!(text.contains(want), "{want}: {text}");
        }
    }

    #[test]
    fn a_copy_closed_while_its_master_was_open_is_flagged_unless_it_was_an_extra() {
        let m = pos(10, "", Side::Buy, 1.0, 0);
        let master = Account {
            open: vec![],
            history: vec![closed(&m, 1.0, 0.0, 100)],
        };
        let early = pos(90, "mc10", Side::Sell, 0.5, 1);
        let follower = Account {
            open: vec![],
            history: vec![closed(&early, 0.5, 0.0, 50)],
        };
        let flagged = closed_while_master_open(&link(), &master, &follower);
        assert_eq!(flagged.len(), 1, "{flagged:?}");
        // An extra copy closed while the first one stayed open is a rule's close.
        let keeper = pos(89, "mc10", Side::Sell, 0.5, 1);
        let follower = Account {
            open: vec![],
            history: vec![closed(&early, 0.5, 0.0, 50), closed(&keeper, 0.5, 0.0, 101)],
        };
        assert!(closed_while_master_open(&link(), &master, &follower).is_empty());
    }

    /// A copy opened at 1.0 (`mc7`), 0.4 closed (renumbered 10 -> 11), then 0.3 (11 -> 12),
    /// 0.3 left open: as a ticket-keeping server shows it, ticket 10 throughout, two partial
    /// closes leaving 0.6 and 0.3, the marker back on every entry.
    #[test]
    fn an_mt4_lineage_reads_as_one_ticket_with_partial_closes() {
        let part = |ticket: i64, volume: f64, to: i64, at: i64| ClosedPosition {
            position: Position {
                ticket,
                symbol: "EURUSD".into(),
                side: Side::Buy,
                volume,
                open_price: 1.1,
                sl: None,
                tp: None,
                magic: 5,
                comment: format!("to #{to}"),
                open_time_ms: 1,
            },
            close_price: 1.1,
            close_time_ms: at,
            closed_by: ClosedBy::Client,
            remaining_volume: 0.0,
            profit: 0.0,
        };
        let mut rest = part(12, 0.3, 0, 0).position;
        rest.comment = "from #11".into();
        let account = Account {
            open: vec![rest],
            history: vec![part(10, 0.4, 11, 100), part(11, 0.3, 12, 200)],
        };
        let opened: HashMap<i64, String> = [(10, "mc7".to_string())].into();
        let kept = as_tickets_kept(&account, &opened);
        assert_eq!(
            kept.open
                .iter()
                .map(|p| (p.ticket, p.comment.as_str(), p.volume))
                .collect::<Vec<_>>(),
            vec![(10, "mc7", 0.3)]
        );
        assert_eq!(
            kept.history
                .iter()
                .map(|h| (
                    h.position.ticket,
                    h.position.comment.as_str(),
                    h.remaining_volume
                ))
                .collect::<Vec<_>>(),
            vec![(10, "mc7", 0.6), (10, "mc7", 0.3)]
        );
        // A ticket-keeping record is left as it is.
        let plain = Account {
            open: kept.open.clone(),
            history: Vec::new(),
        };
        assert_eq!(as_tickets_kept(&plain, &opened).open, plain.open);
    }
}
