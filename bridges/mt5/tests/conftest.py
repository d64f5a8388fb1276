"""Runs the bridge as operators do (`python -m copier_mt5_bridge --config ...`, a separate
process with one worker process per terminal) against fake terminals, with the fake
`MetaTrader5` module first on its path, and talks to it with the tests' own protocol client."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake"
SRC = HERE.parent / "src"

sys.path.insert(0, str(HERE))
sys.path.insert(0, str(FAKE))

from MetaTrader5.control import FakeTerminal  # noqa: E402
from protocol_client import ProtocolClient  # noqa: E402

# The installed package is what is tested; a checkout without it installed runs its source.
_PYTHONPATH = [str(FAKE)]
if importlib.util.find_spec("copier_mt5_bridge") is None:
    _PYTHONPATH.append(str(SRC))
    sys.path.append(str(SRC))

LOGIN = "50112"
PASSWORD = "secret"


class BridgeProcess:
    """A running bridge, its fake terminals, and clients connected to it."""

    def __init__(self, workdir: Path, terminals: dict[str, FakeTerminal],
                 logins: dict[str, list[str]], settings: dict):
        self.workdir = workdir
        self.terminals = terminals
        self.config = workdir / "bridge.toml"
        lines = ['listen = "127.0.0.1:0"']
        for key, value in settings.items():
            lines.append(f"{key} = {value!r}".replace("True", "true").replace("False", "false"))
        for name, fake in terminals.items():
            lines += ["", "[[terminal]]", f'name = "{name}"', f"path = '{fake.path}'",
                      f"logins = {[int(x) for x in logins[name]]}"]
        self.config.write_text("\n".join(lines) + "\n")
        self.log = workdir / "bridge.log"
        self.process = None
        self.clients: list[ProtocolClient] = []
        self.address = None

    def start(self) -> "BridgeProcess":
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(_PYTHONPATH + [env.get("PYTHONPATH", "")])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "copier_mt5_bridge", "--config", str(self.config),
             "--log-level", "DEBUG"],
            stdout=subprocess.PIPE, stderr=open(self.log, "wb"), env=env, cwd=self.workdir)
        line = []

        def first_line():
            line.append(self.process.stdout.readline().decode())

        reader = threading.Thread(target=first_line, daemon=True)
        reader.start()
        reader.join(20)
        if not line or "listening on" not in line[0]:
            self.stop()
            raise RuntimeError(f"the bridge did not start: {line}\n{self.log.read_text()}")
        host, port = line[0].rsplit(" ", 1)[1].strip().rsplit(":", 1)
        self.address = (host, int(port))
        return self

    def client(self, name: str = "node-test", hello: bool = True) -> ProtocolClient:
        client = ProtocolClient(*self.address)
        self.clients.append(client)
        if hello:
            client.hello(name)
        return client

    def session(self, login: str = LOGIN, password: str | None = PASSWORD) -> ProtocolClient:
        """A client that said hello and logged `login` in."""
        client = self.client()
        client.login(login, password)
        return client

    def workers(self) -> list[int]:
        """The process ids of the bridge's worker processes (Linux: from /proc)."""
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.process.pid and "spawn" in _cmdline(stat.parent):
                children.append(int(stat.parent.name))
        return children

    def fake(self, name: str = "t1") -> FakeTerminal:
        return self.terminals[name]

    def stop(self, wait: bool = True) -> None:
        """Stops the bridge as a service manager does (SIGTERM: it stops its workers and
        exits). Without `wait`, the exit is waited for at the end of the session."""
        for client in self.clients:
            client.close()
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
        if wait:
            self.reap()
        else:
            _STOPPING.append(self)

    def reap(self) -> int:
        try:
            code = self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()
        return code


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


_STOPPING: list[BridgeProcess] = []


@pytest.fixture(scope="session", autouse=True)
def _reap_bridges():
    """Bridges stopped without waiting (so that tests do not wait for each one's shutdown)
    must all have exited by the end of the session."""
    yield
    for bridge in _STOPPING:
        bridge.reap()


def start_bridge(workdir: Path, terminals: dict | None = None, **settings) -> BridgeProcess:
    """Starts a bridge over fake terminals: `terminals` maps a terminal's name to its accounts
    (login -> overrides of the fake account); each terminal starts on its first account."""
    terminals = terminals or {"t1": {LOGIN: {}}}
    settings = {"poll_ms": 50, "reconnect_ms": 100, **settings}
    workdir.mkdir(parents=True)
    fakes, logins = {}, {}
    for name, accounts in terminals.items():
        accounts = {str(k): v for k, v in accounts.items()}
        fakes[name] = FakeTerminal(workdir / name / "terminal64.exe").create(
            accounts, active_login=next(iter(accounts)))
        logins[name] = list(accounts)
    return BridgeProcess(workdir, fakes, logins, settings).start()


@pytest.fixture
def make_bridge(tmp_path):
    """`start_bridge` for one test: each bridge in its own folder, stopped afterwards."""
    started = []

    def make(terminals: dict | None = None, **settings) -> BridgeProcess:
        bridge = start_bridge(tmp_path / f"bridge{len(started) + 1}", terminals, **settings)
        started.append(bridge)
        return bridge

    yield make
    for bridge in started:
        bridge.stop(wait=False)


@pytest.fixture
def bridge(make_bridge) -> BridgeProcess:
    return make_bridge()


@pytest.fixture
def node(bridge) -> ProtocolClient:
    """A node's connection with the default account logged in."""
    return bridge.session()


POOL = 60


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> BridgeProcess:
    """One bridge for a module's tests, its terminal holding an account for each test (a
    terminal switches accounts on request): starting a bridge per test costs more than the
    tests themselves."""
    logins = {str(70001 + i): {} for i in range(POOL)}
    bridge = start_bridge(tmp_path_factory.mktemp("shared") / "bridge", {"t1": logins})
    bridge.pool = iter(logins)
    yield bridge
    bridge.stop(wait=False)


@dataclass
class Account:
    """One test's own account on the module's shared bridge, logged in by a node."""

    bridge: BridgeProcess
    login: str
    client: ProtocolClient
    sends_before: int

    @property
    def fake(self) -> FakeTerminal:
        return self.bridge.fake()

    def sends(self) -> int:
        """Trade requests that reached the terminal during this test."""
        return self.fake.order_send_count() - self.sends_before


@pytest.fixture
def acct(shared) -> Account:
    shared.fake().reset()
    login = next(shared.pool)
    client = shared.session(login)
    yield Account(shared, login, client, shared.fake().order_send_count())
    client.close()
