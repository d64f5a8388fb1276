//! The follower's copies by marker: the one index both the event path and reconcile decide from.
//!
//! Built from a broker read (open positions and history), then kept current by the broker's
//! position stream and by the replies to the follower's own orders, in either order: the bridge
//! protocol lets a server send a reply before or after the stream update it caused. So every
//! update is idempotent and monotone: a copy's volume only ever falls (a hedging position keeps
//! its ticket through partial closes and never grows), a closed ticket stays closed, and the set
//! of master tickets ever copied only grows (a broker read that comes back empty or partial
//! must not make a copy look never-opened). Stops have no such order (they move both ways), so
//! they are learned only from broker reads and from the replies to the follower's own stop
//! changes, never from the stream: a late stream update would put back stops a reply had already
//! replaced, and the next change back to them would look done (found by the property test). A stop
//! changed on the follower by someone else is seen at the next reconcile's read, which sets the
//! master's stops again anyway.
//!
//! MT4 renumbers: a partial close ends the copy's ticket (its history entry's comment becomes
//! `to #<new>`) and opens the remainder under a new ticket whose comment is `from #<old>` (the
//! magic kept), and a stop close may rewrite the history's comment too. A bridge should hide
//! this, but a naive one does not, so the index follows the lineage itself: every copy ticket it
//! learns (by a marker, from the copy ledger, or as a remainder) keeps its key, and a position
//! `from #N` with the copy's magic, or the ticket a known copy's history entry names `to #M`, is
//! that copy's remainder: the same copy, its opening volume the lineage's.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::broker::types::{ClosedPosition, OrderEnd, PendingOrder, Position, PositionChange};

use super::parse_marker;

/// A copy: (link magic, master ticket).
pub type Key = (i64, i64);

#[derive(Debug, Default, Clone)]
pub struct CopyIndex {
    /// Open copies by key, oldest ticket first (two means a duplicate, which reconcile closes).
    open: BTreeMap<Key, Vec<Position>>,
    /// Every key the follower ever held a copy for (open or closed).
    ever: HashSet<Key>,
    /// Copy ticket -> its volume when it was opened (partial closes scale against it).
    original: HashMap<i64, f64>,
    /// Copy ticket -> the volume the copy ledger recorded it opened with: a floor for its opening
    /// volume (an MT4 remainder's, its lineage's largest) that holds however little history the
    /// broker keeps.
    recorded: HashMap<i64, f64>,
    /// Copy tickets seen closed: a late update about one changes nothing.
    closed: HashSet<i64>,
    /// Pending copies (a master's pending order copied as one) by key.
    orders: BTreeMap<Key, Vec<PendingOrder>>,
    /// Every key a pending copy was ever placed for (read, placed, or in the ledger of order
    /// copies): a pending copy that is gone is never placed again.
    placed: HashSet<Key>,
    /// Pending-copy tickets seen gone: a late update about one changes nothing.
    gone: HashSet<i64>,
    /// Every pending-copy ticket seen, with its key: a late `order_gone` (after a read already
    /// dropped the order) still tells how that copy ended.
    order_keys: HashMap<i64, Key>,
    /// Keys whose pending copy is known to have left the book without a fill (cancel confirmed,
    /// the broker's `order_gone`, a refusal, or the ledger of order copies says so): only then
    /// is a copy at market made for a key a pending copy was placed for.
    ended: HashSet<Key>,
    /// Every copy ticket learned, with its key (by its marker, from the copy ledger, or as an
    /// MT4 remainder): kept across reads, as the history may no longer show a marker.
    keys: HashMap<i64, Key>,
    /// MT4 lineage: a remainder's ticket -> the ticket it was split from.
    parent: HashMap<i64, i64>,
    /// A copy ticket learned since the last [`CopyIndex::take_learned`].
    learned: bool,
    /// Keys whose pending copy is in doubt (a place or cancel whose outcome is unknown, a cancel
    /// of an order the broker no longer holds): nothing is decided for them until the next read
    /// of the follower's orders, positions and history, in that order.
    doubt: HashSet<Key>,
}

impl CopyIndex {
    /// An index from a broker read.
    pub fn from_read(open: &[Position], history: &[ClosedPosition]) -> Self {
        let mut index = CopyIndex::default();
        index.rebuild(open, history);
        index
    }

    /// Replaces what is open with a fresh broker read. What was ever copied is kept.
    pub fn rebuild(&mut self, open: &[Position], history: &[ClosedPosition]) {
        self.open.clear();
        self.closed.clear();
        let mut closed_volume: HashMap<i64, f64> = HashMap::new();
        for h in history {
            if let Some(t) = parse_marker(&h.position.comment) {
                self.ever.insert((h.position.magic, t));
                self.learn(h.position.ticket, (h.position.magic, t));
            }
            *closed_volume.entry(h.position.ticket).or_default() += h.position.volume;
            if h.remaining_volume <= 1e-9 {
                self.closed.insert(h.position.ticket);
            }
        }
        self.follow_lineage(open, history);
        // An MT4 remainder's opening volume is its lineage's: what it holds plus every part its
        // ancestors closed.
        for p in open {
            let closed: f64 = self.ancestry(p.ticket)[1..]
                .iter()
                .map(|up| closed_volume.get(up).copied().unwrap_or(0.0))
                .sum();
            *closed_volume.entry(p.ticket).or_default() += closed;
        }
        // A pending copy that filled between the read of the orders and this one shows in both:
        // it is a copy now (its position keeps the order's ticket, as the FIX adapter shows an
        // entry order's fill too). A pending copy beside a copy under another ticket still
        // rests: the plan cancels it.
        let filled: Vec<i64> = open
            .iter()
            .map(|p| p.ticket)
            .chain(history.iter().map(|h| h.position.ticket))
            .filter(|t| self.pending_key(*t).is_some())
            .collect();
        for t in filled {
            self.order_gone(t, true);
        }
        // A copy's opening volume is a fact: the copy ledger recorded it when the copy opened,
        // the read gives it as what is open plus what its history says was closed of it, and a
        // later read never lowers what was known (a broker or ledger that keeps less history
        // would otherwise make the copy look opened smaller, and every trim would apply the
        // master's ratio again). Those of copies no longer open are not needed again.
        let known = std::mem::take(&mut self.original);
        for p in open {
            self.closed.remove(&p.ticket);
            let read = p.volume + closed_volume.get(&p.ticket).copied().unwrap_or(0.0);
            let read = (read * 1e8).round() / 1e8;
            let recorded = self.recorded_opening(p.ticket);
            let original = known
                .get(&p.ticket)
                .map_or(read, |k| k.max(read))
                .max(recorded);
            self.original.insert(p.ticket, original);
            self.insert(p.clone());
        }
    }

    /// Replaces the pending copies with a fresh read of the follower's orders (read before its
    /// positions: an order that fills between the two reads is then among the positions, never
    /// in neither). What was ever placed is kept; doubts are resolved by the read.
    pub fn rebuild_orders(&mut self, orders: &[PendingOrder]) {
        // Tickets seen gone stay gone (a ticket is never reused): a stream update queued before
        // the read cannot bring one back.
        self.orders.clear();
        self.doubt.clear();
        for o in orders {
            self.order_placed(o.clone());
        }
    }

    /// A pending copy was placed (the reply to our place, a read, or the stream).
    pub fn order_placed(&mut self, o: PendingOrder) {
        let Some(t) = parse_marker(&o.comment) else {
            return;
        };
        if self.gone.contains(&o.ticket) {
            return;
        }
        let key = (o.magic, t);
        self.placed.insert(key);
        self.order_keys.insert(o.ticket, key);
        let list = self.orders.entry(key).or_default();
        if !list.iter().any(|c| c.ticket == o.ticket) {
            list.push(o);
            list.sort_by_key(|c| c.ticket);
        }
    }

    /// Pending copy `ticket` now rests at this price, with these stops and expiry (the reply to
    /// our amend).
    pub fn order_amended(
        &mut self,
        ticket: i64,
        (price, sl, tp, expiry_ms): (f64, Option<f64>, Option<f64>, Option<i64>),
    ) {
        for o in self
            .orders
            .values_mut()
            .flatten()
            .filter(|o| o.ticket == ticket)
        {
            o.price = price;
            o.sl = sl;
            o.tp = tp;
            o.expiry_ms = expiry_ms;
        }
    }

    /// Pending copy `ticket` left the book; `filled`: it opened a position (so its key was
    /// copied, even before the position's own update arrives).
    pub fn order_gone(&mut self, ticket: i64, filled: bool) {
        self.gone.insert(ticket);
        for list in self.orders.values_mut() {
            list.retain(|o| o.ticket != ticket);
        }
        self.orders.retain(|_, list| !list.is_empty());
        if let Some(key) = self.order_keys.get(&ticket).copied() {
            if filled {
                self.ever.insert(key);
            } else if self.pending(key).is_empty() {
                // Ended only when no other pending copy of the key still rests.
                self.ended.insert(key);
            }
        }
    }

    /// The key of pending copy `ticket`, resting or gone, if it was ever seen.
    pub fn order_key(&self, ticket: i64) -> Option<Key> {
        self.order_keys.get(&ticket).copied()
    }

    /// Records that a pending copy was placed for `key` (the ledger of order copies says so, or a
    /// place was sent).
    pub fn mark_placed(&mut self, key: Key) {
        self.placed.insert(key);
    }

    /// A place is being sent for `key`: placed, and no longer known to have ended.
    pub fn placing(&mut self, key: Key) {
        self.placed.insert(key);
        self.ended.remove(&key);
    }

    /// Forgets a place that put nothing on the book (refused only for now, or never sent): it
    /// may be sent again.
    pub fn unmark_placed(&mut self, key: Key) {
        if self.pending(key).is_empty() {
            self.placed.remove(&key);
            self.ended.remove(&key);
        }
    }

    /// Pending-copy tickets seen, with their keys, that are neither resting nor known gone.
    pub fn unresolved_orders(&self) -> Vec<(i64, Key)> {
        self.order_keys
            .iter()
            .filter(|(t, k)| {
                !self.gone.contains(t)
                    && !self.ended.contains(k)
                    && !self.pending(**k).iter().any(|o| o.ticket == **t)
            })
            .map(|(t, k)| (*t, *k))
            .collect()
    }

    /// Remembers pending copy `ticket` of `key` (the ledger of order copies names it).
    pub fn know_order(&mut self, ticket: i64, key: Key) {
        self.order_keys.entry(ticket).or_insert(key);
    }

    /// Nothing is decided for `key` until the next read.
    pub fn doubt(&mut self, key: Key) {
        self.doubt.insert(key);
    }

    /// The pending copies of `key`, oldest first.
    pub fn pending(&self, key: Key) -> &[PendingOrder] {
        self.orders.get(&key).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Every master ticket with a pending copy under link magic `magic`.
    pub fn pending_of_link(&self, magic: i64) -> impl Iterator<Item = i64> + '_ {
        self.orders
            .range((magic, i64::MIN)..=(magic, i64::MAX))
            .map(|((_, t), _)| *t)
    }

    /// True when copy `ticket` is open.
    pub fn is_open(&self, ticket: i64) -> bool {
        self.open.values().flatten().any(|c| c.ticket == ticket)
    }

    /// The key of pending copy `ticket`, while it rests.
    pub fn pending_key(&self, ticket: i64) -> Option<Key> {
        self.orders
            .iter()
            .find(|(_, list)| list.iter().any(|o| o.ticket == ticket))
            .map(|(key, _)| *key)
    }

    /// Records that `key`'s pending copy left the book without a fill.
    pub fn mark_ended(&mut self, key: Key) {
        self.ended.insert(key);
    }

    /// True when `key`'s pending copy is known to have left the book without a fill.
    pub fn ended(&self, key: Key) -> bool {
        self.ended.contains(&key)
    }

    /// True when a pending copy was ever placed for `key`.
    pub fn placed(&self, key: Key) -> bool {
        self.placed.contains(&key)
    }

    /// True when `key`'s pending copy is in doubt until the next read.
    pub fn in_doubt(&self, key: Key) -> bool {
        self.doubt.contains(&key)
    }

    /// Records that the follower held a copy for `key` (the copy ledger says so).
    pub fn mark_ever(&mut self, key: Key) {
        self.ever.insert(key);
    }

    /// Learns that copy `ticket` is `key`'s (its marker, the copy ledger, or a lineage).
    pub fn learn(&mut self, ticket: i64, key: Key) {
        if self.keys.insert(ticket, key).is_none() {
            self.learned = true;
        }
    }

    /// Learns from the copy ledger that copy `ticket` opened with `volume`. Counts as learned
    /// when it is news, so the read is resolved again.
    pub fn learn_opening(&mut self, ticket: i64, volume: f64) {
        let known = self.recorded.entry(ticket).or_insert(0.0);
        if volume > *known + 1e-9 {
            *known = volume;
            self.learned = true;
        }
    }

    /// The largest opening volume the copy ledger recorded for `ticket` or, for an MT4
    /// remainder, for any ticket of its lineage (0 when none).
    fn recorded_opening(&self, ticket: i64) -> f64 {
        self.ancestry(ticket)
            .iter()
            .map(|t| self.recorded.get(t).copied().unwrap_or(0.0))
            .fold(0.0, f64::max)
    }

    /// True (once) when a copy ticket was learned since the last call: a read then resolves
    /// more MT4 remainders.
    pub fn take_learned(&mut self) -> bool {
        std::mem::take(&mut self.learned)
    }

    /// The key of copy `ticket`, if learned.
    pub fn key_of(&self, ticket: i64) -> Option<Key> {
        self.keys.get(&ticket).copied()
    }

    /// Resolves MT4 remainders: a known copy's history entry `to #M`, or a position `from #N`
    /// of a known copy N with its magic, is that copy's remainder (repeated: lineages chain).
    /// Each link of a lineage is recorded whichever end was known first: a new owner learns
    /// every ticket of a lineage from the copy ledger before it reads, and the opening volume
    /// sums what each ancestor closed, so a link missed here would make the copy look opened
    /// smaller (and trim it again).
    fn follow_lineage(&mut self, open: &[Position], history: &[ClosedPosition]) {
        loop {
            let mut more = false;
            for h in history {
                let Some(m) = lineage(&h.position.comment, "to #") else {
                    continue;
                };
                let (up, down) = (self.keys.get(&h.position.ticket), self.keys.get(&m));
                let Some(key) = up.or(down).copied() else {
                    continue;
                };
                if key.0 != h.position.magic {
                    continue;
                }
                more |= self.link(m, h.position.ticket, key);
            }
            for p in open {
                let Some(n) = lineage(&p.comment, "from #") else {
                    continue;
                };
                let (up, down) = (self.keys.get(&n), self.keys.get(&p.ticket));
                let Some(key) = up.or(down).copied() else {
                    continue;
                };
                if key.0 != p.magic {
                    continue;
                }
                more |= self.link(p.ticket, n, key);
            }
            if !more {
                return;
            }
        }
    }

    /// Records that `child` is `parent`'s remainder, both `key`'s copies; true if anything was
    /// new.
    fn link(&mut self, child: i64, parent: i64, key: Key) -> bool {
        let mut new = false;
        for ticket in [child, parent] {
            if !self.keys.contains_key(&ticket) {
                self.learn(ticket, key);
                new = true;
            }
        }
        if self.parent.get(&child) != Some(&parent) && child != parent {
            self.parent.insert(child, parent);
            new = true;
        }
        new
    }

    fn insert(&mut self, p: Position) {
        let key = match parse_marker(&p.comment) {
            Some(t) => (p.magic, t),
            None => {
                // An MT4 remainder of a known copy, with the copy's magic.
                let from = lineage(&p.comment, "from #");
                match from.and_then(|n| self.keys.get(&n).copied()) {
                    Some(key) if key.0 == p.magic => {
                        if let Some(n) = from {
                            self.parent.insert(p.ticket, n);
                        }
                        key
                    }
                    _ => match self.keys.get(&p.ticket).copied() {
                        Some(key) => key,
                        None => return,
                    },
                }
            }
        };
        self.learn(p.ticket, key);
        self.ever.insert(key);
        let list = self.open.entry(key).or_default();
        match list.iter_mut().find(|c| c.ticket == p.ticket) {
            Some(existing) => {
                // Known already (from a reply or a read): a late update never raises a volume
                // back, and never puts back stops a reply has replaced.
                existing.volume = existing.volume.min(p.volume);
            }
            None => {
                list.push(p);
                list.sort_by_key(|c| c.ticket);
            }
        }
    }

    /// A position opened (a fill this session received, or the stream's update of it).
    pub fn opened(&mut self, p: Position) {
        if self.closed.contains(&p.ticket) {
            return;
        }
        // A pending copy's fill (its position keeps the order's ticket), announced before the
        // order's own `order_gone`.
        if self.pending_key(p.ticket).is_some() {
            self.order_gone(p.ticket, true);
        }
        // An MT4 remainder opened from a copy this index knows: the lineage's opening volume.
        let inherited = lineage(&p.comment, "from #")
            .filter(|n| self.keys.contains_key(n))
            .and_then(|n| self.original.get(&n).copied());
        self.original
            .entry(p.ticket)
            .or_insert(inherited.unwrap_or(p.volume));
        self.insert(p);
    }

    /// Part or all of copy `ticket` closed, leaving `remaining` open.
    pub fn reduced(&mut self, ticket: i64, remaining: f64) {
        if remaining <= 1e-9 {
            self.closed.insert(ticket);
            for list in self.open.values_mut() {
                list.retain(|c| c.ticket != ticket);
            }
            self.open.retain(|_, list| !list.is_empty());
            return;
        }
        for list in self.open.values_mut() {
            for c in list.iter_mut().filter(|c| c.ticket == ticket) {
                c.volume = c.volume.min(remaining);
            }
        }
    }

    /// Copy `ticket`'s stops changed.
    pub fn stops(&mut self, ticket: i64, sl: Option<f64>, tp: Option<f64>) {
        for list in self.open.values_mut() {
            for c in list.iter_mut().filter(|c| c.ticket == ticket) {
                c.sl = sl;
                c.tp = tp;
            }
        }
    }

    /// Applies one update from the broker's position stream.
    pub fn apply(&mut self, change: &PositionChange) {
        match change {
            PositionChange::Opened { position } => self.opened(position.clone()),
            // Stops: from reads and replies only (see the module's doc).
            PositionChange::Modified { .. } => {}
            PositionChange::PartiallyClosed { position, .. } => {
                self.reduced(position.ticket, position.volume)
            }
            PositionChange::Closed { closed } => self.reduced(closed.position.ticket, 0.0),
            // A pending copy's price and stops, like a copy's stops, are learned from reads and
            // replies only (a late update could put back what an amend replaced).
            PositionChange::OrderPlaced { order } | PositionChange::OrderChanged { order } => {
                self.order_placed(order.clone())
            }
            PositionChange::OrderGone { ticket, end } => {
                self.order_gone(*ticket, matches!(end, OrderEnd::Filled { .. }))
            }
        }
    }

    /// The open copies of `key`, oldest first.
    pub fn copies(&self, key: Key) -> &[Position] {
        self.open.get(&key).map(Vec::as_slice).unwrap_or(&[])
    }

    /// How many open copies the follower holds, under every link, counting pending copies (each
    /// may fill).
    pub fn open_copies(&self) -> usize {
        self.open.values().map(Vec::len).sum::<usize>()
            + self.orders.values().map(Vec::len).sum::<usize>()
    }

    /// Every open copy: ((link magic, master ticket), copy ticket).
    pub fn all_open(&self) -> impl Iterator<Item = (Key, i64)> + '_ {
        self.open
            .iter()
            .flat_map(|(key, list)| list.iter().map(move |p| (*key, p.ticket)))
    }

    /// Every open copy under link magic `magic`, by master ticket.
    pub fn copies_of_link(&self, magic: i64) -> impl Iterator<Item = (i64, &[Position])> {
        self.open
            .range((magic, i64::MIN)..=(magic, i64::MAX))
            .map(|((_, t), list)| (*t, list.as_slice()))
    }

    /// True when the follower ever held a copy for `key`.
    pub fn ever(&self, key: Key) -> bool {
        self.ever.contains(&key)
    }

    /// Copy `ticket`'s volume when it was opened (its current volume if unknown).
    /// `ticket` and, for an MT4 remainder, the tickets it was split from, nearest first: what a
    /// record keyed by the copy's first ticket (its late-copy base) is found under.
    pub fn ancestry(&self, ticket: i64) -> Vec<i64> {
        let mut line = vec![ticket];
        let mut t = ticket;
        while let Some(&up) = self.parent.get(&t) {
            if line.contains(&up) {
                break;
            }
            line.push(up);
            t = up;
        }
        line
    }

    pub fn original_volume(&self, copy: &Position) -> f64 {
        self.original
            .get(&copy.ticket)
            .copied()
            .unwrap_or(copy.volume)
    }

    /// Remembers that `key` was copied (an open whose outcome is unknown counts: the next read
    /// tells, and a deduplicating bridge is the second line).
    pub fn mark_copied(&mut self, key: Key) {
        self.ever.insert(key);
    }
}

/// The ticket an MT4 comment names after `prefix` (`from #123`, `to #124`).
pub(crate) fn lineage(comment: &str, prefix: &str) -> Option<i64> {
    comment.strip_prefix(prefix)?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::types::{ClosedBy, Side};
    use crate::copier::marker;

    fn copy(ticket: i64, master: i64, volume: f64) -> Position {
        Position {
            ticket,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume,
            open_price: 1.1,
            sl: None,
            tp: None,
            magic: 77,
            comment: marker(master),
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
            closed_by: ClosedBy::Client,
            remaining_volume: remaining,
            profit: 0.0,
        }
    }

    fn pending_copy(ticket: i64, master: i64) -> PendingOrder {
        PendingOrder {
            ticket,
            symbol: "EURUSD".into(),
            side: Side::Buy,
            kind: crate::broker::types::PendingKind::Limit,
            price: 1.09,
            volume: 0.4,
            sl: None,
            tp: None,
            expiry_ms: None,
            magic: 77,
            comment: marker(master),
            placed_ms: 0,
        }
    }

    #[test]
    fn a_pending_copy_filled_between_reads_is_a_copy_and_one_beside_a_copy_still_rests() {
        // The read of the orders shows pending copies of master orders 10 and 11; the fill of
        // 10's comes before the read of the positions: its position keeps the order's ticket
        // (500), open or already closed (in the history).
        type Read = (Vec<Position>, Vec<ClosedPosition>);
        let reads: [Read; 2] = [
            (vec![copy(500, 10, 0.4)], vec![]),
            (vec![], vec![closed(&copy(500, 10, 0.4), 0.4, 0.0)]),
        ];
        for (open, history) in reads {
            let mut index = CopyIndex::from_read(&[], &[]);
            index.rebuild_orders(&[pending_copy(500, 10), pending_copy(501, 11)]);
            index.rebuild(&open, &history);
            assert!(
                index.pending((77, 10)).is_empty() && index.pending_key(500).is_none(),
                "the filled pending copy no longer rests: {open:?} {history:?}"
            );
            assert!(
                index.ever((77, 10)) && !index.ended((77, 10)),
                "filled, not ended: no copy at market for it"
            );
            assert_eq!(index.pending((77, 11)).len(), 1, "another key's copy rests");
        }
        // A copy of 10 under another ticket beside its resting pending copy: the pending copy
        // is not taken for filled (it may still fill; the plan cancels it).
        let mut index = CopyIndex::from_read(&[], &[]);
        index.rebuild_orders(&[pending_copy(500, 10)]);
        index.rebuild(&[copy(9, 10, 0.4)], &[]);
        assert_eq!(index.pending((77, 10)).len(), 1);
        assert_eq!(index.pending_key(500), Some((77, 10)));
    }

    #[test]
    fn a_read_gives_open_copies_ever_copied_and_original_volumes() {
        let a = copy(1, 10, 0.3);
        let gone = copy(2, 11, 0.5);
        let index = CopyIndex::from_read(
            std::slice::from_ref(&a),
            &[closed(&a, 0.2, 0.3), closed(&gone, 0.5, 0.0)],
        );
        assert_eq!(index.copies((77, 10)).len(), 1);
        assert_eq!(index.original_volume(&a), 0.5);
        assert!(index.ever((77, 11)) && index.copies((77, 11)).is_empty());
        assert!(!index.ever((78, 10)), "per link magic");
    }

    #[test]
    fn a_later_read_with_less_history_never_lowers_an_opening_volume() {
        // Opened at 0.5, trimmed to 0.2: the first read's history says so; a later read whose
        // history lacks the partial close (a broker that keeps less) still scales from 0.5.
        let a = copy(1, 10, 0.2);
        let mut index = CopyIndex::from_read(std::slice::from_ref(&a), &[closed(&a, 0.3, 0.2)]);
        assert_eq!(index.original_volume(&a), 0.5);
        index.rebuild(std::slice::from_ref(&a), &[]);
        assert_eq!(index.original_volume(&a), 0.5);
        // A copy gone from the read is forgotten; its ticket is never reused.
        index.rebuild(&[], &[]);
        assert_eq!(
            index.original_volume(&a),
            0.2,
            "unknown: the current volume"
        );
    }

    /// A new owner whose broker keeps no history of the copy's partial close (or of an MT4
    /// lineage's) still scales from the volume the copy ledger recorded at the open; a lower row
    /// changes nothing, and one copy's row never raises another's (a duplicate sized larger
    /// under the same key keeps its own).
    #[test]
    fn a_new_owner_takes_the_opening_volume_the_copy_ledger_recorded() {
        let a = copy(1, 10, 0.2);
        let mut index = CopyIndex::default();
        index.rebuild(std::slice::from_ref(&a), &[]);
        assert_eq!(index.original_volume(&a), 0.2, "nothing else known yet");
        index.learn_opening(1, 0.5);
        index.learn_opening(1, 0.2);
        assert!(index.take_learned(), "a higher opening volume is news");
        index.rebuild(std::slice::from_ref(&a), &[]);
        assert_eq!(index.original_volume(&a), 0.5);
        index.learn_opening(1, 0.3);
        assert!(!index.take_learned(), "a lower row changes nothing");
        index.rebuild(std::slice::from_ref(&a), &[]);
        assert_eq!(index.original_volume(&a), 0.5);
        // A duplicate of the same master position (same key), recorded larger: its own row only.
        let b = copy(2, 10, 0.2);
        index.learn_opening(2, 0.9);
        index.rebuild(&[a.clone(), b.clone()], &[]);
        assert_eq!(index.original_volume(&a), 0.5);
        assert_eq!(index.original_volume(&b), 0.9);
        // An MT4 remainder, tied to the copy by a ticket the ledger taught: the lineage's row.
        let mut rest = copy(91, 10, 0.1);
        rest.comment = "from #90".into();
        let mut index = CopyIndex::default();
        index.learn(90, (77, 10));
        index.learn_opening(90, 0.6);
        index.rebuild(std::slice::from_ref(&rest), &[]);
        assert_eq!(index.original_volume(&rest), 0.6);
    }

    /// MT4 renumbers a partially closed copy: the remainder (`from #N`, the copy's magic) is the
    /// same copy, found by a read through its lineage (a copy ticket the ledger taught, or a
    /// history entry `to #M`), its opening volume the lineage's; a stranger with another magic,
    /// or naming an unknown ticket, is not a copy.
    #[test]
    fn an_mt4_remainder_is_its_copys_continuation_by_ticket_lineage() {
        let mut root = copy(90, 10, 0.5);
        root.comment = "to #91".into(); // the marker is gone from the history
        let mut first = copy(91, 10, 0.3);
        first.comment = "from #90".into();
        let mut second = copy(92, 10, 0.1);
        second.comment = "from #91".into();
        let mut part = closed(&root, 0.2, 0.0);
        part.position.comment = "to #91".into();
        let mut index = CopyIndex::default();
        // Without the ledger's word for 90, nothing ties 91 to the copy.
        index.rebuild(std::slice::from_ref(&first), std::slice::from_ref(&part));
        assert!(index.copies((77, 10)).is_empty());
        index.learn(90, (77, 10));
        assert!(index.take_learned());
        index.rebuild(std::slice::from_ref(&first), std::slice::from_ref(&part));
        assert_eq!(index.copies((77, 10)).len(), 1);
        assert_eq!(index.copies((77, 10))[0].ticket, 91);
        assert_eq!(
            index.original_volume(&first),
            0.5,
            "the lineage's opening volume"
        );
        // A second split: 91 closes 0.2 (`to #92`); the chain still leads to the copy.
        let mut part2 = closed(&first, 0.2, 0.0);
        part2.position.comment = "to #92".into();
        index.rebuild(std::slice::from_ref(&second), &[part.clone(), part2]);
        assert_eq!(index.copies((77, 10))[0].ticket, 92);
        assert_eq!(index.original_volume(&second), 0.5);
        // Another magic, or an unknown ticket: not a copy.
        let mut stranger = copy(93, 10, 0.1);
        stranger.magic = 5;
        stranger.comment = "from #92".into();
        let mut orphan = copy(94, 10, 0.1);
        orphan.comment = "from #4242".into();
        index.rebuild(&[second.clone(), stranger, orphan], &[part]);
        assert_eq!(index.copies((77, 10)).len(), 1);
        assert_eq!(index.open_copies(), 1);
    }

    /// A new owner learns every ticket of a lineage from the copy ledger before its first read:
    /// the links between them still come from the history and the positions, so the remainder's
    /// opening volume is the lineage's (the fault: the links were skipped for tickets already
    /// known, and the new owner trimmed the copy again).
    #[test]
    fn a_lineage_whose_tickets_the_ledger_taught_first_keeps_its_opening_volume() {
        let root = copy(90, 10, 1.0);
        let mut part1 = closed(&root, 0.4, 0.0);
        part1.position.comment = "to #91".into();
        let mut first = copy(91, 10, 0.6);
        first.comment = "from #90".into();
        let mut part2 = closed(&first, 0.3, 0.0);
        part2.position.comment = "to #92".into();
        let mut second = copy(92, 10, 0.3);
        second.comment = "from #91".into();
        for taught in [vec![90], vec![90, 91, 92], vec![92], vec![91, 92]] {
            let mut index = CopyIndex::default();
            for t in &taught {
                index.learn(*t, (77, 10));
            }
            index.rebuild(
                std::slice::from_ref(&second),
                &[part1.clone(), part2.clone()],
            );
            assert_eq!(index.copies((77, 10)).len(), 1, "taught {taught:?}");
            assert_eq!(
                index.original_volume(&second),
                1.0,
                "taught {taught:?}: the lineage's opening volume"
            );
        }
    }

    /// The stream's view of an MT4 partial close: the copy's ticket closes, its remainder opens
    /// (`from #N`) and is the same copy, with the copy's opening volume.
    #[test]
    fn an_mt4_remainder_announced_on_the_stream_keeps_the_copy() {
        let root = copy(90, 10, 0.5);
        let mut index = CopyIndex::from_read(std::slice::from_ref(&root), &[]);
        index.reduced(90, 0.0);
        assert!(index.copies((77, 10)).is_empty());
        let mut rest = copy(91, 10, 0.3);
        rest.comment = "from #90".into();
        index.opened(rest.clone());
        assert_eq!(index.copies((77, 10))[0].ticket, 91);
        assert_eq!(index.original_volume(&rest), 0.5);
    }

    #[test]
    fn reply_and_stream_in_either_order_end_in_the_same_state() {
        let start = copy(1, 10, 1.0);
        let after_first = copy(1, 10, 0.6);
        let after_second = copy(1, 10, 0.3);
        let stream = |p: &Position, prev: f64| PositionChange::PartiallyClosed {
            position: p.clone(),
            closed: closed(p, prev - p.volume, p.volume),
        };
        // Stream first.
        let mut a = CopyIndex::from_read(std::slice::from_ref(&start), &[]);
        a.apply(&stream(&after_first, 1.0));
        a.reduced(1, 0.6);
        a.apply(&stream(&after_second, 0.6));
        a.reduced(1, 0.3);
        // Replies first, the stream's updates arriving late.
        let mut b = CopyIndex::from_read(std::slice::from_ref(&start), &[]);
        b.reduced(1, 0.6);
        b.reduced(1, 0.3);
        b.apply(&stream(&after_first, 1.0));
        assert_eq!(
            b.copies((77, 10))[0].volume,
            0.3,
            "a late update never raises a volume back"
        );
        b.apply(&stream(&after_second, 0.6));
        assert_eq!(a.copies((77, 10)), b.copies((77, 10)));
        // A close reply, then a late open or modify of that ticket: it stays closed.
        b.reduced(1, 0.0);
        b.apply(&PositionChange::Opened {
            position: start.clone(),
        });
        b.apply(&PositionChange::Modified {
            position: start.clone(),
        });
        assert!(b.copies((77, 10)).is_empty() && b.ever((77, 10)));
    }

    #[test]
    fn a_late_stream_update_never_puts_back_stops_a_reply_replaced() {
        let mut index = CopyIndex::from_read(&[copy(1, 10, 1.0)], &[]);
        let with = |sl: f64| Position {
            sl: Some(sl),
            ..copy(1, 10, 1.0)
        };
        // The open's own update comes after the reply to a stop change.
        index.stops(1, Some(1.02), None);
        index.opened(with(0.9));
        assert_eq!(index.copies((77, 10))[0].sl, Some(1.02));
        // Stops 1.03, then 1.0, each applied from its reply; the first one's update comes late.
        index.stops(1, Some(1.03), None);
        index.stops(1, Some(1.0), None);
        index.apply(&PositionChange::Modified {
            position: with(1.03),
        });
        assert_eq!(
            index.copies((77, 10))[0].sl,
            Some(1.0),
            "a change back to 1.03 must not look done"
        );
    }

    #[test]
    fn what_was_copied_survives_a_read_that_lost_it() {
        let mut index = CopyIndex::from_read(&[copy(1, 10, 1.0)], &[]);
        index.rebuild(&[], &[]);
        assert!(index.copies((77, 10)).is_empty());
        assert!(index.ever((77, 10)), "an empty read is not proof of never");
    }

    #[test]
    fn two_copies_of_one_master_position_are_both_indexed_oldest_first() {
        let index = CopyIndex::from_read(&[copy(5, 10, 1.0), copy(3, 10, 1.0)], &[]);
        let tickets: Vec<i64> = index.copies((77, 10)).iter().map(|c| c.ticket).collect();
        assert_eq!(tickets, vec![3, 5]);
        assert_eq!(index.copies_of_link(77).count(), 1);
        assert_eq!(index.copies_of_link(78).count(), 0);
    }
}
