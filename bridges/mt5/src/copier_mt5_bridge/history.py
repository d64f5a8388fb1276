"""The protocol's history (one Closed entry per full or partial close) from MT5's deals.

A hedging account records every fill as a deal: DEAL_ENTRY_IN opened the position, each
DEAL_ENTRY_OUT (or OUT_BY, a close by an opposite position) closed all or part of it, all under
the position's identifier. The markers come from the opening deal, not the closing one: the
closing deal carries whatever the closing order said, and brokers' servers write their own
comment on stop-loss and take-profit closes (`[sl 1.09000]`), which would hide a copy's marker.
"""

from __future__ import annotations

import time
from collections import defaultdict

from . import shapes

DEAL_ENTRY_IN = 0
DEAL_ENTRY_OUT = 1
DEAL_ENTRY_INOUT = 2  # a reversal: netting accounts only
DEAL_ENTRY_OUT_BY = 3
CLOSING = (DEAL_ENTRY_OUT, DEAL_ENTRY_OUT_BY)
# ENUM_DEAL_TYPE values of fills (the others are balance, credit, commission... operations).
TRADES = (0, 1)

# ENUM_DEAL_REASON -> who closed: a person (desktop, mobile, web terminal), a program (an
# expert or a script, this bridge included), or the server (stops; a stop out counts as `sl`,
# the server closing the position to protect the account).
CLOSED_BY = {
    0: "manual",  # DEAL_REASON_CLIENT: desktop terminal
    1: "manual",  # DEAL_REASON_MOBILE
    2: "manual",  # DEAL_REASON_WEB
    3: "client",  # DEAL_REASON_EXPERT: an MQL5 program or the Python package
    4: "sl",  # DEAL_REASON_SL
    5: "tp",  # DEAL_REASON_TP
    6: "sl",  # DEAL_REASON_SO: stop out
}

_DAY_S = 86400


def _order(deal):
    return (deal.time_msc, deal.ticket)


def closed_entry(position: dict, deal, remaining: float) -> dict:
    """One Closed entry: `position` as it was (its markers), with the closing deal's volume,
    price, time, reason and profit."""
    return {
        **position,
        "volume": deal.volume,
        "close_price": deal.price,
        "close_time_ms": deal.time_msc,
        "closed_by": CLOSED_BY.get(deal.reason, "manual"),
        "remaining_volume": max(0.0, round(remaining, 8)),
        "profit": deal.profit,
    }


def position_entries(deals) -> list[dict]:
    """Closed entries of one position from all of its deals."""
    deals = sorted((d for d in deals if d.type in TRADES), key=_order)
    ins = [d for d in deals if d.entry == DEAL_ENTRY_IN]
    outs = [d for d in deals if d.entry in CLOSING]
    if not outs:
        return []
    if ins:
        opening = ins[0]
        side = shapes.side_of(opening.type)
        volume_in = sum(d.volume for d in ins)
        open_price = sum(d.price * d.volume for d in ins) / volume_in if volume_in else 0.0
    else:
        # The opening deal is gone from the terminal's history: the markers of the first close
        # are the best left, and the side is the opposite of the closing deal's.
        opening = outs[0]
        side = "sell" if opening.type == shapes.BUY else "buy"
        open_price = 0.0
    position = {
        "ticket": opening.position_id,
        "symbol": opening.symbol,
        "side": side,
        "volume": 0.0,
        "open_price": open_price,
        "sl": shapes.stop(getattr(opening, "sl", 0.0)),
        "tp": shapes.stop(getattr(opening, "tp", 0.0)),
        "magic": opening.magic,
        "comment": opening.comment,
        "open_time_ms": opening.time_msc if ins else 0,
    }
    entries = []
    remaining = 0.0 if ins else sum(d.volume for d in outs)
    for deal in deals:
        if deal.entry == DEAL_ENTRY_IN:
            remaining += deal.volume
        elif deal.entry in CLOSING:
            remaining -= deal.volume
            entries.append(closed_entry(position, deal, remaining))
    return entries


def read(link, days: int) -> list[dict]:
    """Every close in the last `days` days (0: all the terminal holds), oldest first. A
    position whose opening fell before the window is read whole, for its markers."""
    now = int(time.time())
    start = now - days * _DAY_S if days else 0
    # The server's clock may run up to 14 hours ahead of UTC: a day's margin.
    deals = link.call("history_deals_get", start, now + _DAY_S, empty_ok=True)
    by_position = defaultdict(list)
    for deal in deals:
        if deal.type in TRADES:
            by_position[deal.position_id].append(deal)
    entries = []
    for position_id, group in by_position.items():
        if any(d.entry in CLOSING for d in group) and not any(
                d.entry == DEAL_ENTRY_IN for d in group):
            group = link.call("history_deals_get", position=position_id, empty_ok=True)
        entries.extend(position_entries(group))
    entries.sort(key=lambda e: (e["close_time_ms"], e["ticket"]))
    return entries


def recent_closes(deals, dropped: float) -> list:
    """The newest closing deals of a position that account for `dropped` lots (what it lost
    between two polls), oldest first."""
    outs = sorted((d for d in deals if d.type in TRADES and d.entry in CLOSING), key=_order)
    picked, total = [], 0.0
    for deal in reversed(outs):
        if total >= dropped - 1e-9:
            break
        picked.append(deal)
        total += deal.volume
    return list(reversed(picked))
