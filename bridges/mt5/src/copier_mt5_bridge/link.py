"""One worker's link to its terminal through the `MetaTrader5` package.

Every function of the package reports failure the same way: it returns `None` (or `False`) and
`last_error()` says why. This module turns that into exceptions a caller cannot forget to check:

* `TerminalDown`: the terminal cannot be reached over IPC (not running, closed, restarting; the
  package's `RES_E_INTERNAL_FAIL*` codes). The link then calls `initialize` again, at most every
  `reconnect_ms`, before its next call.
* `ApiError`: the call failed for another reason (bad arguments, not logged in...).

`order_send` is the exception to the rule: its `None` is handed back as is, because a lost reply
of a trade request is not a failure to report but an outcome that is unknown.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

RES_S_OK = 1
RES_E_INVALID_PARAMS = -2
RES_E_AUTH_FAILED = -6
RES_E_AUTO_TRADING_DISABLED = -8
# RES_E_INTERNAL_FAIL (-10000) to RES_E_INTERNAL_FAIL_TIMEOUT (-10005): the IPC link failed.
IPC_FAILURES = range(-10005, -9999)


class TerminalDown(Exception):
    """The terminal cannot be reached now; nothing was sent to it."""


class ApiError(Exception):
    def __init__(self, function: str, code: int, text: str):
        super().__init__(f"{function} failed: {code} {text}")
        self.code = code
        self.text = text


class Link:
    """The package, bound to one terminal, with the account it is logged in to."""

    def __init__(self, mt5, path: str, portable: bool = False, server: str | None = None,
                 reconnect_ms: int = 2000):
        self.mt5 = mt5
        self.path = path
        self.portable = portable
        self.server = server
        self.reconnect_s = reconnect_ms / 1000
        self.up = False
        self.login: str | None = None  # the account the terminal is on, as last seen
        self._next_attempt = 0.0
        # Trade requests handed to the package: a request that failed after one was handed over
        # has an unknown outcome, whatever failed.
        self.sends = 0

    # --- the IPC link --------------------------------------------------------------------

    def connect(self) -> None:
        """Initializes the package on the terminal, unless it is up already."""
        if self.up:
            return
        now = time.monotonic()
        if now < self._next_attempt:
            raise TerminalDown(f"terminal {self.path} is down; next attempt in "
                               f"{self._next_attempt - now:.1f}s")
        self._next_attempt = now + self.reconnect_s
        self.mt5.shutdown()
        kwargs = {"path": self.path}
        if self.portable:
            kwargs["portable"] = True
        if not self.mt5.initialize(**kwargs):
            code, text = self.mt5.last_error()
            raise TerminalDown(f"initialize({self.path}) failed: {code} {text}")
        self.up = True
        info = self.mt5.account_info()
        self.login = str(info.login) if info is not None and info.login else None
        log.info("terminal %s connected (account %s)", self.path, self.login)

    def down(self, why: str) -> TerminalDown:
        """Marks the link lost. A link that was up is tried again at once on the next call (a
        terminal that answered a moment ago is likely back); then every `reconnect_ms`."""
        if self.up:
            log.warning("terminal %s unreachable: %s", self.path, why)
            self._next_attempt = 0.0
        self.up = False
        self.login = None
        return TerminalDown(why)

    def call(self, function: str, *args, empty_ok: bool = False, **kwargs):
        """Calls `function` of the package. `empty_ok`: a `None` with no error is an empty
        answer (the history functions give one when nothing matched)."""
        self.connect()
        value = getattr(self.mt5, function)(*args, **kwargs)
        if value is None or value is False:
            code, text = self.mt5.last_error()
            if code in IPC_FAILURES:
                raise self.down(f"{function}: {code} {text}")
            if empty_ok and code == RES_S_OK:
                return ()
            raise ApiError(function, code, text)
        return value

    def order_send(self, request: dict):
        """Sends a trade request: the result, or `None` with last_error()'s code and text."""
        self.connect()
        self.sends += 1
        result = self.mt5.order_send(request)
        if result is None:
            code, text = self.mt5.last_error()
            if code in IPC_FAILURES:
                self.down(f"order_send: {code} {text}")
            return None, (code, text)
        return result, None

    # --- the account ---------------------------------------------------------------------

    def account(self):
        """The terminal's account figures; remembers which account the terminal is on (a
        person may switch it by hand)."""
        info = self.call("account_info")
        self.login = str(info.login)
        return info

    def ensure_login(self, login: str, password: str | None):
        """Puts the terminal on `login`, checked before every request: positions read from, or
        an order sent to, another account (one a person switched the terminal to) would be
        taken for this one's. An account the terminal is already on is not logged in again (a
        second login would reconnect it for nothing); otherwise the terminal logs in with
        `password`, or the one it saved. Returns the account's figures."""
        try:
            info = self.account()
        except ApiError:  # the terminal is on no account yet
            info, self.login = None, None
        if self.login == login:
            return info
        kwargs = {}
        if password is not None:
            kwargs["password"] = password
        if self.server is not None:
            kwargs["server"] = self.server
        self.call("login", int(login), **kwargs)
        info = self.account()
        if self.login != login:
            raise ApiError("login", RES_E_AUTH_FAILED, f"terminal is on account {self.login}")
        return info
