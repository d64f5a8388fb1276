"""The bridge's configuration file (TOML): where it listens, how often it polls, and which
terminal serves which login.

One terminal (one installation, one `terminal64.exe`) is logged in to one account at a time,
and the `MetaTrader5` package talks to one terminal per process, so each terminal gets a worker
process and each login belongs to exactly one terminal. Checked at start, so that a mistake shows
before any order does.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """The configuration file is not usable; the message says where."""


@dataclass(frozen=True)
class Terminal:
    """One MetaTrader 5 terminal installation and the logins it serves."""

    name: str
    path: str
    logins: tuple[str, ...]
    # The trade server's name, as the terminal's login dialog shows it (for `login` calls when
    # the terminal has to switch accounts; absent: the terminal's current server).
    server: str | None = None
    # Start the terminal in portable mode (its data in its own folder): one installation per
    # account keeps accounts apart.
    portable: bool = False


@dataclass(frozen=True)
class Settings:
    """What every worker needs besides its terminal."""

    poll_ms: int = 250
    # How far back `history` reads deals (0: everything the terminal holds).
    history_days: int = 90
    # Slippage allowed, in points, on orders that carry no `price_limit`.
    deviation_points: int = 20
    # Serve netting accounts (one position per symbol). Off: their logins are refused, since
    # the node assumes hedging and copies could not be told apart by marker.
    allow_netting: bool = False
    # MT5 group filter for the `symbols` answer (e.g. "*,!*.ecn"); absent: every symbol.
    symbols_group: str | None = None
    # How often a worker tries to reach a terminal that is down.
    reconnect_ms: int = 2000


@dataclass(frozen=True)
class Config:
    host: str
    port: int
    settings: Settings
    terminals: tuple[Terminal, ...] = field(default_factory=tuple)

    def terminal_of(self, login: str) -> Terminal | None:
        for terminal in self.terminals:
            if login in terminal.logins:
                return terminal
        return None


def load(path: str | Path) -> Config:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from e
    return parse(data)


def _int(data: dict, key: str, default: int, minimum: int) -> int:
    value = data.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"`{key}` must be an integer of at least {minimum}, not {value!r}")
    return value


def _listen(text) -> tuple[str, int]:
    if not isinstance(text, str) or ":" not in text:
        raise ConfigError(f"`listen` must be \"host:port\", not {text!r}")
    host, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"`listen` port must be a number, not {port!r}") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"`listen` port {number} is out of range")
    return host.strip("[]") or "127.0.0.1", number


def _terminal(index: int, entry) -> Terminal:
    where = f"terminal #{index + 1}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be a table")
    path = entry.get("path")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where} needs a `path` (its terminal64.exe)")
    logins = entry.get("logins")
    if not isinstance(logins, list) or not logins:
        raise ConfigError(f"{where} needs `logins`, a non-empty list")
    for login in logins:
        if isinstance(login, bool) or not isinstance(login, (int, str)) or not str(login).isdigit():
            raise ConfigError(f"{where}: login {login!r} is not an MT5 account number")
    server = entry.get("server")
    if server is not None and not isinstance(server, str):
        raise ConfigError(f"{where}: `server` must be a string")
    return Terminal(
        name=str(entry.get("name") or f"terminal-{index + 1}"),
        path=path,
        logins=tuple(str(login) for login in logins),
        server=server,
        portable=bool(entry.get("portable", False)),
    )


def parse(data: dict) -> Config:
    host, port = _listen(data.get("listen", "127.0.0.1:7010"))
    group = data.get("symbols_group")
    if group is not None and not isinstance(group, str):
        raise ConfigError("`symbols_group` must be a string")
    settings = Settings(
        poll_ms=_int(data, "poll_ms", 250, 10),
        history_days=_int(data, "history_days", 90, 0),
        deviation_points=_int(data, "deviation_points", 20, 0),
        allow_netting=bool(data.get("allow_netting", False)),
        symbols_group=group,
        reconnect_ms=_int(data, "reconnect_ms", 2000, 10),
    )
    entries = data.get("terminal", [])
    if not isinstance(entries, list) or not entries:
        raise ConfigError("at least one [[terminal]] is needed")
    terminals = tuple(_terminal(i, e) for i, e in enumerate(entries))
    seen: dict[str, str] = {}
    for terminal in terminals:
        for login in terminal.logins:
            if login in seen:
                raise ConfigError(
                    f"login {login} is listed by both {seen[login]} and {terminal.name}: "
                    "each login belongs to one terminal")
            seen[login] = terminal.name
    names = [t.name for t in terminals]
    if len(set(names)) != len(names):
        raise ConfigError("terminal names must differ")
    return Config(host=host, port=port, settings=settings, terminals=terminals)
