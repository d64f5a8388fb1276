//! The script: each check in order on one connection, and a second connection that the
//! unknown-outcome check drops with an order in flight.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::time::Instant;

use super::wire::{Answer, Frame, Wire};
use super::{Check, Options, Outcome};

/// Every check the script reports, in its order.
pub const CHECKS: [&str; 14] = [
    "hello",
    "login",
    "account",
    "symbols",
    "open",
    "partial_close",
    "stops",
    "close",
    "history",
    "events",
    "pending",
    "unknown_outcome",
    "refusals",
    "logout",
];

/// How often the unknown-outcome check reads positions while it looks for its order.
const LOOK_EVERY: Duration = Duration::from_millis(100);

type Step<T> = Result<(T, String), String>;

/// The symbol the script trades, as the bridge listed it.
#[derive(Debug)]
struct Symbol {
    name: String,
    price: f64,
    step: f64,
    min: f64,
}

/// The position the script opened: its ticket, what remains after the partial close, volumes.
struct Traded {
    ticket: i64,
    part: f64,
    rest: f64,
    remainder: i64,
}

pub(super) struct Script<'a> {
    o: &'a Options,
    nonce: u64,
    magic: i64,
    checks: Vec<Check>,
}

impl<'a> Script<'a> {
    pub(super) fn new(o: &'a Options) -> Self {
        let nonce = crate::wall_clock::unix_ms().unsigned_abs() % 10_000_000_000;
        Script {
            o,
            nonce,
            // Within MT4's 32-bit magic numbers.
            magic: 770_000_000 + (nonce % 10_000_000) as i64,
            checks: Vec::new(),
        }
    }

    /// The comment marking one of the script's orders (at most 15 characters: MT5 keeps 31).
    fn marker(&self, tag: &str) -> String {
        format!("bc{}{tag}", self.nonce)
    }

    fn order_id(&self, tag: &str) -> String {
        format!("bridge-check-{}-{tag}", self.nonce)
    }

    fn record<T>(&mut self, name: &'static str, step: Step<T>) -> Option<T> {
        match step {
            Ok((value, detail)) => {
                self.push(name, Outcome::Passed, detail);
                Some(value)
            }
            Err(detail) => {
                self.push(name, Outcome::Failed, detail);
                None
            }
        }
    }

    fn push(&mut self, check: &'static str, result: Outcome, detail: String) {
        self.checks.push(Check {
            check,
            result,
            detail,
        });
    }

    /// Every check of [`CHECKS`] in order; those not reached are failed, saying why.
    fn finish(mut self) -> Vec<Check> {
        let mut ordered = Vec::new();
        for name in CHECKS {
            match self.checks.iter().position(|c| c.check == name) {
                Some(at) => ordered.push(self.checks.swap_remove(at)),
                None => ordered.push(Check {
                    check: name,
                    result: Outcome::Failed,
                    detail: "not reached: a check it needs failed".to_string(),
                }),
            }
        }
        ordered
    }

    pub(super) async fn run(mut self) -> Vec<Check> {
        let mut wire = match Wire::connect(&self.o.server, self.o.timeout).await {
            Ok(wire) => wire,
            Err(e) => {
                self.push("hello", Outcome::Failed, e);
                return self.finish();
            }
        };
        let hello = self.hello(&mut wire).await;
        if self.record("hello", hello).is_none() {
            return self.finish();
        }
        let login = self.login(&mut wire).await;
        if self.record("login", login).is_none() {
            return self.finish();
        }
        let account = self.account(&mut wire).await;
        self.record("account", account);
        let symbols = self.symbols(&mut wire).await;
        let Some(symbol) = self.record("symbols", symbols) else {
            return self.finish();
        };

        let open = self.open(&mut wire, &symbol).await;
        if let Some((ticket, volume)) = self.record("open", open) {
            let partial = self.partial_close(&mut wire, &symbol, ticket, volume).await;
            if let Some(traded) = self.record("partial_close", partial) {
                let stops = self.stops(&mut wire, &symbol, traded.remainder).await;
                self.record("stops", stops);
                let close = self.close(&mut wire, &traded).await;
                if self.record("close", close).is_some() {
                    let history = self.history(&mut wire, &traded).await;
                    self.record("history", history);
                    let events = self.events(&mut wire, &traded).await;
                    self.record("events", events);
                }
            }
        }
        match self.pending(&mut wire, &symbol).await {
            Ok(Some(detail)) => self.push("pending", Outcome::Passed, detail),
            Ok(None) => self.push(
                "pending",
                Outcome::NotOffered,
                "the bridge answers `orders` as one older than pending orders (invalid)"
                    .to_string(),
            ),
            Err(detail) => self.push("pending", Outcome::Failed, detail),
        }
        let unknown = self.unknown_outcome(&mut wire, &symbol).await;
        self.record("unknown_outcome", unknown);
        let refusals = self.refusals(&mut wire, &symbol).await;
        self.record("refusals", refusals);
        self.clean_up(&mut wire).await;
        let logout = async {
            wire.request("logout", json!({ "login": self.o.login }))
                .await?
                .done("logout")?;
            Ok(((), "logged out".to_string()))
        }
        .await;
        self.record("logout", logout);
        self.finish()
    }

    async fn hello(&self, wire: &mut Wire) -> Step<()> {
        let r = wire
            .request("hello", json!({ "client": "bridge-check", "protocol": 1 }))
            .await?
            .done("hello")?;
        if r.get("protocol").and_then(Value::as_u64) != Some(1) {
            return Err(format!("protocol {:?}, expected 1", r.get("protocol")));
        }
        let server = r
            .get("server")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("no `server` name in the reply: {r}"))?;
        let features: Vec<String> = match r.get("features") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(list)) => list
                .iter()
                .map(|f| {
                    f.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| format!("a feature that is not a name: {f}"))
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(format!("`features` is not a list: {other}")),
        };
        Ok((
            (),
            format!(
                "protocol 1, server {server:?}, features [{}]",
                features.join(", ")
            ),
        ))
    }

    fn login_fields(&self) -> Value {
        let mut fields = json!({ "login": self.o.login, "fence": null });
        if let Some(password) = &self.o.password {
            fields["password"] = json!(password);
        }
        fields
    }

    async fn login(&self, wire: &mut Wire) -> Step<()> {
        let r = wire
            .request("login", self.login_fields())
            .await?
            .done("login")?;
        let balance = number(&r, "balance")?;
        let equity = number(&r, "equity")?;
        match r.get("fence") {
            Some(Value::Null) => {}
            Some(f) if f.is_i64() => {}
            Some(f) => return Err(format!("`fence` is neither null nor a number: {f}")),
            None => return Err(format!("no `fence` in the reply (null or a number): {r}")),
        }
        Ok(((), format!("balance {balance}, equity {equity}")))
    }

    async fn account(&self, wire: &mut Wire) -> Step<()> {
        let r = wire
            .request("account", json!({ "login": self.o.login }))
            .await?
            .done("account")?;
        let balance = number(&r, "balance")?;
        let equity = number(&r, "equity")?;
        let mut detail = format!("balance {balance}, equity {equity}");
        match r.get("currency") {
            None | Some(Value::Null) => {}
            Some(Value::String(c)) if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) => {
                detail += &format!(", currency {c}");
            }
            Some(c) => return Err(format!("`currency` is not an ISO 4217 code: {c}")),
        }
        match r.get("server_time_ms") {
            None | Some(Value::Null) => {}
            Some(t) if t.is_i64() => detail += ", server time",
            Some(t) => return Err(format!("`server_time_ms` is not milliseconds: {t}")),
        }
        Ok(((), detail))
    }

    async fn symbols(&self, wire: &mut Wire) -> Step<Symbol> {
        let r = wire.request("symbols", json!({})).await?.done("symbols")?;
        let list = r
            .get("symbols")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("no `symbols` list: {r}"))?;
        let mut problems = Vec::new();
        for s in list {
            if let Err(e) = symbol_spec(s) {
                problems.push(e);
            }
        }
        if !problems.is_empty() {
            return Err(problems.join("; "));
        }
        let chosen = match &self.o.symbol {
            Some(name) => list
                .iter()
                .find(|s| s.get("symbol").and_then(Value::as_str) == Some(name.as_str()))
                .ok_or_else(|| format!("{name} is not among the {} symbols", list.len()))?,
            None => list.first().ok_or("the bridge lists no symbol")?,
        };
        let symbol = symbol_spec(chosen)?;
        let max = number(chosen, "volume_max")?;
        if 3.0 * symbol.min > max + 1e-9 {
            return Err(format!(
                "{}: the script trades three times the minimum volume {}, above the maximum {max}",
                symbol.name, symbol.min
            ));
        }
        let detail = format!(
            "{} symbols, each with a positive price, volume step, minimum, maximum and contract size; trading {}",
            list.len(),
            symbol.name
        );
        Ok((symbol, detail))
    }

    async fn positions(&self, wire: &mut Wire) -> Result<Vec<Value>, String> {
        let r = wire
            .request("positions", json!({ "login": self.o.login }))
            .await?
            .done("positions")?;
        r.get("positions")
            .and_then(Value::as_array)
            .cloned()
            .ok_or_else(|| format!("no `positions` list: {r}"))
    }

    fn open_fields(&self, symbol: &str, volume: f64, tag: &str) -> Value {
        json!({
            "login": self.o.login, "fence": null, "symbol": symbol, "side": "buy",
            "volume": volume, "sl": null, "tp": null, "magic": self.magic,
            "comment": self.marker(tag), "client_order_id": self.order_id(tag),
        })
    }

    async fn open(&self, wire: &mut Wire, symbol: &Symbol) -> Step<(i64, f64)> {
        let volume = on_step(3.0 * symbol.min, symbol.step);
        let r = wire
            .request("open", self.open_fields(&symbol.name, volume, "o"))
            .await?
            .done("the open")?;
        let ticket = ticket(&r)?;
        number(&r, "price")?;
        let positions = self.positions(wire).await?;
        let p = positions
            .iter()
            .find(|p| p.get("ticket").and_then(Value::as_i64) == Some(ticket))
            .ok_or_else(|| format!("ticket {ticket} is not among the positions"))?;
        let mut wrong = Vec::new();
        if p.get("symbol").and_then(Value::as_str) != Some(symbol.name.as_str()) {
            wrong.push(format!("symbol {}", p["symbol"]));
        }
        if p.get("side").and_then(Value::as_str) != Some("buy") {
            wrong.push(format!("side {}", p["side"]));
        }
        if !same(p.get("volume").and_then(Value::as_f64), volume) {
            wrong.push(format!("volume {} (sent {volume})", p["volume"]));
        }
        wrong.extend(self.marker_problems(p, "o"));
        if !wrong.is_empty() {
            return Err(format!("position {ticket}: {}", wrong.join(", ")));
        }
        Ok((
            (ticket, volume),
            format!("ticket {ticket}, {volume} lots, magic and comment kept"),
        ))
    }

    /// What differs from the script's marker `tag` on a position or order.
    fn marker_problems(&self, p: &Value, tag: &str) -> Vec<String> {
        let mut wrong = Vec::new();
        if p.get("magic").and_then(Value::as_i64) != Some(self.magic) {
            wrong.push(format!("magic {} (sent {})", p["magic"], self.magic));
        }
        if p.get("comment").and_then(Value::as_str) != Some(self.marker(tag).as_str()) {
            wrong.push(format!(
                "comment {} (sent {:?})",
                p["comment"],
                self.marker(tag)
            ));
        }
        wrong
    }

    async fn partial_close(
        &self,
        wire: &mut Wire,
        symbol: &Symbol,
        ticket: i64,
        volume: f64,
    ) -> Step<Traded> {
        let part = symbol.min;
        let rest = on_step(volume - part, symbol.step);
        let r = wire
            .request(
                "close",
                json!({
                    "login": self.o.login, "fence": null, "ticket": ticket, "volume": part,
                    "client_order_id": self.order_id("part"),
                }),
            )
            .await?
            .done("the partial close")?;
        if !same(r.get("closed_volume").and_then(Value::as_f64), part)
            || !same(r.get("remaining_volume").and_then(Value::as_f64), rest)
        {
            return Err(format!(
                "closed {} and {} remaining, expected {part} and {rest}",
                r["closed_volume"], r["remaining_volume"]
            ));
        }
        let positions = self.positions(wire).await?;
        let traded = |remainder| Traded {
            ticket,
            part,
            rest,
            remainder,
        };
        if let Some(p) = positions
            .iter()
            .find(|p| p.get("ticket").and_then(Value::as_i64) == Some(ticket))
        {
            let mut wrong = self.marker_problems(p, "o");
            if !same(p.get("volume").and_then(Value::as_f64), rest) {
                wrong.push(format!("volume {} (expected {rest})", p["volume"]));
            }
            if !wrong.is_empty() {
                return Err(format!("remainder {ticket}: {}", wrong.join(", ")));
            }
            return Ok((
                traded(ticket),
                format!("ticket {ticket} kept with its marker, {rest} lots remain"),
            ));
        }
        // MT4 gives the remainder a new ticket and the comment `from #<old>`; the magic stays.
        let lineage = format!("from #{ticket}");
        let renumbered = positions.iter().find(|p| {
            p.get("magic").and_then(Value::as_i64) == Some(self.magic)
                && matches!(p.get("comment").and_then(Value::as_str),
                    Some(c) if c == self.marker("o") || c == lineage)
        });
        match renumbered {
            Some(p) => {
                let remainder = p.get("ticket").and_then(Value::as_i64).unwrap_or(0);
                if !same(p.get("volume").and_then(Value::as_f64), rest) {
                    return Err(format!(
                        "remainder {remainder}: volume {} (expected {rest})",
                        p["volume"]
                    ));
                }
                Ok((
                    traded(remainder),
                    format!(
                        "renumbered as MT4 does: remainder {remainder} ({rest} lots) with comment {}",
                        p["comment"]
                    ),
                ))
            }
            None => Err(format!(
                "no position carries the marker after the partial close: ticket {ticket} is gone and no position has magic {} with comment {:?} or {lineage:?}",
                self.magic,
                self.marker("o")
            )),
        }
    }

    async fn stops(&self, wire: &mut Wire, symbol: &Symbol, ticket: i64) -> Step<()> {
        let (sl, tp) = (
            round_price(symbol.price * 0.95, symbol.price),
            round_price(symbol.price * 1.05, symbol.price),
        );
        wire.request(
            "modify",
            json!({
                "login": self.o.login, "fence": null, "ticket": ticket, "sl": sl, "tp": tp,
                "client_order_id": self.order_id("stops"),
            }),
        )
        .await?
        .done("the stop change")?;
        let positions = self.positions(wire).await?;
        let p = positions
            .iter()
            .find(|p| p.get("ticket").and_then(Value::as_i64) == Some(ticket))
            .ok_or_else(|| format!("ticket {ticket} is gone after the stop change"))?;
        let near = |key: &str, want: f64| {
            p.get(key)
                .and_then(Value::as_f64)
                .is_some_and(|v| (v - want).abs() <= symbol.price * 1e-6)
        };
        if !near("sl", sl) || !near("tp", tp) {
            return Err(format!(
                "ticket {ticket} shows sl {} and tp {}, set to {sl} and {tp}",
                p["sl"], p["tp"]
            ));
        }
        Ok(((), format!("sl {sl} and tp {tp} on ticket {ticket}")))
    }

    async fn close(&self, wire: &mut Wire, traded: &Traded) -> Step<()> {
        let ticket = traded.remainder;
        let r = wire
            .request(
                "close",
                json!({
                    "login": self.o.login, "fence": null, "ticket": ticket, "volume": null,
                    "client_order_id": self.order_id("close"),
                }),
            )
            .await?
            .done("the close")?;
        if !same(r.get("remaining_volume").and_then(Value::as_f64), 0.0) {
            return Err(format!(
                "{} lots remain after closing all of {ticket}",
                r["remaining_volume"]
            ));
        }
        let positions = self.positions(wire).await?;
        if let Some(p) = positions
            .iter()
            .find(|p| p.get("magic").and_then(Value::as_i64) == Some(self.magic))
        {
            return Err(format!("a position with the marker is still open: {p}"));
        }
        Ok(((), format!("ticket {ticket} closed")))
    }

    async fn history(&self, wire: &mut Wire, traded: &Traded) -> Step<()> {
        let r = wire
            .request("history", json!({ "login": self.o.login }))
            .await?
            .done("history")?;
        let list = r
            .get("history")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("no `history` list: {r}"))?;
        let renumbered = traded.remainder != traded.ticket;
        let marker = self.marker("o");
        // As MT4 rewrites them: `to #<new>` on the closed part, `from #<old>` on the remainder.
        let mapped = |c: &str| {
            c == marker
                || (renumbered
                    && (c == format!("to #{}", traded.remainder)
                        || c == format!("from #{}", traded.ticket)))
        };
        let entry = |ticket: i64, volume: f64| {
            list.iter().find(|h| {
                h.get("ticket").and_then(Value::as_i64) == Some(ticket)
                    && same(h.get("volume").and_then(Value::as_f64), volume)
                    && h.get("magic").and_then(Value::as_i64) == Some(self.magic)
            })
        };
        let mut wrong = Vec::new();
        for (what, ticket, volume) in [
            ("the partial close", traded.ticket, traded.part),
            ("the close", traded.remainder, traded.rest),
        ] {
            match entry(ticket, volume) {
                None => wrong.push(format!(
                    "{what} (ticket {ticket}, {volume} lots, magic {}) is not in the history",
                    self.magic
                )),
                Some(h) => {
                    let comment = h.get("comment").and_then(Value::as_str).unwrap_or("");
                    if !mapped(comment) {
                        wrong.push(format!("{what}'s entry has the comment {comment:?}"));
                    }
                    if h.get("closed_by").and_then(Value::as_str) != Some("client") {
                        wrong.push(format!("{what}'s entry says closed_by {}", h["closed_by"]));
                    }
                    if h.get("close_price").and_then(Value::as_f64).is_none() {
                        wrong.push(format!("{what}'s entry has no close_price"));
                    }
                }
            }
        }
        if !wrong.is_empty() {
            return Err(wrong.join("; "));
        }
        Ok((
            (),
            format!(
                "the partial close and the close are in the history with the marker{}",
                if renumbered { " (MT4's lineage)" } else { "" }
            ),
        ))
    }

    async fn events(&self, wire: &mut Wire, traded: &Traded) -> Step<()> {
        let login = self.o.login.clone();
        let about = move |e: &Value, change: &str, ticket: i64| {
            e.get("event").and_then(Value::as_str) == Some("position")
                && e.get("login").and_then(Value::as_str) == Some(login.as_str())
                && e.get("change").and_then(Value::as_str) == Some(change)
                && ["position", "closed"].iter().any(|k| {
                    e.get(*k)
                        .and_then(|p| p.get("ticket"))
                        .and_then(Value::as_i64)
                        == Some(ticket)
                })
        };
        let (t, r) = (traded.ticket, traded.remainder);
        let about2 = about.clone();
        let opened = wire.wait_event(move |e| about2(e, "opened", t)).await?;
        let about3 = about.clone();
        let partial = wire
            .wait_event(move |e| {
                about3(e, "partially_closed", t) || (r != t && about3(e, "closed", t))
            })
            .await?;
        let about4 = about.clone();
        let closed = wire.wait_event(move |e| about4(e, "closed", r)).await?;
        let modified = wire.wait_event(move |e| about(e, "modified", r)).await?;
        let within = self.o.timeout;
        let (Some(opened), Some(partial), Some(closed)) = (opened, partial, closed) else {
            return Err(format!(
                "within {within:?} of each: opened {}, partially closed {}, closed {}",
                seen(opened),
                seen(partial),
                seen(closed)
            ));
        };
        if modified.is_none() {
            return Err(format!(
                "no `modified` event for ticket {r} within {within:?}"
            ));
        }
        if !(opened < partial && partial < closed) {
            return Err(format!(
                "out of order: opened at frame {opened}, partially closed at {partial}, closed at {closed}"
            ));
        }
        let replies = wire
            .frames
            .iter()
            .filter(|f| matches!(f, Frame::Reply))
            .count();
        Ok((
            (),
            format!(
                "opened, modified, partially closed and closed, in order, among {replies} replies"
            ),
        ))
    }

    /// `None`: the bridge does not offer pending orders.
    async fn pending(&self, wire: &mut Wire, symbol: &Symbol) -> Result<Option<String>, String> {
        match wire
            .request("orders", json!({ "login": self.o.login }))
            .await?
        {
            Answer::Refused { kind, .. } if kind == "invalid" => return Ok(None),
            answer => {
                answer.done("orders")?;
            }
        }
        let price = round_price(symbol.price * 0.9, symbol.price);
        let r = wire
            .request(
                "place",
                json!({
                    "login": self.o.login, "fence": null, "symbol": symbol.name, "side": "buy",
                    "kind": "limit", "price": price, "volume": symbol.min, "sl": null,
                    "tp": null, "magic": self.magic, "comment": self.marker("p"),
                    "client_order_id": self.order_id("place"),
                }),
            )
            .await?
            .done("the place")?;
        let ticket = ticket(&r)?;
        let order = self
            .order(wire, ticket)
            .await?
            .ok_or_else(|| format!("order {ticket} is not among the pending orders"))?;
        let mut wrong = self.marker_problems(&order, "p");
        if !near_price(&order, price, symbol.price) {
            wrong.push(format!("price {} (placed at {price})", order["price"]));
        }
        if order.get("kind").and_then(Value::as_str) != Some("limit") {
            wrong.push(format!("kind {}", order["kind"]));
        }
        if !wrong.is_empty() {
            return Err(format!("order {ticket}: {}", wrong.join(", ")));
        }
        let amended = round_price(symbol.price * 0.89, symbol.price);
        wire.request(
            "amend",
            json!({
                "login": self.o.login, "fence": null, "ticket": ticket, "price": amended,
                "sl": null, "tp": null, "client_order_id": self.order_id("amend"),
            }),
        )
        .await?
        .done("the amend")?;
        match self.order(wire, ticket).await? {
            Some(o) if near_price(&o, amended, symbol.price) => {}
            Some(o) => {
                return Err(format!(
                    "order {ticket} shows price {} after the amend to {amended}",
                    o["price"]
                ));
            }
            None => return Err(format!("order {ticket} is gone after the amend")),
        }
        wire.request(
            "cancel",
            json!({
                "login": self.o.login, "fence": null, "ticket": ticket,
                "client_order_id": self.order_id("cancel"),
            }),
        )
        .await?
        .done("the cancel")?;
        if self.order(wire, ticket).await?.is_some() {
            return Err(format!("order {ticket} is still listed after the cancel"));
        }
        Ok(Some(format!(
            "order {ticket} placed with its marker, amended and cancelled"
        )))
    }

    async fn order(&self, wire: &mut Wire, ticket: i64) -> Result<Option<Value>, String> {
        let r = wire
            .request("orders", json!({ "login": self.o.login }))
            .await?
            .done("orders")?;
        let list = r
            .get("orders")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("no `orders` list: {r}"))?;
        Ok(list
            .iter()
            .find(|o| o.get("ticket").and_then(Value::as_i64) == Some(ticket))
            .cloned())
    }

    /// Positions carrying the marker `tag`.
    async fn marked(&self, wire: &mut Wire, tag: &str) -> Result<usize, String> {
        let comment = self.marker(tag);
        Ok(self
            .positions(wire)
            .await?
            .iter()
            .filter(|p| {
                p.get("magic").and_then(Value::as_i64) == Some(self.magic)
                    && p.get("comment").and_then(Value::as_str) == Some(comment.as_str())
            })
            .count())
    }

    async fn unknown_outcome(&self, wire: &mut Wire, symbol: &Symbol) -> Step<()> {
        let mut other = Wire::connect(&self.o.server, self.o.timeout).await?;
        other
            .request("hello", json!({ "client": "bridge-check", "protocol": 1 }))
            .await?
            .done("hello on a second connection")?;
        other
            .request("login", self.login_fields())
            .await?
            .done("login on a second connection")?;
        let fields = self.open_fields(&symbol.name, symbol.min, "u");
        other.send("open", fields.clone()).await?;
        drop(other);
        // Its outcome is unknown: look for it by its marker before anything else.
        let deadline = Instant::now() + self.o.timeout;
        let mut found = self.marked(wire, "u").await?;
        while found == 0 && Instant::now() < deadline {
            tokio::time::sleep(LOOK_EVERY).await;
            found = self.marked(wire, "u").await?;
        }
        let detail = if found == 0 {
            wire.request("open", fields)
                .await?
                .done("the open sent again")?;
            "not executed when its connection dropped; sent again once"
        } else {
            "executed although its connection dropped; found by its marker, not sent again"
        };
        // A bridge that executes the dropped order late, or twice, shows it within a look or two.
        tokio::time::sleep(LOOK_EVERY * 3).await;
        let count = self.marked(wire, "u").await?;
        if count != 1 {
            return Err(format!(
                "{count} positions carry the marker {:?}: one order was executed {count} times",
                self.marker("u")
            ));
        }
        Ok(((), detail.to_string()))
    }

    async fn refusals(&self, wire: &mut Wire, symbol: &Symbol) -> Step<()> {
        let cases = [
            (
                "unknown_symbol",
                "open",
                self.open_fields("BRIDGECHECK.NONE", symbol.min, "r1"),
            ),
            (
                "invalid_volume",
                "open",
                self.open_fields(&symbol.name, symbol.min + symbol.step / 2.0, "r2"),
            ),
            (
                "unknown_ticket",
                "close",
                json!({
                    "login": self.o.login, "fence": null, "ticket": 987_654_321_987_i64,
                    "volume": null, "client_order_id": self.order_id("r3"),
                }),
            ),
        ];
        let mut wrong = Vec::new();
        for (code, op, fields) in cases {
            match wire.request(op, fields).await? {
                Answer::Done(r) => wrong.push(format!("the {code} case was executed: {r}")),
                Answer::Refused {
                    kind,
                    code: got,
                    reason,
                } => {
                    if kind != "rejected" || got.as_deref() != Some(code) {
                        wrong.push(format!(
                            "the {code} case was refused as {kind:?} with code {got:?} ({reason})"
                        ));
                    }
                }
            }
        }
        for tag in ["r1", "r2"] {
            if self.marked(wire, tag).await? > 0 {
                wrong.push(format!("a refused open ({tag}) is among the positions"));
            }
        }
        if !wrong.is_empty() {
            return Err(wrong.join("; "));
        }
        Ok((
            (),
            "an unknown symbol, a volume off the step and an unknown ticket: each rejected with its code, nothing executed"
                .to_string(),
        ))
    }

    /// Closes what the script left open and cancels what it left resting (nothing, when every
    /// check passed); errors are ignored, a failed check already said what went wrong.
    async fn clean_up(&self, wire: &mut Wire) {
        let mine = |v: &Value| v.get("magic").and_then(Value::as_i64) == Some(self.magic);
        if let Ok(positions) = self.positions(wire).await {
            for p in positions.iter().filter(|p| mine(p)) {
                let _ = wire
                    .request(
                        "close",
                        json!({
                            "login": self.o.login, "fence": null, "ticket": p["ticket"],
                            "volume": null, "client_order_id": null,
                        }),
                    )
                    .await;
            }
        }
        if let Ok(Answer::Done(r)) = wire
            .request("orders", json!({ "login": self.o.login }))
            .await
        {
            let orders = r.get("orders").and_then(Value::as_array).cloned();
            for o in orders.unwrap_or_default().iter().filter(|o| mine(o)) {
                let _ = wire
                    .request(
                        "cancel",
                        json!({
                            "login": self.o.login, "fence": null, "ticket": o["ticket"],
                            "client_order_id": null,
                        }),
                    )
                    .await;
            }
        }
    }
}

fn number(v: &Value, key: &str) -> Result<f64, String> {
    v.get(key)
        .and_then(Value::as_f64)
        .ok_or_else(|| format!("no number `{key}` in {v}"))
}

fn ticket(r: &Value) -> Result<i64, String> {
    r.get("ticket")
        .and_then(Value::as_i64)
        .ok_or_else(|| format!("the reply has no ticket: {r}"))
}

/// A symbol's trading figures, checked.
fn symbol_spec(s: &Value) -> Result<Symbol, String> {
    let name = s
        .get("symbol")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("a symbol without a name: {s}"))?;
    let f = |key: &str| number(s, key).map_err(|e| format!("{name}: {e}"));
    let (price, step, min, max, contract) = (
        f("price")?,
        f("volume_step")?,
        f("volume_min")?,
        f("volume_max")?,
        f("contract_size")?,
    );
    if !(price > 0.0 && step > 0.0 && min > 0.0 && max >= min && contract > 0.0) {
        return Err(format!(
            "{name}: price {price}, volume step {step}, minimum {min}, maximum {max}, contract size {contract} (each must be positive, the maximum at least the minimum)"
        ));
    }
    let steps = min / step;
    if (steps - steps.round()).abs() > 1e-6 {
        return Err(format!(
            "{name}: the minimum volume {min} is not a multiple of the step {step}"
        ));
    }
    Ok(Symbol {
        name: name.to_string(),
        price,
        step,
        min,
    })
}

/// `volume` on the step's grid (removes float noise such as 0.030000000000000002).
fn on_step(volume: f64, step: f64) -> f64 {
    let steps = (volume / step).round();
    (steps * step * 1e8).round() / 1e8
}

/// A price rounded as a quote would be: two decimals from 100 up, else four.
fn round_price(price: f64, reference: f64) -> f64 {
    let scale = if reference >= 100.0 { 100.0 } else { 10_000.0 };
    (price * scale).round() / scale
}

fn near_price(order: &Value, want: f64, reference: f64) -> bool {
    order
        .get("price")
        .and_then(Value::as_f64)
        .is_some_and(|p| (p - want).abs() <= reference * 1e-6)
}

fn same(got: Option<f64>, want: f64) -> bool {
    got.is_some_and(|g| (g - want).abs() < 1e-6)
}

fn seen(at: Option<usize>) -> &'static str {
    if at.is_some() { "seen" } else { "missing" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volumes_land_on_the_step_grid() {
        assert_eq!(on_step(0.1 + 0.2, 0.01), 0.3);
        assert_eq!(on_step(0.03 - 0.01, 0.01), 0.02);
        assert_eq!(on_step(3.0 * 0.1, 0.1), 0.3);
    }

    #[test]
    fn a_symbol_with_a_zero_step_or_an_off_step_minimum_is_refused() {
        let ok = json!({"symbol": "EURUSD", "price": 1.1, "volume_step": 0.01,
                        "volume_min": 0.01, "volume_max": 100.0, "contract_size": 100000.0});
        assert!(symbol_spec(&ok).is_ok());
        let mut zero = ok.clone();
        zero["volume_step"] = json!(0.0);
        assert!(symbol_spec(&zero).unwrap_err().contains("EURUSD"));
        let mut off = ok.clone();
        off["volume_min"] = json!(0.015);
        assert!(
            symbol_spec(&off)
                .unwrap_err()
                .contains("not a multiple of the step")
        );
    }
}
