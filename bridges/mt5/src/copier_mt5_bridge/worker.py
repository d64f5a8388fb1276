"""A worker process: the one process that talks to one terminal.

The `MetaTrader5` package connects a Python process to one terminal at a time, and a terminal
is logged in to one account at a time, so the bridge runs one worker per terminal and each
worker does one thing at a time: a request, or a poll. Requests for different terminals run in
parallel in their own workers.

The package is imported by its name, `MetaTrader5`, inside the worker only: on Windows it is
MetaQuotes' package; in tests it is whatever module of that name comes first on the path.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import time

from . import history, shapes, trading, wire
from .config import Settings, Terminal
from .link import RES_E_AUTH_FAILED, ApiError, Link, TerminalDown
from .outcomes import Done, Outcome, Refused, Unknown
from .watcher import Watcher

log = logging.getLogger(__name__)

ACCOUNT_MARGIN_MODE_RETAIL_HEDGING = 2
_IDLE = object()


class Worker:
    """One terminal's requests and event stream."""

    def __init__(self, mt5, terminal: Terminal, settings: Settings, emit):
        self.link = Link(mt5, terminal.path, terminal.portable, terminal.server,
                         settings.reconnect_ms)
        self.terminal = terminal
        self.settings = settings
        self.emit = emit
        self.watchers: dict[str, Watcher] = {}
        self.passwords: dict[str, str] = {}

    # --- requests ------------------------------------------------------------------------

    def handle(self, op: str, fields: dict) -> Outcome:
        """The outcome of one request. Whatever fails after a trade request was handed to the
        package leaves that request's outcome unknown; before, nothing was sent."""
        sends = self.link.sends
        try:
            return self._dispatch(op, fields)
        except trading.Refusal as refusal:
            return refusal.refused
        except TerminalDown as e:
            if self.link.sends != sends:
                return Unknown(f"terminal lost after the order was sent: {e}")
            return self._unavailable(op, str(e))
        except ApiError as e:
            if self.link.sends != sends:
                return Unknown(f"{e} after the order was sent")
            if op == "login" and e.code == RES_E_AUTH_FAILED:
                return Refused(wire.INVALID_CREDENTIALS, f"invalid credentials: {e.text}")
            return Refused(wire.REJECTED, str(e))
        except Exception as e:  # a bug must not take the terminal's worker down
            log.exception("%s failed", op)
            if self.link.sends != sends:
                return Unknown(f"internal error after the order was sent: {e!r}")
            return Refused(wire.REJECTED, f"internal error of the bridge: {e!r}")

    @staticmethod
    def _unavailable(op: str, why: str) -> Outcome:
        """The terminal is down and nothing was sent. An order is refused as "not now" (the
        node sends it again later); a login gets no answer, which the node's client reads as a
        broker it could not reach and retries, where a refusal would end the account's session;
        a read is refused (never `invalid`, which would mean "not supported")."""
        if op == "login":
            return Unknown(f"terminal unavailable: {why}")
        if op in wire.TRADE_OPS:
            return Refused(wire.MARKET_CLOSED, f"terminal unavailable, nothing sent: {why}")
        return Refused(wire.REJECTED, f"terminal unavailable: {why}")

    def _dispatch(self, op: str, fields: dict) -> Outcome:
        if op == "symbols":
            symbols = self.link.call("symbols_get", **(
                {"group": self.settings.symbols_group} if self.settings.symbols_group else {}))
            return Done({"symbols": [shapes.symbol(s) for s in symbols]})
        login = fields["login"]
        if op == "login":
            return self._login(login, fields["password"])
        self.link.ensure_login(login, self.passwords.get(login))
        if op in trading.OPS:
            log.info("%s %s: %s", login, op, {k: v for k, v in fields.items() if k != "login"})
            outcome = trading.OPS[op](self.link, self.settings, fields)
            log.info("%s %s -> %s", login, op, outcome)
            return outcome
        if op == "positions":
            held = self.link.call("positions_get", empty_ok=True)
            return Done({"positions": [shapes.position(p) for p in held]})
        if op == "orders":
            resting = self.link.call("orders_get", empty_ok=True)
            return Done({"orders": [o for o in map(shapes.order, resting) if o is not None]})
        if op == "history":
            return Done({"history": history.read(self.link, self.settings.history_days)})
        if op == "account":
            return Done(shapes.account(self.link.account(), self._server_time_ms()))
        return Refused(wire.INVALID_REQUEST, f"unknown op {op}", kind="invalid")

    def _login(self, login: str, password: str | None) -> Outcome:
        info = self.link.ensure_login(login, password)
        if password is not None:
            self.passwords[login] = password
        hedging = info.margin_mode == ACCOUNT_MARGIN_MODE_RETAIL_HEDGING
        if not hedging and not self.settings.allow_netting:
            return Refused(wire.REJECTED,
                           f"account {login} is not a hedging account (margin mode "
                           f"{info.margin_mode}): copies could not be told apart by marker; "
                           "set allow_netting to serve it anyway")
        watcher = self.watchers.setdefault(login, Watcher())
        if watcher.positions is None:
            watcher.poll(self.link)  # the snapshot later changes are told against
        return Done({**shapes.account(info, self._server_time_ms()), "fence": None})

    def _server_time_ms(self) -> int | None:
        """The trade server's clock as MT5's TimeCurrent() gives it: the time of the last quote
        among the symbols in Market Watch."""
        symbols = self.link.call("symbols_get", empty_ok=True)
        times = [s.time for s in symbols if s.select and s.time]
        return max(times) * 1000 if times else None

    # --- the event stream ----------------------------------------------------------------

    def poll(self) -> None:
        """Reports what changed on the terminal's account since the last poll (if a node has
        logged that account in)."""
        try:
            self.link.connect()
            if not self.watchers:
                return
            self.link.account()  # which account the terminal is on now (a person may switch)
            watcher = self.watchers.get(self.link.login)
            if watcher is None:
                return
            for change in watcher.poll(self.link):
                self.emit(("event", self.link.login, change))
        except (TerminalDown, ApiError) as e:
            log.debug("poll of %s skipped: %s", self.terminal.name, e)


def main(terminal: Terminal, settings: Settings, inbox, outbox, log_level: str) -> None:
    """The worker process: requests from `inbox`, replies and events to `outbox`, a poll every
    `poll_ms`, until told to stop or its parent is gone."""
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s %(levelname)s [{terminal.name}] %(message)s")
    import MetaTrader5 as mt5  # noqa: N813  (by name: the official package, or a test's fake)

    worker = Worker(mt5, terminal, settings, outbox.put)
    parent = multiprocessing.parent_process()
    period = settings.poll_ms / 1000
    next_poll = 0.0
    try:
        while True:
            try:
                message = inbox.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                message = _IDLE
            if message is None:
                break
            if message is not _IDLE:
                seq, op, fields = message
                outcome = worker.handle(op, fields)
                if op in wire.TRADE_OPS:
                    worker.poll()  # the order's own events go out before its reply
                outbox.put(("reply", seq, outcome))
            if time.monotonic() >= next_poll:
                worker.poll()
                next_poll = time.monotonic() + period
            if parent is not None and not parent.is_alive():
                break
    finally:
        mt5.shutdown()
