"""A minimal client of the bridge protocol, written for the tests from the protocol document
(not from the bridge's code): JSON lines over TCP, replies matched by id, events kept apart, and
every frame kept in arrival order so tests can check what came before what."""

from __future__ import annotations

import itertools
import json
import socket
import threading
import time


class ProtocolClient:
    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.sock.settimeout(None)
        self.ids = itertools.count(1)
        self.frames: list[dict] = []
        self.replies: dict[int, dict] = {}
        self.events: list[dict] = []
        self.closed = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self.sock.makefile("rb") as stream:
            for raw in stream:
                frame = json.loads(raw)
                with self.cond:
                    self.frames.append(frame)
                    if "event" in frame:
                        self.events.append(frame)
                    else:
                        self.replies[frame["id"]] = frame
                    self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    # --- sending -------------------------------------------------------------------------

    def send_raw(self, text: str) -> None:
        self.sock.sendall(text.encode() + b"\n")

    def send(self, op: str, **fields) -> int:
        request_id = next(self.ids)
        self.send_raw(json.dumps({"id": request_id, "op": op, **fields}))
        return request_id

    # --- waiting -------------------------------------------------------------------------

    def _wait(self, predicate, timeout: float):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = predicate()
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self.cond.wait(left)

    def reply(self, request_id: int, timeout: float = 10.0) -> dict:
        frame = self._wait(lambda: self.replies.get(request_id), timeout)
        if frame is None:
            raise TimeoutError(f"no reply to request {request_id} within {timeout}s")
        return frame

    def no_reply(self, request_id: int, within: float) -> bool:
        """True when request `request_id` got no reply within `within` seconds: the protocol's
        unknown outcome (the node's client reads it so when its request times out)."""
        return self._wait(lambda: self.replies.get(request_id), within) is None

    def unanswered(self, request_id: int, login: str) -> bool:
        """True when request `request_id` will get no reply: a later request for the same login
        (so for the same terminal's worker, which answers in order) has been answered first."""
        self.reply(self.send("positions", login=login))
        with self.cond:
            return request_id not in self.replies

    def call(self, op: str, timeout: float = 10.0, **fields) -> dict:
        return self.reply(self.send(op, **fields), timeout)

    def result(self, op: str, **fields):
        frame = self.call(op, **fields)
        assert frame["ok"] is True, frame
        return frame["result"]

    def error(self, op: str, **fields) -> dict:
        frame = self.call(op, **fields)
        assert frame["ok"] is False, frame
        return frame["error"]

    def event(self, predicate, timeout: float = 10.0) -> dict:
        """The first event (in arrival order) matching `predicate`."""
        found = self._wait(lambda: next((e for e in self.events if predicate(e)), None), timeout)
        if found is None:
            raise TimeoutError(f"no matching event within {timeout}s; events: {self.events}")
        return found

    def change(self, change: str, ticket: int | None = None, timeout: float = 10.0) -> dict:
        def match(e):
            if e["change"] != change:
                return False
            if ticket is None:
                return True
            if change == "order_gone":
                return e["ticket"] == ticket
            body = e.get("position") or e.get("closed") or e.get("order")
            return body.get("ticket") == ticket
        return self.event(match, timeout)

    # --- the protocol's first steps ------------------------------------------------------

    def hello(self, client: str = "node-test") -> dict:
        return self.result("hello", client=client, protocol=1)

    def login(self, login: str, password: str | None = None, fence=None) -> dict:
        fields = {"login": login, "fence": fence}
        if password is not None:
            fields["password"] = password
        return self.result("login", **fields)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
