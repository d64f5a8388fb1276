"""MetaTrader 5 structures as the protocol's shapes (Position, Order, Symbol, Closed).

MT5 writes "no stop" as 0.0 and times as seconds or milliseconds since 1970 on the trade
server's clock; the protocol writes `null` and milliseconds on the server's clock, so times pass
through unchanged.
"""

from __future__ import annotations

import re

# ENUM_POSITION_TYPE / ENUM_DEAL_TYPE: 0 is a buy, 1 a sell.
BUY, SELL = 0, 1
# ENUM_ORDER_TYPE of pending orders: (side, kind). Stop-limit orders (6, 7) have no protocol
# shape and are left out of `orders`.
PENDING_TYPES = {
    2: ("buy", "limit"),  # ORDER_TYPE_BUY_LIMIT
    3: ("sell", "limit"),  # ORDER_TYPE_SELL_LIMIT
    4: ("buy", "stop"),  # ORDER_TYPE_BUY_STOP
    5: ("sell", "stop"),  # ORDER_TYPE_SELL_STOP
}
ORDER_TYPE_OF = {v: k for k, v in PENDING_TYPES.items()}
# ENUM_ORDER_TYPE_TIME: orders with an expiry time.
ORDER_TIME_SPECIFIED = 2
ORDER_TIME_SPECIFIED_DAY = 3

_CURRENCY = re.compile(r"^[A-Z]{3}$")


def stop(value: float) -> float | None:
    return value if value else None


def side_of(type_: int) -> str:
    return "buy" if type_ == BUY else "sell"


def position(p) -> dict:
    return {
        "ticket": p.ticket,
        "symbol": p.symbol,
        "side": side_of(p.type),
        "volume": p.volume,
        "open_price": p.price_open,
        "sl": stop(p.sl),
        "tp": stop(p.tp),
        "magic": p.magic,
        "comment": p.comment,
        "open_time_ms": p.time_msc,
    }


def order(o) -> dict | None:
    """A resting pending order, or None for a type the protocol has no shape for."""
    kinds = PENDING_TYPES.get(o.type)
    if kinds is None:
        return None
    side, kind = kinds
    shape = {
        "ticket": o.ticket,
        "symbol": o.symbol,
        "side": side,
        "kind": kind,
        "price": o.price_open,
        "volume": o.volume_current,
        "sl": stop(o.sl),
        "tp": stop(o.tp),
        "magic": o.magic,
        "comment": o.comment,
        "placed_ms": o.time_setup_msc,
    }
    if o.type_time in (ORDER_TIME_SPECIFIED, ORDER_TIME_SPECIFIED_DAY) and o.time_expiration:
        shape["expiry_ms"] = o.time_expiration * 1000
    return shape


def symbol(s) -> dict:
    """A symbol's trading rules. Its `price` is the bid (what MT5 charts show), or the last
    deal price for symbols quoted by deals only."""
    shape = {
        "symbol": s.name,
        "price": s.bid or s.last or s.ask,
        "volume_step": s.volume_step,
        "volume_min": s.volume_min,
        "volume_max": s.volume_max,
        "contract_size": s.trade_contract_size,
        "point": s.point,
    }
    if _CURRENCY.match(s.currency_profit or ""):
        shape["profit_currency"] = s.currency_profit
    return shape


def account(info, server_time_ms: int | None) -> dict:
    shape = {"balance": info.balance, "equity": info.equity}
    if _CURRENCY.match(info.currency or ""):
        shape["currency"] = info.currency
    if server_time_ms is not None:
        shape["server_time_ms"] = server_time_ms
    return shape
