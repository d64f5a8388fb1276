"""The bridge protocol's frames (docs/design/bridge-protocol.md): one JSON object per line.

Requests are checked here, before anything reaches a terminal, so that a malformed frame is
answered `invalid` (nothing executed) and a worker only ever sees requests of the shapes it
knows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PROTOCOL_VERSION = 1
MAX_LINE = 64 * 1024

# The codes the node decides by (an `invalid` reply reads as `invalid_request`).
UNKNOWN_SYMBOL = "unknown_symbol"
INVALID_VOLUME = "invalid_volume"
INVALID_STOPS = "invalid_stops"
SLIPPAGE = "slippage"
REQUOTE = "requote"
MARKET_CLOSED = "market_closed"
NO_MONEY = "no_money"
UNKNOWN_TICKET = "unknown_ticket"
INVALID_CREDENTIALS = "invalid_credentials"
UNKNOWN_LOGIN = "unknown_login"
INVALID_REQUEST = "invalid_request"
REJECTED = "rejected"


class Invalid(Exception):
    """A frame the bridge cannot take: answered `invalid`, nothing executed."""

    def __init__(self, request_id: int, reason: str):
        super().__init__(reason)
        self.request_id = request_id
        self.reason = reason


@dataclass(frozen=True)
class Request:
    id: int
    op: str
    fields: dict


# --- replies -----------------------------------------------------------------------------


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def ok(request_id: int, result) -> str:
    return dumps({"id": request_id, "ok": True, "result": result})


def error(request_id: int, kind: str, reason: str, code: str | None = None) -> str:
    body = {"kind": kind, "reason": reason}
    if code is not None:
        body["code"] = code
    return dumps({"id": request_id, "ok": False, "error": body})


def rejected(request_id: int, code: str, reason: str) -> str:
    return error(request_id, "rejected", reason, code)


def invalid(request_id: int, reason: str) -> str:
    return error(request_id, "invalid", reason, INVALID_REQUEST)


def event(login: str, change: dict) -> str:
    return dumps({"event": "position", "login": login, **change})


# --- requests ----------------------------------------------------------------------------

# A field's type: what JSON value it takes. `?` suffix: may be null; `~` prefix: may be absent.
_NUMBER = "number"
_INT = "int"
_STR = "str"
_SIDE = "side"
_KIND = "kind"

_COMMON_ORDER = {"~fence": _INT + "?", "~client_order_id": _STR + "?"}

SCHEMAS: dict[str, dict[str, str]] = {
    "hello": {"client": _STR, "protocol": _INT},
    "login": {"login": _STR, "~password": _STR + "?", "~fence": _INT + "?"},
    "logout": {"login": _STR},
    "positions": {"login": _STR},
    "history": {"login": _STR},
    "account": {"login": _STR},
    "orders": {"login": _STR},
    "symbols": {},
    "open": {
        "login": _STR, "symbol": _STR, "side": _SIDE, "volume": _NUMBER,
        "~sl": _NUMBER + "?", "~tp": _NUMBER + "?", "magic": _INT, "comment": _STR,
        "~price_limit": _NUMBER + "?", **_COMMON_ORDER,
    },
    "close": {"login": _STR, "ticket": _INT, "~volume": _NUMBER + "?", **_COMMON_ORDER},
    "modify": {
        "login": _STR, "ticket": _INT, "~sl": _NUMBER + "?", "~tp": _NUMBER + "?",
        **_COMMON_ORDER,
    },
    "place": {
        "login": _STR, "symbol": _STR, "side": _SIDE, "kind": _KIND, "price": _NUMBER,
        "volume": _NUMBER, "~sl": _NUMBER + "?", "~tp": _NUMBER + "?",
        "~expiry_ms": _INT + "?", "magic": _INT, "comment": _STR, **_COMMON_ORDER,
    },
    "amend": {
        "login": _STR, "ticket": _INT, "price": _NUMBER, "~sl": _NUMBER + "?",
        "~tp": _NUMBER + "?", "~expiry_ms": _INT + "?", **_COMMON_ORDER,
    },
    "cancel": {"login": _STR, "ticket": _INT, **_COMMON_ORDER},
}

# Requests that need a login's terminal, and those that trade (may change the account).
LOGIN_OPS = {"login", "logout", "positions", "history", "account", "orders",
             "open", "close", "modify", "place", "amend", "cancel"}
TRADE_OPS = {"open", "close", "modify", "place", "amend", "cancel"}


def _fits(value, kind: str) -> bool:
    nullable = kind.endswith("?")
    kind = kind.rstrip("?")
    if value is None:
        return nullable
    if isinstance(value, bool):
        return False
    if kind == _NUMBER:
        return isinstance(value, (int, float))
    if kind == _INT:
        return isinstance(value, int)
    if kind == _STR:
        return isinstance(value, str)
    if kind == _SIDE:
        return value in ("buy", "sell")
    if kind == _KIND:
        return value in ("limit", "stop")
    return False


def parse(line: str) -> Request:
    """One request line, checked against its op's fields. Logins are strings on the wire; a
    number is taken as its digits (MT5 logins are numbers)."""
    try:
        frame = json.loads(line)
    except ValueError as e:
        raise Invalid(0, f"malformed request: {e}") from None
    if not isinstance(frame, dict):
        raise Invalid(0, "malformed request: not a JSON object")
    request_id = frame.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0:
        raise Invalid(0, "malformed request: `id` must be a non-negative integer")
    op = frame.get("op")
    if not isinstance(op, str):
        raise Invalid(request_id, "malformed request: `op` missing")
    if op == "fence":
        raise Invalid(request_id, "unknown op fence: this bridge keeps no fences "
                                  "(its hello lists no `fence` feature)")
    schema = SCHEMAS.get(op)
    if schema is None:
        raise Invalid(request_id, f"unknown op {op}")
    if isinstance(frame.get("login"), int) and not isinstance(frame.get("login"), bool):
        frame["login"] = str(frame["login"])
    fields = {}
    for key, kind in schema.items():
        optional = key.startswith("~")
        name = key.lstrip("~")
        if name not in frame:
            if optional:
                fields[name] = None
                continue
            raise Invalid(request_id, f"malformed request: {op} needs `{name}`")
        if not _fits(frame[name], kind):
            raise Invalid(request_id,
                          f"malformed request: `{name}` of {op} cannot be {frame[name]!r}")
        fields[name] = frame[name]
    return Request(request_id, op, fields)

