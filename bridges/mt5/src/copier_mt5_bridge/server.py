"""The bridge's TCP side: connections from nodes, each request routed to the worker of its
login's terminal, replies matched by `id` in whatever order the workers finish, and each
account's events pushed to every connection that logged it in.

The bridge keeps no fence and no client order ids: its `hello` lists no feature, a `fence`
request is answered `invalid`, and a repeated `client_order_id` is executed again (the node does
not rely on deduplication: after an unknown outcome it looks for the order's marker first).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import signal
import threading
from collections import defaultdict

from . import __version__, wire, worker
from .config import Config, Settings, Terminal
from .outcomes import Done, Outcome, Refused, Unknown

log = logging.getLogger(__name__)

SERVER_NAME = f"copier-mt5-bridge {__version__} (MetaTrader 5; no fence, no dedupe)"


class WorkerHandle:
    """The main process's end of one worker process."""

    def __init__(self, terminal: Terminal, settings: Settings, loop, on_event, log_level: str):
        self.terminal = terminal
        self.settings = settings
        self.loop = loop
        self.on_event = on_event
        self.log_level = log_level
        self.ctx = multiprocessing.get_context("spawn")
        self.seq = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.process = None

    def start(self) -> None:
        self.inbox = self.ctx.Queue()
        self.outbox = self.ctx.Queue()
        self.process = self.ctx.Process(
            target=worker.main, name=f"mt5-worker-{self.terminal.name}", daemon=True,
            args=(self.terminal, self.settings, self.inbox, self.outbox, self.log_level))
        self.process.start()
        outbox = self.outbox
        threading.Thread(target=self._pump, args=(outbox,), daemon=True,
                         name=f"pump-{self.terminal.name}").start()

    def _pump(self, outbox) -> None:
        """Hands the worker's messages to the event loop, in the order the worker sent them
        (so an order's events reach the connections before its reply)."""
        while True:
            message = outbox.get()
            if message is None:
                return
            try:
                self.loop.call_soon_threadsafe(self._deliver, message)
            except RuntimeError:  # the loop is closed: the bridge is stopping
                return

    def _deliver(self, message) -> None:
        if message[0] == "event":
            _, login, change = message
            self.on_event(login, change)
        elif message[0] == "reply":
            _, seq, outcome = message
            future = self.pending.pop(seq, None)
            if future is not None and not future.done():
                future.set_result(outcome)

    def call(self, op: str, fields: dict) -> asyncio.Future:
        seq = next(self.seq)
        future = self.loop.create_future()
        self.pending[seq] = future
        self.inbox.put((seq, op, fields))
        return future

    def check(self) -> bool:
        """Restarts a worker that died; True if it did. The requests it held have unknown
        outcomes (it may have sent any of them): they get no reply."""
        if self.process is None or self.process.is_alive():
            return False
        log.error("worker of terminal %s died (exit code %s); restarting it",
                  self.terminal.name, self.process.exitcode)
        for future in self.pending.values():
            if not future.done():
                future.set_result(Unknown("the terminal's worker died"))
        self.pending.clear()
        self.outbox.put(None)
        self.start()
        return True

    def stop(self, timeout: float = 5.0) -> None:
        if self.process is None:
            return
        self.inbox.put(None)
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        self.outbox.put(None)


class Connection:
    """One node's connection: its requests, replies and subscribed events."""

    def __init__(self, bridge: "Bridge", reader, writer):
        self.bridge = bridge
        self.reader = reader
        self.writer = writer
        self.peer = writer.get_extra_info("peername")
        self.client: str | None = None
        self.logins: list[str] = []
        self.lines: asyncio.Queue = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()
        self.closed = False

    def send(self, line: str | None) -> None:
        if not self.closed:
            self.lines.put_nowait(line)

    def abort(self) -> None:
        log.warning("closing the connection of %s (%s): its accounts' worker restarted",
                    self.client, self.peer)
        self.writer.transport.abort()

    async def _write(self) -> None:
        while True:
            line = await self.lines.get()
            if line is None:
                return
            chunk = [line]
            while not self.lines.empty():
                more = self.lines.get_nowait()
                if more is None:
                    self.lines.put_nowait(None)
                    break
                chunk.append(more)
            self.writer.write(("\n".join(chunk) + "\n").encode())
            try:
                await self.writer.drain()
            except ConnectionError:
                return

    async def run(self) -> None:
        writing = asyncio.create_task(self._write())
        try:
            while True:
                try:
                    line = await self.reader.readline()
                except ValueError:  # longer than the protocol's limit
                    self.send(wire.invalid(0, "request line too long"))
                    break
                except ConnectionError:
                    break
                if not line:
                    break
                text = line.decode("utf-8", errors="replace").strip()
                if text:
                    self.handle(text)
        finally:
            for login in self.logins:
                self.bridge.unsubscribe(login, self)
            self.send(None)
            # Requests still with a worker run to their end; their replies go nowhere.
            self.closed = True
            try:
                await asyncio.wait_for(writing, 5)
            except (asyncio.TimeoutError, ConnectionError):
                writing.cancel()
            self.writer.close()

    def handle(self, text: str) -> None:
        try:
            request = wire.parse(text)
        except wire.Invalid as e:
            self.send(wire.invalid(e.request_id, e.reason))
            return
        rid, op, fields = request.id, request.op, request.fields
        if op == "hello":
            if fields["protocol"] != wire.PROTOCOL_VERSION:
                self.send(wire.invalid(rid, f"unsupported protocol {fields['protocol']}; this "
                                            f"bridge speaks {wire.PROTOCOL_VERSION}"))
            elif not fields["client"].strip():
                self.send(wire.invalid(rid, "hello needs a client name"))
            else:
                self.client = fields["client"]
                self.send(wire.ok(rid, {"server": SERVER_NAME,
                                        "protocol": wire.PROTOCOL_VERSION, "features": []}))
            return
        if self.client is None:
            self.send(wire.invalid(rid, "send hello first"))
            return
        if op == "logout":
            self.bridge.unsubscribe(fields["login"], self)
            if fields["login"] in self.logins:
                self.logins.remove(fields["login"])
            self.send(wire.ok(rid, {}))
            return
        if op == "symbols":
            handle = self.bridge.symbols_worker(self.logins)
        else:
            handle = self.bridge.worker_of(fields["login"])
            if handle is None:
                self.send(wire.rejected(rid, wire.UNKNOWN_LOGIN,
                                        f"unknown login {fields['login']}: no terminal of this "
                                        "bridge serves it"))
                return
        task = asyncio.create_task(self.forward(request, handle))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def forward(self, request: wire.Request, handle: WorkerHandle) -> None:
        outcome: Outcome = await handle.call(request.op, request.fields)
        if isinstance(outcome, Done):
            if request.op == "login" and not self.closed:
                login = request.fields["login"]
                self.bridge.subscribe(login, self)
                if login not in self.logins:
                    self.logins.append(login)
            self.send(wire.ok(request.id, outcome.result))
        elif isinstance(outcome, Refused):
            self.send(outcome.frame(request.id))
        else:
            log.warning("%s %s (id %s, client %s): outcome unknown, no reply sent: %s",
                        request.fields.get("login"), request.op, request.id, self.client,
                        outcome.reason)


class Bridge:
    """The workers, the listening socket, and who hears which account's events."""

    def __init__(self, config: Config, log_level: str = "INFO"):
        self.config = config
        self.log_level = log_level
        self.workers: dict[str, WorkerHandle] = {}
        self.by_login: dict[str, WorkerHandle] = {}
        self.subscribers: dict[str, set[Connection]] = defaultdict(set)
        self.server = None
        self._supervisor = None

    async def start(self) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        for terminal in self.config.terminals:
            handle = WorkerHandle(terminal, self.config.settings, loop, self.publish,
                                  self.log_level)
            handle.start()
            self.workers[terminal.name] = handle
            for login in terminal.logins:
                self.by_login[login] = handle
        self.server = await asyncio.start_server(
            self._serve, self.config.host, self.config.port, limit=wire.MAX_LINE + 1)
        self._supervisor = asyncio.create_task(self._supervise())
        host, port = self.server.sockets[0].getsockname()[:2]
        return host, port

    async def _serve(self, reader, writer) -> None:
        await Connection(self, reader, writer).run()

    async def _supervise(self) -> None:
        """Restarts workers that died. The connections that had their accounts logged in are
        closed: the new worker knows none of what they were told, and a node that reconnects
        logs its accounts in again and reads them whole, as after any lost connection."""
        while True:
            await asyncio.sleep(0.5)
            for handle in self.workers.values():
                if handle.check():
                    for login in handle.terminal.logins:
                        for connection in list(self.subscribers.get(login, ())):
                            connection.abort()

    def worker_of(self, login: str) -> WorkerHandle | None:
        return self.by_login.get(login)

    def symbols_worker(self, logins: list[str]) -> WorkerHandle:
        """`symbols` names no login: the terminal of the connection's first login answers, or
        the first configured terminal (a bridge fronts one trade server, whose terminals list
        the same symbols)."""
        for login in logins:
            if login in self.by_login:
                return self.by_login[login]
        return self.workers[self.config.terminals[0].name]

    def subscribe(self, login: str, connection: Connection) -> None:
        self.subscribers[login].add(connection)

    def unsubscribe(self, login: str, connection: Connection) -> None:
        self.subscribers[login].discard(connection)

    def publish(self, login: str, change: dict) -> None:
        subscribers = self.subscribers.get(login)
        if subscribers:
            line = wire.event(login, change)
            for connection in subscribers:
                connection.send(line)

    async def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
        if self.server is not None:
            self.server.close()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, h.stop) for h in self.workers.values()))


async def run(config: Config, log_level: str) -> None:
    """Serves until SIGINT or SIGTERM (on Windows, until Ctrl+C), then stops the workers."""
    bridge = Bridge(config, log_level)
    try:
        host, port = await bridge.start()
        print(f"copier-mt5-bridge listening on {host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass  # Windows: Ctrl+C cancels the run instead
        await stop.wait()
    finally:
        await bridge.close()
