"""What each trade server return code of `order_send` means to the node.

MetaQuotes' table of return codes (MqlTradeResult.retcode) is written out here, one line per
code, with the protocol outcome each maps to:

* `SUCCESS`: executed (10008 placed, 10009 done, 10010 done in part, with the filled volume);
* `UNKNOWN`: the request may or may not have been executed (10012 timeout, and any code not in
  MetaQuotes' table): the bridge sends no reply, which the node reads as an unknown outcome and
  resolves by the order's marker, as after a lost connection;
* a refusal code of the protocol: the server refused the request and changed nothing.
  `requote` and `market_closed` are the protocol's "refused now, may succeed later" codes; the
  bridge uses them for every refusal that is about the moment rather than the request (a price
  that moved, too many requests, no connection to the trade server), so the node retries those
  and gives up on the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import wire

SUCCESS = "success"
UNKNOWN = "unknown"


@dataclass(frozen=True)
class Retcode:
    code: int
    name: str
    meaning: str
    outcome: str  # SUCCESS, UNKNOWN, or a protocol refusal code

    def reason(self, detail: str = "") -> str:
        """The refusal's reason for people: MetaQuotes' meaning, the code and its name."""
        extra = f": {detail}" if detail else ""
        return f"{self.meaning} ({self.code} {self.name}){extra}"


_TABLE = [
    # code, name, MetaQuotes' meaning, outcome
    (10004, "TRADE_RETCODE_REQUOTE", "requote", wire.REQUOTE),
    (10006, "TRADE_RETCODE_REJECT", "request rejected", wire.REJECTED),
    (10007, "TRADE_RETCODE_CANCEL", "request canceled by trader", wire.REJECTED),
    (10008, "TRADE_RETCODE_PLACED", "order placed", SUCCESS),
    (10009, "TRADE_RETCODE_DONE", "request completed", SUCCESS),
    (10010, "TRADE_RETCODE_DONE_PARTIAL", "only part of the request was completed", SUCCESS),
    (10011, "TRADE_RETCODE_ERROR", "request processing error", wire.REJECTED),
    (10012, "TRADE_RETCODE_TIMEOUT", "request canceled by timeout", UNKNOWN),
    (10013, "TRADE_RETCODE_INVALID", "invalid request", wire.REJECTED),
    (10014, "TRADE_RETCODE_INVALID_VOLUME", "invalid volume in the request", wire.INVALID_VOLUME),
    (10015, "TRADE_RETCODE_INVALID_PRICE", "invalid price in the request", wire.REJECTED),
    (10016, "TRADE_RETCODE_INVALID_STOPS", "invalid stops in the request", wire.INVALID_STOPS),
    (10017, "TRADE_RETCODE_TRADE_DISABLED", "trade is disabled", wire.REJECTED),
    (10018, "TRADE_RETCODE_MARKET_CLOSED", "market is closed", wire.MARKET_CLOSED),
    (10019, "TRADE_RETCODE_NO_MONEY", "not enough money to complete the request", wire.NO_MONEY),
    (10020, "TRADE_RETCODE_PRICE_CHANGED", "prices changed", wire.REQUOTE),
    (10021, "TRADE_RETCODE_PRICE_OFF", "there are no quotes to process the request",
     wire.MARKET_CLOSED),
    (10022, "TRADE_RETCODE_INVALID_EXPIRATION", "invalid order expiration date in the request",
     wire.REJECTED),
    (10023, "TRADE_RETCODE_ORDER_CHANGED", "order state changed", wire.REJECTED),
    (10024, "TRADE_RETCODE_TOO_MANY_REQUESTS", "too frequent requests", wire.REQUOTE),
    (10025, "TRADE_RETCODE_NO_CHANGES", "no changes in request", wire.REJECTED),
    (10026, "TRADE_RETCODE_SERVER_DISABLES_AT", "autotrading disabled by server", wire.REJECTED),
    (10027, "TRADE_RETCODE_CLIENT_DISABLES_AT", "autotrading disabled by client terminal",
     wire.REJECTED),
    (10028, "TRADE_RETCODE_LOCKED", "request locked for processing", wire.REQUOTE),
    (10029, "TRADE_RETCODE_FROZEN", "order or position frozen", wire.REJECTED),
    (10030, "TRADE_RETCODE_INVALID_FILL", "invalid order filling type", wire.REJECTED),
    (10031, "TRADE_RETCODE_CONNECTION", "no connection with the trade server",
     wire.MARKET_CLOSED),
    (10032, "TRADE_RETCODE_ONLY_REAL", "operation is allowed only for live accounts",
     wire.REJECTED),
    (10033, "TRADE_RETCODE_LIMIT_ORDERS", "the number of pending orders has reached the limit",
     wire.REJECTED),
    (10034, "TRADE_RETCODE_LIMIT_VOLUME",
     "the volume of orders and positions for the symbol has reached the limit", wire.REJECTED),
    (10035, "TRADE_RETCODE_INVALID_ORDER", "incorrect or prohibited order type", wire.REJECTED),
    (10036, "TRADE_RETCODE_POSITION_CLOSED", "position with the specified identifier has "
     "already been closed", wire.UNKNOWN_TICKET),
    (10038, "TRADE_RETCODE_INVALID_CLOSE_VOLUME", "a close volume exceeds the current position "
     "volume", wire.INVALID_VOLUME),
    (10039, "TRADE_RETCODE_CLOSE_ORDER_EXIST", "a close order already exists for the position",
     wire.REJECTED),
    (10040, "TRADE_RETCODE_LIMIT_POSITIONS", "the number of open positions has reached the "
     "limit", wire.REJECTED),
    (10041, "TRADE_RETCODE_REJECT_CANCEL", "the pending order activation request is rejected, "
     "the order is canceled", wire.REJECTED),
    (10042, "TRADE_RETCODE_LONG_ONLY", "only long positions are allowed for the symbol",
     wire.REJECTED),
    (10043, "TRADE_RETCODE_SHORT_ONLY", "only short positions are allowed for the symbol",
     wire.REJECTED),
    (10044, "TRADE_RETCODE_CLOSE_ONLY", "only position closing is allowed for the symbol",
     wire.REJECTED),
    (10045, "TRADE_RETCODE_FIFO_CLOSE", "position closing is allowed only by FIFO rule",
     wire.REJECTED),
    (10046, "TRADE_RETCODE_HEDGE_PROHIBITED", "opposite positions on a single symbol are "
     "disabled", wire.REJECTED),
]

TABLE: dict[int, Retcode] = {code: Retcode(code, *rest) for code, *rest in _TABLE}

DONE_PARTIAL = 10010
NO_CHANGES = 10025


def classify(code: int) -> Retcode:
    """The entry for `code`; a code missing from MetaQuotes' table is an unknown outcome (it
    could be a success this bridge does not know of)."""
    return TABLE.get(code) or Retcode(code, "unlisted", "return code not in MetaQuotes' table",
                                      UNKNOWN)
