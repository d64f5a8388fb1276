//! The simulated trade server's accounts and positions, as plain data with the operations on
//! them. Every change is expressed as a [`Record`] and applied through [`Book::apply`], so a
//! restart that replays the records (`--state`) rebuilds exactly what was there.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::journal::JournalEntry;
use super::market::{Market, check_price_limit, check_stops, round_volume};
use crate::broker::protocol::LoginResult;
use crate::broker::protocol::OrderResult;
use crate::broker::types::{
    AccountInfo, CloseFill, CloseOrder, ClosedBy, ClosedPosition, Currency, ModifyOrder, OpenFill,
    OpenOrder, OrderEnd, PendingKind, PendingOrder, PlaceOrder, Position, PositionChange, Side,
    SymbolSpec,
};

/// The client name of hand orders: not fence-checked, closes recorded as `manual`.
pub const MANUAL: &str = "manual";

/// First ticket the server hands out.
const FIRST_TICKET: i64 = 1_000_001;

/// One account on the server.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Account {
    pub login: String,
    /// Set by the first login that carried one; later logins must match it.
    pub password: Option<String>,
    pub balance: f64,
    pub positions: BTreeMap<i64, Position>,
    /// Pending orders resting on the server.
    #[serde(default)]
    pub orders: BTreeMap<i64, PendingOrder>,
    pub history: Vec<ClosedPosition>,
    /// Highest fence seen from logins and orders.
    pub fence: Option<i64>,
    /// Client order ids already executed, with their results (idempotency).
    pub done: HashMap<String, Done>,
}

/// The result an executed client order id returns when it is sent again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Done {
    Open(OpenFill),
    Close(CloseFill),
    Modify { ticket: i64 },
    Place { ticket: i64 },
    Amend { ticket: i64 },
    Cancel { ticket: i64 },
}

/// A durable change: appended to the state file before the reply, replayed at start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum Record {
    Account {
        login: String,
        password: Option<String>,
        balance: f64,
    },
    Fence {
        login: String,
        fence: i64,
    },
    Opened {
        login: String,
        position: Position,
    },
    Closed {
        login: String,
        closed: ClosedPosition,
    },
    Modified {
        login: String,
        ticket: i64,
        sl: Option<f64>,
        tp: Option<f64>,
    },
    Done {
        login: String,
        client_order_id: String,
        done: Done,
    },
    /// A pending order placed or amended: it is now `order`.
    OrderSet {
        login: String,
        order: PendingOrder,
    },
    /// A pending order left the book (filled, cancelled or expired).
    OrderRemoved {
        login: String,
        ticket: i64,
    },
    /// The next ticket the server hands out (a compacted state file keeps it: a cancelled or
    /// expired order leaves no other trace of its ticket, which must never be handed out again).
    NextTicket {
        next: i64,
    },
}

/// What one operation did.
#[derive(Debug)]
pub struct Effects<T> {
    /// The reply: a result, or the reason it was rejected.
    pub result: Result<T, String>,
    /// The journal line (order requests and logins only).
    pub journal: Option<JournalEntry>,
    /// Position changes to push to the login's sessions.
    pub events: Vec<(String, PositionChange)>,
    /// Durable changes, already applied.
    pub records: Vec<Record>,
}

/// Every account and the market.
#[derive(Debug)]
pub struct Book {
    pub market: Market,
    accounts: HashMap<String, Account>,
    next_ticket: i64,
    default_balance: f64,
    fence_check: bool,
    /// Execute a client order id once (off: every request executes, as on MT4/MT5 servers).
    dedupe: bool,
    /// MT4's ways (`sim-broker serve --mt4`): a partial close gives the remainder a new ticket
    /// and rewrites both comments (`from #<old>` on the remainder, `to #<new>` on the closed
    /// part, the magic kept), and a stop loss or take profit close rewrites the history
    /// entry's comment (`[sl]`, `[tp]`), as brokers do.
    mt4: bool,
    /// Opening balances of named accounts (others get `default_balance`).
    opening: HashMap<String, f64>,
    /// Currencies of named accounts (others count in US dollars).
    currencies: HashMap<String, Currency>,
    /// Fault switch: (login, op) -> (how many more node orders to refuse, the reason).
    refusals: HashMap<(String, String), (u32, String)>,
    /// How far the server's clock runs from UTC (as MT servers keep their own time zone):
    /// pending orders' expiries and placement times are on it.
    clock_offset_ms: i64,
}

impl Book {
    pub fn new(default_balance: f64, fence_check: bool) -> Self {
        Book {
            market: Market::new(),
            accounts: HashMap::new(),
            next_ticket: FIRST_TICKET,
            default_balance,
            fence_check,
            dedupe: true,
            mt4: false,
            currencies: HashMap::new(),
            opening: HashMap::new(),
            refusals: HashMap::new(),
            clock_offset_ms: 0,
        }
    }

    /// Replaces the symbol list: the default symbols under these suffixes.
    pub fn set_symbol_suffixes(&mut self, suffixes: &[&str]) {
        self.market = Market::with_suffixes(suffixes);
    }

    /// Replaces the symbol list: the default symbols under these suffixes, with these contract
    /// sizes by base symbol.
    pub fn set_symbols(&mut self, suffixes: &[&str], contracts: &HashMap<String, f64>) {
        self.market = Market::with(suffixes, contracts);
    }

    /// The balance `login` gets when it is created (at its first login or order).
    pub fn set_opening_balance(&mut self, login: &str, balance: f64) {
        self.opening.insert(login.to_string(), balance);
    }

    /// The currency an account counts in (balance, equity, profit); US dollars by default.
    pub fn set_currency(&mut self, login: &str, currency: Currency) {
        self.currencies.insert(login.to_string(), currency);
    }

    fn currency(&self, login: &str) -> Currency {
        self.currencies
            .get(login)
            .copied()
            .unwrap_or_else(|| "USD".parse().expect("a currency code"))
    }

    /// A profit in US dollars, in `login`'s currency (converted at the market's price; as is
    /// when the market cannot price the currency).
    fn in_account_currency(&self, login: &str, usd: f64) -> f64 {
        usd * self.market.usd_in(self.currency(login)).unwrap_or(1.0)
    }

    /// Fault switch for tests: refuse the next `count` orders of kind `op` (`open`, `close`,
    /// `modify`, `place`, `amend` or `cancel`), or account reads (`account`: a bridge that cannot
    /// read the balance yet), that a node (not a hand client) sends for `login`, with `reason`
    /// (which names the protocol code: `market closed`, `requote`, `not enough money`, ...).
    /// Kept in memory only.
    pub fn refuse(&mut self, login: &str, op: &str, count: u32, reason: &str) {
        self.refusals.insert(
            (login.to_string(), op.to_string()),
            (count, reason.to_string()),
        );
    }

    /// The injected refusal for this order, if one is pending (and counts it).
    pub(crate) fn refused(&mut self, client: &str, login: &str, op: &str) -> Result<(), String> {
        if client == MANUAL {
            return Ok(());
        }
        match self.refusals.get_mut(&(login.to_string(), op.to_string())) {
            Some((n, reason)) if *n > 0 => {
                *n -= 1;
                Err(reason.clone())
            }
            _ => Ok(()),
        }
    }

    /// Turns client-order-id deduplication off (real MT4/MT5 servers have none) or on.
    /// Behaves as MT4 servers do on partial closes and stop closes (see the field).
    pub fn set_mt4(&mut self, on: bool) {
        self.mt4 = on;
    }

    pub fn set_dedupe(&mut self, on: bool) {
        self.dedupe = on;
    }

    /// Runs the server's clock `offset_ms` from UTC.
    pub fn set_clock_offset(&mut self, offset_ms: i64) {
        self.clock_offset_ms = offset_ms;
    }

    /// The server's clock at UTC instant `now_ms`.
    pub fn server_ms(&self, now_ms: i64) -> i64 {
        now_ms + self.clock_offset_ms
    }

    /// Applies a durable change (live, or replayed from the state file).
    pub fn apply(&mut self, record: &Record) {
        match record {
            Record::Account {
                login,
                password,
                balance,
            } => {
                self.accounts
                    .entry(login.clone())
                    .or_insert_with(|| Account {
                        login: login.clone(),
                        password: password.clone(),
                        balance: *balance,
                        positions: BTreeMap::new(),
                        orders: BTreeMap::new(),
                        history: Vec::new(),
                        fence: None,
                        done: HashMap::new(),
                    });
            }
            Record::Fence { login, fence } => {
                if let Some(a) = self.accounts.get_mut(login) {
                    a.fence = Some(a.fence.map_or(*fence, |f| f.max(*fence)));
                }
            }
            Record::Opened { login, position } => {
                self.next_ticket = self.next_ticket.max(position.ticket + 1);
                if let Some(a) = self.accounts.get_mut(login) {
                    a.positions.insert(position.ticket, position.clone());
                }
            }
            Record::Closed { login, closed } => {
                if let Some(a) = self.accounts.get_mut(login) {
                    let ticket = closed.position.ticket;
                    if closed.remaining_volume <= 0.0 {
                        a.positions.remove(&ticket);
                    } else if let Some(p) = a.positions.get_mut(&ticket) {
                        p.volume = closed.remaining_volume;
                    }
                    a.balance += closed.profit;
                    a.history.push(closed.clone());
                }
            }
            Record::Modified {
                login,
                ticket,
                sl,
                tp,
            } => {
                if let Some(p) = self
                    .accounts
                    .get_mut(login)
                    .and_then(|a| a.positions.get_mut(ticket))
                {
                    p.sl = *sl;
                    p.tp = *tp;
                }
            }
            Record::Done {
                login,
                client_order_id,
                done,
            } => {
                if let Some(a) = self.accounts.get_mut(login) {
                    a.done.insert(client_order_id.clone(), done.clone());
                }
            }
            Record::OrderSet { login, order } => {
                self.next_ticket = self.next_ticket.max(order.ticket + 1);
                if let Some(a) = self.accounts.get_mut(login) {
                    a.orders.insert(order.ticket, order.clone());
                }
            }
            Record::OrderRemoved { login, ticket } => {
                if let Some(a) = self.accounts.get_mut(login) {
                    a.orders.remove(ticket);
                }
            }
            Record::NextTicket { next } => {
                self.next_ticket = self.next_ticket.max(*next);
            }
        }
    }

    /// Records that rebuild the current state (for compacting the state file).
    pub fn snapshot(&self) -> Vec<Record> {
        let mut out = Vec::new();
        let mut logins: Vec<&String> = self.accounts.keys().collect();
        logins.sort();
        for login in logins {
            let a = &self.accounts[login];
            // The balance before history is replayed on top of it.
            let realised: f64 = a.history.iter().map(|h| h.profit).sum();
            out.push(Record::Account {
                login: a.login.clone(),
                password: a.password.clone(),
                balance: a.balance - realised,
            });
            if let Some(f) = a.fence {
                out.push(Record::Fence {
                    login: a.login.clone(),
                    fence: f,
                });
            }
            // Every ticket as it was opened, then every close in order, gives the same state.
            let mut tickets: BTreeMap<i64, Position> = BTreeMap::new();
            for h in &a.history {
                tickets
                    .entry(h.position.ticket)
                    .or_insert_with(|| h.position.clone());
            }
            for (t, p) in &a.positions {
                tickets.entry(*t).or_insert_with(|| p.clone());
            }
            for (t, mut p) in tickets {
                p.volume = original_volume(a, t);
                out.push(Record::Opened {
                    login: a.login.clone(),
                    position: p,
                });
            }
            for h in &a.history {
                out.push(Record::Closed {
                    login: a.login.clone(),
                    closed: h.clone(),
                });
            }
            for (ticket, p) in &a.positions {
                out.push(Record::Modified {
                    login: a.login.clone(),
                    ticket: *ticket,
                    sl: p.sl,
                    tp: p.tp,
                });
            }
            for order in a.orders.values() {
                out.push(Record::OrderSet {
                    login: a.login.clone(),
                    order: order.clone(),
                });
            }
            let mut ids: Vec<&String> = a.done.keys().collect();
            ids.sort();
            for id in ids {
                out.push(Record::Done {
                    login: a.login.clone(),
                    client_order_id: id.clone(),
                    done: a.done[id].clone(),
                });
            }
        }
        out.push(Record::NextTicket {
            next: self.next_ticket,
        });
        out
    }

    fn ensure_account(&mut self, login: &str, password: Option<&str>, records: &mut Vec<Record>) {
        if !self.accounts.contains_key(login) {
            let r = Record::Account {
                login: login.to_string(),
                password: password.map(str::to_string),
                balance: self
                    .opening
                    .get(login)
                    .copied()
                    .unwrap_or(self.default_balance),
            };
            self.apply(&r);
            records.push(r);
        }
    }

    /// Checks a fence against the login's highest and raises it. `None` (hand orders) passes.
    fn fence(
        &mut self,
        login: &str,
        fence: Option<i64>,
        records: &mut Vec<Record>,
    ) -> Result<(), String> {
        let Some(f) = fence else { return Ok(()) };
        let highest = self.accounts.get(login).and_then(|a| a.fence);
        match highest {
            Some(h) if f < h => {
                if self.fence_check {
                    Err(format!(
                        "stale fence {f}: login {login} is held with fence {h}"
                    ))
                } else {
                    Ok(())
                }
            }
            Some(h) if f == h => Ok(()),
            _ => {
                let r = Record::Fence {
                    login: login.to_string(),
                    fence: f,
                };
                self.apply(&r);
                records.push(r);
                Ok(())
            }
        }
    }

    pub fn account(&self, login: &str) -> Option<&Account> {
        self.accounts.get(login)
    }

    pub fn account_count(&self) -> usize {
        self.accounts.len()
    }

    /// Balance and equity (balance plus the open positions' floating profit).
    pub fn info(&self, login: &str) -> Option<AccountInfo> {
        let a = self.accounts.get(login)?;
        let floating: f64 = a
            .positions
            .values()
            .map(|p| {
                let price = self.market.price(&p.symbol).unwrap_or(p.open_price);
                self.market
                    .profit(&p.symbol, p.side, p.volume, p.open_price, price)
            })
            .sum();
        let floating = self.in_account_currency(login, floating);
        Some(AccountInfo {
            balance: round_money(a.balance),
            equity: round_money(a.balance + floating),
            currency: Some(self.currency(login)),
            server_time_ms: None,
        })
    }

    pub fn symbols(&self) -> Vec<SymbolSpec> {
        self.market.specs()
    }

    /// `login`: creates the account on first use; checks the password and the fence.
    pub fn login(
        &mut self,
        client: &str,
        login: &str,
        password: Option<&str>,
        fence: Option<i64>,
        now_ms: i64,
    ) -> Effects<LoginResult> {
        let mut records = Vec::new();
        let mut entry = JournalEntry::new(now_ms, login, client, "login");
        entry.fence = fence;
        self.ensure_account(login, password, &mut records);
        let result = (|| {
            let a = &self.accounts[login];
            if let Some(expected) = &a.password
                && password != Some(expected.as_str())
            {
                return Err("invalid credentials".to_string());
            }
            self.fence(login, fence, &mut records)?;
            Ok(self.logged_in(login, now_ms))
        })();
        entry.finish(&result);
        Effects {
            result,
            journal: Some(entry),
            events: Vec::new(),
            records,
        }
    }

    /// A login's (or a raise's) answer: the account figures with the server's clock, as
    /// `account` answers carry it (a session knows its server's offset from the start), and
    /// the fence now held.
    fn logged_in(&self, login: &str, now_ms: i64) -> LoginResult {
        LoginResult {
            account: AccountInfo {
                server_time_ms: Some(self.server_ms(now_ms)),
                ..self.info(login).expect("account exists")
            },
            fence: self.accounts[login].fence,
        }
    }

    /// `fence`: raises the fence of a login already logged in on the caller's connection (a
    /// prepared hand-off's new owner, once it has claimed the account). Journaled as a `login`
    /// line with the new fence, so the journal shows every raise the same way whichever request
    /// made it.
    pub fn raise_fence(
        &mut self,
        client: &str,
        login: &str,
        fence: i64,
        now_ms: i64,
    ) -> Effects<LoginResult> {
        let mut records = Vec::new();
        let mut entry = JournalEntry::new(now_ms, login, client, "login");
        entry.fence = Some(fence);
        let result = (|| {
            if !self.accounts.contains_key(login) {
                return Err(format!("unknown login {login}"));
            }
            self.fence(login, Some(fence), &mut records)?;
            Ok(self.logged_in(login, now_ms))
        })();
        entry.finish(&result);
        Effects {
            result,
            journal: Some(entry),
            events: Vec::new(),
            records,
        }
    }

    /// A market order to open a position.
    pub fn open(
        &mut self,
        client: &str,
        login: &str,
        fence: Option<i64>,
        order: &OpenOrder,
        now_ms: i64,
    ) -> Effects<OpenFill> {
        let mut records = Vec::new();
        let mut events = Vec::new();
        let mut entry = order_entry(
            (now_ms, login, client, "open", fence),
            (order.symbol.as_str(), order.side, order.volume),
            (order.magic, order.comment.as_str(), &order.client_order_id),
        );
        self.ensure_account(login, None, &mut records);
        let result = (|| {
            self.fence(login, fence, &mut records)?;
            self.refused(client, login, "open")?;
            if let Some(Done::Open(fill)) = order
                .client_order_id
                .as_ref()
                .filter(|_| self.dedupe)
                .and_then(|id| self.accounts[login].done.get(id))
            {
                return Err(duplicate(fill.ticket));
            }
            let price = self
                .market
                .price(&order.symbol)
                .ok_or_else(|| format!("unknown symbol {}", order.symbol))?;
            self.market.check_open(&order.symbol, now_ms)?;
            self.market.check_volume(&order.symbol, order.volume)?;
            check_stops(order.side, price, order.sl, order.tp)?;
            check_price_limit(order.side, price, order.price_limit)?;
            let ticket = self.next_ticket;
            let position = Position {
                volume: round_volume(order.volume),
                ..order.position(ticket, price, now_ms)
            };
            let r = Record::Opened {
                login: login.to_string(),
                position: position.clone(),
            };
            self.apply(&r);
            records.push(r);
            let fill = OpenFill {
                ticket,
                price,
                volume: None,
                duplicate: false,
            };
            self.remember(
                login,
                &order.client_order_id,
                Done::Open(fill.clone()),
                &mut records,
            );
            events.push((login.to_string(), PositionChange::Opened { position }));
            Ok(fill)
        })();
        let result = self.resolve_duplicate(login, &order.client_order_id, result, |d| match d {
            Done::Open(f) => Some(OpenFill {
                duplicate: true,
                ..f.clone()
            }),
            _ => None,
        });
        if let Ok(fill) = &result {
            entry.ticket = Some(fill.ticket);
        }
        entry.finish_dup(&result, |f| f.duplicate);
        Effects {
            result,
            journal: Some(entry),
            events,
            records,
        }
    }

    /// Closes all or part of a position at the current price.
    pub fn close(
        &mut self,
        client: &str,
        login: &str,
        fence: Option<i64>,
        order: &CloseOrder,
        now_ms: i64,
    ) -> Effects<CloseFill> {
        let mut records = Vec::new();
        let mut events = Vec::new();
        let mut entry = JournalEntry::new(now_ms, login, client, "close");
        entry.fence = fence;
        entry.ticket = Some(order.ticket);
        entry.volume = order.volume;
        entry.client_order_id = order.client_order_id.clone();
        self.ensure_account(login, None, &mut records);
        if let Some(p) = self.accounts[login].positions.get(&order.ticket) {
            entry.describe(p);
            entry.volume = Some(order.volume.unwrap_or(p.volume));
        }
        let closed_by = if client == MANUAL {
            ClosedBy::Manual
        } else {
            ClosedBy::Client
        };
        let result = (|| {
            self.fence(login, fence, &mut records)?;
            self.refused(client, login, "close")?;
            if let Some(Done::Close(fill)) = order
                .client_order_id
                .as_ref()
                .filter(|_| self.dedupe)
                .and_then(|id| self.accounts[login].done.get(id))
            {
                return Err(duplicate(fill.ticket));
            }
            let position = self.accounts[login]
                .positions
                .get(&order.ticket)
                .cloned()
                .ok_or_else(|| format!("unknown ticket {}", order.ticket))?;
            let volume = order.volume.unwrap_or(position.volume);
            self.market.check_open(&position.symbol, now_ms)?;
            self.market.check_volume(&position.symbol, volume)?;
            if volume > position.volume + 1e-9 {
                return Err(format!(
                    "close volume {volume} exceeds the position's {}",
                    position.volume
                ));
            }
            let price = self
                .market
                .price(&position.symbol)
                .unwrap_or(position.open_price);
            let closed = self.close_part(
                login,
                &position,
                volume,
                price,
                closed_by,
                now_ms,
                &mut records,
                &mut events,
            );
            let fill = CloseFill {
                ticket: order.ticket,
                closed_volume: closed.position.volume,
                remaining_volume: closed.remaining_volume,
                price,
                duplicate: false,
            };
            self.remember(
                login,
                &order.client_order_id,
                Done::Close(fill.clone()),
                &mut records,
            );
            Ok(fill)
        })();
        let result = self.resolve_duplicate(login, &order.client_order_id, result, |d| match d {
            Done::Close(f) => Some(CloseFill {
                duplicate: true,
                ..f.clone()
            }),
            _ => None,
        });
        entry.finish_dup(&result, |f| f.duplicate);
        Effects {
            result,
            journal: Some(entry),
            events,
            records,
        }
    }

    /// Sets stop loss and take profit.
    pub fn modify(
        &mut self,
        client: &str,
        login: &str,
        fence: Option<i64>,
        order: &ModifyOrder,
        now_ms: i64,
    ) -> Effects<i64> {
        let mut records = Vec::new();
        let mut events = Vec::new();
        let mut entry = JournalEntry::new(now_ms, login, client, "modify");
        entry.fence = fence;
        entry.ticket = Some(order.ticket);
        entry.client_order_id = order.client_order_id.clone();
        self.ensure_account(login, None, &mut records);
        if let Some(p) = self.accounts[login].positions.get(&order.ticket) {
            entry.describe(p);
        }
        let result = (|| {
            self.fence(login, fence, &mut records)?;
            self.refused(client, login, "modify")?;
            let position = self.accounts[login]
                .positions
                .get(&order.ticket)
                .cloned()
                .ok_or_else(|| format!("unknown ticket {}", order.ticket))?;
            self.market.check_open(&position.symbol, now_ms)?;
            let price = self
                .market
                .price(&position.symbol)
                .unwrap_or(position.open_price);
            check_stops(position.side, price, order.sl, order.tp)?;
            let r = Record::Modified {
                login: login.to_string(),
                ticket: order.ticket,
                sl: order.sl,
                tp: order.tp,
            };
            self.apply(&r);
            records.push(r);
            self.remember(
                login,
                &order.client_order_id,
                Done::Modify {
                    ticket: order.ticket,
                },
                &mut records,
            );
            let position = self.accounts[login].positions[&order.ticket].clone();
            events.push((login.to_string(), PositionChange::Modified { position }));
            Ok(order.ticket)
        })();
        entry.finish(&result);
        Effects {
            result,
            journal: Some(entry),
            events,
            records,
        }
    }

    /// Moves prices one tick and closes positions whose stop loss or take profit was hit.
    pub fn tick(&mut self, now_ms: i64) -> (Vec<(String, PositionChange)>, Vec<Record>) {
        self.market.tick();
        self.trigger(now_ms)
    }

    /// What the market's prices trigger now: stop losses and take profits, pending orders that
    /// fill (each opens a position under its own ticket, at the market price, with its stops,
    /// magic and comment) and pending orders that expire. Not journaled: the journal holds
    /// requests, and these are the server's own doing (positions and history show them).
    pub fn trigger(&mut self, now_ms: i64) -> (Vec<(String, PositionChange)>, Vec<Record>) {
        let (mut events, mut records) = self.expire(now_ms);
        self.trigger_orders(now_ms, &mut events, &mut records);
        let mut hits = Vec::new();
        for a in self.accounts.values() {
            for p in a.positions.values() {
                let Some(price) = self.market.price(&p.symbol) else {
                    continue;
                };
                let sl_hit = p.sl.is_some_and(|sl| (price - sl) * p.side.sign() <= 0.0);
                let tp_hit = p.tp.is_some_and(|tp| (price - tp) * p.side.sign() >= 0.0);
                if sl_hit {
                    // A stop becomes a market order: at the market price, which a jump of the
                    // price (the price switch, a fill beyond the stop) may have carried past it.
                    hits.push((a.login.clone(), p.clone(), price, ClosedBy::Sl));
                } else if tp_hit {
                    hits.push((
                        a.login.clone(),
                        p.clone(),
                        p.tp.unwrap_or(price),
                        ClosedBy::Tp,
                    ));
                }
            }
        }
        for (login, p, price, by) in hits {
            self.close_part(
                &login,
                &p,
                p.volume,
                price,
                by,
                now_ms,
                &mut records,
                &mut events,
            );
        }
        (events, records)
    }

    #[allow(clippy::too_many_arguments)]
    fn close_part(
        &mut self,
        login: &str,
        position: &Position,
        volume: f64,
        price: f64,
        closed_by: ClosedBy,
        now_ms: i64,
        records: &mut Vec<Record>,
        events: &mut Vec<(String, PositionChange)>,
    ) -> ClosedPosition {
        let remaining = round_volume(position.volume - volume).max(0.0);
        if self.mt4 {
            return self.close_part_mt4(
                login, position, volume, remaining, price, closed_by, now_ms, records, events,
            );
        }
        let usd = self.market.profit(
            &position.symbol,
            position.side,
            volume,
            position.open_price,
            price,
        );
        let profit = round_money(self.in_account_currency(login, usd));
        let closed = ClosedPosition {
            position: Position {
                volume: round_volume(volume),
                ..position.clone()
            },
            close_price: price,
            close_time_ms: now_ms,
            closed_by,
            remaining_volume: remaining,
            profit,
        };
        let r = Record::Closed {
            login: login.to_string(),
            closed: closed.clone(),
        };
        self.apply(&r);
        records.push(r);
        let change = if remaining > 0.0 {
            let position = self.accounts[login].positions[&position.ticket].clone();
            PositionChange::PartiallyClosed {
                position,
                closed: closed.clone(),
            }
        } else {
            PositionChange::Closed {
                closed: closed.clone(),
            }
        };
        events.push((login.to_string(), change));
        closed
    }

    /// [`Book::close_part`] as MT4 does it: the ticket closes whole (its history entry holds the
    /// part closed), and a remainder opens under a new ticket with the same symbol, side, open
    /// price, open time, stops and magic, its comment `from #<old>`; the closed part's comment
    /// becomes `to #<new>`. A stop loss or take profit close's comment becomes `[sl]` / `[tp]`.
    #[allow(clippy::too_many_arguments)]
    fn close_part_mt4(
        &mut self,
        login: &str,
        position: &Position,
        volume: f64,
        remaining: f64,
        price: f64,
        closed_by: ClosedBy,
        now_ms: i64,
        records: &mut Vec<Record>,
        events: &mut Vec<(String, PositionChange)>,
    ) -> ClosedPosition {
        let usd = self.market.profit(
            &position.symbol,
            position.side,
            volume,
            position.open_price,
            price,
        );
        let profit = round_money(self.in_account_currency(login, usd));
        let remainder = (remaining > 0.0).then(|| {
            let ticket = self.next_ticket;
            Position {
                ticket,
                volume: remaining,
                comment: format!("from #{}", position.ticket),
                ..position.clone()
            }
        });
        let comment = match (&remainder, closed_by) {
            (Some(r), _) => format!("to #{}", r.ticket),
            (None, ClosedBy::Sl) => "[sl]".to_string(),
            (None, ClosedBy::Tp) => "[tp]".to_string(),
            (None, _) => position.comment.clone(),
        };
        let closed = ClosedPosition {
            position: Position {
                volume: round_volume(volume),
                comment,
                ..position.clone()
            },
            close_price: price,
            close_time_ms: now_ms,
            closed_by,
            remaining_volume: 0.0,
            profit,
        };
        let r = Record::Closed {
            login: login.to_string(),
            closed: closed.clone(),
        };
        self.apply(&r);
        records.push(r);
        events.push((
            login.to_string(),
            PositionChange::Closed {
                closed: closed.clone(),
            },
        ));
        if let Some(position) = remainder {
            let r = Record::Opened {
                login: login.to_string(),
                position: position.clone(),
            };
            self.apply(&r);
            records.push(r);
            events.push((login.to_string(), PositionChange::Opened { position }));
        }
        // What the reply reports: the part closed, and (a naive bridge's view) what is left.
        ClosedPosition {
            remaining_volume: remaining,
            ..closed
        }
    }

    /// The account's pending orders, by ticket.
    pub fn orders(&self, login: &str) -> Vec<PendingOrder> {
        self.accounts
            .get(login)
            .map(|a| a.orders.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Places a pending order (checked like an open, and its price against the market: a limit
    /// waits on the near side, a stop beyond it).
    pub fn place(
        &mut self,
        client: &str,
        login: &str,
        fence: Option<i64>,
        order: &PlaceOrder,
        now_ms: i64,
    ) -> Effects<OrderResult> {
        let mut records = Vec::new();
        let mut events = Vec::new();
        let mut entry = order_entry(
            (now_ms, login, client, "place", fence),
            (order.symbol.as_str(), order.side, order.volume),
            (order.magic, order.comment.as_str(), &order.client_order_id),
        );
        self.ensure_account(login, None, &mut records);
        let result = (|| {
            self.fence(login, fence, &mut records)?;
            self.refused(client, login, "place")?;
            if let Some(Done::Place { ticket }) = order
                .client_order_id
                .as_ref()
                .filter(|_| self.dedupe)
                .and_then(|id| self.accounts[login].done.get(id))
            {
                return Err(duplicate(*ticket));
            }
            let market = self
                .market
                .price(&order.symbol)
                .ok_or_else(|| format!("unknown symbol {}", order.symbol))?;
            self.market.check_open(&order.symbol, now_ms)?;
            self.market.check_volume(&order.symbol, order.volume)?;
            check_pending(order.side, order.kind, order.price, market)?;
            check_stops(order.side, order.price, order.sl, order.tp)?;
            check_expiry(order.expiry_ms, self.server_ms(now_ms))?;
            let ticket = self.next_ticket;
            let pending = PendingOrder {
                volume: round_volume(order.volume),
                ..order.pending(ticket, self.server_ms(now_ms))
            };
            let r = Record::OrderSet {
                login: login.to_string(),
                order: pending.clone(),
            };
            self.apply(&r);
            records.push(r);
            self.remember(
                login,
                &order.client_order_id,
                Done::Place { ticket },
                &mut records,
            );
            events.push((
                login.to_string(),
                PositionChange::OrderPlaced { order: pending },
            ));
            Ok(OrderResult {
                ticket,
                duplicate: false,
            })
        })();
        let result = self.resolve_duplicate(login, &order.client_order_id, result, |d| match d {
            Done::Place { ticket } => Some(OrderResult {
                ticket: *ticket,
                duplicate: true,
            }),
            _ => None,
        });
        if let Ok(r) = &result {
            entry.ticket = Some(r.ticket);
        }
        entry.finish_dup(&result, |r| r.duplicate);
        Effects {
            result,
            journal: Some(entry),
            events,
            records,
        }
    }

    /// Changes a pending order's price, stops and expiry (checked as when placed).
    #[allow(clippy::too_many_arguments)]
    pub fn amend(
        &mut self,
        client: &str,
        login: &str,
        fence: Option<i64>,
        ticket: i64,
        (price, sl, tp, expiry_ms): (f64, Option<f64>, Option<f64>, Option<i64>),
        client_order_id: &Option<String>,
        now_ms: i64,
    ) -> Effects<OrderResult> {
        let mut records = Vec::new();
        let mut events = Vec::new();
        let (mut entry, found) = self.pending_request(
            (client, login, fence),
            ("amend", ticket, client_order_id),
            now_ms,
            &mut records,
        );
        let result = found.and_then(|order| {
            let market = self.market.price(&order.symbol).unwrap_or(order.price);
            self.market.check_open(&order.symbol, now_ms)?;
            check_pending(order.side, order.kind, price, market)?;
            check_stops(order.side, price, sl, tp)?;
            check_expiry(expiry_ms, self.server_ms(now_ms))?;
            let amended = PendingOrder {
                price,
                sl,
                tp,
                expiry_ms,
                ..order
            };
            let r = Record::OrderSet {
                login: login.to_string(),
                order: amended.clone(),
            };
            self.apply(&r);
            records.push(r);
            events.push((
                login.to_string(),
                PositionChange::OrderChanged { order: amended },
            ));
            self.remember(login, client_order_id, Done::Amend { ticket }, &mut records);
            Ok(OrderResult {
                ticket,
                duplicate: false,
            })
        });
        let result = self.resolve_duplicate(login, client_order_id, result, |d| match d {
            Done::Amend { ticket } => Some(OrderResult {
                ticket: *ticket,
                duplicate: true,
            }),
            _ => None,
        });
        entry.finish_dup(&result, |r| r.duplicate);
        Effects {
            result,
            journal: Some(entry),
            events,
            records,
        }
    }

    /// Cancels a pending order.
    pub fn cancel(
        &mut self,
        client: &str,
        login: &str,
        fence: Option<i64>,
        ticket: i64,
        client_order_id: &Option<String>,
        now_ms: i64,
    ) -> Effects<OrderResult> {
        let mut records = Vec::new();
        let mut events = Vec::new();
        let (mut entry, found) = self.pending_request(
            (client, login, fence),
            ("cancel", ticket, client_order_id),
            now_ms,
            &mut records,
        );
        let result = found.map(|_| {
            let r = Record::OrderRemoved {
                login: login.to_string(),
                ticket,
            };
            self.apply(&r);
            records.push(r);
            events.push((
                login.to_string(),
                PositionChange::OrderGone {
                    ticket,
                    end: OrderEnd::Cancelled,
                },
            ));
            self.remember(
                login,
                client_order_id,
                Done::Cancel { ticket },
                &mut records,
            );
            OrderResult {
                ticket,
                duplicate: false,
            }
        });
        let result = self.resolve_duplicate(login, client_order_id, result, |d| match d {
            Done::Cancel { ticket } => Some(OrderResult {
                ticket: *ticket,
                duplicate: true,
            }),
            _ => None,
        });
        entry.finish_dup(&result, |r| r.duplicate);
        Effects {
            result,
            journal: Some(entry),
            events,
            records,
        }
    }

    /// The start of a request on a resting order (`amend`, `cancel`): its journal entry, and the
    /// order once the fence is checked, an injected refusal counted and the ticket found.
    fn pending_request(
        &mut self,
        (client, login, fence): (&str, &str, Option<i64>),
        (action, ticket, client_order_id): (&str, i64, &Option<String>),
        now_ms: i64,
        records: &mut Vec<Record>,
    ) -> (JournalEntry, Result<PendingOrder, String>) {
        let mut entry = JournalEntry::new(now_ms, login, client, action);
        entry.fence = fence;
        entry.ticket = Some(ticket);
        entry.client_order_id = client_order_id.clone();
        self.ensure_account(login, None, records);
        let found = (|| {
            self.fence(login, fence, records)?;
            self.refused(client, login, action)?;
            if let Some(Done::Amend { ticket } | Done::Cancel { ticket }) = client_order_id
                .as_ref()
                .filter(|_| self.dedupe)
                .and_then(|id| self.accounts[login].done.get(id))
            {
                return Err(duplicate(*ticket));
            }
            self.accounts[login]
                .orders
                .get(&ticket)
                .cloned()
                .ok_or_else(|| format!("unknown ticket {ticket}: no such pending order"))
        })();
        if let Ok(order) = &found {
            entry.symbol = Some(order.symbol.clone());
            entry.side = Some(order.side);
            entry.volume = Some(order.volume);
            entry.magic = Some(order.magic);
            entry.comment = Some(order.comment.clone());
        }
        (entry, found)
    }

    /// Drops the pending orders whose expiry has come (the server's clock), whatever the prices.
    pub fn expire(&mut self, now_ms: i64) -> (Vec<(String, PositionChange)>, Vec<Record>) {
        let now_server = self.server_ms(now_ms);
        let due: Vec<(String, i64)> = self
            .accounts
            .values()
            .flat_map(|a| {
                a.orders
                    .values()
                    .filter(|o| o.expiry_ms.is_some_and(|e| now_server >= e))
                    .map(|o| (a.login.clone(), o.ticket))
            })
            .collect();
        let mut events = Vec::new();
        let mut records = Vec::new();
        for (login, ticket) in due {
            let r = Record::OrderRemoved {
                login: login.clone(),
                ticket,
            };
            self.apply(&r);
            records.push(r);
            events.push((
                login,
                PositionChange::OrderGone {
                    ticket,
                    end: OrderEnd::Expired,
                },
            ));
        }
        (events, records)
    }

    /// Pending orders that fill at the current prices (a closed market fills none).
    fn trigger_orders(
        &mut self,
        now_ms: i64,
        events: &mut Vec<(String, PositionChange)>,
        records: &mut Vec<Record>,
    ) {
        let mut due: Vec<(String, PendingOrder, f64)> = Vec::new();
        for a in self.accounts.values() {
            for o in a.orders.values() {
                if self.market.check_open(&o.symbol, now_ms).is_err() {
                    continue;
                }
                let Some(price) = self.market.price(&o.symbol) else {
                    continue;
                };
                let reached = match (o.side, o.kind) {
                    (Side::Buy, PendingKind::Limit) | (Side::Sell, PendingKind::Stop) => {
                        price <= o.price
                    }
                    (Side::Sell, PendingKind::Limit) | (Side::Buy, PendingKind::Stop) => {
                        price >= o.price
                    }
                };
                if reached {
                    due.push((a.login.clone(), o.clone(), price));
                }
            }
        }
        for (login, o, price) in due {
            let r = Record::OrderRemoved {
                login: login.clone(),
                ticket: o.ticket,
            };
            self.apply(&r);
            records.push(r);
            let position = Position {
                ticket: o.ticket,
                symbol: o.symbol.clone(),
                side: o.side,
                volume: o.volume,
                open_price: price,
                sl: o.sl,
                tp: o.tp,
                magic: o.magic,
                comment: o.comment.clone(),
                open_time_ms: now_ms,
            };
            let r = Record::Opened {
                login: login.clone(),
                position: position.clone(),
            };
            self.apply(&r);
            records.push(r);
            events.push((
                login.clone(),
                PositionChange::OrderGone {
                    ticket: o.ticket,
                    end: OrderEnd::Filled { position: o.ticket },
                },
            ));
            events.push((login, PositionChange::Opened { position }));
        }
    }

    fn remember(
        &mut self,
        login: &str,
        client_order_id: &Option<String>,
        done: Done,
        records: &mut Vec<Record>,
    ) {
        if let Some(id) = client_order_id {
            let r = Record::Done {
                login: login.to_string(),
                client_order_id: id.clone(),
                done,
            };
            self.apply(&r);
            records.push(r);
        }
    }

    /// A client order id already executed: the original result, marked as a duplicate.
    fn resolve_duplicate<T>(
        &self,
        login: &str,
        client_order_id: &Option<String>,
        result: Result<T, String>,
        original: impl Fn(&Done) -> Option<T>,
    ) -> Result<T, String> {
        match (&result, client_order_id) {
            (Err(reason), Some(id)) if reason.starts_with(DUPLICATE) => {
                match self
                    .accounts
                    .get(login)
                    .and_then(|a| a.done.get(id))
                    .and_then(original)
                {
                    Some(t) => Ok(t),
                    None => result,
                }
            }
            _ => result,
        }
    }
}

/// A pending order's price against the market: a limit waits on the near side (a buy limit
/// below it, a sell limit above), a stop beyond it (a buy stop above, a sell stop below).
fn check_pending(side: Side, kind: PendingKind, price: f64, market: f64) -> Result<(), String> {
    if !(price.is_finite() && price > 0.0) {
        return Err(format!("invalid price {price}"));
    }
    let ok = match (side, kind) {
        (Side::Buy, PendingKind::Limit) | (Side::Sell, PendingKind::Stop) => price < market,
        (Side::Sell, PendingKind::Limit) | (Side::Buy, PendingKind::Stop) => price > market,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "invalid price {price} for a {} {} with the market at {market}",
            match side {
                Side::Buy => "buy",
                Side::Sell => "sell",
            },
            match kind {
                PendingKind::Limit => "limit",
                PendingKind::Stop => "stop",
            }
        ))
    }
}

/// An expiry must lie ahead.
/// The journal line of a new order: who sent it and what it asks for.
fn order_entry(
    (now_ms, login, client, action, fence): (i64, &str, &str, &str, Option<i64>),
    (symbol, side, volume): (&str, Side, f64),
    (magic, comment, client_order_id): (i64, &str, &Option<String>),
) -> JournalEntry {
    let mut entry = JournalEntry::new(now_ms, login, client, action);
    entry.fence = fence;
    entry.symbol = Some(symbol.to_string());
    entry.side = Some(side);
    entry.volume = Some(volume);
    entry.magic = Some(magic);
    entry.comment = Some(comment.to_string());
    entry.client_order_id = client_order_id.clone();
    entry
}

fn check_expiry(expiry_ms: Option<i64>, now_ms: i64) -> Result<(), String> {
    match expiry_ms {
        Some(e) if e <= now_ms => Err(format!(
            "invalid expiration {e}: not after the server's time {now_ms}"
        )),
        _ => Ok(()),
    }
}

const DUPLICATE: &str = "duplicate client_order_id";

fn duplicate(ticket: i64) -> String {
    format!("{DUPLICATE}: already executed (ticket {ticket}); the original result was returned")
}

/// The volume a position was opened with: its current volume plus everything closed of it.
fn original_volume(a: &Account, ticket: i64) -> f64 {
    let closed: f64 = a
        .history
        .iter()
        .filter(|h| h.position.ticket == ticket)
        .map(|h| h.position.volume)
        .sum();
    let open = a.positions.get(&ticket).map(|p| p.volume).unwrap_or(0.0);
    round_volume(open + closed)
}

fn round_money(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::broker::types::Side;

    fn order(volume: f64) -> OpenOrder {
        OpenOrder {
            symbol: "EURUSD".into(),
            side: Side::Buy,
            volume,
            sl: None,
            tp: None,
            magic: 7,
            comment: "mc1".into(),
            client_order_id: Some("o1".into()),
            price_limit: None,
        }
    }

    /// MT4 mode: a partial close ends the ticket (history `to #<new>`) and opens the remainder
    /// under a new ticket (`from #<old>`, magic kept); a stop close's history says `[sl]`.
    #[test]
    fn in_mt4_mode_a_partial_close_renumbers_and_a_stop_rewrites_the_history_comment() {
        let mut b = Book::new(10_000.0, true);
        b.set_mt4(true);
        let fill = b.open("n", "1", Some(1), &order(1.0), 1).result.unwrap();
        let close = |b: &mut Book, ticket, volume| {
            b.close(
                "n",
                "1",
                Some(1),
                &CloseOrder {
                    ticket,
                    volume,
                    client_order_id: None,
                },
                2,
            )
        };
        let part = close(&mut b, fill.ticket, Some(0.4));
        assert_eq!(part.result.unwrap().remaining_volume, 0.6);
        assert!(matches!(part.events[0].1, PositionChange::Closed { .. }));
        let a = b.account("1").unwrap();
        assert!(!a.positions.contains_key(&fill.ticket));
        let (&rest, remainder) = a.positions.iter().next().unwrap();
        assert_ne!(rest, fill.ticket);
        assert_eq!(remainder.volume, 0.6);
        assert_eq!(remainder.comment, format!("from #{}", fill.ticket));
        assert_eq!(remainder.magic, a.history[0].position.magic);
        assert_eq!(a.history[0].position.comment, format!("to #{rest}"));
        assert_eq!(
            (a.history[0].position.volume, a.history[0].remaining_volume),
            (0.4, 0.0)
        );
        // A stop hit: the history entry's comment is the broker's.
        b.modify(
            "n",
            "1",
            Some(1),
            &ModifyOrder {
                ticket: rest,
                sl: Some(1.05),
                tp: None,
                client_order_id: None,
            },
            3,
        )
        .result
        .unwrap();
        b.market.set_price("EURUSD", 1.04, false).unwrap();
        b.trigger(4);
        let a = b.account("1").unwrap();
        assert!(a.positions.is_empty());
        assert_eq!(a.history[1].position.comment, "[sl]");
    }

    #[test]
    fn partial_close_keeps_the_ticket_and_records_history() {
        let mut b = Book::new(10_000.0, true);
        let fill = b.open("n", "1", Some(1), &order(1.0), 1).result.unwrap();
        let part = b
            .close(
                "n",
                "1",
                Some(1),
                &CloseOrder {
                    ticket: fill.ticket,
                    volume: Some(0.4),
                    client_order_id: None,
                },
                2,
            )
            .result
            .unwrap();
        assert_eq!(part.remaining_volume, 0.6);
        let a = b.account("1").unwrap();
        assert_eq!(a.positions[&fill.ticket].volume, 0.6);
        assert_eq!(a.history.len(), 1);
        assert_eq!(a.history[0].position.volume, 0.4);
        assert_eq!(a.history[0].closed_by, ClosedBy::Client);
        let full = b
            .close(
                MANUAL,
                "1",
                None,
                &CloseOrder {
                    ticket: fill.ticket,
                    volume: None,
                    client_order_id: None,
                },
                3,
            )
            .result
            .unwrap();
        assert_eq!(full.remaining_volume, 0.0);
        let a = b.account("1").unwrap();
        assert!(a.positions.is_empty());
        assert_eq!(a.history[1].closed_by, ClosedBy::Manual);
    }

    #[test]
    fn an_order_never_fills_beyond_its_price_limit() {
        let mut b = Book::new(10_000.0, true);
        let price = b.open("n", "1", None, &order(0.1), 1).result.unwrap().price;
        let limited = |side: Side, limit: f64| OpenOrder {
            side,
            price_limit: Some(limit),
            client_order_id: None,
            ..order(0.1)
        };
        for (side, limit, fills) in [
            (Side::Buy, price + 0.0001, true),
            (Side::Buy, price, true),
            (Side::Buy, price - 0.0001, false),
            (Side::Sell, price - 0.0001, true),
            (Side::Sell, price + 0.0001, false),
        ] {
            let e = b.open("n", "1", None, &limited(side, limit), 2);
            match e.result {
                Ok(fill) => assert!(fills && fill.price == price, "{side:?} {limit}"),
                Err(reason) => {
                    assert!(!fills, "{side:?} {limit}: {reason}");
                    assert!(
                        reason.contains("beyond the order's price limit"),
                        "{reason}"
                    );
                    assert!(!e.journal.unwrap().accepted);
                }
            }
        }
    }

    #[test]
    fn a_repeated_client_order_id_returns_the_original_fill() {
        let mut b = Book::new(10_000.0, true);
        let first = b.open("n", "1", Some(1), &order(1.0), 1);
        let fill = first.result.unwrap();
        assert!(first.journal.unwrap().accepted);
        let again = b.open("n", "1", Some(1), &order(1.0), 2);
        let dup = again.result.unwrap();
        assert!(dup.duplicate);
        assert_eq!(dup.ticket, fill.ticket);
        let j = again.journal.unwrap();
        assert!(
            !j.accepted,
            "the journal records that no second order was executed"
        );
        assert!(j.reason.unwrap().contains("duplicate client_order_id"));
        assert!(again.events.is_empty());
        assert_eq!(b.account("1").unwrap().positions.len(), 1);
    }

    #[test]
    fn fences_are_raised_by_logins_and_orders_and_stale_ones_refused() {
        let mut b = Book::new(10_000.0, true);
        assert!(b.login("a", "1", None, Some(5), 1).result.is_ok());
        let stale = b.login("b", "1", None, Some(4), 2);
        assert!(stale.result.unwrap_err().contains("stale fence 4"));
        assert!(!stale.journal.unwrap().accepted);
        assert!(b.open("c", "1", Some(6), &order(0.1), 3).result.is_ok());
        let late = b.open(
            "a",
            "1",
            Some(5),
            &OpenOrder {
                client_order_id: None,
                ..order(0.1)
            },
            4,
        );
        assert!(late.result.unwrap_err().contains("stale fence 5"));
        assert!(
            b.open(
                MANUAL,
                "1",
                None,
                &OpenOrder {
                    client_order_id: None,
                    ..order(0.1)
                },
                5
            )
            .result
            .is_ok(),
            "hand orders are not fence-checked"
        );
        let mut unchecked = Book::new(10_000.0, false);
        unchecked.login("a", "1", None, Some(5), 1);
        assert!(
            unchecked
                .open("a", "1", Some(4), &order(0.1), 2)
                .result
                .is_ok()
        );
        assert_eq!(
            unchecked.account("1").unwrap().fence,
            Some(5),
            "the highest fence is kept"
        );
    }

    #[test]
    fn passwords_are_checked_once_set() {
        let mut b = Book::new(10_000.0, true);
        assert!(b.login("a", "1", Some("s3cret"), None, 1).result.is_ok());
        assert_eq!(
            b.login("a", "1", Some("wrong"), None, 2)
                .result
                .unwrap_err(),
            "invalid credentials"
        );
        assert_eq!(
            b.login("a", "1", None, None, 3).result.unwrap_err(),
            "invalid credentials"
        );
        assert!(b.login("a", "1", Some("s3cret"), None, 4).result.is_ok());
    }

    #[test]
    fn every_rejection_has_a_reason() {
        let mut b = Book::new(10_000.0, true);
        let cases: Vec<(OpenOrder, &str)> = vec![
            (
                OpenOrder {
                    symbol: "BTCUSD".into(),
                    ..order(1.0)
                },
                "unknown symbol",
            ),
            (order(0.001), "below the minimum"),
            (order(150.0), "above the maximum"),
            (order(0.015), "multiple of the step"),
            (
                OpenOrder {
                    sl: Some(1.2),
                    ..order(1.0)
                },
                "invalid stops",
            ),
        ];
        for (o, why) in cases {
            let e = b.open("n", "1", None, &o, 1);
            assert!(e.result.unwrap_err().contains(why), "{why}");
            let j = e.journal.unwrap();
            assert!(!j.accepted && j.reason.unwrap().contains(why));
        }
        let e = b.close(
            "n",
            "1",
            None,
            &CloseOrder {
                ticket: 42,
                volume: None,
                client_order_id: None,
            },
            1,
        );
        assert!(e.result.unwrap_err().contains("unknown ticket 42"));
        let e = b.modify(
            "n",
            "1",
            None,
            &ModifyOrder {
                ticket: 42,
                sl: None,
                tp: None,
                client_order_id: None,
            },
            1,
        );
        assert!(e.result.unwrap_err().contains("unknown ticket 42"));
        let fill = b
            .open(
                "n",
                "1",
                None,
                &OpenOrder {
                    client_order_id: None,
                    ..order(1.0)
                },
                1,
            )
            .result
            .unwrap();
        let e = b.close(
            "n",
            "1",
            None,
            &CloseOrder {
                ticket: fill.ticket,
                volume: Some(2.0),
                client_order_id: None,
            },
            1,
        );
        assert!(e.result.unwrap_err().contains("exceeds"));
    }

    #[test]
    fn stops_close_positions_when_the_price_crosses_them() {
        let mut b = Book::new(10_000.0, true);
        let fill = b
            .open(
                "n",
                "1",
                None,
                &OpenOrder {
                    tp: Some(1.1001),
                    client_order_id: None,
                    ..order(1.0)
                },
                1,
            )
            .result
            .unwrap();
        let mut events = Vec::new();
        for t in 0..600 {
            events.extend(b.tick(t).0);
            if !events.is_empty() {
                break;
            }
        }
        assert!(
            matches!(&events[0].1, PositionChange::Closed { closed } if closed.closed_by == ClosedBy::Tp && closed.position.ticket == fill.ticket)
        );
        assert!(b.info("1").unwrap().balance > 10_000.0);
    }

    #[test]
    fn replaying_the_records_rebuilds_the_book() {
        let mut b = Book::new(10_000.0, true);
        let mut log = Vec::new();
        log.extend(b.login("n", "1", Some("pw"), Some(3), 1).records);
        let f1 = b.open("n", "1", Some(3), &order(1.0), 2);
        let t1 = f1.result.as_ref().unwrap().ticket;
        log.extend(f1.records);
        log.extend(
            b.close(
                "n",
                "1",
                Some(3),
                &CloseOrder {
                    ticket: t1,
                    volume: Some(0.3),
                    client_order_id: Some("c1".into()),
                },
                3,
            )
            .records,
        );
        let f2 = b.open(
            MANUAL,
            "2",
            None,
            &OpenOrder {
                client_order_id: None,
                side: Side::Sell,
                ..order(0.5)
            },
            4,
        );
        log.extend(f2.records);
        log.extend(
            b.modify(
                "n",
                "1",
                Some(3),
                &ModifyOrder {
                    ticket: t1,
                    sl: Some(1.0),
                    tp: Some(1.2),
                    client_order_id: None,
                },
                5,
            )
            .records,
        );

        for records in [log.clone(), b.snapshot()] {
            let mut r = Book::new(10_000.0, true);
            for rec in &records {
                r.apply(rec);
            }
            for login in ["1", "2"] {
                let (x, y) = (b.account(login).unwrap(), r.account(login).unwrap());
                assert_eq!(x.positions, y.positions, "{login}");
                assert_eq!(x.history, y.history, "{login}");
                assert_eq!(x.fence, y.fence);
                assert_eq!(x.password, y.password);
                assert_eq!(x.done, y.done);
                assert!((x.balance - y.balance).abs() < 1e-9);
            }
            assert_eq!(
                r.open(
                    "n",
                    "1",
                    Some(3),
                    &OpenOrder {
                        client_order_id: None,
                        ..order(0.1)
                    },
                    6
                )
                .result
                .unwrap()
                .ticket,
                b.next_ticket
            );
        }
    }

    fn pending(side: Side, kind: PendingKind, price: f64) -> PlaceOrder {
        PlaceOrder {
            symbol: "EURUSD".into(),
            side,
            kind,
            price,
            volume: 0.5,
            sl: None,
            tp: None,
            expiry_ms: None,
            magic: 9,
            comment: "mc77".into(),
            client_order_id: Some("p1".into()),
        }
    }

    #[test]
    fn a_pending_order_is_checked_against_the_market_when_placed() {
        // EURUSD is at 1.1000.
        let mut b = Book::new(10_000.0, true);
        for (side, kind, price) in [
            (Side::Buy, PendingKind::Limit, 1.1050),
            (Side::Sell, PendingKind::Limit, 1.0950),
            (Side::Buy, PendingKind::Stop, 1.0950),
            (Side::Sell, PendingKind::Stop, 1.1050),
            (Side::Buy, PendingKind::Limit, 1.1000),
        ] {
            let e = b.place("n", "1", None, &pending(side, kind, price), 1);
            let reason = e.result.unwrap_err();
            assert!(reason.starts_with("invalid price"), "{reason}");
            assert!(!e.journal.unwrap().accepted);
        }
        let expired = PlaceOrder {
            expiry_ms: Some(1),
            ..pending(Side::Buy, PendingKind::Limit, 1.09)
        };
        assert!(
            b.place("n", "1", None, &expired, 1)
                .result
                .unwrap_err()
                .starts_with("invalid expiration")
        );
        let bad_stop = PlaceOrder {
            sl: Some(1.095),
            ..pending(Side::Buy, PendingKind::Limit, 1.09)
        };
        let reason = b.place("n", "1", None, &bad_stop, 1).result.unwrap_err();
        assert!(
            reason.starts_with("invalid stops: sl 1.095 must be below the price 1.09"),
            "a buy's stop loss above its price: {reason}"
        );
        b.market.switch("EURUSD", Some(false)).unwrap();
        let closed = b.place(
            "n",
            "1",
            None,
            &pending(Side::Buy, PendingKind::Limit, 1.09),
            1,
        );
        assert!(closed.result.unwrap_err().starts_with("market closed"));
        assert!(b.orders("1").is_empty());
    }

    #[test]
    fn pending_orders_fill_as_the_price_reaches_them_under_their_own_ticket() {
        let mut b = Book::new(10_000.0, true);
        let limit = b
            .place(
                "n",
                "1",
                Some(1),
                &pending(Side::Buy, PendingKind::Limit, 1.0950),
                1,
            )
            .result
            .unwrap();
        let stop = b
            .place(
                "n",
                "1",
                Some(1),
                &PlaceOrder {
                    client_order_id: Some("p2".into()),
                    ..pending(Side::Sell, PendingKind::Stop, 1.0900)
                },
                1,
            )
            .result
            .unwrap();
        assert_eq!(b.orders("1").len(), 2);
        // Down to the buy limit: it fills; the sell stop (lower) waits.
        b.market.set_price("EURUSD", 1.0940, false).unwrap();
        let (events, _) = b.trigger(5);
        assert_eq!(b.orders("1").len(), 1);
        let a = b.account("1").unwrap();
        let p = &a.positions[&limit.ticket];
        assert_eq!(
            (
                p.side,
                p.volume,
                p.open_price,
                p.magic,
                p.comment.as_str(),
                p.open_time_ms
            ),
            (Side::Buy, 0.5, 1.0940, 9, "mc77", 5)
        );
        assert_eq!(
            events.iter().map(|(_, e)| e.clone()).collect::<Vec<_>>(),
            vec![
                PositionChange::OrderGone {
                    ticket: limit.ticket,
                    end: OrderEnd::Filled {
                        position: limit.ticket
                    }
                },
                PositionChange::Opened {
                    position: p.clone()
                },
            ]
        );
        // Through the sell stop.
        b.market.set_price("EURUSD", 1.0890, false).unwrap();
        b.trigger(6);
        assert!(b.orders("1").is_empty());
        assert!(b.account("1").unwrap().positions.contains_key(&stop.ticket));
    }

    #[test]
    fn pending_orders_expire_amend_and_cancel_and_survive_a_restart() {
        let mut b = Book::new(10_000.0, true);
        let soon = b
            .place(
                "n",
                "1",
                None,
                &PlaceOrder {
                    expiry_ms: Some(100),
                    ..pending(Side::Buy, PendingKind::Limit, 1.09)
                },
                1,
            )
            .result
            .unwrap();
        let other = b
            .place(
                "n",
                "1",
                None,
                &PlaceOrder {
                    client_order_id: Some("p2".into()),
                    ..pending(Side::Sell, PendingKind::Limit, 1.11)
                },
                1,
            )
            .result
            .unwrap();
        // Amended: a new price and stops, checked as when placed.
        assert!(
            b.amend(
                "n",
                "1",
                None,
                other.ticket,
                (1.09, None, None, None),
                &None,
                2
            )
            .result
            .is_err(),
            "a sell limit below the market"
        );
        let amended = b.amend(
            "n",
            "1",
            None,
            other.ticket,
            (1.12, Some(1.13), Some(1.10), None),
            &None,
            2,
        );
        assert!(amended.result.is_ok());
        assert_eq!(amended.journal.unwrap().action, "amend");
        let o = b
            .orders("1")
            .into_iter()
            .find(|o| o.ticket == other.ticket)
            .unwrap();
        assert_eq!((o.price, o.sl, o.tp), (1.12, Some(1.13), Some(1.10)));
        // A restart replays the snapshot.
        let mut restarted = Book::new(10_000.0, true);
        for r in b.snapshot() {
            restarted.apply(&r);
        }
        assert_eq!(restarted.orders("1"), b.orders("1"));
        // Expiry passes: gone, nothing opened.
        let (events, _) = b.trigger(100);
        assert_eq!(
            events,
            vec![(
                "1".to_string(),
                PositionChange::OrderGone {
                    ticket: soon.ticket,
                    end: OrderEnd::Expired
                }
            )]
        );
        assert!(b.account("1").unwrap().positions.is_empty());
        // Cancelled; then unknown.
        assert!(
            b.cancel("n", "1", None, other.ticket, &None, 3)
                .result
                .is_ok()
        );
        assert!(b.orders("1").is_empty());
        let again = b
            .cancel("n", "1", None, other.ticket, &None, 4)
            .result
            .unwrap_err();
        assert!(again.starts_with("unknown ticket"), "{again}");
    }

    #[test]
    fn a_repeated_place_is_one_order_unless_deduplication_is_off() {
        for dedupe in [true, false] {
            let mut b = Book::new(10_000.0, true);
            b.set_dedupe(dedupe);
            let o = pending(Side::Buy, PendingKind::Limit, 1.09);
            let first = b.place("n", "1", None, &o, 1).result.unwrap();
            let second = b.place("n", "1", None, &o, 2);
            let r = second.result.unwrap();
            if dedupe {
                assert_eq!((r.ticket, r.duplicate), (first.ticket, true));
                assert!(!second.journal.unwrap().accepted);
                assert_eq!(b.orders("1").len(), 1);
            } else {
                assert_ne!(r.ticket, first.ticket);
                assert_eq!(b.orders("1").len(), 2);
            }
        }
    }

    #[test]
    fn a_ticket_is_never_handed_out_twice_across_restarts() {
        let mut b = Book::new(10_000.0, true);
        let placed = b
            .place(
                "n",
                "1",
                None,
                &pending(Side::Buy, PendingKind::Limit, 1.09),
                1,
            )
            .result
            .unwrap();
        b.cancel("n", "1", None, placed.ticket, &None, 2)
            .result
            .unwrap();
        // Two restarts, each compacting the state file into a snapshot.
        let mut restarted = b;
        for _ in 0..2 {
            let mut next = Book::new(10_000.0, true);
            for r in restarted.snapshot() {
                next.apply(&r);
            }
            restarted = next;
        }
        let again = restarted
            .place(
                "n",
                "1",
                None,
                &PlaceOrder {
                    client_order_id: Some("p2".into()),
                    ..pending(Side::Buy, PendingKind::Limit, 1.09)
                },
                3,
            )
            .result
            .unwrap();
        assert!(again.ticket > placed.ticket, "{} reused", again.ticket);
    }

    #[test]
    fn a_buy_stop_fills_through_its_price_and_orders_expire_without_a_price_move() {
        let mut b = Book::new(10_000.0, true);
        let stop = b
            .place(
                "n",
                "1",
                None,
                &pending(Side::Buy, PendingKind::Stop, 1.1050),
                1,
            )
            .result
            .unwrap();
        let dated = b
            .place(
                "n",
                "1",
                None,
                &PlaceOrder {
                    expiry_ms: Some(50),
                    client_order_id: Some("p2".into()),
                    ..pending(Side::Sell, PendingKind::Limit, 1.2)
                },
                1,
            )
            .result
            .unwrap();
        b.market.set_price("EURUSD", 1.1049, false).unwrap();
        b.trigger(10);
        assert_eq!(b.orders("1").len(), 2, "not through yet");
        b.market.set_price("EURUSD", 1.1060, false).unwrap();
        b.trigger(20);
        assert_eq!(
            b.account("1").unwrap().positions[&stop.ticket].open_price,
            1.1060
        );
        // The prices stand still; the expiry comes.
        let (events, _) = b.expire(49);
        assert!(events.is_empty());
        let (events, _) = b.expire(50);
        assert_eq!(events.len(), 1);
        assert!(b.orders("1").is_empty(), "{dated:?} expired");
    }

    #[test]
    fn a_repeated_cancel_or_amend_returns_its_first_result() {
        let mut b = Book::new(10_000.0, true);
        let placed = b
            .place(
                "n",
                "1",
                None,
                &pending(Side::Buy, PendingKind::Limit, 1.09),
                1,
            )
            .result
            .unwrap();
        let id = Some("a1".to_string());
        let first = b.amend(
            "n",
            "1",
            None,
            placed.ticket,
            (1.08, None, None, None),
            &id,
            2,
        );
        assert!(!first.result.unwrap().duplicate);
        let again = b.amend(
            "n",
            "1",
            None,
            placed.ticket,
            (1.07, None, None, None),
            &id,
            3,
        );
        assert!(again.result.unwrap().duplicate);
        assert_eq!(b.orders("1")[0].price, 1.08, "the repeat changed nothing");
        let id = Some("c1".to_string());
        assert!(
            !b.cancel("n", "1", None, placed.ticket, &id, 4)
                .result
                .unwrap()
                .duplicate
        );
        let repeat = b.cancel("n", "1", None, placed.ticket, &id, 5);
        assert!(
            repeat.result.unwrap().duplicate,
            "a retried cancel is told it was done, not that the order is unknown"
        );
    }

    #[test]
    fn a_stop_jumped_past_closes_at_the_market_price() {
        let mut b = Book::new(10_000.0, true);
        let fill = b
            .open(
                "n",
                "1",
                None,
                &OpenOrder {
                    sl: Some(1.09),
                    client_order_id: None,
                    ..order(1.0)
                },
                1,
            )
            .result
            .unwrap();
        b.market.set_price("EURUSD", 1.08, false).unwrap();
        let (events, _) = b.trigger(2);
        let PositionChange::Closed { closed } = &events[0].1 else {
            panic!("{events:?}");
        };
        assert_eq!(
            (closed.position.ticket, closed.close_price),
            (fill.ticket, 1.08)
        );
        assert!(
            b.info("1").unwrap().balance < 10_000.0,
            "a loss, not a gain"
        );
    }
}
