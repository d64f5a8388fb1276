//! What a prepared login reads ahead of its claim, brought current by its stream: held to the
//! simulated broker's book, the server's own state, over random trading (opens, partial and
//! full closes, stops, pending orders placed, amended, cancelled, filled and expired, MT5's and
//! MT4's ways). The stream starts at the login; the read comes any time after it; every change
//! after the login is applied to the read, in order, including those the read already holds.
//! The oracle is the book after the last change, never the code under test.

use copier_node::broker::ReadAhead;
use copier_node::broker::types::{
    CloseOrder, ClosedPosition, ModifyOrder, OpenOrder, PendingKind, PendingOrder, PlaceOrder,
    Position, PositionChange, Side,
};
use copier_node::sim_broker::book::Book;

const LOGIN: &str = "f1";
const SYMBOLS: [&str; 2] = ["EURUSD", "GBPUSD"];

/// A random account's life in three stretches: before the login, between the login and the
/// read, after the read. The read, brought current by every change from the login on, is the
/// book at the end.
#[test]
fn a_read_ahead_brought_current_by_its_stream_is_the_account_at_the_raise() {
    for mt4 in [false, true] {
        for seed in 0..300 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut trading = Trading::new(mt4);
            for _ in 0..rng.usize(0..8) {
                trading.step(&mut rng);
            }
            let stream_from = trading.changes.len();
            for _ in 0..rng.usize(0..12) {
                trading.step(&mut rng);
            }
            let mut ahead = trading.read();
            for _ in 0..rng.usize(0..12) {
                trading.step(&mut rng);
            }
            for change in &trading.changes[stream_from..] {
                ahead.apply(change);
            }
            let truth = trading.read();
            let what = format!("seed {seed}, mt4 {mt4}");
            assert_eq!(
                by_ticket(ahead.positions, |p: &Position| p.ticket),
                by_ticket(truth.positions, |p: &Position| p.ticket),
                "positions: {what}"
            );
            assert_eq!(
                by_ticket(ahead.orders, |o: &PendingOrder| o.ticket),
                by_ticket(truth.orders, |o: &PendingOrder| o.ticket),
                "pending orders: {what}"
            );
            assert_eq!(
                history(ahead.history),
                history(truth.history),
                "history: {what}"
            );
        }
    }
}

/// The account traded at random on the book, every change it pushed kept in order.
struct Trading {
    book: Book,
    now_ms: i64,
    changes: Vec<PositionChange>,
}

impl Trading {
    fn new(mt4: bool) -> Self {
        let mut book = Book::new(100_000.0, true);
        book.set_mt4(mt4);
        let effects = book.login("manual", LOGIN, None, None, 1);
        assert!(effects.result.is_ok());
        Trading {
            book,
            now_ms: 1_000,
            changes: Vec::new(),
        }
    }

    fn step(&mut self, rng: &mut fastrand::Rng) {
        // Some steps share a millisecond: closes of one instant must still be told apart.
        self.now_ms += rng.i64(0..3);
        let now = self.now_ms;
        let symbol = SYMBOLS[rng.usize(0..SYMBOLS.len())];
        let price = self.book.market.price(symbol).expect("a listed symbol");
        let account = self.book.account(LOGIN).expect("logged in");
        let positions: Vec<Position> = account.positions.values().cloned().collect();
        let orders: Vec<PendingOrder> = account.orders.values().cloned().collect();
        let events = match rng.u8(0..9) {
            0 | 1 => {
                let side = if rng.bool() { Side::Buy } else { Side::Sell };
                let order = OpenOrder {
                    symbol: symbol.into(),
                    side,
                    volume: 0.1 * rng.u8(1..6) as f64,
                    sl: rng.bool().then(|| price - side.sign() * 0.002),
                    tp: rng.bool().then(|| price + side.sign() * 0.002),
                    magic: 7,
                    comment: format!("mc{}", rng.u32(1..1000)),
                    client_order_id: None,
                    price_limit: None,
                };
                self.book.open("n", LOGIN, None, &order, now).events
            }
            2 | 3 if !positions.is_empty() => {
                let p = &positions[rng.usize(0..positions.len())];
                let part = (rng.bool() && p.volume > 0.15)
                    .then(|| (p.volume / 2.0 * 100.0).round() / 100.0);
                let order = CloseOrder {
                    ticket: p.ticket,
                    volume: part,
                    client_order_id: None,
                };
                self.book.close("n", LOGIN, None, &order, now).events
            }
            4 if !positions.is_empty() => {
                let p = &positions[rng.usize(0..positions.len())];
                let here = self.book.market.price(&p.symbol).expect("listed");
                let order = ModifyOrder {
                    ticket: p.ticket,
                    sl: Some(here - p.side.sign() * 0.001 * rng.u8(1..4) as f64),
                    tp: None,
                    client_order_id: None,
                };
                self.book.modify("n", LOGIN, None, &order, now).events
            }
            5 => {
                let side = if rng.bool() { Side::Buy } else { Side::Sell };
                let kind = if rng.bool() {
                    PendingKind::Limit
                } else {
                    PendingKind::Stop
                };
                // A limit below (buy) or above (sell) the market, a stop the other way.
                let away = match kind {
                    PendingKind::Limit => -side.sign(),
                    PendingKind::Stop => side.sign(),
                };
                let order = PlaceOrder {
                    symbol: symbol.into(),
                    side,
                    kind,
                    price: price + away * 0.001 * rng.u8(1..3) as f64,
                    volume: 0.1,
                    sl: None,
                    tp: None,
                    expiry_ms: rng.bool().then(|| now + rng.i64(1..20)),
                    magic: 7,
                    comment: format!("mc{}", rng.u32(1..1000)),
                    client_order_id: None,
                };
                self.book.place("n", LOGIN, None, &order, now).events
            }
            6 if !orders.is_empty() => {
                let o = &orders[rng.usize(0..orders.len())];
                self.book
                    .cancel("n", LOGIN, None, o.ticket, &None, now)
                    .events
            }
            _ => {
                // The market moves: stops, pending orders and expiries trigger.
                let moved = price + 0.001 * (rng.i8(-3..4) as f64);
                self.book
                    .market
                    .set_price(symbol, moved, true)
                    .expect("a positive price");
                self.book.trigger(now).0
            }
        };
        self.changes.extend(
            events
                .into_iter()
                .filter(|(login, _)| login == LOGIN)
                .map(|(_, change)| change),
        );
    }

    /// The account as a read shows it.
    fn read(&self) -> ReadAhead {
        let account = self.book.account(LOGIN).expect("logged in");
        ReadAhead {
            orders: self.book.orders(LOGIN),
            positions: account.positions.values().cloned().collect(),
            history: account.history.clone(),
            symbols: Vec::new(),
        }
    }
}

fn by_ticket<T: std::fmt::Debug>(mut items: Vec<T>, ticket: impl Fn(&T) -> i64) -> Vec<T> {
    items.sort_by_key(|i| ticket(i));
    items
}

/// History entries in a canonical order (what happened, not in which order it was learned).
fn history(mut entries: Vec<ClosedPosition>) -> Vec<ClosedPosition> {
    entries.sort_by(|a, b| {
        (a.position.ticket, a.close_time_ms)
            .cmp(&(b.position.ticket, b.close_time_ms))
            .then(b.remaining_volume.total_cmp(&a.remaining_volume))
    });
    entries
}
