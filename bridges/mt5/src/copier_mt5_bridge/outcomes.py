"""What a worker makes of a request: executed, refused, or unknown.

The three are kept apart all the way to the wire because the node acts on them differently: a
refusal changed nothing, while an unknown outcome (a trade request whose answer was lost) has to
be resolved from the account itself before anything else is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import wire


@dataclass(frozen=True)
class Done:
    result: object


@dataclass(frozen=True)
class Refused:
    code: str
    reason: str
    kind: str = "rejected"

    def frame(self, request_id: int) -> str:
        if self.kind == "invalid":
            return wire.invalid(request_id, self.reason)
        return wire.rejected(request_id, self.code, self.reason)


@dataclass(frozen=True)
class Unknown:
    """Sent, answer lost: the bridge sends no reply, which the node's client reads as an
    unknown outcome when its request times out."""

    reason: str


Outcome = Done | Refused | Unknown
