"""The protocol's orders as MT5 trade requests (`order_send`).

| protocol | MT5 request |
| --- | --- |
| open | TRADE_ACTION_DEAL, ORDER_TYPE_BUY/SELL at the ask/bid, `deviation` from `price_limit` |
| close | TRADE_ACTION_DEAL of the opposite type with `position=` the ticket (all or part) |
| modify | TRADE_ACTION_SLTP with `position=` the ticket |
| place | TRADE_ACTION_PENDING, ORDER_TYPE_BUY/SELL_LIMIT/STOP, expiry as ORDER_TIME_SPECIFIED |
| amend | TRADE_ACTION_MODIFY with `order=` the ticket |
| cancel | TRADE_ACTION_REMOVE with `order=` the ticket |

Each request carries the protocol's magic and comment as they are. MT5 keeps at most 31
characters of a comment: a longer one is refused here, never cut, since the comment is how a
node recognises its copies. Nothing is retried: a request is sent once, and what the server
answered (or that its answer was lost) is what the node hears.
"""

from __future__ import annotations

import logging

from . import retcodes, shapes, wire
from .link import RES_E_AUTO_TRADING_DISABLED, RES_E_INVALID_PARAMS, ApiError, TerminalDown
from .outcomes import Done, Refused, Unknown

log = logging.getLogger(__name__)

COMMENT_MAX = 31

# ENUM_TRADE_REQUEST_ACTIONS
TRADE_ACTION_DEAL = 1
TRADE_ACTION_PENDING = 5
TRADE_ACTION_SLTP = 6
TRADE_ACTION_MODIFY = 7
TRADE_ACTION_REMOVE = 8
# ENUM_ORDER_TYPE of market orders
ORDER_TYPE_BUY = 0
ORDER_TYPE_SELL = 1
# ENUM_ORDER_TYPE_FILLING
ORDER_FILLING_FOK = 0
ORDER_FILLING_IOC = 1
ORDER_FILLING_RETURN = 2
# ENUM_ORDER_TYPE_TIME
ORDER_TIME_GTC = 0
ORDER_TIME_SPECIFIED = 2
# SymbolInfo.filling_mode flags
SYMBOL_FILLING_FOK = 1
SYMBOL_FILLING_IOC = 2

EPS = 1e-9


class Refusal(Exception):
    """Raised while preparing a request: the bridge refuses it before sending anything."""

    def __init__(self, refused: Refused):
        super().__init__(refused.reason)
        self.refused = refused


def comment_units(comment: str) -> int:
    """The comment's length as MT5 counts it (UTF-16 code units)."""
    return len(comment.encode("utf-16-le")) // 2


def check_comment(comment: str) -> None:
    units = comment_units(comment)
    if units > COMMENT_MAX:
        raise Refusal(Refused(
            wire.INVALID_REQUEST,
            f"comment {comment!r} has {units} characters; MetaTrader 5 keeps at most "
            f"{COMMENT_MAX}, and this bridge does not cut a marker",
            kind="invalid"))


def symbol(link, name: str):
    """The symbol's info, selected in Market Watch (the terminal quotes and trades only those)."""
    try:
        info = link.call("symbol_info", name)
    except ApiError:
        raise Refusal(Refused(wire.UNKNOWN_SYMBOL, f"unknown symbol {name}")) from None
    if not info.select:
        link.call("symbol_select", name, True)
        info = link.call("symbol_info", name)
    return info


def filling(info) -> int:
    """A filling type the symbol allows: fill or kill first (no partial fills), else
    immediate or cancel, else return."""
    if info.filling_mode & SYMBOL_FILLING_FOK:
        return ORDER_FILLING_FOK
    if info.filling_mode & SYMBOL_FILLING_IOC:
        return ORDER_FILLING_IOC
    return ORDER_FILLING_RETURN


def position(link, ticket: int):
    found = link.call("positions_get", ticket=ticket, empty_ok=True)
    if not found:
        raise Refusal(Refused(wire.UNKNOWN_TICKET, f"unknown ticket {ticket}"))
    return found[0]


def pending(link, ticket: int):
    found = link.call("orders_get", ticket=ticket, empty_ok=True)
    if not found:
        raise Refusal(Refused(wire.UNKNOWN_TICKET,
                              f"unknown ticket {ticket}: no such pending order"))
    return found[0]


def send(link, request: dict, no_changes_ok: bool = False):
    """Sends `request` once. Returns the OrderSendResult of an executed request, or the
    Refused/Unknown outcome."""
    result, error = link.order_send(request)
    if result is None:
        code, text = error
        if code == RES_E_INVALID_PARAMS:
            # The package refused the arguments itself: nothing left this process.
            return Refused(wire.REJECTED, f"order_send refused the request: {code} {text}")
        if code == RES_E_AUTO_TRADING_DISABLED:
            return Refused(wire.REJECTED, f"autotrading disabled in the terminal: {code} {text}")
        return Unknown(f"order_send returned None ({code} {text}): the request may or may not "
                       "have been executed")
    entry = retcodes.classify(result.retcode)
    if entry.outcome == retcodes.SUCCESS:
        return result
    if no_changes_ok and result.retcode == retcodes.NO_CHANGES:
        # The stops or the order are already as asked: what the request wanted holds.
        return result
    detail = result.comment if result.comment and result.comment.lower() != entry.meaning else ""
    if entry.outcome == retcodes.UNKNOWN:
        return Unknown(entry.reason(detail))
    return Refused(entry.outcome, entry.reason(detail))


def _position_of_deal(link, result) -> int:
    """The ticket of the position an opening deal made: the deal's position identifier (a
    position's ticket is normally its opening order's, which the result also gives)."""
    if result.deal:
        try:
            deals = link.call("history_deals_get", ticket=result.deal, empty_ok=True)
        except (ApiError, TerminalDown) as e:
            log.warning("reading deal %s after its fill failed (%s); using order %s",
                        result.deal, e, result.order)
            return result.order
        if deals and deals[0].position_id:
            return deals[0].position_id
    return result.order


def open_position(link, settings, f: dict):
    check_comment(f["comment"])
    info = symbol(link, f["symbol"])
    buy = f["side"] == "buy"
    price = info.ask if buy else info.bid
    limit = f["price_limit"]
    deviation = settings.deviation_points
    if limit is not None:
        if (buy and price > limit + EPS) or (not buy and price < limit - EPS):
            return Refused(wire.SLIPPAGE,
                           f"price {price} of {f['symbol']} is beyond the limit {limit}")
        deviation = int(abs(limit - price) / info.point + 1e-6) if info.point else 0
    request = {
        "action": TRADE_ACTION_DEAL,
        "symbol": f["symbol"],
        "volume": float(f["volume"]),
        "type": ORDER_TYPE_BUY if buy else ORDER_TYPE_SELL,
        "price": price,
        "sl": float(f["sl"] or 0.0),
        "tp": float(f["tp"] or 0.0),
        "deviation": deviation,
        "magic": f["magic"],
        "comment": f["comment"],
        "type_time": ORDER_TIME_GTC,
        "type_filling": filling(info),
    }
    sent = send(link, request)
    if isinstance(sent, (Refused, Unknown)):
        return sent
    return Done({
        "ticket": _position_of_deal(link, sent),
        "price": sent.price or price,
        "volume": sent.volume or float(f["volume"]),
        "duplicate": False,
    })


def close_position(link, settings, f: dict):
    ticket = f["ticket"]
    held = position(link, ticket)
    volume = held.volume if f["volume"] is None else float(f["volume"])
    if volume <= 0:
        return Refused(wire.INVALID_VOLUME, f"invalid volume {volume}")
    if volume > held.volume + EPS:
        return Refused(wire.INVALID_VOLUME,
                       f"close volume {volume} exceeds the position's {held.volume}")
    info = symbol(link, held.symbol)
    buy_to_close = held.type == shapes.SELL
    price = info.ask if buy_to_close else info.bid
    request = {
        "action": TRADE_ACTION_DEAL,
        "symbol": held.symbol,
        "volume": volume,
        "type": ORDER_TYPE_BUY if buy_to_close else ORDER_TYPE_SELL,
        "position": ticket,
        "price": price,
        "deviation": settings.deviation_points,
        "magic": held.magic,
        "comment": held.comment,
        "type_time": ORDER_TIME_GTC,
        "type_filling": filling(info),
    }
    sent = send(link, request)
    if isinstance(sent, (Refused, Unknown)):
        return sent
    closed = sent.volume or volume
    try:
        left = link.call("positions_get", ticket=ticket, empty_ok=True)
        remaining = left[0].volume if left else 0.0
    except (ApiError, TerminalDown):
        remaining = max(0.0, round(held.volume - closed, 8))
    return Done({
        "ticket": ticket,
        "closed_volume": closed,
        "remaining_volume": remaining,
        "price": sent.price or price,
        "duplicate": False,
    })


def modify_position(link, settings, f: dict):
    ticket = f["ticket"]
    held = position(link, ticket)
    sl, tp = float(f["sl"] or 0.0), float(f["tp"] or 0.0)
    if (held.sl, held.tp) == (sl, tp):
        return Done(ticket)
    request = {
        "action": TRADE_ACTION_SLTP,
        "symbol": held.symbol,
        "position": ticket,
        "sl": sl,
        "tp": tp,
        "magic": held.magic,
    }
    sent = send(link, request, no_changes_ok=True)
    if isinstance(sent, (Refused, Unknown)):
        return sent
    return Done(ticket)


def _expiry(expiry_ms: int | None) -> dict:
    """MT5 expiries are whole seconds on the server's clock: cut down, never later than asked."""
    if expiry_ms is None:
        return {"type_time": ORDER_TIME_GTC, "expiration": 0}
    return {"type_time": ORDER_TIME_SPECIFIED, "expiration": expiry_ms // 1000}


def place_order(link, settings, f: dict):
    check_comment(f["comment"])
    info = symbol(link, f["symbol"])
    request = {
        "action": TRADE_ACTION_PENDING,
        "symbol": f["symbol"],
        "volume": float(f["volume"]),
        "type": shapes.ORDER_TYPE_OF[(f["side"], f["kind"])],
        "price": float(f["price"]),
        "sl": float(f["sl"] or 0.0),
        "tp": float(f["tp"] or 0.0),
        "magic": f["magic"],
        "comment": f["comment"],
        "type_filling": filling(info),
        **_expiry(f["expiry_ms"]),
    }
    sent = send(link, request)
    if isinstance(sent, (Refused, Unknown)):
        return sent
    return Done({"ticket": sent.order, "duplicate": False})


def amend_order(link, settings, f: dict):
    ticket = f["ticket"]
    resting = pending(link, ticket)
    request = {
        "action": TRADE_ACTION_MODIFY,
        "order": ticket,
        "symbol": resting.symbol,
        "price": float(f["price"]),
        "sl": float(f["sl"] or 0.0),
        "tp": float(f["tp"] or 0.0),
        **_expiry(f["expiry_ms"]),
    }
    sent = send(link, request, no_changes_ok=True)
    if isinstance(sent, (Refused, Unknown)):
        return sent
    return Done({"ticket": ticket, "duplicate": False})


def cancel_order(link, settings, f: dict):
    ticket = f["ticket"]
    pending(link, ticket)
    sent = send(link, {"action": TRADE_ACTION_REMOVE, "order": ticket})
    if isinstance(sent, (Refused, Unknown)):
        return sent
    return Done({"ticket": ticket, "duplicate": False})


OPS = {
    "open": open_position,
    "close": close_position,
    "modify": modify_position,
    "place": place_order,
    "amend": amend_order,
    "cancel": cancel_order,
}
