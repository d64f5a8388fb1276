"""The fake terminal and the trade server behind it.

A real MetaTrader 5 terminal is one program that several clients reach over IPC: the bridge's
worker process through the Python package, and a person clicking in the terminal's window. The
fake keeps the terminal's whole state in a JSON file beside the terminal path given to
`initialize`, under an exclusive file lock, so that the bridge's worker (another process) and the
tests' "manual trader" (the test process) act on the same terminal, as they would on a real one.

The trade server follows MetaQuotes' documented behaviour for a hedging account: a position keeps
its ticket (the ticket of the order that opened it) through partial closes; every fill is a deal
(DEAL_ENTRY_IN opens, DEAL_ENTRY_OUT closes all or part); comments are cut to 31 characters;
stop-loss and take-profit closes carry the server's own comment (`[sl 1.09000]`) on their deal.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

from . import _constants as c

STATE_NAME = "fake-terminal.json"
COMMENT_MAX = 31
EPS = 1e-9


def state_file(terminal_path: str | os.PathLike) -> Path:
    """Where the terminal at `terminal_path` keeps its state: beside it, as a real terminal keeps
    its data in its installation folder (portable mode)."""
    return Path(terminal_path).parent / STATE_NAME


@contextmanager
def opened(terminal_path: str | os.PathLike):
    """The terminal's state, locked for the duration, written back afterwards."""
    path = state_file(terminal_path)
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(path.read_text())
            yield state
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def exists(terminal_path: str | os.PathLike) -> bool:
    return state_file(terminal_path).exists()


# --- clock and numbers -----------------------------------------------------------------------


def now_ms(state: dict) -> int:
    """The trade server's clock: UTC plus its offset, as MT5 servers keep their own time zone
    and report times as seconds since 1970 on that clock."""
    return int(time.time() * 1000) + int(state.get("utc_offset_ms", 0))


def round_volume(v: float) -> float:
    return round(v + 0.0, 8)


def on_step(volume: float, step: float) -> bool:
    steps = volume / step
    return abs(steps - round(steps)) < 1e-6


def next_ticket(state: dict) -> int:
    state["next_ticket"] += 1
    return state["next_ticket"] - 1


def next_deal(state: dict) -> int:
    state["next_deal"] += 1
    return state["next_deal"] - 1


# --- accounts, symbols, money ----------------------------------------------------------------


def account(state: dict, login) -> dict | None:
    return state["accounts"].get(str(login))


def active(state: dict) -> dict | None:
    login = state.get("active_login")
    return None if login is None else account(state, login)


def is_buy(order_type: int) -> bool:
    return order_type in (
        c.ORDER_TYPE_BUY,
        c.ORDER_TYPE_BUY_LIMIT,
        c.ORDER_TYPE_BUY_STOP,
        c.ORDER_TYPE_BUY_STOP_LIMIT,
    )


def open_price(sym: dict, buy: bool) -> float:
    """Buys fill at the ask, sells at the bid."""
    return sym["ask"] if buy else sym["bid"]


def close_price(sym: dict, position_type: int) -> float:
    """A buy position is closed by a sell (at the bid), a sell by a buy (at the ask)."""
    return sym["bid"] if position_type == c.POSITION_TYPE_BUY else sym["ask"]


def profit(state: dict, acct: dict, sym: dict, position_type: int, volume, opened, closed) -> float:
    sign = 1.0 if position_type == c.POSITION_TYPE_BUY else -1.0
    quote = sign * (closed - opened) * volume * sym["trade_contract_size"]
    if sym["currency_profit"] != acct["currency"] and sym["currency_base"] == acct["currency"]:
        quote = quote / closed if closed else 0.0
    return round(quote, 2)


def floating(state: dict, acct: dict) -> float:
    total = 0.0
    for p in acct["positions"]:
        sym = state["symbols"][p["symbol"]]
        total += profit(state, acct, sym, p["type"], p["volume"], p["price_open"],
                        close_price(sym, p["type"]))
    return round(total, 2)


def margin_for(acct: dict, sym: dict, volume: float, price: float) -> float:
    units = volume * sym["trade_contract_size"]
    if sym["currency_base"] == acct["currency"]:
        return units / acct["leverage"]
    return units * price / acct["leverage"]


def used_margin(state: dict, acct: dict) -> float:
    return sum(
        margin_for(acct, state["symbols"][p["symbol"]], p["volume"], p["price_open"])
        for p in acct["positions"]
    )


# --- what a fill does ------------------------------------------------------------------------


def add_deal(state: dict, acct: dict, **fields) -> dict:
    t = now_ms(state)
    deal = {
        "ticket": next_deal(state),
        "time": t // 1000,
        "time_msc": t,
        "commission": 0.0,
        "swap": 0.0,
        "fee": 0.0,
        "profit": 0.0,
        "external_id": "",
        **fields,
    }
    deal["comment"] = deal.get("comment", "")[:COMMENT_MAX]
    acct["deals"].append(deal)
    return deal


def add_history_order(state: dict, acct: dict, **fields) -> dict:
    t = now_ms(state)
    order = {
        "time_setup": t // 1000,
        "time_setup_msc": t,
        "time_done": t // 1000,
        "time_done_msc": t,
        "time_expiration": 0,
        "type_time": c.ORDER_TIME_GTC,
        "type_filling": c.ORDER_FILLING_FOK,
        "state": c.ORDER_STATE_FILLED,
        "position_by_id": 0,
        "price_current": fields.get("price_open", 0.0),
        "price_stoplimit": 0.0,
        "external_id": "",
        **fields,
    }
    order["comment"] = order.get("comment", "")[:COMMENT_MAX]
    acct["history_orders"].append(order)
    return order


def open_position(state, acct, *, symbol, buy, volume, price, sl, tp, magic, comment, reason,
                  ticket=None) -> tuple[dict, dict]:
    """Opens a position at `price`: its ticket is the opening order's (a pending order's own
    ticket when it fills), and its opening deal carries the order's magic and comment."""
    t = now_ms(state)
    order_ticket = ticket if ticket is not None else next_ticket(state)
    comment = (comment or "")[:COMMENT_MAX]
    position = {
        "ticket": order_ticket,
        "time": t // 1000,
        "time_msc": t,
        "time_update": t // 1000,
        "time_update_msc": t,
        "type": c.POSITION_TYPE_BUY if buy else c.POSITION_TYPE_SELL,
        "magic": magic,
        "identifier": order_ticket,
        "reason": reason,
        "volume": round_volume(volume),
        "price_open": price,
        "sl": sl or 0.0,
        "tp": tp or 0.0,
        "swap": 0.0,
        "symbol": symbol,
        "comment": comment,
        "external_id": "",
    }
    acct["positions"].append(position)
    if ticket is None:
        add_history_order(
            state, acct, ticket=order_ticket,
            type=c.ORDER_TYPE_BUY if buy else c.ORDER_TYPE_SELL, magic=magic,
            position_id=order_ticket, reason=reason, volume_initial=volume, volume_current=0.0,
            price_open=price, sl=sl or 0.0, tp=tp or 0.0, symbol=symbol, comment=comment,
        )
    deal = add_deal(
        state, acct, order=order_ticket, type=c.DEAL_TYPE_BUY if buy else c.DEAL_TYPE_SELL,
        entry=c.DEAL_ENTRY_IN, magic=magic, position_id=order_ticket, reason=reason,
        volume=round_volume(volume), price=price, symbol=symbol, comment=comment,
    )
    return position, deal


def close_part(state, acct, position, volume, price, *, reason, magic, comment) -> dict:
    """Closes `volume` of `position` at `price` by an opposite order: an OUT deal; the position
    keeps its ticket and shrinks, or goes when nothing remains."""
    sym = state["symbols"][position["symbol"]]
    gain = profit(state, acct, sym, position["type"], volume, position["price_open"], price)
    buy_close = position["type"] == c.POSITION_TYPE_SELL
    order_ticket = next_ticket(state)
    add_history_order(
        state, acct, ticket=order_ticket,
        type=c.ORDER_TYPE_BUY if buy_close else c.ORDER_TYPE_SELL, magic=magic,
        position_id=position["ticket"], reason=reason, volume_initial=volume,
        volume_current=0.0, price_open=price, sl=0.0, tp=0.0, symbol=position["symbol"],
        comment=comment,
    )
    deal = add_deal(
        state, acct, order=order_ticket,
        type=c.DEAL_TYPE_BUY if buy_close else c.DEAL_TYPE_SELL, entry=c.DEAL_ENTRY_OUT,
        magic=magic, position_id=position["ticket"], reason=reason,
        volume=round_volume(volume), price=price, profit=gain, symbol=position["symbol"],
        comment=comment,
    )
    acct["balance"] = round(acct["balance"] + gain, 2)
    position["volume"] = round_volume(position["volume"] - volume)
    t = now_ms(state)
    position["time_update"], position["time_update_msc"] = t // 1000, t
    if position["volume"] <= EPS:
        acct["positions"].remove(position)
    return deal


def settle(state: dict) -> None:
    """What the server does on its own at the current prices: expires pending orders, fills the
    ones the price reached, and closes positions whose stop loss or take profit it reached."""
    now_s = now_ms(state) // 1000
    for acct in state["accounts"].values():
        for order in list(acct["orders"]):
            sym = state["symbols"][order["symbol"]]
            expires = order["type_time"] in (c.ORDER_TIME_SPECIFIED, c.ORDER_TIME_SPECIFIED_DAY)
            if expires and order["time_expiration"] and order["time_expiration"] <= now_s:
                retire_order(state, acct, order, c.ORDER_STATE_EXPIRED)
                continue
            if pending_reached(order, sym):
                fill_order(state, acct, order, sym)
        for position in list(acct["positions"]):
            sym = state["symbols"][position["symbol"]]
            price = close_price(sym, position["type"])
            buy = position["type"] == c.POSITION_TYPE_BUY
            sl, tp = position["sl"], position["tp"]
            sl_hit = sl and (price <= sl if buy else price >= sl)
            tp_hit = tp and (price >= tp if buy else price <= tp)
            if sl_hit or tp_hit:
                reason = c.DEAL_REASON_SL if sl_hit else c.DEAL_REASON_TP
                level = sl if sl_hit else tp
                digits = sym["digits"]
                # Brokers' servers put their own comment on stop-loss/take-profit deals.
                tag = f"[{'sl' if sl_hit else 'tp'} {level:.{digits}f}]"
                close_part(state, acct, position, position["volume"], price, reason=reason,
                           magic=position["magic"], comment=tag)


def pending_reached(order: dict, sym: dict) -> bool:
    price = order["price_open"]
    return {
        c.ORDER_TYPE_BUY_LIMIT: sym["ask"] <= price,
        c.ORDER_TYPE_SELL_LIMIT: sym["bid"] >= price,
        c.ORDER_TYPE_BUY_STOP: sym["ask"] >= price,
        c.ORDER_TYPE_SELL_STOP: sym["bid"] <= price,
    }.get(order["type"], False)


def retire_order(state, acct, order, final_state) -> None:
    acct["orders"].remove(order)
    t = now_ms(state)
    done = dict(order, state=final_state, time_done=t // 1000, time_done_msc=t)
    acct["history_orders"].append(done)


def fill_order(state, acct, order, sym) -> None:
    """A pending order that fills opens a position under the order's own ticket."""
    buy = is_buy(order["type"])
    price = open_price(sym, buy)
    acct["orders"].remove(order)
    open_position(
        state, acct, symbol=order["symbol"], buy=buy, volume=order["volume_current"],
        price=price, sl=order["sl"], tp=order["tp"], magic=order["magic"],
        comment=order["comment"], reason=order["reason"], ticket=order["ticket"],
    )
    t = now_ms(state)
    acct["history_orders"].append(dict(
        order, state=c.ORDER_STATE_FILLED, time_done=t // 1000, time_done_msc=t,
        volume_current=0.0, position_id=order["ticket"], price_current=price,
    ))


# --- the trade server's checks and order_send ------------------------------------------------


def check_volume(sym: dict, volume: float) -> bool:
    return (
        volume + EPS >= sym["volume_min"]
        and volume <= sym["volume_max"] + EPS
        and on_step(volume, sym["volume_step"])
    )


def stops_valid(buy: bool, price: float, sl: float, tp: float) -> bool:
    if buy:
        return (not sl or sl < price) and (not tp or tp > price)
    return (not sl or sl > price) and (not tp or tp < price)


def pending_price_valid(order_type: int, price: float, sym: dict) -> bool:
    return {
        c.ORDER_TYPE_BUY_LIMIT: price < sym["ask"],
        c.ORDER_TYPE_SELL_LIMIT: price > sym["bid"],
        c.ORDER_TYPE_BUY_STOP: price > sym["ask"],
        c.ORDER_TYPE_SELL_STOP: price < sym["bid"],
    }.get(order_type, False)


def filling_allowed(sym: dict, filling: int) -> bool:
    # SYMBOL_FILLING_FOK = 1, SYMBOL_FILLING_IOC = 2 (flags of SymbolInfo.filling_mode).
    if filling == c.ORDER_FILLING_FOK:
        return bool(sym["filling_mode"] & 1)
    if filling == c.ORDER_FILLING_IOC:
        return bool(sym["filling_mode"] & 2)
    return True


class Refused(Exception):
    """The server refused the request with this retcode and changed nothing."""

    def __init__(self, retcode: int):
        super().__init__(retcode)
        self.retcode = retcode


def take_fault(state: dict, kind: str, action: int) -> dict | None:
    """The next injected fault of `kind` that applies to `action` (each is used `count` times)."""
    for fault in state["faults"][kind]:
        if fault["action"] in (None, action) and fault["count"] > 0:
            fault["count"] -= 1
            return fault
    return None


def execute(state: dict, acct: dict, req: dict, partial: bool) -> dict:
    """Carries out one trade request on the active account; raises Refused with the server's
    retcode. Returns the MqlTradeResult fields of an accepted request."""
    action = req.get("action", 0)
    if not state.get("autotrading", True):
        raise Refused(c.TRADE_RETCODE_CLIENT_DISABLES_AT)
    if action == c.TRADE_ACTION_DEAL:
        return deal_request(state, acct, req, partial)
    if action == c.TRADE_ACTION_SLTP:
        return sltp_request(state, acct, req)
    if action == c.TRADE_ACTION_PENDING:
        return pending_request(state, acct, req)
    if action == c.TRADE_ACTION_MODIFY:
        return modify_request(state, acct, req)
    if action == c.TRADE_ACTION_REMOVE:
        return remove_request(state, acct, req)
    raise Refused(c.TRADE_RETCODE_INVALID)


def find_position(state, acct, ticket) -> dict:
    for p in acct["positions"]:
        if p["ticket"] == ticket:
            return p
    if any(d["position_id"] == ticket for d in acct["deals"]):
        raise Refused(c.TRADE_RETCODE_POSITION_CLOSED)
    raise Refused(c.TRADE_RETCODE_INVALID)


def find_order(acct, ticket) -> dict:
    for o in acct["orders"]:
        if o["ticket"] == ticket:
            return o
    raise Refused(c.TRADE_RETCODE_INVALID)


def symbol_for(state, name) -> dict:
    sym = state["symbols"].get(name)
    if sym is None:
        raise Refused(c.TRADE_RETCODE_INVALID)
    if not sym.get("market_open", True):
        raise Refused(c.TRADE_RETCODE_MARKET_CLOSED)
    return sym


def check_deviation(req: dict, market: float, sym: dict) -> None:
    """Instant execution: a requested price further from the market than `deviation` points
    is requoted."""
    asked = req.get("price") or 0.0
    if asked and abs(asked - market) > (req.get("deviation", 0) + 0.5) * sym["point"]:
        raise Refused(c.TRADE_RETCODE_REQUOTE)


def partial_volume(volume: float, sym: dict) -> float:
    half = math.floor(volume / 2 / sym["volume_step"] + 1e-6) * sym["volume_step"]
    return round_volume(max(half, sym["volume_min"]))


def deal_request(state, acct, req, partial) -> dict:
    volume = float(req.get("volume", 0.0))
    order_type = req.get("type", -1)
    if order_type not in (c.ORDER_TYPE_BUY, c.ORDER_TYPE_SELL):
        raise Refused(c.TRADE_RETCODE_INVALID_ORDER)
    buy = order_type == c.ORDER_TYPE_BUY
    if not filling_allowed(state["symbols"].get(req.get("symbol"), {"filling_mode": 3}),
                           req.get("type_filling", c.ORDER_FILLING_FOK)):
        raise Refused(c.TRADE_RETCODE_INVALID_FILL)
    if req.get("position"):
        position = find_position(state, acct, req["position"])
        same_side = (position["type"] == c.POSITION_TYPE_BUY) == buy
        if req.get("symbol") != position["symbol"] or same_side:
            raise Refused(c.TRADE_RETCODE_INVALID)
        sym = symbol_for(state, position["symbol"])
        if not check_volume(sym, volume):
            raise Refused(c.TRADE_RETCODE_INVALID_VOLUME)
        if volume > position["volume"] + EPS:
            raise Refused(c.TRADE_RETCODE_INVALID_CLOSE_VOLUME)
        price = close_price(sym, position["type"])
        check_deviation(req, price, sym)
        filled = partial_volume(volume, sym) if partial else volume
        deal = close_part(state, acct, position, filled, price, reason=c.DEAL_REASON_EXPERT,
                          magic=req.get("magic", 0), comment=req.get("comment", ""))
        return {"deal": deal["ticket"], "order": deal["order"], "volume": filled, "price": price}
    sym = symbol_for(state, req.get("symbol"))
    mode = sym["trade_mode"]
    if mode == c.SYMBOL_TRADE_MODE_DISABLED:
        raise Refused(c.TRADE_RETCODE_TRADE_DISABLED)
    if mode == c.SYMBOL_TRADE_MODE_CLOSEONLY:
        raise Refused(c.TRADE_RETCODE_CLOSE_ONLY)
    if mode == c.SYMBOL_TRADE_MODE_LONGONLY and not buy:
        raise Refused(c.TRADE_RETCODE_LONG_ONLY)
    if mode == c.SYMBOL_TRADE_MODE_SHORTONLY and buy:
        raise Refused(c.TRADE_RETCODE_SHORT_ONLY)
    if not check_volume(sym, volume):
        raise Refused(c.TRADE_RETCODE_INVALID_VOLUME)
    price = open_price(sym, buy)
    sl, tp = req.get("sl", 0.0), req.get("tp", 0.0)
    if not stops_valid(buy, price, sl, tp):
        raise Refused(c.TRADE_RETCODE_INVALID_STOPS)
    free = acct["balance"] + floating(state, acct) - used_margin(state, acct)
    if margin_for(acct, sym, volume, price) > free:
        raise Refused(c.TRADE_RETCODE_NO_MONEY)
    check_deviation(req, price, sym)
    filled = partial_volume(volume, sym) if partial else volume
    position, deal = open_position(
        state, acct, symbol=sym["name"], buy=buy, volume=filled, price=price, sl=sl, tp=tp,
        magic=req.get("magic", 0), comment=req.get("comment", ""), reason=c.DEAL_REASON_EXPERT,
    )
    return {"deal": deal["ticket"], "order": position["ticket"], "volume": filled, "price": price}


def sltp_request(state, acct, req) -> dict:
    position = find_position(state, acct, req.get("position", 0))
    sym = symbol_for(state, position["symbol"])
    sl, tp = req.get("sl", 0.0) or 0.0, req.get("tp", 0.0) or 0.0
    buy = position["type"] == c.POSITION_TYPE_BUY
    if not stops_valid(buy, close_price(sym, position["type"]), sl, tp):
        raise Refused(c.TRADE_RETCODE_INVALID_STOPS)
    if (sl, tp) == (position["sl"], position["tp"]):
        raise Refused(c.TRADE_RETCODE_NO_CHANGES)
    t = now_ms(state)
    position.update(sl=sl, tp=tp, time_update=t // 1000, time_update_msc=t)
    return {"deal": 0, "order": 0, "volume": 0.0, "price": 0.0}


def check_pending(state, order_type, price, sl, tp, req, sym) -> None:
    if order_type not in (c.ORDER_TYPE_BUY_LIMIT, c.ORDER_TYPE_SELL_LIMIT,
                          c.ORDER_TYPE_BUY_STOP, c.ORDER_TYPE_SELL_STOP):
        raise Refused(c.TRADE_RETCODE_INVALID_ORDER)
    if not pending_price_valid(order_type, price, sym):
        raise Refused(c.TRADE_RETCODE_INVALID_PRICE)
    if not stops_valid(is_buy(order_type), price, sl, tp):
        raise Refused(c.TRADE_RETCODE_INVALID_STOPS)
    type_time = req.get("type_time", c.ORDER_TIME_GTC)
    if type_time in (c.ORDER_TIME_SPECIFIED, c.ORDER_TIME_SPECIFIED_DAY):
        if int(req.get("expiration", 0)) <= now_ms(state) // 1000:
            raise Refused(c.TRADE_RETCODE_INVALID_EXPIRATION)


def pending_request(state, acct, req) -> dict:
    sym = symbol_for(state, req.get("symbol"))
    order_type = req.get("type", -1)
    volume = float(req.get("volume", 0.0))
    price, sl, tp = req.get("price", 0.0), req.get("sl", 0.0) or 0.0, req.get("tp", 0.0) or 0.0
    if not check_volume(sym, volume):
        raise Refused(c.TRADE_RETCODE_INVALID_VOLUME)
    check_pending(state, order_type, price, sl, tp, req, sym)
    t = now_ms(state)
    type_time = req.get("type_time", c.ORDER_TIME_GTC)
    order = {
        "ticket": next_ticket(state),
        "time_setup": t // 1000,
        "time_setup_msc": t,
        "time_done": 0,
        "time_done_msc": 0,
        "time_expiration": int(req.get("expiration", 0)) if type_time != c.ORDER_TIME_GTC else 0,
        "type": order_type,
        "type_time": type_time,
        "type_filling": req.get("type_filling", c.ORDER_FILLING_RETURN),
        "state": c.ORDER_STATE_PLACED,
        "magic": req.get("magic", 0),
        "position_id": 0,
        "position_by_id": 0,
        "reason": c.ORDER_REASON_EXPERT,
        "volume_initial": volume,
        "volume_current": volume,
        "price_open": price,
        "sl": sl,
        "tp": tp,
        "price_stoplimit": 0.0,
        "symbol": sym["name"],
        "comment": (req.get("comment") or "")[:COMMENT_MAX],
        "external_id": "",
    }
    acct["orders"].append(order)
    return {"deal": 0, "order": order["ticket"], "volume": volume, "price": 0.0,
            "retcode": c.TRADE_RETCODE_PLACED}


def modify_request(state, acct, req) -> dict:
    order = find_order(acct, req.get("order", 0))
    sym = symbol_for(state, order["symbol"])
    price, sl, tp = req.get("price", 0.0), req.get("sl", 0.0) or 0.0, req.get("tp", 0.0) or 0.0
    check_pending(state, order["type"], price, sl, tp, req, sym)
    type_time = req.get("type_time", c.ORDER_TIME_GTC)
    expiration = int(req.get("expiration", 0)) if type_time != c.ORDER_TIME_GTC else 0
    new = dict(order, price_open=price, sl=sl, tp=tp, type_time=type_time,
               time_expiration=expiration)
    if new == order:
        raise Refused(c.TRADE_RETCODE_NO_CHANGES)
    order.update(new)
    return {"deal": 0, "order": order["ticket"], "volume": 0.0, "price": 0.0}


def remove_request(state, acct, req) -> dict:
    order = find_order(acct, req.get("order", 0))
    retire_order(state, acct, order, c.ORDER_STATE_CANCELED)
    return {"deal": 0, "order": order["ticket"], "volume": 0.0, "price": 0.0}
