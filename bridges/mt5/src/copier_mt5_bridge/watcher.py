"""The event stream of one account, made by polling: MT5's Python package pushes nothing, so
the worker reads positions and pending orders every poll period (and right after each of its own
orders) and reports what changed since the last read.

A read that fails part-way changes nothing: the next poll compares against the same snapshot,
so a change is reported once, late rather than never (events stay at-most-once across a
reconnect of the node, which reconciles then).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from . import history, shapes

log = logging.getLogger(__name__)

EPS = 1e-9
# ENUM_ORDER_STATE of orders in the history
ORDER_STATE_CANCELED = 2
ORDER_STATE_PARTIAL = 3
ORDER_STATE_FILLED = 4
ORDER_STATE_REJECTED = 5
ORDER_STATE_EXPIRED = 6
# Polls to wait for the deals of a close to show in the terminal's history before reporting the
# close from the last snapshot alone.
DEAL_WAIT_POLLS = 20


class Watcher:
    """The last seen positions and pending orders of one login."""

    def __init__(self):
        self.positions: dict[int, dict] | None = None
        self.prices: dict[int, float] = {}
        self.orders: dict[int, dict] | None = None
        self.waiting: dict[int, int] = {}

    def poll(self, link) -> list[dict]:
        """The changes since the last poll, as the protocol's event bodies, in the order they
        are to be sent (a filled order's `order_gone` before its position's `opened`)."""
        raw_positions = link.call("positions_get", empty_ok=True)
        raw_orders = link.call("orders_get", empty_ok=True)
        positions = {p.ticket: shapes.position(p) for p in raw_positions}
        prices = {p.ticket: p.price_current for p in raw_positions}
        orders = {}
        for o in raw_orders:
            shape = shapes.order(o)
            if shape is not None:
                orders[o.ticket] = shape
        if self.positions is None or self.orders is None:
            self.positions, self.prices, self.orders = positions, prices, orders
            return []
        changes = self._order_changes(link, orders, positions)
        changes += self._position_changes(link, positions, prices)
        self.orders = orders
        return changes

    def _order_changes(self, link, orders, positions) -> list[dict]:
        changes = []
        for ticket in sorted(self.orders.keys() - orders.keys()):
            changes.append({"change": "order_gone", "ticket": ticket,
                            **self._order_end(link, ticket, positions)})
        for ticket in sorted(orders.keys() - self.orders.keys()):
            changes.append({"change": "order_placed", "order": orders[ticket]})
        for ticket in sorted(orders.keys() & self.orders.keys()):
            if orders[ticket] != self.orders[ticket]:
                changes.append({"change": "order_changed", "order": orders[ticket]})
        return changes

    @staticmethod
    def _order_end(link, ticket, positions) -> dict:
        found = link.call("history_orders_get", ticket=ticket, empty_ok=True)
        state = found[-1].state if found else None
        if state in (ORDER_STATE_FILLED, ORDER_STATE_PARTIAL):
            return {"end": "filled", "position": found[-1].position_id or ticket}
        if state == ORDER_STATE_EXPIRED:
            return {"end": "expired"}
        if state in (ORDER_STATE_CANCELED, ORDER_STATE_REJECTED):
            return {"end": "cancelled"}
        # Not (yet) in the history: a position under its ticket means it filled.
        if ticket in positions:
            return {"end": "filled", "position": ticket}
        return {"end": "cancelled"}

    def _position_changes(self, link, positions, prices) -> list[dict]:
        changes = []
        kept = dict(positions)
        for ticket in sorted(positions.keys() - self.positions.keys()):
            changes.append({"change": "opened", "position": positions[ticket]})
        for ticket in sorted(positions.keys() & self.positions.keys()):
            before, now = self.positions[ticket], positions[ticket]
            if now["volume"] < before["volume"] - EPS:
                closes = self._closes(link, before, now, before["volume"] - now["volume"])
                if closes is None:
                    kept[ticket] = before
                else:
                    changes += closes
            elif (now["sl"], now["tp"]) != (before["sl"], before["tp"]):
                changes.append({"change": "modified", "position": now})
        for ticket in sorted(self.positions.keys() - positions.keys()):
            before = self.positions[ticket]
            closes = self._closes(link, before, None, before["volume"])
            if closes is None:
                kept[ticket] = before
                prices[ticket] = self.prices.get(ticket, before["open_price"])
            else:
                changes += closes
        self.positions, self.prices = kept, prices
        return changes

    def _closes(self, link, before: dict, now: dict | None, dropped: float):
        """The events of `dropped` lots of `before` closed since the last poll, from the
        position's deals; None while the deals are not in the terminal's history yet."""
        ticket = before["ticket"]
        deals = link.call("history_deals_get", position=ticket, empty_ok=True)
        picked = history.recent_closes(deals, dropped)
        if sum(d.volume for d in picked) < dropped - EPS:
            waited = self.waiting.get(ticket, 0) + 1
            if waited < DEAL_WAIT_POLLS:
                self.waiting[ticket] = waited
                return None
            log.warning("no closing deal of position %s found; reporting its close from the "
                        "last snapshot", ticket)
            picked = [SimpleNamespace(
                volume=dropped, price=self.prices.get(ticket, before["open_price"]),
                time_msc=int(time.time() * 1000), reason=0, profit=0.0)]
        self.waiting.pop(ticket, None)
        changes = []
        remaining = before["volume"]
        for i, deal in enumerate(picked):
            remaining = round(remaining - deal.volume, 8)
            closed = history.closed_entry(before, deal, remaining)
            last = i == len(picked) - 1
            if last and now is None:
                changes.append({"change": "closed", "closed": closed})
            else:
                shown = dict(now if now is not None else before, volume=max(remaining, 0.0))
                changes.append({"change": "partially_closed", "position": shown,
                                "closed": closed})
        return changes
