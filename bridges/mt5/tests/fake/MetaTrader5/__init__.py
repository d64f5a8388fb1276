"""A fake of MetaQuotes' `MetaTrader5` Python package, for tests on machines without Windows
or a terminal.

It is written from MetaQuotes' documentation of the package: the same function names and
signatures, the same named-tuple structures (field names and order), the same constants with the
same values, and the documented failure convention: a function that fails returns `None` (or
`False`) and `last_error()` tells why, with the package's codes (`RES_E_INTERNAL_FAIL_*` for IPC
failures between the Python process and the terminal).

What a test needs that the real package cannot do (a terminal that disconnects, injected trade
server return codes, an `order_send` whose IPC times out, a person trading by hand in the
terminal) is in `MetaTrader5.control`; nothing in this module is beyond the documented API.

Each process keeps its own IPC "connection" (which terminal it initialized, and the last error),
as with the real package; the terminal itself is shared (see `_terminal`).
"""

from __future__ import annotations

import calendar
import datetime as _dt
import fnmatch
import time

from . import _terminal as _t
from ._constants import *  # noqa: F401,F403  (the package exports its constants at top level)
from ._constants import (
    RES_E_AUTH_FAILED,
    RES_E_FAIL,
    RES_E_INTERNAL_FAIL_CONNECT,
    RES_E_INTERNAL_FAIL_INIT,
    RES_E_INTERNAL_FAIL_TIMEOUT,
    RES_E_INVALID_PARAMS,
    RES_S_OK,
    TRADE_RETCODE_DONE,
    TRADE_RETCODE_DONE_PARTIAL,
)
from ._structs import (
    AccountInfo,
    OrderSendResult,
    SymbolInfo,
    Tick,
    TradeDeal,
    TradeOrder,
    TradePosition,
    TradeRequest,
    build,
)

__version__ = "5.0.0-fake"
__author__ = "fake, for tests"

_RETCODE_TEXT = {
    10004: "Requote",
    10006: "Request rejected",
    10008: "Order placed",
    10009: "Request completed",
    10010: "Only part of the request was completed",
    10012: "Request canceled by timeout",
    10013: "Invalid request",
    10014: "Invalid volume in the request",
    10015: "Invalid price in the request",
    10016: "Invalid stops in the request",
    10018: "Market is closed",
    10019: "There is not enough money to complete the request",
    10025: "No changes in request",
    10027: "Autotrading disabled by client terminal",
}

# This process's side of the IPC link.
_link = {"path": None, "epoch": None}
_error = [(RES_S_OK, "Success")]
_request_id = [0]


def _fail(code: int, text: str, value=None):
    _error[0] = (code, text)
    return value


def _ok(value):
    _error[0] = (RES_S_OK, "Success")
    return value


def _session(fn, failed=None):
    """Runs `fn(state)` on the terminal this process initialized, or fails as the package does
    when the IPC link is gone (terminal closed, crashed, or restarted since `initialize`)."""
    if _link["path"] is None or not _t.exists(_link["path"]):
        return _fail(RES_E_INTERNAL_FAIL_CONNECT, "No IPC connection", failed)
    with _t.opened(_link["path"]) as state:
        if not state["connected"] or state["epoch"] != _link["epoch"]:
            return _fail(RES_E_INTERNAL_FAIL_CONNECT, "No IPC connection", failed)
        if state["faults"].get("ipc_timeouts", 0) > 0:
            state["faults"]["ipc_timeouts"] -= 1
            return _fail(RES_E_INTERNAL_FAIL_TIMEOUT, "IPC timeout", failed)
        _t.settle(state)
        return fn(state)


def initialize(path=None, *, login=None, password=None, server=None, timeout=60000,
               portable=False) -> bool:
    """Connects this process to the terminal at `path` (and logs in if `login` is given)."""
    if path is None or not _t.exists(path):
        return _fail(RES_E_INTERNAL_FAIL_INIT,
                     "IPC initialize failed, MetaTrader 5 x64 not found", False)
    with _t.opened(path) as state:
        if not state["connected"]:
            return _fail(RES_E_INTERNAL_FAIL_TIMEOUT, "IPC timeout", False)
        _link.update(path=str(path), epoch=state["epoch"])
    if login is not None:
        return globals()["login"](login, password=password, server=server, timeout=timeout)
    return _ok(True)


def login(login, password=None, server=None, timeout=60000) -> bool:
    """Switches the terminal to account `login`. Without a password, the one saved in the
    terminal is used (if the account has one saved)."""

    def run(state):
        acct = _t.account(state, login)
        if acct is None:
            return _fail(RES_E_AUTH_FAILED, "Terminal: Authorization failed", False)
        given = password if password is not None else (
            acct["password"] if acct.get("password_saved", True) else None)
        if given != acct["password"] or (server is not None and server != acct["server"]):
            return _fail(RES_E_AUTH_FAILED, "Terminal: Authorization failed", False)
        state["active_login"] = int(login)
        return _ok(True)

    return _session(run, False)


def shutdown() -> None:
    _link.update(path=None, epoch=None)
    _ok(None)


def last_error() -> tuple:
    return _error[0]


def version():
    return _session(lambda state: _ok((500, 4000, "1 Jan 2024")))


def account_info():
    def run(state):
        acct = _t.active(state)
        if acct is None:
            return _fail(RES_E_FAIL, "Terminal: Not logged in")
        fl = _t.floating(state, acct)
        used = round(_t.used_margin(state, acct), 2)
        equity = round(acct["balance"] + fl, 2)
        return _ok(build(AccountInfo, {
            "login": int(state["active_login"]),
            "trade_mode": acct.get("trade_mode", 0),
            "leverage": acct["leverage"],
            "limit_orders": 200,
            "trade_allowed": True,
            "trade_expert": state.get("autotrading", True),
            "margin_mode": acct["margin_mode"],
            "currency_digits": 2,
            "balance": acct["balance"],
            "profit": fl,
            "equity": equity,
            "margin": used,
            "margin_free": round(equity - used, 2),
            "margin_level": round(equity / used * 100, 2) if used else 0.0,
            "name": acct.get("name", ""),
            "server": acct["server"],
            "currency": acct["currency"],
            "company": "Fake Markets Ltd",
        }))

    return _session(run)


def _symbol(state, sym: dict) -> SymbolInfo:
    return build(SymbolInfo, {**{k: v for k, v in sym.items() if k in SymbolInfo._fields},
                              "time": _t.now_ms(state) // 1000})


def symbols_total():
    return _session(lambda state: _ok(len(state["symbols"])))


def symbols_get(group=None):
    def run(state):
        names = list(state["symbols"])
        if group:
            names = [n for n in names if _group_match(group, n)]
        return _ok(tuple(_symbol(state, state["symbols"][n]) for n in names))

    return _session(run)


def _group_match(group: str, name: str) -> bool:
    """MT5's group filter: comma-separated masks, `*` wildcards, `!` excludes."""
    matched = False
    for mask in group.split(","):
        mask = mask.strip()
        if mask.startswith("!"):
            if fnmatch.fnmatchcase(name, mask[1:]):
                return False
        elif fnmatch.fnmatchcase(name, mask):
            matched = True
    return matched


def symbol_info(symbol):
    def run(state):
        sym = state["symbols"].get(symbol)
        if sym is None:
            return _fail(RES_E_INVALID_PARAMS, f"Invalid \"{symbol}\" argument")
        return _ok(_symbol(state, sym))

    return _session(run)


def symbol_info_tick(symbol):
    def run(state):
        sym = state["symbols"].get(symbol)
        if sym is None:
            return _fail(RES_E_INVALID_PARAMS, f"Invalid \"{symbol}\" argument")
        t = _t.now_ms(state)
        return _ok(Tick(t // 1000, sym["bid"], sym["ask"], 0.0, 0, t, 6, 0.0))

    return _session(run)


def symbol_select(symbol, enable=True):
    def run(state):
        sym = state["symbols"].get(symbol)
        if sym is None:
            return _fail(RES_E_INVALID_PARAMS, f"Invalid \"{symbol}\" argument", False)
        sym["select"] = sym["visible"] = bool(enable)
        return _ok(True)

    return _session(run, False)


def _filtered(rows, symbol=None, group=None, ticket=None):
    if ticket is not None:
        return [r for r in rows if r["ticket"] == ticket]
    if symbol is not None:
        return [r for r in rows if r["symbol"] == symbol]
    if group is not None:
        return [r for r in rows if _group_match(group, r["symbol"])]
    return list(rows)


def positions_total():
    return _session(lambda state: _ok(len((_t.active(state) or {"positions": []})["positions"])))


def positions_get(symbol=None, group=None, ticket=None):
    def run(state):
        acct = _t.active(state)
        if acct is None:
            return _fail(RES_E_FAIL, "Terminal: Not logged in")
        rows = []
        for p in _filtered(acct["positions"], symbol, group, ticket):
            sym = state["symbols"][p["symbol"]]
            current = _t.close_price(sym, p["type"])
            gain = _t.profit(state, acct, sym, p["type"], p["volume"], p["price_open"], current)
            rows.append(build(TradePosition, {**p, "price_current": current, "profit": gain}))
        return _ok(tuple(rows))

    return _session(run)


def orders_total():
    return _session(lambda state: _ok(len((_t.active(state) or {"orders": []})["orders"])))


def orders_get(symbol=None, group=None, ticket=None):
    def run(state):
        acct = _t.active(state)
        if acct is None:
            return _fail(RES_E_FAIL, "Terminal: Not logged in")
        rows = []
        for o in _filtered(acct["orders"], symbol, group, ticket):
            sym = state["symbols"][o["symbol"]]
            current = _t.open_price(sym, _t.is_buy(o["type"]))
            rows.append(build(TradeOrder, {**o, "price_current": current}))
        return _ok(tuple(rows))

    return _session(run)


def _seconds(when) -> int:
    """A history bound: a `datetime` (read as the server's clock, as the package does with a
    naive one) or seconds since 1970."""
    if isinstance(when, _dt.datetime):
        if when.tzinfo is not None:
            return int(when.timestamp())
        return calendar.timegm(when.timetuple())
    return int(when)


def _history(kind, cls, date_from=None, date_to=None, group=None, ticket=None, position=None):
    def run(state):
        acct = _t.active(state)
        if acct is None:
            return _fail(RES_E_FAIL, "Terminal: Not logged in")
        rows = acct[kind]
        if ticket is not None:
            rows = [r for r in rows if r["ticket"] == ticket]
        elif position is not None:
            rows = [r for r in rows if r.get("position_id") == position]
        elif date_from is not None and date_to is not None:
            lo, hi = _seconds(date_from), _seconds(date_to)
            stamp = "time" if kind == "deals" else "time_setup"
            rows = [r for r in rows if lo <= r[stamp] <= hi]
            if group:
                rows = [r for r in rows if _group_match(group, r["symbol"])]
        else:
            return _fail(RES_E_INVALID_PARAMS, "Invalid arguments")
        return _ok(tuple(build(cls, r) for r in rows))

    return _session(run)


def history_deals_get(date_from=None, date_to=None, group=None, ticket=None, position=None):
    return _history("deals", TradeDeal, date_from, date_to, group, ticket, position)


def history_deals_total(date_from, date_to):
    deals = history_deals_get(date_from, date_to)
    return None if deals is None else len(deals)


def history_orders_get(date_from=None, date_to=None, group=None, ticket=None, position=None):
    return _history("history_orders", TradeOrder, date_from, date_to, group, ticket, position)


def history_orders_total(date_from, date_to):
    orders = history_orders_get(date_from, date_to)
    return None if orders is None else len(orders)


def order_send(request):
    """Sends a trade request to the server. Returns an OrderSendResult whatever the server
    answered (its `retcode` says), or None when the request or its answer was lost between this
    process and the terminal (IPC failure, timeout): then `last_error()` says why, and whether
    the server executed the request is unknown."""
    if not isinstance(request, dict):
        return _fail(RES_E_INVALID_PARAMS, "Invalid arguments")
    delay = _session(lambda state: _ok(state["faults"].get("send_delay_s", 0.0)))
    if delay:
        time.sleep(delay)  # a slow trade server: the terminal is not locked meanwhile

    def run(state):
        acct = _t.active(state)
        if acct is None:
            return _fail(RES_E_FAIL, "Terminal: Not logged in")
        state["stats"]["order_send"] = state["stats"].get("order_send", 0) + 1
        state["stats"]["last_request"] = request
        action = request.get("action", 0)
        lost = _t.take_fault(state, "send_none", action)
        if lost is not None and not lost["execute"]:
            return _fail(RES_E_INTERNAL_FAIL_TIMEOUT, "IPC timeout")
        injected = _t.take_fault(state, "retcodes", action) if lost is None else None
        partial = injected is not None and injected["retcode"] == TRADE_RETCODE_DONE_PARTIAL
        if injected is not None and not partial and not injected["execute"]:
            fields = {"retcode": injected["retcode"]}
        else:
            try:
                done = _t.execute(state, acct, request, partial)
                fields = {"retcode": TRADE_RETCODE_DONE, **done}
            except _t.Refused as refused:
                fields = {"retcode": refused.retcode}
            if partial and fields["retcode"] == TRADE_RETCODE_DONE:
                fields["retcode"] = TRADE_RETCODE_DONE_PARTIAL
            elif injected is not None and injected["execute"] and not partial:
                fields["retcode"] = injected["retcode"]
        if lost is not None:
            return _fail(RES_E_INTERNAL_FAIL_TIMEOUT, "IPC timeout")
        sym = state["symbols"].get(request.get("symbol"), {"bid": 0.0, "ask": 0.0})
        _request_id[0] += 1
        echo = build(TradeRequest, {k: v for k, v in request.items()
                                    if k in TradeRequest._fields})
        return _ok(build(OrderSendResult, {
            "deal": 0, "order": 0, "volume": 0.0, "price": 0.0, **fields,
            "bid": sym["bid"], "ask": sym["ask"],
            "comment": _RETCODE_TEXT.get(fields["retcode"], ""),
            "request_id": _request_id[0],
            "request": echo,
        }))

    return _session(run)


__all__ = [n for n in dir() if not n.startswith("_")]
