"""The tests' hand on the fake terminal: what the real package cannot do from Python.

`FakeTerminal(path)` creates a terminal installation at `path` (its state file beside it) and
then acts on it from outside the bridge: a person trading in the terminal's window (the "manual
trader", whose deals carry DEAL_REASON_CLIENT and no magic), the market moving, the terminal
disconnecting and coming back, AutoTrading switched off, and faults injected into the next
`order_send` calls (a retcode, or `None` as on an IPC timeout, with or without the server having
executed the request).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import _constants as c
from . import _terminal as _t

DEFAULT_SYMBOLS = {
    # name: (bid, spread in points, digits, contract size, base, profit currency)
    "EURUSD": (1.10000, 2, 5, 100000.0, "EUR", "USD"),
    "GBPUSD": (1.27000, 3, 5, 100000.0, "GBP", "USD"),
    "USDJPY": (150.000, 3, 3, 100000.0, "USD", "JPY"),
    "XAUUSD": (2000.00, 20, 2, 100.0, "XAU", "USD"),
}


def symbol_spec(name, bid, spread, digits, contract, base, quote, **over) -> dict:
    point = 10.0 ** -digits
    spec = {
        "name": name,
        "description": f"{base} vs {quote}",
        "path": f"Forex\\{name}",
        "select": True,
        "visible": True,
        "digits": digits,
        "spread": spread,
        "point": point,
        "bid": bid,
        "ask": round(bid + spread * point, digits),
        "trade_contract_size": contract,
        "trade_tick_size": point,
        "trade_mode": c.SYMBOL_TRADE_MODE_FULL,
        "trade_exemode": c.SYMBOL_TRADE_EXECUTION_INSTANT,
        "filling_mode": 1 | 2,  # SYMBOL_FILLING_FOK | SYMBOL_FILLING_IOC
        "expiration_mode": 1 | 2 | 4 | 8,  # GTC | DAY | SPECIFIED | SPECIFIED_DAY
        "volume_min": 0.01,
        "volume_max": 100.0,
        "volume_step": 0.01,
        "currency_base": base,
        "currency_profit": quote,
        "currency_margin": base,
        "market_open": True,
    }
    spec.update(over)
    return spec


class FakeTerminal:
    """One fake terminal installation: `path` is what the bridge's config names as the
    terminal's path (its `terminal64.exe`)."""

    def __init__(self, path):
        self.path = Path(path)

    # --- setting up ---------------------------------------------------------------------

    def create(self, accounts: dict, symbols: dict | None = None, utc_offset_ms: int = 0,
               active_login=None) -> "FakeTerminal":
        """Installs the terminal. `accounts`: login -> overrides of the account's defaults
        (password, server, balance, currency, leverage, margin_mode, password_saved)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("fake terminal64.exe\n")
        specs = symbols or {
            name: symbol_spec(name, *values) for name, values in DEFAULT_SYMBOLS.items()
        }
        state = {
            "connected": True,
            "epoch": 1,
            "autotrading": True,
            "utc_offset_ms": utc_offset_ms,
            "active_login": int(active_login) if active_login is not None else None,
            "next_ticket": 5000001,
            "next_deal": 9000001,
            "accounts": {
                str(login): {
                    "password": "secret",
                    "password_saved": True,
                    "server": "FakeMarkets-Demo",
                    "name": f"Account {login}",
                    "balance": 10000.0,
                    "currency": "USD",
                    "leverage": 100,
                    "margin_mode": c.ACCOUNT_MARGIN_MODE_RETAIL_HEDGING,
                    "positions": [],
                    "orders": [],
                    "deals": [],
                    "history_orders": [],
                    **overrides,
                }
                for login, overrides in accounts.items()
            },
            "symbols": specs,
            "faults": {"retcodes": [], "send_none": [], "ipc_timeouts": 0, "send_delay_s": 0.0},
            "stats": {"order_send": 0},
        }
        _t.state_file(self.path).write_text(json.dumps(state))
        return self

    def reset(self) -> None:
        """Back to a calm terminal: the default prices, markets open, AutoTrading on, no
        faults left (accounts and their books are kept)."""
        with self._edit() as state:
            for name, values in DEFAULT_SYMBOLS.items():
                state["symbols"][name] = symbol_spec(name, *values)
            state["autotrading"] = True
            state["utc_offset_ms"] = 0
            state["faults"].update(retcodes=[], send_none=[], ipc_timeouts=0, send_delay_s=0.0)

    def _edit(self):
        return _t.opened(self.path)

    def read(self) -> dict:
        with self._edit() as state:
            _t.settle(state)
            return json.loads(json.dumps(state))

    # --- the terminal and its link --------------------------------------------------------

    def disconnect(self) -> None:
        """The terminal goes away (closed, crashed, lost): every call over IPC fails."""
        with self._edit() as state:
            state["connected"] = False

    def reconnect(self) -> None:
        """The terminal is back, as a new process: clients must `initialize` again."""
        with self._edit() as state:
            state["connected"] = True
            state["epoch"] += 1

    def ipc_timeouts(self, count: int) -> None:
        """The next `count` calls of any client time out on the IPC link."""
        with self._edit() as state:
            state["faults"]["ipc_timeouts"] = count

    def set_autotrading(self, enabled: bool) -> None:
        """The terminal's AutoTrading button: off, every order_send gets 10027."""
        with self._edit() as state:
            state["autotrading"] = enabled

    def active_login(self):
        with self._edit() as state:
            return state["active_login"]

    # --- faults on order_send ------------------------------------------------------------

    def inject_retcode(self, retcode: int, count: int = 1, action: int | None = None,
                       execute: bool = False) -> None:
        """The next `count` order_send calls (of `action`, or any) get `retcode`. Unless
        `execute`, the server changed nothing; 10010 (partial) fills half the volume."""
        with self._edit() as state:
            state["faults"]["retcodes"].append(
                {"retcode": retcode, "count": count, "action": action, "execute": execute})

    def lose_order_send(self, count: int = 1, execute: bool = True,
                        action: int | None = None) -> None:
        """The next `count` order_send calls return None (IPC timeout); with `execute`, the
        server carried the request out all the same."""
        with self._edit() as state:
            state["faults"]["send_none"].append(
                {"count": count, "execute": execute, "action": action})

    def slow_order_send(self, seconds: float) -> None:
        """Every order_send takes `seconds` (a slow trade server)."""
        with self._edit() as state:
            state["faults"]["send_delay_s"] = seconds

    def order_send_count(self) -> int:
        """How many trade requests reached the terminal (to show nothing was retried)."""
        with self._edit() as state:
            return state["stats"]["order_send"]

    def last_request(self) -> dict | None:
        """The last trade request that reached the terminal, as sent."""
        with self._edit() as state:
            return state["stats"].get("last_request")

    # --- the market ----------------------------------------------------------------------

    def set_price(self, symbol: str, bid: float, ask: float | None = None) -> None:
        """Moves the market: pending orders and stops it reaches are triggered at once."""
        with self._edit() as state:
            sym = state["symbols"][symbol]
            sym["bid"] = bid
            sym["ask"] = ask if ask is not None else round(bid + sym["spread"] * sym["point"],
                                                           sym["digits"])
            _t.settle(state)

    def set_market_open(self, symbol: str, open_: bool) -> None:
        with self._edit() as state:
            state["symbols"][symbol]["market_open"] = open_

    def set_account(self, login, **fields) -> None:
        with self._edit() as state:
            state["accounts"][str(login)].update(fields)

    # --- the manual trader (a person in the terminal's window) ---------------------------

    def manual_open(self, login, symbol: str, side: str, volume: float, sl: float = 0.0,
                    tp: float = 0.0, comment: str = "") -> int:
        with self._edit() as state:
            acct = state["accounts"][str(login)]
            sym = state["symbols"][symbol]
            buy = side == "buy"
            position, _ = _t.open_position(
                state, acct, symbol=symbol, buy=buy, volume=volume,
                price=_t.open_price(sym, buy), sl=sl, tp=tp, magic=0, comment=comment,
                reason=c.DEAL_REASON_CLIENT)
            return position["ticket"]

    def manual_close(self, login, ticket: int, volume: float | None = None) -> None:
        with self._edit() as state:
            acct = state["accounts"][str(login)]
            position = next(p for p in acct["positions"] if p["ticket"] == ticket)
            sym = state["symbols"][position["symbol"]]
            _t.close_part(state, acct, position, volume or position["volume"],
                          _t.close_price(sym, position["type"]), reason=c.DEAL_REASON_CLIENT,
                          magic=0, comment="")

    def manual_modify(self, login, ticket: int, sl: float = 0.0, tp: float = 0.0) -> None:
        with self._edit() as state:
            acct = state["accounts"][str(login)]
            position = next(p for p in acct["positions"] if p["ticket"] == ticket)
            position.update(sl=sl, tp=tp)

    def manual_place(self, login, symbol: str, order_type: int, price: float, volume: float,
                     sl: float = 0.0, tp: float = 0.0, comment: str = "") -> int:
        with self._edit() as state:
            acct = state["accounts"][str(login)]
            result = _t.pending_request(state, acct, {
                "symbol": symbol, "type": order_type, "price": price, "volume": volume,
                "sl": sl, "tp": tp, "comment": comment, "magic": 0})
            order = next(o for o in acct["orders"] if o["ticket"] == result["order"])
            order["reason"] = c.ORDER_REASON_CLIENT
            return order["ticket"]

    def manual_amend(self, login, ticket: int, price: float) -> None:
        with self._edit() as state:
            acct = state["accounts"][str(login)]
            order = next(o for o in acct["orders"] if o["ticket"] == ticket)
            order["price_open"] = price

    def manual_cancel(self, login, ticket: int) -> None:
        with self._edit() as state:
            acct = state["accounts"][str(login)]
            order = next(o for o in acct["orders"] if o["ticket"] == ticket)
            _t.retire_order(state, acct, order, c.ORDER_STATE_CANCELED)

    # --- reading the terminal's books directly -------------------------------------------

    def positions(self, login) -> list[dict]:
        return self.read()["accounts"][str(login)]["positions"]

    def orders(self, login) -> list[dict]:
        return self.read()["accounts"][str(login)]["orders"]

    def deals(self, login) -> list[dict]:
        return self.read()["accounts"][str(login)]["deals"]
